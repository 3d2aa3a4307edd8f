-- scripts/bench_blocks.lua: issue 7's benchmark. Llama 3 8B blocks at full width (hidden 4096,
-- 32 query / 8 KV heads of 128, SwiGLU 14336, RoPE theta 500000) at sequence `seq` (8192),
-- micro-batch 1: one training step (forward + backward + gradient clipping + AdamW) on the GPU
-- per recipe (bf16, fp8_cs, nvfp4 — emulated on Hopper) for 1 and 4 blocks, beside the same model
-- in PyTorch (eager with scaled_dot_product_attention, and torch.compile) from
-- scripts/bench_blocks_torch.py in the same run. Both sides run the same model: an embedding and
-- an LM head of a 256-token vocabulary around the blocks (negligible work), fp32 master weights.
-- Prints a markdown table with the device and date: step ms (median), tokens/s, model TFLOP/s
-- (train.flops_per_token: 6 x GEMM parameters + causal attention counted in full, as MFU does)
-- and peak GPU memory, one row per configuration as soon as it is measured (nvlua's in the order
-- run, then PyTorch's), so a run stopped by a time limit keeps what finished. Goals (issue 7): nvlua
-- bf16 at least as fast as torch.compile; fp8_cs >= 1.25x nvlua bf16 throughput; the nvfp4 step <=
-- 1.35x the nvlua bf16 step.
-- Each configuration runs in its own process (a clean peak-memory count; memory given back).
--   build/nvlua scripts/bench_blocks.lua [layers=1,4] [seq=8192] [steps=3] [recipes=bf16,fp8_cs,nvfp4] [torch=true]
-- Exits 77 without a GPU. Commit the output under experiments/bench/.
local nv = require "nvlua"
local config = require "nvlua.config"

-- one=<layers>:<recipe> is the child process's single configuration (set by this script)
local cfg = config.schema({layers = config.str("1,4", {nonempty = true}), seq = config.int(8192, {min = 1}),
  steps = config.int(3, {min = 1}), recipes = config.str("bf16,fp8_cs,nvfp4", {nonempty = true}),
  torch = config.str("true", {one_of = {"true", "false"}}), one = ""}):parse(arg)

local function list(s)
  local out = {}
  for x in tostring(s):gmatch("[^,]+") do out[#out + 1] = math.tointeger(tonumber(x)) or x end
  return out
end

local function model_config(layers, seq)
  return {vocab_size = 256, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = layers,
    num_attention_heads = 32, num_key_value_heads = 8, rope_theta = 500000.0, rms_norm_eps = 1e-5,
    max_position_embeddings = seq}
end

-- ---- one configuration, in a child process: prints "RESULT nvlua <recipe> <layers> <ms> <peak bytes>"
if cfg.one ~= "" then
  local llama = require "nvlua.llama"
  local optim = require "nvlua.optim"
  local recipe = require "nvlua.recipe"
  local rname, layers = cfg.one:match("^([%w_]+):(%d+)$")
  layers = math.tointeger(tonumber(layers))
  nv.cuda.set_sync(false)
  local rec = rname == "nvfp4" and recipe.nvfp4({bf16_first = 0, bf16_last = 0}) or recipe[rname]()
  local m = llama.Llama(model_config(layers, cfg.seq), {seed = 1, recipe = rec}):to("cuda")
  local opt = optim.AdamW(m:named_parameters(), {lr = 1e-4, betas = {0.9, 0.95}, weight_decay = 0.1})
  local g = nv.Generator(5)
  local ids = (nv.rand({1, cfg.seq + 1}, {generator = g}) * 255):to("i64")
  local x, y = ids:narrow(2, 1, cfg.seq):contiguous(), ids:narrow(2, 2, cfg.seq):contiguous()
  local times = {}
  for s = 0, cfg.steps do -- step 0 warms up (allocator, cuBLASLt heuristics)
    nv.cuda.synchronize()
    local t0 = nv.clock()
    m.step = s
    m:zero_grad()
    m:forward_backward(x, y)
    optim.clip_grad_norm(m:named_parameters(), 1.0)
    opt:step()
    nv.cuda.synchronize()
    if s > 0 then times[#times + 1] = nv.clock() - t0 end
  end
  table.sort(times)
  local peak = 0
  for _, d in pairs(nv.cuda.memory()) do peak = math.max(peak, d.peak or 0) end
  print(string.format("RESULT nvlua %s %d %.3f %d", rname, layers, 1000 * times[(#times + 1) // 2], peak))
  os.exit(0)
end

if not nv.cuda.available() then
  io.stderr:write("bench_blocks: no GPU (" .. nv.cuda.unavailable_reason() .. ")\n")
  os.exit(77)
end

local train = require "nvlua.train"
local self_cmd = string.format("%q %q", arg[-1] or "build/nvlua", arg[0])
local base = {} -- base[layers] = nvlua bf16's step ms, for the last column

-- The header first and each row as soon as its configuration is measured (flushed), so a run stopped
-- by a time limit keeps the rows that finished.
local dev = nv.cuda.devices()[1]
print(string.format("# Llama 3 8B blocks, one training step on the GPU\n\n%s (compute capability %s, %.0f GiB), %s; " ..
  "sequence %d, micro-batch 1, vocabulary 256; median of %d steps after a warm-up",
  dev.name, tostring(dev.capability), dev.memory / 2 ^ 30, os.date("!%Y-%m-%d"), cfg.seq, cfg.steps))
print("\n| blocks | implementation | step ms | tokens/s | model TFLOP/s | peak GiB | vs nvlua bf16 step |")
print("|---:|---|---:|---:|---:|---:|---:|")
io.stdout:flush()

local function row(side, name, layers, ms, peak)
  local flops = train.flops_per_token(model_config(layers, cfg.seq), cfg.seq) * cfg.seq
  if side == "nvlua" and name == "bf16" then base[layers] = ms end
  print(string.format("| %d | %s | %.1f | %.0f | %.1f | %.2f | %s |", layers, side == "torch" and "torch " .. name or
    "nvlua " .. name, ms, cfg.seq / (ms / 1000), flops / (ms / 1000) / 1e12, peak / 2 ^ 30,
    base[layers] and string.format("%.2fx", ms / base[layers]) or "-"))
  io.stdout:flush()
end

-- Run cmd, printing a row for each RESULT line as it comes; the rest of its output goes to stderr when
-- no RESULT came.
local function run(cmd, what)
  local p = assert(io.popen(cmd .. " 2>&1"))
  local rest, found = {}, false
  for line in p:lines() do
    local side, name, layers, ms, peak = line:match("^RESULT (%S+) (%S+) (%d+) (%S+) (%d+)")
    if side then
      row(side, name, math.tointeger(tonumber(layers)), tonumber(ms), tonumber(peak))
      found = true
    else
      rest[#rest + 1] = line
    end
  end
  p:close()
  if not found then io.stderr:write("bench_blocks: " .. what .. " gave no result:\n" .. table.concat(rest, "\n") .. "\n") end
end

for _, L in ipairs(list(cfg.layers)) do
  for _, r in ipairs(list(cfg.recipes)) do
    io.stderr:write(string.format("bench_blocks: nvlua %s, %d block%s ...\n", r, L, L > 1 and "s" or ""))
    run(string.format("%s one=%s:%d seq=%d steps=%d", self_cmd, r, L, cfg.seq, cfg.steps), "nvlua " .. r)
  end
end
if cfg.torch == "true" then
  io.stderr:write("bench_blocks: PyTorch (eager, compile) ...\n")
  local script = arg[0]:gsub("bench_blocks%.lua$", "bench_blocks_torch.py")
  run(string.format("PYTHONUNBUFFERED=1 python3 %q --layers %s --seq %d --steps %d", script, cfg.layers, cfg.seq,
    cfg.steps), "PyTorch")
end
print("\nGoals: nvlua bf16 step <= torch compile's; fp8_cs tokens/s >= 1.25x nvlua bf16; nvfp4 step <= 1.35x nvlua bf16.")
