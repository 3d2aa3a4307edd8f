-- experiments/compare_recipes.lua: the paper's comparison at small scale. The same model, data
-- and seed trained under bf16, fp8 (current scaling), mxfp8, nvfp4 (the paper's recipe), mxfp4
-- (the same recipe in OCP MXFP4), and the nvfp4 ablations — no RHT, no stochastic rounding, no
-- 2D weight blocks, every layer in nvfp4.
-- Prints a table of final validation loss, the gap to bf16 in %, and tokens/s, writes it to
-- <out>/results.md and draws one overlay plot of the validation (and training) loss.
--   nvlua experiments/compare_recipes.lua [steps=150] [only=bf16,nvfp4] [key=value ...]
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
}

local c = config.parse(train.schema, arg, {
  out = "runs/compare_recipes", data = "kjv", layers = 4, hidden = 256, heads = 4, kv_heads = 2, ffn = 768,
  seq = 128, batch = 8, steps = 150, lr = 3e-3, min_lr = 3e-4, warmup = 15, schedule = "wsd", decay = 0.25,
  eval_every = 25, eval_batches = 4, log_every = 25, sample_tokens = 0, plot = false, save = false, quiet = true,
  overwrite = true, -- a rerun redoes the sweep's runs
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
for i, r in ipairs(chosen) do
  local rc = {}
  for k, v in pairs(c) do rc[k] = v end
  rc.only = nil
  for k, v in pairs(r) do if k ~= "name" then rc[k] = v end end
  rc.out = c.out .. "/" .. r.name:gsub("[^%w]+", "_")
  io.write(string.format("[%d/%d] %-18s ", i, #chosen, r.name))
  io.flush()
  local t0 = nv.clock()
  local s = train.run(rc, train.build(rc))
  results[#results + 1] = {name = r.name, val = s.final_val_loss, tps = s.tokens_per_s, secs = nv.clock() - t0}
  print(string.format("val loss %.4f  %6.0f tok/s  %5.0f s", s.final_val_loss or 0 / 0, s.tokens_per_s, nv.clock() - t0))
  local vx, vy = {}, {}
  for _, p in ipairs(s.val) do vx[#vx + 1] = p[1]; vy[#vy + 1] = p[2] end
  series[#series + 1] = {title = r.name .. " (val)", x = vx, y = vy}
end

local base
for _, r in ipairs(results) do if r.name == "bf16" then base = r.val end end
local lines = {
  string.format("steps %d, batch %d x seq %d, %d layers, hidden %d, data %s, seed %d", c.steps, c.batch, c.seq, c.layers,
    c.hidden, c.data, c.seed),
  "",
  "| recipe | final val loss | gap to bf16 | tokens/s |",
  "|---|---:|---:|---:|",
}
for _, r in ipairs(results) do
  lines[#lines + 1] = string.format("| %s | %.4f | %s | %.0f |", r.name, r.val or 0 / 0,
    base and string.format("%+.2f%%", 100 * (r.val - base) / base) or "-", r.tps)
end
print("")
for _, l in ipairs(lines) do print(l) end
local f = assert(io.open(c.out .. "/results.md", "w"))
f:write(table.concat(lines, "\n"), "\n")
f:close()
local png = c.out .. "/compare.png"
local ok, err = plot.lines(png, series, {title = "validation loss by recipe", ylabel = "val loss"})
print(ok and ("\nplot: " .. png) or ("\nplot: " .. tostring(err)))
print("table: " .. c.out .. "/results.md")
