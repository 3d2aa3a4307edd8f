-- experiments/compare_recipes.lua: the paper's comparison at small scale. The same model, data
-- and seed trained under bf16, fp8 (current scaling), mxfp8, nvfp4 (the paper's recipe), mxfp4
-- (the same recipe in OCP MXFP4), and the nvfp4 ablations — no RHT, no stochastic rounding, no
-- 2D weight blocks, every layer in nvfp4 — and a variant, one weight amax per fused q/k/v and
-- gate/up group (fused_amax), and MoR (recipe.mor: per tensor, per block, and tiered
-- NVFP4 -> FP8 -> BF16, and as published: mor_paper, GAM scaling), with the measured share of GEMM
-- operands it kept in low precision.
-- With seeds=N each recipe trains N times, seeds seed, seed+1, ... (model init, data order and SR
-- draws all follow it, the same seeds for every recipe): the table gives each recipe's mean final
-- validation loss, the seeds' standard deviation, the mean gap to bf16 and that gap's spread over
-- the seeds (each seed's loss minus bf16's on the same seed: the seed's effect cancels), so a
-- recipe effect can be told from noise. Writes the table to <out>/results.md and draws one overlay
-- plot of the validation loss (the seeds' mean per recipe). With eval_tasks=arc_easy,piqa (nvlua.eval;
-- eval_limit questions each, the same questions for every recipe) the table adds each task's final
-- accuracy (mean of the seeds) with its standard error over the questions, and the gap to bf16 with the
-- standard error of a paired difference: per question, the recipe's correctness (mean of its seeds) minus
-- bf16's, whose mean is the gap and whose standard deviation / sqrt(n) its standard error (the questions
-- are shared, so their difficulty cancels). A gap under two standard errors is marked "within noise".
-- A bits-per-byte task (lambada) shows bpb and its gap (standard error sqrt(se^2 + se_bf16^2)).
--   nvlua experiments/compare_recipes.lua [steps=150] [seeds=1] [only=bf16,nvfp4] [key=value ...]
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local plot = require "nvlua.plot"
local data = require "nvlua.data"

local runs = {
  {name = "bf16", recipe = "bf16"},
  {name = "fp8_cs", recipe = "fp8_cs"},
  {name = "mxfp8", recipe = "mxfp8"},
  {name = "nvfp4", recipe = "nvfp4"},
  {name = "mxfp4", recipe = "mxfp4"},
  {name = "nvfp4 no RHT", recipe = "nvfp4", rht = false},
  {name = "nvfp4 no SR", recipe = "nvfp4", sr = false},
  {name = "nvfp4 no 2D", recipe = "nvfp4", w2d = false},
  {name = "nvfp4 all layers", recipe = "nvfp4", bf16_first = 0, bf16_last = 0},
  {name = "nvfp4 fused amax", recipe = "nvfp4", fused_amax = true}, -- one weight amax per q/k/v and gate/up group
  {name = "mor", recipe = "mor"},                -- MoR per tensor: e4m3, else bf16
  {name = "mor block", recipe = "mor_block"},    -- MoR per 1x128 block
  {name = "mor nvfp4", recipe = "mor_nvfp4"},    -- MoR tiered: nvfp4, else e4m3, else bf16, per tensor
  {name = "mor paper", recipe = "mor_paper"},    -- MoR as published: per 1x128 block, e4m3, e5m2, bf16, GAM
}

local c = config.parse(train.schema, arg, {
  out = "runs/compare_recipes", data = "kjv", layers = 4, hidden = 256, heads = 4, kv_heads = 2, ffn = 768,
  seq = 128, batch = 8, steps = 150, lr = 3e-3, min_lr = 3e-4, warmup = 15, schedule = "wsd", decay = 0.25,
  eval_every = 25, eval_batches = 4, log_every = 25, sample_tokens = 0, plot = false, save = false, quiet = true,
  overwrite = true, -- a rerun redoes the sweep's runs
  seeds = config.int(1, {min = 1, doc = "seeds per recipe: seed, seed+1, ... (init, data order, SR)"}),
  only = config.str("", {doc = "comma-separated run names (empty: all)", check = function(v)
    for name in v:gmatch("[^,]+") do
      local known = false
      for _, r in ipairs(runs) do known = known or r.name == name end
      if not known then
        local names = {}
        for i, r in ipairs(runs) do names[i] = r.name end
        return string.format("unknown run '%s' (runs: %s)", name, table.concat(names, ", "))
      end
    end
  end}),
})
print("config (each run):")
config.print(c)
data.mkdir_p(c.out)

local chosen = {}
for _, r in ipairs(runs) do
  if c.only == "" or ("," .. c.only .. ","):find("," .. r.name .. ",", 1, true) then chosen[#chosen + 1] = r end
end

local results, series = {}, {}
local total, done = #chosen * c.seeds, 0
for _, r in ipairs(chosen) do
  local res = {name = r.name, vals = {}, tps = 0, tasks = {}}
  local curves = {} -- step -> list of val losses over the seeds
  for k = 0, c.seeds - 1 do
    local rc = {}
    for key, v in pairs(c) do rc[key] = v end
    rc.only, rc.seeds = nil, nil
    for key, v in pairs(r) do if key ~= "name" then rc[key] = v end end
    rc.seed, rc.data_seed = c.seed + k, c.data_seed + k
    rc.out = c.out .. "/" .. r.name:gsub("[^%w]+", "_") .. (c.seeds > 1 and ("_s" .. rc.seed) or "")
    done = done + 1
    io.write(string.format("[%d/%d] %-18s seed %d  ", done, total, r.name, rc.seed))
    io.flush()
    local t0 = nv.clock()
    local s = train.run(rc, train.build(rc))
    if s.interrupted then os.exit(require("nvlua.signal").EXIT_INTERRUPTED, true) end -- a stop signal ends the sweep
    res.vals[#res.vals + 1] = s.final_val_loss or 0 / 0
    res.tps = res.tps + s.tokens_per_s / c.seeds
    for name, t in pairs(s.tasks or {}) do -- downstream: sums over the seeds (divided by their count below)
      local m = res.tasks[name] or {seeds = 0, acc = 0, se = 0, bpb = 0, bpb_se = 0, correct = {}}
      m.seeds, m.bpb_task = m.seeds + 1, (t.variant or ""):find("^bpb") ~= nil
      m.acc, m.se = m.acc + (t.acc or 0 / 0), m.se + (t.acc_stderr or 0 / 0)
      m.bpb, m.bpb_se = m.bpb + (t.bpb or 0 / 0), m.bpb_se + (t.bpb_stderr or 0 / 0)
      for q, v in ipairs(t.correct or {}) do m.correct[q] = (m.correct[q] or 0) + v end
      res.tasks[name] = m
    end
    if s.mor_low then -- MoR: the shares of low-precision elements and units (tensors or blocks), mean of seeds
      res.low = (res.low or 0) + s.mor_low / c.seeds
      res.units_low = (res.units_low or 0) + s.mor_units_low / c.seeds
      res.formats = res.formats or {}
      for f, v in pairs(s.mor_formats) do res.formats[f] = (res.formats[f] or 0) + v / c.seeds end
      res.tensors_low = (res.tensors_low or 0) + (s.mor_tensors_low or 0) / c.seeds
      res.tensors = res.tensors or {}
      for k, v in pairs(s.mor_tensors or {}) do res.tensors[k] = (res.tensors[k] or 0) + v / c.seeds end
    end
    print(string.format("val loss %.4f  %6.0f tok/s  %5.0f s", s.final_val_loss or 0 / 0, s.tokens_per_s, nv.clock() - t0))
    for _, p in ipairs(s.val) do
      curves[p[1]] = curves[p[1]] or {}
      table.insert(curves[p[1]], p[2])
    end
  end
  local vx, vy = {}, {}
  for step in pairs(curves) do vx[#vx + 1] = step end
  table.sort(vx)
  for i, step in ipairs(vx) do
    local m = 0
    for _, v in ipairs(curves[step]) do m = m + v / #curves[step] end
    vy[i] = m
  end
  series[#series + 1] = {title = r.name .. (c.seeds > 1 and " (val, mean of seeds)" or " (val)"), x = vx, y = vy}
  results[#results + 1] = res
end

local stats = require("nvlua.util").mean_sd -- mean and sample standard deviation

-- MoR runs: the share of tensors (or blocks) they kept in a low-precision format, and each format's
-- share of the GEMM-operand elements, averaged over the steps; the paper reports 98.38% of tensors
-- in FP8
local function low(r)
  if not r.low then return "-" end
  local fs, parts = {}, {}
  for f in pairs(r.formats) do fs[#fs + 1] = f end
  table.sort(fs)
  for _, f in ipairs(fs) do parts[#parts + 1] = string.format("%s %.2f%%", f, 100 * r.formats[f]) end
  local per_block = r.name:find("block") or r.name:find("paper")
  local line = string.format("%.2f%% of %s (elements: %s)", 100 * r.units_low, per_block and "blocks" or "tensors",
    table.concat(parts, ", "))
  -- per block: the operand tensors wholly in low precision, by kind (all-e4m3 GAM operands are MXFP8 ones)
  if r.tensors_low and per_block then
    line = line .. "; " .. require("nvlua.mor").format_tensor_shares(r.tensors_low, r.tensors)
  end
  return line
end

local base
for _, r in ipairs(results) do if r.name == "bf16" then base = r end end
local lines = {
  string.format("steps %d, batch %d x seq %d, %d layers, hidden %d, data %s, %s", c.steps, c.batch, c.seq, c.layers,
    c.hidden, c.data, c.seeds > 1 and string.format("seeds %d..%d (init, data order, SR)", c.seed, c.seed + c.seeds - 1)
      or string.format("seed %d", c.seed)),
  "",
}
if c.seeds > 1 then
  lines[#lines + 1] = "| recipe | final val loss, mean | std over seeds | gap to bf16, mean | gap std (paired) | tokens/s | MoR low precision |"
  lines[#lines + 1] = "|---|---:|---:|---:|---:|---:|---|"
else
  lines[#lines + 1] = "| recipe | final val loss | gap to bf16 | tokens/s | MoR low precision |"
  lines[#lines + 1] = "|---|---:|---:|---:|---|"
end
-- downstream (eval_tasks): a column per task, "acc ± se" (a bpb task: "bpb ± se"), and the gap to bf16 with
-- its standard error (the header); |gap| < 2 se is "within noise"
local task_names = require("nvlua.eval").split_names(c.eval_tasks)
local function task_mean(t) -- the seeds' means of a recipe's task sums
  local k = math.max(t.seeds, 1)
  local corr = {}
  for q, v in ipairs(t.correct) do corr[q] = v / k end
  return {acc = t.acc / k, se = t.se / k, bpb = t.bpb / k, bpb_se = t.bpb_se / k, correct = corr, bpb_task = t.bpb_task}
end
local function task_cells(r)
  local cells = {}
  for _, name in ipairs(task_names) do
    local t, b = r.tasks[name] and task_mean(r.tasks[name]), base and base.tasks[name] and task_mean(base.tasks[name])
    local cell = "-"
    if t then
      local v, se = t.acc, t.se
      if t.bpb_task then v, se = t.bpb, t.bpb_se end
      cell = string.format("%.3f ± %.3f", v, se)
      if b and r ~= base then
        local gap, gse
        if t.bpb_task then
          gap, gse = t.bpb - b.bpb, math.sqrt(t.bpb_se ^ 2 + b.bpb_se ^ 2)
        elseif #t.correct > 1 and #t.correct == #b.correct then -- paired over the same questions
          local d = {}
          for q = 1, #t.correct do d[q] = t.correct[q] - b.correct[q] end
          local m, sd = stats(d)
          gap, gse = m, sd / math.sqrt(#d)
        else
          gap, gse = t.acc - b.acc, math.sqrt(t.se ^ 2 + b.se ^ 2)
        end
        cell = cell .. string.format(" (%+.3f ± %.3f%s)", gap, gse, math.abs(gap) < 2 * gse and ", within noise" or "")
      end
    end
    cells[#cells + 1] = cell
  end
  return #cells > 0 and (" " .. table.concat(cells, " | ") .. " |") or ""
end
if #task_names > 0 then
  local h, sep = {}, {}
  for i, name in ipairs(task_names) do h[i], sep[i] = name .. " (gap to bf16)", "---:" end
  lines[#lines - 1] = lines[#lines - 1] .. " " .. table.concat(h, " | ") .. " |"
  lines[#lines] = lines[#lines] .. table.concat(sep, "|") .. "|"
  lines[1] = lines[1] .. string.format(", downstream: %s questions per task (acc; lambada-style: bits per byte)",
    c.eval_limit > 0 and tostring(c.eval_limit) or "all")
end
for _, r in ipairs(results) do
  local m, sd = stats(r.vals)
  if c.seeds > 1 then
    local gm, gsd = "-", "-"
    if base then
      local gaps = {}
      for k, v in ipairs(r.vals) do gaps[k] = 100 * (v - base.vals[k]) / base.vals[k] end
      local a, b = stats(gaps)
      gm, gsd = string.format("%+.2f%%", a), string.format("%.2f%%", b)
    end
    lines[#lines + 1] = string.format("| %s | %.4f | %.4f | %s | %s | %.0f | %s |", r.name, m, sd, gm, gsd, r.tps, low(r)) ..
      task_cells(r)
  else
    local bm = base and stats(base.vals)
    lines[#lines + 1] = string.format("| %s | %.4f | %s | %.0f | %s |", r.name, m,
      bm and string.format("%+.2f%%", 100 * (m - bm) / bm) or "-", r.tps, low(r)) .. task_cells(r)
  end
end
plot.results(c.out, lines, "compare.png", series, {title = "validation loss by recipe", ylabel = "val loss"})
