/* test_bounds.c: C unit tests of the checked size arithmetic (core/nvl.h) and the shape rules built
 * on it (core/tensor.c nvl_shape_numel, nvl_tensor_check_bounds, and the views that use them), at
 * their edges: INT64_MAX and INT64_MIN, products that wrap, NVL_MAX_NUMEL and one past it, zero-size
 * dims; and the float -> integer conversions and exact integer/float comparison (NUMERICS §8).
 * Expected values are literals worked out by hand. */
#include <math.h>
#include <string.h>
#include "ops.h"
#include "unit.h"

NVL_TEST(checked_mul_add_at_int64_edges) {
  int64_t r;
  CHECK(!nvl_mul_overflow(INT64_MAX, 1, &r) && r == INT64_MAX);
  CHECK(!nvl_mul_overflow(INT64_MAX, 0, &r) && r == 0);
  CHECK(!nvl_mul_overflow(INT64_MIN, 1, &r) && r == INT64_MIN);
  CHECK(nvl_mul_overflow(INT64_MAX, 2, &r));
  CHECK(nvl_mul_overflow(INT64_MIN, -1, &r));
  CHECK(nvl_mul_overflow(274177, 67280421310721, &r)); /* 2^64 + 1: wraps to 1 */
  CHECK(nvl_mul_overflow((int64_t)1 << 32, (int64_t)1 << 31, &r)); /* 2^63: one past INT64_MAX */
  CHECK(!nvl_mul_overflow((int64_t)1 << 31, (int64_t)1 << 31, &r) && r == (int64_t)1 << 62);
  CHECK(nvl_mul_overflow((int64_t)1 << 32, (int64_t)1 << 32, &r));
  CHECK(!nvl_add_overflow(INT64_MAX - 1, 1, &r) && r == INT64_MAX);
  CHECK(nvl_add_overflow(INT64_MAX, 1, &r));
  CHECK(nvl_add_overflow(INT64_MIN, -1, &r));
  CHECK(!nvl_add_overflow(INT64_MIN, INT64_MAX, &r) && r == -1);
}

NVL_TEST(shape_numel_limits_and_zero_dims) {
  int64_t n = -1;
  CHECK(nvl_shape_numel("t", 0, NULL, &n) == NVL_OK && n == 1);
  int64_t s1[3] = {2, 0, 5};
  CHECK(nvl_shape_numel("t", 3, s1, &n) == NVL_OK && n == 0);
  int64_t s2[1] = {NVL_MAX_NUMEL};
  CHECK(nvl_shape_numel("t", 1, s2, &n) == NVL_OK && n == NVL_MAX_NUMEL);
  s2[0] = NVL_MAX_NUMEL + 1;
  CHECK(nvl_shape_numel("t", 1, s2, &n) == NVL_EINVAL && strstr(nvl_last_error(), "too large"));
  int64_t s3[2] = {274177, 67280421310721}; /* wraps to 1 */
  CHECK(nvl_shape_numel("view", 2, s3, &n) == NVL_EINVAL &&
        strstr(nvl_last_error(), "view: shape [274177,67280421310721] is too large"));
  int64_t s4[5] = {0, 1 << 20, 1 << 20, 1 << 20, 1 << 20}; /* numel 0, but the strides would reach 2^80 */
  CHECK(nvl_shape_numel("empty", 5, s4, &n) == NVL_EINVAL);
  int64_t s5[3] = {0, 1 << 20, 1 << 20};
  CHECK(nvl_shape_numel("empty", 3, s5, &n) == NVL_OK && n == 0);
  int64_t s6[2] = {3, -1};
  CHECK(nvl_shape_numel("t", 2, s6, &n) == NVL_EINVAL && strstr(nvl_last_error(), "negative size -1 in dim 2"));
  int64_t s7[2] = {INT64_MAX, 0}; /* a zero does not excuse the other sizes */
  CHECK(nvl_shape_numel("t", 2, s7, &n) == NVL_EINVAL);
  CHECK(nvl_shape_numel("t", NVL_MAX_DIMS + 1, s1, &n) == NVL_EINVAL);
  CHECK(nvl_shape_numel("t", -1, s1, &n) == NVL_EINVAL);
}

/* A [4] f32 tensor and a view of it with the given fields. */
static nvl_tensor view_of(const nvl_tensor *base, int ndim, const int64_t *shape, const int64_t *strides, int64_t off) {
  nvl_tensor v = *base; /* no reference taken: only inspected */
  v.ndim = ndim;
  for (int d = 0; d < ndim; d++) { v.shape[d] = shape[d]; v.strides[d] = strides[d]; }
  v.offset = off;
  return v;
}

NVL_TEST(check_bounds_of_crafted_views) {
  nvl_tensor t = nvl_tensor_null();
  int64_t four[1] = {4};
  CHECK(nvl_tensor_empty(&t, NVL_F32, NVL_CPU, 1, four) == NVL_OK);
  CHECK(nvl_tensor_check_bounds(&t, "t") == NVL_OK);
  int64_t sh[2] = {2, 2}, st[2] = {2, 1};
  nvl_tensor v = view_of(&t, 2, sh, st, 0);
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_OK); /* elements 0..3: exactly the storage */
  v = view_of(&t, 2, sh, st, 1);
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_EINVAL &&
        strstr(nvl_last_error(), "does not fit its storage of 16 bytes"));
  int64_t st2[2] = {-2, 1}; /* negative stride: elements 2, 3, 0, 1 from offset 2 */
  v = view_of(&t, 2, sh, st2, 2);
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_OK);
  v = view_of(&t, 2, sh, st2, 1);
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_EINVAL); /* reaches element -1 */
  int64_t big[1] = {INT64_MAX}, sbig[1] = {2}, one[1] = {1};
  v = view_of(&t, 1, sbig, big, 0); /* (2 - 1) * INT64_MAX: in range, far past the storage */
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_EINVAL);
  int64_t three[1] = {3};
  v = view_of(&t, 1, three, big, 0); /* (3 - 1) * INT64_MAX overflows */
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_EINVAL);
  v = view_of(&t, 1, one, one, INT64_MAX); /* an offset whose byte count overflows */
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_EINVAL);
  int64_t zero[1] = {0};
  v = view_of(&t, 1, zero, one, 4); /* empty at the end: touches nothing */
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_OK);
  v = view_of(&t, 1, zero, one, -1);
  CHECK(nvl_tensor_check_bounds(&v, "t") == NVL_EINVAL);
  nvl_tensor_release(&t);
}

NVL_TEST(views_reject_wrapping_arguments) {
  nvl_tensor t = nvl_tensor_null(), v = nvl_tensor_null();
  int64_t four[1] = {4};
  CHECK(nvl_tensor_empty(&t, NVL_F32, NVL_CPU, 1, four) == NVL_OK);
  CHECK(nvl_tensor_narrow(&v, &t, 0, INT64_MAX - 1, 2) == NVL_EINVAL); /* start + len wrapped negative */
  CHECK(nvl_tensor_narrow(&v, &t, 0, 2, INT64_MAX) == NVL_EINVAL);
  CHECK(nvl_tensor_narrow(&v, &t, 0, INT64_MAX, 0) == NVL_EINVAL &&
        strstr(nvl_last_error(), "start 9223372036854775807, length 0")); /* no + 1 overflow in the message */
  CHECK(nvl_tensor_narrow(&v, &t, 0, 4, 0) == NVL_OK && v.shape[0] == 0 && v.offset == 4);
  nvl_tensor_release(&v);
  CHECK(nvl_tensor_select(&v, &t, 0, INT64_MAX) == NVL_EINVAL);
  CHECK(nvl_tensor_select(&v, &t, 0, INT64_MIN) == NVL_EINVAL);
  int64_t wrap[2] = {274177, 67280421310721}, neg[1] = {-5}, huge[2] = {(int64_t)1 << 32, (int64_t)1 << 32};
  CHECK(nvl_tensor_view(&v, &t, 2, wrap) == NVL_EINVAL);
  nvl_tensor one = nvl_tensor_null();
  int64_t s1[1] = {1};
  CHECK(nvl_tensor_empty(&one, NVL_F32, NVL_CPU, 1, s1) == NVL_OK);
  CHECK(nvl_tensor_expand(&v, &one, 1, neg) == NVL_EINVAL && strstr(nvl_last_error(), "invalid size -5"));
  CHECK(nvl_tensor_expand(&v, &one, 2, huge) == NVL_EINVAL && strstr(nvl_last_error(), "too large"));
  CHECK(one.storage->refcount == 1); /* the failed views took no reference */
  int64_t ok2[2] = {(int64_t)1 << 20, (int64_t)1 << 20};
  CHECK(nvl_tensor_expand(&v, &one, 2, ok2) == NVL_OK && nvl_tensor_numel(&v) == (int64_t)1 << 40 &&
        v.strides[0] == 0 && v.strides[1] == 0);
  nvl_tensor_release(&v);
  nvl_tensor_release(&one);
  CHECK(t.storage->refcount == 1);
  nvl_tensor_release(&t);
  int64_t alloc[1] = {(int64_t)1 << 56}; /* 2^58 bytes of f32: refused, not a crash */
  CHECK(nvl_tensor_empty(&t, NVL_F32, NVL_CPU, 1, alloc) == NVL_ENOMEM &&
        strstr(nvl_last_error(), "cannot allocate 288230376151711744 bytes"));
  CHECK(t.storage == NULL);
}

NVL_TEST(float_to_int_saturates_and_compares_exactly) {
  CHECK(nvl_f64_is_i64(0.0) && nvl_f64_is_i64(-0x1p63) && nvl_f64_is_i64(0x1p62));
  CHECK(!nvl_f64_is_i64(0x1p63) && !nvl_f64_is_i64(1e300) && !nvl_f64_is_i64(NAN) && !nvl_f64_is_i64(INFINITY) &&
        !nvl_f64_is_i64(2.5));
  CHECK(nvl_f64_to_i64_sat(1e300, INT64_MIN, INT64_MAX) == INT64_MAX);
  CHECK(nvl_f64_to_i64_sat(0x1p63, INT64_MIN, INT64_MAX) == INT64_MAX);
  CHECK(nvl_f64_to_i64_sat(-0x1p63, INT64_MIN, INT64_MAX) == INT64_MIN);
  CHECK(nvl_f64_to_i64_sat(-INFINITY, INT64_MIN, INT64_MAX) == INT64_MIN);
  CHECK(nvl_f64_to_i64_sat(NAN, INT64_MIN, INT64_MAX) == 0);
  CHECK(nvl_f64_to_i64_sat(-2.9, INT64_MIN, INT64_MAX) == -2);
  CHECK(nvl_f64_to_i64_sat(0x1p62, 0, 255) == 255 && nvl_f64_to_i64_sat(-0.5, 0, 255) == 0);
  CHECK(nvl_f64_to_i64_sat(3e9, INT32_MIN, INT32_MAX) == INT32_MAX);
  CHECK(nvl_cmp_i64_f64(INT64_MAX, 0x1p63) == -1); /* (double)INT64_MAX == 2^63, yet it is less */
  CHECK(nvl_cmp_i64_f64(INT64_MIN, -0x1p63) == 0);
  CHECK(nvl_cmp_i64_f64(INT64_MIN, 1e300) == -1 && nvl_cmp_i64_f64(INT64_MAX, -1e300) == 1);
  CHECK(nvl_cmp_i64_f64(((int64_t)1 << 53) + 1, 0x1p53) == 1);
  CHECK(nvl_cmp_i64_f64(2, 2.5) == -1 && nvl_cmp_i64_f64(-3, -3.5) == 1 && nvl_cmp_i64_f64(-3, -2.5) == -1);
  CHECK(nvl_cmp_i64_f64(0, NAN) == 2 && nvl_cmp_i64_f64(0, -0.0) == 0);
  int64_t i64;
  nvl_dtypes[NVL_I64].store_f(&i64, 1e300);
  CHECK(i64 == INT64_MAX);
  float f = 0x1p63f;
  CHECK(nvl_dtypes[NVL_F32].load_i(&f) == INT64_MAX);
}
