-- test_deploy_roundtrip.lua: export -> hf.from_pretrained -> export writes the same files (nvlua.deploy's
-- "kept" rows: what from_pretrained read, model.quantized_source, written back for unchanged weights).
--   * every layout nvlua writes (ModelOpt NVFP4, W4A16_NVFP4, FP8; compressed-tensors NVFP4, NVFP4A16,
--     MXFP4, FP8), from a tiny Llama trained 3 steps under the matching recipe: the second export's
--     files (config.json, hf_quant_config.json, model.safetensors) equal the first's byte for byte, with
--     no calibration the second time (the activation scales are the ones read);
--   * one weight changed after loading: only that linear's tensors differ (in a fused q/k/v group, only
--     the group's: they share one global scale);
--   * ModelOpt <-> compressed-tensors NVFP4: the codes and block scales pass through as the same bytes;
--     the global scales are 1 / each other, rounded once to f32 (computed here with string.pack);
--   * the third-party checkpoints of tests/golden/qload (ModelOpt 0.47, compressed-tensors 0.20) re-export
--     to the same tensor bytes in every layout nvlua writes; a layout it does not write (compressed-
--     tensors FP8 with a scale per row) is quantized anew and asks for calibration.
-- Files are compared as bytes read here (T.read_file), tensors through a safetensors reader written here.
local T = require "nvlua.test"
local nv = require "nvlua"
local hf = require "nvlua.hf"
local deploy = require "nvlua.deploy"
local cjson = require "cjson"
local lfs = require "lfs"
local util = require "nvlua.util"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local GOLD = here .. "/golden/qload"
local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

-- head_dim 16, in-features multiples of 32 (MXFP4 blocks), out-features of 16 (NVFP4 tiles)
local CFG = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 64}
local LINEARS = 14 -- 2 blocks x 7; the LM head stays bf16

local function ids(g) return (nv.rand({2, 32}, {generator = g}) * 64):to("i64") end

-- a model trained 3 AdamW steps under recipe name (seeded), one per name
local trained_models = {}
local function trained(name)
  if trained_models[name] then return trained_models[name] end
  local m = T.trained_llama(CFG, name, ids)
  trained_models[name] = m
  return m
end

local function calib()
  local g = nv.Generator(9)
  return {ids(g), ids(g)}
end

-- ---- files and tensors, read here ------------------------------------------------------------------

local function files_of(dir)
  local out = {}
  for n in lfs.dir(dir) do
    if n ~= "." and n ~= ".." then out[n] = assert(T.read_file(dir .. "/" .. n)) end
  end
  return out
end

local function same_files(a, b, what)
  local fa, fb = files_of(a), files_of(b)
  T.eq(util.sorted_keys(fb), util.sorted_keys(fa), what .. ": the same files")
  for name, bytes in pairs(fa) do T.ok(fb[name] == bytes, what .. ": " .. name .. " byte-identical") end
end

-- safetensors by hand: {name = {dtype, shape, bytes}}
local function read_st(path)
  local s = assert(T.read_file(path))
  local n = string.unpack("<I8", s)
  local h = cjson.decode(s:sub(9, 8 + n))
  local out = {}
  for name, e in pairs(h) do
    if name ~= "__metadata__" then
      out[name] = {dtype = e.dtype, shape = e.shape, bytes = s:sub(9 + n + e.data_offsets[1], 8 + n + e.data_offsets[2])}
    end
  end
  return out
end

-- the tensor names whose dtype or bytes differ between two exports (or that only one holds)
local function differing(a, b)
  local ta, tb = read_st(a .. "/model.safetensors"), read_st(b .. "/model.safetensors")
  local out = {}
  for name, x in pairs(ta) do
    local y = tb[name]
    if not y or y.dtype ~= x.dtype or y.bytes ~= x.bytes then out[#out + 1] = name end
  end
  for name in pairs(tb) do if not ta[name] then out[#out + 1] = name end end
  table.sort(out)
  return out
end

local function f32_of(bytes) return (string.unpack("<f", bytes)) end
-- 1 / x rounded once to f32 (the double quotient of two f32 values rounds to the f32 quotient: 53 >= 2*24+2)
local function f32_recip(bytes) return string.pack("<f", 1 / f32_of(bytes)) end

-- ---- the round trip, every layout --------------------------------------------------------------------

local LAYOUTS = {
  {format = "modelopt", quantize = "nvfp4", recipe = "nvfp4", calib = true},
  {format = "modelopt", quantize = "nvfp4_a16", recipe = "nvfp4"},
  {format = "modelopt", quantize = "fp8", recipe = "fp8_cs", calib = true},
  {format = "compressed-tensors", quantize = "nvfp4", recipe = "nvfp4", calib = true},
  {format = "compressed-tensors", quantize = "nvfp4_a16", recipe = "nvfp4"},
  {format = "compressed-tensors", quantize = "mxfp4", recipe = "mxfp4"},
  {format = "compressed-tensors", quantize = "fp8", recipe = "fp8_cs", calib = true},
}

-- the first export of layout l: its directory
local first_exports = {}
local function first_export(l)
  local key = l.format .. "/" .. l.quantize
  if first_exports[key] then return first_exports[key] end
  local dir = fresh((l.format .. "_" .. l.quantize):gsub("-", "_"))
  local _, rep = hf.save_pretrained(trained(l.recipe), dir, {quantize = l.quantize, format = l.format,
    calibration = l.calib and calib() or nil})
  T.eq(rep.trained, LINEARS, key .. ": the first export holds the training's weights")
  first_exports[key] = dir
  return dir
end

T.case("export -> from_pretrained -> export: byte-identical files, every layout; the report says kept", function()
  for _, l in ipairs(LAYOUTS) do
    local what = l.format .. " " .. l.quantize
    local a = first_export(l)
    local m = hf.from_pretrained(a)
    local b = fresh("again")
    local _, rep = hf.save_pretrained(m, b, {quantize = l.quantize, format = l.format})
    T.eq({rep.kept, rep.trained, rep.ptq, rep.excluded}, {LINEARS, 0, 0, 1}, what .. ": every linear kept, the head excluded")
    for _, row in ipairs(rep.layers) do
      if row.status == "kept" then T.ok(row.why:find("written as read from", 1, true), what .. ": " .. row.why) end
    end
    same_files(a, b, what)
    -- loaded in bf16: the same bytes again (the fingerprint is the weight as loaded, whatever its rounding)
    local mb = hf.from_pretrained(a, {dtype = "bf16"})
    local c = fresh("again_bf16")
    hf.save_pretrained(mb, c, {quantize = l.quantize, format = l.format})
    same_files(a, c, what .. " (loaded in bf16)")
  end
end)

T.case("one weight changed after loading: only that linear's tensors differ, and the report says it changed", function()
  for _, l in ipairs(LAYOUTS) do
    local what = l.format .. " " .. l.quantize
    local a = first_export(l)
    local m = hf.from_pretrained(a)
    local target = "model.layers.1.self_attn.o_proj" -- in no fused group
    local w
    for _, e in ipairs(m:linears()) do if e.name == target then w = e.module.weight_entry.param end end
    w:set(3, 5, w:get(3, 5) + 0.25 * w:amax()) -- a fine-tuning step's worth, changing its block's scale
    local b = fresh("changed")
    local _, rep = hf.save_pretrained(m, b, {quantize = l.quantize, format = l.format})
    T.eq({rep.kept, rep.ptq}, {LINEARS - 1, 1}, what .. ": 13 kept, the changed one quantized after loading")
    for _, row in ipairs(rep.layers) do
      if row.name == target then T.ok(row.why:find("changed since it was loaded", 1, true), what .. ": " .. row.why) end
    end
    local d = differing(a, b)
    T.ok(#d > 0, what .. ": the changed weight's tensors differ")
    for _, name in ipairs(d) do
      T.ok(name:sub(1, #target + 1) == target .. ".", what .. ": " .. name .. " differs, which is not " .. target .. "'s")
    end
    -- its activation scale is the one read (the layer's input did not change)
    for _, suffix in ipairs({"input_scale", "input_global_scale"}) do
      local n = target .. "." .. suffix
      local ta = read_st(a .. "/model.safetensors")
      if ta[n] then T.eq(read_st(b .. "/model.safetensors")[n].bytes, ta[n].bytes, what .. ": " .. n .. " as read") end
    end
    local codes = target .. "." .. deploy.FORMATS[l.format][l.quantize].tensors[1].suffix
    T.ok(read_st(b .. "/model.safetensors")[codes].dtype ~= "BF16", what .. ": the changed linear is still quantized")
  end
end)

T.case("a changed member of a fused group: the group is quantized anew (one global scale), the rest kept", function()
  for _, l in ipairs({LAYOUTS[1], LAYOUTS[6]}) do -- NVFP4 (a global scale per group) and MXFP4 (none)
    local what = l.format .. " " .. l.quantize
    local a = first_export(l)
    local m = hf.from_pretrained(a)
    local target = "model.layers.0.self_attn.q_proj"
    for _, e in ipairs(m:linears()) do
      if e.name == target then e.module.weight_entry.param:mul_(1.5) end
    end
    local b = fresh("changed_group")
    local _, rep = hf.save_pretrained(m, b, {quantize = l.quantize, format = l.format})
    local group = l.quantize == "mxfp4" and {target} or
      {target, "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"}
    T.eq(rep.kept, LINEARS - #group, what .. ": the rest kept")
    for _, name in ipairs(differing(a, b)) do
      local ok = false
      for _, g in ipairs(group) do ok = ok or name:sub(1, #g + 1) == g .. "." end
      T.ok(ok, what .. ": " .. name .. " differs, outside " .. table.concat(group, ", "))
    end
    if #group > 1 then
      local t = read_st(b .. "/model.safetensors")
      T.eq(t[group[2] .. ".weight_scale_2"].bytes, t[target .. ".weight_scale_2"].bytes, what .. ": one global scale in the group")
    end
  end
end)

-- ---- between layouts -------------------------------------------------------------------------------

T.case("ModelOpt <-> compressed-tensors NVFP4: the same code and block-scale bytes, the global scales 1 / each other", function()
  local mo = first_export(LAYOUTS[1])
  local ct = first_export(LAYOUTS[4])
  local function convert(src, format)
    local dir = fresh("to_" .. format:gsub("-", "_"))
    local _, rep = hf.save_pretrained(hf.from_pretrained(src), dir, {quantize = "nvfp4", format = format})
    T.eq(rep.kept, LINEARS, "every linear kept, converting to " .. format)
    return read_st(dir .. "/model.safetensors")
  end
  local mo_t, ct_t = read_st(mo .. "/model.safetensors"), read_st(ct .. "/model.safetensors")
  local to_ct, to_mo = convert(mo, "compressed-tensors"), convert(ct, "modelopt")
  local n = 0
  for name in pairs(mo_t) do
    local module = name:match("^(.*)%.weight_scale_2$")
    if module then
      n = n + 1
      -- the codes and block scales: the same bytes in all four (both exports hold the training's)
      for _, t in ipairs({to_ct[module .. ".weight_packed"], ct_t[module .. ".weight_packed"], to_mo[module .. ".weight"]}) do
        T.eq(t.bytes, mo_t[module .. ".weight"].bytes, module .. ": codes")
      end
      for _, t in ipairs({to_ct, ct_t, to_mo}) do
        T.eq(t[module .. ".weight_scale"].bytes, mo_t[module .. ".weight_scale"].bytes, module .. ": block scales")
        T.eq(t[module .. ".weight_scale"].dtype, "F8_E4M3", module .. ": block scales' dtype")
      end
      T.eq(to_ct[module .. ".weight_global_scale"].bytes, f32_recip(mo_t[module .. ".weight_scale_2"].bytes),
        module .. ": weight_global_scale = fl(1 / weight_scale_2)")
      T.eq(to_ct[module .. ".input_global_scale"].bytes, f32_recip(mo_t[module .. ".input_scale"].bytes),
        module .. ": input_global_scale = fl(1 / input_scale)")
      T.eq(to_mo[module .. ".weight_scale_2"].bytes, f32_recip(ct_t[module .. ".weight_global_scale"].bytes),
        module .. ": weight_scale_2 = fl(1 / weight_global_scale)")
      T.eq(to_mo[module .. ".input_scale"].bytes, f32_recip(ct_t[module .. ".input_global_scale"].bytes),
        module .. ": input_scale = fl(1 / input_global_scale)")
      T.eq(to_ct[module .. ".weight_global_scale"].shape, {1}, module .. ": compressed-tensors' [1]")
      T.eq(to_mo[module .. ".weight_scale_2"].shape, {}, module .. ": ModelOpt's scalar")
    end
  end
  T.eq(n, LINEARS, "every quantized linear compared")
end)

T.case("bad inputs: W4A4 from a weight-only checkpoint needs calibration, naming the linear", function()
  local m = hf.from_pretrained(first_export(LAYOUTS[2]))
  T.raises(function() hf.save_pretrained(m, fresh("no_calib"), {quantize = "nvfp4", format = "modelopt"}) end,
    "needs model.layers.0.self_attn.q_proj's activation scale, which the checkpoint it was loaded from " ..
    "(modelopt W4A16_NVFP4) does not hold: give calibration = batches")
  -- given calibration, the weights are still the bytes read (only the activation scales are new)
  local dir = fresh("with_calib")
  local _, rep = hf.save_pretrained(m, dir, {quantize = "nvfp4", format = "modelopt", calibration = calib()})
  T.eq(rep.kept, LINEARS, "weights kept under calibration")
  local d = differing(first_export(LAYOUTS[2]), dir)
  for _, name in ipairs(d) do T.ok(name:find("%.input_scale$"), name .. " differs: only the new input scales may") end
  -- a format whose codes differ (NVFP4 read, FP8 asked): quantized anew, the report says why
  local _, rep8 = hf.save_pretrained(m, fresh("to_fp8"), {quantize = "fp8", format = "modelopt", calibration = calib()})
  T.eq({rep8.kept, rep8.ptq}, {0, LINEARS}, "nvfp4 read, fp8 written: quantized anew")
  T.ok(rep8.layers[1].why:find("read as nvfp4", 1, true), rep8.layers[1].why)
end)

-- ---- third-party checkpoints --------------------------------------------------------------------------

-- each fixture, the layout nvlua writes it in, and the name of its codes there
local FIXTURES = {
  {"mo_nvfp4", "modelopt", "nvfp4"}, {"mo_w4a16", "modelopt", "nvfp4_a16"}, {"mo_fp8", "modelopt", "fp8"},
  {"ct_nvfp4", "compressed-tensors", "nvfp4"}, {"ct_nvfp4a16", "compressed-tensors", "nvfp4_a16"},
  {"ct_mxfp4", "compressed-tensors", "mxfp4"}, {"ct_fp8", "compressed-tensors", "fp8"},
  -- ModelOpt MXFP4, which nvlua writes in compressed-tensors' layout only: the same codes and scales
  {"mo_mxfp4", "compressed-tensors", "mxfp4", rename = {weight = "weight_packed"}},
}

-- a BF16 scalar's bytes as the f32 of the same value (compressed-tensors FP8 stores its scales in the
-- model's dtype; nvlua's layout writes F32)
local function bf16_as_f32(bytes) return string.pack("<I4", string.unpack("<I2", bytes) << 16) end

T.case("the third-party checkpoints re-export to the same tensor bytes where nvlua writes their layout", function()
  for _, fx in ipairs(FIXTURES) do
    local case, format, quantize = fx[1], fx[2], fx[3]
    local src = GOLD .. "/" .. case
    local m, info = hf.from_pretrained(src)
    local dir = fresh("fx_" .. case)
    local _, rep = hf.save_pretrained(m, dir, {quantize = quantize, format = format})
    T.eq(rep.ptq + rep.trained, 0, case .. ": every quantized linear kept")
    local ta, tb = read_st(src .. "/model.safetensors"), read_st(dir .. "/model.safetensors")
    local n = 0
    for name, x in pairs(ta) do
      local module, suffix = name:match("^(.*_proj)%.([%w_]+)$")
      local out = module and fx.rename and fx.rename[suffix] and module .. "." .. fx.rename[suffix] or name
      local y = tb[out]
      T.ok(y ~= nil, case .. ": " .. out .. " is written")
      if x.dtype == "BF16" and y.dtype == "F32" and #x.bytes == 2 then
        T.eq(y.bytes, bf16_as_f32(x.bytes), case .. ": " .. name .. " (a BF16 scale, written F32)")
      else
        T.eq(y.bytes, x.bytes, case .. ": " .. name .. " bytes")
        n = n + 1
      end
    end
    T.ok(n > 0, case .. ": tensors compared")
    -- the exclusions stand: the checkpoint's unquantized linears stay bf16
    local ex = {}
    for _, row in ipairs(rep.layers) do if row.status == "excluded" then ex[#ex + 1] = row.name end end
    table.sort(ex)
    T.eq(ex, info.quantization.excluded, case .. ": the checkpoint's exclusions")
  end
end)

T.case("a layout nvlua does not write (compressed-tensors FP8 per row) is quantized anew and asks for calibration", function()
  local m = hf.from_pretrained(GOLD .. "/ct_fp8_dyn")
  T.raises(function() hf.save_pretrained(m, fresh("fx_dyn"), {quantize = "fp8", format = "compressed-tensors"}) end,
    "activation scale, which the checkpoint it was loaded from")
  local _, rep = hf.save_pretrained(m, fresh("fx_dyn2"), {quantize = "nvfp4_a16", format = "compressed-tensors"})
  T.eq(rep.kept, 0, "read as fp8: nothing kept in nvfp4")
  T.ok(rep.ptq > 0, "the checkpoint's quantized linears are quantized anew")
end)

T.case("cleanup: the scratch directory is removed", function() T.ok(T.rm_tree(ROOT)) end)
