-- tests/test_cuda_qgather.lua: the quantized all-gather on CUDA tensors (core/qgather.c through NCCL;
-- core/NUMERICS.md "The gathered quantized weight") and the device transpose of a quantized weight
-- it relies on for dgrad (q:t(): the transpose_tiles and swizzle_scales entries, kernels/cuda/quant.cu).
--   * q:t() on the device (nvfp4 16x16, e4m3, bf16) equals the host's q:t() and the device
--     quantization of W^T byte for byte, swizzled scales included; its amax stays on the device (no
--     host synchronisation); the recipe's dgrad copy of a weight without its full-precision rows (w nil)
--     is that transpose.
--   * under the CUDA emulator, 2 ranks under mpirun with 2 emulated GPUs and NCCL's stand-in: every case
--     of tests/qgather_cases.lua on device shards equals the unsharded quantization (the CPU's, byte for
--     byte; the CUDA quantizers are bit-exact with it), swizzled scales equal a device quantization's,
--     the GEMMs through the gathered weight equal the unsharded ones bit for bit, the bytes counted are
--     the ring formula's; and a gather of nvfp4 16x16, nvfp4 1x16, e4m3 and mxfp8 weights (both copies)
--     makes 0 host synchronisations with sync off and a warm allocator, with no stream-order race
--     (the emulator fails the next synchronisation on one).
-- Results are the CPU's under emulation: not a GPU run.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

T.case("q:t() on the device: the host's transpose, the quantization of W^T, swizzled scales, no host sync", function()
  T.need_gpu()
  local C = dofile("tests/qgather_cases.lua")
  local recipe = require "nvlua.recipe"
  local W = C.weight(96, 64, "outliers", 11)
  local Wd, WTd = W:cuda(), W:transpose():contiguous():cuda()
  for _, spec in ipairs({{format = "nvfp4", block = "2d"}, {format = "e4m3"}, {format = "bf16"}}) do
    local o = {block = spec.block}
    local qd = nv.quantize(Wd, spec.format, o)
    local syncs = 0
    local qt
    if nv.cuda.emulated() then
      core.cuda_synchronize()
      T.with(core.cuda_set_sync, false, function()
        local s0 = core.cuda_emu_counters().host_syncs
        qt = qd:t()
        syncs = core.cuda_emu_counters().host_syncs - s0
      end)
    else
      qt = qd:t()
    end
    T.eq(syncs, 0, spec.format .. ": host syncs of q:t()")
    T.eq(qt:device(), "cuda", spec.format .. ": on the device")
    T.eq(C.diff(qt:cpu(), nv.quantize(W, spec.format, o):t()), "", spec.format .. ": the host's q:t()")
    local ref = nv.quantize(WTd, spec.format, o)
    T.eq(C.diff(qt:cpu(), ref:cpu()), "", spec.format .. ": the device quantization of W^T")
    if ref:swizzled_scales() then
      T.eq(qt:swizzled_scales():bytes(), ref:swizzled_scales():bytes(), spec.format .. ": swizzled scales")
    end
    T.eq(C.diff(recipe._transposed(qd, nil, spec):cpu(), recipe._transposed(qd, Wd, spec):cpu(), true), "",
      spec.format .. ": the recipe's dgrad copy without w (q:t()) = with w (W re-quantized along N)")
  end
end)

-- Run script_text on 2 ranks under mpirun with 2 emulated GPUs; -> output, exit code.
local function mpirun2(script_text)
  local p = io.popen("command -v mpirun 2>/dev/null")
  local mpirun = p and p:read("l")
  if p then p:close() end
  if not mpirun or mpirun == "" then T.skip("mpirun not found") end
  if not nv.dist.info().mpi then T.skip("nvlua built without MPI") end
  local dir = T.tmpdir()
  local script = dir .. "/script.lua"
  T.write_file(script, script_text)
  local exe = arg[-1] or "nvlua"
  local f = assert(io.popen(string.format("env NVLUA_EMU_GPUS=2 NVLUA_EMU_CUDA_AWARE_MPI=1 OMP_NUM_THREADS=1 "
    .. "timeout 300 %s --allow-run-as-root --oversubscribe --bind-to none -np 2 %s %s 2>&1", mpirun, exe, script)))
  local out = f:read("a")
  local _, _, code = f:close()
  T.rm_tree(dir)
  return out, code
end

T.case("2 emulated ranks: the gathered weight is the unsharded quantization, no host sync, no race", function()
  T.need_emu()
  local out, code = mpirun2([[
local nv = require "nvlua"
local core = nv.core
local dist = require "nvlua.dist"
local r, world = dist.init()
local C = dofile("tests/qgather_cases.lua")
local function say(s) print(string.format("rank %d: %s", r, s)) end
for _, l in ipairs(C.run("cuda")) do say(l) end
for _, l in ipairs(C.run_async("cuda")) do say(l) end
-- host synchronisations of a gather of both copies, sync off, the allocator warm (a first round)
core.cuda_set_sync(false)
local W = C.weight(128, 64, "outliers", 4)
local specs = {{format = "nvfp4", block = "2d"}, "nvfp4", "e4m3", "mxfp8_e4m3"}
local shards = {}
for i, spec in ipairs(specs) do
  local sr = dist.shard_rows(128, world, nv.quant.gather_align(spec, "both"))[r + 1]
  shards[i] = W:narrow(1, sr.row0 + 1, sr.rows):contiguous():cuda()
end
local got, syncs = {}, 0
for round = 1, 3 do -- blocking (warming the allocator), blocking, then started together and waited for
  core.cuda_synchronize()
  local s0 = core.cuda_emu_counters().host_syncs
  local h = {}
  for i, spec in ipairs(specs) do
    if got[i] then got[i][1]:free(); got[i][2]:free() end
    if round < 3 then got[i] = {nv.quant.all_gather_quantized(shards[i], spec, {rows = 128, copies = "both"})}
    else h[i] = nv.quant.all_gather_quantized(shards[i], spec, {rows = 128, copies = "both", async = true}) end
  end
  for i = 1, #h do got[i] = {h[i]:wait()} end
  syncs = syncs + (round > 1 and core.cuda_emu_counters().host_syncs - s0 or 0)
end
local same = true
for i, spec in ipairs(specs) do
  local fmt = type(spec) == "string" and spec or spec.format
  local block = type(spec) == "table" and spec.block or nil
  local ref = nv.quantize(W, fmt, {block = block})
  local reft = block and nv.quantize(W:transpose():contiguous(), fmt, {block = block})
    or (fmt == "e4m3" and nv.quantize(W:transpose():contiguous(), fmt, {}) or nv.quantize(W, fmt, {axis = 1}))
  same = same and C.diff(got[i][1]:cpu(), ref) == "" and C.diff(got[i][2]:cpu(), reft) == ""
end
say(string.format("host syncs %d, same %s", syncs, tostring(same)))
]])
  T.eq(code, 0, "mpirun exit status; output:\n" .. out)
  local C = dofile("tests/qgather_cases.lua")
  for rank = 0, 1 do
    for _, c in ipairs(C.CASES) do
      T.ok(out:find(string.format("rank %d: ok %s\n", rank, c[1]), 1, true) ~= nil,
        string.format("rank %d, case %s; output:\n%s", rank, c[1], out))
    end
    local asyncs = select(2, out:gsub(string.format("rank %d: ok async ", rank), ""))
    T.eq(asyncs, 4, string.format("rank %d: the prefetched gathers; output:\n%s", rank, out))
    T.ok(out:find(string.format("rank %d: host syncs 0, same true", rank), 1, true) ~= nil,
      "rank " .. rank .. ": no host sync, the unsharded bits; output:\n" .. out)
  end
end)
