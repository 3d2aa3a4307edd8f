/* emu_api.h: what nvlua's C code may ask the CUDA emulator (kernels/cuda/emu) in the emulation build
 * (NVL_CUDA_EMU): a description of the emulation and its counters. C and C++. */
#ifndef NVL_EMU_API_H
#define NVL_EMU_API_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* "emulated on the CPU (kernels/cuda/emu): ..." (devices, compute capability, thread order). */
const char *nvl_emu_description(void);
/* Counter i since the process started: its name and *value, or NULL past the last one. Counters:
 * launches, host_syncs (calls after which the host has waited for device work: synchronisations,
 * blocking copies, a copy from pageable memory), queries, memcpy_h2d/d2h/d2d, memsets, gemms,
 * heuristics, collectives. */
const char *nvl_emu_counter(int i, int64_t *value);
/* Kernel i (in order of first launch): its name and launches, blocks and threads run so far, or NULL
 * past the last one. */
const char *nvl_emu_kernel_counter(int i, int64_t *launches, int64_t *blocks, int64_t *threads);

#ifdef __cplusplus
}
#endif
#endif
