/* formats_ref.c: scalar reference codecs and block quantizers (see formats_ref.h).
 * Written to be read next to core/NUMERICS.md: every fp32 operation of the contract is one C float
 * operation here, in the contract's order (this file needs FLT_EVAL_METHOD 0, i.e. SSE/NEON
 * float arithmetic, no -ffast-math, and fp32 subnormals kept). Not here: speed. */
#include "cpu/ref/formats_ref.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "philox.h"

/* ---- fp8 element formats: one description, one encoder, one decoder ------------------------ */

typedef struct {
  int mbits;     /* mantissa bits */
  int bias;      /* exponent bias */
  int emin;      /* unbiased exponent of the smallest normal, 1 - bias */
  float max;     /* largest finite value */
  int has_inf;   /* 1: exponent field all ones is inf (mantissa 0) or NaN (IEEE-like, e5m2) */
  uint8_t nan;   /* the NaN code we write (sign bit added from the input) */
} minifloat;

static const minifloat E4M3 = {3, 7, -6, 448.0f, 0, 0x7F};
static const minifloat E5M2 = {2, 15, -14, 57344.0f, 1, 0x7F};

/* Bits (without sign) of v, a non-negative value exactly representable in f. */
static uint8_t minifloat_bits(const minifloat *f, float v) {
  if (v == 0.0f) return 0;
  int e;
  frexpf(v, &e);
  e -= 1;  /* v in [2^e, 2^(e+1)) */
  if (e < f->emin) return (uint8_t)(v / ldexpf(1.0f, f->emin - f->mbits));  /* subnormal */
  int mant = (int)(v / ldexpf(1.0f, e - f->mbits)) - (1 << f->mbits);
  return (uint8_t)(((e + f->bias) << f->mbits) | mant);
}

/* fp32 -> code: RNE at the format's precision, then saturate to +-max (satfinite). */
static uint8_t minifloat_encode(const minifloat *f, float x) {
  uint8_t sign = signbit(x) ? 0x80 : 0;
  if (isnan(x)) return f->nan | sign;
  float a = fabsf(x);
  float v;
  if (a >= f->max) {
    v = f->max;  /* satfinite: everything above max, inf included (e4m3: 464 -> 448) */
  } else {       /* max is representable and rounding is monotone: a < max stays <= max */
    int e;
    frexpf(a, &e);
    e -= 1;                       /* a in [2^e, 2^(e+1)) */
    if (e < f->emin) e = f->emin; /* subnormals share the quantum of the lowest binade */
    float quantum = ldexpf(1.0f, e - f->mbits);
    v = rintf(a / quantum) * quantum;  /* the division and product are exact (power of 2); rintf
                                        * rounds half to even in the default rounding mode */
  }
  return sign | minifloat_bits(f, v);
}

static float minifloat_decode(const minifloat *f, uint8_t c) {
  int mmask = (1 << f->mbits) - 1;
  int field = (c & 0x7F) >> f->mbits, mant = c & mmask;
  int field_max = 0x7F >> f->mbits;
  float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (f->has_inf && field == field_max) return mant ? NAN : sign * INFINITY;
  if (!f->has_inf && field == field_max && mant == mmask) return NAN;
  if (field == 0) return sign * ldexpf((float)mant, f->emin - f->mbits);
  return sign * ldexpf((float)((1 << f->mbits) + mant), field - f->bias - f->mbits);
}

uint8_t nvl_e4m3_encode_ref(float x) { return minifloat_encode(&E4M3, x); }
float nvl_e4m3_decode_ref(uint8_t c) { return minifloat_decode(&E4M3, c); }
uint8_t nvl_e5m2_encode_ref(float x) { return minifloat_encode(&E5M2, x); }
float nvl_e5m2_decode_ref(uint8_t c) { return minifloat_decode(&E5M2, c); }


/* ---- ue4m3 ---------------------------------------------------------------------------------- */

uint8_t nvl_ue4m3_encode_ref(float x) {
  if (isnan(x)) return 0x7F;
  if (!(x > 0.0f)) return 0x00;  /* 0, -0 and (out of contract) negatives */
  return minifloat_encode(&E4M3, x);
}

float nvl_ue4m3_decode_ref(uint8_t c) { return minifloat_decode(&E4M3, c & 0x7F); }

/* ---- e2m1 ----------------------------------------------------------------------------------- */

static const float e2m1_values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

uint8_t nvl_e2m1_encode_ref(float x) {
  if (isnan(x)) return 6;
  uint8_t sign = signbit(x) ? 8 : 0;
  float a = fabsf(x);
  uint8_t m;
  /* NUMERICS §1 thresholds: <= where the tie goes down (to the even code), < where it goes up. */
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;
  return sign | m;
}

float nvl_e2m1_decode_ref(uint8_t c) {
  float v = e2m1_values[c & 7];
  return (c & 8) ? -v : v;
}

uint8_t nvl_e2m1_encode_sr_ref(float x, uint8_t r) {
  if (isnan(x)) return 6;
  float u = (float)r / 256.0f;
  float a = fabsf(x);
  float step = a >= 4.0f ? 2.0f : (a >= 2.0f ? 1.0f : 0.5f);
  float t = fmaf(u, step, a);
  float step_t = t >= 4.0f ? 2.0f : (t >= 2.0f ? 1.0f : 0.5f);
  float q = fminf(floorf(t / step_t) * step_t, 6.0f);  /* one of the 8 magnitudes, exactly */
  return (uint8_t)((signbit(x) ? 8 : 0) | (nvl_e2m1_encode_ref(q) & 7));
}

/* ---- element codecs by nvl_elem ----------------------------------------------------------- */

uint8_t nvl_elem_encode_ref(nvl_elem elem, float x) {
  return elem == NVL_ELEM_E2M1 ? nvl_e2m1_encode_ref(x) : minifloat_encode(elem == NVL_ELEM_E5M2 ? &E5M2 : &E4M3, x);
}

float nvl_elem_decode_ref(nvl_elem elem, uint8_t c) {
  return elem == NVL_ELEM_E2M1 ? nvl_e2m1_decode_ref(c) : minifloat_decode(elem == NVL_ELEM_E5M2 ? &E5M2 : &E4M3, c);
}

float nvl_elem_max_ref(nvl_elem elem) { return elem == NVL_ELEM_E2M1 ? 6.0f : elem == NVL_ELEM_E5M2 ? E5M2.max : E4M3.max; }

int nvl_elem_emax_ref(nvl_elem elem) { return elem == NVL_ELEM_E2M1 ? 2 : elem == NVL_ELEM_E5M2 ? 15 : 8; }

void nvl_e2m1_pack_ref(uint8_t *packed, const uint8_t *codes, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    uint8_t lo = codes[i] & 0xF, hi = (i + 1 < n) ? (codes[i + 1] & 0xF) : 0;
    packed[i / 2] = (uint8_t)(lo | (hi << 4));
  }
}

void nvl_e2m1_unpack_ref(uint8_t *codes, const uint8_t *packed, int64_t n) {
  for (int64_t i = 0; i < n; i++) codes[i] = (i % 2) ? (packed[i / 2] >> 4) : (packed[i / 2] & 0xF);
}

/* ---- e8m0 ----------------------------------------------------------------------------------- */

float nvl_e8m0_decode_ref(uint8_t c) { return c == 0xFF ? NAN : ldexpf(1.0f, (int)c - 127); }

uint8_t nvl_e8m0_scale_rceil_ref(float bmax, float elem_max) {
  float q = bmax / elem_max;
  if (isnan(q)) return 0xFF;
  if (!(q > 0.0f)) return 0;
  if (isinf(q)) return 254;
  uint32_t b;
  memcpy(&b, &q, 4);
  uint32_t exp = b >> 23, mant = b & 0x7FFFFF;
  if (exp == 0) return mant <= 0x400000 ? 0 : 1;  /* subnormal q = mant * 2^-149: 2^-127 covers it
                                                   * iff mant <= 2^22, else 2^-126 does */
  uint32_t e = exp + (mant != 0);                 /* round the power of two up */
  return (uint8_t)(e > 254 ? 254 : e);
}

uint8_t nvl_e8m0_scale_floor_ref(float bmax, int emax_elem) {
  if (isnan(bmax)) return 0xFF;
  if (!(bmax > 0.0f)) return 0;
  if (isinf(bmax)) return 254;
  int e;
  frexpf(bmax, &e);  /* bmax in [2^(e-1), 2^e): floor(log2 bmax) = e - 1 (subnormals too) */
  int code = (e - 1) - emax_elem + 127;
  return (uint8_t)(code < 0 ? 0 : code > 254 ? 254 : code);
}

/* ---- RHT ------------------------------------------------------------------------------------ */

void nvl_rht16_ref(float y[16], const float x[16], const float *signs) {
  if (!signs) signs = nvl_rht16_default_signs;
  float t[16];
  for (int i = 0; i < 16; i++) t[i] = signs[i] * x[i];
  for (int h = 1; h < 16; h *= 2)        /* butterflies: pairs (j, j+h) with j mod 2h < h */
    for (int base = 0; base < 16; base += 2 * h)
      for (int j = base; j < base + h; j++) {
        float a = t[j], b = t[j + h];
        t[j] = a + b;
        t[j + h] = a - b;
      }
  for (int i = 0; i < 16; i++) y[i] = t[i] * 0.25f;
}

void nvl_rht16_inverse_ref(float y[16], const float x[16], const float *signs) {
  static const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  if (!signs) signs = nvl_rht16_default_signs;
  float t[16];
  nvl_rht16_ref(t, x, ones); /* H / 4 */
  for (int i = 0; i < 16; i++) y[i] = signs[i] * t[i];
}

nvl_status nvl_rht16_rows_ref(float *y, const float *x, int64_t rows, int64_t K, const float *signs) {
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "rht16_rows_ref: K = %lld is not a multiple of 16 (rows %lld)",
                     (long long)K, (long long)rows);
  for (int64_t i = 0; i < rows * K; i += 16) nvl_rht16_ref(y + i, x + i, signs);
  return NVL_OK;
}

/* ---- non-finite flags ----------------------------------------------------------------------- */

static _Atomic uint32_t host_nonfinite;

void nvl_host_nonfinite_set(uint32_t bits) { atomic_fetch_or_explicit(&host_nonfinite, bits, memory_order_relaxed); }

uint32_t nvl_host_nonfinite_take(void) { return atomic_exchange_explicit(&host_nonfinite, 0u, memory_order_relaxed); }

int nvl_has_nonfinite_ref(const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(x[i])) return 1;
  return 0;
}

/* ---- NVFP4 ---------------------------------------------------------------------------------- */

static float absmax(const float *x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
  return m;
}

float nvl_nvfp4_enc_scale_ref(float amax) {
  if (!(amax > 0.0f) || isinf(amax)) return 1.0f;  /* amax 0 (or nan) -> 1; inf: 2688/inf = 0 -> 1 */
  return fminf(2688.0f / amax, FLT_MAX);
}

float nvl_nvfp4_dec_scale_ref(float amax) {
  if (!(amax > 0.0f) || isinf(amax)) return 1.0f; /* = 1 / enc_scale */
  /* enc_scale clamped to FLT_MAX: its reciprocal as a constant. Written as 1 / enc_scale(amax) after
   * the test 2688 / amax > FLT_MAX, GCC 13.3 -O3 (Ubuntu 24.04) returned 1.0 here: its float range
   * propagation seems to take an infinite quotient for amax == 0 (overflow ignored) and fold the
   * call's "amax > 0" test; GCC 12 does not. Seen on the H200 machine, 2026-11-28. */
  if (2688.0f / amax > FLT_MAX) return 1.0f / FLT_MAX;
  return amax / 2688.0f;
}

uint8_t nvl_nvfp4_block_scale_ref(float bmax, float s_enc) {
  float s_enc6 = s_enc * (1.0f / 6.0f);  /* first, in fp32 (§2) */
  return nvl_ue4m3_encode_ref(fminf(bmax * s_enc6, FLT_MAX));
}

/* One 1x16 block x (16) with block max bmax -> codes (16) and its scale byte.
 * rbytes (16) NULL: RNE; else stochastic rounding with those random bytes. */
static uint8_t nvfp4_block(uint8_t *codes, const float *x, float bmax, float s_enc, float s_dec,
                           const uint8_t *rbytes) {
  uint8_t sd = nvl_nvfp4_block_scale_ref(bmax, s_enc);
  float se = fminf(1.0f / (nvl_ue4m3_decode_ref(sd) * s_dec), FLT_MAX);  /* all-zero: FLT_MAX */
  for (int j = 0; j < 16; j++) {
    float v = x[j] * se;
    codes[j] = rbytes ? nvl_e2m1_encode_sr_ref(v, rbytes[j]) : nvl_e2m1_encode_ref(v);
  }
  return sd;
}

/* The 16 SR bytes of group g: byte j = byte (j mod 4) of word (j div 4), low byte first. */
static void sr_bytes(uint8_t r[16], const nvl_quant_ref_opts *o, uint64_t g) {
  uint32_t w[4];
  nvl_philox_words(o->seed, o->offset, (uint64_t)g, w);
  for (int j = 0; j < 16; j++) r[j] = (uint8_t)(w[j / 4] >> (8 * (j % 4)));
}

nvl_status nvl_sr_check_slab(const char *op, const nvl_quant_ref_opts *o, int64_t K, int block) {
  if (!o) return NVL_OK;
  int64_t kt = o->sr_k_total ? o->sr_k_total : K;
  if (o->sr_row_offset < 0 || o->sr_k_offset < 0 || o->sr_k_total < 0 || o->sr_k_offset % block || kt % block ||
      o->sr_k_offset > kt - K)
    return nvl_error(NVL_EINVAL, "%s: SR slab offsets (row %lld, k %lld, k total %lld) do not fit a block "
                     "length of %lld (offsets >= 0, k offset and total multiples of %d, k offset + %lld <= total)",
                     op, (long long)o->sr_row_offset, (long long)o->sr_k_offset, (long long)o->sr_k_total,
                     (long long)K, block, (long long)K);
  return NVL_OK;
}

static nvl_status nvfp4_quantize(const char *op, int two_d, uint8_t *codes, uint8_t *scales, float *amax_out,
                                 const float *x, int64_t rows, int64_t K, const nvl_quant_ref_opts *opts) {
  static const nvl_quant_ref_opts defaults;
  const nvl_quant_ref_opts *o = opts ? opts : &defaults;
  if (rows < 0 || K < 0 || K % 16 || (two_d && rows % 16))
    return nvl_error(NVL_EINVAL, "%s: shape [%lld,%lld] is not a whole number of %s blocks", op,
                     (long long)rows, (long long)K, two_d ? "16x16" : "1x16");
  NVL_TRY(nvl_sr_check_slab(op, o, K, 16));
  float amax = o->has_amax ? o->amax : absmax(x, rows * K);
  float s_enc = nvl_nvfp4_enc_scale_ref(amax);
  float s_dec = 1.0f / s_enc;
  int64_t nb = K / 16;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t b = 0; b < nb; b++) {
      const float *xb = x + r * K + b * 16;
      float bmax;
      if (two_d) {  /* the max over the whole 16x16 tile holding this block */
        int64_t r0 = r - r % 16;
        bmax = 0.0f;
        for (int64_t i = r0; i < r0 + 16; i++) bmax = fmaxf(bmax, absmax(x + i * K + b * 16, 16));
      } else {
        bmax = absmax(xb, 16);
      }
      uint8_t rb[16];
      if (o->sr) sr_bytes(rb, o, nvl_sr_group(o, K, r, b));  /* r * nb + b for a whole tensor */
      scales[r * nb + b] = nvfp4_block(codes + r * K + b * 16, xb, bmax, s_enc, s_dec, o->sr ? rb : NULL);
    }
  }
  if (amax_out) *amax_out = amax;
  return NVL_OK;
}

nvl_status nvl_nvfp4_quantize_1d_ref(uint8_t *codes, uint8_t *scales, float *amax, const float *x,
                                     int64_t rows, int64_t K, const nvl_quant_ref_opts *opts) {
  return nvfp4_quantize("nvfp4_quantize_1d_ref", 0, codes, scales, amax, x, rows, K, opts);
}

nvl_status nvl_nvfp4_quantize_2d_ref(uint8_t *codes, uint8_t *scales, float *amax, const float *x,
                                     int64_t rows, int64_t K, const nvl_quant_ref_opts *opts) {
  return nvfp4_quantize("nvfp4_quantize_2d_ref", 1, codes, scales, amax, x, rows, K, opts);
}

nvl_status nvl_nvfp4_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, float amax,
                                    int64_t rows, int64_t K) {
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "nvfp4_dequantize_ref: shape [%lld,%lld] is not a whole number of 1x16 blocks",
                     (long long)rows, (long long)K);
  float s_dec = nvl_nvfp4_dec_scale_ref(amax);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k++) {
      float sd = nvl_ue4m3_decode_ref(scales[r * (K / 16) + k / 16]);
      y[r * K + k] = nvl_e2m1_decode_ref(codes[r * K + k]) * sd * s_dec;  /* first product exact */
    }
  return NVL_OK;
}

/* ---- MX formats ------------------------------------------------------------------------------ */

static nvl_status check_elem(const char *op, nvl_elem elem) {
  if ((int)elem < 0 || elem >= NVL_ELEM_COUNT) return nvl_error(NVL_EINVAL, "%s: invalid element codec %d", op, (int)elem);
  return NVL_OK;
}

/* Per-tensor fp8 takes the two fp8 codecs only. */
static nvl_status check_fp8(const char *op, nvl_elem elem) {
  if (elem != NVL_ELEM_E4M3 && elem != NVL_ELEM_E5M2)
    return nvl_error(NVL_EINVAL, "%s: invalid fp8 element format %d", op, (int)elem);
  return NVL_OK;
}

nvl_status nvl_mx_quantize_ref(uint8_t *codes, uint8_t *scales, const float *x, int64_t rows, int64_t K, nvl_elem elem,
                               nvl_mx_rule rule, const nvl_quant_ref_opts *opts) {
  static const nvl_quant_ref_opts defaults;
  const nvl_quant_ref_opts *o = opts ? opts : &defaults;
  NVL_TRY(check_elem("mx_quantize_ref", elem));
  if ((int)rule < 0 || rule >= NVL_MX_RULE_COUNT)
    return nvl_error(NVL_EINVAL, "mx_quantize_ref: invalid scale rule %d", (int)rule);
  if (rows < 0 || K < 0 || K % 32)
    return nvl_error(NVL_EINVAL, "mx_quantize_ref: shape [%lld,%lld] is not a whole number of 1x32 blocks",
                     (long long)rows, (long long)K);
  if (o->sr && elem != NVL_ELEM_E2M1)
    return nvl_error(NVL_EINVAL, "mx_quantize_ref: stochastic rounding is defined for e2m1 elements only");
  NVL_TRY(nvl_sr_check_slab("mx_quantize_ref", o, K, 32));
  int64_t nb = K / 32;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < nb; b++) {
      const float *xb = x + r * K + b * 32;
      float bmax = absmax(xb, 32);
      uint8_t e = rule == NVL_MX_RCEIL ? nvl_e8m0_scale_rceil_ref(bmax, nvl_elem_max_ref(elem))
                                       : nvl_e8m0_scale_floor_ref(bmax, nvl_elem_emax_ref(elem));
      float inv = e == 0xFF ? NAN : ldexpf(1.0f, 127 - (int)e);  /* 2^(127-e), exact in fp32 */
      uint8_t rb[32];
      if (o->sr) {
        sr_bytes(rb, o, nvl_sr_group(o, K, r, 2 * b));
        sr_bytes(rb + 16, o, nvl_sr_group(o, K, r, 2 * b + 1));
      }
      scales[r * nb + b] = e;
      for (int j = 0; j < 32; j++)
        codes[r * K + b * 32 + j] = o->sr ? nvl_e2m1_encode_sr_ref(xb[j] * inv, rb[j]) : nvl_elem_encode_ref(elem, xb[j] * inv);
    }
  return NVL_OK;
}

nvl_status nvl_mx_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K,
                                 nvl_elem elem) {
  NVL_TRY(check_elem("mx_dequantize_ref", elem));
  if (rows < 0 || K < 0 || K % 32)
    return nvl_error(NVL_EINVAL, "mx_dequantize_ref: shape [%lld,%lld] is not a whole number of 1x32 blocks",
                     (long long)rows, (long long)K);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k++)
      y[r * K + k] = nvl_elem_decode_ref(elem, codes[r * K + k]) * nvl_e8m0_decode_ref(scales[r * (K / 32) + k / 32]);
  return NVL_OK;
}

/* ---- FP8 per tensor ------------------------------------------------------------------------- */

float nvl_fp8_tensor_scale_ref(float amax, nvl_elem elem) {
  if (amax == 0.0f || !isfinite(amax)) return 1.0f;
  float s = nvl_elem_max_ref(elem) / amax;
  return isinf(s) ? FLT_MAX : s;
}

nvl_status nvl_fp8_quantize_tensor_ref(uint8_t *codes, float *scale, float *amax, const float *x,
                                       int64_t n, nvl_elem elem, const float *amax_in) {
  NVL_TRY(check_fp8("fp8_quantize_tensor_ref", elem));
  if (n < 0) return nvl_error(NVL_EINVAL, "fp8_quantize_tensor_ref: negative size %lld", (long long)n);
  float a = amax_in ? *amax_in : absmax(x, n);
  float s = nvl_fp8_tensor_scale_ref(a, elem);
  for (int64_t i = 0; i < n; i++) codes[i] = nvl_elem_encode_ref(elem, x[i] * s);
  if (scale) *scale = s;
  if (amax) *amax = a;
  return NVL_OK;
}

nvl_status nvl_fp8_dequantize_tensor_ref(float *y, const uint8_t *codes, float scale, int64_t n,
                                         nvl_elem elem) {
  NVL_TRY(check_fp8("fp8_dequantize_tensor_ref", elem));
  if (n < 0) return nvl_error(NVL_EINVAL, "fp8_dequantize_tensor_ref: negative size %lld", (long long)n);
  for (int64_t i = 0; i < n; i++) y[i] = nvl_elem_decode_ref(elem, codes[i]) / scale;
  return NVL_OK;
}
