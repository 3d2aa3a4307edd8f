/* gam_ref.h: Group Amax Mantissa (GAM) scaling of fp8 blocks, the scalar reference (issue 34: MoR as
 * published, arXiv 2512.22804, its Algorithm 1 as secondary accounts give it). Groundwork: the backend
 * tables' gam_quantize entry (core/gam.h) runs it (reference table) or matches it bit for bit (CPU,
 * CUDA); no qtensor or recipe uses it yet; core/NUMERICS.md will carry the contract when one does.
 *
 * Not here: tensors, threads, speed, Lua, the choice between representations (MoR's), the GEMM.
 *
 * Shape letters: R rows, K the contiguous (blocked, GEMM-reduction) dimension, B the block length
 * (1 x B blocks along K), G blocks per group. Blocks are numbered row-major, b = r * (K/B) + k/B
 * (NUMERICS §0's layout), and group j holds blocks [j G, (j + 1) G).
 *
 * The rule, elem e4m3 (qmax 448) or e5m2 (qmax 57344):
 *   gamax = max |x| over the group, bamax = max |x| over the block (fmaxf: NaN ignored, inf counts)
 *   s_g = qmax / gamax = m_g 2^E_g,  1 <= m_g < 2     (only m_g is kept: one fp32 per group)
 *   s_b = qmax / bamax = m_b 2^e_b,  1 <= m_b < 2     (only e_b is kept: one E8M0 byte per block)
 *   e_b = e_b - 1 when m_b < m_g, so that scale_b = m_g 2^e_b <= s_b: the block cannot saturate
 *   code_i  = elem_rne_satfinite(x_i * scale_b)       (the fp32 product, then the element codec)
 *   x^_i    = code_i 2^-e_b / m_g                     (one rounding, to fp32)
 * The quotients are the fp32 quotient, rounded once to 24 bits, with an unbounded exponent (the
 * fp32 division itself wherever it is finite: a >= qmax / FLT_MAX, ~2^-119.2 for e4m3, ~2^-112.2
 * for e5m2). qmax is 1.75 x a power of two for both codecs, so m_g is the same for e4m3 and e5m2 and
 * their e_b differ by 7 (until a clamp below).
 * Edge cases (nvlua's choices, the paper's being unknown):
 *   - gamax 0, inf (or a group of NaN and zeros): m_g = 1, as per-tensor fp8 takes scale 1 (§4.2).
 *   - bamax 0 (a zero block, or zeros and NaN): e_b = 127, the E8M0 code 0 an MX zero block gets;
 *     the codes are zeros (0x80 for -0, as the codec writes it) and NaN codes for NaN.
 *   - e_b > 127 (bamax below ~2^-119.2 for e4m3, ~2^-112.2 for e5m2, where the fp32 s_b
 *     overflows; subnormal maxima included): e_b = 127, the largest E8M0
 *     range; the scale is smaller than the rule's, so still no saturation, and small values lose
 *     precision or flush to zero (such a block fails MoR's error criterion).
 *   - bamax inf: e_b = -127 (E8M0 code 254, as MX's rceil gives an infinite block); m_g is then 1
 *     (the group holds the inf), inf codes saturate to +-qmax, NaN gives the NaN code.
 *   - NaN or inf anywhere: not an error. The codes are defined above, and *nonfinite says so, for the
 *     caller to raise NVL_NONFINITE_INPUT as every quantization into fp8 does (NUMERICS §8).
 * Finite blocks have e_b in [-121, 127], so scale_b = m_g 2^e_b is a normal fp32 number, exact. */
#ifndef NVL_GAM_REF_H
#define NVL_GAM_REF_H
#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* m_g for a group with max |x| = gamax, elem e4m3 or e5m2: in [1, 2); 1 for gamax 0, inf, NaN. */
float nvl_gam_group_mantissa_ref(float gamax, nvl_elem elem);
/* e_b for a block with max |x| = bamax in a group of mantissa m_g: in [-127, 127] (edge cases above). */
int nvl_gam_block_exp_ref(float bamax, float m_g, nvl_elem elem);
/* The stored byte of e_b: the E8M0 code of the decode factor 2^-e_b, 127 - e_b (an MX scale byte). */
static inline uint8_t nvl_gam_e8m0_of_exp(int e_b) { return (uint8_t)(127 - e_b); }
static inline int nvl_gam_exp_of_e8m0(uint8_t c) { return 127 - (int)c; }

/* codes (R, K) element codes, scales (R, K/B) E8M0 bytes 127 - e_b, mant (R*(K/B) / G) the groups'
 * m_g, from x (R, K) f32. group_blocks G: blocks per group, 0 for the whole tensor (one group); it
 * must divide R*(K/B). *nonfinite (may be NULL) = 1 when x holds a NaN or an infinity, else 0. */
nvl_status nvl_gam_quantize_ref(uint8_t *codes, uint8_t *scales, float *mant, int *nonfinite, const float *x,
                                int64_t rows, int64_t K, int block, int64_t group_blocks, nvl_elem elem);
/* y (R, K) = the decoded values: value(code) 2^-e_b / m_g rounded once to fp32. Same layout and
 * arguments as nvl_gam_quantize_ref. The GEMM operand, value(code) 2^-e_b without the 1 / m_g, is
 * what nvl_mx_dequantize_ref decodes from the same codes and bytes when B = 32. */
nvl_status nvl_gam_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, const float *mant,
                                  int64_t rows, int64_t K, int block, int64_t group_blocks, nvl_elem elem);

#ifdef __cplusplus
}
#endif
#endif
