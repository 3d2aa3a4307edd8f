/* attention_ref.h: the readable reference of causal grouped-query attention — one softmax row
 * at a time, in double. The fast kernels (kernels/cpu/attention_cpu.h) are tested against it.
 * Raw contiguous f32 buffers, already validated and allocated by core/attention.c; the double
 * workspace comes from the caller too (nvl_kctx scratch; kernels never allocate). The entries of
 * the reference table.
 * Shapes: q, out, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T). Query head h
 * reads key/value head h / (Hq / Hkv); position t sees positions s <= t.
 * Not here: validation, threads, anything fast. */
#ifndef NVL_ATTENTION_REF_H
#define NVL_ATTENTION_REF_H
#include "backend.h"

/* out = softmax(q k^T * scale, causal) v; lse = log of each row's softmax denominator
 * (max-subtracted, accumulated in double, stored f32). Scratch: T + D doubles. */
nvl_status nvl_attention_forward_ref(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                     const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                     double scale);
/* The forward of queries at positions pos0 .. pos0 + T - 1 over a key/value cache (KV-cache decoding):
 * q, out (B, T, Hq, D); k, v (B, S, Hkv, D), S >= pos0 + T, rows past pos0 + T - 1 unread; lse (B, Hq, T);
 * query t sees keys s <= pos0 + t (the causal mask aligned bottom-right). pos0 = 0, S = T is the forward
 * above. Scratch: pos0 + T + D doubles. */
nvl_status nvl_attention_forward_at_ref(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                        const float *v, int64_t B, int64_t T, int64_t S, int64_t pos0, int64_t Hq,
                                        int64_t Hkv, int64_t D, double scale);
/* dq, dk, dv = (written, dk/dv summed over the Hq / Hkv query heads of each kv head). P is
 * recomputed from q, k and lse: P = exp(q k^T * scale - lse); D_t = sum_d dout * out;
 * dP = dout v^T; dS = P (dP - D_t); dq = dS k * scale; dk = dS^T q * scale; dv = P^T dout.
 * Scratch: 2 T (P and dS rows) + 2 T D (dk, dv accumulators) doubles. */
nvl_status nvl_attention_backward_ref(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                                      const float *q, const float *k, const float *v, const float *out,
                                      const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                      double scale);
#endif
