-- nvlua.deploy_read: the quantized checkpoints inference engines load, read back for
-- hf.from_pretrained / hf.load_weights: which linear layers a checkpoint quantizes and how, the
-- checks that their tensors are what its config says, and each quantized weight decoded to f32.
--   local dr = require "nvlua.deploy_read"
--   local scheme = dr.scheme(who, dir, quantization_config, read_json)  -- nil: not quantized
--   local spec = scheme.layer("model.layers.0.mlp.down_proj")         -- nil: left unquantized
--   local r = dr.check_layer(fail, scheme, spec, module, {N, K}, tensors) -- r.parts: tensor names
--   local w = dr.decode(fail, spec, r.parts, loaded, N, K)             -- f32 [N, K]
-- (lua/nvlua/deploy.lua writes these formats; this file reads them, its own exports and others'.)
--
-- The formats (checked against the libraries that define them: nvidia-modelopt 0.47,
-- compressed-tensors 0.20; tests/golden/qload holds checkpoints they wrote):
--   ModelOpt        hf_quant_config.json {"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
--                   "group_size", "exclude_modules"}} and/or config.json's quantization_config with
--                   quant_method "modelopt" (ModelOpt's flat quant_algo, ignore = the exclusions, or
--                   hf_quant_config.json's "quantization" nested: vLLM reads both); both files, when
--                   both are there, must agree. quant_algo (any case):
--                     NVFP4, W4A16_NVFP4  weight U8 [N, K/2] (two e2m1 codes a byte, the even element in
--                                  the low nibble), weight_scale F8_E4M3 [N, K/16], weight_scale_2 F32
--                                  scalar; NVFP4 (W4A4) also input_scale F32 scalar
--                     FP8          weight F8_E4M3 [N, K], weight_scale F32 scalar, input_scale F32 scalar
--                     MXFP4        weight U8 [N, K/2], weight_scale U8 (e8m0) [N, K/32]
--                   A linear is left unquantized when an exclude_modules entry lies within its name
--                   (its own, a parent's, a bare "o_proj") or matches the whole name as a pattern
--                   with * and ?, as vLLM decides (ModelOptQuantConfigBase.is_layer_excluded).
--   compressed-tensors  config.json's quantization_config with quant_method "compressed-tensors",
--                   quantization_status "compressed", config_groups {targets, weights,
--                   input_activations, format?}, ignore, format. A linear belongs to the group one of
--                   whose targets matches it (its name; "re:<regex>", matched from the start of the
--                   name as Python's re.match does; or the class "Linear") and that ignore does not
--                   match. Formats:
--                     nvfp4-pack-quantized  weight_packed U8 [N, K/2], weight_scale F8_E4M3 [N, K/16],
--                                  weight_global_scale F32 [1]; input_global_scale F32 [1] when the
--                                  input activations are static (NVFP4; not NVFP4A16, no activations)
--                     mxfp4-pack-quantized  weight_packed U8 [N, K/2], weight_scale U8 (e8m0) [N, K/32]
--                     float-quantized  weight F8_E4M3 [N, K], weight_scale [1] (strategy tensor) or
--                                  [N, 1] (channel), F32, BF16 or F16; input_scale [1] when static
--                   Regexes: the subset Lua patterns express (. * + ? [...] \d \w \s \. ^ $); groups,
--                   alternation and counted repeats are refused, naming the entry.
--
-- Decoding. An e2m1 code times its e4m3 block scale is exact in f32 (at most 2 x 4 significant bits,
-- magnitudes 2^-10 .. 2688); an e2m1 code times an e8m0 scale (a power of two) is exact in f32 and
-- bf16 alike, where it does not overflow (|code| >= 2 with 2^127, >= 4 with 2^126 give inf, which
-- the loader refuses as non-finite). tests/test_qload.lua checks both for every code and every
-- scale. The global scale is an arbitrary f32, so the product with it is rounded:
-- there is no exactly representable "true" NVFP4 or per-tensor FP8 weight, and each library
-- rounds in its own order. nvlua decodes as the checkpoint's library does, bit for bit (the test
-- compares with their own decoders' output):
--   ModelOpt NVFP4        w = code * fl(scale * weight_scale_2)   (and the code -0 gives +0: its table)
--   compressed-tensors NVFP4   w = code * fl(scale / weight_global_scale)
--   MXFP4 (both)          w = code * 2^(e - 127)                   exact
--   FP8 (both)            w = code * scale                         per tensor or per row, one rounding
-- all in f32 (bf16 when asked: that f32 rounded once, which is what compressed-tensors' decompressor
-- returns for the fp4 formats). decode = "exact" (from_pretrained's option) rounds once instead:
-- w = fl(code * scale * weight_scale_2), fl(code * scale / weight_global_scale), the code * scale
-- product exact; that is the engines' GEMM arithmetic (the global scale applied after the block
-- products) and the training forward's (NUMERICS §2), so nvlua's own ModelOpt NVFP4 export
-- (weight_scale_2 = amax / 2688, the forward's decode factor) reads back as the forward's weight
-- bit for bit. The two orders differ in the last bit of some elements whose code is 1.5, 3 or 6
-- (and, for ModelOpt, in the sign of a zero).
--
-- Activation scales (input_scale, input_global_scale) carry nothing the weights need; they are
-- checked against the scheme (F32 scalars, present exactly when the scheme quantizes activations
-- statically, because an engine refuses the checkpoint otherwise) and then ignored. Under strict
-- (the default) a missing one is an error naming it, an extra one an unexpected tensor; strict =
-- false reports them in info.missing / info.unexpected. KV-cache scales (*.k_scale, *.v_scale) are
-- ignored where the config declares a quantized KV cache, unexpected otherwise.
-- What was read is kept for a re-export (hf.lua's from_pretrained / load_weights, as
-- model.quantized_source; nvlua.deploy writes it back): each quantized linear's codes and block
-- scales as read (u8 tensors), its global and activation scales (numbers: the f32 values), and
-- dr.fingerprint of the weight as loaded, which tells an unchanged weight from a fine-tuned one.
-- Not here: keeping the weights quantized (QTensors) for the forward — refused by from_pretrained
-- (quantized = "keep") with the reason; sparsity, transforms (rotations), zero points, integer
-- formats, other quant_methods (refused by name).
local lfs = require "lfs"
local core = require "nvlua.core"
local cjson = require "cjson"
local util = require "nvlua.util"
local user_error = util.user_error

local dr = {}

local HQ = "hf_quant_config.json"

local function is_null(v) return v == nil or v == cjson.null end
-- a JSON value for a message (cjson reads every number as a float: 16, not 16.0)
local function show(v) return tostring(math.type(v) == "float" and math.tointeger(v) or v) end
local function is_object(v) return type(v) == "table" and v ~= cjson.null and (next(v) == nil or #v == 0) end
local function is_list(v) return type(v) == "table" and v ~= cjson.null and (next(v) == nil or #v > 0) end

-- ---- matching module names -------------------------------------------------------------------------

-- A ModelOpt exclude pattern (* any run, ? one character, the rest literal) as an anchored Lua pattern.
local function glob_pattern(s)
  return "^" .. s:gsub("[%^%$%(%)%%%.%[%]%+%-]", "%%%0"):gsub("%*", ".*"):gsub("%?", ".") .. "$"
end

-- The Python regex re of a "re:" entry as a Lua pattern anchored at the start (re.match), or nil,
-- why: the subset without groups, alternation or counted repeats.
local function regex_pattern(re)
  local out, i, n, prev_item = {"^"}, 1, #re, false
  while i <= n do
    local c = re:sub(i, i)
    if c == "\\" then
      local e = re:sub(i + 1, i + 1)
      if e:match("^[dwsDWS]$") then out[#out + 1] = "%" .. e
      elseif e ~= "" and not e:match("^%w$") then out[#out + 1] = "%" .. e
      else return nil, "the escape \\" .. e .. " is not supported" end
      i, prev_item = i + 2, true
    elseif c == "[" then
      local j, cls = i + 1, {"["}
      if re:sub(j, j) == "^" then cls[#cls + 1] = "^"; j = j + 1 end
      while j <= n and (re:sub(j, j) ~= "]" or j == i + 1) do
        local d = re:sub(j, j)
        if d == "\\" then cls[#cls + 1] = "%" .. re:sub(j + 1, j + 1); j = j + 2
        else cls[#cls + 1] = (d == "%" and "%%" or d); j = j + 1 end
      end
      if j > n then return nil, "an unclosed [" end
      cls[#cls + 1] = "]"
      out[#out + 1] = table.concat(cls)
      i, prev_item = j + 1, true
    elseif c == "*" or c == "+" or c == "?" then
      if not prev_item then return nil, "a repeat (" .. c .. ") of nothing or of a repeat" end
      out[#out + 1] = c
      i, prev_item = i + 1, false
    elseif c == "^" and i == 1 then
      i = i + 1
    elseif c == "$" and i == n then
      out[#out + 1] = "$"
      i = i + 1
    elseif c:match("[%(%)%|{}%^%$]") then
      return nil, "'" .. c .. "' (groups, alternation, counted repeats and inner anchors) is not supported"
    else
      out[#out + 1] = c == "." and "." or (c:match("%p") and "%" .. c or c)
      i, prev_item = i + 1, true
    end
  end
  return table.concat(out)
end

-- A compressed-tensors target or ignore entry -> a function(module name) -> bool
local function ct_matcher(fail, where, entry)
  if type(entry) ~= "string" then fail("%s: entries must be strings, got %s", where, tostring(entry)) end
  if entry:sub(1, 3) == "re:" then
    local pat, why = regex_pattern(entry:sub(4))
    if not pat then fail("%s: %q: %s (nvlua matches the regex subset Lua patterns express)", where, entry, why) end
    return function(name) return name:find(pat) ~= nil end
  end
  if entry == "Linear" or entry == "LinearBase" then return function() return true end end -- a class: every linear
  return function(name) return name == entry end
end

-- A ModelOpt exclude_modules entry -> a function(module name) -> bool, as vLLM matches them: the
-- entry within the name (older ModelOpt wrote parents and bare names), or the whole name matching
-- it as a wildcard pattern (fnmatch)
local function mo_matcher(fail, where, entry)
  if type(entry) ~= "string" then fail("%s: entries must be strings, got %s", where, tostring(entry)) end
  local pat = glob_pattern(entry)
  return function(name) return name:find(entry, 1, true) ~= nil or name:find(pat) ~= nil end
end

-- ---- the layer specs -------------------------------------------------------------------------------

local PACKED, E4M3, E8M0 = {U8 = true}, {F8_E4M3 = true}, {U8 = true, F8_E8M0 = true}
local SCALAR = {F32 = true}
local CT_FLOAT = {F32 = true, BF16 = true, F16 = true}

-- spec fields: kind (nvfp4 | mxfp4 | fp8), label, codes (the codes' tensor suffix), global (suffix or
-- nil), divide (the block scale is divided by the global), plus_zero (ModelOpt's e2m1 table), fp8
-- (tensor | channel), scale_dtypes, input (the input scale's suffix when static activations need one)
local MODELOPT = {
  NVFP4 = {kind = "nvfp4", codes = "weight", global = "weight_scale_2", plus_zero = true, input = "input_scale",
    group = 16},
  W4A16_NVFP4 = {kind = "nvfp4", codes = "weight", global = "weight_scale_2", plus_zero = true, group = 16},
  FP8 = {kind = "fp8", codes = "weight", fp8 = "tensor", scale_dtypes = SCALAR, input = "input_scale"},
  MXFP4 = {kind = "mxfp4", codes = "weight"},
}
local CT_FORMATS = {
  ["nvfp4-pack-quantized"] = {kind = "nvfp4", codes = "weight_packed", global = "weight_global_scale", divide = true,
    input = "input_global_scale", bits = 4, strategies = {tensor_group = true}, group = 16},
  ["mxfp4-pack-quantized"] = {kind = "mxfp4", codes = "weight_packed", input = "input_global_scale", bits = 4,
    strategies = {group = true}, group = 32},
  ["float-quantized"] = {kind = "fp8", codes = "weight", scale_dtypes = CT_FLOAT, input = "input_scale", bits = 8,
    strategies = {tensor = true, channel = true}},
}
local BLOCK = {nvfp4 = 16, mxfp4 = 32}

local function names(t) return table.concat(util.sorted_keys(t), ", ") end

local function copy(t, extra)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  for k, v in pairs(extra or {}) do out[k] = v end
  return out
end

-- ModelOpt's fields from hf_quant_config.json's "quantization" (where = its name for messages)
local function modelopt_fields(fail, where, q, from_hq)
  if not is_object(q) then fail("%s must be an object", where) end
  local algo = q.quant_algo
  if type(algo) ~= "string" then fail("%s.quant_algo must be a string, got %s", where, tostring(algo)) end
  algo = algo:upper()
  if not MODELOPT[algo] then
    fail("%s.quant_algo %q is not one nvlua reads (%s)", where, q.quant_algo, names(MODELOPT))
  end
  local ex = q.exclude_modules
  if from_hq then
    -- engines (vLLM) refuse the file without these keys; null is a value
    for _, k in ipairs({"kv_cache_quant_algo", "exclude_modules"}) do
      if q[k] == nil then fail("%s.%s is missing (engines refuse the file without it; null if none)", where, k) end
    end
  else
    if ex == nil then ex = q.ignore end
  end
  if is_null(ex) then ex = {} end
  if not is_list(ex) then fail("%s.exclude_modules must be a list of module names", where) end
  local spec = MODELOPT[algo]
  if spec.group then
    local g = q.group_size
    if from_hq and g == nil then fail("%s.group_size is missing (%s needs 16)", where, algo) end
    if g ~= nil and g ~= spec.group then fail("%s.group_size is %s; %s has groups of %d", where, show(g), algo, spec.group) end
  end
  local kv = q.kv_cache_quant_algo
  if kv == nil then kv = q.kv_cache_scheme end
  return algo, ex, not is_null(kv)
end

-- the set of a list's strings, for comparing exclusion lists
local function set_of(l)
  local s = {}
  for _, v in ipairs(l) do s[tostring(v)] = true end
  return s
end
local function same_set(a, b)
  local sa, sb = set_of(a), set_of(b)
  for k in pairs(sa) do if not sb[k] then return false end end
  for k in pairs(sb) do if not sa[k] then return false end end
  return true
end

-- config.json's ModelOpt quantization_config: ModelOpt's flat form (quant_algo, ignore, ...) or
-- hf_quant_config.json's nested under "quantization" (vLLM reads both) -> fields, where, whether nested
local function modelopt_qc(qc)
  if is_object(qc.quantization) then return qc.quantization, "config.json: quantization_config.quantization", true end
  return qc, "config.json: quantization_config", false
end

local function modelopt_scheme(fail, dir, hq, qc)
  local algo, ex, kv, source
  if hq then
    local where = HQ .. ": quantization"
    algo, ex, kv = modelopt_fields(fail, where, hq.quantization, true)
    source = HQ
    if qc then -- config.json's copy must say the same
      local q, where, nested = modelopt_qc(qc)
      local a2, ex2 = modelopt_fields(fail, where, q, nested)
      if a2 ~= algo then fail("%s says quant_algo %s, config.json's quantization_config %s", HQ, algo, a2) end
      if not same_set(ex, ex2) then
        fail("%s's exclude_modules and config.json's quantization_config's exclusions differ (engines read one or the " ..
          "other: the checkpoint is ambiguous)", HQ)
      end
    end
  else
    local q, where, nested = modelopt_qc(qc)
    algo, ex, kv = modelopt_fields(fail, where, q, nested)
    source = "config.json"
  end
  local match = {}
  for i, e in ipairs(ex) do match[i] = mo_matcher(fail, source .. ": exclude_modules", e) end
  local spec = copy(MODELOPT[algo], {label = "ModelOpt " .. algo, scale_dtypes = MODELOPT[algo].scale_dtypes})
  return {method = "modelopt", algo = algo, source = source, kv_cache = kv, exclusions = ex,
    layer = function(name)
      for _, m in ipairs(match) do if m(name) then return nil end end
      return spec
    end}
end

-- the layer spec of a compressed-tensors config group (where: its path, for messages)
local function ct_spec(fail, where, g, format)
  local f = g.format
  if is_null(f) then f = format end
  if type(f) ~= "string" then fail("%s: no format (neither the group's nor quantization_config's)", where) end
  local base = CT_FORMATS[f]
  if not base then fail("%s: format %q is not one nvlua reads (%s)", where, f, names(CT_FORMATS)) end
  local w = g.weights
  if not is_object(w) then fail("%s.weights must be an object", where) end
  if w.type ~= "float" or w.num_bits ~= base.bits then
    fail("%s.weights: %s with num_bits %s and type %s; %s stores %d-bit float weights", where, f, show(w.num_bits),
      show(w.type), f, base.bits)
  end
  if w.symmetric == false then fail("%s.weights: asymmetric (zero points) is not supported", where) end
  if w.dynamic == true then fail("%s.weights: dynamic weights hold no stored scales", where) end
  if not base.strategies[w.strategy] then
    fail("%s.weights.strategy %q: %s stores %s", where, tostring(w.strategy), f, names(base.strategies))
  end
  if base.group and w.group_size ~= base.group then
    fail("%s.weights.group_size %s: %s has groups of %d", where, show(w.group_size), f, base.group)
  end
  local ia = g.input_activations
  local static = not is_null(ia) and ia.dynamic ~= true -- false or "local": a stored (global) scale
  if not is_null(g.output_activations) then fail("%s.output_activations: quantized outputs are not supported", where) end
  local kind = f == "nvfp4-pack-quantized" and (is_null(ia) and "NVFP4A16" or "NVFP4") or f
  local spec = copy(base, {label = "compressed-tensors " .. kind, fp8 = base.kind == "fp8" and w.strategy or nil})
  if not static then spec.input = nil end -- dynamic or no activation quantization: no stored scale
  return spec
end

local function ct_scheme(fail, qc)
  local where = "config.json: quantization_config"
  local status = qc.quantization_status
  if not is_null(status) and status ~= "compressed" then
    fail("%s.quantization_status is %q: nvlua reads compressed checkpoints (the weights stored quantized)", where,
      tostring(status))
  end
  for _, k in ipairs({"sparsity_config", "transform_config"}) do
    if is_object(qc[k]) and next(qc[k]) ~= nil then
      fail("%s.%s is set: sparse or transformed (rotated) weights are not supported", where, k)
    end
  end
  local groups = qc.config_groups
  if not is_object(groups) or next(groups) == nil then fail("%s.config_groups must be a non-empty object", where) end
  local gnames = {}
  for k in pairs(groups) do gnames[#gnames + 1] = k end
  table.sort(gnames)
  local specs, targets = {}, {}
  for i, gn in ipairs(gnames) do
    local gw = where .. ".config_groups." .. gn
    local g = groups[gn]
    if not is_object(g) then fail("%s must be an object", gw) end
    specs[i] = ct_spec(fail, gw, g, qc.format)
    if not is_list(g.targets) or #g.targets == 0 then fail("%s.targets must be a non-empty list", gw) end
    targets[i] = {}
    for j, t in ipairs(g.targets) do targets[i][j] = ct_matcher(fail, gw .. ".targets", t) end
  end
  local ignore = qc.ignore
  if is_null(ignore) then ignore = {} end
  if not is_list(ignore) then fail("%s.ignore must be a list", where) end
  local ign = {}
  for i, e in ipairs(ignore) do ign[i] = ct_matcher(fail, where .. ".ignore", e) end
  return {method = "compressed-tensors", algo = tostring(qc.format), source = "config.json",
    kv_cache = not is_null(qc.kv_cache_scheme), exclusions = ignore,
    layer = function(name)
      for _, m in ipairs(ign) do if m(name) then return nil end end
      local found
      for i = 1, #gnames do
        for _, m in ipairs(targets[i]) do
          if m(name) then
            if found and found ~= i then
              fail("%s: %s is a target of config_groups %s and %s", where, name, gnames[found], gnames[i])
            end
            found = i
          end
        end
      end
      return found and specs[found] or nil
    end}
end

--- dr.scheme(who, dir, qc [, read_json]) -> nil (not a quantized checkpoint) | scheme {method, algo, source,
-- kv_cache, exclusions, layer = function(module name) -> spec | nil}: dir's quantization, from
-- qc (config.json's quantization_config, nil if none) and dir's hf_quant_config.json. read_json(path,
-- fname) -> table | nil, err reads a JSON object (hf.lua's). Raises naming the file and field for a
-- config nvlua cannot read.
function dr.scheme(who, dir, qc, read_json)
  local function fail(fmt, ...) user_error(string.format("%s: %s: " .. fmt, who, dir, ...), 0) end
  local hq
  if lfs.attributes(dir .. "/" .. HQ, "mode") == "file" then
    hq = read_json(dir .. "/" .. HQ, who)
    if not hq then fail("%s cannot be read", HQ) end
    if not is_object(hq.quantization) then fail("%s: no \"quantization\" object", HQ) end
  end
  if is_null(qc) then qc = nil end
  if qc ~= nil and not is_object(qc) then fail("config.json: quantization_config must be an object") end
  local method = qc and qc.quant_method
  if qc and method ~= "modelopt" and method ~= "compressed-tensors" then
    fail("config.json: quantization_config.quant_method %s is not one nvlua reads (modelopt, compressed-tensors)",
      type(method) == "string" and string.format("%q", method) or tostring(method))
  end
  if method == "compressed-tensors" then
    if hq then fail("has both %s (ModelOpt) and a compressed-tensors quantization_config in config.json", HQ) end
    return ct_scheme(fail, qc)
  end
  if hq or method == "modelopt" then return modelopt_scheme(fail, dir, hq, qc) end
  return nil
end

-- ---- the tensors of one linear ---------------------------------------------------------------------

-- Suffixes of the tensors a quantized linear can hold besides its float weight.
local QUANT_SUFFIXES = {"weight_packed", "weight_scale", "weight_scale_2", "weight_global_scale", "weight_zero_point",
  "input_scale", "input_global_scale"}
local INPUT_SUFFIXES = {input_scale = true, input_global_scale = true}

local function dims(shape) return "[" .. table.concat(shape, ",") .. "]" end
local function same(shape, want)
  if #shape ~= #want then return false end
  for i = 1, #want do if shape[i] ~= want[i] then return false end end
  return true
end
local function scalar(shape) return #shape == 0 or (#shape == 1 and shape[1] == 1) end

--- dr.check_layer(fail, scheme, spec, module, {N, K}, tensors) -> {parts = {codes =, scale =, global =}
-- (tensor names), inputs = {names of the activation scales present and expected}, missing = {the
-- expected activation scales absent}, unexpected = {activation scales the scheme has none of}}:
-- module's tensors (tensors: name -> {dtype, shape, file}) checked against spec; a malformed one
-- raises through fail(fmt, ...), naming it.
function dr.check_layer(fail, scheme, spec, module, shape, tensors)
  local N, K = shape[1], shape[2]
  local function name(s) return module .. "." .. s end
  local function need(s, dtypes, want, what)
    local t = tensors[name(s)]
    if not t then
      fail("%s is missing (%s stores %s %s for %s)", name(s), spec.label, names(dtypes), want and dims(want) or "a scalar",
        what)
    end
    local ok_shape = want and same(t.shape, want) or (not want and scalar(t.shape))
    if not dtypes[t.dtype] or not ok_shape then
      fail("%s is %s %s in %s; %s stores %s %s (%s)", name(s), t.dtype, dims(t.shape), t.file, spec.label, names(dtypes),
        want and dims(want) or "[] or [1]", what)
    end
    return name(s)
  end
  local parts = {}
  local g = BLOCK[spec.kind]
  if g and K % g ~= 0 then
    fail("%s: K = %d (the model's %s [%d,%d]) is not a multiple of %d, %s's block", name(spec.codes), K, name("weight"),
      N, K, g, spec.label)
  end
  local dense = tensors[name("weight")]
  if dense and (spec.codes ~= "weight" or CT_FLOAT[dense.dtype]) then
    fail("%s is stored unquantized (%s %s), but %s quantizes %s (%s; a layer left in high precision must be listed " ..
      "there)", name("weight"), dense.dtype, dims(dense.shape), scheme.source, module, spec.label)
  end
  if spec.kind == "fp8" then
    parts.codes = need(spec.codes, E4M3, {N, K}, "e4m3 codes")
    parts.scale = need("weight_scale", spec.scale_dtypes, spec.fp8 == "channel" and {N, 1} or nil,
      spec.fp8 == "channel" and "one scale per row" or "one scale for the tensor")
  else
    parts.codes = need(spec.codes, PACKED, {N, K // 2}, "two e2m1 codes a byte")
    parts.scale = need("weight_scale", spec.kind == "nvfp4" and E4M3 or E8M0, {N, K // g},
      spec.kind == "nvfp4" and "an e4m3 scale per 16 weights" or "an e8m0 scale per 32 weights")
  end
  if spec.global then parts.global = need(spec.global, SCALAR, nil, "the global scale") end
  local out = {parts = parts, inputs = {}, missing = {}, unexpected = {}}
  for s in pairs(INPUT_SUFFIXES) do
    local present = tensors[name(s)]
    if s == spec.input then
      if present then out.inputs[#out.inputs + 1] = need(s, spec.kind == "fp8" and spec.scale_dtypes or SCALAR, nil,
        "the static input scale") else out.missing[#out.missing + 1] = name(s) end
    elseif present then
      out.unexpected[#out.unexpected + 1] = name(s)
    end
  end
  if tensors[name("weight_zero_point")] then
    fail("%s: zero points (asymmetric quantization) are not supported", name("weight_zero_point"))
  end
  return out
end

--- dr.check_excluded(fail, scheme, module, tensors): module is left unquantized by scheme; raise,
-- naming the tensor, when the checkpoint holds it quantized all the same.
function dr.check_excluded(fail, scheme, module, tensors)
  local w = tensors[module .. ".weight"]
  local q = (w and not CT_FLOAT[w.dtype]) and module .. ".weight" or nil
  for _, s in ipairs(QUANT_SUFFIXES) do
    if not q and tensors[module .. "." .. s] then q = module .. "." .. s end
  end
  if q then
    local t = tensors[q]
    fail("%s is there (%s %s), but %s leaves %s unquantized (%s: %s); the checkpoint contradicts its config",
      q, t.dtype, dims(t.shape), scheme.source, module,
      scheme.method == "modelopt" and "exclude_modules" or "ignore or no config_groups target", "[" ..
      table.concat(scheme.exclusions, ", ") .. "]")
  end
end

-- ---- decoding --------------------------------------------------------------------------------------

-- the one value of a scalar tensor, checked finite and > 0 (fail names it)
local function positive(fail, name, t)
  local v = t:to("f32"):reshape(1):get(1)
  if not (v > 0 and v < math.huge) then fail("%s is %s; a scale must be a finite number > 0", name, tostring(v)) end
  return v
end

--- dr.decode(fail, spec, parts, tensors, N, K [, exact]) -> w f32 [N, K], the dense weight as spec's
-- library decodes it, or with exact one rounding of code * block scale * global (see the header);
-- parts: check_layer's names, tensors: name -> loaded tensor (u8 for the codes and fp8/e8m0 scales)
function dr.decode(fail, spec, parts, tensors, N, K, exact)
  return core.scope(function()
    local codes, scale = tensors[parts.codes], tensors[parts.scale]
    if spec.kind == "fp8" then
      local s = scale:to("f32"):reshape(spec.fp8 == "channel" and N or 1, 1):contiguous()
      if spec.fp8 ~= "channel" then positive(fail, parts.scale, scale) end
      return core.decode_scaled(codes, "e4m3", K, s)
    end
    local nb = scale:size(2)
    local s = core.decode_scaled(scale, spec.kind == "nvfp4" and "e4m3" or "e8m0", nb)
    local g = parts.global and positive(fail, parts.global, tensors[parts.global]) or 1
    return core.decode_scaled(codes, "e2m1", K, s, {global = g, divide = spec.divide, exact = exact,
      plus_zero = spec.plus_zero and not exact})
  end)
end

--- dr.fingerprint(w) -> the CRC-32C of w's bytes: a loaded weight's, compared at export to tell whether
-- it changed since (one pass over the bytes; a change that keeps the CRC is a 2^-32 chance)
function dr.fingerprint(w)
  if w:device() == "cpu" then return core.crc32c(w:bytes()) end
  return core.scope(function() return core.crc32c(w:cpu():bytes()) end)
end

return dr
