-- tests/test_bf16act.lua: bf16 activations (core/NUMERICS.md §11, recipe act_dtype).
-- Per op (embedding, RMSNorm, RoPE, SwiGLU, attention; forward and backward), on the fast and the
-- reference kernels: the bf16 result is bit for bit the f32 op on the widened inputs rounded once
-- to bf16 (its oracle); parameters' gradients and saved statistics are the f32 op's, bit for bit;
-- fast and reference agree bit for bit where their f32 kernels do, else within one bf16 ulp; the
-- bf16 result against plain-Lua double math within one rounding (2^-8 relative) plus the f32
-- kernels' own error; mixed activation dtypes are an error.
-- Models: act_dtype = "f32" reproduces the numbers of the dataflow before act_dtype existed (3
-- steps of nvfp4 and bf16 training: losses and gradient bits, produced by main's build at 55f2d39);
-- a 2-layer Llama under nvfp4 with bf16 activations learns, keeps bf16 activations (and f32 rstd,
-- lse) for its backward and holds fewer bytes for it; its gradient is within the bf16 rounding
-- bound of the f32 dataflow's. Config and recipe errors for act_dtype.
--
-- Tolerances. bf16 has 8 significant bits: rounding to nearest is off by at most 2^-8 relative
-- (half an ulp, 2^-7 at 1). One op rounds each output once, so op-level bounds are 2^-8 |want|
-- (plus the f32 kernels' own ~1e-6 relative error where the oracle is double math). A model's
-- gradient passes through about 15 roundings forward and 15 backward in a 2-layer Llama (norms,
-- RoPE, attention, SwiGLU, residual sums, dgrads), so its relative L2 distance from the f32
-- dataflow's is bounded by 30 * 2^-8 ≈ 0.12 (random errors give far less: sqrt(30) * 2^-8 / sqrt(3)
-- ≈ 0.012).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local llama = require "nvlua.llama"

local U = 2 ^ -8 -- unit roundoff of bf16

local function with_ref(fn, ...) return T.with(nv.use_reference, true, fn, ...) end
local function flat(t) return t:contiguous():to("f32"):reshape(-1):totable() end
local function bf(t) return t:to("bf16") end
local function wide(t) return t:to("f32") end

-- a and b hold the same values bit for bit (NaN equal to NaN), and a has dtype dt
local function same(a, b, what, dt)
  if dt then T.eq(a:dtype(), dt, what .. ": dtype") end
  T.eq(a:size(), b:size(), what .. ": shape")
  local x, y = flat(a), flat(b)
  for i = 1, #x do
    if x[i] ~= y[i] and not (x[i] ~= x[i] and y[i] ~= y[i]) then
      error(string.format("%s: element %d differs: %.9g vs %.9g", what, i, x[i], y[i]), 2)
    end
  end
end

-- bf16 tensors a and b differ by at most one bf16 ulp anywhere; returns how many elements differ
local function within_ulp(a, b, what)
  local x, y = flat(a), flat(b)
  local n = 0
  for i = 1, #x do
    if x[i] ~= y[i] then
      n = n + 1
      local m = math.max(math.abs(x[i]), math.abs(y[i]))
      local ulp = 2.0 ^ (math.floor(math.log(m, 2)) - 7)
      if math.abs(x[i] - y[i]) > ulp then
        error(string.format("%s: element %d: %.9g vs %.9g, more than one bf16 ulp (%.3g)", what, i, x[i], y[i], ulp), 2)
      end
    end
  end
  return n
end

-- inputs exactly representable in bf16 (so the f32 op and the bf16 op see the same values)
local function rb(...) return nv.randn(...):to("bf16") end

-- ---- per op: the oracle, on both kernel sets ----------------------------------------------------

-- run(kernels) with kernels = "fast" or "ref"
local function both(fn)
  fn(function(f, ...) return f(...) end, "fast")
  fn(with_ref, "ref")
end

T.case("embedding: bf16 out = the f32 rows rounded; bf16 dout scatters into the f32 weight gradient exactly", function()
  nv.manual_seed(1)
  local V, C = 11, 40
  local w = nv.randn(V, C)
  local ids = nv.tensor({3, 0, 10, 3, 7, 1}, "i64")
  local dout = rb(6, C)
  both(function(run, k)
    local o = run(core.embedding_forward, ids, w, "bf16")
    same(o, bf(run(core.embedding_forward, ids, w)), k .. " forward", "bf16")
    local g1, g2 = nv.randn(V, C), nil
    g2 = g1:clone()
    run(core.embedding_backward, g1, dout, ids)
    run(core.embedding_backward, g2, wide(dout), ids)
    same(g1, g2, k .. " backward (f32 dweight)", "f32")
  end)
  T.raises(function() core.embedding_forward(ids, w, "i32") end,
    "embedding_forward: dtype must be 'f32' or 'bf16', got 'i32'")
end)

T.case("rmsnorm: bf16 out and dx = the f32 op's rounded once; rstd and dweight the f32 op's bit for bit", function()
  nv.manual_seed(2)
  -- 37 x 96: one thread, a ragged dweight column chunk; 301 x 200: threaded rows and chunks
  for _, nc in ipairs({{37, 96}, {301, 200}}) do
  local N, C = nc[1], nc[2]
  local x, w, dout = rb(N, C) * 3, nv.randn(C), rb(N, C)
  x = x:to("bf16")
  both(function(run, k)
    local o, r = run(core.rmsnorm_forward, x, w, 1e-5)
    local o32, r32 = run(core.rmsnorm_forward, wide(x), w, 1e-5)
    same(o, bf(o32), k .. " out", "bf16")
    same(r, r32, k .. " rstd", "f32")
    local dw1, dw2 = nv.randn(C), nil
    dw2 = dw1:clone()
    local dx = run(core.rmsnorm_backward, dw1, dout, x, w, r)
    local dx32 = run(core.rmsnorm_backward, dw2, wide(dout), wide(x), w, r32)
    same(dx, bf(dx32), k .. " dx", "bf16")
    same(dw1, dw2, k .. " dweight (f32, accumulated)", "f32")
  end)
  end
end)

T.case("rope: bf16 out and dx = the f32 rotation rounded once", function()
  nv.manual_seed(3)
  -- (2, 9, 3, 16): one thread; (4, 40, 8, 64): threaded rows
  for _, sh in ipairs({{2, 9, 3, 16}, {4, 40, 8, 64}}) do
    local c, s = core.rope_tables(sh[2], sh[4], 10000)
    local x = rb(table.unpack(sh))
    both(function(run, k)
      same(run(core.rope_forward, x, c, s), bf(run(core.rope_forward, wide(x), c, s)), k .. " forward", "bf16")
      same(run(core.rope_backward, x, c, s), bf(run(core.rope_backward, wide(x), c, s)), k .. " backward", "bf16")
    end)
  end
end)

-- SwiGLU's forward and backward on bf16 g, u, d against the f32 op on the widened inputs, rounded once
local function swiglu_oracle(g, u, d)
  both(function(run, k)
    same(run(core.swiglu_forward, g, u), bf(run(core.swiglu_forward, wide(g), wide(u))), k .. " forward", "bf16")
    local dg, du = run(core.swiglu_backward, d, g, u)
    local dg32, du32 = run(core.swiglu_backward, wide(d), wide(g), wide(u))
    same(dg, bf(dg32), k .. " dgate", "bf16")
    same(du, bf(du32), k .. " dup", "bf16")
  end)
end

T.case("swiglu: bf16 out, dgate, dup = the f32 op's rounded once", function()
  nv.manual_seed(4)
  local g, u, d = (rb(50, 70) * 3):to("bf16"), rb(50, 70), rb(50, 70)
  swiglu_oracle(g, u, d)
end)

T.case("swiglu, bf16 kernels: threaded chunks, a ragged tail, extremes, NaN, inf = the f32 op rounded once", function()
  -- 201 x 203 elements: above the threading threshold, chunks of 4096 with a ragged last one; gate
  -- values past exp's clamps (|g| = 100, 1e30), zeros, inf and NaN
  nv.manual_seed(14)
  local g = nv.randn(201, 203) * 4
  for i, v in ipairs{100, -100, 1e30, -1e30, 0, 1 / 0, -1 / 0, 0 / 0, 88.5, -87.5} do
    g:narrow(1, 7 * i, 1):narrow(2, 3 * i, 1):fill_(v)
  end
  g = g:to("bf16")
  local u, d = rb(201, 203), rb(201, 203)
  swiglu_oracle(g, u, d)
end)

-- Attention follows the rule with core.attention_flash(false); on a CPU with AVX512-BF16 the default is the
-- flash numerics (P and dS rounded to bf16), tested within bounds in test_attention_bf16.lua.
local function rule(fn, ...) return T.with(core.attention_flash, false, fn, ...) end

T.case("attention: bf16 out, dq, dk, dv = the f32 op's rounded once; lse the f32 op's", function()
  nv.manual_seed(5)
  local q, k, v = rb(2, 7, 4, 8), rb(2, 7, 2, 8), rb(2, 7, 2, 8)
  local dout = rb(2, 7, 4, 8)
  rule(both, function(run, kk)
    local o, l = run(core.attention_forward, q, k, v, 0.35)
    local o32, l32 = run(core.attention_forward, wide(q), wide(k), wide(v), 0.35)
    same(o, bf(o32), kk .. " out", "bf16")
    same(l, l32, kk .. " lse", "f32")
    local dq, dk, dv = run(core.attention_backward, dout, q, k, v, o, l, 0.35)
    local dq32, dk32, dv32 = run(core.attention_backward, wide(dout), wide(q), wide(k), wide(v), wide(o), l, 0.35)
    same(dq, bf(dq32), kk .. " dq", "bf16")
    same(dk, bf(dk32), kk .. " dk", "bf16")
    same(dv, bf(dv32), kk .. " dv", "bf16")
  end)
end)

-- ---- fast vs reference on bf16 -------------------------------------------------------------------

T.case("fast vs reference on bf16: embedding, rope bit for bit; rmsnorm, swiglu, attention within a bf16 ulp", function()
  nv.manual_seed(6)
  local x, w = rb(300, 257), nv.randn(257)
  local c, s = core.rope_tables(40, 64, 500000)
  local xr = rb(4, 40, 8, 64)
  same(core.rope_forward(xr, c, s), with_ref(core.rope_forward, xr, c, s), "rope forward", "bf16")
  same(core.rope_backward(xr, c, s), with_ref(core.rope_backward, xr, c, s), "rope backward", "bf16")
  local ids = nv.tensor({1, 5, 2, 0}, "i64")
  local ew = nv.randn(6, 257)
  same(core.embedding_forward(ids, ew, "bf16"), with_ref(core.embedding_forward, ids, ew, "bf16"), "embedding", "bf16")
  -- f32 kernels that differ by an ulp or so (SIMD sums, expf vs double) may straddle a bf16 boundary
  local o1, r1 = core.rmsnorm_forward(x, w, 1e-6)
  local o2 = with_ref(core.rmsnorm_forward, x, w, 1e-6)
  local n = within_ulp(o1, o2, "rmsnorm out")
  local dw1, dw2 = nv.zeros(257), nv.zeros(257)
  within_ulp(core.rmsnorm_backward(dw1, x, x, w, r1), with_ref(core.rmsnorm_backward, dw2, x, x, w, r1), "rmsnorm dx")
  same(dw1, dw2, "rmsnorm dweight", "f32")
  n = n + within_ulp(core.swiglu_forward(x, x), with_ref(core.swiglu_forward, x, x), "swiglu out")
  local q = rb(2, 20, 4, 16)
  local att = with_ref(core.attention_forward, q, q, q, 0.25)
  n = n + within_ulp(rule(core.attention_forward, q, q, q, 0.25), att, "attention")
  T.ok(n < 0.01 * (300 * 257 * 2 + 2 * 20 * 4 * 16), "fewer than 1% of the elements differ, got " .. n)
end)

-- ---- against double math (an oracle independent of the f32 kernels) ------------------------------

T.case("bf16 rmsnorm and swiglu vs double math on the bf16 inputs: within one rounding (2^-8) + 1e-6", function()
  nv.manual_seed(7)
  local N, C = 6, 32
  local x, w = rb(N, C), nv.randn(C)
  local o = core.rmsnorm_forward(x, w, 1e-5)
  local xs, ws, os = flat(x), flat(w), flat(o)
  for n = 0, N - 1 do
    local ss = 0
    for c = 1, C do ss = ss + xs[n * C + c] ^ 2 end
    local r = 1 / math.sqrt(ss / C + 1e-5)
    for c = 1, C do
      local want = xs[n * C + c] * r * ws[c]
      T.ok(math.abs(os[n * C + c] - want) <= (U + 1e-6) * math.abs(want) + 1e-30,
        string.format("rmsnorm [%d,%d]: %.9g vs %.9g", n, c, os[n * C + c], want))
    end
  end
  local g, u = rb(N, C), rb(N, C)
  local y, gs, us = flat(core.swiglu_forward(g, u)), flat(g), flat(u)
  for i = 1, #y do
    local want = gs[i] / (1 + math.exp(-gs[i])) * us[i]
    T.ok(math.abs(y[i] - want) <= (U + 1e-6) * math.abs(want) + 1e-30,
      string.format("swiglu %d: %.9g vs %.9g", i, y[i], want))
  end
end)

T.case("bf16 backward vs f32 backward on the same inputs: within one rounding, 2^-8 relative", function()
  nv.manual_seed(8)
  local x, w, d = rb(20, 48), nv.randn(48), rb(20, 48)
  local _, r = core.rmsnorm_forward(x, w, 1e-5)
  local dx = core.rmsnorm_backward(nv.zeros(48), d, x, w, r)
  local dx32 = core.rmsnorm_backward(nv.zeros(48), wide(d), wide(x), w, r)
  T.close(wide(dx), dx32, U, 0, "rmsnorm dx")
  local q, k = rb(1, 9, 2, 8), rb(1, 9, 1, 8)
  local o, l = rule(core.attention_forward, q, k, k, 0.3)
  local dq, dk = rule(core.attention_backward, o, q, k, k, o, l, 0.3)
  local dq32, dk32 = core.attention_backward(wide(o), wide(q), wide(k), wide(k), wide(o), l, 0.3)
  T.close(wide(dq), dq32, U, 0, "attention dq")
  T.close(wide(dk), dk32, U, 0, "attention dk")
end)

T.case("errors: activations of one call share a dtype; parameters stay f32", function()
  local x = rb(4, 8)
  T.raises(function() core.rmsnorm_backward(nv.zeros(8), nv.randn(4, 8), x, nv.randn(8), nv.randn(4)) end,
    "rmsnorm_backward: dout is [4,8] f32 but x is [4,8] bf16; the activations of one call must share a dtype")
  T.raises(function() core.swiglu_backward(x, x, nv.randn(4, 8)) end, "swiglu_backward: dout is [4,8] bf16 but up is")
  T.raises(function() core.rope_forward(rb(1, 2, 1, 4), nv.zeros(2, 4):to("bf16"), nv.zeros(2, 4)) end,
    "rope_forward: cos must be f32")
  T.raises(function() core.embedding_backward(nv.zeros(5, 8):to("bf16"), x, nv.tensor({1, 2, 3, 4}, "i64")) end,
    "embedding_backward: dweight must be f32")
end)

-- ---- models ---------------------------------------------------------------------------------------

local CFG = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2}

-- a 31-based checksum of the f32 bits of t (order-sensitive; a flipped bit anywhere changes it)
local function checksum(t)
  local s, v = 0, t:reshape(-1):totable()
  for i = 1, #v do s = (s * 31 + string.unpack("<I4", string.pack("<f", v[i]))) % 2147483647 end
  return s
end

-- 3 steps of plain SGD (lr 0.05) on fixed random tokens -> {{loss, grad checksum}, ...}
local function three_steps(r)
  local m = llama.Llama(CFG, {seed = 5, recipe = r})
  local g = nv.Generator(9)
  local out = {}
  for step = 1, 3 do
    m.step = step - 1
    local ids = (nv.rand({2, 32}, {generator = g}) * 64):to("i64")
    local y = (nv.rand({2, 32}, {generator = g}) * 64):to("i64")
    m:zero_grad()
    local loss = m:forward_backward(ids, y)
    out[step] = {string.format("%a", loss), checksum(m.grad_buffer)}
    for _, p in ipairs(m:named_parameters()) do p.param:add_(p.grad, -0.05) end
  end
  return out
end

-- Produced with main's build at 55f2d39 (before act_dtype existed) running the same three_steps on
-- recipe.nvfp4({bf16_first = 0, bf16_last = 0}) and recipe.bf16() under nv.use_reference(true): the
-- scalar reference kernels, so the values do not depend on the machine's BLAS or SIMD (the fast
-- kernels' sums differ between CPUs, and the bf16 GEMMs now run on oneDNN where it is present).
local GOLDEN = {
  nvfp4 = {{"0x1.0c1da30995cc7p+2", 402974321}, {"0x1.0ba94f2c14282p+2", 1490340427},
    {"0x1.0b900fc3e72eep+2", 1749664788}},
  bf16 = {{"0x1.0c0c5274f3ccp+2", 1926558382}, {"0x1.0b9096245604bp+2", 11414657},
    {"0x1.0ba44eb8d5607p+2", 1209995003}},
}

T.case("act_dtype = f32: 3 training steps bit for bit as before act_dtype (nvfp4, bf16); bf16 differs", function()
  T.with(nv.use_reference, true, function()
    local got = three_steps(nv.recipe.nvfp4({bf16_first = 0, bf16_last = 0, act_dtype = "f32"}))
    T.eq(got, GOLDEN.nvfp4, "nvfp4, act_dtype f32")
    T.eq(three_steps(nv.recipe.bf16({act_dtype = "f32"})), GOLDEN.bf16, "bf16, act_dtype f32")
    local b = three_steps(nv.recipe.nvfp4({bf16_first = 0, bf16_last = 0}))
    T.ok(b[1][2] ~= GOLDEN.nvfp4[1][2], "the default (bf16 activations) computes another gradient")
  end)
end)

T.case("nvfp4 Llama, bf16 activations: saved activations bf16 (rstd, lse f32), fewer bytes; it learns", function()
  local function built(act)
    local m = llama.Llama(CFG, {seed = 3, recipe = nv.recipe.nvfp4({act_dtype = act})})
    return m
  end
  local ids = (nv.rand({2, 32}, {generator = nv.Generator(4)}) * 64):to("i64")
  local function held(m) -- bytes live after a training forward (what backward will read), then dropped
    local before = nv.memory().cpu
    local logits = m:forward(ids)
    local n = nv.memory().cpu - before
    return n, logits
  end
  local m16, m32 = built("bf16"), built("f32")
  local n16, l16 = held(m16)
  local n32 = held(m32)
  T.eq(l16:dtype(), "bf16", "logits")
  local b = m16.layers[1]
  T.eq(b.input_layernorm._saved.x:dtype(), "bf16", "norm input (the residual stream)")
  T.eq(b.input_layernorm._saved.rstd:dtype(), "f32", "rstd")
  T.eq(b.self_attn._saved.q:dtype(), "bf16", "q")
  T.eq(b.self_attn._saved.out:dtype(), "bf16", "attention out")
  T.eq(b.self_attn._saved.lse:dtype(), "f32", "lse")
  T.eq(b.mlp._saved.g:dtype(), "bf16", "gate")
  -- down_proj keeps its input (the SwiGLU output) as its wgrad copy, quantized with fprop's copy
  -- in one pass (nvfp4 along the tokens, with the RHT), not the bf16 tensor
  local ds = b.mlp.down_proj._saved
  T.ok(ds.x == nil and ds.saved.x == nil, "down_proj keeps no bf16 input")
  T.eq(ds.saved.qx_col:format(), "nvfp4", "down_proj input: its nvfp4 wgrad copy")
  T.ok(ds.saved.qx_col.rht and ds.saved.qx_col:axis() == 1, "blocked along the tokens, with the RHT")
  T.ok(n16 < 0.75 * n32, string.format("bf16 activations hold %d bytes, f32 ones %d", n16, n32))
  -- train a few steps on one batch: the loss falls
  local opt = require("nvlua.optim").AdamW(m16:named_parameters(), {lr = 1e-2})
  local y = (nv.rand({2, 32}, {generator = nv.Generator(5)}) * 64):to("i64")
  local first, last
  for step = 1, 12 do
    m16.step = step - 1
    m16:zero_grad()
    local loss = m16:forward_backward(ids, y)
    opt:step()
    first = first or loss
    last = loss
  end
  T.ok(last < first - 0.5, string.format("loss fell from %.4f to %.4f", first, last))
end)

T.case("bf16 activations: the gradient within 30 roundings (30 * 2^-8, relative L2) of the f32 dataflow's", function()
  local ids = (nv.rand({2, 32}, {generator = nv.Generator(6)}) * 64):to("i64")
  local y = (nv.rand({2, 32}, {generator = nv.Generator(7)}) * 64):to("i64")
  local function grad(act)
    local m = llama.Llama(CFG, {seed = 8, recipe = nv.recipe.bf16({act_dtype = act})})
    local loss = m:forward_backward(ids, y)
    return m.grad_buffer:clone(), loss
  end
  local g16, l16 = grad("bf16")
  local g32, l32 = grad("f32")
  local rel = math.sqrt(core.sumsq(g16 - g32) / core.sumsq(g32))
  T.ok(rel > 0, "the dataflows differ")
  T.ok(rel <= 30 * U, string.format("relative L2 distance %.4g > %.4g", rel, 30 * U))
  T.near(l16, l32, 30 * U * l32, "loss")
end)

T.case("act_dtype errors: recipes, set_act_dtype, the train config, a recipe value that disagrees", function()
  T.raises(function() nv.recipe.nvfp4({act_dtype = "fp16"}) end,
    "recipe.nvfp4: option act_dtype must be one of bf16, f32")
  T.raises(function() nv.recipe.f32({act_dtype = 1}) end, "recipe.f32: option act_dtype must be one of bf16, f32")
  T.raises(function() nv.recipe.bf16():set_act_dtype("f16") end,
    "recipe bf16: act_dtype must be 'bf16' or 'f32', got 'f16'")
  T.eq(nv.recipe.f32().act_dtype, "f32")
  T.eq(nv.recipe.custom(function() return "f32" end).act_dtype, "f32")
  for _, n in ipairs({"bf16", "fp8_cs", "fp8_delayed", "mxfp8", "nvfp4", "mxfp4"}) do
    T.eq(nv.recipe.make(n).act_dtype, "bf16", n .. " default")
    T.eq(nv.recipe.make(n, {act_dtype = "f32"}).act_dtype, "f32", n .. " act_dtype=f32")
  end
  T.eq(tostring(nv.recipe.bf16({act_dtype = "f32"})), "bf16(act_dtype=f32)")
  local train = require "nvlua.train"
  local parse = function(args) return train.schema:parse(args) end
  T.raises(function() parse({"act_dtype=f16"}) end, "config: act_dtype must be one of recipe, bf16, f32")
  T.eq(train.recipe(parse({"recipe=mxfp4", "act_dtype=f32"})).act_dtype, "f32")
  T.eq(train.recipe(parse({"recipe=mxfp4"})).act_dtype, "bf16")
  T.eq(train.recipe(parse({"recipe=f32"})).act_dtype, "f32")
  T.eq(train.recipe(parse({"recipe=f32", "act_dtype=bf16"})).act_dtype, "bf16")
  local c = parse({"act_dtype=f32"})
  c.recipe = nv.recipe.nvfp4()
  T.raises(function() train.recipe(c) end, "config: act_dtype=f32 but the recipe value")
  c.recipe = nv.recipe.nvfp4({act_dtype = "f32"})
  T.eq(train.recipe(c), c.recipe, "a recipe value that agrees")
end)
