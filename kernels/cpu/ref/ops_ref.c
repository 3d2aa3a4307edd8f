/* ops_ref.c: scalar reference kernels (see ops_ref.h). */
#include <math.h>
#include <string.h>
#include "cpu/ref/iter.h"
#include "cpu/ref/ops_ref.h"

double nvl_binary_f(nvl_binary_op op, double a, double b) {
  switch (op) {
    case NVL_OP_ADD: return a + b;
    case NVL_OP_SUB: return a - b;
    case NVL_OP_MUL: return a * b;
    case NVL_OP_DIV: return a / b;
    case NVL_OP_POW: return pow(a, b);
    case NVL_OP_MAXIMUM: return isnan(a) || isnan(b) ? NAN : (a > b ? a : b);
    case NVL_OP_MINIMUM: return isnan(a) || isnan(b) ? NAN : (a < b ? a : b);
    case NVL_OP_EQ: return a == b;
    case NVL_OP_NE: return a != b;
    case NVL_OP_LT: return a < b;
    case NVL_OP_LE: return a <= b;
    case NVL_OP_GT: return a > b;
    case NVL_OP_GE: return a >= b;
    default: return NAN;
  }
}

int64_t nvl_binary_i(nvl_binary_op op, int64_t a, int64_t b) {
  switch (op) { /* two's-complement wrap-around, computed unsigned to stay defined */
    case NVL_OP_ADD: return (int64_t)((uint64_t)a + (uint64_t)b);
    case NVL_OP_SUB: return (int64_t)((uint64_t)a - (uint64_t)b);
    case NVL_OP_MUL: return (int64_t)((uint64_t)a * (uint64_t)b);
    case NVL_OP_MAXIMUM: return a > b ? a : b;
    case NVL_OP_MINIMUM: return a < b ? a : b;
    case NVL_OP_EQ: return a == b;
    case NVL_OP_NE: return a != b;
    case NVL_OP_LT: return a < b;
    case NVL_OP_LE: return a <= b;
    case NVL_OP_GT: return a > b;
    case NVL_OP_GE: return a >= b;
    default: return 0; /* DIV and POW promote to f32 in core/ops.c */
  }
}

/* A comparison op (EQ..GE) from nvl_cmp_i64_f64's result c (2: unordered, only NE holds). */
static int cmp_holds(nvl_binary_op op, int c) {
  switch (op) {
    case NVL_OP_EQ: return c == 0;
    case NVL_OP_NE: return c != 0;
    case NVL_OP_LT: return c == -1;
    case NVL_OP_LE: return c == -1 || c == 0;
    case NVL_OP_GT: return c == 1;
    case NVL_OP_GE: return c == 1 || c == 0;
    default: return 0;
  }
}

/* x op y for an integer x and a float y, compared as mathematical values (no rounding of x). */
static int cmp_int_float(nvl_binary_op op, int64_t x, double y) { return cmp_holds(op, nvl_cmp_i64_f64(x, y)); }
/* y op x: the same with the operands swapped (x < y is y > x). */
static int cmp_float_int(nvl_binary_op op, double y, int64_t x) {
  int c = nvl_cmp_i64_f64(x, y);
  return cmp_holds(op, c == 2 ? 2 : -c);
}

double nvl_unary_f(nvl_unary_op op, double a) {
  switch (op) {
    case NVL_OP_EXP: return exp(a);
    case NVL_OP_LOG: return log(a);
    case NVL_OP_SQRT: return sqrt(a);
    case NVL_OP_ABS: return fabs(a);
    case NVL_OP_NEG: return -a;
    default: return NAN;
  }
}

nvl_status nvl_copy_ref(nvl_kctx *ctx, nvl_tensor *dst, const nvl_tensor *src) {
  const nvl_tensor *ts[2] = {dst, src};
  const nvl_dtype_traits *td = &nvl_dtypes[dst->dtype], *ts_ = &nvl_dtypes[src->dtype];
  int64_t n = nvl_tensor_numel(dst);
  nvl_iter it;
  nvl_iter_init(&it, 2, ts);
  int same = dst->dtype == src->dtype;
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) {
    void *pd = nvl_iter_ptr(&it, 0), *ps = nvl_iter_ptr(&it, 1);
    if (same) {
      for (int b = 0; b < td->elem_size; b++) ((char *)pd)[b] = ((char *)ps)[b];
    } else if (td->is_float || ts_->is_float) {
      td->store_f(pd, ts_->load_f(ps));
    } else {
      td->store_i(pd, ts_->load_i(ps));
    }
  }
  return NVL_OK;
}

nvl_status nvl_binary_ref(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  const nvl_tensor *ts[3] = {out, a, b};
  const nvl_dtype_traits *to = &nvl_dtypes[out->dtype], *ta = &nvl_dtypes[a->dtype], *tb = &nvl_dtypes[b->dtype];
  int64_t n = nvl_tensor_numel(out);
  nvl_iter it;
  nvl_iter_init(&it, 3, ts);
  int in_float = to->is_float || (op >= NVL_OP_EQ && (ta->is_float || tb->is_float));
  int mixed = op >= NVL_OP_EQ && ta->is_float != tb->is_float; /* an integer against a float: exact */
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) {
    void *pa = nvl_iter_ptr(&it, 1), *pb = nvl_iter_ptr(&it, 2);
    if (mixed)
      to->store_i(nvl_iter_ptr(&it, 0), ta->is_float ? cmp_float_int(op, ta->load_f(pa), tb->load_i(pb))
                                                     : cmp_int_float(op, ta->load_i(pa), tb->load_f(pb)));
    else if (in_float)
      to->store_f(nvl_iter_ptr(&it, 0), nvl_binary_f(op, ta->load_f(nvl_iter_ptr(&it, 1)), tb->load_f(nvl_iter_ptr(&it, 2))));
    else
      to->store_i(nvl_iter_ptr(&it, 0), nvl_binary_i(op, ta->load_i(nvl_iter_ptr(&it, 1)), tb->load_i(nvl_iter_ptr(&it, 2))));
  }
  return NVL_OK;
}

nvl_status nvl_unary_ref(nvl_kctx *ctx, nvl_unary_op op, nvl_tensor *out, const nvl_tensor *a) {
  const nvl_tensor *ts[2] = {out, a};
  const nvl_dtype_traits *to = &nvl_dtypes[out->dtype], *ta = &nvl_dtypes[a->dtype];
  int64_t n = nvl_tensor_numel(out);
  nvl_iter it;
  nvl_iter_init(&it, 2, ts);
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) {
    void *po = nvl_iter_ptr(&it, 0), *pa = nvl_iter_ptr(&it, 1);
    if (to->is_float) {
      to->store_f(po, nvl_unary_f(op, ta->load_f(pa)));
    } else { /* integer ABS / NEG */
      int64_t v = ta->load_i(pa);
      to->store_i(po, op == NVL_OP_NEG ? (int64_t)(0 - (uint64_t)v) : (v < 0 ? (int64_t)(0 - (uint64_t)v) : v));
    }
  }
  return NVL_OK;
}

/* Fold one value into an accumulator. Returns 1 if v becomes the new extreme (for argmax). */
static int fold_f(nvl_reduce_op op, double *acc, double v, int first) {
  if (op == NVL_RED_SUM || op == NVL_RED_MEAN) { *acc += v; return 0; }
  if (op == NVL_RED_AMAX) v = fabs(v);
  if (first) { *acc = v; return 1; }
  if (isnan(*acc)) return 0;
  if (isnan(v) || (op == NVL_RED_MIN ? v < *acc : v > *acc)) { *acc = v; return 1; }
  return 0;
}

static int fold_i(nvl_reduce_op op, int64_t *acc, int64_t v, int first) {
  if (op == NVL_RED_SUM || op == NVL_RED_MEAN) { *acc = (int64_t)((uint64_t)*acc + (uint64_t)v); return 0; }
  if (op == NVL_RED_AMAX) v = v < 0 ? (int64_t)(0 - (uint64_t)v) : v;
  if (first || (op == NVL_RED_MIN ? v < *acc : v > *acc)) { *acc = v; return 1; }
  return 0;
}

nvl_status nvl_reduce_last_ref(nvl_kctx *ctx, nvl_reduce_op op, nvl_tensor *out, nvl_tensor *idx, const nvl_tensor *a) {
  const nvl_dtype_traits *to = &nvl_dtypes[out->dtype], *ta = &nvl_dtypes[a->dtype];
  int64_t len = a->shape[a->ndim - 1], stride = a->strides[a->ndim - 1];
  int64_t n = nvl_tensor_numel(out);
  /* Iterate the output with a's leading strides: a view of a with its last dim dropped. */
  nvl_tensor lead = *a;
  lead.ndim = a->ndim - 1;
  nvl_tensor o = *out;
  o.ndim = lead.ndim;
  for (int d = 0; d < lead.ndim; d++) o.shape[d] = lead.shape[d], o.strides[d] = out->strides[d];
  nvl_tensor ix;
  if (idx) { ix = *idx; ix.ndim = lead.ndim; for (int d = 0; d < lead.ndim; d++) ix.shape[d] = lead.shape[d], ix.strides[d] = idx->strides[d]; }
  const nvl_tensor *ts[3] = {&o, &lead, idx ? &ix : &o};
  nvl_iter it;
  nvl_iter_init(&it, 3, ts);
  int esize = ta->elem_size;
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) {
    const char *p = nvl_iter_ptr(&it, 1);
    int64_t best = 0;
    if (ta->is_float || to->is_float) {
      double acc = 0;
      for (int64_t k = 0; k < len; k++)
        if (fold_f(op, &acc, ta->load_f(p + k * stride * esize), k == 0)) best = k;
      if (op == NVL_RED_MEAN) acc /= (double)len;
      to->store_f(nvl_iter_ptr(&it, 0), acc);
    } else {
      int64_t acc = 0;
      for (int64_t k = 0; k < len; k++)
        if (fold_i(op, &acc, ta->load_i(p + k * stride * esize), k == 0)) best = k;
      to->store_i(nvl_iter_ptr(&it, 0), acc);
    }
    if (idx) *(int64_t *)nvl_iter_ptr(&it, 2) = best;
  }
  return NVL_OK;
}

nvl_status nvl_reduce_all_ref(nvl_kctx *ctx, nvl_reduce_op op, nvl_scalar *out, const nvl_tensor *a) {
  const nvl_dtype_traits *ta = &nvl_dtypes[a->dtype];
  int64_t n = nvl_tensor_numel(a);
  const nvl_tensor *ts[1] = {a};
  nvl_iter it;
  nvl_iter_init(&it, 1, ts);
  if (ta->is_float) {
    double acc = 0;
    for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) fold_f(op, &acc, ta->load_f(nvl_iter_ptr(&it, 0)), i == 0);
    *out = nvl_scalar_f(op == NVL_RED_MEAN ? acc / (double)n : acc);
    return NVL_OK;
  }
  int64_t acc = 0;
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) fold_i(op, &acc, ta->load_i(nvl_iter_ptr(&it, 0)), i == 0);
  *out = op == NVL_RED_MEAN ? nvl_scalar_f((double)acc / (double)n) : nvl_scalar_i(acc);
  return NVL_OK;
}

nvl_status nvl_matmul_ref(nvl_kctx *ctx, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  const nvl_dtype_traits *to = &nvl_dtypes[out->dtype], *ta = &nvl_dtypes[a->dtype], *tb = &nvl_dtypes[b->dtype];
  int64_t M = a->shape[0], K = a->shape[1], N = b->shape[1];
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double acc = 0;
      for (int64_t k = 0; k < K; k++) {
        int64_t ia[2] = {m, k}, ib[2] = {k, n};
        acc += ta->load_f(nvl_tensor_ptr(a, ia)) * tb->load_f(nvl_tensor_ptr(b, ib));
      }
      int64_t io[2] = {m, n};
      to->store_f(nvl_tensor_ptr(out, io), acc);
    }
  return NVL_OK;
}

nvl_status nvl_fill_ref(nvl_kctx *ctx, nvl_tensor *t, const void *value) {
  const int es = nvl_dtypes[t->dtype].elem_size;
  char *p = nvl_tensor_data(t);
  int64_t n = nvl_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) memcpy(p + i * es, value, (size_t)es);
  return NVL_OK;
}

nvl_status nvl_arange_ref(nvl_kctx *ctx, nvl_tensor *t, double start, double step) {
  const nvl_dtype_traits *tt = &nvl_dtypes[t->dtype];
  char *p = nvl_tensor_data(t);
  int64_t n = nvl_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) tt->store_f(p + i * tt->elem_size, start + (double)i * step);
  return NVL_OK;
}

/* element e of a call: uniform from word e % 4 of group e / 4; normal from words 2 (e % 2), +1 of
 * group e / 2 (Box-Muller, one value per pair). t holds elements first, first + 1, ... */
static void uniform(nvl_tensor *t, uint64_t seed, uint64_t offset, uint64_t first) {
  const nvl_dtype_traits *tt = &nvl_dtypes[t->dtype];
  const int bits = tt->significand_bits; /* k random bits * 2^-k: exact in the dtype, < 1 */
  char *p = nvl_tensor_data(t);
  int64_t n = nvl_tensor_numel(t);
  uint32_t w[4];
  for (int64_t i = 0; i < n; i++) {
    uint64_t e = first + (uint64_t)i;
    if (i == 0 || e % 4 == 0) nvl_philox_words(seed, offset, e / 4, w);
    tt->store_f(p + i * tt->elem_size, (double)(w[e % 4] >> (32 - bits)) * ldexp(1.0, -bits));
  }
}

static void normal(nvl_tensor *t, uint64_t seed, uint64_t offset, uint64_t first) {
  const nvl_dtype_traits *tt = &nvl_dtypes[t->dtype];
  char *p = nvl_tensor_data(t);
  int64_t n = nvl_tensor_numel(t);
  const double two_pi = 6.283185307179586;
  uint32_t w[4];
  for (int64_t i = 0; i < n; i++) {
    uint64_t e = first + (uint64_t)i;
    if (i == 0 || e % 2 == 0) nvl_philox_words(seed, offset, e / 2, w);
    int j = 2 * (int)(e % 2);
    double u1 = ((double)(w[j] >> 8) + 1.0) * (1.0 / 16777216.0); /* (0, 1] */
    double u2 = (double)(w[j + 1] >> 8) * (1.0 / 16777216.0);      /* [0, 1) */
    tt->store_f(p + i * tt->elem_size, sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
  }
}

nvl_status nvl_random_ref(nvl_kctx *ctx, nvl_tensor *t, uint64_t seed, uint64_t offset, uint64_t first,
                          int is_normal) {
  if (is_normal) normal(t, seed, offset, first);
  else uniform(t, seed, offset, first);
  return NVL_OK;
}

/* One element of a op s (scalar_left: s op a) for a comparison op: exact between an integer and a
 * float (NUMERICS §8). */
static int compare_scalar(nvl_binary_op op, const nvl_dtype_traits *ta, const void *pa, nvl_scalar sc,
                          int scalar_left) {
  if (!ta->is_float && (sc.is_int || nvl_f64_is_i64(sc.f))) { /* both integers */
    int64_t x = ta->load_i(pa), si = sc.is_int ? sc.i : (int64_t)sc.f;
    return (int)(scalar_left ? nvl_binary_i(op, si, x) : nvl_binary_i(op, x, si));
  }
  if (!ta->is_float) { /* an integer element, a float scalar */
    int64_t x = ta->load_i(pa);
    return scalar_left ? cmp_float_int(op, sc.f, x) : cmp_int_float(op, x, sc.f);
  }
  double x = ta->load_f(pa);
  if (sc.is_int) return scalar_left ? cmp_int_float(op, sc.i, x) : cmp_float_int(op, x, sc.i);
  return (int)(scalar_left ? nvl_binary_f(op, sc.f, x) : nvl_binary_f(op, x, sc.f));
}

nvl_status nvl_binary_scalar_ref(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, nvl_scalar sc,
                                 int scalar_left) {
  double s = sc.f;
  const nvl_tensor *ts[2] = {out, a};
  const nvl_dtype_traits *to = &nvl_dtypes[out->dtype], *ta = &nvl_dtypes[a->dtype];
  int64_t n = nvl_tensor_numel(out);
  /* integer arithmetic: core/ops.c keeps an integer result only for a scalar int64 holds exactly */
  int64_t si = sc.is_int ? sc.i : nvl_f64_to_i64_sat(s, INT64_MIN, INT64_MAX);
  nvl_iter it;
  nvl_iter_init(&it, 2, ts);
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) {
    void *po = nvl_iter_ptr(&it, 0), *pa = nvl_iter_ptr(&it, 1);
    if (op >= NVL_OP_EQ) {
      to->store_i(po, compare_scalar(op, ta, pa, sc, scalar_left));
    } else if (to->is_float) {
      double x = ta->load_f(pa);
      to->store_f(po, scalar_left ? nvl_binary_f(op, s, x) : nvl_binary_f(op, x, s));
    } else {
      int64_t x = ta->load_i(pa);
      to->store_i(po, scalar_left ? nvl_binary_i(op, si, x) : nvl_binary_i(op, x, si));
    }
  }
  return NVL_OK;
}

static int allclose(const nvl_tensor *a, const nvl_tensor *b, double rtol, double atol, int equal_nan) {
  const nvl_tensor *ts[2] = {a, b};
  const nvl_dtype_traits *ta = &nvl_dtypes[a->dtype], *tb = &nvl_dtypes[b->dtype];
  int64_t n = nvl_tensor_numel(a);
  nvl_iter it;
  nvl_iter_init(&it, 2, ts);
  for (int64_t i = 0; i < n; i++, nvl_iter_next(&it)) {
    double x = ta->load_f(nvl_iter_ptr(&it, 0)), y = tb->load_f(nvl_iter_ptr(&it, 1));
    if (isnan(x) || isnan(y)) {
      if (equal_nan && isnan(x) && isnan(y)) continue;
      return 0;
    }
    if (x == y) continue; /* equal infinities included */
    if (isinf(x) || isinf(y)) return 0;
    if (!(fabs(x - y) <= atol + rtol * fabs(y))) return 0;
  }
  return 1;
}

nvl_status nvl_allclose_ref(nvl_kctx *ctx, int *result, const nvl_tensor *a, const nvl_tensor *b, double rtol,
                            double atol, int equal_nan) {
  *result = allclose(a, b, rtol, atol, equal_nan);
  return NVL_OK;
}

nvl_status nvl_axpy_ref(nvl_kctx *ctx, float *y, const float *x, double alpha, int64_t n) {
  float a = (float)alpha;
  for (int64_t i = 0; i < n; i++) {
    float p = a * x[i];
    y[i] = y[i] + p;
  }
  return NVL_OK;
}

nvl_status nvl_scale_ref(nvl_kctx *ctx, float *p, double s, int64_t n) {
  for (int64_t i = 0; i < n; i++) p[i] = (float)((double)p[i] * s); /* a float times a double: exact, one rounding */
  return NVL_OK;
}
