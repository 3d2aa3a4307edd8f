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
--   * the quantized gather (gather=quantized, the default under shard=full: the equivalence cases above
--     run it): on 2 and 3 ranks, nvfp4 and fp8_cs, checkpoints byte-identical to gather=f32's; the
--     bytes a rank sends in the quantized linears' all-gathers (metrics qgather_bytes) against a bf16
--     gather of the same shards computed from the shapes: nvfp4 <= 0.3x, fp8 <= 0.5x; and the f32
--     run's extra bytes are exactly those linears' f32 bytes less the quantized ones.
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
--     optimizer, grads and full (P parameters; every shard here is exactly half); under full (built in
--     rows) the build's peak is that too, never a whole parameter more; the step's peak over
--     it is shard=none's (activations) plus one block's f32 gradients (grads) and plus one block's
--     gathered f32 weights as well (full), less the weight copies of all blocks but one (the cache
--     drops a gathered weight's copies with it). (Printed for the plan's comparison.)
--   * building in rows (shard.build): core.randn_'s `first` draws a part of a whole draw, bit for bit;
--     each rank's parameter rows equal the whole build's (2 and 3 ranks).
--   * shard=full, nvfp4 and fp8_cs: at most one block's quantized weight copies exist (handles
--     counted), and the step's peak is lower, by at least L - 1 blocks' copies, than when the weight
--     cache keeps them to the step's end (as before recipe.weight_cache_drop).
--   * dist.all_gather_start (MPI_Iallgather) on 2 and 3 ranks: out of place, in place, several in
--     flight waited in another order: the blocking all_gather's bytes; reduce_scatter_start
--     (MPI_Ireduce_scatter_block; avg divided at the wait) = the blocking reduce_scatter; bad input named.
--   * prefetch under shard=full (2 ranks, one step): the exact order of gathers and compute (each
--     unit starts the next one's gather before it computes: forward the next, backward the one
--     before), at most two units gathered at once, and the weights after the step byte-identical to
--     prefetch off.
local T = require "nvlua.test"
local nv = require "nvlua"
local dist = require "nvlua.dist"
local lfs = require "lfs"
local st = require "nvlua.safetensors"
local ckpt = require "nvlua.checkpoint"
local train = require "nvlua.train"
local config = require "nvlua.config"
local shard = require "nvlua.shard"
local nn = require "nvlua.nn"
local llama = require "nvlua.llama"
local core = require "nvlua.core"
local cjson = require "cjson"

local ROOT = T.tmpdir()

local NVLUA = T.nvlua() -- the binary running this file, absolute

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

-- ---- building in rows ------------------------------------------------------------------------------

T.case("core.randn_/rand_ with first: the elements first.. of the whole draw, at any (odd) start", function()
  for _, fn in ipairs({"randn_", "rand_"}) do
    local g = nv.Generator(11)
    g:set_offset(5)
    local whole = core[fn](nv.empty(37), g)
    T.eq(g:offset(), 6, fn .. ": one generator step")
    for _, c in ipairs({{0, 37}, {1, 10}, {3, 5}, {4, 33}, {36, 1}}) do
      local h = nv.Generator(11)
      h:set_offset(5)
      local part = core[fn](nv.empty(c[2]), h, c[1])
      T.eq(h:offset(), 6, fn .. ": a part steps the generator as the whole draw")
      T.ok(part:bytes() == whole:narrow(1, c[1] + 1, c[2]):bytes(), string.format("%s: elements %d.. of %d", fn, c[1], c[2]))
    end
  end
  T.raises(function() core.randn_(nv.empty(2), nil, -1) end, "first must be >= 0")
end)

T.case("shard.build: each rank's rows are the whole build's, byte for byte (2 and 3 ranks), zeros past them", function()
  local cfg = {vocab_size = 256, hidden_size = 64, intermediate_size = 80, num_attention_heads = 4,
    num_key_value_heads = 2, num_hidden_layers = 2}
  local whole = llama.Llama(cfg, {seed = 7})
  local W = {}
  nn.each_entry(whole, function(name, e) W[name] = e.param end)
  for _, world in ipairs({2, 3}) do
    for rank = 0, world - 1 do
      local m = shard.build(world, rank, function() return llama.Llama(cfg, {seed = 7}) end)
      local n, grads = 0, 0
      nn.each_entry(m, function(name, e)
        n = n + 1
        T.eq(e.full_shape, W[name]:size(), name .. ": full_shape")
        local r, chunk = shard.shard_rows(e.full_shape[1], world, #e.full_shape >= 2 and 16 or 1)
        local mine = r[rank + 1]
        local s = e.full_shape[2] and {chunk, e.full_shape[2]} or {chunk}
        T.eq(e.param:size(), s, name .. ": (chunk, ...) rows")
        T.eq(e.grad:size(), s, name .. ": its gradient too")
        grads = grads + e.grad:numel()
        if mine.rows > 0 then
          T.ok(e.param:narrow(1, 1, mine.rows):bytes() == W[name]:narrow(1, mine.row0 + 1, mine.rows):bytes(),
            string.format("%s, rank %d of %d: rows %d..%d", name, rank, world, mine.row0, mine.row0 + mine.rows - 1))
        end
        if mine.rows < chunk then T.eq(e.param:narrow(1, mine.rows + 1, chunk - mine.rows):abs():max(), 0, "padding") end
      end)
      T.eq(n, 21, "embedding, 2 x 9 block parameters, norm, LM head")
      T.eq(m.grad_buffer:numel(), grads, "the flat gradient buffer holds rows only")
    end
  end
  -- the rows a world larger than a parameter's rows would need: refused, naming it
  T.raises(function() shard.build(200, 0, function() return llama.Llama(cfg, {seed = 7}) end) end,
    "has 64 rows, fewer than the 200 ranks")
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

-- fused_amax: a part of a fused group is gathered f32 (recipe:gathered_weight: its scale is the group's)
T.case("2 ranks, nvfp4 fused_amax: shard=full = plain data parallelism, bit for bit", function()
  need_mpi()
  local common = {"recipe=nvfp4", "fused_amax=true", "batch=2", "dist=true", "clip=0.5"}
  local none = run(2, "fused/none", common)
  local full = run(2, "fused/full", {"recipe=nvfp4", "fused_amax=true", "batch=2", "dist=true", "clip=0.5", "shard=full"})
  for _, step in ipairs({2, 4}) do same_ckpt(none, full, step, "fused_amax full step " .. step) end
  local m0, m = metrics(none), metrics(full)
  for step = 1, 4 do T.eq(m[step].loss, m0[step].loss, "fused_amax full: loss of step " .. step) end
  local plain = metrics(run(2, "fused/plain", {"recipe=nvfp4", "batch=2", "dist=true", "clip=0.5"}))
  T.ok(plain[4].loss ~= m0[4].loss, "fused_amax changes the run")
end)

-- The quantized gather (shard=full's default gather=quantized): the bytes a rank sends in the
-- quantized linears' all-gathers (metrics qgather_bytes) against a bf16 gather of the same shards,
-- computed here from the shapes: a block's q, k, v, o, gate, up, down [rows, K]; rank shards of
-- chunk = ceil(ceil(rows / N) / 16) * 16 rows (shard.shard_rows); N - 1 chunks sent a gather (ring);
-- two gathers per block a step (forward, then again for the backward: reshard_after_forward).
local function bf16_linear_gather_bytes(n, steps)
  local C, F, hd = 64, 80, 16
  local shapes = {{4 * hd, C}, {2 * hd, C}, {2 * hd, C}, {C, 4 * hd}, {F, C}, {F, C}, {C, F}}
  local per = 0
  for _, s in ipairs(shapes) do
    local chunk = ((s[1] + n - 1) // n + 15) // 16 * 16
    per = per + (n - 1) * chunk * s[2] * 2
  end
  return per * 2 * 2 * steps -- 2 blocks, 2 gathers each
end

for _, n in ipairs({2, 3}) do
  T.case(n .. " ranks, nvfp4 and fp8_cs: shard=full gathers the quantized linears quantized (bit for bit gather=f32's), " ..
    "nvfp4 <= 0.3x the bytes of bf16", function()
    need_mpi()
    for _, recipe in ipairs({"nvfp4", "fp8_cs"}) do
      local common = {"recipe=" .. recipe, "batch=2", "dist=true", "clip=0.5", "shard=full"}
      local function with(x) local a = {table.unpack(common)}; a[#a + 1] = x; return a end
      local q = run(n, "qg" .. n .. "/" .. recipe .. "/q", common)
      local f = run(n, "qg" .. n .. "/" .. recipe .. "/f32", with("gather=f32"))
      -- the same collectives reduce the same gradients: bytes equal, whatever the ranks' sum order
      for _, step in ipairs({2, 4}) do same_ckpt(f, q, step, recipe .. " gather=quantized vs f32, step " .. step) end
      local mq, mf = metrics(q), metrics(f)
      local bf16 = bf16_linear_gather_bytes(n, 4)
      T.eq(mf[4].qgather_bytes, 0, "gather=f32 gathers nothing quantized")
      T.eq(mq[4].qgather_bf16_bytes, bf16, "the bf16 figure of the quantized linears")
      local ratio = mq[4].qgather_bytes / bf16
      -- nvfp4 16x16: 4 bits a code + an e4m3 scale each 16 elements of a row (the tile's, as the layout keeps it):
      -- 4.5 bits, 0.28125;
      -- fp8 per tensor: 8 bits a code, the scale from the all-reduced amax: 0.5
      T.ok(ratio <= (recipe == "nvfp4" and 0.3 or 0.5), string.format("%s: quantized gather bytes %d = %.4f x bf16's %d",
        recipe, mq[4].qgather_bytes, ratio, bf16))
      -- the rest (embedding, norms, LM head) gathers f32 either way: the f32 run's extra is the linears' f32 bytes
      T.eq(mf[4].gather_bytes - mq[4].gather_bytes, 2 * bf16 - mq[4].qgather_bytes, "the other weights' f32 gathers")
      print(string.format("%d ranks %s shard=full: weight all-gathers %d bytes a rank over 4 steps (gather=f32: %d); " ..
        "quantized linears %d bytes = %.4f x bf16 (%d)", n, recipe, mq[4].gather_bytes, mf[4].gather_bytes,
        mq[4].qgather_bytes, ratio, bf16))
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
local recipes = require "nvlua.recipe"
local quant = require "nvlua.quant"
-- SHARD_KEEP_COPIES=1: the quantized weight copies of a gathered weight are not dropped when it is
-- freed (the weight cache keeps them to the step's end), for the comparison
if os.getenv("SHARD_KEEP_COPIES") then recipes.weight_cache_drop = function() end end
local c = config.parse(train.schema, arg, {})
nv.reset_peak_memory()
local before = nv.memory().cpu
local p = train.build(c)
local live = nv.memory().cpu - before
local build_peak = nv.memory().peak.cpu - before
p.peak = 1e9 -- no GEMM-rate measurement (its 1024^2 operands are not the step's)
nv.reset_peak_memory()
c.steps = 2
-- the most quantized copies the weight cache holds when a unit's weights are gathered or freed
local most = 0
local opt = p.optimizer
if opt.units then
  local g, r = opt._gather, opt._release
  function opt._gather(...) most = math.max(most, recipes.weight_cache_size()); return g(...) end
  function opt._release(...) most = math.max(most, recipes.weight_cache_size()); return r(...) end
end
train.run(c, p)
local peak = nv.memory().peak.cpu
-- the bytes of block 0's quantized weight copies (fprop's, as the recipe makes them; none for a
-- plain f32 GEMM) and its linears
local copy, linears = 0, 0
for _, l in ipairs(p.model:linears()) do
  if l.block == 0 then
    linears = linears + 1
    local g = p.recipe:gemm(l.module:context(), "fprop")
    if not (g.a.format == "f32" and g.b.format == "f32") then
      copy = copy + nv.scope(function()
        return quant.quantize(nv.zeros(l.module.out_features, l.module.in_features), g.b.format,
          g.b.block == "2d" and {block = "2d"} or nil):nbytes()
      end)
    end
  end
end
-- the count: parameters P (f32), padded shards of chunk rows per parameter
local P, S = 0, 0
for _, e in ipairs(p.model:named_parameters()) do
  local shape = p.optimizer.by_name and p.optimizer.by_name[e.name].shape or e.param:size()
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  P = P + n
  if p.optimizer.by_name then S = S + p.optimizer.by_name[e.name].grad:numel() end
end
-- the largest parameter (its whole f32 bytes)
local big = 0
for _, e in ipairs(p.model:named_parameters()) do
  local shape = p.optimizer.by_name and p.optimizer.by_name[e.name].shape or e.param:size()
  big = math.max(big, 4 * shape[1] * (shape[2] or 1))
end
print(string.format("rank %d: live %d peak %d P %d S %d build_peak %d big %d copy %d linears %d most %d", dist.rank(),
  live, peak - before, P, S, build_peak, big, copy, linears, most))
]=]

-- the numbers rank 0 of a MEM run printed
local function mem_result(out)
  local r, keys = {}, {"live", "peak", "P", "S", "build", "big", "copy", "linears", "most"}
  local vals = {out:match("rank 0: live (%d+) peak (%d+) P (%d+) S (%d+) build_peak (%d+) big (%d+) copy (%d+) " ..
    "linears (%d+) most (%d+)")}
  T.eq(#vals, #keys, "MEM's line; output:\n" .. out)
  for i, k in ipairs(keys) do r[k] = tonumber(vals[i]) end
  return r
end

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
    res[mode] = mem_result(out)
  end
  local P = res.none.P
  -- weights + grads + AdamW (f32): none 16P; optimizer 8P + 8P/2 (ZeRO-1's flat shard, 4 more bytes a
  -- shard element for its gradient shard, which it keeps besides the flat gradient buffer)
  T.eq(res.none.live, 16 * P, "none: 16 bytes a parameter")
  -- grads: whole weights (padded to 2·chunk rows per parameter: 2S) + gradient, m, v shards (S each)
  T.eq(res.grads.live, 4 * 2 * res.grads.S + 12 * res.grads.S, "grads: padded weights + 3 shards")
  T.eq(res.full.live, 16 * res.full.S, "full: 4 shards")
  -- full is built in rows (shard.build): the build never holds a whole parameter; its peak is the
  -- end state, 16S (on the way: weights 4S, gradient rows 4S and their flat buffer 4S while
  -- Llama:_flatten_grads copies them, 12S; then the moments, 8S)
  T.eq(res.full.build, res.full.live, "full: the build's peak is the shards it ends with")
  T.ok(res.full.build < 16 * P / 2 + res.full.big, "full: below the shards plus one whole parameter")
  for _, mode in ipairs({"none", "optimizer", "grads", "full"}) do
    local r = res[mode]
    print(string.format("%-9s P %d, live after build %.3f MiB (build's peak %.3f MiB), step peak %.3f MiB", mode, P,
      r.live / 2 ^ 20, r.build / 2 ^ 20, r.peak / 2 ^ 20))
  end
  T.eq(res.optimizer.live, 14 * P, "optimizer: whole weights and gradient buffer, 3 shards (of P/2)")
  -- the step's peak over the state: shard=none's is the activations, the blocks' bf16 weight copies
  -- (kept by the weight cache from fprop to dgrad) and scratch; grads adds one block's whole f32
  -- gradients (reduce-scattered and freed before the next block's backward), bit for bit here. full
  -- adds two blocks' gathered f32 weights (the current one and the prefetched one) and one block's
  -- gradients (4 bytes a parameter each) but holds one block's weight copies, not all L's (a gathered
  -- weight's copies go with it: recipe.weight_cache_drop), and its peak moves (to the first block's
  -- backward, where block 2's are): at most that (measured: 1.1 MiB under it). The embedding and
  -- head are smaller than a block here. Slack: 4 KiB for the allocator's small tensors.
  local block = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 768 * 256 + 2 * 256) -- bytes of one block's f32 tensors
  local act = res.none.peak - res.none.live
  T.eq(res.full.copy, 2 * 786432, "a block's bf16 copies: 2 bytes a weight")
  T.near(res.grads.peak - res.grads.live, act + block, 4096, "grads: peak = state + activations + one block's gradients")
  T.ok(res.full.peak - res.full.live <= act + 3 * block - res.full.copy + 4096,
    "full: peak <= state + activations + two blocks' gathered weights, one's gradients - one block's copies (of 2)")
  -- (2 blocks of hidden 256: the two gathered blocks outweigh full's smaller state; at 8B width and
  -- more blocks they do not)
  T.ok(res.full.peak < res.optimizer.peak and res.grads.peak < res.optimizer.peak and res.optimizer.peak < res.none.peak,
    "peaks: full and grads < optimizer < none")
end)

T.case("shard=full, nvfp4 and fp8_cs: one block's quantized weight copies at a time (they go with the gathered weight)", function()
  -- The weight cache keeps a weight's quantized copies to the step's end; under shard=full a gathered
  -- weight's copies are dropped when it is freed (after the unit's forward, and its backward), and the
  -- backward re-makes fprop's copy from the re-gathered weight (the same call on the same f32 values:
  -- the same bits; the checkpoints equal shard=none's, the 2-rank cases above). So at most one block's
  -- copies exist (each with its dgrad handle, a view), where the cache kept them all (SHARD_KEEP_COPIES:
  -- not dropped, the behaviour before): at the dropping run's peak (a block's backward) the keeping run
  -- holds the other L - 1 blocks' copies as well, so its peak is at least that much higher.
  need_mpi()
  local script = ROOT .. "/mem.lua"
  T.write_file(script, MEM)
  for _, recipe in ipairs({"nvfp4", "fp8_cs"}) do
    local r = {}
    for _, keep in ipairs({false, true}) do
      local out, code = mpirun(2, script, {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=256",
        "heads=4", "kv_heads=2", "ffn=768", "seq=64", "batch=2", "recipe=" .. recipe, "eval_every=0", "sample_tokens=0",
        "plot=false", "quiet=true", "save=false", "check_memory=false", "dist=true", "shard=full",
        "out=" .. ROOT .. "/copies_" .. recipe .. tostring(keep)}, keep and "SHARD_KEEP_COPIES=1" or nil)
      T.eq(code, 0, out)
      r[keep] = mem_result(out)
    end
    local L, drop, kept = 2, r[false], r[true]
    T.ok(drop.copy > 0, recipe .. ": the blocks' weights are quantized")
    T.ok(drop.most <= 2 * drop.linears, string.format("%s: at most one block's copies (%d handles for %d linears)", recipe,
      drop.most, drop.linears))
    T.ok(kept.most >= L * kept.linears, recipe .. ": kept, every block's")
    T.ok(kept.peak - drop.peak >= (L - 1) * drop.copy - 4096, string.format("%s: the peak is lower by at least " ..
      "%d blocks' copies (%d bytes): %d", recipe, L - 1, (L - 1) * drop.copy, kept.peak - drop.peak))
    print(string.format("%s, shard=full: step peak %.3f MiB (copies kept to the step's end: %.3f MiB); a block's " ..
      "copies %.3f MiB", recipe, drop.peak / 2 ^ 20, kept.peak / 2 ^ 20, drop.copy / 2 ^ 20))
  end
end)

-- ---- prefetch: the nonblocking all-gather ------------------------------------------------------------

local GATHER = [=[
local nv = require "nvlua"
local dist = require "nvlua.dist"
local r, n = dist.init()
local function rows(k, v) return nv.full({k, 3}, v) end
local ok = true
-- out of place, in place, and two in flight waited in the other order: each = the blocking gather
local t1, t2 = rows(5, 10 * r + 1), rows(2, 10 * r + 2)
local a, b = nv.empty(5 * n, 3), nv.empty(2 * n, 3)
local inplace = nv.empty(4 * n, 3)
inplace:narrow(1, 4 * r + 1, 4):fill_(10 * r + 3)
local ha = dist.all_gather_start(a, t1)
local hb = dist.all_gather_start(b, t2)
local hc = dist.all_gather_start(inplace, inplace:narrow(1, 4 * r + 1, 4))
local pending = dist.gathers_pending()
hb:wait(); hc:wait(); ha:wait(); ha:wait() -- (a second wait: nothing)
local a0, b0, c0 = nv.empty(5 * n, 3), nv.empty(2 * n, 3), nv.empty(4 * n, 3)
dist.all_gather(a0, t1); dist.all_gather(b0, t2); dist.all_gather(c0, rows(4, 10 * r + 3))
ok = ok and a:bytes() == a0:bytes() and b:bytes() == b0:bytes() and inplace:bytes() == c0:bytes()
-- reduce_scatter_start (avg, sum) = the blocking reduce_scatter
local g = nv.randn(6 * n, 2, {generator = nv.Generator(3 + r)})
local o1, o2, o0, o3 = nv.empty(6, 2), nv.empty(6, 2), nv.empty(6, 2), nv.empty(6, 2)
local h1 = dist.reduce_scatter_start(o1, g, "avg")
local h2 = dist.reduce_scatter_start(o2, g, "sum")
h2:wait(); h1:wait()
dist.reduce_scatter(o0, g, "avg"); dist.reduce_scatter(o3, g, "sum")
ok = ok and o1:bytes() == o0:bytes() and o2:bytes() == o3:bytes()
-- bad input
local e1 = select(2, pcall(dist.all_gather_start, nv.empty(5 * n, 2), t1))
local e2 = select(2, pcall(dist.all_gather_start, nv.empty(3, 5 * n):t(), t1))
local e3 = select(2, pcall(require("nvlua.core").dist.all_gather_wait, 77))
print(string.format("rank %d: pending %d, same %s, left %d", r, pending, tostring(ok), dist.gathers_pending()))
print("errors: " .. tostring(e1) .. " | " .. tostring(e2) .. " | " .. tostring(e3))
]=]

T.case("dist.all_gather_start, reduce_scatter_start: = the blocking ones (2 and 3 ranks, in place, several in flight); bad input", function()
  need_mpi()
  local script = ROOT .. "/gather.lua"
  T.write_file(script, GATHER)
  for _, n in ipairs({2, 3}) do
    local out, code = mpirun(n, script)
    T.eq(code, 0, out)
    for r = 0, n - 1 do
      T.ok(out:find(string.format("rank %d: pending 3, same true, left 0", r), 1, true) ~= nil, out)
    end
    T.ok(out:find("all_gather_start: out (contiguous) holds the " .. n .. " ranks' t (contiguous) along dim 1", 1, true) ~= nil, out)
    T.ok(out:find("all_gather_wait: no all-gather started with handle 77 is pending", 1, true) ~= nil, out)
  end
end)

local ORDER = [=[
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local dist = require "nvlua.dist"
local c = config.parse(train.schema, arg, {})
local p = train.build(c)
p.peak = 1e9
local opt = p.optimizer
opt.prefetch = os.getenv("SHARD_NO_PREFETCH") == nil
opt.trace = {}
-- the most units gathered or in flight when a unit's compute begins
local most = 0
local note = opt._note
function opt._note(self, what, u)
  if what == "forward" or what == "backward" then
    local k = 0
    for _, x in ipairs(self.units) do if x.gathered or x.inflight then k = k + 1 end end
    most = math.max(most, k)
  end
  return note(self, what, u)
end
c.steps = 1
train.run(c, p)
local w = opt:whole_parameters()
local names = {}
for k in pairs(w) do names[#names + 1] = k end
table.sort(names)
local bytes = {}
for _, k in ipairs(names) do bytes[#bytes + 1] = w[k]:bytes() end
if dist.rank() == 0 then
  local f = assert(io.open(c.out .. "/weights.bin", "wb"))
  f:write(table.concat(bytes))
  f:close()
  print("trace: " .. table.concat(opt.trace, ", "))
  print(string.format("most %d", most))
end
]=]

T.case("prefetch: the next unit's gather starts before this unit computes; at most two units gathered; same bits", function()
  need_mpi()
  local script = ROOT .. "/order.lua"
  T.write_file(script, ORDER)
  local a = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=64", "heads=4", "kv_heads=2", "ffn=80",
    "seq=16", "batch=2", "recipe=nvfp4", "eval_every=0", "sample_tokens=0", "plot=false", "quiet=true", "save=false",
    "check_memory=false", "dist=true", "shard=full", "out=" .. ROOT .. "/order"}
  local out, code = mpirun(2, script, a)
  T.eq(code, 0, out)
  -- forward: each unit starts the next one's gather before it computes, and waits for its own;
  -- the LM head's backward starts the last block's, each block's backward the one before
  T.eq(out:match("trace: ([^\n]*)"), table.concat({"gather embed", "start 1", "forward embed", "wait 1", "start 2",
    "forward 1", "wait 2", "start head", "forward 2", "wait head", "forward head", "start 2", "wait 2", "start 1",
    "backward 2", "wait 1", "start embed", "backward 1", "wait embed", "backward embed"}, ", "), "the order")
  T.eq(tonumber(out:match("most (%d+)")), 2, "at most two units gathered (or in flight) when one computes")
  -- and the weights after the step are the blocking gathers' (prefetch off), byte for byte
  a[#a] = "out=" .. ROOT .. "/order_off"
  local out2, code2 = mpirun(2, script, a, "SHARD_NO_PREFETCH=1")
  T.eq(code2, 0, out2)
  T.eq(out2:match("trace: ([^\n]*)"):find("start", 1, true), nil, "prefetch off: no gather started early")
  local w1, w2 = read(ROOT .. "/order/weights.bin"), read(ROOT .. "/order_off/weights.bin")
  T.ok(#w1 > 0 and w1 == w2, "the weights after the step, byte for byte")
end)

T.case("cleanup: the scratch directory is removed", function()
  ckpt.rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
