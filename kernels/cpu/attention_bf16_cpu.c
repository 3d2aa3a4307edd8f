/* attention_bf16_cpu.c: causal GQA on bf16 activations with VDPBF16PS (see attention_bf16_cpu.h).
 * Every product is a packed GEMM: A (m, k) packed as rows of bf16 pairs along k, B (k, n) packed as
 * pairs of k-rows interleaved per column (the layout VDPBF16PS reads: one 32-bit lane = B[2kk][j],
 * B[2kk+1][j]), both zero-padded, and an AVX-512 micro-kernel of 4 rows x 32 columns that sums the
 * pair products into fp32 accumulators. Packing an fp32 matrix (P, dS) rounds it to bf16 (RNE):
 * the one place the flash numerics round. K^T and V are packed once per (batch, kv head).
 * Threads: forward over (b, query tile, query head), largest tiles first; backward over (b, kv head),
 * whose query heads add into fp32 dk, dv accumulators on one thread (no race, no atomics). */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu/attention_bf16_cpu.h"
#include "cpu/attention_cpu.h"
#include "cpu/simd_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define NVL_HAVE_DPBF16 1
#include <immintrin.h>
#endif

#ifndef NVL_HAVE_DPBF16

int nvl_attention_bf16_cpu_ready(void) { return 0; }
nvl_status nvl_attention_forward_bf16_cpu(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q,
                                          const uint16_t *k, const uint16_t *v, int64_t B, int64_t T, int64_t Hq,
                                          int64_t Hkv, int64_t D, double scale) {
  return nvl_error(NVL_EUNSUPPORTED, "bf16 attention: built without the AVX512-BF16 kernels");
}
nvl_status nvl_attention_backward_bf16_cpu(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                           const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                           const uint16_t *v, const uint16_t *out, const float *lse, int64_t B,
                                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale) {
  return nvl_error(NVL_EUNSUPPORTED, "bf16 attention: built without the AVX512-BF16 kernels");
}

#else

int nvl_attention_bf16_cpu_ready(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

/* keys per block of the backward: a tile's P, dP, dS blocks stay in L1. (The forward keeps whole
 * rows: blocking its keys with the online softmax measured slower here, its per-block row work
 * outweighing the cache it saves.) */
#define NVL_ATTN_KBLOCK 64

static int64_t rup32(int64_t x) { return (x + 31) / 32 * 32; }

/* ---- packing ------------------------------------------------------------------------------------ */

/* Ap (m rows of lda pairs) = A (m, k), element (i, c) at a[i rs + c cs], bf16 or f32 (rounded) */
static void pack_a_bf16(uint32_t *Ap, int64_t lda, const uint16_t *a, int64_t rs, int64_t cs, int64_t m, int64_t k) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t kk = 0; kk < lda; kk++) {
      uint32_t lo = 2 * kk < k ? a[i * rs + 2 * kk * cs] : 0, hi = 2 * kk + 1 < k ? a[i * rs + (2 * kk + 1) * cs] : 0;
      Ap[i * lda + kk] = lo | hi << 16;
    }
}

/* Ap (m rows of lda pairs) = A (m, k) f32 with rows of stride rs, rounded to bf16: a packed row is
 * the row's bf16 values in order (a pair is two neighbours), zero-padded; the loop vectorises */
static void pack_a_f32(uint32_t *Ap, int64_t lda, const float *a, int64_t rs, int64_t m, int64_t k) {
  for (int64_t i = 0; i < m; i++) {
    uint16_t *row = (uint16_t *)(Ap + i * lda);
    const float *x = a + i * rs;
    for (int64_t c = 0; c < k; c++) row[c] = bf16_of(x[c]);
    for (int64_t c = k; c < 2 * lda; c++) row[c] = 0;
  }
}

/* Bp (kp pair-rows of ldb lanes) = B (k, n) f32 with rows of stride rs, rounded to bf16; zero past
 * k and n. Two rows interleave into one pair-row (contiguous reads and writes). */
static void pack_b_f32(uint32_t *Bp, int64_t ldb, const float *b, int64_t rs, int64_t k, int64_t n, int64_t kp) {
  for (int64_t kk = 0; kk < kp; kk++) {
    uint32_t *o = Bp + kk * ldb;
    const float *r0 = b + 2 * kk * rs, *r1 = r0 + rs;
    if (2 * kk + 1 < k)
      for (int64_t j = 0; j < n; j++) o[j] = (uint32_t)bf16_of(r0[j]) | (uint32_t)bf16_of(r1[j]) << 16;
    else if (2 * kk < k)
      for (int64_t j = 0; j < n; j++) o[j] = bf16_of(r0[j]);
    else
      for (int64_t j = 0; j < n; j++) o[j] = 0;
    for (int64_t j = n; j < ldb; j++) o[j] = 0;
  }
}

/* Bp (kp pair-rows of ldb lanes) = B (k, n), element (r, j) at b[r rs + j cs]; zero past k and n */
static void pack_b_bf16(uint32_t *Bp, int64_t ldb, const uint16_t *b, int64_t rs, int64_t cs, int64_t k, int64_t n,
                        int64_t kp) {
  for (int64_t kk = 0; kk < kp; kk++)
    for (int64_t j = 0; j < ldb; j++) {
      uint32_t lo = 2 * kk < k && j < n ? b[2 * kk * rs + j * cs] : 0;
      uint32_t hi = 2 * kk + 1 < k && j < n ? b[(2 * kk + 1) * rs + j * cs] : 0;
      Bp[kk * ldb + j] = lo | hi << 16;
    }
}

/* ---- the micro-kernel ------------------------------------------------------------------------- */

#define NVL_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* C (R rows, ncols <= 32 columns, row stride ldc) = alpha * A B, or += that with acc; A R rows of
 * kp pairs (stride lda), B kp pair-rows of 32 lanes (stride ldb) */
NVL_DP_TARGET static inline __attribute__((always_inline)) void block(const int R, float *C, int64_t ldc,
                                                                       const uint32_t *Ap, int64_t lda,
                                                                       const uint32_t *Bp, int64_t ldb, int64_t kp,
                                                                       int ncols, float alpha, int acc) {
  __m512 c0[4], c1[4];
  for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp; kk++) {
    __m512i b0 = _mm512_loadu_si512(Bp + kk * ldb), b1 = _mm512_loadu_si512(Bp + kk * ldb + 16);
    for (int r = 0; r < R; r++) {
      __m512i a = _mm512_set1_epi32((int)Ap[r * lda + kk]);
      c0[r] = _mm512_dpbf16_ps(c0[r], (__m512bh)a, (__m512bh)b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], (__m512bh)a, (__m512bh)b1);
    }
  }
  __mmask16 m0 = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1);
  __mmask16 m1 = ncols >= 32 ? 0xffff : ncols > 16 ? (__mmask16)((1u << (ncols - 16)) - 1) : 0;
  __m512 al = _mm512_set1_ps(alpha);
  for (int r = 0; r < R; r++) {
    __m512 v0 = _mm512_mul_ps(c0[r], al), v1 = _mm512_mul_ps(c1[r], al);
    if (acc) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, C + r * ldc), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, C + r * ldc + 16), v1);
    }
    _mm512_mask_storeu_ps(C + r * ldc, m0, v0);
    if (m1) _mm512_mask_storeu_ps(C + r * ldc + 16, m1, v1);
  }
}

/* C (m, n, row stride ldc) = alpha * A B (acc: +=), A packed (m rows, lda pairs), B packed (kp
 * pair-rows, ldb >= rup32(n) lanes) */
NVL_DP_TARGET static void gemm_packed(float *C, int64_t ldc, const uint32_t *Ap, int64_t lda, const uint32_t *Bp,
                                      int64_t ldb, int64_t m, int64_t n, int64_t kp, float alpha, int acc) {
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    int nc = (int)(n - j0 < 32 ? n - j0 : 32);
    int64_t i0 = 0;
    for (; i0 + 4 <= m; i0 += 4) block(4, C + i0 * ldc + j0, ldc, Ap + i0 * lda, lda, Bp + j0, ldb, kp, nc, alpha, acc);
    for (; i0 < m; i0++) block(1, C + i0 * ldc + j0, ldc, Ap + i0 * lda, lda, Bp + j0, ldb, kp, nc, alpha, acc);
  }
}

/* ---- forward ------------------------------------------------------------------------------------ */

typedef struct {
  int64_t B, T, Hq, Hkv, D, ldq, ldk, kpD, npT, kpT, npD;
} geom;

static geom geom_of(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  geom g = {B, T, Hq, Hkv, D, Hq * D, Hkv * D, (D + 1) / 2, rup32(T), (T + 1) / 2, rup32(D)};
  return g;
}

/* threads for `tasks` of about T x T x D work each: one below ~2 MFLOP in all */
static int team(int64_t tasks, int64_t T, int64_t D) {
  if ((double)tasks * (double)T * (double)T * (double)D < 1e6) return 1;
  int64_t nt = omp_get_max_threads();
  return (int)(nt > tasks ? tasks : nt);
}

/* one query tile of head h: rows [i0, i0 + m) */
static void forward_tile(const geom *g, uint16_t *out, float *lse, const uint16_t *q, const uint32_t *KT,
                         const uint32_t *VP, float *S, uint32_t *Aq, uint32_t *Ap, float *O, int64_t i0, float scale) {
  int64_t m = g->T - i0 < NVL_ATTN_BLOCK ? g->T - i0 : NVL_ATTN_BLOCK, n = i0 + m, kpn = (n + 1) / 2;
  float rinv[NVL_ATTN_BLOCK];
  pack_a_bf16(Aq, g->kpD, q + i0 * g->ldq, g->ldq, 1, m, g->D);
  gemm_packed(S, n, Aq, g->kpD, KT, g->npT, m, n, g->kpD, scale, 0); /* S = scale q k^T */
  for (int64_t r = 0; r < m; r++) {
    float mx;
    double sum = nvl_attn_softmax_row(S + r * n, i0 + r, n, &mx);
    rinv[r] = (float)(1.0 / sum);
    lse[i0 + r] = (float)((double)mx + log(sum));
  }
  pack_a_f32(Ap, kpn, S, n, m, n);                                 /* P rounded to bf16 */
  gemm_packed(O, g->npD, Ap, kpn, VP, g->npD, m, g->D, kpn, 1.0f, 0); /* O = P v */
  for (int64_t r = 0; r < m; r++)
    for (int64_t d = 0; d < g->D; d++) out[(i0 + r) * g->ldq + d] = bf16_of(O[r * g->npD + d] * rinv[r]);
}

nvl_status nvl_attention_forward_bf16_cpu(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q,
                                          const uint16_t *k, const uint16_t *v, int64_t B, int64_t T, int64_t Hq,
                                          int64_t Hkv, int64_t D, double scale) {
  geom g = geom_of(B, T, Hq, Hkv, D);
  if (B <= 0 || T <= 0 || D <= 0 || Hkv <= 0 || Hq % Hkv)
    return nvl_error(NVL_EINVAL, "bf16 attention: empty or bad shape (B %lld, T %lld, D %lld)", (long long)B,
                     (long long)T, (long long)D);
  int64_t per_bg = g.kpD * g.npT + g.kpT * g.npD, M = NVL_ATTN_BLOCK;
  int64_t per_thread = M * g.npT + M * g.kpD + M * g.kpT + M * g.npD; /* S, Aq, Ap, O (4-byte units) */
  int nt = omp_get_max_threads();
  uint32_t *work;
  NVL_TRY(ctx->scratch(ctx, (size_t)(B * Hkv * per_bg + nt * per_thread) * 4, (void **)&work));
#pragma omp parallel for schedule(static) if (B * Hkv > 1 && B * T * Hkv * D > 65536)
  for (int64_t bg = 0; bg < B * Hkv; bg++) { /* K^T (D, T) and V (T, D) of each (b, kv head), packed */
    int64_t b = bg / Hkv, h = bg % Hkv;
    uint32_t *KT = work + bg * per_bg, *VP = KT + g.kpD * g.npT;
    pack_b_bf16(KT, g.npT, k + (b * T * Hkv + h) * D, 1, g.ldk, D, T, g.kpD);
    pack_b_bf16(VP, g.npD, v + (b * T * Hkv + h) * D, g.ldk, 1, T, D, g.kpT);
  }
  int64_t tiles = (T + M - 1) / M, group = Hq / Hkv, tasks = B * Hq * tiles;
  uint32_t *thread_work = work + B * Hkv * per_bg;
#pragma omp parallel for num_threads(team(B * Hq, T, D)) schedule(dynamic, 1)
  for (int64_t i = 0; i < tasks; i++) {
    int64_t b = i / (Hq * tiles), i0 = (tiles - 1 - i / Hq % tiles) * M, h = i % Hq, bg = b * Hkv + h / group;
    uint32_t *w = thread_work + (int64_t)omp_get_thread_num() * per_thread;
    float *S = (float *)w, *O = (float *)(w + M * g.npT + M * g.kpD + M * g.kpT);
    uint32_t *Aq = w + M * g.npT, *Ap = Aq + M * g.kpD;
    const uint32_t *KT = work + bg * per_bg, *VP = KT + g.kpD * g.npT;
    forward_tile(&g, out + (b * T * Hq + h) * D, lse + (b * Hq + h) * T, q + (b * T * Hq + h) * D, KT, VP, S, Aq, Ap,
                 O, i0, (float)scale);
  }
  return NVL_OK;
}

/* ---- backward ----------------------------------------------------------------------------------- */

typedef struct {
  uint32_t *KT, *VT, *KP;     /* k^T, v^T (D, T); k (T, D), packed */
  float *dKT, *dVT;           /* (D, T) fp32 accumulators of dk^T, dv^T */
  float *P, *dS, *dQ;         /* (M, KB), (M, KB), (M, npD); KB = NVL_ATTN_KBLOCK */
  uint32_t *Aq, *Ado, *Ads;   /* (M, kpD), (M, kpD), (M, KB/2) */
  uint32_t *AqT, *AdoT, *Bds, *BP; /* (D, M/2), (D, M/2), (M/2, KB), (M/2, KB) */
} bwd_work;

static int64_t bwd_units(const geom *g) {
  int64_t M = NVL_ATTN_BLOCK, kpM = (M + 1) / 2, KB = NVL_ATTN_KBLOCK;
  return 2 * g->kpD * g->npT + g->kpT * g->npD + 2 * g->D * g->T + 2 * M * KB + M * g->npD + 2 * M * g->kpD +
         M * KB / 2 + 2 * g->D * kpM + 2 * kpM * KB;
}

static bwd_work bwd_carve(const geom *g, uint32_t *w) {
  int64_t M = NVL_ATTN_BLOCK, kpM = (M + 1) / 2, KB = NVL_ATTN_KBLOCK;
  bwd_work b;
  b.KT = w, w += g->kpD * g->npT;
  b.VT = w, w += g->kpD * g->npT;
  b.KP = w, w += g->kpT * g->npD;
  b.dKT = (float *)w, w += g->D * g->T;
  b.dVT = (float *)w, w += g->D * g->T;
  b.P = (float *)w, w += M * KB;
  b.dS = (float *)w, w += M * KB;
  b.dQ = (float *)w, w += M * g->npD;
  b.Aq = w, w += M * g->kpD;
  b.Ado = w, w += M * g->kpD;
  b.Ads = w, w += M * KB / 2;
  b.AqT = w, w += g->D * kpM;
  b.AdoT = w, w += g->D * kpM;
  b.Bds = w, w += kpM * KB;
  b.BP = w;
  return b;
}

/* one query tile of one head: dq rows written; columns [0, i0 + m) of dk^T, dv^T added to. Keys go
 * in blocks of NVL_ATTN_KBLOCK: per block S, dP (m, nb) from q_i, dout_i; P, dS by the fp32 rows;
 * dq_i += scale dS k_j, dk_j^T += scale q_i^T dS, dv_j^T += dout_i^T P (dS and P rounded to bf16). */
static void backward_tile(const geom *g, bwd_work *w, uint16_t *dq, const uint16_t *dout, const uint16_t *q,
                          const uint16_t *out, const float *lse, int64_t i0, float scale) {
  int64_t m = g->T - i0 < NVL_ATTN_BLOCK ? g->T - i0 : NVL_ATTN_BLOCK, n = i0 + m, kpm = (m + 1) / 2;
  const uint16_t *qi = q + i0 * g->ldq, *gi = dout + i0 * g->ldq;
  float Dt[NVL_ATTN_BLOCK];
  pack_a_bf16(w->Aq, g->kpD, qi, g->ldq, 1, m, g->D);
  pack_a_bf16(w->Ado, g->kpD, gi, g->ldq, 1, m, g->D);
  pack_a_bf16(w->AqT, kpm, qi, 1, g->ldq, g->D, m);
  pack_a_bf16(w->AdoT, kpm, gi, 1, g->ldq, g->D, m);
  for (int64_t r = 0; r < m; r++) { /* D_t = dout_t . out_t (the bf16 out) */
    const uint16_t *gt = gi + r * g->ldq, *ot = out + (i0 + r) * g->ldq;
    float acc = 0.0f;
    for (int64_t d = 0; d < g->D; d++) acc += f32_of(gt[d]) * f32_of(ot[d]);
    Dt[r] = acc;
  }
  for (int64_t j0 = 0; j0 < n; j0 += NVL_ATTN_KBLOCK) {
    int64_t nb = n - j0 < NVL_ATTN_KBLOCK ? n - j0 : NVL_ATTN_KBLOCK, kpb = (nb + 1) / 2;
    gemm_packed(w->P, nb, w->Aq, g->kpD, w->KT + j0, g->npT, m, nb, g->kpD, scale, 0);  /* scale q k_j^T */
    gemm_packed(w->dS, nb, w->Ado, g->kpD, w->VT + j0, g->npT, m, nb, g->kpD, 1.0f, 0); /* dP = dout v_j^T */
    for (int64_t r = 0; r < m; r++) { /* the causal part of row t in this block: keys j0 .. min(t, j0 + nb - 1) */
      int64_t tc = i0 + r - j0 < nb - 1 ? i0 + r - j0 : nb - 1;
      nvl_attn_dsoftmax_row(w->P + r * nb, w->dS + r * nb, tc < -1 ? -1 : tc, nb, lse[i0 + r], Dt[r]);
    }
    pack_a_f32(w->Ads, kpb, w->dS, nb, m, nb); /* dS rounded to bf16 */
    gemm_packed(w->dQ, g->npD, w->Ads, kpb, w->KP + j0 / 2 * g->npD, g->npD, m, g->D, kpb, scale, j0 > 0);
    pack_b_f32(w->Bds, NVL_ATTN_KBLOCK, w->dS, nb, m, nb, kpm); /* dS rounded to bf16 */
    gemm_packed(w->dKT + j0, g->T, w->AqT, kpm, w->Bds, NVL_ATTN_KBLOCK, g->D, nb, kpm, scale, 1);
    pack_b_f32(w->BP, NVL_ATTN_KBLOCK, w->P, nb, m, nb, kpm); /* P rounded to bf16 */
    gemm_packed(w->dVT + j0, g->T, w->AdoT, kpm, w->BP, NVL_ATTN_KBLOCK, g->D, nb, kpm, 1.0f, 1);
  }
  for (int64_t r = 0; r < m; r++)
    for (int64_t d = 0; d < g->D; d++) dq[(i0 + r) * g->ldq + d] = bf16_of(w->dQ[r * g->npD + d]);
}

nvl_status nvl_attention_backward_bf16_cpu(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                           const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                           const uint16_t *v, const uint16_t *out, const float *lse, int64_t B,
                                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale) {
  geom g = geom_of(B, T, Hq, Hkv, D);
  if (B <= 0 || T <= 0 || D <= 0 || Hkv <= 0 || Hq % Hkv)
    return nvl_error(NVL_EINVAL, "bf16 attention: empty or bad shape (B %lld, T %lld, D %lld)", (long long)B,
                     (long long)T, (long long)D);
  int64_t units = bwd_units(&g), M = NVL_ATTN_BLOCK, tiles = (T + M - 1) / M, group = Hq / Hkv;
  int nt = team(B * Hkv, T, D * group);
  uint32_t *work;
  NVL_TRY(ctx->scratch(ctx, (size_t)(nt * units) * 4, (void **)&work));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t task = 0; task < B * Hkv; task++) {
    int64_t b = task / Hkv, h = task % Hkv;
    bwd_work w = bwd_carve(&g, work + (int64_t)omp_get_thread_num() * units);
    const uint16_t *kb = k + (b * T * Hkv + h) * D, *vb = v + (b * T * Hkv + h) * D;
    pack_b_bf16(w.KT, g.npT, kb, 1, g.ldk, D, T, g.kpD);
    pack_b_bf16(w.VT, g.npT, vb, 1, g.ldk, D, T, g.kpD);
    pack_b_bf16(w.KP, g.npD, kb, g.ldk, 1, T, D, g.kpT);
    memset(w.dKT, 0, (size_t)(T * D) * sizeof(float));
    memset(w.dVT, 0, (size_t)(T * D) * sizeof(float));
    for (int64_t hq = h * group; hq < (h + 1) * group; hq++) {
      int64_t oq = (b * T * Hq + hq) * D;
      for (int64_t tile = tiles - 1; tile >= 0; tile--)
        backward_tile(&g, &w, dq + oq, dout + oq, q + oq, out + oq, lse + (b * Hq + hq) * T, tile * M, (float)scale);
    }
    uint16_t *dkb = dk + (b * T * Hkv + h) * D, *dvb = dv + (b * T * Hkv + h) * D;
    for (int64_t s0 = 0; s0 < T; s0 += 32) /* dk^T, dv^T back to (T, D) rows, in blocks of 32 keys */
      for (int64_t d = 0; d < D; d++)
        for (int64_t s = s0; s < s0 + 32 && s < T; s++) {
          dkb[s * g.ldk + d] = bf16_of(w.dKT[d * T + s]);
          dvb[s * g.ldk + d] = bf16_of(w.dVT[d * T + s]);
        }
  }
  return NVL_OK;
}
#endif
