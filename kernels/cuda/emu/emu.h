/* emu.h: what the parts of the CUDA emulator share (runtime.cpp: devices, memory, streams, errors,
 * counters; launch.cpp: fibers and the block scheduler; blaslt.cpp: cuBLASLt; cudnn.cpp: cuDNN's graph API; nccl.cpp:
 * NCCL).
 * Private to kernels/cuda/emu; C++.
 *
 * Memory: device allocations live in a reserved address range that is never readable by the host
 * (PROT_NONE): host code that dereferences a device pointer faults, and the fault handler names the
 * allocation. Their bytes live at the same offset in a second range (the "host view"); the emulator
 * translates device pointers to it where device code runs (kernel arguments, copies, GEMMs,
 * collectives). Each allocation ends at a page boundary followed by an inaccessible page, so a kernel
 * reading or writing past its end faults too.
 *
 * Ordering: every device operation (kernel, copy, memset, GEMM, collective) is an op on a stream; it
 * runs at once, in call order, but the emulator keeps what each stream, and the host, is known to
 * have waited for (vector clocks: a stream synchronisation or query, an event wait, the legacy
 * default stream's implicit waits). An op that reads an allocation last written by an op of another
 * stream it has not waited for, or writes one another stream read or wrote, is a stream-order race:
 * on a GPU it would read or overwrite data that may not be there yet. */
#ifndef NVL_EMU_H
#define NVL_EMU_H
#include <stdarg.h>
#include <stdint.h>

#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime_api.h"

namespace nvl_emu {

/* ---- the lock and the configuration (environment, read at the first call) ------------------------ */

std::recursive_mutex &big_lock();
#define NVL_EMU_LOCK std::lock_guard<std::recursive_mutex> nvl_emu_lock_(::nvl_emu::big_lock())

struct Config {
  int gpus;             /* NVLUA_EMU_GPUS: emulated devices in the machine (1..8, default 1) */
  int cc;               /* NVLUA_EMU_CC: 90 (H100), 100 (B200), 103 (B300), 120 (RTX 5090), 80 (A100) */
  size_t capacity;      /* NVLUA_EMU_MEMORY_MB: device memory per device */
  int order;            /* NVLUA_EMU_ORDER: 0 forward, 1 reverse, 2 shuffle (threads and blocks) */
  uint64_t seed;        /* NVLUA_EMU_ORDER=shuffle:SEED */
  int fatal;            /* NVLUA_EMU_FATAL=1: abort at the first error */
  int fill;             /* NVLUA_EMU_FILL: byte of new allocations (-1: none), default 0xFF */
  int cuda_aware_mpi;   /* NVLUA_EMU_CUDA_AWARE_MPI=1: MPI_Init starts the CUDA runtime */
  char bad[256];        /* why the configuration was refused ("" if it was not) */
};
/* Read the environment and CUDA_VISIBLE_DEVICES once (the first CUDA call of the process). */
void init();
const Config &config();

/* ---- devices --------------------------------------------------------------------------------- */

int visible_devices();
const cudaDeviceProp &props(int dev);
int physical_index(int dev);
int current_device();

/* ---- memory ------------------------------------------------------------------------------------ */

struct Alloc {
  uintptr_t d;              /* the device address */
  char *h;                  /* the host view of the same bytes */
  size_t size;              /* bytes asked for */
  size_t off, pages;        /* position in the ranges, pages held (the guard page included) */
  int dev;
  int pinned_host;          /* cudaMallocHost memory: a host allocation (not in the device range) */
  /* ordering: the last write (stream id, op number, what) and the last read per stream */
  int w_stream;
  uint64_t w_seq;
  const char *w_what;
  std::vector<uint64_t> r_seq;
};

/* The live device allocation holding [p, p + bytes) (bytes 0: p may be its end), or NULL. */
Alloc *find_alloc(const void *p, size_t bytes);
bool in_device_range(const void *p);
bool is_pinned_host(const void *p, size_t bytes);
inline char *host_view(const Alloc *a, const void *p) { return a->h + ((uintptr_t)p - a->d); }
/* Describe p for a message: "device allocation of N bytes at 0x..+off" or "host memory". */
std::string describe_ptr(const void *p);

/* ---- streams, ops and ordering ---------------------------------------------------------------------- */

struct Stream;
/* The stream of handle s (NULL: the legacy default stream of the current device), or NULL if the
 * handle is not a live stream (the error is set). */
Stream *stream_of(cudaStream_t s, const char *fn);
std::string stream_name(const Stream *s);
int stream_device(const Stream *s);

enum { ACC_READ = 1, ACC_WRITE = 2 };
struct Access {
  Alloc *a;
  int mode;
  const char *what; /* "A", "argument #2", "recvbuff", ... */
};
/* Enqueue an op named `name` on s that accesses acc[0..n): checks stream order (a race is an
 * error, reported like a kernel fault) and records the accesses. Returns false on a race. */
bool op_enqueue(Stream *s, const char *name, const Access *acc, int n);
/* The host has waited for everything s has queued so far (a synchronisation or a successful query). */
void host_waits_for(Stream *s);

/* ---- errors ------------------------------------------------------------------------------------------ */

/* A refused call: cudaGetLastError returns e, cudaGetErrorString(e) adds the message. Returns e. */
cudaError_t refuse(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* An error found while running device work (a kernel rule broken, a race, a fault a GPU would
 * report): printed on stderr at once, returned by the next synchronising call as e. */
void fault(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The pending fault, cleared (cudaSuccess if none). */
cudaError_t take_fault();
/* The detailed message kept for e (or NULL). */
const char *detail_of(cudaError_t e);

/* ---- counters ---------------------------------------------------------------------------------------- */

struct KernelCount {
  const void *key;
  std::string name;
  int64_t launches, blocks, threads;
  int64_t bytes_read, bytes_written; /* global memory, page-granular (see track_begin) */
};
/* One GEMM shape and type signature (cublasLtMatmul calls with the same key add up). */
struct GemmCount {
  int type_a, type_b, type_d; /* cudaDataType */
  int scale_mode;             /* CUBLASLT_MATMUL_MATRIX_SCALE_* of A (0: none or per-tensor) */
  int64_t m, n, k;
  int64_t calls, flops, bytes_a, bytes_b, bytes_c, bytes_d, bytes_scales;
};
struct Counters {
  int64_t launches, host_syncs, queries, memcpy_h2d, memcpy_d2h, memcpy_d2d, memsets, gemms, heuristics,
      collectives, cudnn_plans, cudnn_executes;
  int64_t memcpy_h2d_bytes, memcpy_d2h_bytes, memcpy_d2d_bytes, memset_bytes, gemm_flops;
  int64_t gemm_subnormals; /* bf16 x bf16 GEMMs: subnormal inputs, products and partial sums met (blaslt.cpp) */
  std::vector<KernelCount> kernels;
  std::vector<GemmCount> gemm_shapes;
};
Counters &counters();
KernelCount &kernel_counter(const void *key, const char *name);
/* Add one GEMM call to its shape's counter. */
void count_gemm(const GemmCount &g);

/* Global-memory bytes of a kernel launch (x86-64 only; elsewhere nothing is counted): track_begin
 * makes the host view of every allocation the kernel may access (its arguments) inaccessible; the
 * fault handler marks each page a kernel thread touches as read (first access a load: the page
 * becomes read-only) or written (a store: read-write), so a page is marked read at most at its
 * first load and written at its first store; a load of a page after a store to it is not seen.
 * track_end adds, per allocation, the bytes of its marked pages that lie inside it (a page clipped
 * to the allocation's bytes) to k, and restores the access. So the counts are the unique bytes
 * touched per launch, rounded out to the 4 KiB pages touched (clipped to each allocation). */
bool bytes_tracking_supported();
void track_begin(const Access *acc, int n);
void track_end(KernelCount &k);

/* ---- launch.cpp ----------------------------------------------------------------------------------------- */

/* 1 while a kernel's threads run (the fault handler's context). */
bool in_kernel();
/* "kernel NAME, block (x,y,z), thread (x,y,z)" of the running thread, for messages. */
std::string kernel_context();
/* Is addr inside a fiber stack's guard page? */
bool in_fiber_guard(const void *addr);
/* cudaFuncSetAttribute's value for kernel (0: not set). */
int max_dynamic_smem(const void *kernel);

}  // namespace nvl_emu

#include "emu_api.h"

#endif
