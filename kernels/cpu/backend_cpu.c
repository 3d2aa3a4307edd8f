/* backend_cpu.c: the CPU table (core/backend.h): OpenMP, SIMD and OpenBLAS kernels of kernels/cpu,
 * tested against the reference table. An op without a fast kernel is left empty here and runs the
 * reference through the fallback; the fast entries themselves use the reference for layouts they do
 * not cover. */
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
  .gam_quantize = nvl_quantize_gam_cpu,

  .layers = &nvl_layers_cpu,

  .copy = nvl_copy_cpu,
  .binary = nvl_binary_cpu,
  .binary_scalar = nvl_binary_scalar_cpu,
  .unary = nvl_unary_cpu,
  .reduce_all = nvl_reduce_all_cpu,
  .matmul = nvl_matmul_cpu,
  .axpy = nvl_axpy_cpu,
  .scale = nvl_scale_cpu,
  .fill = nvl_fill_cpu,

  .fallback = &nvl_backend_ref,
};
