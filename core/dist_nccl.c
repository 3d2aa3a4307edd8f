/* dist_nccl.c: collectives on CUDA tensors through NCCL (see dist_nccl.h).
 *
 * STATUS: COMPILES, UNTESTED. CI has no GPU: this file is compiled and linked there, and the
 * library load (dlopen + every symbol) is tested; no collective here has run on a GPU yet.
 *
 * One communicator per process, created at the first CUDA collective (every rank gets there in
 * the same collective): rank 0 draws the unique id, MPI broadcasts it, ncclCommInitRank on the
 * tensor's GPU (dist.c has given each rank of a node its own GPU via CUDA_VISIBLE_DEVICES). Ops
 * run on a stream of their own and are waited for before returning (core's CUDA calls are all
 * synchronous). libnccl is opened with dlopen, so an nvlua built with NCCL still starts where
 * the library is missing; a CUDA collective then fails with a message saying so.
 * Faults: dist.c's watchdog calls nvl_nccl_watch every 100 ms, which polls ncclCommGetAsyncError
 * and aborts the communicator on an error; on a timeout it calls nvl_nccl_abort. Either way the
 * process then ends with a message, as the MPI path does. */
#include "dist_nccl.h"

#ifndef NVLUA_HAVE_NCCL

#define NO_NCCL(op) \
  nvl_error(NVL_EUNSUPPORTED, "%s: CUDA tensors need nvlua built with CUDA and NCCL (this build has no NCCL); " \
            "use CPU tensors", op)
int nvl_nccl_compiled(void) { return 0; }
int nvl_nccl_load(const char **why) {
  if (why) *why = "nvlua was built without NCCL";
  return 0;
}
const char *nvl_nccl_watch(int in_op) { (void)in_op; return NULL; }
void nvl_nccl_abort(void) {}
void nvl_nccl_shutdown(void) {}
nvl_status nvl_nccl_all_reduce(nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  (void)t; (void)op; (void)rank; (void)world;
  return NO_NCCL("all_reduce");
}
nvl_status nvl_nccl_broadcast(nvl_tensor *t, int root, int rank, int world) {
  (void)t; (void)root; (void)rank; (void)world;
  return NO_NCCL("broadcast");
}
nvl_status nvl_nccl_all_reduce_start(nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  (void)t; (void)op; (void)rank; (void)world;
  return NO_NCCL("all_reduce_start");
}
nvl_status nvl_nccl_wait_all(void) { return NVL_OK; }
nvl_status nvl_nccl_reduce_scatter(nvl_tensor *out, const nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  (void)out; (void)t; (void)op; (void)rank; (void)world;
  return NO_NCCL("reduce_scatter");
}
nvl_status nvl_nccl_all_gather(nvl_tensor *out, const nvl_tensor *t, int in_place, int rank, int world) {
  (void)out; (void)t; (void)in_place; (void)rank; (void)world;
  return NO_NCCL("all_gather");
}
nvl_status nvl_nccl_all_reduce_ordered(nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  (void)t; (void)op; (void)rank; (void)world;
  return NO_NCCL("all_reduce");
}
nvl_status nvl_nccl_all_gather_ordered(nvl_tensor *out, const nvl_tensor *t, int rank, int world) {
  (void)out; (void)t; (void)rank; (void)world;
  return NO_NCCL("all_gather");
}
nvl_status nvl_nccl_all_gather_start(nvl_tensor *out, const nvl_tensor *t, int rank, int world, int *slot) {
  (void)out; (void)t; (void)rank; (void)world; (void)slot;
  return NO_NCCL("all_gather_start");
}
nvl_status nvl_nccl_event_wait(int slot) {
  (void)slot;
  return NVL_OK;
}

#else /* NVLUA_HAVE_NCCL */

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#ifndef NVLUA_NCCL_LIBRARY
#define NVLUA_NCCL_LIBRARY "libnccl.so"
#endif

/* The NCCL functions nvlua calls, resolved from the library at run time. */
static struct {
  int tried, ok;
  char why[512];
  void *lib;
  __typeof__(ncclGetUniqueId) *GetUniqueId;
  __typeof__(ncclCommInitRank) *CommInitRank;
  __typeof__(ncclCommDestroy) *CommDestroy;
  __typeof__(ncclCommAbort) *CommAbort;
  __typeof__(ncclCommGetAsyncError) *CommGetAsyncError;
  __typeof__(ncclGetErrorString) *GetErrorString;
  __typeof__(ncclAllReduce) *AllReduce;
  __typeof__(ncclBroadcast) *Broadcast;
  __typeof__(ncclReduceScatter) *ReduceScatter;
  __typeof__(ncclAllGather) *AllGather;
} N;

static ncclComm_t comm;            /* NULL until the first CUDA collective */
static cudaStream_t stream;
static cudaEvent_t ready, done;    /* stream 0's work before a collective; the collective itself */
static atomic_int aborted;         /* set (by either thread) once the communicator is aborted */
static const char *abort_reason = "";

int nvl_nccl_compiled(void) { return 1; }

#ifdef NVL_CUDA_EMU
/* The emulation build (kernels/cuda/emu): NCCL is the emulator's, linked in. */
int nvl_nccl_load(const char **why) {
  if (!N.tried) {
    N.tried = N.ok = 1;
    N.GetUniqueId = ncclGetUniqueId;
    N.CommInitRank = ncclCommInitRank;
    N.CommDestroy = ncclCommDestroy;
    N.CommAbort = ncclCommAbort;
    N.CommGetAsyncError = ncclCommGetAsyncError;
    N.GetErrorString = ncclGetErrorString;
    N.AllReduce = ncclAllReduce;
    N.Broadcast = ncclBroadcast;
    N.ReduceScatter = ncclReduceScatter;
    N.AllGather = ncclAllGather;
  }
  if (why) *why = "";
  return 1;
}
#else
int nvl_nccl_load(const char **why) {
  if (!N.tried) {
    N.tried = 1;
    N.lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!N.lib) N.lib = dlopen(NVLUA_NCCL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!N.lib) {
      snprintf(N.why, sizeof N.why, "cannot load libnccl.so.2 or %s: %s", NVLUA_NCCL_LIBRARY, dlerror());
    } else {
      struct { void **fn; const char *name; } syms[] = {
        {(void **)&N.GetUniqueId, "ncclGetUniqueId"}, {(void **)&N.CommInitRank, "ncclCommInitRank"},
        {(void **)&N.CommDestroy, "ncclCommDestroy"}, {(void **)&N.CommAbort, "ncclCommAbort"},
        {(void **)&N.CommGetAsyncError, "ncclCommGetAsyncError"}, {(void **)&N.GetErrorString, "ncclGetErrorString"},
        {(void **)&N.AllReduce, "ncclAllReduce"}, {(void **)&N.Broadcast, "ncclBroadcast"},
        {(void **)&N.ReduceScatter, "ncclReduceScatter"}, {(void **)&N.AllGather, "ncclAllGather"}};
      N.ok = 1;
      for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].fn = dlsym(N.lib, syms[i].name);
        if (!*syms[i].fn) {
          snprintf(N.why, sizeof N.why, "libnccl has no %s", syms[i].name);
          N.ok = 0;
          break;
        }
      }
    }
  }
  if (why) *why = N.ok ? "" : N.why;
  return N.ok;
}
#endif

static nvl_status nccl_fail(const char *op, const char *call, ncclResult_t r) {
  return nvl_error(NVL_EDEVICE, "%s: %s failed: %s", op, call, N.GetErrorString(r));
}

static nvl_status cuda_fail(const char *op, const char *call, cudaError_t e) {
  (void)cudaGetLastError();
  return nvl_error(NVL_EDEVICE, "%s: %s failed: %s", op, call, cudaGetErrorString(e));
}

/* The communicator, created on t's GPU at the first CUDA collective. */
static nvl_status ensure_comm(const char *op, const nvl_tensor *t, int rank, int world) {
  const char *why;
  if (comm) return NVL_OK;
  if (!nvl_nccl_load(&why)) return nvl_error(NVL_EUNSUPPORTED, "%s: NCCL is not available: %s", op, why);
  cudaError_t e = cudaSetDevice(t->storage->device_index);
  if (e != cudaSuccess) return cuda_fail(op, "cudaSetDevice", e);
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = N.GetUniqueId(&id);
    if (r != ncclSuccess) return nccl_fail(op, "ncclGetUniqueId", r);
  }
  if (world > 1) NVL_TRY(nvl_dist_bcast_bytes(&id, (int)sizeof id, 0));
  ncclResult_t r = N.CommInitRank(&comm, world, id, rank);
  if (r != ncclSuccess) {
    comm = NULL;
    return nccl_fail(op, "ncclCommInitRank", r);
  }
  /* comm is the "set up" mark: on a failure below everything is undone, so the next collective
   * tries again instead of using a NULL stream or event */
  const char *call = "cudaStreamCreateWithFlags";
  e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) {
    call = "cudaEventCreateWithFlags";
    if ((e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming)) == cudaSuccess)
      e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  }
  if (e != cudaSuccess) {
    nvl_status st = cuda_fail(op, call, e);
    if (ready) (void)cudaEventDestroy(ready);
    if (stream) (void)cudaStreamDestroy(stream);
    ready = NULL;
    stream = NULL;
    (void)N.CommDestroy(comm);
    comm = NULL;
    return st;
  }
  return NVL_OK;
}

/* Order the collective after everything queued on stream 0, where every kernel and GEMM runs:
 * `stream` is non-blocking, so without this event wait (NVLUA_CUDA_SYNC=0) NCCL could read
 * gradients still being written. */
static nvl_status after_default_stream(const char *op) {
  cudaError_t e = cudaEventRecord(ready, 0);
  if (e != cudaSuccess) return cuda_fail(op, "cudaEventRecord", e);
  e = cudaStreamWaitEvent(stream, ready, 0);
  if (e != cudaSuccess) return cuda_fail(op, "cudaStreamWaitEvent", e);
  return NVL_OK;
}

/* Wait for the op just enqueued (r its launch result); fails if the communicator was aborted. */
static nvl_status finish(const char *op, const char *call, ncclResult_t r) {
  if (r != ncclSuccess) return nccl_fail(op, call, r);
  /* and stream 0's later work after the collective (the host waits below too) */
  cudaError_t re = cudaEventRecord(done, stream);
  if (re == cudaSuccess) re = cudaStreamWaitEvent(0, done, 0);
  if (re != cudaSuccess) return cuda_fail(op, "cudaEventRecord/cudaStreamWaitEvent", re);
  for (;;) {
    cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return NVL_OK;
    if (e != cudaErrorNotReady) return cuda_fail(op, "cudaStreamQuery", e);
    if (atomic_load(&aborted)) return nvl_error(NVL_EDEVICE, "%s: the NCCL communicator was aborted: %s", op, abort_reason);
    struct timespec ts = {0, 20 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* The op just enqueued (r its launch result) without the host's wait: stream 0's later work waits
 * for it (an event). */
static nvl_status ordered(const char *op, const char *call, ncclResult_t r) {
  if (r != ncclSuccess) return nccl_fail(op, call, r);
  if (atomic_load(&aborted)) return nvl_error(NVL_EDEVICE, "%s: the NCCL communicator was aborted: %s", op, abort_reason);
  cudaError_t e = cudaEventRecord(done, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(0, done, 0);
  if (e != cudaSuccess) return cuda_fail(op, "cudaEventRecord/cudaStreamWaitEvent", e);
  return NVL_OK;
}

static nvl_status check(const char *op, const nvl_tensor *t, ncclDataType_t *dt) {
  char d[160];
  if (!nvl_tensor_is_contiguous(t)) return nvl_error(NVL_EUNSUPPORTED, "%s: CUDA tensors must be contiguous, got %s", op, nvl_tensor_desc(t, d, sizeof d));
  switch (t->dtype) {
    case NVL_F32: *dt = ncclFloat32; break;
    case NVL_BF16: *dt = ncclBfloat16; break;
    case NVL_I32: *dt = ncclInt32; break;
    case NVL_I64: *dt = ncclInt64; break;
    case NVL_U8: *dt = ncclUint8; break;
    default: return nvl_error(NVL_EUNSUPPORTED, "%s: NCCL has no %s", op, nvl_dtypes[t->dtype].name);
  }
  return NVL_OK;
}

static ncclRedOp_t red(nvl_dist_op op) {
  return op == NVL_DIST_AVG ? ncclAvg : op == NVL_DIST_MAX ? ncclMax : op == NVL_DIST_MIN ? ncclMin : ncclSum;
}

/* Queue t's all-reduce on `stream` after stream 0's work; *r: NCCL's launch result. */
static nvl_status queue_all_reduce(const char *name, nvl_tensor *t, nvl_dist_op op, int rank, int world,
                                   ncclResult_t *r) {
  ncclDataType_t dt = ncclFloat32;
  NVL_TRY(check(name, t, &dt));
  NVL_TRY(ensure_comm(name, t, rank, world));
  NVL_TRY(after_default_stream(name));
  void *p = nvl_tensor_data(t);
  *r = N.AllReduce(p, p, (size_t)nvl_tensor_numel(t), dt, red(op), comm, stream);
  return NVL_OK;
}

nvl_status nvl_nccl_all_reduce(nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  ncclResult_t r;
  NVL_TRY(queue_all_reduce("all_reduce", t, op, rank, world, &r));
  return finish("all_reduce", "ncclAllReduce", r);
}

/* Bucketed all-reduces: queued on `stream` in order, each after stream 0's work so far; the
 * waiting is left to nvl_nccl_wait_all (stream 0 waits for the last one's event). */
static int started; /* queued since the last wait_all */

nvl_status nvl_nccl_all_reduce_start(nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  ncclResult_t r;
  NVL_TRY(queue_all_reduce("all_reduce_start", t, op, rank, world, &r));
  if (r != ncclSuccess) return nccl_fail("all_reduce_start", "ncclAllReduce", r);
  started++;
  return NVL_OK;
}

nvl_status nvl_nccl_wait_all(void) {
  if (!started) return NVL_OK;
  started = 0;
  if (atomic_load(&aborted)) return nvl_error(NVL_EDEVICE, "all_reduce: the NCCL communicator was aborted: %s", abort_reason);
  cudaError_t e = cudaEventRecord(done, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(0, done, 0); /* stream 0's later work after them; no host wait */
  if (e != cudaSuccess) return cuda_fail("all_reduce", "cudaEventRecord/cudaStreamWaitEvent", e);
  return NVL_OK;
}

nvl_status nvl_nccl_broadcast(nvl_tensor *t, int root, int rank, int world) {
  ncclDataType_t dt = ncclFloat32;
  NVL_TRY(check("broadcast", t, &dt));
  NVL_TRY(ensure_comm("broadcast", t, rank, world));
  NVL_TRY(after_default_stream("broadcast"));
  void *p = nvl_tensor_data(t);
  return finish("broadcast", "ncclBroadcast", N.Broadcast(p, p, (size_t)nvl_tensor_numel(t), dt, root, comm, stream));
}

nvl_status nvl_nccl_reduce_scatter(nvl_tensor *out, const nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  ncclDataType_t dt = ncclFloat32;
  NVL_TRY(check("reduce_scatter", t, &dt));
  NVL_TRY(check("reduce_scatter", out, &dt));
  NVL_TRY(ensure_comm("reduce_scatter", t, rank, world));
  NVL_TRY(after_default_stream("reduce_scatter"));
  return finish("reduce_scatter", "ncclReduceScatter", N.ReduceScatter(nvl_tensor_data(t), nvl_tensor_data(out),
                (size_t)nvl_tensor_numel(out), dt, red(op), comm, stream));
}

nvl_status nvl_nccl_all_gather(nvl_tensor *out, const nvl_tensor *t, int in_place, int rank, int world) {
  ncclDataType_t dt = ncclFloat32;
  (void)in_place; /* NCCL gathers in place when t is out's own chunk: the same call */
  NVL_TRY(check("all_gather", t, &dt));
  NVL_TRY(check("all_gather", out, &dt));
  NVL_TRY(ensure_comm("all_gather", t, rank, world));
  NVL_TRY(after_default_stream("all_gather"));
  return finish("all_gather", "ncclAllGather", N.AllGather(nvl_tensor_data(t), nvl_tensor_data(out),
                (size_t)nvl_tensor_numel(t), dt, comm, stream));
}

nvl_status nvl_nccl_all_reduce_ordered(nvl_tensor *t, nvl_dist_op op, int rank, int world) {
  ncclResult_t r;
  NVL_TRY(queue_all_reduce("all_reduce", t, op, rank, world, &r));
  return ordered("all_reduce", "ncclAllReduce", r);
}

nvl_status nvl_nccl_all_gather_ordered(nvl_tensor *out, const nvl_tensor *t, int rank, int world) {
  ncclDataType_t dt = ncclFloat32;
  NVL_TRY(check("all_gather", t, &dt));
  NVL_TRY(check("all_gather", out, &dt));
  NVL_TRY(ensure_comm("all_gather", t, rank, world));
  NVL_TRY(after_default_stream("all_gather"));
  return ordered("all_gather", "ncclAllGather", N.AllGather(nvl_tensor_data(t), nvl_tensor_data(out),
                 (size_t)nvl_tensor_numel(t), dt, comm, stream));
}

/* The events of started all-gathers (nvl_nccl_all_gather_start), made at first use. */
#define NCCL_EVENTS 256
static cudaEvent_t gather_ev[NCCL_EVENTS];
static int gather_ev_used[NCCL_EVENTS];

nvl_status nvl_nccl_all_gather_start(nvl_tensor *out, const nvl_tensor *t, int rank, int world, int *slot) {
  ncclDataType_t dt = ncclFloat32;
  NVL_TRY(check("all_gather_start", t, &dt));
  NVL_TRY(check("all_gather_start", out, &dt));
  int s = 0;
  while (s < NCCL_EVENTS && gather_ev_used[s]) s++;
  if (s == NCCL_EVENTS) return nvl_error(NVL_EINVAL, "all_gather_start: more than %d all-gathers in flight", NCCL_EVENTS);
  NVL_TRY(ensure_comm("all_gather_start", t, rank, world));
  if (!gather_ev[s]) {
    cudaError_t e = cudaEventCreateWithFlags(&gather_ev[s], cudaEventDisableTiming);
    if (e != cudaSuccess) {
      gather_ev[s] = NULL;
      return cuda_fail("all_gather_start", "cudaEventCreateWithFlags", e);
    }
  }
  NVL_TRY(after_default_stream("all_gather_start"));
  ncclResult_t r = N.AllGather(nvl_tensor_data(t), nvl_tensor_data(out), (size_t)nvl_tensor_numel(t), dt, comm, stream);
  if (r != ncclSuccess) return nccl_fail("all_gather_start", "ncclAllGather", r);
  cudaError_t e = cudaEventRecord(gather_ev[s], stream);
  if (e != cudaSuccess) return cuda_fail("all_gather_start", "cudaEventRecord", e);
  gather_ev_used[s] = 1;
  *slot = s;
  return NVL_OK;
}

nvl_status nvl_nccl_event_wait(int slot) {
  if (slot < 0 || slot >= NCCL_EVENTS || !gather_ev_used[slot])
    return nvl_error(NVL_EINVAL, "all_gather_wait: no all-gather in flight in slot %d", slot);
  gather_ev_used[slot] = 0;
  if (atomic_load(&aborted)) return nvl_error(NVL_EDEVICE, "all_gather: the NCCL communicator was aborted: %s", abort_reason);
  cudaError_t e = cudaStreamWaitEvent(0, gather_ev[slot], 0);
  if (e != cudaSuccess) return cuda_fail("all_gather_wait", "cudaStreamWaitEvent", e);
  return NVL_OK;
}

const char *nvl_nccl_watch(int in_op) {
  (void)in_op;
  if (!comm || atomic_load(&aborted)) return NULL;
  ncclResult_t ar = ncclSuccess;
  if (N.CommGetAsyncError(comm, &ar) != ncclSuccess || ar == ncclSuccess || ar == ncclInProgress) return NULL;
  abort_reason = N.GetErrorString(ar);
  atomic_store(&aborted, 1);
  N.CommAbort(comm);
  return abort_reason;
}

void nvl_nccl_abort(void) {
  if (comm && !atomic_exchange(&aborted, 1)) {
    abort_reason = "timeout or failure of another rank";
    N.CommAbort(comm);
  }
}

void nvl_nccl_shutdown(void) {
  if (!comm) return;
  if (!atomic_load(&aborted)) N.CommDestroy(comm);
  for (int s = 0; s < NCCL_EVENTS; s++)
    if (gather_ev[s]) {
      cudaEventDestroy(gather_ev[s]);
      gather_ev[s] = NULL;
      gather_ev_used[s] = 0;
    }
  cudaStreamDestroy(stream);
  cudaEventDestroy(ready);
  cudaEventDestroy(done);
  comm = NULL;
}

#endif /* NVLUA_HAVE_NCCL */
