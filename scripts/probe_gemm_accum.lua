-- scripts/probe_gemm_accum.lua: how precisely the GPU's GEMMs accumulate. For each operand pair and
-- depth K, random operands quantized on the CPU and the device; the device GEMM (f32 output) against
-- the CPU's fp32 emulation (exact products, fp32 sums: its own error <= K 2^-24 sum|a||b|, far
-- below what is measured here). Prints, per case, the largest |got - want| / (|A||B|^T) over the
-- output (the test bound's form: tests/test_cuda_quant.lua check_gemm) and that ratio in units of
-- 2^-24 K (fp32 accumulation's worst case), for two input distributions: randn, and "wide" (randn
-- times exp(U(-6, 6)), the tests' make_input: a few products dominate each sum).
--   build/nvlua scripts/probe_gemm_accum.lua [m=64] [n=96] [ks=32,128,512,2048,8192] [seed=1]
-- Exits 77 without a GPU.
local nv = require "nvlua"
local core = require "nvlua.core"
local config = require "nvlua.config"

local cfg = config.schema({ m = config.int(64, { min = 1 }), n = config.int(96, { min = 1 }),
  ks = config.str("32,128,512,2048,8192", { nonempty = true }), seed = config.int(1, { min = 0 }) }):parse(arg)
if not nv.cuda.available() then
  io.stderr:write("probe_gemm_accum: no GPU (" .. tostring(nv.info().cuda_unavailable_reason) .. ")\n")
  os.exit(77)
end

local function input(shape, seed, wide)
  local g = nv.Generator(seed)
  local x = nv.randn(shape, { generator = g })
  if wide then
    local scale = nv.rand(x:numel(), { generator = g }):mul(12):sub(6):exp():reshape(table.unpack(shape))
    x = x * scale
  end
  return x:mul(0.01)
end

local dev = nv.cuda.devices()[1]
print(string.format("# GEMM accumulation on %s (compute capability %s), %s\n", dev.name, dev.capability,
  os.date("!%Y-%m-%d %H:%M UTC")))
print(string.format("M = %d, N = %d; max |got - want| / (|A||B|^T) over the output, and that / (K 2^-24)\n",
  cfg.m, cfg.n))
print("| A x B | inputs | K | max err / sum|a||b| | log2 | / (K 2^-24) |")
print("|---|---|---:|---:|---:|---:|")
local pairs_ = { { "bf16", "bf16" }, { "e4m3", "e4m3" }, { "e4m3", "e5m2" }, { "nvfp4", "nvfp4" } }
for _, pr in ipairs(pairs_) do
  for _, wide in ipairs({ false, true }) do
    for k in cfg.ks:gmatch("%d+") do
      local K = math.tointeger(tonumber(k))
      local a, b = input({ cfg.m, K }, cfg.seed, wide), input({ cfg.n, K }, cfg.seed + 1, wide)
      local qa_c, qb_c = core.quantize(a, pr[1]), core.quantize(b, pr[2])
      local qa, qb = core.quantize(a:cuda(), pr[1]), core.quantize(b:cuda(), pr[2])
      local want = nv.qmatmul(qa_c, qb_c, { out = "f32" })
      local got = nv.qmatmul(qa, qb, { out = "f32" }):cpu()
      local absprod = nv.matmul(qa_c:dequantize():abs(), qb_c:dequantize():abs():transpose(1, 2))
      local r = ((got - want):abs() / (absprod + 1e-30)):max() -- 1e-30: an all-zero row of products
      print(string.format("| %s x %s | %s | %d | %.3g | %.1f | %.3g |", pr[1], pr[2], wide and "wide" or "randn", K, r,
        r > 0 and math.log(r, 2) or -math.huge, r / (K * 2.0 ^ -24)))
      io.stdout:flush()
    end
  end
end
