-- tests/test_attention.lua: causal grouped-query attention (core.attention_forward/backward).
-- The forward against a naive plain-Lua attention (double), causality, lse, finite-difference
-- gradients, the fast kernel against the reference, and bad inputs.
--
-- Tolerances (fp32, eps = 2^-23 ~ 1.2e-7):
--   * reference vs naive Lua: the reference sums in double and rounds once, so it is within
--     1 ulp: |diff| <= 2e-7 |x| + 1e-7 (x = O(1) here).
--   * fast vs naive / reference: sgemm and the fp32 softmax add up to T terms in fp32 in their own
--     order, an error that grows like sqrt(T) ulps. We allow |diff| <= 1e-5 (|ref| + max|ref|),
--     i.e. ~80 ulps of the tensor's largest value; measured: 4-5 ulps of max|ref| for T from 64
--     to 2048 (forward and backward).
--   * finite differences: central, step h = 1e-2 on the f32 forward, loss = sum(out * R) for a
--     fixed random R, summed in double. The loss's rounding noise, ~ sqrt(#out) |R| ulp(out)
--     ~ 4e-7, over 2h gives ~ 2e-5; the O(h^2) truncation is ~ 1e-5 (measured max error 5e-5;
--     h = 1e-3 is worse, 4e-4, from the noise). We allow 5e-4 + 1e-3 |g|.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

-- ---- helpers -------------------------------------------------------------------------------------

local function randn(g, ...) return nv.randn({...}, {generator = g}) end

local function inputs(seed, B, Tn, Hq, Hkv, D)
  local g = nv.Generator(seed)
  return randn(g, B, Tn, Hq, D), randn(g, B, Tn, Hkv, D), randn(g, B, Tn, Hkv, D)
end

-- Naive attention in plain Lua (double): out[b][t][h][d], lse[b][h][t], from nested tables.
local function naive(q, k, v, scale)
  local B, Tn, Hq, D, Hkv = #q, #q[1], #q[1][1], #q[1][1][1], #k[1][1]
  local group = Hq // Hkv
  local out, lse = {}, {}
  for b = 1, B do
    out[b], lse[b] = {}, {}
    for t = 1, Tn do out[b][t] = {} end
    for h = 1, Hq do
      lse[b][h] = {}
      local g = (h - 1) // group + 1
      for t = 1, Tn do
        local sc, m = {}, -math.huge
        for s = 1, t do
          local dot = 0
          for d = 1, D do dot = dot + q[b][t][h][d] * k[b][s][g][d] end
          sc[s] = dot * scale
          m = math.max(m, sc[s])
        end
        local sum = 0
        for s = 1, t do sc[s] = math.exp(sc[s] - m); sum = sum + sc[s] end
        local o = {}
        for d = 1, D do
          local a = 0
          for s = 1, t do a = a + sc[s] * v[b][s][g][d] end
          o[d] = a / sum
        end
        out[b][t][h] = o
        lse[b][h][t] = m + math.log(sum)
      end
    end
  end
  return out, lse
end

-- Flatten a nested table in row-major order.
local function flat(x, acc)
  acc = acc or {}
  if type(x) ~= "table" then acc[#acc + 1] = x; return acc end
  for _, y in ipairs(x) do flat(y, acc) end
  return acc
end

local function max_abs(list)
  local m = 0
  for _, x in ipairs(list) do m = math.max(m, math.abs(x)) end
  return m
end

-- Every element of tensor a within atol + rtol*|e| of the plain list e.
local function near_list(a, e, rtol, atol, what)
  local got = flat(a:totable())
  T.eq(#got, #e, what .. ": element count")
  for i = 1, #e do
    if not (math.abs(got[i] - e[i]) <= atol + rtol * math.abs(e[i])) then
      error(string.format("%s: element %d is %.9g, expected %.9g (rtol %g, atol %g)", what, i, got[i], e[i], rtol, atol), 2)
    end
  end
end

-- The attention entries with the scalar reference kernels (ref = true) or the fast ones.
local function fwd(ref, ...) return T.with(nv.use_reference, ref, core.attention_forward, ...) end
local function bwd(ref, ...) return T.with(nv.use_reference, ref, core.attention_backward, ...) end

-- Fast tensor a against reference tensor b: |a - b| <= 1e-5 (|b| + max|b|).
local function close_fp32(a, b, what)
  T.close(a, b, 1e-5, 1e-5 * math.max(b:abs():max(), 1e-30), what)
end

local SMALL = {
  {name = "GQA B=2 T=5 Hq=4 Hkv=2 D=8", B = 2, T = 5, Hq = 4, Hkv = 2, D = 8},
  {name = "MHA Hq=Hkv=3", B = 2, T = 5, Hq = 3, Hkv = 3, D = 8},
  {name = "MQA Hkv=1", B = 2, T = 5, Hq = 4, Hkv = 1, D = 8},
  {name = "T=1", B = 2, T = 1, Hq = 4, Hkv = 2, D = 8},
}

-- ---- forward against naive Lua -------------------------------------------------------------------

for i, c in ipairs(SMALL) do
  T.case("forward vs naive Lua, " .. c.name .. " (reference and fast)", function()
    local q, k, v = inputs(10 + i, c.B, c.T, c.Hq, c.Hkv, c.D)
    local scale = 1 / math.sqrt(c.D)
    local eo, el = naive(q:totable(), k:totable(), v:totable(), scale)
    eo, el = flat(eo), flat(el)
    local ro, rl = T.with(nv.use_reference, true, core.attention_forward, q, k, v, scale)
    T.eq(ro:size(), {c.B, c.T, c.Hq, c.D}, "out shape")
    T.eq(rl:size(), {c.B, c.Hq, c.T}, "lse shape")
    near_list(ro, eo, 2e-7, 1e-7, "reference out")
    near_list(rl, el, 2e-7, 1e-7, "reference lse")
    local fo, fl = core.attention_forward(q, k, v, scale)
    near_list(fo, eo, 1e-5, 1e-5 * max_abs(eo), "fast out")
    near_list(fl, el, 1e-5, 1e-5 * max_abs(el), "fast lse")
  end)
end

T.case("forward: row 1 of every head is v[1] of its kv head; a scale of 0 averages v causally", function()
  local q, k, v = inputs(3, 1, 4, 4, 2, 8)
  for _, ref in ipairs({true, false}) do
    local o = fwd(ref, q, k, v, 0.7)
    for h = 1, 4 do
      local g = (h - 1) // 2 + 1
      for d = 1, 8 do T.eq(o:get(1, 1, h, d), v:get(1, 1, g, d), "out[1] = v[1]") end
    end
    local z, lz = fwd(ref, q, k, v, 0)
    for t = 1, 4 do
      T.near(lz:get(1, 1, t), math.log(t), 1e-6, "lse with equal scores is log(t)")
      for d = 1, 8 do
        local mean = 0
        for s = 1, t do mean = mean + v:get(1, s, 2, d) end
        T.near(z:get(1, t, 3, d), mean / t, 1e-6, "uniform weights")
      end
    end
  end
end)

-- ---- lse -----------------------------------------------------------------------------------------

T.case("lse is the log of the softmax denominator, and exp(score - lse) sums to 1", function()
  local B, Tn, Hq, Hkv, D = 2, 6, 4, 2, 8
  local q, k, v = inputs(21, B, Tn, Hq, Hkv, D)
  local scale = 0.3
  local qt, kt = q:totable(), k:totable()
  for _, ref in ipairs({true, false}) do
    local _, lse = fwd(ref, q, k, v, scale)
    for b = 1, B do
      for h = 1, Hq do
        local g = (h - 1) // (Hq // Hkv) + 1
        for t = 1, Tn do
          local sc, den = {}, 0
          for s = 1, t do
            local dot = 0
            for d = 1, D do dot = dot + qt[b][t][h][d] * kt[b][s][g][d] end
            sc[s] = dot * scale
            den = den + math.exp(sc[s]) -- no max subtraction: the plain definition
          end
          local l = lse:get(b, h, t)
          T.near(l, math.log(den), 1e-5 * math.max(1, math.abs(l)), "lse")
          local total = 0
          for s = 1, t do total = total + math.exp(sc[s] - l) end
          T.near(total, 1, 1e-5, "probabilities sum to 1")
        end
      end
    end
  end
end)

-- ---- causality -----------------------------------------------------------------------------------

T.case("causality: changing k, v at positions > t leaves out[1..t] and lse[1..t] unchanged", function()
  local B, Tn, Hq, Hkv, D = 2, 7, 4, 2, 8
  local q, k, v = inputs(31, B, Tn, Hq, Hkv, D)
  for _, ref in ipairs({true, false}) do
    local o1, l1 = fwd(ref, q, k, v, 0.4)
    for t = 1, Tn - 1 do
      local k2, v2 = k:clone(), v:clone()
      local g = nv.Generator(100 + t)
      k2:narrow(2, t + 1, Tn - t):copy_(randn(g, B, Tn - t, Hkv, D) * 5)
      v2:narrow(2, t + 1, Tn - t):copy_(randn(g, B, Tn - t, Hkv, D) * 5)
      local o2, l2 = fwd(ref, q, k2, v2, 0.4)
      T.eq(o2:narrow(2, 1, t):totable(), o1:narrow(2, 1, t):totable(), "out[1.." .. t .. "] (bit for bit)")
      T.eq(l2:narrow(3, 1, t):totable(), l1:narrow(3, 1, t):totable(), "lse[1.." .. t .. "] (bit for bit)")
      T.ok((o2:narrow(2, t + 1, 1) - o1:narrow(2, t + 1, 1)):abs():max() > 1e-3, "out[t+1] does see the change")
    end
  end
end)

-- ---- finite differences --------------------------------------------------------------------------

-- Central differences of loss = sum(out * R) (in double) with respect to every element of x,
-- x one of q, k, v; returns the list of estimates.
local function fd_grad(x, q, k, v, scale, R, h)
  local r = flat(R:totable())
  local function loss()
    local o = flat(core.attention_forward(q, k, v, scale):totable())
    local s = 0
    for i = 1, #o do s = s + o[i] * r[i] end
    return s
  end
  local sz = x:size()
  local est = {}
  for i1 = 1, sz[1] do for i2 = 1, sz[2] do for i3 = 1, sz[3] do for i4 = 1, sz[4] do
    local x0 = x:get(i1, i2, i3, i4)
    x:set(i1, i2, i3, i4, x0 + h)
    local lp = loss()
    x:set(i1, i2, i3, i4, x0 - h)
    local lm = loss()
    x:set(i1, i2, i3, i4, x0)
    est[#est + 1] = (lp - lm) / (2 * h)
  end end end end
  return est
end

local FD = {
  {name = "GQA B=2 T=5 Hq=4 Hkv=2 D=8", B = 2, T = 5, Hq = 4, Hkv = 2, D = 8},
  {name = "MQA B=1 T=6 Hq=3 Hkv=1 D=4", B = 1, T = 6, Hq = 3, Hkv = 1, D = 4},
}

for i, c in ipairs(FD) do
  T.case("finite differences: dq, dk, dv, " .. c.name .. " (reference and fast backward)", function()
    local q, k, v = inputs(40 + i, c.B, c.T, c.Hq, c.Hkv, c.D)
    local R = randn(nv.Generator(50 + i), c.B, c.T, c.Hq, c.D)
    local scale = 1 / math.sqrt(c.D)
    local h = 1e-2
    local est = {fd_grad(q, q, k, v, scale, R, h), fd_grad(k, q, k, v, scale, R, h), fd_grad(v, q, k, v, scale, R, h)}
    local out, lse = core.attention_forward(q, k, v, scale)
    for _, ref in ipairs({true, false}) do
      local grads = {bwd(ref, R, q, k, v, out, lse, scale)}
      for j, name in ipairs({"dq", "dk", "dv"}) do
        near_list(grads[j], est[j], 1e-3, 5e-4, (ref and "reference " or "fast ") .. name)
      end
    end
  end)
end

-- ---- fast vs reference ---------------------------------------------------------------------------

local BIG = {
  {name = "B=2 T=64 Hq=8 Hkv=2 D=32", B = 2, T = 64, Hq = 8, Hkv = 2, D = 32},
  {name = "B=1 T=150 Hq=4 Hkv=1 D=16 (partial last tile)", B = 1, T = 150, Hq = 4, Hkv = 1, D = 16},
  {name = "B=3 T=70 Hq=6 Hkv=6 D=8", B = 3, T = 70, Hq = 6, Hkv = 6, D = 8},
  -- query tiles of 64 rows: several tiles, the last one ragged (T mod 64 = 5 and 63), GQA groups of 3
  -- and 4, rows whose causal length is not a multiple of the softmax's 16 lanes
  {name = "B=2 T=197 Hq=6 Hkv=2 D=24 (ragged tiles, GQA)", B = 2, T = 197, Hq = 6, Hkv = 2, D = 24},
  {name = "B=1 T=127 Hq=4 Hkv=1 D=64 (ragged tiles, GQA)", B = 1, T = 127, Hq = 4, Hkv = 1, D = 64},
}

for i, c in ipairs(BIG) do
  T.case("fast vs reference, forward and backward, " .. c.name, function()
    local q, k, v = inputs(60 + i, c.B, c.T, c.Hq, c.Hkv, c.D)
    local dout = randn(nv.Generator(70 + i), c.B, c.T, c.Hq, c.D)
    local scale = 1 / math.sqrt(c.D)
    local ro, rl = T.with(nv.use_reference, true, core.attention_forward, q, k, v, scale)
    local fo, fl = core.attention_forward(q, k, v, scale)
    close_fp32(fo, ro, "out")
    close_fp32(fl, rl, "lse")
    local r = {T.with(nv.use_reference, true, core.attention_backward, dout, q, k, v, ro, rl, scale)}
    local f = {core.attention_backward(dout, q, k, v, ro, rl, scale)}
    for j, name in ipairs({"dq", "dk", "dv"}) do close_fp32(f[j], r[j], name) end
  end)
end

T.case("fast vs reference with scores spread over hundreds (exp underflows below -87)", function()
  local q, k, v = inputs(66, 1, 90, 2, 1, 16)
  local dout = randn(nv.Generator(76), 1, 90, 2, 16)
  local scale = 8 -- scores up to ~200 apart: a third of the score - max are below -87 (exp < 2^-125)
  local ro, rl = T.with(nv.use_reference, true, core.attention_forward, q, k, v, scale)
  local fo, fl = core.attention_forward(q, k, v, scale)
  close_fp32(fo, ro, "out")
  close_fp32(fl, rl, "lse")
  local r = {T.with(nv.use_reference, true, core.attention_backward, dout, q, k, v, ro, rl, scale)}
  local f = {core.attention_backward(dout, q, k, v, ro, rl, scale)}
  for j, name in ipairs({"dq", "dk", "dv"}) do close_fp32(f[j], r[j], name) end
end)

T.case("fast kernel is deterministic (same bits on a second run)", function()
  local q, k, v = inputs(80, 2, 100, 8, 2, 16)
  local o1, l1 = core.attention_forward(q, k, v, 0.25)
  local o2, l2 = core.attention_forward(q, k, v, 0.25)
  T.ok(o1:eq(o2):sum() == o1:numel() and l1:eq(l2):sum() == l1:numel(), "forward differs between runs")
  local g1 = {core.attention_backward(o1, q, k, v, o1, l1, 0.25)}
  local g2 = {core.attention_backward(o1, q, k, v, o1, l1, 0.25)}
  for j = 1, 3 do T.ok(g1[j]:eq(g2[j]):sum() == g1[j]:numel(), "backward differs between runs") end
end)

T.case("empty sizes: T = 0, B = 0 and D = 0", function()
  for _, sz in ipairs({{1, 0, 2, 1, 4}, {0, 3, 2, 2, 4}}) do
    local q, k, v = nv.zeros(sz[1], sz[2], sz[3], sz[5]), nv.zeros(sz[1], sz[2], sz[4], sz[5]), nv.zeros(sz[1], sz[2], sz[4], sz[5])
    for _, ref in ipairs({true, false}) do
      local o, l = fwd(ref, q, k, v, 1)
      T.eq(o:numel(), 0)
      T.eq(l:size(), {sz[1], sz[3], sz[2]})
      local dq, dk, dv = bwd(ref, o, q, k, v, o, l, 1)
      T.eq({dq:numel(), dk:numel(), dv:numel()}, {0, 0, 0})
    end
  end
  local q, k = nv.zeros(1, 3, 2, 0), nv.zeros(1, 3, 1, 0) -- D = 0: every score is 0
  for _, ref in ipairs({true, false}) do
    local o, l = fwd(ref, q, k, k, 1)
    T.eq(o:size(), {1, 3, 2, 0})
    for t = 1, 3 do T.near(l:get(1, 2, t), math.log(t), 1e-6, "lse of t equal scores") end
  end
end)

-- ---- bad inputs ----------------------------------------------------------------------------------

T.case("bad inputs: each error names the op, the problem and the shapes", function()
  local z = nv.zeros
  local q, k, v = z(2, 5, 4, 8), z(2, 5, 2, 8), z(2, 5, 2, 8)
  local out, lse = core.attention_forward(q, k, v, 1)
  local F, Bk = core.attention_forward, core.attention_backward
  local function both(qq, kk, vv, text)
    T.raises(function() return F(qq, kk, vv, 1) end, "attention_forward: " .. text)
    T.raises(function() return T.with(nv.use_reference, true, F, qq, kk, vv, 1) end, "attention_forward: " .. text)
    T.raises(function() return Bk(out, qq, kk, vv, out, lse, 1) end, "attention_backward: " .. text)
  end
  both(z(2, 5, 3, 8), k, v, "Hq (3) must be a positive multiple of Hkv (2): q is [2,5,3,8] f32, k is [2,5,2,8] f32")
  both(q, z(2, 6, 2, 8), z(2, 6, 2, 8), "q and k differ in T (dim 2): q is [2,5,4,8] f32, k is [2,6,2,8] f32")
  both(q, z(2, 5, 2, 4), z(2, 5, 2, 4), "q and k differ in D (dim 4): q is [2,5,4,8] f32, k is [2,5,2,4] f32")
  both(q, z(3, 5, 2, 8), z(3, 5, 2, 8), "q and k differ in B (dim 1)")
  both(q, k, z(2, 5, 2, 4), "k and v must have one shape (B, T, Hkv, D), got k [2,5,2,8] f32 and v [2,5,2,4] f32")
  -- activations all f32 or all bf16 (NUMERICS §11); no other dtype
  T.raises(function() return F(q:to("bf16"), k, v, 1) end,
    "attention_forward: q is [2,5,4,8] bf16 but k is [2,5,2,8] f32; the activations of one call must share a dtype")
  T.raises(function() return Bk(out, q, k, v:to("bf16"), out, lse, 1) end,
    "attention_backward: dout is [2,5,4,8] f32 but v is [2,5,2,8] bf16")
  both(q:to("i32"), k:to("i32"), v:to("i32"), "q must be f32 or bf16, got [2,5,4,8] i32")
  both(z(2, 5, 8), k, v, "q must be 4-D (B, T, Hq, D), got [2,5,8] f32")
  both(q, z(2, 5, 16), v, "k must be 4-D (B, T, Hkv, D), got [2,5,16] f32")
  both(z(2, 4, 5, 8):transpose(2, 3), k, v, "q must be contiguous")
  both(q, z(2, 5, 0, 8), z(2, 5, 0, 8), "Hq (4) must be a positive multiple of Hkv (0)")
  T.raises(function() return F(q, k, v, 0 / 0) end, "attention_forward: scale must be finite")
  T.raises(function() return F(q, k, v, "x") end, "number expected")
  T.raises(function() return core.attention_forward(q, k) end, "bad argument #3 to 'attention_forward'")
  T.raises(function() return Bk(z(2, 5, 4, 4), q, k, v, out, lse, 1) end,
    "attention_backward: dout must have q's shape (B, T, Hq, D): dout is [2,5,4,4] f32, q is [2,5,4,8] f32")
  T.raises(function() return Bk(out, q, k, v, z(2, 5, 2, 8), lse, 1) end, "attention_backward: out must have q's shape")
  T.raises(function() return Bk(out, q, k, v, out, z(2, 5, 4), 1) end,
    "attention_backward: lse must be a contiguous f32 (B, Hq, T) = [2,4,5] cpu tensor, got [2,5,4] f32")
  T.raises(function() return Bk(out, q, k, v, out, lse:to("bf16"), 1) end, "attention_backward: lse must be")
  T.raises(function() return Bk(out:to("bf16"), q, k, v, out, lse, 1) end,
    "attention_backward: dout is [2,5,4,8] bf16 but q is [2,5,4,8] f32")
  local dead = z(2, 5, 4, 8)
  dead:free()
  T.raises(function() return F(dead, k, v, 1) end, "freed")
end)

T.case("cuda tensors mixed with cpu ones: a clean one-device error (the cuda kernel: test_cuda_layers.lua)", function()
  if not nv.cuda.available() then T.skip("no GPU") end
  local q = nv.zeros(1, 2, 2, 4):cuda()
  local k = nv.zeros(1, 2, 1, 4)
  T.raises(function() return core.attention_forward(q, k, k, 1) end, "every tensor must be on one device")
end)
