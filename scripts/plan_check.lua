-- scripts/plan_check.lua: the memory plan of one rank (nvlua.plan.memory) against the measured peak of
-- a real training step on that rank (nv.memory's tensor peak, the CPU's or the GPU's), for any world
-- size, shard and recompute setting the training loop offers.
--   build/nvlua scripts/plan_check.lua data=<text file> hidden=512 ffn=1792 vocab=8192 layers=2 seq=512 batch=2
--   mpirun --oversubscribe -np 4 build/nvlua scripts/plan_check.lua dist=true shard_optimizer=true data=... ...
-- Arguments are train's keys (train.schema; a one-step run: steps=1, nothing saved, evaluated, sampled
-- or plotted unless given; out defaults to /tmp/nvlua_plan_check, overwritten) plus plan_gather (f32 | quantized: what a shard=full run gathers; nvlua.shard
-- gathers f32 until the quantized all-gather is wired), plan_prefetch (false: a unit's gather waits for
-- the one before it to be done, as nvlua.shard's blocking gathers; true: the next unit's gather runs
-- beside this one) and plan_overlap_reduce (false: a unit's reduce-scatter ends before the next unit's
-- backward, as nvlua.shard's blocking one). Issue 30 asks for both overlaps, which the plan assumes by
-- default. Each rank
-- prints one line "RESULT <rank> <measured bytes> <planned bytes> <phase>"; rank 0 then a summary
-- line. The measured peak includes the data set's tokens and the batch (small beside the model).
-- Not a test by itself: tests/test_plan.lua runs it under mpirun and holds the lines to 5%.
local nv = require "nvlua"
local train = require "nvlua.train"
local plan = require "nvlua.plan"
local config = require "nvlua.config"

local c = config.parse(train.schema, arg, {steps = 1, save = false, eval_every = 0, sample_tokens = 0, plot = false,
  quiet = true, warmup = 0, out = "/tmp/nvlua_plan_check", overwrite = true,
  plan_gather = config.str("f32", {one_of = {"f32", "quantized"}}), plan_prefetch = config.bool(false), plan_overlap_reduce = config.bool(false)})
collectgarbage()
collectgarbage()
local dev = c.device
local function live() return nv.memory()[dev] end
local base = live()
local parts = train.build(c)
local mc = train.model_config(c, parts.model.config.vocab_size)
mc.head_dim = mc.head_dim or c.hidden // c.heads
nv.reset_peak_memory()
train.run(c, parts)
local measured = nv.memory().peak[dev] - base
local shard = c.shard or "none"
if shard == "none" and c.shard_optimizer then shard = "optimizer" end
local m = plan.memory(mc, parts.recipe, c.batch, c.seq, {gpus = parts.world, shard = shard, recompute = c.recompute or "none",
  device = dev, grad_accum = c.grad_accum, reshard_after_forward = c.reshard_after_forward ~= false,
  gather = c.plan_gather, prefetch = c.plan_prefetch, overlap_reduce = c.plan_overlap_reduce})
local planned = m.total - (dev == "cuda" and plan.CUDA_OUTSIDE or 0) -- the allowance is outside the tensor count
print(string.format("RESULT %d %d %d %s", parts.rank, measured, math.floor(planned + 0.5), m.phase))
io.stdout:flush()
if parts.dist and parts.world > 1 then parts.dist.barrier() end
if parts.rank == 0 then
  print(string.format("plan_check: %d rank%s, shard=%s recompute=%s, batch %d x seq %d: rank 0 measured %.2f MiB, planned " ..
    "%.2f MiB (%+.1f%%, peak at %s)", parts.world, parts.world == 1 and "" or "s", shard, c.recompute or "none", c.batch,
    c.seq, measured / 2 ^ 20, planned / 2 ^ 20, 100 * (planned - measured) / measured, m.phase))
end
