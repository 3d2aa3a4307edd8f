-- test_hf.lua: nvlua.hf, Hugging Face model directories, against the golden set transformers made
-- (tests/data/hf, scripts/make_hf_golden.py: tiny Llamas, each case a directory transformers 5
-- saved, with its float32 and float64 logits for fixed ids, its config.json in every other form,
-- and the configs transformers 5 and 4.x wrote back after loading nvlua's save).
--   * logits: every case (Llama 2/3/3.1/3.2-like, head_dim != hidden/heads, linear and dynamic
--     RoPE, sharded, F16, BF16) gives transformers' logits within the tolerance below;
--   * every config form (old 4.x with "type", 4.x, the transformers 5 and 4.x re-saves of nvlua's
--     save) reads to the same RoPE and the same logits bit for bit; a wrong RoPE would move the
--     logits by far more than the tolerance;
--   * save_pretrained: transformers' shard layout byte for byte, sizes, stale files, the hook;
--   * strict and non-strict loading, ignored buffers, tied models and a stored lm_head, F16
--     decoding (all 65536 values), dtype = "bf16", pytorch_model.bin, bad arguments, config keys;
--   * non-finite values are refused by name: NaN or Inf in a weight (F32, BF16, in one shard of six,
--     a tied model's stored head) and a NaN or infinite rms_norm_eps, rope_theta, initializer_range.
--
-- Tolerance. transformers' own float32 logits differ from its float64 ones by at most S relative
-- to max |logit| (S = the largest spread over the cases, measured from the data here: 4.2e-7
-- when the set was made; MANIFEST.json has each case's). nvlua computes the same model in float32
-- in another order, so its error is of the same size: measured 2.1e-7 .. 4.5e-7 (at most 1.5 S).
-- The test requires max |nvlua - float64| <= 4 S * max |logit|, and S < 2e-6 (the golden data is
-- what it claims). A wrong RoPE moves the logits by 0.2 .. 0.5 relative, 10^5 times more.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = require "nvlua.core"
local hf = require "nvlua.hf"
local st = require "nvlua.safetensors"
local llama = require "nvlua.llama"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"
local lfs = require "lfs"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local DATA = here .. "/data/hf"
local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

local CASES = {"llama2", "llama3", "llama31", "llama32", "headdim", "linear", "dynamic"}
local LOW = {llama2_f16 = "llama2", llama32_bf16 = "llama32"}

-- ---- helpers --------------------------------------------------------------------------------------

local function floats(t) -- the values of an f32 tensor, flat
  local b, out = t:bytes(), {}
  for i = 1, #b // 4 do out[i] = string.unpack("<f", b, 4 * i - 3) end
  return out
end

local function read_json(path) return cjson.decode(assert(T.read_file(path))) end

-- the weight files of a case directory (model.safetensors, or the index and its shards)
local function weight_files(dir)
  local out = {}
  for n in lfs.dir(dir) do
    if n == "model.safetensors" or n == "model.safetensors.index.json" or n:match("^model%-%d+%-of%-%d+%.safetensors$")
    then
      out[#out + 1] = n
    end
  end
  table.sort(out)
  return out
end

-- a fresh directory with the weights of case and config (a JSON text or a table)
local function with_config(case, config, name)
  local d = fresh(name or case)
  for _, n in ipairs(weight_files(DATA .. "/" .. case)) do
    T.write_file(d .. "/" .. n, assert(T.read_file(DATA .. "/" .. case .. "/" .. n)))
  end
  T.write_file(d .. "/config.json", type(config) == "table" and cjson.encode(config) or config)
  return d
end

local function case_config(case) return read_json(DATA .. "/" .. case .. "/config.json") end

local GOLDEN = {}
local function golden(case)
  if not GOLDEN[case] then
    local g = assert(st.load(DATA .. "/" .. case .. "/golden.safetensors"))
    local hi, lo, l64 = floats(g.logits_f64_hi), floats(g.logits_f64_lo), {}
    for i = 1, #hi do l64[i] = hi[i] + lo[i] end
    local scale = 0
    for _, v in ipairs(l64) do scale = math.max(scale, math.abs(v)) end
    GOLDEN[case] = {ids = g.input_ids, l32 = floats(g.logits_f32), l64 = l64, scale = scale}
  end
  return GOLDEN[case]
end

-- max |a - b| / scale over two flat lists
local function rel_diff(a, b, scale)
  assert(#a == #b and #a > 0, "lengths differ")
  local m = 0
  for i = 1, #a do m = math.max(m, math.abs(a[i] - b[i])) end
  return m / scale
end

local function logits(model, ids)
  model:eval()
  local l = model:forward(ids)
  local out = floats(l)
  l:free()
  return out
end
local logit_bytes = T.logit_bytes

-- S: the largest float32-vs-float64 spread of transformers over the cases (see the header)
local SPREAD
local function tolerance()
  if not SPREAD then
    SPREAD = 0
    for _, case in ipairs(CASES) do
      local g = golden(case)
      SPREAD = math.max(SPREAD, rel_diff(g.l32, g.l64, g.scale))
    end
    for case in pairs(LOW) do
      local g = golden(case)
      SPREAD = math.max(SPREAD, rel_diff(g.l32, g.l64, g.scale))
    end
    assert(SPREAD > 0 and SPREAD < 2e-6, "the golden spread is " .. SPREAD)
  end
  return 4 * SPREAD
end

local function check_logits(model, case, what)
  local g = golden(case)
  local got = logits(model, g.ids)
  local err, tol = rel_diff(got, g.l64, g.scale), tolerance()
  T.ok(err <= tol, string.format("%s: max |nvlua - transformers fp64| = %.3g x max|logit|, tolerance %.3g",
    what or case, err, tol))
  return got, err
end

-- ---- golden logits ----------------------------------------------------------------------------------

T.case("golden: the tolerance from transformers' own float32 spread", function()
  local tol = tolerance()
  T.ok(SPREAD > 1e-8, "the float32 and float64 logits differ (they are two computations): " .. SPREAD)
  T.ok(tol < 1e-5, "tolerance " .. tol)
end)

T.case("golden: every case gives transformers' logits (llama 2/3/3.1/3.2-like, head_dim, linear, dynamic)", function()
  for _, case in ipairs(CASES) do
    local model, info = hf.from_pretrained(DATA .. "/" .. case)
    T.eq(info.missing, {}); T.eq(info.unexpected, {}); T.eq(info.ignored, {})
    check_logits(model, case)
  end
  -- what each case is
  local c = hf.from_pretrained(DATA .. "/llama31").config
  T.eq({c.rope_theta, c.rope_scaling}, {500000.0, {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0,
    high_freq_factor = 4.0, original_max_position_embeddings = 64}})
  T.ok(lfs.attributes(DATA .. "/llama31/model.safetensors.index.json") and
    not lfs.attributes(DATA .. "/llama31/model.safetensors"), "llama31 is sharded")
  c = hf.from_pretrained(DATA .. "/llama32").config
  T.eq({c.tie_word_embeddings, c.rope_scaling.factor}, {true, 32.0})
  c = hf.from_pretrained(DATA .. "/headdim").config
  T.eq({c.hidden_size, c.num_attention_heads, c.head_dim}, {32, 4, 16})
  T.eq(hf.from_pretrained(DATA .. "/linear").config.rope_scaling, {rope_type = "linear", factor = 4.0})
  T.eq(hf.from_pretrained(DATA .. "/dynamic").config.rope_scaling, {rope_type = "dynamic", factor = 2.0})
  T.eq(hf.from_pretrained(DATA .. "/llama2").config.num_key_value_heads, 2)
end)

T.case("golden: F16 and BF16 weights (read as f32) give transformers' logits", function()
  for case, src in pairs(LOW) do
    local dir = DATA .. "/" .. case
    local header = assert(st.read_header(dir .. "/model.safetensors", {f16 = "f32"}))
    T.eq(header["model.norm.weight"].dtype, case == "llama2_f16" and "F16" or "BF16")
    local model = hf.from_pretrained(dir)
    check_logits(model, case)
    local full = hf.from_pretrained(DATA .. "/" .. src) -- the same model in f32: other logits
    T.ok(rel_diff(logits(full, golden(case).ids), golden(case).l64, golden(case).scale) > 100 * tolerance(),
      case .. ": the low-precision weights matter")
  end
end)

T.case("golden: a wrong RoPE would be seen (theta 1e4, no scaling: what nvlua read before)", function()
  for _, case in ipairs({"llama3", "llama31", "llama32", "headdim", "linear"}) do
    local c = case_config(case)
    c.rope_parameters = {rope_type = "default", rope_theta = 10000.0}
    local model = hf.from_pretrained(with_config(case, c, case .. "_wrong"))
    local g = golden(case)
    local err = rel_diff(logits(model, g.ids), g.l64, g.scale)
    T.ok(err > 1000 * tolerance(), string.format("%s: a wrong RoPE moves the logits by only %.3g", case, err))
  end
  -- dynamic NTK up to max_position_embeddings is plain RoPE with theta * (2 * M / M - 1)^(16/14) = theta
  local c = case_config("dynamic")
  c.rope_parameters = {rope_type = "default", rope_theta = 10000.0}
  local plain = hf.from_pretrained(with_config("dynamic", c, "dynamic_plain"))
  local dyn = hf.from_pretrained(DATA .. "/dynamic")
  T.eq(logit_bytes(plain, golden("dynamic").ids), logit_bytes(dyn, golden("dynamic").ids))
end)

T.case("RoPE tables: linear divides every frequency; dynamic is theta * (f M / M - (f - 1))^(D / (D - 2))", function()
  local Tn, D, theta = 40, 16, 10000.0
  local c = core.rope_tables(Tn, D, theta, {rope_type = "linear", factor = 4.0})
  for _, t in ipairs({1, 7, 39}) do
    for i = 1, D do
      local f = theta ^ (-2 * ((i - 1) % (D // 2)) / D) / 4
      T.near(c:get(t + 1, i), math.cos(t * f), 2e-7, string.format("linear cos t=%d i=%d", t, i))
    end
  end
  -- dynamic, at T <= M: transformers' expression in double (M 48, factor 3.3: its base is not exactly 1)
  local M = 48
  for _, f in ipairs({2.0, 3.3}) do
    local want = core.rope_tables(Tn, D, theta * ((f * M / M) - (f - 1)) ^ (D / (D - 2)))
    local got = core.rope_tables(Tn, D, theta, {rope_type = "dynamic", factor = f}, M)
    T.ok(got:bytes() == want:bytes(), "dynamic factor " .. f)
  end
  T.ok((3.3 * M / M) - (3.3 - 1) ~= 1, "factor 3.3 makes a base other than 1")
  local dyn2 = core.rope_tables(Tn, D, theta, {rope_type = "dynamic", factor = 2.0}, M)
  T.ok(dyn2:bytes() == core.rope_tables(Tn, D, theta):bytes(), "factor 2: plain RoPE")
  T.raises(function() core.rope_tables(65, D, theta, {rope_type = "dynamic", factor = 2.0}, M) end,
    "rope_tables: dynamic scaling is computed for T <= max_position_embeddings (48), got T = 65")
  local dyn = {rope_type = "dynamic", factor = 2.0}
  T.raises(function() core.rope_tables(4, D, theta, dyn) end, "number expected, got no value")
  T.raises(function() core.rope_tables(4, 2, theta, dyn, 8) end, "needs a head dim D > 2")
  T.raises(function() core.rope_tables(4, D, theta, {rope_type = "linear", factor = 2, low_freq_factor = 1}) end,
    "scaling key 'low_freq_factor' belongs to rope_type llama3, not linear")
  T.raises(function() core.rope_tables(4, D, theta, {rope_type = "linear"}) end, "option 'factor' is required")
  local plain = core.rope_tables(4, D, theta)
  T.ok(core.rope_tables(4, D, theta, {rope_type = "default"}):bytes() == plain:bytes(), "default")
  -- a model never asks for more than max_position_embeddings
  local m = llama.Llama({vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1,
    num_attention_heads = 2, max_position_embeddings = 8, rope_scaling = dyn}, {seed = 1})
  T.raises(function() m:forward(nv.zeros(1, 9, "i64")) end, "exceeds max_position_embeddings 8")
  m:forward(nv.zeros(1, 8, "i64"))
end)

-- ---- config forms -----------------------------------------------------------------------------------

T.case("config forms: legacy (4.x, old 'type'), and the transformers 5 / 4.x re-saves of nvlua's save", function()
  for _, case in ipairs(CASES) do
    local ref = hf.from_pretrained(DATA .. "/" .. case)
    local want = logit_bytes(ref, golden(case).ids)
    for _, form in ipairs({"v4", "old", "t5_resave", "t4_resave"}) do
      local text = assert(T.read_file(DATA .. "/" .. case .. "/forms/" .. form .. ".json"))
      local j = cjson.decode(text)
      if form == "old" and j.rope_scaling ~= cjson.null then
        T.ok(j.rope_scaling.type and not j.rope_scaling.rope_type, "old: 'type'")
      end
      if form == "v4" or form == "old" then T.eq(j.rope_parameters, nil, "no rope_parameters in " .. form) end
      if form == "t5_resave" then
        T.eq({j.rope_theta, j.rope_scaling}, {nil, nil}, "only rope_parameters in t5_resave")
      end
      local model = hf.from_pretrained(with_config(case, text, case .. "_" .. form))
      local what = case .. " forms/" .. form .. ".json"
      T.eq({model.config.rope_theta, model.config.rope_scaling}, {ref.config.rope_theta, ref.config.rope_scaling}, what)
      T.eq(model.config.head_dim, ref.config.head_dim, what)
      T.ok(logit_bytes(model, golden(case).ids) == want, what .. ": the same logits bit for bit")
    end
  end
end)

T.case("config: hf.config writes rope_parameters and the legacy keys; numbers as transformers writes them", function()
  local model = hf.from_pretrained(DATA .. "/llama31")
  local d = fresh("write_config")
  hf.save_pretrained(model, d, {bos_token_id = 1, eos_token_id = {2, 3}})
  local text = assert(T.read_file(d .. "/config.json"))
  local j = cjson.decode(text)
  local rs = {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0,
    original_max_position_embeddings = 64}
  T.eq(j.rope_scaling, rs)
  rs.rope_theta = 500000.0
  T.eq(j.rope_parameters, rs)
  T.eq(j.rope_theta, 500000.0)
  T.eq({j.bos_token_id, j.eos_token_id, j.pad_token_id}, {1, {2, 3}, cjson.null})
  T.eq({j.dtype, j.architectures, j.model_type, j.head_dim}, {"float32", {"LlamaForCausalLM"}, "llama", 16})
  for _, s in ipairs({'"rope_theta":500000.0', '"factor":8.0', '"rms_norm_eps":1e-05',
    '"original_max_position_embeddings":64,', '"initializer_range":0.02', '"attention_dropout":0.0',
    '"vocab_size":64'}) do
    T.ok(text:find(s, 1, true), "config.json has " .. s .. ": " .. text)
  end
  -- without token ids: null; a plain model: rope_type default, rope_scaling null
  local plain = hf.from_pretrained(DATA .. "/llama2")
  hf.save_pretrained(plain, d)
  j = read_json(d .. "/config.json")
  T.eq({j.rope_parameters, j.rope_scaling, j.rope_theta},
    {{rope_type = "default", rope_theta = 10000.0}, cjson.null, 10000.0})
  T.eq({j.bos_token_id, j.eos_token_id}, {1, 2}, "kept from the loaded config.json")
  local fresh_model = llama.Llama({vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1,
    num_attention_heads = 2, rope_theta = 20000}, {seed = 1})
  hf.save_pretrained(fresh_model, d)
  text = assert(T.read_file(d .. "/config.json"))
  j = cjson.decode(text)
  T.eq({j.bos_token_id, j.eos_token_id}, {cjson.null, cjson.null})
  T.ok(text:find('"rope_theta":20000.0', 1, true), "an integer theta is written as a float: " .. text)
end)

T.case("config: rope types and keys nvlua does not compute are refused by name; keys without arithmetic ignored",
function()
  local base = case_config("llama2")
  local function load(edit, name)
    local c = case_config("llama2")
    edit(c)
    return hf.from_pretrained(with_config("llama2", c, name or "cfg"))
  end
  local function refused(edit, text) T.raises(function() load(edit) end, text) end
  refused(function(c) c.rope_parameters = {rope_type = "yarn", factor = 4.0, rope_theta = 1e4} end,
    "rope_parameters rope_type 'yarn' is not supported (nvlua computes default, linear, dynamic, llama3)")
  refused(function(c) c.rope_parameters = nil; c.rope_scaling = {type = "longrope", factor = 4.0} end,
    "rope_scaling rope_type 'longrope' is not supported")
  refused(function(c) c.rope_parameters.partial_rotary_factor = 0.5 end, "partial_rotary_factor = 0.5 is not supported")
  refused(function(c) c.partial_rotary_factor = 0.5 end, "partial_rotary_factor = 0.5 is not supported")
  refused(function(c) c.rope_parameters = {rope_type = "llama3", rope_theta = 5e5, low_freq_factor = 1,
    high_freq_factor = 4} end, "rope_parameters.factor must be a number > 0 for rope_type 'llama3', got nil")
  refused(function(c) c.rope_parameters = {rope_type = "linear", rope_theta = 1e4} end, "factor must be a number > 0")
  refused(function(c) c.rope_theta = 500000.0 end, "rope_parameters (rope_theta 10000.0, rope_type default) and " ..
    "the legacy rope_theta/rope_scaling (rope_theta 500000.0, rope_type default) disagree")
  refused(function(c) c.rope_scaling = {rope_type = "linear", factor = 2.0} end, "disagree")
  refused(function(c)
    c.rope_parameters = nil
    c.rope_scaling = {rope_type = "linear", factor = 2.0, rope_theta = 5e5}
  end, "rope_scaling.rope_theta (500000.0) and rope_theta (10000.0) disagree")
  refused(function(c) c.rope_parameters = {full_attention = {rope_type = "default", rope_theta = 1e4}} end,
    "unknown rope_parameters key 'full_attention' (rope parameters per layer type are not supported)")
  refused(function(c) c.hidden_act = "gelu" end, "hidden_act = gelu is not supported")
  refused(function(c) c.attention_bias = true end, "attention_bias = true is not supported")
  refused(function(c) c.model_type = "mistral" end, "model_type = mistral is not supported")
  refused(function(c) c.quantization_config = {quant_method = "bitsandbytes"} end,
    "config.json: quantization_config.quant_method \"bitsandbytes\" is not one nvlua reads (modelopt, compressed-tensors)")
  refused(function(c) c.auto_map = {AutoModelForCausalLM = "modeling_x.X"} end,
    "auto_map: it names custom modeling code")
  refused(function(c) c.pruned_heads = {["0"] = {1}} end, "pruned_heads: pruned attention heads are not supported")
  -- accepted: both forms agreeing, legacy only with "type", a llama3 original_max_position_embeddings
  -- defaulting to max_position_embeddings (transformers 5), keys transformers' Llama does not read
  local m = load(function(c) c.rope_theta = 10000.0; c.rope_scaling = cjson.null end)
  T.eq(m.config.rope_theta, 10000.0)
  m = load(function(c)
    c.rope_parameters = {rope_type = "llama3", rope_theta = 5e5, factor = 8, low_freq_factor = 1, high_freq_factor = 4,
      attention_factor = 1.0}
  end)
  T.eq(m.config.rope_scaling.original_max_position_embeddings, base.max_position_embeddings)
  local _, info
  m, info = hf.from_pretrained(with_config("llama2", (function()
    local c = case_config("llama2")
    c.layer_types = {"full_attention", "full_attention"}; c.sliding_window = 4096; c.id2label = {["0"] = "A"}
    c.my_own_key = "x"; c.pretraining_tp = 2; c.pruned_heads = {}; c.quantization_config = cjson.null
    return c
  end)(), "ignored"))
  T.eq(info.config_ignored, {"id2label", "layer_types", "my_own_key", "pruned_heads", "sliding_window"})
  check_logits(m, "llama2", "with ignored keys")
end)

-- ---- weights: strict, non-strict, buffers, tied -------------------------------------------------------

-- a fresh directory holding case's config.json and model.safetensors with tensors edited by edit
local function with_tensors(case, edit, name)
  local d = fresh(name or case)
  T.write_file(d .. "/config.json", assert(T.read_file(DATA .. "/" .. case .. "/config.json")))
  local ts = assert(st.load(DATA .. "/" .. case .. "/model.safetensors", {f16 = "f32"}))
  edit(ts)
  assert(st.save(d .. "/model.safetensors", ts, {format = "pt"}))
  return d
end

T.case("weights: known buffers are ignored; unexpected and missing tensors: strict raises, non-strict lists", function()
  local d = with_tensors("llama2", function(ts)
    ts["model.layers.0.self_attn.rotary_emb.inv_freq"] = nv.rand(8)
    ts["model.layers.1.self_attn.rotary_emb.inv_freq"] = nv.rand(8)
    ts["model.layers.0.attn.masked_bias"] = nv.tensor({-1e4})
  end, "buffers")
  local m, info = hf.from_pretrained(d)
  T.eq(info.ignored, {"model.layers.0.attn.masked_bias", "model.layers.0.self_attn.rotary_emb.inv_freq",
    "model.layers.1.self_attn.rotary_emb.inv_freq"})
  check_logits(m, "llama2", "with buffers")
  d = with_tensors("llama2", function(ts)
    ts["model.layers.0.mlp.extra.weight"] = nv.rand(4)
    ts["model.norm.weight"] = nil
    ts["model.layers.1.input_layernorm.weight"] = nil
  end, "strict")
  T.raises(function() hf.from_pretrained(d) end, "the weights do not match the model (missing: " ..
    "model.layers.1.input_layernorm.weight, model.norm.weight; unexpected: model.layers.0.mlp.extra.weight); " ..
    "{strict = false} loads the rest")
  m, info = hf.from_pretrained(d, {strict = false})
  T.eq(info.missing, {"model.layers.1.input_layernorm.weight", "model.norm.weight"})
  T.eq(info.unexpected, {"model.layers.0.mlp.extra.weight"})
  local sd = m:state_dict()
  local ref = hf.from_pretrained(DATA .. "/llama2"):state_dict()
  T.ok(sd["model.layers.0.self_attn.q_proj.weight"]:bytes() == ref["model.layers.0.self_attn.q_proj.weight"]:bytes(),
    "the others are loaded")
  T.eq(sd["model.norm.weight"]:bytes() == ref["model.norm.weight"]:bytes(), false)
  -- a shape or dtype that cannot be a parameter raises, strict or not
  d = with_tensors("llama2", function(ts) ts["model.norm.weight"] = nv.rand(31) end, "shape")
  T.raises(function() hf.from_pretrained(d, {strict = false}) end,
    "model.norm.weight has shape [31] in model.safetensors, the model's is [32]")
  d = with_tensors("llama2", function(ts) ts["model.norm.weight"] = nv.zeros(32, "i32") end, "dtype")
  T.raises(function() hf.from_pretrained(d, {strict = false}) end,
    "model.norm.weight is I32 in model.safetensors; parameters must be F32, BF16 or F16")
end)

T.case("weights: a tied model storing lm_head.weight loads when it equals the embedding, else raises", function()
  local function head(copy) -- llama32 (tied) plus an lm_head.weight made by copy(embedding)
    return with_tensors("llama32", function(ts) ts["lm_head.weight"] = copy(ts["model.embed_tokens.weight"]) end,
      "tied")
  end
  local m, info = hf.from_pretrained(head(function(e) return e:clone() end))
  T.eq(info.ignored, {"lm_head.weight"})
  check_logits(m, "llama32", "tied with lm_head stored")
  -- both stored in bf16: equal after conversion
  local d = with_tensors("llama32", function(ts)
    ts["model.embed_tokens.weight"] = ts["model.embed_tokens.weight"]:to("bf16")
    ts["lm_head.weight"] = ts["model.embed_tokens.weight"]:clone()
  end, "tied_bf16")
  T.eq(select(2, hf.from_pretrained(d)).ignored, {"lm_head.weight"})
  local function bumped(e)
    local c = e:clone()
    c:set(3, 5, c:get(3, 5) + 2 ^ -20)
    return c
  end
  for _, strict in ipairs({true, false}) do
    T.raises(function() hf.from_pretrained(head(bumped), {strict = strict}) end,
      "lm_head.weight differs from model.embed_tokens.weight, but tie_word_embeddings is true")
  end
  -- untied: lm_head.weight is a parameter, and missing it is an error
  d = with_tensors("llama2", function(ts) ts["lm_head.weight"] = nil end, "untied")
  T.raises(function() hf.from_pretrained(d) end, "missing: lm_head.weight")
end)

T.case("weights: dtype = \"bf16\" rounds every weight as transformers' bfloat16 does", function()
  local a = hf.from_pretrained(DATA .. "/llama32", {dtype = "bf16"}):state_dict()
  local b = hf.from_pretrained(DATA .. "/llama32_bf16"):state_dict()
  local f = hf.from_pretrained(DATA .. "/llama32"):state_dict()
  local n = 0
  for name, t in pairs(b) do
    n = n + 1
    T.ok(a[name]:bytes() == t:bytes(), name .. ": bf16-rounded f32 weights equal transformers' BF16 file")
  end
  T.eq(n, 20)
  T.ok(f["model.norm.weight"]:bytes() ~= a["model.norm.weight"]:bytes(), "f32 is not rounded")
end)

-- {name, a directory made here, the expected message after "from_pretrained: <dir>: "}: each loaded
-- silently before issue 28 (resume= refused the same values in a checkpoint)
local function with_config_text(case, edit, name) -- config.json with JSON's NaN / Infinity spliced in
  local c = case_config(case)
  edit(c)
  local text = cjson.encode(c):gsub('"@(.-)@"', "%1")
  return with_config(case, text, name)
end
local function set_shard(case, file, name, edit, dir_name) -- a copy of case with one tensor of one file edited
  local d = with_config(case, assert(T.read_file(DATA .. "/" .. case .. "/config.json")), dir_name)
  local ts = assert(st.load(d .. "/" .. file, {f16 = "f32"}))
  ts[name] = edit(ts[name])
  assert(st.save(d .. "/" .. file, ts, {format = "pt"}))
  return d
end
local function poke(i, j, v) return function(t) t:set(i, j, v); return t end end
local NONFINITE = {
  {"NaN in a norm weight", function()
    return with_tensors("llama2", function(ts) ts["model.norm.weight"]:set(3, 0 / 0) end, "nan_norm")
  end, "model.safetensors: tensor model.norm.weight holds NaN values"},
  {"+Inf in an MLP weight", function()
    return set_shard("llama2", "model.safetensors", "model.layers.1.mlp.down_proj.weight", poke(2, 5, math.huge),
      "inf_mlp")
  end, "model.safetensors: tensor model.layers.1.mlp.down_proj.weight holds infinite values"},
  {"-Inf in a BF16 weight", function()
    return set_shard("llama32_bf16", "model.safetensors", "model.layers.0.self_attn.k_proj.weight",
      function(t) t:set(1, 1, -math.huge); return t end, "inf_bf16")
  end, "model.safetensors: tensor model.layers.0.self_attn.k_proj.weight holds infinite values"},
  {"NaN in one shard of six", function()
    local idx = read_json(DATA .. "/llama31/model.safetensors.index.json")
    local file = idx.weight_map["model.layers.1.self_attn.o_proj.weight"]
    return set_shard("llama31", file, "model.layers.1.self_attn.o_proj.weight", poke(4, 4, 0 / 0), "nan_shard"), file
  end, "%s: tensor model.layers.1.self_attn.o_proj.weight holds NaN values"},
  {"NaN in a tied model's stored lm_head", function()
    return with_tensors("llama32", function(ts)
      local h = ts["model.embed_tokens.weight"]:clone()
      h:set(7, 2, 0 / 0)
      ts["lm_head.weight"] = h
    end, "nan_tied")
  end, "model.safetensors: tensor lm_head.weight holds NaN values"},
  {"rms_norm_eps NaN", function()
    return with_config_text("llama2", function(c) c.rms_norm_eps = "@NaN@" end, "eps_nan")
  end, "config.json: llama_config: rms_norm_eps must be a finite number > 0, got "},
  {"rms_norm_eps 1e999", function()
    return with_config_text("llama2", function(c) c.rms_norm_eps = "@1e999@" end, "eps_inf")
  end, "config.json: llama_config: rms_norm_eps must be a finite number > 0, got inf"},
  {"rope_theta Infinity (both forms)", function()
    return with_config_text("llama2", function(c)
      c.rope_theta = "@Infinity@"; c.rope_parameters.rope_theta = "@Infinity@"
    end, "theta_inf")
  end, "config.json: llama_config: rope_theta must be a finite number > 0, got inf"},
  {"rope_theta NaN (rope_parameters)", function()
    return with_config_text("llama31", function(c) c.rope_parameters.rope_theta = "@NaN@" end, "theta_nan")
  end, "config.json: llama_config: rope_theta must be a finite number > 0, got "},
  {"initializer_range NaN", function()
    return with_config_text("llama2", function(c) c.initializer_range = "@NaN@" end, "init_nan")
  end, "config.json: llama_config: initializer_range must be a finite number > 0, got "},
}

T.case("non-finite weights and config numbers (NaN, Inf) are refused, naming the tensor or key", function()
  for _, c in ipairs(NONFINITE) do
    local dir, file = c[2]()
    local want = "from_pretrained: " .. dir .. ": " .. c[3]:format(file)
    local ok, err = pcall(hf.from_pretrained, dir)
    T.eq(ok, false, c[1] .. ": loads")
    T.ok(tostring(err):sub(1, #want) == want, c[1] .. ":\n  expected " .. want .. "\n  got      " .. tostring(err))
  end
  -- the same directories with the values made finite again load (the check is of the values alone)
  local d = with_config_text("llama2", function(c) c.rms_norm_eps = "@1e-05@" end, "eps_ok")
  check_logits(hf.from_pretrained(d), "llama2", "rms_norm_eps spliced back")
  d = set_shard("llama2", "model.safetensors", "model.layers.1.mlp.down_proj.weight", function(t) return t end, "same")
  check_logits(hf.from_pretrained(d), "llama2", "rewritten unchanged")
end)

-- ---- F16 --------------------------------------------------------------------------------------------

-- the value of the IEEE half with bits h, from the definition (s1 e5 m10, bias 15)
local function half(h)
  local s, e, m = h >> 15, (h >> 10) & 31, h & 1023
  local sign = s == 1 and -1 or 1
  if e == 31 then return m == 0 and sign * math.huge or 0 / 0 end
  if e == 0 then return sign * m * 2.0 ^ -24 end
  return sign * (1 + m / 1024) * 2.0 ^ (e - 15)
end

T.case("F16: every one of the 65536 values decodes exactly (subnormals, zeros, inf, NaN with its payload)", function()
  local parts = {}
  for h = 0, 65535 do parts[#parts + 1] = string.pack("<I2", h) end
  local t = core.from_f16_bytes(table.concat(parts), {65536})
  T.eq({t:dtype(), t:size()}, {"f32", {65536}})
  local b = t:bytes()
  for h = 0, 65535 do
    local bits = string.unpack("<I4", b, 4 * h + 1)
    local v = string.unpack("<f", b, 4 * h + 1)
    local want = half(h)
    if want ~= want then
      T.eq(bits, ((h >> 15) << 31) | 0x7f800000 | ((h & 1023) << 13),
        string.format("NaN 0x%04x keeps sign and payload", h))
    elseif v ~= want or (want == 0 and bits ~= (h >> 15) << 31) then
      error(string.format("f16 0x%04x: got %.17g (bits 0x%08x), expected %.17g", h, v, bits, want))
    end
  end
  T.eq(half(0x0001), 2.0 ^ -24); T.eq(half(0x7bff), 65504)
  -- the reader: refused unless asked, then f32
  local d = fresh("f16")
  local text = '{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}'
  T.write_file(d .. "/a.safetensors", string.pack("<I8", #text) .. text .. string.pack("<I2I2", 0x3c00, 0xc001))
  T.raises(function() st.load(d .. "/a.safetensors") end,
    "dtype F16 is not supported by nvlua (supported: F32, BF16, I32, I64, U8; F16 is read as f32 with {f16 = \"f32\"})")
  local ts = st.load(d .. "/a.safetensors", {f16 = "f32"})
  T.eq(ts.a:totable(), {1.0, -2.001953125})
  T.eq(st.read_header(d .. "/a.safetensors", {f16 = "f32"}).a.dtype, "F16")
  T.raises(function() st.load(d .. "/a.safetensors", {f16 = "f16"}) end, "option f16 must be \"f32\"")
  T.raises(function() core.from_f16_bytes("abc", {2}) end,
    "from_f16_bytes: 4 bytes needed at offset 0, the string has 3")
end)

-- ---- saving -------------------------------------------------------------------------------------------

local function listing(dir)
  local out = {}
  for n in lfs.dir(dir) do if n ~= "." and n ~= ".." then out[#out + 1] = n end end
  table.sort(out)
  return out
end

T.case("save_pretrained: sharded as transformers shards, byte for byte; read back; one file when it fits", function()
  local src = DATA .. "/llama31"
  local model = hf.from_pretrained(src)
  local names = weight_files(src)
  for _, size in ipairs({"20KB", 20000, "0.02MB", " 20kb "}) do
    local d = fresh("sharded")
    local files = hf.save_pretrained(model, d, {max_shard_size = size, bos_token_id = 1, eos_token_id = 2})
    T.eq(weight_files(d), names, "transformers' file names")
    for _, n in ipairs(names) do
      T.ok(T.read_file(d .. "/" .. n) == T.read_file(src .. "/" .. n), n .. " is transformers' file byte for byte")
    end
    local want = {["config.json"] = lfs.attributes(d .. "/config.json", "size")}
    for _, n in ipairs(names) do want[n] = lfs.attributes(d .. "/" .. n, "size") end
    T.eq(files, want, "the returned sizes")
    local back = hf.from_pretrained(d)
    T.ok(logit_bytes(back, golden("llama31").ids) == logit_bytes(model, golden("llama31").ids), "read back")
  end
  -- one model.safetensors when it fits (the default, 50GB); the shards of the earlier save go
  local d = fresh("resave")
  hf.save_pretrained(model, d, {max_shard_size = "20KB"})
  local files = hf.save_pretrained(model, d)
  T.eq(listing(d), {"config.json", "model.safetensors"})
  T.eq(files["model.safetensors"], lfs.attributes(d .. "/model.safetensors", "size"))
  hf.save_pretrained(model, d, {max_shard_size = 30000}) -- and back: model.safetensors goes
  T.ok(not lfs.attributes(d .. "/model.safetensors") and lfs.attributes(d .. "/model.safetensors.index.json"))
  local idx = read_json(d .. "/model.safetensors.index.json")
  T.eq(idx.metadata, {total_parameters = model:num_parameters(), total_size = 4 * model:num_parameters()})
  -- a tensor larger than the limit gets a shard of its own; a tied model has no lm_head
  local tied = hf.from_pretrained(DATA .. "/llama32")
  d = fresh("tiny_shards")
  hf.save_pretrained(tied, d, {max_shard_size = 5000})
  idx = read_json(d .. "/model.safetensors.index.json")
  local n = 0
  for _ in pairs(idx.weight_map) do n = n + 1 end
  T.eq(n, 20)
  -- by hand, from huggingface_hub's algorithm: the embedding (8192 bytes) alone; q (4096) alone, as
  -- k (2048) would pass 5000; k + v; gate, up, down (8192 each) alone the moment they come, while
  -- o (4096) and the two norms (128 each) wait for layer 1's q to close their shard
  local want = {["model.embed_tokens.weight"] = 1, ["model.layers.0.self_attn.q_proj.weight"] = 2,
    ["model.layers.0.self_attn.k_proj.weight"] = 3, ["model.layers.0.self_attn.v_proj.weight"] = 3,
    ["model.layers.0.mlp.gate_proj.weight"] = 4, ["model.layers.0.mlp.up_proj.weight"] = 5,
    ["model.layers.0.mlp.down_proj.weight"] = 6, ["model.layers.0.self_attn.o_proj.weight"] = 7,
    ["model.layers.0.input_layernorm.weight"] = 7, ["model.layers.0.post_attention_layernorm.weight"] = 7,
    ["model.layers.1.self_attn.q_proj.weight"] = 8, ["model.layers.1.mlp.down_proj.weight"] = 12,
    ["model.layers.1.self_attn.o_proj.weight"] = 13, ["model.norm.weight"] = 13}
  for name, k in pairs(want) do
    T.eq(idx.weight_map[name], string.format("model-%05d-of-00013.safetensors", k), name)
  end
  T.eq(idx.weight_map["lm_head.weight"], nil)
  check_logits(hf.from_pretrained(d), "llama32", "tied, in 13 shards")
end)

T.case("save_pretrained: the weights are written before after_weights(), config.json after", function()
  local model = hf.from_pretrained(DATA .. "/llama2")
  local d = fresh("hook")
  local seen
  hf.save_pretrained(model, d, {max_shard_size = "30KB", after_weights = function() seen = listing(d) end})
  T.eq(seen, weight_files(d))
  T.ok(#seen > 2, "sharded")
  T.ok(lfs.attributes(d .. "/config.json"), "config.json written after")
end)

T.case("save_pretrained: bad arguments", function()
  local model = hf.from_pretrained(DATA .. "/llama2")
  local d = fresh("bad_save")
  T.raises(function() hf.save_pretrained(nil, d) end, "save_pretrained: model must be an nvlua model")
  T.raises(function() hf.save_pretrained(model, d .. "/nope") end,
    "save_pretrained: " .. d .. "/nope is not a directory")
  T.raises(function() hf.save_pretrained(model, d, {shard = 1}) end, "save_pretrained: unknown option 'shard'")
  for _, bad in ipairs({"20KiB", "KB", "abc", 0, -1, 1.5, "0KB", true}) do
    T.raises(function() hf.save_pretrained(model, d, {max_shard_size = bad}) end,
      "max_shard_size must be an integer >= 1 (bytes) or a size such as \"5GB\" (units KB, MB, GB, TB)")
  end
  T.raises(function() hf.save_pretrained(model, d, {bos_token_id = -1}) end,
    "option bos_token_id must be an integer >= 0 or a list of them")
  T.raises(function() hf.save_pretrained(model, d, {eos_token_id = {1, "2"}}) end, "option eos_token_id must be")
  T.eq(hf.parse_size("5GB"), 5000000000); T.eq(hf.parse_size("1.5MB"), 1500000); T.eq(hf.parse_size(7), 7)
end)

-- ---- reading: directories and arguments ------------------------------------------------------------

T.case("from_pretrained: a pytorch_model.bin directory gets the conversion command", function()
  for _, bin in ipairs({"pytorch_model.bin", "pytorch_model.bin.index.json"}) do
    local d = fresh("bin")
    T.write_file(d .. "/config.json", assert(T.read_file(DATA .. "/llama2/config.json")))
    T.write_file(d .. "/" .. bin, "PK\3\4 not read")
    local err = T.raises(function() hf.from_pretrained(d) end, "has " .. bin .. " but no model.safetensors or " ..
      "model.safetensors.index.json: nvlua reads safetensors only")
    T.ok(err:find("AutoModelForCausalLM.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1])\" " .. d, 1, true),
      "the command: " .. err)
  end
  local d = fresh("empty")
  T.write_file(d .. "/config.json", assert(T.read_file(DATA .. "/llama2/config.json")))
  T.raises(function() hf.from_pretrained(d) end,
    "no model.safetensors in " .. d .. ", nor model.safetensors.index.json")
end)

T.case("from_pretrained: bad arguments and broken directories raise named errors", function()
  T.raises(function() hf.from_pretrained() end, "from_pretrained: dir must be a string (a model directory), got nil")
  T.raises(function() hf.from_pretrained(42) end, "dir must be a string")
  T.raises(function() hf.from_pretrained(ROOT .. "/nowhere") end,
    "from_pretrained: " .. ROOT .. "/nowhere: no such directory")
  T.raises(function() hf.from_pretrained(DATA .. "/llama2/config.json") end, "config.json: not a directory (a file)")
  T.raises(function() hf.from_pretrained(fresh("noconfig")) end, "no config.json (not a Hugging Face model directory)")
  T.raises(function() hf.from_pretrained(DATA .. "/llama2", {strict = 1}) end, "option strict must be true or false")
  T.raises(function() hf.from_pretrained(DATA .. "/llama2", {dtype = "f16"}) end,
    "option dtype must be \"f32\" or \"bf16\"")
  T.raises(function() hf.from_pretrained(DATA .. "/llama2", {strct = true}) end, "unknown option 'strct'")
  T.raises(function() hf.from_pretrained(with_config("llama2", "{not json", "badjson")) end, "config.json: bad JSON")
  T.raises(function() hf.from_pretrained(with_config("llama2", "[1, 2]", "array")) end,
    "config.json: expected a JSON object")
  local c = case_config("llama2")
  c.hidden_size = nil; c.head_dim = nil
  T.raises(function() hf.from_pretrained(with_config("llama2", c, "nosize")) end,
    "config.json: llama_config: the config must give the model's sizes vocab_size, hidden_size")
  -- sharded: the index must agree with its shards
  local function index(edit)
    local d = with_config("llama31", assert(T.read_file(DATA .. "/llama31/config.json")), "index")
    local idx = read_json(d .. "/model.safetensors.index.json")
    edit(idx, d)
    T.write_file(d .. "/model.safetensors.index.json", cjson.encode(idx))
    return d
  end
  local S1, S2, S3 = "model-00001-of-00006.safetensors", "model-00002-of-00006.safetensors",
    "model-00003-of-00006.safetensors"
  T.raises(function() hf.from_pretrained(index(function(_, d) os.remove(d .. "/" .. S3) end)) end,
    "names the shard " .. S3 .. " (for ")
  T.raises(function() hf.from_pretrained(index(function(i) i.weight_map["model.norm.weight"] = nil end)) end,
    "model-00006-of-00006.safetensors holds model.norm.weight, which model.safetensors.index.json does not list")
  T.raises(function()
    hf.from_pretrained(index(function(i) i.weight_map["model.norm.weight"] = S1 end))
  end, "holds model.norm.weight, which model.safetensors.index.json puts in " .. S1)
  T.raises(function() hf.from_pretrained(index(function(i) i.weight_map["model.extra"] = S2 end)) end,
    "model.safetensors.index.json puts model.extra in " .. S2 .. ", which has no such tensor")
  T.raises(function() hf.from_pretrained(index(function(i) i.weight_map["model.norm.weight"] = "../x.safetensors" end))
  end, "weight_map[\"model.norm.weight\"] must be a file name in the directory")
  T.raises(function() hf.from_pretrained(index(function(i) i.weight_map = {1, 2} end)) end,
    "weight_map must be an object {tensor name = shard file}")
end)

T.case("checkpoint.lua's aliases: ckpt.from_pretrained, read_config and hf_config are nvlua.hf's", function()
  T.ok(ckpt.from_pretrained == hf.from_pretrained and ckpt.read_config == hf.read_config and
    ckpt.hf_config == hf.config, "the same functions")
  local c, info = ckpt.read_config(DATA .. "/llama31")
  T.eq(c.rope_parameters.rope_type, "llama3")
  T.eq(info.config_ignored, {})
  local none, err = ckpt.read_config(fresh("none"))
  T.eq(none, nil)
  T.ok(tostring(err):find("config.json: No such file", 1, true), "the open error: " .. tostring(err))
end)

T.case("cleanup: the scratch directory is removed", function()
  T.ok(T.rm_tree(ROOT))
end)
