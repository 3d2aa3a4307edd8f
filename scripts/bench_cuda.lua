-- scripts/bench_cuda.lua: issue 6's CUDA benchmark. Two markdown tables, with device and date:
--  1. quantization kernels in GB/s beside a device-to-device copy measured in the same run (bytes
--     counted once: the input read plus every output written, block scales and their swizzled
--     copy included; the copy counts its read and its write). Goals: nvfp4 1D RNE >= 70% of the
--     copy; RHT + SR + both copies >= 50%.
--  2. GEMM TFLOP/s for Llama 3 8B shapes (M = 8192 tokens), bf16 / fp8 / nvfp4 / mxfp8 through
--     nv.qmatmul, beside torch.matmul (bf16) and torch._scaled_mm (fp8) from
--     scripts/bench_cuda_torch.py run in the same session. Goals: bf16 and fp8 within 5% of
--     PyTorch; emulated nvfp4 (quantize + dequantize + GEMM) within 1.5x of bf16.
-- Device time with CUDA events (core.cuda_time) around back-to-back calls, median of reps, after a
-- warm-up, sync mode off; random inputs. Commit the output under experiments/bench/.
--   build/nvlua scripts/bench_cuda.lua [rows=8192] [cols=8192] [m=8192] [iters=20] [reps=5] [torch=true]
--     [quant=true] [gemm=true]
-- Exits 77 without a GPU.
local nv = require "nvlua"
local core = require "nvlua.core"

local config = require "nvlua.config"

local pos = {min = 1}
local cfg = config.schema({rows = config.int(8192, pos), cols = config.int(8192, {min = 32}), m = config.int(8192, pos),
  iters = config.int(20, pos), reps = config.int(5, pos), torch = true, quant = true, gemm = true}):parse(arg)

if not nv.cuda.available() then
  io.stderr:write("bench_cuda: no GPU (" .. tostring(nv.info().cuda_unavailable_reason) .. ")\n")
  os.exit(77)
end

local dev = nv.cuda.devices()[1]
local info = nv.info()
core.cuda_set_sync(false)
local gemm_path = (nv.cuda and nv.cuda.gemm_path) or core.cuda_gemm_path

print(string.format("# nvlua CUDA benchmark\n\n%s, compute capability %s, %d SMs, %.1f GiB; CUDA runtime %d, cuBLASLt %d; %s",
  dev.name, dev.capability, dev.multiprocessors or 0, dev.memory / 2 ^ 30, info.cuda_runtime, info.cublaslt,
  os.date("!%Y-%m-%d %H:%M UTC")))

local function median(t)
  table.sort(t)
  return t[(#t + 1) // 2]
end

-- ms per call of fn: warm-up, then the median over reps of event-timed runs of iters calls.
local function time_ms(fn, iters)
  iters = iters or cfg.iters
  for _ = 1, 3 do fn() end
  core.cuda_synchronize()
  local ts = {}
  for r = 1, cfg.reps do ts[r] = core.cuda_time(fn, iters) end
  core.cuda_synchronize() -- surfaces any asynchronous fault of the timed calls
  return median(ts)
end

-- A random (rows, cols) device tensor of dtype with a spread of magnitudes.
local function device_input(rows, cols, dtype, seed)
  local g = nv.Generator(seed)
  local x = nv.randn(rows, cols, { generator = g })
  if dtype ~= "f32" then x = x:to(dtype) end
  local d = x:cuda()
  x:free()
  return d
end

-- ---- 1. quantization bandwidth -------------------------------------------------------------------

local copy_gbs
if cfg.quant then
  local R, C = cfg.rows, cfg.cols
  local n = R * C
  print(string.format("\n## Quantization kernels, x = %d x %d\n", R, C))
  print("| kernel | input | MB moved | ms | GB/s | % of copy |")
  print("|---|---|---:|---:|---:|---:|")
  local function swz(rows, nb) return ((rows + 127) // 128 * 128) * ((nb + 3) // 4 * 4) end
  -- bytes written by one copy of each format, blocked along a dim of length K with rows rows
  local function out_bytes(fmt, rows, K)
    if fmt == "nvfp4" then return rows * K // 2 + 2 * rows * (K // 16) end -- approx.: scales + swizzled
    if fmt:match("^mxfp8") then return rows * K + rows * (K // 32) + swz(rows, K // 32) end
    return rows * K
  end
  for _, dtype in ipairs({ "bf16", "f32" }) do
    local esize = dtype == "bf16" and 2 or 4
    local x = device_input(R, C, dtype, 1)
    local amax = x:cpu():abs():max()
    local ms = time_ms(function() local y = x:clone(); y:free() end)
    local gbs = 2 * n * esize / ms / 1e6
    if dtype == "bf16" then copy_gbs = gbs end
    local row = function(name, bytes, t)
      print(string.format("| %s | %s | %.0f | %.4f | %.0f | %.0f%% |", name, dtype, bytes / 1e6, t, bytes / t / 1e6,
        100 * (bytes / t / 1e6) / gbs))
    end
    row("device-to-device copy", 2 * n * esize, ms)
    local one, both = out_bytes("nvfp4", R, C), out_bytes("nvfp4", R, C) + out_bytes("nvfp4", C, R)
    local cases = {
      { "nvfp4 1D RNE (amax given)", n * esize + one, function() core.quantize(x, "nvfp4", { amax = amax }):free() end },
      { "nvfp4 1D RNE (+ amax pass, readback)", n * esize + one, function() core.quantize(x, "nvfp4"):free() end },
      { "nvfp4 1D RHT+SR, row+col (amax given)", n * esize + both, function()
        local a, b = core.quantize_rowcol(x, "nvfp4", { rht = true, sr = true, seed = 1, offset = 0, amax = 4 * amax })
        a:free(); b:free()
      end },
      { "nvfp4 1D RHT+SR, row+col (+ amax passes)", n * esize + both, function()
        local a, b = core.quantize_rowcol(x, "nvfp4", { rht = true, sr = true, seed = 1, offset = 0 })
        a:free(); b:free()
      end },
      { "nvfp4 2D, row+col (amax given)", n * esize + both, function()
        local a, b = core.quantize_rowcol(x, "nvfp4", { block = "2d", amax = amax })
        a:free(); b:free()
      end },
      { "mxfp8_e4m3 1D (+ amax pass)", n * esize + out_bytes("mxfp8_e4m3", R, C), function()
        core.quantize(x, "mxfp8_e4m3"):free()
      end },
      { "e4m3 per-tensor (amax given)", n * esize + n, function() core.quantize(x, "e4m3", { amax = amax }):free() end },
    }
    for _, c in ipairs(cases) do row(c[1], c[2], time_ms(c[3])) end
    x:free()
  end
  print("\nGoals: nvfp4 1D RNE >= 70% of the copy; RHT + SR + both copies >= 50% (amax-given rows: the kernel; "
    .. "'+ amax' rows add the reduction pass and its readback).")
end

-- ---- 2. GEMMs --------------------------------------------------------------------------------------

if cfg.gemm then
  local M = cfg.m
  local SHAPES = { { 6144, 4096 }, { 4096, 4096 }, { 28672, 4096 }, { 4096, 14336 } }
  -- PyTorch first (its own process; frees the GPU before nvlua allocates)
  local torch = {}
  local torch_note = "not run (torch=false)"
  if cfg.torch then
    core.cuda_empty_cache() -- hand the cached blocks back so PyTorch has the memory
    local here = (arg and arg[0] or "scripts/bench_cuda.lua"):match("^(.*)/[^/]*$") or "scripts"
    local cmd = string.format("python3 %s/bench_cuda_torch.py --m %d --iters %d --reps %d 2>&1", here, M, cfg.iters, cfg.reps)
    local p = io.popen(cmd)
    local out = p and p:read("a") or ""
    if p then p:close() end
    for name, nn, kk, ms, rate in out:gmatch("RESULT (%S+) (%d+) (%d+) (%S+) (%S+)") do
      torch[name .. " " .. nn .. " " .. kk] = { ms = tonumber(ms), rate = tonumber(rate) }
    end
    torch_note = out:match("(PyTorch [^\n]*)") or ("failed: " .. out:sub(1, 300))
  end
  print(string.format("\n## GEMMs, M = %d (TFLOP/s; PyTorch: %s)\n", M, torch_note))
  print("| format | path | N | K | ms | TFLOP/s | PyTorch TFLOP/s | ratio | vs nvlua bf16 |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for si, s in ipairs(SHAPES) do
    local N, K = s[1], s[2]
    local flops = 2.0 * M * N * K
    local a = device_input(M, K, "bf16", 10 + si)
    local b = device_input(N, K, "bf16", 20 + si)
    local bf16_ms
    local function report(name, path, ms, tname)
      local tf = flops / ms / 1e9
      local t = tname and torch[tname .. " " .. N .. " " .. K]
      print(string.format("| %s | %s | %d | %d | %.4f | %.0f | %s | %s | %s |", name, path, N, K, ms, tf,
        t and string.format("%.0f", t.rate) or "-", t and string.format("%.3f", tf / t.rate) or "-",
        bf16_ms and string.format("%.2fx", ms / bf16_ms) or "1.00x"))
    end
    -- bf16
    local qa, qb = core.quantize(a, "bf16"), core.quantize(b, "bf16")
    bf16_ms = nil
    local ms = time_ms(function() nv.qmatmul(qa, qb, { out = "bf16" }):free() end)
    report("bf16", gemm_path("bf16") or "-", ms, "matmul_bf16")
    bf16_ms = ms
    qa:free(); qb:free()
    -- fp8 e4m3 x e4m3, per-tensor scales
    if gemm_path("e4m3") then
      qa, qb = core.quantize(a, "e4m3"), core.quantize(b, "e4m3")
      ms = time_ms(function() nv.qmatmul(qa, qb, { out = "bf16" }):free() end)
      report("fp8 e4m3", gemm_path("e4m3"), ms, "scaled_mm_fp8")
      qa:free(); qb:free()
    end
    -- nvfp4 and mxfp8: the GEMM on quantized operands, then quantize (both, current amax) + GEMM
    for _, fmt in ipairs({ "nvfp4", "mxfp8_e4m3" }) do
      local path = gemm_path(fmt) or "-"
      qa, qb = core.quantize(a, fmt), core.quantize(b, fmt)
      ms = time_ms(function() nv.qmatmul(qa, qb, { out = "bf16" }):free() end)
      report(fmt .. " (GEMM)", path, ms)
      qa:free(); qb:free()
      ms = time_ms(function()
        local x, y = core.quantize(a, fmt), core.quantize(b, fmt)
        nv.qmatmul(x, y, { out = "bf16" }):free()
        x:free(); y:free()
      end, math.max(1, cfg.iters // 2))
      report(fmt .. " (quantize + GEMM)", path, ms)
    end
    a:free(); b:free()
    core.cuda_empty_cache()
  end
  print("\nGoals: bf16 and fp8 ratio to PyTorch >= 0.95; emulated nvfp4 (quantize + dequantize + GEMM) <= 1.5x bf16.")
end
