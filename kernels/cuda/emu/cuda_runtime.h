/* cuda_runtime.h (emulation): the runtime API (cuda_runtime_api.h) and, in C++, the device side
 * (emu_device.h): what `#include <cuda_runtime.h>` gives a .cu file of kernels/cuda in the emulation
 * build. */
#ifndef NVL_EMU_CUDA_RUNTIME_H
#define NVL_EMU_CUDA_RUNTIME_H
#include "cuda_runtime_api.h"
#ifdef __cplusplus
#include "emu_device.h"
#endif
#endif
