-- nvlua.llama: the Llama 3 model, built from the nn layers.   local llama = require "nvlua.llama"
-- llama.Block, a decoder layer, and llama.Llama: token embedding, blocks, final norm and LM head,
-- registered under Hugging Face's parameter names so that the state dict is a Hugging Face
-- checkpoint's (model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...,
-- lm_head.weight); its forward/backward over token ids, loss and forward_backward (fused
-- cross-entropy, z-loss), and one flat gradient buffer. The config is nn.llama_config's (Hugging
-- Face LlamaConfig keys and defaults). nn.Llama and nn.Block are these same classes.
-- Not here: the layers (nn.lua), the optimizer (optim.lua), the training loop (train.lua),
-- checkpoints and Hugging Face config.json (checkpoint.lua).
-- Shape letters as in nn.lua: B batch, T sequence, N = B*T tokens, C hidden, V vocabulary.
-- Memory as in nn.lua: every forward and backward runs in an nv.scope. Block and Llama save no
-- tensors: each layer keeps its own handle of the input its backward reads — except under
-- activation recompute (Block:set_recompute, Llama's recompute option, train's recompute key):
--   "none"       every layer keeps what its backward reads (per token and block, in the activation
--                dtype: the block input, both norm outputs, the residual, RoPE'd q and k, v, the
--                attention output, gate, up and SwiGLU's product: 4C + 2·Dq + 2·kvC + 3F, with Dq and
--                kvC the query and key/value widths; in f32 the attention's log-sum-exp, one per query
--                head, and the two norms' rstd: Hq + 2)
--   "block"      the block keeps only its input x (C per token): its forward runs with the layers
--                keeping nothing, and its backward first runs that forward again, the layers keeping
--                what their backward reads, then back-propagates; so one block's activations exist at
--                a time. The recomputed forward gives the same bits with no side effect: the first
--                forward's quantization decisions are taped and replayed (recipe.record / replay:
--                delayed-scaling amaxes, data-parallel global amaxes, SR offsets, MoR choices), and
--                the replay counts no GEMM in nv.stats and calls no trace hook.
--   "selective"  everything but the two RMSNorm outputs and SwiGLU's product (2C + F per token, in the
--                activation dtype): the linears reading them keep neither them nor a quantized copy
--                (nn.Linear's recompute_input), and the backward recomputes each just before the
--                layers reading it back-propagate (RMSNorm:recompute from the norm's kept input,
--                SwiGLU from the kept gate and up); no quantization is decided again (the wgrad copy
--                of a recomputed input is made in the backward, as where fprop and wgrad do not pair).
-- Either way the gradients are bit-identical to "none" for every recipe (tests/test_recompute.lua).
local nv = require "nvlua"
local core = require "nvlua.core"
local util = require "nvlua.util"
local user_error = util.user_error
local nn = require "nvlua.nn"
local recipes = require "nvlua.recipe"
local check_opts, same_shape, shape_str = util.check_opts, util.same_shape, util.shape_str
local Module, ModuleList, Linear, Embedding, RMSNorm = nn.Module, nn.ModuleList, nn.Linear, nn.Embedding, nn.RMSNorm
local Attention, MLP = nn.Attention, nn.MLP
local take_saved, move_to, check_device = nn.take_saved, nn.move_to, nn.check_device

local llama = {}

-- ---- Block --------------------------------------------------------------------------------------

--- llama.Block(config [, {index = 0-based block index, rope =, generator =}]): a Llama decoder layer,
-- h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)). x (B, T, C).
local Block = nn.class("Block", Module)
llama.Block = Block

--- llama.RECOMPUTE: the activation recompute modes (see the header), in order of memory kept
llama.RECOMPUTE = {"none", "block", "selective"}

-- A check_opts checker of a recompute mode: nil for one of llama.RECOMPUTE, else what is wrong.
local function is_recompute(v)
  for _, m in ipairs(llama.RECOMPUTE) do if v == m then return nil end end
  return "must be one of " .. table.concat(llama.RECOMPUTE, ", ")
end

-- mode checked for fname's set_recompute: a user error naming the key otherwise
local function check_recompute(mode, fname)
  local bad = is_recompute(mode)
  if bad then
    user_error(string.format("%s: recompute %s, got %s", fname, bad, type(mode) == "string" and "'" .. mode .. "'" or
      tostring(mode)), 3)
  end
end

function Block:__init(config, opts)
  Module.__init(self)
  local c = nn.llama_config(config)
  opts = check_opts(opts, {index = true, rope = true, generator = true, recipe = true, recompute = is_recompute}, "Block")
  self.index = opts.index
  -- registered in Hugging Face's order (LlamaDecoderLayer: self_attn, mlp, the two norms)
  self.self_attn = self:register_module("self_attn", Attention(c, {rope = opts.rope, generator = opts.generator,
    recipe = opts.recipe}))
  self.mlp = self:register_module("mlp", MLP(c, {generator = opts.generator, recipe = opts.recipe}))
  self.input_layernorm = self:register_module("input_layernorm", RMSNorm(c.hidden_size, {eps = c.rms_norm_eps}))
  self.post_attention_layernorm = self:register_module("post_attention_layernorm",
    RMSNorm(c.hidden_size, {eps = c.rms_norm_eps}))
  for _, m in ipairs(self:modules()) do
    if nn.is_instance(m, Linear) then m.block = opts.index end
  end
  self:set_recompute(opts.recompute or "none")
end

function Block:extra_repr()
  local parts = {}
  if self.index then parts[#parts + 1] = "index=" .. self.index end
  if self.recompute ~= "none" then parts[#parts + 1] = "recompute=" .. self.recompute end
  return table.concat(parts, ", ")
end

--- block:set_recompute(mode) -> block: "none" | "block" | "selective" (the header). Set it between
-- steps, not between a forward and its backward.
function Block:set_recompute(mode)
  check_recompute(mode, "Block:set_recompute")
  self.recompute = mode
  local selective = self.recompute == "selective" or nil
  for _, l in ipairs({self.self_attn.q_proj, self.self_attn.k_proj, self.self_attn.v_proj, self.mlp.gate_proj,
    self.mlp.up_proj, self.mlp.down_proj}) do
    l.recompute_input = selective
  end
  return self
end

-- The block's arithmetic: x (B, T, C) -> out (B, T, C), in the caller's scope; kv: the layer's key/value
-- cache (nn.Attention), or nil.
local function block_forward(self, x, kv)
  local h = self.input_layernorm:forward(x)                  -- (B, T, C)
  local x1 = self.self_attn:forward(h, kv):add_(x)           -- (B, T, C) residual, in place
  local h2 = self.post_attention_layernorm:forward(x1)       -- (B, T, C)
  return self.mlp:forward(h2):add_(x1)                       -- (B, T, C)
end

-- Free what a forward kept for a backward that never ran (recompute = "block": the input, the tape).
function Block:_drop()
  local s = self._saved
  self._saved = nil
  if type(s) == "table" then
    s.x:free()
    recipes.release_tape(s.tape)
  end
end

-- fn() with every module under the block (not the block) in eval mode: they keep nothing.
local function layers_keeping_nothing(self, fn, ...)
  local mods, was = self:modules(), {}
  for i = 2, #mods do was[i], mods[i].training = mods[i].training, false end
  local r = table.pack(pcall(fn, ...))
  for i = 2, #mods do mods[i].training = was[i] end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- block:forward(x [, kv]) -> out (B, T, C); kv (eval mode): this layer's key/value cache (nn.Attention)
function Block:forward(x, kv)
  self:_drop()
  if kv or not (self.training and self.recompute == "block") then
    self._saved = self.training or nil -- nothing to keep: the layers hold h, x1 and h2 for their backward
    return nv.scope(function() return block_forward(self, x, kv) end)
  end
  -- recompute = "block": the layers keep nothing; their decisions are taped for the backward's rerun
  local tape, out = layers_keeping_nothing(self, function()
    return recipes.record(function() return nv.scope(function() return block_forward(self, x) end) end)
  end)
  self._saved = {x = nv.unscope(x:view(x:size())), tape = tape} -- the input (B, T, C), our own handle
  return out
end

function Block:backward(dout)
  local s = take_saved(self, "Block")
  if type(s) == "table" then -- recompute = "block": the forward again, the layers keeping what their backward reads
    nv.scope(function() -- our handle of the input and the recomputed output die here
      nv.adopt(s.x)
      local ok, err = pcall(recipes.replay, s.tape, function()
        nv.scope(function() block_forward(self, s.x) end)
      end)
      recipes.release_tape(s.tape)
      if not ok then error(err, 0) end
    end)
  end
  -- recompute = "selective": each norm's output again just before the projections reading it run
  -- their backward (they hold it until then)
  return nv.scope(function()
    local dx1 = nv.scope(function() -- dh2 dies once the norm's backward has read it
      if self.mlp.gate_proj:needs_input() then
        self.mlp:restore_input(self.post_attention_layernorm:recompute())           -- h2 (B, T, C)
      end
      return self.post_attention_layernorm:backward(self.mlp:backward(dout))
    end)
    dx1:add_(dout)                                           -- (B, T, C) the residual's gradient
    if self.self_attn.q_proj:needs_input() then
      nv.scope(function() self.self_attn:restore_input(self.input_layernorm:recompute()) end) -- h (B, T, C)
    end
    return self.input_layernorm:backward(self.self_attn:backward(dx1)):add_(dx1)
  end)
end

-- ---- Llama --------------------------------------------------------------------------------------

--- llama.Llama(config [, {recipe =, seed =, generator =, recompute = "none"}]): a Llama 3 language model (config: nn.llama_config's
-- keys; the five sizes, nn.LLAMA_SIZE_KEYS, must be given) with Hugging Face
-- parameter names (model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...,
-- model.norm.weight, lm_head.weight unless tied). Weights: normal(0, initializer_range) from a
-- Philox generator seeded with `seed` (else the default generator), norms ones. Gradients live in
-- one flat f32 buffer (model.grad_buffer) that each parameter's grad is a view of.
-- model.step (set by the training loop) is passed to the recipe as ctx.step. recompute: every
-- block's activation recompute mode (the header; model:set_recompute).
local Llama = nn.class("Llama", Module)
llama.Llama = Llama

function Llama:__init(config, opts)
  Module.__init(self)
  local c = nn.llama_config(config) -- the sizes must be given (Hugging Face defaults them to a 6.7B model)
  opts = check_opts(opts, {recipe = true, seed = true, generator = true, recompute = is_recompute}, "Llama")
  self.config = c
  self.step = 0
  local gen = opts.generator or (opts.seed and nv.Generator(opts.seed)) or nil
  self.rope = nn.RopeCache(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
  local model = self:register_module("model", Module())
  self.embed_tokens = model:register_module("embed_tokens",
    Embedding(c.vocab_size, c.hidden_size, {generator = gen, std = c.initializer_range}))
  self.layers = model:register_module("layers", ModuleList())
  for i = 0, c.num_hidden_layers - 1 do
    self.layers:append(Block(c, {index = i, rope = self.rope, generator = gen, recompute = opts.recompute}))
  end
  self.norm = model:register_module("norm", RMSNorm(c.hidden_size, {eps = c.rms_norm_eps}))
  self.lm_head = self:register_module("lm_head", Linear(c.hidden_size, c.vocab_size, {high_precision = true,
    generator = gen, std = c.initializer_range, tie = c.tie_word_embeddings and self.embed_tokens.weight_entry or nil}))
  self:set_names("")
  self._linears = {}
  for _, m in ipairs(self:modules()) do
    if nn.is_instance(m, Linear) then
      m.num_blocks = c.num_hidden_layers
      self._linears[#self._linears + 1] = m
    end
  end
  self:_flatten_grads()
  if opts.recipe then self:set_recipe(opts.recipe) end
end

function Llama:extra_repr()
  local c = self.config
  local r = self:recompute_mode()
  return string.format("layers=%d, hidden=%d, heads=%d/%d, ffn=%d, vocab=%d%s%s", c.num_hidden_layers, c.hidden_size,
    c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size,
    c.tie_word_embeddings and ", tied" or "", r ~= "none" and ", recompute=" .. r or "")
end

--- model:set_recompute(mode) -> model: every block's activation recompute, "none" | "block" |
-- "selective" (the header); between steps, not between a forward and its backward
function Llama:set_recompute(mode)
  check_recompute(mode, "Llama:set_recompute")
  for i = 1, self.layers.n do self.layers[i]:set_recompute(mode) end
  return self
end

--- model:recompute_mode() -> the blocks' recompute mode ("mixed" where blocks were set apart)
function Llama:recompute_mode()
  local m
  for i = 1, self.layers.n do
    local r = self.layers[i].recompute
    if m and r ~= m then return "mixed" end
    m = r
  end
  return m or "none"
end

-- Make every gradient a view of one flat f32 buffer on the parameters' device (for one
-- all-reduce / one zero fill); the gradients' values are kept.
function Llama:_flatten_grads()
  local entries, total = {}, 0
  nn.each_entry(self, function(_, e)
    entries[#entries + 1] = e
    total = total + e.param:numel()
  end)
  local old = self.grad_buffer
  local buf = nv.unscope(nv.zeros(total, {device = self.device or "cpu"}))
  local off = 0
  for _, e in ipairs(entries) do
    local n = e.param:numel()
    local piece = buf:narrow(1, off + 1, n)
    local g = piece:view(e.param:size())
    piece:free() -- its share of buf now: a buffer replaced later (ZeRO-1's padded one) is then freed at once
    if old then g:copy_(e.grad) end
    e.grad:free()
    e.grad = nv.unscope(g)
    off = off + n
  end
  self.grad_buffer = buf
end

function Llama:zero_grad()
  self.grad_buffer:zero_()
  return self
end

--- model:to(device) -> model: Module:to, with the gradients copied straight into one new flat
-- buffer on that device
function Llama:to(device)
  check_device(device, "Module:to")
  move_to(self, device, false)
  local old = self.grad_buffer
  self:_flatten_grads()
  old:free()
  return self
end

--- model:linears() -> ordered array of {name =, block = 0-based or nil, high_precision =, module =}
--- model:recipes() -> the recipes its linears compute under, each once, in the linears' order
-- (nn.default_recipe() for a linear without its own)
function Llama:recipes()
  local out, seen = {}, {}
  for _, l in ipairs(self._linears) do
    local r = l.recipe or nn.default_recipe()
    if not seen[r] then seen[r], out[#out + 1] = true, r end
  end
  return out
end

--- model:save_recipe_states() -> restore: the state of each of model:recipes() now (SR generators,
-- delayed-scaling histories, MoR's choices: recipe:state()), and a function putting it back. What
-- scores, samples or exports a model without changing its run (generate, nvlua.eval, nvlua.deploy)
-- brackets its forwards with them.
function Llama:save_recipe_states()
  local states = {}
  for i, r in ipairs(self:recipes()) do states[i] = {r, r:state()} end
  return function() for _, s in ipairs(states) do s[1]:load_state(s[2]) end end
end

function Llama:linears()
  local out = {}
  for _, m in ipairs(self._linears) do
    out[#out + 1] = {name = m.name, block = m.block, high_precision = m.high_precision, module = m}
  end
  return out
end

local function check_ids(ids, what, fname, max_pos)
  if not nv.is_tensor(ids) or ids:dtype() ~= "i64" or ids:dim() ~= 2 then
    user_error(string.format("%s: %s must be an i64 [B, T] tensor, got %s", fname, what,
      nv.is_tensor(ids) and (ids:dtype() .. " " .. shape_str(ids)) or type(ids)), 3)
  end
  if max_pos and ids:size(2) > max_pos then
    user_error(string.format("%s: sequence length %d exceeds max_position_embeddings %d", fname, ids:size(2), max_pos), 3)
  end
end

--- model:forward(ids [, {cache = model:kv_cache()}]) -> logits [B*T, V], f32 or bf16 (the recipe's
-- act_dtype); ids i64 [B, T] (0-based token ids). With a cache (eval mode): ids are the positions
-- cache.len .. cache.len + T - 1, after those the cache holds; their keys and values are appended and
-- the logits come as [B, T, V].
function Llama:forward(ids, opts)
  if opts ~= nil then
    opts = check_opts(opts, {cache = true}, "Llama:forward")
    if opts.cache ~= nil then return self:_forward_cached(ids, opts.cache) end
  end
  check_ids(ids, "ids", "Llama:forward", self.config.max_position_embeddings)
  return nv.scope(function() return self.lm_head:forward(self:_hidden(ids)) end) -- (N, V)
end

-- ---- KV cache -------------------------------------------------------------------------------------
-- Per layer the RoPE'd keys and the values of the positions run so far, f32 (B, capacity, Hkv, D)
-- buffers on the model's device, made at the first forward (which sets B) and freed by cache:free()
-- (or the GC). Each cached forward runs only its new positions through the model: generating n tokens
-- after a prompt of P processes P + n positions (cache.positions counts them), not a forward over the
-- whole context per token. Numerics: in f32 the cached logits are the full forward's up to fp32
-- rounding (the attention's sums run in another order); under a quantized recipe each cached step
-- quantizes its own activations (per-tensor scales and amaxes of the new tokens only), so the logits
-- are close to the full forward's, not equal (tests/test_generate.lua states the measured bounds).
-- Under delayed scaling each cached forward pushes its amaxes to the recipe's history, as every eval
-- forward does (model:generate restores the recipes' state when it is done).

local KVCache = {}
KVCache.__index = KVCache
llama.KVCache = KVCache

--- model:kv_cache([capacity]) -> cache: an empty key/value cache for model:forward(ids, {cache =}) of at
-- most capacity positions (default and at most max_position_embeddings). cache.len: the positions held;
-- cache:truncate(n) keeps the first n (to run another continuation of a shared prefix); cache:free().
function Llama:kv_cache(capacity)
  local mpe = self.config.max_position_embeddings
  capacity = capacity == nil and mpe or capacity
  if math.type(capacity) ~= "integer" or capacity < 1 or capacity > mpe then
    user_error(string.format("Llama:kv_cache: capacity must be an integer in 1 .. %d (max_position_embeddings), got %s",
      mpe, tostring(capacity)), 2)
  end
  return setmetatable({model = self, capacity = capacity, len = 0, positions = 0, layers = nil, B = nil}, KVCache)
end

--- cache:truncate(n) -> cache: drop the positions >= n (0 <= n <= cache.len); the next forward continues at n
function KVCache:truncate(n)
  if math.type(n) ~= "integer" or n < 0 or n > self.len then
    user_error(string.format("KVCache:truncate: n must be an integer in 0 .. %d (cache.len), got %s", self.len,
      tostring(n)), 2)
  end
  self.len = n
  return self
end

--- cache:free(): release the buffers now (the cache is empty after it and can be used again)
function KVCache:free()
  for _, l in ipairs(self.layers or {}) do l.k:free(); l.v:free() end
  self.layers, self.B, self.len = nil, nil, 0
end

-- The buffers for batch B (made, or made again for another B when empty).
function KVCache:_buffers(B)
  if self.layers and self.B == B then return self.layers end
  if self.layers and self.len > 0 then
    user_error(string.format("Llama:forward: the cache holds %d positions of a batch of %d; ids have a batch of %d " ..
      "(cache:truncate(0) to start over)", self.len, self.B, B), 3)
  end
  self:free()
  local m, c = self.model, self.model.config
  local layers = {}
  for i = 1, c.num_hidden_layers do
    local function buf() -- (B, capacity, Hkv, D) f32
      return nv.unscope(nv.zeros(B, self.capacity, c.num_key_value_heads, c.head_dim, {device = m.device or "cpu"}))
    end
    layers[i] = {k = buf(), v = buf()}
  end
  self.layers, self.B = layers, B
  return layers
end

function Llama:_forward_cached(ids, cache)
  if getmetatable(cache) ~= KVCache or cache.model ~= self then
    user_error("Llama:forward: cache must be this model's model:kv_cache(), got " .. tostring(cache), 3)
  end
  check_ids(ids, "ids", "Llama:forward")
  if self.training then
    user_error("Llama:forward: a key/value cache runs in eval mode only (call model:eval()): a training forward " ..
      "keeps activations for a backward the cache cannot give", 3)
  end
  local B, T, p0 = ids:size(1), ids:size(2), cache.len
  if p0 + T > cache.capacity then
    user_error(string.format("Llama:forward: %d positions after the %d cached exceed the cache's capacity %d", T, p0,
      cache.capacity), 3)
  end
  local layers = cache:_buffers(B)
  for _, m in ipairs(self._linears) do m.step = self.step end
  local logits = nv.scope(function()
    local x = self.embed_tokens:forward(ids)                 -- (B, T, C)
    for i = 1, self.layers.n do
      x = nv.scope(function()
        nv.adopt(x)
        return self.layers[i]:forward(x, {k = layers[i].k, v = layers[i].v, pos = p0}) -- (B, T, C)
      end)
    end
    local C = self.config.hidden_size
    return self.lm_head:forward(self.norm:forward(x:view(B * T, C))):view(B, T, self.config.vocab_size) -- (B, T, V)
  end)
  cache.len, cache.positions = p0 + T, cache.positions + B * T
  return logits
end

-- The trunk: embedding, blocks, final norm -> (N, C) (ids checked by the caller)
function Llama:_hidden(ids)
  for _, m in ipairs(self._linears) do m.step = self.step end
  local N, C = ids:numel(), self.config.hidden_size
  self._saved = self.training and {shape = {ids:size(1), ids:size(2), C}} or nil -- no tensors: see Block
  return nv.scope(function()
    local x = self.embed_tokens:forward(ids)                 -- (B, T, C)
    for i = 1, self.layers.n do
      x = nv.scope(function() -- our handle of the block's input dies here (in training its norm keeps one)
        nv.adopt(x)
        return self.layers[i]:forward(x)                     -- (B, T, C)
      end)
    end
    return self.norm:forward(x:view(N, C))                   -- (N, C)
  end)
end

--- model:backward(dlogits [N, V]): accumulates every parameter gradient; returns nil
function Llama:backward(dlogits)
  self:_hidden_backward(function() return self.lm_head:backward(dlogits) end)
end

--- model:grad_buckets() -> {head = {views}, [i] = {views}, embed = {views}}: the gradient buffer
-- cut where the backward pass completes it — the final norm and the (untied) LM head first, then
-- block L .. 1, then the embedding (with a tied LM head) — each a list of contiguous views of
-- model.grad_buffer (one per contiguous run of its parameters). Bucketed data parallelism starts
-- reducing each as model.grad_hook(stage) announces it (train.lua). nil if the stages do not
-- cover the buffer exactly.
function Llama:grad_buckets()
  if self._buckets and self._buckets.buffer == self.grad_buffer then return self._buckets.stages end
  local tied = self.lm_head.tied
  local function runs(mods)
    local es, seen = {}, {}
    for _, m in ipairs(mods) do
      nn.each_entry(m, function(_, e) if not seen[e] then seen[e] = true; es[#es + 1] = e end end)
    end
    table.sort(es, function(a, b) return a.grad:storage_offset() < b.grad:storage_offset() end)
    local out, n, lo, hi = {}, 0, nil, nil
    local base = self.grad_buffer:storage_offset()
    for _, e in ipairs(es) do
      local o, k = e.grad:storage_offset() - base, e.grad:numel()
      n = n + k
      if hi == o then hi = o + k
      else
        if lo then out[#out + 1] = self.grad_buffer:narrow(1, lo + 1, hi - lo) end
        lo, hi = o, o + k
      end
    end
    if lo then out[#out + 1] = self.grad_buffer:narrow(1, lo + 1, hi - lo) end
    return out, n
  end
  local order = {{"head", tied and {self.norm} or {self.norm, self.lm_head}}}
  for i = 1, self.layers.n do order[#order + 1] = {i, {self.layers[i]}} end
  order[#order + 1] = {"embed", {self.embed_tokens}}
  local stages, total = {}, 0
  for _, o in ipairs(order) do
    local list, n = runs(o[2])
    for j, v in ipairs(list) do list[j] = nv.unscope(v) end
    stages[o[1]], total = list, total + n
  end
  if total ~= self.grad_buffer:numel() then stages = nil end
  self._buckets = {buffer = self.grad_buffer, stages = stages}
  return stages
end

-- The trunk's backward from dh() (the gradient of the final norm's output, (N, C), made inside
-- the scope that frees it). model.grad_hook(stage), if set, is called as each stage of
-- grad_buckets() is complete.
function Llama:_hidden_backward(dh)
  local s = take_saved(self, "Llama")
  local hook = self.grad_hook or function() end
  nv.scope(function()
    local dx = nv.scope(function() -- the norm's input gradient, as (B, T, C); dh dies here
      return self.norm:backward(dh()):view(s.shape)
    end)
    hook("head")
    for i = self.layers.n, 1, -1 do
      dx = nv.scope(function() -- the gradient of block i's output dies with its backward
        nv.adopt(dx)
        return self.layers[i]:backward(dx)                   -- (B, T, C)
      end)
      hook(i)
    end
    self.embed_tokens:backward(dx)
    hook("embed")
  end)
  return nil
end

-- The LM head and its loss in chunks of tokens: logits and their gradient exist for one chunk at a
-- time (at a 128k vocabulary and 8k tokens the whole batch's bf16 logits, f32 and bf16 dlogits are
-- about 8 GB). Default: chunks of recipe.LOSS_CHUNK_ELEMS (2^27) / vocab tokens (~1 GB of those at
-- any vocabulary), where recipe:head_chunkable says chunks leave the result as it is.
function Llama:_head_chunkable()
  return (self.lm_head.recipe or nn.default_recipe()):head_chunkable(self.lm_head:context())
end

function Llama:_chunked_loss(ids, targets, opts, chunk)
  check_ids(ids, "ids", "Llama:forward_backward", self.config.max_position_embeddings)
  local N = ids:numel()
  local ignore = opts.ignore_index or -100
  local tg = targets:reshape(N)
  local th = tg:device() == "cpu" and tg or tg:cpu()             -- the targets, on the host
  local count = th:ne(ignore):sum()
  local h = self:_hidden(ids)                                    -- (N, C) (saved for the backward)
  local sums = {count = count} -- the chunks' loss sums, on the logits' device (read at the end)
  local dh = nv.empty(N, h:size(2), {dtype = h:dtype(), device = h:device()})
  for r0 = 0, N - 1, chunk do
    local n = math.min(chunk, N - r0)
    sums[#sums + 1] = nv.scope(function() -- this chunk's logits and their gradient die here
      local logits = self.lm_head:forward(h:narrow(1, r0 + 1, n)) -- (n, V)
      -- bf16 logits: dlogits rounded once to bf16 by the loss itself, as unchunked (NUMERICS §11)
      local sum, _, d = core.cross_entropy(logits, th:narrow(1, r0 + 1, n), {ignore_index = ignore,
        z_loss = opts.z_loss or 0, grad = true, scale = opts.scale or 1, of_count = count > 0 and count or nil,
        defer = true, grad_dtype = logits:dtype()})
      dh:narrow(1, r0 + 1, n):copy_(self.lm_head:backward(d))
      return sum
    end)
  end
  h:free()
  self:_hidden_backward(function() return dh end)
  return sums, count
end

-- Knowledge distillation (forward_backward's distill = {teacher, temperature, alpha}): the teacher's
-- trunk runs in eval mode (no gradients, nothing saved), then the LM heads of both and the loss
-- (core.distill_loss: alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE) run over chunks
-- of the tokens, so that neither model's (tokens x vocab) logits exist whole; where the student's
-- head cannot be chunked (_head_chunkable) its logits and their gradient are whole, the teacher's
-- still come in chunks. -> {loss, kl =, ce =} (host numbers), count
function Llama:_distill(ids, targets, opts, chunk)
  local o = opts.distill
  local teacher, T, alpha = o.teacher, o.temperature or 1, o.alpha or 0.5
  if type(teacher) ~= "table" or not teacher._hidden or teacher.config.vocab_size ~= self.config.vocab_size then
    error("Llama:forward_backward: distill.teacher must be an nn.Llama with the student's vocabulary", 3)
  end
  local N = ids:numel()
  if chunk == 0 then chunk = N end
  local whole = not self:_head_chunkable() -- the student's head over all the tokens at once
  local ignore = opts.ignore_index or -100
  local tg = targets:reshape(N)
  local th_ = tg:device() == "cpu" and tg or tg:cpu()
  local count = th_:ne(ignore):sum()
  local was = teacher.training
  teacher:eval()
  local ok, ht = pcall(teacher._hidden, teacher, ids)          -- (N, C_teacher), nothing saved
  teacher:train(was)
  if not ok then error(ht, 0) end
  local h = self:_hidden(ids)                                  -- (N, C) (saved for the backward)
  local dh = whole and nil or nv.empty(N, h:size(2), {dtype = h:dtype(), device = h:device()})
  local sl_all = whole and self.lm_head:forward(h) or nil      -- (N, V) only where the head needs it
  local dl_all = whole and nv.empty(N, self.config.vocab_size, {dtype = sl_all:dtype(), device = h:device()}) or nil
  local kl, ce = 0, 0
  for r0 = 0, N - 1, chunk do
    local n = math.min(chunk, N - r0)
    nv.scope(function() -- this chunk's logits, the teacher's and the gradient die here
      local sl = whole and sl_all:narrow(1, r0 + 1, n) or self.lm_head:forward(h:narrow(1, r0 + 1, n))
      local tl = teacher.lm_head:forward(ht:narrow(1, r0 + 1, n))
      local k, c, _, d = core.distill_loss(sl, tl, th_:narrow(1, r0 + 1, n), {temperature = T, alpha = alpha,
        ignore_index = ignore, scale = opts.scale or 1, of_count = count > 0 and count or nil})
      kl, ce = kl + k, ce + c
      if sl:dtype() == "bf16" then d = d:to("bf16") end
      if whole then dl_all:narrow(1, r0 + 1, n):copy_(d)
      else dh:narrow(1, r0 + 1, n):copy_(self.lm_head:backward(d)) end
    end)
  end
  ht:free()
  if whole then
    sl_all:free()
    dh = self.lm_head:backward(dl_all)
    dl_all:free()
  end
  h:free()
  self:_hidden_backward(function() return dh end)
  return {alpha * T * T * kl + (1 - alpha) * ce, kl = kl, ce = ce}, count
end

-- ---- generation ------------------------------------------------------------------------------------

-- A check_opts checker: nil for a number >= 0, else what is wrong
local function non_negative(v)
  if type(v) ~= "number" or v ~= v or v < 0 then return "must be a number >= 0" end
end
local function count_of(v)
  if math.type(v) ~= "integer" or v < 0 then return "must be an integer >= 0" end
end
local function positive_count(v)
  if math.type(v) ~= "integer" or v < 1 then return "must be an integer >= 1" end
end

--- llama.pick_token(row, o, gen) -> a 0-based token id from the logits row (a Lua array, 1-based): the
-- argmax with o.temperature == 0 (the first of equal ones), else softmax(top-k of row / temperature) and
-- one uniform draw from gen (o.top_k default 40); train.sample's scheme, kept so its samples stay.
function llama.pick_token(row, o, gen)
  local temp = o.temperature or 1
  if temp == 0 then
    local best = 1
    for i = 2, #row do if row[i] > row[best] then best = i end end
    return best - 1
  end
  -- the k best ids, best first (ties: the lower id first), by insertion into a list of at most k: O(V) for
  -- a vocabulary of V, not a sort of it (128K ids: a sort took 0.17 s a token)
  local k = math.min(o.top_k or 40, #row)
  local idx = {}
  for i = 1, #row do
    local v = row[i]
    if #idx < k or v > row[idx[#idx]] then
      local j = math.min(#idx, k - 1) -- the list's last slot that stays
      while j >= 1 and v > row[idx[j]] do idx[j + 1] = idx[j]; j = j - 1 end
      idx[j + 1] = i
    end
  end
  local m, w, z = row[idx[1]], {}, 0
  for i = 1, k do w[i] = math.exp((row[idx[i]] - m) / temp); z = z + w[i] end
  local u = nv.rand(1, {generator = gen}):get(1) * z
  local pick = idx[k]
  for i = 1, k do
    u = u - w[i]
    if u <= 0 then pick = idx[i]; break end
  end
  return pick - 1
end

--- model:generate(tok, prompt_text [, {max_new_tokens = 64, temperature = 1, top_k = 40, seed = 1, prompt_ids =}])
-- -> text, ids, stop: the prompt encoded by tok:encode (a tokenizer object: data.ByteTokenizer or
-- nvlua.tokenizer.load's), run once through a KV cache, then one token per step: temperature 0 is greedy
-- (argmax), else top-k sampling with one uniform draw per token from nv.Generator(seed) (deterministic).
-- Stops after max_new_tokens (stop = "max_new_tokens"), at tok.eos_id (stop = "eos"; the eos is in ids, not in
-- text) or when the context (max_position_embeddings) is full (stop = "context"). text: tok:decode of the
-- new tokens; ids: their 0-based ids. prompt_ids (a table of ids) replaces the encoding of prompt_text
-- (train.sample: a data manifest's pre-tokenized prompt). Runs in eval mode (the mode is restored after);
-- the recipes' state (SR generator, delayed-scaling histories, MoR: recipe:state()) is restored after it
-- too, so generating leaves training as it was and repeats under delayed scaling.
function Llama:generate(tok, prompt, opts)
  local fname = "Llama:generate"
  opts = check_opts(opts, {max_new_tokens = count_of, temperature = non_negative, top_k = positive_count,
    seed = count_of, prompt_ids = true}, fname)
  if type(tok) ~= "table" or type(tok.decode) ~= "function" or (not opts.prompt_ids and type(tok.encode) ~= "function")
  then
    user_error(fname .. ": tok must be a tokenizer with encode and decode (data.ByteTokenizer or " ..
      "nvlua.tokenizer.load(path)), got " .. (type(tok) == "table" and "a table without them" or type(tok)), 2)
  end
  if type(prompt) ~= "string" then user_error(fname .. ": the prompt must be a string, got " .. type(prompt), 2) end
  local ids = opts.prompt_ids or tok:encode(prompt)
  if type(ids) ~= "table" then user_error(fname .. ": prompt_ids must be a table of token ids", 2) end
  local V, mpe = self.config.vocab_size, self.config.max_position_embeddings
  if #ids == 0 then
    if not tok.bos_id then
      user_error(fname .. ": the prompt encodes to no tokens and the tokenizer has no bos token to start from", 2)
    end
    ids = {tok.bos_id}
  end
  for i, id in ipairs(ids) do
    if math.type(id) ~= "integer" or id < 0 or id >= V then
      user_error(string.format("%s: prompt token %d is %s, not an id of the model's vocabulary (0 .. %d)", fname, i,
        tostring(id), V - 1), 2)
    end
  end
  if #ids >= mpe then
    user_error(string.format("%s: the prompt is %d tokens; the context (max_position_embeddings) holds %d, with no room " ..
      "for a new token", fname, #ids, mpe), 2)
  end
  local n = opts.max_new_tokens or 64
  local gen = nv.Generator(opts.seed or 1)
  local was = self.training
  local restore = self:save_recipe_states()
  self:eval()
  local cache = self:kv_cache(math.min(mpe, #ids + n))
  local out, stop = {}, "max_new_tokens"
  local ok, err = pcall(recipes.weight_cache, function() -- each weight quantized once for the whole generation
    local step = ids
    while #out < n do
      if cache.len + #step > cache.capacity then stop = "context"; break end
      local id = nv.scope(function() -- one step: its tensors die with it
        local logits = self:forward(nv.tensor({step}, "i64"), {cache = cache})    -- (1, T, V)
        local last = logits:select(2, logits:size(2)):select(1, 1)                -- (V)
        return llama.pick_token((last:device() == "cpu" and last or last:cpu()):to("f32"):totable(), opts, gen)
      end)
      out[#out + 1] = id
      if id == tok.eos_id then stop = "eos"; break end
      step = {id}
    end
  end)
  cache:free()
  self:train(was)
  restore()
  if not ok then error(err, 0) end
  local text_ids = out
  if stop == "eos" then text_ids = {table.unpack(out, 1, #out - 1)} end
  return tok:decode(text_ids), out, stop
end

--- llama.loss_value(d) -> the mean loss a forward_backward{defer_loss = true} returned as d (read
-- back from the device now: the first read waits for the step's work)
function llama.loss_value(d)
  if type(d) ~= "table" or math.type(d.count) ~= "integer" then
    error("loss_value: expects what forward_backward{defer_loss = true} returned", 2)
  end
  local total = 0
  for _, t in ipairs(d) do
    total = total + string.unpack("<d", string.pack("<i8", t:cpu():totable()[1]))
  end
  return d.count > 0 and total / d.count or 0
end

--- model:forward_backward(ids, targets [, {ignore_index = -100, z_loss = 0, scale = 1, loss_chunk, distill}]) -> loss, count
-- loss: mean cross-entropy over the counted tokens (targets ~= ignore_index), z-loss included;
-- with distill = {teacher = an nn.Llama, temperature = 1, alpha = 0.5}: alpha * T^2 * KL(teacher ||
-- student at temperature T) + (1 - alpha) * cross-entropy, returned as a number (model.distill_parts
-- = {kl, ce}, the means), whatever defer_loss says;
-- every parameter gradient += scale * d(loss)/d(param). targets i64 [B, T], 0-based.
-- loss_chunk: tokens per chunk of the LM head and loss (default model.loss_chunk, else 2^27 /
-- vocab; 0: the whole batch at once); see _head_chunkable for when chunks apply. The loss is read
-- back after the backward is queued; defer_loss = true returns, instead of the loss, a plain table
-- d of device tensors for llama.loss_value(d) to read later (the training loop reads it after the
-- step's last micro-batch): no host synchronisation inside forward_backward.
function Llama:forward_backward(ids, targets, opts)
  opts = check_opts(opts, {ignore_index = true, z_loss = true, scale = true, loss_chunk = true, defer_loss = true,
    distill = true}, "Llama:forward_backward")
  check_ids(targets, "targets", "Llama:forward_backward")
  if not same_shape(ids:size(), targets:size()) then
    user_error(string.format("Llama:forward_backward: targets %s do not match ids %s", shape_str(targets), shape_str(ids)), 2)
  end
  if not self.training then error("Llama:forward_backward: the model is in eval mode (call model:train())", 2) end
  local N, V = ids:numel(), self.config.vocab_size
  local chunk = opts.loss_chunk or self.loss_chunk or math.max(1, recipes.LOSS_CHUNK_ELEMS // V)
  if math.type(chunk) ~= "integer" or chunk < 0 then
    error("Llama:forward_backward: loss_chunk must be a non-negative integer (0: one chunk), got " .. tostring(chunk), 2)
  end
  -- the loss stays on the logits' device until the backward is queued: no wait inside the step;
  -- one quantization of each weight for the forward and the backward (recipe.weight_cache; the
  -- training loop opens one around all the micro-batches of a step)
  local sums, count
  if opts.distill then
    if opts.z_loss and opts.z_loss ~= 0 then error("Llama:forward_backward: z_loss does not combine with distill", 2) end
    local d, n = recipes.weight_cache(nv.scope, self._distill, self, ids, targets, opts, chunk)
    self.distill_parts = {kl = d.kl, ce = d.ce} -- the last call's loss parts (the training log shows them)
    return d[1], n
  end
  if chunk > 0 and chunk < N and self:_head_chunkable() then
    sums, count = recipes.weight_cache(nv.scope, self._chunked_loss, self, ids, targets, opts, chunk)
  else
    sums, count = recipes.weight_cache(nv.scope, function()
      local sum, n, dlogits = nv.scope(function() -- the logits die here, their gradient lives on
        local logits = self:forward(ids)                       -- (N, V), f32 or bf16 (act_dtype)
        -- bf16 activations: dlogits rounded once to bf16 (NUMERICS §11), by the loss kernel itself on
        -- CUDA (no (N, V) f32 gradient: 4 bytes a logit less in memory, 8 less of traffic)
        local s, c, d = core.cross_entropy(logits, targets:reshape(targets:numel()), -- (N)
          {ignore_index = opts.ignore_index or -100, z_loss = opts.z_loss or 0, grad = true, scale = opts.scale or 1,
            defer = true, grad_dtype = logits:dtype()})
        return s, c, d
      end)                                                     -- dlogits (N, V)
      self:backward(dlogits)
      return {sum, count = n}, n
    end)
  end
  if opts.defer_loss then return sums, count end
  return nv.scope(function() nv.adopt(sums); return llama.loss_value(sums), count end)
end

--- model:loss(ids, targets [, {ignore_index =, z_loss =}]) -> loss, count, without gradients
-- (the model's training mode is left as it was; nothing is saved)
function Llama:loss(ids, targets, opts)
  opts = check_opts(opts, {ignore_index = true, z_loss = true}, "Llama:loss")
  local was = self.training
  self:eval()
  local ok, logits = pcall(self.forward, self, ids)          -- (N, V)
  self:train(was)
  if not ok then error(logits, 2) end
  return nv.scope(function()
    nv.adopt(logits)
    return core.cross_entropy(logits, targets:reshape(targets:numel()),
      {ignore_index = opts.ignore_index or -100, z_loss = opts.z_loss or 0, grad = false})
  end)
end

return llama
