/* formats_ref.h: scalar reference codecs and block quantizers for nvlua's low-precision formats
 * (e4m3, e5m2, e2m1, ue4m3, e8m0; NVFP4 1D/2D, the MX formats, FP8 per-tensor) and the 16-point RHT.
 * core/NUMERICS.md is the contract; every fast CPU and CUDA kernel is tested bit for bit against
 * these functions, and these against tests/golden/formats.txt (scripts/gen_golden_formats.py).
 *
 * Not here: speed, threads, tensors, allocation, Lua. Buffers are plain row-major arrays owned
 * by the caller. Element codes are unpacked, one byte per element (nvfp4: 0..15);
 * nvl_e2m1_pack_ref packs them two per byte.
 *
 * Shape letters: R rows, K the contiguous (blocked, GEMM-reduction) dimension, n elements.
 * Blocks run along K: nvfp4 1x16 (scales (R, K/16)), nvfp4 2D 16x16 tiles (scales still stored
 * per 1x16 block, (R, K/16), equal down a tile), mx 1x32 (scales (R, K/32)).
 *
 * NaN and infinity in inputs: amax and block maxima are fmaxf reductions of |x|, so NaN
 * elements do not raise them (an inf does). NaN elements encode to a NaN code (fp8) or +6
 * (e2m1); infinities saturate to the format's largest finite value. */
#ifndef NVL_FORMATS_REF_H
#define NVL_FORMATS_REF_H
#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element codecs ----------------------------------------------------------------------- */

/* fp32 -> e4m3 ("fn"): RNE, saturate to +-448 (inf too); NaN -> 0x7F | sign of the input. */
uint8_t nvl_e4m3_encode_ref(float x);
/* e4m3 -> fp32; 0x7F / 0xFF are NaN. */
float nvl_e4m3_decode_ref(uint8_t c);

/* fp32 -> e5m2: RNE, satfinite to +-57344 (inf too); NaN -> 0x7F | sign of the input. */
uint8_t nvl_e5m2_encode_ref(float x);
/* e5m2 -> fp32; 0x7C / 0xFC are +-inf, 0x7D..0x7F / 0xFD..0xFF NaN. */
float nvl_e5m2_decode_ref(uint8_t c);

/* fp32 -> e2m1 code 0..15 (code | 8 negative): RNE with the thresholds of NUMERICS §1,
 * saturate to +-6, NaN -> 6; a negative value (or -0) that rounds to zero -> 8 (-0). */
uint8_t nvl_e2m1_encode_ref(float x);
/* e2m1 code (low 4 bits) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives (code 8 is -0). */
float nvl_e2m1_decode_ref(uint8_t c);
/* fp32 -> e2m1 by stochastic rounding with random byte r, exactly NUMERICS §3 (fmaf). */
uint8_t nvl_e2m1_encode_sr_ref(float x, uint8_t r);

/* fp32 -> ue4m3 (nvfp4 block scale, e4m3 bits with the sign bit 0): RNE, satfinite to 448.
 * Meant for x >= 0; a negative x (or -0) gives 0x00, NaN gives 0x7F. */
uint8_t nvl_ue4m3_encode_ref(float x);
/* ue4m3 -> fp32 (the sign bit is ignored); 0x7F is NaN. */
float nvl_ue4m3_decode_ref(uint8_t c);

/* e8m0 -> fp32: 2^(c-127) (c = 0 gives 2^-127, an fp32 subnormal); 0xFF is NaN. */
float nvl_e8m0_decode_ref(uint8_t c);
/* MX scale, rule "rceil" (NUMERICS §4): the smallest code e in [0, 254] with
 * 2^(e-127) >= bmax / elem_max (fp32 division). bmax = 0 -> 0; bmax = inf -> 254. */
uint8_t nvl_e8m0_scale_rceil_ref(float bmax, float elem_max);
/* MX scale, OCP rule "floor": code floor(log2 bmax) - emax_elem + 127 clamped to [0, 254].
 * bmax = 0 -> 0; bmax = inf -> 254. emax_elem: 8 for e4m3, 15 for e5m2. */
uint8_t nvl_e8m0_scale_floor_ref(float bmax, int emax_elem);

/* Encode / decode one element of a codec (dtype.h nvl_elem): the functions above by elem. */
uint8_t nvl_elem_encode_ref(nvl_elem elem, float x);
float nvl_elem_decode_ref(nvl_elem elem, uint8_t c);
/* Largest finite value: 448 (e4m3), 57344 (e5m2), 6 (e2m1). */
float nvl_elem_max_ref(nvl_elem elem);
/* emax of the element format (OCP MX): 8 (e4m3), 15 (e5m2), 2 (e2m1). */
int nvl_elem_emax_ref(nvl_elem elem);

/* e2m1 codes -> packed bytes, two per byte, the lower index in the low nibble; an odd n leaves
 * the high nibble of the last byte 0. packed: (n+1)/2 bytes, codes: (n). */
void nvl_e2m1_pack_ref(uint8_t *packed, const uint8_t *codes, int64_t n);
/* Packed bytes -> codes (n). */
void nvl_e2m1_unpack_ref(uint8_t *codes, const uint8_t *packed, int64_t n);

/* ---- random Hadamard transform (NUMERICS §5) ---------------------------------------------- */

/* The default sign vector: nvl_rht16_default_signs (dtype.h). */
/* y = x . diag(signs) H / 4 for one 16-chunk, in the contract's fixed order (sign, butterflies
 * h = 1, 2, 4, 8, then * 0.25). signs NULL: the default. y may alias x. */
void nvl_rht16_ref(float y[16], const float x[16], const float *signs);
/* Its inverse, y = x . H diag(signs) / 4 (R^T: R is orthonormal): butterflies h = 1, 2, 4, 8, * 0.25,
 * then the signs. y may alias x. */
void nvl_rht16_inverse_ref(float y[16], const float x[16], const float *signs);
/* The RHT on every 16-chunk along K of x (R, K) -> y (R, K); y may alias x. K % 16 == 0. */
nvl_status nvl_rht16_rows_ref(float *y, const float *x, int64_t rows, int64_t K, const float *signs);

/* ---- NVFP4 (NUMERICS §2, §3) --------------------------------------------------------------- */

/* Options of the block quantizers (nvfp4, mx); all-zero means RNE with the amax computed from x. */
typedef struct {
  int sr;           /* 1: stochastic rounding of the elements (§3; e2m1 elements only); scales stay RNE */
  uint64_t seed;    /* SR: Philox key (seed lo, seed hi) */
  uint64_t offset;  /* SR: Philox counter words 1-2, the generator's call counter */
  int has_amax;     /* nvfp4: 1: use amax below (e.g. a precomputed or reduced amax), not max|x| */
  float amax;
  /* SR draws of a slab of a larger tensor (data parallelism: each rank quantizes its slice, and
   * must draw the bits the whole tensor would). x (R, K) is rows [sr_row_offset, +R) x columns
   * [sr_k_offset, +K) of a global blocked layout (., sr_k_total); all zero (sr_k_total 0 means
   * K): the tensor itself. sr_k_offset and sr_k_total are multiples of the block length,
   * sr_k_offset + K <= sr_k_total. */
  int64_t sr_row_offset, sr_k_offset, sr_k_total;
} nvl_quant_ref_opts;

/* Check o's SR slab fields for an (R, K) call with blocks of `block`; op names the caller. NULL
 * o: OK. */
nvl_status nvl_sr_check_slab(const char *op, const nvl_quant_ref_opts *o, int64_t K, int block);
/* The Philox counter of the 16 elements [16 j, 16 j + 16) of row `row` of an (R, K) call: the
 * index of that 16-element group in the global blocked layout, (sr_row_offset + row) *
 * (kt/16) + sr_k_offset/16 + j, kt = sr_k_total or K (row * (K/16) + j for a whole tensor).
 * Element i of the group takes byte i%4 of word i/4, lowest byte first (NUMERICS §3): an nvfp4
 * block is one group, an mx block of 32 two consecutive ones. */
static inline uint64_t nvl_sr_group(const nvl_quant_ref_opts *o, int64_t K, int64_t row, int64_t j) {
  int64_t kt = o->sr_k_total ? o->sr_k_total : K;
  /* unsigned: core/quant.c bounds the global layout, so this is the exact index, never a wrap */
  return ((uint64_t)o->sr_row_offset + (uint64_t)row) * (uint64_t)(kt / 16) + (uint64_t)(o->sr_k_offset / 16) +
         (uint64_t)j;
}

/* The host's non-finite flags (core/backend.h NVL_NONFINITE_*), one word for every CPU table:
 * set ORs bits in (relaxed atomics, from any thread), take reads and clears them. */
void nvl_host_nonfinite_set(uint32_t bits);
uint32_t nvl_host_nonfinite_take(void);
/* 1 when x (n f32) holds a NaN or an infinity: the reference quantize entries' own scan (the fast
 * kernels fold the test into the passes they make anyway). */
int nvl_has_nonfinite_ref(const float *x, int64_t n);

/* Global encode scale s_enc = 2688 / amax with the §2 guards (FLT_MAX cap, 1 for 0/inf/nan). */
float nvl_nvfp4_enc_scale_ref(float amax);
/* Global decode scale used by dequantization: amax / 2688 (§2); where the encoder fell back
 * (amax 0 or not finite) or capped s_enc at FLT_MAX, 1 / s_enc instead, so decode matches. */
float nvl_nvfp4_dec_scale_ref(float amax);
/* Stored ue4m3 block scale for a block with max |x| = bmax under global encode scale s_enc. */
uint8_t nvl_nvfp4_block_scale_ref(float bmax, float s_enc);

/* NVFP4 1D: 1x16 blocks along K. codes (R, K) 0..15, scales (R, K/16) ue4m3, *amax the amax
 * used. x (R, K) f32. opts NULL: defaults. Block g = row * (K/16) + k/16 (or its index in the
 * global layout given by opts' SR slab fields, nvl_sr_group) draws Philox counter (g, offset lo,
 * offset hi, 0) under SR. K % 16 == 0. */
nvl_status nvl_nvfp4_quantize_1d_ref(uint8_t *codes, uint8_t *scales, float *amax, const float *x,
                                     int64_t rows, int64_t K, const nvl_quant_ref_opts *opts);
/* NVFP4 2D (weights): one block max per 16x16 tile of x (R, K), shared by the tile's 16 1x16
 * blocks; output laid out as in 1D: codes (R, K), scales (R, K/16). R % 16 == 0, K % 16 == 0. */
nvl_status nvl_nvfp4_quantize_2d_ref(uint8_t *codes, uint8_t *scales, float *amax, const float *x,
                                     int64_t rows, int64_t K, const nvl_quant_ref_opts *opts);
/* y (R, K) = value(code) * float(scale) * nvl_nvfp4_dec_scale_ref(amax); codes (R, K),
 * scales (R, K/16). Serves both 1D and 2D layouts. K % 16 == 0. */
nvl_status nvl_nvfp4_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, float amax,
                                    int64_t rows, int64_t K);

/* ---- MX formats (NUMERICS §4): 1x32 blocks, e8m0 scales, any element codec ----------------- */

/* codes (R, K) element codes, one byte each (e2m1: 0..15, unpacked), scales (R, K/32) e8m0;
 * q = elem(x * 2^(127-e)), RNE, or SR with opts->sr for e2m1 elements (the 32 bytes of block
 * (row, b) from groups 2b and 2b+1, nvl_sr_group). x (R, K) f32. K % 32 == 0. opts may be NULL. */
nvl_status nvl_mx_quantize_ref(uint8_t *codes, uint8_t *scales, const float *x, int64_t rows, int64_t K, nvl_elem elem,
                               nvl_mx_rule rule, const nvl_quant_ref_opts *opts);
/* y (R, K) = value(code) * 2^(scale-127) (fp32 product); scale 0xFF gives NaN. Codes unpacked. */
nvl_status nvl_mx_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K,
                                 nvl_elem elem);

/* ---- FP8 per-tensor scaling (NUMERICS §4) -------------------------------------------------- */
/* elem: e4m3 or e5m2. */

/* scale = elem_max / amax; 1 for amax 0, inf or nan; FLT_MAX if the division overflows. */
float nvl_fp8_tensor_scale_ref(float amax, nvl_elem elem);
/* codes (n) = elem_rne_satfinite(x * scale); *scale and *amax as used. amax_in NULL: current
 * scaling (amax = max|x|); else delayed scaling with the given amax. x (n) f32. */
nvl_status nvl_fp8_quantize_tensor_ref(uint8_t *codes, float *scale, float *amax, const float *x,
                                       int64_t n, nvl_elem elem, const float *amax_in);
/* y (n) = value(code) / scale. */
nvl_status nvl_fp8_dequantize_tensor_ref(float *y, const uint8_t *codes, float scale, int64_t n,
                                         nvl_elem elem);

#ifdef __cplusplus
}
#endif
#endif
