-- experiments/prune_distill.lua: Minitron at small scale (Muralidharan et al. 2024; Sreenivas et al.
-- 2024): train a teacher, prune it to about half its parameters by activation importance — in width
-- (FFN neurons, query heads) and in depth (the blocks with the least influence) — then compare at
-- equal training tokens:
--   (a) the pruned model without retraining,
--   (b) pruned, then trained on the cross-entropy,
--   (c) pruned, then distilled from the teacher (alpha * T^2 * KL + (1 - alpha) * CE),
--   (d) the same small architecture trained from scratch;
-- the students under `recipe` (nvfp4 by default: an NVFP4 student of a bf16 teacher), seeds seed,
-- seed+1, ... (data order, SR, and (d)'s initialisation). Minitron's finding to check: (c) beats (d).
-- (b) and (c) start from the pruned model saved as a Hugging Face directory (init=hf:<dir>); init= on
-- the command line starts the teacher from pretrained weights (its shape then the checkpoint's).
-- Prints a table (final validation loss, mean and spread over seeds), writes <out>/results.md and a
-- plot of the mean validation curves.
--   nvlua experiments/prune_distill.lua [teacher_steps=400] [steps=150] [seeds=3] [key=value ...]
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local plot = require "nvlua.plot"
local data = require "nvlua.data"
local prune = require "nvlua.prune"
local mean_sd = require("nvlua.util").mean_sd
local hf = require "nvlua.hf"

local c = config.parse(train.schema, arg, {
  out = "runs/prune_distill", data = "kjv", layers = 4, hidden = 256, heads = 4, kv_heads = 2, ffn = 768,
  seq = 128, batch = 8, steps = 150, lr = 3e-3, min_lr = 3e-4, warmup = 15, schedule = "wsd", decay = 0.25,
  eval_every = 25, eval_batches = 4, log_every = 50, sample_tokens = 0, plot = false, save = false, quiet = true,
  overwrite = true, distill_alpha = 0.5, distill_temperature = 1.0,
  teacher_steps = config.int(400, {min = 1, doc = "the teacher's training steps (bf16, teacher_recipe)"}),
  seeds = config.int(3, {min = 1, doc = "seeds per student: seed, seed+1, ..."}),
  prune_ffn = config.int(320, {min = 1, doc = "width pruning: FFN neurons kept per block"}),
  prune_heads = config.int(2, {min = 1, doc = "width pruning: query heads kept (one per KV group)"}),
  prune_layers = config.int(2, {min = 1, doc = "depth pruning: blocks kept"}),
})
print("config:")
config.print(c)
data.mkdir_p(c.out)

local function copy(t, over)
  local r = {}
  for k, v in pairs(t) do r[k] = v end
  r.teacher_steps, r.seeds, r.prune_ffn, r.prune_heads, r.prune_layers = nil, nil, nil, nil, nil
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

-- 1. the teacher, saved as a Hugging Face checkpoint
local tc = copy(c, {recipe = c.teacher_recipe, steps = c.teacher_steps, out = c.out .. "/teacher", save = true,
  teacher = ""})
io.write(string.format("teacher: %d steps under %s ... ", tc.steps, tc.recipe))
io.flush()
local tp = train.build(tc)
local ts = train.run(tc, tp)
if ts.interrupted then os.exit(require("nvlua.signal").EXIT_INTERRUPTED, true) end -- a stop signal ends the sweep
local teacher = tp.model
local teacher_dir = ts.checkpoint .. "/model"
print(string.format("val loss %.4f, %.2fM parameters", ts.final_val_loss, teacher:num_parameters() / 1e6))

-- 2. importance on a calibration batch from the training split, then the two pruned models, saved as
-- Hugging Face directories the students start from (init=hf:<dir>)
local calib = data.Loader(tp.dataset.train, {batch = c.batch, seq = c.seq, seed = 9999}):next()
local imp = prune.importance(teacher, calib)
local archs = {
  {name = "width", model = prune.width(teacher, imp, {ffn = c.prune_ffn, heads = c.prune_heads})},
  {name = "depth", model = (prune.depth(teacher, imp, {layers = c.prune_layers}))},
}
for _, arch in ipairs(archs) do
  arch.dir = c.out .. "/pruned_" .. arch.name
  data.mkdir_p(arch.dir)
  hf.save_pretrained(arch.model, arch.dir)
end

-- the train keys of a model's architecture
local function arch_keys(m)
  local k = m.config
  return {layers = k.num_hidden_layers, hidden = k.hidden_size, heads = k.num_attention_heads,
    kv_heads = k.num_key_value_heads, ffn = k.intermediate_size, head_dim = k.head_dim}
end

-- 3. the students
local rows, series = {}, {}
local function student(arch, variant, seed)
  local rc = copy(c, arch_keys(arch.model))
  rc.seed, rc.data_seed = c.seed + seed, c.data_seed + seed
  rc.out = string.format("%s/%s_%s_s%d", c.out, arch.name, variant, rc.seed)
  rc.teacher = variant == "distilled" and teacher_dir or ""
  rc.init = variant ~= "scratch" and "hf:" .. arch.dir or "" -- the pruned weights, or a random start
  return train.run(rc, train.build(rc))
end

for _, arch in ipairs(archs) do
  arch.model:set_recipe(nv.recipe.make(c.recipe))
  local vl = train.evaluate(arch.model, tp.dataset, c)
  rows[#rows + 1] = {arch = arch.name, variant = "(a) pruned, no training", vals = {vl},
    params = arch.model:num_parameters()}
  print(string.format("%s: %.2fM parameters; without training val loss %.4f", arch.name,
    arch.model:num_parameters() / 1e6, vl))
  for _, v in ipairs({{"ce", "(b) pruned + cross-entropy"}, {"distilled", "(c) pruned + distillation"},
                      {"scratch", "(d) from scratch"}}) do
    local r = {arch = arch.name, variant = v[2], vals = {}, params = arch.model:num_parameters()}
    local curves = {}
    for k = 0, c.seeds - 1 do
      io.write(string.format("  %s %-28s seed %d  ", arch.name, v[2], c.seed + k))
      io.flush()
      local t0 = nv.clock()
      local s = student(arch, v[1], k)
      if s.interrupted then os.exit(require("nvlua.signal").EXIT_INTERRUPTED, true) end -- a stop signal ends the sweep
      r.vals[#r.vals + 1] = s.final_val_loss
      print(string.format("val loss %.4f  %4.0f s", s.final_val_loss, nv.clock() - t0))
      for _, pt in ipairs(s.val) do
        curves[pt[1]] = curves[pt[1]] or {}
        table.insert(curves[pt[1]], pt[2])
      end
    end
    rows[#rows + 1] = r
    local xs, ys = {}, {}
    for step in pairs(curves) do xs[#xs + 1] = step end
    table.sort(xs)
    for i, step in ipairs(xs) do ys[i] = (mean_sd(curves[step])) end
    series[#series + 1] = {title = arch.name .. " " .. v[2], x = xs, y = ys}
  end
end

-- 4. the table
local lines = {
  string.format("teacher: %d blocks, hidden %d, %d/%d heads, ffn %d, %.2fM parameters, %d steps under %s: val loss %.4f",
    c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, teacher:num_parameters() / 1e6, c.teacher_steps, c.teacher_recipe,
    ts.final_val_loss),
  string.format("students: %d steps of %d x %d tokens under %s, seeds %d..%d; distillation alpha %g, T %g",
    c.steps, c.batch, c.seq, c.recipe, c.seed, c.seed + c.seeds - 1, c.distill_alpha, c.distill_temperature),
  "",
  "| pruned in | student | parameters | final val loss, mean | std over seeds |",
  "|---|---|---:|---:|---:|",
}
for _, r in ipairs(rows) do
  local m, sd = mean_sd(r.vals)
  lines[#lines + 1] = string.format("| %s | %s | %.2fM | %.4f | %s |", r.arch, r.variant, r.params / 1e6, m,
    #r.vals > 1 and string.format("%.4f", sd) or "-")
end
plot.results(c.out, lines, "prune_distill.png", series, {title = "students: validation loss (mean of the seeds)",
  ylabel = "val loss"})
