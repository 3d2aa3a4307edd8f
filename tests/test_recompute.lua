-- tests/test_recompute.lua: activation recompute on the CPU (recompute = "none" | "block" |
-- "selective": lua/nvlua/llama.lua's header; the tape of a forward's decisions: recipe.record /
-- recipe.replay in lua/nvlua/recipe.lua).
--   * numerics: for every registered recipe (recipe.names()) and five variants that reach the paths
--     the presets do not (f32 activations; bf16 blocks beside nvfp4 ones; MoR reusing choices over
--     steps; SR on a forward operand with delayed scaling, a data-parallel amax reducer and an SR
--     shard; fp8 with the reducer), a 2-block Llama trains 3 optimizer steps of 2 micro-batches each
--     (one weight cache per step, as the training loop runs them) under each mode: every
--     micro-batch's loss, the whole gradient buffer after each step, the final parameters (byte for
--     byte), the recipe's state (SR generator offset, delayed-scaling histories, MoR's reused choices),
--     nv.stats' GEMM and MoR counters, MoR's per-step counts, the weight cache's size and the
--     reducer's calls are identical. Three steps, so that delayed scaling's history holds the earlier
--     steps' amaxes when a block is recomputed (its own forward's push included: the replay must not
--     read it). A control breaks the replay (the tape ignored) and must differ.
--   * memory: what a training forward keeps, exactly: none - block = L * N * (A - C) and none -
--     selective = L * N * (2C + F) (activation-dtype bytes; A, the bytes "none" keeps per token and
--     block, = ab * (4C + 2*Dq + 2*kvC + 3F) + 4 * (Hq + 2), itself checked against the measured
--     total); and the peak of a whole step lower by at least (L - 1) and at most L blocks' savings.
--   * the module and train-key options, their errors, eval mode, a forward without its backward,
--     a replay that does not match its record; a short run with recompute=block equals recompute=none.
-- tests/test_cuda_recompute.lua runs the numerics on the CUDA backend (its emulation on the CPU).
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local recipe = require "nvlua.recipe"
local stats = require "nvlua.stats"
local optim = require "nvlua.optim"

local MODES = {"none", "block", "selective"}

-- Sizes every recipe takes: MoR's 128-element blocks need 128 | hidden (128), q width (4 x 64),
-- kv width (2 x 64), FFN (128) and the tokens of a micro-batch (2 x 64).
local CFG = {vocab_size = 96, hidden_size = 128, intermediate_size = 128, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, head_dim = 64, max_position_embeddings = 64}

-- micro-batch mb of step s: ids and targets [2, 64] (0-based token ids)
local function batch(s, mb)
  local g = nv.Generator(100 * s + mb)
  local ids = (nv.rand(2, 64, {generator = g}) * 95):to("i64")
  local tg = (nv.rand(2, 64, {generator = g}) * 95):to("i64")
  return ids, tg
end

-- The variants: name -> a function returning a new recipe and, optionally, a function giving more
-- state to compare (the reducer's calls).
local VARIANTS = {}
for _, name in ipairs(recipe.names()) do
  VARIANTS[#VARIANTS + 1] = {name, function() return recipe.make(name) end}
end
-- a data-parallel amax reducer for a world of one (the max over one rank: the amax itself), counting
-- its calls: a recompute must not run the collective again
local function counting_reducer(r)
  local calls = {n = 0}
  r:set_amax_reducer(function(a) calls.n = calls.n + 1; return a end)
  return r, function() return calls.n end
end
VARIANTS[#VARIANTS + 1] = {"nvfp4 with f32 activations", function() return recipe.make("nvfp4", {act_dtype = "f32"}) end}
VARIANTS[#VARIANTS + 1] = {"nvfp4 with block 0 in bf16", function()
  return recipe.make("nvfp4", {bf16_first = 1, bf16_last = 0})
end}
VARIANTS[#VARIANTS + 1] = {"mor reusing choices (every = 2)", function() return recipe.mor({every = 2}) end}
VARIANTS[#VARIANTS + 1] = {"custom: SR on x, delayed nvfp4 weights, reducer, SR shard 0 of 2", function()
  local r = recipe.custom(function(c)
    if c.high_precision then return "bf16" end
    if c.operand == "w" then return {format = "nvfp4", block = "2d", delayed = true} end
    return {format = "nvfp4", sr = true}
  end, {act_dtype = "bf16", seed = 9})
  r:set_shard(0, 2)
  return counting_reducer(r)
end}
VARIANTS[#VARIANTS + 1] = {"fp8_cs with a reducer", function() return counting_reducer(recipe.make("fp8_cs")) end}

-- 3 optimizer steps of a fresh model under make()'s recipe and recompute mode -> per step what must
-- not depend on the mode, and the final parameters' bytes
local function trace(make, mode)
  stats.reset()
  local rec, extra = make()
  local m = llama.Llama(CFG, {recipe = rec, seed = 4, recompute = mode})
  local opt = optim.AdamW(m:named_parameters(), {lr = 1e-2})
  local out = {}
  for s = 1, 3 do
    m.step = s - 1
    m:zero_grad()
    local losses, cached = {}, nil
    recipe.weight_cache(function()
      for mb = 1, 2 do
        local ids, tg = batch(s, mb)
        losses[mb] = string.pack("<d", m:forward_backward(ids, tg, {scale = 0.5}))
      end
      cached = recipe.weight_cache_size()
    end)
    out[s] = {losses = losses, grads = m.grad_buffer:bytes(), state = rec:state(), gemms = stats.gemms(),
      reps = stats.representations(), mor = rec.mor and rec.mor:take_step() or false, cached = cached,
      extra = extra and extra() or false}
    opt:step()
  end
  out.params = {}
  for _, p in ipairs(m:named_parameters()) do out.params[p.name] = p.param:bytes() end
  return out
end

-- a and b (traces) the same; what: the comparison's name. -> nil, or the first difference found
local function differ(a, b)
  for s = 1, 3 do
    local x, y = a[s], b[s]
    for mb = 1, 2 do if x.losses[mb] ~= y.losses[mb] then return string.format("step %d micro-batch %d loss", s, mb) end end
    if x.grads ~= y.grads then return string.format("step %d gradients", s) end
    for _, k in ipairs({"state", "gemms", "reps", "mor", "cached", "extra"}) do
      if not T.deep_eq(x[k], y[k]) then
        return string.format("step %d %s%s", s, k, type(x[k]) == "table" and "" or (": " .. T.show(x[k]) .. " vs " .. T.show(y[k])))
      end
    end
  end
  for name, bytes in pairs(a.params) do if b.params[name] ~= bytes then return "final parameter " .. name end end
end

T.case("every recipe: losses, gradients, parameters and recipe state identical under none, block and selective", function()
  for _, v in ipairs(VARIANTS) do
    local base = trace(v[2], "none")
    T.ok(#base[3].losses == 2 and next(base.params), v[1] .. ": traced")
    for _, mode in ipairs({"block", "selective"}) do
      local d = differ(trace(v[2], mode), base)
      T.ok(d == nil, string.format("%s, recompute=%s: %s differs from recompute=none", v[1], mode, tostring(d)))
    end
  end
end)

T.case("the comparison sees a recompute that decides again (control: no replay)", function()
  -- fp8_delayed with the block's second forward run plainly: it takes its amaxes from histories that
  -- now hold its own first forward's push, and pushes again; the gradients must differ
  local make = function() return recipe.make("fp8_delayed") end
  local base = trace(make, "none")
  local replay = recipe.replay
  local broken = T.with(function(f) local p = recipe.replay; recipe.replay = f; return p end,
    function(_, fn, ...) return fn(...) end, trace, make, "block")
  T.ok(recipe.replay == replay, "put back")
  local grads_differ = false
  for s = 1, 3 do grads_differ = grads_differ or broken[s].grads ~= base[s].grads end
  T.ok(grads_differ, "a re-deciding recompute changes the gradients")
  T.ok(not T.deep_eq(broken[3].state, base[3].state), "and the amax histories")
end)

-- ---- memory ------------------------------------------------------------------------------------------

-- Activations dominate: 4 blocks, 512 tokens, a vocabulary of 64.
local MCFG = {vocab_size = 64, hidden_size = 128, intermediate_size = 512, num_hidden_layers = 4,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256}
local B, S = 2, 256

local function mem_batch()
  local g = nv.Generator(5)
  return (nv.rand(B, S, {generator = g}) * 63):to("i64"), (nv.rand(B, S, {generator = g}) * 63):to("i64")
end

-- bytes a training forward keeps (beyond the logits it returns), then the backward run: -> kept, and
-- the peak of a whole forward_backward above what was live before it
local function measure(rname, mode)
  collectgarbage()
  collectgarbage()
  local m = llama.Llama(MCFG, {recipe = rname, seed = 1, recompute = mode})
  local ids, tg = mem_batch()
  local kept = recipe.weight_cache(function()
    local base = nv.memory().cpu
    local logits = m:forward(ids)                             -- (N, V)
    local k = nv.memory().cpu - base - logits:nbytes()
    local _, _, d = nv.core.cross_entropy(logits, tg:reshape(B * S), {grad = true, grad_dtype = logits:dtype()})
    logits:free()
    m:backward(d)
    d:free()
    return k
  end)
  m:zero_grad()
  collectgarbage()
  local base = nv.memory().cpu
  nv.reset_peak_memory()
  m:forward_backward(ids, tg)
  return kept, nv.memory().peak.cpu - base
end

T.case("memory: what a training forward keeps and a step's peak, as counted, under each mode", function()
  local C, F, L, N = MCFG.hidden_size, MCFG.intermediate_size, MCFG.num_hidden_layers, B * S
  local hd = C // MCFG.num_attention_heads
  local Dq, kvC, Hq = hd * MCFG.num_attention_heads, hd * MCFG.num_key_value_heads, MCFG.num_attention_heads
  for _, rname in ipairs({"bf16", "f32"}) do
    local ab = rname == "bf16" and 2 or 4 -- the activation dtype's bytes
    -- what recompute=none keeps per token and block (llama.lua's header): the block input, both norm
    -- outputs, the residual, RoPE'd q and k, v, the attention output, gate, up, SwiGLU's product; in
    -- f32 the attention's log-sum-exp (one per query head) and the two norms' rstd
    local A = ab * (4 * C + 2 * Dq + 2 * kvC + 3 * F) + 4 * (Hq + 2)
    local block_saves = A - ab * C              -- recompute=block keeps the block input only
    local selective_saves = ab * (2 * C + F)    -- recompute=selective drops both norm outputs and the product
    local kept, peak = {}, {}
    for _, mode in ipairs(MODES) do kept[mode], peak[mode] = measure(rname, mode) end
    -- the total kept under none: L blocks; the final norm's input (the last block's output) and rstd,
    -- and its output (the LM head's input); the step's weight copies (bf16: one of every linear, 2
    -- bytes per parameter; f32 runs plain GEMMs); the RoPE tables (f32 cos and sin, T x head_dim),
    -- made by the first forward
    local lin = L * (C * (2 * Dq + 2 * kvC) + 3 * C * F) + C * MCFG.vocab_size
    local other = N * (2 * ab * C + 4) + (rname == "bf16" and 2 * lin or 0) + 2 * 4 * S * hd
    T.eq(kept.none, L * N * A + other, rname .. ": what recompute=none keeps")
    T.eq(kept.none - kept.block, L * N * block_saves, rname .. ": recompute=block keeps L*N*(A - C) bytes less")
    T.eq(kept.none - kept.selective, L * N * selective_saves, rname .. ": recompute=selective keeps L*N*(2C + F) less")
    -- The peak of a step. Under none it comes in the top block's backward: every block's set kept, the
    -- top one's being consumed. Each block's backward also adds its dgrad weight copies to the step's
    -- weight cache, which holds them to the step's end (bf16: each linear's fprop copy transposed, 2
    -- bytes per parameter, a copy of its own on the CPU; f32 GEMMs take no copies): delta per block.
    -- Under block the recomputed block's set is whole again while the others hold their input (c) or,
    -- once back-propagated, their dgrad copies (delta): the peak is at the first or the last block
    -- back-propagated, whichever holds more, so none - block = (L-1) * (A - max(c, delta)), exactly.
    -- Under selective (A - s > delta here) it is the top block's backward, with the other blocks s
    -- lighter and part of the top block's s not rebuilt yet: none - selective in [(L-1) s, L s].
    local delta = rname == "bf16" and 2 * (lin - C * MCFG.vocab_size) // L or 0 -- bytes per block
    local block_peak = (L - 1) * (N * A - math.max(N * ab * C, delta))
    T.eq(peak.none - peak.block, block_peak, rname .. ": recompute=block lowers the peak by (L-1)*(A - max(c, delta))")
    local saved = peak.none - peak.selective
    T.ok(saved >= (L - 1) * N * selective_saves and saved <= L * N * selective_saves, string.format(
      "%s selective: the peak %.3f MB lower, not within [%.3f, %.3f] MB ((L-1) to L blocks' savings)", rname,
      saved / 2 ^ 20, (L - 1) * N * selective_saves / 2 ^ 20, L * N * selective_saves / 2 ^ 20))
  end
end)

-- ---- options, errors, lifetimes ----------------------------------------------------------------------

T.case("options: the Llama option, set_recompute, clear errors naming the key", function()
  local m = llama.Llama(CFG, {seed = 1, recompute = "block"})
  T.eq(m:recompute_mode(), "block")
  T.ok(m:extra_repr():find("recompute=block", 1, true), "the model says so")
  T.eq(m:set_recompute("selective"):recompute_mode(), "selective")
  T.eq(m.layers[1].mlp.down_proj.recompute_input, true, "selective: the linears reading a recomputed tensor")
  T.eq(m.layers[1].self_attn.o_proj.recompute_input, nil, "o_proj keeps its input (attention keeps it anyway)")
  m:set_recompute("none")
  T.eq(m.layers[1].mlp.down_proj.recompute_input, nil)
  T.ok(not m:extra_repr():find("recompute", 1, true))
  m.layers[2]:set_recompute("block")
  T.eq(m:recompute_mode(), "mixed")
  T.raises(function() llama.Llama(CFG, {recompute = "blocks"}) end,
    "Llama: option recompute must be one of none, block, selective, got blocks")
  T.raises(function() m:set_recompute("full") end, "Llama:set_recompute: recompute must be one of none, block, selective, got 'full'")
  T.raises(function() m:set_recompute() end, "got nil")
  T.raises(function() m.layers[1]:set_recompute(true) end, "Block:set_recompute: recompute must be one of")
end)

T.case("eval mode keeps nothing whatever the mode; a forward without its backward frees what it kept", function()
  local ids = batch(1, 1)
  local ref = llama.Llama(CFG, {seed = 2, recipe = "nvfp4"})
  ref:eval()
  local want = ref:forward(ids):bytes()
  for _, mode in ipairs({"block", "selective"}) do
    local m = llama.Llama(CFG, {seed = 2, recipe = "nvfp4", recompute = mode})
    m:eval()
    m:forward(ids):free() -- the RoPE tables are made by a model's first forward
    collectgarbage()
    local base = nv.memory().cpu
    local y = m:forward(ids)
    T.ok(y:bytes() == want, mode .. ": eval logits equal recompute=none's")
    y:free()
    T.eq(nv.memory().cpu - base, 0, mode .. ": an eval forward keeps nothing")
    m:train()
    -- two training forwards: the second frees what the first kept (the block inputs and tapes too)
    recipe.weight_cache(function()
      local b0 = nv.memory().cpu
      m:forward(ids):free()
      local once = nv.memory().cpu - b0
      T.ok(once > 0, mode .. ": a training forward keeps something")
      m:forward(ids):free()
      T.eq(nv.memory().cpu - b0, once, mode .. ": the second forward replaced the first's")
    end)
  end
end)

T.case("the tape: a replay must make the recorded decisions; Linear's input must be given back", function()
  local r = recipe.make("fp8_delayed")
  local w = nv.randn(32, 32, {generator = nv.Generator(1)})
  local x = nv.randn(64, 32, {generator = nv.Generator(2)})
  local ctx = {name = "l", step = 0}
  local tape = recipe.record(function() end) -- a forward that quantized nothing
  T.raises(function() recipe.replay(tape, function() r:linear_forward(ctx, x, w, true) end) end,
    "recompute: the recomputed forward quantized l|x|fprop")
  T.eq(recipe.replaying(), false, "the replay closed")
  T.raises(function() recipe.record(function() recipe.record(function() end) end) end, "recompute does not nest")
  T.raises(function() recipe.replay({}, function() end) end, "expects a tape from recipe.record")
  -- a Linear that did not keep its input
  local nn = require "nvlua.nn"
  local lin = nn.Linear(32, 16, {recipe = recipe.make("bf16")})
  lin.recompute_input = true
  lin:forward(x)
  T.ok(lin:needs_input())
  T.raises(function() lin:backward(nv.zeros(64, 16)) end, "its input was not kept (recompute_input)")
  T.raises(function() lin:restore_input(nv.zeros(64, 16)) end, "expected the forward's input [64,32], got [64,16]")
  lin:restore_input(x)
  T.ok(not lin:needs_input())
  T.raises(function() lin:restore_input(x) end, "is not waiting for its input")
  lin:backward(nv.zeros(64, 16))
end)

-- ---- the training loop --------------------------------------------------------------------------------

T.case("train: recompute=block and selective train as recompute=none does, bit for bit; the key is printed", function()
  local train = require "nvlua.train"
  local config = require "nvlua.config"
  local root = T.tmpdir()
  local corpus = T.write_corpus(root .. "/corpus.txt", {seed = 7, lines = 400, words = {"in", "the", "beginning",
    "was", "word", "and", "light"}})
  local function run(mode)
    local c = config.parse(train.defaults, {"data=" .. corpus, "cache=" .. root .. "/cache", "layers=2", "hidden=32",
      "heads=4", "kv_heads=2", "ffn=64", "seq=16", "batch=2", "grad_accum=2", "steps=4", "warmup=1", "eval_every=0",
      "sample_tokens=0", "plot=false", "save=false", "recipe=fp8_delayed", "out=" .. root .. "/" .. mode,
      "recompute=" .. mode, "quiet=" .. tostring(mode == "none")})
    local p = train.build(c)
    p.peak = 1e9 -- no sgemm measurement
    local lines = {}
    local s = T.with(function(f) local o = io.stdout; io.stdout = f; return o end,
      {write = function(_, ...) for _, x in ipairs({...}) do lines[#lines + 1] = tostring(x) end end, flush = function() end},
      function() return train.run(c, p) end)
    local printed = {write = function(_, x) lines[#lines + 1] = x end}
    config.print(c, printed)
    return s, table.concat(lines), T.read_file(c.out .. "/config.json")
  end
  local s0 = run("none")
  for _, mode in ipairs({"block", "selective"}) do
    local s, text, json = run(mode)
    T.eq(#s.losses, 4)
    for i = 1, 4 do T.eq(string.pack("<d", s.losses[i][2]), string.pack("<d", s0.losses[i][2]), mode .. ": loss of step " .. i) end
    T.ok(text:find("recompute=" .. mode, 1, true), mode .. ": the run's model line says it")
    T.ok(text:find("recompute%s*= " .. mode), mode .. ": the printed config has the key")
    T.ok(json:find('"recompute": "' .. mode .. '"', 1, true), mode .. ": config.json has it")
  end
  T.raises(function() config.parse(train.schema, {"recompute=full"}) end,
    "config: recompute must be one of none, block, selective, got 'full'")
  T.rm_tree(root)
end)
