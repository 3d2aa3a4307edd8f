/* info.c: build and runtime facts (see info.h). */
#include "cpu/gemm_bf16_cpu.h"
#include "cpu/ops_cpu.h"
#include "info.h"
#include <stdio.h>

const char *nvl_blas_info(void) { return nvl_blas_config(); }
const char *nvl_dnnl_info(void) { return nvl_gemm_bf16_info(); }
int nvl_cpu_gemm_bf16_switch(int on) { return nvl_gemm_bf16_switch(on); }
int nvl_cpu_gemm_bf16_ready(void) { return nvl_gemm_bf16_ready(); }

void nvl_cpu_gemm_paths(int64_t *bf16, int64_t *sgemm) {
  *bf16 = nvl_cpu_gemm_route_calls(NVL_CPU_GEMM_BF16);
  *sgemm = nvl_cpu_gemm_route_calls(NVL_CPU_GEMM_SGEMM);
}

static char fp_env_note[160] = "ieee";

int nvl_fp_env_ieee(const char *where) {
  int found = 0;
#if defined(__x86_64__) || defined(__i386__)
  unsigned csr;
  __asm__ volatile("stmxcsr %0" : "=m"(csr));
  found = ((csr >> 15) & 1u ? NVL_FP_FTZ : 0) | ((csr >> 6) & 1u ? NVL_FP_DAZ : 0);
  if (found) {
    csr &= ~((1u << 15) | (1u << 6));
    __asm__ volatile("ldmxcsr %0" : : "m"(csr));
  }
#elif defined(__aarch64__)
  unsigned long fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  found = (fpcr >> 24) & 1ul ? NVL_FP_FTZ : 0;
  if (found) {
    fpcr &= ~(1ul << 24);
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
  }
#endif
  if (found && fp_env_note[0] == 'i')
    snprintf(fp_env_note, sizeof fp_env_note, "%s%s%s found set %s (cleared)", found & NVL_FP_FTZ ? "FTZ" : "",
             found == (NVL_FP_FTZ | NVL_FP_DAZ) ? "+" : "", found & NVL_FP_DAZ ? "DAZ" : "", where ? where : "");
  return found;
}

const char *nvl_fp_env_info(void) { return fp_env_note; }
