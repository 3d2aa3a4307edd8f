-- nvlua.optim: AdamW with parameter groups and global gradient-norm clipping.
--   local optim = require "nvlua.optim"
--   local opt = optim.AdamW(model:named_parameters(), {lr = 3e-4, betas = {0.9, 0.95}, weight_decay = 0.1})
--   optim.clip_grad_norm(model:named_parameters(), 1.0); opt:step(); model:zero_grad()
-- Parameters are fp32 master weights updated in place; the moments m, v are fp32 tensors of the
-- parameter's shape. The update is core.adamw_step (core/layers.h: torch.optim.AdamW semantics,
-- decoupled weight decay, bias correction by the 1-based step). Not here: learning-rate schedules
-- (the loop calls set_lr), sharded optimizer state (later, with data parallelism).
local nv = require "nvlua"
local core = require "nvlua.core"

local optim = {}

local function check_opts(opts, valid, fname)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(fname .. ": options must be a table, got " .. type(opts), 3) end
  for k in pairs(opts) do
    if not valid[k] then
      local names = {}
      for n in pairs(valid) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (valid: %s)", fname, tostring(k), table.concat(names, ", ")), 3)
    end
  end
  return opts
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

local function shape_str(t) return "[" .. table.concat(t:size(), ",") .. "]" end

-- A list of parameters: an nn.Module (its named_parameters()) or an array of entries
-- {name =, param =, grad =, no_decay =}.
local function entries_of(x, fname)
  if type(x) == "table" and type(x.named_parameters) == "function" then return x:named_parameters() end
  if type(x) ~= "table" then error(fname .. ": expected named parameters (an array of {name, param, grad}), got " ..
    type(x), 3) end
  for i, e in ipairs(x) do
    if type(e) ~= "table" or not nv.is_tensor(e.param) or not nv.is_tensor(e.grad) then
      error(string.format("%s: entry #%d is not {name =, param = tensor, grad = tensor}", fname, i), 3)
    end
  end
  return x
end

-- ---- AdamW --------------------------------------------------------------------------------------

local AdamW = {}
AdamW.__index = AdamW

local ADAMW_OPTS = {lr = true, betas = true, eps = true, weight_decay = true}
local GROUP_OPTS = {params = true, lr = true, betas = true, eps = true, weight_decay = true, name = true,
  lr_scale = true}

--- optim.AdamW(params, {lr = 1e-3, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1})
-- params: named parameters (entries {name, param, grad, no_decay}, or a module), split into two
-- groups "decay" and "no_decay" (weight_decay 0: the entries marked no_decay, i.e. norms and
-- embeddings); or an array of groups {params = entries, lr =, betas =, eps =, weight_decay =,
-- lr_scale =} whose unset fields come from the defaults. set_lr(lr) sets every group's lr to
-- lr * (its lr_scale or 1).
function optim.AdamW(params, opts)
  opts = check_opts(opts, ADAMW_OPTS, "AdamW")
  local defaults = {lr = opts.lr or 1e-3, betas = opts.betas or {0.9, 0.95}, eps = opts.eps or 1e-8,
    weight_decay = opts.weight_decay or 0.1}
  if type(defaults.betas) ~= "table" or #defaults.betas ~= 2 then error("AdamW: betas must be {beta1, beta2}", 2) end
  local groups
  if type(params) == "table" and type(params[1]) == "table" and params[1].params ~= nil then
    groups = {}
    for i, g in ipairs(params) do
      check_opts(g, GROUP_OPTS, "AdamW group #" .. i)
      groups[i] = {name = g.name or ("group" .. i), params = entries_of(g.params, "AdamW"), lr = g.lr or defaults.lr,
        betas = g.betas or defaults.betas, eps = g.eps or defaults.eps,
        weight_decay = g.weight_decay or defaults.weight_decay, lr_scale = g.lr_scale or 1}
    end
  else
    local all = entries_of(params, "AdamW")
    local decay, no_decay = {}, {}
    for _, e in ipairs(all) do
      if e.no_decay then no_decay[#no_decay + 1] = e else decay[#decay + 1] = e end
    end
    groups = {
      {name = "decay", params = decay, lr = defaults.lr, betas = defaults.betas, eps = defaults.eps,
        weight_decay = defaults.weight_decay, lr_scale = 1},
      {name = "no_decay", params = no_decay, lr = defaults.lr, betas = defaults.betas, eps = defaults.eps,
        weight_decay = 0, lr_scale = 1},
    }
  end
  local self = setmetatable({groups = groups, t = 0, m = {}, v = {}, names = {}}, AdamW)
  local seen = {}
  for _, g in ipairs(groups) do
    for i, e in ipairs(g.params) do
      if e.param:dtype() ~= "f32" or e.grad:dtype() ~= "f32" then
        error("AdamW: parameter '" .. tostring(e.name) .. "' and its grad must be f32", 2)
      end
      if seen[e.param] then error("AdamW: parameter '" .. tostring(e.name) .. "' is in more than one group", 2) end
      seen[e.param] = true
      local name = e.name or (g.name .. "." .. i)
      if self.m[name] then error("AdamW: two parameters are named '" .. name .. "'", 2) end
      self.m[name] = nv.zeros(e.param:size())
      self.v[name] = nv.zeros(e.param:size())
      self.names[e] = name
    end
  end
  return self
end

--- opt:step(): one AdamW update of every parameter from its grad (the step count advances first)
function AdamW:step()
  self.t = self.t + 1
  for _, g in ipairs(self.groups) do
    local o = {lr = g.lr, beta1 = g.betas[1], beta2 = g.betas[2], eps = g.eps, weight_decay = g.weight_decay,
      step = self.t}
    for _, e in ipairs(g.params) do
      local name = self.names[e]
      core.adamw_step(e.param, e.grad, self.m[name], self.v[name], o)
    end
  end
end

--- opt:zero_grad(): every grad = 0
function AdamW:zero_grad()
  for _, g in ipairs(self.groups) do
    for _, e in ipairs(g.params) do e.grad:zero_() end
  end
end

--- opt:set_lr(lr): every group's lr = lr * its lr_scale
function AdamW:set_lr(lr)
  if type(lr) ~= "number" or lr < 0 then error("set_lr: lr must be a non-negative number", 2) end
  for _, g in ipairs(self.groups) do g.lr = lr * g.lr_scale end
end

--- opt:get_lr() -> the first group's lr
function AdamW:get_lr() return self.groups[1].lr end

--- opt:state() -> {step = n, m = {name = tensor}, v = {name = tensor}}: the live moment tensors
-- (a checkpoint writer saves them; load_state copies back)
function AdamW:state()
  return {step = self.t, m = self.m, v = self.v}
end

--- opt:load_state(s): s as state() returns it; every name and shape must match
function AdamW:load_state(s)
  if type(s) ~= "table" or math.type(s.step) ~= "integer" or type(s.m) ~= "table" or type(s.v) ~= "table" then
    error("load_state: expected {step = integer, m = {name = tensor}, v = {name = tensor}}", 2)
  end
  local problems = {}
  for _, which in ipairs({"m", "v"}) do
    local src, dst = s[which], self[which]
    local missing, unexpected, shape = {}, {}, {}
    for name, t in pairs(dst) do
      local x = src[name]
      if x == nil then missing[#missing + 1] = name
      elseif not nv.is_tensor(x) or not same_shape(x:size(), t:size()) then
        shape[#shape + 1] = string.format("%s: expected %s, got %s", name, shape_str(t),
          nv.is_tensor(x) and shape_str(x) or type(x))
      end
    end
    for name in pairs(src) do if dst[name] == nil then unexpected[#unexpected + 1] = tostring(name) end end
    table.sort(missing); table.sort(unexpected); table.sort(shape)
    if #missing > 0 then problems[#problems + 1] = which .. " missing: " .. table.concat(missing, ", ") end
    if #unexpected > 0 then problems[#problems + 1] = which .. " unexpected: " .. table.concat(unexpected, ", ") end
    if #shape > 0 then problems[#problems + 1] = which .. " shape mismatch: " .. table.concat(shape, "; ") end
  end
  if #problems > 0 then error("load_state: " .. table.concat(problems, "; "), 2) end
  for name, t in pairs(self.m) do t:copy_(s.m[name]) end
  for name, t in pairs(self.v) do t:copy_(s.v[name]) end
  self.t = s.step
end

-- ---- clipping -----------------------------------------------------------------------------------

--- optim.grad_norm(params) -> the global L2 norm of all grads (fp64 sums of squares)
function optim.grad_norm(params)
  local ss = 0.0
  for _, e in ipairs(entries_of(params, "grad_norm")) do ss = ss + core.sumsq(e.grad) end
  return math.sqrt(ss)
end

--- optim.clip_grad_norm(params, max_norm) -> total norm (before clipping)
-- If the global L2 norm of all grads exceeds max_norm, every grad is scaled by
-- max_norm / (norm + 1e-6) (torch.nn.utils.clip_grad_norm_). A non-finite norm leaves the grads
-- untouched; the caller sees it in the return value and decides (skip the step).
function optim.clip_grad_norm(params, max_norm)
  if type(max_norm) ~= "number" or max_norm <= 0 then error("clip_grad_norm: max_norm must be a positive number", 2) end
  local entries = entries_of(params, "clip_grad_norm")
  local total = optim.grad_norm(entries)
  if total > max_norm and total < math.huge then
    local c = max_norm / (total + 1e-6)
    for _, e in ipairs(entries) do e.grad:mul_(c) end
  end
  return total
end

return optim
