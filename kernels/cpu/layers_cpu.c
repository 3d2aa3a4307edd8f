/* layers_cpu.c: fast CPU kernels of the layer library (see layers_cpu.h). Rows go to OpenMP
 * threads; parameter gradients (embedding, rmsnorm dweight) go by column chunks instead, each
 * column summed over the rows in order, so there are no races, no atomics and the same bits as
 * the reference whatever the thread count. Sums over a whole tensor (cross-entropy loss, sumsq)
 * use at most MAX_PARTS fixed chunks combined in order.
 *
 * Not here: validation, allocation (beyond small stack arrays), tensors, Lua. Needs IEEE f32 in
 * the default rounding mode (no -ffast-math), as the references do. */
#include "cpu/attention_bf16_cpu.h"
#include "cpu/attention_cpu.h"
#include "cpu/layers_cpu.h"
#include "cpu/ops_cpu.h"
#include "cpu/simd_cpu.h"
#include "cpu/ref/attention_ref.h"
#include "cpu/ref/formats_ref.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define NVL_LAYERS_OMP_MIN 32768 /* elements; below this one thread is faster */
#define COL_CHUNK 64              /* columns per task for the parameter-gradient scatters/sums */
#define MAX_PARTS 256             /* chunks of a whole-tensor sum */

/* ---- embedding -------------------------------------------------------------------------------- */

static nvl_status embedding_forward(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N,
                                    int64_t C) {
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t n = 0; n < N; n++) memcpy(out + n * C, weight + ids[n] * C, (size_t)C * sizeof(float));
  return NVL_OK;
}

static nvl_status embedding_backward(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                     int64_t C) {
  int64_t nchunks = (C + COL_CHUNK - 1) / COL_CHUNK;
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t k = 0; k < nchunks; k++) {
    int64_t c0 = k * COL_CHUNK, c1 = c0 + COL_CHUNK < C ? c0 + COL_CHUNK : C;
    for (int64_t n = 0; n < N; n++) {
      float *restrict dw = dweight + ids[n] * C;
      const float *restrict g = dout + n * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; c++) dw[c] += g[c];
    }
  }
  return NVL_OK;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

/* The row and column work of RMSNorm, shared by the f32 and the bf16 kernels: noinline, so both run
 * the same machine code (the same double sums, in the same order) and a bf16 kernel is the f32 one
 * on the widened inputs, each output rounded once. */
__attribute__((noinline)) static float rms_row(float *restrict o, const float *restrict xr,
                                               const float *restrict weight, int64_t C, double eps) {
  double ss = 0.0;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
  float r = (float)(1.0 / sqrt(ss / (double)C + eps));
#pragma omp simd
  for (int64_t c = 0; c < C; c++) o[c] = (xr[c] * r) * weight[c];
  return r;
}

__attribute__((noinline)) static void rms_dx_row(float *restrict o, const float *restrict g,
                                                 const float *restrict xr, const float *restrict weight, double r,
                                                 int64_t C) {
  double dot = 0.0;
#pragma omp simd reduction(+ : dot)
  for (int64_t c = 0; c < C; c++) dot += (double)g[c] * weight[c] * xr[c];
  double k = r * r * r * dot / (double)C;
#pragma omp simd
  for (int64_t c = 0; c < C; c++) o[c] = (float)(r * weight[c] * g[c] - (double)xr[c] * k);
}

__attribute__((noinline)) static void rms_dw_acc(double *restrict acc, const float *restrict g,
                                                 const float *restrict xr, double r, int64_t len) {
#pragma omp simd
  for (int64_t j = 0; j < len; j++) acc[j] += (double)g[j] * xr[j] * r;
}

static void widen_row(float *restrict y, const uint16_t *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = f32_of(x[i]);
}

static void round_row(uint16_t *restrict y, const float *restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = bf16_of(x[i]);
}

static nvl_status rmsnorm_forward(nvl_kctx *ctx, float *out, float *rstd, const float *x, const float *weight,
                                  int64_t N, int64_t C, double eps) {
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t n = 0; n < N; n++) rstd[n] = rms_row(out + n * C, x + n * C, weight, C, eps);
  return NVL_OK;
}

/* per-thread rows of f32 for the bf16 kernels: nt * per floats of call scratch */
static nvl_status thread_rows(nvl_kctx *ctx, int64_t per, float **buf) {
  return ctx->scratch(ctx, (size_t)omp_get_max_threads() * (size_t)per * sizeof(float), (void **)buf);
}

static nvl_status rmsnorm_forward_bf16(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x,
                                       const float *weight, int64_t N, int64_t C, double eps) {
  float *buf;
  NVL_TRY(thread_rows(ctx, 2 * C, &buf));
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t n = 0; n < N; n++) {
    float *xw = buf + (int64_t)omp_get_thread_num() * 2 * C, *o = xw + C;
    widen_row(xw, x + n * C, C);
    rstd[n] = rms_row(o, xw, weight, C, eps);
    round_row(out + n * C, o, C);
  }
  return NVL_OK;
}

/* dweight by column chunks: each column sums its rows in order, as the reference does; dout and x
 * f32 (g32, x32) or bf16 (g16, x16, widened a chunk at a time) */
static void rms_dweight(float *dweight, const float *g32, const float *x32, const uint16_t *g16, const uint16_t *x16,
                        const float *rstd, int64_t N, int64_t C) {
  int64_t nchunks = (C + COL_CHUNK - 1) / COL_CHUNK;
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t kc = 0; kc < nchunks; kc++) {
    int64_t c0 = kc * COL_CHUNK, len = c0 + COL_CHUNK < C ? COL_CHUNK : C - c0;
    double acc[COL_CHUNK];
    float gw[COL_CHUNK], xw[COL_CHUNK];
    for (int64_t j = 0; j < len; j++) acc[j] = 0.0;
    for (int64_t n = 0; n < N; n++) {
      if (g16) {
        widen_row(gw, g16 + n * C + c0, len);
        widen_row(xw, x16 + n * C + c0, len);
        rms_dw_acc(acc, gw, xw, rstd[n], len);
      } else {
        rms_dw_acc(acc, g32 + n * C + c0, x32 + n * C + c0, rstd[n], len);
      }
    }
    for (int64_t j = 0; j < len; j++) dweight[c0 + j] = (float)((double)dweight[c0 + j] + acc[j]);
  }
}

static nvl_status rmsnorm_backward(nvl_kctx *ctx, float *dx, float *dweight, const float *dout, const float *x,
                                   const float *weight, const float *rstd, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t n = 0; n < N; n++) rms_dx_row(dx + n * C, dout + n * C, x + n * C, weight, rstd[n], C);
  rms_dweight(dweight, dout, x, NULL, NULL, rstd, N, C);
  return NVL_OK;
}

static nvl_status rmsnorm_backward_bf16(nvl_kctx *ctx, uint16_t *dx, float *dweight, const uint16_t *dout,
                                        const uint16_t *x, const float *weight, const float *rstd, int64_t N,
                                        int64_t C) {
  float *buf;
  NVL_TRY(thread_rows(ctx, 3 * C, &buf));
#pragma omp parallel for schedule(static) if (N * C > NVL_LAYERS_OMP_MIN)
  for (int64_t n = 0; n < N; n++) {
    float *gw = buf + (int64_t)omp_get_thread_num() * 3 * C, *xw = gw + C, *o = xw + C;
    widen_row(gw, dout + n * C, C);
    widen_row(xw, x + n * C, C);
    rms_dx_row(o, gw, xw, weight, rstd[n], C);
    round_row(dx + n * C, o, C);
  }
  rms_dweight(dweight, NULL, NULL, dout, x, rstd, N, C);
  return NVL_OK;
}

/* ---- RoPE: one (b, t, h) row of D at a time, the halves in separate loops so both vectorise --- */

/* one row, forward (bwd 0) or backward: per element a double sum rounded once, so the f32 and the
 * bf16 kernels (the latter on a row widened in cache, rounded after) give the same bits */
static void rope_row(float *restrict o, const float *restrict xr, const float *restrict c, const float *restrict s,
                     int64_t D, int bwd) {
  int64_t h = D / 2;
  if (!bwd) {
#pragma omp simd
    for (int64_t j = 0; j < h; j++) o[j] = (float)((double)xr[j] * c[j] + -(double)xr[j + h] * s[j]);
#pragma omp simd
    for (int64_t j = h; j < D; j++) o[j] = (float)((double)xr[j] * c[j] + (double)xr[j - h] * s[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < h; j++) o[j] = (float)((double)xr[j] * c[j] + (double)xr[j + h] * s[j + h]);
#pragma omp simd
    for (int64_t j = h; j < D; j++) o[j] = (float)((double)xr[j] * c[j] + -(double)xr[j - h] * s[j - h]);
  }
}

static void rope_rows(float *out, const float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                      int64_t H, int64_t D, int bwd) {
  int64_t rows = B * T * H;
#pragma omp parallel for schedule(static) if (rows * D > NVL_LAYERS_OMP_MIN)
  for (int64_t row = 0; row < rows; row++) {
    int64_t t = (row / H) % T;
    rope_row(out + row * D, x + row * D, cos_t + t * D, sin_t + t * D, D, bwd);
  }
}

static nvl_status rope_forward(nvl_kctx *ctx, float *out, const float *x, const float *cos_t, const float *sin_t,
                               int64_t B, int64_t T, int64_t H, int64_t D) {
  rope_rows(out, x, cos_t, sin_t, B, T, H, D, 0);
  return NVL_OK;
}

static nvl_status rope_backward(nvl_kctx *ctx, float *dx, const float *dout, const float *cos_t, const float *sin_t,
                                int64_t B, int64_t T, int64_t H, int64_t D) {
  rope_rows(dx, dout, cos_t, sin_t, B, T, H, D, 1);
  return NVL_OK;
}

static nvl_status rope_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *x, const float *cos_t, const float *sin_t,
                            int64_t B, int64_t T, int64_t H, int64_t D, int bwd) {
  int64_t rows = B * T * H;
  float *buf;
  NVL_TRY(thread_rows(ctx, 2 * D, &buf));
#pragma omp parallel for schedule(static) if (rows * D > NVL_LAYERS_OMP_MIN)
  for (int64_t row = 0; row < rows; row++) {
    int64_t t = (row / H) % T;
    float *xw = buf + (int64_t)omp_get_thread_num() * 2 * D, *o = xw + D;
    widen_row(xw, x + row * D, D);
    rope_row(o, xw, cos_t + t * D, sin_t + t * D, D, bwd);
    round_row(out + row * D, o, D);
  }
  return NVL_OK;
}

static nvl_status rope_forward_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *x, const float *cos_t,
                                    const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t D) {
  return rope_bf16(ctx, out, x, cos_t, sin_t, B, T, H, D, 0);
}

static nvl_status rope_backward_bf16(nvl_kctx *ctx, uint16_t *dx, const uint16_t *dout, const float *cos_t,
                                     const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t D) {
  return rope_bf16(ctx, dx, dout, cos_t, sin_t, B, T, H, D, 1);
}

/* ---- SwiGLU (f32 arithmetic, expf) ------------------------------------------------------------ */

/* One element of SwiGLU and of its backward in f32 (exp_f32: vectorises); the f32 and the bf16
 * kernels below share them, so a bf16 kernel is the f32 one on the widened inputs, rounded once. */
static inline float swiglu_one(float g, float u) { return g / (1.0f + exp_f32(-g)) * u; }

static inline void swiglu_grad_one(float *dg, float *du, float d, float g, float u) {
  float s = 1.0f / (1.0f + exp_f32(-g));
  *dg = d * u * s * (1.0f + g * (1.0f - s));
  *du = d * g * s;
}

NVL_CLONES static void swiglu_fwd_rows(float *out, const float *gate, const float *up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) out[i] = swiglu_one(gate[i], up[i]);
}

NVL_CLONES static void swiglu_bwd_rows(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                       int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) swiglu_grad_one(&dgate[i], &dup[i], dout[i], gate[i], up[i]);
}

/* bf16 rows: widened into f32 blocks, the f32 rows above, rounded back (each loop vectorises) */
#define BF16_BLOCK 512

static void widen_block(float *y, const uint16_t *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = f32_of(x[i]);
}

static void round_block(uint16_t *y, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = bf16_of(x[i]);
}

static void swiglu_fwd_rows_bf16(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n) {
  float g[BF16_BLOCK], u[BF16_BLOCK], o[BF16_BLOCK];
  for (int64_t i0 = 0; i0 < n; i0 += BF16_BLOCK) {
    int64_t m = n - i0 < BF16_BLOCK ? n - i0 : BF16_BLOCK;
    widen_block(g, gate + i0, m);
    widen_block(u, up + i0, m);
    swiglu_fwd_rows(o, g, u, m);
    round_block(out + i0, o, m);
  }
}

static void swiglu_bwd_rows_bf16(uint16_t *dgate, uint16_t *dup, const uint16_t *dout, const uint16_t *gate,
                                 const uint16_t *up, int64_t n) {
  float d[BF16_BLOCK], g[BF16_BLOCK], u[BF16_BLOCK], dg[BF16_BLOCK], du[BF16_BLOCK];
  for (int64_t i0 = 0; i0 < n; i0 += BF16_BLOCK) {
    int64_t m = n - i0 < BF16_BLOCK ? n - i0 : BF16_BLOCK;
    widen_block(d, dout + i0, m);
    widen_block(g, gate + i0, m);
    widen_block(u, up + i0, m);
    swiglu_bwd_rows(dg, du, d, g, u, m);
    round_block(dgate + i0, dg, m);
    round_block(dup + i0, du, m);
  }
}

#define SWIGLU_CHUNK 4096 /* elements per OpenMP task */
#define SWIGLU_TASKS(n) (((n) + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK)
#define SWIGLU_SPAN(c, n) int64_t i0 = (c) * SWIGLU_CHUNK, m = (n) - i0 < SWIGLU_CHUNK ? (n) - i0 : SWIGLU_CHUNK

static nvl_status swiglu_forward(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > NVL_LAYERS_OMP_MIN)
  for (int64_t c = 0; c < SWIGLU_TASKS(n); c++) {
    SWIGLU_SPAN(c, n);
    swiglu_fwd_rows(out + i0, gate + i0, up + i0, m);
  }
  return NVL_OK;
}

static nvl_status swiglu_forward_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate, const uint16_t *up,
                                      int64_t n) {
#pragma omp parallel for schedule(static) if (n > NVL_LAYERS_OMP_MIN)
  for (int64_t c = 0; c < SWIGLU_TASKS(n); c++) {
    SWIGLU_SPAN(c, n);
    swiglu_fwd_rows_bf16(out + i0, gate + i0, up + i0, m);
  }
  return NVL_OK;
}

static nvl_status swiglu_backward(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                                  const float *up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > NVL_LAYERS_OMP_MIN)
  for (int64_t c = 0; c < SWIGLU_TASKS(n); c++) {
    SWIGLU_SPAN(c, n);
    swiglu_bwd_rows(dgate + i0, dup + i0, dout + i0, gate + i0, up + i0, m);
  }
  return NVL_OK;
}

static nvl_status swiglu_backward_bf16(nvl_kctx *ctx, uint16_t *dgate, uint16_t *dup, const uint16_t *dout,
                                       const uint16_t *gate, const uint16_t *up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > NVL_LAYERS_OMP_MIN)
  for (int64_t c = 0; c < SWIGLU_TASKS(n); c++) {
    SWIGLU_SPAN(c, n);
    swiglu_bwd_rows_bf16(dgate + i0, dup + i0, dout + i0, gate + i0, up + i0, m);
  }
  return NVL_OK;
}

/* ---- cross-entropy: max, then exp(x - max) once per element (kept in dlogits), then scale ----- */

/* One counted row: returns lse - x[t] + z lse^2. */
static double ce_row(float *restrict d, const float *restrict x, int64_t t, int64_t V, double z_loss,
                     double grad_scale) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
  double s = 0.0;
  if (d) {
    for (int64_t i = 0; i < V; i++) {
      float e = expf(x[i] - m);
      d[i] = e;
      s += e;
    }
  } else {
    for (int64_t i = 0; i < V; i++) s += expf(x[i] - m);
  }
  double lse = (double)m + log(s);
  if (d) {
    double k = 1.0 + 2.0 * z_loss * lse;
    double et = d[t];
    float f = (float)(grad_scale * k / s);
#pragma omp simd
    for (int64_t i = 0; i < V; i++) d[i] = d[i] * f;
    d[t] = (float)(grad_scale * (k * et / s - 1.0));
  }
  return lse - (double)x[t] + z_loss * lse * lse;
}

/* *out = x as f32: x itself, or a widened copy of bf16 x (exact) in scratch. */
static nvl_status widen(nvl_kctx *ctx, const float **out, const void *x, nvl_dtype dt, int64_t n) {
  if (dt == NVL_F32) {
    *out = x;
    return NVL_OK;
  }
  float *w;
  NVL_TRY(ctx->scratch(ctx, (size_t)n * sizeof(float), (void **)&w));
  nvl_bf16_to_f32_cpu(w, x, n);
  *out = w;
  return NVL_OK;
}

static nvl_status cross_entropy(nvl_kctx *ctx, double *total_out, int total_on_device, float *dlogits,
                                const void *logits_in,
                                nvl_dtype logits_dtype, const int64_t *targets, int64_t N, int64_t V,
                                int64_t ignore_index, double z_loss, double grad_scale) {
  (void)total_on_device; /* the CPU's memory is the host's */
  const float *logits;
  NVL_TRY(widen(ctx, &logits, logits_in, logits_dtype, N * V));
  double part[MAX_PARTS];
  int64_t per = (N + MAX_PARTS - 1) / MAX_PARTS, nparts = per ? (N + per - 1) / per : 0;
#pragma omp parallel for schedule(dynamic, 1) if (N * V > NVL_LAYERS_OMP_MIN)
  for (int64_t k = 0; k < nparts; k++) {
    int64_t n0 = k * per, n1 = n0 + per < N ? n0 + per : N;
    double acc = 0.0;
    for (int64_t n = n0; n < n1; n++) {
      float *d = dlogits ? dlogits + n * V : NULL;
      if (targets[n] == ignore_index) {
        if (d) memset(d, 0, (size_t)V * sizeof(float));
        continue;
      }
      acc += ce_row(d, logits + n * V, targets[n], V, z_loss, grad_scale);
    }
    part[k] = acc;
  }
  double total = 0.0;
  for (int64_t k = 0; k < nparts; k++) total += part[k];
  *total_out = total;
  return NVL_OK;
}

/* ---- AdamW ------------------------------------------------------------------------------------ */

/* The bits of |f| with NaN kept: >= 0x7F800000 exactly for a NaN or an infinity. */
static inline int32_t raw_bits_f(float f) {
  int32_t b;
  memcpy(&b, &f, 4);
  return b & 0x7FFFFFFF;
}

/* The host's NVL_NONFINITE_PARAM when a chunk's updated parameters' raw bits reach a non-finite
 * value (a NaN or an infinity read or made): folded into the update loop, no pass of its own. */
static inline void flag_params(int32_t raw) {
  if (raw >= 0x7F800000) nvl_host_nonfinite_set(NVL_NONFINITE_PARAM);
}

/* One chunk. Vectorises where sqrtf need not set errno (-fno-math-errno); as built, gcc keeps
 * it scalar, which costs little: the step is bound by memory traffic (7 floats per element). */
static void adamw_span(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, int64_t n,
                       const nvl_adamw_coefs *k) {
  nvl_adamw_coefs kk = *k;
  int32_t raw = 0;
#pragma omp simd reduction(max : raw)
  for (int64_t i = 0; i < n; i++) {
    nvl_adamw_elem(&p[i], g[i], &m[i], &v[i], &kk);
    int32_t r = raw_bits_f(p[i]);
    raw = r > raw ? r : raw;
  }
  flag_params(raw);
}

static nvl_status adamw_step(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                             const nvl_adamw_opts *o) {
  nvl_adamw_coefs k = nvl_adamw_coefs_of(o);
  const int64_t chunk = 8192;
  int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (n > NVL_LAYERS_OMP_MIN)
  for (int64_t c = 0; c < nchunks; c++) {
    int64_t i0 = c * chunk, len = i0 + chunk < n ? chunk : n - i0;
    adamw_span(param + i0, grad + i0, m + i0, v + i0, len, &k);
  }
  return NVL_OK;
}

/* One chunk, its grad scaled by the clip factor c first. */
static void adamw_span_clip(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                            int64_t n, const nvl_adamw_coefs *k, double c) {
  nvl_adamw_coefs kk = *k;
  int32_t raw = 0;
  for (int64_t i = 0; i < n; i++) {
    nvl_adamw_elem(&p[i], nvl_clip_scale(g[i], c), &m[i], &v[i], &kk);
    int32_t r = raw_bits_f(p[i]);
    raw = r > raw ? r : raw;
  }
  flag_params(raw);
}

/* Each tensor as adamw_step (the same chunks; a tensor's weight decay 0 when no_decay). */
static nvl_status adamw_multi(nvl_kctx *ctx, const nvl_adamw_chunk *t, int64_t count, const nvl_adamw_opts *o,
                              const int64_t *state) {
  nvl_adamw_opts o0 = *o;
  o0.weight_decay = 0.0;
  nvl_adamw_coefs kd = nvl_adamw_coefs_of(o), k0 = nvl_adamw_coefs_of(&o0);
  const double c = state ? nvl_norm_state_get(state, NVL_NORM_CLIP) : 1.0;
  const int64_t chunk = 8192;
  for (int64_t j = 0; j < count; j++) {
    const nvl_adamw_chunk *e = &t[j];
    const nvl_adamw_coefs *k = e->no_decay ? &k0 : &kd;
    int64_t nchunks = (e->n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (e->n > NVL_LAYERS_OMP_MIN)
    for (int64_t ci = 0; ci < nchunks; ci++) {
      int64_t i0 = ci * chunk, len = i0 + chunk < e->n ? chunk : e->n - i0;
      if (state) adamw_span_clip(e->param + i0, e->grad + i0, e->m + i0, e->v + i0, len, k, c);
      else adamw_span(e->param + i0, e->grad + i0, e->m + i0, e->v + i0, len, k);
    }
  }
  return NVL_OK;
}

/* ---- sum of squares --------------------------------------------------------------------------- */

static nvl_status sumsq(nvl_kctx *ctx, double *out, const void *x_in, nvl_dtype dt, int64_t n) {
  const float *x;
  NVL_TRY(widen(ctx, &x, x_in, dt, n));
  double part[MAX_PARTS];
  int64_t per = (n + MAX_PARTS - 1) / MAX_PARTS;
  if (per < 4096) per = 4096;
  int64_t nparts = (n + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_LAYERS_OMP_MIN)
  for (int64_t k = 0; k < nparts; k++) {
    int64_t i0 = k * per, i1 = i0 + per < n ? i0 + per : n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; i++) s += (double)x[i] * x[i];
    part[k] = s;
  }
  double total = 0.0;
  for (int64_t k = 0; k < nparts; k++) total += part[k];
  *out = total;
  return NVL_OK;
}

/* the reference's groups (layers_ref.h nvl_group_sqerr), in parallel: each group's sum in its own order */
static nvl_status block_sqerr(nvl_kctx *ctx, float *out, const float *a, const float *b, int64_t rows, int64_t K,
                              int64_t block) {
  (void)ctx;
  const int64_t ng = rows * (K / block);
#pragma omp parallel for schedule(static) if (rows * K > NVL_LAYERS_OMP_MIN)
  for (int64_t g = 0; g < ng; g++) out[g] = nvl_group_sqerr(a, b, g * block, (g + 1) * block);
  return NVL_OK;
}

static nvl_status amax_history(nvl_kctx *ctx, float *sel, float *hist, int64_t len, int64_t count, int64_t pos,
                               const float *cur) {
  (void)ctx;
  float m = 0.0f, last = hist[len];
  for (int64_t i = 0; i < count; i++)
    if (isfinite(hist[i]) && hist[i] > m) m = hist[i];
  if (m > 0.0f) last = m;
  *sel = last > 0.0f ? last : *cur;
  hist[len] = last;
  hist[pos] = *cur;
  return NVL_OK;
}

/* Each tensor's sumsq as core.sumsq computes it, added in order in double (optim.grad_norm's sum,
 * bit for bit). */
static nvl_status grad_norm_multi(nvl_kctx *ctx, int64_t *state, const float *const *x, const int64_t *n,
                                  int64_t count, double max_norm, int take_nonfinite) {
  double ss = 0.0;
  for (int64_t j = 0; j < count; j++) {
    double s = 0.0;
    if (n[j] > 0) NVL_TRY(sumsq(ctx, &s, x[j], NVL_F32, n[j]));
    ss += s;
  }
  nvl_norm_state_set(state, NVL_NORM_SUMSQ, ss);
  nvl_norm_state_set(state, NVL_NORM_CLIP, nvl_clip_factor(ss, max_norm));
  state[NVL_NORM_NONFINITE] = take_nonfinite ? nvl_host_nonfinite_take() : 0;
  return NVL_OK;
}

/* ---- the CPU table's layer kernels (rope_tables: the reference's, through the fallback) -------- */

/* the host's flags (formats_ref.h), shared by the CPU tables */
static nvl_status nonfinite_take(nvl_kctx *ctx, uint32_t *flags) {
  (void)ctx;
  *flags = nvl_host_nonfinite_take();
  return NVL_OK;
}

const nvl_layer_kernels nvl_layers_cpu = {
  .embedding_forward = embedding_forward,
  .embedding_backward = embedding_backward,
  .rmsnorm_forward = rmsnorm_forward,
  .rmsnorm_backward = rmsnorm_backward,
  .rope_forward = rope_forward,
  .rope_backward = rope_backward,
  .swiglu_forward = swiglu_forward,
  .swiglu_backward = swiglu_backward,
  .attention_bf16_ready = nvl_attention_bf16_cpu_ready,
  .attention_forward_bf16 = nvl_attention_forward_bf16_cpu,
  .attention_backward_bf16 = nvl_attention_backward_bf16_cpu,
  .rope_forward_bf16 = rope_forward_bf16,
  .rope_backward_bf16 = rope_backward_bf16,
  .rmsnorm_forward_bf16 = rmsnorm_forward_bf16,
  .rmsnorm_backward_bf16 = rmsnorm_backward_bf16,
  .swiglu_forward_bf16 = swiglu_forward_bf16,
  .swiglu_backward_bf16 = swiglu_backward_bf16,
  .cross_entropy = cross_entropy,
  .adamw_step = adamw_step,
  .sumsq = sumsq,
  .block_sqerr = block_sqerr,
  .distill = nvl_distill_ref, /* the reference's loop (one pass per row; the teacher runs anyway) */
  .amax_history = amax_history,
  .attention_forward = nvl_attention_forward_cpu,
  .attention_backward = nvl_attention_backward_cpu,
  /* the reference's loop: a cached step reads each key once per query row (memory-bound, no product to tile) */
  .attention_forward_at = nvl_attention_forward_at_ref,
  .adamw_multi = adamw_multi,
  .grad_norm_multi = grad_norm_multi,
  .nonfinite_take = nonfinite_take,
};
