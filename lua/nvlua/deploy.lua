-- nvlua.deploy: quantized checkpoints that inference engines load, holding the training forward's own
-- codes and scales: NVIDIA ModelOpt's layout (hf_quant_config.json; vLLM, SGLang, TensorRT-LLM) and
-- compressed-tensors' (llm-compressor's; vLLM, transformers), in NVFP4 (W4A4 and weight-only), MXFP4
-- and per-tensor FP8.
--   local files, report = hf.save_pretrained(model, dir, {quantize = "nvfp4", format = "modelopt",
--     calibration = batches})                    -- = deploy.save_pretrained; scripts/export.lua
--   deploy.FORMATS[format][quantize]             -- each layout's tensors and config, for readers too
--   local rows = deploy.quantize(model, o)       -- what an export writes, as QTensors (deploy.free(rows))
--
-- Which linears are quantized. Not the LM head, nor what is no linear (embeddings, norms): they stay
-- bf16, as every linear left out does, and the linears left out are listed in exclude_modules (ModelOpt)
-- or ignore (compressed-tensors) by their exact module names. Without an exclude list, a linear is
-- quantized where its recipe quantizes its fprop weight (a layer the recipe keeps in bf16 is left
-- out), and every linear but the head when the recipe quantizes none (a model trained in bf16);
-- with one, every linear but those named and the head.
-- Where the weight comes from (report.layers[i].status):
--   "trained"  the recipe's fprop weight is in the export's format: the codes and scales are the ones
--              recipe:fprop_weight gives, the call linear_forward makes (16x16 NVFP4 tiles: each tile's
--              e4m3 scale on each of its 16 rows, which is lossless in the 1x16 layout engines read)
--   "ptq"      a post-training quantization of the master weight (another format, RHT weights, MoR,
--              a bf16 model): NVFP4 1x16 and MXFP4 1x32 blocks, FP8 per tensor, RTN, as nv.quantize
--              makes them; the report says why
--   "kept"     the model was loaded from a quantized checkpoint (hf.from_pretrained keeps what it read:
--              model.quantized_source) and this weight is unchanged since (its fingerprint, a CRC-32C of
--              its bytes): the codes, block scales and global scale read are written back as they were,
--              so export -> from_pretrained -> export gives the same files. Re-quantizing the decoded
--              weight would not: its amax is at most the original's, and the scales move with it. A
--              fine-tuned (changed) weight is quantized as above, and the report says it changed.
-- A loaded checkpoint's choice of linears stands (without exclude): the linears it left unquantized
-- are excluded, the ones it quantized are quantized. Between layouts of the same codes (ModelOpt <->
-- compressed-tensors NVFP4, MXFP4 and per-tensor FP8, W4A4 <-> weight-only) the codes and block scales
-- pass through byte for byte; NVFP4's global scale changes convention, weight_global_scale = 1 /
-- weight_scale_2 (and input_global_scale = 1 / input_scale), computed as compressed-tensors' ModelOpt
-- converter does, one f32 division (here in double, then rounded to f32: the same value, as 53 >= 2 *
-- 24 + 2 bits). fl(1 / fl(1 / x)) is not always x: a conversion there and back may move a global
-- scale by an ulp (nvlua's own exports write both from the amax, fl(amax / 2688) and fl(2688 / amax)).
-- The activation scales read are written back too (changed weight or not: they describe the layer's
-- input), unless calibration = batches measures new ones; a layout that needs them from a checkpoint
-- without them needs calibration.
-- Fused groups: engines run q/k/v (and gate/up) as one GEMM with one global weight scale (vLLM takes the
-- largest and keeps the block scales: the others then decode wrong). Where the members' amaxes differ,
-- all are quantized again with the group's largest amax (the recipe's spec, the amax given): report.fused
-- says how many and the weight error it brings (max |dw|, rms dw / rms w, against the training's).
-- A recipe that shares the amax over the group (recipe option fused_amax) gives equal amaxes: nothing
-- is re-quantized. A loaded group is kept whole or not at all: if one member changed, all are quantized
-- (NVFP4, FP8: their global scale is one; MXFP4 members are kept one by one).
-- Calibration (W4A4 NVFP4, FP8): the batches run through the model under its recipe (eval mode); each
-- quantized linear's input amax is the max over them and over its fused group, written as the scale
-- nvlua's quantizer gives for that amax (ModelOpt's input_scale: the decode factor, amax / 2688 for
-- NVFP4; compressed-tensors' input_global_scale: the encode scale 2688 / amax; FP8: 1 / (448 / amax)).
-- The recipe's state (SR generator, delayed-scaling histories) is put back afterwards: an export
-- changes nothing in a run.
-- Not here: reading these checkpoints (nvlua.deploy_read), GGUF, MXFP8, the KV cache's quantization.
local cjson = require "cjson"
local nv = require "nvlua"
local core = require "nvlua.core"
local dr = require "nvlua.deploy_read"
local hf = require "nvlua.hf"
local nn = require "nvlua.nn"
local st = require "nvlua.safetensors"
local util = require "nvlua.util"
local user_error = util.user_error

local deploy = {}

-- ---- the formats ------------------------------------------------------------------------------
--
-- deploy.FORMATS[format][quantize] = {nvlua = the nvlua format of the codes, group = elements per block
-- scale (0: per tensor), tensors = {{suffix, dtype, shape, value}, ...}: what each quantized linear
-- "<module>" stores as "<module>.<suffix>", plus the layout's config fields}. shape is a list of
-- dimensions in N (out features) and K (in features): "N,K/2", "" for a 0-d tensor (deploy.shape).
-- value says what the tensor holds:
--   codes         the element codes: e2m1 two per byte, the element of even index in the low nibble;
--                 e4m3 one per byte (the F8_E4M3 dtype)
--   block_scales  one byte per block, row-major [N, K/group]: ue4m3 (F8_E4M3) for NVFP4, e8m0 (U8,
--                 2^(e-127)) for MXFP4
--   dec_scale     the tensor's decode factor, f32: NVFP4 amax / 2688 (= 1 / s_enc; nvlua's dequantize
--                 and GEMMs multiply by it), FP8 1 / scale
--   enc_scale     the tensor's encode scale s_enc = 2688 / amax, f32 (compressed-tensors divides by it)
--   input_dec_scale, input_enc_scale   the same two for the calibrated activation amax
-- Decoding: w = value(code) * value(block scale) * dec_scale (ModelOpt, nvlua, vLLM's modelopt path: the
-- training's values bit for bit), or value(code) * (value(block scale) / enc_scale) (compressed-tensors'
-- decompressor; it then rounds to bf16); FP8: value(code) * weight_scale.
-- Checked against ModelOpt's export (unified_export_hf.py, convert_hf_config.py), compressed-tensors
-- 0.20.1 (NVFP4PackedCompressor, MXFP4PackedCompressor, the float-quantized compressor, its presets
-- NVFP4, NVFP4A16, MXFP4, FP8 and its ModelOpt NVFP4 converter) and vLLM's loaders (modelopt.py,
-- compressed_tensors_w4a4_nvfp4.py); scripts/check_deploy.py runs compressed-tensors and transformers
-- on the exports.
local NVFP4_W = {
  {suffix = "weight", dtype = "U8", shape = "N,K/2", value = "codes"},
  {suffix = "weight_scale", dtype = "F8_E4M3", shape = "N,K/16", value = "block_scales"},
  {suffix = "weight_scale_2", dtype = "F32", shape = "", value = "dec_scale"},
}
local NVFP4_CT = {
  {suffix = "weight_packed", dtype = "U8", shape = "N,K/2", value = "codes"},
  {suffix = "weight_scale", dtype = "F8_E4M3", shape = "N,K/16", value = "block_scales"},
  {suffix = "weight_global_scale", dtype = "F32", shape = "1", value = "enc_scale"},
}
local function with(list, extra)
  local out = {table.unpack(list)}
  out[#out + 1] = extra
  return out
end

-- compressed-tensors' quantization args (its presets, as its model_dump writes them)
local function ct_args(bits, strategy, group, dynamic, scale_dtype, observer)
  return {num_bits = bits, type = "float", strategy = strategy, group_size = group or cjson.null, symmetric = true,
    dynamic = dynamic, scale_dtype = scale_dtype, observer = observer}
end
local CT_NVFP4_W = ct_args(4, "tensor_group", 16, false, "torch.float8_e4m3fn")

deploy.FORMATS = {
  modelopt = {
    nvfp4 = {nvlua = "nvfp4", group = 16, quant_algo = "NVFP4",
      tensors = with(NVFP4_W, {suffix = "input_scale", dtype = "F32", shape = "", value = "input_dec_scale"})},
    nvfp4_a16 = {nvlua = "nvfp4", group = 16, quant_algo = "W4A16_NVFP4", tensors = NVFP4_W},
    fp8 = {nvlua = "e4m3", group = 0, quant_algo = "FP8", tensors = {
      {suffix = "weight", dtype = "F8_E4M3", shape = "N,K", value = "codes"},
      {suffix = "weight_scale", dtype = "F32", shape = "", value = "dec_scale"},
      {suffix = "input_scale", dtype = "F32", shape = "", value = "input_dec_scale"}}},
  },
  ["compressed-tensors"] = {
    nvfp4 = {nvlua = "nvfp4", group = 16, format = "nvfp4-pack-quantized",
      tensors = with(NVFP4_CT, {suffix = "input_global_scale", dtype = "F32", shape = "1", value = "input_enc_scale"}),
      weights = CT_NVFP4_W,
      input_activations = ct_args(4, "tensor_group", 16, "local", "torch.float8_e4m3fn", "static_minmax")},
    nvfp4_a16 = {nvlua = "nvfp4", group = 16, format = "nvfp4-pack-quantized", tensors = NVFP4_CT, weights = CT_NVFP4_W},
    mxfp4 = {nvlua = "mxfp4", group = 32, format = "mxfp4-pack-quantized", tensors = {
      {suffix = "weight_packed", dtype = "U8", shape = "N,K/2", value = "codes"},
      {suffix = "weight_scale", dtype = "U8", shape = "N,K/32", value = "block_scales"}},
      weights = ct_args(4, "group", 32, false, "torch.uint8"),
      input_activations = ct_args(4, "group", 32, true, "torch.uint8")},
    fp8 = {nvlua = "e4m3", group = 0, format = "float-quantized", tensors = {
      {suffix = "weight", dtype = "F8_E4M3", shape = "N,K", value = "codes"},
      {suffix = "weight_scale", dtype = "F32", shape = "1", value = "dec_scale"},
      {suffix = "input_scale", dtype = "F32", shape = "1", value = "input_dec_scale"}},
      weights = ct_args(8, "tensor", nil, false),
      input_activations = ct_args(8, "tensor", nil, false, nil, "static_minmax")},
  },
}
deploy.FORMAT_NAMES = {"modelopt", "compressed-tensors"}
deploy.QUANTIZE_NAMES = {"nvfp4", "nvfp4_a16", "mxfp4", "fp8"}
-- the compressed-tensors release whose layout and config the exports follow (config.json's "version")
deploy.CT_VERSION = "0.20.1"

--- deploy.FUSED: the linears engines fuse into one GEMM (vLLM's packed_modules_mapping for Llama:
-- qkv_proj, gate_up_proj), by their names under a block
deploy.FUSED = {{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {"mlp.gate_proj", "mlp.up_proj"}}

--- deploy.shape(spec, N, K) -> the dims of a FORMATS tensor shape ("N,K/2", "1", "") for a weight [N, K]
function deploy.shape(spec, N, K)
  local dims = {}
  for part in spec:gmatch("[^,]+") do
    local v = ({N = N, K = K})[part:match("^(%a)")] or tonumber(part)
    local d = part:match("/(%d+)$")
    dims[#dims + 1] = d and v // tonumber(d) or v
  end
  return dims
end

-- the group key of a linear ("model.layers.3.qkv"), nil outside a fused group
local function fused_key(name)
  for gi, g in ipairs(deploy.FUSED) do
    for _, member in ipairs(g) do
      local prefix = name:sub(1, #name - #member - 1)
      if #name > #member and name:sub(-#member - 1) == "." .. member then return prefix .. "#" .. gi end
    end
  end
end

-- ---- options ----------------------------------------------------------------------------------

local function check_list(v)
  if type(v) ~= "table" then return "must be a list of linear module names" end
  for i, x in ipairs(v) do if type(x) ~= "string" then return "must be a list of strings (entry " .. i .. " is not)" end end
end

local OPTS = {quantize = true, format = true, calibration = true, exclude = check_list, max_shard_size = true,
  bos_token_id = hf.token_id, eos_token_id = hf.token_id,
  progress = function(v) return type(v) ~= "function" and "must be a function" or nil end}

-- o checked -> the FORMATS entry, its format name
local function layout(o)
  if not deploy.FORMATS.modelopt[o.quantize] and not deploy.FORMATS["compressed-tensors"][o.quantize] then
    user_error(string.format("save_pretrained: quantize must be one of %s, got %s%s", table.concat(deploy.QUANTIZE_NAMES, ", "),
      tostring(o.quantize), util.suggest(o.quantize, deploy.QUANTIZE_NAMES)), 0)
  end
  local format = o.format
  if format == nil then -- the first layout that has it
    for _, f in ipairs(deploy.FORMAT_NAMES) do
      if deploy.FORMATS[f][o.quantize] then format = f; break end
    end
  end
  if not deploy.FORMATS[format] then
    user_error(string.format("save_pretrained: format must be one of %s, got %s%s", table.concat(deploy.FORMAT_NAMES, ", "),
      tostring(format), util.suggest(format, deploy.FORMAT_NAMES)), 0)
  end
  local f = deploy.FORMATS[format][o.quantize]
  if not f then
    user_error(string.format("save_pretrained: format %s has no %s layout (it has %s)", format, o.quantize,
      table.concat(util.sorted_keys(deploy.FORMATS[format]), ", ")), 0)
  end
  return f, format
end

local function needs_input(f)
  for _, t in ipairs(f.tensors) do if t.value:match("^input_") then return true end end
  return false
end

-- ---- the plan: which linears, from where ------------------------------------------------------------

local function recipe_of(l) return l.module.recipe or nn.default_recipe() end

local function ctx_of(model, l)
  local ctx = l.module:context()
  ctx.step = model.step or ctx.step -- the step the model is at (a recipe may switch formats by step)
  return ctx
end

-- deploy_read's kind of each nvlua format of the codes
local KIND = {nvfp4 = "nvfp4", mxfp4 = "mxfp4", e4m3 = "fp8"}

-- A model loaded from a quantized checkpoint (src = model.quantized_source): its choice of linears
-- (without o.exclude), and row.src (what was read) and status "kept" where the weight is unchanged and
-- layout f holds the same codes (see the header).
local function overlay_source(rows, f, src, o)
  local from = "the checkpoint it was loaded from (" .. src.label .. ")"
  for _, row in ipairs(rows) do
    if not row.head then
      if not o.exclude and not src.quantized[row.name] then
        row.status, row.why, row.spec = "excluded", "left unquantized in " .. from, nil
      elseif not o.exclude and row.status == "excluded" then
        row.status, row.why = "ptq", "quantized in " .. from
      end
      local k = src.layers[row.name]
      if k and row.status ~= "excluded" then
        row.src = k
        if k.kind ~= KIND[f.nvlua] then
          row.why = (row.why and row.why .. "; " or "") .. "read as " .. k.kind .. " from " .. from
        elseif dr.fingerprint(row.module.weight_entry.param) ~= k.fingerprint then
          row.why = (row.why and row.why .. "; " or "") .. "changed since it was loaded from " .. from
        else
          row.keep = true
        end
      end
    end
  end
  if f.group ~= 32 then -- one global scale per fused group: kept whole or not at all
    local changed = {}
    for _, row in ipairs(rows) do
      if row.group and row.status ~= "excluded" and not row.keep then changed[row.group] = changed[row.group] or row.name end
    end
    for _, row in ipairs(rows) do
      if row.keep and changed[row.group] then
        row.keep = nil
        row.why = (row.why and row.why .. "; " or "") .. "its fused group's " .. changed[row.group] .. " is quantized anew"
      end
    end
  end
  for _, row in ipairs(rows) do
    if row.keep then row.status, row.why, row.spec, row.keep = "kept", "written as read from " .. from, nil, nil end
  end
end

--- deploy.plan(model, {quantize =, format =, exclude =}) -> rows, one per linear in model:linears() order:
-- {name, module, block, status = "trained" | "ptq" | "kept" | "excluded", why (a phrase, for ptq, kept and
-- excluded), spec (the recipe's fprop weight spec, for trained), group (the fused group's key, or nil),
-- src (for a model loaded from a quantized checkpoint: what was read of this linear, model.quantized_source)}.
function deploy.plan(model, o)
  local f = layout(o)
  if model.shards then -- (nvlua.shard) each rank holds rows of the weights, whose quantization is the whole's
    user_error("save_pretrained: the model is sharded (shard=grads|full): export one loaded whole " ..
      "(hf.from_pretrained of its checkpoint; scripts/export.lua does)", 0)
  end
  local lin = model:linears()
  local rows, by_name = {}, {}
  for _, l in ipairs(lin) do by_name[l.name] = l end
  local excluded = {}
  if o.exclude then
    local all = {}
    for _, l in ipairs(lin) do all[#all + 1] = l.name end
    for _, n in ipairs(o.exclude) do
      if not by_name[n] then
        user_error(string.format("save_pretrained: exclude names %s, which is not a linear of the model (they are " ..
          "named like %s)%s", n, all[1] or "?", util.suggest(n, all)), 0)
      end
      excluded[n] = true
    end
  end
  local any_low = false -- does the recipe quantize any fprop weight? (if not: a bf16 model, quantized after training)
  for _, l in ipairs(lin) do
    local r = recipe_of(l)
    local ctx = ctx_of(model, l)
    local row = {name = l.name, module = l.module, block = l.block, group = fused_key(l.name), head = l.high_precision}
    local spec = r.mor == nil and r:spec(ctx, "fprop", "w") or nil
    local low = spec and spec.format ~= "bf16" and spec.format ~= "f32"
    if l.high_precision then
      row.status, row.why = "excluded", "the LM head stays in bf16"
    elseif excluded[l.name] then
      row.status, row.why = "excluded", "named in exclude"
    elseif r.mor ~= nil then
      row.status, row.why, any_low = "ptq", "MoR chooses its formats as it runs", true
    elseif low and spec.format == f.nvlua and not spec.rht then
      row.status, row.spec, any_low = "trained", spec, true
    elseif low then
      row.status, row.why, any_low = "ptq", spec.rht and "the recipe rotates this weight (RHT)" or
        "trained in " .. spec.format, true
    else
      row.status, row.why = o.exclude and "ptq" or "excluded", o.exclude and "trained in " .. spec.format or
        "the recipe keeps it in " .. spec.format
    end
    rows[#rows + 1] = row
  end
  if not any_low and not o.exclude then -- nothing quantized in training: every linear but the head, after it
    for _, row in ipairs(rows) do
      if not row.head then
        row.status, row.why = "ptq", "trained in " .. recipe_of(row):spec(ctx_of(model, row), "fprop", "w").format
      end
    end
  end
  if model.quantized_source then overlay_source(rows, f, model.quantized_source, o) end
  -- engines quantize a fused group's members alike
  local groups = {}
  for _, row in ipairs(rows) do
    if row.group then
      local g = groups[row.group] or {}
      groups[row.group] = g
      g[#g + 1] = row
    end
  end
  for _, g in pairs(groups) do
    local q, x = {}, {}
    for _, row in ipairs(g) do
      if row.status == "excluded" then x[#x + 1] = row.name else q[#q + 1] = row.name end
    end
    if #q > 0 and #x > 0 then
      user_error(string.format("save_pretrained: %s would be quantized but %s not; engines run them as one fused linear " ..
        "and need them quantized alike (name all of them in exclude, or none)", table.concat(q, ", "), table.concat(x, ", ")), 0)
    end
  end
  return rows
end

-- ---- quantizing -------------------------------------------------------------------------------------

-- nv.quantize's options for a weight [N, K] blocked along K under spec (the recipe's) with amax given
local function weight_opts(spec, amax)
  local o = {axis = 2, amax = amax}
  if spec then
    if spec.block == "2d" then o.block = "2d" end
    if spec.scale_rule then o.scale_rule = spec.scale_rule end
  end
  return o
end

-- the nvfp4 / fp8 scale nvlua's quantizer gives for amax a: {dec =, enc =}
local function scales_for(fmt, a)
  return nv.scope(function()
    local q = nv.quantize(nv.zeros({1, fmt == "nvfp4" and 16 or 1}), fmt, {amax = a})
    return {dec = q.dec_scale, enc = q.scale}
  end)
end

-- max |a - b| and rms(a - b) / rms(b) of two f32 tensors
local function weight_error(a, b)
  return nv.scope(function()
    local d = a - b
    local n2 = core.sumsq(b)
    return {max = d:amax(), rms = n2 > 0 and math.sqrt(core.sumsq(d) / n2) or 0}
  end)
end

-- The quantized weight of every row neither excluded nor kept: row.q (unscoped, freed by the caller),
-- row.amax.
local function quantize_rows(model, rows, f, progress)
  local n = 0
  for _, row in ipairs(rows) do if row.status ~= "excluded" then n = n + 1 end end
  local i = 0
  for _, row in ipairs(rows) do
    if row.status == "kept" then
      i = i + 1
      if progress then progress({layer = row.name, status = row.status, i = i, n = n}) end
    elseif row.status ~= "excluded" then
      local w = row.module.weight_entry.param
      local K = w:size(2)
      local need = f.group == 0 and 1 or f.group
      if K % need ~= 0 then
        user_error(string.format("save_pretrained: %s has %d input features, not a multiple of %s's block of %d; " ..
          "leave it out with exclude", row.name, K, f.nvlua, need), 0)
      end
      local a = w:amax() -- (NaN propagates: a damaged weight is refused, not encoded)
      if a ~= a or a == math.huge then
        user_error(string.format("save_pretrained: %s's weight holds %s", row.name, a ~= a and "NaN" or "an infinity"), 0)
      end
      local q
      if row.status == "trained" then
        local spec
        spec, q = recipe_of(row):fprop_weight(ctx_of(model, row), w)
        assert(spec and q and q:format() == f.nvlua and q:axis() == 2, "deploy: the recipe's fprop weight is not the planned one")
        q = q:share() -- our own handle (a weight cache's copy stays the cache's)
      else
        q = nv.quantize(w, f.nvlua, {axis = 2})
      end
      row.q, row.amax = core.unscope(q), q.amax
      i = i + 1
      if progress then progress({layer = row.name, status = row.status, i = i, n = n}) end
    end
  end
end

-- Fused groups whose members' amaxes differ: every member quantized again with the largest (formats
-- with a tensor scale). -> {groups =, requantized = {{name, trained, max, rms}, ...}}
local function share_group_scales(rows, f)
  local out = {groups = 0, requantized = {}}
  if f.group == 32 then return out end -- MXFP4: no tensor scale
  local groups, order = {}, {}
  for _, row in ipairs(rows) do
    if row.group and row.q then -- (a kept group's members are all kept)
      if not groups[row.group] then groups[row.group] = {}; order[#order + 1] = row.group end
      table.insert(groups[row.group], row)
    end
  end
  for _, key in ipairs(order) do
    local g = groups[key]
    out.groups = out.groups + 1
    local top = 0
    for _, row in ipairs(g) do top = math.max(top, row.amax) end
    for _, row in ipairs(g) do
      if row.amax ~= top then
        local w = row.module.weight_entry.param
        local q2 = core.unscope(nv.quantize(w, f.nvlua, weight_opts(row.spec, top)))
        local e = nv.scope(function() return weight_error(q2:dequantize(), row.q:dequantize()) end)
        out.requantized[#out.requantized + 1] = {name = row.name, trained = row.status == "trained", max = e.max, rms = e.rms,
          amax = row.amax, group_amax = top}
        row.q:free()
        row.q, row.amax, row.requantized = q2, top, e
      end
    end
  end
  return out
end

-- ---- calibration --------------------------------------------------------------------------------------

-- calibration: a list of batches, or a function returning the next (nil: done); a batch is ids (i64 [B, T])
-- or {ids, targets}
local function batches(cal)
  if type(cal) == "function" then
    return function()
      local b = cal()
      return type(b) == "table" and b[1] or b
    end
  end
  if type(cal) ~= "table" then
    user_error("save_pretrained: calibration must be a list of batches (i64 [B, T] token ids) or a function returning " ..
      "the next one, got " .. type(cal), 0)
  end
  local i = 0
  return function()
    i = i + 1
    local b = cal[i]
    return type(b) == "table" and b[1] or b
  end
end

-- Each quantized linear's input amax over the batches (the model in eval mode under its recipe),
-- then the max over its fused group. -> {name = amax}, batches run
local function calibrate(model, rows, cal, progress)
  local amax, mods = {}, {}
  for _, row in ipairs(rows) do
    if row.status ~= "excluded" then mods[#mods + 1] = row.module end
  end
  local nb = 0
  for _, m in ipairs(mods) do
    m.forward = function(self, x) -- the layer's input, observed (the instance field shadows the class's)
      local a = x:amax()
      if a ~= a or a == math.huge then
        user_error(string.format("save_pretrained: calibration batch %d: the input of %s holds %s", nb, self.name,
          a ~= a and "NaN" or "an infinity"), 0)
      end
      amax[self.name] = math.max(amax[self.name] or 0, a)
      return nn.Linear.forward(self, x)
    end
  end
  local was = model.training
  model:eval()
  local ok, err = pcall(function()
    for ids in batches(cal) do
      nb = nb + 1
      if not nv.is_tensor(ids) then
        user_error(string.format("save_pretrained: calibration batch %d is a %s, not an i64 [B, T] tensor of token ids", nb,
          type(ids)), 0)
      end
      nv.scope(function() model:forward(ids) end)
      if progress then progress({calibration = nb}) end
    end
  end)
  for _, m in ipairs(mods) do m.forward = nil end
  model:train(was)
  if not ok then error(err, 0) end
  if nb == 0 then user_error("save_pretrained: calibration holds no batch", 0) end
  local top = {}
  for _, row in ipairs(rows) do
    if row.group and amax[row.name] then top[row.group] = math.max(top[row.group] or 0, amax[row.name]) end
  end
  for _, row in ipairs(rows) do
    if row.group and amax[row.name] then amax[row.name] = top[row.group] end
  end
  return amax, nb
end

-- ---- the files ----------------------------------------------------------------------------------------

local function excluded_names(rows)
  local out = {}
  for _, row in ipairs(rows) do if row.status == "excluded" then out[#out + 1] = row.name end end
  return out
end

-- a scale as an f32 tensor of a FORMATS shape ("" or "1")
local function scalar(v, shape) return nv.full(shape == "" and {} or {1}, v) end

-- a scale v read as an encode scale (is_enc) or a decode factor, as the other when want_enc differs
-- (1 / v, rounded to f32 when it is stored; see the header)
local function as_scale(v, is_enc, want_enc) return (is_enc == true) == want_enc and v or 1 / v end

-- The tensors of one quantized row under layout f (calibrated input amax a, or nil: the activation
-- scale read, row.src.input).
local function row_tensors(row, f, a, out)
  local q, N, K = row.q, row.module.out_features, row.module.in_features
  local k = row.status == "kept" and row.src
  local inp
  if needs_input(f) and a then
    inp = scales_for(f.nvlua, a)
  elseif needs_input(f) then
    local s = assert(row.src and row.src.input, "deploy: no input scale for " .. row.name)
    inp = {dec = as_scale(s, row.src.input_enc, false), enc = as_scale(s, row.src.input_enc, true)}
  end
  for _, t in ipairs(f.tensors) do
    local v
    if t.value == "codes" then v = k and k.codes or q:data()
    elseif t.value == "block_scales" then v = k and k.scales or q:scale_bytes()
    elseif t.value == "dec_scale" then v = scalar(k and as_scale(k.global, k.global_enc, false) or q.dec_scale, t.shape)
    elseif t.value == "enc_scale" then v = scalar(k and as_scale(k.global, k.global_enc, true) or q.scale, t.shape)
    elseif t.value == "input_dec_scale" then v = scalar(inp.dec, t.shape)
    elseif t.value == "input_enc_scale" then v = scalar(inp.enc, t.shape)
    end
    if nv.is_tensor(v) and v:dtype() == "u8" and t.dtype ~= "U8" then v = st.typed(v, t.dtype) end
    local want = deploy.shape(t.shape, N, K)
    local got = (nv.is_tensor(v) and v or v.t):size()
    assert(util.same_shape(got, want), "deploy: " .. row.name .. "." .. t.suffix .. " has the wrong shape")
    out[row.name .. "." .. t.suffix] = v
  end
end

local function quant_config(f, format, rows)
  local ex = excluded_names(rows)
  if format == "modelopt" then
    local q = {quant_algo = f.quant_algo, kv_cache_quant_algo = cjson.null, exclude_modules = ex}
    if f.group > 0 then q.group_size = f.group end
    local file = {producer = {name = "nvlua", version = nv.version}, quantization = q}
    -- config.json gets what ModelOpt writes there (convert_hf_quant_config_format): the flat form,
    -- compressed-tensors-like groups, ignore for exclude_modules (vLLM reads quant_algo, ignore, the
    -- group size from config_groups, and a KV-cache scheme only when there is one)
    local args = {dynamic = false, num_bits = f.nvlua == "e4m3" and 8 or 4, type = "float",
      group_size = f.group > 0 and f.group or nil}
    local cfg = {config_groups = {group_0 = {weights = args, input_activations = needs_input(f) and args or nil,
      targets = {"Linear"}}}, ignore = ex, quant_algo = f.quant_algo, producer = file.producer, quant_method = "modelopt"}
    return cfg, file
  end
  return {config_groups = {group_0 = {format = cjson.null, input_activations = f.input_activations or cjson.null,
      output_activations = cjson.null, targets = {"Linear"}, weights = f.weights}},
    format = f.format, global_compression_ratio = cjson.null, ignore = ex, kv_cache_scheme = cjson.null,
    moe_sparsity_config = cjson.null, quant_method = "compressed-tensors", quantization_status = "compressed",
    sparsity_config = {}, transform_config = {}, version = deploy.CT_VERSION}
end

-- options checked -> the layout and its format name, after the calibration option's checks (a model
-- loaded from a quantized checkpoint may take its activation scales from there: checked per linear)
local function checked(o, who, model)
  local f, format = layout(o)
  if needs_input(f) and o.calibration == nil and not model.quantized_source then
    user_error(string.format("%s: quantize = %s quantizes the activations with static scales: give " ..
      "calibration = batches (or quantize = %s for weights only)", who, o.quantize, o.quantize == "fp8" and "fp8 with another " ..
      "format" or "nvfp4_a16"), 0)
  end
  if not needs_input(f) and o.calibration ~= nil then
    user_error(string.format("%s: calibration does not apply to quantize = %s (its activations are %s)", who,
      o.quantize, f.group == 32 and "scaled per block as they run" or "not quantized"), 0)
  end
  return f, format
end

--- deploy.free(rows): free the quantized weights deploy.quantize returned in rows.
function deploy.free(rows)
  for _, row in ipairs(rows) do
    if row.q then row.q:free() end
    row.q = nil
  end
end

--- deploy.quantize(model, {quantize =, format =, calibration =, exclude =, progress =}) -> rows, info: what an
-- export writes, not written: deploy.plan's rows, each quantized one with q (its QTensor, the caller's to
-- free: deploy.free(rows); a "kept" row has none, its bytes are row.src's), amax (q's tensor amax), requantized ({max, rms}, for a fused group's shared
-- amax) and input_amax (calibrated, where the layout quantizes activations); info = {fused = {groups,
-- requantized = {{name, trained, max, rms, amax, group_amax}}}, calibration_batches}. The recipes' state
-- is as it was before. save_pretrained's options, their checks and errors (under the name save_pretrained).
function deploy.quantize(model, o)
  o = util.check_opts(o, {quantize = true, format = true, calibration = true, exclude = check_list,
    progress = OPTS.progress}, "save_pretrained")
  local f = checked(o, "save_pretrained", model)
  local rows = deploy.plan(model, o)
  -- the recipes' state (SR generators, delayed-scaling histories) as it is: put back afterwards
  local restore = model:save_recipe_states()
  local ok, info = pcall(nv.scope, function()
    -- the weights first: a delayed-scaling forward of the calibration would push amaxes into the
    -- histories the weights' scales come from
    quantize_rows(model, rows, f, o.progress)
    restore()
    local fused = share_group_scales(rows, f)
    local amax, nb
    if needs_input(f) and o.calibration ~= nil then amax, nb = calibrate(model, rows, o.calibration, o.progress) end
    restore()
    for _, row in ipairs(rows) do
      row.input_amax = amax and row.status ~= "excluded" and amax[row.name] or nil
      if needs_input(f) and row.status ~= "excluded" and not row.input_amax and not (row.src and row.src.input) then
        user_error(string.format("save_pretrained: quantize = %s needs %s's activation scale, which the checkpoint it " ..
          "was loaded from (%s) does not hold: give calibration = batches", o.quantize, row.name,
          model.quantized_source.label), 0)
      end
    end
    return {fused = fused, calibration_batches = nb}
  end)
  if not ok then
    restore()
    deploy.free(rows)
    error(info, 0)
  end
  return rows, info
end

-- ---- the deployment gap -----------------------------------------------------------------------------
--
-- deploy.gap measures what deploying costs: the validation loss of the model under its training forward
-- (a), of the exported NVFP4 weights with bf16 activations (b, W4A16: the weights are (a)'s fprop
-- weights bit for bit; only x's quantization is gone), of W4A4 with the calibrated static input scales
-- as an engine computes it (c), and, given a second model trained in bf16, of its post-training NVFP4
-- quantization (d: deploy's PTQ path, 1x16 blocks, RTN, a per-tensor global scale; W4A16 and W4A4).
-- (b), (c), (d) hold every tensor the checkpoint stores in bf16 (embeddings, norms, the linears left
-- out) at its bf16 value, as an engine loads it; the linears left out run under the model's recipe
-- (bf16 operands, f32 accumulation), as the engine's bf16 GEMM does.
-- The engine's W4A4 arithmetic (c), as vLLM's ModelOpt and compressed-tensors NVFP4 linears run it
-- (scaled_fp4_quant, then cutlass_scaled_fp4_mm / FlashInfer's mm_fp4 with alpha), matched to the
-- torch reference those projects test their kernels against (vLLM tests/kernels/.../nvfp4_utils.py
-- ref_nvfp4_quant, FlashInfer's ref_fp4_quant, vLLM's nvfp4_emulation_utils): per 1x16 block of the
-- bf16 activation, s = gs * (vmax * (1/6)) in f32, rounded to e4m3 (saturating at 448), os = 1 /
-- (s * (1/gs)) (0 where s is 0), codes = e2m1 RNE of x * os clamped to +-6; the GEMM sums code * s
-- products of both operands exactly in f32 and multiplies by alpha once: ModelOpt gs = 1 / input_scale,
-- alpha = input_scale * weight_scale_2; compressed-tensors gs = input_global_scale, alpha = 1 /
-- (input_global_scale * weight_global_scale); the output rounded to bf16. Not matched: the kernels'
-- reciprocals are rcp.approx (within an ulp of the reference's 1/x) and a tensor core's summation order
-- differs from nvlua's f32 GEMM; both move y by f32 roundings, under the bf16 output's.
-- (nvlua's own quantizer forms the block scale as vmax * (gs * (1/6)), which can differ from the
-- engines' order in the last f32 bit, so (c) does not call it.)

local TWO22, TWO23, TWO24 = 2.0 ^ 22, 2.0 ^ 23, 2.0 ^ 24

-- t f32 rounded to e4m3, saturating at 448 (fp8 per-tensor scale 448 / 448 = 1: the codes' own values)
local function e4m3_round(t)
  return nv.quantize(t:minimum(448), "e4m3", {amax = 448}):dequantize()
end

-- v f32 rounded to e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), RNE, saturating at 6: adding then subtracting
-- 2^22 (2^23, 2^24) rounds an f32 below 2 (4, 6) to a multiple of 0.5 (1, 2), ties to even, which is
-- e2m1's grid and RNE on [0, 2), [2, 4) and [4, 6]
local function e2m1_round(v)
  local a = v:abs():minimum(6)
  local r05, r1, r2 = (a + TWO22) - TWO22, (a + TWO23) - TWO23, (a + TWO24) - TWO24
  local lo, mid = a:lt(2):to("f32"), a:lt(4):to("f32")
  local r = r2 + (r1 - r2) * mid + (r05 - r1) * lo
  return r * (v:ge(0):to("f32") * 2 - 1)
end

--- deploy.nvfp4_act(x, gs) -> a f32 [R, K], s f32 [R, K/16]: x [R, K] (bf16 or f32) quantized to NVFP4
-- 1x16 blocks with the global encode scale gs as the engines quantize activations (see above): a =
-- value(code) * s, the operand the block-scaled GEMM sums; s the e4m3 block scales' values.
function deploy.nvfp4_act(x, gs)
  if not nv.is_tensor(x) or x:dim() ~= 2 or x:size(2) % 16 ~= 0 then
    user_error("deploy.nvfp4_act: x must be a tensor [R, K] with K a multiple of 16, got " ..
      (nv.is_tensor(x) and util.shape_str(x) or type(x)), 2)
  end
  local R, K = x:size(1), x:size(2)
  if not (gs > 0 and gs < math.huge) then user_error("deploy.nvfp4_act: gs must be a finite number > 0, got " .. tostring(gs), 2) end
  return nv.scope(function()
    local b = (x:dtype() == "f32" and x or x:to("f32")):reshape(R, K // 16, 16)
    local vmax = b:abs():amax(3, true)                                  -- (R, K/16, 1)
    local s = e4m3_round(((vmax * (1 / 6)) * gs):reshape(R, K // 16))  -- (R, K/16)
    local d = s * (1 / gs)
    local os = d:gt(0):to("f32") / d:maximum(2.0 ^ -126)               -- 0 where s is 0
    local s3 = s:reshape(R, K // 16, 1)
    local a = e2m1_round((b * os:reshape(R, K // 16, 1)):maximum(-6):minimum(6)) * s3
    return a:reshape(R, K):contiguous(), s
  end)
end

-- x rounded to f32 (RNE), as the engines' f32 scalars hold it
local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

-- the validation loss of model over batches ({{ids, targets}, ...}), averaged over the tokens
local function val_loss(model, batches)
  local total, count = 0, 0
  for _, b in ipairs(batches) do
    local loss, cnt = nv.scope(function() return model:loss(b[1], b[2]) end)
    total, count = total + loss * cnt, count + cnt
  end
  return total / math.max(count, 1)
end

-- row.q's weight as the checkpoint stores it: w = value(code) * value(block scale) * dec_scale, one
-- rounding (how the engines and nvlua's GEMMs use it), and wi = value(code) * value(block scale)
local function exported_weight(row)
  local q, K = row.q, row.module.in_features
  local s = core.decode_scaled(q:scale_bytes(), "e4m3", K // 16)
  return core.decode_scaled(q:data(), "e2m1", K, s, {global = q.dec_scale, exact = true}), core.decode_scaled(q:data(), "e2m1", K, s)
end

-- y (..., N) from a linear's 2-D product y2 (R, N), of the recipe's activation dtype (bf16 values)
local function out_like(y2, x, r)
  local shape = x:size()
  shape[#shape] = y2:size(2)
  local y = y2:to("bf16")
  if r.act_dtype == "f32" then y = y:to("f32") end
  return y:reshape(shape)
end

-- The model's losses (a), (b), (c) (see above) for an NVFP4 export in format; rows checked: the
-- exported weights of each trained row against its training forward's, bit for bit.
local function measure(model, o)
  local res = {a = val_loss(model, o.batches)}
  local rows, info = deploy.quantize(model, {quantize = "nvfp4", format = o.format, calibration = o.calibration})
  local saved, mods = {}, {}
  local ok, err = pcall(function()
    local q_names = {}
    res.trained, res.ptq, res.excluded, res.differ, res.fused = 0, 0, 0, {}, #info.fused.requantized
    for _, row in ipairs(rows) do
      res[row.status] = res[row.status] + 1
      if row.q then
        q_names[row.name .. ".weight"] = true
        local w, wi = exported_weight(row)
        row.w, row.wi = core.unscope(w), core.unscope(wi)
        if row.status == "trained" then -- (a)'s weight: the training forward's own quantization, now
          local r = recipe_of(row)
          local st0 = r:state()
          local same = nv.scope(function()
            local _, qa = r:fprop_weight(ctx_of(model, row), row.module.weight_entry.param)
            return qa:dequantize():bytes() == w:bytes()
          end)
          r:load_state(st0)
          if not same then res.differ[#res.differ + 1] = row.name end
        end
        local ie = scales_for("nvfp4", row.input_amax)
        if o.format == "modelopt" then -- vLLM: input_scale_inv = 1 / input_scale, alpha = input_scale * weight_scale_2
          row.gs, row.alpha = f32(1 / ie.dec), f32(ie.dec * row.q.dec_scale)
        else -- alpha = 1 / (input_global_scale * weight_global_scale)
          row.gs, row.alpha = ie.enc, f32(1 / f32(ie.enc * row.q.scale))
        end
        mods[#mods + 1] = row
      end
    end
    -- what the checkpoint holds in bf16, at its bf16 values
    for _, p in ipairs(model:named_parameters()) do
      if not q_names[p.name] and p.param:dtype() == "f32" then
        saved[#saved + 1] = {p = p.param, v = core.unscope(p.param:clone())}
        nv.scope(function() p.param:copy_(p.param:to("bf16")) end)
      end
    end
    local function each(fwd)
      for _, row in ipairs(mods) do
        row.module.forward = function(self, x)
          return nv.scope(function()
            local x2 = x:reshape(x:numel() // self.in_features, self.in_features)
            return out_like(fwd(row, x2), x, recipe_of(row))
          end)
        end
      end
    end
    each(function(row, x2) return (x2:dtype() == "f32" and x2 or x2:to("f32")):matmul(row.w:transpose()) end)
    res.b = val_loss(model, o.batches)
    each(function(row, x2) return deploy.nvfp4_act(x2, row.gs):matmul(row.wi:transpose()) * row.alpha end)
    res.c = val_loss(model, o.batches)
  end)
  for _, row in ipairs(mods) do
    row.module.forward = nil
    row.w:free()
    row.wi:free()
  end
  for _, e in ipairs(saved) do
    e.p:copy_(e.v)
    e.v:free()
  end
  deploy.free(rows)
  if not ok then error(err, 0) end
  return res
end

--- deploy.gap(model, {batches =, calibration =, format = "modelopt" | "compressed-tensors", bf16 =}) ->
-- report: the deployment gap of an NVFP4 export (see above) on the validation batches ({{ids, targets},
-- ...}); calibration: save_pretrained's (the batches for the static input scales); bf16: the same
-- model trained in bf16, for (d). report = {a, b, c (losses), trained, ptq, excluded (linears), differ =
-- {names of trained linears whose exported weight is not their training forward's: re-quantized for
-- a fused group}, fused (re-quantized linears), d = the same for bf16 (its a: the bf16 forward; b, c:
-- its PTQ export)}. The models are left as they were (weights, recipe state).
function deploy.gap(model, o)
  o = util.check_opts(o, {batches = true, calibration = true, format = true, bf16 = true}, "deploy.gap")
  if type(o.batches) ~= "table" or #o.batches == 0 then
    user_error("deploy.gap: batches must be a non-empty list of {ids, targets} validation batches", 2)
  end
  o.format = o.format or "modelopt"
  if not deploy.FORMATS[o.format] then
    user_error(string.format("deploy.gap: format must be one of %s, got %s", table.concat(deploy.FORMAT_NAMES, ", "),
      tostring(o.format)), 2)
  end
  local rep = measure(model, o)
  if o.bf16 then rep.d = measure(o.bf16, o) end
  return rep
end

--- deploy.save_pretrained(model, dir, {quantize = "nvfp4" | "nvfp4_a16" | "mxfp4" | "fp8", format =
-- "modelopt" | "compressed-tensors" (default: the first that has quantize), calibration = batches or a
-- function (W4A4 NVFP4 and FP8: required unless the model was loaded from a checkpoint holding the
-- activation scales), exclude = {module names}, max_shard_size, bos_token_id,
-- eos_token_id, progress = fn(info)}) -> files, report. Writes a Hugging Face model directory engines
-- load into the existing directory dir (see the header): config.json with quantization_config (and,
-- for ModelOpt, hf_quant_config.json), the weights in safetensors, everything not quantized in bf16.
-- progress gets {layer, status, i, n} per quantized linear, {calibration = i} per batch, {file, bytes}
-- per weight file. files: {file name = bytes}; report: {quantize, format, layers = {{name, status, why,
-- requantized = {max, rms}}}, trained, ptq, kept, excluded (counts), fused = {groups, requantized = {{name,
-- trained, max, rms, amax, group_amax}}}, calibration_batches, bytes (all files)}.
function deploy.save_pretrained(model, dir, o)
  o = util.check_opts(o, OPTS, "save_pretrained")
  hf.check_save_args(model, dir)
  local f, format = checked(o, "save_pretrained", model)
  local rows, info = deploy.quantize(model, {quantize = o.quantize, format = o.format, calibration = o.calibration,
    exclude = o.exclude, progress = o.progress})
  local ok, files, report = pcall(nv.scope, function()
    local sd, tensors = model:state_dict(), {}
    local qnames = {}
    for _, row in ipairs(rows) do
      if row.status ~= "excluded" then
        qnames[row.name .. ".weight"] = true
        row_tensors(row, f, row.input_amax, tensors)
      end
    end
    for name, t in pairs(sd) do
      if not qnames[name] then tensors[name] = t:dtype() == "bf16" and t or t:to("bf16") end
    end
    local cfg, file = quant_config(f, format, rows)
    local written = hf.save_model(model, dir, tensors, {max_shard_size = o.max_shard_size, bos_token_id = o.bos_token_id,
      eos_token_id = o.eos_token_id, progress = o.progress, quant_config = file,
      config_extra = {quantization_config = cfg, dtype = "bfloat16", torch_dtype = "bfloat16"}})
    local rep = {quantize = o.quantize, format = format, layers = {}, trained = 0, ptq = 0, kept = 0, excluded = 0,
      fused = info.fused,
      calibration_batches = info.calibration_batches, bytes = 0}
    for _, row in ipairs(rows) do
      rep[row.status] = rep[row.status] + 1
      rep.layers[#rep.layers + 1] = {name = row.name, status = row.status, why = row.why, requantized = row.requantized}
    end
    for _, b in pairs(written) do rep.bytes = rep.bytes + b end
    return written, rep
  end)
  deploy.free(rows)
  if not ok then error(files, 0) end
  return files, report
end

return deploy
