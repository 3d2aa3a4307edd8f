/* layers_ref.h: scalar reference kernels of the layer library (core/layers.h) — plain, readable,
 * single-threaded, double precision wherever a sum or a transcendental decides the result. The
 * fast kernels (kernels/cpu/layers_cpu.h) are tested against these.
 *
 * Each entry has the signature of its nvl_backend entry (core/backend.h) and sits in the reference
 * table (kernels/cpu/ref/backend_ref.c).
 *
 * Not here: validation, allocation, tensors, threads, Lua. Buffers are plain row-major f32 arrays
 * owned by the caller and already checked by core/layers.c (ids and targets in range, shapes
 * consistent); scratch comes from the caller (nvl_kctx). Contract of the backwards as in layers.h:
 * parameter gradients ACCUMULATE (+=), activation gradients are WRITTEN (=).
 *
 * Shape letters: N rows (tokens), C width, V vocabulary, B batch, T sequence, H heads, D head
 * dim, n elements. */
#ifndef NVL_LAYERS_REF_H
#define NVL_LAYERS_REF_H
#include <math.h>
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *out = x (n f32 or bf16 elements) as f32: x itself, or a widened copy (exact) in c's scratch. */
nvl_status nvl_widen_f32(nvl_kctx *ctx, const float **out, const void *x, nvl_dtype dt, int64_t n);

/* out (N, C) = weight[ids[n], :]. */
nvl_status nvl_embedding_forward_ref(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N, int64_t C);
/* dweight (V, C) += dout (N, C) scattered by ids: rows n in order, f32 adds (as torch). */
nvl_status nvl_embedding_backward_ref(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N, int64_t C);

/* rstd (N) = f32(1 / sqrt(mean_c x^2 + eps)) with a double sum; out (N, C) = (x * rstd) * w in f32
 * (the Hugging Face order: weight * (x * rstd)). */
nvl_status nvl_rmsnorm_forward_ref(nvl_kctx *ctx, float *out, float *rstd, const float *x, const float *weight, int64_t N, int64_t C,
                             double eps);
/* dx (N, C) = r w g - x r^3 (sum_c g w x) / C in double, r = rstd; dweight (C) += sum_n g x r
 * (double sum over n in order, one f32 rounding on the add). */
nvl_status nvl_rmsnorm_backward_ref(nvl_kctx *ctx, float *dx, float *dweight, const float *dout, const float *x, const float *weight,
                              const float *rstd, int64_t N, int64_t C);

/* inv_freq (D/2) = theta^(-2i/D), then Llama 3.1 scaling when s && s->llama3 (Hugging Face
 * _compute_llama3_parameters), in double. */
void nvl_rope_inv_freq_ref(double *inv_freq, int64_t D, double theta, const nvl_rope_scaling *s);
/* cos, sin (T, D): angle(t, i) = t * inv_freq[i mod D/2], computed in double. */
void nvl_rope_tables_ref(float *cos, float *sin, const double *inv_freq, int64_t T, int64_t D);
/* The table entry: both of the above (inv_freq in scratch). */
nvl_status nvl_rope_tables_entry_ref(nvl_kctx *ctx, float *cos, float *sin, int64_t T, int64_t D, double theta,
                                     const nvl_rope_scaling *s);
/* out (B, T, H, D) = x cos + rotate_half(x) sin, rotate_half(x) = cat(-x2, x1); each element
 * is a*b + c*d of f32 values in double, rounded once. */
nvl_status nvl_rope_forward_ref(nvl_kctx *ctx, float *out, const float *x, const float *cos, const float *sin, int64_t B, int64_t T,
                          int64_t H, int64_t D);
/* dx = cos dout + rotate_half^T(sin dout): dx_j = c_j g_j + s_{j+D/2} g_{j+D/2} (j < D/2),
 * c_j g_j - s_{j-D/2} g_{j-D/2} (j >= D/2), in double, rounded once. */
nvl_status nvl_rope_backward_ref(nvl_kctx *ctx, float *dx, const float *dout, const float *cos, const float *sin, int64_t B, int64_t T,
                           int64_t H, int64_t D);

/* out (n) = silu(gate) * up, silu(g) = g / (1 + exp(-g)), in double. */
nvl_status nvl_swiglu_forward_ref(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n);
/* dgate = dout up s (1 + g (1 - s)), dup = dout g s, s = sigmoid(g), in double. */
nvl_status nvl_swiglu_backward_ref(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                             int64_t n);

/* *total = the sum over counted rows (targets[n] != ignore_index, all others in [0, V)) of
 * lse_n - logits[n, t_n] + z_loss lse_n^2, in double. If dlogits (N, V) is not NULL it gets
 * grad_scale * ((1 + 2 z_loss lse_n) softmax_n - onehot(t_n)) on counted rows, 0 on ignored. */
nvl_status nvl_cross_entropy_ref(nvl_kctx *ctx, double *total, float *dlogits, const void *logits, nvl_dtype logits_dtype,
                                 const int64_t *targets, int64_t N, int64_t V, int64_t ignore_index, double z_loss,
                                 double grad_scale);

/* torch.optim.AdamW (single-tensor path) in f32, step by step in torch's order:
 *   p = p * f32(1 - lr wd);  m = lerp(m, g, f32(1 - b1));  v = v * f32(b2);  v = v + f32(1 - b2) g g;
 *   denom = sqrt(v) / f32(sqrt(1 - b2^step)) + f32(eps);  p = p + f32(-lr / (1 - b1^step)) m / denom.
 * The scalars are formed in double (as Python does) and rounded to f32 once. */
typedef struct {
  float decay, w1, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
} nvl_adamw_coefs;
nvl_adamw_coefs nvl_adamw_coefs_of(const nvl_adamw_opts *o);
/* One element; shared by the reference and the fast kernel so both do the same f32 arithmetic. */
static inline void nvl_adamw_elem(float *p, float g, float *m, float *v, const nvl_adamw_coefs *k) {
  float pp = *p * k->decay;
  float mm = *m, vv = *v;
  /* torch's lerp: self + w (end - self) for |w| < 0.5, else end - (end - self) (1 - w) */
  mm = fabsf(k->w1) < 0.5f ? mm + k->w1 * (g - mm) : g - (g - mm) * (1.0f - k->w1);
  vv = vv * k->b2;
  vv = vv + k->one_minus_b2 * g * g;
  float denom = sqrtf(vv) / k->bc2_sqrt + k->eps;
  pp = pp + k->neg_step_size * mm / denom;
  *p = pp; *m = mm; *v = vv;
}
nvl_status nvl_adamw_step_ref(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n, const nvl_adamw_opts *o);

/* *out = sum of x^2 over n f32 or bf16 elements, in double, in order. */
nvl_status nvl_sumsq_ref(nvl_kctx *ctx, double *out, const void *x, nvl_dtype dt, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
