/* attention_ref.c: causal grouped-query attention, the scalar reference (see attention_ref.h).
 * Every dot product and sum runs in double; results are rounded to f32 once. */
#include <math.h>
#include "cpu/ref/attention_ref.h"

/* Row t of head h of a (B, T, H, D) buffer. */
static inline const float *row(const float *x, int64_t b, int64_t t, int64_t h, int64_t T, int64_t H, int64_t D) {
  return x + ((b * T + t) * H + h) * D;
}

static inline double dot(const float *a, const float *b, int64_t D) {
  double s = 0.0;
  for (int64_t d = 0; d < D; d++) s += (double)a[d] * (double)b[d];
  return s;
}

/* Queries t < T at positions pos0 + t; keys and values rows s < S of each batch, of which a query sees
 * s <= pos0 + t (the full forward: S = T, pos0 = 0). */
static void forward(float *out, float *lse, const float *q, const float *k, const float *v, double *work, int64_t B,
                    int64_t T, int64_t S, int64_t pos0, int64_t Hq, int64_t Hkv, int64_t D, double scale) {
  int64_t group = Hq / Hkv;
  double *p = work;                 /* (pos0 + T) scores, then exp(score - max) */
  double *acc = work + pos0 + T;    /* (D) sum_s p[s] v[s] */
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hq; h++) {
      int64_t g = h / group;
      for (int64_t t = 0; t < T; t++) {
        const float *qt = row(q, b, t, h, T, Hq, D);
        int64_t last = pos0 + t; /* the last key this query sees */
        double m = -INFINITY;
        for (int64_t s = 0; s <= last; s++) {
          p[s] = dot(qt, row(k, b, s, g, S, Hkv, D), D) * scale;
          if (p[s] > m) m = p[s];
        }
        double sum = 0.0;
        for (int64_t s = 0; s <= last; s++) {
          p[s] = exp(p[s] - m);
          sum += p[s];
        }
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0;
        for (int64_t s = 0; s <= last; s++) {
          const float *vs = row(v, b, s, g, S, Hkv, D);
          for (int64_t d = 0; d < D; d++) acc[d] += p[s] * (double)vs[d];
        }
        float *ot = out + ((b * T + t) * Hq + h) * D;
        for (int64_t d = 0; d < D; d++) ot[d] = (float)(acc[d] / sum);
        lse[(b * Hq + h) * T + t] = (float)(m + log(sum));
      }
    }
}

static void backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k, const float *v,
                     const float *out, const float *lse, double *work, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                     int64_t D, double scale) {
  int64_t group = Hq / Hkv;
  double *p = work;              /* (T) P row */
  double *ds = work + T;         /* (T) dS row */
  double *dk_acc = work + 2 * T; /* (T, D) dk of one (b, kv head) */
  double *dv_acc = dk_acc + T * D; /* (T, D) dv of one (b, kv head) */
  for (int64_t b = 0; b < B; b++)
    for (int64_t g = 0; g < Hkv; g++) {
      for (int64_t i = 0; i < T * D; i++) dk_acc[i] = dv_acc[i] = 0.0;
      for (int64_t h = g * group; h < (g + 1) * group; h++)
        for (int64_t t = 0; t < T; t++) {
          const float *qt = row(q, b, t, h, T, Hq, D);
          const float *go = row(dout, b, t, h, T, Hq, D); /* (D) dout row */
          double l = (double)lse[(b * Hq + h) * T + t];
          double Dt = dot(go, row(out, b, t, h, T, Hq, D), D);
          for (int64_t s = 0; s <= t; s++) {
            p[s] = exp(dot(qt, row(k, b, s, g, T, Hkv, D), D) * scale - l);
            double dp = dot(go, row(v, b, s, g, T, Hkv, D), D);
            ds[s] = p[s] * (dp - Dt);
          }
          float *dqt = dq + ((b * T + t) * Hq + h) * D;
          for (int64_t d = 0; d < D; d++) {
            double a = 0.0;
            for (int64_t s = 0; s <= t; s++) a += ds[s] * (double)row(k, b, s, g, T, Hkv, D)[d];
            dqt[d] = (float)(a * scale);
          }
          for (int64_t s = 0; s <= t; s++)
            for (int64_t d = 0; d < D; d++) {
              dk_acc[s * D + d] += ds[s] * (double)qt[d] * scale;
              dv_acc[s * D + d] += p[s] * (double)go[d];
            }
        }
      for (int64_t s = 0; s < T; s++)
        for (int64_t d = 0; d < D; d++) {
          dk[((b * T + s) * Hkv + g) * D + d] = (float)dk_acc[s * D + d];
          dv[((b * T + s) * Hkv + g) * D + d] = (float)dv_acc[s * D + d];
        }
    }
}

nvl_status nvl_attention_forward_ref(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                     const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                     double scale) {
  double *work; /* T scores + D accumulators */
  NVL_TRY(ctx->scratch(ctx, (size_t)(T + D) * sizeof(double), (void **)&work));
  forward(out, lse, q, k, v, work, B, T, T, 0, Hq, Hkv, D, scale);
  return NVL_OK;
}

nvl_status nvl_attention_forward_at_ref(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                        const float *v, int64_t B, int64_t T, int64_t S, int64_t pos0, int64_t Hq,
                                        int64_t Hkv, int64_t D, double scale) {
  double *work; /* pos0 + T scores + D accumulators */
  NVL_TRY(ctx->scratch(ctx, (size_t)(pos0 + T + D) * sizeof(double), (void **)&work));
  forward(out, lse, q, k, v, work, B, T, S, pos0, Hq, Hkv, D, scale);
  return NVL_OK;
}

nvl_status nvl_attention_backward_ref(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                                      const float *q, const float *k, const float *v, const float *out,
                                      const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                      double scale) {
  double *work; /* 2 T (P and dS rows) + 2 T D (dk, dv accumulators) */
  NVL_TRY(ctx->scratch(ctx, (size_t)(2 * T + 2 * T * D) * sizeof(double), (void **)&work));
  backward(dq, dk, dv, dout, q, k, v, out, lse, work, B, T, Hq, Hkv, D, scale);
  return NVL_OK;
}
