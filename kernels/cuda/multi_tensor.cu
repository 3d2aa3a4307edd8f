/* multi_tensor.cu: the optimizer's multi-tensor kernels (core/optim.h, entries of the CUDA table):
 * one AdamW step over every tensor of a parameter group, and the global gradient norm over every
 * grad, each ONE launch (per 512 tensors) whatever the number of parameters, where the single-tensor
 * ops cost a launch per parameter (and the norm a copy to the host per parameter).
 *
 * The tensor list travels in the kernel's parameters (a table of up to kRows rows, ~21 KB: CUDA
 * 12.1+ takes up to 32764 bytes of parameters on sm_70 and later), so a step uploads nothing and
 * keeps no device table that could go stale when a tensor moves. Every thread walks the rows in
 * order, grid-striding over each row's elements; the per-element AdamW is layers.cu's adamw_kernel
 * (layers_ref.h nvl_adamw_elem, each rounding pinned: bit-exact with the CPU).
 *
 * The norm: each block writes its fp64 partial, the last block to finish (an atomic count in the
 * state) adds the partials in block order and writes the sum of squares and the clip factor into
 * the state on the device; nothing is read back. Run to run the result is the same (fixed order);
 * it differs from the CPU's sum only by fp64 summation order (the squares of f32 are exact in fp64).
 * AdamW reads the clip factor from the state and scales each grad on the fly as grad:mul_ rounds.
 *
 * Not here: validation (core/optim.c), the single-tensor AdamW and sumsq (layers.cu). */
#include <math.h>
#include <stdio.h>

#include "common.cuh"
#include "cpu/ref/layers_ref.h"

static const int kThreads = 256;
enum { kRows = 512 }; /* rows per launch: 5 * 8 * 512 + 4 * 512 bytes of table, under 32764 */

/* __threadfence, which the CPU emulation (one memory, blocks in turn) does not need */
#ifdef NVL_CUDA_EMU
#define NVL_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#else
#define NVL_FENCE() __threadfence()
#endif

struct AdamwTable {
  float *p[kRows];
  const float *g[kRows];
  float *m[kRows];
  float *v[kRows];
  int64_t n[kRows];
  int no_decay[kRows]; /* ints, not bytes: no 8 bytes of flags can read as an address */
  int64_t count;
};

struct NormTable {
  const float *x[kRows];
  int64_t n[kRows];
  int64_t count;
};

/* The clip factor c applied as grad:mul_(c) rounds (layers_ref.h nvl_clip_scale; ops.cu scale_kernel). */
__device__ __forceinline__ float clip_scale(float g, double c, float cf, bool exact) {
  return exact ? f_mul(g, cf) : __double2float_rn(__dmul_rn((double)g, c));
}

/* layers.cu adamw_kernel's element (layers_ref.h nvl_adamw_elem), operation for operation. */
__device__ __forceinline__ void adamw_elem(float *p, float gi, float *m, float *v, const nvl_adamw_coefs &k) {
  float pp = f_mul(*p, k.decay), mm = *m, vv = *v;
  mm = fabsf(k.w1) < 0.5f ? f_add(mm, f_mul(k.w1, f_sub(gi, mm))) : f_sub(gi, f_mul(f_sub(gi, mm), f_sub(1.0f, k.w1)));
  vv = f_mul(vv, k.b2);
  vv = f_add(vv, f_mul(f_mul(k.one_minus_b2, gi), gi));
  float denom = f_add(f_div(__fsqrt_rn(vv), k.bc2_sqrt), k.eps);
  pp = f_add(pp, f_div(f_mul(k.neg_step_size, mm), denom));
  *p = pp;
  *m = mm;
  *v = vv;
}

/* Every row of t: AdamW with kd (k0 for a no_decay row), each grad scaled by *clip first when
 * clip is not NULL. */
__global__ void adamw_multi_kernel(AdamwTable t, nvl_adamw_coefs kd, nvl_adamw_coefs k0, const double *clip,
                                   uint32_t *nonfinite) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const double c = clip ? *clip : 1.0;
  const float cf = (float)c;
  const bool exact = (double)cf == c;
  uint32_t raw = 0; /* the updated parameters' raw_bits: NVL_NONFINITE_PARAM (common.cuh) */
  for (int64_t r = 0; r < t.count; r++) {
    const nvl_adamw_coefs &k = t.no_decay[r] ? k0 : kd;
    float *p = t.p[r], *m = t.m[r], *v = t.v[r];
    const float *g = t.g[r];
    for (int64_t i = i0; i < t.n[r]; i += stride) {
      adamw_elem(&p[i], clip ? clip_scale(g[i], c, cf, exact) : g[i], &m[i], &v[i], k);
      raw = max(raw, raw_bits(p[i]));
    }
  }
  flag_nonfinite(raw, nonfinite, NVL_NONFINITE_PARAM);
}

extern "C" nvl_status nvl_cuda_adamw_multi(nvl_kctx *ctx, const nvl_adamw_chunk *rows, int64_t count,
                                           const nvl_adamw_opts *o, const int64_t *state) {
  const int dev = ctx->dev;
  if (count == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  nvl_adamw_opts o0 = *o;
  o0.weight_decay = 0.0;
  const nvl_adamw_coefs kd = nvl_adamw_coefs_of(o), k0 = nvl_adamw_coefs_of(&o0);
  const double *clip = state ? (const double *)&state[NVL_NORM_CLIP] : NULL;
  static thread_local AdamwTable t; /* ~21 KB: not on the stack; the launch copies it */
  for (int64_t r0 = 0; r0 < count; r0 += kRows) {
    memset(&t, 0, sizeof t);
    t.count = count - r0 < (int64_t)kRows ? count - r0 : (int64_t)kRows;
    int64_t total = 0;
    for (int64_t r = 0; r < t.count; r++) {
      const nvl_adamw_chunk *e = &rows[r0 + r];
      t.p[r] = e->param, t.g[r] = e->grad, t.m[r] = e->m, t.v[r] = e->v, t.n[r] = e->n;
      t.no_decay[r] = e->no_decay;
      total += e->n;
    }
    (void)cudaGetLastError();
    NVL_LAUNCH(nvl_cuda_grid(total, kThreads, dev), kThreads, 0, 0, adamw_multi_kernel)(t, kd, k0, clip,
                                                                                    nvl_cuda_nonfinite_word(dev));
    char what[96];
    snprintf(what, sizeof what, "adamw_multi_kernel (%lld tensors, %lld elements)", (long long)t.count,
             (long long)total);
    NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  }
  return NVL_OK;
}

/* ---- the global gradient norm ----------------------------------------------------------------- */

/* Sum over the block of v; every thread gets the total (layers.cu block_sum). */
__device__ double block_sum_d(double v) {
  NVL_SHARED(double, part, [32]);
  NVL_SHARED(double, total, );
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double s = lane < nw ? part[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) total = s;
  }
  __syncthreads();
  double r = total;
  __syncthreads();
  return r;
}

/* partial[part0 + block] = this block's share of sum x^2 over every row; the last of all_blocks
 * blocks (this launch's and earlier ones') adds partial[0 .. all_blocks) in order and writes the
 * state: sum of squares, clip factor for max_norm; then zeroes the count. */
__global__ void grad_norm_kernel(NormTable t, double *partial, int64_t part0, unsigned all_blocks, int64_t *state,
                                 double max_norm, uint32_t *nonfinite) {
  NVL_SHARED(int, last, );
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  double acc = 0.0;
  for (int64_t r = 0; r < t.count; r++) {
    const float *x = t.x[r];
    for (int64_t i = i0; i < t.n[r]; i += stride) {
      double a = (double)x[i];
      acc += a * a;
    }
  }
  acc = block_sum_d(acc);
  unsigned *count = (unsigned *)&state[NVL_NORM_COUNT];
  if (threadIdx.x == 0) {
    partial[part0 + blockIdx.x] = acc;
    NVL_FENCE();
    last = atomicAdd(count, 1u) == all_blocks - 1;
  }
  __syncthreads();
  if (!last) return;
  NVL_FENCE();
  const volatile double *vp = partial;
  double s = 0.0;
  for (int64_t b = threadIdx.x; b < all_blocks; b += blockDim.x) s += vp[b];
  s = block_sum_d(s);
  if (threadIdx.x == 0) {
    double *d = (double *)state;
    double norm = sqrt(s);
    d[NVL_NORM_SUMSQ] = s;
    d[NVL_NORM_CLIP] = norm > max_norm && norm < INFINITY ? max_norm / (norm + 1e-6) : 1.0;
    *count = 0u;
    /* the device's non-finite flags, taken: every kernel that set them ran before (stream order) */
    state[NVL_NORM_NONFINITE] = nonfinite ? (int64_t)*nonfinite : 0;
    if (nonfinite) *nonfinite = 0u;
  }
}

extern "C" nvl_status nvl_cuda_grad_norm_multi(nvl_kctx *ctx, int64_t *state, const float *const *x, const int64_t *n,
                                               int64_t count, double max_norm, int take_nonfinite) {
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  static thread_local NormTable t;
  int64_t total = 0;
  for (int64_t r = 0; r < count; r++) total += n[r];
  const int blocks = nvl_cuda_grid(total, kThreads, dev);
  const int64_t launches = count == 0 ? 1 : (count + kRows - 1) / kRows;
  double *partial = NULL; /* (launches * blocks) device */
  NVL_TRY(ctx->scratch(ctx, (size_t)(launches * blocks) * sizeof(double), (void **)&partial));
  NVL_CUDA_CHECK(cudaMemsetAsync(&state[NVL_NORM_COUNT], 0, sizeof(int64_t), 0)); /* after a failed launch too */
  for (int64_t l = 0; l < launches; l++) {
    memset(&t, 0, sizeof t);
    const int64_t r0 = l * kRows;
    t.count = count - r0 < (int64_t)kRows ? count - r0 : (int64_t)kRows;
    for (int64_t r = 0; r < t.count; r++) t.x[r] = x[r0 + r], t.n[r] = n[r0 + r];
    (void)cudaGetLastError();
    NVL_LAUNCH(blocks, kThreads, 0, 0, grad_norm_kernel)(t, partial, l * blocks, (unsigned)(launches * blocks), state,
                                                       max_norm, take_nonfinite ? nvl_cuda_nonfinite_word(dev) : NULL);
    char what[96];
    snprintf(what, sizeof what, "grad_norm_kernel (%lld tensors, %lld elements)", (long long)t.count, (long long)total);
    NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  }
  return NVL_OK;
}

/* state's sum of squares = sum of the parts' in order (fp64), its clip factor (backend.h): one thread */
__global__ void grad_norm_combine_kernel(int64_t *state, const int64_t *parts, int64_t count, double max_norm) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double s = 0.0;
  for (int64_t r = 0; r < count; r++) s += ((const double *)(parts + r * NVL_NORM_STATE))[NVL_NORM_SUMSQ];
  double *d = (double *)state, norm = sqrt(s);
  d[NVL_NORM_SUMSQ] = s;
  d[NVL_NORM_CLIP] = norm > max_norm && norm < INFINITY ? max_norm / (norm + 1e-6) : 1.0;
}

extern "C" nvl_status nvl_cuda_grad_norm_combine(nvl_kctx *ctx, int64_t *state, const int64_t *parts, int64_t count,
                                                 double max_norm) {
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  NVL_LAUNCH(1, 32, 0, 0, grad_norm_combine_kernel)(state, parts, count, max_norm);
  return nvl_cuda_check_launch(dev, __func__, "grad_norm_combine_kernel");
}

/* ---- the device's non-finite flags, to the host ------------------------------------------------ */

extern "C" nvl_status nvl_cuda_nonfinite_take(nvl_kctx *ctx, uint32_t *flags) {
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  uint32_t *w = nvl_cuda_nonfinite_word(dev);
  if (!w) return nvl_error(NVL_EDEVICE, "%s: cuda:%d has no non-finite flag word (its allocation failed)", __func__, dev);
  NVL_CUDA_CHECK(cudaMemcpy(flags, w, sizeof(uint32_t), cudaMemcpyDeviceToHost));
  NVL_CUDA_CHECK(cudaMemsetAsync(w, 0, sizeof(uint32_t), 0));
  return NVL_OK;
}
