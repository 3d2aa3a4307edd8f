/* qentry_cpu.h: the quantization entries of the CPU table (kernels/cpu/qentry_cpu.c), bit for bit
 * their reference twins: one quantize driver and one decoder per scale kind, generic over the
 * element codec and block length of the format's traits row, and the emulated GEMM (oneDNN bf16 or
 * OpenBLAS sgemm) on decoded operands. Signatures as in core/backend.h (nvl_format_kernels). */
#ifndef NVL_QENTRY_CPU_H
#define NVL_QENTRY_CPU_H
#include "backend.h"

/* quantize: f32 / bf16 values (a cast into the blocked layout); fp8 per tensor; mx; nvfp4 */
nvl_status nvl_quantize_values_cpu(nvl_kctx *ctx, const nvl_qdesc *d);
nvl_status nvl_quantize_tensor_cpu(nvl_kctx *ctx, const nvl_qdesc *d);
nvl_status nvl_quantize_mx_cpu(nvl_kctx *ctx, const nvl_qdesc *d);
nvl_status nvl_quantize_nvfp4_cpu(nvl_kctx *ctx, const nvl_qdesc *d);

/* dequantize rows [r0, r0 + nr) */
nvl_status nvl_dequantize_values_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled);
nvl_status nvl_dequantize_tensor_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled);
nvl_status nvl_dequantize_mx_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled);
nvl_status nvl_dequantize_nvfp4_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                    int unscaled);

/* out = alpha_a alpha_b A B^T: operands decoded without global factors, bf16 GEMM or sgemm, factors after
 * (NUMERICS §7) */
nvl_status nvl_qgemm_cpu(nvl_kctx *ctx, const nvl_gemm_desc *g);
/* GAM scaling (core/backend.h gam_quantize): nvl_gam_quantize_cpu */
nvl_status nvl_quantize_gam_cpu(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant, const float *x,
                                int64_t rows, int64_t K, int64_t block, int64_t group_blocks, nvl_elem elem);
/* the RHT of every 16-chunk (nvl_rht16_rows_cpu), or its inverse (nvl_rht16_rows_inverse_cpu) */
nvl_status nvl_rht_cpu(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs,
                       int inverse);
#endif
