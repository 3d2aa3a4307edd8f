-- nvlua.record: the run record. At the start of a run rank 0 writes into out= (record.start):
--   run.json     what ran, from what and where: nvlua's version and build facts (nv.info(), what
--                `nvlua -v` prints), the git commit and dirty flag of the tree holding the experiment
--                script, the command line, the script's path, host, start time (UTC), world size,
--                device, and the schedule and recipe the run uses, each described by itself
--                (schedule.describe: kind, options, sampled values; recipe:describe: name, settings,
--                the format of each operand of each linear's three GEMMs)
--   <script>     a byte-for-byte copy of the experiment script (its basename; script.lua when the
--                name does not end in .lua)
--   config.json  the resolved config; a value given from Lua (a recipe value, a schedule or a
--                function), or a part the experiment put in place of the one train.build made from
--                the config, is written as its description, never as the key's default
-- A resumed run keeps the first record as it was, byte for byte, and appends an entry to its
-- "resumes" list: time, commit, dirty, command, script, host, world, device, the checkpoint, and
-- the schedule and recipe where they differ from the first record's.
-- Not here: metrics (train.lua's metrics.jsonl), checkpoints (nvlua.checkpoint).
local nv = require "nvlua"
local core = require "nvlua.core"
local cjson = require "cjson"
local lfs = require "lfs"
local config = require "nvlua.config"
local schedule = require "nvlua.schedule"
local util = require "nvlua.util"

local record = {}

local null = cjson.null

-- ---- facts --------------------------------------------------------------------------------------

local function shq(s) return "'" .. (tostring(s):gsub("'", "'\\''")) .. "'" end

-- cmd's standard output and exit status (stderr folded into the output)
local function run(cmd)
  local f = io.popen(cmd .. " 2>&1", "r")
  if not f then return "", -1 end
  local out = f:read("a")
  local _, how, code = f:close()
  return out, how == "exit" and code or -1
end

--- record.git(dir [, own]) -> {commit, dirty, changes, root} of the git work tree holding dir: commit
-- is `git rev-parse HEAD`, dirty whether `git status --porcelain` lists anything (untracked files
-- included) but the directory own (absolute: the run's output, when it lies in the tree) and those
-- holding it, changes those lines (at most 100, only when dirty). Where there is no git, dir is in
-- no repository or it has no commit yet: {commit = null, dirty = null, reason = why}. Never raises.
function record.git(dir, own)
  local out, code = run("git -C " .. shq(dir) .. " rev-parse HEAD --show-toplevel")
  local commit, root = out:match("^(%x+)\n([^\n]*)")
  if code ~= 0 or not commit or #commit < 40 then
    local why = code == 127 and "git is not installed" or (out:match("[^\n]+") or ("git exited with " .. code))
    return {commit = null, dirty = null, reason = why}
  end
  local st, scode = run("git -C " .. shq(dir) .. " status --porcelain")
  if scode ~= 0 then
    return {commit = commit, root = root, dirty = null, reason = "git status: " .. (st:match("[^\n]+") or scode)}
  end
  -- own, relative to the root as status writes paths ("runs/x/"); a line about it, a path in it or
  -- an untracked directory holding it ("?? runs/") is this run's output, not a change to the source
  local rel
  if own then
    local o = own:gsub("/+$", "") .. "/"
    if o:sub(1, #root + 1) == root .. "/" and #o > #root + 1 then rel = o:sub(#root + 2) end
  end
  local changes = {}
  for line in st:gmatch("[^\n]+") do
    local f = line:sub(4):gsub('^"', "")
    local mine = rel and (f:sub(1, #rel) == rel or (f:sub(-1) == "/" and rel:sub(1, #f) == f))
    if not mine then changes[#changes + 1] = line end
  end
  local g = {commit = commit, root = root, dirty = #changes > 0}
  if #changes > 0 then
    if #changes > 100 then
      g.changes_total = #changes
      for i = #changes, 101, -1 do changes[i] = nil end
    end
    g.changes = changes
  end
  return g
end

--- record.command() -> the process's command line: {arg[lowest], ..., arg[#arg]} (the binary, its
-- options, the script, its arguments), or nil when there is no global arg (nvlua embedded)
function record.command()
  if type(arg) ~= "table" then return nil end
  local lo = 0
  while arg[lo - 1] ~= nil do lo = lo - 1 end
  local out = {}
  for i = lo, #arg do
    if arg[i] ~= nil then out[#out + 1] = tostring(arg[i]) end
  end
  return #out > 0 and out or nil
end

-- path made absolute from this process's current directory ("./" and "/./" dropped)
local function absolute(path)
  if path:sub(1, 1) ~= "/" then path = lfs.currentdir() .. "/" .. path end
  local n
  repeat path, n = path:gsub("/%./", "/") until n == 0
  path = path:gsub("/%.$", ""):gsub("(.)/+$", "%1")
  return path
end

--- record.script() -> {path (as given: arg[0]), abs (absolute, from this process's current
-- directory), dir, text (its bytes)}, or nil and why (no script: -e, stdin or the REPL; a file that
-- cannot be read)
function record.script()
  local path = type(arg) == "table" and arg[0]
  if type(path) ~= "string" or path == "" or path == "-" then
    return nil, "no script file (nvlua -e, stdin or the REPL)"
  end
  local abs = absolute(path)
  local f, err = io.open(abs, "rb")
  if not f then return nil, "cannot read the script: " .. tostring(err) end
  local text = f:read("a")
  f:close()
  return {path = path, abs = abs, dir = abs:match("^(.*)/[^/]*$") or "/", text = text}
end

local function hostname()
  local ok, h = pcall(core.hostname)
  return ok and h ~= "" and h or null
end

-- nv.info(), as a record holds it: versions also in words, no empty list
local function build_facts()
  local i = nv.info()
  local rt = i.cuda_runtime or 0
  i.cuda_runtime_text = i.cuda_compiled and string.format("%d.%d", rt // 1000, rt % 1000 // 10) or nil
  local function v3(v) return v > 0 and string.format("%d.%d.%d", v // 10000, v // 100 % 100, v % 100) or nil end
  i.cudnn.compiled = v3(i.cudnn.compiled_version)
  i.cudnn.library = v3(i.cudnn.version)
  if #i.gpus == 0 then i.gpus = nil end
  return i
end

-- The environment variables that change what a run computes or how fast (OpenMP's threads and wait,
-- BLAS, oneDNN, CUDA devices, NCCL, nvlua's own), from /proc/self/environ: {name = value}, or null
-- where none is set or the file cannot be read.
local ENV_PATTERNS = {"^OMP_", "^GOMP_", "^KMP_", "^OPENBLAS_", "^ONEDNN_", "^DNNL_", "^NVLUA_", "^CUDA_",
  "^NCCL_", "^CUBLAS", "^CUDNN_"}
local function run_environment()
  local f = io.open("/proc/self/environ", "rb")
  if not f then return null end
  local text = f:read("a")
  f:close()
  local env, any = {}, false
  for kv in text:gmatch("[^%z]+") do
    local k, v = kv:match("^([^=]+)=(.*)$")
    if k then
      for _, pat in ipairs(ENV_PATTERNS) do
        if k:match(pat) then env[k], any = v, true break end
      end
    end
  end
  return any and env or null
end

-- ---- descriptions ---------------------------------------------------------------------------------

--- record.describe_schedule(s, c) -> schedule.describe(s) with the config's steps and warmup, sampled
-- where s is a schedule value (a function of the step by construction) or the config's schedule (a
-- function given as the schedule key is called at the sample steps as the run starts: a function of
-- the step alone). A function an experiment put into the parts in place of the config's (a hook,
-- perhaps, with effects of its own) is called by the training loop alone: its values are the lr of
-- metrics.jsonl.
function record.describe_schedule(s, c)
  local sample = schedule.is_schedule(s) or rawequal(s, c.schedule)
  local d = schedule.describe(s, {steps = c.steps, warmup = c.warmup, sample = sample})
  if not sample then d.not_sampled = "not the config's schedule: the run's lr is in metrics.jsonl" end
  return d
end

--- record.describe_recipe(r [, model [, step]]) -> recipe:describe({model, step}) for a recipe value
-- (its per-layer plan needs the model); {text = tostring(r)} for a recipe of another kind (a table
-- with linear_forward and linear_backward); the plan's error in plan_error if it fails
function record.describe_recipe(r, model, step)
  if not nv.recipe.is_recipe(r) then return {text = tostring(r)} end
  local ok, d = pcall(r.describe, r, {model = model, step = step})
  if ok then return d end
  local d0 = r:describe()
  d0.plan_error = tostring(d)
  return d0
end

--- record.config_view(c, p [, made]) -> a copy of the config c for config.json: a recipe value, a
-- schedule value or a function held by a key is replaced by its description, and so are the run's
-- recipe and schedule (p.recipe, p.schedule) where made(v) says train.build did not make them from
-- the config (an experiment put its own into the parts). Other values as they are.
function record.config_view(c, p, made)
  local v = {}
  for k, x in pairs(c) do v[k] = x end
  made = made or function() return true end
  for k, x in pairs(c) do
    if nv.recipe.is_recipe(x) then
      v[k] = record.describe_recipe(x)
    elseif schedule.is_schedule(x) or type(x) == "function" then
      v[k] = record.describe_schedule(x, c)
    end
  end
  if p.recipe ~= nil and not made(p.recipe) then v.recipe = record.describe_recipe(p.recipe) end
  if p.schedule ~= nil and not made(p.schedule) then v.schedule = record.describe_schedule(p.schedule, c) end
  return v
end

-- ---- JSON -----------------------------------------------------------------------------------------

-- v as indented JSON text (config.encode's values: sorted keys, exact numbers): a table whose
-- one-line form fits in WIDTH columns stays on one line. The record holds no empty list (an empty
-- table is written {}).
local WIDTH = 110
local function pretty(v, ind)
  local one = config.encode(v)
  if type(v) ~= "table" or getmetatable(v) or ind + #one <= WIDTH then return one end
  local pad, inner = string.rep(" ", ind), string.rep(" ", ind + 2)
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  local parts = {}
  if #v > 0 and #keys == #v then
    for i = 1, #v do parts[i] = inner .. pretty(v[i], ind + 2) end
    return "[\n" .. table.concat(parts, ",\n") .. "\n" .. pad .. "]"
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for i, k in ipairs(keys) do parts[i] = inner .. cjson.encode(tostring(k)) .. ": " .. pretty(v[k], ind + 2) end
  return "{\n" .. table.concat(parts, ",\n") .. "\n" .. pad .. "}"
end

local function write(path, text)
  local ok, err = util.atomic_write(path, text)
  if not ok then util.user_error("record: " .. path .. ": " .. err, 0) end
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local t = f:read("a")
  f:close()
  return t
end

-- ---- the record -----------------------------------------------------------------------------------

-- the script s (record.script(); why: its reason when nil) copied into run_dir: as its basename, else
-- script.lua; for the n-th resume, when it differs from the newest copy (last), as
-- <name>.resume-<n>.lua. -> {path, abs, copy, bytes, same (as last)} or {path = null, reason}
local function copy_script(run_dir, s, why, last, n)
  if not s then return {path = null, reason = why} end
  local base = s.abs:match("([^/]+)$")
  local name = base:match("%.lua$") and base or "script.lua"
  local d = {path = s.path, abs = s.abs, bytes = #s.text}
  if last then
    if read(run_dir .. "/" .. last) == s.text then
      d.copy, d.same = last, true
      return d
    end
    name = string.format("%s.resume-%d.lua", (name:gsub("%.lua$", "")), n)
    d.same = false
  end
  write(run_dir .. "/" .. name, s.text)
  d.copy = name
  return d
end

-- the newest copy of the script a record holds: its last resume's, else its first
local function latest_copy(first)
  local copy = type(first.script) == "table" and first.script.copy or nil
  for _, e in ipairs(type(first.resumes) == "table" and first.resumes or {}) do
    if type(e) == "table" and type(e.script) == "table" and type(e.script.copy) == "string" then copy = e.script.copy end
  end
  return copy
end

-- the world the run runs in: its size, this node's ranks, the launcher's backend
local function world_of(p)
  local w = {size = p.world or 1, rank = p.rank or 0, ranks_on_node = 1, backend = "none"}
  local dist = p.dist
  if dist and dist.initialized and dist.initialized() then
    w.backend, w.ranks_on_node = dist.backend(), dist.local_size()
  end
  return w
end

local function device_of(c, p)
  local d = {kind = c.device}
  if c.device == "cuda" and p.dist and p.dist.gpu then
    local ok, line = pcall(p.dist.gpu)
    if ok and line then d.gpu = line end
  end
  return d
end

--- record.start(run_dir, c, p [, {start_step = 0, resumed_from = dir, made = function(v)}]) -> the
-- record written (a table): config.json (record.config_view), and run.json with the script's copy;
-- or, resuming (start_step > 0) where run.json holds a record, that record with this start appended
-- to its resumes. Called by rank 0 alone. made: see record.config_view.
function record.start(run_dir, c, p, o)
  o = o or {}
  -- the tree is looked at before this run writes anything into it
  local script, why = record.script()
  local g = record.git(script and script.dir or lfs.currentdir(), absolute(run_dir))
  write(run_dir .. "/config.json", config.json(record.config_view(c, p, o.made)))
  local path = run_dir .. "/run.json"
  local old = (o.start_step or 0) > 0 and read(path) or nil
  local first
  if old then
    local ok, t = pcall(cjson.decode, old)
    if ok and type(t) == "table" and t.nvlua then
      first = t
    else -- not a record this module wrote: kept aside, and a new record started
      local aside = path .. ".unreadable"
      local mok, merr = os.rename(path, aside)
      if not mok then util.user_error(string.format("record: %s is not a run record, and moving it aside failed: %s", path,
        tostring(merr)), 0) end
      io.stderr:write(string.format("record: %s is not a run record; moved it to %s\n", path, aside))
      old = nil
    end
  end
  local now = os.date("!%Y-%m-%dT%H:%M:%SZ")
  local sched = p.schedule ~= nil and record.describe_schedule(p.schedule, c) or null
  local rec = p.recipe ~= nil and record.describe_recipe(p.recipe, p.model, o.start_step or 0) or null
  if not first then
    local r = {nvlua = nv.version, build = build_facts(), git = g, command = record.command() or null,
      cwd = lfs.currentdir(), script = copy_script(run_dir, script, why), host = hostname(), started = now,
      world = world_of(p), device = device_of(c, p), schedule = sched, recipe = rec, start_step = o.start_step or 0,
      resumed_from = o.resumed_from, environment = run_environment(), mfu_peak = o.mfu_peak or null}
    write(path, pretty(r, 0) .. "\n")
    return r
  end
  local n = (type(first.resumes) == "table" and #first.resumes or 0) + 1
  local e = {time = now, git = g, command = record.command() or null, cwd = lfs.currentdir(),
    script = copy_script(run_dir, script, why, latest_copy(first), n), host = hostname(),
    world = world_of(p), device = device_of(c, p), resumed_from = o.resumed_from or null, start_step = o.start_step,
    environment = run_environment(), mfu_peak = o.mfu_peak or null}
  -- the schedule and recipe again only where they changed (a config extended on resume, say)
  if config.encode(sched) ~= config.encode(first.schedule) then e.schedule = sched end
  if type(rec) == "table" and type(first.recipe) == "table" and rec.text ~= first.recipe.text then e.recipe = rec end
  -- appended to the text as written: the first record stays byte for byte (JSON numbers read back
  -- through cjson would not: a 64-bit seed)
  local entry, tail = "    " .. config.encode(e), "\n  ]\n}\n"
  local text
  if n > 1 and old:sub(-#tail) == tail then
    text = old:sub(1, -#tail - 1) .. ",\n" .. entry .. tail
  elseif n == 1 and old:sub(-3) == "\n}\n" then
    text = old:sub(1, -4) .. ",\n  \"resumes\": [\n" .. entry .. tail
  end
  local ok, t = pcall(cjson.decode, text or "")
  if not (ok and type(t) == "table" and type(t.resumes) == "table" and #t.resumes == n) then
    -- a record edited by hand: written again from what it reads as
    first.resumes = type(first.resumes) == "table" and first.resumes or {}
    first.resumes[n] = e
    text = pretty(first, 0) .. "\n"
  end
  write(path, text)
  return cjson.decode(text)
end

return record
