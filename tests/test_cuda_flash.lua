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

local function need_emu()
  need_gpu()
  if not nv.cuda.emulated() then T.skip("needs the CUDA emulator (-DNVLUA_CUDA=EMU)") end
end

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
