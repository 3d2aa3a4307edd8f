-- test_matmul.lua: a:matmul(b) on the CPU against a naive triple loop written in Lua — many
-- shapes (vectors as 1xK / Mx1 matrices, K = 1, odd sizes), batched operands with broadcast
-- batch dims, strided operands (transposed, narrowed, expanded with stride 0), bf16 operands
-- (an fp32 product rounded once to bf16), and the errors for operands it cannot take.
-- Not here: quantized GEMMs, CUDA.
--
-- Tolerance. The reference is summed in double from the exact input values. The implementation
-- sums K products in fp32 (OpenBLAS sgemm, any order, FMA or not); the classic bound for a
-- floating-point dot product is |fl(sum) - sum| <= gamma_K * sum_k |a_k||b_k|, gamma_K =
-- K*u/(1 - K*u), u = 2^-24 for fp32. We allow K * 2^-23 * sum_k |a_k||b_k| per element (= 2Ku,
-- which covers gamma_K for every K here), computed per element in Lua. The double reference's
-- own error (K * 2^-53 relative) is far below that.
local T = require "nvlua.test"
local nv = require "nvlua"

local U32 = 2.0 ^ -23

-- C = A B for nested tables A [M][K], B [K][N]; also the per-element error bound.
local function naive(A, B, M, K, N)
  local C, E = {}, {}
  for i = 1, M do
    C[i], E[i] = {}, {}
    for j = 1, N do
      local s, sa = 0.0, 0.0
      for k = 1, K do
        local p = A[i][k] * B[k][j]
        s = s + p
        sa = sa + math.abs(p)
      end
      C[i][j] = s
      E[i][j] = K * U32 * sa
    end
  end
  return C, E
end

-- got (nested table [M][N]) against the naive product of A and B within the fp32 bound.
local function check(got, A, B, M, K, N, what)
  T.eq(#got, M, what .. ": rows")
  local C, E = naive(A, B, M, K, N)
  for i = 1, M do
    T.eq(#got[i], N, what .. ": columns")
    for j = 1, N do
      local g = got[i][j]
      if not (math.abs(g - C[i][j]) <= E[i][j]) then
        error(string.format("%s: [%d,%d] = %.9g, want %.9g within %.3g (K=%d)", what, i, j, g, C[i][j], E[i][j], K), 2)
      end
    end
  end
end

-- a:matmul(b) for 2-D a, b against the naive product of their values (read with totable, so a
-- strided operand is read through its own strides).
local function check2(a, b, what)
  local M, K, N = a:size(1), a:size(2), b:size(2)
  local r = a:matmul(b)
  T.eq(r:size(), {M, N}, what .. ": result shape")
  T.eq(r:dtype(), "f32", what .. ": result dtype")
  check(r:totable(), a:totable(), b:totable(), M, K, N, what)
end

T.case("2-D shapes: vectors, K = 1, odd and larger sizes", function()
  nv.manual_seed(101)
  local shapes = {
    {1, 7, 5}, {6, 9, 1}, {1, 9, 1}, {4, 1, 3}, {1, 1, 1}, {7, 13, 5}, {64, 33, 17},
    {3, 64, 2}, {16, 16, 16}, {2, 300, 3}, {33, 2, 31}, {5, 128, 9},
  }
  for _, s in ipairs(shapes) do
    local M, K, N = s[1], s[2], s[3]
    local a, b = nv.randn(M, K), nv.randn(K, N)
    check2(a, b, string.format("[%d,%d]x[%d,%d]", M, K, K, N))
  end
  -- the module function is the same op
  local a, b = nv.randn(3, 4), nv.randn(4, 2)
  T.eq(nv.matmul(a, b):totable(), a:matmul(b):totable())
end)

T.case("exact small-integer products, by hand", function()
  -- every product and partial sum is a small integer, exact in fp32 in any order
  local a = nv.tensor({{1, 2}, {3, 4}, {5, 6}})
  local b = nv.tensor({{7, 8, 9}, {10, 11, 12}})
  T.eq(a:matmul(b):totable(), {{27, 30, 33}, {61, 68, 75}, {95, 106, 117}})
  T.eq(nv.tensor({{2}}):matmul(nv.tensor({{-3}})):totable(), {{-6}})
  T.eq(nv.tensor({{1, 1, 1}}):matmul(nv.tensor({{1}, {2}, {3}})):totable(), {{6}}, "row times column")
  T.eq(nv.tensor({{1}, {2}}):matmul(nv.tensor({{3, 4}})):totable(), {{3, 4}, {6, 8}}, "outer product (K = 1)")
end)

T.case("empty dims: M = 0, N = 0, K = 0 (K = 0 gives zeros)", function()
  T.eq(nv.zeros(0, 3):matmul(nv.zeros(3, 2)):size(), {0, 2})
  T.eq(nv.zeros(2, 3):matmul(nv.zeros(3, 0)):size(), {2, 0})
  -- leave non-zero bytes in the allocator's free lists, so an output that is never written
  -- cannot pass by reading fresh zeroed pages
  for _ = 1, 4 do nv.full({2, 3}, 7, "f32"):free(); nv.full({3, 2, 3}, 7, "f32"):free() end
  local z = nv.ones(2, 0):matmul(nv.ones(0, 3))
  T.eq(z:size(), {2, 3})
  T.eq(z:totable(), {{0, 0, 0}, {0, 0, 0}}, "an empty sum is 0")
  local zb = nv.ones(3, 2, 0):matmul(nv.ones(3, 0, 3))
  T.eq(zb:size(), {3, 2, 3})
  T.eq(zb:sum(), 0, "batched, an empty sum is 0")
  T.eq(nv.ones(2, 0, "bf16"):matmul(nv.ones(0, 3, "bf16")):totable(), {{0, 0, 0}, {0, 0, 0}}, "bf16")
end)

T.case("strided operands: transposed, narrowed, expanded (stride 0), selected", function()
  nv.manual_seed(102)
  for _, s in ipairs({{7, 13, 5}, {1, 8, 6}, {6, 8, 1}, {64, 33, 17}, {5, 1, 4}}) do
    local M, K, N = s[1], s[2], s[3]
    local tag = string.format(" [%d,%d]x[%d,%d]", M, K, K, N)
    local at, bt = nv.randn(K, M):t(), nv.randn(N, K):t()
    local a, b = nv.randn(M, K), nv.randn(K, N)
    check2(at, b, "transposed a" .. tag)
    check2(a, bt, "transposed b" .. tag)
    check2(at, bt, "both transposed" .. tag)
    local an = nv.randn(M + 3, K + 5):narrow(1, 2, M):narrow(2, 4, K)
    local bn = nv.randn(K + 2, N + 7):narrow(1, 3, K):narrow(2, 2, N)
    check2(an, b, "narrowed a" .. tag)
    check2(an, bn, "narrowed a and b" .. tag)
    check2(nv.randn(K + 4, M + 1):narrow(1, 2, K):t():narrow(1, 1, M), bn, "narrowed then transposed a" .. tag)
    local ae = nv.randn(1, K):expand(M, K)
    local be = nv.randn(K, 1):expand(K, N)
    if M > 1 then T.eq(ae:stride(1), 0, "expand gives stride 0" .. tag) end
    check2(ae, b, "expanded a (stride 0 rows)" .. tag)
    check2(a, be, "expanded b (stride 0 columns)" .. tag)
    check2(ae, be, "both expanded" .. tag)
    check2(nv.randn(1, 1):expand(M, K), nv.randn(1, 1):expand(K, N), "fully expanded scalars" .. tag)
    local a3 = nv.randn(M, 3, K)
    check2(a3:select(2, 2), b, "selected a (row stride 3K)" .. tag)
  end
end)

T.case("batched: [B,M,K]x[B,K,N], [M,K]x[B,K,N], broadcast [2,1,M,K]x[3,K,N]", function()
  nv.manual_seed(103)
  local M, K, N = 4, 7, 3
  local a, b = nv.randn(5, M, K), nv.randn(5, K, N)
  local r = a:matmul(b)
  T.eq(r:size(), {5, M, N})
  local at, bt, rt = a:totable(), b:totable(), r:totable()
  for i = 1, 5 do check(rt[i], at[i], bt[i], M, K, N, "batch " .. i) end

  local a2 = nv.randn(M, K)
  r = a2:matmul(b)
  T.eq(r:size(), {5, M, N}, "a 2-D a broadcasts over b's batch")
  rt = r:totable()
  for i = 1, 5 do check(rt[i], a2:totable(), bt[i], M, K, N, "2-D x batched, batch " .. i) end

  local a4 = nv.randn(2, 1, M, K)
  local b3 = nv.randn(3, K, N)
  r = a4:matmul(b3)
  T.eq(r:size(), {2, 3, M, N}, "[2,1,M,K] x [3,K,N]")
  local a4t, b3t = a4:totable(), b3:totable()
  rt = r:totable()
  for i = 1, 2 do
    for j = 1, 3 do check(rt[i][j], a4t[i][1], b3t[j], M, K, N, string.format("broadcast batch (%d,%d)", i, j)) end
  end

  -- strided batches: transposed inner dims, a permuted batch dim, an expanded batch
  local atr = nv.randn(3, K, M):transpose(2, 3)                  -- [3,M,K], inner dims transposed
  local bp = nv.randn(K, 3, N):permute(2, 1, 3)                   -- [3,K,N], batch dim not outermost
  local bex = nv.randn(1, K, N):expand(3, K, N)                   -- batch stride 0
  for name, pair in pairs({["transposed a"] = {atr, bp}, ["expanded b"] = {atr, bex}}) do
    local x, y = pair[1], pair[2]
    local rr = x:matmul(y)
    T.eq(rr:size(), {3, M, N})
    local xt, yt, rrt = x:totable(), y:totable(), rr:totable()
    for i = 1, 3 do check(rrt[i], xt[i], yt[i], M, K, N, name .. ", batch " .. i) end
  end
end)

-- bf16 ulp at |x|: 2^(e-7) for x in [2^e, 2^(e+1)); fixed at 2^-133 below 2^-126.
local function bf16_ulp(x)
  x = math.abs(x)
  if x < 2.0 ^ -126 then return 2.0 ^ -133 end
  local e = ((string.unpack("<I8", string.pack("<d", x)) >> 52) & 0x7ff) - 1023
  return 2.0 ^ (e - 7)
end

T.case("bf16 operands: the fp32 product rounded once to bf16", function()
  -- The implementation widens bf16 operands to fp32 (exact), multiplies in fp32 and rounds the
  -- result once to bf16 (core/ops.c nvl_matmul). So with f the fp32 result, |f - exact| <= the
  -- fp32 bound E above, and the bf16 result is f rounded to nearest: |got - f| <= 1/2 ulp. We
  -- allow |got - exact| <= E + 1 bf16 ulp of max(|got|, |exact|), a margin over the 1/2 ulp.
  nv.manual_seed(104)
  for _, s in ipairs({{1, 9, 4}, {7, 13, 5}, {64, 33, 17}, {6, 1, 6}, {3, 200, 2}}) do
    local M, K, N = s[1], s[2], s[3]
    local a, b = nv.randn(M, K):to("bf16"), nv.randn(K, N):to("bf16")
    local r = a:matmul(b)
    T.eq(r:dtype(), "bf16", "bf16 x bf16 gives bf16")
    T.eq(r:size(), {M, N})
    local C, E = naive(a:totable(), b:totable(), M, K, N)
    local got = r:totable()
    for i = 1, M do
      for j = 1, N do
        local g, c = got[i][j], C[i][j]
        local tol = E[i][j] + bf16_ulp(math.max(math.abs(g), math.abs(c)))
        if not (math.abs(g - c) <= tol) then
          error(string.format("bf16 [%d,%d,%d] at [%d,%d]: got %.9g, want %.9g within %.3g", M, K, N, i, j, g, c, tol))
        end
      end
    end
    -- the contract itself: the same bits as the fp32 product of the same values, cast once
    T.eq(got, a:to("f32"):matmul(b:to("f32")):to("bf16"):totable(), "bf16 result = bf16(fp32 matmul)")
    -- a strided bf16 operand gives the same
    T.eq(a:t():clone():t():matmul(b):totable(), got, "transposed bf16 operand")
  end
  -- rounded once at the end, not per partial sum: 256 + 1 + 1 + 1 = 259 is exact in fp32 and
  -- rounds to 260 in bf16 (259 lies halfway between 258 and 260; 260 has the even significand).
  -- Rounding each partial sum to bf16 would give 256.
  local a = nv.tensor({{1, 1, 1, 1}}, "bf16")
  local b = nv.tensor({{256}, {1}, {1}, {1}}, "bf16")
  T.eq(a:matmul(b)[1][1], 260)
  -- a tie rounds to even: 257 -> 256
  T.eq(nv.tensor({{1, 1}}, "bf16"):matmul(nv.tensor({{256}, {1}}, "bf16"))[1][1], 256)
end)

T.case("bf16 batched operands, broadcast batch dims: each batch the fp32 product rounded once", function()
  nv.manual_seed(105)
  local M, K, N = 3, 10, 4
  local a = nv.randn(2, 1, M, K):to("bf16")
  local b = nv.randn(3, K, N):to("bf16")
  local r = a:matmul(b)
  T.eq(r:dtype(), "bf16")
  T.eq(r:size(), {2, 3, M, N})
  T.eq(r:totable(), a:to("f32"):matmul(b:to("f32")):to("bf16"):totable(), "= bf16(fp32 matmul of the widened values)")
end)

T.case("mixed dtypes: matmul raises naming both (PyTorch's rule); elementwise ops promote to f32", function()
  -- one rule, stated in README "Tensors": a product of bf16 and f32 would have to pick a result
  -- dtype silently, so it is refused; elementwise ops promote as PyTorch's do
  nv.manual_seed(106)
  local a, b = nv.randn(4, 8):to("bf16"), nv.randn(8, 3)
  local e = T.raises(function() return a:matmul(b) end, "matmul")
  T.ok(e:find("[4,8] bf16", 1, true) and e:find("[8,3] f32", 1, true), "names both operands and dtypes: " .. e)
  T.ok(e:find("b:to('bf16')", 1, true) and e:find("a:to('f32')", 1, true), "says how to convert: " .. e)
  e = T.raises(function() return nv.matmul(b:t(), a:t()) end, "matmul")
  T.ok(e:find("a is [3,8] f32", 1, true) and e:find("b is [8,4] bf16", 1, true), "f32 x bf16 too: " .. e)
  T.raises(function() return nv.randn(2, 4, 8):matmul(nv.randn(2, 8, 3):to("bf16")) end, "convert one")
  -- converting either way is what the message offers; both give the widened f32 product
  local want = a:to("f32"):matmul(b)
  T.eq(want:dtype(), "f32")
  T.eq(a:matmul(b:to("bf16")):dtype(), "bf16", "bf16 x bf16 stays bf16")
  -- elementwise: bf16 op f32 -> f32, the bf16 operand widened exactly (every bf16 value is an f32)
  local x, y = nv.randn(4, 8):to("bf16"), nv.randn(4, 8)
  for _, op in ipairs({"add", "sub", "mul", "div"}) do
    local f = ({add = function(p, q) return p + q end, sub = function(p, q) return p - q end,
      mul = function(p, q) return p * q end, div = function(p, q) return p / q end})[op]
    local r1, r2 = f(x, y), f(y, x)
    T.eq(r1:dtype(), "f32", op .. ": bf16 op f32 -> f32")
    T.eq(r2:dtype(), "f32", op .. ": f32 op bf16 -> f32")
    T.eq(r1:totable(), f(x:to("f32"), y):totable(), op .. ": the f32 op of the widened values")
    T.eq(r2:totable(), f(y, x:to("f32")):totable(), op .. ": the f32 op of the widened values (swapped)")
  end
end)

T.case("errors: inner dims, 1-D operands, integer dtypes, batch dims", function()
  local e = T.raises(function() return nv.zeros(2, 3):matmul(nv.zeros(4, 5)) end, "inner dims")
  T.ok(e:find("[2,3]", 1, true) and e:find("[4,5]", 1, true), "names both shapes: " .. e)
  e = T.raises(function() return nv.zeros(5, 2, 3):matmul(nv.zeros(2, 3)) end, "inner dims")
  T.ok(e:find("[5,2,3]", 1, true) and e:find("[2,3]", 1, true), "batched shapes too: " .. e)
  T.raises(function() return nv.zeros(3):matmul(nv.zeros(3, 2)) end, "2-D")
  T.raises(function() return nv.zeros(2, 3):matmul(nv.zeros(3)) end, "2-D")
  T.raises(function() return nv.tensor(1):matmul(nv.tensor(1)) end, "2-D")
  for _, dt in ipairs({"i32", "i64", "u8"}) do
    e = T.raises(function() return nv.zeros(2, 2, dt):matmul(nv.zeros(2, 2)) end, "f32 or bf16")
    T.ok(e:find(dt, 1, true), "names the dtype: " .. e)
    T.raises(function() return nv.zeros(2, 2):matmul(nv.zeros(2, 2, dt)) end, "f32 or bf16")
  end
  T.raises(function() return nv.zeros(2, 3, 4):matmul(nv.zeros(3, 4, 5)) end, "cannot be broadcast")
  T.raises(function() return nv.zeros(2, 2):matmul(5) end, "Tensor expected")
end)
