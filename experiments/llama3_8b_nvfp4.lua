-- experiments/llama3_8b_nvfp4.lua: Llama 3 8B exactly (hidden 4096, 32 layers, 32 heads / 8 KV
-- heads, FFN 14336, vocab 128256, RoPE θ 500000, RMSNorm eps 1e-5, sequence 8192) under the
-- paper's NVFP4 recipe (2D weights, RHT on Wgrad inputs, SR on gradients, the first 2 and last 8
-- blocks in bf16), WSD schedule, AdamW β = (0.9, 0.95), weight decay 0.1.
--
--   nvlua experiments/llama3_8b_nvfp4.lua plan=true
--       parameters, FLOPs per token, memory per component per recipe, the GEMM precision plan;
--       nothing is allocated
--   nvlua experiments/llama3_8b_nvfp4.lua layers=1 seq=128 steps=2
--       trains one full-width 8B block on the CPU (about 21 GiB); prints the peak memory beside
--       the plan's prediction
--   data=shards:<dir> vocab=128256 trains on pre-tokenized shards (scripts/make_shards.lua)
local nv = require "nvlua"
local train = require "nvlua.train"
local plan = require "nvlua.plan"
local config = require "nvlua.config"

local defaults = {
  layers = 32, hidden = 4096, heads = 32, kv_heads = 8, ffn = 14336, vocab = 128256, rope_theta = 500000.0,
  norm_eps = 1e-5, seq = 8192, tie = false,
  recipe = "nvfp4", schedule = "wsd", decay = 0.2, lr = 3e-4, min_lr = 3e-5, warmup = 0, beta1 = 0.9, beta2 = 0.95,
  weight_decay = 0.1, clip = 1.0, batch = 1, steps = 2, eval_every = 0, sample_tokens = 0, plot = false, save = false,
  out = "runs/llama3_8b_nvfp4", log_every = 1,
  plan = config.bool(false, {doc = "print the plan and memory table without allocating"}),
}
local c = config.parse(train.schema, arg, defaults)

local mc = train.model_config(c, c.vocab)
mc.head_dim = mc.head_dim or c.hidden // c.heads
print(string.format("Llama 3 8B-shaped model: %d layers, hidden %d, %d/%d heads, FFN %d, vocab %d, seq %d, rope θ %g",
  c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq, c.rope_theta))
local rows = plan.report(mc, {"bf16", "fp8_cs", "mxfp8", "nvfp4", "mxfp4"}, c.batch, c.seq)
if c.plan then
  print("")
  local r = train.recipe(c)
  r:plan({linears = function() return plan.linears(mc) end})
  return
end

print("")
print("config:")
config.print(c)
local predicted = rows[c.recipe] and rows[c.recipe].total or plan.memory(mc, train.recipe(c), c.batch, c.seq).total
local parts = train.build(c)
local s = train.run(c, parts)
local measured = nv.memory().peak.cpu
print(string.format("\npeak tensor memory %.2f GiB (process peak RSS %.2f GiB); the plan predicted %.2f GiB (%+.1f%%)",
  measured / 2 ^ 30, nv.core.peak_rss() / 2 ^ 30, predicted / 2 ^ 30, 100 * (predicted - measured) / measured))
print(string.format("%d steps, %.1f tokens/s, last loss %.4f", s.steps, s.tokens_per_s, s.last_loss or 0 / 0))
