-- tests/gemm_exact.lua: inputs whose GEMM every summation order gets exactly, the exact product, and
-- the summation-order bound of two fp32 GEMMs over the same exact products; shared by
-- test_gemm_bf16.lua (the CPU's bf16 units vs sgemm) and test_cuda_gemm_emu.lua (sm_90's bf16 GEMM
-- vs the CPU), whose headers derive the bound. Not a test file: loaded with dofile.
local M = {}

M.U = 2.0 ^ -24

--- M.rng(seed) -> r: a deterministic integer generator (an LCG), r(lo, hi) in [lo, hi]
function M.rng(seed)
  local s = seed
  return function(lo, hi)
    s = (s * 1103515245 + 12345) % 2147483648
    return lo + (s >> 8) % (hi - lo + 1)
  end
end

--- M.exact_values(fmt, M, K, seed [, opts]) -> (M, K) nested table of values fmt quantizes exactly:
-- ints for the mx formats, fp8 with amax 7 (a power-of-two scale), bf16; nvfp4 (opts.block "2d" for
-- 16x16 blocks): e2m1 values times block scales from opts.scales (ue4m3 values; default 448, 256, 64,
-- 8) times 2^-9, one +-6 per block and a 448 block first, so amax = 5.25 and d = 2^-9 exactly.
function M.exact_values(fmt, rows, K, seed, opts)
  opts = opts or {}
  local r, x = M.rng(seed), {}
  for i = 1, rows do x[i] = {} end
  if fmt == "nvfp4" then
    local bh, scales = opts.block == "2d" and 16 or 1, opts.scales or {448, 256, 64, 8}
    for i0 = 1, rows, bh do
      for k0 = 1, K, 16 do
        local f = (i0 == 1 and k0 == 1 and 448 or scales[r(1, #scales)]) * 2.0 ^ -9
        local pi, pk = r(0, bh - 1), r(0, 15)
        for i = i0, i0 + bh - 1 do
          for k = k0, k0 + 15 do
            local e = (i - i0 == pi and k - k0 == pk) and (r(0, 1) == 0 and -6 or 6) or r(-4, 4)
            x[i][k] = e * f
          end
        end
      end
    end
    return x
  end
  local lim = ({mxfp4 = 4, mxfp8_e4m3 = 8, mxfp8_e5m2 = 8, e4m3 = 7, e5m2 = 7, bf16 = 64})[fmt]
  for i = 1, rows do
    for k = 1, K do x[i][k] = r(-lim, lim) end
  end
  if fmt == "e4m3" or fmt == "e5m2" then x[1][1] = 7 end
  return x
end

--- M.exact_product(A, B) -> the exact A B^T of nested tables (double; exact for the inputs above)
function M.exact_product(A, B)
  local C = {}
  for i = 1, #A do
    C[i] = {}
    for j = 1, #B do
      local s = 0.0
      for k = 1, #A[i] do s = s + A[i][k] * B[j][k] end
      C[i][j] = s
    end
  end
  return C
end

--- M.order_bound(qa, qb) -> per element of qa qb^T (on any device): 2 gamma_K |alpha| S, with
-- |alpha| S bounded from the dequantized values by (1 + u)^3 / (1 - u)^2 sum |d_a||d_b|
function M.order_bound(qa, qb)
  local U = M.U
  local da, db = qa:dequantize():cpu():totable(), qb:dequantize():cpu():totable()
  local K = #da[1]
  local gamma, f = K * U / (1 - K * U), (1 + U) ^ 3 / (1 - U) ^ 2
  local bound = {}
  for i = 1, #da do
    bound[i] = {}
    for j = 1, #db do
      local s = 0.0
      for k = 1, K do s = s + math.abs(da[i][k] * db[j][k]) end
      bound[i][j] = 2 * gamma * f * s
    end
  end
  return bound
end

return M
