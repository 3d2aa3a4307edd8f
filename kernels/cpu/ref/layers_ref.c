/* layers_ref.c: scalar reference kernels of the layer library (see layers_ref.h). Written to be
 * read next to the formulas in layers.h; speed is layers_cpu.c's business. */
#include "cpu/ref/layers_ref.h"
#include "cpu/ref/attention_ref.h"
#include "cpu/ref/formats_ref.h"

#include <math.h>
#include <string.h>

/* ---- embedding -------------------------------------------------------------------------------- */

static nvl_status embedding_forward(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N,
                                    int64_t C) {
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++) out[n * C + c] = weight[ids[n] * C + c];
  return NVL_OK;
}

static nvl_status embedding_backward(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                     int64_t C) {
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++) dweight[ids[n] * C + c] += dout[n * C + c];
  return NVL_OK;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

static nvl_status rmsnorm_forward(nvl_kctx *ctx, float *out, float *rstd, const float *x, const float *weight,
                                  int64_t N, int64_t C, double eps) {
  for (int64_t n = 0; n < N; n++) {
    const float *xr = x + n * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
    float r = (float)(1.0 / sqrt(ss / (double)C + eps));
    rstd[n] = r;
    for (int64_t c = 0; c < C; c++) out[n * C + c] = (xr[c] * r) * weight[c];
  }
  return NVL_OK;
}

static nvl_status rmsnorm_backward(nvl_kctx *ctx, float *dx, float *dweight, const float *dout, const float *x,
                                   const float *weight, const float *rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; n++) {
    const float *g = dout + n * C, *xr = x + n * C;
    double r = rstd[n], dot = 0.0;
    for (int64_t c = 0; c < C; c++) dot += (double)g[c] * weight[c] * xr[c];
    double k = r * r * r * dot / (double)C;
    for (int64_t c = 0; c < C; c++) dx[n * C + c] = (float)(r * weight[c] * g[c] - (double)xr[c] * k);
  }
  for (int64_t c = 0; c < C; c++) {
    double acc = 0.0;
    for (int64_t n = 0; n < N; n++) acc += (double)dout[n * C + c] * x[n * C + c] * rstd[n];
    dweight[c] = (float)((double)dweight[c] + acc);
  }
  return NVL_OK;
}

/* ---- RoPE ------------------------------------------------------------------------------------- */

void nvl_rope_inv_freq_ref(double *inv_freq, int64_t D, double theta, const nvl_rope_scaling *s) {
  const double pi = 3.14159265358979323846;
  nvl_rope_kind kind = s ? s->kind : NVL_ROPE_DEFAULT;
  if (kind == NVL_ROPE_DYNAMIC) { /* _compute_dynamic_ntk_parameters at L = M, its operations in its order */
    double M = s->max_position_embeddings;
    theta = theta * pow(s->factor * M / M - (s->factor - 1.0), (double)D / (double)(D - 2));
  }
  for (int64_t i = 0; i < D / 2; i++) {
    double f = pow(theta, -(double)(2 * i) / (double)D);
    if (kind == NVL_ROPE_LINEAR) f = f / s->factor;
    if (kind == NVL_ROPE_LLAMA3) {
      double low_wavelen = s->original_max_position_embeddings / s->low_freq_factor;
      double high_wavelen = s->original_max_position_embeddings / s->high_freq_factor;
      double wavelen = 2.0 * pi / f;
      if (wavelen > low_wavelen) {
        f = f / s->factor;
      } else if (!(wavelen < high_wavelen)) {
        double smooth = (s->original_max_position_embeddings / wavelen - s->low_freq_factor) /
                        (s->high_freq_factor - s->low_freq_factor);
        f = (1.0 - smooth) * f / s->factor + smooth * f;
      }
    }
    inv_freq[i] = f;
  }
}

void nvl_rope_tables_ref(float *cos_t, float *sin_t, const double *inv_freq, int64_t T, int64_t D) {
  int64_t h = D / 2;
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < D; i++) {
      double a = (double)t * inv_freq[i % h];
      cos_t[t * D + i] = (float)cos(a);
      sin_t[t * D + i] = (float)sin(a);
    }
}

static nvl_status rope_tables(nvl_kctx *ctx, float *cos_t, float *sin_t, int64_t T, int64_t D, double theta,
                              const nvl_rope_scaling *sc) {
  double *inv_freq; /* (D/2) */
  NVL_TRY(ctx->scratch(ctx, (size_t)(D / 2) * sizeof(double), (void **)&inv_freq));
  nvl_rope_inv_freq_ref(inv_freq, D, theta, sc);
  nvl_rope_tables_ref(cos_t, sin_t, inv_freq, T, D);
  return NVL_OK;
}

static nvl_status rope_forward(nvl_kctx *ctx, float *out, const float *x, const float *cos_t, const float *sin_t,
                               int64_t B, int64_t T, int64_t H, int64_t D) {
  int64_t h = D / 2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t hd = 0; hd < H; hd++) {
        const float *xr = x + ((b * T + t) * H + hd) * D, *c = cos_t + t * D, *s = sin_t + t * D;
        float *o = out + ((b * T + t) * H + hd) * D;
        for (int64_t j = 0; j < D; j++) {
          double rot = j < h ? -(double)xr[j + h] : (double)xr[j - h]; /* rotate_half(x)[j] */
          o[j] = (float)((double)xr[j] * c[j] + rot * s[j]);
        }
      }
  return NVL_OK;
}

static nvl_status rope_backward(nvl_kctx *ctx, float *dx, const float *dout, const float *cos_t, const float *sin_t,
                                int64_t B, int64_t T, int64_t H, int64_t D) {
  int64_t h = D / 2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t hd = 0; hd < H; hd++) {
        const float *g = dout + ((b * T + t) * H + hd) * D, *c = cos_t + t * D, *s = sin_t + t * D;
        float *o = dx + ((b * T + t) * H + hd) * D;
        for (int64_t j = 0; j < D; j++) {
          double tr = j < h ? (double)g[j + h] * s[j + h] : -(double)g[j - h] * s[j - h];
          o[j] = (float)((double)g[j] * c[j] + tr);
        }
      }
  return NVL_OK;
}

/* ---- SwiGLU ----------------------------------------------------------------------------------- */

static nvl_status swiglu_forward(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double g = gate[i];
    out[i] = (float)(g / (1.0 + exp(-g)) * (double)up[i]);
  }
  return NVL_OK;
}

static nvl_status swiglu_backward(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                                  const float *up, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double g = gate[i], u = up[i], d = dout[i];
    double s = 1.0 / (1.0 + exp(-g));
    dgate[i] = (float)(d * u * s * (1.0 + g * (1.0 - s)));
    dup[i] = (float)(d * g * s);
  }
  return NVL_OK;
}

/* ---- cross-entropy ---------------------------------------------------------------------------- */

/* *out = x (n f32 or bf16 elements) as f32: x itself, or a widened copy (exact) in scratch. */
nvl_status nvl_widen_f32(nvl_kctx *ctx, const float **out, const void *x, nvl_dtype dt, int64_t n) {
  if (dt == NVL_F32) {
    *out = x;
    return NVL_OK;
  }
  float *w;
  NVL_TRY(ctx->scratch(ctx, (size_t)n * sizeof(float), (void **)&w));
  const uint16_t *h = x;
  for (int64_t i = 0; i < n; i++) w[i] = nvl_bf16_to_f32(h[i]);
  *out = w;
  return NVL_OK;
}

static nvl_status cross_entropy(nvl_kctx *ctx, double *total_out, int total_on_device, float *dlogits,
                                const void *logits_in, nvl_dtype logits_dtype, const int64_t *targets, int64_t N,
                                int64_t V, int64_t ignore_index, double z_loss, double grad_scale) {
  (void)total_on_device; /* host memory either way */
  const float *logits;
  NVL_TRY(nvl_widen_f32(ctx, &logits, logits_in, logits_dtype, N * V));
  double total = 0.0;
  for (int64_t n = 0; n < N; n++) {
    const float *x = logits + n * V;
    float *d = dlogits ? dlogits + n * V : NULL;
    if (targets[n] == ignore_index) {
      if (d) memset(d, 0, (size_t)V * sizeof(float));
      continue;
    }
    double m = -INFINITY;
    for (int64_t i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
    double s = 0.0;
    for (int64_t i = 0; i < V; i++) s += exp((double)x[i] - m);
    double lse = m + log(s);
    total += lse - (double)x[targets[n]] + z_loss * lse * lse;
    if (d) {
      double k = 1.0 + 2.0 * z_loss * lse;
      for (int64_t i = 0; i < V; i++) {
        double p = exp((double)x[i] - lse);
        d[i] = (float)(grad_scale * (k * p - (i == targets[n] ? 1.0 : 0.0)));
      }
    }
  }
  *total_out = total;
  return NVL_OK;
}

/* ---- knowledge distillation ----------------------------------------------------------------- */

/* lse of x / T over V values, in double */
static double lse_over(const float *x, int64_t V, double T) {
  double m = -INFINITY;
  for (int64_t i = 0; i < V; i++) m = (double)x[i] / T > m ? (double)x[i] / T : m;
  double s = 0.0;
  for (int64_t i = 0; i < V; i++) s += exp((double)x[i] / T - m);
  return m + log(s);
}

nvl_status nvl_distill_ref(nvl_kctx *ctx, double *kl_out, double *ce_out, float *dlogits, const void *s_in,
                           nvl_dtype s_dtype, const void *t_in, nvl_dtype t_dtype, const int64_t *targets, int64_t N,
                           int64_t V, int64_t ignore_index, double T, double alpha, double grad_scale) {
  const float *s, *t;
  NVL_TRY(nvl_widen_f32(ctx, &s, s_in, s_dtype, N * V));
  NVL_TRY(nvl_widen_f32(ctx, &t, t_in, t_dtype, N * V));
  double kl = 0.0, ce = 0.0;
  for (int64_t n = 0; n < N; n++) {
    const float *x = s + n * V, *y = t + n * V;
    float *d = dlogits ? dlogits + n * V : NULL;
    if (targets[n] == ignore_index) {
      if (d) memset(d, 0, (size_t)V * sizeof(float));
      continue;
    }
    double lse1 = lse_over(x, V, 1.0), lse_s = lse_over(x, V, T), lse_t = lse_over(y, V, T);
    ce += lse1 - (double)x[targets[n]];
    double k = 0.0;
    for (int64_t i = 0; i < V; i++) {
      double lpt = (double)y[i] / T - lse_t, lps = (double)x[i] / T - lse_s, pt = exp(lpt);
      k += pt * (lpt - lps);
      if (d) {
        double g = alpha * T * (exp(lps) - pt) + (1.0 - alpha) * (exp((double)x[i] - lse1) - (i == targets[n]));
        d[i] = (float)(grad_scale * g);
      }
    }
    kl += k;
  }
  *kl_out = kl;
  *ce_out = ce;
  return NVL_OK;
}

/* ---- AdamW ------------------------------------------------------------------------------------ */

nvl_adamw_coefs nvl_adamw_coefs_of(const nvl_adamw_opts *o) {
  nvl_adamw_coefs k;
  double bc1 = 1.0 - pow(o->beta1, (double)o->step);
  double bc2 = 1.0 - pow(o->beta2, (double)o->step);
  k.decay = (float)(1.0 - o->lr * o->weight_decay);
  k.w1 = (float)(1.0 - o->beta1);
  k.b2 = (float)o->beta2;
  k.one_minus_b2 = (float)(1.0 - o->beta2);
  k.bc2_sqrt = (float)sqrt(bc2);
  k.eps = (float)o->eps;
  k.neg_step_size = (float)(-(o->lr / bc1));
  return k;
}

static nvl_status adamw_step(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                             const nvl_adamw_opts *o) {
  nvl_adamw_coefs k = nvl_adamw_coefs_of(o);
  int bad = 0;
  for (int64_t i = 0; i < n; i++) {
    nvl_adamw_elem(&param[i], grad[i], &m[i], &v[i], &k);
    bad |= !isfinite(param[i]);
  }
  if (bad) nvl_host_nonfinite_set(NVL_NONFINITE_PARAM); /* backend.h */
  return NVL_OK;
}

static nvl_status adamw_multi(nvl_kctx *ctx, const nvl_adamw_chunk *t, int64_t count, const nvl_adamw_opts *o,
                              const int64_t *state) {
  nvl_adamw_opts o0 = *o;
  o0.weight_decay = 0.0;
  nvl_adamw_coefs kd = nvl_adamw_coefs_of(o), k0 = nvl_adamw_coefs_of(&o0);
  const double c = state ? nvl_norm_state_get(state, NVL_NORM_CLIP) : 1.0;
  for (int64_t j = 0; j < count; j++) {
    const nvl_adamw_coefs *k = t[j].no_decay ? &k0 : &kd;
    int bad = 0;
    for (int64_t i = 0; i < t[j].n; i++) {
      float g = state ? nvl_clip_scale(t[j].grad[i], c) : t[j].grad[i];
      nvl_adamw_elem(&t[j].param[i], g, &t[j].m[i], &t[j].v[i], k);
      bad |= !isfinite(t[j].param[i]);
    }
    if (bad) nvl_host_nonfinite_set(NVL_NONFINITE_PARAM); /* backend.h */
  }
  return NVL_OK;
}

/* ---- sum of squares --------------------------------------------------------------------------- */

static nvl_status sumsq(nvl_kctx *ctx, double *out, const void *x_in, nvl_dtype dt, int64_t n) {
  const float *x;
  NVL_TRY(nvl_widen_f32(ctx, &x, x_in, dt, n));
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += (double)x[i] * x[i];
  *out = s;
  return NVL_OK;
}

static nvl_status grad_norm_multi(nvl_kctx *ctx, int64_t *state, const float *const *x, const int64_t *n,
                                  int64_t count, double max_norm, int take_nonfinite) {
  double ss = 0.0;
  for (int64_t j = 0; j < count; j++) {
    double s = 0.0;
    for (int64_t i = 0; i < n[j]; i++) s += (double)x[j][i] * x[j][i];
    ss += s;
  }
  nvl_norm_state_set(state, NVL_NORM_SUMSQ, ss);
  nvl_norm_state_set(state, NVL_NORM_CLIP, nvl_clip_factor(ss, max_norm));
  state[NVL_NORM_NONFINITE] = take_nonfinite ? nvl_host_nonfinite_take() : 0;
  return NVL_OK;
}

static nvl_status grad_norm_combine(nvl_kctx *ctx, int64_t *state, const int64_t *parts, int64_t count,
                                    double max_norm) {
  (void)ctx;
  double ss = 0.0;
  for (int64_t r = 0; r < count; r++) ss += nvl_norm_state_get(parts + r * NVL_NORM_STATE, NVL_NORM_SUMSQ);
  nvl_norm_state_set(state, NVL_NORM_SUMSQ, ss);
  nvl_norm_state_set(state, NVL_NORM_CLIP, nvl_clip_factor(ss, max_norm));
  return NVL_OK;
}

/* ---- the reference table's layer kernels ----------------------------------------------------- */

static nvl_status block_sqerr(nvl_kctx *ctx, float *out, const float *a, const float *b, int64_t rows, int64_t K,
                              int64_t block) {
  (void)ctx;
  for (int64_t g = 0; g < rows * (K / block); g++) out[g] = nvl_group_sqerr(a, b, g * block, (g + 1) * block);
  return NVL_OK;
}

/* the host's flags (formats_ref.h), shared by the CPU tables */
static nvl_status nonfinite_take(nvl_kctx *ctx, uint32_t *flags) {
  (void)ctx;
  *flags = nvl_host_nonfinite_take();
  return NVL_OK;
}

const nvl_layer_kernels nvl_layers_ref = {
  .embedding_forward = embedding_forward,
  .embedding_backward = embedding_backward,
  .rmsnorm_forward = rmsnorm_forward,
  .rmsnorm_backward = rmsnorm_backward,
  .rope_tables = rope_tables,
  .rope_forward = rope_forward,
  .rope_backward = rope_backward,
  .swiglu_forward = swiglu_forward,
  .swiglu_backward = swiglu_backward,
  .cross_entropy = cross_entropy,
  .adamw_step = adamw_step,
  .sumsq = sumsq,
  .block_sqerr = block_sqerr,
  .distill = nvl_distill_ref,
  .attention_forward = nvl_attention_forward_ref,
  .attention_backward = nvl_attention_backward_ref,
  .attention_forward_at = nvl_attention_forward_at_ref,
  .adamw_multi = adamw_multi,
  .grad_norm_multi = grad_norm_multi,
  .grad_norm_combine = grad_norm_combine,
  .nonfinite_take = nonfinite_take,
};
