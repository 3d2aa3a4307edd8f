-- tests/test_mor.lua: MoR (lua/nvlua/mor.lua, recipe.mor; NUMERICS §12) on the CPU:
--   * the decision per granularity against hand-computed cases (tests/mor_cases.lua: errors 0,
--     1/17, 1/19 from e4m3's round-to-nearest-even ties), at two thresholds;
--   * the mixed-representation operand holds exactly the chosen blocks' values, and its GEMM equals
--     the exact product of those values (inputs whose sums fp32 gets exactly in any order);
--   * an injected block of tiny values falls back exactly where the error, computed here in double
--     from the quantizer's own output at the power-of-two scale worked out here, exceeds the threshold;
--   * the tiered candidates (nvfp4, then e4m3, then bf16), decide replaced, its bad results;
--   * end to end: threshold +inf trains bit for bit as fp8_cs (e4m3), a decide choosing bf16 as bf16; the counters
--     (nv.stats, the training log) and the plan; bad options.
-- Resume with MoR state: tests/test_train.lua.
local T = require "nvlua.test"
local nv = require "nvlua"
local recipe = require "nvlua.recipe"
local mor = require "nvlua.mor"
local stats = require "nvlua.stats"
local llama = require "nvlua.llama"

local C = dofile("tests/mor_cases.lua")

local same_values, tbl = C.same_values, C.tbl

T.case("per block: the hand-computed choices at two thresholds, the mixed values, the shares", function()
  local x = nv.tensor(C.A())
  for _, tau in ipairs({0.04, 0.055}) do
    local r = mor.choose(x, {granularity = "block", threshold = tau})
    local want = C.expected_choice(C.A_KINDS, tau)
    same_values(tbl(r.choice), want, "choice at " .. tau)
    T.eq(r.label, "mor")
    T.eq(r.q:format(), "bf16")
    same_values(tbl(r.q:dequantize()), C.mixed(C.A(), want), "mixed values at " .. tau)
    local e = tbl(r.errs[1])
    T.near(e[1][2], 1 / 17, 1e-6, "r1 b2's error")
    T.near(e[2][2], 1 / 19, 1e-6, "r2 b2's error")
    T.eq(e[1][1], 0, "r1 b1 is exact")
    -- the counts: blocks and elements per format
    local s = r.counts["x|fprop|x"]
    local n_bf16 = tau == 0.04 and 2 or 1
    T.eq(s.units, {e4m3 = 4 - n_bf16, bf16 = n_bf16})
    T.eq(s.elems, {e4m3 = (4 - n_bf16) * 128, bf16 = n_bf16 * 128})
  end
end)

T.case("per tensor: the same tensor stays e4m3 (its bad blocks hide in the whole), with TE's scale", function()
  local xs = C.A()
  local x = nv.tensor(xs)
  -- by hand: the squared errors 128/256 (r1 b2) + 1/256 (r2 b1) + 128/256 (r2 b2) over sum x^2
  local n2 = 0
  for _, row in ipairs(xs) do for _, v in ipairs(row) do n2 = n2 + v * v end end
  local err = math.sqrt((257 / 256) / n2)
  local r = mor.choose(x, {threshold = 0.04})
  T.eq(r.label, "e4m3")
  T.near(tbl(r.errs[1])[1][1], err, 1e-6 * err, "the tensor's relative L2 error")
  T.eq(r.q.scale, 64.0, "TE's current scaling: 448 / 7")
  -- a threshold just below the error: bf16, the tensor itself
  local r2 = mor.choose(x, {threshold = err * 0.99})
  T.eq(r2.label, "bf16")
  same_values(tbl(r2.q:dequantize()), xs, "the bf16 fallback")
  T.eq(r2.counts["x|fprop|x"].units, {bf16 = 1})
end)

T.case("the mixed GEMM equals the exact product of the chosen values, bit for bit", function()
  local a, b = nv.tensor(C.A()), nv.tensor(C.Bm())
  local ra = mor.choose(a, {granularity = "block"})
  local rb = mor.choose(b, {granularity = "block"})
  local wa, wb = C.expected_choice(C.A_KINDS, 0.04), C.expected_choice(C.B_KINDS, 0.04)
  same_values(tbl(rb.choice), wb, "B's choices")
  local want = C.product(C.mixed(C.A(), wa), C.mixed(C.Bm(), wb))
  same_values(tbl(nv.qmatmul(ra.q, rb.q)), want, "qmatmul(mixed, mixed)")
  -- dequantize-then-matmul gives the same
  same_values(tbl(ra.q:dequantize():matmul(rb.q:dequantize():transpose())), want, "dequantize then matmul")
  -- blocked along the other axis (wgrad's layout): the same choices on the transpose
  local rt = mor.choose(a:transpose():contiguous(), {granularity = "block", axis = 1})
  same_values(tbl(rt.choice), wa, "choices along axis 1")
end)

-- the error of every 1 x B block of x (a Lua table) against its round trip y, in double
local function block_errors(x, y, B)
  local out = {}
  for i = 1, #x do
    out[i] = {}
    for b = 1, #x[i] // B do
      local e2, n2 = 0, 0
      for k = (b - 1) * B + 1, b * B do
        e2, n2 = e2 + (y[i][k] - x[i][k]) ^ 2, n2 + x[i][k] ^ 2
      end
      out[i][b] = n2 > 0 and math.sqrt(e2 / n2) or 0
    end
  end
  return out
end

T.case("an injected block of tiny values falls back exactly where the metric says", function()
  nv.manual_seed(5)
  local R, K, B, tau = 16, 512, 128, 0.04
  local x = nv.randn(R, K)
  x:narrow(1, 4, 1):narrow(2, 2 * B + 1, B):mul_(2.0 ^ -16) -- row 4, block 3: below e4m3's reach
  x:narrow(1, 9, 1):narrow(2, 1, B):mul_(2.0 ^ -13)          -- row 9, block 1: in e4m3's subnormals
  local r = mor.choose(x, {granularity = "block", threshold = tau})
  -- the power-of-two scale by hand: the largest 2^k with amax * 2^k <= 448
  local xs = tbl(x)
  local amax = 0
  for _, row in ipairs(xs) do for _, v in ipairs(row) do amax = math.max(amax, math.abs(v)) end end
  local k = math.floor(math.log(448 / amax, 2))
  if amax * 2.0 ^ (k + 1) <= 448 then k = k + 1 end
  if amax * 2.0 ^ k > 448 then k = k - 1 end
  local q = nv.quantize(x, "e4m3", {amax = 448 * 2.0 ^ -k})
  T.eq(q.scale, 2.0 ^ k, "the scale is the power of two")
  local errs = block_errors(xs, tbl(q:dequantize()), B)
  local choice, fell = tbl(r.choice), 0
  for i = 1, R do
    for b = 1, K // B do
      local e = errs[i][b]
      T.ok(math.abs(e - tau) > 0.01 * tau, string.format("block %d,%d's error %.5f is clear of the threshold", i, b, e))
      T.eq(choice[i][b], e <= tau and 1 or 2, string.format("block %d,%d (error %.5f)", i, b, e))
      if e > tau then fell = fell + 1 end
    end
  end
  T.eq(choice[4][3], 2, "the tiny block falls back")
  T.eq(choice[9][1], 2, "the subnormal block falls back")
  T.eq(fell, 2, "and nothing else")
end)

T.case("tiered: nvfp4 where its error is within, else e4m3, else bf16; decide replaced", function()
  nv.manual_seed(6)
  local x = nv.randn(8, 256)
  x:narrow(1, 2, 1):narrow(2, 129, 128):mul_(2.0 ^ -20) -- below nvfp4's reach, and e4m3's
  local r = mor.choose(x, {granularity = "block", candidates = {"nvfp4", "e4m3"}, threshold = {nvfp4 = 0.15, e4m3 = 0.04}})
  T.eq(r.formats, {"nvfp4", "e4m3", "bf16"})
  local ch, e1, e2 = tbl(r.choice), tbl(r.errs[1]), tbl(r.errs[2])
  local n = {0, 0, 0}
  for i = 1, 8 do
    for b = 1, 2 do
      local want = e1[i][b] <= 0.15 and 1 or (e2[i][b] <= 0.04 and 2 or 3)
      T.eq(ch[i][b], want, string.format("block %d,%d (errors %.4f, %.4f)", i, b, e1[i][b], e2[i][b]))
      n[want] = n[want] + 1
    end
  end
  T.eq(ch[2][2], 3, "the tiny block: bf16")
  T.ok(n[1] > 0, "some blocks in nvfp4")
  -- every nvfp4 block's values are bf16 values (the power-of-two global scale)
  local v = r.q:dequantize()
  T.eq(v:to("bf16"):to("f32"):eq(v):sum(), v:numel())
  -- a replaced decision: everything to the second candidate
  local seen
  local r2 = mor.choose(x, {granularity = "block", candidates = {"nvfp4", "e4m3"},
    decide = function(d) seen = d; return nv.full(d.errs[1]:size(), 2) end})
  T.eq(r2.counts["x|fprop|x"].units, {e4m3 = 16})
  T.eq(seen.granularity, "block")
  T.eq(seen.thresholds, {0.15, 0.04})
  T.eq(seen.ctx.role, "fprop")
  -- its bad answers
  T.raises(function() mor.choose(x, {decide = function() return 1 end}) end, "decide must return a tensor")
  T.raises(function() mor.choose(x, {decide = function() return nv.full({1, 1}, 3) end}) end,
    "decide returned values outside 1..2")
  T.raises(function() mor.choose(x, {granularity = "block", decide = function() return nv.full({1, 1}, 1) end}) end,
    "decide returned a 1x1 tensor for 8x2 units")
end)

T.case("non-finite units fall back: a NaN block, an infinite one; zeros stay low precision", function()
  local x = nv.ones(2, 256)
  x:set(1, 3, 0 / 0)
  x:set(2, 200, math.huge)
  x:narrow(1, 2, 1):narrow(2, 1, 128):fill_(0)
  local r = mor.choose(x, {granularity = "block"})
  same_values(tbl(r.choice), {{2, 1}, {1, 2}}, "choices")
  local v = tbl(r.q:dequantize())
  T.ok(v[1][3] ~= v[1][3] and v[2][200] == math.huge, "the fallback blocks keep NaN and inf")
  T.eq(v[1][200], 1, "the e4m3 block")
  T.eq(mor.choose(x, {}).label, "bf16", "per tensor: NaN in the tensor -> bf16")
  T.eq(mor.choose(nv.zeros(4, 64), {}).label, "e4m3", "an all-zero tensor: error 0")
end)

T.case("the power-of-two amax: scale = range / amax is exactly 2^k, no element past the range", function()
  for _, a in ipairs({7, 448, 449, 1e-3, 3.5, 1e30, 1e-30}) do
    for _, range in ipairs({448, 2688}) do
      local am = mor.pow2_amax(range, a)
      local k = math.log(range / am, 2)
      T.eq(k, math.floor(k), string.format("range %g amax %g: 2^k", range, a))
      T.ok(am >= a and am / 2 < a, string.format("range %g amax %g: the tightest such amax (%g)", range, a, am))
    end
  end
  T.eq(mor.pow2_amax(448, 0), nil)
  T.eq(mor.pow2_amax(448, math.huge), nil)
end)

-- ---- end to end --------------------------------------------------------------------------------

local CFG = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 64}

local function batch()
  nv.manual_seed(3)
  local ids = (nv.rand(2, 32) * 63):to("i64")
  local tg = (nv.rand(2, 32) * 63):to("i64")
  return ids, tg
end

-- one forward/backward of a fresh model under rec -> loss, {param name = grad bytes}
local function step(rec)
  local m = llama.Llama(CFG, {recipe = rec, seed = 4})
  local ids, tg = batch()
  local loss = m:forward_backward(ids, tg)
  local g = {}
  for _, e in ipairs(m:named_parameters()) do g[e.name] = e.grad:bytes() end
  return loss, g
end

local function same_step(a, b, what)
  local la, ga = step(a)
  local lb, gb = step(b)
  T.eq(string.pack("<d", la), string.pack("<d", lb), what .. ": loss bits")
  local n = 0
  for k, v in pairs(ga) do n = n + 1; T.ok(gb[k] == v, what .. ": gradient of " .. k) end
  T.ok(n > 10, what .. ": gradients compared")
end

-- a decision that sends every unit to bf16 (the last format)
local function all_bf16(d) return nv.full(d.errs[1]:size(), #d.formats) end

T.case("threshold +inf is fp8_cs (e4m3) bit for bit; all bf16 is bf16; the counters and the log agree", function()
  stats.reset()
  same_step(recipe.mor({threshold = math.huge}), recipe.fp8_cs({format = "e4m3"}), "mor +inf vs fp8_cs")
  local reps = stats.representations()
  T.eq(#reps, 14 * 6, "2 blocks x 7 linears x 6 operands (the LM head is bf16, not MoR's)")
  for _, r in ipairs(reps) do
    T.eq(r.units, {e4m3 = 1}, r.name .. " " .. r.role .. " " .. r.operand)
    T.eq(r.unit, "tensor")
  end
  local buf = {}
  stats.report({write = function(_, ...) for _, s in ipairs({...}) do buf[#buf + 1] = s end end})
  T.ok(table.concat(buf):find("model.layers.0.mlp.down_proj wgrad  dy  e4m3 100.00%% %(1 tensors%)"), "stats.report")
  same_step(recipe.mor({decide = all_bf16}), recipe.bf16(), "mor all bf16 vs bf16")
  same_step(recipe.mor({granularity = "block", block = 32, decide = all_bf16}), recipe.bf16(), "mor block all bf16 vs bf16")
  T.raises(function() recipe.mor({threshold = -1}) end, "threshold for e4m3 must be a number >= 0")
end)

T.case("every = N reuses a tensor's choice, as recipe state", function()
  local rec = recipe.mor({every = 2, threshold = 0.04})
  local m = llama.Llama(CFG, {recipe = rec, seed = 4})
  local ids, tg = batch()
  m.step = 1
  m:forward_backward(ids, tg)
  local s = rec:state().mor.sticky
  T.eq(s["model.layers.1.mlp.up_proj|x|fprop"], {format = "e4m3", step = 1})
  -- a forced bf16 record is reused at step 2, re-decided at step 3
  s["model.layers.1.mlp.up_proj|x|fprop"] = {format = "bf16", step = 1}
  local st = rec:state()
  st.mor.sticky = s
  rec:load_state(st)
  rec.mor:take_step()
  m.step = 2
  m:forward_backward(ids, tg)
  T.eq(rec.mor:take_step()["model.layers.1.mlp.up_proj|fprop|x"].units, {bf16 = 1})
  m.step = 3
  m:forward_backward(ids, tg)
  T.eq(rec.mor:take_step()["model.layers.1.mlp.up_proj|fprop|x"].units, {e4m3 = 1})
  T.raises(function() rec:load_state({seed = 1, offset = 0, mor = {sticky = {k = {format = "nope", step = 1}}}}) end,
    "mor state entry 'k' must be {format, step}")
end)

T.case("plan says what MoR may choose; bad options get clear errors", function()
  local rec = recipe.mor({granularity = "block", candidates = {"nvfp4", "e4m3"}})
  local m = llama.Llama(CFG, {recipe = rec, seed = 4})
  local buf = {}
  local rows = rec:plan(m, {out = {write = function(_, ...) for _, s in ipairs({...}) do buf[#buf + 1] = s end end}})
  local text = table.concat(buf)
  T.ok(text:find("mor nvfp4<=0.15 > e4m3<=0.04 > bf16 per 1x128 block", 1, true), "the choices")
  T.eq(rows[1].fprop.label, "mor")
  T.eq(rows[#rows].fprop.label, "bf16", "the LM head")
  T.ok(tostring(rec):find("candidates=nvfp4>e4m3", 1, true))
  T.raises(function() recipe.mor({granularity = "row"}) end, "granularity must be \"tensor\" or \"block\"")
  T.raises(function() recipe.mor({granularity = "block", block = 48}) end, "block must be a positive multiple of 32")
  T.raises(function() recipe.mor({block = 64}) end, "block applies to granularity = \"block\"")
  T.raises(function() recipe.mor({candidates = {"bf16"}}) end, "candidates[1] = bf16 is not a quantized format")
  T.raises(function() recipe.mor({candidates = {"mxfp8_e4m3"}}) end, "mxfp8_e4m3 has no default threshold")
  T.raises(function() recipe.mor({threshold = {nvfp4 = 0.1}}) end, "threshold.nvfp4: nvfp4 is not a candidate")
  T.raises(function() recipe.mor({granularity = "block", every = 2}) end, "every > 1 reuses a tensor's representation")
  T.raises(function() recipe.mor({thresold = 1}) end, "unknown option 'thresold'")
  T.raises(function() recipe.mor({act_dtype = "f16"}) end, "act_dtype must be 'bf16' or 'f32'")
  T.raises(function() rec:set_amax_reducer(function(a) return a end) end, "data parallelism is not supported yet")
  -- a reduction dim that is not a multiple of the block: the layer named
  local r2 = recipe.mor({granularity = "block", block = 128})
  local m2 = llama.Llama(CFG, {recipe = r2, seed = 4})
  local ids, tg = batch()
  T.raises(function() m2:forward_backward(ids, tg) end, "fprop operand x: its reduction dim (64) is not a multiple of block 128")
end)

T.case("core.block_sqerr: per-group sums of squares in double, the reference kernel's bits; its errors", function()
  local core = nv.core
  nv.manual_seed(9)
  local a, b = nv.randn(6, 96), nv.randn(6, 96)
  local got = core.block_sqerr(a, b, 32):totable()
  local ta, tb = a:totable(), b:totable()
  for i = 1, 6 do
    for g = 1, 3 do
      local s = 0
      for k = (g - 1) * 32 + 1, g * 32 do
        local d = string.unpack("<f", string.pack("<f", ta[i][k] - tb[i][k])) -- the f32 difference
        s = s + d * d
      end
      T.eq(got[i][g], string.unpack("<f", string.pack("<f", s)), string.format("group %d,%d", i, g))
    end
  end
  T.with(nv.use_reference, true, function()
    T.eq(core.block_sqerr(a, b, 32):totable(), got, "the reference kernel")
    T.eq(core.block_sqerr(a, nil, 96):totable(), core.block_sqerr(a, nv.zeros(6, 96), 96):totable())
  end)
  T.raises(function() core.block_sqerr(a, b, 40) end, "block 40 must divide the last dim (96)")
  T.raises(function() core.block_sqerr(a, nv.randn(6, 32), 32) end, "b must be an f32 tensor of a's shape")
  T.raises(function() core.block_sqerr(a:to("bf16"), nil, 32) end, "a must be a 2-D f32 tensor")
end)

T.case("recipe=mor from a config: sr and w2d taken, the fixed-table settings refused; trace sees each GEMM", function()
  local r = recipe.make("mor_nvfp4", {seed = 3, sr = false, w2d = false, rht = true})
  T.eq(r.mor.sr, false)
  T.eq(r.mor.w2d, false)
  T.eq(r:generator():seed(), 3)
  T.raises(function() recipe.make("mor", {switch_at = {step = 5}}) end, "recipe mor: switch_step does not apply")
  T.raises(function() recipe.make("mor_block", {bf16_first = 1}) end, "recipe mor_block: bf16_first does not apply")
  local seen = {}
  local rec = recipe.mor({granularity = "block", block = 32, decide = all_bf16})
  rec:trace(function(e) seen[#seen + 1] = e.role .. " " .. e.gemm.label .. " " .. e.a:format() end)
  local m = llama.Llama(CFG, {recipe = rec, seed = 4})
  m:forward_backward(batch())
  T.eq(seen[1], "fprop mor bf16", "a per-block operand is a bf16 QTensor")
  T.eq(#seen, 15 * 3, "every GEMM of the 15 linears (the LM head's too)")
end)
