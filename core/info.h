/* info.h: build and runtime facts for `nvlua -v` and nv.info(). */
#ifndef NVL_INFO_H
#define NVL_INFO_H
#include <stdint.h>
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
#endif
