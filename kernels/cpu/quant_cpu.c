/* quant_cpu.c: fast CPU quantizers (see quant_cpu.h), bit-identical to the scalar references in
 * kernels/cpu/ref/formats_ref.c, stochastic rounding included. Speed comes from three things:
 * OpenMP over independent blocks (tensor-wide amax as a parallel max reduction first), element
 * encoders written branch-free so gcc vectorises a whole block at a time (e2m1 by counting
 * threshold compares, fp8 by integer rounding of the fp32 bits), and Philox evaluated for 16
 * blocks at once in lanes. Every shortcut below is argued exact next to it; the unit tests in
 * tests/c/test_quant_cpu.c check it against the references bit for bit.
 *
 * Not here: allocation (beyond small stack tables), tensors, Lua; the scalar codecs themselves
 * (the references own the contract; per-block scalar steps that are cheap call them directly).
 *
 * Shape letters: R rows, K the contiguous blocked dim, n elements. Because x is row-major and
 * K is a multiple of the block, 1D blocks are simply the consecutive 16- or 32-element pieces
 * of x: block g starts at x + 16 g (g = row * (K/16) + k/16, the index the SR stream uses).
 *
 * Needs IEEE fp32 in the default rounding mode with subnormals kept (no -ffast-math, no FTZ),
 * as the references do. */
#include "cpu/quant_cpu.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "philox.h"

#define NVL_QUANT_OMP_MIN 32768 /* elements; below this a single thread is faster */
#define NVL_SR_LANES 16         /* blocks whose Philox draws are computed together */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- max |x| -------------------------------------------------------------------------------- */

/* The reference folds m = fmaxf(m, |x_i|) from m = 0, so NaN never enters m. With m not NaN,
 * fmaxf(m, a) == (a > m ? a : m) (a NaN compares false), a form that maps onto SIMD max
 * instructions; and a max of non-NaN values does not depend on the order, so lanes and threads
 * may split the work freely. */
static inline float absmax16(const float *x) {
  float m[8];
  for (int j = 0; j < 8; j++) {
    float a = fabsf(x[j]), b = fabsf(x[j + 8]);
    m[j] = a > 0.0f ? a : 0.0f;
    m[j] = b > m[j] ? b : m[j];
  }
  for (int h = 4; h >= 1; h /= 2)
    for (int j = 0; j < h; j++) m[j] = m[j + h] > m[j] ? m[j + h] : m[j];
  return m[0];
}

static float absmax_span(const float *x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; j++) {
      float a = fabsf(x[i + j]);
      acc[j] = a > acc[j] ? a : acc[j];
    }
  float m = 0.0f;
  for (; i < n; i++) {
    float a = fabsf(x[i]);
    m = a > m ? a : m;
  }
  for (int j = 0; j < 16; j++) m = acc[j] > m ? acc[j] : m;
  return m;
}

/* max |x_i| over n elements, NaN ignored, 0 for n = 0; threads over chunks. */
static float absmax_cpu(const float *x, int64_t n) {
  const int64_t chunk = 16384;
  int64_t nc = (n + chunk - 1) / chunk;
  float m = 0.0f;
#pragma omp parallel if (n > NVL_QUANT_OMP_MIN)
  {
    float lm = 0.0f;
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < nc; c++) {
      int64_t len = c == nc - 1 ? n - c * chunk : chunk;
      float a = absmax_span(x + c * chunk, len);
      lm = a > lm ? a : lm;
    }
#pragma omp critical(nvl_quant_absmax)
    m = lm > m ? lm : m;
  }
  return m;
}

/* ---- fp8 element encoders ------------------------------------------------------------------- */

/* fp32 -> fp8 code, the twin of formats_ref.c's minifloat_encode: RNE, satfinite, NaN -> 0x7F |
 * sign. M mantissa bits, bias B, emin = 1 - B, max finite maxv with code maxcode. Branch-free,
 * so it vectorises; meant to be inlined with constant parameters.
 *  - a >= maxv: maxcode (inf too), as the reference.
 *  - a normal in the fp8 format (a >= 2^emin): round the fp32 bits to M mantissa bits, ties to
 *    even (add 2^(22-M) - 1 plus the lowest kept bit, then truncate; a carry into the exponent is
 *    the correct next binade), then rebias the exponent from 127 to B. Since a < maxv and maxv
 *    is representable, the result is at most maxcode, as rounding is monotone.
 *  - a < 2^emin (fp8 subnormal): the quantum is 2^(emin-M), a * 2^(M-emin) < 2^M is exact, and
 *    adding 2^23 rounds it to an integer, ties to even (the fp32 ulp at 2^23 is 1); that integer
 *    is the code (2^M, for a that rounds up to 2^emin, is that normal's code too). */
static inline uint8_t fp8_encode(float x, int M, int B, float maxv, uint32_t maxcode) {
  uint32_t u = f2u(x);
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t au = u & 0x7FFFFFFFu;
  float a = u2f(au);
  const int sh = 23 - M;
  uint32_t norm = ((au + ((1u << (sh - 1)) - 1u) + ((au >> sh) & 1u)) >> sh) - ((uint32_t)(127 - B) << M);
  float sub_scale = u2f((uint32_t)(127 + M + B - 1) << 23); /* 2^(M - emin) */
  float min_normal = u2f((uint32_t)(127 + 1 - B) << 23);    /* 2^emin */
  uint32_t sub = f2u(a * sub_scale + 8388608.0f) - 0x4B000000u;
  uint32_t mag = a >= maxv ? maxcode : (a < min_normal ? sub : norm);
  return (uint8_t)(x != x ? (0x7Fu | sign) : (sign | mag));
}

static inline uint8_t e4m3_encode(float x) { return fp8_encode(x, 3, 7, 448.0f, 0x7E); }
static inline uint8_t e5m2_encode(float x) { return fp8_encode(x, 2, 15, 57344.0f, 0x7B); }

/* ue4m3 block scale: nvl_ue4m3_encode_ref (NaN -> 0x7F, x <= 0 -> 0, else e4m3). */
static inline uint8_t ue4m3_encode(float x) {
  if (x != x) return 0x7F;
  if (!(x > 0.0f)) return 0x00;
  return e4m3_encode(x);
}

/* ---- e2m1 element encoders ----------------------------------------------------------------- */

/* RNE (nvl_e2m1_encode_ref): the code is the number of thresholds |v| has passed. The reference
 * tests "a <= t" where a tie rounds down (to the even code) and "a < t" where it rounds up, so
 * passing means a > t for the first kind and a >= t for the second. NaN passes none (its sign
 * is dropped: code 6). The sign bit of v is bit 3 of the code, so -0 and small negatives give 8. */
static inline uint8_t e2m1_encode(float v) {
  float a = fabsf(v);
  uint32_t m = (uint32_t)(a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
               (a > 5.0f);
  uint32_t c = ((f2u(v) >> 28) & 8u) | m;
  return (uint8_t)(v != v ? 6u : c);
}

/* SR (nvl_e2m1_encode_sr_ref) with random byte r. The reference's t = fmaf(u, step, a) equals
 * u * step + a in plain fp32: u = r/256 has 8 significant bits and step is a power of two, so
 * the product is exact and the only rounding is the sum's. Its q = min(floor(t/step_t)*step_t,
 * 6) is the largest e2m1 magnitude <= t (step_t is the grid spacing at t; t >= 6 gives 6), so
 * the code is again a count: of the magnitudes 0.5 .. 6 that t reaches. */
static inline uint8_t e2m1_encode_sr(float v, uint32_t r) {
  float a = fabsf(v);
  float u = (float)r * (1.0f / 256.0f);
  float step = a >= 4.0f ? 2.0f : (a >= 2.0f ? 1.0f : 0.5f);
  float t = u * step + a;
  uint32_t m = (uint32_t)(t >= 0.5f) + (t >= 1.0f) + (t >= 1.5f) + (t >= 2.0f) + (t >= 3.0f) + (t >= 4.0f) +
               (t >= 6.0f);
  uint32_t c = ((f2u(v) >> 28) & 8u) | m;
  return (uint8_t)(v != v ? 6u : c);
}

/* ---- Philox in lanes ------------------------------------------------------------------------ */

/* out[w][l] = word w of nvl_philox_words(seed, offset, g[l]) for NVL_SR_LANES counters at once
 * (the same Philox4x32-10 as core/philox.c, counter (g lo, offset lo, offset hi, g hi), written
 * lane-wise so the compiler can use SIMD 32x32->64 multiplies). */
static void philox_lanes(uint32_t out[4][NVL_SR_LANES], const uint64_t g[NVL_SR_LANES], uint64_t seed,
                         uint64_t offset) {
  uint32_t c0[NVL_SR_LANES], c1[NVL_SR_LANES], c2[NVL_SR_LANES], c3[NVL_SR_LANES];
  for (int l = 0; l < NVL_SR_LANES; l++) {
    c0[l] = (uint32_t)g[l];
    c1[l] = (uint32_t)offset;
    c2[l] = (uint32_t)(offset >> 32);
    c3[l] = (uint32_t)(g[l] >> 32);
  }
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; round++) {
    for (int l = 0; l < NVL_SR_LANES; l++) {
      uint64_t p0 = (uint64_t)0xD2511F53u * c0[l];
      uint64_t p1 = (uint64_t)0xCD9E8D57u * c2[l];
      uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[l] ^ k0;
      uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = (uint32_t)p1;
      c3[l] = (uint32_t)p0;
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int l = 0; l < NVL_SR_LANES; l++) {
    out[0][l] = c0[l];
    out[1][l] = c1[l];
    out[2][l] = c2[l];
    out[3][l] = c3[l];
  }
}

/* ---- NVFP4 ---------------------------------------------------------------------------------- */

/* Per-call constants: s_enc * (1/6) and the encode scale se for every stored scale byte,
 * se = min(1 / (float(sd) * s_dec), FLT_MAX) exactly as the reference computes it per block
 * (the scale byte is at most 0x7F, so 128 entries cover every block). */
typedef struct {
  float s_enc6;
  float se[128];
} nvfp4_consts;

static void nvfp4_consts_init(nvfp4_consts *c, float s_enc) {
  float s_dec = 1.0f / s_enc;
  c->s_enc6 = s_enc * (1.0f / 6.0f);
  for (int i = 0; i < 128; i++) c->se[i] = fminf(1.0f / (nvl_ue4m3_decode_ref((uint8_t)i) * s_dec), FLT_MAX);
}

/* nvl_nvfp4_block_scale_ref. */
static inline uint8_t nvfp4_scale(const nvfp4_consts *c, float bmax) {
  return ue4m3_encode(fminf(bmax * c->s_enc6, FLT_MAX));
}

/* One 1x16 block x (16) -> packed (8), RNE, with encode scale se. */
static inline void nvfp4_block_rne(uint8_t *restrict packed, const float *restrict x, float se) {
  uint8_t q[16];
  for (int j = 0; j < 16; j++) q[j] = e2m1_encode(x[j] * se);
  for (int j = 0; j < 8; j++) packed[j] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
}

/* The same under SR: element j uses byte j%4 of word j/4 (lowest first) of the block's draw,
 * here words w[0..3][lane]. */
static inline void nvfp4_block_sr(uint8_t *restrict packed, const float *restrict x, float se,
                                  const uint32_t w[4][NVL_SR_LANES], int lane) {
  uint8_t q[16];
  for (int j = 0; j < 16; j++) q[j] = e2m1_encode_sr(x[j] * se, (w[j / 4][lane] >> (8 * (j % 4))) & 0xFFu);
  for (int j = 0; j < 8; j++) packed[j] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
}

/* 1D: blocks [g0, g1) of x, each with its own max. */
static void nvfp4_1d_range(uint8_t *packed, uint8_t *scales, const float *x, int64_t g0, int64_t g1,
                           const nvfp4_consts *c, const nvl_nvfp4_ref_opts *o) {
  if (!o->sr) {
    for (int64_t g = g0; g < g1; g++) {
      uint8_t sd = nvfp4_scale(c, absmax16(x + 16 * g));
      scales[g] = sd;
      nvfp4_block_rne(packed + 8 * g, x + 16 * g, c->se[sd]);
    }
    return;
  }
  for (int64_t gl = g0; gl < g1; gl += NVL_SR_LANES) {
    uint64_t gs[NVL_SR_LANES];
    uint32_t w[4][NVL_SR_LANES];
    for (int l = 0; l < NVL_SR_LANES; l++) gs[l] = (uint64_t)(gl + l);
    philox_lanes(w, gs, o->seed, o->offset);
    int nl = g1 - gl < NVL_SR_LANES ? (int)(g1 - gl) : NVL_SR_LANES;
    for (int l = 0; l < nl; l++) {
      int64_t g = gl + l;
      uint8_t sd = nvfp4_scale(c, absmax16(x + 16 * g));
      scales[g] = sd;
      nvfp4_block_sr(packed + 8 * g, x + 16 * g, c->se[sd], w, l);
    }
  }
}

/* 2D: the 16x16 tile whose top-left element is x[r0, 16 b]: one max, shared by its 16 blocks
 * g = (r0 + i) * nb + b. */
static void nvfp4_2d_tile(uint8_t *packed, uint8_t *scales, const float *x, int64_t r0, int64_t b, int64_t K,
                          const nvfp4_consts *c, const nvl_nvfp4_ref_opts *o) {
  int64_t nb = K / 16;
  const float *xt = x + r0 * K + 16 * b;
  float tmax = 0.0f;
  for (int i = 0; i < 16; i++) {
    float m = absmax16(xt + i * K);
    tmax = m > tmax ? m : tmax;
  }
  uint8_t sd = nvfp4_scale(c, tmax);
  float se = c->se[sd];
  uint64_t gs[NVL_SR_LANES];
  uint32_t w[4][NVL_SR_LANES];
  if (o->sr) {
    for (int i = 0; i < 16; i++) gs[i] = (uint64_t)((r0 + i) * nb + b);
    philox_lanes(w, gs, o->seed, o->offset);
  }
  for (int i = 0; i < 16; i++) {
    int64_t g = (r0 + i) * nb + b;
    scales[g] = sd;
    if (o->sr) nvfp4_block_sr(packed + 8 * g, xt + i * K, se, w, i);
    else nvfp4_block_rne(packed + 8 * g, xt + i * K, se);
  }
}

nvl_status nvl_nvfp4_quantize_cpu(uint8_t *packed, uint8_t *scales, float *amax_out, const float *x, int64_t rows,
                                  int64_t K, int block2d, const nvl_nvfp4_ref_opts *opts) {
  static const nvl_nvfp4_ref_opts defaults;
  const nvl_nvfp4_ref_opts *o = opts ? opts : &defaults;
  if (rows < 0 || K < 0 || K % 16 || (block2d && rows % 16))
    return nvl_error(NVL_EINVAL, "nvfp4_quantize_cpu: shape [%lld,%lld] is not a whole number of %s blocks",
                     (long long)rows, (long long)K, block2d ? "16x16" : "1x16");
  int64_t n = rows * K;
  float amax = o->has_amax ? o->amax : absmax_cpu(x, n);
  nvfp4_consts c;
  nvfp4_consts_init(&c, nvl_nvfp4_enc_scale_ref(amax));
  if (block2d) {
    int64_t nb = K / 16, ntiles = (rows / 16) * nb;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t t = 0; t < ntiles; t++) nvfp4_2d_tile(packed, scales, x, 16 * (t / nb), t % nb, K, &c, o);
  } else {
    int64_t nblk = n / 16, per = 4 * NVL_SR_LANES; /* blocks per work item, a whole number of lane groups */
    int64_t nitems = (nblk + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t it = 0; it < nitems; it++) {
      int64_t g0 = it * per, g1 = g0 + per < nblk ? g0 + per : nblk;
      nvfp4_1d_range(packed, scales, x, g0, g1, &c, o);
    }
  }
  if (amax_out) *amax_out = amax;
  return NVL_OK;
}

nvl_status nvl_nvfp4_dequantize_cpu(float *y, const uint8_t *packed, const uint8_t *scales, float amax, int64_t rows,
                                    int64_t K) {
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "nvfp4_dequantize_cpu: shape [%lld,%lld] is not a whole number of 1x16 blocks",
                     (long long)rows, (long long)K);
  static const float v[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  float s_dec = nvl_nvfp4_dec_scale_ref(amax);
  int64_t n = rows * K, nblk = n / 16;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t g = 0; g < nblk; g++) {
    float sd = nvl_ue4m3_decode_ref(scales[g]);
    const uint8_t *p = packed + 8 * g;
    float *yb = y + 16 * g;
    for (int j = 0; j < 8; j++) { /* (value * sd) * s_dec, the reference's order */
      yb[2 * j] = v[p[j] & 0xF] * sd * s_dec;
      yb[2 * j + 1] = v[p[j] >> 4] * sd * s_dec;
    }
  }
  return NVL_OK;
}

/* ---- MXFP8 ---------------------------------------------------------------------------------- */

static nvl_status check_elem(const char *op, nvl_fp8_elem elem) {
  if ((int)elem < 0 || elem >= NVL_ELEM_COUNT)
    return nvl_error(NVL_EINVAL, "%s: invalid fp8 element format %d", op, (int)elem);
  return NVL_OK;
}

/* 2^(127 - e) for an e8m0 code e (NaN for 0xFF), as the reference's ldexpf: normal for e <= 253,
 * 2^-127 (subnormal, bits 1 << 22) for e = 254. */
static inline float e8m0_inverse(uint8_t e) {
  if (e == 0xFF) return NAN;
  return e == 254 ? u2f(1u << 22) : u2f((uint32_t)(254 - e) << 23);
}

/* Blocks [g0, g1) of 32 elements; elem fixed per instantiation so the encoder is specialised. */
static inline void mxfp8_range(uint8_t *codes, uint8_t *scales, const float *x, int64_t g0, int64_t g1,
                               nvl_fp8_elem elem, nvl_mx_rule rule) {
  float emaxv = nvl_fp8_max_ref(elem);
  int emax = nvl_fp8_emax_ref(elem);
  for (int64_t g = g0; g < g1; g++) {
    const float *xb = x + 32 * g;
    float m0 = absmax16(xb), m1 = absmax16(xb + 16);
    float bmax = m1 > m0 ? m1 : m0;
    uint8_t e = rule == NVL_MX_RCEIL ? nvl_e8m0_scale_rceil_ref(bmax, emaxv) : nvl_e8m0_scale_floor_ref(bmax, emax);
    float inv = e8m0_inverse(e);
    scales[g] = e;
    uint8_t *cb = codes + 32 * g;
    if (elem == NVL_ELEM_E5M2)
      for (int j = 0; j < 32; j++) cb[j] = e5m2_encode(xb[j] * inv);
    else
      for (int j = 0; j < 32; j++) cb[j] = e4m3_encode(xb[j] * inv);
  }
}

nvl_status nvl_mxfp8_quantize_cpu(uint8_t *codes, uint8_t *scales, const float *x, int64_t rows, int64_t K,
                                  nvl_fp8_elem elem, nvl_mx_rule rule) {
  NVL_TRY(check_elem("mxfp8_quantize_cpu", elem));
  if ((int)rule < 0 || rule >= NVL_MX_RULE_COUNT)
    return nvl_error(NVL_EINVAL, "mxfp8_quantize_cpu: invalid scale rule %d", (int)rule);
  if (rows < 0 || K < 0 || K % 32)
    return nvl_error(NVL_EINVAL, "mxfp8_quantize_cpu: shape [%lld,%lld] is not a whole number of 1x32 blocks",
                     (long long)rows, (long long)K);
  int64_t n = rows * K, nblk = n / 32, per = 64;
  int64_t nitems = (nblk + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t it = 0; it < nitems; it++) {
    int64_t g0 = it * per, g1 = g0 + per < nblk ? g0 + per : nblk;
    if (elem == NVL_ELEM_E5M2) mxfp8_range(codes, scales, x, g0, g1, NVL_ELEM_E5M2, rule);
    else mxfp8_range(codes, scales, x, g0, g1, NVL_ELEM_E4M3, rule);
  }
  return NVL_OK;
}

/* ---- FP8 per tensor ------------------------------------------------------------------------- */

nvl_status nvl_fp8_quantize_tensor_cpu(uint8_t *codes, float *scale, float *amax, const float *x, int64_t n,
                                       nvl_fp8_elem elem, const float *amax_in) {
  NVL_TRY(check_elem("fp8_quantize_tensor_cpu", elem));
  if (n < 0) return nvl_error(NVL_EINVAL, "fp8_quantize_tensor_cpu: negative size %lld", (long long)n);
  float a = amax_in ? *amax_in : absmax_cpu(x, n);
  float s = nvl_fp8_tensor_scale_ref(a, elem);
  if (elem == NVL_ELEM_E5M2) {
#pragma omp parallel for simd schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t i = 0; i < n; i++) codes[i] = e5m2_encode(x[i] * s);
  } else {
#pragma omp parallel for simd schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t i = 0; i < n; i++) codes[i] = e4m3_encode(x[i] * s);
  }
  if (scale) *scale = s;
  if (amax) *amax = a;
  return NVL_OK;
}

/* ---- RHT ------------------------------------------------------------------------------------ */

/* One 16-chunk in the contract's order (nvl_rht16_ref): sign, butterflies h = 1, 2, 4, 8, * 0.25.
 * y may alias x: x is read whole before y is written. */
static inline void rht16(float *y, const float *x, const float *s) {
  float t[16];
  for (int i = 0; i < 16; i++) t[i] = s[i] * x[i];
  for (int h = 1; h < 16; h *= 2)
    for (int base = 0; base < 16; base += 2 * h)
      for (int j = base; j < base + h; j++) {
        float a = t[j], b = t[j + h];
        t[j] = a + b;
        t[j + h] = a - b;
      }
  for (int i = 0; i < 16; i++) y[i] = t[i] * 0.25f;
}

nvl_status nvl_rht16_rows_cpu(float *y, const float *x, int64_t rows, int64_t K, const float *signs) {
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "rht16_rows_cpu: K = %lld is not a multiple of 16 (rows %lld)", (long long)K,
                     (long long)rows);
  float s[16];
  memcpy(s, signs ? signs : nvl_rht16_default_signs, sizeof s);
  int64_t n = rows * K, nchunk = n / 16;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t c = 0; c < nchunk; c++) rht16(y + 16 * c, x + 16 * c, s);
  return NVL_OK;
}
