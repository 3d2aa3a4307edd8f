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
    return v
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

--- JSON text of the config (sorted keys).
function config.json(c)
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = string.format("  %s: %s", cjson.encode(k), cjson.encode(c[k])) end
  return "{\n" .. table.concat(parts, ",\n") .. "\n}\n"
end

return config
