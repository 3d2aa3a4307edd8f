-- scripts/bench_ckpt.lua: what periodic checkpoints cost the main job (experiments/tiny_llama_nvfp4.lua's
-- model and recipe), blocking and in the background (ckpt_background=true: the step copies the state
-- into a host staging buffer, a writer thread writes, syncs and commits it; with ckpt_overlap=true the
-- writer thread makes that copy itself during the next step's forward and backward). Issue 20's
-- goal: background under 1% of step time where blocking is over 5%.
--   nvlua scripts/bench_ckpt.lua [steps=60] [every=5,20] [repeat=3] [out=runs/bench_ckpt]
--
-- Two measures of the overhead, per checkpoint interval N:
--   within a run (the one the table's verdict uses): per save, the seconds the training loop stood in
--     ckpt.save (timed around it) plus the steps it slowed: the step after it, and in the background
--     every later step that started with the writer still busy, each counted by how much longer it
--     took than the run's median step outside such stretches, less what the same steps took over the
--     median in the run without checkpoints (the control: steps that are slower anyway, and the
--     skew of step times above their median); overhead = that per-save cost / (N x the median
--     step). The steps of one run are compared with each other, so the machine's drift between runs
--     cancels.
--   across runs: the wall time of the same steps with saves against a run without checkpoints, minus
--     one (medians over `repeat` runs, back to back). On this shared 2-core VM two identical runs
--     differ by up to 5-10%, so this column bounds nothing at the 1% level; it is printed as a check
--     that the within-run figure misses nothing large.
-- The first SKIP steps (allocation, warm-up) are left out of the medians.
local nv = require "nvlua"
local core = require "nvlua.core"
local train = require "nvlua.train"
local config = require "nvlua.config"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"

local o = config.schema({
  steps = config.int(60, {min = 1, doc = "training steps of every run"}),
  every = config.str("5,20", {nonempty = true, doc = "the checkpoint intervals compared (steps, comma-separated)"}),
  ["repeat"] = config.int(3, {min = 1, doc = "runs of each setting (the across-runs medians)"}),
  out = config.str("runs/bench_ckpt", {nonempty = true}),
}):parse(arg)
local everys = {}
for e in o.every:gmatch("[^,]+") do
  local n = math.tointeger(tonumber(e))
  if not n or n < 1 then error("bench_ckpt: every must list integers >= 1, got " .. o.every, 0) end
  everys[#everys + 1] = n
end
local SKIP = 3

local function median(l)
  local s = {table.unpack(l)}
  table.sort(s)
  local n = #s
  if n == 0 then return 0 / 0 end
  return n % 2 == 1 and s[(n + 1) // 2] or (s[n // 2] + s[n // 2 + 1]) / 2
end

-- the instrumented entry points: seconds in ckpt.save per call, and whether the writer was busy when
-- each step started (train.run calls ckpt.poll first thing in a step of a background run)
local saves, busy_at
local save0, poll0 = ckpt.save, ckpt.poll
ckpt.save = function(...)
  local t0 = nv.clock()
  local res = save0(...)
  saves[#saves + 1] = nv.clock() - t0
  return res
end
ckpt.poll = function()
  busy_at[#busy_at + 1] = core.bg_busy()
  return poll0()
end

-- one run; -> {wall, step (median step seconds), save (seconds in ckpt.save per save), extra (the
-- slowed steps' seconds over the median, all saves), saves, ms (per step), slowed (the set of steps)}
-- mode: nil (blocking saves), "bg" (ckpt_background) or "overlap" (and ckpt_overlap)
local function run(every, k, mode)
  saves, busy_at = {}, {}
  local c = config.parse(train.schema, {}, {
    out = string.format("%s/e%d_%d%s", o.out, every, k, mode or ""), data = "kjv", recipe = "nvfp4",
    layers = 6, hidden = 384, heads = 6, kv_heads = 2, ffn = 1024, seq = 128, batch = 8, steps = o.steps, lr = 3e-3,
    warmup = 10, eval_every = 0, sample_tokens = 0, plot = false, save = false, quiet = true, overwrite = true,
    ckpt_every = every, keep = 2, ckpt_background = mode ~= nil, ckpt_overlap = mode == "overlap"})
  local p = train.build(c)
  local t0 = nv.clock()
  train.run(c, p)
  local wall = nv.clock() - t0
  local ms = {}
  for line in io.lines(c.out .. "/metrics.jsonl") do
    local rec = cjson.decode(line)
    if rec.ms then ms[rec.step] = rec.ms / 1000 end
  end
  -- steps slowed by the save: after a save at step s, s+1 (in both modes: a blocking save leaves
  -- cold caches too) and every later step that started with the writer still busy (busy_at[j]: the
  -- start of step j; empty for blocking saves)
  local slowed, calm = {}, {}
  if every > 0 then
    for s = every, o.steps - 1, every do
      local j = s + 1
      slowed[j] = true
      while busy_at[j + 1] and j + 1 <= o.steps do j = j + 1; slowed[j] = true end
    end
  end
  for j = SKIP + 1, o.steps do if not slowed[j] and ms[j] then calm[#calm + 1] = ms[j] end end
  local step = median(calm)
  local extra = 0
  for j in pairs(slowed) do if ms[j] then extra = extra + (ms[j] - step) end end
  local n = #saves
  local save = 0
  for _, s in ipairs(saves) do save = save + s end
  return {wall = wall, step = step, save = n > 0 and save / n or 0, extra = extra, saves = n, ms = ms, slowed = slowed}
end

-- the same steps' excess over the median in the run without checkpoints (the control): what those
-- steps take longer anyway (the data, the allocator, the collector, a median below the mean)
local function control(none, slowed)
  local extra = 0
  for j in pairs(slowed) do if none.ms[j] then extra = extra + (none.ms[j] - none.step) end end
  return extra
end

print(string.format("bench_ckpt: %d steps of the main job (nvfp4, 9.6M parameters; a checkpoint holds 115 MB), " ..
  "%d repeats, %s", o.steps, o["repeat"], os.date("!%Y-%m-%d")))
print("| every | saves | step | mode | in ckpt.save | slowed steps | per save | overhead | wall vs none |")
print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
local MODES = {{nil, "blocking"}, {"bg", "background"}, {"overlap", "background, ckpt_overlap"}}
for _, every in ipairs(everys) do
  local acc = {}
  for i = 1, #MODES do acc[i] = {step = {}, save = {}, slowed = {}, per = {}, ovh = {}, wall = {}} end
  local saves_n
  for k = 1, o["repeat"] do
    local none = run(0, k)
    for i, m in ipairs(MODES) do
      local r = run(every, k, m[1])
      saves_n = r.saves
      local slowed = (r.extra - control(none, r.slowed)) / r.saves
      local per_save = r.save + slowed
      local a = acc[i]
      a.step[k], a.save[k], a.slowed[k], a.per[k] = r.step, r.save, slowed, per_save
      a.ovh[k], a.wall[k] = per_save / (every * r.step), r.wall / none.wall - 1
    end
  end
  for i, m in ipairs(MODES) do
    local a = acc[i]
    print(string.format("| %d steps | %d | %.3f s | %s | %.3f s | %.3f s | %.3f s | %.2f%% | %+.1f%% |", every, saves_n,
      median(a.step), m[2], median(a.save), median(a.slowed), median(a.per), 100 * median(a.ovh), 100 * median(a.wall)))
  end
  io.stdout:flush()
end
