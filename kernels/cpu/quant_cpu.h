/* quant_cpu.h: fast CPU quantizers (OpenMP over rows/blocks, branch-free element encoders the
 * compiler vectorises). Each is bit-identical to its reference in kernels/cpu/ref/formats_ref.h,
 * stochastic rounding included (same Philox stream), and is tested against it.
 * Shapes as in formats_ref.h: x (R, K) f32 row-major, blocks along K. Outputs must not overlap x
 * (the RHT, which may work in place, excepted). */
#ifndef NVL_QUANT_CPU_H
#define NVL_QUANT_CPU_H
#include "cpu/ref/formats_ref.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NVFP4 1D (block2d 0) or 2D 16x16 (block2d 1): packed (R, K/2) e2m1 codes, two per byte, low
 * nibble first; scales (R, K/16) ue4m3; *amax the amax used. */
nvl_status nvl_nvfp4_quantize_cpu(uint8_t *packed, uint8_t *scales, float *amax, const float *x, int64_t rows,
                                  int64_t K, int block2d, const nvl_quant_ref_opts *opts);
/* The 1x16 quantization of bf16 x: bit for bit nvl_nvfp4_quantize_cpu of x widened to f32, without a
 * widened copy (blocks are widened in cache; amax from the bits). */
nvl_status nvl_nvfp4_quantize_bf16_cpu(uint8_t *packed, uint8_t *scales, float *amax, const uint16_t *x,
                                       int64_t rows, int64_t K, const nvl_quant_ref_opts *opts);
/* y (R, K) from packed codes (R, K/2) and scales (R, K/16), as nvl_nvfp4_dequantize_ref. */
nvl_status nvl_nvfp4_dequantize_cpu(float *y, const uint8_t *packed, const uint8_t *scales, float amax, int64_t rows,
                                    int64_t K);
/* MX formats: codes (R, K) one byte each (e2m1 elements: packed (R, K/2), low nibble first),
 * scales (R, K/32); SR (e2m1) per opts, as nvl_mx_quantize_ref. opts may be NULL. */
nvl_status nvl_mx_quantize_cpu(uint8_t *codes, uint8_t *scales, const float *x, int64_t rows, int64_t K, nvl_elem elem,
                               nvl_mx_rule rule, const nvl_quant_ref_opts *opts);
/* FP8 per-tensor: codes (n); amax_in NULL: current scaling. */
nvl_status nvl_fp8_quantize_tensor_cpu(uint8_t *codes, float *scale, float *amax, const float *x, int64_t n,
                                       nvl_elem elem, const float *amax_in);
/* GAM scaling (kernels/cpu/ref/gam_ref.h), bit for bit nvl_gam_quantize_ref: codes (R, K), scales
 * (R, K/block) E8M0 bytes, mant (nblocks / G) with G = group_blocks >= 1; a NaN or an inf sets the host's
 * NVL_NONFINITE_INPUT flag. */
nvl_status nvl_gam_quantize_cpu(uint8_t *codes, uint8_t *scales, float *mant, const float *x, int64_t rows, int64_t K,
                                int64_t block, int64_t group_blocks, nvl_elem elem);
/* RHT on every 16-chunk along K; y may alias x. */
nvl_status nvl_rht16_rows_cpu(float *y, const float *x, int64_t rows, int64_t K, const float *signs);
/* The same on bf16 x, each output rounded to bf16 (kept as f32): NUMERICS §5's bf16 operand, the
 * same bits as widening, nvl_rht16_rows_cpu and rounding. */
nvl_status nvl_rht16_rows_bf16_cpu(float *y, const uint16_t *x, int64_t rows, int64_t K, const float *signs);
/* The inverse on every 16-chunk (nvl_rht16_inverse_ref's order: butterflies, * 0.25, signs); y may alias x. */
nvl_status nvl_rht16_rows_inverse_cpu(float *y, const float *x, int64_t rows, int64_t K, const float *signs);

#ifdef __cplusplus
}
#endif
#endif
