-- scripts/bench_ckpt.lua: what periodic checkpoints cost the main job (experiments/tiny_llama_nvfp4.lua's
-- model and recipe): the same `steps` trained with no periodic checkpoint, with a blocking one every N
-- steps and with a background one (ckpt_background=true: the step writes the files unsynced, a writer
-- thread makes them durable and commits), `repeat` times each, back to back (the machine's drift
-- cancels); the overhead is the median over the repeats of the wall-time ratio to the run without
-- checkpoints, minus one, and the cost of one save is that overhead times the no-checkpoint wall time
-- over the number of saves. Issue 20's goal: background under 1% where blocking is over 5%.
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
local function run(every, k, background)
  local c = config.parse(train.schema, {}, {
    out = string.format("%s/e%d_%d%s", o.out, every, k, background and "bg" or ""), data = "kjv", recipe = "nvfp4", layers = 6, hidden = 384,
    heads = 6, kv_heads = 2, ffn = 1024, seq = 128, batch = 8, steps = o.steps, lr = 3e-3, warmup = 10,
    eval_every = 0, sample_tokens = 0, plot = false, save = false, quiet = true, overwrite = true,
    ckpt_every = every, keep = 2, ckpt_background = background or false})
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
print("| checkpoint every | saves | wall, none | blocking saves: wall | per save | overhead | background saves: wall | per save | overhead |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for _, every in ipairs(everys) do
  local w0s, w1s, w2s, r1, r2 = {}, {}, {}, {}, {}
  for k = 1, o["repeat"] do
    local w0, w1, w2 = run(0, k), run(every, k), run(every, k, true)
    w0s[#w0s + 1], w1s[#w1s + 1], w2s[#w2s + 1], r1[#r1 + 1], r2[#r2 + 1] = w0, w1, w2, w1 / w0, w2 / w0
  end
  local saves = (o.steps - 1) // every
  local m0, o1, o2 = median(w0s), median(r1) - 1, median(r2) - 1
  print(string.format("| %d steps | %d | %.2f s | %.2f s | %.3f s | %.1f%% | %.2f s | %.3f s | %.1f%% |", every, saves, m0,
    median(w1s), o1 * m0 / math.max(saves, 1), 100 * o1, median(w2s), o2 * m0 / math.max(saves, 1), 100 * o2))
end
