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
