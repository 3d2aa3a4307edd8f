/* nvl.h: status codes, the error message channel, limits, and the overflow-checked size arithmetic
 * shared by all of core/ and kernels/ (host code; nvcc reads it too, device code calls none of it).
 * Not here: anything that knows about Lua. Errors travel up as an nvl_status plus a message
 * (thread-local); the Lua binding turns them into Lua errors. Nothing in core calls exit/abort. */
#ifndef NVL_H
#define NVL_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  NVL_OK = 0,
  NVL_EINVAL = 1,       /* bad argument: shape, dtype, dim, index, value */
  NVL_ENOMEM = 2,       /* allocation failed */
  NVL_EUNSUPPORTED = 3, /* valid request this backend/format cannot do */
  NVL_EDEVICE = 4,      /* a CUDA / cuBLASLt call failed */
  NVL_EIO = 5,          /* file I/O */
  NVL_ESTATE = 6,       /* use of a freed tensor and similar */
  NVL_STATUS_COUNT
} nvl_status;

#define NVL_MAX_DIMS 8

/* ---- checked arithmetic: every product or sum of sizes, strides, offsets and byte counts that
 * comes from a caller goes through these, so nothing in core/ or kernels/ overflows a signed
 * integer; the shape rules built on them are tensor.h's nvl_shape_numel / nvl_tensor_check_bounds */

/* The most elements a tensor (a view too) may have: numel times any element size (at most 16
 * bytes) still fits in int64, and so does every stride and offset of a view inside it. */
#define NVL_MAX_NUMEL (INT64_MAX / 16)

/* *r = a * b; returns 1 (and *r is meaningless) if the product does not fit in int64. */
static inline int nvl_mul_overflow(int64_t a, int64_t b, int64_t *r) { return __builtin_mul_overflow(a, b, r); }
/* *r = a + b; returns 1 if the sum does not fit in int64. */
static inline int nvl_add_overflow(int64_t a, int64_t b, int64_t *r) { return __builtin_add_overflow(a, b, r); }

/* 1 if v is an integer that int64 holds exactly (NaN, infinities, fractions and |v| >= 2^63: 0). */
static inline int nvl_f64_is_i64(double v) { return v >= -0x1p63 && v < 0x1p63 && v == (double)(int64_t)v; }

/* v converted to [lo, hi] (lo <= hi): truncated toward zero, saturated at the ends, NaN -> 0. The
 * one float -> integer conversion of core and the CPU kernels (core/NUMERICS.md §8). */
static inline int64_t nvl_f64_to_i64_sat(double v, int64_t lo, int64_t hi) {
  if (v != v) return 0;
  if (v < -0x1p63) return lo;
  if (v >= 0x1p63) return hi;
  int64_t i = (int64_t)v; /* in range: defined, truncates toward zero */
  return i < lo ? lo : i > hi ? hi : i;
}

/* Compare an integer with a double as mathematical values, exactly (no rounding of x to double):
 * -1 if x < y, 0 if equal, 1 if x > y, 2 if y is NaN (unordered). */
static inline int nvl_cmp_i64_f64(int64_t x, double y) {
  if (y != y) return 2;
  if (y >= 0x1p63) return -1;
  if (y < -0x1p63) return 1;
  int64_t t = (int64_t)y; /* y truncated toward zero: exact in range */
  if (x != t) return x < t ? -1 : 1;
  double frac = y - (double)t; /* exact: |y| < 2^63 and t is y without its fraction */
  return frac > 0 ? -1 : frac < 0 ? 1 : 0;
}

/* Record a message (printf-style) for the calling thread and return st. */
nvl_status nvl_error(nvl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The last message recorded on this thread ("" if none). */
const char *nvl_last_error(void);
/* The status recorded with it (NVL_OK if none). */
nvl_status nvl_last_status(void);

/* Propagate a non-OK status. */
#define NVL_TRY(expr)                  \
  do {                                 \
    nvl_status nvl_st_ = (expr);       \
    if (nvl_st_ != NVL_OK) return nvl_st_; \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
