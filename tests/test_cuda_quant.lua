-- test_cuda_quant.lua: the CUDA quantizers and GEMMs (kernels/cuda/quant.cu, gemm.cu) against the
-- CPU. Quantizers: every format and option of core/NUMERICS.md, bit for bit (codes, scales, amax,
-- scale) with the CPU path for the same inputs, seeds and offsets, on several shapes (blocked dims
-- not multiples of 128, 3-D tensors, any axis), f32 and bf16 inputs; the 128x4 swizzled scales
-- against a swizzle computed here; the fused row + column quantization against two CPU calls.
-- GEMMs: every path against the fp32 CPU emulation of the same quantized operands, within a
-- tolerance derived from fp32 accumulation (summation order is all that may differ). Every
-- device output is allocated poisoned (twice, 0xFF and 0x00, for the quantizers), so an element a
-- kernel leaves unwritten cannot match.
-- Not here: the device layer (test_cuda.lua), CPU quantizers (test_quant.lua). Every case needs a
-- GPU and skips without one (so the file alone exits 77).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = require "nvlua.core"

local need_gpu = T.need_gpu

local gemm_path = (nv.cuda and nv.cuda.gemm_path) or core.cuda_gemm_path

-- Run fn once with every new device block filled with 0xFF and once with 0x00.
local function poisoned(fn)
  for _, byte in ipairs({ 0xFF, 0x00 }) do T.with(core.cuda_set_poison, byte, fn, byte) end
end

-- First differing byte of two strings, or nil.
local function first_diff(a, b)
  if #a ~= #b then return 0 end
  if a == b then return nil end
  for i = 1, #a do
    if a:byte(i) ~= b:byte(i) then return i end
  end
end

local function same_bytes(got, want, what)
  local gb, wb = got:bytes(), want:bytes()
  local i = first_diff(gb, wb)
  T.ok(i == nil, i and string.format("%s: %d vs %d bytes, first difference at byte %d (got 0x%02x, want 0x%02x)", what,
    #gb, #wb, i, gb:byte(i) or 0, wb:byte(i) or 0) or what)
end

local function same_float(got, want, what)
  T.ok(got == want or (got ~= got and want ~= want),
    string.format("%s: got %.9g, want %.9g", what, got, want))
end

-- q (device) equals qc (cpu) bit for bit.
local function check_same_q(q, qc, what)
  T.eq(q:device(), "cuda", what .. ": device")
  T.eq(q:format(), qc:format(), what .. ": format")
  T.eq(q:layout(), qc:layout(), what .. ": layout")
  same_bytes(q:data():cpu(), qc:data(), what .. ": codes")
  if qc:layout() ~= "none" and qc:layout() ~= "tensor" then
    same_bytes(q:scale_bytes(), qc:scale_bytes(), what .. ": block scales")
  end
  if require("nvlua.formats").traits[qc:format()].global_amax then
    same_float(q.amax, qc.amax, what .. ": amax")
  else -- only reported, never used: not computed on cuda (a host sync per cast; issue 15 D9)
    T.ok(q.amax ~= q.amax, what .. ": amax of a format without a per-tensor scale is NaN on cuda")
  end
  same_float(q.scale, qc.scale, what .. ": scale")
  T.eq(q.sr, qc.sr, what .. ": sr")
  if qc.sr then
    T.eq(q.seed, qc.seed, what .. ": seed")
    T.eq(q.offset, qc.offset, what .. ": offset")
  end
end

local function copy(t)
  local r = {}
  for k, v in pairs(t or {}) do r[k] = v end
  return r
end

-- Random input whose magnitudes spread over e^-6..e^6 times a normal draw, so blocks of very
-- different scale meet in one tensor (exact ties are left to chance; the CPU tests cover them).
local function make_input(shape, seed, dtype)
  local g = nv.Generator(seed)
  local x = nv.randn(shape, { generator = g })
  local n = x:numel()
  local scale = nv.rand(n, { generator = g }):mul(12):sub(6):exp():reshape(table.unpack(shape))
  x = x * scale
  if dtype == "bf16" then x = x:to("bf16") end
  return x
end

-- The quantizer configurations checked bit for bit.
local CONFIGS = {
  { "f32" }, { "bf16" }, { "bf16", rht = true },
  { "e4m3" }, { "e5m2" }, { "e4m3", amax = 3.5 }, { "e5m2", rht = true },
  { "mxfp8_e4m3" }, { "mxfp8_e5m2" }, { "mxfp8_e4m3", scale_rule = "floor" }, { "mxfp8_e5m2", scale_rule = "floor" },
  { "mxfp8_e4m3", rht = true },
  { "nvfp4" }, { "nvfp4", amax = 100.0 }, { "nvfp4", rht = true },
  { "nvfp4", sr = true, seed = 1234, offset = 7 }, { "nvfp4", rht = true, sr = true, seed = 99, offset = (1 << 33) + 5 },
  { "nvfp4", block = "2d" }, { "nvfp4", block = "2d", sr = true, seed = 5, offset = 1 },
  { "nvfp4", sr = true, seed = 77, offset = 3, sr_row_offset = 32, sr_k_offset = 64, sr_k_total = 1024 },
}

local function label(cfg)
  local parts = { cfg[1] }
  for _, k in ipairs({ "block", "rht", "rht_col", "sr", "scale_rule", "amax", "axis", "sr_row_offset" }) do
    if cfg[k] ~= nil then parts[#parts + 1] = k .. "=" .. tostring(cfg[k]) end
  end
  return table.concat(parts, "+")
end

local function opts_of(cfg)
  local o = copy(cfg)
  o[1] = nil
  return o
end

-- Shapes: {shape, axis (nil = last)}. Blocked lengths are multiples of 32 (every format's block)
-- but rows are not multiples of 128; 2-D shapes with rows % 16 == 0 also run the 2D configs.
local SHAPES = {
  { { 16, 32 } }, { { 3, 64 } }, { { 130, 96 } }, { { 48, 160 } }, { { 256, 512 } },
  { { 64, 96 }, 1 }, { { 32, 48 * 2 }, 1 }, { { 2, 5, 64 } }, { { 3, 64, 5 }, 2 }, { { 64, 3, 2 }, 1 },
}

local function applies(cfg, shape, axis)
  if cfg.block == "2d" then
    if #shape ~= 2 then return false end
    local rows = axis == 1 and shape[2] or shape[1]
    if rows % 16 ~= 0 then return false end
  end
  if cfg.sr_row_offset then return #shape == 2 and axis == nil end
  return true
end

for _, dtype in ipairs({ "f32", "bf16" }) do
  T.case("quantize on cuda equals the CPU bit for bit (" .. dtype .. " inputs, all formats and options)", function()
    need_gpu()
    local n = 0
    for si, sh in ipairs(SHAPES) do
      local shape, axis = sh[1], sh[2]
      local x = make_input(shape, 100 + si, dtype)
      local xd = x:cuda()
      for _, cfg in ipairs(CONFIGS) do
        if applies(cfg, shape, axis) then
          local o = opts_of(cfg)
          o.axis = axis
          local what = string.format("%s %s axis %s", label(cfg), table.concat(shape, "x"), tostring(axis or "last"))
          local qc = core.quantize(x, cfg[1], o)
          poisoned(function(byte)
            local q = core.quantize(xd, cfg[1], o)
            check_same_q(q, qc, what .. string.format(" (poison 0x%02x)", byte))
            q:free()
          end)
          qc:free()
          n = n + 1
        end
      end
      xd:free()
    end
    T.ok(n > 100, "ran " .. n .. " comparisons")
  end)
end

-- Quantizations blocked along a dimension that is not the last (the column-wise copies of wgrad, a
-- weight's dgrad copy) go through quant.cu's 64x64 tiles (quant_col_kernel): coalesced reads, the
-- transposition in shared memory. Ragged tiles: blocked lengths that are not multiples of 64,
-- columns past a tile's edge (C = 7, 17, 130), C not a multiple of the 16-byte piece (the scalar load
-- path), batches (3-D), unaligned views; fp8 and values (no unit along K) with K not a multiple of 16.
local COL_SHAPES = {
  { { 96, 130 }, 1 }, { { 160, 40 }, 1 }, { { 224, 17 }, 1 }, { { 32, 7 }, 1 }, { { 96, 48 }, 1 }, { { 160, 144 }, 1 },
  { { 3, 96, 48 }, 2 }, { { 2, 32, 7 }, 2 }, { { 64, 2, 33 }, 1 },
}
local ELEM_SHAPES = { { { 37, 70 }, 1 }, { { 70, 5 }, 1 }, { { 2, 45, 66 }, 2 } }
local ELEM_CONFIGS = { { "f32" }, { "bf16" }, { "e4m3" }, { "e5m2" }, { "e4m3", amax = 3.5 } }

for _, dtype in ipairs({ "f32", "bf16" }) do
  T.case("column-wise quantization through 64x64 tiles equals the CPU bit for bit (" .. dtype .. " inputs, ragged tiles, every format and option)", function()
    need_gpu()
    local n = 0
    local function run(shapes, configs, seed0)
      for si, sh in ipairs(shapes) do
        local shape, axis = sh[1], sh[2]
        local x = make_input(shape, seed0 + si, dtype)
        local xd = x:cuda()
        for _, cfg in ipairs(configs) do
          local rows = 1
          for d = 1, #shape do if d ~= axis then rows = rows * shape[d] end end
          local ok = cfg.block ~= "2d" or (#shape == 2 and rows % 16 == 0)
          if cfg.sr_row_offset then ok = false end
          if ok then
            local o = opts_of(cfg)
            o.axis = axis
            local what = string.format("%s %s axis %d", label(cfg), table.concat(shape, "x"), axis)
            local qc = core.quantize(x, cfg[1], o)
            poisoned(function(byte)
              local q = core.quantize(xd, cfg[1], o)
              check_same_q(q, qc, what .. string.format(" (poison 0x%02x)", byte))
              q:free()
            end)
            qc:free()
            n = n + 1
          end
        end
        xd:free()
      end
    end
    run(COL_SHAPES, CONFIGS, 300)
    run(ELEM_SHAPES, ELEM_CONFIGS, 400)
    -- an unaligned view (offset by one element): the scalar load path
    local x = make_input({ 65, 96 }, 500, dtype)
    local xv, xdv = x:narrow(1, 2, 64), x:cuda():narrow(1, 2, 64)
    for _, fmt in ipairs({ "mxfp8_e4m3", "nvfp4", "e4m3", "bf16" }) do
      local qc = core.quantize(xv, fmt, { axis = 1 })
      local q = core.quantize(xdv, fmt, { axis = 1 })
      check_same_q(q, qc, fmt .. " on an unaligned view, axis 1")
      n = n + 1
    end
    T.ok(n > 80, "ran " .. n .. " comparisons")
  end)
end

T.case("column-wise quantization: one tiled kernel reading the input once and writing codes and scales once (emulator bytes)", function()
  need_gpu()
  T.need_emu()
  if not core.cuda_emu_counters().bytes_counted then T.skip("the emulator counts bytes on x86-64 only") end
  -- sizes where every buffer is a whole number of 4 KiB pages (the counters' granularity)
  local R, C = 128, 256
  for _, dtype in ipairs({ "f32", "bf16" }) do
    local xd = make_input({ R, C }, 600, dtype):cuda()
    local esz = dtype == "f32" and 4 or 2
    -- {format, code bytes per element, scale bytes per element (row-major, and again in the 128x4
    -- swizzled layout: C = 256 rows of the blocked layout, no padding)}
    for _, c in ipairs({ { "mxfp8_e4m3", 1, 2 / 32 }, { "nvfp4", 0.5, 2 / 16, amax = 3.0 }, { "e4m3", 1, 0, amax = 3.0 },
                         { "bf16", 2, 0 } }) do
      core.cuda_synchronize()
      core.cuda_emu_reset_counters()
      local q = T.with(core.cuda_set_sync, false, core.quantize, xd, c[1], { axis = 1, amax = c.amax })
      local k = core.cuda_emu_counters().kernels
      local name, kk
      for nm, v in pairs(k) do
        if nm:find("quant") then T.eq(name, nil, c[1] .. ": one quantization kernel"); name, kk = nm, v end
      end
      T.ok(name and name:find("quant_col_kernel", 1, true) ~= nil, c[1] .. " " .. dtype .. ": the tiled kernel, got " .. tostring(name))
      T.eq(kk.launches, 1, c[1] .. ": launches")
      T.eq(kk.bytes_read, R * C * esz, c[1] .. " " .. dtype .. ": bytes read = the input")
      T.eq(kk.bytes_written, math.floor(R * C * (c[2] + c[3])), c[1] .. " " .. dtype .. ": bytes written = codes + scales (both layouts)")
      q:free()
    end
    xd:free()
  end
end)

T.case("SR from a generator: the same draw as the CPU, and the offset advances by one", function()
  need_gpu()
  local x = make_input({ 64, 128 }, 7, "f32")
  local xd = x:cuda()
  local g1, g2 = nv.Generator(2024), nv.Generator(2024)
  for i = 1, 3 do
    local qc = core.quantize(x, "nvfp4", { sr = true, generator = g1, rht = i == 2 })
    local q = core.quantize(xd, "nvfp4", { sr = true, generator = g2, rht = i == 2 })
    check_same_q(q, qc, "generator draw " .. i)
    T.eq(g2:offset(), g1:offset(), "offsets after draw " .. i)
    q:free(); qc:free()
  end
  T.eq(g2:offset(), 3, "three SR calls advance the offset by three")
  xd:free()
end)

-- The swizzled copy of (rows, nb) row-major scale bytes, computed here (core/backend.h nvl_swizzled_bytes).
local function swizzle(bytes, rows, nb)
  local ncb = (nb + 3) // 4
  local nrb = (rows + 127) // 128
  local out = {}
  for i = 1, nrb * 128 * ncb * 4 do out[i] = 0 end
  for r = 0, rows - 1 do
    for j = 0, nb - 1 do
      local off = ((r // 128) * ncb + j // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + j % 4
      out[off + 1] = bytes:byte(r * nb + j + 1)
    end
  end
  local parts = {}
  for i = 1, #out, 4096 do parts[#parts + 1] = string.char(table.unpack(out, i, math.min(#out, i + 4095))) end
  return table.concat(parts)
end

T.case("block scales in cuBLASLt's 128x4 swizzled layout, padding zero", function()
  need_gpu()
  for _, sh in ipairs({ { 1, 16 }, { 130, 80 }, { 256, 512 }, { 200, 96 } }) do
    local x = make_input(sh, 11, "f32")
    local xd = x:cuda()
    for _, fmt in ipairs({ "nvfp4", "mxfp8_e4m3" }) do
      if sh[2] % (fmt == "nvfp4" and 16 or 32) == 0 then
        poisoned(function(byte)
          local q = core.quantize(xd, fmt)
          local nb = sh[2] // (fmt == "nvfp4" and 16 or 32)
          local want = swizzle(q:scale_bytes():bytes(), sh[1], nb)
          local got = q:swizzled_scales()
          T.ok(got ~= nil, fmt .. ": swizzled scales present")
          local gb = got:bytes()
          local i = first_diff(gb, want)
          T.ok(i == nil, i and string.format("%s %dx%d (poison 0x%02x): swizzled scales differ at byte %d of %d", fmt, sh[1],
            sh[2], byte, i, #want) or "")
          q:free()
        end)
      end
    end
    xd:free()
  end
end)

-- Row-wise + column-wise from one read: the same as two quantize calls on the CPU.
T.case("quantize_rowcol on cuda equals quantize(axis=2) then quantize(axis=1) on the CPU", function()
  need_gpu()
  local cases = {
    { { 64, 128 }, { "nvfp4" } }, { { 192, 320 }, { "nvfp4", rht = true } },
    { { 96, 160 }, { "nvfp4", sr = true, seed = 3, offset = 11 } },
    { { 128, 64 }, { "nvfp4", rht = true, sr = true, seed = 8, offset = 0 } },
    { { 80, 48 }, { "nvfp4", block = "2d" } }, { { 96, 64 }, { "nvfp4", amax = 20.0 } },
    { { 96, 160 }, { "mxfp8_e4m3" } }, { { 64, 96 }, { "mxfp8_e5m2", scale_rule = "floor", rht = true } },
    { { 64, 80 }, { "e4m3" } }, { { 30, 50 }, { "e5m2" } }, { { 48, 64 }, { "e4m3", rht = true } },
    { { 40, 24 }, { "bf16" } },
    -- the NVFP4 recipe's pairs: the column copy adds the RHT (x: plain + rht; dY: sr + rht sr)
    { { 64, 128 }, { "nvfp4", rht_col = true } },
    { { 96, 160 }, { "nvfp4", sr = true, seed = 4, offset = 2, rht_col = true } },
    { { 64, 96 }, { "mxfp4", sr = true, seed = 4, offset = 2, rht_col = true } },
  }
  for i, c in ipairs(cases) do
    for _, dtype in ipairs({ "f32", "bf16" }) do
      local x = make_input(c[1], 300 + i, dtype)
      local xd = x:cuda()
      local o = opts_of(c[2])
      local what = label(c[2]) .. " " .. table.concat(c[1], "x") .. " " .. dtype
      local oc = copy(o)
      oc.axis, oc.rht_col = 2, nil
      local qr_c = core.quantize(x, c[2][1], oc)
      oc.axis = 1
      if o.rht_col then oc.rht = true end
      local qc_c = core.quantize(x, c[2][1], oc)
      poisoned(function(byte)
        local qr, qc = core.quantize_rowcol(xd, c[2][1], o)
        check_same_q(qr, qr_c, what .. " row-wise")
        check_same_q(qc, qc_c, what .. " column-wise")
        qr:free(); qc:free()
      end)
      qr_c:free(); qc_c:free(); xd:free()
    end
  end
  -- with a generator: row draws offset o, column o + 1
  local x = make_input({ 64, 64 }, 9, "f32")
  local xd = x:cuda()
  local g1, g2 = nv.Generator(5), nv.Generator(5)
  local a1 = core.quantize(x, "nvfp4", { sr = true, generator = g1, axis = 2 })
  local a2 = core.quantize(x, "nvfp4", { sr = true, generator = g1, axis = 1 })
  local b1, b2 = core.quantize_rowcol(xd, "nvfp4", { sr = true, generator = g2 })
  check_same_q(b1, a1, "generator row-wise")
  check_same_q(b2, a2, "generator column-wise")
  T.eq(g2:offset(), 2, "rowcol advances the generator by two")
  T.raises(function() return core.quantize(xd, "nvfp4", { rht_col = true }) end, "rht_col")
  xd:free()
end)

T.case("quantize errors on cuda: block lengths, layouts, options", function()
  need_gpu()
  local x = nv.randn(8, 40):cuda()
  T.raises(function() return core.quantize(x, "nvfp4") end, "not a multiple of 16")
  T.raises(function() return core.quantize(x, "mxfp8_e4m3") end, "not a multiple of 32")
  T.raises(function() return core.quantize(x, "e4m3", { rht = true }) end, "16-element chunks")
  T.raises(function() return core.quantize(nv.randn(8, 32):cuda(), "nvfp4", { block = "2d" }) end, "2d")
  T.raises(function() return T.with(nv.use_reference, true, core.quantize, nv.randn(16, 32):cuda(), "nvfp4") end, "CPU")
  local y = nv.randn(16, 64):cuda()
  -- a non-contiguous view is quantized through a contiguous device copy (core/quant.c), like the CPU
  local ycpu = y:cpu()
  local qt = core.quantize(y:transpose(1, 2), "nvfp4")
  check_same_q(qt, core.quantize(ycpu:transpose(1, 2), "nvfp4"), "nvfp4 of a transposed view")
  qt:free()
  local q = core.quantize(y, "nvfp4", { block = "2d" })
  -- a device q's transpose is made on the device (test_cuda_qgather.lua checks it in full)
  check_same_q(q:t(), core.quantize(ycpu, "nvfp4", { block = "2d" }):t(), "q:t() on the device")
  T.raises(function() return core.quantize(y, "nvfp4"):t() end, "blocks run along one dim only")
  local qcpu = core.quantize(nv.randn(16, 64), "nvfp4")
  T.raises(function() return nv.qmatmul(q, qcpu) end, "different devices")
  -- a device q decodes on the host
  T.eq(q:dequantize():device(), "cpu", "dequantize of a device q gives a cpu tensor")
  T.eq(q:cpu():device(), "cpu", "q:cpu()")
  x:free(); y:free(); q:free()
end)

T.case("dequantize of RHT operands on cuda: on the device (kernels/cuda rht) and on the host, both domains, = the CPU's bits", function()
  need_gpu()
  -- the inverse transform runs where the values are: the CUDA table's rht entry for on_device, the
  -- CPU's for a device q decoded on the host; the same butterflies in the same order (common.cuh
  -- rht16, NUMERICS §5), so every path gives the CPU's bits
  local cases = {
    { { 130, 96 }, { "nvfp4", rht = true } }, { { 64, 96 }, { "nvfp4", rht = true, sr = true, seed = 9, offset = 2 }, 1 },
    { { 3, 64, 5 }, { "mxfp8_e4m3", rht = true }, 2 }, { { 48, 160 }, { "e5m2", rht = true } },
    { { 2, 5, 64 }, { "bf16", rht = true } }, { { 16, 32 }, { "nvfp4", block = "2d" } },
  }
  for i, c in ipairs(cases) do
    local x = make_input(c[1], 700 + i, "f32")
    local o = opts_of(c[2])
    o.axis = c[3]
    local qc, q = core.quantize(x, c[2][1], o), core.quantize(x:cuda(), c[2][1], o)
    local what = label(c[2]) .. " " .. table.concat(c[1], "x")
    for _, domain in ipairs({ "original", "rotated" }) do
      local want = qc:dequantize({ domain = domain })
      poisoned(function(byte)
        local dd = q:dequantize({ on_device = true, domain = domain })
        T.eq(dd:device(), "cuda", what .. ": on the device")
        same_bytes(dd:cpu(), want, string.format("%s %s on the device (poison 0x%02x)", what, domain, byte))
        dd:free()
      end)
      same_bytes(q:dequantize({ domain = domain }), want, what .. " " .. domain .. " on the host")
    end
    if qc.rht then -- x's domain is x's values within the format's error; the rotated values are not
      local d, r = qc:dequantize(), qc:dequantize({ domain = "rotated" })
      T.ok((d - x):abs():sum() < 0.5 * (r - x):abs():sum(), what .. ": dequantize() is nearer x than the rotated values")
    end
    qc:free(); q:free()
  end
end)

-- ---- GEMMs --------------------------------------------------------------------------------------

local U32 = 2.0 ^ -24

-- got (cuda) vs the fp32 CPU emulation want, elementwise |got - want| <= tol_ij with
-- tol_ij = rel * (|A| |B|^T)_ij (+ 2^-8 |want_ij| for a bf16 output): rel = 2 K u covers any
-- summation order of fp32 accumulation over exact products (u = 2^-24; every product of two
-- operands of these formats is exact in fp32), with room for tensor-core adders that truncate
-- instead of rounding. Hopper's fp8 MMA keeps about 14 bits while it adds a K = 32 step's products
-- to its accumulator, aligned to the largest and truncated (DeepSeek-V3 report, section 3.3.2), with
-- cuBLASLt's fp32 promotions between steps: up to 32 truncations of 2^-13 relative, so fp8 gets
-- 2^-8. Measured on an H200 (scripts/probe_gemm_accum.lua, experiments/bench/gemm_accum_h200_2026-11-28.md):
-- at most 2^-10.2 for inputs whose sums one product dominates, 2^-12.4 for randn. The native
-- block-scaled GEMMs of sm_100 keep 2^-12 (not yet run on such a GPU).
local function check_gemm(got, want, absprod, rel, out_bf16, what)
  T.eq(got:device(), "cuda", what .. ": device")
  local g = got:cpu():to("f32")
  local w = want:to("f32")
  local nan = g:ne(g):sum()
  T.eq(nan, 0, what .. ": NaN elements (unwritten or overflowed)")
  local bound = absprod * rel
  if out_bf16 then bound = bound + w:abs() * (2.0 ^ -8) end
  local excess = ((g - w):abs() - bound):max()
  T.ok(excess <= 0, string.format("%s: error exceeds the bound by %g", what, excess))
end

-- |the values a GEMM multiplies|: an RHT operand's as stored, in the rotated domain
local function deq_abs(q) return q:dequantize({ domain = "rotated" }):abs() end

-- {fmt_a, fmt_b, opts, rel}
local GEMMS = {
  { "f32", "f32" }, { "bf16", "bf16" },
  { "e4m3", "e4m3", fp8 = true }, { "e4m3", "e5m2", fp8 = true }, { "e5m2", "e4m3", fp8 = true },
  { "mxfp8_e4m3", "mxfp8_e4m3" }, { "mxfp8_e5m2", "mxfp8_e4m3" }, { "mxfp8_e5m2", "mxfp8_e5m2" },
  { "nvfp4", "nvfp4" }, { "nvfp4", "nvfp4", rht = true }, { "nvfp4", "nvfp4", sr = true },
  { "nvfp4", "bf16" }, { "mxfp8_e4m3", "nvfp4" }, { "e4m3", "nvfp4" },
}
local GEMM_SHAPES = { { 64, 96, 128 }, { 130, 48, 256 }, { 256, 512, 1024 } }

T.case("every GEMM path against the fp32 CPU emulation (f32 and bf16 outputs, poisoned)", function()
  need_gpu()
  for si, s in ipairs(GEMM_SHAPES) do
    local M, N, K = s[1], s[2], s[3]
    local a = make_input({ M, K }, 500 + si, "f32"):mul(0.01)
    local b = make_input({ N, K }, 600 + si, "f32"):mul(0.01)
    local ad, bd = a:cuda(), b:cuda()
    for _, gcase in ipairs(GEMMS) do
      local fa, fb = gcase[1], gcase[2]
      local oa = { rht = gcase.rht, sr = gcase.sr, seed = gcase.sr and 1 or nil, offset = gcase.sr and 0 or nil }
      local ob = { rht = gcase.rht }
      if fa ~= "nvfp4" then oa.sr, oa.seed, oa.offset = nil, nil, nil end
      local qa_c, qb_c = core.quantize(a, fa, oa), core.quantize(b, fb, ob)
      local qa, qb = core.quantize(ad, fa, oa), core.quantize(bd, fb, ob)
      local what = string.format("%s x %s%s%s %dx%dx%d", fa, fb, gcase.rht and " rht" or "", gcase.sr and " sr" or "", M, N, K)
      local path, detail = gemm_path(fa, fb)
      if not path then
        T.raises(function() return nv.qmatmul(qa, qb) end, "", what .. ": unsupported pair raises")
      else
        local absprod = nv.matmul(deq_abs(qa_c), deq_abs(qb_c):transpose(1, 2))
        -- fp8 MMAs (and the block-scaled ones of sm_100) may accumulate in fewer bits between fp32
        -- promotions: 2^-12 relative to sum |a||b| for them
        local low = path == "native" and (fa == "nvfp4" or fa:match("^mxfp8") ~= nil)
        local rel = gcase.fp8 and math.max(2.0 ^ -8, 2 * K * U32) or low and math.max(2.0 ^ -12, 2 * K * U32)
          or 2 * K * U32
        local prev = core.cuda_set_poison(0xFF)
        for _, out in ipairs({ "f32", "bf16" }) do
          local want = nv.qmatmul(qa_c, qb_c, { out = "f32" })
          local got = nv.qmatmul(qa, qb, { out = out })
          check_gemm(got, want, absprod, rel, out == "bf16", what .. " -> " .. out .. " (" .. path .. ": " .. detail .. ")")
          got:free()
        end
        -- accumulate: acc += product
        local acc0 = make_input({ M, N }, 700 + si, "f32")
        local acc = acc0:cuda()
        nv.qmatmul(qa, qb, { accumulate = acc })
        local want = nv.qmatmul(qa_c, qb_c, { accumulate = acc0:clone() })
        check_gemm(acc, want, absprod + acc0:abs() * (2 / (2 * K)), rel, false, what .. " accumulate")
        acc:free()
        core.cuda_set_poison(prev)
      end
      qa:free(); qb:free(); qa_c:free(); qb_c:free()
    end
    ad:free(); bd:free()
  end
end)

T.case("a per-tensor amax stays on the device: quantize, a transposed re-quantization and qmatmul wait for nothing; q.amax is read back on demand", function()
  T.need_emu() -- counts host synchronisations
  local function syncs() return core.cuda_emu_counters().host_syncs end
  local prev_sync = core.cuda_set_sync(false) -- as in training: no synchronisation after each kernel
  local x = make_input({ 48, 64 }, 801, "f32"):mul(0.01)
  local w = make_input({ 32, 64 }, 802, "f32"):mul(0.01)
  local xd, wd = x:cuda(), w:cuda()
  for _, c in ipairs({ { "e4m3", "e4m3" }, { "e5m2", "e4m3" }, { "nvfp4", "nvfp4", block = "2d" } }) do
    local fa, fb = c[1], c[2]
    local what = fa .. " x " .. fb .. (c.block and " (2d weight)" or "")
    local ob = { block = c.block }
    local acc, acc_host = nv.zeros(48, 32):cuda(), nv.zeros(48, 32):cuda()
    local s0 = syncs()
    local qa, qb = core.quantize(xd, fa), core.quantize(wd, fb, ob)
    -- dgrad's weight copy: w blocked along its other axis with the fprop copy's amax, given as qb
    local qbt = core.quantize(wd, fb, { axis = 1, block = c.block, amax = qb })
    local y = nv.qmatmul(qa, qb, { out = "bf16" })
    nv.qmatmul(qa, qb, { accumulate = acc })
    T.eq(syncs() - s0, 0, what .. ": no host synchronisation from the quantizations and GEMMs")
    -- the same GEMMs with the amaxes read back first (host alpha): the device-derived alpha and
    -- beta give the same bits
    local ra, rb = core.quantize(xd, fa), core.quantize(wd, fb, ob)
    local s1 = syncs()
    local amax = ra.amax
    T.eq(syncs() - s1, 1, what .. ": reading q.amax is one host synchronisation")
    local _ = ra.scale
    T.eq(syncs() - s1, 1, what .. ": the second read is free")
    local _ = rb.amax
    local y_host = nv.qmatmul(ra, rb, { out = "bf16" })
    nv.qmatmul(ra, rb, { accumulate = acc_host })
    T.ok(y:cpu():bytes() == y_host:cpu():bytes(), what .. ": bf16 product with the device alpha = with the host alpha, bit for bit")
    T.ok(acc:cpu():bytes() == acc_host:cpu():bytes(), what .. ": accumulated product (device beta 1) = host, bit for bit")
    -- against the CPU: amax, scale, and the transposed copy's codes
    local ca, cb = core.quantize(x, fa), core.quantize(w, fb, ob)
    T.eq(amax, ca.amax, what .. ": amax read back = the CPU's")
    T.eq(qa.scale, ca.scale, what .. ": scale read back = the CPU's")
    local cbt = core.quantize(w, fb, { axis = 1, block = c.block, amax = cb.amax })
    check_same_q(qbt, cbt, what .. ": the transposed re-quantization with the device amax")
    T.eq(qbt.amax, cb.amax, what .. ": it carries the amax it was given")
    for _, t in ipairs({ qa, qb, qbt, ra, rb, ca, cb, cbt }) do t:free() end
    y:free(); y_host:free(); acc:free(); acc_host:free()
  end
  -- amax given as a quantized tensor: clear errors
  local qm = core.quantize(xd, "mxfp8_e4m3")
  T.raises(function() return core.quantize(wd, "e4m3", { amax = qm }) end, "no per-tensor amax")
  local q8 = core.quantize(xd, "e4m3")
  T.raises(function() return core.quantize(wd, "mxfp8_e4m3", { amax = q8 }) end, "per-tensor scale")
  q8:free()
  T.raises(function() return core.quantize(wd, "e4m3", { amax = q8 }) end, "freed")
  T.raises(function() return core.quantize(wd, "e4m3", { amax = "big" }) end, "amax must be a number, a quantized tensor or a one%-element f32 tensor")
  -- an amax tensor: on the device, read there; errors name what is wrong
  local at = nv.tensor({ 3.5 }):cuda()
  local s0 = core.cuda_emu_counters().host_syncs
  local qt = core.quantize(wd, "e4m3", { amax = at })
  T.eq(core.cuda_emu_counters().host_syncs - s0, 0, "amax tensor on the device: no host sync")
  T.eq(qt.amax, 3.5, "amax tensor: the value used")
  T.raises(function() return core.quantize(wd, "e4m3", { amax = nv.zeros(2):cuda() }) end, "one f32 value")
  T.raises(function() return core.quantize(wd, "mxfp8_e4m3", { amax = at }) end, "per-tensor scale")
  qt:free(); at:free()
  -- a host-known amax (q on the CPU) is taken as a number, on any device
  local qc = core.quantize(w, "e4m3")
  local qd = core.quantize(wd, "e4m3", { amax = qc })
  T.eq(qd.amax, qc.amax, "amax of a CPU quantized tensor used on cuda")
  qm:free(); qc:free(); qd:free(); xd:free(); wd:free()
  core.cuda_set_sync(prev_sync)
end)

T.case("gemm_path: native bf16/f32/fp8, nvfp4 and mxfp8 native on sm_100 and emulated on sm_90, clear errors", function()
  need_gpu()
  local cap = nv.cuda.devices()[1].capability
  local major = tonumber(cap:match("^(%d+)"))
  T.eq(gemm_path("bf16"), "native", "bf16")
  T.eq(gemm_path("f32"), "native", "f32")
  T.eq(gemm_path("e4m3"), "native", "e4m3")
  T.eq(gemm_path("e4m3", "e5m2"), "native", "e4m3 x e5m2")
  local p, why = gemm_path("e5m2")
  T.ok(p == nil and why:find("e5m2"), "e5m2 x e5m2 is unsupported, with a reason: " .. tostring(why))
  p, why = gemm_path("f32", "nvfp4")
  T.ok(p == nil and why:find("f32"), "f32 x nvfp4 is unsupported: " .. tostring(why))
  local want = major == 10 and "native" or "emulated"
  T.eq(gemm_path("nvfp4"), want, "nvfp4 on sm_" .. cap)
  T.eq(gemm_path("mxfp8_e4m3"), want, "mxfp8_e4m3 on sm_" .. cap)
  T.eq(gemm_path("mxfp8_e5m2"), "emulated", "mxfp8 e5m2 x e5m2")
  T.eq(gemm_path("nvfp4", "bf16"), "emulated", "nvfp4 x bf16")
  local q = core.quantize(nv.randn(32, 64):cuda(), "e5m2")
  T.raises(function() return nv.qmatmul(q, q) end, "e5m2")
  q:free()
end)

T.case("caching allocator: blocks are reused, per-device statistics in nv.memory()", function()
  need_gpu()
  local m = core.cuda_memory()[1]
  for _, k in ipairs({ "allocated", "peak", "reserved", "cached", "blocks", "device_mallocs", "free", "total" }) do
    T.eq(type(m[k]), "number", "cuda_memory()[1]." .. k)
  end
  T.eq(type(nv.memory().devices), "table", "nv.memory().devices")
  local t = nv.empty(123457):cuda()
  t:free()
  local before = core.cuda_memory()[1]
  for _ = 1, 5 do
    local u = nv.empty(123457):cuda()
    u:free()
  end
  local after = core.cuda_memory()[1]
  T.eq(after.device_mallocs, before.device_mallocs, "the same size reuses the cached block")
  T.eq(after.allocated, before.allocated, "allocated bytes back where they were")
  core.cuda_empty_cache()
  T.eq(core.cuda_memory()[1].cached, 0, "empty_cache gives the cache back")
end)

-- ---- non-finite inputs (tests/nonfinite_flags.lua) ----------------------------------------------

T.case("on cuda: a NaN or an infinity in a quantization's input sets the device's flag; AdamW's parameters too", function()
  need_gpu()
  local FLAGS = dofile("tests/nonfinite_flags.lua")
  local dev = function(t) return t:cuda() end
  FLAGS.quantize_cases(dev, "cuda")
  FLAGS.optim_cases(dev, "cuda")
end)
