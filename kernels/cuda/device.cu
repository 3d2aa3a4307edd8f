/* device.cu: the CUDA backend's device layer — device discovery, properties, versions, memory
 * (malloc/free/synchronous memcpy) and the elementwise f32 binary kernel (add/sub/mul/div).
 * Implements core/cuda.h with C linkage; kernels/cuda/stub.c is its stand-in without nvcc.
 * Every CUDA call's failure becomes an nvl_status with a message naming the call and the device;
 * nothing here prints, exits or aborts. With no driver or no GPU, nvl_cuda_device_count() is 0
 * and nvl_cuda_unavailable_reason() says why (cudart is linked statically, so nvlua starts on
 * machines without a driver).
 * Not here: streams, events, memory pools, cuBLASLt GEMMs, quantization kernels. Everything runs
 * on the legacy default stream and each call synchronises before returning, so an asynchronous
 * error surfaces in the call that caused it.
 * Numerics: the binary kernel is exact IEEE-754 fp32 (round to nearest even, subnormals kept),
 * bit-identical to the CPU's `a op b` on floats whatever nvcc's -ftz/-prec-div/--use_fast_math
 * flags say (the ops are written as non-.ftz PTX). Only NaN payloads may differ: the GPU returns
 * the canonical NaN. */
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <pthread.h>
#include <stdio.h>

#include "nvl_cuda.h"
#include "ops.h"

/* Evaluate a CUDA runtime call; on failure clear the (non-sticky) error so a later
 * cudaGetLastError does not report it again, and return NVL_EDEVICE naming the call. */
#define NVL_CUDA_CHECK(call)                                                          \
  do {                                                                                \
    cudaError_t nvl_ce_ = (call);                                                     \
    if (nvl_ce_ != cudaSuccess) {                                                     \
      (void)cudaGetLastError();                                                       \
      return nvl_error(NVL_EDEVICE, "%s: %s failed: %s (%s)", __func__, #call,        \
                       cudaGetErrorString(nvl_ce_), cudaGetErrorName(nvl_ce_));       \
    }                                                                                 \
  } while (0)

/* ---- discovery ---------------------------------------------------------------------------- */

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static int probe_count;        /* usable devices, 0 on any failure */
static char probe_reason[256]; /* "" when probe_count > 0 */

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
    probe_count = n;
  }
}

extern "C" int nvl_cuda_compiled(void) { return 1; }

extern "C" int nvl_cuda_device_count(void) {
  pthread_once(&probe_once, probe);
  return probe_count;
}

extern "C" const char *nvl_cuda_unavailable_reason(void) {
  pthread_once(&probe_once, probe);
  return probe_reason;
}

/* Check dev is a usable ordinal and make it current; fn names the public caller. */
static nvl_status use_device(int dev, const char *fn) {
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

extern "C" nvl_status nvl_cuda_device_props(int dev, nvl_cuda_props *p) {
  NVL_TRY(use_device(dev, __func__));
  cudaDeviceProp prop;
  NVL_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  snprintf(p->name, sizeof p->name, "%s", prop.name);
  p->total_mem = prop.totalGlobalMem;
  p->major = prop.major;
  p->minor = prop.minor;
  p->multiprocessors = prop.multiProcessorCount;
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

/* ---- memory ------------------------------------------------------------------------------- */

/* bytes == 0 gives *p = NULL and NVL_OK (cudaMalloc's own behaviour). */
extern "C" nvl_status nvl_cuda_malloc(void **p, size_t bytes, int dev) {
  *p = NULL;
  NVL_TRY(use_device(dev, __func__));
  cudaError_t e = cudaMalloc(p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *p = NULL;
    return nvl_error(e == cudaErrorMemoryAllocation ? NVL_ENOMEM : NVL_EDEVICE,
                     "cudaMalloc(%zu bytes) on cuda:%d failed: %s (%s)", bytes, dev,
                     cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}

/* Errors are dropped (a free has no way to report them; a sticky error shows up in the next
 * call that can). */
extern "C" void nvl_cuda_free(void *p, int dev) {
  if (p == NULL) return;
  if (dev >= 0 && dev < nvl_cuda_device_count() && cudaSetDevice(dev) == cudaSuccess)
    (void)cudaFree(p);
  (void)cudaGetLastError();
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
  NVL_TRY(use_device(dev, __func__));
  cudaError_t e = cudaMemcpy(dst, src, bytes, kinds[kind]);
  /* host->device from pageable memory and device->device may return before the copy is done:
   * wait, so the copy is complete and its errors belong to this call. */
  if (e == cudaSuccess && kind != 1) e = cudaStreamSynchronize(0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nvl_error(NVL_EDEVICE, "cudaMemcpy(%zu bytes, %s) on cuda:%d failed: %s (%s)", bytes,
                     names[kind], dev, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}

/* ---- elementwise binary f32 --------------------------------------------------------------- */

/* IEEE fp32 ops, round to nearest even, no flush-to-zero, never contracted into an fma: the
 * non-.ftz PTX instructions pin this regardless of compiler flags. */
template <int OP>
__device__ __forceinline__ float binary_f32(float a, float b) {
  float r;
  if (OP == NVL_OP_ADD) asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  else if (OP == NVL_OP_SUB) asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  else if (OP == NVL_OP_MUL) asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  else asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
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
  if (vec) binary_f32_kernel<OP, true><<<blocks, threads>>>(out, a, b, n);
  else binary_f32_kernel<OP, false><<<blocks, threads>>>(out, a, b, n);
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
  NVL_TRY(use_device(dev, __func__));

  int sms = 0;
  NVL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const bool vec = (((uintptr_t)out | (uintptr_t)a | (uintptr_t)b) & 15) == 0;
  const int threads = 256;
  const int64_t work = vec ? (n + 3) / 4 : n; /* items per thread-slot: float4s (+ tail) */
  int64_t blocks = (work + threads - 1) / threads;
  const int64_t max_blocks = (int64_t)(sms > 0 ? sms : 1) * 8; /* grid-stride covers the rest */
  if (blocks > max_blocks) blocks = max_blocks;

  (void)cudaGetLastError(); /* launch errors below must be this launch's own */
  switch (op) {
    case NVL_OP_ADD: launch_binary_f32<NVL_OP_ADD>(vec, (int)blocks, threads, out, a, b, n); break;
    case NVL_OP_SUB: launch_binary_f32<NVL_OP_SUB>(vec, (int)blocks, threads, out, a, b, n); break;
    case NVL_OP_MUL: launch_binary_f32<NVL_OP_MUL>(vec, (int)blocks, threads, out, a, b, n); break;
    default: launch_binary_f32<NVL_OP_DIV>(vec, (int)blocks, threads, out, a, b, n); break;
  }
  cudaError_t e = cudaGetLastError();
  const char *what = "launch of";
  if (e == cudaSuccess) {
    e = cudaStreamSynchronize(0);
    what = "cudaStreamSynchronize after";
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return nvl_error(NVL_EDEVICE, "%s: %s binary_f32_kernel<%s> (n=%lld, %lld blocks x %d) on "
                     "cuda:%d failed: %s (%s)", __func__, what, names[op], (long long)n,
                     (long long)blocks, threads, dev, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return NVL_OK;
}
