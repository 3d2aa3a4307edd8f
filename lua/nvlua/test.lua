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

--- Skip the running case when no GPU is usable (the GPU test files' guard).
function T.need_gpu()
  if not require("nvlua").cuda.available() then T.skip("no GPU") end
end

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
    local ok, err = xpcall(c.fn, function(e)
      if T.is_skip(e) then return e end
      return debug.traceback(tostring(e), 2)
    end)
    if ok then
      p = p + 1
      out:write(string.format("ok   %s: %s\n", label, c.name))
    elseif T.is_skip(err) then
      s = s + 1
      out:write(string.format("skip %s: %s (%s)\n", label, c.name, err.reason))
    else
      f = f + 1
      out:write(string.format("FAIL %s: %s\n     %s\n", label, c.name, tostring(err):gsub("\n", "\n     ")))
    end
    out:flush()
  end
  return p, f, s
end

return T
