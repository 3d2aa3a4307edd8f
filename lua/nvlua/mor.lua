-- nvlua.mor: MoR, a mixture of representations (Su, Dykas, Chrzanowski, Chhugani, "MoR: Mixture Of
-- Representations For Mixed-Precision Training", arXiv 2512.22804). Instead of a fixed per-layer
-- table, each GEMM operand is quantized to its candidate formats as it enters the GEMM, the
-- quantization error is measured, and the first candidate within its threshold is used; BF16 is
-- the fallback. Per tensor (one representation per operand) or per block (1 x block elements along
-- the GEMM's reduction dim, each with its own representation). core/NUMERICS.md §12 is the
-- contract; what the paper leaves open (the stored text of the paper is its abstract: the metric,
-- thresholds and scaling are not in it) is an option here, and §12 says what nvlua chose.
--
-- The recipe side: recipe.mor{...} (lua/nvlua/recipe.lua) builds a Recipe whose linears run through
-- M.forward / M.backward below; its LM head (high_precision) stays in bf16 as in every preset.
-- Representations and exactness: per tensor, the chosen operand is the format's own quantization
-- (e4m3 with TE's current scaling, nvfp4 with its two-level scaling, ...), and the GEMM is the same
-- nv.qmatmul as the fixed recipes'. Per block, the tensor-level factor of a candidate (fp8's scale,
-- nvfp4's global scale) is a power of two, so every block's dequantized values are bf16 values
-- exactly; the operand holds them decoded (a bf16 QTensor: 16 bits per element, the decoded form a
-- Hopper kernel would produce from the codes) and the GEMM is one bf16 x bf16 -> fp32 GEMM, exact
-- up to fp32 summation order, on the CPU and on the CUDA backend alike. With scale = "gam" (the
-- paper's group amax mantissa scaling, NUMERICS §12.1) and one group, the fp8 blocks hold code 2^-e_b
-- and the bf16 blocks x m_g in bf16, and 1 / m_g is the operand's decode factor (the GEMM's alpha):
-- a bf16 QTensor, or, every block in one fp8 format, the MXFP8 QTensor of GAM's codes and bytes (the
-- MX tensor cores' operand); with groups of blocks the fp8 blocks are code 2^-e_b / m_g in fp32 (an
-- f32 QTensor, an f32 GEMM).
local core = require "nvlua.core"
local quant = require "nvlua.quant"
local stats = require "nvlua.stats"
local formats = require "nvlua.formats"
local util = require "nvlua.util"
local user_error = util.user_error

local M = {}

local Mor = {}
Mor.__index = Mor

-- ---- options ----------------------------------------------------------------------------------

-- Default thresholds on the relative L2 error, from the errors measured on the operands of a bf16
-- run of experiments/compare_recipes.lua's model (NUMERICS §12): e4m3 per tensor 0.0265 (median;
-- max 0.0295), per 128-block 0.026 (median), 0.04 (99th percentile); nvfp4 per tensor 0.095 (x),
-- 0.111 (w, 16x16), 0.137 (dY with SR), per block 0.094 / 0.111 / 0.132 (medians); e5m2 with GAM
-- scaling per 128-block (experiments/mor_gam_thresholds.lua, the same model, 40 bf16 steps) median
-- 0.052, 99th percentile 0.075 (e4m3 with GAM: 0.026, 0.037). Other candidates take an explicit threshold.
M.DEFAULT_THRESHOLD = {e4m3 = 0.04, e5m2 = 0.08, nvfp4 = 0.15}

local function bad(fmt, ...) util.user_error(string.format("recipe.mor: " .. fmt, ...), 0) end

-- candidates: a list of quantized format names (tried in order; bf16 is the implicit last)
local function check_candidates(c)
  if type(c) ~= "table" or next(c) == nil then
    bad("candidates must be a non-empty list of format names, e.g. {\"e4m3\"}, got %s", tostring(c))
  end
  -- a list: keys 1..n, every one present ({"e4m3", nil, "nvfp4"} has a hole at 2, whatever # says)
  local n = 0
  for k in pairs(c) do
    if math.type(k) ~= "integer" or k < 1 then bad("candidates must be a list (a key %s)", tostring(k)) end
    n = math.max(n, k)
  end
  for i = 1, n do
    if c[i] == nil then bad("candidates has a hole: candidates[%d] is nil (of %d); give a list without nils", i, n) end
  end
  local seen = {}
  for i, f in ipairs(c) do
    local ft = formats.traits[f]
    if not ft or not ft.quantized then
      local q = {}
      for _, n in ipairs(formats.names) do if formats.traits[n].quantized then q[#q + 1] = n end end
      bad("candidates[%d] = %s is not a quantized format (valid: %s; bf16 is always the last resort)", i,
        tostring(f), table.concat(q, ", "))
    end
    if seen[f] then bad("candidates lists %s twice", f) end
    seen[f] = true
  end
end

local VALID = {granularity = true, block = true, candidates = true, threshold = true, every = true, decide = true,
  sr = true, w2d = true, scale = true, group = true}

-- the candidates GAM scaling takes (kernels/cpu/ref/gam_ref.h), with their qmax 448 / 57344
local GAM_FORMATS = {e4m3 = true, e5m2 = true}

--- M.new(opts) -> the MoR settings of a recipe (see recipe.mor for the options); validated.
function M.new(o)
  o = o or {}
  if type(o) ~= "table" then bad("options must be a table, got %s", type(o)) end
  for k in pairs(o) do
    if not VALID[k] then
      local ks = {}
      for n in pairs(VALID) do ks[#ks + 1] = n end
      table.sort(ks)
      bad("unknown option '%s' (valid: %s)%s", tostring(k), table.concat(ks, ", "), util.suggest(k, ks))
    end
  end
  local m = setmetatable({}, Mor)
  m.granularity = o.granularity or "tensor"
  if m.granularity ~= "tensor" and m.granularity ~= "block" then
    bad("granularity must be \"tensor\" or \"block\", got %s", tostring(o.granularity))
  end
  m.block = o.block or 128
  if math.type(m.block) ~= "integer" or m.block < 32 or m.block % 32 ~= 0 then
    bad("block must be a positive multiple of 32 (elements along the reduction dim), got %s", tostring(o.block))
  end
  if o.block ~= nil and m.granularity ~= "block" then bad("block applies to granularity = \"block\"") end
  m.candidates = o.candidates or {"e4m3"}
  check_candidates(m.candidates)
  -- scale: the per-block scaling of the fp8 candidates; "pow2" (a power-of-two tensor factor, NUMERICS
  -- §12) or "gam" (the paper's group amax mantissa: one fp32 mantissa per group, one exponent per block)
  m.scale = o.scale or "pow2"
  if m.scale ~= "pow2" and m.scale ~= "gam" then
    bad("scale must be \"pow2\" or \"gam\", got %s", tostring(o.scale))
  end
  if m.scale == "gam" then
    if m.granularity ~= "block" then
      bad("scale = \"gam\" scales blocks: it needs granularity = \"block\" (per tensor MoR uses each format's own scaling)")
    end
    for i, f in ipairs(m.candidates) do
      if not GAM_FORMATS[f] then
        bad("scale = \"gam\" takes the fp8 candidates e4m3 and e5m2, not candidates[%d] = %s", i, tostring(f))
      end
    end
  end
  -- group: GAM's groups, "tensor" (one group, the default) or a number of blocks (consecutive in the
  -- operand's blocked layout, row-major; it must divide the operand's block count)
  local g = o.group
  if g == nil or g == "tensor" then m.group = "tensor"
  elseif math.type(g) == "integer" and g >= 1 then m.group = g
  else bad("group must be \"tensor\" or a positive integer number of blocks, got %s", tostring(g)) end
  if g ~= nil and m.scale ~= "gam" then bad("group applies to scale = \"gam\"") end
  m.candidates = {table.unpack(m.candidates)}
  m.formats = {table.unpack(m.candidates)}
  m.formats[#m.formats + 1] = "bf16"
  m.threshold = {}
  local th = o.threshold
  for _, f in ipairs(m.candidates) do
    local v
    if type(th) == "number" then v = th
    elseif th == nil then v = M.DEFAULT_THRESHOLD[f]
    elseif type(th) == "table" then
      for k in pairs(th) do
        local found = false
        for _, c in ipairs(m.candidates) do found = found or c == k end
        if not found then bad("threshold.%s: %s is not a candidate (candidates: %s)", tostring(k), tostring(k),
          table.concat(m.candidates, ", ")) end
      end
      v = th[f] or M.DEFAULT_THRESHOLD[f]
    else bad("threshold must be a number or a table {format = number}, got %s", type(th)) end
    if v == nil then bad("%s has no default threshold (defaults: e4m3, e5m2, nvfp4): give threshold = {%s = ...}", f, f) end
    -- a relative error: >= 0 (a negative one would silently send every operand to bf16, a NaN too);
    -- math.huge takes the candidate whenever its error is finite
    if type(v) ~= "number" or not (v >= 0) then
      bad("threshold for %s must be a number >= 0 (a relative error; math.huge: always within), got %s", f, tostring(v))
    end
    m.threshold[#m.threshold + 1] = v
  end
  m.every = o.every or 1
  if math.type(m.every) ~= "integer" or m.every < 1 then bad("every must be a positive integer, got %s", tostring(o.every)) end
  if m.every > 1 and m.granularity ~= "tensor" then
    bad("every > 1 reuses a tensor's representation; a block's rows are this step's tokens, so granularity " ..
      "\"block\" decides at every quantization (every = 1)")
  end
  if o.decide ~= nil and type(o.decide) ~= "function" then bad("decide must be a function(d) -> choice tensor, got %s", type(o.decide)) end
  m.decide = o.decide or M.first_within
  m.custom_decide = o.decide ~= nil
  for _, k in ipairs({"sr", "w2d"}) do
    if o[k] ~= nil and type(o[k]) ~= "boolean" then bad("%s must be true or false, got %s", k, tostring(o[k])) end
  end
  m.sr, m.w2d = o.sr ~= false, o.w2d ~= false
  m.sticky = {}   -- key -> {format, step}: the per-tensor choices reused while every > 1
  m.step_counts = {} -- this step's counts (take_step)
  return m
end

--- M.first_within(d) -> choice: the default decision. d = {errs = {tensor per candidate}, thresholds,
-- formats (the candidates, then "bf16"), granularity, ctx}; every errs[i] has the shape of the units
-- (1 x 1 per tensor, rows x blocks per block). choice (f32, the same shape) = the index in
-- d.formats of the first candidate whose error is <= its threshold, else #d.formats (bf16). A NaN
-- error (a NaN or infinity in the unit) is never within.
function M.first_within(d)
  local n = #d.formats
  local e1 = d.errs[1]
  local choice = core.fill_(core.empty(e1:size(), "f32", e1:device()), n)
  for i = n - 1, 1, -1 do
    local m = d.errs[i]:le(d.thresholds[i]):to("f32")
    choice = choice + m * (choice * -1 + i) -- i where within, else unchanged: exact in f32
  end
  return choice
end

-- ---- measuring --------------------------------------------------------------------------------

-- The operand t (2-D) blocked along axis as its blocked layout [rows, K], f32: the rows its blocks
-- run along (axis 2: t itself; axis 1: its transpose). Quantizing it along its last dim is
-- bit for bit quantizing t along axis (codes, scales and SR block indices are the layout's).
local function layout(t, axis)
  local l = axis == 2 and t or t:transpose():contiguous()
  return l:dtype() == "f32" and l or l:to("f32")
end

-- 2^e for an integer e, exactly (e in the double range)
local function pow2(e) return 2.0 ^ e end

-- The factor the errors are measured on x * c with: 1 for an amax a (max |x|, NaN ignored) in
-- [2^-30, 2^30], 0 or inf; else a power of two with |x| * c < 4. Either way the squares neither
-- overflow nor underflow for values above a * 2^-33 (smaller ones, which no fp8 or fp4 scale keeps
-- either, weigh nothing against the tensor's).
local function norm_factor(a)
  if not (a > 0 and a < math.huge) or (a >= 2.0 ^ -30 and a <= 2.0 ^ 30) then return 1 end
  local e = math.floor(math.log(a, 2))
  return pow2(math.max(-126, math.min(126, -e)))
end

-- per 1 x B group of the rows of a (and b): sum (a - b)^2, in double in index order, rounded to f32
-- once: the same bits on every backend
local sqerr = core.block_sqerr

-- the sum of a [rows, 1] tensor's values, in double on the host in row order
local function host_sum(t)
  local s = 0
  for _, r in ipairs(t:cpu():totable()) do s = s + r[1] end
  return s
end

-- The amax giving a per-tensor-scaled format a power-of-two scale: the largest range * 2^-k >= a
-- (no element above range after scaling) with range / amax = 2^k exact in fp32. nil (the format's
-- own rule: scale 1) for a = 0, inf or NaN.
local function pow2_amax(range, a)
  if not (a > 0 and a < math.huge) then return nil end
  local k = math.floor(math.log(range / a, 2))
  while range * pow2(-k) < a do k = k - 1 end
  while range * pow2(-(k + 1)) >= a do k = k + 1 end
  k = math.max(-110, math.min(126, k))
  return range * pow2(-k)
end

-- quantize options for candidate fmt of operand (x, w, dy)
function Mor:_opts(rec, fmt, operand, axis)
  local ft = formats.traits[fmt]
  local o = {axis = axis}
  if ft.block2d and operand == "w" and self.w2d then o.block = "2d" end
  if ft.sr and operand == "dy" and self.sr then o.sr = true; o.generator = rec.gen end
  if ft.scale == "e8m0" then o.scale_rule = "rceil" end
  return o
end

local TINY = 2.0 ^ -126

-- ---- choosing ---------------------------------------------------------------------------------

-- Run the decision, check what it returned, count each format's units. -> choice, counts
function Mor:_decide(d, what)
  local choice = self.decide(d)
  if type(choice) == "userdata" and choice.numel and choice:device() ~= "cpu" then choice = choice:cpu() end
  if not (type(choice) == "userdata" and choice.numel) then
    error(string.format("recipe mor: %s: decide must return a tensor of format indices, got %s", what, type(choice)), 0)
  end
  local want, got = d.errs[1]:size(), choice:size()
  if #want ~= #got or want[1] ~= got[1] or want[2] ~= got[2] then
    error(string.format("recipe mor: %s: decide returned a %s tensor for %s units", what, table.concat(got, "x"),
      table.concat(want, "x")), 0)
  end
  local counts, total = {}, 0
  for i = 1, #d.formats do
    counts[i] = math.tointeger(choice:eq(i):to("f32"):sum()) or 0
    total = total + counts[i]
  end
  if total ~= choice:numel() then
    error(string.format("recipe mor: %s: decide returned values outside 1..%d (the indices of %s)", what, #d.formats,
      table.concat(d.formats, ", ")), 0)
  end
  return choice, counts
end

local function where_of(ctx, role, operand)
  return string.format("layer '%s' %s operand %s", tostring(ctx.name), role, operand)
end

-- Count units (tensors or blocks) and elements per format for (layer, role, operand): nv.stats and
-- this step's record.
function Mor:_count(ctx, role, operand, counts, elems_per_unit, unit)
  local key = tostring(ctx.name) .. "|" .. role .. "|" .. operand
  local s = self.step_counts[key]
  if not s then
    s = {name = ctx.name, block = ctx.block, role = role, operand = operand, units = {}, elems = {}, tensors = {}}
    self.step_counts[key] = s
  end
  local kind -- this operand tensor's representation: its units' one format, or "mixed"
  for i, f in ipairs(self.formats) do
    local n = counts[i] or 0
    if n > 0 then
      s.units[f] = (s.units[f] or 0) + n
      s.elems[f] = (s.elems[f] or 0) + n * elems_per_unit
      stats.representation(ctx.name, role, operand, f, unit, n, n * elems_per_unit)
      kind = kind and "mixed" or f
    end
  end
  if kind then
    if kind == "mixed" and (counts[#self.formats] or 0) == 0 then kind = "mixed_low" end -- no bf16 unit
    s.tensors[kind] = (s.tensors[kind] or 0) + 1
  end
end

-- Per tensor: quantize t with each candidate, the relative L2 error of each over the tensor, the
-- decision; -> the chosen quantization (the format's own scaling), its format.
function Mor:_per_tensor(rec, ctx, role, operand, t, axis, split)
  local key = tostring(ctx.name) .. "|" .. operand .. "|" .. role
  local prev = self.sticky[key]
  local numel = t:numel()
  local function as_bf16() return quant.quantize(t, "bf16", {axis = axis, view = split or nil}) end
  if prev and ctx.step and prev.step and ctx.step >= prev.step and ctx.step - prev.step < self.every then
    local i = 0
    for j, f in ipairs(self.formats) do if f == prev.format then i = j end end
    if i > 0 then -- (a choice this recipe does not offer, another run's state, is decided again)
      self:_count(ctx, role, operand, {[i] = 1}, numel, "tensor")
      if prev.format == "bf16" then return as_bf16(), "bf16" end
      return quant.quantize(t, prev.format, self:_opts(rec, prev.format, operand, axis)), prev.format
    end
  end
  local tf = t:dtype() == "f32" and t or t:to("f32")
  local cols = tf:size(2)
  local c, xs, n2
  local qs, errs = {}, {}
  for i, f in ipairs(self.candidates) do
    local q = quant.quantize(t, f, self:_opts(rec, f, operand, axis))
    if not c then -- the first quantization's amax: max |t|, NaN ignored (per tensor: no RHT)
      c = norm_factor(q.amax)
      xs = c == 1 and tf or tf * c
      n2 = host_sum(sqerr(xs, nil, cols))
    end
    local deq = q:dequantize({on_device = true})
    local e2 = host_sum(sqerr(c == 1 and deq or deq * c, xs, cols))
    qs[i] = q
    errs[i] = core.tensor({{math.sqrt(e2 / math.max(n2, TINY))}})
  end
  local d = {errs = errs, thresholds = self.threshold, formats = self.formats, granularity = "tensor",
    ctx = {name = ctx.name, block = ctx.block, step = ctx.step, role = role, operand = operand}}
  local choice, counts = self:_decide(d, where_of(ctx, role, operand))
  local i = math.tointeger(choice:cpu():totable()[1][1])
  self:_count(ctx, role, operand, counts, numel, "tensor")
  local f = self.formats[i]
  if self.every > 1 then self.sticky[key] = {format = f, step = ctx.step} end
  if f == "bf16" then return as_bf16(), "bf16", choice, errs end
  return qs[i], f, choice, errs
end

-- Per block: quantize t's blocked layout with each candidate (power-of-two tensor factors), the
-- relative L2 error of each block, the decision per block, and the operand of every block's chosen
-- values: a bf16 QTensor of the layout (exact: each value is a bf16 value). -> q, "mor". given: a
-- recompute's replay (recipe.replay) of a forward operand: the choice tensor the first forward made,
-- the chosen candidates quantized again, nothing measured, decided or counted.
function Mor:_per_block(rec, ctx, role, operand, t, axis, given)
  local L = layout(t, axis)
  local rows, K = L:size(1), L:size(2)
  local B = self.block
  if K % B ~= 0 then
    user_error(string.format("recipe mor: %s: its reduction dim (%d) is not a multiple of block %d", where_of(ctx, role,
      operand), K, B), 0)
  end
  local nb = K // B
  local a = core.quant_amax(L):cpu():totable()[1]
  local gam = self.scale == "gam"
  local gblocks = "tensor" -- GAM's groups: the whole operand, or this many blocks each
  if gam and self.group ~= "tensor" then
    gblocks = self.group
    if (rows * nb) % gblocks ~= 0 then
      user_error(string.format("recipe mor: %s: its %d blocks of 1x%d do not split into groups of %d blocks",
        where_of(ctx, role, operand), rows * nb, B, gblocks), 0)
    end
  end
  -- GAM (NUMERICS §12.1): candidate i's codes and E8M0 bytes, as an MX operand (each 1xB block's byte
  -- repeated over its 1x32 MX blocks) with the decode factor f (1 / m_g, or 1 for the unscaled values)
  local gparts, mant = {}, nil
  local function gam_mx(i, f)
    return core.qtensor_assemble("mxfp8_" .. self.candidates[i], gparts[i].codes, gparts[i].scales, f)
  end
  local function deq(i) -- candidate i's values of the layout, dequantized
    local f = self.candidates[i]
    if gam then -- code 2^-e_b (exact in fp32); the group's m_g is applied below
      local codes, scales, m = core.gam_quantize(L, B, gblocks, f)
      if B ~= 32 then scales = scales:reshape(rows, nb, 1):expand(rows, nb, B // 32):contiguous():reshape(rows, K // 32) end
      gparts[i], mant = {codes = codes, scales = scales}, m
      return gam_mx(i):dequantize({on_device = true})
    end
    local ft = formats.traits[f]
    local o = self:_opts(rec, f, operand, 2)
    if given and o.sr then error("recipe mor: a recompute replays forward operands, which take no SR", 0) end
    if ft.global_amax then o.amax = pow2_amax(ft.range, a) end
    return quant.quantize(L, f, o):dequantize({on_device = true})
  end
  local deqs, errs, choice, counts = {}, {}, given, {}
  if given then
    for i = 1, #self.formats do counts[i] = math.tointeger(choice:eq(i):to("f32"):sum()) or 0 end
  end
  for i = 1, #self.candidates do if not given or counts[i] > 0 then deqs[i] = deq(i) end end
  if gam and not mant then deq(1) end -- a replay of bf16 blocks only: their m_g still (both formats share it)
  -- GAM with one group (the fold): the operand holds code 2^-e_b, bf16 values exactly, and 1 / m_g
  -- leaves the GEMM as its decode factor; bf16 blocks hold x m_g rounded to bf16, so that every block
  -- is on the same footing, and the errors are measured against x m_g. Groups of blocks: no fold (a
  -- group may split a row along K): the fp8 blocks hold code 2^-e_b / m_g (the fp32 quotient, the
  -- reference's decode), the bf16 blocks x rounded to bf16, in an f32 operand.
  local fold = gam and gblocks == "tensor"
  local mg, base = 1, L -- the values the errors are measured against: x, or x m_g (the fold)
  if gam and mant then
    if fold then
      mg = mant:cpu():totable()[1]
      -- x m_g, one fp32 product per element (a same-shape tensor: the devices' elementwise ops)
      if mg ~= 1 then base = L * mant:reshape(1, 1):expand(rows, K):contiguous() end
    else
      local ng = mant:size(1)
      local mgx = mant:reshape(ng, 1):expand(ng, (rows * K) // ng):contiguous():reshape(rows, K)
      for i = 1, #self.candidates do if deqs[i] then deqs[i] = deqs[i] / mgx end end
    end
  end
  if not given then
    local c = norm_factor(a)
    local Ls = c == 1 and base or base * c
    -- the per-block sums on t's device; the errors, the decision and the counts on the host (rows x
    -- blocks numbers)
    local n2 = sqerr(Ls, nil, B):cpu():maximum(TINY)
    for i = 1, #self.candidates do
      errs[i] = (sqerr(c == 1 and deqs[i] or deqs[i] * c, Ls, B):cpu() / n2):sqrt()
    end
    local d = {errs = errs, thresholds = self.threshold, formats = self.formats, granularity = "block", block = B,
      ctx = {name = ctx.name, block = ctx.block, step = ctx.step, role = role, operand = operand}}
    choice, counts = self:_decide(d, where_of(ctx, role, operand))
    self:_count(ctx, role, operand, counts, B, "block")
  end
  if fold then
    -- every block in one fp8 format: the operand is that MXFP8 tensor itself (E8M0 byte 127 - e_b per
    -- 1x32 block), for the MX tensor cores (NUMERICS §12.1)
    for i = 1, #self.candidates do
      if counts[i] == rows * nb then return gam_mx(i, 1 / mg), "mor", choice, errs end
    end
  end
  deqs[#self.formats] = base:to("bf16"):to("f32") -- bf16 blocks: x (x m_g with the fold) rounded to bf16
  local mixed
  for i = 1, #self.formats do
    if counts[i] > 0 then
      local m = choice:eq(i):to("f32"):to(L:device()):reshape(rows, nb, 1):expand(rows, nb, B):contiguous()
      m = m:reshape(rows, K)
      local part = deqs[i] * m -- a value where chosen, else 0 (a NaN stays only where x had one)
      mixed = mixed and mixed + part or part
    end
  end
  if fold then return core.qtensor_assemble("bf16", mixed:to("bf16"), nil, 1 / mg), "mor", choice, errs end
  -- groups of blocks: code 2^-e_b / m_g are fp32 values, not bf16 ones: an f32 operand, an f32 GEMM
  return quant.quantize(mixed, gam and "f32" or "bf16"), "mor", choice, errs
end

-- A recompute's replay of a per-tensor choice (recipe.replay): t in the format the first forward
-- chose, not measured, decided or counted again. -> q, format
function Mor:_per_tensor_replayed(rec, operand, t, axis, split, f)
  if f == "bf16" then return quant.quantize(t, "bf16", {axis = axis, view = split or nil}), "bf16" end
  local o = self:_opts(rec, f, operand, axis)
  if o.sr then error("recipe mor: a recompute replays forward operands, which take no SR", 0) end
  return quant.quantize(t, f, o), f
end

--- mor:operand(rec, ctx, role, operand, t, axis [, split]) -> the quantized operand (a QTensor blocked
-- along axis), its label (the chosen format, or "mor" for a per-block operand), the choice tensor
-- and the errors (as decide saw them): t's representation chosen per the settings. Under activation
-- recompute (recipe.record / replay) the choice is taped in the first forward and replayed in the
-- second: no second measurement, decision, sticky update or count.
function Mor:operand(rec, ctx, role, operand, t, axis, split)
  return core.scope(function()
    local key = tostring(ctx.name) .. "|" .. operand .. "|" .. role
    local e = rec._tape_take and rec:_tape_take(key)
    if e and e.format then return self:_per_tensor_replayed(rec, operand, t, axis, split, e.format) end
    if e then return self:_per_block(rec, ctx, role, operand, t, axis, e.choice) end
    if self.granularity == "block" then
      local q, label, choice, errs = self:_per_block(rec, ctx, role, operand, t, axis)
      if rec._tape_put then
        local kept = choice:clone() -- the tape's own copy: choice goes to the caller
        rec:_tape_put(key, {choice = kept}, kept)
      end
      return q, label, choice, errs
    end
    local q, f, choice, errs = self:_per_tensor(rec, ctx, role, operand, t, axis, split)
    if rec._tape_put then rec:_tape_put(key, {format = f}) end
    return q, f, choice, errs
  end)
end

--- M.choose(t, opts) -> {q, label, choice, errs, formats}: MoR's choice for one 2-D tensor, as a
-- recipe makes it for a GEMM operand (the REPL's and the tests' entry). opts: the recipe.mor
-- options, plus axis (the blocked dim, 1 or 2; default 2), operand ("x", "w" or "dy": which
-- candidate options apply, e.g. SR for dy; default "x"), generator (SR draws; default a new one).
function M.choose(t, opts)
  opts = opts or {}
  local o, axis, operand, gen = {}, opts.axis or 2, opts.operand or "x", opts.generator
  for k, v in pairs(opts) do if k ~= "axis" and k ~= "operand" and k ~= "generator" then o[k] = v end end
  if axis ~= 1 and axis ~= 2 then bad("choose: axis must be 1 or 2, got %s", tostring(axis)) end
  if operand ~= "x" and operand ~= "w" and operand ~= "dy" then
    bad("choose: operand must be \"x\", \"w\" or \"dy\", got %s", tostring(operand))
  end
  if type(t) ~= "userdata" or not t.dim or t:dim() ~= 2 then bad("choose: expects a 2-D tensor") end
  local m = M.new(o)
  local rec = {gen = gen or core.Generator(1234)}
  local q, label, choice, errs = m:operand(rec, {name = "x", step = 0}, "fprop", operand, t, axis)
  return {q = q, label = label, choice = choice, errs = errs, formats = m.formats, counts = m:take_step()}
end

--- mor:take_step() -> this step's counts {[name|role|operand] = {name, block, role, operand, units =
-- {[format] = n}, elems = {[format] = n}}}, then cleared: the training log's per-step record.
function Mor:take_step()
  local s = self.step_counts
  self.step_counts = {}
  return s
end

--- M.summary(counts) -> {low = share of elements not in bf16, by_format = {[format] = element share},
-- units_low = share of units (tensors or blocks) not in bf16, blocks = {[block index] = low share},
-- roles = {[fprop|dgrad|wgrad] = low share}, tensors_low = share of operand tensors without a bf16
-- unit, tensors = {[kind] = share of operand tensors}: kind a format (every unit of the tensor in
-- it: per block, an all-e4m3 or all-e5m2 GAM operand is an MXFP8 operand), "mixed_low" (low-precision
-- formats only, more than one) or "mixed" (some bf16 units)} (nil when counts holds nothing)
function M.summary(counts)
  local tot, low, utot, ulow, byf, blk, rl = 0, 0, 0, 0, {}, {}, {}
  local ttot, tlow, kinds = 0, 0, {}
  for _, s in pairs(counts) do
    for k, n in pairs(s.tensors or {}) do
      ttot = ttot + n
      kinds[k] = (kinds[k] or 0) + n
      if k ~= "bf16" and k ~= "mixed" then tlow = tlow + n end
    end
    for f, n in pairs(s.elems) do
      tot = tot + n
      byf[f] = (byf[f] or 0) + n
      if f ~= "bf16" then low = low + n end
      rl[s.role] = rl[s.role] or {0, 0}
      rl[s.role][1] = rl[s.role][1] + n
      if f ~= "bf16" then rl[s.role][2] = rl[s.role][2] + n end
      local b = s.block ~= nil and tostring(s.block) or tostring(s.name)
      blk[b] = blk[b] or {0, 0}
      blk[b][1] = blk[b][1] + n
      if f ~= "bf16" then blk[b][2] = blk[b][2] + n end
    end
    for f, n in pairs(s.units) do
      utot = utot + n
      if f ~= "bf16" then ulow = ulow + n end
    end
  end
  if tot == 0 then return nil end
  for f, n in pairs(byf) do byf[f] = n / tot end
  local blocks, roles = {}, {}
  for b, v in pairs(blk) do blocks[b] = v[2] / v[1] end
  for r, v in pairs(rl) do roles[r] = v[2] / v[1] end
  for k, n in pairs(kinds) do kinds[k] = n / ttot end
  return {low = low / tot, by_format = byf, units_low = ulow / utot, blocks = blocks, roles = roles,
    tensors_low = ttot > 0 and tlow / ttot or nil, tensors = kinds}
end

--- M.TENSOR_KINDS: what the mixed kinds of summary's tensors mean (the others are format names)
M.TENSOR_KINDS = {mixed_low = "mixed low-precision formats", mixed = "with bf16 units"}

--- M.format_tensor_shares(tensors_low, tensors) -> one line of the operand tensors' representations
-- (summary's tensors_low and tensors): "97.50% of operand tensors wholly in low precision (e4m3 96.00%,
-- mixed low-precision formats 1.50%, with bf16 units 2.50%)"
function M.format_tensor_shares(tl, kinds)
  if not tl then return "no operand tensors counted" end
  local label = M.TENSOR_KINDS
  local ks = require("nvlua.util").sorted_keys(kinds)
  local rank = {mixed_low = 1, mixed = 2} -- formats first, then the mixed kinds
  table.sort(ks, function(a, b) return (rank[a] or 0) < (rank[b] or 0) or ((rank[a] or 0) == (rank[b] or 0) and a < b) end)
  local parts = {}
  for _, k in ipairs(ks) do parts[#parts + 1] = string.format("%s %.2f%%", label[k] or k, 100 * kinds[k]) end
  return string.format("%.2f%% of operand tensors wholly in low precision (%s)", 100 * tl, table.concat(parts, ", "))
end

-- ---- the linear layer -------------------------------------------------------------------------

local function label(fa, fb) return fa == fb and fa or (fa .. " x " .. fb) end

-- what recipe:trace's callback sees of a MoR GEMM: {role, a = {format}, b = {format}, out, label, mor}
-- (format "mor": a per-block operand, a bf16 QTensor of mixed values; with scale = "gam" a bf16 or
-- MXFP8 one with a decode factor, or with groups of blocks an f32 one)
local function gemm_of(role, fa, fb)
  return {role = role, a = {format = fa}, b = {format = fb}, out = role == "wgrad" and "f32" or "bf16",
    label = label(fa, fb), mor = true}
end

local function gemm_out(y, act)
  if act == "bf16" then return y end
  return y:to("f32")
end

--- mor:forward(rec, ctx, x2, w) -> y (bf16 product, the recipe's act_dtype): fprop, both operands
-- blocked along K.
function Mor:forward(rec, ctx, x2, w)
  local qx, fx = self:operand(rec, ctx, "fprop", "x", x2, 2, true)
  local qw, fw = self:operand(rec, ctx, "fprop", "w", w, 2)
  local replay = rec._replaying and rec:_replaying() -- a recompute: this GEMM was counted and traced once
  if rec.hook and not replay then
    core.unscoped(rec.hook, {ctx = ctx, role = "fprop", gemm = gemm_of("fprop", fx, fw), a = qx, b = qw})
  end
  local y = gemm_out(quant.qmatmul(qx, qw, {out = "bf16"}), rec.act_dtype)
  if not replay then stats.count("fprop", label(fx, fw)) end
  return y
end

--- mor:backward(rec, ctx, dy2, x2, w, dw) -> dx: dgrad (dy, w along N) and, with dw, wgrad (dy, x
-- along T, dw += the f32 product). Quantization order: dgrad's dy, w, then wgrad's dy, x (SR draws).
function Mor:backward(rec, ctx, dy2, x2, w, dw)
  local dx = core.scope(function()
    local qdy, fdy = self:operand(rec, ctx, "dgrad", "dy", dy2, 2, true)
    local qw, fw = self:operand(rec, ctx, "dgrad", "w", w, 1)
    if rec.hook then core.unscoped(rec.hook, {ctx = ctx, role = "dgrad", gemm = gemm_of("dgrad", fdy, fw), a = qdy, b = qw}) end
    stats.count("dgrad", label(fdy, fw))
    return gemm_out(quant.qmatmul(qdy, qw, {out = "bf16"}), rec.act_dtype)
  end)
  if dw ~= nil then
    core.scope(function()
      local qdy, fdy = self:operand(rec, ctx, "wgrad", "dy", dy2, 1, true)
      local qx, fx = self:operand(rec, ctx, "wgrad", "x", x2, 1, true)
      if rec.hook then core.unscoped(rec.hook, {ctx = ctx, role = "wgrad", gemm = gemm_of("wgrad", fdy, fx), a = qdy, b = qx}) end
      quant.qmatmul(qdy, qx, {accumulate = dw})
      stats.count("wgrad", label(fdy, fx))
    end)
  end
  return dx
end

-- ---- description and state --------------------------------------------------------------------

--- mor:describe() -> one line: what MoR may choose (recipe:plan prints it per operand)
function Mor:describe()
  local parts = {}
  for i, f in ipairs(self.candidates) do parts[i] = string.format("%s<=%g", f, self.threshold[i]) end
  parts[#parts + 1] = "bf16"
  local g = self.granularity == "block" and string.format("per 1x%d block", self.block) or "per tensor"
  if self.scale == "gam" then
    g = g .. string.format(" gam (group %s)", self.group == "tensor" and "tensor" or (self.group .. " blocks"))
  end
  return string.format("mor %s %s%s%s", table.concat(parts, " > "), g, self.every > 1 and (" every " .. self.every) or "",
    self.custom_decide and " custom decide" or "")
end

--- mor:state() -> plain table: the per-tensor choices reused while every > 1 (a checkpoint's part)
function Mor:state()
  local s = {}
  for k, v in pairs(self.sticky) do s[k] = {format = v.format, step = v.step} end
  return {sticky = s}
end

--- mor:load_state(s): restore what state() returned
function Mor:load_state(s)
  local st = {}
  if s ~= nil then
    if type(s) ~= "table" or (s.sticky ~= nil and type(s.sticky) ~= "table") then
      error("recipe:load_state: mor state must be a table {sticky = {...}}", 0)
    end
    for k, v in pairs(s.sticky or {}) do
      local ok = type(v) == "table" and (v.format == "bf16" or (formats.traits[v.format] or {}).quantized)
        and math.type(math.tointeger(v.step)) == "integer"
      if not ok then error(string.format("recipe:load_state: mor state entry '%s' must be {format, step}", tostring(k)), 0) end
      st[k] = {format = v.format, step = math.tointeger(v.step)}
    end
  end
  self.sticky = st
end

M.pow2_amax = pow2_amax -- for tests
return M
