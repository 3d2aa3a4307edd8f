/* cuda.h: what core/ asks of the CUDA backend (the .cu files in kernels/cuda/, or kernels/cuda/stub.c when
 * nvlua is built without nvcc). Every call reports failures as an nvl_status naming the CUDA or
 * cuBLASLt call; nothing aborts. With no GPU or no driver, device_count gives 0 and allocation
 * fails with a clear message. */
#ifndef NVL_CUDA_H
#define NVL_CUDA_H
#include "nvl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if the CUDA backend was compiled in. */
int nvl_cuda_compiled(void);
/* Number of usable GPUs (0 with no driver or no device; never an error). */
int nvl_cuda_device_count(void);
/* Why device_count is 0 ("" if it is not), for nvlua -v. */
const char *nvl_cuda_unavailable_reason(void);
typedef struct {
  char name[256];
  size_t total_mem;
  int major, minor;
  int multiprocessors;
} nvl_cuda_props;
nvl_status nvl_cuda_device_props(int dev, nvl_cuda_props *p);
/* Runtime and cuBLASLt versions (0 when not compiled in). */
int nvl_cuda_runtime_version(void);
size_t nvl_cuda_blaslt_version(void);

nvl_status nvl_cuda_malloc(void **p, size_t bytes, int dev);
void nvl_cuda_free(void *p, int dev);
/* kind: 0 host->device, 1 device->host, 2 device->device. Synchronous. */
nvl_status nvl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int dev);

/* out[i] = a[i] op b[i] over n contiguous f32 (op: nvl_binary_op ADD..DIV). */
nvl_status nvl_cuda_binary_f32(int op, float *out, const float *a, const float *b, int64_t n, int dev);

#ifdef __cplusplus
}
#endif
#endif
