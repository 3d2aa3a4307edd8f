/* formats_ref.h: scalar reference codecs and block quantizers for nvlua's low-precision formats
 * (e4m3, e5m2, e2m1, ue4m3, e8m0; NVFP4 1D/2D, MXFP8, FP8 per-tensor) and the 16-point RHT.
 * NUMERICS.md is the contract; every fast CPU and CUDA kernel is tested bit for bit against
 * these functions, and these against tests/golden/formats.txt (scripts/gen_golden_formats.py).
 *
 * Not here: speed, threads, tensors, allocation, Lua. Buffers are plain row-major arrays owned
 * by the caller. Element codes are unpacked, one byte per element (nvfp4: 0..15);
 * nvl_e2m1_pack_ref packs them two per byte.
 *
 * Shape letters: R rows, K the contiguous (blocked, GEMM-reduction) dimension, n elements.
 * Blocks run along K: nvfp4 1x16 (scales (R, K/16)), nvfp4 2D 16x16 tiles (scales still stored
 * per 1x16 block, (R, K/16), equal down a tile), mxfp8 1x32 (scales (R, K/32)).
 *
 * NaN and infinity in inputs: amax and block maxima are fmaxf reductions of |x|, so NaN
 * elements do not raise them (an inf does). NaN elements encode to a NaN code (fp8) or +6
 * (e2m1); infinities saturate to the format's largest finite value. */
#ifndef NVL_FORMATS_REF_H
#define NVL_FORMATS_REF_H
#include "nvl.h"

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

/* The two fp8 element formats, for the block/tensor quantizers. Values are stable. */
typedef enum { NVL_ELEM_E4M3 = 0, NVL_ELEM_E5M2 = 1, NVL_ELEM_COUNT } nvl_fp8_elem;
/* MX e8m0 scale rules. Values are stable. */
typedef enum { NVL_MX_RCEIL = 0, NVL_MX_FLOOR = 1, NVL_MX_RULE_COUNT } nvl_mx_rule;

/* Encode / decode one element of an fp8 format. */
uint8_t nvl_fp8_encode_ref(nvl_fp8_elem elem, float x);
float nvl_fp8_decode_ref(nvl_fp8_elem elem, uint8_t c);
/* Largest finite value: 448 (e4m3), 57344 (e5m2). */
float nvl_fp8_max_ref(nvl_fp8_elem elem);
/* emax of the element format (OCP MX): 8 (e4m3), 15 (e5m2). */
int nvl_fp8_emax_ref(nvl_fp8_elem elem);

/* e2m1 codes -> packed bytes, two per byte, the lower index in the low nibble; an odd n leaves
 * the high nibble of the last byte 0. packed: (n+1)/2 bytes, codes: (n). */
void nvl_e2m1_pack_ref(uint8_t *packed, const uint8_t *codes, int64_t n);
/* Packed bytes -> codes (n). */
void nvl_e2m1_unpack_ref(uint8_t *codes, const uint8_t *packed, int64_t n);

/* ---- random Hadamard transform (NUMERICS §5) ---------------------------------------------- */

/* The default sign vector s of R = diag(s) H / 4, entries +-1. */
extern const float nvl_rht16_default_signs[16];
/* y = x . diag(signs) H / 4 for one 16-chunk, in the contract's fixed order (sign, butterflies
 * h = 1, 2, 4, 8, then * 0.25). signs NULL: the default. y may alias x. */
void nvl_rht16_ref(float y[16], const float x[16], const float *signs);
/* The RHT on every 16-chunk along K of x (R, K) -> y (R, K); y may alias x. K % 16 == 0. */
nvl_status nvl_rht16_rows_ref(float *y, const float *x, int64_t rows, int64_t K, const float *signs);

/* ---- NVFP4 (NUMERICS §2, §3) --------------------------------------------------------------- */

/* Options of the nvfp4 quantizers; all-zero means RNE with the amax computed from x. */
typedef struct {
  int sr;           /* 1: stochastic rounding of the elements (§3); block scales stay RNE */
  uint64_t seed;    /* SR: Philox key (seed lo, seed hi) */
  uint64_t offset;  /* SR: Philox counter words 1-2, the generator's call counter */
  int has_amax;     /* 1: use amax below (e.g. a precomputed or reduced amax), not max|x| */
  float amax;
  /* SR block indices of a slab of a larger tensor (data parallelism: each rank quantizes its
   * slice, and must draw the bits the whole tensor would). x (R, K) is rows [sr_row_offset,
   * +R) x columns [sr_k_offset, +K) of a global blocked layout (., sr_k_total); block (row, k/16)
   * draws counter g = (sr_row_offset + row) * (sr_k_total/16) + (sr_k_offset + k)/16. All zero
   * (sr_k_total 0 means K): the tensor itself, g = row * (K/16) + k/16. sr_k_offset and
   * sr_k_total are multiples of 16, sr_k_offset + K <= sr_k_total. */
  int64_t sr_row_offset, sr_k_offset, sr_k_total;
} nvl_nvfp4_ref_opts;

/* Check o's SR slab fields for an (R, K) call; op names the caller. NULL o: OK. */
nvl_status nvl_nvfp4_check_sr_slab(const char *op, const nvl_nvfp4_ref_opts *o, int64_t K);
/* The SR block index (NUMERICS §3) of block (row, b) (b = k/16) of an (R, K) call under o's
 * slab fields: row * (K/16) + b when they are zero. */
static inline uint64_t nvl_nvfp4_sr_block(const nvl_nvfp4_ref_opts *o, int64_t K, int64_t row, int64_t b) {
  int64_t kt = o->sr_k_total ? o->sr_k_total : K;
  return (uint64_t)((o->sr_row_offset + row) * (kt / 16) + o->sr_k_offset / 16 + b);
}

/* Global encode scale s_enc = 2688 / amax with the §2 guards (FLT_MAX cap, 1 for 0/inf/nan). */
float nvl_nvfp4_enc_scale_ref(float amax);
/* Global decode scale used by dequantization: amax / 2688 (§2); where the encoder fell back
 * (amax 0 or not finite) or capped s_enc at FLT_MAX, 1 / s_enc instead, so decode matches. */
float nvl_nvfp4_dec_scale_ref(float amax);
/* Stored ue4m3 block scale for a block with max |x| = bmax under global encode scale s_enc. */
uint8_t nvl_nvfp4_block_scale_ref(float bmax, float s_enc);

/* NVFP4 1D: 1x16 blocks along K. codes (R, K) 0..15, scales (R, K/16) ue4m3, *amax the amax
 * used. x (R, K) f32. opts NULL: defaults. Block g = row * (K/16) + k/16 (or its index in the
 * global layout given by opts' SR slab fields) draws Philox counter (g, offset lo, offset hi, 0)
 * under SR. K % 16 == 0. */
nvl_status nvl_nvfp4_quantize_1d_ref(uint8_t *codes, uint8_t *scales, float *amax, const float *x,
                                     int64_t rows, int64_t K, const nvl_nvfp4_ref_opts *opts);
/* NVFP4 2D (weights): one block max per 16x16 tile of x (R, K), shared by the tile's 16 1x16
 * blocks; output laid out as in 1D: codes (R, K), scales (R, K/16). R % 16 == 0, K % 16 == 0. */
nvl_status nvl_nvfp4_quantize_2d_ref(uint8_t *codes, uint8_t *scales, float *amax, const float *x,
                                     int64_t rows, int64_t K, const nvl_nvfp4_ref_opts *opts);
/* y (R, K) = value(code) * float(scale) * nvl_nvfp4_dec_scale_ref(amax); codes (R, K),
 * scales (R, K/16). Serves both 1D and 2D layouts. K % 16 == 0. */
nvl_status nvl_nvfp4_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales, float amax,
                                    int64_t rows, int64_t K);

/* ---- MXFP8 (NUMERICS §4) ------------------------------------------------------------------- */

/* MXFP8: 1x32 blocks along K, e8m0 scale each. codes (R, K) fp8 codes, scales (R, K/32);
 * q = elem_rne_satfinite(x * 2^(127-e)). x (R, K) f32. K % 32 == 0. */
nvl_status nvl_mxfp8_quantize_ref(uint8_t *codes, uint8_t *scales, const float *x, int64_t rows,
                                  int64_t K, nvl_fp8_elem elem, nvl_mx_rule rule);
/* y (R, K) = value(code) * 2^(scale-127) (fp32 product); scale 0xFF gives NaN. */
nvl_status nvl_mxfp8_dequantize_ref(float *y, const uint8_t *codes, const uint8_t *scales,
                                    int64_t rows, int64_t K, nvl_fp8_elem elem);

/* ---- FP8 per-tensor scaling (NUMERICS §4) -------------------------------------------------- */

/* scale = elem_max / amax; 1 for amax 0, inf or nan; FLT_MAX if the division overflows. */
float nvl_fp8_tensor_scale_ref(float amax, nvl_fp8_elem elem);
/* codes (n) = elem_rne_satfinite(x * scale); *scale and *amax as used. amax_in NULL: current
 * scaling (amax = max|x|); else delayed scaling with the given amax. x (n) f32. */
nvl_status nvl_fp8_quantize_tensor_ref(uint8_t *codes, float *scale, float *amax, const float *x,
                                       int64_t n, nvl_fp8_elem elem, const float *amax_in);
/* y (n) = value(code) / scale. */
nvl_status nvl_fp8_dequantize_tensor_ref(float *y, const uint8_t *codes, float scale, int64_t n,
                                         nvl_fp8_elem elem);

#ifdef __cplusplus
}
#endif
#endif
