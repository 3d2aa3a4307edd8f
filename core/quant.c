/* quant.c: quantized tensors — validation against the format's traits row, the blocked layout,
 * one kernel-table call per quantization or GEMM (dispatch.h), and the host-side views of codes
 * and scales (see quant.h). Nothing here switches on a format: the traits row (dtype.h) says what
 * a format has (block length, scale kind, element bits, SR, 2-D blocks, a global amax) and the
 * backend's row for the format does the work.
 *
 * Block scales on a backend with swizzled_scales (CUDA): q.scales, a (rows, K/block) view at
 * offset 0 of its storage, is followed in the same storage, at a 256-byte aligned offset, by the
 * same bytes in cuBLASLt's 128x4 swizzled layout (backend.h nvl_swizzled_bytes), which native
 * block-scaled GEMMs read. dequantize / codes / scale_bytes of a device q copy its codes and scales
 * to the host and decode there. */
#include <math.h>
#include <string.h>
#include "dispatch.h"
#include "quant.h"

void nvl_qtensor_release(nvl_qtensor *q) {
  nvl_tensor_release(&q->data);
  nvl_tensor_release(&q->scales);
  nvl_tensor_release(&q->amax_dev);
  q->amax_pending = 0;
}

nvl_status nvl_qtensor_resolve_amax(nvl_qtensor *q) {
  if (!q->amax_pending) return NVL_OK;
  if (!q->amax_dev.storage) return nvl_error(NVL_ESTATE, "amax: quantized tensor has been freed");
  nvl_tensor h = nvl_tensor_null();
  NVL_TRY(nvl_tensor_clone_to(&h, &q->amax_dev, NVL_F32, NVL_CPU)); /* waits for the kernels that wrote it */
  q->amax = *(const float *)nvl_tensor_data(&h);
  nvl_tensor_release(&h);
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  if (f->enc_scale) q->scale = f->enc_scale(q->amax);
  q->amax_pending = 0;
  return NVL_OK;
}

/* ---- the blocked layout on the host ---------------------------------------------------------- */

/* perm moving axis last; returns the permuted shape too. */
static void axis_last_perm(int ndim, const int64_t *shape, int axis, int *perm, int64_t *pshape) {
  int k = 0;
  for (int d = 0; d < ndim; d++)
    if (d != axis) perm[k++] = d;
  perm[k] = axis;
  for (int d = 0; d < ndim; d++) pshape[d] = shape[perm[d]];
}

/* out = t (rows, Kt) in the blocked layout of q, presented in q's logical shape with the
 * blocked dim of length Kt (contiguous host copy). */
/* out (on device dev) = t read as q's blocked layout, moved back to q's logical shape. */
static nvl_status from_blocked_on(nvl_tensor *out, const nvl_tensor *t, const nvl_qtensor *q, int64_t Kt, nvl_device dev) {
  int perm[NVL_MAX_DIMS], inv[NVL_MAX_DIMS];
  int64_t pshape[NVL_MAX_DIMS];
  axis_last_perm(q->ndim, q->shape, q->axis, perm, pshape);
  pshape[q->ndim - 1] = Kt;
  for (int d = 0; d < q->ndim; d++) inv[perm[d]] = d;
  nvl_tensor v = nvl_tensor_null(), p = nvl_tensor_null();
  NVL_TRY(nvl_tensor_view(&v, t, q->ndim, pshape));
  nvl_status st = nvl_tensor_permute(&p, &v, inv);
  if (st == NVL_OK) st = nvl_tensor_clone_to(out, &p, t->dtype, dev);
  nvl_tensor_release(&v);
  nvl_tensor_release(&p);
  return st;
}

static nvl_status from_blocked(nvl_tensor *out, const nvl_tensor *t, const nvl_qtensor *q, int64_t Kt) {
  return from_blocked_on(out, t, q, Kt, NVL_CPU);
}

static nvl_status check_signs(const float *s) {
  for (int i = 0; i < 16; i++)
    if (s[i] != 1.0f && s[i] != -1.0f) return nvl_error(NVL_EINVAL, "rht: sign %d is %g; signs must be +1 or -1", i + 1, s[i]);
  return NVL_OK;
}

nvl_status nvl_rht(nvl_tensor *out, const nvl_tensor *x, int axis, const float *signs) {
  char d[160];
  const nvl_backend *be;
  NVL_TRY(nvl_tensor_check_live(x, "rht"));
  if (!nvl_dtypes[x->dtype].is_float || x->ndim < 1)
    return nvl_error(NVL_EINVAL, "rht: expects a float tensor with at least one dim, got %s", nvl_tensor_desc(x, d, sizeof d));
  if (axis < 0) axis = x->ndim - 1;
  if (axis >= x->ndim) return nvl_error(NVL_EINVAL, "rht: dim %d out of range for %s", axis + 1, nvl_tensor_desc(x, d, sizeof d));
  if (signs) NVL_TRY(check_signs(signs));
  int64_t K = x->shape[axis], rows = K ? nvl_tensor_numel(x) / K : 0;
  if (K % 16)
    return nvl_error(NVL_EINVAL, "rht: works on 16-element chunks, but dim %d of %s has length %lld", axis + 1,
                     nvl_tensor_desc(x, d, sizeof d), (long long)K);
  NVL_PICK(be, x, rht, "rht");
  if (x->device != NVL_CPU) return nvl_unsupported(be, "rht"); /* the result is presented through host views */
  int perm[NVL_MAX_DIMS];
  int64_t pshape[NVL_MAX_DIMS], shape2[2] = {rows, K};
  axis_last_perm(x->ndim, x->shape, axis, perm, pshape);
  nvl_tensor p = nvl_tensor_null(), c = nvl_tensor_null(), b = nvl_tensor_null();
  nvl_status st = nvl_tensor_permute(&p, x, perm);
  if (st == NVL_OK) st = nvl_tensor_clone_to(&c, &p, NVL_F32, NVL_CPU);
  if (st == NVL_OK) st = nvl_tensor_view(&b, &c, 2, shape2); /* (rows, K) f32 */
  if (st == NVL_OK) st = NVL_CALL(be, &b, rht, nvl_tensor_data(&b), nvl_tensor_data(&b), rows, K, signs, 0);
  nvl_qtensor shape_of = nvl_qtensor_null();
  shape_of.ndim = x->ndim;
  memcpy(shape_of.shape, x->shape, sizeof x->shape);
  shape_of.axis = axis;
  if (st == NVL_OK) st = from_blocked(out, &b, &shape_of, K);
  nvl_tensor_release(&p);
  nvl_tensor_release(&c);
  nvl_tensor_release(&b);
  return st;
}

/* ---- swizzled scales ------------------------------------------------------------------------- */

static size_t swizzled_offset(int64_t rows, int64_t nb) { return ((size_t)(rows * nb) + 255) & ~(size_t)255; }

/* The swizzled scales of q, or NULL if it has none. */
static const uint8_t *qtensor_swizzled(const nvl_qtensor *q) {
  int block = nvl_dtypes[q->format].block;
  if (!q->scales.storage || q->scales.offset != 0 || block == 0) return NULL;
  int64_t nb = q->K / block;
  size_t off = swizzled_offset(q->rows, nb);
  if (q->scales.storage->bytes < off + nvl_swizzled_bytes(q->rows, nb)) return NULL;
  return (const uint8_t *)q->scales.storage->data + off;
}

nvl_status nvl_qtensor_swizzled_scales(nvl_tensor *out, const nvl_qtensor *q) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "swizzled_scales: quantized tensor has been freed");
  if (!qtensor_swizzled(q))
    return nvl_error(NVL_EINVAL, "swizzled_scales: this %s tensor carries no swizzled scales (only block scales "
                     "quantized on a backend that writes them have them)", nvl_dtypes[q->format].name);
  int block = nvl_dtypes[q->format].block;
  int64_t nb = q->K / block, n = (int64_t)nvl_swizzled_bytes(q->rows, nb);
  size_t off = swizzled_offset(q->rows, nb);
  nvl_tensor full = nvl_tensor_null(), part = nvl_tensor_null();
  full = q->scales; /* the whole storage as a 1-D u8 view */
  full.ndim = 1;
  full.shape[0] = (int64_t)q->scales.storage->bytes;
  full.strides[0] = 1;
  full.offset = 0;
  NVL_TRY(nvl_tensor_narrow(&part, &full, 0, (int64_t)off, n));
  nvl_status st = nvl_tensor_clone_to(out, &part, NVL_U8, NVL_CPU);
  nvl_tensor_release(&part);
  return st;
}

nvl_status nvl_qtensor_alloc_scales(nvl_tensor *scales, uint8_t **swz_p, nvl_device device, int64_t rows, int64_t nb,
                                    int swz, size_t extra) {
  size_t off = swz ? swizzled_offset(rows, nb) : (size_t)(rows * nb);
  size_t need = off + (swz ? nvl_swizzled_bytes(rows, nb) : 0);
  int64_t total = (int64_t)(need > extra ? need : extra), shape2[2] = {rows, nb};
  nvl_tensor full = nvl_tensor_null(), part = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&full, NVL_U8, device, 1, &total));
  nvl_status st = nvl_tensor_narrow(&part, &full, 0, 0, rows * nb);
  if (st == NVL_OK) st = nvl_tensor_view(scales, &part, 2, shape2);
  *swz_p = st == NVL_OK && swz ? (uint8_t *)full.storage->data + off : NULL;
  nvl_tensor_release(&part);
  nvl_tensor_release(&full);
  return st;
}

static nvl_status alloc_scales(nvl_tensor *scales, uint8_t **swz_p, nvl_device device, int64_t rows, int64_t nb,
                               int swz) {
  return nvl_qtensor_alloc_scales(scales, swz_p, device, rows, nb, swz, 0);
}

/* ---- quantize ------------------------------------------------------------------------------- */

/* The options check against the format's traits row. */
static nvl_status check_quant_opts(const nvl_tensor *x, nvl_dtype format, const nvl_quant_opts *o, int axis,
                                   int64_t rows, int64_t K) {
  char d[160];
  const nvl_dtype_traits *f = &nvl_dtypes[format];
  if (f->block && K % f->block)
    return nvl_error(NVL_EINVAL, "quantize: %s blocks %d elements along dim %d, whose length %lld is not a multiple of %d (x is %s)",
                     f->name, f->block, axis + 1, (long long)K, f->block, nvl_tensor_desc(x, d, sizeof d));
  if (o->rht && K % 16)
    return nvl_error(NVL_EINVAL, "quantize: the RHT works on 16-element chunks, but dim %d has length %lld (x is %s)", axis + 1,
                     (long long)K, nvl_tensor_desc(x, d, sizeof d));
  if (o->rht && o->signs) NVL_TRY(check_signs(o->signs));
  if (o->rht_col)
    return nvl_error(NVL_EINVAL, "quantize: rht_col (the column copy's RHT) is an option of quantize_rowcol");
  if (o->block2d && !f->block2d)
    return nvl_error(NVL_EINVAL, "quantize: block = \"2d\" (16x16 tiles) is not offered by %s", f->name);
  if (o->block2d && (x->ndim != 2 || rows % 16))
    return nvl_error(NVL_EINVAL, "quantize: 2d (16x16) blocks need a 2-D tensor whose dims are multiples of 16, got %s",
                     nvl_tensor_desc(x, d, sizeof d));
  if (o->sr && !f->sr)
    return nvl_error(NVL_EINVAL, "quantize: stochastic rounding is defined for e2m1 elements (nvfp4, mxfp4), not %s", f->name);
  if (o->has_amax && !f->global_amax)
    return nvl_error(NVL_EINVAL, "quantize: amax applies to formats with a per-tensor scale (fp8, nvfp4), not %s", f->name);
  if ((o->sr_row_offset || o->sr_k_offset || o->sr_k_total) && !o->sr)
    return nvl_error(NVL_EINVAL, "quantize: sr_row_offset / sr_k_offset / sr_k_total place the stochastic rounding "
                     "draws; they need sr = true");
  if (o->sr) {
    int64_t kt = o->sr_k_total ? o->sr_k_total : K, grows, gsize; /* the global layout: grows x kt */
    if (o->sr_row_offset < 0 || o->sr_k_offset < 0 || o->sr_k_total < 0 || o->sr_k_offset % f->block || kt % f->block ||
        o->sr_k_offset > kt - K || nvl_add_overflow(o->sr_row_offset, rows, &grows) ||
        nvl_mul_overflow(grows, kt, &gsize) || gsize > NVL_MAX_NUMEL)
      return nvl_error(NVL_EINVAL, "quantize: SR slab offsets (row %lld, k %lld, k total %lld) do not fit a block "
                       "length of %lld (offsets >= 0, k offset and total multiples of %d, k offset + %lld <= total, "
                       "the whole layout at most 2^59 elements)",
                       (long long)o->sr_row_offset, (long long)o->sr_k_offset, (long long)o->sr_k_total, (long long)K,
                       f->block, (long long)K);
  }
  if (o->has_amax && !(o->amax >= 0))
    return nvl_error(NVL_EINVAL, "quantize: amax must be a non-negative number, got %g", o->amax);
  if (o->amax_t) {
    const nvl_tensor *a = o->amax_t;
    if (o->has_amax || o->amax_of)
      return nvl_error(NVL_EINVAL, "quantize: give amax as a number, a quantized tensor or a tensor, not two of them");
    if (!f->global_amax)
      return nvl_error(NVL_EINVAL, "quantize: amax applies to formats with a per-tensor scale (fp8, nvfp4), not %s", f->name);
    NVL_TRY(nvl_tensor_check_live(a, "quantize"));
    if (a->dtype != NVL_F32 || nvl_tensor_numel(a) != 1 || !nvl_tensor_is_contiguous(a))
      return nvl_error(NVL_EINVAL, "quantize: an amax tensor must hold one f32 value, got %s", nvl_tensor_desc(a, d, sizeof d));
    if (a->device != NVL_CPU && !nvl_tensor_same_device(a, x))
      return nvl_error(NVL_EINVAL, "quantize: the amax tensor is on another device than x");
  }
  if (o->amax_of) {
    const nvl_qtensor *a = o->amax_of;
    if (o->has_amax) return nvl_error(NVL_EINVAL, "quantize: give amax as a number or as a quantized tensor, not both");
    if (!f->global_amax)
      return nvl_error(NVL_EINVAL, "quantize: amax applies to formats with a per-tensor scale (fp8, nvfp4), not %s", f->name);
    if (!a->data.storage) return nvl_error(NVL_ESTATE, "quantize: the quantized tensor given as amax has been freed");
    if (!nvl_dtypes[a->format].global_amax)
      return nvl_error(NVL_EINVAL, "quantize: the quantized tensor given as amax is %s, which has no per-tensor amax",
                       nvl_dtypes[a->format].name);
    if (a->amax_pending && !nvl_tensor_same_device(&a->amax_dev, x))
      return nvl_error(NVL_EINVAL, "quantize: the quantized tensor given as amax is on another device than x");
  }
  if ((unsigned)o->rule >= NVL_MX_RULE_COUNT) return nvl_error(NVL_EINVAL, "quantize: invalid scale rule %d", (int)o->rule);
  return NVL_OK;
}

/* A prepared quantization: the output's header and storage, x's contiguous copy (if one was
 * needed), and the kernel's description. */
typedef struct {
  const nvl_backend *be;
  nvl_qtensor q;
  nvl_tensor xc; /* x itself (shared) or its contiguous copy */
  nvl_qdesc d;
  int aliased;   /* q.data is a view of x: nothing to run (nvl_quant_opts.view) */
} prepared;

static void prepared_init(prepared *p) {
  memset(p, 0, sizeof *p);
  p->q = nvl_qtensor_null();
  p->xc = nvl_tensor_null();
}

static void prepared_release(prepared *p) {
  nvl_qtensor_release(&p->q);
  nvl_tensor_release(&p->xc);
}

/* Validate, allocate the outputs on x's device, and describe the kernel call. */
static nvl_status quantize_prepare(prepared *p, const nvl_tensor *x, nvl_dtype format, const nvl_quant_opts *o) {
  char d[160];
  prepared_init(p);
  NVL_TRY(nvl_tensor_check_live(x, "quantize"));
  if ((unsigned)format >= NVL_DTYPE_COUNT || !nvl_dtypes[format].is_float)
    return nvl_error(NVL_EINVAL, "quantize: invalid format (valid: %s)", nvl_qformat_names());
  const nvl_dtype_traits *f = &nvl_dtypes[format];
  if ((x->dtype != NVL_F32 && x->dtype != NVL_BF16) || x->ndim < 1)
    return nvl_error(NVL_EINVAL, "quantize: expects a float tensor with at least one dim, got %s",
                     nvl_tensor_desc(x, d, sizeof d));
  int axis = o->axis < 0 ? x->ndim - 1 : o->axis;
  if (axis >= x->ndim)
    return nvl_error(NVL_EINVAL, "quantize: axis %d out of range for %s", axis + 1, nvl_tensor_desc(x, d, sizeof d));
  int64_t K = x->shape[axis], rows = K ? nvl_tensor_numel(x) / K : 0;
  NVL_TRY(check_quant_opts(x, format, o, axis, rows, K));
  const nvl_backend *be;
  NVL_PICK(be, x, formats[format].quantize, "quantize");
  p->be = be;

  nvl_qtensor *q = &p->q;
  q->format = format;
  q->layout = o->block2d ? NVL_LAYOUT_16X16 : f->layout;
  q->ndim = x->ndim;
  memcpy(q->shape, x->shape, sizeof x->shape);
  q->axis = axis;
  q->rows = rows;
  q->K = K;
  q->rht = o->rht;
  memcpy(q->signs, o->signs ? o->signs : nvl_rht16_default_signs, sizeof q->signs);
  q->rule = o->rule;
  if (o->sr) {
    q->sr = 1;
    q->seed = o->gen ? o->gen->seed : o->seed;
    q->offset = o->gen ? o->gen->offset : o->offset;
  }

  nvl_qdesc *dd = &p->d;
  NVL_TRY(nvl_tensor_contiguous(&p->xc, x));
  dd->format = format;
  dd->x = nvl_tensor_data(&p->xc);
  dd->x_dtype = x->dtype;
  dd->B = 1;
  dd->C = 1;
  for (int i = 0; i < x->ndim; i++) {
    if (i < axis) dd->B *= x->shape[i];
    if (i > axis) dd->C *= x->shape[i];
  }
  dd->K = K;
  dd->block2d = o->block2d;
  dd->rht = o->rht;
  memcpy(dd->signs, q->signs, sizeof dd->signs);
  dd->rule = o->rule;
  dd->sr = q->sr;
  dd->seed = q->seed;
  dd->offset = q->offset;
  dd->sr_row_offset = o->sr_row_offset;
  dd->sr_k_offset = o->sr_k_offset;
  dd->sr_k_total = o->sr_k_total;
  dd->has_amax = o->has_amax;
  dd->amax = o->amax;
  if (o->amax_of && !o->amax_of->amax_pending) { /* its amax is known on the host: a given number */
    dd->has_amax = 1;
    dd->amax = o->amax_of->amax;
  }
  if (o->amax_t && o->amax_t->device == NVL_CPU) { /* a host tensor: its value, as a given number */
    dd->has_amax = 1;
    dd->amax = *(const float *)nvl_tensor_data(o->amax_t);
    if (!(dd->amax >= 0))
      return nvl_error(NVL_EINVAL, "quantize: amax must be a non-negative number, got %g", dd->amax);
  }
  /* a format without a per-tensor scale only reports its amax: on a device, where reading it back
   * is a host synchronisation per cast (issue 15 D9), it is not computed and q.amax is NaN. A
   * per-tensor format's amax stays on the device (amax_dev, read back only when asked for) unless
   * the host gave it. */
  if (x->device != NVL_CPU && f->global_amax && !dd->has_amax) {
    dd->amax_out = NULL;
    q->amax = q->scale = NAN;
    q->amax_pending = 1;
    if (o->amax_of || o->amax_t) {
      nvl_tensor_share(&q->amax_dev, o->amax_t ? o->amax_t : &o->amax_of->amax_dev);
      dd->amax_dev_in = nvl_tensor_data(&q->amax_dev);
    } else {
      int64_t one = 1;
      NVL_TRY(nvl_tensor_empty(&q->amax_dev, NVL_F32, x->device, 1, &one));
      dd->amax_dev_out = nvl_tensor_data(&q->amax_dev);
    }
  } else if (f->global_amax || x->device == NVL_CPU) {
    dd->amax_out = &q->amax;
  } else {
    dd->amax_out = NULL;
    q->amax = NAN;
  }

  /* quantizing to x's own dtype along its contiguous last dim without the RHT is the identity: with
   * opts.view the result is a (rows, K) view of x, no copy and no kernel */
  if (o->view && format == x->dtype && !o->rht && axis == x->ndim - 1 && nvl_tensor_is_contiguous(x)) {
    int64_t vshape[2] = {rows, K};
    NVL_TRY(nvl_tensor_view(&q->data, x, 2, vshape));
    q->amax = NAN; /* as a device cast to f32/bf16 reports it (not computed); scale 0 */
    p->aliased = 1;
    return NVL_OK;
  }
  /* rows * K is x's numel (<= NVL_MAX_NUMEL, tensor.h): code bytes and scale counts cannot overflow */
  int64_t cshape[2] = {rows, f->is_quantized ? nvl_code_bytes(format, K) : K};
  NVL_TRY(nvl_tensor_empty(&q->data, f->is_quantized ? NVL_U8 : format, x->device, 2, cshape));
  dd->codes = nvl_tensor_data(&q->data);
  if (f->block) {
    NVL_TRY(alloc_scales(&q->scales, &dd->scales_swz, x->device, rows, K / f->block, be->swizzled_scales));
    dd->scales = nvl_tensor_data(&q->scales);
  }
  return NVL_OK;
}

/* After the kernel: the per-tensor scale from the amax used, and the generator's draw. */
static void quantize_finish(nvl_qtensor *q, const nvl_quant_opts *o) {
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  if (f->enc_scale && !q->amax_pending) q->scale = f->enc_scale(q->amax);
  if (o->sr && o->gen) o->gen->offset++;
}

nvl_status nvl_quantize(nvl_qtensor *out, const nvl_tensor *x, nvl_dtype format, const nvl_quant_opts *opts) {
  static const nvl_quant_opts defaults = {.axis = -1};
  const nvl_quant_opts *o = opts ? opts : &defaults;
  prepared p;
  nvl_status st = quantize_prepare(&p, x, format, o);
  if (st == NVL_OK && !p.aliased) st = NVL_CALL(p.be, x, formats[format].quantize, &p.d);
  if (st != NVL_OK) {
    prepared_release(&p);
    return st;
  }
  quantize_finish(&p.q, o);
  nvl_tensor_release(&p.xc);
  *out = p.q;
  return NVL_OK;
}

nvl_status nvl_quant_amax(nvl_tensor *out, const nvl_tensor *x, int axis, int rht) {
  nvl_quant_opts o = {.axis = axis, .rht = rht};
  NVL_TRY(nvl_tensor_check_live(x, "quant_amax"));
  if (x->device == NVL_CPU) { /* the amax of a quantization (fp8's, which computes nothing more) */
    nvl_qtensor q = nvl_qtensor_null();
    NVL_TRY(nvl_quantize(&q, x, NVL_E4M3, &o));
    float a = q.amax;
    nvl_qtensor_release(&q);
    int64_t one = 1;
    NVL_TRY(nvl_tensor_empty(out, NVL_F32, NVL_CPU, 1, &one));
    *(float *)nvl_tensor_data(out) = a;
    return NVL_OK;
  }
  prepared p;
  nvl_status st = quantize_prepare(&p, x, NVL_E4M3, &o); /* a device q keeps its amax there */
  if (st == NVL_OK && !p.q.amax_pending) st = nvl_error(NVL_EINVAL, "quant_amax: internal error: no device amax");
  if (st == NVL_OK) {
    p.d.amax_only = 1;
    st = NVL_CALL(p.be, x, formats[NVL_E4M3].quantize, &p.d);
  }
  if (st == NVL_OK) nvl_tensor_share(out, &p.q.amax_dev);
  prepared_release(&p);
  return st;
}

nvl_status nvl_quantize_rowcol(nvl_qtensor *row, nvl_qtensor *col, const nvl_tensor *x, nvl_dtype format,
                               const nvl_quant_opts *opts) {
  char d[160];
  static const nvl_quant_opts defaults = {.axis = -1};
  const nvl_quant_opts *o = opts ? opts : &defaults;
  NVL_TRY(nvl_tensor_check_live(x, "quantize_rowcol"));
  if (x->ndim != 2)
    return nvl_error(NVL_EINVAL, "quantize_rowcol: needs a 2-D tensor, got %s", nvl_tensor_desc(x, d, sizeof d));
  nvl_quant_opts orow = *o, ocol = *o;
  orow.axis = 1;
  ocol.axis = 0;
  orow.view = ocol.view = 0; /* both copies are written by one kernel */
  orow.rht_col = ocol.rht_col = 0;
  if (o->rht_col) { /* the column copy is in the RHT domain: a given amax (x's) is the row copy's only */
    ocol.rht = 1;
    ocol.has_amax = 0;
    ocol.amax_of = NULL;
    ocol.amax_t = NULL;
  }
  orow.gen = ocol.gen = NULL; /* the two draws: offsets o and o + 1 of the generator */
  if (o->gen) {
    orow.seed = ocol.seed = o->gen->seed;
    orow.offset = o->gen->offset;
    ocol.offset = o->gen->offset + 1;
  }
  prepared r, c;
  prepared_init(&c);
  nvl_status st = quantize_prepare(&r, x, format, &orow);
  if (st == NVL_OK) st = quantize_prepare(&c, x, format, &ocol);
  if (st == NVL_OK && r.be->quantize_pair) {
    st = NVL_CALL(r.be, x, quantize_pair, &r.d, &c.d);
  } else if (st == NVL_OK) { /* the definition: two quantizations in a row */
    st = NVL_CALL(r.be, x, formats[format].quantize, &r.d);
    if (st == NVL_OK) st = NVL_CALL(c.be, x, formats[format].quantize, &c.d);
  }
  if (st != NVL_OK) {
    prepared_release(&r);
    prepared_release(&c);
    return st;
  }
  quantize_finish(&r.q, &orow);
  quantize_finish(&c.q, &ocol);
  if (o->sr && o->gen) o->gen->offset += 2;
  nvl_tensor_release(&r.xc);
  nvl_tensor_release(&c.xc);
  *row = r.q;
  *col = c.q;
  return NVL_OK;
}

/* ---- dequantize and the host views ---------------------------------------------------------- */

nvl_status nvl_qtensor_host(nvl_qtensor *h, const nvl_qtensor *q) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "cpu: quantized tensor has been freed");
  NVL_TRY(nvl_qtensor_resolve_amax((nvl_qtensor *)q)); /* fills q's host cache of its amax */
  *h = *q;
  h->data = nvl_tensor_null();
  h->scales = nvl_tensor_null();
  h->amax_dev = nvl_tensor_null();
  nvl_status st = nvl_tensor_clone_to(&h->data, &q->data, q->data.dtype, NVL_CPU);
  if (st == NVL_OK && q->scales.storage) st = nvl_tensor_clone_to(&h->scales, &q->scales, NVL_U8, NVL_CPU);
  if (st != NVL_OK) nvl_qtensor_release(h);
  return st;
}

/* For a device q: run fn on its host copy and return. */
#define NVL_ON_HOST(fn, out, q)                                 \
  do {                                                          \
    if ((q)->data.storage && (q)->data.device != NVL_CPU) {     \
      nvl_qtensor h_;                                           \
      NVL_TRY(nvl_qtensor_host(&h_, (q)));                          \
      nvl_status st_ = fn((out), &h_);                          \
      nvl_qtensor_release(&h_);                                 \
      return st_;                                               \
    }                                                           \
  } while (0)

/* The kernels' view of a live q. */
static nvl_qview qview_of(const nvl_qtensor *q) {
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  nvl_qview v;
  v.format = q->format;
  v.codes = nvl_tensor_data(&q->data);
  v.scales = q->scales.storage ? nvl_tensor_data(&q->scales) : NULL;
  v.scales_swz = qtensor_swizzled(q);
  v.rows = q->rows;
  v.K = q->K;
  v.amax = q->amax;
  v.scale = q->scale;
  v.alpha = f->dec_scale ? f->dec_scale(q->amax, q->scale) : 1.0f;
  if (q->factor != 0.0f) v.alpha *= q->factor; /* assembled: no pending amax, dec_scale-free formats */
  v.amax_dev = q->amax_pending ? nvl_tensor_data(&q->amax_dev) : NULL;
  return v;
}

/* b (rows, K) f32 on dev = q decoded by its backend; an RHT operand's values moved back to x's domain
 * (x R^T, NUMERICS §5, by the backend's inverse rht in place) unless rotated. */
static nvl_status decode_blocked(nvl_tensor *b, const nvl_qtensor *q, nvl_device dev, int rotated) {
  const nvl_backend *be, *bt = NULL, *bs = NULL;
  NVL_PICK(be, &q->data, formats[q->format].dequantize, "dequantize");
  if (q->rht && !rotated) NVL_PICK_DEV(bt, dev, rht, "dequantize (the inverse RHT)");
  if (q->factor != 0.0f) NVL_PICK_DEV(bs, dev, scale, "dequantize (the factor)");
  int64_t shape2[2] = {q->rows, q->K};
  NVL_TRY(nvl_tensor_empty(b, NVL_F32, dev, 2, shape2));
  nvl_qview v = qview_of(q);
  nvl_status st = NVL_CALL(be, b, formats[q->format].dequantize, nvl_tensor_data(b), &v, 0, q->rows, 0);
  if (st == NVL_OK && bs) /* an assembled q's factor: value * factor, one fp32 multiply */
    st = NVL_CALL(bs, b, scale, nvl_tensor_data(b), (double)q->factor, q->rows * q->K);
  if (st == NVL_OK && bt) st = NVL_CALL(bt, b, rht, nvl_tensor_data(b), nvl_tensor_data(b), q->rows, q->K, q->signs, 1);
  if (st != NVL_OK) nvl_tensor_release(b);
  return st;
}

nvl_status nvl_dequantize(nvl_tensor *out, const nvl_qtensor *q, int rotated) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "dequantize: quantized tensor has been freed");
  if (q->data.device != NVL_CPU) { /* decoded from a host copy */
    nvl_qtensor h = nvl_qtensor_null();
    NVL_TRY(nvl_qtensor_host(&h, q));
    nvl_status st = nvl_dequantize(out, &h, rotated);
    nvl_qtensor_release(&h);
    return st;
  }
  nvl_tensor b = nvl_tensor_null();
  NVL_TRY(decode_blocked(&b, q, NVL_CPU, rotated));
  nvl_status st = from_blocked(out, &b, q, q->K);
  nvl_tensor_release(&b);
  return st;
}

nvl_status nvl_dequantize_on_device(nvl_tensor *out, nvl_qtensor *q, int rotated) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "dequantize: quantized tensor has been freed");
  if (q->data.device == NVL_CPU) return nvl_dequantize(out, q, rotated);
  NVL_TRY(nvl_qtensor_resolve_amax(q)); /* the global factor, on the host */
  nvl_tensor b = nvl_tensor_null();
  NVL_TRY(decode_blocked(&b, q, q->data.device, rotated));
  nvl_status st = from_blocked_on(out, &b, q, q->K, q->data.device);
  nvl_tensor_release(&b);
  return st;
}

nvl_status nvl_qtensor_codes(nvl_tensor *out, const nvl_qtensor *q) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "codes: quantized tensor has been freed");
  NVL_ON_HOST(nvl_qtensor_codes, out, q);
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  if (!f->is_quantized)
    return nvl_error(NVL_EINVAL, "codes: %s holds plain values, not codes; use dequantize()", f->name);
  if (f->bits == 8) return from_blocked(out, &q->data, q, q->K);
  int64_t shape2[2] = {q->rows, q->K}; /* 4-bit codes: unpacked, the lower index from the low nibble */
  nvl_tensor u = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&u, NVL_U8, NVL_CPU, 2, shape2));
  const uint8_t *src = nvl_tensor_data(&q->data);
  uint8_t *dst = nvl_tensor_data(&u);
  for (int64_t i = 0; i < q->rows * q->K; i++) dst[i] = (i % 2) ? (src[i / 2] >> 4) : (src[i / 2] & 0xF);
  nvl_status st = from_blocked(out, &u, q, q->K);
  nvl_tensor_release(&u);
  return st;
}

nvl_status nvl_qtensor_scale_bytes(nvl_tensor *out, const nvl_qtensor *q) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "scale_bytes: quantized tensor has been freed");
  if (!q->scales.storage)
    return nvl_error(NVL_EINVAL, "scale_bytes: %s has no block scales (per-tensor scale: q.scale)", nvl_dtypes[q->format].name);
  NVL_ON_HOST(nvl_qtensor_scale_bytes, out, q);
  return from_blocked(out, &q->scales, q, q->K / nvl_dtypes[q->format].block);
}

/* Scales assembled from pieces on a backend that swizzles them: fill q's swizzled copy (q.scales a
 * (rows, nb) view at offset 0 of a storage with room for it, alloc_scales). */
nvl_status nvl_qtensor_swizzle(nvl_qtensor *q) {
  int block = nvl_dtypes[q->format].block;
  if (!block || !q->scales.storage || q->scales.device == NVL_CPU) return NVL_OK;
  const nvl_backend *be;
  NVL_PICK(be, &q->scales, swizzle_scales, "swizzle_scales");
  if (!be->swizzled_scales) return NVL_OK;
  uint8_t *swz = (uint8_t *)qtensor_swizzled(q);
  if (!swz) return nvl_error(NVL_EINVAL, "swizzle_scales: internal error: the scales have no room for their swizzled copy");
  return NVL_CALL(be, &q->scales, swizzle_scales, swz, nvl_tensor_data(&q->scales), q->rows, q->K / block);
}

/* r (K, R) = the 16x16-tiled 4-bit q (R, K) transposed, on q's device: codes moved, each tile's scale
 * re-read (the backend's transpose_tiles), the swizzled copy made where the backend keeps one. */
static nvl_status transpose_tiles(nvl_qtensor *r, const nvl_qtensor *q) {
  int64_t R = q->rows, K = q->K, ps[2] = {K, R / 2};
  nvl_device dev = q->data.device;
  const nvl_backend *be;
  NVL_PICK(be, &q->data, transpose_tiles, "t");
  uint8_t *swz = NULL;
  NVL_TRY(nvl_tensor_empty(&r->data, NVL_U8, dev, 2, ps));
  NVL_TRY(alloc_scales(&r->scales, &swz, dev, K, R / 16, dev != NVL_CPU && be->swizzled_scales));
  NVL_TRY(NVL_CALL(be, &q->data, transpose_tiles, nvl_tensor_data(&r->data), nvl_tensor_data(&r->scales),
                   nvl_tensor_data(&q->data), nvl_tensor_data(&q->scales), R, K));
  return swz ? nvl_qtensor_swizzle(r) : NVL_OK;
}

nvl_status nvl_qtensor_t(nvl_qtensor *out, const nvl_qtensor *q) {
  const char *name = nvl_dtypes[q->format].name;
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "t: quantized tensor has been freed");
  if (q->ndim != 2) return nvl_error(NVL_EINVAL, "t: needs a 2-D quantized tensor, got %d-D", q->ndim);
  if (q->layout == NVL_LAYOUT_1X16 || q->layout == NVL_LAYOUT_1X32)
    return nvl_error(NVL_EINVAL, "t: %s %s blocks run along one dim only; quantize x with the other axis for the "
                     "column-wise copy", name, nvl_layout_names[q->layout]);
  if (q->rht || q->sr)
    return nvl_error(NVL_EINVAL, "t: the transpose of an RHT or SR quantization is a different quantization; "
                     "quantize x^T instead");
  nvl_qtensor r = *q;
  r.data = nvl_tensor_null();
  r.scales = nvl_tensor_null();
  r.amax_dev = nvl_tensor_null();
  if (q->amax_pending) nvl_tensor_share(&r.amax_dev, &q->amax_dev); /* a device amax stays there: no host sync */
  r.shape[0] = q->shape[1];
  r.shape[1] = q->shape[0];
  r.rows = q->K;
  r.K = q->rows;
  nvl_status st = NVL_OK;
  if (q->layout == NVL_LAYOUT_16X16) { /* the tile scales do not depend on the orientation */
    st = transpose_tiles(&r, q);
  } else { /* element-wise formats: transpose the (rows, K) data, on its device */
    nvl_tensor tv = nvl_tensor_null();
    st = nvl_tensor_transpose(&tv, &q->data, 0, 1);
    if (st == NVL_OK) st = nvl_tensor_clone_to(&r.data, &tv, q->data.dtype, q->data.device);
    nvl_tensor_release(&tv);
  }
  if (st != NVL_OK) { nvl_qtensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

/* ---- GEMM ------------------------------------------------------------------------------------ */

/* ---- assembled from parts ------------------------------------------------------------------- */

nvl_status nvl_qtensor_assemble(nvl_qtensor *out, nvl_dtype format, const nvl_tensor *values, const nvl_tensor *scales,
                                float factor) {
  const char *fn = "qtensor_assemble";
  char d[160];
  int mx = format == NVL_MXFP8_E4M3 || format == NVL_MXFP8_E5M2;
  if (!mx && format != NVL_F32 && format != NVL_BF16)
    return nvl_error(NVL_EINVAL, "%s: format must be f32, bf16, mxfp8_e4m3 or mxfp8_e5m2 (formats without a per-tensor "
                     "scale), got %s", fn, format >= 0 && format < NVL_DTYPE_COUNT ? nvl_dtypes[format].name : "?");
  NVL_TRY(nvl_tensor_check_live(values, fn));
  nvl_dtype want = mx ? NVL_U8 : format;
  if (values->ndim != 2 || values->dtype != want || !nvl_tensor_is_contiguous(values))
    return nvl_error(NVL_EINVAL, "%s: %s for %s must be a contiguous 2-D %s tensor, got %s", fn, mx ? "codes" : "values",
                     nvl_dtypes[format].name, nvl_dtypes[want].name, nvl_tensor_desc(values, d, sizeof d));
  int64_t R = values->shape[0], K = values->shape[1];
  if (!(isfinite(factor) && isnormal(factor) && factor > 0.0f))
    return nvl_error(NVL_EINVAL, "%s: factor must be a finite, normal, positive number, got %g", fn, (double)factor);
  if (!mx && scales)
    return nvl_error(NVL_EINVAL, "%s: %s takes no block scales", fn, nvl_dtypes[format].name);
  int64_t nb = 0;
  if (mx) {
    int block = nvl_dtypes[format].block;
    if (K % block)
      return nvl_error(NVL_EINVAL, "%s: %s codes [%lld, %lld]: K is not a multiple of the block, %d", fn,
                       nvl_dtypes[format].name, (long long)R, (long long)K, block);
    nb = K / block;
    if (!scales) return nvl_error(NVL_EINVAL, "%s: %s needs its block scales (u8 [%lld, %lld])", fn,
                                  nvl_dtypes[format].name, (long long)R, (long long)nb);
    NVL_TRY(nvl_tensor_check_live(scales, fn));
    if (scales->ndim != 2 || scales->dtype != NVL_U8 || !nvl_tensor_is_contiguous(scales) || scales->shape[0] != R ||
        scales->shape[1] != nb)
      return nvl_error(NVL_EINVAL, "%s: scales must be a contiguous u8 [%lld, %lld] tensor (one E8M0 byte per 1x%d "
                       "block), got %s", fn, (long long)R, (long long)nb, block, nvl_tensor_desc(scales, d, sizeof d));
    if (!nvl_tensor_same_device(scales, values))
      return nvl_error(NVL_EINVAL, "%s: codes and scales are on different devices", fn);
    /* a 255 byte (E8M0's NaN) is refused: scanned on the host (a device's bytes copied back: R K/32 bytes) */
    nvl_tensor h = nvl_tensor_null();
    NVL_TRY(nvl_tensor_clone_to(&h, scales, NVL_U8, NVL_CPU));
    const uint8_t *hb = (const uint8_t *)nvl_tensor_data(&h);
    int nan_byte = 0;
    for (int64_t i = 0; i < R * nb; i++) nan_byte |= hb[i] == 255;
    nvl_tensor_release(&h);
    if (nan_byte)
      return nvl_error(NVL_EINVAL, "%s: a scale byte is 255 (E8M0's NaN); block scales are 0..254", fn);
  }
  nvl_qtensor q = nvl_qtensor_null();
  q.format = format;
  q.layout = nvl_dtypes[format].layout;
  q.ndim = 2;
  q.shape[0] = R;
  q.shape[1] = K;
  q.axis = 1;
  q.rows = R;
  q.K = K;
  q.amax = q.scale = NAN;
  q.factor = factor == 1.0f ? 0.0f : factor;
  const nvl_backend *be;
  NVL_PICK(be, values, formats[format].qgemm, fn);
  nvl_status st = nvl_tensor_clone_to(&q.data, values, values->dtype, values->device);
  if (st == NVL_OK && mx) {
    uint8_t *swz = NULL;
    st = nvl_qtensor_alloc_scales(&q.scales, &swz, values->device, R, nb, be->swizzled_scales, 0);
    if (st == NVL_OK) st = nvl_tensor_copy(&q.scales, scales);
    if (st == NVL_OK) st = nvl_qtensor_swizzle(&q);
  }
  if (st != NVL_OK) {
    nvl_qtensor_release(&q);
    return st;
  }
  *out = q;
  return NVL_OK;
}

/* Checks shared by qmatmul and qmatmul_acc; *be gets the operands' table with both formats'
 * qgemm entries. */
static nvl_status qmatmul_check(const char *op, const nvl_qtensor *qa, const nvl_qtensor *qb, const nvl_backend **be) {
  if (!qa->data.storage || !qb->data.storage) return nvl_error(NVL_ESTATE, "%s: quantized tensor has been freed", op);
  if (!nvl_tensor_same_device(&qa->data, &qb->data))
    return nvl_error(NVL_EINVAL, "%s: operands on different devices (a on %s, b on %s)", op,
                     qa->data.device == NVL_CPU ? "cpu" : "cuda", qb->data.device == NVL_CPU ? "cpu" : "cuda");
  if (qa->K != qb->K)
    return nvl_error(NVL_EINVAL, "%s: reduction lengths differ: a (%s) is blocked along a dim of %lld, b (%s) along %lld",
                     op, nvl_dtypes[qa->format].name, (long long)qa->K, nvl_dtypes[qb->format].name, (long long)qb->K);
  if (qa->rows > INT32_MAX || qb->rows > INT32_MAX || qa->K > INT32_MAX)
    return nvl_error(NVL_EINVAL, "%s: dims above 2^31 are not supported", op);
  if (qa->rht != qb->rht || (qa->rht && memcmp(qa->signs, qb->signs, sizeof qa->signs)))
    return nvl_error(NVL_EINVAL, "%s: both operands need the same RHT (or none) for the product to be unchanged", op);
  NVL_PICK(*be, &qa->data, formats[qa->format].qgemm, op);
  if (!(*be)->formats[qb->format].qgemm)
    return nvl_error(NVL_EUNSUPPORTED, "%s: %s operands are not supported on %s", op, nvl_dtypes[qb->format].name,
                     (*be)->name);
  return NVL_OK;
}

static nvl_status run_qgemm(const nvl_backend *be, void *out, nvl_dtype out_dtype, int acc, const nvl_qtensor *qa,
                            const nvl_qtensor *qb) {
  nvl_qview a = qview_of(qa), b = qview_of(qb);
  nvl_gemm_desc g = {.out = out, .out_dtype = out_dtype, .accumulate = acc, .a = &a, .b = &b};
  return NVL_CALL(be, &qa->data, formats[qa->format].qgemm, &g);
}

nvl_status nvl_qmatmul(nvl_tensor *out, const nvl_qtensor *qa, const nvl_qtensor *qb, nvl_dtype out_dtype) {
  const nvl_backend *be = NULL;
  NVL_TRY(qmatmul_check("qmatmul", qa, qb, &be));
  if (out_dtype != NVL_F32 && out_dtype != NVL_BF16)
    return nvl_error(NVL_EINVAL, "qmatmul: output dtype must be f32 or bf16, got %s", nvl_dtypes[out_dtype].name);
  int64_t so[2] = {qa->rows, qb->rows};
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, out_dtype, qa->data.device, 2, so));
  nvl_status st = run_qgemm(be, nvl_tensor_data(&r), out_dtype, 0, qa, qb);
  if (st != NVL_OK) { nvl_tensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_qmatmul_acc(nvl_tensor *acc, const nvl_qtensor *qa, const nvl_qtensor *qb) {
  const nvl_backend *be = NULL;
  NVL_TRY(qmatmul_check("qmatmul", qa, qb, &be));
  NVL_TRY(nvl_tensor_check_live(acc, "qmatmul"));
  if (!nvl_tensor_same_device(acc, &qa->data) || acc->dtype != NVL_F32 || !nvl_tensor_is_contiguous(acc) ||
      acc->ndim != 2 || acc->shape[0] != qa->rows || acc->shape[1] != qb->rows) {
    char d[160];
    return nvl_error(NVL_EINVAL, "qmatmul: accumulate needs a contiguous f32 [%lld,%lld] %s tensor, got %s",
                     (long long)qa->rows, (long long)qb->rows, qa->data.device == NVL_CPU ? "cpu" : "cuda",
                     nvl_tensor_desc(acc, d, sizeof d));
  }
  return run_qgemm(be, nvl_tensor_data(acc), NVL_F32, 1, qa, qb);
}
