/* dequant_cpu.h: fast CPU decoders for the GEMM emulation (core/quant.c qmatmul): each element's
 * value looked up in a 256-entry table of its format, times its block scale — the same fp32
 * products as the references in formats_ref.h (a product of a code's value and a power of two or
 * a ue4m3 byte is exact), spread over OpenMP threads. */
#ifndef NVL_DEQUANT_CPU_H
#define NVL_DEQUANT_CPU_H
#include "cpu/ref/formats_ref.h"

/* y (n) = value(codes[i]) * mul  (fp8 per tensor: mul = 1, or 1/scale for the full decode). */
void nvl_fp8_decode_cpu(float *y, const uint8_t *codes, int64_t n, nvl_elem elem, float mul);
/* y[i] = value(codes[i]) / div in fp32: per-tensor fp8's dequantize, bit for bit the reference's */
void nvl_fp8_decode_div_cpu(float *y, const uint8_t *codes, int64_t n, nvl_elem elem, float div);
/* y (R, K) = value(code) * 2^(scale - 127) per 32-block (the mx formats; e2m1 codes packed). */
void nvl_mx_decode_cpu(float *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K, nvl_elem elem);
/* y (R, K) = value(code) * float(ue4m3 scale) per 16-block, from packed e2m1 codes (R, K/2);
 * the nvfp4 values without the global decode scale. */
void nvl_nvfp4_decode_unscaled_cpu(float *y, const uint8_t *packed, const uint8_t *scales, int64_t rows, int64_t K);

/* The same values straight into bf16, for the bf16 GEMM path (qentry_cpu.c): every fp8 code, every
 * nvfp4 value (e2m1 x ue4m3: at most 6 significant bits, magnitudes from 2^-10) is exact in bf16; an
 * mx value is exact when its block scale keeps it in bf16's normal range (the caller checks with
 * nvl_u8_min_cpu on the scales). */
void nvl_fp8_decode_bf16_cpu(uint16_t *y, const uint8_t *codes, int64_t n, nvl_elem elem);
void nvl_mx_decode_bf16_cpu(uint16_t *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K,
                            nvl_elem elem);
void nvl_nvfp4_decode_unscaled_bf16_cpu(uint16_t *y, const uint8_t *packed, const uint8_t *scales, int64_t rows,
                                        int64_t K);
/* min of n bytes (255 when n = 0) */
int nvl_u8_min_cpu(const uint8_t *x, int64_t n);
/* Whether nvl_nvfp4_decode_unscaled_bf16_cpu uses its AVX-512 lookups (1, where the CPU has them) or
 * the scalar table (0): on = 0/1 sets (1 only takes where supported), < 0 reads. -> the previous
 * setting. For the unit test that compares the two. */
int nvl_nvfp4_decode_simd_cpu(int on);
/* the smallest exponent field of the nonzero bf16 values (0: a subnormal; 255: none, or only inf/NaN) */
int nvl_bf16_exp_min_cpu(const uint16_t *x, int64_t n);
#endif
