-- nvlua.config: an experiment's settings, declared by a schema: every key has a default, a type
-- (integer, number, boolean, string), and where it matters a range, a set of accepted values and a
-- check of its own; relations between keys (kv_heads divides heads, min_lr <= lr) are the schema's
-- checks. `key=value` arguments override the defaults; the resolved config is checked as a whole
-- before anything is built, and every message names the key and what it accepts (and, for a
-- mistyped key or value, the closest valid ones). The resolved config is printed and saved.
-- `nvlua script.lua --help` (or -h) prints the script's leading comment block and every key of the
-- schema it parses (type, default, accepted values, doc), then exits 0 before anything is built.
--   local s = config.schema({steps = config.int(300, {min = 1}), lr = config.num(3e-3, {above = 0}),
--     schedule = config.str("wsd", {one_of = {"wsd", "cosine"}})}, {function(c) ... end})
--   local c = s:parse(arg)                      -- or s:extend({steps = 50, mine = config.int(2)}):parse(arg)
-- A plain table of defaults is a schema too (each key typed by its default, no range):
-- config.parse(defaults, args).
local cjson = require "cjson"
local util = require "nvlua.util"

-- every error about a config value is a user error: nvlua prints it as one line (lua/bind/errors.c)
local fail = util.user_error

local config = {}

-- ---- specs: one key's default, type and accepted values ---------------------------------------

local Spec = {}
Spec.__index = Spec

local function spec(kind, default, o)
  o = o or {}
  for k in pairs(o) do
    if not (k == "min" or k == "max" or k == "above" or k == "below" or k == "one_of" or k == "nonempty" or
        k == "check" or k == "accept" or k == "accept_what" or k == "doc") then
      error(string.format("config.%s: unknown option '%s'", kind, tostring(k)), 3)
    end
  end
  local s = setmetatable({kind = kind, default = default}, Spec)
  for k, v in pairs(o) do s[k] = v end
  return s
end

--- config.int(default [, {min =, max =, check =, doc =}]): an integer key
function config.int(default, o) return spec("int", default, o) end
--- config.num(default [, {min =, max =, above =, below =, check =, doc =}]): a finite number
-- (min/max inclusive, above/below exclusive bounds); the value is stored as a float
function config.num(default, o) return spec("num", default, o) end
--- config.bool(default [, {doc =}])
function config.bool(default, o) return spec("bool", default, o) end
--- config.str(default [, {one_of = {...} or function() -> {...}, nonempty =, check =, accept =, accept_what =,
-- doc =}]): a string key; accept(v) -> true admits a non-string value set from Lua (accept_what says
-- what, e.g. "a recipe value").
function config.str(default, o) return spec("str", default, o) end

function config.is_spec(v) return getmetatable(v) == Spec end

-- The spec a plain default value stands for: typed by the value, nothing else.
local function infer(key, v)
  if config.is_spec(v) then return v end
  local t = math.type(v) or type(v)
  if t == "integer" then return config.int(v) end
  if t == "float" then return config.num(v) end
  if t == "boolean" then return config.bool(v) end
  if t == "string" then return config.str(v) end
  return spec("value", v) -- a table or function default: settable from Lua only
end

local function one_of(s)
  local v = s.one_of
  if type(v) == "function" then v = v() end
  return v
end

-- What a spec accepts, in words: "an integer >= 1", "a number in (0, 1)", "one of cpu, cuda".
function Spec:describe()
  if self.kind == "bool" then return "true or false" end
  if self.kind == "str" then
    local set = one_of(self)
    local also = self.accept and (self.accept_what or "a value set from Lua") .. " or " or ""
    if set then return also .. "one of " .. table.concat(set, ", ") end
    return also .. (self.nonempty and "a non-empty string" or "a string")
  end
  if self.kind == "value" then return "a value set from Lua" end
  local what = self.kind == "int" and "an integer" or "a finite number"
  local lo = self.min ~= nil and ("[" .. tostring(self.min)) or self.above ~= nil and ("(" .. tostring(self.above))
  local hi = self.max ~= nil and (tostring(self.max) .. "]") or self.below ~= nil and (tostring(self.below) .. ")")
  if lo and hi then return string.format("%s in %s, %s", what, lo, hi) end
  if self.min ~= nil then return what .. " >= " .. tostring(self.min) end
  if self.above ~= nil then return what .. " > " .. tostring(self.above) end
  if self.max ~= nil then return what .. " <= " .. tostring(self.max) end
  if self.below ~= nil then return what .. " < " .. tostring(self.below) end
  return what
end

local function show(v)
  if type(v) == "string" then return "'" .. v .. "'" end
  if math.type(v) == "float" and v == math.floor(v) and v > -1e15 and v < 1e15 then return string.format("%.1f", v) end
  return tostring(v)
end

-- v checked against the spec -> v (a number key's float as a float), or raises naming the key.
function Spec:validate(key, v, c)
  local function bad() fail(string.format("config: %s must be %s, got %s", key, self:describe(), show(v)), 0) end
  local k = self.kind
  if k == "int" then
    if math.type(v) ~= "integer" then bad() end
  elseif k == "num" then
    if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then bad() end
    v = v + 0.0
  elseif k == "bool" then
    if type(v) ~= "boolean" then bad() end
  elseif k == "str" then
    if type(v) ~= "string" then
      if self.accept and self.accept(v) then return v end
      bad()
    end
    if self.nonempty and v == "" then bad() end
    local set = one_of(self)
    if set then
      local found = false
      for _, x in ipairs(set) do found = found or x == v end
      if not found then
        fail(string.format("config: %s must be %s, got %s%s", key, self:describe(), show(v), util.suggest(v, set)), 0)
      end
    end
  end
  if k == "int" or k == "num" then
    if (self.min ~= nil and v < self.min) or (self.max ~= nil and v > self.max) or
       (self.above ~= nil and v <= self.above) or (self.below ~= nil and v >= self.below) then bad() end
  end
  if self.check then
    local msg = self.check(v, c)
    if msg then fail(string.format("config: %s: %s", key, msg), 0) end
  end
  return v
end

-- Is text a number written in decimal: digits with an optional sign, point and exponent ("3",
-- "-2", "3e-4", "0.5", ".5", "1.")? Lua's tonumber also reads hex ("0x10" is 16, "0x1p4" too) and
-- surrounding spaces; on the command line those are refused rather than read as a surprise.
local function decimal(text)
  local m = text:match("^[+-]?(%d*%.?%d*)[eE][+-]?%d+$") or text:match("^[+-]?(%d*%.?%d*)$")
  return m ~= nil and m:find("%d") ~= nil
end

-- Text from the command line -> a value of the spec's type (the range is checked later, by validate).
-- Numbers are read in decimal only (see decimal).
function Spec:parse_text(key, text)
  local k = self.kind
  if k == "int" then
    local v = decimal(text) and math.tointeger(tonumber(text))
    if not v then
      local other = not decimal(text) and tonumber(text) -- a number in another spelling: 0x10
      fail(string.format("config: %s must be an integer%s, got '%s'", key, other and " written in decimal" or "", text), 0)
    end
    return v
  elseif k == "num" then
    local v = decimal(text) and tonumber(text)
    if not v then
      local other = tonumber(text) and " written in decimal (such as 3e-4 or 0.0003)" or ""
      fail(string.format("config: %s must be a number%s, got '%s'", key, other, text), 0)
    end
    return v + 0.0 -- the key's type: "lr=1" gives 1.0
  elseif k == "bool" then
    if text == "true" or text == "1" then return true elseif text == "false" or text == "0" then return false end
    fail(string.format("config: %s must be true or false, got '%s'", key, text), 0)
  elseif k == "str" then
    return text
  end
  fail(string.format("config: %s cannot be set from the command line", key), 0)
end

-- ---- schemas: the specs of every key, and the checks relating keys ------------------------------

local Schema = {}
Schema.__index = Schema

-- config table -> {key = true} for the keys its arguments set (Schema:parse), while it lives
local given_keys = setmetatable({}, {__mode = "k"})

--- config.schema(specs [, checks [, resolvers]]) -> a schema. specs: {key = spec or plain default};
-- checks: a list of functions(c) -> nil, or a message naming the keys involved (raised as "config:
-- <message>"); resolvers: a list of functions(c, given) that may set keys from elsewhere (train.lua's
-- init: the model's keys from a checkpoint), run by check after each key is checked and before the
-- checks; given = {key = true} for the keys the user chose (see Schema:check).
function config.schema(specs, checks, resolvers)
  local s = setmetatable({specs = {}, checks = {}, resolvers = {}}, Schema)
  for k, v in pairs(specs) do
    if type(k) ~= "string" or not k:match("^[%w_%.]+$") then
      error("config.schema: keys are names ([%w_.]+), got " .. tostring(k), 2)
    end
    s.specs[k] = infer(k, v)
  end
  for i, f in ipairs(checks or {}) do s.checks[i] = f end
  for i, f in ipairs(resolvers or {}) do s.resolvers[i] = f end
  return s
end

function config.is_schema(v) return getmetatable(v) == Schema end

--- schema:extend(overrides [, checks]) -> a new schema: overrides maps keys to a new default (a plain
-- value, for a key of this schema or a new key typed by it) or a spec (declaring a key or replacing
-- one); checks are added to this schema's. The keys it declares or replaces are its own (--help
-- lists them first).
function Schema:extend(overrides, checks)
  local s = setmetatable({specs = {}, checks = {}, resolvers = self.resolvers, own = {}}, Schema)
  for k, v in pairs(self.specs) do s.specs[k] = v end
  for k in pairs(self.own or {}) do s.own[k] = true end
  for k, v in pairs(overrides or {}) do
    local base = s.specs[k]
    if config.is_spec(v) or not base then
      s.specs[k] = infer(k, v)
      s.own[k] = true
    else -- a new default for a declared key: same type and range
      local copy = setmetatable({}, Spec)
      for kk, vv in pairs(base) do copy[kk] = vv end
      copy.default = v
      s.specs[k] = copy
    end
  end
  for _, f in ipairs(self.checks) do s.checks[#s.checks + 1] = f end
  for _, f in ipairs(checks or {}) do s.checks[#s.checks + 1] = f end
  return s
end

--- schema:defaults() -> a plain table {key = default}
function Schema:defaults()
  local d = {}
  for k, v in pairs(self.specs) do d[k] = v.default end
  return d
end

--- schema:check(c) -> c: every declared key's value checked (a number key's value made a float),
-- then the resolvers, then the checks between keys. Raises "config: <key> must be <what it accepts>,
-- got <value>". Keys of c that the schema does not declare are left alone. The keys the user chose
-- (the resolvers' given): those the arguments set when c was made by parse (by any schema), else
-- (a table made in Lua) those whose value is not the default.
function Schema:check(c)
  local keys = {}
  for k in pairs(self.specs) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    if c[k] == nil then fail(string.format("config: %s is missing (%s)", k, self.specs[k]:describe()), 0) end
    c[k] = self.specs[k]:validate(k, c[k], c)
  end
  if #self.resolvers > 0 then
    local given = given_keys[c]
    if not given then
      given = {}
      for _, k in ipairs(keys) do given[k] = c[k] ~= self.specs[k].default or nil end
    end
    for _, f in ipairs(self.resolvers) do f(c, given) end
  end
  for _, f in ipairs(self.checks) do
    local msg = f(c)
    if msg then fail("config: " .. msg, 0) end
  end
  return c
end

-- The text a default is given as on the command line ('' for the empty string).
local function default_text(s)
  local v = s.default
  if s.kind == "value" then return "(set from Lua)" end
  if v == "" then return "''" end
  return tostring(v)
end

-- The leading comment block of the script at path (its description), without the comment marks;
-- nil when it cannot be read or has none.
local function script_description(path)
  local f = type(path) == "string" and path ~= "-" and io.open(path, "r")
  if not f then return nil end
  local lines = {}
  for line in f:lines() do
    if not (#lines == 0 and line:match("^#!")) then
      local text = line:match("^%-%-%-? ?(.*)$")
      if not text then break end
      lines[#lines + 1] = text
    end
  end
  f:close()
  while #lines > 0 and lines[#lines] == "" do lines[#lines] = nil end
  return #lines > 0 and table.concat(lines, "\n") .. "\n" or nil
end

--- schema:help([script]) -> the text `nvlua script --help` prints: the script's leading comment
-- block, a usage line, then every key as key=default with what it accepts and its doc, sorted,
-- the keys the script declares itself (schema:extend) first.
function Schema:help(script)
  local groups = {{title = "Keys:", keys = {}}}
  if next(self.own or {}) then
    groups = {{title = "Keys of this script:", keys = {}},
      {title = "Keys it shares (the schema it extends):", keys = {}}}
  end
  for k in pairs(self.specs) do
    local g = (#groups == 2 and not self.own[k]) and groups[2] or groups[1]
    g.keys[#g.keys + 1] = k
  end
  local width = 0
  for k, s in pairs(self.specs) do width = math.max(width, #k + 1 + #default_text(s)) end
  width = math.min(width, 30)
  local out = {}
  local desc = script_description(script)
  if desc then out[#out + 1] = desc .. "\n" end
  out[#out + 1] = string.format("usage: nvlua %s [key=value ...]   (booleans true|false, numbers in decimal)\n",
    script or "<script>")
  for _, g in ipairs(groups) do
    table.sort(g.keys)
    out[#out + 1] = "\n" .. g.title .. "\n"
    for _, k in ipairs(g.keys) do
      local s = self.specs[k]
      local head = k .. "=" .. default_text(s)
      out[#out + 1] = string.format("  %-" .. width .. "s  %s\n", head, s:describe())
      if s.doc then out[#out + 1] = string.format("  %-" .. width .. "s  %s\n", "", s.doc) end
    end
  end
  return table.concat(out)
end

--- config.help_requested(args) -> true when the arguments ask for help: one of them is --help or -h
function config.help_requested(args)
  for _, a in ipairs(args or {}) do
    if a == "--help" or a == "-h" then return true end
  end
  return false
end

--- schema:parse(args) -> resolved and checked config (a new table). args: {"key=value", ...}, with
-- args[0] the script (the `arg` table); an unknown key is an error naming the closest valid keys, or
-- listing them all. When args ask for help (config.help_requested), prints schema:help(args[0])
-- and exits with status 0 instead: nothing after parse runs.
function Schema:parse(args)
  args = args or {}
  if config.help_requested(args) then
    io.stdout:write(self:help(args[0]))
    os.exit(0, true)
  end
  local out, given = self:defaults(), {}
  given_keys[out] = given
  for _, a in ipairs(args) do
    local k, v = tostring(a):match("^([%w_%.]+)=(.*)$")
    if not k then fail(string.format("config: arguments are key=value, got '%s'", tostring(a)), 0) end
    local s = self.specs[k]
    if not s then
      local keys = {}
      for name in pairs(self.specs) do keys[#keys + 1] = name end
      table.sort(keys)
      local hint = util.did_you_mean(k, keys)
      local list = "valid keys: " .. table.concat(keys, ", ")
      local more = type(args[0]) == "string" and string.format("nvlua %s --help", args[0])
      if hint then
        fail(string.format("config: unknown key '%s'; %s (%s)", k, hint, more and more .. " lists the keys" or list), 0)
      end
      fail(string.format("config: unknown key '%s'; %s%s", k, list, more and " (" .. more .. " describes them)" or ""),
        0)
    end
    out[k] = s:parse_text(k, v)
    given[k] = true
  end
  return self:check(out)
end

--- config.parse(schema or plain defaults, args [, overrides]) -> resolved, checked config: the same
-- as schema:extend(overrides):parse(args).
function config.parse(base, args, overrides)
  local s = config.is_schema(base) and base or config.schema(base)
  if overrides then s = s:extend(overrides) end
  return s:parse(args)
end

--- Print the resolved config as aligned key = value lines (sorted).
function config.print(c, out)
  out = out or io.stdout
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local w = 0
  for _, k in ipairs(keys) do w = math.max(w, #k) end
  for _, k in ipairs(keys) do
    local v = c[k]
    out:write(string.format("  %-" .. w .. "s = %s\n", k,
      type(v) == "function" and "lua function defined at " .. util.defined_at(v) or tostring(v)))
  end
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
-- numbers read back bit for bit; non-finite numbers are written as strings ("nan", "inf"), a
-- table with a __tostring metamethod (a recipe value in a config) as its string, and a function
-- (a schedule given from Lua) as "lua function defined at <source>:<line>".
function config.encode(v)
  local t = type(v)
  if t == "number" then return number(v) end
  if t == "function" then return cjson.encode("lua function defined at " .. util.defined_at(v)) end
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
