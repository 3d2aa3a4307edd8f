/* flash_attn.h: FlashAttention-2 on tensor cores (kernels/cuda/flash_attn.cu): grouped-query attention,
 * causal or not, bf16 q, k, v, out, dout, dq, dk, dv, fp32 accumulation, softmax and lse; and a probe of
 * the warp matrix functions it is built on (tests of the emulator's WMMA model). Device pointers,
 * contiguous; the caller (core/flash_attention.c) validates shapes, dtypes and alignment.
 *
 * Shapes: q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T) f32; query head h
 * reads kv head h / (Hq / Hkv). D is 64 or 128 (nvl_cuda_flash_attn_supported says why not otherwise).
 * Backward: dq, dk, dv are WRITTEN (=); it needs the forward's out and lse. */
#ifndef NVL_CUDA_FLASH_ATTN_H
#define NVL_CUDA_FLASH_ATTN_H
#include <stdint.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NVL_OK if the kernels take head dim D, else NVL_EUNSUPPORTED naming fn and the reason (the caller falls
 * back to the fp32 attention of attention.cu). */
nvl_status nvl_cuda_flash_attn_supported(const char *fn, int64_t D);
/* The most dynamic shared memory one of its blocks takes (bytes; D = 128's backward): a GPU that allows
 * less per block cannot run it (device.cu refuses such GPUs at start-up). */
size_t nvl_cuda_flash_attn_smem(void);
/* out (B, T, Hq, D) bf16, lse (B, Hq, T) f32 = softmax(scale q k^T [causal mask]) v, its row logsumexp. */
nvl_status nvl_cuda_flash_attn_fwd(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                                   const uint16_t *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                   double scale, int causal);
/* dq, dk, dv (bf16) from dout, q, k, v, out (bf16) and lse; scratch: delta (B, Hq, T) f32. */
nvl_status nvl_cuda_flash_attn_bwd(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv, const uint16_t *dout,
                                   const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                   const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                   double scale, int causal);

/* Probe flags: operand layouts, and (emulator only) a broken WMMA rule to provoke. */
enum {
  NVL_WMMA_A_COL = 1,      /* a is read column major (the product uses a's memory transposed) */
  NVL_WMMA_B_COL = 2,      /* b likewise */
  NVL_WMMA_C_COL = 4,      /* c is loaded and d stored column major */
  NVL_WMMA_MISALIGNED = 8, /* a's pointer 16 bytes past a 32-byte boundary */
  NVL_WMMA_BAD_LDM = 16,   /* ldm 12 for a (not a multiple of 8) */
  NVL_WMMA_DIVERGE = 32,   /* lane 31 exits before mma_sync */
  NVL_WMMA_LANE_PTR = 64,  /* odd lanes pass b's pointer for a */
  NVL_WMMA_PARTIAL = 128,  /* a block of 48 threads: the second warp has 16 lanes */
  NVL_WMMA_FLAGS_ALL = 255
};
/* d (16, 16) f32 = A B + C by one warp's wmma::mma_sync, A and B bf16 (16, 16) memory, C f32 (16, 16). */
nvl_status nvl_cuda_wmma_probe(nvl_kctx *ctx, float *d, const uint16_t *a, const uint16_t *b, const float *c,
                               int flags);

#ifdef __cplusplus
}
#endif
#endif
