/* ops.cu: the plain tensor ops the layer library and the training loop run on device tensors
 * (kernels/cuda/cuda.h "tensor ops", behind the adapters of backend_cuda.c): strided copies with the f32 <-> bf16 casts, fill, in-place
 * y += alpha x and x *= s, and max |x|. Each computes exactly what its CPU twin computes (core/
 * ops.c, kernels/cpu/ops_cpu.c): the same fp32 operations in the same order, pinned with
 * common.cuh's f_* so nvcc fuses nothing, so device results are bit-identical to the CPU's.
 *
 * Not here: validation and allocation (core/ops.c, core/tensor.c), broadcasting (the caller
 * passes expanded strides; a stride of 0 repeats an element), casts other than f32 <-> bf16. */
#include <stdio.h>

#include "common.cuh"
#include "dtype.h"

static const int kThreads = 256;

/* ---- strided copy ------------------------------------------------------------------------- */

typedef struct {
  int ndim;
  int64_t shape[NVL_MAX_DIMS];
  int64_t dst_strides[NVL_MAX_DIMS], src_strides[NVL_MAX_DIMS]; /* in elements */
} strided_desc;

/* Element offsets of linear index i (row-major over shape) in dst and src. */
__device__ __forceinline__ void offsets(const strided_desc &d, int64_t i, int64_t *od, int64_t *os) {
  int64_t a = 0, b = 0;
  for (int k = d.ndim - 1; k >= 0; k--) {
    const int64_t c = i % d.shape[k];
    i /= d.shape[k];
    a += c * d.dst_strides[k];
    b += c * d.src_strides[k];
  }
  *od = a;
  *os = b;
}

template <typename D, typename S>
__device__ __forceinline__ D convert(S v) { return (D)v; }
template <>
__device__ __forceinline__ uint16_t convert<uint16_t, float>(float v) { return f32_to_bf16_bits(v); }
template <>
__device__ __forceinline__ float convert<float, uint16_t>(uint16_t v) { return bf16_bits_to_f32(v); }

template <typename D, typename S>
__global__ void copy_strided_kernel(D *__restrict__ dst, const S *__restrict__ src, strided_desc d, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    int64_t od, os;
    offsets(d, i, &od, &os);
    dst[od] = convert<D, S>(src[os]);
  }
}

template <typename D, typename S>
static void launch_copy(void *dst, const void *src, const strided_desc &d, int64_t n, int blocks) {
  NVL_LAUNCH(blocks, kThreads, 0, 0, copy_strided_kernel<D, S>)((D *)dst, (const S *)src, d, n);
}

/* A strided copy whose destination's contiguous dim a is not its source's contiguous dim b (a
 * transpose, or a permutation moving the last dim): 32x32 tiles of the (a, b) planes through shared
 * memory, so both the reads (along b) and the writes (along a) are coalesced; the other dims are a
 * batch, one CTA per tile of each plane. copy_strided_kernel would read (or write) with a stride. */
typedef struct {
  int nbd; /* batch dims */
  int64_t bshape[NVL_MAX_DIMS], bdst[NVL_MAX_DIMS], bsrc[NVL_MAX_DIMS];
  int64_t na, nb;       /* the extents of a and b */
  int64_t dst_b, src_a; /* dst's stride of b, src's of a (dst's of a and src's of b are 1) */
  int64_t ta, tb;       /* tiles along a and b */
} transpose_desc;

template <typename D, typename S>
__global__ void __launch_bounds__(256) transpose_kernel(D *__restrict__ dst, const S *__restrict__ src,
                                                        transpose_desc d) {
  NVL_SHARED(S, tile, [32][33]);
  const int64_t per = d.ta * d.tb;
  int64_t bi = (int64_t)blockIdx.x / per;
  const int64_t ti = (int64_t)blockIdx.x - bi * per, a0 = (ti / d.tb) * 32, b0 = (ti % d.tb) * 32;
  int64_t od = 0, os = 0;
  for (int k = d.nbd - 1; k >= 0; k--) {
    const int64_t c = bi % d.bshape[k];
    bi /= d.bshape[k];
    od += c * d.bdst[k];
    os += c * d.bsrc[k];
  }
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (int j = ty; j < 32; j += 8) { /* a warp reads 32 consecutive elements of b */
    const int64_t ia = a0 + j, ib = b0 + tx;
    if (ia < d.na && ib < d.nb) tile[j][tx] = src[os + ia * d.src_a + ib];
  }
  __syncthreads();
  for (int j = ty; j < 32; j += 8) { /* and writes 32 consecutive elements of a */
    const int64_t ib = b0 + j, ia = a0 + tx;
    if (ia < d.na && ib < d.nb) dst[od + ib * d.dst_b + ia] = convert<D, S>(tile[tx][j]);
  }
}

/* The tiled plan of a copy, or false where it does not apply (both contiguous along one dim). */
static bool transpose_plan(const strided_desc &d, transpose_desc *t) {
  int a = -1, b = -1;
  for (int k = 0; k < d.ndim; k++) {
    if (d.shape[k] == 1) continue;
    if (d.dst_strides[k] == 1) a = k;
    if (d.src_strides[k] == 1) b = k;
  }
  if (a < 0 || b < 0 || a == b) return false;
  memset(t, 0, sizeof *t);
  int64_t batch = 1;
  for (int k = 0; k < d.ndim; k++) {
    if (k == a || k == b || d.shape[k] == 1) continue;
    t->bshape[t->nbd] = d.shape[k];
    t->bdst[t->nbd] = d.dst_strides[k];
    t->bsrc[t->nbd] = d.src_strides[k];
    t->nbd++;
    batch *= d.shape[k];
  }
  t->na = d.shape[a];
  t->nb = d.shape[b];
  t->dst_b = d.dst_strides[b];
  t->src_a = d.src_strides[a];
  t->ta = (t->na + 31) / 32;
  t->tb = (t->nb + 31) / 32;
  return batch * t->ta * t->tb < ((int64_t)1 << 31);
}

template <typename D, typename S>
static void launch_copy_or_transpose(void *dst, const void *src, const strided_desc &d, int64_t n, int blocks,
                                     bool *tiled) {
  transpose_desc t;
  *tiled = transpose_plan(d, &t);
  if (*tiled) {
    int64_t batch = 1;
    for (int k = 0; k < t.nbd; k++) batch *= t.bshape[k];
    NVL_LAUNCH((unsigned)(batch * t.ta * t.tb), kThreads, 0, 0, transpose_kernel<D, S>)((D *)dst, (const S *)src, t);
  } else {
    launch_copy<D, S>(dst, src, d, n, blocks);
  }
}

/* dst[i] = src[i] converted: a cast between two dense row-major tensors, no index arithmetic. */
template <typename D, typename S>
__global__ void cast_dense_kernel(D *__restrict__ dst, const S *__restrict__ src, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = convert<D, S>(src[i]);
}

/* Whether strides (elements) are the dense row-major ones of shape (dims of length 1 skipped). */
static bool dense_strides(const int64_t *strides, const int64_t *shape, int ndim) {
  int64_t want = 1;
  for (int k = ndim - 1; k >= 0; k--) {
    if (shape[k] == 1) continue;
    if (strides[k] != want) return false;
    want *= shape[k];
  }
  return true;
}

extern "C" nvl_status nvl_cuda_copy_strided(void *dst, int dst_dtype, const int64_t *dst_strides, const void *src,
                                            int src_dtype, const int64_t *src_strides, int ndim,
                                            const int64_t *shape, int dev) {
  if (ndim < 0 || ndim > NVL_MAX_DIMS) return nvl_error(NVL_EINVAL, "%s: %d dims", __func__, ndim);
  strided_desc d;
  memset(&d, 0, sizeof d);
  d.ndim = ndim;
  int64_t n = 1;
  for (int k = 0; k < ndim; k++) {
    d.shape[k] = shape[k];
    d.dst_strides[k] = dst_strides[k];
    d.src_strides[k] = src_strides[k];
    n *= shape[k];
  }
  if (n == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const int blocks = nvl_cuda_grid(n, kThreads, dev);
  (void)cudaGetLastError();
  const bool dense = dense_strides(dst_strides, shape, ndim) && dense_strides(src_strides, shape, ndim);
  if (dense && dst_dtype == src_dtype) {
    /* a dense copy is the copy engine's (or the driver's copy kernel's) work at full bandwidth, in
     * stream order on the legacy default stream, no host synchronisation (device to device) */
    const size_t bytes = (size_t)n * (size_t)nvl_dtypes[dst_dtype].elem_size;
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return nvl_error(NVL_EDEVICE, "%s: cudaMemcpyAsync(%zu bytes, device to device) on cuda:%d failed: %s (%s)",
                       __func__, bytes, dev, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    return NVL_OK;
  }
  if (dense && dst_dtype == NVL_BF16 && src_dtype == NVL_F32) {
    NVL_LAUNCH(blocks, kThreads, 0, 0, cast_dense_kernel<uint16_t, float>)((uint16_t *)dst, (const float *)src, n);
    return nvl_cuda_check_launch(dev, __func__, "cast_dense_kernel<bf16 <- f32>");
  }
  if (dense && dst_dtype == NVL_F32 && src_dtype == NVL_BF16) {
    NVL_LAUNCH(blocks, kThreads, 0, 0, cast_dense_kernel<float, uint16_t>)((float *)dst, (const uint16_t *)src, n);
    return nvl_cuda_check_launch(dev, __func__, "cast_dense_kernel<f32 <- bf16>");
  }
  bool tiled = false;
  if (dst_dtype == src_dtype) {
    switch (nvl_dtypes[dst_dtype].elem_size) {
      case 1: launch_copy_or_transpose<uint8_t, uint8_t>(dst, src, d, n, blocks, &tiled); break;
      case 2: launch_copy_or_transpose<uint16_t, uint16_t>(dst, src, d, n, blocks, &tiled); break;
      case 4: launch_copy_or_transpose<uint32_t, uint32_t>(dst, src, d, n, blocks, &tiled); break;
      case 8: launch_copy_or_transpose<uint64_t, uint64_t>(dst, src, d, n, blocks, &tiled); break;
      default:
        return nvl_error(NVL_EUNSUPPORTED, "%s: no device copy for %s elements", __func__,
                         nvl_dtypes[dst_dtype].name);
    }
  } else if (dst_dtype == NVL_BF16 && src_dtype == NVL_F32) {
    launch_copy_or_transpose<uint16_t, float>(dst, src, d, n, blocks, &tiled);
  } else if (dst_dtype == NVL_F32 && src_dtype == NVL_BF16) {
    launch_copy_or_transpose<float, uint16_t>(dst, src, d, n, blocks, &tiled);
  } else {
    return nvl_error(NVL_EUNSUPPORTED, "copy: %s -> %s is not supported on cuda (only f32 <-> bf16 casts); cast on the cpu",
                     nvl_dtypes[src_dtype].name, nvl_dtypes[dst_dtype].name);
  }
  char what[160];
  snprintf(what, sizeof what, "%s<%s <- %s> (n=%lld, %d dims)", tiled ? "transpose_kernel" : "copy_strided_kernel",
           nvl_dtypes[dst_dtype].name, nvl_dtypes[src_dtype].name, (long long)n, ndim);
  return nvl_cuda_check_launch(dev, __func__, what);
}

/* ---- fill --------------------------------------------------------------------------------- */

template <typename T>
__global__ void fill_kernel(T *__restrict__ p, T v, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = v;
}

extern "C" nvl_status nvl_cuda_fill(void *p, int dtype, const void *value, int64_t n, int dev) {
  if (n <= 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const int blocks = nvl_cuda_grid(n, kThreads, dev);
  (void)cudaGetLastError();
  switch (nvl_dtypes[dtype].elem_size) { /* value: one element's bytes, stored as the CPU stores it */
    case 1: NVL_LAUNCH(blocks, kThreads, 0, 0, fill_kernel<uint8_t>)((uint8_t *)p, *(const uint8_t *)value, n); break;
    case 2:
      NVL_LAUNCH(blocks, kThreads, 0, 0, fill_kernel<uint16_t>)((uint16_t *)p, *(const uint16_t *)value, n);
      break;
    case 4:
      NVL_LAUNCH(blocks, kThreads, 0, 0, fill_kernel<uint32_t>)((uint32_t *)p, *(const uint32_t *)value, n);
      break;
    case 8:
      NVL_LAUNCH(blocks, kThreads, 0, 0, fill_kernel<uint64_t>)((uint64_t *)p, *(const uint64_t *)value, n);
      break;
    default: return nvl_error(NVL_EUNSUPPORTED, "%s: no device fill for %s", __func__, nvl_dtypes[dtype].name);
  }
  char what[96];
  snprintf(what, sizeof what, "fill_kernel<%s> (n=%lld)", nvl_dtypes[dtype].name, (long long)n);
  return nvl_cuda_check_launch(dev, __func__, what);
}

/* ---- y += alpha x, x *= s ------------------------------------------------------------------ */

/* nvl_axpy_f32_cpu: alpha == 1 adds x; else p = alpha * x rounded, then y + p. */
__global__ void axpy_kernel(float *__restrict__ y, const float *__restrict__ x, float alpha, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = alpha == 1.0f ? f_add(y[i], x[i]) : f_add(y[i], f_mul(alpha, x[i]));
}

extern "C" nvl_status nvl_cuda_axpy_f32(float *y, const float *x, float alpha, int64_t n, int dev) {
  if (n <= 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const int blocks = nvl_cuda_grid(n, kThreads, dev);
  (void)cudaGetLastError();
  NVL_LAUNCH(blocks, kThreads, 0, 0, axpy_kernel)(y, x, alpha, n);
  char what[64];
  snprintf(what, sizeof what, "axpy_kernel (n=%lld)", (long long)n);
  return nvl_cuda_check_launch(dev, __func__, what);
}

/* nvl_binary_scalar_f32_cpu's MUL: s exact in f32 -> one f32 multiply; else the double product
 * rounded once to f32. */
__global__ void scale_kernel(float *__restrict__ p, double s, int exact, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const float sf = (float)s;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = exact ? f_mul(p[i], sf) : __double2float_rn(__dmul_rn((double)p[i], s));
}

extern "C" nvl_status nvl_cuda_scale_f32(float *p, double s, int64_t n, int dev) {
  if (n <= 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const int blocks = nvl_cuda_grid(n, kThreads, dev);
  (void)cudaGetLastError();
  NVL_LAUNCH(blocks, kThreads, 0, 0, scale_kernel)(p, s, (double)(float)s == s, n);
  char what[64];
  snprintf(what, sizeof what, "scale_kernel (n=%lld)", (long long)n);
  return nvl_cuda_check_launch(dev, __func__, what);
}

/* ---- max |x| ------------------------------------------------------------------------------- */

/* The max of |x|'s bits over n f32 or bf16 elements into *out (an unsigned max: non-negative
 * floats order as their bits, NaN bits above +inf), as nvl_reduce_f32_cpu's AMAX. */
template <typename T>
__global__ void amax_bits_kernel(unsigned int *__restrict__ out, const T *__restrict__ x, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  unsigned int m = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v;
    if (sizeof(T) == 2) v = bf16_bits_to_f32((uint16_t)x[i]);
    else v = u2f((uint32_t)x[i]);
    const unsigned int b = f2u(v) & 0x7fffffffu;
    m = b > m ? b : m;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned int t = __shfl_xor_sync(0xffffffffu, m, o);
    m = t > m ? t : m;
  }
  if ((threadIdx.x & 31) == 0) atomicMax(out, m);
}

extern "C" nvl_status nvl_cuda_amax(nvl_kctx *ctx, double *out, const void *x, int x_bf16, int64_t n) {
  const int dev = ctx->dev;
  *out = 0.0;
  if (n <= 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  unsigned int *word = NULL;
  NVL_TRY(ctx->scratch(ctx, sizeof *word, (void **)&word));
  NVL_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof *word, 0));
  const int blocks = nvl_cuda_grid(n, kThreads, dev);
  (void)cudaGetLastError();
  if (x_bf16) NVL_LAUNCH(blocks, kThreads, 0, 0, amax_bits_kernel<uint16_t>)(word, (const uint16_t *)x, n);
  else NVL_LAUNCH(blocks, kThreads, 0, 0, amax_bits_kernel<uint32_t>)(word, (const uint32_t *)x, n);
  char what[64];
  snprintf(what, sizeof what, "amax_bits_kernel (n=%lld)", (long long)n);
  NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  unsigned int bits = 0;
  NVL_CUDA_CHECK(cudaMemcpy(&bits, word, sizeof bits, cudaMemcpyDeviceToHost));
  *out = bits > 0x7f800000u ? (double)NAN : (double)u2f(bits);
  return NVL_OK;
}
