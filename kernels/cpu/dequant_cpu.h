/* dequant_cpu.h: fast CPU decoders for the GEMM emulation (core/quant.c qmatmul): each element's
 * value looked up in a 256-entry table of its format, times its block scale — the same fp32
 * products as the references in formats_ref.h (a product of a code's value and a power of two or
 * a ue4m3 byte is exact), spread over OpenMP threads. */
#ifndef NVL_DEQUANT_CPU_H
#define NVL_DEQUANT_CPU_H
#include "cpu/ref/formats_ref.h"

/* y (n) = value(codes[i]) * mul  (fp8 per tensor: mul = 1, or 1/scale for the full decode). */
void nvl_fp8_decode_cpu(float *y, const uint8_t *codes, int64_t n, nvl_elem elem, float mul);
/* y (R, K) = value(code) * 2^(scale - 127) per 32-block (the mx formats; e2m1 codes packed). */
void nvl_mx_decode_cpu(float *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K, nvl_elem elem);
/* y (R, K) = value(code) * float(ue4m3 scale) per 16-block, from packed e2m1 codes (R, K/2);
 * the nvfp4 values without the global decode scale. */
void nvl_nvfp4_decode_unscaled_cpu(float *y, const uint8_t *packed, const uint8_t *scales, int64_t rows, int64_t K);
#endif
