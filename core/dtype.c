/* dtype.c: the dtype traits table, its name tables, bf16 conversion, f16 decoding and the decoding of
 * deployment checkpoints' block-scaled weights (see dtype.h). */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "cpu/ref/formats_ref.h"
#include "dtype.h"

float nvl_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0x1f) {
    u = sign | 0x7f800000u | (m << 13); /* inf, NaN with its payload */
  } else if (e != 0) {
    u = sign | ((e + 127 - 15) << 23) | (m << 13); /* normal: exponent rebiased */
  } else {
    float f = (float)m * 0x1p-24f; /* zero or subnormal m * 2^-24: exact (a normal f32) */
    memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

void nvl_f16_to_f32_n(float *dst, const uint8_t *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = nvl_f16_to_f32((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
}

void nvl_decode_scaled_n(float *dst, const uint8_t *codes, const nvl_codec *c, int packed, const float *scales,
                         int64_t rows, int64_t K, int64_t srows, int64_t nb, const nvl_decode_opts *o) {
  int64_t block = scales ? K / nb : K;
  for (int64_t r = 0; r < rows; r++) {
    const float *sr = scales ? scales + (srows == 1 ? 0 : r) * nb : NULL;
    for (int64_t b = 0; b < K / block; b++) {
      float s = sr ? sr[b] : 1.0f;
      if (sr && !o->exact) s = o->divide ? s / o->global : s * o->global; /* the libraries' order: one rounding */
      for (int64_t k = b * block; k < (b + 1) * block; k++) {
        int64_t i = r * K + k;
        uint8_t code = packed ? (uint8_t)((codes[i / 2] >> (4 * (i & 1))) & 0x0f) : codes[i];
        float v = c->decode(code);
        if (o->plus_zero && v == 0.0f) v = 0.0f; /* -0 read as +0 */
        if (!sr) dst[i] = v;
        else if (!o->exact) dst[i] = v * s;
        else dst[i] = o->divide ? (v * s) / o->global : (v * s) * o->global; /* v * s exact: one rounding */
      }
    }
  }
}

/* Double -> float -> bf16 would round twice; round once from double instead. */
static uint16_t f64_to_bf16(double v) {
  float f = (float)v;
  if (isnan(v) || isinf(v) || (double)f == v) return nvl_f32_to_bf16(f);
  /* f is v rounded to 24 bits; if f lies exactly on a bf16 tie, decide the tie from v. */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0xffffu) == 0x8000u) {
    double away = fabs(v) > fabs((double)f); /* v beyond the tie point (in magnitude) */
    uint32_t up = (u & 0xffff0000u) + 0x10000u, down = u & 0xffff0000u;
    return (uint16_t)((away ? up : down) >> 16);
  }
  return nvl_f32_to_bf16(f);
}

/* Float -> integer stores saturate (NaN -> 0): nvl.h nvl_f64_to_i64_sat, NUMERICS §8. */
static int64_t sat_i64(double v, int64_t lo, int64_t hi) { return nvl_f64_to_i64_sat(v, lo, hi); }

static double load_f32(const void *p) { return *(const float *)p; }
static void store_f32(void *p, double v) { *(float *)p = (float)v; }
static int64_t load_i_f32(const void *p) { return sat_i64(*(const float *)p, INT64_MIN, INT64_MAX); }
static void store_i_f32(void *p, int64_t v) { *(float *)p = (float)v; }

static double load_bf16(const void *p) { return nvl_bf16_to_f32(*(const uint16_t *)p); }
static void store_bf16(void *p, double v) { *(uint16_t *)p = f64_to_bf16(v); }
static int64_t load_i_bf16(const void *p) {
  return sat_i64(nvl_bf16_to_f32(*(const uint16_t *)p), INT64_MIN, INT64_MAX);
}
static void store_i_bf16(void *p, int64_t v) { *(uint16_t *)p = f64_to_bf16((double)v); }

static double load_i32(const void *p) { return *(const int32_t *)p; }
static void store_i32(void *p, double v) { *(int32_t *)p = (int32_t)sat_i64(v, INT32_MIN, INT32_MAX); }
static int64_t load_i_i32(const void *p) { return *(const int32_t *)p; }
static void store_i_i32(void *p, int64_t v) { *(int32_t *)p = v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : (int32_t)v; }

static double load_i64(const void *p) { return (double)*(const int64_t *)p; }
static void store_i64(void *p, double v) { *(int64_t *)p = sat_i64(v, INT64_MIN, INT64_MAX); }
static int64_t load_i_i64(const void *p) { return *(const int64_t *)p; }
static void store_i_i64(void *p, int64_t v) { *(int64_t *)p = v; }

static double load_u8(const void *p) { return *(const uint8_t *)p; }
static void store_u8(void *p, double v) { *(uint8_t *)p = (uint8_t)sat_i64(v, 0, 255); }
static int64_t load_i_u8(const void *p) { return *(const uint8_t *)p; }
static void store_i_u8(void *p, int64_t v) { *(uint8_t *)p = v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v; }

/* Per-tensor factors (dtype.h enc_scale / dec_scale). */
static float e4m3_enc_scale(float amax) { return nvl_fp8_tensor_scale_ref(amax, NVL_ELEM_E4M3); }
static float e5m2_enc_scale(float amax) { return nvl_fp8_tensor_scale_ref(amax, NVL_ELEM_E5M2); }
static float fp8_dec_scale(float amax, float enc_scale) { (void)amax; return 1.0f / enc_scale; }
static float nvfp4_dec_scale(float amax, float enc_scale) { (void)enc_scale; return nvl_nvfp4_dec_scale_ref(amax); }

#define PLAIN(nm, bits_, size, flt, rank, sig, maxv, minv, lf, sf, li, si)                              \
  {.name = nm, .bits = bits_, .elem_size = size, .is_float = flt, .promote_rank = rank, .significand_bits = sig, \
   .max_finite = maxv, .min_value = minv, .load_f = lf, .store_f = sf, .load_i = li, .store_i = si, .elem = -1, \
   .bits_per_elem = bits_}
/* A quantized format: element codec e (bits eb, max maxv; its functions: formats_ref.h nvl_elem_*),
 * scale kind sc with blocks of blk along the blocked dim (layout lay), scales of sbits each,
 * rounded by rule; es / ds the per-tensor factors. */
#define QUANT(nm, e, eb, maxv, sc, blk, lay, sbits, rule, es, ds)                                          \
  {.name = nm, .bits = eb, .elem_size = 1, .is_float = 1, .max_finite = maxv, .min_value = -(maxv),        \
   .is_quantized = 1, .elem = e, .scale = sc, .block = blk, .layout = lay, .scale_bits = sbits,            \
   .bits_per_elem = (eb) + (blk ? (double)(sbits) / (blk) : 0.0), .scale_rule = rule,                      \
   .sr = (e) == NVL_ELEM_E2M1, .global_amax = (sc) == NVL_SCALE_TENSOR || (sc) == NVL_SCALE_UE4M3,         \
   .block2d = (sc) == NVL_SCALE_UE4M3, .enc_scale = es, .dec_scale = ds}

const nvl_dtype_traits nvl_dtypes[NVL_DTYPE_COUNT] = {
  [NVL_F32] = PLAIN("f32", 32, 4, 1, 4, 24, 3.4028234663852886e38, -3.4028234663852886e38, load_f32, store_f32, load_i_f32, store_i_f32),
  [NVL_BF16] = PLAIN("bf16", 16, 2, 1, 3, 8, 3.3895313892515355e38, -3.3895313892515355e38, load_bf16, store_bf16, load_i_bf16, store_i_bf16),
  [NVL_I32] = PLAIN("i32", 32, 4, 0, 1, 0, 2147483647.0, -2147483648.0, load_i32, store_i32, load_i_i32, store_i_i32),
  [NVL_I64] = PLAIN("i64", 64, 8, 0, 2, 0, 9223372036854775807.0, -9223372036854775808.0, load_i64, store_i64, load_i_i64, store_i_i64),
  [NVL_U8] = PLAIN("u8", 8, 1, 0, 0, 0, 255.0, 0.0, load_u8, store_u8, load_i_u8, store_i_u8),
  [NVL_E4M3] = QUANT("e4m3", NVL_ELEM_E4M3, 8, 448.0, NVL_SCALE_TENSOR, 0, NVL_LAYOUT_TENSOR, 32, "fp32",
                      e4m3_enc_scale, fp8_dec_scale),
  [NVL_E5M2] = QUANT("e5m2", NVL_ELEM_E5M2, 8, 57344.0, NVL_SCALE_TENSOR, 0, NVL_LAYOUT_TENSOR, 32, "fp32",
                      e5m2_enc_scale, fp8_dec_scale),
  [NVL_MXFP8_E4M3] = QUANT("mxfp8_e4m3", NVL_ELEM_E4M3, 8, 448.0, NVL_SCALE_E8M0, 32, NVL_LAYOUT_1X32, 8, "rceil", NULL, NULL),
  [NVL_MXFP8_E5M2] = QUANT("mxfp8_e5m2", NVL_ELEM_E5M2, 8, 57344.0, NVL_SCALE_E8M0, 32, NVL_LAYOUT_1X32, 8, "rceil", NULL, NULL),
  [NVL_NVFP4] = QUANT("nvfp4", NVL_ELEM_E2M1, 4, 6.0, NVL_SCALE_UE4M3, 16, NVL_LAYOUT_1X16, 8, "rne",
                      nvl_nvfp4_enc_scale_ref, nvfp4_dec_scale),
  [NVL_MXFP4] = QUANT("mxfp4", NVL_ELEM_E2M1, 4, 6.0, NVL_SCALE_E8M0, 32, NVL_LAYOUT_1X32, 8, "rceil", NULL, NULL),
};
_Static_assert(sizeof nvl_dtypes / sizeof nvl_dtypes[0] == NVL_DTYPE_COUNT, "a dtype lacks its traits row");

static const nvl_codec codecs[] = {
  {"e4m3", nvl_e4m3_encode_ref, nvl_e4m3_decode_ref}, {"e5m2", nvl_e5m2_encode_ref, nvl_e5m2_decode_ref},
  {"e2m1", nvl_e2m1_encode_ref, nvl_e2m1_decode_ref}, {"ue4m3", nvl_ue4m3_encode_ref, nvl_ue4m3_decode_ref},
  {"e8m0", NULL, nvl_e8m0_decode_ref}};

const nvl_codec *nvl_codec_from_name(const char *name) {
  for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++)
    if (strcmp(codecs[i].name, name) == 0) return &codecs[i];
  return NULL;
}

const char *nvl_codec_names(void) { return "e4m3, e5m2, e2m1, ue4m3, e8m0"; }

const float nvl_rht16_default_signs[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};

const char *const nvl_layout_names[NVL_LAYOUT_COUNT] = {"none", "tensor", "1x16", "16x16", "1x32"};
const char *const nvl_elem_names[NVL_ELEM_COUNT] = {"e4m3", "e5m2", "e2m1"};
const char *const nvl_scale_kind_names[NVL_SCALE_KIND_COUNT] = {"none", "fp32", "ue4m3", "e8m0"};
const char *const nvl_mx_rule_names[NVL_MX_RULE_COUNT] = {"rceil", "floor"};

nvl_dtype nvl_dtype_from_name(const char *name) {
  for (int i = 0; i < NVL_DTYPE_COUNT; i++)
    if (nvl_dtypes[i].name && strcmp(nvl_dtypes[i].name, name) == 0) return (nvl_dtype)i;
  return NVL_DTYPE_COUNT;
}

static const char *names_where(char *buf, size_t n, int quantized) {
  if (!buf[0]) {
    for (int i = 0; i < NVL_DTYPE_COUNT; i++) {
      if (nvl_dtypes[i].is_quantized != quantized) continue;
      if (buf[0]) strncat(buf, ", ", n - strlen(buf) - 1);
      strncat(buf, nvl_dtypes[i].name, n - strlen(buf) - 1);
    }
  }
  return buf;
}

const char *nvl_dtype_names(void) {
  static char buf[256];
  return names_where(buf, sizeof buf, 0);
}

const char *nvl_qformat_names(void) {
  static char buf[256];
  if (!buf[0]) {
    snprintf(buf, sizeof buf, "f32, bf16, ");
    char q[200] = "";
    strncat(buf, names_where(q, sizeof q, 1), sizeof buf - strlen(buf) - 1);
  }
  return buf;
}

nvl_dtype nvl_dtype_promote(nvl_dtype a, nvl_dtype b) { return nvl_dtypes[a].promote_rank >= nvl_dtypes[b].promote_rank ? a : b; }
