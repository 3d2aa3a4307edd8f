/* attention_bf16_cpu.h: causal grouped-query attention on bf16 activations with the CPU's bf16
 * dot-product units (AVX512-BF16 VDPBF16PS): FlashAttention's numerics, the CUDA route's
 * (kernels/cuda/flash_attn.cu, NUMERICS §11) — scores, softmax and every accumulation in fp32, P
 * rounded to bf16 before its products with V (forward) and dout (dV), dS rounded to bf16 before its
 * products with K (dQ) and Q (dK); out, dq, dk, dv rounded to bf16 once, lse fp32. Tiles of
 * NVL_ATTN_BLOCK query rows as attention_cpu.c (nothing above the diagonal block is computed), the
 * same fp32 softmax rows. Within stated bounds of the widened-f32 rule, not equal to it
 * (tests/test_attention_bf16.lua). Shapes: q, out, dq, dout (B, T, Hq, D) bf16; k, v, dk, dv (B, T,
 * Hkv, D) bf16; lse (B, Hq, T) f32; contiguous.
 * Not here: validation, allocation of the outputs (core/attention.c). */
#ifndef NVL_ATTENTION_BF16_CPU_H
#define NVL_ATTENTION_BF16_CPU_H
#include "backend.h"

/* 1: built with the AVX512-BF16 kernels and this CPU has the instructions */
int nvl_attention_bf16_cpu_ready(void);

nvl_status nvl_attention_forward_bf16_cpu(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q,
                                          const uint16_t *k, const uint16_t *v, int64_t B, int64_t T, int64_t Hq,
                                          int64_t Hkv, int64_t D, double scale);
nvl_status nvl_attention_backward_bf16_cpu(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                           const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                           const uint16_t *v, const uint16_t *out, const float *lse, int64_t B,
                                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale);
#endif
