/* test_gam_ref.c: GAM scaling's scalar reference (kernels/cpu/ref/gam_ref.c) against cases worked by
 * hand and against an independent implementation written here: code values from their bit fields,
 * the quotients in double with the significand rounded as an integer (nearbyint), the block exponent
 * as "the largest e with m_g 2^e <= s_b" found by a search (not the m_b < m_g test), the element
 * encoder as a brute-force nearest-code search (ties to the even code), and the decoder in long
 * double. Everything bit for bit (no tolerance), except the saturation bound, which is stated. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cpu/ref/formats_ref.h"
#include "cpu/ref/gam_ref.h"
#include "unit.h"

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static int same(float a, float b) { return (isnan(a) && isnan(b)) || f2u(a) == f2u(b); }

/* ---- the independent implementation --------------------------------------------------------- */

static double t_qmax(nvl_elem el) { return el == NVL_ELEM_E4M3 ? 448.0 : 57344.0; }

/* The value of a code from its fields (NaN for NaN codes, +-inf for e5m2's). */
static double t_value(nvl_elem el, int c) {
  int s = c >> 7;
  double v;
  if (el == NVL_ELEM_E4M3) {
    int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    v = e == 0 ? m * ldexp(1, -9) : (8 + m) * ldexp(1, e - 10);
  } else {
    int e = (c >> 2) & 31, m = c & 3;
    if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
    v = e == 0 ? m * ldexp(1, -16) : (4 + m) * ldexp(1, e - 17);
  }
  return s ? -v : v;
}

/* Nearest finite code to v, ties to the even code (the even significand), sign kept (-0 -> 0x80);
 * beyond qmax the nearest is qmax (satfinite); NaN -> 0x7F | sign. */
static int t_encode(nvl_elem el, float v) {
  int sign = signbit(v) ? 0x80 : 0;
  if (isnan(v)) return 0x7F | sign;
  double a = fabs((double)v), bd = INFINITY;
  int best = -1;
  for (int c = 0; c < 0x80; c++) {
    double val = t_value(el, c);
    if (!isfinite(val)) continue;
    double d = isinf(a) ? t_qmax(el) - val : fabs(val - a);
    if (best < 0 || d < bd || (d == bd && !(c & 1))) best = c, bd = d;
  }
  return best | sign;
}

/* qmax / a rounded to 24 significant bits, as m 2^e with m in [1, 2): the double quotient (a second
 * rounding of a quotient of 24-bit numbers to 24 bits is innocuous from 53 bits), then its
 * significand rounded as an integer. */
static double t_split(double qmax, double a, int *e) {
  int ex;
  double r = nearbyint(ldexp(frexp(qmax / a, &ex), 24)); /* in [2^23, 2^24] */
  if (r == 0x1p24) r = 0x1p23, ex++;
  *e = ex - 1;
  return r / 0x1p23;
}

static double t_absmax(const float *x, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++)
    if (!isnan(x[i]) && fabs((double)x[i]) > m) m = fabs((double)x[i]);
  return m;
}

static double t_group_mantissa(nvl_elem el, double gamax) {
  if (gamax == 0 || isinf(gamax)) return 1;
  int e;
  return t_split(t_qmax(el), gamax, &e);
}

/* The largest e in [-127, 127] with m_g 2^e <= s_b (s_b as rounded to 24 bits, exponent unbounded). */
static int t_block_exp(nvl_elem el, double bamax, double m_g) {
  if (bamax == 0) return 127;
  if (isinf(bamax)) return -127;
  int es;
  double m_b = t_split(t_qmax(el), bamax, &es);
  double s_b = ldexp(m_b, es); /* exact in double: |es| < 170 */
  int e = 127;
  while (e > -127 && ldexp(m_g, e) > s_b) e--;
  return e;
}

/* ---- deterministic data --------------------------------------------------------------------- */

#include "gam_data.h"

/* ---- the comparison ------------------------------------------------------------------------- */

typedef struct {
  long blocks, below, equal, zero, clamped, elems, over_qmax;
  double worst; /* max over finite elements of |x| scale / qmax, exact in double */
} stats;

/* Quantizes x (R, K) with the reference and checks every output against the independent
 * implementation; returns the failures. */
static int compare(const float *x, int64_t R, int64_t K, int B, int64_t G, nvl_elem el, stats *st) {
  static uint8_t codes[1 << 14], scales[1 << 10];
  static float mant[1 << 10], y[1 << 14];
  int fails = 0, nonfinite = -1;
  if (nvl_gam_quantize_ref(codes, scales, mant, &nonfinite, x, R, K, B, G, el) != NVL_OK) return 1;
  if (nvl_gam_dequantize_ref(y, codes, scales, mant, R, K, B, G, el) != NVL_OK) return 1;
  int64_t nb = R * (K / B), g = G ? G : nb;
  int want_nonfinite = 0;
  for (int64_t i = 0; i < R * K; i++) want_nonfinite |= !isfinite(x[i]);
  fails += nonfinite != want_nonfinite;
  double qmax = t_qmax(el);
  for (int64_t b = 0; b < nb; b++) {
    double gamax = t_absmax(x + (b / g) * g * B, g * B), bamax = t_absmax(x + b * B, B);
    double m_g = t_group_mantissa(el, gamax);
    if (mant[b / g] != (float)m_g) fails++;
    int e = t_block_exp(el, bamax, m_g);
    if (scales[b] != 127 - e) fails++;
    double scale = ldexp(m_g, e);
    st->blocks++;
    if (bamax == 0) st->zero++;
    else if (isfinite(bamax)) {
      int es;
      double m_b = t_split(qmax, bamax, &es);
      if (es > 127 + (m_b < m_g)) st->clamped++;
      else if (m_b < m_g) st->below++;
      else if (m_b == m_g) st->equal++;
    }
    for (int j = 0; j < B; j++) {
      int64_t i = b * B + j;
      float p = (float)((double)x[i] * scale); /* x * scale rounded once to fp32, as a float product */
      int c = t_encode(el, p);
      if (codes[i] != c) fails++;
      float want = (float)((long double)t_value(el, c) * ldexpl(1, -e) / (long double)m_g);
      if (!same(y[i], want)) fails++;
      if (isfinite(x[i])) {
        double r = fabs((double)x[i]) * scale / qmax; /* |x| scale exact in double (24 x 24 bits) */
        if (r > st->worst) st->worst = r;
        st->over_qmax += fabsf(p) > qmax;
        fails += fabsf(p) > nextafterf((float)qmax, INFINITY); /* at most one fp32 step above qmax */
        st->elems++;
      }
    }
  }
  return fails;
}

/* ---- tests ------------------------------------------------------------------------------------ */

/* One tensor worked by hand, e4m3, blocks of 4, one group: gamax = 3, s_g = 448/3 = (7/6) 2^7, so
 * m_g = fl(7/6). Block maxima 3, 1.59, 2, 0.75, 0, 2^-140 give s_b = (7/6) 2^7, 1.1006 2^8 (m_b < m_g:
 * e_b 8 - 1), 1.75 2^7, (7/6) 2^9 (0.75 = 3/4: m_b == m_g), none (zero block), 1.75 2^148 (clamped). */
NVL_TEST(gam_hand_cases) {
  const float x[24] = {3.0f,  -1.0f, 0.5f,  2.25f, /* the group's max */
                       1.59f, 1.0f,  -0.5f, 0.0f,  /* m_b < m_g */
                       2.0f,  1.5f,  -2.0f, 0.25f, /* m_b > m_g */
                       0.75f, 0.5f,  -0.25f, 0.125f, /* m_b == m_g */
                       0.0f,  -0.0f, 0.0f,  0.0f,  /* zero block */
                       0x1p-140f, -0x1p-141f, 0x1p-149f, 0.0f}; /* subnormal max */
  uint8_t codes[24], scales[6];
  float mant[1], y[24];
  int nonfinite = -1;
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, &nonfinite, x, 1, 24, 4, 0, NVL_ELEM_E4M3) == NVL_OK);
  CHECK(nonfinite == 0);
  CHECK(mant[0] == (float)(7.0 / 6.0));
  const int want_e[6] = {7, 7, 7, 9, 127, 127};
  for (int b = 0; b < 6; b++) CHECK_EQ_U32(scales[b], 127 - want_e[b]);
  /* 3 (7/6) 2^7 = 448 up to fp32 rounding: e4m3's largest code; 0.75 (7/6) 2^9 too */
  CHECK_EQ_U32(codes[0], 0x7E);
  CHECK_EQ_U32(codes[12], 0x7E);
  /* 1.59: without the decrement, 1.59 (7/6) 2^8 = 474.88 > 448 would saturate; with it, 237.44 -> 240 */
  CHECK(1.59 * (7.0 / 6.0) * 256 > 448);
  CHECK(t_value(NVL_ELEM_E4M3, codes[4]) == 240.0);
  /* 2 (7/6) 2^7 = 298.67 -> 288 (e4m3 steps of 32 in [256, 512)) */
  CHECK(t_value(NVL_ELEM_E4M3, codes[8]) == 288.0);
  for (int i = 16; i < 20; i++) CHECK_EQ_U32(codes[i], i == 17 ? 0x80 : 0x00);
  /* 2^-140 (7/6) 2^127 = (7/6) 2^-13, below e4m3's 2^-10 rounding threshold: zeros */
  for (int i = 20; i < 24; i++) CHECK_EQ_U32(codes[i] & 0x7F, 0);
  CHECK(nvl_gam_dequantize_ref(y, codes, scales, mant, 1, 24, 4, 0, NVL_ELEM_E4M3) == NVL_OK);
  CHECK(y[4] == (float)(240.0 / 128 / (double)mant[0])); /* 240 2^-7 / m_g = 1.6071... */
  CHECK(y[16] == 0.0f && y[20] == 0.0f);

  /* e5m2: qmax 57344 = 1.75 2^15 has e4m3's 448 = 1.75 2^8 mantissa, so m_g is the same and every e_b
   * is 7 more, until the clamp (the subnormal block: 1.75 2^155 -> 127) */
  float mant5[1];
  uint8_t codes5[24], scales5[6];
  CHECK(nvl_gam_quantize_ref(codes5, scales5, mant5, NULL, x, 1, 24, 4, 0, NVL_ELEM_E5M2) == NVL_OK);
  CHECK(mant5[0] == mant[0]);
  const int want_e5[6] = {14, 14, 14, 16, 127, 127};
  for (int b = 0; b < 6; b++) CHECK_EQ_U32(scales5[b], 127 - want_e5[b]);
  CHECK_EQ_U32(codes5[0], 0x7B); /* 57344 */
  /* the subnormal block keeps precision in e5m2: 2^-140 (7/6) 2^127 = (7/6) 2^-13 -> 1.25 2^-13 */
  CHECK(t_value(NVL_ELEM_E5M2, codes5[20]) == 1.25 * 0x1p-13);
  stats st = {0};
  CHECK(compare(x, 1, 24, 4, 0, NVL_ELEM_E4M3, &st) == 0);
  CHECK(compare(x, 1, 24, 4, 0, NVL_ELEM_E5M2, &st) == 0);
}

/* The exponent rule at the E8M0 range's top: e_b = 127 unclamped, 128 -> 127 by the decrement,
 * beyond by the clamp; bamax where the fp32 quotient qmax / bamax overflows. */
NVL_TEST(gam_exponent_edges) {
  /* bamax = 1.75 2^-119: s_b = 2^127 exactly (e4m3), m_b = 1 */
  CHECK(nvl_gam_block_exp_ref(0x1.cp-119f, 1.0f, NVL_ELEM_E4M3) == 127);
  CHECK(nvl_gam_block_exp_ref(0x1.cp-119f, 1.5f, NVL_ELEM_E4M3) == 126); /* m_b = 1 < m_g */
  /* bamax = 1.75 2^-120: s_b = 2^128, not a finite fp32; e_b 128 -> 127 by the decrement or the clamp */
  CHECK(isinf(448.0f / 0x1.cp-120f));
  CHECK(nvl_gam_block_exp_ref(0x1.cp-120f, 1.5f, NVL_ELEM_E4M3) == 127);
  CHECK(nvl_gam_block_exp_ref(0x1.cp-120f, 1.0f, NVL_ELEM_E4M3) == 127);
  /* subnormal maxima: the smallest, and one with a fraction */
  CHECK(nvl_gam_block_exp_ref(0x1p-149f, 1.0f, NVL_ELEM_E4M3) == 127);
  CHECK(nvl_gam_block_exp_ref(0x1.8p-130f, 1.9f, NVL_ELEM_E5M2) == 127);
  /* the largest block maximum: FLT_MAX, s_b = 448 / FLT_MAX = 1.75 2^-120 (1 + 2^-24) rounded */
  CHECK(nvl_gam_block_exp_ref(FLT_MAX, 1.0f, NVL_ELEM_E4M3) == -120);
  CHECK(nvl_gam_block_exp_ref(FLT_MAX, 1.9f, NVL_ELEM_E4M3) == -121);
  CHECK(nvl_gam_block_exp_ref(0.0f, 1.3f, NVL_ELEM_E4M3) == 127);
  CHECK(nvl_gam_block_exp_ref(INFINITY, 1.0f, NVL_ELEM_E5M2) == -127);
  /* group mantissas: a subnormal gamax (448 / 2^-149 overflows fp32, its significand does not) */
  CHECK(nvl_gam_group_mantissa_ref(0x1p-149f, NVL_ELEM_E4M3) == 1.75f);
  CHECK(nvl_gam_group_mantissa_ref(0x1.8p-140f, NVL_ELEM_E4M3) == (float)(7.0 / 6.0));
  CHECK(nvl_gam_group_mantissa_ref(0.0f, NVL_ELEM_E4M3) == 1.0f);
  CHECK(nvl_gam_group_mantissa_ref(INFINITY, NVL_ELEM_E4M3) == 1.0f);
  CHECK(nvl_gam_group_mantissa_ref(NAN, NVL_ELEM_E5M2) == 1.0f);
  /* against the search, over maxima across the whole fp32 range */
  rng_state = 7;
  int fails = 0;
  for (int i = 0; i < 20000; i++) {
    float a = fabsf(rnd(-149, 127)), m = nvl_gam_group_mantissa_ref(fabsf(rnd(-149, 127)), NVL_ELEM_E4M3);
    nvl_elem el = (i & 1) ? NVL_ELEM_E5M2 : NVL_ELEM_E4M3;
    fails += nvl_gam_block_exp_ref(a, m, el) != t_block_exp(el, a, m);
  }
  CHECK(fails == 0);
}

/* Random tensors, e4m3 and e5m2, blocks of 16, 32 and 128, one group or groups of 1, 2 or 4 blocks:
 * every code, byte, mantissa and decoded value against the independent implementation; the cases
 * (m_b < m_g, m_b == m_g, zero blocks, clamped blocks) all occur; and the saturation guarantee:
 * |x| scale <= qmax (1 + 2^-24) exactly (the bound is reached only when m_b == m_g, through s_b's
 * own rounding), so the fp32 product is at most one fp32 step above qmax and rounds to qmax: no
 * element relies on the codec's saturation. */
NVL_TEST(gam_random_vs_independent) {
  static float x[1 << 14];
  const int Bs[3] = {16, 32, 128};
  stats st = {0};
  int fails = 0;
  rng_state = 2026;
  for (int t = 0; t < 96; t++) {
    int B = Bs[t % 3];
    int64_t R = 4, K = B * (1 + (int64_t)(t % 4)), nb = R * (K / B);
    int64_t G = (t / 3) % 4 == 3 ? 0 : (int64_t)1 << ((t / 3) % 4 % 3); /* 1, 2, 4 or the tensor */
    if (G && nb % G) G = 0;
    random_tensor(x, nb, B, G);
    fails += compare(x, R, K, B, G, NVL_ELEM_E4M3, &st);
    fails += compare(x, R, K, B, G, NVL_ELEM_E5M2, &st);
  }
  CHECK(fails == 0);
  CHECK(st.below > 0 && st.equal > 0 && st.zero > 0 && st.clamped > 0);
  CHECK(st.worst <= 1.0 + 0x1p-24);
  printf("  %ld blocks (%ld m_b < m_g, %ld m_b == m_g, %ld zero, %ld clamped), %ld elements: max |x| scale / qmax "
         "= 1 + %.3g, %ld fp32 products above qmax\n",
         st.blocks, st.below, st.equal, st.zero, st.clamped, st.elems, st.worst - 1.0, st.over_qmax);
}

/* NaN and inf: not an error (NUMERICS §8): NaN codes, saturated infinities, the group of an inf gets
 * m_g = 1 and its block e_b = -127; NaN is ignored by the maxima; *nonfinite reports either. */
NVL_TEST(gam_nonfinite) {
  float x[16] = {3.0f, NAN, -1.0f, 0.5f, -NAN, 0.0f, 0.0f, 0.0f, /* group 0: NaN ignored; NaN in a zero block */
                 1.0f, INFINITY, -2.0f, 0.25f, 2.0f, -INFINITY, 0.5f, 1e30f}; /* group 1: infinities */
  uint8_t codes[16], scales[4];
  float mant[2], y[16];
  int nonfinite = 0;
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, &nonfinite, x, 2, 8, 4, 2, NVL_ELEM_E4M3) == NVL_OK);
  CHECK(nonfinite == 1);
  CHECK(mant[0] == (float)(7.0 / 6.0)); /* gamax 3, the NaN ignored */
  CHECK(mant[1] == 1.0f);               /* gamax inf */
  CHECK_EQ_U32(scales[0], 127 - 7);
  CHECK_EQ_U32(scales[1], 127 - 127); /* zeros and a NaN: a zero block */
  CHECK_EQ_U32(scales[2], 127 + 127); /* an inf: E8M0 254 */
  CHECK_EQ_U32(scales[3], 127 + 127);
  CHECK_EQ_U32(codes[1], 0x7F);
  CHECK_EQ_U32(codes[4], 0xFF);
  CHECK_EQ_U32(codes[9], 0x7E);  /* inf -> 448 */
  CHECK_EQ_U32(codes[13], 0xFE); /* -inf -> -448 */
  /* finite values in an inf block: x 2^-127, 1e30 2^-127 = 5.9e-9 -> 0 */
  CHECK_EQ_U32(codes[15], 0x00);
  CHECK(nvl_gam_dequantize_ref(y, codes, scales, mant, 2, 8, 4, 2, NVL_ELEM_E4M3) == NVL_OK);
  /* +-448 2^127 is beyond fp32: the saturated infinities decode to infinities again */
  CHECK(isnan(y[1]) && isnan(y[4]) && y[9] == INFINITY && y[13] == -INFINITY);
  stats st = {0};
  CHECK(compare(x, 2, 8, 4, 2, NVL_ELEM_E4M3, &st) == 0);
  CHECK(compare(x, 2, 8, 4, 2, NVL_ELEM_E5M2, &st) == 0);
  x[1] = x[4] = x[9] = x[13] = 1.0f;
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, &nonfinite, x, 2, 8, 4, 2, NVL_ELEM_E4M3) == NVL_OK);
  CHECK(nonfinite == 0);
}

/* Blocks of 32 are MXFP8 blocks: the codes with the bytes 127 - e_b decode through the MX reference
 * (value 2^(byte - 127)) to the GEMM operand value 2^-e_b, and the GAM decode is that over m_g,
 * one rounding. The operand is a bf16 value wherever its quantum, 2^(-9 - e_b) (e4m3) or 2^(-16 - e_b)
 * (e5m2), is at least bf16's smallest subnormal 2^-133: e_b <= 124 (e4m3), <= 117 (e5m2). */
NVL_TEST(gam_mx_operand) {
  static float x[8 * 128], op[8 * 128], y[8 * 128];
  static uint8_t codes[8 * 128], scales[32];
  float mant[1];
  rng_state = 34;
  for (int e = 0; e < 2; e++) {
    nvl_elem el = e ? NVL_ELEM_E5M2 : NVL_ELEM_E4M3;
    int emax_bf16 = e ? 117 : 124;
    for (int i = 0; i < 8 * 128; i++) x[i] = rnd(-126 + (i / 32) * 7, -106 + (i / 32) * 7); /* maxima 2^-106 .. 2^112 */
    CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 8, 128, 32, 0, el) == NVL_OK);
    CHECK(nvl_mx_dequantize_ref(op, codes, scales, 8, 128, el) == NVL_OK);
    CHECK(nvl_gam_dequantize_ref(y, codes, scales, mant, 8, 128, 32, 0, el) == NVL_OK);
    int fails = 0, bf16_blocks = 0;
    for (int i = 0; i < 8 * 128; i++) {
      int eb = nvl_gam_exp_of_e8m0(scales[i / 32]);
      fails += (double)op[i] != t_value(el, codes[i]) * ldexp(1, -eb);
      fails += y[i] != (float)((long double)op[i] / (long double)mant[0]);
      if (eb <= emax_bf16) fails += nvl_bf16_to_f32(nvl_f32_to_bf16(op[i])) != op[i];
      bf16_blocks += i % 32 == 0 && eb <= emax_bf16;
    }
    CHECK(fails == 0);
    CHECK(bf16_blocks > 16);
  }
}

NVL_TEST(gam_bad_arguments) {
  float x[64] = {0}, mant[4];
  uint8_t codes[64], scales[8];
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 2, 32, 32, 0, NVL_ELEM_E2M1) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "gam_quantize_ref") && strstr(nvl_last_error(), "e4m3, e5m2"));
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 2, 32, 24, 0, NVL_ELEM_E4M3) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "[2,32] is not a whole number of 1x24 blocks") != NULL);
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 2, 32, 0, 0, NVL_ELEM_E4M3) == NVL_EINVAL);
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 3, 16, 8, 4, NVL_ELEM_E4M3) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "6 blocks of 1x8 do not split into groups of 4 blocks") != NULL);
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 2, 32, 16, -1, NVL_ELEM_E4M3) == NVL_EINVAL);
  CHECK(nvl_gam_dequantize_ref(x, codes, scales, mant, 2, 32, 16, 3, NVL_ELEM_E5M2) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "gam_dequantize_ref") != NULL);
  /* an empty tensor is fine */
  CHECK(nvl_gam_quantize_ref(codes, scales, mant, NULL, x, 0, 32, 32, 0, NVL_ELEM_E4M3) == NVL_OK);
}
