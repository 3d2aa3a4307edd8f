-- nvlua.test: the test harness used by tests/*.lua and run by tests/run.lua.
--   local T = require "nvlua.test"
--   T.case("name", function() T.eq(a, b) ... end)
-- A test file only registers cases; the runner runs them, prints one line per case and the
-- closing "N passed, N failed, N skipped". Assertions raise; T.skip(reason) marks a case skipped.
local T = {}

local cases = {}
local SKIP = {}

function T.reset() cases = {} end
function T.cases() return cases end

--- Register a case.
function T.case(name, fn) cases[#cases + 1] = {name = name, fn = fn} end

--- Mark the running case skipped (ends it).
function T.skip(reason) error(setmetatable({reason = reason or "skipped"}, SKIP), 0) end
function T.is_skip(e) return getmetatable(e) == SKIP end

local emulated_case = false -- the running case called need_gpu in an emulation build

--- Skip the running case when no GPU is usable (the GPU test files' guard). In a build whose CUDA
-- backend runs on the CPU emulation of CUDA (-DNVLUA_CUDA=EMU) the case runs, and its result line
-- says "[CUDA emulated on the CPU]": it is not a GPU run.
function T.need_gpu()
  local nv = require("nvlua")
  if not nv.cuda.available() then T.skip("no GPU") end
  if nv.cuda.emulated() then emulated_case = true end
end

--- T.need_emu(): skip the case unless CUDA runs on the CPU emulation (-DNVLUA_CUDA=EMU): for cases
-- that read the emulator's counters or rely on its checks.
function T.need_emu()
  T.need_gpu()
  if not require("nvlua").cuda.emulated() then T.skip("needs the CUDA emulator (-DNVLUA_CUDA=EMU)") end
end

--- T.emulated() -> true when CUDA is the CPU emulation (test files use smaller sizes there).
function T.emulated() return require("nvlua").cuda.emulated() ~= nil end

--- T.with(set, value, fn, ...) -> fn(...)'s results, run with the setting set(value) (set returns
-- the previous value), which is restored afterwards, also when fn raises.
function T.with(set, value, fn, ...)
  local prev = set(value)
  local r = table.pack(pcall(fn, ...))
  set(prev)
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

local function show(v)
  if type(v) == "string" then return string.format("%q", v) end
  if type(v) ~= "table" then return tostring(v) end
  local parts = {}
  for i, x in ipairs(v) do
    if i > 16 then parts[#parts + 1] = "..."; break end
    parts[#parts + 1] = show(x)
  end
  return "{" .. table.concat(parts, ", ") .. "}"
end
T.show = show

local function fail(msg, level) error(msg, (level or 1) + 2) end

local function deep_eq(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) == "number" then return a == b or (a ~= a and b ~= b) end
  if type(a) ~= "table" then return a == b end
  for k, v in pairs(a) do if not deep_eq(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end
T.deep_eq = deep_eq

--- a equals b (deep for tables; NaN equals NaN; integers and floats compare by value).
function T.eq(a, b, msg)
  if not deep_eq(a, b) then fail(string.format("%sexpected %s, got %s", msg and msg .. ": " or "", show(b), show(a))) end
end

function T.ok(cond, msg)
  if not cond then fail(msg or "condition is false") end
end

--- |a - b| <= tol
function T.near(a, b, tol, msg)
  if not (math.abs(a - b) <= tol) then
    fail(string.format("%sexpected %.9g within %g, got %.9g", msg and msg .. ": " or "", b, tol, a))
  end
end

--- fn() must raise an error whose message contains text (plain substring, else a Lua pattern).
function T.raises(fn, text, msg)
  local ok, err = pcall(fn)
  if ok then fail((msg and msg .. ": " or "") .. "expected an error" .. (text and (" containing '" .. text .. "'") or "")) end
  err = tostring(err)
  if text and not err:find(text, 1, true) then
    local pok, found = pcall(string.find, err, text)
    if not (pok and found) then
      fail(string.format("%serror message %q does not contain %q", msg and msg .. ": " or "", err, text))
    end
  end
  return err
end

--- Tensors a and b close elementwise: |a-b| <= atol + rtol*|b|.
function T.close(a, b, rtol, atol, msg)
  if not a:allclose(b, rtol or 1e-5, atol or 1e-8) then
    local d = (a:to("f32") - b:to("f32")):abs():max()
    fail(string.format("%stensors differ: max |a-b| = %g (rtol %g, atol %g)", msg and msg .. ": " or "", d, rtol or 1e-5,
      atol or 1e-8))
  end
end

--- Run the registered cases of one file; returns passed, failed, skipped.
function T.run(label, out)
  out = out or io.stdout
  local p, f, s = 0, 0, 0
  for _, c in ipairs(cases) do
    emulated_case = false
    local ok, err = xpcall(c.fn, function(e)
      if T.is_skip(e) then return e end
      return debug.traceback(tostring(e), 2)
    end)
    local name = emulated_case and c.name .. " [CUDA emulated on the CPU]" or c.name
    if ok then
      p = p + 1
      out:write(string.format("ok   %s: %s\n", label, name))
    elseif T.is_skip(err) then
      s = s + 1
      out:write(string.format("skip %s: %s (%s)\n", label, name, err.reason))
    else
      f = f + 1
      out:write(string.format("FAIL %s: %s\n     %s\n", label, name, tostring(err):gsub("\n", "\n     ")))
    end
    out:flush()
  end
  return p, f, s
end

-- ---- files: whole-file reads and writes, scratch directories --------------------------------------

--- T.read_file(path) -> the file's bytes, or nil and io.open's message when it cannot be opened
-- (assert(T.read_file(path)) where the file must be there).
function T.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

--- T.write_file(path, text) -> path: the file created (or truncated) holding exactly text; raises
-- when it cannot be written.
function T.write_file(path, text)
  local f = assert(io.open(path, "wb"))
  assert(f:write(text))
  assert(f:close())
  return path
end

--- T.write_corpus(path, {seed =, lines =, words = {...}, prefix = function(i) -> string}) -> path: a
-- deterministic text corpus (the training tests' data): line i is prefix(i) (default "") and 8
-- words drawn by the LCG s = (s * 1103515245 + 12345) mod 2^31 (word s % #words + 1), then ".".
function T.write_corpus(path, o)
  local s, words, out = o.seed, o.words, {}
  for i = 1, o.lines do
    local w = {}
    for _ = 1, 8 do
      s = (s * 1103515245 + 12345) % 2147483648
      w[#w + 1] = words[s % #words + 1]
    end
    out[i] = (o.prefix and o.prefix(i) or "") .. table.concat(w, " ") .. "."
  end
  return T.write_file(path, table.concat(out, "\n") .. "\n")
end

--- T.tmpdir() -> the path of a fresh empty directory (a name from os.tmpname); T.rm_tree removes it.
function T.tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(require("lfs").mkdir(d))
  return d
end

--- T.dir_maker(root) -> fresh(name): each call of fresh makes and returns a new empty directory
-- root/NN_name, NN counting the calls (01, 02, ...), so every case gets its own place under root.
function T.dir_maker(root)
  local n = 0
  return function(name)
    n = n + 1
    local d = string.format("%s/%02d_%s", root, n, name)
    assert(require("lfs").mkdir(d))
    return d
  end
end

--- T.rm_tree(path) -> true when nothing is left at path, else nil and a message: a directory is
-- removed with everything below it, anything else (a file, a link) is removed itself; links are
-- not followed. A path that does not exist is left as it is (true).
function T.rm_tree(path)
  local lfs = require "lfs"
  local mode = lfs.symlinkattributes(path, "mode")
  if mode == "directory" then
    for n in lfs.dir(path) do
      if n ~= "." and n ~= ".." then T.rm_tree(path .. "/" .. n) end
    end
    lfs.rmdir(path)
  elseif mode then
    os.remove(path)
  end
  if lfs.symlinkattributes(path, "mode") then return nil, "rm_tree: " .. path .. " could not be removed" end
  return true
end

-- ---- child processes: the nvlua binary run as a program ----------------------------------------

--- T.shq(s) -> s quoted for /bin/sh
function T.shq(s) return "'" .. (tostring(s):gsub("'", "'\\''")) .. "'" end

--- T.nvlua() -> the absolute path of the nvlua binary running the tests: /proc/self/exe, else the
-- interpreter in arg (its lowest index, as lua.c sets it), else build/nvlua.
function T.nvlua()
  local lfs = require "lfs"
  local exe = lfs.symlinkattributes("/proc/self/exe", "target")
  if type(exe) == "string" and exe:match("/nvlua[^/]*$") then return exe end
  local bin = "build/nvlua"
  if type(arg) == "table" then
    local lo = 0
    while arg[lo - 1] ~= nil do lo = lo - 1 end
    if lo < 0 then bin = arg[lo] end
  end
  if bin:find("/", 1, true) and bin:sub(1, 1) ~= "/" then bin = lfs.currentdir() .. "/" .. bin end
  return bin
end

-- Variables that change what nvlua does; cleared for every child unless opts.env sets them.
-- (OpenMP's wait settings too: the child then starts as a user's nvlua does, with nvlua's default.)
T.NVLUA_ENV = {"NVLUA_PATH", "NVLUA_TRACEBACK", "LUA_INIT", "LUA_INIT_5_4", "LUA_PATH", "LUA_PATH_5_4", "LUA_CPATH",
  "LUA_CPATH_5_4", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "NVLUA_OMP_DEFAULT"}

--- T.run_nvlua(args [, {stdin = text, env = {name = value}, cd = dir}]) -> {out =, err =, code =}: the
-- binary run with args (a string, already quoted for the shell), stdin from the text (else
-- /dev/null), stdout and stderr captured apart; code is the exit status, -1 when killed by a signal.
function T.run_nvlua(args, opts)
  opts = opts or {}
  local out, err = os.tmpname(), os.tmpname()
  local input = opts.stdin and T.write_file(os.tmpname(), opts.stdin)
  local cmd = {"unset " .. table.concat(T.NVLUA_ENV, " ") .. ";"}
  if opts.cd then cmd[#cmd + 1] = "cd " .. T.shq(opts.cd) .. " &&" end
  for k, v in pairs(opts.env or {}) do cmd[#cmd + 1] = k .. "=" .. T.shq(v) end
  cmd[#cmd + 1] = T.shq(T.nvlua()) .. " " .. args
  cmd[#cmd + 1] = "<" .. (input and T.shq(input) or "/dev/null") .. " >" .. T.shq(out) .. " 2>" .. T.shq(err)
  local _, how, code = os.execute(table.concat(cmd, " "))
  local r = {out = assert(T.read_file(out)), err = assert(T.read_file(err)), code = how == "exit" and code or -1}
  os.remove(out)
  os.remove(err)
  if input then os.remove(input) end
  return r
end

--- T.logit_bytes(model, ids) -> the bytes of model's logits on ids, in eval mode (the logits freed)
function T.logit_bytes(model, ids)
  model:eval()
  local l = model:forward(ids)
  local b = l:bytes()
  l:free()
  return b
end

-- ---- tiny trained models -----------------------------------------------------------------------

--- T.trained_llama(cfg, recipe, ids [, steps = 3]) -> a Llama of config cfg (seed 1) under recipe (a
-- registered name or a recipe value) trained `steps` AdamW steps (lr 1e-2) on ids(g), g = Generator(3):
-- the same model each time; model.step is left at steps
function T.trained_llama(cfg, recipe, ids, steps)
  local nv, llama, optim = require "nvlua", require "nvlua.llama", require "nvlua.optim"
  if type(recipe) == "string" then recipe = nv.recipe.make(recipe) end
  local m = llama.Llama(cfg, {recipe = recipe, seed = 1})
  local opt = optim.AdamW(m:named_parameters(), {lr = 1e-2})
  local g = nv.Generator(3)
  steps = steps or 3
  for step = 1, steps do
    m.step = step - 1
    local x = ids(g)
    m:zero_grad()
    m:forward_backward(x, x)
    opt:step()
  end
  m.step = steps
  return m
end

return T
