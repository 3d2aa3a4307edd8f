/* gemm_bf16_cpu.h: the CPU's bf16 units (AVX512-BF16 VDPBF16PS, AMX TDPBF16PS) through oneDNN's
 * matmul, for the emulated GEMMs of qentry_cpu.c: bf16 x bf16 products, exact in fp32, summed in
 * fp32 (what sgemm computes on the same values, up to the order of the summation; the units flush
 * subnormal inputs, products and sums to zero, which the caller rules out, see qentry_cpu.c).
 * Used only when built with oneDNN (NVLUA_HAVE_DNNL), the CPU has bf16 units and NVLUA_DNNL is not
 * "0"; otherwise nvl_gemm_bf16_ready() is 0 and the callers stay on sgemm. Not here: decoding, the
 * global scales, accumulation (the caller's). */
#ifndef NVL_GEMM_BF16_CPU_H
#define NVL_GEMM_BF16_CPU_H
#include "backend.h"

/* 1 when nvl_gemm_bf16_abt_cpu can run now (compiled in, bf16 units, not switched off). */
int nvl_gemm_bf16_ready(void);
/* the in-process switch (on by default; NVLUA_DNNL=0 in the environment turns it off at start):
 * sets it unless on < 0, returns the previous setting. */
int nvl_gemm_bf16_switch(int on);
/* one line for nvlua -v / nv.info(): "oneDNN 2.6.3, bf16 GEMMs on avx512_core_bf16 (brg:...)", or
 * why it is not used. */
const char *nvl_gemm_bf16_info(void);

/* c (M, N, row stride ldc) f32 = a (M, K) bf16 · b (N, K) bf16ᵀ, both row-major and contiguous;
 * the products exact, fp32 sums. Primitives are created once per shape (LRU cache). */
nvl_status nvl_gemm_bf16_abt_cpu(float *c, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M, int64_t N,
                                 int64_t K);
/* alpha times the same product (one fp32 multiply), rounded once to bf16 (RNE, NaN quieted with its
 * sign) into c16 (M, N, row stride ldc), by oneDNN's scaling and conversion of its fp32 result: the
 * bits of nvl_f32_to_bf16(alpha * sum) where that is zero or at least 2^-126 in magnitude (the
 * conversion flushes smaller ones to zero; the caller rules them out). */
nvl_status nvl_gemm_bf16_abt_bf16_cpu(uint16_t *c16, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M,
                                      int64_t N, int64_t K, float alpha);

/* c (M, N) contiguous f32 = a (M, K) · b (K, N), f32 operands with any element strides (rs, cs: a
 * row and a column step, in elements), through oneDNN's f32 matmul (its brgemm kernels: faster than
 * OpenBLAS's sgemm here, the same fp32 products, another summation order). Returns
 * NVL_EUNSUPPORTED without an error message when oneDNN cannot run (the caller uses sgemm). */
nvl_status nvl_gemm_f32_dnnl_cpu(float *c, const float *a, int64_t rsa, int64_t csa, const float *b, int64_t rsb,
                                 int64_t csb, int64_t M, int64_t N, int64_t K);

/* which path the CPU's emulated GEMMs took (counters since start, for tests and nv.info) */
typedef enum { NVL_CPU_GEMM_SGEMM = 0, NVL_CPU_GEMM_BF16 = 1, NVL_CPU_GEMM_ROUTE_COUNT } nvl_cpu_gemm_route;
void nvl_cpu_gemm_route_count(nvl_cpu_gemm_route p);
int64_t nvl_cpu_gemm_route_calls(nvl_cpu_gemm_route p);
#endif
