-- test_cuda_emu.lua: regression tests of issue 15's CUDA defects (D2, D3, D7, D8, D9, D10) that the
-- CPU emulation of CUDA (-DNVLUA_CUDA=EMU, kernels/cuda/emu) detects: stream-order races, cuBLASLt
-- alignment rules, host synchronisations (its counters). Cases that need the emulator's checks or
-- counters skip elsewhere ("needs the CUDA emulator"); those that state plain results run on any
-- GPU. Results here are the CPU's: bit-exact with the CPU under emulation, not a GPU run.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local need_gpu = T.need_gpu

local function need_emu()
  need_gpu()
  if not nv.cuda.emulated() then T.skip("needs the CUDA emulator (-DNVLUA_CUDA=EMU)") end
end

-- The emulator's counter `name` spent by fn(...) (fn's results dropped).
local function counted(name, fn, ...)
  local before = core.cuda_emu_counters()[name]
  fn(...)
  return core.cuda_emu_counters()[name] - before
end

T.case("the emulation build says so: nv.cuda.emulated() and its counters", function()
  need_emu()
  T.ok(nv.cuda.emulated():match("emulated on the CPU") ~= nil, "description: " .. nv.cuda.emulated())
  local x = nv.randn(1000):cuda()
  T.eq(counted("launches", function() return x + x end), 1, "x + x is one kernel launch")
  T.ok(core.cuda_emu_counters().kernels["binary_f32_kernel<0, true>"] ~= nil, "per-kernel counter by name")
  T.eq(counted("host_syncs", function() return x:cpu() end), 1, "a copy to the host is one host sync")
end)

-- D2: NCCL runs on a non-blocking stream of its own; every kernel runs on stream 0. Without an event
-- wait between them a collective can read a buffer a kernel is still writing (NVLUA_CUDA_SYNC=0:
-- no synchronisation after each kernel). The emulator reports such a read as a stream-order race
-- (the collective then fails); with one rank the collectives still run (NCCL's world of one).
T.case("D2: CUDA collectives are ordered after stream 0's kernels (no stream-order race, sync off)", function()
  need_gpu()
  T.with(core.cuda_set_sync, false, function()
    local x = nv.randn(4096)
    local xd = x:cuda()
    local y = xd + xd -- written by a kernel on stream 0, then reduced at once
    nv.dist.all_reduce(y, "sum")
    T.eq(y:cpu():totable(), (x + x):totable(), "all_reduce of one rank keeps the kernel's result")
    local z = xd * xd
    nv.dist.broadcast(z, 0)
    T.eq(z:cpu():totable(), (x * x):totable(), "broadcast")
    local out = nv.zeros(4096):cuda()
    nv.dist.all_gather(out, xd + xd)
    T.eq(out:cpu():totable(), (x + x):totable(), "all_gather")
    local w = xd - xd
    nv.dist.reduce_scatter(out, w, "sum")
    T.eq(out:cpu():totable(), (x - x):totable(), "reduce_scatter")
    core.cuda_synchronize()
  end)
end)
