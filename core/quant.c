/* quant.c: quantized tensors — validation, the blocked layout, dispatch to the reference or
 * fast CPU quantizers, and the emulated GEMM on quantized operands (see quant.h). */
#include <math.h>
#include <string.h>
#include "cpu/ops_cpu.h"
#include "cpu/dequant_cpu.h"
#include "cpu/quant_cpu.h"
#include "nvl_cuda.h"
#include "quant.h"

const char *const nvl_layout_names[NVL_LAYOUT_COUNT] = {"none", "tensor", "1x16", "16x16", "1x32"};

void nvl_qtensor_release(nvl_qtensor *q) {
  nvl_tensor_release(&q->data);
  nvl_tensor_release(&q->scales);
}

/* perm moving axis last; returns the permuted shape too. */
static void axis_last_perm(int ndim, const int64_t *shape, int axis, int *perm, int64_t *pshape) {
  int k = 0;
  for (int d = 0; d < ndim; d++)
    if (d != axis) perm[k++] = d;
  perm[k] = axis;
  for (int d = 0; d < ndim; d++) pshape[d] = shape[perm[d]];
}

/* out = x moved to the blocked layout, as contiguous f32 (rows, K). */
static nvl_status to_blocked(nvl_tensor *out, const nvl_tensor *x, int axis, int64_t rows, int64_t K) {
  int perm[NVL_MAX_DIMS];
  int64_t pshape[NVL_MAX_DIMS], shape2[2] = {rows, K};
  axis_last_perm(x->ndim, x->shape, axis, perm, pshape);
  nvl_tensor p = nvl_tensor_null(), c = nvl_tensor_null();
  NVL_TRY(nvl_tensor_permute(&p, x, perm));
  nvl_status st = nvl_tensor_clone_to(&c, &p, NVL_F32, NVL_CPU);
  nvl_tensor_release(&p);
  if (st == NVL_OK) st = nvl_tensor_view(out, &c, 2, shape2);
  nvl_tensor_release(&c);
  return st;
}

/* out = t (rows, Kt) in the blocked layout of q, presented in q's logical shape with the
 * blocked dim of length Kt (contiguous copy). */
static nvl_status from_blocked(nvl_tensor *out, const nvl_tensor *t, const nvl_qtensor *q, int64_t Kt) {
  int perm[NVL_MAX_DIMS], inv[NVL_MAX_DIMS];
  int64_t pshape[NVL_MAX_DIMS];
  axis_last_perm(q->ndim, q->shape, q->axis, perm, pshape);
  pshape[q->ndim - 1] = Kt;
  for (int d = 0; d < q->ndim; d++) inv[perm[d]] = d;
  nvl_tensor v = nvl_tensor_null(), p = nvl_tensor_null();
  NVL_TRY(nvl_tensor_view(&v, t, q->ndim, pshape));
  nvl_status st = nvl_tensor_permute(&p, &v, inv);
  if (st == NVL_OK) st = nvl_tensor_clone_to(out, &p, t->dtype, NVL_CPU);
  nvl_tensor_release(&v);
  nvl_tensor_release(&p);
  return st;
}

static nvl_status check_signs(const float *s) {
  for (int i = 0; i < 16; i++)
    if (s[i] != 1.0f && s[i] != -1.0f) return nvl_error(NVL_EINVAL, "rht: sign %d is %g; signs must be +1 or -1", i + 1, s[i]);
  return NVL_OK;
}

nvl_status nvl_rht(nvl_tensor *out, const nvl_tensor *x, int axis, const float *signs) {
  char d[160];
  NVL_TRY(nvl_tensor_check_live(x, "rht"));
  if (x->device != NVL_CPU) return nvl_error(NVL_EUNSUPPORTED, "rht: not supported on cuda yet");
  if (!nvl_dtypes[x->dtype].is_float || x->ndim < 1)
    return nvl_error(NVL_EINVAL, "rht: expects a float tensor with at least one dim, got %s", nvl_tensor_desc(x, d, sizeof d));
  if (axis < 0) axis = x->ndim - 1;
  if (axis >= x->ndim) return nvl_error(NVL_EINVAL, "rht: dim %d out of range for %s", axis + 1, nvl_tensor_desc(x, d, sizeof d));
  if (signs) NVL_TRY(check_signs(signs));
  int64_t K = x->shape[axis], rows = K ? nvl_tensor_numel(x) / K : 0;
  if (K % 16)
    return nvl_error(NVL_EINVAL, "rht: works on 16-element chunks, but dim %d of %s has length %lld", axis + 1,
                     nvl_tensor_desc(x, d, sizeof d), (long long)K);
  nvl_tensor b = nvl_tensor_null();
  NVL_TRY(to_blocked(&b, x, axis, rows, K));
  nvl_rht16_rows_cpu(nvl_tensor_data(&b), nvl_tensor_data(&b), rows, K, signs);
  nvl_qtensor shape_of = nvl_qtensor_null();
  shape_of.ndim = x->ndim;
  memcpy(shape_of.shape, x->shape, sizeof x->shape);
  shape_of.axis = axis;
  nvl_status st = from_blocked(out, &b, &shape_of, K);
  nvl_tensor_release(&b);
  return st;
}

/* ---- the CUDA path --------------------------------------------------------------------------
 * x on a GPU: the kernels of kernels/cuda/quant.cu write the blocked layout the CPU path writes,
 * bit for bit. Block scales (q.scales, a (rows, K/block) view at offset 0) are followed in the
 * same storage, at a 256-byte aligned offset, by their copy in cuBLASLt's 128x4 swizzled layout
 * (nvl_cuda.h), which the native block-scaled GEMMs read. dequantize / codes / scale_bytes of a
 * device q copy its codes and scales to the host and decode there. */

/* Set by nvl_quantize_rowcol: quantize_cuda then allocates the outputs and records the kernel
 * description here instead of launching, so the pair can run from one read of x. */
static _Thread_local nvl_cuda_quant_desc *cuda_capture;

static size_t swizzled_offset(int64_t rows, int64_t nb) { return ((size_t)(rows * nb) + 255) & ~(size_t)255; }

/* The swizzled scales of a device q, or NULL if it has none. */
static const uint8_t *qtensor_swizzled(const nvl_qtensor *q) {
  int block = nvl_dtypes[q->format].block;
  if (!q->scales.storage || q->scales.device != NVL_CUDA || q->scales.offset != 0 || block == 0) return NULL;
  int64_t nb = q->K / block;
  size_t off = swizzled_offset(q->rows, nb);
  if (q->scales.storage->bytes < off + nvl_cuda_swizzled_bytes(q->rows, nb)) return NULL;
  return (const uint8_t *)q->scales.storage->data + off;
}

/* scales = a (rows, nb) u8 view of a new device storage that also holds the swizzled copy. */
static nvl_status cuda_scales(nvl_tensor *scales, uint8_t **swz, int64_t rows, int64_t nb) {
  size_t off = swizzled_offset(rows, nb);
  int64_t total = (int64_t)(off + nvl_cuda_swizzled_bytes(rows, nb)), shape2[2] = {rows, nb};
  nvl_tensor full = nvl_tensor_null(), part = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&full, NVL_U8, NVL_CUDA, 1, &total));
  nvl_status st = nvl_tensor_narrow(&part, &full, 0, 0, rows * nb);
  if (st == NVL_OK) st = nvl_tensor_view(scales, &part, 2, shape2);
  if (st == NVL_OK) *swz = (uint8_t *)full.storage->data + off;
  nvl_tensor_release(&part);
  nvl_tensor_release(&full);
  return st;
}

/* q.scale from q.amax, as the CPU quantizers set it. */
static void set_scale_from_amax(nvl_qtensor *q) {
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  if (f->scale == NVL_SCALE_TENSOR) q->scale = nvl_fp8_tensor_scale_ref(q->amax, (nvl_fp8_elem)f->fp8_elem);
  else if (f->scale == NVL_SCALE_UE4M3) q->scale = nvl_nvfp4_enc_scale_ref(q->amax);
}

/* nvl_quantize for x on a GPU; qh holds the validated header (format, shape, axis, rows, K, rht). */
static nvl_status quantize_cuda(nvl_qtensor *out, const nvl_qtensor *qh, const nvl_tensor *x, const nvl_quant_opts *o) {
  char d[160];
  nvl_qtensor q = *qh;
  const nvl_dtype_traits *f = &nvl_dtypes[q.format];
  if (o->use_ref)
    return nvl_error(NVL_EINVAL, "quantize: the reference kernels run on the CPU; quantize x:cpu() for them (x is %s)",
                     nvl_tensor_desc(x, d, sizeof d));
  if ((x->dtype != NVL_F32 && x->dtype != NVL_BF16) || !nvl_tensor_is_contiguous(x))
    return nvl_error(NVL_EUNSUPPORTED, "quantize: on cuda x must be a contiguous f32 or bf16 tensor, got %s",
                     nvl_tensor_desc(x, d, sizeof d));
  int dev = x->storage->device_index;
  nvl_cuda_quant_desc dd;
  memset(&dd, 0, sizeof dd);
  dd.x = nvl_tensor_data(x);
  dd.x_bf16 = x->dtype == NVL_BF16;
  dd.B = 1;
  dd.C = 1;
  for (int i = 0; i < x->ndim; i++) {
    if (i < q.axis) dd.B *= x->shape[i];
    if (i > q.axis) dd.C *= x->shape[i];
  }
  dd.K = q.K;
  dd.rht = q.rht;
  memcpy(dd.signs, q.signs, sizeof dd.signs);
  dd.block2d = o->block2d;
  dd.rule = (int)o->rule;
  dd.has_amax = o->has_amax;
  dd.amax = o->amax;
  int64_t rows = q.rows, K = q.K, s2[2] = {rows, K};
  nvl_status st = NVL_OK;
  switch (f->scale) {
    case NVL_SCALE_NONE:
      q.layout = NVL_LAYOUT_NONE;
      dd.kind = NVL_CQ_VALUES;
      dd.values_bf16 = q.format == NVL_BF16;
      st = nvl_tensor_empty(&q.data, q.format, NVL_CUDA, 2, s2);
      break;
    case NVL_SCALE_TENSOR:
      q.layout = NVL_LAYOUT_TENSOR;
      dd.kind = NVL_CQ_FP8;
      dd.elem = f->fp8_elem;
      st = nvl_tensor_empty(&q.data, NVL_U8, NVL_CUDA, 2, s2);
      break;
    case NVL_SCALE_E8M0:
      q.layout = NVL_LAYOUT_1X32;
      dd.kind = NVL_CQ_MXFP8;
      dd.elem = f->fp8_elem;
      st = nvl_tensor_empty(&q.data, NVL_U8, NVL_CUDA, 2, s2);
      if (st == NVL_OK) st = cuda_scales(&q.scales, &dd.scales_swz, rows, K / 32);
      break;
    default: { /* NVL_SCALE_UE4M3 */
      q.layout = o->block2d ? NVL_LAYOUT_16X16 : NVL_LAYOUT_1X16;
      dd.kind = NVL_CQ_NVFP4;
      if (o->sr) {
        nvl_nvfp4_ref_opts ro = {.sr = 1, .sr_row_offset = o->sr_row_offset, .sr_k_offset = o->sr_k_offset,
                                 .sr_k_total = o->sr_k_total};
        NVL_TRY(nvl_nvfp4_check_sr_slab("quantize", &ro, K));
        q.sr = 1;
        q.seed = o->gen ? o->gen->seed : o->seed;
        q.offset = o->gen ? o->gen->offset : o->offset;
        dd.sr = 1;
        dd.seed = q.seed;
        dd.offset = q.offset;
        dd.sr_row_offset = o->sr_row_offset;
        dd.sr_k_offset = o->sr_k_offset;
        dd.sr_k_total = o->sr_k_total;
      }
      int64_t ps[2] = {rows, K / 2};
      st = nvl_tensor_empty(&q.data, NVL_U8, NVL_CUDA, 2, ps);
      if (st == NVL_OK) st = cuda_scales(&q.scales, &dd.scales_swz, rows, K / 16);
    }
  }
  if (st == NVL_OK) {
    dd.codes = nvl_tensor_data(&q.data);
    if (q.scales.storage) dd.scales = nvl_tensor_data(&q.scales);
    if (cuda_capture) {
      *cuda_capture = dd;
    } else {
      st = nvl_cuda_quantize(&dd, &q.amax, dev);
      set_scale_from_amax(&q);
    }
  }
  if (st != NVL_OK) {
    nvl_qtensor_release(&q);
    return st;
  }
  if (o->sr && o->gen) o->gen->offset++;
  *out = q;
  return NVL_OK;
}

/* h = a host copy of the device q (codes and row-major scales). */
static nvl_status qtensor_host(nvl_qtensor *h, const nvl_qtensor *q) {
  *h = *q;
  h->data = nvl_tensor_null();
  h->scales = nvl_tensor_null();
  nvl_status st = nvl_tensor_clone_to(&h->data, &q->data, q->data.dtype, NVL_CPU);
  if (st == NVL_OK && q->scales.storage) st = nvl_tensor_clone_to(&h->scales, &q->scales, NVL_U8, NVL_CPU);
  if (st != NVL_OK) nvl_qtensor_release(h);
  return st;
}

/* For a device q: run fn on its host copy and return. */
#define NVL_ON_HOST(fn, out, q)                                 \
  do {                                                          \
    if ((q)->data.storage && (q)->data.device == NVL_CUDA) {    \
      nvl_qtensor h_;                                           \
      NVL_TRY(qtensor_host(&h_, (q)));                          \
      nvl_status st_ = fn((out), &h_);                          \
      nvl_qtensor_release(&h_);                                 \
      return st_;                                               \
    }                                                           \
  } while (0)

/* The GEMM operand of a device q: its blocked layout and global decode factor (the alpha
 * decode_rows_unscaled gives on the CPU). */
static void gemm_operand(nvl_cuda_gemm_operand *g, const nvl_qtensor *q) {
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  g->format = q->format;
  g->data = nvl_tensor_data(&q->data);
  g->scales = q->scales.storage ? nvl_tensor_data(&q->scales) : NULL;
  g->scales_swz = qtensor_swizzled(q);
  g->rows = q->rows;
  g->alpha = f->scale == NVL_SCALE_TENSOR ? 1.0f / q->scale
             : f->scale == NVL_SCALE_UE4M3 ? nvl_nvfp4_dec_scale_ref(q->amax) : 1.0f;
}

/* qmatmul (acc = 0: *out = a new (M, N) out_dtype tensor) or qmatmul_acc (acc = 1: *out += the
 * product) on device operands. */
static nvl_status qmatmul_cuda(nvl_tensor *out, int acc, const nvl_qtensor *qa, const nvl_qtensor *qb, nvl_dtype out_dtype) {
  char d[160];
  if (qa->data.device != NVL_CUDA || qb->data.device != NVL_CUDA)
    return nvl_error(NVL_EINVAL, "qmatmul: operands on different devices (a on %s, b on %s)",
                     qa->data.device == NVL_CUDA ? "cuda" : "cpu", qb->data.device == NVL_CUDA ? "cuda" : "cpu");
  int64_t M = qa->rows, N = qb->rows, so[2] = {M, N};
  if (acc && (out->device != NVL_CUDA || out->dtype != NVL_F32 || !nvl_tensor_is_contiguous(out) || out->ndim != 2 ||
              out->shape[0] != M || out->shape[1] != N))
    return nvl_error(NVL_EINVAL, "qmatmul: accumulate needs a contiguous f32 [%lld,%lld] cuda tensor, got %s",
                     (long long)M, (long long)N, nvl_tensor_desc(out, d, sizeof d));
  int dev = qa->data.storage->device_index;
  nvl_cuda_gemm_operand ga, gb;
  gemm_operand(&ga, qa);
  gemm_operand(&gb, qb);
  nvl_tensor r = nvl_tensor_null();
  if (!acc) NVL_TRY(nvl_tensor_empty(&r, out_dtype, NVL_CUDA, 2, so));
  nvl_status st = nvl_cuda_qgemm(nvl_tensor_data(acc ? out : &r), out_dtype == NVL_BF16, acc, &ga, &gb, qa->K, dev);
  if (acc) return st;
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_quantize(nvl_qtensor *out, const nvl_tensor *x, nvl_dtype format, const nvl_quant_opts *o) {
  char d[160];
  static const nvl_quant_opts defaults = {.axis = -1};
  if (!o) o = &defaults;
  NVL_TRY(nvl_tensor_check_live(x, "quantize"));
  if ((unsigned)format >= NVL_DTYPE_COUNT || !nvl_dtypes[format].is_float)
    return nvl_error(NVL_EINVAL, "quantize: invalid format (valid: %s)", nvl_qformat_names());
  const nvl_dtype_traits *f = &nvl_dtypes[format];
  if (!nvl_dtypes[x->dtype].is_float || x->ndim < 1)
    return nvl_error(NVL_EINVAL, "quantize: expects a float tensor with at least one dim, got %s",
                     nvl_tensor_desc(x, d, sizeof d));
  int axis = o->axis < 0 ? x->ndim - 1 : o->axis;
  if (axis >= x->ndim)
    return nvl_error(NVL_EINVAL, "quantize: axis %d out of range for %s", axis + 1, nvl_tensor_desc(x, d, sizeof d));
  int64_t K = x->shape[axis], rows = K ? nvl_tensor_numel(x) / K : 0;
  if (f->block && K % f->block)
    return nvl_error(NVL_EINVAL, "quantize: %s blocks %d elements along dim %d, whose length %lld is not a multiple of %d (x is %s)",
                     f->name, f->block, axis + 1, (long long)K, f->block, nvl_tensor_desc(x, d, sizeof d));
  if (o->rht && K % 16)
    return nvl_error(NVL_EINVAL, "quantize: the RHT works on 16-element chunks, but dim %d has length %lld (x is %s)", axis + 1,
                     (long long)K, nvl_tensor_desc(x, d, sizeof d));
  if (o->rht && o->signs) NVL_TRY(check_signs(o->signs));
  if (o->block2d && format != NVL_NVFP4)
    return nvl_error(NVL_EINVAL, "quantize: block = \"2d\" is an nvfp4 option, not %s", f->name);
  if (o->block2d && (x->ndim != 2 || rows % 16))
    return nvl_error(NVL_EINVAL, "quantize: 2d (16x16) blocks need a 2-D tensor whose dims are multiples of 16, got %s",
                     nvl_tensor_desc(x, d, sizeof d));
  if (o->sr && format != NVL_NVFP4)
    return nvl_error(NVL_EINVAL, "quantize: stochastic rounding is defined for nvfp4 only, not %s", f->name);
  if (o->has_amax && !(f->scale == NVL_SCALE_TENSOR || f->scale == NVL_SCALE_UE4M3))
    return nvl_error(NVL_EINVAL, "quantize: amax applies to per-tensor fp8 and nvfp4, not %s", f->name);
  if ((o->sr_row_offset || o->sr_k_offset || o->sr_k_total) && !o->sr)
    return nvl_error(NVL_EINVAL, "quantize: sr_row_offset / sr_k_offset / sr_k_total place the stochastic rounding "
                     "draws; they need sr = true");
  if (o->has_amax && !(o->amax >= 0))
    return nvl_error(NVL_EINVAL, "quantize: amax must be a non-negative number, got %g", o->amax);

  nvl_qtensor q = nvl_qtensor_null();
  q.format = format;
  q.ndim = x->ndim;
  memcpy(q.shape, x->shape, sizeof x->shape);
  q.axis = axis;
  q.rows = rows;
  q.K = K;
  q.rht = o->rht;
  memcpy(q.signs, o->signs ? o->signs : nvl_rht16_default_signs, sizeof q.signs);
  q.rule = o->rule;
  if (x->device == NVL_CUDA) return quantize_cuda(out, &q, x, o);

  nvl_tensor xb = nvl_tensor_null();
  int64_t blocked_shape[2] = {rows, K};
  if (!o->rht && axis == x->ndim - 1 && x->dtype == NVL_F32 && nvl_tensor_is_contiguous(x))
    NVL_TRY(nvl_tensor_view(&xb, x, 2, blocked_shape)); /* read in place */
  else
    NVL_TRY(to_blocked(&xb, x, axis, rows, K));
  const float *xp = nvl_tensor_data(&xb);
  nvl_status st = NVL_OK;
  if (o->rht) {
    if (o->use_ref) st = nvl_rht16_rows_ref(nvl_tensor_data(&xb), xp, rows, K, q.signs);
    else st = nvl_rht16_rows_cpu(nvl_tensor_data(&xb), xp, rows, K, q.signs);
  }
  int64_t shape2[2] = {rows, K};
  switch (f->scale) {
    case NVL_SCALE_NONE: /* f32 / bf16: the values themselves */
      q.layout = NVL_LAYOUT_NONE;
      if (st == NVL_OK) st = nvl_tensor_clone_to(&q.data, &xb, format, NVL_CPU);
      if (st == NVL_OK) {
        nvl_scalar a;
        st = nvl_reduce_all(&a, NVL_RED_AMAX, &xb);
        q.amax = (float)a.f;
      }
      break;
    case NVL_SCALE_TENSOR: {
      q.layout = NVL_LAYOUT_TENSOR;
      float given = o->amax;
      if (st == NVL_OK) st = nvl_tensor_empty(&q.data, NVL_U8, NVL_CPU, 2, shape2);
      if (st == NVL_OK) {
        nvl_fp8_elem e = (nvl_fp8_elem)f->fp8_elem;
        const float *ain = o->has_amax ? &given : NULL;
        st = o->use_ref ? nvl_fp8_quantize_tensor_ref(nvl_tensor_data(&q.data), &q.scale, &q.amax, xp, rows * K, e, ain)
                        : nvl_fp8_quantize_tensor_cpu(nvl_tensor_data(&q.data), &q.scale, &q.amax, xp, rows * K, e, ain);
      }
      break;
    }
    case NVL_SCALE_E8M0: {
      q.layout = NVL_LAYOUT_1X32;
      int64_t ss[2] = {rows, K / 32};
      if (st == NVL_OK) st = nvl_tensor_empty(&q.data, NVL_U8, NVL_CPU, 2, shape2);
      if (st == NVL_OK) st = nvl_tensor_empty(&q.scales, NVL_U8, NVL_CPU, 2, ss);
      if (st == NVL_OK) {
        nvl_fp8_elem e = (nvl_fp8_elem)f->fp8_elem;
        st = o->use_ref ? nvl_mxfp8_quantize_ref(nvl_tensor_data(&q.data), nvl_tensor_data(&q.scales), xp, rows, K, e, o->rule)
                        : nvl_mxfp8_quantize_cpu(nvl_tensor_data(&q.data), nvl_tensor_data(&q.scales), xp, rows, K, e, o->rule);
      }
      if (st == NVL_OK) {
        nvl_scalar a;
        st = nvl_reduce_all(&a, NVL_RED_AMAX, &xb);
        q.amax = (float)a.f;
      }
      break;
    }
    case NVL_SCALE_UE4M3: {
      q.layout = o->block2d ? NVL_LAYOUT_16X16 : NVL_LAYOUT_1X16;
      nvl_nvfp4_ref_opts ro = {.sr = o->sr, .has_amax = o->has_amax, .amax = o->amax, .sr_row_offset = o->sr_row_offset,
                               .sr_k_offset = o->sr_k_offset, .sr_k_total = o->sr_k_total};
      if (o->sr) {
        if (o->gen) { ro.seed = o->gen->seed; ro.offset = o->gen->offset; }
        else { ro.seed = o->seed; ro.offset = o->offset; }
        q.sr = 1;
        q.seed = ro.seed;
        q.offset = ro.offset;
      }
      int64_t ps[2] = {rows, K / 2}, ss[2] = {rows, K / 16};
      if (st == NVL_OK) st = nvl_tensor_empty(&q.data, NVL_U8, NVL_CPU, 2, ps);
      if (st == NVL_OK) st = nvl_tensor_empty(&q.scales, NVL_U8, NVL_CPU, 2, ss);
      if (st == NVL_OK && o->use_ref) {
        nvl_tensor codes = nvl_tensor_null();
        st = nvl_tensor_empty(&codes, NVL_U8, NVL_CPU, 2, shape2);
        if (st == NVL_OK)
          st = (o->block2d ? nvl_nvfp4_quantize_2d_ref : nvl_nvfp4_quantize_1d_ref)(
              nvl_tensor_data(&codes), nvl_tensor_data(&q.scales), &q.amax, xp, rows, K, &ro);
        if (st == NVL_OK) nvl_e2m1_pack_ref(nvl_tensor_data(&q.data), nvl_tensor_data(&codes), rows * K);
        nvl_tensor_release(&codes);
      } else if (st == NVL_OK) {
        st = nvl_nvfp4_quantize_cpu(nvl_tensor_data(&q.data), nvl_tensor_data(&q.scales), &q.amax, xp, rows, K, o->block2d, &ro);
      }
      if (st == NVL_OK) q.scale = nvl_nvfp4_enc_scale_ref(q.amax);
      if (st == NVL_OK && o->sr && o->gen) o->gen->offset++;
      break;
    }
    default:
      st = nvl_error(NVL_EUNSUPPORTED, "quantize: no quantizer for %s", f->name);
  }
  nvl_tensor_release(&xb);
  if (st != NVL_OK) {
    nvl_qtensor_release(&q);
    return st;
  }
  *out = q;
  return NVL_OK;
}

/* y (nr, K) f32 = the decoded rows [r0, r0+nr) of q's blocked layout, without the per-tensor
 * factor, which goes to *alpha (NUMERICS §2: every value is then exact in fp32). */
static void decode_rows_unscaled(float *y, float *alpha, const nvl_qtensor *q, int64_t r0, int64_t nr) {
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  int64_t K = q->K;
  *alpha = 1.0f;
  switch (f->scale) {
    case NVL_SCALE_NONE:
      if (q->data.dtype == NVL_BF16) nvl_bf16_to_f32_cpu(y, (const uint16_t *)nvl_tensor_data(&q->data) + r0 * K, nr * K);
      else memcpy(y, (const float *)nvl_tensor_data(&q->data) + r0 * K, (size_t)(nr * K) * sizeof(float));
      break;
    case NVL_SCALE_TENSOR:
      nvl_fp8_decode_cpu(y, (const uint8_t *)nvl_tensor_data(&q->data) + r0 * K, nr * K, (nvl_fp8_elem)f->fp8_elem, 1.0f);
      *alpha = 1.0f / q->scale;
      break;
    case NVL_SCALE_E8M0:
      nvl_mxfp8_decode_cpu(y, (const uint8_t *)nvl_tensor_data(&q->data) + r0 * K,
                           (const uint8_t *)nvl_tensor_data(&q->scales) + r0 * (K / 32), nr, K, (nvl_fp8_elem)f->fp8_elem);
      break;
    default: /* NVL_SCALE_UE4M3: value(q) * float(sd), at most 6 significant bits */
      nvl_nvfp4_decode_unscaled_cpu(y, (const uint8_t *)nvl_tensor_data(&q->data) + r0 * (K / 2),
                                    (const uint8_t *)nvl_tensor_data(&q->scales) + r0 * (K / 16), nr, K);
      *alpha = nvl_nvfp4_dec_scale_ref(q->amax);
  }
}

/* out (rows, K) f32 = the decoded values of q in its blocked layout, global scale applied. */
static nvl_status decode_blocked(nvl_tensor *out, const nvl_qtensor *q) {
  int64_t rows = q->rows, K = q->K, shape2[2] = {rows, K};
  const nvl_dtype_traits *f = &nvl_dtypes[q->format];
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "dequantize: quantized tensor has been freed");
  if (f->scale == NVL_SCALE_NONE) return nvl_tensor_clone_to(out, &q->data, NVL_F32, NVL_CPU);
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, NVL_F32, NVL_CPU, 2, shape2));
  float *y = nvl_tensor_data(&r);
  const uint8_t *c = nvl_tensor_data(&q->data);
  nvl_status st = NVL_OK;
  float alpha;
  if (f->scale == NVL_SCALE_TENSOR) /* value / scale, as the reference divides */
    st = nvl_fp8_dequantize_tensor_ref(y, c, q->scale, rows * K, (nvl_fp8_elem)f->fp8_elem);
  else if (f->scale == NVL_SCALE_UE4M3)
    st = nvl_nvfp4_dequantize_cpu(y, c, nvl_tensor_data(&q->scales), q->amax, rows, K);
  else
    decode_rows_unscaled(y, &alpha, q, 0, rows); /* mxfp8: no global factor */
  if (st != NVL_OK) { nvl_tensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_dequantize(nvl_tensor *out, const nvl_qtensor *q) {
  NVL_ON_HOST(nvl_dequantize, out, q);
  nvl_tensor b = nvl_tensor_null();
  NVL_TRY(decode_blocked(&b, q));
  nvl_status st = from_blocked(out, &b, q, q->K);
  nvl_tensor_release(&b);
  return st;
}

nvl_status nvl_qtensor_codes(nvl_tensor *out, const nvl_qtensor *q) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "codes: quantized tensor has been freed");
  NVL_ON_HOST(nvl_qtensor_codes, out, q);
  if (nvl_dtypes[q->format].scale == NVL_SCALE_NONE)
    return nvl_error(NVL_EINVAL, "codes: %s holds plain values, not codes; use dequantize()", nvl_dtypes[q->format].name);
  if (q->format != NVL_NVFP4) return from_blocked(out, &q->data, q, q->K);
  int64_t shape2[2] = {q->rows, q->K};
  nvl_tensor u = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&u, NVL_U8, NVL_CPU, 2, shape2));
  nvl_e2m1_unpack_ref(nvl_tensor_data(&u), nvl_tensor_data(&q->data), q->rows * q->K);
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

nvl_status nvl_qtensor_t(nvl_qtensor *out, const nvl_qtensor *q) {
  const char *name = nvl_dtypes[q->format].name;
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "t: quantized tensor has been freed");
  if (q->ndim != 2) return nvl_error(NVL_EINVAL, "t: needs a 2-D quantized tensor, got %d-D", q->ndim);
  if (q->data.device == NVL_CUDA)
    return nvl_error(NVL_EUNSUPPORTED, "t: not supported on cuda; quantize x with the other axis (or nv.quantize_rowcol)");
  if (q->layout == NVL_LAYOUT_1X16 || q->layout == NVL_LAYOUT_1X32)
    return nvl_error(NVL_EINVAL, "t: %s %s blocks run along one dim only; quantize x with the other axis for the "
                     "column-wise copy", name, nvl_layout_names[q->layout]);
  if (q->rht || q->sr)
    return nvl_error(NVL_EINVAL, "t: the transpose of an RHT or SR quantization is a different quantization; "
                     "quantize x^T instead");
  nvl_qtensor r = *q;
  r.data = nvl_tensor_null();
  r.scales = nvl_tensor_null();
  r.shape[0] = q->shape[1];
  r.shape[1] = q->shape[0];
  r.rows = q->K;
  r.K = q->rows;
  nvl_status st = NVL_OK;
  int64_t R = q->rows, K = q->K;
  if (q->format == NVL_NVFP4) { /* 16x16: transpose the codes, re-read each tile's scale */
    int64_t ps[2] = {K, R / 2}, ss[2] = {K, R / 16};
    st = nvl_tensor_empty(&r.data, NVL_U8, NVL_CPU, 2, ps);
    if (st == NVL_OK) st = nvl_tensor_empty(&r.scales, NVL_U8, NVL_CPU, 2, ss);
    if (st == NVL_OK) {
      const uint8_t *src = nvl_tensor_data(&q->data), *ssrc = nvl_tensor_data(&q->scales);
      uint8_t *dst = nvl_tensor_data(&r.data), *sdst = nvl_tensor_data(&r.scales);
      memset(dst, 0, (size_t)(K * R / 2));
      for (int64_t i = 0; i < R; i++)
        for (int64_t k = 0; k < K; k++) {
          uint8_t b = src[(i * K + k) / 2], code = (k & 1) ? b >> 4 : b & 15;
          dst[(k * R + i) / 2] |= (uint8_t)(code << ((i & 1) * 4));
        }
      for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < R / 16; j++) sdst[k * (R / 16) + j] = ssrc[(16 * j) * (K / 16) + k / 16];
    }
  } else { /* element-wise formats: transpose the (rows, K) data */
    nvl_tensor tv = nvl_tensor_null();
    st = nvl_tensor_transpose(&tv, &q->data, 0, 1);
    if (st == NVL_OK) st = nvl_tensor_clone_to(&r.data, &tv, q->data.dtype, NVL_CPU);
    nvl_tensor_release(&tv);
  }
  if (st != NVL_OK) { nvl_qtensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

/* The GEMM of qmatmul: y (M, N, row stride ldy) = alpha · A·Bᵀ, or, with acc, y += that
 * (through a scratch of at most ~16 MB, so the sum rounds exactly as a separate add would). */
static nvl_status qgemm_into(float *y, int64_t ldy, const nvl_qtensor *qa, const nvl_qtensor *qb, int acc) {
  int64_t M = qa->rows, N = qb->rows, K = qa->K;
  int64_t chunk = (int64_t)(1 << 22) / (K > 0 ? K : 1);
  if (acc && M > 0 && (int64_t)(1 << 22) / M < chunk) chunk = (int64_t)(1 << 22) / M;
  if (chunk < 64) chunk = 64;
  if (chunk > N) chunk = N;
  int64_t sa[2] = {M, K}, sb[2] = {chunk > 0 ? chunk : 1, K}, ss[2] = {M, chunk > 0 ? chunk : 1};
  nvl_tensor a = nvl_tensor_null(), b = nvl_tensor_null(), sc = nvl_tensor_null();
  float alpha_a = 1.0f, alpha_b = 1.0f;
  nvl_status st = nvl_tensor_empty(&a, NVL_F32, NVL_CPU, 2, sa);
  if (st == NVL_OK) st = nvl_tensor_empty(&b, NVL_F32, NVL_CPU, 2, sb);
  if (st == NVL_OK && acc) st = nvl_tensor_empty(&sc, NVL_F32, NVL_CPU, 2, ss);
  if (st == NVL_OK) {
    decode_rows_unscaled(nvl_tensor_data(&a), &alpha_a, qa, 0, M);
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      int64_t nr = N - n0 < chunk ? N - n0 : chunk;
      decode_rows_unscaled(nvl_tensor_data(&b), &alpha_b, qb, n0, nr);
      float alpha = alpha_a * alpha_b;
      float *dst = acc ? (float *)nvl_tensor_data(&sc) : y + n0;
      int64_t ld = acc ? nr : ldy;
      nvl_matmul_f32_abt_cpu(dst, ld, nvl_tensor_data(&a), nvl_tensor_data(&b), M, nr, K);
#pragma omp parallel for if (M * nr > 65536)
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < nr; j++) {
          float v = dst[i * ld + j];
          if (alpha != 1.0f) v = v * alpha;
          if (acc) y[i * ldy + n0 + j] = y[i * ldy + n0 + j] + v;
          else dst[i * ld + j] = v;
        }
    }
  }
  nvl_tensor_release(&a);
  nvl_tensor_release(&b);
  nvl_tensor_release(&sc);
  return st;
}

static nvl_status qmatmul_check(const char *op, const nvl_qtensor *qa, const nvl_qtensor *qb) {
  if (!qa->data.storage || !qb->data.storage) return nvl_error(NVL_ESTATE, "%s: quantized tensor has been freed", op);
  if (qa->K != qb->K)
    return nvl_error(NVL_EINVAL, "%s: reduction lengths differ: a (%s) is blocked along a dim of %lld, b (%s) along %lld",
                     op, nvl_dtypes[qa->format].name, (long long)qa->K, nvl_dtypes[qb->format].name, (long long)qb->K);
  if (qa->rows > INT32_MAX || qb->rows > INT32_MAX || qa->K > INT32_MAX)
    return nvl_error(NVL_EINVAL, "%s: dims above 2^31 are not supported", op);
  if (qa->rht != qb->rht || (qa->rht && memcmp(qa->signs, qb->signs, sizeof qa->signs)))
    return nvl_error(NVL_EINVAL, "%s: both operands need the same RHT (or none) for the product to be unchanged", op);
  return NVL_OK;
}

nvl_status nvl_qmatmul(nvl_tensor *out, const nvl_qtensor *qa, const nvl_qtensor *qb, nvl_dtype out_dtype) {
  NVL_TRY(qmatmul_check("qmatmul", qa, qb));
  if (out_dtype != NVL_F32 && out_dtype != NVL_BF16)
    return nvl_error(NVL_EINVAL, "qmatmul: output dtype must be f32 or bf16, got %s", nvl_dtypes[out_dtype].name);
  if (qa->data.device == NVL_CUDA || qb->data.device == NVL_CUDA) return qmatmul_cuda(out, 0, qa, qb, out_dtype);
  int64_t so[2] = {qa->rows, qb->rows};
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, NVL_F32, NVL_CPU, 2, so));
  nvl_status st = qgemm_into(nvl_tensor_data(&r), qb->rows, qa, qb, 0);
  if (st == NVL_OK && out_dtype != NVL_F32) {
    nvl_tensor c = nvl_tensor_null();
    st = nvl_cast(&c, &r, out_dtype);
    nvl_tensor_release(&r);
    r = c;
  }
  if (st != NVL_OK) { nvl_tensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_qmatmul_acc(nvl_tensor *acc, const nvl_qtensor *qa, const nvl_qtensor *qb) {
  NVL_TRY(qmatmul_check("qmatmul", qa, qb));
  NVL_TRY(nvl_tensor_check_live(acc, "qmatmul"));
  if (qa->data.device == NVL_CUDA || qb->data.device == NVL_CUDA) return qmatmul_cuda(acc, 1, qa, qb, NVL_F32);
  if (acc->device != NVL_CPU || acc->dtype != NVL_F32 || !nvl_tensor_is_contiguous(acc) || acc->ndim != 2 ||
      acc->shape[0] != qa->rows || acc->shape[1] != qb->rows) {
    char d[160];
    return nvl_error(NVL_EINVAL, "qmatmul: accumulate needs a contiguous f32 [%lld,%lld] cpu tensor, got %s",
                     (long long)qa->rows, (long long)qb->rows, nvl_tensor_desc(acc, d, sizeof d));
  }
  return qgemm_into(nvl_tensor_data(acc), qb->rows, qa, qb, 1);
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
  uint64_t gen_offset = o->gen ? o->gen->offset : 0;
  nvl_qtensor r = nvl_qtensor_null(), c = nvl_qtensor_null();
  nvl_status st;
  if (x->device != NVL_CUDA) { /* the definition: two quantizations in a row */
    st = nvl_quantize(&r, x, format, &orow);
    if (st == NVL_OK) st = nvl_quantize(&c, x, format, &ocol);
  } else { /* the same two, prepared (validated, allocated), then run from one read of x */
    nvl_cuda_quant_desc dr, dc;
    cuda_capture = &dr;
    st = nvl_quantize(&r, x, format, &orow);
    cuda_capture = &dc;
    if (st == NVL_OK) st = nvl_quantize(&c, x, format, &ocol);
    cuda_capture = NULL;
    if (st == NVL_OK) st = nvl_cuda_quantize_pair(&dr, &dc, &r.amax, &c.amax, x->storage->device_index);
    if (st == NVL_OK) {
      set_scale_from_amax(&r);
      set_scale_from_amax(&c);
    }
  }
  if (st != NVL_OK) {
    nvl_qtensor_release(&r);
    nvl_qtensor_release(&c);
    if (o->gen) o->gen->offset = gen_offset;
    return st;
  }
  *row = r;
  *col = c;
  return NVL_OK;
}
