/* qentry_cpu.c: the quantization entries of the CPU table (core/backend.h): per scale kind a
 * quantize driver (x gathered into the blocked layout in cache tiles, the fast RHT, the fast
 * quantizer of quant_cpu.c), a table-driven decoder (dequant_cpu.c), and the emulated GEMM of
 * core/NUMERICS.md §7: operands decoded without their global factors (exact in fp32), one OpenBLAS sgemm,
 * the product of the global factors applied after in fp32. Every entry is bit-identical to its
 * twin in kernels/cpu/ref/qentry_ref.c (the GEMM: within fp32 summation-order error).
 * Not here: validation and allocation of the outputs (core/quant.c). */
#include <math.h>
#include <string.h>

#include "cpu/dequant_cpu.h"
#include "cpu/ops_cpu.h"
#include "cpu/qentry_cpu.h"
#include "cpu/quant_cpu.h"

#define NVL_GATHER_OMP_MIN 32768 /* elements */

/* ---- input ---------------------------------------------------------------------------------- */

/* y (B*C, K) f32 = x (B, K, C) f32 or bf16 with each (K, C) slab transposed, in 32 x 32 tiles. */
static void gather(float *y, const void *x, int x_bf16, int64_t B, int64_t K, int64_t C) {
  int64_t tk = (K + 31) / 32, tc = (C + 31) / 32, ntiles = B * tk * tc;
#pragma omp parallel for schedule(static) if (B * K * C > NVL_GATHER_OMP_MIN)
  for (int64_t t = 0; t < ntiles; t++) {
    int64_t b = t / (tk * tc), k0 = (t / tc) % tk * 32, c0 = t % tc * 32;
    int64_t k1 = k0 + 32 < K ? k0 + 32 : K, c1 = c0 + 32 < C ? c0 + 32 : C;
    for (int64_t c = c0; c < c1; c++)
      for (int64_t k = k0; k < k1; k++) {
        int64_t i = (b * K + k) * C + c;
        y[(b * C + c) * K + k] = x_bf16 ? nvl_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
      }
  }
}

/* *xp = d's x in the blocked layout (rows, K) as f32, RHT applied: x itself when it already is
 * that, else a copy in scratch. */
static nvl_status blocked_input(nvl_kctx *ctx, const nvl_qdesc *d, const float **xp) {
  int64_t rows = d->B * d->C, K = d->K, n = rows * K;
  if (d->C == 1 && d->x_dtype == NVL_F32 && !d->rht) {
    *xp = d->x;
    return NVL_OK;
  }
  float *y; /* (rows, K) */
  NVL_TRY(ctx->scratch(ctx, (size_t)n * sizeof(float), (void **)&y));
  if (d->C == 1 && d->x_dtype == NVL_F32) memcpy(y, d->x, (size_t)n * sizeof(float));
  else if (d->C == 1) nvl_bf16_to_f32_cpu(y, d->x, n);
  else gather(y, d->x, d->x_dtype == NVL_BF16, d->B, K, d->C);
  if (d->rht) {
    NVL_TRY(nvl_rht16_rows_cpu(y, y, rows, K, d->signs));
    /* NUMERICS §5: the transform's output has the operand's dtype (TE's bf16 wgrad path) */
    if (d->x_dtype == NVL_BF16) {
#pragma omp parallel for if (n > 32768)
      for (int64_t i = 0; i < n; i++) y[i] = nvl_bf16_to_f32(nvl_f32_to_bf16(y[i]));
    }
  }
  *xp = y;
  return NVL_OK;
}

static nvl_quant_ref_opts ref_opts(const nvl_qdesc *d) {
  nvl_quant_ref_opts o = {.sr = d->sr, .seed = d->seed, .offset = d->offset, .has_amax = d->has_amax, .amax = d->amax,
                          .sr_row_offset = d->sr_row_offset, .sr_k_offset = d->sr_k_offset, .sr_k_total = d->sr_k_total};
  return o;
}

/* max |x| as the tensor reduction defines it (NaN if any element is NaN). */
static float amax_of(const float *x, int64_t n) { return n ? (float)nvl_reduce_f32_cpu(NVL_RED_AMAX, x, n) : 0.0f; }

/* ---- quantize ------------------------------------------------------------------------------- */

nvl_status nvl_quantize_values_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  NVL_TRY(blocked_input(ctx, d, &x));
  int64_t n = d->B * d->C * d->K;
  if (d->format == NVL_BF16) nvl_f32_to_bf16_cpu(d->codes, x, n);
  else memcpy(d->codes, x, (size_t)n * sizeof(float));
  *d->amax_out = amax_of(x, n);
  return NVL_OK;
}

nvl_status nvl_quantize_tensor_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  NVL_TRY(blocked_input(ctx, d, &x));
  float scale, given = d->amax;
  return nvl_fp8_quantize_tensor_cpu(d->codes, &scale, d->amax_out, x, d->B * d->C * d->K,
                                     (nvl_elem)nvl_dtypes[d->format].elem, d->has_amax ? &given : NULL);
}

nvl_status nvl_quantize_mx_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  int64_t rows = d->B * d->C;
  NVL_TRY(blocked_input(ctx, d, &x));
  nvl_quant_ref_opts o = ref_opts(d);
  NVL_TRY(nvl_mx_quantize_cpu(d->codes, d->scales, x, rows, d->K, (nvl_elem)nvl_dtypes[d->format].elem, d->rule, &o));
  *d->amax_out = amax_of(x, rows * d->K);
  return NVL_OK;
}

nvl_status nvl_quantize_nvfp4_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  NVL_TRY(blocked_input(ctx, d, &x));
  nvl_quant_ref_opts o = ref_opts(d);
  return nvl_nvfp4_quantize_cpu(d->codes, d->scales, d->amax_out, x, d->B * d->C, d->K, d->block2d, &o);
}

/* ---- dequantize ----------------------------------------------------------------------------- */

nvl_status nvl_dequantize_values_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled) {
  int64_t n = nr * q->K;
  if (q->format == NVL_BF16) nvl_bf16_to_f32_cpu(y, (const uint16_t *)q->codes + r0 * q->K, n);
  else memcpy(y, (const float *)q->codes + r0 * q->K, (size_t)n * sizeof(float));
  return NVL_OK;
}

nvl_status nvl_dequantize_tensor_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled) {
  nvl_elem e = (nvl_elem)nvl_dtypes[q->format].elem;
  const uint8_t *c = (const uint8_t *)q->codes + r0 * q->K;
  if (!unscaled) return nvl_fp8_dequantize_tensor_ref(y, c, q->scale, nr * q->K, e); /* value / scale, as the reference */
  nvl_fp8_decode_cpu(y, c, nr * q->K, e, 1.0f);
  return NVL_OK;
}

nvl_status nvl_dequantize_mx_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled) {
  nvl_mx_decode_cpu(y, (const uint8_t *)q->codes + nvl_code_bytes(q->format, r0 * q->K), q->scales + r0 * (q->K / 32),
                    nr, q->K, (nvl_elem)nvl_dtypes[q->format].elem);
  return NVL_OK;
}

nvl_status nvl_dequantize_nvfp4_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                    int unscaled) {
  const uint8_t *c = (const uint8_t *)q->codes + r0 * (q->K / 2), *s = q->scales + r0 * (q->K / 16);
  if (!unscaled) return nvl_nvfp4_dequantize_cpu(y, c, s, q->amax, nr, q->K);
  nvl_nvfp4_decode_unscaled_cpu(y, c, s, nr, q->K); /* value(q) * float(sd): at most 6 significant bits */
  return NVL_OK;
}

/* ---- GEMM ----------------------------------------------------------------------------------- */

/* y (M, N, row stride ldy) = alpha · A·Bᵀ, or, with acc, y += that: A decoded once, B in chunks of
 * rows (a 128k-row LM head never becomes one full-size f32 copy); with acc the chunk's product goes
 * through a scratch of at most ~16 MB so the sum rounds exactly as a separate add would. */
static nvl_status qgemm_into(nvl_kctx *ctx, float *y, int64_t ldy, const nvl_qview *qa, const nvl_qview *qb, int acc) {
  int64_t M = qa->rows, N = qb->rows, K = qa->K;
  const nvl_format_kernels *fa = &nvl_backend_cpu.formats[qa->format], *fb = &nvl_backend_cpu.formats[qb->format];
  int64_t chunk = (int64_t)(1 << 22) / (K > 0 ? K : 1);
  if (acc && M > 0 && (int64_t)(1 << 22) / M < chunk) chunk = (int64_t)(1 << 22) / M;
  if (chunk < 64) chunk = 64;
  if (chunk > N) chunk = N;
  if (chunk < 1) chunk = 1;
  float *a, *b, *sc = NULL; /* (M, K), (chunk, K), acc: (M, chunk) */
  NVL_TRY(ctx->scratch(ctx, (size_t)(M * K + 1) * sizeof(float), (void **)&a));
  NVL_TRY(ctx->scratch(ctx, (size_t)(chunk * K + 1) * sizeof(float), (void **)&b));
  if (acc) NVL_TRY(ctx->scratch(ctx, (size_t)(M * chunk + 1) * sizeof(float), (void **)&sc));
  NVL_TRY(fa->dequantize(ctx, a, qa, 0, M, 1));
  float alpha = qa->alpha * qb->alpha;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    int64_t nr = N - n0 < chunk ? N - n0 : chunk;
    NVL_TRY(fb->dequantize(ctx, b, qb, n0, nr, 1));
    float *dst = acc ? sc : y + n0;
    int64_t ld = acc ? nr : ldy;
    nvl_matmul_f32_abt_cpu(dst, ld, a, b, M, nr, K);
#pragma omp parallel for if (M * nr > 65536)
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < nr; j++) {
        float v = dst[i * ld + j];
        if (alpha != 1.0f) v = v * alpha;
        if (acc) y[i * ldy + n0 + j] = y[i * ldy + n0 + j] + v;
        else dst[i * ld + j] = v;
      }
  }
  return NVL_OK;
}

nvl_status nvl_qgemm_cpu(nvl_kctx *ctx, const nvl_gemm_desc *g) {
  int64_t M = g->a->rows, N = g->b->rows;
  if (g->accumulate || g->out_dtype == NVL_F32) return qgemm_into(ctx, g->out, N, g->a, g->b, g->accumulate);
  float *r; /* (M, N) f32, then rounded to bf16 once */
  NVL_TRY(ctx->scratch(ctx, (size_t)(M * N + 1) * sizeof(float), (void **)&r));
  NVL_TRY(qgemm_into(ctx, r, N, g->a, g->b, 0));
  nvl_f32_to_bf16_cpu(g->out, r, M * N);
  return NVL_OK;
}

nvl_status nvl_rht_cpu(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs) {
  return nvl_rht16_rows_cpu(y, x, rows, K, signs);
}
