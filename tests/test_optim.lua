-- test_optim.lua: the multi-tensor optimizer ops on the CPU (core/optim.c, optim.lua): the lazy clip
-- (opt:clip_grad_norm, then opt:step scales the grads on the fly) equals the eager one
-- (optim.clip_grad_norm scales them in place, then a step) bit for bit; optim.grad_norm is still
-- the sum of core.sumsq per grad in order, bit for bit; bad arguments are clear errors. The device
-- side: test_cuda_optim.lua.
local T = require "nvlua.test"
local nv = require "nvlua"
local optim = require "nvlua.optim"
local core = nv.core

local function params(seed)
  nv.manual_seed(seed)
  local es = {}
  for i, n in ipairs({ 1, 17, 4099, 10000 }) do
    es[i] = { name = "p" .. i, param = nv.randn(n), grad = nv.randn(n) * 3, no_decay = i % 2 == 0 }
  end
  return es
end

T.case("grad_norm: the sum of core.sumsq per grad, in order, bit for bit", function()
  local es = params(1)
  local ss = 0.0
  for _, e in ipairs(es) do ss = ss + core.sumsq(e.grad) end
  T.eq(optim.grad_norm(es), math.sqrt(ss))
  -- a strided grad takes the per-tensor path: the same value
  local t = nv.randn(8, 6)
  local s = { { param = nv.zeros(6, 8), grad = t:transpose(1, 2) } }
  T.eq(optim.grad_norm(s), math.sqrt(core.sumsq(s[1].grad)))
end)

T.case("opt:clip_grad_norm + step = optim.clip_grad_norm + step, bit for bit, over 3 steps", function()
  local a, b = params(2), params(2)
  local oa, ob = optim.AdamW(a, { lr = 1e-2 }), optim.AdamW(b, { lr = 1e-2 })
  for s = 1, 3 do
    nv.manual_seed(10 + s)
    for i, e in ipairs(a) do
      local g = nv.randn(e.grad:numel()) * s
      e.grad:copy_(g); b[i].grad:copy_(g)
    end
    local na = oa:clip_grad_norm(1.0)
    local nb = optim.clip_grad_norm(b, 1.0)
    T.ok(nb > 1, "clipping active")
    T.eq(na:value(), nb, "norm of step " .. s)
    oa:step(); ob:step()
  end
  for i, e in ipairs(a) do
    T.eq(e.param:totable(), b[i].param:totable(), e.name .. " param")
    T.eq(oa.m[e.name]:totable(), ob.m[e.name]:totable(), e.name .. " m")
  end
  -- a norm under max_norm: factor 1, the step equals an unclipped one
  local c, d = params(3), params(3)
  local oc, od = optim.AdamW(c, { lr = 1e-2 }), optim.AdamW(d, { lr = 1e-2 })
  T.ok(oc:clip_grad_norm(1e9):value() < 1e9)
  oc:step(); od:step()
  for i, e in ipairs(c) do T.eq(e.param:totable(), d[i].param:totable(), e.name .. " unclipped") end
  -- the norm handle is read-once-per-clip
  local n1 = oc:clip_grad_norm(1.0)
  oc:clip_grad_norm(1.0)
  T.raises(function() n1:value() end, "newer norm")
  T.raises(function() oc:clip_grad_norm(0) end, "max_norm must be a finite number > 0, got 0")
end)

T.case("adamw_multi and grad_norm_multi: bad arguments are clear errors", function()
  local p, g, m, v = nv.zeros(4), nv.zeros(4), nv.zeros(4), nv.zeros(4)
  local o = { lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0, step = 1 }
  T.raises(function() core.adamw_multi({ p }, { g, g }, { m }, { v }, o) end, "adamw_multi: grads has 2 tensors")
  T.raises(function() core.adamw_multi({ p }, { 3 }, { m }, { v }, o) end, "grads[1] is not a tensor")
  T.raises(function() core.adamw_multi({ p }, { nv.zeros(5) }, { m }, { v }, o) end, "grad #1 is [5] f32")
  T.raises(function() core.adamw_multi({ p }, { p }, { m }, { v }, o) end, "param #1 and grad #1 overlap")
  T.raises(function() core.adamw_multi({ p }, { g }, { m }, { v }, o, nil, nv.zeros(4)) end,
    "norm state must be a contiguous i64 tensor of 4 elements")
  T.raises(function() core.adamw_multi({ p }, { g:to("bf16") }, { m }, { v }, o) end,
    "grad #1 must be a contiguous f32 tensor")
  T.raises(function() core.grad_norm_multi(nv.zeros(4, { dtype = "i64" }), { g }, -1) end, "max_norm must be")
  local gone = nv.zeros(4); gone:free()
  T.raises(function() core.grad_norm_multi(nv.zeros(4, { dtype = "i64" }), { gone }, 1) end, "has been freed")
  T.raises(function() core.adamw_multi({ p }, { g }, { m }, { v }, { lr = 1 }) end, "adamw_multi")
end)

T.case("AdamW flags a non-finite parameter; grad_norm_multi takes the flags into its state when asked", function()
  local FLAGS = dofile("tests/nonfinite_flags.lua")
  FLAGS.optim_cases(function(t) return t end, "cpu")
  T.with(nv.use_reference, true, FLAGS.optim_cases, function(t) return t end, "reference")
end)
