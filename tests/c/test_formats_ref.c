/* test_formats_ref.c: the scalar reference codecs and quantizers (kernels/cpu/ref/formats_ref.c)
 * against core/NUMERICS.md: exhaustive 8-bit and 4-bit codecs, every rounding tie, saturation,
 * NaN/inf, subnormals, -0; stochastic-rounding properties; RHT orthogonality; the 2D
 * transpose property; and every case of tests/golden/formats.txt (made by an independent
 * implementation, scripts/gen_golden_formats.py) reproduced bit for bit. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ref/formats_ref.h"
#include "unit.h"

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* Same value and same sign (so -0 != +0); NaN == NaN. */
static int same(float a, float b) { return (isnan(a) && isnan(b)) || (a == b && !signbit(a) == !signbit(b)); }

/* ---- fp8 codecs, exhaustively ------------------------------------------------------------- */

/* The value of an e4m3 code from its fields, written out independently of formats_ref.c. */
static double e4m3_value(int c) {
  int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return NAN;
  double v = e == 0 ? m * ldexp(1, -9) : (8 + m) * ldexp(1, e - 10);
  return s ? -v : v;
}

static double e5m2_value(int c) {
  int s = c >> 7, e = (c >> 2) & 31, m = c & 3;
  if (e == 31) return m ? NAN : (s ? -INFINITY : INFINITY);
  double v = e == 0 ? m * ldexp(1, -16) : (4 + m) * ldexp(1, e - 17);
  return s ? -v : v;
}

NVL_TEST(formats_e4m3_all_codes) {
  for (int c = 0; c < 256; c++) {
    float v = nvl_e4m3_decode_ref((uint8_t)c);
    double want = e4m3_value(c);
    CHECK(isnan(want) ? isnan(v) : same(v, (float)want));
    if ((c & 0x7F) == 0x7F) continue;
    CHECK_EQ_U32(nvl_e4m3_encode_ref(v), c);  /* every non-NaN code is canonical, 0x80 (-0) too */
  }
  /* monotone over the positive codes */
  for (int c = 0; c < 0x7E; c++) CHECK(nvl_e4m3_decode_ref((uint8_t)c) < nvl_e4m3_decode_ref((uint8_t)(c + 1)));
  CHECK(nvl_e4m3_decode_ref(0x7E) == 448.0f);
  CHECK(nvl_e4m3_decode_ref(0x01) == ldexpf(1, -9));
  CHECK(nvl_e4m3_decode_ref(0x08) == ldexpf(1, -6));
}

NVL_TEST(formats_e5m2_all_codes) {
  for (int c = 0; c < 256; c++) {
    float v = nvl_e5m2_decode_ref((uint8_t)c);
    double want = e5m2_value(c);
    CHECK(isnan(want) ? isnan(v) : same(v, (float)want));
    if ((c & 0x7F) >= 0x7C) continue;  /* inf and NaN codes: not canonical (satfinite) */
    CHECK_EQ_U32(nvl_e5m2_encode_ref(v), c);
  }
  for (int c = 0; c < 0x7B; c++) CHECK(nvl_e5m2_decode_ref((uint8_t)c) < nvl_e5m2_decode_ref((uint8_t)(c + 1)));
  CHECK(nvl_e5m2_decode_ref(0x7B) == 57344.0f);
  CHECK(isinf(nvl_e5m2_decode_ref(0x7C)) && nvl_e5m2_decode_ref(0x7C) > 0);
  CHECK(isinf(nvl_e5m2_decode_ref(0xFC)) && nvl_e5m2_decode_ref(0xFC) < 0);
  CHECK(nvl_e5m2_decode_ref(0x01) == ldexpf(1, -16));
}

/* Every midpoint between neighbouring codes goes to the even code; one ulp either side goes to
 * the nearer code; the same for negatives. */
static void check_ties(int *nvl_failed_, uint8_t (*enc)(float), float (*dec)(uint8_t), int last) {
  for (int c = 0; c < last; c++) {
    float lo = dec((uint8_t)c), hi = dec((uint8_t)(c + 1));
    float mid = (lo + hi) / 2;
    CHECK((double)mid == ((double)lo + (double)hi) / 2);  /* the midpoint is exact in fp32 */
    int even = (c % 2 == 0) ? c : c + 1;
    CHECK_EQ_U32(enc(mid), even);
    CHECK_EQ_U32(enc(-mid), 0x80 | even);
    CHECK_EQ_U32(enc(nextafterf(mid, 0)), c);
    CHECK_EQ_U32(enc(nextafterf(mid, INFINITY)), c + 1);
    CHECK_EQ_U32(enc(-nextafterf(mid, INFINITY)), 0x80 | (c + 1));
  }
}

NVL_TEST(formats_fp8_ties) {
  check_ties(nvl_failed_, nvl_e4m3_encode_ref, nvl_e4m3_decode_ref, 0x7D);
  check_ties(nvl_failed_, nvl_e5m2_encode_ref, nvl_e5m2_decode_ref, 0x7A);
}

NVL_TEST(formats_fp8_saturation_nan_subnormal) {
  /* e4m3: 448 max; 464 (the tie toward the non-existent 480) and everything above saturate */
  CHECK_EQ_U32(nvl_e4m3_encode_ref(464.0f), 0x7E);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(nextafterf(464.0f, 0)), 0x7E);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(480.0f), 0x7E);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(1e30f), 0x7E);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(FLT_MAX), 0x7E);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(INFINITY), 0x7E);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(-INFINITY), 0xFE);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(-500.0f), 0xFE);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(NAN), 0x7F);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(-NAN), 0xFF);
  CHECK(isnan(nvl_e4m3_decode_ref(0x7F)) && isnan(nvl_e4m3_decode_ref(0xFF)));
  /* subnormals: smallest 2^-9; 2^-10 is a tie and rounds to 0 (even); 3*2^-10 ties up to 2*2^-9 */
  CHECK_EQ_U32(nvl_e4m3_encode_ref(ldexpf(1, -9)), 0x01);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(ldexpf(1, -10)), 0x00);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(nextafterf(ldexpf(1, -10), 1)), 0x01);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(-ldexpf(1, -10)), 0x80);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(3 * ldexpf(1, -10)), 0x02);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(7 * ldexpf(1, -9)), 0x07);  /* largest subnormal */
  CHECK_EQ_U32(nvl_e4m3_encode_ref(15 * ldexpf(1, -10)), 0x08); /* tie with 2^-6: even */
  CHECK_EQ_U32(nvl_e4m3_encode_ref(1e-45f), 0x00);
  CHECK_EQ_U32(nvl_e4m3_encode_ref(-1e-45f), 0x80);
  /* -0 */
  CHECK_EQ_U32(nvl_e4m3_encode_ref(-0.0f), 0x80);
  CHECK(same(nvl_e4m3_decode_ref(0x80), -0.0f));
  CHECK_EQ_U32(nvl_e5m2_encode_ref(-0.0f), 0x80);
  /* e5m2: satfinite, inf included; 61440 is the tie toward the inf code */
  CHECK_EQ_U32(nvl_e5m2_encode_ref(61440.0f), 0x7B);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(65536.0f), 0x7B);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(INFINITY), 0x7B);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(-INFINITY), 0xFB);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(NAN), 0x7F);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(-NAN), 0xFF);
  for (int c = 0x7D; c <= 0x7F; c++) CHECK(isnan(nvl_e5m2_decode_ref((uint8_t)c)) && isnan(nvl_e5m2_decode_ref((uint8_t)(c | 0x80))));
  CHECK_EQ_U32(nvl_e5m2_encode_ref(ldexpf(1, -16)), 0x01);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(ldexpf(1, -17)), 0x00);
  CHECK_EQ_U32(nvl_e5m2_encode_ref(3 * ldexpf(1, -17)), 0x02);
  /* the dispatching helpers */
  CHECK(nvl_elem_max_ref(NVL_ELEM_E4M3) == 448.0f && nvl_elem_max_ref(NVL_ELEM_E5M2) == 57344.0f);
  CHECK(nvl_elem_emax_ref(NVL_ELEM_E4M3) == 8 && nvl_elem_emax_ref(NVL_ELEM_E5M2) == 15);
  CHECK_EQ_U32(nvl_elem_encode_ref(NVL_ELEM_E5M2, 3.0f), nvl_e5m2_encode_ref(3.0f));
}

NVL_TEST(formats_ue4m3) {
  for (int c = 0; c < 256; c++) {
    float v = nvl_ue4m3_decode_ref((uint8_t)c);
    CHECK(same(v, nvl_e4m3_decode_ref((uint8_t)(c & 0x7F))));  /* sign bit ignored */
    if (c < 0x7F) CHECK_EQ_U32(nvl_ue4m3_encode_ref(v), c);
  }
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(0.0f), 0x00);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(-0.0f), 0x00);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(-3.0f), 0x00);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(464.0f), 0x7E);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(FLT_MAX), 0x7E);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(INFINITY), 0x7E);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(NAN), 0x7F);
  CHECK_EQ_U32(nvl_ue4m3_encode_ref(ldexpf(1, -10)), 0x00);
}

/* ---- e8m0 and the MX scale rules ---------------------------------------------------------- */

NVL_TEST(formats_e8m0) {
  for (int c = 0; c < 255; c++) CHECK((double)nvl_e8m0_decode_ref((uint8_t)c) == ldexp(1.0, c - 127));
  CHECK(isnan(nvl_e8m0_decode_ref(0xFF)));
  /* rceil: a block max that is 448 * 2^(c-127) gives exactly c; one ulp above gives c + 1 */
  for (int c = 0; c < 255; c++) {
    float bmax = nvl_e8m0_decode_ref((uint8_t)c) * 448.0f;
    if (isinf(bmax)) continue;
    CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(bmax, 448.0f), c);
    if (c >= 1 && c < 254) CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(nextafterf(bmax, INFINITY), 448.0f), c + 1);
    float b5 = nvl_e8m0_decode_ref((uint8_t)c) * 57344.0f;
    if (!isinf(b5)) CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(b5, 57344.0f), c);
  }
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(0.0f, 448.0f), 0);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(INFINITY, 448.0f), 254);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(FLT_MAX, 448.0f), 127 + 120);  /* FLT_MAX/448 in (2^119, 2^120] */
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(1e-45f, 448.0f), 0);          /* underflows to 0 */
  /* subnormal quotients: 2^-127 still fits code 0, anything above needs code 1 */
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(ldexpf(1, -127), 1.0f), 0);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(ldexpf(1, -130), 1.0f), 0);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(nextafterf(ldexpf(1, -127), 1), 1.0f), 1);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(ldexpf(1, -126), 1.0f), 1);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(1.0f, 1.0f), 127);
  CHECK_EQ_U32(nvl_e8m0_scale_rceil_ref(1.5f, 1.0f), 128);
  /* floor (OCP): 2^(floor(log2 bmax) - emax) */
  for (int p = -126; p < 127; p++) {
    float b = ldexpf(1, p);
    int want = p - 8 + 127;
    want = want < 0 ? 0 : want > 254 ? 254 : want;
    CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(b, 8), want);
    CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(b * 1.75f, 8), want);
    int want5 = p - 15 + 127 < 0 ? 0 : p - 15 + 127;
    CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(b, 15), want5);
  }
  CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(448.0f, 8), 127);   /* 448 = 1.75 * 2^8 */
  CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(0.0f, 8), 0);
  CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(1e-45f, 8), 0);
  CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(FLT_MAX, 8), 127 - 8 + 127);
  CHECK_EQ_U32(nvl_e8m0_scale_floor_ref(INFINITY, 8), 254);
}

/* ---- e2m1 ---------------------------------------------------------------------------------- */

NVL_TEST(formats_e2m1_codes_and_ties) {
  static const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; c++) {
    float v = nvl_e2m1_decode_ref((uint8_t)c);
    CHECK(same(v, (c & 8) ? -mag[c & 7] : mag[c & 7]));
    CHECK_EQ_U32(nvl_e2m1_encode_ref(v), c);
  }
  /* NUMERICS §1: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 */
  static const struct { float x; int code; } ties[] = {
    {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6}};
  for (int i = 0; i < 7; i++) {
    float t = ties[i].x;
    CHECK_EQ_U32(nvl_e2m1_encode_ref(t), ties[i].code);
    CHECK_EQ_U32(nvl_e2m1_encode_ref(-t), 8 | ties[i].code);
    /* just off the tie: the nearer neighbour */
    float lo = nextafterf(t, 0), hi = nextafterf(t, INFINITY);
    CHECK(nvl_e2m1_decode_ref(nvl_e2m1_encode_ref(lo)) < t);
    CHECK(nvl_e2m1_decode_ref(nvl_e2m1_encode_ref(hi)) > t);
    CHECK(nvl_e2m1_decode_ref(nvl_e2m1_encode_ref(-hi)) < -t);
  }
  /* midpoints are ties going to the even code (mantissa bit 0) */
  for (int c = 0; c < 7; c++) {
    float mid = (mag[c] + mag[c + 1]) / 2;
    CHECK_EQ_U32(nvl_e2m1_encode_ref(mid), c % 2 ? c + 1 : c);
  }
  CHECK_EQ_U32(nvl_e2m1_encode_ref(5.5f), 7);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(6.0f), 7);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(7.0f), 7);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(1e30f), 7);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(INFINITY), 7);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(-INFINITY), 15);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(NAN), 6);   /* NaN -> +6 */
  CHECK_EQ_U32(nvl_e2m1_encode_ref(-NAN), 6);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(-0.1f), 8); /* negative rounding to zero -> -0 */
  CHECK_EQ_U32(nvl_e2m1_encode_ref(-0.25f), 8);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(-0.0f), 8);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(0.1f), 0);
  CHECK_EQ_U32(nvl_e2m1_encode_ref(-1e-45f), 8);
}

NVL_TEST(formats_e2m1_pack) {
  uint8_t codes[7] = {1, 2, 15, 8, 0, 7, 9}, packed[4], back[7];
  nvl_e2m1_pack_ref(packed, codes, 7);
  CHECK_EQ_U32(packed[0], 0x21);  /* lower index in the low nibble */
  CHECK_EQ_U32(packed[1], 0x8F);
  CHECK_EQ_U32(packed[2], 0x70);
  CHECK_EQ_U32(packed[3], 0x09);  /* odd n: high nibble of the last byte is 0 */
  nvl_e2m1_unpack_ref(back, packed, 7);
  for (int i = 0; i < 7; i++) CHECK_EQ_U32(back[i], codes[i]);
}

/* ---- stochastic rounding ------------------------------------------------------------------ */

/* Grid spacing of e2m1 around magnitude a (the "step" of NUMERICS §3). */
static float sr_step(float a) { return a >= 4 ? 2.0f : (a >= 2 ? 1.0f : 0.5f); }

NVL_TEST(formats_sr_unbiased_exact_on_grid) {
  /* For |x| <= 6 on the grid of step/256 (step/256 = 2^-9 below 2, 2^-8 in [2,4), 2^-7 in
   * [4,6]), t = |x| + u*step is exact and floor((k + r)/256) averages to k/256 over the 256
   * values of r, also across a binade edge (where the coarser step lands on the edge itself):
   * the mean of decode(sr(x, r)) over all r is exactly x. */
  int n = 0;
  for (float a = 0.0f; a <= 6.0f; a += sr_step(a) / 256.0f) {
    for (int s = 0; s < 2; s++) {
      float x = s ? -a : a;
      double sum = 0;
      for (int r = 0; r < 256; r++) sum += nvl_e2m1_decode_ref(nvl_e2m1_encode_sr_ref(x, (uint8_t)r));
      if (sum / 256 != (double)x) {
        fprintf(stderr, "  sr mean at x = %a: %a\n", x, sum / 256);
        CHECK(0);
      }
      n++;
    }
  }
  CHECK(n == 2 * (4 * 256 + 2 * 256 + 1 * 256 + 1));
}

NVL_TEST(formats_sr_bounds) {
  /* Off the grid the mean is biased by less than step/256 (8-bit r: it truncates |x| to the
   * step/256 grid; the one fp32 rounding in fmaf can move one r across); every result is one of
   * the two neighbours of x; r = 0 truncates toward zero; representable x are returned as is. */
  uint32_t st = 12345;
  for (int i = 0; i < 20000; i++) {
    st = st * 1664525u + 1013904223u;
    float x = ((float)(st >> 8) / 16777216.0f * 2 - 1) * 6.0f;
    float a = fabsf(x), step = sr_step(a);
    float down = nvl_e2m1_decode_ref(nvl_e2m1_encode_sr_ref(a, 0));
    CHECK(down <= a && a - down < step);
    double sum = 0;
    for (int r = 0; r < 256; r++) {
      float q = nvl_e2m1_decode_ref(nvl_e2m1_encode_sr_ref(x, (uint8_t)r));
      CHECK(!signbit(q) == !signbit(x));
      CHECK(fabsf(q) == down || (fabsf(q) > a && fabsf(q) - down <= 2 * step));
      sum += q;
    }
    CHECK(fabs(sum / 256 - x) <= step / 256.0);
  }
  for (int c = 0; c < 16; c++) {
    float v = nvl_e2m1_decode_ref((uint8_t)c);
    for (int r = 0; r < 256; r++) CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(v, (uint8_t)r), c);
  }
  CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(NAN, 7), 6);
  CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(7.0f, 255), 7);
  CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(-INFINITY, 0), 15);
  CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(-0.1f, 0), 8);
  CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(0.25f, 127), 0);  /* 0.25 + 127/512 < 0.5 */
  CHECK_EQ_U32(nvl_e2m1_encode_sr_ref(0.25f, 128), 1);
}

/* ---- RHT ----------------------------------------------------------------------------------- */

NVL_TEST(formats_rht_orthogonal) {
  float R[16][16];
  for (int i = 0; i < 16; i++) {
    float e[16] = {0};
    e[i] = 1;
    nvl_rht16_ref(R[i], e, NULL);  /* e_i . R = row i of R */
    for (int j = 0; j < 16; j++) {
      float h = (__builtin_popcount(i & j) % 2) ? -0.25f : 0.25f;
      CHECK(R[i][j] == nvl_rht16_default_signs[i] * h);
    }
  }
  for (int i = 0; i < 16; i++)
    for (int k = 0; k < 16; k++) {
      double d = 0;
      for (int j = 0; j < 16; j++) d += (double)R[i][j] * R[k][j];
      CHECK(d == (i == k ? 1.0 : 0.0));  /* R R^T = I, exactly */
    }
  static const float sd[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};
  for (int i = 0; i < 16; i++) CHECK(nvl_rht16_default_signs[i] == sd[i]);
  /* norms and dot products are preserved (fp32 rounding only) */
  uint32_t st = 7;
  float a[64], b[64], ta[64], tb[64];
  for (int i = 0; i < 64; i++) {
    st = st * 1664525u + 1013904223u;
    a[i] = (float)(st >> 8) / 16777216.0f - 0.5f;
    st = st * 1664525u + 1013904223u;
    b[i] = (float)(st >> 8) / 16777216.0f - 0.5f;
  }
  CHECK(nvl_rht16_rows_ref(ta, a, 2, 32, NULL) == NVL_OK);
  memcpy(tb, b, sizeof b);
  CHECK(nvl_rht16_rows_ref(tb, tb, 4, 16, NULL) == NVL_OK);  /* in place */
  double dab = 0, dt = 0, na = 0, nt = 0;
  for (int i = 0; i < 64; i++) {
    dab += (double)a[i] * b[i];
    dt += (double)ta[i] * tb[i];
    na += (double)a[i] * a[i];
    nt += (double)ta[i] * ta[i];
  }
  CHECK(fabs(dab - dt) < 1e-5 && fabs(na - nt) < 1e-5 * na);
  /* the inverse is R^T: x = y R^T */
  for (int c = 0; c < 4; c++)
    for (int i = 0; i < 16; i++) {
      double x = 0;
      for (int j = 0; j < 16; j++) x += (double)ta[16 * c + j] * R[i][j];
      CHECK(fabs(x - a[16 * c + i]) < 1e-6);
    }
  /* nvl_rht16_inverse_ref is that x R^T: e_i R^T = column i of R, exactly (+-1/4 sums of one term);
   * and it undoes the RHT within fp32 rounding (4 butterfly roundings each side) */
  for (int i = 0; i < 16; i++) {
    float e[16] = {0}, col[16];
    e[i] = 1;
    nvl_rht16_inverse_ref(col, e, NULL);
    for (int j = 0; j < 16; j++) CHECK(col[j] == R[j][i]);
  }
  for (int c = 0; c < 4; c++) {
    float back[16];
    nvl_rht16_inverse_ref(back, ta + 16 * c, NULL);
    for (int i = 0; i < 16; i++) CHECK(fabsf(back[i] - a[16 * c + i]) < 1e-6f);
  }
  /* an explicit sign vector */
  float ones[16], e3[16] = {0}, y[16];
  for (int i = 0; i < 16; i++) ones[i] = 1;
  e3[3] = 1;
  nvl_rht16_ref(y, e3, ones);
  CHECK(y[0] == 0.25f && y[1] == -0.25f && y[2] == -0.25f && y[3] == 0.25f && y[4] == 0.25f && y[7] == 0.25f);
  CHECK(nvl_rht16_rows_ref(ta, a, 1, 24, NULL) == NVL_EINVAL);
}

/* ---- quantizers: properties --------------------------------------------------------------- */

static void fill(float *x, int64_t n, uint32_t seed, float scale) {
  uint32_t st = seed;
  for (int64_t i = 0; i < n; i++) {
    st = st * 1664525u + 1013904223u;
    float u = (float)(st >> 8) / 16777216.0f - 0.5f;
    x[i] = u * scale * (float)(1 + (i / 16) % 5);  /* block magnitudes vary */
  }
}

NVL_TEST(formats_nvfp4_2d_transpose) {
  enum { R = 32, K = 48 };
  static float w[R * K], wt[K * R], y[R * K], yt[K * R];
  static uint8_t c[R * K], ct[K * R], s[R * K / 16], stt[K * R / 16];
  fill(w, R * K, 99, 3.0f);
  for (int r = 0; r < R; r++)
    for (int k = 0; k < K; k++) wt[k * R + r] = w[r * K + k];
  float amax, amaxt;
  CHECK(nvl_nvfp4_quantize_2d_ref(c, s, &amax, w, R, K, NULL) == NVL_OK);
  CHECK(nvl_nvfp4_quantize_2d_ref(ct, stt, &amaxt, wt, K, R, NULL) == NVL_OK);
  CHECK(amax == amaxt);
  int bad = 0;
  for (int r = 0; r < R; r++)
    for (int k = 0; k < K; k++) {
      bad += c[r * K + k] != ct[k * R + r];
      bad += s[r * (K / 16) + k / 16] != stt[k * (R / 16) + r / 16];
      bad += s[r * (K / 16) + k / 16] != s[(r - r % 16) * (K / 16) + k / 16];  /* same down a tile */
    }
  CHECK(bad == 0);
  CHECK(nvl_nvfp4_dequantize_ref(y, c, s, amax, R, K) == NVL_OK);
  CHECK(nvl_nvfp4_dequantize_ref(yt, ct, stt, amaxt, K, R) == NVL_OK);
  for (int r = 0; r < R; r++)
    for (int k = 0; k < K; k++) bad += f2u(y[r * K + k]) != f2u(yt[k * R + r]);
  CHECK(bad == 0);
  /* shapes that are not whole tiles are refused */
  CHECK(nvl_nvfp4_quantize_2d_ref(c, s, &amax, w, 8, K, NULL) == NVL_EINVAL);
  CHECK(nvl_nvfp4_quantize_1d_ref(c, s, &amax, w, 1, 17, NULL) == NVL_EINVAL);
  CHECK(nvl_mx_quantize_ref(c, s, w, 1, 48, NVL_ELEM_E4M3, NVL_MX_RCEIL, NULL) == NVL_EINVAL);
  CHECK(nvl_mx_quantize_ref(c, s, w, 1, 32, (nvl_elem)7, NVL_MX_RCEIL, NULL) == NVL_EINVAL);
}

NVL_TEST(formats_nvfp4_scales_and_zeros) {
  CHECK(nvl_nvfp4_enc_scale_ref(0.0f) == 1.0f);
  CHECK(nvl_nvfp4_enc_scale_ref(INFINITY) == 1.0f);
  CHECK(nvl_nvfp4_enc_scale_ref(NAN) == 1.0f);
  CHECK(nvl_nvfp4_enc_scale_ref(2688.0f) == 1.0f);
  CHECK(nvl_nvfp4_enc_scale_ref(1e-37f) == FLT_MAX);
  CHECK(nvl_nvfp4_dec_scale_ref(2688.0f) == 1.0f);
  CHECK(nvl_nvfp4_dec_scale_ref(0.0f) == 1.0f);
  CHECK(nvl_nvfp4_dec_scale_ref(1e-37f) == 1.0f / FLT_MAX);
  CHECK(nvl_nvfp4_dec_scale_ref(3.0f) == 3.0f / 2688.0f);
  CHECK_EQ_U32(nvl_nvfp4_block_scale_ref(0.0f, 5.0f), 0);
  CHECK_EQ_U32(nvl_nvfp4_block_scale_ref(6.0f, 1.0f), 0x38);   /* 6 * (1/6) rounds to 1.0 */
  CHECK_EQ_U32(nvl_nvfp4_block_scale_ref(1e30f, 1e30f), 0x7E); /* FLT_MAX cap, then satfinite */
  /* a block max of amax gets the stored scale 448 and its largest element maps to 6 */
  float x[32], y[32];
  uint8_t c[32], s[2];
  float amax;
  fill(x, 32, 5, 1.0f);
  for (int i = 16; i < 32; i++) x[i] = 0;  /* an all-zero block */
  CHECK(nvl_nvfp4_quantize_1d_ref(c, s, &amax, x, 1, 32, NULL) == NVL_OK);
  CHECK_EQ_U32(s[0], 0x7E);
  CHECK_EQ_U32(s[1], 0x00);
  for (int i = 16; i < 32; i++) CHECK_EQ_U32(c[i], 0);
  int has6 = 0;
  for (int i = 0; i < 16; i++) has6 |= (c[i] & 7) == 7;
  CHECK(has6);
  CHECK(nvl_nvfp4_dequantize_ref(y, c, s, amax, 1, 32) == NVL_OK);
  for (int i = 0; i < 32; i++) CHECK(fabsf(y[i] - x[i]) <= amax / 6.0f * 1.0001f);  /* half of the top step 2 * 448 * s_dec */
  /* all-zero tensor: amax 0, s_enc 1, all codes and scales 0, decodes to 0 */
  memset(x, 0, sizeof x);
  CHECK(nvl_nvfp4_quantize_1d_ref(c, s, &amax, x, 2, 16, NULL) == NVL_OK);
  CHECK(amax == 0.0f && s[0] == 0 && s[1] == 0);
  for (int i = 0; i < 32; i++) CHECK_EQ_U32(c[i], 0);
  CHECK(nvl_nvfp4_dequantize_ref(y, c, s, amax, 2, 16) == NVL_OK);
  for (int i = 0; i < 32; i++) CHECK_EQ_U32(f2u(y[i]), 0);
}

NVL_TEST(formats_nvfp4_sr_stream) {
  /* SR is deterministic in (seed, offset), draws block g from Philox counter g, and differs
   * between offsets; on values that need no rounding it equals RNE. */
  enum { R = 4, K = 64 };
  static float x[R * K];
  static uint8_t a[R * K], b[R * K], c[R * K], s1[R * K / 16], s2[R * K / 16];
  fill(x, R * K, 3, 2.0f);
  nvl_quant_ref_opts o = {.sr = 1, .seed = 1234, .offset = 5};
  float amax;
  CHECK(nvl_nvfp4_quantize_1d_ref(a, s1, &amax, x, R, K, &o) == NVL_OK);
  CHECK(nvl_nvfp4_quantize_1d_ref(b, s2, &amax, x, R, K, &o) == NVL_OK);
  CHECK(memcmp(a, b, sizeof a) == 0);
  o.offset = 6;
  CHECK(nvl_nvfp4_quantize_1d_ref(c, s2, &amax, x, R, K, &o) == NVL_OK);
  CHECK(memcmp(a, c, sizeof a) != 0);
  CHECK(memcmp(s1, s2, sizeof s1) == 0);  /* block scales are always RNE */
  /* the last block of the tensor alone, as a 1-row tensor, draws counter 0, not 15 */
  o.offset = 5;
  uint8_t one[16], sone[1];
  nvl_quant_ref_opts og = o;
  og.has_amax = 1;
  og.amax = amax;
  CHECK(nvl_nvfp4_quantize_1d_ref(one, sone, NULL, x + (R * K - 16), 1, 16, &og) == NVL_OK);
  int diff = 0;
  for (int j = 0; j < 16; j++) diff += one[j] != a[R * K - 16 + j];
  CHECK(diff > 0);
  /* values exactly on the grid: SR == RNE */
  float g[16] = {6, 4, 3, 2, 1.5f, 1, 0.5f, 0, -6, -4, -3, -2, -1.5f, -1, -0.5f, 0};
  uint8_t q1[16], q2[16], ss[1];
  nvl_quant_ref_opts ot = {.sr = 1, .seed = 9, .offset = 1, .has_amax = 1, .amax = 2688.0f};
  CHECK(nvl_nvfp4_quantize_1d_ref(q1, ss, NULL, g, 1, 16, &ot) == NVL_OK);
  ot.sr = 0;
  CHECK(nvl_nvfp4_quantize_1d_ref(q2, ss, NULL, g, 1, 16, &ot) == NVL_OK);
  CHECK(memcmp(q1, q2, 16) == 0);
}

NVL_TEST(formats_mxfp8_fp8_properties) {
  enum { R = 2, K = 64 };
  static float x[R * K], y[R * K];
  static uint8_t c[R * K], s[R * K / 32];
  fill(x, R * K, 11, 100.0f);
  /* rceil never needs to saturate: every scaled element is within the element range */
  for (int el = 0; el < 2; el++) {
    CHECK(nvl_mx_quantize_ref(c, s, x, R, K, (nvl_elem)el, NVL_MX_RCEIL, NULL) == NVL_OK);
    CHECK(nvl_mx_dequantize_ref(y, c, s, R, K, (nvl_elem)el) == NVL_OK);
    float tol = el == 0 ? 1.0f / 16 : 1.0f / 8;  /* half an ulp, relative */
    for (int i = 0; i < R * K; i++) {
      float scaled = x[i] * ldexpf(1, 127 - s[i / 32]);
      CHECK(fabsf(scaled) <= nvl_elem_max_ref((nvl_elem)el));
      CHECK(fabsf(y[i] - x[i]) <= tol * fabsf(x[i]) + ldexpf(1, s[i / 32] - 127 - (el == 0 ? 9 : 16)));
    }
  }
  /* fp8 per-tensor scale rule */
  CHECK(nvl_fp8_tensor_scale_ref(0.0f, NVL_ELEM_E4M3) == 1.0f);
  CHECK(nvl_fp8_tensor_scale_ref(INFINITY, NVL_ELEM_E4M3) == 1.0f);
  CHECK(nvl_fp8_tensor_scale_ref(NAN, NVL_ELEM_E5M2) == 1.0f);
  CHECK(nvl_fp8_tensor_scale_ref(448.0f, NVL_ELEM_E4M3) == 1.0f);
  CHECK(nvl_fp8_tensor_scale_ref(1.0f, NVL_ELEM_E5M2) == 57344.0f);
  CHECK(nvl_fp8_tensor_scale_ref(1e-40f, NVL_ELEM_E4M3) == FLT_MAX);
  float sc, am;
  CHECK(nvl_fp8_quantize_tensor_ref(c, &sc, &am, x, R * K, NVL_ELEM_E4M3, NULL) == NVL_OK);
  int has_max = 0;
  for (int i = 0; i < R * K; i++) has_max |= (c[i] & 0x7F) == 0x7E;
  CHECK(has_max && sc == 448.0f / am);
  float given = am / 4;
  CHECK(nvl_fp8_quantize_tensor_ref(c, &sc, &am, x, R * K, NVL_ELEM_E4M3, &given) == NVL_OK);
  CHECK(am == given && sc == 448.0f / given);
  CHECK(nvl_fp8_dequantize_tensor_ref(y, c, sc, R * K, NVL_ELEM_E4M3) == NVL_OK);
  for (int i = 0; i < R * K; i++) CHECK(fabsf(y[i]) <= given * 1.0001f);  /* saturated at the given amax */
}

/* ---- golden vectors ----------------------------------------------------------------------- */

typedef struct {
  char name[96], fmt[16];
  int64_t rows, K, n;
  int rht, sr, has_amax_in, elem, rule, bf16; /* bf16: x is a bf16 operand (dtype=bf16) */
  uint64_t seed, offset;
  float amax_in;
  uint32_t *x, *xt, *y, amax, scale;
  uint8_t *codes, *scales;
  int64_t nx, nxt, ny, ncodes, nscales;
  int has_amax, has_scale;
} golden_case;

static FILE *open_golden(void) {
  const char *paths[] = {
#ifdef NVL_SOURCE_DIR
    NVL_SOURCE_DIR "/tests/golden/formats.txt",
#endif
    "../tests/golden/formats.txt", "tests/golden/formats.txt"};
  for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
    FILE *f = fopen(paths[i], "r");
    if (f) return f;
  }
  return NULL;
}

/* Compare n words; report the first difference. Returns the number of differences. */
static int64_t cmp_u32(const char *cs, const char *what, const uint32_t *want, const uint32_t *got, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++)
    if (want[i] != got[i] && bad++ == 0)
      fprintf(stderr, "  golden %s: %s[%lld] want %08x (%a) got %08x (%a)\n", cs, what, (long long)i, want[i],
              u2f(want[i]), got[i], u2f(got[i]));
  return bad;
}

static int64_t cmp_u8(const char *cs, const char *what, const uint8_t *want, const uint8_t *got, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++)
    if (want[i] != got[i] && bad++ == 0)
      fprintf(stderr, "  golden %s: %s[%lld] want %02x got %02x\n", cs, what, (long long)i, want[i], got[i]);
  return bad;
}

static void round_bf16(float *v, int64_t n) {
  for (int64_t i = 0; i < n; i++) v[i] = nvl_bf16_to_f32(nvl_f32_to_bf16(v[i]));
}

/* Run one parsed case; returns the number of mismatching values (or 1 for a malformed case). */
static int64_t run_golden_case(golden_case *g) {
  int64_t n = g->n, bad = 0;
  const char *cs = g->name;
  if (g->nx != n || g->ncodes != n || g->ny != n) {
    fprintf(stderr, "  golden %s: malformed (x %lld, codes %lld, y %lld of %lld)\n", cs, (long long)g->nx,
            (long long)g->ncodes, (long long)g->ny, (long long)n);
    return 1;
  }
  float *x = malloc(n * sizeof(float)), *xq = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
  uint8_t *codes = malloc(n), *scales = malloc(n / 16 + 1);
  memcpy(x, g->x, n * sizeof(float));
  memcpy(xq, x, n * sizeof(float));
  nvl_status st = NVL_OK;
  if (!strcmp(g->fmt, "nvfp4_1d") || !strcmp(g->fmt, "nvfp4_2d")) {
    int64_t ns = n / 16;
    if (g->rht) {
      st = nvl_rht16_rows_ref(xq, x, g->rows, g->K, NULL);
      if (g->bf16) round_bf16(xq, n); /* NUMERICS §5: a bf16 operand's transform is bf16 (qentry does it) */
      if (g->nxt != n) bad++;
      else bad += cmp_u32(cs, "xt", g->xt, (const uint32_t *)xq, n);
    }
    nvl_quant_ref_opts o = {.sr = g->sr, .seed = g->seed, .offset = g->offset,
                            .has_amax = g->has_amax_in, .amax = g->amax_in};
    float amax = -1;
    if (st == NVL_OK)
      st = (g->fmt[6] == '1' ? nvl_nvfp4_quantize_1d_ref : nvl_nvfp4_quantize_2d_ref)(codes, scales, &amax, xq,
                                                                                     g->rows, g->K, &o);
    if (st == NVL_OK) st = nvl_nvfp4_dequantize_ref(y, codes, scales, amax, g->rows, g->K);
    uint32_t ua = f2u(amax);
    if (st == NVL_OK && g->nscales == ns && g->has_amax) {
      bad += cmp_u8(cs, "codes", g->codes, codes, n);
      bad += cmp_u8(cs, "scales", g->scales, scales, ns);
      bad += cmp_u32(cs, "amax", &g->amax, &ua, 1);
      bad += cmp_u32(cs, "y", g->y, (const uint32_t *)y, n);
    } else {
      bad++;
    }
  } else if (!strcmp(g->fmt, "mxfp8")) {
    int64_t ns = n / 32;
    st = nvl_mx_quantize_ref(codes, scales, x, g->rows, g->K, (nvl_elem)g->elem, (nvl_mx_rule)g->rule, NULL);
    if (st == NVL_OK) st = nvl_mx_dequantize_ref(y, codes, scales, g->rows, g->K, (nvl_elem)g->elem);
    if (st == NVL_OK && g->nscales == ns) {
      bad += cmp_u8(cs, "codes", g->codes, codes, n);
      bad += cmp_u8(cs, "scales", g->scales, scales, ns);
      bad += cmp_u32(cs, "y", g->y, (const uint32_t *)y, n);
    } else {
      bad++;
    }
  } else if (!strcmp(g->fmt, "mxfp4")) {
    int64_t ns = n / 32;
    if (g->rht) {
      st = nvl_rht16_rows_ref(xq, x, g->rows, g->K, NULL);
      if (g->bf16) round_bf16(xq, n); /* NUMERICS §5: a bf16 operand's transform is bf16 (qentry does it) */
      if (g->nxt != n) bad++;
      else bad += cmp_u32(cs, "xt", g->xt, (const uint32_t *)xq, n);
    }
    nvl_quant_ref_opts o = {.sr = g->sr, .seed = g->seed, .offset = g->offset};
    if (st == NVL_OK)
      st = nvl_mx_quantize_ref(codes, scales, xq, g->rows, g->K, NVL_ELEM_E2M1, (nvl_mx_rule)g->rule, &o);
    if (st == NVL_OK) st = nvl_mx_dequantize_ref(y, codes, scales, g->rows, g->K, NVL_ELEM_E2M1);
    if (st == NVL_OK && g->nscales == ns) {
      bad += cmp_u8(cs, "codes", g->codes, codes, n);
      bad += cmp_u8(cs, "scales", g->scales, scales, ns);
      bad += cmp_u32(cs, "y", g->y, (const uint32_t *)y, n);
    } else {
      bad++;
    }
  } else if (!strcmp(g->fmt, "fp8")) {
    float scale = -1, amax = -1;
    st = nvl_fp8_quantize_tensor_ref(codes, &scale, &amax, x, n, (nvl_elem)g->elem,
                                     g->has_amax_in ? &g->amax_in : NULL);
    if (st == NVL_OK) st = nvl_fp8_dequantize_tensor_ref(y, codes, scale, n, (nvl_elem)g->elem);
    uint32_t us = f2u(scale), ua = f2u(amax);
    if (st == NVL_OK && g->has_scale && g->has_amax) {
      bad += cmp_u8(cs, "codes", g->codes, codes, n);
      bad += cmp_u32(cs, "scale", &g->scale, &us, 1);
      bad += cmp_u32(cs, "amax", &g->amax, &ua, 1);
      bad += cmp_u32(cs, "y", g->y, (const uint32_t *)y, n);
    } else {
      bad++;
    }
  } else {
    fprintf(stderr, "  golden %s: unknown format '%s'\n", cs, g->fmt);
    bad++;
  }
  if (st != NVL_OK) fprintf(stderr, "  golden %s: %s\n", cs, nvl_last_error());
  free(x); free(xq); free(y); free(codes); free(scales);
  return bad;
}

static void free_case(golden_case *g) {
  free(g->x); free(g->xt); free(g->y); free(g->codes); free(g->scales);
  memset(g, 0, sizeof *g);
}

NVL_TEST(formats_golden_vectors) {
  FILE *f = open_golden();
  CHECK(f != NULL);
  if (!f) return;
  char line[4096];
  golden_case g;
  memset(&g, 0, sizeof g);
  int in_case = 0, ncases = 0, nfailed = 0, counts[4] = {0};
  while (fgets(line, sizeof line, f)) {
    if (line[0] == '#' || line[0] == '\n') continue;
    char *save = NULL, *key = strtok_r(line, " \n", &save), *tok;
    if (!key) continue;
    if (!strcmp(key, "case")) {
      free_case(&g);
      in_case = 1;
      g.elem = g.rule = -1;
      snprintf(g.name, sizeof g.name, "%s", strtok_r(NULL, " \n", &save));
      snprintf(g.fmt, sizeof g.fmt, "%s", strtok_r(NULL, " \n", &save));
      g.rows = atoll(strtok_r(NULL, " \n", &save));
      g.K = atoll(strtok_r(NULL, " \n", &save));
      g.n = g.rows * g.K;
      g.x = calloc(g.n + 1, 4); g.xt = calloc(g.n + 1, 4); g.y = calloc(g.n + 1, 4);
      g.codes = calloc(g.n + 1, 1); g.scales = calloc(g.n + 1, 1);
      while ((tok = strtok_r(NULL, " \n", &save))) {
        char *eq = strchr(tok, '=');
        if (!eq) continue;
        *eq = 0;
        const char *v = eq + 1;
        if (!strcmp(tok, "elem")) g.elem = !strcmp(v, "e5m2") ? NVL_ELEM_E5M2 : NVL_ELEM_E4M3;
        else if (!strcmp(tok, "rule")) g.rule = !strcmp(v, "floor") ? NVL_MX_FLOOR : NVL_MX_RCEIL;
        else if (!strcmp(tok, "rht")) g.rht = atoi(v);
        else if (!strcmp(tok, "dtype")) g.bf16 = !strcmp(v, "bf16");
        else if (!strcmp(tok, "sr")) g.sr = atoi(v);
        else if (!strcmp(tok, "seed")) g.seed = strtoull(v, NULL, 16);
        else if (!strcmp(tok, "offset")) g.offset = strtoull(v, NULL, 16);
        else if (!strcmp(tok, "amax_in")) { g.has_amax_in = 1; g.amax_in = u2f((uint32_t)strtoul(v, NULL, 16)); }
      }
    } else if (in_case && !strcmp(key, "end")) {
      int64_t bad = run_golden_case(&g);
      ncases++;
      if (bad) nfailed++;
      counts[g.fmt[0] == 'n' ? 0 : g.fmt[0] == 'm' ? 1 : 2]++;
      if (g.sr) counts[3]++;
      if (bad) fprintf(stderr, "  golden %s: %lld values differ\n", g.name, (long long)bad);
      free_case(&g);
      in_case = 0;
    } else if (in_case) {
      uint32_t *w = NULL;
      uint8_t *b = NULL;
      int64_t *cnt = NULL, cap = g.n;
      if (!strcmp(key, "x")) { w = g.x; cnt = &g.nx; }
      else if (!strcmp(key, "xt")) { w = g.xt; cnt = &g.nxt; }
      else if (!strcmp(key, "y")) { w = g.y; cnt = &g.ny; }
      else if (!strcmp(key, "codes")) { b = g.codes; cnt = &g.ncodes; }
      else if (!strcmp(key, "scales")) { b = g.scales; cnt = &g.nscales; }
      else if (!strcmp(key, "amax")) { g.amax = (uint32_t)strtoul(strtok_r(NULL, " \n", &save), NULL, 16); g.has_amax = 1; }
      else if (!strcmp(key, "scale")) { g.scale = (uint32_t)strtoul(strtok_r(NULL, " \n", &save), NULL, 16); g.has_scale = 1; }
      if (cnt)
        while ((tok = strtok_r(NULL, " \n", &save))) {
          if (*cnt >= cap) { (*cnt)++; continue; }  /* too many: reported as malformed */
          unsigned long v = strtoul(tok, NULL, 16);
          if (w) w[(*cnt)++] = (uint32_t)v;
          else b[(*cnt)++] = (uint8_t)v;
        }
    }
  }
  fclose(f);
  free_case(&g);
  CHECK(!in_case);          /* the file ends with a complete case */
  CHECK(nfailed == 0);
  CHECK(ncases >= 40);      /* the file is all there */
  CHECK(counts[0] >= 10 && counts[1] >= 8 && counts[2] >= 6 && counts[3] >= 2);
  CHECK(counts[1] >= 8 + 10); /* mxfp8 and mxfp4 */
  if (nfailed) fprintf(stderr, "  golden: %d of %d cases differ\n", nfailed, ncases);
}
