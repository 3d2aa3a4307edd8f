/* stub.c: the CUDA backend (core/nvl_cuda.h) for builds without nvcc. It reports "not compiled":
 * no devices, versions 0, and every call that would touch a GPU fails with NVL_EUNSUPPORTED and a
 * message saying how to rebuild. The .cu files of kernels/cuda/ are the real implementation.
 * Not here: any emulation of device memory on the host. */
#include "nvl_cuda.h"

#define NVL_NO_CUDA(fn) \
  nvl_error(NVL_EUNSUPPORTED, "%s: nvlua was built without CUDA (rebuild with nvcc and -DNVLUA_CUDA=ON)", fn)

int nvl_cuda_compiled(void) { return 0; }
int nvl_cuda_device_count(void) { return 0; }
const char *nvl_cuda_unavailable_reason(void) { return "nvlua was built without CUDA"; }

nvl_status nvl_cuda_device_props(int dev, nvl_cuda_props *p) {
  (void)dev; (void)p;
  return NVL_NO_CUDA(__func__);
}

int nvl_cuda_runtime_version(void) { return 0; }
size_t nvl_cuda_blaslt_version(void) { return 0; }

int nvl_cuda_set_sync(int on) { (void)on; return 1; }
nvl_status nvl_cuda_synchronize(int dev) {
  (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_malloc(void **p, size_t bytes, int dev) {
  (void)bytes; (void)dev;
  if (p) *p = NULL;
  return NVL_NO_CUDA(__func__);
}

void nvl_cuda_free(void *p, int dev) { (void)p; (void)dev; }

nvl_status nvl_cuda_memory_stats(int dev, nvl_cuda_mem_stats *s) {
  (void)dev; (void)s;
  return NVL_NO_CUDA(__func__);
}

void nvl_cuda_empty_cache(int dev) { (void)dev; }
int nvl_cuda_set_poison(int byte) { (void)byte; return -1; }

nvl_status nvl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int dev) {
  (void)dst; (void)src; (void)bytes; (void)kind; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_memset(void *p, int v, size_t bytes, int dev) {
  (void)p; (void)v; (void)bytes; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_timer_start(int dev) {
  (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_timer_stop(int dev, double *ms) {
  (void)dev;
  if (ms) *ms = 0;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_binary_f32(int op, float *out, const float *a, const float *b, int64_t n, int dev) {
  (void)op; (void)out; (void)a; (void)b; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}

size_t nvl_cuda_swizzled_bytes(int64_t rows, int64_t nb) {
  if (rows <= 0 || nb <= 0) return 0;
  return (size_t)((rows + 127) / 128 * 128) * (size_t)((nb + 3) / 4 * 4);
}

nvl_status nvl_cuda_quantize(const nvl_cuda_quant_desc *d, float *amax_out, int dev) {
  (void)d; (void)amax_out; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_quantize_pair(const nvl_cuda_quant_desc *row, const nvl_cuda_quant_desc *col, float *amax_row,
                                  float *amax_col, int dev) {
  (void)row; (void)col; (void)amax_row; (void)amax_col; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_gemm_path nvl_cuda_gemm_path(int format_a, int format_b, int dev, char *detail, size_t n) {
  (void)format_a; (void)format_b; (void)dev;
  if (detail && n) detail[0] = '\0';
  NVL_NO_CUDA("gemm_path");
  return NVL_GEMM_UNSUPPORTED;
}

nvl_status nvl_cuda_qgemm(void *out, int out_bf16, int accumulate, const nvl_cuda_gemm_operand *a,
                          const nvl_cuda_gemm_operand *b, int64_t K, int dev) {
  (void)out; (void)out_bf16; (void)accumulate; (void)a; (void)b; (void)K; (void)dev;
  return NVL_NO_CUDA(__func__);
}

/* ---- layers ----------------------------------------------------------------------------------- */

nvl_status nvl_cuda_embedding_forward(float *out, const int64_t *ids, const float *weight, int64_t N, int64_t C,
                                      int dev) {
  (void)out; (void)ids; (void)weight; (void)N; (void)C; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_embedding_backward(float *dweight, const float *dout, const int64_t *ids, int64_t N, int64_t C,
                                       int dev) {
  (void)dweight; (void)dout; (void)ids; (void)N; (void)C; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_rmsnorm_forward(float *out, float *rstd, const float *x, const float *weight, int64_t N, int64_t C,
                                    double eps, int dev) {
  (void)out; (void)rstd; (void)x; (void)weight; (void)N; (void)C; (void)eps; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_rmsnorm_backward(float *dx, float *dweight, const float *dout, const float *x, const float *weight,
                                     const float *rstd, int64_t N, int64_t C, int dev) {
  (void)dx; (void)dweight; (void)dout; (void)x; (void)weight; (void)rstd; (void)N; (void)C; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_rope_forward(float *out, const float *x, const float *cos_t, const float *sin_t, int64_t B,
                                 int64_t T, int64_t H, int64_t D, int dev) {
  (void)out; (void)x; (void)cos_t; (void)sin_t; (void)B; (void)T; (void)H; (void)D; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_rope_backward(float *dx, const float *dout, const float *cos_t, const float *sin_t, int64_t B,
                                  int64_t T, int64_t H, int64_t D, int dev) {
  (void)dx; (void)dout; (void)cos_t; (void)sin_t; (void)B; (void)T; (void)H; (void)D; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_swiglu_forward(float *out, const float *gate, const float *up, int64_t n, int dev) {
  (void)out; (void)gate; (void)up; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                    int64_t n, int dev) {
  (void)dgate; (void)dup; (void)dout; (void)gate; (void)up; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_cross_entropy(double *total, float *dlogits, const void *logits, int logits_bf16,
                                  const int64_t *targets, int64_t N, int64_t V, int64_t ignore_index, double z_loss,
                                  double grad_scale, int dev) {
  (void)dlogits; (void)logits; (void)logits_bf16; (void)targets; (void)N; (void)V; (void)ignore_index; (void)z_loss;
  (void)grad_scale; (void)dev;
  if (total) *total = 0.0;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_adamw_step(float *param, const float *grad, float *m, float *v, int64_t n, double lr, double beta1,
                               double beta2, double eps, double weight_decay, int64_t step, int dev) {
  (void)param; (void)grad; (void)m; (void)v; (void)n; (void)lr; (void)beta1; (void)beta2; (void)eps;
  (void)weight_decay; (void)step; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_sumsq(double *out, const void *x, int x_bf16, int64_t n, int dev) {
  (void)x; (void)x_bf16; (void)n; (void)dev;
  if (out) *out = 0.0;
  return NVL_NO_CUDA(__func__);
}

/* ---- attention -------------------------------------------------------------------------------- */

nvl_status nvl_cuda_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                                      int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale, int dev) {
  (void)out; (void)lse; (void)q; (void)k; (void)v; (void)B; (void)T; (void)Hq; (void)Hkv; (void)D; (void)scale;
  (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                       const float *k, const float *v, const float *out, const float *lse, int64_t B,
                                       int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale, int dev) {
  (void)dq; (void)dk; (void)dv; (void)dout; (void)q; (void)k; (void)v; (void)out; (void)lse; (void)B; (void)T;
  (void)Hq; (void)Hkv; (void)D; (void)scale; (void)dev;
  return NVL_NO_CUDA(__func__);
}

/* ---- tensor ops ------------------------------------------------------------------------------- */

nvl_status nvl_cuda_copy_strided(void *dst, int dst_dtype, const int64_t *dst_strides, const void *src,
                                 int src_dtype, const int64_t *src_strides, int ndim, const int64_t *shape, int dev) {
  (void)dst; (void)dst_dtype; (void)dst_strides; (void)src; (void)src_dtype; (void)src_strides; (void)ndim;
  (void)shape; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_fill(void *p, int dtype, const void *value, int64_t n, int dev) {
  (void)p; (void)dtype; (void)value; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_axpy_f32(float *y, const float *x, float alpha, int64_t n, int dev) {
  (void)y; (void)x; (void)alpha; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_scale_f32(float *p, double s, int64_t n, int dev) {
  (void)p; (void)s; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_amax(double *out, const void *x, int x_bf16, int64_t n, int dev) {
  (void)x; (void)x_bf16; (void)n; (void)dev;
  if (out) *out = 0.0;
  return NVL_NO_CUDA(__func__);
}
