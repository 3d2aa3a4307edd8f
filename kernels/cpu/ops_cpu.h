/* ops_cpu.h: fast CPU kernels (OpenMP, OpenBLAS) for the common cases; each is bit-identical
 * to its reference in kernels/cpu/ref/ops_ref.h (matmul: within fp32 summation-order error;
 * sum/mean: up to the order of the double additions). The nvl_*_cpu entries at the end are the
 * tensor ops of the CPU table: a fast kernel where the layout allows, the reference otherwise. */
#ifndef NVL_OPS_CPU_H
#define NVL_OPS_CPU_H
#include "cpu/ref/ops_ref.h"

/* out[i] = a[i] op b[i], n contiguous f32 (op ADD..MINIMUM). */
void nvl_binary_f32_cpu(nvl_binary_op op, float *out, const float *a, const float *b, int64_t n);
/* out[i] = a[i] op s, or s op a[i] when scalar_left. */
void nvl_binary_scalar_f32_cpu(nvl_binary_op op, float *out, const float *a, double s, int scalar_left, int64_t n);
/* y[i] += alpha * x[i], n contiguous f32 (y += alpha x, fmaf-free: one rounding of the
 * product, one of the sum). */
void nvl_axpy_f32_cpu(float *y, const float *x, float alpha, int64_t n);
/* out[i] = op(a[i]), n contiguous f32. */
void nvl_unary_f32_cpu(nvl_unary_op op, float *out, const float *a, int64_t n);
/* Reduce n contiguous f32 (n > 0): MAX/MIN/AMAX exactly as the reference (NaN propagates);
 * SUM/MEAN in double, per-thread partial sums (same value as the reference up to the order of
 * the double additions). */
double nvl_reduce_f32_cpu(nvl_reduce_op op, const float *a, int64_t n);
/* dst (contiguous) <- src (same dtype and shape, any strides): a 2-D transpose in cache tiles,
 * otherwise row by row along the last dim. Bytes are moved, never converted. */
void nvl_copy_strided_cpu(nvl_tensor *dst, const nvl_tensor *src);
/* Contiguous conversions and copies. */
void nvl_f32_to_bf16_cpu(uint16_t *out, const float *a, int64_t n);
void nvl_bf16_to_f32_cpu(float *out, const uint16_t *a, int64_t n);
/* out[M,N] (contiguous f32) = a[M,K] @ b[K,N], f32 views whose inner or outer stride is 1
 * (else the caller makes them contiguous). Returns 0 if the layout is not BLAS-compatible. */
int nvl_matmul_f32_cpu(float *out, const nvl_tensor *a, const nvl_tensor *b);
/* c (M, N) with row stride ldc = a (M, K) @ b (N, K)^T, both contiguous f32 (sgemm, beta 0). */
void nvl_matmul_f32_abt_cpu(float *c, int64_t ldc, const float *a, const float *b, int64_t M, int64_t N, int64_t K);
/* "OpenBLAS 0.3.21 (pthread, 2 threads)" or similar. */
const char *nvl_blas_config(void);

/* Entries of the CPU table (core/backend.h). */
nvl_status nvl_copy_cpu(nvl_kctx *ctx, nvl_tensor *dst, const nvl_tensor *src);
nvl_status nvl_binary_cpu(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
nvl_status nvl_binary_scalar_cpu(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, nvl_scalar s,
                                 int scalar_left);
nvl_status nvl_unary_cpu(nvl_kctx *ctx, nvl_unary_op op, nvl_tensor *out, const nvl_tensor *a);
nvl_status nvl_reduce_all_cpu(nvl_kctx *ctx, nvl_reduce_op op, nvl_scalar *out, const nvl_tensor *a);
/* out (M, N) contiguous f32 = a @ b for f32 views: OpenBLAS, operands BLAS cannot read as they are
 * gathered into scratch first. */
nvl_status nvl_matmul_cpu(nvl_kctx *ctx, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
nvl_status nvl_axpy_cpu(nvl_kctx *ctx, float *y, const float *x, double alpha, int64_t n);
nvl_status nvl_scale_cpu(nvl_kctx *ctx, float *p, double s, int64_t n);
/* contiguous t = one element's bytes repeated: memset when they are all one byte (zero), else
 * stored per element width; threads over large tensors. The reference's result, byte for byte. */
nvl_status nvl_fill_cpu(nvl_kctx *ctx, nvl_tensor *t, const void *value);
#endif
