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
} nvl_dtype_traits;

extern const nvl_dtype_traits nvl_dtypes[NVL_DTYPE_COUNT];

/* Look up a dtype by name; returns NVL_DTYPE_COUNT if unknown. */
nvl_dtype nvl_dtype_from_name(const char *name);
/* Comma-separated list of valid names, for error messages. */
const char *nvl_dtype_names(void);
/* Result dtype of a binary op between a and b (u8 < i32 < i64 < bf16 < f32). */
nvl_dtype nvl_dtype_promote(nvl_dtype a, nvl_dtype b);

/* bf16 <-> f32, round to nearest even; NaN stays a (quiet) NaN with its sign. */
uint16_t nvl_f32_to_bf16(float f);
float nvl_bf16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif
