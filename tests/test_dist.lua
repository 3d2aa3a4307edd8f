-- tests/test_dist.lua: data parallelism (nvlua.dist, the dist=true training loop, ZeRO-1) on the
-- CPU, with ranks launched by Open MPI's mpirun (skipped when mpirun is not found or nvlua was
-- built without MPI). Each case writes a small Lua script and runs it under `mpirun -np N
-- build/nvlua` (OMP_NUM_THREADS=1 per rank; 2 ranks on CI's 2 cores):
--   * in this process (no launcher): dist is a world of one; collectives are identities; and
--     quantize's SR slab options (sr_row_offset, sr_k_offset, sr_k_total) reproduce a slice of
--     the whole tensor's quantization (the C tests check every kernel; this, the binding).
--   * every collective (all_reduce sum/avg/max/min, all_reduce_number(s), broadcast, reduce_scatter,
--     all_gather, in place too, non-contiguous tensors, barrier) on f32, bf16, i32, i64, u8 and
--     several shapes, against a serial reference each rank computes from every rank's data, on
--     2 and 3 ranks. The data are small integers (times the world size), so every result is
--     exact and compared bit for bit; argument errors raise alike on every rank.
--   * equivalence: 2 ranks x batch 2 against 1 rank x batch 4 (tiny Llama: 2 layers, hidden 32,
--     seq 16, 6 steps), under bf16 and nvfp4 (shared amax, SR at global block indices), with and
--     without ZeRO-1. What may differ is fp32 summation order: each rank sums its half of the
--     tokens (wgrad GEMMs, norm-weight and embedding gradients, the loss) and the halves are then
--     added, where one rank sums all tokens in one pass. Tolerances, per recipe:
--       nvfp4: every step's loss, grad norm (relative) and final weight within 1e-6 (measured:
--              1.5e-8, 6e-9, 1.1e-8; products of nvfp4 operands are short, so the fp32 sums of the
--              wgrad GEMMs are mostly exact whatever their order);
--       bf16:  the losses of steps 1-2 within 1e-6 (measured 1e-15), every loss within 5e-4, grad
--              norm within 2e-3 relative, final weights within 1e-3 (measured 8e-5, 4.5e-4,
--              1.3e-4): a last-bit difference in an fp32 value that is then rounded to bf16 (a
--              GEMM output, the next step's weight operand) can flip that rounding, a 2^-8
--              relative jump, which Adam's normalised update carries on.
--     ZeRO-1 runs equal the plain runs within the same tolerances (they differ only in the order
--     the gradient norm is summed, by shard instead of by parameter: bit for bit on 2 ranks here,
--     ~1e-10 in the norm and 7e-8 in the weights on 3), also on 3 ranks where the flat parameter
--     space of a tied-embedding model is padded to 3 equal shards; the ranks' weights are
--     bit-identical after every run. Controls: dropping the SR offsets or the amax reduction
--     under nvfp4 moves the weights by far more than the tolerance, so the comparison sees them.
--   * resume: a 2-rank nvfp4 ZeRO-1 run of 3 steps + resume=auto for 3 more equals the 6 straight
--     steps bit for bit (metrics and weights).
--   * the background all-reduce (sync=shadow's averaging) on 2 and 3 ranks: run by a thread of its
--     own beside blocking collectives of the main thread, it completes while the main thread makes
--     no MPI call; exact sums and averages.
--   * sync=shadow: k=1 without overlap equals a blocking average of every parameter (and, with
--     shadow_moments, of the AdamW moments) after each step, bit for bit; overlapped every 3 steps
--     equals a reference that averages at once and applies the change at the next averaging.
--   * faults: rank 1 killed with SIGKILL at step 3, rank 1 calling os.exit(3), and rank 1 hanging
--     (NVLUA_DIST_TIMEOUT=2): mpirun exits non-zero within seconds with a message naming rank 1
--     (or, for the hang, the rank that timed out waiting); checkpoint step 2 is complete and loads.
local T = require "nvlua.test"
local nv = require "nvlua"
local dist = require "nvlua.dist"
local cjson = require "cjson"
local lfs = require "lfs"
local st = require "nvlua.safetensors"
local ckpt = require "nvlua.checkpoint"
local train = require "nvlua.train"
local config = require "nvlua.config"

local ROOT = T.tmpdir()

-- the nvlua binary running this file, as an absolute path
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

-- run a shell command; -> output (stdout and stderr), exit code, seconds
local function sh(cmd)
  local t0 = nv.clock()
  local p = assert(io.popen(cmd .. " 2>&1"))
  local out = p:read("a")
  local _, _, code = p:close()
  return out, code, nv.clock() - t0
end

-- mpirun -np n nvlua script args (a 120 s guard against a hang of the test itself)
local function mpirun(n, script, args, env)
  return sh(string.format("env OMP_NUM_THREADS=1 %s timeout 120 %s --allow-run-as-root --oversubscribe --bind-to none " ..
    "-np %d %s %s %s", env or "", MPIRUN, n, NVLUA, script, table.concat(args or {}, " ")))
end

local function nvlua(script, args)
  return sh(string.format("env OMP_NUM_THREADS=1 timeout 120 %s %s %s", NVLUA, script, table.concat(args or {}, " ")))
end

-- ---- a world of one --------------------------------------------------------------------------

T.case("without a launcher dist is a world of one: collectives are identities", function()
  local r, w = dist.init()
  T.eq({r, w}, {0, 1})
  T.eq(dist.world_size(), 1)
  T.eq(dist.local_rank(), 0)
  T.eq(dist.backend(), "none")
  T.eq(dist.is_main(), true)
  local t = nv.tensor({1.5, -2, 3})
  for _, op in ipairs({"sum", "avg", "max", "min"}) do T.eq(dist.all_reduce(t, op):totable(), {1.5, -2, 3}) end
  T.eq(dist.all_reduce_number(2.5, "avg"), 2.5)
  T.eq(dist.all_reduce_numbers({2.5, 1, -3}, "avg"), {2.5, 1, -3})
  T.raises(function() dist.all_reduce_numbers({1, "x"}, "sum") end, "element 2 is a string, not a number")
  T.eq(dist.broadcast(t, 0):totable(), {1.5, -2, 3})
  local out = nv.zeros(3)
  T.eq(dist.reduce_scatter(out, t, "sum"):totable(), {1.5, -2, 3})
  local g = nv.zeros(3)
  T.eq(dist.all_gather(g, t):totable(), {1.5, -2, 3})
  T.eq(dist.all_gather(g, g:narrow(1, 1, 3)):totable(), {1.5, -2, 3}, "in place")
  dist.barrier()
  T.raises(function() dist.all_reduce(t, "prod") end, "invalid option 'prod'")
  T.raises(function() dist.all_reduce(nv.tensor({1, 2}, "i32"), "avg") end, "all_reduce: avg needs a float tensor, got i32")
  T.raises(function() dist.broadcast(t, 1) end, "root 1 is not a rank (0..0)")
  T.raises(function() dist.reduce_scatter(nv.zeros(2), t) end, "reduce_scatter: t is cut along dim 1 into 1 equal chunks")
  T.raises(function() dist.all_gather(nv.zeros(4), t) end, "all_gather: out holds the 1 ranks' t along dim 1")
  -- bucketed all-reduce: identities too, nothing left pending; bad input named
  for _, op in ipairs({"sum", "avg"}) do dist.all_reduce_start(t:narrow(1, 1, 2), op) end
  dist.wait_all()
  T.eq(t:totable(), {1.5, -2, 3}, "all_reduce_start + wait_all")
  T.eq(dist.pending(), 0, "nothing pending")
  T.raises(function() dist.all_reduce_start(t, "max") end, "all_reduce_start: op must be sum or avg, got max")
  T.raises(function() dist.all_reduce_start(t:to("bf16")) end, "all_reduce_start: expects a contiguous f32 tensor")
  T.raises(function() dist.all_reduce_start(nv.zeros(2, 2):transpose(1, 2)) end, "expects a contiguous f32 tensor")
  -- background all-reduce (sync=shadow's): an identity too, nothing left pending; bad input named
  dist.all_reduce_bg(t, "avg")
  T.eq({dist.bg_pending(), dist.bg_busy(), dist.bg_threaded()}, {false, false, false}, "a world of one: nothing runs")
  dist.bg_wait()
  T.eq(t:totable(), {1.5, -2, 3}, "all_reduce_bg + bg_wait")
  T.raises(function() dist.all_reduce_bg(t, "min") end, "all_reduce_bg: op must be sum or avg, got min")
  T.raises(function() dist.all_reduce_bg(t:to("bf16")) end, "all_reduce_bg: expects a contiguous f32 CPU tensor, got")
  T.raises(function() dist.all_reduce_bg(nv.zeros(2, 2):transpose(1, 2)) end, "expects a contiguous f32 CPU tensor")
  local out = nv.full({3}, 9)
  T.eq(dist.all_reduce_bg(out, "avg", {src = t}):totable(), {1.5, -2, 3}, "from src: src itself")
  dist.all_reduce_bg(out, "sum", {src = t, delta = true})
  T.eq(out:totable(), {0, 0, 0}, "delta: the reduction minus src")
  T.raises(function() dist.all_reduce_bg(t, "sum", {delta = true}) end, "delta (t = reduced - src) needs a src other than t")
  T.raises(function() dist.all_reduce_bg(t, "sum", {src = t, delta = true}) end, "needs a src other than t")
  T.raises(function() dist.all_reduce_bg(t, "sum", {src = nv.zeros(4)}) end, "src must be a contiguous f32 CPU tensor of t's 3 elements")
  T.raises(function() dist.all_reduce_bg(t, "sum", {source = t}) end, "unknown option 'source'")
  T.raises(function() dist.init({threads = "serialized"}) end, 'threads must be "funneled" or "multiple"')
  local info = dist.info()
  T.eq(type(info.mpi), "boolean")
  if info.nccl then T.ok(info.nccl_loads, "built with NCCL: the library loads and resolves: " .. info.nccl_why) end
end)

T.case("quantize's SR slab options: a rank's rows quantize as their part of the whole batch (dgrad and wgrad copies)", function()
  local x = nv.randn(64, 32, {generator = nv.Generator(3)})           -- (tokens, N), the global dY
  for _, ref in ipairs({false, true}) do T.with(nv.use_reference, ref, function()
    -- row-wise copy (blocked along N): rank 1 owns tokens 33..64 = rows from 32
    local whole = nv.quantize(x, "nvfp4", {sr = true, seed = 5, offset = 2})
    local part = nv.quantize(x:narrow(1, 33, 32), "nvfp4", {sr = true, seed = 5, offset = 2, amax = whole.amax,
      sr_row_offset = 32})
    T.eq(part:codes():bytes(), whole:codes():narrow(1, 33, 32):bytes(), "row-wise codes")
    T.eq(part:scale_bytes():bytes(), whole:scale_bytes():narrow(1, 33, 32):bytes(), "row-wise scales")
    local plain = nv.quantize(x:narrow(1, 33, 32), "nvfp4", {sr = true, seed = 5, offset = 2, amax = whole.amax})
    T.ok(plain:codes():bytes() ~= part:codes():bytes(), "without the offset the draws differ")
    -- column-wise copy with the RHT (blocked along tokens): columns 32.. of a layout 64 long
    local wt = nv.quantize(x, "nvfp4", {axis = 1, rht = true, sr = true, seed = 5, offset = 3})
    local pt = nv.quantize(x:narrow(1, 33, 32), "nvfp4", {axis = 1, rht = true, sr = true, seed = 5, offset = 3,
      amax = wt.amax, sr_k_offset = 32, sr_k_total = 64})
    T.eq(pt:codes():bytes(), wt:codes():narrow(1, 33, 32):bytes(), "column-wise codes")
  end) end
  T.raises(function() nv.quantize(x, "nvfp4", {sr_row_offset = 16}) end, "they need sr = true")
  T.raises(function() nv.quantize(x, "nvfp4", {sr = true, sr_k_offset = 8, sr_k_total = 64}) end, "SR slab offsets")
  T.raises(function() nv.quantize(x, "nvfp4", {sr = true, sr_row_offset = -1}) end, "sr_row_offset must be a non-negative integer")
end)

-- ---- collectives ---------------------------------------------------------------------------------

local COLL = [=[
local nv = require "nvlua"
local dist = require "nvlua.dist"
local rank, world = dist.init()
assert(dist.backend() == "mpi", "not launched under MPI")
local n, bad = 0, {}
local function bits(t) return t:contiguous():bytes() end
local function check(got, want, what)
  n = n + 1
  if bits(got) ~= bits(want) then
    bad[#bad + 1] = string.format("%s: got %s want %s", what, table.concat(got:reshape(-1):totable(), ","),
      table.concat(want:reshape(-1):totable(), ","))
  end
end
-- rank r's data: small integers times world, so sums, means, maxima are exact in every dtype
local function value(r, i, dt)
  local v = ((r * 7 + i * 3) % 11) - (dt == "u8" and 0 or 5)
  return v * world
end
local function data(r, shape, dt)
  local t = nv.zeros(shape, dt)
  local flat = t:reshape(-1)
  for i = 1, flat:numel() do flat:set(i, value(r, i, dt)) end
  return t
end
local function reference(shape, dt, op)
  local acc = data(0, shape, dt):reshape(-1):totable()
  for r = 1, world - 1 do
    local x = data(r, shape, dt):reshape(-1):totable()
    for i = 1, #acc do
      if op == "max" then acc[i] = math.max(acc[i], x[i])
      elseif op == "min" then acc[i] = math.min(acc[i], x[i])
      else acc[i] = acc[i] + x[i] end
    end
  end
  if op == "avg" then for i = 1, #acc do acc[i] = acc[i] / world end end
  local t = nv.zeros(shape, dt)
  local flat = t:reshape(-1)
  for i = 1, #acc do flat:set(i, acc[i]) end
  return t
end
local DTYPES = {"f32", "bf16", "i32", "i64", "u8"}
local SHAPES = {{5}, {3, 4}, {2, 3, 2}}
for _, dt in ipairs(DTYPES) do
  local ops = (dt == "f32" or dt == "bf16") and {"sum", "avg", "max", "min"} or {"sum", "max", "min"}
  for _, shape in ipairs(SHAPES) do
    local tag = dt .. " [" .. table.concat(shape, ",") .. "]"
    for _, op in ipairs(ops) do
      check(dist.all_reduce(data(rank, shape, dt), op), reference(shape, dt, op), "all_reduce " .. op .. " " .. tag)
      -- reduce_scatter: a (world·s0, ...) tensor, this rank's chunk
      local big = {world * shape[1], table.unpack(shape, 2)}
      local out = nv.zeros(shape, dt)
      dist.reduce_scatter(out, data(rank, big, dt), op)
      check(out, reference(big, dt, op):narrow(1, rank * shape[1] + 1, shape[1]), "reduce_scatter " .. op .. " " .. tag)
    end
    -- a non-contiguous tensor reduces in place
    if #shape == 2 then
      local m = data(rank, {shape[2], shape[1]}, dt)
      local tv = m:transpose()
      dist.all_reduce(tv, "max")
      check(tv, reference({shape[2], shape[1]}, dt, "max"):transpose(), "all_reduce max transposed " .. tag)
    end
    -- broadcast from every root
    for root = 0, world - 1 do
      check(dist.broadcast(data(rank, shape, dt), root), data(root, shape, dt), "broadcast root " .. root .. " " .. tag)
    end
    -- all_gather, into a new tensor and in place
    local big = {world * shape[1], table.unpack(shape, 2)}
    local want = nv.zeros(big, dt)
    for r = 0, world - 1 do want:narrow(1, r * shape[1] + 1, shape[1]):copy_(data(r, shape, dt)) end
    local out = nv.zeros(big, dt)
    check(dist.all_gather(out, data(rank, shape, dt)), want, "all_gather " .. tag)
    local inplace = nv.zeros(big, dt)
    inplace:narrow(1, rank * shape[1] + 1, shape[1]):copy_(data(rank, shape, dt))
    check(dist.all_gather(inplace, inplace:narrow(1, rank * shape[1] + 1, shape[1])), want, "all_gather in place " .. tag)
  end
end
-- numbers in double precision
local x = dist.all_reduce_number(rank + 0.25, "sum")
n = n + 1
if x ~= world * (world - 1) / 2 + 0.25 * world then bad[#bad + 1] = "all_reduce_number sum: " .. x end
for _, c in ipairs({{"max", world - 1 + 1 / 3}, {"min", 1 / 3}, {"avg", (world - 1) / 2 + 1 / 3}}) do
  n = n + 1
  local v = dist.all_reduce_number(rank + 1 / 3, c[1])
  if math.abs(v - c[2]) > 1e-15 then bad[#bad + 1] = "all_reduce_number " .. c[1] .. ": " .. v end
  -- several numbers in one collective: each as all_reduce_number reduces it alone, bit for bit
  n = n + 1
  local vs = dist.all_reduce_numbers({rank + 1 / 3, rank == 1 and 1 or 0, -rank}, c[1])
  local want = {v, dist.all_reduce_number(rank == 1 and 1 or 0, c[1]), dist.all_reduce_number(-rank, c[1])}
  if #vs ~= 3 or vs[1] ~= want[1] or vs[2] ~= want[2] or vs[3] ~= want[3] then
    bad[#bad + 1] = string.format("all_reduce_numbers %s: %s, %s, %s", c[1], tostring(vs[1]), tostring(vs[2]), tostring(vs[3]))
  end
end
n = n + 1
if #dist.all_reduce_numbers({}, "sum") ~= 0 then bad[#bad + 1] = "all_reduce_numbers of none" end
dist.barrier()
-- argument errors are local checks: every rank raises the same, nobody hangs
local ok, err = pcall(dist.reduce_scatter, nv.zeros(2), nv.zeros(world * 2 + 1))
n = n + 1
if ok or not tostring(err):find("reduce_scatter: t is cut along dim 1 into " .. world .. " equal chunks", 1, true) then
  bad[#bad + 1] = "reduce_scatter shape error: " .. tostring(err)
end
ok, err = pcall(dist.all_gather, nv.zeros(world * 2, "f32"), nv.zeros(2, "i32"))
n = n + 1
if ok or not tostring(err):find("all_gather: out holds", 1, true) then bad[#bad + 1] = "all_gather dtype error: " .. tostring(err) end
dist.barrier()
print(string.format("rank %d of %d: %d checks, %d bad", rank, world, n, #bad))
for _, b in ipairs(bad) do print("  " .. b) end
]=]

T.case("collectives on 2 and 3 ranks equal a serial reference (every op, 5 dtypes, 3 shapes)", function()
  need_mpi()
  local script = ROOT .. "/coll.lua"
  T.write_file(script, COLL)
  for _, n in ipairs({2, 3}) do
    local out, code = mpirun(n, script)
    T.eq(code, 0, "mpirun -np " .. n .. " exit status; output:\n" .. out)
    local seen = 0
    for r, w, checks, bad in out:gmatch("rank (%d+) of (%d+): (%d+) checks, (%d+) bad") do
      seen = seen + 1
      T.eq(tonumber(w), n)
      T.ok(tonumber(checks) > 150, "checks run on rank " .. r .. ": " .. checks)
      T.eq(tonumber(bad), 0, "rank " .. r .. " mismatches:\n" .. out)
    end
    T.eq(seen, n, "every rank reported:\n" .. out)
  end
end)

-- The background all-reduce (dist.all_reduce_bg, sync=shadow's averaging) on every rank: a thread
-- of its own under MPI_THREAD_MULTIPLE. Its 1M-element all-reduce is started, the main thread runs
-- blocking collectives on the main communicator meanwhile (the two threads in MPI at once), then waits
-- for it with no MPI call of its own (dist.bg_busy() polled, a 60 s guard): it must complete without
-- the main thread driving it, which a nonblocking MPI_Iallreduce in Open MPI (no progress thread)
-- does not. Then avg, and avg - src out of place (delta). Small integers: every result exact,
-- compared bit for bit. With threads=funneled (no
-- MPI_THREAD_MULTIPLE) the fallback, an MPI_Iallreduce completed by bg_wait, gives the same results.
local BGRED = [=[
local nv = require "nvlua"
local dist = require "nvlua.dist"
local threads = arg[1] or "multiple" -- "funneled": the MPI_Iallreduce fallback, completed by bg_wait
local rank, world = dist.init({threads = threads})
assert(dist.bg_threaded() == (threads == "multiple"), "bg_threaded() under threads=" .. threads)
local ok0, err0 = pcall(dist.init, {threads = "multiple"}) -- MPI is started: too late to ask for more
assert(ok0 == (threads == "multiple"), tostring(err0))
assert(ok0 or tostring(err0):find("MPI was started without MPI_THREAD_MULTIPLE", 1, true), tostring(err0))
local N = 1 << 20
local function data(r) -- element i (0-based): world (i + r); every sum over 3 ranks < 2^24: exact in f32
  return ((nv.arange(N) + r) * world):to("f32")
end
local t, sum = data(rank), nv.zeros(N)
for r = 0, world - 1 do sum = sum + data(r) end
dist.all_reduce_bg(t, "sum")
assert(dist.bg_pending())
local ok, err = pcall(dist.all_reduce_bg, nv.zeros(4))
assert(not ok and tostring(err):find("one is already running", 1, true), tostring(err))
local u = nv.tensor({rank + 1, 2 * rank})
dist.all_reduce(u, "sum") -- the main communicator while the thread is in MPI_Allreduce
assert(dist.all_reduce_number(rank, "max") == world - 1)
local t0 = nv.clock()
while dist.bg_busy() and threads == "multiple" do
  if nv.clock() - t0 > 60 then error("rank " .. rank .. ": the background all-reduce did not complete on its own") end
end
assert(dist.bg_busy() == (threads ~= "multiple"), "without the thread it is busy until waited for")
dist.bg_wait()
assert(not dist.bg_pending())
local function same(a, b) return a:contiguous():bytes() == b:contiguous():bytes() end
assert(same(t, sum), "sum")
assert(same(u, nv.tensor({world * (world + 1) / 2, world * (world - 1)})), "the main thread's all_reduce")
local a = data(rank)
dist.all_reduce_bg(a, "avg")
dist.bg_wait()
local avg = (nv.arange(N) * world + world * (world - 1) / 2):to("f32") -- sum / world, an integer
assert(same(a, avg), "avg")
local src, d = data(rank), nv.zeros(N) -- out of place, and the change the average brings to src
dist.all_reduce_bg(d, "avg", {src = src, delta = true})
dist.bg_wait()
assert(same(d, avg - src), "delta")
assert(same(src, data(rank)), "src unchanged")
print(string.format("rank %d of %d: background all-reduce ok (%s)", rank, world, threads))
]=]

T.case("background all-reduce on 2 and 3 ranks: its own thread, completes with no MPI call of the main thread, exact; the MPI_Iallreduce fallback", function()
  need_mpi()
  local script = ROOT .. "/bgred.lua"
  T.write_file(script, BGRED)
  for _, c in ipairs({{2, "multiple"}, {3, "multiple"}, {2, "funneled"}}) do
    local n = c[1]
    local out, code = mpirun(n, script, {c[2]})
    T.eq(code, 0, "mpirun -np " .. n .. " " .. c[2] .. ": exit status; output:\n" .. out)
    local seen = 0
    for _ in out:gmatch("rank %d+ of " .. n .. ": background all%-reduce ok %(" .. c[2] .. "%)") do seen = seen + 1 end
    T.eq(seen, n, "every rank reported:\n" .. out)
  end
end)

-- ---- training --------------------------------------------------------------------------------------

-- a deterministic corpus (as tests/test_train.lua's)
local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 12345, lines = 500,
  prefix = function(i) return string.format("%d:%d ", i // 30 + 1, i % 30 + 1) end,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in", "darkness", "was",
    "upon", "face", "of", "waters", "said", "let", "there", "be", "morning", "evening", "day"}})

-- the training script every rank runs: key=value config, plus the test's own keys:
-- stop_at=N (stop after step N, keeping the steps=6 schedule), control=noshard|noreduce (drop
-- the SR offsets / the amax reduction), fault=kill|exit|hang (rank 1, at step 3), avg_ref=1 (every
-- parameter averaged over the ranks after each optimizer step: sync=shadow's reference; avg_ref=moments:
-- the AdamW moments too, shadow_moments=true's; avg_ref=delayed:k: overlapped sync=shadow's, every k steps)
local TRAIN = [=[
local train = require "nvlua.train"
local config = require "nvlua.config"
local dist = require "nvlua.dist"
local args, extra = {}, {}
for _, a in ipairs(arg) do
  local k, v = a:match("^([%w_]+)=(.*)$")
  if k == "stop_at" or k == "control" or k == "fault" or k == "avg_ref" then extra[k] = v else args[#args + 1] = a end
end
local c = config.parse(train.defaults, args)
local p = train.build(c)
p.peak = 1e9
if extra.control == "noshard" then p.recipe:set_shard(0, 1) end
if extra.control == "noreduce" then p.recipe:set_amax_reducer(nil) end
if extra.stop_at then c.steps = tonumber(extra.stop_at) end
local nv = require "nvlua"
local delayed = extra.avg_ref and tonumber(extra.avg_ref:match("^delayed:(%d+)$"))
if delayed then -- the reference for overlapped sync=shadow, every k steps: after the optimizer step the
  -- previous averaging's change is applied (p += avg - snapshot), then the snapshot is averaged over
  -- the ranks at once by a blocking all-reduce, its change kept for the next averaging (or, after the
  -- last step, applied at once, as the end of a run completes a pending averaging)
  local step, n, pending = p.optimizer.step, 0, nil
  p.optimizer.step = function(self, ...)
    step(self, ...)
    n = n + 1
    if n % delayed ~= 0 then return end
    local ps = p.model:named_parameters()
    local function apply()
      for i, e in ipairs(ps) do
        e.param:add_(pending[i])
        pending[i]:free()
      end
    end
    if pending then apply() end
    pending = {}
    for i, e in ipairs(ps) do -- kept beyond the step's scope (nv.unscope) until applied
      local snap = e.param:clone()
      local avg = dist.all_reduce(snap:clone(), "avg")
      pending[i] = nv.unscope(avg - snap)
    end
    if n == c.steps then
      apply()
      pending = nil
    end
  end
elseif extra.avg_ref then -- the reference for sync=shadow: after every optimizer step, each parameter averaged
  local step = p.optimizer.step -- over the ranks by a blocking all-reduce of its own
  p.optimizer.step = function(self, ...)
    step(self, ...)
    for _, e in ipairs(p.model:named_parameters()) do
      dist.all_reduce(e.param, "avg")
      if extra.avg_ref == "moments" then
        dist.all_reduce(self.m[e.name], "avg")
        dist.all_reduce(self.v[e.name], "avg")
      end
    end
  end
end
if extra.fault then
  local base = p.schedule
  p.schedule = function(step)
    if step == 3 and p.rank == 1 then
      io.stdout:flush()
      if extra.fault == "kill" then os.execute("kill -9 $PPID")
      elseif extra.fault == "exit" then os.exit(3)
      elseif extra.fault == "hang" then while true do end end
    end
    return base(step)
  end
end
local s = train.run(c, p)
-- are the ranks' weights the same, bit for bit?
local same = true
if dist.world_size() > 1 then
  for _, e in ipairs(p.model:named_parameters()) do
    local t = e.param:clone()
    dist.broadcast(t, 0)
    if t:bytes() ~= e.param:bytes() then same = false end
  end
end
print(string.format("rank %d: steps %d, weights same as rank 0: %s", p.rank, s.steps, tostring(same)))
]=]

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=32", "heads=4", "kv_heads=2", "ffn=64",
  "seq=16", "steps=6", "warmup=2", "lr=3e-3", "min_lr=3e-4", "schedule=wsd", "decay=0.5", "eval_every=3",
  "eval_batches=2", "log_every=1", "sample_tokens=0", "plot=false", "quiet=true", "keep=0", "seed=7"}

local function train_args(name, extra)
  local a = {}
  for _, x in ipairs(BASE) do a[#a + 1] = x end
  a[#a + 1] = "out=" .. ROOT .. "/" .. name
  for _, x in ipairs(extra or {}) do a[#a + 1] = x end
  return a
end

local SCRIPT = ROOT .. "/train.lua"
T.write_file(SCRIPT, TRAIN)
-- train.main, as an experiment script calls it (it starts dist itself)
T.write_file(ROOT .. "/main.lua", 'require("nvlua.train").main({}, arg)\n')

-- 2 ranks: the run must succeed and leave both ranks' weights identical, unless may_differ
-- (overlapped sync=shadow: each rank applies the average as a change to its own weights)
local function run2(name, extra, env, may_differ)
  local out, code = mpirun(2, SCRIPT, train_args(name, extra), env)
  T.eq(code, 0, name .. ": mpirun exit status; output:\n" .. out)
  local n = 0
  for r, same in out:gmatch("rank (%d): steps %d+, weights same as rank 0: (%a+)") do
    n = n + 1
    if not may_differ then T.eq(same, "true", name .. ": rank " .. r .. "'s weights equal rank 0's") end
  end
  T.eq(n, 2, name .. ": both ranks finished:\n" .. out)
  return ROOT .. "/" .. name
end

local function run1(name, extra)
  local out, code = nvlua(SCRIPT, train_args(name, extra))
  T.eq(code, 0, name .. ": exit status; output:\n" .. out)
  return ROOT .. "/" .. name
end

local function metrics(dir)
  local steps, evals = {}, {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.loss then steps[r.step] = r elseif r.val_loss then evals[r.step] = r.val_loss end
  end
  return steps, evals
end

local function weights(dir)
  local t = st.load(ckpt.latest(dir) .. "/model/model.safetensors")
  local out = {}
  for k, v in pairs(t) do out[k] = v:reshape(-1):totable() end
  return out
end

-- max |a - b| over every weight
local function weight_diff(da, db, nparams)
  local wa, wb = weights(da), weights(db)
  local m, n = 0, 0
  for k, a in pairs(wa) do
    n = n + 1
    local b = assert(wb[k], "missing " .. k)
    for i = 1, #a do m = math.max(m, math.abs(a[i] - b[i])) end
  end
  T.eq(n, nparams or 21, "parameters compared")
  return m
end

-- the largest difference between two runs' final AdamW moments (their trainer.safetensors)
local function moment_diff(da, db)
  local ta = st.load(ckpt.latest(da) .. "/trainer.safetensors")
  local tb = st.load(ckpt.latest(db) .. "/trainer.safetensors")
  local m, n = 0, 0
  for k, a in pairs(ta) do
    n = n + 1
    local x, y = a:reshape(-1):totable(), assert(tb[k], "missing " .. k):reshape(-1):totable()
    for i = 1, #x do m = math.max(m, math.abs(x[i] - y[i])) end
  end
  T.eq(n, 42, "moments compared (m and v of 21 parameters)")
  return m
end

-- tolerances (see the header): early = the losses of steps 1-2, loss = every step's (and val)
-- loss, grad = the grad norm, relative, weight = every final weight; absolute unless said
local TOL = {nvfp4 = {early = 1e-6, loss = 1e-6, grad = 1e-6, weight = 1e-6},
  bf16 = {early = 1e-6, loss = 5e-4, grad = 2e-3, weight = 1e-3}}

local function equivalent(one, two, what, tol)
  local s1, e1 = metrics(one)
  local s2, e2 = metrics(two)
  for step = 1, 6 do
    T.ok(s1[step] and s2[step], what .. ": step " .. step .. " logged")
    T.near(s2[step].loss, s1[step].loss, step <= 2 and tol.early or tol.loss, what .. ": loss of step " .. step)
    T.near(s2[step].grad_norm, s1[step].grad_norm, tol.grad * s1[step].grad_norm, what .. ": grad norm of step " .. step)
    T.eq(s2[step].lr, s1[step].lr)
  end
  for _, step in ipairs({3, 6}) do T.near(e2[step], e1[step], tol.loss, what .. ": val loss at " .. step) end
  local d = weight_diff(one, two)
  T.ok(d <= tol.weight, string.format("%s: weights differ by %.3g (tolerance %g)", what, d, tol.weight))
  return d
end

local function same_weights(da, db, what)
  local wa, wb = weights(da), weights(db)
  for k, a in pairs(wa) do
    local b, same = wb[k], true
    for i = 1, #a do if a[i] ~= b[i] then same = false; break end end
    T.ok(same, what .. ": weight " .. k .. " bit for bit")
  end
end

for _, recipe in ipairs({"bf16", "nvfp4"}) do
  T.case("2 ranks x batch 2 = 1 rank x batch 4 under " .. recipe .. ", with and without ZeRO-1", function()
    need_mpi()
    -- nvfp4 with f32 activations: equal up to fp32 summation order (bf16 activations would round
    -- those last-bit differences to a bf16 ulp now and then; the bf16 recipe's run has them, with
    -- its looser tolerances)
    local act = recipe == "nvfp4" and "act_dtype=f32" or "act_dtype=recipe"
    local one = run1(recipe .. "/one", {"recipe=" .. recipe, "batch=4", act})
    local two = run2(recipe .. "/two", {"recipe=" .. recipe, "batch=2", "dist=true", act})
    equivalent(one, two, recipe .. " 2 ranks", TOL[recipe])
    local zero = run2(recipe .. "/zero", {"recipe=" .. recipe, "batch=2", "dist=true", "shard_optimizer=true", act})
    equivalent(one, zero, recipe .. " 2 ranks ZeRO-1", TOL[recipe])
    equivalent(two, zero, recipe .. " ZeRO-1 vs plain 2 ranks", TOL[recipe])
    -- ZeRO-1 checkpoints hold the whole moments, in AdamW's layout
    local a = st.load(ckpt.latest(two) .. "/trainer.safetensors")
    local b = st.load(ckpt.latest(zero) .. "/trainer.safetensors")
    local n = 0
    for k, t in pairs(a) do
      n = n + 1
      T.ok(b[k] and b[k]:numel() == t:numel(), "ZeRO checkpoint has " .. k)
    end
    T.eq(n, 42, "m and v of 21 parameters")
  end)
end

T.case("bucketed all-reduce (each stage started as the last micro-batch's backward completes it) = one all-reduce after it", function()
  need_mpi()
  -- 2 ranks, 2 micro-batches (the hook runs in the last one only): sum of two values, the same in any
  -- order, so bit for bit; with and without tied embeddings (a tied LM head's gradient is complete
  -- only with the embedding's)
  for _, tie in ipairs({"tie=false", "tie=true"}) do
    local common = {"recipe=nvfp4", "batch=2", "grad_accum=2", "dist=true", "eval_every=0", tie}
    local args = {table.unpack(common)}
    args[#args + 1] = "bucket_grads=false"
    local whole = run2("bucket/whole-" .. tie, args)
    local bucketed = run2("bucket/bucketed-" .. tie, common)
    same_weights(whole, bucketed, "bucketed vs one all-reduce, " .. tie)
  end
end)

T.case("ZeRO-1 on 3 ranks (a parameter space not divisible by 3: padded shards), tied embeddings, = plain 3 ranks", function()
  need_mpi()
  local function run3(name, extra)
    local out, code = mpirun(3, SCRIPT, train_args(name, extra))
    T.eq(code, 0, name .. ": mpirun exit status; output:\n" .. out)
    local n = 0
    for same in out:gmatch("weights same as rank 0: (%a+)") do n = n + 1; T.eq(same, "true") end
    T.eq(n, 3, name .. ": every rank finished:\n" .. out)
    return ROOT .. "/" .. name
  end
  local common = {"recipe=nvfp4", "batch=2", "dist=true", "tie=true", "eval_every=0", "act_dtype=f32"}
  local plain = run3("three/plain", common)
  local args = {table.unpack(common)}
  args[#args + 1] = "shard_optimizer=true"
  local zero = run3("three/zero", args)
  local s0, s1 = metrics(plain), metrics(zero)
  for step = 1, 6 do
    T.near(s1[step].loss, s0[step].loss, TOL.nvfp4.loss, "loss of step " .. step)
    T.near(s1[step].grad_norm, s0[step].grad_norm, 1e-8 * s0[step].grad_norm, "grad norm of step " .. step)
  end
  local d = weight_diff(plain, zero, 20)
  T.ok(d <= TOL.nvfp4.weight, string.format("weights differ by %.3g (tolerance %g)", d, TOL.nvfp4.weight))
end)

T.case("controls: without SR offsets or without the shared amax, nvfp4 runs differ by far more than the tolerance", function()
  need_mpi()
  local one = ROOT .. "/nvfp4/one"
  if not lfs.attributes(one .. "/metrics.jsonl") then
    one = run1("nvfp4/one", {"recipe=nvfp4", "batch=4", "act_dtype=f32"})
  end
  for _, control in ipairs({"noshard", "noreduce"}) do
    local two = run2("control/" .. control, {"recipe=nvfp4", "batch=2", "dist=true", "control=" .. control,
      "act_dtype=f32"})
    local d = weight_diff(one, two)
    T.ok(d > 100 * TOL.nvfp4.weight, string.format("%s: weights differ by %.3g, more than 100 x %g", control, d,
      TOL.nvfp4.weight))
  end
end)

T.case("resume: 2 ranks, nvfp4 + ZeRO-1, 3 steps + resume=auto 3 = 6 straight, bit for bit", function()
  need_mpi()
  local extra = {"recipe=nvfp4", "batch=2", "dist=true", "shard_optimizer=true", "act_dtype=f32"} -- as nvfp4/zero
  local straight = ROOT .. "/nvfp4/zero"
  if not lfs.attributes(straight .. "/metrics.jsonl") then straight = run2("nvfp4/zero", extra) end
  local args = {table.unpack(extra)}
  args[#args + 1] = "stop_at=3"
  local dir = run2("resume", args)
  T.eq(ckpt.latest(dir), dir .. "/checkpoints/step-000003")
  args = {table.unpack(extra)}
  args[#args + 1] = "resume=auto"
  run2("resume", args)
  local s0, e0 = metrics(straight)
  local s1, e1 = metrics(dir)
  for step = 1, 6 do
    for _, k in ipairs({"loss", "grad_norm", "lr"}) do
      T.eq(string.pack("<d", s1[step][k]), string.pack("<d", s0[step][k]), "step " .. step .. " " .. k)
    end
  end
  T.eq(e1, e0, "val losses")
  same_weights(straight, dir, "resumed")
end)

-- ---- faults ------------------------------------------------------------------------------------------

-- rank 1 fails at step 3 (checkpoints every 2 steps): mpirun must end non-zero, quickly, saying
-- which rank; checkpoint step 2 must be complete and load
local function fault_case(fault, expect, env)
  local dir = ROOT .. "/fault-" .. fault
  local out, code, secs = mpirun(2, SCRIPT, train_args("fault-" .. fault, {"recipe=bf16", "batch=2", "dist=true",
    "ckpt_every=2", "eval_every=0", "fault=" .. fault}), env)
  T.ok(code ~= 0, fault .. ": mpirun must exit non-zero; output:\n" .. out)
  T.ok(code ~= 124, fault .. ": ended by the test's own 120 s guard, not by nvlua / Open MPI:\n" .. out)
  T.ok(secs < 60, string.format("%s: the job ended after %.1f s", fault, secs))
  T.ok(out:find(expect) ~= nil, fault .. ": the output names the rank (" .. expect .. "):\n" .. out)
  T.eq(out:find("weights same as rank 0"), nil, fault .. ": no rank finished")
  T.eq(ckpt.latest(dir), dir .. "/checkpoints/step-000002", fault .. ": the last complete checkpoint")
  local latest = ckpt.latest(dir)
  T.eq(lfs.attributes(latest .. ".partial"), nil, fault .. ": no half-written checkpoint")
  local model = ckpt.from_pretrained(latest) -- config.json + model.safetensors load
  T.eq(model:num_parameters(), 34976)
  local tr = cjson.decode(assert(T.read_file(latest .. "/trainer.json")))
  T.eq(math.tointeger(tr.step), 2)
  local n = 0
  for _ in pairs(st.load(latest .. "/trainer.safetensors")) do n = n + 1 end
  T.eq(n, 42, fault .. ": the AdamW moments load")
  return secs
end

T.case("a rank killed mid-run (SIGKILL at step 3): the job ends non-zero naming rank 1; step 2's checkpoint is intact", function()
  need_mpi()
  fault_case("kill", "process rank 1")
end)

T.case("a rank that exits (os.exit(3) at step 3) ends the job with a message naming it", function()
  need_mpi()
  fault_case("exit", "rank 1 of 2 exits with status 3")
end)

T.case("a rank that hangs: the others time out (NVLUA_DIST_TIMEOUT=2) with a message, the job ends non-zero", function()
  need_mpi()
  local secs = fault_case("hang", "rank 0 of 2: [%w_ ]+ %b() did not complete within %d+ s", "NVLUA_DIST_TIMEOUT=2")
  T.ok(secs < 30, "within the timeout plus start-up: " .. secs)
end)

T.case("sync=shadow: k=1 without overlap = synchronous parameter averaging, bit for bit; overlapped k=3 = its delayed reference, bit for bit", function()
  need_mpi()
  -- shadow (k = 1, applied at once) against each rank stepping on its own gradients and then averaging
  -- every parameter with a blocking all-reduce (sync=shadow with an averaging that never comes, plus
  -- the reference's own averaging in the optimizer step)
  local a = run2("shadow_k1", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow", "shadow_every=1",
    "shadow_overlap=false"})
  local b = run2("shadow_ref", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow", "shadow_every=1000000", "avg_ref=1"})
  T.eq(weight_diff(a, b), 0, "the final weights, bit for bit")
  local ma, mb = metrics(a), metrics(b)
  for s = 1, 6 do T.eq(ma[s].loss, mb[s].loss, "step " .. s .. "'s loss") end
  -- without averaging the ranks drift apart: the comparison sees the averaging
  local out = mpirun(2, SCRIPT, train_args("shadow_none", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow",
    "shadow_every=1000000"}))
  T.ok(out:find("rank 1: steps 6, weights same as rank 0: false", 1, true), "no averaging: the ranks differ:\n" .. out)
  -- overlapped, every 3 steps (the averaging started after step 3 is applied as a change after step 6,
  -- the one started then at the end of the run) = the delayed reference, bit for bit (rank 0's final
  -- weights, every logged loss); and it trains
  local a3 = run2("shadow_k3", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow", "shadow_every=3"}, nil, true)
  local b3 = run2("shadow_k3_ref", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow", "shadow_every=1000000",
    "avg_ref=delayed:3"}, nil, true)
  T.eq(weight_diff(a3, b3), 0, "overlapped k=3: the final weights, bit for bit")
  local m3, r3 = metrics(a3), metrics(b3)
  for s = 1, 6 do T.eq(m3[s].loss, r3[s].loss, "overlapped k=3: step " .. s .. "'s loss") end
  T.ok(weight_diff(a3, a) > 0, "overlapped differs from averaging at once (the comparison can see the delay)")
  T.ok(m3[6].loss < m3[1].loss, "the loss goes down")
  for _, st_ in ipairs({3, 6}) do T.ok(m3[st_].sync_wait_ms <= m3[st_].sync_ms, "sync_wait_ms is part of sync_ms") end
  T.eq({m3[1].sync_wait_ms, m3[2].sync_wait_ms, m3[4].sync_wait_ms, m3[5].sync_wait_ms}, {0, 0, 0, 0},
    "no waiting on the ranks at a step without averaging")
  -- through train.main (as experiments run): MPI started with MPI_THREAD_MULTIPLE, the thread used
  local outm = mpirun(2, ROOT .. "/main.lua", train_args("shadow_main", {"recipe=bf16", "batch=2", "dist=true",
    "sync=shadow", "shadow_every=3", "quiet=false"}))
  T.ok(outm:find("sync=shadow: parameters averaged every 3 steps, by an all-reduce in a thread of its own", 1, true),
    "train.main: the averaging thread:\n" .. outm)
  T.raises(function() train.check(config.parse(train.defaults, {"sync=shadow", "shard_optimizer=true"})) end,
    "sync=shadow averages whole parameters")
  -- shadow_moments: the AdamW moments averaged with the parameters; k=1 without overlap = the blocking
  -- average of parameters, m and v after each step, bit for bit (rank 0's final checkpoint)
  local am = run2("shadow_k1m", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow", "shadow_every=1",
    "shadow_overlap=false", "shadow_moments=true"})
  local bm = run2("shadow_refm", {"recipe=bf16", "batch=2", "dist=true", "sync=shadow", "shadow_every=1000000",
    "avg_ref=moments"})
  T.eq(weight_diff(am, bm), 0, "shadow_moments: the final weights, bit for bit")
  T.eq(moment_diff(am, bm), 0, "shadow_moments: the final moments, bit for bit")
  T.ok(moment_diff(a, bm) > 0, "without shadow_moments each rank keeps its own moments")
  T.raises(function() train.check(config.parse(train.defaults, {"shadow_moments=true"})) end,
    "shadow_moments=true averages the optimizer moments under sync=shadow")
end)

T.case("cleanup: the scratch directory is removed", function()
  ckpt.rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
