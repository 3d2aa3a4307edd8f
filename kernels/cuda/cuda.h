/* cuda.h: the CUDA backend's own functions (the .cu files of kernels/cuda), private to kernels/cuda: the
 * device API and the entries that kernels/cuda/backend_cuda.c puts in the CUDA table
 * (core/backend.h), plus the raw kernels its adapters call. core/ never calls these directly.
 * Every call reports failures as an nvl_status naming the CUDA or cuBLASLt call; nothing aborts.
 * With no GPU or no driver, device_count gives 0 and allocation fails with a clear message.
 *
 * Streams and synchronisation: all work goes to the legacy default stream of the device, in call
 * order, so memory freed to the caching allocator may be handed to the next kernel without a
 * wait (stream order). By default launches only check the launch itself, the host runs ahead,
 * and an asynchronous fault surfaces at the next synchronising call (a device->host copy,
 * nvl_cuda_synchronize). "Sync mode" (for debugging: nvl_cuda_set_sync, env NVLUA_CUDA_SYNC=1)
 * follows every launch with a stream synchronisation, so a fault is reported by the call that
 * caused it.
 *
 * Scratch: entries that need device memory beyond their outputs take it from the caller through
 * nvl_kctx.scratch (call scratch, released by stream order after the call).
 *
 * Not here: tensors (core/ builds them around these pointers), Lua. */
#ifndef NVL_CUDA_BACKEND_H
#define NVL_CUDA_BACKEND_H
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices -------------------------------------------------------------------------------- */

/* Number of usable GPUs (0 with no driver or no device; never an error). */
int nvl_cuda_device_count(void);
/* Why device_count is 0 ("" if it is not), for nvlua -v. */
const char *nvl_cuda_unavailable_reason(void);
nvl_status nvl_cuda_device_props(int dev, nvl_device_props *p);
/* Runtime and cuBLASLt versions (0 when not compiled in). */
int nvl_cuda_runtime_version(void);
size_t nvl_cuda_blaslt_version(void);

/* Sync mode (see the header comment): on = 1, off = 0. Returns the previous setting. */
int nvl_cuda_set_sync(int on);
/* Wait for all work queued on dev; reports any asynchronous fault. */
nvl_status nvl_cuda_synchronize(int dev);

/* ---- memory: a caching allocator per device ------------------------------------------------ *
 * Freed blocks are kept on a per-device free list by size class and handed out again for an
 * allocation of the same class (sizes rounded up to 512 B below 1 MiB, to 128 KiB up to 64 MiB,
 * to 2 MiB above); on cudaMalloc running out of memory the device's cache is given back and the
 * allocation tried once more. Blocks are whole cudaMalloc allocations (256-byte aligned). */

nvl_status nvl_cuda_malloc(void **p, size_t bytes, int dev);
void nvl_cuda_free(void *p, int dev);
nvl_status nvl_cuda_memory_stats(int dev, nvl_device_mem_stats *s);
/* Give dev's cached blocks back (dev < 0: every device). Waits for the device first. */
void nvl_cuda_empty_cache(int dev);
/* Poisoning for tests: byte >= 0 fills every block the allocator hands out with that byte
 * (stream-ordered memset), so a kernel that leaves an output element unwritten is seen; -1 off.
 * Returns the previous setting. */
int nvl_cuda_set_poison(int byte);

/* kind: 0 host->device, 1 device->host, 2 device->device. host->device and device->host are
 * synchronous; device->device is stream-ordered (synchronous in sync mode). */
nvl_status nvl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int dev);
/* Stream-ordered memset of bytes at p to the byte v. */
nvl_status nvl_cuda_memset(void *p, int v, size_t bytes, int dev);

/* Device timing with events on the default stream: start, then stop gives the milliseconds. */
nvl_status nvl_cuda_timer_start(int dev);
nvl_status nvl_cuda_timer_stop(int dev, double *ms);

/* ---- elementwise ---------------------------------------------------------------------------- */

/* out[i] = a[i] op b[i] over n contiguous f32 (op: nvl_binary_op ADD..DIV). */
nvl_status nvl_cuda_binary_f32(int op, float *out, const float *a, const float *b, int64_t n, int dev);
/* out = a + b (sub: a - b) over n contiguous bf16: the f32 sum rounded once (the CPU's bf16 add). */
nvl_status nvl_cuda_add_bf16(int sub, uint16_t *out, const uint16_t *a, const uint16_t *b, int64_t n, int dev);

/* ---- tensor ops (kernels/cuda/ops.cu), bit-identical to the CPU's ---------------------------- */

/* dst[i] = src[i] over an ndim view of shape, strides in elements (a 0 stride repeats an
 * element); dtypes equal (any), or f32 <-> bf16 (RNE). dst and src must not overlap. */
nvl_status nvl_cuda_copy_strided(void *dst, int dst_dtype, const int64_t *dst_strides, const void *src,
                                 int src_dtype, const int64_t *src_strides, int ndim, const int64_t *shape, int dev);
/* p[0..n) = *value (one element of dtype, as its bytes), contiguous. */
nvl_status nvl_cuda_fill(void *p, int dtype, const void *value, int64_t n, int dev);
/* y += alpha * x over n contiguous f32 (nvl_axpy_f32_cpu's operations). */
nvl_status nvl_cuda_axpy_f32(float *y, const float *x, float alpha, int64_t n, int dev);
/* p *= s over n contiguous f32 (nvl_binary_scalar_f32_cpu's MUL). */
nvl_status nvl_cuda_scale_f32(float *p, double s, int64_t n, int dev);
/* *out (host) = max |x| over n contiguous f32 or bf16 (x_bf16) elements; NaN if any is NaN; 0 if
 * n == 0 (synchronising; the max word is call scratch). */
nvl_status nvl_cuda_amax(nvl_kctx *ctx, double *out, const void *x, int x_bf16, int64_t n);

/* ---- quantization (core/NUMERICS.md; kernels/cuda/quant.cu) ---------------------------------- *
 * The quantize and quantize_pair entries (nvl_qdesc, core/backend.h): x (B, K, C) contiguous f32
 * or bf16 on the device, outputs in the blocked layout, block scales row-major and swizzled. */

nvl_status nvl_cuda_quantize(nvl_kctx *ctx, const nvl_qdesc *d);
/* The row-wise (C = 1) and column-wise (B = 1) quantizations of one 2-D x (R, C) from a single
 * read of x when the shape allows (R and C multiples of the block, and of 16 for the RHT), else
 * two launches; bit for bit what two nvl_cuda_quantize calls give. */
nvl_status nvl_cuda_quantize_pair(nvl_kctx *ctx, const nvl_qdesc *row, const nvl_qdesc *col);

/* The rht, swizzle_scales and transpose_tiles entries (core/backend.h), queued on stream 0. */
nvl_status nvl_cuda_rht(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs,
                        int inverse);
nvl_status nvl_cuda_swizzle_scales(nvl_kctx *ctx, uint8_t *swz, const uint8_t *scales, int64_t rows, int64_t nb);
nvl_status nvl_cuda_transpose_tiles(nvl_kctx *ctx, uint8_t *codes_t, uint8_t *scales_t, const uint8_t *codes,
                                    const uint8_t *scales, int64_t R, int64_t K);

/* The gam_quantize entry (core/backend.h; gam.cu), bit for bit nvl_gam_quantize_ref, queued on stream 0. */
nvl_status nvl_cuda_gam_quantize(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant, const float *x,
                                 int64_t rows, int64_t K, int64_t block, int64_t group_blocks, nvl_elem elem);

/* quant.cu's kernels take this description (built from an nvl_qdesc by quant.cu itself). */
typedef enum {
  NVL_CQ_VALUES = 0, /* f32 / bf16: the (RHT'd) values themselves, in the blocked layout */
  NVL_CQ_FP8 = 1,    /* per-tensor fp8 (current scaling, or delayed with a given amax) */
  NVL_CQ_MX = 2,     /* 1x32 blocks, e8m0 scales, e4m3 / e5m2 / e2m1 elements */
  NVL_CQ_NVFP4 = 3,  /* 1x16 (or 16x16) blocks, ue4m3 scales, fp32 amax */
  NVL_CQ_KIND_COUNT
} nvl_cuda_qkind;

typedef struct {
  const void *x;       /* contiguous (B, K, C) f32 or bf16 */
  int x_bf16;
  int64_t B, K, C;
  int kind;            /* nvl_cuda_qkind */
  int values_bf16;     /* NVL_CQ_VALUES: 1 for bf16 output, 0 for f32 */
  int elem;            /* nvl_elem: 0 e4m3, 1 e5m2, 2 e2m1 (mx) */
  int rule;            /* nvl_mx_rule */
  int block2d, rht;
  float signs[16];
  int sr;
  uint64_t seed, offset;
  int64_t sr_row_offset, sr_k_offset, sr_k_total;
  int has_amax;
  float amax;
  uint32_t *amax_dev_out;      /* device word receiving the amax (float bits), or NULL */
  const uint32_t *amax_dev_in; /* device amax to use (float bits), or NULL */
  int amax_only;               /* only the amax into amax_dev_out */
  void *codes;
  uint8_t *scales, *scales_swz;
} nvl_cuda_quant_desc;

/* ---- GEMM (kernels/cuda/gemm.cu) ------------------------------------------------------------ */

/* Which path a pair of formats takes on dev (gemm_path of the device API). */
nvl_gemm_path nvl_cuda_gemm_path(nvl_dtype format_a, nvl_dtype format_b, int dev, char *detail, size_t n);
/* The qgemm entry: out = alpha_a alpha_b A B^T through cuBLASLt, natively or by exact emulation. */
nvl_status nvl_cuda_qgemm(nvl_kctx *ctx, const nvl_gemm_desc *g);
nvl_status nvl_cuda_dequantize(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled);

/* ---- layers and attention (kernels/cuda/layers.cu, attention.cu) ------------------------------ *
 * The entries of core/backend.h with those signatures: device pointers, contiguous f32 unless said;
 * shapes validated and ids/targets range-checked by core/layers.c. Attention: tiled with an online
 * softmax (never the T x T matrix), fp32, 1 <= D <= 256. */
nvl_status nvl_cuda_embedding_forward(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N,
                                      int64_t C);
nvl_status nvl_cuda_embedding_backward(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                       int64_t C);
nvl_status nvl_cuda_rmsnorm_forward(nvl_kctx *ctx, float *out, float *rstd, const float *x, const float *weight,
                                    int64_t N, int64_t C, double eps);
nvl_status nvl_cuda_rmsnorm_backward(nvl_kctx *ctx, float *dx, float *dweight, const float *dout, const float *x,
                                     const float *weight, const float *rstd, int64_t N, int64_t C);
nvl_status nvl_cuda_rope_forward(nvl_kctx *ctx, float *out, const float *x, const float *cos_t, const float *sin_t,
                                 int64_t B, int64_t T, int64_t H, int64_t D);
nvl_status nvl_cuda_rope_backward(nvl_kctx *ctx, float *dx, const float *dout, const float *cos_t, const float *sin_t,
                                  int64_t B, int64_t T, int64_t H, int64_t D);
nvl_status nvl_cuda_swiglu_forward(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n);
nvl_status nvl_cuda_swiglu_backward(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                                    const float *up, int64_t n);
/* SwiGLU, RMSNorm, RoPE on bf16 activations: loaded widened, each output rounded once (the f32
 * kernels' bits); rstd, dweight, cos, sin f32 */
nvl_status nvl_cuda_swiglu_forward_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate, const uint16_t *up,
                                        int64_t n);
nvl_status nvl_cuda_swiglu_backward_bf16(nvl_kctx *ctx, uint16_t *dgate, uint16_t *dup, const uint16_t *dout,
                                         const uint16_t *gate, const uint16_t *up, int64_t n);
nvl_status nvl_cuda_rmsnorm_forward_bf16(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x,
                                         const float *weight, int64_t N, int64_t C, double eps);
nvl_status nvl_cuda_rmsnorm_backward_bf16(nvl_kctx *ctx, uint16_t *dx, float *dweight, const uint16_t *dout,
                                          const uint16_t *x, const float *weight, const float *rstd, int64_t N,
                                          int64_t C);
nvl_status nvl_cuda_rope_forward_bf16(nvl_kctx *ctx, uint16_t *out, const uint16_t *x, const float *cos_t,
                                      const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t D);
nvl_status nvl_cuda_rope_backward_bf16(nvl_kctx *ctx, uint16_t *dx, const uint16_t *dout, const float *cos_t,
                                       const float *sin_t, int64_t B, int64_t T, int64_t H, int64_t D);
nvl_status nvl_cuda_cross_entropy(nvl_kctx *ctx, double *total, int total_on_device, float *dlogits, const void *logits,
                                  nvl_dtype logits_dtype, const int64_t *targets, int64_t N, int64_t V,
                                  int64_t ignore_index, double z_loss, double grad_scale);
nvl_status nvl_cuda_cross_entropy_bf16grad(nvl_kctx *ctx, double *total, int total_on_device, uint16_t *dlogits,
                                           const void *logits, nvl_dtype logits_dtype, const int64_t *targets,
                                           int64_t N, int64_t V, int64_t ignore_index, double z_loss,
                                           double grad_scale);
/* The bf16 RMSNorm / SwiGLU forwards that also leave max |out| in *amax (device; backend.h). */
nvl_status nvl_cuda_rmsnorm_forward_bf16_amax(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x,
                                              const float *weight, int64_t N, int64_t C, double eps, float *amax);
nvl_status nvl_cuda_swiglu_forward_bf16_amax(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate, const uint16_t *up,
                                             int64_t n, float *amax);
nvl_status nvl_cuda_amax_history(nvl_kctx *ctx, float *sel, float *hist, int64_t len, int64_t count, int64_t pos,
                                 const float *cur);
nvl_status nvl_cuda_adamw_step(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                               const nvl_adamw_opts *o);
nvl_status nvl_cuda_sumsq(nvl_kctx *ctx, double *out, const void *x, nvl_dtype x_dtype, int64_t n);
nvl_status nvl_cuda_distill(nvl_kctx *ctx, double *kl, double *ce, float *dlogits, const void *s, nvl_dtype s_dtype,
                            const void *t, nvl_dtype t_dtype, const int64_t *targets, int64_t N, int64_t V,
                            int64_t ignore_index, double T, double alpha, double grad_scale);
nvl_status nvl_cuda_block_sqerr(nvl_kctx *ctx, float *out, const float *a, const float *b, int64_t rows, int64_t K,
                                int64_t block);
/* multi_tensor.cu: the optimizer over many tensors (core/optim.h), one launch per 512 tensors */
nvl_status nvl_cuda_adamw_multi(nvl_kctx *ctx, const nvl_adamw_chunk *t, int64_t count, const nvl_adamw_opts *o,
                                const int64_t *state);
nvl_status nvl_cuda_grad_norm_multi(nvl_kctx *ctx, int64_t *state, const float *const *x, const int64_t *n,
                                    int64_t count, double max_norm, int take_nonfinite);
nvl_status nvl_cuda_grad_norm_combine(nvl_kctx *ctx, int64_t *state, const int64_t *parts, int64_t count,
                                      double max_norm);
/* backend.h nonfinite_take: the device's flag word to the host, cleared (multi_tensor.cu) */
nvl_status nvl_cuda_nonfinite_take(nvl_kctx *ctx, uint32_t *flags);
nvl_status nvl_cuda_attention_forward(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                      const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                      double scale);
/* the forward over a key/value cache: k, v (B, S, Hkv, D), queries at positions pos0 .. pos0 + T - 1 */
nvl_status nvl_cuda_attention_forward_at(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                         const float *v, int64_t B, int64_t T, int64_t S, int64_t pos0, int64_t Hq,
                                         int64_t Hkv, int64_t D, double scale);
nvl_status nvl_cuda_attention_backward(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout,
                                       const float *q, const float *k, const float *v, const float *out,
                                       const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                       double scale);

#ifdef __cplusplus
}
#endif
#endif
