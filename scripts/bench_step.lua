-- scripts/bench_step.lua: one training step of a ~10M-parameter Llama on the CPU, per recipe:
-- step time, tokens/s, the share of the step spent quantizing and in GEMMs, and the GEMMs' rate
-- beside OpenBLAS's sgemm rate on the same shapes. With torch=true, the same model and step in PyTorch
-- on the CPU (scripts/bench_step_torch.py: eager fp32, torch.compile fp32, eager with bf16 autocast) in
-- the same invocation, and the ratios issue 17 sets goals on. Prints a markdown table; commit it under
-- experiments/bench/ with the machine and date.
--   build/nvlua scripts/bench_step.lua [steps=5] [batch=8] [seq=128] [recipes=f32,bf16,fp8_cs,mxfp8,nvfp4]
--     [torch=false] [torch_modes=eager,compile,autocast] [repeat=1]
-- repeat=N runs everything (every recipe, then PyTorch) N times: the table shows each row's median run,
-- and each goal ratio is given per run (both sides of a ratio from the same run) with the median. On a
-- shared machine single runs vary by about 10%.
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local quant = require "nvlua.quant"
local recipe = require "nvlua.recipe"
local train = require "nvlua.train"

local config = require "nvlua.config"

local cfg = config.schema({steps = config.int(5, {min = 1}), batch = config.int(8, {min = 1}),
  seq = config.int(128, {min = 1}), recipes = config.str("f32,bf16,fp8_cs,mxfp8,nvfp4", {nonempty = true}),
  torch = false, torch_modes = config.str("eager,compile,autocast", {nonempty = true}),
  ["repeat"] = config.int(1, {min = 1})}):parse(arg)

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
local flops_gemm = 6 * tokens * (6 * (384 * 64 * (6 * 2 + 2 * 2) + 3 * 384 * 1024) + 384 * 256)

-- one recipe's step: {ms, s = median step seconds, q = its quantize seconds, g = its GEMM seconds}
local function nvlua_step(r)
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
  model = nil
  collectgarbage()
  return {ms = times[m] * 1000, s = times[m], q = tq[m], g = tg[m]}
end

-- PyTorch's step on the same model (scripts/bench_step_torch.py): mode -> ms, or a failure message
local function torch_steps()
  local here = (arg[0] or "scripts/bench_step.lua"):match("^(.*)/[^/]*$") or "scripts"
  local cmd = string.format("python3 %s/bench_step_torch.py --batch %d --seq %d --steps %d --modes %s 2>&1", here,
    cfg.batch, cfg.seq, cfg.steps, cfg.torch_modes)
  local p = assert(io.popen(cmd))
  local ms, failed, info = {}, {}, nil
  for line in p:lines() do
    local mode, v = line:match("^torch (%S+) (%S+)")
    if line:match("^torch_info ") then info = line:sub(12)
    elseif mode and tonumber(v) then ms[mode] = tonumber(v)
    elseif mode then failed[mode] = line:match("FAILED (.*)") or v end
  end
  p:close()
  return ms, failed, info
end

local function median(t)
  local c = {table.unpack(t)}
  table.sort(c)
  return c[(#c + 1) // 2]
end

-- runs: every recipe, then PyTorch, `repeat` times over; each run's ratios come from that run alone
local recipes = {}
for r in cfg.recipes:gmatch("[^,]+") do recipes[#recipes + 1] = r end
local runs = {}
for k = 1, cfg["repeat"] do
  local run = {nv = {}, torch = {}}
  for _, r in ipairs(recipes) do run.nv[r] = nvlua_step(r) end
  if cfg.torch then run.torch, run.failed, run.info = torch_steps() end
  runs[k] = run
  if cfg["repeat"] > 1 then io.stderr:write(string.format("run %d of %d done\n", k, cfg["repeat"])) end
end

-- the table: per row the run whose step time is that row's median over the runs
local function median_run(get)
  local v = {}
  for k = 1, #runs do if get(runs[k]) then v[#v + 1] = {t = get(runs[k]), k = k} end end
  if #v == 0 then return nil end
  table.sort(v, function(a, b) return a.t < b.t end)
  return v[(#v + 1) // 2].k
end
print(string.format("median over %d run%s of each row's step time", #runs, #runs > 1 and "s" or ""))
print("")
print("| recipe | step ms | tokens/s | quantize % | GEMM % | GEMM GFLOP/s | GEMM / sgemm | vs bf16 step |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
local kb = median_run(function(run) return run.nv.bf16 and run.nv.bf16.ms end)
local bf16_ms = kb and runs[kb].nv.bf16.ms
for _, r in ipairs(recipes) do
  local e = runs[median_run(function(run) return run.nv[r].ms end)].nv[r]
  print(string.format("| %s | %.0f | %.0f | %.1f | %.1f | %.1f | %.2f | %s |", r, e.ms, tokens / e.s, 100 * e.q / e.s,
    100 * e.g / e.s, flops_gemm / e.g / 1e9, flops_gemm / e.g / peak, bf16_ms and string.format("%.2fx", e.ms / bf16_ms) or "-"))
end
if cfg.torch then
  local names = {eager = "PyTorch eager f32", compile = "PyTorch torch.compile f32", autocast = "PyTorch eager bf16 autocast"}
  for mode in cfg.torch_modes:gmatch("[^,]+") do
    local k = median_run(function(run) return run.torch[mode] end)
    if k then
      local ms = runs[k].torch[mode]
      print(string.format("| %s | %.0f | %.0f | | | | | %s |", names[mode] or mode, ms, tokens / ms * 1000,
        bf16_ms and string.format("%.2fx", ms / bf16_ms) or "-"))
    elseif runs[1].failed and runs[1].failed[mode] then
      print(string.format("| %s | failed: %s | | | | | | |", names[mode] or mode, runs[1].failed[mode]))
    end
  end
  print("")
  print("PyTorch: " .. tostring(runs[1].info or "did not run (see the rows above)"))
end
print("")
print(string.format("parameters: %.2fM; GEMM FLOPs per step %.2f G (6 x tokens x GEMM parameters)",
  llama.Llama(mcfg):num_parameters() / 1e6, flops_gemm / 1e9))
-- the ratios of issue 17's goals, each from one run; with several runs, each run's and their median
local function ratios(name, a, b)
  local v = {}
  for _, run in ipairs(runs) do
    local x, y = a(run), b(run)
    if x and y then v[#v + 1] = x / y end
  end
  if #v == 0 then return end
  local each = {}
  for i, x in ipairs(v) do each[i] = string.format("%.2f", x) end
  if #v == 1 then print(string.format("- %s: %s", name, each[1]))
  else print(string.format("- %s: %.2f (median; runs: %s)", name, median(v), table.concat(each, ", "))) end
end
local function nvms(r) return function(run) return run.nv[r] and run.nv[r].ms end end
local function tms(m) return function(run) return run.torch[m] end end
if cfg.torch and runs[1].torch.autocast then
  print("")
  print("Ratios, each measured within one run (issue 17's goals: nvfp4/autocast <= 1, bf16/autocast <= 1/1.2 = 0.83,")
  print("f32/compile <= 1, nvfp4/bf16 <= 1.15):")
  ratios("nvlua nvfp4 step / PyTorch autocast", nvms("nvfp4"), tms("autocast"))
  ratios("nvlua bf16 step / PyTorch autocast", nvms("bf16"), tms("autocast"))
  ratios("nvlua f32 step / PyTorch compile", nvms("f32"), tms("compile"))
end
ratios("nvlua nvfp4 / nvlua bf16", nvms("nvfp4"), nvms("bf16"))
