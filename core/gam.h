/* gam.h: GAM scaling of a tensor into fp8 blocks (issue 34; the rule and its edge cases are
 * kernels/cpu/ref/gam_ref.h's), dispatched to the backend table's gam_quantize entry: the scalar
 * reference while nv.use_reference(true) is on, the fast CPU kernel, or the CUDA kernel, the same bits.
 * Used by MoR's scale = "gam" (lua/nvlua/mor.lua) through core.gam_quantize; its operands are assembled
 * from these parts (core/quant.h nvl_qtensor_assemble).
 *
 * Not here: the rule itself (gam_ref.h), decoding (nvl_gam_dequantize_ref), MoR's choice, Lua.
 *
 * Shape letters: R rows, K the contiguous blocked dim, B the block length, G blocks per group. */
#ifndef NVL_GAM_H
#define NVL_GAM_H
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* codes (new u8 [R, K]) e4m3 / e5m2 codes, scales (new u8 [R, K/B]) E8M0 bytes 127 - e_b, mant (new f32
 * [R*(K/B) / G]) the groups' m_g, all on x's device, from x (2-D f32 [R, K], blocked along its last dim);
 * group_blocks G >= 1, or 0 for the whole tensor (one group). A NaN or an inf in x is not an error: it
 * sets the device's NVL_NONFINITE_INPUT flag (core/backend.h). */
nvl_status nvl_gam_quantize(nvl_tensor *codes, nvl_tensor *scales, nvl_tensor *mant, const nvl_tensor *x,
                            int64_t block, int64_t group_blocks, nvl_elem elem);

#ifdef __cplusplus
}
#endif
#endif
