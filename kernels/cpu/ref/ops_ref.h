/* ops_ref.h: scalar reference kernels on CPU tensors — plain, readable, single-threaded: the tensor
 * ops of the reference table (kernels/cpu/ref/backend_ref.c), each with its nvl_backend entry's
 * signature (core/backend.h). The fast kernels (kernels/cpu/ops_cpu.h) are tested against these and
 * fall back to them for layouts they do not cover. Inputs are already validated by core/ops.c and
 * expanded (broadcast) to the output's shape; kernels never allocate. */
#ifndef NVL_OPS_REF_H
#define NVL_OPS_REF_H
#include "backend.h"

/* dst <- src elementwise (same shape), converting dtype through the traits table. */
nvl_status nvl_copy_ref(nvl_kctx *ctx, nvl_tensor *dst, const nvl_tensor *src);
/* Every element of the contiguous t = the element whose bytes are at value. */
nvl_status nvl_fill_ref(nvl_kctx *ctx, nvl_tensor *t, const void *value);
/* out = a op b; float outputs compute in double, integer outputs in int64. */
nvl_status nvl_binary_ref(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
/* out = a op s (or s op a). */
nvl_status nvl_binary_scalar_ref(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, nvl_scalar s,
                                 int scalar_left);
/* out = op(a). */
nvl_status nvl_unary_ref(nvl_kctx *ctx, nvl_unary_op op, nvl_tensor *out, const nvl_tensor *a);
/* out = reduce a over its last dim (a is permuted so the reduced dim is last and has the
 * output's leading shape); idx (may be NULL) gets 0-based argmax/argmin as i64. */
nvl_status nvl_reduce_last_ref(nvl_kctx *ctx, nvl_reduce_op op, nvl_tensor *out, nvl_tensor *idx, const nvl_tensor *a);
/* *out = reduce all of a: fp64 accumulation for floats, exact int64 for integers. */
nvl_status nvl_reduce_all_ref(nvl_kctx *ctx, nvl_reduce_op op, nvl_scalar *out, const nvl_tensor *a);
/* out[M,N] = a[M,K] @ b[K,N] (2-D views, any strides, f32/bf16), double accumulation. */
nvl_status nvl_matmul_ref(nvl_kctx *ctx, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
/* y += (float)alpha * x over n f32: one rounding of the product, one of the sum. */
nvl_status nvl_axpy_ref(nvl_kctx *ctx, float *y, const float *x, double alpha, int64_t n);
/* p = (float)(p * s) over n f32 (the product in double is exact: one rounding). */
nvl_status nvl_scale_ref(nvl_kctx *ctx, float *p, double s, int64_t n);
/* Contiguous t: element i = start + i*step. */
nvl_status nvl_arange_ref(nvl_kctx *ctx, nvl_tensor *t, double start, double step);
/* Contiguous float t from the Philox stream at (seed, offset): uniform [0,1) takes word i%4
 * of group i/4, its top p bits times 2^-p with p the dtype's significand bits (f32 24, bf16 8),
 * so every value is exact and below 1; normal uses group i/2, Box-Muller on words 2(i%2),
 * 2(i%2)+1. */
nvl_status nvl_random_ref(nvl_kctx *ctx, nvl_tensor *t, uint64_t seed, uint64_t offset, uint64_t first, int normal);
/* *result = 1 if |a-b| <= atol + rtol*|b| everywhere (a, b expanded to one shape). */
nvl_status nvl_allclose_ref(nvl_kctx *ctx, int *result, const nvl_tensor *a, const nvl_tensor *b, double rtol,
                            double atol, int equal_nan);

/* The scalar functions themselves, shared by reference and fast kernels. */
double nvl_binary_f(nvl_binary_op op, double a, double b);
int64_t nvl_binary_i(nvl_binary_op op, int64_t a, int64_t b);
double nvl_unary_f(nvl_unary_op op, double a);
#endif
