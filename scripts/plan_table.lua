-- scripts/plan_table.lua: the per-GPU memory plan (nvlua.plan) of Llama 3 8B and 70B at batch 1 x
-- sequence 8192 per GPU, as a markdown table: GiB per GPU for every shard x recompute setting on 1, 8
-- and 64 GPUs under bf16, fp8_cs and nvfp4 (the paper's recipe: first 2 and last 8 blocks of 32, 5 and
-- 20 of 80, in bf16), whether it fits an 80 GB GPU (gpu_memory=80GB: 80e9 bytes, 74.5 GiB; an H100 80GB
-- has 79.6 GiB), the first configuration that fits (plan.fit, in plan.ORDER), and the bytes each GPU
-- sends per step; and what fits one H200 (its 143771 MiB). Computed by the plan, not measured (tests/test_plan.lua holds the plan to 5% of
-- measured peaks where they can be measured: CPU ranks, one 8B block on an H200).
--   build/nvlua scripts/plan_table.lua [seq=8192] [batch=1] [gpu_memory=80GB] > experiments/bench/plan_fits.md
local plan = require "nvlua.plan"
local recipe = require "nvlua.recipe"
local config = require "nvlua.config"

local c = config.parse({seq = config.int(8192, {min = 1}), batch = config.int(1, {min = 1}),
  gpu_memory = config.str("80GB", {check = function(v) local _, why = plan.parse_bytes(v); return why end})}, arg)
local have = plan.parse_bytes(c.gpu_memory)
local GiB = 2 ^ 30
local MODELS = {{"Llama 3 8B", plan.configs.llama3_8b}, {"Llama 3 70B", plan.configs.llama3_70b}}
local RECIPES = {"bf16", "fp8_cs", "nvfp4"}
local GPUS = {1, 8, 64}
local H200 = plan.parse_bytes("143771MiB") -- what an H200 "141GB" reports (140.4 GiB)

local function p(...) io.write(string.format(...)) end

p("# Per-GPU memory plan: Llama 3 8B and 70B\n\n")
p("Computed by the plan (`nvlua.plan`, its CUDA backend model), **not measured**; %s, `scripts/plan_table.lua`. " ..
  "Batch %d x sequence %d per GPU, AdamW with f32 master weights; GiB per GPU at the step's peak (memory " ..
  "outside nvlua's allocator allowed 1 GiB). Fits: at most gpu_memory=%s (%.2f GiB; an H100 80GB has 79.6 GiB). " ..
  "`-`: not a configuration (shard=grads or full on one GPU). The plan is held to 5%% of measured peaks in " ..
  "tests/test_plan.lua (CPU ranks under mpirun; one 8B block on an H200); shard=grads and full are modelled as " ..
  "issue 30 specifies them (prefetch of the next unit, the quantized weight all-gather).\n\n",
  os.date("!%Y-%m-%d"), c.batch, c.seq, c.gpu_memory, have / GiB)

for _, model in ipairs(MODELS) do
  local name, mc = model[1], model[2]
  local params = plan.params(mc).total
  p("## %s (%.2fB parameters)\n\n", name, params / 1e9)
  p("| recipe | shard | recompute |")
  for _, g in ipairs(GPUS) do p(" %d GPU%s |", g, g == 1 and "" or "s") end
  p("\n|---|---|---|")
  for _ = 1, #GPUS do p("---:|") end
  p("\n")
  for _, rn in ipairs(RECIPES) do
    for _, cand in ipairs(plan.ORDER) do
      p("| %s | %s | %s |", rn, cand.shard, cand.recompute)
      for _, g in ipairs(GPUS) do
        if g == 1 and (cand.shard == "grads" or cand.shard == "full") then
          p(" - |")
        else
          local m = plan.memory(mc, recipe[rn](), c.batch, c.seq, {gpus = g, shard = cand.shard,
            recompute = cand.recompute, device = "cuda"})
          p(" %.1f%s |", m.total / GiB, m.total <= have and " **fits**" or "")
        end
      end
      p("\n")
    end
  end
  p("\nThe first configuration that fits gpu_memory=%s (the last column: one H200's 140.4 GiB) (plan.fit, in the " ..
    "order %s):\n\n", c.gpu_memory, plan.order_text())
  p("| recipe |")
  for _, g in ipairs(GPUS) do p(" %d GPU%s |", g, g == 1 and "" or "s") end
  p(" 1 H200 (140.4 GiB) |\n|---|")
  for _ = 1, #GPUS + 1 do p("---|") end
  p("\n")
  local function cell(fit)
    if fit then p(" shard=%s recompute=%s (%.1f GiB) |", fit.shard, fit.recompute, fit.total / GiB)
    else p(" nothing fits |") end
  end
  for _, rn in ipairs(RECIPES) do
    p("| %s |", rn)
    for _, g in ipairs(GPUS) do cell(plan.fit(mc, recipe[rn](), c.batch, c.seq, {gpus = g, gpu_memory = have, device = "cuda"})) end
    cell(plan.fit(mc, recipe[rn](), c.batch, c.seq, {gpus = 1, gpu_memory = H200, device = "cuda"}))
    p("\n")
  end
  p("\nBytes each GPU sends per optimizer step (GB; ring algorithms; shard=full gathers each block before its forward " ..
    "and again before its backward; nvfp4 gathers its nvfp4 linears quantized):\n\n")
  p("| recipe | GPUs | none (all-reduce) | optimizer | grads | full | full: weight all-gather | of it, quantized " ..
    "linears vs bf16 |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
  for _, rn in ipairs(RECIPES) do
    for _, g in ipairs({8, 64}) do
      local row = {}
      for _, sh in ipairs(plan.SHARDS) do
        row[sh] = plan.comm(mc, recipe[rn](), c.batch, c.seq, {gpus = g, shard = sh})
      end
      local f = row.full
      p("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %s |\n", rn, g, row.none.total / 1e9, row.optimizer.total / 1e9,
        row.grads.total / 1e9, f.total / 1e9, f.weight_gather / 1e9, f.quantized_gather_bf16 > 0 and
        string.format("%.3fx", f.quantized_gather / f.quantized_gather_bf16) or "-")
    end
  end
  p("\n")
end
