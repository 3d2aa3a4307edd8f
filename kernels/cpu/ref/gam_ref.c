/* gam_ref.c: GAM scaling of fp8 blocks, the scalar reference (see gam_ref.h for the rule and its edge
 * cases). Like formats_ref.c, every fp32 operation of the rule is one C float operation here (needs
 * FLT_EVAL_METHOD 0, no -ffast-math, fp32 subnormals kept). Not here: speed. */
#include "cpu/ref/gam_ref.h"

#include <math.h>

#include "cpu/ref/formats_ref.h"

static nvl_status check_fp8(const char *op, nvl_elem elem) {
  if (elem != NVL_ELEM_E4M3 && elem != NVL_ELEM_E5M2)
    return nvl_error(NVL_EINVAL, "%s: GAM scaling takes an fp8 element format (e4m3, e5m2), not %d", op, (int)elem);
  return NVL_OK;
}

/* qmax / a = m 2^e, 1 <= m < 2, the quotient rounded once to 24 bits with an unbounded exponent: a
 * (finite, > 0, subnormal allowed) = ma 2^ea exactly, ma in [0.5, 1), and qmax / ma in (qmax, 2 qmax]
 * is a normal fp32 quotient with the same 24-bit significand as qmax / a. Returns m, sets *e. */
static float split_quotient(float qmax, float a, int *e) {
  int ea, eq;
  float ma = frexpf(a, &ea);
  float mq = frexpf(qmax / ma, &eq); /* qmax / ma = mq 2^eq, mq in [0.5, 1) */
  *e = eq - 1 - ea;
  return 2.0f * mq;
}

float nvl_gam_group_mantissa_ref(float gamax, nvl_elem elem) {
  if (!(gamax > 0.0f) || isinf(gamax)) return 1.0f; /* 0, NaN, inf */
  int e;
  return split_quotient(nvl_elem_max_ref(elem), gamax, &e);
}

int nvl_gam_block_exp_ref(float bamax, float m_g, nvl_elem elem) {
  if (!(bamax > 0.0f)) return 127; /* a zero block (NaN: treated as one) */
  if (isinf(bamax)) return -127;
  int e;
  float m_b = split_quotient(nvl_elem_max_ref(elem), bamax, &e);
  if (m_b < m_g) e -= 1;
  return e > 127 ? 127 : e < -127 ? -127 : e; /* finite blocks: e >= -121, so only the upper clamp acts */
}

/* G = group_blocks or all blocks; checks the arguments common to both directions. */
static nvl_status check_shape(const char *op, int64_t rows, int64_t K, int block, int64_t group_blocks, nvl_elem elem,
                              int64_t *G) {
  NVL_TRY(check_fp8(op, elem));
  if (block <= 0) return nvl_error(NVL_EINVAL, "%s: block length %d is not positive", op, block);
  if (rows < 0 || K < 0 || K % block)
    return nvl_error(NVL_EINVAL, "%s: shape [%lld,%lld] is not a whole number of 1x%d blocks", op, (long long)rows,
                     (long long)K, block);
  int64_t nblocks = rows * (K / block);
  if (group_blocks < 0) return nvl_error(NVL_EINVAL, "%s: group of %lld blocks", op, (long long)group_blocks);
  *G = group_blocks ? group_blocks : nblocks;
  if (nblocks && nblocks % *G)
    return nvl_error(NVL_EINVAL, "%s: %lld blocks of 1x%d do not split into groups of %lld blocks", op,
                     (long long)nblocks, block, (long long)*G);
  return NVL_OK;
}

static float absmax(const float *x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
  return m;
}

nvl_status nvl_gam_quantize_ref(uint8_t *codes, uint8_t *scales, float *mant, int *nonfinite, const float *x,
                                int64_t rows, int64_t K, int block, int64_t group_blocks, nvl_elem elem) {
  int64_t G;
  NVL_TRY(check_shape("gam_quantize_ref", rows, K, block, group_blocks, elem, &G));
  int64_t nblocks = rows * (K / block);
  if (nonfinite) *nonfinite = nvl_has_nonfinite_ref(x, rows * K);
  /* block b is x[b * block, (b + 1) * block): rows are whole blocks, so the layout is one run */
  for (int64_t g0 = 0; g0 < nblocks; g0 += G) {
    float gamax = absmax(x + g0 * block, G * block);
    float m_g = nvl_gam_group_mantissa_ref(gamax, elem);
    mant[g0 / G] = m_g;
    for (int64_t b = g0; b < g0 + G; b++) {
      const float *xb = x + b * block;
      int e_b = nvl_gam_block_exp_ref(absmax(xb, block), m_g, elem);
      float scale = ldexpf(m_g, e_b); /* exact: normal for e_b >= -126; e_b = -127 only with m_g = 1 */
      scales[b] = nvl_gam_e8m0_of_exp(e_b);
      for (int j = 0; j < block; j++) codes[b * block + j] = nvl_elem_encode_ref(elem, xb[j] * scale);
    }
  }
  return NVL_OK;
}

nvl_status nvl_gam_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, const float *mant,
                                  int64_t rows, int64_t K, int block, int64_t group_blocks, nvl_elem elem) {
  int64_t G;
  NVL_TRY(check_shape("gam_dequantize_ref", rows, K, block, group_blocks, elem, &G));
  int64_t nblocks = rows * (K / block);
  for (int64_t b = 0; b < nblocks; b++) {
    double f = ldexp(1.0, -nvl_gam_exp_of_e8m0(scales[b])); /* 2^-e_b */
    double m_g = mant[b / G];
    for (int j = 0; j < block; j++) {
      /* value 2^-e_b is exact in double; the double quotient rounded to fp32 is the fp32 rounding of
       * the exact quotient (53 >= 2 * 24 + 2: double rounding is innocuous for a division) */
      double v = nvl_elem_decode_ref(elem, codes[b * block + j]);
      y[b * block + j] = (float)(v * f / m_g);
    }
  }
  return NVL_OK;
}
