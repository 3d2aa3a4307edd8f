/* backend_cuda.c: the CUDA table (core/backend.h), built only when nvcc is found: the kernels of
 * the .cu files of kernels/cuda, the device API of device.cu, and small adapters from the tensor-op entries
 * (views) to the raw kernels, which take contiguous buffers and say what else they refuse.
 * This file is C: the .cu files export their entries with C linkage (kernels/cuda/cuda.h). */
#include "cuda/cuda.h"

/* ---- tensor-op adapters ------------------------------------------------------------------------ */

static nvl_status copy(nvl_kctx *ctx, nvl_tensor *dst, const nvl_tensor *src) {
  return nvl_cuda_copy_strided(nvl_tensor_data(dst), dst->dtype, dst->strides, nvl_tensor_data(src), src->dtype,
                               src->strides, dst->ndim, dst->shape, ctx->dev);
}

static nvl_status fill(nvl_kctx *ctx, nvl_tensor *t, const void *value) {
  return nvl_cuda_fill(nvl_tensor_data(t), t->dtype, value, nvl_tensor_numel(t), ctx->dev);
}

static int f32_contig(const nvl_tensor *t) { return t->dtype == NVL_F32 && nvl_tensor_is_contiguous(t); }

static int bf16_contig(const nvl_tensor *t) { return t->dtype == NVL_BF16 && nvl_tensor_is_contiguous(t); }

static nvl_status binary(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  if ((op == NVL_OP_ADD || op == NVL_OP_SUB) && bf16_contig(out) && bf16_contig(a) && bf16_contig(b))
    return nvl_cuda_add_bf16(op == NVL_OP_SUB, nvl_tensor_data(out), nvl_tensor_data(a), nvl_tensor_data(b),
                             nvl_tensor_numel(out), ctx->dev);
  if (!(op <= NVL_OP_DIV && out->dtype == NVL_F32 && f32_contig(a) && f32_contig(b))) {
    char s1[160], s2[160];
    return nvl_error(NVL_EUNSUPPORTED, "%s: on cuda only contiguous f32 tensors of one shape and add, sub, mul, div "
                     "(bf16: add, sub) are supported yet (got %s and %s)", op < NVL_BINARY_COUNT ? "binary" : "?",
                     nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2));
  }
  return nvl_cuda_binary_f32(op, nvl_tensor_data(out), nvl_tensor_data(a), nvl_tensor_data(b), nvl_tensor_numel(out),
                             ctx->dev);
}

static nvl_status reduce_all(nvl_kctx *ctx, nvl_reduce_op op, nvl_scalar *out, const nvl_tensor *a) {
  if (op != NVL_RED_AMAX || !nvl_dtypes[a->dtype].is_float || !nvl_tensor_is_contiguous(a)) {
    char s1[160];
    return nvl_error(NVL_EUNSUPPORTED, "reduce: on cuda only amax() over all elements of a contiguous f32 or bf16 "
                     "tensor is supported yet (got %s); copy it with :cpu() first", nvl_tensor_desc(a, s1, sizeof s1));
  }
  double m;
  NVL_TRY(nvl_cuda_amax(ctx, &m, nvl_tensor_data(a), a->dtype == NVL_BF16, nvl_tensor_numel(a)));
  *out = nvl_scalar_f(m);
  return NVL_OK;
}

static nvl_status axpy(nvl_kctx *ctx, float *y, const float *x, double alpha, int64_t n) {
  return nvl_cuda_axpy_f32(y, x, (float)alpha, n, ctx->dev);
}

static nvl_status scale(nvl_kctx *ctx, float *p, double s, int64_t n) { return nvl_cuda_scale_f32(p, s, n, ctx->dev); }

/* out (M, N) contiguous f32 = a (M, K) @ b (K, N), f32 views of any strides: the cuBLASLt f32 GEMM
 * (nvl_cuda_qgemm, A = a and B = b^T, both row-major (rows, K)); an operand that is not such a view
 * already is gathered into scratch first. */
static nvl_status gemm_operand(nvl_kctx *ctx, const float **p, const nvl_tensor *t, int transposed) {
  const int64_t rows = t->shape[transposed ? 1 : 0], K = t->shape[transposed ? 0 : 1];
  const int64_t sr = t->strides[transposed ? 1 : 0], sk = t->strides[transposed ? 0 : 1];
  if ((sk == 1 && (sr == K || rows == 1)) || rows * K == 0) {
    *p = (const float *)nvl_tensor_data(t);
    return NVL_OK;
  }
  void *dst = NULL;
  NVL_TRY(ctx->scratch(ctx, (size_t)(rows * K) * sizeof(float), &dst));
  const int64_t shape[2] = {rows, K}, ds[2] = {K, 1}, ss[2] = {sr, sk};
  NVL_TRY(nvl_cuda_copy_strided(dst, NVL_F32, ds, nvl_tensor_data(t), NVL_F32, ss, 2, shape, ctx->dev));
  *p = (const float *)dst;
  return NVL_OK;
}

static nvl_status matmul(nvl_kctx *ctx, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  const int64_t M = a->shape[0], K = a->shape[1], N = b->shape[1];
  const float *pa = NULL, *pb = NULL;
  NVL_TRY(gemm_operand(ctx, &pa, a, 0));
  NVL_TRY(gemm_operand(ctx, &pb, b, 1));
  nvl_qview qa = {.format = NVL_F32, .codes = pa, .rows = M, .K = K, .amax = 0, .scale = 1, .alpha = 1};
  nvl_qview qb = qa;
  qb.codes = pb;
  qb.rows = N;
  nvl_gemm_desc g = {.out = nvl_tensor_data(out), .out_dtype = NVL_F32, .accumulate = 0, .a = &qa, .b = &qb};
  return nvl_cuda_qgemm(ctx, &g);
}

/* ---- the table ----------------------------------------------------------------------------------- */

static const nvl_device_api device_api = {
  .count = nvl_cuda_device_count,
  .unavailable_reason = nvl_cuda_unavailable_reason,
  .props = nvl_cuda_device_props,
  .runtime_version = nvl_cuda_runtime_version,
  .blas_version = nvl_cuda_blaslt_version,
  .alloc = nvl_cuda_malloc,
  .free = nvl_cuda_free,
  .memcpy = nvl_cuda_memcpy,
  .memset = nvl_cuda_memset,
  .synchronize = nvl_cuda_synchronize,
  .set_sync = nvl_cuda_set_sync,
  .memory_stats = nvl_cuda_memory_stats,
  .empty_cache = nvl_cuda_empty_cache,
  .set_poison = nvl_cuda_set_poison,
  .timer_start = nvl_cuda_timer_start,
  .timer_stop = nvl_cuda_timer_stop,
  .gemm_path = nvl_cuda_gemm_path,
};

static const nvl_layer_kernels layers = { /* rope_tables: computed on the host */
  .embedding_forward = nvl_cuda_embedding_forward,
  .embedding_backward = nvl_cuda_embedding_backward,
  .rmsnorm_forward = nvl_cuda_rmsnorm_forward,
  .rmsnorm_backward = nvl_cuda_rmsnorm_backward,
  .rope_forward = nvl_cuda_rope_forward,
  .rope_backward = nvl_cuda_rope_backward,
  .swiglu_forward = nvl_cuda_swiglu_forward,
  .swiglu_backward = nvl_cuda_swiglu_backward,
  .swiglu_forward_bf16 = nvl_cuda_swiglu_forward_bf16,
  .rmsnorm_forward_bf16 = nvl_cuda_rmsnorm_forward_bf16,
  .rmsnorm_backward_bf16 = nvl_cuda_rmsnorm_backward_bf16,
  .rope_forward_bf16 = nvl_cuda_rope_forward_bf16,
  .rope_backward_bf16 = nvl_cuda_rope_backward_bf16,
  .swiglu_backward_bf16 = nvl_cuda_swiglu_backward_bf16,
  .cross_entropy = nvl_cuda_cross_entropy,
  .cross_entropy_bf16grad = nvl_cuda_cross_entropy_bf16grad,
  .adamw_step = nvl_cuda_adamw_step,
  .sumsq = nvl_cuda_sumsq,
  .block_sqerr = nvl_cuda_block_sqerr,
  .distill = nvl_cuda_distill,
  .amax_history = nvl_cuda_amax_history,
  .rmsnorm_forward_bf16_amax = nvl_cuda_rmsnorm_forward_bf16_amax,
  .swiglu_forward_bf16_amax = nvl_cuda_swiglu_forward_bf16_amax,
  .attention_forward = nvl_cuda_attention_forward,
  .attention_backward = nvl_cuda_attention_backward,
  .attention_forward_at = nvl_cuda_attention_forward_at,
  .adamw_multi = nvl_cuda_adamw_multi,
  .grad_norm_multi = nvl_cuda_grad_norm_multi,
  .grad_norm_combine = nvl_cuda_grad_norm_combine,
  .nonfinite_take = nvl_cuda_nonfinite_take,
};

#define ROW {nvl_cuda_quantize, nvl_cuda_dequantize, nvl_cuda_qgemm}

const nvl_backend nvl_backend_cuda = {
  .name = "cuda",
  .device = NVL_CUDA,
  .formats = {
    [NVL_F32] = ROW,
    [NVL_BF16] = ROW,
    [NVL_E4M3] = ROW,
    [NVL_E5M2] = ROW,
    [NVL_MXFP8_E4M3] = ROW,
    [NVL_MXFP8_E5M2] = ROW,
    [NVL_NVFP4] = ROW,
    [NVL_MXFP4] = ROW,
  },
  .swizzled_scales = 1,
  .quantize_pair = nvl_cuda_quantize_pair,
  .rht = nvl_cuda_rht,
  .swizzle_scales = nvl_cuda_swizzle_scales,
  .transpose_tiles = nvl_cuda_transpose_tiles,
  .gam_quantize = nvl_cuda_gam_quantize,

  .layers = &layers,

  .copy = copy,
  .fill = fill,
  .binary = binary,
  .reduce_all = reduce_all,
  .matmul = matmul,
  .axpy = axpy,
  .scale = scale,

  .device_api = &device_api,
};
