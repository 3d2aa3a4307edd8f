-- nvlua.config: an experiment's settings. Every experiment has a defaults table; `key=value`
-- arguments override it, type-checked against the default (number, integer, boolean, string);
-- an unknown key is an error listing the valid ones. The resolved config is printed and saved.
local cjson = require "cjson"

local config = {}

local function parse_value(key, text, default)
  local t = math.type(default) or type(default)
  if t == "integer" then
    local v = math.tointeger(tonumber(text))
    if not v then error(string.format("config: %s must be an integer, got '%s'", key, text), 0) end
    return v
  elseif t == "float" then
    local v = tonumber(text)
    if not v then error(string.format("config: %s must be a number, got '%s'", key, text), 0) end
    return v + 0.0 -- the default's type: "lr=1" gives 1.0
  elseif t == "boolean" then
    if text == "true" or text == "1" then return true elseif text == "false" or text == "0" then return false end
    error(string.format("config: %s must be true or false, got '%s'", key, text), 0)
  elseif t == "string" then
    return text
  end
  error(string.format("config: %s cannot be set from the command line", key), 0)
end

--- config.parse(defaults, args) -> resolved table (a copy). args: {"key=value", ...}. A key
-- whose default is the string "" or a number accepts any value of that type; "nil" defaults are
-- given as config.optional(type) and accept "none".
function config.parse(defaults, args)
  local out = {}
  for k, v in pairs(defaults) do out[k] = v end
  for _, a in ipairs(args or {}) do
    local k, v = tostring(a):match("^([%w_%.]+)=(.*)$")
    if not k then error(string.format("config: arguments are key=value, got '%s'", tostring(a)), 0) end
    if defaults[k] == nil then
      local keys = {}
      for name in pairs(defaults) do keys[#keys + 1] = name end
      table.sort(keys)
      error(string.format("config: unknown key '%s'; valid keys: %s", k, table.concat(keys, ", ")), 0)
    end
    out[k] = parse_value(k, v, defaults[k])
  end
  return out
end

--- Print the resolved config as aligned key = value lines (sorted).
function config.print(c, out)
  out = out or io.stdout
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local w = 0
  for _, k in ipairs(keys) do w = math.max(w, #k) end
  for _, k in ipairs(keys) do out:write(string.format("  %-" .. w .. "s = %s\n", k, tostring(c[k]))) end
end

-- A JSON number that reads back as the same value: integers exactly (cjson would write a 64-bit
-- seed as 1.1529215046068e+18), floats with the fewest of 15..17 digits that round-trip (cjson
-- keeps 14, which loses bits of a loss).
local function number(v)
  if math.type(v) == "integer" then return string.format("%d", v) end
  if v ~= v or v == math.huge or v == -math.huge then return cjson.encode(tostring(v)) end
  for _, f in ipairs({"%.15g", "%.16g"}) do
    local s = string.format(f, v)
    if tonumber(s) == v then return s end
  end
  return string.format("%.17g", v)
end

--- config.encode(v) -> JSON text of a value (tables with sorted keys; arrays as arrays) whose
-- numbers read back bit for bit; non-finite numbers are written as strings ("nan", "inf"), and
-- a table with a __tostring metamethod (a recipe value in a config) as its string.
function config.encode(v)
  local t = type(v)
  if t == "number" then return number(v) end
  if t ~= "table" then return cjson.encode(v) end
  if v == cjson.null then return "null" end
  local mt = getmetatable(v)
  if mt and mt.__tostring then return cjson.encode(tostring(v)) end
  local n = #v
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  if n > 0 and #keys == n then
    local parts = {}
    for i = 1, n do parts[i] = config.encode(v[i]) end
    return "[" .. table.concat(parts, ",") .. "]"
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = cjson.encode(tostring(k)) .. ":" .. config.encode(v[k]) end
  return "{" .. table.concat(parts, ",") .. "}"
end

--- JSON text of the config (sorted keys, one per line, numbers exact).
function config.json(c)
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = string.format("  %s: %s", cjson.encode(k), config.encode(c[k])) end
  return "{\n" .. table.concat(parts, ",\n") .. "\n}\n"
end

return config
