/* layers_ref.h: scalar reference kernels of the layer library (core/layers.h) — plain, readable,
 * single-threaded, double precision wherever a sum or a transcendental decides the result. The
 * fast kernels (kernels/cpu/layers_cpu.h) are tested against these.
 *
 * The kernels are static in layers_ref.c and reach core through nvl_layers_ref, the reference
 * table's layer sub-table (core/backend.h nvl_layer_kernels); what each computes is below.
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
#include <string.h>
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The reference table's layer kernels (attention from attention_ref.c). */
extern const nvl_layer_kernels nvl_layers_ref;
/* sum over [k0, k1) of f32(a - b)^2 (b NULL: a^2) in double, in index order, rounded to f32 once:
 * one group of block_sqerr (core/backend.h), the reference's and the fast CPU table's */
static inline float nvl_group_sqerr(const float *a, const float *b, int64_t k0, int64_t k1) {
  double s = 0.0;
  for (int64_t k = k0; k < k1; k++) {
    double d = (double)(b ? a[k] - b[k] : a[k]);
    s = s + d * d;
  }
  return (float)s;
}

/* the distillation loss of the layer table (core/backend.h distill): the fast CPU table's too */
nvl_status nvl_distill_ref(nvl_kctx *ctx, double *kl_out, double *ce_out, float *dlogits, const void *s_in,
                           nvl_dtype s_dtype, const void *t_in, nvl_dtype t_dtype, const int64_t *targets, int64_t N,
                           int64_t V, int64_t ignore_index, double T, double alpha, double grad_scale);

/* *out = x (n f32 or bf16 elements) as f32: x itself, or a widened copy (exact) in c's scratch. */
nvl_status nvl_widen_f32(nvl_kctx *ctx, const float **out, const void *x, nvl_dtype dt, int64_t n);

/* embedding_forward: out (N, C) = weight[ids[n], :]. */
/* embedding_backward: dweight (V, C) += dout (N, C) scattered by ids: rows n in order, f32 adds
 * (as torch). */

/* rmsnorm_forward: rstd (N) = f32(1 / sqrt(mean_c x^2 + eps)) with a double sum; out (N, C) =
 * (x * rstd) * w in f32 (the Hugging Face order: weight * (x * rstd)). */
/* rmsnorm_backward: dx (N, C) = r w g - x r^3 (sum_c g w x) / C in double, r = rstd; dweight (C) +=
 * sum_n g x r (double sum over n in order, one f32 rounding on the add). */

/* inv_freq (D/2) = theta^(-2i/D) changed by s's rope type (s NULL: none), in double, as Hugging
 * Face's modeling_rope_utils computes it (in f32): llama3 _compute_llama3_parameters, linear
 * _compute_linear_scaling_rope_parameters, dynamic _compute_dynamic_ntk_parameters at seq_len = M. */
void nvl_rope_inv_freq_ref(double *inv_freq, int64_t D, double theta, const nvl_rope_scaling *s);
/* cos, sin (T, D): angle(t, i) = t * inv_freq[i mod D/2], computed in double. */
void nvl_rope_tables_ref(float *cos, float *sin, const double *inv_freq, int64_t T, int64_t D);
/* rope_tables: both of the above (inv_freq in scratch).
 * rope_forward: out (B, T, H, D) = x cos + rotate_half(x) sin, rotate_half(x) = cat(-x2, x1); each
 * element is a*b + c*d of f32 values in double, rounded once.
 * rope_backward: dx = cos dout + rotate_half^T(sin dout): dx_j = c_j g_j + s_{j+D/2} g_{j+D/2}
 * (j < D/2), c_j g_j - s_{j-D/2} g_{j-D/2} (j >= D/2), in double, rounded once. */

/* swiglu_forward: out (n) = silu(gate) * up, silu(g) = g / (1 + exp(-g)), in double.
 * swiglu_backward: dgate = dout up s (1 + g (1 - s)), dup = dout g s, s = sigmoid(g), in double. */

/* cross_entropy: *total = the sum over counted rows (targets[n] != ignore_index, all others in
 * [0, V)) of lse_n - logits[n, t_n] + z_loss lse_n^2, in double. If dlogits (N, V) is not NULL it
 * gets grad_scale * ((1 + 2 z_loss lse_n) softmax_n - onehot(t_n)) on counted rows, 0 on ignored. */

/* adamw_step: torch.optim.AdamW (single-tensor path) in f32, step by step in torch's order:
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

/* sumsq: *out = sum of x^2 over n f32 or bf16 elements, in double, in order. */

/* Multi-tensor AdamW (adamw_multi): each tensor as adamw_step, its grad first scaled by the clip
 * factor c as grad:mul_(c) rounds (nvl_binary_scalar_f32_cpu's MUL): one f32 product when c is
 * exact in f32, else the double product rounded once. */
static inline float nvl_clip_scale(float g, double c) {
  float cf = (float)c;
  return (double)cf == c ? g * cf : (float)((double)g * c);
}
/* The clip factor of optim.clip_grad_norm for a sum of squares ss: max_norm / (sqrt(ss) + 1e-6)
 * when sqrt(ss) > max_norm and finite, else exactly 1. In double. */
static inline double nvl_clip_factor(double ss, double max_norm) {
  double norm = sqrt(ss);
  return norm > max_norm && norm < INFINITY ? max_norm / (norm + 1e-6) : 1.0;
}
/* state[NVL_NORM_SUMSQ], state[NVL_NORM_CLIP] (doubles in i64 slots) */
static inline double nvl_norm_state_get(const int64_t *state, int slot) {
  double d;
  memcpy(&d, &state[slot], sizeof d);
  return d;
}
static inline void nvl_norm_state_set(int64_t *state, int slot, double d) { memcpy(&state[slot], &d, sizeof d); }

#ifdef __cplusplus
}
#endif
#endif
