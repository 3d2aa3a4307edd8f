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
--   * a shard=full step (forward, backward, reduce_clip, step, zero_grad; the second of two) makes no
--     host synchronisation: the norm's sum of squares stays on the device (all-gathered per rank,
--     summed there) and is read afterwards, one copy with its non-finite flags, as the unsharded
--     trainer reads its norm.
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
local core = require("nvlua").core
core.cuda_set_sync(false)
local p = require("nvlua.train").main({}, arg)
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
local c = config.parse(train.schema, arg, {})
local p = train.build(c)
local model, opt = p.model, p.optimizer
core.cuda_set_sync(false)
local gen = nv.Generator(5)
local syncs, queries, read_syncs, norm
for step = 1, 2 do
  local x = (nv.rand(2, 16, {generator = gen}) * 63):to("i64")
  local y = (nv.rand(2, 16, {generator = gen}) * 63):to("i64")
  local c0 = core.cuda_emu_counters()
  local d = model:forward_backward(x, y, {defer_loss = true})
  local n = opt:reduce_clip(1.0)
  opt:step()
  model:zero_grad()
  local c1 = core.cuda_emu_counters()
  syncs, queries = c1.host_syncs - c0.host_syncs, c1.queries - c0.queries
  norm = n:value()
  read_syncs = core.cuda_emu_counters().host_syncs - c1.host_syncs
  llama.loss_value(d)
end
print(string.format("rank %d: host syncs %d, queries %d, reading the norm %d, norm %.6g, gathers left %d", p.rank, syncs,
  queries, read_syncs, norm, require("nvlua.dist").gathers_pending()))
]]

T.case("a shard=full step on 2 emulated GPUs makes no host synchronisation; the norm is read after", function()
  need_emu()
  local a = {table.unpack(BASE)}
  a[#a + 1] = "out=" .. ROOT .. "/syncs"
  a[#a + 1] = "recipe=nvfp4"
  a[#a + 1] = "shard=full"
  a[#a + 1] = "save=false"
  local out, code = mpirun2("step", STEP, a)
  T.eq(code, 0, "mpirun exit status; output:\n" .. out)
  for r = 0, 1 do
    local s, q, rd, norm, left = out:match("rank " .. r .. ": host syncs (%d+), queries (%d+), reading the norm (%d+), " ..
      "norm ([^,]+), gathers left (%d+)")
    T.ok(s ~= nil, "rank " .. r .. " finished; output:\n" .. out)
    print(string.format("rank %d: host syncs %s, stream queries %s in the step; reading the norm: %s host sync(s)", r, s,
      q, rd))
    T.eq(tonumber(s), 0, "rank " .. r .. ": host syncs in the step")
    T.eq(tonumber(rd), 1, "rank " .. r .. ": reading the norm (and its flags) is one copy")
    T.ok(tonumber(norm) > 0, "a norm")
    T.eq(tonumber(left), 0, "no gather left in flight")
  end
end)

T.case("cleanup: the scratch directory is removed", function()
  require("nvlua.checkpoint").rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
