-- nvlua.util: small helpers the Lua library shares (option checking, shapes).
local util = {}

--- Options table (nil: {}) whose keys must all be in `valid` (a set); an unknown key raises
-- "<fname>: unknown option 'k' (valid: ...)" at the caller's caller.
function util.check_opts(opts, valid, fname)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(fname .. ": options must be a table, got " .. type(opts), 3) end
  for k in pairs(opts) do
    if not valid[k] then
      local names = {}
      for n in pairs(valid) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (valid: %s)", fname, tostring(k), table.concat(names, ", ")), 3)
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
