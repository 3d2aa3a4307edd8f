/* nccl.cpp: NCCL on the CPU, for the emulation build: the collectives core/dist_nccl.c calls, one
 * rank per process. A collective is an op on the stream it is given, so its reads and writes are
 * checked against stream order like a kernel's (a collective on a stream that has not waited for the
 * kernels that wrote its buffer is a race); between processes the bytes travel by MPI (every rank
 * gathers every rank's buffer and reduces them in rank order, so all ranks get the same bits).
 * bf16 is reduced in fp32 and rounded once; avg is the sum divided by the number of ranks.
 *
 * Also here: MPI_Init_thread as a CUDA-aware MPI behaves (NVLUA_EMU_CUDA_AWARE_MPI=1): it starts the
 * CUDA runtime before MPI itself, so CUDA_VISIBLE_DEVICES is read then (and later changes to it are
 * ignored, as on a real machine).
 *
 * Not here: communicator splitting, point-to-point, groups, non-blocking communicators. */
#include <stdio.h>
#include <string.h>

#include <vector>

#include "dtype.h"
#include "emu.h"
#include "nccl.h"

#ifdef NVLUA_HAVE_MPI
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

struct nvl_emu_nccl_comm {
  int rank, nranks, dev;
  bool aborted;
};

namespace nvl_emu {

static size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

static double get(ncclDataType_t t, const char *p, size_t i) {
  switch (t) {
    case ncclUint8: return ((const uint8_t *)p)[i];
    case ncclInt8: return ((const int8_t *)p)[i];
    case ncclInt32: return ((const int32_t *)p)[i];
    case ncclUint32: return ((const uint32_t *)p)[i];
    case ncclInt64: return (double)((const int64_t *)p)[i];
    case ncclUint64: return (double)((const uint64_t *)p)[i];
    case ncclFloat32: return ((const float *)p)[i];
    case ncclFloat64: return ((const double *)p)[i];
    case ncclBfloat16: return nvl_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0;
  }
}

/* One element of the reduction of `parts` (each rank's buffer, in rank order). Integers stay exact
 * (64-bit integers through int64 arithmetic), floats are summed in their own precision (bf16 in fp32). */
static void reduce_elem(ncclDataType_t t, ncclRedOp_t op, const std::vector<const char *> &parts, size_t i,
                        char *out) {
  const int n = (int)parts.size();
  if (t == ncclInt64 || t == ncclUint64 || t == ncclInt32 || t == ncclUint32 || t == ncclInt8 || t == ncclUint8) {
    int64_t r = (int64_t)get(t, parts[0], i);
    if (t == ncclInt64 || t == ncclUint64) memcpy(&r, parts[0] + 8 * i, 8);
    for (int k = 1; k < n; k++) {
      int64_t v = (int64_t)get(t, parts[(size_t)k], i);
      if (t == ncclInt64 || t == ncclUint64) memcpy(&v, parts[(size_t)k] + 8 * i, 8);
      r = op == ncclMax ? (v > r ? v : r) : op == ncclMin ? (v < r ? v : r) : op == ncclProd ? r * v : r + v;
    }
    if (op == ncclAvg) r /= n;
    memcpy(out, &r, type_size(t)); /* little-endian: the low bytes */
    return;
  }
  float r = (float)get(t, parts[0], i);
  double rd = get(t, parts[0], i);
  for (int k = 1; k < n; k++) {
    float v = (float)get(t, parts[(size_t)k], i);
    double vd = get(t, parts[(size_t)k], i);
    r = op == ncclMax ? (v > r ? v : r) : op == ncclMin ? (v < r ? v : r) : op == ncclProd ? r * v : r + v;
    rd = op == ncclMax ? (vd > rd ? vd : rd) : op == ncclMin ? (vd < rd ? vd : rd) : op == ncclProd ? rd * vd : rd + vd;
  }
  if (op == ncclAvg) {
    r /= (float)n;
    rd /= n;
  }
  if (t == ncclFloat32) memcpy(out, &r, 4);
  else if (t == ncclFloat64) memcpy(out, &rd, 8);
  else {
    uint16_t b = nvl_f32_to_bf16(r);
    memcpy(out, &b, 2);
  }
}

/* Every rank's `bytes` from p, in rank order, into all (nranks * bytes). */
static bool gather_all(const nvl_emu_nccl_comm *c, const char *p, size_t bytes, std::vector<char> &all) {
  all.resize(bytes * (size_t)c->nranks);
  if (c->nranks == 1) {
    memcpy(all.data(), p, bytes);
    return true;
  }
#ifdef NVLUA_HAVE_MPI
  return MPI_Allgather(p, (int)bytes, MPI_BYTE, all.data(), (int)bytes, MPI_BYTE, MPI_COMM_WORLD) == MPI_SUCCESS;
#else
  return false;
#endif
}

/* Queue a collective on s: check its buffers' stream order and resolve them to host views. */
static ncclResult_t begin(nvl_emu_nccl_comm *c, cudaStream_t h, const char *name, const void *send, size_t sbytes,
                          void *recv, size_t rbytes, char **hs, char **hr, bool *race) {
  *race = false;
  if (!c || c->aborted) return ncclInvalidUsage;
  Stream *s = stream_of(h, name);
  if (!s) return ncclInvalidArgument;
  Alloc *as = find_alloc(send, sbytes), *ar = find_alloc(recv, rbytes);
  if (!as || !ar || as->dev != c->dev || ar->dev != c->dev || stream_device(s) != c->dev) {
    fprintf(stderr, "nvlua cuda emulator: %s: buffers and stream must be memory of the communicator's device "
            "cuda:%d (send %s, recv %s)\n", name, c->dev, describe_ptr(send).c_str(), describe_ptr(recv).c_str());
    return ncclInvalidArgument;
  }
  Access acc[2] = {{as, ACC_READ, "sendbuff"}, {ar, ACC_WRITE, "recvbuff"}};
  if (as == ar) acc[0] = Access{as, ACC_READ | ACC_WRITE, "sendbuff (= recvbuff)"};
  counters().collectives++;
  if (!op_enqueue(s, name, acc, as == ar ? 1 : 2)) {
    *race = true;
    return ncclSuccess; /* the race is reported as a fault by the stream's next synchronisation */
  }
  *hs = host_view(as, send);
  *hr = host_view(ar, recv);
  return ncclSuccess;
}

}  // namespace nvl_emu

using namespace nvl_emu;

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "nvlua cuda emulator");
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  NVL_EMU_LOCK;
  init();
  (void)id;
  int world = 1;
#ifdef NVLUA_HAVE_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) MPI_Comm_size(MPI_COMM_WORLD, &world);
#endif
  if (nranks != world || rank < 0 || rank >= nranks) {
    fprintf(stderr, "nvlua cuda emulator: ncclCommInitRank(%d ranks, rank %d): the emulator's ranks are the %d MPI "
            "process(es)\n", nranks, rank, world);
    return ncclInvalidArgument;
  }
  *comm = new nvl_emu_nccl_comm{rank, nranks, current_device(), false};
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm) comm->aborted = true;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *err) {
  *err = comm && comm->aborted ? ncclRemoteError : ncclSuccess;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument (see the emulator's message above)";
    case ncclInvalidUsage: return "invalid usage (the communicator was aborted)";
    case ncclSystemError: return "unhandled system error (MPI failed)";
    default: return "NCCL error";
  }
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                           ncclComm_t c, cudaStream_t s) {
  NVL_EMU_LOCK;
  const size_t es = type_size(dt), bytes = count * es;
  char *hs, *hr;
  bool race;
  ncclResult_t r = begin(c, s, "ncclAllReduce", send, bytes, recv, bytes, &hs, &hr, &race);
  if (r != ncclSuccess || race || !count) return r;
  std::vector<char> all;
  if (!gather_all(c, hs, bytes, all)) return ncclSystemError;
  std::vector<const char *> parts;
  for (int k = 0; k < c->nranks; k++) parts.push_back(all.data() + (size_t)k * bytes);
  for (size_t i = 0; i < count; i++) reduce_elem(dt, op, parts, i, hr + i * es);
  return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t dt, int root, ncclComm_t c,
                           cudaStream_t s) {
  NVL_EMU_LOCK;
  const size_t bytes = count * type_size(dt);
  char *hs, *hr;
  bool race;
  ncclResult_t r = begin(c, s, "ncclBroadcast", send, bytes, recv, bytes, &hs, &hr, &race);
  if (r != ncclSuccess || race || !count) return r;
  if (root < 0 || root >= c->nranks) return ncclInvalidArgument;
  std::vector<char> all;
  if (!gather_all(c, hs, bytes, all)) return ncclSystemError;
  memcpy(hr, all.data() + (size_t)root * bytes, bytes);
  return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recv_count, ncclDataType_t dt, ncclRedOp_t op,
                               ncclComm_t c, cudaStream_t s) {
  NVL_EMU_LOCK;
  const size_t es = type_size(dt), rbytes = recv_count * es, sbytes = rbytes * (size_t)(c ? c->nranks : 1);
  char *hs, *hr;
  bool race;
  ncclResult_t r = begin(c, s, "ncclReduceScatter", send, sbytes, recv, rbytes, &hs, &hr, &race);
  if (r != ncclSuccess || race || !recv_count) return r;
  std::vector<char> all;
  if (!gather_all(c, hs, sbytes, all)) return ncclSystemError;
  std::vector<const char *> parts;
  for (int k = 0; k < c->nranks; k++) parts.push_back(all.data() + (size_t)k * sbytes + (size_t)c->rank * rbytes);
  for (size_t i = 0; i < recv_count; i++) reduce_elem(dt, op, parts, i, hr + i * es);
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t send_count, ncclDataType_t dt, ncclComm_t c,
                           cudaStream_t s) {
  NVL_EMU_LOCK;
  const size_t sbytes = send_count * type_size(dt), rbytes = sbytes * (size_t)(c ? c->nranks : 1);
  char *hs, *hr;
  bool race;
  ncclResult_t r = begin(c, s, "ncclAllGather", send, sbytes, recv, rbytes, &hs, &hr, &race);
  if (r != ncclSuccess || race || !send_count) return r;
  std::vector<char> all;
  if (!gather_all(c, hs, sbytes, all)) return ncclSystemError;
  memcpy(hr, all.data(), rbytes);
  return ncclSuccess;
}

#ifdef NVLUA_HAVE_MPI
/* A CUDA-aware MPI starts the CUDA runtime in MPI_Init (NVLUA_EMU_CUDA_AWARE_MPI=1 models one). */
int MPI_Init_thread(int *argc, char ***argv, int required, int *provided) {
  const char *e = getenv("NVLUA_EMU_CUDA_AWARE_MPI");
  if (e && e[0] == '1') nvl_emu::init();
  return PMPI_Init_thread(argc, argv, required, provided);
}
#endif

}  // extern "C"
