-- test_cuda_flash.lua: the tensor-core FlashAttention-2 of the CUDA backend (kernels/cuda/flash_attn.cu,
-- core.cuda_flash_attention and its backward) against the CPU reference attention, and the warp matrix
-- functions it is built on (the CUDA emulator's WMMA model, kernels/cuda/emu/mma.h, through
-- core.cuda_wmma_probe). Every case needs a GPU and skips without one; CI runs them on the CPU emulation
-- of CUDA (scripts/test.sh --emu): results there are the CPU's, within the bounds below, not a GPU run.
-- Every device output is allocated poisoned (0xFF bytes), so an element a kernel leaves unwritten fails.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local need_gpu = T.need_gpu

local need_emu = T.need_emu

local function flat(t) return t:cpu():to("f32"):contiguous():reshape(-1):totable() end
local function poisoned(fn, ...) return T.with(core.cuda_set_poison, 0xFF, fn, ...) end

-- ---- the warp matrix functions ------------------------------------------------------------------------

-- A (16, 16) matrix of small integers from a seed: bf16 products and 16-term sums of them are exact in
-- fp32, so D = A B + C is exact whatever the summation order: compared bit for bit.
local function ints(seed, lo, hi)
  local t, x = {}, seed
  for i = 1, 16 do
    t[i] = {}
    for j = 1, 16 do
      x = (x * 1103515245 + 12345) % 2147483648
      t[i][j] = lo + x % (hi - lo + 1)
    end
  end
  return t
end
local function tr(m)
  local t = {}
  for i = 1, 16 do
    t[i] = {}
    for j = 1, 16 do t[i][j] = m[j][i] end
  end
  return t
end

T.case("wmma on cuda: d = a b + c bit for bit, every operand layout (row/col major a, b; c/d)", function()
  need_gpu()
  local A, B, C = ints(1, -8, 8), ints(2, -8, 8), ints(3, -100, 100)
  local want = {}
  for i = 1, 16 do
    want[i] = {}
    for j = 1, 16 do
      local s = C[i][j]
      for k = 1, 16 do s = s + A[i][k] * B[k][j] end
      want[i][j] = s
    end
  end
  for flags = 0, 7 do
    -- memory holds the operand, or its transpose when read column major
    local am = (flags & 1 ~= 0) and tr(A) or A
    local bm = (flags & 2 ~= 0) and tr(B) or B
    local cm = (flags & 4 ~= 0) and tr(C) or C
    poisoned(function()
      local d = core.cuda_wmma_probe(nv.tensor(am, "bf16"):cuda(), nv.tensor(bm, "bf16"):cuda(),
        nv.tensor(cm):cuda(), flags)
      local got = d:cpu():totable()
      if flags & 4 ~= 0 then got = tr(got) end
      T.eq(got, want, "flags " .. flags)
    end)
  end
end)

T.case("wmma rules the emulator enforces: alignment, ldm, convergence, uniform arguments, whole warps", function()
  need_emu()
  local a, b, c = nv.tensor(ints(1, -8, 8), "bf16"):cuda(), nv.tensor(ints(2, -8, 8), "bf16"):cuda(), nv.zeros(16, 16):cuda()
  local function fails(flags, text)
    T.raises(function()
      core.cuda_wmma_probe(a, b, c, flags)
      core.cuda_synchronize()
    end, text, "flags " .. flags)
  end
  fails(8, "is not 256-bit (32-byte) aligned")
  fails(16, "ldm 12 is not a multiple of 8")
  fails(32, "divergent warp")
  fails(64, "must be the same in every lane of the warp")
  fails(128, "which does not exist")
  -- the device still works after each fault
  T.eq(core.cuda_wmma_probe(a, b, c, 0):cpu():totable()[1][1] ~= nil, true, "a clean probe after the faults")
end)

-- ---- flash attention vs the reference: the bounds of tests/flash_bounds.lua ------------------------------

local FB = dofile("tests/flash_bounds.lua")
local bounds, within, randb, head = FB.bounds, FB.within, FB.randb, FB.head

local function ref(fn, ...) return T.with(nv.use_reference, true, fn, ...) end

local SIZES = { -- B, T, Hq, Hkv, D: ragged tiles (T = 1, 17, 69, 130), GQA groups 2 and 4, D 64 and 128
  { 1, 1, 2, 1, 64 }, { 2, 17, 4, 2, 64 }, { 1, 69, 4, 1, 128 }, { 1, 130, 4, 2, 64 }, { 1, 130, 2, 2, 128 },
}

-- q, k, v (and dout) for shape sh: bf16 cuda tensors and their f32 widenings
local function inputs(sh, backward)
  local B, Tn, Hq, Hkv, D = table.unpack(sh)
  local x = { q = randb(B, Tn, Hq, D), k = randb(B, Tn, Hkv, D), v = randb(B, Tn, Hkv, D) }
  if backward then x.dout = randb(B, Tn, Hq, D) end
  local d = {}
  for name, t in pairs(x) do d[name] = t:to("bf16"):cuda() end
  return x, d
end

T.case("flash attention forward on cuda vs the reference (causal, GQA, D 64 and 128, ragged tiles)", function()
  need_gpu()
  nv.manual_seed(11)
  for _, sh in ipairs(SIZES) do
    local B, Tn, Hq, Hkv, D = table.unpack(sh)
    local what = string.format("(B %d, T %d, Hq %d, Hkv %d, D %d)", B, Tn, Hq, Hkv, D)
    local scale = 1 / math.sqrt(D)
    local x, d = inputs(sh, false)
    local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
    x.lse = lse
    local bo, _, _, _, e_lse = bounds(x, scale, true, false)
    poisoned(function()
      local o, l = core.cuda_flash_attention(d.q, d.k, d.v, scale, true)
      T.eq(o:dtype(), "bf16", "out is bf16")
      -- lse = m + log l: l sums p (off by ep) in fp32 (ea): |d lse| <= ep + ea + 2 u |lse| (absolute)
      local r = within(o, out, bo, "flash out " .. what)
      within(l, lse, nv.full(lse:size(), e_lse), "flash lse " .. what)
    end)
  end
end)

T.case("flash attention backward on cuda vs the reference (causal, GQA, D 64 and 128, ragged tiles)", function()
  need_gpu()
  nv.manual_seed(12)
  for _, sh in ipairs(SIZES) do
    local B, Tn, Hq, Hkv, D = table.unpack(sh)
    local what = string.format("(B %d, T %d, Hq %d, Hkv %d, D %d)", B, Tn, Hq, Hkv, D)
    local scale = 1 / math.sqrt(D)
    local x, d = inputs(sh, true)
    local out, lse = ref(core.attention_forward, x.q, x.k, x.v, scale)
    local dq, dk, dv = ref(core.attention_backward, x.dout, x.q, x.k, x.v, out, lse, scale)
    x.lse, x.out = lse, out
    local _, bq, bk, bv = bounds(x, scale, true, true)
    poisoned(function()
      local o, l = core.cuda_flash_attention(d.q, d.k, d.v, scale)
      local gq, gk, gv = core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale)
      T.eq({ gq:dtype(), gk:dtype(), gv:dtype() }, { "bf16", "bf16", "bf16" }, "gradients are bf16")
      local rq = within(gq, dq, bq, "flash dq " .. what)
      local rk = within(gk, dk, bk, "flash dk " .. what)
      local rv = within(gv, dv, bv, "flash dv " .. what)
    end)
  end
end)

local dense_ref = FB.dense_ref

T.case("flash attention without the causal mask, forward and backward, vs dense f32 formulas", function()
  need_gpu()
  nv.manual_seed(13)
  for _, sh in ipairs({ { 2, 17, 4, 2, 64 }, { 1, 69, 2, 1, 128 } }) do
    local B, Tn, Hq, Hkv, D = table.unpack(sh)
    local what = string.format("non-causal (B %d, T %d, Hq %d, Hkv %d, D %d)", B, Tn, Hq, Hkv, D)
    local scale = 1 / math.sqrt(D)
    local x, d = inputs(sh, true)
    local out, lse, dq, dk, dv = dense_ref(x, scale)
    x.lse, x.out = lse, out
    local bo, bq, bk, bv = bounds(x, scale, false, true, 2)
    poisoned(function()
      local o, l = core.cuda_flash_attention(d.q, d.k, d.v, scale, false)
      within(o, out, bo, "flash out " .. what)
      local gq, gk, gv = core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, o, l, scale, false)
      within(gq, dq, bq, "flash dq " .. what)
      within(gk, dk, bk, "flash dk " .. what)
      within(gv, dv, bv, "flash dv " .. what)
    end)
  end
end)

T.case("flash attention refuses what it does not take, with the reason", function()
  need_gpu()
  local function qkv(D, dt, dev)
    local t = nv.randn(1, 8, 2, D):to(dt or "bf16")
    if dev ~= "cpu" then t = t:cuda() end
    return t
  end
  local q = qkv(64)
  T.raises(function() core.cuda_flash_attention(qkv(96), qkv(96), qkv(96), 0.1) end,
    "the tensor-core flash attention takes D = 64 or 128")
  T.raises(function() core.cuda_flash_attention(qkv(64, "f32"), q, q, 0.1) end, "q must be a 4-D bf16")
  T.raises(function() core.cuda_flash_attention(qkv(64, "bf16", "cpu"), q, q, 0.1) end, "q must be on cuda")
  T.raises(function() core.cuda_flash_attention(q, nv.randn(1, 8, 3, 64):to("bf16"):cuda(), nv.randn(1, 8, 3, 64):to("bf16"):cuda(), 0.1) end,
    "must be a positive multiple of Hkv")
  T.raises(function() core.cuda_flash_attention(q, q, q, 0.1, "yes") end, "boolean expected")
  T.raises(function() core.cuda_flash_attention(q, q, q, math.huge) end, "scale must be finite")
  local o, l = core.cuda_flash_attention(q, q, q, 0.1)
  T.raises(function() core.cuda_flash_attention_backward(q, q, q, q, o, l:cuda():to("bf16"), 0.1) end,
    "lse must be a 3-D f32")
end)

-- The attention entry (core.attention_forward/backward, what nn.Attention calls) under attention=flash routes
-- bf16 activations on cuda with head dim 64 or 128 to the flash kernels: the same bits as calling them directly.
-- With the route off (core.attention_flash(false): attention=reference), or at another head dim, it is NUMERICS
-- §11's widened f32 op rounded once. (attention=auto prefers cuDNN: tests/test_cuda_cudnn.lua.)
T.case("bf16 attention on cuda: D 64/128 routed to flash (same bits), else and when off the widened f32 op", function()
  need_gpu()
  nv.manual_seed(13)
  T.eq(core.attention_route(), "auto", "the route is auto by default")
  T.with(core.attention_route, "flash", function()
    local function same(a, b, what) T.eq(flat(a), flat(b), what) end
    for _, sh in ipairs({{1, 33, 4, 2, 64}, {2, 17, 2, 1, 128}, {1, 20, 4, 2, 32}}) do
      local B, Tn, Hq, Hkv, D = table.unpack(sh)
      local what = string.format("(B %d, T %d, Hq %d, Hkv %d, D %d)", B, Tn, Hq, Hkv, D)
      local scale = 1 / math.sqrt(D)
      local x, d = inputs(sh, true)
      T.eq(core.attention_flash(), true, "the flash switch reads on under attention=flash")
      T.eq(core.attention_route_of(d.q, d.k, d.v), (D == 64 or D == 128) and "flash" or "widened", "route_of " .. what)
      local o, l = core.attention_forward(d.q, d.k, d.v, scale)
      local gq, gk, gv = core.attention_backward(d.dout, d.q, d.k, d.v, o, l, scale)
      -- the widened f32 op on cuda, rounded once (the rule with the route off)
      local wo, wl = core.attention_forward(d.q:to("f32"), d.k:to("f32"), d.v:to("f32"), scale)
      local wq, wk, wv = core.attention_backward(d.dout:to("f32"), d.q:to("f32"), d.k:to("f32"), d.v:to("f32"),
        o:to("f32"), l, scale)
      if D == 64 or D == 128 then
        local fo, fl = core.cuda_flash_attention(d.q, d.k, d.v, scale, true)
        same(o, fo, "routed out " .. what); same(l, fl, "routed lse " .. what)
        local fq, fk, fv = core.cuda_flash_attention_backward(d.dout, d.q, d.k, d.v, fo, fl, scale, true)
        same(gq, fq, "routed dq " .. what); same(gk, fk, "routed dk " .. what); same(gv, fv, "routed dv " .. what)
      else
        same(o, wo:to("bf16"), "D 32 is not routed: out " .. what)
        same(gq, wq:to("bf16"), "D 32 is not routed: dq " .. what)
      end
      T.with(core.attention_flash, false, function()
        local ro, rl = core.attention_forward(d.q, d.k, d.v, scale)
        same(ro, wo:to("bf16"), "route off: out " .. what); same(rl, wl, "route off: lse " .. what)
        local rq, rk, rv = core.attention_backward(d.dout, d.q, d.k, d.v, o, l, scale)
        same(rq, wq:to("bf16"), "route off: dq " .. what)
        same(rk, wk:to("bf16"), "route off: dk " .. what); same(rv, wv:to("bf16"), "route off: dv " .. what)
      end)
      T.eq(core.attention_route(), "flash", "attention_flash(true) restored the route set before it")
    end
  end)
end)
