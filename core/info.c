/* info.c: build and runtime facts (see info.h). */
#include "cpu/gemm_bf16_cpu.h"
#include "cpu/ops_cpu.h"
#include "info.h"

const char *nvl_blas_info(void) { return nvl_blas_config(); }
const char *nvl_dnnl_info(void) { return nvl_gemm_bf16_info(); }
int nvl_cpu_gemm_bf16_switch(int on) { return nvl_gemm_bf16_switch(on); }
int nvl_cpu_gemm_bf16_ready(void) { return nvl_gemm_bf16_ready(); }

void nvl_cpu_gemm_paths(int64_t *bf16, int64_t *sgemm) {
  *bf16 = nvl_cpu_gemm_route_calls(NVL_CPU_GEMM_BF16);
  *sgemm = nvl_cpu_gemm_route_calls(NVL_CPU_GEMM_SGEMM);
}
