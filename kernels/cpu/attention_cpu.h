/* attention_cpu.h: the fast CPU kernels of causal grouped-query attention — OpenBLAS sgemm on tiles
 * of NVL_ATTN_BLOCK query rows (a tile's keys stop at its last row: nothing above the diagonal
 * block is computed), the softmax in fp32 with a vectorised exp (Cody-Waite + polynomial, within
 * ~2 ulp of expf, 0 below -87 where expf is subnormal) and the row sum in double over 16 fixed lanes
 * (the same bits on every SIMD width). Tested
 * against kernels/cpu/ref/attention_ref.h within fp32 summation-order error (tests/test_attention.lua).
 * Raw contiguous f32 buffers, validated and allocated by core/attention.c; the f32 workspace
 * comes from the caller's scratch (nvl_kctx; kernels never allocate). D = 0 runs the reference. Shapes as in attention_ref.h:
 * q, out, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T).
 * Not here: validation, the reference arithmetic. */
#ifndef NVL_ATTENTION_CPU_H
#define NVL_ATTENTION_CPU_H
#include "cpu/ref/attention_ref.h"

#define NVL_ATTN_BLOCK 64 /* query rows per tile */

/* The row functions of the softmax, shared with attention_bf16_cpu.c. Forward: s[0..t] (the causal
 * part of a score row; s[t+1..n) set to 0) becomes exp(s[j] - max); returns the row sum (double, 16
 * fixed lanes), *mx the max. Backward: p[0..t] scores -> P = exp(score - l), ds[0..t] dP -> P (dP -
 * Dt), both zeroed on (t, n). */
double nvl_attn_softmax_row(float *s, int64_t t, int64_t n, float *mx);
void nvl_attn_dsoftmax_row(float *p, float *ds, int64_t t, int64_t n, float l, float Dt);

/* out, lse as nvl_attention_forward_ref; threads over (b, query tile, query head), largest tiles
 * first. Scratch: one
 * (NVL_ATTN_BLOCK, T) f32 score tile per thread. */
nvl_status nvl_attention_forward_cpu(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                     const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                     double scale);
/* dq, dk, dv as nvl_attention_backward_ref; threads over (b, kv head), so the Hq / Hkv query
 * heads that share a kv head add into its dk, dv on one thread (no race). Scratch: two
 * (NVL_ATTN_BLOCK, T) tiles (P, dS) per thread. */
nvl_status nvl_attention_backward_cpu(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                                      const float *q, const float *k, const float *v, const float *out,
                                      const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                      double scale);

#endif
