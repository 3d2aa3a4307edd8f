-- nvlua.pretty: values as a person reads them, for the REPL (lua/bind/repl.c prints every result
-- with pretty.print) and for help(). A plain table prints as a Lua constructor, keys sorted
-- (the list part first, in order), nested tables indented, on one line when it fits; a value
-- with a __tostring (a tensor, a recipe, an nn module) prints as its tostring. Large tables are
-- cut: at most `items` entries each (then "... N more"), `depth` levels (then "{...N entries}");
-- a table met again inside itself prints as "<cycle>".
--   pretty.format(nv.formats.nvfp4)       -> "{\n  bits = 4.5,\n  block = 16, ..."
--   pretty.format({1, 2, x = "a"})        -> '{1, 2, x = "a"}'
-- Not here: tensors' own printing (nvlua/init.lua) and saving values (nvlua.config encodes JSON).
local M = {}

local WIDTH = 96  -- a table goes on one line when that line, indented, fits in this many columns
local ITEMS = 50  -- entries shown per table
local DEPTH = 4   -- nesting levels shown

local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or repeat return then true
  until while]]):gmatch("%a+") do KEYWORDS[w] = true end

local ESCAPES = {["\""] = "\\\"", ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t"}

-- A string as a Lua literal: quotes, escapes for the quote, backslash and control characters.
local function quote(s)
  return "\"" .. s:gsub("[%c\"\\]", function(c) return ESCAPES[c] or string.format("\\%03d", c:byte()) end) .. "\""
end

local function has_tostring(v)
  local mt = getmetatable(v)
  return type(mt) == "table" and mt.__tostring ~= nil
end

-- A table printed through its entries (not its __tostring)?
local function is_plain(v) return type(v) == "table" and not has_tostring(v) end

-- Key order: numbers before strings before the rest, then by value (numbers) or text.
local RANK = {number = 1, string = 2}
local function key_less(a, b)
  local ra, rb = RANK[type(a)] or 3, RANK[type(b)] or 3
  if ra ~= rb then return ra < rb end
  if ra == 1 then return a < b end
  return tostring(a) < tostring(b)
end

local format

-- "name = " for an identifier key, "[k] = " for another; "" for the list part.
local function key_text(k, in_list)
  if in_list then return "" end
  if type(k) == "string" and k:match("^[%a_][%w_]*$") and not KEYWORDS[k] then return k .. " = " end
  return "[" .. (type(k) == "string" and quote(k) or tostring(k)) .. "] = "
end

-- The entries of t in print order: {key, value, in_list}, and how many there are in all.
local function entries(t)
  local n = #t
  local list, keys = {}, {}
  for i = 1, n do list[i] = {i, rawget(t, i), true} end
  for k in pairs(t) do
    if not (math.type(k) == "integer" and k >= 1 and k <= n) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_less)
  for _, k in ipairs(keys) do list[#list + 1] = {k, rawget(t, k), false} end
  return list
end

local function format_table(t, o, indent, path)
  if path[t] then return "<cycle>" end
  local all = entries(t)
  if #all == 0 then return "{}" end
  if indent // 2 >= o.depth then return string.format("{...%d entries}", #all) end
  path[t] = true
  local parts, packable = {}, {}
  local shown = math.min(#all, o.items)
  for i = 1, shown do
    local k, v, in_list = all[i][1], all[i][2], all[i][3]
    local text = format(v, o, indent + 2, path)
    if text:find("\n", 1, true) and not is_plain(v) then
      -- a value of several lines (a tensor): a list item's lines aligned with its first, a field's
      -- on lines of their own under its key
      local pad = string.rep(" ", in_list and indent + 2 or indent + 4)
      text = text:gsub("\n", "\n" .. pad)
      parts[i] = in_list and text or key_text(k, false):sub(1, -2) .. "\n" .. pad .. text
    else
      parts[i] = key_text(k, in_list) .. text
      packable[i] = in_list and not is_plain(v)
    end
  end
  if #all > shown then parts[#parts + 1] = string.format("... %d more", #all - shown) end
  path[t] = nil
  local one = "{" .. table.concat(parts, ", ") .. "}"
  if not one:find("\n", 1, true) and indent + #one <= o.width then return one end
  -- one entry per line, but a run of plain list items (numbers, strings) filled into lines
  local pad = string.rep(" ", indent + 2)
  local lines = {}
  for i, p in ipairs(parts) do
    local last = lines[#lines]
    if packable[i] and packable[i - 1] and #last + 2 + #p + 1 <= o.width then -- + 1: the comma after it
      lines[#lines] = last .. ", " .. p
    else
      lines[#lines + 1] = pad .. p
    end
  end
  return "{\n" .. table.concat(lines, ",\n") .. "\n" .. string.rep(" ", indent) .. "}"
end

-- v as text, for a value nested `indent` columns deep; path: the tables being printed (cycles).
format = function(v, o, indent, path)
  local t = type(v)
  if t == "string" then return quote(v) end
  if is_plain(v) then return format_table(v, o, indent, path) end
  return tostring(v)
end

--- pretty.format(v [, {width = 96, items = 50, depth = 4}]) -> text: v as a Lua constructor for a
-- plain table (sorted keys, indented, cut where large), tostring(v) for anything else but a
-- string, which is quoted
function M.format(v, o)
  o = o or {}
  return format(v, {width = o.width or WIDTH, items = o.items or ITEMS, depth = o.depth or DEPTH}, 0, {})
end

--- pretty.print(...): print's twin for the REPL: strings, numbers, booleans and nil as print
-- writes them, tables through pretty.format, separated by tabs
function M.print(...)
  local n = select("#", ...)
  local parts = {}
  for i = 1, n do
    local v = select(i, ...)
    parts[i] = is_plain(v) and M.format(v) or tostring(v)
  end
  io.stdout:write(table.concat(parts, "\t"), "\n")
end

return M
