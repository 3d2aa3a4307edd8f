/* info.h: build and runtime facts for `nvlua -v` and nv.info(). */
#ifndef NVL_INFO_H
#define NVL_INFO_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
/* The BLAS library in use and its configuration. */
const char *nvl_blas_info(void);
/* oneDNN: whether the CPU's emulated GEMMs use the bf16 units through it, on which ISA and
 * implementation, or why not (kernels/cpu/gemm_bf16_cpu.h). */
const char *nvl_dnnl_info(void);
/* The CPU bf16 GEMM path: the in-process switch (sets it unless on < 0, returns the previous
 * setting), whether the path can run now (built with oneDNN, bf16 units, switched on), and how many
 * emulated GEMMs ran on it and on sgemm since the start. */
int nvl_cpu_gemm_bf16_switch(int on);
int nvl_cpu_gemm_bf16_ready(void);
void nvl_cpu_gemm_paths(int64_t *bf16, int64_t *sgemm);
/* IEEE subnormals on this thread: clears x86's MXCSR flush-to-zero (bit 15) and denormals-are-zero
 * (bit 6), or AArch64's FPCR.FZ (bit 24), when something in the process set them, and returns which
 * were set (NVL_FP_FTZ | NVL_FP_DAZ; 0: none). nvlua's CPU numerics (the formats' scales, the
 * references) are IEEE fp32 with subnormals, bit for bit: a library that turns on FTZ/DAZ (its
 * load-time constructor, say, when built with -ffast-math) silently changes them. Called at the
 * start of main() (threads created later inherit the state) and by the C unit runner after each
 * test. On the H200 machine (2026-11-28) none of the libraries nvlua links set them, at load or
 * after cudaMalloc, cublasLtCreate or an sgemm. The first non-zero return is remembered for
 * nv.info().fp_env. */
enum { NVL_FP_FTZ = 1, NVL_FP_DAZ = 2 };
int nvl_fp_env_ieee(const char *where);
/* "ieee" or what was found set and where, e.g. "FTZ+DAZ found set at start-up (cleared)". */
const char *nvl_fp_env_info(void);
#ifdef __cplusplus
}
#endif
#endif
