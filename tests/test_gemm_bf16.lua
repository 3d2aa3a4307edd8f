-- test_gemm_bf16.lua: the CPU's emulated GEMMs (nv.qmatmul) on its bf16 units through oneDNN
-- against the sgemm path (core.gemm_bf16(false)), for every format: nvfp4 (1x16 and 16x16 blocks),
-- mxfp4, mxfp8 e4m3/e5m2, fp8 e4m3/e5m2 per tensor, bf16. core.gemm_paths() says which path ran.
--
-- Exact inputs: values chosen so that quantizing them is exact (checked: q:dequantize() gives them
-- back) and every product and partial sum is exact in fp32 (small integers, or small multiples of
-- one power of two), so any summation order gives the exact sum: both paths must equal the exact
-- product, computed here in double from the inputs, bit for bit.
--
-- Random inputs: both paths sum the same products, each exact in fp32 (at most 8 x 8 significant
-- bits), in fp32 with one rounding per addition, in some order. Any order's result s^ satisfies
-- |s^ - s| <= gamma_(K-1) S, S = sum_k |a_k||b_k| over the decoded (unscaled) values, gamma_n =
-- n u / (1 - n u), u = 2^-24. Then alpha (the global factors) multiplies, one more rounding:
-- |fl(alpha s^1) - fl(alpha s^2)| <= |alpha| (2 gamma_(K-1) S + 2 u (1 + gamma_(K-1)) S) <= 2 gamma_K |alpha| S,
-- so c = 2. |alpha| S is computed here from q:dequantize() values d (each d = v alpha_x (1 + delta),
-- |delta| <= u, and alpha = fl(alpha_a alpha_b)): |alpha| S <= (1 + u)^3 / (1 - u)^2 sum |d_a||d_b|.
-- A bf16 output adds a rounding to 8 significant bits, u_b = 2^-8, on each side:
-- |o1 - o2| <= |x1 - x2| + u_b (|x1| + |x2|), |x_i| <= |o_i| / (1 - u_b).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = require "nvlua.core"

local G = dofile("tests/gemm_exact.lua") -- rng, exact_values, exact_product, order_bound
local exact_values, exact_product = G.exact_values, G.exact_product
local _, READY = core.gemm_bf16()

local function need_bf16()
  if not READY then T.skip("the bf16 GEMM path cannot run here: " .. nv.info().dnnl) end
end

-- r, paths = fn() with the bf16 path switched on (bf16 = true) or off; paths: how many GEMMs took each.
local function on_path(bf16, fn)
  local prev = core.gemm_bf16(bf16)
  local p0 = core.gemm_paths()
  local ok, r = pcall(fn)
  core.gemm_bf16(prev)
  if not ok then error(r, 0) end
  local p1 = core.gemm_paths()
  return r, {bf16 = p1.bf16 - p0.bf16, sgemm = p1.sgemm - p0.sgemm}
end

local function same(a, b, what)
  T.eq(a:size(), b:size(), what .. ": shape")
  local n = a:eq(b):sum()
  T.ok(n == a:numel(), string.format("%s: %d of %d elements differ", what, a:numel() - n, a:numel()))
end

local function quantize_exact(x, fmt, opts, what)
  local t = nv.tensor(x)
  local q = nv.quantize(t, fmt, opts)
  same(q:dequantize(), t, what .. ": the inputs quantize exactly")
  return q
end

local FORMATS = {{"nvfp4"}, {"nvfp4", block = "2d"}, {"mxfp4"}, {"mxfp8_e4m3"}, {"mxfp8_e5m2"}, {"e4m3"}, {"e5m2"},
  {"bf16"}}
local function fmt_name(f) return f[1] .. (f.block and " " .. f.block or "") end

T.case("every format, exact inputs: both paths give the exact product bit for bit (f32, bf16, accumulate)", function()
  need_bf16()
  for n, f in ipairs(FORMATS) do
    local what = fmt_name(f)
    -- odd shapes: M, N not multiples of 16 (16x16 blocks need rows % 16 == 0), K the block's multiple
    local M, N, K = 37, 53, 96
    if f.block then M, N, K = 48, 32, 80 end
    local A, B = exact_values(f[1], M, K, 10 + n, f), exact_values(f[1], N, K, 20 + n, f)
    local opts = f.block and {block = f.block} or nil
    local qa, qb = quantize_exact(A, f[1], opts, what .. " a"), quantize_exact(B, f[1], opts, what .. " b")
    local want = nv.tensor(exact_product(A, B))
    local r1, p1 = on_path(true, function() return nv.qmatmul(qa, qb) end)
    local r0, p0 = on_path(false, function() return nv.qmatmul(qa, qb) end)
    T.eq(p1, {bf16 = 1, sgemm = 0}, what .. ": the bf16 path ran")
    T.eq(p0, {bf16 = 0, sgemm = 1}, what .. ": switched off, sgemm ran")
    same(r1, want, what .. ": bf16 path = exact product")
    same(r0, want, what .. ": sgemm path = exact product")
    local b1 = on_path(true, function() return nv.qmatmul(qa, qb, {out = "bf16"}) end)
    local b0 = on_path(false, function() return nv.qmatmul(qa, qb, {out = "bf16"}) end)
    same(b1, b0, what .. ": bf16 output, both paths")
    same(b1, want:to("bf16"), what .. ": bf16 output = the exact product rounded once")
    local y0 = nv.tensor(exact_values("bf16", M, N, 30 + n))
    local y1, y0c = y0:clone(), y0:clone()
    on_path(true, function() return nv.qmatmul(qa, qb, {accumulate = y1}) end)
    on_path(false, function() return nv.qmatmul(qa, qb, {accumulate = y0c}) end)
    same(y1, y0 + want, what .. ": accumulate on the bf16 path")
    same(y0c, y0 + want, what .. ": accumulate on sgemm")
  end
end)

T.case("bf16 output written by the bf16 units: NaN, inf, an overflow and exact ties as the f32 result rounded", function()
  -- bf16 operands (alpha 1): oneDNN rounds its fp32 sums to bf16 itself; every sum here is exact (small
  -- integers and powers of two), so it must equal the sgemm path's f32 result rounded once (RNE)
  need_bf16()
  local K = 32
  local A, B = {}, {}
  for i = 1, 6 do
    A[i] = {}
    for k = 1, K do A[i][k] = (i * 7 + k * 3) % 9 - 4 end
  end
  for j = 1, 5 do
    B[j] = {}
    for k = 1, K do B[j][k] = (j * 5 + k) % 7 - 3 end
  end
  A[1][1], A[2][5], B[3][2] = 1 / 0, 0 / 0, -1 / 0                 -- inf and NaN in the sums
  for k = 1, K do A[4][k] = 2 ^ 120 end                              -- row 4 x column 1: 32 * 2^120 * b: inf
  for k = 1, K do B[1][k] = k == 1 and 256 or k == 2 and 1 or 0 end -- column 1: 256 a1 + a2
  A[5][1], A[5][2], A[6][1], A[6][2] = 1, 1, 1, 3                    -- 257, 259: ties (-> 256, 260)
  local qa, qb = nv.quantize(nv.tensor(A):to("bf16"), "bf16"), nv.quantize(nv.tensor(B):to("bf16"), "bf16")
  local b1, p1 = on_path(true, function() return nv.qmatmul(qa, qb, {out = "bf16"}) end)
  local f0 = on_path(false, function() return nv.qmatmul(qa, qb) end)
  T.eq(p1, {bf16 = 1, sgemm = 0}, "the bf16 path ran")
  local got, want = b1:to("f32"):totable(), f0:to("bf16"):to("f32"):totable()
  local nans = 0
  for i = 1, 6 do
    for j = 1, 5 do
      local g, w = got[i][j], want[i][j]
      if w ~= w then nans = nans + 1 end
      T.ok(g == w or (g ~= g and w ~= w), string.format("[%d][%d]: %s vs %s", i, j, tostring(g), tostring(w)))
    end
  end
  T.ok(nans > 0 and want[4][1] == math.huge, "the case holds NaN sums and an overflow to inf")
  T.eq({got[5][1], got[6][1]}, {256, 260}, "ties round to even")
end)

T.case("f32 matmul through oneDNN: strided and transposed views, within fp32 summation order of the reference", function()
  -- Tensor:matmul on f32 runs oneDNN's f32 matmul where the bf16 path can run (the same switch), OpenBLAS else;
  -- both sum the same fp32 products in their own order: |got - ref| <= 2 K u sum_k |a_ik||b_kj| (u = 2^-24)
  need_bf16()
  nv.manual_seed(41)
  local A, B = nv.randn(90, 70), nv.randn(50, 70)
  local views = {
    {"a b^T", A, B:transpose()},
    {"a^T-view of a transposed copy", A:transpose():contiguous():transpose(), B:transpose()},
    {"narrowed rows and columns", A:narrow(1, 3, 80):narrow(2, 5, 60), B:narrow(2, 5, 60):transpose()},
  }
  for _, v in ipairs(views) do
    local what, a, b = v[1], v[2], v[3]
    local K = a:size(2)
    local ref = T.with(nv.use_reference, true, a.matmul, a, b)
    local bound = a:abs():matmul(b:abs()) * (2 * K * 2 ^ -24)
    local got = on_path(true, function() return a:matmul(b) end)
    local blas = on_path(false, function() return a:matmul(b) end)
    T.eq((got - ref):abs():le(bound):sum(), got:numel(), what .. ": oneDNN within the bound")
    T.eq((blas - ref):abs():le(bound):sum(), blas:numel(), what .. ": OpenBLAS within the bound")
  end
end)

-- the summation-order bound of the header for out = qa qb^T: per element, 2 gamma_K |alpha| S
local order_bound = G.order_bound

local function within(got, ref, bound, ub, what)
  local g, r = got:float():totable(), ref:float():totable()
  for i = 1, #g do
    for j = 1, #g[i] do
      local d, b = math.abs(g[i][j] - r[i][j]), bound[i][j]
      if ub then b = b + ub * (math.abs(g[i][j]) + math.abs(r[i][j])) / (1 - ub) end
      if not (d <= b) then
        error(string.format("%s: [%d,%d] %.9g vs %.9g, |diff| %.3g > bound %.3g", what, i, j, g[i][j], r[i][j],
          d, b), 2)
      end
    end
  end
end

T.case("every format, random inputs: the paths differ by at most the summation-order bound", function()
  need_bf16()
  nv.manual_seed(17)
  for _, f in ipairs(FORMATS) do
    local what = fmt_name(f)
    local M, N, K = 29, 41, 160
    if f.block then M, N = 32, 48 end
    local opts = f.block and {block = f.block} or nil
    local qa = nv.quantize(nv.randn(M, K) * nv.randn(M, 1):exp(), f[1], opts)
    local qb = nv.quantize(nv.randn(N, K) * 0.05, f[1], opts)
    local bound = order_bound(qa, qb)
    local r1, p1 = on_path(true, function() return nv.qmatmul(qa, qb) end)
    local r0 = on_path(false, function() return nv.qmatmul(qa, qb) end)
    T.eq(p1.bf16, 1, what .. ": the bf16 path ran")
    within(r1, r0, bound, nil, what .. " f32")
    local b1 = on_path(true, function() return nv.qmatmul(qa, qb, {out = "bf16"}) end)
    local b0 = on_path(false, function() return nv.qmatmul(qa, qb, {out = "bf16"}) end)
    within(b1, b0, bound, 2.0 ^ -8, what .. " bf16 output")
    -- accumulate is the product, then a separate fp32 add, on the bf16 path too
    local y0 = nv.randn(M, N)
    local y = y0:clone()
    on_path(true, function() return nv.qmatmul(qa, qb, {accumulate = y}) end)
    same(y, y0 + r1, what .. ": accumulate = y + the product, bit for bit")
  end
end)

T.case("large N: B decoded in chunks of rows, every chunk on the bf16 path, exact", function()
  need_bf16()
  -- K = 4096: chunks of 2^22 / K = 1024 rows; N = 2100 = 1024 + 1024 + 52. B is 21 distinct rows,
  -- each repeated 100 times (row r is pattern row floor(r / 100)), so the exact product is cheap.
  local M, K = 3, 4096
  for n, f in ipairs({{"nvfp4", scales = {448, 256}}, {"mxfp8_e4m3"}, {"bf16"}}) do
    local A, P = exact_values(f[1], M, K, 40 + n, f), exact_values(f[1], 21, K, 50 + n, f)
    local b = nv.tensor(P):view(21, 1, K):expand(21, 100, K):contiguous():view(2100, K)
    local qa, qb = quantize_exact(A, f[1], nil, f[1] .. " a"), nv.quantize(b, f[1])
    local small = exact_product(A, P)
    local want = {}
    for i = 1, M do
      want[i] = {}
      for j = 1, 2100 do want[i][j] = small[i][(j - 1) // 100 + 1] end
    end
    want = nv.tensor(want)
    local r1, p1 = on_path(true, function() return nv.qmatmul(qa, qb) end)
    T.eq(p1, {bf16 = 1, sgemm = 0}, f[1] .. ": the bf16 path ran")
    same(r1, want, f[1] .. ": chunked product = exact")
    local y = nv.zeros(M, 2100) + 1
    on_path(true, function() return nv.qmatmul(qa, qb, {accumulate = y}) end)
    same(y, want + 1, f[1] .. ": chunked accumulate = exact")
  end
end)

T.case("values outside bf16's normal range run on sgemm, exactly; tiny but normal ones on bf16", function()
  need_bf16()
  -- mxfp4, row 1 of A at block scale 2^-127: its values 0.5 * 2^-127 .. 6 * 2^-127 are exact in
  -- fp32 but subnormal in bf16 (which the bf16 units flush to zero), so the GEMM must stay on sgemm.
  local M, N, K = 5, 7, 64
  for _, case in ipairs({{scale = 2.0 ^ -127, path = "sgemm"}, {scale = 2.0 ^ -119, path = "bf16"}}) do
    local A, B = exact_values("mxfp4", M, K, 61), exact_values("mxfp4", N, K, 62)
    for k = 1, K do A[1][k] = (k % 32 == 1 and 6 or (k % 5) - 2) * case.scale end
    local qa, qb = quantize_exact(A, "mxfp4", nil, "tiny a"), quantize_exact(B, "mxfp4", nil, "b")
    local want = nv.tensor(exact_product(A, B))
    local r, p = on_path(true, function() return nv.qmatmul(qa, qb) end)
    T.eq(p[case.path], 1, string.format("scale %g: the %s path ran", case.scale, case.path))
    same(r, want, string.format("scale %g: exact product", case.scale))
    T.ok(r:get(1, 1) ~= 0 or want:get(1, 1) == 0, "row 1 not flushed")
  end
  -- bf16 operands: a subnormal bf16 value (2^-130) sends the GEMM to sgemm
  local A, B = exact_values("bf16", 4, 32, 63), exact_values("bf16", 6, 32, 64)
  A[2][3] = 2.0 ^ -130
  local qa, qb = nv.quantize(nv.tensor(A), "bf16"), nv.quantize(nv.tensor(B), "bf16")
  local r, p = on_path(true, function() return nv.qmatmul(qa, qb) end)
  T.eq(p, {bf16 = 0, sgemm = 1}, "bf16 subnormal: sgemm ran")
  same(r, nv.tensor(exact_product(A, B)), "bf16 subnormal: exact product")
end)

T.case("the primitive cache: more shapes than it holds, then the first again", function()
  need_bf16()
  local B = exact_values("bf16", 5, 32, 71)
  local qb = nv.quantize(nv.tensor(B), "bf16")
  for m = 1, 70 do
    local A = exact_values("bf16", m, 32, 100 + m)
    local r, p = on_path(true, function() return nv.qmatmul(nv.quantize(nv.tensor(A), "bf16"), qb) end)
    T.eq(p.bf16, 1, "m = " .. m .. ": bf16 path")
    same(r, nv.tensor(exact_product(A, B)), "m = " .. m)
  end
  local A = exact_values("bf16", 1, 32, 101)
  same(on_path(true, function() return nv.qmatmul(nv.quantize(nv.tensor(A), "bf16"), qb) end),
    nv.tensor(exact_product(A, B)), "m = 1 again")
end)

T.case("nv.use_reference(true) runs the reference GEMM, neither CPU path", function()
  local qa, qb = nv.quantize(nv.randn(8, 32), "nvfp4"), nv.quantize(nv.randn(4, 32), "nvfp4")
  local fast = nv.qmatmul(qa, qb)
  local prev = nv.use_reference(true)
  local p0 = core.gemm_paths()
  local ok, r = pcall(nv.qmatmul, qa, qb)
  local p1 = core.gemm_paths()
  nv.use_reference(prev)
  assert(ok, r)
  T.eq(p1, p0, "no CPU-table GEMM ran")
  T.eq(r:size(), fast:size())
end)

T.case("NVLUA_DNNL=0 keeps every GEMM on sgemm; core.gemm_bf16 checks its argument", function()
  local script = "local nv = require 'nvlua'; local core = require 'nvlua.core'; " ..
    "local _, ready = core.gemm_bf16(); " ..
    "nv.qmatmul(nv.quantize(nv.randn(4, 32), 'nvfp4'), nv.quantize(nv.randn(4, 32), 'nvfp4')); " ..
    "local p = core.gemm_paths(); print(tostring(ready), p.bf16, p.sgemm); print(nv.info().dnnl)"
  local r = T.run_nvlua("-e " .. T.shq(script), {env = {NVLUA_DNNL = "0"}})
  T.eq(r.code, 0, r.err)
  local ready, nb, ns, info = r.out:match("^(%a+)\t(%d+)\t(%d+)\n(.-)\n$")
  T.eq({ready, nb, ns}, {"false", "0", "1"}, "not ready, one sgemm GEMM: " .. r.out)
  T.ok(info:match("NVLUA_DNNL=0") or info:match("not compiled in"), "info says why: " .. info)
  T.raises(function() core.gemm_bf16("yes") end, "boolean expected")
end)
