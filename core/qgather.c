/* qgather.c: the quantized all-gather (see qgather.h): checks, the global amax, the shard's
 * quantization (nvl_quantize with that amax), the gathers of codes and block scales (dist.h
 * nvl_dist_all_gather_start, padded to equal chunks) started by nvl_quantize_all_gather_start, and at
 * nvl_quantize_all_gather_wait the QTensors assembled from them (the axis-0 copy's slabs placed, the
 * swizzled scales made). Nothing here switches on a format: the traits row says whether it has a global
 * amax, block scales and 4-bit codes.
 *
 * Memory (the output's bytes B, world N): the gathered codes and scales of the axis-1 copy are the
 * output itself (N * chunk rows, of which the first `rows` are the view returned: padding at most
 * N * align rows); the shard's own quantization (B / N) lives until the gather is queued. The axis-0
 * copy gathers into a staging buffer (N * K * chunk elements' bytes) and copies the slabs into the
 * output: about 2 B at the peak. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "dist.h"
#include "ops.h"
#include "qgather.h"

#define OP "quantize_all_gather"

int64_t nvl_qgather_align(nvl_dtype format, int block2d, int axis) {
  if ((unsigned)format >= NVL_DTYPE_COUNT) return 0;
  if (axis == 1) return block2d ? 16 : 1;
  if (block2d) return 0;
  int block = nvl_dtypes[format].block;
  return block > 0 ? block : 1;
}

/* Columns of the blocked layout's data for n elements along the blocked dim: code bytes, or values. */
static int64_t data_cols(nvl_dtype format, int64_t n) {
  return nvl_dtypes[format].is_quantized ? nvl_code_bytes(format, n) : n;
}

/* The whole storage of t as a 1-D view (borrowed: no reference of its own; narrow it before keeping it). */
static nvl_tensor whole_storage(const nvl_tensor *t) {
  nvl_tensor w = *t;
  w.ndim = 1;
  w.shape[0] = (int64_t)(t->storage->bytes / (size_t)nvl_dtypes[t->dtype].elem_size);
  w.strides[0] = 1;
  w.offset = 0;
  return w;
}

/* dst = rows [r0, r0 + n) of a 2-D t (a new reference). */
static nvl_status rows_of(nvl_tensor *dst, const nvl_tensor *t, int64_t r0, int64_t n) {
  return nvl_tensor_narrow(dst, t, 0, r0, n);
}

struct nvl_qgather {
  int copies;          /* NVL_QG_AXIS1 | NVL_QG_AXIS0 */
  nvl_qtensor q[2];    /* the outputs: [0] the axis-1 copy, [1] the axis-0 copy (headers set, bytes arriving) */
  nvl_tensor stage[2]; /* the axis-0 copy's staging buffers: codes, block scales (N * K rows of chunks) */
  int ticket[4];       /* the gathers in flight: [0..1] axis 1's codes and scales, [2..3] axis 0's */
  int64_t rows, K, align;
  int world, rank;
};

/* Copy piece (this rank's, n rows) into rows [mine0, mine0 + n) of full (2-D, N * chunk rows), zero the
 * rest of this rank's chunk, then start gathering the chunks in place. */
static nvl_status start_rows(nvl_tensor *full, const nvl_tensor *piece, int64_t mine0, int64_t n, int64_t chunk,
                             int *ticket) {
  nvl_tensor mine = nvl_tensor_null(), part = nvl_tensor_null();
  nvl_status st = rows_of(&mine, full, mine0, chunk);
  if (st == NVL_OK && n > 0) {
    st = rows_of(&part, full, mine0, n);
    if (st == NVL_OK) st = nvl_tensor_copy(&part, piece);
    nvl_tensor_release(&part);
  }
  if (st == NVL_OK && n < chunk) { /* padding: defined bytes on the wire */
    st = rows_of(&part, full, mine0 + n, chunk - n);
    if (st == NVL_OK) st = nvl_fill_(&part, nvl_scalar_i(0));
    nvl_tensor_release(&part);
  }
  if (st == NVL_OK) st = nvl_dist_all_gather_start(full, &mine, ticket);
  nvl_tensor_release(&mine);
  return st;
}

/* The axis-1 copy: out's data (rows, dc) and scales (rows, nb) gathered from the shard's quantization qs
 * straight into out's storage (N * chunk rows, the first `rows` of them out's view). */
static nvl_status start_axis1(nvl_qgather *g, const nvl_qtensor *qs, int64_t n, int64_t chunk, int swz) {
  nvl_qtensor *out = &g->q[0];
  const nvl_dtype_traits *f = &nvl_dtypes[out->format];
  nvl_device dev = qs->data.device;
  int64_t dc = data_cols(out->format, out->K), dshape[2] = {(int64_t)g->world * chunk, dc};
  nvl_tensor full = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&full, qs->data.dtype, dev, 2, dshape));
  nvl_status st = start_rows(&full, &qs->data, (int64_t)g->rank * chunk, n, chunk, &g->ticket[0]);
  if (st == NVL_OK) st = rows_of(&out->data, &full, 0, g->rows);
  nvl_tensor_release(&full);
  if (st != NVL_OK || !f->block) return st;
  int64_t nb = out->K / f->block, sshape[2] = {(int64_t)g->world * chunk, nb};
  uint8_t *swz_p = NULL;
  NVL_TRY(nvl_qtensor_alloc_scales(&out->scales, &swz_p, dev, g->rows, nb, swz, (size_t)(g->world * chunk * nb)));
  nvl_tensor all = whole_storage(&out->scales), sflat = nvl_tensor_null(), sfull = nvl_tensor_null();
  st = nvl_tensor_narrow(&sflat, &all, 0, 0, (int64_t)g->world * chunk * nb);
  if (st == NVL_OK) st = nvl_tensor_view(&sfull, &sflat, 2, sshape);
  /* the gathered padding may run into the swizzled copy's bytes: they are written after the wait */
  if (st == NVL_OK) st = start_rows(&sfull, &qs->scales, (int64_t)g->rank * chunk, n, chunk, &g->ticket[1]);
  nvl_tensor_release(&sflat);
  nvl_tensor_release(&sfull);
  return st;
}

/* One piece of the axis-0 copy: this rank's (K, cols(n)) slab into its chunk of a new staging buffer
 * (N * K, cols(chunk)), whose gather is started. */
static nvl_status start_slabs(nvl_tensor *stage, const nvl_tensor *piece, nvl_dtype dt, nvl_device dev,
                              int64_t (*cols)(int64_t, int64_t), int64_t arg, int64_t n, int64_t chunk, int64_t K,
                              int world, int rank, int *ticket) {
  int64_t gshape[2] = {(int64_t)world * K, cols(chunk, arg)};
  nvl_tensor mine = nvl_tensor_null(), part = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(stage, dt, dev, 2, gshape));
  nvl_status st = rows_of(&mine, stage, (int64_t)rank * K, K);
  if (st == NVL_OK && n < chunk) st = nvl_fill_(&mine, nvl_scalar_i(0)); /* padding: defined bytes on the wire */
  if (st == NVL_OK && n > 0) {
    st = nvl_tensor_narrow(&part, &mine, 1, 0, cols(n, arg));
    if (st == NVL_OK) st = nvl_tensor_copy(&part, piece);
    nvl_tensor_release(&part);
  }
  if (st == NVL_OK) st = nvl_dist_all_gather_start(stage, &mine, ticket);
  nvl_tensor_release(&mine);
  return st;
}

/* After the gather: rank s's slab (the first cols(n_s) columns of its K staged rows) to columns
 * [cols(row0_s), cols(row0_s + n_s)) of dst (K, cols(rows)), for every rank. */
static nvl_status place_slabs(nvl_tensor *dst, const nvl_tensor *stage, int64_t (*cols)(int64_t, int64_t), int64_t arg,
                              const nvl_qgather *g) {
  nvl_status st = NVL_OK;
  for (int s = 0; st == NVL_OK && s < g->world; s++) {
    int64_t r0s, ns, c;
    nvl_dist_shard_rows(g->rows, g->world, g->align, s, &r0s, &ns, &c);
    if (ns == 0) continue;
    nvl_tensor src = nvl_tensor_null(), slab = nvl_tensor_null(), to = nvl_tensor_null();
    st = rows_of(&slab, stage, (int64_t)s * g->K, g->K);
    if (st == NVL_OK) st = nvl_tensor_narrow(&src, &slab, 1, 0, cols(ns, arg));
    if (st == NVL_OK) st = nvl_tensor_narrow(&to, dst, 1, cols(r0s, arg), cols(ns, arg));
    if (st == NVL_OK) st = nvl_tensor_copy(&to, &src);
    nvl_tensor_release(&src);
    nvl_tensor_release(&slab);
    nvl_tensor_release(&to);
  }
  return st;
}

static int64_t code_cols(int64_t n, int64_t format) { return data_cols((nvl_dtype)format, n); }
static int64_t scale_cols(int64_t n, int64_t block) { return n / block; }

/* The axis-0 copy: out's data (K, cols(rows)) and scales (K, rows / block), staged. */
static nvl_status start_axis0(nvl_qgather *g, const nvl_qtensor *qs, int64_t n, int64_t chunk, int swz) {
  nvl_qtensor *out = &g->q[1];
  const nvl_dtype_traits *f = &nvl_dtypes[out->format];
  nvl_device dev = qs->data.device;
  int64_t dshape[2] = {g->K, data_cols(out->format, g->rows)};
  NVL_TRY(nvl_tensor_empty(&out->data, qs->data.dtype, dev, 2, dshape));
  NVL_TRY(start_slabs(&g->stage[0], &qs->data, qs->data.dtype, dev, code_cols, out->format, n, chunk, g->K, g->world,
                      g->rank, &g->ticket[2]));
  if (!f->block) return NVL_OK;
  uint8_t *swz_p = NULL;
  NVL_TRY(nvl_qtensor_alloc_scales(&out->scales, &swz_p, dev, g->K, g->rows / f->block, swz, 0));
  return start_slabs(&g->stage[1], &qs->scales, NVL_U8, dev, scale_cols, f->block, n, chunk, g->K, g->world, g->rank,
                     &g->ticket[3]);
}

/* The cross-rank agreement check (and, on the host, the amax reduction folded into it): every rank
 * gets the same verdict. v: pairs (x, -x) max-reduced, then the amax. */
static nvl_status agree(const int64_t *vals, const char *const *names, int nvals, int check, float *amax) {
  double v[32];
  int n = 0;
  if (check)
    for (int i = 0; i < nvals; i++) {
      v[n++] = (double)vals[i];
      v[n++] = -(double)vals[i];
    }
  int with_amax = amax != NULL;
  if (with_amax) v[n++] = *amax; /* NaN is ignored by amaxes: never one here */
  if (n == 0) return NVL_OK;
  NVL_TRY(nvl_dist_all_reduce_f64(v, n, NVL_DIST_MAX));
  if (check)
    for (int i = 0; i < nvals; i++)
      if (v[2 * i] != -v[2 * i + 1])
        return nvl_error(NVL_EINVAL, OP ": the ranks disagree on %s (from %.0f to %.0f): every rank must gather the "
                         "same weight (rows, K, dtype, device) with the same format and options", names[i],
                         -v[2 * i + 1], v[2 * i]);
  if (with_amax) *amax = (float)v[n - 1];
  return NVL_OK;
}

void nvl_qgather_free(nvl_qgather *g) {
  if (!g) return;
  for (int i = 0; i < 4; i++) (void)nvl_dist_all_gather_wait(g->ticket[i]);
  for (int i = 0; i < 2; i++) {
    nvl_qtensor_release(&g->q[i]);
    nvl_tensor_release(&g->stage[i]);
  }
  free(g);
}

nvl_status nvl_quantize_all_gather_start(nvl_qgather **gp, const nvl_tensor *shard, int64_t rows, nvl_dtype format,
                                         const nvl_qgather_opts *opts) {
  static const nvl_qgather_opts defaults = {.copies = NVL_QG_AXIS1};
  const nvl_qgather_opts *o = opts ? opts : &defaults;
  char d[160];
  *gp = NULL;
  NVL_TRY(nvl_tensor_check_live(shard, OP));
  if ((unsigned)format >= NVL_DTYPE_COUNT || !nvl_dtypes[format].is_float)
    return nvl_error(NVL_EINVAL, OP ": invalid format (valid: %s)", nvl_qformat_names());
  const nvl_dtype_traits *f = &nvl_dtypes[format];
  if (shard->ndim != 2 || (shard->dtype != NVL_F32 && shard->dtype != NVL_BF16))
    return nvl_error(NVL_EINVAL, OP ": expects this rank's rows of a 2-D f32 or bf16 weight, got %s",
                     nvl_tensor_desc(shard, d, sizeof d));
  int copies = o->copies ? o->copies : NVL_QG_AXIS1;
  if (copies & ~(NVL_QG_AXIS1 | NVL_QG_AXIS0)) return nvl_error(NVL_EINVAL, OP ": invalid copies %d", copies);
  if ((unsigned)o->rule >= NVL_MX_RULE_COUNT) return nvl_error(NVL_EINVAL, OP ": invalid scale rule %d", (int)o->rule);
  if (o->block2d && !f->block2d)
    return nvl_error(NVL_EINVAL, OP ": 16x16 blocks are an nvfp4 layout, not %s", f->name);
  if ((copies & NVL_QG_AXIS0) && o->block2d)
    return nvl_error(NVL_EINVAL, OP ": a 16x16 copy is gathered blocked along K (axis 2); its transpose (q:t()) is "
                     "the copy blocked along the rows");
  int64_t need = 1;
  if (copies & NVL_QG_AXIS1) need = nvl_qgather_align(format, o->block2d, 1);
  if ((copies & NVL_QG_AXIS0) && nvl_qgather_align(format, 0, 0) > need) need = nvl_qgather_align(format, 0, 0);
  int64_t align = o->align ? o->align : need; /* the alignments are powers of two: the larger serves both */
  if (align < 0 || align % need)
    return nvl_error(NVL_EINVAL, OP ": align must be a positive multiple of %lld (the %s copy's shard boundaries), got %lld",
                     (long long)need, f->name, (long long)align);
  if (rows < 0) return nvl_error(NVL_EINVAL, OP ": the weight's row count must be >= 0, got %lld", (long long)rows);
  int64_t K = shard->shape[1];
  int world = nvl_dist_world_size(), rank = nvl_dist_rank();
  int64_t row0, n, chunk;
  nvl_dist_shard_rows(rows, world, align, rank, &row0, &n, &chunk);
  if (shard->shape[0] != n)
    return nvl_error(NVL_EINVAL, OP ": rank %d of %d holds rows [%lld, %lld) of the %lld-row weight (dist.shard_rows(%lld, "
                     "%d, %lld)), so its shard has %lld rows; got %s", rank, world, (long long)row0, (long long)(row0 + n),
                     (long long)rows, (long long)rows, world, (long long)align, (long long)n,
                     nvl_tensor_desc(shard, d, sizeof d));
  /* the format's rules on the whole weight, before any collective (every rank fails alike) */
  for (int axis = 1; axis >= 0; axis--) {
    if (!(copies & (axis == 1 ? NVL_QG_AXIS1 : NVL_QG_AXIS0))) continue;
    int64_t blocked = axis == 1 ? K : rows;
    if (f->block && blocked % f->block)
      return nvl_error(NVL_EINVAL, OP ": %s blocks %d elements along the weight's %s, whose length %lld is not a "
                       "multiple of %d", f->name, f->block, axis == 1 ? "columns (K)" : "rows", (long long)blocked, f->block);
  }
  if (o->block2d && (rows % 16 || K % 16))
    return nvl_error(NVL_EINVAL, OP ": 16x16 blocks need both dims of the weight to be multiples of 16, got %lld x %lld",
                     (long long)rows, (long long)K);
  int given = (o->has_amax != 0) + (o->amax_t != NULL) + (o->amax_of != NULL);
  if (given > 1) return nvl_error(NVL_EINVAL, OP ": give the amax as a number, a tensor or a quantized tensor, not two");
  if (given && !f->global_amax)
    return nvl_error(NVL_EINVAL, OP ": amax applies to formats with a per-tensor scale (fp8, nvfp4), not %s", f->name);
  if (o->has_amax && !(o->amax >= 0))
    return nvl_error(NVL_EINVAL, OP ": amax must be a non-negative number, got %g", o->amax);
  const nvl_backend *be;
  NVL_PICK(be, shard, formats[format].quantize, OP);
  int on_host = shard->device == NVL_CPU, reduce = f->global_amax && !given;

  /* the global amax: max over the shards' (NaN ignored, as every amax), reduced exactly */
  float amax = 0;
  nvl_tensor amax_t = nvl_tensor_null();
  if (reduce) NVL_TRY(nvl_quant_amax(&amax_t, shard, 1, 0));
  if (reduce && on_host) amax = *(const float *)nvl_tensor_data(&amax_t);
  nvl_status st = NVL_OK;
  if (world > 1) {
    static const char *const names[] = {"K (the weight's columns)", "the weight's rows", "the format", "the copies",
                                        "the block layout", "the scale rule", "the shard's dtype", "the device",
                                        "whether an amax is given", "the split's alignment"};
    const int64_t vals[] = {K, rows, format, copies, o->block2d, o->rule, shard->dtype, shard->device, given, align};
    st = agree(vals, names, (int)(sizeof vals / sizeof vals[0]), !o->nocheck, reduce && on_host ? &amax : NULL);
    if (st == NVL_OK && reduce && !on_host) st = nvl_dist_all_reduce_ordered(&amax_t, NVL_DIST_MAX);
  }
  nvl_qgather *g = st == NVL_OK ? calloc(1, sizeof *g) : NULL;
  if (st == NVL_OK && !g) st = nvl_error(NVL_ENOMEM, OP ": out of host memory");
  if (st != NVL_OK) {
    nvl_tensor_release(&amax_t);
    return st;
  }
  for (int i = 0; i < 2; i++) {
    g->q[i] = nvl_qtensor_null();
    g->stage[i] = nvl_tensor_null();
  }
  for (int i = 0; i < 4; i++) g->ticket[i] = -1;
  g->copies = copies;
  g->rows = rows;
  g->K = K;
  g->align = align;
  g->world = world;
  g->rank = rank;
  int swz = !on_host && be->swizzled_scales;

  /* each copy: this rank's rows quantized with the global amax (the whole weight's codes and scales
   * there), its gathers started */
  for (int c = 0; st == NVL_OK && c < 2; c++) {
    if (!(copies & (c == 0 ? NVL_QG_AXIS1 : NVL_QG_AXIS0))) continue;
    int axis = c == 0 ? 1 : 0;
    nvl_quant_opts qo = {.axis = axis, .block2d = c == 0 && o->block2d, .rule = o->rule};
    if (o->has_amax) { qo.has_amax = 1; qo.amax = o->amax; }
    qo.amax_t = o->amax_t;
    qo.amax_of = o->amax_of;
    if (reduce && on_host) { qo.has_amax = 1; qo.amax = amax; }
    if (reduce && !on_host) qo.amax_t = &amax_t;
    nvl_qtensor qs = nvl_qtensor_null();
    st = nvl_quantize(&qs, shard, format, &qo);
    if (st != NVL_OK) break;
    if (world == 1) { /* the shard is the weight */
      g->q[c] = qs;
      continue;
    }
    nvl_qtensor *q = &g->q[c];
    *q = qs; /* the header: format, layout, amax (the global one), options */
    q->data = nvl_tensor_null();
    q->scales = nvl_tensor_null();
    q->amax_dev = nvl_tensor_null();
    if (qs.amax_dev.storage) nvl_tensor_share(&q->amax_dev, &qs.amax_dev);
    q->shape[0] = rows;
    q->shape[1] = K;
    q->rows = axis == 1 ? rows : K;
    q->K = axis == 1 ? K : rows;
    if (!f->global_amax) { /* without a per-tensor scale the amax is information only; not reduced */
      q->amax = NAN;
      q->scale = 0;
    }
    st = axis == 1 ? start_axis1(g, &qs, n, chunk, swz) : start_axis0(g, &qs, n, chunk, swz);
    nvl_qtensor_release(&qs); /* stream order: freed after the copies that read it */
  }
  nvl_tensor_release(&amax_t); /* a device amax is shared by the copies */
  if (st != NVL_OK) {
    nvl_qgather_free(g);
    return st;
  }
  *gp = g;
  return NVL_OK;
}

nvl_status nvl_quantize_all_gather_wait(nvl_qtensor out[2], nvl_qgather *g) {
  nvl_status st = NVL_OK;
  for (int i = 0; i < 4; i++) {
    nvl_status s = nvl_dist_all_gather_wait(g->ticket[i]);
    g->ticket[i] = -1;
    if (st == NVL_OK) st = s;
  }
  if (st == NVL_OK && g->world > 1 && (g->copies & NVL_QG_AXIS0)) {
    nvl_qtensor *q = &g->q[1];
    st = place_slabs(&q->data, &g->stage[0], code_cols, q->format, g);
    if (st == NVL_OK && q->scales.storage)
      st = place_slabs(&q->scales, &g->stage[1], scale_cols, nvl_dtypes[q->format].block, g);
  }
  for (int c = 0; st == NVL_OK && g->world > 1 && c < 2; c++)
    if (g->q[c].data.storage) st = nvl_qtensor_swizzle(&g->q[c]); /* nothing on the host */
  if (st != NVL_OK) {
    nvl_qgather_free(g);
    return st;
  }
  for (int c = 0; c < 2; c++) {
    out[c] = g->q[c];
    g->q[c] = nvl_qtensor_null();
  }
  nvl_qgather_free(g);
  return NVL_OK;
}

nvl_status nvl_quantize_all_gather(nvl_qtensor out[2], const nvl_tensor *shard, int64_t rows, nvl_dtype format,
                                   const nvl_qgather_opts *o) {
  nvl_qgather *g;
  NVL_TRY(nvl_quantize_all_gather_start(&g, shard, rows, format, o));
  return nvl_quantize_all_gather_wait(out, g);
}
