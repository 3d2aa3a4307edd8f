/* qgather.h: the quantized all-gather (core/NUMERICS.md "The gathered quantized weight"). Each rank
 * holds a row shard of a weight W (rows, K) — the rows nvl_dist_shard_rows assigns it — and gets the
 * quantization of the whole W, bit for bit what nvl_quantize(W) gives, having sent only quantized
 * bytes: one max all-reduce of the shards' amaxes (exact: a max of floats), each rank quantizing its
 * shard with that global amax, then an all-gather of codes and block scales (padded to equal chunks,
 * dist.h), assembled into one QTensor (swizzled scales made after, where the backend keeps them).
 *
 * Two copies of a weight can be gathered:
 *   axis 1 (the fprop copy, blocked along K): row shards are independent for every format; the rows
 *          must be cut on 16-row boundaries for nvfp4 16x16 tiles (align 16), anywhere otherwise.
 *          For nvfp4 16x16, per-tensor fp8, bf16 and f32 this copy also serves dgrad: its transpose
 *          (nvl_qtensor_t, on the device too) is the quantization of W^T.
 *   axis 0 (the dgrad copy of 1-D blocked formats, blocked along the rows: mxfp8, mxfp4, nvfp4 1x16):
 *          each rank quantizes its shard along its rows, a column slab of the copy's (K, rows)
 *          layout, which needs shard boundaries on block multiples (align 32 for mx, 16 for nvfp4);
 *          the slabs are gathered and placed side by side (a strided copy per rank).
 * nvl_qgather_align says which alignment a format and axis need. On CUDA tensors every step is
 * stream-ordered (NCCL on its stream behind events): no host synchronisation. Start and wait are
 * separate calls, so a layer's weights can be gathered while the layer before computes (prefetch).
 *
 * Not here: which weights are gathered when (FSDP, lua/nvlua/train.lua), the collectives (dist.h). */
#ifndef NVL_QGATHER_H
#define NVL_QGATHER_H
#include "quant.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  /* which copies: NVL_QG_AXIS1 (blocked along K: the fprop copy), NVL_QG_AXIS0 (blocked along the rows:
   * a 1-D blocked format's dgrad copy), or both (one amax reduction for the two); 0: NVL_QG_AXIS1 */
  int copies;
  int block2d;       /* nvfp4 16x16 tiles (the axis-1 copy) */
  nvl_mx_rule rule;  /* e8m0 scale rule */
  /* the global amax to use instead of reducing the shards' (delayed scaling's, or another copy's):
   * a number, a one-element f32 tensor (on the shard's device: read there), or a quantized tensor's
   * (quant.h nvl_quant_opts has_amax / amax_t / amax_of; at most one) */
  int has_amax;
  float amax;
  const nvl_tensor *amax_t;
  const nvl_qtensor *amax_of;
  int nocheck;       /* skip the cross-rank agreement check (one small host all-reduce) */
  /* the rows' split: dist.shard_rows(rows, world, align) with this align (0: the least the copies
   * need, nvl_qgather_align; else a multiple of it) */
  int64_t align;
} nvl_qgather_opts;

enum { NVL_QG_AXIS1 = 1, NVL_QG_AXIS0 = 2 };

/* A started quantized all-gather (its buffers and the collectives in flight). */
typedef struct nvl_qgather nvl_qgather;

/* The row alignment a shard of this format's copy along axis (1: K, 0: the rows) needs (1, 16 or 32);
 * 0 if that copy is not gathered (16x16 tiles along axis 0: take the axis-1 copy's transpose). */
int64_t nvl_qgather_align(nvl_dtype format, int block2d, int axis);

/* Start gathering the quantization of W (rows, K), each copy asked for (per nvl_quantize: RNE, no RHT),
 * where this rank holds shard = W's rows nvl_dist_shard_rows(rows, world, align) gives it. Every rank
 * calls it with the same rows, K, format and options (checked across the ranks unless o->nocheck: a
 * mismatch is the same error on every rank, raised before anything is gathered). The amax reduction and
 * the shard's quantization happen here (on the host: a blocking all-reduce of a few numbers; on a device:
 * queued), the gathers are started (dist.h nvl_dist_all_gather_start): the work queued next on the
 * device runs beside them. *g: the handle for nvl_quantize_all_gather_wait. */
nvl_status nvl_quantize_all_gather_start(nvl_qgather **g, const nvl_tensor *shard, int64_t rows, nvl_dtype format,
                                         const nvl_qgather_opts *o);
/* Complete g and free it: out[0] = the axis-1 copy, out[1] = the axis-0 copy (those asked for; the others
 * null), on the shard's device, their amax the global one (on a device: in device memory, read back on
 * demand). On a device nothing waits on the host: stream 0's later work waits for the gathers. */
nvl_status nvl_quantize_all_gather_wait(nvl_qtensor out[2], nvl_qgather *g);
/* Drop a started gather without its result (its collectives are completed first: every rank must
 * complete them). */
void nvl_qgather_free(nvl_qgather *g);
/* start + wait. */
nvl_status nvl_quantize_all_gather(nvl_qtensor out[2], const nvl_tensor *shard, int64_t rows, nvl_dtype format,
                                   const nvl_qgather_opts *o);

#ifdef __cplusplus
}
#endif
#endif
