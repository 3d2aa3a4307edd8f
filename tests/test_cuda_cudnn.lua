-- test_cuda_cudnn.lua: attention through cuDNN's fused SDPA (kernels/cuda/cudnn_attn.cu, core.cuda_cudnn_attention
-- and its backward; the route core.attention_route / the train key attention=) against the CPU reference
-- attention, the route's choices and refusals, its plan cache, and the checks of the CUDA emulator's cuDNN
-- stand-in (kernels/cuda/emu/cudnn.cpp). Every case needs a GPU and skips without one; CI runs them on the CPU
-- emulation of CUDA (scripts/test.sh --emu), where cuDNN is the stand-in: results there are the CPU model of a
-- fused kernel, within the bounds below, not cuDNN's, and nothing here has run on a GPU yet.
--
-- Bounds: tests/flash_bounds.lua's, derived for FlashAttention's numerics (fp32 scores, softmax and
-- accumulation; P and dS rounded to bf16 before their products; outputs rounded once; for cuDNN's backward under
-- GQA, each query head's dk and dv rounded to bf16 before the group's sum, as measured on an H200), which is what cuDNN's
-- fused kernels compute up to the order of their fp32 sums (and, on a GPU, its exp2-based softmax: an extra
-- argument rounding of u |scale s|, inside the 2 (D + 2) u scale sum|q||k| the bound allows the scores). The lse
-- is held tighter than the outputs: |d lse| <= ep + ea + 4 u (|lse| + ln T + 1) (the row max, the log and the
-- final add each round once in fp32 at magnitudes up to |lse| + ln T; one u more for a GPU's log2-domain
-- arithmetic), not the outputs' extra 2^-8 |lse|.
-- Every device output is allocated poisoned (0xFF bytes), so an element the route leaves unwritten fails.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local need_gpu, need_emu = T.need_gpu, T.need_emu

local FB = dofile("tests/flash_bounds.lua")
local bounds, within, randb, dense_ref = FB.bounds, FB.within, FB.randb, FB.dense_ref

local function flat(t) return t:cpu():to("f32"):contiguous():reshape(-1):totable() end
local function poisoned(fn, ...) return T.with(core.cuda_set_poison, 0xFF, fn, ...) end
local function ref(fn, ...) return T.with(nv.use_reference, true, fn, ...) end
local function same(a, b, what) T.eq(flat(a), flat(b), what) end

-- |got - want| <= e + 4 u (|want| + ln T + 1) elementwise (the lse bound above)
local function within_lse(got, want, e, Tn, what)
  local g, w, u = flat(got), flat(want), 2 ^ -24
  T.eq(#g, #w, what .. ": number of elements")
  local bad, wi = 0, 1
  for i = 1, #w do
    if not (math.abs(g[i] - w[i]) <= e + 4 * u * (math.abs(w[i]) + math.log(Tn) + 1)) then bad, wi = bad + 1, i end
  end
  T.ok(bad == 0, bad == 0 and what or string.format("%s: %d of %d out of bounds, e.g. [%d]: %.9g vs %.9g", what, bad,
    #w, wi, g[wi], w[wi]))
end

-- B, T, Hq, Hkv, D: GQA ratios 1, 2 and 4; D 64 and 128; T from 2 (the least cuDNN's backward takes) through
-- lengths that are and are not multiples of 64 and 128 (cuDNN's tiles)
local SIZES = {
  {1, 2, 2, 1, 64}, {2, 17, 4, 4, 64}, {1, 69, 4, 1, 128}, {1, 128, 4, 2, 64}, {1, 130, 2, 2, 128}, {1, 200, 8, 2, 64},
}

-- q, k, v (and dout) for shape sh: f32 tensors holding bf16 values, and their bf16 cuda copies
local function inputs(sh, backward)
  local B, Tn, Hq, Hkv, D = table.unpack(sh)
  local x = {q = randb(B, Tn, Hq, D), k = randb(B, Tn, Hkv, D), v = randb(B, Tn, Hkv, D)}
  if backward then x.dout = randb(B, Tn, Hq, D) end
  local d = {}
  for name, t in pairs(x) do d[name] = t:to("bf16"):cuda() end
  return x, d
end

local function label(sh) return string.format("(B %d, T %d, Hq %d, Hkv %d, D %d)", table.unpack(sh)) end

-- ---- numerics against the reference ------------------------------------------------------------------------

T.case("cuDNN attention forward vs the reference: causal, GQA 1/2/4, D 64 and 128, T 2..200", function()
  need_gpu()
  nv.manual_seed(21)
  for _, sh in ipairs(SIZES) do
    local what, D, Tn = label(sh), sh[5], sh[2]
    local scale = 1 / math.sqrt(D)
    local x, d = inputs(sh, false)
    local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
    x.lse = lse
    local bo, _, _, _, e_lse = bounds(x, scale, true, false)
    poisoned(function()
      local o, l = core.cuda_cudnn_attention(d.q, d.k, d.v, scale)
      T.eq({o:dtype(), l:dtype(), l:size()}, {"bf16", "f32", {sh[1], sh[3], Tn}}, "out bf16, lse f32 (B, Hq, T)")
      within(o, out, bo, "cudnn out " .. what)
      within_lse(l, lse, e_lse, Tn, "cudnn lse " .. what)
      -- the attention entry (what nn.Attention calls) takes this route by default: the same bits
      T.eq(core.attention_route_of(d.q, d.k, d.v), "cudnn", "attention=auto routes to cuDNN " .. what)
      local ao, al = core.attention_forward(d.q, d.k, d.v, scale)
      same(ao, o, "routed out " .. what); same(al, l, "routed lse " .. what)
    end)
  end
end)

T.case("cuDNN attention backward vs the reference (default and deterministic graphs)", function()
  need_gpu()
  nv.manual_seed(22)
  for _, sh in ipairs(SIZES) do
    local what, D = label(sh), sh[5]
    local scale = 1 / math.sqrt(D)
    local x, d = inputs(sh, true)
    local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
    local dq, dk, dv = ref(core.attention_backward, x.dout, x.q, x.k, x.v, out, lse, scale)
    x.lse, x.out = lse, out
    local _, bq, bk, bv = bounds(x, scale, true, true, 1, true)
    poisoned(function()
      local o, l = core.cuda_cudnn_attention(d.q, d.k, d.v, scale)
      local gq, gk, gv = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale)
      T.eq({gq:dtype(), gk:dtype(), gv:dtype()}, {"bf16", "bf16", "bf16"}, "gradients are bf16")
      within(gq, dq, bq, "cudnn dq " .. what)
      within(gk, dk, bk, "cudnn dk " .. what)
      within(gv, dv, bv, "cudnn dv " .. what)
      local aq, ak, av = core.attention_backward(d.dout, d.q, d.k, d.v, o, l, scale)
      same(aq, gq, "routed dq " .. what); same(ak, gk, "routed dk " .. what); same(av, gv, "routed dv " .. what)
      -- the deterministic graph (no fp32 dq atomics): within the same bounds, and the same bits run to run
      local q1, k1, v1 = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale, true, true)
      local q2, k2, v2 = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale, true, true)
      within(q1, dq, bq, "deterministic dq " .. what)
      within(k1, dk, bk, "deterministic dk " .. what)
      within(v1, dv, bv, "deterministic dv " .. what)
      same(q2, q1, "deterministic dq twice " .. what); same(k2, k1, "deterministic dk twice " .. what)
      same(v2, v1, "deterministic dv twice " .. what)
      -- through the route's switch too
      T.with(core.attention_cudnn_deterministic, true, function()
        same(core.attention_backward(d.dout, d.q, d.k, d.v, o, l, scale), q1, "routed deterministic dq " .. what)
      end)
    end)
  end
end)

T.case("cuDNN attention without the causal mask, forward and backward, vs dense f32 formulas", function()
  need_gpu()
  nv.manual_seed(23)
  for _, sh in ipairs({{2, 17, 4, 2, 64}, {1, 69, 2, 1, 128}}) do
    local what, D, Tn = "non-causal " .. label(sh), sh[5], sh[2]
    local scale = 1 / math.sqrt(D)
    local x, d = inputs(sh, true)
    local out, lse, dq, dk, dv = dense_ref(x, scale)
    x.lse, x.out = lse, out
    local bo, bq, bk, bv, e_lse = bounds(x, scale, false, true, 2, true)
    poisoned(function()
      local o, l = core.cuda_cudnn_attention(d.q, d.k, d.v, scale, false)
      within(o, out, bo, "cudnn out " .. what)
      within_lse(l, lse, e_lse, Tn, "cudnn lse " .. what)
      local gq, gk, gv = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale, false)
      within(gq, dq, bq, "cudnn dq " .. what)
      within(gk, dk, bk, "cudnn dk " .. what)
      within(gv, dv, bv, "cudnn dv " .. what)
    end)
  end
end)

-- cuDNN's Stats is the logsumexp every route saves: a backward may follow another route's forward
T.case("cuDNN's backward from the flash kernels' forward (and the reverse) stays within the bounds", function()
  need_gpu()
  nv.manual_seed(24)
  local sh = {1, 69, 4, 2, 64}
  local scale = 1 / 8
  local x, d = inputs(sh, true)
  local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
  local dq, dk, dv = ref(core.attention_backward, x.dout, x.q, x.k, x.v, out, lse, scale)
  x.lse, x.out = lse, out
  local _, bq, bk, bv = bounds(x, scale, true, true)
  local _, cq, ck, cv = bounds(x, scale, true, true, 1, true) -- cuDNN's GQA rounding (tests/flash_bounds.lua)
  local fo, fl = core.cuda_flash_attention(d.q, d.k, d.v, scale)
  local gq, gk, gv = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, fo, fl, scale)
  within(gq, dq, cq, "cudnn dq after flash"); within(gk, dk, ck, "cudnn dk after flash")
  within(gv, dv, cv, "cudnn dv after flash")
  local co, cl = core.cuda_cudnn_attention(d.q, d.k, d.v, scale)
  local hq, hk, hv = core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, co, cl, scale)
  within(hq, dq, bq, "flash dq after cudnn"); within(hk, dk, bk, "flash dk after cudnn")
  within(hv, dv, bv, "flash dv after cudnn")
end)

-- ---- the route ------------------------------------------------------------------------------------------

T.case("attention=auto|flash|cudnn|reference: which kernels run, the same bits as calling them", function()
  need_gpu()
  nv.manual_seed(25)
  T.eq(core.attention_route(), "auto", "auto is the default")
  for _, sh in ipairs({{1, 33, 4, 2, 64}, {2, 20, 2, 1, 128}}) do
    local what, scale = label(sh), 1 / math.sqrt(sh[5])
    local _, d = inputs(sh, true)
    local co, cl = core.cuda_cudnn_attention(d.q, d.k, d.v, scale)
    local cq = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, co, cl, scale)
    local fo, fl = core.cuda_flash_attention(d.q, d.k, d.v, scale)
    local fq = core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, fo, fl, scale)
    local f32 = function(t) return t:to("f32") end
    local wo, wl = core.attention_forward(f32(d.q), f32(d.k), f32(d.v), scale)
    local wq = core.attention_backward(f32(d.dout), f32(d.q), f32(d.k), f32(d.v), f32(fo), fl, scale)
    local want = {auto = {"cudnn", co, cl, cq, co, cl}, cudnn = {"cudnn", co, cl, cq, co, cl},
      flash = {"flash", fo, fl, fq, fo, fl}, reference = {"widened", wo:to("bf16"), wl, wq:to("bf16"), fo, fl}}
    for _, r in ipairs({"auto", "cudnn", "flash", "reference"}) do
      T.with(core.attention_route, r, function()
        local w = want[r]
        T.eq(core.attention_route_of(d.q, d.k, d.v), w[1], "attention=" .. r .. " " .. what)
        local o, l = core.attention_forward(d.q, d.k, d.v, scale)
        same(o, w[2], r .. " out " .. what); same(l, w[3], r .. " lse " .. what)
        same(core.attention_backward(d.dout, d.q, d.k, d.v, w[5], w[6], scale), w[4], r .. " dq " .. what)
      end)
    end
  end
  T.raises(function() core.attention_route("fast") end, "invalid option 'fast'")
  T.eq(core.attention_route(), "auto", "a refused name changes nothing")
end)

T.case("what cuDNN's route does not take: auto falls back and says why, cudnn raises with the reason", function()
  need_gpu()
  nv.manual_seed(26)
  local function qkv(B, Tn, D, dt, dev)
    local t = {}
    for i, H in ipairs({4, 2, 2}) do
      t[i] = nv.randn(B, Tn, H, D):to(dt or "bf16")
      if dev ~= "cpu" then t[i] = t[i]:cuda() end
    end
    return t[1], t[2], t[3]
  end
  local cases = { -- what, q, k, v, auto's kernels, the reason's text
    {"head dim 96", {qkv(1, 8, 96)}, "widened", "head dim 64 or 128, got 96"},
    {"head dim 32", {qkv(1, 8, 32)}, "widened", "head dim 64 or 128, got 32"},
    {"T = 1", {qkv(1, 1, 64)}, "flash", "T >= 2"},
    {"f32 activations", {qkv(1, 8, 64, "f32")}, "f32", "f32"},
    {"cpu tensors", {qkv(1, 8, 64, "bf16", "cpu")}, nil, "runs on CUDA tensors"},
    {"B = 0", {qkv(0, 8, 64)}, nil, "no empty problem"},
  }
  -- a strided q (every other 64-element half of a 128-wide row) and a q 2 bytes past a 16-byte boundary
  local wide = nv.randn(1, 8, 4, 128):to("bf16"):cuda()
  local _, k8, v8 = qkv(1, 8, 64)
  cases[#cases + 1] = {"a strided q", {wide:narrow(4, 1, 64), k8, v8}, "widened", "strided"}
  local flatq = nv.randn(1 + 8 * 4 * 64):to("bf16"):cuda()
  cases[#cases + 1] = {"a misaligned q", {flatq:narrow(1, 2, 8 * 4 * 64):view(1, 8, 4, 64), k8, v8}, "widened",
    "not 16-byte aligned"}
  for _, c in ipairs(cases) do
    local q, k, v = table.unpack(c[2])
    local scale = 0.125
    local got, why = core.attention_route_of(q, k, v)
    if c[3] then T.eq(got, c[3], "auto's kernels for " .. c[1]) end
    if c[3] ~= "f32" then T.ok(why:find(c[4], 1, true), "auto says why for " .. c[1] .. ": " .. why) end
    core.attention_forward(q, k, v, scale) -- auto runs them
    T.with(core.attention_route, "cudnn", function()
      T.eq(core.attention_route_of(q, k, v), "error", "attention=cudnn on " .. c[1])
      local err = T.raises(function() core.attention_forward(q, k, v, scale) end, c[4], "attention=cudnn on " .. c[1])
      T.ok(err:find("attention=cudnn cannot run these activations", 1, true), err)
    end)
  end
  -- the direct call names the rule too
  local q, k, v = qkv(1, 8, 96)
  T.raises(function() core.cuda_cudnn_attention(q, k, v, 0.1) end, "head dim 64 or 128, got 96")
  q, k, v = qkv(1, 8, 64, "f32")
  T.raises(function() core.cuda_cudnn_attention(q, k, v, 0.1) end, "q must be a 4-D bf16")
  q, k, v = qkv(1, 8, 64)
  T.raises(function() core.cuda_cudnn_attention(q, k, v, math.huge) end, "scale must be finite")
  local o, l = core.cuda_cudnn_attention(q, k, v, 0.1)
  T.raises(function() core.cuda_cudnn_attention_backward(q, q, k, v, o, l:to("bf16"), 0.1) end, "lse must be a 3-D f32")
  T.raises(function() core.cuda_cudnn_attention_backward(q, q, k, v, o, l, 0.1, true, "yes") end, "boolean expected")
end)

-- ---- plans ----------------------------------------------------------------------------------------------

local function stats() return core.attention_cudnn() end
local function delta(a, b, keys)
  local d = {}
  for _, k in ipairs(keys) do d[k] = b[k] - a[k] end
  return d
end

T.case("one cuDNN plan per problem: built at the first call, then from the cache; least recently used out", function()
  need_gpu()
  nv.manual_seed(27)
  core.attention_cudnn_clear_cache()
  local keys = {"graphs_built", "cache_hits", "executions", "evictions"}
  local s0 = stats()
  T.eq(s0.cached, 0, "an empty cache")
  local emu = nv.cuda.emulated() and core.cuda_emu_counters()
  local function fwd(Tn)
    local _, d = inputs({1, Tn, 2, 1, 64}, false)
    return d, core.cuda_cudnn_attention(d.q, d.k, d.v, 0.125)
  end
  local d20, o20, l20 = fwd(20)
  fwd(20)
  fwd(21)
  local dout = nv.randn(1, 20, 2, 64):to("bf16"):cuda()
  core.cuda_cudnn_attention_backward(dout, d20.q, d20.k, d20.v, o20, l20, 0.125)
  core.cuda_cudnn_attention_backward(dout, d20.q, d20.k, d20.v, o20, l20, 0.125)
  core.cuda_cudnn_attention_backward(dout, d20.q, d20.k, d20.v, o20, l20, 0.125, true, true)
  core.cuda_cudnn_attention(d20.q, d20.k, d20.v, 0.125, false)
  local s1 = stats()
  -- forward T 20, forward T 21, backward T 20, deterministic backward T 20, non-causal forward T 20
  T.eq(delta(s0, s1, keys), {graphs_built = 5, cache_hits = 2, executions = 7, evictions = 0}, "plans built and reused")
  T.eq(s1.cached, 5, "five plans held")
  T.ok(s1.last_workspace > 0, "the last plan asked for a workspace (it came from the call scratch)")
  if emu then -- the stand-in's own count of plans finalized and executions run
    local e1 = core.cuda_emu_counters()
    T.eq({e1.cudnn_plans - emu.cudnn_plans, e1.cudnn_executes - emu.cudnn_executes}, {5, 7},
      "the emulator saw the same")
  end
  -- 32 plans at most: 33 problems evict the least recently used one (nvlua's bookkeeping: checked under the
  -- emulator, where a plan costs nothing; on a GPU 33 plan builds would spend the session's minutes)
  if not T.emulated() then return end
  core.attention_cudnn_clear_cache()
  local s2 = stats()
  for Tn = 2, 34 do fwd(Tn) end
  local s3 = stats()
  T.eq(delta(s2, s3, keys), {graphs_built = 33, cache_hits = 0, executions = 33, evictions = 1}, "33 problems")
  T.eq(s3.cached, 32, "the cache holds 32")
  fwd(34)
  T.eq(stats().cache_hits - s3.cache_hits, 1, "the newest is still cached")
  fwd(2)
  T.eq({stats().graphs_built - s3.graphs_built, stats().evictions - s3.evictions}, {1, 1}, "the oldest was evicted")
end)

-- ---- the emulator's cuDNN stand-in checks the API ---------------------------------------------------------

T.case("the emulator's cuDNN stand-in refuses broken wiring, naming the rule", function()
  need_emu()
  nv.manual_seed(28)
  local _, d = inputs({1, 19, 4, 2, 64}, true)
  local o, l = core.cuda_cudnn_attention(d.q, d.k, d.v, 0.125)
  local want = core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, 0.125)
  local rules = { -- NVL_CUDNN_BREAK_* (kernels/cuda/cudnn_attn.h), what the stand-in says
    [1] = "the top-left causal mask is axis 2 (the query) >= axis 3 (the key)",
    [2] = "must be BFLOAT16",
    [3] = "has no pointer in the variant pack",
    [4] = "bytes of workspace",
    [5] = "byte alignment 12 is not a power of two",
    [6] = "Stats (uid 5",
    [7] = "is not a live descriptor",
    [8] = "the descriptor is finalized",
    [9] = "names two tensor descriptors in one graph",
    [10] = "in-place execution is not modelled",
  }
  for rule = 1, 10 do
    T.with(core.cuda_cudnn_break, rule, function()
      local err = T.raises(function() core.cuda_cudnn_attention(d.q, d.k, d.v, 0.125) end, rules[rule], "rule " .. rule)
      T.ok(err:find("cuDNN stand-in of the cuda emulator", 1, true), "the stand-in's message: " .. err)
    end)
  end
  -- the backward's graph is checked as well (a mask with its axes swapped)
  T.with(core.cuda_cudnn_break, 1, function()
    T.raises(function() core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, 0.125) end,
      "not the SDPA backward pattern")
  end)
  -- after them, the route works again and gives the same bits
  same(core.cuda_cudnn_attention_backward(d.dout, d.q, d.k, d.v, o, l, 0.125), want, "a clean call after the refusals")
end)

-- cuDNN saying it has no engine for a graph (NOT_SUPPORTED: nothing ran) sends attention=auto on to the flash
-- kernels, and the refusal is remembered per problem; any other cuDNN failure is the call's error
T.case("no engine for a problem: attention=auto falls back to flash (remembered), attention=cudnn raises", function()
  need_emu()
  nv.manual_seed(29)
  local _, d = inputs({1, 21, 4, 2, 64}, true)
  local fo, fl = core.cuda_flash_attention(d.q, d.k, d.v, 0.125)
  local fq = core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, fo, fl, 0.125)
  T.with(core.cuda_cudnn_break, 1, function() -- a mask cuDNN has no pattern for: its heuristics refuse the graph
    local s0 = stats()
    local o, l = core.attention_forward(d.q, d.k, d.v, 0.125)
    same(o, fo, "auto fell back to the flash kernels: out"); same(l, fl, "auto fell back: lse")
    same(core.attention_backward(d.dout, d.q, d.k, d.v, o, l, 0.125), fq, "auto fell back: dq")
    core.attention_forward(d.q, d.k, d.v, 0.125)
    T.eq(stats().graphs_built - s0.graphs_built, 0, "no plan was built")
    T.eq(stats().executions - s0.executions, 0, "and nothing ran")
    T.eq(stats().refusals - s0.refusals, 2, "the forward's and the backward's problems refused, once each")
    T.ok(stats().last_refusal:find("no engine for the SDPA backward graph", 1, true), stats().last_refusal)
    T.with(core.attention_route, "cudnn", function()
      T.raises(function() core.attention_forward(d.q, d.k, d.v, 0.125) end, "has no engine for the SDPA forward graph")
    end)
  end)
  T.with(core.cuda_cudnn_break, 5, function() -- an invalid descriptor: an error, also under auto
    T.raises(function() core.attention_forward(d.q, d.k, d.v, 0.125) end, "byte alignment 12")
  end)
  same(core.attention_forward(d.q, d.k, d.v, 0.125), core.cuda_cudnn_attention(d.q, d.k, d.v, 0.125),
    "cuDNN runs again once the rule is kept")
end)

-- ---- the library: missing, or a version the route does not take --------------------------------------------

-- a child nvlua with the emulator's cuDNN stand-in playing another library: the route's choice and reasons
local PROBE = [[
local nv = require "nvlua"; local core = nv.core
local function qkv(Tn)
  local t = {}
  for i, H in ipairs({2, 1, 1}) do t[i] = nv.randn(1, Tn, H, 64):to("bf16"):cuda() end
  return t
end
for _, Tn in ipairs({130, 256}) do
  local x = qkv(Tn)
  local r, why = core.attention_route_of(x[1], x[2], x[3])
  local o = core.attention_forward(x[1], x[2], x[3], 0.125)
  print(string.format("T=%d route=%s why=%s ran=%s", Tn, r, why, tostring(o:size(2) == Tn)))
end
local a = core.attention_cudnn()
print("available=" .. tostring(a.available) .. " reason=" .. a.reason)
core.attention_route("cudnn")
local x = qkv(256)
local ok, err = pcall(core.attention_forward, x[1], x[2], x[3], 0.125)
print("strict=" .. (ok and "ran" or (tostring(err):gsub("\n.*", ""))))
]]

T.case("where cuDNN is missing or too old the route falls back and says why; attention=cudnn refuses", function()
  need_emu()
  local dir = T.tmpdir()
  local script = T.write_file(dir .. "/probe.lua", PROBE)
  local function probe(env)
    local r = T.run_nvlua(T.shq(script), {env = env})
    T.eq(r.code, 0, "the probe ran: " .. r.err)
    return r.out
  end
  local out = probe({NVLUA_EMU_CUDNN = "missing"})
  T.ok(out:find("T=256 route=flash why=[^\n]*cannot load libcudnn.so.9") and out:find("ran=true"), out)
  T.ok(out:find("available=false reason=[^\n]*cannot load libcudnn.so.9"), out)
  T.ok(out:find("strict=[^\n]*attention=cudnn cannot run these activations[^\n]*cannot load libcudnn"), out)
  -- 9.15: the backward bug cudnn-frontend works around with a padding mask unless T is a multiple of 128
  out = probe({NVLUA_EMU_CUDNN_VERSION = "91500"})
  T.ok(out:find("T=130 route=flash why=[^\n]*T a multiple of 128"), out)
  T.ok(out:find("T=256 route=cudnn why= ran=true") and out:find("strict=ran"), out)
  out = probe({NVLUA_EMU_CUDNN_VERSION = "90500"})
  T.ok(out:find("T=256 route=flash why=[^\n]*older than 9.6.0"), out)
  out = probe({NVLUA_EMU_CUDNN_VERSION = "91000"})
  T.ok(out:find("T=256 route=flash why=[^\n]*known bf16 SDPA bug"), out)
  T.rm_tree(dir)
end)

-- ---- through the model and the training loop ----------------------------------------------------------------

T.case("a Llama (head dim 64) trains on cuda under attention=cudnn: step 1 as the rule's, and it learns", function()
  need_gpu()
  local curve = dofile("tests/curve.lua")
  local cfg = {vocab_size = 64, hidden_size = 256, intermediate_size = 256, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64} -- head dim 64
  local e0 = stats().executions
  local c = T.with(core.attention_route, "cudnn", curve.losses, "cuda", "bf16", 12, {cfg = cfg})
  T.ok(stats().executions - e0 >= 12 * 2 * 2, "cuDNN ran every layer's forward and backward")
  local r = T.with(core.attention_route, "reference", curve.losses, "cuda", "bf16", 1, {cfg = cfg})
  -- one bf16 ulp of the logits' effect (test_cuda_train.lua's step-1 bound): the routes differ by roundings
  T.ok(math.abs(c[1] - r[1]) / r[1] <= 0.005, string.format("step 1: cudnn %.6f vs reference rule %.6f", c[1], r[1]))
  T.ok(c[12] < c[1] - 0.3, string.format("it learns: %.4f -> %.4f", c[1], c[12]))
end)

T.case("a run with attention=cudnn says so and trains; one where cuDNN is missing falls back and says why", function()
  need_emu() -- child processes with the emulator's stand-in playing a machine with and without cuDNN
  local dir = T.tmpdir()
  local corpus = T.write_corpus(dir .. "/corpus.txt", {seed = 5, lines = 400, words = {"alpha", "beta", "gamma",
    "delta", "epsilon", "zeta", "eta", "theta"}})
  -- train.build and train.run as train.main does, with the MFU peak given (measuring it runs 4096^3 GEMMs,
  -- minutes under the emulator)
  local script = T.write_file(dir .. "/run.lua", [[
local train, config = require "nvlua.train", require "nvlua.config"
local c = config.parse(train.defaults, arg)
local p = train.build(c)
p.peak = 1e12
train.run(c, p)
]])
  local function run(route, env)
    local out = dir .. "/run_" .. route .. (env and "_missing" or "")
    return T.run_nvlua(table.concat({T.shq(script), "device=cuda", "attention=" .. route,
      "recipe=bf16", "layers=1", "hidden=128", "heads=2", "kv_heads=1", "ffn=128", "seq=32", "batch=2", "steps=2",
      "warmup=1", "eval_every=0", "log_every=1", "sample_tokens=0", "plot=false", "save=false", "ckpt_every=0",
      "data=" .. T.shq(corpus), "cache=" .. T.shq(dir .. "/cache"), "out=" .. T.shq(out)}, " "), {env = env})
  end
  local r = run("cudnn")
  T.eq(r.code, 0, "the run: " .. r.err)
  T.ok(r.out:find("attention: cudnn; cuDNN 9.19.0 available", 1, true), r.out)
  T.ok(r.out:find("step +2/2"), r.out)
  r = run("auto", {NVLUA_EMU_CUDNN = "missing"})
  T.eq(r.code, 0, "the run: " .. r.err)
  T.ok(r.out:find("attention: auto; cuDNN not used: [^\n]*cannot load libcudnn.so.9"), r.out)
  r = run("cudnn", {NVLUA_EMU_CUDNN = "missing"})
  T.eq(r.code, 1, "refused before it starts")
  T.ok(r.err:find("attention=cudnn is not available here: [^\n]*cannot load libcudnn.so.9"), r.err)
  T.rm_tree(dir)
end)

T.case("the train keys: attention= sets the route; attention=cudnn is refused where it cannot run", function()
  need_gpu()
  local train = require "nvlua.train"
  local function check(o)
    local c = train.schema:defaults()
    for k, v in pairs(o) do c[k] = v end
    return train.check(c)
  end
  T.raises(function() check({attention = "fast"}) end, "attention")
  T.raises(function() check({attention = "cudnn", device = "cpu"}) end, "needs device=cuda")
  T.raises(function() check({attention = "cudnn", device = "cuda", recipe = "f32"}) end, "takes bf16 activations")
  T.raises(function() check({attention = "cudnn", device = "cuda", hidden = 256, heads = 8}) end, "head dim 64 or 128")
  check({attention = "cudnn", device = "cuda", hidden = 256, heads = 4, kv_heads = 2, attention_deterministic = true})
  T.raises(function() check({attention_deterministic = "yes"}) end, "attention_deterministic")
end)
