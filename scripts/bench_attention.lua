-- scripts/bench_attention.lua: issue 29's attention benchmark. Causal grouped-query attention at Llama 3 8B's
-- shapes (B 1, T 8192, 32 query / 8 KV heads of 128, bf16), forward and backward on the GPU, per nvlua route:
-- cudnn (cuDNN's fused SDPA; also its deterministic backward), flash (nvlua's FlashAttention-2 kernels) and
-- reference (the widened f32 op: NUMERICS §11's rule, on CUDA cores) — each where it runs here, else a row
-- saying why — beside PyTorch's scaled_dot_product_attention (its default choice, and the cuDNN and flash
-- backends forced) from scripts/bench_attention_torch.py in the same run. Prints a markdown table with the
-- device and date: milliseconds (median of `iters` timed with device events after a warm-up that builds the
-- plans) and TFLOP/s counted as FlashAttention does (causal: half the square; forward 4 B Hq T^2 D / 2, backward
-- 2.5x forward).
--   build/nvlua scripts/bench_attention.lua [seq=8192] [batch=1] [heads=32] [kv_heads=8] [head_dim=128]
--     [iters=10] [routes=cudnn,cudnn_det,flash,reference] [torch=true]
-- Exits 77 without a GPU. Commit the output under experiments/bench/.
local nv = require "nvlua"
local core = nv.core
local config = require "nvlua.config"

local cfg = config.schema({seq = config.int(8192, {min = 2}), batch = config.int(1, {min = 1}),
  heads = config.int(32, {min = 1}), kv_heads = config.int(8, {min = 1}), head_dim = config.int(128, {min = 8}),
  iters = config.int(10, {min = 1}), routes = config.str("cudnn,cudnn_det,flash,reference", {nonempty = true}),
  torch = config.str("true", {one_of = {"true", "false"}})}):parse(arg)

if not nv.cuda.available() then
  io.stderr:write("bench_attention: no GPU (" .. nv.cuda.unavailable_reason() .. ")\n")
  os.exit(77)
end
if cfg.heads % cfg.kv_heads ~= 0 then error("bench_attention: kv_heads must divide heads", 0) end

local B, Tn, Hq, Hkv, D = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
local scale = 1 / math.sqrt(D)
local FWD = 4 * B * Hq * Tn * Tn * D / 2 -- two products of 2 flops per multiply-add, causal half
local BWD = 2.5 * FWD

nv.cuda.set_sync(false)
nv.manual_seed(1)
local g = nv.Generator(3)
local function input(H) return nv.randn({B, Tn, H, D}, {generator = g}):to("bf16"):cuda() end
local q, k, v, dout = input(Hq), input(Hkv), input(Hkv), input(Hq)

local function median(fn)
  local t = {}
  for i = 1, 3 do t[i] = core.cuda_time(fn, math.max(1, cfg.iters // 3)) end
  table.sort(t)
  return t[2]
end

-- fn() with the route and the deterministic switch set, both restored after (also when fn raises)
local function with_route(route, det, fn)
  local pr, pd = core.attention_route(route), core.attention_cudnn_deterministic(det)
  local ok, err = pcall(fn)
  core.attention_route(pr)
  core.attention_cudnn_deterministic(pd)
  if not ok then error(err, 0) end
end

-- one row: the median forward and backward of route `name`, or why it does not run here
local ROUTES = {cudnn = {"cudnn", false}, cudnn_det = {"cudnn", true}, flash = {"flash", false},
  reference = {"reference", false}}
local function measure(name)
  local r = ROUTES[name]
  if not r then error("bench_attention: unknown route '" .. name .. "' (cudnn, cudnn_det, flash, reference)", 0) end
  local row = {name = "nvlua " .. name}
  local ok, err = pcall(with_route, r[1], r[2], function()
    local kind, why = core.attention_route_of(q, k, v)
    if kind == "error" or (r[1] ~= "reference" and kind ~= r[1]) then error("does not run here: " .. why, 0) end
    local o, l = core.attention_forward(q, k, v, scale) -- the warm-up builds the plans
    nv.scope(function() core.attention_backward(dout, q, k, v, o, l, scale) end)
    nv.cuda.synchronize()
    row.fwd = median(function() nv.scope(function() core.attention_forward(q, k, v, scale) end) end)
    row.bwd = median(function() nv.scope(function() core.attention_backward(dout, q, k, v, o, l, scale) end) end)
    o:free(); l:free()
  end)
  if not ok then row.why = tostring(err):gsub("\n.*", "") end
  return row
end

local rows = {}
for name in cfg.routes:gmatch("[^,]+") do
  io.stderr:write("bench_attention: nvlua " .. name .. " ...\n")
  rows[#rows + 1] = measure(name)
end

if cfg.torch == "true" then
  io.stderr:write("bench_attention: PyTorch scaled_dot_product_attention ...\n")
  local script = arg[0]:gsub("bench_attention%.lua$", "bench_attention_torch.py")
  local p = assert(io.popen(string.format("python3 %q --batch %d --seq %d --heads %d --kv-heads %d --head-dim %d " ..
    "--iters %d 2>&1", script, B, Tn, Hq, Hkv, D, cfg.iters)))
  local text = p:read("a")
  p:close()
  local found = false
  for backend, fwd, bwd in text:gmatch("RESULT torch (%S+) (%S+) (%S+)") do
    found = true
    if fwd == "n/a" then
      local why = text:match("NA " .. backend:gsub("%p", "%%%0") .. " ([^\n]*)")
      rows[#rows + 1] = {name = "torch " .. backend, why = why or ""}
    else
      rows[#rows + 1] = {name = "torch " .. backend, fwd = tonumber(fwd), bwd = tonumber(bwd)}
    end
  end
  if not found then io.stderr:write("bench_attention: PyTorch gave no result:\n" .. text .. "\n") end
end

local dev = nv.cuda.devices()[1]
local a = core.attention_cudnn()
print(string.format("# Causal GQA attention at Llama 3 8B shapes, forward and backward\n\n%s (compute capability %s, " ..
  "%.0f GiB), %s; cuDNN %s; B %d, T %d, Hq %d, Hkv %d, D %d, bf16; median of 3 x %d calls timed with device events " ..
  "after a warm-up; TFLOP/s as FlashAttention counts them (causal: half the square; backward 2.5x forward)",
  dev.name, tostring(dev.capability), dev.memory / 2 ^ 30, os.date("!%Y-%m-%d"),
  a.version > 0 and string.format("%d.%d.%d", a.version // 10000, a.version // 100 % 100, a.version % 100) or
  "not loaded (" .. a.library_error .. ")", B, Tn, Hq, Hkv, D, math.max(1, cfg.iters // 3)))
print("\n| implementation | forward ms | backward ms | fwd+bwd ms | forward TFLOP/s | backward TFLOP/s |")
print("|---|---:|---:|---:|---:|---:|")
for _, r in ipairs(rows) do
  if r.fwd then
    print(string.format("| %s | %.3f | %.3f | %.3f | %.0f | %.0f |", r.name, r.fwd, r.bwd, r.fwd + r.bwd,
      FWD / (r.fwd * 1e-3) / 1e12, BWD / (r.bwd * 1e-3) / 1e12))
  else
    print(string.format("| %s | - | - | - | - | - (%s) |", r.name, r.why or "no result"))
  end
end
