/* ops_ref.h: scalar reference kernels on CPU tensors — plain, readable, single-threaded. The
 * fast kernels (kernels/cpu/ops_cpu.h) are tested against these. Inputs are already validated
 * by core/ops.c and expanded (broadcast) to the output's shape; kernels never allocate. */
#ifndef NVL_OPS_REF_H
#define NVL_OPS_REF_H
#include "ops.h"

/* dst <- src elementwise (same shape), converting dtype through the traits table. */
void nvl_copy_ref(nvl_tensor *dst, const nvl_tensor *src);
/* out = a op b; float outputs compute in double, integer outputs in int64. */
void nvl_binary_ref(nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
/* out = op(a). */
void nvl_unary_ref(nvl_unary_op op, nvl_tensor *out, const nvl_tensor *a);
/* out = reduce a over its last dim (a is permuted so the reduced dim is last and has the
 * output's leading shape); idx (may be NULL) gets 0-based argmax/argmin as i64. */
void nvl_reduce_last_ref(nvl_reduce_op op, nvl_tensor *out, nvl_tensor *idx, const nvl_tensor *a);
/* Reduce all of a. */
nvl_scalar nvl_reduce_all_ref(nvl_reduce_op op, const nvl_tensor *a);
/* out[M,N] = a[M,K] @ b[K,N] (2-D views, any strides, f32/bf16), double accumulation. */
void nvl_matmul_ref(nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
void nvl_fill_ref(nvl_tensor *t, nvl_scalar v);
/* Contiguous t: element i = start + i*step. */
void nvl_arange_ref(nvl_tensor *t, double start, double step);
/* Contiguous float t from the Philox stream at (seed, offset): uniform [0,1) takes word i%4
 * of group i/4, its top p bits times 2^-p with p the dtype's significand bits (f32 24, bf16 8),
 * so every value is exact and below 1; normal uses group i/2, Box-Muller on words 2(i%2),
 * 2(i%2)+1. */
void nvl_rand_ref(nvl_tensor *t, uint64_t seed, uint64_t offset);
void nvl_randn_ref(nvl_tensor *t, uint64_t seed, uint64_t offset);

/* The scalar functions themselves, shared by reference and fast kernels. */
double nvl_binary_f(nvl_binary_op op, double a, double b);
int64_t nvl_binary_i(nvl_binary_op op, int64_t a, int64_t b);
double nvl_unary_f(nvl_unary_op op, double a);


/* out = a op s (or s op a). */
void nvl_binary_scalar_ref(nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, nvl_scalar s, int scalar_left);
/* 1 if |a-b| <= atol + rtol*|b| everywhere (a, b expanded to one shape). */
int nvl_allclose_ref(const nvl_tensor *a, const nvl_tensor *b, double rtol, double atol, int equal_nan);
#endif
