/* flash_attention.c: validation, allocation and the call of the CUDA backend's fused attentions (contract in
 * flash_attention.h): the tensor-core flash attention (kernels/cuda/flash_attn.cu) and cuDNN's (kernels/cuda/
 * cudnn_attn.cu), and of the WMMA probe. Not here: the arithmetic, the fp32 attention and the route (attention.c). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "dispatch.h"
#include "flash_attention.h"
#ifdef NVLUA_HAVE_CUDA
#include "cuda/cudnn_attn.h"
#include "cuda/flash_attn.h"
#endif

#ifdef NVLUA_HAVE_CUDA
typedef struct {
  int64_t B, T, Hq, Hkv, D;
} dims;

/* t is a live, ndim-D, contiguous, 16-byte aligned tensor of dtype dt on cuda, on like's device (if like). */
static nvl_status check_on_cuda(const char *op, const char *name, const char *layout, const nvl_tensor *t, int ndim,
                                nvl_dtype dt, const nvl_tensor *like) {
  char s[160], s2[160];
  NVL_TRY(nvl_tensor_check_live(t, op));
  if (t->ndim != ndim || t->dtype != dt)
    return nvl_error(NVL_EINVAL, "%s: %s must be a %d-D %s %s tensor, got %s", op, name, ndim, nvl_dtypes[dt].name,
                     layout, nvl_tensor_desc(t, s, sizeof s));
  if (t->device != NVL_CUDA)
    return nvl_error(NVL_EINVAL, "%s: %s must be on cuda (the fused attentions run on CUDA), got %s", op, name,
                     nvl_tensor_desc(t, s, sizeof s));
  if (like && like != t && !nvl_tensor_same_device(t, like))
    return nvl_error(NVL_EINVAL, "%s: %s is %s but q is %s; every tensor must be on one device", op, name,
                     nvl_tensor_desc(t, s, sizeof s), nvl_tensor_desc(like, s2, sizeof s2));
  if (!nvl_tensor_is_contiguous(t))
    return nvl_error(NVL_EINVAL, "%s: %s must be contiguous, got a strided %s (use :contiguous())", op, name,
                     nvl_tensor_desc(t, s, sizeof s));
  if ((uintptr_t)nvl_tensor_data(t) % 16)
    return nvl_error(NVL_EINVAL, "%s: %s's data is not 16-byte aligned (a view at an odd offset); use :clone()", op,
                     name);
  return NVL_OK;
}

static int same_shape(const nvl_tensor *a, const nvl_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* q (B, T, Hq, D), k and v (B, T, Hkv, D) bf16, Hq % Hkv == 0; fills *n. */
static nvl_status check_qkv(const char *op, const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v, dims *n) {
  char s1[160], s2[160];
  NVL_TRY(check_on_cuda(op, "q", "(B, T, Hq, D)", q, 4, NVL_BF16, NULL));
  NVL_TRY(check_on_cuda(op, "k", "(B, T, Hkv, D)", k, 4, NVL_BF16, q));
  NVL_TRY(check_on_cuda(op, "v", "(B, T, Hkv, D)", v, 4, NVL_BF16, q));
  if (!same_shape(k, v) || q->shape[0] != k->shape[0] || q->shape[1] != k->shape[1] || q->shape[3] != k->shape[3])
    return nvl_error(NVL_EINVAL, "%s: k and v must be (B, T, Hkv, D) with q's B, T and D: q is %s, k is %s, v is %s",
                     op, nvl_tensor_desc(q, s1, sizeof s1), nvl_tensor_desc(k, s2, sizeof s2),
                     nvl_tensor_desc(v, s2, sizeof s2));
  n->B = q->shape[0], n->T = q->shape[1], n->Hq = q->shape[2], n->Hkv = k->shape[2], n->D = q->shape[3];
  if (n->Hkv < 1 || n->Hq % n->Hkv != 0)
    return nvl_error(NVL_EINVAL, "%s: Hq (%lld) must be a positive multiple of Hkv (%lld)", op, (long long)n->Hq,
                     (long long)n->Hkv);
  return NVL_OK;
}

nvl_status nvl_flash_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, int causal) {
  const char *op = "flash_attention_forward";
  dims n;
  NVL_TRY(check_qkv(op, q, k, v, &n));
  if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
  NVL_TRY(nvl_cuda_flash_attn_supported(op, n.D));
  int64_t lse_shape[3] = {n.B, n.Hq, n.T};
  nvl_tensor o = nvl_tensor_null(), l = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&o, NVL_BF16, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&l, NVL_F32, q->device, 3, lse_shape); /* (B, Hq, T) */
  if (st == NVL_OK) {
    nvl_call c;
    nvl_call_begin(&c, q->device, q->storage ? q->storage->device_index : 0);
    st = nvl_cuda_flash_attn_fwd(&c.k, nvl_tensor_data(&o), nvl_tensor_data(&l), nvl_tensor_data(q),
                                 nvl_tensor_data(k), nvl_tensor_data(v), n.B, n.T, n.Hq, n.Hkv, n.D, scale, causal);
    nvl_call_end(&c);
  }
  if (st != NVL_OK) {
    nvl_tensor_release(&o);
    nvl_tensor_release(&l);
    return st;
  }
  *out = o;
  *lse = l;
  return NVL_OK;
}

nvl_status nvl_flash_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, int causal) {
  const char *op = "flash_attention_backward";
  char s1[160];
  dims n;
  NVL_TRY(check_qkv(op, q, k, v, &n));
  if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
  NVL_TRY(nvl_cuda_flash_attn_supported(op, n.D));
  NVL_TRY(check_on_cuda(op, "dout", "(B, T, Hq, D)", dout, 4, NVL_BF16, q));
  NVL_TRY(check_on_cuda(op, "out", "(B, T, Hq, D)", out, 4, NVL_BF16, q));
  NVL_TRY(check_on_cuda(op, "lse", "(B, Hq, T)", lse, 3, NVL_F32, q));
  if (!same_shape(dout, q) || !same_shape(out, q))
    return nvl_error(NVL_EINVAL, "%s: dout and out must have q's shape (B, T, Hq, D) = %s", op,
                     nvl_tensor_desc(q, s1, sizeof s1));
  if (lse->shape[0] != n.B || lse->shape[1] != n.Hq || lse->shape[2] != n.T)
    return nvl_error(NVL_EINVAL, "%s: lse must be (B, Hq, T) = [%lld,%lld,%lld], got %s", op, (long long)n.B,
                     (long long)n.Hq, (long long)n.T, nvl_tensor_desc(lse, s1, sizeof s1));
  nvl_tensor gq = nvl_tensor_null(), gk = nvl_tensor_null(), gv = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&gq, NVL_BF16, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&gk, NVL_BF16, q->device, 4, k->shape); /* (B, T, Hkv, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&gv, NVL_BF16, q->device, 4, v->shape); /* (B, T, Hkv, D) */
  if (st == NVL_OK) {
    nvl_call c;
    nvl_call_begin(&c, q->device, q->storage ? q->storage->device_index : 0);
    st = nvl_cuda_flash_attn_bwd(&c.k, nvl_tensor_data(&gq), nvl_tensor_data(&gk), nvl_tensor_data(&gv),
                                 nvl_tensor_data(dout), nvl_tensor_data(q), nvl_tensor_data(k), nvl_tensor_data(v),
                                 nvl_tensor_data(out), nvl_tensor_data(lse), n.B, n.T, n.Hq, n.Hkv, n.D, scale, causal);
    nvl_call_end(&c);
  }
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

/* ---- cuDNN's fused attention --------------------------------------------------------------------------- */

static int dev_of(const nvl_tensor *t) { return t->storage ? t->storage->device_index : 0; }

nvl_status nvl_cudnn_attention_supported(const char *op, const nvl_tensor *q, const nvl_tensor *k, int deterministic) {
  char s[160];
  if (!q || !q->storage || !k || !k->storage)
    return nvl_error(NVL_EUNSUPPORTED, "%s: a tensor is missing or freed", op);
  if (q->device != NVL_CUDA)
    return nvl_error(NVL_EUNSUPPORTED, "%s: q is %s; cuDNN's attention runs on CUDA tensors", op,
                     nvl_tensor_desc(q, s, sizeof s));
  if (q->ndim != 4 || k->ndim != 4 || q->dtype != NVL_BF16)
    return nvl_error(NVL_EUNSUPPORTED, "%s: cuDNN's attention takes 4-D bf16 (B, T, H, D) tensors, q is %s", op,
                     nvl_tensor_desc(q, s, sizeof s));
  return nvl_cuda_cudnn_attn_supported(op, dev_of(q), q->shape[0], q->shape[1], q->shape[2], k->shape[2], q->shape[3],
                                       deterministic);
}

nvl_status nvl_cudnn_attention_available(int dev) { return nvl_cuda_cudnn_attn_available("cudnn_attention", dev); }

void nvl_cudnn_attention_stats(nvl_cudnn_attention_info *i) {
  nvl_cudnn_attn_stats s;
  nvl_cuda_cudnn_attn_stats(&s);
  i->graphs_built = s.graphs_built, i->cache_hits = s.cache_hits, i->evictions = s.evictions;
  i->executions = s.executions, i->cached = s.cached, i->last_workspace = s.last_workspace;
  i->refusals = s.refusals;
  snprintf(i->last_refusal, sizeof i->last_refusal, "%s", s.last_refusal);
  i->loads = nvl_cuda_cudnn_loads(i->load_error, sizeof i->load_error);
  i->version = nvl_cuda_cudnn_version();
  i->compiled_version = nvl_cuda_cudnn_compiled_version();
}

void nvl_cudnn_attention_clear_cache(void) { nvl_cuda_cudnn_attn_clear_cache(); }

int nvl_cudnn_attention_break(int what) { return nvl_cuda_cudnn_attn_break(what); }

nvl_status nvl_cudnn_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, int causal) {
  const char *op = "cudnn_attention_forward";
  dims n;
  NVL_TRY(check_qkv(op, q, k, v, &n));
  if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
  NVL_TRY(nvl_cudnn_attention_supported(op, q, k, 0));
  int64_t lse_shape[3] = {n.B, n.Hq, n.T};
  nvl_tensor o = nvl_tensor_null(), l = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&o, NVL_BF16, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&l, NVL_F32, q->device, 3, lse_shape); /* (B, Hq, T) */
  if (st == NVL_OK) {
    nvl_call c;
    nvl_call_begin(&c, q->device, dev_of(q));
    st = nvl_cuda_cudnn_attn_fwd(&c.k, nvl_tensor_data(&o), nvl_tensor_data(&l), nvl_tensor_data(q), nvl_tensor_data(k),
                                 nvl_tensor_data(v), n.B, n.T, n.Hq, n.Hkv, n.D, scale, causal);
    nvl_call_end(&c);
  }
  if (st != NVL_OK) {
    nvl_tensor_release(&o);
    nvl_tensor_release(&l);
    return st;
  }
  *out = o;
  *lse = l;
  return NVL_OK;
}

nvl_status nvl_cudnn_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, int causal,
                                        int deterministic) {
  const char *op = "cudnn_attention_backward";
  char s1[160];
  dims n;
  NVL_TRY(check_qkv(op, q, k, v, &n));
  if (!isfinite(scale)) return nvl_error(NVL_EINVAL, "%s: scale must be finite, got %g", op, scale);
  NVL_TRY(check_on_cuda(op, "dout", "(B, T, Hq, D)", dout, 4, NVL_BF16, q));
  NVL_TRY(check_on_cuda(op, "out", "(B, T, Hq, D)", out, 4, NVL_BF16, q));
  NVL_TRY(check_on_cuda(op, "lse", "(B, Hq, T)", lse, 3, NVL_F32, q));
  if (!same_shape(dout, q) || !same_shape(out, q))
    return nvl_error(NVL_EINVAL, "%s: dout and out must have q's shape (B, T, Hq, D) = %s", op,
                     nvl_tensor_desc(q, s1, sizeof s1));
  if (lse->shape[0] != n.B || lse->shape[1] != n.Hq || lse->shape[2] != n.T)
    return nvl_error(NVL_EINVAL, "%s: lse must be (B, Hq, T) = [%lld,%lld,%lld], got %s", op, (long long)n.B,
                     (long long)n.Hq, (long long)n.T, nvl_tensor_desc(lse, s1, sizeof s1));
  NVL_TRY(nvl_cudnn_attention_supported(op, q, k, deterministic));
  nvl_tensor gq = nvl_tensor_null(), gk = nvl_tensor_null(), gv = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&gq, NVL_BF16, q->device, 4, q->shape); /* (B, T, Hq, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&gk, NVL_BF16, q->device, 4, k->shape); /* (B, T, Hkv, D) */
  if (st == NVL_OK) st = nvl_tensor_empty(&gv, NVL_BF16, q->device, 4, v->shape); /* (B, T, Hkv, D) */
  if (st == NVL_OK) {
    nvl_call c;
    nvl_call_begin(&c, q->device, dev_of(q));
    st = nvl_cuda_cudnn_attn_bwd(&c.k, nvl_tensor_data(&gq), nvl_tensor_data(&gk), nvl_tensor_data(&gv),
                                 nvl_tensor_data(dout), nvl_tensor_data(q), nvl_tensor_data(k), nvl_tensor_data(v),
                                 nvl_tensor_data(out), nvl_tensor_data(lse), n.B, n.T, n.Hq, n.Hkv, n.D, scale, causal,
                                 deterministic);
    nvl_call_end(&c);
  }
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

nvl_status nvl_wmma_probe(nvl_tensor *d, const nvl_tensor *a, const nvl_tensor *b, const nvl_tensor *c, int flags) {
  const char *op = "wmma_probe";
  char s[160];
  NVL_TRY(check_on_cuda(op, "a", "(16, 16)", a, 2, NVL_BF16, NULL));
  NVL_TRY(check_on_cuda(op, "b", "(16, 16)", b, 2, NVL_BF16, a));
  NVL_TRY(check_on_cuda(op, "c", "(16, 16)", c, 2, NVL_F32, a));
  const nvl_tensor *t[3] = {a, b, c};
  for (int i = 0; i < 3; i++)
    if (t[i]->shape[0] != 16 || t[i]->shape[1] != 16)
      return nvl_error(NVL_EINVAL, "%s: a, b and c must be (16, 16), got %s", op, nvl_tensor_desc(t[i], s, sizeof s));
  if (flags < 0 || flags > NVL_WMMA_FLAGS_ALL)
    return nvl_error(NVL_EINVAL, "%s: flags must be in 0..%d, got %d", op, NVL_WMMA_FLAGS_ALL, flags);
  nvl_tensor o = nvl_tensor_null();
  nvl_status st = nvl_tensor_empty(&o, NVL_F32, a->device, 2, c->shape);
  if (st == NVL_OK) {
    nvl_call cl;
    nvl_call_begin(&cl, a->device, a->storage ? a->storage->device_index : 0);
    st = nvl_cuda_wmma_probe(&cl.k, nvl_tensor_data(&o), nvl_tensor_data(a), nvl_tensor_data(b), nvl_tensor_data(c),
                             flags);
    nvl_call_end(&cl);
  }
  if (st != NVL_OK) {
    nvl_tensor_release(&o);
    return st;
  }
  *d = o;
  return NVL_OK;
}
#else
static nvl_status not_built(const char *op) {
  return nvl_error(NVL_EUNSUPPORTED, "%s: the flash attention is a CUDA kernel, and nvlua was built without CUDA "
                   "(rebuild with nvcc and -DNVLUA_CUDA=ON)", op);
}
nvl_status nvl_flash_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, int causal) {
  (void)out, (void)lse, (void)q, (void)k, (void)v, (void)scale, (void)causal;
  return not_built("flash_attention_forward");
}
nvl_status nvl_flash_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, int causal) {
  (void)dq, (void)dk, (void)dv, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)scale, (void)causal;
  return not_built("flash_attention_backward");
}
nvl_status nvl_wmma_probe(nvl_tensor *d, const nvl_tensor *a, const nvl_tensor *b, const nvl_tensor *c, int flags) {
  (void)d, (void)a, (void)b, (void)c, (void)flags;
  return not_built("wmma_probe");
}
static nvl_status no_cuda(const char *op) {
  return nvl_error(NVL_EUNSUPPORTED, "%s: cuDNN's attention runs on CUDA, and nvlua was built without CUDA (rebuild "
                   "with nvcc and -DNVLUA_CUDA=ON)", op);
}
nvl_status nvl_cudnn_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                       const nvl_tensor *v, double scale, int causal) {
  (void)out, (void)lse, (void)q, (void)k, (void)v, (void)scale, (void)causal;
  return no_cuda("cudnn_attention_forward");
}
nvl_status nvl_cudnn_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                        const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                        const nvl_tensor *out, const nvl_tensor *lse, double scale, int causal,
                                        int deterministic) {
  (void)dq, (void)dk, (void)dv, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)scale, (void)causal,
      (void)deterministic;
  return no_cuda("cudnn_attention_backward");
}
nvl_status nvl_cudnn_attention_supported(const char *op, const nvl_tensor *q, const nvl_tensor *k, int deterministic) {
  (void)q, (void)k, (void)deterministic;
  return no_cuda(op);
}
nvl_status nvl_cudnn_attention_available(int dev) {
  (void)dev;
  return no_cuda("cudnn_attention");
}
void nvl_cudnn_attention_stats(nvl_cudnn_attention_info *i) {
  memset(i, 0, sizeof *i);
  snprintf(i->load_error, sizeof i->load_error, "nvlua was built without CUDA");
}
void nvl_cudnn_attention_clear_cache(void) {}
int nvl_cudnn_attention_break(int what) {
  (void)what;
  return -1;
}
#endif
