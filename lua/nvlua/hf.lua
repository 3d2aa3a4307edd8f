-- nvlua.hf: Hugging Face Llama model directories — config.json (LlamaConfig) and the weights in
-- safetensors under Hugging Face's parameter names — read into an nvlua model and written from one.
--   local hf = require "nvlua.hf"
--   local model, info = hf.from_pretrained(dir [, {strict = true, dtype = "f32", recipe =, quantized = "dequantize"}])
--   hf.load_weights(model, dir [, {strict = true, dtype = "f32"}])   -- into a model built by the caller
--   hf.save_pretrained(model, dir [, {max_shard_size = "50GB", bos_token_id =, eos_token_id =}])
--   hf.save_pretrained(model, dir, {quantize = "nvfp4", ...})          -- for inference engines: nvlua.deploy
-- A quantized checkpoint (ModelOpt, compressed-tensors: nvlua.deploy_read) loads dequantized; what was
-- read stays beside it (model.quantized_source), so that a re-export writes the same bytes.
-- Training checkpoints (checkpoint.lua) hold such a directory plus the training state.
--
-- Reading follows transformers 4.x and 5.x (LlamaForCausalLM):
--   config.json  RoPE from rope_parameters (transformers 5) or the legacy rope_theta/rope_scaling
--                (4.x; "type" or "rope_type"), both forms agreeing where both are given; rope
--                types default, linear, dynamic and llama3 (nn.llama_config), others refused by
--                name. Keys that transformers' Llama does not read carry no arithmetic and are
--                ignored (listed in info.config_ignored); keys that ask for arithmetic nvlua does
--                not compute are refused (a hidden_act other than silu, biases, custom modeling
--                code: auto_map, pruned heads). quantization_config (and hf_quant_config.json) is
--                read by nvlua.deploy_read: ModelOpt and compressed-tensors NVFP4 / MXFP4 / FP8,
--                other quantization methods refused by name.
--   weights      model.safetensors, else model.safetensors.index.json and the shards it names
--                (transformers' order of preference); F32, BF16 and F16 (read as f32, exactly).
--                A quantized checkpoint's linear weights (U8 / F8_E4M3 codes, block and global
--                scales) are checked against its config and decoded to f32 as its library decodes
--                them (nvlua.deploy_read, which says how); its activation scales are checked and
--                ignored (they are missing or unexpected tensors where they contradict the scheme).
--                Known non-parameter buffers (rotary_emb.inv_freq, masked_bias) are ignored.
--                A tied model (tie_word_embeddings) that also stores lm_head.weight loads when it
--                equals model.embed_tokens.weight bit for bit after conversion, else it is refused.
--                A weight holding NaN or an infinity is refused, naming it (resume= refuses them too);
--                so are a non-finite rms_norm_eps or rope_theta in config.json (nn.llama_config).
--                pytorch_model.bin is not read (it is a pickle): the error says how to convert it.
-- Writing follows transformers 5's save_pretrained: config.json with rope_parameters and, for
-- transformers 4.x, the same RoPE as rope_theta/rope_scaling; the weights (f32) in one
-- model.safetensors, or, past max_shard_size, in model-0000k-of-0000N.safetensors plus
-- model.safetensors.index.json, split as huggingface_hub's split_torch_state_dict_into_shards
-- splits them (Hugging Face's parameter order, a tensor larger than the limit in a shard of its
-- own). Each file is written atomically; a directory as a whole is not (checkpoint.lua writes into
-- a fresh one). Not written: generation_config.json (transformers derives it from config.json).
local lfs = require "lfs"
local cjson = require "cjson"
local core = require "nvlua.core"
local st = require "nvlua.safetensors"
local dr = require "nvlua.deploy_read"
local nn = require "nvlua.nn"
local util = require "nvlua.util"
local user_error = util.user_error

local hf = {}

local function is_file(path) return lfs.attributes(path, "mode") == "file" end
local function is_dir(path) return lfs.attributes(path, "mode") == "directory" end

-- ---- JSON -----------------------------------------------------------------------------------------

local function read_json(path, fname)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, s or "")
  if not ok then user_error(string.format("%s: %s: bad JSON: %s", fname, path, tostring(v)), 0) end
  if type(v) ~= "table" or v == cjson.null or (next(v) ~= nil and #v > 0) then
    user_error(string.format("%s: %s: expected a JSON object", fname, path), 0)
  end
  return v
end

-- A float as Python's repr (json.dumps) writes it: the shortest digits that read back, fixed
-- notation for exponents -4 .. 15 (with ".0" when integral), else d.ddde+XX.
local function py_float(x)
  if x ~= x or x == math.huge or x == -math.huge then
    error("hf: cannot write the non-finite number " .. x .. " in JSON", 0)
  end
  if x == 0 then return 1 / x < 0 and "-0.0" or "0.0" end
  local s
  for p = 0, 16 do
    s = string.format("%." .. p .. "e", x)
    if tonumber(s) == x then break end
  end
  local sign, d1, rest, e = s:match("^(-?)(%d)%.?(%d*)e([-+]%d+)$")
  local digits = (d1 .. rest):gsub("0+$", "")
  e = tonumber(e)
  if e < -4 or e >= 16 then
    local m = #digits > 1 and digits:sub(1, 1) .. "." .. digits:sub(2) or digits
    return string.format("%s%se%s%02d", sign, m, e < 0 and "-" or "+", math.abs(e))
  end
  if e < 0 then return sign .. "0." .. string.rep("0", -e - 1) .. digits end
  if #digits <= e + 1 then return sign .. digits .. string.rep("0", e + 1 - #digits) .. ".0" end
  return sign .. digits:sub(1, e + 1) .. "." .. digits:sub(e + 2)
end

-- JSON text of v: keys sorted; floats as Python writes them (8.0, 1e-05), integers as integers;
-- indent: nil for one line (no spaces), else json.dumps(indent = 2) layout.
local function encode(v, indent, level)
  level = level or 0
  if v == nil or v == cjson.null then return "null" end
  local t = type(v)
  if t == "boolean" then return tostring(v) end
  if t == "number" then return math.type(v) == "integer" and string.format("%d", v) or py_float(v) end
  if t == "string" then return (cjson.encode(v):gsub("\\/", "/")) end
  if t ~= "table" then error("hf: cannot write a " .. t .. " in JSON", 0) end
  local keys, n = {}, #v
  for k in pairs(v) do keys[#keys + 1] = k end
  local items = {}
  if n > 0 and #keys == n then
    for i = 1, n do items[i] = encode(v[i], indent, level + 1) end
  else
    table.sort(keys)
    local sep = indent and ": " or ":"
    for i, k in ipairs(keys) do items[i] = cjson.encode(k) .. sep .. encode(v[k], indent, level + 1) end
  end
  local open, close = (n > 0 and #keys == n) and "[" or "{", (n > 0 and #keys == n) and "]" or "}"
  if #items == 0 then return open .. close end
  if not indent then return open .. table.concat(items, ",") .. close end
  local pad, inner = string.rep(" ", indent * level), string.rep(" ", indent * (level + 1))
  return open .. "\n" .. inner .. table.concat(items, ",\n" .. inner) .. "\n" .. pad .. close
end

local function write_json(path, t, indent, fname) -- -> the bytes written
  local ok, err = util.atomic_write(path, encode(t, indent) .. "\n")
  if not ok then user_error(fname .. ": " .. path .. ": " .. err, 0) end
  return err
end

-- ---- config.json ----------------------------------------------------------------------------------

-- config.json keys that ask for arithmetic nvlua does not compute (the reason, given the value),
-- beyond what nn.llama_config checks (hidden_act, biases, model_type, rope types, ...)
local REFUSED = {
  auto_map = function() return "it names custom modeling code, not transformers' LlamaForCausalLM" end,
  pruned_heads = function(v) return next(v) and "pruned attention heads are not supported" or nil end,
}

-- JSON null -> nil, integral floats -> integers (ints), recursively
local function plain(v, ints)
  if v == cjson.null then return nil end
  if type(v) == "number" and ints then return math.tointeger(v) or v end
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = plain(x, ints) end
  return out
end
local INT_KEYS = {bos_token_id = true, eos_token_id = true, pad_token_id = true}

--- hf.read_config(dir) -> config, info | nil, msg (no readable config.json): the keys of dir's
-- config.json that nn.llama_config takes (not yet checked: llama.Llama checks them), and
-- info.config_ignored, the sorted names of the keys that carry no arithmetic for a Llama, and
-- info.quantization_config, the config's quantization_config as decoded (nil if none; read by
-- nvlua.deploy_read). A key that asks for arithmetic nvlua does not compute raises.
function hf.read_config(dir)
  if type(dir) ~= "string" then error("read_config: dir must be a string (a model directory), got " .. type(dir), 2) end
  if is_file(dir .. "/model/config.json") then dir = dir .. "/model" end -- an nvlua checkpoint: its model/
  local c, err = read_json(dir .. "/config.json", "read_config")
  if not c then return nil, err end
  local out, ignored, qc = {}, {}, nil
  for k, v in pairs(c) do
    local why = REFUSED[k] and v ~= cjson.null and REFUSED[k](v)
    if why then user_error(string.format("read_config: %s/config.json: %s: %s", dir, k, why), 0) end
    if k == "quantization_config" then
      if v ~= cjson.null then qc = v end
    elseif nn.llama_config_key(k) then
      out[k] = plain(v, INT_KEYS[k])
    elseif v ~= cjson.null then
      ignored[#ignored + 1] = k
    end
  end
  table.sort(ignored)
  return out, {config_ignored = ignored, quantization_config = qc}
end

-- x written as a float (8.0, not 8): the keys transformers writes as floats
local function float(x) return x and x + 0.0 end

--- hf.config(c [, {bos_token_id =, eos_token_id =}]) -> the Hugging Face LlamaConfig of a model
-- config (nn.llama_config's resolved table) as transformers 5 writes it, plus rope_theta and
-- rope_scaling for transformers 4.x (which reads those and not rope_parameters). Token ids: the
-- options', else the config's, else null.
function hf.config(c, o)
  o = o or {}
  local rp, legacy = {rope_theta = float(c.rope_theta), rope_type = "default"}, cjson.null
  local rs = c.rope_scaling
  if rs then
    rp.rope_type, legacy = rs.rope_type, {rope_type = rs.rope_type}
    for k, v in pairs(rs) do
      if k ~= "rope_type" then
        v = k == "original_max_position_embeddings" and math.tointeger(v) or float(v)
        rp[k], legacy[k] = v, v
      end
    end
  end
  local function id(k)
    local v = o[k]
    if v == nil then v = c[k] end
    return v == nil and cjson.null or v
  end
  return {
    architectures = {"LlamaForCausalLM"}, model_type = "llama",
    vocab_size = c.vocab_size, hidden_size = c.hidden_size, intermediate_size = c.intermediate_size,
    num_hidden_layers = c.num_hidden_layers, num_attention_heads = c.num_attention_heads,
    num_key_value_heads = c.num_key_value_heads, head_dim = c.head_dim, hidden_act = "silu",
    max_position_embeddings = c.max_position_embeddings, initializer_range = float(c.initializer_range or 0.02),
    rms_norm_eps = float(c.rms_norm_eps), rope_parameters = rp, rope_theta = float(c.rope_theta),
    rope_scaling = legacy, tie_word_embeddings = c.tie_word_embeddings, attention_bias = false,
    attention_dropout = 0.0, mlp_bias = false, pretraining_tp = 1, use_cache = true, dtype = "float32",
    torch_dtype = "float32", bos_token_id = id("bos_token_id"), eos_token_id = id("eos_token_id"),
    pad_token_id = id("pad_token_id"),
  }
end

-- ---- reading the weights --------------------------------------------------------------------------

local SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
local OTHER_FORMATS = {"pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack"}

-- Tensors transformers saved (older versions) that are buffers, not parameters: ignored.
local BUFFERS = {"%.rotary_emb%.inv_freq$", "%.rotary_emb%.original_inv_freq$", "%.masked_bias$"}
local function is_buffer(name)
  for _, p in ipairs(BUFFERS) do if name:find(p) then return true end end
  return false
end

-- who: the public function reading (from_pretrained, load_weights), which the messages name
local function fail(who, dir, fmt, ...) user_error(string.format("%s: %s: " .. fmt, who, dir, ...), 0) end

-- an error raised by another function, without its position
local function strip_position(err) return (tostring(err):gsub("^[^\n]-%.lua:%d+: ", "")) end

local function no_weights(who, dir)
  for _, n in ipairs(OTHER_FORMATS) do
    if is_file(dir .. "/" .. n) then
      fail(who, dir, "has %s but no %s or %s: nvlua reads safetensors only (a .bin is a pickle, which runs code when " ..
        "loaded). Convert it once with transformers (>= 4.35 writes safetensors), if you trust the file:\n" ..
        "  python3 -c \"import sys, transformers as t; t.AutoModelForCausalLM.from_pretrained(sys.argv[1])" ..
        ".save_pretrained(sys.argv[1])\" %s", n, SINGLE, INDEX, dir)
    end
  end
  user_error(string.format("%s: no %s in %s, nor %s (not a Hugging Face model directory with safetensors " ..
    "weights)", who, SINGLE, dir, INDEX), 0)
end

-- The shards of an index: {files = {name, ...} (sorted), map = {tensor = file}}.
local function read_index(who, dir)
  local idx = read_json(dir .. "/" .. INDEX, who)
  if not idx then fail(who, dir, "%s cannot be read", INDEX) end
  local wm = idx.weight_map
  if type(wm) ~= "table" or wm == cjson.null or (next(wm) ~= nil and #wm > 0) then
    fail(who, dir, "%s: weight_map must be an object {tensor name = shard file}", INDEX)
  end
  local files, seen = {}, {}
  for name, file in pairs(wm) do
    if type(file) ~= "string" or file == "" or file:find("/", 1, true) or file == "." or file == ".." then
      fail(who, dir, "%s: weight_map[%q] must be a file name in the directory, got %s", INDEX, name, tostring(file))
    end
    if not seen[file] then
      if not is_file(dir .. "/" .. file) then
        fail(who, dir, "%s names the shard %s (for %s), which is missing", INDEX, file, name)
      end
      seen[file] = true
      files[#files + 1] = file
    end
  end
  if #files == 0 then fail(who, dir, "%s: weight_map is empty", INDEX) end
  table.sort(files)
  return {files = files, map = wm}
end

-- Every tensor of the weights: {name = {file =, dtype =, shape =}}, and the files in order.
local function scan_weights(who, dir)
  local files, map
  if is_file(dir .. "/" .. SINGLE) then
    files = {SINGLE}
  elseif is_file(dir .. "/" .. INDEX) then
    local idx = read_index(who, dir)
    files, map = idx.files, idx.map
  else
    no_weights(who, dir)
  end
  local tensors = {}
  for _, file in ipairs(files) do
    local header, err = st.read_header(dir .. "/" .. file, {f16 = "f32", f8 = "u8"})
    if not header then fail(who, dir, "%s", tostring(err)) end
    for name, h in pairs(header) do
      if map and map[name] ~= file then
        fail(who, dir, "%s holds %s, which %s %s", file, name, INDEX,
          map[name] and ("puts in " .. map[name]) or "does not list")
      end
      tensors[name] = {file = file, dtype = h.dtype, shape = h.shape}
    end
  end
  for name, file in pairs(map or {}) do
    if not tensors[name] then fail(who, dir, "%s puts %s in %s, which has no such tensor", INDEX, name, file) end
  end
  return tensors, files
end

local function list(names, max)
  max = max or 12
  if #names <= max then return table.concat(names, ", ") end
  return table.concat(names, ", ", 1, max) .. string.format(", ... (%d in all)", #names)
end

local FLOATS = {F32 = true, BF16 = true, F16 = true}

-- The model's parameters as {name =, shape = the whole parameter's shape}: under shard=grads|full
-- (nvlua.shard) a parameter is this rank's rows, its whole shape the shards' record, and the model's
-- load_state_dict takes whole tensors.
local function whole_params(model)
  local out = {}
  if model.shards then
    for i, p in ipairs(model.shards.params) do out[i] = {name = p.name, shape = p.shape} end
  else
    for i, e in ipairs(model:named_parameters()) do out[i] = {name = e.name, shape = e.param:size()} end
  end
  return out
end

-- The linear layers' weights (Hugging Face Llama names): the modules a checkpoint may quantize.
local function linear_module(name)
  return (name:match("^(.+_proj)%.weight$") or name:match("^(lm_head)%.weight$"))
end

-- A quantized checkpoint's linear weight e {name, shape}, module its module: which tensors it is
-- decoded from (p.quant[module] = {spec, parts, N, K}, p.part_of[tensor] = module), its activation
-- scales ignored, missing or unexpected (deploy_read.check_layer); consumed[tensor] = true for each.
local function plan_quantized(who, dir, scheme, spec, e, module, tensors, p, consumed)
  local any = false
  for name in pairs(tensors) do
    if name:sub(1, #module + 1) == module .. "." then any = true; break end
  end
  if not any then p.missing[#p.missing + 1] = e.name; return end
  local function failer(fmt, ...) fail(who, dir, fmt, ...) end
  local r = dr.check_layer(failer, scheme, spec, module, e.shape, tensors)
  p.quant[module] = {spec = spec, parts = r.parts, N = e.shape[1], K = e.shape[2], name = e.name}
  for _, name in pairs(r.parts) do p.part_of[name], consumed[name] = module, true end
  for _, name in ipairs(r.inputs) do p.ignored[#p.ignored + 1], consumed[name], p.input_of[name] = name, true, module end
  for _, name in ipairs(r.missing) do p.missing[#p.missing + 1] = name end
end

-- What each stored tensor is to the model: {load = {name = true}, missing, unexpected, ignored
-- (sorted lists), tied_head = the stored lm_head.weight of a tied model, or nil; quant, part_of:
-- the quantized weights of a quantized checkpoint (scheme, nvlua.deploy_read), see plan_quantized}.
local function plan(who, dir, model, tensors, scheme)
  local params, p = {}, {load = {}, missing = {}, unexpected = {}, ignored = {}, quant = {}, part_of = {}, input_of = {}}
  local consumed = {}
  for _, e in ipairs(whole_params(model)) do
    params[e.name] = true
    local t = tensors[e.name]
    local module = scheme and linear_module(e.name)
    local spec = module and scheme.layer(module)
    if module and not spec then dr.check_excluded(function(fmt, ...) fail(who, dir, fmt, ...) end, scheme, module, tensors) end
    if spec then
      plan_quantized(who, dir, scheme, spec, e, module, tensors, p, consumed)
    elseif not t then
      p.missing[#p.missing + 1] = e.name
    else
      if not FLOATS[t.dtype] then
        fail(who, dir, "%s is %s in %s; parameters must be F32, BF16 or F16", e.name, t.dtype, t.file)
      end
      if not util.same_shape(t.shape, e.shape) then
        fail(who, dir, "%s has shape [%s] in %s, the model's is %s", e.name, table.concat(t.shape, ","), t.file,
          util.shape_str(e.shape))
      end
      p.load[e.name] = true
    end
  end
  local tied = model.config.tie_word_embeddings
  for name, t in pairs(tensors) do
    if params[name] or consumed[name] then -- loaded, or a quantized weight's part or activation scale
    elseif is_buffer(name) then
      p.ignored[#p.ignored + 1] = name
    elseif scheme and scheme.kv_cache and name:find("%.[kv]_scale$") then -- the engine's KV cache's scales
      p.ignored[#p.ignored + 1] = name
    elseif tied and name == "lm_head.weight" and p.load["model.embed_tokens.weight"] then
      local emb = tensors["model.embed_tokens.weight"]
      if not FLOATS[t.dtype] or not util.same_shape(t.shape, emb.shape) then
        fail(who, dir, "lm_head.weight (%s [%s]) of a tied model does not match model.embed_tokens.weight (%s [%s])",
          t.dtype, table.concat(t.shape, ","), emb.dtype, table.concat(emb.shape, ","))
      end
      p.tied_head = name
      p.ignored[#p.ignored + 1] = name
    else
      p.unexpected[#p.unexpected + 1] = name
    end
  end
  table.sort(p.missing); table.sort(p.unexpected); table.sort(p.ignored)
  return p
end

local function converted(t, dtype)
  if dtype ~= "bf16" or t:dtype() == "bf16" then return t end
  local b = t:to("bf16")
  t:free()
  return b
end

-- The bytes of a tensor as f32 (after the dtype option's rounding), for the tied comparison.
local function f32_bytes(t)
  if t:dtype() == "f32" then return t:bytes() end
  local f = t:to("f32")
  local b = f:bytes()
  f:free()
  return b
end

-- Refuse a weight holding NaN or an infinity (a diverged or damaged model, which would train or
-- evaluate as garbage without a word): one reduction per tensor (core.sumsq, summed in double: no
-- finite f32 or bf16 value overflows it), a pass over the weights as they are loaded.
local function check_finite(who, dir, file, name, t)
  local ss = core.sumsq(t)
  if ss ~= ss or ss == math.huge then
    return string.format("%s: %s: %s: tensor %s holds %s values; the weights are damaged or come " ..
      "from a diverged run", who, dir, file, name, ss ~= ss and "NaN" or "infinite")
  end
end

-- the one value of a scalar tensor ([] or [1]), as a number
local function scalar_value(t) return core.scope(function() return t:to("f32"):reshape(1):get(1) end) end

-- What a re-export (nvlua.deploy) needs of quantized weight q's parts: {kind, codes, scales (u8 tensors
-- taken from parts, unscoped), global (the f32 value: NVFP4's global scale, FP8's weight_scale),
-- global_enc (true: compressed-tensors' encode scale, which decoding divides by)}; nil for a layout no
-- export writes (FP8 with a scale per row).
local function kept_parts(q, parts)
  local spec = q.spec
  if spec.kind == "fp8" and spec.fp8 == "channel" then return nil end
  local k = {kind = spec.kind, codes = core.unscope(parts[q.parts.codes])}
  if spec.kind == "fp8" then
    k.global = scalar_value(parts[q.parts.scale])
  else
    k.scales = core.unscope(parts[q.parts.scale])
    if q.parts.global then k.global, k.global_enc = scalar_value(parts[q.parts.global]), spec.divide == true end
  end
  return k
end

-- The quantized weights whose parts have all been read (parts: tensor name -> tensor, the parts
-- read so far), decoded (nvlua.deploy_read) into sub (module's weight name -> f32 or bf16 tensor);
-- their parts freed but, with keep, the codes and block scales (q.kept: kept_parts). A weight
-- decoding to a non-finite value raises, naming its tensors.
local function decode_ready(who, dir, p, parts, sub, dtype, exact, keep)
  for module, q in pairs(p.quant) do
    local ready = not q.done
    for _, name in pairs(q.parts) do ready = ready and parts[name] ~= nil end
    if ready then
      q.done = true
      local ok, w = pcall(dr.decode, function(fmt, ...) fail(who, dir, fmt, ...) end, q.spec, q.parts, parts, q.N, q.K,
        exact)
      q.kept = ok and keep and kept_parts(q, parts) or nil
      for _, name in pairs(q.parts) do
        local t = parts[name]
        if not (q.kept and (t == q.kept.codes or t == q.kept.scales)) then t:free() end
        parts[name] = nil
      end
      if not ok then error(w, 0) end
      local ss = core.sumsq(w)
      if ss ~= ss or ss == math.huge then
        w:free()
        local names = {}
        for _, name in pairs(q.parts) do names[#names + 1] = name end
        table.sort(names)
        fail(who, dir, "%s decodes to %s values (from %s): the checkpoint is damaged", q.name,
          ss ~= ss and "NaN" or "infinite", table.concat(names, ", "))
      end
      sub[q.name] = converted(w, dtype)
    end
  end
end

-- Copy the planned tensors of every file into the model, one file at a time; every tensor loaded
-- is checked to be finite first (nothing is copied from a file that holds a non-finite one). The
-- parts of a quantized weight are kept until the last of them is read, then decoded; with keep, the
-- activation scales' values are kept too (p.quant[module].input, input_enc).
local function load_files(who, dir, model, files, p, dtype, exact, keep)
  local head_bytes
  local parts = {}
  for _, file in ipairs(files) do
    local ts, err = st.load(dir .. "/" .. file, {f16 = "f32", f8 = "u8"})
    if not ts then fail(who, dir, "%s", tostring(err)) end
    local names = {}
    for name in pairs(ts) do if p.load[name] or name == p.tied_head then names[#names + 1] = name end end
    table.sort(names)
    for _, name in ipairs(names) do
      local bad = check_finite(who, dir, file, name, ts[name])
      if bad then
        for _, t in pairs(ts) do t:free() end
        user_error(bad, 0)
      end
    end
    local sub = {}
    for name, t in pairs(ts) do
      if p.load[name] then
        sub[name] = converted(t, dtype)
      elseif p.part_of[name] then
        parts[name] = t
      elseif keep and p.input_of[name] then
        local q = p.quant[p.input_of[name]]
        q.input, q.input_enc = scalar_value(t), name:find("%.input_global_scale$") ~= nil
        t:free()
      elseif name == p.tied_head then
        local c = converted(t, dtype)
        head_bytes = f32_bytes(c)
        c:free()
      else
        t:free()
      end
    end
    local dok, derr = pcall(decode_ready, who, dir, p, parts, sub, dtype, exact, keep)
    if not dok then
      for _, t in pairs(sub) do t:free() end
      for _, t in pairs(parts) do t:free() end
      error(derr, 0)
    end
    local ok, lerr = pcall(model.load_state_dict, model, sub, {strict = false})
    for _, t in pairs(sub) do t:free() end
    if not ok then fail(who, dir, "%s: %s", file, strip_position(lerr)) end
  end
  if head_bytes and head_bytes ~= model:state_dict()["model.embed_tokens.weight"]:bytes() then
    fail(who, dir, "lm_head.weight differs from model.embed_tokens.weight, but tie_word_embeddings is true (the model " ..
      "would compute with the embedding; set tie_word_embeddings to false in config.json to load both)")
  end
end

local DTYPES = {f32 = true, bf16 = true}

-- from_pretrained's recipe option: a recipe value or a registered recipe's name (nn.check_recipe)
local function is_recipe(v)
  local recipe = require "nvlua.recipe"
  local names = recipe.names()
  if type(v) == "string" then
    for _, n in ipairs(names) do if n == v then return nil end end
  elseif type(v) == "table" and type(v.linear_forward) == "function" and type(v.linear_backward) == "function" then
    return nil
  end
  return "must be a recipe value or the name of one (" .. table.concat(names, ", ") .. ")"
end

local function check_strict(v) return type(v) ~= "boolean" and "must be true or false" or nil end
local function check_dtype(v) return not DTYPES[v] and "must be \"f32\" or \"bf16\"" or nil end

-- dir checked to be a directory (who names the caller) -> the model directory: dir, or an nvlua
-- checkpoint's model/
local function model_dir(who, dir)
  if type(dir) ~= "string" then error(who .. ": dir must be a string (a model directory), got " .. type(dir), 3) end
  local mode = lfs.attributes(dir, "mode")
  if not mode then fail(who, dir, "no such directory") end
  if mode ~= "directory" then fail(who, dir, "not a directory (a %s)", mode) end
  if is_file(dir .. "/model/config.json") then dir = dir .. "/model" end -- an nvlua checkpoint: its model/
  return dir
end

-- whether a tensor name is a linear's activation scale (a quantized checkpoint's)
local function activation_scale(name) return name:find("%.input_scale$") or name:find("%.input_global_scale$") end

-- the quantization of dir (nvlua.deploy_read's scheme, nil for a plain checkpoint); qc: config.json's
-- quantization_config, or false to read it from dir's config.json
local function quant_scheme(who, dir, qc)
  if qc == false then
    local c = is_file(dir .. "/config.json") and read_json(dir .. "/config.json", who) or {}
    qc = c.quantization_config
  end
  return dr.scheme(who, dir, qc, read_json)
end

-- info.quantization of a quantized checkpoint: {method, algo, source, quantized = {modules},
-- excluded = {linear modules left unquantized}} (sorted)
local function quant_info(scheme, model, p)
  local q, ex = {}, {}
  for module in pairs(p.quant) do q[#q + 1] = module end
  for _, e in ipairs(whole_params(model)) do
    local module = linear_module(e.name)
    if module and not p.quant[module] then ex[#ex + 1] = module end
  end
  table.sort(q); table.sort(ex)
  return {method = scheme.method, algo = scheme.algo, source = scheme.source, quantized = q, excluded = ex}
end

-- model.quantized_source after loading a quantized checkpoint (nil otherwise, and for a sharded model,
-- which nvlua.deploy does not export): {method, algo, label, quantized = {module = true} (every linear
-- the checkpoint quantizes), layers = {module = kept_parts's record plus input (the activation scale's
-- value, nil if none), input_enc (compressed-tensors' input_global_scale: an encode scale) and
-- fingerprint (deploy_read.fingerprint of the weight as loaded)}}: what nvlua.deploy writes again for
-- an unchanged weight.
local function quantized_source(scheme, model, p)
  if not scheme or model.shards then return nil end
  local params = {}
  for _, e in ipairs(model:named_parameters()) do params[e.name] = e.param end
  local src = {method = scheme.method, algo = scheme.algo, label = scheme.method .. " " .. scheme.algo, quantized = {},
    layers = {}}
  for module, q in pairs(p.quant) do
    src.quantized[module] = true
    if q.kept then
      q.kept.input, q.kept.input_enc, q.kept.fingerprint = q.input, q.input_enc, dr.fingerprint(params[q.name])
      src.layers[module] = q.kept
    end
  end
  return src
end

-- the weights of dir (scan_weights's tensors and files; scheme: its quantization or nil) into model
-- (checked by the caller) -> info {missing, unexpected, ignored [, quantization]}; sets
-- model.quantized_source (see quantized_source)
local function load_weights(who, dir, tensors, files, model, strict, dtype, scheme, decode)
  local p = plan(who, dir, model, tensors, scheme)
  if strict ~= false and (#p.missing > 0 or #p.unexpected > 0) then
    local parts = {}
    if #p.missing > 0 then parts[#parts + 1] = "missing: " .. list(p.missing) end
    if #p.unexpected > 0 then parts[#parts + 1] = "unexpected: " .. list(p.unexpected) end
    local act = false
    for _, l in ipairs({p.missing, p.unexpected}) do
      for _, n in ipairs(l) do act = act or activation_scale(n) end
    end
    fail(who, dir, "the weights do not match the model (%s)%s; {strict = false} loads the rest and returns the lists",
      table.concat(parts, "; "), act and string.format(" (activation scales: %s's scheme has them exactly where it " ..
      "quantizes activations with a static scale; engines refuse the checkpoint otherwise)", scheme.source) or "")
  end
  model.quantized_source = nil
  load_files(who, dir, model, files, p, dtype or "f32", decode == "exact", scheme ~= nil and not model.shards)
  model.quantized_source = quantized_source(scheme, model, p)
  return {missing = p.missing, unexpected = p.unexpected, ignored = p.ignored,
    quantization = scheme and quant_info(scheme, model, p) or nil}
end

local function check_quantized(v)
  if v == "dequantize" then return nil end
  if v == "keep" then
    return "\"keep\" (the weights as QTensors for the forward) is not supported yet: the layers quantize their " ..
      "f32 weights through the recipe and take no given codes and scales; use \"dequantize\" (the default)"
  end
  return "must be \"dequantize\""
end
local function check_decode(v) return v ~= "library" and v ~= "exact" and "must be \"library\" or \"exact\"" or nil end

--- hf.from_pretrained(dir [, {strict = true, dtype = "f32" | "bf16", recipe =, quantized = "dequantize",
-- decode = "library"}]) -> model, info: a llama.Llama with the weights of dir (a Hugging Face Llama
-- directory, or an nvlua checkpoint), computing with recipe (a recipe value or a registered recipe's
-- name; default f32). A quantized checkpoint (ModelOpt or compressed-tensors NVFP4, MXFP4, FP8:
-- nvlua.deploy_read) loads with each quantized linear's weight decoded to f32 as its library decodes
-- it, or with decode = "exact" as the engines' GEMMs and nvlua's forward compute it (one rounding of
-- code * block scale * global scale); info.quantization = {method, algo, source, quantized =
-- {modules}, excluded = {linear modules left unquantized}}. What it read stays in
-- model.quantized_source: hf.save_pretrained with quantize = writes it back for every linear whose
-- weight is unchanged (nvlua.deploy).
-- info = {missing =, unexpected =, ignored =, config_ignored = [, quantization =]} (sorted names). strict (the
-- default) raises when a parameter is missing or a tensor is unexpected, listing them; with
-- strict = false they are returned in info and a missing parameter keeps its initial value
-- (normal(0, initializer_range) from seed 0). dtype "bf16" rounds every weight to bf16 (what a
-- model loaded in bfloat16 holds; parameters stay f32 masters). Ignored: non-parameter buffers
-- and the stored lm_head.weight of a tied model that equals the embedding.
function hf.from_pretrained(dir, o)
  local who = "from_pretrained"
  o = util.check_opts(o, {strict = check_strict, dtype = check_dtype, recipe = is_recipe,
    quantized = check_quantized, decode = check_decode}, who)
  dir = model_dir(who, dir)
  if not is_file(dir .. "/config.json") then fail(who, dir, "no config.json (not a Hugging Face model directory)") end
  local rok, c, info = pcall(hf.read_config, dir)
  if not rok then user_error("from_pretrained: " .. strip_position(c):gsub("^read_config: ", ""), 0) end
  if not c then fail(who, dir, "config.json: %s", tostring(info)) end
  local scheme = quant_scheme(who, dir, info.quantization_config)
  local tensors, files = scan_weights(who, dir) -- (before a model is built)
  local llama = require "nvlua.llama"
  local ok, model = pcall(llama.Llama, c, {recipe = o.recipe, seed = 0})
  if not ok and not util.is_user_error(model) then error(model, 0) end -- a bug, not the file's
  if not ok then fail(who, dir, "config.json: %s", strip_position(model)) end
  local li = load_weights(who, dir, tensors, files, model, o.strict, o.dtype, scheme, o.decode)
  li.config_ignored = info.config_ignored
  return model, li
end

--- hf.load_weights(model, dir [, {strict = true, dtype = "f32" | "bf16", quantized = "dequantize", decode =
-- "library" | "exact"}]) -> info
-- {missing =, unexpected =, ignored = [, quantization =]}: the weights of dir (a Hugging Face Llama directory, or an nvlua
-- checkpoint) copied into model, a llama.Llama its caller built for dir's config (its parameters'
-- shapes must be the stored ones; one under shard=grads|full, nvlua.shard, keeps its rows of each).
-- What from_pretrained does after it builds the model: the same checks, refusals and options;
-- config.json is read only for its quantization_config (the model's config is the caller's).
function hf.load_weights(model, dir, o)
  local who = "load_weights"
  o = util.check_opts(o, {strict = check_strict, dtype = check_dtype, quantized = check_quantized,
    decode = check_decode}, who)
  if type(model) ~= "table" or type(model.named_parameters) ~= "function" or type(model.config) ~= "table" then
    error("load_weights: model must be an nvlua model (llama.Llama), got " .. type(model), 2)
  end
  dir = model_dir(who, dir)
  local scheme = quant_scheme(who, dir, false)
  local tensors, files = scan_weights(who, dir)
  return load_weights(who, dir, tensors, files, model, o.strict, o.dtype, scheme, o.decode)
end

-- ---- writing --------------------------------------------------------------------------------------

local UNITS = {TB = 10 ^ 12, GB = 10 ^ 9, MB = 10 ^ 6, KB = 10 ^ 3}

--- hf.parse_size(v) -> bytes: an integer >= 1, or "<number><unit>" with unit KB, MB, GB or TB
-- (powers of 10, any case), read as huggingface_hub's parse_size_to_int reads it.
function hf.parse_size(v)
  if math.type(v) == "integer" and v >= 1 then return v end
  local digits = type(v) == "string" and (v:match("^%s*(.-)%s*$")):sub(1, -3):match("^%s*(.-)%s*$")
  local n = digits and digits:match("^%d+%.?%d*$") and tonumber(digits) -- decimal only, as huggingface_hub reads it
  local unit = type(v) == "string" and UNITS[(v:match("^%s*(.-)%s*$")):sub(-2):upper()]
  local bytes = n and unit and math.tointeger(math.floor(n * unit))
  if not bytes or bytes < 1 then
    user_error(string.format("save_pretrained: max_shard_size must be an integer >= 1 (bytes) or a size such as \"5GB\" " ..
      "(units KB, MB, GB, TB), got %s", type(v) == "string" and string.format("%q", v) or tostring(v)), 0)
  end
  return bytes
end

-- Hugging Face's parameter order (LlamaForCausalLM.state_dict()): embedding, the layers in order
-- (attention q k v o, MLP gate up down, the two norms), the final norm, lm_head.
local SUB_ORDER = {["self_attn.q_proj.weight"] = 1, ["self_attn.k_proj.weight"] = 2, ["self_attn.v_proj.weight"] = 3,
  ["self_attn.o_proj.weight"] = 4, ["mlp.gate_proj.weight"] = 5, ["mlp.up_proj.weight"] = 6,
  ["mlp.down_proj.weight"] = 7, ["input_layernorm.weight"] = 8, ["post_attention_layernorm.weight"] = 9}
local function order_key(name)
  if name == "model.embed_tokens.weight" then return {0, 0, 0} end
  local i, rest = name:match("^model%.layers%.(%d+)%.(.+)$")
  -- a quantized export's other tensors of a linear (weight_scale, input_scale, ...) go with its weight
  if i then return {1, tonumber(i), SUB_ORDER[rest] or SUB_ORDER[(rest:match("^(.*)%.[^.]+$") or "") .. ".weight"] or 99} end
  if name == "model.norm.weight" then return {2, 0, 0} end
  if name == "lm_head.weight" then return {3, 0, 0} end
  return {4, 0, 0}
end
local function hf_order(names)
  local keys = {}
  for _, n in ipairs(names) do keys[n] = order_key(n) end
  table.sort(names, function(a, b)
    local x, y = keys[a], keys[b]
    for k = 1, 3 do if x[k] ~= y[k] then return x[k] < y[k] end end
    return a < b
  end)
  return names
end

-- huggingface_hub's split_state_dict_into_shards_factory: tensors in order; one larger than max
-- gets a shard of its own (appended at once); otherwise a shard is closed when the next tensor
-- would pass max. -> {{names}, ...}, total bytes
local function split(names, sizes, max)
  local shards, cur, cur_size, total = {}, {}, 0, 0
  for _, n in ipairs(names) do
    local s = sizes[n]
    total = total + s
    if s > max then
      shards[#shards + 1] = {n}
    else
      if cur_size + s > max then
        shards[#shards + 1] = cur
        cur, cur_size = {}, 0
      end
      cur[#cur + 1] = n
      cur_size = cur_size + s
    end
  end
  if #cur > 0 then shards[#shards + 1] = cur end
  return shards, total
end

-- Weight files of an earlier save in dir that this one does not write (they would shadow or
-- contradict it): model.safetensors, the index, model-NNNNN-of-NNNNN.safetensors, and a quantized
-- export's hf_quant_config.json (which engines read as the weights' format).
local QUANT_CONFIG = "hf_quant_config.json"
local function remove_stale(dir, written)
  for n in lfs.dir(dir) do
    local weights = n == SINGLE or n == INDEX or n == QUANT_CONFIG or
      n:match("^model%-%d%d%d%d%d%-of%-%d%d%d%d%d%.safetensors$")
    if weights and not written[n] and is_file(dir .. "/" .. n) then
      local ok, err = os.remove(dir .. "/" .. n)
      if not ok then
        user_error("save_pretrained: cannot remove the stale " .. dir .. "/" .. n .. ": " .. tostring(err), 0)
      end
    end
  end
end

local TOKEN_ID = "must be an integer >= 0 or a list of them"
local function token_id(v)
  if v == nil or math.type(v) == "integer" and v >= 0 then return nil end
  if type(v) == "table" and #v > 0 then
    for _, x in ipairs(v) do if math.type(x) ~= "integer" or x < 0 then return TOKEN_ID end end
    return nil
  end
  return TOKEN_ID
end

-- The bytes a value of a state dict takes in safetensors: a tensor (f32, bf16, u8) or st.typed fp8 codes.
local ELEM_BYTES = {f32 = 4, bf16 = 2, u8 = 1, i32 = 4, i64 = 8}
local function stored_bytes(v)
  local t = type(v) == "table" and v.t or v -- st.typed holds its tensor in t
  return t:numel() * ELEM_BYTES[t:dtype()]
end

-- Write sd ({name = tensor or st.typed value}) as model's weights into dir, then (o.quant_config:
-- hf_quant_config.json) and config.json (its quantization_config and dtype from o.config_extra).
local function save_model(model, dir, sd, o)
  local max = hf.parse_size(o.max_shard_size or "50GB")
  local names, sizes = {}, {}
  for n, t in pairs(sd) do
    names[#names + 1] = n
    sizes[n] = stored_bytes(t)
  end
  local shards, total = split(hf_order(names), sizes, max)
  local files, written = {}, {}
  local function save(name, tensors)
    local ok, err = st.save(dir .. "/" .. name, tensors, {})
    if not ok then user_error("save_pretrained: " .. dir .. "/" .. name .. ": " .. tostring(err), 0) end
    files[name], written[name] = err, true
    if o.progress then o.progress({file = name, bytes = err}) end
  end
  if #shards == 1 then
    save(SINGLE, sd)
  else
    local map = {}
    for k, shard in ipairs(shards) do
      local name, ts = string.format("model-%05d-of-%05d.safetensors", k, #shards), {}
      for _, n in ipairs(shard) do ts[n], map[n] = sd[n], name end
      save(name, ts)
    end
    files[INDEX] = write_json(dir .. "/" .. INDEX, {metadata = {total_parameters = model:num_parameters(),
      total_size = total}, weight_map = map}, 2, "save_pretrained")
    written[INDEX] = true
  end
  if o.quant_config then
    files[QUANT_CONFIG] = write_json(dir .. "/" .. QUANT_CONFIG, o.quant_config, 4, "save_pretrained")
    written[QUANT_CONFIG] = true
  end
  remove_stale(dir, written)
  if o.after_weights then o.after_weights() end
  local c = hf.config(model.config, o)
  for k, v in pairs(o.config_extra or {}) do c[k] = v end
  files["config.json"] = write_json(dir .. "/config.json", c, nil, "save_pretrained")
  return files
end

--- hf.write_json(path, t [, indent]) -> bytes: t as JSON (keys sorted, floats as Python writes them;
-- indent nil for one line, else json.dumps(indent = n)'s layout), written atomically. For nvlua.deploy.
function hf.write_json(path, t, indent) return write_json(path, t, indent, "save_pretrained") end

--- hf.save_pretrained(model, dir [, {max_shard_size = "50GB", bos_token_id =, eos_token_id =,
-- after_weights = fn, quantize =, format =, calibration =, exclude =, progress =}]) -> {file name = byte
-- size} of every file written: the model's weights (f32, __metadata__ {"format": "pt"}) in
-- model.safetensors, or in shards and model.safetensors.index.json when they pass max_shard_size
-- (transformers 5's default, "50GB"), then config.json, into the existing directory dir. Weight files
-- of an earlier save that this one does not replace are removed. after_weights() runs between the
-- weights and config.json (checkpoint.lua's fault point). With quantize ("nvfp4" | "nvfp4_a16" |
-- "mxfp4" | "fp8"), a checkpoint inference engines load: nvlua.deploy.save_pretrained (its options,
-- and it returns files, report).
function hf.save_pretrained(model, dir, o)
  if type(o) == "table" and o.quantize ~= nil then return require("nvlua.deploy").save_pretrained(model, dir, o) end
  o = util.check_opts(o, {max_shard_size = true, bos_token_id = token_id, eos_token_id = token_id,
    after_weights = function(v) return type(v) ~= "function" and "must be a function" or nil end}, "save_pretrained")
  hf.check_save_args(model, dir)
  return save_model(model, dir, model:state_dict(), o)
end

--- hf.check_save_args(model, dir): raises unless model is an nvlua model and dir an existing directory.
function hf.check_save_args(model, dir)
  if type(model) ~= "table" or type(model.state_dict) ~= "function" or type(model.config) ~= "table" then
    error("save_pretrained: model must be an nvlua model (llama.Llama), got " .. type(model), 3)
  end
  if type(dir) ~= "string" or not is_dir(dir) then
    user_error("save_pretrained: " .. tostring(dir) .. " is not a directory", 3)
  end
end

--- hf.save_model(model, dir, sd, o) -> {file name = byte size}: save_pretrained's writer for a state dict
-- of one's own (nvlua.deploy: quantized tensors, st.typed fp8 codes, bf16 copies). o: max_shard_size,
-- bos_token_id, eos_token_id, progress(info) (called after each weight file, info = {file, bytes}),
-- quant_config (written as hf_quant_config.json), config_extra (keys set in config.json).
hf.save_model = save_model
hf.token_id = token_id

return hf
