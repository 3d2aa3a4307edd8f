-- tests/test_mor_gam.lua: GAM scaling in MoR (recipe.mor scale = "gam", the mor_paper preset; NUMERICS
-- §12, GAM; issue 34) on the CPU:
--   * core.gam_quantize (the backend table's GAM: the fast CPU kernel here; the scalar reference and the
--     CUDA kernel equal it in test_gam_fast / test_cuda_gam) against an independent Lua
--     implementation of the rule: quotients in double rounded once to fp32 with string.pack, the
--     exponent and mantissa by search, the element code by brute force over every code's value worked
--     out here from the e4m3 / e5m2 bit layouts, the decode in double rounded once; bit for bit, for
--     e4m3 and e5m2, one group and groups of 2 blocks, a zero block, m_b < m_g and m_b >= m_g blocks,
--     subnormal and near-clamp block maxima (e_b clamped at 127) (NaN and inf: gam_cases, the C tests);
--   * through mor.choose, one group (the fold): a bf16 operand whose fp8 blocks hold code 2^-e_b and
--     whose bf16 blocks x m_g rounded to bf16, with 1 / m_g as its decode factor; every block in one
--     fp8 format: the MXFP8 operand itself (GAM's codes and bytes), whose GEMM, and its bf16 form's,
--     equal the exact product within fp32 summation; groups of blocks: an f32 operand of the
--     reference's decoded values; the errors MoR measured agree with ones computed here (relative 1e-6:
--     MoR sums f32 squares in double and takes an f32 sqrt);
--   * the recipe trains a few steps of a tiny model (finite losses, shares per format reported);
--   * bad options and bad arguments.
local T = require "nvlua.test"
local nv = require "nvlua"
local recipe = require "nvlua.recipe"
local mor = require "nvlua.mor"
local stats = require "nvlua.stats"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"

local core = nv.core

-- ---- an independent GAM, in Lua doubles ---------------------------------------------------------

local function f32(v) return (string.unpack("<f", string.pack("<f", v))) end

-- every finite value of an fp8 format from its bit layout: {code = value}
local function fp8_values(ebits, mbits, bias, is_e4m3)
  local vals = {}
  for code = 0, 255 do
    local s = code >> 7
    local e = (code >> mbits) & ((1 << ebits) - 1)
    local m = code & ((1 << mbits) - 1)
    local finite = true
    if is_e4m3 then finite = not (e == 15 and m == 7) else finite = e ~= 31 end
    if finite then
      local v = e == 0 and m / (1 << mbits) * 2.0 ^ (1 - bias) or (1 + m / (1 << mbits)) * 2.0 ^ (e - bias)
      vals[code] = s == 1 and -v or v
    end
  end
  return vals
end
local FMT = {e4m3 = {qmax = 448, vals = fp8_values(4, 3, 7, true)}, e5m2 = {qmax = 57344, vals = fp8_values(5, 2, 15, false)}}

-- q = m 2^e with 1 <= m < 2, by search (q > 0, finite)
local function split(q)
  local e = 0
  while q >= 2.0 ^ (e + 1) do e = e + 1 end
  while q < 2.0 ^ e do e = e - 1 end
  return q / 2.0 ^ e, e
end

-- q (> 0, finite in double) rounded once to 24 significant bits with an unbounded exponent -> m, e
local function split24(q)
  local m, e = split(q)
  m = f32(m) -- m in [1, 2): a normal fp32 number, so this is the 24-bit rounding
  if m == 2 then m, e = 1, e + 1 end
  return m, e
end

-- the code nearest to v (already clamped to +-qmax), ties to the even code (lowest bit 0); +-0 by sign
local function encode(fmt, v)
  local best, bd
  for code = 0, 255 do
    local c = fmt.vals[code]
    if c ~= nil and not (c == 0 and code ~= 0 and code ~= 0x80) then
      local d = math.abs(c - v)
      if bd == nil or d < bd or (d == bd and code % 2 == 0 and best % 2 == 1) then best, bd = code, d end
    end
  end
  if fmt.vals[best] == 0 then best = (v < 0 or (v == 0 and 1 / v < 0)) and 0x80 or 0 end
  return best
end

-- x: rows of numbers (no NaN, no inf, blocks above 2^-100); -> codes, e_b, m_g per group, decoded
local function gam(x, name, B, G)
  local fmt = FMT[name]
  local R, K = #x, #x[1]
  local nb = R * K // B
  G = G or nb
  local function blk(b) -- block b (0-based): its values in order
    local r, j = b // (K // B), b % (K // B)
    local t = {}
    for k = 1, B do t[k] = x[r + 1][j * B + k] end
    return t
  end
  local codes, exps, mants, dec = {}, {}, {}, {}
  for g0 = 0, nb - 1, G do
    local gamax = 0
    for b = g0, g0 + G - 1 do for _, v in ipairs(blk(b)) do gamax = math.max(gamax, math.abs(v)) end end
    local m_g = gamax == 0 and 1 or (split24(fmt.qmax / gamax))
    mants[#mants + 1] = m_g
    for b = g0, g0 + G - 1 do
      local t = blk(b)
      local bamax = 0
      for _, v in ipairs(t) do bamax = math.max(bamax, math.abs(v)) end
      local e_b = 127
      if bamax > 0 then
        local m_b
        m_b, e_b = split24(fmt.qmax / bamax)
        if m_b < m_g then e_b = e_b - 1 end
        e_b = math.min(e_b, 127) -- tiny (subnormal) block maxima: the largest E8M0 range
      end
      exps[b + 1] = e_b
      local scale = m_g * 2.0 ^ e_b
      for k, v in ipairs(t) do
        local p = f32(v * scale)
        p = math.max(-fmt.qmax, math.min(fmt.qmax, p))
        local c = encode(fmt, p)
        codes[b * B + k] = c
        dec[b * B + k] = f32(fmt.vals[c] * 2.0 ^ -e_b / m_g)
      end
    end
  end
  return codes, exps, mants, dec
end

local function flat(t2) -- rows -> one list, row-major
  local out = {}
  for _, row in ipairs(t2) do for _, v in ipairs(row) do out[#out + 1] = v end end
  return out
end

-- a [4, 96] test tensor, blocks of 32 (12 blocks): normal values at varied scales, a zero block, one
-- block holding the group max, one where m_b < m_g and one where m_b >= m_g (checked below)
local function sample()
  nv.manual_seed(11)
  local x = nv.randn(4, 96):totable()
  local scales = {1, 0.01, 3, 1e-3, 250, 1, 0.5, 7, 1e-5, 1, 0, 2}
  for b = 0, 11 do
    local r, j = b // 3, b % 3
    for k = 1, 32 do x[r + 1][j * 32 + k] = f32(x[r + 1][j * 32 + k] * scales[b + 1]) end
  end
  x[2][33] = 1000 -- block 4 (0-based) holds the group max: m_b = m_g there
  return x
end

-- code 2^-e_b of the independent GAM (exact in double and in fp32: >= 2^-143), per element
local function unscaled(codes, exps, name, B)
  local out = {}
  for i, c in ipairs(codes) do out[i] = FMT[name].vals[c] * 2.0 ^ -exps[(i - 1) // B + 1] end
  return out
end

-- the decoded values from the binding's parts: an MX operand assembled from the codes and bytes decodes
-- to code 2^-e_b; divided by the group's m_g in fp32
local function decode(name, codes, scales, mant, G)
  local u = core.qtensor_assemble("mxfp8_" .. name, codes, scales):dequantize()
  local R, K = u:size(1), u:size(2)
  local ng = mant:size(1)
  return u, u / mant:reshape(ng, 1):expand(ng, R * K // ng):contiguous():reshape(R, K)
end

T.case("core.gam_quantize: codes, exponents, mantissas and decoded values bit for bit an independent GAM", function()
  local x = sample()
  for _, name in ipairs({"e4m3", "e5m2"}) do
    for _, G in ipairs({"tensor", 2}) do
      local codes, scales, mant = core.gam_quantize(nv.tensor(x), 32, G, name)
      local wc, we, wm, wd = gam(x, name, 32, G ~= "tensor" and G or nil)
      local what = string.format("%s group %s", name, G)
      T.eq(flat(codes:totable()), wc, what .. ": codes")
      local bytes = flat(scales:totable())
      local lt, ge = 0, 0
      for b, e in ipairs(we) do
        T.eq(bytes[b], 127 - e, what .. ": E8M0 byte of block " .. b)
      end
      T.eq(mant:totable(), wm, what .. ": m_g per group")
      local u, dec = decode(name, codes, scales, mant, G)
      T.eq(flat(u:totable()), unscaled(wc, we, name, 32), what .. ": the MX operand's values, code 2^-e_b")
      T.eq(flat(dec:totable()), wd, what .. ": decoded values")
      -- the rule's two branches both occur: m_b < m_g (e_b lowered) and m_b >= m_g
      for b, e in ipairs(we) do
        local g = G ~= "tensor" and (b - 1) // G + 1 or 1
        local bamax = 0
        local r, j = (b - 1) // 3, (b - 1) % 3
        for k = 1, 32 do bamax = math.max(bamax, math.abs(x[r + 1][j * 32 + k])) end
        if bamax > 0 then
          local m_b = split24(FMT[name].qmax / bamax)
          if m_b < wm[g] then lt = lt + 1 else ge = ge + 1 end
        end
      end
      T.ok(lt > 0 and ge > 0, what .. string.format(": m_b < m_g in %d blocks, >= in %d", lt, ge))
      T.eq(bytes[11], 0, what .. ": the zero block's byte is 0 (e_b = 127)")
    end
  end
  -- e4m3 and e5m2 share m_g (qmax 1.75 x 2^k for both) and their exponents differ by 7
  local _, s4, m4 = core.gam_quantize(nv.tensor(x), 32, "tensor", "e4m3")
  local _, s5, m5 = core.gam_quantize(nv.tensor(x), 32, "tensor", "e5m2")
  T.eq(m4:totable(), m5:totable(), "one m_g for both formats")
  local b4, b5 = flat(s4:totable()), flat(s5:totable())
  for b = 1, 12 do if b ~= 11 then T.eq(b4[b] - b5[b], 7, "e5m2's e_b is e4m3's + 7, block " .. b) end end
end)

T.case("core.gam_quantize edge cases: subnormal and near-clamp block maxima, a zero block, bit for bit", function()
  -- blocks of 32 in one row: fp32 subnormals (max 2^-130), max 2^-118 and 2^-121 (near e4m3's and
  -- e5m2's clamp of e_b at 127), zeros, and ordinary values holding the group max
  nv.manual_seed(12)
  local r = nv.randn(1, 160):totable()[1]
  local scales = {2.0 ^ -130, 2.0 ^ -118, 2.0 ^ -121, 0, 1}
  local x = {{}}
  for b = 0, 4 do
    local mx = 0
    for k = 1, 32 do mx = math.max(mx, math.abs(r[b * 32 + k])) end
    for k = 1, 32 do x[1][b * 32 + k] = f32(r[b * 32 + k] / mx * scales[b + 1]) end
  end
  for _, name in ipairs({"e4m3", "e5m2"}) do
    local codes, scales_t, mant = core.gam_quantize(nv.tensor(x), 32, "tensor", name)
    local wc, we, wm, wd = gam(x, name, 32)
    T.eq(flat(codes:totable()), wc, name .. ": codes")
    local bytes = flat(scales_t:totable())
    for b, e in ipairs(we) do T.eq(bytes[b], 127 - e, name .. ": byte of block " .. b) end
    T.eq(bytes[1], 0, name .. ": the subnormal block's e_b is clamped at 127")
    T.eq(mant:totable(), wm, name .. ": m_g")
    local u, dec = decode(name, codes, scales_t, mant, "tensor")
    T.eq(flat(u:totable()), unscaled(wc, we, name, 32), name .. ": code 2^-e_b (fp32 subnormals included)")
    T.eq(flat(dec:totable()), wd, name .. ": decoded values")
  end
end)

-- choices by pattern: blocks cycle e4m3, e5m2, bf16 (decide replaced, so every kind occurs)
local function cycle(d)
  local sz = d.errs[1]:size()
  local t = {}
  for i = 1, sz[1] do
    t[i] = {}
    for j = 1, sz[2] do t[i][j] = ((i - 1) * sz[2] + j - 1) % 3 + 1 end
  end
  return nv.tensor(t)
end

T.case("mor.choose scale = \"gam\", one group: a bf16 operand of code 2^-e_b (x m_g in bf16 blocks), 1 / m_g as its factor", function()
  local x = sample()
  local xt = nv.tensor(x)
  local r = mor.choose(xt, {granularity = "block", block = 32, candidates = {"e4m3", "e5m2"}, scale = "gam",
    threshold = {e4m3 = 0.04, e5m2 = 0.1}, decide = cycle})
  T.eq(r.label, "mor")
  T.eq(r.q:format(), "bf16", "mixed e4m3 / e5m2 / bf16 blocks: a bf16 operand")
  local c4, x4, wm = gam(x, "e4m3", 32)
  local c5, x5 = gam(x, "e5m2", 32)
  local m_g = wm[1]
  T.eq(r.q:factor(), f32(1 / m_g), "the operand's factor is 1 / m_g in fp32")
  local u4, u5 = unscaled(c4, x4, "e4m3", 32), unscaled(c5, x5, "e5m2", 32)
  local xf = flat(x)
  local xg = {} -- x m_g in fp32, what the errors are measured against
  for i, v in ipairs(xf) do xg[i] = f32(v * m_g) end
  local got = flat(r.q:data():to("f32"):totable())
  for b = 0, 11 do
    local c = b % 3 + 1
    for k = 1, 32 do
      local i = b * 32 + k
      local want = c == 1 and u4[i] or c == 2 and u5[i] or nv.tensor({xg[i]}):to("bf16"):to("f32"):totable()[1]
      if got[i] ~= want then
        error(string.format("block %d element %d (choice %d): %.9g, want %.9g", b, k, c, got[i], want))
      end
    end
  end
  -- decoded: the stored value times the factor, one fp32 rounding
  local dq = flat(r.q:dequantize():totable())
  for i = 1, #got do
    if dq[i] ~= f32(got[i] * f32(1 / m_g)) then error(string.format("element %d decodes to %.9g", i, dq[i])) end
  end
  T.eq(r.counts["x|fprop|x"].units, {e4m3 = 4, e5m2 = 4, bf16 = 4})
  T.eq(r.counts["x|fprop|x"].tensors, {mixed = 1}, "one operand tensor, with bf16 blocks")
  local sm = mor.summary(r.counts)
  T.eq(sm.tensors_low, 0)
  T.eq(sm.tensors, {mixed = 1})
  -- the errors decide saw: ||code 2^-e_b - x m_g|| / ||x m_g|| per block, here in double
  for ci, uu in ipairs({u4, u5}) do
    local e = flat(r.errs[ci]:totable())
    for b = 0, 11 do
      local s, n = 0, 0
      for k = 1, 32 do
        local i = b * 32 + k
        s, n = s + (uu[i] - xg[i]) ^ 2, n + xg[i] ^ 2
      end
      local want = n == 0 and 0 or math.sqrt(s / n)
      T.near(e[b + 1], want, 1e-6 * want + 1e-30, string.format("candidate %d block %d error", ci, b))
    end
  end
  -- the default decision on the same errors: e4m3 where within 0.04, else e5m2 within 0.1, else bf16
  local r2 = mor.choose(xt, {granularity = "block", block = 32, candidates = {"e4m3", "e5m2"}, scale = "gam",
    threshold = {e4m3 = 0.04, e5m2 = 0.1}})
  local e4, e5, ch = flat(r2.errs[1]:totable()), flat(r2.errs[2]:totable()), flat(r2.choice:totable())
  for b = 1, 12 do
    T.eq(ch[b], e4[b] <= 0.04 and 1 or e5[b] <= 0.1 and 2 or 3, "default choice of block " .. b)
  end
end)

T.case("mor.choose scale = \"gam\": every block in one fp8 format is an MXFP8 operand; groups of blocks an f32 one", function()
  local x = sample()
  local xt = nv.tensor(x)
  for _, name in ipairs({"e4m3", "e5m2"}) do
    -- threshold +inf: every block takes the first candidate
    local r = mor.choose(xt, {granularity = "block", block = 32, candidates = {name}, scale = "gam", threshold = math.huge})
    T.eq(r.q:format(), "mxfp8_" .. name, name .. ": an MX operand")
    T.eq(r.counts["x|fprop|x"].tensors, {[name] = 1}, name .. ": counted as one tensor wholly in " .. name)
    local wc, we, wm = gam(x, name, 32)
    T.eq(r.q:factor(), f32(1 / wm[1]), name .. ": factor 1 / m_g")
    T.eq(flat(r.q:codes():totable()), wc, name .. ": its codes are GAM's")
    local bytes = flat(r.q:scale_bytes():totable())
    for b, e in ipairs(we) do T.eq(bytes[b], 127 - e, name .. ": E8M0 byte of block " .. b) end
    -- the same operand held as bf16 values with the same factor: the same exact products (the two GEMM
    -- paths may sum them in different orders: NUMERICS §7)
    local w = nv.randn(8, 96)
    local qw = mor.choose(w, {granularity = "block", block = 32, candidates = {"e4m3", "e5m2"}, scale = "gam",
      threshold = {e4m3 = 0.04, e5m2 = 0.1}, decide = cycle}).q
    local as_bf16 = core.qtensor_assemble("bf16", nv.tensor(unscaled(wc, we, name, 32)):reshape(4, 96):to("bf16"), nil,
      r.q:factor())
    local o1, o2 = nv.qmatmul(r.q, qw), nv.qmatmul(as_bf16, qw)
    -- each is the exact product of the decoded values up to fp32 summation and alpha's one rounding:
    -- |err| <= (K + 3) 2^-24 sum |a' b'| alpha
    local Bv, alpha = qw:data():to("f32"), f32(r.q:factor() * qw:factor())
    local ua = unscaled(wc, we, name, 32)
    local bt = Bv:totable()
    local ot, ot2 = o1:totable(), o2:totable()
    for m = 1, 4 do
      for n = 1, 8 do
        local s, sa = 0, 0
        for k = 1, 96 do
          local p = ua[(m - 1) * 96 + k] * bt[n][k]
          s, sa = s + p, sa + math.abs(p)
        end
        T.near(ot[m][n], s * alpha, 99 * 2.0 ^ -24 * sa * alpha + 1e-30, string.format("%s out[%d][%d]", name, m, n))
        T.near(ot2[m][n], s * alpha, 99 * 2.0 ^ -24 * sa * alpha + 1e-30, string.format("%s bf16 form out[%d][%d]", name, m, n))
      end
    end
  end
  -- groups of 2 blocks: no fold, the fp8 blocks hold the reference's decoded values in an f32 operand
  local r3 = mor.choose(xt, {granularity = "block", block = 32, candidates = {"e4m3"}, scale = "gam", group = 2,
    threshold = math.huge})
  T.eq(r3.q:format(), "f32")
  local _, _, _, dg = gam(x, "e4m3", 32, 2)
  T.eq(flat(r3.q:dequantize():totable()), dg, "group = 2: every block e4m3, the reference's values")
end)

T.case("mor.summary: operand tensors by representation (hand counts), and their line", function()
  -- 4 operand tensors: 2 wholly e4m3, 1 of e4m3 and e5m2 blocks, 1 with a bf16 block
  local counts = {
    a = {name = "a", role = "fprop", operand = "x", units = {e4m3 = 8}, elems = {e4m3 = 1024}, tensors = {e4m3 = 2}},
    b = {name = "b", role = "dgrad", operand = "dy", units = {e4m3 = 3, e5m2 = 1}, elems = {e4m3 = 384, e5m2 = 128},
      tensors = {mixed_low = 1}},
    c = {name = "c", role = "wgrad", operand = "x", units = {e4m3 = 3, bf16 = 1}, elems = {e4m3 = 384, bf16 = 128},
      tensors = {mixed = 1}},
  }
  local sm = mor.summary(counts)
  T.eq(sm.tensors_low, 0.75)
  T.eq(sm.tensors, {e4m3 = 0.5, mixed_low = 0.25, mixed = 0.25})
  T.eq(mor.format_tensor_shares(sm.tensors_low, sm.tensors), "75.00% of operand tensors wholly in low precision " ..
    "(e4m3 50.00%, mixed low-precision formats 25.00%, with bf16 units 25.00%)")
end)

local CFG = {vocab_size = 96, hidden_size = 128, intermediate_size = 256, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, head_dim = 64, max_position_embeddings = 64}

-- three AdamW steps of a fresh model under rec -> the losses, this run's representation counts
local function train3(rec)
  stats.reset()
  local m = llama.Llama(CFG, {recipe = rec, seed = 5})
  local opt = optim.AdamW(m:named_parameters(), {lr = 1e-2})
  local losses = {}
  for s = 1, 3 do
    nv.manual_seed(20 + s)
    local ids = (nv.rand(2, 64) * 95):to("i64")
    local tg = (nv.rand(2, 64) * 95):to("i64")
    losses[s] = m:forward_backward(ids, tg)
    opt:step()
    m:zero_grad()
  end
  return losses, stats.representations()
end

T.case("mor_paper trains: finite losses, every operand's blocks counted, e4m3 / e5m2 / bf16 shares", function()
  local rec = recipe.make("mor_paper", {seed = 2})
  T.eq(rec.mor.scale, "gam")
  T.eq(rec.mor.candidates, {"e4m3", "e5m2"})
  T.eq(rec.mor.granularity, "block")
  T.eq(rec.mor.block, 128)
  local losses, reps = train3(rec)
  for s, l in ipairs(losses) do T.ok(l == l and math.abs(l) < math.huge, "step " .. s .. " loss " .. tostring(l)) end
  local elems, total = {}, 0
  for _, r in ipairs(reps) do
    for f, n in pairs(r.elems or {}) do elems[f] = (elems[f] or 0) + n; total = total + n end
  end
  T.ok(total > 0, "operands were counted")
  T.ok((elems.e4m3 or 0) > 0, "some blocks in e4m3")
  local parts = {}
  for _, f in ipairs({"e4m3", "e5m2", "bf16"}) do parts[#parts + 1] = string.format("%s %.2f%%", f, 100 * (elems[f] or 0) / total) end
  print("    mor_paper element shares over 3 steps: " .. table.concat(parts, ", "))
  -- group = 4 blocks trains too
  local l2 = train3(recipe.mor({granularity = "block", block = 32, candidates = {"e4m3", "e5m2"}, scale = "gam", group = 4,
    threshold = {e5m2 = 0.1}}))
  for s, l in ipairs(l2) do T.ok(l == l and math.abs(l) < math.huge, "group 4: step " .. s .. " loss " .. tostring(l)) end
end)

T.case("scale / group options and core.gam_quantize arguments: clear errors", function()
  local gb = {granularity = "block", candidates = {"e4m3"}}
  local function with(t)
    local o = {}
    for k, v in pairs(gb) do o[k] = v end
    for k, v in pairs(t) do o[k] = v end
    return o
  end
  T.raises(function() recipe.mor(with({scale = "pow3"})) end, "scale must be \"pow2\" or \"gam\", got pow3")
  T.raises(function() recipe.mor({scale = "gam"}) end, "scale = \"gam\" scales blocks: it needs granularity = \"block\"")
  T.raises(function() recipe.mor(with({scale = "gam", candidates = {"e4m3", "nvfp4"}})) end,
    "scale = \"gam\" takes the fp8 candidates e4m3 and e5m2, not candidates[2] = nvfp4")
  T.raises(function() recipe.mor(with({scale = "gam", group = 0})) end, "group must be \"tensor\" or a positive integer")
  T.raises(function() recipe.mor(with({scale = "gam", group = "row"})) end, "group must be \"tensor\" or a positive integer")
  T.raises(function() recipe.mor(with({group = 2})) end, "group applies to scale = \"gam\"")
  -- a group that does not divide an operand's blocks: the operand named
  local x = nv.randn(3, 64)
  T.raises(function() mor.choose(x, with({block = 32, scale = "gam", group = 4, threshold = 0.04})) end,
    "layer 'x' fprop operand x: its 6 blocks of 1x32 do not split into groups of 4 blocks")
  T.eq(mor.new(with({scale = "gam", group = 3})):describe(), "mor e4m3<=0.04 > bf16 per 1x128 block gam (group 3 blocks)")
  -- assembling an operand: what is wrong is named
  local c8 = nv.zeros(2, 64):to("u8")
  local s8 = nv.zeros(2, 2):to("u8")
  T.raises(function() core.qtensor_assemble("nvfp4", c8, s8) end, "format must be f32, bf16, mxfp8_e4m3 or mxfp8_e5m2")
  T.raises(function() core.qtensor_assemble("mxfp8_e4m3", nv.zeros(2, 64), s8) end, "codes for mxfp8_e4m3 must be a contiguous 2-D u8")
  T.raises(function() core.qtensor_assemble("mxfp8_e4m3", c8) end, "mxfp8_e4m3 needs its block scales (u8 [2, 2])")
  T.raises(function() core.qtensor_assemble("mxfp8_e4m3", c8, nv.zeros(2, 3):to("u8")) end, "scales must be a contiguous u8 [2, 2]")
  T.raises(function() core.qtensor_assemble("mxfp8_e4m3", nv.zeros(2, 48):to("u8"), s8) end, "K is not a multiple of the block, 32")
  T.raises(function() core.qtensor_assemble("mxfp8_e5m2", c8, s8 + 255) end, "a scale byte is 255 (E8M0's NaN)")
  T.raises(function() core.qtensor_assemble("bf16", nv.zeros(2, 64):to("bf16"), s8) end, "bf16 takes no block scales")
  T.raises(function() core.qtensor_assemble("bf16", nv.zeros(2, 64), nil) end, "values for bf16 must be a contiguous 2-D bf16")
  for _, f in ipairs({0, -1, 0 / 0, math.huge, 1e-40}) do
    T.raises(function() core.qtensor_assemble("bf16", nv.zeros(2, 64):to("bf16"), nil, f) end,
      "factor must be a finite, normal, positive number")
  end
end)
