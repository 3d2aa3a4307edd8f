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
 * heuristics, collectives, cudnn_plans (cuDNN execution plans finalized), cudnn_executes
 * (cudnnBackendExecute calls that ran); memcpy_h2d/d2h/d2d_bytes and memset_bytes (bytes copied or set),
 * gemm_flops (2 m n k per cuBLASLt matmul), gemm_subnormals (in bf16 x bf16 cuBLASLt matmuls, the
 * subnormal inputs, products and partial sums met in the emulator's own summation order: what tensor
 * cores may flush; the emulator keeps them, so results do not show it). */
const char *nvl_emu_counter(int i, int64_t *value);
/* Kernel i (in order of first launch): its name and launches, blocks and threads run so far, or NULL
 * past the last one. */
const char *nvl_emu_kernel_counter(int i, int64_t *launches, int64_t *blocks, int64_t *threads);
/* Kernel i's global-memory bytes read and written so far (0 past the last kernel): per launch, the
 * unique bytes of the 4 KiB pages its threads loaded from / stored to, each page clipped to its
 * allocation (emu.h: track_begin says exactly what is counted). Counted on x86-64 only:
 * nvl_emu_bytes_counted() says whether this build counts them. */
int nvl_emu_kernel_bytes(int i, int64_t *read, int64_t *written);
int nvl_emu_bytes_counted(void);
/* One cuBLASLt GEMM shape and type signature: the calls made with it and what they add up to. FLOPs
 * 2 m n k per call; bytes from the layouts: A (m x k) and B (k x n) read, C read when beta != 0
 * (C == D included), D (m x n) written, the block or per-tensor scales read. */
typedef struct {
  int type_a, type_b, type_d; /* cudaDataType: 0 f32, 14 bf16, 28 e4m3, 29 e5m2, 33 e2m1 (cublasLt.h) */
  int scale_mode;             /* A's CUBLASLT_MATMUL_MATRIX_SCALE_* (0: per-tensor f32 or none) */
  int64_t m, n, k, calls, flops, bytes_a, bytes_b, bytes_c, bytes_d, bytes_scales;
} nvl_emu_gemm_info;
int nvl_emu_gemm_counter(int i, nvl_emu_gemm_info *g);
/* Every counter back to 0, the kernel and GEMM lists emptied. */
void nvl_emu_reset_counters(void);

#ifdef __cplusplus
}
#endif
#endif
