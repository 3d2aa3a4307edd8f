-- test_cuda_devices.lua: which GPU a process gets (issue 29). Under mpirun each rank of a node gets
-- its own: entry local_rank % n of a CUDA_VISIBLE_DEVICES list, device local_rank when it is unset, the
-- one entry a launcher bound; dist.gpu() says which, for the log. GPUs this build cannot run on (before
-- sm_90; consumer Blackwell, whose blocks get less shared memory than the flash attention takes) are
-- refused by name at start-up. Both need the emulator: several emulated GPUs behind a CUDA-aware MPI,
-- and the properties of GPUs this machine does not have (NVLUA_EMU_CC). Not a GPU run.
local T = require "nvlua.test"
local nv = require "nvlua"

local function mpirun_path()
  local p = io.popen("command -v mpirun 2>/dev/null")
  local path = p and p:read("l")
  if p then p:close() end
  if not path or path == "" then T.skip("mpirun not found") end
  if not nv.dist.info().mpi then T.skip("nvlua built without MPI") end
  return path
end

-- Each rank prints "rank R: <physical GPU of cuda:0> | <dist.gpu()>". EARLY=1: it asks whether CUDA is
-- available before dist.init, as train's check of device=cuda does (the CUDA runtime starts then).
local PLACEMENT = [[
local nv = require "nvlua"
if os.getenv("EARLY") == "1" then assert(nv.cuda.available()) end
local r = nv.dist.init()
local name = nv.cuda.devices()[1].name
print(string.format("rank %d: physical %s | %s", r, name:match("physical GPU (%d+)"), nv.dist.gpu()))
]]

-- Run PLACEMENT on 2 ranks with env (a shell prefix: "env ..." settings) and `wrap` (a command put before
-- nvlua on each rank, "" for none) -> output, exit code.
local function placement(env, wrap)
  local mpirun = mpirun_path()
  local dir = T.tmpdir()
  local script = dir .. "/placement.lua"
  T.write_file(script, PLACEMENT)
  local p = assert(io.popen(string.format("%s OMP_NUM_THREADS=1 timeout 120 %s --allow-run-as-root --oversubscribe " ..
    "--bind-to none -np 2 %s %s %s 2>&1", env, mpirun, wrap, T.shq(T.nvlua()), T.shq(script))))
  local out = p:read("a")
  local _, _, code = p:close()
  T.rm_tree(dir)
  return out, code
end

T.case("each rank of a node gets its own GPU: CUDA_VISIBLE_DEVICES unset, \"0,1\", \"1,0\", \"3\" (2 ranks, CUDA-aware MPI)",
  function()
    T.need_emu()
    -- {CUDA_VISIBLE_DEVICES (false: unset), emulated GPUs, rank 0's physical GPU, rank 1's, what the log says}
    local cases = {
      {false, 2, 0, 1, {"CUDA_VISIBLE_DEVICES=0 (was unset", "CUDA_VISIBLE_DEVICES=1 (was unset"}},
      {"0,1", 2, 0, 1, {"CUDA_VISIBLE_DEVICES=0 (entry 1 of 0,1 for local rank 0", "CUDA_VISIBLE_DEVICES=1 (entry 2 of 0,1 for local rank 1"}},
      {"1,0", 2, 1, 0, {"CUDA_VISIBLE_DEVICES=1 (entry 1 of 1,0 for local rank 0", "CUDA_VISIBLE_DEVICES=0 (entry 2 of 1,0 for local rank 1"}},
      {"3", 4, 3, 3, {"CUDA_VISIBLE_DEVICES=3 (one entry: the launcher's choice, kept; local rank 0",
        "CUDA_VISIBLE_DEVICES=3 (one entry: the launcher's choice, kept; local rank 1"}},
    }
    for _, c in ipairs(cases) do
      local cvd = c[1] and "CUDA_VISIBLE_DEVICES=" .. c[1] or "-u CUDA_VISIBLE_DEVICES"
      local out, code = placement(string.format("env %s NVLUA_EMU_GPUS=%d NVLUA_EMU_CUDA_AWARE_MPI=1", cvd, c[2]), "")
      local what = "CUDA_VISIBLE_DEVICES " .. (c[1] and ("\"" .. c[1] .. "\"") or "unset")
      T.eq(code, 0, what .. ": mpirun exit status; output:\n" .. out)
      for rank = 0, 1 do
        local line = out:match("rank " .. rank .. ": ([^\n]*)") or ""
        T.eq(line:match("^physical (%d+)"), tostring(c[3 + rank]), what .. ": rank " .. rank .. "'s GPU; output:\n" .. out)
        T.ok(line:find(c[5][rank + 1], 1, true) ~= nil, what .. ": rank " .. rank .. "'s log line: " .. line)
        T.ok(line:find("PCI 00000000:%x%x:00%.0") ~= nil, what .. ": the log line names the PCI bus id: " .. line)
        T.ok(line:find("from OMPI_COMM_WORLD_LOCAL_RANK", 1, true) ~= nil,
          what .. ": placed before MPI_Init, from the launcher's local rank: " .. line)
      end
    end
  end)

T.case("a CUDA query before dist.init (train's check of device=cuda) does not put every rank on one GPU", function()
  T.need_emu()
  local out, code = placement("env EARLY=1 CUDA_VISIBLE_DEVICES=1,0 NVLUA_EMU_GPUS=2", "")
  T.eq(code, 0, "mpirun exit status; output:\n" .. out)
  for rank, phys in pairs({[0] = 1, [1] = 0}) do
    local line = out:match("rank " .. rank .. ": ([^\n]*)") or ""
    T.eq(line:match("^physical (%d+)"), tostring(phys), "rank " .. rank .. "'s GPU; output:\n" .. out)
  end
end)

-- A launcher that exports no node-local rank: dist.init places the GPU after MPI_Init from MPI's own
-- (an MPI that is not CUDA-aware: the runtime has not read CUDA_VISIBLE_DEVICES yet).
T.case("without the launcher's local rank, MPI's places each rank on entry local_rank % n (\"1,0\", 2 ranks)", function()
  T.need_emu()
  local out, code = placement("env CUDA_VISIBLE_DEVICES=1,0 NVLUA_EMU_GPUS=2",
    "env -u OMPI_COMM_WORLD_LOCAL_RANK -u MPI_LOCALRANKID -u PMI_LOCAL_RANK -u SLURM_LOCALID")
  T.eq(code, 0, "mpirun exit status; output:\n" .. out)
  for rank, phys in pairs({[0] = 1, [1] = 0}) do
    local line = out:match("rank " .. rank .. ": ([^\n]*)") or ""
    T.eq(line:match("^physical (%d+)"), tostring(phys), "rank " .. rank .. "'s GPU; output:\n" .. out)
    T.ok(line:find("from MPI_COMM_TYPE_SHARED", 1, true) ~= nil, "placed from MPI's local rank: " .. line)
  end
end)

-- nv.cuda.available() and the reason, in a process whose emulator has NVLUA_EMU_CC's device (the CUDA
-- runtime reads it once per process).
local function probe(cc)
  local r = T.run_nvlua(T.shq('-e local nv = require "nvlua"; local d = nv.cuda.devices()[1]; ' ..
    'print(nv.cuda.available(), d and d.name or "-", d and d.capability or "-"); print(nv.cuda.unavailable_reason())'),
    {env = {NVLUA_EMU_CC = tostring(cc), NVLUA_EMU_GPUS = "2"}})
  T.eq(r.code, 0, "NVLUA_EMU_CC=" .. cc .. ": exit status; stderr:\n" .. r.err)
  local avail, name, cap, why = r.out:match("^(%S+)\t([^\t]*)\t(%S+)\n(.*)\n$")
  return avail == "true", name, cap, why or r.out
end

T.case("GPUs this build cannot run on are refused by name at start-up: sm_120 (RTX 5090), sm_80 (A100); sm_103 runs",
  function()
    T.need_emu()
    local ok, _, _, why = probe(120)
    T.eq(ok, false, "sm_120: not available")
    for _, s in ipairs({"GPU 0, NVIDIA GeForce RTX 5090", "is sm_120 (consumer Blackwell): not supported",
      "a block may have 99 KiB of shared memory there and nvlua's flash attention takes 121 KiB",
      "Hide it with CUDA_VISIBLE_DEVICES"}) do
      T.ok(why:find(s, 1, true) ~= nil, "sm_120's reason says \"" .. s .. "\": " .. why)
    end
    ok, _, _, why = probe(80)
    T.eq(ok, false, "sm_80: not available")
    T.ok(why:find("GPU 0, NVIDIA A100-SXM4-80GB", 1, true) and why:find("is sm_80: not supported", 1, true) and
      why:find("which need sm_90 (Hopper) or newer", 1, true), "sm_80's reason: " .. why)
    local name, cap
    ok, name, cap, why = probe(103)
    T.eq({ok, cap, why}, {true, "10.3", ""}, "sm_103 (B300) is available")
    T.ok(name:find("NVIDIA B300", 1, true) ~= nil, "sm_103's name: " .. name)
  end)
