-- tests/test_progress.lua: the console's progress bar (train.progress_bar) appears only on an
-- interactive terminal of this process. A tiny run (1 layer, 4 steps, a line at steps 1, 3 and 4, the bar
-- at step 2) is run as a child under a pseudo-terminal (util-linux's `script`), and its bytes are read:
--   * TERM=xterm, no launcher: the bar ("\r[===...] 2/4 eta") and its erase-line escape are there;
--   * an MPI launcher's variables (Open MPI, PMIx, PMI), TERM=dumb or unset, NVLUA_PROGRESS=0: plain lines
--     only, with no "\r" and no escape, and the same step lines;
--   * NVLUA_PROGRESS=1 under a launcher: the bar; output to a file (no terminal): plain lines;
--     NVLUA_PROGRESS=yes: refused, naming the variable.
local T = require "nvlua.test"

local ROOT = T.tmpdir()

local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 7, lines = 200,
  words = {"in", "the", "beginning", "was", "light", "and", "darkness", "upon", "waters"}})
local SCRIPT = T.write_file(ROOT .. "/run.lua", 'require("nvlua.train").main({}, arg)\n')
local ARGS = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "out=" .. ROOT .. "/run", "overwrite=true", "layers=1",
  "hidden=32", "heads=2", "kv_heads=1", "ffn=64", "seq=16", "batch=2", "steps=4", "warmup=1", "log_every=3",
  "eval_every=0", "sample_tokens=0", "plot=false", "save=false", "recipe=bf16", "mfu_peak=1e9"}

-- every variable that decides the bar, cleared for each child unless set
local CLEARED = {"TERM", "NVLUA_PROGRESS", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
  "MV2_COMM_WORLD_SIZE"}

-- The child's command line: the run with env (name -> value) set and the other CLEARED unset
local function command(env)
  local parts = {"env"}
  for _, v in ipairs(CLEARED) do parts[#parts + 1] = "-u " .. v end
  parts[#parts + 1] = "-u NVLUA_TRACEBACK"
  local path = os.getenv("NVLUA_PATH") -- this file's Lua modules, where the runner was given them
  parts[#parts + 1] = path and "NVLUA_PATH=" .. T.shq(path) or "-u NVLUA_PATH"
  for k, v in pairs(env) do parts[#parts + 1] = k .. "=" .. T.shq(v) end
  parts[#parts + 1] = T.shq(T.nvlua()) .. " " .. T.shq(SCRIPT)
  for _, a in ipairs(ARGS) do parts[#parts + 1] = T.shq(a) end
  return table.concat(parts, " ")
end

local HAVE_SCRIPT = os.execute("script -qec true /dev/null >/dev/null 2>&1")

-- the child's output bytes (stdout and stderr, as the terminal got them) under a pseudo-terminal
local function under_pty(env)
  if not HAVE_SCRIPT then T.skip("no `script` (util-linux) to run a child under a pseudo-terminal") end
  local out = ROOT .. "/pty.out"
  local _, how, code = os.execute(string.format("script -qec %s /dev/null </dev/null >%s 2>&1", T.shq(command(env)),
    T.shq(out)))
  local text = assert(T.read_file(out))
  T.eq({how, code}, {"exit", 0}, "the child's exit status; its output:\n" .. text)
  return text
end

local BAR = "\r[" .. string.rep("=", 15) .. string.rep(" ", 15) .. "] 2/4 eta"
local ERASE = "\27[K"

-- the step lines the run printed, in order
local function step_lines(text)
  local l = {}
  for n in text:gmatch("step%s+(%d)/4 |") do l[#l + 1] = tonumber(n) end
  return l
end

local function has_bar(text, what)
  T.ok(text:find(BAR, 1, true), what .. ": the bar is there:\n" .. text)
  T.ok(text:find(ERASE, 1, true), what .. ": the erase-line escape is there")
  T.eq(step_lines(text), {1, 3, 4}, what .. ": the step lines")
end

local function plain(text, what)
  T.eq(text:find("\r[", 1, true), nil, what .. ": no bar:\n" .. text)
  T.eq(text:find("\27", 1, true), nil, what .. ": no escape code")
  T.eq(step_lines(text), {1, 3, 4}, what .. ": the same step lines")
  T.ok(text:find("MFU is against mfu_peak=1e9, 1 GFLOP/s", 1, true), what .. ": the peak's line")
end

T.case("on a terminal of its own (TERM=xterm, no launcher) the run draws the bar", function()
  has_bar(under_pty({TERM = "xterm"}), "TERM=xterm")
end)

T.case("under an MPI launcher, on a dumb or unnamed terminal, or with NVLUA_PROGRESS=0: plain lines", function()
  for _, env in ipairs({{TERM = "xterm", OMPI_COMM_WORLD_SIZE = "1"}, {TERM = "xterm", PMIX_RANK = "0"},
      {TERM = "xterm", PMI_RANK = "0"}, {TERM = "dumb"}, {}, {TERM = ""}, {TERM = "xterm", NVLUA_PROGRESS = "0"}}) do
    local what = {}
    for k, v in pairs(env) do what[#what + 1] = k .. "=" .. v end
    table.sort(what)
    plain(under_pty(env), table.concat(what, " "))
  end
end)

T.case("NVLUA_PROGRESS=1 draws it under a launcher; a file gets plain lines; NVLUA_PROGRESS=yes is refused", function()
  has_bar(under_pty({TERM = "xterm", OMPI_COMM_WORLD_SIZE = "1", NVLUA_PROGRESS = "1"}), "NVLUA_PROGRESS=1")
  local out = ROOT .. "/file.out"
  local _, how, code = os.execute(command({TERM = "xterm"}) .. " </dev/null >" .. T.shq(out) .. " 2>&1")
  T.eq({how, code}, {"exit", 0})
  plain(assert(T.read_file(out)), "stdout a file")
  _, how, code = os.execute(command({TERM = "xterm", NVLUA_PROGRESS = "yes"}) .. " </dev/null >" .. T.shq(out) .. " 2>&1")
  T.eq({how, code}, {"exit", 1})
  local text = assert(T.read_file(out))
  T.ok(text:find("NVLUA_PROGRESS must be 0 or 1, got 'yes'", 1, true), text)
end)

T.case("cleanup", function() T.ok(T.rm_tree(ROOT)) end)
