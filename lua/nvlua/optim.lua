-- nvlua.optim: AdamW with parameter groups and global gradient-norm clipping.
--   local optim = require "nvlua.optim"
--   local opt = optim.AdamW(model:named_parameters(), {lr = 3e-4, betas = {0.9, 0.95}, weight_decay = 0.1})
--   optim.clip_grad_norm(model:named_parameters(), 1.0); opt:step(); model:zero_grad()
-- Parameters are fp32 master weights updated in place; the moments m, v are fp32 tensors of the
-- parameter's shape. The update is core.adamw_multi (core/optim.h: every tensor of a group in one
-- call, one kernel launch on a GPU, each element exactly as core.adamw_step: torch.optim.AdamW
-- semantics, decoupled weight decay, bias correction by the 1-based step). optim.ShardedAdamW is the
-- same update with its state split across data-parallel ranks (ZeRO-1).
-- Clipping without a host round trip: opt:clip_grad_norm(max_norm) computes the global norm on the
-- device (one launch) and the next opt:step() scales the grads by the clip factor on the fly; the
-- norm comes back to the host only when asked (norm:value()). optim.clip_grad_norm(params, max_norm)
-- is the eager form (returns the norm, scales the grads in place). Not here: learning-rate
-- schedules (the loop calls set_lr), the collectives themselves (nvlua.dist).
local nv = require "nvlua"
local core = require "nvlua.core"
local util = require "nvlua.util"
local check_opts, same_shape, shape_str = util.check_opts, util.same_shape, util.shape_str

local optim = {}

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

-- Checkers of option values (util.check_opts): nil for a good value, else what is wrong with it.
-- The values the update takes are finite: a NaN or infinite lr, eps or weight decay would turn
-- every parameter into NaN at the first step.
local function finite(v) return type(v) == "number" and v == v and v > -math.huge and v < math.huge end
local function is_nonneg(v) if not (finite(v) and v >= 0) then return "must be a finite number >= 0" end end
-- eps divides: 0 makes 0 / 0 of every element whose moments are still 0
local function is_pos(v) if not (finite(v) and v > 0) then return "must be a finite number > 0" end end
local function is_betas(v)
  if type(v) ~= "table" or #v ~= 2 or not (finite(v[1]) and v[1] >= 0 and v[1] < 1) or
     not (finite(v[2]) and v[2] >= 0 and v[2] < 1) then
    return "must be {beta1, beta2}, each a number in [0, 1)"
  end
end

local ADAMW_OPTS = {lr = is_nonneg, betas = is_betas, eps = is_pos, weight_decay = is_nonneg}
local GROUP_OPTS = {params = true, lr = is_nonneg, betas = is_betas, eps = is_pos, weight_decay = is_nonneg,
  name = true, lr_scale = is_nonneg}

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
  local groups, order -- order: every entry as given (the norm's summation order)
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
    order = all
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
  local self = setmetatable({groups = groups, t = 0, m = {}, v = {}, names = {}, entries = {}, norm_gen = 0}, AdamW)
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
      -- on the parameter's device; the optimizer's own, kept past any open nv.scope
      self.m[name] = nv.unscope(nv.zeros(e.param:size(), {device = e.param:device()}))
      self.v[name] = nv.unscope(nv.zeros(e.param:size(), {device = e.param:device()}))
      self.names[e] = name
      if not order then self.entries[#self.entries + 1] = e end
    end
  end
  if order then for i, e in ipairs(order) do self.entries[i] = e end end
  return self
end

--- opt:step(): one AdamW update of every parameter from its grad (the step count advances first):
-- one core.adamw_multi per group (one launch on a GPU). After opt:clip_grad_norm each grad is
-- scaled by the clip factor on the fly (the grads stay as they are).
function AdamW:step()
  self.t = self.t + 1
  local clip = self.clip_armed and self.norm_state or nil
  self.clip_armed = false
  for _, g in ipairs(self.groups) do
    local o = {lr = g.lr, beta1 = g.betas[1], beta2 = g.betas[2], eps = g.eps, weight_decay = g.weight_decay,
      step = self.t}
    local ps, gs, ms, vs = {}, {}, {}, {}
    for i, e in ipairs(g.params) do
      local name = self.names[e]
      ps[i], gs[i], ms[i], vs[i] = e.param, e.grad, self.m[name], self.v[name]
    end
    if #ps > 0 then core.adamw_multi(ps, gs, ms, vs, o, nil, clip) end
  end
end

-- The sum of squares and the non-finite flags a norm state holds (one copy to the host; slots:
-- core/backend.h NVL_NORM_*).
local function state_read(state)
  local t = state:cpu():totable()
  return (string.unpack("<d", string.pack("<i8", t[1]))), t[4]
end

local GradNorm = {}
GradNorm.__index = GradNorm
function GradNorm:_read(what)
  if self.opt.norm_gen ~= self.gen then
    error(what .. ": the optimizer has computed a newer norm since; read it before the next clip_grad_norm", 3)
  end
  if not self.v then
    local ss, flags = state_read(self.opt.norm_state)
    self.v, self.flags = math.sqrt(ss), flags
  end
end
function GradNorm:value()
  self:_read("norm:value()")
  return self.v
end
--- norm:nonfinite() -> flags: the non-finite flags the grads' device had when the norm was computed
-- (core.nonfinite_take's: 1 a quantizer read a NaN or an infinity, 2 AdamW a non-finite parameter;
-- 0 none), read with the norm in the same copy; the device's flags are cleared by clip_grad_norm.
function GradNorm:nonfinite()
  self:_read("norm:nonfinite()")
  return self.flags
end
GradNorm.__tostring = function(self) return "GradNorm(" .. tostring(self:value()) .. ")" end

--- opt:clip_grad_norm(max_norm) -> norm: the global L2 norm of every grad of this optimizer (in the
-- order the parameters were given: optim.grad_norm's value) computed on their device into the
-- optimizer's norm state, one launch, nothing read back; the next opt:step() then scales every grad
-- by max_norm / (norm + 1e-6) when norm > max_norm and finite (optim.clip_grad_norm's rule, rounded
-- as grad:mul_ rounds), without writing the grads. norm:value() reads the norm (one copy to the
-- host), until the next clip_grad_norm. A non-finite norm is not clipped: read it to skip a step.
-- max_norm checked: a finite number > 0 (a NaN would never clip, an infinite one never either)
local function check_max_norm(max_norm, fname)
  if not (finite(max_norm) and max_norm > 0) then
    util.user_error(string.format("%s: max_norm must be a finite number > 0, got %s", fname, tostring(max_norm)), 3)
  end
end

function AdamW:clip_grad_norm(max_norm)
  check_max_norm(max_norm, "clip_grad_norm")
  local gs = {}
  for i, e in ipairs(self.entries) do gs[i] = e.grad end
  local dev = gs[1] and gs[1]:device() or "cpu"
  if not self.norm_state or self.norm_state:device() ~= dev then
    self.norm_state = nv.unscope(nv.zeros(4, {dtype = "i64", device = dev}))
  end
  core.grad_norm_multi(self.norm_state, gs, max_norm, true) -- and takes the device's non-finite flags
  self.clip_armed, self.norm_gen = true, self.norm_gen + 1
  return setmetatable({opt = self, gen = self.norm_gen}, GradNorm)
end

--- opt:zero_grad(): every grad = 0
function AdamW:zero_grad()
  for _, g in ipairs(self.groups) do
    for _, e in ipairs(g.params) do e.grad:zero_() end
  end
end

--- opt:set_lr(lr): every group's lr = lr * its lr_scale
function AdamW:set_lr(lr)
  if not (finite(lr) and lr >= 0) then
    util.user_error("set_lr: lr must be a finite number >= 0, got " .. tostring(lr), 2)
  end
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

-- ---- ZeRO-1 -------------------------------------------------------------------------------------

local ShardedAdamW = {}
ShardedAdamW.__index = ShardedAdamW

local function mib(bytes) return bytes / (1024 * 1024) end

--- optim.ShardedAdamW(model, {lr, betas, eps, weight_decay}, dist) -> ZeRO-1 AdamW
-- model: an nn module with one flat gradient buffer (model.grad_buffer, as llama.Llama has); dist:
-- require "nvlua.dist" after init. The flat parameter space (every parameter, in
-- named_parameters order, the grad buffer's order) is padded to a multiple of the world size and
-- cut into world equal shards; rank r owns shard r and keeps AdamW's m and v for it only, so
-- optimizer memory per rank is 1/world of AdamW's. To make the all-gather one call, the
-- parameters are moved into one flat f32 buffer here (each parameter becomes a view of it, as
-- each gradient already is of grad_buffer); the model computes with them as before.
-- Per step: opt:reduce_clip(max_norm) reduce-scatters (avg) the gradients into this rank's shard
-- and clips by the global norm (-> the norm, before clipping); opt:step() updates the shard (the
-- decay / no_decay groups as optim.AdamW splits them) and all-gathers the parameters.
-- opt:state() is a collective (the moments are gathered; every rank calls it) and returns
-- AdamW's layout, {step, m = {name = tensor}, v = {...}}, so a checkpoint is the same as an
-- unsharded run's and either can resume the other; opt:load_state takes that layout too.
function optim.ShardedAdamW(model, opts, dist)
  opts = check_opts(opts, ADAMW_OPTS, "ShardedAdamW")
  if type(model) ~= "table" or not nv.is_tensor(model.grad_buffer) then
    error("ShardedAdamW: expects a model with one flat gradient buffer (model.grad_buffer)", 2)
  end
  if type(dist) ~= "table" or type(dist.reduce_scatter) ~= "function" then
    error("ShardedAdamW: expects the nvlua.dist module as its third argument", 2)
  end
  local betas = opts.betas or {0.9, 0.95}
  local self = setmetatable({t = 0, dist = dist, sharded = true, lr = opts.lr or 1e-3, beta1 = betas[1],
    beta2 = betas[2], eps = opts.eps or 1e-8, weight_decay = opts.weight_decay or 0.1}, ShardedAdamW)
  local world, rank = dist.world_size(), dist.rank()
  -- the parameter entries (the tables modules hold), in named_parameters order
  local named, entries, seen = model:named_parameters(), {}, {}
  for _, m in ipairs(model:modules()) do
    for _, e in ipairs(m._params) do
      if not seen[e.param] then seen[e.param] = true; entries[#entries + 1] = e end
    end
  end
  local n = 0
  for i, e in ipairs(entries) do
    if named[i].param ~= e.param or e.param:dtype() ~= "f32" then
      error("ShardedAdamW: the model's parameters are not its named_parameters() in order, or not f32", 2)
    end
    n = n + e.param:numel()
  end
  if model.grad_buffer:numel() ~= n then
    error(string.format("ShardedAdamW: grad_buffer has %d elements for %d parameter elements", model.grad_buffer:numel(), n), 2)
  end
  local shard = (n + world - 1) // world
  local npad = shard * world
  -- everything lives on the gradients' device (cuda: the collectives go through NCCL)
  local dev = model.grad_buffer:device()
  self.n, self.shard, self.npad, self.world, self.rank, self.device = n, shard, npad, world, rank, dev
  -- parameters -> views of one flat buffer; gradients -> views of one padded to npad
  local flat = nv.zeros(npad, {device = dev})
  local gflat = npad == n and model.grad_buffer or nv.zeros(npad, {device = dev})
  local layout, off = {}, 0
  for i, e in ipairs(entries) do
    local k, shape = e.param:numel(), e.param:size()
    local pv = flat:narrow(1, off + 1, k):view(shape)
    pv:copy_(e.param)
    e.param:free()
    e.param = nv.unscope(pv)
    if gflat ~= model.grad_buffer then
      local gv = gflat:narrow(1, off + 1, k):view(shape)
      gv:copy_(e.grad)
      e.grad:free() -- its share of the old buffer now, not when the collector finds the handle
      e.grad = nv.unscope(gv) -- the old buffer itself the model drops below
    end
    layout[i] = {name = named[i].name, offset = off, numel = k, shape = shape, no_decay = e.no_decay}
    off = off + k
  end
  if gflat ~= model.grad_buffer then
    model.grad_buffer:free()
    model.grad_buffer = nv.unscope(gflat:narrow(1, 1, n))
  end
  self.flat, self.gflat, self.layout = flat, gflat, layout
  -- this rank's shard [lo, hi) of the flat space: parameter view, gradient, moments
  local lo, hi = rank * shard, (rank + 1) * shard
  self.p = flat:narrow(1, lo + 1, shard)
  self.g, self.m, self.v = nv.zeros(shard, {device = dev}), nv.zeros(shard, {device = dev}), nv.zeros(shard, {device = dev})
  -- the pieces of parameters that fall in the shard, each with its group's weight decay
  self.segments = {}
  for _, l in ipairs(layout) do
    local a, b = math.max(lo, l.offset), math.min(hi, l.offset + l.numel)
    if a < b then
      local s0, len = a - lo, b - a
      self.segments[#self.segments + 1] = {name = l.name, from = a - l.offset, len = len, no_decay = l.no_decay,
        p = self.p:narrow(1, s0 + 1, len), g = self.g:narrow(1, s0 + 1, len), m = self.m:narrow(1, s0 + 1, len),
        v = self.v:narrow(1, s0 + 1, len)}
      nv.unscope(self.segments[#self.segments])
    end
  end
  -- the optimizer's own, kept past any open nv.scope
  nv.unscope(flat, gflat, self.p, self.g, self.m, self.v)
  return self
end

--- opt:memory() -> {state = bytes of m and v on this rank, unsharded = AdamW's, grad_shard = bytes}
function ShardedAdamW:memory()
  return {state = 2 * 4 * self.shard, unsharded = 2 * 4 * self.n, grad_shard = 4 * self.shard}
end

--- opt:describe() -> a line for the log
function ShardedAdamW:describe()
  local mem = self:memory()
  return string.format("ZeRO-1: AdamW state %.2f MiB per rank (m, v of %d of %d elements; unsharded %.2f MiB, world %d)",
    mib(mem.state), self.shard, self.n, mib(mem.unsharded), self.world)
end

--- opt:reduce_clip(max_norm) -> global gradient norm before clipping: reduce-scatter (avg) the
-- model's gradients into this rank's shard, then scale the shard by max_norm / (norm + 1e-6)
-- when the norm exceeds max_norm (optim.clip_grad_norm's rule; a non-finite norm leaves it).
function ShardedAdamW:reduce_clip(max_norm)
  if max_norm ~= nil then check_max_norm(max_norm, "reduce_clip") end
  self.dist.reduce_scatter(self.g, self.gflat, "avg")
  local total = math.sqrt(self.dist.all_reduce_number(core.sumsq(self.g), "sum"))
  if max_norm and total > max_norm and total < math.huge then self.g:mul_(max_norm / (total + 1e-6)) end
  return total
end

--- opt:step(): AdamW on this rank's shard, then every rank gets every shard (all-gather in place)
-- (one core.adamw_multi over every segment, the no_decay ones with weight decay 0)
function ShardedAdamW:step()
  self.t = self.t + 1
  local ps, gs, ms, vs, nd = {}, {}, {}, {}, {}
  for i, sg in ipairs(self.segments) do ps[i], gs[i], ms[i], vs[i], nd[i] = sg.p, sg.g, sg.m, sg.v, sg.no_decay end
  if #ps > 0 then
    core.adamw_multi(ps, gs, ms, vs, {lr = self.lr, beta1 = self.beta1, beta2 = self.beta2, eps = self.eps,
      weight_decay = self.weight_decay, step = self.t}, nd)
  end
  self.dist.all_gather(self.flat, self.p)
end

function ShardedAdamW:zero_grad() self.gflat:zero_() end

function ShardedAdamW:set_lr(lr)
  if not (finite(lr) and lr >= 0) then
    util.user_error("set_lr: lr must be a finite number >= 0, got " .. tostring(lr), 2)
  end
  self.lr = lr
end

function ShardedAdamW:get_lr() return self.lr end

-- full (npad) gathered copy of a shard tensor -> {name = view of it, shaped like the parameter}
function ShardedAdamW:_gather(shard)
  local full = nv.zeros(self.npad, {device = self.device})
  self.dist.all_gather(full, shard)
  local out = {}
  for _, l in ipairs(self.layout) do out[l.name] = full:narrow(1, l.offset + 1, l.numel):view(l.shape) end
  return out
end

--- opt:state() -> {step, m = {name = tensor}, v = {...}}: a collective (every rank calls it);
-- new tensors holding the gathered moments, in optim.AdamW's layout
function ShardedAdamW:state()
  return {step = self.t, m = self:_gather(self.m), v = self:_gather(self.v)}
end

--- opt:load_state(s): s in optim.AdamW's layout (full moments); this rank keeps its shard
function ShardedAdamW:load_state(s)
  if type(s) ~= "table" or math.type(s.step) ~= "integer" or type(s.m) ~= "table" or type(s.v) ~= "table" then
    error("load_state: expected {step = integer, m = {name = tensor}, v = {name = tensor}}", 2)
  end
  local problems = {}
  for _, l in ipairs(self.layout) do
    for _, which in ipairs({"m", "v"}) do
      local x = s[which][l.name]
      if not nv.is_tensor(x) then problems[#problems + 1] = which .. " missing: " .. l.name
      elseif x:numel() ~= l.numel then problems[#problems + 1] = string.format("%s shape mismatch: %s", which, l.name) end
    end
  end
  if #problems > 0 then error("load_state: " .. table.concat(problems, "; "), 2) end
  for _, sg in ipairs(self.segments) do
    sg.m:copy_(s.m[sg.name]:reshape(-1):narrow(1, sg.from + 1, sg.len))
    sg.v:copy_(s.v[sg.name]:reshape(-1):narrow(1, sg.from + 1, sg.len))
  end
  self.t = s.step
end

-- ---- clipping -----------------------------------------------------------------------------------

--- optim.grad_norm(params) -> the global L2 norm of all grads (fp64 sums of squares): the sum of
-- core.sumsq of each grad, in order. Contiguous f32 grads on one device: one core.grad_norm_multi
-- (one launch on a GPU, the same sum on the CPU) and one copy to the host.
function optim.grad_norm(params)
  local entries = entries_of(params, "grad_norm")
  local gs, multi = {}, #entries > 0
  for i, e in ipairs(entries) do
    gs[i] = e.grad
    multi = multi and e.grad:dtype() == "f32" and e.grad:is_contiguous() and e.grad:device() == gs[1]:device()
  end
  if multi then
    local state = nv.zeros(4, {dtype = "i64", device = gs[1]:device()})
    core.grad_norm_multi(state, gs, 1.0)
    local ss = state_read(state) -- (the device's non-finite flags stay for the training step)
    state:free()
    return math.sqrt(ss)
  end
  local ss = 0.0
  for _, e in ipairs(entries) do ss = ss + core.sumsq(e.grad) end
  return math.sqrt(ss)
end

--- optim.clip_grad_norm(params, max_norm) -> total norm (before clipping)
-- If the global L2 norm of all grads exceeds max_norm, every grad is scaled by
-- max_norm / (norm + 1e-6) (torch.nn.utils.clip_grad_norm_). A non-finite norm leaves the grads
-- untouched; the caller sees it in the return value and decides (skip the step).
function optim.clip_grad_norm(params, max_norm)
  check_max_norm(max_norm, "clip_grad_norm")
  local entries = entries_of(params, "clip_grad_norm")
  local total = optim.grad_norm(entries)
  if total > max_norm and total < math.huge then
    local c = max_norm / (total + 1e-6)
    for _, e in ipairs(entries) do e.grad:mul_(c) end
  end
  return total
end

return optim
