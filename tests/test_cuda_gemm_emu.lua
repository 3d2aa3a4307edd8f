-- test_cuda_gemm_emu.lua: the emulated block-scaled GEMMs on an sm_90 device (kernels/cuda/gemm.cu
-- emulated_gemm): nvfp4 (1x16 and 16x16 blocks), mxfp4, mxfp8 e4m3/e5m2 operands dequantized to bf16
-- (global factors left to alpha) and one cuBLASLt bf16 x bf16 -> fp32 GEMM; where a block scale
-- takes values below bf16's normal range (NUMERICS §7), the operands scaled by powers of two chosen on
-- the device (alpha by the inverse), or, where no such scaling exists, the exact fp32 sum from a
-- CUDA-core kernel: no host synchronisation either way. The emulator counts the subnormal inputs,
-- products and partial sums its bf16 GEMMs meet (what tensor cores may flush): none may. Results
-- here are the CPU emulation of CUDA's (under emulation), not a GPU run.
--
-- Exact inputs (small integers, or e2m1 values times power-of-two scales: every product and partial
-- sum exact in fp32): the device equals the exact product, computed here in double, bit for bit.
-- Random inputs: both sides sum the same exact fp32 products in fp32 in some order, so per element
-- |cuda - cpu| <= 2 gamma_K |alpha| S, gamma_K = K u / (1 - K u), u = 2^-24, S = sum |a||b| of the
-- dequantized values, times (1 + u)^3 / (1 - u)^2 for alpha's own rounding (test_gemm_bf16.lua's
-- derivation and bound; the helpers both use are tests/gemm_exact.lua).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local G = dofile("tests/gemm_exact.lua") -- rng, exact_values, exact_product, order_bound
local exact_values, exact_product, order_bound = G.exact_values, G.exact_product, G.order_bound

local function need_sm90_emu()
  T.need_emu()
  if not nv.cuda.devices()[1].capability:match("^9") then T.skip("needs an sm_90 device (NVLUA_EMU_CC=90)") end
end

local function same(got, want, what)
  local g, w = got:cpu():totable(), want:totable()
  for i = 1, #w do
    for j = 1, #w[i] do
      if g[i][j] ~= w[i][j] then error(string.format("%s: [%d,%d] %.9g vs %.9g", what, i, j, g[i][j], w[i][j]), 2) end
    end
  end
end

local function quantize_exact(x, fmt, opts, what)
  local t = nv.tensor(x)
  local q = nv.quantize(t:cuda(), fmt, opts)
  same(q:dequantize(), t, what .. ": the inputs quantize exactly")
  return q
end

-- fn()'s counters: host syncs, subnormals met by bf16 GEMMs, and whether fallback_gemm_kernel wrote
-- the product (out_bytes; it writes 16 floats of alpha and beta otherwise: a page at most), or nil
-- where that cannot tell (no byte counts, or an output under 4 pages)
local function spent(fn, out_bytes)
  core.cuda_synchronize()
  core.cuda_emu_reset_counters()
  local r = T.with(core.cuda_set_sync, false, fn)
  local c = core.cuda_emu_counters()
  core.cuda_synchronize()
  local k = c.kernels["fallback_gemm_kernel"]
  local fell = nil
  if c.bytes_counted and out_bytes >= 16384 then fell = k ~= nil and k.bytes_written >= out_bytes end
  return r, {syncs = c.host_syncs, subnormals = c.gemm_subnormals, fallback = fell}
end

local FORMATS = { {"nvfp4"}, {"nvfp4", block = "2d"}, {"mxfp4"}, {"mxfp8_e4m3"}, {"mxfp8_e5m2"} }

T.case("sm_90: nvfp4 (1d, 2d), mxfp4, mxfp8 e4m3/e5m2 on the bf16 GEMM: exact inputs bit for bit, random within the order bound", function()
  need_sm90_emu()
  for _, f in ipairs(FORMATS) do
    local fmt, what = f[1], f[1] .. (f.block and " 2d" or "")
    local path, detail = nv.cuda.gemm_path(fmt, fmt)
    T.eq(path, "emulated", what .. ": gemm_path")
    T.ok(detail:find("bf16 GEMM on the tensor cores", 1, true) ~= nil, what .. ": detail " .. detail)
    local opts = f.block and { block = "2d" } or nil
    local M, N, K = 16, 32, 64
    local A, B = exact_values(fmt, M, K, 11, f), exact_values(fmt, N, K, 12, f)
    local qa, qb = quantize_exact(A, fmt, opts, what .. " a"), quantize_exact(B, fmt, opts, what .. " b")
    local r, c = spent(function() return nv.qmatmul(qa, qb) end, M * N * 4)
    same(r, nv.tensor(exact_product(A, B)), what .. ": exact inputs")
    T.eq({c.syncs, c.subnormals}, {0, 0}, what .. ": host syncs, subnormals met by the bf16 GEMM")
    T.ok(c.fallback ~= true, what .. ": no fallback")
    -- random inputs against the CPU's qmatmul
    nv.manual_seed(21)
    local a, b = nv.randn(M, K), nv.randn(N, K)
    local ca, cb = nv.quantize(a, fmt, opts), nv.quantize(b, fmt, opts)
    local da, db = nv.quantize(a:cuda(), fmt, opts), nv.quantize(b:cuda(), fmt, opts)
    local got, want = nv.qmatmul(da, db):cpu():totable(), nv.qmatmul(ca, cb):totable()
    local bound = order_bound(ca, cb)
    for i = 1, M do
      for j = 1, N do
        local d = math.abs(got[i][j] - want[i][j])
        if not (d <= bound[i][j]) then
          error(string.format("%s random: [%d,%d] %.9g vs %.9g, |diff| %.3g > %.3g", what, i, j, got[i][j],
            want[i][j], d, bound[i][j]))
        end
      end
    end
  end
end)

T.case("sm_90: MX block scales down to 2^-127 stay on the bf16 GEMM, scaled by a power of two chosen on the device: exact, no subnormal, no host sync", function()
  need_sm90_emu()
  local M, N, K = 5, 7, 64
  -- scale 2^-127 (e = 0, values down to 2^-136): unscaled, the values and products are subnormal; the
  -- device scales a up (and alpha down) so every product is a multiple of 2^-126. 2^-119 (mxfp4) and
  -- 2^-90 (mxfp8) already satisfied the rule (lo_a + lo_b >= -126): no scaling needed.
  for _, fc in ipairs({ { "mxfp4", 2.0 ^ -119 }, { "mxfp8_e4m3", 2.0 ^ -90 }, { "mxfp8_e5m2", 2.0 ^ -100 } }) do
    local fmt = fc[1]
    for _, scale in ipairs({ 2.0 ^ -127, fc[2] }) do
      local A, B = exact_values(fmt, M, K, 61), exact_values(fmt, N, K, 62)
      for k = 1, K do A[1][k] = (k % 32 == 1 and 4 or (k % 5) - 2) * scale end
      local what = string.format("%s, scale %g", fmt, scale)
      local qa, qb = quantize_exact(A, fmt, nil, what .. " a"), quantize_exact(B, fmt, nil, what .. " b")
      local want = nv.tensor(exact_product(A, B))
      local r, c = spent(function() return nv.qmatmul(qa, qb) end, M * N * 4)
      same(r, want, what .. ": exact product")
      T.eq({c.syncs, c.subnormals}, {0, 0}, what .. ": host syncs, subnormals met by the bf16 GEMM")
      T.ok(c.fallback ~= true, what .. ": no fallback")
      T.ok(want:get(1, 1) == 0 or r:cpu():get(1, 1) ~= 0, what .. ": row 1 not flushed")
      r, c = spent(function() return nv.qmatmul(qa, qb, { out = "bf16" }) end, M * N * 2)
      same(r:float(), want:to("bf16"):float(), what .. ": bf16 output")
      T.eq({c.syncs, c.subnormals}, {0, 0}, what .. " bf16 output: host syncs, subnormals")
      -- accumulate: acc += the product, as a separate f32 add
      local acc0 = nv.randn(M, N, {generator = nv.Generator(3)}) * 2.0 ^ -100
      local acc = acc0:cuda()
      _, c = spent(function() nv.qmatmul(qa, qb, { accumulate = acc }) end, M * N * 4)
      same(acc, acc0 + want, what .. ": accumulated")
      T.eq({c.syncs, c.subnormals}, {0, 0}, what .. " accumulated: host syncs, subnormals")
      -- random operands at that scale against the CPU's qmatmul (its sgemm path), within the order bound
      nv.manual_seed(23)
      local xa = nv.randn(M, K) * scale * 64
      local xb = nv.randn(N, K)
      local ca, cb = nv.quantize(xa, fmt), nv.quantize(xb, fmt)
      local got = nv.qmatmul(nv.quantize(xa:cuda(), fmt), nv.quantize(xb:cuda(), fmt)):cpu():totable()
      local want2, bound = nv.qmatmul(ca, cb):totable(), order_bound(ca, cb)
      for i = 1, M do
        for j = 1, N do
          T.ok(math.abs(got[i][j] - want2[i][j]) <= bound[i][j],
            string.format("%s random [%d,%d]: %.9g vs %.9g", what, i, j, got[i][j], want2[i][j]))
        end
      end
    end
  end
end)

T.case("sm_90: blocks of zero codes (scale byte 0) do not count in the range: no scaling, no fallback", function()
  need_sm90_emu()
  local M, N, K = 64, 96, 96
  for _, fmt in ipairs({ "mxfp8_e4m3", "mxfp4" }) do
    local A, B = exact_values(fmt, M, K, 71), exact_values(fmt, N, K, 72)
    for k = 33, 64 do A[2][k] = 0 end -- one all-zero block in a, one in b: their scale bytes are 0
    for k = 1, 32 do B[3][k] = 0 end
    local qa, qb = quantize_exact(A, fmt, nil, fmt .. " a"), quantize_exact(B, fmt, nil, fmt .. " b")
    T.eq(qa:scale_bytes():cpu():min(), 0, fmt .. ": a zero block's scale byte is 0")
    local r, c = spent(function() return nv.qmatmul(qa, qb) end, M * N * 4)
    same(r, nv.tensor(exact_product(A, B)), fmt .. ": exact product")
    T.eq({c.syncs, c.subnormals}, {0, 0}, fmt .. ": host syncs, subnormals met by the bf16 GEMM")
    T.ok(c.fallback ~= true, fmt .. ": no fallback")
    -- the same with the zero block's scale counted (a block of one tiny value instead): no longer on
    -- the bf16 GEMM unscaled, but scaled on the device (still no fallback, no subnormal)
    A[2][40] = 2.0 ^ -127
    local qt = quantize_exact(A, fmt, nil, fmt .. " a, a tiny block")
    r, c = spent(function() return nv.qmatmul(qt, qb) end, M * N * 4)
    same(r, nv.tensor(exact_product(A, B)), fmt .. ", a tiny block: exact product")
    T.eq({c.syncs, c.subnormals}, {0, 0}, fmt .. ", a tiny block: host syncs, subnormals")
    T.ok(c.fallback ~= true, fmt .. ", a tiny block: no fallback")
  end
end)

T.case("sm_90: exponent ranges no power-of-two scaling covers take the exact fallback on the device (no host sync)", function()
  need_sm90_emu()
  -- a's rows 1 and b's rows 2 hold blocks at scale 2^-127, a's row 2 and b's row 1 blocks at 2^100:
  -- products span 2^-272 .. 2^218, more than fp32's range, yet every element of the product is a
  -- sum of tiny x huge terms, exact in fp32. No shift keeps both ends (decide fails): the fallback
  -- kernel sums the exact fp32 products; the bf16 GEMM then adds nothing.
  local M, N, K = 128, 128, 64 -- outputs of 16 pages and more: the fallback's writes tell
  local fmt = "mxfp8_e4m3"
  local function row(scale0, scale1, seed)
    local r, x = G.rng(seed), {}
    for k = 1, K do x[k] = (k <= 32 and scale0 or scale1) * r(-8, 8) end
    x[1], x[33] = 8 * scale0, 8 * scale1
    return x
  end
  local A, B = {}, {}
  for i = 1, M do A[i] = i % 2 == 1 and row(2.0 ^ -127, 0, 80 + i) or row(0, 2.0 ^ 100, 80 + i) end
  for j = 1, N do B[j] = j % 2 == 1 and row(2.0 ^ 100, 0, 300 + j) or row(0, 2.0 ^ -127, 300 + j) end
  local qa, qb = quantize_exact(A, fmt, nil, "a"), quantize_exact(B, fmt, nil, "b")
  local want = nv.tensor(exact_product(A, B))
  T.ok(want:get(1, 1) ~= 0 and want:get(2, 2) ~= 0, "tiny x huge products are normal")
  for _, out in ipairs({ "f32", "bf16" }) do
    local r, c = spent(function() return nv.qmatmul(qa, qb, { out = out }) end, M * N * (out == "bf16" and 2 or 4))
    same(r:float(), out == "bf16" and want:to("bf16"):float() or want, out .. ": exact product")
    T.eq({c.syncs, c.subnormals}, {0, 0}, out .. ": host syncs, subnormals met by the bf16 GEMM")
    T.ok(c.fallback ~= false, out .. ": the fallback computed it")
  end
  local acc0 = nv.randn(M, N, {generator = nv.Generator(9)}) * 2.0 ^ -20
  local acc = acc0:cuda()
  local _, c = spent(function() nv.qmatmul(qa, qb, { accumulate = acc }) end, M * N * 4)
  same(acc, acc0 + want, "accumulated")
  T.eq(c.syncs, 0, "accumulated: host syncs")
  T.ok(c.fallback ~= false, "accumulated: the fallback computed it")
  -- an operand holding values past fp32's range (an infinity: its block scale is 2^127 and decodes to
  -- inf, as on the CPU) beside a tiny block: no shift (it would need one, and may take none); the
  -- fallback gives the CPU's infinities and NaNs, the zeroed bf16 operands add nothing (no NaN from
  -- inf x 0 there)
  do
    local Ai = {}
    for i = 1, M do Ai[i] = row(i == 3 and 2.0 ^ -127 or 1, 1, 700 + i) end
    Ai[5][40] = 1 / 0
    local qi = nv.quantize(nv.tensor(Ai):cuda(), fmt)
    local qbi = quantize_exact(B, fmt, nil, "b")
    local wanti = nv.qmatmul(nv.quantize(nv.tensor(Ai), fmt), nv.quantize(nv.tensor(B), fmt)):totable()
    local ri, ci = spent(function() return nv.qmatmul(qi, qbi) end, M * N * 4)
    local gi = ri:cpu():totable()
    local bad, infs = 0, 0
    for i = 1, M do
      for j = 1, N do
        local x, y = gi[i][j], wanti[i][j]
        if not (x == y or (x ~= x and y ~= y)) then bad = bad + 1 end
        if x ~= x or x == 1 / 0 or x == -1 / 0 then infs = infs + 1 end
      end
    end
    T.eq(bad, 0, "an infinity beside a tiny block: the CPU's product (inf and NaN included)")
    T.ok(infs > 0 and infs <= N, "only the infinity's row is not finite (" .. infs .. ")")
    T.eq(ci.syncs, 0, "an infinity beside a tiny block: host syncs")
    T.ok(ci.fallback ~= false, "an infinity beside a tiny block: the fallback computed it")
  end
  -- a bf16 operand is never scaled: one with a subnormal value (here with an mx partner) falls back
  local Bb, Am = {}, {}
  for j = 1, N do
    Bb[j] = {}
    for k = 1, K do Bb[j][k] = j % 2 == 1 and ((k + j) % 7 - 3) * 2.0 ^ -130 or (k + j) % 5 - 2 end
  end
  for i = 1, M do Am[i] = row(i % 3 == 0 and 2.0 ^ -10 or 1, 1, 500 + i) end
  local qbb, qm = core.quantize(nv.tensor(Bb):cuda(), "bf16"), quantize_exact(Am, fmt, nil, "mx partner")
  local wantb = nv.qmatmul(nv.quantize(nv.tensor(Am), fmt), core.quantize(nv.tensor(Bb), "bf16"))
  local rb
  rb, c = spent(function() return nv.qmatmul(qm, qbb) end, M * N * 4)
  same(rb, wantb, "mxfp8 x bf16 with bf16 subnormals: the CPU's (exact) product")
  -- the bf16 operand goes to the bf16 GEMM as it is (no copy): its own subnormal values meet the
  -- zeroed partner there, so only they count (no product or sum is subnormal)
  local nsub = 0
  for j = 1, N do for k = 1, K do nsub = nsub + ((Bb[j][k] ~= 0 and math.abs(Bb[j][k]) < 2.0 ^ -126) and 1 or 0) end end
  T.eq({c.syncs, c.subnormals}, {0, nsub}, "mxfp8 x bf16: host syncs, subnormals (the bf16 operand's own values only)")
  T.ok(c.fallback ~= false, "mxfp8 x bf16 with bf16 subnormals: the fallback computed it")
end)
