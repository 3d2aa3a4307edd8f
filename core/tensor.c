/* tensor.c: storage allocation and accounting, views, copies (see tensor.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dispatch.h"
#include "tensor.h"

static size_t live_bytes[NVL_DEVICE_COUNT], peak_bytes[NVL_DEVICE_COUNT];
static int64_t live_count[NVL_DEVICE_COUNT];

size_t nvl_memory_live(nvl_device dev) { return live_bytes[dev]; }
size_t nvl_memory_peak(nvl_device dev) { return peak_bytes[dev]; }
void nvl_memory_reset_peak(nvl_device dev) { peak_bytes[dev] = live_bytes[dev]; }
int64_t nvl_memory_count(nvl_device dev) { return live_count[dev]; }

/* ---- a small caching allocator for big host buffers ----
 * A training step frees and re-allocates the same large buffers every time; giving them back to
 * the OS and taking them again costs a page fault per 4 KiB (on this kind of machine more than
 * the copy itself). Freed host buffers of at least 1 MiB (sizes rounded up to 64 KiB) are kept,
 * up to NVLUA_CPU_CACHE_MB (default 1024) in all, and reused for an allocation of the same
 * rounded size; the oldest go first. Contents of a reused buffer are garbage, as with malloc. */
#define CACHE_SLOTS 64
#define CACHE_MIN ((size_t)1 << 20)
static struct { void *p; size_t size; uint64_t age; } cache[CACHE_SLOTS];
static size_t cache_bytes, cache_cap = (size_t)-1;
static uint64_t cache_clock;

static size_t cache_limit(void) {
  if (cache_cap == (size_t)-1) {
    const char *e = getenv("NVLUA_CPU_CACHE_MB");
    long mb = e ? strtol(e, NULL, 10) : 1024;
    cache_cap = mb > 0 ? (size_t)mb << 20 : 0;
  }
  return cache_cap;
}

static size_t host_round(size_t bytes) {
  if (bytes >= CACHE_MIN) return (bytes + 65535) & ~(size_t)65535;
  return (bytes + 63) & ~(size_t)63;
}

static void *host_alloc(size_t bytes) {
  size_t r = host_round(bytes);
  if (r >= CACHE_MIN) {
    for (int i = 0; i < CACHE_SLOTS; i++)
      if (cache[i].p && cache[i].size == r) {
        void *p = cache[i].p;
        cache[i].p = NULL;
        cache_bytes -= r;
        return p;
      }
  }
  void *p = aligned_alloc(64, r);
  if (!p && cache_bytes) { /* give the cache back and try once more */
    nvl_memory_empty_cache();
    p = aligned_alloc(64, r);
  }
  return p;
}

static void host_free(void *p, size_t bytes) {
  size_t r = host_round(bytes);
  if (r >= CACHE_MIN && r <= cache_limit()) {
    while (cache_bytes + r > cache_limit()) { /* evict the oldest */
      int o = -1;
      for (int i = 0; i < CACHE_SLOTS; i++)
        if (cache[i].p && (o < 0 || cache[i].age < cache[o].age)) o = i;
      if (o < 0) break;
      free(cache[o].p);
      cache_bytes -= cache[o].size;
      cache[o].p = NULL;
    }
    int slot = -1;
    for (int i = 0; i < CACHE_SLOTS && slot < 0; i++)
      if (!cache[i].p) slot = i;
    if (slot < 0) { /* all slots full: replace the oldest */
      slot = 0;
      for (int i = 1; i < CACHE_SLOTS; i++)
        if (cache[i].age < cache[slot].age) slot = i;
      free(cache[slot].p);
      cache_bytes -= cache[slot].size;
    }
    if (cache_bytes + r <= cache_limit()) {
      cache[slot].p = p;
      cache[slot].size = r;
      cache[slot].age = ++cache_clock;
      cache_bytes += r;
      return;
    }
    cache[slot].p = NULL;
  }
  free(p);
}

size_t nvl_memory_cached(void) { return cache_bytes; }

void nvl_memory_empty_cache(void) {
  for (int i = 0; i < CACHE_SLOTS; i++)
    if (cache[i].p) {
      free(cache[i].p);
      cache[i].p = NULL;
    }
  cache_bytes = 0;
}

static nvl_status storage_new(nvl_storage **out, nvl_device dev, size_t bytes) {
  nvl_storage *s = calloc(1, sizeof *s);
  if (!s) return nvl_error(NVL_ENOMEM, "cannot allocate a storage header: out of host memory");
  size_t alloc = bytes ? bytes : 1;
  if (dev == NVL_CPU) {
    s->data = host_alloc(alloc);
    if (!s->data) {
      free(s);
      return nvl_error(NVL_ENOMEM, "cannot allocate %zu bytes: out of host memory", bytes);
    }
  } else {
    const nvl_device_api *api = nvl_device_api_for(dev, "empty");
    nvl_status st = api ? api->alloc(&s->data, alloc, 0) : NVL_EUNSUPPORTED;
    if (st != NVL_OK) { free(s); return st; }
  }
  s->refcount = 1;
  s->device = dev;
  s->bytes = bytes;
  live_bytes[dev] += bytes;
  live_count[dev]++;
  if (live_bytes[dev] > peak_bytes[dev]) peak_bytes[dev] = live_bytes[dev];
  *out = s;
  return NVL_OK;
}

static void storage_unref(nvl_storage *s) {
  if (!s || --s->refcount > 0) return;
  live_bytes[s->device] -= s->bytes;
  live_count[s->device]--;
  if (s->device == NVL_CPU) host_free(s->data, s->bytes ? s->bytes : 1);
  else nvl_device_api_for(s->device, "free")->free(s->data, s->device_index); /* it allocated s, so it exists */
  free(s);
}

/* Sizes were checked by nvl_shape_numel: the products stay below NVL_MAX_NUMEL. */
static void set_contiguous_strides(nvl_tensor *t) {
  int64_t st = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    t->strides[d] = st;
    st *= t->shape[d];
  }
}

static const char *dims_str(int ndim, const int64_t *shape, char *buf, size_t n) {
  size_t used = (size_t)snprintf(buf, n, "[");
  for (int d = 0; d < ndim && used < n; d++)
    used += (size_t)snprintf(buf + used, n - used, d ? ",%lld" : "%lld", (long long)shape[d]);
  if (used < n) snprintf(buf + used, n - used, "]");
  return buf;
}

nvl_status nvl_shape_numel(const char *op, int ndim, const int64_t *shape, int64_t *numel) {
  char sh[200];
  if (ndim < 0 || ndim > NVL_MAX_DIMS)
    return nvl_error(NVL_EINVAL, "%s: %d dims requested, at most %d supported", op, ndim, NVL_MAX_DIMS);
  int64_t n = 1, span = 1; /* span: the product with each 0 counted as 1, which bounds every stride */
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0)
      return nvl_error(NVL_EINVAL, "%s: negative size %lld in dim %d", op, (long long)shape[d], d + 1);
    if (nvl_mul_overflow(span, shape[d] ? shape[d] : 1, &span) || span > NVL_MAX_NUMEL)
      return nvl_error(NVL_EINVAL, "%s: shape %s is too large: its sizes multiply past %lld elements", op,
                       dims_str(ndim, shape, sh, sizeof sh), (long long)NVL_MAX_NUMEL);
    n *= shape[d];
  }
  *numel = n;
  return NVL_OK;
}

nvl_status nvl_tensor_check_bounds(const nvl_tensor *t, const char *op) {
  int64_t numel, es = nvl_dtypes[t->dtype].elem_size, lo = t->offset, hi = t->offset, last;
  NVL_TRY(nvl_shape_numel(op, t->ndim, t->shape, &numel));
  int ok = t->offset >= 0 && !nvl_mul_overflow(t->offset, es, &last);
  for (int d = 0; ok && numel > 0 && d < t->ndim; d++) {
    int64_t ext; /* how far dim d reaches from element 0 of the view */
    ok = !nvl_mul_overflow(t->shape[d] - 1, t->strides[d], &ext) &&
         !nvl_add_overflow(ext < 0 ? lo : hi, ext, ext < 0 ? &lo : &hi);
  }
  /* the last element's end: (hi + 1) * es bytes from the storage's start */
  if (ok && numel > 0) ok = lo >= 0 && !nvl_mul_overflow(hi, es, &last) && last <= INT64_MAX - es &&
                             t->storage && (uint64_t)(last + es) <= (uint64_t)t->storage->bytes;
  if (!ok) {
    char sh[200], st[200];
    return nvl_error(NVL_EINVAL, "%s: a view %s with strides %s at offset %lld does not fit its storage of %lld bytes",
                     op, dims_str(t->ndim, t->shape, sh, sizeof sh), dims_str(t->ndim, t->strides, st, sizeof st),
                     (long long)t->offset, t->storage ? (long long)t->storage->bytes : 0LL);
  }
  return NVL_OK;
}

nvl_status nvl_tensor_empty(nvl_tensor *out, nvl_dtype dt, nvl_device dev, int ndim, const int64_t *shape) {
  if ((unsigned)dt >= NVL_DTYPE_COUNT) return nvl_error(NVL_EINVAL, "empty: invalid dtype %d", (int)dt);
  if (nvl_dtypes[dt].is_quantized)
    return nvl_error(NVL_EINVAL, "empty: %s is a quantized format, not a tensor dtype (valid: %s); use nv.quantize(x, \"%s\")",
                     nvl_dtypes[dt].name, nvl_dtype_names(), nvl_dtypes[dt].name);
  int64_t n;
  NVL_TRY(nvl_shape_numel("empty", ndim, shape, &n));
  nvl_tensor t = nvl_tensor_null();
  t.dtype = dt;
  t.device = dev;
  t.ndim = ndim;
  for (int d = 0; d < ndim; d++) t.shape[d] = shape[d];
  set_contiguous_strides(&t);
  size_t bytes = (size_t)n * (size_t)nvl_dtypes[dt].elem_size; /* n <= NVL_MAX_NUMEL: no overflow */
  nvl_status st = storage_new(&t.storage, dev, bytes);
  if (st != NVL_OK) {
    char d[160], msg[512];
    snprintf(msg, sizeof msg, "%s", nvl_last_error());
    return nvl_error(st, "empty: %s (for a %s tensor)", msg, nvl_tensor_desc(&t, d, sizeof d));
  }
  *out = t;
  return NVL_OK;
}

void nvl_tensor_release(nvl_tensor *t) {
  if (!t) return;
  storage_unref(t->storage);
  t->storage = NULL;
}

void nvl_tensor_share(nvl_tensor *out, const nvl_tensor *t) {
  *out = *t;
  if (out->storage) out->storage->refcount++;
}

nvl_status nvl_tensor_check_live(const nvl_tensor *t, const char *op) {
  if (!t->storage) return nvl_error(NVL_ESTATE, "%s: tensor has been freed", op);
  return NVL_OK;
}

int nvl_tensor_same_device(const nvl_tensor *a, const nvl_tensor *b) {
  if (a->device != b->device) return 0;
  return a->device != NVL_CUDA || a->storage->device_index == b->storage->device_index;
}

int64_t nvl_tensor_numel(const nvl_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
  return n;
}

size_t nvl_tensor_nbytes(const nvl_tensor *t) {
  return (size_t)nvl_tensor_numel(t) * (size_t)nvl_dtypes[t->dtype].elem_size;
}

int nvl_tensor_is_contiguous(const nvl_tensor *t) {
  int64_t st = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->strides[d] != st) return 0;
    st *= t->shape[d];
  }
  return 1;
}

void *nvl_tensor_data(const nvl_tensor *t) {
  return (char *)t->storage->data + t->offset * nvl_dtypes[t->dtype].elem_size;
}

void *nvl_tensor_ptr(const nvl_tensor *t, const int64_t *idx) {
  int64_t off = t->offset;
  for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
  return (char *)t->storage->data + off * nvl_dtypes[t->dtype].elem_size;
}

const char *nvl_shape_str(const nvl_tensor *t, char *buf, size_t n) { return dims_str(t->ndim, t->shape, buf, n); }

const char *nvl_tensor_desc(const nvl_tensor *t, char *buf, size_t n) {
  char sh[160];
  snprintf(buf, n, "%s %s%s", nvl_shape_str(t, sh, sizeof sh), nvl_dtypes[t->dtype].name,
           t->device == NVL_CPU ? "" : " cuda");
  return buf;
}

/* ---- views ---- */

/* A 0-based index as the 1-based number a message shows (INT64_MAX stays itself). */
static long long one_based(int64_t i) { return i < INT64_MAX ? (long long)i + 1 : (long long)i; }

static nvl_status check_dim(const nvl_tensor *t, int dim, const char *op) {
  if (dim < 0 || dim >= t->ndim) {
    char sh[160];
    return nvl_error(NVL_EINVAL, "%s: dim %d out of range for a %d-D tensor %s", op, dim + 1, t->ndim,
                     nvl_shape_str(t, sh, sizeof sh));
  }
  return NVL_OK;
}

/* Resolve a requested shape (one -1 allowed) against t's element count. */
static nvl_status resolve_shape(const char *op, const nvl_tensor *t, int ndim, const int64_t *in, int64_t *shape) {
  char sh[160];
  if (ndim < 0 || ndim > NVL_MAX_DIMS) return nvl_error(NVL_EINVAL, "%s: %d dims, at most %d", op, ndim, NVL_MAX_DIMS);
  int64_t known, numel = nvl_tensor_numel(t);
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    shape[d] = in[d];
    if (shape[d] == -1) {
      if (infer >= 0) return nvl_error(NVL_EINVAL, "%s: only one dim can be -1", op);
      infer = d;
      shape[d] = 1; /* for the product of the others */
    } else if (shape[d] < 0) {
      return nvl_error(NVL_EINVAL, "%s: invalid size %lld in dim %d", op, (long long)shape[d], d + 1);
    }
  }
  NVL_TRY(nvl_shape_numel(op, ndim, shape, &known));
  if (infer >= 0) {
    if (known == 0 || numel % known)
      return nvl_error(NVL_EINVAL, "%s: cannot infer dim %d: %lld elements of %s do not divide by %lld", op,
                       infer + 1, (long long)numel, nvl_shape_str(t, sh, sizeof sh), (long long)known);
    shape[infer] = numel / known;
    known = numel;
  }
  if (known != numel)
    return nvl_error(NVL_EINVAL, "%s: shape has %lld elements, tensor %s has %lld", op, (long long)known,
                     nvl_shape_str(t, sh, sizeof sh), (long long)numel);
  return NVL_OK;
}

/* Strides for viewing t as shape without copying: 1 on success, 0 if the layout forbids it.
 * Walks t's dims from the innermost, grouping runs that are contiguous among themselves; each
 * run must be covered exactly by a run of new dims. */
static int view_strides(const nvl_tensor *t, int ndim, const int64_t *shape, int64_t *strides) {
  int64_t st = 1;
  for (int d = ndim - 1; d >= 0; d--) { strides[d] = st; st *= shape[d]; }
  if (t->ndim == 0 || nvl_tensor_numel(t) == 0) return 1;
  int vd = ndim - 1;
  int64_t base = t->strides[t->ndim - 1], tn = 1, vn = 1;
  for (int td = t->ndim - 1; td >= 0; td--) {
    tn *= t->shape[td];
    int run_ends = td == 0 || (t->shape[td - 1] != 1 && t->strides[td - 1] != tn * base);
    if (!run_ends) continue;
    while (vd >= 0 && (vn < tn || shape[vd] == 1)) {
      strides[vd] = vn * base;
      vn *= shape[vd];
      vd--;
    }
    if (vn != tn) return 0;
    if (td > 0) { base = t->strides[td - 1]; tn = 1; vn = 1; }
  }
  return vd == -1;
}

/* *out = the view v (holding a reference) once it is checked to lie within its storage. */
static nvl_status finish_view(nvl_tensor *out, nvl_tensor *v, const char *op) {
  nvl_status st = nvl_tensor_check_bounds(v, op);
  if (st != NVL_OK) {
    nvl_tensor_release(v);
    return st;
  }
  *out = *v;
  return NVL_OK;
}

nvl_status nvl_tensor_view(nvl_tensor *out, const nvl_tensor *t, int ndim, const int64_t *shape_in) {
  NVL_TRY(nvl_tensor_check_live(t, "view"));
  int64_t shape[NVL_MAX_DIMS], strides[NVL_MAX_DIMS];
  NVL_TRY(resolve_shape("view", t, ndim, shape_in, shape));
  if (!view_strides(t, ndim, shape, strides)) {
    char sh[160];
    return nvl_error(NVL_EINVAL, "view: the strides of %s do not allow this view without a copy; use reshape",
                     nvl_shape_str(t, sh, sizeof sh));
  }
  nvl_tensor v;
  nvl_tensor_share(&v, t);
  v.ndim = ndim;
  for (int d = 0; d < NVL_MAX_DIMS; d++) {
    v.shape[d] = d < ndim ? shape[d] : 1;
    v.strides[d] = d < ndim ? strides[d] : 0;
  }
  return finish_view(out, &v, "view");
}

nvl_status nvl_tensor_transpose(nvl_tensor *out, const nvl_tensor *t, int d0, int d1) {
  NVL_TRY(nvl_tensor_check_live(t, "transpose"));
  NVL_TRY(check_dim(t, d0, "transpose"));
  NVL_TRY(check_dim(t, d1, "transpose"));
  nvl_tensor v;
  nvl_tensor_share(&v, t);
  int64_t s = v.shape[d0]; v.shape[d0] = v.shape[d1]; v.shape[d1] = s;
  s = v.strides[d0]; v.strides[d0] = v.strides[d1]; v.strides[d1] = s;
  *out = v;
  return NVL_OK;
}

nvl_status nvl_tensor_permute(nvl_tensor *out, const nvl_tensor *t, const int *perm) {
  NVL_TRY(nvl_tensor_check_live(t, "permute"));
  int seen[NVL_MAX_DIMS] = {0};
  for (int d = 0; d < t->ndim; d++) {
    if (perm[d] < 0 || perm[d] >= t->ndim || seen[perm[d]])
      return nvl_error(NVL_EINVAL, "permute: dims must be a permutation of 1..%d", t->ndim);
    seen[perm[d]] = 1;
  }
  nvl_tensor v;
  nvl_tensor_share(&v, t);
  for (int d = 0; d < t->ndim; d++) {
    v.shape[d] = t->shape[perm[d]];
    v.strides[d] = t->strides[perm[d]];
  }
  *out = v;
  return NVL_OK;
}

nvl_status nvl_tensor_narrow(nvl_tensor *out, const nvl_tensor *t, int dim, int64_t start, int64_t len) {
  NVL_TRY(nvl_tensor_check_live(t, "narrow"));
  NVL_TRY(check_dim(t, dim, "narrow"));
  if (start < 0 || len < 0 || start > t->shape[dim] || len > t->shape[dim] - start) {
    char sh[160];
    return nvl_error(NVL_EINVAL, "narrow: start %lld, length %lld out of range for dim %d of size %lld (tensor %s)",
                     one_based(start), (long long)len, dim + 1, (long long)t->shape[dim],
                     nvl_shape_str(t, sh, sizeof sh));
  }
  nvl_tensor v;
  nvl_tensor_share(&v, t);
  int64_t step;
  if (nvl_mul_overflow(start, t->strides[dim], &step) || nvl_add_overflow(v.offset, step, &v.offset)) {
    nvl_tensor_release(&v);
    return nvl_error(NVL_EINVAL, "narrow: the offset of start %lld in dim %d overflows", one_based(start), dim + 1);
  }
  v.shape[dim] = len;
  return finish_view(out, &v, "narrow");
}

nvl_status nvl_tensor_select(nvl_tensor *out, const nvl_tensor *t, int dim, int64_t index) {
  NVL_TRY(nvl_tensor_check_live(t, "select"));
  NVL_TRY(check_dim(t, dim, "select"));
  if (index < 0 || index >= t->shape[dim]) {
    char sh[160];
    return nvl_error(NVL_EINVAL, "select: index %lld out of range for dim %d of size %lld (tensor %s)",
                     one_based(index), dim + 1, (long long)t->shape[dim], nvl_shape_str(t, sh, sizeof sh));
  }
  nvl_tensor v;
  nvl_tensor_share(&v, t);
  v.offset += index * t->strides[dim];
  for (int d = dim; d < t->ndim - 1; d++) {
    v.shape[d] = t->shape[d + 1];
    v.strides[d] = t->strides[d + 1];
  }
  v.ndim--;
  v.shape[v.ndim] = 1;
  v.strides[v.ndim] = 0;
  return finish_view(out, &v, "select");
}

nvl_status nvl_tensor_expand(nvl_tensor *out, const nvl_tensor *t, int ndim, const int64_t *shape) {
  NVL_TRY(nvl_tensor_check_live(t, "expand"));
  char sh[160];
  if (ndim < t->ndim || ndim > NVL_MAX_DIMS)
    return nvl_error(NVL_EINVAL, "expand: cannot expand %s to %d dims", nvl_shape_str(t, sh, sizeof sh), ndim);
  nvl_tensor v;
  nvl_tensor_share(&v, t);
  int lead = ndim - t->ndim;
  for (int d = ndim - 1; d >= 0; d--) {
    int od = d - lead;
    int64_t os = od >= 0 ? t->shape[od] : 1, ost = od >= 0 ? t->strides[od] : 0;
    if (shape[d] < 0) {
      nvl_tensor_release(&v);
      return nvl_error(NVL_EINVAL, "expand: invalid size %lld for dim %d of %s (sizes are >= 0; -1 keeps a dim of the "
                       "tensor)", (long long)shape[d], d + 1, nvl_shape_str(t, sh, sizeof sh));
    }
    if (os == shape[d]) {
      v.shape[d] = os;
      v.strides[d] = ost;
    } else if (os == 1) {
      v.shape[d] = shape[d];
      v.strides[d] = 0;
    } else {
      nvl_tensor_release(&v);
      return nvl_error(NVL_EINVAL, "expand: size %lld of dim %d of %s cannot become %lld", (long long)os, od + 1,
                       nvl_shape_str(t, sh, sizeof sh), (long long)shape[d]);
    }
  }
  v.ndim = ndim;
  return finish_view(out, &v, "expand");
}

nvl_status nvl_broadcast_shape(const nvl_tensor *a, const nvl_tensor *b, const char *op, int *ndim, int64_t *shape) {
  int n = a->ndim > b->ndim ? a->ndim : b->ndim;
  for (int d = 0; d < n; d++) {
    int da = d - (n - a->ndim), db = d - (n - b->ndim);
    int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      char s1[160], s2[160];
      return nvl_error(NVL_EINVAL, "%s: shapes %s and %s cannot be broadcast (dim %d: %lld vs %lld)", op,
                       nvl_tensor_desc(a, s1, sizeof s1), nvl_tensor_desc(b, s2, sizeof s2), d + 1,
                       (long long)sa, (long long)sb);
    }
    shape[d] = sa == 1 ? sb : sa;
  }
  int64_t numel; /* each operand fits; the broadcast of both may not */
  NVL_TRY(nvl_shape_numel(op, n, shape, &numel));
  *ndim = n;
  return NVL_OK;
}

/* ---- copies ---- */

/* dst = s on one device, s already expanded to dst's shape: one copy entry of the device's table.
 * Overlapping storage goes through a contiguous temporary. */
static nvl_status copy_on_device(nvl_tensor *dst, const nvl_tensor *s) {
  char s1[160], s2[160];
  if (!nvl_tensor_same_device(dst, s))
    return nvl_error(NVL_EUNSUPPORTED, "copy: %s and %s are on different GPUs (cuda:%d, cuda:%d)",
                     nvl_tensor_desc(s, s1, sizeof s1), nvl_tensor_desc(dst, s2, sizeof s2),
                     s->storage->device_index, dst->storage->device_index);
  const nvl_backend *be;
  NVL_PICK(be, dst, copy, "copy");
  int overlap = dst->storage == s->storage &&
                !(nvl_tensor_is_contiguous(dst) && nvl_tensor_is_contiguous(s) && dst->dtype == s->dtype);
  if (overlap) {
    nvl_tensor c = nvl_tensor_null();
    NVL_TRY(nvl_tensor_empty(&c, s->dtype, s->device, s->ndim, s->shape));
    nvl_status st = NVL_CALL(be, dst, copy, &c, s);
    if (st == NVL_OK) st = NVL_CALL(be, dst, copy, dst, &c);
    nvl_tensor_release(&c);
    return st;
  }
  return NVL_CALL(be, dst, copy, dst, s);
}

nvl_status nvl_tensor_copy(nvl_tensor *dst, const nvl_tensor *src) {
  NVL_TRY(nvl_tensor_check_live(dst, "copy"));
  NVL_TRY(nvl_tensor_check_live(src, "copy"));
  nvl_tensor s = nvl_tensor_null();
  nvl_status st = nvl_tensor_expand(&s, src, dst->ndim, dst->shape);
  if (st != NVL_OK) {
    char s1[160], s2[160];
    return nvl_error(NVL_EINVAL, "copy: source %s does not broadcast to destination %s",
                     nvl_tensor_desc(src, s1, sizeof s1), nvl_tensor_desc(dst, s2, sizeof s2));
  }
  if (dst->device == s.device) { /* one device (the host too) */
    st = copy_on_device(dst, &s);
    nvl_tensor_release(&s);
    return st;
  }
  /* Host <-> device: stage through a contiguous tensor of the destination's dtype; the device
   * side makes strided or broadcast layouts with its own copy. */
  nvl_device devd = dst->device != NVL_CPU ? dst->device : s.device;
  const nvl_device_api *api = nvl_device_api_for(devd, "copy");
  if (!api) {
    nvl_tensor_release(&s);
    return NVL_EUNSUPPORTED;
  }
  int64_t n = nvl_tensor_numel(dst);
  size_t bytes = (size_t)n * nvl_dtypes[dst->dtype].elem_size;
  if (s.device == NVL_CPU) { /* host -> device */
    nvl_tensor tmp = nvl_tensor_null(), dtmp = nvl_tensor_null();
    st = nvl_tensor_clone_to(&tmp, &s, dst->dtype, NVL_CPU); /* contiguous, dst's shape */
    nvl_tensor_release(&s);
    if (st == NVL_OK && nvl_tensor_is_contiguous(dst)) {
      st = api->memcpy(nvl_tensor_data(dst), nvl_tensor_data(&tmp), bytes, 0, dst->storage->device_index);
    } else if (st == NVL_OK) {
      st = nvl_tensor_empty(&dtmp, dst->dtype, dst->device, dst->ndim, dst->shape);
      if (st == NVL_OK) st = api->memcpy(nvl_tensor_data(&dtmp), nvl_tensor_data(&tmp), bytes, 0, dtmp.storage->device_index);
      if (st == NVL_OK) st = copy_on_device(dst, &dtmp);
    }
    nvl_tensor_release(&tmp);
    nvl_tensor_release(&dtmp);
    return st;
  }
  /* device -> host */
  nvl_tensor c = nvl_tensor_null(), tmp = nvl_tensor_null();
  if (nvl_tensor_is_contiguous(&s)) nvl_tensor_share(&c, &s);
  else { /* strided or broadcast on the device: gather it there first */
    st = nvl_tensor_empty(&c, s.dtype, s.device, s.ndim, s.shape);
    if (st == NVL_OK) st = copy_on_device(&c, &s);
  }
  nvl_tensor_release(&s);
  if (st == NVL_OK) st = nvl_tensor_empty(&tmp, c.dtype, NVL_CPU, c.ndim, c.shape);
  if (st == NVL_OK)
    st = api->memcpy(nvl_tensor_data(&tmp), nvl_tensor_data(&c), (size_t)n * nvl_dtypes[c.dtype].elem_size, 1,
                     c.storage->device_index);
  if (st == NVL_OK) st = nvl_tensor_copy(dst, &tmp); /* host: casts and dst's strides */
  nvl_tensor_release(&c);
  nvl_tensor_release(&tmp);
  return st;
}

nvl_status nvl_tensor_clone_to(nvl_tensor *out, const nvl_tensor *t, nvl_dtype dt, nvl_device dev) {
  NVL_TRY(nvl_tensor_check_live(t, "clone"));
  nvl_tensor r = nvl_tensor_null();
  NVL_TRY(nvl_tensor_empty(&r, dt, dev, t->ndim, t->shape));
  nvl_status st = nvl_tensor_copy(&r, t);
  if (st != NVL_OK) { nvl_tensor_release(&r); return st; }
  *out = r;
  return NVL_OK;
}

nvl_status nvl_tensor_contiguous(nvl_tensor *out, const nvl_tensor *t) {
  NVL_TRY(nvl_tensor_check_live(t, "contiguous"));
  if (nvl_tensor_is_contiguous(t)) {
    nvl_tensor_share(out, t);
    return NVL_OK;
  }
  return nvl_tensor_clone_to(out, t, t->dtype, t->device);
}

nvl_status nvl_tensor_reshape(nvl_tensor *out, const nvl_tensor *t, int ndim, const int64_t *shape_in) {
  NVL_TRY(nvl_tensor_check_live(t, "reshape"));
  int64_t shape[NVL_MAX_DIMS], strides[NVL_MAX_DIMS];
  NVL_TRY(resolve_shape("reshape", t, ndim, shape_in, shape));
  if (view_strides(t, ndim, shape, strides)) return nvl_tensor_view(out, t, ndim, shape);
  nvl_tensor c = nvl_tensor_null();
  NVL_TRY(nvl_tensor_clone_to(&c, t, t->dtype, t->device));
  nvl_status st = nvl_tensor_view(out, &c, ndim, shape);
  nvl_tensor_release(&c);
  return st;
}
