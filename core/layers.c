/* layers.c: validation, output allocation and dispatch for the layer library (core/layers.h):
 * embedding, RMSNorm, RoPE, SwiGLU, fused cross-entropy, AdamW, sumsq. Attention lives in
 * core/attention.c.
 *
 * bf16 activations (NUMERICS §11): each public entry reads its activations' dtype (core/act.h); bf16
 * ones are widened to f32 copies, the f32 entry (the *_f32 functions below) runs on them and its
 * activation outputs are rounded once to bf16.
 *
 * Every entry checks its tensors (live, on the CPU, f32 and contiguous — ids and targets: i64,
 * any strides —, shapes consistent, ids and targets in range) and fails with a message naming
 * the op (by its Lua name), the tensors' shapes and dtypes, before anything is allocated or
 * written. Outputs are allocated here; parameter gradients are passed in and accumulated into.
 * Then one entry of the kernel table of the tensors' device runs (core/dispatch.h: the CPU
 * table, the reference while nv.use_reference is on, or CUDA).
 *
 * Shapes, beyond layers.h: the row-wise layers take any leading dims and flatten them to N —
 * ids (...) -> out (..., C); x (..., C) -> rstd (...); logits (..., V) with targets (...);
 * swiglu's gate/up any one shape. RoPE takes x (B, T, H, D) with cos/sin exactly (T, D).
 * Cross-entropy takes f32 or bf16 logits (bf16 is widened to f32 exactly first). sumsq takes
 * any f32/bf16 tensor, strided or not.
 *
 * Devices: every tensor of a call must be on the device of its first tensor (ids and targets may
 * also be on the CPU: they are range-checked on the host either way).
 *
 * Not here: attention, the kernels themselves, Lua. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "act.h"
#include "dispatch.h"
#include "layers.h"
#include "optim.h"
#include "quant.h"

#define DESC(t, buf) nvl_tensor_desc((t), (buf), sizeof(buf))

/* ---- validation helpers ----------------------------------------------------------------------- */


static int on_host(const nvl_tensor *t) { return !t || !t->storage || t->device == NVL_CPU; }

/* t is live, on like's device (like: the op's first tensor, already checked; NULL or t itself:
 * any device), of dtype dt, contiguous; name is how the op's docs call it. */
static nvl_status check_tensor_on(const char *op, const char *name, const nvl_tensor *t, nvl_dtype dt,
                                  const nvl_tensor *like) {
  char s[160], s2[160];
  if (!t) return nvl_error(NVL_EINVAL, "%s: %s is missing (NULL)", op, name);
  if (!t->storage) return nvl_error(NVL_ESTATE, "%s: %s has been freed", op, name);
  if (like && like != t && like->storage && !nvl_tensor_same_device(t, like))
    return nvl_error(NVL_EINVAL, "%s: %s is %s but the call's first tensor is %s; every tensor must be on one device",
                     op, name, DESC(t, s), DESC(like, s2));
  if (t->dtype != dt)
    return nvl_error(NVL_EINVAL, "%s: %s must be %s, got %s", op, name, nvl_dtypes[dt].name, DESC(t, s));
  if (!nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "%s: %s must be contiguous, got a strided view %s; call :contiguous() first", op, name,
                     DESC(t, s));
  return NVL_OK;
}

/* The op's first tensor: any device. */
static nvl_status check_tensor(const char *op, const char *name, const nvl_tensor *t, nvl_dtype dt) {
  return check_tensor_on(op, name, t, dt, NULL);
}

static int same_shape(const nvl_tensor *a, const nvl_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* "op: a is [4,64] f32 but b is [32] f32" (+ what was expected). */
static nvl_status mismatch(const char *op, const char *an, const nvl_tensor *a, const char *bn, const nvl_tensor *b,
                           const char *expect) {
  char s1[160], s2[160];
  return nvl_error(NVL_EINVAL, "%s: %s is %s but %s is %s%s%s", op, an, DESC(a, s1), bn, DESC(b, s2),
                   expect ? "; expected " : "", expect ? expect : "");
}

static nvl_status need_same_shape(const char *op, const char *an, const nvl_tensor *a, const char *bn,
                                  const nvl_tensor *b) {
  return same_shape(a, b) ? NVL_OK : mismatch(op, an, a, bn, b, "the same shape");
}

/* b's shape is a's without its last dim. */
static int is_leading_shape(const nvl_tensor *a, const nvl_tensor *b) {
  if (b->ndim != a->ndim - 1) return 0;
  for (int d = 0; d < b->ndim; d++)
    if (b->shape[d] != a->shape[d]) return 0;
  return 1;
}

static nvl_status need_out_null(const char *op, const char *name, const nvl_tensor *t) {
  if (!t) return nvl_error(NVL_EINVAL, "%s: no place for the output %s (NULL)", op, name);
  if (t->storage) return nvl_error(NVL_EINVAL, "%s: the output %s must be a null tensor", op, name);
  return NVL_OK;
}

/* Every id in [0, V). what: "id" or "target"; ids with value skip are allowed (ignore_index). */
static nvl_status check_ids(const char *op, const char *what, const int64_t *ids, int64_t n, int64_t V,
                            int has_skip, int64_t skip) {
  for (int64_t i = 0; i < n; i++) {
    if (has_skip && ids[i] == skip) continue;
    if (ids[i] < 0 || ids[i] >= V)
      return nvl_error(NVL_EINVAL, "%s: %s %lld out of range for V = %lld (element %lld of the %ss, 1-based; ids are "
                       "0-based)%s",
                       op, what, (long long)ids[i], (long long)V, (long long)i + 1, what,
                       has_skip ? "; only ignore_index may lie outside [0, V)" : "");
  }
  return NVL_OK;
}

/* ids / targets: live, CPU, i64, any strides — *c gets a contiguous view or copy (these are
 * small, and slices like tokens[:, 1:] are their natural form). Release *c after use. */
static nvl_status ids_contiguous(const char *op, const char *name, const nvl_tensor *t, nvl_tensor *c) {
  char s[160];
  if (!t) return nvl_error(NVL_EINVAL, "%s: %s is missing (NULL)", op, name);
  if (!t->storage) return nvl_error(NVL_ESTATE, "%s: %s has been freed", op, name);
  if (t->device != NVL_CPU)
    return nvl_error(NVL_EINVAL, "%s: %s is %s but the call's other tensors are on the cpu; every tensor must be on one "
                     "device", op, name, DESC(t, s));
  if (t->dtype != NVL_I64) return nvl_error(NVL_EINVAL, "%s: %s must be i64, got %s", op, name, DESC(t, s));
  return nvl_tensor_contiguous(c, t);
}

/* ids / targets for an op on like's device: *h a contiguous CPU view or copy (for the range
 * checks), *d the same ids on like's device (a share of *h when that is the CPU). Release both. */
static nvl_status ids_on(const char *op, const char *name, const nvl_tensor *t, const nvl_tensor *like, nvl_tensor *h,
                         nvl_tensor *d) {
  char s[160];
  if (on_host(like)) {
    NVL_TRY(ids_contiguous(op, name, t, h));
    nvl_tensor_share(d, h);
    return NVL_OK;
  }
  if (!t) return nvl_error(NVL_EINVAL, "%s: %s is missing (NULL)", op, name);
  if (!t->storage) return nvl_error(NVL_ESTATE, "%s: %s has been freed", op, name);
  if (t->dtype != NVL_I64) return nvl_error(NVL_EINVAL, "%s: %s must be i64, got %s", op, name, DESC(t, s));
  if (t->device != NVL_CPU && !nvl_tensor_same_device(t, like))
    return nvl_error(NVL_EINVAL, "%s: %s is %s, on another device than the call's first tensor", op, name, DESC(t, s));
  if (t->device != NVL_CPU && !nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "%s: %s on a device must be contiguous, got %s", op, name, DESC(t, s));
  if (t->device == NVL_CPU) NVL_TRY(nvl_tensor_contiguous(h, t));
  else NVL_TRY(nvl_tensor_clone_to(h, t, NVL_I64, NVL_CPU));
  nvl_status st = NVL_OK;
  if (t->device != NVL_CPU) nvl_tensor_share(d, t);
  else st = nvl_tensor_clone_to(d, h, NVL_I64, like->device);
  if (st != NVL_OK) nvl_tensor_release(h);
  return st;
}

/* Contiguous a and b of n f32 elements share memory. */
static int overlap(const nvl_tensor *a, const nvl_tensor *b, int64_t n) {
  if (a->storage != b->storage) return 0;
  return a->offset < b->offset + n && b->offset < a->offset + n;
}


/* ---- embedding -------------------------------------------------------------------------------- */

static nvl_status embedding_forward_f32(nvl_tensor *out, const nvl_tensor *ids_in, const nvl_tensor *weight) {
  const char *op = "embedding_forward";
  char s1[160];
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, "out", out));
  NVL_TRY(check_tensor(op, "weight", weight, NVL_F32));
  if (weight->ndim != 2) return nvl_error(NVL_EINVAL, "%s: weight must be 2-D (V, C), got %s", op, DESC(weight, s1));
  NVL_PICK(be, weight, layers->embedding_forward, op);
  nvl_tensor ids = nvl_tensor_null(), idd = nvl_tensor_null(), r = nvl_tensor_null();
  NVL_TRY(ids_on(op, "ids", ids_in, weight, &ids, &idd));
  int64_t V = weight->shape[0], C = weight->shape[1], N = nvl_tensor_numel(&ids);
  int64_t shape[NVL_MAX_DIMS];
  nvl_status st = NVL_OK;
  if (ids.ndim < 1 || ids.ndim >= NVL_MAX_DIMS)
    st = nvl_error(NVL_EINVAL, "%s: ids must have 1 to %d dims, got %s", op, NVL_MAX_DIMS - 1, DESC(&ids, s1));
  if (st == NVL_OK) {
    memcpy(shape, ids.shape, sizeof(int64_t) * ids.ndim);
    shape[ids.ndim] = C;
    st = check_ids(op, "id", nvl_tensor_data(&ids), N, V, 0, 0);
  }
  if (st == NVL_OK) st = nvl_tensor_empty(&r, NVL_F32, weight->device, ids.ndim + 1, shape);
  if (st == NVL_OK)
    st = NVL_CALL(be, weight, layers->embedding_forward, nvl_tensor_data(&r), nvl_tensor_data(&idd), nvl_tensor_data(weight),
                  N, C);
  if (st == NVL_OK) *out = r;
  else nvl_tensor_release(&r);
  nvl_tensor_release(&ids);
  nvl_tensor_release(&idd);
  return st;
}

nvl_status nvl_embedding_forward_as(nvl_tensor *out, const nvl_tensor *ids, const nvl_tensor *weight, nvl_dtype dt) {
  const char *op = "embedding_forward";
  if (dt != NVL_F32 && dt != NVL_BF16)
    return nvl_error(NVL_EINVAL, "%s: the output dtype must be f32 or bf16, got %s", op,
                     (int)dt >= 0 && dt < NVL_DTYPE_COUNT ? nvl_dtypes[dt].name : "an unknown dtype");
  if (dt == NVL_F32) return embedding_forward_f32(out, ids, weight);
  nvl_tensor r[1] = {nvl_tensor_null()};
  NVL_TRY(embedding_forward_f32(&r[0], ids, weight)); /* a gather: exact, then one rounding */
  nvl_tensor *outs[1] = {out};
  return nvl_act_round(outs, r, 1);
}

nvl_status nvl_embedding_forward(nvl_tensor *out, const nvl_tensor *ids, const nvl_tensor *weight) {
  return nvl_embedding_forward_as(out, ids, weight, NVL_F32);
}

static nvl_status embedding_backward_f32(nvl_tensor *dweight, const nvl_tensor *dout, const nvl_tensor *ids_in) {
  const char *op = "embedding_backward";
  char s1[160];
  const nvl_backend *be;
  NVL_TRY(check_tensor(op, "dweight", dweight, NVL_F32));
  NVL_TRY(check_tensor_on(op, "dout", dout, NVL_F32, dweight));
  if (dweight->ndim != 2) return nvl_error(NVL_EINVAL, "%s: dweight must be 2-D (V, C), got %s", op, DESC(dweight, s1));
  NVL_PICK(be, dweight, layers->embedding_backward, op);
  nvl_tensor ids = nvl_tensor_null(), idd = nvl_tensor_null();
  NVL_TRY(ids_on(op, "ids", ids_in, dweight, &ids, &idd));
  int64_t V = dweight->shape[0], C = dweight->shape[1], N = nvl_tensor_numel(&ids);
  nvl_status st = NVL_OK;
  if (ids.ndim < 1 || dout->ndim != ids.ndim + 1 || !is_leading_shape(dout, &ids) || dout->shape[dout->ndim - 1] != C)
    st = mismatch(op, "dout", dout, "ids", &ids, "dout of shape (ids..., C) with C = dweight's width");
  if (st == NVL_OK) st = check_ids(op, "id", nvl_tensor_data(&ids), N, V, 0, 0);
  if (st == NVL_OK)
    st = NVL_CALL(be, dweight, layers->embedding_backward, nvl_tensor_data(dweight), nvl_tensor_data(dout),
                  nvl_tensor_data(&idd), N, C);
  nvl_tensor_release(&ids);
  nvl_tensor_release(&idd);
  return st;
}

nvl_status nvl_embedding_backward(nvl_tensor *dweight, const nvl_tensor *dout, const nvl_tensor *ids) {
  const char *names[1] = {"dout"};
  nvl_dtype dt;
  NVL_TRY(nvl_act_dtype("embedding_backward", names, &dout, 1, &dt));
  if (dt == NVL_F32) return embedding_backward_f32(dweight, dout, ids);
  nvl_tensor w;
  NVL_TRY(nvl_act_widen(&w, &dout, 1));
  nvl_status st = embedding_backward_f32(dweight, &w, ids);
  nvl_tensor_release(&w);
  return st;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

/* x (..., C) with C >= 1 and weight (C). */
static nvl_status check_rms_x_w(const char *op, const nvl_tensor *x, const nvl_tensor *weight, nvl_dtype dt) {
  char s1[160];
  NVL_TRY(check_tensor(op, "x", x, dt));
  NVL_TRY(check_tensor_on(op, "weight", weight, NVL_F32, x));
  if (x->ndim < 1 || x->shape[x->ndim - 1] < 1)
    return nvl_error(NVL_EINVAL, "%s: x must be (..., C) with C >= 1, got %s", op, DESC(x, s1));
  if (weight->ndim != 1 || weight->shape[0] != x->shape[x->ndim - 1])
    return mismatch(op, "x", x, "weight", weight, "weight of shape [C] with C = x's last dim");
  return NVL_OK;
}

static const nvl_layer_kernels *native_bf16(const nvl_tensor *t);

/* dt f32: the f32 entry; dt bf16: the native bf16 one (the caller checked it is there): out of x's
 * dtype, rstd f32 */
static nvl_status rmsnorm_forward_as(nvl_tensor *out, nvl_tensor *rstd, const nvl_tensor *x, const nvl_tensor *weight,
                                     double eps, nvl_dtype dt, nvl_tensor *amax) {
  const char *op = "rmsnorm_forward";
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, "out", out));
  NVL_TRY(need_out_null(op, "rstd", rstd));
  NVL_TRY(check_rms_x_w(op, x, weight, dt));
  if (!(eps >= 0.0) || !isfinite(eps))
    return nvl_error(NVL_EINVAL, "%s: eps must be a finite number >= 0, got %g", op, eps);
  if (amax) NVL_PICK(be, x, layers->rmsnorm_forward_bf16_amax, op);
  else if (dt == NVL_BF16) NVL_PICK(be, x, layers->rmsnorm_forward_bf16, op);
  else NVL_PICK(be, x, layers->rmsnorm_forward, op);
  int64_t C = x->shape[x->ndim - 1], N = nvl_tensor_numel(x) / C, one = 1;
  nvl_tensor o = nvl_tensor_null(), r = nvl_tensor_null(), a = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&o, dt, x->device, x->ndim, x->shape);
  if (st == NVL_OK) st = nvl_tensor_empty(&r, NVL_F32, x->device, x->ndim - 1, x->shape);
  if (st == NVL_OK && amax) st = nvl_tensor_empty(&a, NVL_F32, x->device, 1, &one);
  void *od = st == NVL_OK ? nvl_tensor_data(&o) : NULL; /* o stays null when its allocation failed */
  const void *xd = nvl_tensor_data(x);
  if (st == NVL_OK && amax)
    st = NVL_CALL(be, x, layers->rmsnorm_forward_bf16_amax, od, nvl_tensor_data(&r), xd, nvl_tensor_data(weight), N, C,
                  eps, nvl_tensor_data(&a));
  else if (st == NVL_OK && dt == NVL_BF16)
    st = NVL_CALL(be, x, layers->rmsnorm_forward_bf16, od, nvl_tensor_data(&r), xd, nvl_tensor_data(weight), N, C, eps);
  else if (st == NVL_OK)
    st = NVL_CALL(be, x, layers->rmsnorm_forward, od, nvl_tensor_data(&r), xd, nvl_tensor_data(weight), N, C, eps);
  if (st != NVL_OK) {
    nvl_tensor_release(&o);
    nvl_tensor_release(&r);
    nvl_tensor_release(&a);
    return st;
  }
  *out = o;
  *rstd = r;
  if (amax) *amax = a;
  return NVL_OK;
}

nvl_status nvl_rmsnorm_forward(nvl_tensor *out, nvl_tensor *rstd, const nvl_tensor *x, const nvl_tensor *weight,
                               double eps) {
  const char *op = "rmsnorm_forward";
  const char *names[1] = {"x"};
  nvl_dtype dt;
  NVL_TRY(nvl_act_dtype(op, names, &x, 1, &dt));
  if (dt == NVL_F32) return rmsnorm_forward_as(out, rstd, x, weight, eps, NVL_F32, NULL);
  const nvl_layer_kernels *nat = native_bf16(x);
  if (nat && nat->rmsnorm_forward_bf16) return rmsnorm_forward_as(out, rstd, x, weight, eps, NVL_BF16, NULL);
  NVL_TRY(need_out_null(op, "out", out));
  NVL_TRY(need_out_null(op, "rstd", rstd));
  nvl_tensor w, r[1] = {nvl_tensor_null()}, sd = nvl_tensor_null();
  NVL_TRY(nvl_act_widen(&w, &x, 1));
  nvl_status st = rmsnorm_forward_as(&r[0], &sd, &w, weight, eps, NVL_F32, NULL);
  nvl_tensor_release(&w);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[1] = {out};
  st = nvl_act_round(outs, r, 1);
  if (st == NVL_OK) *rstd = sd; /* rstd stays f32 */
  else nvl_tensor_release(&sd);
  return st;
}

/* dt f32: the f32 entry; dt bf16: the native bf16 one (the caller checked it is there): dout, x, dx
 * of dtype dt; dweight, rstd f32 */
static nvl_status rmsnorm_backward_as(nvl_tensor *dx, nvl_tensor *dweight, const nvl_tensor *dout, const nvl_tensor *x,
                                      const nvl_tensor *weight, const nvl_tensor *rstd, nvl_dtype dt) {
  const char *op = "rmsnorm_backward";
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, "dx", dx));
  NVL_TRY(check_tensor(op, "dweight", dweight, NVL_F32));
  NVL_TRY(check_tensor_on(op, "dout", dout, dt, dweight));
  NVL_TRY(check_rms_x_w(op, x, weight, dt));
  NVL_TRY(check_tensor_on(op, "x", x, dt, dweight));
  NVL_TRY(check_tensor_on(op, "rstd", rstd, NVL_F32, dweight));
  NVL_TRY(need_same_shape(op, "dout", dout, "x", x));
  NVL_TRY(need_same_shape(op, "dweight", dweight, "weight", weight));
  if (!is_leading_shape(x, rstd)) return mismatch(op, "x", x, "rstd", rstd, "rstd of x's shape without its last dim");
  if (dt == NVL_BF16) NVL_PICK(be, x, layers->rmsnorm_backward_bf16, op);
  else NVL_PICK(be, x, layers->rmsnorm_backward, op);
  int64_t C = x->shape[x->ndim - 1], N = nvl_tensor_numel(x) / C;
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, dt, x->device, x->ndim, x->shape));
  void *rd = nvl_tensor_data(&r);
  const void *gd = nvl_tensor_data(dout), *xd = nvl_tensor_data(x);
  nvl_status st = dt == NVL_BF16
                    ? NVL_CALL(be, x, layers->rmsnorm_backward_bf16, rd, nvl_tensor_data(dweight), gd, xd,
                               nvl_tensor_data(weight), nvl_tensor_data(rstd), N, C)
                    : NVL_CALL(be, x, layers->rmsnorm_backward, rd, nvl_tensor_data(dweight), gd, xd,
                               nvl_tensor_data(weight), nvl_tensor_data(rstd), N, C);
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *dx = r;
  return NVL_OK;
}

nvl_status nvl_rmsnorm_backward(nvl_tensor *dx, nvl_tensor *dweight, const nvl_tensor *dout, const nvl_tensor *x,
                                const nvl_tensor *weight, const nvl_tensor *rstd) {
  const char *op = "rmsnorm_backward";
  const char *names[2] = {"dout", "x"};
  const nvl_tensor *acts[2] = {dout, x};
  nvl_dtype dt;
  NVL_TRY(nvl_act_dtype(op, names, acts, 2, &dt));
  if (dt == NVL_F32) return rmsnorm_backward_as(dx, dweight, dout, x, weight, rstd, NVL_F32);
  const nvl_layer_kernels *nat = native_bf16(x);
  if (nat && nat->rmsnorm_backward_bf16) return rmsnorm_backward_as(dx, dweight, dout, x, weight, rstd, NVL_BF16);
  NVL_TRY(need_out_null(op, "dx", dx));
  nvl_tensor w[2], r[1] = {nvl_tensor_null()};
  NVL_TRY(nvl_act_widen(w, acts, 2));
  nvl_status st = rmsnorm_backward_as(&r[0], dweight, &w[0], &w[1], weight, rstd, NVL_F32);
  nvl_act_release(w, 2);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[1] = {dx};
  return nvl_act_round(outs, r, 1);
}

/* ---- RoPE ------------------------------------------------------------------------------------- */

static int positive(double x) { return x > 0.0 && isfinite(x); }

/* The scaling of a rope_tables call, for tables of T rows and head dim D. */
static nvl_status check_rope_scaling(const char *op, const nvl_rope_scaling *s, int64_t T, int64_t D) {
  if ((int)s->kind < 0 || s->kind >= NVL_ROPE_KIND_COUNT)
    return nvl_error(NVL_EINVAL, "%s: unknown scaling kind %d", op, (int)s->kind);
  if (s->kind == NVL_ROPE_DEFAULT) return NVL_OK;
  if (!positive(s->factor)) return nvl_error(NVL_EINVAL, "%s: scaling factor must be > 0, got %g", op, s->factor);
  if (s->kind == NVL_ROPE_LLAMA3) {
    if (!positive(s->low_freq_factor))
      return nvl_error(NVL_EINVAL, "%s: scaling low_freq_factor must be > 0, got %g", op, s->low_freq_factor);
    if (!(s->high_freq_factor > s->low_freq_factor) || !isfinite(s->high_freq_factor))
      return nvl_error(NVL_EINVAL, "%s: scaling high_freq_factor (%g) must be greater than low_freq_factor (%g)", op,
                       s->high_freq_factor, s->low_freq_factor);
    if (!positive(s->original_max_position_embeddings))
      return nvl_error(NVL_EINVAL, "%s: scaling original_max_position_embeddings must be > 0, got %g", op,
                       s->original_max_position_embeddings);
  }
  if (s->kind == NVL_ROPE_DYNAMIC) {
    /* Hugging Face recomputes the frequencies for the longest sequence L seen once L > M, and
     * keeps them for later, shorter ones: beyond M the tables depend on the call history. */
    if (!positive(s->max_position_embeddings))
      return nvl_error(NVL_EINVAL, "%s: dynamic scaling needs max_position_embeddings > 0, got %g", op,
                       s->max_position_embeddings);
    if ((double)T > s->max_position_embeddings)
      return nvl_error(NVL_EINVAL, "%s: dynamic scaling is computed for T <= max_position_embeddings (%g), "
                       "got T = %lld", op, s->max_position_embeddings, (long long)T);
    if (D == 2)
      return nvl_error(NVL_EINVAL, "%s: dynamic scaling needs a head dim D > 2 (its exponent is D / (D - 2))", op);
  }
  return NVL_OK;
}

nvl_status nvl_rope_tables(nvl_tensor *cos_t, nvl_tensor *sin_t, int64_t T, int64_t D, double theta,
                           const nvl_rope_scaling *s) {
  const char *op = "rope_tables";
  NVL_TRY(need_out_null(op, "cos", cos_t));
  NVL_TRY(need_out_null(op, "sin", sin_t));
  if (T < 0) return nvl_error(NVL_EINVAL, "%s: T must be >= 0, got %lld", op, (long long)T);
  if (D < 2 || D % 2)
    return nvl_error(NVL_EINVAL, "%s: the head dim D must be even and >= 2, got %lld", op, (long long)D);
  if (!(theta > 0.0) || !isfinite(theta))
    return nvl_error(NVL_EINVAL, "%s: theta must be a finite number > 0, got %g", op, theta);
  if (s) NVL_TRY(check_rope_scaling(op, s, T, D));
  const nvl_backend *be;
  NVL_PICK_DEV(be, NVL_CPU, layers->rope_tables, op); /* computed on the host, in double */
  int64_t shape[2] = {T, D};
  nvl_tensor c = nvl_tensor_null(), sn = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&c, NVL_F32, NVL_CPU, 2, shape);
  if (st == NVL_OK) st = nvl_tensor_empty(&sn, NVL_F32, NVL_CPU, 2, shape);
  if (st == NVL_OK) st = NVL_CALL(be, &c, layers->rope_tables, nvl_tensor_data(&c), nvl_tensor_data(&sn), T, D, theta, s);
  if (st != NVL_OK) {
    nvl_tensor_release(&c);
    nvl_tensor_release(&sn);
    return st;
  }
  *cos_t = c;
  *sin_t = sn;
  return NVL_OK;
}

/* x (B, T, H, D) and cos, sin (T, D), D even. xn names x ("x" or "dout"). */
static nvl_status check_rope(const char *op, const char *xn, const nvl_tensor *x, const nvl_tensor *c,
                             const nvl_tensor *s, nvl_dtype dt) {
  char s1[160];
  NVL_TRY(check_tensor(op, xn, x, dt));
  NVL_TRY(check_tensor_on(op, "cos", c, NVL_F32, x));
  NVL_TRY(check_tensor_on(op, "sin", s, NVL_F32, x));
  if (x->ndim != 4) return nvl_error(NVL_EINVAL, "%s: %s must be 4-D (B, T, H, D), got %s", op, xn, DESC(x, s1));
  if (x->shape[3] % 2) return nvl_error(NVL_EINVAL, "%s: the head dim D must be even, %s is %s", op, xn, DESC(x, s1));
  if (c->ndim != 2 || c->shape[0] != x->shape[1] || c->shape[1] != x->shape[3])
    return mismatch(op, xn, x, "cos", c, "cos and sin of shape (T, D) matching (B, T, H, D)");
  NVL_TRY(need_same_shape(op, "cos", c, "sin", s));
  return NVL_OK;
}

/* out (or dx) = the rotation (bwd: its transpose) of x (B, T, H, D): one table entry, f32 or the
 * native bf16 one (dt bf16: the caller checked it is there). */
static nvl_status rope_as(nvl_tensor *out, const nvl_tensor *x, const nvl_tensor *cos_t, const nvl_tensor *sin_t,
                          int bwd, nvl_dtype dt) {
  const char *op = bwd ? "rope_backward" : "rope_forward";
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, bwd ? "dx" : "out", out));
  NVL_TRY(check_rope(op, bwd ? "dout" : "x", x, cos_t, sin_t, dt));
  if (dt == NVL_BF16 && bwd) NVL_PICK(be, x, layers->rope_backward_bf16, op);
  else if (dt == NVL_BF16) NVL_PICK(be, x, layers->rope_forward_bf16, op);
  else if (bwd) NVL_PICK(be, x, layers->rope_backward, op);
  else NVL_PICK(be, x, layers->rope_forward, op);
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, dt, x->device, 4, x->shape));
  const int64_t *sh = x->shape;
  void *o = nvl_tensor_data(&r);
  const void *xi = nvl_tensor_data(x), *c = nvl_tensor_data(cos_t), *sn = nvl_tensor_data(sin_t);
  nvl_status st;
  if (dt == NVL_BF16 && bwd) st = NVL_CALL(be, x, layers->rope_backward_bf16, o, xi, c, sn, sh[0], sh[1], sh[2], sh[3]);
  else if (dt == NVL_BF16) st = NVL_CALL(be, x, layers->rope_forward_bf16, o, xi, c, sn, sh[0], sh[1], sh[2], sh[3]);
  else if (bwd) st = NVL_CALL(be, x, layers->rope_backward, o, xi, c, sn, sh[0], sh[1], sh[2], sh[3]);
  else st = NVL_CALL(be, x, layers->rope_forward, o, xi, c, sn, sh[0], sh[1], sh[2], sh[3]);
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *out = r;
  return NVL_OK;
}

/* The rotation of bf16 activations: NUMERICS §11 (act.h). */
static nvl_status rope(nvl_tensor *out, const nvl_tensor *x, const nvl_tensor *cos_t, const nvl_tensor *sin_t, int bwd) {
  const char *op = bwd ? "rope_backward" : "rope_forward";
  const char *names[1] = {bwd ? "dout" : "x"};
  nvl_dtype dt;
  NVL_TRY(nvl_act_dtype(op, names, &x, 1, &dt));
  if (dt == NVL_F32) return rope_as(out, x, cos_t, sin_t, bwd, NVL_F32);
  const nvl_layer_kernels *nat = native_bf16(x);
  if (nat && (bwd ? nat->rope_backward_bf16 : nat->rope_forward_bf16))
    return rope_as(out, x, cos_t, sin_t, bwd, NVL_BF16);
  NVL_TRY(need_out_null(op, bwd ? "dx" : "out", out));
  nvl_tensor w, r[1] = {nvl_tensor_null()};
  NVL_TRY(nvl_act_widen(&w, &x, 1));
  nvl_status st = rope_as(&r[0], &w, cos_t, sin_t, bwd, NVL_F32);
  nvl_tensor_release(&w);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[1] = {out};
  return nvl_act_round(outs, r, 1);
}

nvl_status nvl_rope_forward(nvl_tensor *out, const nvl_tensor *x, const nvl_tensor *cos_t, const nvl_tensor *sin_t) {
  return rope(out, x, cos_t, sin_t, 0);
}

nvl_status nvl_rope_backward(nvl_tensor *dx, const nvl_tensor *dout, const nvl_tensor *cos_t, const nvl_tensor *sin_t) {
  return rope(dx, dout, cos_t, sin_t, 1);
}

/* ---- SwiGLU ----------------------------------------------------------------------------------- */

/* The backend's native bf16 layer entries for tensors like t, or NULL when it has none (then the
 * bf16 op widens: core/act.h). A native entry gives the same bits as the widening. */
static const nvl_layer_kernels *native_bf16(const nvl_tensor *t) {
  const nvl_backend *be = t && t->storage ? nvl_backend_for(t->device, "layers") : NULL;
  return be && be->layers ? be->layers : NULL;
}

/* dt f32: the f32 entry; dt bf16: the native bf16 entry (the caller checked there is one) */
static nvl_status swiglu_forward_as(nvl_tensor *out, const nvl_tensor *gate, const nvl_tensor *up, nvl_dtype dt,
                                    nvl_tensor *amax) {
  const char *op = "swiglu_forward";
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, "out", out));
  NVL_TRY(check_tensor(op, "gate", gate, dt));
  NVL_TRY(check_tensor_on(op, "up", up, dt, gate));
  NVL_TRY(need_same_shape(op, "gate", gate, "up", up));
  nvl_tensor r = nvl_tensor_null();
  nvl_status st;
  if (amax) { /* the bf16 forward with max |out| from the same pass */
    int64_t one = 1;
    NVL_PICK(be, gate, layers->swiglu_forward_bf16_amax, op);
    NVL_TRY(nvl_tensor_empty(amax, NVL_F32, gate->device, 1, &one));
    st = nvl_tensor_empty(&r, dt, gate->device, gate->ndim, gate->shape);
    if (st == NVL_OK)
      st = NVL_CALL(be, gate, layers->swiglu_forward_bf16_amax, nvl_tensor_data(&r), nvl_tensor_data(gate),
                    nvl_tensor_data(up), nvl_tensor_numel(gate), nvl_tensor_data(amax));
    if (st != NVL_OK) nvl_tensor_release(amax);
  } else if (dt == NVL_BF16) {
    NVL_PICK(be, gate, layers->swiglu_forward_bf16, op);
    NVL_TRY(nvl_tensor_empty(&r, dt, gate->device, gate->ndim, gate->shape));
    st = NVL_CALL(be, gate, layers->swiglu_forward_bf16, nvl_tensor_data(&r), nvl_tensor_data(gate),
                  nvl_tensor_data(up), nvl_tensor_numel(gate));
  } else {
    NVL_PICK(be, gate, layers->swiglu_forward, op);
    NVL_TRY(nvl_tensor_empty(&r, dt, gate->device, gate->ndim, gate->shape));
    st = NVL_CALL(be, gate, layers->swiglu_forward, nvl_tensor_data(&r), nvl_tensor_data(gate), nvl_tensor_data(up),
                  nvl_tensor_numel(gate));
  }
  if (st != NVL_OK) {
    nvl_tensor_release(&r);
    return st;
  }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_swiglu_forward(nvl_tensor *out, const nvl_tensor *gate, const nvl_tensor *up) {
  const char *op = "swiglu_forward";
  const char *names[2] = {"gate", "up"};
  const nvl_tensor *acts[2] = {gate, up};
  nvl_dtype dt;
  NVL_TRY(nvl_act_dtype(op, names, acts, 2, &dt));
  const nvl_layer_kernels *nat = dt == NVL_BF16 ? native_bf16(gate) : NULL;
  if (dt == NVL_F32 || (nat && nat->swiglu_forward_bf16)) return swiglu_forward_as(out, gate, up, dt, NULL);
  NVL_TRY(need_out_null(op, "out", out));
  nvl_tensor w[2], r[1] = {nvl_tensor_null()};
  NVL_TRY(nvl_act_widen(w, acts, 2));
  nvl_status st = swiglu_forward_as(&r[0], &w[0], &w[1], NVL_F32, NULL);
  nvl_act_release(w, 2);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[1] = {out};
  return nvl_act_round(outs, r, 1);
}

/* The forwards with the amax of their output (core/layers.h): fused where the backend offers it
 * for bf16 activations, else the forward then the amax (core/quant.h nvl_quant_amax). */
nvl_status nvl_rmsnorm_forward_amax(nvl_tensor *out, nvl_tensor *rstd, nvl_tensor *amax, const nvl_tensor *x,
                                    const nvl_tensor *weight, double eps) {
  const char *names[1] = {"x"};
  nvl_dtype dt;
  NVL_TRY(need_out_null("rmsnorm_forward", "amax", amax));
  NVL_TRY(nvl_act_dtype("rmsnorm_forward", names, &x, 1, &dt));
  const nvl_layer_kernels *nat = dt == NVL_BF16 ? native_bf16(x) : NULL;
  if (nat && nat->rmsnorm_forward_bf16_amax) return rmsnorm_forward_as(out, rstd, x, weight, eps, NVL_BF16, amax);
  NVL_TRY(nvl_rmsnorm_forward(out, rstd, x, weight, eps));
  nvl_status st = nvl_quant_amax(amax, out, -1, 0);
  if (st != NVL_OK) {
    nvl_tensor_release(out);
    nvl_tensor_release(rstd);
  }
  return st;
}

nvl_status nvl_swiglu_forward_amax(nvl_tensor *out, nvl_tensor *amax, const nvl_tensor *gate, const nvl_tensor *up) {
  const char *names[2] = {"gate", "up"};
  const nvl_tensor *acts[2] = {gate, up};
  nvl_dtype dt;
  NVL_TRY(need_out_null("swiglu_forward", "amax", amax));
  NVL_TRY(nvl_act_dtype("swiglu_forward", names, acts, 2, &dt));
  const nvl_layer_kernels *nat = dt == NVL_BF16 ? native_bf16(gate) : NULL;
  if (nat && nat->swiglu_forward_bf16_amax) return swiglu_forward_as(out, gate, up, NVL_BF16, amax);
  NVL_TRY(nvl_swiglu_forward(out, gate, up));
  nvl_status st = nvl_quant_amax(amax, out, -1, 0);
  if (st != NVL_OK) nvl_tensor_release(out);
  return st;
}

static nvl_status swiglu_backward_as(nvl_tensor *dgate, nvl_tensor *dup, const nvl_tensor *dout,
                                     const nvl_tensor *gate, const nvl_tensor *up, nvl_dtype dt) {
  const char *op = "swiglu_backward";
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, "dgate", dgate));
  NVL_TRY(need_out_null(op, "dup", dup));
  NVL_TRY(check_tensor(op, "dout", dout, dt));
  NVL_TRY(check_tensor_on(op, "gate", gate, dt, dout));
  NVL_TRY(check_tensor_on(op, "up", up, dt, dout));
  NVL_TRY(need_same_shape(op, "gate", gate, "up", up));
  NVL_TRY(need_same_shape(op, "dout", dout, "gate", gate));
  if (dt == NVL_BF16) NVL_PICK(be, dout, layers->swiglu_backward_bf16, op);
  else NVL_PICK(be, dout, layers->swiglu_backward, op);
  nvl_tensor g = nvl_tensor_null(), u = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&g, dt, dout->device, gate->ndim, gate->shape);
  if (st == NVL_OK) st = nvl_tensor_empty(&u, dt, dout->device, gate->ndim, gate->shape);
  if (st == NVL_OK && dt == NVL_BF16)
    st = NVL_CALL(be, dout, layers->swiglu_backward_bf16, nvl_tensor_data(&g), nvl_tensor_data(&u),
                  nvl_tensor_data(dout), nvl_tensor_data(gate), nvl_tensor_data(up), nvl_tensor_numel(gate));
  else if (st == NVL_OK)
    st = NVL_CALL(be, dout, layers->swiglu_backward, nvl_tensor_data(&g), nvl_tensor_data(&u), nvl_tensor_data(dout),
                  nvl_tensor_data(gate), nvl_tensor_data(up), nvl_tensor_numel(gate));
  if (st != NVL_OK) {
    nvl_tensor_release(&g);
    nvl_tensor_release(&u);
    return st;
  }
  *dgate = g;
  *dup = u;
  return NVL_OK;
}

nvl_status nvl_swiglu_backward(nvl_tensor *dgate, nvl_tensor *dup, const nvl_tensor *dout, const nvl_tensor *gate,
                               const nvl_tensor *up) {
  const char *op = "swiglu_backward";
  const char *names[3] = {"dout", "gate", "up"};
  const nvl_tensor *acts[3] = {dout, gate, up};
  nvl_dtype dt;
  NVL_TRY(nvl_act_dtype(op, names, acts, 3, &dt));
  const nvl_layer_kernels *nat = dt == NVL_BF16 ? native_bf16(dout) : NULL;
  if (dt == NVL_F32 || (nat && nat->swiglu_backward_bf16)) return swiglu_backward_as(dgate, dup, dout, gate, up, dt);
  NVL_TRY(need_out_null(op, "dgate", dgate));
  NVL_TRY(need_out_null(op, "dup", dup));
  nvl_tensor w[3], r[2] = {nvl_tensor_null(), nvl_tensor_null()};
  NVL_TRY(nvl_act_widen(w, acts, 3));
  nvl_status st = swiglu_backward_as(&r[0], &r[1], &w[0], &w[1], &w[2], NVL_F32);
  nvl_act_release(w, 3);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[2] = {dgate, dup};
  return nvl_act_round(outs, r, 2);
}

/* ---- fused softmax cross-entropy -------------------------------------------------------------- */

nvl_status nvl_cross_entropy(double *loss, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *logits,
                             const nvl_tensor *targets, int64_t ignore_index, double z_loss, double dloss_scale) {
  return nvl_cross_entropy_of(loss, count, dlogits, logits, targets, ignore_index, z_loss, dloss_scale, 0, NVL_F32);
}

static nvl_status cross_entropy_impl(double *loss, nvl_tensor *sum_out, int64_t *count, nvl_tensor *dlogits,
                                     const nvl_tensor *logits, const nvl_tensor *targets_in, int64_t ignore_index,
                                     double z_loss, double dloss_scale, int64_t of_count, nvl_dtype grad_dtype);

nvl_status nvl_cross_entropy_of(double *loss, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *logits,
                                const nvl_tensor *targets_in, int64_t ignore_index, double z_loss, double dloss_scale,
                                int64_t of_count, nvl_dtype grad_dtype) {
  return cross_entropy_impl(loss, NULL, count, dlogits, logits, targets_in, ignore_index, z_loss, dloss_scale, of_count,
                            grad_dtype);
}

nvl_status nvl_cross_entropy_sum(nvl_tensor *sum_out, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *logits,
                                 const nvl_tensor *targets_in, int64_t ignore_index, double z_loss, double dloss_scale,
                                 int64_t of_count, nvl_dtype grad_dtype) {
  double loss;
  if (!sum_out) return nvl_error(NVL_EINVAL, "cross_entropy: sum_out must not be NULL");
  NVL_TRY(need_out_null("cross_entropy", "sum", sum_out));
  return cross_entropy_impl(&loss, sum_out, count, dlogits, logits, targets_in, ignore_index, z_loss, dloss_scale,
                            of_count, grad_dtype);
}

static nvl_status cross_entropy_impl(double *loss, nvl_tensor *sum_out, int64_t *count, nvl_tensor *dlogits,
                                     const nvl_tensor *logits, const nvl_tensor *targets_in, int64_t ignore_index,
                                     double z_loss, double dloss_scale, int64_t of_count, nvl_dtype grad_dtype) {
  const char *op = "cross_entropy";
  char s1[160];
  const nvl_backend *be;
  if (!loss || !count) return nvl_error(NVL_EINVAL, "%s: loss and count must not be NULL", op);
  if (of_count < 0) return nvl_error(NVL_EINVAL, "%s: of_count must be positive (0: this call's count), got %lld", op,
                                     (long long)of_count);
  if (dlogits) NVL_TRY(need_out_null(op, "dlogits", dlogits));
  if (logits && logits->storage && logits->dtype == NVL_BF16) NVL_TRY(check_tensor(op, "logits", logits, NVL_BF16));
  else NVL_TRY(check_tensor(op, "logits", logits, NVL_F32));
  if (logits->ndim < 1 || logits->shape[logits->ndim - 1] < 1)
    return nvl_error(NVL_EINVAL, "%s: logits must be (N, V) with V >= 1, got %s", op, DESC(logits, s1));
  if (!isfinite(z_loss)) return nvl_error(NVL_EINVAL, "%s: z_loss must be finite, got %g", op, z_loss);
  if (!isfinite(dloss_scale))
    return nvl_error(NVL_EINVAL, "%s: the gradient scale must be finite, got %g", op, dloss_scale);
  if (grad_dtype != NVL_F32 && grad_dtype != NVL_BF16)
    return nvl_error(NVL_EINVAL, "%s: the gradient is f32 or bf16, got %s", op,
                     grad_dtype >= 0 && grad_dtype < NVL_DTYPE_COUNT ? nvl_dtypes[grad_dtype].name : "?");
  NVL_PICK(be, logits, layers->cross_entropy, op);
  /* bf16 dlogits straight from the kernel where this backend writes them (no f32 copy), else the
   * f32 entry's rounded once below */
  const int native16 = dlogits && grad_dtype == NVL_BF16 && be->layers->cross_entropy_bf16grad;
  nvl_tensor targets = nvl_tensor_null(), tgd = nvl_tensor_null(), d = nvl_tensor_null();
  NVL_TRY(ids_on(op, "targets", targets_in, logits, &targets, &tgd));
  int64_t V = logits->shape[logits->ndim - 1], N = nvl_tensor_numel(&targets);
  const int64_t *tg = nvl_tensor_data(&targets);
  nvl_status st = NVL_OK;
  if (!is_leading_shape(logits, &targets))
    st = mismatch(op, "logits", logits, "targets", &targets, "targets of logits' shape without its last dim (N)");
  if (st == NVL_OK) st = check_ids(op, "target", tg, N, V, 1, ignore_index);
  int64_t cnt = 0;
  for (int64_t n = 0; st == NVL_OK && n < N; n++) cnt += tg[n] != ignore_index;
  if (st == NVL_OK && of_count && cnt > of_count)
    st = nvl_error(NVL_EINVAL, "%s: this slice counts %lld tokens, more than the of_count %lld of its batch", op,
                   (long long)cnt, (long long)of_count);
  const int64_t denom = of_count ? of_count : cnt;
  double gscale = denom ? dloss_scale / (double)denom : 0.0, total = 0.0;
  if (st == NVL_OK && dlogits)
    st = nvl_tensor_empty(&d, native16 ? NVL_BF16 : NVL_F32, logits->device, logits->ndim, logits->shape);
  nvl_tensor sum = nvl_tensor_null();
  int64_t one = 1;
  if (st == NVL_OK && sum_out) st = nvl_tensor_empty(&sum, NVL_I64, logits->device, 1, &one);
  /* sum's data only once it exists: a failed check above leaves it a null tensor (no storage) */
  double *tp = st == NVL_OK && sum_out ? (double *)nvl_tensor_data(&sum) : &total;
  if (st == NVL_OK && native16) /* bf16 logits are read as they are (the CPU widens them exactly first) */
    st = NVL_CALL(be, logits, layers->cross_entropy_bf16grad, tp, sum_out != NULL, nvl_tensor_data(&d),
                  nvl_tensor_data(logits), logits->dtype, nvl_tensor_data(&tgd), N, V, ignore_index, z_loss, gscale);
  else if (st == NVL_OK)
    st = NVL_CALL(be, logits, layers->cross_entropy, tp, sum_out != NULL, dlogits ? nvl_tensor_data(&d) : NULL,
                  nvl_tensor_data(logits), logits->dtype, nvl_tensor_data(&tgd), N, V, ignore_index, z_loss, gscale);
  if (st == NVL_OK && dlogits && grad_dtype == NVL_BF16 && !native16) { /* f32 -> bf16, rounded once */
    nvl_tensor r = nvl_tensor_null();
    st = nvl_tensor_clone_to(&r, &d, NVL_BF16, d.device);
    nvl_tensor_release(&d);
    d = r;
  }
  if (st == NVL_OK) {
    *loss = sum_out ? NAN : denom ? total / (double)denom : 0.0;
    *count = cnt;
    if (dlogits) *dlogits = d;
    if (sum_out) *sum_out = sum;
  } else {
    nvl_tensor_release(&d);
    nvl_tensor_release(&sum);
  }
  nvl_tensor_release(&targets);
  nvl_tensor_release(&tgd);
  return st;
}

/* ---- optimizer -------------------------------------------------------------------------------- */

nvl_status nvl_adamw_step(nvl_tensor *param, const nvl_tensor *grad, nvl_tensor *m, nvl_tensor *v,
                          const nvl_adamw_opts *o) {
  const char *op = "adamw_step";
  const nvl_backend *be;
  NVL_TRY(check_tensor(op, "param", param, NVL_F32));
  NVL_TRY(check_tensor_on(op, "grad", grad, NVL_F32, param));
  NVL_TRY(check_tensor_on(op, "m", m, NVL_F32, param));
  NVL_TRY(check_tensor_on(op, "v", v, NVL_F32, param));
  NVL_TRY(need_same_shape(op, "param", param, "grad", grad));
  NVL_TRY(need_same_shape(op, "param", param, "m", m));
  NVL_TRY(need_same_shape(op, "param", param, "v", v));
  NVL_TRY(nvl_adamw_opts_check(op, o));
  int64_t n = nvl_tensor_numel(param);
  const nvl_tensor *ts[4] = {param, grad, m, v};
  const char *names[4] = {"param", "grad", "m", "v"};
  for (int i = 0; i < 4; i++) /* views of one flat buffer are fine; overlapping ones are not */
    for (int j = i + 1; j < 4; j++)
      if (n > 0 && overlap(ts[i], ts[j], n))
        return nvl_error(NVL_EINVAL, "%s: %s and %s overlap in memory; they must be separate tensors", op, names[i],
                         names[j]);
  NVL_PICK(be, param, layers->adamw_step, op);
  return NVL_CALL(be, param, layers->adamw_step, nvl_tensor_data(param), nvl_tensor_data(grad), nvl_tensor_data(m),
                  nvl_tensor_data(v), n, o);
}

nvl_status nvl_amax_history_step(nvl_tensor *sel_out, nvl_tensor *hist, int64_t count, int64_t pos,
                                 const nvl_tensor *cur) {
  const char *op = "amax_history_step";
  char s1[160];
  const nvl_backend *be;
  NVL_TRY(need_out_null(op, "sel", sel_out));
  NVL_TRY(check_tensor(op, "hist", hist, NVL_F32));
  NVL_TRY(check_tensor_on(op, "cur", cur, NVL_F32, hist));
  int64_t len = nvl_tensor_numel(hist) - 1;
  if (hist->ndim != 1 || len < 1)
    return nvl_error(NVL_EINVAL, "%s: hist must be 1-D of length len + 1 >= 2, got %s", op, DESC(hist, s1));
  if (nvl_tensor_numel(cur) != 1) return nvl_error(NVL_EINVAL, "%s: cur must hold one value, got %s", op, DESC(cur, s1));
  if (count < 0 || count > len || pos < 0 || pos >= len)
    return nvl_error(NVL_EINVAL, "%s: count %lld must be in [0, %lld] and pos %lld in [0, %lld)", op, (long long)count,
                     (long long)len, (long long)pos, (long long)len);
  NVL_PICK(be, hist, layers->amax_history, op);
  int64_t one = 1;
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, NVL_F32, hist->device, 1, &one));
  nvl_status st = NVL_CALL(be, hist, layers->amax_history, nvl_tensor_data(&r), nvl_tensor_data(hist), len, count, pos,
                           nvl_tensor_data(cur));
  if (st == NVL_OK) *sel_out = r;
  else nvl_tensor_release(&r);
  return st;
}

nvl_status nvl_distill_loss(double *kl, double *ce, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *s,
                            const nvl_tensor *t, const nvl_tensor *targets_in, int64_t ignore_index, double T, double alpha,
                            double dscale, int64_t of_count) {
  const char *op = "distill_loss";
  char s1[160], s2[160];
  const nvl_backend *be;
  if (!kl || !ce || !count) return nvl_error(NVL_EINVAL, "%s: kl, ce and count must not be NULL", op);
  if (dlogits) NVL_TRY(need_out_null(op, "dlogits", dlogits));
  NVL_TRY(check_tensor(op, "student logits", s, s && s->storage && s->dtype == NVL_BF16 ? NVL_BF16 : NVL_F32));
  NVL_TRY(check_tensor(op, "teacher logits", t, t && t->storage && t->dtype == NVL_BF16 ? NVL_BF16 : NVL_F32));
  if (s->ndim != 2 || t->ndim != 2 || s->shape[0] != t->shape[0] || s->shape[1] != t->shape[1] || s->device != t->device)
    return nvl_error(NVL_EINVAL, "%s: the student's and the teacher's logits must be (N, V) of one shape on one device: "
                     "%s, %s", op, DESC(s, s1), DESC(t, s2));
  if (!(T > 0.0) || !isfinite(T)) return nvl_error(NVL_EINVAL, "%s: the temperature must be > 0, got %g", op, T);
  if (!(alpha >= 0.0 && alpha <= 1.0)) return nvl_error(NVL_EINVAL, "%s: alpha must be in [0, 1], got %g", op, alpha);
  if (!isfinite(dscale)) return nvl_error(NVL_EINVAL, "%s: the gradient scale must be finite, got %g", op, dscale);
  if (of_count < 0) return nvl_error(NVL_EINVAL, "%s: of_count must be >= 0, got %lld", op, (long long)of_count);
  NVL_PICK(be, s, layers->distill, op);
  nvl_tensor targets = nvl_tensor_null(), tgd = nvl_tensor_null(), d = nvl_tensor_null();
  NVL_TRY(ids_on(op, "targets", targets_in, s, &targets, &tgd));
  const int64_t N = s->shape[0], V = s->shape[1];
  const int64_t *tg = nvl_tensor_data(&targets);
  nvl_status st = NVL_OK;
  if (nvl_tensor_numel(&targets) != N)
    st = mismatch(op, "logits", s, "targets", &targets, "N targets for the logits' N rows");
  if (st == NVL_OK) st = check_ids(op, "target", tg, N, V, 1, ignore_index);
  int64_t cnt = 0;
  for (int64_t n = 0; st == NVL_OK && n < N; n++) cnt += tg[n] != ignore_index;
  const int64_t denom = of_count ? of_count : cnt;
  double klsum = 0.0, cesum = 0.0;
  if (st == NVL_OK && dlogits) st = nvl_tensor_empty(&d, NVL_F32, s->device, 2, s->shape);
  if (st == NVL_OK)
    st = NVL_CALL(be, s, layers->distill, &klsum, &cesum, dlogits ? nvl_tensor_data(&d) : NULL, nvl_tensor_data(s),
                  s->dtype, nvl_tensor_data(t), t->dtype, nvl_tensor_data(&tgd), N, V, ignore_index, T, alpha,
                  denom ? dscale / (double)denom : 0.0);
  if (st == NVL_OK) {
    *kl = denom ? klsum / (double)denom : 0.0;
    *ce = denom ? cesum / (double)denom : 0.0;
    *count = cnt;
    if (dlogits) *dlogits = d;
  } else {
    nvl_tensor_release(&d);
  }
  nvl_tensor_release(&targets);
  nvl_tensor_release(&tgd);
  return st;
}

nvl_status nvl_block_sqerr(nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b, int64_t block) {
  const char *op = "block_sqerr";
  char s1[160], s2[160];
  const nvl_backend *be;
  if (!out || !a) return nvl_error(NVL_EINVAL, "%s: out and a must not be NULL", op);
  NVL_TRY(nvl_tensor_check_live(a, op));
  if (b) NVL_TRY(nvl_tensor_check_live(b, op));
  if (a->dtype != NVL_F32 || a->ndim != 2) return nvl_error(NVL_EINVAL, "%s: a must be a 2-D f32 tensor, got %s", op, DESC(a, s1));
  if (b && (b->dtype != NVL_F32 || b->ndim != 2 || b->shape[0] != a->shape[0] || b->shape[1] != a->shape[1] ||
            b->device != a->device))
    return nvl_error(NVL_EINVAL, "%s: b must be an f32 tensor of a's shape on a's device: a %s, b %s", op, DESC(a, s1),
                     DESC(b, s2));
  const int64_t rows = a->shape[0], K = a->shape[1];
  if (block < 1 || K % block != 0)
    return nvl_error(NVL_EINVAL, "%s: block %lld must divide the last dim (%lld)", op, (long long)block, (long long)K);
  NVL_PICK(be, a, layers->block_sqerr, op);
  nvl_tensor ca = nvl_tensor_null(), cb = nvl_tensor_null(), r = nvl_tensor_null();
  int64_t shape[2] = {rows, K / block};
  nvl_status st = nvl_tensor_contiguous(&ca, a);
  if (st == NVL_OK && b) st = nvl_tensor_contiguous(&cb, b);
  if (st == NVL_OK) st = nvl_tensor_empty(&r, NVL_F32, a->device, 2, shape);
  if (st == NVL_OK)
    st = NVL_CALL(be, a, layers->block_sqerr, nvl_tensor_data(&r), nvl_tensor_data(&ca), b ? nvl_tensor_data(&cb) : NULL,
                  rows, K, block);
  nvl_tensor_release(&ca);
  nvl_tensor_release(&cb);
  if (st == NVL_OK) *out = r;
  else nvl_tensor_release(&r);
  return st;
}

nvl_status nvl_sumsq(double *out, const nvl_tensor *t) {
  const char *op = "sumsq";
  char s1[160];
  const nvl_backend *be;
  if (!out) return nvl_error(NVL_EINVAL, "%s: out must not be NULL", op);
  if (!t) return nvl_error(NVL_EINVAL, "%s: the tensor is missing (NULL)", op);
  NVL_TRY(nvl_tensor_check_live(t, op));
  if (t->dtype != NVL_F32 && t->dtype != NVL_BF16)
    return nvl_error(NVL_EINVAL, "%s: the tensor must be f32 or bf16, got %s", op, DESC(t, s1));
  NVL_PICK(be, t, layers->sumsq, op);
  nvl_tensor c = nvl_tensor_null(); /* strided views are gathered first */
  NVL_TRY(nvl_tensor_contiguous(&c, t));
  nvl_status st = NVL_CALL(be, &c, layers->sumsq, out, nvl_tensor_data(&c), c.dtype, nvl_tensor_numel(&c));
  nvl_tensor_release(&c);
  return st;
}
