-- nvlua.checkpoint: checkpoints in the Hugging Face Llama layout plus the training state.
--
--   <run>/checkpoints/step-000100/
--     model.safetensors   parameters under HF names, f32, __metadata__ {"format": "pt"}
--     config.json         the HF LlamaConfig (all keys), so LlamaForCausalLM.from_pretrained loads it
--     trainer.safetensors AdamW moments (m.<name>, v.<name>)
--     trainer.json        step, optimizer step, data cursor, recipe state (SR generator, amax
--                         histories), default generator, the run config, the metrics so far
--
-- A checkpoint is written into step-N.partial/, each file atomically (util.atomic_write: temp,
-- fsync, rename), then the directory is renamed to step-N and its parent fsync'd: a directory
-- named step-N is always complete. Older ones beyond `keep` are removed. latest() picks the newest complete one.
local nv = require "nvlua"
local core = require "nvlua.core"
local lfs = require "lfs"
local cjson = require "cjson"
local st = require "nvlua.safetensors"
local data = require "nvlua.data"
local config = require "nvlua.config"
local util = require "nvlua.util"

local ckpt = {}

-- nn.llama_config keeps rope_scaling without its type (llama3 is the only one it computes); HF
-- and nn.llama_config both need "rope_type" to read it back.
local function rope_scaling(rs)
  if rs == nil then return cjson.null end
  local out = {rope_type = "llama3"}
  for k, v in pairs(rs) do out[k] = v end
  return out
end

--- The HF LlamaConfig of a model config (nn.llama_config's resolved table).
function ckpt.hf_config(c)
  return {
    architectures = {"LlamaForCausalLM"}, model_type = "llama",
    vocab_size = c.vocab_size, hidden_size = c.hidden_size, intermediate_size = c.intermediate_size,
    num_hidden_layers = c.num_hidden_layers, num_attention_heads = c.num_attention_heads,
    num_key_value_heads = c.num_key_value_heads, head_dim = c.head_dim, hidden_act = "silu",
    max_position_embeddings = c.max_position_embeddings, initializer_range = c.initializer_range or 0.02,
    rms_norm_eps = c.rms_norm_eps, rope_theta = c.rope_theta, rope_scaling = rope_scaling(c.rope_scaling),
    tie_word_embeddings = c.tie_word_embeddings, attention_bias = false, attention_dropout = 0.0,
    mlp_bias = false, pretraining_tp = 1, use_cache = true, torch_dtype = "float32",
    bos_token_id = cjson.null, eos_token_id = cjson.null,
  }
end

local function rm_rf(path)
  local a = lfs.attributes(path)
  if not a then return end
  if a.mode == "directory" then
    for n in lfs.dir(path) do
      if n ~= "." and n ~= ".." then rm_rf(path .. "/" .. n) end
    end
    lfs.rmdir(path)
  else
    os.remove(path)
  end
end
ckpt.rm_rf = rm_rf

-- JSON numbers are doubles: 64-bit integers (generator seeds, offsets) travel as strings.
local function int_to_text(v) return math.type(v) == "integer" and string.format("%d", v) or v end
local function text_to_int(v) return type(v) == "string" and math.tointeger(tonumber(v)) or math.tointeger(v) or v end

-- config.encode: numbers read back bit for bit (cjson keeps 14 digits); a non-finite number
-- (an amax pushed by a step that went NaN) is written as a string and mapped back on load.
local function write_json(path, t)
  local ok, err = util.atomic_write(path, config.encode(t) .. "\n")
  if not ok then error("checkpoint: " .. path .. ": " .. err, 3) end
end
local NONFINITE = {inf = math.huge, ["-inf"] = -math.huge, nan = 0 / 0, ["-nan"] = 0 / 0}
local function text_to_number(v) if type(v) == "string" then return NONFINITE[v] or tonumber(v) end return v end

local function read_json(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, s)
  if not ok then error("checkpoint: " .. path .. ": bad JSON: " .. tostring(v), 2) end
  return v
end

--- ckpt.save(run_dir, {model=, optimizer=, recipe=, loader=, step=, config=, metrics=, keep=3 (0: all)})
-- -> the checkpoint directory
function ckpt.save(run_dir, o)
  local root = run_dir .. "/checkpoints"
  data.mkdir_p(root)
  local name = string.format("step-%06d", o.step)
  local final, partial = root .. "/" .. name, root .. "/" .. name .. ".partial"
  rm_rf(partial)
  assert(lfs.mkdir(partial))
  local ok, err = st.save(partial .. "/model.safetensors", o.model:state_dict(), {})
  if not ok then error("checkpoint: " .. tostring(err), 2) end
  write_json(partial .. "/config.json", ckpt.hf_config(o.model.config))
  local trainer = {step = o.step, config = o.config, metrics = o.metrics}
  if o.optimizer then
    local s = o.optimizer:state()
    local tensors = {}
    for k, t in pairs(s.m) do tensors["m." .. k] = t end
    for k, t in pairs(s.v) do tensors["v." .. k] = t end
    ok, err = st.save(partial .. "/trainer.safetensors", tensors, {})
    if not ok then error("checkpoint: " .. tostring(err), 2) end
    trainer.optimizer_step = s.step
  end
  if o.recipe then
    local rs = o.recipe:state()
    rs.seed, rs.offset = int_to_text(rs.seed), int_to_text(rs.offset)
    trainer.recipe = rs
  end
  if o.loader then
    local ls = o.loader:state()
    trainer.loader = {cursor = int_to_text(ls.cursor), seed = int_to_text(ls.seed)}
  end
  local g = nv.default_generator()
  trainer.default_generator = {seed = int_to_text(g:seed()), offset = int_to_text(g:offset())}
  write_json(partial .. "/trainer.json", trainer)
  core.fsync(partial, true)
  rm_rf(final)
  local rok, rerr = os.rename(partial, final)
  if not rok then error("checkpoint: cannot rename " .. partial .. ": " .. tostring(rerr), 2) end
  core.fsync(root, true)
  -- keep the newest `keep` (0 or less: keep all)
  local keep = o.keep or 3
  if keep > 0 then
    local all = ckpt.list(run_dir)
    for i = 1, #all - keep do rm_rf(all[i]) end
  end
  return final
end

--- Complete checkpoints of a run, oldest first.
function ckpt.list(run_dir)
  local root = run_dir .. "/checkpoints"
  local out = {}
  if not lfs.attributes(root) then return out end
  for n in lfs.dir(root) do
    if n:match("^step%-%d+$") and lfs.attributes(root .. "/" .. n .. "/trainer.json") then out[#out + 1] = n end
  end
  -- by step number: "step-1000000" comes after "step-999999"
  table.sort(out, function(a, b) return tonumber(a:sub(6)) < tonumber(b:sub(6)) end)
  for i, n in ipairs(out) do out[i] = root .. "/" .. n end
  return out
end

--- The newest complete checkpoint of a run, or nil.
function ckpt.latest(run_dir)
  local all = ckpt.list(run_dir)
  return all[#all]
end

--- Read a checkpoint's HF config.json into llama.Llama config keys.
function ckpt.read_config(dir)
  local c, err = read_json(dir .. "/config.json")
  if not c then return nil, err end
  local keys = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "rope_scaling", "initializer_range",
    -- checked by nn.llama_config, so a model nvlua does not compute (another activation,
    -- biases) is refused instead of loaded wrong
    "model_type", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "pretraining_tp"}
  local out = {}
  for _, k in ipairs(keys) do
    local v = c[k]
    if v ~= nil and v ~= cjson.null then out[k] = math.tointeger(v) or v end
  end
  return out
end

--- ckpt.from_pretrained(dir [, {recipe =}]) -> a llama.Llama with the weights of dir (a Hugging
-- Face Llama directory with config.json and model.safetensors, or an nvlua checkpoint).
function ckpt.from_pretrained(dir, o)
  local llama = require "nvlua.llama"
  local c, err = ckpt.read_config(dir)
  if not c then error("from_pretrained: " .. tostring(err), 2) end
  local model = llama.Llama(c, {recipe = o and o.recipe})
  local tensors = st.load(dir .. "/model.safetensors")
  if not tensors then error("from_pretrained: no model.safetensors in " .. dir, 2) end
  model:load_state_dict(tensors)
  for _, t in pairs(tensors) do t:free() end
  return model
end

--- ckpt.load(dir, {model=, optimizer=, recipe=, loader=}) -> trainer table (step, metrics, ...)
-- Restores everything save() wrote, so training continues bit for bit.
function ckpt.load(dir, o)
  local trainer, err = read_json(dir .. "/trainer.json")
  if not trainer then error("checkpoint: " .. tostring(err), 2) end
  local tensors = st.load(dir .. "/model.safetensors")
  o.model:load_state_dict(tensors)
  for _, t in pairs(tensors) do t:free() end
  if o.optimizer then
    local ts = st.load(dir .. "/trainer.safetensors")
    local m, v = {}, {}
    for k, t in pairs(ts) do
      local which, name = k:match("^([mv])%.(.*)$")
      if which == "m" then m[name] = t elseif which == "v" then v[name] = t end
    end
    o.optimizer:load_state({step = math.tointeger(trainer.optimizer_step), m = m, v = v})
    for _, t in pairs(ts) do t:free() end
  end
  if o.recipe and trainer.recipe then
    trainer.recipe.seed, trainer.recipe.offset = text_to_int(trainer.recipe.seed), text_to_int(trainer.recipe.offset)
    for _, h in pairs(trainer.recipe.histories or {}) do
      for i, v in ipairs(h.values or {}) do h.values[i] = text_to_number(v) end
      h.last = text_to_number(h.last)
    end
    o.recipe:load_state(trainer.recipe)
  end
  if o.loader and trainer.loader then
    o.loader:load_state({cursor = text_to_int(trainer.loader.cursor), seed = text_to_int(trainer.loader.seed)})
  end
  if trainer.default_generator then
    local g = nv.default_generator()
    g:manual_seed(text_to_int(trainer.default_generator.seed))
    g:set_offset(text_to_int(trainer.default_generator.offset))
  end
  trainer.step = math.tointeger(trainer.step)
  return trainer
end

return ckpt
