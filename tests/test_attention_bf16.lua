-- test_attention_bf16.lua: bf16 attention on the CPU's AVX512-BF16 kernels (kernels/cpu/attention_bf16_cpu.c:
-- FlashAttention's numerics, P and dS rounded to bf16 before their products) against the reference attention,
-- within the bounds of tests/flash_bounds.lua (derived there from what the kernels round, shared with the CUDA
-- FlashAttention test). The route is taken when core.attention_flash_cpu() says so (a CPU with AVX512-BF16);
-- on other CPUs these cases skip and bf16 attention is the widened f32 op (test_bf16act.lua covers it).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local FB = dofile("tests/flash_bounds.lua")

local function need_route()
  if not core.attention_flash_cpu() then T.skip("this CPU has no AVX512-BF16: bf16 attention is the widened f32 op") end
end

local function ref(fn, ...) return T.with(nv.use_reference, true, fn, ...) end
local function wide(t) return t:to("f32") end

-- B, T, Hq, Hkv, D: ragged tiles (T = 1, 17, 69, 130 against tiles of 64 rows and 32 keys), GQA groups 1, 2 and 4,
-- head dims 64, 128 and two that are not multiples of 32 (40, 17: odd, the last pair half zero)
local SIZES = {
  {1, 1, 2, 1, 64}, {2, 17, 4, 2, 64}, {1, 69, 4, 1, 128}, {1, 130, 4, 2, 64}, {2, 70, 2, 2, 40}, {1, 33, 2, 1, 17},
}

local function inputs(sh)
  local B, Tn, Hq, Hkv, D = table.unpack(sh)
  local x = {q = FB.randb(B, Tn, Hq, D), k = FB.randb(B, Tn, Hkv, D), v = FB.randb(B, Tn, Hkv, D),
    dout = FB.randb(B, Tn, Hq, D)}
  local b = {}
  for name, t in pairs(x) do b[name] = t:to("bf16") end
  return x, b
end

T.case("bf16 attention on the CPU's bf16 units vs the reference, forward and backward, in the flash bounds", function()
  need_route()
  nv.manual_seed(31)
  for _, sh in ipairs(SIZES) do
    local B, Tn, Hq, Hkv, D = table.unpack(sh)
    local what = string.format("(B %d, T %d, Hq %d, Hkv %d, D %d)", B, Tn, Hq, Hkv, D)
    local scale = 1 / math.sqrt(D)
    local x, b = inputs(sh)
    local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
    local dq, dk, dv = ref(core.attention_backward, x.dout, x.q, x.k, x.v, out, lse, scale)
    x.lse, x.out = lse, out
    local bo, bq, bk, bv, e_lse = FB.bounds(x, scale, true, true)
    local o, l = core.attention_forward(b.q, b.k, b.v, scale)
    T.eq({o:dtype(), l:dtype()}, {"bf16", "f32"}, "out bf16, lse f32 " .. what)
    FB.within(o, out, bo, "out " .. what)
    FB.within(l, lse, nv.full(lse:size(), e_lse), "lse " .. what)
    local gq, gk, gv = core.attention_backward(b.dout, b.q, b.k, b.v, o, l, scale)
    T.eq({gq:dtype(), gk:dtype(), gv:dtype()}, {"bf16", "bf16", "bf16"}, "gradients are bf16 " .. what)
    FB.within(gq, dq, bq, "dq " .. what)
    FB.within(gk, dk, bk, "dk " .. what)
    FB.within(gv, dv, bv, "dv " .. what)
  end
end)

T.case("the route is the flash numerics, not the widened op; attention_flash(false) gives the widened op", function()
  need_route()
  nv.manual_seed(32)
  local _, b = inputs({2, 70, 4, 2, 64})
  local o1 = core.attention_forward(b.q, b.k, b.v, 0.125)
  local prev = core.attention_flash(false)
  T.eq(core.attention_flash_cpu(), false, "the switch turns the CPU route off")
  local o2 = core.attention_forward(b.q, b.k, b.v, 0.125)
  core.attention_flash(prev)
  -- off: exactly the widened f32 op rounded once (NUMERICS §11)
  local o3 = core.attention_forward(wide(b.q), wide(b.k), wide(b.v), 0.125):to("bf16")
  T.eq(o2:to("f32"):ne(o3:to("f32")):sum(), 0, "route off = the widened op, bit for bit")
  -- on: rounding P to bf16 moves some outputs by a bf16 ulp or more (the route ran, and it is not the rule)
  T.ok(o1:to("f32"):ne(o3:to("f32")):sum() > 0, "route on differs from the widened op somewhere")
end)

T.case("the CPU route keeps NaN where the reference has it; strided inputs go to the widened op", function()
  need_route()
  nv.manual_seed(33)
  local x, b = inputs({1, 40, 2, 1, 64})
  -- an inf in a key row: scores against it are inf or NaN in both kernels (rows after it attend to it)
  local k = x.k:clone()
  k:narrow(2, 10, 1):fill_(1 / 0)
  local want = ref(core.attention_forward, x.q, k, x.v, 0.125)
  local got = core.attention_forward(b.q, k:to("bf16"), b.v, 0.125)
  local w, g = want:reshape(-1):totable(), got:to("f32"):reshape(-1):totable()
  local agree = 0
  for i = 1, #w do
    if (w[i] ~= w[i]) == (g[i] ~= g[i]) then agree = agree + 1 end
  end
  T.eq(agree, #w, "NaN positions agree with the reference")
  -- a strided q (a transposed view) is not the route's layout: the widened op runs and gives its result
  local qs = b.q:transpose(2, 3):contiguous():transpose(2, 3)
  T.eq(qs:is_contiguous(), false, "the view is strided")
  local o = core.attention_forward(qs, b.k, b.v, 0.125)
  local o_rule = core.attention_forward(wide(b.q), wide(b.k), wide(b.v), 0.125):to("bf16")
  T.eq(o:to("f32"):ne(o_rule:to("f32")):sum(), 0, "strided inputs: the widened op")
end)

-- The route setting on the CPU (core/layers.h nvl_attention_route): cuDNN is CUDA's, so attention=auto takes the
-- CPU's kernels (or the widened op) and says why not cuDNN; attention=cudnn refuses CPU tensors by name;
-- attention=reference is the widened op; attention=flash the CPU's kernels as auto. Runs on every CPU.
T.case("attention routes on the CPU: auto and flash take the CPU's kernels, reference the rule, cudnn refuses", function()
  nv.manual_seed(34)
  local _, b = inputs({1, 24, 4, 2, 64})
  local native = core.attention_flash_cpu() and "cpu_bf16" or "widened"
  T.eq(core.attention_route(), "auto", "auto is the default")
  local r, why = core.attention_route_of(b.q, b.k, b.v)
  T.eq(r, native, "auto on the CPU")
  T.ok(why:find("CUDA", 1, true), "auto says why not cuDNN: " .. why)
  local o_auto = core.attention_forward(b.q, b.k, b.v, 0.125)
  local o_rule = core.attention_forward(wide(b.q), wide(b.k), wide(b.v), 0.125):to("bf16")
  T.with(core.attention_route, "flash", function()
    T.eq(core.attention_route_of(b.q, b.k, b.v), native, "flash on the CPU")
    T.eq(core.attention_forward(b.q, b.k, b.v, 0.125):to("f32"):ne(o_auto:to("f32")):sum(), 0, "flash = auto here")
  end)
  T.with(core.attention_route, "reference", function()
    T.eq(core.attention_route_of(b.q, b.k, b.v), "widened", "reference on the CPU")
    T.eq(core.attention_flash_cpu(), false, "the CPU's kernels are off under reference")
    T.eq(core.attention_forward(b.q, b.k, b.v, 0.125):to("f32"):ne(o_rule:to("f32")):sum(), 0, "reference = the rule")
  end)
  T.with(core.attention_route, "cudnn", function()
    T.eq(core.attention_route_of(b.q, b.k, b.v), "error", "cudnn on the CPU")
    T.raises(function() core.attention_forward(b.q, b.k, b.v, 0.125) end, "attention=cudnn cannot run these activations")
    T.raises(function() core.attention_forward(wide(b.q), wide(b.k), wide(b.v), 0.125) end, "f32")
  end)
  T.eq(core.attention_route_of(wide(b.q), wide(b.k), wide(b.v)), "f32", "f32 activations: the f32 op")
  -- the old switch: off is the reference route, on restores the route set before it
  T.with(core.attention_route, "flash", function()
    T.eq(core.attention_flash(false), true, "the switch read on")
    T.eq(core.attention_route(), "reference", "off = reference")
    core.attention_flash(true)
    T.eq(core.attention_route(), "flash", "on restored flash")
  end)
  T.raises(function() core.attention_route("fast") end, "invalid option 'fast'")
  local info = core.attention_cudnn()
  if not nv.cuda.available() then
    T.eq(info.available, false, "no cuDNN route without a GPU")
    T.ok(info.reason ~= "", "and a reason: " .. info.reason)
  end
  -- built with cuDNN's headers: libcudnn is opened with dlopen (no GPU needed) and has every function the route
  -- calls, reporting a cuDNN 9 version; or the reason names the library (a machine without it)
  if info.compiled_version > 0 then
    if info.library_loads then
      T.eq(info.version // 10000, 9, "the loaded library is cuDNN 9: " .. info.version)
    else
      T.ok(info.library_error:find("libcudnn", 1, true), "why libcudnn does not load: " .. info.library_error)
    end
  else
    T.eq({info.library_loads, info.version}, {false, 0}, "built without cuDNN")
  end
end)
