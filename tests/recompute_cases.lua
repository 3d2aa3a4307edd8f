-- tests/recompute_cases.lua: what tests/test_recompute.lua (the CPU) and tests/test_cuda_recompute.lua
-- (the CUDA backend) train under each activation recompute mode and compare. Not a test file:
-- loaded with dofile.
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local recipe = require "nvlua.recipe"
local stats = require "nvlua.stats"
local optim = require "nvlua.optim"

local M = {}

M.MODES = {"none", "block", "selective"}

-- Sizes every recipe takes: MoR's 128-element blocks need 128 | hidden (128), q width (4 x 64),
-- kv width (2 x 64), FFN (128) and the tokens of a micro-batch (2 x 64).
M.CFG = {vocab_size = 96, hidden_size = 128, intermediate_size = 128, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, head_dim = 64, max_position_embeddings = 64}

--- M.batch(s, mb [, T = 64 [, V = 96]]) -> ids, targets [2, T] (0-based token ids < V, host tensors) of
-- micro-batch mb of step s
function M.batch(s, mb, T_, V)
  local g = nv.Generator(100 * s + mb)
  local ids = (nv.rand(2, T_ or 64, {generator = g}) * ((V or 96) - 1)):to("i64")
  local tg = (nv.rand(2, T_ or 64, {generator = g}) * ((V or 96) - 1)):to("i64")
  return ids, tg
end

--- M.SMALL: a config half as wide and long (T = 32) for the recipes that take it (not mor_block, whose
-- 128-element blocks need M.CFG): where each step costs more (the CUDA emulator)
M.SMALL = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32}

-- a data-parallel amax reducer for a world of one (the max over one rank: the amax itself), counting
-- its calls: a recompute must not run the collective again. -> r, a function giving the count
local function counting_reducer(r)
  local calls = {n = 0}
  r:set_amax_reducer(function(a) calls.n = calls.n + 1; return a end)
  return r, function() return calls.n end
end

--- M.VARIANTS: {name, make [, cfg]} for every registered recipe (recipe.names()) and five that reach
-- paths the presets do not: f32 activations; bf16 blocks beside nvfp4 ones; MoR reusing its choices
-- over steps (every = 2); SR on a forward operand with delayed-scaling nvfp4 weights, a data-parallel
-- amax reducer and an SR shard; fp8 current scaling with the reducer. make() -> a new recipe and,
-- optionally, a function giving more state to compare (the reducer's calls). cfg: the model the
-- variant needs (mor_block: M.CFG), else M.SMALL.
M.VARIANTS = {}
for _, name in ipairs(recipe.names()) do
  M.VARIANTS[#M.VARIANTS + 1] = {name, function() return recipe.make(name) end, (name == "mor_block" or name == "mor_paper") and M.CFG or nil}
end
M.VARIANTS[#M.VARIANTS + 1] = {"nvfp4 with f32 activations", function() return recipe.make("nvfp4", {act_dtype = "f32"}) end}
M.VARIANTS[#M.VARIANTS + 1] = {"nvfp4 with block 0 in bf16", function()
  return recipe.make("nvfp4", {bf16_first = 1, bf16_last = 0})
end}
M.VARIANTS[#M.VARIANTS + 1] = {"mor reusing choices (every = 2)", function() return recipe.mor({every = 2}) end}
M.VARIANTS[#M.VARIANTS + 1] = {"custom: SR on x, delayed nvfp4 weights, reducer, SR shard 0 of 2", function()
  local r = recipe.custom(function(c)
    if c.high_precision then return "bf16" end
    if c.operand == "w" then return {format = "nvfp4", block = "2d", delayed = true} end
    return {format = "nvfp4", sr = true}
  end, {act_dtype = "bf16", seed = 9})
  r:set_shard(0, 2)
  return counting_reducer(r)
end}
M.VARIANTS[#M.VARIANTS + 1] = {"fp8_cs with a reducer", function() return counting_reducer(recipe.make("fp8_cs")) end}

--- M.trace(make, mode [, {device = "cpu", steps = 3, micro = 2, cfg = M.CFG}]) -> per step what must not
-- depend on the recompute mode, and the final parameters' bytes: a fresh 2-block model (cfg; its
-- max_position_embeddings is the sequence length) under make()'s
-- recipe trains steps AdamW steps of micro micro-batches each, in one weight cache per step as the
-- training loop runs them. Per step: each micro-batch's loss bits, the gradient buffer's bytes, the
-- recipe's state (SR generator offset, delayed-scaling histories, MoR's reused choices), nv.stats'
-- GEMM and MoR counters, MoR's step counts, the weight cache's size, make's extra state.
function M.trace(make, mode, o)
  o = o or {}
  local device, steps, micro, cfg = o.device or "cpu", o.steps or 3, o.micro or 2, o.cfg or M.CFG
  stats.reset()
  local rec, extra = make()
  local m = llama.Llama(cfg, {recipe = rec, seed = 4, recompute = mode})
  if device ~= "cpu" then m:to(device) end
  local opt = optim.AdamW(m:named_parameters(), {lr = 1e-2})
  local out = {steps = steps, micro = micro}
  for s = 1, steps do
    m.step = s - 1
    m:zero_grad()
    local losses, cached = {}, nil
    recipe.weight_cache(function()
      for mb = 1, micro do
        local ids, tg = M.batch(s, mb, cfg.max_position_embeddings, cfg.vocab_size)
        losses[mb] = string.pack("<d", m:forward_backward(ids, tg, {scale = 1 / micro}))
      end
      cached = recipe.weight_cache_size()
    end)
    out[s] = {losses = losses, grads = m.grad_buffer:cpu():bytes(), state = rec:state(), gemms = stats.gemms(),
      reps = stats.representations(), mor = rec.mor and rec.mor:take_step() or false, cached = cached,
      extra = extra and extra() or false}
    opt:step()
  end
  out.params = {}
  for _, p in ipairs(m:named_parameters()) do out.params[p.name] = p.param:cpu():bytes() end
  return out
end

--- M.differ(a, b) -> nil when traces a and b are the same, else the first difference found (a phrase)
function M.differ(a, b)
  for s = 1, a.steps do
    local x, y = a[s], b[s]
    for mb = 1, a.micro do
      if x.losses[mb] ~= y.losses[mb] then return string.format("step %d micro-batch %d loss", s, mb) end
    end
    if x.grads ~= y.grads then return string.format("step %d gradients", s) end
    for _, k in ipairs({"state", "gemms", "reps", "mor", "cached", "extra"}) do
      if not T.deep_eq(x[k], y[k]) then
        return string.format("step %d %s%s", s, k, type(x[k]) == "table" and "" or (": " .. T.show(x[k]) .. " vs " .. T.show(y[k])))
      end
    end
  end
  for name, bytes in pairs(a.params) do if b.params[name] ~= bytes then return "final parameter " .. name end end
end

--- M.check_all(o): every variant (or those o.variants names, a set) traced under each mode (o: M.trace's
-- options but cfg: the variant's), block and selective against none
function M.check_all(o)
  for _, v in ipairs(M.VARIANTS) do
    if o and o.variants and not o.variants[v[1]] then goto next end
    local to = {device = o and o.device, steps = o and o.steps, micro = o and o.micro, cfg = v[3] or M.SMALL}
    local base = M.trace(v[2], "none", to)
    T.ok(#base[base.steps].losses == base.micro and next(base.params), v[1] .. ": traced")
    for _, mode in ipairs({"block", "selective"}) do
      local d = M.differ(M.trace(v[2], mode, to), base)
      T.ok(d == nil, string.format("%s, recompute=%s: %s differs from recompute=none", v[1], mode, tostring(d)))
    end
    ::next::
  end
end

--- M.per_token(cfg, ab) -> A, the bytes recompute=none keeps per token and block (llama.lua's header:
-- the block input, both norm outputs, the residual, RoPE'd q and k, v, the attention output, gate, up
-- and SwiGLU's product in the activation dtype of ab bytes; in f32 the attention's log-sum-exp, one per
-- query head, and the two norms' rstd); what block keeps less (all but the input: A - ab*C); what
-- selective keeps less (both norm outputs and the product: ab * (2C + F))
function M.per_token(cfg, ab)
  local C, F, Hq = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
  local hd = cfg.head_dim or C // Hq
  local Dq, kvC = hd * Hq, hd * cfg.num_key_value_heads
  local A = ab * (4 * C + 2 * Dq + 2 * kvC + 3 * F) + 4 * (Hq + 2)
  return A, A - ab * C, ab * (2 * C + F)
end

--- M.memory(rname, mode, cfg, B [, device = "cpu"]) -> kept, peak: a model of cfg under recipe rname and
-- recompute mode, batch [B, max_position_embeddings]: the bytes of device memory a training forward
-- keeps beyond the logits it returns (inside the step's weight cache; the backward then run), and the
-- peak of a second whole forward_backward above what was live before it.
function M.memory(rname, mode, cfg, B, device)
  device = device or "cpu"
  local S, V = cfg.max_position_embeddings, cfg.vocab_size
  collectgarbage()
  collectgarbage()
  local m = llama.Llama(cfg, {recipe = rname, seed = 1, recompute = mode})
  if device ~= "cpu" then m:to(device) end
  local g = nv.Generator(5)
  local ids, tg = (nv.rand(B, S, {generator = g}) * (V - 1)):to("i64"), (nv.rand(B, S, {generator = g}) * (V - 1)):to("i64")
  local function live() return nv.memory()[device] end
  local kept = recipe.weight_cache(function()
    local base = live()
    local logits = m:forward(ids)                             -- (N, V)
    local k = live() - base - logits:nbytes()
    local _, _, d = nv.core.cross_entropy(logits, tg:reshape(B * S):to(device),
      {grad = true, grad_dtype = logits:dtype()})
    logits:free()
    m:backward(d)
    d:free()
    return k
  end)
  m:zero_grad()
  collectgarbage()
  local base = live()
  nv.reset_peak_memory()
  m:forward_backward(ids, tg)
  return kept, nv.memory().peak[device] - base
end

return M
