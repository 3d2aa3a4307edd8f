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
