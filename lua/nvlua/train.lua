-- nvlua.train: the training loop every experiment uses. An experiment is a defaults table and a
-- call:   local train = require "nvlua.train"
--         train.main(defaults, arg)         -- parse key=value args, build, train, report
-- Pieces (data, model, recipe, optimizer, schedule) are built from the config by train.build and
-- can be replaced by an experiment that wants something else (train.run takes them). A recipe of
-- one's own goes into the config instead (recipe = a recipe value, or a name registered with
-- recipe.register, which key=value arguments can then pick): train.build gives it the
-- data-parallel hooks, which a recipe swapped into the parts afterwards would lack.
--
-- Per step: gradient accumulation over `grad_accum` micro-batches, global-norm clipping, AdamW,
-- the LR schedule; a console line every `log_every` steps (and a progress bar on a terminal),
-- metrics.jsonl (one JSON object per step and per eval) and, with tensorboard=true, the same numbers
-- as TensorBoard scalars in out/tb (nvlua.tensorboard), eval every `eval_every` steps on the
-- validation split, checkpoints every `ckpt_every` steps and at the end, a text sample and a
-- loss-curve PNG at the end. A non-finite loss, gradient norm, weight or activation skips the
-- step (counted and logged); more than `max_bad_steps` in a row stop the run with an error (the
-- count is saved in each checkpoint and restored on resume). Ctrl-C, SIGTERM or SIGUSR1 (to any
-- rank) finishes the current step, writes a checkpoint and returns summary.interrupted, with the
-- process's exit status set to 75 (nvlua.signal.EXIT_INTERRUPTED); a second Ctrl-C stops at once,
-- saving nothing of the step. resume=auto continues from the checkpoint written last; an out= that
-- holds a run is never started over (resume=none refuses it).
--
-- Data parallelism (dist=true, under `mpirun -np N` or srun; README "Data parallel"): each rank
-- reads its own windows of every global batch (the loader's rank/world), the gradient buffer is
-- averaged with one all-reduce per step before clipping (shard=optimizer, alias
-- shard_optimizer=true: reduce-scattered, and AdamW updates this rank's shard, ZeRO-1; shard=grads:
-- each block's gradients reduce-scattered as the backward completes it, ZeRO-2; shard=full: weights,
-- gradients and AdamW state as 1/N shards, each block's weights all-gathered for its forward and
-- backward, ZeRO-3 / FSDP: nvlua.shard), the logged loss is the ranks' mean, recipes scale
-- activations and gradients by the amax of the global batch and draw SR bits at their global
-- block indices (recipe:set_amax_reducer, set_shard), so N ranks x batch B train as 1 rank x
-- batch N·B up to fp32 summation order. Only rank 0 prints and writes config, metrics (and events), plots and
-- checkpoints; every rank resumes from the checkpoint rank 0 picks.
local nv = require "nvlua"
local core = require "nvlua.core"
local cjson = require "cjson"
local lfs = require "lfs"
local nn = require "nvlua.nn"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local data = require "nvlua.data"
local schedule = require "nvlua.schedule"
local config = require "nvlua.config"
local util = require "nvlua.util"
local user_error = util.user_error
local ckpt = require "nvlua.checkpoint"
local hf = require "nvlua.hf"
local plot = require "nvlua.plot"
local mor = require "nvlua.mor"
local plan = require "nvlua.plan"
local shard = require "nvlua.shard"
local tensorboard = require "nvlua.tensorboard"
local peak = require "nvlua.peak"
local record = require "nvlua.record"

local train = {}

local int, num, bool, str = config.int, config.num, config.bool, config.str

-- data=kjv | shards:<dir> | megatron:<prefix> | <text file>: the directory or files must be there
local function check_data(v)
  if v == "kjv" then return nil end
  local dir = v:match("^shards:(.*)$")
  if dir then
    if lfs.attributes(dir, "mode") ~= "directory" then return "shards:" .. dir .. " is not a directory" end
    return nil
  end
  local prefix = v:match("^megatron:(.*)$")
  if prefix then
    for _, ext in ipairs({".bin", ".idx"}) do
      if lfs.attributes(prefix .. ext, "mode") ~= "file" then
        return string.format("megatron:%s: no file %s%s (a Megatron-LM indexed dataset is <prefix>.bin and " ..
          "<prefix>.idx)", prefix, prefix, ext)
      end
    end
    return nil
  end
  local mode = lfs.attributes(v, "mode")
  if mode ~= "file" then
    return string.format("'%s' is %s; give kjv, shards:<dir> or a text file (or megatron:<prefix>)", v,
      mode and "a " .. mode or "not a file")
  end
end

-- tokenizer=<tokenizer.json or a directory holding one>: the file must be there
local function check_tokenizer(v)
  if v == "" then return nil end
  local mode = lfs.attributes(v, "mode")
  local file = mode == "directory" and v .. "/tokenizer.json" or v
  if lfs.attributes(file, "mode") ~= "file" then
    return string.format("'%s' is not a tokenizer.json nor a directory holding one", v)
  end
end

--- train.init_source(v) -> {kind = "hf" | "ckpt", dir = the Hugging Face model directory to read,
-- checkpoint = the checkpoint's directory (ckpt:)}, or nil and what is wrong: where init=v's weights
-- are. hf:<dir>: a Hugging Face Llama directory (config.json and safetensors; an nvlua checkpoint's
-- model/ too); ckpt:<dir>: an nvlua checkpoint (trainer.json beside model/; checked intact:
-- ckpt.verify), or a run directory, whose newest complete checkpoint it is.
function train.init_source(v)
  local kind, path = tostring(v):match("^(%a+):(.+)$")
  if kind ~= "hf" and kind ~= "ckpt" then
    return nil, string.format("'%s' is neither hf:<Hugging Face Llama directory> nor ckpt:<nvlua checkpoint or run " ..
      "directory>", tostring(v))
  end
  local mode = lfs.attributes(path, "mode")
  if mode ~= "directory" then
    return nil, string.format("%s: %s", v, mode and "not a directory (a " .. mode .. ")" or "no such directory")
  end
  if kind == "hf" then
    local dir = ckpt.model_dir(path)
    if lfs.attributes(dir .. "/config.json", "mode") ~= "file" then
      return nil, v .. ": no config.json (not a Hugging Face model directory)"
    end
    return {kind = kind, dir = dir}
  end
  local cdir = path
  if lfs.attributes(path .. "/trainer.json", "mode") ~= "file" then
    cdir = ckpt.latest(path)
    if not cdir then
      return nil, string.format("%s: neither a checkpoint (no trainer.json) nor a run directory holding one (no complete " ..
        "checkpoint in %s/checkpoints)", v, path)
    end
  end
  local bad = ckpt.verify(cdir)
  if bad then return nil, string.format("%s: the checkpoint %s is damaged: %s", v, cdir, bad) end
  return {kind = kind, dir = ckpt.model_dir(cdir), checkpoint = cdir}
end

-- init: "" or a source of weights train.init_source accepts
local function check_init(v)
  if v == "" then return nil end
  local _, err = train.init_source(v)
  return err
end

-- A rope_scaling text (JSON) -> the table it holds (nil for ""), or nil, what is wrong
local function rope_scaling_of(v)
  if v == "" then return nil end
  local ok, t = pcall(cjson.decode, v)
  if not ok or type(t) ~= "table" or t == cjson.null or #t > 0 or next(t) == nil then
    return nil, string.format("must be \"\" (none) or a JSON object such as {\"rope_type\":\"linear\",\"factor\":2}, " ..
      "got '%s'", v)
  end
  return t
end

-- A rope_scaling table as nn.llama_config reads it, on a stand-in model of rope_theta theta and
-- max_position_embeddings mpe (nil: the defaults) -> true, the resolved scaling | false, what is wrong
local function read_scaling(t, theta, mpe)
  local ok, r = pcall(nn.llama_config, {vocab_size = 1, hidden_size = 2, intermediate_size = 1, num_hidden_layers = 1,
    num_attention_heads = 1, rope_theta = theta, max_position_embeddings = mpe, rope_scaling = t})
  if not ok then return false, (tostring(r):gsub("^[^\n]-%.lua:%d+: ", ""):gsub("^llama_config: ", "")) end
  return true, r.rope_scaling
end

-- rope_scaling: "" or a scaling nn.llama_config computes
local function check_rope_scaling(v, c)
  local t, err = rope_scaling_of(v)
  if not t then return err end
  local ok, rerr = read_scaling(t, type(c.rope_theta) == "number" and c.rope_theta or nil)
  if not ok then return rerr end
end

-- The model's keys init= takes from its checkpoint: the train key, nn.llama_config's key. head_dim,
-- vocab and max_positions 0 stand for a value derived from others: given so, they take the
-- checkpoint's too.
local INIT_KEYS = {{"layers", "num_hidden_layers"}, {"hidden", "hidden_size"}, {"heads", "num_attention_heads"},
  {"kv_heads", "num_key_value_heads"}, {"ffn", "intermediate_size"}, {"head_dim", "head_dim"}, {"vocab", "vocab_size"},
  {"tie", "tie_word_embeddings"}, {"norm_eps", "rms_norm_eps"}, {"rope_theta", "rope_theta"},
  {"max_positions", "max_position_embeddings"}, {"rope_scaling", "rope_scaling"}}
local DERIVED = {head_dim = 0, vocab = 0, max_positions = 0}

-- the checkpoint's value of train key k (mc: its resolved config), as the key holds it
local function init_value(k, hk, mc)
  local v = mc[hk]
  if k == "rope_scaling" then return v and config.encode(v) or "" end
  if math.type(v) == "integer" and (k == "norm_eps" or k == "rope_theta") then return v + 0.0 end
  return v
end

-- Does the rope_scaling text v name the scaling of the resolved config mc (read as nn.llama_config
-- reads it for mc: its max_position_embeddings and rope_theta)?
local function same_scaling(v, mc)
  local want = mc.rope_scaling
  local ok, got = read_scaling(rope_scaling_of(v), mc.rope_theta, mc.max_position_embeddings)
  if not (ok and got and want) then return ok and got == want end
  for k, x in pairs(want) do if got[k] ~= x then return false end end
  for k, x in pairs(got) do if want[k] ~= x then return false end end
  return true
end

-- The resolver of init= (train.schema): the model's keys (INIT_KEYS) are the checkpoint's. A key the
-- user chose (given) that says otherwise is an error naming both values; the others take the
-- checkpoint's value, so that the printed and saved config shows the model trained.
local function resolve_init(c, given)
  if c.init == "" then return end
  local src = assert(train.init_source(c.init)) -- (checked with the key)
  local ok, mc = pcall(function() return nn.llama_config(assert(hf.read_config(src.dir))) end)
  if not ok then
    user_error(string.format("config: init=%s: %s/config.json is not a Llama nvlua computes: %s", c.init, src.dir,
      (tostring(mc):gsub("^[^\n]-%.lua:%d+: ", ""))), 0)
  end
  local wrong = {}
  for _, e in ipairs(INIT_KEYS) do
    local k, hk = e[1], e[2]
    local v = init_value(k, hk, mc)
    local same = c[k] == v or (k == "rope_scaling" and same_scaling(c[k], mc))
    if not same and given[k] and c[k] ~= DERIVED[k] then
      local function show(x) return k == "rope_scaling" and x == "" and "none" or tostring(x) end
      wrong[#wrong + 1] = string.format("%s=%s but init=%s has %s %s", k, show(c[k]), c.init, hk, show(v))
    end
    c[k] = v
  end
  if #wrong > 0 then
    user_error(string.format("config: %s (the model's keys come from init=; leave them out)", table.concat(wrong, "; ")), 0)
  end
  if c.seq > c.max_positions then
    user_error(string.format("config: seq=%d is longer than init=%s's max_position_embeddings %d, the longest sequence " ..
      "it was made for", c.seq, c.init, c.max_positions), 0)
  end
end

-- ckpt_every: "auto" or a non-negative integer (as text from the command line)
local function check_ckpt_every(v)
  if v == "auto" or (type(v) == "string" and v:match("^%d+$")) then return nil end
  return "must be a non-negative integer or auto"
end

local function check_device(v)
  if v ~= "cpu" and v ~= "cuda" then return string.format("invalid device '%s' (valid: cpu, cuda)", v) end
  if v == "cuda" and not nv.cuda.available() then
    return string.format("device 'cuda' is not available here (%s)", nv.cuda.unavailable_reason())
  end
end

-- The relations between keys, checked with the keys themselves (train.schema:check).
-- eval_tasks: comma-separated names nvlua.eval can score (a task, or task:variant, of loglikelihood
-- requests; each file read once here) -> nil, or the error
local function check_eval_tasks(v)
  if v == "" then return nil end
  return require("nvlua.eval").check_tasks(v)
end

local function relations(c)
  if c.heads % c.kv_heads ~= 0 then
    return string.format("kv_heads (%d) must divide heads (%d)", c.kv_heads, c.heads)
  end
  if c.head_dim == 0 and c.hidden % c.heads ~= 0 then
    return string.format("hidden (%d) is not a multiple of heads (%d); give head_dim", c.hidden, c.heads)
  end
  local hd = c.head_dim > 0 and c.head_dim or c.hidden // c.heads
  if hd % 2 ~= 0 then return string.format("the head dimension (%d) must be even for RoPE", hd) end
  if c.min_lr > c.lr then return string.format("min_lr (%g) must not exceed lr (%g)", c.min_lr, c.lr) end
  if c.overwrite and c.resume ~= "none" then
    return string.format("overwrite=true starts the run over; it does not go with resume=%s", c.resume)
  end
  if c.max_positions > 0 and c.max_positions < c.seq then
    return string.format("max_positions (%d) must be 0 (= seq) or at least seq (%d)", c.max_positions, c.seq)
  end
  if c.shard_optimizer and c.shard ~= "none" and c.shard ~= "optimizer" then
    return string.format("shard_optimizer=true is shard=optimizer; it does not go with shard=%s", c.shard)
  end
  local sm = train.shard_mode(c)
  if c.sync == "shadow" and sm ~= "none" then
    return "sync=shadow averages whole parameters in the background; it does not go with " ..
      (c.shard_optimizer and "shard_optimizer=true" or "shard=" .. sm)
  end
  if (sm == "grads" or sm == "full") and not c.dist then
    return string.format("shard=%s shards across data-parallel ranks; it needs dist=true (launched by mpirun or " ..
      "srun; a world of one is allowed)", sm)
  end
  if (sm == "grads" or sm == "full") and c.tie then
    return string.format("shard=%s does not take tie=true (the tied weight is used by the embedding and the LM head); " ..
      "give tie=false or shard=optimizer", sm)
  end
  if c.eval_tasks ~= "" and c.eval_every == 0 then
    return "eval_tasks=" .. c.eval_tasks .. " are scored at each evaluation; eval_every=0 runs none (give eval_every > 0)"
  end
  if c.ckpt_overlap and not c.ckpt_background then
    return "ckpt_overlap=true is how background saves copy the state; it needs ckpt_background=true"
  end
  if c.shadow_moments and c.sync ~= "shadow" then
    return "shadow_moments=true averages the optimizer moments under sync=shadow; with sync=" .. c.sync ..
      " every rank already holds the same ones"
  end
  if c.attention == "cudnn" then
    if c.device ~= "cuda" then
      return "attention=cudnn runs on a GPU; it needs device=cuda (attention=auto or flash on the cpu)"
    end
    if c.act_dtype == "f32" or (c.act_dtype == "recipe" and c.recipe == "f32") then
      return "attention=cudnn takes bf16 activations; act_dtype is f32 here (use attention=auto)"
    end
    if hd ~= 64 and hd ~= 128 then
      return string.format("attention=cudnn takes head dim 64 or 128, the model's is %d (use attention=auto)", hd)
    end
    local a = core.attention_cudnn()
    if not a.available then return "attention=cudnn is not available here: " .. a.reason end
  end
  if c.tokenizer ~= "" and c.data == "kjv" then
    return string.format("tokenizer=%s goes with data=shards:..., megatron:... or a text file or directory; data=kjv " ..
      "is byte tokens (give the KJV's text as a file to encode it)", c.tokenizer)
  end
end

--- The keys every experiment understands: default, type and accepted values (config.schema). An
-- experiment changes defaults and declares keys of its own with train.schema:extend (train.main
-- does it with the experiment's table).
train.schema = config.schema({
  -- data
  data = str("kjv", {check = check_data, doc = "kjv | shards:<dir> | megatron:<prefix> | a text file"}),
  cache = str("", {doc = "where prepared data goes ('': $NVLUA_CACHE or ~/.cache/nvlua)"}),
  seed = int(1), data_seed = int(1),
  -- the data's tokenizer (shards, megatron, or a text file or directory, then encoded at load time): a
  -- tokenizer.json or a directory holding one; "": the data directory's manifest.json or tokenizer.json
  -- (text: byte tokens). Exported with every checkpoint.
  tokenizer = str("", {check = check_tokenizer, doc = "a tokenizer.json, or a directory holding one"}),
  -- model (Hugging Face Llama keys in short); head_dim 0: hidden / heads; vocab 0: the data's (the
  -- byte tokenizer's 256, or the manifest's / tokenizer's)
  layers = int(4, {min = 1}), hidden = int(256, {min = 1}), heads = int(8, {min = 1}), kv_heads = int(4, {min = 1}),
  ffn = int(768, {min = 1}), head_dim = int(0, {min = 0}), vocab = int(0, {min = 0}),
  rope_theta = num(10000.0, {above = 0}), norm_eps = num(1e-5, {above = 0}), tie = bool(false),
  seq = int(128, {min = 1}),
  -- RoPE scaling (HF rope_scaling, a JSON object: rope_type linear | dynamic | llama3 and its keys;
  -- nn.llama_config); "": none
  rope_scaling = str("", {check = check_rope_scaling, doc = "\"\" or a JSON object {\"rope_type\": ..., ...}"}),
  -- start from pretrained weights: hf:<Hugging Face Llama directory> or ckpt:<nvlua checkpoint, or run
  -- directory: its newest>; the model's keys above are then the checkpoint's (one given otherwise is
  -- an error). Weights only: the step, optimizer moments, data cursor and LR schedule start fresh
  -- (resume= continues a run; once out= holds a checkpoint, resume=auto takes it, not init=).
  init = str("", {check = check_init, doc = "hf:<dir> | ckpt:<dir> (pretrained weights; empty: random)"}),
  -- the longest sequence the model accepts (HF max_position_embeddings, the export's context
  -- length; 0: seq). RoPE is computed for any position, so a model trained on seq tokens can be
  -- declared (and run) longer; positions past seq were never trained on.
  max_positions = int(0, {min = 0}),
  -- optimisation
  steps = int(300, {min = 1}), batch = int(8, {min = 1}), grad_accum = int(1, {min = 1}),
  lr = num(3e-3, {above = 0}), min_lr = num(3e-4, {min = 0}), warmup = int(30, {min = 0}),
  -- schedule: a name, or from Lua a schedule value (nvlua.schedule) or a function(step) -> lr, which then
  -- ignores lr, min_lr, warmup and decay (the run record describes what it is: nvlua.record)
  schedule = str("wsd", {one_of = {"wsd", "cosine", "linear", "constant"},
    accept = function(v) return schedule.is_schedule(v) or type(v) == "function" end,
    accept_what = "a schedule value or function"}), decay = num(0.2, {min = 0, max = 1}),
  beta1 = num(0.9, {min = 0, below = 1}), beta2 = num(0.95, {min = 0, below = 1}), eps = num(1e-8, {above = 0}),
  weight_decay = num(0.1, {min = 0}), clip = num(1.0, {above = 0}), z_loss = num(0.0, {min = 0}),
  -- precision recipe (bf16_first/bf16_last -1: the recipe's own choice)
  recipe = str("nvfp4", {one_of = function() return nv.recipe.names() end,
    accept = function(v) return nv.recipe.is_recipe(v) end, accept_what = "a recipe value"}),
  rht = bool(true), sr = bool(true), w2d = bool(true), bf16_first = int(-1, {min = -1}),
  bf16_last = int(-1, {min = -1}), switch_step = int(0, {min = 0}), switch_forward_only = bool(true),
  -- one weight amax per fused group (q/k/v, gate/up), as one fused linear has and engines load: nvfp4,
  -- fp8_cs, fp8_delayed (nvlua.recipe "fused groups")
  fused_amax = bool(false, {doc = "scale q/k/v and gate/up weights by their group's amax (nvfp4, fp8_cs, fp8_delayed)"}),
  -- the dtype of the activations and activation gradients between layers (NUMERICS §11); recipe:
  -- the recipe's own (bf16 for the low-precision recipes, f32 for recipe=f32)
  act_dtype = str("recipe", {one_of = {"recipe", "bf16", "f32"},
    doc = "recipe (the recipe's own: bf16, f32 for recipe=f32) | bf16 | f32"}),
  -- the route of attention on bf16 activations (core.attention_route; NUMERICS §11): auto (cuDNN's fused
  -- attention on sm_90+ where cuDNN loads, else the flash kernels, else the reference rule), flash (nvlua's own
  -- kernels), cudnn (cuDNN or an error saying why not), reference (the widened f32 op)
  attention = str("auto", {one_of = {"auto", "flash", "cudnn", "reference"},
    doc = "auto | flash | cudnn | reference (bf16 attention's kernels)"}),
  -- activation recompute (nvlua.llama's header): none (keep every activation the backward reads), block
  -- (keep each block's input; its backward runs its forward again first), selective (recompute the
  -- norms' outputs and SwiGLU's product); the gradients are the same bits whichever
  recompute = str("none", {one_of = {"none", "block", "selective"}, doc = "none | block | selective"}),
  -- cuDNN's attention backward without fp32 dq atomics (bit-reproducible runs; Hopper only, a B*Hq*T*T*2-byte
  -- workspace; elsewhere attention=auto falls back to the flash kernels, which are deterministic)
  attention_deterministic = bool(false),
  -- knowledge distillation: teacher = a Hugging Face model directory (an nvlua checkpoint's model/
  -- too), frozen, run under teacher_recipe on every batch; loss = distill_alpha * T^2 * KL(teacher ||
  -- student at temperature T = distill_temperature) + (1 - distill_alpha) * cross-entropy
  teacher = str("", {doc = "a Hugging Face model directory: distil from it (empty: no teacher)"}),
  teacher_recipe = str("bf16", {one_of = function() return nv.recipe.names() end}),
  distill_alpha = num(0.5, {min = 0, max = 1}), distill_temperature = num(1.0, {above = 0}),
  -- bookkeeping (eval_every, ckpt_every 0: never, auto (the default): the Young/Daly interval for the
  -- measured save cost and mtbf, the expected hours between failures of the job, the first save (it
  -- measures the cost) after 10 steps and ckpt_first_s seconds of training, so a run of a few
  -- minutes writes only its final checkpoint; keep 0: every checkpoint; resume: none | auto | a
  -- directory)
  out = str("runs/run", {nonempty = true, doc = "the run's directory: config, metrics, checkpoints, plots"}),
  resume = str("none", {nonempty = true,
    doc = "none | auto (the checkpoint in out= written last) | a checkpoint directory"}),
  eval_every = int(100, {min = 0}), eval_batches = int(8, {min = 1}), log_every = int(10, {min = 1}),
  -- downstream tasks (nvlua.eval) scored at every evaluation beside the validation loss: their
  -- accuracies go to metrics.jsonl, TensorBoard (eval/<task>/acc) and tasks.png; eval_limit questions
  -- of each (the first in the file's order, the same at every evaluation; 0: all)
  eval_tasks = str("", {check = check_eval_tasks,
    doc = "comma-separated downstream tasks scored at every eval (nvlua scripts/eval.lua --help lists them)"}),
  eval_limit = int(200, {min = 0, doc = "questions per downstream task at each eval (0: all)"}),
  ckpt_every = str("auto", {check = check_ckpt_every, accept = function(v) return math.type(v) == "integer" and v >= 0 end,
    accept_what = "a non-negative integer", doc = "steps between checkpoints, 0 (never) or auto"}),
  mtbf = num(24.0, {above = 0, doc = "expected hours between failures of the job (ckpt_every=auto)"}),
  ckpt_first_s = num(300, {min = 0, doc = "ckpt_every=auto: seconds of training before the first checkpoint"}),
  -- periodic checkpoints written in the background: the step copies the state into a host staging
  -- buffer and goes on; a C writer thread writes, syncs and commits the checkpoint (nvlua.checkpoint
  -- save{background = true}); host memory: one checkpoint's size, held until the run ends.
  -- ckpt_overlap: the writer thread makes that copy itself while the next step's forward and backward
  -- run (its optimizer step waits for it; save{defer_copy = true}): a gain where the step leaves
  -- cores idle, a loss where it does not (experiments/bench/ckpt_cpu.md)
  ckpt_background = bool(false), ckpt_overlap = bool(false),
  keep = int(2, {min = 0}), sample_tokens = int(200, {min = 0}),
  sample_prompt = str("", {doc = "the end-of-run sample's prompt text ('': \"And \" for the byte tokenizer, else " ..
    "the data manifest's prompt)"}),
  temperature = num(0.8, {min = 0}), top_k = int(40, {min = 1}), max_bad_steps = int(5, {min = 0}),
  plot = bool(true), quiet = bool(false), save = bool(true),
  -- TensorBoard event files in out/tb: each step's metrics.jsonl numbers as scalars (train/, perf/, mor/),
  -- eval/val_loss and val_ppl, the config as text (tensorboard --logdir runs shows runs side by side)
  tensorboard = bool(true, {doc = "TensorBoard event files in out/tb (tensorboard --logdir runs)"}),
  -- the peak MFU is against (nvlua.peak): bf16 (the dense bf16 peak whatever the recipe: a GPU's
  -- datasheet, the CPU's calibrated bf16 GEMM rate), recipe (the peak of the units the recipe's GEMMs
  -- run on), fp8 | fp4 | tf32 | fp32 (that datasheet column), or a number (FLOP/s per device)
  mfu_peak = str("bf16", {check = peak.check_mfu_peak, doc = "bf16 | recipe | fp8 | fp4 | tf32 | fp32 | FLOP/s per device"}),
  -- resume=none on an out= that holds a run: refused, unless overwrite=true (its checkpoints and
  -- metrics are removed first)
  overwrite = bool(false),
  -- data parallelism (nvlua.dist): launch with mpirun / srun; shard_optimizer is ZeRO-1;
  -- bucket_grads: without ZeRO-1, each block's gradients start their all-reduce as the last
  -- micro-batch's backward completes them (overlapped with the rest of the backward; CPU gradients)
  -- shard: none | optimizer (ZeRO-1; shard_optimizer=true is its alias) | grads (ZeRO-2) | full (ZeRO-3,
  -- FSDP; nvlua.shard); reshard_after_forward (shard=full): a block's gathered weights are freed after
  -- its forward and gathered again for its backward (false: kept from the forward to the backward)
  dist = bool(false), shard_optimizer = bool(false), bucket_grads = bool(true),
  shard = str("none", {one_of = shard.MODES}), reshard_after_forward = bool(true),
  -- gather (shard=full): "quantized" (a linear whose recipe quantizes its weight with a cacheable spec
  -- gathers the codes and scales, bit for bit its quantization; nvlua.shard) or "f32" (every weight)
  gather = str("quantized", {one_of = {"quantized", "f32"}}),
  -- sync=shadow (ShadowSync): no gradient all-reduce; each rank steps on its own gradients and every
  -- shadow_every steps the parameters are averaged over the ranks by an all-reduce of a snapshot in
  -- a background thread, applied as the change it brings (p += avg - snapshot) at the next averaging
  -- (shadow_overlap=false: applied at once, p = avg: synchronous parameter averaging);
  -- shadow_moments: the AdamW moments (m, v) averaged the same way, with the parameters
  sync = str("allreduce", {one_of = {"allreduce", "shadow"}}), shadow_every = int(1, {min = 1}),
  shadow_overlap = bool(true), shadow_moments = bool(false),
  -- where the model, its gradients and the optimizer state live: cpu | cuda
  device = str("cpu", {check = check_device, doc = "cpu | cuda"}),
  -- refuse, before anything is built, a run whose memory plan (nvlua.plan) exceeds the machine's
  -- memory (train.check_memory); false builds it anyway (the plan is an estimate)
  check_memory = bool(true),
}, {relations}, {resolve_init})

-- One line each for `nvlua <experiment> --help`, where the key's definition above gives none (the
-- comments above say more).
local KEY_DOCS = {
  seed = "the model's initialisation and the recipe's SR / RHT draws", data_seed = "the order of the batches",
  layers = "transformer blocks", hidden = "the model width", heads = "query heads", kv_heads = "key/value heads (GQA)",
  ffn = "SwiGLU's inner width", head_dim = "0: hidden / heads", vocab = "0: the data's tokenizer's",
  rope_theta = "RoPE's base", norm_eps = "RMSNorm's epsilon", tie = "the LM head shares the embedding",
  seq = "tokens per sequence", max_positions = "the context length a checkpoint declares (0: seq)",
  steps = "optimizer steps", batch = "sequences per micro-batch (per rank)",
  grad_accum = "micro-batches per step", lr = "the peak learning rate", min_lr = "the learning rate the decay ends at",
  warmup = "steps of linear warmup", schedule = "the LR schedule: wsd, cosine, linear, constant (or a Lua value)",
  decay = "wsd: the share of steps spent decaying", beta1 = "AdamW's beta1", beta2 = "AdamW's beta2",
  eps = "AdamW's epsilon", weight_decay = "AdamW's decoupled weight decay", clip = "global gradient-norm clip",
  z_loss = "weight of the z-loss (log-sum-exp^2) term; 0: off",
  recipe = "the precision recipe: a registered name (nv.recipe.names()) or a recipe value",
  rht = "random Hadamard transforms on the Wgrad inputs (nvfp4)", sr = "stochastic rounding of gradients (nvfp4)",
  w2d = "16x16 2D weight blocks (nvfp4)", bf16_first = "blocks kept in bf16 at the start (-1: the recipe's)",
  bf16_last = "blocks kept in bf16 at the end (-1: the recipe's)", switch_step = "switch to bf16 from this step (0: never)",
  switch_forward_only = "switch_step: only the forward's GEMMs go to bf16",
  attention_deterministic = "cuDNN's attention backward without fp32 atomics (Hopper)",
  teacher_recipe = "the teacher's recipe (distillation)", distill_alpha = "KL's weight in the distillation loss",
  distill_temperature = "the distillation temperature",
  eval_every = "steps between validation evals (and at the last step; 0: never)", eval_batches = "batches per validation eval",
  log_every = "steps between console lines", ckpt_background = "write periodic checkpoints in a background thread",
  ckpt_overlap = "ckpt_background: copy the state while the next step runs", keep = "checkpoints kept (0: all)",
  sample_tokens = "tokens of the text sample at the end (0: none)", temperature = "the sample's temperature",
  top_k = "the sample's top-k", max_bad_steps = "skipped (non-finite) steps in a row that stop the run",
  plot = "loss.png at the end (gnuplot)", quiet = "no console output but errors", save = "write checkpoints",
  overwrite = "resume=none on an out= that holds a run: remove it first",
  dist = "data parallelism over MPI ranks (launch with mpirun / srun)", shard_optimizer = "alias of shard=optimizer",
  bucket_grads = "all-reduce each block's gradients as its backward completes them",
  shard = "none | optimizer (ZeRO-1) | grads (ZeRO-2) | full (ZeRO-3 / FSDP)",
  reshard_after_forward = "shard=full: free gathered weights after the forward",
  gather = "shard=full: gather quantized codes and scales, or f32 weights",
  sync = "allreduce (gradients) | shadow (periodic parameter averaging)", shadow_every = "sync=shadow: steps between averagings",
  shadow_overlap = "sync=shadow: apply each average one averaging later (false: at once)", shadow_moments = "sync=shadow: average AdamW's moments too",
  check_memory = "refuse a run whose memory plan exceeds the machine's",
}
for k, d in pairs(KEY_DOCS) do
  local spec = assert(train.schema.specs[k], k)
  if not spec.doc then spec.doc = d end
end

--- The defaults of train.schema's keys (a plain table).
train.defaults = train.schema:defaults()

--- train.shard_mode(c) -> "none" | "optimizer" | "grads" | "full": c.shard, with shard_optimizer=true
-- read as "optimizer"
function train.shard_mode(c)
  if c.shard_optimizer then return "optimizer" end
  return c.shard or "none"
end

--- train.check(c) -> c: the config's train keys and their relations checked (train.schema); raises
-- "config: <key> must be ..., got ..." naming the key. train.build runs it first.
function train.check(c) return train.schema:check(c) end

-- ---- building -------------------------------------------------------------------------------

function train.dataset(c)
  local cache = c.cache ~= "" and c.cache or nil
  if c.data == "kjv" then return data.kjv({cache = cache}) end
  local shards, prefix = c.data:match("^shards:(.*)$"), c.data:match("^megatron:(.*)$")
  if shards or prefix then
    -- the vocabulary: the manifest's or the tokenizer's (vocab= may only be larger: check_data_fits)
    local o = {tokenizer = c.tokenizer ~= "" and c.tokenizer or nil, cache = cache}
    local ds = shards and data.shards(shards, o) or data.megatron(prefix, o)
    if not ds.vocab_size and c.vocab == 0 then
      user_error(string.format("config: data=%s needs vocab=<vocabulary size> or tokenizer=<tokenizer.json>: %s has no " ..
        "manifest.json nor tokenizer.json (scripts/prepare_data.py writes them)", c.data,
        shards or (prefix:match("^(.*)/[^/]*$") or ".")), 0)
    end
    return ds
  end
  -- raw text: byte tokens, or encoded now with tokenizer=
  return data.text(c.data, {cache = cache, tokenizer = c.tokenizer ~= "" and c.tokenizer or nil})
end

--- train.model_config(c, vocab) -> the Llama config (nn.llama_config's keys) of a checked config:
-- the model's keys, rope_scaling included, and with init= what its checkpoint's config.json says
-- beyond them (initializer_range, the token ids), so that the model built from it is the
-- checkpoint's (then hf.load_weights).
function train.model_config(c, vocab)
  local mc = {
    vocab_size = vocab, hidden_size = c.hidden, intermediate_size = c.ffn, num_hidden_layers = c.layers,
    num_attention_heads = c.heads, num_key_value_heads = c.kv_heads, head_dim = c.head_dim > 0 and c.head_dim or nil,
    rope_theta = c.rope_theta, rms_norm_eps = c.norm_eps, rope_scaling = rope_scaling_of(c.rope_scaling or ""),
    max_position_embeddings = math.max(c.max_positions > 0 and c.max_positions or c.seq, 1),
    tie_word_embeddings = c.tie,
  }
  if (c.init or "") ~= "" then
    local src, err = train.init_source(c.init)
    if not src then user_error("config: init: " .. err, 0) end
    local hc = assert(hf.read_config(src.dir))
    for _, k in ipairs({"initializer_range", "bos_token_id", "eos_token_id", "pad_token_id"}) do mc[k] = hc[k] end
  end
  return mc
end

-- Will train.run resume (start_run: resume=<dir>, or resume=auto with a checkpoint in out=)? Then
-- init='s weights are not loaded: the checkpoint's replace them.
local function will_resume(c)
  if c.resume == "none" then return false end
  return c.resume ~= "auto" or ckpt.latest(c.out) ~= nil
end

--- train.load_init(c, model): the weights of c.init (train.init_source) copied into model, built for
-- them by train.build (hf.load_weights: every parameter, each finite; a model under shard=grads|full
-- keeps its rows). They are master weights: the recipe quantizes them as it does any.
function train.load_init(c, model)
  local src, err = train.init_source(c.init)
  if not src then user_error("config: init: " .. err, 0) end
  local ok, lerr = pcall(hf.load_weights, model, src.dir)
  if not ok and not util.is_user_error(lerr) then error(lerr, 0) end
  if not ok then user_error(string.format("config: init=%s: %s", c.init, lerr), 0) end
end

-- The settings a config gives every recipe constructor (recipe.register): seed, switch_at, rht,
-- sr, w2d, bf16_first, bf16_last, act_dtype, fused_amax (nil where the config leaves them to the recipe).
local function recipe_settings(c)
  local switch = c.switch_step > 0 and {step = c.switch_step, forward_only = c.switch_forward_only} or nil
  return {seed = c.seed, switch_at = switch, rht = c.rht, sr = c.sr, w2d = c.w2d,
    bf16_first = c.bf16_first >= 0 and c.bf16_first or nil, bf16_last = c.bf16_last >= 0 and c.bf16_last or nil,
    act_dtype = c.act_dtype ~= "recipe" and c.act_dtype or nil, fused_amax = c.fused_amax or nil}
end

--- The run's recipe: c.recipe itself when it is a recipe value (recipe.custom, a preset), else the
-- recipe registered under the name c.recipe (recipe.register), built from the config's settings.
function train.recipe(c)
  local r = nv.recipe
  local name = c.recipe
  if r.is_recipe(name) then
    if c.act_dtype ~= "recipe" and c.act_dtype ~= name.act_dtype then
      user_error(string.format("config: act_dtype=%s but the recipe value %s has act_dtype %s; give it {act_dtype = " ..
        "\"%s\"} when building it, or act_dtype=recipe", c.act_dtype, tostring(name), name.act_dtype, c.act_dtype), 0)
    end
    if c.fused_amax and not name.fused_amax then
      user_error(string.format("config: fused_amax=true but the recipe value %s does not scale fused groups by one amax; " ..
        "give it {fused_amax = true} when building it", tostring(name)), 0)
    end
    return name
  end
  local names = r.names()
  local known = false
  for _, n in ipairs(names) do known = known or n == name end
  if not known then
    user_error(string.format("config: recipe must be a recipe value or one of %s; got %s", table.concat(names, ", "),
      type(name) == "string" and "'" .. name .. "'" or type(name)), 0)
  end
  return r.make(name, recipe_settings(c))
end

--- train.checkpoint_model(dir, what [, name, default]) -> model, run, from_run, recipe: a model to score or
-- export. A checkpoint of a run (trainer.json beside model/): its model under the recipe train.recipe
-- builds from the run's keys (JSON numbers back to integers), the recipe's state (SR generator,
-- delayed-scaling histories) loaded as a resume loads it and model.step its step (from_run true);
-- run is the run's config. name (a registered recipe) replaces the run's recipe, its keys and its state;
-- a directory without trainer.json (a Hugging Face model) computes under name, else default. what
-- names the caller in errors (scripts/eval.lua, scripts/export.lua).
function train.checkpoint_model(dir, what, name, default)
  local run
  local marker = dir .. "/trainer.json"
  if lfs.attributes(marker, "mode") == "file" then
    local f = assert(io.open(marker, "rb"))
    local ok, v = pcall(cjson.decode, f:read("a"))
    f:close()
    if not ok or type(v) ~= "table" or type(v.config) ~= "table" then
      user_error(what .. ": " .. marker .. " is not a trainer.json of nvlua (no config)", 0)
    end
    run = v.config
  end
  local from_run = run ~= nil and name == nil
  local rc = {recipe = name or (run and run.recipe) or default, act_dtype = "recipe", switch_step = 0, bf16_first = -1,
    bf16_last = -1}
  if from_run then
    for _, k in ipairs({"seed", "switch_step", "switch_forward_only", "rht", "sr", "w2d", "bf16_first", "bf16_last",
      "act_dtype", "fused_amax"}) do
      local v = run[k]
      if v ~= nil and v ~= cjson.null then rc[k] = type(v) == "number" and math.tointeger(v) or v end
    end
  end
  local ok, rec = pcall(train.recipe, rc)
  if not ok then
    user_error(string.format("%s: the recipe %s: %s (give recipe=<a registered name>)", what, tostring(rc.recipe),
      tostring(rec):gsub("^.-config: ", "")), 0)
  end
  local model = hf.from_pretrained(dir, {recipe = rec})
  if from_run then model.step = ckpt.load(dir, {model = model, recipe = rec}).step end -- a recipe may switch by step
  return model, run, from_run, rec
end

-- The recipe and schedule train.build made from a config (weak keys): an experiment may put others
-- into the parts, which the run record then describes in config.json (nvlua.record).
local made = setmetatable({}, {__mode = "k"})

-- Data parallelism: rec scales activations and gradients by the amax of the global batch and
-- draws SR bits at this rank's rows of it (recipe:set_amax_reducer, set_shard).
local function dist_hooks(rec, dist, rank, world)
  if rec.set_amax_reducer then
    rec:set_amax_reducer(function(a) return dist.all_reduce_number(a, "max") end)
    rec:set_shard(rank, world)
  end
end

-- The data against the config, before the model is built: the vocabulary (the data's, and every
-- token id of scanned files: data.token_ranges, done when the dataset was opened), and enough tokens
-- in each split for one global batch (the validation split only when the run evaluates).
local function check_data_fits(c, ds, world)
  if c.vocab > 0 and ds.vocab_size and c.vocab < ds.vocab_size then
    user_error(string.format("config: vocab=%d is smaller than the data's vocabulary (%d tokens)", c.vocab, ds.vocab_size), 0)
  end
  if c.vocab > 0 then
    for _, split in ipairs({ds.train, ds.val}) do data.check_vocab(split, c.vocab, "vocab=" .. c.vocab) end
  end
  local need = c.batch * world
  local function fits(split, name)
    local total = 0
    for _, s in ipairs(split) do total = total + s.count end
    local windows = math.max(total - 1, 0) // c.seq
    if windows < need then
      user_error(string.format("config: the %s split of data=%s has %d tokens: %d windows of seq+1=%d tokens, but a batch of " ..
        "batch=%d x %d rank(s) needs %d; lower seq or batch, or give more data", name, c.data, total, windows, c.seq + 1,
        c.batch, world, need), 0)
    end
  end
  fits(ds.train, "training")
  if c.eval_every > 0 then fits(ds.val, "validation") end
end

-- ---- will it fit? ------------------------------------------------------------------------------

local GiB = 2 ^ 30

-- a number of bytes from a file holding one integer (a cgroup limit), or nil
local function read_int_file(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local v = f:read("l")
  f:close()
  return v and math.tointeger(tonumber(v:match("^%s*(%d+)%s*$")))
end

--- train.machine_memory(device) -> bytes, a phrase saying whose they are; nil when unknown. "cpu":
-- the RAM (/proc/meminfo MemTotal), or the process's cgroup limit (v2 memory.max, v1
-- memory.limit_in_bytes) when smaller; "cuda": the smallest GPU's total memory. Tests replace it.
function train.machine_memory(device)
  if device == "cuda" then
    local least
    for _, d in ipairs(nv.cuda.memory()) do
      if type(d) == "table" and (d.total or 0) > 0 then least = math.min(least or math.huge, d.total) end
    end
    return least, "of GPU memory"
  end
  local f = io.open("/proc/meminfo", "r")
  local total = nil
  if f then
    for line in f:lines() do
      local kb = line:match("^MemTotal:%s*(%d+)%s*kB")
      if kb then total = math.tointeger(tonumber(kb)) * 1024; break end
    end
    f:close()
  end
  local what = "of RAM on this machine"
  for _, p in ipairs({"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) do
    local limit = read_int_file(p)
    if limit and (not total or limit < total) then
      total, what = limit, "this process may use (its cgroup's limit, " .. p .. ")"
    end
  end
  return total, what
end

--- train.local_ranks() -> the processes of this job on this node, as the launcher says: Open MPI
-- (OMPI_COMM_WORLD_LOCAL_SIZE), MPICH / Hydra (MPI_LOCALNRANKS), Slurm (SLURM_NTASKS_PER_NODE, or the
-- first count of SLURM_TASKS_PER_NODE, e.g. "8(x2)"); 1 when none does.
function train.local_ranks()
  for _, var in ipairs({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) do
    local n = math.tointeger(tonumber((os.getenv(var) or ""):match("^(%d+)") or ""))
    if n and n >= 1 then return n end
  end
  return 1
end

-- The variables an MPI launcher sets in its ranks: Open MPI, PMIx (Open MPI 5, srun --mpi=pmix), PMI
-- (MPICH / Hydra, Intel MPI, srun --mpi=pmi2), MVAPICH.
local LAUNCHER_VARS = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}

--- train.progress_bar() -> whether the console gets a progress bar ("\r" updates) between log lines:
-- NVLUA_PROGRESS=1 or 0 says so; else only when stdout is an interactive terminal of this process:
-- a tty, TERM set and not "dumb", and no MPI launcher (Open MPI forwards a rank's stdout through a pty
-- while mpirun's own output goes to a log file). Slurm needs no rule of its own: a batch job's stdout
-- is a file and srun's a pipe (srun --pty, a terminal someone watches, keeps the bar).
function train.progress_bar()
  local force = os.getenv("NVLUA_PROGRESS")
  if force == "0" or force == "1" then return force == "1" end
  if force and force ~= "" then user_error("NVLUA_PROGRESS must be 0 or 1, got '" .. force .. "'", 0) end
  local term = os.getenv("TERM")
  if not core.isatty(1) or not term or term == "" or term == "dumb" then return false end
  for _, v in ipairs(LAUNCHER_VARS) do
    if os.getenv(v) then return false end
  end
  return true
end

--- train.check_memory(c, recipe, model_config, world): refuses ("config: ...", before anything is
-- allocated) a run that cannot fit the machine's memory (train.machine_memory, per process: times
-- the ranks on this node, train.local_ranks, on the CPU). First a bound that costs nothing
-- whatever the size: the weights, gradients and AdamW states of one rank (16 bytes per parameter,
-- the sharded ones / world: shard, shard_optimizer) plus the bf16 activations a step saves (fewer
-- with recompute); then the memory plan of one rank of `world` under the run's shard and recompute
-- (nvlua.plan.memory, within 5% of the measured peak: tests/test_plan.lua). c.shard and c.recompute
-- are read where the config has them (default none; shard_optimizer=true is shard=optimizer).
-- Not counted: a distillation teacher.
function train.check_memory(c, rec, mc, world)
  if not c.check_memory then return end
  local have, whose = train.machine_memory(c.device)
  if not have then return end
  local per_node = c.device == "cpu" and train.local_ranks() or 1
  local ranks = per_node > 1 and string.format(" (x %d ranks on this node)", per_node) or ""
  local p = plan.params(mc)
  local hd = mc.head_dim or mc.hidden_size // mc.num_attention_heads
  local C, F, L, N = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, c.batch * c.seq
  local shard = train.shard_mode(c)
  local recompute = c.recompute or "none"
  -- one rank's f32 weights, gradients and AdamW moments, the sharded ones / world
  local per_param = ({none = 16, optimizer = 8 + 8 / world, grads = 4 + 12 / world, full = 16 / world})[shard] or 16
  local state = per_param * p.total
  -- the bf16 activations a step keeps per token and block (nvlua.llama's header): all of them, the block's
  -- input (recompute=block: plus one block's whole set) or all but the norms' outputs and SwiGLU's product
  local block_acts = 6 * C + 2 * hd * mc.num_key_value_heads + 3 * F
  local acts = 2 * N * (recompute == "block" and L * C + block_acts or
    L * (block_acts - (recompute == "selective" and 2 * C + F or 0)))
  local fix = "lower layers, hidden, ffn, batch or seq (grad_accum keeps the tokens per step), or give " ..
    "check_memory=false to build it anyway"
  if (state + acts) * per_node > have then
    user_error(string.format("config: this run cannot fit: it needs at least %.1f GiB%s (%.3fB parameters x %g bytes for " ..
      "the weights, gradients and AdamW states: %.1f GiB; the activations of batch=%d x seq=%d over %d layers: " ..
      "%.1f GiB), more than the %.1f GiB %s; %s", (state + acts) / GiB, ranks, p.total / 1e9, state / p.total,
      state / GiB, c.batch, c.seq, L, acts / GiB, have / GiB, whose, fix), 0)
  end
  local ok, m = pcall(plan.memory, mc, rec, c.batch, c.seq, {gpus = world, shard = shard, recompute = recompute,
    device = c.device, grad_accum = c.grad_accum, reshard_after_forward = c.reshard_after_forward ~= false})
  if not ok then return end -- a recipe the plan cannot read: the bound above is all there is
  local total = m.total -- one rank's, under its shard and recompute
  if total * per_node > have then
    user_error(string.format("config: this run needs about %.2f GiB%s by its memory plan (nvlua.plan: weights %.2f, " ..
      "gradients %.2f, AdamW %.2f, activations of batch=%d x seq=%d %.2f, weight copies %.2f, scratch %.2f " ..
      "GiB), more than the %.2f GiB %s; %s", total / GiB, ranks, m.weights / GiB, m.grads / GiB, m.optimizer / GiB,
      c.batch, c.seq, m.activations / GiB, m.weight_copies / GiB, m.transient / GiB, have / GiB, whose, fix), 0)
  end
end

--- train.teacher(c, vocab) -> the frozen teacher of c.teacher (nil without one): loaded with
-- hf.from_pretrained under c.teacher_recipe, on c.device, in eval mode; its vocabulary must be the
-- student's.
function train.teacher(c, vocab)
  if c.teacher == "" then return nil end
  local t = hf.from_pretrained(c.teacher, {recipe = nv.recipe.make(c.teacher_recipe)})
  if t.config.vocab_size ~= vocab then
    user_error(string.format("config: teacher=%s has a vocabulary of %d tokens, the student %d", c.teacher,
      t.config.vocab_size, vocab), 0)
  end
  if c.device ~= "cpu" then t:to(c.device) end
  t:eval()
  return t
end

-- the MPI thread level a run asks for: sync=shadow averages in a thread of its own, which needs
-- MPI_THREAD_MULTIPLE
local function dist_threads(c) return c.sync == "shadow" and "multiple" or "funneled" end

--- Build everything a run needs from a resolved config. With c.dist the process group is
-- started here (parts.dist, parts.rank, parts.world). c.recipe is a registered name or a recipe
-- value (train.recipe); either way, with more than one rank, it gets the data-parallel hooks.
function train.build(c)
  train.check(c)
  train.check_out(c)
  core.attention_route(c.attention) -- one setting for the process (core/layers.h), as the next
  core.attention_cudnn_deterministic(c.attention_deterministic)
  local dist, rank, world
  local sm = train.shard_mode(c)
  if c.dist or sm ~= "none" then
    dist = require "nvlua.dist"
    if c.dist then dist.init({threads = dist_threads(c)}) end
  end
  rank, world = dist and dist.rank() or 0, dist and dist.world_size() or 1
  if world > 1 and c.device == "cuda" and not c.quiet then -- which GPU each rank got, one line per rank
    print(string.format("rank %d of %d (local %d): %s", rank, world, dist.local_rank(), dist.gpu() or
      "no GPU: " .. require("nvlua").cuda.unavailable_reason()))
    io.stdout:flush()
  end
  local ds = train.dataset(c)
  if c.init ~= "" and ds.vocab_size and ds.vocab_size ~= c.vocab then -- (c.vocab: the checkpoint's)
    user_error(string.format("config: init=%s has vocab_size %d, but data=%s has a vocabulary of %d tokens (%s); train " ..
      "it on data tokenized with its tokenizer", c.init, c.vocab, c.data, ds.vocab_size, ds.vocab_source or
      "byte tokens"), 0)
  end
  check_data_fits(c, ds, world)
  local vocab = c.vocab > 0 and c.vocab or ds.vocab_size
  local rec = train.recipe(c)
  local mc = train.model_config(c, vocab)
  if sm == "grads" or sm == "full" then shard.check_world(mc, world, sm) end
  train.check_memory(c, rec, mc, world)
  local function make() return llama.Llama(mc, {recipe = rec, seed = c.seed, recompute = c.recompute}) end
  -- shard=full: built in rows, each rank's parameters and gradients its rows only (the values the
  -- whole initialisation gives them), never the whole model (nvlua.shard)
  local model = sm == "full" and shard.build(world, rank, make) or make()
  if world > 1 then
    -- the same weights everywhere (they are by construction, from the seed; this makes it so; rows
    -- are each rank's own)
    if sm ~= "full" then for _, e in ipairs(model:named_parameters()) do dist.broadcast(e.param, 0) end end
    dist_hooks(rec, dist, rank, world)
  end
  -- initialised on the cpu from the seed, then moved: the same weights on either device
  if c.device ~= "cpu" then model:to(c.device) end
  local oo = {lr = c.lr, betas = {c.beta1, c.beta2}, eps = c.eps, weight_decay = c.weight_decay}
  local opt
  if sm == "grads" or sm == "full" then
    opt = shard.Sharded(model, oo, dist, {mode = sm, reshard_after_forward = c.reshard_after_forward,
      gather = c.gather})
  elseif sm == "optimizer" then opt = optim.ShardedAdamW(model, oo, dist)
  else opt = optim.AdamW(model:named_parameters(), oo) end
  -- init=: loaded once the optimizer is made (under shard=grads|full it installs the model's
  -- load_state_dict of whole tensors), as a resume loads a checkpoint
  if c.init ~= "" and not will_resume(c) then train.load_init(c, model) end
  local sched = type(c.schedule) ~= "string" and c.schedule or schedule.make(c.schedule, {lr = c.lr, min_lr = c.min_lr,
    warmup = c.warmup, total = c.steps, decay = c.decay})
  made[rec], made[sched] = true, true
  local loader = data.Loader(ds.train, {batch = c.batch, seq = c.seq, seed = c.data_seed, rank = rank, world = world})
  return {dataset = ds, model = model, recipe = rec, optimizer = opt, schedule = sched, loader = loader, dist = dist,
    rank = rank, world = world, teacher = train.teacher(c, vocab)}
end

-- ---- measuring ------------------------------------------------------------------------------

--- Model FLOPs per token for training (forward + backward): 6 per parameter in the GEMMs
-- (the embedding lookup is not a GEMM) plus attention's QK^T and PV, 12·L·T·head_dim·Hq
-- (counted for the full square; causal masking halves the useful work).
function train.flops_per_token(cfg_model, T)
  local c = cfg_model
  local hd = c.head_dim or c.hidden_size // c.num_attention_heads
  local per_layer = c.hidden_size * hd * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)
    + 3 * c.hidden_size * c.intermediate_size
  local gemm_params = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
  return 6 * gemm_params + 12 * c.num_hidden_layers * T * hd * c.num_attention_heads
end

-- ---- evaluation and sampling -------------------------------------------------------------------

--- train.evaluate(model, ds, c [, parts]) -> val loss, perplexity. With parts.world > 1 each rank
-- evaluates its windows of every batch and the sums are reduced (a collective).
function train.evaluate(model, ds, c, p)
  local rank, world = p and p.rank or 0, p and p.world or 1
  local loader = data.Loader(ds.val, {batch = c.batch, seq = c.seq, shuffle = false, rank = rank, world = world})
  local total, count = 0, 0
  local n = math.min(c.eval_batches, loader.per_epoch)
  for _ = 1, n do
    local loss, cnt = nv.scope(function()
      local x, y = loader:next()
      return model:loss(x, y)
    end)
    total, count = total + loss * cnt, count + cnt
  end
  if world > 1 then
    total, count = p.dist.all_reduce_number(total, "sum"), p.dist.all_reduce_number(count, "sum")
  end
  local loss = total / math.max(count, 1)
  return loss, math.exp(loss)
end

-- The ids "tokenizer" of train.sample without one: ids joined by spaces.
local IDS = {name = "ids"}
function IDS:encode() user_error("train.sample: without a tokenizer the prompt must be token ids (a table)", 3) end
function IDS:decode(ids) return table.concat(ids, " ") end

--- train.sample(model, tok, prompt, n [, {temperature =, top_k =, seed =}]) -> text: n tokens after a prompt
-- by model:generate (a KV cache; temperature 0: greedy, else top-k sampling deterministic from the seed),
-- decoded by tok:decode, or their ids joined by spaces without a tokenizer (tok nil). prompt: text (encoded
-- by tok:encode) or token ids (a table: a data manifest's pre-tokenized prompt). Fewer than n tokens when
-- the tokenizer's eos comes or the context (max_position_embeddings) is full; the second result says
-- which ("eos" | "context" | "max_new_tokens").
function train.sample(model, tokenizer, prompt, n, o)
  o = o or {}
  local ids = type(prompt) == "table" and prompt or nil
  local text, _, stop = model:generate(tokenizer or IDS, ids and "" or prompt, {prompt_ids = ids, max_new_tokens = n,
    temperature = o.temperature, top_k = o.top_k, seed = o.seed})
  return text, stop
end

--- The end-of-run sample's prompt for a tokenizer -> ids (or text), and its text: the sample_prompt
-- key's text when given (encoded by the tokenizer); "And " (the byte tokenizer); the data manifest's
-- prompt (scripts/prepare_data.py tokenizes it with the real tokenizer); else the bos token alone;
-- else nil (no sample).
function train.sample_prompt(tok, text)
  if text and text ~= "" then return text, text end
  if tok.name == "bytes" then return "And ", "And " end
  if tok.prompt then return tok.prompt.ids, tok.prompt.text end
  if tok.bos_id then return {tok.bos_id}, "" end
  return nil
end

-- ---- the loop ---------------------------------------------------------------------------------
-- train.run in named steps: start_run (resume, config.json and run.json, metrics.jsonl, the header), then per
-- step step_once (one optimisation step and its metrics record), report_step (console),
-- eval_and_log, save_checkpoint and interrupt_requested, and at the end finish_run (the final
-- checkpoint, sample and plot). They share one table r: the config c, the parts, the rank's role,
-- and the run's running state (step, losses, val_points, skipped, ...).

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

local function fmt_time(s)
  if s < 60 then return string.format("%.0fs", s) end
  return string.format("%dm%02ds", math.floor(s / 60), math.floor(s % 60))
end

-- where ranks other than 0, and quiet runs, write
local SILENT = {write = function() end, flush = function() end, close = function() end}

-- A checkpoint at step: gathered state on every rank (ZeRO-1's moments: a collective), written by
-- rank 0; the others wait until it is complete. -> its directory. Its scope frees the gathered
-- moments (full-size copies) once written. It records the skipped-step counters; pruning never
-- removes the checkpoint this run resumed from, nor the newest one written outside a streak of
-- skipped steps (nvlua.checkpoint).
local function save_checkpoint(r, step, background)
  -- AdamW flags a non-finite parameter as it writes it, after the step has read its flags: a save
  -- right after such a step holds the NaN. It is marked unhealthy (written within a streak), so
  -- pruning keeps the last healthy checkpoint and resume never takes it; the flag goes on to the
  -- next step, which is skipped. The take is a copy to the host, as the save is anyway; the ranks
  -- agree (ZeRO-1 shards: each rank updates its own).
  local pflags = r.params[1] and core.nonfinite_take(r.params[1].param) or 0
  if r.world > 1 then pflags = r.dist.all_reduce_number(pflags ~= 0 and 1 or 0, "sum") > 0 and 2 or 0 end
  r.carry_flags = (r.carry_flags or 0) | pflags
  local bad_in_row = r.bad_in_row + (pflags ~= 0 and 1 or 0)
  local path = nv.scope(function()
    local opt = r.opt
    local optv = opt
    local serve = opt.serve_checkpoint -- shard=grads|full: tensors gathered as rank 0 writes them
    if opt.sharded and not serve then
      local st = opt:state()
      optv = {state = function() return st end}
    end
    local path = string.format("%s/checkpoints/step-%06d", r.run_dir, step)
    if r.main then
      path = ckpt.save(r.run_dir, {model = serve and opt:model_view() or r.model, optimizer = optv, recipe = r.rec, loader = r.loader, step = step,
        config = r.c, keep = r.c.keep, protect = r.resumed_from, bad_in_row = bad_in_row, skipped = r.skipped,
        tokenizer = r.ds.tokenizer, max_batches_per_step = r.max_batches, background = background or nil,
        defer_copy = background and r.c.ckpt_overlap or nil})
    elseif serve then
      opt:serve_checkpoint()
    end
    if r.world > 1 then r.dist.barrier() end
    return path
  end)
  r.last_ckpt = {step = step, dir = path}
  return path
end

-- What out= holds of an earlier run (records in metrics.jsonl, checkpoints), as a phrase, or nil.
local function held_run(run_dir)
  local n, last = 0, nil
  local f = io.open(run_dir .. "/metrics.jsonl", "r")
  if f then
    for line in f:lines() do
      if line:match("%S") then
        n = n + 1
        local ok, rec = pcall(cjson.decode, line)
        if ok and type(rec) == "table" and type(rec.step) == "number" then last = rec.step end
      end
    end
    f:close()
  end
  local parts = {}
  if n > 0 then
    parts[1] = string.format("metrics.jsonl with %d records%s", n, last and string.format(" up to step %d", last) or "")
  end
  local latest = ckpt.latest(run_dir)
  if latest then parts[#parts + 1] = "the checkpoint " .. latest end
  return #parts > 0 and table.concat(parts, " and ") or nil
end

local function refuse_held(run_dir, held)
  user_error(string.format("resume=none: out=%s already holds a run (%s); resume=auto continues it; to start over, " ..
    "give overwrite=true (which removes it), remove that directory or choose another out=", run_dir, held), 0)
end

--- train.check_out(c): resume=none refuses an out= that holds a run, unless c.overwrite (train.build
-- runs it before it builds anything).
function train.check_out(c)
  if c.resume ~= "none" or c.overwrite then return end
  local held = held_run(c.out)
  if held then refuse_held(c.out, held) end
end

-- resume=auto's checkpoint: the newest intact one (ckpt.verify). Each newer one that is damaged (a
-- trainer.json that cannot be read or belongs elsewhere, a missing or truncated file, ...) is set
-- aside as <dir>.corrupt (ckpt.set_aside: kept, never pruned nor overwritten when its step is saved
-- again) and reported, on stderr and in r.skipped_checkpoints, with the reason. -> dir or nil
local function newest_intact(r)
  local all = ckpt.list(r.run_dir)
  for i = #all, 1, -1 do
    local problem = ckpt.verify(all[i], {optimizer = true})
    if not problem then return all[i] end
    local aside = ckpt.set_aside(all[i])
    r.skipped_checkpoints[#r.skipped_checkpoints + 1] = {dir = all[i], reason = problem, moved_to = aside}
    io.stderr:write(string.format("resume=auto: skipped the checkpoint %s, it is damaged: %s; moved it to %s " ..
      "(kept for inspection); trying the one before it\n", all[i], problem, aside))
    io.stderr:flush()
  end
  return nil
end

-- Rank 0's choice of the checkpoint to resume from (nil: start fresh). An existing run is never
-- started over unasked: resume=none refuses an out= that holds one unless overwrite=true (then it is
-- removed), and resume=auto refuses when it finds no complete checkpoint there (after ckpt.recover
-- has settled what a crash left), or only damaged ones (newest_intact set them aside).
local function pick_checkpoint(r)
  local c = r.c
  if c.resume == "none" then
    local held = held_run(r.run_dir)
    if held and not c.overwrite then refuse_held(r.run_dir, held) end
    if held then -- overwrite=true: the earlier run's checkpoints and metrics go
      ckpt.remove_all(r.run_dir)
      os.remove(r.run_dir .. "/metrics.jsonl")
      r.out:write(string.format("overwrite=true: removed the earlier run in %s (%s)\n", r.run_dir, held))
    end
    return nil
  end
  if c.resume ~= "auto" then return c.resume end
  ckpt.recover(r.run_dir)
  local dir = newest_intact(r)
  if dir then return dir end
  if #r.skipped_checkpoints > 0 then
    local moved = {}
    for i, e in ipairs(r.skipped_checkpoints) do moved[i] = e.moved_to end
    user_error(string.format("resume=auto: every checkpoint in %s/checkpoints is damaged (set aside: %s; the reasons are " ..
      "printed above); refusing to start the run over: repair one and give resume=<its dir>, or remove %s to start " ..
      "fresh", r.run_dir, table.concat(moved, ", "), r.run_dir), 0)
  end
  local held = held_run(r.run_dir)
  if held then
    user_error(string.format("resume=auto: no complete checkpoint in %s/checkpoints, but out=%s holds a run (%s); " ..
      "refusing to start it over: resume=<checkpoint dir> picks one, or remove the directory to start fresh",
      r.run_dir, r.run_dir, held), 0)
  end
  r.out:write("resume=auto: no checkpoint in " .. r.run_dir .. "/checkpoints, starting fresh\n")
  return nil
end

-- Is dir this run's own checkpoint of step (the same directory, however named)?
local function own_checkpoint(r, dir, step)
  local a = lfs.attributes(dir)
  local b = lfs.attributes(string.format("%s/checkpoints/step-%06d", r.run_dir, step))
  return a and b and a.dev == b.dev and a.ino == b.ino
end

-- resume=<dir>|auto|none: load that checkpoint into the parts, with the skipped-step counters
-- (ckpt.load refuses a checkpoint taken after more than max_bad_steps skipped steps in a row).
-- Rank 0 picks; the others follow its choice (its step; -1: none, -2: it failed, -3: the dir given).
-- -> the step it was taken at (0: none)
local function resume(r)
  local c = r.c
  local explicit = c.resume ~= "none" and c.resume ~= "auto"
  if explicit and not lfs.attributes(c.resume .. "/trainer.json") then
    user_error("config: resume=" .. c.resume .. " is not a checkpoint directory (no trainer.json in it)", 0)
  end
  local dir, err
  if r.main then
    local ok, d = pcall(pick_checkpoint, r)
    if ok then dir = d else err = d end
  end
  if r.world > 1 then
    local code = err and -2 or not dir and -1 or explicit and -3 or math.tointeger(tonumber(dir:match("step%-(%d+)$")))
    local t = nv.tensor({code}, "i64")
    r.dist.broadcast(t, 0)
    code = t:get(1)
    if code == -2 and not r.main then user_error("resume: rank 0 could not resume (its message says why)", 0) end
    if not r.main then
      dir = code == -3 and c.resume or code >= 0 and string.format("%s/checkpoints/step-%06d", r.run_dir, code) or nil
    end
  end
  if err then error(err, 0) end
  if not dir then return 0 end
  local tr = ckpt.load(dir, {model = r.model, optimizer = r.opt, recipe = r.rec, loader = r.loader,
    max_bad_steps = c.max_bad_steps})
  r.bad_in_row, r.skipped = tr.bad_steps_in_row, tr.skipped_steps
  -- the most batches a step of this run has drawn (bounds the data cursor of its checkpoints), unknown
  -- when the checkpoint does not say
  r.max_batches = tr.max_batches_per_step and math.max(tr.max_batches_per_step, c.grad_accum) or nil
  r.resumed_from = dir
  if own_checkpoint(r, dir, tr.step) then r.last_ckpt = {step = tr.step, dir = dir} end
  r.out:write(string.format("resumed from %s at step %d\n", dir, tr.step))
  return tr.step
end

-- metrics.jsonl, opened for writing on rank 0 (SILENT elsewhere). After a resume at start_step it
-- first drops what a run that died after its last checkpoint logged past it: those steps run again
-- (the file is replaced atomically). A fresh start never truncates an earlier run's records
-- (pick_checkpoint refuses that, or removed them on overwrite=true).
local function open_metrics(r, start_step)
  if not r.main then return SILENT end
  local mpath = r.run_dir .. "/metrics.jsonl"
  if start_step > 0 then
    local kept, f = {}, io.open(mpath, "r")
    if f then
      for line in f:lines() do
        local dok, rec = pcall(cjson.decode, line)
        if dok and type(rec) == "table" and type(rec.step) == "number" and rec.step <= start_step then
          kept[#kept + 1] = line .. "\n"
        end
      end
      f:close()
    end
    local wok, werr = util.atomic_write(mpath, table.concat(kept))
    if not wok then user_error("train: " .. mpath .. ": " .. werr, 0) end
  end
  return assert(io.open(mpath, start_step > 0 and "a" or "w"))
end

-- out/tb's events file (nvlua.tensorboard), opened on rank 0 when tensorboard=true (nil elsewhere): a
-- new file at each start. Resumed at start_step, the earlier files keep their events up to it, as
-- metrics.jsonl its records (the steps after it run again); a fresh run removes them. A fresh run
-- logs its config (config.json's text, as a markdown code block) at step 0.
local function open_tensorboard(r, start_step)
  if not (r.main and r.c.tensorboard) then return nil end
  local w = tensorboard.open(r.run_dir .. "/tb", {resume_step = start_step})
  if start_step == 0 then -- config.json as written (nvlua.record: Lua-built values as their descriptions)
    local f = assert(io.open(r.run_dir .. "/config.json", "r"))
    w:text("config", (f:read("a"):gsub("[^\n]+", "    %0")), 0)
    f:close()
  end
  return w
end

-- ckpt_every as the loop uses it: "auto" or an integer
local function ckpt_every(c)
  if c.ckpt_every == "auto" then return "auto" end
  return math.tointeger(tonumber(c.ckpt_every)) or 0
end

-- Everything before the first step: the resume, config.json and run.json, metrics.jsonl, the throughput
-- references, the header lines, deferred stop signals (Ctrl-C, SIGTERM, SIGUSR1). -> the run table r
local function start_run(c, p)
  local r = {c = c, p = p, dist = p.dist, world = p.world or 1, main = (p.rank or 0) == 0, -- rank 0 prints and writes
    model = p.model, opt = p.optimizer, rec = p.recipe, loader = p.loader, ds = p.dataset, run_dir = c.out}
  r.out = (c.quiet or not r.main) and SILENT or io.stdout
  r.tty = train.progress_bar() and not c.quiet
  -- the peak MFU is against, and what it is (nvlua.peak; c.mfu_peak), before anything is written (a
  -- peak it cannot give stops the run here). Only rank 0 measures one (it alone reports MFU): ranks
  -- measuring at once would load the machine they measure (nor does rank 0 cache a figure it took while
  -- ranks of its node wait in MPI, spinning); elsewhere r.peak may be nil.
  r.peak, r.peak_what = peak.for_run(c, {given = p.peak, recipe = r.rec, model = r.model, may_measure = r.main,
    alone = r.world == 1 or train.local_ranks() == 1})
  r.params = r.model:named_parameters()
  r.bad_in_row, r.skipped, r.interrupted = 0, 0, false
  r.max_batches, r.skipped_checkpoints = c.grad_accum, {}
  -- the device's non-finite flags (core.nonfinite_take) start clean: what earlier work in this
  -- process set (a test, an evaluation before the run) is not this run's first step's
  if r.params[1] then core.nonfinite_take(r.params[1].param) end
  r.start_step = resume(r) -- first: it refuses to start an existing run over (and may restore the counters)
  if c.init ~= "" and r.start_step == 0 then -- (train.build loaded them: no checkpoint to resume)
    r.out:write(string.format("init=%s: its weights; the step, AdamW moments, data order and LR schedule start " ..
      "fresh\n", c.init))
  end
  if r.main then -- config.json and run.json (nvlua.record)
    data.mkdir_p(c.out)
    record.start(r.run_dir, c, p, {start_step = r.start_step, resumed_from = r.resumed_from,
      made = function(v) return made[v] == true end,
      mfu_peak = r.peak and {flops_per_s = r.peak, what = r.peak_what} or nil})
  end
  r.mf = open_metrics(r, r.start_step)
  r.tb = open_tensorboard(r, r.start_step)
  -- background saves: their staging buffer made now, its pages faulted in by the writer thread while
  -- the first steps run, so that the first save pays no allocation
  if c.ckpt_background and r.main and ckpt_every(c) ~= 0 then
    ckpt.reserve({model = r.model, tokenizer = r.ds and r.ds.tokenizer})
  end

  local out, model, world = r.out, r.model, r.world
  r.tokens_per_step = c.batch * c.seq * c.grad_accum * world -- the global batch
  r.flops_tok = train.flops_per_token(model.config, c.seq)
  local gpu = c.device == "cuda"
  out:write(string.format("model: %s, %.2fM parameters; recipe %s\n", tostring(model:extra_repr()),
    model:num_parameters() / 1e6, tostring(r.rec)))
  out:write(string.format("%d tokens per step; MFU is against %s\n", r.tokens_per_step, r.peak_what))
  if gpu then
    local a = core.attention_cudnn()
    local v = a.version
    out:write(string.format("attention: %s%s; cuDNN %s\n", core.attention_route(),
      core.attention_cudnn_deterministic() and " (deterministic cuDNN backward)" or "", a.available and
      string.format("%d.%d.%d available", v // 10000, v // 100 % 100, v % 100) or "not used: " .. a.reason))
  end
  if r.dist and r.dist.initialized() then
    out:write(string.format("data parallel: %d rank%s (%s), %d x %d sequences per step\n", world, world > 1 and "s" or "",
      r.dist.backend(), world, c.batch * c.grad_accum))
    if c.sync == "shadow" and world > 1 then
      out:write(string.format("sync=shadow: parameters%s averaged every %d step%s, %s\n",
        c.shadow_moments and " and AdamW moments" or "", c.shadow_every, c.shadow_every > 1 and "s" or "",
        r.dist.bg_threaded() and "by an all-reduce in a thread of its own" or
        "by a nonblocking all-reduce (no MPI_THREAD_MULTIPLE: it advances inside MPI calls only)"))
    end
  end
  if r.opt.describe then out:write(r.opt:describe(), "\n") end

  r.signal_ok, r.signal = pcall(require, "nvlua.signal")
  if r.signal_ok then r.signal.defer(true) end
  r.losses, r.val_points, r.mor_points = {}, {}, {}
  r.t_run, r.tok_run = 0, 0
  r.step = r.start_step
  model:train()
  return r
end

-- One optimisation step: grad_accum micro-batches, the gradients averaged over the ranks (ZeRO-1:
-- reduce-scattered) and clipped, AdamW when the loss and the gradient norm are finite (else the
-- step is skipped and counted), the step's record in metrics.jsonl. Raises, after logging it, at
-- a step that makes more than max_bad_steps bad ones in a row. -> {lr, loss, gnorm, dt, mfu}
-- The step runs in an nv.scope (the per-step arena), each micro-batch in one of its own.
-- MoR (recipe.mor): the step's representation counts in its metrics record — mor_low, the share of
-- GEMM-operand elements in a low-precision format (not bf16); mor_units_low, that share of the
-- tensors (or blocks); mor_tensors_low, the share of operand tensors without a bf16 unit, and
-- mor_tensors_<kind> per kind (mor.summary); mor_<format>, each format's element share; mor_low_b<i>, the low share of
-- transformer block i (kept for the plot); mor_low_fprop / _dgrad / _wgrad, per GEMM role. -> the summary (nil for other recipes)
local function mor_record(r, step, line)
  local m = r.rec and r.rec.mor
  if not m then return nil end
  local sm = mor.summary(m:take_step())
  if not sm then return nil end
  line.mor_low, line.mor_units_low, line.mor_tensors_low = sm.low, sm.units_low, sm.tensors_low
  for k, v in pairs(sm.tensors) do line["mor_tensors_" .. k] = v end
  for f, v in pairs(sm.by_format) do line["mor_" .. f] = v end
  for b, v in pairs(sm.blocks) do line["mor_low_b" .. b] = v end
  for role, v in pairs(sm.roles) do line["mor_low_" .. role] = v end
  r.mor_points[#r.mor_points + 1] = {step, sm}
  return sm
end

-- ShadowSync (sync=shadow): the parameters averaged over the ranks off the step's critical path.
-- Each averaging completes the previous one (its all-reduce has run under the steps since) and
-- applies it as the change it brings, p += avg - snapshot, so the local steps taken meanwhile are
-- kept; then snapshots the parameters (and with shadow_moments the AdamW moments m and v, averaged
-- the same way) into a flat buffer and starts its all-reduce in the background (dist.all_reduce_bg:
-- a thread of its own under MPI_THREAD_MULTIPLE, which also computes the change avg - snapshot).
-- With shadow_overlap=false it waits at once and sets p = avg.
-- A second moment v plus its change could go below zero (v decays between the snapshot and the
-- apply while its average may be small): it is clamped at 0, which AdamW's sqrt needs.
-- shadow_average -> the seconds it waited for the all-reduce.
local function shadow_apply(s, exact)
  for _, e in ipairs(s.entries) do
    local a = s.avg:narrow(1, e.off + 1, e.n):view(e.param:size())
    if exact then e.param:copy_(a)
    else
      e.param:add_(a) -- a holds avg - snapshot
      if e.second_moment then e.param:copy_(e.param:maximum(0)) end
    end
  end
end

-- The pending averaging completed and applied (exact: p = avg, else p += avg - snapshot). -> the
-- seconds waited for its all-reduce
local function shadow_complete(dist, s, exact)
  local t0 = nv.clock()
  dist.bg_wait()
  local waited = nv.clock() - t0
  shadow_apply(s, exact)
  s.pending = false
  return waited
end

local function shadow_average(r)
  local dist, c = r.dist, r.c
  local s = r.shadow
  if not s then
    s = {entries = {}, n = 0}
    local function add(t, second_moment)
      s.entries[#s.entries + 1] = {param = t, off = s.n, n = t:numel(), second_moment = second_moment}
      s.n = s.n + t:numel()
    end
    for _, e in ipairs(r.model:named_parameters()) do
      add(e.param)
      if c.shadow_moments then -- AdamW's, made when it was built (shard_optimizer is refused)
        add(assert(r.opt.m[e.name], "shadow_moments: no AdamW moment for " .. e.name))
        add(r.opt.v[e.name], true)
      end
    end
    s.avg, s.snap = nv.unscope(nv.zeros(s.n)), nv.unscope(nv.zeros(s.n))
    r.shadow = s
  end
  local waited = 0
  nv.scope(function()
    if s.pending then waited = shadow_complete(dist, s, false) end
    for _, e in ipairs(s.entries) do s.snap:narrow(1, e.off + 1, e.n):copy_(e.param:reshape(e.n)) end
    dist.all_reduce_bg(s.avg, "avg", {src = s.snap, delta = c.shadow_overlap})
    s.pending = true
    if not c.shadow_overlap then waited = waited + shadow_complete(dist, s, true) end
  end)
  return waited
end

-- A step's metrics record as TensorBoard scalars: the throughput fields under perf/, MoR's under mor/
-- (mor_low: mor/low), the others under train/, and the run's count of skipped steps so far; what is
-- not a finite number (a skipped step's loss, written as text) is left out.
local PERF = {ms = true, tokens_per_s = true, mfu = true, sync_ms = true, sync_wait_ms = true, gather_bytes = true,
  qgather_bytes = true, qgather_bf16_bytes = true}
local function tb_scalars(rec, skipped)
  local v = {["train/skipped_steps"] = skipped}
  for k, x in pairs(rec) do
    if k ~= "step" and type(x) == "number" and finite(x) then
      local m = k:match("^mor_(.+)$")
      v[m and "mor/" .. m or PERF[k] and "perf/" .. k or "train/" .. k] = x
    end
  end
  return v
end

-- What a step's non-finite flags (core.nonfinite_take; 0: another rank's) say, for the log.
local function nonfinite_what(flags)
  local parts = {}
  if flags & 1 ~= 0 then parts[#parts + 1] = "a NaN or an infinity entered a quantizer (a weight or an activation)" end
  if flags & 2 ~= 0 then parts[#parts + 1] = "AdamW met a non-finite parameter" end
  if #parts == 0 then parts[1] = "another rank saw a non-finite value" end
  return table.concat(parts, "; ")
end

local function step_once(r, step)
  return nv.scope(function()
    local c, model, opt, world, dist = r.c, r.model, r.opt, r.world, r.dist
    model.step = step
    local lr = r.p.schedule(step)
    opt:set_lr(lr)
    local t0 = nv.clock()
    local losses, n_tok, parts = {}, 0, {kl = 0, ce = 0}
    -- bucketed all-reduce: during the last micro-batch's backward, each stage's gradients (the
    -- head, block L .. 1, the embedding) start reducing as soon as they are complete. CPU
    -- gradients only for now: on CUDA the buckets (NCCL on its own stream) and the backward's GEMMs
    -- touch disjoint ranges of one gradient allocation at once, which CUDA allows but the
    -- emulator, checking stream order per allocation, cannot tell from a race, so it is unverified
    local shadow = world > 1 and c.sync == "shadow"
    local buckets = world > 1 and not shadow and not opt.sharded and c.bucket_grads and model.grad_buffer:device() == "cpu" and
      model.grad_buckets and model:grad_buckets()
    nv.recipe.weight_cache(function() -- each weight quantized once for all the micro-batches
      for i = 1, c.grad_accum do
        -- the micro-batch's loss stays on the device (read below, after the step's work is queued)
        if buckets and i == c.grad_accum then
          model.grad_hook = function(stage)
            for _, v in ipairs(buckets[stage]) do dist.all_reduce_start(v, "avg") end
          end
        end
        local ok, d, cnt = pcall(nv.scope, function()
          local x, y = r.loader:next()
          return model:forward_backward(x, y, {z_loss = c.z_loss, scale = 1 / c.grad_accum, defer_loss = true,
            distill = r.p.teacher and {teacher = r.p.teacher, temperature = c.distill_temperature,
              alpha = c.distill_alpha} or nil})
        end)
        if r.p.teacher then -- the loss's parts, means over the micro-batches
          parts.kl, parts.ce = parts.kl + model.distill_parts.kl / c.grad_accum, parts.ce + model.distill_parts.ce / c.grad_accum
        end
        model.grad_hook = nil
        if not ok then error(d, 0) end
        losses[i], n_tok = d, n_tok + cnt
      end
    end)
    local gnorm, flags
    -- the seconds this step spends on synchronisation (data parallel), and of them waiting for the
    -- ranks' communication (sync=shadow: the rest is copying the snapshot and applying the average)
    local t_sync, t_wait = nv.clock(), 0
    if opt.sharded then -- ZeRO-1: reduce-scatter into this rank's shard, clip by the global norm
      local norm = opt:reduce_clip(c.clip)
      t_sync = nv.clock() - t_sync
      if type(norm) == "table" then -- shard=grads|full: the norm on the device, read with its flags in one copy
        gnorm, flags = norm:value(), norm:nonfinite() | (r.carry_flags or 0)
      else
        gnorm = norm
        flags = core.nonfinite_take(opt.flags_tensor or model.grad_buffer) | (r.carry_flags or 0) -- (a copy after the norm's: nothing queued)
      end
    else
      if buckets then dist.wait_all()
      elseif world > 1 and not shadow then dist.all_reduce(model.grad_buffer, "avg") end
      t_sync = nv.clock() - t_sync
      -- the norm and the clip factor on the grads' device (one launch); AdamW applies the factor.
      -- The norm is read back every step, with the device's non-finite flags in the same copy: a
      -- NaN or an infinity that a quantizer read (a weight or an activation: its codes cannot carry
      -- it) or AdamW met in a parameter, or a non-finite norm or loss, skips the step.
      local norm = opt:clip_grad_norm(c.clip)
      gnorm, flags = norm:value(), norm:nonfinite() | (r.carry_flags or 0)
    end
    local loss_sum = 0
    for _, d in ipairs(losses) do -- a model (or a wrapper of it) may also return the loss itself
      loss_sum = loss_sum + (type(d) == "number" and d or llama.loss_value(d))
    end
    local loss = loss_sum / c.grad_accum
    local flagged = flags ~= 0
    r.carry_flags = 0
    if world > 1 then
      -- the ranks' mean loss and, in the same collective, whether a stop signal came to any rank
      -- (interrupt_requested: every rank then stops after this step) and whether any rank's
      -- non-finite flags are set (every rank then skips this step). avg is the sum / world.
      -- A rank's own non-finite gradient norm counts too: under sync=shadow each rank's norm is
      -- its own gradients', and a step one rank skips must be skipped by all (the averaging is a
      -- collective); elsewhere the norms are equal already.
      local v = dist.all_reduce_numbers({loss, r.signal_ok and r.signal.pending() and 1 or 0, flagged and 1 or 0,
        finite(gnorm) and 0 or 1}, "sum")
      loss, r.stop_agreed = v[1] / world, v[2] > 0
      flagged = v[3] > 0 -- this rank's flags, or another's (nonfinite_what says which)
      if v[4] > 0 and finite(gnorm) then gnorm = 0 / 0 end -- another rank's norm was not finite
    end
    local rec_line, stop
    if finite(loss) and finite(gnorm) and not flagged then
      -- a background checkpoint copies the state while this step's forward and backward ran; the
      -- optimizer changes it, so the copy must be complete first (at once, in the usual case)
      if c.ckpt_background and c.ckpt_overlap then ckpt.snapshot_wait() end
      opt:step()
      if shadow and step % c.shadow_every == 0 then
        local t0 = nv.clock()
        t_wait = shadow_average(r)
        t_sync = t_sync + (nv.clock() - t0)
      end
      r.bad_in_row = 0
      rec_line = {step = step, loss = loss, lr = lr, grad_norm = gnorm}
      if r.p.teacher then rec_line.kl, rec_line.ce = parts.kl, parts.ce end
      r.losses[#r.losses + 1] = {step, loss}
      r.last_loss = loss
    else
      r.skipped, r.bad_in_row = r.skipped + 1, r.bad_in_row + 1
      rec_line = {step = step, skipped = true, loss = finite(loss) and loss or tostring(loss),
        grad_norm = finite(gnorm) and gnorm or tostring(gnorm)}
      local why = ""
      if flagged then
        rec_line.nonfinite = nonfinite_what(flags)
        why = "; " .. rec_line.nonfinite
      end
      r.out:write(string.format("step %d: skipped (loss %s, grad norm %s%s), %d in a row\n", step, tostring(loss),
        tostring(gnorm), why, r.bad_in_row))
      if r.bad_in_row > c.max_bad_steps then
        stop = string.format("training stopped at step %d: %d consecutive steps with a non-finite loss, gradient, " ..
          "weight or activation (max_bad_steps=%d); lower lr or check the data", step, r.bad_in_row, c.max_bad_steps)
      end
    end
    model:zero_grad()
    local dt = nv.clock() - t0
    r.t_run, r.tok_run = r.t_run + dt, r.tok_run + r.tokens_per_step
    rec_line.ms = dt * 1000
    rec_line.tokens_per_s = r.tokens_per_step / dt
    rec_line.mfu = r.peak and r.flops_tok * r.tokens_per_step / dt / (r.peak * world)
    if opt.sharded and opt.bytes and opt.mode == "full" then -- this rank's bytes sent in weight all-gathers, so far
      -- (qgather: the quantized linears' part; qgather_bf16: what gathering those in bf16 would send)
      rec_line.gather_bytes, rec_line.qgather_bytes = opt.bytes.gather, opt.bytes.qgather
      rec_line.qgather_bf16_bytes = opt.bytes.qgather_bf16
    end
    if world > 1 then -- not in a 1-rank record
      rec_line.sync_ms, rec_line.sync_wait_ms = t_sync * 1000, (shadow and t_wait or t_sync) * 1000
    end
    local ms = mor_record(r, step, rec_line)
    r.mf:write(config.encode(rec_line), "\n")
    if r.tb then r.tb:scalars(step, tb_scalars(rec_line, r.skipped)) end
    if stop then user_error(stop, 0) end -- after logging the step that made it
    return {lr = lr, loss = loss, gnorm = gnorm, dt = dt, mfu = rec_line.mfu, mor = ms,
      distill = r.p.teacher and parts or nil}
  end)
end

-- The console: a line every log_every steps (and at the first and last), else on a terminal a
-- progress bar with the time left.
local function report_step(r, step, s)
  local c, out = r.c, r.out
  if out == SILENT then return end -- another rank's, or quiet (the MFU of a rank but 0 may be unknown)
  if step % c.log_every == 0 or step == c.steps or step == r.start_step + 1 then
    if r.tty then out:write("\r\27[K") end
    out:write(string.format("step %5d/%d | loss %.4f | lr %.2e | gnorm %6.3f | %7.0f tok/s | %6.0f ms | mfu %4.1f%%%s\n",
      step, c.steps, s.loss, s.lr, s.gnorm, r.tokens_per_step / s.dt, s.dt * 1000, 100 * s.mfu,
      (s.mor and string.format(" | low-p %5.1f%%", 100 * s.mor.low) or "") ..
      (s.distill and string.format(" | kl %.4f ce %.4f", s.distill.kl, s.distill.ce) or "")))
  elseif r.tty then
    local frac = (step - r.start_step) / (c.steps - r.start_step)
    local eta = r.t_run / (step - r.start_step) * (c.steps - step)
    out:write(string.format("\r[%-30s] %d/%d eta %s", string.rep("=", math.floor(30 * frac)), step, c.steps,
      fmt_time(eta)))
  end
  out:flush()
end

-- Validation loss and perplexity at step, logged. Evaluating must not change training: under
-- delayed scaling its forwards push amaxes into the recipe's histories, so the recipe's state is
-- put back afterwards.
local function eval_and_log(r, step)
  local rec = r.rec
  local rs = rec and rec.state and rec:state()
  local vl, ppl = train.evaluate(r.model, r.ds, r.c, r.p)
  local tasks, full = train.score_tasks(r)
  r.last_tasks = full or r.last_tasks
  if rs then rec:load_state(rs) end
  if rec and rec.mor then rec.mor:take_step() end -- the evaluation's choices are not the training's
  r.val_points[#r.val_points + 1] = {step, vl}
  r.mf:write(config.encode({step = step, val_loss = vl, val_ppl = ppl, tasks = tasks}), "\n")
  local scalars = {["eval/val_loss"] = vl, ["eval/val_ppl"] = ppl}
  for _, name in ipairs(r.task_names or {}) do
    local t = tasks[name]
    r.task_points[name][#r.task_points[name] + 1] = {step, t.acc}
    for _, m in ipairs({"acc", "acc_norm", "bpb"}) do
      if t[m] then scalars["eval/" .. name .. "/" .. m] = t[m] end
    end
  end
  if r.tb then r.tb:scalars(step, scalars) end
  if r.tty then r.out:write("\r\27[K") end
  r.out:write(string.format("eval  %5d | val loss %.4f | val ppl %.2f\n", step, vl, ppl))
  if tasks then r.out:write(train.format_tasks(step, r.task_names, tasks), "\n") end
end

--- train.score_tasks(r) -> {[task] = nvlua.eval's metrics but the per-question list}, eval.evaluate's results,
-- for c.eval_tasks (nil when none): every rank
-- scores the same eval_limit questions of each task (a sharded model's forwards are collectives), in eval
-- mode under the run's recipe; the caller puts the recipe's state back.
function train.score_tasks(r)
  local c = r.c
  if c.eval_tasks == "" then return nil end
  if not r.task_names then
    r.task_names, r.task_points = require("nvlua.eval").split_names(c.eval_tasks), {}
    for _, name in ipairs(r.task_names) do r.task_points[name] = {} end
  end
  local res = require("nvlua.eval").evaluate(r.model, r.ds.tokenizer, r.task_names,
    {limit = c.eval_limit > 0 and c.eval_limit or nil, progress = false})
  local rec = {} -- metrics.jsonl's record: the metrics without the per-question list
  for name, t in pairs(res) do
    rec[name] = {}
    for k, v in pairs(t) do if k ~= "correct" then rec[name][k] = v end end
  end
  return rec, res
end

--- train.format_tasks(step, names, results) -> one console line: each task's accuracy and its
-- standard error (bits per byte for a task that has no accuracy)
function train.format_tasks(step, names, results)
  local parts = {string.format("tasks %5d", step)}
  for _, name in ipairs(names) do
    local t = results[name]
    local skipped = t.skipped and string.format(" (%d skipped)", t.skipped) or ""
    if t.bpb and (t.variant or ""):find("^bpb") or not t.acc and t.bpb then -- LAMBADA-style: bits per byte
      parts[#parts + 1] = string.format("%s bpb %.3f±%.3f%s", name, t.bpb, t.bpb_stderr or 0 / 0, skipped)
    elseif t.acc then
      parts[#parts + 1] = string.format("%s acc %.3f±%.3f%s", name, t.acc, t.acc_stderr or 0 / 0, skipped)
    end
  end
  return table.concat(parts, " | ")
end

-- A stop signal came (SIGINT, SIGTERM or SIGUSR1, deferred by start_run) to any rank: every rank
-- stops after this step. On several ranks the step's loss all-reduce carried the ranks' flags
-- (step_once), so they agree without a collective of its own; a signal that comes after it is seen
-- at the next step's.
local function interrupt_requested(r)
  if r.world > 1 then return r.stop_agreed == true end
  return r.signal_ok and r.signal.pending() and true or false
end

-- The end-of-run text sample (rank 0 alone: no collective may run in its forwards).
local function sample_text(r)
  local c, rec = r.c, r.rec
  local reducer = rec and rec.amax_reducer
  if reducer then rec:set_amax_reducer(nil) end
  local prompt, prompt_text = train.sample_prompt(r.ds.tokenizer, c.sample_prompt)
  local text = prompt and train.sample(r.model, r.ds.tokenizer, prompt, c.sample_tokens,
    {temperature = c.temperature, top_k = c.top_k, seed = c.seed})
  if reducer then rec:set_amax_reducer(reducer) end
  return text, prompt_text
end

-- tasks.png: each downstream task's accuracy at each evaluation. -> its path, or nil (none, or the reason printed)
local function plot_tasks(r)
  if not r.task_names or #r.task_names == 0 then return nil end
  local series = {}
  for _, name in ipairs(r.task_names) do
    local xs, ys = {}, {}
    for _, p in ipairs(r.task_points[name]) do
      if p[2] then xs[#xs + 1] = p[1]; ys[#ys + 1] = p[2] end
    end
    if #xs > 0 then series[#series + 1] = {title = name .. " acc", x = xs, y = ys} end
  end
  if #series == 0 then return nil end
  local png = r.run_dir .. "/tasks.png"
  local ok, err = plot.lines(png, series, {title = string.format("%s: downstream accuracy (eval_limit=%d)", r.c.out,
    r.c.eval_limit), xlabel = "step", ylabel = "accuracy"})
  if not ok then r.out:write("plot: " .. tostring(err) .. "\n") end
  return ok and png or nil
end

-- loss.png: the train and validation losses. -> its path, or nil (the reason printed)
local function plot_losses(r)
  local c = r.c
  local xs, ys, vx, vy = {}, {}, {}, {}
  for _, l in ipairs(r.losses) do xs[#xs + 1] = l[1]; ys[#ys + 1] = l[2] end
  for _, l in ipairs(r.val_points) do vx[#vx + 1] = l[1]; vy[#vy + 1] = l[2] end
  local png = r.run_dir .. "/loss.png"
  local pok, perr = plot.lines(png, {{title = "train loss", x = xs, y = ys}, {title = "val loss", x = vx, y = vy}},
    {title = string.format("%s — %s", c.out, tostring(c.recipe))})
  if not pok then r.out:write("plot: " .. tostring(perr) .. "\n") end
  return pok and png or nil
end

-- the run's mean low-precision share of elements (MoR), over its logged steps
-- -> elements, units and operand tensors in low precision, element shares per format, tensor shares per kind
local function mean_mor_low(r)
  local t, u, tl, f, tk = 0, 0, 0, {}, {}
  local n = #r.mor_points
  for _, p in ipairs(r.mor_points) do
    t, u, tl = t + p[2].low, u + p[2].units_low, tl + (p[2].tensors_low or 0)
    for k, v in pairs(p[2].by_format) do f[k] = (f[k] or 0) + v / n end
    for k, v in pairs(p[2].tensors) do tk[k] = (tk[k] or 0) + v / n end
  end
  return t / n, u / n, f, tl / n, tk
end

-- mor.png (MoR runs): the share of each transformer block's GEMM-operand elements in a low-precision
-- format, step by step. -> its path, or nil
local function plot_mor(r)
  if #r.mor_points == 0 then return nil end
  local keys, seen = {}, {}
  for _, p in ipairs(r.mor_points) do
    for b in pairs(p[2].blocks) do if not seen[b] then seen[b] = true; keys[#keys + 1] = b end end
  end
  table.sort(keys, function(a, b) return (tonumber(a) or math.huge) < (tonumber(b) or math.huge) end)
  local series = {}
  for _, b in ipairs(keys) do
    local s = {title = tonumber(b) and ("block " .. b) or b, x = {}, y = {}}
    for _, p in ipairs(r.mor_points) do
      local v = p[2].blocks[b]
      if v then s.x[#s.x + 1] = p[1]; s.y[#s.y + 1] = 100 * v end
    end
    series[#series + 1] = s
  end
  local png = r.run_dir .. "/mor.png"
  local ok, err = plot.lines(png, series, {title = string.format("%s — %s: low-precision share per block", r.c.out,
    tostring(r.c.recipe)), ylabel = "% of GEMM-operand elements not in bf16"})
  if not ok then r.out:write("plot: " .. tostring(err) .. "\n") end
  -- mor_kinds.png: each format's share of the elements and each kind's share of the operand tensors,
  -- step by step, on a log scale (the minor ones are a few percent or less)
  local kinds = {}
  for _, p in ipairs(r.mor_points) do
    for f in pairs(p[2].by_format) do kinds["elements: " .. f] = {"by_format", f} end
    for k in pairs(p[2].tensors) do
      kinds["tensors: " .. (mor.TENSOR_KINDS[k] or ("wholly " .. k))] = {"tensors", k}
    end
  end
  local ks = require("nvlua.util").sorted_keys(kinds)
  local ser = {}
  for _, name in ipairs(ks) do
    local s = {title = name, x = {}, y = {}}
    for _, p in ipairs(r.mor_points) do
      local v = p[2][kinds[name][1]][kinds[name][2]]
      if v and v > 0 then s.x[#s.x + 1] = p[1]; s.y[#s.y + 1] = 100 * v end
    end
    if #s.x > 0 then ser[#ser + 1] = s end
  end
  if ok and #ser > 0 then
    local ok2, err2 = plot.lines(r.run_dir .. "/mor_kinds.png", ser, {title = string.format(
      "%s — %s: representations (element shares; operand tensors by kind)", r.c.out, tostring(r.c.recipe)),
      ylabel = "% (log scale)", logy = true})
    if not ok2 then r.out:write("plot: " .. tostring(err2) .. "\n") end
  end
  return ok and png or nil
end

-- The run failed with err (at where): stop signals' default actions back, and err raised again; an
-- interrupted! (a second Ctrl-C, which interrupts the code wherever it is) is told as such.
local function failed(r, err, where)
  if r.signal_ok then r.signal.defer(false) end
  if not tostring(err):find("interrupted!", 1, true) then error(err, 0) end
  local lok, last = pcall(ckpt.latest, r.run_dir)
  error(string.format("interrupted! a second Ctrl-C stopped the run at once, %s: nothing of that step is saved; %s",
    where, lok and last and ("the newest complete checkpoint is " .. last .. " (resume=auto continues from it)") or
    "there is no complete checkpoint"), 0)
end

-- After the loop (ok, err: its pcall's results): metrics.jsonl and the events file closed, a
-- background save waited for, the final checkpoint, then (unless interrupted) the sample and the
-- plot. -> the summary
-- Stop signals stay deferred until the final checkpoint is written: one that comes during it (the
-- run complete) still stops the process (no sample or plot; interrupted, the exit status 75). A
-- second Ctrl-C (interrupted! raised wherever the code was, mid-step perhaps) stops at once and
-- writes nothing: the state is not that of a whole step.
local function finish_run(r, ok, err)
  local c = r.c
  r.mf:close()
  if r.tb then r.tb:close() end
  -- a background save still writing is waited for (its error raised, unless the run failed already);
  -- a parameter averaging still running (sync=shadow) is completed and applied
  local wok, werr = pcall(ckpt.wait)
  if wok then ckpt.release() end -- its staging buffer: the final save below is a blocking one
  if ok and wok and r.shadow and r.shadow.pending then
    wok, werr = pcall(shadow_complete, r.dist, r.shadow, false)
  end
  if not ok then failed(r, err, string.format("during step %d", r.step)) end
  if not wok then -- signals are not left deferred to a loop that no longer polls them
    if r.signal_ok then r.signal.defer(false) end
    error(werr, 0)
  end
  local summary = {steps = r.step, skipped = r.skipped, run_dir = r.run_dir, interrupted = r.interrupted,
    losses = r.losses, val = r.val_points, tokens_per_s = r.t_run > 0 and r.tok_run / r.t_run or 0,
    last_loss = r.last_loss, skipped_checkpoints = r.skipped_checkpoints}
  if c.save or r.interrupted then
    -- a checkpoint of this step already written (a periodic one before a Ctrl-C) or resumed from
    -- (a finished run resumed) holds this very state: it is not written again
    local last = r.last_ckpt
    local sok, path = pcall(function() return last and last.step == r.step and last.dir or save_checkpoint(r, r.step) end)
    if not sok then failed(r, path, string.format("while the checkpoint of step %d was written", r.step)) end
    summary.checkpoint = path
  end
  local sig = r.signal_ok and r.signal.pending()
  local late = not r.interrupted and sig and true or false -- came in the last step or after it
  if not r.interrupted and r.world > 1 then late = r.dist.all_reduce_number(late and 1 or 0, "max") > 0 end
  if r.signal_ok then r.signal.defer(false) end
  if r.interrupted or late then
    summary.interrupted = true
    if r.signal_ok then r.signal.set_exit_status(r.signal.EXIT_INTERRUPTED) end
    local what = sig or "a signal on another rank"
    if r.interrupted then
      r.out:write(string.format("\ninterrupted (%s) at step %d: checkpoint saved in %s (resume with resume=auto)\n",
        what, r.step, summary.checkpoint))
    else
      r.out:write(string.format("\nstopped (%s) after the last step, %d: the run is complete%s\n", what, r.step,
        summary.checkpoint and (", checkpoint " .. summary.checkpoint) or ""))
    end
    return summary
  end
  if #r.val_points > 0 then
    summary.final_val_loss = r.val_points[#r.val_points][2]
    summary.val_ppl = math.exp(summary.final_val_loss)
  end
  -- (under shard=full every rank samples: each forward gathers the weights, a collective)
  local every = r.opt.mode == "full" and r.world > 1
  if c.sample_tokens > 0 and r.ds.tokenizer and (r.main or every) then
    local text, prompt = sample_text(r)
    if r.main then summary.sample, summary.sample_prompt = text, prompt end
  end
  if r.task_points then
    summary.tasks = {}
    for _, name in ipairs(r.task_names) do summary.tasks[name] = r.last_tasks and r.last_tasks[name] end
  end
  if c.plot and r.main then summary.plot, summary.mor_plot, summary.tasks_plot = plot_losses(r), plot_mor(r), plot_tasks(r) end
  if #r.mor_points > 0 then
    summary.mor_low, summary.mor_units_low, summary.mor_formats, summary.mor_tensors_low, summary.mor_tensors = mean_mor_low(r)
  end
  return summary
end

--- train.auto_interval(cost_s, step_s, mtbf_h) -> steps, info: the checkpoint interval that minimizes
-- the expected time lost to saving and to failures (Young/Daly: every tau = sqrt(2 C M) seconds for a
-- blocking save of C seconds and M seconds between failures), in steps of step_s seconds (at least 1);
-- info = {tau_s, overhead (C / interval: the share of time spent saving), lost (interval / 2M: the
-- expected share lost to failures, work since the last save), waste = overhead + lost}.
function train.auto_interval(cost_s, step_s, mtbf_h)
  for _, v in ipairs({cost_s, step_s, mtbf_h}) do
    if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge then
      error("train.auto_interval: expects finite non-negative numbers (cost, step seconds, MTBF hours)", 2)
    end
  end
  local M = mtbf_h * 3600
  local tau = math.sqrt(2 * cost_s * M)
  local steps = math.max(1, math.floor(tau / math.max(step_s, 1e-9) + 0.5))
  local interval = steps * step_s
  local overhead = interval > 0 and cost_s / interval or 0
  local lost = M > 0 and interval / (2 * M) or 0
  return steps, {tau_s = tau, overhead = overhead, lost = lost, waste = overhead + lost}
end

-- ckpt_every=auto: the first save, after AUTO_FIRST steps and ckpt_first_s seconds of training (the
-- steps' time, in this process), measures its blocking cost; each save then sets the next from the
-- measured cost (the latest) and the mean step time so far. The floor keeps short runs (tests, small
-- experiments) to their final checkpoint; what it can cost a long run is the work of its first
-- ckpt_first_s seconds, once: 300 s / (2 x 24 h) = 0.17% of the expected loss to failures at most.
local AUTO_FIRST = 10

local function ckpt_due(r, step)
  local e = ckpt_every(r.c)
  if step >= r.c.steps then return false end
  if e == "auto" then
    r.ckpt_next = r.ckpt_next or (r.start_step + AUTO_FIRST)
    return step >= r.ckpt_next and r.t_run >= r.c.ckpt_first_s
  end
  return e > 0 and step % e == 0
end

local function save_due(r, step)
  local t0 = nv.clock()
  save_checkpoint(r, step, r.c.ckpt_background)
  if ckpt_every(r.c) ~= "auto" then return end
  local cost, step_s = nv.clock() - t0, r.t_run / math.max(1, step - r.start_step)
  local n, info = train.auto_interval(cost, step_s, r.c.mtbf)
  r.ckpt_next = step + n
  r.mf:write(config.encode({step = step, ckpt_cost_s = cost, ckpt_step_s = step_s, ckpt_every = n,
    ckpt_overhead = info.overhead, ckpt_lost = info.lost}), "\n")
  if not r.c.quiet and r.main then
    if r.tty then r.out:write("\r\27[K") end
    r.out:write(string.format("checkpoint %5d | save %.2f s, step %.3f s, MTBF %g h -> every %d steps (saving %.2f%%, " ..
      "expected loss to failures %.2f%%)\n", step, cost, step_s, r.c.mtbf, n, 100 * info.overhead, 100 * info.lost))
  end
end

--- train.run(c, parts) -> summary {final_val_loss, val_ppl, tokens_per_s, steps, skipped, run_dir,
-- plot, checkpoint, sample (the text after sample_prompt), sample_prompt, interrupted, losses = {...},
-- skipped_checkpoints = {{dir, reason, moved_to}, ...} (resume=auto passed over them as damaged)}
function train.run(c, p)
  local r = start_run(c, p)
  local ok, err = pcall(function()
    while r.step < c.steps do
      if c.ckpt_background then ckpt.poll() end -- a background save's error surfaces here
      r.step = r.step + 1
      local step = r.step
      local refusals = step == r.start_step + 1 and c.device == "cuda" and core.attention_cudnn().refusals
      report_step(r, step, step_once(r, step))
      if refusals then -- attention=auto fell back to nvlua's kernels where cuDNN had no engine: say so, once
        local a = core.attention_cudnn()
        if a.refusals > refusals then
          r.out:write("attention: cuDNN refused, nvlua's kernels ran instead: ", a.last_refusal, "\n")
        end
      end
      if c.eval_every > 0 and (step % c.eval_every == 0 or step == c.steps) then eval_and_log(r, step) end
      r.mf:flush()
      if ckpt_due(r, step) then save_due(r, step) end
      -- (after the last step a signal only skips the sample and the plot: finish_run)
      if step < c.steps and interrupt_requested(r) then
        r.interrupted = true
        break
      end
    end
  end)
  return finish_run(r, ok, err)
end

--- train.main(defaults, args) -> summary: parse, print and save the config, build, run, report.
-- defaults: the experiment's table: new defaults for train keys (plain values) and the keys it adds
-- (a plain default declares a key of that type; config.int/num/bool/str give a range too).
function train.main(defaults, args)
  local c = config.parse(train.schema, args, defaults)
  local main = true
  if c.dist then main = require("nvlua.dist").init({threads = dist_threads(c)}) == 0 end
  if not c.quiet and main then
    print("config:")
    config.print(c)
  end
  local parts = train.build(c)
  local s = train.run(c, parts)
  if not c.quiet and main and not s.interrupted then
    print(string.format("\ndone: %d steps (%d skipped), %.0f tokens/s", s.steps, s.skipped, s.tokens_per_s))
    if s.final_val_loss then print(string.format("final validation loss %.4f (perplexity %.2f)", s.final_val_loss, s.val_ppl)) end
    if s.tasks and next(s.tasks) then
      print(require("nvlua.eval").format_table(s.tasks))
    end
    if s.sample then print("sample: " .. (s.sample_prompt .. s.sample):gsub("\n", "\n        ")) end
    if s.plot then print("loss curve: " .. s.plot) end
    if s.mor_low then
      print(string.format("MoR: %.2f%% of GEMM-operand elements (%.2f%% of units) in low precision", 100 * s.mor_low,
        100 * s.mor_units_low))
      print("MoR: " .. mor.format_tensor_shares(s.mor_tensors_low, s.mor_tensors))
    end
    if s.mor_plot then print("MoR share per block: " .. s.mor_plot) end
    if s.tasks_plot then print("downstream accuracy: " .. s.tasks_plot) end
    if s.checkpoint then print("checkpoint: " .. s.checkpoint) end
    print("metrics: " .. s.run_dir .. "/metrics.jsonl")
  end
  return s, parts
end

return train
