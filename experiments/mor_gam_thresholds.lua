-- experiments/mor_gam_thresholds.lua: the errors behind the GAM thresholds (NUMERICS §12, GAM). As
-- §12 measured e4m3's defaults: experiments/compare_recipes.lua's model and data, a 40-step bf16 run,
-- the relative L2 error of every 1x128 block of every GEMM operand (fprop x, w; dgrad dy, w; wgrad dy,
-- x) under each candidate, here e4m3 and e5m2 with GAM scaling (group: the whole operand). The run is
-- recipe.mor with a decide that records the errors and chooses bf16 for every block, so it trains as
-- bf16 does (bf16 blocks are x rounded to bf16; the GEMM is f32 on those values). Prints the median,
-- 90th, 99th percentile and max per candidate and per operand kind.
--   nvlua experiments/mor_gam_thresholds.lua [steps=40] [key=value ...]
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local recipe = require "nvlua.recipe"

local c = config.parse(train.schema, arg, {
  out = "runs/mor_gam_thresholds", data = "kjv", layers = 4, hidden = 256, heads = 4, kv_heads = 2, ffn = 768,
  seq = 128, batch = 8, steps = 40, lr = 3e-3, min_lr = 3e-4, warmup = 15, schedule = "wsd", decay = 0.25,
  eval_every = 0, log_every = 10, sample_tokens = 0, plot = false, save = false, quiet = true, overwrite = true,
})

local cands = {"e4m3", "e5m2"}
local errs = {} -- [format][operand] = list of block errors
for _, f in ipairs(cands) do errs[f] = {x = {}, w = {}, dy = {}, all = {}} end
local function record(d)
  for i, f in ipairs(cands) do
    local op = d.ctx.operand
    for _, row in ipairs(d.errs[i]:totable()) do
      for _, e in ipairs(row) do
        table.insert(errs[f][op], e)
        table.insert(errs[f].all, e)
      end
    end
  end
  return nv.core.fill_(nv.core.empty(d.errs[1]:size(), "f32", "cpu"), #d.formats) -- bf16 everywhere
end
recipe.register("mor_gam_measure", function(s)
  return recipe.mor({granularity = "block", candidates = cands, scale = "gam", threshold = math.huge, decide = record,
    seed = s.seed})
end)
c.recipe = "mor_gam_measure"
local s = train.run(c, train.build(c))
print(string.format("final val loss %s", tostring(s.final_val_loss)))

local function pct(t, p) -- the p-th percentile: the value at rank ceil(p n) of the sorted list
  return t[math.max(1, math.ceil(p * #t))]
end
for _, f in ipairs(cands) do
  for _, op in ipairs({"x", "w", "dy", "all"}) do
    local t = errs[f][op]
    table.sort(t, function(a, b) return (a == a and a or math.huge) < (b == b and b or math.huge) end)
    print(string.format("%s gam per 128-block, %-3s %7d blocks: median %.4f  p90 %.4f  p99 %.4f  max %.4f", f, op, #t,
      pct(t, 0.5), pct(t, 0.9), pct(t, 0.99), t[#t]))
  end
end
