/* device.h: the devices besides the host, through their tables' device API (core/backend.h):
 * how many there are, their properties, memory statistics and controls. With no table for a
 * device (a build without CUDA) the queries say so: count 0, a reason, and calls that would touch
 * a device fail with NVL_EUNSUPPORTED and a message saying how to rebuild.
 * Not here: tensors on devices (tensor.h), the kernels. */
#ifndef NVL_DEVICE_H
#define NVL_DEVICE_H
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if nvlua was built with a table for device. */
int nvl_device_compiled(nvl_device device);
/* Usable devices (0 without a table, a driver or a GPU; never an error). */
int nvl_device_count(nvl_device device);
/* Why the count is 0 ("" if it is not). */
const char *nvl_device_unavailable_reason(nvl_device device);
nvl_status nvl_device_props_of(nvl_device device, int dev, nvl_device_props *p);
/* Runtime and BLAS library versions (0 without a table). */
int nvl_device_runtime_version(nvl_device device);
size_t nvl_device_blas_version(nvl_device device);
nvl_status nvl_device_synchronize(nvl_device device, int dev);
/* Synchronise after every launch (on) or not; returns the previous setting. */
int nvl_device_set_sync(nvl_device device, int on);
nvl_status nvl_device_memory_stats(nvl_device device, int dev, nvl_device_mem_stats *s);
void nvl_device_empty_cache(nvl_device device, int dev);
/* Fill every block the allocator hands out with byte (>= 0), or stop (-1); returns the previous. */
int nvl_device_set_poison(nvl_device device, int byte);
nvl_status nvl_device_timer_start(nvl_device device, int dev);
nvl_status nvl_device_timer_stop(nvl_device device, int dev, double *ms);
/* The path out = A . B^T takes for formats a, b on the device (detail: a description, or why not). */
nvl_gemm_path nvl_device_gemm_path(nvl_device device, nvl_dtype a, nvl_dtype b, int dev, char *detail, size_t n);

/* The reference switch: while on (for the calling thread), every op on CPU tensors runs the scalar
 * reference table, and ops on device tensors refuse to run. Returns the previous setting. */
int nvl_use_reference(int on);

#ifdef __cplusplus
}
#endif
#endif
