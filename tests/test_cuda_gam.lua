-- test_cuda_gam.lua: the CUDA kernel of GAM scaling (kernels/cuda/gam.cu, the CUDA table's gam_quantize)
-- through core.gam_quantize on device tensors, against the scalar reference on the CPU copy (the
-- same call under nv.use_reference(true)): codes, E8M0 bytes, group mantissas and the device's
-- non-finite flag equal bit for bit on every case of tests/gam_cases.lua (test_gam_ref.c's hand-worked,
-- NaN / inf and exponent-edge cases, its random generator; the large tensors, with many warps per
-- group and group boundaries inside a warp's run of blocks, outside the emulation only where noted).
-- Run under the CPU emulation of CUDA (-DNVLUA_CUDA=EMU), and on a GPU by scripts/gpu_check.sh.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local C = dofile("tests/gam_cases.lua")

local function cuda(x) return x:cuda() end

T.case("the CUDA kernel equals the reference, every case, e4m3 and e5m2", function()
  T.need_gpu()
  C.check(C.cases(true), core.gam_quantize, cuda)
end)

-- Enough 1 x 16 blocks (98304) that each warp of gam_amax_kernel walks a run of several blocks (the grid
-- is capped at 16 blocks of 8 warps per SM: 16896 warps on 132 SMs, emulated or not), so group
-- boundaries fall inside runs (groups of 3 and 4) and a whole-tensor group is folded from every warp.
T.case("runs of several blocks per warp: group boundaries inside a warp's run", function()
  T.need_gpu()
  local R, K = 2048, 768
  local f = {}
  for r = 1, R do f[r] = {2.0 ^ ((r * 7) % 61 - 30)} end
  nv.manual_seed(34)
  local x = nv.randn(R, K) * nv.tensor(f, "f32")
  local xd = x:cuda()
  for _, g in ipairs({3, 4, "tensor"}) do
    C.check({{"randn", nil, R, K, 16, g}}, core.gam_quantize, function() return xd end, x)
  end
end)

T.case("outputs live on the device; the CPU kernel and the CUDA kernel agree on one tensor", function()
  T.need_gpu()
  local x = C.tensor(C.random(99, 64, 32, 4), 16, 128)
  local c, s, m = core.gam_quantize(x:cuda(), 32, 4, "e5m2")
  T.eq({c:device(), s:device(), m:device()}, {"cuda", "cuda", "cuda"})
  local c0, s0, m0 = core.gam_quantize(x, 32, 4, "e5m2")
  T.eq(c:cpu():totable(), c0:totable())
  T.eq(s:cpu():totable(), s0:totable())
  T.eq(m:cpu():totable(), m0:totable())
end)

T.case("argument errors on the device", function()
  T.need_gpu()
  local x = nv.zeros(2, 32):cuda()
  T.raises(function() core.gam_quantize(x, 24, "tensor", "e4m3") end, "block 24 must divide the last dim")
  T.raises(function() core.gam_quantize(x, 8, 3, "e4m3") end, "8 blocks of 1x8 do not split into groups of 3 blocks")
  local c, s, m = core.gam_quantize(nv.zeros(0, 32):cuda(), 32, "tensor", "e4m3")
  T.eq({c:numel(), s:numel(), m:numel()}, {0, 0, 0})
end)
