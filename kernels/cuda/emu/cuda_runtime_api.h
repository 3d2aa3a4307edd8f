/* cuda_runtime_api.h (emulation): the part of the CUDA runtime API that nvlua calls, for the
 * emulation build of the CUDA backend (-DNVLUA_CUDA=EMU), where the .cu files of kernels/cuda are compiled by
 * the host C++ compiler and run on the CPU (kernels/cuda/emu/runtime.cpp). C and C++.
 *
 * Names and enum values are NVIDIA's, so the sources compile unchanged against either header;
 * only what nvlua uses is declared, and a call outside it does not compile. What a call does is
 * the documented behaviour plus checks a GPU would make (runtime.cpp says which).
 *
 * Not here: the device side (threads, shared memory, warp functions, launches: device.h, C++ only). */
#ifndef NVL_EMU_CUDA_RUNTIME_API_H
#define NVL_EMU_CUDA_RUNTIME_API_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NVL_CUDA_EMULATED 1

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInsufficientDriver = 35,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999
} cudaError_t;

typedef struct nvl_emu_stream *cudaStream_t;
typedef struct nvl_emu_event *cudaEvent_t;

typedef enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
} cudaMemcpyKind;

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00

typedef enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
} cudaDeviceAttr;

typedef enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;

typedef struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;      /* 48 KiB: static + dynamic without the opt-in */
  size_t sharedMemPerBlockOptin; /* with cudaFuncAttributeMaxDynamicSharedMemorySize */
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int major, minor;
  int multiProcessorCount;
  int pciDomainID, pciBusID, pciDeviceID;
} cudaDeviceProp;

/* library_types.h */
typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_16BF = 14,
  CUDA_R_8F_E4M3 = 28,
  CUDA_R_8F_UE4M3 = CUDA_R_8F_E4M3,
  CUDA_R_8F_E5M2 = 29,
  CUDA_R_8F_UE8M0 = 30,
  CUDA_R_4F_E2M1 = 33
} cudaDataType;

const char *cudaGetErrorName(cudaError_t e);
/* The documented string; for the last error the emulator raised, that string and what it found. */
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr attr, int dev);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDeviceSynchronize(void);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t s);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);

cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t stop);

/* cudaFuncSetAttribute takes the kernel's address (the C++ template in device.h forwards to it). */
cudaError_t nvl_emu_func_set_attribute(const void *func, cudaFuncAttribute attr, int value);

#ifdef __cplusplus
}
#endif
#endif
