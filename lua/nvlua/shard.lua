-- nvlua.shard: sharded data parallelism beyond ZeRO-1: shard = "grads" (ZeRO-2) and "full"
-- (ZeRO-3 / FSDP) for an nn.Llama, as one object that is both the run's optimizer and the keeper of
-- the model's parameter shards.   local shard = require "nvlua.shard"
--   local opt = shard.Sharded(model, {lr =, betas =, eps =, weight_decay =}, dist, {mode = "full"})
-- (train.build makes it for shard=grads|full; opt:reduce_clip, opt:step, model:zero_grad as ZeRO-1's).
--
-- The rule (shard.shard_rows): every parameter is cut along its first dim (rows) into `world`
-- contiguous row ranges; each range is `chunk` rows, chunk = ceil(ceil(rows / world) / align) * align
-- (align: 16 for 2-D weights, nvfp4's 16x16 blocks; 1 for 1-D norm weights), except that the last
-- ranks get what is left (fewer rows, or none). Rank r holds rows [r·chunk, min(rows, (r+1)·chunk)),
-- in a tensor of `chunk` rows whose rows past the parameter's end are zeros ("padding": zero
-- weights, zero gradients, zero moments, which AdamW leaves at zero). So the ranks' shards are equal
-- in size and one all-gather of them into a (world·chunk, ...) buffer holds the whole parameter,
-- contiguous, in its first `rows` rows; one reduce-scatter of a (world·chunk, ...) gradient gives each
-- rank its rows, summed over the ranks. A world larger than a parameter's rows is refused.
--
-- Units: the embedding; each block; the final norm with the LM head ("head"). A unit's gradients
-- exist whole only while its backward runs: its backward is wrapped (on the module instance) so that
-- the full-size gradients are allocated first and, once the backward is done, reduce-scattered (avg)
-- into this rank's gradient shard and freed ("grads" and "full"). Under "full" the unit's forward is
-- wrapped too: its weights are all-gathered (f32, what the forward reads: the numerics are an
-- unsharded run's) just before and freed after (reshard_after_forward, the default; false keeps
-- them to the backward), all-gathered again before its backward, and freed after it. The LM head's
-- weights stay gathered from the final norm's forward to its backward (the chunked loss runs in
-- between). Under "grads" every rank keeps whole weights (4 bytes a parameter) and the update's
-- all-gather refills them.
-- Per step: grad_accum micro-batches, each reduce-scattering as its backward completes a unit (the
-- first straight into the shard, later ones added to it: with grad_accum > 1 the sum order is that
-- of the micro-batches' averages, an fp32 reordering against plain data parallelism, which averages
-- once); opt:reduce_clip(max_norm) -> global norm (sqrt of the all-reduced sum of the shards'
-- squares, fp64) and clip; opt:step() AdamW on the shards (core.adamw_multi, the decay / no_decay
-- split of optim.AdamW) and, under "grads", the all-gather of the updated weights.
--
-- Checkpoints keep the one format (nvlua.checkpoint): rank 0 writes model.safetensors and
-- trainer.safetensors as an unsharded run does; each tensor is a source (st.source) that gathers it
-- as it is written and is freed after, one at a time, while every other rank runs the same
-- collectives in the same order (opt:serve_checkpoint()). Loading takes the full tensors of any
-- checkpoint and keeps this rank's rows, so any checkpoint resumes at any world size and shard mode.
--
-- Not here: a prefetching (nonblocking) gather — the gathers are blocking MPI_Allgather / NCCL
-- calls; the quantized gather of a linear's weight (gather_weight is the one place it plugs in);
-- tied embeddings (refused); building the model directly in shards (train.build builds it whole,
-- then shards it and frees the rest).
local nv = require "nvlua"
local core = require "nvlua.core"
local util = require "nvlua.util"
local nn = require "nvlua.nn"
local check_opts, same_shape, shape_str = util.check_opts, util.same_shape, util.shape_str

local shard = {}

--- shard.MODES: the values of the train key shard
shard.MODES = {"none", "optimizer", "grads", "full"}

--- shard.ALIGN_2D: the row alignment of a 2-D parameter's shards (nvfp4's 16x16 blocks)
shard.ALIGN_2D = 16

--- shard.shard_rows(rows, world, align) -> {{row0 =, rows =}, ...} per rank (index rank + 1; row0
-- 0-based), chunk: contiguous row ranges of `chunk` rows (a multiple of align), the last ranks'
-- shorter or empty; nil, msg when world > rows.
function shard.shard_rows(rows, world, align)
  align = align or 1
  if world > rows then return nil, string.format("%d ranks but %d rows", world, rows) end
  local per = (rows + world - 1) // world
  local chunk = (per + align - 1) // align * align
  local out = {}
  for r = 0, world - 1 do
    local a, b = math.min(rows, r * chunk), math.min(rows, (r + 1) * chunk)
    out[r + 1] = {row0 = a, rows = b - a}
  end
  return out, chunk
end

local function align_of(shape) return #shape >= 2 and shard.ALIGN_2D or 1 end

--- shard.check_world(model_config, world, mode): raises "config: shard=<mode>: ..." when a parameter
-- of that Llama config has fewer rows than there are ranks (before anything is built)
function shard.check_world(mc, world, mode)
  local hd = mc.head_dim or mc.hidden_size // mc.num_attention_heads
  local rows = {
    ["model.embed_tokens.weight"] = mc.vocab_size, ["self_attn.q_proj.weight"] = mc.num_attention_heads * hd,
    ["self_attn.k_proj.weight"] = mc.num_key_value_heads * hd, ["self_attn.v_proj.weight"] = mc.num_key_value_heads * hd,
    ["self_attn.o_proj.weight"] = mc.hidden_size, ["mlp.gate_proj.weight"] = mc.intermediate_size,
    ["mlp.down_proj.weight"] = mc.hidden_size, ["input_layernorm.weight"] = mc.hidden_size,
  }
  local worst, wname
  for name, n in pairs(rows) do
    if not worst or n < worst or (n == worst and name < wname) then worst, wname = n, name end
  end
  if world > worst then
    util.user_error(string.format("config: shard=%s: %d ranks, but the parameter %s has %d rows; each rank holds rows " ..
      "of every parameter, so the world may be at most %d (fewer ranks, or shard=optimizer)", mode, world, wname, worst,
      worst), 0)
  end
end

-- ---- the sharded optimizer and model --------------------------------------------------------------

local Sharded = {}
Sharded.__index = Sharded

local function finite(v) return type(v) == "number" and v == v and v > -math.huge and v < math.huge end

local function padded_shape(shape, rows)
  local s = {table.unpack(shape)}
  s[1] = rows
  return s
end

-- a freed tensor: what a parameter's grad (and under "full" its param) is while its unit is not in
-- use; touching it raises "tensor is freed" rather than computing with something else
local function dead()
  local t = nv.unscope(nv.empty(1))
  t:free()
  return t
end

--- shard.Sharded(model, {lr, betas, eps, weight_decay}, dist, {mode = "grads"|"full",
-- reshard_after_forward = true}) -> the optimizer; the model's parameters become shards (see the header)
function shard.Sharded(model, opts, dist, so)
  opts = check_opts(opts, {lr = true, betas = true, eps = true, weight_decay = true}, "shard.Sharded")
  so = check_opts(so, {mode = true, reshard_after_forward = true}, "shard.Sharded")
  local mode = so.mode
  if mode ~= "grads" and mode ~= "full" then
    error("shard.Sharded: mode must be \"grads\" or \"full\", got " .. tostring(mode), 2)
  end
  if type(model) ~= "table" or not model.layers or not model.embed_tokens or not model.lm_head then
    error("shard.Sharded: expects an nn.Llama", 2)
  end
  if model.lm_head.tied then
    util.user_error("config: shard=" .. mode .. " does not take a tied LM head (tie=true): the tied weight is used by " ..
      "two units; give tie=false or shard=optimizer", 0)
  end
  local world, rank = dist.world_size(), dist.rank()
  local betas = opts.betas or {0.9, 0.95}
  local self = setmetatable({mode = mode, reshard = so.reshard_after_forward ~= false, dist = dist, world = world,
    rank = rank, model = model, t = 0, lr = opts.lr or 1e-3, beta1 = betas[1], beta2 = betas[2], eps = opts.eps or 1e-8,
    weight_decay = opts.weight_decay or 0.1, sharded = true, params = {}, by_name = {}, units = {},
    bytes = {gather = 0, reduce_scatter = 0}}, Sharded)
  local dev = model.grad_buffer:device()
  self.device = dev
  local DEAD = dead()
  self.dead = DEAD
  -- the parameters, in named_parameters order, each with its unit
  local unit_of = {}
  local function add_unit(key, mods)
    local u = {key = key, mods = mods, params = {}, gathered = false, grads = false}
    self.units[#self.units + 1] = u
    for _, m in ipairs(mods) do nn.each_entry(m, function(_, e) unit_of[e] = u end) end
    return u
  end
  add_unit("embed", {model.embed_tokens})
  for i = 1, model.layers.n do add_unit(i, {model.layers[i]}) end
  add_unit("head", {model.norm, model.lm_head})
  nn.each_entry(model, function(name, e)
    local shape = e.param:size()
    local ranges, chunk = shard.shard_rows(shape[1], world, align_of(shape))
    if not ranges then
      util.user_error(string.format("config: shard=%s: the parameter %s has %d rows, fewer than the %d ranks", mode, name,
        shape[1], world), 0)
    end
    local mine = ranges[rank + 1]
    local p = {name = name, entry = e, shape = shape, rows = shape[1], chunk = chunk, row0 = mine.row0, nrows = mine.rows,
      no_decay = e.no_decay, unit = assert(unit_of[e], "shard: parameter " .. name .. " is in no unit")}
    local pshape = padded_shape(shape, chunk)
    -- this rank's rows: master weight (full mode: its own tensor; grads: a view of the padded
    -- whole weight), gradient, moments; all (chunk, ...)
    if mode == "full" then
      p.shard = nv.unscope(nv.zeros(pshape, {device = dev}))
      if p.nrows > 0 then p.shard:narrow(1, 1, p.nrows):copy_(e.param:narrow(1, p.row0 + 1, p.nrows)) end
      e.param:free()
      e.param = p.shard
    else
      p.full = nv.unscope(nv.zeros(padded_shape(shape, chunk * world), {device = dev}))
      p.full:narrow(1, 1, p.rows):copy_(e.param)
      e.param:free()
      e.param = nv.unscope(p.full:narrow(1, 1, p.rows))
      p.shard = nv.unscope(p.full:narrow(1, rank * chunk + 1, chunk))
    end
    p.grad = nv.unscope(nv.zeros(pshape, {device = dev}))
    p.m = nv.unscope(nv.zeros(pshape, {device = dev}))
    p.v = nv.unscope(nv.zeros(pshape, {device = dev}))
    p.fresh = true -- the gradient shard holds nothing of this step yet
    e.grad:free() -- a view of the flat gradient buffer, freed below
    e.grad = DEAD
    self.params[#self.params + 1] = p
    self.by_name[name] = p
    table.insert(p.unit.params, p)
  end)
  model.grad_buffer:free()
  model.grad_buffer = nil
  model._buckets = nil
  -- the whole weights are freed above, but the model's constructor may have left other handles of
  -- their storage (the tensors they were made as views of) to the Lua GC: collected now, once, so
  -- that the memory is this rank's shards from here on
  collectgarbage("collect")
  self.flags_tensor = self.params[1].grad -- the device whose non-finite flags the step reads
  self:_install()
  return self
end

-- ---- gathering and reduce-scattering ------------------------------------------------------------

--- opt:gather_weight(p) -> the whole parameter p (rows, ...), a view of a new padded buffer (p.buf):
-- the all-gather of the ranks' f32 shards. The one place a quantized gather plugs in: for a linear
-- whose recipe quantizes its weight (with no SR draw or delayed history on it), each rank would
-- quantize its shard with the global amax and gather codes and scales (quant.all_gather_quantized,
-- bit-identical to quantizing the whole weight), and the recipe would take that QTensor as fprop's
-- and dgrad's weight; today the f32 weight is gathered and the recipe quantizes it, the same bits.
function Sharded:gather_weight(p)
  local buf = nv.unscope(nv.empty(padded_shape(p.shape, p.chunk * self.world), {device = self.device}))
  self.dist.all_gather(buf, p.shard)
  self.bytes.gather = self.bytes.gather + p.shard:nbytes() * (self.world - 1)
  p.buf = buf
  return nv.unscope(buf:narrow(1, 1, p.rows))
end

-- full mode: unit u's weights gathered (nothing when they are); the Linear layers' saved weight
-- handles (a forward whose weights were freed since) are pointed at the new ones
function Sharded:_gather(u)
  if self.mode ~= "full" or u.gathered then return end
  local moved = {}
  for _, p in ipairs(u.params) do
    local e = p.entry
    local w = self:gather_weight(p)
    if p.old then moved[p.old] = w; p.old = nil end
    e.param = w
  end
  if next(moved) then
    for _, m in ipairs(u.mods) do
      for _, sub in ipairs(m:modules()) do
        local s = sub._saved
        if type(s) == "table" and type(s.saved) == "table" and moved[s.saved.w] then s.saved.w = moved[s.saved.w] end
      end
    end
  end
  u.gathered = true
end

-- full mode: unit u's gathered weights freed (their handles remembered, for _gather to replace)
function Sharded:_release(u)
  if self.mode ~= "full" or not u.gathered then return end
  for _, p in ipairs(u.params) do
    p.old = p.entry.param
    p.entry.param:free() -- (a view of buf: freed too, or its handle would keep buf's storage)
    p.entry.param = p.shard
    p.buf:free()
    p.buf = nil
  end
  u.gathered = false
end

-- unit u's whole-size gradients, zeros (padded to world·chunk rows for the reduce-scatter)
function Sharded:_grads(u)
  if u.grads then return end
  for _, p in ipairs(u.params) do
    p.gfull = nv.unscope(nv.zeros(padded_shape(p.shape, p.chunk * self.world), {device = self.device}))
    p.entry.grad = nv.unscope(p.gfull:narrow(1, 1, p.rows))
  end
  u.grads = true
end

-- unit u's gradients reduce-scattered (avg) into this rank's shards, then freed
function Sharded:_reduce(u)
  if not u.grads then return end
  for _, p in ipairs(u.params) do
    if p.fresh then
      self.dist.reduce_scatter(p.grad, p.gfull, "avg")
      p.fresh = false
    else
      nv.scope(function()
        local tmp = nv.empty(padded_shape(p.shape, p.chunk), {device = self.device})
        self.dist.reduce_scatter(tmp, p.gfull, "avg")
        p.grad:add_(tmp)
      end)
    end
    self.bytes.reduce_scatter = self.bytes.reduce_scatter + p.grad:nbytes() * (self.world - 1)
    p.entry.grad:free()
    p.gfull:free()
    p.gfull = nil
    p.entry.grad = self.dead
  end
  u.grads = false
end

-- The units' forward and backward wrapped, on the module instances (the classes stay as they are).
function Sharded:_install()
  local model = self.model
  local function wrap_unit(u, m)
    local fwd, bwd = m.forward, m.backward -- the class's
    m.forward = function(mod, ...)
      self:_gather(u)
      local r = table.pack(fwd(mod, ...))
      -- (a forward run inside the unit's own backward, activation recompute's, keeps the weights)
      if not u.in_backward and (not mod.training or self.reshard) then self:_release(u) end
      return table.unpack(r, 1, r.n)
    end
    m.backward = function(mod, ...)
      self:_gather(u)
      self:_grads(u)
      u.in_backward = true
      local r = table.pack(pcall(bwd, mod, ...))
      u.in_backward = false
      if not r[1] then error(r[2], 0) end
      table.remove(r, 1)
      r.n = r.n - 1
      self:_reduce(u)
      self:_release(u)
      return table.unpack(r, 1, r.n)
    end
  end
  wrap_unit(self.units[1], model.embed_tokens)
  for i = 1, model.layers.n do wrap_unit(self.units[i + 1], model.layers[i]) end
  -- the head: gathered from the final norm's forward to its backward (the LM head and the loss run in
  -- between, chunk by chunk); in eval, freed after the LM head's forward
  local head = self.units[#self.units]
  local norm, lm = model.norm, model.lm_head
  local nf, nb, lf, lb = norm.forward, norm.backward, lm.forward, lm.backward
  norm.forward = function(mod, ...)
    self:_gather(head)
    return nf(mod, ...)
  end
  lm.forward = function(mod, ...)
    self:_gather(head)
    local r = table.pack(lf(mod, ...))
    if not mod.training then self:_release(head) end
    return table.unpack(r, 1, r.n)
  end
  lm.backward = function(mod, ...)
    self:_gather(head)
    self:_grads(head)
    return lb(mod, ...)
  end
  norm.backward = function(mod, ...)
    self:_gather(head)
    self:_grads(head)
    local r = table.pack(nb(mod, ...))
    self:_reduce(head)
    self:_release(head)
    return table.unpack(r, 1, r.n)
  end
  -- the gradient shards are the model's gradients now
  model.zero_grad = function(mod)
    for _, p in ipairs(self.params) do p.grad:zero_(); p.fresh = true end
    return mod
  end
  -- a checkpoint's (or any) whole tensors: this rank's rows of each
  model.load_state_dict = function(mod, dict, o) return self:load_state_dict(dict, o) end
  model.shards = self
end

-- ---- the optimizer --------------------------------------------------------------------------------

--- opt:reduce_clip(max_norm) -> the global gradient norm before clipping: the units' gradients are
-- already reduce-scattered (during the backward); the norm is the square root of the all-reduced sum
-- of the shards' squares (fp64), and the shards are scaled by max_norm / (norm + 1e-6) when it
-- exceeds max_norm (optim.clip_grad_norm's rule; a non-finite norm leaves them)
function Sharded:reduce_clip(max_norm)
  if max_norm ~= nil and not (finite(max_norm) and max_norm > 0) then
    util.user_error("reduce_clip: max_norm must be a finite number > 0, got " .. tostring(max_norm), 2)
  end
  local ss = 0.0
  for _, p in ipairs(self.params) do ss = ss + core.sumsq(p.grad) end
  local total = math.sqrt(self.dist.all_reduce_number(ss, "sum"))
  if max_norm and total > max_norm and total < math.huge then
    local c = max_norm / (total + 1e-6)
    for _, p in ipairs(self.params) do p.grad:mul_(c) end
  end
  return total
end

--- opt:step(): AdamW on this rank's shards (one core.adamw_multi; no_decay ones with weight decay 0);
-- under "grads" the updated weights are then all-gathered into every rank's whole weights
function Sharded:step()
  self.t = self.t + 1
  local ps, gs, ms, vs, nd = {}, {}, {}, {}, {}
  for i, p in ipairs(self.params) do ps[i], gs[i], ms[i], vs[i], nd[i] = p.shard, p.grad, p.m, p.v, p.no_decay end
  core.adamw_multi(ps, gs, ms, vs, {lr = self.lr, beta1 = self.beta1, beta2 = self.beta2, eps = self.eps,
    weight_decay = self.weight_decay, step = self.t}, nd)
  if self.mode == "grads" then
    for _, p in ipairs(self.params) do
      self.dist.all_gather(p.full, p.shard)
      self.bytes.gather = self.bytes.gather + p.shard:nbytes() * (self.world - 1)
    end
  end
end

function Sharded:zero_grad() self.model:zero_grad() end

function Sharded:set_lr(lr)
  if not (finite(lr) and lr >= 0) then
    util.user_error("set_lr: lr must be a finite number >= 0, got " .. tostring(lr), 2)
  end
  self.lr = lr
end

function Sharded:get_lr() return self.lr end

--- opt:memory() -> bytes on this rank: {weights (master weights: shards under "full", whole under
-- "grads", padding included), grads (the shards), state (m and v)}; between steps
function Sharded:memory()
  local w, g, s = 0, 0, 0
  for _, p in ipairs(self.params) do
    w = w + (self.mode == "full" and p.shard:nbytes() or p.full:nbytes())
    g, s = g + p.grad:nbytes(), s + p.m:nbytes() + p.v:nbytes()
  end
  return {weights = w, grads = g, state = s}
end

--- opt:describe() -> a line for the log
function Sharded:describe()
  local m = self:memory()
  local MiB = 1024 * 1024
  return string.format("shard=%s (%s): per rank weights %.2f MiB, gradient shards %.2f MiB, AdamW state %.2f MiB " ..
    "(world %d%s)", self.mode, self.mode == "full" and "ZeRO-3, FSDP" or "ZeRO-2", m.weights / MiB, m.grads / MiB,
    m.state / MiB, self.world, self.mode == "full" and (self.reshard and ", reshard_after_forward" or
    ", weights kept from forward to backward") or "")
end

-- ---- checkpoints ----------------------------------------------------------------------------------

-- The whole tensor `which` ("param", "m", "v") of p, on every rank (a collective under "full", and
-- for the moments); -> tensor, whether it is a new one (the caller frees it)
function Sharded:_whole(p, which)
  if which == "param" and self.mode == "grads" then return p.entry.param, false end
  local src = which == "param" and p.shard or p[which]
  local buf = nv.empty(padded_shape(p.shape, p.chunk * self.world), {device = self.device})
  self.dist.all_gather(buf, src)
  return buf:narrow(1, 1, p.rows), true
end

-- the tensors a checkpoint holds, in the order rank 0 writes them (safetensors sorts by name):
-- model.safetensors (the parameters), then trainer.safetensors (m.<name>, then v.<name>)
function Sharded:_save_order()
  local names = {}
  for _, p in ipairs(self.params) do names[#names + 1] = p.name end
  table.sort(names)
  local out = {}
  for _, n in ipairs(names) do out[#out + 1] = {n, "param"} end
  for _, which in ipairs({"m", "v"}) do
    for _, n in ipairs(names) do out[#out + 1] = {n, which} end
  end
  return out
end

-- a safetensors source (st.source) for p's whole `which`: gathered when written
function Sharded:_source(p, which)
  return util.tensor_source(p.shape, "f32", function(put)
    if util.write_sink_active() then -- a background save keeps the tensor until it is copied: the caller's scope frees it
      put((self:_whole(p, which)))
    else
      nv.scope(function() put((self:_whole(p, which))) end)
    end
  end)
end

--- opt:model_view() -> what checkpoint.save takes as the model on rank 0: the config and a
-- state_dict of sources, each parameter gathered as it is written
function Sharded:model_view()
  local model = self.model
  return {config = model.config, num_parameters = function() return model:num_parameters() end,
    state_dict = function()
      local d = {}
      for _, p in ipairs(self.params) do d[p.name] = self:_source(p, "param") end
      return d
    end}
end

--- opt:state() -> {step, m = {name = source}, v = {...}}: optim.AdamW's layout, each moment gathered
-- as it is written (rank 0, inside checkpoint.save; the others run opt:serve_checkpoint())
function Sharded:state()
  local m, v = {}, {}
  for _, p in ipairs(self.params) do m[p.name], v[p.name] = self:_source(p, "m"), self:_source(p, "v") end
  return {step = self.t, m = m, v = v}
end

--- opt:serve_checkpoint(): on a rank other than 0 while rank 0 saves a checkpoint: the same gathers,
-- in the same order (each freed at once)
function Sharded:serve_checkpoint()
  for _, o in ipairs(self:_save_order()) do
    local p = self.by_name[o[1]]
    if not (o[2] == "param" and self.mode == "grads") then
      nv.scope(function() self:_whole(p, o[2]) end)
    end
  end
end

-- checks that dict[name] is a tensor of p's shape for every p; -> problems
local function check_whole(dict, params, what)
  local problems, known = {}, {}
  for _, p in ipairs(params) do
    known[p.name] = true
    local t = dict[p.name]
    if t == nil then problems[#problems + 1] = what .. " missing: " .. p.name
    elseif not nv.is_tensor(t) then problems[#problems + 1] = what .. " not a tensor: " .. p.name
    elseif not same_shape(t:size(), p.shape) then
      problems[#problems + 1] = string.format("%s shape mismatch: %s: expected %s, got %s", what, p.name,
        shape_str(p.shape), shape_str(t))
    end
  end
  for k in pairs(dict) do if not known[k] then problems[#problems + 1] = what .. " unexpected: " .. tostring(k) end end
  table.sort(problems)
  return problems
end

-- copy this rank's rows of whole tensor t into dst (chunk, ...) rows
local function copy_rows(dst, t, p)
  if p.nrows > 0 then dst:narrow(1, 1, p.nrows):copy_(t:narrow(1, p.row0 + 1, p.nrows)) end
end

--- model:load_state_dict(dict) (installed on the model): whole tensors, this rank's rows kept (under
-- "grads" the whole weights); every name and shape checked first
function Sharded:load_state_dict(dict, o)
  check_opts(o, {strict = true}, "load_state_dict")
  if type(dict) ~= "table" then error("load_state_dict: expected a table {name = tensor}, got " .. type(dict), 2) end
  local problems = check_whole(dict, self.params, "")
  if #problems > 0 then error("load_state_dict: " .. table.concat(problems, "; "), 2) end
  for _, p in ipairs(self.params) do
    if self.mode == "grads" then p.entry.param:copy_(dict[p.name]) else copy_rows(p.shard, dict[p.name], p) end
  end
  return {missing = {}, unexpected = {}}
end

--- opt:load_state(s): s in optim.AdamW's layout (whole moments, of any run); this rank keeps its rows
function Sharded:load_state(s)
  if type(s) ~= "table" or math.type(s.step) ~= "integer" or type(s.m) ~= "table" or type(s.v) ~= "table" then
    error("load_state: expected {step = integer, m = {name = tensor}, v = {name = tensor}}", 2)
  end
  local problems = check_whole(s.m, self.params, "m")
  for _, x in ipairs(check_whole(s.v, self.params, "v")) do problems[#problems + 1] = x end
  if #problems > 0 then error("load_state: " .. table.concat(problems, "; "), 2) end
  for _, p in ipairs(self.params) do
    copy_rows(p.m, s.m[p.name], p)
    copy_rows(p.v, s.v[p.name], p)
  end
  self.t = s.step
end

--- opt:whole_parameters() -> {name = new whole tensor}: every parameter gathered (a collective;
-- for tests and exports of small models)
function Sharded:whole_parameters()
  local out = {}
  for _, p in ipairs(self.params) do
    out[p.name] = nv.scope(function() return (self:_whole(p, "param")):clone() end)
  end
  return out
end

return shard
