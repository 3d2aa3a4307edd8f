/* quant.c: quantized tensors — validation, the blocked layout, dispatch to the reference or
 * fast CPU quantizers, and the emulated GEMM on quantized operands (see quant.h). */
#include <math.h>
#include <string.h>
#include "cpu/ops_cpu.h"
#include "cpu/dequant_cpu.h"
#include "cpu/quant_cpu.h"
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

nvl_status nvl_quantize(nvl_qtensor *out, const nvl_tensor *x, nvl_dtype format, const nvl_quant_opts *o) {
  char d[160];
  static const nvl_quant_opts defaults = {.axis = -1};
  if (!o) o = &defaults;
  NVL_TRY(nvl_tensor_check_live(x, "quantize"));
  if ((unsigned)format >= NVL_DTYPE_COUNT || !nvl_dtypes[format].is_float)
    return nvl_error(NVL_EINVAL, "quantize: invalid format (valid: %s)", nvl_qformat_names());
  const nvl_dtype_traits *f = &nvl_dtypes[format];
  if (x->device != NVL_CPU) return nvl_error(NVL_EUNSUPPORTED, "quantize: not supported on cuda yet");
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
      nvl_nvfp4_ref_opts ro = {.sr = o->sr, .has_amax = o->has_amax, .amax = o->amax};
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
  nvl_tensor b = nvl_tensor_null();
  NVL_TRY(decode_blocked(&b, q));
  nvl_status st = from_blocked(out, &b, q, q->K);
  nvl_tensor_release(&b);
  return st;
}

nvl_status nvl_qtensor_codes(nvl_tensor *out, const nvl_qtensor *q) {
  if (!q->data.storage) return nvl_error(NVL_ESTATE, "codes: quantized tensor has been freed");
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
  return from_blocked(out, &q->scales, q, q->K / nvl_dtypes[q->format].block);
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
  if (acc->device != NVL_CPU || acc->dtype != NVL_F32 || !nvl_tensor_is_contiguous(acc) || acc->ndim != 2 ||
      acc->shape[0] != qa->rows || acc->shape[1] != qb->rows) {
    char d[160];
    return nvl_error(NVL_EINVAL, "qmatmul: accumulate needs a contiguous f32 [%lld,%lld] cpu tensor, got %s",
                     (long long)qa->rows, (long long)qb->rows, nvl_tensor_desc(acc, d, sizeof d));
  }
  return qgemm_into(nvl_tensor_data(acc), qb->rows, qa, qb, 1);
}
