/* backend_cpu.c: the CPU table (core/backend.h): OpenMP, SIMD and OpenBLAS kernels of kernels/cpu,
 * tested against the reference table; where a fast kernel does not cover a layout or an op, the
 * entry is the reference itself. */
#include "cpu/attention_cpu.h"
#include "cpu/layers_cpu.h"
#include "cpu/ops_cpu.h"
#include "cpu/qentry_cpu.h"

#define VALUES {nvl_quantize_values_cpu, nvl_dequantize_values_cpu, nvl_qgemm_cpu}
#define TENSOR {nvl_quantize_tensor_cpu, nvl_dequantize_tensor_cpu, nvl_qgemm_cpu}
#define MX {nvl_quantize_mx_cpu, nvl_dequantize_mx_cpu, nvl_qgemm_cpu}
#define NVFP4 {nvl_quantize_nvfp4_cpu, nvl_dequantize_nvfp4_cpu, nvl_qgemm_cpu}

const nvl_backend nvl_backend_cpu = {
  .name = "cpu",
  .device = NVL_CPU,
  .formats = {
    [NVL_F32] = VALUES,
    [NVL_BF16] = VALUES,
    [NVL_E4M3] = TENSOR,
    [NVL_E5M2] = TENSOR,
    [NVL_MXFP8_E4M3] = MX,
    [NVL_MXFP8_E5M2] = MX,
    [NVL_NVFP4] = NVFP4,
    [NVL_MXFP4] = MX,
  },
  .rht = nvl_rht_cpu,

  .embedding_forward = nvl_embedding_forward_cpu,
  .embedding_backward = nvl_embedding_backward_cpu,
  .rmsnorm_forward = nvl_rmsnorm_forward_cpu,
  .rmsnorm_backward = nvl_rmsnorm_backward_cpu,
  .rope_tables = nvl_rope_tables_entry_ref, /* computed once, in double */
  .rope_forward = nvl_rope_forward_cpu,
  .rope_backward = nvl_rope_backward_cpu,
  .swiglu_forward = nvl_swiglu_forward_cpu,
  .swiglu_backward = nvl_swiglu_backward_cpu,
  .cross_entropy = nvl_cross_entropy_cpu,
  .adamw_step = nvl_adamw_step_cpu,
  .sumsq = nvl_sumsq_cpu,
  .attention_forward = nvl_attention_forward_cpu,
  .attention_backward = nvl_attention_backward_cpu,

  .copy = nvl_copy_cpu,
  .fill = nvl_fill_ref,
  .binary = nvl_binary_cpu,
  .binary_scalar = nvl_binary_scalar_cpu,
  .unary = nvl_unary_cpu,
  .reduce_all = nvl_reduce_all_cpu,
  .reduce_last = nvl_reduce_last_ref,
  .matmul = nvl_matmul_cpu,
  .axpy = nvl_axpy_cpu,
  .scale = nvl_scale_cpu,
  .arange = nvl_arange_ref,
  .random = nvl_random_ref,
  .allclose = nvl_allclose_ref,
};
