/* qentry_ref.c: the quantization entries of the reference table (core/backend.h): for each scale
 * kind a quantize driver (x gathered into the blocked layout, the RHT, the reference quantizer of
 * formats_ref.c, 4-bit codes packed), a decoder, and a plain GEMM on decoded operands. The element
 * codec, block length and factors come from the format's traits row (core/dtype.h), so one driver
 * serves every format of its scale kind.
 * Not here: speed (qentry_cpu.c), validation (core/quant.c). */
#include <math.h>
#include <string.h>

#include "cpu/ref/formats_ref.h"
#include "cpu/ref/gam_ref.h"
#include "cpu/ref/qentry_ref.h"

/* ---- input ---------------------------------------------------------------------------------- */

/* *xp = d's x in the blocked layout (rows, K) as f32, RHT applied: x itself when it already is
 * that, else a copy in scratch. */
static nvl_status blocked_input(nvl_kctx *ctx, const nvl_qdesc *d, const float **xp) {
  int64_t B = d->B, K = d->K, C = d->C, rows = B * C;
  if (C == 1 && d->x_dtype == NVL_F32 && !d->rht) {
    *xp = d->x;
    return NVL_OK;
  }
  float *y; /* (rows, K) */
  NVL_TRY(ctx->scratch(ctx, (size_t)(rows * K) * sizeof(float), (void **)&y));
  for (int64_t b = 0; b < B; b++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t c = 0; c < C; c++) {
        int64_t i = (b * K + k) * C + c;
        y[(b * C + c) * K + k] = d->x_dtype == NVL_BF16 ? nvl_bf16_to_f32(((const uint16_t *)d->x)[i])
                                                         : ((const float *)d->x)[i];
      }
  if (d->rht) {
    NVL_TRY(nvl_rht16_rows_ref(y, y, rows, K, d->signs));
    /* NUMERICS §5: the transform's output has the operand's dtype (TE's bf16 wgrad path) */
    if (d->x_dtype == NVL_BF16)
      for (int64_t i = 0; i < rows * K; i++) y[i] = nvl_bf16_to_f32(nvl_f32_to_bf16(y[i]));
  }
  *xp = y;
  return NVL_OK;
}

/* max |x| as the tensor reduction defines it (NaN if any element is NaN). */
static float amax_of(const float *x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    float a = fabsf(x[i]);
    if (isnan(a)) return a;
    m = a > m ? a : m;
  }
  return m;
}

static nvl_quant_ref_opts ref_opts(const nvl_qdesc *d) {
  nvl_quant_ref_opts o = {.sr = d->sr, .seed = d->seed, .offset = d->offset, .has_amax = d->has_amax, .amax = d->amax,
                          .sr_row_offset = d->sr_row_offset, .sr_k_offset = d->sr_k_offset, .sr_k_total = d->sr_k_total};
  return o;
}

/* Codes one byte per element: the output itself, or (4-bit codes) scratch to be packed after. */
static nvl_status unpacked_codes(nvl_kctx *ctx, const nvl_qdesc *d, uint8_t **codes, int64_t n) {
  if (nvl_dtypes[d->format].bits == 8) {
    *codes = d->codes;
    return NVL_OK;
  }
  return ctx->scratch(ctx, (size_t)n, (void **)codes);
}

static void pack_if_needed(const nvl_qdesc *d, const uint8_t *codes, int64_t n) {
  if (nvl_dtypes[d->format].bits == 4) nvl_e2m1_pack_ref(d->codes, codes, n);
}

/* ---- quantize ------------------------------------------------------------------------------- */

nvl_status nvl_quantize_values_ref(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  NVL_TRY(blocked_input(ctx, d, &x));
  int64_t n = d->B * d->C * d->K;
  if (d->format == NVL_BF16)
    for (int64_t i = 0; i < n; i++) ((uint16_t *)d->codes)[i] = nvl_f32_to_bf16(x[i]);
  else
    memcpy(d->codes, x, (size_t)n * sizeof(float));
  *d->amax_out = amax_of(x, n);
  return NVL_OK;
}

/* The non-finite flag of a quantization into a quantized format (backend.h NVL_NONFINITE_INPUT). */
static void flag_input(const float *x, int64_t n) {
  if (nvl_has_nonfinite_ref(x, n)) nvl_host_nonfinite_set(NVL_NONFINITE_INPUT);
}

nvl_status nvl_quantize_tensor_ref(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  NVL_TRY(blocked_input(ctx, d, &x));
  flag_input(x, d->B * d->C * d->K);
  float scale, given = d->amax;
  return nvl_fp8_quantize_tensor_ref(d->codes, &scale, d->amax_out, x, d->B * d->C * d->K,
                                     (nvl_elem)nvl_dtypes[d->format].elem, d->has_amax ? &given : NULL);
}

nvl_status nvl_quantize_mx_ref(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  uint8_t *codes;
  int64_t rows = d->B * d->C, n = rows * d->K;
  NVL_TRY(blocked_input(ctx, d, &x));
  flag_input(x, n);
  NVL_TRY(unpacked_codes(ctx, d, &codes, n));
  nvl_quant_ref_opts o = ref_opts(d);
  NVL_TRY(nvl_mx_quantize_ref(codes, d->scales, x, rows, d->K, (nvl_elem)nvl_dtypes[d->format].elem, d->rule, &o));
  pack_if_needed(d, codes, n);
  *d->amax_out = amax_of(x, n);
  return NVL_OK;
}

nvl_status nvl_quantize_nvfp4_ref(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  uint8_t *codes;
  int64_t rows = d->B * d->C, n = rows * d->K;
  NVL_TRY(blocked_input(ctx, d, &x));
  flag_input(x, n);
  NVL_TRY(unpacked_codes(ctx, d, &codes, n));
  nvl_quant_ref_opts o = ref_opts(d);
  NVL_TRY((d->block2d ? nvl_nvfp4_quantize_2d_ref : nvl_nvfp4_quantize_1d_ref)(codes, d->scales, d->amax_out, x, rows,
                                                                              d->K, &o));
  pack_if_needed(d, codes, n);
  return NVL_OK;
}

/* ---- dequantize ----------------------------------------------------------------------------- */

/* Rows [r0, r0 + nr) of q's codes, one byte per element (4-bit codes unpacked into scratch). */
static nvl_status codes_of(nvl_kctx *ctx, const uint8_t **out, const nvl_qview *q, int64_t r0, int64_t nr) {
  const uint8_t *c = (const uint8_t *)q->codes + nvl_code_bytes(q->format, r0 * q->K);
  if (nvl_dtypes[q->format].bits == 8) {
    *out = c;
    return NVL_OK;
  }
  uint8_t *u;
  NVL_TRY(ctx->scratch(ctx, (size_t)(nr * q->K), (void **)&u));
  nvl_e2m1_unpack_ref(u, c, nr * q->K);
  *out = u;
  return NVL_OK;
}

nvl_status nvl_dequantize_values_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled) {
  int64_t n = nr * q->K;
  if (q->format == NVL_BF16)
    for (int64_t i = 0; i < n; i++) y[i] = nvl_bf16_to_f32(((const uint16_t *)q->codes)[r0 * q->K + i]);
  else
    memcpy(y, (const float *)q->codes + r0 * q->K, (size_t)n * sizeof(float));
  return NVL_OK;
}

nvl_status nvl_dequantize_tensor_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled) {
  nvl_elem e = (nvl_elem)nvl_dtypes[q->format].elem;
  const uint8_t *c = (const uint8_t *)q->codes + r0 * q->K;
  if (!unscaled) return nvl_fp8_dequantize_tensor_ref(y, c, q->scale, nr * q->K, e); /* value / scale */
  for (int64_t i = 0; i < nr * q->K; i++) y[i] = nvl_elem_decode_ref(e, c[i]);
  return NVL_OK;
}

nvl_status nvl_dequantize_mx_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled) {
  const uint8_t *c;
  NVL_TRY(codes_of(ctx, &c, q, r0, nr)); /* no global factor: scaled and unscaled agree */
  return nvl_mx_dequantize_ref(y, c, q->scales + r0 * (q->K / 32), nr, q->K, (nvl_elem)nvl_dtypes[q->format].elem);
}

nvl_status nvl_dequantize_nvfp4_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                    int unscaled) {
  const uint8_t *c, *s = q->scales + r0 * (q->K / 16);
  NVL_TRY(codes_of(ctx, &c, q, r0, nr));
  if (!unscaled) return nvl_nvfp4_dequantize_ref(y, c, s, q->amax, nr, q->K);
  for (int64_t i = 0; i < nr * q->K; i++) y[i] = nvl_e2m1_decode_ref(c[i]) * nvl_ue4m3_decode_ref(s[i / 16]);
  return NVL_OK;
}

/* ---- GEMM ----------------------------------------------------------------------------------- */

nvl_status nvl_qgemm_ref(nvl_kctx *ctx, const nvl_gemm_desc *g) {
  const nvl_qview *qa = g->a, *qb = g->b;
  int64_t M = qa->rows, N = qb->rows, K = qa->K;
  const nvl_format_kernels *fa = &nvl_backend_ref.formats[qa->format], *fb = &nvl_backend_ref.formats[qb->format];
  if (!fa->dequantize || !fb->dequantize)
    return nvl_error(NVL_EUNSUPPORTED, "qmatmul: %s x %s has no reference decoder", nvl_dtypes[qa->format].name,
                     nvl_dtypes[qb->format].name);
  float *a, *b; /* (M, K), (N, K): values times block scales, exact in fp32 */
  NVL_TRY(ctx->scratch(ctx, (size_t)(M * K + 1) * sizeof(float), (void **)&a));
  NVL_TRY(ctx->scratch(ctx, (size_t)(N * K + 1) * sizeof(float), (void **)&b));
  NVL_TRY(fa->dequantize(ctx, a, qa, 0, M, 1));
  NVL_TRY(fb->dequantize(ctx, b, qb, 0, N, 1));
  float alpha = qa->alpha * qb->alpha;
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; k++) acc += (double)a[m * K + k] * b[n * K + k];
      float v = (float)acc;
      if (alpha != 1.0f) v = v * alpha;
      if (g->accumulate) ((float *)g->out)[m * N + n] += v;
      else if (g->out_dtype == NVL_BF16) ((uint16_t *)g->out)[m * N + n] = nvl_f32_to_bf16(v);
      else ((float *)g->out)[m * N + n] = v;
    }
  return NVL_OK;
}

nvl_status nvl_rht_ref(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs,
                       int inverse) {
  if (!inverse) return nvl_rht16_rows_ref(y, x, rows, K, signs);
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "rht_ref: K = %lld is not a multiple of 16 (rows %lld)", (long long)K,
                     (long long)rows);
  for (int64_t i = 0; i < rows * K; i += 16) nvl_rht16_inverse_ref(y + i, x + i, signs);
  return NVL_OK;
}

nvl_status nvl_transpose_tiles_ref(nvl_kctx *ctx, uint8_t *codes_t, uint8_t *scales_t, const uint8_t *codes,
                                   const uint8_t *scales, int64_t R, int64_t K) {
  (void)ctx;
  memset(codes_t, 0, (size_t)(K * R / 2));
  for (int64_t i = 0; i < R; i++)
    for (int64_t k = 0; k < K; k++) {
      uint8_t b = codes[(i * K + k) / 2], code = (k & 1) ? b >> 4 : b & 15;
      codes_t[(k * R + i) / 2] |= (uint8_t)(code << ((i & 1) * 4));
    }
  for (int64_t k = 0; k < K; k++)
    for (int64_t j = 0; j < R / 16; j++) scales_t[k * (R / 16) + j] = scales[(16 * j) * (K / 16) + k / 16];
  return NVL_OK;
}

nvl_status nvl_quantize_gam_ref(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant, const float *x,
                                int64_t rows, int64_t K, int64_t block, int64_t group_blocks, nvl_elem elem) {
  (void)ctx;
  if (block > INT32_MAX) return nvl_error(NVL_EINVAL, "gam_quantize_ref: block length %lld", (long long)block);
  int nonfinite = 0;
  NVL_TRY(nvl_gam_quantize_ref(codes, scales, mant, &nonfinite, x, rows, K, (int)block, group_blocks, elem));
  if (nonfinite) nvl_host_nonfinite_set(NVL_NONFINITE_INPUT);
  return NVL_OK;
}
