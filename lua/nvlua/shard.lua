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
-- Quantized weight copies (the recipe's weight cache, one quantization per optimizer step): under
-- "full" a gathered weight's cached copies are dropped when it is freed (recipe.weight_cache_drop),
-- so at most the gathered units' copies exist, not every block's until the step ends. Within a
-- unit's forward, and within its backward, a weight is quantized once (its uses hit the cache); with
-- reshard_after_forward the backward's re-gathered weight (the same f32 values) is quantized again —
-- the same call, the same bits: fprop's copy re-made for dgrad (recipe.linear_backward) — so a
-- quantized weight is made twice per micro-batch, where an unsharded step makes it once per step.
-- reshard_after_forward=false keeps the gathered weights, and so their copies, to the backward.
-- Per step: grad_accum micro-batches, each reduce-scattering as its backward completes a unit (the
-- first straight into the shard, later ones added to it: with grad_accum > 1 the sum order is that
-- of the micro-batches' averages, an fp32 reordering against plain data parallelism, which averages
-- once); opt:reduce_clip(max_norm) -> the global norm on the device (each rank's fp64 sum of
-- squares of its shards, all-gathered and summed in rank order; norm:value() reads it) and the clip
-- factor; opt:step() AdamW on the shards (core.adamw_multi, the decay / no_decay split of
-- optim.AdamW, the clip factor applied as it reads the gradients) and, under "grads", the
-- all-gather of the updated weights. Nothing in a step waits for the host (CUDA): the gathers,
-- reduce-scatters and the norm are stream-ordered; the norm is read where train.lua reads it.
--
-- Checkpoints keep the one format (nvlua.checkpoint): rank 0 writes model.safetensors and
-- trainer.safetensors as an unsharded run does; each tensor is a source (st.source) that gathers it
-- as it is written and is freed after, one at a time, while every other rank runs the same
-- collectives in the same order (opt:serve_checkpoint()). Loading takes the full tensors of any
-- checkpoint and keeps this rank's rows, so any checkpoint resumes at any world size and shard mode.
--
-- Prefetch (full mode; {prefetch = false} turns it off): when a unit's forward begins, once its own
-- weights are there, the next unit's all-gather is started (dist.all_gather_start: MPI_Iallgather on
-- the CPU, NCCL on its stream ordered by events on CUDA) before this unit computes; in the backward
-- the previous unit's (the LM head's backward starts the last block's). The next unit's gather
-- waits for it. So at most two units are gathered at once (with reshard_after_forward), and the
-- gathered values are the blocking gather's (the same bytes: the results do not change).
-- On the CPU, Open MPI advances a started gather only inside MPI calls (each start, wait and other
-- collective), so the overlap there is partial; on CUDA the NCCL stream runs it beside stream 0.
--
-- Quantized linears (gather = "quantized", the default; opt:gather_weight): a Linear whose recipe
-- quantizes its weight with one cacheable spec gathers codes and scales (nv.quant.all_gather_quantized)
-- straight into the recipe's weight cache, never the f32 weight: nvfp4 16x16 4.5 bits an element, fp8
-- 8, where f32 is 32 (opt.bytes.qgather counts them, qgather_bf16 what bf16 would have sent).
-- Not here: tied embeddings (refused).
--
-- Building: under "full" train.build makes the model in rows (shard.build, nn.build_rows): each
-- parameter is born as this rank's (chunk, ...) rows, drawn from the seed's Philox stream at the
-- elements the whole initialisation would give them (core.randn_'s `first`), and so is its gradient
-- (the model's flat gradient buffer is of rows): no rank ever holds a whole parameter. Sharded then
-- takes the rows as they are. (A model built whole, e.g. under "grads", is cut into rows here.)
local nv = require "nvlua"
local core = require "nvlua.core"
local util = require "nvlua.util"
local nn = require "nvlua.nn"
local recipes = require "nvlua.recipe"
local quant = require "nvlua.quant"
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

--- shard.row_rule(world, rank) -> rows(shape) -> row0 (0-based), nrows, chunk: this rank's rows of a
-- parameter of that shape by shard.shard_rows, what nn.build_rows takes (shard.build)
function shard.row_rule(world, rank)
  return function(shape)
    local ranges, chunk = shard.shard_rows(shape[1], world, align_of(shape))
    if not ranges then
      util.user_error(string.format("config: shard=full: a parameter %s has %d rows, fewer than the %d ranks",
        shape_str(shape), shape[1], world), 0)
    end
    return ranges[rank + 1].row0, ranges[rank + 1].rows, chunk
  end
end

--- shard.build(world, rank, fn) -> fn()'s results, every parameter the layers create inside fn made
-- as this rank's rows only (nn.build_rows with shard.row_rule): how train.build makes a shard=full
-- model, so that no rank holds a whole parameter or gradient; shard.Sharded(model, ..., {mode =
-- "full"}) then takes the rows as they are
function shard.build(world, rank, fn) return nn.build_rows(shard.row_rule(world, rank), fn) end

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

-- zeros of shape on device dev, made there (nv.zeros with a device fills on the host and copies:
-- a host synchronisation on a GPU)
local function zeros(shape, dev, dtype) return nv.empty(shape, {device = dev, dtype = dtype}):zero_() end

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
-- reshard_after_forward = true, prefetch = true}) -> the optimizer; the model's parameters become
-- shards (see the header)
function shard.Sharded(model, opts, dist, so)
  opts = check_opts(opts, {lr = true, betas = true, eps = true, weight_decay = true}, "shard.Sharded")
  so = check_opts(so, {mode = true, reshard_after_forward = true, prefetch = true, gather = true}, "shard.Sharded")
  if so.gather ~= nil and so.gather ~= "quantized" and so.gather ~= "f32" then
    util.user_error("shard.Sharded: gather must be \"quantized\" or \"f32\", got " .. tostring(so.gather), 2)
  end
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
  local self = setmetatable({mode = mode, reshard = so.reshard_after_forward ~= false, prefetch = so.prefetch ~= false,
    qgather = mode == "full" and so.gather ~= "f32",
    dist = dist, world = world,
    rank = rank, model = model, t = 0, lr = opts.lr or 1e-3, beta1 = betas[1], beta2 = betas[2], eps = opts.eps or 1e-8,
    weight_decay = opts.weight_decay or 0.1, sharded = true, params = {}, by_name = {}, units = {},
    bytes = {gather = 0, reduce_scatter = 0, qgather = 0, qgather_bf16 = 0}}, Sharded)
  local dev = model.grad_buffer:device()
  self.device = dev
  local DEAD = dead()
  self.dead = DEAD
  -- the parameters, in named_parameters order, each with its unit
  local unit_of, linear_of = {}, {}
  local function add_unit(key, mods)
    local u = {key = key, mods = mods, params = {}, gathered = false, grads = false}
    self.units[#self.units + 1] = u
    for _, m in ipairs(mods) do
      nn.each_entry(m, function(_, e) unit_of[e] = u end)
      for _, sub in ipairs(m:modules()) do
        if nn.is_instance(sub, nn.Linear) and not sub.tied then linear_of[sub.weight_entry] = sub end
      end
    end
    return u
  end
  add_unit("embed", {model.embed_tokens})
  for i = 1, model.layers.n do add_unit(i, {model.layers[i]}) end
  add_unit("head", {model.norm, model.lm_head})
  local built_in_rows -- (shard.build): each parameter is already this rank's rows, its gradient too
  nn.each_entry(model, function(name, e)
    if built_in_rows == nil then built_in_rows = e.full_shape ~= nil end
    if built_in_rows ~= (e.full_shape ~= nil) then
      error("shard.Sharded: some of the model's parameters were built in rows (shard.build), some whole", 2)
    end
    if built_in_rows and mode ~= "full" then
      error("shard.Sharded: a model built in rows (shard.build) is for mode \"full\" (\"grads\" keeps whole weights)", 2)
    end
    local shape = e.full_shape or e.param:size()
    local ranges, chunk = shard.shard_rows(shape[1], world, align_of(shape))
    if not ranges then
      util.user_error(string.format("config: shard=%s: the parameter %s has %d rows, fewer than the %d ranks", mode, name,
        shape[1], world), 0)
    end
    local mine = ranges[rank + 1]
    local p = {name = name, entry = e, shape = shape, rows = shape[1], chunk = chunk, row0 = mine.row0, nrows = mine.rows,
      no_decay = e.no_decay, unit = assert(unit_of[e], "shard: parameter " .. name .. " is in no unit"),
      linear = linear_of[e]}
    local pshape = padded_shape(shape, chunk)
    -- this rank's rows: master weight (full mode: its own tensor; grads: a view of the padded
    -- whole weight), gradient, moments; all (chunk, ...)
    if built_in_rows then
      if not same_shape(e.param:size(), pshape) or not same_shape(e.grad:size(), pshape) then
        error(string.format("shard.Sharded: %s was built as %s rows, but this rank's shard is %s (another world?)", name,
          shape_str(e.param), shape_str(pshape)), 2)
      end
      p.shard = e.param
    elseif mode == "full" then
      p.shard = nv.unscope(zeros(pshape, dev))
      if p.nrows > 0 then p.shard:narrow(1, 1, p.nrows):copy_(e.param:narrow(1, p.row0 + 1, p.nrows)) end
      e.param:free()
      e.param = p.shard
    else
      p.full = nv.unscope(zeros(padded_shape(shape, chunk * world), dev))
      p.full:narrow(1, 1, p.rows):copy_(e.param)
      e.param:free()
      e.param = nv.unscope(p.full:narrow(1, 1, p.rows))
      p.shard = nv.unscope(p.full:narrow(1, rank * chunk + 1, chunk))
    end
    if built_in_rows then
      p.grad = e.grad -- a view of the model's flat buffer of gradient rows, which it keeps
    else
      p.grad = nv.unscope(zeros(pshape, dev))
      e.grad:free() -- a view of the flat gradient buffer, freed below
    end
    p.m = nv.unscope(zeros(pshape, dev))
    p.v = nv.unscope(zeros(pshape, dev))
    p.fresh = true -- the gradient shard holds nothing of this step yet
    e.grad = DEAD
    self.params[#self.params + 1] = p
    self.by_name[name] = p
    table.insert(p.unit.params, p)
  end)
  model.grad_buffer:free() -- (built in rows: the handle; the gradient shards keep its storage)
  model.grad_buffer = nil
  model._buckets = nil
  -- the whole weights are freed above, but the model's constructor may have left other handles of
  -- their storage (the tensors they were made as views of) to the Lua GC: collected now, once, so
  -- that the memory is this rank's shards from here on
  collectgarbage("collect")
  self:_install()
  return self
end

-- ---- gathering and reduce-scattering ------------------------------------------------------------

--- opt:gather_weight(p [, start]) -> the whole parameter p (rows, ...), a view of a new padded buffer
-- (p.buf): the all-gather of the ranks' f32 shards; with start, -> a handle (dist.all_gather_start)
-- whose wait() completes it, and the view is made then (opt:_gather, opt:_view).
-- The quantized gather (full mode, gather = "quantized", the default): for a Linear whose recipe
-- quantizes its weight for fprop and dgrad with one cacheable spec (recipe:gathered_weight: nvfp4
-- 16x16, fp8 per tensor, mx formats; no SR, delayed history, RHT or MoR), inside a weight cache,
-- each rank quantizes its real rows with the global amax and the codes and scales are gathered
-- (nv.quant.all_gather_quantized, copies = "both": bit for bit the whole weight's quantization,
-- core/NUMERICS.md §14); the two copies go into the recipe's weight cache under the keys the
-- Linear's forward and backward ask for (recipe.weight_cache_put), and the Linear is given a
-- placeholder of the weight's shape instead of the f32 weight: a (1, K) row of NaN expanded to
-- (rows, K) (stride 0: K floats), which nothing reads (fprop and dgrad find their copies in the
-- cache; wgrad writes the gradient). Everything else (embedding, norms, the bf16 LM head, other
-- specs, a gather outside a weight cache, an mx weight whose shards are not on 32-row boundaries)
-- gathers f32. p's alignment: shard.ALIGN_2D (16) serves nvfp4 16x16 and fp8 (1); mx's dgrad copy
-- needs 32 (gather_align), taken when the chunk is a multiple of 32 (the same split then).
function Sharded:_qplan(p)
  if not (self.qgather and p.linear and recipes.weight_cache_open()) then return nil end
  local m = p.linear
  local plan = (m.recipe or nn.default_recipe()):gathered_weight(m:context())
  if not plan then return nil end
  local ga = quant.gather_align(plan.spec, "both")
  if shard.ALIGN_2D % ga == 0 then plan.align = shard.ALIGN_2D
  elseif p.chunk % ga == 0 then plan.align = ga
  else return nil end
  return plan
end

function Sharded:gather_weight(p, start)
  local plan = self:_qplan(p)
  if plan then
    local b0 = self.dist.bytes().all_gather
    local h = quant.all_gather_quantized(p.shard:narrow(1, 1, p.nrows), plan.spec, {rows = p.rows, copies = "both",
      align = plan.align, async = true})
    local sent = self.dist.bytes().all_gather - b0
    self.bytes.gather = self.bytes.gather + sent
    self.bytes.qgather = self.bytes.qgather + sent
    self.bytes.qgather_bf16 = self.bytes.qgather_bf16 + p.shard:nbytes() // 2 * (self.world - 1)
    p.qplan = plan
    local qh = {wait = function() p.qcopies = {h:wait()} end}
    if start then return qh end
    qh.wait()
    return self:_view(p)
  end
  local buf = nv.unscope(nv.empty(padded_shape(p.shape, p.chunk * self.world), {device = self.device}))
  self.bytes.gather = self.bytes.gather + p.shard:nbytes() * (self.world - 1)
  p.buf = buf
  local h = self.dist.all_gather_start(buf, p.shard)
  if start then return h end
  h:wait() -- (started and waited: on CUDA stream-ordered, the host does not wait)
  return self:_view(p)
end

-- the whole parameter p once its gather is waited for: the view of the f32 buffer, or, for a
-- quantized gather, the placeholder whose cached copies are the gathered ones (see gather_weight)
function Sharded:_view(p)
  local qc = p.qcopies
  if not qc then return nv.unscope(p.buf:narrow(1, 1, p.rows)) end
  p.qcopies = nil
  local plan = p.qplan
  p.qplan = nil
  if not recipes.weight_cache_open() then -- (a prefetch waited for after its cache closed: gathered anew, f32)
    for _, q in ipairs(qc) do q:free() end
    local save = self.qgather
    self.qgather = false
    local w = self:gather_weight(p)
    self.qgather = save
    return w
  end
  local K = p.shape[2]
  p.buf = nv.unscope(nv.empty({1, K}, {device = self.device}):fill_(0 / 0))
  local w = nv.unscope(p.buf:expand({p.rows, K}))
  recipes.weight_cache_put(w, plan.fkey, qc[1])
  recipes.weight_cache_put(w, plan.dkey, qc[2])
  return w
end

-- opt.trace = {} records the order of the gathers and the units' compute, one string each: "gather
-- <unit>" (started and waited for at once), "start <unit>" (a prefetch issued), "wait <unit>", "forward <unit>",
-- "backward <unit>" (its compute begins); units: embed, 1 .. L, head
function Sharded:_note(what, u)
  if self.trace then self.trace[#self.trace + 1] = what .. " " .. tostring(u.key) end
end

-- full mode: start unit u's gather without waiting (the prefetch of the unit that computes next),
-- unless it is gathered or in flight (nothing for u nil, or with prefetch off)
function Sharded:_prefetch(u)
  if self.mode ~= "full" or not self.prefetch or not u or u.gathered or u.inflight then return end
  local hs = {}
  for i, p in ipairs(u.params) do hs[i] = self:gather_weight(p, true) end
  u.inflight = hs
  self:_note("start", u)
end

-- full mode: unit u's weights gathered (nothing when they are; its prefetch waited for); the Linear
-- layers' saved weight handles (a forward whose weights were freed since) are pointed at the new ones
function Sharded:_gather(u)
  if self.mode ~= "full" or u.gathered then return end
  local hs = u.inflight
  u.inflight = nil
  self:_note(hs and "wait" or "gather", u)
  local moved = {}
  for i, p in ipairs(u.params) do
    local e = p.entry
    local w
    if hs then
      hs[i]:wait()
      w = self:_view(p)
    else
      w = self:gather_weight(p)
    end
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

-- full mode: unit u's gathered weights freed (their handles remembered, for _gather to replace),
-- with the recipe's cached quantized copies of them (recipe.weight_cache_drop)
function Sharded:_release(u)
  if self.mode ~= "full" or not u.gathered then return end
  for _, p in ipairs(u.params) do
    recipes.weight_cache_drop(p.entry.param)
    p.old = p.entry.param
    p.entry.param:free() -- (a view of buf: freed too, or its handle would keep buf's storage)
    p.entry.param = p.shard
    p.buf:free()
    p.buf = nil
  end
  u.gathered = false
end

-- full mode: every prefetch still in flight completed and its weights freed (a pass that ended
-- early, by an error, can leave one); before the step's own collectives
function Sharded:_settle()
  for _, u in ipairs(self.units) do
    if u.inflight then
      self:_gather(u)
      self:_release(u)
    end
  end
end

-- unit u's whole-size gradients, zeros (padded to world·chunk rows for the reduce-scatter)
function Sharded:_grads(u)
  if u.grads then return end
  for _, p in ipairs(u.params) do
    p.gfull = nv.unscope(zeros(padded_shape(p.shape, p.chunk * self.world), self.device))
    p.entry.grad = nv.unscope(p.gfull:narrow(1, 1, p.rows))
  end
  u.grads = true
end

-- unit u's gradients reduce-scattered (avg) into this rank's shards, then freed
function Sharded:_reduce(u)
  if not u.grads then return end
  for _, p in ipairs(u.params) do
    -- (reduce_scatter_start and its wait: on CUDA stream-ordered, the host does not wait)
    if p.fresh then
      self.dist.reduce_scatter_start(p.grad, p.gfull, "avg"):wait()
      p.fresh = false
    else
      nv.scope(function()
        local tmp = nv.empty(padded_shape(p.shape, p.chunk), {device = self.device})
        self.dist.reduce_scatter_start(tmp, p.gfull, "avg"):wait()
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
  local index = {}
  for i, u in ipairs(self.units) do index[u] = i end
  -- the unit that computes after u: in the forward the next one, in the backward the one before
  local function after(u, backward) return self.units[index[u] + (backward and -1 or 1)] end
  local function wrap_unit(u, m)
    local fwd, bwd = m.forward, m.backward -- the class's
    m.forward = function(mod, ...)
      self:_gather(u)
      if not u.in_backward then
        self:_prefetch(after(u))
        self:_note("forward", u)
      end
      local r = table.pack(fwd(mod, ...))
      -- (a forward run inside the unit's own backward, activation recompute's, keeps the weights)
      if not u.in_backward and (not mod.training or self.reshard) then self:_release(u) end
      return table.unpack(r, 1, r.n)
    end
    m.backward = function(mod, ...)
      self:_gather(u)
      self:_prefetch(after(u, true))
      self:_note("backward", u)
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
    self:_note("forward", head)
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
    self:_prefetch(after(head, true))
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
  -- the whole model's count (its parameters are shards)
  model.num_parameters = function()
    local n = 0
    for _, p in ipairs(self.params) do
      local k = 1
      for _, d in ipairs(p.shape) do k = k * d end
      n = n + k
    end
    return n
  end
  -- a checkpoint's (or any) whole tensors: this rank's rows of each
  model.load_state_dict = function(mod, dict, o) return self:load_state_dict(dict, o) end
  model.shards = self
end

-- ---- the optimizer --------------------------------------------------------------------------------

-- what reduce_clip returns: the norm state read once, on demand
local Norm = {}
Norm.__index = Norm
function Norm:_read()
  if self.opt.norm_gen ~= self.gen then
    error("norm: the optimizer has computed a newer norm since; read it before the next reduce_clip", 3)
  end
  if not self.v then
    local t = self.opt.norm_state:cpu():totable() -- (slots: core/backend.h NVL_NORM_*)
    self.v, self.flags = math.sqrt((string.unpack("<d", string.pack("<i8", t[1])))), t[4]
  end
end
--- norm:value() -> the global gradient norm (before clipping)
function Norm:value() self:_read(); return self.v end
--- norm:nonfinite() -> this rank's device's non-finite flags, taken when the norm was computed
function Norm:nonfinite() self:_read(); return self.flags end

--- opt:reduce_clip(max_norm) -> norm: the global gradient norm before clipping, on the gradients'
-- device, nothing read back: the units' gradients are already reduce-scattered (during the
-- backward); each rank's sum of squares of its shards (core.grad_norm_multi, fp64, which takes the
-- device's non-finite flags) is all-gathered (its norm state: 4 slots a rank; there is no f64
-- tensor to all-reduce) and summed in rank order on the device (core.grad_norm_combine: the same
-- sum on every rank), with the clip factor max_norm / (norm + 1e-6) when the norm exceeds max_norm
-- (optim.clip_grad_norm's rule; a non-finite norm is not clipped), which the next opt:step()
-- applies as AdamW reads the gradients (as optim.AdamW's clip_grad_norm). norm:value() reads the
-- norm and norm:nonfinite() this rank's non-finite flags (one copy to the host, the first time).
function Sharded:reduce_clip(max_norm)
  if max_norm ~= nil and not (finite(max_norm) and max_norm > 0) then
    util.user_error("reduce_clip: max_norm must be a finite number > 0, got " .. tostring(max_norm), 2)
  end
  self:_settle()
  if not self.norm_state then
    self.norm_state = nv.unscope(zeros({4}, self.device, "i64"))
    self.norm_parts = nv.unscope(zeros({4 * self.world}, self.device, "i64"))
  end
  local gs = {}
  for i, p in ipairs(self.params) do gs[i] = p.grad end
  local mn = max_norm or 1e300 -- (no clipping: a factor of 1)
  core.grad_norm_multi(self.norm_state, gs, mn, true)
  self.dist.all_gather_start(self.norm_parts, self.norm_state):wait() -- (on CUDA: stream-ordered, no host wait)
  core.grad_norm_combine(self.norm_state, self.norm_parts, mn)
  self.clip_armed = true
  self.norm_gen = (self.norm_gen or 0) + 1
  return setmetatable({opt = self, gen = self.norm_gen}, Norm)
end

--- opt:step(): AdamW on this rank's shards (one core.adamw_multi; no_decay ones with weight decay 0);
-- under "grads" the updated weights are then all-gathered into every rank's whole weights
function Sharded:step()
  self.t = self.t + 1
  local ps, gs, ms, vs, nd = {}, {}, {}, {}, {}
  for i, p in ipairs(self.params) do ps[i], gs[i], ms[i], vs[i], nd[i] = p.shard, p.grad, p.m, p.v, p.no_decay end
  local clip = self.clip_armed and self.norm_state or nil -- reduce_clip's factor, applied as the gradients are read
  self.clip_armed = false
  core.adamw_multi(ps, gs, ms, vs, {lr = self.lr, beta1 = self.beta1, beta2 = self.beta2, eps = self.eps,
    weight_decay = self.weight_decay, step = self.t}, nd, clip)
  if self.mode == "grads" then
    for _, p in ipairs(self.params) do -- (in place: p.shard is p.full's chunk)
      self.dist.all_gather_start(p.full, p.shard):wait()
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
  self:_settle()
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
  self:_settle()
  for _, o in ipairs(self:_save_order()) do
    local p = self.by_name[o[1]]
    if not (o[2] == "param" and self.mode == "grads") then
      nv.scope(function() self:_whole(p, o[2]) end)
    end
  end
end

-- checks that dict[name] is a tensor of p's shape for every p; -> problems. lenient: a missing or
-- unexpected name is not a problem but listed (-> problems, missing, unexpected)
local function check_whole(dict, params, what, lenient)
  local problems, known, missing, unexpected = {}, {}, {}, {}
  for _, p in ipairs(params) do
    known[p.name] = true
    local t = dict[p.name]
    if t == nil and lenient then missing[#missing + 1] = p.name
    elseif t == nil then problems[#problems + 1] = what .. " missing: " .. p.name
    elseif not nv.is_tensor(t) then problems[#problems + 1] = what .. " not a tensor: " .. p.name
    elseif not same_shape(t:size(), p.shape) then
      problems[#problems + 1] = string.format("%s shape mismatch: %s: expected %s, got %s", what, p.name,
        shape_str(p.shape), shape_str(t))
    end
  end
  for k in pairs(dict) do
    if known[k] then -- checked above
    elseif lenient then unexpected[#unexpected + 1] = tostring(k)
    else problems[#problems + 1] = what .. " unexpected: " .. tostring(k) end
  end
  table.sort(problems); table.sort(missing); table.sort(unexpected)
  return problems, missing, unexpected
end

-- copy this rank's rows of whole tensor t into dst (chunk, ...) rows
local function copy_rows(dst, t, p)
  if p.nrows > 0 then dst:narrow(1, 1, p.nrows):copy_(t:narrow(1, p.row0 + 1, p.nrows)) end
end

--- model:load_state_dict(dict [, {strict = true}]) (installed on the model): whole tensors, this
-- rank's rows kept (under "grads" the whole weights); every name and shape checked first. With
-- strict = false a missing or unexpected name is returned, not raised (a checkpoint's shards, one file
-- at a time: hf.load_weights), as nn.Module's.
function Sharded:load_state_dict(dict, o)
  o = check_opts(o, {strict = true}, "load_state_dict")
  if type(dict) ~= "table" then error("load_state_dict: expected a table {name = tensor}, got " .. type(dict), 2) end
  local problems, missing, unexpected = check_whole(dict, self.params, "", o.strict == false)
  if #problems > 0 then error("load_state_dict: " .. table.concat(problems, "; "), 2) end
  for _, p in ipairs(self.params) do
    local t = dict[p.name] -- (nil: missing, strict = false)
    if t and self.mode == "grads" then p.entry.param:copy_(t) elseif t then copy_rows(p.shard, t, p) end
  end
  return {missing = missing, unexpected = unexpected}
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
