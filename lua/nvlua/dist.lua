-- nvlua.dist: data parallelism across processes (DESIGN.md "Scale-out"; core/dist.h).
--   local dist = require "nvlua.dist"
--   dist.init()                                  -- under mpirun / srun: MPI; else a world of one
--   dist.all_reduce(model.grad_buffer, "avg")    -- t in place; ops "sum" "avg" "max" "min"
--   if dist.rank() == 0 then print(...) end
-- Ranks are launched by Open MPI (`mpirun -np 2 build/nvlua script.lua`) or Slurm (`srun`).
-- Ranks are 0-based, as MPI numbers them. CPU tensors go through MPI, CUDA tensors through NCCL
-- (one communicator, each rank on its own GPU; that path compiles but is untested). nvlua built
-- without MPI, or started without a launcher, is a world of one: every collective is an identity.
--
-- Collectives: barrier(), all_reduce(t, op), all_reduce_number(x, op) (in double precision),
-- all_reduce_numbers({x1, ...}, op) (several numbers, one collective; -> a new table),
-- broadcast(t, root), reduce_scatter(out, t, op) (t cut along dim 1 into world equal chunks;
-- out gets this rank's, reduced), all_gather(out, t) (out = the ranks' t along dim 1; t may be
-- out's own chunk, gathered in place). Each returns its output. all_gather_start / all_gather_wait:
-- the all-gather without waiting. shard_rows: the row split of sharded tensors; bytes(): what this
-- rank sent. nv.quant.all_gather_quantized (lua/nvlua/quant.lua) gathers a weight quantized.
--
-- Faults: a collective that waits longer than the timeout (set_timeout(s), or the environment's
-- NVLUA_DIST_TIMEOUT; default 600 s) ends the process with a message naming the rank and the
-- op, and the launcher ends the job. A rank whose script fails, or that calls os.exit with a
-- failure status, ends the whole job (MPI_Abort) rather than leave the others waiting; after
-- init, os.exit with success finalizes MPI first (so a script may end with os.exit(0)).
local core = require "nvlua.core"

local C = core.dist
local dist = {}

local raw_exit

--- dist.init([{threads = "funneled"|"multiple"}]) -> rank, world: start the process group
-- (idempotent). threads = "multiple" asks MPI for MPI_THREAD_MULTIPLE, which all_reduce_bg needs to
-- run in a thread of its own (sync=shadow asks for it); the first call that starts MPI decides, so a
-- later call asking for "multiple" after MPI was started without it raises.
function dist.init(o)
  local threads = o and o.threads or "funneled"
  if threads ~= "funneled" and threads ~= "multiple" then
    error("dist.init: threads must be \"funneled\" or \"multiple\", got " .. tostring(threads), 2)
  end
  local rank, world = C.init(threads == "multiple")
  if not raw_exit then
    -- os.exit leaves without returning to the driver, which would finalize or abort: do it here
    raw_exit = os.exit
    os.exit = function(code, close) ---@diagnostic disable-line: duplicate-set-field
      local ok = code == nil or code == true or code == 0
      if ok then C.finalize()
      elseif C.world_size() > 1 then
        io.stdout:flush()
        io.stderr:write(string.format("nvlua dist: rank %d of %d exits with status %s; ending the job\n", C.rank(),
          C.world_size(), tostring(code)))
        io.stderr:flush()
        C.abort(math.type(code) == "integer" and code or 1)
      end
      return raw_exit(code, close)
    end
  end
  return rank, world
end

dist.initialized = C.initialized
--- dist.rank() -> this process's rank (0-based; 0 before init)
dist.rank = C.rank
--- dist.world_size() -> number of ranks (1 before init or without a launcher)
dist.world_size = C.world_size
--- dist.local_rank(), dist.local_size(): the rank among the ranks on this node, and their number
dist.local_rank = C.local_rank
dist.local_size = C.local_size
--- dist.backend() -> "mpi" or "none"
dist.backend = C.backend
--- dist.info() -> {mpi, mpi_version, nccl, nccl_loads, nccl_why}: what this build can do
dist.info = C.info

--- dist.gpu() -> a line for the log saying which GPU this rank uses: what dist.init did to
-- CUDA_VISIBLE_DEVICES (each rank of a node gets its own GPU: entry local_rank % n of a list) and the
-- device cuda:0 now is, with its PCI bus id (the physical GPU, as nvidia-smi lists it); nil without a GPU.
-- Starts the CUDA runtime: call it after dist.init.
function dist.gpu()
  local nv_cuda = require("nvlua").cuda
  if not nv_cuda.available() then return nil end
  local d = nv_cuda.devices()[1]
  local how = C.gpu_placement()
  if how == "" then
    local cvd = os.getenv("CUDA_VISIBLE_DEVICES")
    how = cvd and ("CUDA_VISIBLE_DEVICES=" .. cvd .. " (kept)") or "CUDA_VISIBLE_DEVICES unset"
  end
  return string.format("cuda:0 = %s, PCI %s; %s", d.name, d.pci_bus_id, how)
end
dist.barrier = C.barrier
dist.all_reduce = C.all_reduce
dist.all_reduce_number = C.all_reduce_number
dist.all_reduce_numbers = C.all_reduce_numbers
--- dist.all_reduce_start(t [, op = "sum"|"avg"]): start reducing t (f32, contiguous) in place without
-- waiting (MPI_Iallreduce; NCCL on its own stream); dist.wait_all() completes every started one
-- (then t holds the result); dist.pending() counts them. Bucketed gradient reduction.
dist.all_reduce_start = C.all_reduce_start
dist.wait_all = C.wait_all
dist.pending = C.pending
--- dist.all_reduce_bg(t [, op = "sum"|"avg" [, {src = tensor, delta = false}]]): start reducing t (f32,
-- contiguous, CPU) in place in the background — or with src, t = the reduction of src (out of place)
-- and with delta then t -= src — one at a time; dist.bg_wait() completes it. With
-- MPI_THREAD_MULTIPLE (dist.init{threads = "multiple"}; dist.bg_threaded() says) a thread of its own
-- runs it, so it advances while the caller computes; otherwise it is an MPI_Iallreduce, which Open
-- MPI advances only inside MPI calls.
-- t must not be touched until bg_wait returns. ShadowSync's parameter averaging (sync=shadow).
-- dist.bg_pending(): one is started and not waited for; dist.bg_busy(): and not known to be complete
-- (its thread still runs; without the thread, until bg_wait), a check that makes no MPI call.
dist.all_reduce_bg = C.all_reduce_bg
dist.bg_wait = C.bg_wait
dist.bg_pending = C.bg_pending
dist.bg_busy = C.bg_busy
dist.bg_threaded = C.bg_threaded
dist.broadcast = C.broadcast
dist.reduce_scatter = C.reduce_scatter
dist.all_gather = C.all_gather
--- dist.all_gather_start(out, t) -> ticket: start all_gather(out, t) (contiguous tensors) without waiting
-- (MPI_Iallgather; on CUDA NCCL on its stream, stream 0 not waiting); dist.all_gather_wait(ticket)
-- completes it (then out holds the result; on CUDA stream 0's later work waits for it, the host does not).
-- out and t must not be touched in between. Prefetching a layer's weights while another computes.
dist.all_gather_start = C.all_gather_start
dist.all_gather_wait = C.all_gather_wait
dist.set_timeout = C.set_timeout
dist.timeout = C.timeout
--- dist.shard_rows(rows [, world = dist.world_size() [, align = 1]]) -> {[r + 1] = {row0 =, rows =}, chunk =}:
-- the row split every sharded feature uses (ZeRO-2/3 shards, nv.quant.all_gather_quantized; core/dist.h):
-- the rows in units of align rows, chunk = ceil(ceil(rows / align) / world) * align rows per rank, rank r
-- holding the contiguous rows [row0, row0 + rows) = [min(r * chunk, rows), min((r + 1) * chunk, rows))
-- (row0 is 0-based: t:narrow(1, row0 + 1, n)). Front-loaded, like torch.chunk and FSDP2: every shard is a
-- multiple of align rows except the one that ends at `rows`, none holds more than chunk (the smallest
-- maximum an align-row split allows), and ranks past the end hold 0 rows (e.g. 5 units on 4 ranks: 2, 2,
-- 1, 0). Padded to chunk rows each, the shards sit in a world * chunk buffer whose first `rows` rows are
-- the tensor: equal-count collectives (all_gather, reduce_scatter) then work in place.
function dist.shard_rows(rows, world, align)
  return C.shard_rows(rows, world or C.world_size(), align or 1)
end
--- dist.bytes() -> {all_gather, reduce_scatter, all_reduce, broadcast}: the bytes this rank has sent in
-- each kind of collective since start or dist.reset_bytes(), as the ring algorithms move them, from the
-- sizes (not measured on the wire): (N - 1) / N of the gathered or scattered tensor, 2 (N - 1) / N of an
-- all-reduced one, (N - 1) / N of a broadcast one (averaged over ranks), N the world size; 0 in a world
-- of one. dist.reset_bytes(): start counting again.
dist.bytes = C.bytes
dist.reset_bytes = C.reset_bytes
--- dist.finalize(): end MPI cleanly (the driver does it at the end of the script)
dist.finalize = C.finalize
--- dist.abort(status): end every rank's process (returns in a world of one)
dist.abort = C.abort

--- dist.is_main() -> true on rank 0 (the rank that logs and writes checkpoints)
function dist.is_main() return C.rank() == 0 end

return dist
