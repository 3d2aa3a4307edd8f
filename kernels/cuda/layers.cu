/* layers.cu: the layer library's kernels on the device (entries of the CUDA table): embedding,
 * RMSNorm, RoPE, SwiGLU forward and backward, the fused softmax cross-entropy, AdamW and the
 * sum of squares. Each is the twin of a reference in kernels/cpu/ref/layers_ref.c and is tested
 * against it within fp32 tolerance (tests/test_cuda_layers.lua); only AdamW is bit-exact (same
 * f32 operations in the same order, pinned with common.cuh's f_* so nothing is fused).
 *
 * Contract (core/layers.h): parameter gradients ACCUMULATE (+=: embedding and RMSNorm dweight),
 * activation gradients and outputs are WRITTEN (=). All pointers are device memory, contiguous,
 * f32 unless said; the caller (core/layers.c) has validated shapes and index ranges. Shapes:
 * N tokens, C width, V vocabulary, B batch, T sequence, H heads, D head dim.
 *
 * Reductions that feed a host value (cross-entropy loss, sumsq) write one partial per row or per
 * block into call scratch and one block adds them in a fixed order, so results are deterministic
 * run to run. The dweight reductions use atomicAdd (fp32: order may vary in the last bits).
 *
 * Not here: validation and allocation (core/layers.c), attention (attention.cu), bf16
 * activations (the layer contract is f32; the cross-entropy and sumsq also read bf16). */
#include <math.h>
#include <stdio.h>

#include "common.cuh"
#include "cpu/ref/layers_ref.h"

static const int kThreads = 256;

/* Sum over the block of v (float or double); every thread gets the total. blockDim.x is a
 * multiple of 32, at most 1024. */
template <typename F>
__device__ F block_sum(F v) {
  NVL_SHARED(F, part, [32]);
  NVL_SHARED(F, total, );
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    F s = lane < nw ? part[lane] : (F)0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) total = s;
  }
  __syncthreads();
  F r = total;
  __syncthreads(); /* part/total may be reused by a following call */
  return r;
}

/* (m, s) online-softmax pair merge: s is sum exp(x - m). */
__device__ __forceinline__ void ms_merge(float &m, float &s, float m2, float s2) {
  float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return; /* both empty */
  s = s * expf(m - mn) + s2 * expf(m2 - mn);
  m = mn;
}

__device__ __forceinline__ float load_f(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const uint16_t *p, int64_t i) { return bf16_bits_to_f32(p[i]); }

static nvl_status launched(int dev, const char *fn, const char *kernel, int64_t a, int64_t b) {
  char what[160];
  snprintf(what, sizeof what, "%s (%lld x %lld)", kernel, (long long)a, (long long)b);
  return nvl_cuda_check_launch(dev, fn, what);
}

/* ---- embedding -------------------------------------------------------------------------------- */

/* out (N, C) = weight[ids[n], :]. */
__global__ void embedding_fwd_kernel(float *__restrict__ out, const int64_t *__restrict__ ids,
                                     const float *__restrict__ weight, int64_t N, int64_t C) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    int64_t n = i / C, c = i - n * C;
    out[i] = weight[ids[n] * C + c];
  }
}

/* dweight (V, C) += dout (N, C) scattered by ids (atomics: repeated ids collide). */
__global__ void embedding_bwd_kernel(float *__restrict__ dweight, const float *__restrict__ dout,
                                     const int64_t *__restrict__ ids, int64_t N, int64_t C) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    int64_t n = i / C, c = i - n * C;
    atomicAdd(&dweight[ids[n] * C + c], dout[i]);
  }
}

extern "C" nvl_status nvl_cuda_embedding_forward(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N,
                                                 int64_t C) {
  const int dev = ctx->dev;
  if (N * C == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(N * C, kThreads, dev), kThreads, 0, 0, embedding_fwd_kernel)(out, ids, weight, N, C);
  return launched(dev, __func__, "embedding_fwd_kernel", N, C);
}

extern "C" nvl_status nvl_cuda_embedding_backward(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                                  int64_t C) {
  const int dev = ctx->dev;
  if (N * C == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(N * C, kThreads, dev), kThreads, 0, 0, embedding_bwd_kernel)(dweight, dout, ids, N, C);
  return launched(dev, __func__, "embedding_bwd_kernel", N, C);
}

/* T float: f32 activations; T uint16_t: bf16 bits, widened on load and rounded once on store (RNE,
 * f32_to_bf16_bits), the f32 arithmetic in between unchanged: a bf16 launch is bit for bit the f32
 * kernel on the widened inputs, each output rounded once (NUMERICS §11), without widened copies. */
__device__ __forceinline__ float act_load(float v) { return v; }
__device__ __forceinline__ float act_load(uint16_t v) { return bf16_bits_to_f32(v); }
__device__ __forceinline__ void act_store(float *p, float v) { *p = v; }
__device__ __forceinline__ void act_store(uint16_t *p, float v) { *p = f32_to_bf16_bits(v); }

/* The value act_store writes for v, read back (bf16: v rounded; f32: v): what a later amax sees. */
__device__ __forceinline__ float stored(float v, float *) { return v; }
__device__ __forceinline__ float stored(float v, uint16_t *) { return bf16_bits_to_f32(f32_to_bf16_bits(v)); }

/* *amax (float bits) = max(*amax, the block's max of m): a warp shuffle fold, one atomic per warp.
 * Every thread of the block calls it (m = 0 for threads with nothing). */
__device__ __forceinline__ void warp_max_to(uint32_t m, uint32_t *amax) {
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((threadIdx.x & 31) == 0 && m) atomicMax(amax, m);
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

/* One block per row: rstd[n] = 1 / sqrt(mean(x^2) + eps) (sum in double, as the reference),
 * out = (x * rstd) * weight. */
template <typename T>
__global__ void rmsnorm_fwd_kernel(T *__restrict__ out, float *__restrict__ rstd, const T *__restrict__ x,
                                   const float *__restrict__ weight, int64_t N, int64_t C, double eps,
                                   uint32_t *amax) {
  uint32_t m = 0; /* amax: max |out| (the stored values, NaN ignored), when asked for */
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const T *xr = x + n * C;
    double ss = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += (double)act_load(xr[c]) * act_load(xr[c]);
    ss = block_sum(ss);
    float r = (float)(1.0 / sqrt(ss / (double)C + eps));
    if (threadIdx.x == 0) rstd[n] = r;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float y = f_mul(f_mul(act_load(xr[c]), r), weight[c]);
      act_store(&out[n * C + c], y);
      if (amax) m = max(m, abs_bits(stored(y, out)));
    }
  }
  if (amax) warp_max_to(m, amax);
}

/* One block per row: dx = r w g - x r^3 (sum g w x) / C. */
template <typename T>
__global__ void rmsnorm_bwd_dx_kernel(T *__restrict__ dx, const T *__restrict__ dout, const T *__restrict__ x,
                                      const float *__restrict__ weight, const float *__restrict__ rstd, int64_t N,
                                      int64_t C) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const T *g = dout + n * C, *xr = x + n * C;
    double dot = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      dot += (double)act_load(g[c]) * weight[c] * act_load(xr[c]);
    dot = block_sum(dot);
    double r = rstd[n], k = r * r * r * dot / (double)C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      act_store(&dx[n * C + c], (float)(r * weight[c] * act_load(g[c]) - (double)act_load(xr[c]) * k));
  }
}

/* dweight (C) += sum_n dout x rstd. Block (32, 8): 32 columns, each of the 8 rows of threads
 * walks a strided share of this block's row slab; then one atomicAdd per column and block. */
template <typename T>
__global__ void rmsnorm_bwd_dw_kernel(float *__restrict__ dweight, const T *__restrict__ dout, const T *__restrict__ x,
                                      const float *__restrict__ rstd, int64_t N, int64_t C, int64_t rows_per_block) {
  NVL_SHARED(float, part, [8][33]);
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  const int64_t n0 = (int64_t)blockIdx.y * rows_per_block;
  const int64_t n1 = n0 + rows_per_block < N ? n0 + rows_per_block : N;
  float acc = 0.0f;
  if (c < C)
    for (int64_t n = n0 + threadIdx.y; n < n1; n += 8)
      acc += act_load(dout[n * C + c]) * act_load(x[n * C + c]) * rstd[n];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += part[i][threadIdx.x];
    atomicAdd(&dweight[c], s);
  }
}

template <typename T>
static nvl_status rmsnorm_fwd(nvl_kctx *ctx, T *out, float *rstd, const T *x, const float *weight, int64_t N, int64_t C,
                              double eps, const char *fn, float *amax = NULL) {
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  if (amax) NVL_TRY(nvl_cuda_memset(amax, 0, sizeof(float), dev));
  if (N == 0) return NVL_OK;
  int blocks = (int)(N < 65535 * 16 ? N : 65535 * 16);
  (void)cudaGetLastError();
  NVL_LAUNCH(blocks, kThreads, 0, 0, rmsnorm_fwd_kernel<T>)(out, rstd, x, weight, N, C, eps,
                                                            reinterpret_cast<uint32_t *>(amax));
  return launched(dev, fn, "rmsnorm_fwd_kernel", N, C);
}

template <typename T>
static nvl_status rmsnorm_bwd(nvl_kctx *ctx, T *dx, float *dweight, const T *dout, const T *x, const float *weight,
                              const float *rstd, int64_t N, int64_t C, const char *fn) {
  const int dev = ctx->dev;
  if (N == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  int blocks = (int)(N < 65535 * 16 ? N : 65535 * 16);
  (void)cudaGetLastError();
  NVL_LAUNCH(blocks, kThreads, 0, 0, rmsnorm_bwd_dx_kernel<T>)(dx, dout, x, weight, rstd, N, C);
  NVL_TRY(launched(dev, fn, "rmsnorm_bwd_dx_kernel", N, C));
  /* enough row slabs to fill the machine, each at least 64 rows */
  int64_t cb = (C + 31) / 32, want = (int64_t)nvl_cuda_sm_count(dev) * 8 / (cb > 0 ? cb : 1);
  int64_t slabs = want < 1 ? 1 : want, max_slabs = (N + 63) / 64;
  if (slabs > max_slabs) slabs = max_slabs;
  if (slabs > 65535) slabs = 65535;
  int64_t rpb = (N + slabs - 1) / slabs;
  dim3 grid((unsigned)cb, (unsigned)((N + rpb - 1) / rpb)), block(32, 8);
  NVL_LAUNCH(grid, block, 0, 0, rmsnorm_bwd_dw_kernel<T>)(dweight, dout, x, rstd, N, C, rpb);
  return launched(dev, fn, "rmsnorm_bwd_dw_kernel", N, C);
}

extern "C" nvl_status nvl_cuda_rmsnorm_forward(nvl_kctx *ctx, float *out, float *rstd, const float *x,
                                               const float *weight, int64_t N, int64_t C, double eps) {
  return rmsnorm_fwd(ctx, out, rstd, x, weight, N, C, eps, __func__);
}

extern "C" nvl_status nvl_cuda_rmsnorm_backward(nvl_kctx *ctx, float *dx, float *dweight, const float *dout,
                                                const float *x, const float *weight, const float *rstd, int64_t N,
                                                int64_t C) {
  return rmsnorm_bwd(ctx, dx, dweight, dout, x, weight, rstd, N, C, __func__);
}

extern "C" nvl_status nvl_cuda_rmsnorm_forward_bf16(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x,
                                                    const float *weight, int64_t N, int64_t C, double eps) {
  return rmsnorm_fwd(ctx, out, rstd, x, weight, N, C, eps, __func__);
}

extern "C" nvl_status nvl_cuda_rmsnorm_forward_bf16_amax(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x,
                                                         const float *weight, int64_t N, int64_t C, double eps,
                                                         float *amax) {
  return rmsnorm_fwd(ctx, out, rstd, x, weight, N, C, eps, __func__, amax);
}

extern "C" nvl_status nvl_cuda_rmsnorm_backward_bf16(nvl_kctx *ctx, uint16_t *dx, float *dweight,
                                                     const uint16_t *dout, const uint16_t *x, const float *weight,
                                                     const float *rstd, int64_t N, int64_t C) {
  return rmsnorm_bwd(ctx, dx, dweight, dout, x, weight, rstd, N, C, __func__);
}

/* ---- RoPE ------------------------------------------------------------------------------------- */

/* x, out (B, T, H, D); cos, sin (T, D). BWD: the transposed rotation. */
template <bool BWD, typename A>
__global__ void rope_kernel(A *__restrict__ out, const A *__restrict__ x, const float *__restrict__ cos_t,
                            const float *__restrict__ sin_t, int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t total = B * T * H * D, h = D / 2;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t j = i % D, t = (i / (H * D)) % T;
    const float *c = cos_t + t * D, *s = sin_t + t * D;
    double r;
    if (!BWD) r = j < h ? -(double)act_load(x[i + h]) * s[j] : (double)act_load(x[i - h]) * s[j];
    else r = j < h ? (double)act_load(x[i + h]) * s[j + h] : -(double)act_load(x[i - h]) * s[j - h];
    act_store(&out[i], (float)((double)act_load(x[i]) * c[j] + r));
  }
}

template <typename A>
static nvl_status rope_launch(bool bwd, A *out, const A *x, const float *c, const float *s, int64_t B, int64_t T,
                              int64_t H, int64_t D, int dev, const char *fn) {
  int64_t n = B * T * H * D;
  if (n == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  int blocks = nvl_cuda_grid(n, kThreads, dev);
  (void)cudaGetLastError();
  if (bwd) NVL_LAUNCH(blocks, kThreads, 0, 0, rope_kernel<true, A>)(out, x, c, s, B, T, H, D);
  else NVL_LAUNCH(blocks, kThreads, 0, 0, rope_kernel<false, A>)(out, x, c, s, B, T, H, D);
  return launched(dev, fn, bwd ? "rope_kernel<bwd>" : "rope_kernel<fwd>", B * T, H * D);
}

extern "C" nvl_status nvl_cuda_rope_forward(nvl_kctx *ctx, float *out, const float *x, const float *cos_t, const float *sin_t,
                                            int64_t B, int64_t T, int64_t H, int64_t D) {
  const int dev = ctx->dev;
  return rope_launch(false, out, x, cos_t, sin_t, B, T, H, D, dev, __func__);
}

extern "C" nvl_status nvl_cuda_rope_backward(nvl_kctx *ctx, float *dx, const float *dout, const float *cos_t, const float *sin_t,
                                             int64_t B, int64_t T, int64_t H, int64_t D) {
  const int dev = ctx->dev;
  return rope_launch(true, dx, dout, cos_t, sin_t, B, T, H, D, dev, __func__);
}

extern "C" nvl_status nvl_cuda_rope_forward_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *x, const float *cos_t,
                                                 const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t D) {
  return rope_launch(false, out, x, cos_t, sin_t, B, T, H, D, ctx->dev, __func__);
}

extern "C" nvl_status nvl_cuda_rope_backward_bf16(nvl_kctx *ctx, uint16_t *dx, const uint16_t *dout, const float *cos_t,
                                                  const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t D) {
  return rope_launch(true, dx, dout, cos_t, sin_t, B, T, H, D, ctx->dev, __func__);
}

/* ---- SwiGLU ----------------------------------------------------------------------------------- */

template <typename T>
__global__ void swiglu_fwd_kernel(T *__restrict__ out, const T *__restrict__ gate, const T *__restrict__ up,
                                  int64_t n, uint32_t *amax) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t m = 0; /* amax: max |out| (the stored values, NaN ignored), when asked for */
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float g = act_load(gate[i]);
    const float y = g / (1.0f + expf(-g)) * act_load(up[i]);
    act_store(&out[i], y);
    if (amax) m = max(m, abs_bits(stored(y, out)));
  }
  if (amax) warp_max_to(m, amax);
}

template <typename T>
__global__ void swiglu_bwd_kernel(T *__restrict__ dgate, T *__restrict__ dup, const T *__restrict__ dout,
                                  const T *__restrict__ gate, const T *__restrict__ up, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float g = act_load(gate[i]), u = act_load(up[i]), d = act_load(dout[i]);
    float s = 1.0f / (1.0f + expf(-g));
    act_store(&dgate[i], d * u * s * (1.0f + g * (1.0f - s)));
    act_store(&dup[i], d * g * s);
  }
}

template <typename T>
static nvl_status swiglu_fwd(nvl_kctx *ctx, T *out, const T *gate, const T *up, int64_t n, const char *fn,
                             float *amax = NULL) {
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  if (amax) NVL_TRY(nvl_cuda_memset(amax, 0, sizeof(float), dev));
  if (n == 0) return NVL_OK;
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(n, kThreads, dev), kThreads, 0, 0, swiglu_fwd_kernel<T>)(out, gate, up, n,
                                                                                    reinterpret_cast<uint32_t *>(amax));
  return launched(dev, fn, "swiglu_fwd_kernel", n, 1);
}

template <typename T>
static nvl_status swiglu_bwd(nvl_kctx *ctx, T *dgate, T *dup, const T *dout, const T *gate, const T *up, int64_t n,
                             const char *fn) {
  const int dev = ctx->dev;
  if (n == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(n, kThreads, dev), kThreads, 0, 0, swiglu_bwd_kernel<T>)(dgate, dup, dout, gate, up, n);
  return launched(dev, fn, "swiglu_bwd_kernel", n, 1);
}

extern "C" nvl_status nvl_cuda_swiglu_forward(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
  return swiglu_fwd(ctx, out, gate, up, n, __func__);
}

extern "C" nvl_status nvl_cuda_swiglu_backward(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                                               const float *up, int64_t n) {
  return swiglu_bwd(ctx, dgate, dup, dout, gate, up, n, __func__);
}

extern "C" nvl_status nvl_cuda_swiglu_forward_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate, const uint16_t *up,
                                                   int64_t n) {
  return swiglu_fwd(ctx, out, gate, up, n, __func__);
}

extern "C" nvl_status nvl_cuda_swiglu_forward_bf16_amax(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate,
                                                        const uint16_t *up, int64_t n, float *amax) {
  return swiglu_fwd(ctx, out, gate, up, n, __func__, amax);
}

extern "C" nvl_status nvl_cuda_swiglu_backward_bf16(nvl_kctx *ctx, uint16_t *dgate, uint16_t *dup, const uint16_t *dout,
                                                    const uint16_t *gate, const uint16_t *up, int64_t n) {
  return swiglu_bwd(ctx, dgate, dup, dout, gate, up, n, __func__);
}

/* ---- fused softmax cross-entropy -------------------------------------------------------------- *
 * One block per row. Pass 1: each thread keeps an online (max, sum exp) over its strided share of
 * the row, merged across the block into lse. Pass 2 (dlogits only): re-reads the row and writes
 * grad_scale * (k softmax - onehot), as f32 (G = float) or that f32 value rounded once to bf16
 * (G = uint16_t). The logits are read in their own dtype (f32 or bf16); no widened copy exists, and
 * no fp32 row buffer beyond registers. */
__device__ __forceinline__ void store_grad(float *d, int64_t i, float v) { d[i] = v; }
__device__ __forceinline__ void store_grad(uint16_t *d, int64_t i, float v) { d[i] = f32_to_bf16_bits(v); }

/* One dlogit: gs (k p - onehot), p = exp(x - lse) (the same f32 operations for either output) */
__device__ __forceinline__ float ce_grad(float x, float lse, float k, float gs, bool target) {
  const float p = expf(x - lse);
  return gs * (k * p - (target ? 1.0f : 0.0f));
}

template <typename X, typename G>
__global__ void cross_entropy_kernel(double *__restrict__ row_loss, G *__restrict__ dlogits,
                                     const X *__restrict__ logits, const int64_t *__restrict__ targets, int64_t N,
                                     int64_t V, int64_t ignore_index, double z_loss, double grad_scale) {
  NVL_SHARED(float, sm, [32]);
  NVL_SHARED(float, ss, [32]);
  NVL_SHARED(float, lse_sh, );
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const X *x = logits + n * V;
    const int64_t tg = targets[n];
    G *d = dlogits ? dlogits + n * V : NULL;
    if (tg == ignore_index) {
      if (d)
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) store_grad(d, i, 0.0f);
      if (threadIdx.x == 0) row_loss[n] = 0.0;
      continue;
    }
    float m = -INFINITY, s = 0.0f;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      float v = load_f(x, i);
      if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
      } else if (v != -INFINITY) { /* -inf adds exp(-inf) = 0; with m = -inf still, exp(-inf + inf) is NaN */
        s += expf(v - m);
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      ms_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    if (warp == 0) {
      m = lane < nw ? sm[lane] : -INFINITY;
      s = lane < nw ? ss[lane] : 0.0f;
      for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, m2, s2);
      }
      if (lane == 0) {
        double lse = (double)m + log((double)s);
        lse_sh = (float)lse;
        row_loss[n] = lse - (double)load_f(x, tg) + z_loss * lse * lse;
      }
    }
    __syncthreads();
    const float lse = lse_sh;
    if (d) {
      const float k = (float)(1.0 + 2.0 * z_loss * (double)lse), gs = (float)grad_scale;
      for (int64_t i = threadIdx.x; i < V; i += blockDim.x) store_grad(d, i, ce_grad(load_f(x, i), lse, k, gs, i == tg));
    }
    __syncthreads(); /* sm/ss/lse_sh reused by the next row */
  }
}

/* *out (host) = sum of in[0..n) in double, in a fixed order (one block; deterministic). */
__global__ void sum_doubles_kernel(double *__restrict__ out, const double *__restrict__ in, int64_t n) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += in[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

/* The sum of the n doubles at in (device), read back to the host through scratch. */
static nvl_status sum_to_host(nvl_kctx *ctx, double *host, const double *in, int64_t n, const char *fn) {
  const int dev = ctx->dev;
  double *d = NULL;
  NVL_TRY(ctx->scratch(ctx, sizeof(double), (void **)&d));
  (void)cudaGetLastError();
  NVL_LAUNCH(1, 1024, 0, 0, sum_doubles_kernel)(d, in, n);
  NVL_TRY(launched(dev, fn, "sum_doubles_kernel", n, 1));
  return nvl_cuda_memcpy(host, d, sizeof(double), 1, dev);
}

/* The maximum over the block of v; every thread gets it (block_sum's pattern). */
__device__ double block_max(double v) {
  NVL_SHARED(double, part, [32]);
  NVL_SHARED(double, total, );
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double s = lane < nw ? part[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) s = fmax(s, __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) total = s;
  }
  __syncthreads();
  double r = total;
  __syncthreads();
  return r;
}

/* lse of x / T over the row, in double (every thread gets it) */
template <typename X>
__device__ double row_lse(const X *x, int64_t V, double T) {
  double m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = fmax(m, (double)load_f(x, i) / T);
  m = block_max(m);
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) s += exp((double)load_f(x, i) / T - m);
  return m + log(block_sum(s));
}

/* One block per row: row_kl[n], row_ce[n] and the row's gradient (core/backend.h distill). */
template <typename S, typename X>
__global__ void distill_kernel(double *__restrict__ row_kl, double *__restrict__ row_ce, float *__restrict__ dlogits,
                               const S *__restrict__ s, const X *__restrict__ t, const int64_t *__restrict__ targets,
                               int64_t N, int64_t V, int64_t ignore_index, double T, double alpha, double grad_scale) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const S *x = s + n * V;
    const X *y = t + n * V;
    const int64_t tg = targets[n];
    float *d = dlogits ? dlogits + n * V : NULL;
    if (tg == ignore_index) {
      if (d)
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) d[i] = 0.0f;
      if (threadIdx.x == 0) row_kl[n] = row_ce[n] = 0.0;
      continue;
    }
    const double lse1 = row_lse(x, V, 1.0), lse_s = row_lse(x, V, T), lse_t = row_lse(y, V, T);
    double k = 0.0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const double xs = (double)load_f(x, i), lpt = (double)load_f(y, i) / T - lse_t, lps = xs / T - lse_s;
      const double pt = exp(lpt);
      k += pt * (lpt - lps);
      if (d) {
        const double g = alpha * T * (exp(lps) - pt) + (1.0 - alpha) * (exp(xs - lse1) - (i == tg ? 1.0 : 0.0));
        d[i] = (float)(grad_scale * g);
      }
    }
    k = block_sum(k);
    if (threadIdx.x == 0) {
      row_kl[n] = k;
      row_ce[n] = lse1 - (double)load_f(x, tg);
    }
  }
}

extern "C" nvl_status nvl_cuda_distill(nvl_kctx *ctx, double *kl, double *ce, float *dlogits, const void *s,
                                       nvl_dtype s_dtype, const void *t, nvl_dtype t_dtype, const int64_t *targets,
                                       int64_t N, int64_t V, int64_t ignore_index, double T, double alpha,
                                       double grad_scale) {
  const int dev = ctx->dev;
  *kl = *ce = 0.0;
  if (N == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  double *rows = NULL; /* (2N): the rows' KL, then their CE, device */
  NVL_TRY(ctx->scratch(ctx, (size_t)(2 * N) * sizeof(double), (void **)&rows));
  const int blocks = (int)(N < 65535 * 16 ? N : 65535 * 16), threads = 256;
  const bool sb = s_dtype == NVL_BF16, tb = t_dtype == NVL_BF16;
  (void)cudaGetLastError();
#define NVL_DISTILL(S, X)                                                                                      \
  NVL_LAUNCH(blocks, threads, 0, 0, distill_kernel<S, X>)(rows, rows + N, dlogits, (const S *)s, (const X *)t, \
                                                          targets, N, V, ignore_index, T, alpha, grad_scale)
  if (sb && tb) NVL_DISTILL(uint16_t, uint16_t);
  else if (sb) NVL_DISTILL(uint16_t, float);
  else if (tb) NVL_DISTILL(float, uint16_t);
  else NVL_DISTILL(float, float);
#undef NVL_DISTILL
  NVL_TRY(launched(dev, __func__, "distill_kernel", N, V));
  NVL_TRY(sum_to_host(ctx, kl, rows, N, __func__));
  return sum_to_host(ctx, ce, rows + N, N, __func__);
}

template <typename G>
static nvl_status cross_entropy_cuda(nvl_kctx *ctx, double *total, int total_on_device, G *dlogits, const void *logits,
                                     nvl_dtype logits_dtype, const int64_t *targets, int64_t N, int64_t V,
                                     int64_t ignore_index, double z_loss, double grad_scale, const char *fn) {
  const int dev = ctx->dev;
  const bool bf16 = logits_dtype == NVL_BF16;
  if (N == 0) return total_on_device ? nvl_cuda_memset(total, 0, sizeof(double), dev) : (*total = 0.0, NVL_OK);
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  double *rows = NULL; /* (N) per-row loss terms, device */
  NVL_TRY(ctx->scratch(ctx, (size_t)N * sizeof(double), (void **)&rows));
  int blocks = (int)(N < 65535 * 16 ? N : 65535 * 16), threads = 512;
  (void)cudaGetLastError();
  if (bf16)
    NVL_LAUNCH(blocks, threads, 0, 0, cross_entropy_kernel<uint16_t, G>)(
        rows, dlogits, (const uint16_t *)logits, targets, N, V, ignore_index, z_loss, grad_scale);
  else
    NVL_LAUNCH(blocks, threads, 0, 0, cross_entropy_kernel<float, G>)(rows, dlogits, (const float *)logits, targets, N,
                                                                        V, ignore_index, z_loss, grad_scale);
  char what[64];
  snprintf(what, sizeof what, "cross_entropy_kernel<%s, %s>", bf16 ? "bf16" : "f32", sizeof(G) == 2 ? "bf16" : "f32");
  NVL_TRY(launched(dev, fn, what, N, V));
  if (total_on_device) { /* the sum stays on the device: read back by whoever wants the loss, later */
    NVL_LAUNCH(1, 1024, 0, 0, sum_doubles_kernel)(total, rows, N);
    return launched(dev, fn, "sum_doubles_kernel", N, 1);
  }
  return sum_to_host(ctx, total, rows, N, fn);
}

extern "C" nvl_status nvl_cuda_cross_entropy(nvl_kctx *ctx, double *total, int total_on_device, float *dlogits,
                                             const void *logits,
                                             nvl_dtype logits_dtype, const int64_t *targets, int64_t N, int64_t V,
                                             int64_t ignore_index, double z_loss, double grad_scale) {
  return cross_entropy_cuda(ctx, total, total_on_device, dlogits, logits, logits_dtype, targets, N, V, ignore_index,
                            z_loss, grad_scale, __func__);
}

extern "C" nvl_status nvl_cuda_cross_entropy_bf16grad(nvl_kctx *ctx, double *total, int total_on_device,
                                                      uint16_t *dlogits, const void *logits, nvl_dtype logits_dtype,
                                                      const int64_t *targets, int64_t N, int64_t V,
                                                      int64_t ignore_index, double z_loss, double grad_scale) {
  return cross_entropy_cuda(ctx, total, total_on_device, dlogits, logits, logits_dtype, targets, N, V, ignore_index,
                            z_loss, grad_scale, __func__);
}

/* ---- delayed scaling's history step (backend.h amax_history; layers_cpu.c's operations) ------- */
__global__ void amax_history_kernel(float *sel, float *hist, int64_t len, int64_t count, int64_t pos,
                                    const float *cur) {
  float m = 0.0f, last = hist[len];
  for (int64_t i = 0; i < count; i++) {
    const float v = hist[i];
    if (fabsf(v) < u2f(0x7F800000u) && v > m) m = v; /* finite (NaN fails the compare) and positive */
  }
  if (m > 0.0f) last = m;
  const float c = *cur;
  *sel = last > 0.0f ? last : c;
  hist[len] = last;
  hist[pos] = c;
}

extern "C" nvl_status nvl_cuda_amax_history(nvl_kctx *ctx, float *sel, float *hist, int64_t len, int64_t count,
                                            int64_t pos, const float *cur) {
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  NVL_LAUNCH(1, 1, 0, 0, amax_history_kernel)(sel, hist, len, count, pos, cur);
  return launched(dev, __func__, "amax_history_kernel", len, 1);
}

/* ---- AdamW ------------------------------------------------------------------------------------ *
 * layers_ref.h nvl_adamw_elem, operation for operation, each rounding pinned (bit-exact). */
__global__ void adamw_kernel(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m,
                             float *__restrict__ v, int64_t n, nvl_adamw_coefs k, uint32_t *nonfinite) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t raw = 0; /* the updated parameters' raw_bits: NVL_NONFINITE_PARAM (common.cuh) */
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float gi = g[i], pp = f_mul(p[i], k.decay), mm = m[i], vv = v[i];
    mm = fabsf(k.w1) < 0.5f ? f_add(mm, f_mul(k.w1, f_sub(gi, mm)))
                            : f_sub(gi, f_mul(f_sub(gi, mm), f_sub(1.0f, k.w1)));
    vv = f_mul(vv, k.b2);
    vv = f_add(vv, f_mul(f_mul(k.one_minus_b2, gi), gi));
    float denom = f_add(f_div(__fsqrt_rn(vv), k.bc2_sqrt), k.eps);
    pp = f_add(pp, f_div(f_mul(k.neg_step_size, mm), denom));
    p[i] = pp;
    m[i] = mm;
    v[i] = vv;
    raw = max(raw, raw_bits(pp));
  }
  flag_nonfinite(raw, nonfinite, NVL_NONFINITE_PARAM);
}

extern "C" nvl_status nvl_cuda_adamw_step(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v,
                                          int64_t n, const nvl_adamw_opts *o) {
  const int dev = ctx->dev;
  if (n == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  nvl_adamw_coefs k = nvl_adamw_coefs_of(o);
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(n, kThreads, dev), kThreads, 0, 0, adamw_kernel)(param, grad, m, v, n, k,
                                                                             nvl_cuda_nonfinite_word(dev));
  return launched(dev, __func__, "adamw_kernel", n, 1);
}

/* ---- sum of squares --------------------------------------------------------------------------- */

/* partial[blockIdx.x] = sum over this block's grid-stride share of x^2, in double. */
template <typename X>
__global__ void sumsq_kernel(double *__restrict__ partial, const X *__restrict__ x, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  double acc = 0.0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    double a = (double)load_f(x, i);
    acc += a * a;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

/* out[g] = sum over group g's elements of f32(a - b)^2 in double, in index order (one thread per
 * group: the CPU's loop, the same bits; explicit .rn operations, no contraction). */
__global__ void block_sqerr_kernel(float *__restrict__ out, const float *__restrict__ a, const float *__restrict__ b,
                                   int64_t ng, int64_t block) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < ng; g += stride) {
    double s = 0.0;
    for (int64_t k = g * block; k < (g + 1) * block; k++) {
      double d = (double)(b ? f_sub(a[k], b[k]) : a[k]);
      s = d_add(s, d_mul(d, d));
    }
    out[g] = (float)s;
  }
}

extern "C" nvl_status nvl_cuda_block_sqerr(nvl_kctx *ctx, float *out, const float *a, const float *b, int64_t rows,
                                           int64_t K, int64_t block) {
  const int dev = ctx->dev;
  const int64_t ng = rows * (K / block);
  if (ng == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(ng, kThreads, dev), kThreads, 0, 0, block_sqerr_kernel)(out, a, b, ng, block);
  return launched(dev, __func__, "block_sqerr_kernel", rows * K, 1);
}

extern "C" nvl_status nvl_cuda_sumsq(nvl_kctx *ctx, double *out, const void *x, nvl_dtype x_dtype, int64_t n) {
  const int dev = ctx->dev;
  const bool bf16 = x_dtype == NVL_BF16;
  *out = 0.0;
  if (n == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  int blocks = nvl_cuda_grid(n, kThreads, dev);
  double *partial = NULL; /* (blocks) device */
  NVL_TRY(ctx->scratch(ctx, (size_t)blocks * sizeof(double), (void **)&partial));
  (void)cudaGetLastError();
  if (bf16) NVL_LAUNCH(blocks, kThreads, 0, 0, sumsq_kernel<uint16_t>)(partial, (const uint16_t *)x, n);
  else NVL_LAUNCH(blocks, kThreads, 0, 0, sumsq_kernel<float>)(partial, (const float *)x, n);
  NVL_TRY(launched(dev, __func__, bf16 ? "sumsq_kernel<bf16>" : "sumsq_kernel<f32>", n, 1));
  return sum_to_host(ctx, out, partial, blocks, __func__);
}
