-- experiments/fp4_tokens.lua: the paper's NVFP4-vs-MXFP4 comparison at small scale — how many more
-- training tokens the same recipe needs in MXFP4 (e2m1 in 1x32 blocks, e8m0 scales) to reach the
-- validation loss NVFP4 (e2m1 in 1x16 blocks, e4m3 scales, fp32 tensor scale) reaches. The paper
-- (arXiv 2509.25149, multi-billion-parameter runs) reports about 36% more.
--
-- For each seed (model init, data order and SR draws all follow it): NVFP4 trains `steps` steps;
-- MXFP4 trains steps x m for each multiplier m (each with its own full LR schedule, as a longer run
-- would). The token multiplier MXFP4 needs is where its mean final validation loss, interpolated
-- linearly between multipliers, meets NVFP4's mean; the seeds give the noise (the standard deviation
-- of each mean, and the multiplier's range when the NVFP4 loss moves by one standard error).
-- Prints a table, writes <out>/results.md and a plot of the mean validation curves.
--   nvlua experiments/fp4_tokens.lua [steps=300] [seeds=3] [mults=1,1.25,1.5,1.75] [key=value ...]
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local plot = require "nvlua.plot"
local data = require "nvlua.data"

-- mults=1,1.25,...: numbers >= 1 -> the sorted list, or nil and what is wrong
local function parse_mults(text)
  local out = {}
  for m in text:gmatch("[^,]+") do
    local v = tonumber(m)
    if not v or v ~= v or v < 1 or v > 100 then return nil, "'" .. m .. "' is not a number in [1, 100]" end
    out[#out + 1] = v
  end
  if #out == 0 then return nil, "give at least one multiplier" end
  table.sort(out)
  return out
end

local c = train.schema:extend({
  out = "runs/fp4_tokens", data = "kjv", layers = 4, hidden = 256, heads = 4, kv_heads = 2, ffn = 768,
  seq = 128, batch = 8, steps = 300, lr = 3e-3, min_lr = 3e-4, warmup = 15, schedule = "wsd", decay = 0.25,
  eval_every = 25, eval_batches = 8, log_every = 50, sample_tokens = 0, plot = false, save = false, quiet = true,
  overwrite = true, -- a rerun redoes the sweep's runs
  seeds = config.int(3, {min = 1, doc = "seeds per run (1, 2, ...)"}),
  mults = config.str("1,1.25,1.5,1.75", {doc = "MXFP4's token multipliers", check = function(v)
    local _, err = parse_mults(v)
    return err and err .. " (mults: comma-separated token multipliers)"
  end}),
}, {function(cc) if cc.eval_every == 0 then return "eval_every must be > 0: the comparison is of validation losses" end end})
  :parse(arg)
print("config (each run):")
config.print(c)
data.mkdir_p(c.out)

local mults = parse_mults(c.mults)

local mean_sd = require("nvlua.util").mean_sd

-- One run; returns its final validation loss and its validation curve (tokens, loss).
local runs = {}
local function run(recipe_name, steps, seed, label)
  local rc = {}
  for k, v in pairs(c) do rc[k] = v end
  rc.seeds, rc.mults = nil, nil
  rc.recipe, rc.steps, rc.seed, rc.data_seed = recipe_name, steps, seed, seed
  rc.out = string.format("%s/%s_s%d", c.out, label:gsub("[^%w]+", "_"), seed)
  io.write(string.format("  %-14s seed %d, %5d steps ... ", label, seed, steps))
  io.flush()
  local t0 = nv.clock()
  local s = train.run(rc, train.build(rc))
  if s.interrupted then os.exit(require("nvlua.signal").EXIT_INTERRUPTED, true) end -- a stop signal ends the sweep
  print(string.format("val loss %.4f  (%.0f s)", s.final_val_loss, nv.clock() - t0))
  runs[#runs + 1] = {label = label, seed = seed, val = s.val}
  return s.final_val_loss
end

local tokens_per_step = c.batch * c.seq
local nv_losses, mx = {}, {}
for seed = 1, c.seeds do
  print(string.format("seed %d", seed))
  nv_losses[#nv_losses + 1] = run("nvfp4", c.steps, seed, "nvfp4")
  for i, m in ipairs(mults) do
    mx[i] = mx[i] or {}
    mx[i][#mx[i] + 1] = run("mxfp4", math.floor(c.steps * m + 0.5), seed, string.format("mxfp4 x%.2f", m))
  end
end

local nv_mean, nv_sd = mean_sd(nv_losses)
local mx_mean = {}
local lines = {
  string.format("nvfp4 vs mxfp4: %d layers, hidden %d, batch %d x seq %d, %d seeds, data %s; nvfp4 trains %d steps " ..
    "(%d tokens)", c.layers, c.hidden, c.batch, c.seq, c.seeds, c.data, c.steps, c.steps * tokens_per_step),
  "",
  "| recipe | tokens (x nvfp4's) | final val loss, mean +- sd over seeds | per seed |",
  "|---|---:|---:|---|",
}
local function per_seed(xs)
  local t = {}
  for _, x in ipairs(xs) do t[#t + 1] = string.format("%.4f", x) end
  return table.concat(t, " ")
end
lines[#lines + 1] = string.format("| nvfp4 | 1.00 | %.4f +- %.4f | %s |", nv_mean, nv_sd, per_seed(nv_losses))
for i, m in ipairs(mults) do
  local mm, sd = mean_sd(mx[i])
  mx_mean[i] = mm
  lines[#lines + 1] = string.format("| mxfp4 | %.2f | %.4f +- %.4f | %s |", m, mm, sd, per_seed(mx[i]))
end

-- The multiplier at which the mean mxfp4 loss meets a target (linear between measured points).
local function crossing(target)
  if mx_mean[1] <= target then return mults[1], "at or below" end
  for i = 2, #mults do
    if mx_mean[i] <= target then
      local f = (mx_mean[i - 1] - target) / (mx_mean[i - 1] - mx_mean[i])
      return mults[i - 1] + f * (mults[i] - mults[i - 1]), "between"
    end
  end
  return nil, "beyond"
end
local se = nv_sd / math.sqrt(#nv_losses)
local m0, how = crossing(nv_mean)
local mlo, mhi = crossing(nv_mean + se), crossing(nv_mean - se)
lines[#lines + 1] = ""
if m0 and how == "between" then
  lines[#lines + 1] = string.format("mxfp4 reaches nvfp4's mean final loss with %.2fx the tokens (%+.0f%%); with nvfp4's " ..
    "mean moved by one standard error (%.4f): %s to %s", m0, 100 * (m0 - 1),
    se, mlo and string.format("%.2fx", mlo) or "?", mhi and string.format("%.2fx", mhi) or string.format("> %.2fx", mults[#mults]))
elseif how == "at or below" then
  lines[#lines + 1] = "mxfp4 reaches nvfp4's mean final loss with the same tokens (no token gap at this scale)"
else
  lines[#lines + 1] = string.format("mxfp4 does not reach nvfp4's mean final loss within %.2fx the tokens", mults[#mults])
end

-- mean validation curves (x: tokens) per configuration
local series, by = {}, {}
for _, r in ipairs(runs) do
  by[r.label] = by[r.label] or {}
  for _, p in ipairs(r.val) do
    local key = p[1]
    by[r.label][key] = by[r.label][key] or {}
    table.insert(by[r.label][key], p[2])
  end
end
local labels = {"nvfp4"}
for _, m in ipairs(mults) do labels[#labels + 1] = string.format("mxfp4 x%.2f", m) end
for _, label in ipairs(labels) do
  local steps = {}
  for s in pairs(by[label] or {}) do steps[#steps + 1] = s end
  table.sort(steps)
  local xs, ys = {}, {}
  for _, s in ipairs(steps) do
    xs[#xs + 1] = s * tokens_per_step
    ys[#ys + 1] = (mean_sd(by[label][s]))
  end
  series[#series + 1] = {title = label .. " (mean val)", x = xs, y = ys}
end
plot.results(c.out, lines, "fp4_tokens.png", series, {title = "validation loss, mean over seeds", xlabel = "tokens",
  ylabel = "val loss"})
