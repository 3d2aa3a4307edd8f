/* attention_cpu.c: fast causal grouped-query attention on the CPU (see attention_cpu.h).
 * Per head, the T query rows go in tiles of NVL_ATTN_BLOCK; a tile of rows [i0, i1) only needs
 * keys [0, i1), so each tile is a few sgemms on (m, n) blocks with m <= NVL_ATTN_BLOCK, n = i1,
 * and the causal mask zeroes the tile's upper triangle. Forward tiles (b, tile, head) and backward
 * (b, kv head) groups run on OpenMP threads; while they do, OpenBLAS is held to one thread (its
 * pthread build must not be entered from an active OpenMP region with its own threads), and
 * restored after. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#include "cpu/attention_cpu.h"
#include "cpu/simd_cpu.h"

/* The row loops (max, exp, sums) get AVX2 / AVX-512 clones (NVL_CLONES, simd_cpu.h). */
#define NVL_ROWS NVL_CLONES

#define NVL_ATTN_LANES 16 /* partial maxima and sums per row: a fixed order, the same bits on every clone */

/* Forward softmax of one score row s[0..t] (the causal part; s[t+1..n) are set to 0): s[j] becomes
 * exp(s[j] - max); returns the sum in double, accumulated in NVL_ATTN_LANES lanes (lane l takes
 * j = l mod NVL_ATTN_LANES) then added lane by lane; *mx the max. */
NVL_ROWS double nvl_attn_softmax_row(float *s, int64_t t, int64_t n, float *mx) {
  int64_t len = t + 1, body = len - len % NVL_ATTN_LANES;
  float mm[NVL_ATTN_LANES];
  double acc[NVL_ATTN_LANES];
  for (int l = 0; l < NVL_ATTN_LANES; l++) mm[l] = -INFINITY, acc[l] = 0.0;
  for (int64_t j = 0; j < body; j += NVL_ATTN_LANES)
    for (int l = 0; l < NVL_ATTN_LANES; l++) mm[l] = s[j + l] > mm[l] ? s[j + l] : mm[l];
  for (int64_t j = body; j < len; j++) mm[j - body] = s[j] > mm[j - body] ? s[j] : mm[j - body];
  float m = -INFINITY;
  for (int l = 0; l < NVL_ATTN_LANES; l++) m = mm[l] > m ? mm[l] : m;
#pragma omp simd
  for (int64_t j = 0; j < len; j++) s[j] = exp_f32(s[j] - m);
  for (int64_t j = 0; j < body; j += NVL_ATTN_LANES)
    for (int l = 0; l < NVL_ATTN_LANES; l++) acc[l] += (double)s[j + l];
  for (int64_t j = body; j < len; j++) acc[j - body] += (double)s[j];
  double sum = 0.0;
  for (int l = 0; l < NVL_ATTN_LANES; l++) sum += acc[l];
  if (n > len) memset(s + len, 0, (size_t)(n - len) * sizeof(float));
  *mx = m;
  return sum;
}

/* Backward of one row: p[0..t] scores -> P = exp(score - l); ds[0..t] dP -> P (dP - Dt); both zeroed
 * on (t, n). */
NVL_ROWS void nvl_attn_dsoftmax_row(float *p, float *ds, int64_t t, int64_t n, float l, float Dt) {
#pragma omp simd
  for (int64_t j = 0; j <= t; j++) {
    p[j] = exp_f32(p[j] - l);
    ds[j] = p[j] * (ds[j] - Dt);
  }
  if (n > t + 1) {
    memset(p + t + 1, 0, (size_t)(n - t - 1) * sizeof(float));
    memset(ds + t + 1, 0, (size_t)(n - t - 1) * sizeof(float));
  }
}

static int64_t tile_rows(int64_t T) { return T < NVL_ATTN_BLOCK ? T : NVL_ATTN_BLOCK; }

/* Threads for `tasks` independent tasks, each needing per_thread floats of the workspace. */
/* Threads for `tasks` heads of T x T x D work each: one below ~2 MFLOP in all (a thread team costs
 * more than it saves there, and on a loaded machine a lot more), else up to one per head within
 * the scratch space. */
static int team_size(int64_t tasks, size_t work_floats, size_t per_thread, int64_t T, int64_t D) {
  if ((double)tasks * (double)T * (double)T * (double)D < 1e6) return 1;
  int64_t nt = omp_get_max_threads();
  if (nt > tasks) nt = tasks;
  if (per_thread > 0 && (size_t)nt > work_floats / per_thread) nt = (int64_t)(work_floats / per_thread);
  return nt < 1 ? 1 : (int)nt;
}

/* OpenBLAS single-threaded while a team of nt > 1 threads calls it; returns what to restore. */
static int blas_solo_begin(int nt) {
  if (nt <= 1) return 0;
  int prev = openblas_get_num_threads();
  openblas_set_num_threads(1);
  return prev;
}

static void blas_solo_end(int prev) {
  if (prev > 0) openblas_set_num_threads(prev);
}

static size_t forward_work(int64_t T) {
  return (size_t)omp_get_max_threads() * (size_t)(tile_rows(T) * T);
}

/* One query tile of one (b, query head), rows [i0, i0 + m): q, out (T, D) with row stride ldq; k, v
 * (T, D) with row stride ldk; lse (T); S an (NVL_ATTN_BLOCK, T) tile. The tile needs keys [0, i0 + m)
 * only: the blocks above the diagonal are never computed. */
static void forward_tile(float *out, float *lse, const float *q, const float *k, const float *v, float *S, int64_t i0,
                         int64_t T, int64_t D, int ldq, int ldk, float scale) {
  float rinv[NVL_ATTN_BLOCK]; /* 1 / softmax denominator of each row of the tile */
  int m = (int)tile_rows(T - i0), n = (int)(i0 + m);
  /* S (m, n) = scale * q[i0:i0+m] k[0:n]^T */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, (int)D, scale, q + i0 * ldq, ldq, k, ldk, 0.0f, S, n);
  for (int r = 0; r < m; r++) {
    int64_t t = i0 + r;
    float mx;
    double sum = nvl_attn_softmax_row(S + (int64_t)r * n, t, n, &mx);
    rinv[r] = (float)(1.0 / sum);
    lse[t] = (float)((double)mx + log(sum));
  }
  /* out[i0:i0+m] (m, D) = P v[0:n], then each row divided by its denominator */
  float *o = out + i0 * ldq;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, (int)D, n, 1.0f, S, n, v, ldk, 0.0f, o, ldq);
  for (int r = 0; r < m; r++)
    for (int64_t d = 0; d < D; d++) o[(int64_t)r * ldq + d] *= rinv[r];
}

nvl_status nvl_attention_forward_cpu(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                     const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                     double scale) {
  if (D == 0) return nvl_attention_forward_ref(ctx, out, lse, q, k, v, B, T, Hq, Hkv, D, scale);
  size_t work_floats = forward_work(T);
  float *work;
  NVL_TRY(ctx->scratch(ctx, (work_floats ? work_floats : 1) * sizeof(float), (void **)&work));
  int64_t group = Hq / Hkv, tiles = (T + NVL_ATTN_BLOCK - 1) / NVL_ATTN_BLOCK, tasks = B * Hq * tiles;
  size_t per = (size_t)(tile_rows(T) * T);
  int ldq = (int)(Hq * D), ldk = (int)(Hkv * D);
  int nt = team_size(B * Hq, work_floats, per, T, D);
  int prev = blas_solo_begin(nt);
  /* tasks (b, query tile, head), the last (largest) tiles first so that the small ones fill the gaps;
   * the heads of one tile run back to back and share its kv head's k, v rows in cache */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t i = 0; i < tasks; i++) {
    int64_t b = i / (Hq * tiles), i0 = (tiles - 1 - i / Hq % tiles) * NVL_ATTN_BLOCK, h = i % Hq, g = h / group;
    float *S = work + (size_t)omp_get_thread_num() * per;
    forward_tile(out + (b * T * Hq + h) * D, lse + (b * Hq + h) * T, q + (b * T * Hq + h) * D,
                 k + (b * T * Hkv + g) * D, v + (b * T * Hkv + g) * D, S, i0, T, D, ldq, ldk, (float)scale);
  }
  blas_solo_end(prev);
  return NVL_OK;
}

static size_t backward_work(int64_t T) {
  return (size_t)omp_get_max_threads() * (size_t)(2 * tile_rows(T) * T);
}

/* One query head's contribution: dq (=), dk, dv (+=) of its kv head. q, dout, out, dq (T, D)
 * with row stride ldq; k, v, dk, dv (T, D) with row stride ldk; lse (T); P, dS (NVL_ATTN_BLOCK, T). */
static void backward_head(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                          const float *v, const float *out, const float *lse, float *P, float *dS, int64_t T,
                          int64_t D, int ldq, int ldk, float scale) {
  for (int64_t i0 = 0; i0 < T; i0 += NVL_ATTN_BLOCK) {
    int m = (int)tile_rows(T - i0), n = (int)(i0 + m);
    const float *qi = q + i0 * ldq, *gi = dout + i0 * ldq;
    /* P (m, n) = exp(scale * q k^T - lse), causal */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, (int)D, scale, qi, ldq, k, ldk, 0.0f, P, n);
    /* dS (m, n) = dout v^T, then P (dP - D_t) with D_t = dout[t] . out[t] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, (int)D, 1.0f, gi, ldq, v, ldk, 0.0f, dS, n);
    for (int r = 0; r < m; r++) {
      int64_t t = i0 + r;
      float *Pr = P + (int64_t)r * n, *dSr = dS + (int64_t)r * n;
      const float *gt = gi + (int64_t)r * ldq, *ot = out + t * ldq;
      float Dt = 0.0f, l = lse[t];
      for (int64_t d = 0; d < D; d++) Dt += gt[d] * ot[d];
      nvl_attn_dsoftmax_row(Pr, dSr, t, n, l, Dt);
    }
    /* dq[i0:i0+m] = scale * dS k[0:n]; dk[0:n] += scale * dS^T q_i; dv[0:n] += P^T dout_i */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, (int)D, n, scale, dS, n, k, ldk, 0.0f, dq + i0 * ldq,
                ldq);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, (int)D, m, scale, dS, n, qi, ldq, 1.0f, dk, ldk);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, (int)D, m, 1.0f, P, n, gi, ldq, 1.0f, dv, ldk);
  }
}

nvl_status nvl_attention_backward_cpu(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                                      const float *q, const float *k, const float *v, const float *out,
                                      const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                      double scale) {
  if (D == 0) return nvl_attention_backward_ref(ctx, dq, dk, dv, dout, q, k, v, out, lse, B, T, Hq, Hkv, D, scale);
  size_t work_floats = backward_work(T);
  float *work;
  NVL_TRY(ctx->scratch(ctx, (work_floats ? work_floats : 1) * sizeof(float), (void **)&work));
  int64_t group = Hq / Hkv, tasks = B * Hkv;
  size_t tile = (size_t)(tile_rows(T) * T);
  int ldq = (int)(Hq * D), ldk = (int)(Hkv * D);
  int nt = team_size(tasks, work_floats, 2 * tile, T, D);
  int prev = blas_solo_begin(nt);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t i = 0; i < tasks; i++) {
    int64_t b = i / Hkv, g = i % Hkv;
    float *P = work + (size_t)omp_get_thread_num() * 2 * tile, *dS = P + tile;
    float *dkg = dk + (b * T * Hkv + g) * D, *dvg = dv + (b * T * Hkv + g) * D; /* (T, D), row stride ldk */
    for (int64_t s = 0; s < T; s++) {
      memset(dkg + s * ldk, 0, (size_t)D * sizeof(float));
      memset(dvg + s * ldk, 0, (size_t)D * sizeof(float));
    }
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
      int64_t oq = (b * T * Hq + h) * D, ok = (b * T * Hkv + g) * D;
      backward_head(dq + oq, dkg, dvg, dout + oq, q + oq, k + ok, v + ok, out + oq, lse + (b * Hq + h) * T, P, dS,
                    T, D, ldq, ldk, (float)scale);
    }
  }
  blas_solo_end(prev);
  return NVL_OK;
}
