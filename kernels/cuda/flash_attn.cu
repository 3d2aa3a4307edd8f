/* flash_attn.cu: FlashAttention-2 (Dao 2023) on tensor cores through the WMMA API (nvcuda::wmma, bf16
 * 16x16x16 tiles, fp32 accumulators): grouped-query attention, causal or not, bf16 in and out, fp32
 * accumulation, softmax and lse; the T x T matrix is never stored. Contract in flash_attn.h. Runs under
 * the CPU emulation of CUDA (kernels/cuda/emu/mma.h models WMMA), where tests/test_cuda_flash.lua
 * checks it against the CPU reference attention within bf16 bounds.
 *
 * Tiles: a CTA of 4 warps takes 64 query rows (forward, dq) or 64 keys (dk/dv) of one (b, head); each
 * warp owns 16 of them. K/V (or Q/dO) stream through shared memory in tiles of 64 rows, zero past T
 * (ragged last tiles); masked scores (causal s > t, s >= T) become p = 0.
 * Layout choice: the kernels never index a fragment's x[] (WMMA does not document which lane holds which
 * element). Scores go fragment -> shared memory (store_matrix_sync) -> the online softmax by plain
 * threads (two lanes per row) -> P as bf16 in shared memory -> load_matrix_sync. The forward's O
 * accumulator lives in shared memory (fp32), rescaled per row by the softmax lanes and loaded as the
 * accumulator of the P V product: layout-independent, at the cost of shared-memory traffic that an
 * mma.sync version with register-resident O (the PTX m16n8k16 C layout) would save.
 *
 * Forward: per K/V tile, S = Q K^T (fp32), m_new = max(m, rowmax S scale), alpha = exp(m - m_new),
 * P = exp(S scale - m_new) (rounded to bf16 for the P V product, summed into l in fp32), O = alpha O + P V;
 * at the end out = O / l (rounded to bf16 once), lse = m + log(l).
 * Backward (FA-2, deterministic, no atomics): delta = rowsum(dout * out) (fp32); dk/dv kernel: a CTA
 * per 64 keys of one kv head loops over the query heads of its group and the query tiles that see the
 * keys (outer loop over K/V, as FA-2), P^T = exp(scale K Q^T - lse), dS^T = P^T (V dO^T - delta),
 * dV += P^T dO, dK += dS^T Q in fragments; dq kernel: a separate pass by query tiles (the forward's loop
 * order) recomputing P and dS, dQ += dS K. The separate pass costs two extra tile products per (q, kv)
 * tile pair against FA-2's atomic dQ, and keeps the result deterministic and dQ in bf16 without an fp32
 * scratch. Scale: dq and dk are multiplied by scale when rounded to bf16.
 *
 * Shared memory per CTA (bytes; opt-in above 48 KiB; the H100 allows 227 KiB): forward 72192 (D 64) /
 * 113152 (D 128), dq 81408 / 114176, dk/dv 90624 / 123392. Designed-for occupancy on an H100 (an estimate
 * from these sizes and ptxas's register counts for sm_90a, not a measurement): forward 3 CTAs (12 warps) per SM
 * at D 64, 2 (8 warps) at D 128; dq 2 CTAs at both; dk/dv 2 CTAs at D 64, 1 (4 warps, 230 registers) at D 128.
 * Not here: validation and allocation (core/flash_attention.c), the fp32 attention (attention.cu). */
#include <math.h>
#include <stdio.h>

#include "common.cuh"
#include "cuda/flash_attn.h"
#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;
typedef __nv_bfloat16 bf16;

#define FA_TILE 64    /* query rows per CTA, keys per tile */
#define FA_THREADS 128 /* 4 warps, 16 rows each */
#define FA_LDS (FA_TILE + 4) /* row stride of fp32 score tiles */
#define FA_LDP (FA_TILE + 8) /* row stride of bf16 probability tiles */

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> frag_b_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> frag_b_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

__device__ __forceinline__ float bf2f(bf16 h) { return __bfloat162float(h); }
__device__ __forceinline__ bf16 f2bf(float f) { return __float2bfloat16_rn(f); }

/* Rows [r0, r0 + 64) of head h of a (B, T, H, D) bf16 tensor into a (64, D + 8) shared tile, zero past T;
 * 16-byte copies by all threads of the block. */
template <int D>
__device__ __forceinline__ void load_tile(bf16 *tile, const bf16 *x, int64_t b, int64_t r0, int64_t h, int64_t T,
                                          int64_t H) {
  constexpr int V = D / 8, LDH = D + 8;
  for (int i = threadIdx.x; i < FA_TILE * V; i += FA_THREADS) {
    const int r = i / V, c = i - r * V;
    const int64_t t = r0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (t < T) val = *reinterpret_cast<const uint4 *>(x + ((b * T + t) * H + h) * D + 8 * c);
    *reinterpret_cast<uint4 *>(tile + r * LDH + 8 * c) = val;
  }
}

/* Per-row lse and delta of rows [t0, t0 + 64) of head h (0 past T). */
__device__ __forceinline__ void load_rows(float *ls, float *ds, const float *lse, const float *delta, int64_t b,
                                          int64_t h, int64_t t0, int64_t T, int64_t H) {
  if (threadIdx.x < FA_TILE) {
    const int64_t t = t0 + threadIdx.x;
    ls[threadIdx.x] = t < T ? lse[(b * H + h) * T + t] : 0.0f;
    ds[threadIdx.x] = t < T ? delta[(b * H + h) * T + t] : 0.0f;
  }
}

/* One warp: out (16, 64) fp32 at ldm FA_LDS = A (16, D) times B^T, B (64, D) both bf16 at ldm D + 8
 * (A's rows at a, B's rows at b). Column tiles j with skip(j) are left unwritten. */
template <int D, class Skip>
__device__ __forceinline__ void tile_abt(float *out, const bf16 *a, const bf16 *b, Skip skip) {
  constexpr int LDH = D + 8;
  frag_a fa;
  frag_b_col fb;
  frag_c fc;
  for (int j = 0; j < FA_TILE / 16; j++) {
    if (skip(j)) continue; /* warp-uniform */
    wmma::fill_fragment(fc, 0.0f);
    for (int kk = 0; kk < D / 16; kk++) {
      wmma::load_matrix_sync(fa, a + 16 * kk, LDH);
      wmma::load_matrix_sync(fb, b + j * 16 * LDH + 16 * kk, LDH);
      wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(out + 16 * j, fc, FA_LDS, wmma::mem_row_major);
  }
}

/* One warp: acc[n] (16, 16) += P (16, 64) bf16 at ldm FA_LDP times X (64, D) bf16 at ldm D + 8, columns
 * 16 n of X; key tiles kk with skip(kk) are all-zero in P and left out. */
template <int D, class Skip>
__device__ __forceinline__ void tile_pv(frag_c *acc, const bf16 *p, const bf16 *x, Skip skip) {
  constexpr int LDH = D + 8;
  frag_a fa;
  frag_b_row fb;
  for (int kk = 0; kk < FA_TILE / 16; kk++) {
    if (skip(kk)) continue;
    wmma::load_matrix_sync(fa, p + 16 * kk, FA_LDP);
    for (int n = 0; n < D / 16; n++) {
      wmma::load_matrix_sync(fb, x + kk * 16 * LDH + 16 * n, LDH);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

/* ---- forward ------------------------------------------------------------------------------------ */

/* The online-softmax step of one warp's 16 rows for one key tile (two lanes per row, 32 columns each):
 * ss (16, FA_LDS) raw scores -> ps (16, FA_LDP) bf16 p; ms, ls the rows' running max and sum; os (16, D + 4)
 * the rows' O, rescaled by alpha. */
template <int D>
__device__ __forceinline__ void online_softmax(float *ss, bf16 *ps, float *os, float *ms, float *ls, int64_t t,
                                               int64_t s0, int64_t T, float scale, int causal) {
  const int lane = threadIdx.x & 31, c0 = (lane & 1) * 32, r = lane >> 1;
  float mx = -INFINITY;
  for (int j = 0; j < 32; j++) {
    const int64_t s = s0 + c0 + j;
    const bool ok = t < T && s < T && (!causal || s <= t);
    const float x = ok ? ss[r * FA_LDS + c0 + j] * scale : -INFINITY;
    ss[r * FA_LDS + c0 + j] = x;
    mx = fmaxf(mx, x);
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  const float m_old = ms[r], l_old = ls[r];
  const float m_new = fmaxf(m_old, mx), m_use = m_new == -INFINITY ? 0.0f : m_new;
  const float alpha = expf(m_old - m_use); /* 0 while the row has seen no key */
  float sum = 0.0f;
  for (int j = 0; j < 32; j++) {
    const float p = expf(ss[r * FA_LDS + c0 + j] - m_use); /* masked: exp(-inf) = 0 */
    sum += p;
    ps[r * FA_LDP + c0 + j] = f2bf(p);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  for (int d = (lane & 1) * (D / 2); d < (lane & 1) * (D / 2) + D / 2; d++) os[r * (D + 4) + d] *= alpha;
  __syncwarp(); /* both lanes of the row have read m_old, l_old */
  if (!(lane & 1)) {
    ms[r] = m_new;
    ls[r] = l_old * alpha + sum;
  }
}

/* grid (ceil(T/64), Hq, B), block 128. */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) flash_fwd_kernel(bf16 *__restrict__ out, float *__restrict__ lse,
                                                               const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                                                               const bf16 *__restrict__ v, int64_t T, int64_t Hq,
                                                               int64_t Hkv, float scale, int causal) {
  constexpr int LDH = D + 8, LDO = D + 4;
  NVL_SHARED_DYNAMIC(float4, sh);
  bf16 *qs = reinterpret_cast<bf16 *>(sh), *ks = qs + FA_TILE * LDH, *vs = ks + FA_TILE * LDH;
  bf16 *ps = vs + FA_TILE * LDH;                           /* (64, FA_LDP) */
  float *ss = reinterpret_cast<float *>(ps + FA_TILE * FA_LDP); /* (64, FA_LDS) */
  float *os = ss + FA_TILE * FA_LDS, *ms = os + FA_TILE * LDO, *ls = ms + FA_TILE;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / (Hq / Hkv), t0 = (int64_t)blockIdx.x * FA_TILE;
  const int64_t w0 = t0 + 16 * warp; /* the warp's first row */
  load_tile<D>(qs, q, b, t0, h, T, Hq);
  for (int i = tid; i < FA_TILE * LDO; i += FA_THREADS) os[i] = 0.0f;
  if (tid < FA_TILE) {
    ms[tid] = -INFINITY;
    ls[tid] = 0.0f;
  }
  const int64_t s_end = causal && t0 + FA_TILE < T ? t0 + FA_TILE : T;
  for (int64_t s0 = 0; s0 < s_end; s0 += FA_TILE) {
    __syncthreads(); /* the previous tile is consumed (and q, os, ms, ls are set) */
    load_tile<D>(ks, k, b, s0, g, T, Hkv);
    load_tile<D>(vs, v, b, s0, g, T, Hkv);
    __syncthreads();
    if (w0 >= T || (causal && s0 > w0 + 15)) continue; /* warp-uniform: no key of the tile is seen */
    float *sw = ss + 16 * warp * FA_LDS, *ow = os + 16 * warp * LDO;
    bf16 *pw = ps + 16 * warp * FA_LDP;
    auto masked = [&](int j) { return causal && s0 + 16 * j > w0 + 15; };
    tile_abt<D>(sw, qs + 16 * warp * LDH, ks, masked);
    __syncwarp();
    online_softmax<D>(sw, pw, ow, ms + 16 * warp, ls + 16 * warp, w0 + ((tid & 31) >> 1), s0, T, scale, causal);
    __syncwarp();
    frag_c acc[D / 16];
    for (int n = 0; n < D / 16; n++) wmma::load_matrix_sync(acc[n], ow + 16 * n, LDO, wmma::mem_row_major);
    tile_pv<D>(acc, pw, vs, masked);
    for (int n = 0; n < D / 16; n++) wmma::store_matrix_sync(ow + 16 * n, acc[n], LDO, wmma::mem_row_major);
  }
  __syncthreads();
  for (int i = tid; i < FA_TILE * D; i += FA_THREADS) {
    const int r = i / D, d = i - r * D;
    const int64_t t = t0 + r;
    if (t < T) out[((b * T + t) * Hq + h) * D + d] = f2bf(os[r * LDO + d] / ls[r]);
  }
  if (tid < FA_TILE && t0 + tid < T) lse[(b * Hq + h) * T + t0 + tid] = ms[tid] + logf(ls[tid]);
}

/* ---- backward ----------------------------------------------------------------------------------- */

/* delta (B, Hq, T) = sum_d dout * out in fp32, one warp per row; grid-stride over rows. */
__global__ void flash_delta_kernel(float *__restrict__ delta, const bf16 *__restrict__ dout,
                                   const bf16 *__restrict__ out, int64_t B, int64_t T, int64_t Hq, int D) {
  const int lane = threadIdx.x & 31;
  const int64_t nrows = B * Hq * T, wstride = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t w = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < nrows; w += wstride) {
    const int64_t t = w % T, h = (w / T) % Hq, b = w / (T * Hq);
    const bf16 *go = dout + ((b * T + t) * Hq + h) * D, *o = out + ((b * T + t) * Hq + h) * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += bf2f(go[d]) * bf2f(o[d]);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) delta[w] = s;
  }
}

/* The gradient step of one warp's 16 rows of a score tile (two lanes per row, 32 columns each): from the
 * raw scores ss and dout.v products dps (fp32), p = exp(scale s - lse) and ds = p (dp - delta), written
 * as bf16 (pb may be NULL). Row i is query/key index ri, column j col0 + j; qrow: rows are queries
 * (dq), else keys (dk/dv); lr, dr the per-query lse and delta, indexed by row (qrow) or column. */
__device__ __forceinline__ void grad_step(bf16 *pb, bf16 *db, const float *ss, const float *dps, const float *lr,
                                          const float *dr, int64_t r0, int64_t c0, bool qrow, int64_t T, float scale,
                                          int causal) {
  const int lane = threadIdx.x & 31, r = lane >> 1, j0 = (lane & 1) * 32;
  for (int j = j0; j < j0 + 32; j++) {
    const int64_t t = qrow ? r0 + r : c0 + j, s = qrow ? c0 + j : r0 + r;
    const int qi = qrow ? r : j; /* the query's index into lr, dr */
    float p = 0.0f, ds = 0.0f;
    if (t < T && s < T && (!causal || s <= t)) {
      p = expf(ss[r * FA_LDS + j] * scale - lr[qi]);
      ds = p * (dps[r * FA_LDS + j] - dr[qi]);
    }
    if (pb) pb[r * FA_LDP + j] = f2bf(p);
    db[r * FA_LDP + j] = f2bf(ds);
  }
}

/* One warp writes its 16 rows of acc[D/16] (rows r0.. of head h of a (B, T, H, D) bf16 tensor), each times
 * mul, through the staging area st (16, FA_LDS) fp32. */
template <int D>
__device__ __forceinline__ void write_rows(bf16 *x, frag_c *acc, float *st, int64_t b, int64_t r0, int64_t h,
                                           int64_t T, int64_t H, float mul) {
  const int lane = threadIdx.x & 31;
  for (int n = 0; n < D / 16; n++) {
    wmma::store_matrix_sync(st, acc[n], FA_LDS, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < 256; i += 32) {
      const int r = i >> 4, c = i & 15;
      if (r0 + r < T) x[((b * T + r0 + r) * H + h) * D + 16 * n + c] = f2bf(st[r * FA_LDS + c] * mul);
    }
    __syncwarp();
  }
}

/* dk, dv of 64 keys of kv head g. grid (ceil(T/64), Hkv, B), block 128; warp w owns keys s0 + 16w... */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) flash_dkdv_kernel(
    bf16 *__restrict__ dk, bf16 *__restrict__ dv, const bf16 *__restrict__ dout, const bf16 *__restrict__ q,
    const bf16 *__restrict__ k, const bf16 *__restrict__ v, const float *__restrict__ lse,
    const float *__restrict__ delta, int64_t T, int64_t Hq, int64_t Hkv, float scale, int causal) {
  constexpr int LDH = D + 8;
  NVL_SHARED_DYNAMIC(float4, sh);
  bf16 *ks = reinterpret_cast<bf16 *>(sh), *vs = ks + FA_TILE * LDH, *qs = vs + FA_TILE * LDH;
  bf16 *gs = qs + FA_TILE * LDH, *pt = gs + FA_TILE * LDH, *dst = pt + FA_TILE * FA_LDP;
  float *st = reinterpret_cast<float *>(dst + FA_TILE * FA_LDP), *dpt = st + FA_TILE * FA_LDS;
  float *lr = dpt + FA_TILE * FA_LDS, *dr = lr + FA_TILE;
  const int warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, g = blockIdx.y, s0 = (int64_t)blockIdx.x * FA_TILE, group = Hq / Hkv;
  const int64_t sw0 = s0 + 16 * warp; /* the warp's first key */
  load_tile<D>(ks, k, b, s0, g, T, Hkv);
  load_tile<D>(vs, v, b, s0, g, T, Hkv);
  frag_c dka[D / 16], dva[D / 16];
  for (int n = 0; n < D / 16; n++) {
    wmma::fill_fragment(dka[n], 0.0f);
    wmma::fill_fragment(dva[n], 0.0f);
  }
  float *sw = st + 16 * warp * FA_LDS, *dpw = dpt + 16 * warp * FA_LDS;
  bf16 *pw = pt + 16 * warp * FA_LDP, *dsw = dst + 16 * warp * FA_LDP;
  for (int64_t h = g * group; h < (g + 1) * group; h++)
    for (int64_t t0 = causal ? s0 : 0; t0 < T; t0 += FA_TILE) {
      __syncthreads(); /* the previous q, dout tiles are consumed (and k, v are loaded) */
      load_tile<D>(qs, q, b, t0, h, T, Hq);
      load_tile<D>(gs, dout, b, t0, h, T, Hq);
      load_rows(lr, dr, lse, delta, b, h, t0, T, Hq);
      __syncthreads();
      if (sw0 >= T) continue; /* warp-uniform */
      auto masked = [&](int j) { return causal && t0 + 16 * j + 15 < sw0; };
      tile_abt<D>(sw, ks + 16 * warp * LDH, qs, masked);  /* S^T = K Q^T */
      tile_abt<D>(dpw, vs + 16 * warp * LDH, gs, masked); /* dP^T = V dO^T */
      __syncwarp();
      grad_step(pw, dsw, sw, dpw, lr, dr, sw0, t0, false, T, scale, causal);
      __syncwarp();
      tile_pv<D>(dva, pw, gs, masked);  /* dV += P^T dO */
      tile_pv<D>(dka, dsw, qs, masked); /* dK += dS^T Q */
    }
  __syncwarp();
  write_rows<D>(dk, dka, sw, b, sw0, g, T, Hkv, scale);
  write_rows<D>(dv, dva, sw, b, sw0, g, T, Hkv, 1.0f);
}

/* dq of 64 query rows of head h. grid (ceil(T/64), Hq, B), block 128; warp w owns rows t0 + 16w... */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) flash_dq_kernel(
    bf16 *__restrict__ dq, const bf16 *__restrict__ dout, const bf16 *__restrict__ q, const bf16 *__restrict__ k,
    const bf16 *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta, int64_t T,
    int64_t Hq, int64_t Hkv, float scale, int causal) {
  constexpr int LDH = D + 8;
  NVL_SHARED_DYNAMIC(float4, sh);
  bf16 *qs = reinterpret_cast<bf16 *>(sh), *gs = qs + FA_TILE * LDH, *ks = gs + FA_TILE * LDH;
  bf16 *vs = ks + FA_TILE * LDH, *dsb = vs + FA_TILE * LDH;
  float *ss = reinterpret_cast<float *>(dsb + FA_TILE * FA_LDP), *dps = ss + FA_TILE * FA_LDS;
  float *lr = dps + FA_TILE * FA_LDS, *dr = lr + FA_TILE;
  const int warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / (Hq / Hkv), t0 = (int64_t)blockIdx.x * FA_TILE;
  const int64_t w0 = t0 + 16 * warp;
  load_tile<D>(qs, q, b, t0, h, T, Hq);
  load_tile<D>(gs, dout, b, t0, h, T, Hq);
  load_rows(lr, dr, lse, delta, b, h, t0, T, Hq);
  frag_c dqa[D / 16];
  for (int n = 0; n < D / 16; n++) wmma::fill_fragment(dqa[n], 0.0f);
  float *sw = ss + 16 * warp * FA_LDS, *dpw = dps + 16 * warp * FA_LDS;
  bf16 *dsw = dsb + 16 * warp * FA_LDP;
  const int64_t s_end = causal && t0 + FA_TILE < T ? t0 + FA_TILE : T;
  for (int64_t s0 = 0; s0 < s_end; s0 += FA_TILE) {
    __syncthreads();
    load_tile<D>(ks, k, b, s0, g, T, Hkv);
    load_tile<D>(vs, v, b, s0, g, T, Hkv);
    __syncthreads();
    if (w0 >= T || (causal && s0 > w0 + 15)) continue;
    auto masked = [&](int j) { return causal && s0 + 16 * j > w0 + 15; };
    tile_abt<D>(sw, qs + 16 * warp * LDH, ks, masked);  /* S = Q K^T */
    tile_abt<D>(dpw, gs + 16 * warp * LDH, vs, masked); /* dP = dO V^T */
    __syncwarp();
    grad_step(NULL, dsw, sw, dpw, lr + 16 * warp, dr + 16 * warp, w0, s0, true, T, scale, causal);
    __syncwarp();
    tile_pv<D>(dqa, dsw, ks, masked); /* dQ += dS K */
  }
  __syncwarp();
  write_rows<D>(dq, dqa, sw, b, w0, h, T, Hq, scale);
}

/* ---- host side ------------------------------------------------------------------------------------ */

static size_t fwd_smem(int D) {
  return (size_t)3 * FA_TILE * (D + 8) * 2 + FA_TILE * FA_LDP * 2 + FA_TILE * FA_LDS * 4 + FA_TILE * (D + 4) * 4 +
         2 * FA_TILE * 4;
}
static size_t dq_smem(int D) {
  return (size_t)4 * FA_TILE * (D + 8) * 2 + FA_TILE * FA_LDP * 2 + 2 * FA_TILE * FA_LDS * 4 + 2 * FA_TILE * 4;
}
static size_t dkdv_smem(int D) {
  return (size_t)4 * FA_TILE * (D + 8) * 2 + 2 * FA_TILE * FA_LDP * 2 + 2 * FA_TILE * FA_LDS * 4 + 2 * FA_TILE * 4;
}

extern "C" size_t nvl_cuda_flash_attn_smem(void) {
  size_t most = 0;
  for (int D = 64; D <= 128; D += 64) {
    const size_t s[3] = {fwd_smem(D), dq_smem(D), dkdv_smem(D)};
    for (size_t x : s) most = x > most ? x : most;
  }
  return most;
}

template <typename K>
static nvl_status set_smem(K kern, size_t smem) {
  if (smem > 48 * 1024)
    NVL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  return NVL_OK;
}

extern "C" nvl_status nvl_cuda_flash_attn_supported(const char *fn, int64_t D) {
  if (D != 64 && D != 128)
    return nvl_error(NVL_EUNSUPPORTED, "%s: head dim D = %lld; the tensor-core flash attention takes D = 64 or 128 "
                     "(the fp32 attention takes 1 <= D <= 256)", fn, (long long)D);
  return NVL_OK;
}

static nvl_status check_grid(const char *fn, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  NVL_TRY(nvl_cuda_flash_attn_supported(fn, D));
  if (Hkv < 1 || Hq % Hkv)
    return nvl_error(NVL_EINVAL, "%s: Hq (%lld) must be a multiple of Hkv (%lld)", fn, (long long)Hq, (long long)Hkv);
  if ((T + FA_TILE - 1) / FA_TILE > 2147483647LL || Hq > 65535 || B > 65535)
    return nvl_error(NVL_EUNSUPPORTED, "%s: grid too large (B %lld, T %lld, Hq %lld)", fn, (long long)B, (long long)T,
                     (long long)Hq);
  return NVL_OK;
}

template <int D>
static nvl_status fwd_launch(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, int64_t B, int64_t T,
                             int64_t Hq, int64_t Hkv, float scale, int causal) {
  const size_t smem = fwd_smem(D);
  NVL_TRY(set_smem(flash_fwd_kernel<D>, smem));
  dim3 grid((unsigned)((T + FA_TILE - 1) / FA_TILE), (unsigned)Hq, (unsigned)B);
  NVL_LAUNCH(grid, FA_THREADS, smem, 0, flash_fwd_kernel<D>)(out, lse, q, k, v, T, Hq, Hkv, scale, causal);
  return NVL_OK;
}

extern "C" nvl_status nvl_cuda_flash_attn_fwd(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q,
                                              const uint16_t *k, const uint16_t *v, int64_t B, int64_t T, int64_t Hq,
                                              int64_t Hkv, int64_t D, double scale, int causal) {
  const int dev = ctx->dev;
  NVL_TRY(check_grid(__func__, B, T, Hq, Hkv, D));
  if (B * T * Hq == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  bf16 *o = reinterpret_cast<bf16 *>(out);
  const bf16 *qb = reinterpret_cast<const bf16 *>(q), *kb = reinterpret_cast<const bf16 *>(k),
             *vb = reinterpret_cast<const bf16 *>(v);
  if (D == 64) NVL_TRY(fwd_launch<64>(o, lse, qb, kb, vb, B, T, Hq, Hkv, (float)scale, causal));
  else NVL_TRY(fwd_launch<128>(o, lse, qb, kb, vb, B, T, Hq, Hkv, (float)scale, causal));
  char what[160];
  snprintf(what, sizeof what, "flash_fwd_kernel (B %lld, T %lld, Hq %lld, Hkv %lld, D %lld)", (long long)B,
           (long long)T, (long long)Hq, (long long)Hkv, (long long)D);
  return nvl_cuda_check_launch(dev, __func__, what);
}

template <int D>
static nvl_status bwd_launch(bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                             const bf16 *v, const float *lse, const float *delta, int64_t B, int64_t T, int64_t Hq,
                             int64_t Hkv, float scale, int causal, int dev, const char *fn, const char *what) {
  size_t smem = dkdv_smem(D);
  NVL_TRY(set_smem(flash_dkdv_kernel<D>, smem));
  dim3 grid((unsigned)((T + FA_TILE - 1) / FA_TILE), (unsigned)Hkv, (unsigned)B);
  NVL_LAUNCH(grid, FA_THREADS, smem, 0, flash_dkdv_kernel<D>)(dk, dv, dout, q, k, v, lse, delta, T, Hq, Hkv, scale,
                                                              causal);
  NVL_TRY(nvl_cuda_check_launch(dev, fn, what));
  smem = dq_smem(D);
  NVL_TRY(set_smem(flash_dq_kernel<D>, smem));
  grid.y = (unsigned)Hq;
  NVL_LAUNCH(grid, FA_THREADS, smem, 0, flash_dq_kernel<D>)(dq, dout, q, k, v, lse, delta, T, Hq, Hkv, scale, causal);
  return nvl_cuda_check_launch(dev, fn, what);
}

extern "C" nvl_status nvl_cuda_flash_attn_bwd(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                              const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                              const uint16_t *v, const uint16_t *out, const float *lse, int64_t B,
                                              int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale,
                                              int causal) {
  const int dev = ctx->dev;
  NVL_TRY(check_grid(__func__, B, T, Hq, Hkv, D));
  if (B * T * Hq == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  float *delta = NULL; /* (B, Hq, T), call scratch */
  NVL_TRY(ctx->scratch(ctx, (size_t)(B * Hq * T) * sizeof(float), (void **)&delta));
  char what[160];
  snprintf(what, sizeof what, "flash attention backward (B %lld, T %lld, Hq %lld, Hkv %lld, D %lld)", (long long)B,
           (long long)T, (long long)Hq, (long long)Hkv, (long long)D);
  (void)cudaGetLastError();
  const bf16 *go = reinterpret_cast<const bf16 *>(dout), *qb = reinterpret_cast<const bf16 *>(q),
             *kb = reinterpret_cast<const bf16 *>(k), *vb = reinterpret_cast<const bf16 *>(v),
             *ob = reinterpret_cast<const bf16 *>(out);
  bf16 *gq = reinterpret_cast<bf16 *>(dq), *gk = reinterpret_cast<bf16 *>(dk), *gv = reinterpret_cast<bf16 *>(dv);
  NVL_LAUNCH(nvl_cuda_grid(B * Hq * T * 32, 256, dev), 256, 0, 0, flash_delta_kernel)(delta, go, ob, B, T, Hq, (int)D);
  NVL_TRY(nvl_cuda_check_launch(dev, __func__, what));
  if (D == 64) return bwd_launch<64>(gq, gk, gv, go, qb, kb, vb, lse, delta, B, T, Hq, Hkv, (float)scale, causal, dev,
                                     __func__, what);
  return bwd_launch<128>(gq, gk, gv, go, qb, kb, vb, lse, delta, B, T, Hq, Hkv, (float)scale, causal, dev, __func__,
                         what);
}

/* ---- the WMMA probe (tests of the emulator's model; flash_attn.h) --------------------------------------- */

template <class LA, class LB>
__device__ void probe_mma(float *d, const bf16 *a, const bf16 *b, const float *c, int flags) {
  const int lane = threadIdx.x & 31;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB> fb;
  frag_c fc;
  const wmma::layout_t lc = flags & NVL_WMMA_C_COL ? wmma::mem_col_major : wmma::mem_row_major;
  const bf16 *pa = a;
  unsigned lda = 16;
  if (flags & NVL_WMMA_MISALIGNED) pa = a + 8;
  if (flags & NVL_WMMA_BAD_LDM) lda = 12;
  if ((flags & NVL_WMMA_LANE_PTR) && (lane & 1)) pa = b;
  wmma::load_matrix_sync(fc, c, 16, lc);
  wmma::load_matrix_sync(fa, pa, lda);
  wmma::load_matrix_sync(fb, b, 16);
  if ((flags & NVL_WMMA_DIVERGE) && lane == 31) return;
  wmma::mma_sync(fc, fa, fb, fc);
  wmma::store_matrix_sync(d, fc, 16, lc);
}

/* block 32 (48 with NVL_WMMA_PARTIAL): warp 0 computes d; the flags pick layouts and broken rules */
__global__ void wmma_probe_kernel(float *d, const bf16 *a, const bf16 *b, const float *c, int flags) {
  const int ac = flags & NVL_WMMA_A_COL, bc = flags & NVL_WMMA_B_COL;
  if (!(flags & NVL_WMMA_PARTIAL) && threadIdx.x >= 32) return;
  if (!ac && !bc) probe_mma<wmma::row_major, wmma::row_major>(d, a, b, c, flags);
  else if (!ac) probe_mma<wmma::row_major, wmma::col_major>(d, a, b, c, flags);
  else if (!bc) probe_mma<wmma::col_major, wmma::row_major>(d, a, b, c, flags);
  else probe_mma<wmma::col_major, wmma::col_major>(d, a, b, c, flags);
}

extern "C" nvl_status nvl_cuda_wmma_probe(nvl_kctx *ctx, float *d, const uint16_t *a, const uint16_t *b,
                                          const float *c, int flags) {
  const int dev = ctx->dev;
#ifndef NVL_CUDA_EMU
  if (flags & ~(NVL_WMMA_A_COL | NVL_WMMA_B_COL | NVL_WMMA_C_COL))
    return nvl_error(NVL_EUNSUPPORTED, "%s: flags 0x%x break a WMMA rule on purpose; only the CUDA emulator checks "
                     "them (a GPU's behaviour is undefined)", __func__, flags);
#endif
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  (void)cudaGetLastError();
  NVL_LAUNCH(1, flags & NVL_WMMA_PARTIAL ? 48 : 32, 0, 0, wmma_probe_kernel)(
      d, reinterpret_cast<const bf16 *>(a), reinterpret_cast<const bf16 *>(b), c, flags);
  return nvl_cuda_check_launch(dev, __func__, "wmma_probe_kernel");
}
