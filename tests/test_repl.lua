-- tests/test_repl.lua: the nvlua program itself (lua/bind/main.c and repl.c): a command line
-- compatible with Lua 5.4's `lua` (arg, -e -l -i -v -E -W - --, LUA_INIT, errors and exit
-- status), the REPL driven through a pipe, the built-in modules, and package.path (the nvlua
-- library, NVLUA_PATH).
-- Not here: interactive line editing, history and Ctrl-C at a prompt, which need a terminal.
-- Every case runs the binary as a child process: stdin from a file (/dev/null unless given),
-- stdout and stderr captured apart, and the variables that nvlua reads removed from its
-- environment unless the case sets them.
local T = require "nvlua.test"
local lfs = require "lfs"

local shq = T.shq
local NVLUA = T.nvlua()

local function need_nvlua()
  if not lfs.attributes(NVLUA, "mode") then T.skip("no nvlua binary at " .. NVLUA) end
end

local run = T.run_nvlua

-- A REPL session: the statements in text are fed to nvlua through a pipe.
local function repl(text, opts)
  opts = opts or {}
  opts.stdin = text
  return run(opts.args or "", opts)
end

local function has(s, part, what)
  T.ok(s:find(part, 1, true), string.format("%s should contain %q, got %q", what or "output", part, s))
end

-- ---- the REPL through a pipe -------------------------------------------------------------

T.case("REPL prints the value of an expression", function()
  need_nvlua()
  local r = repl("1+1\n")
  T.eq(r.out, "2\n", "stdout (no banner, no prompts through a pipe)")
  T.eq(r.err, "", "stderr")
  T.eq(r.code, 0, "exit status")
end)

T.case("REPL continues a statement over several lines", function()
  need_nvlua()
  local r = repl("function f(x)\n  return x*2\nend\nf(21)\n")
  T.eq(r.out, "42\n")
  T.eq(r.err, "")
end)

T.case("REPL: an error does not end the session", function()
  need_nvlua()
  local r = repl("error('boom')\n40+2\n")
  T.eq(r.out, "42\n")
  has(r.err, "stdin:1: boom", "stderr")
  has(r.err, "stack traceback:", "stderr")
  T.eq(r.err:find("nvlua: ", 1, true), nil, "no program name on REPL errors (as lua.c)")
  T.eq(r.code, 0)
end)

T.case("REPL has nv and help", function()
  need_nvlua()
  local r = repl("type(nv), type(help)\nnv == require 'nvlua'\n")
  T.eq(r.out, "table\tfunction\ntrue\n")
  T.eq(r.err, "")
end)

T.case("REPL: several values, statements, =expr, locals per line", function()
  need_nvlua()
  local r = repl("x = 5\n1, 'a', nil\nx\n=x+1\nlocal y = 1\ny\n")
  T.eq(r.out, "1\ta\tnil\n5\n6\nnil\n")
  T.eq(r.err, "")
end)

-- The printer's layout (nvlua.pretty) is the contract written here: a plain table as a Lua
-- constructor, keys sorted (the list part first), one "key = value," per line when it does not fit
-- on one line, strings quoted.
T.case("REPL prints API tables readably: nv.formats.nvfp4, nv.info(), nv.memory()", function()
  need_nvlua()
  local nv = require "nvlua"
  local traits = nv.formats.nvfp4
  local keys = {}
  for k in pairs(traits) do keys[#keys + 1] = k end
  table.sort(keys)
  local lines = {}
  for _, k in ipairs(keys) do
    local v = traits[k]
    lines[#lines + 1] = "  " .. k .. " = " .. (type(v) == "string" and '"' .. v .. '"' or tostring(v))
  end
  local r = repl("nv.formats.nvfp4\n")
  T.eq(r.out, "{\n" .. table.concat(lines, ",\n") .. "\n}\n", "nv.formats.nvfp4")
  T.eq(r.err, "")
  r = repl("nv.info()\nnv.memory()\n")
  has(r.out, '\n  version = "' .. nv.version .. '"', "nv.info()")
  has(r.out, "  peak = {cpu = ", "nv.memory(), nested on one line")
  T.eq(r.out:find("table: 0x", 1, true), nil, "no table addresses: " .. r.out)
  r = repl("nv.ones(2), {t = nv.ones(2)}\n")
  T.eq(r.out, " 1  1\n[nvlua.Tensor f32 2]\t{\n  t =\n     1  1\n    [nvlua.Tensor f32 2]\n}\n",
    "a tensor as print shows it; in a table, under its key")
end)

T.case("pretty.format: sorted keys, one line when it fits, cycles, large tables cut", function()
  local pretty = require "nvlua.pretty"
  T.eq(pretty.format({1, 2, {3, 4}, x = {5, 6}}), "{1, 2, {3, 4}, x = {5, 6}}")
  T.eq(pretty.format({b = 1, a = "s", [10] = true, ["a b"] = 2, ["end"] = 3}),
    '{[10] = true, a = "s", ["a b"] = 2, b = 1, ["end"] = 3}', "numbers first; keys that are not names bracketed")
  T.eq(pretty.format({}), "{}")
  T.eq(pretty.format("a\n\"b\""), '"a\\n\\"b\\""', "a string quoted, escapes shown")
  local cyc = {}
  cyc.self = cyc
  T.eq(pretty.format(cyc), "{self = <cycle>}")
  local shared = {1}
  T.eq(pretty.format({shared, shared}), "{{1}, {1}}", "a table met twice, not inside itself, is no cycle")
  local long = {}
  for i = 1, 60 do long[i] = i end
  local text = pretty.format(long, {width = 40})
  T.ok(text:find("^{\n  1, 2, 3,"), "a long list filled into lines: " .. text)
  T.ok(text:find("\n  %.%.%. 10 more\n}$"), "cut after 50 entries: " .. text)
  for line in text:gmatch("[^\n]+") do T.ok(#line <= 40, "lines fit the width: " .. line) end
  T.eq(pretty.format({a = {b = {c = {d = {e = 1}}}}}, {depth = 2}), "{a = {b = {...1 entries}}}", "depth")
  T.eq(pretty.format({k = setmetatable({}, {__tostring = function() return "custom" end})}), "{k = custom}",
    "a value's own __tostring")
end)

T.case("REPL: a statement left open at end of input is a syntax error", function()
  need_nvlua()
  local r = repl("for i = 1, 2 do\n")
  T.eq(r.out, "")
  has(r.err, "'end' expected near <eof>", "stderr")
  T.eq(r.code, 0)
end)

T.case("REPL: SIGINT interrupts running code, not the session", function()
  need_nvlua()
  -- The child shell's parent is nvlua: the signal arrives while the chunk runs, whatever the timing.
  local r = repl('p = io.popen("kill -INT $PPID"); p:close(); for _ = 1, 3e9 do end\n40+2\n')
  has(r.err, "interrupted!", "stderr")
  T.eq(r.out, "42\n")
  T.eq(r.code, 0)
end)

T.case("-i runs the REPL after the script", function()
  need_nvlua()
  local dir = T.tmpdir()
  local script = T.write_file(dir .. "/s.lua", "y = 10\n")
  local r = run("-i " .. shq(script), {stdin = "y * 2\n"})
  T.rm_tree(dir)
  T.eq(r.out, "20\n")
  T.eq(r.err, "")
end)

-- ---- the command line --------------------------------------------------------------------

T.case("-e runs a statement", function()
  need_nvlua()
  local r = run("-e 'print(1)'")
  T.eq(r.out, "1\n")
  T.eq(r.err, "")
  T.eq(r.code, 0)
  r = run("-e 'x = 2' -e 'print(x * 3)'")
  T.eq(r.out, "6\n", "two -e in order")
end)

T.case("-v reports Lua, nvlua, BLAS, oneDNN, OpenMP's wait, CUDA, cuDNN and GPUs", function()
  need_nvlua()
  local r = run("-v")
  T.eq(r.code, 0)
  T.eq(r.err, "")
  local lines = {}
  for l in r.out:gmatch("[^\n]+") do lines[#lines + 1] = l end
  T.ok(#lines >= 7, "at least 7 lines: " .. r.out)
  T.ok(lines[1]:match("^Lua 5%.4"), "Lua line: " .. lines[1])
  T.ok(lines[2]:match("^nvlua %d+%.%d+"), "nvlua line: " .. lines[2])
  T.ok(lines[3]:match("^BLAS: %S"), "BLAS line: " .. lines[3])
  T.ok(lines[4]:match("^bf16 GEMMs: oneDNN %d+%.%d+%.%d+, bf16 GEMMs on %S+ %(.+%)$") or
    lines[4]:match("^bf16 GEMMs: oneDNN.*not used %(.+%): bf16 GEMMs on sgemm$") or
    lines[4] == "bf16 GEMMs: oneDNN: not compiled in (bf16 GEMMs on sgemm)", "oneDNN line: " .. lines[4])
  T.eq(lines[5], "OpenMP: GOMP_SPINCOUNT=5000 (nvlua's default: idle threads yield the cores soon)")
  table.remove(lines, 5)
  T.ok(lines[5] == "CUDA: not compiled in" or lines[5]:match("^CUDA: compiled in %(runtime %d+%.%d+, cuBLASLt %d+%)$"),
    "CUDA line: " .. lines[5])
  local n = 6
  if lines[n] and lines[n]:match("^CUDA: emulated") then n = n + 1 end
  if lines[5] ~= "CUDA: not compiled in" then -- a CUDA build says what became of cuDNN
    T.ok(lines[n]:match("^cuDNN: not compiled in %(.+%)$") or
      lines[n]:match("^cuDNN: headers %d+%.%d+%.%d+, library %d+%.%d+%.%d+ %(.+%)$") or
      lines[n]:match("^cuDNN: headers %d+%.%d+%.%d+, library not loaded %(.+%)$"), "cuDNN line: " .. tostring(lines[n]))
    n = n + 1
  end
  T.ok(lines[n], "a GPUs line: " .. r.out)
  if lines[n]:match("^GPUs: ") then
    T.ok(lines[n]:match("^GPUs: none %(.+%)$"), "GPUs line: " .. lines[n])
    T.eq(#lines, n)
  else
    for i = n, #lines do
      T.ok(lines[i]:match("^GPU %d+: .+, [%d.]+ GiB, compute capability %d+%.%d+"), "GPU line: " .. lines[i])
    end
  end
  r = run("-v -e 'print(\"after\")'")
  T.ok(r.out:match("\nafter\n$"), "-v then -e")
end)

T.case("a script error exits 1 with a traceback", function()
  need_nvlua()
  local dir = T.tmpdir()
  local script = T.write_file(dir .. "/bad.lua", "local function g() error('kaboom') end\ng()\n")
  local r = run(shq(script))
  T.rm_tree(dir)
  T.eq(r.code, 1)
  T.eq(r.out, "")
  has(r.err, "nvlua: " .. script .. ":1: kaboom\nstack traceback:\n", "stderr")
  has(r.err, script .. ":2: in main chunk", "stderr")
end)

T.case("errors that are not strings, missing scripts", function()
  need_nvlua()
  local r = run("-e 'error({})'")
  T.eq(r.code, 1)
  has(r.err, "nvlua: (error object is a table value)", "stderr")
  r = run("-e 'error(setmetatable({}, {__tostring = function() return \"custom\" end}))'")
  T.eq(r.err, "nvlua: custom\n")
  r = run("/nonexistent/script.lua")
  T.eq(r.code, 1)
  has(r.err, "nvlua: cannot open /nonexistent/script.lua", "stderr")
end)

T.case("arg holds the script, its arguments and, below 0, the interpreter and options", function()
  need_nvlua()
  local dir = T.tmpdir()
  local script = T.write_file(dir .. "/args.lua",
    "print(arg[0], #arg, arg[1], arg[2], arg[-1], arg[-2], arg[-3], select('#', ...), ...)\n")
  local r = run("-W " .. shq(script) .. " a 'b c'")
  T.eq(r.out, table.concat({script, "2", "a", "b c", "-W", NVLUA, "nil", "2", "a", "b c"}, "\t") .. "\n")
  T.eq(r.code, 0)
  r = run("-- " .. shq(script) .. " -v")
  T.eq(r.out, table.concat({script, "1", "-v", "nil", "--", NVLUA, "nil", "1", "-v"}, "\t") .. "\n",
    "-- ends the options")
  T.rm_tree(dir)
  -- No script: arg[0] is the interpreter and every option is positive (as lua.c does).
  r = run("-e 'print(#arg, arg[0], arg[1], arg[-1])'")
  T.eq(r.out, "2\t" .. NVLUA .. "\t-e\tnil\n")
end)

T.case("- runs the script read from stdin", function()
  need_nvlua()
  local r = run("- x y", {stdin = "print(arg[0], ...)\n"})
  T.eq(r.out, "-\tx\ty\n")
  T.eq(r.code, 0)
end)

T.case("-l requires a module into a global", function()
  need_nvlua()
  T.eq(run("-l lfs -e 'print(type(lfs), lfs == package.loaded.lfs)'").out, "table\ttrue\n")
  T.eq(run("-l fs=lfs -e 'print(type(fs), fs == package.loaded.lfs)'").out, "table\ttrue\n")
  local r = run("-l no_such_module_xyz")
  T.eq(r.code, 1)
  has(r.err, "module 'no_such_module_xyz' not found", "stderr")
end)

T.case("bad options print the usage and exit 1", function()
  need_nvlua()
  local r = run("-x")
  T.eq(r.code, 1)
  has(r.err, "nvlua: unrecognized option '-x'\nusage: nvlua [options] [script [args]]", "stderr")
  r = run("-e")
  T.eq(r.code, 1)
  has(r.err, "nvlua: '-e' needs argument", "stderr")
  T.eq(r.out, "")
end)

T.case("os.exit keeps its status", function()
  need_nvlua()
  T.eq(run("-e 'os.exit(3)'").code, 3)
  T.eq(run("-e 'os.exit(false)'").code, 1)
  local r = run("-e 'io.write(\"x\") os.exit(true, true)'")
  T.eq(r.code, 0)
  T.eq(r.out, "x")
end)

T.case("-W turns warnings on", function()
  need_nvlua()
  T.eq(run("-W -e 'warn(\"careful\")'").err, "Lua warning: careful\n")
  T.eq(run("-e 'warn(\"careful\")'").err, "")
end)

T.case("LUA_INIT runs first; -E ignores it", function()
  need_nvlua()
  T.eq(run("-e 'print(x_init)'", {env = {LUA_INIT = "x_init = 7"}}).out, "7\n")
  T.eq(run("-E -e 'print(x_init)'", {env = {LUA_INIT = "x_init = 7"}}).out, "nil\n")
  T.eq(run("-e 'print(x_init)'", {env = {LUA_INIT = "x_init = 7", LUA_INIT_5_4 = "x_init = 8"}}).out, "8\n")
  local dir = T.tmpdir()
  local init = T.write_file(dir .. "/init.lua", "x_init = 9\n")
  T.eq(run("-e 'print(x_init)'", {env = {LUA_INIT = "@" .. init}}).out, "9\n")
  T.rm_tree(dir)
  local r = run("-e 'print(1)'", {env = {LUA_INIT = "error('in init')"}})
  T.eq(r.code, 1)
  T.eq(r.out, "")
  has(r.err, "nvlua: LUA_INIT:1: in init", "stderr")
end)

-- ---- modules and paths -------------------------------------------------------------------

T.case("lfs and nvlua.core are built in, whatever the module paths", function()
  need_nvlua()
  local garbage = {LUA_PATH = "/nonexistent/?.lua", LUA_CPATH = "/nonexistent/?.so",
    LUA_PATH_5_4 = "/nonexistent/?.lua", LUA_CPATH_5_4 = "/nonexistent/?.so"}
  local code = "-e 'print(type(require(\"lfs\").currentdir()), type(require(\"nvlua.core\")))'"
  for _, flags in ipairs({"-E ", ""}) do
    local r = run(flags .. code, {env = garbage})
    T.eq(r.out, "string\ttable\n", flags .. "stdout")
    T.eq(r.err, "", flags .. "stderr")
  end
end)

T.case("NVLUA_PATH is prepended to package.path; -E ignores it", function()
  need_nvlua()
  local dir = T.tmpdir()
  T.write_file(dir .. "/nvl_repl_test_mod.lua", "return 'from NVLUA_PATH'\n")
  assert(lfs.mkdir(dir .. "/nvlua"))
  T.write_file(dir .. "/nvlua/init.lua", "return 'shadow'\n")
  local env = {NVLUA_PATH = dir .. "/?.lua;" .. dir .. "/?/init.lua"}
  local default = run("-e 'io.write(package.path)'").out
  local r = run("-e 'print((require \"nvl_repl_test_mod\"), (require \"nvlua\"))' -e 'io.write(package.path)'", {env = env})
  T.eq(r.out, "from NVLUA_PATH\tshadow\n" .. env.NVLUA_PATH .. ";" .. default, "before the nvlua library")
  T.eq(r.err, "")
  -- ";;" stands for the default path, as in LUA_PATH.
  r = run("-e 'io.write(package.path)'", {env = {NVLUA_PATH = dir .. "/?.lua;;/x/?.lua"}})
  T.eq(r.out, dir .. "/?.lua;" .. default .. ";/x/?.lua")
  r = run("-E -e 'require \"nvl_repl_test_mod\"'", {env = env})
  T.eq(r.code, 1)
  has(r.err, "module 'nvl_repl_test_mod' not found", "stderr")
  T.rm_tree(dir)
end)

T.case("the nvlua library is found from any directory", function()
  need_nvlua()
  local dir = T.tmpdir()
  local code = "-e 'local nv = require \"nvlua\"; print(type(nv), package.searchpath(\"nvlua\", package.path) ~= nil)'"
  T.eq(run(code, {cd = dir}).out, "table\ttrue\n")
  T.eq(run("-E " .. code, {cd = dir}).out, "table\ttrue\n", "-E")
  local r = repl("type(nv)\n", {cd = dir})
  T.eq(r.out, "table\n", "REPL")
  T.eq(r.err, "", "REPL stderr")
  T.rm_tree(dir)
end)
