/* qentry_ref.h: the quantization entries of the reference table (kernels/cpu/ref/qentry_ref.c):
 * one quantize driver and one decoder per scale kind, generic over the element codec and block
 * length of the format's traits row, and the reference GEMM on decoded operands. Signatures as in
 * core/backend.h (nvl_format_kernels). */
#ifndef NVL_QENTRY_REF_H
#define NVL_QENTRY_REF_H
#include "backend.h"

/* quantize: f32 / bf16 values (a cast into the blocked layout); fp8 per tensor; mx; nvfp4 */
nvl_status nvl_quantize_values_ref(nvl_kctx *ctx, const nvl_qdesc *d);
nvl_status nvl_quantize_tensor_ref(nvl_kctx *ctx, const nvl_qdesc *d);
nvl_status nvl_quantize_mx_ref(nvl_kctx *ctx, const nvl_qdesc *d);
nvl_status nvl_quantize_nvfp4_ref(nvl_kctx *ctx, const nvl_qdesc *d);

/* dequantize rows [r0, r0 + nr) */
nvl_status nvl_dequantize_values_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled);
nvl_status nvl_dequantize_tensor_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled);
nvl_status nvl_dequantize_mx_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled);
nvl_status nvl_dequantize_nvfp4_ref(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                    int unscaled);

/* out = alpha_a alpha_b A B^T on the decoded operands, double accumulation, rounded to f32 once */
nvl_status nvl_qgemm_ref(nvl_kctx *ctx, const nvl_gemm_desc *g);
/* a 16x16-tiled 4-bit tensor transposed (core/backend.h transpose_tiles) */
nvl_status nvl_transpose_tiles_ref(nvl_kctx *ctx, uint8_t *codes_t, uint8_t *scales_t, const uint8_t *codes,
                                   const uint8_t *scales, int64_t R, int64_t K);
/* GAM scaling (core/backend.h gam_quantize): nvl_gam_quantize_ref, a NaN or an inf flagged on the host */
nvl_status nvl_quantize_gam_ref(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant, const float *x,
                                int64_t rows, int64_t K, int64_t block, int64_t group_blocks, nvl_elem elem);
/* the RHT of every 16-chunk (nvl_rht16_rows_ref), or its inverse (nvl_rht16_inverse_ref) */
nvl_status nvl_rht_ref(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs,
                       int inverse);
#endif
