/* act.h: bf16 activations for the layer ops (core-private; core/NUMERICS.md §11). A layer op whose
 * activation tensors (x, dout, gate, up, q, k, v, out) are bf16 widens them exactly to f32, runs
 * its f32 form on the copies — the f32 kernels, unchanged, on any device — and rounds each
 * activation output (out, dx, dgate, dup, dq, dk, dv) once to bf16 (RNE). Parameters, parameter
 * gradients and the saved statistics (rstd, lse) stay f32. So a bf16 op is, bit for bit, its f32
 * op on the widened inputs followed by one rounding, on every backend.
 * Used by core/layers.c and core/attention.c. Not here: the kernels. */
#ifndef NVL_ACT_H
#define NVL_ACT_H
#include "tensor.h"

/* The dtype of an op's activations t[0..n) (named names[i]): f32 or bf16, one for all. A missing
 * or freed tensor is left to the op's own checks (it counts as f32 here). */
static inline nvl_status nvl_act_dtype(const char *op, const char *const *names, const nvl_tensor *const *t, int n,
                                       nvl_dtype *dt) {
  char s1[160], s2[160];
  int first = -1;
  *dt = NVL_F32;
  for (int i = 0; i < n; i++) {
    if (!t[i] || !t[i]->storage) continue;
    if (t[i]->dtype != NVL_F32 && t[i]->dtype != NVL_BF16)
      return nvl_error(NVL_EINVAL, "%s: %s must be f32 or bf16, got %s", op, names[i],
                       nvl_tensor_desc(t[i], s1, sizeof s1));
    if (first < 0) {
      first = i;
      *dt = t[i]->dtype;
    } else if (t[i]->dtype != *dt) {
      return nvl_error(NVL_EINVAL, "%s: %s is %s but %s is %s; the activations of one call must share a dtype "
                       "(f32, or bf16: act_dtype)", op, names[first], nvl_tensor_desc(t[first], s1, sizeof s1),
                       names[i], nvl_tensor_desc(t[i], s2, sizeof s2));
    }
  }
  return NVL_OK;
}

/* w[i] = t[i] widened exactly to f32 on its device (a share when it is f32 or missing); on an
 * error nothing is left allocated. */
static inline nvl_status nvl_act_widen(nvl_tensor *w, const nvl_tensor *const *t, int n) {
  for (int i = 0; i < n; i++) w[i] = nvl_tensor_null();
  for (int i = 0; i < n; i++) {
    if (!t[i] || !t[i]->storage || t[i]->dtype != NVL_BF16) {
      if (t[i]) nvl_tensor_share(&w[i], t[i]);
      continue;
    }
    nvl_status st = nvl_tensor_clone_to(&w[i], t[i], NVL_F32, t[i]->device);
    if (st != NVL_OK) {
      for (int j = 0; j < i; j++) nvl_tensor_release(&w[j]);
      return st;
    }
  }
  return NVL_OK;
}

static inline void nvl_act_release(nvl_tensor *w, int n) {
  for (int i = 0; i < n; i++) nvl_tensor_release(&w[i]);
}

/* out[i] = f[i] rounded once to bf16 (RNE) on its device; f[0..n) (f32, owned) are released. On
 * an error nothing is written to out and nothing is left allocated. */
static inline nvl_status nvl_act_round(nvl_tensor *const *out, nvl_tensor *f, int n) {
  nvl_tensor r[8];
  nvl_status st = NVL_OK;
  int done = 0;
  for (; done < n && st == NVL_OK; done++) {
    r[done] = nvl_tensor_null();
    st = nvl_tensor_clone_to(&r[done], &f[done], NVL_BF16, f[done].device);
  }
  nvl_act_release(f, n);
  if (st != NVL_OK) {
    nvl_act_release(r, done);
    return st;
  }
  for (int i = 0; i < n; i++) *out[i] = r[i];
  return NVL_OK;
}
#endif
