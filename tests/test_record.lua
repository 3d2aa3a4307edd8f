-- tests/test_record.lua: the run record (lua/nvlua/record.lua): out/run.json, the script's copy and
-- config.json, on a tiny run (2 layers, hidden 32, 4/2 heads, seq 16, batch 2, 2-5 steps) over a
-- ~24 KB corpus written here (byte tokenizer):
--   * an experiment run as a program (T.run_nvlua) from outside the git repository holding it (made
--     here: git init, commit): run.json's commit is what `git rev-parse HEAD` says, its dirty flag
--     and changes what `git status --porcelain` says (a clean tree, the run's own output inside it
--     not counted; then a tracked file edited); the command line is the binary, the script and every
--     key=value passed; the script's copy is byte-equal; the build facts are what `nvlua -v` prints;
--     the host is `uname -n`, the start time (UTC) between the test's clock readings; world, device.
--     Without git, or outside a repository, the commit is null with the reason.
--   * Lua values in the config (a recipe.custom value, a schedule function, a schedule value) are
--     written to config.json and run.json as what they are, not as the keys' defaults; the schedule
--     samples are checked against hand-computed values and against the lr metrics.jsonl logged; a
--     schedule put into the parts after train.build is described too; names stay names.
--   * a per-layer recipe: the format of each operand of each linear's GEMMs, and a linear given a
--     recipe of its own described by it.
--   * resume=auto keeps the first record byte for byte and appends one entry per resume; a run.json
--     that is not a record is set aside.
-- Every run writes under one scratch directory (T.tmpdir), removed by the last case.
local T = require "nvlua.test"
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local recipe = require "nvlua.recipe"
local schedule = require "nvlua.schedule"
local record = require "nvlua.record"
local cjson = require "cjson"
local lfs = require "lfs"

local ROOT = T.tmpdir()
local SRC = debug.getinfo(1, "S").source:sub(2) -- this file as it was loaded: where its functions are defined

local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 12345, lines = 500,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in", "darkness"}})

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "layers=2", "hidden=32", "heads=4", "kv_heads=2",
  "ffn=64", "seq=16", "batch=2", "steps=2", "warmup=1", "lr=3e-3", "min_lr=3e-4", "decay=0.5", "eval_every=0",
  "log_every=1", "sample_tokens=0", "plot=false", "quiet=true", "keep=0", "save=false"}

local function args_for(name, extra)
  local a = {}
  for _, x in ipairs(BASE) do a[#a + 1] = x end
  a[#a + 1] = "out=" .. ROOT .. "/" .. name
  for _, x in ipairs(extra or {}) do a[#a + 1] = x end
  return a
end

-- an in-process run: the config as train.main resolves it (overrides: the experiment's table, Lua
-- values included), built, hook(parts), run with a fixed MFU peak (no measuring)
local function run(name, extra, overrides, hook)
  local c = config.parse(train.schema, args_for(name, extra), overrides)
  local p = train.build(c)
  p.peak = 1e9
  if hook then hook(p) end
  return train.run(c, p), p, c
end

local function json(path) return cjson.decode(assert(T.read_file(path))) end

-- cmd's output (stdout and stderr), exit status; cd: the directory it runs in
local function sh(cmd, cd)
  local f = assert(io.popen((cd and ("cd " .. T.shq(cd) .. " && ") or "") .. cmd .. " 2>&1"))
  local out = f:read("a")
  local _, _, code = f:close()
  return out, code
end

local function git(dir, cmd) return sh("git -C " .. T.shq(dir) .. " " .. cmd) end

local function lines(text)
  local t = {}
  for l in text:gmatch("[^\n]+") do t[#t + 1] = l end
  return t
end

local function utc_now() return os.date("!%Y-%m-%dT%H:%M:%SZ") end

-- ---- an experiment run as a program ------------------------------------------------------------

local EXPERIMENT = [[
-- a tiny experiment (tests/test_record.lua wrote it)
local train = require "nvlua.train"
train.main({plot = false, quiet = true}, arg)
]]

T.case("run.json of a program run: commit, dirty flag, command line, script copy, build facts, host, time", function()
  local _, gcode = sh("git --version")
  if gcode ~= 0 then T.skip("git is not installed here (`git --version` exited " .. tostring(gcode) .. ")") end
  local repo = ROOT .. "/repo"
  assert(lfs.mkdir(repo)); assert(lfs.mkdir(repo .. "/experiments"))
  local script = T.write_file(repo .. "/experiments/tiny.lua", EXPERIMENT)
  T.write_file(repo .. "/README.md", "a repository of experiments\n")
  local _, c1 = git(repo, "init -q")
  local _, c2 = git(repo, "add -A")
  local _, c3 = git(repo, "-c user.name=test -c user.email=test@example.com commit -qm experiments")
  T.eq({c1, c2, c3}, {0, 0, 0}, "git init, add, commit")
  local head = git(repo, "rev-parse HEAD"):match("^(%x+)\n")
  T.eq(#head, 40)

  -- run from ROOT, outside the repository, by a relative path; the output inside the tree (runs/,
  -- untracked and not ignored): the tree counts as clean, that output being the run's own
  local out = repo .. "/runs/a"
  local keys = {"data=" .. CORPUS, "layers=2", "hidden=32", "heads=4", "kv_heads=2", "ffn=64", "seq=16", "batch=2",
    "steps=2", "warmup=1", "eval_every=0", "sample_tokens=0", "save=false", "out=" .. out}
  local argv = {}
  for i, k in ipairs(keys) do argv[i] = T.shq(k) end
  local before = utc_now()
  local r = T.run_nvlua("./repo/experiments/tiny.lua " .. table.concat(argv, " "),
    {cd = ROOT, env = {NVLUA_PATH = package.path}})
  local after = utc_now()
  T.eq(r.code, 0, "the experiment ran: " .. r.err)
  local rec = json(out .. "/run.json")
  T.eq(rec.nvlua, nv.version)
  T.eq(rec.git.commit, head, "the commit is `git rev-parse HEAD`")
  T.eq(rec.git.root, repo)
  T.eq(rec.git.dirty, false)
  T.eq(rec.git.changes, nil)
  -- the environment that changes speed: the child started without OpenMP settings (T.run_nvlua
  -- clears them) and ran under nvlua's default; NVLUA_PATH as the test gave it
  T.eq(rec.environment.GOMP_SPINCOUNT, "5000")
  T.eq(rec.environment.NVLUA_PATH, package.path)
  T.eq(rec.environment.OMP_WAIT_POLICY, nil)
  -- the peak MFU is against, and what it is (the log's words)
  T.ok(type(rec.mfu_peak.flops_per_s) == "number" and rec.mfu_peak.flops_per_s > 0, "mfu_peak.flops_per_s")
  T.ok(type(rec.mfu_peak.what) == "string" and #rec.mfu_peak.what > 0, "mfu_peak.what")
  -- now git status lists the run's output (the record looked before writing it); a resume looks
  -- after: that output is not counted, other changes are
  T.eq(git(repo, "status --porcelain"), "?? runs/\n")
  T.eq(record.git(repo .. "/experiments", out), {commit = head, root = repo, dirty = false})
  T.eq(record.git(repo .. "/experiments", repo .. "/runs/b"), {commit = head, root = repo, dirty = false},
    "a directory holding the run's output, untracked as a whole, is that output")
  T.eq(record.git(repo .. "/experiments"), {commit = head, root = repo, dirty = true, changes = {"?? runs/"}})
  local want = {T.nvlua(), "./repo/experiments/tiny.lua"}
  for _, k in ipairs(keys) do want[#want + 1] = k end
  T.eq(rec.command, want, "the command line: the binary, the script, every key=value")
  T.eq(rec.cwd, ROOT)
  T.eq(rec.script.path, "./repo/experiments/tiny.lua")
  T.eq(rec.script.abs, script)
  T.eq(rec.script.copy, "tiny.lua")
  T.eq(T.read_file(out .. "/tiny.lua"), T.read_file(script), "the copy is the script, byte for byte")
  T.eq(rec.script.bytes, #EXPERIMENT)
  T.eq(rec.host, (sh("uname -n"):gsub("\n$", "")))
  T.ok(rec.started:match("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$") and before <= rec.started and rec.started <= after,
    string.format("start time %s in [%s, %s]", rec.started, before, after))
  T.eq(rec.world, {size = 1, rank = 0, ranks_on_node = 1, backend = "none"})
  T.eq(rec.device, {kind = "cpu"})
  T.eq(rec.start_step, 0)
  T.eq(rec.schedule.kind, "wsd", "the config's schedule, by name")
  T.eq(rec.recipe.name, "nvfp4", "the config's default recipe")
  T.eq(json(out .. "/config.json").schedule, "wsd", "names stay names in config.json")

  -- the build facts are what `nvlua -v` prints
  local v = T.run_nvlua("-v")
  T.eq(v.code, 0)
  local b, seen = rec.build, {}
  for _, l in ipairs(lines(v.out)) do
    local k, rest = l:match("^([^:]+): (.*)$")
    if l:match("^nvlua ") then T.eq(rec.nvlua, l:match("^nvlua (%S+)")); seen.nvlua = true
    elseif k == "BLAS" then T.eq(b.blas, rest); seen.blas = true
    elseif k == "bf16 GEMMs" then T.eq(b.dnnl, rest); seen.dnnl = true
    elseif k == "CUDA" and rest:match("^compiled in") then
      local rt, lt = rest:match("^compiled in %(runtime ([%d.]+), cuBLASLt (%d+)%)")
      T.eq({b.cuda_compiled, b.cuda_runtime_text, b.cublaslt}, {true, rt, math.tointeger(tonumber(lt))}, l)
      seen.cuda = true
    elseif k == "CUDA" and rest == "not compiled in" then T.eq(b.cuda_compiled, false); seen.cuda = true
    elseif k == "cuDNN" then
      local h, lib = rest:match("^headers ([%d.]+), library ([%d.]+)")
      if rest == "not compiled in (attention runs on nvlua's own kernels)" then T.eq(b.cudnn.compiled, nil, l)
      elseif h then T.eq({b.cudnn.compiled, b.cudnn.library}, {h, lib}, l)
      else T.eq({b.cudnn.compiled, b.cudnn.library}, {rest:match("^headers ([%d.]+)"), nil}, l) end
      seen.cudnn = true
    elseif k == "GPUs" then T.eq(b.gpus, nil, l); T.eq("none (" .. b.cuda_unavailable_reason .. ")", rest); seen.gpus = true
    elseif l:match("^GPU %d+: ") then
      local i, name = l:match("^GPU (%d+): ([^,]+),")
      T.eq(b.gpus[tonumber(i) + 1].name, name, l); seen.gpus = true
    end
  end
  if not seen.cudnn and not b.cuda_compiled then -- a build without CUDA prints no cuDNN line
    T.eq(b.cudnn.compiled, nil, "no cuDNN headers without CUDA")
    seen.cudnn = true
  end
  T.eq(seen, {nvlua = true, blas = true, dnnl = true, cuda = true, cudnn = true, gpus = true}, "every -v fact compared")

  -- a tracked file edited: dirty, the changes git lists (runs/ is run a's output, not this run's)
  T.write_file(repo .. "/README.md", "a repository of experiments, edited\n")
  local out2 = ROOT .. "/b"
  keys[#keys] = "out=" .. out2
  argv[#argv] = T.shq(keys[#keys])
  r = T.run_nvlua(T.shq(script) .. " " .. table.concat(argv, " "), {env = {NVLUA_PATH = package.path}})
  T.eq(r.code, 0, r.err)
  local rec2 = json(out2 .. "/run.json")
  T.eq(rec2.git.commit, head)
  T.eq(rec2.git.dirty, true)
  T.eq(rec2.git.changes, lines(git(repo, "status --porcelain")), "the changes are git status's lines")
  T.eq(rec2.git.changes, {" M README.md", "?? runs/"})
  T.eq(rec2.script.path, script, "an absolute script path")
end)

T.case("without git, or outside a repository, the commit is null with the reason", function()
  local dir = ROOT .. "/norepo"
  assert(lfs.mkdir(dir))
  local _, gcode = sh("git --version")
  if gcode == 0 then -- (a repository above the scratch directory would hold it: then this says so)
    local g = record.git(dir)
    local top = git(dir, "rev-parse --show-toplevel")
    if g.commit ~= cjson.null then T.skip("the scratch directory is inside a git repository: " .. top) end
    T.eq(g.dirty, cjson.null)
    T.ok(g.reason:find("not a git repository", 1, true), g.reason)
  end
  local code = "local r = require('nvlua.record'); io.write(require('nvlua.config').encode(r.git(" ..
    string.format("%q", dir) .. ")))"
  local r = T.run_nvlua("-e " .. T.shq(code), {env = {NVLUA_PATH = package.path, PATH = "/nonexistent"}})
  T.eq(r.code, 0, r.err)
  T.eq(cjson.decode(r.out), {commit = cjson.null, dirty = cjson.null, reason = "git is not installed"})
end)

-- ---- Lua values: a recipe value, a schedule function, a schedule value ---------------------------

T.case("config.json and run.json record a custom recipe and a custom schedule as what they are", function()
  local sched_line, halving = debug.getinfo(1, "l").currentline, function(step) return 0.5 ^ step end
  local rec_line, mine = debug.getinfo(1, "l").currentline, recipe.custom(function(c) return c.high_precision and "bf16" or "e4m3" end)
  local s, _, c = run("lua_values", {"steps=4", "save=true"}, {recipe = mine, schedule = halving})
  T.eq(s.steps, 4)
  T.ok(c.recipe == mine and c.schedule == halving, "the Lua values reached the config (train.main's overrides)")
  local fn_desc = {kind = "lua function", defined_at = SRC .. ":" .. sched_line,
    text = "lua function defined at " .. SRC .. ":" .. sched_line,
    samples = {{step = 1, lr = 0.5}, {step = 2, lr = 0.25}, {step = 3, lr = 0.125}, {step = 4, lr = 0.0625}}}
  local rec_desc = {name = "custom", text = "custom(seed=1234)", settings = {seed = 1234}, act_dtype = "f32",
    defined_at = SRC .. ":" .. rec_line}
  local cfg = json(c.out .. "/config.json")
  T.eq(cfg.schedule, fn_desc, "config.json: the function, where it is defined, its values")
  T.eq(cfg.recipe, rec_desc, "config.json: the recipe value")
  local rj = json(c.out .. "/run.json")
  T.eq(rj.schedule, fn_desc)
  for k, v in pairs(rec_desc) do T.eq(rj.recipe[k], v, "run.json recipe " .. k) end
  -- the samples are the lr the run used
  local i = 0
  for line in io.lines(c.out .. "/metrics.jsonl") do
    local m = cjson.decode(line)
    if m.lr then i = i + 1; T.eq(m.lr, fn_desc.samples[m.step].lr, "metrics lr at step " .. m.step) end
  end
  T.eq(i, 4)
  -- the checkpoint's copy of the config holds the function's description too (JSON has no functions)
  local tr = json(s.checkpoint .. "/trainer.json")
  T.eq(tr.config.schedule, fn_desc.text)

  -- a schedule value: its kind and options; samples of cosine from 1 to 0 over 4 steps, (1 + cos(pi
  -- t)) / 2 at t = 1/4, 1/2, 3/4, 1: (2 + sqrt 2) / 4, 1/2, (2 - sqrt 2) / 4, 0 (within 1e-15: a few
  -- f64 roundings of numbers <= 1)
  local cos = schedule.cosine({lr = 1.0, min_lr = 0.0, warmup = 0, total = 4})
  local _, _, c2 = run("schedule_value", {"steps=4"}, {schedule = cos})
  local sv = json(c2.out .. "/config.json").schedule
  T.eq({sv.kind, sv.options, sv.text}, {"cosine", {lr = 1, min_lr = 0, warmup = 0, total = 4},
    "cosine(lr=1.0, min_lr=0.0, total=4, warmup=0)"})
  local want = {(2 + math.sqrt(2)) / 4, 0.5, (2 - math.sqrt(2)) / 4, 0}
  T.eq(#sv.samples, 4)
  for k, smp in ipairs(sv.samples) do
    T.eq(smp.step, k)
    T.near(smp.lr, want[k], 1e-15, "cosine at step " .. k)
  end
  T.eq(json(c2.out .. "/run.json").schedule, sv)

  -- names stay names in config.json; run.json describes what they built
  local _, _, c3 = run("names", {"recipe=bf16", "schedule=wsd"})
  local cn = json(c3.out .. "/config.json")
  T.eq({cn.recipe, cn.schedule}, {"bf16", "wsd"})
  local rn = json(c3.out .. "/run.json")
  T.eq(rn.schedule.kind, "wsd")
  T.eq(rn.schedule.options, {lr = 3e-3, min_lr = 3e-4, warmup = 1, total = 2, decay = 0.5}, "the config's values")
  T.eq({rn.recipe.name, rn.recipe.text}, {"bf16", "bf16"})

  -- a schedule put into the parts after train.build: config.json says what ran, not "wsd"; a
  -- function there is not called outside the loop (it may be a hook)
  local hook_line, calls = nil, 0
  local _, _, c4 = run("swapped", {"schedule=wsd"}, nil, function(p)
    hook_line, p.schedule = debug.getinfo(1, "l").currentline, function() calls = calls + 1; return 1e-3 end
  end)
  T.eq(calls, 2, "called by the two steps alone")
  local sw = json(c4.out .. "/config.json").schedule
  T.eq(sw.kind, "lua function")
  T.eq(sw.defined_at, SRC .. ":" .. hook_line)
  T.eq(sw.samples, nil)
  T.eq(sw.not_sampled, "not the config's schedule: the run's lr is in metrics.jsonl")
  T.eq(json(c4.out .. "/run.json").schedule, sw)

  -- what is not a schedule is refused, naming the key
  T.raises(function() config.parse(train.schema, args_for("bad"), {schedule = 42}) end,
    "config: schedule must be a schedule value or function or one of wsd, cosine, linear, constant, got 42")
  T.raises(function() schedule.describe("wsd") end,
    "schedule.describe: expects a schedule value or a function(step) -> lr, got string")
end)

T.case("a per-layer recipe records the format of each operand of each linear's GEMMs", function()
  local per_layer = recipe.custom(function(c)
    if c.high_precision then return "bf16" end
    if c.block == 0 then return {format = "nvfp4", block = c.operand == "w" and "2d" or "1d"} end
    return "e4m3"
  end)
  local own = recipe.custom(function() return "bf16" end)
  local _, _, c = run("per_layer", {}, {recipe = per_layer}, function(p)
    for _, l in ipairs(p.model:linears()) do
      if l.name == "model.layers.1.mlp.down_proj" then l.module.recipe = own end
    end
  end)
  local r = json(c.out .. "/run.json").recipe
  local NV = {fprop = {x = "nvfp4 1x16", w = "nvfp4 16x16", out = "bf16"},
    dgrad = {dy = "nvfp4 1x16", w = "nvfp4 16x16 (fprop's, t)", out = "bf16"},
    wgrad = {dy = "nvfp4 1x16", x = "nvfp4 1x16", out = "f32"}}
  local E4 = {fprop = {x = "e4m3 tensor", w = "e4m3 tensor", out = "bf16"},
    dgrad = {dy = "e4m3 tensor", w = "e4m3 tensor (fprop's, t)", out = "bf16"},
    wgrad = {dy = "e4m3 tensor", x = "e4m3 tensor", out = "f32"}}
  local BF = {fprop = {x = "bf16", w = "bf16", out = "bf16"}, dgrad = {dy = "bf16", w = "bf16 (fprop's, t)", out = "bf16"},
    wgrad = {dy = "bf16", x = "bf16", out = "f32"}}
  local names = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
    "mlp.up_proj", "mlp.down_proj"}
  local want = {}
  for b = 0, 1 do
    for _, n in ipairs(names) do
      local g = b == 0 and NV or (n == "mlp.down_proj" and BF or E4)
      local row = {name = "model.layers." .. b .. "." .. n, block = b, high_precision = false, fprop = g.fprop,
        dgrad = g.dgrad, wgrad = g.wgrad}
      if g == BF then row.recipe = "custom(seed=1234)" end
      want[#want + 1] = row
    end
  end
  want[#want + 1] = {name = "lm_head", high_precision = true, fprop = BF.fprop, dgrad = BF.dgrad, wgrad = BF.wgrad}
  T.eq(#r.layers, #want)
  for i, row in ipairs(want) do T.eq(r.layers[i], row, row.name) end
  local t = {nvfp4 = 7, e4m3 = 6, bf16 = 2}
  T.eq(r.totals, {fprop = t, dgrad = t, wgrad = t})
  T.eq(r.step, 0)
end)

-- ---- resume ------------------------------------------------------------------------------------

-- the command line of this process, as the record takes it (the global arg, lowest index first)
local function own_command()
  local lo, out = 0, {}
  while arg[lo - 1] ~= nil do lo = lo - 1 end
  for i = lo, #arg do out[#out + 1] = arg[i] end
  return out
end

T.case("resume=auto keeps the first record byte for byte and appends each resume", function()
  local _, _, c = run("resume", {"save=true"})
  local path = c.out .. "/run.json"
  local first = assert(T.read_file(path))
  T.eq(first:sub(-3), "\n}\n")
  local function kept(text) return text:sub(1, #first - 3) == first:sub(1, -4) end
  local s2 = run("resume", {"save=true", "steps=3", "resume=auto"})
  T.eq(s2.steps, 3)
  local text = assert(T.read_file(path))
  T.ok(kept(text), "the first record is unchanged")
  local rj = cjson.decode(text)
  T.eq(#rj.resumes, 1)
  local e = rj.resumes[1]
  T.eq(e.start_step, 2)
  T.eq(e.resumed_from, c.out .. "/checkpoints/step-000002")
  T.eq(e.command, own_command())
  T.ok(e.time:match("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$"), e.time)
  T.eq({e.script.copy, e.script.same}, {rj.script.copy, true}, "the same script: its first copy")
  T.eq(e.schedule.options.total, 3, "the schedule changed with steps: recorded again")
  T.eq(e.recipe, nil, "the recipe did not change")
  T.eq(rj.start_step, 0)
  run("resume", {"save=true", "steps=4", "resume=auto"})
  text = assert(T.read_file(path))
  T.ok(kept(text), "still unchanged after a second resume")
  rj = cjson.decode(text)
  T.eq(#rj.resumes, 2)
  T.eq(rj.resumes[2].start_step, 3)

  -- a run.json that is not a record: set aside (said on stderr), a new record begun
  T.write_file(path, "not a record\n")
  local s5 = run("resume", {"save=true", "steps=5", "resume=auto"})
  T.eq(s5.steps, 5)
  T.eq(T.read_file(path .. ".unreadable"), "not a record\n")
  T.eq(json(path).start_step, 4)
  T.eq(json(path).resumed_from, c.out .. "/checkpoints/step-000004")
end)

T.case("cleanup", function()
  T.ok(T.rm_tree(ROOT))
end)
