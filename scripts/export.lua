-- scripts/export.lua: an nvlua checkpoint exported as a quantized checkpoint inference engines load
-- (nvlua.deploy): ModelOpt (vLLM, SGLang, TensorRT-LLM) or compressed-tensors (vLLM, transformers)
-- NVFP4, MXFP4 or FP8, holding the codes and scales the training forward used where the recipe trained
-- the layer in that format, a post-training quantization where it did not (said so), everything else
-- bf16. The recipe and its state come from the checkpoint's trainer.json (a Hugging Face directory
-- without one: recipe=, default bf16, so every linear is quantized after training); the calibration
-- batches from the run's data (data=, batch=, seq= override it). The tokenizer files go along.
-- Prints each linear as it is quantized, each file as it is written, then a summary: the quantized
-- (trained, post-training) and excluded layers, the bytes, the fused groups re-quantized with a shared
-- scale and the weight error that brings.
--   build/nvlua scripts/export.lua runs/x/checkpoints/step-000400 runs/x/nvfp4 [format=modelopt]
--     [quantize=nvfp4] [calib_batches=16] [data=kjv] [exclude=model.layers.0.mlp.down_proj,...]
-- The first two arguments may also be given as ckpt= and out=.
local lfs = require "lfs"
local nv = require "nvlua"
local ckpt = require "nvlua.checkpoint"
local config = require "nvlua.config"
local data = require "nvlua.data"
local deploy = require "nvlua.deploy"
local hf = require "nvlua.hf"
local train = require "nvlua.train"
local util = require "nvlua.util"
local user_error = util.user_error

local schema = config.schema({
  ckpt = config.str("", {nonempty = true, doc = "the checkpoint: a run's step-N/, its model/, or a Hugging Face model " ..
    "directory (or the first argument)"}),
  out = config.str("", {nonempty = true, doc = "the directory to write, created; an earlier export's weight files in it " ..
    "are replaced (or the second argument)"}),
  quantize = config.str("nvfp4", {one_of = deploy.QUANTIZE_NAMES, doc = "nvfp4 (W4A4) | nvfp4_a16 (weights only) | " ..
    "mxfp4 | fp8"}),
  format = config.str("auto", {one_of = {"auto", "modelopt", "compressed-tensors"}, doc = "auto: modelopt where it has " ..
    "the layout (nvfp4, fp8), else compressed-tensors (mxfp4)"}),
  calib_batches = config.int(16, {min = 1, doc = "batches run through the model for the activations' static scales " ..
    "(quantize=nvfp4, fp8)"}),
  data = config.str("", {doc = "the calibration data, as train's data= (kjv | shards:<dir> | megatron:<prefix> | " ..
    "<text file>); empty: the run's"}),
  batch = config.int(0, {min = 0, doc = "calibration batch size (0: the run's)"}),
  seq = config.int(0, {min = 0, doc = "calibration sequence length (0: the run's)"}),
  exclude = config.str("", {doc = "linears kept in bf16 besides the LM head, comma-separated module names; empty: as " ..
    "the recipe trained them"}),
  gap = config.bool(true, {doc = "print the deployment gap (nvlua.deploy.gap): the validation loss under the " ..
    "training forward, the NVFP4 export W4A16 and W4A4 (the engine's arithmetic), and with bf16= a bf16 run's " ..
    "post-training NVFP4 (quantize=nvfp4, nvfp4_a16)"}),
  eval_batches = config.int(0, {min = 0, doc = "validation batches of the gap (0: the run's eval_batches, else 8)"}),
  bf16 = config.str("", {doc = "the checkpoint of the same model trained in bf16, for the gap's post-training row " ..
    "(d); empty: none"}),
  recipe = config.str("", {doc = "the recipe of a directory without trainer.json (a registered name; empty: the " ..
    "checkpoint's, else bf16)"}),
  max_shard_size = config.str("50GB", {doc = "the largest weight file (transformers' max_shard_size)", check = function(v)
    local ok, err = pcall(hf.parse_size, v)
    return not ok and tostring(err):gsub("^save_pretrained: ", "") or nil
  end}),
})

-- ckpt and out may come first, as plain arguments
local args = {[0] = arg[0]}
local positional = {"ckpt", "out"}
for _, a in ipairs(arg) do
  if not a:find("=", 1, true) and not a:match("^%-") and #positional > 0 then
    args[#args + 1] = table.remove(positional, 1) .. "=" .. a
  else
    args[#args + 1] = a
  end
end
local c = schema:parse(args)

local function is_file(p) return lfs.attributes(p, "mode") == "file" end
local function is_dir(p) return lfs.attributes(p, "mode") == "directory" end
if not is_dir(c.ckpt) then user_error("export: " .. c.ckpt .. " is not a directory", 0) end

-- the run's config, recipe and recipe state, when ckpt is a checkpoint of a run
local model, run, from_run, rec = train.checkpoint_model(c.ckpt, "export", c.recipe ~= "" and c.recipe or nil, "bf16")
print(string.format("export: %s (recipe %s%s) -> %s", c.ckpt, tostring(rec), from_run and string.format(", step %d", model.step) or "",
  c.out))

-- the calibration batches (and the gap's validation batches), from the run's data
local f = deploy.FORMATS[c.format == "auto" and "modelopt" or c.format][c.quantize] or
  deploy.FORMATS["compressed-tensors"][c.quantize]
local static = false
for _, t in ipairs(f and f.tensors or {}) do if t.value:match("^input_") then static = true end end
local gap = c.gap and (c.quantize == "nvfp4" or c.quantize == "nvfp4_a16")
local calib, val
if static or gap then
  local dc = {data = c.data ~= "" and c.data or (run and run.data), cache = run and run.cache or "",
    tokenizer = run and run.tokenizer or ""}
  if not dc.data then
    user_error("export: " .. (static and "quantize=" .. c.quantize .. " calibrates the activations" or "gap=true evaluates " ..
      "on the validation split") .. ": give data=", 0)
  end
  local ds = train.dataset(dc)
  local B = c.batch > 0 and c.batch or (run and math.tointeger(run.batch)) or 8
  local T = c.seq > 0 and c.seq or (run and math.tointeger(run.seq)) or 256
  local loader = data.Loader(ds.train, {batch = B, seq = T, seed = 0})
  calib = {}
  for i = 1, c.calib_batches do calib[i] = loader:next() end
  print(string.format("calibration: %d batches of %d x %d tokens from %s", c.calib_batches, B, T, dc.data))
  if gap then -- train.evaluate's batches: the first of the validation split, in order
    local vl = data.Loader(ds.val, {batch = B, seq = T, shuffle = false})
    local n = math.min(c.eval_batches > 0 and c.eval_batches or (run and math.tointeger(run.eval_batches)) or 8, vl.per_epoch)
    val = {}
    for i = 1, n do val[i] = {vl:next()} end
  end
end
local calibration
if static then
  local n = 0
  calibration = function()
    n = n + 1
    return calib[n]
  end
end

local exclude
if c.exclude ~= "" then
  exclude = {}
  for name in c.exclude:gmatch("[^,%s]+") do exclude[#exclude + 1] = name end
end

if not is_dir(c.out) then
  local path = ""
  for part in c.out:gmatch("[^/]+") do
    path = (path == "" and c.out:sub(1, 1) == "/" and "/" or path) .. (path ~= "" and path ~= "/" and "/" or "") .. part
    if not is_dir(path) then
      local made, err = lfs.mkdir(path)
      if not made then user_error("export: cannot create " .. path .. ": " .. tostring(err), 0) end
    end
  end
end

local t0 = nv.clock()
local files, report = hf.save_pretrained(model, c.out, {quantize = c.quantize, format = c.format ~= "auto" and c.format or nil,
  calibration = calibration, exclude = exclude, max_shard_size = c.max_shard_size, progress = function(i)
    if i.layer then
      print(string.format("  [%d/%d] %-40s %s", i.i, i.n, i.layer, i.status))
    elseif i.calibration then
      if i.calibration == 1 or i.calibration % 8 == 0 or i.calibration == #calib then
        print(string.format("  calibration batch %d/%d", i.calibration, c.calib_batches))
      end
    elseif i.file then
      print(string.format("  wrote %s (%.2f MB)", i.file, i.bytes / 1e6))
    end
  end})

-- the tokenizer goes along (engines read it from the model directory)
local src = is_dir(c.ckpt .. "/model") and c.ckpt .. "/model" or c.ckpt
for _, name in ipairs({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}) do
  if is_file(src .. "/" .. name) then
    local fi = assert(io.open(src .. "/" .. name, "rb"))
    local text = fi:read("a")
    fi:close()
    local okw, err = util.atomic_write(c.out .. "/" .. name, text)
    if not okw then user_error("export: " .. c.out .. "/" .. name .. ": " .. tostring(err), 0) end
    files[name] = #text
  end
end

-- ---- the summary -----------------------------------------------------------------------------------
local names = {}
for n in pairs(files) do names[#names + 1] = n end
table.sort(names)
local bytes = 0
for _, n in ipairs(names) do bytes = bytes + files[n] end
print(string.format("\n%s %s export in %s (%.1f s): %d files, %.2f MB", report.format, report.quantize, c.out, nv.clock() - t0,
  #names, bytes / 1e6))
print(string.format("linears: %d quantized as trained, %d quantized after training, %d excluded (bf16)%s", report.trained,
  report.ptq, report.excluded, report.kept > 0 and string.format(", %d written as loaded", report.kept) or ""))
local why = {}
for _, l in ipairs(report.layers) do
  if l.status ~= "trained" then
    local k = l.status .. ": " .. l.why
    why[k] = why[k] or {}
    table.insert(why[k], l.name)
  end
end
local keys = {}
for k in pairs(why) do keys[#keys + 1] = k end
table.sort(keys)
for _, k in ipairs(keys) do
  local l = why[k]
  print(string.format("  %s (%d): %s%s", k, #l, table.concat(l, ", ", 1, math.min(#l, 4)), #l > 4 and ", ..." or ""))
end
local rq = report.fused.requantized
if #rq > 0 then
  local trained_n, maxd, rms_max, rms_sum = 0, 0, 0, 0
  for _, r in ipairs(rq) do
    if r.trained then trained_n = trained_n + 1 end
    maxd, rms_max, rms_sum = math.max(maxd, r.max), math.max(rms_max, r.rms), rms_sum + r.rms
  end
  print(string.format("fused groups: %d (q/k/v, gate/up); %d linears re-quantized with their group's amax (%d of them " ..
    "trained in the format, whose codes then differ from training's): max |dw| %.3g, rms dw / rms w %.3g mean, %.3g max " ..
    "(a recipe sharing the amax over the group avoids it)", report.fused.groups, #rq, trained_n, maxd, rms_sum / #rq, rms_max))
elseif report.fused.groups > 0 then
  print(string.format("fused groups: %d (q/k/v, gate/up), every one with a single amax already: nothing re-quantized",
    report.fused.groups))
end
if report.calibration_batches then print(string.format("calibration: %d batches", report.calibration_batches)) end
if report.ptq > 0 then
  print("note: the layers quantized after training are a post-training quantization of the master weights, not what " ..
    "the training forward computed with")
end

-- ---- the deployment gap ----------------------------------------------------------------------------
if gap then
  local bf16
  if c.bf16 ~= "" then
    if not is_dir(c.bf16) then user_error("export: bf16=" .. c.bf16 .. " is not a directory", 0) end
    bf16 = hf.from_pretrained(c.bf16, {recipe = train.recipe({recipe = "bf16", act_dtype = "recipe", switch_step = 0,
      bf16_first = -1, bf16_last = -1})})
  end
  local fmt = report.format == "compressed-tensors" and report.format or "modelopt"
  print(string.format("\ndeployment gap: validation loss on %d batches (the run's evaluation), NVFP4 %s arithmetic", #val, fmt))
  local g = deploy.gap(model, {batches = val, calibration = calib, format = fmt, bf16 = bf16})
  local function row(label, v, ref) print(string.format("  %-62s %.4f%s", label, v, ref and string.format("  (%+.4f)", v - ref) or "")) end
  row("(a) training forward (recipe " .. tostring(rec) .. ")", g.a)
  row("(b) export W4A16: exported weights, bf16 activations", g.b, g.a)
  row("(c) export W4A4: + activations NVFP4, static input scales", g.c, g.a)
  if g.d then
    row("(d) bf16 run: its bf16 forward", g.d.a)
    row("    bf16 run, post-training NVFP4 W4A16", g.d.b, g.d.a)
    row("    bf16 run, post-training NVFP4 W4A4 (same calibration)", g.d.c, g.d.a)
  end
  print(string.format("  (b)'s weights vs (a)'s fprop weights: %d of %d trained linears bit for bit%s; %d quantized after " ..
    "training, %d excluded (bf16)", g.trained - #g.differ, g.trained, #g.differ > 0 and " (differing, re-quantized for " ..
    "a fused group: " .. table.concat(g.differ, ", ") .. ")" or "", g.ptq, g.excluded))
end
