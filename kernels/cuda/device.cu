/* device.cu: the CUDA backend's device layer — device discovery, properties, versions, sync mode,
 * the caching allocator, copies, memset, event timing, and the elementwise f32 binary kernel
 * (add/sub/mul/div): the device API of the CUDA table (kernels/cuda/backend_cuda.c), with C
 * linkage. A build without nvcc has no CUDA table at all (core/dispatch.c says so).
 * Every CUDA call's failure becomes an nvl_status with a message naming the call and the device;
 * nothing here prints, exits or aborts. With no driver, no GPU, or a GPU this build cannot run on
 * (refuse_gpu: before sm_90, or consumer Blackwell), nvl_cuda_device_count() is 0
 * and nvl_cuda_unavailable_reason() says why (cudart is linked statically, so nvlua starts on
 * machines without a driver).
 * Not here: non-default streams, CUDA graphs, multi-GPU peer access.
 * Numerics: the binary kernel is exact IEEE-754 fp32 (round to nearest even, subnormals kept),
 * bit-identical to the CPU's `a op b` on floats whatever nvcc's -ftz/-prec-div/--use_fast_math
 * flags say (the ops are written as non-.ftz PTX). Only NaN payloads may differ: the GPU returns
 * the canonical NaN. */
#include <cublasLt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cuda/flash_attn.h"

#define NVL_MAX_GPUS 16

/* ---- discovery ---------------------------------------------------------------------------- */

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static int probe_count;        /* usable devices, 0 on any failure */
static char probe_reason[640]; /* "" when probe_count > 0 */

#ifndef NVL_CUDA_TARGETS /* CMakeLists.txt names the real build's -gencode targets */
#define NVL_CUDA_TARGETS "(emulated) sm_90a, sm_100a and sm_103a machine code and compute_90 PTX"
#endif

/* 1 (and probe_reason says why, naming the GPU) if this build cannot run on device d of n. Its machine
 * code is for sm_90a, sm_100a and sm_103a; its compute_90 PTX, which the driver compiles at first use,
 * runs on any later GPU (no kernel needs wgmma or tcgen05) but on none before sm_90. The flash
 * attention's blocks take more shared memory than consumer Blackwell (sm_120, RTX 50xx; sm_121, DGX
 * Spark) lets a block have, and the attention route does not look at the device: refused by that
 * measure, so a GPU that allows enough passes. */
static int refuse_gpu(int d, int n) {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0; /* the first use of the device reports it */
  }
  const int cc = 10 * p.major + p.minor;
  char name[160];
  snprintf(name, sizeof name, "%.159s", p.name);
  const size_t need = nvl_cuda_flash_attn_smem();
  const char *hide = n > 1 ? " Hide it with CUDA_VISIBLE_DEVICES." : "";
  if (cc < 90) {
    snprintf(probe_reason, sizeof probe_reason, "GPU %d, %s, is sm_%d: not supported; this build has %s, which need "
             "sm_90 (Hopper) or newer.%s", d, name, cc, NVL_CUDA_TARGETS, hide);
    return 1;
  }
  if (p.sharedMemPerBlockOptin < need) {
    snprintf(probe_reason, sizeof probe_reason, "GPU %d, %s, is sm_%d%s: not supported; a block may have %zu KiB of "
             "shared memory there and nvlua's flash attention takes %zu KiB (supported: sm_90 Hopper, sm_100 and "
             "sm_103 Blackwell).%s", d, name, cc, p.major == 12 ? " (consumer Blackwell)" : "",
             p.sharedMemPerBlockOptin / 1024, (need + 1023) / 1024, hide);
    return 1;
  }
  return 0;
}

/* cudaGetDeviceCount fails (without printing) when there is no driver or no device; the result
 * cannot change within a process (the runtime reads CUDA_VISIBLE_DEVICES once), so probe once. */
static void probe(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    int drv = 0, rt = 0;
    (void)cudaDriverGetVersion(&drv); /* 0 when no driver is installed */
    (void)cudaRuntimeGetVersion(&rt);
    (void)cudaGetLastError();
    if (e == cudaErrorInsufficientDriver && drv == 0)
      snprintf(probe_reason, sizeof probe_reason, "no CUDA driver found (libcuda.so.1 could not "
               "be loaded; cudaGetDeviceCount: %s)", cudaGetErrorName(e));
    else if (e == cudaErrorInsufficientDriver)
      snprintf(probe_reason, sizeof probe_reason, "the CUDA driver (%d.%d) is older than this "
               "build's CUDA runtime (%d.%d) (cudaGetDeviceCount: %s)", drv / 1000,
               drv % 1000 / 10, rt / 1000, rt % 1000 / 10, cudaGetErrorName(e));
    else
      snprintf(probe_reason, sizeof probe_reason, "cudaGetDeviceCount failed: %s (%s)",
               cudaGetErrorString(e), cudaGetErrorName(e));
    probe_count = 0;
  } else if (n <= 0) {
    snprintf(probe_reason, sizeof probe_reason, "no CUDA device found");
    probe_count = 0;
  } else {
    probe_reason[0] = '\0';
    probe_count = n > NVL_MAX_GPUS ? NVL_MAX_GPUS : n;
    for (int d = 0; d < probe_count; d++)
      if (refuse_gpu(d, probe_count)) {
        probe_count = 0;
        break;
      }
  }
}

extern "C" int nvl_cuda_device_count(void) {
  pthread_once(&probe_once, probe);
  return probe_count;
}

extern "C" const char *nvl_cuda_unavailable_reason(void) {
  pthread_once(&probe_once, probe);
  return probe_reason;
}

nvl_status nvl_cuda_use_device(int dev, const char *fn) {
  int n = nvl_cuda_device_count();
  if (n == 0)
    return nvl_error(NVL_EDEVICE, "%s: cuda:%d is not available: %s", fn, dev, probe_reason);
  if (dev < 0 || dev >= n)
    return nvl_error(NVL_EINVAL, "%s: no device cuda:%d (%d CUDA device%s)", fn, dev, n,
                     n == 1 ? "" : "s");
  cudaError_t e = cudaSetDevice(dev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nvl_error(NVL_EDEVICE, "%s: cudaSetDevice(%d) failed: %s (%s)", fn, dev,
                     cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}

extern "C" nvl_status nvl_cuda_device_props(int dev, nvl_device_props *p) {
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  cudaDeviceProp prop;
  NVL_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  snprintf(p->name, sizeof p->name, "%s", prop.name);
  p->total_mem = prop.totalGlobalMem;
  p->major = prop.major;
  p->minor = prop.minor;
  p->multiprocessors = prop.multiProcessorCount;
  snprintf(p->pci_bus_id, sizeof p->pci_bus_id, "%08X:%02X:%02X.0", (unsigned)prop.pciDomainID,
           (unsigned)prop.pciBusID, (unsigned)prop.pciDeviceID);
  return NVL_OK;
}

extern "C" int nvl_cuda_runtime_version(void) {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

/* Needs no GPU: it reports the version of the linked cuBLASLt library. */
extern "C" size_t nvl_cuda_blaslt_version(void) { return cublasLtGetVersion(); }

/* Cached per-device attributes: SM count and compute capability (0 until read). */
static int dev_sms[NVL_MAX_GPUS], dev_cc[NVL_MAX_GPUS];

static void read_attrs(int dev) {
  if (dev < 0 || dev >= NVL_MAX_GPUS || dev_sms[dev] > 0) return;
  int sms = 0, ma = 0, mi = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  dev_cc[dev] = 10 * ma + mi;
  dev_sms[dev] = sms > 0 ? sms : 1;
}

int nvl_cuda_sm_count(int dev) {
  read_attrs(dev);
  return dev >= 0 && dev < NVL_MAX_GPUS && dev_sms[dev] > 0 ? dev_sms[dev] : 1;
}

int nvl_cuda_cc(int dev) {
  read_attrs(dev);
  return dev >= 0 && dev < NVL_MAX_GPUS ? dev_cc[dev] : 0;
}

int nvl_cuda_grid(int64_t n, int threads, int dev) {
  int64_t blocks = (n + threads - 1) / threads;
  int64_t cap = (int64_t)nvl_cuda_sm_count(dev) * 16; /* grid-stride loops cover the rest */
  if (blocks > cap) blocks = cap;
  return blocks < 1 ? 1 : (int)blocks;
}

/* ---- non-finite flags (backend.h NVL_NONFINITE_*) -------------------------------------------- */

static uint32_t *nonfinite_words[NVL_MAX_GPUS];
static int nonfinite_tried[NVL_MAX_GPUS]; /* made, or failed once: no retry at every launch */
static pthread_mutex_t nonfinite_mu = PTHREAD_MUTEX_INITIALIZER;

uint32_t *nvl_cuda_nonfinite_word(int dev) {
  if (dev < 0 || dev >= NVL_MAX_GPUS) return NULL;
  uint32_t *w = __atomic_load_n(&nonfinite_words[dev], __ATOMIC_ACQUIRE); /* every launch: no lock */
  if (w) return w;
  pthread_mutex_lock(&nonfinite_mu);
  w = nonfinite_words[dev];
  if (!w && !nonfinite_tried[dev]) {
    nonfinite_tried[dev] = 1;
    void *p = NULL;
    if (cudaMalloc(&p, sizeof(uint32_t)) == cudaSuccess) {
      if (cudaMemsetAsync(p, 0, sizeof(uint32_t), 0) == cudaSuccess) {
        w = (uint32_t *)p;
        __atomic_store_n(&nonfinite_words[dev], w, __ATOMIC_RELEASE);
      } else {
        (void)cudaFree(p);
      }
    }
    (void)cudaGetLastError();
  }
  pthread_mutex_unlock(&nonfinite_mu);
  return w;
}

/* ---- sync mode ------------------------------------------------------------------------------ */

static int sync_mode = -1; /* -1: not read from the environment yet */

/* Off by default: kernels and copies are queued and the host runs ahead (a kernel's fault surfaces
 * at the next synchronisation). NVLUA_CUDA_SYNC=1 (or nv.cuda.set_sync(true)) waits after every
 * launch, so an error is reported by the call that caused it: for debugging. */
static int sync_on(void) {
  if (sync_mode < 0) {
    const char *e = getenv("NVLUA_CUDA_SYNC");
    sync_mode = e && e[0] == '1';
  }
  return sync_mode;
}

extern "C" int nvl_cuda_set_sync(int on) {
  int prev = sync_on();
  sync_mode = on ? 1 : 0;
  return prev;
}

extern "C" nvl_status nvl_cuda_synchronize(int dev) {
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nvl_error(NVL_EDEVICE, "cudaDeviceSynchronize on cuda:%d: an earlier asynchronous "
                     "operation failed: %s (%s)", dev, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}

nvl_status nvl_cuda_check_launch(int dev, const char *fn, const char *what) {
  cudaError_t e = cudaGetLastError();
  const char *stage = "launch of";
  if (e == cudaSuccess && sync_on()) {
    e = cudaStreamSynchronize(0);
    stage = "cudaStreamSynchronize after";
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nvl_error(NVL_EDEVICE, "%s: %s %s on cuda:%d failed: %s (%s)", fn, stage, what, dev,
                     cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}

/* ---- the caching allocator ------------------------------------------------------------------ *
 * Per device: a hash map of live blocks (pointer -> sizes) and an array of free blocks. A block
 * is one cudaMalloc allocation of a rounded size; an allocation takes the most recently freed
 * free block of exactly its rounded size, else calls cudaMalloc. All device work is on the legacy
 * default stream, so a block freed after the launches that use it and handed to a later launch is
 * only touched after those finished (stream order): no synchronisation is needed. Host code
 * never reads device memory except through synchronous copies. */

typedef struct {
  void *p;
  size_t size;      /* rounded (what cudaMalloc got) */
  size_t requested; /* live blocks: what the caller asked for */
} block;

typedef struct {
  block *live;      /* open addressing, key p (NULL = empty), tombstones p = (void *)1 */
  size_t live_cap, live_n, live_used;
  block *free_list;
  size_t free_n, free_cap;
  size_t allocated, peak, reserved, cached;
  int64_t mallocs;
} dev_alloc;

static dev_alloc allocs[NVL_MAX_GPUS];
static pthread_mutex_t alloc_mu = PTHREAD_MUTEX_INITIALIZER;
static int poison_byte = -1;
#define TOMB ((void *)1)

static size_t round_size(size_t n) {
  if (n == 0) n = 1;
  if (n <= ((size_t)1 << 20)) return (n + 511) & ~(size_t)511;
  if (n <= ((size_t)64 << 20)) return (n + ((size_t)128 << 10) - 1) & ~(((size_t)128 << 10) - 1);
  return (n + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
}

static size_t hash_ptr(const void *p, size_t cap) {
  uint64_t x = (uint64_t)(uintptr_t)p >> 8; /* cudaMalloc pointers are 256-byte aligned */
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return (size_t)x & (cap - 1);
}

/* Insert into the live map (grows it at 50% load, tombstones included); 0 on host OOM. */
static int live_insert(dev_alloc *a, block b) {
  if ((a->live_used + 1) * 2 > a->live_cap) {
    size_t cap = a->live_cap ? a->live_cap * 2 : 1024;
    while (a->live_n * 4 >= cap) cap *= 2;
    block *t = (block *)calloc(cap, sizeof(block));
    if (!t) return 0;
    for (size_t i = 0; i < a->live_cap; i++) {
      void *p = a->live[i].p;
      if (p == NULL || p == TOMB) continue;
      size_t h = hash_ptr(p, cap);
      while (t[h].p) h = (h + 1) & (cap - 1);
      t[h] = a->live[i];
    }
    free(a->live);
    a->live = t;
    a->live_cap = cap;
    a->live_used = a->live_n;
  }
  size_t h = hash_ptr(b.p, a->live_cap);
  while (a->live[h].p && a->live[h].p != TOMB) h = (h + 1) & (a->live_cap - 1);
  if (a->live[h].p == NULL) a->live_used++;
  a->live[h] = b;
  a->live_n++;
  return 1;
}

/* Remove p from the live map into *out; 0 if p is not live. */
static int live_remove(dev_alloc *a, void *p, block *out) {
  if (!a->live_cap) return 0;
  size_t h = hash_ptr(p, a->live_cap);
  while (a->live[h].p) {
    if (a->live[h].p == p) {
      *out = a->live[h];
      a->live[h].p = TOMB;
      a->live_n--;
      return 1;
    }
    h = (h + 1) & (a->live_cap - 1);
  }
  return 0;
}

/* Give every cached block of a back (caller holds the lock and has made dev current). */
static void release_cached(dev_alloc *a) {
  if (a->free_n) (void)cudaDeviceSynchronize();
  for (size_t i = 0; i < a->free_n; i++) {
    (void)cudaFree(a->free_list[i].p);
    a->reserved -= a->free_list[i].size;
  }
  a->free_n = 0;
  a->cached = 0;
  (void)cudaGetLastError();
}

/* bytes == 0 gives a 512-byte block (so every tensor has an address). */
extern "C" nvl_status nvl_cuda_malloc(void **p, size_t bytes, int dev) {
  *p = NULL;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  size_t size = round_size(bytes);
  pthread_mutex_lock(&alloc_mu);
  dev_alloc *a = &allocs[dev];
  block b = {NULL, size, bytes};
  for (size_t i = a->free_n; i-- > 0;) {
    if (a->free_list[i].size == size) {
      b.p = a->free_list[i].p;
      a->free_list[i] = a->free_list[--a->free_n];
      a->cached -= size;
      break;
    }
  }
  if (!b.p) {
    cudaError_t e = cudaMalloc(&b.p, size);
    if (e == cudaErrorMemoryAllocation && a->free_n) { /* give the cache back, try once more */
      (void)cudaGetLastError();
      release_cached(a);
      e = cudaMalloc(&b.p, size);
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      pthread_mutex_unlock(&alloc_mu);
      size_t fr = 0, tot = 0;
      if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) (void)cudaGetLastError();
      return nvl_error(e == cudaErrorMemoryAllocation ? NVL_ENOMEM : NVL_EDEVICE,
                       "cudaMalloc(%zu bytes) on cuda:%d failed: %s (%s); %zu MiB allocated by "
                       "nvlua, %zu MiB free of %zu MiB", size, dev, cudaGetErrorString(e),
                       cudaGetErrorName(e), a->allocated >> 20, fr >> 20, tot >> 20);
    }
    a->reserved += size;
    a->mallocs++;
  }
  if (!live_insert(a, b)) { /* host out of memory: hand the block to the cache and fail */
    if (a->free_n < a->free_cap) {
      a->free_list[a->free_n++] = b;
      a->cached += size;
    } else {
      (void)cudaFree(b.p);
      a->reserved -= size;
    }
    pthread_mutex_unlock(&alloc_mu);
    return nvl_error(NVL_ENOMEM, "nvl_cuda_malloc: out of host memory for the allocator's block map");
  }
  a->allocated += bytes;
  if (a->allocated > a->peak) a->peak = a->allocated;
  int poison = poison_byte;
  pthread_mutex_unlock(&alloc_mu);
  if (poison >= 0) {
    cudaError_t e = cudaMemsetAsync(b.p, poison, size, 0);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      nvl_cuda_free(b.p, dev);
      return nvl_error(NVL_EDEVICE, "nvl_cuda_malloc: cudaMemsetAsync (poisoning %zu bytes) on "
                       "cuda:%d failed: %s (%s)", size, dev, cudaGetErrorString(e), cudaGetErrorName(e));
    }
  }
  *p = b.p;
  return NVL_OK;
}

/* The block goes to the free list (stream order makes it reusable at once). Unknown pointers
 * and errors are dropped: a free has no way to report them. */
extern "C" void nvl_cuda_free(void *p, int dev) {
  if (p == NULL || dev < 0 || dev >= nvl_cuda_device_count()) return;
  pthread_mutex_lock(&alloc_mu);
  dev_alloc *a = &allocs[dev];
  block b;
  if (live_remove(a, p, &b)) {
    a->allocated -= b.requested;
    if (a->free_n == a->free_cap) {
      size_t cap = a->free_cap ? a->free_cap * 2 : 256;
      block *t = (block *)realloc(a->free_list, cap * sizeof(block));
      if (t) {
        a->free_list = t;
        a->free_cap = cap;
      }
    }
    if (a->free_n < a->free_cap) {
      a->free_list[a->free_n++] = b;
      a->cached += b.size;
    } else if (cudaSetDevice(dev) == cudaSuccess) { /* no room to remember it: give it back */
      (void)cudaFree(b.p);
      a->reserved -= b.size;
    }
  }
  pthread_mutex_unlock(&alloc_mu);
  (void)cudaGetLastError();
}

extern "C" nvl_status nvl_cuda_memory_stats(int dev, nvl_device_mem_stats *s) {
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  pthread_mutex_lock(&alloc_mu);
  dev_alloc *a = &allocs[dev];
  s->allocated = a->allocated;
  s->peak_allocated = a->peak;
  s->reserved = a->reserved;
  s->cached = a->cached;
  s->blocks = (int64_t)a->live_n;
  s->device_mallocs = a->mallocs;
  pthread_mutex_unlock(&alloc_mu);
  s->device_free = s->device_total = 0;
  if (cudaMemGetInfo(&s->device_free, &s->device_total) != cudaSuccess) {
    (void)cudaGetLastError();
    s->device_free = s->device_total = 0;
  }
  return NVL_OK;
}

extern "C" void nvl_cuda_empty_cache(int dev) {
  int n = nvl_cuda_device_count();
  for (int d = 0; d < n; d++) {
    if (dev >= 0 && d != dev) continue;
    if (cudaSetDevice(d) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    pthread_mutex_lock(&alloc_mu);
    release_cached(&allocs[d]);
    pthread_mutex_unlock(&alloc_mu);
  }
}

extern "C" int nvl_cuda_set_poison(int byte) {
  pthread_mutex_lock(&alloc_mu);
  int prev = poison_byte;
  poison_byte = byte < 0 ? -1 : (byte & 0xFF);
  pthread_mutex_unlock(&alloc_mu);
  return prev;
}

/* ---- timers --------------------------------------------------------------------- */

static cudaEvent_t timer_ev[NVL_MAX_GPUS][2];

extern "C" nvl_status nvl_cuda_timer_start(int dev) {
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  for (int i = 0; i < 2; i++)
    if (!timer_ev[dev][i]) NVL_CUDA_CHECK(cudaEventCreate(&timer_ev[dev][i]));
  NVL_CUDA_CHECK(cudaEventRecord(timer_ev[dev][0], 0));
  return NVL_OK;
}

extern "C" nvl_status nvl_cuda_timer_stop(int dev, double *ms) {
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  if (!timer_ev[dev][0] || !timer_ev[dev][1])
    return nvl_error(NVL_ESTATE, "%s: the timer of cuda:%d was not started", __func__, dev);
  NVL_CUDA_CHECK(cudaEventRecord(timer_ev[dev][1], 0));
  NVL_CUDA_CHECK(cudaEventSynchronize(timer_ev[dev][1]));
  float f = 0;
  NVL_CUDA_CHECK(cudaEventElapsedTime(&f, timer_ev[dev][0], timer_ev[dev][1]));
  *ms = f;
  return NVL_OK;
}

/* ---- copies --------------------------------------------------------------------------------- */

/* ---- host->device uploads without a host synchronisation ----------------------------------- *
 * A copy from pageable host memory makes the host wait for the device (all queued work first).
 * Small uploads (token ids and targets, every micro-batch) go through a per-device ring of pinned
 * staging slots instead: the bytes are copied into a slot on the host, the slot is queued
 * asynchronously, and an event recorded after it; a slot is reused only once its event has passed
 * (cudaEventSynchronize in the rare case it has not: the only wait). The caller's buffer is free
 * when nvl_cuda_memcpy returns, as before. */
enum { STAGE_SLOTS = 8, STAGE_SLOT_BYTES = 1 << 20 };
struct Stage {
  bool ready;
  char *slot[STAGE_SLOTS];
  cudaEvent_t done[STAGE_SLOTS];
  bool used[STAGE_SLOTS];
  int next;
};
static Stage stages[NVL_MAX_GPUS];
static pthread_mutex_t stage_mu = PTHREAD_MUTEX_INITIALIZER;

/* 1: queued through a staging slot; 0: not staged (too large, or no pinned memory: the caller
 * copies the plain way); -1: a CUDA error (set). */
static int staged_upload(void *dst, const void *src, size_t bytes, int dev) {
  if (bytes > STAGE_SLOT_BYTES || dev < 0 || dev >= NVL_MAX_GPUS) return 0;
  pthread_mutex_lock(&stage_mu);
  Stage *g = &stages[dev];
  if (!g->ready) {
    for (int i = 0; i < STAGE_SLOTS; i++) {
      if (cudaMallocHost((void **)&g->slot[i], STAGE_SLOT_BYTES) != cudaSuccess ||
          cudaEventCreateWithFlags(&g->done[i], cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        for (int j = 0; j <= i; j++) { /* give up on staging for this device: plain copies */
          if (g->slot[j]) cudaFreeHost(g->slot[j]);
          if (g->done[j]) cudaEventDestroy(g->done[j]);
          g->slot[j] = NULL;
          g->done[j] = NULL;
        }
        (void)cudaGetLastError();
        pthread_mutex_unlock(&stage_mu);
        return 0;
      }
    }
    g->ready = true;
  }
  const int i = g->next;
  g->next = (i + 1) % STAGE_SLOTS;
  cudaError_t e = cudaSuccess;
  if (g->used[i] && cudaEventQuery(g->done[i]) != cudaSuccess) { /* still being read by an earlier copy */
    (void)cudaGetLastError();
    e = cudaEventSynchronize(g->done[i]);
  }
  if (e == cudaSuccess) {
    memcpy(g->slot[i], src, bytes);
    e = cudaMemcpyAsync(dst, g->slot[i], bytes, cudaMemcpyHostToDevice, 0);
  }
  if (e == cudaSuccess) e = cudaEventRecord(g->done[i], 0);
  if (e == cudaSuccess) g->used[i] = true;
  pthread_mutex_unlock(&stage_mu);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    nvl_error(NVL_EDEVICE, "nvl_cuda_memcpy: a staged host->device copy of %zu bytes on cuda:%d failed: %s (%s)",
              bytes, dev, cudaGetErrorString(e), cudaGetErrorName(e));
    return -1;
  }
  return 1;
}

extern "C" nvl_status nvl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int dev) {
  static const cudaMemcpyKind kinds[3] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                          cudaMemcpyDeviceToDevice};
  static const char *const names[3] = {"host->device", "device->host", "device->device"};
  if (kind < 0 || kind > 2)
    return nvl_error(NVL_EINVAL, "%s: kind must be 0 (host->device), 1 (device->host) or "
                     "2 (device->device), got %d", __func__, kind);
  if (bytes == 0) return NVL_OK;
  if (dst == NULL || src == NULL)
    return nvl_error(NVL_EINVAL, "%s: NULL %s for a %zu-byte %s copy", __func__,
                     dst == NULL ? "dst" : "src", bytes, names[kind]);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  cudaError_t e = cudaSuccess;
  if (kind == 2) {
    e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
    if (e == cudaSuccess && sync_on()) e = cudaStreamSynchronize(0);
  } else if (kind == 0 && !sync_on() && bytes <= STAGE_SLOT_BYTES) {
    const int r = staged_upload(dst, src, bytes, dev);
    if (r < 0) return NVL_EDEVICE;
    if (r == 0) {
      e = cudaMemcpy(dst, src, bytes, kinds[kind]);
      if (e == cudaSuccess) e = cudaStreamSynchronize(0);
    }
  } else {
    e = cudaMemcpy(dst, src, bytes, kinds[kind]);
    /* host->device from pageable memory may return before the copy is done: wait, so the copy
     * is complete and its errors belong to this call. */
    if (e == cudaSuccess && kind == 0) e = cudaStreamSynchronize(0);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nvl_error(NVL_EDEVICE, "cudaMemcpy(%zu bytes, %s) on cuda:%d failed: %s (%s)", bytes,
                     names[kind], dev, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}

extern "C" nvl_status nvl_cuda_memset(void *p, int v, size_t bytes, int dev) {
  if (bytes == 0) return NVL_OK;
  if (p == NULL) return nvl_error(NVL_EINVAL, "%s: NULL pointer for %zu bytes", __func__, bytes);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  NVL_CUDA_CHECK(cudaMemsetAsync(p, v, bytes, 0));
  return NVL_OK;
}

/* ---- elementwise binary f32 --------------------------------------------------------------- */

template <int OP>
__device__ __forceinline__ float binary_f32(float a, float b) {
  if (OP == NVL_OP_ADD) return f_add(a, b);
  if (OP == NVL_OP_SUB) return f_sub(a, b);
  if (OP == NVL_OP_MUL) return f_mul(a, b);
  return f_div(a, b);
}

/* out[i] = a[i] op b[i], i in [0, n). VEC: out, a, b are 16-byte aligned; the first n/4*4
 * elements go as float4, the tail (< 4) as scalars. Grid-stride loops, so any grid covers n. */
template <int OP, bool VEC>
__global__ void binary_f32_kernel(float *__restrict__ out, const float *__restrict__ a,
                                  const float *__restrict__ b, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (VEC) {
    const int64_t n4 = n / 4;
    const float4 *a4 = reinterpret_cast<const float4 *>(a);
    const float4 *b4 = reinterpret_cast<const float4 *>(b);
    float4 *o4 = reinterpret_cast<float4 *>(out);
    for (int64_t i = tid; i < n4; i += stride) {
      float4 x = a4[i], y = b4[i], r;
      r.x = binary_f32<OP>(x.x, y.x);
      r.y = binary_f32<OP>(x.y, y.y);
      r.z = binary_f32<OP>(x.z, y.z);
      r.w = binary_f32<OP>(x.w, y.w);
      o4[i] = r;
    }
    start = n4 * 4;
  }
  for (int64_t i = start + tid; i < n; i += stride) out[i] = binary_f32<OP>(a[i], b[i]);
}

template <int OP>
static void launch_binary_f32(bool vec, int blocks, int threads, float *out, const float *a,
                              const float *b, int64_t n) {
  if (vec) NVL_LAUNCH(blocks, threads, 0, 0, binary_f32_kernel<OP, true>)(out, a, b, n);
  else NVL_LAUNCH(blocks, threads, 0, 0, binary_f32_kernel<OP, false>)(out, a, b, n);
}

/* out[i] = bf16(a[i] + b[i]) (SUB: a[i] - b[i]) over bf16 bits: the f32 sum of two bf16 values
 * rounded once to bf16, which is their exact sum rounded once (kernels/cpu/ops_cpu.c add_bf16_block
 * has the argument), the CPU's bits. VEC: 16-byte aligned, 8 elements per load. */
template <bool SUB, bool VEC>
__global__ void add_bf16_kernel(uint16_t *__restrict__ out, const uint16_t *__restrict__ a,
                                const uint16_t *__restrict__ b, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t start = 0;
  if (VEC) {
    const int64_t n8 = n / 8;
    const uint4 *a8 = reinterpret_cast<const uint4 *>(a);
    const uint4 *b8 = reinterpret_cast<const uint4 *>(b);
    uint4 *o8 = reinterpret_cast<uint4 *>(out);
    for (int64_t i = tid; i < n8; i += stride) {
      const uint4 x = a8[i], y = b8[i];
      const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
      uint32_t r[4];
      for (int j = 0; j < 4; j++) {
        uint32_t w = 0;
        for (int h = 0; h < 2; h++) {
          const float u = bf16_bits_to_f32((uint16_t)(xs[j] >> (16 * h)));
          const float v = bf16_bits_to_f32((uint16_t)(ys[j] >> (16 * h)));
          w |= (uint32_t)f32_to_bf16_bits(SUB ? f_sub(u, v) : f_add(u, v)) << (16 * h);
        }
        r[j] = w;
      }
      o8[i] = make_uint4(r[0], r[1], r[2], r[3]);
    }
    start = n8 * 8;
  }
  for (int64_t i = start + tid; i < n; i += stride) {
    const float u = bf16_bits_to_f32(a[i]), v = bf16_bits_to_f32(b[i]);
    out[i] = f32_to_bf16_bits(SUB ? f_sub(u, v) : f_add(u, v));
  }
}

extern "C" nvl_status nvl_cuda_add_bf16(int sub, uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n,
                                        int dev) {
  if (n < 0) return nvl_error(NVL_EINVAL, "%s: negative length %lld", __func__, (long long)n);
  if (n == 0) return NVL_OK;
  if (out == NULL || a == NULL || b == NULL) return nvl_error(NVL_EINVAL, "%s: NULL pointer", __func__);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const bool vec = (((uintptr_t)out | (uintptr_t)a | (uintptr_t)b) & 15) == 0;
  const int threads = 256;
  const int blocks = nvl_cuda_grid(vec ? (n + 7) / 8 : n, threads, dev);
  (void)cudaGetLastError();
  if (sub) {
    if (vec) NVL_LAUNCH(blocks, threads, 0, 0, add_bf16_kernel<true, true>)(out, a, b, n);
    else NVL_LAUNCH(blocks, threads, 0, 0, add_bf16_kernel<true, false>)(out, a, b, n);
  } else {
    if (vec) NVL_LAUNCH(blocks, threads, 0, 0, add_bf16_kernel<false, true>)(out, a, b, n);
    else NVL_LAUNCH(blocks, threads, 0, 0, add_bf16_kernel<false, false>)(out, a, b, n);
  }
  char what[120];
  snprintf(what, sizeof what, "add_bf16_kernel<%s> (n=%lld)", sub ? "sub" : "add", (long long)n);
  return nvl_cuda_check_launch(dev, __func__, what);
}

extern "C" nvl_status nvl_cuda_binary_f32(int op, float *out, const float *a, const float *b,
                                          int64_t n, int dev) {
  static const char *const names[4] = {"add", "sub", "mul", "div"};
  if (op < NVL_OP_ADD || op > NVL_OP_DIV)
    return nvl_error(NVL_EUNSUPPORTED, "%s: op %d is not one of add, sub, mul, div", __func__, op);
  if (n < 0) return nvl_error(NVL_EINVAL, "%s: negative length %lld", __func__, (long long)n);
  if (n == 0) return NVL_OK;
  if (out == NULL || a == NULL || b == NULL)
    return nvl_error(NVL_EINVAL, "%s: NULL pointer for %s of %lld elements", __func__, names[op],
                     (long long)n);
  NVL_TRY(nvl_cuda_use_device(dev, __func__));

  const bool vec = (((uintptr_t)out | (uintptr_t)a | (uintptr_t)b) & 15) == 0;
  const int threads = 256;
  const int64_t work = vec ? (n + 3) / 4 : n; /* items per thread-slot: float4s (+ tail) */
  const int blocks = nvl_cuda_grid(work, threads, dev);

  (void)cudaGetLastError(); /* launch errors below must be this launch's own */
  switch (op) {
    case NVL_OP_ADD: launch_binary_f32<NVL_OP_ADD>(vec, blocks, threads, out, a, b, n); break;
    case NVL_OP_SUB: launch_binary_f32<NVL_OP_SUB>(vec, blocks, threads, out, a, b, n); break;
    case NVL_OP_MUL: launch_binary_f32<NVL_OP_MUL>(vec, blocks, threads, out, a, b, n); break;
    default: launch_binary_f32<NVL_OP_DIV>(vec, blocks, threads, out, a, b, n); break;
  }
  char what[160];
  snprintf(what, sizeof what, "binary_f32_kernel<%s> (n=%lld, %d blocks x %d)", names[op],
           (long long)n, blocks, threads);
  return nvl_cuda_check_launch(dev, __func__, what);
}
