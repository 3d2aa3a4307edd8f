/* attention.cu: causal grouped-query attention on the device (the attention entries of the CUDA table, kernels/cuda/cuda.h),
 * FlashAttention-style: K/V are streamed through shared memory in tiles of 32 keys and the
 * softmax is computed online (running max and sum per query row), so the T x T score matrix is
 * never stored; fp32 throughout (the contract of core/layers.h: f32 in, f32 out). The twin of
 * kernels/cpu/ref/attention_ref.c, tested against it within fp32 tolerance
 * (tests/test_cuda_layers.lua).
 *
 * Shapes: q, out, dq, dout (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse, delta (B, Hq, T);
 * query head h reads key/value head h / (Hq / Hkv); 1 <= D <= 256. The forward also runs over a KV
 * cache (nvl_cuda_attention_forward_at: k, v (B, S, Hkv, D), queries at positions pos0 .. pos0 + T - 1).
 *
 * Forward: a block of 4 warps takes 16 query rows of one (b, h), each warp 4 rows; per key
 * tile, lane j scores key j, the warp merges the tile into its rows' (max, sum, acc) state; the
 * accumulator holds D/32 values per lane and row. lse = max + log(sum) is saved.
 * Backward (FlashAttention-2's split, no atomics, deterministic): delta = rowsum(dout * out);
 * dq by query blocks (the forward's layout, P recomputed from lse); dk, dv by blocks of 32 keys
 * of one (b, kv head), one warp, lane j owning key j's accumulators in shared memory, walking
 * every query row of the group that sees those keys.
 *
 * Written for correctness first: CUDA cores, fp32, no tensor cores, no bf16 inputs; the dk/dv
 * kernel is one warp per block. Tuning (wgmma/mma tiles, bf16 in) is the next step, measured.
 * Not here: validation and allocation (core/attention.c). */
#include <math.h>
#include <stdio.h>

#include "common.cuh"

#define ATT_BQ 16  /* query rows per forward / dq block (4 warps x 4 rows) */
#define ATT_BK 32  /* keys per tile (one per lane) */
#define ATT_ROWS 4 /* query rows per warp */

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Load rows [s0, s0 + 32) of head g of a (B, T, H, D) tensor into a (32, D + 1) tile (rows
 * past T are zero). All threads of the block take part. */
__device__ __forceinline__ void load_tile(float *tile, const float *x, int64_t b, int64_t s0, int64_t g, int64_t T,
                                          int64_t H, int D) {
  const int P = D + 1;
  for (int i = threadIdx.x; i < ATT_BK * D; i += blockDim.x) {
    int j = i / D, d = i - j * D;
    int64_t s = s0 + j;
    tile[j * P + d] = s < T ? x[((b * T + s) * H + g) * D + d] : 0.0f;
  }
}

/* Load ATT_BQ query rows [t0, t0 + 16) of head h into rows (16, D) (zero past T). */
__device__ __forceinline__ void load_rows(float *rows, const float *x, int64_t b, int64_t t0, int64_t h, int64_t T,
                                          int64_t H, int D) {
  for (int i = threadIdx.x; i < ATT_BQ * D; i += blockDim.x) {
    int r = i / D, d = i - r * D;
    int64_t t = t0 + r;
    rows[i] = t < T ? x[((b * T + t) * H + h) * D + d] : 0.0f;
  }
}

/* grid (ceil(T/16), Hq, B), block 128; shared: k, v tiles (32, D+1) and q rows (16, D). Query t is at
 * position pos0 + t and sees keys s <= pos0 + t of k, v (B, S, Hkv, D): S = T, pos0 = 0 in the training
 * forward; a KV cache's rows (S its capacity) in a cached step (nvl_cuda_attention_forward_at). */
template <int DM>
__global__ void __launch_bounds__(128) attn_fwd_kernel(float *__restrict__ out, float *__restrict__ lse,
                                                       const float *__restrict__ q, const float *__restrict__ k,
                                                       const float *__restrict__ v, int64_t T, int64_t S,
                                                       int64_t pos0, int64_t Hq, int64_t Hkv, int D, float scale) {
  NVL_SHARED_DYNAMIC(float, sh);
  const int P = D + 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float *ks = sh, *vs = sh + ATT_BK * P, *qs = vs + ATT_BK * P;
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / (Hq / Hkv), t0 = (int64_t)blockIdx.x * ATT_BQ;
  load_rows(qs, q, b, t0, h, T, Hq, D);
  float m[ATT_ROWS], l[ATT_ROWS], acc[ATT_ROWS][DM / 32];
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < DM / 32; i++) acc[r][i] = 0.0f;
  }
  const int64_t t_last = pos0 + (t0 + ATT_BQ - 1 < T - 1 ? t0 + ATT_BQ - 1 : T - 1); /* the last key seen */
  for (int64_t s0 = 0; s0 <= t_last; s0 += ATT_BK) {
    __syncthreads(); /* the previous tile is consumed (and qs is loaded) */
    load_tile(ks, k, b, s0, g, S, Hkv, D);
    load_tile(vs, v, b, s0, g, S, Hkv, D);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
      const int row = warp * ATT_ROWS + r;
      const int64_t t = t0 + row, ta = pos0 + t; /* the query's row and position */
      if (t >= T || s0 > ta) continue; /* warp-uniform */
      const int64_t s = s0 + lane;
      float sc = -INFINITY;
      if (s <= ta) {
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot += qs[row * D + d] * ks[lane * P + d];
        sc = dot * scale;
      }
      const float m_new = fmaxf(m[r], warp_max(sc)); /* finite: key s0 <= ta is in the tile */
      const float alpha = expf(m[r] - m_new);       /* 0 on the first tile (m = -inf) */
      const float p = s <= ta ? expf(sc - m_new) : 0.0f;
      l[r] = l[r] * alpha + warp_sum(p);
#pragma unroll
      for (int i = 0; i < DM / 32; i++) acc[r][i] *= alpha;
      const int jn = (int)(ta - s0 + 1 < ATT_BK ? ta - s0 + 1 : ATT_BK); /* keys of the tile row t sees */
      for (int j = 0; j < jn; j++) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
        for (int i = 0; i < DM / 32; i++) {
          const int d = lane + 32 * i;
          if (d < D) acc[r][i] += pj * vs[j * P + d];
        }
      }
      m[r] = m_new;
    }
  }
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    const int64_t t = t0 + warp * ATT_ROWS + r;
    if (t >= T) continue;
    const float inv = 1.0f / l[r];
#pragma unroll
    for (int i = 0; i < DM / 32; i++) {
      const int d = lane + 32 * i;
      if (d < D) out[((b * T + t) * Hq + h) * D + d] = acc[r][i] * inv;
    }
    if (lane == 0) lse[(b * Hq + h) * T + t] = m[r] + logf(l[r]);
  }
}

/* delta (B, Hq, T) = sum_d dout * out, one warp per row; grid-stride over rows. */
__global__ void attn_delta_kernel(float *__restrict__ delta, const float *__restrict__ dout,
                                  const float *__restrict__ out, int64_t B, int64_t T, int64_t Hq, int D) {
  const int lane = threadIdx.x & 31;
  const int64_t nrows = B * Hq * T, wstride = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t w = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < nrows; w += wstride) {
    const int64_t t = w % T, h = (w / T) % Hq, b = w / (T * Hq);
    const float *go = dout + ((b * T + t) * Hq + h) * D, *o = out + ((b * T + t) * Hq + h) * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += go[d] * o[d];
    s = warp_sum(s);
    if (lane == 0) delta[w] = s;
  }
}

/* dq = scale * sum_s dS[t, s] k[s], dS = P (dout.v - delta), P = exp(q.k scale - lse).
 * grid (ceil(T/16), Hq, B), block 128; shared: k, v tiles, q and dout rows. */
template <int DM>
__global__ void __launch_bounds__(128) attn_dq_kernel(float *__restrict__ dq, const float *__restrict__ dout,
                                                      const float *__restrict__ q, const float *__restrict__ k,
                                                      const float *__restrict__ v, const float *__restrict__ lse,
                                                      const float *__restrict__ delta, int64_t T, int64_t Hq,
                                                      int64_t Hkv, int D, float scale) {
  NVL_SHARED_DYNAMIC(float, sh);
  const int P = D + 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float *ks = sh, *vs = sh + ATT_BK * P, *qs = vs + ATT_BK * P, *gs = qs + ATT_BQ * D;
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / (Hq / Hkv), t0 = (int64_t)blockIdx.x * ATT_BQ;
  load_rows(qs, q, b, t0, h, T, Hq, D);
  load_rows(gs, dout, b, t0, h, T, Hq, D);
  float acc[ATT_ROWS][DM / 32], lr[ATT_ROWS], dr[ATT_ROWS];
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    const int64_t t = t0 + warp * ATT_ROWS + r;
    lr[r] = t < T ? lse[(b * Hq + h) * T + t] : 0.0f;
    dr[r] = t < T ? delta[(b * Hq + h) * T + t] : 0.0f;
#pragma unroll
    for (int i = 0; i < DM / 32; i++) acc[r][i] = 0.0f;
  }
  const int64_t t_last = t0 + ATT_BQ - 1 < T - 1 ? t0 + ATT_BQ - 1 : T - 1;
  for (int64_t s0 = 0; s0 <= t_last; s0 += ATT_BK) {
    __syncthreads();
    load_tile(ks, k, b, s0, g, T, Hkv, D);
    load_tile(vs, v, b, s0, g, T, Hkv, D);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
      const int row = warp * ATT_ROWS + r;
      const int64_t t = t0 + row;
      if (t >= T || s0 > t) continue;
      const int64_t s = s0 + lane;
      float ds = 0.0f;
      if (s <= t) {
        float qk = 0.0f, dp = 0.0f;
        for (int d = 0; d < D; d++) {
          qk += qs[row * D + d] * ks[lane * P + d];
          dp += gs[row * D + d] * vs[lane * P + d];
        }
        ds = expf(qk * scale - lr[r]) * (dp - dr[r]);
      }
      const int jn = (int)(t - s0 + 1 < ATT_BK ? t - s0 + 1 : ATT_BK);
      for (int j = 0; j < jn; j++) {
        const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
        for (int i = 0; i < DM / 32; i++) {
          const int d = lane + 32 * i;
          if (d < D) acc[r][i] += dsj * ks[j * P + d];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    const int64_t t = t0 + warp * ATT_ROWS + r;
    if (t >= T) continue;
#pragma unroll
    for (int i = 0; i < DM / 32; i++) {
      const int d = lane + 32 * i;
      if (d < D) dq[((b * T + t) * Hq + h) * D + d] = acc[r][i] * scale;
    }
  }
}

/* The q and dout rows of attn_dkdv_kernel are padded to a multiple of 4 floats: nvcc reads the tail of
 * the d < D loop with one 16-byte LDS.128 from a 16-byte-aligned address, so up to 3 floats past the row
 * (past the end of the allocation for D = 1, 2: compute-sanitizer's memcheck on an H200 flagged it). */
#define DKDV_ROW(D) (((D) + 3) & ~3)

/* dk[s] = scale * sum_t dS[t, s] q[t], dv[s] = sum_t P[t, s] dout[t] over the query heads of kv
 * head g and the rows t >= s. grid (ceil(T/32), Hkv, B), block 32 (one warp, lane j = key s0+j);
 * shared: k, v tiles and the dk, dv accumulators (32, D+1), the current q and dout rows (D). */
__global__ void __launch_bounds__(32) attn_dkdv_kernel(float *__restrict__ dk, float *__restrict__ dv,
                                                       const float *__restrict__ dout, const float *__restrict__ q,
                                                       const float *__restrict__ k, const float *__restrict__ v,
                                                       const float *__restrict__ lse, const float *__restrict__ delta,
                                                       int64_t T, int64_t Hq, int64_t Hkv, int D, float scale) {
  NVL_SHARED_DYNAMIC(float, sh);
  const int P = D + 1, lane = threadIdx.x;
  float *ks = sh, *vs = ks + ATT_BK * P, *dka = vs + ATT_BK * P, *dva = dka + ATT_BK * P;
  float *qr = dva + ATT_BK * P, *gr = qr + DKDV_ROW(D); /* rows padded: see DKDV_ROW */
  const int64_t b = blockIdx.z, g = blockIdx.y, s0 = (int64_t)blockIdx.x * ATT_BK, group = Hq / Hkv;
  load_tile(ks, k, b, s0, g, T, Hkv, D);
  load_tile(vs, v, b, s0, g, T, Hkv, D);
  for (int i = lane; i < ATT_BK * P; i += 32) dka[i] = dva[i] = 0.0f;
  const int64_t s = s0 + lane;
  for (int64_t h = g * group; h < (g + 1) * group; h++)
    for (int64_t t = s0; t < T; t++) {
      __syncwarp();
      for (int d = lane; d < D; d += 32) {
        qr[d] = q[((b * T + t) * Hq + h) * D + d];
        gr[d] = dout[((b * T + t) * Hq + h) * D + d];
      }
      __syncwarp();
      if (s < T && s <= t) {
        float qk = 0.0f, dp = 0.0f;
        for (int d = 0; d < D; d++) {
          qk += qr[d] * ks[lane * P + d];
          dp += gr[d] * vs[lane * P + d];
        }
        const float p = expf(qk * scale - lse[(b * Hq + h) * T + t]);
        const float ds = p * (dp - delta[(b * Hq + h) * T + t]);
        for (int d = 0; d < D; d++) {
          dka[lane * P + d] += ds * qr[d];
          dva[lane * P + d] += p * gr[d];
        }
      }
    }
  __syncwarp();
  for (int i = lane; i < ATT_BK * D; i += 32) {
    const int j = i / D, d = i - j * D;
    const int64_t sj = s0 + j;
    if (sj < T) {
      dk[((b * T + sj) * Hkv + g) * D + d] = dka[j * P + d] * scale;
      dv[((b * T + sj) * Hkv + g) * D + d] = dva[j * P + d];
    }
  }
}

static nvl_status check_dims(const char *fn, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  if (D < 1 || D > 256)
    return nvl_error(NVL_EUNSUPPORTED, "%s: head dim D = %lld; attention on cuda takes 1 <= D <= 256", fn,
                     (long long)D);
  if (Hkv < 1 || Hq % Hkv) return nvl_error(NVL_EINVAL, "%s: Hq (%lld) must be a multiple of Hkv (%lld)", fn,
                                            (long long)Hq, (long long)Hkv);
  if ((T + ATT_BK - 1) / ATT_BK > 2147483647LL || Hq > 65535 || B > 65535)
    return nvl_error(NVL_EUNSUPPORTED, "%s: grid too large (B %lld, T %lld, Hq %lld)", fn, (long long)B,
                     (long long)T, (long long)Hq);
  return NVL_OK;
}

/* Launch kern with `smem` dynamic shared bytes, opting in above the 48 KiB default. */
template <typename K>
static nvl_status set_smem(K kern, size_t smem) {
  if (smem > 48 * 1024) NVL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            (int)smem));
  return NVL_OK;
}

template <int DM>
static nvl_status fwd_launch(float *out, float *lse, const float *q, const float *k, const float *v, int64_t B,
                             int64_t T, int64_t S, int64_t pos0, int64_t Hq, int64_t Hkv, int D, float scale) {
  size_t smem = (size_t)(2 * ATT_BK * (D + 1) + ATT_BQ * D) * sizeof(float);
  NVL_TRY(set_smem(attn_fwd_kernel<DM>, smem));
  dim3 grid((unsigned)((T + ATT_BQ - 1) / ATT_BQ), (unsigned)Hq, (unsigned)B);
  NVL_LAUNCH(grid, 128, smem, 0, attn_fwd_kernel<DM>)(out, lse, q, k, v, T, S, pos0, Hq, Hkv, D, scale);
  return NVL_OK;
}

/* The forward's launch for queries at pos0 .. pos0 + T - 1 over k, v (B, S, Hkv, D). */
static nvl_status forward_at(nvl_kctx *ctx, const char *fn, float *out, float *lse, const float *q, const float *k,
                             const float *v, int64_t B, int64_t T, int64_t S, int64_t pos0, int64_t Hq, int64_t Hkv,
                             int64_t D, double scale) {
  const int dev = ctx->dev;
  NVL_TRY(check_dims(fn, B, S, Hq, Hkv, D));
  if (B * T * Hq == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  (void)cudaGetLastError();
  const int d = (int)D;
  const float sc = (float)scale;
  if (D <= 32) NVL_TRY(fwd_launch<32>(out, lse, q, k, v, B, T, S, pos0, Hq, Hkv, d, sc));
  else if (D <= 64) NVL_TRY(fwd_launch<64>(out, lse, q, k, v, B, T, S, pos0, Hq, Hkv, d, sc));
  else if (D <= 128) NVL_TRY(fwd_launch<128>(out, lse, q, k, v, B, T, S, pos0, Hq, Hkv, d, sc));
  else NVL_TRY(fwd_launch<256>(out, lse, q, k, v, B, T, S, pos0, Hq, Hkv, d, sc));
  char what[200];
  snprintf(what, sizeof what, "attn_fwd_kernel (B %lld, T %lld, S %lld, pos0 %lld, Hq %lld, Hkv %lld, D %lld)",
           (long long)B, (long long)T, (long long)S, (long long)pos0, (long long)Hq, (long long)Hkv, (long long)D);
  return nvl_cuda_check_launch(dev, fn, what);
}

template <int DM>
static nvl_status dq_launch(float *dq, const float *dout, const float *q, const float *k, const float *v,
                            const float *lse, const float *delta, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int D,
                            float scale) {
  size_t smem = (size_t)(2 * ATT_BK * (D + 1) + 2 * ATT_BQ * D) * sizeof(float);
  NVL_TRY(set_smem(attn_dq_kernel<DM>, smem));
  dim3 grid((unsigned)((T + ATT_BQ - 1) / ATT_BQ), (unsigned)Hq, (unsigned)B);
  NVL_LAUNCH(grid, 128, smem, 0, attn_dq_kernel<DM>)(dq, dout, q, k, v, lse, delta, T, Hq, Hkv, D, scale);
  return NVL_OK;
}

extern "C" nvl_status nvl_cuda_attention_forward(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                                 const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                                 int64_t D, double scale) {
  return forward_at(ctx, __func__, out, lse, q, k, v, B, T, T, 0, Hq, Hkv, D, scale);
}

extern "C" nvl_status nvl_cuda_attention_forward_at(nvl_kctx *ctx, float *out, float *lse, const float *q,
                                                    const float *k, const float *v, int64_t B, int64_t T, int64_t S,
                                                    int64_t pos0, int64_t Hq, int64_t Hkv, int64_t D, double scale) {
  return forward_at(ctx, __func__, out, lse, q, k, v, B, T, S, pos0, Hq, Hkv, D, scale);
}

extern "C" nvl_status nvl_cuda_attention_backward(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout, const float *q,
                                                  const float *k, const float *v, const float *out, const float *lse,
                                                  int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                                  double scale) {
  const int dev = ctx->dev;
  NVL_TRY(check_dims(__func__, B, T, Hq, Hkv, D));
  if (B * T * Hq == 0) return NVL_OK;
  NVL_TRY(nvl_cuda_use_device(dev, __func__));
  const int d = (int)D;
  const float sc = (float)scale;
  float *delta = NULL; /* (B, Hq, T), call scratch */
  NVL_TRY(ctx->scratch(ctx, (size_t)(B * Hq * T) * sizeof(float), (void **)&delta));
  char what[160];
  snprintf(what, sizeof what, "attention backward (B %lld, T %lld, Hq %lld, Hkv %lld, D %lld)", (long long)B,
           (long long)T, (long long)Hq, (long long)Hkv, (long long)D);
  (void)cudaGetLastError();
  NVL_LAUNCH(nvl_cuda_grid(B * Hq * T * 32, 256, dev), 256, 0, 0, attn_delta_kernel)(delta, dout, out, B, T, Hq, d);
  nvl_status st = nvl_cuda_check_launch(dev, __func__, what);
  if (st == NVL_OK) {
    if (D <= 32) st = dq_launch<32>(dq, dout, q, k, v, lse, delta, B, T, Hq, Hkv, d, sc);
    else if (D <= 64) st = dq_launch<64>(dq, dout, q, k, v, lse, delta, B, T, Hq, Hkv, d, sc);
    else if (D <= 128) st = dq_launch<128>(dq, dout, q, k, v, lse, delta, B, T, Hq, Hkv, d, sc);
    else st = dq_launch<256>(dq, dout, q, k, v, lse, delta, B, T, Hq, Hkv, d, sc);
  }
  if (st == NVL_OK) st = nvl_cuda_check_launch(dev, __func__, what);
  if (st == NVL_OK) {
    size_t smem = (size_t)(4 * ATT_BK * (D + 1) + 2 * DKDV_ROW(d)) * sizeof(float);
    st = set_smem(attn_dkdv_kernel, smem);
    if (st == NVL_OK) {
      dim3 grid((unsigned)((T + ATT_BK - 1) / ATT_BK), (unsigned)Hkv, (unsigned)B);
      NVL_LAUNCH(grid, 32, smem, 0, attn_dkdv_kernel)(dk, dv, dout, q, k, v, lse, delta, T, Hq, Hkv, d, sc);
      st = nvl_cuda_check_launch(dev, __func__, what);
    }
  }
  return st;
}
