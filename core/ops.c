/* ops.c: validation, output allocation and one kernel-table call per tensor op (see ops.h). */
#include <limits.h>
#include <math.h>
#include <string.h>
#include "dispatch.h"
#include "ops.h"

const char *const nvl_binary_names[NVL_BINARY_COUNT] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum",
                                                           "eq", "ne", "lt", "le", "gt", "ge"};
const char *const nvl_unary_names[NVL_UNARY_COUNT] = {"exp", "log", "sqrt", "abs", "neg"};
const char *const nvl_reduce_names[NVL_REDUCE_COUNT] = {"sum", "mean", "max", "min", "amax"};

static nvl_status same_device(const char *op, const nvl_tensor *a, const nvl_tensor *b) {
  if (a->device != b->device) {
    char s1[160], s2[160];
    return nvl_error(NVL_EINVAL, "%s: tensors are on different devices: %s and %s", op,
                     nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2));
  }
  return NVL_OK;
}

/* Element access reads host memory. */
static nvl_status host_only(const char *op, const nvl_tensor *t) {
  if (t->device != NVL_CPU) {
    char s[160];
    return nvl_error(NVL_EUNSUPPORTED, "%s: not supported on a device tensor (%s); copy it with :cpu() first", op,
                     nvl_tensor_desc(t, s, sizeof s));
  }
  return NVL_OK;
}

static int is_f32_contig(const nvl_tensor *t) { return t->dtype == NVL_F32 && nvl_tensor_is_contiguous(t); }

nvl_status nvl_binary(nvl_tensor *out, nvl_binary_op op, const nvl_tensor *a, const nvl_tensor *b) {
  const char *name = (unsigned)op < NVL_BINARY_COUNT ? nvl_binary_names[op] : "binary";
  if ((unsigned)op >= NVL_BINARY_COUNT) return nvl_error(NVL_EINVAL, "binary: invalid op %d", (int)op);
  NVL_TRY(nvl_tensor_check_live(a, name));
  NVL_TRY(nvl_tensor_check_live(b, name));
  NVL_TRY(same_device(name, a, b));
  int ndim;
  int64_t shape[NVL_MAX_DIMS];
  NVL_TRY(nvl_broadcast_shape(a, b, name, &ndim, shape));
  nvl_dtype dt = nvl_dtype_promote(a->dtype, b->dtype);
  if ((op == NVL_OP_DIV || op == NVL_OP_POW) && !nvl_dtypes[dt].is_float) dt = NVL_F32;
  if (op >= NVL_OP_EQ) dt = NVL_U8;

  const nvl_backend *be;
  NVL_PICK(be, a, binary, name);
  nvl_tensor r = nvl_tensor_null(), ea = nvl_tensor_null(), eb = nvl_tensor_null();
  nvl_tensor wa = nvl_tensor_null(), wb = nvl_tensor_null();
  nvl_status st = NVL_OK;
  /* bf16 with f32 (PyTorch's promotion, README "Tensors"): the bf16 operand widened first (exact), so
   * every backend runs the f32 op on one dtype; the same bits as an f32 op on the widened values */
  if (a->dtype != b->dtype && nvl_dtypes[a->dtype].is_float && nvl_dtypes[b->dtype].is_float) {
    nvl_dtype wide = nvl_dtype_promote(a->dtype, b->dtype);
    if (a->dtype != wide) {
      st = nvl_tensor_clone_to(&wa, a, wide, a->device);
      a = &wa;
    } else {
      st = nvl_tensor_clone_to(&wb, b, wide, b->device);
      b = &wb;
    }
  }
  if (st == NVL_OK) st = nvl_tensor_empty(&r, dt, a->device, ndim, shape);
  if (st == NVL_OK) st = nvl_tensor_expand(&ea, a, ndim, shape);
  if (st == NVL_OK) st = nvl_tensor_expand(&eb, b, ndim, shape);
  if (st == NVL_OK) st = NVL_CALL(be, a, binary, op, &r, &ea, &eb);
  nvl_tensor_release(&ea);
  nvl_tensor_release(&eb);
  nvl_tensor_release(&wa);
  nvl_tensor_release(&wb);
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_binary_scalar(nvl_tensor *out, nvl_binary_op op, const nvl_tensor *a, nvl_scalar sc, int scalar_left) {
  double s = sc.f;
  if ((unsigned)op >= NVL_BINARY_COUNT) return nvl_error(NVL_EINVAL, "binary: invalid op %d", (int)op);
  const char *name = nvl_binary_names[op];
  const nvl_backend *be;
  NVL_TRY(nvl_tensor_check_live(a, name));
  NVL_PICK(be, a, binary_scalar, name);
  nvl_dtype dt = a->dtype;
  /* an integer tensor stays integer only with a scalar int64 holds exactly (NUMERICS §8) */
  if (!nvl_dtypes[dt].is_float && (op == NVL_OP_DIV || op == NVL_OP_POW || (!sc.is_int && !nvl_f64_is_i64(s))))
    dt = NVL_F32;
  if (op >= NVL_OP_EQ) dt = NVL_U8;
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, dt, a->device, a->ndim, a->shape));
  nvl_status st = NVL_CALL(be, a, binary_scalar, op, &r, a, sc, scalar_left);
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_unary(nvl_tensor *out, nvl_unary_op op, const nvl_tensor *a) {
  if ((unsigned)op >= NVL_UNARY_COUNT) return nvl_error(NVL_EINVAL, "unary: invalid op %d", (int)op);
  const char *name = nvl_unary_names[op];
  const nvl_backend *be;
  NVL_TRY(nvl_tensor_check_live(a, name));
  NVL_PICK(be, a, unary, name);
  nvl_dtype dt = a->dtype;
  if (!nvl_dtypes[dt].is_float && (op == NVL_OP_EXP || op == NVL_OP_LOG || op == NVL_OP_SQRT)) dt = NVL_F32;
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, dt, a->device, a->ndim, a->shape));
  nvl_status st = NVL_CALL(be, a, unary, op, &r, a);
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *out = r;
  return NVL_OK;
}

static nvl_dtype reduce_dtype(nvl_reduce_op op, nvl_dtype in) {
  if (nvl_dtypes[in].is_float) return in;
  if (op == NVL_RED_SUM) return NVL_I64;
  if (op == NVL_RED_MEAN) return NVL_F32;
  return in;
}

nvl_status nvl_reduce_all(nvl_scalar *result, nvl_reduce_op op, const nvl_tensor *a) {
  if ((unsigned)op >= NVL_REDUCE_COUNT) return nvl_error(NVL_EINVAL, "reduce: invalid op %d", (int)op);
  const char *name = nvl_reduce_names[op];
  NVL_TRY(nvl_tensor_check_live(a, name));
  if (nvl_tensor_numel(a) == 0 && op >= NVL_RED_MAX)
    return nvl_error(NVL_EINVAL, "%s: the tensor is empty", name);
  const nvl_backend *be;
  NVL_PICK(be, a, reduce_all, name);
  return NVL_CALL(be, a, reduce_all, op, result, a);
}

nvl_status nvl_reduce_dim(nvl_tensor *out, nvl_tensor *idx, nvl_reduce_op op, const nvl_tensor *a, int dim, int keepdim) {
  if ((unsigned)op >= NVL_REDUCE_COUNT) return nvl_error(NVL_EINVAL, "reduce: invalid op %d", (int)op);
  const char *name = nvl_reduce_names[op];
  char sh[160];
  const nvl_backend *be;
  NVL_TRY(nvl_tensor_check_live(a, name));
  NVL_PICK(be, a, reduce_last, name);
  if (dim < 0 || dim >= a->ndim)
    return nvl_error(NVL_EINVAL, "%s: dim %d out of range for a %d-D tensor %s", name, dim + 1, a->ndim,
                     nvl_shape_str(a, sh, sizeof sh));
  if (a->shape[dim] == 0 && op >= NVL_RED_MAX)
    return nvl_error(NVL_EINVAL, "%s: dim %d of %s is empty", name, dim + 1, nvl_shape_str(a, sh, sizeof sh));
  /* a permuted so dim is last; lead = the other dims in order. */
  int perm[NVL_MAX_DIMS], k = 0;
  int64_t lead[NVL_MAX_DIMS], full[NVL_MAX_DIMS];
  for (int d = 0; d < a->ndim; d++) {
    full[d] = d == dim ? 1 : a->shape[d];
    if (d != dim) { lead[k] = a->shape[d]; perm[k++] = d; }
  }
  perm[k] = dim;
  nvl_tensor ap = nvl_tensor_null(), r = nvl_tensor_null(), rv = nvl_tensor_null();
  nvl_tensor ix = nvl_tensor_null(), ixv = nvl_tensor_null();
  nvl_status st = nvl_tensor_permute(&ap, a, perm);
  if (st == NVL_OK)
    st = nvl_tensor_empty(&r, reduce_dtype(op, a->dtype), a->device, keepdim ? a->ndim : a->ndim - 1, keepdim ? full : lead);
  if (st == NVL_OK) st = nvl_tensor_view(&rv, &r, a->ndim - 1, lead);
  if (st == NVL_OK && idx)
    st = nvl_tensor_empty(&ix, NVL_I64, a->device, keepdim ? a->ndim : a->ndim - 1, keepdim ? full : lead);
  if (st == NVL_OK && idx) st = nvl_tensor_view(&ixv, &ix, a->ndim - 1, lead);
  if (st == NVL_OK) st = NVL_CALL(be, a, reduce_last, op, &rv, idx ? &ixv : NULL, &ap);
  nvl_tensor_release(&ap);
  nvl_tensor_release(&rv);
  nvl_tensor_release(&ixv);
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    nvl_tensor_release(&ix);
    return st;
  }
  *out = r;
  if (idx) *idx = ix;
  return NVL_OK;
}

/* The 2-D matrix of batch bi of t viewed as [batch..., R, C] (no reference taken). */
static nvl_tensor batch_matrix(const nvl_tensor *t, int64_t bi) {
  nvl_tensor m = *t;
  int nb = t->ndim - 2;
  for (int d = nb - 1; d >= 0; d--) {
    m.offset += (bi % t->shape[d]) * t->strides[d];
    bi /= t->shape[d];
  }
  m.ndim = 2;
  m.shape[0] = t->shape[nb]; m.shape[1] = t->shape[nb + 1];
  m.strides[0] = t->strides[nb]; m.strides[1] = t->strides[nb + 1];
  return m;
}

nvl_status nvl_matmul(nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  char s1[160], s2[160];
  NVL_TRY(nvl_tensor_check_live(a, "matmul"));
  NVL_TRY(nvl_tensor_check_live(b, "matmul"));
  NVL_TRY(same_device("matmul", a, b));
  const nvl_backend *be;
  NVL_PICK(be, a, matmul, "matmul");
  if (a->ndim < 2 || b->ndim < 2)
    return nvl_error(NVL_EINVAL, "matmul: expects 2-D or batched matrices, got a %s and b %s",
                     nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2));
  if (!nvl_dtypes[a->dtype].is_float || !nvl_dtypes[b->dtype].is_float)
    return nvl_error(NVL_EINVAL, "matmul: expects f32 or bf16 tensors, got a %s and b %s",
                     nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2));
  /* PyTorch's rule: elementwise ops promote (bf16 + f32 -> f32), a product of two dtypes is an error
   * rather than a silent f32 result (README "Tensors") */
  if (a->dtype != b->dtype) {
    const char *da = nvl_dtypes[a->dtype].name, *db = nvl_dtypes[b->dtype].name;
    return nvl_error(NVL_EINVAL, "matmul: a is %s and b is %s; convert one (b:to('%s') or a:to('%s'))",
                     nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2), da, db);
  }
  int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
  if (b->shape[b->ndim - 2] != K)
    return nvl_error(NVL_EINVAL, "matmul: inner dims differ: a is %s, b is %s", nvl_tensor_desc(a, s1, sizeof s1),
                     nvl_tensor_desc(b, s2, sizeof s2));
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return nvl_error(NVL_EINVAL, "matmul: dims above 2^31 are not supported (a %s, b %s)",
                     nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2));
  /* batch dims: broadcast a[..., :, :] against b[..., :, :] */
  nvl_tensor ba = *a, bb = *b;
  ba.ndim -= 2; bb.ndim -= 2;
  int nb;
  int64_t shape[NVL_MAX_DIMS];
  NVL_TRY(nvl_broadcast_shape(&ba, &bb, "matmul (batch dims)", &nb, shape));
  if (nb + 2 > NVL_MAX_DIMS) return nvl_error(NVL_EINVAL, "matmul: too many dims");
  int64_t batches = 1; /* nvl_broadcast_shape checked that the product fits */
  for (int d = 0; d < nb; d++) batches *= shape[d];
  nvl_dtype dt = a->dtype;

  int64_t sa[NVL_MAX_DIMS], sb[NVL_MAX_DIMS], so[NVL_MAX_DIMS];
  memcpy(sa, shape, sizeof(int64_t) * nb); memcpy(sb, shape, sizeof(int64_t) * nb); memcpy(so, shape, sizeof(int64_t) * nb);
  sa[nb] = M; sa[nb + 1] = K; sb[nb] = K; sb[nb + 1] = N; so[nb] = M; so[nb + 1] = N;

  nvl_tensor fa = nvl_tensor_null(), fb = nvl_tensor_null(), ea = nvl_tensor_null(), eb = nvl_tensor_null();
  nvl_tensor r = nvl_tensor_null(), rf = nvl_tensor_null();
  nvl_status st = NVL_OK;
  /* bf16 operands are widened to f32 (exact) and the product rounded once at the end. */
  nvl_device dev = a->device;
  if (a->dtype == NVL_F32) nvl_tensor_share(&fa, a); else st = nvl_tensor_clone_to(&fa, a, NVL_F32, dev);
  if (st == NVL_OK) { if (b->dtype == NVL_F32) nvl_tensor_share(&fb, b); else st = nvl_tensor_clone_to(&fb, b, NVL_F32, dev); }
  if (st == NVL_OK) st = nvl_tensor_expand(&ea, &fa, nb + 2, sa);
  if (st == NVL_OK) st = nvl_tensor_expand(&eb, &fb, nb + 2, sb);
  if (st == NVL_OK) st = nvl_tensor_empty(&r, dt, dev, nb + 2, so);
  if (st == NVL_OK) { if (dt == NVL_F32) nvl_tensor_share(&rf, &r); else st = nvl_tensor_empty(&rf, NVL_F32, dev, nb + 2, so); }
  for (int64_t bi = 0; st == NVL_OK && bi < batches; bi++) {
    nvl_tensor ma = batch_matrix(&ea, bi), mb = batch_matrix(&eb, bi), mo = batch_matrix(&rf, bi);
    st = NVL_CALL(be, a, matmul, &mo, &ma, &mb);
  }
  if (st == NVL_OK && dt != NVL_F32) st = nvl_tensor_copy(&r, &rf);
  nvl_tensor_release(&fa); nvl_tensor_release(&fb); nvl_tensor_release(&ea); nvl_tensor_release(&eb);
  nvl_tensor_release(&rf);
  if (st != NVL_OK) { nvl_tensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

/* t += alpha * src, one rule for every layout and device (NUMERICS §9): p = (float)alpha * src rounded to f32,
 * then t + p rounded to f32, by the backend's axpy. A strided or bf16 destination is computed in an f32
 * contiguous copy and written back (bf16: one rounding of the f32 sum). */
nvl_status nvl_add_(nvl_tensor *t, const nvl_tensor *src, double alpha) {
  char s1[160], s2[160];
  NVL_TRY(nvl_tensor_check_live(t, "add_"));
  NVL_TRY(nvl_tensor_check_live(src, "add_"));
  NVL_TRY(same_device("add_", t, src));
  if (!nvl_dtypes[t->dtype].is_float)
    return nvl_error(NVL_EINVAL, "add_: the destination must be f32 or bf16, got %s", nvl_dtypes[t->dtype].name);
  const nvl_backend *be;
  NVL_PICK(be, t, axpy, "add_");
  nvl_tensor e = nvl_tensor_null(), c = nvl_tensor_null(), y = nvl_tensor_null();
  if (nvl_tensor_expand(&e, src, t->ndim, t->shape) != NVL_OK)
    return nvl_error(NVL_EINVAL, "add_: %s does not broadcast to %s", nvl_tensor_desc(src, s1, sizeof s1),
                     nvl_tensor_desc(t, s2, sizeof s2));
  nvl_status st = NVL_OK;
  if (alpha == 1.0 && t->dtype == NVL_BF16 && e.dtype == NVL_BF16 && nvl_tensor_is_contiguous(t) &&
      nvl_tensor_is_contiguous(&e) && (e.storage != t->storage || nvl_tensor_data(&e) == nvl_tensor_data(t))) {
    /* bf16 += bf16: p = src exactly, and the f32 sum rounded to bf16 is the exact sum rounded
     * once, which is what the bf16 ADD of the binary entry computes (CPU and CUDA tables); in
     * place, one pass */
    const nvl_backend *bb = nvl_backend_for(t->device, "add_"); /* NVL_PICK's choice, without its return */
    if (bb && !bb->binary && bb->fallback) bb = bb->fallback;
    if (!bb || !bb->binary) { /* every table has it today; were one not to, e must not leak */
      nvl_tensor_release(&e);
      NVL_PICK(be, t, binary, "add_");
    }
    st = NVL_CALL(bb, t, binary, NVL_OP_ADD, t, t, &e);
    nvl_tensor_release(&e);
    return st;
  }
  int direct = is_f32_contig(t);
  if (direct) nvl_tensor_share(&y, t);
  else st = nvl_tensor_clone_to(&y, t, NVL_F32, t->device);
  /* src gathered to a contiguous f32 temporary unless it is one that does not alias t */
  if (st == NVL_OK) {
    if (is_f32_contig(&e) && e.storage != t->storage) nvl_tensor_share(&c, &e);
    else st = nvl_tensor_clone_to(&c, &e, NVL_F32, t->device);
  }
  if (st == NVL_OK) st = NVL_CALL(be, t, axpy, nvl_tensor_data(&y), nvl_tensor_data(&c), alpha, nvl_tensor_numel(t));
  if (st == NVL_OK && !direct) st = nvl_tensor_copy(t, &y);
  nvl_tensor_release(&e);
  nvl_tensor_release(&c);
  nvl_tensor_release(&y);
  return st;
}

nvl_status nvl_mul_(nvl_tensor *t, double s) {
  NVL_TRY(nvl_tensor_check_live(t, "mul_"));
  if (!nvl_dtypes[t->dtype].is_float)
    return nvl_error(NVL_EINVAL, "mul_: the tensor must be f32 or bf16, got %s", nvl_dtypes[t->dtype].name);
  if (is_f32_contig(t)) {
    const nvl_backend *be;
    NVL_PICK(be, t, scale, "mul_");
    return NVL_CALL(be, t, scale, nvl_tensor_data(t), s, nvl_tensor_numel(t));
  }
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_binary_scalar(&r, NVL_OP_MUL, t, nvl_scalar_f(s), 0));
  nvl_status st = nvl_tensor_copy(t, &r);
  nvl_tensor_release(&r);
  return st;
}

nvl_status nvl_fill_(nvl_tensor *t, nvl_scalar v) {
  NVL_TRY(nvl_tensor_check_live(t, "fill"));
  const nvl_dtype_traits *tt = &nvl_dtypes[t->dtype];
  const nvl_backend *be;
  NVL_PICK(be, t, fill, "fill");
  uint8_t value[8]; /* the element's bytes: integers exact, floats rounded once */
  if (v.is_int && !tt->is_float) tt->store_i(value, v.i);
  else tt->store_f(value, v.f);
  if (nvl_tensor_is_contiguous(t)) return NVL_CALL(be, t, fill, t, value);
  nvl_tensor c = nvl_tensor_null(); /* a strided t: through a contiguous temporary */
  NVL_TRY(nvl_tensor_empty(&c, t->dtype, t->device, t->ndim, t->shape));
  nvl_status st = NVL_CALL(be, t, fill, &c, value);
  if (st == NVL_OK) st = nvl_tensor_copy(t, &c);
  nvl_tensor_release(&c);
  return st;
}

nvl_status nvl_arange_(nvl_tensor *t, double start, double step) {
  const nvl_backend *be;
  NVL_TRY(nvl_tensor_check_live(t, "arange"));
  NVL_PICK(be, t, arange, "arange");
  if (t->ndim != 1 || !nvl_tensor_is_contiguous(t)) return nvl_error(NVL_EINVAL, "arange: needs a contiguous 1-D tensor");
  return NVL_CALL(be, t, arange, t, start, step);
}

static nvl_status random_fill(nvl_tensor *t, nvl_generator *g, int64_t first, int normal) {
  const char *name = normal ? "randn" : "rand";
  const nvl_backend *be;
  NVL_TRY(nvl_tensor_check_live(t, name));
  NVL_PICK(be, t, random, name);
  if (!nvl_dtypes[t->dtype].is_float)
    return nvl_error(NVL_EINVAL, "%s: dtype must be f32 or bf16, got %s", name, nvl_dtypes[t->dtype].name);
  if (first < 0) return nvl_error(NVL_EINVAL, "%s: first must be >= 0, got %lld", name, (long long)first);
  if (!g) g = nvl_default_generator();
  nvl_tensor c = nvl_tensor_null();
  if (nvl_tensor_is_contiguous(t)) nvl_tensor_share(&c, t);
  else NVL_TRY(nvl_tensor_empty(&c, t->dtype, t->device, t->ndim, t->shape));
  nvl_status st = NVL_CALL(be, t, random, &c, g->seed, g->offset, (uint64_t)first, normal);
  if (st == NVL_OK) g->offset++;
  if (st == NVL_OK && !nvl_tensor_is_contiguous(t)) st = nvl_tensor_copy(t, &c);
  nvl_tensor_release(&c);
  return st;
}

nvl_status nvl_rand_(nvl_tensor *t, nvl_generator *g) { return random_fill(t, g, 0, 0); }
nvl_status nvl_randn_(nvl_tensor *t, nvl_generator *g) { return random_fill(t, g, 0, 1); }
nvl_status nvl_rand_part_(nvl_tensor *t, nvl_generator *g, int64_t first) { return random_fill(t, g, first, 0); }
nvl_status nvl_randn_part_(nvl_tensor *t, nvl_generator *g, int64_t first) { return random_fill(t, g, first, 1); }

nvl_status nvl_cast(nvl_tensor *out, const nvl_tensor *t, nvl_dtype dt) {
  NVL_TRY(nvl_tensor_check_live(t, "to"));
  if ((unsigned)dt >= NVL_DTYPE_COUNT) return nvl_error(NVL_EINVAL, "to: invalid dtype");
  return nvl_tensor_clone_to(out, t, dt, t->device);
}

nvl_status nvl_allclose(int *result, const nvl_tensor *a, const nvl_tensor *b, double rtol, double atol, int equal_nan) {
  NVL_TRY(nvl_tensor_check_live(a, "allclose"));
  NVL_TRY(nvl_tensor_check_live(b, "allclose"));
  NVL_TRY(same_device("allclose", a, b));
  const nvl_backend *be;
  NVL_PICK(be, a, allclose, "allclose");
  int ndim;
  int64_t shape[NVL_MAX_DIMS];
  NVL_TRY(nvl_broadcast_shape(a, b, "allclose", &ndim, shape));
  nvl_tensor ea = nvl_tensor_null(), eb = nvl_tensor_null();
  nvl_status st = nvl_tensor_expand(&ea, a, ndim, shape);
  if (st == NVL_OK) st = nvl_tensor_expand(&eb, b, ndim, shape);
  if (st == NVL_OK) st = NVL_CALL(be, a, allclose, result, &ea, &eb, rtol, atol, equal_nan);
  nvl_tensor_release(&ea);
  nvl_tensor_release(&eb);
  return st;
}

static nvl_status check_index(const char *op, const nvl_tensor *t, const int64_t *idx) {
  NVL_TRY(nvl_tensor_check_live(t, op));
  NVL_TRY(host_only(op, t));
  for (int d = 0; d < t->ndim; d++)
    if (idx[d] < 0 || idx[d] >= t->shape[d]) {
      char sh[160];
      return nvl_error(NVL_EINVAL, "%s: index %lld out of range for dim %d of size %lld (tensor %s)", op,
                       (long long)idx[d] + 1, d + 1, (long long)t->shape[d], nvl_shape_str(t, sh, sizeof sh));
    }
  return NVL_OK;
}

nvl_status nvl_get(double *v, const nvl_tensor *t, const int64_t *idx) {
  NVL_TRY(check_index("get", t, idx));
  *v = nvl_dtypes[t->dtype].load_f(nvl_tensor_ptr(t, idx));
  return NVL_OK;
}

nvl_status nvl_set(nvl_tensor *t, const int64_t *idx, double v) {
  NVL_TRY(check_index("set", t, idx));
  nvl_dtypes[t->dtype].store_f(nvl_tensor_ptr(t, idx), v);
  return NVL_OK;
}

nvl_status nvl_set_i(nvl_tensor *t, const int64_t *idx, int64_t v) {
  NVL_TRY(check_index("set", t, idx));
  const nvl_dtype_traits *tt = &nvl_dtypes[t->dtype];
  if (tt->is_float) tt->store_f(nvl_tensor_ptr(t, idx), (double)v);
  else tt->store_i(nvl_tensor_ptr(t, idx), v);
  return NVL_OK;
}
