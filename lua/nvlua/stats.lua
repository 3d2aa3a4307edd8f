-- nvlua.stats: counters of what actually ran, so a run can prove its recipe was applied.
-- Every GEMM a recipe runs (lua/nvlua/recipe.lua) is counted here by role ("fprop", "dgrad",
-- "wgrad") and format label: the operands' format when both have the same one ("nvfp4",
-- "bf16", "e4m3", ...), else "fmtA x fmtB" with the GEMM's first operand first (x for fprop,
-- dy for dgrad and wgrad); MoR's representation counters per layer, role and operand. Not here:
-- timings, memory (nv.memory), per-layer plans (recipe:plan).
local M = {}

local ROLES = {"fprop", "dgrad", "wgrad"}
local counts = {fprop = {}, dgrad = {}, wgrad = {}}
local reps = {} -- MoR: [layer|role|operand] = {name, role, operand, unit, units = {}, elems = {}}

--- stats.count(role, label [, n]): add n (default 1) GEMMs of format label to role.
function M.count(role, label, n)
  local c = counts[role]
  if not c then error(string.format("stats.count: invalid role '%s' (valid: fprop, dgrad, wgrad)", tostring(role)), 2) end
  c[label] = (c[label] or 0) + (n or 1)
end

--- stats.gemms() -> {fprop = {[label] = n}, dgrad = {...}, wgrad = {...}}: a copy; every role
-- is present (empty when nothing ran in it).
function M.gemms()
  local out = {}
  for _, r in ipairs(ROLES) do
    local t = {}
    for k, v in pairs(counts[r]) do t[k] = v end
    out[r] = t
  end
  return out
end

--- stats.representation(layer, role, operand, format, unit, units, elements): MoR (nvlua.mor) put
-- units ("tensor" or "block") of operand ("x", "w", "dy") of layer's role GEMM, elements in all,
-- in format ("bf16" for its fallback).
function M.representation(name, role, operand, fmt, unit, n, elems)
  local key = tostring(name) .. "|" .. role .. "|" .. operand
  local r = reps[key]
  if not r then
    r = {name = name, role = role, operand = operand, unit = unit, units = {}, elems = {}}
    reps[key] = r
  end
  r.units[fmt] = (r.units[fmt] or 0) + n
  r.elems[fmt] = (r.elems[fmt] or 0) + elems
end

--- stats.representations() -> a copy of the MoR counters: a list sorted by layer, role, operand of
-- {name, role, operand, unit, units = {[format] = n}, elems = {[format] = n}}
function M.representations()
  local out = {}
  for _, r in pairs(reps) do
    local u, e = {}, {}
    for k, v in pairs(r.units) do u[k] = v end
    for k, v in pairs(r.elems) do e[k] = v end
    out[#out + 1] = {name = r.name, role = r.role, operand = r.operand, unit = r.unit, units = u, elems = e}
  end
  table.sort(out, function(a, b)
    if tostring(a.name) ~= tostring(b.name) then return tostring(a.name) < tostring(b.name) end
    if a.role ~= b.role then return a.role < b.role end
    return a.operand < b.operand
  end)
  return out
end

--- stats.reset(): zero every counter.
function M.reset()
  for _, r in ipairs(ROLES) do counts[r] = {} end
  reps = {}
end

--- stats.report([out]): print the counters, one line per role and label.
function M.report(out)
  out = out or io.stdout
  for _, r in ipairs(ROLES) do
    local labels = {}
    for k in pairs(counts[r]) do labels[#labels + 1] = k end
    table.sort(labels)
    for _, k in ipairs(labels) do out:write(string.format("%-6s %-28s %d\n", r, k, counts[r][k])) end
  end
  local rs = M.representations()
  if #rs > 0 then out:write("MoR representations (share of elements; units counted):\n") end
  for _, r in ipairs(rs) do
    local tot, fs = 0, {}
    for f, n in pairs(r.elems) do tot = tot + n; fs[#fs + 1] = f end
    table.sort(fs)
    local parts = {}
    for _, f in ipairs(fs) do
      parts[#parts + 1] = string.format("%s %.2f%% (%d %ss)", f, 100 * r.elems[f] / tot, r.units[f], r.unit)
    end
    out:write(string.format("  %-24s %-6s %-3s %s\n", tostring(r.name), r.role, r.operand, table.concat(parts, ", ")))
  end
end

return M
