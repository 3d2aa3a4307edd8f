-- tests/test_crash.lua: a checkpoint that existed is never lost (lua/nvlua/checkpoint.lua's protocol,
-- train.lua's resume). A tiny run (1 layer, hidden 32, seq 16, batch 2, bf16, 6 steps, a
-- checkpoint every 2 steps) is run as a child process (build/nvlua on a script written here):
--   * every fault point of the protocol (ckpt.FAULT_POINTS; NVLUA_FAULT=<point>:<nth> makes the
--     child SIGKILL itself there), with keep=1 and keep=2: after the kill the previous checkpoints
--     are listed and equal to an uninterrupted run's, byte for byte; then resume=auto finishes with
--     the uninterrupted run's loss (printed with 17 digits), final checkpoint and metrics.jsonl,
--     bit for bit, and leaves no leftover directory. Points reached while a step that already has
--     a checkpoint is saved again (a run resumed from an older checkpoint) and while recovering
--     from a crash are reached by those runs.
--   * a diverged run (NaN loss from step 3 on) exits non-zero; resume=auto continues its
--     skipped-step count and stops at the same step; with a lower max_bad_steps resume refuses the
--     checkpoint, naming the last healthy one.
--   * background saves (ckpt_background=true, also with ckpt_overlap=true): the same files as blocking
--     ones; killed in the writer
--     thread at every point of a fresh run's save and pruning, the previous checkpoints stay intact
--     and resume=auto finishes like the reference.
-- and in this process (train.run):
--   * resume=auto of a finished run with keep=1, and Ctrl-C right after a periodic checkpoint:
--     nothing is written again, metrics.jsonl is unchanged.
--   * skipped steps: the newest healthy checkpoint is kept while checkpoints are written during a
--     streak, which record the counters; pruned once a healthy one is written.
--   * resuming from an older checkpoint: the new checkpoints are not pruned (pruning goes by the
--     order of writing); the checkpoint resumed from is kept.
--   * an existing run is never started over: resume=none refuses an out= that holds one, and so
--     does resume=auto when no complete checkpoint is left, or only damaged ones. A damaged newest
--     checkpoint is skipped by resume=auto, which says which and why (stderr), sets it aside as
--     step-N.corrupt and resumes from the newest intact one; trainer.json records the data cursor
--     and max_batches_per_step that bound it.
-- Every run writes under one scratch directory (os.tmpname), removed by the last case.
local T = require "nvlua.test"
local train = require "nvlua.train"
local config = require "nvlua.config"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"
local lfs = require "lfs"

local ROOT = T.tmpdir()

local NVLUA = T.nvlua() -- the nvlua binary running this file

-- a run(cfg, hook) hook: Ctrl-C (a raised SIGINT) while step n's learning rate is computed
local function interrupt_at(n)
  return function(p)
    local base = p.schedule
    p.schedule = function(step)
      if step == n then require("nvlua.signal").raise() end
      return base(step)
    end
  end
end

-- a deterministic corpus: lines of words picked by an LCG
local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 4242, lines = 300, prefix = function(i) return i .. " " end,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in", "darkness"}})

-- The child's training script: key=value config, plus nan_from=N (every step from N on has a
-- NaN loss, so it is skipped). Prints the final loss with 17 significant digits.
local SCRIPT = ROOT .. "/train.lua"
T.write_file(SCRIPT, [=[
local train = require "nvlua.train"
local config = require "nvlua.config"
local args, nan_from = {}, nil
for _, a in ipairs(arg) do
  local v = a:match("^nan_from=(%d+)$")
  if v then nan_from = tonumber(v) else args[#args + 1] = a end
end
local c = config.parse(train.defaults, args)
local p = train.build(c)
p.peak = 1e9
if nan_from then
  local fb = p.model.forward_backward
  p.model.forward_backward = function(self, ...)
    local loss, n = fb(self, ...)
    if self.step >= nan_from then loss = 0 / 0 end
    return loss, n
  end
end
local s = train.run(c, p)
local last = s.last_loss and string.format("%.17g", s.last_loss) or "none"
print(string.format("finished: step %d, last loss %s", s.steps, last))
]=])

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=1", "hidden=32", "heads=4", "kv_heads=2",
  "ffn=64", "seq=16", "batch=2", "steps=6", "warmup=2", "lr=3e-3", "min_lr=3e-4", "eval_every=0", "log_every=1",
  "sample_tokens=0", "plot=false", "quiet=true", "seed=7", "recipe=bf16", "ckpt_every=2"}

local function args_of(name, extra)
  local a = {}
  for _, x in ipairs(BASE) do a[#a + 1] = x end
  a[#a + 1] = "out=" .. ROOT .. "/" .. name
  for _, x in ipairs(extra or {}) do a[#a + 1] = x end
  return a
end

-- Run the script in a child process (NVLUA_FAULT=fault when given). -> output, exit status
-- (137: killed by SIGKILL), the run directory
local function child(name, extra, fault)
  local quoted = {}
  for i, a in ipairs(args_of(name, extra)) do quoted[i] = T.shq(a) end
  local cmd = string.format("env OMP_NUM_THREADS=1 %s timeout 60 %s %s %s 2>&1; echo \"exit=$?\"",
    fault and ("NVLUA_FAULT=" .. T.shq(fault)) or "", T.shq(NVLUA), T.shq(SCRIPT), table.concat(quoted, " "))
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  p:close()
  local code = tonumber(out:match("exit=(%d+)%s*$"))
  return out, code, ROOT .. "/" .. name
end

local function must_finish(name, extra)
  local out, code, dir = child(name, extra)
  T.eq(code, 0, name .. ": exit status; output:\n" .. out)
  return out, dir
end

local function must_be_killed(name, extra, fault)
  local out, code, dir = child(name, extra, fault)
  T.eq(code, 137, name .. ": killed by SIGKILL at " .. fault .. "; output:\n" .. out)
  T.ok(out:find("NVLUA_FAULT: killing this process at " .. fault:match("^[^:]+"), 1, true), name .. ": " .. out)
  return dir
end

local function cp_r(from, to)
  assert(os.execute(string.format("cp -r '%s' '%s'", from, to)))
end

-- metrics.jsonl without the wall-clock fields, as text per record
local TIMING = {ms = true, tokens_per_s = true, mfu = true}
local function metrics(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    for k in pairs(TIMING) do r[k] = nil end
    out[#out + 1] = config.encode(r)
  end
  return out
end

-- the files of a checkpoint's model/ besides model.safetensors (the byte tokenizer's among them)
local MODEL_FILES = {"config.json", "tokenizer.json", "tokenizer_config.json"}

local function step_of(dir) return math.tointeger(tonumber(dir:match("step%-(%d+)[^/]*$"))) end
local function ckpt_dir(dir, step) return string.format("%s/checkpoints/step-%06d", dir, step) end

-- ---- the uninterrupted reference run (keep=0: every checkpoint) -----------------------------------

local REF = {}
local function reference()
  if REF.loss then return REF end
  local out, dir = must_finish("ref", {"keep=0"})
  REF.loss = out:match("last loss (%S+)")
  T.ok(REF.loss and REF.loss ~= "none", "the reference printed its loss: " .. out)
  REF.dir, REF.metrics = dir, metrics(dir)
  T.eq(#REF.metrics, 6)
  for _, step in ipairs({2, 4, 6}) do
    local d = ckpt_dir(dir, step)
    REF[step] = {model = T.read_file(d .. "/model/model.safetensors"),
      moments = T.read_file(d .. "/trainer.safetensors")}
    T.ok(REF[step].model and REF[step].moments, "reference checkpoint " .. step)
    for _, name in ipairs(MODEL_FILES) do
      REF[step][name] = T.read_file(d .. "/model/" .. name)
      T.ok(REF[step][name], "reference checkpoint " .. step .. ": model/" .. name)
    end
  end
  T.ok(REF[2].model ~= REF[4].model and REF[4].model ~= REF[6].model, "the checkpoints differ from step to step")
  return REF
end

-- every file under dir, by its path relative to dir: {path = size}
local function files_under(dir, prefix, out)
  out = out or {}
  for n in lfs.dir(dir) do
    if n ~= "." and n ~= ".." then
      local p = dir .. "/" .. n
      if lfs.attributes(p, "mode") == "directory" then files_under(p, (prefix or "") .. n .. "/", out)
      else out[(prefix or "") .. n] = lfs.attributes(p, "size") end
    end
  end
  return out
end

-- dir is a complete checkpoint equal to the reference's of its step, byte for byte
local function intact(dir, what)
  local step = step_of(dir)
  T.ok(REF[step], what .. ": a checkpoint of step " .. tostring(step) .. ": " .. dir)
  T.ok(ckpt.complete(dir), what .. ": complete: " .. dir)
  T.ok(T.read_file(dir .. "/model/model.safetensors") == REF[step].model,
    what .. ": model/model.safetensors as in the reference: " .. dir)
  T.ok(T.read_file(dir .. "/trainer.safetensors") == REF[step].moments, what .. ": trainer.safetensors: " .. dir)
  for _, name in ipairs(MODEL_FILES) do
    T.ok(T.read_file(dir .. "/model/" .. name) == REF[step][name], what .. ": model/" .. name .. ": " .. dir)
  end
  local tr = cjson.decode(assert(T.read_file(dir .. "/trainer.json")))
  T.eq(math.tointeger(tr.step), step, what .. ": trainer.json's step")
  -- trainer.json's bookkeeping covers every other file of the checkpoint, model/'s included
  local have = files_under(dir)
  have["trainer.json"] = nil
  local recorded = {}
  for k, v in pairs(tr.files) do recorded[k] = math.tointeger(v) end
  T.eq(recorded, have, what .. ": trainer.json's files are the checkpoint's files: " .. dir)
end

-- After a kill: latest() is the checkpoint of step `latest`, the steps in `survive` are listed,
-- and every listed checkpoint is intact.
local function after_kill(dir, latest, survive, what)
  local have = {}
  for _, d in ipairs(ckpt.list(dir)) do
    intact(d, what)
    have[step_of(d)] = true
  end
  for _, s in ipairs(survive) do T.ok(have[s], what .. ": the checkpoint of step " .. s .. " survived") end
  T.eq(step_of(ckpt.latest(dir) or ""), latest, what .. ": the newest complete checkpoint")
end

-- After resume=auto: the reference's final checkpoint, metrics and (when steps were trained) loss;
-- nothing under checkpoints/ but complete step-N directories.
local function finished_like_reference(dir, out, trained, what)
  if trained then
    T.eq(out:match("last loss (%S+)"), REF.loss, what .. ": the final loss, 17 digits; output:\n" .. out)
  end
  T.eq(ckpt.latest(dir), ckpt_dir(dir, 6), what .. ": the final checkpoint")
  intact(ckpt.latest(dir), what .. " (final)")
  T.eq(metrics(dir), REF.metrics, what .. ": metrics.jsonl")
  for n in lfs.dir(dir .. "/checkpoints") do
    if n ~= "." and n ~= ".." then
      T.ok(n:match("^step%-%d%d%d%d%d%d$") and ckpt.complete(dir .. "/checkpoints/" .. n), what .. ": leftover " .. n)
    end
  end
end

-- ---- every fault point, keep=1 and keep=2 -----------------------------------------------------

-- A fresh run killed at a point of its step-4 save (nth 2) or of its first pruning (nth 1; keep=1
-- prunes step 2 after step 4 is written, keep=2 after step 6). latest/survive as after_kill's,
-- per keep. then: the faults of the resume=auto runs that follow, before the last one.
local FRESH = {
  {"save.data:2", {2, {2}}, {2, {2}}},
  {"save.marker:2", {2, {2}}, {2, {2}}, then_ = {"clean.marker:1", "clean.half:1"}},
  {"save.partial:2", {2, {2}}, {2, {2}}},
  {"save.done:2", {4, {2, 4}}, {4, {2, 4}}},
  {"prune.marker:1", {4, {4}}, {6, {4, 6}}},
  {"prune.half:1", {4, {4}}, {6, {4, 6}}},
}
-- A finished run (steps 2..6 with keep) resumed from a copy of the reference's step 4, killed
-- while saving step 6 over its own step 6 (every point reached once).
local REPLACE = {
  {"save.aside:1", then_ = {"recover.renamed:1"}}, {"save.renamed:1"}, {"old.marker:1"}, {"old.half:1"},
}

T.case("the fault points: the cases below reach every one of ckpt.FAULT_POINTS", function()
  local seen = {}
  for _, list in ipairs({FRESH, REPLACE}) do
    for _, c in ipairs(list) do
      for _, f in ipairs({c[1], table.unpack(c.then_ or {})}) do seen[f:match("^[^:]+")] = true end
    end
  end
  for _, p in ipairs(ckpt.FAULT_POINTS) do T.ok(seen[p], "a case reaches " .. p) end
  local out, code = child("badfault", {"steps=2"}, "save.nowhere")
  T.eq(code, 1, out)
  T.ok(out:find("NVLUA_FAULT=save.nowhere: expected <point>[:<nth>]", 1, true), out)
end)

-- the resume=auto runs after a kill: each fault of then_ kills one (the state stays recoverable),
-- the last one finishes like the reference
local function resume_after(name, keep, then_, trained, what)
  for _, f in ipairs(then_ or {}) do
    must_be_killed(name, {"keep=" .. keep, "resume=auto"}, f)
    local d = ROOT .. "/" .. name
    T.ok(ckpt.latest(d), what .. ": a complete checkpoint after the kill at " .. f)
    for _, x in ipairs(ckpt.list(d)) do intact(x, what .. " after " .. f) end
  end
  local out, dir = must_finish(name, {"keep=" .. keep, "resume=auto"})
  finished_like_reference(dir, out, trained, what)
end

for _, keep in ipairs({1, 2}) do
  T.case("a fresh run killed at every point of its save and prune protocol (keep=" .. keep .. ")", function()
    reference()
    for _, c in ipairs(FRESH) do
      local name = string.format("fresh-k%d-%s", keep, c[1]:gsub("[^%w]", "_"))
      local what = "keep=" .. keep .. " " .. c[1]
      local dir = must_be_killed(name, {"keep=" .. keep}, c[1])
      local want = c[keep + 1]
      after_kill(dir, want[1], want[2], what)
      resume_after(name, keep, c.then_, want[1] < 6, what)
    end
  end)

  T.case("a step saved over its own checkpoint, killed at every point of the replacement (keep=" .. keep .. ")",
    function()
      reference()
      local ext = ROOT .. "/ext" -- the reference's step 4, outside the runs
      if not lfs.attributes(ext) then
        assert(lfs.mkdir(ext))
        cp_r(ckpt_dir(REF.dir, 4), ext .. "/")
      end
      local _, template = must_finish("replace-template-k" .. keep, {"keep=" .. keep})
      for _, c in ipairs(REPLACE) do
        local name = string.format("replace-k%d-%s", keep, c[1]:gsub("[^%w]", "_"))
        local what = "keep=" .. keep .. " replacing, " .. c[1]
        cp_r(template, ROOT .. "/" .. name)
        local dir = must_be_killed(name, {"keep=" .. keep, "resume=" .. ext .. "/step-000004"}, c[1])
        after_kill(dir, 6, keep == 1 and {6} or {4, 6}, what)
        resume_after(name, keep, c.then_, false, what)
      end
    end)
end

-- ---- background saves (ckpt_background=true: the writer thread runs the protocol's durable steps) ---

T.case("background saves: the files of blocking saves; killed in the writer at every point, the previous checkpoint stays and resume=auto finishes like the reference", function()
  reference()
  local out, dir = must_finish("bg", {"keep=0", "ckpt_background=true"})
  T.eq(out:match("last loss (%S+)"), REF.loss, "the final loss")
  T.eq(metrics(dir), REF.metrics, "metrics.jsonl")
  for _, step in ipairs({2, 4, 6}) do intact(ckpt_dir(dir, step), "background save of step " .. step) end
  -- ckpt_overlap: the writer thread copies the state during the next step; the same files and run
  local out2, dir2 = must_finish("bg_overlap", {"keep=0", "ckpt_background=true", "ckpt_overlap=true"})
  T.eq(out2:match("last loss (%S+)"), REF.loss, "ckpt_overlap: the final loss")
  T.eq(metrics(dir2), REF.metrics, "ckpt_overlap: metrics.jsonl")
  for _, step in ipairs({2, 4, 6}) do intact(ckpt_dir(dir2, step), "ckpt_overlap: the save of step " .. step) end
  for _, c in ipairs(FRESH) do
    local name = "bg-k1-" .. c[1]:gsub("[^%w]", "_")
    local what = "background, keep=1 " .. c[1]
    local d = must_be_killed(name, {"keep=1", "ckpt_background=true"}, c[1])
    after_kill(d, c[2][1], c[2][2], what)
    resume_after(name, 1, nil, c[2][1] < 6, what)
  end
end)

-- ---- a diverged run ---------------------------------------------------------------------------

T.case("a diverged run exits non-zero; resume=auto keeps its skipped-step count; a lower max_bad_steps refuses it",
  function()
    local extra = {"steps=10", "keep=1", "max_bad_steps=3", "nan_from=3"}
    local stop = "training stopped at step 6: 4 consecutive steps with a non-finite loss, gradient, weight or activation (max_bad_steps=3)"
    local out, code, dir = child("diverged", extra)
    T.eq(code, 1, "exit status; output:\n" .. out)
    T.ok(out:find(stop, 1, true), out)
    -- step 4's checkpoint was written during the streak; step 2's, the newest healthy one, is kept
    T.eq(ckpt.list(dir), {ckpt_dir(dir, 2), ckpt_dir(dir, 4)})
    local tr = cjson.decode(assert(T.read_file(ckpt_dir(dir, 4) .. "/trainer.json")))
    T.eq({tr.bad_steps_in_row, tr.skipped_steps}, {2, 2})
    local before = metrics(dir)
    T.eq(#before, 6)
    out, code = child("diverged", {"steps=10", "keep=1", "max_bad_steps=3", "nan_from=3", "resume=auto"})
    T.eq(code, 1, "resumed: exit status; output:\n" .. out)
    T.ok(out:find(stop, 1, true), "the resumed run counts on from 2 skipped steps: " .. out)
    T.eq(metrics(dir), before, "metrics.jsonl as after the first run")
    out, code = child("diverged", {"steps=10", "keep=1", "max_bad_steps=1", "resume=auto"})
    T.eq(code, 1, "refused: exit status; output:\n" .. out)
    T.ok(out:find(ckpt_dir(dir, 4) .. "/trainer.json: the run had diverged: this checkpoint was written after 2 " ..
      "consecutive skipped steps (non-finite loss, gradient, weight or activation), more than max_bad_steps=1; the newest checkpoint " ..
      "of the run written before such a streak is " .. ckpt_dir(dir, 2), 1, true), out)
    T.eq(metrics(dir), before, "metrics.jsonl untouched by the refused resume")
  end)

-- ---- in this process --------------------------------------------------------------------------

local PEAK = 1e9

local function cfg(name, extra)
  return config.parse(train.defaults, args_of(name, extra))
end

-- build the parts of c, let hook(parts) change them, run
local function run(c, hook)
  local p = train.build(c)
  p.peak = PEAK
  if hook then hook(p) end
  return train.run(c, p), p
end

local function seq_of(dir) return math.tointeger(cjson.decode(assert(T.read_file(dir .. "/trainer.json"))).seq) end

T.case("resume=auto of a finished run (keep=1) and Ctrl-C after a periodic checkpoint write nothing again", function()
  local c = cfg("finished", {"keep=1"})
  local s = run(c)
  local last = ckpt_dir(c.out, 6)
  T.eq(s.checkpoint, last)
  T.eq(ckpt.list(c.out), {last})
  local ino, m = lfs.attributes(last, "ino"), T.read_file(c.out .. "/metrics.jsonl")
  for i = 1, 2 do
    local s2 = run(cfg("finished", {"keep=1", "resume=auto"}))
    T.eq(s2.steps, 6)
    T.eq(s2.checkpoint, last, "resume " .. i)
    T.eq(ckpt.list(c.out), {last}, "resume " .. i)
    T.eq(lfs.attributes(last, "ino"), ino, "resume " .. i .. ": the same directory, not rewritten")
    T.eq(T.read_file(c.out .. "/metrics.jsonl"), m, "resume " .. i .. ": metrics.jsonl")
  end
  local ci = cfg("ctrlc", {"keep=1"})
  local si = run(ci, interrupt_at(4))
  T.eq({si.interrupted, si.steps, si.checkpoint}, {true, 4, ckpt_dir(ci.out, 4)})
  T.eq(seq_of(si.checkpoint), 2, "step 4's periodic checkpoint (the run's 2nd) was not written again")
  T.eq(ckpt.list(ci.out), {si.checkpoint})
end)

T.case("skipped steps: the newest healthy checkpoint survives a streak; the counters are saved", function()
  local c = cfg("streak", {"keep=1", "steps=8"})
  local seen = {}
  local s = run(c, function(p)
    local fb, base = p.model.forward_backward, p.schedule
    p.model.forward_backward = function(self, ...)
      local loss, n = fb(self, ...)
      if self.step == 3 or self.step == 4 then loss = 0 / 0 end
      return loss, n
    end
    p.schedule = function(step)
      seen[step] = ckpt.list(c.out)
      if step == 5 then seen.tr4 = cjson.decode(assert(T.read_file(ckpt_dir(c.out, 4) .. "/trainer.json"))) end
      if step == 7 then seen.tr6 = cjson.decode(assert(T.read_file(ckpt_dir(c.out, 6) .. "/trainer.json"))) end
      return base(step)
    end
  end)
  T.eq(s.skipped, 2)
  T.eq(seen[5], {ckpt_dir(c.out, 2), ckpt_dir(c.out, 4)}, "after step 4 (2 skipped in a row): step 2 is kept")
  T.eq({seen.tr4.bad_steps_in_row, seen.tr4.skipped_steps}, {2, 2}, "step 4's checkpoint records the streak")
  T.eq(seen[7], {ckpt_dir(c.out, 6)}, "a healthy step 6 replaces both")
  T.eq({seen.tr6.bad_steps_in_row, seen.tr6.skipped_steps}, {0, 2})
  local s2 = run(cfg("streak", {"keep=1", "steps=10", "resume=auto"}))
  T.eq(s2.skipped, 2, "the resumed run counts the skipped steps from before")
end)

T.case("resumed from an older checkpoint: its new checkpoints are not pruned; the one resumed from is kept", function()
  local src = cfg("older-src", {"keep=0"})
  local _, p0 = run(src)
  -- keep=1: a run at step 6 resumed from a copy of step 2; by step number, step 6 would win
  local c = cfg("older", {"keep=1"})
  run(c)
  local ext = ROOT .. "/older-ext"
  assert(lfs.mkdir(ext))
  cp_r(ckpt_dir(src.out, 2), ext .. "/")
  local seen = {}
  local c2 = cfg("older", {"keep=1", "resume=" .. ext .. "/step-000002"})
  local _, p2 = run(c2, function(p)
    local base = p.schedule
    p.schedule = function(step)
      seen[step] = ckpt.latest(c.out)
      return base(step)
    end
  end)
  T.eq(seen[5], ckpt_dir(c.out, 4), "step 4 was just written: it is the newest")
  T.eq(ckpt.list(c.out), {ckpt_dir(c.out, 6)})
  for _, e in ipairs(p0.model:named_parameters()) do
    local q
    for _, x in ipairs(p2.model:named_parameters()) do if x.name == e.name then q = x end end
    T.ok(q.param:bytes() == e.param:bytes(), "final " .. e.name .. " as in the straight run")
  end
  -- keep=2, resumed from its own step 2 (of 2, 4, 6) with another lr and stopped at step 4: the new
  -- step 4 is the newest (not the old step 6), step 2 is kept beside the 2 newest
  local k = cfg("older2", {"keep=3"})
  run(k)
  local s = run(cfg("older2", {"keep=2", "lr=1e-3", "resume=" .. ckpt_dir(k.out, 2)}), interrupt_at(4))
  T.eq({s.interrupted, s.steps}, {true, 4})
  T.eq(ckpt.list(k.out), {ckpt_dir(k.out, 2), ckpt_dir(k.out, 6), ckpt_dir(k.out, 4)}, "in the order of writing")
  T.eq(ckpt.latest(k.out), ckpt_dir(k.out, 4))
  local s2 = run(cfg("older2", {"keep=2", "lr=1e-3", "resume=auto"}))
  T.eq(s2.losses[1][1], 5, "resumed after the new step 4")
  T.eq(ckpt.list(k.out), {ckpt_dir(k.out, 4), ckpt_dir(k.out, 6)})
  T.eq({seq_of(ckpt_dir(k.out, 4)), seq_of(ckpt_dir(k.out, 6))}, {4, 5}, "4 and 6 written again")
end)

T.case("an existing run is never started over; a damaged newest checkpoint is skipped, said and set aside", function()
  local c = cfg("exists", {"keep=2", "steps=4"})
  run(c)
  local m = T.read_file(c.out .. "/metrics.jsonl")
  local cj = T.read_file(c.out .. "/config.json")
  T.raises(function() run(cfg("exists", {"keep=2", "steps=4"})) end,
    "resume=none: out=" .. c.out .. " already holds a run (metrics.jsonl with 4 records up to step 4 and the " ..
    "checkpoint " .. ckpt_dir(c.out, 4) .. "); resume=auto continues it")
  T.eq(T.read_file(c.out .. "/config.json"), cj, "config.json untouched")
  -- what train.lua records for the data cursor's check: the step's batches, the most per step
  local tj = cjson.decode(T.read_file(ckpt_dir(c.out, 4) .. "/trainer.json"))
  T.eq({tj.loader.cursor, tj.max_batches_per_step}, {"4", 1})
  -- the newest checkpoint lost its model: resume=auto says which one it skipped and why, sets it aside
  -- (kept, never pruned or overwritten) and continues from the one before it (a child process: the
  -- notice is on stderr, quiet=true or not)
  local d2, d4, d6 = ckpt_dir(c.out, 2), ckpt_dir(c.out, 4), ckpt_dir(c.out, 6)
  os.remove(d4 .. "/model/model.safetensors")
  local out = must_finish("exists", {"keep=2", "steps=6", "resume=auto"})
  T.ok(out:find("resume=auto: skipped the checkpoint " .. d4 .. ", it is damaged: checkpoint " .. d4 ..
    "/model/model.safetensors: missing (a checkpoint has model/config.json, model/model.safetensors, " ..
    "trainer.safetensors and trainer.json); moved it to " .. d4 .. ".corrupt (kept for inspection)", 1, true), out)
  T.ok(out:find("finished: step 6", 1, true), out)
  T.eq(ckpt.list(c.out), {d2, d4, d6}, "resumed from step 2 (kept), steps 4 and 6 written again")
  T.eq(lfs.attributes(d4 .. ".corrupt/trainer.json", "mode"), "file", "the damaged one kept whole")
  T.eq(lfs.attributes(d4 .. ".corrupt/model/model.safetensors"), nil)
  -- every checkpoint damaged: refused, each set aside
  for _, d in ipairs({d2, d4, d6}) do T.write_file(d .. "/trainer.json", "{\"step\": ") end
  local m6 = T.read_file(c.out .. "/metrics.jsonl")
  T.raises(function() run(cfg("exists", {"keep=2", "steps=8", "resume=auto"})) end,
    "resume=auto: every checkpoint in " .. c.out .. "/checkpoints is damaged (set aside: " .. d6 .. ".corrupt, " ..
    d4 .. ".corrupt-2, " .. d2 .. ".corrupt; the reasons are printed above); refusing to start the run over")
  T.eq(T.read_file(c.out .. "/metrics.jsonl"), m6, "metrics.jsonl untouched")
  T.eq(ckpt.list(c.out), {})
  -- in this process, the summary says what was skipped: a run of 4 steps started over, its step 4 damaged
  run(cfg("exists", {"keep=0", "steps=4", "overwrite=true"}))
  m = T.read_file(c.out .. "/metrics.jsonl")
  local records = metrics(c.out)
  T.write_file(d4 .. "/trainer.json", "garbage")
  local s4 = run(cfg("exists", {"keep=0", "steps=4", "resume=auto"}))
  T.eq(s4.skipped_checkpoints, {{dir = d4, moved_to = d4 .. ".corrupt", reason = "checkpoint " .. d4 ..
    "/trainer.json: not valid JSON (truncated or overwritten?): Expected value but found invalid token at character 1"}})
  T.eq({s4.steps, s4.losses[1][1]}, {4, 3}, "resumed from step 2")
  T.eq(metrics(c.out), records, "steps 3 and 4 ran again as they had")
  m = T.read_file(c.out .. "/metrics.jsonl")
  -- no complete checkpoint left, but the run's metrics: resume=auto refuses to start over
  ckpt.rm_rf(c.out .. "/checkpoints")
  T.raises(function() run(cfg("exists", {"keep=2", "steps=6", "resume=auto"})) end,
    "resume=auto: no complete checkpoint in " .. c.out .. "/checkpoints, but out=" .. c.out ..
    " holds a run (metrics.jsonl with 4 records up to step 4)")
  T.eq(T.read_file(c.out .. "/metrics.jsonl"), m, "metrics.jsonl untouched")
  -- a directory without a run: resume=auto starts fresh
  local s = run(cfg("fresh-auto", {"keep=2", "steps=2", "resume=auto"}))
  T.eq(s.steps, 2)
end)

T.case("overwrite=true starts a run over: the earlier checkpoints and metrics are removed first", function()
  local c = cfg("over", {"keep=2", "steps=4", "ckpt_every=2"})
  run(c)
  T.eq(ckpt.list(c.out), {ckpt_dir(c.out, 2), ckpt_dir(c.out, 4)})
  T.raises(function() train.build(cfg("over", {"keep=2", "steps=2"})) end,
    "resume=none: out=" .. c.out .. " already holds a run", "refused before anything is built")
  T.raises(function() config.parse(train.schema, {"overwrite=true", "resume=auto"}) end,
    "config: overwrite=true starts the run over; it does not go with resume=auto")
  local s = run(cfg("over", {"keep=2", "steps=2", "overwrite=true"}))
  T.eq(s.steps, 2)
  T.eq(ckpt.list(c.out), {ckpt_dir(c.out, 2)}, "only the new run's checkpoint")
  local steps = {}
  for line in io.lines(c.out .. "/metrics.jsonl") do
    local rec = cjson.decode(line)
    if not rec.val_loss then steps[#steps + 1] = rec.step end
  end
  T.eq(steps, {1, 2}, "metrics.jsonl holds only the new run's steps")
end)

T.case("cleanup: the scratch directory is removed", function()
  ckpt.rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
