/* backend_ref.c: the reference table (core/backend.h): the plain scalar kernels of kernels/cpu/ref,
 * the contract in readable form. core/ uses it for CPU tensors while nv.use_reference(true) is on;
 * the fast CPU and CUDA kernels are tested against it. */
#include "cpu/ref/layers_ref.h"
#include "cpu/ref/ops_ref.h"
#include "cpu/ref/qentry_ref.h"

#define VALUES {nvl_quantize_values_ref, nvl_dequantize_values_ref, nvl_qgemm_ref}
#define TENSOR {nvl_quantize_tensor_ref, nvl_dequantize_tensor_ref, nvl_qgemm_ref}
#define MX {nvl_quantize_mx_ref, nvl_dequantize_mx_ref, nvl_qgemm_ref}
#define NVFP4 {nvl_quantize_nvfp4_ref, nvl_dequantize_nvfp4_ref, nvl_qgemm_ref}

const nvl_backend nvl_backend_ref = {
  .name = "reference",
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
  .rht = nvl_rht_ref,
  .transpose_tiles = nvl_transpose_tiles_ref,
  .gam_quantize = nvl_quantize_gam_ref,

  .layers = &nvl_layers_ref,

  .copy = nvl_copy_ref,
  .fill = nvl_fill_ref,
  .binary = nvl_binary_ref,
  .binary_scalar = nvl_binary_scalar_ref,
  .unary = nvl_unary_ref,
  .reduce_all = nvl_reduce_all_ref,
  .reduce_last = nvl_reduce_last_ref,
  .matmul = nvl_matmul_ref,
  .axpy = nvl_axpy_ref,
  .scale = nvl_scale_ref,
  .arange = nvl_arange_ref,
  .random = nvl_random_ref,
  .allclose = nvl_allclose_ref,
};
