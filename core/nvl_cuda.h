/* nvl_cuda.h: what core/ asks of the CUDA backend (the .cu files in kernels/cuda/, or
 * kernels/cuda/stub.c when nvlua is built without nvcc). Every call reports failures as an
 * nvl_status naming the CUDA or cuBLASLt call; nothing aborts. With no GPU or no driver,
 * device_count gives 0 and allocation fails with a clear message.
 *
 * Streams and synchronisation: all work goes to the legacy default stream of the device, in call
 * order, so memory freed to the caching allocator may be handed to the next kernel without a
 * wait (stream order). In "sync mode" (the default; nvl_cuda_set_sync, env NVLUA_CUDA_SYNC=0
 * turns it off) every launch is followed by a stream synchronisation, so an asynchronous fault is
 * reported by the call that caused it; with it off, launches only check the launch itself and a
 * fault surfaces at the next synchronising call (a device->host copy, nvl_cuda_synchronize).
 *
 * Not here: tensors (core/ builds them around these pointers), Lua. */
#ifndef NVL_CUDA_H
#define NVL_CUDA_H
#include "nvl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices -------------------------------------------------------------------------------- */

/* 1 if the CUDA backend was compiled in. */
int nvl_cuda_compiled(void);
/* Number of usable GPUs (0 with no driver or no device; never an error). */
int nvl_cuda_device_count(void);
/* Why device_count is 0 ("" if it is not), for nvlua -v. */
const char *nvl_cuda_unavailable_reason(void);
typedef struct {
  char name[256];
  size_t total_mem;
  int major, minor;
  int multiprocessors;
} nvl_cuda_props;
nvl_status nvl_cuda_device_props(int dev, nvl_cuda_props *p);
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
typedef struct {
  size_t allocated;      /* bytes handed out and not freed (requested sizes) */
  size_t peak_allocated; /* the largest `allocated` seen */
  size_t reserved;       /* bytes held from cudaMalloc (in use + cached) */
  size_t cached;         /* bytes of free blocks kept for reuse */
  int64_t blocks;        /* live blocks */
  int64_t device_mallocs;/* cudaMalloc calls made so far */
  size_t device_free, device_total; /* cudaMemGetInfo (0, 0 if it failed) */
} nvl_cuda_mem_stats;
nvl_status nvl_cuda_memory_stats(int dev, nvl_cuda_mem_stats *s);
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
 * n == 0 (synchronising). */
nvl_status nvl_cuda_amax(double *out, const void *x, int x_bf16, int64_t n, int dev);

/* ---- quantization (NUMERICS.md; kernels/cuda/quant.cu) -------------------------------------- *
 * The input x is contiguous f32 or bf16 on the device, seen as (B, Kx, C) with the blocked dim in
 * the middle: the blocked layout (rows = B*C, K = Kx) has row r = b*C + c and its element k at
 * x[(b*K + k)*C + c]. Blocking the last dim is C = 1; the column-wise copy of a 2-D (R, C) x is
 * B = 1, K = R. Every output is in the blocked layout, row-major, exactly as the CPU quantizers
 * (core/quant.c) lay it out, and bit for bit their values (tests/test_cuda_quant.lua). */

typedef enum {
  NVL_CQ_VALUES = 0, /* f32 / bf16: the (RHT'd) values themselves, in the blocked layout */
  NVL_CQ_FP8 = 1,    /* per-tensor fp8 (current scaling, or delayed with a given amax) */
  NVL_CQ_MXFP8 = 2,  /* 1x32 blocks, e8m0 scales */
  NVL_CQ_NVFP4 = 3,  /* 1x16 (or 16x16) blocks, ue4m3 scales, fp32 amax */
  NVL_CQ_KIND_COUNT
} nvl_cuda_qkind;

typedef struct {
  /* input */
  const void *x;       /* contiguous (B, K, C) f32 or bf16 */
  int x_bf16;          /* 1: x is bf16 */
  int64_t B, K, C;
  /* what to make */
  int kind;            /* nvl_cuda_qkind */
  int values_bf16;     /* NVL_CQ_VALUES: 1 for bf16 output, 0 for f32 */
  int elem;            /* NVL_CQ_FP8 / NVL_CQ_MXFP8: nvl_fp8_elem (0 e4m3, 1 e5m2) */
  int rule;            /* NVL_CQ_MXFP8: nvl_mx_rule (0 rceil, 1 floor) */
  int block2d;         /* NVL_CQ_NVFP4: 16x16 tiles (rows % 16 == 0) */
  int rht;             /* apply the 16-point RHT along K first (K % 16 == 0) */
  float signs[16];     /* its signs (+-1) */
  int sr;              /* NVL_CQ_NVFP4: stochastic rounding of the elements */
  uint64_t seed, offset; /* SR Philox key and call counter */
  int64_t sr_row_offset, sr_k_offset, sr_k_total; /* SR slab of a larger tensor (formats_ref.h
                          nvl_nvfp4_ref_opts): block (r, kb) draws counter g = (sr_row_offset + r) *
                          (kt/16) + sr_k_offset/16 + kb, kt = sr_k_total or K; all 0: r*(K/16) + kb */
  int has_amax;        /* 1: use amax below (delayed scaling); 0: max |x| (after the RHT) */
  float amax;
  /* outputs, device memory */
  void *codes;         /* VALUES: (rows, K) f32/bf16; FP8/MXFP8: (rows, K) u8; NVFP4: (rows, K/2) packed */
  uint8_t *scales;     /* MXFP8 (rows, K/32) / NVFP4 (rows, K/16) scale bytes, row-major; else NULL */
  uint8_t *scales_swz; /* the same bytes in cuBLASLt's 128x4 swizzled layout (nvl_cuda_swizzled_bytes),
                          padding zeroed; NULL: not written */
} nvl_cuda_quant_desc;

/* Bytes of the 128x4 swizzled scale layout for `rows` rows of `nb` block scales:
 * ceil(rows/128)*128 * ceil(nb/4)*4. Scale (r, j) sits at byte
 *   ((r/128) * ceil(nb/4) + j/4) * 512 + (r%32) * 16 + ((r%128)/32) * 4 + j%4
 * (cuBLAS "1D block scaling factors layout": 128x4 tiles of 512 contiguous bytes, tiles in
 * row-major order, each tile stored as 32 lines of 16 bytes, line r%32 holding the 4 scales of
 * rows r%32, r%32+32, r%32+64, r%32+96). Padding rows and columns must read as zero. */
size_t nvl_cuda_swizzled_bytes(int64_t rows, int64_t nb);
/* Run one quantization. *amax_out (host, may be NULL) receives the amax used (the given one,
 * or max |x| after the RHT, read back from the device: a synchronising copy). */
nvl_status nvl_cuda_quantize(const nvl_cuda_quant_desc *d, float *amax_out, int dev);
/* The row-wise (C = 1, blocked along the last dim) and column-wise (B = 1, blocked along dim 0)
 * quantizations of one 2-D x (R, C) from a single read of x when the shape allows (R and C
 * multiples of the format's block, and of 16 for the RHT), else from two launches. row and col
 * describe the same x and format; each gets its own options (seed/offset, amax). Bit for bit
 * what two nvl_cuda_quantize calls give. */
nvl_status nvl_cuda_quantize_pair(const nvl_cuda_quant_desc *row, const nvl_cuda_quant_desc *col,
                                  float *amax_row, float *amax_col, int dev);

/* ---- GEMM (kernels/cuda/gemm.cu) ------------------------------------------------------------ *
 * out[M, N] = alpha_a * alpha_b * sum_k A[m, k] B[n, k] (fp32 accumulation), A and B in their
 * blocked layouts (rows, K) row-major, as nvl_qmatmul defines it (core/quant.h). */

typedef struct {
  int format;                /* nvl_dtype: f32, bf16, e4m3, e5m2, mxfp8_e4m3, mxfp8_e5m2, nvfp4 */
  const void *data;          /* (rows, K): values / codes; nvfp4 (rows, K/2) packed */
  const uint8_t *scales;     /* block scales (rows, K/block) row-major, or NULL */
  const uint8_t *scales_swz; /* the same, 128x4 swizzled (needed by the native block-scaled GEMMs) */
  int64_t rows;
  float alpha;               /* the operand's global decode factor (1 / fp8 scale, nvfp4 s_dec, or 1) */
} nvl_cuda_gemm_operand;

typedef enum {
  NVL_GEMM_UNSUPPORTED = 0,
  NVL_GEMM_NATIVE = 1,   /* one cuBLASLt GEMM on the formats themselves */
  NVL_GEMM_EMULATED = 2, /* exact dequantization to bf16, a bf16 cuBLASLt GEMM, alphas applied after */
} nvl_gemm_path;
/* Which path a pair of formats takes on dev; detail (may be NULL) receives a description, or
 * why the pair is unsupported (then NVL_GEMM_UNSUPPORTED and nvl_error is set too). */
nvl_gemm_path nvl_cuda_gemm_path(int format_a, int format_b, int dev, char *detail, size_t n);
/* out (M, N) row-major, f32 (out_bf16 = 0) or bf16; accumulate (f32 only): out += the product
 * (beta = 1 in cuBLASLt's epilogue). */
nvl_status nvl_cuda_qgemm(void *out, int out_bf16, int accumulate, const nvl_cuda_gemm_operand *a,
                          const nvl_cuda_gemm_operand *b, int64_t K, int dev);

/* ---- layers (kernels/cuda/layers.cu; the contracts of core/layers.h) ------------------------ *
 * Device pointers, contiguous f32 unless said; shapes validated and ids/targets range-checked by
 * the caller (core/layers.c). Parameter gradients accumulate (+=), everything else is written. */

/* out (N, C) = weight[ids[n], :]; ids (N) i64. */
nvl_status nvl_cuda_embedding_forward(float *out, const int64_t *ids, const float *weight, int64_t N, int64_t C,
                                      int dev);
/* dweight (V, C) += dout (N, C) scattered by ids (N) (atomicAdd). */
nvl_status nvl_cuda_embedding_backward(float *dweight, const float *dout, const int64_t *ids, int64_t N, int64_t C,
                                       int dev);
/* out (N, C), rstd (N) from x (N, C), weight (C). */
nvl_status nvl_cuda_rmsnorm_forward(float *out, float *rstd, const float *x, const float *weight, int64_t N, int64_t C,
                                    double eps, int dev);
/* dx (N, C) =, dweight (C) +=. */
nvl_status nvl_cuda_rmsnorm_backward(float *dx, float *dweight, const float *dout, const float *x, const float *weight,
                                     const float *rstd, int64_t N, int64_t C, int dev);
/* out (B, T, H, D) = rope(x) with cos, sin (T, D); backward: dx = the transposed rotation of dout. */
nvl_status nvl_cuda_rope_forward(float *out, const float *x, const float *cos_t, const float *sin_t, int64_t B,
                                 int64_t T, int64_t H, int64_t D, int dev);
nvl_status nvl_cuda_rope_backward(float *dx, const float *dout, const float *cos_t, const float *sin_t, int64_t B,
                                  int64_t T, int64_t H, int64_t D, int dev);
/* out (n) = silu(gate) * up; backward: dgate, dup (n) =. */
nvl_status nvl_cuda_swiglu_forward(float *out, const float *gate, const float *up, int64_t n, int dev);
nvl_status nvl_cuda_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                    int64_t n, int dev);
/* *total (host) = sum over counted rows of lse - logit[target] + z_loss lse^2 (layers_ref.h
 * nvl_cross_entropy_ref); logits (N, V) f32 or bf16 (logits_bf16), targets (N) i64; dlogits
 * (N, V) f32 or NULL. Reads back N doubles (synchronising). */
nvl_status nvl_cuda_cross_entropy(double *total, float *dlogits, const void *logits, int logits_bf16,
                                  const int64_t *targets, int64_t N, int64_t V, int64_t ignore_index, double z_loss,
                                  double grad_scale, int dev);
/* One fused AdamW step over n f32 elements, in place (layers.h nvl_adamw_step, bit for bit). */
nvl_status nvl_cuda_adamw_step(float *param, const float *grad, float *m, float *v, int64_t n, double lr, double beta1,
                               double beta2, double eps, double weight_decay, int64_t step, int dev);
/* *out (host) = sum of x^2 over n f32 or bf16 (x_bf16) elements, fp64 accumulation (synchronising). */
nvl_status nvl_cuda_sumsq(double *out, const void *x, int x_bf16, int64_t n, int dev);

/* ---- attention (kernels/cuda/attention.cu) ------------------------------------------------- *
 * Causal grouped-query attention, tiled with an online softmax (never the T x T matrix), fp32:
 * q, out, dq, dout (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T); 1 <= D <= 256.
 * Outputs and dq, dk, dv are written (=). */
nvl_status nvl_cuda_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                                      int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale, int dev);
nvl_status nvl_cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                       const float *k, const float *v, const float *out, const float *lse, int64_t B,
                                       int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale, int dev);

#ifdef __cplusplus
}
#endif
#endif
