-- test_qload.lua: hf.from_pretrained on quantized checkpoints (nvlua.deploy_read), against the ones
-- the formats' own libraries wrote (tests/golden/qload, scripts/make_quant_fixtures.py: ModelOpt
-- NVFP4, W4A16_NVFP4, FP8, MXFP4; compressed-tensors NVFP4, NVFP4A16, MXFP4, FP8 per tensor and per
-- channel; each beside reference.safetensors, the library's own float32 decode of every quantized
-- linear).
--   * every case loads, each quantized weight equal to the library's decode bit for bit (no
--     tolerance: the same f32 operations in the same order), the others to their stored bf16
--     values; the fixtures tell the libraries' rounding orders apart (the test would see a wrong one);
--   * dtype = "bf16" gives that f32 decode rounded once; the logits equal those of a dense f32 model
--     built from the reference values, bit for bit;
--   * decode = "exact" (one rounding of code * scale * global) reads an nvlua NVFP4 weight written in
--     ModelOpt's layout back as the forward's weight, bit for bit, and so does nvlua.deploy's export
--     where that exporter is in the tree (skipped, saying so, where it is not);
--   * e2m1 x e4m3 and e2m1 x e8m0 products are exact in f32 (all codes, all scales);
--   * malformed checkpoints raise naming the tensor or field: a missing or misshapen scale, wrong
--     dtypes, K not a multiple of the block, exclusion lists that contradict the tensors, unknown
--     algorithms and formats, activation scales that do not match the scheme, bad scales, and the
--     refused quantized = "keep".
local T = require "nvlua.test"
local nv = require "nvlua"
local core = require "nvlua.core"
local hf = require "nvlua.hf"
local st = require "nvlua.safetensors"
local llama = require "nvlua.llama"
local cjson = require "cjson"
local lfs = require "lfs"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local GOLD = here .. "/golden/qload"
local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

local CASES = {"mo_nvfp4", "mo_w4a16", "mo_fp8", "mo_mxfp4", "ct_nvfp4", "ct_nvfp4a16", "ct_mxfp4", "ct_fp8", "ct_fp8_dyn"}
local L0 = "model.layers.0."
-- the linears each case leaves unquantized (the generator's choice)
local EXCLUDED = {mo_nvfp4 = {"lm_head", L0 .. "self_attn.o_proj"}, ct_nvfp4 = {"lm_head", L0 .. "self_attn.o_proj"}}

-- ---- helpers --------------------------------------------------------------------------------------

local function read_json(path) return cjson.decode(assert(T.read_file(path))) end

-- a copy of case's directory (edit(dir) may change it), a fresh directory
local function copy_case(case, name)
  local d = fresh(name or case)
  for n in lfs.dir(GOLD .. "/" .. case) do
    if n ~= "." and n ~= ".." and n ~= "reference.safetensors" then
      T.write_file(d .. "/" .. n, assert(T.read_file(GOLD .. "/" .. case .. "/" .. n)))
    end
  end
  return d
end

local function edit_json(path, fn)
  local c = read_json(path)
  fn(c)
  T.write_file(path, cjson.encode(c))
end

-- The tensors of a safetensors file as raw entries {name = {dtype, shape, bytes}} (fp8 included).
local function raw(path)
  local header, _, layout = assert(st.read_header(path, {f8 = "u8"}))
  local s = assert(T.read_file(path))
  local out = {}
  for name, h in pairs(header) do
    local b, e = h.data_offsets[1], h.data_offsets[2]
    out[name] = {dtype = h.dtype, shape = h.shape, bytes = s:sub(layout.data_start + b + 1, layout.data_start + e)}
  end
  return out
end

-- Write raw entries as a safetensors file (any dtype: the test's own writer, for malformed files).
local function write_raw(path, entries)
  local names = {}
  for n in pairs(entries) do names[#names + 1] = n end
  table.sort(names)
  local parts, data, off = {'"__metadata__":{"format":"pt"}'}, {}, 0
  for _, n in ipairs(names) do
    local e = entries[n]
    parts[#parts + 1] = string.format('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', cjson.encode(n), e.dtype,
      table.concat(e.shape, ","), off, off + #e.bytes)
    data[#data + 1] = e.bytes
    off = off + #e.bytes
  end
  local h = "{" .. table.concat(parts, ",") .. "}"
  h = h .. string.rep(" ", (8 - #h % 8) % 8)
  T.write_file(path, string.pack("<I8", #h) .. h .. table.concat(data))
end

-- a copy of case whose model.safetensors is edited: fn(entries) changes the raw entries
local function edit_tensors(case, name, fn)
  local d = copy_case(case, name)
  local e = raw(d .. "/model.safetensors")
  fn(e)
  write_raw(d .. "/model.safetensors", e)
  return d
end

local function f32_scalar(v) return {dtype = "F32", shape = {}, bytes = string.pack("<f", v)} end

local function refs(case) return st.load(GOLD .. "/" .. case .. "/reference.safetensors") end

local IDS = nv.tensor({{1, 5, 9, 30, 2, 17, 4, 4, 11, 0, 23, 8}, {31, 3, 3, 12, 6, 19, 27, 1, 14, 22, 9, 16}}, "i64")

local function logit_bytes(model) return T.logit_bytes(model, IDS) end

-- ---- decoding ---------------------------------------------------------------------------------------

T.case("every case decodes each quantized weight as its library does, bit for bit", function()
  for _, case in ipairs(CASES) do
    local model, info = hf.from_pretrained(GOLD .. "/" .. case)
    local sd = model:state_dict()
    local ref = refs(case)
    local quantized = {}
    for name, r in pairs(ref) do
      local m = name:match("^(.*)%.ref_f32$")
      quantized[#quantized + 1] = m
      T.ok(sd[m .. ".weight"]:bytes() == r:bytes(), case .. ": " .. m .. " equals the library's float32 decode")
    end
    table.sort(quantized)
    T.eq(info.quantization.quantized, quantized, case .. ": the quantized linears")
    T.eq(info.quantization.excluded, EXCLUDED[case] or {"lm_head"}, case .. ": the linears left unquantized")
    T.eq(#quantized + #info.quantization.excluded, 8, case .. ": 7 linears and the head, each one or the other")
    T.eq(info.missing, {}); T.eq(info.unexpected, {})
    -- every other parameter is its stored bf16 value, widened
    local stored = st.load(GOLD .. "/" .. case .. "/model.safetensors", {f8 = "u8"})
    for name, t in pairs(sd) do
      local m = name:match("^(.*)%.weight$")
      if not ref[(m or "") .. ".ref_f32"] then
        T.eq(stored[name]:dtype(), "bf16", case .. ": " .. name .. " is stored in bf16")
        T.ok(stored[name]:to("f32"):bytes() == t:bytes(), case .. ": " .. name .. " is its stored value")
      end
    end
    -- the activation scales are checked and ignored, nothing else
    for _, n in ipairs(info.ignored) do T.ok(n:find("%.input_g?l?o?b?a?l?_?scale$"), case .. ": ignored " .. n) end
  end
end)

T.case("the fixtures tell the libraries' rounding orders apart: another order would fail the test", function()
  -- ModelOpt: code * fl(scale * weight_scale_2), its code -0 giving +0; compressed-tensors:
  -- code * fl(scale / weight_global_scale). The training forward's order, fl(code * scale * g),
  -- and the other library's each give different bits on these checkpoints.
  local function parts(case, m)
    local ts = st.load(GOLD .. "/" .. case .. "/model.safetensors", {f8 = "u8"})
    return ts, refs(case)[m .. ".ref_f32"]
  end
  local m = L0 .. "mlp.down_proj"
  local ts, ref = parts("mo_nvfp4", m)
  local s = core.decode_scaled(ts[m .. ".weight_scale"], "e4m3", 2)
  local g = ts[m .. ".weight_scale_2"]:get()
  local codes = ts[m .. ".weight"]
  T.ok(core.decode_scaled(codes, "e2m1", 32, s, {global = g, plus_zero = true}):bytes() == ref:bytes(), "ModelOpt's order")
  T.ok(core.decode_scaled(codes, "e2m1", 32, s, {global = g}):bytes() ~= ref:bytes(), "-0 kept differs")
  local exact = core.decode_scaled(codes, "e2m1", 32, s) * g -- one rounding of the exact product
  T.ok(exact:bytes() ~= ref:bytes(), "one rounding of code * scale * g differs")
  ts, ref = parts("ct_nvfp4", m)
  s = core.decode_scaled(ts[m .. ".weight_scale"], "e4m3", 2)
  g = ts[m .. ".weight_global_scale"]:reshape(1):get(1)
  codes = ts[m .. ".weight_packed"]
  T.ok(core.decode_scaled(codes, "e2m1", 32, s, {global = g, divide = true}):bytes() == ref:bytes(),
    "compressed-tensors' order")
  T.ok(core.decode_scaled(codes, "e2m1", 32, s, {global = 1 / g}):bytes() ~= ref:bytes(), "times fl(1/g) differs")
  T.ok(core.decode_scaled(codes, "e2m1", 32, s, {global = g, divide = true, exact = true}):bytes() ~= ref:bytes(),
    "one rounding of code * scale / g differs")
end)

T.case("decode = \"exact\": nvlua's own NVFP4 weight in ModelOpt's layout reads back as the forward's, bit for bit", function()
  -- a weight quantized by nvlua as the NVFP4 recipe quantizes weights (16x16 tiles), its codes, block
  -- scales and decode factor amax / 2688 written where ModelOpt puts them (what nvlua.deploy writes)
  local down = L0 .. "mlp.down_proj"
  local w = nv.randn({32, 32}, {generator = nv.Generator(7)}) * 0.05
  local q = nv.quantize(w, "nvfp4", {block = "2d"})
  local d = edit_tensors("mo_w4a16", "own", function(e)
    e[down .. ".weight"].bytes = q:data():bytes()
    e[down .. ".weight_scale"].bytes = q:scale_bytes():bytes()
    -- amax / 2688 in f32 (the double quotient rounded to f32: the f32 quotient, unless it lay within
    -- 2^-53 of an f32 rounding boundary, which the comparison below would show)
    e[down .. ".weight_scale_2"] = f32_scalar(q.amax / 2688)
  end)
  local deq = q:dequantize():bytes()
  local exact = hf.from_pretrained(d, {decode = "exact"}):state_dict()[down .. ".weight"]:bytes()
  T.ok(exact == deq, "decode = exact gives q:dequantize(), the forward's weight")
  local lib = hf.from_pretrained(d):state_dict()[down .. ".weight"]:bytes()
  T.ok(lib ~= deq, "ModelOpt's own order differs on this weight (the option matters)")
  T.raises(function() hf.from_pretrained(d, {decode = "nvlua"}) end, "decode must be \"library\" or \"exact\"")
end)

T.case("round trip: nvlua.deploy's ModelOpt NVFP4 export reads back as the training forward's weights", function()
  local ok, deploy = pcall(require, "nvlua.deploy")
  if not ok then T.skip("nvlua.deploy (the exporter) is not in this tree: " .. tostring(deploy):match("^[^\n]*")) end
  local cfg = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
    num_key_value_heads = 2, max_position_embeddings = 64}
  local m = llama.Llama(cfg, {recipe = nv.recipe.make("nvfp4"), seed = 1})
  local dir = fresh("roundtrip")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "nvfp4_a16", format = "modelopt"})
  local requantized = {}
  for _, r in ipairs(rep.fused.requantized) do requantized[r.name] = true end
  local back = hf.from_pretrained(dir, {decode = "exact"}):state_dict()
  local sd, n = m:state_dict(), 0
  for i = 0, 1 do
    for _, name in ipairs({"self_attn.o_proj", "mlp.down_proj"}) do -- in no fused group: the forward's own codes
      local full = "model.layers." .. i .. "." .. name
      T.ok(not requantized[full], full .. " is not re-quantized")
      local fwd = nv.quantize(sd[full .. ".weight"], "nvfp4", {block = "2d"}):dequantize() -- the recipe's fprop weight
      T.ok(back[full .. ".weight"]:bytes() == fwd:bytes(), full .. ": the forward's weight, bit for bit")
      n = n + 1
    end
  end
  T.eq(n, 4)
end)

T.case("e2m1 times an e4m3 or e8m0 scale is exact in f32: every code, every scale", function()
  -- an e2m1 value has at most 2 significant bits, an e4m3 one 4: their product fits f32's 24, and
  -- lies in 2^-10 .. 2688 (normal); times a power of two 2^-127 .. 2^127 it stays exact (2^-128 is
  -- an f32 subnormal, 1.5 * 2^-128 too) unless it passes f32's largest value: codes of magnitude
  -- >= 2 with e8m0 2^127, >= 4 with 2^126 give inf (as in the libraries; the loader then refuses
  -- the weight as non-finite). Lua numbers are doubles: the product is computed exactly.
  local codes, bytes = {}, {}
  for c = 0, 15 do codes[#codes + 1] = c end
  for b = 0, 255 do bytes[#bytes + 1] = string.char(b) end
  local packed = {}
  for i = 1, #codes, 2 do packed[#packed + 1] = string.char(codes[i] | (codes[i + 1] << 4)) end
  local row = table.concat(packed)                                      -- the 16 codes, two a byte
  local c8 = core.from_bytes(string.rep(row, 256), "u8", {256, 8})       -- [256 scales, 16 codes]
  local sb = core.from_bytes(table.concat(bytes), "u8", {256, 1})
  for _, fmt in ipairs({"e4m3", "e8m0"}) do
    local s = core.decode_scaled(sb, fmt, 1)
    local w = core.decode_scaled(c8, "e2m1", 16, s)
    local n = 0
    for r = 1, 256 do
      local sv = s:get(r, 1)
      if sv == sv and sv ~= math.huge then -- NaN scales (e4m3 0x7F, 0xFF; e8m0 0xFF) decode to NaN
        for k = 1, 16 do
          local exact = core.codec("e2m1", "decode", k - 1) * sv
          if math.abs(exact) > 0x1.fffffep127 then exact = exact > 0 and math.huge or -math.huge end
          if w:get(r, k) ~= exact or (exact == 0 and 1 / w:get(r, k) ~= 1 / exact) then n = n + 1 end
        end
      end
    end
    T.eq(n, 0, fmt .. ": products that are not the exact value")
  end
end)

T.case("dtype bf16: the f32 decode rounded once (what compressed-tensors' decompressor returns)", function()
  for _, case in ipairs({"ct_nvfp4", "mo_mxfp4", "ct_fp8"}) do
    local model = hf.from_pretrained(GOLD .. "/" .. case, {dtype = "bf16"})
    local sd = model:state_dict()
    for name, r in pairs(refs(case)) do
      local m = name:match("^(.*)%.ref_f32$")
      T.ok(sd[m .. ".weight"]:bytes() == r:to("bf16"):to("f32"):bytes(), case .. ": " .. m)
    end
  end
end)

T.case("the loaded model's logits equal a dense f32 model built from the reference values", function()
  for _, case in ipairs(CASES) do
    local q = hf.from_pretrained(GOLD .. "/" .. case)
    local dense = llama.Llama(q.config, {seed = 1})
    local sd, params = {}, dense:state_dict()
    for name, t in pairs(st.load(GOLD .. "/" .. case .. "/model.safetensors", {f8 = "u8"})) do
      if params[name] and t:dtype() == "bf16" then sd[name] = t:to("f32") end
    end
    for name, r in pairs(refs(case)) do sd[name:gsub("%.ref_f32$", ".weight")] = r end
    dense:load_state_dict(sd)
    T.ok(logit_bytes(q) == logit_bytes(dense), case .. ": logits bit for bit")
  end
end)

T.case("sharded: a weight's codes and scales in different shards are decoded once both are read", function()
  local d = copy_case("ct_nvfp4", "sharded")
  local e = raw(d .. "/model.safetensors")
  os.remove(d .. "/model.safetensors")
  local up = L0 .. "mlp.up_proj"
  local one, two, map = {}, {}, {}
  for name, t in pairs(e) do -- up_proj's scale (and every norm) in the second shard, its codes in the first
    local second = name == up .. ".weight_scale" or name:find("norm")
    if second then two[name] = t else one[name] = t end
    map[name] = second and "model-00002-of-00002.safetensors" or "model-00001-of-00002.safetensors"
  end
  write_raw(d .. "/model-00001-of-00002.safetensors", one)
  write_raw(d .. "/model-00002-of-00002.safetensors", two)
  T.write_file(d .. "/model.safetensors.index.json", cjson.encode({metadata = {}, weight_map = map}))
  local m = hf.from_pretrained(d)
  T.ok(m:state_dict()[up .. ".weight"]:bytes() == refs("ct_nvfp4")[up .. ".ref_f32"]:bytes())
  T.ok(logit_bytes(m) == logit_bytes(hf.from_pretrained(GOLD .. "/ct_nvfp4")), "the same model")
end)

T.case("load_weights reads the quantization from the directory too", function()
  local q = hf.from_pretrained(GOLD .. "/ct_fp8_dyn")
  local m = llama.Llama(q.config, {seed = 3})
  local info = hf.load_weights(m, GOLD .. "/ct_fp8_dyn")
  T.eq(info.quantization.method, "compressed-tensors")
  T.ok(logit_bytes(m) == logit_bytes(q))
end)

T.case("safetensors: fp8 tensors are read as their bytes only when asked", function()
  local path = GOLD .. "/mo_fp8/model.safetensors"
  T.raises(function() st.load(path) end, "dtype F8_E4M3 is not supported by nvlua")
  T.raises(function() st.load(path) end, "fp8 codes are read as u8 bytes with {f8 = \"u8\"}")
  local ts = st.load(path, {f8 = "u8"})
  local w = ts[L0 .. "self_attn.q_proj.weight"]
  T.eq({w:dtype(), w:size(1), w:size(2)}, {"u8", 32, 32})
  T.eq(raw(path)[L0 .. "self_attn.q_proj.weight"].bytes, w:bytes(), "the bytes as stored")
  T.raises(function() st.load(path, {f8 = "f32"}) end, "must be \"u8\"")
end)

-- ---- malformed checkpoints ---------------------------------------------------------------------

T.case("a missing or misshapen scale, wrong dtypes: the error names the tensor", function()
  local function bad(case, name, edit, text)
    T.raises(function() hf.from_pretrained(edit_tensors(case, name, edit)) end, text, name)
  end
  local up = L0 .. "mlp.up_proj"
  bad("mo_nvfp4", "no_scale", function(e) e[up .. ".weight_scale"] = nil end,
    up .. ".weight_scale is missing (ModelOpt NVFP4 stores F8_E4M3 [32,2]")
  bad("mo_nvfp4", "no_scale2", function(e) e[up .. ".weight_scale_2"] = nil end, up .. ".weight_scale_2 is missing")
  bad("ct_nvfp4", "no_gs", function(e) e[up .. ".weight_global_scale"] = nil end, up .. ".weight_global_scale is missing")
  bad("mo_nvfp4", "scale_shape", function(e) e[up .. ".weight_scale"].shape = {64, 1} end,
    up .. ".weight_scale is F8_E4M3 [64,1] in model.safetensors; ModelOpt NVFP4 stores F8_E4M3 [32,2]")
  bad("mo_nvfp4", "scale_dtype", function(e) e[up .. ".weight_scale"].dtype = "U8" end,
    up .. ".weight_scale is U8 [32,2]")
  bad("ct_nvfp4", "codes_shape", function(e) e[up .. ".weight_packed"].shape = {16, 32} end,
    up .. ".weight_packed is U8 [16,32] in model.safetensors; compressed-tensors NVFP4 stores U8 [32,16]")
  bad("ct_mxfp4", "mx_scale", function(e) e[up .. ".weight_scale"].dtype = "F8_E4M3" end,
    up .. ".weight_scale is F8_E4M3 [32,1] in model.safetensors; compressed-tensors mxfp4-pack-quantized stores " ..
    "F8_E8M0, U8 [32,1]")
  bad("mo_fp8", "fp8_codes", function(e) e[up .. ".weight"].dtype = "U8" end,
    up .. ".weight is U8 [32,32] in model.safetensors; ModelOpt FP8 stores F8_E4M3 [32,32]")
  bad("ct_fp8_dyn", "channel", function(e) e[up .. ".weight_scale"].shape = {1, 32} end,
    up .. ".weight_scale is BF16 [1,32] in model.safetensors; compressed-tensors float-quantized stores BF16, F16, F32 " ..
    "[32,1] (one scale per row)")
  bad("mo_nvfp4", "gs_shape", function(e) e[up .. ".weight_scale_2"] = {dtype = "F32", shape = {2},
    bytes = string.rep("\0\0\128\63", 2)} end, up .. ".weight_scale_2 is F32 [2]")
  bad("ct_nvfp4", "zp", function(e) e[up .. ".weight_zero_point"] = f32_scalar(0) end,
    up .. ".weight_zero_point: zero points (asymmetric quantization) are not supported")
end)

T.case("bad scale values: a zero or NaN global scale, a NaN block scale, are refused by name", function()
  local up = L0 .. "mlp.up_proj"
  T.raises(function() hf.from_pretrained(edit_tensors("mo_nvfp4", "g0", function(e)
    e[up .. ".weight_scale_2"] = f32_scalar(0) end)) end, up .. ".weight_scale_2 is 0.0; a scale must be a finite number > 0")
  T.raises(function() hf.from_pretrained(edit_tensors("mo_fp8", "fp8nan", function(e)
    e[up .. ".weight_scale"] = f32_scalar(0 / 0) end)) end, up .. ".weight_scale is")
  T.raises(function() hf.from_pretrained(edit_tensors("ct_nvfp4", "nanblock", function(e)
    local b = e[up .. ".weight_scale"].bytes
    e[up .. ".weight_scale"].bytes = "\127" .. b:sub(2) -- e4m3 0x7F: NaN
  end)) end, up .. ".weight decodes to NaN values (from " .. up .. ".weight_global_scale, " .. up ..
    ".weight_packed, " .. up .. ".weight_scale): the checkpoint is damaged")
end)

T.case("K not a multiple of the block (16 for NVFP4, 32 for MXFP4): the error names the tensor", function()
  -- a model whose intermediate size is 24 (48): gate/up [24, 32] are fine, down_proj's K is not
  local function rows(e, name, n) -- the first n rows of a 2-D entry (repeated when n > its rows)
    local t = e[name]
    local w = #t.bytes // t.shape[1]
    local out = {}
    for r = 0, n - 1 do out[#out + 1] = t.bytes:sub((r % t.shape[1]) * w + 1, (r % t.shape[1] + 1) * w) end
    t.bytes, t.shape = table.concat(out), {n, t.shape[2]}
  end
  for _, c in ipairs({{"mo_nvfp4", 24, 16, "ModelOpt NVFP4"}, {"ct_mxfp4", 48, 32, "compressed-tensors mxfp4"}}) do
    local case, F, block, label = c[1], c[2], c[3], c[4]
    local codes = case == "mo_nvfp4" and ".weight" or ".weight_packed"
    local d = edit_tensors(case, "k_" .. case, function(e)
      for _, p in ipairs({"gate_proj", "up_proj"}) do
        rows(e, L0 .. "mlp." .. p .. codes, F); rows(e, L0 .. "mlp." .. p .. ".weight_scale", F)
      end
    end)
    edit_json(d .. "/config.json", function(cfg) cfg.intermediate_size = F end)
    T.raises(function() hf.from_pretrained(d) end, string.format("%smlp.down_proj%s: K = %d (the model's %smlp.down_proj" ..
      ".weight [32,%d]) is not a multiple of %d, %s", L0, codes, F, L0, F, block, label))
  end
end)

T.case("exclusion lists that contradict the tensors: the error names the tensor", function()
  -- o_proj stored in bf16, but the lists no longer exclude it
  local d = copy_case("mo_nvfp4", "ex_missing")
  edit_json(d .. "/hf_quant_config.json", function(c) c.quantization.exclude_modules = {"lm_head"} end)
  edit_json(d .. "/config.json", function(c) c.quantization_config.ignore = {"lm_head"} end)
  T.raises(function() hf.from_pretrained(d) end, L0 .. "self_attn.o_proj.weight is stored unquantized (BF16 [32,32]), " ..
    "but hf_quant_config.json quantizes " .. L0 .. "self_attn.o_proj (ModelOpt NVFP4; a layer left in high " ..
    "precision must be listed there)")
  d = copy_case("ct_nvfp4", "ct_ex_missing")
  edit_json(d .. "/config.json", function(c) c.quantization_config.ignore = {"lm_head"} end)
  T.raises(function() hf.from_pretrained(d) end, L0 .. "self_attn.o_proj.weight is stored unquantized (BF16 [32,32]), " ..
    "but config.json quantizes")
  -- a quantized layer listed as excluded (by a pattern, a parent's name, a bare name)
  for _, ex in ipairs({"*.down_proj", L0 .. "mlp", "down_proj"}) do
    d = copy_case("mo_w4a16", "ex_extra")
    edit_json(d .. "/hf_quant_config.json", function(c) c.quantization.exclude_modules = {"lm_head", ex} end)
    edit_json(d .. "/config.json", function(c) c.quantization_config.ignore = {"lm_head", ex} end)
    local first = ex == L0 .. "mlp" and "gate" or "down" -- the first linear it excludes, in the model's order
    T.raises(function() hf.from_pretrained(d) end, L0 .. "mlp." .. first .. "_proj.weight is there (U8 [32,16]), but " ..
      "hf_quant_config.json leaves " .. L0 .. "mlp." .. first .. "_proj unquantized (exclude_modules: [lm_head, " .. ex .. "])")
  end
  -- the two ModelOpt configs disagreeing
  d = copy_case("mo_nvfp4", "ex_differ")
  edit_json(d .. "/config.json", function(c) c.quantization_config.ignore = {"lm_head"} end)
  T.raises(function() hf.from_pretrained(d) end, "hf_quant_config.json's exclude_modules and config.json's " ..
    "quantization_config's exclusions differ")
  d = copy_case("mo_nvfp4", "algo_differ")
  edit_json(d .. "/config.json", function(c) c.quantization_config.quant_algo = "FP8" end)
  T.raises(function() hf.from_pretrained(d) end, "hf_quant_config.json says quant_algo NVFP4, config.json's " ..
    "quantization_config FP8")
end)

T.case("ModelOpt's config from either file alone: hf_quant_config.json, or config.json's quantization_config", function()
  local want = hf.from_pretrained(GOLD .. "/mo_nvfp4")
  local d = copy_case("mo_nvfp4", "hq_only")
  edit_json(d .. "/config.json", function(c) c.quantization_config = nil end)
  local m, info = hf.from_pretrained(d)
  T.eq(info.quantization.source, "hf_quant_config.json")
  T.ok(logit_bytes(m) == logit_bytes(want), "the same model")
  d = copy_case("mo_nvfp4", "qc_only")
  os.remove(d .. "/hf_quant_config.json")
  m, info = hf.from_pretrained(d)
  T.eq({info.quantization.method, info.quantization.algo, info.quantization.source}, {"modelopt", "NVFP4", "config.json"})
  T.eq(info.quantization.excluded, {"lm_head", L0 .. "self_attn.o_proj"})
  T.ok(logit_bytes(m) == logit_bytes(want), "the same model")
  -- hf_quant_config.json beside a compressed-tensors config is ambiguous
  d = copy_case("ct_fp8", "both")
  T.write_file(d .. "/hf_quant_config.json", assert(T.read_file(GOLD .. "/mo_fp8/hf_quant_config.json")))
  T.raises(function() hf.from_pretrained(d) end, "has both hf_quant_config.json (ModelOpt) and a compressed-tensors " ..
    "quantization_config in config.json")
end)

T.case("compressed-tensors ignore and targets: names, re: regexes (a subset), the Linear class", function()
  local function with(name, fn)
    local d = copy_case("ct_nvfp4", name)
    edit_json(d .. "/config.json", function(c) fn(c.quantization_config) end)
    return d
  end
  for _, ign in ipairs({{"re:.*o_proj$", "re:lm_head"}, {"re:model\\.layers\\.\\d+\\.self_attn\\.o_.*", "lm_head"},
      {"re:.*[o]_proj", "re:^lm_head$"}}) do
    local m, info = hf.from_pretrained(with("ign", function(q) q.ignore = ign end))
    T.eq(info.quantization.excluded, {"lm_head", L0 .. "self_attn.o_proj"}, table.concat(ign, " "))
    T.ok(m.config ~= nil)
  end
  -- targets by name and by regex instead of the class
  local _, info = hf.from_pretrained(with("targets", function(q)
    q.config_groups.group_0.targets = {"re:.*_proj$"}
    q.ignore = {L0 .. "self_attn.o_proj"}
  end))
  T.eq(#info.quantization.quantized, 6)
  T.raises(function() hf.from_pretrained(with("alt", function(q) q.ignore = {"re:.*(o|lm)_.*"} end)) end,
    "quantization_config.ignore: \"re:.*(o|lm)_.*\": '(' (groups, alternation, counted repeats and inner anchors) " ..
    "is not supported")
  T.raises(function() hf.from_pretrained(with("brace", function(q) q.ignore = {"re:x{2}"} end)) end, "'{'")
  -- a layer targeted by two groups
  T.raises(function() hf.from_pretrained(with("two", function(q)
    q.config_groups.group_1 = q.config_groups.group_0
  end)) end, "is a target of config_groups group_0 and group_1")
end)

T.case("unknown algorithms, formats and methods, and incomplete configs, are refused naming the field", function()
  local function mo(name, fn, text)
    local d = copy_case("mo_nvfp4", name)
    edit_json(d .. "/hf_quant_config.json", function(c) fn(c.quantization) end)
    T.raises(function() hf.from_pretrained(d) end, text, name)
  end
  mo("algo", function(q) q.quant_algo = "NVFP5" end,
    "hf_quant_config.json: quantization.quant_algo \"NVFP5\" is not one nvlua reads (FP8, MXFP4, NVFP4, W4A16_NVFP4)")
  mo("noex", function(q) q.exclude_modules = nil end,
    "hf_quant_config.json: quantization.exclude_modules is missing (engines refuse the file without it; null if none)")
  mo("nokv", function(q) q.kv_cache_quant_algo = nil end, "quantization.kv_cache_quant_algo is missing")
  mo("group", function(q) q.group_size = 32 end, "quantization.group_size is 32; NVFP4 has groups of 16")
  mo("nogroup", function(q) q.group_size = nil end, "quantization.group_size is missing (NVFP4 needs 16)")
  local function ct(name, fn, text)
    local d = copy_case("ct_fp8", name)
    edit_json(d .. "/config.json", function(c) fn(c.quantization_config) end)
    T.raises(function() hf.from_pretrained(d) end, text, name)
  end
  ct("fmt", function(q) q.format = "int-quantized"; q.config_groups.group_0.format = nil end,
    "config_groups.group_0: format \"int-quantized\" is not one nvlua reads (float-quantized, mxfp4-pack-quantized, " ..
    "nvfp4-pack-quantized)")
  ct("bits", function(q) q.config_groups.group_0.weights.num_bits = 4 end,
    "config_groups.group_0.weights: float-quantized with num_bits 4")
  ct("strategy", function(q) q.config_groups.group_0.weights.strategy = "block" end,
    "config_groups.group_0.weights.strategy \"block\": float-quantized stores channel, tensor")
  ct("status", function(q) q.quantization_status = "frozen" end, "quantization_status is \"frozen\"")
  ct("method", function(q) q.quant_method = "gptq" end,
    "quantization_config.quant_method \"gptq\" is not one nvlua reads (modelopt, compressed-tensors)")
  ct("transform", function(q) q.transform_config = {config_groups = {}} end,
    "transform_config is set: sparse or transformed (rotated) weights are not supported")
  ct("nogroups", function(q) q.config_groups = {} end, "config_groups must be a non-empty object")
end)

T.case("activation scales: missing for a static scheme or present for a weight-only one", function()
  -- not needed to load the weights, but an engine refuses such a checkpoint: strict raises, naming
  -- them; strict = false loads and lists them
  local q = L0 .. "self_attn.q_proj"
  local d = edit_tensors("mo_nvfp4", "no_input", function(e) e[q .. ".input_scale"] = nil end)
  T.raises(function() hf.from_pretrained(d) end, "missing: " .. q .. ".input_scale) (activation scales:")
  local _, info = hf.from_pretrained(d, {strict = false})
  T.eq(info.missing, {q .. ".input_scale"})
  d = edit_tensors("mo_w4a16", "stray_input", function(e) e[q .. ".input_scale"] = f32_scalar(0.5) end)
  T.raises(function() hf.from_pretrained(d) end, "unexpected: " .. q .. ".input_scale) (activation scales:")
  _, info = hf.from_pretrained(d, {strict = false})
  T.eq(info.unexpected, {q .. ".input_scale"})
  d = edit_tensors("ct_nvfp4", "input_dtype", function(e) e[q .. ".input_global_scale"].dtype = "I32" end)
  T.raises(function() hf.from_pretrained(d) end, q .. ".input_global_scale is I32 [1]")
  -- KV-cache scales: ignored where the config declares a quantized KV cache, else unexpected
  d = edit_tensors("mo_fp8", "kv", function(e) e[L0 .. "self_attn.k_proj.k_scale"] = f32_scalar(1) end)
  T.raises(function() hf.from_pretrained(d) end, "unexpected: " .. L0 .. "self_attn.k_proj.k_scale")
  edit_json(d .. "/hf_quant_config.json", function(c) c.quantization.kv_cache_quant_algo = "FP8" end)
  _, info = hf.from_pretrained(d)
  local n = 0
  for _, name in ipairs(info.ignored) do if name == L0 .. "self_attn.k_proj.k_scale" then n = n + 1 end end
  T.eq(n, 1, "the KV-cache scale is ignored")
end)

T.case("quantized = \"keep\" is refused with the reason; bad values name the option", function()
  T.raises(function() hf.from_pretrained(GOLD .. "/mo_nvfp4", {quantized = "keep"}) end,
    "\"keep\" (the weights as QTensors for the forward) is not supported yet")
  T.raises(function() hf.from_pretrained(GOLD .. "/mo_nvfp4", {quantized = "dequantise"}) end,
    "quantized must be \"dequantize\"")
  local m = hf.from_pretrained(GOLD .. "/mo_nvfp4", {quantized = "dequantize"})
  T.ok(m ~= nil)
end)

T.case("core.decode_scaled: bad arguments", function()
  local c = core.from_bytes(string.rep("\0", 32), "u8", {4, 8})
  T.raises(function() core.decode_scaled(c, "e2m1", 8) end, "K = 8 does not match codes [4, 8] of e2m1")
  T.raises(function() core.decode_scaled(c, "e9m9", 8) end, "unknown element format 'e9m9'")
  T.raises(function() core.decode_scaled(c, "e4m3", 8, nv.zeros(4, 3)) end, "scales [4, 3] do not block [4, 8]")
  T.raises(function() core.decode_scaled(c:to("f32"), "e4m3", 8) end, "codes must be a 2-D contiguous u8 tensor")
  T.raises(function() core.decode_scaled(c, "e4m3", 8, nv.ones(1, 2), {global = "2"}) end, "global must be a number")
  T.eq(core.decode_scaled(c, "e4m3", 8, nv.ones(1, 2), {global = 2.0}):sum(), 0.0)
end)

T.case("cleanup: the scratch directory is removed", function()
  T.ok(T.rm_tree(ROOT))
end)
