-- nvlua.hf: Hugging Face Llama model directories — config.json (LlamaConfig) and the weights in
-- safetensors under Hugging Face's parameter names — read into an nvlua model and written from one.
--   local hf = require "nvlua.hf"
--   local model = hf.from_pretrained(dir [, {recipe =}])
--   hf.save_pretrained(model, dir)
-- Training checkpoints (checkpoint.lua) hold such a directory plus the training state.
local lfs = require "lfs"
local cjson = require "cjson"
local st = require "nvlua.safetensors"
local config = require "nvlua.config"
local util = require "nvlua.util"

local hf = {}

local function read_json(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, s or "")
  if not ok then error("hf: " .. path .. ": bad JSON: " .. tostring(v), 2) end
  return v
end

local function write_json(path, t)
  local ok, err = util.atomic_write(path, config.encode(t) .. "\n")
  if not ok then error("hf: " .. path .. ": " .. err, 0) end
end

-- nn.llama_config keeps rope_scaling without its type (llama3 is the only one it computes); HF
-- and nn.llama_config both need "rope_type" to read it back.
local function rope_scaling(rs)
  if rs == nil then return cjson.null end
  local out = {rope_type = "llama3"}
  for k, v in pairs(rs) do out[k] = v end
  return out
end

--- hf.config(c [, {bos_token_id =, eos_token_id =}]) -> the HF LlamaConfig of a model config
-- (nn.llama_config's resolved table).
function hf.config(c, o)
  o = o or {}
  return {
    architectures = {"LlamaForCausalLM"}, model_type = "llama",
    vocab_size = c.vocab_size, hidden_size = c.hidden_size, intermediate_size = c.intermediate_size,
    num_hidden_layers = c.num_hidden_layers, num_attention_heads = c.num_attention_heads,
    num_key_value_heads = c.num_key_value_heads, head_dim = c.head_dim, hidden_act = "silu",
    max_position_embeddings = c.max_position_embeddings, initializer_range = c.initializer_range or 0.02,
    rms_norm_eps = c.rms_norm_eps, rope_theta = c.rope_theta, rope_scaling = rope_scaling(c.rope_scaling),
    tie_word_embeddings = c.tie_word_embeddings, attention_bias = false, attention_dropout = 0.0,
    mlp_bias = false, pretraining_tp = 1, use_cache = true, torch_dtype = "float32",
    bos_token_id = o.bos_token_id or cjson.null, eos_token_id = o.eos_token_id or cjson.null,
  }
end

--- Read a checkpoint's HF config.json into llama.Llama config keys.
function hf.read_config(dir)
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

--- hf.from_pretrained(dir [, {recipe =}]) -> a llama.Llama with the weights of dir (a Hugging
-- Face Llama directory with config.json and model.safetensors, or an nvlua checkpoint: its model/).
function hf.from_pretrained(dir, o)
  if lfs.attributes(dir .. "/model/config.json") then dir = dir .. "/model" end
  local llama = require "nvlua.llama"
  local c, err = hf.read_config(dir)
  if not c then error("from_pretrained: " .. tostring(err), 2) end
  local model = llama.Llama(c, {recipe = o and o.recipe})
  local tensors = st.load(dir .. "/model.safetensors")
  if not tensors then error("from_pretrained: no model.safetensors in " .. dir, 2) end
  model:load_state_dict(tensors)
  for _, t in pairs(tensors) do t:free() end
  return model
end

--- hf.save_pretrained(model, dir [, {after_weights = fn}]) -> {file name = byte size}: the model's
-- weights (model.safetensors, f32, __metadata__ {"format": "pt"}) and config.json written into the
-- existing directory dir. after_weights() runs between the two (checkpoint.lua's fault point).
-- o.bos_token_id, o.eos_token_id: config.json's (null when absent).
function hf.save_pretrained(model, dir, o)
  o = o or {}
  if lfs.attributes(dir, "mode") ~= "directory" then error("save_pretrained: " .. tostring(dir) .. " is not a directory", 2) end
  local files = {}
  local wok, werr = st.save(dir .. "/model.safetensors", model:state_dict(), {})
  if not wok then error("save_pretrained: " .. dir .. "/model.safetensors: " .. tostring(werr), 0) end
  files["model.safetensors"] = lfs.attributes(dir .. "/model.safetensors", "size")
  if o.after_weights then o.after_weights() end
  write_json(dir .. "/config.json", hf.config(model.config, o))
  files["config.json"] = lfs.attributes(dir .. "/config.json", "size")
  return files
end

return hf
