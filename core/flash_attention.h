/* flash_attention.h: the CUDA backend's fused attentions as tensor-level calls (core/attention.c routes bf16
 * attention to them): the tensor-core FlashAttention-2 (kernels/cuda/flash_attn.cu) and cuDNN's fused SDPA
 * (kernels/cuda/cudnn_attn.cu, cuDNN 9 loaded at run time). Grouped-query attention, causal or not, bf16 q, k, v
 * (and out, dout, dq, dk, dv), fp32 lse; head dim 64 or 128.
 * q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T) f32; all contiguous, on one
 * CUDA device, each 16-byte aligned. Backward: dq, dk, dv are WRITTEN (=). In a build without CUDA (or, for
 * cuDNN, without its headers) each call returns NVL_EUNSUPPORTED. Also the probe of the warp matrix functions
 * (tests of the CUDA emulator). Not here: the fp32 attention of every backend (layers.h). */
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
/* The same two calls through cuDNN's fused attention (sm_90+, cuDNN 9.6+); lse is cuDNN's softmax Stats, the same
 * logsumexp. deterministic: the backward graph without cuDNN's fp32 dq atomics (Hopper only; a B*Hq*T*T*2-byte
 * workspace). */
nvl_status nvl_cudnn_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, int causal);
nvl_status nvl_cudnn_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, int causal,
                                        int deterministic);
/* NVL_OK if cuDNN's attention would take bf16 q (B, T, Hq, D), k (B, T, Hkv, D) on q's CUDA device (the library
 * loads and is a version the route takes, sm_90+, D 64 or 128, T >= 2, ...); else NVL_EUNSUPPORTED and why.
 * Layout (contiguity, alignment) is the caller's to check. */
nvl_status nvl_cudnn_attention_supported(const char *op, const nvl_tensor *q, const nvl_tensor *k, int deterministic);
/* NVL_OK if cuDNN's attention can run on CUDA device dev (0-based) at all; else the reason. */
nvl_status nvl_cudnn_attention_available(int dev);
/* What the cuDNN route has done in this process, and the library. */
typedef struct {
  int64_t graphs_built, cache_hits, evictions, executions, cached;
  int64_t refusals;        /* problems cuDNN had no engine for (attention=auto fell back on them) */
  char last_refusal[480];  /* the last one's message */
  size_t last_workspace;   /* bytes of cuDNN workspace the last plan built asked for */
  size_t version;          /* cudnnGetVersion() of the loaded library (0: not loaded) */
  size_t compiled_version; /* CUDNN_VERSION of the headers nvlua was built with (0: built without cuDNN) */
  int loads;               /* libcudnn opened with every function the route calls (no GPU needed) */
  char load_error[400];    /* why not ("" if it loads) */
} nvl_cudnn_attention_info;
void nvl_cudnn_attention_stats(nvl_cudnn_attention_info *i);
/* Drop every cached cuDNN plan. */
void nvl_cudnn_attention_clear_cache(void);
/* Emulation builds: break one cuDNN API rule on purpose (kernels/cuda/cudnn_attn.h NVL_CUDNN_BREAK_*; 0 restores)
 * -> the previous setting; -1 elsewhere (nothing changes). */
int nvl_cudnn_attention_break(int what);
/* d (16, 16) f32 = A B + C by one warp's wmma::mma_sync on cuda: a, b (16, 16) bf16 read with the layouts of
 * flags (kernels/cuda/flash_attn.h NVL_WMMA_*), c (16, 16) f32; flags above 7 break a rule on purpose
 * (emulator only). */
nvl_status nvl_wmma_probe(nvl_tensor *d, const nvl_tensor *a, const nvl_tensor *b, const nvl_tensor *c, int flags);

#ifdef __cplusplus
}
#endif
#endif
