/* flash_attention.h: the tensor-core FlashAttention-2 of the CUDA backend (kernels/cuda/flash_attn.cu), as a
 * tensor-level call of its own until the attention entry of the CUDA table routes to it: grouped-query
 * attention, causal or not, bf16 q, k, v (and out, dout, dq, dk, dv), fp32 lse; head dim 64 or 128.
 * q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T) f32; all contiguous, on one
 * CUDA device, each 16-byte aligned. Backward: dq, dk, dv are WRITTEN (=). In a build without CUDA each call
 * returns NVL_EUNSUPPORTED. Also the probe of the warp matrix functions (tests of the CUDA emulator).
 * Not here: the fp32 attention of every backend (layers.h). */
#ifndef NVL_FLASH_ATTENTION_H
#define NVL_FLASH_ATTENTION_H
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out (B, T, Hq, D) bf16, lse (B, Hq, T) f32 = attention(q, k, v) with scores scale q.k (causal: key s <= t). */
nvl_status nvl_flash_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, int causal);
/* dq, dk, dv (bf16) of the forward's out and lse for the output gradient dout (bf16). */
nvl_status nvl_flash_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, int causal);
/* d (16, 16) f32 = A B + C by one warp's wmma::mma_sync on cuda: a, b (16, 16) bf16 read with the layouts of
 * flags (kernels/cuda/flash_attn.h NVL_WMMA_*), c (16, 16) f32; flags above 7 break a rule on purpose
 * (emulator only). */
nvl_status nvl_wmma_probe(nvl_tensor *d, const nvl_tensor *a, const nvl_tensor *b, const nvl_tensor *c, int flags);

#ifdef __cplusplus
}
#endif
#endif
