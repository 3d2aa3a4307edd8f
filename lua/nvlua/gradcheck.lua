-- nvlua.gradcheck: compare analytic gradients with central finite differences of an f32 forward.
--   local gradcheck = require "nvlua.gradcheck"
--   gradcheck(nn.RMSNorm(8), {x})                           -- a module: input and parameter grads
--   gradcheck(loss_fn, {ids, targets}, {params = model:named_parameters()})   -- a scalar loss
-- Returns a report table; raises an error listing the worst mismatches if any element fails.
-- Not here: double-precision forwards (the layers are f32), Jacobians of non-scalar outputs
-- beyond one random projection, second derivatives.
--
-- What is checked:
--   * target with forward/backward (an nn.Module or any table with those methods): the scalar
--     L = sum(forward(inputs...) * R) for a fixed random R of the output's shape; the analytic
--     gradients are backward(R) (its k-th result is the gradient of the k-th input) and the
--     parameter gradients the module accumulated (target:named_parameters() or opts.params).
--     Every f32 tensor input is checked, unless opts.inputs == false.
--   * target a function f(inputs...) -> loss that accumulates gradients into opts.params
--     (e.g. model:forward_backward): parameters only; opts.eval(inputs...) -> loss, when given,
--     is used for the finite differences (no backward).
-- Tolerance (why these numbers). f32's unit roundoff is u = 2^-24 ~ 6e-8. An f32 evaluation of
-- the objective carries a rounding error of the order of u*F, where F is the sum of the
-- magnitudes of its terms (F = sum|out*R| for a module, |loss| + 1 for a loss): every term is
-- rounded a few times, but the errors are independent and mostly cancel (measured on a Block and
-- on the tiny Llama: 0.1 to 0.5 u*F). The central difference (f(x+h) - f(x-h)) / 2h turns that
-- into an error of about u*F/h: atol = k*u*F/h with k = 2, 4x or more above what we measured.
-- The step h = 3e-2 * rms(tensor) balances that noise against the truncation error
-- h^2/6 * f''' (h = 1e-2 is noise-bound, 1e-1 truncation-bound); rtol = 1e-2 covers the
-- truncation. A real bug (a wrong factor, index, sign or a missing term) shows as a relative
-- error of O(1), or of a few % for a slightly wrong constant, far above both. An element passes
-- if |num - ana| <= atol + rtol*|ana|; h is the actual f32 difference of the perturbed values.
local nv = require "nvlua"
local util = require "nvlua.util"

local U = 2.0 ^ -24 -- f32 unit roundoff

local DEFAULTS = {eps = 3e-2, rtol = 1e-2, k = 2, max_per_tensor = 24, seed = 1}
local VALID = {eps = true, rtol = true, atol = true, k = true, max_per_tensor = true, seed = true, params = true,
  inputs = true, eval = true, names = true, verbose = true}

local function shape_str(t) return "[" .. table.concat(t:size(), ",") .. "]" end

-- 0-based linear index -> 1-based multi-index for shape
local function unravel(i, shape)
  local idx = {}
  for d = #shape, 1, -1 do
    idx[d] = i % shape[d] + 1
    i = i // shape[d]
  end
  return idx
end

-- indices to check in a tensor of n elements: all if few, else the largest analytic gradient
-- plus a deterministic spread (an LCG over [0, n))
local function pick(n, max, grad_abs_argmax, seed)
  local out = {}
  if n <= max then
    for i = 0, n - 1 do out[#out + 1] = i end
    return out
  end
  local seen = {}
  local function add(i) if not seen[i] then seen[i] = true; out[#out + 1] = i end end
  add(grad_abs_argmax)
  local s = seed * 2654435761 % 4294967296
  while #out < max do
    s = (s * 1664525 + 1013904223) % 4294967296
    add(s % n)
  end
  return out
end

local function argmax_abs(t)
  local flat = t:contiguous():reshape(t:numel())
  local _, idx = flat:abs():max(1)
  return idx:item()
end

local function rms(t)
  local n = t:numel()
  if n == 0 then return 1 end
  local s = math.sqrt((t * t):sum() / n)
  return s > 0 and s or 1
end

--- gradcheck(target, inputs, opts) -> report {checked, max_abs_err, worst, tensors = {...}, F}
-- worst = the largest |num - ana| / tol seen (a pass is <= 1); per tensor the same in tensors[i].
-- opts: eps (step relative to the tensor's rms, 3e-2), rtol (1e-2), atol (a fixed atol instead of
-- the roundoff estimate), k (the roundoff estimate's factor, 2), max_per_tensor (elements checked
-- per tensor, 24), seed, params (named parameters to check), inputs (false: skip input
-- gradients), eval (function target: loss without gradients), names (names of the inputs, for
-- messages), verbose.
-- The analytic side: runs forward and backward once and returns the tensors to check
-- ({name, t, g = a copy of the analytic gradient}), the error scale F, the objective the finite
-- differences evaluate, and R (module targets: the random output weights, owned by the caller).
-- Errors name the caller of gradcheck (level 3).
local function analytic(target, inputs, opts, params, is_fn, set_mode)
  local nin = #inputs
  for _, p in ipairs(params) do p.grad:zero_() end
  local checks = {}
  local F, objective, R
  if is_fn then
    local loss = target(table.unpack(inputs, 1, nin))
    F = math.abs(loss) + 1
    local eval = opts.eval or target
    objective = function() return eval(table.unpack(inputs, 1, nin)) end
  else
    set_mode(true)
    local out = target:forward(table.unpack(inputs, 1, nin))
    R = nv.randn(out:size(), {generator = nv.Generator(opts.seed)})
    F = nv.scope(function() return (out * R):abs():sum() end)
    if F == 0 then F = 1 end
    out:free()
    local grads = table.pack(target:backward(R))
    set_mode(false)
    objective = function()
      return nv.scope(function() return (target:forward(table.unpack(inputs, 1, nin)) * R):sum() end)
    end
    if opts.inputs ~= false then
      for i = 1, nin do
        local x = inputs[i]
        if nv.is_tensor(x) and x:dtype() == "f32" then
          local g = grads[i]
          local name = opts.names and opts.names[i] or ("input #" .. i)
          if not nv.is_tensor(g) then
            error("gradcheck: backward returned no gradient for " .. name .. " (pass inputs = false to skip inputs)", 3)
          end
          if table.concat(g:size(), ",") ~= table.concat(x:size(), ",") then
            error(string.format("gradcheck: gradient of %s is %s, the input is %s", name, shape_str(g), shape_str(x)), 3)
          end
          checks[#checks + 1] = {name = name, t = x, g = g:clone()}
        end
      end
    end
    for i = 1, grads.n do if nv.is_tensor(grads[i]) then grads[i]:free() end end
  end
  for _, p in ipairs(params) do checks[#checks + 1] = {name = p.name or "param", t = p.param, g = p.grad:clone()} end
  return checks, F, objective, R
end

-- The finite differences of one tensor c against its analytic gradient: a report row, and the
-- failing elements appended to failures.
local function check_tensor(c, objective, F, opts, failures)
  local t, g = c.t, c.g
  local shape = t:size()
  local h0 = opts.eps * rms(t)
  local rep = {name = c.name, checked = 0, max_abs_err = 0, worst = 0, max_atol = 0, max_grad = 0}
  for _, i in ipairs(pick(t:numel(), opts.max_per_tensor, argmax_abs(g) - 1, opts.seed)) do
    local idx = unravel(i, shape)
    local x0 = t:get(table.unpack(idx))
    idx[#idx + 1] = x0 + h0
    t:set(table.unpack(idx))
    local xp = t:get(table.unpack(idx, 1, #shape))
    local fp = objective()
    idx[#idx] = x0 - h0
    t:set(table.unpack(idx))
    local xm = t:get(table.unpack(idx, 1, #shape))
    local fm = objective()
    idx[#idx] = x0
    t:set(table.unpack(idx)) -- exact restore: x0 was read from the f32 tensor
    local num = (fp - fm) / (xp - xm)
    local ana = g:get(table.unpack(idx, 1, #shape))
    local atol = opts.atol or opts.k * U * F / ((xp - xm) / 2)
    local diff = math.abs(num - ana)
    local tol = atol + opts.rtol * math.abs(ana)
    rep.checked = rep.checked + 1
    rep.max_abs_err = math.max(rep.max_abs_err, diff)
    rep.worst = math.max(rep.worst, diff / tol)
    rep.max_atol = math.max(rep.max_atol, atol)
    rep.max_grad = math.max(rep.max_grad, math.abs(ana))
    if not (diff <= tol) then
      failures[#failures + 1] = {name = c.name, idx = {table.unpack(idx, 1, #shape)}, ana = ana, num = num,
        diff = diff, tol = tol}
    end
  end
  if opts.verbose then
    print(string.format("gradcheck %-45s %3d checked, max |grad| %.3g, max |diff| %.3g, atol %.3g, worst diff/tol %.3g",
      c.name, rep.checked, rep.max_grad, rep.max_abs_err, rep.max_atol, rep.worst))
  end
  return rep
end

-- The error message for failures (the ten worst first).
local function failure_message(failures, checked, opts, F)
  table.sort(failures, function(a, b) return a.diff / a.tol > b.diff / b.tol end)
  local lines = {string.format("gradcheck: %d of %d elements differ (rtol %g; F = %.4g):", #failures, checked,
    opts.rtol, F)}
  for i = 1, math.min(#failures, 10) do
    local f = failures[i]
    lines[#lines + 1] = string.format("  %s[%s]: analytic %.7g, numeric %.7g, |diff| %.3g > tol %.3g", f.name,
      table.concat(f.idx, ","), f.ana, f.num, f.diff, f.tol)
  end
  return table.concat(lines, "\n")
end

local function gradcheck(target, inputs, opts)
  opts = util.check_opts(opts, VALID, "gradcheck")
  for k, v in pairs(DEFAULTS) do if opts[k] == nil then opts[k] = v end end
  inputs = inputs or {}
  local is_fn = type(target) == "function"
  if not is_fn and not (type(target) == "table" and type(target.forward) == "function" and
    type(target.backward) == "function") then
    error("gradcheck: target must be a function or have forward and backward methods", 2)
  end
  local params = opts.params
  if not params and not is_fn and type(target.named_parameters) == "function" then params = target:named_parameters() end
  params = params or {}
  if is_fn and #params == 0 then error("gradcheck: a function target needs opts.params", 2) end
  local function set_mode(train)
    if not is_fn and type(target.train) == "function" then target:train(train) end
  end
  local was_training = is_fn or target.training ~= false

  local checks, F, objective, R = analytic(target, inputs, opts, params, is_fn, set_mode)
  local report = {checked = 0, max_abs_err = 0, worst = 0, tensors = {}, F = F}
  local failures = {}
  local ok, err = pcall(function()
    for _, c in ipairs(checks) do
      local rep = check_tensor(c, objective, F, opts, failures)
      report.checked = report.checked + rep.checked
      report.max_abs_err = math.max(report.max_abs_err, rep.max_abs_err)
      report.worst = math.max(report.worst, rep.worst)
      report.tensors[#report.tensors + 1] = rep
    end
  end)
  for _, c in ipairs(checks) do c.g:free() end
  if R then R:free() end
  set_mode(was_training)
  if not ok then error(err, 0) end
  report.failures = failures
  if #failures > 0 then error(failure_message(failures, report.checked, opts, F), 2) end
  return report
end

return gradcheck
