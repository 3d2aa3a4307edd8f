/* dtype.h: the number formats nvlua knows, one traits row per dtype (DESIGN.md "Formats"). This is
 * a shared format header: core/, every backend in kernels/ and (through nv.formats) the Lua library
 * read the same row; nothing else keeps its own table of bits, block lengths or names, and generic
 * code never switches on a format by hand. core/NUMERICS.md is the contract of the quantized rows.
 *
 * A quantized format is (element codec) x (block layout) x (scale kind): nvfp4 = e2m1 elements in
 * 1x16 blocks with ue4m3 scales and an fp32 amax; mxfp8 = e4m3/e5m2 elements in 1x32 blocks with
 * e8m0 scales; fp8 = e4m3/e5m2 elements with one fp32 scale per tensor. The backends' quantizers
 * are written per (scale kind), generic over the element codec and block length read from here, so
 * a new combination is an enum value, a row, and one line in each backend table.
 *
 * Enum values are stable: they appear in files. */
#ifndef NVL_DTYPE_H
#define NVL_DTYPE_H
#include <string.h>

#include "nvl.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  NVL_F32 = 0,
  NVL_BF16 = 1,
  NVL_I32 = 2,
  NVL_I64 = 3,
  NVL_U8 = 4,
  /* quantized formats (core/NUMERICS.md): live only inside nvl_qtensor (quant.h), never as plain
   * tensor elements */
  NVL_E4M3 = 5,       /* fp8 e4m3, one fp32 scale per tensor */
  NVL_E5M2 = 6,       /* fp8 e5m2, one fp32 scale per tensor */
  NVL_MXFP8_E4M3 = 7, /* e4m3 elements, 1x32 blocks, e8m0 scales */
  NVL_MXFP8_E5M2 = 8, /* e5m2 elements, 1x32 blocks, e8m0 scales */
  NVL_NVFP4 = 9,      /* e2m1 elements, 1x16 (or 16x16) blocks, ue4m3 scales, fp32 amax */
  NVL_MXFP4 = 10,     /* e2m1 elements, 1x32 blocks, e8m0 scales (OCP Microscaling v1.0) */
  NVL_DTYPE_COUNT
} nvl_dtype;

/* Element codecs of the quantized formats (NUMERICS §1). */
typedef enum {
  NVL_ELEM_E4M3 = 0, /* fp8 "fn": s1 e4 m3, bias 7, max 448, no inf */
  NVL_ELEM_E5M2 = 1, /* fp8: s1 e5 m2, bias 15, max 57344, inf */
  NVL_ELEM_E2M1 = 2, /* fp4: s1 e2 m1, bias 1, max 6; two per byte, the lower index in the low nibble */
  NVL_ELEM_COUNT
} nvl_elem;

typedef enum {
  NVL_SCALE_NONE = 0,   /* plain element type */
  NVL_SCALE_TENSOR = 1, /* one fp32 scale per tensor (fp8 current/delayed scaling) */
  NVL_SCALE_UE4M3 = 2,  /* ue4m3 block scale + fp32 tensor amax (nvfp4) */
  NVL_SCALE_E8M0 = 3,   /* power-of-two block scale (OCP microscaling) */
  NVL_SCALE_KIND_COUNT
} nvl_scale_kind;

/* Rules for an e8m0 block scale (NUMERICS §4). */
typedef enum { NVL_MX_RCEIL = 0, NVL_MX_FLOOR = 1, NVL_MX_RULE_COUNT } nvl_mx_rule;

/* Where the scales of a quantized tensor sit. */
typedef enum {
  NVL_LAYOUT_NONE = 0,   /* f32 / bf16: no scales */
  NVL_LAYOUT_TENSOR = 1, /* one fp32 scale */
  NVL_LAYOUT_1X16 = 2,   /* 16 consecutive elements along the blocked dim */
  NVL_LAYOUT_16X16 = 3,  /* 16x16 tiles (2-D weights), stored per 1x16 block, equal down a tile */
  NVL_LAYOUT_1X32 = 4,   /* 32 consecutive elements along the blocked dim */
  NVL_LAYOUT_COUNT
} nvl_block_layout;

extern const char *const nvl_layout_names[NVL_LAYOUT_COUNT];
extern const char *const nvl_elem_names[NVL_ELEM_COUNT];
extern const char *const nvl_scale_kind_names[NVL_SCALE_KIND_COUNT];
extern const char *const nvl_mx_rule_names[NVL_MX_RULE_COUNT];

typedef struct {
  const char *name;     /* "f32", as Lua spells it */
  int bits;             /* bits per stored element (without scales) */
  int elem_size;        /* bytes per stored element (quantized: per stored byte of codes) */
  int is_float;         /* 1: loads/stores go through double; 0: through int64 */
  int promote_rank;     /* binary ops give the operand dtype of higher rank */
  int significand_bits; /* floats: bits of precision including the implicit one (f32 24) */
  double max_finite;    /* largest finite value (integers: largest value; nvfp4: 6, its element max) */
  double min_value;     /* most negative value (floats: -max_finite) */
  /* Reference scalar access of plain dtypes. Floats round to nearest even on store; integers
   * truncate toward zero and saturate on store from double; NaN stores as 0. */
  double (*load_f)(const void *p);
  void (*store_f)(void *p, double v);
  int64_t (*load_i)(const void *p);
  void (*store_i)(void *p, int64_t v);
  /* ---- quantized formats (is_quantized = 1) ---- */
  int is_quantized;     /* 1: a format of nv.quantize, with element codes (no load/store) */
  int elem;             /* nvl_elem; -1 for plain dtypes */
  nvl_scale_kind scale; /* how blocks are scaled */
  int block;            /* elements per scale block along the blocked dim (0: none) */
  nvl_block_layout layout; /* the default layout (nvfp4 also has 16x16, see block2d) */
  int block2d;          /* 1: the 16x16 2-D layout is offered (weights) */
  int scale_bits;       /* bits per block scale (8), or 32 for the per-tensor fp32 scale */
  double bits_per_elem; /* storage per element, scales included: bits + scale_bits / block */
  const char *scale_rule; /* how the scale is rounded: "rne" (ue4m3), "rceil"/"floor" (e8m0),
                             "fp32" (per tensor) */
  int sr;               /* 1: stochastic rounding of the elements is defined (NUMERICS §3) */
  int global_amax;      /* 1: an fp32 amax scales the tensor (the amax option applies) */
  /* The per-tensor factors from the amax (NULL: none, the factor is 1):
   * enc_scale: what x is multiplied by before the block scales (fp8: elem_max / amax; nvfp4:
   * s_enc = 2688 / amax), as q.scale; dec_scale: the factor a GEMM applies to the products of
   * decoded values and block scales (fp8: 1 / scale; nvfp4: amax / 2688), NUMERICS §7. */
  float (*enc_scale)(float amax);
  float (*dec_scale)(float amax, float enc_scale);
} nvl_dtype_traits;

extern const nvl_dtype_traits nvl_dtypes[NVL_DTYPE_COUNT];

/* Look up a dtype by name; returns NVL_DTYPE_COUNT if unknown. */
nvl_dtype nvl_dtype_from_name(const char *name);
/* Comma-separated names of the plain dtypes (tensor elements), for error messages. */
const char *nvl_dtype_names(void);
/* Comma-separated names of the formats nv.quantize takes (f32, bf16 and the quantized ones). */
const char *nvl_qformat_names(void);
/* Result dtype of a binary op between a and b (u8 < i32 < i64 < bf16 < f32). */
nvl_dtype nvl_dtype_promote(nvl_dtype a, nvl_dtype b);
/* Bytes of n codes of a quantized format (4-bit elements: two per byte; n even). */
static inline int64_t nvl_code_bytes(nvl_dtype f, int64_t n) { return n * nvl_dtypes[f].bits / 8; }

/* The reference codecs of elements and scales by name ("e4m3", "e5m2", "e2m1", "ue4m3", "e8m0"):
 * encode NULL where the rounding depends on more than the value (e8m0: the scale rule). */
typedef struct {
  const char *name;
  uint8_t (*encode)(float x);
  float (*decode)(uint8_t code);
} nvl_codec;
/* The codec called name, or NULL; names: a comma-separated list of them, for messages. */
const nvl_codec *nvl_codec_from_name(const char *name);
const char *nvl_codec_names(void);

/* The default sign vector s of the random Hadamard transform R = diag(s) H / 4 (NUMERICS §5). */
extern const float nvl_rht16_default_signs[16];

/* bf16 <-> f32, round to nearest even; NaN stays a (quiet) NaN with its sign. */
static inline uint16_t nvl_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN, sign kept */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even; overflows to inf correctly */
  return (uint16_t)(u >> 16);
}
static inline float nvl_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* IEEE half (f16: s1 e5 m10, bias 15) -> f32, exact for every value: normals, subnormals, +-0,
 * +-inf, NaN (payload kept). nvlua has no f16 dtype: f16 data (a safetensors F16 tensor) is read
 * into f32. */
float nvl_f16_to_f32(uint16_t h);
/* dst[i] = f16 element i of src (n elements, 2 bytes each, little-endian), for i < n. */
void nvl_f16_to_f32_n(float *dst, const uint8_t *src, int64_t n);

/* How nvl_decode_scaled_n applies a block scale s and a global scale g to an element's value v. */
typedef struct {
  float global;  /* g (1: none) */
  int divide;    /* the block scale is divided by g, not multiplied */
  int exact;     /* 0: v * fl(s op g), the deployment libraries' order (ModelOpt, compressed-tensors);
                    1: fl((v * s) op g), v * s exact (e2m1 x e4m3 or e8m0): the engines' GEMM order,
                    the global applied after the block products, and nvlua's (NUMERICS §2) */
  int plus_zero; /* a code decoding to -0 gives +0 (ModelOpt's e2m1 table has +0 for it) */
} nvl_decode_opts;
/* The dense values of a block-scaled weight as a deployment checkpoint's decoder computes them
 * (lua/nvlua/deploy_read.lua): for element i = r*K + k of a [rows, K] tensor, dst[i] = v with
 * v = c->decode(code i) (packed: two 4-bit codes per byte, the even element in the low nibble),
 * scaled by s = scales[r', k / (K/nb)] (r' = r when srows = rows, 0 when srows = 1) and o->global
 * in the order of o (above), in fp32; scales NULL: dst = v. The caller checks the shapes (K a
 * multiple of nb, of 2 when packed). */
void nvl_decode_scaled_n(float *dst, const uint8_t *codes, const nvl_codec *c, int packed, const float *scales,
                         int64_t rows, int64_t K, int64_t srows, int64_t nb, const nvl_decode_opts *o);

#ifdef __cplusplus
}
#endif
#endif
