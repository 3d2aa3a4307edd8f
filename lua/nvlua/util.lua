-- nvlua.util: small helpers the Lua library shares (option checking, shapes).
local util = {}

--- util.check_opts(opts, valid, fname) -> opts ({} for nil): the one option checker of the Lua
-- library. valid maps each accepted key to true (any value) or to a checker function(value) that
-- returns nil for a good value, else a phrase for "<fname>: option <k> <phrase>, got <value>"
-- (e.g. "must be true or false"). An unknown key raises "<fname>: unknown option 'k' (valid:
-- a, b, ...)", the valid keys sorted. Errors are raised at the caller's caller (level 3).
function util.check_opts(opts, valid, fname)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(fname .. ": options must be a table, got " .. type(opts), 3) end
  for k, v in pairs(opts) do
    local check = valid[k]
    if not check then
      local names = {}
      for n in pairs(valid) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (valid: %s)", fname, tostring(k), table.concat(names, ", ")), 3)
    end
    if type(check) == "function" then
      local bad = check(v)
      if bad then error(string.format("%s: option %s %s, got %s", fname, k, bad, tostring(v)), 3) end
    end
  end
  return opts
end

--- Two size tables equal?
function util.same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

--- "[2,3]" for a size table or a tensor
function util.shape_str(s)
  if type(s) ~= "table" then s = s:size() end
  return "[" .. table.concat(s, ",") .. "]"
end

return util
