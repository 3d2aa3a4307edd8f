/* gam.cu: GAM scaling of fp8 blocks on the device (the gam_quantize entry of core/backend.h), bit for
 * bit kernels/cpu/ref/gam_ref.c (the rule and its edge cases: gam_ref.h). Three launches on stream 0:
 *  1. gam_amax_kernel: each warp walks a contiguous run of 1 x B blocks (lanes across a block, so its
 *     reads are coalesced), keeps the running max |x| of the group it is in and folds it into that
 *     group's word by atomicMax on the bits when the group changes (non-negative floats order as
 *     integers; NaN bits cleared, as the reference's fmaxf ignores NaN): one atomic per warp and group
 *     boundary. The group words are mant itself, zeroed first. It also raises the non-finite flag.
 *  2. gam_codes_kernel: one warp per block: its max by a warp reduction, m_g from its group's word,
 *     e_b, the scale m_g 2^e_b, the codes (common.cuh's encoders) and the E8M0 byte.
 *  3. gam_mant_kernel: each group's word (its max |x|) replaced by its m_g.
 * The per-group and per-block scalar steps are gam_ref.c's split_quotient on the bits (below), with
 * common.cuh's pinned division: the same fp32 quotient, its significand and exponent read from the
 * bits rather than by frexpf.
 *
 * Not here: allocation (mant doubles as the amax scratch), decoding, the GEMM.
 *
 * Shape letters: x (R, K) f32 row-major, blocks of B along K numbered b = r (K/B) + k/B, group j =
 * blocks [j G, (j + 1) G). */
#include <stdio.h>

#include "common.cuh"

namespace {

const int kThreads = 256; /* 8 warps */

/* gam_ref.c split_quotient: qmax / a = m 2^e, 1 <= m < 2, for a finite > 0 (subnormal allowed). a =
 * ma 2^ea with ma in [0.5, 1): from the bits (a subnormal a is first scaled by 2^24, exactly); then
 * qmax / ma in (qmax, 2 qmax] is a normal fp32 quotient whose significand is m and whose exponent
 * gives e. */
NVL_HD float gam_split(float qmax, float a, int *e) {
  uint32_t b = f2u(a);
  int adj = 0;
  if ((b >> 23) == 0) {
    b = f2u(f_mul(a, 16777216.0f)); /* 2^24: exact, normal */
    adj = 24;
  }
  const int ea = (int)(b >> 23) - 126 - adj;
  const float ma = u2f((b & 0x7FFFFFu) | (126u << 23));
  const uint32_t bq = f2u(f_div(qmax, ma));
  *e = (int)(bq >> 23) - 127 - ea;
  return u2f((bq & 0x7FFFFFu) | (127u << 23));
}

/* nvl_gam_group_mantissa_ref */
NVL_HD float gam_group_mantissa(float gamax, float qmax) {
  if (!(gamax > 0.0f) || gamax == u2f(0x7F800000u)) return 1.0f;
  int e;
  return gam_split(qmax, gamax, &e);
}

/* nvl_gam_block_exp_ref */
NVL_HD int gam_block_exp(float bamax, float m_g, float qmax) {
  if (!(bamax > 0.0f)) return 127;
  if (bamax == u2f(0x7F800000u)) return -127;
  int e;
  const float m_b = gam_split(qmax, bamax, &e);
  if (m_b < m_g) e -= 1;
  return e > 127 ? 127 : e < -127 ? -127 : e;
}

/* ldexpf(m_g, e_b): m_g in [1, 2), so for e_b >= -126 the exponent field 127 + e_b in [1, 254] is set
 * exactly; e_b = -127 (an inf block, m_g = 1) is the subnormal m_g 2^-127, one rounded product. */
NVL_HD float gam_scale(float m_g, int e_b) {
  if (e_b >= -126) return u2f((uint32_t)((int32_t)f2u(m_g) + e_b * (1 << 23)));
  return f_mul(m_g, u2f(1u << 22));
}

__global__ void __launch_bounds__(kThreads) gam_amax_kernel(uint32_t *__restrict__ gamax, const float *__restrict__ x,
                                                            int64_t nblocks, int64_t block, int64_t G,
                                                            uint32_t *nonfinite) {
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t per = (nblocks + nwarps - 1) / nwarps;
  const int64_t b0 = w * per, b1 = b0 + per < nblocks ? b0 + per : nblocks;
  uint32_t m = 0, raw = 0;
  int64_t cur = b0 / G;
  for (int64_t b = b0; b < b1; b++) { /* warp-uniform */
    if (b / G != cur) {
      m = __reduce_max_sync(0xFFFFFFFFu, m);
      if (lane == 0 && m) atomicMax(gamax + cur, m);
      m = 0;
      cur = b / G;
    }
    for (int64_t j = lane; j < block; j += 32) {
      const float v = x[b * block + j];
      m = max(m, abs_bits(v));
      raw = max(raw, raw_bits(v));
    }
  }
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if (lane == 0 && m && b0 < b1) atomicMax(gamax + cur, m);
  flag_nonfinite(raw, nonfinite, NVL_NONFINITE_INPUT);
}

template <int E5M2>
__global__ void __launch_bounds__(kThreads) gam_codes_kernel(uint8_t *__restrict__ codes, uint8_t *__restrict__ scales,
                                                             const uint32_t *__restrict__ gamax,
                                                             const float *__restrict__ x, int64_t nblocks,
                                                             int64_t block, int64_t G) {
  const float qmax = E5M2 ? 57344.0f : 448.0f;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t b = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nblocks; b += nwarps) {
    const float *xb = x + b * block;
    uint32_t m = 0;
    for (int64_t j = lane; j < block; j += 32) m = max(m, abs_bits(xb[j]));
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    const float m_g = gam_group_mantissa(u2f(gamax[b / G]), qmax);
    const int e_b = gam_block_exp(u2f(m), m_g, qmax);
    const float s = gam_scale(m_g, e_b);
    if (lane == 0) scales[b] = (uint8_t)(127 - e_b);
    for (int64_t j = lane; j < block; j += 32) {
      const float v = f_mul(xb[j], s);
      codes[b * block + j] = (uint8_t)(E5M2 ? e5m2_encode(v) : e4m3_encode(v));
    }
  }
}

/* mant[g]: the group's max |x| bits in, its m_g out (one thread reads and writes each word) */
__global__ void __launch_bounds__(kThreads) gam_mant_kernel(float *mant, int64_t ng, float qmax) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < ng; g += stride)
    mant[g] = gam_group_mantissa(mant[g], qmax);
}

} /* namespace */

extern "C" nvl_status nvl_cuda_gam_quantize(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant,
                                            const float *x, int64_t rows, int64_t K, int64_t block,
                                            int64_t group_blocks, nvl_elem elem) {
  const int dev = ctx->dev;
  const int64_t G = group_blocks;
  if (elem != NVL_ELEM_E4M3 && elem != NVL_ELEM_E5M2)
    return nvl_error(NVL_EINVAL, "%s: invalid fp8 element format %d", __func__, (int)elem);
  if (block <= 0 || rows < 0 || K < 0 || K % block)
    return nvl_error(NVL_EINVAL, "%s: shape [%lld,%lld] is not a whole number of 1x%lld blocks", __func__,
                     (long long)rows, (long long)K, (long long)block);
  const int64_t nblocks = rows * (K / block);
  if (nblocks == 0) return NVL_OK;
  if (G <= 0 || nblocks % G)
    return nvl_error(NVL_EINVAL, "%s: %lld blocks do not split into groups of %lld blocks", __func__,
                     (long long)nblocks, (long long)G);
  const int64_t ng = nblocks / G;
  const float qmax = elem == NVL_ELEM_E5M2 ? 57344.0f : 448.0f;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  /* mant holds the groups' max |x| bits until the last launch */
  uint32_t *gamax = reinterpret_cast<uint32_t *>(mant);
  NVL_CUDA_CHECK(cudaMemsetAsync(gamax, 0, (size_t)ng * sizeof(uint32_t), 0));
  const int grid = nvl_cuda_grid(nblocks * 32, kThreads, dev);
  char what[160];
  snprintf(what, sizeof what, "gam_amax_kernel (rows=%lld, K=%lld, block=%lld, group=%lld)", (long long)rows,
           (long long)K, (long long)block, (long long)G);
  NVL_LAUNCH(grid, kThreads, 0, 0, gam_amax_kernel)(gamax, x, nblocks, block, G, nvl_cuda_nonfinite_word(dev));
  NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  snprintf(what, sizeof what, "gam_codes_kernel<%s> (rows=%lld, K=%lld, block=%lld, group=%lld)",
           elem == NVL_ELEM_E5M2 ? "e5m2" : "e4m3", (long long)rows, (long long)K, (long long)block, (long long)G);
  if (elem == NVL_ELEM_E5M2)
    NVL_LAUNCH(grid, kThreads, 0, 0, gam_codes_kernel<1>)(codes, scales, gamax, x, nblocks, block, G);
  else NVL_LAUNCH(grid, kThreads, 0, 0, gam_codes_kernel<0>)(codes, scales, gamax, x, nblocks, block, G);
  NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  NVL_LAUNCH(nvl_cuda_grid(ng, kThreads, dev), kThreads, 0, 0, gam_mant_kernel)(mant, ng, qmax);
  return nvl_cuda_check_launch(dev, __func__, "gam_mant_kernel");
}
