-- scripts/bench_step.lua: one training step of a ~10M-parameter Llama on the CPU, per recipe:
-- step time, tokens/s, the share of the step spent quantizing and in GEMMs, and the GEMMs' rate
-- beside OpenBLAS's sgemm rate on the same shapes. With torch=true, the same model and step in PyTorch
-- on the CPU (scripts/bench_step_torch.py: eager fp32, torch.compile fp32, eager with bf16 autocast) in
-- the same invocation, and the ratios issue 17 sets goals on. Prints a markdown table; commit it under
-- experiments/bench/ with the machine and date.
--   build/nvlua scripts/bench_step.lua [steps=5] [batch=8] [seq=128] [recipes=f32,bf16,fp8_cs,mxfp8,nvfp4]
--     [torch=false] [torch_modes=eager,compile,autocast]
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local quant = require "nvlua.quant"
local recipe = require "nvlua.recipe"
local train = require "nvlua.train"

local config = require "nvlua.config"

local cfg = config.schema({steps = config.int(5, {min = 1}), batch = config.int(8, {min = 1}),
  seq = config.int(128, {min = 1}), recipes = config.str("f32,bf16,fp8_cs,mxfp8,nvfp4", {nonempty = true}),
  torch = false, torch_modes = config.str("eager,compile,autocast", {nonempty = true})}):parse(arg)

local mcfg = {vocab_size = 256, hidden_size = 384, intermediate_size = 1024, num_hidden_layers = 6,
  num_attention_heads = 6, num_key_value_heads = 2, max_position_embeddings = cfg.seq}

-- time spent inside quantize and inside the GEMMs (qmatmul, or matmul on the f32 path)
local t_quant, t_gemm = 0, 0
local q0, qm0 = quant.quantize, quant.qmatmul
quant.quantize = function(...)
  local t0 = nv.clock()
  local q = q0(...)
  t_quant = t_quant + nv.clock() - t0
  return q
end
quant.qmatmul = function(...)
  local t0 = nv.clock()
  local y = qm0(...)
  t_gemm = t_gemm + nv.clock() - t0
  return y
end
local mm0 = nv.Tensor.matmul
nv.Tensor.matmul = function(...)
  local t0 = nv.clock()
  local y = mm0(...)
  t_gemm = t_gemm + nv.clock() - t0
  return y
end

-- OpenBLAS sgemm on this model's GEMM shapes (M = tokens), FLOP/s
local tokens = cfg.batch * cfg.seq
local shapes = {{tokens, 384, 384}, {tokens, 128, 384}, {tokens, 1024, 384}, {tokens, 384, 1024}, {tokens, 256, 384}}
local function sgemm_rate()
  local fl, t = 0, 0
  for _, s in ipairs(shapes) do
    local a, b = nv.randn(s[1], s[3]), nv.randn(s[3], s[2])
    mm0(a, b):free()
    local best = math.huge
    for _ = 1, 3 do
      local t0 = nv.clock()
      mm0(a, b):free()
      best = math.min(best, nv.clock() - t0)
    end
    fl, t = fl + 2 * s[1] * s[2] * s[3], t + best
    a:free(); b:free()
  end
  return fl / t
end
local peak = sgemm_rate()

local ids = nv.tensor({{0}}, "i64") -- replaced below
local gen = nv.Generator(5)
local function batch()
  local x = (nv.rand(cfg.batch, cfg.seq, {generator = gen}) * 255):to("i64")
  local y = (nv.rand(cfg.batch, cfg.seq, {generator = gen}) * 255):to("i64")
  return x, y
end
ids:free()

local info = nv.info()
print(string.format("# nvlua %s training step, CPU (%s)", info.version, info.blas))
print(string.format("model: hidden 384, 6 layers, 6/2 heads, ffn 1024, vocab 256; batch %d x seq %d = %d tokens; median of %d steps",
  cfg.batch, cfg.seq, tokens, cfg.steps))
print(string.format("OpenBLAS sgemm on the model's GEMM shapes: %.1f GFLOP/s", peak / 1e9))
print("")
print("| recipe | step ms | tokens/s | quantize % | GEMM % | GEMM GFLOP/s | GEMM / sgemm | vs bf16 step |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
local bf16_ms
local step_ms = {} -- recipe -> median step ms
local flops_gemm = 6 * tokens * (6 * (384 * 64 * (6 * 2 + 2 * 2) + 3 * 384 * 1024) + 384 * 256)
for r in cfg.recipes:gmatch("[^,]+") do
  local model = llama.Llama(mcfg, {recipe = recipe[r](), seed = 1})
  local opt = optim.AdamW(model:named_parameters(), {lr = 1e-3})
  local times, tq, tg = {}, {}, {}
  for i = 0, cfg.steps do
    local x, y = batch()
    t_quant, t_gemm = 0, 0
    local t0 = nv.clock()
    model:forward_backward(x, y)
    opt:clip_grad_norm(1.0) -- the trainer's clip (train.lua): one multi-tensor norm, the factor applied in the step
    opt:step()
    model:zero_grad()
    local dt = nv.clock() - t0
    if i > 0 then times[#times + 1], tq[#tq + 1], tg[#tg + 1] = dt, t_quant, t_gemm end -- step 0 warms up
    x:free(); y:free()
    collectgarbage()
  end
  local order = {}
  for i = 1, #times do order[i] = i end
  table.sort(order, function(a, b) return times[a] < times[b] end)
  local m = order[(#order + 1) // 2]
  local ms = times[m] * 1000
  if r == "bf16" then bf16_ms = ms end
  step_ms[r] = ms
  print(string.format("| %s | %.0f | %.0f | %.1f | %.1f | %.1f | %.2f | %s |", r, ms, tokens / times[m], 100 * tq[m] / times[m],
    100 * tg[m] / times[m], flops_gemm / tg[m] / 1e9, flops_gemm / tg[m] / peak,
    bf16_ms and string.format("%.2fx", ms / bf16_ms) or "-"))
  model = nil
  collectgarbage()
end

-- PyTorch's step on the same model, in this run; its rows and the ratios of issue 17's goals
local torch_ms = {}
if cfg.torch then
  local here = (arg[0] or "scripts/bench_step.lua"):match("^(.*)/[^/]*$") or "scripts"
  local cmd = string.format("python3 %s/bench_step_torch.py --batch %d --seq %d --steps %d --modes %s 2>&1", here,
    cfg.batch, cfg.seq, cfg.steps, cfg.torch_modes)
  local p = assert(io.popen(cmd))
  local info
  for line in p:lines() do
    local mode, v = line:match("^torch (%S+) (%S+)")
    if line:match("^torch_info ") then info = line:sub(12)
    elseif mode and tonumber(v) then torch_ms[mode] = tonumber(v)
    elseif mode then print(string.format("| PyTorch %s | failed: %s | | | | | | |", mode, line:match("FAILED (.*)") or v)) end
  end
  p:close()
  local names = {eager = "PyTorch eager f32", compile = "PyTorch torch.compile f32", autocast = "PyTorch eager bf16 autocast"}
  for mode in cfg.torch_modes:gmatch("[^,]+") do
    local ms = torch_ms[mode]
    if ms then
      print(string.format("| %s | %.0f | %.0f | | | | | %s |", names[mode] or mode, ms, tokens / ms * 1000,
        bf16_ms and string.format("%.2fx", ms / bf16_ms) or "-"))
    end
  end
  print("")
  print("PyTorch: " .. tostring(info or "did not run (see the rows above)"))
end
print("")
print(string.format("parameters: %.2fM; GEMM FLOPs per step %.2f G (6 x tokens x GEMM parameters)",
  llama.Llama(mcfg):num_parameters() / 1e6, flops_gemm / 1e9))
if torch_ms.autocast then
  local function ratio(r, what)
    if step_ms[r] then
      print(string.format("- nvlua %s step / PyTorch %s: %.2f", r, what, step_ms[r] / torch_ms[what]))
    end
  end
  print("")
  print("Ratios measured in this run (issue 17's goals: nvfp4/autocast <= 1, bf16/autocast <= 1/1.2 = 0.83,")
  print("f32/compile <= 1, nvfp4/bf16 <= 1.15):")
  ratio("nvfp4", "autocast")
  ratio("bf16", "autocast")
  if torch_ms.compile then ratio("f32", "compile") end
  if step_ms.nvfp4 and step_ms.bf16 then print(string.format("- nvlua nvfp4 / nvlua bf16: %.2f", step_ms.nvfp4 / step_ms.bf16)) end
end
