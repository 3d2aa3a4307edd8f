-- tests/test_shard.lua: sharded data parallelism, shard=grads (ZeRO-2) and shard=full (ZeRO-3, FSDP)
-- (nvlua.shard, train.lua) on the CPU, ranks launched by Open MPI's mpirun (skipped without it):
--   * shard.shard_rows: contiguous row ranges, multiples of align except the last, every row once.
--   * bad input, before anything is built: unknown shard value, shard=grads|full without dist=true,
--     shard_optimizer=true with shard=full, sync=shadow with sharding, tie=true, a world larger than a
--     parameter's rows (shard.check_world), each naming the key.
--   * equivalence with plain data parallelism (tiny Llama: 2 layers, hidden 64, FFN 80, seq 16, 4
--     steps, clipping active): on 2 ranks, shard=grads, shard=full and shard=full with
--     reshard_after_forward=false give checkpoints (model.safetensors and trainer.safetensors: every
--     weight and AdamW moment) byte-identical to shard=none's, and the same losses, under bf16, fp8_cs
--     and nvfp4 (SR on). Why bit for bit: the reduce-scatter (avg) and the all-reduce (avg) sum two
--     values, which fp32 does the same in either order, then divide by 2; AdamW is elementwise; the
--     gathered weights are the f32 weights the forward reads. The gradient norm is summed by shard
--     instead of by parameter (fp64): it may differ in its last bits, which here does not reach the
--     f32 clip factor (the weights are equal).
--     On 3 ranks (every parameter uneven: 80 rows -> 32, 32, 16; 64 -> 32, 32, 0; norms 22, 22, 20),
--     nvfp4 with f32 activations: the sum of three values may be ordered differently by MPI's
--     reduce-scatter and all-reduce, so the bound is test_dist's for ZeRO-1 on 3 ranks (every loss and
--     weight within 1e-6: fp32 reordering of a three-term sum, 2 ulp relative per step, carried by Adam);
--     measured 0 here (Open MPI orders them alike).
--   * grad_accum=2 on 2 ranks: each micro-batch is reduce-scattered (a sum of averages, an fp32
--     reordering of plain data parallelism's average of sums): within 1e-6 (test_dist's nvfp4 bound).
--   * resume across world sizes and shard settings: 2 ranks shard=full, 2 steps -> resumed on 1 rank
--     unsharded (and, against it, 1 rank shard=full under dist=true: a world of one, bit for bit) for
--     step 3 -> resumed on 3 ranks shard=grads (against 3 ranks shard=none: bit for bit, or within the
--     3-rank bound) for step 4. A checkpoint holds whole tensors whatever the world: each resumed run
--     loads its rows.
--   * a SIGKILL of rank 0 while it writes a sharded checkpoint (NVLUA_FAULT=save.data:2: the second
--     save, step 4) ends the job; the checkpoint of step 2 is complete and loads.
--   * a background checkpoint (ckpt_background=true) under shard=full writes the same bytes.
--   * memory per rank (2 ranks, hidden 256, FFN 768, 2 blocks, seq 64, batch 2, bf16): live tensor
--     bytes after the build (weights, gradients, AdamW state) are 16P, 14P, 10P and 8P bytes for none,
--     optimizer, grads and full (P parameters; every shard here is exactly half); the step's peak over
--     it is shard=none's (activations) plus one block's f32 gradients (grads) and plus one block's
--     gathered f32 weights as well (full). (Printed for the plan's comparison.)
local T = require "nvlua.test"
local nv = require "nvlua"
local dist = require "nvlua.dist"
local lfs = require "lfs"
local st = require "nvlua.safetensors"
local ckpt = require "nvlua.checkpoint"
local train = require "nvlua.train"
local config = require "nvlua.config"
local shard = require "nvlua.shard"
local cjson = require "cjson"

local ROOT = T.tmpdir()

local NVLUA = arg and arg[-1] or "nvlua"
do
  local i = -1
  while arg and arg[i - 1] do i = i - 1 end
  NVLUA = arg and arg[i] or NVLUA
  if NVLUA:sub(1, 1) ~= "/" and NVLUA:find("/", 1, true) then NVLUA = lfs.currentdir() .. "/" .. NVLUA end
end

local MPIRUN = (function()
  local p = io.popen("command -v mpirun 2>/dev/null")
  local path = p and p:read("l")
  if p then p:close() end
  return path ~= "" and path or nil
end)()

local function need_mpi()
  if not MPIRUN then T.skip("mpirun not found") end
  if not dist.info().mpi then T.skip("nvlua built without MPI") end
end

local function sh(cmd)
  local p = assert(io.popen(cmd .. " 2>&1"))
  local out = p:read("a")
  local _, _, code = p:close()
  return out, code
end

local function mpirun(n, script, args, env)
  return sh(string.format("env OMP_NUM_THREADS=1 %s timeout 120 %s --allow-run-as-root --oversubscribe --bind-to none " ..
    "-np %d %s %s %s", env or "", MPIRUN, n, NVLUA, script, table.concat(args or {}, " ")))
end

-- a corpus of words, deterministic
local CORPUS = ROOT .. "/corpus.txt"
T.write_corpus(CORPUS, {seed = 3, lines = 2000, words = {"the", "of", "and", "to", "in", "is", "was", "he", "for", "it",
  "with", "as", "his", "on", "be", "at", "by", "had", "are", "but", "from", "or", "have", "an", "they", "which"}})

local MAIN = ROOT .. "/main.lua"
T.write_file(MAIN, 'require("nvlua.train").main({}, arg)\n')

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=64", "heads=4", "kv_heads=2", "ffn=80",
  "seq=16", "steps=4", "warmup=0", "schedule=constant", "lr=3e-3", "eval_every=0", "log_every=1", "sample_tokens=0",
  "plot=false", "quiet=true", "keep=0", "seed=7", "check_memory=false", "ckpt_every=2"}

local function args(name, extra)
  local a = {table.unpack(BASE)}
  a[#a + 1] = "out=" .. ROOT .. "/" .. name
  for _, x in ipairs(extra or {}) do a[#a + 1] = x end
  return a
end

local function run(n, name, extra, env)
  local out, code = mpirun(n, MAIN, args(name, extra), env)
  T.eq(code, 0, name .. ": mpirun exit status; output:\n" .. out)
  return ROOT .. "/" .. name
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function metrics(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.loss then out[r.step] = r end
  end
  return out
end

local function ckpt_of(dir, step) return string.format("%s/checkpoints/step-%06d", dir, step) end

-- the checkpoints of step in runs a and b hold the same bytes (model and trainer tensors)
local function same_ckpt(a, b, step, what)
  for _, f in ipairs({"model/model.safetensors", "trainer.safetensors"}) do
    T.ok(read(ckpt_of(a, step) .. "/" .. f) == read(ckpt_of(b, step) .. "/" .. f), what .. ": " .. f .. " byte for byte")
  end
end

-- largest |a - b| over every tensor of the two checkpoints' files
local function max_diff(a, b, step)
  local d = 0
  for _, f in ipairs({"model/model.safetensors", "trainer.safetensors"}) do
    local ta, tb = st.load(ckpt_of(a, step) .. "/" .. f), st.load(ckpt_of(b, step) .. "/" .. f)
    for k, t in pairs(ta) do d = math.max(d, (t - tb[k]):abs():max()) end
  end
  return d
end

-- ---- the rule --------------------------------------------------------------------------------------

T.case("shard_rows: contiguous ranges of chunk rows (a multiple of align), the last ranks' shorter", function()
  local r, chunk = shard.shard_rows(80, 3, 16)
  T.eq(chunk, 32)
  T.eq(r, {{row0 = 0, rows = 32}, {row0 = 32, rows = 32}, {row0 = 64, rows = 16}})
  r, chunk = shard.shard_rows(64, 3, 1)
  T.eq(chunk, 22)
  T.eq(r, {{row0 = 0, rows = 22}, {row0 = 22, rows = 22}, {row0 = 44, rows = 20}})
  r = shard.shard_rows(64, 3, 16)
  T.eq(r, {{row0 = 0, rows = 32}, {row0 = 32, rows = 32}, {row0 = 64, rows = 0}})
  for _, c in ipairs({{4096, 8, 16}, {128256, 8, 16}, {14336, 7, 16}, {1000, 3, 1}, {17, 17, 1}}) do
    local rs, ch = shard.shard_rows(c[1], c[2], c[3])
    local next_row = 0
    for i, x in ipairs(rs) do
      T.eq(x.row0, math.min(next_row, c[1]))
      if i < #rs and x.rows > 0 and rs[i + 1].rows > 0 then T.eq(x.rows % c[3], 0) end
      T.ok(x.rows <= ch)
      next_row = x.row0 + x.rows
    end
    T.eq(next_row, c[1], "every row once")
  end
  local none, msg = shard.shard_rows(2, 3, 1)
  T.eq(none, nil)
  T.ok(msg:find("3 ranks but 2 rows", 1, true))
end)

-- ---- bad input -------------------------------------------------------------------------------------

T.case("bad input: refused with the key named, before anything is built", function()
  local function refused(list, want)
    T.raises(function() train.check(config.parse(train.schema, list, {})) end, want)
  end
  refused({"shard=zero3"}, "shard")
  refused({"shard=full"}, "shard=full shards across data-parallel ranks; it needs dist=true")
  refused({"shard=grads"}, "shard=grads shards across data-parallel ranks; it needs dist=true")
  refused({"shard=full", "dist=true", "shard_optimizer=true"}, "shard_optimizer=true is shard=optimizer; it does not go with shard=full")
  refused({"shard=grads", "dist=true", "sync=shadow"}, "does not go with shard=grads")
  refused({"shard=full", "dist=true", "tie=true"}, "shard=full does not take tie=true")
  refused({"reshard_after_forward=maybe"}, "reshard_after_forward")
  -- a world larger than a parameter's rows (k_proj: 1 kv head x head dim 2)
  local mc = {vocab_size = 256, hidden_size = 4, intermediate_size = 8, num_attention_heads = 2, num_key_value_heads = 1,
    num_hidden_layers = 1}
  T.raises(function() shard.check_world(mc, 3, "full") end,
    "config: shard=full: 3 ranks, but the parameter self_attn.k_proj.weight has 2 rows")
  shard.check_world(mc, 2, "full") -- 2 ranks fit
  -- shard=optimizer without dist stays allowed (ZeRO-1 in a world of one, as shard_optimizer=true was)
  train.check(config.parse(train.schema, {"shard=optimizer"}, {}))
end)

-- ---- equivalence -----------------------------------------------------------------------------------

for _, recipe in ipairs({"bf16", "fp8_cs", "nvfp4"}) do
  T.case("2 ranks, " .. recipe .. ": shard=grads and shard=full (resharded or not) = plain data parallelism, bit for bit", function()
    need_mpi()
    local common = {"recipe=" .. recipe, "batch=2", "dist=true", "clip=0.5"}
    local function with(x) local a = {table.unpack(common)}; a[#a + 1] = x; return a end
    local none = run(2, recipe .. "/none", common)
    local grads = run(2, recipe .. "/grads", with("shard=grads"))
    local full = run(2, recipe .. "/full", with("shard=full"))
    local keep = run(2, recipe .. "/keep", {"recipe=" .. recipe, "batch=2", "dist=true", "clip=0.5", "shard=full",
      "reshard_after_forward=false"})
    local m0 = metrics(none)
    for _, x in ipairs({{grads, "grads"}, {full, "full"}, {keep, "full, reshard_after_forward=false"}}) do
      for _, step in ipairs({2, 4}) do same_ckpt(none, x[1], step, recipe .. " " .. x[2] .. " step " .. step) end
      local m = metrics(x[1])
      for step = 1, 4 do
        T.eq(m[step].loss, m0[step].loss, x[2] .. ": loss of step " .. step)
        T.near(m[step].grad_norm, m0[step].grad_norm, 1e-12 * m0[step].grad_norm, x[2] .. ": grad norm of step " .. step)
      end
      T.ok(m0[1].grad_norm > 0.5, "clipping is active")
    end
  end)
end

-- activation recompute inside sharded units: the recompute forward runs in the block's backward, where
-- shard=full has gathered the block's weights again; the bits stay plain data parallelism's
T.case("2 ranks, nvfp4: shard=full with recompute=block and shard=grads with recompute=selective = plain, bit for bit",
  function()
    need_mpi()
    local common = {"recipe=nvfp4", "batch=2", "dist=true", "clip=0.5"}
    local function with(...) local a = {table.unpack(common)}; for _, x in ipairs({...}) do a[#a + 1] = x end; return a end
    local none = run(2, "rc/none", common)
    local m0 = metrics(none)
    for _, x in ipairs({{"shard=full", "recompute=block"}, {"shard=grads", "recompute=selective"},
      {"shard=full", "recompute=selective", "reshard_after_forward=false"}}) do
      local what = table.concat(x, " ")
      local dir = run(2, "rc/" .. what:gsub("[ =]", "_"), with(table.unpack(x)))
      for _, step in ipairs({2, 4}) do same_ckpt(none, dir, step, what .. " step " .. step) end
      local m = metrics(dir)
      for step = 1, 4 do T.eq(m[step].loss, m0[step].loss, what .. ": loss of step " .. step) end
    end
  end)

T.case("3 ranks, nvfp4 (every parameter split unevenly): shard=grads and shard=full = plain, within the 3-rank bound", function()
  need_mpi()
  local common = {"recipe=nvfp4", "batch=2", "dist=true", "act_dtype=f32"}
  local function with(x) local a = {table.unpack(common)}; a[#a + 1] = x; return a end
  local none = run(3, "three/none", common)
  local m0 = metrics(none)
  for _, mode in ipairs({"grads", "full"}) do
    local dir = run(3, "three/" .. mode, with("shard=" .. mode))
    local m = metrics(dir)
    for step = 1, 4 do T.near(m[step].loss, m0[step].loss, 1e-6, mode .. ": loss of step " .. step) end
    local d = max_diff(none, dir, 4)
    T.ok(d <= 1e-6, string.format("%s: weights and moments within 1e-6 (%.3g)", mode, d))
    print(string.format("3 ranks shard=%s vs none: max difference %.3g", mode, d))
  end
end)

T.case("2 ranks, grad_accum=2: each micro-batch reduce-scattered = one all-reduce of the sums, within fp32 reordering", function()
  need_mpi()
  -- shard=grads|full sum the micro-batches' averages, (a1+b1)/2 + (a2+b2)/2, where plain data
  -- parallelism averages the sums, ((a1+a2) + (b1+b2))/2: an fp32 reordering each step (~1 ulp of a
  -- gradient), carried by Adam's normalised update; bound as test_dist's nvfp4 one (f32 activations)
  local common = {"recipe=nvfp4", "batch=1", "grad_accum=2", "dist=true", "act_dtype=f32"}
  local function with(x) local a = {table.unpack(common)}; a[#a + 1] = x; return a end
  local none = run(2, "accum/none", common)
  local m0 = metrics(none)
  for _, mode in ipairs({"grads", "full"}) do
    local dir = run(2, "accum/" .. mode, with("shard=" .. mode))
    local m = metrics(dir)
    for step = 1, 4 do T.near(m[step].loss, m0[step].loss, 1e-6, mode .. ": loss of step " .. step) end
    local d = max_diff(none, dir, 4)
    T.ok(d <= 1e-6, string.format("%s: weights and moments within 1e-6 (%.3g)", mode, d))
    print(string.format("grad_accum=2, shard=%s vs none: max difference %.3g", mode, d))
  end
end)

-- ---- resume across world sizes and shard settings ---------------------------------------------------

T.case("resume: 2 ranks full -> 1 rank unsharded (= 1 rank full) -> 3 ranks grads (= 3 ranks none)", function()
  need_mpi()
  local rec = {"recipe=nvfp4", "act_dtype=f32"}
  local function with(t) local a = {table.unpack(rec)}; for _, x in ipairs(t) do a[#a + 1] = x end; return a end
  local a = run(2, "resume/a", with({"batch=2", "dist=true", "shard=full", "steps=2"}))
  -- 1 rank: batch 4 keeps the global batch
  local b = run(1, "resume/b", with({"batch=4", "steps=3", "resume=" .. ckpt_of(a, 2)}))
  local b1 = run(1, "resume/b_full", with({"batch=4", "steps=3", "dist=true", "shard=full", "resume=" .. ckpt_of(a, 2)}))
  same_ckpt(b, b1, 3, "1 rank: shard=full (world of one) vs unsharded")
  -- 3 ranks from the 1-rank checkpoint
  local c = run(3, "resume/c", with({"batch=2", "steps=4", "dist=true", "shard=grads", "resume=" .. ckpt_of(b, 3)}))
  local c0 = run(3, "resume/c_none", with({"batch=2", "steps=4", "dist=true", "resume=" .. ckpt_of(b, 3)}))
  local d = max_diff(c0, c, 4)
  T.ok(d <= 1e-6, string.format("3 ranks grads vs none after resuming: within 1e-6 (%.3g)", d))
  -- the loaded state is the checkpoint's: the first resumed loss of the 3-rank runs agree
  T.eq(metrics(c)[4].loss, metrics(c0)[4].loss, "the loss of step 4 (the forward of the loaded weights)")
end)

-- ---- faults and background saves -------------------------------------------------------------------

T.case("a SIGKILL of rank 0 inside a sharded save leaves the previous checkpoint complete", function()
  need_mpi()
  local out, code = mpirun(2, MAIN, args("kill", {"recipe=bf16", "batch=2", "dist=true", "shard=full"}),
    "NVLUA_FAULT=save.data:2")
  T.ok(code ~= 0, "mpirun must exit non-zero; output:\n" .. out)
  local dir = ROOT .. "/kill"
  T.eq(ckpt.latest(dir), ckpt_of(dir, 2))
  T.eq(ckpt.verify(ckpt_of(dir, 2), {optimizer = true}), nil)
  -- and it is the same checkpoint a run that was not killed writes
  local ok = run(2, "kill_ref", {"recipe=bf16", "batch=2", "dist=true", "shard=full"})
  same_ckpt(dir, ok, 2, "the surviving checkpoint")
  -- resume=auto continues from it to the same end
  run(2, "kill", {"recipe=bf16", "batch=2", "dist=true", "shard=full", "resume=auto"})
  same_ckpt(dir, ok, 4, "resumed after the kill")
end)

T.case("background checkpoints under shard=full write the same bytes", function()
  need_mpi()
  local ref = run(2, "bg/ref", {"recipe=bf16", "batch=2", "dist=true", "shard=full"})
  local bg = run(2, "bg/bg", {"recipe=bf16", "batch=2", "dist=true", "shard=full", "ckpt_background=true"})
  local ov = run(2, "bg/overlap", {"recipe=bf16", "batch=2", "dist=true", "shard=full", "ckpt_background=true",
    "ckpt_overlap=true"})
  for _, step in ipairs({2, 4}) do
    same_ckpt(ref, bg, step, "background, step " .. step)
    same_ckpt(ref, ov, step, "background with overlap, step " .. step)
  end
end)

-- ---- memory per rank --------------------------------------------------------------------------------

local MEM = [=[
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local dist = require "nvlua.dist"
local c = config.parse(train.schema, arg, {})
local p = train.build(c)
local live = nv.memory().cpu
p.peak = 1e9 -- no GEMM-rate measurement (its 1024^2 operands are not the step's)
nv.reset_peak_memory()
c.steps = 2
train.run(c, p)
local peak = nv.memory().peak.cpu
-- the count: parameters P (f32), padded shards of chunk rows per parameter
local P, S = 0, 0
for _, e in ipairs(p.model:named_parameters()) do
  local shape = p.optimizer.by_name and p.optimizer.by_name[e.name].shape or e.param:size()
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  P = P + n
  if p.optimizer.by_name then S = S + p.optimizer.by_name[e.name].grad:numel() end
end
print(string.format("rank %d: live %d peak %d P %d S %d", dist.rank(), live, peak, P, S))
]=]

T.case("memory per rank (2 ranks, hidden 256, 2 blocks): state as counted, step peak lower when sharded", function()
  need_mpi()
  local script = ROOT .. "/mem.lua"
  T.write_file(script, MEM)
  local base = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=256", "heads=4", "kv_heads=2",
    "ffn=768", "seq=64", "batch=2", "recipe=bf16", "eval_every=0", "sample_tokens=0", "plot=false", "quiet=true",
    "save=false", "check_memory=false", "dist=true"}
  local res = {}
  for _, mode in ipairs({"none", "optimizer", "grads", "full"}) do
    local a = {table.unpack(base)}
    a[#a + 1] = "shard=" .. mode
    a[#a + 1] = "out=" .. ROOT .. "/mem_" .. mode
    local out, code = mpirun(2, script, a)
    T.eq(code, 0, mode .. ": " .. out)
    local live, peak, P, S = out:match("rank 0: live (%d+) peak (%d+) P (%d+) S (%d+)")
    res[mode] = {live = tonumber(live), peak = tonumber(peak), P = tonumber(P), S = tonumber(S)}
  end
  local P = res.none.P
  -- weights + grads + AdamW (f32): none 16P; optimizer 8P + 8P/2 (ZeRO-1's flat shard, 4 more bytes a
  -- shard element for its gradient shard, which it keeps besides the flat gradient buffer)
  T.eq(res.none.live, 16 * P, "none: 16 bytes a parameter")
  -- grads: whole weights (padded to 2·chunk rows per parameter: 2S) + gradient, m, v shards (S each)
  T.eq(res.grads.live, 4 * 2 * res.grads.S + 12 * res.grads.S, "grads: padded weights + 3 shards")
  T.eq(res.full.live, 16 * res.full.S, "full: 4 shards")
  for _, mode in ipairs({"none", "optimizer", "grads", "full"}) do
    local r = res[mode]
    print(string.format("%-9s P %d, live after build %.3f MiB, step peak %.3f MiB", mode, P, r.live / 2 ^ 20,
      r.peak / 2 ^ 20))
  end
  T.eq(res.optimizer.live, 14 * P, "optimizer: whole weights and gradient buffer, 3 shards (of P/2)")
  -- the step's peak over the state: shard=none's is the activations and scratch; grads adds one block's
  -- whole f32 gradients (reduce-scattered and freed before the next block's backward), full adds one
  -- block's gathered f32 weights too (4 bytes a parameter each). The embedding and head are smaller
  -- than a block here. Slack: 4 KiB for the allocator's small tensors.
  local block = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 768 * 256 + 2 * 256) -- bytes of one block's f32 tensors
  local act = res.none.peak - res.none.live
  T.near(res.grads.peak - res.grads.live, act + block, 4096, "grads: peak = state + activations + one block's gradients")
  T.near(res.full.peak - res.full.live, act + 2 * block, 4096,
    "full: peak = state + activations + one block's gathered weights and gradients")
  T.ok(res.full.peak < res.grads.peak and res.grads.peak < res.optimizer.peak and res.optimizer.peak < res.none.peak,
    "peaks: full < grads < optimizer < none")
end)

T.case("cleanup: the scratch directory is removed", function()
  ckpt.rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
