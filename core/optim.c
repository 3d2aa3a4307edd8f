/* optim.c: validation and dispatch of the multi-tensor optimizer ops (core/optim.h). Each entry
 * checks every tensor (live, f32, contiguous, one device, shapes) and fails with a message naming
 * the op, the tensor's index (1-based, as Lua counts) and its shape before anything is written, then
 * makes one call of the device's table with a host array of (pointer, length) rows.
 * Not here: the kernels (layers_ref.c, layers_cpu.c, kernels/cuda/multi_tensor.cu), Lua. */
#include <math.h>
#include <stdlib.h>

#include "dispatch.h"
#include "optim.h"

#define DESC(t, buf) nvl_tensor_desc((t), (buf), sizeof(buf))

/* t: live, f32, contiguous, on like's device (like NULL: any), of like_shape's shape (NULL: any). */
static nvl_status check_one(const char *op, const char *name, int64_t j, const nvl_tensor *t, const nvl_tensor *like,
                            const nvl_tensor *like_shape) {
  char s1[160], s2[160];
  if (!t) return nvl_error(NVL_EINVAL, "%s: %s #%lld is missing (NULL)", op, name, (long long)j + 1);
  if (!t->storage) return nvl_error(NVL_ESTATE, "%s: %s #%lld has been freed", op, name, (long long)j + 1);
  if (t->dtype != NVL_F32 || !nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "%s: %s #%lld must be a contiguous f32 tensor, got %s", op, name, (long long)j + 1,
                     DESC(t, s1));
  if (like && !nvl_tensor_same_device(t, like))
    return nvl_error(NVL_EINVAL, "%s: %s #%lld is %s but the first tensor is %s; every tensor must be on one device",
                     op, name, (long long)j + 1, DESC(t, s1), DESC(like, s2));
  if (like_shape) {
    int same = t->ndim == like_shape->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == like_shape->shape[d];
    if (!same)
      return nvl_error(NVL_EINVAL, "%s: %s #%lld is %s but param #%lld is %s; expected the same shape", op, name,
                       (long long)j + 1, DESC(t, s1), (long long)j + 1, DESC(like_shape, s2));
  }
  return NVL_OK;
}

/* Contiguous a and b of n elements share memory. */
static int overlap(const nvl_tensor *a, const nvl_tensor *b, int64_t n) {
  if (a->storage != b->storage) return 0;
  return a->offset < b->offset + n && b->offset < a->offset + n;
}

static nvl_status check_state(const char *op, const nvl_tensor *state, const nvl_tensor *like) {
  char s1[160], s2[160];
  if (!state->storage) return nvl_error(NVL_ESTATE, "%s: the norm state has been freed", op);
  if (state->dtype != NVL_I64 || !nvl_tensor_is_contiguous(state) || nvl_tensor_numel(state) != NVL_NORM_STATE)
    return nvl_error(NVL_EINVAL, "%s: the norm state must be a contiguous i64 tensor of %d elements, got %s", op,
                     NVL_NORM_STATE, DESC(state, s1));
  if (like && !nvl_tensor_same_device(state, like))
    return nvl_error(NVL_EINVAL, "%s: the norm state is %s but the tensors are %s; it must be on their device", op,
                     DESC(state, s1), DESC(like, s2));
  return NVL_OK;
}

nvl_status nvl_adamw_opts_check(const char *op, const nvl_adamw_opts *o) {
  if (!o) return nvl_error(NVL_EINVAL, "%s: options are missing (NULL)", op);
  if (!(o->lr >= 0.0) || !isfinite(o->lr))
    return nvl_error(NVL_EINVAL, "%s: lr must be a finite number >= 0, got %g", op, o->lr);
  if (!(o->beta1 >= 0.0 && o->beta1 < 1.0))
    return nvl_error(NVL_EINVAL, "%s: beta1 must be in [0, 1), got %g", op, o->beta1);
  if (!(o->beta2 >= 0.0 && o->beta2 < 1.0))
    return nvl_error(NVL_EINVAL, "%s: beta2 must be in [0, 1), got %g", op, o->beta2);
  if (!(o->eps >= 0.0) || !isfinite(o->eps))
    return nvl_error(NVL_EINVAL, "%s: eps must be a finite number >= 0, got %g", op, o->eps);
  if (!(o->weight_decay >= 0.0) || !isfinite(o->weight_decay))
    return nvl_error(NVL_EINVAL, "%s: weight_decay must be a finite number >= 0, got %g", op, o->weight_decay);
  if (o->step < 1)
    return nvl_error(NVL_EINVAL, "%s: step must be an integer >= 1 (1-based), got %lld", op, (long long)o->step);
  return NVL_OK;
}

nvl_status nvl_adamw_multi(nvl_tensor *const *params, nvl_tensor *const *grads, nvl_tensor *const *m,
                           nvl_tensor *const *v, const int *no_decay, int64_t count, const nvl_adamw_opts *o,
                           const nvl_tensor *state) {
  const char *op = "adamw_multi";
  const nvl_backend *be;
  NVL_TRY(nvl_adamw_opts_check(op, o));
  if (count < 0) return nvl_error(NVL_EINVAL, "%s: count must be >= 0, got %lld", op, (long long)count);
  if (count == 0) return NVL_OK;
  const nvl_tensor *first = params[0];
  for (int64_t j = 0; j < count; j++) {
    NVL_TRY(check_one(op, "param", j, params[j], j ? first : NULL, NULL));
    NVL_TRY(check_one(op, "grad", j, grads[j], first, params[j]));
    NVL_TRY(check_one(op, "m", j, m[j], first, params[j]));
    NVL_TRY(check_one(op, "v", j, v[j], first, params[j]));
    const nvl_tensor *ts[4] = {params[j], grads[j], m[j], v[j]};
    const char *names[4] = {"param", "grad", "m", "v"};
    int64_t n = nvl_tensor_numel(params[j]);
    for (int a = 0; a < 4; a++)
      for (int b = a + 1; b < 4; b++)
        if (n > 0 && overlap(ts[a], ts[b], n))
          return nvl_error(NVL_EINVAL, "%s: %s #%lld and %s #%lld overlap in memory; they must be separate tensors",
                           op, names[a], (long long)j + 1, names[b], (long long)j + 1);
  }
  if (state) NVL_TRY(check_state(op, state, first));
  NVL_PICK(be, first, layers->adamw_multi, op);
  nvl_adamw_chunk *t = malloc((size_t)count * sizeof *t);
  if (!t) return nvl_error(NVL_ENOMEM, "%s: out of host memory for %lld rows", op, (long long)count);
  int64_t k = 0;
  for (int64_t j = 0; j < count; j++) {
    int64_t n = nvl_tensor_numel(params[j]);
    if (n == 0) continue;
    t[k++] = (nvl_adamw_chunk){.param = nvl_tensor_data(params[j]), .grad = nvl_tensor_data(grads[j]),
                               .m = nvl_tensor_data(m[j]), .v = nvl_tensor_data(v[j]), .n = n,
                               .no_decay = no_decay ? no_decay[j] != 0 : 0};
  }
  nvl_status st = k == 0 ? NVL_OK
                         : NVL_CALL(be, first, layers->adamw_multi, t, k, o,
                                    state ? (const int64_t *)nvl_tensor_data((nvl_tensor *)state) : NULL);
  free(t);
  return st;
}

nvl_status nvl_grad_norm_multi(nvl_tensor *state, nvl_tensor *const *grads, int64_t count, double max_norm,
                               int take_nonfinite) {
  const char *op = "grad_norm_multi";
  const nvl_backend *be;
  if (!state) return nvl_error(NVL_EINVAL, "%s: the norm state is missing (NULL)", op);
  if (!(max_norm > 0.0) || !isfinite(max_norm))
    return nvl_error(NVL_EINVAL, "%s: max_norm must be a finite number > 0, got %g", op, max_norm);
  if (count < 0) return nvl_error(NVL_EINVAL, "%s: count must be >= 0, got %lld", op, (long long)count);
  for (int64_t j = 0; j < count; j++) NVL_TRY(check_one(op, "grad", j, grads[j], j ? grads[0] : NULL, NULL));
  NVL_TRY(check_state(op, state, count ? grads[0] : NULL));
  NVL_PICK(be, state, layers->grad_norm_multi, op);
  const float **x = malloc((size_t)(count ? count : 1) * sizeof *x);
  int64_t *n = malloc((size_t)(count ? count : 1) * sizeof *n);
  if (!x || !n) {
    free(x);
    free(n);
    return nvl_error(NVL_ENOMEM, "%s: out of host memory for %lld rows", op, (long long)count);
  }
  int64_t k = 0;
  for (int64_t j = 0; j < count; j++) {
    int64_t nj = nvl_tensor_numel(grads[j]);
    if (nj == 0) continue;
    x[k] = nvl_tensor_data(grads[j]);
    n[k++] = nj;
  }
  nvl_status st = NVL_CALL(be, state, layers->grad_norm_multi, nvl_tensor_data(state), x, n, k, max_norm,
                           take_nonfinite);
  free(x);
  free(n);
  return st;
}

nvl_status nvl_grad_norm_combine(nvl_tensor *state, const nvl_tensor *parts, double max_norm) {
  const char *op = "grad_norm_combine";
  const nvl_backend *be;
  char s1[160];
  if (!state || !parts) return nvl_error(NVL_EINVAL, "%s: state and parts must not be NULL", op);
  if (!(max_norm > 0.0) || !isfinite(max_norm))
    return nvl_error(NVL_EINVAL, "%s: max_norm must be a finite number > 0, got %g", op, max_norm);
  NVL_TRY(nvl_tensor_check_live(parts, op));
  NVL_TRY(check_state(op, state, parts));
  if (parts->dtype != NVL_I64 || !nvl_tensor_is_contiguous(parts) || nvl_tensor_numel(parts) % NVL_NORM_STATE != 0 ||
      nvl_tensor_numel(parts) == 0)
    return nvl_error(NVL_EINVAL, "%s: parts must be a contiguous i64 tensor of norm states (%d elements each), got %s",
                     op, NVL_NORM_STATE, DESC(parts, s1));
  NVL_PICK(be, state, layers->grad_norm_combine, op);
  return NVL_CALL(be, state, layers->grad_norm_combine, nvl_tensor_data(state), nvl_tensor_data(parts),
                  nvl_tensor_numel(parts) / NVL_NORM_STATE, max_norm);
}

nvl_status nvl_nonfinite_take(const nvl_tensor *like, uint32_t *flags) {
  const char *op = "nonfinite_take";
  const nvl_backend *be;
  if (!like || !flags) return nvl_error(NVL_EINVAL, "%s: like and flags must not be NULL", op);
  NVL_TRY(nvl_tensor_check_live(like, op));
  NVL_PICK(be, like, layers->nonfinite_take, op);
  *flags = 0;
  return NVL_CALL(be, like, layers->nonfinite_take, flags);
}
