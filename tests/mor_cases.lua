-- tests/mor_cases.lua: hand-computed MoR inputs shared by test_mor.lua (CPU) and test_cuda_mor.lua
-- (the CUDA backend). Not a test file: loaded with dofile.
--
-- A (2 x 256) in two 1x128 blocks per row, e4m3 candidate, amax 7:
--   the power-of-two tensor scale (block granularity) is 448 / 7 = 64 = 2^6, the one TE's current
--   scaling gives too (448 / 7 is exact), so every integer in [-7, 7] (at most 3 significant bits)
--   times 64 is an e4m3 value: exact.
--   r1 b1: integers, the first 7        -> error 0                         -> e4m3
--   r1 b2: +-17/16 everywhere           -> 68 is the tie 64 | 72, even: 64 -> 1.0, error 1/17 = 0.0588
--   r2 b1: integers and one 17/16       -> error 0.0625 / ||block||, < 0.01 -> e4m3
--   r2 b2: +-19/16 everywhere           -> 76 is the tie 72 | 80, even: 80 -> 1.25, error 1/19 = 0.0526
-- threshold 0.04: r1 b2 and r2 b2 fall back to bf16; 0.055: only r1 b2 (0.0526 <= 0.055 < 0.0588).
-- Every value is an integer or a multiple of 1/16 below 8 in magnitude: products of two are
-- multiples of 2^-8 below 64, and a sum of 256 of them is exact in fp32 in any order.
local M = {}

local G = dofile("tests/gemm_exact.lua")
local lcg = G.rng -- a deterministic integer generator, r(lo, hi)

M.K, M.B = 256, 128

-- rows x 256 values: row pattern kinds per block ("int", "int17", "s17", "s19")
local function build(kinds, seed)
  local r = lcg(seed)
  local x = {}
  for i, row in ipairs(kinds) do
    x[i] = {}
    for b, kind in ipairs(row) do
      for j = 1, M.B do
        local k = (b - 1) * M.B + j
        local sign = r(0, 1) == 0 and -1 or 1
        if kind == "s17" then x[i][k] = sign * 17 / 16
        elseif kind == "s19" then x[i][k] = sign * 19 / 16
        else x[i][k] = r(-7, 7) end
      end
      if kind == "int17" then x[i][(b - 1) * M.B + 5] = 17 / 16 end
    end
  end
  x[1][1] = 7 -- the amax
  return x
end

M.A_KINDS = {{"int", "s17"}, {"int17", "s19"}}
M.B_KINDS = {{"int", "int"}, {"s19", "int"}, {"int17", "s17"}}

function M.A() return build(M.A_KINDS, 11) end
function M.Bm() return build(M.B_KINDS, 23) end

-- the e4m3 round trip at scale 64 of the values above (by hand: integers exact, 17/16 -> 1, 19/16 -> 5/4)
local function e4m3_64(v)
  local a = math.abs(v)
  if a == 17 / 16 then return v > 0 and 1 or -1 end
  if a == 19 / 16 then return v > 0 and 1.25 or -1.25 end
  return v
end

-- the expected choice (1 = e4m3, 2 = bf16) per block for threshold tau, from the errors above
local ERR = {int = 0, int17 = 0.01, s17 = 1 / 17, s19 = 1 / 19}
function M.expected_choice(kinds, tau)
  local c = {}
  for i, row in ipairs(kinds) do
    c[i] = {}
    for b, kind in ipairs(row) do c[i][b] = ERR[kind] <= tau and 1 or 2 end
  end
  return c
end

-- the mixed operand's values: e4m3 blocks round-tripped, bf16 blocks as they are
function M.mixed(x, choice)
  local out = {}
  for i, row in ipairs(x) do
    out[i] = {}
    for k, v in ipairs(row) do
      local b = (k - 1) // M.B + 1
      out[i][k] = choice[i][b] == 1 and e4m3_64(v) or v
    end
  end
  return out
end

-- a . b^T in double (exact here): tests/gemm_exact.lua's
M.product = G.exact_product

-- got and want (nested tables of numbers) equal element by element (NaN equals NaN), else an error
-- naming the element
function M.same_values(got, want, what)
  for i = 1, #want do
    for j = 1, #want[i] do
      if got[i][j] ~= want[i][j] and not (got[i][j] ~= got[i][j] and want[i][j] ~= want[i][j]) then
        error(string.format("%s: [%d,%d] %.9g, want %.9g", what, i, j, got[i][j], want[i][j]), 2)
      end
    end
  end
end

-- a tensor's values on the host, as nested tables
function M.tbl(t) return t:cpu():totable() end

return M
