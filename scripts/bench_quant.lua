-- scripts/bench_quant.lua: CPU quantization throughput, GB/s of f32 input read, per format and
-- option set, beside a memcpy baseline (copy_ between two f32 buffers of the same size) and the
-- scalar reference kernels. Prints a markdown table; commit it under experiments/bench/.
--   build/nvlua scripts/bench_quant.lua [rows=4096] [cols=4096] [reps=5] [reference=true]
local nv = require "nvlua"
local config = require "nvlua.config"

-- cols: a multiple of 32 (the MX block), rows of 16 (the 2-D weight blocks)
local function mult(n) return function(v) if v % n ~= 0 then return "must be a multiple of " .. n end end end
local cfg = config.schema({rows = config.int(4096, {min = 16, check = mult(16)}),
  cols = config.int(4096, {min = 32, check = mult(32)}), reps = config.int(5, {min = 1}), reference = true}):parse(arg)

nv.manual_seed(0)
local x = nv.randn(cfg.rows, cfg.cols)
local bytes = x:numel() * 4

local function median(t)
  table.sort(t)
  return t[(#t + 1) // 2]
end

local function time(fn)
  fn() -- warm up
  local ts = {}
  for i = 1, cfg.reps do
    local t0 = nv.clock()
    fn()
    ts[i] = nv.clock() - t0
    collectgarbage()
  end
  return median(ts)
end

local dst = nv.empty(cfg.rows, cfg.cols)
local t_copy = time(function() dst:copy_(x) end)

local cases = {
  {"nvfp4 1d", "nvfp4", {}},
  {"nvfp4 2d", "nvfp4", {block = "2d"}},
  {"nvfp4 1d +rht", "nvfp4", {rht = true}},
  {"nvfp4 1d +sr", "nvfp4", {sr = true, seed = 1, offset = 0}},
  {"nvfp4 1d +rht +sr", "nvfp4", {rht = true, sr = true, seed = 1, offset = 0}},
  {"nvfp4 column-wise (axis 1)", "nvfp4", {axis = 1}},
  {"mxfp8_e4m3", "mxfp8_e4m3", {}},
  {"mxfp8_e5m2 floor", "mxfp8_e5m2", {scale_rule = "floor"}},
  {"e4m3 per-tensor", "e4m3", {}},
  {"e5m2 per-tensor", "e5m2", {}},
  {"bf16", "bf16", {}},
}

local info = nv.info()
print(string.format("# nvlua %s quantization throughput (CPU)", info.version))
print(string.format("input: %dx%d f32 (%.1f MB); median of %d runs; %s", cfg.rows, cfg.cols, bytes / 1e6, cfg.reps, info.blas))
print("")
print("| case | fast GB/s | % of copy | reference GB/s | fast / reference |")
print("|---|---:|---:|---:|---:|")
print(string.format("| copy_ (f32 -> f32) | %.2f | 100 | | |", bytes / t_copy / 1e9))
for _, c in ipairs(cases) do
  local label, fmt, opts = c[1], c[2], c[3]
  local t_fast = time(function() nv.quantize(x, fmt, opts):free() end)
  local t_ref
  if cfg.reference then
    nv.use_reference(true)
    t_ref = time(function() nv.quantize(x, fmt, opts):free() end)
    nv.use_reference(false)
  end
  print(string.format("| %s | %.2f | %.0f | %s | %s |", label, bytes / t_fast / 1e9, 100 * t_copy / t_fast,
    t_ref and string.format("%.2f", bytes / t_ref / 1e9) or "-", t_ref and string.format("%.1fx", t_ref / t_fast) or "-"))
end
