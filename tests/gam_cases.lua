-- tests/gam_cases.lua: inputs and the comparison shared by the GAM kernels' tests (test_gam_fast.lua:
-- the fast CPU kernel; test_cuda_gam.lua: the CUDA kernel), both against the scalar reference
-- (kernels/cpu/ref/gam_ref.c, run through core.gam_quantize under nv.use_reference(true) on a
-- CPU copy; the reference itself is checked against an independent implementation in
-- tests/c/test_gam_ref.c). The inputs are test_gam_ref.c's: its hand-worked tensor, its NaN / inf
-- tensor, the exponent edges as block maxima, tensors from its random generator (splitmix64 here too,
-- so fixed seeds, never the clock), plus tensors large enough for the kernels' parallel paths.
-- Expected: every code, E8M0 byte and group mantissa equal, bit for bit (tolerance 0), and the same
-- non-finite flag.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local M = {}
local nan, inf = 0 / 0, math.huge

M.hand = {3.0, -1.0, 0.5, 2.25, 1.59, 1.0, -0.5, 0.0, 2.0, 1.5, -2.0, 0.25,
          0.75, 0.5, -0.25, 0.125, 0.0, -0.0, 0.0, 0.0, 0x1p-140, -0x1p-141, 0x1p-149, 0.0}
M.nonfinite = {3.0, nan, -1.0, 0.5, -nan, 0.0, 0.0, 0.0, 1.0, inf, -2.0, 0.25, 2.0, -inf, 0.5, 1e30}

-- a flat Lua list as an f32 tensor (rows, K)
function M.tensor(list, rows, K)
  local t = {}
  for r = 1, rows do
    local row = {}
    for k = 1, K do row[k] = list[(r - 1) * K + k] end
    t[r] = row
  end
  return nv.tensor(t, "f32")
end

-- test_gam_ref.c gam_exponent_edges: groups of two blocks of 4, block 1 setting the group's max
-- (so m_g), block 2's max an edge value (the E8M0 top, where qmax / bamax overflows, subnormal maxima,
-- FLT_MAX, zero, inf)
function M.edges()
  local flt_max = 0x1.fffffep127
  local e = {0x1.cp-119, 0x1.cp-120, 0x1p-149, 0x1.8p-130, flt_max, 0.0, inf, 0x1.8p-140}
  local g = {0x1.cp-119, 1.5 * 0x1p-119, 0x1p-149, 1.9 * 0x1p-129, flt_max, 1.3, inf, 3.0}
  local l = {}
  for i = 1, #e do
    for k = 1, #g do
      local gm = math.max(g[k], e[i])
      for _, v in ipairs({gm, -gm * 0.5, 0.0, gm * 0.25, e[i], -e[i] * 0.75, 0.0, e[i] * 0.5}) do l[#l + 1] = v end
    end
  end
  return l
end

-- splitmix64 and test_gam_ref.c's rnd / random tensor
local function rng_new(seed)
  local s = seed
  return function()
    s = s + 0x9E3779B97F4A7C15
    local z = s
    z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ~ (z >> 27)) * 0x94D049BB133111EB
    return z ~ (z >> 31)
  end
end
local function umod(a, m) -- a (a uint64 in a Lua integer) mod m, m > 0 small
  local q = ((a >> 1) // m) << 1
  local r = a - q * m
  while math.ult(m - 1, r) do r = r - m end
  return r
end

-- +-(1 + u) 2^e, u a 23-bit fraction, e in [lo, hi] (rounded to f32 when stored: subnormals rounded)
local function rnd(rng, lo, hi)
  local r = rng()
  local v = (1.0 + (r & 0x7FFFFF) / 0x1p23) * 2.0 ^ (lo + umod(r >> 24, hi - lo + 1))
  return (r >> 63) ~= 0 and -v or v
end

-- x (nb blocks of B) per test_gam_ref.c: blocks of zeros, subnormals, wide or narrow ranges, and per
-- group one block whose max is the group max times a power of two (m_b == m_g); values rounded to f32
-- before the group max is looked for
function M.random(seed, nb, B, G)
  local rng = rng_new(seed)
  local x = {}
  local function f32(v) return string.unpack("f", string.pack("f", v)) end
  for b = 0, nb - 1 do
    local kind, lo = umod(rng(), 8), -20 + umod(rng(), 30)
    for j = 1, B do
      local v
      if kind == 0 then v = 0.0
      elseif kind == 1 then v = rnd(rng, -149, -118)
      elseif kind == 2 then v = rnd(rng, -60, 60)
      else v = rnd(rng, lo, lo + 6) end
      x[b * B + j] = f32(v)
    end
  end
  local gsz = G == "tensor" and nb or G
  for g0 = 0, nb - 1, gsz do
    local im = g0 * B + 1
    for i = g0 * B + 1, (g0 + gsz) * B do if math.abs(x[i]) > math.abs(x[im]) then im = i end end
    local b = g0 + umod(rng(), gsz)
    local v = math.abs(x[im]) * 2.0 ^ -umod(rng(), 5)
    v = f32(v)
    for j = 1, B do
      local i = b * B + j
      x[i] = math.min(math.abs(x[i]), v) * ((j - 1) & 1 == 1 and -1.0 or 1.0)
    end
    x[b * B + 1] = v
  end
  return x
end

-- The cases: {name, list, rows, K, block, group}
function M.cases(large)
  local c = {
    {"hand, one group", M.hand, 1, 24, 4, "tensor"},
    {"hand, groups of 3", M.hand, 2, 12, 4, 3},
    {"hand, groups of 1", M.hand, 6, 4, 4, 1},
    {"NaN and inf, groups of 2", M.nonfinite, 2, 8, 4, 2},
    {"NaN and inf, one group", M.nonfinite, 2, 8, 4, "tensor"},
    {"NaN and inf, one block of 16", M.nonfinite, 1, 16, 16, "tensor"},
  }
  local e = M.edges()
  c[#c + 1] = {"exponent edges, groups of 2", e, #e // 8, 8, 4, 2}
  c[#c + 1] = {"exponent edges, one group", e, 1, #e, 4, "tensor"}
  local Bs = {16, 32, 128, 24, 8}
  for t = 0, 29 do
    local B = Bs[t % #Bs + 1]
    local R, K = 4, B * (1 + t % 4)
    local nb = R * (K // B)
    local G = ({1, 2, 4, "tensor"})[t // 5 % 4 + 1]
    if G ~= "tensor" and nb % G ~= 0 then G = "tensor" end
    c[#c + 1] = {("random %d: [%d,%d] B=%d G=%s"):format(t, R, K, B, G), M.random(2026 + t, nb, B, G), R, K, B, G}
  end
  if large then
    for i, spec in ipairs({{32, "tensor"}, {24, 4}, {128, 96}, {64, 1}}) do
      local B, G, R, K = spec[1], spec[2], 96, 1536
      local l = M.random(34 + i, R * K // B, B, G)
      if i == 2 then l[R * K // 2 + 5] = nan end
      c[#c + 1] = {("large %d: [%d,%d] B=%d G=%s"):format(i, R, K, B, G), l, R, K, B, G}
    end
  end
  return c
end

-- got and want (any devices) hold the same values, bit for bit (no NaN can occur in these outputs)
local function flat(t)
  local l = {}
  local function walk(v) if type(v) == "table" then for _, w in ipairs(v) do walk(w) end else l[#l + 1] = v end end
  walk((t:device() == "cpu" and t or t:cpu()):totable())
  return l
end
local function same(got, want, what)
  T.eq(got:size(), want:size(), what .. ": shape")
  local g, w = flat(got), flat(want)
  local n, first = 0, nil
  for i = 1, #w do
    if g[i] ~= w[i] or math.type(g[i]) ~= math.type(w[i]) then
      n = n + 1
      first = first or ("element %d: %s, want %s"):format(i, tostring(g[i]), tostring(w[i]))
    end
  end
  if n > 0 then error(("%s: %d of %d differ (first %s)"):format(what, n, #w, first), 2) end
end

-- Runs every case through run(x, block, group, elem) -> codes, scales, mant (tensors on any device)
-- on x = to_device(the case's CPU tensor), and compares with the reference on the CPU tensor: codes,
-- bytes and mantissas equal, and the non-finite flag of x's device equals the reference's.
-- (A case's list may be nil: then xc, the CPU tensor given, is used.)
function M.check(cases, run, to_device, xc_given)
  for _, c in ipairs(cases) do
    local name, list, rows, K, block, group = table.unpack(c, 1, 6)
    local xc = list and M.tensor(list, rows, K) or xc_given
    local x = to_device(xc)
    for _, elem in ipairs({"e4m3", "e5m2"}) do
      local what = name .. " " .. elem
      core.nonfinite_take(xc)
      core.nonfinite_take(x)
      local prev = nv.use_reference(true)
      local ok, c0, s0, m0 = pcall(core.gam_quantize, xc, block, group, elem)
      nv.use_reference(prev)
      if not ok then error(c0, 0) end
      local f0 = core.nonfinite_take(xc)
      local c1, s1, m1 = run(x, block, group, elem)
      local f1 = core.nonfinite_take(x)
      same(c1, c0, what .. ": codes")
      same(s1, s0, what .. ": scales")
      same(m1, m0, what .. ": group mantissas")
      T.eq(f1, f0, what .. ": the non-finite flag")
    end
  end
end

return M
