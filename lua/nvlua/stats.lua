-- nvlua.stats: counters of what actually ran, so a run can prove its recipe was applied.
-- Every GEMM a recipe runs (lua/nvlua/recipe.lua) is counted here by role ("fprop", "dgrad",
-- "wgrad") and format label: the operands' format when both have the same one ("nvfp4",
-- "bf16", "e4m3", ...), else "fmtA x fmtB" with the GEMM's first operand first (x for fprop,
-- dy for dgrad and wgrad). Not here: timings, memory (nv.memory), per-layer detail (recipe:plan).
local M = {}

local ROLES = {"fprop", "dgrad", "wgrad"}
local counts = {fprop = {}, dgrad = {}, wgrad = {}}

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

--- stats.reset(): zero every counter.
function M.reset()
  for _, r in ipairs(ROLES) do counts[r] = {} end
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
end

return M
