-- tests/test_signals.lua: a stop signal (SIGTERM, SIGUSR1, SIGINT) to a training run finishes the
-- step, writes a checkpoint of it and exits with status 75 (nvlua.signal.EXIT_INTERRUPTED), on every
-- rank of a data-parallel run at the same step; resume=auto then continues bit for bit. A tiny run
-- (1 layer, hidden 32, seq 16, batch 2, 2 micro-batches per step, bf16, 6 steps, an evaluation at
-- step 3) runs as a child process (build/nvlua on a script written here), beside an uninterrupted
-- reference run that checkpoints every step:
--   * one process: each signal raised by the run itself in the middle of step 3 (between its two
--     micro-batches; SIGTERM twice, as `timeout` sends it: a repeat changes nothing); exit status
--     75, the message that names the signal and suggests resume=auto; the newest checkpoint is step
--     3's and equals the reference's byte for byte (weights, AdamW moments; loader, RNG and
--     optimizer counters); then that resume=auto ends with the reference's last loss (17 digits),
--     final checkpoint and metrics.jsonl. SIGUSR1 with ckpt_background=true (step 2 saved by the
--     writer thread, which the stop waits for): that checkpoint is complete and the reference's too.
--   * a second Ctrl-C (SIGINT) in the same step stops at once: exit status 1, a message saying so, no
--     checkpoint of that step (the newest is the periodic one of step 2, intact); resume=auto from it
--     ends like the reference.
--   * a signal in the last step (one process, and rank 1 of 2): the run is complete; its final
--     checkpoint is the reference's, exit status 75, the message says so.
--   * 2 ranks under mpirun: rank 1 alone raises SIGTERM mid-step 3 (rank 0 SIGUSR1, in a second
--     run): both ranks stop after step 3, mpirun exits 75, checkpoint 3 equals the 2-rank reference's;
--     resume=auto on 2 ranks ends like it, the ranks' weights identical.
--   * signals from outside, as `timeout`, Slurm and mpirun send them, once step 2 is logged: SIGTERM
--     to the process (through `timeout`, which passes it on); SIGUSR1 to mpirun (which forwards it to
--     every rank); SIGTERM to rank 1's process alone. The stop step N depends on timing, so the checks
--     are that the exit status is 75, every rank stopped at the same N, and checkpoint N equals the
--     reference's.
-- mpirun cases skip without mpirun or MPI. Every run writes under one scratch directory, removed by
-- the last case.
local T = require "nvlua.test"
local ckpt = require "nvlua.checkpoint"
local config = require "nvlua.config"
local dist = require "nvlua.dist"
local cjson = require "cjson"
local lfs = require "lfs"

local ROOT = T.tmpdir()
local NVLUA = T.nvlua()

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

local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 4242, lines = 300, prefix = function(i) return i .. " " end,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in", "darkness"}})

-- The child's training script: key=value config, plus
--   sig=SIGTERM|SIGUSR1|SIGINT, sig_at=N, sig_rank=R (default: every rank): the run raises sig on
--     itself in step N, before its second micro-batch (twice=true: two signals, then);
--   slow=S: each step first sleeps S seconds (a child `sleep`), so a signal from outside lands in a
--     step; pid=true: each rank writes "<pid> <parent pid>" to <out>/rank<R>.pid.
-- Prints per rank: its final step, whether it was interrupted, the last loss (17 digits) and whether
-- its weights equal rank 0's.
local SCRIPT = ROOT .. "/train.lua"
T.write_file(SCRIPT, [=[
local train = require "nvlua.train"
local config = require "nvlua.config"
local dist = require "nvlua.dist"
local signal = require "nvlua.signal"
local args, x = {}, {}
for _, a in ipairs(arg) do
  local k, v = a:match("^([%w_]+)=(.*)$")
  if k == "sig" or k == "sig_at" or k == "sig_rank" or k == "twice" or k == "slow" or k == "pid" then x[k] = v
  else args[#args + 1] = a end
end
local c = config.parse(train.defaults, args)
local p = train.build(c)
p.peak = 1e9
local rank = p.rank or 0
if x.pid then
  local stat = assert(io.open("/proc/self/stat")):read("l")
  local pid, ppid = stat:match("^(%d+) %b() %S+ (%d+)")
  require("nvlua.data").mkdir_p(c.out)
  local f = assert(io.open(string.format("%s/rank%d.pid", c.out, rank), "w"))
  f:write(pid, " ", ppid, "\n")
  f:close()
end
if x.slow then
  local base = p.schedule
  p.schedule = function(step)
    io.popen("sleep " .. x.slow):close()
    return base(step)
  end
end
if x.sig then
  local fb, calls = p.model.forward_backward, 0
  p.model.forward_backward = function(self, ...)
    if self.step == tonumber(x.sig_at) and (not x.sig_rank or tonumber(x.sig_rank) == rank) then
      calls = calls + 1
      if calls == 2 then
        signal.raise(x.sig)
        if x.twice then signal.raise(x.sig) end
      end
    end
    return fb(self, ...)
  end
end
local s = train.run(c, p)
local same = true
if dist.world_size() > 1 then
  for _, e in ipairs(p.model:named_parameters()) do
    local t = e.param:clone()
    dist.broadcast(t, 0)
    if t:bytes() ~= e.param:bytes() then same = false end
  end
end
print(string.format("rank %d: steps %d, interrupted %s, last loss %s, weights same as rank 0: %s", rank, s.steps,
  tostring(s.interrupted), s.last_loss and string.format("%.17g", s.last_loss) or "none", tostring(same)))
]=])

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=1", "hidden=32", "heads=4", "kv_heads=2",
  "ffn=64", "seq=16", "batch=2", "grad_accum=2", "steps=6", "warmup=2", "lr=3e-3", "min_lr=3e-4", "eval_every=3",
  "eval_batches=2", "log_every=3", "sample_tokens=0", "plot=false", "seed=7", "recipe=bf16", "keep=0"}

local function args_of(name, extra)
  local a = {}
  for _, x in ipairs(BASE) do a[#a + 1] = T.shq(x) end
  a[#a + 1] = T.shq("out=" .. ROOT .. "/" .. name)
  for _, x in ipairs(extra or {}) do a[#a + 1] = T.shq(x) end
  return table.concat(a, " ")
end

-- a shell command's output (stdout and stderr) and the exit status it echoes last ("exit=N")
local function sh(cmd)
  local p = assert(io.popen(cmd .. " 2>&1"))
  local out = p:read("a")
  p:close()
  return out, tonumber(out:match("exit=(%d+)%s*$"))
end

-- the launcher of n ranks (n = 0: none), as a command prefix
local function launcher(n)
  if n == 0 then return "timeout 60 " .. T.shq(NVLUA) end
  return string.format("timeout 120 %s --allow-run-as-root --oversubscribe --bind-to none -np %d %s", T.shq(MPIRUN), n,
    T.shq(NVLUA))
end

-- Run the script on n ranks (0: a plain process). -> output, exit status, run directory
local function child(n, name, extra)
  local out, code = sh(string.format("env OMP_NUM_THREADS=1 %s %s %s 2>&1; echo \"exit=$?\"", launcher(n), T.shq(SCRIPT),
    args_of(name, extra)))
  return out, code, ROOT .. "/" .. name
end

-- the ranks' report lines -> {[rank] = {steps =, interrupted =, loss =, same =}}
local function reports(out)
  local r = {}
  for rank, steps, int, loss, same in out:gmatch("rank (%d+): steps (%d+), interrupted (%a+), last loss (%S+), " ..
    "weights same as rank 0: (%a+)") do
    r[tonumber(rank)] = {steps = tonumber(steps), interrupted = int == "true", loss = loss, same = same == "true"}
  end
  return r
end

local function ckpt_dir(dir, step) return string.format("%s/checkpoints/step-%06d", dir, step) end
local function step_of(dir) return math.tointeger(tonumber((dir or ""):match("step%-(%d+)$"))) end

-- metrics.jsonl without the wall-clock fields, as text per record
local TIMING = {ms = true, tokens_per_s = true, mfu = true, sync_ms = true, sync_wait_ms = true}
local function metrics(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    for k in pairs(TIMING) do r[k] = nil end
    out[#out + 1] = config.encode(r)
  end
  return out
end

-- what a checkpoint holds of the training state: the weights and AdamW moments (bytes), and
-- trainer.json's counters, the loader's cursor and the RNG states
local function state_of(dir)
  local tr = cjson.decode(assert(T.read_file(dir .. "/trainer.json")))
  return {model = T.read_file(dir .. "/model/model.safetensors"), moments = T.read_file(dir .. "/trainer.safetensors"),
    json = config.encode({step = tr.step, optimizer_step = tr.optimizer_step, loader = tr.loader,
      default_generator = tr.default_generator, recipe = tr.recipe, skipped = tr.skipped_steps,
      bad = tr.bad_steps_in_row})}
end

-- The uninterrupted reference on n ranks (a checkpoint every step), once. -> {dir, loss, metrics}
local REFS = {}
local function reference(n)
  if REFS[n] then return REFS[n] end
  local out, code, dir = child(n, "ref" .. n, {"ckpt_every=1", n > 0 and "dist=true" or nil})
  T.eq(code, 0, "reference: exit status; output:\n" .. out)
  local rep = reports(out)
  T.ok(rep[0] and rep[0].steps == 6 and rep[0].loss ~= "none", "reference: 6 steps:\n" .. out)
  REFS[n] = {dir = dir, loss = rep[0].loss, metrics = metrics(dir)}
  T.ok(state_of(ckpt_dir(dir, 2)).model ~= state_of(ckpt_dir(dir, 3)).model, "the checkpoints differ from step to step")
  return REFS[n]
end

-- ckpt (a checkpoint directory) is complete and holds the reference's state of its step
local function like_reference(ref, dir, what)
  local step = step_of(dir)
  T.ok(step and ckpt.complete(dir), what .. ": a complete checkpoint: " .. tostring(dir))
  local got, want = state_of(dir), state_of(ckpt_dir(ref.dir, step))
  T.ok(got.model == want.model, what .. ": the weights of step " .. step .. " as in the reference, byte for byte")
  T.ok(got.moments == want.moments, what .. ": the AdamW moments of step " .. step .. " as in the reference")
  T.eq(got.json, want.json, what .. ": trainer.json's counters, loader and RNG states")
end

-- resume=auto on n ranks: the run ends like the reference (last loss, final checkpoint, metrics)
local function resume_like_reference(n, name, extra, what)
  local args = {"resume=auto"}
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  if n > 0 then args[#args + 1] = "dist=true" end
  local out, code, dir = child(n, name, args)
  T.eq(code, 0, what .. ", resumed: exit status; output:\n" .. out)
  local ref, rep = reference(n), reports(out)
  for r = 0, math.max(n, 1) - 1 do
    T.ok(rep[r], what .. ", resumed: rank " .. r .. " reported:\n" .. out)
    T.eq({rep[r].steps, rep[r].interrupted, rep[r].loss, rep[r].same}, {6, false, ref.loss, true},
      what .. ", resumed: rank " .. r .. "'s steps, last loss (17 digits), weights")
  end
  T.eq(step_of(ckpt.latest(dir)), 6, what .. ", resumed: the final checkpoint")
  like_reference(ref, ckpt.latest(dir), what .. ", resumed")
  T.eq(metrics(dir), ref.metrics, what .. ", resumed: metrics.jsonl as the reference's")
end

-- An interrupted run's output: exit status 75, every rank stopped after step `step`, rank 0's message.
local function interrupted(out, code, n, step, sig, dir, what)
  T.eq(code, 75, what .. ": exit status 75 (EXIT_INTERRUPTED); output:\n" .. out)
  local rep = reports(out)
  for r = 0, math.max(n, 1) - 1 do
    T.ok(rep[r], what .. ": rank " .. r .. " reported:\n" .. out)
    T.eq({rep[r].steps, rep[r].interrupted, rep[r].same}, {step, true, true}, what .. ": rank " .. r .. " stopped after step " ..
      step .. ", its weights rank 0's")
  end
  T.ok(out:find(string.format("interrupted (%s) at step %d: checkpoint saved in %s (resume with resume=auto)", sig, step,
    ckpt_dir(dir, step)), 1, true), what .. ": the message:\n" .. out)
  T.eq(ckpt.latest(dir), ckpt_dir(dir, step), what .. ": the newest checkpoint is the stop step's")
  T.eq(lfs.attributes(ckpt_dir(dir, step) .. ".partial"), nil, what .. ": no half-written checkpoint")
end

-- ---- one process ---------------------------------------------------------------------------------

for _, v in ipairs({{"SIGTERM", {}, true}, {"SIGUSR1", {"ckpt_background=true", "ckpt_every=2"}}, {"SIGINT", {}}}) do
  local sig, extra, twice = v[1], v[2], v[3]
  T.case(sig .. (twice and " (twice)" or "") .. " mid-step: the step finishes, its checkpoint is written, exit 75; " ..
    "resume=auto continues bit for bit" .. (#extra > 0 and " (" .. table.concat(extra, " ") .. ")" or ""), function()
    local ref = reference(0)
    local name = "one-" .. sig
    local args = {"sig=" .. sig, "sig_at=3", twice and "twice=true" or nil}
    for _, a in ipairs(extra) do args[#args + 1] = a end
    local out, code, dir = child(0, name, args)
    interrupted(out, code, 0, 3, sig, dir, sig)
    like_reference(ref, ckpt_dir(dir, 3), sig)
    if #extra > 0 then like_reference(ref, ckpt_dir(dir, 2), sig .. ": the background save of step 2") end
    resume_like_reference(0, name, extra, sig)
  end)
end

T.case("a second Ctrl-C in the step stops at once: exit 1, nothing of the step saved; resume=auto from the last checkpoint", function()
  local ref = reference(0)
  local out, code, dir = child(0, "twice", {"sig=SIGINT", "sig_at=3", "twice=true", "ckpt_every=2"})
  T.eq(code, 1, "exit status; output:\n" .. out)
  T.ok(out:find("interrupted! a second Ctrl-C stopped the run at once, during step 3: nothing of that step is saved; " ..
    "the newest complete checkpoint is " .. ckpt_dir(dir, 2) .. " (resume=auto continues from it)", 1, true), out)
  T.eq(out:find("rank 0: steps", 1, true), nil, "the script did not go on")
  T.eq(ckpt.latest(dir), ckpt_dir(dir, 2))
  T.eq(lfs.attributes(ckpt_dir(dir, 3)), nil, "no checkpoint of step 3")
  like_reference(ref, ckpt_dir(dir, 2), "twice")
  resume_like_reference(0, "twice", {"ckpt_every=2"}, "twice")
end)

-- ---- 2 ranks ----------------------------------------------------------------------------------------

for _, v in ipairs({{"SIGTERM", 1}, {"SIGUSR1", 0}}) do
  local sig, rank = v[1], v[2]
  T.case(string.format("2 ranks, %s to rank %d alone mid-step: both stop after the same step, checkpoint, exit 75; " ..
    "resume=auto bit for bit", sig, rank), function()
    need_mpi()
    local ref = reference(2)
    local name = "two-" .. sig
    local out, code, dir = child(2, name, {"dist=true", "sig=" .. sig, "sig_at=3", "sig_rank=" .. rank})
    interrupted(out, code, 2, 3, rank == 0 and sig or "a signal on another rank", dir, "2 ranks, " .. sig)
    like_reference(ref, ckpt_dir(dir, 3), "2 ranks, " .. sig)
    resume_like_reference(2, name, {}, "2 ranks, " .. sig)
  end)
end

T.case("a signal in the last step (one process; rank 1 of 2): the run is complete, its final checkpoint written, exit 75",
  function()
  for _, n in ipairs({0, 2}) do
    if n > 0 and (not MPIRUN or not dist.info().mpi) then break end
    local what = n == 0 and "one process" or "2 ranks"
    local ref = reference(n)
    local name = "last-" .. n
    local out, code, dir = child(n, name, {"sig=SIGTERM", "sig_at=6", "sig_rank=" .. (n > 0 and 1 or 0),
      n > 0 and "dist=true" or nil})
    T.eq(code, 75, what .. ": exit status; output:\n" .. out)
    local rep = reports(out)
    for r = 0, math.max(n, 1) - 1 do
      T.eq({rep[r] and rep[r].steps, rep[r] and rep[r].interrupted}, {6, true}, what .. ": rank " .. r .. ":\n" .. out)
    end
    T.ok(out:find(string.format("stopped (%s) after the last step, 6: the run is complete, checkpoint %s",
      n == 0 and "SIGTERM" or "a signal on another rank", ckpt_dir(dir, 6)), 1, true), what .. ": the message:\n" .. out)
    like_reference(ref, ckpt_dir(dir, 6), what)
    T.eq(metrics(dir), ref.metrics, what .. ": metrics.jsonl")
  end
end)

-- ---- signals from outside ---------------------------------------------------------------------------

-- Start the script on n ranks (0: one process, under `timeout`) in the background with slow steps,
-- wait until step 2 is logged, send sig to `to` ("self": the process, through timeout; "mpirun";
-- "rank1"), wait. -> output, exit status, run directory
local function from_outside(n, name, sig, to)
  local dir = ROOT .. "/" .. name
  local extra = {"slow=0.2", "pid=true", "steps=6"}
  if n > 0 then extra[#extra + 1] = "dist=true" end
  local target = to == "self" and "$pid" or to == "mpirun" and "$(cut -d' ' -f2 " .. T.shq(dir .. "/rank0.pid") .. ")" or
    "$(cut -d' ' -f1 " .. T.shq(dir .. "/rank1.pid") .. ")"
  local script = table.concat({
    string.format("env OMP_NUM_THREADS=1 %s %s %s 2>&1 & pid=$!", launcher(n), T.shq(SCRIPT), args_of(name, extra)),
    -- until step 2's record is in metrics.jsonl (at most 60 s)
    string.format("i=0; while [ $i -lt 1200 ] && ! grep -qs '\"step\":2[,}]' %s; do sleep 0.05; i=$((i+1)); done",
      T.shq(dir .. "/metrics.jsonl")),
    string.format("kill -%s %s", sig:gsub("^SIG", ""), target),
    "wait $pid; echo \"exit=$?\""}, "\n")
  local out, code = sh(script .. "\n")
  return out, code, dir
end

local function outside_case(n, sig, to, what)
  T.case("from outside: " .. what .. ": exit 75, every rank stopped after the same step, its checkpoint the reference's",
    function()
      if n > 0 then need_mpi() end
      local ref = reference(n)
      local name = "outside-" .. to .. "-" .. sig
      local out, code, dir = from_outside(n, name, sig, to)
      local rep = reports(out)
      local step = rep[0] and rep[0].steps
      T.ok(step and step >= 2 and step <= 6, what .. ": rank 0 reported a step:\n" .. out)
      T.eq(code, 75, what .. ": exit status; output:\n" .. out)
      for r = 0, math.max(n, 1) - 1 do
        T.ok(rep[r], what .. ": rank " .. r .. " reported:\n" .. out)
        T.eq({rep[r].steps, rep[r].interrupted, rep[r].same}, {step, true, true}, what .. ": rank " .. r)
      end
      T.eq(ckpt.latest(dir), ckpt_dir(dir, step), what .. ": the newest checkpoint is the stop step's")
      like_reference(ref, ckpt_dir(dir, step), what)
    end)
end

outside_case(0, "SIGTERM", "self", "SIGTERM to the process (timeout passes it on)")
outside_case(2, "SIGUSR1", "mpirun", "SIGUSR1 to mpirun (forwarded to every rank)")
outside_case(2, "SIGTERM", "rank1", "SIGTERM to rank 1's process alone")

T.case("defer(true) starts with no stop pending (one a failed run left is forgotten); defer(false) gives SIGTERM " ..
  "back the action it had (an inherited SIG_IGN stays ignored)", function()
  local script = T.write_file(ROOT .. "/defer.lua", [[
local signal = require "nvlua.signal"
signal.defer(true)
signal.raise("SIGUSR1")
io.write("pending ", tostring(signal.pending()), "\n")
signal.defer(true) -- a later run: what the failed one left is not its stop
io.write("again ", tostring(signal.pending()), "\n")
signal.defer(false)
signal.raise("SIGTERM") -- ignored before nvlua started: still ignored
io.write("alive\n")
]])
  local out = os.tmpname()
  local _, how, code = os.execute(string.format("sh -c %s > %s 2>&1", T.shq("trap '' TERM; exec " .. T.shq(NVLUA) .. " " ..
    T.shq(script)), T.shq(out)))
  local text = T.read_file(out)
  os.remove(out)
  T.eq({how, code}, {"exit", 0}, "exit status; output:\n" .. text)
  T.eq(text, "pending SIGUSR1\nagain false\nalive\n")
end)

T.case("cleanup: the scratch directory is removed", function()
  T.ok(T.rm_tree(ROOT))
end)
