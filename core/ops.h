/* ops.h: tensor operations, dispatched through the kernel table of the tensors' device (dispatch.h).
 * Every function validates shapes/dtypes/devices and returns an nvl_status with a message that
 * names the op and the offending shapes and dtypes. Outputs are allocated here (out must be a
 * null tensor) unless the name ends in _ (in-place).
 * Not here: layers (forward/backward, layers.h), quantization (quant.h). */
#ifndef NVL_OPS_H
#define NVL_OPS_H
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The op codes (nvl_binary_op, nvl_unary_op, nvl_reduce_op) and nvl_scalar: core/backend.h. */
extern const char *const nvl_binary_names[NVL_BINARY_COUNT];
extern const char *const nvl_unary_names[NVL_UNARY_COUNT];
extern const char *const nvl_reduce_names[NVL_REDUCE_COUNT];

/* out = a op b with broadcasting; result dtype nvl_dtype_promote (DIV/POW of integers: f32;
 * comparisons: u8, compared in double if either side is a float, else in int64). */
nvl_status nvl_binary(nvl_tensor *out, nvl_binary_op op, const nvl_tensor *a, const nvl_tensor *b);
/* out = a op s (scalar_left: s op a). The tensor's dtype is kept unless s is non-integral and a
 * is an integer tensor (then f32), or op is DIV/POW on integers (f32). */
nvl_status nvl_binary_scalar(nvl_tensor *out, nvl_binary_op op, const nvl_tensor *a, nvl_scalar s, int scalar_left);
/* out = op(a); integer inputs give f32 for EXP/LOG/SQRT. */
nvl_status nvl_unary(nvl_tensor *out, nvl_unary_op op, const nvl_tensor *a);

/* Reduce over all elements into *result: fp64 accumulation for floats, exact int64 for integer
 * sum/max/min/amax (result->is_int). */
nvl_status nvl_reduce_all(nvl_scalar *result, nvl_reduce_op op, const nvl_tensor *a);
/* Reduce over dim; out has dim removed (or kept with size 1). For MAX/MIN, idx (may be NULL)
 * receives 0-based i64 positions of the first extreme value. */
nvl_status nvl_reduce_dim(nvl_tensor *out, nvl_tensor *idx, nvl_reduce_op op, const nvl_tensor *a, int dim, int keepdim);

/* out = a @ b. 2-D [M,K]x[K,N]; batched [...,M,K]x[...,K,N] with broadcast batch dims; a and b of
 * one dtype, f32 (OpenBLAS sgemm) or bf16 (computed in fp32, rounded once): a mix is an error, not
 * a promotion (elementwise ops promote). */
nvl_status nvl_matmul(nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);

/* t += alpha * src in place (src broadcast to t's shape; t float). */
nvl_status nvl_add_(nvl_tensor *t, const nvl_tensor *src, double alpha);
/* t *= s in place (t float). */
nvl_status nvl_mul_(nvl_tensor *t, double s);

/* Fill t with v (converted to t's dtype; integers exact). */
nvl_status nvl_fill_(nvl_tensor *t, nvl_scalar v);
/* t[i] = start + i*step for a 1-D t. */
nvl_status nvl_arange_(nvl_tensor *t, double start, double step);
/* Uniform [0,1) / standard normal from g; advances g->offset by one. */
nvl_status nvl_rand_(nvl_tensor *t, nvl_generator *g);
nvl_status nvl_randn_(nvl_tensor *t, nvl_generator *g);
/* The same draw's elements first, first + 1, ... (0-based, in the order of a contiguous tensor the
 * draw would fill whole): a part of it, e.g. some rows, made without the rest; advances g->offset by
 * one, as the whole draw does. */
nvl_status nvl_rand_part_(nvl_tensor *t, nvl_generator *g, int64_t first);
nvl_status nvl_randn_part_(nvl_tensor *t, nvl_generator *g, int64_t first);
/* out = t converted to dt (a copy even if dt is t's dtype). */
nvl_status nvl_cast(nvl_tensor *out, const nvl_tensor *t, nvl_dtype dt);
/* *result = all(|a-b| <= atol + rtol*|b|), shapes broadcast; NaNs equal only if equal_nan. */
nvl_status nvl_allclose(int *result, const nvl_tensor *a, const nvl_tensor *b, double rtol, double atol, int equal_nan);
/* Read / write one element as double (0-based index, all dims). */
nvl_status nvl_get(double *v, const nvl_tensor *t, const int64_t *idx);
nvl_status nvl_set(nvl_tensor *t, const int64_t *idx, double v);
/* The same with an exact integer (integer dtypes store it saturated, floats round it once). */
nvl_status nvl_set_i(nvl_tensor *t, const int64_t *idx, int64_t v);

#ifdef __cplusplus
}
#endif
#endif
