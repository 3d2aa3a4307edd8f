-- test_deploy_gap.lua: nvlua.deploy.gap, the deployment gap of an NVFP4 export, on tiny Llamas.
--   * deploy.nvfp4_act (the engines' activation quantization) against a reference written here from the
--     definition the engines' kernels are tested against (vLLM's and FlashInfer's ref_fp4_quant): block
--     max, s = gs * (vmax * (1/6)) in f32, e4m3 RNE saturating at 448 from its bits, os = 1 / (s * (1/gs)),
--     e2m1 RNE of x * os clamped to +-6: every value bit for bit;
--   * its error with a static scale that saturates nothing (gs = 2688 / amax(x)): per element
--     |xq - x| <= max(0.375 D, |x| / 4), D = s / gs the block's decode scale. Why: e2m1's half step is
--     0.25 below 2 and v / 4 above (0.5 on [2, 4), 1 on [4, 6]); a normal e4m3 s is within 2^-4 of
--     gs * vmax / 6, so |x| / D <= 6 * 17/16 = 6.375 and the clamp at 6 costs at most 0.375 D;
--   * (b)'s weights are (a)'s fprop weights bit for bit (fused_amax: nothing re-quantized), and the
--     comparison finds the q/k/v and gate/up weights a run without fused_amax re-quantizes;
--   * (c) and (d) give finite losses; the bf16 model's export is all post-training.
-- No loss value is asserted against a tuned number: no ordering of (a), (b), (c) follows from the math.
local T = require "nvlua.test"
local nv = require "nvlua"
local deploy = require "nvlua.deploy"

local CFG = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 64}

local function ids(g) return (nv.rand({2, 32}, {generator = g}) * 64):to("i64") end

-- a model trained 3 AdamW steps under recipe r (seeded)
local function trained(r) return T.trained_llama(CFG, r, ids) end

local function batches(seed, n)
  local g, out = nv.Generator(seed), {}
  for i = 1, n do
    local x = ids(g)
    out[i] = {x, x}
  end
  return out
end

-- ---- the reference, from the definition ------------------------------------------------------------

local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

-- x >= 0 to a multiple of step (a power of two; exact in doubles), ties to even
local function rne(x, step)
  local q = x / step
  local f = math.floor(q)
  local r = q - f
  if r > 0.5 or (r == 0.5 and f % 2 == 1) then f = f + 1 end
  return f * step
end

-- e4m3 (bias 7, 3 mantissa bits, subnormal step 2^-9, largest 448) of v >= 0, RNE, saturating
local function e4m3(v)
  if v >= 448 then return 448 end
  local step = 2.0 ^ -9
  if v >= 2.0 ^ -6 then
    local _, e = math.frexp(v) -- v = m 2^e, m in [0.5, 1): the binade 2^(e-1), 3 mantissa bits
    step = 2.0 ^ (e - 1 - 3)
  end
  return math.min(rne(v, step), 448)
end

-- e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6) of v, RNE (ties to the even code: 0, 1, 2, 4), |v| <= 6
local E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}
local function e2m1(v)
  local a, best, bi = math.abs(v), nil, nil
  for i, g in ipairs(E2M1) do
    local d = math.abs(a - g)
    if best == nil or d < best or (d == best and (i - 1) % 2 == 0) then best, bi = d, i end
  end
  return v < 0 and -E2M1[bi] or E2M1[bi]
end

-- rows of x (a Lua table of rows of numbers) -> a[r][k] = value(code) * s, s[r][b]
local function reference(x, gs)
  local a, s = {}, {}
  for r, row in ipairs(x) do
    a[r], s[r] = {}, {}
    for b = 0, #row // 16 - 1 do
      local vmax = 0
      for j = 1, 16 do vmax = math.max(vmax, math.abs(row[16 * b + j])) end
      local sf = e4m3(f32(gs * f32(vmax * f32(1 / 6))))
      local os = sf == 0 and 0 or f32(1 / f32(sf * f32(1 / gs)))
      s[r][b + 1] = sf
      for j = 1, 16 do
        local v = math.max(-6, math.min(6, f32(row[16 * b + j] * os)))
        a[r][16 * b + j] = e2m1(v) * sf
      end
    end
  end
  return a, s
end

-- ---- the cases -------------------------------------------------------------------------------------------

local function sample_x(seed)
  local g = nv.Generator(seed)
  local x = (nv.randn({6, 64}, {generator = g}) * 3):to("bf16")
  x[2]:fill_(0) -- an all-zero row: every block scale 0
  local t = x:to("f32"):totable()
  t[3][5] = 1e-30 -- a block of almost nothing beside one tiny value (its scale underflows)
  for j = 1, 16 do t[4][j] = t[4][j] * 100 end -- a block far above the static amax (saturates)
  return nv.tensor(t):to("bf16"):to("f32"), t
end

T.case("nvfp4_act: the engines' reference bit for bit, gs from the static amax (saturating blocks, zero blocks)", function()
  for _, seed in ipairs({1, 2, 3}) do
    local x, t = sample_x(seed)
    t = x:totable()
    for _, gs in ipairs({f32(2688 / 9.0), f32(2688 / 0.7), 1.0}) do
      local a, s = deploy.nvfp4_act(x, gs)
      local ra, rs = reference(t, gs)
      local at, st = a:totable(), s:totable()
      local bad = 0
      for r = 1, #ra do
        for k = 1, #ra[r] do if at[r][k] ~= ra[r][k] then bad = bad + 1 end end
        for b = 1, #rs[r] do if st[r][b] ~= rs[r][b] then bad = bad + 1 end end
      end
      T.eq(bad, 0, "seed " .. seed .. ", gs " .. gs .. ": values differing from the reference")
    end
  end
  -- bf16 input is read as its f32 widening
  local x = sample_x(4)
  local a1 = deploy.nvfp4_act(x:to("bf16"), 300.0)
  T.ok(a1:bytes() == deploy.nvfp4_act(x, 300.0):bytes(), "bf16 x = its f32 widening")
  T.raises(function() deploy.nvfp4_act(nv.zeros({2, 24}), 1.0) end, "multiple of 16")
  T.raises(function() deploy.nvfp4_act(nv.zeros({2, 32}), 0 / 0) end, "gs must be")
end)

T.case("nvfp4_act: with a static scale that saturates nothing, the stated NVFP4 bound per element", function()
  local g = nv.Generator(7)
  local x = (nv.randn({32, 128}, {generator = g}) * 2):to("bf16"):to("f32")
  local gs = f32(2688 / x:amax())
  local a, s = deploy.nvfp4_act(x, gs)
  local xt, at, st = x:totable(), a:totable(), s:totable()
  local worst = 0
  for r = 1, #xt do
    for k = 1, #xt[r] do
      local sf = st[r][(k - 1) // 16 + 1]
      T.ok(sf >= 2.0 ^ -6, "a subnormal block scale: the bound below assumes normal ones")
      local D = sf / gs
      local err = math.abs(at[r][k] / gs - xt[r][k])
      worst = math.max(worst, err / math.max(0.375 * D, math.abs(xt[r][k]) / 4))
    end
  end
  T.ok(worst <= 1, "error over the bound: " .. worst)
end)

T.case("gap: (b)'s weights are (a)'s fprop weights bit for bit; the losses are finite", function()
  local m = trained(nv.recipe.nvfp4({fused_amax = true, bf16_first = 0, bf16_last = 0}))
  local val = batches(11, 2)
  local cal = {val[1][1], val[2][1]}
  local before = m:state_dict()["model.layers.0.input_layernorm.weight"]:clone()
  local rep = deploy.gap(m, {batches = val, calibration = cal})
  T.eq(rep.trained, 14, "every linear but the head trained in NVFP4")
  T.eq(#rep.differ, 0, "trained linears whose exported weight is not the forward's")
  for _, k in ipairs({"a", "b", "c"}) do T.ok(rep[k] == rep[k] and rep[k] < math.huge, k .. " is finite") end
  T.ok(m:state_dict()["model.layers.0.input_layernorm.weight"]:bytes() == before:bytes(), "the model's weights put back")
  T.near(deploy.gap(m, {batches = val, calibration = cal}).a, rep.a, 0, "(a) again: the recipe state put back")
  -- compressed-tensors' arithmetic: another global scale and alpha, the same weights
  local ct = deploy.gap(m, {batches = val, calibration = cal, format = "compressed-tensors"})
  T.eq(#ct.differ, 0)
  T.eq(ct.b, rep.b, "(b) does not depend on the format's scales")
  -- without fused_amax the export re-quantizes the q/k/v and gate/up parts whose amax is not the group's
  local m2 = trained(nv.recipe.nvfp4({bf16_first = 0, bf16_last = 0}))
  local r2 = deploy.gap(m2, {batches = val, calibration = cal})
  T.ok(#r2.differ > 0 and #r2.differ == r2.fused, "the re-quantized parts found: " .. #r2.differ .. " of " .. r2.fused)
  T.raises(function() deploy.gap(m, {batches = {}}) end, "non%-empty list")
  T.raises(function() deploy.gap(m, {batches = val, calibration = cal, format = "gguf"}) end, "format must be")
end)

T.case("gap: (d) a bf16 model's post-training NVFP4 gives finite losses", function()
  local m = trained(nv.recipe.nvfp4({fused_amax = true, bf16_first = 0, bf16_last = 0}))
  local b = trained(nv.recipe.bf16())
  local val = batches(11, 2)
  local rep = deploy.gap(m, {batches = val, calibration = {val[1][1]}, bf16 = b})
  local d = rep.d
  T.eq(d.trained, 0)
  T.eq(d.ptq, 14, "every linear but the head quantized after training")
  for _, k in ipairs({"a", "b", "c"}) do T.ok(d[k] == d[k] and d[k] < math.huge, "d." .. k .. " is finite") end
end)
