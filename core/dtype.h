/* dtype.h: the number formats nvlua knows, one traits row per dtype (DESIGN.md "Formats").
 * Generic code reads this table (element size, float or integer, scalar load/store); it never
 * switches on a dtype by hand. Quantized formats (fp8, nvfp4, mxfp8) join the table with their
 * block layout and scale kind; NUMERICS.md is their contract.
 * Enum values are stable: they appear in files. */
#ifndef NVL_DTYPE_H
#define NVL_DTYPE_H
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
  /* quantized formats (NUMERICS.md): live only inside nvl_qtensor (quant.h), never as plain
   * tensor elements */
  NVL_E4M3 = 5,       /* fp8 e4m3, one fp32 scale per tensor */
  NVL_E5M2 = 6,       /* fp8 e5m2, one fp32 scale per tensor */
  NVL_MXFP8_E4M3 = 7, /* e4m3 elements, 1x32 blocks, e8m0 scales */
  NVL_MXFP8_E5M2 = 8, /* e5m2 elements, 1x32 blocks, e8m0 scales */
  NVL_NVFP4 = 9,      /* e2m1 elements, 1x16 (or 16x16) blocks, ue4m3 scales, fp32 amax */
  NVL_DTYPE_COUNT
} nvl_dtype;

typedef enum {
  NVL_SCALE_NONE = 0,      /* plain element type */
  NVL_SCALE_TENSOR = 1,    /* one fp32 scale per tensor (fp8 current/delayed scaling) */
  NVL_SCALE_UE4M3 = 2,     /* e4m3 block scale + fp32 tensor amax (nvfp4) */
  NVL_SCALE_E8M0 = 3,      /* power-of-two block scale (mx formats) */
  NVL_SCALE_KIND_COUNT
} nvl_scale_kind;

typedef struct {
  const char *name;     /* "f32", as Lua spells it */
  int bits;             /* bits per element */
  int elem_size;        /* bytes per stored element */
  int is_float;         /* 1: loads/stores go through double; 0: through int64 */
  int promote_rank;     /* binary ops give the operand dtype of higher rank */
  int significand_bits; /* floats: bits of precision including the implicit one (f32 24) */
  int is_quantized;     /* 1: a format of nv.quantize, with element codes (no load/store) */
  int block;            /* elements per scale block (0: none) */
  nvl_scale_kind scale; /* how blocks are scaled */
  double max_finite;    /* largest finite value (integers: largest value) */
  double min_value;     /* most negative value (floats: -max_finite) */
  /* Reference scalar access. Floats round to nearest even on store; integers truncate
   * toward zero and saturate on store from double; NaN stores as 0. */
  double (*load_f)(const void *p);
  void (*store_f)(void *p, double v);
  int64_t (*load_i)(const void *p);
  void (*store_i)(void *p, int64_t v);
  /* Quantized formats: the reference element codec (fp32 <-> code, RNE, NUMERICS §1). */
  uint8_t (*encode)(float x);
  float (*decode)(uint8_t code);
  int scale_bits;       /* bits per block scale (8), or 32 for the per-tensor fp32 scale */
  int fp8_elem;         /* fp8 element formats: nvl_fp8_elem (formats_ref.h); else -1 */
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

/* bf16 <-> f32, round to nearest even; NaN stays a (quiet) NaN with its sign. */
uint16_t nvl_f32_to_bf16(float f);
float nvl_bf16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif
