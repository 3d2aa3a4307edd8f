-- tests/test_layers.lua: the layer library (core/layers.h through nv.core): embedding, RMSNorm,
-- RoPE (tables, Llama 3.1 scaling, forward/backward), SwiGLU, fused cross-entropy, AdamW, sumsq.
-- For each: the forward against a plain-Lua implementation (double precision), the backward
-- against central finite differences of the f32 forward, the accumulate (+=) vs write (=)
-- contract, the fast kernels against the scalar references (nv.use_reference), and
-- bad inputs with their messages. Attention is tested in tests/test_attention.lua.
--
-- Finite differences. The scalar loss is L = sum_i out_i * w_i with fixed random weights w, so
-- every output element matters; the backward is called with dout = w. Each input element is
-- stepped by h = 1e-2 both ways (the step actually taken is read back, since x +- h is rounded
-- to f32) and L is summed in double from the f32 outputs. Error budget: the f32 forward rounds
-- each output by <= 2^-24 relative, so L carries an absolute error of about
-- 6e-8 * sum |out_i w_i| (~1e-6 for these sizes) and the difference quotient about
-- 1e-6 / h = 1e-4; the truncation error of central differences is h^2/6 |L'''| ~ 2e-5 for
-- smooth O(1) functions. Tolerance: |fd - analytic| <= 1e-3 + 1e-3 |analytic|, about ten times
-- that budget (observed: below 2e-5), while a wrong term in a backward is off by O(0.1). Shapes
-- are small so each case runs in milliseconds.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

-- ---- helpers ----------------------------------------------------------------------------------

local function flat(t) return t:contiguous():reshape(-1):totable() end
local function from(vals, shape, dtype) return nv.tensor(vals, dtype):reshape(shape) end
local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

local function randn_flat(n) return flat(nv.randn(n)) end

-- Run fn with the reference kernels selected; restores the previous setting even on error.
local function with_ref(fn, ...) return T.with(nv.use_reference, true, fn, ...) end

-- Elementwise |got - want| <= atol + rtol |want| over two flat tables.
local function near_tbl(got, want, rtol, atol, what)
  T.eq(#got, #want, (what or "") .. ": number of elements")
  for i = 1, #want do
    local g, w = got[i], want[i]
    if not (math.abs(g - w) <= atol + rtol * math.abs(w)) then
      error(string.format("%s: element %d is %.9g, expected %.9g (rtol %g, atol %g)", what or "values", i, g, w, rtol,
        atol), 2)
    end
  end
end

-- Bit-for-bit equality of two f32 tensors (same shape).
local function same_bits(a, b, what)
  T.eq(a:size(), b:size(), (what or "") .. ": shapes")
  local x, y = flat(a), flat(b)
  for i = 1, #x do
    if x[i] ~= y[i] and not (x[i] ~= x[i] and y[i] ~= y[i]) then
      error(string.format("%s: element %d differs: %.9g vs %.9g", what or "tensors", i, x[i], y[i]), 2)
    end
  end
end

local function weighted(out, w)
  local o, s = flat(out), 0.0
  for i = 1, #o do s = s + o[i] * w[i] end
  return s
end

-- Central differences of loss() with respect to every element of the contiguous f32 tensor x.
local H = 1e-2
local function numgrad(x, loss)
  local xf = x:reshape(-1) -- a view: writes land in x
  local g = {}
  for i = 1, xf:numel() do
    local v = xf[i]
    xf[i] = v + H
    local xp = xf[i]
    local lp = loss()
    xf[i] = v - H
    local xm = xf[i]
    local lm = loss()
    xf[i] = v
    g[i] = (lp - lm) / (xp - xm)
  end
  return g
end

local FD_RTOL, FD_ATOL = 1e-3, 1e-3
local function check_fd(analytic, x, loss, what)
  near_tbl(flat(analytic), numgrad(x, loss), FD_RTOL, FD_ATOL, what)
end

-- ---- embedding ------------------------------------------------------------------------------------

T.case("embedding forward gathers rows (plain Lua), ids of any shape", function()
  nv.manual_seed(1)
  local V, C = 5, 3
  local w = nv.randn(V, C)
  local wt = w:totable()
  local ids = nv.tensor({{4, 0, 2}, {2, 2, 1}}, "i64")
  local out = core.embedding_forward(ids, w)
  T.eq(out:size(), {2, 3, C})
  local it = ids:totable()
  for a = 1, 2 do
    for b = 1, 3 do
      for c = 1, C do T.eq(out:get(a, b, c), wt[it[a][b] + 1][c], "row of id " .. it[a][b]) end
    end
  end
  -- strided ids (a slice of a token batch, as inputs = tokens[:, :-1]) are taken as they are
  local tokens = nv.tensor({{4, 0, 2, 1}, {2, 2, 1, 3}}, "i64")
  local sl = tokens:narrow(2, 1, 3)
  T.eq(sl:is_contiguous(), false)
  same_bits(core.embedding_forward(sl, w), out, "strided ids")
end)

T.case("embedding backward: finite differences, += into dweight, repeated ids sum", function()
  nv.manual_seed(2)
  local V, C, N = 4, 3, 6
  local w = nv.randn(V, C)
  local ids = nv.tensor({1, 3, 1, 0, 1, 3}, "i64")
  local wts = randn_flat(N * C)
  local dout = from(wts, {N, C})
  local dw = nv.zeros(V, C)
  T.eq(core.embedding_backward(dw, dout, ids), nil, "returns nothing")
  check_fd(dw, w, function() return weighted(core.embedding_forward(ids, w), wts) end, "dweight")
  -- row 3 (id 2) never appears: stays zero
  for c = 1, C do T.eq(dw:get(3, c), 0.0) end
  local once = dw:clone()
  core.embedding_backward(dw, dout, ids)
  T.close(dw, once * 2, 1e-6, 1e-7, "second call doubles dweight")
end)

-- ---- RMSNorm ------------------------------------------------------------------------------------

local function rmsnorm_lua(x, w, eps) -- x: rows of C, in double
  local out, rstd = {}, {}
  for n, row in ipairs(x) do
    local ss = 0
    for _, v in ipairs(row) do ss = ss + v * v end
    rstd[n] = 1 / math.sqrt(ss / #row + eps)
    out[n] = {}
    for c, v in ipairs(row) do out[n][c] = v * rstd[n] * w[c] end
  end
  return out, rstd
end

T.case("rmsnorm forward against plain Lua; rstd saved; leading dims kept", function()
  nv.manual_seed(3)
  local x, w = nv.randn(4, 7), nv.randn(7)
  local eps = 1e-5
  local out, rstd = core.rmsnorm_forward(x, w, eps)
  local want, wr = rmsnorm_lua(x:totable(), w:totable(), eps)
  local wf = {}
  for _, row in ipairs(want) do for _, v in ipairs(row) do wf[#wf + 1] = v end end
  near_tbl(flat(out), wf, 1e-6, 1e-7, "out")
  near_tbl(flat(rstd), wr, 1e-6, 0, "rstd")
  local o3, r3 = core.rmsnorm_forward(x:reshape({2, 2, 7}), w, eps)
  T.eq(o3:size(), {2, 2, 7})
  T.eq(r3:size(), {2, 2})
  same_bits(o3:reshape({4, 7}), out, "3-D input")
end)

T.case("rmsnorm backward: finite differences for dx and dweight, dx written, dweight +=", function()
  nv.manual_seed(4)
  local N, C, eps = 3, 8, 1e-5
  local x, w = nv.randn(N, C), nv.randn(C)
  local wts = randn_flat(N * C)
  local dout = from(wts, {N, C})
  local _, rstd = core.rmsnorm_forward(x, w, eps)
  local dw = nv.zeros(C)
  local dx = core.rmsnorm_backward(dw, dout, x, w, rstd)
  local function loss() return weighted((core.rmsnorm_forward(x, w, eps)), wts) end
  check_fd(dx, x, loss, "dx")
  check_fd(dw, w, loss, "dweight")
  local once = dw:clone()
  local dx2 = core.rmsnorm_backward(dw, dout, x, w, rstd)
  same_bits(dx2, dx, "dx is the same on the second call")
  T.close(dw, once * 2, 1e-6, 1e-7, "dweight doubles")
end)

-- ---- RoPE ---------------------------------------------------------------------------------------

T.case("rope tables: shape, cos/sin of t * theta^(-2i/D), both halves repeat", function()
  local Tn, D, theta = 6, 8, 10000
  local c, s = core.rope_tables(Tn, D, theta)
  T.eq(c:size(), {Tn, D})
  T.eq(s:size(), {Tn, D})
  local ct, st = c:totable(), s:totable()
  for t = 0, Tn - 1 do
    for i = 0, D - 1 do
      local f = theta ^ (-2 * (i % (D // 2)) / D)
      T.near(ct[t + 1][i + 1], math.cos(t * f), 1e-7, "cos")
      T.near(st[t + 1][i + 1], math.sin(t * f), 1e-7, "sin")
    end
  end
end)

T.case("rope forward: the rotate-half layout by hand at one position", function()
  -- D = 4, theta = 100: inv_freq = {1, 0.1}; at position t = 1 the angles are {1, 0.1, 1, 0.1}.
  local c, s = core.rope_tables(2, 4, 100)
  local x = from({0, 0, 0, 0, 1, 2, 3, 4}, {1, 2, 1, 4}) -- B=1, T=2, H=1, D=4
  local out = core.rope_forward(x, c, s)
  local c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)
  local want = {1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2}
  for j = 1, 4 do T.near(out:get(1, 2, 1, j), want[j], 1e-6, "out[" .. j .. "]") end
  for j = 1, 4 do T.eq(out:get(1, 1, 1, j), 0.0) end
end)

local function rope_lua(x, c, s) -- x[b][t][h][j], c[t][j], s[t][j]
  local out = {}
  for b, xb in ipairs(x) do
    for t, xt in ipairs(xb) do
      for _, xh in ipairs(xt) do
        local D = #xh
        local h = D // 2
        for j = 1, D do
          local rot = j <= h and -xh[j + h] or xh[j - h]
          out[#out + 1] = xh[j] * c[t][j] + rot * s[t][j]
        end
      end
    end
  end
  return out
end

T.case("rope forward against plain Lua; backward by finite differences; dx written", function()
  nv.manual_seed(5)
  local B, Tn, Hh, D = 2, 3, 2, 4
  local c, s = core.rope_tables(Tn, D, 10000)
  local x = nv.randn(B, Tn, Hh, D)
  local out = core.rope_forward(x, c, s)
  near_tbl(flat(out), rope_lua(x:totable(), c:totable(), s:totable()), 1e-6, 1e-7, "out")
  local wts = randn_flat(B * Tn * Hh * D)
  local dout = from(wts, {B, Tn, Hh, D})
  local dx = core.rope_backward(dout, c, s)
  check_fd(dx, x, function() return weighted(core.rope_forward(x, c, s), wts) end, "dx")
  same_bits(core.rope_backward(dout, c, s), dx, "dx is the same on the second call")
  -- the rotation is orthogonal: the backward of the forward is the identity
  near_tbl(flat(core.rope_backward(out, c, s)), flat(x), 1e-6, 1e-6, "R^T R x = x")
end)

-- Hugging Face _compute_llama3_parameters, in Lua.
local function llama3_inv_freq(D, theta, sc)
  local inv, kinds = {}, {low = 0, high = 0, mid = 0}
  local low_wl = sc.original_max_position_embeddings / sc.low_freq_factor
  local high_wl = sc.original_max_position_embeddings / sc.high_freq_factor
  for i = 0, D // 2 - 1 do
    local f = 1 / theta ^ (2 * i / D)
    local wl = 2 * math.pi / f
    if wl < high_wl then
      kinds.high = kinds.high + 1
    elseif wl > low_wl then
      f = f / sc.factor
      kinds.low = kinds.low + 1
    else
      local smooth = (sc.original_max_position_embeddings / wl - sc.low_freq_factor) /
                     (sc.high_freq_factor - sc.low_freq_factor)
      f = (1 - smooth) * f / sc.factor + smooth * f
      kinds.mid = kinds.mid + 1
    end
    inv[i + 1] = f
  end
  return inv, kinds
end

T.case("rope tables with Llama 3.1 scaling match the Hugging Face formula", function()
  local D, theta = 128, 500000.0
  local sc = {factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192}
  local inv, kinds = llama3_inv_freq(D, theta, sc)
  T.ok(kinds.low > 0 and kinds.high > 0 and kinds.mid > 0,
    "all three regimes occur: " .. T.show({kinds.high, kinds.mid, kinds.low}))
  local Tn = 4097
  local c, s = core.rope_tables(Tn, D, theta, sc)
  local c0, s0 = core.rope_tables(Tn, D, theta)
  for _, t in ipairs({1, 37, 4096}) do
    local ct, st = c:select(1, t + 1):totable(), s:select(1, t + 1):totable()
    for i = 1, D do
      local f = inv[(i - 1) % (D // 2) + 1]
      T.near(ct[i], math.cos(t * f), 2e-7, string.format("cos t=%d i=%d", t, i))
      T.near(st[i], math.sin(t * f), 2e-7, string.format("sin t=%d i=%d", t, i))
    end
  end
  -- the scaling changes the low frequencies only: the first (highest) frequency is kept
  T.eq(c:get(4097, 1), c0:get(4097, 1))
  T.ok(math.abs(s:get(4097, 64) - s0:get(4097, 64)) > 1e-3, "the lowest frequency is scaled")
  -- rope_type = "llama3" is accepted (a Hugging Face rope_scaling table passes as is)
  sc.rope_type = "llama3"
  local c2 = core.rope_tables(Tn, D, theta, sc)
  same_bits(c2, c, "with rope_type")
end)

-- ---- SwiGLU -------------------------------------------------------------------------------------

T.case("swiglu forward against plain Lua; backward by finite differences", function()
  nv.manual_seed(6)
  local g, u = nv.randn(3, 5) * 2, nv.randn(3, 5)
  local out = core.swiglu_forward(g, u)
  local gt, ut, want = flat(g), flat(u), {}
  for i = 1, #gt do want[i] = gt[i] / (1 + math.exp(-gt[i])) * ut[i] end
  near_tbl(flat(out), want, 2e-6, 1e-7, "out")
  local wts = randn_flat(15)
  local dout = from(wts, {3, 5})
  local dg, du = core.swiglu_backward(dout, g, u)
  local function loss() return weighted(core.swiglu_forward(g, u), wts) end
  check_fd(dg, g, loss, "dgate")
  check_fd(du, u, loss, "dup")
  local dg2, du2 = core.swiglu_backward(dout, g, u)
  same_bits(dg2, dg, "dgate written")
  same_bits(du2, du, "dup written")
end)

-- ---- cross-entropy ------------------------------------------------------------------------------

-- loss, count, dlogits (flat) in double; rows of logits, 0-based targets.
local function ce_lua(x, tg, ignore, z, scale)
  local total, count, rows = 0, 0, {}
  for n, row in ipairs(x) do
    local m = -math.huge
    for _, v in ipairs(row) do m = math.max(m, v) end
    local s = 0
    for _, v in ipairs(row) do s = s + math.exp(v - m) end
    rows[n] = {lse = m + math.log(s), skip = tg[n] == ignore}
    if not rows[n].skip then
      count = count + 1
      total = total + rows[n].lse - row[tg[n] + 1] + z * rows[n].lse ^ 2
    end
  end
  local d = {}
  for n, row in ipairs(x) do
    for i, v in ipairs(row) do
      if rows[n].skip then
        d[#d + 1] = 0
      else
        local p = math.exp(v - rows[n].lse)
        d[#d + 1] = scale / count * ((1 + 2 * z * rows[n].lse) * p - (i - 1 == tg[n] and 1 or 0))
      end
    end
  end
  return count > 0 and total / count or 0, count, d
end

T.case("cross_entropy against plain Lua: mean over counted tokens, ignore_index, z_loss, scale", function()
  nv.manual_seed(7)
  local N, V = 5, 7
  local x = nv.randn(N, V) * 3
  local tg = {3, -100, 0, 6, 3}
  local targets = nv.tensor(tg, "i64")
  -- defaults: ignore_index -100, z_loss 0, scale 1
  local loss, count, d = core.cross_entropy(x, targets)
  local wl, wc, wd = ce_lua(x:totable(), tg, -100, 0, 1)
  T.eq(count, 4)
  T.eq(math.type(count), "integer")
  T.near(loss, wl, 1e-6 * math.abs(wl))
  near_tbl(flat(d), wd, 1e-5, 1e-8, "dlogits")
  for i = 1, V do T.eq(d:get(2, i), 0.0, "ignored row is zero") end
end)

T.case("cross_entropy with ignore_index = 3, z_loss and scale against plain Lua", function()
  nv.manual_seed(8)
  local N, V = 5, 7
  local x = nv.randn(N, V) * 3
  local tg = {3, 1, 0, 6, 3}
  local loss, count, d = core.cross_entropy(x, nv.tensor(tg, "i64"), {ignore_index = 3, z_loss = 0.1, scale = 2.5})
  local wl, wc, wd = ce_lua(x:totable(), tg, 3, 0.1, 2.5)
  T.eq(count, 3)
  T.eq(count, wc)
  T.near(loss, wl, 1e-6 * math.abs(wl))
  near_tbl(flat(d), wd, 1e-5, 1e-8, "dlogits")
  -- grad = false: no dlogits, same loss
  local l2, c2, d2 = core.cross_entropy(x, nv.tensor(tg, "i64"), {ignore_index = 3, z_loss = 0.1, grad = false})
  T.eq(l2, loss)
  T.eq(c2, count)
  T.eq(d2, nil)
end)

T.case("cross_entropy: every token ignored gives loss 0, count 0, zero dlogits", function()
  local x = nv.randn(3, 4)
  local loss, count, d = core.cross_entropy(x, nv.tensor({-100, -100, -100}, "i64"))
  T.eq(loss, 0.0)
  T.eq(count, 0)
  T.eq(d:abs():sum(), 0.0)
end)

T.case("cross_entropy backward by finite differences (with z_loss, an ignored row and scale)", function()
  nv.manual_seed(9)
  local N, V = 4, 6
  local x = nv.randn(N, V) * 2
  local targets = nv.tensor({5, 0, -100, 2}, "i64")
  local o = {z_loss = 0.05, scale = 1.5}
  local _, _, d = core.cross_entropy(x, targets, o)
  -- the loss is computed in double from f32 logits: far less rounding noise than the budget
  check_fd(d, x, function() return 1.5 * core.cross_entropy(x, targets, {z_loss = 0.05, grad = false}) end, "dlogits")
  local _, _, d2 = core.cross_entropy(x, targets, o)
  same_bits(d2, d, "dlogits written")
end)

T.case("cross_entropy takes bf16 logits (widened exactly), (B, T, V) logits and strided targets", function()
  nv.manual_seed(10)
  local x = nv.randn(2, 3, 5):to("bf16")
  local tg = nv.tensor({{1, 4, 0}, {2, 2, -100}}, "i64")
  local l1, c1, d1 = core.cross_entropy(x, tg)
  local l2, c2, d2 = core.cross_entropy(x:to("f32"):reshape({6, 5}), tg:reshape({6}))
  T.eq(l1, l2)
  T.eq(c1, c2)
  T.eq(d1:size(), {2, 3, 5})
  T.eq(d1:dtype(), "f32")
  same_bits(d1:reshape({6, 5}), d2, "dlogits")
  -- strided targets (targets = tokens[:, 1:]) are taken as they are
  local tokens = nv.tensor({{0, 1, 4, 0}, {3, 2, 2, -100}}, "i64")
  local l3, c3, d3 = core.cross_entropy(x, tokens:narrow(2, 2, 3))
  T.eq(l3, l1)
  T.eq(c3, c1)
  same_bits(d3, d1, "strided targets")
end)

-- ---- AdamW --------------------------------------------------------------------------------------

-- torch.optim.AdamW (single-tensor path), in double:
--   p *= 1 - lr wd;  m = lerp(m, g, 1 - b1);  v = v b2 + (1 - b2) g^2;
--   p += -lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
-- and the same with every operation rounded to f32 in torch's order (rnd = f32).
local function adamw_lua(p, g, m, v, o, rnd)
  rnd = rnd or function(a) return a end
  local bc1, bc2 = 1 - o.beta1 ^ o.step, 1 - o.beta2 ^ o.step
  local decay, w1, b2, omb2 = rnd(1 - o.lr * o.weight_decay), rnd(1 - o.beta1), rnd(o.beta2), rnd(1 - o.beta2)
  local bc2s, eps, nss = rnd(math.sqrt(bc2)), rnd(o.eps), rnd(-(o.lr / bc1))
  for i = 1, #p do
    local pp = rnd(p[i] * decay)
    local mm = m[i]
    if math.abs(w1) < 0.5 then mm = rnd(mm + rnd(w1 * rnd(g[i] - mm)))
    else mm = rnd(g[i] - rnd(rnd(g[i] - mm) * rnd(1 - w1))) end
    local vv = rnd(v[i] * b2)
    vv = rnd(vv + rnd(rnd(omb2 * g[i]) * g[i]))
    local denom = rnd(rnd(rnd(math.sqrt(vv)) / bc2s) + eps)
    p[i] = rnd(pp + rnd(rnd(nss * mm) / denom))
    m[i], v[i] = mm, vv
  end
end

local function adamw_run(reference, steps, o)
  nv.manual_seed(11)
  local n = 37
  local p = nv.randn(n)
  local m, v = nv.zeros(n), nv.zeros(n)
  local gs = {}
  for s = 1, steps do gs[s] = nv.randn(n) end
  local run = function()
    for s = 1, steps do
      local opts = {}
      for k, x in pairs(o) do opts[k] = x end
      opts.step = s
      core.adamw_step(p, gs[s], m, v, opts)
    end
  end
  local p0 = flat(p)
  if reference then with_ref(run) else run() end
  return p, m, v, p0, gs
end

T.case("adamw: 3 steps against a plain-Lua torch.optim.AdamW (double) and bit for bit in f32", function()
  local o = {lr = 1e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1}
  local p, m, v, p0, gs = adamw_run(false, 3, o)
  local lp, lm, lv = {}, {}, {}
  local ep, em, ev = {}, {}, {}
  for i = 1, #p0 do lp[i], lm[i], lv[i], ep[i], em[i], ev[i] = p0[i], 0, 0, p0[i], 0, 0 end
  for s = 1, 3 do
    local opts = {lr = o.lr, beta1 = o.beta1, beta2 = o.beta2, eps = o.eps, weight_decay = o.weight_decay, step = s}
    adamw_lua(lp, flat(gs[s]), lm, lv, opts)
    adamw_lua(ep, flat(gs[s]), em, ev, opts, f32)
  end
  -- f32 rounding of a handful of operations per step: a few ulps of p (~1) plus lr-sized steps
  near_tbl(flat(p), lp, 1e-6, 1e-6, "param vs double")
  near_tbl(flat(m), lm, 1e-5, 1e-7, "m vs double")
  near_tbl(flat(v), lv, 1e-5, 1e-9, "v vs double")
  -- emulating f32 in torch's order gives the same bits (x86-64: no fused multiply-add)
  same_bits(p, from(ep, {#ep}), "param vs f32 emulation")
  same_bits(m, from(em, {#em}), "m vs f32 emulation")
  same_bits(v, from(ev, {#ev}), "v vs f32 emulation")
end)

T.case("adamw: decoupled weight decay uses the param before the update (zero grad: p * (1 - lr wd))", function()
  local p = nv.tensor({1.5, -2.25, 3.0})
  local g, m, v = nv.zeros(3), nv.zeros(3), nv.zeros(3)
  core.adamw_step(p, g, m, v, {lr = 0.1, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.5, step = 1})
  local k = f32(1 - 0.1 * 0.5)
  T.eq(p:totable(), {f32(1.5 * k), f32(-2.25 * k), f32(3.0 * k)})
  T.eq(m:totable(), {0.0, 0.0, 0.0})
end)

-- ---- sumsq --------------------------------------------------------------------------------------

T.case("sumsq against a Lua sum; strided and bf16 tensors", function()
  nv.manual_seed(12)
  local x = nv.randn(33, 17)
  local want = 0
  for _, v in ipairs(flat(x)) do want = want + v * v end
  T.near(core.sumsq(x), want, 1e-12 * want)
  T.near(core.sumsq(x:t()), want, 1e-12 * want, "transposed view")
  local b = x:to("bf16")
  local wb = 0
  for _, v in ipairs(flat(b)) do wb = wb + v * v end
  T.near(core.sumsq(b), wb, 1e-12 * wb, "bf16")
  T.eq(core.sumsq(nv.zeros(0)), 0.0)
end)

-- ---- fast kernels against the references (sizes above the OpenMP threshold) ----------------------

T.case("fast vs reference: embedding (bit for bit)", function()
  nv.manual_seed(13)
  local V, C, N = 50, 257, 300
  local w = nv.randn(V, C)
  local idt = {}
  for i = 1, N do idt[i] = (i * 7919) % V end
  local ids = nv.tensor(idt, "i64")
  local dout = nv.randn(N, C)
  same_bits(core.embedding_forward(ids, w), with_ref(core.embedding_forward, ids, w), "forward")
  local a, b = nv.randn(V, C), nil
  b = a:clone()
  core.embedding_backward(a, dout, ids)
  with_ref(core.embedding_backward, b, dout, ids)
  same_bits(a, b, "backward")
end)

T.case("fast vs reference: rmsnorm (out, rstd 1e-6 and dx 1e-5 relative; dweight bit for bit)", function()
  -- fast sums of squares and dot products are reassociated by SIMD: rstd may differ by an ulp
  nv.manual_seed(14)
  local N, C = 300, 257
  local x, w, dout = nv.randn(N, C), nv.randn(C), nv.randn(N, C)
  local o1, r1 = core.rmsnorm_forward(x, w, 1e-6)
  local o2, r2 = with_ref(core.rmsnorm_forward, x, w, 1e-6)
  T.close(o1, o2, 1e-6, 1e-7, "out")
  T.close(r1, r2, 1e-6, 0, "rstd")
  local dw1, dw2 = nv.randn(C), nil
  dw2 = dw1:clone()
  local dx1 = core.rmsnorm_backward(dw1, dout, x, w, r2)
  local dx2 = with_ref(core.rmsnorm_backward, dw2, dout, x, w, r2)
  T.close(dx1, dx2, 1e-5, 1e-6, "dx")
  same_bits(dw1, dw2, "dweight")
end)

T.case("fast vs reference: rope forward/backward (bit for bit)", function()
  nv.manual_seed(15)
  local B, Tn, Hh, D = 4, 40, 8, 64
  local c, s = core.rope_tables(Tn, D, 500000)
  local x = nv.randn(B, Tn, Hh, D)
  same_bits(core.rope_forward(x, c, s), with_ref(core.rope_forward, x, c, s), "forward")
  same_bits(core.rope_backward(x, c, s), with_ref(core.rope_backward, x, c, s), "backward")
end)

T.case("fast vs reference: swiglu (f32 expf vs double: 1e-5 relative)", function()
  -- a few f32 roundings per element, and in dgate 1 - sigmoid(g) loses |g| ulps for g >> 0
  nv.manual_seed(16)
  local g, u, d = nv.randn(300, 257) * 3, nv.randn(300, 257), nv.randn(300, 257)
  T.close(core.swiglu_forward(g, u), with_ref(core.swiglu_forward, g, u), 1e-5, 1e-6, "forward")
  local a1, b1 = core.swiglu_backward(d, g, u)
  local a2, b2 = with_ref(core.swiglu_backward, d, g, u)
  T.close(a1, a2, 1e-5, 1e-6, "dgate")
  T.close(b1, b2, 1e-5, 1e-6, "dup")
end)

T.case("fast vs reference: cross_entropy (loss 1e-6, dlogits 1e-5 relative)", function()
  -- fast: expf of x - max in f32 (relative error ~|x - max| 2^-24), sums in double
  nv.manual_seed(17)
  local N, V = 300, 517
  local x = nv.randn(N, V) * 4
  local tt = {}
  for i = 1, N do tt[i] = i % 11 == 0 and -100 or (i * 31) % V end
  local tg = nv.tensor(tt, "i64")
  local o = {z_loss = 1e-3, scale = 0.5}
  local l1, c1, d1 = core.cross_entropy(x, tg, o)
  local l2, c2, d2 = with_ref(core.cross_entropy, x, tg, o)
  T.eq(c1, c2)
  T.near(l1, l2, 1e-6 * math.abs(l2))
  T.close(d1, d2, 1e-5, 1e-10, "dlogits")
end)

T.case("fast vs reference: adamw (bit for bit) and sumsq (1e-12 relative)", function()
  local o = {lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1}
  local p1, m1, v1 = adamw_run(false, 3, o)
  local p2, m2, v2 = adamw_run(true, 3, o)
  same_bits(p1, p2, "param")
  same_bits(m1, m2, "m")
  same_bits(v1, v2, "v")
  nv.manual_seed(18)
  local x = nv.randn(1000, 333)
  local a, b = core.sumsq(x), with_ref(core.sumsq, x)
  T.near(a, b, 1e-12 * b)
end)

T.case("use_reference returns the previous setting", function()
  T.eq(nv.use_reference(true), false)
  T.eq(nv.use_reference(false), true)
  T.eq(nv.use_reference(false), false)
end)

-- ---- bad inputs ---------------------------------------------------------------------------------

T.case("bad inputs: embedding", function()
  local w = nv.randn(5, 3)
  T.raises(function() core.embedding_forward(nv.tensor({1, 9}, "i64"), w) end, "embedding_forward: id 9 out of range for V = 5")
  T.raises(function() core.embedding_forward(nv.tensor({-1}, "i64"), w) end, "id -1 out of range for V = 5")
  T.raises(function() core.embedding_forward(nv.tensor({1, 2}), w) end, "embedding_forward: ids must be i64, got [2] f32")
  T.raises(function() core.embedding_forward(nv.tensor({1}, "i64"), nv.randn(5)) end, "weight must be 2-D (V, C), got [5] f32")
  T.raises(function() core.embedding_forward(nv.tensor({1}, "i64"), w:to("bf16")) end, "weight must be f32, got [5,3] bf16")
  T.raises(function() core.embedding_backward(nv.zeros(5, 3), nv.zeros(3, 4), nv.tensor({1, 2}, "i64")) end,
    "embedding_backward: dout is [3,4] f32 but ids is [2] i64")
  T.raises(function() core.embedding_backward(nv.zeros(5, 3), nv.zeros(2, 3), nv.tensor({1, 5}, "i64")) end,
    "embedding_backward: id 5 out of range for V = 5")
  local dead = nv.randn(5, 3)
  dead:free()
  T.raises(function() core.embedding_forward(nv.tensor({1}, "i64"), dead) end, "embedding_forward: tensor has been freed")
end)

T.case("bad inputs: rmsnorm", function()
  T.raises(function() core.rmsnorm_forward(nv.randn(4, 64), nv.randn(32), 1e-5) end,
    "rmsnorm_forward: x is [4,64] f32 but weight is [32] f32")
  T.raises(function() core.rmsnorm_forward(nv.randn(4, 8):to("i32"), nv.randn(8), 1e-5) end,
    "rmsnorm_forward: x must be f32 or bf16, got [4,8] i32")
  T.raises(function() core.rmsnorm_forward(nv.randn(4, 8):to("bf16"), nv.randn(8):to("bf16"), 1e-5) end,
    "rmsnorm_forward: weight must be f32, got [8] bf16")
  T.raises(function() core.rmsnorm_forward(nv.randn(8, 4):t(), nv.randn(8), 1e-5) end, "x must be contiguous")
  T.raises(function() core.rmsnorm_forward(nv.randn(4, 8), nv.randn(8), -1) end, "eps must be a finite number >= 0")
  T.raises(function() core.rmsnorm_forward(nv.randn(4, 8), nv.randn(8)) end, "bad argument #3")
  local x, w = nv.randn(4, 8), nv.randn(8)
  local _, r = core.rmsnorm_forward(x, w, 1e-5)
  T.raises(function() core.rmsnorm_backward(nv.zeros(8), nv.randn(4, 8), x, w, nv.zeros(3)) end,
    "rmsnorm_backward: x is [4,8] f32 but rstd is [3] f32")
  T.raises(function() core.rmsnorm_backward(nv.zeros(7), nv.randn(4, 8), x, w, r) end,
    "rmsnorm_backward: dweight is [7] f32 but weight is [8] f32")
  T.raises(function() core.rmsnorm_backward(nv.zeros(8), nv.randn(4, 9), x, w, r) end,
    "rmsnorm_backward: dout is [4,9] f32 but x is [4,8] f32")
end)

T.case("bad inputs: rope", function()
  local c, s = core.rope_tables(3, 4, 10000)
  T.raises(function() core.rope_tables(3, 5, 10000) end, "rope_tables: the head dim D must be even and >= 2, got 5")
  T.raises(function() core.rope_tables(3, 4, -1) end, "theta must be a finite number > 0")
  T.raises(function() core.rope_forward(nv.randn(3, 2, 4), c, s) end, "rope_forward: x must be 4-D (B, T, H, D), got [3,2,4] f32")
  T.raises(function() core.rope_forward(nv.randn(1, 5, 2, 4), c, s) end,
    "rope_forward: x is [1,5,2,4] f32 but cos is [3,4] f32")
  T.raises(function() core.rope_backward(nv.randn(1, 3, 2, 4), c, nv.randn(3, 2)) end,
    "rope_backward: cos is [3,4] f32 but sin is [3,2] f32")
  local function scaling(over)
    local sc = {factor = 8, low_freq_factor = 1, high_freq_factor = 4, original_max_position_embeddings = 8192}
    for k, v in pairs(over) do sc[k] = v end
    return function() core.rope_tables(3, 4, 10000, sc) end
  end
  T.raises(scaling({factr = 8}), "rope_tables: unknown option 'factr' (valid: factor, low_freq_factor, "
    .. "high_freq_factor, original_max_position_embeddings, rope_type)")
  T.raises(scaling({low_freq_factor = false}), "rope_tables: option 'low_freq_factor' must be a number, got boolean")
  T.raises(scaling({low_freq_factor = 4}), "high_freq_factor (4) must be greater than low_freq_factor (4)")
  T.raises(scaling({factor = "8"}), "option 'factor' must be a number, got string")
  T.raises(scaling({factor = 0}), "rope_tables: scaling factor must be > 0, got 0")
  T.raises(scaling({rope_type = "yarn"}), "rope_type must be \"llama3\"")
  T.raises(function() core.rope_tables(3, 4, 10000, {factor = 8, high_freq_factor = 4, original_max_position_embeddings = 8192}) end,
    "rope_tables: option 'low_freq_factor' is required")
end)

T.case("bad inputs: swiglu", function()
  T.raises(function() core.swiglu_forward(nv.randn(2, 3), nv.randn(3, 2)) end, "swiglu_forward: gate is [2,3] f32 but up is [3,2] f32")
  T.raises(function() core.swiglu_forward(nv.randn(2, 3), nv.randn(2, 3):to("bf16")) end,
    "swiglu_forward: gate is [2,3] f32 but up is [2,3] bf16; the activations of one call must share a dtype")
  T.raises(function() core.swiglu_backward(nv.randn(2, 4), nv.randn(2, 3), nv.randn(2, 3)) end,
    "swiglu_backward: dout is [2,4] f32 but gate is [2,3] f32")
end)

T.case("bad inputs: cross_entropy", function()
  local x = nv.randn(3, 7)
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 7, 2}, "i64")) end, "cross_entropy: target 7 out of range for V = 7 (element 2")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, -1, 2}, "i64")) end, "target -1 out of range for V = 7")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, -100, 2}, "i64"), {ignore_index = 0}) end, "target -100 out of range")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 2, 3})) end, "cross_entropy: targets must be i64, got [3] f32")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 2}, "i64")) end, "cross_entropy: logits is [3,7] f32 but targets is [2] i64")
  T.raises(function() core.cross_entropy(x:to("i32"), nv.tensor({1, 2, 3}, "i64")) end, "logits must be f32, got [3,7] i32")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 2, 3}, "i64"), {zloss = 1}) end,
    "cross_entropy: unknown option 'zloss' (valid: ignore_index, z_loss, grad, scale, of_count, defer, grad_dtype)")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 2, 3}, "i64"), {grad_dtype = "i32"}) end,
    "cross_entropy: grad_dtype must be 'f32' or 'bf16', got i32")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 2, 3}, "i64"), {ignore_index = 1.5}) end,
    "option 'ignore_index' must be an integer")
  T.raises(function() core.cross_entropy(x, nv.tensor({1, 2, 3}, "i64"), {grad = 1}) end, "option 'grad' must be a boolean, got number")
end)

T.case("bad inputs: adamw_step and sumsq", function()
  local p, g, m, v = nv.randn(4), nv.randn(4), nv.zeros(4), nv.zeros(4)
  local o = {lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, step = 1}
  local function with(k, val)
    local r = {}
    for kk, vv in pairs(o) do r[kk] = vv end
    r[k] = val
    return r
  end
  T.raises(function() core.adamw_step(p, g, m, v, with("step", nil)) end, "adamw_step: option 'step' is required")
  T.raises(function() core.adamw_step(p, g, m, v, with("step", 0)) end, "adamw_step: step must be an integer >= 1 (1-based), got 0")
  T.raises(function() core.adamw_step(p, g, m, v, with("step", 1.5)) end, "option 'step' must be an integer")
  T.raises(function() core.adamw_step(p, g, m, v, with("beta1", 1)) end, "beta1 must be in [0, 1), got 1")
  T.raises(function() core.adamw_step(p, g, m, v, with("momentum", 1)) end,
    "adamw_step: unknown option 'momentum' (valid: lr, beta1, beta2, eps, weight_decay, step)")
  T.raises(function() core.adamw_step(p, nv.randn(5), m, v, o) end, "adamw_step: param is [4] f32 but grad is [5] f32")
  T.raises(function() core.adamw_step(p, g, m, v:to("bf16"), o) end, "adamw_step: v must be f32, got [4] bf16")
  T.raises(function() core.adamw_step(p, g, m, m, o) end, "adamw_step: m and v overlap in memory")
  T.raises(function() core.adamw_step(p, g, m, v) end, "bad argument #5")
  -- views of one flat buffer are fine as long as they do not overlap
  local flatbuf = nv.zeros(8)
  core.adamw_step(p, g, flatbuf:narrow(1, 1, 4), flatbuf:narrow(1, 5, 4), o)
  T.raises(function() core.sumsq(nv.tensor({1, 2}, "i64")) end, "sumsq: the tensor must be f32 or bf16, got [2] i64")
end)

T.case("cuda tensors mixed with cpu ones: a clean one-device error (the cuda kernels: test_cuda_layers.lua)",
  function()
  if not nv.cuda.available() then T.skip("no GPU") end
  local x = nv.randn(2, 8):cuda()
  T.raises(function() core.rmsnorm_forward(x, nv.ones(8), 1e-5) end, "rmsnorm_forward: weight is")
  T.raises(function() core.swiglu_forward(nv.randn(2, 8), x) end, "every tensor must be on one device")
end)

T.case("cross_entropy defer = true: the loss sum left in a tensor (its double bits), the same gradient; of_count", function()
  nv.manual_seed(31)
  local logits = nv.randn(6, 10)
  local tg = nv.tensor({1, 9, -100, 0, 4, 4}, "i64")
  local loss, n, d = core.cross_entropy(logits, tg, {z_loss = 1e-3, scale = 0.5})
  local sum, n2, d2 = core.cross_entropy(logits, tg, {z_loss = 1e-3, scale = 0.5, defer = true})
  T.eq(sum:dtype(), "i64", "an i64 tensor")
  T.eq(n2, n, "count")
  local v = string.unpack("<d", string.pack("<i8", sum:totable()[1]))
  T.eq(v / n, loss, "sum / count = the loss, bit for bit (the same double sum and division)")
  T.eq(d2:bytes(), d:bytes(), "the same gradient")
  -- of_count: two halves of the batch, each normalised by the batch's count, add up to it
  local la = core.cross_entropy(logits:narrow(1, 1, 3), tg:narrow(1, 1, 3), {z_loss = 1e-3, of_count = n})
  local lb = core.cross_entropy(logits:narrow(1, 4, 3), tg:narrow(1, 4, 3), {z_loss = 1e-3, of_count = n})
  T.ok(math.abs(la + lb - loss) <= 1e-15 * math.abs(loss), "halves with of_count add up to the batch's loss")
  local _, _, da = core.cross_entropy(logits:narrow(1, 1, 3), tg:narrow(1, 1, 3), {z_loss = 1e-3, scale = 0.5, of_count = n})
  T.eq(da:bytes(), d:narrow(1, 1, 3):contiguous():bytes(), "their gradient rows are the batch's, bit for bit")
  T.raises(function() core.cross_entropy(logits, tg, {of_count = 0}) end, "of_count must be a positive integer")
end)
