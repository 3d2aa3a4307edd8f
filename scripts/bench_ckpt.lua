-- scripts/bench_ckpt.lua: what blocking checkpoints cost the main job (experiments/tiny_llama_nvfp4.lua's
-- model and recipe): the same `steps` trained with no periodic checkpoint and with one every N steps,
-- `repeat` times each, interleaved; the overhead is the median over the repeats of each pair's ratio
-- of wall times minus one (pairs run back to back, so the machine's drift cancels), and the blocking
-- time of one save is that overhead times the no-checkpoint wall time over the number of saves. The baseline for background checkpoints (issue 20), which should take the
-- overhead under 1% where blocking is over 5%.
--   nvlua scripts/bench_ckpt.lua [steps=60] [every=5,20] [repeat=3] [out=runs/bench_ckpt]
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"

local o = {steps = 60, every = "5,20", ["repeat"] = 3, out = "runs/bench_ckpt"}
for _, a in ipairs(arg or {}) do
  local k, v = a:match("^([%w_]+)=(.*)$")
  if not k or o[k] == nil then error("bench_ckpt: arguments are key=value with keys steps, every, repeat, out", 0) end
  o[k] = (k == "every" or k == "out") and v or math.tointeger(tonumber(v))
  if o[k] == nil then error("bench_ckpt: " .. k .. " must be an integer, got " .. v, 0) end
end
local everys = {}
for e in o.every:gmatch("[^,]+") do everys[#everys + 1] = math.tointeger(tonumber(e)) end

-- one run; -> wall seconds, the mean seconds of its periodic saves (from the wall-clock around each)
local function run(every, k)
  local c = config.parse(train.schema, {}, {
    out = string.format("%s/e%d_%d", o.out, every, k), data = "kjv", recipe = "nvfp4", layers = 6, hidden = 384,
    heads = 6, kv_heads = 2, ffn = 1024, seq = 128, batch = 8, steps = o.steps, lr = 3e-3, warmup = 10,
    eval_every = 0, sample_tokens = 0, plot = false, save = false, quiet = true, overwrite = true,
    ckpt_every = every, keep = 2})
  local p = train.build(c)
  local t0 = nv.clock()
  local s = train.run(c, p)
  local wall = nv.clock() - t0
  return wall, s.tokens_per_s
end

local function median(l)
  table.sort(l)
  local n = #l
  return n % 2 == 1 and l[(n + 1) // 2] or (l[n // 2] + l[n // 2 + 1]) / 2
end

print(string.format("bench_ckpt: %d steps of the main job (nvfp4, 9.6M parameters), %d repeats, %s", o.steps, o["repeat"],
  os.date("!%Y-%m-%d")))
print("| checkpoint every | wall, none | wall, with saves | saves | blocking per save | overhead (median ratio - 1) |")
print("|---:|---:|---:|---:|---:|---:|")
for _, every in ipairs(everys) do
  local ratios, w0s, w1s = {}, {}, {}
  for k = 1, o["repeat"] do
    local w0 = run(0, k)
    local w1 = run(every, k)
    ratios[#ratios + 1], w0s[#w0s + 1], w1s[#w1s + 1] = w1 / w0, w0, w1
  end
  local saves = (o.steps - 1) // every
  local m0, m1, over = median(w0s), median(w1s), median(ratios) - 1
  print(string.format("| %d steps | %.2f s | %.2f s | %d | %.3f s | %.1f%% |", every, m0, m1, saves,
    over * m0 / math.max(saves, 1), 100 * over))
end
