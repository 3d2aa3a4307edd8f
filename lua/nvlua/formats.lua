-- nvlua.formats: the number formats nv.quantize takes, read from the C traits rows (core/dtype.h
-- through core.formats()), the one place bits, block lengths, scale kinds and names are defined.
-- recipe, quant and plan ask this module; none keeps its own table. nv.formats is `traits`.
--
-- traits[name] = {name, quantized, elem_bits, bits (per element, scales included), max, and for
-- quantized formats: elem ("e4m3"|"e5m2"|"e2m1"), block (elements per scale, 0 per tensor),
-- layout ("tensor"|"1x16"|"1x32"), scale ("fp32"|"ue4m3"|"e8m0"), scale_bits, scale_rule,
-- block2d (16x16 weight tiles offered), sr (stochastic rounding defined), global_amax (an fp32
-- amax scales the tensor: the amax/delayed options apply), range (largest magnitude, scales
-- included)}; f32 and bf16 have scale "none", block 0.
local core = require "nvlua.core"
local util = require "nvlua.util"

local M = {}
M.traits = core.formats()

local names = {}
for name in pairs(M.traits) do names[#names + 1] = name end
table.sort(names, function(a, b) return M.traits[a].index < M.traits[b].index end)
M.names = names -- in the enum's order: f32, bf16, then the quantized formats

--- formats.get(name, where) -> the traits of name; an error naming where and the valid names.
function M.get(name, where)
  local t = M.traits[name]
  if not t then
    error(string.format("%s: unknown format '%s' (valid: %s)%s", where, tostring(name), table.concat(names, ", "),
      util.suggest(name, names)), 0)
  end
  return t
end

--- formats.is_mx(name), formats.per_tensor(name): the scale kinds recipes ask about.
function M.is_mx(name) return M.traits[name] ~= nil and M.traits[name].scale == "e8m0" end
function M.per_tensor(name) return M.traits[name] ~= nil and M.traits[name].scale == "fp32" end

return M
