-- tests/test_plan.lua: nvlua.plan's counts against a built model, and its memory prediction
-- against the measured peak of a real training step.
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local plan = require "nvlua.plan"

local cfg = {vocab_size = 256, hidden_size = 128, intermediate_size = 384, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64}

T.case("parameter counts match the built model", function()
  T.eq(plan.params(cfg).total, llama.Llama(cfg):num_parameters())
  local tied = {}
  for k, v in pairs(cfg) do tied[k] = v end
  tied.tie_word_embeddings = true
  T.eq(plan.params(tied).total, llama.Llama(tied):num_parameters())
  -- Llama 3 8B: 8.03B parameters
  local p = plan.params({vocab_size = 128256, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = 32,
    num_attention_heads = 32, num_key_value_heads = 8})
  T.eq(p.total, 8030261248)
end)

T.case("the memory plan predicts a training step's peak within 20%", function()
  for _, name in ipairs({"bf16", "nvfp4"}) do
    collectgarbage()
    nv.reset_peak_memory()
    local base = nv.memory().cpu
    local r = nv.recipe[name]()
    local m = llama.Llama(cfg, {recipe = r, seed = 1})
    local opt = optim.AdamW(m:named_parameters(), {lr = 1e-3})
    local g = nv.Generator(3)
    local x = (nv.rand(4, 64, {generator = g}) * 255):to("i64")
    local y = (nv.rand(4, 64, {generator = g}) * 255):to("i64")
    m:forward_backward(x, y)
    opt:step()
    local measured = nv.memory().peak.cpu - base
    local predicted = plan.memory(cfg, r, 4, 64).total
    T.ok(math.abs(predicted - measured) <= 0.2 * measured,
      string.format("%s: predicted %.2f MB, measured %.2f MB", name, predicted / 2 ^ 20, measured / 2 ^ 20))
    x:free(); y:free()
  end
end)

T.case("the LM head's logits in the plan: one chunk of 2^27 / vocab tokens where the head is chunkable", function()
  local recipe = require "nvlua.recipe"
  local c = {vocab_size = 128256, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = 32,
    num_attention_heads = 32, num_key_value_heads = 8}
  local N, V = 8192, 128256
  local chunked = plan.memory(c, recipe.nvfp4(), 1, N)
  local whole = plan.memory(c, recipe.custom(function() return "nvfp4" end, {act_dtype = "bf16"}), 1, N)
  local rows = (1 << 27) // V -- 1046 tokens at a time
  -- f32 logits and gradient (8 bytes per logit) of one chunk instead of every token
  T.eq(whole.activations - chunked.activations, (N - rows) * 8 * V, "the difference is the unchunked tokens' logits")
  T.ok(whole.activations - chunked.activations > 7e9, "about 7.3 GB less at 8k tokens")
end)
