-- nvlua.quant: quantization from Lua — nv.quantize, nv.qmatmul, nv.rht, nv.AmaxHistory, and the
-- REPL tools nv.quant.report (a format comparison table) and nv.quant.show (one block, digit by
-- digit). The formats and their arithmetic are core/NUMERICS.md's; the kernels are C (core/quant.c).
local core = require "nvlua.core"
local util = require "nvlua.util"
local formats = require "nvlua.formats"

local M = {}
local QT = core.QTensor            -- metatable of quantized tensors
local qmethods = QT.__methods

local OPTS = {axis = true, block = true, rht = true, sr = true, seed = true, offset = true, generator = true,
  scale_rule = true, amax = true, sr_row_offset = true, sr_k_offset = true, sr_k_total = true, view = true}

-- Quantized tensors keep (weakly, by key) the tensor they came from, for show().
local source = setmetatable({}, {__mode = "k"})

--- nv.quantize(x, fmt [, opts]) -> quantized tensor
-- fmt: one of nv.format_names (f32, bf16, e4m3, e5m2, mxfp8_e4m3, mxfp8_e5m2, nvfp4, ...; what each
-- allows is in nv.formats). opts: axis (blocked dim, default the last), block "1d"|"2d", rht
-- true|signs, sr with seed/offset or generator, scale_rule "rceil"|"floor", amax (delayed
-- scaling; or a quantized tensor whose amax to use: on a device read there, no host sync),
-- sr_row_offset / sr_k_offset / sr_k_total (SR draws of a slab of a larger tensor: x's
-- blocked layout is rows sr_row_offset.. and columns sr_k_offset.. of one sr_k_total long; data
-- parallelism), view = true (where quantizing is the identity — x's own dtype, f32 or bf16, along
-- its contiguous last dim, no RHT — the result shares x's storage: no copy; x must not change
-- while it is used). nv.use_reference(true) runs the scalar reference kernels. On a device, a
-- per-tensor amax stays there: q.amax and q.scale read it back (one host sync) when asked for.
function M.quantize(x, fmt, opts)
  util.check_opts(opts, OPTS, "quantize")
  local q = core.quantize(x, fmt, opts)
  source[q] = x
  return q
end

--- nv.qmatmul(qa, qb [, {out = "f32"|"bf16", accumulate = t}]) -> [M, N] = sum over the blocked
-- dims (core/NUMERICS.md §7); with accumulate (an f32 [M, N] tensor): t += the f32 product, returns t
function M.qmatmul(qa, qb, opts)
  local out = opts and opts.out or "f32"
  if opts and opts.accumulate then
    if out ~= "f32" then error("qmatmul: accumulate takes the f32 product", 2) end
    return core.qmatmul(qa, qb, out, opts.accumulate)
  end
  return core.qmatmul(qa, qb, out)
end

--- nv.rht(x [, {axis = d, signs = {...16}}]) -> f32 tensor, the RHT along axis (default last)
function M.rht(x, opts)
  opts = opts or {}
  return core.rht(x, opts.axis, opts.signs)
end

M.rht_signs = core.rht_default_signs

-- The magnitude a format's per-tensor scale maps the amax to: the largest value with its block
-- scales (nvfp4 6 * 448), or the element maximum (fp8; mx formats have no per-tensor scale).
local function fmt_max(fmt)
  local t = formats.traits[fmt]
  if not t or not t.quantized then return nil end
  return t.global_amax and t.range or t.max
end

--- nv.AmaxHistory(len): delayed scaling (NUMERICS §4). h:push(amax); h:amax() = max over the
-- last len pushes; h:scale(fmt) = fmt_max / amax, keeping the previous scale when the amax is
-- zero or not finite.
function M.AmaxHistory(len)
  len = len or 1024
  if math.type(len) ~= "integer" or len < 1 then error("AmaxHistory: length must be a positive integer", 2) end
  local h = {len = len, values = {}, pos = 0, count = 0, last_scale = {}}
  function h:push(a)
    if type(a) ~= "number" then error("AmaxHistory:push: amax must be a number", 2) end
    self.pos = self.pos % self.len + 1
    self.values[self.pos] = a
    self.count = math.min(self.count + 1, self.len)
  end
  function h:amax()
    local m = 0
    for i = 1, self.count do
      local v = self.values[i]
      if v == v and v ~= math.huge and v > m then m = v end -- non-finite entries never count
    end
    return m
  end
  function h:scale(fmt)
    local fmax = fmt_max(fmt)
    if not fmax then error("AmaxHistory:scale: unknown format '" .. tostring(fmt) .. "'", 2) end
    local a = self:amax()
    local prev = self.last_scale[fmt] or 1
    if a == 0 or a ~= a or a == math.huge then return prev end
    local s = fmax / a
    if s == math.huge then s = 3.4028234663852886e38 end
    self.last_scale[fmt] = s
    return s
  end
  return h
end

-- ---- the quantized all-gather (core/qgather.h, core/NUMERICS.md "The gathered quantized weight") -----

local COPIES = {fprop = true, dgrad = true, both = true}

-- spec (a format name, or a recipe spec {format, block, scale_rule, ...}) -> format, 16x16?, scale rule
local function weight_spec(spec, where)
  local s = spec
  if type(spec) == "string" then s = {format = spec}
  elseif type(spec) ~= "table" then
    util.user_error(string.format("%s: spec must be a format name or a spec table {format = ..., block = ...}, got %s",
      where, type(spec)), 3)
  end
  local fmt = s.format or s[1]
  if type(fmt) ~= "string" then util.user_error(where .. ": spec has no format (spec.format = \"nvfp4\", ...)", 3) end
  if not formats.traits[fmt] then
    util.user_error(string.format("%s: unknown format '%s' (valid: %s)%s", where, fmt, table.concat(formats.names, ", "),
      util.suggest(fmt, formats.names)), 3)
  end
  if s.rht then util.user_error(where .. ": a weight is quantized without the RHT (spec.rht)", 3) end
  if s.sr then util.user_error(where .. ": a weight is quantized with RNE, not stochastic rounding (spec.sr)", 3) end
  if s.block ~= nil and s.block ~= "1d" and s.block ~= "2d" then
    util.user_error(string.format("%s: spec.block must be \"1d\" or \"2d\", got %s", where, tostring(s.block)), 3)
  end
  if s.block == "2d" and not formats.traits[fmt].block2d then
    util.user_error(string.format("%s: 2d (16x16) blocks are an nvfp4 layout, not %s", where, fmt), 3)
  end
  return fmt, s.block == "2d", s.scale_rule
end

-- Does the fprop copy's transpose serve dgrad (NUMERICS §2, quant.h nvl_qtensor_t)? Values, per-tensor
-- fp8 and 16x16 tiles; 1-D blocks along K do not.
local function transposable(fmt, b2)
  local ft = formats.traits[fmt]
  return ft.scale == "none" or ft.scale == "fp32" or b2
end

local function check_copies(c, where)
  if c ~= nil and not COPIES[c] then
    util.user_error(string.format("%s: copies must be \"fprop\", \"dgrad\" or \"both\", got %s", where, tostring(c)), 3)
  end
  return c or "fprop"
end

--- nv.quant.gather_align(spec [, copies = "fprop"]) -> the row alignment a weight's shards need so that
-- all_gather_quantized can gather those copies ("fprop", "dgrad", "both"): 16 for nvfp4 16x16 tiles,
-- 32 for an mx dgrad copy (its 1x32 blocks run down the rows), 16 for an nvfp4 1x16 one, else 1. Shard
-- the weight with dist.shard_rows(rows, world, gather_align(spec, copies)).
function M.gather_align(spec, copies)
  local fmt, b2 = weight_spec(spec, "gather_align")
  copies = check_copies(copies, "gather_align")
  local a = core.qgather_align(fmt, b2, 2)
  if copies ~= "fprop" and not transposable(fmt, b2) then a = math.max(a, core.qgather_align(fmt, b2, 1)) end
  return a -- every alignment is a power of two: the larger is a multiple of the smaller
end

local QG_OPTS = {rows = true, copies = true, amax = true, check = true, align = true, async = true}

-- A started gather (all_gather_quantized{async = true}): h:wait() -> its copies, as the call would have
-- returned them; h:pending() -> true until then.
local Gather = {}
Gather.__index = Gather
Gather.__name = "nvlua.QuantizedGather"

function Gather:wait()
  local a, b = self.g:wait()
  if self.copies == "fprop" or not self.transpose then return a, b end
  local qt = a:t() -- the exact dgrad copy of 16x16, per-tensor and plain formats: no second gather
  if self.copies == "dgrad" then a:free(); return qt end
  return a, qt
end

function Gather:pending() return self.g:pending() end

--- nv.quant.all_gather_quantized(shard, spec, rows | {rows, copies = "fprop", amax, check = true, align,
-- async = false}) -> q (copies "fprop": blocked along K, what fprop reads), qt ("dgrad": blocked along
-- the rows, what dgrad reads), or q, qt ("both"). shard: this rank's rows of a weight W [rows, K] (f32 or
-- bf16, cpu or cuda): rows [row0, row0 + n) of dist.shard_rows(rows, world, align), align =
-- gather_align(spec, copies) unless given. Every rank calls it alike (checked: a disagreement is the same
-- error on every rank; check = false skips that small host all-reduce). The result is bit for bit
-- nv.quantize(W, format, spec's options) along that axis — codes, block scales, amax and scale — from one
-- max all-reduce of the shards' amaxes (exact), each rank quantizing its shard with the global amax, and
-- all-gathers of codes and scales (core/NUMERICS.md "The gathered quantized weight"). dgrad's copy is
-- q:t() where that is exact (nvfp4 16x16, fp8 per tensor, bf16, f32; no second gather), else (mx, nvfp4
-- 1x16) a second gather of the shard quantized along its rows (the same amax: one reduction). amax: the
-- global amax to use instead (delayed scaling's; a number, a one-element f32 tensor or a quantized
-- tensor). async = true: returns a handle at once, the gathers in flight (MPI_Iallgather on the CPU; on
-- CUDA NCCL on its stream, the work queued next on stream 0 running beside it), and h:wait() returns the
-- copies (prefetch the next layer's weights while this one computes). On CUDA tensors nothing
-- synchronises the host. dist.bytes().all_gather counts the bytes sent.
function M.all_gather_quantized(shard, spec, opts)
  if math.type(opts) == "integer" then opts = {rows = opts} end
  if opts == nil then util.user_error("all_gather_quantized: give the weight's row count (rows)", 2) end
  util.check_opts(opts, QG_OPTS, "all_gather_quantized")
  local rows = opts.rows
  if math.type(rows) ~= "integer" or rows < 0 then
    util.user_error("all_gather_quantized: rows (the whole weight's row count) must be a non-negative integer, got " ..
      tostring(rows), 2)
  end
  if getmetatable(shard) ~= core.Tensor then
    util.user_error("all_gather_quantized: shard must be a tensor (this rank's rows of the weight), got " .. type(shard), 2)
  end
  if opts.async ~= nil and type(opts.async) ~= "boolean" then
    util.user_error("all_gather_quantized: async must be true or false, got " .. tostring(opts.async), 2)
  end
  local copies = check_copies(opts.copies, "all_gather_quantized")
  local fmt, b2, rule = weight_spec(spec, "all_gather_quantized")
  local align = opts.align
  if align == nil then align = M.gather_align(spec, copies) end
  local transpose = copies ~= "fprop" and transposable(fmt, b2)
  local axis = 2 -- the fprop copy; its transpose where that is dgrad's
  if copies == "dgrad" and not transpose then axis = 1 elseif copies == "both" and not transpose then axis = "both" end
  local h = setmetatable({copies = copies, transpose = transpose, g = core.quantize_all_gather(shard, fmt, rows,
    {axis = axis, block = b2 and "2d" or nil, scale_rule = rule, amax = opts.amax, check = opts.check, align = align,
     async = true})}, Gather)
  if opts.async then return h end
  return h:wait()
end

-- ---- printing ---------------------------------------------------------------------------------

QT.__name = "nvlua.QTensor"
QT.__tostring = function(q)
  if q:is_freed() then return "[nvlua.QTensor (freed)]" end
  local extra = {}
  if q.rht then extra[#extra + 1] = "rht (codes in the rotated domain; dequantize() returns x's domain)" end
  if q.sr then extra[#extra + 1] = string.format("sr seed=%d offset=%d", q.seed, q.offset) end
  if q.scale_rule then extra[#extra + 1] = q.scale_rule end
  local lay = q:layout()
  local what
  if lay == "none" then what = ""
  elseif lay == "tensor" then what = string.format(", scale %.6g (amax %.6g)", q.scale, q.amax)
  else what = string.format(", %s blocks along dim %d, amax %.6g", lay, q:axis(), q.amax) end
  return string.format("[nvlua.QTensor %s %s%s%s, %d bytes]", q:format(), table.concat(q:size(), "x"), what,
    #extra > 0 and (", " .. table.concat(extra, ", ")) or "", q:nbytes())
end

-- ---- report -----------------------------------------------------------------------------------

-- The codes of the largest magnitude (+ and -) of each element codec.
local ELEM_MAX_CODE = {e2m1 = {7, 15}, e4m3 = {0x7E, 0xFE}, e5m2 = {0x7B, 0xFB}}

local function spec_of(s)
  if type(s) == "string" then return s, {}, s end
  if type(s) == "table" and type(s[1]) == "string" then
    local opts = {}
    for k, v in pairs(s) do if k ~= 1 and k ~= "label" then opts[k] = v end end
    local label = s.label
    if not label then
      local parts = {s[1]}
      for _, k in ipairs({"block", "rht", "sr", "scale_rule", "axis"}) do
        if opts[k] ~= nil and opts[k] ~= false then
          parts[#parts + 1] = opts[k] == true and k or (k .. "=" .. tostring(opts[k]))
        end
      end
      label = table.concat(parts, "+")
    end
    return s[1], opts, label
  end
  error("report: each format is a name or a table {name, opts...}", 3)
end

-- A 20-column text histogram of a table of counts keyed by integers.
local function histogram(counts, keyfmt, nbins)
  local keys = {}
  for k in pairs(counts) do keys[#keys + 1] = k end
  table.sort(keys)
  if #keys == 0 then return {} end
  local total, peak = 0, 0
  for _, k in ipairs(keys) do total = total + counts[k]; peak = math.max(peak, counts[k]) end
  -- merge into at most nbins bins of consecutive keys
  local lo, hi = keys[1], keys[#keys]
  local width = math.max(1, math.ceil((hi - lo + 1) / nbins))
  local bins = {}
  for _, k in ipairs(keys) do
    local b = (k - lo) // width
    bins[b] = (bins[b] or 0) + counts[k]
  end
  peak = 0
  for _, c in pairs(bins) do peak = math.max(peak, c) end
  local lines = {}
  for b = 0, (hi - lo) // width do
    local c = bins[b] or 0
    local a, z = lo + b * width, math.min(hi, lo + b * width + width - 1)
    local label = a == z and keyfmt(a) or (keyfmt(a) .. ".." .. keyfmt(z))
    lines[#lines + 1] = string.format("    %-22s %6.2f%% %s", label, 100 * c / total, string.rep("#", math.floor(30 * c / peak + 0.5)))
  end
  return lines
end

local function count_values(t)
  local counts = {}
  for _, v in ipairs(t:reshape(-1):totable()) do counts[v] = (counts[v] or 0) + 1 end
  return counts
end

--- nv.quant.report(x, formats [, {histogram = true, out = io.stdout}]) -> rows (also printed)
-- For each format: bits per element including scales, relative RMS error, SQNR (dB), max abs
-- error, % saturated (clipped at the largest code), % of non-zeros flushed to zero, and a text
-- histogram of the block-scale exponents (block formats) or of the codes' magnitudes.
-- With rht the errors are those of q:dequantize(), the transform undone, against x itself; the
-- saturated and flushed shares count codes, so they are taken in the RHT domain the codes hold.
function M.report(x, fmts, opts)
  opts = opts or {}
  if getmetatable(x) ~= core.Tensor then error("report: x must be a tensor", 2) end
  if type(fmts) ~= "table" then fmts = {"bf16", "e4m3", "mxfp8_e4m3", "nvfp4"} end
  local out = opts.out or io.stdout
  local rows = {}
  local x32 = x:to("f32")
  local n = x32:numel()
  local energy = (x32 * x32):sum()
  for _, s in ipairs(fmts) do
    local fmt, qo, label = spec_of(s)
    local ft = formats.get(fmt, "report")
    local q = M.quantize(x32, fmt, qo)
    local xh = q:dequantize() -- x's domain
    local err = xh - x32
    local se = (err * err):sum()
    local r = {format = label, bits = 8 * q:nbytes() / n}
    r.rel_rms = energy > 0 and math.sqrt(se / energy) or 0
    r.sqnr_db = se > 0 and 10 * math.log(energy / se, 10) or math.huge
    r.max_abs = err:abs():max()
    -- the codes' domain: the input and values the quantizer saw
    local ref, xc = x32, xh
    if q.rht then
      ref = M.rht(x32, {axis = qo.axis, signs = type(qo.rht) == "table" and qo.rht or nil})
      xc = q:dequantize({domain = "rotated"})
    end
    local nonzero = ref:ne(0):sum()
    r.flushed = nonzero > 0 and 100 * (ref:ne(0) * xc:eq(0)):sum() / nonzero or 0
    r.saturated = 0
    local hist
    if ft.quantized then
      local codes = q:codes()
      local cl = ELEM_MAX_CODE[ft.elem]
      local at_max = codes:eq(cl[1]) + codes:eq(cl[2])
      r.saturated = 100 * (at_max * ref:abs():gt(xc:abs())):sum() / n
      if opts.histogram ~= false then
        if ft.block > 0 then
          local sb = q:scale_bytes()
          local counts = count_values(sb)
          if ft.scale == "ue4m3" then -- bucket by power of two of the decoded scale
            local e = {}
            for c, k in pairs(counts) do
              local v = core.codec("ue4m3", "decode", c)
              local key = v == 0 and -99 or math.floor(math.log(v, 2))
              e[key] = (e[key] or 0) + k
            end
            hist = {"  block scales (ue4m3, by power of two; -99 = zero):"}
            for _, l in ipairs(histogram(e, function(k) return k == -99 and "0" or ("2^" .. k) end, 12)) do hist[#hist + 1] = l end
          else
            hist = {"  block scales (e8m0 exponent):"}
            for _, l in ipairs(histogram(counts, function(k) return "2^" .. (k - 127) end, 12)) do hist[#hist + 1] = l end
          end
        else
          local mag = {}
          for c, k in pairs(count_values(codes)) do
            local m = c & 0x7F
            mag[m] = (mag[m] or 0) + k
          end
          hist = {"  code magnitudes (|code|, 0..126):"}
          for _, l in ipairs(histogram(mag, function(k) return tostring(k) end, 12)) do hist[#hist + 1] = l end
        end
      end
    end
    r.histogram = hist
    rows[#rows + 1] = r
    if q.rht then ref:free(); xc:free() end
    q:free(); xh:free(); err:free()
  end
  out:write(string.format("x: %s, %d elements, amax %.4g, rms %.4g\n", table.concat(x:size(), "x"), n, x32:abs():max(),
    math.sqrt(energy / math.max(n, 1))))
  out:write(string.format("%-28s %9s %11s %9s %11s %8s %9s\n", "format", "bits/elem", "rel RMS err", "SQNR dB",
    "max |err|", "sat %", "flushed %"))
  for _, r in ipairs(rows) do
    out:write(string.format("%-28s %9.3f %11.3e %9.2f %11.3e %8.3f %9.3f\n", r.format, r.bits, r.rel_rms, r.sqnr_db,
      r.max_abs, r.saturated, r.flushed))
  end
  for _, r in ipairs(rows) do
    if r.histogram then
      out:write(r.format .. "\n")
      for _, l in ipairs(r.histogram) do out:write(l .. "\n") end
    end
  end
  return rows
end

-- ---- show -------------------------------------------------------------------------------------

local function f32(v) return string.unpack("<f", string.pack("<f", v)) end

--- nv.quant.show(q [, {block = i, x = source}]): one block of q digit by digit — inputs,
-- scaled values, codes, decoded values, and the scale byte with what it means. Blocks are
-- numbered from 1 in the blocked layout (row-major over [rows, K/block]).
function M.show(q, opts)
  opts = opts or {}
  local out = opts.out or io.stdout
  if getmetatable(q) ~= QT then error("show: expects a quantized tensor (from nv.quantize)", 2) end
  local fmt, lay = q:format(), q:layout()
  local ft = formats.traits[fmt]
  local K = q:size(q:axis())
  local bsize = ft.block > 0 and ft.block or math.min(16, K)
  local nblocks = q:data():numel() // (ft.quantized and K * ft.elem_bits // 8 or K) * (K // bsize)
  local b = opts.block or 1
  if math.type(b) ~= "integer" or b < 1 or b > nblocks then
    error(string.format("show: block must be an integer in 1..%d, got %s", nblocks, tostring(b)), 2)
  end
  local row, col = (b - 1) // (K // bsize), (b - 1) % (K // bsize)
  -- the block's elements in the blocked layout: codes, decoded values, inputs
  local function rows_of(t) -- t in q's logical shape -> (rows, length of the blocked dim)
    local ax = q:axis()
    local perm = {}
    for d = 1, t:dim() do if d ~= ax then perm[#perm + 1] = d end end
    perm[#perm + 1] = ax
    return t:permute(perm):reshape(-1, t:size(ax))
  end
  local function blocked(t) -- the block's elements
    return rows_of(t):select(1, row + 1):narrow(1, col * bsize + 1, bsize):totable()
  end
  local function scale_byte() return math.tointeger(rows_of(q:scale_bytes()):get(row + 1, col + 1)) end
  local x = opts.x
  if x == nil and source[q] and not source[q]:is_freed() then x = source[q] end -- it may have been freed (an nv.scope)
  local xin = x and (q.rht and M.rht(x, {axis = q:axis()}) or x)
  local xs = xin and blocked(xin:to("f32")) or nil
  local dec = blocked(q:dequantize({domain = "rotated"})) -- the values the codes hold, beside the codes
  local codes = ft.quantized and blocked(q:codes()) or nil
  out:write(string.format("%s block %d of %d (row %d, elements %d..%d along dim %d), layout %s%s%s\n", fmt, b, nblocks,
    row + 1, col * bsize + 1, col * bsize + bsize, q:axis(), lay, q.rht and ", after the RHT" or "",
    q.sr and string.format(", stochastic rounding (seed %d, offset %d)", q.seed, q.offset) or ", round to nearest even"))
  local enc -- the per-element encode multiplier
  if ft.scale == "ue4m3" then
    local amax = q.amax
    local s_enc = q.scale
    local s_dec = f32(1 / s_enc)
    local sbyte = scale_byte()
    local sd = core.codec("ue4m3", "decode", sbyte)
    enc = sd > 0 and f32(math.min(1 / f32(sd * s_dec), 3.4028234663852886e38)) or 3.4028234663852886e38
    out:write(string.format("  global: amax %.6g, s_enc = 2688/amax = %.6g, decode scale amax/2688 = %.6g\n", amax, s_enc,
      amax / 2688))
    out:write(string.format("  scale byte 0x%02x = ue4m3 %.6g -> block decode scale %.6g * %.6g = %.6g; encode x * %.6g\n",
      sbyte, sd, sd, amax / 2688, sd * amax / 2688, enc))
  elseif ft.scale == "e8m0" then
    local e = scale_byte()
    enc = 2.0 ^ (127 - e)
    out:write(string.format("  scale byte 0x%02x = e8m0 2^%d (%s rule); encode x * 2^%d\n", e, e - 127, q.scale_rule, 127 - e))
  elseif ft.scale == "fp32" then
    enc = q.scale
    out:write(string.format("  per-tensor scale %.6g = %.6g / amax %.6g; decode value / scale\n", q.scale, ft.max, q.amax))
  else
    out:write("  no scaling: the values are rounded to " .. fmt .. "\n")
  end
  out:write(string.format("  %4s %13s %13s %6s %11s %13s %11s\n", "i", "x", "x*scale", "code", "value", "decoded", "error"))
  for i = 1, bsize do
    local xv = xs and xs[i]
    local code = codes and math.tointeger(codes[i])
    local value = "-"
    if code then value = string.format("%.6g", core.codec(ft.elem, "decode", code)) end
    out:write(string.format("  %4d %13s %13s %6s %11s %13.6g %11s\n", i, xv and string.format("%.6g", xv) or "-",
      (xv and enc) and string.format("%.6g", xv * enc) or "-", code and string.format("0x%02x", code) or "-", value, dec[i],
      xv and string.format("%+.3e", dec[i] - xv) or "-"))
  end
end

return M
