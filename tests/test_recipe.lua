-- tests/test_recipe.lua: precision recipes (lua/nvlua/recipe.lua) and GEMM counters
-- (lua/nvlua/stats.lua): the NVFP4 recipe's three GEMMs against explicit nv.quantize/nv.qmatmul
-- calls bit for bit, every preset's per-operand formats, ablation switches, custom recipes,
-- switch_at, the LM head rule, stats counts, delayed scaling, state round trips, f32/bf16, errors.
local T = require "nvlua.test"
local nv = require "nvlua"
local recipe = require "nvlua.recipe"
local stats = require "nvlua.stats"

-- ---- helpers ------------------------------------------------------------------------------------

local function same(a, b, what)
  T.eq(a:size(), b:size(), what .. ": shape")
  local n = a:eq(b):sum()
  T.ok(n == a:numel(), string.format("%s: %d of %d elements differ", what, a:numel() - n, a:numel()))
end

local function is_bf16_valued(t) return t:dtype() == "f32" and t:to("bf16"):to("f32"):eq(t):sum() == t:numel() end

local BLOCK_LINEARS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
  "mlp.up_proj", "mlp.down_proj"}

-- A stand-in for llama.Llama: 7 linears per block, then the LM head (high precision, no block).
local function fake_model(L)
  local lin = {}
  for b = 0, L - 1 do
    for _, n in ipairs(BLOCK_LINEARS) do
      lin[#lin + 1] = {name = string.format("model.layers.%d.%s", b, n), block = b, high_precision = false}
    end
  end
  lin[#lin + 1] = {name = "lm_head", block = nil, high_precision = true}
  return {num_blocks = L, linears = function() return lin end}
end

local function ctx_of(block, L, step, name)
  return {name = name or string.format("model.layers.%d.mlp.up_proj", block), block = block, num_blocks = L,
    high_precision = false, step = step or 0}
end

local function data(T_, K, N, seed)
  nv.manual_seed(seed or 1)
  local x = nv.randn(T_, K) * nv.randn(T_, 1):exp()
  local w = nv.randn(N, K) * 0.05
  local dy = nv.randn(T_, N) * 1e-3
  return x, w, dy
end

local function row(rows, name)
  for _, r in ipairs(rows) do if r.name == name then return r end end
  error("no plan row " .. name)
end

-- ---- (a) NVFP4 semantics bit for bit ---------------------------------------------------------------

T.case("nvfp4 fprop = qmatmul(1x16 x, 16x16 w, bf16 out) bit for bit; y bf16 (act_dtype f32: bf16 values)", function()
  local x, w = data(64, 128, 48, 1)
  local r = recipe.nvfp4()
  local y, saved = r:linear_forward(ctx_of(5, 32), x, w)
  local ref = nv.qmatmul(nv.quantize(x, "nvfp4"), nv.quantize(w, "nvfp4", {block = "2d"}), {out = "bf16"}):float()
  same(y, ref, "fprop")
  T.eq(y:dtype(), "bf16", "y is a bf16 activation (act_dtype bf16, the default)")
  local y32, s32 = recipe.nvfp4({act_dtype = "f32"}):linear_forward(ctx_of(5, 32), x, w)
  same(y32, ref, "fprop, act_dtype f32")
  T.ok(is_bf16_valued(y32), "act_dtype f32: y is an f32 tensor of bf16 values")
  recipe.nvfp4():release(s32)
  T.ok(saved.qw ~= nil and saved.qw:layout() == "16x16", "the 2-D weight is kept for dgrad")
  r:release(saved)
  T.ok(saved.qw == nil, "release frees it")
end)

T.case("nvfp4 dgrad = qmatmul(SR 1x16 dy, fprop's q_w:t()) and wgrad = RHT+SR explicit, accumulated, bit for bit", function()
  local x, w, dy = data(64, 128, 48, 2)
  local r = recipe.nvfp4({seed = 77})
  local ctx = ctx_of(5, 32)
  local _, saved = r:linear_forward(ctx, x, w)
  local g = r:generator()
  T.eq(g:seed(), 77)
  local seed, off = g:seed(), g:offset()
  local dw0 = nv.randn(48, 128)
  local dw = dw0:clone()
  local dx = r:linear_backward(ctx, dy, saved, dw)
  T.eq(g:offset(), off + 2, "one SR draw for dgrad's dy, one for wgrad's")
  -- dgrad: dy row-wise with the recipe generator's draw (seed, off); W^T = the fprop tiles transposed
  local gen = nv.Generator(seed)
  gen:set_offset(off)
  local qdy = nv.quantize(dy, "nvfp4", {sr = true, generator = gen})
  local qw = nv.quantize(w, "nvfp4", {block = "2d"})
  same(dx, nv.qmatmul(qdy, qw:t(), {out = "bf16"}):float(), "dgrad")
  T.eq(dx:dtype(), "bf16", "dx is a bf16 activation gradient")
  -- wgrad: the next draw (offset + 1), both operands blocked along T with the RHT
  local qdyt = nv.quantize(dy, "nvfp4", {axis = 1, rht = true, sr = true, generator = gen})
  T.eq(qdyt.offset, off + 1)
  local qxt = nv.quantize(x, "nvfp4", {axis = 1, rht = true})
  local expect = dw0:clone():add_(nv.qmatmul(qdyt, qxt))
  same(dw, expect, "wgrad accumulated into dw")
  T.ok(saved.qw == nil, "backward freed the saved weight quantization")
end)

T.case("nvfp4 dgrad sees exactly the fprop weight values, transposed (traced operands)", function()
  local x, w, dy = data(32, 64, 48, 3)
  local r = recipe.nvfp4()
  local seen = {}
  r:trace(function(e) seen[e.role] = {a = e.a:dequantize(), b = e.b:dequantize(), blay = e.b:layout(), a_axis = e.a:axis(),
    b_axis = e.b:axis(), rht = e.a.rht and e.b.rht, a_sr = e.a.sr, b_sr = e.b.sr} end)
  local ctx = ctx_of(3, 32)
  local _, saved = r:linear_forward(ctx, x, w)
  r:linear_backward(ctx, dy, saved, nv.zeros(48, 64))
  r:trace(nil)
  local wf, wd = seen.fprop.b, seen.dgrad.b
  T.eq(wd:size(), {64, 48}, "dgrad's weight operand is W^T [K, N]")
  same(wd, wf:t():contiguous(), "dgrad weight values = fprop weight values transposed")
  T.eq(seen.fprop.blay, "16x16")
  T.eq(seen.dgrad.blay, "16x16")
  T.ok(not seen.fprop.a_sr and not seen.fprop.b_sr, "fprop: RNE")
  T.ok(seen.dgrad.a_sr and not seen.dgrad.b_sr, "dgrad: SR on dy only")
  T.ok(seen.wgrad.rht and seen.wgrad.a_sr and not seen.wgrad.b_sr, "wgrad: RHT on both, SR on dy only")
  T.eq(seen.wgrad.a_axis, 1, "wgrad dy blocked along T")
  T.eq(seen.wgrad.b_axis, 1, "wgrad x blocked along T")
end)

T.case("nvfp4 ablations: w2d=false quantizes W per GEMM, rht=false / sr=false drop exactly those", function()
  local x, w, dy = data(64, 64, 32, 4)
  local ctx = ctx_of(4, 32)
  -- w2d = false: fprop W 1x16 along K; dgrad W 1x16 along N ({axis = 1}), a separate quantization
  local r = recipe.nvfp4({w2d = false, seed = 5})
  local y, saved = r:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "nvfp4"), nv.quantize(w, "nvfp4"), {out = "bf16"}):float(), "w2d=false fprop")
  T.ok(saved.qw == nil, "nothing to reuse for 1-D weights")
  local dx = r:linear_backward(ctx, dy, saved, nil)
  local qdy = nv.quantize(dy, "nvfp4", {sr = true, seed = 5, offset = 0})
  same(dx, nv.qmatmul(qdy, nv.quantize(w, "nvfp4", {axis = 1}), {out = "bf16"}):float(), "w2d=false dgrad")
  -- rht = false: the wgrad operands are not transformed; SR on dy still
  r = recipe.nvfp4({rht = false, seed = 6})
  local _, s2 = r:linear_forward(ctx, x, w)
  local dw = nv.zeros(32, 64)
  r:linear_backward(ctx, dy, s2, dw)
  local q1 = nv.quantize(dy, "nvfp4", {axis = 1, sr = true, seed = 6, offset = 1})
  same(dw, nv.qmatmul(q1, nv.quantize(x, "nvfp4", {axis = 1})), "rht=false wgrad")
  -- sr = false: round to nearest everywhere, the generator is never advanced
  r = recipe.nvfp4({sr = false})
  local _, s3 = r:linear_forward(ctx, x, w)
  dw = nv.zeros(32, 64)
  dx = r:linear_backward(ctx, dy, s3, dw)
  T.eq(r:generator():offset(), 0, "no SR, no draws")
  same(dx, nv.qmatmul(nv.quantize(dy, "nvfp4"), nv.quantize(w, "nvfp4", {block = "2d"}):t(), {out = "bf16"}):float(),
    "sr=false dgrad")
  same(dw, nv.qmatmul(nv.quantize(dy, "nvfp4", {axis = 1, rht = true}), nv.quantize(x, "nvfp4", {axis = 1, rht = true})),
    "sr=false wgrad")
  -- and in the plan, each switch changes only its own fields
  local m = fake_model(32)
  local base = row(recipe.nvfp4():plan(m, {quiet = true}), "model.layers.10.mlp.up_proj")
  for opt, changed in pairs({rht = {"wgrad.dy.rht", "wgrad.x.rht"}, sr = {"dgrad.dy.sr", "wgrad.dy.sr"},
    w2d = {"dgrad.w.block", "fprop.w.block"}}) do
    local p = row(recipe.nvfp4({[opt] = false}):plan(m, {quiet = true}), "model.layers.10.mlp.up_proj")
    local diff = {}
    for _, role in ipairs({"fprop", "dgrad", "wgrad"}) do
      for op, s in pairs(p[role]) do
        if type(s) == "table" then
          for k, v in pairs(s) do
            if base[role][op][k] ~= v then diff[#diff + 1] = role .. "." .. op .. "." .. k end
          end
        end
      end
    end
    table.sort(diff)
    T.eq(diff, changed, opt .. "=false changes")
  end
end)

-- ---- (b) presets, as planned -----------------------------------------------------------------------

T.case("nvfp4 plan for 32 blocks: blocks 0,1 and 24..31 in bf16, the rest as NUMERICS §6; LM head bf16", function()
  local rows = recipe.nvfp4():plan(fake_model(32), {quiet = true})
  T.eq(#rows, 32 * 7 + 1)
  local hp = {}
  for _, r in ipairs(rows) do
    if r.block then
      local f = r.fprop.x.format
      for _, role in ipairs({"fprop", "dgrad", "wgrad"}) do
        for op, s in pairs(r[role]) do
          if type(s) == "table" then T.eq(s.format, f, r.name .. " " .. role .. " " .. op .. " same as x") end
        end
      end
      if f == "bf16" then hp[r.block] = true end
    end
  end
  local expect = {[0] = true, [1] = true}
  for b = 24, 31 do expect[b] = true end
  T.eq(hp, expect, "bf16 blocks")
  local r = row(rows, "model.layers.2.self_attn.q_proj")
  T.eq(r.fprop.x, {format = "nvfp4", block = "1d", rht = false, sr = false, delayed = false})
  T.eq(r.fprop.w, {format = "nvfp4", block = "2d", rht = false, sr = false, delayed = false})
  T.eq(r.fprop.out, "bf16")
  T.eq(r.dgrad.dy, {format = "nvfp4", block = "1d", rht = false, sr = true, delayed = false})
  T.eq(r.dgrad.w, {format = "nvfp4", block = "2d", rht = false, sr = false, delayed = false})
  T.eq(r.dgrad.out, "bf16")
  T.eq(r.wgrad.dy, {format = "nvfp4", block = "1d", rht = true, sr = true, delayed = false})
  T.eq(r.wgrad.x, {format = "nvfp4", block = "1d", rht = true, sr = false, delayed = false})
  T.eq(r.wgrad.out, "f32")
  local head = row(rows, "lm_head")
  for _, role in ipairs({"fprop", "dgrad", "wgrad"}) do T.eq(head[role].label, "bf16", "LM head " .. role) end
  T.eq(rows.totals.fprop, {nvfp4 = 22 * 7, bf16 = 10 * 7 + 1})
  T.eq(rows.totals.wgrad, {nvfp4 = 22 * 7, bf16 = 10 * 7 + 1})
end)

T.case("nvfp4 high-precision blocks scale with depth: floor(2L/32) first, floor(8L/32) last; explicit counts", function()
  local function bf16_blocks(r, L)
    local s = {}
    for _, row_ in ipairs(r:plan(fake_model(L), {quiet = true})) do
      if row_.block and row_.fprop.label == "bf16" then s[#s + 1] = row_.block end
    end
    local u, seen = {}, {}
    for _, b in ipairs(s) do if not seen[b] then seen[b] = true; u[#u + 1] = b end end
    return u
  end
  T.eq(bf16_blocks(recipe.nvfp4(), 4), {3}, "L=4: 0 first, 1 last")
  T.eq(bf16_blocks(recipe.nvfp4(), 16), {0, 12, 13, 14, 15}, "L=16: 1 and 4")
  T.eq(bf16_blocks(recipe.nvfp4(), 2), {}, "L=2: none")
  T.eq(bf16_blocks(recipe.nvfp4({bf16_first = 1, bf16_last = 0}), 4), {0}, "explicit")
  T.eq(bf16_blocks(recipe.nvfp4({bf16_first = 0, bf16_last = 0}), 32), {}, "all nvfp4 (the ablation)")
  T.eq(bf16_blocks(recipe.nvfp4({bf16_first = 3, bf16_last = 2}), 8), {0, 1, 2, 6, 7})
end)

T.case("mxfp4: the nvfp4 recipe in 1x32 e8m0 blocks; fprop, dgrad and wgrad equal explicit quantizations bit for bit", function()
  local x, w, dy = data(64, 128, 64, 4)
  local r = recipe.mxfp4({seed = 21})
  local ctx = ctx_of(5, 32)
  local y, saved = r:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "mxfp4"), nv.quantize(w, "mxfp4"), {out = "bf16"}):float(), "fprop")
  local g = r:generator()
  local seed, off = g:seed(), g:offset()
  local dw0 = nv.randn(64, 128)
  local dw = dw0:clone()
  local dx = r:linear_backward(ctx, dy, saved, dw)
  T.eq(g:offset(), off + 2, "one SR draw for dgrad's dy, one for wgrad's")
  local gen = nv.Generator(seed)
  gen:set_offset(off)
  -- dgrad: dy 1x32 with SR; W blocked along its other axis (1x32 blocks have no exact transpose)
  local qdy = nv.quantize(dy, "mxfp4", {sr = true, generator = gen})
  same(dx, nv.qmatmul(qdy, nv.quantize(w, "mxfp4", {axis = 1}), {out = "bf16"}):float(), "dgrad")
  -- wgrad: both along T with the RHT, SR on dy
  local qdyt = nv.quantize(dy, "mxfp4", {axis = 1, rht = true, sr = true, generator = gen})
  same(dw, dw0:clone():add_(nv.qmatmul(qdyt, nv.quantize(x, "mxfp4", {axis = 1, rht = true}))), "wgrad")
  -- the same high-precision blocks as nvfp4; no 2-D weights; the floor rule on request
  local m = fake_model(32)
  local p = r:plan(m, {quiet = true})
  T.eq(row(p, "model.layers.1.mlp.up_proj").fprop.w.format, "bf16", "block 1 in bf16")
  T.eq(row(p, "model.layers.2.mlp.up_proj").fprop.w.format, "mxfp4")
  T.eq(row(p, "model.layers.2.mlp.up_proj").fprop.w.block, nil, "no 2-D blocks")
  T.eq(row(p, "model.layers.24.mlp.up_proj").fprop.w.format, "bf16", "the last 8 blocks in bf16")
  T.eq(row(recipe.mxfp4({scale_rule = "floor"}):plan(m, {quiet = true}), "model.layers.2.mlp.up_proj").wgrad.dy.scale_rule,
    "floor")
  T.raises(function() recipe.mxfp4({w2d = true}) end, "recipe.mxfp4: unknown option 'w2d'")
  T.raises(function() recipe.nvfp4({scale_rule = "floor"}) end, "recipe.nvfp4: unknown option 'scale_rule'")
  T.eq(recipe.make("mxfp4", {rht = false}).name, "mxfp4")
end)

T.case("every preset's formats per operand", function()
  local m = fake_model(4)
  local name = "model.layers.1.mlp.down_proj"
  local function fmts(r)
    local p = row(r:plan(m, {quiet = true}), name)
    return {p.fprop.x.format, p.fprop.w.format, p.fprop.out, p.dgrad.dy.format, p.dgrad.w.format, p.dgrad.out,
      p.wgrad.dy.format, p.wgrad.x.format, p.wgrad.out}
  end
  T.eq(fmts(recipe.f32()), {"f32", "f32", "f32", "f32", "f32", "f32", "f32", "f32", "f32"})
  T.eq(fmts(recipe.bf16()), {"bf16", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16", "f32"})
  T.eq(fmts(recipe.fp8_cs()), {"e4m3", "e4m3", "bf16", "e5m2", "e4m3", "bf16", "e5m2", "e4m3", "f32"})
  T.eq(fmts(recipe.fp8_cs({format = "e4m3"})), {"e4m3", "e4m3", "bf16", "e4m3", "e4m3", "bf16", "e4m3", "e4m3", "f32"})
  T.eq(fmts(recipe.fp8_delayed()), {"e4m3", "e4m3", "bf16", "e5m2", "e4m3", "bf16", "e5m2", "e4m3", "f32"})
  local mx = {"mxfp8_e4m3", "mxfp8_e4m3", "bf16", "mxfp8_e4m3", "mxfp8_e4m3", "bf16", "mxfp8_e4m3", "mxfp8_e4m3", "f32"}
  T.eq(fmts(recipe.mxfp8()), mx)
  T.eq(fmts(recipe.nvfp4()), {"nvfp4", "nvfp4", "bf16", "nvfp4", "nvfp4", "bf16", "nvfp4", "nvfp4", "f32"})
  T.eq(fmts(recipe.mxfp4()), {"mxfp4", "mxfp4", "bf16", "mxfp4", "mxfp4", "bf16", "mxfp4", "mxfp4", "f32"})
  local p = row(recipe.fp8_delayed():plan(m, {quiet = true}), name)
  T.ok(p.fprop.x.delayed and p.dgrad.dy.delayed and p.wgrad.x.delayed, "fp8_delayed marks every operand delayed")
  T.ok(not row(recipe.fp8_cs():plan(m, {quiet = true}), name).fprop.x.delayed, "fp8_cs: current scaling")
  T.eq(row(recipe.mxfp8():plan(m, {quiet = true}), name).fprop.x.scale_rule, "rceil")
  T.eq(row(recipe.mxfp8({scale_rule = "floor"}):plan(m, {quiet = true}), name).wgrad.dy.scale_rule, "floor")
  -- the LM head: bf16 in every low-precision recipe, f32 in the f32 recipe
  for _, r in ipairs({recipe.bf16(), recipe.fp8_cs(), recipe.fp8_delayed(), recipe.mxfp8(), recipe.nvfp4()}) do
    local h = row(r:plan(m, {quiet = true}), "lm_head")
    T.eq({h.fprop.label, h.dgrad.label, h.wgrad.label, h.fprop.out, h.wgrad.out}, {"bf16", "bf16", "bf16", "bf16", "f32"},
      r.name .. " LM head")
  end
  local h = row(recipe.f32():plan(m, {quiet = true}), "lm_head")
  T.eq({h.fprop.label, h.fprop.out, h.dgrad.out}, {"f32", "f32", "f32"})
end)

T.case("plan prints every layer x 3 GEMMs and the totals", function()
  local buf = {}
  local out = {write = function(_, s) buf[#buf + 1] = s end}
  local rows = recipe.nvfp4():plan(fake_model(4), {out = out})
  local text = table.concat(buf)
  local lines = 0
  for _ in text:gmatch("\n") do lines = lines + 1 end
  T.eq(lines, 1 + 1 + 3 * #rows + 3, "title, header, 3 lines per layer, 3 totals")
  T.ok(text:find("model.layers.0.self_attn.q_proj", 1, true), "layer names")
  T.ok(text:find("dy nvfp4 1x16 rht sr", 1, true), "wgrad dy")
  T.ok(text:find("w nvfp4 16x16 (fprop's, t)", 1, true), "dgrad reuses the fprop tiles")
  T.ok(text:find("fprop: bf16 8, nvfp4 21", 1, true), "totals: " .. text:sub(-200))
end)

T.case("custom recipes: fn sees ctx; any per-layer, per-GEMM, per-operand mix; GEMMs follow the specs", function()
  local seen = {}
  local r = recipe.custom(function(c)
    seen[#seen + 1] = {name = c.name, block = c.block, role = c.role, operand = c.operand, step = c.step, num_blocks = c.num_blocks,
      high_precision = c.high_precision}
    if c.role == "wgrad" then return "bf16" end
    if c.operand == "w" then return {format = "nvfp4", block = "2d"} end
    if c.operand == "dy" then return {format = "mxfp8_e5m2", scale_rule = "floor"} end
    return "nvfp4"
  end)
  local x, w, dy = data(64, 128, 64, 7)
  local ctx = ctx_of(1, 4, 12, "model.layers.1.self_attn.o_proj")
  stats.reset()
  local y, saved = r:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "nvfp4"), nv.quantize(w, "nvfp4", {block = "2d"}), {out = "bf16"}):float(), "custom fprop")
  local dw = nv.zeros(64, 128)
  local dx = r:linear_backward(ctx, dy, saved, dw)
  -- dgrad: mxfp8 dy x nvfp4 W^T (mixed formats); the 2-D W is the fprop one, transposed
  same(dx, nv.qmatmul(nv.quantize(dy, "mxfp8_e5m2", {scale_rule = "floor"}), nv.quantize(w, "nvfp4", {block = "2d"}):t(),
    {out = "bf16"}):float(), "custom dgrad")
  same(dw, nv.qmatmul(nv.quantize(dy, "bf16", {axis = 1}), nv.quantize(x, "bf16", {axis = 1})), "custom wgrad")
  T.eq(stats.gemms(), {fprop = {nvfp4 = 1}, dgrad = {["mxfp8_e5m2 x nvfp4"] = 1}, wgrad = {bf16 = 1}})
  T.eq(seen[1], {name = "model.layers.1.self_attn.o_proj", block = 1, role = "fprop", operand = "x", step = 12, num_blocks = 4,
    high_precision = false})
  local roles = {}
  for _, s in ipairs(seen) do roles[s.role .. "." .. s.operand] = true end
  T.eq(roles, {["fprop.x"] = true, ["fprop.w"] = true, ["dgrad.dy"] = true, ["dgrad.w"] = true, ["wgrad.dy"] = true,
    ["wgrad.x"] = true})
  -- a per-layer mix: every other block in fp8, the LM head left in f32 by the function
  local mix = recipe.custom(function(c)
    if c.high_precision then return "f32" end
    if c.block % 2 == 1 then return c.operand == "dy" and "e5m2" or "e4m3" end
    return "bf16"
  end)
  local rows = mix:plan(fake_model(4), {quiet = true})
  T.eq(rows.totals.fprop, {bf16 = 14, e4m3 = 14, f32 = 1})
  T.eq(rows.totals.dgrad, {bf16 = 14, ["e5m2 x e4m3"] = 14, f32 = 1})
  T.eq(row(rows, "lm_head").fprop.out, "f32", "f32 x f32 keeps an f32 output")
end)

T.case("switch_at moves fprop (forward_only) or every GEMM to bf16 from step N on", function()
  local m = fake_model(8)
  local name = "model.layers.3.mlp.gate_proj"
  local function labels(r, step)
    local p = row(r:plan(m, {quiet = true, step = step}), name)
    return {p.fprop.label, p.dgrad.label, p.wgrad.label}
  end
  local fwd = recipe.nvfp4({switch_at = {step = 100, forward_only = true}})
  T.eq(labels(fwd, 99), {"nvfp4", "nvfp4", "nvfp4"})
  T.eq(labels(fwd, 100), {"bf16", "nvfp4", "nvfp4"})
  T.eq(labels(fwd, 5000), {"bf16", "nvfp4", "nvfp4"})
  local all = recipe.nvfp4({switch_at = {step = 100}})
  T.eq(labels(all, 99), {"nvfp4", "nvfp4", "nvfp4"})
  T.eq(labels(all, 100), {"bf16", "bf16", "bf16"})
  T.eq(labels(recipe.fp8_cs({switch_at = {step = 3, forward_only = true}}), 3), {"bf16", "e5m2 x e4m3", "e5m2 x e4m3"})
  -- and the GEMMs follow: after the switch fprop is bf16 and dgrad still uses the 2-D weight
  local x, w, dy = data(32, 64, 32, 8)
  local ctx = ctx_of(3, 8, 100, name)
  local y, saved = fwd:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "bf16"), nv.quantize(w, "bf16"), {out = "bf16"}):float(), "switched fprop")
  local dx = fwd:linear_backward(ctx, dy, saved, nil)
  same(dx, nv.qmatmul(nv.quantize(dy, "nvfp4", {sr = true, seed = 1234, offset = 0}), nv.quantize(w, "nvfp4", {block = "2d"}):t(),
    {out = "bf16"}):float(), "dgrad after a forward-only switch")
  T.raises(function() fwd:linear_forward({name = "l", block = 3, num_blocks = 8}, x, w) end, "switch_at needs ctx.step")
end)

-- ---- (c) stats ------------------------------------------------------------------------------------

T.case("stats count exactly the GEMMs that ran, per role and format", function()
  local L = 4 -- nvfp4 defaults for 4 blocks: block 3 in bf16
  local x, w, dy = data(32, 64, 32, 9)
  local function step(r)
    stats.reset()
    local ctxs = {}
    for b = 0, L - 1 do ctxs[#ctxs + 1] = ctx_of(b, L, 0, "model.layers." .. b .. ".mlp.up_proj") end
    ctxs[#ctxs + 1] = {name = "lm_head", high_precision = true, num_blocks = L, step = 0}
    for _, c in ipairs(ctxs) do
      local _, saved = r:linear_forward(c, x, w)
      r:linear_backward(c, dy, saved, nv.zeros(32, 64))
    end
    return stats.gemms()
  end
  T.eq(step(recipe.nvfp4()), {fprop = {nvfp4 = 3, bf16 = 2}, dgrad = {nvfp4 = 3, bf16 = 2}, wgrad = {nvfp4 = 3, bf16 = 2}})
  T.eq(step(recipe.fp8_cs()), {fprop = {e4m3 = 4, bf16 = 1}, dgrad = {["e5m2 x e4m3"] = 4, bf16 = 1},
    wgrad = {["e5m2 x e4m3"] = 4, bf16 = 1}})
  T.eq(step(recipe.mxfp8()), {fprop = {mxfp8_e4m3 = 4, bf16 = 1}, dgrad = {mxfp8_e4m3 = 4, bf16 = 1},
    wgrad = {mxfp8_e4m3 = 4, bf16 = 1}})
  T.eq(step(recipe.f32()), {fprop = {f32 = 5}, dgrad = {f32 = 5}, wgrad = {f32 = 5}})
  -- gemms() is a copy; reset() empties every role; a backward without dw skips wgrad
  local g = stats.gemms()
  g.fprop.f32 = 99
  T.eq(stats.gemms().fprop.f32, 5)
  stats.reset()
  T.eq(stats.gemms(), {fprop = {}, dgrad = {}, wgrad = {}})
  local r = recipe.bf16()
  local _, saved = r:linear_forward(ctx_of(0, L), x, w)
  r:linear_backward(ctx_of(0, L), dy, saved, nil)
  T.eq(stats.gemms(), {fprop = {bf16 = 1}, dgrad = {bf16 = 1}, wgrad = {}})
end)

-- ---- (d) delayed scaling, state --------------------------------------------------------------------

T.case("fp8_delayed: the first step uses current scaling, later steps the history's amax, zero keeps the previous", function()
  local x, w = data(32, 64, 32, 10)
  local r = recipe.fp8_delayed({history = 2})
  local ctx = ctx_of(0, 4, 0, "l0")
  local function fwd(xx)
    local y, saved = r:linear_forward(ctx, xx, w)
    r:release(saved)
    return y
  end
  local xa, wa = x:amax(), w:amax()
  T.eq(xa, x:abs():max())
  -- step 1: empty history -> current scaling for x and w
  local y1 = fwd(x)
  same(y1, nv.qmatmul(nv.quantize(x, "e4m3"), nv.quantize(w, "e4m3"), {out = "bf16"}):float(), "step 1: current scaling")
  -- step 2: x doubled, but the scale comes from the history (amax of step 1)
  local x2 = x * 2
  local y2 = fwd(x2)
  same(y2, nv.qmatmul(nv.quantize(x2, "e4m3", {amax = xa}), nv.quantize(w, "e4m3", {amax = wa}), {out = "bf16"}):float(),
    "step 2: delayed")
  -- step 3: the window of 2 holds (xa, 2xa)
  local y3 = fwd(x)
  same(y3, nv.qmatmul(nv.quantize(x, "e4m3", {amax = 2 * xa}), nv.quantize(w, "e4m3", {amax = wa}), {out = "bf16"}):float(),
    "step 3: max of the window")
  -- zeros fill the window; the history amax is then 0, and the previous amax stays in use
  local z = nv.zeros(32, 64)
  fwd(z); fwd(z)
  local y6 = fwd(x)
  same(y6, nv.qmatmul(nv.quantize(x, "e4m3", {amax = 2 * xa}), nv.quantize(w, "e4m3", {amax = wa}), {out = "bf16"}):float(),
    "zero history keeps the previous amax")
  local st = r:state()
  T.eq(st.histories["l0|x|fprop"].values, {0.0, x:amax()}, "the history holds the true amaxes pushed")
  -- per (layer, operand, role): another layer has its own history
  local ya = r:linear_forward(ctx_of(1, 4, 0, "l1"), x2, w)
  same(ya, nv.qmatmul(nv.quantize(x2, "e4m3"), nv.quantize(w, "e4m3"), {out = "bf16"}):float(), "a new layer starts fresh")
end)

T.case("fp8_delayed backward: dgrad reuses the fprop weight, dy scales come from their own histories", function()
  local x, w, dy = data(32, 64, 32, 11)
  local r = recipe.fp8_delayed()
  local ctx = ctx_of(0, 4, 0, "l0")
  for i = 1, 2 do
    local dyi = dy * i
    local _, saved = r:linear_forward(ctx, x, w)
    local dw = nv.zeros(32, 64)
    local dx = r:linear_backward(ctx, dyi, saved, dw)
    local o = i == 1 and {} or {amax = dy:amax()}
    local ox = i == 1 and {axis = 1} or {axis = 1, amax = x:amax()}
    same(dx, nv.qmatmul(nv.quantize(dyi, "e5m2", o), nv.quantize(w, "e4m3", {amax = i == 1 and nil or w:amax()}):t(),
      {out = "bf16"}):float(), "dgrad step " .. i)
    local o1 = {axis = 1, amax = o.amax}
    same(dw, nv.qmatmul(nv.quantize(dyi, "e5m2", o1), nv.quantize(x, "e4m3", ox)), "wgrad step " .. i)
  end
  local keys = {}
  for k in pairs(r:state().histories) do keys[#keys + 1] = k end
  table.sort(keys)
  T.eq(keys, {"l0|dy|dgrad", "l0|dy|wgrad", "l0|w|fprop", "l0|x|fprop", "l0|x|wgrad"})
end)

T.case("state()/load_state(): a resumed recipe draws the same SR bits and uses the same histories (also via JSON)", function()
  local cjson = require "cjson"
  local x, w, dy = data(32, 64, 32, 12)
  local ctx = ctx_of(4, 32)
  local r1 = recipe.nvfp4({seed = 99})
  for _ = 1, 3 do
    local _, s = r1:linear_forward(ctx, x, w)
    r1:linear_backward(ctx, dy, s, nv.zeros(32, 64))
  end
  local st = r1:state()
  T.eq({st.seed, st.offset}, {99, 6})
  local function step(r)
    local _, s = r:linear_forward(ctx, x, w)
    local dw = nv.zeros(32, 64)
    return r:linear_backward(ctx, dy, s, dw), dw
  end
  local dx1, dw1 = step(r1)
  local r2 = recipe.nvfp4({seed = 1})
  r2:load_state(cjson.decode(cjson.encode(st)))
  T.eq(r2:generator():seed(), 99)
  T.eq(r2:generator():offset(), 6)
  local dx2, dw2 = step(r2)
  same(dx2, dx1, "resumed dgrad")
  same(dw2, dw1, "resumed wgrad")
  -- a fresh recipe of the original seed without the state draws other bits
  local _, dw3 = step(recipe.nvfp4({seed = 99}))
  T.ok(dw3:ne(dw1):sum() > 0, "without the state the draws differ")
  -- fp8_delayed: the histories travel too
  local d1 = recipe.fp8_delayed({history = 4})
  for i = 1, 3 do local _, s = d1:linear_forward(ctx, x * i, w); d1:release(s) end
  local d2 = recipe.fp8_delayed({history = 4})
  d2:load_state(cjson.decode(cjson.encode(d1:state())))
  local ya = d1:linear_forward(ctx, x, w)
  local yb = d2:linear_forward(ctx, x, w)
  same(yb, ya, "resumed delayed scaling")
  same(ya, nv.qmatmul(nv.quantize(x, "e4m3", {amax = 3 * x:amax()}), nv.quantize(w, "e4m3", {amax = w:amax()}),
    {out = "bf16"}):float(), "the history's max")
  T.eq(d2:state(), d1:state(), "identical state after the same step")
  T.raises(function() d2:load_state({seed = 1}) end, "offset")
end)

-- ---- (e) f32 and bf16 ------------------------------------------------------------------------------

T.case("f32 recipe: plain fp32 GEMMs (x·wᵀ, dy·w, dw += dyᵀ·x)", function()
  local x, w, dy = data(24, 40, 20, 13) -- any sizes: nothing is blocked
  local r = recipe.f32()
  local ctx = ctx_of(0, 2)
  local y, saved = r:linear_forward(ctx, x, w)
  T.close(y, x:matmul(w:t()), 1e-6, 1e-6, "y")
  local dw0 = nv.randn(20, 40)
  local dw = dw0:clone()
  local dx = r:linear_backward(ctx, dy, saved, dw)
  T.close(dx, dy:matmul(w), 1e-6, 1e-9, "dx")
  T.close(dw, dw0 + dy:t():matmul(x), 1e-6, 1e-6, "dw")
  T.ok(not is_bf16_valued(y), "f32 output is not rounded to bf16")
  -- a 3-D input [B, T, K] is taken as [B*T, K]
  local x3 = x:reshape(4, 6, 40)
  local y3, s3 = r:linear_forward(ctx, x3, w)
  T.eq(y3:size(), {4, 6, 20})
  local dx3 = r:linear_backward(ctx, dy:reshape(4, 6, 20), s3, nil)
  T.eq(dx3:size(), {4, 6, 40})
end)

T.case("bf16 recipe: the bf16-rounded product of bf16-rounded inputs, fp32 accumulation", function()
  local x, w, dy = data(32, 64, 48, 14)
  local r = recipe.bf16()
  local ctx = ctx_of(0, 2)
  local y, saved = r:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "bf16"), nv.quantize(w, "bf16"), {out = "bf16"}):float(), "y")
  T.eq(y:dtype(), "bf16", "a bf16 activation")
  local xb, wb = x:bf16():float(), w:bf16():float()
  local ref = xb:matmul(wb:t())
  T.close(y, ref, 2 ^ -8, 1e-6, "within bf16 output rounding of the fp32 product")
  local dw = nv.zeros(48, 64)
  local dx = r:linear_backward(ctx, dy, saved, dw)
  same(dx, nv.qmatmul(nv.quantize(dy, "bf16"), nv.quantize(w, "bf16"):t(), {out = "bf16"}):float(), "dx")
  same(dw, nv.qmatmul(nv.quantize(dy, "bf16", {axis = 1}), nv.quantize(x, "bf16", {axis = 1})), "dw (f32)")
  -- against sgemm on the same bf16 values: both sum the same exact products in fp32, maybe in other
  -- orders (the CPU's bf16 units through oneDNN), so they differ by at most 2 gamma_K sum |a||b|,
  -- gamma_K = K u / (1 - K u), u = 2^-24, K = 32 tokens (S itself summed in fp32: times 1 + gamma_K)
  local dyb = dy:bf16():float()
  local K, u = 32, 2.0 ^ -24
  local gamma = K * u / (1 - K * u)
  local S = dyb:abs():t():matmul(xb:abs())
  local excess = ((dw - dyb:t():matmul(xb)):abs() - S * (2 * gamma * (1 + gamma))):max()
  T.ok(excess <= 0, "dw = fp32 product of bf16 inputs, up to the summation order: excess " .. excess)
end)

T.case("mxfp8 and fp8_cs GEMMs equal their explicit quantizations", function()
  local x, w, dy = data(64, 128, 64, 15)
  local ctx = ctx_of(0, 2)
  local r = recipe.mxfp8()
  local y, saved = r:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "mxfp8_e4m3"), nv.quantize(w, "mxfp8_e4m3"), {out = "bf16"}):float(), "mxfp8 y")
  local dw = nv.zeros(64, 128)
  local dx = r:linear_backward(ctx, dy, saved, dw)
  same(dx, nv.qmatmul(nv.quantize(dy, "mxfp8_e4m3"), nv.quantize(w, "mxfp8_e4m3", {axis = 1}), {out = "bf16"}):float(), "mxfp8 dx")
  same(dw, nv.qmatmul(nv.quantize(dy, "mxfp8_e4m3", {axis = 1}), nv.quantize(x, "mxfp8_e4m3", {axis = 1})), "mxfp8 dw")
  r = recipe.fp8_cs()
  y, saved = r:linear_forward(ctx, x, w)
  same(y, nv.qmatmul(nv.quantize(x, "e4m3"), nv.quantize(w, "e4m3"), {out = "bf16"}):float(), "fp8 y")
  dw = nv.zeros(64, 128)
  dx = r:linear_backward(ctx, dy, saved, dw)
  same(dx, nv.qmatmul(nv.quantize(dy, "e5m2"), nv.quantize(w, "e4m3", {axis = 1}), {out = "bf16"}):float(), "fp8 dx")
  same(dw, nv.qmatmul(nv.quantize(dy, "e5m2", {axis = 1}), nv.quantize(x, "e4m3", {axis = 1})), "fp8 dw")
end)

T.case("the GPU's dgrad weight (quantized again along the other axis with the fprop amax) = q:t() bit for bit", function()
  -- On a GPU a QTensor has no transpose, so dgrad re-quantizes W along dim 1; NUMERICS §2 makes
  -- that the same values as q:t() for 2-D nvfp4 tiles, per-tensor fp8, bf16 and f32. Checked here
  -- on the CPU, where both can be taken: codes, scale bytes and amax.
  -- q:t() is W^T [K, N] blocked along dim 2; the re-quantization is W [N, K] blocked along dim 1:
  -- one blocked layout (K rows of N), so the codes, scales and the dgrad product are the same.
  local _, w, dy = data(32, 64, 48, 21)
  w:mul_(3)
  local specs = {{format = "nvfp4", block = "2d"}, {format = "e4m3"}, {format = "e5m2"}, {format = "bf16"},
    {format = "f32"}}
  for _, s in ipairs(specs) do
    local q = nv.quantize(w, s.format, s.block and {block = s.block} or nil)
    local a, b = q:t(), recipe._transposed(q, w, s, true)
    local what = s.format .. (s.block and " 2d" or "")
    T.eq(b:size(), w:size(), what .. ": shape")
    same(b:dequantize():t():contiguous(), a:dequantize(), what .. ": values")
    if s.format ~= "bf16" and s.format ~= "f32" then
      same(b:codes():t():contiguous(), a:codes(), what .. ": codes")
      T.eq(b.amax, a.amax, what .. ": amax")
    end
    if s.format == "nvfp4" then same(b:scale_bytes():t():contiguous(), a:scale_bytes(), what .. ": scale bytes") end
    local qdy = nv.quantize(dy, s.format == "nvfp4" and "nvfp4" or s.format)
    same(nv.qmatmul(qdy, b, {out = "f32"}), nv.qmatmul(qdy, a, {out = "f32"}), what .. ": dgrad product")
    q:free(); a:free(); b:free(); qdy:free()
  end
end)

-- ---- (f) errors -------------------------------------------------------------------------------------

T.case("errors: unknown options list the valid ones; bad custom specs name the layer and the role", function()
  T.raises(function() recipe.nvfp4({rth = false}) end,
    "recipe.nvfp4: unknown option 'rth' (valid: act_dtype, bf16_first, bf16_last, fused_amax, rht, seed, sr, switch_at, w2d)")
  T.raises(function() recipe.fp8_delayed({histroy = 4}) end,
    "unknown option 'histroy' (valid: act_dtype, format, fused_amax, history, switch_at)")
  T.raises(function() recipe.mxfp8({scale_rule = "round"}) end, "option scale_rule must be one of rceil, floor")
  T.raises(function() recipe.bf16({rht = true}) end, "recipe.bf16: unknown option 'rht' (valid: act_dtype)")
  T.raises(function() recipe.nvfp4({sr = 1}) end, "option sr must be true or false")
  T.raises(function() recipe.nvfp4({bf16_last = -1}) end, "non-negative integer")
  T.raises(function() recipe.nvfp4({switch_at = {step = 5, fwd = true}}) end, "unknown field 'fwd'")
  T.raises(function() recipe.nvfp4({switch_at = 5}) end, "switch_at must be a table")
  T.raises(function() recipe.custom("nvfp4") end, "expects a function")
  local x, w = data(32, 64, 32, 16)
  local ctx = ctx_of(0, 2, 0, "model.layers.0.mlp.up_proj")
  local function run(fn) return function() recipe.custom(fn):linear_forward(ctx, x, w) end end
  T.raises(run(function(c) return c.operand == "w" and "fp4" or "nvfp4" end),
    "recipe custom: layer 'model.layers.0.mlp.up_proj' fprop operand w: unknown format 'fp4' (valid: f32, bf16, e4m3, e5m2, mxfp8_e4m3, mxfp8_e5m2, nvfp4, mxfp4)")
  T.raises(run(function() return {format = "nvfp4", blocks = "2d"} end), "fprop operand x: unknown spec field 'blocks'")
  T.raises(run(function() return nil end), "fprop operand x: the spec must be a format name or a table")
  T.raises(run(function() return {format = "e4m3", sr = true} end), "stochastic rounding is defined for e2m1 elements")
  T.raises(run(function() return {format = "nvfp4", block = "2d"} end), "fprop operand x: 2d (16x16) blocks are for weights only")
  T.raises(run(function(c) return {format = "nvfp4", rht = c.operand == "x"} end),
    "layer 'model.layers.0.mlp.up_proj' fprop: the RHT must be on both operands (x, w) or on neither")
  T.raises(run(function() return {format = "bf16", scale_rule = "floor"} end), "scale_rule is an mxfp8 option")
  T.raises(run(function() return {format = "mxfp8_e4m3", delayed = true} end), "delayed scaling needs a format with a global amax")
  -- nvfp4 without num_blocks cannot apply its depth rule
  T.raises(function() recipe.nvfp4():linear_forward({name = "l", block = 0, step = 0}, x, w) end, "needs ctx.num_blocks")
  T.raises(function() recipe.nvfp4():plan({}) end, "linears() method")
end)

T.case("share: siblings' activation quantizations computed once (same elements, spec, axis); SR, weights never", function()
  -- recipe.share(fn): inside fn a deterministic quantization of a view of the same elements is reused
  local quant = require "nvlua.quant"
  local r = recipe.nvfp4()
  local calls = 0
  local q0 = quant.quantize
  quant.quantize = function(...) calls = calls + 1; return q0(...) end
  local ok, err = pcall(function()
    nv.manual_seed(3)
    local x = nv.randn(64, 32):to("bf16")
    local plain = {format = "nvfp4"}
    local rht = {format = "nvfp4", rht = true}
    local sr = {format = "nvfp4", sr = true}
    local kept
    recipe.share(function()
      local a = r:_quantize(plain, x:reshape(64, 32), 2, "k", true)
      local b = r:_quantize(plain, x:view(64, 32), 2, "k", true) -- another handle on the same elements
      T.eq(calls, 1, "the second view reuses the first quantization")
      T.ok(rawequal(a, b), "the same QTensor")
      r:_quantize(plain, x, 1, "k", true)                       -- other axis: its own
      r:_quantize(rht, x, 1, "k", true)                         -- other spec: its own
      r:_quantize(rht, x:view(64, 32), 1, "k", true)            -- ...reused
      T.eq(calls, 3, "axis and spec are part of the key")
      r:_quantize(sr, x, 2, "k", true)
      r:_quantize(sr, x, 2, "k", true)                          -- SR draws differ: never reused
      T.eq(calls, 5, "SR quantizations are never shared")
      r:_quantize(plain, x:narrow(1, 1, 32), 2, "k", true)      -- other elements: its own
      T.eq(calls, 6, "a narrower view is other elements")
      local w = nv.randn(16, 32)
      r:_quantize(plain, w, 2, "w", false)
      r:_quantize(plain, w, 2, "w", false)                      -- weights (split false): never memoized
      T.eq(calls, 8, "weight copies are not shared (dgrad may keep them)")
      kept = a
    end)
    T.ok(kept:is_freed(), "the memo frees its copies when share returns")
    -- outside share nothing is reused
    calls = 0
    r:_quantize(plain, x, 2, "k", true)
    r:_quantize(plain, x, 2, "k", true)
    T.eq(calls, 2, "no memo outside share")
  end)
  quant.quantize = q0
  if not ok then error(err, 0) end
end)

T.case("share in the model: an nvfp4 Llama block quantizes x once for q/k/v and gate/up, same bits as unshared", function()
  local quant = require "nvlua.quant"
  local llama = require "nvlua.llama"
  local cfg = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 3,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32}
  local function run(shared)
    local rec = recipe.nvfp4({bf16_first = 0, bf16_last = 0}) -- every block nvfp4
    local m = llama.Llama(cfg, {recipe = rec, seed = 4})
    local g = nv.Generator(9)
    local x = (nv.rand(2, 16, {generator = g}) * 63):to("i64")
    local y = (nv.rand(2, 16, {generator = g}) * 63):to("i64")
    local calls, share0 = 0, recipe.share
    local core = require "nvlua.core"
    local q0, rc0 = quant.quantize, core.quantize_rowcol
    quant.quantize = function(...) calls = calls + 1; return q0(...) end
    core.quantize_rowcol = function(...) calls = calls + 2; return rc0(...) end -- two copies (x's fprop and wgrad)
    if not shared then recipe.share = function(fn, ...) return fn(...) end end
    local ok, loss = pcall(function() return m:forward_backward(x, y) end)
    quant.quantize, recipe.share, core.quantize_rowcol = q0, share0, rc0
    if not ok then error(loss, 0) end
    local grads = {}
    for _, e in ipairs(m:named_parameters()) do grads[e.name] = e.grad:clone() end
    return calls, loss, grads
  end
  local c1, l1, g1 = run(true)
  local c0, l0, g0 = run(false)
  -- per block: fprop x 5 -> 2 (q,k,v share; gate, up share), wgrad x 5 -> 2
  T.eq(c0 - c1, 3 * 6, "6 quantizations fewer per block")
  T.eq(l1, l0, "same loss")
  for name, g in pairs(g0) do same(g1[name], g, "grad " .. name) end
end)

T.case("weight_cache: each weight quantized once per optimizer step for every micro-batch, same bits; SR/delayed never", function()
  local quant = require "nvlua.quant"
  local llama = require "nvlua.llama"
  local cfg = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32}
  -- two micro-batches of one step; cached: inside one recipe.weight_cache (as train.lua), else with
  -- the cache disabled (Llama:forward_backward opens one of its own)
  local function run(make, cached)
    local m = llama.Llama(cfg, {recipe = make(), seed = 4})
    local params = {}
    for _, e in ipairs(m:named_parameters()) do params[e.param] = true end
    local g = nv.Generator(9)
    local calls, wc0 = 0, recipe.weight_cache
    local q0 = quant.quantize
    quant.quantize = function(t, ...) if params[t] then calls = calls + 1 end; return q0(t, ...) end
    if not cached then recipe.weight_cache = function(fn, ...) return fn(...) end end
    local losses = {}
    local ok, err = pcall(recipe.weight_cache, function()
      for i = 1, 2 do
        local x = (nv.rand(2, 16, {generator = g}) * 63):to("i64")
        local y = (nv.rand(2, 16, {generator = g}) * 63):to("i64")
        losses[i] = m:forward_backward(x, y, {scale = 0.5})
      end
      if cached then T.ok(recipe.weight_cache_size() > 0, "the open cache holds the weights' copies") end
    end)
    quant.quantize, recipe.weight_cache = q0, wc0
    if not ok then error(err, 0) end
    T.eq(recipe.weight_cache_size(), 0, "closed after the step")
    local grads = {}
    for _, e in ipairs(m:named_parameters()) do grads[e.name] = e.grad:clone() end
    return calls, losses, grads
  end
  local presets = {
    {"nvfp4", function() return recipe.nvfp4({bf16_first = 0, bf16_last = 0}) end, true},
    {"fp8_cs", recipe.fp8_cs, true}, {"mxfp8", recipe.mxfp8, true}, {"bf16", recipe.bf16, true},
    {"fp8_delayed", recipe.fp8_delayed, false}, -- the weights' amax histories: quantized at every use
  }
  for _, p in ipairs(presets) do
    local name, make, caches = p[1], p[2], p[3]
    local c1, l1, g1 = run(make, true)
    local c0, l0, g0 = run(make, false)
    T.ok(c1 > 0, name .. ": weights are quantized")
    if caches then T.eq(c0, 2 * c1, name .. ": two micro-batches quantize the weights as often as one does with the cache")
    else T.eq(c0 - c1, 1, name .. ": delayed-scaling weights are not cached (only the bf16 LM head's copy is)") end
    T.eq(l1, l0, name .. ": same losses")
    for pname, g in pairs(g0) do same(g1[pname], g, name .. ": grad " .. pname) end
  end
end)

T.case("weight_cache: a forward inside, its backward after the cache closed, recomputes; errors free the cache", function()
  nv.manual_seed(12)
  local r = recipe.nvfp4({sr = false})
  local ctx = {name = "l", block = 0, num_blocks = 1, step = 0}
  local x, w, dy = nv.randn(32, 64):to("bf16"), nv.randn(48, 64), nv.randn(32, 48):to("bf16")
  local y0, s0 = r:linear_forward(ctx, x, w)
  local dw0 = nv.zeros(48, 64)
  local dx0 = r:linear_backward(ctx, dy, s0, dw0)
  local y1, s1
  recipe.weight_cache(function() y1, s1 = r:linear_forward(ctx, x, w) end)
  T.ok(s1.qw_cached and s1.qw:is_freed(), "the saved weight copy was the cache's, freed with it")
  local dw1 = nv.zeros(48, 64)
  local dx1 = r:linear_backward(ctx, dy, s1, dw1)
  same(y1, y0, "fprop")
  same(dx1, dx0, "dgrad after the cache closed")
  same(dw1, dw0, "wgrad")
  local kept
  T.raises(function()
    recipe.weight_cache(function()
      kept = r:_quantize({format = "nvfp4", block = "2d"}, w, 2, "w")
      error("boom")
    end)
  end, "boom")
  T.ok(kept:is_freed() and recipe.weight_cache_size() == 0, "an error inside frees the cache and propagates")
end)
