/* layers_cpu.h: fast CPU kernels of the layer library (OpenMP over rows or column chunks,
 * inner loops the compiler vectorises). Same arguments and contracts as the references in
 * kernels/cpu/ref/layers_ref.h, against which tests/test_layers.lua checks each one:
 *   bit-identical: embedding forward/backward, rmsnorm dweight, rope forward/backward, adamw
 *     (same arithmetic in the same order; parameter-gradient sums run over rows in order);
 *   within a stated tolerance: rmsnorm (row sums of squares and dot products reassociated by
 *     SIMD), swiglu and cross-entropy (f32 expf instead of double exp), sumsq (chunked sums).
 * Every result is independent of the number of threads: reductions use fixed chunks that are
 * combined in order. */
#ifndef NVL_LAYERS_CPU_H
#define NVL_LAYERS_CPU_H
#include "cpu/ref/layers_ref.h"

#ifdef __cplusplus
extern "C" {
#endif

void nvl_embedding_forward_cpu(float *out, const int64_t *ids, const float *weight, int64_t N, int64_t C);
void nvl_embedding_backward_cpu(float *dweight, const float *dout, const int64_t *ids, int64_t N, int64_t C);

void nvl_rmsnorm_forward_cpu(float *out, float *rstd, const float *x, const float *weight, int64_t N, int64_t C,
                             double eps);
void nvl_rmsnorm_backward_cpu(float *dx, float *dweight, const float *dout, const float *x, const float *weight,
                              const float *rstd, int64_t N, int64_t C);

void nvl_rope_forward_cpu(float *out, const float *x, const float *cos, const float *sin, int64_t B, int64_t T,
                          int64_t H, int64_t D);
void nvl_rope_backward_cpu(float *dx, const float *dout, const float *cos, const float *sin, int64_t B, int64_t T,
                           int64_t H, int64_t D);

void nvl_swiglu_forward_cpu(float *out, const float *gate, const float *up, int64_t n);
void nvl_swiglu_backward_cpu(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                             int64_t n);

double nvl_cross_entropy_cpu(float *dlogits, const float *logits, const int64_t *targets, int64_t N, int64_t V,
                             int64_t ignore_index, double z_loss, double grad_scale);

void nvl_adamw_step_cpu(float *param, const float *grad, float *m, float *v, int64_t n, const nvl_adamw_opts *o);

double nvl_sumsq_cpu(const float *x, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
