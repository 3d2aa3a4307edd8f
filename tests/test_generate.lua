-- tests/test_generate.lua: the KV cache (model:kv_cache, model:forward(ids, {cache =}),
-- core.attention_forward_at) and generation from a text prompt (model:generate, train.sample).
--
-- Tolerances:
--   * core.attention_forward_at vs core.attention_forward under nv.use_reference(true): both are the
--     scalar reference's one loop (double sums, one rounding to f32) over the same keys: equal, bit for
--     bit. The CPU table runs the same reference loop for attention_forward_at.
--   * cached logits vs the full forward's, f32: the first chunk (cache.len = 0) runs the very
--     attention of the full forward; later chunks the double-precision reference rounded once, where the
--     full forward runs the fast fp32 kernel, whose difference tests/test_attention.lua bounds by
--     1e-5 (|x| + max|x|). The tiny model's norms and linears have O(1) gain, so we allow
--     1e-5 (|logit| + max|logit|) per element (measured: ~1.5e-7 of max|logit|, about 1 ulp).
--   * bf16 recipe: the activations are rounded to bf16 (2^-8 relative) at every layer, and the cached
--     steps' attention runs the widened f32 op rather than the fused CPU route: a few bf16 roundings
--     apart. We allow 2^-5 max|logit| (measured below, printed).
--   * nvfp4: each cached step quantizes its own activations (per-tensor scales of the new tokens only),
--     so the same token's activations land on another e2m1 grid than in the full forward (a code step
--     is up to 1/3 of the value): cached logits are close, not equal. Measured 0.11 max|logit| for this
--     model and seed (printed); we allow 0.25, about twice that, and check the prefill (cache.len = 0,
--     the full forward's own computation) bit for bit.
local T = require "nvlua.test"
local nv = require "nvlua"
local nn = require "nvlua.nn"
local recipe = require "nvlua.recipe"
local core = nv.core

local CFG = {vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32}

local function model(o)
  o = o or {}
  local cfg = {}
  for k, v in pairs(CFG) do cfg[k] = v end
  for k, v in pairs(o.config or {}) do cfg[k] = v end
  local m = nn.Llama(cfg, {seed = o.seed or 1, recipe = o.recipe})
  m:eval()
  return m
end

-- Fixed token ids (B, Tn), 0-based, in the vocabulary.
local function token_ids(B, Tn, seed)
  local rows = {}
  for b = 1, B do
    rows[b] = {}
    for t = 1, Tn do rows[b][t] = (t * 7 + b * 13 + (seed or 0) * 5) % CFG.vocab_size end
  end
  return nv.tensor(rows, "i64")
end

-- max |a - b| and max |b| over two tensors of one shape (read as f32)
local function diff(a, b)
  return (a:to("f32") - b:to("f32")):abs():max(), b:to("f32"):abs():max()
end

-- The full forward's logits (B, Tn, V) and the cached ones, run in chunks of the sizes given.
local function full_and_cached(m, ids, chunks)
  local B, Tn = ids:size(1), ids:size(2)
  local full = m:forward(ids):view(B, Tn, CFG.vocab_size)
  local cache = m:kv_cache()
  local parts, at = {}, 0
  for _, n in ipairs(chunks) do
    parts[#parts + 1] = {at, m:forward(ids:narrow(2, at + 1, n):contiguous(), {cache = cache})}
    at = at + n
  end
  T.eq(at, Tn, "the chunks cover the ids")
  T.eq(cache.len, Tn)
  return full, parts, cache
end

-- every chunk's logits within rtol (|full| + max|full|) of the full forward's; -> the max difference
-- over max|full|
local function check_close(full, parts, rtol, what)
  local worst = 0
  for _, p in ipairs(parts) do
    local at, l = p[1], p[2]
    local want = full:narrow(2, at + 1, l:size(2))
    local d, mx = diff(l, want)
    worst = math.max(worst, d / mx)
    T.ok(l:to("f32"):allclose(want:to("f32"), rtol, rtol * mx), string.format("%s: chunk at %d differs by %g " ..
      "(max |logit| %g)", what, at, d, mx))
  end
  return worst
end

-- ---- core.attention_forward_at --------------------------------------------------------------------

T.case("attention_forward_at: the reference rows of the full causal attention, bit for bit", function()
  local g = nv.Generator(3)
  local B, L, Hq, Hkv, D, S = 2, 9, 4, 2, 8, 12
  local q = nv.randn({B, L, Hq, D}, {generator = g})
  local k = nv.randn({B, L, Hkv, D}, {generator = g})
  local v = nv.randn({B, L, Hkv, D}, {generator = g})
  -- a cache of S >= L rows: the first L are k, v; the rest garbage it must not read
  local kc, vc = nv.full({B, S, Hkv, D}, 1e30), nv.full({B, S, Hkv, D}, -1e30)
  kc:narrow(2, 1, L):copy_(k)
  vc:narrow(2, 1, L):copy_(v)
  local out, lse = T.with(nv.use_reference, true, core.attention_forward, q, k, v, 0.35)
  for _, ref in ipairs({true, false}) do -- the reference table, then the CPU table's entry
    T.with(nv.use_reference, ref, function()
      for _, p0 in ipairs({0, 4, 8}) do
        local Tq = L - p0
        local o, l = core.attention_forward_at(q:narrow(2, p0 + 1, Tq):contiguous(), kc, vc, p0, 0.35)
        T.eq(o:bytes(), out:narrow(2, p0 + 1, Tq):contiguous():bytes(), "out rows from " .. p0)
        T.eq(l:bytes(), lse:narrow(3, p0 + 1, Tq):contiguous():bytes(), "lse rows from " .. p0)
      end
    end)
  end
end)

T.case("attention_forward_at: bad inputs", function()
  local q, k = nv.zeros(1, 2, 4, 8), nv.zeros(1, 5, 2, 8)
  T.raises(function() core.attention_forward_at(q, k, k, 4, 1) end, "positions 4 .. 5 do not fit the 5 cached rows")
  T.raises(function() core.attention_forward_at(q, k, k, -1, 1) end, "do not fit")
  T.raises(function() core.attention_forward_at(q, nv.zeros(1, 5, 3, 8), nv.zeros(1, 5, 3, 8), 0, 1) end,
    "must be a positive multiple of Hkv")
  T.raises(function() core.attention_forward_at(q, k, nv.zeros(1, 4, 2, 8), 0, 1) end, "k and v must have one shape")
  T.raises(function() core.attention_forward_at(q, nv.zeros(2, 5, 2, 8), nv.zeros(2, 5, 2, 8), 0, 1) end,
    "q and k differ in B (dim 1)")
  T.raises(function() core.attention_forward_at(q, nv.zeros(1, 5, 2, 4), nv.zeros(1, 5, 2, 4), 0, 1) end,
    "q and k differ in D (dim 4)")
  T.raises(function() core.attention_forward_at(q:to("bf16"), k, k, 0, 1) end, "q must be f32")
  T.raises(function() core.attention_forward_at(q, k, k, 0, 0 / 0) end, "scale must be finite")
  T.raises(function() core.attention_forward_at(q, k, k, 0.5, 1) end, "number has no integer representation")
end)

-- ---- the KV cache ---------------------------------------------------------------------------------

T.case("kv cache, f32: prefill then one token at a time equals the full forward (GQA, batch 2)", function()
  local m = model()
  local full, parts, cache = full_and_cached(m, token_ids(2, 14), {5, 1, 1, 1, 1, 1, 1, 1, 1, 1})
  T.eq(parts[1][2]:size(), {2, 5, CFG.vocab_size}, "logits (B, T, V)")
  local w = check_close(full, parts, 1e-5, "f32")
  print(string.format("    f32: max |cached - full| = %.3g max|logit|", w))
  T.eq(cache.positions, 2 * 14, "every position ran once")
end)

T.case("kv cache, f32: chunks of several tokens, multi-head (kv heads = heads) and head_dim 16", function()
  local m = model({config = {num_key_value_heads = 4}})
  local full, parts = full_and_cached(m, token_ids(1, 20), {3, 4, 1, 7, 5})
  check_close(full, parts, 1e-5, "mha")
  local m2 = model({config = {num_attention_heads = 2, num_key_value_heads = 1}})
  full, parts = full_and_cached(m2, token_ids(1, 11), {2, 9})
  check_close(full, parts, 1e-5, "D 16, one kv head")
end)

T.case("kv cache: truncate and reuse a shared prefix", function()
  local m = model()
  local ctx, a, b = token_ids(1, 7, 1), token_ids(1, 4, 2), token_ids(1, 3, 3)
  local cache = m:kv_cache(16)
  m:forward(ctx, {cache = cache})
  local la = m:forward(a, {cache = cache})
  T.eq(cache.len, 11)
  T.eq(cache:truncate(7), cache)
  local lb = m:forward(b, {cache = cache})
  T.eq(cache.len, 10)
  local function cat(x, y)
    local t = {}
    for _, v in ipairs(x:totable()[1]) do t[#t + 1] = v end
    for _, v in ipairs(y:totable()[1]) do t[#t + 1] = v end
    return nv.tensor({t}, "i64")
  end
  for _, c in ipairs({{a, la}, {b, lb}}) do
    local full = m:forward(cat(ctx, c[1])):view(1, 7 + c[1]:size(2), CFG.vocab_size)
    check_close(full, {{7, c[2]}}, 1e-5, "continuation after the prefix")
  end
  -- truncate(0) starts over, and a new batch size is taken then
  cache:truncate(0)
  check_close(m:forward(token_ids(2, 3)):view(2, 3, CFG.vocab_size), {{0, m:forward(token_ids(2, 3), {cache = cache})}},
    1e-5, "after truncate(0), batch 2")
  cache:free()
  T.eq(cache.len, 0)
end)

T.case("kv cache, bf16 recipe: within bf16 rounding of the full forward", function()
  local m = model({recipe = recipe.bf16()})
  local full, parts = full_and_cached(m, token_ids(1, 16), {6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1})
  T.eq(parts[2][2]:dtype(), full:dtype())
  local w = check_close(full, parts, 2 ^ -5, "bf16")
  print(string.format("    bf16: max |cached - full| = %.3g max|logit| (allowed 2^-5)", w))
end)

T.case("kv cache, nvfp4 recipe: runs and stays close to the full forward", function()
  local m = model({recipe = recipe.nvfp4()})
  local full, parts = full_and_cached(m, token_ids(1, 12), {4, 1, 1, 1, 1, 1, 1, 1, 1})
  local worst = 0
  for _, p in ipairs(parts) do
    local d, mx = diff(p[2], full:narrow(2, p[1] + 1, p[2]:size(2)))
    worst = math.max(worst, d / mx)
  end
  print(string.format("    nvfp4: max |cached - full| = %.3g max|logit| (allowed 0.25)", worst))
  T.ok(worst <= 0.25, "nvfp4 cached logits within 25% of max|logit|: " .. worst)
  -- the prefill is the full forward's own computation on those positions: the same bits
  T.eq(parts[1][2]:bytes(), nv.scope(function() return m:forward(token_ids(1, 4)) end):bytes())
end)

T.case("kv cache: errors", function()
  local m = model()
  T.raises(function() m:kv_cache(33) end, "capacity must be an integer in 1 .. 32")
  T.raises(function() m:kv_cache(0) end, "capacity must be an integer")
  T.raises(function() m:kv_cache("8") end, "capacity must be an integer")
  local cache = m:kv_cache(8)
  m:forward(token_ids(1, 6), {cache = cache})
  T.raises(function() m:forward(token_ids(1, 3), {cache = cache}) end, "3 positions after the 6 cached exceed the cache's capacity 8")
  T.eq(cache.len, 6, "a refused forward leaves the cache as it was")
  T.raises(function() m:forward(token_ids(2, 1), {cache = cache}) end, "the cache holds 6 positions of a batch of 1")
  T.raises(function() cache:truncate(7) end, "n must be an integer in 0 .. 6")
  T.raises(function() m:forward(token_ids(1, 1), {cache = model({seed = 2}):kv_cache()}) end, "this model's model:kv_cache()")
  T.raises(function() m:forward(token_ids(1, 1), {cache = {}}) end, "cache must be this model's")
  T.raises(function() m:forward(token_ids(1, 1), {cahce = cache}) end, "cahce")
  T.raises(function() m:forward(nv.zeros(1, 2), {cache = cache}) end, "ids must be an i64 [B, T] tensor")
  m:train()
  T.raises(function() m:forward(token_ids(1, 1), {cache = cache}) end, "eval mode only")
  m:eval()
end)

-- ---- generation ------------------------------------------------------------------------------------

local data = require "nvlua.data"
local train = require "nvlua.train"
local BYTES = data.ByteTokenizer

-- a byte-vocabulary model: data.ByteTokenizer's ids
local function byte_model(o)
  o = o or {}
  return model({config = {vocab_size = 256}, recipe = o.recipe, seed = o.seed})
end

-- argmax of a Lua array (the first of equal ones), 0-based
local function argmax(row)
  local best = 1
  for i = 2, #row do if row[i] > row[best] then best = i end end
  return best - 1
end

T.case("generate, greedy: token for token the greedy decoding by repeated full forwards (f32)", function()
  local m = byte_model()
  local text, ids, stop = m:generate(BYTES, "And the", {max_new_tokens = 12, temperature = 0})
  T.eq(#ids, 12)
  T.eq(stop, "max_new_tokens")
  T.eq(text, BYTES:decode(ids))
  local ctx = BYTES:encode("And the")
  for i = 1, 12 do
    local logits = m:forward(nv.tensor({ctx}, "i64"))                    -- (T, V)
    local want = argmax(logits:select(1, #ctx):totable())
    T.eq(ids[i], want, "token " .. i)
    ctx[#ctx + 1] = want
  end
end)

T.case("generate: positions processed are prompt + new - 1, not quadratic", function()
  local m = byte_model()
  local seen, calls = 0, 0
  local fwd = m.embed_tokens.forward
  m.embed_tokens.forward = function(self, ids) seen, calls = seen + ids:numel(), calls + 1; return fwd(self, ids) end
  local _, ids = m:generate(BYTES, "In the beginning", {max_new_tokens = 10, temperature = 0})
  m.embed_tokens.forward = nil
  T.eq(#ids, 10)
  T.eq(seen, 16 + 10 - 1, "16 prompt positions once, then one per new token but the last")
  T.eq(calls, 10, "one prefill, then one forward per token")
end)

T.case("generate: sampling is deterministic from the seed; top_k = 1 is greedy", function()
  local m = byte_model()
  local o = {max_new_tokens = 16, temperature = 1, top_k = 50, seed = 7}
  local t1, i1 = m:generate(BYTES, "And ", o)
  local t2, i2 = m:generate(BYTES, "And ", o)
  T.eq(i1, i2)
  T.eq(t1, t2)
  local _, i3 = m:generate(BYTES, "And ", {max_new_tokens = 16, temperature = 1, top_k = 50, seed = 8})
  T.ok(not T.deep_eq(i1, i3), "another seed, other tokens")
  local _, g = m:generate(BYTES, "And ", {max_new_tokens = 16, temperature = 0})
  local _, k1 = m:generate(BYTES, "And ", {max_new_tokens = 16, temperature = 0.7, top_k = 1, seed = 3})
  T.eq(k1, g)
end)

T.case("generate: stops at the tokenizer's eos and at the context limit, and says which", function()
  local m = byte_model()
  local _, g = m:generate(BYTES, "And ", {max_new_tokens = 8, temperature = 0})
  local tok = setmetatable({eos_id = g[3]}, {__index = BYTES})
  local text, ids, stop = m:generate(tok, "And ", {max_new_tokens = 8, temperature = 0})
  T.eq(stop, "eos")
  local first = 1
  while g[first] ~= g[3] do first = first + 1 end -- the eos may come before its place 3
  T.eq(ids, {table.unpack(g, 1, first)}, "the tokens up to the eos, the eos last")
  T.eq(text, BYTES:decode({table.unpack(g, 1, first - 1)}), "text without the eos")
  -- 30 prompt tokens in a context of 32: positions 30 and 31 take two more, 3 new tokens in all
  local prompt = string.rep("ab", 15)
  local _, c, why = m:generate(BYTES, prompt, {max_new_tokens = 10, temperature = 0})
  T.eq(why, "context")
  T.eq(#c, 3)
  T.eq(select(3, m:generate(BYTES, "a", {max_new_tokens = 0})), "max_new_tokens")
  T.eq(#select(2, m:generate(BYTES, "a", {max_new_tokens = 0})), 0)
end)

T.case("generate, nvfp4 and bf16 recipes: run, deterministic", function()
  for _, r in ipairs({recipe.bf16(), recipe.nvfp4()}) do
    local m = byte_model({recipe = r})
    local _, a = m:generate(BYTES, "And ", {max_new_tokens = 6, seed = 2})
    local _, b = m:generate(BYTES, "And ", {max_new_tokens = 6, seed = 2})
    T.eq(#a, 6)
    T.eq(a, b)
  end
end)

T.case("generate, fp8_delayed: the recipe's state is restored, so generating repeats and leaves training as it was", function()
  local m = byte_model({recipe = recipe.fp8_delayed()})
  m:forward(token_ids(1, 5)) -- a history to keep
  local r = m.layers[1].self_attn.q_proj.recipe
  local before = r:state()
  T.ok(next(before.histories) ~= nil, "the forward left amax histories")
  local _, a = m:generate(BYTES, "And ", {max_new_tokens = 6, seed = 2})
  T.eq(r:state(), before, "histories, generator offset as before")
  -- a cached forward alone pushes to the histories (as every eval forward does): the restore is real
  m:forward(token_ids(1, 2), {cache = m:kv_cache()})
  T.ok(not T.deep_eq(r:state(), before), "a forward changes the histories")
  local _, b = m:generate(BYTES, "And ", {max_new_tokens = 6, seed = 2})
  T.eq(a, b)
end)

T.case("generate: bad input", function()
  local m = byte_model()
  T.raises(function() m:generate(BYTES, 42) end, "the prompt must be a string, got number")
  T.raises(function() m:generate(BYTES, nil) end, "the prompt must be a string, got nil")
  T.raises(function() m:generate(nil, "x") end, "tok must be a tokenizer with encode and decode")
  T.raises(function() m:generate({}, "x") end, "tok must be a tokenizer")
  T.raises(function() m:generate(BYTES, "x", {max_new_tokens = -1}) end, "max_new_tokens")
  T.raises(function() m:generate(BYTES, "x", {max_new_tokens = 1.5}) end, "max_new_tokens")
  T.raises(function() m:generate(BYTES, "x", {temperature = "hot"}) end, "temperature")
  T.raises(function() m:generate(BYTES, "x", {temperature = 0 / 0}) end, "temperature")
  T.raises(function() m:generate(BYTES, "x", {top_k = 0}) end, "top_k")
  T.raises(function() m:generate(BYTES, "x", {max_tokens = 3}) end, "max_tokens")
  T.raises(function() m:generate(BYTES, "") end, "the prompt encodes to no tokens")
  T.raises(function() m:generate(BYTES, string.rep("a", 32)) end, "the prompt is 32 tokens")
  local small = model() -- a vocabulary of 64: bytes >= 64 are not its ids
  T.raises(function() small:generate(BYTES, "z") end, "prompt token 1 is 122, not an id of the model's vocabulary (0 .. 63)")
  -- the mode is kept: a training model generates in eval mode and is put back
  m:train()
  m:generate(BYTES, "x", {max_new_tokens = 2})
  T.eq(m.training, true)
end)

T.case("train.sample: model:generate from a text prompt or ids; without a tokenizer the ids", function()
  local m = byte_model()
  local o = {temperature = 0.8, top_k = 10, seed = 4}
  local text = train.sample(m, BYTES, "And ", 10, o)
  T.eq(text, (m:generate(BYTES, "And ", {max_new_tokens = 10, temperature = 0.8, top_k = 10, seed = 4})))
  T.eq(train.sample(m, BYTES, {65, 110, 100, 32}, 10, o), text, "the same prompt as ids")
  local ids = select(2, m:generate(BYTES, "And ", {max_new_tokens = 10, temperature = 0.8, top_k = 10, seed = 4}))
  T.eq(train.sample(m, nil, {65, 110, 100, 32}, 10, o), table.concat(ids, " "))
  T.raises(function() train.sample(m, nil, "And ", 10, o) end, "without a tokenizer the prompt must be token ids")
  T.eq({train.sample_prompt(BYTES)}, {"And ", "And "})
  T.eq({train.sample_prompt(BYTES, "In the")}, {"In the", "In the"})
end)

T.case("pick_token: the top-k selection (no sort of the vocabulary) draws what a full sort's top k draws, ties included",
  function()
  local llama = require "nvlua.llama"
  local g = nv.Generator(5)
  for trial = 1, 100 do
    local V = 1 + trial % 97
    local r = nv.rand(V, {generator = g}):totable()
    local row = {}
    for i = 1, V do row[i] = math.floor(r[i] * 8) / 8 end -- 8 levels: many ties
    local idx = {}
    for i = 1, V do idx[i] = i end
    table.sort(idx, function(a, b) if row[a] ~= row[b] then return row[a] > row[b] end return a < b end)
    for _, k in ipairs({1, 3, 40, 200}) do
      local kk = math.min(k, V)
      local w, z = {}, 0
      for i = 1, kk do w[i] = math.exp((row[idx[i]] - row[idx[1]]) / 0.7); z = z + w[i] end
      local u = nv.rand(1, {generator = nv.Generator(trial)}):get(1) * z
      local want = idx[kk]
      for i = 1, kk do u = u - w[i]; if u <= 0 then want = idx[i]; break end end
      T.eq(llama.pick_token(row, {top_k = k, temperature = 0.7}, nv.Generator(trial)), want - 1,
        string.format("V %d, k %d", V, k))
    end
  end
end)
