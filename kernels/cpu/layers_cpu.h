/* layers_cpu.h: fast CPU kernels of the layer library (OpenMP over rows or column chunks,
 * inner loops the compiler vectorises). Same arguments and contracts as the references in
 * kernels/cpu/ref/layers_ref.h, against which tests/test_layers.lua checks each one:
 *   bit-identical: embedding forward/backward, rmsnorm dweight, rope forward/backward, adamw
 *     (same arithmetic in the same order; parameter-gradient sums run over rows in order);
 *   within a stated tolerance: rmsnorm (row sums of squares and dot products reassociated by
 *     SIMD), swiglu and cross-entropy (f32 expf instead of double exp), sumsq (chunked sums).
 * Every result is independent of the number of threads: reductions use fixed chunks that are
 * combined in order. Each function is the entry of the CPU table (kernels/cpu/backend_cpu.c). */
#ifndef NVL_LAYERS_CPU_H
#define NVL_LAYERS_CPU_H
#include "cpu/ref/layers_ref.h"

#ifdef __cplusplus
extern "C" {
#endif

nvl_status nvl_embedding_forward_cpu(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N, int64_t C);
nvl_status nvl_embedding_backward_cpu(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N, int64_t C);

nvl_status nvl_rmsnorm_forward_cpu(nvl_kctx *ctx, float *out, float *rstd, const float *x, const float *weight, int64_t N, int64_t C,
                             double eps);
nvl_status nvl_rmsnorm_backward_cpu(nvl_kctx *ctx, float *dx, float *dweight, const float *dout, const float *x, const float *weight,
                              const float *rstd, int64_t N, int64_t C);

nvl_status nvl_rope_forward_cpu(nvl_kctx *ctx, float *out, const float *x, const float *cos, const float *sin, int64_t B, int64_t T,
                          int64_t H, int64_t D);
nvl_status nvl_rope_backward_cpu(nvl_kctx *ctx, float *dx, const float *dout, const float *cos, const float *sin, int64_t B, int64_t T,
                           int64_t H, int64_t D);

nvl_status nvl_swiglu_forward_cpu(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n);
nvl_status nvl_swiglu_backward_cpu(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                             int64_t n);

nvl_status nvl_cross_entropy_cpu(nvl_kctx *ctx, double *total, float *dlogits, const void *logits, nvl_dtype logits_dtype,
                                 const int64_t *targets, int64_t N, int64_t V, int64_t ignore_index, double z_loss,
                                 double grad_scale);

nvl_status nvl_adamw_step_cpu(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n, const nvl_adamw_opts *o);

nvl_status nvl_sumsq_cpu(nvl_kctx *ctx, double *out, const void *x, nvl_dtype dt, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
