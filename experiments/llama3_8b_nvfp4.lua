-- experiments/llama3_8b_nvfp4.lua: Llama 3 8B exactly (hidden 4096, 32 layers, 32 heads / 8 KV
-- heads, FFN 14336, vocab 128256, RoPE θ 500000, RMSNorm eps 1e-5, sequence 8192) under the
-- paper's NVFP4 recipe (2D weights, RHT on Wgrad inputs, SR on gradients, the first 2 and last 8
-- blocks in bf16), WSD schedule, AdamW β = (0.9, 0.95), weight decay 0.1.
--
--   nvlua experiments/llama3_8b_nvfp4.lua plan=true
--       parameters, FLOPs per token, memory per component per recipe, the GEMM precision plan;
--       nothing is allocated
--   nvlua experiments/llama3_8b_nvfp4.lua plan=true gpus=8 device=cuda [shard=full recompute=block] gpu_memory=80GB
--       the same per GPU of 8 (nvlua.plan): memory per component per recipe, the bytes each GPU sends
--       per step (all-gathers, reduce-scatters, all-reduces), whether each recipe fits gpu_memory and
--       the smallest shard x recompute that does (or the fewest GPUs)
--   mpirun -np 8 build/nvlua experiments/llama3_8b_nvfp4.lua dist=true device=cuda
--       trains on 8 GPUs with the first configuration that fits an 80 GB GPU (shard=auto, recompute=auto:
--       plan.fit, in the order plan.ORDER; said at start); shard=... recompute=... choose one yourself
--   nvlua experiments/llama3_8b_nvfp4.lua layers=1 seq=128 steps=2
--       trains one full-width 8B block on the CPU (about 21 GiB); prints the peak memory beside
--       the plan's prediction
--   data=shards:<dir> vocab=128256 trains on pre-tokenized shards (scripts/make_shards.lua)
-- Keys of this experiment: plan (implies dist=true: a data-parallel run is planned, nothing started),
-- gpus (the GPUs the plan is for; default the launcher's ranks, 1 without one; a run must have that
-- many; the plan refuses shard=grads|full on one), gpu_memory (what each GPU has: 80GB, 80GiB, 141GB, a number
-- of bytes; auto: this GPU's, with device=cuda), and shard / recompute as train's keys plus "auto".
-- Where this nvlua's train has no shard or recompute key (they came with issue 30), auto chooses among
-- what it has: shard none or optimizer (shard_optimizer=true), recompute none.
local nv = require "nvlua"
local train = require "nvlua.train"
local plan = require "nvlua.plan"
local config = require "nvlua.config"

local launcher_world, launcher_rank = plan.launcher()
-- what this train accepts: its own lists where it has the keys, else what shard_optimizer offers
local function train_values(key, fallback)
  local s = train.schema.specs[key]
  if not s then return fallback end
  local v = s.one_of
  if type(v) == "function" then v = v() end
  return v or fallback
end
local SHARDS = train_values("shard", {"none", "optimizer"})
local RECOMPUTES = train_values("recompute", {"none"})
local function with_auto(list)
  local l = {"auto"}
  for _, v in ipairs(list) do l[#l + 1] = v end
  return l
end
local function check_memory_text(v)
  if v == "auto" then return nil end
  local _, why = plan.parse_bytes(v)
  return why and ("must be " .. why .. " (or auto), got '" .. v .. "'") or nil
end

local defaults = {
  layers = 32, hidden = 4096, heads = 32, kv_heads = 8, ffn = 14336, vocab = 128256, rope_theta = 500000.0,
  norm_eps = 1e-5, seq = 8192, tie = false,
  recipe = "nvfp4", schedule = "wsd", decay = 0.2, lr = 3e-4, min_lr = 3e-5, warmup = 0, beta1 = 0.9, beta2 = 0.95,
  weight_decay = 0.1, clip = 1.0, batch = 1, steps = 2, eval_every = 0, sample_tokens = 0, plot = false, save = false,
  out = "runs/llama3_8b_nvfp4", log_every = 1,
  plan = config.bool(false, {doc = "print the plan and memory table without allocating"}),
  gpus = config.int(launcher_world, {min = 1, doc = "the GPUs (ranks) the plan is for; a run must have that many"}),
  gpu_memory = config.str("80GB", {check = check_memory_text,
    doc = "memory per GPU: 80GB, 80GiB, 141GB, bytes, or auto (this GPU's, device=cuda)"}),
  shard = config.str("auto", {one_of = with_auto(plan.SHARDS), doc = "auto: the first of plan.ORDER that fits gpu_memory"}),
  recompute = config.str("auto", {one_of = with_auto(plan.RECOMPUTES), doc = "auto: the first of plan.ORDER that fits"}),
}
-- plan=true plans a data-parallel run: dist=true is implied (nothing is started), so that train's checks of
-- sharding keys (shard=full needs dist=true) hold for what is planned
local args, planning, dist_given = {[0] = arg and arg[0]}, false, false -- [0]: the script, for --help
for i, a in ipairs(arg or {}) do
  args[i] = a
  planning = planning or a == "plan=true" or a == "plan=1"
  dist_given = dist_given or tostring(a):match("^dist=") ~= nil
end
if planning and not dist_given then args[#args + 1] = "dist=true" end
local c = config.parse(train.schema, args, defaults)
local user_error = require("nvlua.util").user_error
-- plan=true plans for GPUs (the CUDA backend's allocations) unless device= is given; a run plans for its device
local device_given = false
for _, a in ipairs(arg or {}) do device_given = device_given or tostring(a):match("^device=") ~= nil end
local device = (c.plan and not device_given) and "cuda" or c.device
-- a run takes what this train has; plan=true plans any of them
for key, list in pairs({shard = SHARDS, recompute = RECOMPUTES}) do
  local found = c[key] == "auto"
  for _, v in ipairs(list) do found = found or v == c[key] end
  if not c.plan and not found then
    user_error(string.format("config: %s=%s: this nvlua's training loop offers %s=%s only (plan=true plans it)", key, c[key],
      key, table.concat(list, "|")), 0)
  end
end
local main = launcher_rank == 0 -- rank 0 prints the plan (before the process group exists)
local function say(...) if main then print(...) end end

local mc = train.model_config(c, c.vocab)
mc.head_dim = mc.head_dim or c.hidden // c.heads
say(string.format("Llama 3 8B-shaped model: %d layers, hidden %d, %d/%d heads, FFN %d, vocab %d, seq %d, rope θ %g",
  c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq, c.rope_theta))

if not c.plan and c.gpus ~= launcher_world then
  user_error(string.format("config: gpus=%d, but this run has %d rank%s (mpirun -np / srun); gpus sizes the plan: " ..
    "leave it out (or give plan=true)", c.gpus, launcher_world, launcher_world == 1 and "" or "s"), 0)
end
-- the memory each GPU has
local have, have_label
if c.gpu_memory == "auto" then
  local bytes = c.device == "cuda" and train.machine_memory("cuda") or nil
  have, have_label = bytes or 80e9, bytes and "this GPU's memory" or "gpu_memory=auto (no GPU here: 80GB, an H100)"
else
  have, have_label = plan.parse_bytes(c.gpu_memory), "gpu_memory=" .. c.gpu_memory
end
-- shard and recompute: given, or the first configuration that fits (plan.fit)
local shard = c.shard
if shard == "auto" and c.shard_optimizer then shard = "optimizer" end
local recompute = c.recompute
local rec = train.recipe(c)
if shard ~= "auto" then plan.check_world(mc, c.gpus, shard) end
if c.plan and shard ~= "auto" and c.gpus == 1 and (shard == "grads" or shard == "full") then
  user_error(string.format("config: shard=%s with gpus=1: the plan shards grads and full over ranks and one GPU has " ..
    "nothing to share them with; give gpus >= 2 or shard=none|optimizer", shard), 0)
end
local popts = {gpus = c.gpus, device = device, grad_accum = c.grad_accum,
  reshard_after_forward = c.reshard_after_forward ~= false}
-- what auto may choose: a run, what this train offers; plan=true, everything the plan models
local offered = c.plan and {shard = plan.SHARDS, recompute = plan.RECOMPUTES} or {shard = SHARDS, recompute = RECOMPUTES}
if shard == "auto" or recompute == "auto" then
  local allowed = {shard = shard == "auto" and offered.shard or {shard},
    recompute = recompute == "auto" and offered.recompute or {recompute}}
  local fo = {gpus = c.gpus, gpu_memory = have, device = device, grad_accum = c.grad_accum,
    reshard_after_forward = popts.reshard_after_forward, allowed = allowed}
  local fit = plan.fit(mc, rec, c.batch, c.seq, fo)
  if fit then
    shard, recompute = fit.shard, fit.recompute
    local unit = device == "cuda" and "GPU" or "rank"
    say(string.format("plan: shard=%s recompute=%s fits %s (%.2f GiB) on each of %d %s%s: %.2f GiB per %s by the plan " ..
      "(the first that fits of %s)", shard, recompute, have_label, have / 2 ^ 30, c.gpus, unit, c.gpus == 1 and "" or "s",
      fit.total / 2 ^ 30, unit, plan.order_text()))
  else
    local g, gf = plan.fewest_gpus(mc, rec, c.batch, c.seq, fo)
    local msg = string.format("nothing (shard %s, recompute %s) fits %s (%.2f GiB) on each of %d " ..
      "GPU%s with batch=%d x seq=%d under recipe %s; %s", table.concat(allowed.shard, "|"),
      table.concat(allowed.recompute, "|"), have_label, have / 2 ^ 30, c.gpus, c.gpus == 1 and "" or "s", c.batch, c.seq,
      tostring(c.recipe), g and string.format("the fewest GPUs that fit: %d, with shard=%s recompute=%s (%.2f GiB)", g,
        gf.shard, gf.recompute, gf.total / 2 ^ 30) or "nothing fits on up to 4096 GPUs")
    if not c.plan then user_error("config: gpus=" .. c.gpus .. ": " .. msg, 0) end
    say("plan: " .. msg)
    shard = shard == "auto" and "none" or shard
    recompute = recompute == "auto" and "none" or recompute
  end
end
popts.shard, popts.recompute = shard, recompute
-- what this train takes: its shard / recompute keys, or shard_optimizer
if train.schema.specs.shard then c.shard = shard else c.shard = nil; c.shard_optimizer = shard == "optimizer" end
if train.schema.specs.recompute then c.recompute = recompute else c.recompute = nil end

local out = main and io.stdout or {write = function() end}
local rows = plan.report(mc, {"bf16", "fp8_cs", "mxfp8", "nvfp4", "mxfp4"}, c.batch, c.seq, out,
  {gpus = c.gpus, shard = shard, recompute = recompute, device = device, grad_accum = c.grad_accum,
    reshard_after_forward = popts.reshard_after_forward, gpu_memory = have, memory_label = have_label,
    allowed = offered})
if #SHARDS < #plan.SHARDS or #RECOMPUTES < #plan.RECOMPUTES then
  say(string.format("(this nvlua's training loop offers shard=%s and recompute=%s only)", table.concat(SHARDS, "|"),
    table.concat(RECOMPUTES, "|")))
end
if c.plan then
  say("")
  if main then rec:plan({linears = function() return plan.linears(mc) end}) end
  return
end

say("")
say("config:")
if main then config.print(c) end
local predicted = rows[c.recipe] and rows[c.recipe].total or plan.memory(mc, rec, c.batch, c.seq, popts).total
if device == "cuda" then predicted = predicted - plan.CUDA_OUTSIDE end -- the allowance is not in the tensor count
local parts = train.build(c)
local s = train.run(c, parts)
local measured = c.device == "cuda" and nv.memory().peak.cuda or nv.memory().peak.cpu
if parts.rank == 0 then
  print(string.format("\npeak tensor memory %.2f GiB (process peak RSS %.2f GiB); the plan predicted %.2f GiB (%+.1f%%)",
    measured / 2 ^ 30, nv.core.peak_rss() / 2 ^ 30, predicted / 2 ^ 30, 100 * (predicted - measured) / measured))
  print(string.format("%d steps, %.1f tokens/s, last loss %.4f", s.steps, s.tokens_per_s, s.last_loss or 0 / 0))
end
