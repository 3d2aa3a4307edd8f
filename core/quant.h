/* quant.h: quantized tensors and the ops on them (core/NUMERICS.md is the contract).
 * A quantized tensor is x (any shape, any float dtype) moved so that its blocked dim (axis) is
 * last and flattened to the "blocked layout" [rows, K]: codes and block scales live in that
 * layout, row-major, so each block is contiguous and block g = row*(K/block) + k/block is the
 * index the SR stream uses. The logical shape and axis are kept so codes()/scale_bytes() can
 * present them in x's own shape.
 * Not here: recipes (which format each GEMM operand gets), layers. */
#ifndef NVL_QUANT_H
#define NVL_QUANT_H
#include "ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* nvl_block_layout, nvl_mx_rule and the formats' traits: dtype.h. */

typedef struct nvl_qtensor_s {
  nvl_dtype format;         /* f32, bf16, or a quantized format */
  nvl_block_layout layout;
  int ndim;
  int64_t shape[NVL_MAX_DIMS]; /* logical shape (x's) */
  int axis;                 /* the blocked dim of the logical shape, 0-based */
  int64_t rows, K;          /* the blocked layout */
  nvl_tensor data;          /* (rows, K) u8 codes; 4-bit elements: (rows, K/2) packed, low nibble
                               first; f32/bf16: (rows, K) values */
  nvl_tensor scales;        /* (rows, K/block) u8 block scales, or null */
  float amax;               /* the global amax used (max |x| after RHT, or the one given) */
  float scale;              /* the traits' enc_scale of amax: fp8 x * scale; nvfp4 s_enc; else 0 */
  /* On a device, a quantization that computes its own amax leaves it in device memory: amax_dev
   * (f32 [1], shared by the quantizations that reuse it) is what its kernels and GEMMs read, and
   * amax_pending says amax and scale above are not known on the host yet (NaN) until
   * nvl_qtensor_resolve_amax reads it back (one host synchronisation, on demand). */
  nvl_tensor amax_dev;
  int amax_pending;
  int rht;                  /* 1: the RHT of NUMERICS §5 was applied along axis first */
  float signs[16];          /* its sign vector */
  int sr;                   /* 1: stochastic rounding; seed/offset of the draw */
  uint64_t seed, offset;
  nvl_mx_rule rule;         /* e8m0 scale rule */
  float factor;             /* a decode factor beside the format's own, or 0 for none (1): an assembled
                               operand's (nvl_qtensor_assemble), e.g. GAM's 1 / m_g (NUMERICS §12.1) */
} nvl_qtensor;

typedef struct {
  int axis;                  /* blocked dim, 0-based; -1: the last */
  int block2d;               /* 16x16 tiles (2-D x only; formats whose traits offer them) */
  int rht;                   /* apply the RHT along axis before quantizing */
  const float *signs;        /* RHT signs (16), NULL: the default */
  int sr;                    /* stochastic rounding (formats whose traits define it: e2m1 elements) */
  nvl_generator *gen;        /* SR draw from gen (offset advanced by one), or ... */
  uint64_t seed, offset;     /* ... from this explicit (seed, offset) when gen is NULL */
  nvl_mx_rule rule;          /* e8m0 scale rule */
  int has_amax;              /* use amax instead of max |x| (delayed scaling, reduced amax) */
  float amax;
  /* use the amax another quantization used (a per-tensor format's): on a device, read there (no
   * host synchronisation) when it is still pending; the result shares it. Excludes has_amax. */
  const struct nvl_qtensor_s *amax_of;
  /* the amax to use as a one-element f32 tensor (on x's device: read there, no host sync; the
   * result shares it): delayed scaling's device history (nvl_amax_history_step). Excludes the others. */
  const nvl_tensor *amax_t;
  /* quantize_rowcol only: the column copy gets the RHT too (the row copy only with rht): the
   * NVFP4 recipe's wgrad copies of x and dY beside their plain fprop / dgrad copies. A given amax
   * is then the row copy's; the column copy computes its own (in the RHT domain). */
  int rht_col;
  /* the result may be a view of x where quantizing is the identity (x's own dtype f32/bf16, blocked
   * along its contiguous last dim, no RHT): no copy; x must not change while the result is used */
  int view;
  /* SR: x's blocked layout is a slab of a larger tensor's (a data-parallel rank's
   * slice): rows from sr_row_offset, columns from sr_k_offset, of a layout sr_k_total long
   * (0: K), so block g of the SR stream is the global one (backend.h nvl_qdesc). All 0: x itself. */
  int64_t sr_row_offset, sr_k_offset, sr_k_total;
} nvl_quant_opts;

static inline nvl_qtensor nvl_qtensor_null(void) {
  nvl_qtensor q;
  for (size_t i = 0; i < sizeof q; i++) ((char *)&q)[i] = 0;
  q.data = nvl_tensor_null();
  q.scales = nvl_tensor_null();
  q.amax_dev = nvl_tensor_null();
  return q;
}

/* out = x quantized to format (f32, bf16 or a quantized format) per opts. */
nvl_status nvl_quantize(nvl_qtensor *out, const nvl_tensor *x, nvl_dtype format, const nvl_quant_opts *opts);
/* row = quantize(x, opts with axis = last), col = quantize(x, opts with axis = first) for a 2-D x,
 * bit for bit those two calls (a generator's offset advances twice: row draws offset o, col
 * o + 1). On cuda both copies come from one read of x where the shape allows (kernels/cuda). */
nvl_status nvl_quantize_rowcol(nvl_qtensor *row, nvl_qtensor *col, const nvl_tensor *x, nvl_dtype format,
                               const nvl_quant_opts *opts);
/* out = a one-element f32 tensor on x's device holding max |x| (after the RHT along axis when rht),
 * as a quantization computes its amax; on a device nothing is read back. */
nvl_status nvl_quant_amax(nvl_tensor *out, const nvl_tensor *x, int axis, int rht);
/* h = a host copy of q (codes and row-major scales, its amax read back if it was pending). */
nvl_status nvl_qtensor_host(nvl_qtensor *h, const nvl_qtensor *q);
/* q.amax and q.scale on the host: read back from the device when pending (a host sync), else
 * nothing to do. */
nvl_status nvl_qtensor_resolve_amax(nvl_qtensor *q);
/* Release codes and scales. */
void nvl_qtensor_release(nvl_qtensor *q);
/* out (f32, logical shape) = the decoded values. An RHT operand's are moved back to x's domain (the
 * inverse transform in fp32, NUMERICS §5) unless rotated: then they are the values as stored, in the
 * RHT domain the GEMMs read. Without the RHT, rotated changes nothing. */
nvl_status nvl_dequantize(nvl_tensor *out, const nvl_qtensor *q, int rotated);
/* out (f32, logical shape, on q's device) = the decoded values, bit for bit nvl_dequantize's; a device
 * q decodes there (its pending amax is read back first: one host synchronisation). */
nvl_status nvl_dequantize_on_device(nvl_tensor *out, nvl_qtensor *q, int rotated);
/* out (u8, logical shape) = element codes, unpacked; f32/bf16: unsupported. */
nvl_status nvl_qtensor_codes(nvl_tensor *out, const nvl_qtensor *q);
/* out (u8) = block-scale bytes, logical shape with axis divided by the block size. */
nvl_status nvl_qtensor_scale_bytes(nvl_tensor *out, const nvl_qtensor *q);
/* out (u8, host) = the block scales in cuBLASLt's 128x4 swizzled layout, padding included, as a
 * backend with swizzled_scales (CUDA) writes them; an error for q without them. */
nvl_status nvl_qtensor_swizzled_scales(nvl_tensor *out, const nvl_qtensor *q);
/* out = the quantization of x^T for a 2-D q, blocked along the same dim index, bit for bit
 * what quantize(x^T, same options) gives: exact for 16x16 nvfp4 (the tile scales do not depend
 * on the orientation), f32, bf16 and per-tensor fp8. 1x16 / 1x32 blocks raise (quantize x along
 * the other axis instead); so does an RHT or SR quantization, whose transpose is a different
 * draw / transform. On q's device (a device q keeps its amax there: no host synchronisation; the
 * swizzled scales of a backend that keeps them are made too). */
nvl_status nvl_qtensor_t(nvl_qtensor *out, const nvl_qtensor *q);
/* q's block scales assembled from pieces (core/qgather.c): write their swizzled copy where q's
 * backend keeps one (q.scales a (rows, nb) view at offset 0 of a storage with room for it after
 * the 256-byte aligned end of the row-major bytes); nothing for host tensors. */
nvl_status nvl_qtensor_swizzle(nvl_qtensor *q);
/* scales = a new (rows, nb) u8 view at offset 0 of a storage on device, with room for the
 * swizzled copy after it when swz (*swz_p: its bytes, else NULL); extra: at least this many bytes
 * in all (a gather's padded rows may run past rows * nb). */
nvl_status nvl_qtensor_alloc_scales(nvl_tensor *scales, uint8_t **swz_p, nvl_device device, int64_t rows, int64_t nb,
                                    int swz, size_t extra);
/* out[M,N] = sum_k A[m,k] B[n,k] where A, B are the 2-D qa, qb read in their blocked layouts
 * (M = qa.rows, N = qb.rows, K their blocked length): each operand decoded exactly without its
 * global scale, an fp32 GEMM, then alpha (the product of the global decode scales) applied in
 * fp32 (NUMERICS §7). out_dtype f32 or bf16. */
nvl_status nvl_qmatmul(nvl_tensor *out, const nvl_qtensor *qa, const nvl_qtensor *qb, nvl_dtype out_dtype);
/* acc (an existing contiguous f32 [M, N]) += the f32 result of nvl_qmatmul, bit for bit what
 * qmatmul followed by an add gives, without a full-size temporary (wgrad into a weight grad). */
nvl_status nvl_qmatmul_acc(nvl_tensor *acc, const nvl_qtensor *qa, const nvl_qtensor *qb);
/* out = a 2-D q (shape [R, K], blocked along its last dim) assembled from its parts, copied onto their
 * device: format f32 or bf16 with values (that dtype, [R, K], scales NULL), or mxfp8_e4m3 /
 * mxfp8_e5m2 with codes (u8 [R, K], K a multiple of 32) and E8M0 bytes (u8 [R, K/32]; 255, NaN, is
 * refused); factor (finite, normal, > 0) multiplies every decoded value and enters the GEMMs' alpha
 * (out = alpha_a alpha_b sum_k, NUMERICS §7), so a factor common to a whole operand leaves its
 * products exact. The amax of an assembled q is not known: NaN. */
nvl_status nvl_qtensor_assemble(nvl_qtensor *out, nvl_dtype format, const nvl_tensor *values, const nvl_tensor *scales,
                                float factor);
/* out = x with the RHT applied to every 16-chunk along axis (f32). */
nvl_status nvl_rht(nvl_tensor *out, const nvl_tensor *x, int axis, const float *signs);

#ifdef __cplusplus
}
#endif
#endif
