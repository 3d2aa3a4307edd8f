-- test_cuda_gemm_emu.lua: the emulated block-scaled GEMMs on an sm_90 device (kernels/cuda/gemm.cu
-- emulated_gemm): nvfp4 (1x16 and 16x16 blocks), mxfp4, mxfp8 e4m3/e5m2 operands dequantized to bf16
-- (global factors left to alpha) and one cuBLASLt bf16 x bf16 -> fp32 GEMM; where a block scale
-- takes values below bf16's normal range (the CPU's rule, NUMERICS §7), the fp32 fallback. Results
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

local function launches(name)
  local k = core.cuda_emu_counters().kernels[name]
  return k and k.launches or 0
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
    local f32_before = launches("dequant_f32_kernel")
    same(nv.qmatmul(qa, qb), nv.tensor(exact_product(A, B)), what .. ": exact inputs")
    T.eq(launches("dequant_f32_kernel") - f32_before, 0, what .. ": no fp32 fallback")
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

T.case("sm_90: an MX block scale of 2^-127 takes the fp32 fallback, exactly; in-range tiny scales stay on bf16", function()
  need_sm90_emu()
  local M, N, K = 5, 7, 64
  -- in range: every value >= 2^-126 and lo_a + lo_b >= -126 (lo: the element's lowest bit times
  -- the smallest block scale; b's lo is -1 (mxfp4, scale 1) / -14 (mxfp8: amax 8 -> scale 2^-5, e4m3 2^-9))
  for _, fc in ipairs({ { "mxfp4", 2.0 ^ -119 }, { "mxfp8_e4m3", 2.0 ^ -90 } }) do
    local fmt = fc[1]
    for _, case in ipairs({ { scale = 2.0 ^ -127, fallback = 1 }, { scale = fc[2], fallback = 0 } }) do
      local A, B = exact_values(fmt, M, K, 61), exact_values(fmt, N, K, 62)
      for k = 1, K do A[1][k] = (k % 32 == 1 and 4 or (k % 5) - 2) * case.scale end
      local what = string.format("%s, scale %g", fmt, case.scale)
      local qa, qb = quantize_exact(A, fmt, nil, what .. " a"), quantize_exact(B, fmt, nil, what .. " b")
      local before = launches("dequant_f32_kernel")
      local r = nv.qmatmul(qa, qb)
      T.eq(launches("dequant_f32_kernel") - before, 2 * case.fallback, what .. ": fp32 fallback (both operands)")
      local want = nv.tensor(exact_product(A, B))
      same(r, want, what .. ": exact product")
      T.ok(want:get(1, 1) == 0 or r:cpu():get(1, 1) ~= 0, what .. ": row 1 not flushed")
      same(nv.qmatmul(qa, qb, { out = "bf16" }):float(), want:to("bf16"):float(), what .. ": bf16 output")
    end
  end
end)
