/* stub.c: the CUDA backend (core/cuda.h) for builds without nvcc. It reports "not compiled":
 * no devices, versions 0, and every call that would touch a GPU fails with NVL_EUNSUPPORTED and a
 * message saying how to rebuild. kernels/cuda/device.cu is the real implementation.
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

nvl_status nvl_cuda_malloc(void **p, size_t bytes, int dev) {
  (void)bytes; (void)dev;
  if (p) *p = NULL;
  return NVL_NO_CUDA(__func__);
}

void nvl_cuda_free(void *p, int dev) { (void)p; (void)dev; }

nvl_status nvl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int dev) {
  (void)dst; (void)src; (void)bytes; (void)kind; (void)dev;
  return NVL_NO_CUDA(__func__);
}

nvl_status nvl_cuda_binary_f32(int op, float *out, const float *a, const float *b, int64_t n, int dev) {
  (void)op; (void)out; (void)a; (void)b; (void)n; (void)dev;
  return NVL_NO_CUDA(__func__);
}
