-- tests/test_distill.lua: knowledge distillation (core.distill_loss, Llama:forward_backward{distill},
-- the training loop's teacher= keys).
--   * the loss against a double-precision implementation written here (softmaxes, KL, CE over the
--     counted rows), ignored rows, bad inputs;
--   * the gradient against central finite differences of the loss: logits on a 2^-8 grid and a step
--     of 2^-10, so every perturbed input is exact in f32; the loss is computed in double, so the gap
--     is the O(h^2) truncation (~1e-6 of the gradient here) and the gradient's f32 rounding: checked
--     to 1e-4 of the largest gradient entry;
--   * alpha = 0 is the cross-entropy's gradient bit for bit; the chunked LM head equals the whole one
--     (gradients bit for bit but the head's weight's, within fp32 reordering; the loss to 1e-13: the
--     chunks' means add in another grouping);
--     the teacher is left untouched; a student head that cannot be chunked runs whole while the
--     teacher's logits still come in chunks, with the same result.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local llama = require "nvlua.llama"

-- s, t as Lua tables (rows), targets (0-based, -100 ignored) -> kl, ce means over the counted rows
local function reference(s, t, tg, Tm, alpha)
  local kl, ce, n = 0, 0, 0
  for i, row in ipairs(s) do
    if tg[i] ~= -100 then
      n = n + 1
      local function lse(x, tt)
        local m = -math.huge
        for _, v in ipairs(x) do m = math.max(m, v / tt) end
        local z = 0
        for _, v in ipairs(x) do z = z + math.exp(v / tt - m) end
        return m + math.log(z)
      end
      local ls, lt, l1 = lse(row, Tm), lse(t[i], Tm), lse(row, 1)
      for v = 1, #row do
        local lpt = t[i][v] / Tm - lt
        kl = kl + math.exp(lpt) * (lpt - (row[v] / Tm - ls))
      end
      ce = ce + l1 - row[tg[i] + 1]
    end
  end
  return kl / n, ce / n
end

local function grid(rows, V, seed)
  nv.manual_seed(seed)
  return ((nv.randn(rows, V) * 512):to("i64"):to("f32")) * (1 / 256) -- multiples of 2^-8
end

T.case("distill_loss: KL and CE against double precision; ignored rows; bad inputs", function()
  local s, t = grid(5, 11, 1), grid(5, 11, 2)
  local tg = {3, -100, 0, 10, 7}
  local tgt = nv.tensor(tg):to("i64")
  for _, c in ipairs({{1, 0.5}, {2, 0.9}, {0.5, 0.1}}) do
    local kl, ce, n, d = core.distill_loss(s, t, tgt, {temperature = c[1], alpha = c[2]})
    local rk, rc = reference(s:totable(), t:totable(), tg, c[1], c[2])
    T.near(kl, rk, 1e-12 * math.max(1, rk), "KL at T = " .. c[1])
    T.near(ce, rc, 1e-12 * rc, "CE at T = " .. c[1])
    T.eq(n, 4)
    T.eq(d:narrow(1, 2, 1):abs():sum(), 0, "the ignored row's gradient")
  end
  T.raises(function() core.distill_loss(s, t, tgt, {temperature = 0}) end, "the temperature must be > 0")
  T.raises(function() core.distill_loss(s, t, tgt, {alpha = 1.5}) end, "alpha must be in [0, 1]")
  T.raises(function() core.distill_loss(s, grid(5, 10, 3), tgt) end, "must be (N, V) of one shape")
  T.raises(function() core.distill_loss(s, t, nv.tensor({1, 2}):to("i64")) end, "targets")
  T.raises(function() core.distill_loss(s, t, tgt, {temprature = 2}) end, "temprature")
end)

T.case("distill_loss: the gradient against central finite differences", function()
  local s, t = grid(3, 9, 4), grid(3, 9, 5)
  local tgt = nv.tensor({2, 8, 0}):to("i64")
  local Tm, alpha, h = 2, 0.7, 2.0 ^ -10
  local function L(x)
    local kl, ce = core.distill_loss(x, t, tgt, {temperature = Tm, alpha = alpha, grad = false})
    return alpha * Tm * Tm * kl + (1 - alpha) * ce
  end
  local _, _, _, d = core.distill_loss(s, t, tgt, {temperature = Tm, alpha = alpha})
  local g, maxg = d:totable(), d:abs():max()
  for i = 1, 3 do
    for v = 1, 9 do
      local xp, xm = s:clone(), s:clone()
      xp:set(i, v, s:get(i, v) + h)
      xm:set(i, v, s:get(i, v) - h)
      local fd = (L(xp) - L(xm)) / (2 * h)
      T.near(g[i][v], fd, 1e-4 * maxg, string.format("d loss / d s[%d,%d]", i, v))
    end
  end
end)

T.case("alpha = 0 is the cross-entropy's gradient bit for bit", function()
  local s, t = grid(4, 13, 6), grid(4, 13, 7)
  local tgt = nv.tensor({1, 5, -100, 12}):to("i64")
  local _, ce, _, d = core.distill_loss(s, t, tgt, {alpha = 0, temperature = 3})
  local loss, _, dc = T.with(nv.use_reference, true, function() return core.cross_entropy(s, tgt) end)
  T.ok(d:bytes() == dc:bytes(), "the gradients' bits")
  T.near(ce, loss, 1e-15 * loss)
end)

local CFG = {vocab_size = 40, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 32}

T.case("Llama:forward_backward with a teacher: chunked = whole, the teacher untouched", function()
  local cfg_t = {}
  for k, v in pairs(CFG) do cfg_t[k] = v end
  cfg_t.hidden_size, cfg_t.num_hidden_layers = 48, 3 -- another shape; the vocabulary must match
  local teacher = llama.Llama(cfg_t, {seed = 1, recipe = nv.recipe.bf16()})
  local before = {}
  for _, e in ipairs(teacher:named_parameters()) do before[e.name] = e.param:bytes() end
  nv.manual_seed(2)
  local ids, tg = (nv.rand(2, 16) * 39):to("i64"), (nv.rand(2, 16) * 39):to("i64")
  local res = {}
  for _, chunk in ipairs({0, 7}) do
    local s = llama.Llama(CFG, {seed = 3, recipe = nv.recipe.bf16()})
    local loss = s:forward_backward(ids, tg, {distill = {teacher = teacher, temperature = 2, alpha = 0.6},
      loss_chunk = chunk})
    local g = {}
    for _, e in ipairs(s:named_parameters()) do g[e.name] = e.grad end
    res[#res + 1] = {loss = loss, parts = s.distill_parts, g = g, model = s}
  end
  -- the loss: the chunks' means add in double in another grouping (a few ulps); the gradients are per row
  T.near(res[1].loss, res[2].loss, 1e-13 * res[1].loss, "the loss")
  T.near(res[1].loss, 0.6 * 4 * res[1].parts.kl + 0.4 * res[1].parts.ce, 1e-12)
  -- the LM head's weight gradient sums dY^T X over the tokens chunk by chunk: within two fp32
  -- summation orders of N = 32 terms, 2 N u sum |dY||X| (u = 2^-24; test_nn.lua's bound); every
  -- other gradient bit for bit
  local m0 = res[1].model
  m0:eval()
  teacher:eval()
  local h, ht = m0:_hidden(ids), teacher:_hidden(ids)
  local _, _, _, d = core.distill_loss(m0.lm_head:forward(h), teacher.lm_head:forward(ht), tg:reshape(32),
    {temperature = 2, alpha = 0.6})
  teacher:train()
  local bound = d:to("bf16"):to("f32"):abs():transpose(1, 2):matmul(h:to("f32"):abs()) * (2 * 32 * 2.0 ^ -24)
  for k, v in pairs(res[1].g) do
    if k == "lm_head.weight" then
      local diff = (res[2].g[k] - v):abs()
      T.ok(diff:le(bound):sum() == diff:numel(), "lm_head.weight within the fp32 reordering bound")
    else
      T.ok(res[2].g[k]:bytes() == v:bytes(), "gradient of " .. k)
    end
  end
  for _, e in ipairs(teacher:named_parameters()) do
    T.ok(e.param:bytes() == before[e.name], "teacher parameter " .. e.name)
    T.eq(e.grad:abs():sum(), 0, "teacher gradient " .. e.name)
  end
  T.eq(teacher.training, true, "the teacher's mode is put back")
  local other = llama.Llama({vocab_size = 41, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1,
    num_attention_heads = 4, max_position_embeddings = 32}, {seed = 1})
  local s = llama.Llama(CFG, {seed = 3})
  T.raises(function() s:forward_backward(ids, tg, {distill = {teacher = other}}) end, "the student's vocabulary")
  T.raises(function() s:forward_backward(ids, tg, {distill = {teacher = teacher}, z_loss = 1e-4}) end,
    "z_loss does not combine with distill")
end)

T.case("a student head that cannot be chunked: whole logits, the teacher's in chunks, the same result", function()
  local teacher = llama.Llama(CFG, {seed = 1, recipe = nv.recipe.bf16()})
  nv.manual_seed(4)
  local ids, tg = (nv.rand(2, 16) * 39):to("i64"), (nv.rand(2, 16) * 39):to("i64")
  local function run(chunk)
    -- an e4m3 LM head (one amax over all the tokens: not chunkable), bf16 elsewhere
    local rec = nv.recipe.custom(function(c) return c.high_precision and "e4m3" or "bf16" end, {act_dtype = "bf16"})
    local s = llama.Llama(CFG, {seed = 3, recipe = rec})
    T.ok(not s:_head_chunkable())
    local loss = s:forward_backward(ids, tg, {distill = {teacher = teacher, temperature = 1.5, alpha = 0.4},
      loss_chunk = chunk})
    local g = {}
    for _, e in ipairs(s:named_parameters()) do g[e.name] = e.grad:bytes() end
    return loss, g
  end
  local l0, g0 = run(0)
  local l1, g1 = run(5)
  T.near(l1, l0, 1e-13 * l0, "the loss")
  for k, v in pairs(g0) do T.ok(g1[k] == v, "gradient of " .. k .. " bit for bit (one student head pass)") end
end)
