-- tests/test_prune.lua: structured pruning (lua/nvlua/prune.lua).
--   * importance on a hand-built model whose answer is known: dead FFN neurons (zero gate and up
--     rows) score exactly 0 and a boosted one scores highest; a KV group with zero v rows scores 0
--     with every query head in it; a channel zeroed in every norm's weight scores 0; a block whose
--     o_proj and down_proj are zero (the identity on the residual stream) has block influence 0, the
--     least; one neuron's score equals Minitron's aggregate computed here from its activation;
--   * width: the pruned model's logits equal, bit for bit, the original's with the pruned units
--     zeroed (FFN neurons: their down_proj columns; heads and KV groups: their o_proj columns), with
--     the scalar reference kernels (sequential sums, where a zero term changes nothing);
--   * depth: the pruned model equals the original run through the kept blocks only, bit for bit;
--   * the pruned models save as Hugging Face checkpoints nvlua loads back (transformers loads them in
--     scripts/check_hf_roundtrip.py); bad options.
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local prune = require "nvlua.prune"
local hf = require "nvlua.hf"

local CFG = {vocab_size = 48, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 3, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 32}

local function model() return llama.Llama(CFG, {seed = 5}) end

local function ids(seed, B, T_)
  nv.manual_seed(seed)
  return (nv.rand(B or 2, T_ or 16) * (CFG.vocab_size - 1)):to("i64")
end

local function P(m, name)
  for _, e in ipairs(m:named_parameters()) do if e.name == name then return e.param end end
  error("no parameter " .. name)
end

local function same(a, b, what)
  T.eq(a:size(), b:size(), what .. ": shape")
  T.ok(a:bytes() == b:bytes(), what .. ": bits")
end

T.case("importance: known answers on a hand-built model", function()
  local m = model()
  local L = "model.layers."
  -- block 0: neurons 3 and 10 dead, neuron 7 boosted
  for _, i in ipairs({3, 10}) do
    P(m, L .. "0.mlp.gate_proj.weight"):narrow(1, i, 1):fill_(0)
    P(m, L .. "0.mlp.up_proj.weight"):narrow(1, i, 1):fill_(0)
  end
  P(m, L .. "0.mlp.up_proj.weight"):narrow(1, 7, 1):mul_(50)
  -- block 1: KV group 2 (query heads 3, 4) sees zero values
  P(m, L .. "1.self_attn.v_proj.weight"):narrow(1, 9, 8):fill_(0)
  -- channel 5 zero in every norm
  for _, e in ipairs(m:named_parameters()) do
    if e.name:find("norm") then e.param:narrow(1, 5, 1):fill_(0) end
  end
  -- block 2: the identity on the residual stream
  P(m, L .. "2.self_attn.o_proj.weight"):fill_(0)
  P(m, L .. "2.mlp.down_proj.weight"):fill_(0)
  local x = ids(1)
  local imp = prune.importance(m, {x, ids(2)})
  local f = imp.ffn[0]:totable()
  T.eq(f[3], 0)
  T.eq(f[10], 0)
  local best = 1
  for i = 2, #f do if f[i] > f[best] then best = i end end
  T.eq(best, 7, "the boosted neuron")
  local h = imp.heads[1]:totable()
  T.eq({h[3], h[4]}, {0, 0}, "the query heads of the zero-value group")
  T.ok(h[1] > 0 and h[2] > 0)
  T.eq(imp.kv[1]:totable()[2], 0)
  T.eq(imp.hidden:totable()[5], 0, "the channel every norm zeroes")
  T.near(imp.blocks[2], 0, 1e-6, "the identity block's influence")
  T.ok(imp.blocks[0] > 1e-3 and imp.blocks[1] > 1e-3)
  -- one score by hand: neuron 1 of block 0 over batch x alone = sqrt(sum_b (mean_t |h|)^2)
  local one = prune.importance(m, x)
  local hcap
  local rec = nv.recipe.f32()
  rec:trace(function(e) if e.role == "fprop" and e.ctx.name == L .. "0.mlp.down_proj" then hcap = e.a:totable() end end)
  m:set_recipe(rec)
  m:eval()
  nv.scope(function() m:forward(x) end)
  local s = 0
  for b = 0, 1 do
    local t = 0
    for i = 1, 16 do t = t + math.abs(hcap[b * 16 + i][1]) end
    s = s + (t / 16) ^ 2
  end
  T.near(one.ffn[0]:totable()[1], math.sqrt(s), 1e-5 * math.sqrt(s), "Minitron's aggregate")
end)

-- logits of m on x with the scalar reference kernels (sums in index order)
local function logits(m, x)
  return T.with(nv.use_reference, true, function() return nv.unscope(m:forward(x)) end)
end

T.case("width: the pruned model = the original with the pruned units zeroed, bit for bit", function()
  local m = model()
  local x = ids(3)
  local imp = prune.importance(m, x)
  -- drop 1 of 2 KV groups, keep 1 of its 2 heads... i.e. heads 1 of 4 per the scores; ffn 64 -> 40
  local small = prune.width(m, imp, {ffn = 40, heads = 2, kv_heads = 1})
  T.eq({small.config.intermediate_size, small.config.num_attention_heads, small.config.num_key_value_heads,
    small.config.head_dim, small.config.hidden_size}, {40, 2, 1, 8, 32})
  -- the original with the same units zeroed: what prune kept, read off the scores the same way
  local z = model()
  for b = 0, 2 do
    local p = "model.layers." .. b .. "."
    local f, kept = imp.ffn[b]:totable(), {}
    local idx = {}
    for i = 1, #f do idx[i] = i end
    table.sort(idx, function(a, c) if f[a] ~= f[c] then return f[a] > f[c] end return a < c end)
    for i = 1, 40 do kept[idx[i]] = true end
    for i = 1, 64 do if not kept[i] then P(z, p .. "mlp.down_proj.weight"):narrow(2, i, 1):fill_(0) end end
    local kv = imp.kv[b]:totable()
    local g = kv[1] >= kv[2] and 1 or 2 -- the kept group; in it both query heads are kept (2 of 2)
    local o = P(z, p .. "self_attn.o_proj.weight")
    o:narrow(2, (2 - g) * 16 + 1, 16):fill_(0) -- the other group's two heads (8 columns each)
  end
  same(logits(small, x), logits(z, x), "logits")
end)

T.case("width: hidden channels and heads within groups; the tied LM head stays tied", function()
  local cfg = {}
  for k, v in pairs(CFG) do cfg[k] = v end
  cfg.tie_word_embeddings = true
  local m = llama.Llama(cfg, {seed = 6})
  local imp = prune.importance(m, ids(4))
  local small = prune.width(m, imp, {hidden = 24, heads = 2})
  T.eq(small.config.hidden_size, 24)
  T.eq(small.config.num_key_value_heads, 2, "both groups, one query head each")
  T.eq(small.config.tie_word_embeddings, true)
  T.eq(P(small, "model.embed_tokens.weight"):size(), {48, 24})
  local loss = small:loss(ids(4), ids(5))
  T.ok(loss == loss and loss > 0, "the pruned model runs")
  T.raises(function() prune.width(m, imp, {heads = 3}) end, "heads (3) must be a multiple of kv_heads (2)")
  T.raises(function() prune.width(m, imp, {ffn = 65}) end, "ffn must be an integer in 1..64")
  T.raises(function() prune.width(m, imp, {width = 2}) end, "unknown option 'width'")
  T.raises(function() prune.width(m, imp, {heads = 4, kv_heads = 1}) end, "4 query heads per KV group, more than the model's 2")
end)

T.case("depth: the kept blocks, in order, bit for bit; saved and loaded as a Hugging Face checkpoint", function()
  local m = model()
  local x = ids(7)
  local imp = prune.importance(m, x)
  local small, keep = prune.depth(m, imp, {layers = 2})
  T.eq(small.config.num_hidden_layers, 2)
  T.eq(#keep, 2)
  local want = nv.scope(function()
    m:eval()
    local h = m.embed_tokens:forward(x)
    for _, k in ipairs(keep) do h = m.layers[k]:forward(h) end
    return m.lm_head:forward(m.norm:forward(h:view(x:numel(), CFG.hidden_size)))
  end)
  small:eval()
  same(small:forward(x), want, "logits")
  local dir = T.tmpdir()
  hf.save_pretrained(small, dir)
  local back = hf.from_pretrained(dir)
  T.eq(back.config.num_hidden_layers, 2)
  back:eval()
  same(back:forward(x), want, "the saved checkpoint's logits")
  T.raises(function() prune.depth(m, imp, {layers = 4}) end, "layers must be an integer in 1..3")
end)
