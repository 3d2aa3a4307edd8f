/* attention.c: causal grouped-query attention — validation, allocation, the route and dispatch for
 * nvl_attention_forward / nvl_attention_backward, and nvl_attention_forward_at over a KV cache (contract in
 * layers.h; kernels in
 * kernels/cpu/attention_cpu.h and kernels/cpu/ref/attention_ref.h).
 * q, out, dq, dout (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T); all f32,
 * contiguous, all on one device (q's) — or the activations all bf16 (lse f32): then the f32 op
 * runs on exact f32 copies and dq, dk, dv, out are rounded once (NUMERICS §11, core/act.h).
 * Backward: dq, dk, dv are activation gradients, WRITTEN (=). bf16 activations take the route of
 * nvl_attention_route (layers.h): on CUDA cuDNN's fused attention or the tensor-core FlashAttention-2
 * (flash_attention.h), on a CPU with AVX512-BF16 the CPU table's bf16 entries (kernels/cpu/attention_bf16_cpu.h),
 * else the widened f32 op: P and dS are rounded to bf16 before their products in the fused routes (NUMERICS §11),
 * so they are not the widened f32 op.
 * One entry of the device's kernel table runs (core/dispatch.h); its workspace is call scratch.
 * Not here: the arithmetic. */
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include "act.h"
#include "dispatch.h"
#include "flash_attention.h"
#include "layers.h"

typedef struct {
  int64_t B, T, Hq, Hkv, D;
} dims;


/* t is a live, 4-D, f32, contiguous tensor on like's device (like NULL: any device); name is
 * its argument name ("q"). */
static nvl_status check_4d_on(const char *op, const char *name, const char *layout, const nvl_tensor *t,
                              const nvl_tensor *like, nvl_dtype dt) {
  char s[160], s2[160];
  NVL_TRY(nvl_tensor_check_live(t, op));
  if (t->ndim != 4)
    return nvl_error(NVL_EINVAL, "%s: %s must be 4-D %s, got %s", op, name, layout, nvl_tensor_desc(t, s, sizeof s));
  if (like && like != t && !nvl_tensor_same_device(t, like))
    return nvl_error(NVL_EINVAL, "%s: %s is %s but q is %s; every tensor must be on one device", op, name,
                     nvl_tensor_desc(t, s, sizeof s), nvl_tensor_desc(like, s2, sizeof s2));
  if (t->dtype != dt)
    return nvl_error(NVL_EINVAL, "%s: %s must be %s, got %s", op, name, nvl_dtypes[dt].name,
                     nvl_tensor_desc(t, s, sizeof s));
  if (!nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "%s: %s must be contiguous, got a strided %s (use :contiguous())", op, name,
                     nvl_tensor_desc(t, s, sizeof s));
  return NVL_OK;
}

static int same_shape(const nvl_tensor *a, const nvl_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* q (B, T, Hq, D), k and v (B, T, Hkv, D), Hq % Hkv == 0; fills *n. cached: k and v are a key/value
 * cache (B, S, Hkv, D) of any length S (n->T is still q's). */
static nvl_status check_qkv(const char *op, const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                            double scale, dims *n, nvl_dtype dt, int cached) {
  char s1[160], s2[160];
  const char *kv = cached ? "(B, S, Hkv, D)" : "(B, T, Hkv, D)";
  NVL_TRY(check_4d_on(op, "q", "(B, T, Hq, D)", q, NULL, dt));
  NVL_TRY(check_4d_on(op, "k", kv, k, q, dt));
  NVL_TRY(check_4d_on(op, "v", kv, v, q, dt));
  if (!same_shape(k, v))
    return nvl_error(NVL_EINVAL, "%s: k and v must have one shape %s, got k %s and v %s", op, kv,
                     nvl_tensor_desc(k, s1, sizeof s1), nvl_tensor_desc(v, s2, sizeof s2));
  static const char *const what[4] = {"B (dim 1)", "T (dim 2)", "heads", "D (dim 4)"};
  for (int d = 0; d < 4; d++) {
    if (d == 2 || (d == 1 && cached) || q->shape[d] == k->shape[d]) continue;
    return nvl_error(NVL_EINVAL, "%s: q and k differ in %s: q is %s, k is %s", op, what[d],
                     nvl_tensor_desc(q, s1, sizeof s1), nvl_tensor_desc(k, s2, sizeof s2));
  }
  n->B = q->shape[0], n->T = q->shape[1], n->Hq = q->shape[2], n->Hkv = k->shape[2], n->D = q->shape[3];
  if (n->Hkv < 1 || n->Hq % n->Hkv != 0)
    return nvl_error(NVL_EINVAL, "%s: Hq (%lld) must be a positive multiple of Hkv (%lld): q is %s, k is %s", op,
                     (long long)n->Hq, (long long)n->Hkv, nvl_tensor_desc(q, s1, sizeof s1),
                     nvl_tensor_desc(k, s2, sizeof s2));
  if (n->T > INT_MAX || k->shape[1] > INT_MAX || n->Hq * n->D > INT_MAX)
    return nvl_error(NVL_EUNSUPPORTED, "%s: T, S or Hq*D beyond the BLAS int range: q is %s, k is %s", op,
                     nvl_tensor_desc(q, s1, sizeof s1), nvl_tensor_desc(k, s2, sizeof s2));
  if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
  return NVL_OK;
}

/* dt f32: the f32 entry; dt bf16: the backend's bf16 entry (the flash numerics; the caller checked
 * it is there and ready) */
static nvl_status attention_forward_as(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, nvl_dtype dt) {
  const char *op = "attention_forward";
  const nvl_backend *be;
  dims n;
  NVL_TRY(check_qkv(op, q, k, v, scale, &n, dt, 0));
  if (dt == NVL_BF16) NVL_PICK(be, q, layers->attention_forward_bf16, op);
  else NVL_PICK(be, q, layers->attention_forward, op);
  int64_t lse_shape[3] = {n.B, n.Hq, n.T};
  nvl_tensor o = nvl_tensor_null(), l = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&o, dt, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&l, NVL_F32, q->device, 3, lse_shape); /* (B, Hq, T) */
  if (st == NVL_OK && dt == NVL_BF16)
    st = NVL_CALL(be, q, layers->attention_forward_bf16, nvl_tensor_data(&o), nvl_tensor_data(&l), nvl_tensor_data(q),
                  nvl_tensor_data(k), nvl_tensor_data(v), n.B, n.T, n.Hq, n.Hkv, n.D, scale);
  else if (st == NVL_OK)
    st = NVL_CALL(be, q, layers->attention_forward, nvl_tensor_data(&o), nvl_tensor_data(&l), nvl_tensor_data(q),
                  nvl_tensor_data(k), nvl_tensor_data(v), n.B, n.T, n.Hq, n.Hkv, n.D, scale);
  if (st != NVL_OK) {
    nvl_tensor_release(&o);
    nvl_tensor_release(&l);
    return st;
  }
  *out = o;
  *lse = l;
  return NVL_OK;
}

static nvl_status attention_backward_as(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, nvl_dtype dt) {
  const char *op = "attention_backward";
  char s1[160], s2[160];
  const nvl_backend *be;
  dims n;
  NVL_TRY(check_qkv(op, q, k, v, scale, &n, dt, 0));
  NVL_TRY(check_4d_on(op, "dout", "(B, T, Hq, D)", dout, q, dt));
  NVL_TRY(check_4d_on(op, "out", "(B, T, Hq, D)", out, q, dt));
  if (!same_shape(dout, q))
    return nvl_error(NVL_EINVAL, "%s: dout must have q's shape (B, T, Hq, D): dout is %s, q is %s", op,
                     nvl_tensor_desc(dout, s1, sizeof s1), nvl_tensor_desc(q, s2, sizeof s2));
  if (!same_shape(out, q))
    return nvl_error(NVL_EINVAL, "%s: out must have q's shape (B, T, Hq, D): out is %s, q is %s", op,
                     nvl_tensor_desc(out, s1, sizeof s1), nvl_tensor_desc(q, s2, sizeof s2));
  NVL_TRY(nvl_tensor_check_live(lse, op));
  if (lse->ndim != 3 || lse->shape[0] != n.B || lse->shape[1] != n.Hq || lse->shape[2] != n.T ||
      lse->dtype != NVL_F32 || !nvl_tensor_same_device(lse, q) || !nvl_tensor_is_contiguous(lse))
    return nvl_error(NVL_EINVAL, "%s: lse must be a contiguous f32 (B, Hq, T) = [%lld,%lld,%lld] %s tensor, got %s%s",
                     op, (long long)n.B, (long long)n.Hq, (long long)n.T, q->device == NVL_CUDA ? "cuda" : "cpu",
                     nvl_tensor_desc(lse, s1, sizeof s1), nvl_tensor_is_contiguous(lse) ? "" : " (strided)");
  if (dt == NVL_BF16) NVL_PICK(be, q, layers->attention_backward_bf16, op);
  else NVL_PICK(be, q, layers->attention_backward, op);
  nvl_tensor gq = nvl_tensor_null(), gk = nvl_tensor_null(), gv = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&gq, dt, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&gk, dt, q->device, 4, k->shape); /* (B, T, Hkv, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&gv, dt, q->device, 4, v->shape); /* (B, T, Hkv, D) */
  if (st == NVL_OK && dt == NVL_BF16)
    st = NVL_CALL(be, q, layers->attention_backward_bf16, nvl_tensor_data(&gq), nvl_tensor_data(&gk),
                  nvl_tensor_data(&gv), nvl_tensor_data(dout), nvl_tensor_data(q), nvl_tensor_data(k),
                  nvl_tensor_data(v), nvl_tensor_data(out), nvl_tensor_data(lse), n.B, n.T, n.Hq, n.Hkv, n.D, scale);
  else if (st == NVL_OK)
    st = NVL_CALL(be, q, layers->attention_backward, nvl_tensor_data(&gq), nvl_tensor_data(&gk), nvl_tensor_data(&gv),
                  nvl_tensor_data(dout), nvl_tensor_data(q), nvl_tensor_data(k), nvl_tensor_data(v),
                  nvl_tensor_data(out), nvl_tensor_data(lse), n.B, n.T, n.Hq, n.Hkv, n.D, scale);
  if (st != NVL_OK) {
    nvl_tensor_release(&gq);
    nvl_tensor_release(&gk);
    nvl_tensor_release(&gv);
    return st;
  }
  *dq = gq;
  *dk = gk;
  *dv = gv;
  return NVL_OK;
}

/* ---- the route (layers.h nvl_attention_route) ------------------------------------------------------ */

const char *const nvl_attn_route_names[NVL_ATTN_ROUTE_COUNT] = {"auto", "flash", "cudnn", "reference"};

static atomic_int route = NVL_ATTN_AUTO;
static atomic_int route_before_off = NVL_ATTN_AUTO; /* what nvl_attention_flash(1) restores */
static atomic_int cudnn_det = 0;

int nvl_attention_route(int r) {
  int prev = atomic_load(&route);
  if (r >= 0 && r < NVL_ATTN_ROUTE_COUNT) atomic_store(&route, r);
  return prev;
}

int nvl_attention_cudnn_deterministic(int on) {
  int prev = atomic_load(&cudnn_det);
  if (on >= 0) atomic_store(&cudnn_det, on ? 1 : 0);
  return prev;
}

int nvl_attention_flash(int on) {
  int prev = atomic_load(&route);
  if (on == 0 && prev != NVL_ATTN_REFERENCE) {
    atomic_store(&route_before_off, prev);
    atomic_store(&route, NVL_ATTN_REFERENCE);
  } else if (on > 0 && prev == NVL_ATTN_REFERENCE) {
    atomic_store(&route, atomic_load(&route_before_off));
  }
  return prev != NVL_ATTN_REFERENCE;
}

/* the tensor-core flash attention takes these: bf16 on cuda, head dim 64 or 128, contiguous, 16-byte aligned */
static int flash_route(const nvl_tensor *const *acts, int n) {
  /* a missing or freed tensor takes the widened path, whose checks name it */
  for (int i = 0; i < n; i++)
    if (!acts[i] || !acts[i]->storage) return 0;
  if (acts[0]->device != NVL_CUDA) return 0;
  int64_t D = acts[0]->shape[3];
  if (acts[0]->ndim != 4 || (D != 64 && D != 128)) return 0;
  for (int i = 0; i < n; i++)
    if (!nvl_tensor_is_contiguous(acts[i]) || (uintptr_t)nvl_tensor_data(acts[i]) % 16) return 0;
  return 1;
}

/* the device's own bf16 attention (the CPU's AVX512-BF16 kernels) takes these: not cuda (its route is
 * above), the table has the entries and says this machine can run them, every tensor non-empty */
static int native_ready(nvl_device dev) {
  int r = atomic_load(&route);
  if ((r != NVL_ATTN_AUTO && r != NVL_ATTN_FLASH) || dev == NVL_CUDA) return 0;
  const nvl_backend *be = nvl_backend_for(dev, "attention");
  const nvl_layer_kernels *l = be ? be->layers : NULL;
  return l && l->attention_forward_bf16 && l->attention_backward_bf16 && l->attention_bf16_ready &&
         l->attention_bf16_ready();
}

int nvl_attention_flash_cpu(void) { return native_ready(NVL_CPU); }

static int native_route(const nvl_tensor *const *acts, int n) {
  if (!acts[0]->storage || !native_ready(acts[0]->device)) return 0;
  for (int i = 0; i < n; i++)
    if (!acts[i] || !acts[i]->storage || nvl_tensor_numel(acts[i]) == 0 || !nvl_tensor_is_contiguous(acts[i])) return 0;
  return 1;
}

/* cuDNN's fused attention takes these (acts[qi] is q, acts[qi + 1] k): every tensor live, contiguous and 16-byte
 * aligned (what the graph's tensors declare), and core/flash_attention.h's rules; else 0 and why */
static int cudnn_route(const nvl_tensor *const *acts, const char *const *names, int n, int qi, char *why, size_t wn) {
  char s[160];
  for (int i = 0; i < n; i++) {
    if (!acts[i] || !acts[i]->storage) {
      snprintf(why, wn, "%s is missing or freed", names[i]);
      return 0;
    }
    if (!nvl_tensor_is_contiguous(acts[i]) || (uintptr_t)nvl_tensor_data(acts[i]) % 16) {
      snprintf(why, wn, "%s is %s%s; cuDNN's route takes contiguous, 16-byte aligned tensors", names[i],
               nvl_tensor_is_contiguous(acts[i]) ? "not 16-byte aligned: " : "strided: ",
               nvl_tensor_desc(acts[i], s, sizeof s));
      return 0;
    }
  }
  if (nvl_cudnn_attention_supported("cudnn", acts[qi], acts[qi + 1], atomic_load(&cudnn_det)) != NVL_OK) {
    snprintf(why, wn, "%s", nvl_last_error());
    return 0;
  }
  return 1;
}

typedef enum { IMPL_F32, IMPL_WIDENED, IMPL_CPU_BF16, IMPL_FLASH, IMPL_CUDNN, IMPL_ERROR } impl;
static const char *const impl_names[] = {"f32", "widened", "cpu_bf16", "flash", "cudnn", "error"};

/* The kernels for activations acts (q at acts[qi]) of dtype dt under the route now; why: see route_of. */
static impl pick(const nvl_tensor *const *acts, const char *const *names, int n, int qi, nvl_dtype dt, char *why,
                 size_t wn) {
  const int r = atomic_load(&route);
  why[0] = 0;
  if (dt == NVL_F32) {
    if (r != NVL_ATTN_CUDNN) return IMPL_F32;
    snprintf(why, wn, "the activations are f32 and cuDNN's route takes bf16 ones (the f32 attention has no cuDNN "
             "route; attention=auto runs it)");
    return IMPL_ERROR;
  }
  if (r == NVL_ATTN_REFERENCE) return IMPL_WIDENED;
  if (r == NVL_ATTN_AUTO || r == NVL_ATTN_CUDNN) {
    if (cudnn_route(acts, names, n, qi, why, wn)) return IMPL_CUDNN;
    if (r == NVL_ATTN_CUDNN) return IMPL_ERROR;
  }
  if (flash_route(acts, n)) return IMPL_FLASH;
  if (native_route(acts, n)) return IMPL_CPU_BF16;
  return IMPL_WIDENED;
}

const char *nvl_attention_route_of(const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v, char *why, size_t n) {
  const char *names[3] = {"q", "k", "v"};
  const nvl_tensor *acts[3] = {q, k, v};
  char w[600];
  nvl_dtype dt;
  impl m;
  if (nvl_act_dtype("attention", names, acts, 3, &dt) != NVL_OK) {
    snprintf(w, sizeof w, "%s", nvl_last_error());
    m = IMPL_ERROR;
  } else {
    m = pick(acts, names, 3, 0, dt, w, sizeof w);
  }
  if (why && n) snprintf(why, n, "%s", w);
  return impl_names[m];
}

/* Under attention=auto, cuDNN having no engine for a problem (NVL_EUNSUPPORTED: nothing ran; the refusal is
 * remembered per problem by kernels/cuda/cudnn_attn.cu) sends the call on to the next route; any other failure,
 * and every failure under attention=cudnn, is the call's error. */
static int cudnn_fell_back(nvl_status st) {
  return st == NVL_EUNSUPPORTED && atomic_load(&route) == NVL_ATTN_AUTO;
}

/* the route after cuDNN: the flash kernels where they apply, else the widened op (CUDA tensors: no CPU route) */
static impl pick_after_cudnn(const nvl_tensor *const *acts, int n) {
  return flash_route(acts, n) ? IMPL_FLASH : IMPL_WIDENED;
}

static nvl_status cudnn_refused(const char *op, const char *why) {
  return nvl_error(NVL_EUNSUPPORTED, "%s: attention=cudnn cannot run these activations: %s (attention=auto falls "
                   "back to the flash kernels or the reference rule)", op, why);
}

static nvl_status need_null(const char *op, const char *name, const nvl_tensor *t) {
  if (!t) return nvl_error(NVL_EINVAL, "%s: no place for the output %s (NULL)", op, name);
  if (t->storage) return nvl_error(NVL_EINVAL, "%s: the output %s must be a null tensor", op, name);
  return NVL_OK;
}

/* ---- bf16 activations (NUMERICS §11, act.h): widened exactly, the f32 op, one rounding ------------ */

nvl_status nvl_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                 const nvl_tensor *v, double scale) {
  const char *op = "attention_forward";
  const char *names[3] = {"q", "k", "v"};
  const nvl_tensor *acts[3] = {q, k, v};
  nvl_dtype dt;
  char why[600];
  NVL_TRY(nvl_act_dtype(op, names, acts, 3, &dt));
  impl m = pick(acts, names, 3, 0, dt, why, sizeof why);
  if (m == IMPL_ERROR) return cudnn_refused(op, why);
  if (m == IMPL_F32) return attention_forward_as(out, lse, q, k, v, scale, NVL_F32);
  NVL_TRY(need_null(op, "out", out));
  NVL_TRY(need_null(op, "lse", lse));
  if (m == IMPL_CUDNN) {
    nvl_status st = nvl_cudnn_attention_forward(out, lse, q, k, v, scale, 1); /* checks shapes */
    if (!cudnn_fell_back(st)) return st;
    m = pick_after_cudnn(acts, 3);
  }
  if (m == IMPL_FLASH) {
    if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
    return nvl_flash_attention_forward(out, lse, q, k, v, scale, 1); /* checks shapes and devices */
  }
  if (m == IMPL_CPU_BF16) return attention_forward_as(out, lse, q, k, v, scale, NVL_BF16);
  nvl_tensor w[3], r[1] = {nvl_tensor_null()}, l = nvl_tensor_null();
  NVL_TRY(nvl_act_widen(w, acts, 3));
  nvl_status st = attention_forward_as(&r[0], &l, &w[0], &w[1], &w[2], scale, NVL_F32);
  nvl_act_release(w, 3);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[1] = {out};
  st = nvl_act_round(outs, r, 1);
  if (st == NVL_OK) *lse = l; /* lse stays f32 */
  else nvl_tensor_release(&l);
  return st;
}

nvl_status nvl_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                  const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                  const nvl_tensor *out, const nvl_tensor *lse, double scale) {
  const char *op = "attention_backward";
  const char *names[5] = {"dout", "q", "k", "v", "out"};
  const nvl_tensor *acts[5] = {dout, q, k, v, out};
  nvl_dtype dt;
  char why[600];
  NVL_TRY(nvl_act_dtype(op, names, acts, 5, &dt));
  impl m = pick(acts, names, 5, 1, dt, why, sizeof why);
  if (m == IMPL_ERROR) return cudnn_refused(op, why);
  if (m == IMPL_F32) return attention_backward_as(dq, dk, dv, dout, q, k, v, out, lse, scale, NVL_F32);
  NVL_TRY(need_null(op, "dq", dq));
  NVL_TRY(need_null(op, "dk", dk));
  NVL_TRY(need_null(op, "dv", dv));
  if (m == IMPL_CUDNN) {
    nvl_status st = nvl_cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, 1,
                                                 atomic_load(&cudnn_det));
    if (!cudnn_fell_back(st)) return st;
    m = pick_after_cudnn(acts, 5);
  }
  if (m == IMPL_FLASH) {
    if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
    return nvl_flash_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, 1);
  }
  if (m == IMPL_CPU_BF16) return attention_backward_as(dq, dk, dv, dout, q, k, v, out, lse, scale, NVL_BF16);
  nvl_tensor w[5], r[3] = {nvl_tensor_null(), nvl_tensor_null(), nvl_tensor_null()};
  NVL_TRY(nvl_act_widen(w, acts, 5));
  nvl_status st = attention_backward_as(&r[0], &r[1], &r[2], &w[0], &w[1], &w[2], &w[3], &w[4], lse, scale,
                                        NVL_F32);
  nvl_act_release(w, 5);
  if (st != NVL_OK) return st;
  nvl_tensor *outs[3] = {dq, dk, dv};
  return nvl_act_round(outs, r, 3);
}

/* ---- over a key/value cache (KV-cache decoding): f32, forward only ---------------------------------- */

nvl_status nvl_attention_forward_at(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                    const nvl_tensor *v, int64_t pos0, double scale) {
  const char *op = "attention_forward_at";
  char s1[160];
  const nvl_backend *be;
  dims n;
  NVL_TRY(need_null(op, "out", out));
  NVL_TRY(need_null(op, "lse", lse));
  NVL_TRY(check_qkv(op, q, k, v, scale, &n, NVL_F32, 1));
  int64_t B = n.B, T = n.T, Hq = n.Hq, Hkv = n.Hkv, D = n.D, S = k->shape[1];
  if (pos0 < 0 || pos0 + T > S)
    return nvl_error(NVL_EINVAL, "%s: queries at positions %lld .. %lld do not fit the %lld cached rows of k %s", op,
                     (long long)pos0, (long long)(pos0 + T - 1), (long long)S, nvl_tensor_desc(k, s1, sizeof s1));
  NVL_PICK(be, q, layers->attention_forward_at, op);
  int64_t lse_shape[3] = {B, Hq, T};
  nvl_tensor o = nvl_tensor_null(), l = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&o, NVL_F32, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&l, NVL_F32, q->device, 3, lse_shape); /* (B, Hq, T) */
  if (st == NVL_OK)
    st = NVL_CALL(be, q, layers->attention_forward_at, nvl_tensor_data(&o), nvl_tensor_data(&l), nvl_tensor_data(q),
                  nvl_tensor_data(k), nvl_tensor_data(v), B, T, S, pos0, Hq, Hkv, D, scale);
  if (st != NVL_OK) {
    nvl_tensor_release(&o);
    nvl_tensor_release(&l);
    return st;
  }
  *out = o;
  *lse = l;
  return NVL_OK;
}
