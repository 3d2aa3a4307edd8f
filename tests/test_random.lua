-- test_random.lua: Philox4x32-10 and the random streams built on it — known answers from the
-- Random123 distribution (kat_vectors), the stream layout of rand/randn (core/NUMERICS.md §3: key =
-- (seed lo, seed hi), counter = (group, offset lo, offset hi, 0)), generator offsets and
-- independence, determinism, the range of rand and the moments of rand/randn.
-- Not here: stochastic rounding in quantizers (their own tests).
local T = require "nvlua.test"
local nv = require "nvlua"

local philox = nv.core.philox
local M32 = 0xffffffff

-- Random123 kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words), expected.
local KAT = {
  {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
  {{M32, M32, M32, M32}, {M32, M32}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
  {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
   {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
}

T.case("Philox4x32-10 known answers (Random123 kat_vectors)", function()
  for i, k in ipairs(KAT) do
    local c, key, want = k[1], k[2], k[3]
    local got = {philox(c[1], c[2], c[3], c[4], key[1], key[2])}
    local hex = {}
    for j = 1, 4 do hex[j] = string.format("0x%08x", got[j]) end
    local whex = {}
    for j = 1, 4 do whex[j] = string.format("0x%08x", want[j]) end
    T.eq(hex, whex, "KAT " .. i)
  end
end)

T.case("manual_seed: the same seed gives identical rand and randn; another seed differs", function()
  nv.manual_seed(42)
  local a1, n1 = nv.rand(1000):totable(), nv.randn(1000):totable()
  nv.manual_seed(42)
  local a2, n2 = nv.rand(1000):totable(), nv.randn(1000):totable()
  T.eq(a1, a2, "rand")
  T.eq(n1, n2, "randn")
  nv.manual_seed(43)
  local a3 = nv.rand(1000):totable()
  local same = 0
  for i = 1, 1000 do if a3[i] == a1[i] then same = same + 1 end end
  -- two independent 24-bit uniforms agree with probability 2^-24; a few coincidences would
  -- already be suspicious
  T.ok(same <= 2, same .. " of 1000 elements equal across seeds")
  -- consecutive calls draw different numbers
  nv.manual_seed(42)
  local b1, b2 = nv.rand(100):totable(), nv.rand(100):totable()
  T.ok(not T.deep_eq(b1, b2), "two calls differ")
  -- shape does not change the stream: element i is the same whatever the shape
  nv.manual_seed(42)
  local s = nv.rand(10, 100)
  T.eq(s:view(-1):totable(), a1, "a [10,100] tensor holds the same stream")
end)

T.case("generator offsets: one per call; Generator objects are independent", function()
  nv.manual_seed(5)
  local dg = nv.default_generator()
  T.eq(dg:seed(), 5)
  T.eq(dg:offset(), 0, "manual_seed resets the offset")
  nv.rand(10)
  T.eq(dg:offset(), 1, "rand advances the offset by one")
  nv.randn(1000)
  T.eq(dg:offset(), 2, "randn too, whatever the size")
  nv.rand(3, 4, "bf16")
  T.eq(dg:offset(), 3)
  nv.rand(0)
  T.eq(dg:offset(), 4, "even an empty draw is a call")

  local g = nv.Generator(5)
  T.eq(g:seed(), 5)
  T.eq(g:offset(), 0)
  local x = nv.rand(50, {generator = g}):totable()
  T.eq(g:offset(), 1, "the generator's own offset advanced")
  T.eq(dg:offset(), 4, "the default generator's did not")
  nv.manual_seed(5)
  T.eq(nv.rand(50):totable(), x, "same seed and offset, same numbers")
  -- drawing from the default generator does not disturb g
  local g1, g2 = nv.Generator(77), nv.Generator(77)
  local y1 = nv.randn(20, {generator = g1}):totable()
  nv.rand(100); nv.randn(100)
  local y2 = nv.randn(20, {generator = g2}):totable()
  T.eq(y1, y2)
  -- set_offset replays a call; manual_seed on a generator resets it
  g1:set_offset(0)
  T.eq(nv.randn(20, {generator = g1}):totable(), y1, "set_offset(0) replays the first call")
  g1:manual_seed(78)
  T.eq(g1:offset(), 0)
  T.ok(not T.deep_eq(nv.randn(20, {generator = g1}):totable(), y1), "a new seed")
  T.ok(tostring(g1):find("seed=78", 1, true), tostring(g1))
end)

-- Element i (1-based) of a rand call at (seed, offset) is word (i-1)%4 of
-- philox(ctr = ((i-1)//4, offset lo, offset hi, 0), key = (seed lo, seed hi)), its top 24 bits
-- times 2^-24. nv.core.philox is checked against the published answers above, so it can stand
-- in for an independent Philox here.
local function rand_elem(seed, offset, i)
  local w = {philox((i - 1) // 4, offset & M32, offset >> 32, 0, seed & M32, (seed >> 32) & M32)}
  return (w[(i - 1) % 4 + 1] >> 8) * 2.0 ^ -24
end

T.case("rand's stream layout: element i from philox((i-1)//4, offset; seed)", function()
  local seed = 0x123456789abcd                         -- both key words non-zero
  nv.manual_seed(seed)
  local r0 = nv.rand(23):totable()                     -- offset 0; 23: a partial last group
  local r1 = nv.rand(9):totable()                      -- offset 1
  for i = 1, 23 do T.eq(r0[i], rand_elem(seed, 0, i), "call 0, element " .. i) end
  for i = 1, 9 do T.eq(r1[i], rand_elem(seed, 1, i), "call 1, element " .. i) end
  -- a large offset uses both offset words
  local g = nv.Generator(7)
  local off = (3 << 32) + 5
  g:set_offset(off)
  local r = nv.rand(8, {generator = g}):totable()
  for i = 1, 8 do T.eq(r[i], rand_elem(7, off, i), "offset 2^32*3+5, element " .. i) end
  T.eq(g:offset(), off + 1)
  -- a strided destination gets the stream in its logical (row-major) order
  nv.manual_seed(seed)
  local base = nv.zeros(4, 3)
  local view = base:t()                                  -- [3,4], not contiguous
  nv.core.rand_(view)
  local vt = view:totable()
  for i = 1, 3 do
    for j = 1, 4 do T.eq(vt[i][j], rand_elem(seed, 0, (i - 1) * 4 + j), "strided destination") end
  end
end)

T.case("randn's stream layout: Box-Muller on word pairs", function()
  -- element i uses group (i-1)//2 and words j, j+1 with j = 2*((i-1)%2) (0-based):
  -- u1 = (w_j >> 8 + 1) * 2^-24 in (0,1], u2 = (w_{j+1} >> 8) * 2^-24, z = sqrt(-2 ln u1) cos(2 pi u2)
  -- (kernels/cpu/ref/ops_ref.c). The libm calls may differ from Lua's in the last bit, and the
  -- result is rounded to f32, so compare within 2 f32 ulps of |z| (|z| < 6 here).
  local seed = 2024
  nv.manual_seed(seed)
  local z = nv.randn(11):totable()
  for i = 1, 11 do
    local w = {philox((i - 1) // 2, 0, 0, 0, seed, 0)}
    local j = 2 * ((i - 1) % 2)
    local u1 = ((w[j + 1] >> 8) + 1) * 2.0 ^ -24
    local u2 = (w[j + 2] >> 8) * 2.0 ^ -24
    local want = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
    T.near(z[i], want, 2 * 2.0 ^ -23 * math.max(math.abs(want), 2 ^ -10), "element " .. i)
  end
end)

local function moments(t)
  local n, s, s2, lo, hi = 0, 0, 0, math.huge, -math.huge
  for _, v in ipairs(t) do
    n = n + 1; s = s + v; s2 = s2 + v * v
    if v < lo then lo = v end
    if v > hi then hi = v end
  end
  local mean = s / n
  return n, mean, s2 / n - mean * mean, lo, hi
end

T.case("rand: values in [0, 1), mean and variance within 5 sigma", function()
  nv.manual_seed(11)
  local t = nv.rand(100000)
  T.eq(t:dtype(), "f32")
  local n, mean, var, lo, hi = moments(t:totable())
  T.ok(lo >= 0 and hi < 1, string.format("range [%g, %g]", lo, hi))
  -- U(0,1): mean 1/2, variance 1/12. The sample mean's std is sqrt(1/12/n) = 0.00091 for
  -- n = 1e5; the sample variance's std is sqrt((mu4 - sigma^4)/n) = sqrt((1/80 - 1/144)/n) =
  -- sqrt(1/(180 n)) = 0.00024. Allow 5 sigma (a false alarm about once in 1.7 million seeds; the
  -- seed is fixed, so the test is deterministic).
  T.near(mean, 0.5, 5 * math.sqrt(1 / 12 / n), "mean")
  T.near(var, 1 / 12, 5 * math.sqrt(1 / (180 * n)), "variance")
  -- every value is a multiple of 2^-24 (24 random bits)
  local bad = 0
  for _, v in ipairs(t:totable()) do if v * 2 ^ 24 ~= math.floor(v * 2 ^ 24) then bad = bad + 1 end end
  T.eq(bad, 0, "values on the 2^-24 grid")
  T.eq(nv.rand(3, 5):size(), {3, 5})
end)

T.case("randn: mean and variance within 5 sigma", function()
  nv.manual_seed(12)
  local n, mean, var, lo, hi = moments(nv.randn(100000):totable())
  -- N(0,1): the sample mean's std is 1/sqrt(n) = 0.0032; the sample variance's std is
  -- sqrt(2/n) = 0.0045 (mu4 = 3). 5 sigma each.
  T.near(mean, 0, 5 / math.sqrt(n), "mean")
  T.near(var, 1, 5 * math.sqrt(2 / n), "variance")
  -- u1 >= 2^-24 bounds |z| by sqrt(-2 ln 2^-24) = 5.77
  T.ok(lo >= -5.77 and hi <= 5.77, string.format("range [%g, %g]", lo, hi))
  T.ok(lo < -3.5 and hi > 3.5, "tails are reached in 1e5 draws")
end)

T.case("rand into bf16: bf16 values in [0, 1)", function()
  nv.manual_seed(13)
  local t = nv.rand(100000, "bf16")
  T.eq(t:dtype(), "bf16")
  local vals = t:totable()
  local lo, hi = math.huge, -math.huge
  local offgrid = 0
  for _, v in ipairs(vals) do
    if v < lo then lo = v end
    if v > hi then hi = v end
    -- a bf16 value in [2^e, 2^(e+1)) is a multiple of 2^(e-7)
    if v > 0 then
      local e = math.floor(math.log(v, 2))
      local q = 2.0 ^ (e - 7)
      if v / q ~= math.floor(v / q) then offgrid = offgrid + 1 end
    end
  end
  T.eq(offgrid, 0, "values are bf16")
  T.ok(lo >= 0, "lower end " .. lo)
  T.ok(hi < 1, "rand must stay below 1 in bf16 too; max " .. hi)
  local _, mean = moments(vals)
  T.near(mean, 0.5, 5 * math.sqrt(1 / 12 / #vals) + 2 ^ -9, "mean (plus bf16 rounding bias bound)")
end)

T.case("randn into bf16 and into a strided destination", function()
  nv.manual_seed(14)
  local b = nv.randn(1000, "bf16")
  nv.manual_seed(14)
  local f = nv.randn(1000):totable()
  local bt = b:totable()
  for i = 1, 1000 do
    local a = math.abs(f[i])
    local ulp = a > 2 ^ -126 and 2.0 ^ (math.floor(math.log(a, 2)) - 7) or 2.0 ^ -133
    -- f32 then bf16 (two roundings) vs one rounding from double: within one bf16 ulp
    T.ok(math.abs(bt[i] - f[i]) <= ulp, "randn bf16 element " .. i)
  end
  -- a strided destination gets the stream in its logical (row-major) order
  nv.manual_seed(15)
  local want = nv.randn(3, 4):totable()
  nv.manual_seed(15)
  local base = nv.zeros(4, 3)
  nv.core.randn_(base:t())
  T.eq(base:t():totable(), want)
end)
