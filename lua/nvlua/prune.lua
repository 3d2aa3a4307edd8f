-- nvlua.prune: structured pruning of a trained Llama, Minitron's way (Muralidharan et al. 2024,
-- "Compact Language Models via Pruning and Knowledge Distillation"; Sreenivas et al. 2024, "LLM
-- Pruning and Distillation in Practice: The Minitron Approach"): importance from activations on a
-- calibration batch, then a smaller nn.Llama with the most important units' weights copied in.
--
--   imp = prune.importance(model, batches)     -- ffn neurons, heads, KV groups, hidden channels, blocks
--   small = prune.width(model, imp, {ffn = 512, heads = 4, kv_heads = 2, hidden = 192})
--   small = prune.depth(model, imp, {layers = 3})
--   nv.hf.save_pretrained(small, dir)           -- a Hugging Face checkpoint of the new config
--
-- Importance (Minitron's activation-based estimators, aggregated over a calibration batch of B
-- sequences of T tokens: the mean over the sequence of |activation|, then the L2 norm over the batch):
--   ffn[i]     the SwiGLU output silu(gate) * up, i.e. down_proj's input, per neuron
--   heads[i]   per query head the L2 norm over head_dim of the attention output (o_proj's input)
--   kv[i]      per KV group the sum of its query heads' scores
--   hidden     per channel, summed over every RMSNorm output (each block's two and the final norm)
--   blocks     per block, 1 - the mean over tokens of cos(block input, block output) (ShortGPT's
--              block influence: a block that hardly changes the residual stream matters least)
-- The activations are read through recipe:trace under an f32 recipe (the model's own recipe is put
-- back afterwards), on the CPU.
-- Not here: training the pruned model (train.lua, distillation), saving (hf.lua).
local core = require "nvlua.core"
local recipe = require "nvlua.recipe"
local util = require "nvlua.util"

local M = {}

local function bad(fmt, ...) util.user_error(string.format("prune: " .. fmt, ...), 0) end

-- A score is usable for ranking when it is a finite number (a NaN breaks the sort's order).
local function is_tensor(t) return getmetatable(t) == core.Tensor end
local function finite(v) return type(v) == "number" and v == v and v > -math.huge and v < math.huge end

-- imp[field][b] for every block b of model (0-based), or imp[field] itself (per_block false): an f32
-- tensor of n finite scores -> its scores as a table; raises naming fname, the entry and what it holds.
local function scores(imp, field, b, n, what, fname)
  local t, name = imp[field], field
  if b ~= nil then
    if type(t) ~= "table" then
      bad("%s: importance.%s must be a table {[block] = scores}, got %s", fname, field, type(t))
    end
    t, name = t[b], string.format("%s[%d]", field, b)
  end
  if not is_tensor(t) or t:dim() ~= 1 or t:size(1) ~= n then
    bad("%s: importance.%s must be a 1-D tensor of %d scores (the model's %s), got %s", fname, name, n, what,
      is_tensor(t) and ("[" .. table.concat(t:size(), ",") .. "]") or type(t))
  end
  local v = t:totable()
  for i, x in ipairs(v) do
    if not finite(x) then bad("%s: importance.%s[%d] is %s, not a finite score", fname, name, i, tostring(x)) end
  end
  return v
end

-- imp checked against model for prune.width: {ffn, heads, kv = {[block] = tensor}, hidden = tensor},
-- as prune.importance returns it -> the scores as tables: {ffn = {[b] = {...}}, heads =, kv =, hidden =}.
local function width_scores(imp, c)
  if type(imp) ~= "table" then bad("width: imp must be the table prune.importance returns, got %s", type(imp)) end
  local out = {ffn = {}, heads = {}, kv = {}}
  out.hidden = scores(imp, "hidden", nil, c.hidden_size, "hidden_size", "width")
  for b = 0, c.num_hidden_layers - 1 do
    out.ffn[b] = scores(imp, "ffn", b, c.intermediate_size, "intermediate_size", "width")
    out.heads[b] = scores(imp, "heads", b, c.num_attention_heads, "num_attention_heads", "width")
    out.kv[b] = scores(imp, "kv", b, c.num_key_value_heads, "num_key_value_heads", "width")
  end
  return out
end

-- block index and linear kind ("q_proj", "down_proj", ...) of a linear's name
local function parse(name)
  local b, kind = tostring(name):match("^model%.layers%.(%d+)%.[%w_]+%.([%w_]+)$")
  return b and tonumber(b), kind
end

-- [B*T, K] activations -> [K]: per sequence the mean over its T tokens of |a|, then the L2 norm over
-- the B sequences
local function aggregate(a, B, T)
  local K = a:size(2)
  local m = a:abs():reshape(B, T, K):mean(2) -- [B, K]
  return (m * m):sum(1):sqrt()                -- [K]
end

-- acc[key] += v (tensors), v taken
local function add(acc, key, v)
  if acc[key] then acc[key] = core.unscope(acc[key] + v) else acc[key] = core.unscope(v:clone()) end
end

--- prune.importance(model, batches) -> imp = {ffn = {[block] = f32 [F]}, heads = {[block] = [Hq]},
-- kv = {[block] = [Hkv]}, hidden = [C], blocks = {[block] = score}} (blocks 0-based, as the parameter
-- names). batches: an i64 [B, T] tensor of token ids or a list of them; scores add over them.
function M.importance(model, batches)
  if type(model) ~= "table" or not model.config or not model.layers then bad("importance: expects an nn.Llama") end
  if type(batches) == "userdata" then batches = {batches} end
  if type(batches) ~= "table" or #batches == 0 then bad("importance: expects token ids [B, T] or a list of them") end
  if model.embed_tokens.weight_entry.param:device() ~= "cpu" then
    bad("importance: runs on the CPU; model:to(\"cpu\") first")
  end
  local c = model.config
  local Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
  local olds, was_training = {}, model.training
  for _, m in ipairs(model:modules()) do olds[m] = m.recipe end
  local acc = {}
  local rec = recipe.f32()
  rec:trace(function(e)
    if e.role ~= "fprop" then return end
    local a = e.a:device() == "cpu" and e.a or e.a:cpu()
    local b, kind = parse(e.ctx.name)
    local B, T = acc._B, acc._T
    core.scope(function()
      if kind == "down_proj" then add(acc, "ffn" .. b, aggregate(a, B, T))
      elseif kind == "o_proj" then
        local n = a:reshape(B * T, Hq, D)
        add(acc, "heads" .. b, aggregate((n * n):sum(3):sqrt(), B, T))
      elseif kind == "q_proj" or kind == "gate_proj" or e.ctx.name == "lm_head" then
        add(acc, "hidden", aggregate(a, B, T))
      end
    end)
  end)
  model:set_recipe(rec)
  model:eval()
  local ok, err = pcall(function()
    for _, ids in ipairs(batches) do
      if type(ids) ~= "userdata" or ids:dim() ~= 2 then bad("importance: every batch must be token ids [B, T]") end
      acc._B, acc._T = ids:size(1), ids:size(2)
      M._pass(model, ids, acc)
    end
  end)
  for m, r in pairs(olds) do m.recipe = r end
  model:train(was_training)
  if not ok then error(err, 0) end
  local imp = {ffn = {}, heads = {}, kv = {}, hidden = acc.hidden, blocks = {}}
  for i = 0, c.num_hidden_layers - 1 do
    imp.ffn[i], imp.heads[i], imp.blocks[i] = acc["ffn" .. i], acc["heads" .. i], acc["bi" .. i]
    local h, g = imp.heads[i]:totable(), {}
    for k = 1, Hkv do
      g[k] = 0
      for j = (k - 1) * (Hq // Hkv) + 1, k * (Hq // Hkv) do g[k] = g[k] + h[j] end
    end
    imp.kv[i] = core.unscope(core.tensor(g))
  end
  return imp
end

-- One forward of the model on ids, as Llama:forward runs it (the trace sees every linear's input),
-- and acc["bi" .. i] += 1 - the mean over the tokens of cos(x_in, x_out) of block i.
function M._pass(model, ids, acc)
  core.scope(function()
    local C = model.config.hidden_size
    local x = model.embed_tokens:forward(ids)
    for i = 1, model.layers.n do
      local y = model.layers[i]:forward(x)
      local a, b = x:to("f32"):reshape(-1, C), y:to("f32"):reshape(-1, C)
      local cos = (a * b):sum(2) / ((a * a):sum(2):sqrt() * (b * b):sum(2):sqrt())
      local key = "bi" .. (i - 1)
      acc[key] = (acc[key] or 0) + 1 - cos:mean()
      x = y
    end
    model.lm_head:forward(model.norm:forward(x:view(ids:numel(), C)))
  end)
end

-- ---- the smaller model -------------------------------------------------------------------------

-- the n indices (1-based, ascending) of the largest entries of score (a table); ties: the lower index
local function top(score, n)
  local idx = {}
  for i = 1, #score do idx[i] = i end
  table.sort(idx, function(a, b) if score[a] ~= score[b] then return score[a] > score[b] end return a < b end)
  local keep = {}
  for i = 1, n do keep[i] = idx[i] end
  table.sort(keep)
  return keep
end

-- dst's slices along dim d = src's slices at the indices rows (1-based) along d; every other dim copied
-- through the index list other (along the other dim of a 2-D weight) when given
local function gather(dst, src, d, rows, od, others)
  core.scope(function()
    local tmp = src
    if od and others then
      tmp = core.empty(od == 1 and {#others, src:size(2)} or {src:size(1), #others}, src:dtype())
      for j, i in ipairs(others) do tmp:narrow(od, j, 1):copy_(src:narrow(od, i, 1)) end
    end
    if d and rows then
      for j, i in ipairs(rows) do dst:narrow(d, j, 1):copy_(tmp:narrow(d, i, 1)) end
    else
      dst:copy_(tmp)
    end
  end)
end

local function params_of(model)
  local out = {}
  for _, e in ipairs(model:named_parameters()) do out[e.name] = e.param end
  return out
end

-- a copy of model's config with the changes in ch; head_dim kept explicitly
local function config_with(model, ch)
  local c = {}
  for k, v in pairs(model.config) do c[k] = v end
  c._checked = nil
  c.head_dim = model.config.head_dim
  for k, v in pairs(ch) do c[k] = v end
  return c
end

local function check_size(o, key, max, what)
  local v = o[key]
  if v == nil then return max end
  v = math.tointeger(v) or v -- 40.0 from a JSON reader is 40
  if math.type(v) ~= "integer" or v < 1 or v > max then
    bad("width: %s must be an integer in 1..%d (the model's %s), got %s", key, max, what, tostring(v))
  end
  return v
end

local function range_of(list, D) -- each index i in list -> D consecutive indices (i - 1) * D + 1 .. i * D
  local out = {}
  for _, i in ipairs(list) do for d = 1, D do out[#out + 1] = (i - 1) * D + d end end
  return out
end

--- prune.width(model, imp, {ffn =, heads =, kv_heads =, hidden =}) -> a new nn.Llama (f32, on the
-- CPU, no recipe) with the most important units of model (imp: prune.importance's) and their
-- weights: ffn neurons per block (gate/up rows, down columns); KV groups (the groups with the
-- largest kv score, their k/v rows) and, within each kept group, heads / kv_heads query heads (q
-- rows, o_proj columns; GQA stays consistent); hidden channels (the embedding's columns, every
-- norm's weight, every projection's input columns and output rows, the LM head's columns; a tied
-- LM head stays tied). Kept units keep their order. A size left out stays as it is. Pruning FFN
-- neurons, heads or KV groups gives exactly the original model with those units' output weights
-- zeroed (up to summation order); pruning hidden channels does not: RMSNorm then averages over fewer
-- channels (Minitron retrains after pruning for this and the rest).
function M.width(model, imp, o)
  local llama = require "nvlua.llama"
  o = o or {}
  for k in pairs(o) do
    if k ~= "ffn" and k ~= "heads" and k ~= "kv_heads" and k ~= "hidden" then
      bad("width: unknown option '%s' (valid: ffn, heads, kv_heads, hidden)%s", tostring(k),
        util.suggest(k, {"ffn", "heads", "kv_heads", "hidden"}))
    end
  end
  local c = model.config
  local Hq, Hkv, D, L = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_hidden_layers
  local F = check_size(o, "ffn", c.intermediate_size, "intermediate_size")
  local H = check_size(o, "heads", Hq, "num_attention_heads")
  local K = check_size(o, "kv_heads", Hkv, "num_key_value_heads")
  local C = check_size(o, "hidden", c.hidden_size, "hidden_size")
  if H % K ~= 0 then bad("width: heads (%d) must be a multiple of kv_heads (%d)", H, K) end
  if H // K > Hq // Hkv then
    bad("width: heads / kv_heads = %d query heads per KV group, more than the model's %d", H // K, Hq // Hkv)
  end
  local sc = width_scores(imp, c)
  local nc = config_with(model, {intermediate_size = F, num_attention_heads = H, num_key_value_heads = K, hidden_size = C})
  local small = llama.Llama(nc, {seed = 1})
  local src, dst = params_of(model), params_of(small)
  local hid = top(sc.hidden, C)
  local G = Hq // Hkv
  for b = 0, L - 1 do
    local p = "model.layers." .. b .. "."
    local groups = top(sc.kv[b], K)
    local heads, hs = {}, sc.heads[b]
    for _, g in ipairs(groups) do
      local within = {}
      for j = 1, G do within[j] = hs[(g - 1) * G + j] end
      for _, j in ipairs(top(within, H // K)) do heads[#heads + 1] = (g - 1) * G + j end
    end
    local qrows, kvrows = range_of(heads, D), range_of(groups, D)
    local ff = top(sc.ffn[b], F)
    gather(dst[p .. "self_attn.q_proj.weight"], src[p .. "self_attn.q_proj.weight"], 1, qrows, 2, hid)
    gather(dst[p .. "self_attn.k_proj.weight"], src[p .. "self_attn.k_proj.weight"], 1, kvrows, 2, hid)
    gather(dst[p .. "self_attn.v_proj.weight"], src[p .. "self_attn.v_proj.weight"], 1, kvrows, 2, hid)
    gather(dst[p .. "self_attn.o_proj.weight"], src[p .. "self_attn.o_proj.weight"], 1, hid, 2, qrows)
    gather(dst[p .. "mlp.gate_proj.weight"], src[p .. "mlp.gate_proj.weight"], 1, ff, 2, hid)
    gather(dst[p .. "mlp.up_proj.weight"], src[p .. "mlp.up_proj.weight"], 1, ff, 2, hid)
    gather(dst[p .. "mlp.down_proj.weight"], src[p .. "mlp.down_proj.weight"], 1, hid, 2, ff)
    gather(dst[p .. "input_layernorm.weight"], src[p .. "input_layernorm.weight"], 1, hid)
    gather(dst[p .. "post_attention_layernorm.weight"], src[p .. "post_attention_layernorm.weight"], 1, hid)
  end
  gather(dst["model.embed_tokens.weight"], src["model.embed_tokens.weight"], 2, hid)
  gather(dst["model.norm.weight"], src["model.norm.weight"], 1, hid)
  if dst["lm_head.weight"] then gather(dst["lm_head.weight"], src["lm_head.weight"], 2, hid) end
  return small
end

--- prune.depth(model, imp, {layers = n}) -> a new nn.Llama (f32, CPU, no recipe) of the n blocks with
-- the largest block-influence scores (imp.blocks), in their order, renumbered 0..n-1; embedding,
-- final norm and LM head as they are.
function M.depth(model, imp, o)
  local llama = require "nvlua.llama"
  o = o or {}
  for k in pairs(o) do
    if k ~= "layers" then bad("depth: unknown option '%s' (valid: layers)%s", tostring(k), util.suggest(k, {"layers"})) end
  end
  local L = model.config.num_hidden_layers
  local n = math.tointeger(o.layers) or o.layers
  if math.type(n) ~= "integer" or n < 1 or n > L then
    bad("depth: layers must be an integer in 1..%d (the model's blocks), got %s", L, tostring(n))
  end
  if type(imp) ~= "table" or type(imp.blocks) ~= "table" then
    bad("depth: imp must be the table prune.importance returns, with blocks = {[block] = score}, got %s",
      type(imp) == "table" and ("blocks = " .. tostring(imp.blocks)) or type(imp))
  end
  local score = {}
  for b = 0, L - 1 do
    local v = imp.blocks[b]
    if not finite(v) then
      bad("depth: importance.blocks[%d] must be a finite number (block %d's score), got %s", b, b, tostring(v))
    end
    score[b + 1] = v
  end
  local keep = top(score, n)
  local small = llama.Llama(config_with(model, {num_hidden_layers = n}), {seed = 1})
  local src, dst = params_of(model), params_of(small)
  for name, t in pairs(dst) do
    local b, rest = name:match("^model%.layers%.(%d+)%.(.+)$")
    local from = b and ("model.layers." .. (keep[tonumber(b) + 1] - 1) .. "." .. rest) or name
    t:copy_(src[from])
  end
  return small, keep
end

return M
