/* test_quant_cpu.c: the fast CPU quantizers (kernels/cpu/quant_cpu.c) against the scalar
 * references (kernels/cpu/ref/formats_ref.c), bit for bit: codes (nvfp4 unpacked from its packed
 * bytes), block scales, amax and scale bits, dequantized values. Inputs: normal, a wide dynamic
 * range with random signs, values built to land exactly on every e2m1 / fp8 rounding tie after
 * scaling (and one ulp either side), zero blocks, an all-zero tensor, +-inf, NaN, fp32
 * subnormals, block scales that underflow; a strided sweep of the whole fp32 range through the
 * fp8 encoders; every shape class (rows 1..129, K 16..4096), 1D and 2D, RNE and SR with several
 * seeds and offsets, given amax, both MX element formats and scale rules, current and delayed
 * fp8 scaling, the RHT; SR of a slab of a larger tensor (data-parallel offsets); cases big enough to run on several threads; and the whole file built a
 * second time with NVL_QUANT_PORTABLE, so the code paths of machines without AVX2 run here too. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/dequant_cpu.h"
#include "cpu/quant_cpu.h"
#include "cpu/ref/formats_ref.h"
#include "unit.h"

/* ---- the implementation under test ------------------------------------------------------------ */

/* The fast functions, called through this table: normally the library's (on x86-64 they run
 * their AVX2 code); quant_cpu_portable_build at the end switches to the same source built again
 * with NVL_QUANT_PORTABLE (baseline vector code, scalar Philox) and reruns tests with it. */
typedef struct {
  nvl_status (*nvfp4)(uint8_t *, uint8_t *, float *, const float *, int64_t, int64_t, int, const nvl_quant_ref_opts *);
  nvl_status (*nvfp4_deq)(float *, const uint8_t *, const uint8_t *, float, int64_t, int64_t);
  nvl_status (*mxfp8)(uint8_t *, uint8_t *, const float *, int64_t, int64_t, nvl_elem, nvl_mx_rule,
                       const nvl_quant_ref_opts *);
  nvl_status (*fp8)(uint8_t *, float *, float *, const float *, int64_t, nvl_elem, const float *);
  nvl_status (*rht)(float *, const float *, int64_t, int64_t, const float *);
  nvl_status (*rht_bf16)(float *, const uint16_t *, int64_t, int64_t, const float *);
  nvl_status (*rht_inverse)(float *, const float *, int64_t, int64_t, const float *);
  nvl_status (*nvfp4_bf16)(uint8_t *, uint8_t *, float *, const uint16_t *, int64_t, int64_t,
                           const nvl_quant_ref_opts *);
} quant_impl;
static const quant_impl library_impl = {nvl_nvfp4_quantize_cpu, nvl_nvfp4_dequantize_cpu, nvl_mx_quantize_cpu,
                                        nvl_fp8_quantize_tensor_cpu, nvl_rht16_rows_cpu, nvl_rht16_rows_bf16_cpu,
                                        nvl_rht16_rows_inverse_cpu, nvl_nvfp4_quantize_bf16_cpu};
static const quant_impl *impl = &library_impl;

/* ---- inputs ---------------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static float rng_unif(uint64_t *s) { return (float)(rng_next(s) >> 40) * (1.0f / 16777216.0f); } /* [0, 1) */
static int rng_int(uint64_t *s, int lo, int hi) { return lo + (int)(rng_next(s) % (uint64_t)(hi - lo + 1)); }
static float rng_normal(uint64_t *s) {
  float u = rng_unif(s) + 1.0f / 33554432.0f, v = rng_unif(s);
  return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}
static float rng_sign(uint64_t *s) { return (rng_next(s) & 1) ? -1.0f : 1.0f; }

typedef enum {
  D_NORMAL,   /* N(0, 1) */
  D_WIDE,     /* 2^U(-40, 40), random signs */
  D_TIES,     /* nvfp4: every e2m1 tie and its neighbours, exact after scaling */
  D_FP8_TIES, /* fp8 / mxfp8: every midpoint of the element format and its neighbours */
  D_SPECIAL,  /* zero blocks, inf, NaN, fp32 subnormals, block scales that underflow */
  D_COUNT
} dist;
static const char *const dist_names[D_COUNT] = {"normal", "wide", "ties", "fp8_ties", "special"};

/* The e2m1 ties and grid points (NUMERICS §1). */
static const float e2m1_marks[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f,
                                   0.0f,  0.5f,  1.0f,  1.5f,  2.0f, 3.0f, 4.0f, 6.0f};

/* A value on or next to a midpoint of elem's code grid, or a code value, or past the max. */
static float fp8_mark(uint64_t *s, nvl_elem elem) {
  int last = elem == NVL_ELEM_E5M2 ? 0x7B : 0x7E;
  int c = rng_int(s, 0, last - 1);
  float lo = nvl_elem_decode_ref(elem, (uint8_t)c), hi = nvl_elem_decode_ref(elem, (uint8_t)(c + 1));
  float v;
  switch (rng_int(s, 0, 5)) {
    case 0: v = lo; break;
    case 1: v = nextafterf((lo + hi) / 2, 0); break;
    case 2: v = nextafterf((lo + hi) / 2, INFINITY); break;
    default: v = (lo + hi) / 2; break; /* the midpoint is exact in fp32 */
  }
  return v;
}

/* x (R, K) from distribution d. block: the block length whose max the tie constructions pin
 * (16 nvfp4, 32 mxfp8, 0: one scale for the whole tensor, the fp8 per-tensor case). */
static void fill(float *x, int64_t R, int64_t K, dist d, uint64_t seed, nvl_elem elem, int block) {
  uint64_t s = seed * 0x2545F4914F6CDD1Dull + 1;
  switch (d) {
    case D_NORMAL:
      for (int64_t i = 0; i < R * K; i++) x[i] = rng_normal(&s);
      break;
    case D_WIDE:
      for (int64_t i = 0; i < R * K; i++) x[i] = rng_sign(&s) * exp2f(rng_unif(&s) * 80.0f - 40.0f);
      break;
    case D_TIES:
      /* Block (tile, for 2D) with max 6 * 2^k under s_enc = 1: bmax * (1/6) rounds to the scale
       * 2^k, so se = 2^-k and every x = mark * 2^k lands exactly on its mark. One tile-constant
       * k per 16 rows and 16 columns serves 1D and 2D alike; x[0] = 2688 makes amax 2688 and
       * s_enc exactly 1 (its own block is not exact, the rest are). */
      for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < K / 16; b++) {
          uint64_t ts = (uint64_t)(r / 16) * 1000003u + (uint64_t)b + seed * 7919u;
          int k = (int)(rng_next(&ts) % 18) - 9; /* 2^k in ue4m3's range [2^-9, 2^8] */
          float p = ldexpf(1.0f, k);
          float *xb = x + r * K + 16 * b;
          for (int j = 0; j < 16; j++) {
            float m = e2m1_marks[rng_int(&s, 0, 14)];
            int nudge = rng_int(&s, 0, 3); /* 0, 1: on the mark; 2: one ulp down; 3: one ulp up */
            float v = nudge == 2 ? nextafterf(m, 0) : nudge == 3 ? nextafterf(m, INFINITY) : m;
            xb[j] = rng_sign(&s) * v * p;
          }
          xb[rng_int(&s, 0, 15)] = rng_sign(&s) * 6.0f * p;
        }
      if (R * K > 0) x[0] = 2688.0f;
      break;
    case D_FP8_TIES: {
      /* Per block of `block` (or the whole tensor): max = elem_max * 2^k, so both MX rules pick
       * e = 127 + k and the per-tensor scale is elem_max / amax = 2^-k; x = mark * 2^k. */
      float emax = nvl_elem_max_ref(elem);
      int64_t bl = block ? block : R * K;
      for (int64_t g = 0; bl && g < R * K / bl; g++) {
        int k = block ? rng_int(&s, -20, 20) : 0;
        float p = ldexpf(1.0f, k);
        for (int64_t j = 0; j < bl; j++) x[g * bl + j] = rng_sign(&s) * fp8_mark(&s, elem) * p;
        x[g * bl + rng_int(&s, 0, (int)bl - 1)] = rng_sign(&s) * emax * p;
      }
      break;
    }
    case D_SPECIAL:
      /* blocks of: zeros, tiny (fp32 subnormal) values, a scale far below the tensor's max (the
       * block scale underflows to 0 or to ue4m3 subnormals), or normal values salted with
       * inf / NaN / -0 / subnormals; one huge block sets the amax. */
      for (int64_t g = 0; g < R * K / 16; g++) {
        float *xb = x + 16 * g;
        int kind = rng_int(&s, 0, 5);
        float sc = kind == 2 ? ldexpf(1.0f, rng_int(&s, -60, -10)) : 1.0f;
        for (int j = 0; j < 16; j++) {
          switch (kind) {
            case 0: xb[j] = (j & 1) ? -0.0f : 0.0f; break;
            case 1: xb[j] = rng_sign(&s) * ldexpf(rng_unif(&s), -126 - rng_int(&s, 0, 20)); break;
            default: xb[j] = rng_normal(&s) * sc; break;
          }
          if (kind >= 3) {
            int u = rng_int(&s, 0, 19);
            if (u == 0) xb[j] = NAN;
            else if (u == 1) xb[j] = -NAN;
            else if (u == 2 && kind == 5) xb[j] = rng_sign(&s) * INFINITY;
            else if (u == 3) xb[j] = -0.0f;
            else if (u == 4) xb[j] = ldexpf(rng_unif(&s), -140);
          }
        }
      }
      if (R * K >= 32) {
        int64_t g = (int64_t)(rng_next(&s) % (uint64_t)(R * K / 16));
        for (int j = 0; j < 16; j++) x[16 * g + j] = rng_normal(&s) * 1e30f;
      }
      break;
    default: break;
  }
}

/* ---- comparison ------------------------------------------------------------------------------ */

/* memcmp with a message naming the first difference. */
static int same_bytes(const char *what, const char *ctx, const void *a, const void *b, size_t n, size_t elem) {
  if (!memcmp(a, b, n)) return 1;
  const uint8_t *p = a, *q = b;
  size_t i = 0;
  while (p[i] == q[i]) i++;
  i /= elem;
  uint32_t va = 0, vb = 0;
  memcpy(&va, p + i * elem, elem);
  memcpy(&vb, q + i * elem, elem);
  fprintf(stderr, "  %s: %s differs at [%zu]: fast 0x%x, ref 0x%x\n", ctx, what, i, va, vb);
  return 0;
}

/* Float arrays equal bit for bit, except that any NaN matches any NaN: where two NaN operands
 * meet (or inf - inf makes one), which sign and payload come out depends on the operand order
 * the compiler picks for a commutative operation, in the reference too. */
static int same_floats(const char *what, const char *ctx, const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t ua, ub;
    memcpy(&ua, &a[i], 4);
    memcpy(&ub, &b[i], 4);
    if (ua != ub && !(isnan(a[i]) && isnan(b[i]))) {
      fprintf(stderr, "  %s: %s differs at [%lld]: fast 0x%08x, ref 0x%08x\n", ctx, what, (long long)i, ua, ub);
      return 0;
    }
  }
  return 1;
}

static uint8_t *bytes(int64_t n) { return malloc((size_t)(n > 0 ? n : 1)); }
static float *floats(int64_t n) { return malloc(sizeof(float) * (size_t)(n > 0 ? n : 1)); }

/* nvfp4 quantize (and dequantize) of x (R, K) by both paths; 1 if every bit agrees. */
static int nvfp4_agrees(const float *x, int64_t R, int64_t K, int two_d, const nvl_quant_ref_opts *o, const char *ctx) {
  int64_t n = R * K;
  uint8_t *cr = bytes(n), *cf = bytes(n), *pf = bytes(n / 2), *sr = bytes(n / 16), *sf = bytes(n / 16);
  float *yr = floats(n), *yf = floats(n), ar = -1, af = -2;
  memset(pf, 0xAA, (size_t)(n / 2));
  memset(sf, 0xAA, (size_t)(n / 16));
  int ok = 1;
  nvl_status str = two_d ? nvl_nvfp4_quantize_2d_ref(cr, sr, &ar, x, R, K, o) : nvl_nvfp4_quantize_1d_ref(cr, sr, &ar, x, R, K, o);
  nvl_status stf = impl->nvfp4(pf, sf, &af, x, R, K, two_d, o);
  if (str != NVL_OK || stf != NVL_OK) {
    fprintf(stderr, "  %s: status ref %d fast %d\n", ctx, str, stf);
    ok = 0;
  } else {
    nvl_e2m1_unpack_ref(cf, pf, n);
    ok &= same_bytes("codes", ctx, cf, cr, (size_t)n, 1);
    ok &= same_bytes("scales", ctx, sf, sr, (size_t)(n / 16), 1);
    ok &= same_bytes("amax", ctx, &af, &ar, 4, 4);
    ok &= nvl_nvfp4_dequantize_ref(yr, cr, sr, ar, R, K) == NVL_OK;
    ok &= impl->nvfp4_deq(yf, pf, sf, af, R, K) == NVL_OK;
    ok &= same_bytes("dequantized", ctx, yf, yr, sizeof(float) * (size_t)n, 4);
  }
  free(cr); free(cf); free(pf); free(sr); free(sf); free(yr); free(yf);
  return ok;
}

static int mxfp8_agrees(const float *x, int64_t R, int64_t K, nvl_elem e, nvl_mx_rule rule, const char *ctx) {
  int64_t n = R * K;
  uint8_t *cr = bytes(n), *cf = bytes(n), *sr = bytes(n / 32), *sf = bytes(n / 32);
  memset(cf, 0xAA, (size_t)n);
  memset(sf, 0xAA, (size_t)(n / 32));
  int ok = nvl_mx_quantize_ref(cr, sr, x, R, K, e, rule, NULL) == NVL_OK;
  ok &= impl->mxfp8(cf, sf, x, R, K, e, rule, NULL) == NVL_OK;
  ok = ok && same_bytes("codes", ctx, cf, cr, (size_t)n, 1);
  ok = ok && same_bytes("scales", ctx, sf, sr, (size_t)(n / 32), 1);
  free(cr); free(cf); free(sr); free(sf);
  return ok;
}

static int fp8_agrees(const float *x, int64_t n, nvl_elem e, const float *amax_in, const char *ctx) {
  uint8_t *cr = bytes(n), *cf = bytes(n);
  float scr = -1, scf = -2, ar = -1, af = -2;
  memset(cf, 0xAA, (size_t)n);
  int ok = nvl_fp8_quantize_tensor_ref(cr, &scr, &ar, x, n, e, amax_in) == NVL_OK;
  ok &= impl->fp8(cf, &scf, &af, x, n, e, amax_in) == NVL_OK;
  ok = ok && same_bytes("codes", ctx, cf, cr, (size_t)n, 1);
  ok = ok && same_bytes("scale", ctx, &scf, &scr, 4, 4);
  ok = ok && same_bytes("amax", ctx, &af, &ar, 4, 4);
  free(cr); free(cf);
  return ok;
}

/* ---- shapes ---------------------------------------------------------------------------------- */

static const int64_t test_rows[] = {1, 3, 16, 48, 129};
static const int64_t test_K[] = {16, 32, 48, 256, 4096};
#define NROWS (int)(sizeof test_rows / sizeof test_rows[0])
#define NK (int)(sizeof test_K / sizeof test_K[0])

/* ---- NVFP4 ---------------------------------------------------------------------------------- */

/* Every distribution x every shape (1D: all; 2D: rows a multiple of 16), under the option sets:
 * RNE, SR with two seed/offset pairs, RNE and SR with a given amax. */
static void nvfp4_sweep(int *nvl_failed_, int two_d) {
  const nvl_quant_ref_opts optsets[] = {
      {.sr = 0, .seed = 0, .offset = 0, .has_amax = 0, .amax = 0.0f},
      {.sr = 1, .seed = 0x1234567890ABCDEFull, .offset = 0, .has_amax = 0, .amax = 0.0f},
      {.sr = 1, .seed = 42, .offset = 0x100000003ull, .has_amax = 0, .amax = 0.0f},
      {.sr = 0, .seed = 0, .offset = 0, .has_amax = 1, .amax = 2688.0f},
      {.sr = 1, .seed = 7, .offset = 5, .has_amax = 1, .amax = 3.0f}, /* an amax below max|x|: saturation */
  };
  int runs = 0;
  for (int d = 0; d < D_COUNT; d++) {
    if (d == D_FP8_TIES) continue;
    for (int ri = 0; ri < NROWS; ri++)
      for (int ki = 0; ki < NK; ki++) {
        int64_t R = test_rows[ri], K = test_K[ki];
        if (two_d && R % 16) continue;
        float *x = floats(R * K);
        fill(x, R, K, (dist)d, (uint64_t)(ri * 31 + ki + 1), NVL_ELEM_E4M3, 16);
        for (int oi = 0; oi < (int)(sizeof optsets / sizeof optsets[0]); oi++) {
          if (R * K > 100000 && oi >= 3) continue; /* the big shapes: the main option sets */
          char ctx[128];
          snprintf(ctx, sizeof ctx, "nvfp4 %s %s [%lld,%lld] opts %d", two_d ? "2d" : "1d", dist_names[d],
                   (long long)R, (long long)K, oi);
          CHECK(nvfp4_agrees(x, R, K, two_d, &optsets[oi], ctx));
          runs++;
        }
        free(x);
      }
  }
  CHECK(runs > 50);
}

NVL_TEST(quant_cpu_nvfp4_1d) { nvfp4_sweep(nvl_failed_, 0); }
NVL_TEST(quant_cpu_nvfp4_2d) { nvfp4_sweep(nvl_failed_, 1); }

NVL_TEST(quant_cpu_nvfp4_ties_exact) {
  /* The tie construction really lands on the ties (every block scale is a power of two and
   * s_enc is 1): many elements sit exactly on a tie after scaling, and grid values come back
   * exactly from dequantization. */
  enum { R = 16, K = 64 };
  static float x[R * K], y[R * K];
  static uint8_t packed[R * K / 2], s[R * K / 16];
  float amax;
  fill(x, R, K, D_TIES, 3, NVL_ELEM_E4M3, 16);
  CHECK(impl->nvfp4(packed, s, &amax, x, R, K, 0, NULL) == NVL_OK);
  CHECK(amax == 2688.0f);
  CHECK(impl->nvfp4_deq(y, packed, s, amax, R, K) == NVL_OK);
  int exact = 0, ties = 0;
  for (int i = 16; i < R * K; i++) { /* block 0 holds 2688 */
    float bs = nvl_ue4m3_decode_ref(s[i / 16]);
    float m = fabsf(x[i]) / bs;
    for (int t = 0; t < 7; t++) ties += m == e2m1_marks[t];
    for (int t = 7; t < 15; t++) exact += m == e2m1_marks[t] && fabsf(y[i]) == fabsf(x[i]);
  }
  CHECK(ties > 100);
  CHECK(exact > 100);
}

NVL_TEST(quant_cpu_nvfp4_zero_and_edge) {
  /* all-zero tensor, empty tensor, -0, all NaN, inf amax, NaN amax, tiny / huge amax */
  enum { R = 16, K = 32 };
  static float x[R * K];
  const nvl_quant_ref_opts rne = {0}, sr = {.sr = 1, .seed = 99, .offset = 1};
  memset(x, 0, sizeof x);
  for (int two_d = 0; two_d < 2; two_d++) {
    CHECK(nvfp4_agrees(x, R, K, two_d, &rne, "zeros"));
    CHECK(nvfp4_agrees(x, R, K, two_d, &sr, "zeros sr"));
    CHECK(nvfp4_agrees(x, 0, K, two_d, &rne, "empty"));
  }
  for (int i = 0; i < R * K; i++) x[i] = -0.0f;
  CHECK(nvfp4_agrees(x, R, K, 0, &rne, "-0"));
  for (int i = 0; i < R * K; i++) x[i] = (i & 1) ? NAN : -NAN;
  CHECK(nvfp4_agrees(x, R, K, 0, &rne, "nan"));
  CHECK(nvfp4_agrees(x, R, K, 1, &sr, "nan sr"));
  fill(x, R, K, D_NORMAL, 5, NVL_ELEM_E4M3, 16);
  x[7] = INFINITY;
  CHECK(nvfp4_agrees(x, R, K, 0, &rne, "inf element"));
  CHECK(nvfp4_agrees(x, R, K, 1, &sr, "inf element sr"));
  x[7] = 1.0f;
  const float amaxes[] = {0.0f, INFINITY, NAN, 1e-45f, 1e-38f, 1e-30f, 1.0f, 1e30f, FLT_MAX, -1.0f};
  for (int i = 0; i < (int)(sizeof amaxes / sizeof amaxes[0]); i++) {
    nvl_quant_ref_opts o = {.sr = i & 1, .seed = 11, .offset = (uint64_t)i, .has_amax = 1, .amax = amaxes[i]};
    char ctx[64];
    snprintf(ctx, sizeof ctx, "given amax %g", amaxes[i]);
    CHECK(nvfp4_agrees(x, R, K, 0, &o, ctx));
    CHECK(nvfp4_agrees(x, R, K, 1, &o, ctx));
  }
}

NVL_TEST(quant_cpu_nvfp4_e2m1_sweep) {
  /* Every fp32 in [-6, 6] with a coarse stride (and everything near the marks) through the
   * e2m1 encoder: each block holds 6 at j = 0 so its scale is 1 and se exactly 1 under
   * amax 2688. */
  enum { NB = 1 << 16 };
  float *x = floats(16 * NB);
  uint32_t bits = 0;
  for (int g = 0; g < NB; g++) {
    x[16 * g] = 6.0f;
    for (int j = 1; j < 16; j++) {
      float v;
      do {
        bits += 0x40B1u; /* about 2^32 / 2^18: crosses every binade */
        v = 0;
        memcpy(&v, &bits, 4);
      } while (!(fabsf(v) <= 6.0f));
      x[16 * g + j] = v;
    }
  }
  for (int i = 0; i < 15; i++) /* the marks and 3 ulps either side, both signs */
    for (int d = -3; d <= 3; d++) {
      float v = e2m1_marks[i];
      for (int k = 0; k < (d < 0 ? -d : d); k++) v = nextafterf(v, d < 0 ? 0 : INFINITY);
      x[16 * (i * 7 + d + 3) + 1] = v;
      x[16 * (i * 7 + d + 3) + 2] = -v;
    }
  const nvl_quant_ref_opts o[] = {{.sr = 0, .seed = 0, .offset = 0, .has_amax = 1, .amax = 2688.0f},
                                  {.sr = 1, .seed = 5, .offset = 9, .has_amax = 1, .amax = 2688.0f}};
  CHECK(nvfp4_agrees(x, NB, 16, 0, &o[0], "e2m1 sweep"));
  CHECK(nvfp4_agrees(x, NB, 16, 0, &o[1], "e2m1 sweep sr"));
  free(x);
}

NVL_TEST(quant_cpu_nvfp4_threaded) {
  /* Large enough to go parallel in every phase (amax, blocks, tiles, dequantize). */
  enum { R = 512, K = 4096 };
  float *x = floats((int64_t)R * K);
  fill(x, R, K, D_NORMAL, 77, NVL_ELEM_E4M3, 16);
  for (int i = 0; i < 64; i++) x[(int64_t)i * 32771 % ((int64_t)R * K)] *= 1000.0f;
  const nvl_quant_ref_opts rne = {0}, sr = {.sr = 1, .seed = 0xDEADBEEFull, .offset = 123456789};
  CHECK(nvfp4_agrees(x, R, K, 0, &rne, "threaded 1d"));
  CHECK(nvfp4_agrees(x, R, K, 0, &sr, "threaded 1d sr"));
  CHECK(nvfp4_agrees(x, R, K, 1, &rne, "threaded 2d"));
  CHECK(nvfp4_agrees(x, R, K, 1, &sr, "threaded 2d sr"));
  /* K = 16 with many rows: a 1D block per row */
  CHECK(nvfp4_agrees(x, (int64_t)R * K / 16, 16, 0, &sr, "threaded k16 sr"));
  free(x);
}

NVL_TEST(quant_cpu_nvfp4_sr_stream) {
  /* SR reads the Philox stream by block index: different offsets / seeds give different codes,
   * the same ones the same codes, block g's draw does not depend on the shape it sits in. */
  enum { R = 4, K = 64 };
  static float x[R * K];
  static uint8_t p1[R * K / 2], p2[R * K / 2], p3[R * K / 2], s[R * K / 16];
  float amax;
  fill(x, R, K, D_NORMAL, 8, NVL_ELEM_E4M3, 16);
  nvl_quant_ref_opts a = {.sr = 1, .seed = 1, .offset = 0}, b = {.sr = 1, .seed = 1, .offset = 1},
                     c = {.sr = 1, .seed = 2, .offset = 0};
  CHECK(impl->nvfp4(p1, s, &amax, x, R, K, 0, &a) == NVL_OK);
  CHECK(impl->nvfp4(p2, s, &amax, x, R, K, 0, &b) == NVL_OK);
  CHECK(memcmp(p1, p2, sizeof p1) != 0);
  CHECK(impl->nvfp4(p2, s, &amax, x, R, K, 0, &c) == NVL_OK);
  CHECK(memcmp(p1, p2, sizeof p1) != 0);
  CHECK(impl->nvfp4(p2, s, &amax, x, R * K / 16, 16, 0, &a) == NVL_OK);
  CHECK(impl->nvfp4(p3, s, &amax, x, 1, R * K, 0, &a) == NVL_OK);
  CHECK(memcmp(p1, p2, sizeof p1) == 0 && memcmp(p1, p3, sizeof p1) == 0);
}

NVL_TEST(quant_cpu_nvfp4_dequantize_any_bytes) {
  /* Random packed codes and scale bytes (0x7F / 0xFF NaN scales included) under odd amaxes. */
  enum { R = 8, K = 64 };
  static uint8_t p[R * K / 2], c[R * K], s[R * K / 16];
  static float yr[R * K], yf[R * K];
  uint64_t st = 4;
  for (int i = 0; i < R * K / 2; i++) p[i] = (uint8_t)rng_next(&st);
  for (int i = 0; i < R * K / 16; i++) s[i] = (uint8_t)i * 8 + (uint8_t)(i & 7); /* all high bits, 0x7F, 0xFF */
  s[0] = 0x7F;
  s[1] = 0xFF;
  s[2] = 0;
  nvl_e2m1_unpack_ref(c, p, R * K);
  const float amaxes[] = {0.0f, INFINITY, NAN, 1e-45f, 1e-30f, 1.0f, 2688.0f, 1e30f, FLT_MAX};
  for (int i = 0; i < (int)(sizeof amaxes / sizeof amaxes[0]); i++) {
    CHECK(nvl_nvfp4_dequantize_ref(yr, c, s, amaxes[i], R, K) == NVL_OK);
    CHECK(impl->nvfp4_deq(yf, p, s, amaxes[i], R, K) == NVL_OK);
    CHECK(same_bytes("dequantized", "dequantize any bytes", yf, yr, sizeof yr, 4));
  }
}

NVL_TEST(quant_cpu_nvfp4_errors) {
  static float x[32 * 48];
  static uint8_t p[32 * 48], s[32 * 48];
  float amax;
  CHECK(impl->nvfp4(p, s, &amax, x, 8, 48, 1, NULL) == NVL_EINVAL);
  CHECK(impl->nvfp4(p, s, &amax, x, 1, 17, 0, NULL) == NVL_EINVAL);
  CHECK(impl->nvfp4(p, s, &amax, x, -1, 16, 0, NULL) == NVL_EINVAL);
  CHECK(impl->nvfp4_deq(x, p, s, 1.0f, 1, 24) == NVL_EINVAL);
  CHECK(impl->mxfp8(p, s, x, 1, 48, NVL_ELEM_E4M3, NVL_MX_RCEIL, NULL) == NVL_EINVAL);
  CHECK(impl->mxfp8(p, s, x, 1, 32, (nvl_elem)7, NVL_MX_RCEIL, NULL) == NVL_EINVAL);
  CHECK(impl->mxfp8(p, s, x, 1, 32, NVL_ELEM_E4M3, (nvl_mx_rule)5, NULL) == NVL_EINVAL);
  CHECK(impl->fp8(p, &amax, &amax, x, -1, NVL_ELEM_E4M3, NULL) == NVL_EINVAL);
  CHECK(impl->fp8(p, &amax, &amax, x, 4, (nvl_elem)2, NULL) == NVL_EINVAL);
  CHECK(impl->rht(x, x, 1, 24, NULL) == NVL_EINVAL);
}

/* ---- MXFP8 ---------------------------------------------------------------------------------- */

NVL_TEST(quant_cpu_mxfp8) {
  int runs = 0;
  for (int e = 0; e <= NVL_ELEM_E5M2; e++) /* the fp8 codecs */
    for (int rule = 0; rule < NVL_MX_RULE_COUNT; rule++)
      for (int d = 0; d < D_COUNT; d++) {
        if (d == D_TIES) continue;
        for (int ri = 0; ri < NROWS; ri++)
          for (int ki = 0; ki < NK; ki++) {
            int64_t R = test_rows[ri], K = test_K[ki];
            if (K % 32) continue;
            if (R * K > 100000 && (d == D_WIDE || rule == NVL_MX_FLOOR)) continue;
            float *x = floats(R * K);
            fill(x, R, K, (dist)d, (uint64_t)(ri * 17 + ki + e), (nvl_elem)e, 32);
            char ctx[128];
            snprintf(ctx, sizeof ctx, "mxfp8 %s %s %s [%lld,%lld]", e ? "e5m2" : "e4m3", rule ? "floor" : "rceil",
                     dist_names[d], (long long)R, (long long)K);
            CHECK(mxfp8_agrees(x, R, K, (nvl_elem)e, (nvl_mx_rule)rule, ctx));
            runs++;
            free(x);
          }
      }
  CHECK(runs > 50);
  /* blocks whose scale is 0 (tiny or zero max) or 254 (inf), an all-NaN block, threads */
  enum { R = 512, K = 4096 };
  float *x = floats((int64_t)R * K);
  fill(x, R, K, D_NORMAL, 3, NVL_ELEM_E4M3, 32);
  for (int j = 0; j < 32; j++) {
    x[j] = 0.0f;
    x[32 + j] = ldexpf(1.0f, -140) * (float)j;
    x[64 + j] = j == 3 ? -INFINITY : 1.0f;
    x[160 + j] = j == 9 ? INFINITY : (float)j * 1e37f; /* scale 2^-127: finite elements still matter */
    /* rceil at the subnormal edge: bmax / elem_max = 2^-127 exactly (code 0), one ulp above (1) */
    x[192 + j] = j == 4 ? 448.0f * ldexpf(1.0f, -127) : ldexpf(1.0f, -130);
    x[224 + j] = j == 4 ? nextafterf(448.0f * ldexpf(1.0f, -127), 1.0f) : -ldexpf(1.0f, -131);
    x[256 + j] = j == 4 ? 57344.0f * ldexpf(1.0f, -127) : ldexpf(1.0f, -125);
    x[288 + j] = j == 4 ? nextafterf(57344.0f * ldexpf(1.0f, -127), 1.0f) : 0.0f;
    x[96 + j] = NAN;
    x[128 + j] = j == 5 ? FLT_MAX : -1e-20f;
  }
  for (int e = 0; e <= NVL_ELEM_E5M2; e++) /* the fp8 codecs */
    for (int rule = 0; rule < NVL_MX_RULE_COUNT; rule++)
      CHECK(mxfp8_agrees(x, R, K, (nvl_elem)e, (nvl_mx_rule)rule, "mxfp8 threaded edges"));
  free(x);
}

/* ---- MX with e2m1 elements (mxfp4) ---------------------------------------------------------- */

/* The fast mx quantizer with e2m1 elements writes packed codes; the reference unpacked ones,
 * packed here with nvl_e2m1_pack_ref. Codes and scales must agree bit for bit, SR included. */
static int mxfp4_agrees(const float *x, int64_t R, int64_t K, nvl_mx_rule rule, const nvl_quant_ref_opts *o,
                        const char *ctx) {
  int64_t n = R * K;
  uint8_t *cr = bytes(n), *pr = bytes(n / 2), *pf = bytes(n / 2), *sr = bytes(n / 32), *sf = bytes(n / 32);
  memset(pf, 0xAA, (size_t)(n / 2));
  memset(sf, 0xAA, (size_t)(n / 32));
  int ok = nvl_mx_quantize_ref(cr, sr, x, R, K, NVL_ELEM_E2M1, rule, o) == NVL_OK;
  nvl_e2m1_pack_ref(pr, cr, n);
  ok &= impl->mxfp8(pf, sf, x, R, K, NVL_ELEM_E2M1, rule, o) == NVL_OK;
  ok = ok && same_bytes("packed codes", ctx, pf, pr, (size_t)(n / 2), 1);
  ok = ok && same_bytes("scales", ctx, sf, sr, (size_t)(n / 32), 1);
  free(cr); free(pr); free(pf); free(sr); free(sf);
  return ok;
}

NVL_TEST(quant_cpu_mxfp4) {
  const nvl_quant_ref_opts rne = {0}, sr = {.sr = 1, .seed = 0xABCDEF12345ull, .offset = 77},
                           slab = {.sr = 1, .seed = 3, .offset = 1, .sr_row_offset = 5, .sr_k_offset = 64, .sr_k_total = 8192};
  const nvl_quant_ref_opts *opts[3] = {&rne, &sr, &slab};
  const dist dists[3] = {D_NORMAL, D_WIDE, D_SPECIAL};
  int runs = 0;
  for (int rule = 0; rule < NVL_MX_RULE_COUNT; rule++)
    for (int di = 0; di < 3; di++)
      for (int ri = 0; ri < NROWS; ri++)
        for (int ki = 0; ki < NK; ki++) {
          int64_t R = test_rows[ri], K = test_K[ki];
          if (K % 32 || (R * K > 100000 && di > 0)) continue;
          float *x = floats(R * K);
          fill(x, R, K, dists[di], (uint64_t)(ri * 19 + ki + 3 * rule), NVL_ELEM_E4M3, 32);
          for (int oi = 0; oi < 3; oi++) {
            if (oi == 2 && K + 64 > 8192) continue;
            char ctx[128];
            snprintf(ctx, sizeof ctx, "mxfp4 %s %s %s [%lld,%lld]", rule ? "floor" : "rceil", dist_names[dists[di]],
                     oi == 0 ? "rne" : oi == 1 ? "sr" : "sr slab", (long long)R, (long long)K);
            CHECK(mxfp4_agrees(x, R, K, (nvl_mx_rule)rule, opts[oi], ctx));
            runs++;
          }
          free(x);
        }
  CHECK(runs > 50);
  /* SR of e2m1 only; a slab that does not fit 32-blocks is refused */
  float x[64] = {0};
  uint8_t p[64], s[4];
  nvl_quant_ref_opts bad = {.sr = 1, .sr_k_offset = 16, .sr_k_total = 128};
  CHECK(impl->mxfp8(p, s, x, 1, 64, NVL_ELEM_E4M3, NVL_MX_RCEIL, &sr) == NVL_EINVAL);
  CHECK(impl->mxfp8(p, s, x, 1, 64, NVL_ELEM_E2M1, NVL_MX_RCEIL, &bad) == NVL_EINVAL);
  CHECK(nvl_mx_quantize_ref(p, s, x, 1, 64, NVL_ELEM_E2M1, NVL_MX_RCEIL, &bad) == NVL_EINVAL);
}

/* ---- FP8 per tensor ------------------------------------------------------------------------- */

NVL_TEST(quant_cpu_fp8_tensor) {
  int runs = 0;
  for (int e = 0; e <= NVL_ELEM_E5M2; e++) /* the fp8 codecs */ {
    float emax = nvl_elem_max_ref((nvl_elem)e);
    for (int d = 0; d < D_COUNT; d++) {
      if (d == D_TIES) continue;
      for (int ri = 0; ri < NROWS; ri++)
        for (int ki = 0; ki < NK; ki++) {
          int64_t R = test_rows[ri], K = test_K[ki];
          if (R * K > 100000 && d != D_NORMAL && d != D_FP8_TIES) continue;
          float *x = floats(R * K);
          fill(x, R, K, (dist)d, (uint64_t)(ri * 13 + ki + 5 * e), (nvl_elem)e, 0);
          const float delayed[] = {emax, 1.0f, 0.5f * emax, 0.0f, INFINITY, NAN, 1e-30f, FLT_MAX};
          char ctx[128];
          snprintf(ctx, sizeof ctx, "fp8 %s %s [%lld,%lld] current", e ? "e5m2" : "e4m3", dist_names[d],
                   (long long)R, (long long)K);
          CHECK(fp8_agrees(x, R * K, (nvl_elem)e, NULL, ctx));
          for (int i = 0; i < (int)(sizeof delayed / sizeof delayed[0]); i++) {
            if (R * K > 100000 && i > 1) break;
            snprintf(ctx, sizeof ctx, "fp8 %s %s [%lld,%lld] delayed %g", e ? "e5m2" : "e4m3", dist_names[d],
                     (long long)R, (long long)K, delayed[i]);
            CHECK(fp8_agrees(x, R * K, (nvl_elem)e, &delayed[i], ctx));
          }
          runs++;
          free(x);
        }
    }
  }
  CHECK(runs > 50);
  float z[64] = {0};
  CHECK(fp8_agrees(z, 64, NVL_ELEM_E4M3, NULL, "fp8 zeros"));
  CHECK(fp8_agrees(z, 0, NVL_ELEM_E5M2, NULL, "fp8 empty"));
}

NVL_TEST(quant_cpu_fp8_sweep) {
  /* A strided walk over all 2^32 fp32 bit patterns (NaN, inf, subnormals, both signs) through
   * both encoders at scale exactly 1 (delayed amax = elem_max), plus every fp8 midpoint and
   * 2 ulps either side, multi-threaded. */
  int64_t n = 1 << 22;
  float *x = floats(n);
  uint32_t bits = 12345;
  for (int64_t i = 0; i < n; i++) {
    bits += 1021u; /* odd stride: a fresh low-bit pattern every lap */
    memcpy(&x[i], &bits, 4);
    if (i % 4 == 0) x[i] = ldexpf(x[i], -100); /* more mass near the fp8 ranges */
  }
  for (int e = 0; e <= NVL_ELEM_E5M2; e++) /* the fp8 codecs */ {
    int last = e ? 0x7B : 0x7E;
    int64_t i = 0;
    for (int c = 0; c < last; c++) {
      float lo = nvl_elem_decode_ref((nvl_elem)e, (uint8_t)c), hi = nvl_elem_decode_ref((nvl_elem)e, (uint8_t)(c + 1));
      float m = (lo + hi) / 2, v = nextafterf(nextafterf(m, 0), 0);
      for (int k = 0; k < 5; k++, v = nextafterf(v, INFINITY)) {
        x[i++] = v;
        x[i++] = -v;
      }
    }
    float emax = nvl_elem_max_ref((nvl_elem)e);
    CHECK(fp8_agrees(x, n, (nvl_elem)e, &emax, e ? "fp8 sweep e5m2" : "fp8 sweep e4m3"));
  }
  free(x);
}

NVL_TEST(quant_cpu_amax_position) {
  /* The amax reduction sees every element: the max first, last, at chunk edges, for lengths
   * that are not a multiple of 16 (fp8 per tensor) and long enough to be threaded. */
  const int64_t lens[] = {1, 5, 17, 31, 4096 + 7, 16384 * 3 + 1, 200000};
  for (int li = 0; li < (int)(sizeof lens / sizeof lens[0]); li++) {
    int64_t n = lens[li];
    float *x = floats(n);
    const int64_t at[] = {0, n - 1, n / 2, 16383 % n, 16384 % n};
    for (int ai = 0; ai < 5; ai++) {
      fill(x, 1, n, D_NORMAL, (uint64_t)(li * 5 + ai), NVL_ELEM_E4M3, 0);
      x[at[ai]] = -1000.0f;
      char ctx[96];
      snprintf(ctx, sizeof ctx, "amax at %lld of %lld", (long long)at[ai], (long long)n);
      CHECK(fp8_agrees(x, n, NVL_ELEM_E4M3, NULL, ctx));
      CHECK(fp8_agrees(x, n, NVL_ELEM_E5M2, NULL, ctx));
      if (n % 16 == 0) CHECK(nvfp4_agrees(x, 1, n, 0, NULL, ctx));
      if (n >= 16) CHECK(nvfp4_agrees(x, 1, n - n % 16, 0, NULL, ctx));
    }
    free(x);
  }
}

/* ---- bf16 input -------------------------------------------------------------------------------- */

/* nvl_nvfp4_quantize_bf16_cpu(xb) == nvl_nvfp4_quantize_cpu(widened xb), byte for byte: codes, scales,
 * amax; RNE and SR; every distribution (NaN, inf, zero blocks, subnormal bf16 included) */
NVL_TEST(quant_cpu_nvfp4_bf16_input) {
  const dist dists[3] = {D_NORMAL, D_WIDE, D_SPECIAL};
  for (int ri = 0; ri < NROWS; ri++)
    for (int ki = 0; ki < NK; ki++)
      for (int di = 0; di < 3; di++) {
        int64_t R = test_rows[ri], K = test_K[ki], n = R * K;
        float *x = floats(n);
        uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)n);
        uint8_t *p1 = bytes(n / 2), *p2 = bytes(n / 2), *s1 = bytes(n / 16), *s2 = bytes(n / 16);
        fill(x, R, K, dists[di], (uint64_t)(7 * ri + 3 * ki + di), NVL_ELEM_E2M1, 16);
        for (int64_t i = 0; i < n; i++) xb[i] = nvl_f32_to_bf16(x[i]);
        for (int64_t i = 0; i < n; i++) x[i] = nvl_bf16_to_f32(xb[i]);
        for (int sr = 0; sr < 2; sr++) {
          const nvl_quant_ref_opts o = {.sr = sr, .seed = 99, .offset = 5};
          float a1 = -1, a2 = -2;
          memset(p2, 0xAA, (size_t)(n / 2));
          memset(s2, 0xAA, (size_t)(n / 16));
          CHECK(impl->nvfp4(p1, s1, &a1, x, R, K, 0, &o) == NVL_OK);
          CHECK(impl->nvfp4_bf16(p2, s2, &a2, xb, R, K, &o) == NVL_OK);
          CHECK(same_bytes("codes", "nvfp4 from bf16", p2, p1, (size_t)(n / 2), 1));
          CHECK(same_bytes("scales", "nvfp4 from bf16", s2, s1, (size_t)(n / 16), 1));
          CHECK(same_bytes("amax", "nvfp4 from bf16", &a2, &a1, 4, 4));
        }
        free(x); free(xb); free(p1); free(p2); free(s1); free(s2);
      }
}

/* ---- nvfp4 -> bf16 decoding (the bf16 GEMM path) ---------------------------------------------- */

/* The AVX-512 lookups and the scalar table give the same bf16 bits, and those are the f32 decoder's
 * values exactly (e2m1 x ue4m3 is exact in bf16): every code byte, every scale byte (NaN scales
 * 0x7f/0xff included), a block count that is not a multiple of the work item. */
NVL_TEST(dequant_cpu_nvfp4_bf16) {
  int64_t R = 97, K = 512, n = R * K; /* 3104 blocks */
  uint8_t *p = bytes(n / 2), *sc = bytes(n / 16);
  uint16_t *y1 = malloc(sizeof(uint16_t) * (size_t)n), *y2 = malloc(sizeof(uint16_t) * (size_t)n);
  float *f = floats(n);
  uint64_t st = 12345;
  for (int64_t i = 0; i < n / 2; i++) p[i] = (uint8_t)rng_next(&st);
  for (int64_t i = 0; i < n / 16; i++) sc[i] = (uint8_t)(i % 256);
  int prev = nvl_nvfp4_decode_simd_cpu(1);
  nvl_nvfp4_decode_unscaled_bf16_cpu(y1, p, sc, R, K);
  nvl_nvfp4_decode_simd_cpu(0);
  nvl_nvfp4_decode_unscaled_bf16_cpu(y2, p, sc, R, K);
  nvl_nvfp4_decode_simd_cpu(prev);
  CHECK(same_bytes("bf16", "nvfp4 decode: simd vs scalar", y1, y2, sizeof(uint16_t) * (size_t)n, 2));
  nvl_nvfp4_decode_unscaled_cpu(f, p, sc, R, K);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    float v = nvl_bf16_to_f32(y1[i]);
    if (memcmp(&v, &f[i], 4) != 0 && !(v != v && f[i] != f[i])) bad++;
  }
  CHECK(bad == 0);
  free(p); free(sc); free(y1); free(y2); free(f);
}

/* ---- RHT ------------------------------------------------------------------------------------ */

NVL_TEST(quant_cpu_rht) {
  const float mysigns[16] = {-1, 1, -1, -1, 1, 1, -1, 1, 1, -1, 1, 1, -1, -1, 1, -1};
  for (int ri = 0; ri < NROWS; ri++)
    for (int ki = 0; ki < NK; ki++) {
      int64_t R = test_rows[ri], K = test_K[ki], n = R * K;
      float *x = floats(n), *yr = floats(n), *yf = floats(n);
      fill(x, R, K, ri % 2 ? D_WIDE : D_SPECIAL, (uint64_t)(ri + ki), NVL_ELEM_E4M3, 16);
      for (int sv = 0; sv < 2; sv++) {
        const float *signs = sv ? mysigns : NULL;
        CHECK(nvl_rht16_rows_ref(yr, x, R, K, signs) == NVL_OK);
        CHECK(impl->rht(yf, x, R, K, signs) == NVL_OK);
        CHECK(same_floats("rht", "rht", yf, yr, n));
        memcpy(yf, x, sizeof(float) * (size_t)n); /* in place */
        CHECK(impl->rht(yf, yf, R, K, signs) == NVL_OK);
        CHECK(same_floats("rht", "rht in place", yf, yr, n));
        /* bf16 operand (NUMERICS §5): x rounded to bf16, widened, transformed, each output rounded */
        uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(n ? n : 1));
        for (int64_t i = 0; i < n; i++) xb[i] = nvl_f32_to_bf16(x[i]);
        for (int64_t i = 0; i < n; i++) yf[i] = nvl_bf16_to_f32(xb[i]);
        CHECK(nvl_rht16_rows_ref(yr, yf, R, K, signs) == NVL_OK);
        for (int64_t i = 0; i < n; i++) yr[i] = nvl_bf16_to_f32(nvl_f32_to_bf16(yr[i]));
        CHECK(impl->rht_bf16(yf, xb, R, K, signs) == NVL_OK);
        CHECK(same_floats("rht", "rht of bf16", yf, yr, n));
        free(xb);
        /* the inverse (dequantize's x R^T): the reference's order, out of place and in place */
        for (int64_t i = 0; i < n; i += 16) nvl_rht16_inverse_ref(yr + i, x + i, signs);
        CHECK(impl->rht_inverse(yf, x, R, K, signs) == NVL_OK);
        CHECK(same_floats("rht", "inverse rht", yf, yr, n));
        memcpy(yf, x, sizeof(float) * (size_t)n);
        CHECK(impl->rht_inverse(yf, yf, R, K, signs) == NVL_OK);
        CHECK(same_floats("rht", "inverse rht in place", yf, yr, n));
      }
      free(x); free(yr); free(yf);
    }
}

/* SR slab offsets (data parallelism): a slab of a global tensor G (RT, KT) -- rows [r0, r0+R),
 * columns [k0, k0+K) -- quantized alone with the global amax and sr_row_offset = r0, sr_k_offset =
 * k0, sr_k_total = KT gives exactly G's codes and scales there (reference and fast, 1D and 2D);
 * every slab option set agrees ref vs fast on its own; bad offsets are refused. */
static int slab_matches(const float *G, int64_t RT, int64_t KT, int64_t r0, int64_t R, int64_t k0, int64_t K, int two_d,
                        const char *ctx) {
  int64_t n = R * K, N = RT * KT;
  float *x = floats(n), amax = 0.0f, a2;
  uint8_t *cg = bytes(N), *sg = bytes(N / 16), *cs = bytes(n), *ss = bytes(n / 16), *ps = bytes(n / 2), *cf = bytes(n);
  for (int64_t i = 0; i < N; i++) amax = fmaxf(amax, fabsf(G[i]));
  for (int64_t i = 0; i < R; i++) memcpy(x + i * K, G + (r0 + i) * KT + k0, sizeof(float) * (size_t)K);
  nvl_quant_ref_opts og = {.sr = 1, .seed = 0xC0FFEE, .offset = 3, .has_amax = 1, .amax = amax};
  nvl_quant_ref_opts os = og;
  os.sr_row_offset = r0;
  os.sr_k_offset = k0;
  os.sr_k_total = KT;
  int ok = (two_d ? nvl_nvfp4_quantize_2d_ref : nvl_nvfp4_quantize_1d_ref)(cg, sg, &a2, G, RT, KT, &og) == NVL_OK;
  ok = ok && (two_d ? nvl_nvfp4_quantize_2d_ref : nvl_nvfp4_quantize_1d_ref)(cs, ss, &a2, x, R, K, &os) == NVL_OK;
  for (int64_t i = 0; ok && i < R; i++) {
    ok &= same_bytes("slab codes (ref)", ctx, cs + i * K, cg + (r0 + i) * KT + k0, (size_t)K, 1);
    ok &= same_bytes("slab scales (ref)", ctx, ss + i * (K / 16), sg + (r0 + i) * (KT / 16) + k0 / 16, (size_t)(K / 16), 1);
  }
  ok = ok && impl->nvfp4(ps, ss, &a2, x, R, K, two_d, &os) == NVL_OK;
  if (ok) nvl_e2m1_unpack_ref(cf, ps, n);
  for (int64_t i = 0; ok && i < R; i++)
    ok &= same_bytes("slab codes (fast)", ctx, cf + i * K, cg + (r0 + i) * KT + k0, (size_t)K, 1);
  ok = ok && nvfp4_agrees(x, R, K, two_d, &os, ctx);
  free(x); free(cg); free(sg); free(cs); free(ss); free(ps); free(cf);
  return ok;
}

NVL_TEST(quant_cpu_nvfp4_sr_slab) {
  enum { RT = 64, KT = 128 };
  float *G = floats(RT * KT);
  fill(G, RT, KT, D_NORMAL, 99, NVL_ELEM_E4M3, 16);
  /* row slabs (the dgrad copy of dY: each rank owns rows), column slabs (the wgrad copy, blocked
   * along T: each rank owns a run of K), both, the whole tensor, and a 1-row slab */
  static const int64_t cases[][4] = {{0, 32, 0, 128}, {32, 32, 0, 128}, {16, 16, 0, 128}, {0, 64, 0, 64},
                                     {0, 64, 64, 64}, {16, 32, 32, 48}, {0, 64, 0, 128}, {17, 1, 112, 16}};
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++)
    for (int two_d = 0; two_d < 2; two_d++) {
      const int64_t *c = cases[i];
      if (two_d && (c[0] % 16 || c[1] % 16)) continue;
      char ctx[96];
      snprintf(ctx, sizeof ctx, "slab rows %lld+%lld cols %lld+%lld %s", (long long)c[0], (long long)c[1],
               (long long)c[2], (long long)c[3], two_d ? "2d" : "1d");
      CHECK(slab_matches(G, RT, KT, c[0], c[1], c[2], c[3], two_d, ctx));
    }
  /* threaded: a big column slab */
  enum { RB = 64, KB = 8192 };
  float *B = floats(RB * KB);
  fill(B, RB, KB, D_NORMAL, 5, NVL_ELEM_E4M3, 16);
  CHECK(slab_matches(B, RB, KB, 0, RB, KB / 2, KB / 2, 0, "threaded column slab"));
  CHECK(slab_matches(B, RB, KB, RB / 2, RB / 2, 0, KB, 0, "threaded row slab"));
  /* zero offsets with sr_k_total = K: the plain call, bit for bit */
  uint8_t p1[RT * KT / 2], p2[RT * KT / 2], s1[RT * KT / 16], s2[RT * KT / 16];
  float a;
  nvl_quant_ref_opts plain = {.sr = 1, .seed = 4, .offset = 2}, same = plain;
  same.sr_k_total = KT;
  CHECK(impl->nvfp4(p1, s1, &a, G, RT, KT, 0, &plain) == NVL_OK);
  CHECK(impl->nvfp4(p2, s2, &a, G, RT, KT, 0, &same) == NVL_OK);
  CHECK(memcmp(p1, p2, sizeof p1) == 0);
  /* refused: k offset not a multiple of 16, a slab past the total, a total not a multiple of 16 */
  uint8_t codes[RT * KT];
  nvl_quant_ref_opts bad[3] = {plain, plain, plain};
  bad[0].sr_k_offset = 8, bad[0].sr_k_total = 2 * KT;
  bad[1].sr_k_offset = 16, bad[1].sr_k_total = KT;
  bad[2].sr_k_total = KT + 8;
  for (int i = 0; i < 3; i++) {
    CHECK(impl->nvfp4(p1, s1, &a, G, RT, KT, 0, &bad[i]) == NVL_EINVAL);
    CHECK(nvl_nvfp4_quantize_1d_ref(codes, s1, &a, G, RT, KT, &bad[i]) == NVL_EINVAL);
  }
  free(G);
  free(B);
}

NVL_TEST(quant_cpu_rht_then_nvfp4) {
  /* The Wgrad operand path: RHT rows, then nvfp4 1D with SR (and RNE), threaded. */
  enum { R = 256, K = 1024 };
  float *x = floats(R * K), *tr = floats(R * K), *tf = floats(R * K);
  fill(x, R, K, D_NORMAL, 21, NVL_ELEM_E4M3, 16);
  CHECK(nvl_rht16_rows_ref(tr, x, R, K, NULL) == NVL_OK);
  CHECK(impl->rht(tf, x, R, K, NULL) == NVL_OK);
  CHECK(same_bytes("rht", "rht rows", tf, tr, sizeof(float) * R * K, 4));
  const nvl_quant_ref_opts sr = {.sr = 1, .seed = 2024, .offset = 17}, rne = {0};
  CHECK(nvfp4_agrees(tf, R, K, 0, &sr, "rht + nvfp4 sr"));
  CHECK(nvfp4_agrees(tf, R, K, 0, &rne, "rht + nvfp4 rne"));
  free(x); free(tr); free(tf);
}

/* ---- the portable build ------------------------------------------------------------------------ */

/* kernels/cpu/quant_cpu.c once more, with NVL_QUANT_PORTABLE and its public names renamed, so the
 * code a machine without AVX2 (or a non-x86 one) runs is tested here too. */
#define NVL_QUANT_PORTABLE 1
#define nvl_nvfp4_quantize_cpu portable_nvfp4_quantize_cpu
#define nvl_nvfp4_dequantize_cpu portable_nvfp4_dequantize_cpu
#define nvl_mx_quantize_cpu portable_mx_quantize_cpu
#define nvl_fp8_quantize_tensor_cpu portable_fp8_quantize_tensor_cpu
#define nvl_rht16_rows_cpu portable_rht16_rows_cpu
#define nvl_rht16_rows_bf16_cpu portable_rht16_rows_bf16_cpu
#define nvl_rht16_rows_inverse_cpu portable_rht16_rows_inverse_cpu
#define nvl_nvfp4_quantize_bf16_cpu portable_nvfp4_quantize_bf16_cpu
#define nvl_gam_quantize_cpu portable_gam_quantize_cpu
nvl_status nvl_nvfp4_quantize_cpu(uint8_t *, uint8_t *, float *, const float *, int64_t, int64_t, int, const nvl_quant_ref_opts *);
nvl_status nvl_nvfp4_dequantize_cpu(float *, const uint8_t *, const uint8_t *, float, int64_t, int64_t);
nvl_status nvl_mx_quantize_cpu(uint8_t *, uint8_t *, const float *, int64_t, int64_t, nvl_elem, nvl_mx_rule,
                               const nvl_quant_ref_opts *);
nvl_status nvl_fp8_quantize_tensor_cpu(uint8_t *, float *, float *, const float *, int64_t, nvl_elem, const float *);
nvl_status nvl_rht16_rows_cpu(float *, const float *, int64_t, int64_t, const float *);
nvl_status nvl_rht16_rows_bf16_cpu(float *, const uint16_t *, int64_t, int64_t, const float *);
nvl_status nvl_rht16_rows_inverse_cpu(float *, const float *, int64_t, int64_t, const float *);
nvl_status nvl_nvfp4_quantize_bf16_cpu(uint8_t *, uint8_t *, float *, const uint16_t *, int64_t, int64_t,
                                       const nvl_quant_ref_opts *);
nvl_status nvl_gam_quantize_cpu(uint8_t *, uint8_t *, float *, const float *, int64_t, int64_t, int64_t, int64_t,
                                nvl_elem); /* tested in test_gam_cpu.c */
#include "cpu/quant_cpu.c"
static const quant_impl portable_impl = {nvl_nvfp4_quantize_cpu, nvl_nvfp4_dequantize_cpu, nvl_mx_quantize_cpu,
                                         nvl_fp8_quantize_tensor_cpu, nvl_rht16_rows_cpu, nvl_rht16_rows_bf16_cpu,
                                         nvl_rht16_rows_inverse_cpu, nvl_nvfp4_quantize_bf16_cpu};

NVL_TEST(quant_cpu_portable_build) {
  impl = &portable_impl;
  quant_cpu_nvfp4_threaded(nvl_failed_);
  quant_cpu_nvfp4_e2m1_sweep(nvl_failed_);
  quant_cpu_nvfp4_zero_and_edge(nvl_failed_);
  quant_cpu_nvfp4_sr_stream(nvl_failed_);
  quant_cpu_nvfp4_sr_slab(nvl_failed_);
  quant_cpu_nvfp4_dequantize_any_bytes(nvl_failed_);
  quant_cpu_mxfp8(nvl_failed_);
  quant_cpu_mxfp4(nvl_failed_);
  quant_cpu_fp8_sweep(nvl_failed_);
  quant_cpu_amax_position(nvl_failed_);
  quant_cpu_rht(nvl_failed_);
  quant_cpu_nvfp4_bf16_input(nvl_failed_);
  impl = &library_impl;
}
