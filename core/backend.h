/* backend.h: the one kernel table type (DESIGN.md "Dispatch"). core/ validates every call (live
 * tensors, devices, dtypes, shapes, ranges), allocates the outputs, picks one table — from the
 * tensor's device, or the scalar reference while nv.use_reference(true) is on — and makes one call.
 * An empty entry is a clean "<op>: not supported on <backend>" error; nothing else in core branches
 * on the device or the format.
 *
 * Three instances: nvl_backend_ref (kernels/cpu/ref: plain scalar code, the contract's readable
 * form), nvl_backend_cpu (kernels/cpu: OpenMP, SIMD, OpenBLAS; bit-identical to the reference
 * where quantization is concerned, within a stated tolerance for floating-point reductions) and
 * nvl_backend_cuda (kernels/cuda; present only in builds with nvcc: a build without CUDA simply has
 * no CUDA table).
 *
 * This is a shared header: kernels include it (and nvl.h, dtype.h, tensor.h, philox.h), nothing
 * else of core/. Kernels never allocate behind the caller's back: scratch memory comes from the
 * caller through nvl_kctx.scratch, on the op's device, and lives until the call returns.
 *
 * Adding a format: an enum value and a traits row (core/dtype.h, core/dtype.c), a reference codec if
 * its element is new, and one line in each table's `formats` that points at the drivers of its scale
 * kind (MXFP4 was exactly that: five files). Adding a layer op (say GELU): a field in
 * nvl_layer_kernels (here), its core entry (core/layers.h, core/layers.c: checks, outputs, one
 * NVL_PICK / NVL_CALL), the reference kernel with its line in nvl_layers_ref (kernels/cpu/ref/
 * layers_ref.c), and a binding line (lua/bind/layers.c): five files. It then runs on the CPU
 * through the fallback; a fast CPU or a CUDA kernel is one more file each (layers_cpu.c,
 * layers.cu + backend_cuda.c), and until then cuda says "gelu: not supported on cuda".
 *
 * Argument order in every entry: the context, outputs, inputs, weights, saved activations, dims.
 * Raw pointers are contiguous buffers on the backend's device (f32 unless said); tensor arguments
 * (the tensor ops) are views already checked and broadcast by core. Shapes as in core/layers.h. */
#ifndef NVL_BACKEND_H
#define NVL_BACKEND_H
#include "philox.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- op codes and parameters shared by core's API and the kernels ------------------------- */

typedef enum {
  NVL_OP_ADD = 0, NVL_OP_SUB = 1, NVL_OP_MUL = 2, NVL_OP_DIV = 3, NVL_OP_POW = 4,
  NVL_OP_MAXIMUM = 5, NVL_OP_MINIMUM = 6,
  /* comparisons: u8 results, 1 where true */
  NVL_OP_EQ = 7, NVL_OP_NE = 8, NVL_OP_LT = 9, NVL_OP_LE = 10, NVL_OP_GT = 11, NVL_OP_GE = 12,
  NVL_BINARY_COUNT
} nvl_binary_op;

typedef enum {
  NVL_OP_EXP = 0, NVL_OP_LOG = 1, NVL_OP_SQRT = 2, NVL_OP_ABS = 3, NVL_OP_NEG = 4,
  NVL_UNARY_COUNT
} nvl_unary_op;

typedef enum {
  NVL_RED_SUM = 0, NVL_RED_MEAN = 1, NVL_RED_MAX = 2, NVL_RED_MIN = 3, NVL_RED_AMAX = 4,
  NVL_REDUCE_COUNT
} nvl_reduce_op;

/* A scalar operand: Lua integers stay exact for integer tensors (i64 beyond 2^53). */
typedef struct {
  double f;    /* the value (rounded, for integers beyond 2^53) */
  int64_t i;   /* the exact value when is_int */
  int is_int;
} nvl_scalar;
static inline nvl_scalar nvl_scalar_f(double f) { nvl_scalar s = {f, 0, 0}; return s; }
static inline nvl_scalar nvl_scalar_i(int64_t i) { nvl_scalar s = {(double)i, i, 1}; return s; }

/* RoPE frequency scaling: the rope types of Hugging Face's modeling_rope_utils.py that nvlua
 * computes, each a change of inv_freq[i] = theta^(-2i/D) (i < D/2). Values are stable. */
typedef enum {
  NVL_ROPE_DEFAULT = 0, /* none */
  NVL_ROPE_LLAMA3 = 1,  /* Llama 3.1: low frequencies / factor, high ones kept, a smooth band between */
  NVL_ROPE_LINEAR = 2,  /* every frequency / factor (position interpolation) */
  NVL_ROPE_DYNAMIC = 3, /* dynamic NTK: theta * (factor * L / M - (factor - 1))^(D / (D - 2)), L = M */
  NVL_ROPE_KIND_COUNT
} nvl_rope_kind;

typedef struct {
  nvl_rope_kind kind;
  double factor;                           /* llama3 (8 for Llama 3.1), linear, dynamic */
  double low_freq_factor;                  /* llama3: 1 */
  double high_freq_factor;                 /* llama3: 4 */
  double original_max_position_embeddings; /* llama3: 8192 */
  double max_position_embeddings;          /* dynamic: M, the longest sequence it is computed for */
} nvl_rope_scaling;

typedef struct {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step; /* 1-based step number, for bias correction */
} nvl_adamw_opts;

/* One tensor of a multi-tensor AdamW step (core/optim.h): n contiguous f32 elements of each
 * buffer, on the backend's device; no_decay: this tensor's weight decay is 0 whatever the opts say. */
typedef struct {
  float *param;
  const float *grad;
  float *m, *v;
  int64_t n;
  int no_decay;
} nvl_adamw_chunk;

/* The gradient-norm state (core/optim.h), NVL_NORM_STATE i64 slots on the device, read as: */
enum { NVL_NORM_SUMSQ = 0, /* double: the sum of squares of every grad */
       NVL_NORM_CLIP = 1,  /* double: the clip factor max_norm / (norm + 1e-6), or exactly 1 */
       NVL_NORM_COUNT = 2, /* u32: blocks done (a kernel's own; 0 between calls) */
       NVL_NORM_NONFINITE = 3, /* u32: the device's non-finite flags, taken (read and cleared) by this norm */
       NVL_NORM_STATE = 4 };

/* The non-finite flags of a device (one word per device, the host's too): a kernel sets them as it
 * reads its data, without a pass of its own, and grad_norm_multi (or nonfinite_take) takes them.
 * - NVL_NONFINITE_INPUT: a quantization into a quantized format (fp8, mx, nvfp4; not bf16/f32
 *   values), or its amax pass, read a NaN or an infinity. Their codes cannot carry it (e2m1 has no
 *   NaN, every format saturates infinities) and amaxes ignore NaN (NUMERICS), so without the flag
 *   a NaN weight or activation would vanish into finite codes.
 * - NVL_NONFINITE_PARAM: AdamW read or wrote a non-finite parameter. */
enum { NVL_NONFINITE_INPUT = 1, NVL_NONFINITE_PARAM = 2 };

/* ---- the call context ----------------------------------------------------------------------- */

typedef struct nvl_kctx nvl_kctx;
struct nvl_kctx {
  int dev; /* device ordinal (0 on the host) */
  /* *p = bytes of scratch on the op's device, owned by the caller and valid until the entry
   * returns (on a GPU: until the work the entry queued has run, by stream order). */
  nvl_status (*scratch)(nvl_kctx *c, size_t bytes, void **p);
  void *owner; /* the caller's bookkeeping */
};

/* ---- quantization --------------------------------------------------------------------------- *
 * The blocked layout (core/quant.h): x moved so that its blocked dim is last, flattened to
 * (rows, K); codes and scales are row-major in it and block g = row * (K/block) + k/block. */

/* One quantization of x into format (dtype.h traits row). */
typedef struct {
  nvl_dtype format;
  /* input: contiguous x seen as (B, K, C), blocked along K: row r = b*C + c of the blocked layout
   * has its element k at x[(b*K + k)*C + c]; rows = B*C. f32 or bf16. */
  const void *x;
  nvl_dtype x_dtype;
  int64_t B, K, C;
  /* options, validated by core against the traits row */
  int block2d;             /* 16x16 tiles (rows % 16 == 0) */
  int rht;                 /* the 16-point RHT along K first (NUMERICS §5) */
  float signs[16];         /* its signs */
  nvl_mx_rule rule;        /* e8m0 scale rule */
  int sr;                  /* stochastic rounding of the elements (NUMERICS §3) */
  uint64_t seed, offset;   /* its Philox key and call counter */
  int64_t sr_row_offset, sr_k_offset, sr_k_total; /* SR draws of a slab of a larger tensor */
  int has_amax;            /* 1: scale by amax below, not max |x| */
  float amax;
  /* outputs, on the backend's device, in the blocked layout */
  void *codes;             /* (rows, K) values (f32/bf16 formats) or codes; 4-bit: (rows, K/2) packed */
  uint8_t *scales;         /* (rows, K/block) block scales, or NULL */
  uint8_t *scales_swz;     /* the same in cuBLASLt's 128x4 swizzled layout, or NULL (see swizzled_scales) */
  float *amax_out;         /* host: the amax used (max |x| after the RHT, or the one given) */
  /* devices only: the amax word in device memory to write the amax used into (then amax_out is
   * NULL: nothing is read back), and the device amax to use instead of max |x| (then has_amax is
   * 0 and amax_dev_out NULL: the result shares it) */
  float *amax_dev_out;
  const float *amax_dev_in;
  int amax_only;           /* devices: only the amax into amax_dev_out (no codes written) */
} nvl_qdesc;

/* A quantized tensor as the kernels read it (core/quant.h nvl_qtensor, blocked layout). */
typedef struct {
  nvl_dtype format;
  const void *codes;          /* as nvl_qdesc.codes */
  const uint8_t *scales;      /* (rows, K/block) or NULL */
  const uint8_t *scales_swz;  /* swizzled copy or NULL */
  int64_t rows, K;
  float amax, scale;          /* the amax used, and q.scale (traits enc_scale of it) */
  float alpha;                /* the global decode factor (traits dec_scale; 1 without one) */
  const float *amax_dev;      /* device: non-NULL when the amax is known there only (amax, scale and
                                 alpha above are NaN): the GEMM derives alpha on the device */
} nvl_qview;

/* out (M, N) = alpha_a * alpha_b * sum_k A[m,k] B[n,k], A = a (M = a.rows), B = b (N = b.rows),
 * both read in their blocked layouts, fp32 accumulation (core/NUMERICS.md §7). */
typedef struct {
  void *out;           /* (M, N) row-major, f32 or bf16 */
  nvl_dtype out_dtype; /* f32 or bf16 */
  int accumulate;      /* f32 only: out += the product (bit for bit the product, then an add) */
  const nvl_qview *a, *b;
} nvl_gemm_desc;

typedef struct {
  /* x -> codes, scales, *amax_out, per d. */
  nvl_status (*quantize)(nvl_kctx *ctx, const nvl_qdesc *d);
  /* y (nr, K) = rows [r0, r0 + nr) of q decoded: value * block scale, times the global factor
   * unless unscaled (then every value is exact in fp32: what a GEMM multiplies). */
  nvl_status (*dequantize)(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled);
  /* the GEMM on operands whose A has this format (B's row must have a qgemm too) */
  nvl_status (*qgemm)(nvl_kctx *ctx, const nvl_gemm_desc *g);
} nvl_format_kernels;

/* ---- devices ---------------------------------------------------------------------------------- */

typedef struct {
  char name[256];
  size_t total_mem;
  int major, minor;
  int multiprocessors;
  char pci_bus_id[24]; /* "00000000:1B:00.0", as nvidia-smi prints it: the physical GPU */
} nvl_device_props;

typedef struct {
  size_t allocated;      /* bytes handed out and not freed (requested sizes) */
  size_t peak_allocated; /* the largest `allocated` seen */
  size_t reserved;       /* bytes held from the driver (in use + cached) */
  size_t cached;         /* bytes of free blocks kept for reuse */
  int64_t blocks;        /* live blocks */
  int64_t device_mallocs;/* driver allocations made so far */
  size_t device_free, device_total; /* the driver's view (0, 0 if unknown) */
} nvl_device_mem_stats;

typedef enum {
  NVL_GEMM_UNSUPPORTED = 0,
  NVL_GEMM_NATIVE = 1,   /* one library GEMM on the formats themselves */
  NVL_GEMM_EMULATED = 2, /* exact dequantization to a wider type, a GEMM, global factors applied after */
} nvl_gemm_path;

/* A device other than the host (the host's memory is core's). */
typedef struct {
  int (*count)(void);                              /* usable devices (0 without a driver; never an error) */
  const char *(*unavailable_reason)(void);         /* why count is 0 ("" if it is not) */
  nvl_status (*props)(int dev, nvl_device_props *p);
  int (*runtime_version)(void);                    /* 1000 major + 10 minor */
  size_t (*blas_version)(void);
  nvl_status (*alloc)(void **p, size_t bytes, int dev);
  void (*free)(void *p, int dev);                  /* stream-ordered */
  /* kind: 0 host->device, 1 device->host, 2 device->device */
  nvl_status (*memcpy)(void *dst, const void *src, size_t bytes, int kind, int dev);
  nvl_status (*memset)(void *p, int v, size_t bytes, int dev);
  nvl_status (*synchronize)(int dev);
  int (*set_sync)(int on);                         /* synchronise after every launch; returns the previous */
  nvl_status (*memory_stats)(int dev, nvl_device_mem_stats *s);
  void (*empty_cache)(int dev);                    /* dev < 0: every device */
  int (*set_poison)(int byte);                     /* fill new blocks with byte (>= 0) or not (-1) */
  nvl_status (*timer_start)(int dev);
  nvl_status (*timer_stop)(int dev, double *ms);
  /* which path out = A . B^T takes for these formats; detail gets a description, or why not */
  nvl_gemm_path (*gemm_path)(nvl_dtype a, nvl_dtype b, int dev, char *detail, size_t n);
} nvl_device_api;

/* Bytes of cuBLASLt's 128x4 swizzled layout for rows x nb block scales: ceil(rows/128)*128 *
 * ceil(nb/4)*4. Scale (r, j) sits at byte ((r/128) * ceil(nb/4) + j/4) * 512 + (r%32) * 16 +
 * ((r%128)/32) * 4 + j%4; padding reads as zero. */
static inline size_t nvl_swizzled_bytes(int64_t rows, int64_t nb) {
  if (rows <= 0 || nb <= 0) return 0;
  return (size_t)((rows + 127) / 128 * 128) * (size_t)((nb + 3) / 4 * 4);
}

/* The layer library's kernels (core/layers.h): parameter gradients +=, everything else =. Each
 * backend defines its instance next to its kernels (kernels/cpu/ref/layers_ref.c, ...), so a new op
 * is a field here and lines in the files that implement it. */
typedef struct nvl_layer_kernels {
  nvl_status (*embedding_forward)(nvl_kctx *ctx, float *out, const int64_t *ids, const float *weight, int64_t N,
                                  int64_t C);
  nvl_status (*embedding_backward)(nvl_kctx *ctx, float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                   int64_t C);
  nvl_status (*rmsnorm_forward)(nvl_kctx *ctx, float *out, float *rstd, const float *x, const float *weight, int64_t N,
                                int64_t C, double eps);
  nvl_status (*rmsnorm_backward)(nvl_kctx *ctx, float *dx, float *dweight, const float *dout, const float *x,
                                 const float *weight, const float *rstd, int64_t N, int64_t C);
  /* host tables: cos, sin (T, D) */
  nvl_status (*rope_tables)(nvl_kctx *ctx, float *cos, float *sin, int64_t T, int64_t D, double theta,
                            const nvl_rope_scaling *s);
  nvl_status (*rope_forward)(nvl_kctx *ctx, float *out, const float *x, const float *cos, const float *sin, int64_t B,
                             int64_t T, int64_t H, int64_t D);
  nvl_status (*rope_backward)(nvl_kctx *ctx, float *dx, const float *dout, const float *cos, const float *sin,
                              int64_t B, int64_t T, int64_t H, int64_t D);
  nvl_status (*swiglu_forward)(nvl_kctx *ctx, float *out, const float *gate, const float *up, int64_t n);
  nvl_status (*swiglu_backward)(nvl_kctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                                const float *up, int64_t n);
  /* optional, bf16 activations natively (these and the two RMSNorm entries below): exactly the f32
   * entry on the widened inputs with each activation output rounded once to bf16 (RNE), statistics
   * and parameter gradients as the f32 entry's; NULL: core widens, runs the f32 entry, rounds
   * (core/act.h). Not taken from the fallback: the bits must be this table's f32 entry's. */
  nvl_status (*swiglu_forward_bf16)(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t n);
  nvl_status (*rope_forward_bf16)(nvl_kctx *ctx, uint16_t *out, const uint16_t *x, const float *cos,
                                  const float *sin, int64_t B, int64_t T, int64_t H, int64_t D);
  nvl_status (*rope_backward_bf16)(nvl_kctx *ctx, uint16_t *dx, const uint16_t *dout, const float *cos,
                                   const float *sin, int64_t B, int64_t T, int64_t H, int64_t D);
  nvl_status (*rmsnorm_forward_bf16)(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x, const float *weight,
                                     int64_t N, int64_t C, double eps);
  nvl_status (*rmsnorm_backward_bf16)(nvl_kctx *ctx, uint16_t *dx, float *dweight, const uint16_t *dout,
                                      const uint16_t *x, const float *weight, const float *rstd, int64_t N, int64_t C);
  nvl_status (*swiglu_backward_bf16)(nvl_kctx *ctx, uint16_t *dgate, uint16_t *dup, const uint16_t *dout,
                                     const uint16_t *gate, const uint16_t *up, int64_t n);
  /* *total = sum over rows n with targets[n] != ignore_index of lse - logit[target] +
   * z_loss lse^2; logits (N, V) f32 or bf16; dlogits (N, V) or NULL gets grad_scale * d/dlogits.
   * total is host memory, or with total_on_device memory of the op's device (written there in
   * stream order, not read back: no host synchronisation). */
  nvl_status (*cross_entropy)(nvl_kctx *ctx, double *total, int total_on_device, float *dlogits, const void *logits,
                              nvl_dtype logits_dtype,
                              const int64_t *targets, int64_t N, int64_t V, int64_t ignore_index, double z_loss,
                              double grad_scale);
  /* optional: cross_entropy with dlogits bf16, each this table's f32 dlogit rounded once (RNE): no
   * (N, V) f32 gradient in memory; NULL: core rounds the f32 entry's (the same bits) */
  nvl_status (*cross_entropy_bf16grad)(nvl_kctx *ctx, double *total, int total_on_device, uint16_t *dlogits,
                                       const void *logits, nvl_dtype logits_dtype, const int64_t *targets, int64_t N,
                                       int64_t V, int64_t ignore_index, double z_loss, double grad_scale);
  nvl_status (*adamw_step)(nvl_kctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                           const nvl_adamw_opts *o);
  /* *out (host) = sum of x^2 over n f32 or bf16 elements, fp64 accumulation */
  nvl_status (*sumsq)(nvl_kctx *ctx, double *out, const void *x, nvl_dtype x_dtype, int64_t n);
  /* Delayed scaling's history step, on the op's device (no host synchronisation): hist[0..len)
   * the amax history, hist[len] the last usable amax (0: none). m = the max of the finite positive
   * values among hist[0..count); if m > 0, last = m; *sel = last if last > 0, else *cur (current
   * scaling); then hist[len] = last and hist[pos] = *cur. Optional. */
  nvl_status (*amax_history)(nvl_kctx *ctx, float *sel, float *hist, int64_t len, int64_t count, int64_t pos,
                             const float *cur);
  /* Optional: the bf16 RMSNorm / SwiGLU forwards (the entries above, the same bits) that also leave
   * max |out| over the stored bf16 values (NaN ignored) in *amax, a device f32 word they overwrite:
   * the amax a per-tensor quantization of out computes, from the pass that writes out (TE's fused
   * amax), so the quantization needs no amax pass of its own. */
  nvl_status (*rmsnorm_forward_bf16_amax)(nvl_kctx *ctx, uint16_t *out, float *rstd, const uint16_t *x,
                                          const float *weight, int64_t N, int64_t C, double eps, float *amax);
  nvl_status (*swiglu_forward_bf16_amax)(nvl_kctx *ctx, uint16_t *out, const uint16_t *gate, const uint16_t *up,
                                         int64_t n, float *amax);
  nvl_status (*attention_forward)(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k, const float *v,
                                  int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale);
  nvl_status (*attention_backward)(nvl_kctx *ctx, float *dq, float *dk, float *dv, const float *dout, const float *q,
                                   const float *k, const float *v, const float *out, const float *lse, int64_t B,
                                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale);
  /* the forward of T queries at positions pos0 .. pos0 + T - 1 over a key/value cache (KV-cache decoding,
   * core/layers.h nvl_attention_forward_at): q, out (B, T, Hq, D); k, v (B, S, Hkv, D), S >= pos0 + T; lse
   * (B, Hq, T); query t sees keys s <= pos0 + t. */
  nvl_status (*attention_forward_at)(nvl_kctx *ctx, float *out, float *lse, const float *q, const float *k,
                                     const float *v, int64_t B, int64_t T, int64_t S, int64_t pos0, int64_t Hq,
                                     int64_t Hkv, int64_t D, double scale);
  /* optional: attention on bf16 activations with FlashAttention's numerics (P and dS rounded to
   * bf16 before their products, fp32 scores, softmax and accumulation; out, dq, dk, dv rounded once,
   * lse f32), taken by core/attention.c when attention_bf16_ready() says this machine can run it
   * and nvl_attention_flash is on; else bf16 attention is the widened f32 op (NUMERICS §11). */
  int (*attention_bf16_ready)(void);
  nvl_status (*attention_forward_bf16)(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                                       const uint16_t *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                       double scale);
  nvl_status (*attention_backward_bf16)(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv, const uint16_t *dout,
                                        const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                        const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                        double scale);
  /* optimizer over many tensors, one launch each (core/optim.h). state (NVL_NORM_STATE i64, the
   * device's): adamw_multi scales each grad by its clip factor first when state is not NULL (as
   * grad:mul_(factor) rounds: one f32 product when the factor is exact in f32, else the double
   * product rounded), and leaves the grads as they are; grad_norm_multi writes its sum of squares
   * (fp64, every tensor), the clip factor for max_norm (1 when the norm is <= max_norm or not
   * finite) and, when take_nonfinite, the device's non-finite flags, which it clears (else that slot
   * is 0 and the flags stay). Neither reads anything back to the host. */
  nvl_status (*adamw_multi)(nvl_kctx *ctx, const nvl_adamw_chunk *t, int64_t count, const nvl_adamw_opts *o,
                            const int64_t *state);
  nvl_status (*grad_norm_multi)(nvl_kctx *ctx, int64_t *state, const float *const *x, const int64_t *n, int64_t count,
                                double max_norm, int take_nonfinite);
  /* state's sum of squares = the sum of parts[r]'s (count states of NVL_NORM_STATE slots, e.g. the
   * ranks' of a sharded model, all-gathered), in order, in fp64, and its clip factor for max_norm, as
   * grad_norm_multi writes them; its non-finite slot is left. Nothing read back. */
  nvl_status (*grad_norm_combine)(nvl_kctx *ctx, int64_t *state, const int64_t *parts, int64_t count,
                                  double max_norm);
  /* *flags (host) = the device's non-finite flags (NVL_NONFINITE_*), which are cleared; on a GPU a
   * copy to the host (it waits for the queued work). grad_norm_multi takes them too, into its
   * state's NVL_NORM_NONFINITE, with nothing read back. */
  nvl_status (*nonfinite_take)(nvl_kctx *ctx, uint32_t *flags);
  /* out (rows, K / block) = per 1 x block group of a and b (rows, K) f32: sum of f32(a - b)^2 (b NULL:
   * a^2), each square and the sum in double in index order, the total rounded to f32 once: the
   * same bits on every backend (MoR's error metric, lua/nvlua/mor.lua). */
  nvl_status (*block_sqerr)(nvl_kctx *ctx, float *out, const float *a, const float *b, int64_t rows, int64_t K,
                            int64_t block);
  /* Knowledge distillation (core/layers.h nvl_distill_loss): per row of the student's and the
   * teacher's logits s, t (N, V; f32 or bf16), with targets (host, i64): kl += KL(softmax(t/T) ||
   * softmax(s/T)), ce += the cross-entropy of s, over the rows whose target is not ignore_index;
   * dlogits (or NULL) = grad_scale * (alpha * T * (softmax(s/T) - softmax(t/T)) + (1 - alpha) *
   * (softmax(s) - onehot)), zero rows for ignored targets. Sums and softmaxes in double. */
  nvl_status (*distill)(nvl_kctx *ctx, double *kl, double *ce, float *dlogits, const void *s, nvl_dtype s_dtype,
                        const void *t, nvl_dtype t_dtype, const int64_t *targets, int64_t N, int64_t V,
                        int64_t ignore_index, double T, double alpha, double grad_scale);
} nvl_layer_kernels;

/* ---- the table -------------------------------------------------------------------------------- */

typedef struct nvl_backend {
  const char *name;     /* "reference", "cpu", "cuda" */
  nvl_device device;

  /* quantization: one row per format (plain f32 and bf16 included: their "quantization" is a
   * cast into the blocked layout) */
  nvl_format_kernels formats[NVL_DTYPE_COUNT];
  int swizzled_scales;  /* 1: block scales are also written swizzled (nvl_qdesc.scales_swz) */
  /* the row-wise (C = 1) and column-wise (B = 1) quantizations of one 2-D x from one read; NULL:
   * two quantize calls */
  nvl_status (*quantize_pair)(nvl_kctx *ctx, const nvl_qdesc *row, const nvl_qdesc *col);
  /* y (rows, K) = the RHT of every 16-chunk of x (rows, K), x R (NUMERICS §5); inverse: x R^T (the
   * butterflies and * 0.25 first, the signs after: what dequantize undoes). y may alias x */
  nvl_status (*rht)(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs, int inverse);
  /* Scales assembled from pieces rather than written by quantize (the quantized all-gather, a
   * transposed 16x16 copy): swz (nvl_swizzled_bytes(rows, nb)) = the row-major block scales
   * (rows, nb) in the 128x4 swizzled layout, padding zeroed, as quantize writes it beside them.
   * Backends with swizzled_scales only. */
  nvl_status (*swizzle_scales)(nvl_kctx *ctx, uint8_t *swz, const uint8_t *scales, int64_t rows, int64_t nb);
  /* The 16x16-tiled 4-bit quantization of x (R, K) (codes (R, K/2) packed, low nibble first; scales
   * (R, K/16), equal down each tile) transposed into that of x^T: codes_t (K, R/2), scales_t
   * (K, R/16), each tile's scale read from its first row (NUMERICS §2). */
  nvl_status (*transpose_tiles)(nvl_kctx *ctx, uint8_t *codes_t, uint8_t *scales_t, const uint8_t *codes,
                                const uint8_t *scales, int64_t R, int64_t K);
  /* GAM scaling of fp8 blocks (kernels/cpu/ref/gam_ref.h, bit for bit nvl_gam_quantize_ref): codes
   * (rows, K) e4m3/e5m2 codes, scales (rows, K/block) E8M0 bytes 127 - e_b, mant (nblocks / G) f32 group
   * mantissas, from x (rows, K) f32; G = group_blocks >= 1 blocks per group (core resolves "the whole
   * tensor"), dividing nblocks = rows * (K/block). A NaN or an inf in x sets the device's
   * NVL_NONFINITE_INPUT flag, as every quantization into fp8 does. */
  nvl_status (*gam_quantize)(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant, const float *x,
                             int64_t rows, int64_t K, int64_t block, int64_t group_blocks, nvl_elem elem);

  /* layers and attention (core/layers.h): a sub-table, defined beside the kernels */
  const struct nvl_layer_kernels *layers;
  /* an entry this table leaves empty is taken from the fallback (the CPU table: the reference) */
  const struct nvl_backend *fallback;

  /* tensor ops (core/ops.h): views of one shape (inputs broadcast by core), out's dtype chosen */
  nvl_status (*copy)(nvl_kctx *ctx, nvl_tensor *dst, const nvl_tensor *src); /* any strides, casts; no overlap */
  nvl_status (*fill)(nvl_kctx *ctx, nvl_tensor *t, const void *value);       /* contiguous t; one element's bytes */
  nvl_status (*binary)(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
  nvl_status (*binary_scalar)(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, nvl_scalar s,
                              int scalar_left);
  nvl_status (*unary)(nvl_kctx *ctx, nvl_unary_op op, nvl_tensor *out, const nvl_tensor *a);
  nvl_status (*reduce_all)(nvl_kctx *ctx, nvl_reduce_op op, nvl_scalar *out, const nvl_tensor *a);
  /* out = a reduced over its last dim (a permuted so); idx (or NULL): 0-based arg of max/min */
  nvl_status (*reduce_last)(nvl_kctx *ctx, nvl_reduce_op op, nvl_tensor *out, nvl_tensor *idx, const nvl_tensor *a);
  /* out (M, N) contiguous f32 = a (M, K) @ b (K, N), f32 views of any strides */
  nvl_status (*matmul)(nvl_kctx *ctx, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b);
  /* y += (float)alpha * x, n contiguous f32 */
  nvl_status (*axpy)(nvl_kctx *ctx, float *y, const float *x, double alpha, int64_t n);
  /* p *= s, n contiguous f32 */
  nvl_status (*scale)(nvl_kctx *ctx, float *p, double s, int64_t n);
  nvl_status (*arange)(nvl_kctx *ctx, nvl_tensor *t, double start, double step);  /* contiguous 1-D */
  /* contiguous float t from the Philox stream at (seed, offset): uniform [0, 1) or normal; t's element
   * k is the call's element first + k (first = 0: a whole draw; > 0: a part of a larger one) */
  nvl_status (*random)(nvl_kctx *ctx, nvl_tensor *t, uint64_t seed, uint64_t offset, uint64_t first, int normal);
  nvl_status (*allclose)(nvl_kctx *ctx, int *result, const nvl_tensor *a, const nvl_tensor *b, double rtol, double atol,
                         int equal_nan);

  const nvl_device_api *device_api; /* NULL for the host */
} nvl_backend;

extern const nvl_backend nvl_backend_ref;
extern const nvl_backend nvl_backend_cpu;
#ifdef NVLUA_HAVE_CUDA
extern const nvl_backend nvl_backend_cuda;
#endif

#ifdef __cplusplus
}
#endif
#endif
