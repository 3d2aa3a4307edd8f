-- tests/test_cuda_shard.lua: sharded data parallelism (nvlua.shard: shard=grads, ZeRO-2; shard=full,
-- ZeRO-3 / FSDP) on CUDA tensors, 2 ranks on 2 GPUs: the gradients' reduce-scatters, the weights'
-- all-gathers (the prefetch's on NCCL's stream, ordered by events) and the gradient norm on the
-- device. Under the CPU emulation of CUDA (-DNVLUA_CUDA=EMU: scripts/test.sh --emu cuda_shard) the
-- emulated NCCL serves the collectives, the emulator fails any stream-order race and counts the host
-- synchronisations; elsewhere the cases skip ("needs the CUDA emulator").
--   * 2 ranks, nvfp4 (SR on) and bf16, 2 blocks, clipping active: shard=grads, shard=full and
--     shard=full with reshard_after_forward=false write checkpoints (model.safetensors and
--     trainer.safetensors) byte-identical to shard=none's (plain data parallelism with bucketed
--     all-reduces), with the same losses: the reduce-scatter (avg) and the all-reduce (avg) of two
--     values are the same sum in either order; AdamW is elementwise; the gathered weights are the f32
--     weights the forward reads; the gradient norm is summed by shard (fp64) instead of by bucket and
--     tensor, which can move its last bits only (the grad norms are compared to 1e-12).
--   * a shard=grads and a shard=full step (forward, backward, reduce_clip, step, zero_grad; the second
--     of two) make no host synchronisation of their own, nor stream polls (queries): the gathers
--     (prefetched or not) and reduce-scatters are started on NCCL's stream and waited for by events, the norm's sum of squares stays on
--     the device (each rank's norm state all-gathered, summed there) and is read afterwards, one
--     copy with its non-finite flags, as the unsharded trainer reads its norm. bf16: 0; nvfp4: as
--     many as shard=none's step, each one of data parallelism's host all-reduces of an activation's
--     global amax (train.lua's dist_hooks, not sharding's).
local T = require "nvlua.test"
local nv = require "nvlua"
local lfs = require "lfs"

local need_emu = T.need_emu

local ROOT = T.tmpdir()

local function exe()
  local i = -1
  while arg and arg[i - 1] do i = i - 1 end
  local x = arg and arg[i] or "nvlua"
  if x:sub(1, 1) ~= "/" and x:find("/", 1, true) then x = lfs.currentdir() .. "/" .. x end
  return x
end

-- script_text run on 2 ranks, 2 emulated GPUs (a CUDA-aware MPI: each rank its own) -> output, exit code
local function mpirun2(name, script_text, args)
  local p = io.popen("command -v mpirun 2>/dev/null")
  local mpirun = p and p:read("l")
  if p then p:close() end
  if not mpirun or mpirun == "" then T.skip("mpirun not found") end
  if not nv.dist.info().mpi then T.skip("nvlua built without MPI") end
  local script = ROOT .. "/" .. name .. ".lua"
  T.write_file(script, script_text)
  local f = assert(io.popen(string.format("env NVLUA_EMU_GPUS=2 NVLUA_EMU_CUDA_AWARE_MPI=1 OMP_NUM_THREADS=1 "
    .. "timeout 300 %s --allow-run-as-root --oversubscribe --bind-to none -np 2 %s %s %s 2>&1", mpirun, exe(), script,
    table.concat(args or {}, " "))))
  local out = f:read("a")
  local _, _, code = f:close()
  return out, code
end

local CORPUS = ROOT .. "/corpus.txt"
T.write_corpus(CORPUS, {seed = 7, lines = 400,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in"}})

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=32", "heads=4", "kv_heads=2",
  "ffn=64", "seq=16", "batch=2", "steps=4", "warmup=0", "schedule=constant", "lr=3e-3", "eval_every=0",
  "log_every=1", "sample_tokens=0", "plot=false", "quiet=true", "keep=0", "seed=7", "check_memory=false",
  "ckpt_every=2", "dist=true", "device=cuda", "clip=0.5"}

local TRAIN = [[
local train = require "nvlua.train"
local config = require "nvlua.config"
local c = config.parse(train.schema, arg, {})
local p = train.build(c)
p.peak = 1e9 -- no GEMM-rate measurement (its large operands, emulated)
require("nvlua").core.cuda_set_sync(false)
train.run(c, p)
]]

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function metrics(dir)
  local cjson = require "cjson"
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.loss then out[r.step] = r end
  end
  return out
end

local function run(name, extra)
  local a = {table.unpack(BASE)}
  a[#a + 1] = "out=" .. ROOT .. "/" .. name
  for _, x in ipairs(extra) do a[#a + 1] = x end
  local out, code = mpirun2("train", TRAIN, a)
  T.eq(code, 0, name .. ": mpirun exit status; output:\n" .. out)
  return ROOT .. "/" .. name
end

for _, recipe in ipairs({"nvfp4", "bf16"}) do
  T.case("2 emulated GPUs, " .. recipe .. ": shard=grads and shard=full train as plain data parallelism, bit for bit", function()
    need_emu()
    local none = run(recipe .. "_none", {"recipe=" .. recipe})
    local m0 = metrics(none)
    for _, x in ipairs({{"grads", {"shard=grads"}}, {"full", {"shard=full"}},
        {"full, reshard_after_forward=false", {"shard=full", "reshard_after_forward=false"}}}) do
      local a = {"recipe=" .. recipe}
      for _, y in ipairs(x[2]) do a[#a + 1] = y end
      local dir = run(recipe .. "_" .. x[1]:gsub("[^%w]", "_"), a)
      for _, step in ipairs({2, 4}) do
        for _, f in ipairs({"model/model.safetensors", "trainer.safetensors"}) do
          local ck = string.format("/checkpoints/step-%06d/", step)
          T.ok(read(none .. ck .. f) == read(dir .. ck .. f), string.format("%s %s, step %d: %s byte for byte",
            recipe, x[1], step, f))
        end
      end
      local m = metrics(dir)
      for step = 1, 4 do
        T.eq(m[step].loss, m0[step].loss, x[1] .. ": loss of step " .. step)
        T.near(m[step].grad_norm, m0[step].grad_norm, 1e-12 * m0[step].grad_norm, x[1] .. ": grad norm of step " .. step)
      end
      T.ok(m0[1].grad_norm > 0.5, "clipping is active")
    end
  end)
end

local STEP = [[
local nv = require "nvlua"
local core = nv.core
local train = require "nvlua.train"
local config = require "nvlua.config"
local llama = require "nvlua.llama"
local dist = require "nvlua.dist"
local c = config.parse(train.schema, arg, {})
local p = train.build(c)
local model, opt, rec = p.model, p.optimizer, p.recipe
-- the data-parallel global amax of the activations (a per-tensor format's: recipe:set_amax_reducer,
-- dist.all_reduce_number: a host value), counted
local amaxes = 0
if rec.amax_reducer then
  local f = rec.amax_reducer
  rec.amax_reducer = function(...) amaxes = amaxes + 1; return f(...) end
end
core.cuda_set_sync(false)
local gen = nv.Generator(5)
local syncs, queries, read_syncs, norm, n_amax
for step = 1, 2 do
  local x = (nv.rand(2, 16, {generator = gen}) * 63):to("i64")
  local y = (nv.rand(2, 16, {generator = gen}) * 63):to("i64")
  amaxes = 0
  local c0 = core.cuda_emu_counters()
  local d = model:forward_backward(x, y, {defer_loss = true})
  local n
  if opt.reduce_clip then
    n = opt:reduce_clip(1.0)
  else -- plain data parallelism (train.lua with one bucket: the whole buffer)
    dist.all_reduce_start(model.grad_buffer, "avg")
    dist.wait_all()
    n = opt:clip_grad_norm(1.0)
  end
  opt:step()
  model:zero_grad()
  local c1 = core.cuda_emu_counters()
  syncs, queries, n_amax = c1.host_syncs - c0.host_syncs, c1.queries - c0.queries, amaxes
  norm = n:value()
  read_syncs = core.cuda_emu_counters().host_syncs - c1.host_syncs
  llama.loss_value(d)
end
print(string.format("rank %d: host syncs %d, queries %d, amax reductions %d, reading the norm %d, norm %.17g, " ..
  "gathers left %d", p.rank, syncs, queries, n_amax, read_syncs, norm, dist.gathers_pending()))
]]

T.case("a sharded step on 2 emulated GPUs makes no host synchronisation of its own; the norm is read after", function()
  need_emu()
  -- bf16: none at all. nvfp4: data parallelism's global amax of each quantized activation is a host
  -- all-reduce (train.lua dist_hooks), one host synchronisation each, in shard=none's step as well:
  -- the sharded step makes exactly those.
  for _, recipe in ipairs({"bf16", "nvfp4"}) do
    local res = {}
    for _, shard in ipairs({"none", "grads", "full"}) do
      local a = {table.unpack(BASE)}
      for _, x in ipairs({"out=" .. ROOT .. "/syncs", "overwrite=true", "recipe=" .. recipe, "shard=" .. shard,
        "save=false"}) do a[#a + 1] = x end
      local out, code = mpirun2("step", STEP, a)
      T.eq(code, 0, "mpirun exit status; output:\n" .. out)
      for r = 0, 1 do
        local s, q, am, rd, norm, left = out:match("rank " .. r .. ": host syncs (%d+), queries (%d+), " ..
          "amax reductions (%d+), reading the norm (%d+), norm ([^,]+), gathers left (%d+)")
        T.ok(s ~= nil, "rank " .. r .. " finished; output:\n" .. out)
        local what = string.format("%s, shard=%s, rank %d", recipe, shard, r)
        T.eq(tonumber(s), tonumber(am), what .. ": host syncs in the step = the activations' amax all-reduces")
        if recipe == "bf16" then T.eq(tonumber(s), 0, what .. ": no host sync") end
        T.eq(tonumber(rd), 1, what .. ": reading the norm (and its flags) is one copy")
        T.eq(tonumber(left), 0, what .. ": no gather left in flight")
        res[shard] = res[shard] or {syncs = tonumber(s), queries = tonumber(q), norm = tonumber(norm)}
      end
    end
    for _, shard in ipairs({"grads", "full"}) do
      T.eq(res[shard].syncs, res.none.syncs, recipe .. ", shard=" .. shard .. ": the same host syncs as plain data parallelism")
      -- (a blocking NCCL collective polls its stream from the host, cudaStreamQuery: the sharded
      -- step's gathers and reduce-scatters are started and waited for by events instead)
      T.eq(res[shard].queries, res.none.queries, recipe .. ", shard=" .. shard .. ": the same stream queries (host polls)")
      T.near(res[shard].norm, res.none.norm, 1e-12 * res.none.norm, recipe .. ", shard=" .. shard .. ": the norm")
    end
    print(string.format("%s: host syncs per step %d, stream queries %d (none, grads and full alike)", recipe,
      res.none.syncs, res.none.queries))
  end
end)

T.case("cleanup: the scratch directory is removed", function()
  require("nvlua.checkpoint").rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
