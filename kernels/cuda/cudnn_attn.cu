/* cudnn_attn.cu: attention through cuDNN's fused scaled-dot-product attention (contract in cudnn_attn.h).
 *
 * STATUS: compiles and links against cuDNN 9's headers; verified under the CUDA emulation only (its cuDNN
 * stand-in, kernels/cuda/emu/cudnn.cpp, checks every descriptor and attribute set here and computes the
 * attention on the CPU). It has not run on a GPU yet.
 *
 * Why the backend C API (cudnn_graph.h) and not the cudnn-frontend C++ headers: the frontend is itself a thin
 * layer that lowers its SDPA node to exactly these backend calls (cudnn-frontend include/cudnn_frontend/node/
 * scaled_dot_product_flash_attention.h, CompositeSDPANode and CompositeSDPABackwardNode); calling them here
 * keeps the C core free of a C++17 header library fetched at build time, makes the set of cuDNN calls small and
 * fixed — so the emulator's stand-in models exactly them, not whatever a frontend version emits — and lets the
 * library be opened with dlopen (the frontend links cuDNN unless built with its own dynamic-loading shim). The
 * cost is verbosity: the graphs below are written out op by op. They are the frontend's composite graphs for
 * causal (top-left), no bias, no dropout, no padding mask, fp32 intermediates and compute, op for op and in
 * its order, since those are the graphs cuDNN's fused engines are known to recognise: forward
 *   S = Q K^T; S *= scale; [row = index(S, 2); col = index(S, 3); S = row >= col ? S : -inf]
 *   M = rowmax(S); E = exp(S - M); L = rowsum(E); Stats = M + log(L); P = E / L (bf16); O = P V
 * and backward (softmax_sum and, unless deterministic, the fp32 dq accumulator are non-virtual tensors in the
 * workspace, as the frontend places them)
 *   softmax_sum = rowsum(dO * O) * 1; S = Q K^T * scale - Stats; [mask]; P = exp(S)
 *   dV = P^T dO (bf16 P^T; GQA: per query head, then summed over the group)
 *   dS = (dO V^T - softmax_sum) * P * scale; dK = dS^T Q (bf16 dS^T; GQA as dV)
 *   dq_accum = dS K (fp32); dQ = identity(dq_accum)          [deterministic: dQ = dS K directly]
 * Stats is the row logsumexp of the scaled, masked scores (natural log): the lse every nvlua attention route
 * saves, so forward and backward may come from different routes.
 *
 * Library loading: libcudnn is opened with dlopen at the first use (NVLUA_CUDNN_LIBRARY from the environment,
 * else the library CMake found, else the soname libcudnn.so.9 through the loader's path), so an nvlua built with
 * cuDNN starts and runs where it is missing: the route then falls back (or, asked for explicitly, refuses) with
 * the reason. cuDNN 9 opens its sub-libraries (libcudnn_graph, libcudnn_engines_*) by soname at run time; those
 * of the directory the library came from are opened first with RTLD_GLOBAL (as PyTorch does for its pip
 * cuDNN), so a pip install outside the loader's path works and a system cuDNN elsewhere is not mixed in.
 *
 * Plans: one execution plan per (device, direction, B, T, Hq, Hkv, D, causal, deterministic), built at the first
 * call (heuristics mode A, then the fallback list; the first engine config that finalises), kept with every
 * descriptor it was built from in a least-recently-used cache of NPLANS; a problem cuDNN has no engine for is
 * remembered (NREFUSED) and refused at once after (NVL_EUNSUPPORTED: attention=auto then falls back). Every call
 * runs under one mutex (plans are not evicted while in use). Work goes to the legacy default stream
 * (cudnnSetStream(h, 0)), like every kernel of this backend. bf16 only (the dtype is not in the key).
 * Not here: validation and allocation (core/flash_attention.c), the route choice (core/attention.c). */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cuda/cudnn_attn.h"

namespace {
nvl_cudnn_attn_stats stats;
}

#ifndef NVLUA_HAVE_CUDNN

static nvl_status not_built(const char *fn) {
  return nvl_error(NVL_EUNSUPPORTED, "%s: nvlua was built without cuDNN (cudnn_graph.h of cuDNN 9 was not found at "
                   "configure time: install the cuDNN 9 package or pip's nvidia-cudnn-cu13, or set CUDNN_ROOT, and "
                   "rebuild)", fn);
}
extern "C" nvl_status nvl_cuda_cudnn_attn_available(const char *fn, int dev) {
  (void)dev;
  return not_built(fn);
}
extern "C" nvl_status nvl_cuda_cudnn_attn_supported(const char *fn, int dev, int64_t B, int64_t T, int64_t Hq,
                                                    int64_t Hkv, int64_t D, int deterministic) {
  (void)dev, (void)B, (void)T, (void)Hq, (void)Hkv, (void)D, (void)deterministic;
  return not_built(fn);
}
extern "C" nvl_status nvl_cuda_cudnn_attn_fwd(nvl_kctx *, uint16_t *, float *, const uint16_t *, const uint16_t *,
                                              const uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                                              int) {
  return not_built("nvl_cuda_cudnn_attn_fwd");
}
extern "C" nvl_status nvl_cuda_cudnn_attn_bwd(nvl_kctx *, uint16_t *, uint16_t *, uint16_t *, const uint16_t *,
                                              const uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *,
                                              const float *, int64_t, int64_t, int64_t, int64_t, int64_t, double, int,
                                              int) {
  return not_built("nvl_cuda_cudnn_attn_bwd");
}
extern "C" void nvl_cuda_cudnn_attn_stats(nvl_cudnn_attn_stats *s) { *s = stats; }
extern "C" size_t nvl_cuda_cudnn_version(void) { return 0; }
extern "C" int nvl_cuda_cudnn_loads(char *why, size_t n) {
  if (why && n) snprintf(why, n, "nvlua was built without cuDNN");
  return 0;
}
extern "C" size_t nvl_cuda_cudnn_compiled_version(void) { return 0; }
extern "C" void nvl_cuda_cudnn_attn_clear_cache(void) {}
extern "C" int nvl_cuda_cudnn_attn_break(int what) {
  (void)what;
  return -1;
}

#else /* NVLUA_HAVE_CUDNN */

#include <cudnn_graph.h>
#ifndef NVL_CUDA_EMU
#include <dirent.h>
#include <dlfcn.h>
#endif

#define NVL_MAX_GPUS 16

namespace {

/* ---- the library -------------------------------------------------------------------------------------- */

/* The cuDNN functions this file calls, resolved at the first use. */
struct Api {
  int tried, ok;
  char why[700];
  size_t version;
  decltype(&cudnnGetVersion) GetVersion;
  decltype(&cudnnGetErrorString) GetErrorString;
  decltype(&cudnnGetLastErrorString) GetLastErrorString;
  decltype(&cudnnCreate) Create;
  decltype(&cudnnSetStream) SetStream;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor;
  decltype(&cudnnBackendSetAttribute) SetAttribute;
  decltype(&cudnnBackendGetAttribute) GetAttribute;
  decltype(&cudnnBackendFinalize) Finalize;
  decltype(&cudnnBackendExecute) Execute;
};
Api A;
pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* guards A, the handles, the plans and the stats */

#ifdef NVL_CUDA_EMU
/* The emulation build: cuDNN is the emulator's stand-in (kernels/cuda/emu/cudnn.cpp), linked in. */
bool open_library() {
  A.GetVersion = cudnnGetVersion;
  A.GetErrorString = cudnnGetErrorString;
  A.GetLastErrorString = cudnnGetLastErrorString;
  A.Create = cudnnCreate;
  A.SetStream = cudnnSetStream;
  A.CreateDescriptor = cudnnBackendCreateDescriptor;
  A.DestroyDescriptor = cudnnBackendDestroyDescriptor;
  A.SetAttribute = cudnnBackendSetAttribute;
  A.GetAttribute = cudnnBackendGetAttribute;
  A.Finalize = cudnnBackendFinalize;
  A.Execute = cudnnBackendExecute;
  /* NVLUA_EMU_CUDNN=missing: behave as a machine without the library (the fallback's tests) */
  const char *e = getenv("NVLUA_EMU_CUDNN");
  if (e && !strcmp(e, "missing")) {
    snprintf(A.why, sizeof A.why, "cannot load libcudnn.so.9: not found (NVLUA_EMU_CUDNN=missing: the emulator "
             "plays a machine without cuDNN)");
    return false;
  }
  return true;
}
#else
/* The sub-libraries beside the loaded libcudnn (libcudnn_graph first), opened RTLD_GLOBAL so that cuDNN's own
 * dlopen by soname finds these and not another install; best effort (a missing engine library surfaces as
 * cuDNN's own error when a plan needs it). */
void preload_sublibraries(void *sym) {
  Dl_info info;
  if (!dladdr(sym, &info) || !info.dli_fname) return;
  char dir[1024];
  snprintf(dir, sizeof dir, "%s", info.dli_fname);
  char *slash = strrchr(dir, '/');
  if (!slash) return; /* found through the loader's path by soname: its siblings are found the same way */
  *slash = 0;
  char path[1400];
  snprintf(path, sizeof path, "%s/libcudnn_graph.so.9", dir);
  (void)dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    const char *n = e->d_name;
    size_t len = strlen(n);
    if (strncmp(n, "libcudnn_", 9) || len < 6 || strcmp(n + len - 5, ".so.9")) continue;
    snprintf(path, sizeof path, "%s/%s", dir, n);
    (void)dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  }
  closedir(d);
}

bool open_library() {
  const char *cand[3];
  int n = 0;
  const char *env = getenv("NVLUA_CUDNN_LIBRARY");
  if (env && *env) cand[n++] = env;
#ifdef NVLUA_CUDNN_LIBRARY
  cand[n++] = NVLUA_CUDNN_LIBRARY;
#endif
  cand[n++] = "libcudnn.so.9";
  void *lib = NULL;
  size_t used = 0;
  A.why[0] = 0;
  for (int i = 0; i < n && !lib; i++) {
    lib = dlopen(cand[i], RTLD_NOW | RTLD_GLOBAL);
    if (!lib && used < sizeof A.why)
      used += (size_t)snprintf(A.why + used, sizeof A.why - used, "%scannot load %s (%s)", used ? "; " : "", cand[i],
                               dlerror());
  }
  if (!lib) return false;
  struct {
    void **fn;
    const char *name;
  } syms[] = {{(void **)&A.GetVersion, "cudnnGetVersion"},
              {(void **)&A.GetErrorString, "cudnnGetErrorString"},
              {(void **)&A.GetLastErrorString, "cudnnGetLastErrorString"},
              {(void **)&A.Create, "cudnnCreate"},
              {(void **)&A.SetStream, "cudnnSetStream"},
              {(void **)&A.CreateDescriptor, "cudnnBackendCreateDescriptor"},
              {(void **)&A.DestroyDescriptor, "cudnnBackendDestroyDescriptor"},
              {(void **)&A.SetAttribute, "cudnnBackendSetAttribute"},
              {(void **)&A.GetAttribute, "cudnnBackendGetAttribute"},
              {(void **)&A.Finalize, "cudnnBackendFinalize"},
              {(void **)&A.Execute, "cudnnBackendExecute"}};
  for (auto &s : syms) {
    *s.fn = dlsym(lib, s.name);
    if (!*s.fn) {
      snprintf(A.why, sizeof A.why, "the loaded libcudnn has no %s (not cuDNN 9?)", s.name);
      return false;
    }
  }
  preload_sublibraries((void *)A.GetVersion);
  return true;
}
#endif

/* Called with mu held. */
bool load() {
  if (A.tried) return A.ok;
  A.tried = 1;
  if (!open_library()) return false;
  A.version = A.GetVersion();
  const size_t v = A.version;
  if (v / 10000 != 9)
    snprintf(A.why, sizeof A.why, "the loaded cuDNN is %zu.%zu.%zu; this route is written for cuDNN 9", v / 10000,
             v / 100 % 100, v % 100);
  else if (v < 90600)
    snprintf(A.why, sizeof A.why, "cuDNN %zu.%zu.%zu is older than 9.6.0, the oldest this route takes (the dq "
             "accumulator needs clearing by the caller before 9.6)", v / 10000, v / 100 % 100, v % 100);
  else if (v == 91000 || v == 91001)
    snprintf(A.why, sizeof A.why, "cuDNN %zu.%zu.%zu has a known bf16 SDPA bug (cudnn-frontend refuses 9.10.0 and "
             "9.10.1); use 9.10.2 or newer", v / 10000, v / 100 % 100, v % 100);
  else
    A.ok = 1;
  return A.ok;
}

cudnnHandle_t handles[NVL_MAX_GPUS];

#ifdef NVL_CUDA_EMU
int brk; /* nvl_cuda_cudnn_attn_break: a rule broken on purpose (tests of the emulator's stand-in) */
#else
const int brk = NVL_CUDNN_BREAK_NONE;
#endif

nvl_status cudnn_fail(const char *fn, const char *what, cudnnStatus_t s) {
  char last[600] = "";
  if (A.GetLastErrorString) A.GetLastErrorString(last, sizeof last);
  const int cat = (int)s / 1000 * 1000;
  return nvl_error(cat == CUDNN_STATUS_NOT_SUPPORTED ? NVL_EUNSUPPORTED : NVL_EDEVICE, "%s: cuDNN %s failed: %s%s%s",
                   fn, what, A.GetErrorString(s), last[0] ? ": " : "", last);
}

/* The handle of dev (made current), created at the first use; mu held. */
nvl_status get_handle(const char *fn, int dev, cudnnHandle_t *h) {
  if (dev < 0 || dev >= NVL_MAX_GPUS) return nvl_error(NVL_EINVAL, "%s: device %d out of range", fn, dev);
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  if (!handles[dev]) {
    cudnnHandle_t x = NULL;
    cudnnStatus_t s = A.Create(&x);
    if (s != CUDNN_STATUS_SUCCESS) return cudnn_fail(fn, "cudnnCreate", s);
    s = A.SetStream(x, 0); /* the legacy default stream: every kernel of this backend runs there */
    if (s != CUDNN_STATUS_SUCCESS) return cudnn_fail(fn, "cudnnSetStream", s);
    handles[dev] = x;
  }
  *h = handles[dev];
  return NVL_OK;
}

/* mu held */
nvl_status available_locked(const char *fn, int dev) {
  if (!load()) return nvl_error(NVL_EUNSUPPORTED, "%s: cuDNN is not available: %s", fn, A.why);
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  const int cc = nvl_cuda_cc(dev);
  if (cc < 90)
    return nvl_error(NVL_EUNSUPPORTED, "%s: cuda:%d is sm_%d; this route runs on sm_90 (Hopper) or newer", fn, dev,
                     cc);
  return NVL_OK;
}

/* ---- the graphs ------------------------------------------------------------------------------------------ */

/* Unique ids of the tensors a variant pack binds; virtual tensors count up from VIRTUAL. */
enum : int64_t {
  UID_Q = 1, UID_K = 2, UID_V = 3, UID_O = 4, UID_STATS = 5, UID_SCALE = 6, UID_NEG_INF = 7, UID_DO = 8, UID_DQ = 9,
  UID_DK = 10, UID_DV = 11, UID_ONE = 12, UID_SOFTMAX_SUM = 13, UID_DQ_ACCUM = 14, UID_VIRTUAL = 100
};

typedef cudnnBackendDescriptor_t Desc;

/* Builds descriptors, remembering each (destroyed with the plan) and the first failure. */
struct Builder {
  const char *fn, *graph;
  nvl_status st;
  int64_t next_uid;
  Desc all[160];
  int nall;
  Desc ops[48];
  int nops;

  bool ok() const { return st == NVL_OK; }
  void fail(const char *what, cudnnStatus_t s) {
    if (!ok()) return;
    char w[200];
    snprintf(w, sizeof w, "%s (building the %s)", what, graph);
    st = cudnn_fail(fn, w, s);
  }
  Desc create(cudnnBackendDescriptorType_t t, const char *what) {
    if (!ok()) return NULL;
    if (nall == (int)(sizeof all / sizeof all[0])) {
      st = nvl_error(NVL_EINVAL, "%s: internal error: too many cuDNN descriptors for the %s", fn, graph);
      return NULL;
    }
    Desc d = NULL;
    cudnnStatus_t s = A.CreateDescriptor(t, &d);
    if (s != CUDNN_STATUS_SUCCESS) {
      char w[160];
      snprintf(w, sizeof w, "cudnnBackendCreateDescriptor of %s", what);
      fail(w, s);
      return NULL;
    }
    all[nall++] = d;
    return d;
  }
  void set(Desc d, cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, int64_t n, const void *v,
           const char *what) {
    if (!ok()) return;
    cudnnStatus_t s = A.SetAttribute(d, a, t, n, v);
    if (s != CUDNN_STATUS_SUCCESS) {
      char w[160];
      snprintf(w, sizeof w, "cudnnBackendSetAttribute(%s, attribute %d)", what, (int)a);
      fail(w, s);
    }
  }
  void finalize(Desc d, const char *what) {
    if (!ok()) return;
    cudnnStatus_t s = A.Finalize(d);
    if (s != CUDNN_STATUS_SUCCESS) {
      char w[160];
      snprintf(w, sizeof w, "cudnnBackendFinalize(%s)", what);
      fail(w, s);
    }
  }

  /* A 4-D tensor: dims and strides outermost first, 16-byte alignment (what the frontend declares; every
   * pointer nvlua binds is at least that aligned). */
  Desc tensor(int64_t uid, cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4], bool virt,
              bool by_value = false) {
    Desc d = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "a tensor");
    const int64_t align = brk == NVL_CUDNN_BREAK_ALIGNMENT && uid == UID_Q ? 12 : 16;
    set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
    set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, "tensor dimensions");
    set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, "tensor strides");
    set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor unique id");
    set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
    set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor is-virtual");
    if (by_value) set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by-value");
    finalize(d, "a tensor");
    if (brk == NVL_CUDNN_BREAK_FINALIZED && uid == UID_Q)
      set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor unique id, once finalized");
    if (brk == NVL_CUDNN_BREAK_DESTROYED && uid == UID_Q && ok()) {
      A.DestroyDescriptor(d);
      all[--nall] = NULL;
    }
    return d;
  }
  Desc virt(cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4]) {
    return tensor(next_uid++, dt, dim, str, true);
  }
  Desc scalar(int64_t uid) { /* a by-value fp32 scalar (scale, -inf, 1) */
    static const int64_t one[4] = {1, 1, 1, 1};
    return tensor(uid, CUDNN_DATA_FLOAT, one, one, false, true);
  }
  void add_op(Desc op) {
    if (!ok()) return;
    if (nops == (int)(sizeof ops / sizeof ops[0])) {
      st = nvl_error(NVL_EINVAL, "%s: internal error: too many operations in the %s", fn, graph);
      return;
    }
    ops[nops++] = op;
  }
  /* y = mode(x [, b [, t]]): b and t as the frontend binds them (BINARY_SELECT: y = t ? x : b) */
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, Desc x, Desc b, Desc t, Desc y, int64_t axis = -1) {
    Desc pw = create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "a pointwise descriptor");
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
    if (mode == CUDNN_POINTWISE_GEN_INDEX) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "axis");
    finalize(pw, "a pointwise descriptor");
    Desc op = create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "a pointwise operation");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pointwise op");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "pointwise x");
    if (b) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "pointwise b");
    if (t) set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, "pointwise t");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "pointwise y");
    const float one = 1.0f;
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha1");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha2");
    finalize(op, "a pointwise operation");
    add_op(op);
  }
  void reduction(cudnnReduceTensorOp_t r, Desc x, Desc y) {
    Desc rd = create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "a reduction descriptor");
    const cudnnDataType_t f = CUDNN_DATA_FLOAT;
    set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, "reduction compute type");
    set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &r, "reduction operator");
#if CUDNN_VERSION >= 91100
    if (A.version >= 91100) { /* the frontend sets it from 9.11 on (false: the default) */
      const bool det = false;
      set(rd, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &det, "reduction determinism");
    }
#endif
    finalize(rd, "a reduction descriptor");
    Desc op = create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "a reduction operation");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, "reduction op");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reduction x");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reduction y");
    finalize(op, "a reduction operation");
    add_op(op);
  }
  /* c = a b (batched over the first two dims; b's head dim may divide a's: GQA) */
  void matmul(Desc a, Desc b, Desc c) {
    Desc md = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "a matmul descriptor");
    const cudnnDataType_t f = CUDNN_DATA_FLOAT;
    set(md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, "matmul compute type");
    finalize(md, "a matmul descriptor");
    Desc op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "a matmul operation");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, "matmul a");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "matmul b");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, "matmul c");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md, "matmul op");
    finalize(op, "a matmul operation");
    add_op(op);
  }
  void reshape(Desc x, Desc y) {
    Desc op = create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "a reshape operation");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reshape x");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reshape y");
    finalize(op, "a reshape operation");
    add_op(op);
  }
  /* s = [causal mask](s): -inf where the key index (axis 3) exceeds the query index (axis 2) */
  Desc causal_mask(Desc s, const int64_t sd[4], const int64_t ss[4]) {
    Desc row = virt(CUDNN_DATA_INT32, sd, ss), col = virt(CUDNN_DATA_INT32, sd, ss);
    const bool swap = brk == NVL_CUDNN_BREAK_MASK_AXES;
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, s, NULL, NULL, row, swap ? 3 : 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, s, NULL, NULL, col, swap ? 2 : 3);
    Desc keep = virt(CUDNN_DATA_BOOLEAN, sd, ss);
    pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, NULL, keep);
    Desc masked = virt(CUDNN_DATA_FLOAT, sd, ss);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, scalar(UID_NEG_INF), keep, masked);
    return masked;
  }
};

/* What a plan is for. */
struct Key {
  int dev, backward, causal, deterministic;
  int64_t B, T, Hq, Hkv, D;
  bool operator==(const Key &o) const {
    return dev == o.dev && backward == o.backward && causal == o.causal && deterministic == o.deterministic &&
           B == o.B && T == o.T && Hq == o.Hq && Hkv == o.Hkv && D == o.D;
  }
};

struct Plan {
  bool used;
  uint64_t last_use;
  Key key;
  Desc descs[200]; /* every descriptor the plan was built from, destroyed with it */
  int ndescs;
  Desc plan;
  int64_t workspace;
};
const int NPLANS = 32;
Plan plans[NPLANS];
uint64_t plan_clock;

void destroy_plan(Plan *p) {
  for (int i = p->ndescs - 1; i >= 0; i--)
    if (p->descs[i]) A.DestroyDescriptor(p->descs[i]);
  memset(p, 0, sizeof *p);
}

/* The operations of key's graph into b (a builder of b.graph's name). */
void build_graph(Builder &b, const Key &k) {
  const int64_t B = k.B, T = k.T, Hq = k.Hq, Hkv = k.Hkv, D = k.D;
  /* nvlua's (B, T, H, D) layouts seen as cuDNN's (b, h, s, d) */
  const int64_t qd[4] = {B, Hq, T, D}, qs[4] = {T * Hq * D, D, Hq * D, 1};      /* q, out, dout, dq */
  const int64_t kd[4] = {B, Hkv, T, D}, ks[4] = {T * Hkv * D, D, Hkv * D, 1};   /* k, v, dk, dv */
  const int64_t ktd[4] = {B, Hkv, D, T}, kts[4] = {T * Hkv * D, D, 1, Hkv * D}; /* k^T, v^T */
  const int64_t sd[4] = {B, Hq, T, T}, ss[4] = {Hq * T * T, T * T, T, 1};       /* scores */
  const int64_t std_[4] = {B, Hq, T, T}, sts[4] = {Hq * T * T, T * T, 1, T};    /* scores transposed */
  const int64_t rd[4] = {B, Hq, T, 1}, rs[4] = {Hq * T, T, 1, 1};               /* per row: lse (B, Hq, T) */
  const int64_t fd[4] = {B, Hq, T, D}, fs[4] = {Hq * T * D, T * D, D, 1};       /* per query head (GQA, dq acc) */
  const cudnnDataType_t F = CUDNN_DATA_FLOAT, H = CUDNN_DATA_BFLOAT16;
  Desc Q = b.tensor(UID_Q, H, qd, qs, false), KT = b.tensor(UID_K, H, ktd, kts, false);
  const bool bad_stats = brk == NVL_CUDNN_BREAK_STATS_DIMS;
  Desc stats = b.tensor(UID_STATS, F, bad_stats ? sd : rd, bad_stats ? ss : rs, false), scale = b.scalar(UID_SCALE);
  if (!k.backward) {
    Desc V = b.tensor(UID_V, H, kd, ks, false);
    Desc O = b.tensor(brk == NVL_CUDNN_BREAK_DUP_UID ? UID_V : UID_O, H, qd, qs, false);
    Desc S = b.virt(F, sd, ss), S1 = b.virt(F, sd, ss);
    b.matmul(Q, KT, S);
    b.pointwise(CUDNN_POINTWISE_MUL, F, S, scale, NULL, S1);
    Desc S2 = k.causal ? b.causal_mask(S1, sd, ss) : S1;
    Desc M = b.virt(F, rd, rs), X = b.virt(F, sd, ss), E = b.virt(F, sd, ss), L = b.virt(F, rd, rs);
    b.reduction(CUDNN_REDUCE_TENSOR_MAX, S2, M);
    b.pointwise(CUDNN_POINTWISE_SUB, F, S2, M, NULL, X);
    b.pointwise(CUDNN_POINTWISE_EXP, F, X, NULL, NULL, E);
    b.reduction(CUDNN_REDUCE_TENSOR_ADD, E, L);
    Desc logL = b.virt(F, rd, rs);
    b.pointwise(CUDNN_POINTWISE_LOG, F, L, NULL, NULL, logL);
    b.pointwise(CUDNN_POINTWISE_ADD, F, M, logL, NULL, stats);
    Desc P = b.virt(brk == NVL_CUDNN_BREAK_P_TYPE ? F : H, sd, ss);
    b.pointwise(CUDNN_POINTWISE_DIV, F, E, L, NULL, P);
    b.matmul(P, V, O);
    return;
  }
  Desc VT = b.tensor(UID_V, H, ktd, kts, false), O = b.tensor(UID_O, H, qd, qs, false);
  Desc dO = b.tensor(UID_DO, H, qd, qs, false), dQ = b.tensor(UID_DQ, H, qd, qs, false);
  Desc dK = b.tensor(UID_DK, H, kd, ks, false), dV = b.tensor(UID_DV, H, kd, ks, false);
  /* softmax_sum = rowsum(dO * O) * 1 (the frontend's dropout-scale multiply, by 1 without dropout) */
  const int64_t ods[4] = {Hq * T * D, T * D, Hq * D, 1}; /* the frontend's strides for this virtual product */
  Desc dOO = b.virt(F, qd, ods), red = b.virt(F, rd, rs);
  Desc ssum = b.tensor(UID_SOFTMAX_SUM, F, rd, rs, false);
  b.pointwise(CUDNN_POINTWISE_MUL, F, dO, O, NULL, dOO);
  b.reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, red);
  b.pointwise(CUDNN_POINTWISE_MUL, F, red, b.scalar(UID_ONE), NULL, ssum);
  /* P = exp(Q K^T scale - Stats), masked */
  Desc S = b.virt(F, sd, ss), S1 = b.virt(F, sd, ss), S2 = b.virt(F, sd, ss);
  b.matmul(Q, KT, S);
  b.pointwise(CUDNN_POINTWISE_MUL, F, S, scale, NULL, S1);
  b.pointwise(CUDNN_POINTWISE_SUB, F, S1, stats, NULL, S2);
  Desc S3 = k.causal ? b.causal_mask(S2, sd, ss) : S2;
  Desc P = b.virt(F, sd, ss);
  b.pointwise(CUDNN_POINTWISE_EXP, F, S3, NULL, NULL, P);
  /* dV = P^T dO */
  Desc PT = b.virt(H, std_, sts);
  b.reshape(P, PT);
  if (Hq == Hkv) {
    b.matmul(PT, dO, dV);
  } else {
    Desc dVf = b.virt(H, fd, fs);
    b.matmul(PT, dO, dVf);
    b.reduction(CUDNN_REDUCE_TENSOR_ADD, dVf, dV);
  }
  /* dS = (dO V^T - softmax_sum) P scale */
  Desc dP = b.virt(F, sd, ss), dP1 = b.virt(F, sd, ss), dP2 = b.virt(F, sd, ss), dS = b.virt(F, sd, ss);
  b.matmul(dO, VT, dP);
  b.pointwise(CUDNN_POINTWISE_SUB, F, dP, ssum, NULL, dP1);
  b.pointwise(CUDNN_POINTWISE_MUL, F, dP1, P, NULL, dP2);
  b.pointwise(CUDNN_POINTWISE_MUL, F, dP2, scale, NULL, dS);
  /* dK = dS^T Q */
  Desc dST = b.virt(H, std_, sts);
  b.reshape(dS, dST);
  if (Hq == Hkv) {
    b.matmul(dST, Q, dK);
  } else {
    Desc dKf = b.virt(H, fd, fs);
    b.matmul(dST, Q, dKf);
    b.reduction(CUDNN_REDUCE_TENSOR_ADD, dKf, dK);
  }
  /* dQ = dS K (K: k^T reshaped back; fp32 like every virtual tensor the frontend leaves untyped) */
  Desc Kr = b.virt(F, kd, ks);
  b.reshape(KT, Kr);
  if (k.deterministic) {
    b.matmul(dS, Kr, dQ);
  } else {
    Desc acc = b.tensor(UID_DQ_ACCUM, F, fd, fs, false);
    b.matmul(dS, Kr, acc);
    b.pointwise(CUDNN_POINTWISE_IDENTITY, F, acc, NULL, NULL, dQ);
  }
}

/* The operation graph, the heuristics' engine configs and the first plan that finalises, into p. mu held. */
nvl_status build_plan(const char *fn, cudnnHandle_t h, const Key &k, Plan *p) {
  memset(p, 0, sizeof *p);
  p->key = k;
  Builder b;
  memset(&b, 0, sizeof b);
  b.fn = fn;
  b.graph = k.backward ? "SDPA backward graph" : "SDPA forward graph";
  b.st = NVL_OK;
  b.next_uid = UID_VIRTUAL;
  build_graph(b, k);
  Desc g = b.create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "the operation graph");
  b.set(g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "graph handle");
  b.set(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, b.nops, b.ops, "graph operations");
  b.finalize(g, "the operation graph");
  /* heuristics: mode A, then the fallback list; the first config whose plan finalises */
  Desc plan = NULL;
  char tried[700] = "";
  size_t used = 0;
  const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
  for (int m = 0; m < 2 && b.ok() && !plan; m++) {
    Desc heur = b.create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "the engine heuristics");
    b.set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g, "heuristics graph");
    b.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[m], "heuristics mode");
    if (!b.ok()) break;
    cudnnStatus_t s = A.Finalize(heur);
    int64_t count = 0;
    if (s == CUDNN_STATUS_SUCCESS) s = A.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                      CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL);
    if (s != CUDNN_STATUS_SUCCESS) {
      char last[500] = "";
      A.GetLastErrorString(last, sizeof last);
      if (m && used) last[0] = 0; /* the fallback's refusal repeats mode A's reason */
      if (used < sizeof tried)
        used += (size_t)snprintf(tried + used, sizeof tried - used, "%sheuristics %s: %s%s%s", used ? "; " : "",
                                 m ? "FALLBACK" : "A", A.GetErrorString(s), last[0] ? ": " : "", last);
      continue;
    }
    if (count > 16) count = 16;
    Desc cfgs[16];
    int64_t got = 0;
    for (int64_t i = 0; i < count; i++) cfgs[i] = b.create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "an engine config");
    if (!b.ok()) break;
    if (count > 0) {
      s = A.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfgs);
      if (s != CUDNN_STATUS_SUCCESS) {
        b.fail("reading the heuristics' engine configs", s);
        break;
      }
    }
    for (int64_t i = 0; i < got && !plan; i++) {
      Desc pl = b.create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "an execution plan");
      b.set(pl, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i], "plan config");
      if (!b.ok()) break;
      s = A.Finalize(pl);
      if (s == CUDNN_STATUS_SUCCESS) {
        plan = pl;
      } else if (used < sizeof tried) {
        used += (size_t)snprintf(tried + used, sizeof tried - used, "%sconfig %lld of mode %s: %s", used ? "; " : "",
                                 (long long)i, m ? "FALLBACK" : "A", A.GetErrorString(s));
      }
    }
    if (!plan && got == 0 && used < sizeof tried)
      used += (size_t)snprintf(tried + used, sizeof tried - used, "%sheuristics %s found no engine config",
                               used ? "; " : "", m ? "FALLBACK" : "A");
  }
  int64_t ws = 0;
  if (b.ok() && !plan)
    b.st = nvl_error(NVL_EUNSUPPORTED, "%s: cuDNN has no engine for the %s (B %lld, T %lld, Hq %lld, Hkv %lld, D "
                     "%lld%s%s): %s", fn, b.graph, (long long)k.B, (long long)k.T, (long long)k.Hq, (long long)k.Hkv,
                     (long long)k.D, k.causal ? ", causal" : "", k.deterministic ? ", deterministic" : "", tried);
  if (b.ok()) {
    int64_t n = 0;
    cudnnStatus_t s = A.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws);
    if (s != CUDNN_STATUS_SUCCESS) b.fail("reading the plan's workspace size", s);
    else if (n != 1 || ws < 0)
      b.st = nvl_error(NVL_EDEVICE, "%s: cuDNN reported a workspace size of %lld (%lld values)", fn, (long long)ws,
                       (long long)n);
  }
  if (!b.ok()) {
    for (int i = b.nall - 1; i >= 0; i--)
      if (b.all[i]) A.DestroyDescriptor(b.all[i]);
    return b.st;
  }
  p->used = true;
  p->plan = plan;
  p->workspace = ws;
  p->ndescs = b.nall;
  memcpy(p->descs, b.all, (size_t)b.nall * sizeof b.all[0]);
  return NVL_OK;
}

/* Problems cuDNN had no engine for (NVL_EUNSUPPORTED from build_plan), so that a route falling back does not
 * rebuild their graphs at every call: the last NREFUSED, with the message. */
const int NREFUSED = 16;
struct Refused {
  bool used;
  Key key;
  char why[700];
} refused[NREFUSED];
int next_refused;

/* The plan of key k, built if it is not cached (evicting the least recently used). mu held. */
nvl_status get_plan(const char *fn, cudnnHandle_t h, const Key &k, Plan **out) {
  for (int i = 0; i < NREFUSED; i++)
    if (refused[i].used && refused[i].key == k) return nvl_error(NVL_EUNSUPPORTED, "%s", refused[i].why);
  Plan *free_slot = NULL, *lru = NULL;
  for (int i = 0; i < NPLANS; i++) {
    Plan *p = &plans[i];
    if (p->used && p->key == k) {
      p->last_use = ++plan_clock;
      stats.cache_hits++;
      *out = p;
      return NVL_OK;
    }
    if (!p->used && !free_slot) free_slot = p;
    if (p->used && (!lru || p->last_use < lru->last_use)) lru = p;
  }
  Plan *slot = free_slot;
  if (!slot) {
    destroy_plan(lru);
    stats.evictions++;
    stats.cached--;
    slot = lru;
  }
  nvl_status st = build_plan(fn, h, k, slot);
  if (st == NVL_EUNSUPPORTED) {
    Refused &r = refused[next_refused++ % NREFUSED];
    r.used = true;
    r.key = k;
    snprintf(r.why, sizeof r.why, "%s", nvl_last_error());
    stats.refusals++;
    snprintf(stats.last_refusal, sizeof stats.last_refusal, "%s", r.why);
  }
  if (st != NVL_OK) return st;
  slot->last_use = ++plan_clock;
  stats.graphs_built++;
  stats.cached++;
  stats.last_workspace = (size_t)slot->workspace;
  *out = slot;
  return NVL_OK;
}

size_t round_up(size_t n) { return (n + 255) & ~(size_t)255; }

/* Execute p with the variant pack of uids/ptrs and the workspace. mu held. */
nvl_status execute(const char *fn, cudnnHandle_t h, Plan *p, const int64_t *uids, void *const *ptrs, int n,
                   void *ws) {
  int64_t u2[16];
  void *p2[16];
  if (brk == NVL_CUDNN_BREAK_NO_SCALE) { /* the same pack without the scale */
    int m = 0;
    for (int i = 0; i < n; i++)
      if (uids[i] != UID_SCALE) u2[m] = uids[i], p2[m++] = ptrs[i];
    uids = u2, ptrs = p2, n = m;
  }
  if (brk == NVL_CUDNN_BREAK_WORKSPACE) ws = NULL;
  if (brk == NVL_CUDNN_BREAK_OVERLAP && !p->key.backward) {
    memcpy(p2, ptrs, (size_t)n * sizeof *ptrs);
    p2[3] = p2[0]; /* O over Q */
    ptrs = p2;
  }
  Desc vp = NULL;
  cudnnStatus_t s = A.CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
  if (s != CUDNN_STATUS_SUCCESS) return cudnn_fail(fn, "creating the variant pack", s);
  const char *what = "setting the variant pack";
  s = A.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
  if (s == CUDNN_STATUS_SUCCESS)
    s = A.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
  if (s == CUDNN_STATUS_SUCCESS) s = A.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  if (s == CUDNN_STATUS_SUCCESS) {
    what = "finalizing the variant pack";
    s = A.Finalize(vp);
  }
  if (s == CUDNN_STATUS_SUCCESS) {
    what = "cudnnBackendExecute";
    s = A.Execute(h, p->plan, vp);
    stats.executions++;
  }
  A.DestroyDescriptor(vp);
  if (s != CUDNN_STATUS_SUCCESS) return cudnn_fail(fn, what, s);
  return nvl_cuda_check_launch(p->key.dev, fn, p->key.backward ? "cuDNN SDPA backward" : "cuDNN SDPA forward");
}

float neg_inf_value() { return A.version >= 91000 ? -INFINITY : -FLT_MAX; } /* the frontend's choice */

nvl_status supported_locked(const char *fn, int dev, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                            int deterministic) {
  NVL_TRY(available_locked(fn, dev));
  if (B < 1 || Hq < 1 || Hkv < 1)
    return nvl_error(NVL_EUNSUPPORTED, "%s: the cuDNN route takes no empty problem (B %lld, Hq %lld, Hkv %lld)", fn,
                     (long long)B, (long long)Hq, (long long)Hkv);
  if (D != 64 && D != 128)
    return nvl_error(NVL_EUNSUPPORTED, "%s: the cuDNN route takes head dim 64 or 128, got %lld", fn, (long long)D);
  if (T < 2)
    return nvl_error(NVL_EUNSUPPORTED, "%s: the cuDNN route needs T >= 2 (cuDNN's backward refuses s_q = s_kv = 1), "
                     "got T = %lld", fn, (long long)T);
  if (A.version <= 91500 && T % 128)
    return nvl_error(NVL_EUNSUPPORTED, "%s: with cuDNN %zu.%zu.%zu (9.15 or older) the cuDNN route needs T a multiple "
                     "of 128 (cudnn-frontend works around a backward bug there with a padding mask, not built here), "
                     "got T = %lld", fn, A.version / 10000, A.version / 100 % 100, A.version % 100, (long long)T);
  if (deterministic && nvl_cuda_cc(dev) >= 100)
    return nvl_error(NVL_EUNSUPPORTED, "%s: a deterministic cuDNN attention backward is built for Hopper only (on "
                     "sm_%d cudnn-frontend also pins an engine and its knobs, which this route does not)", fn,
                     nvl_cuda_cc(dev));
  return NVL_OK;
}

}  // namespace

extern "C" nvl_status nvl_cuda_cudnn_attn_available(const char *fn, int dev) {
  pthread_mutex_lock(&mu);
  nvl_status st = available_locked(fn, dev);
  pthread_mutex_unlock(&mu);
  return st;
}

extern "C" nvl_status nvl_cuda_cudnn_attn_supported(const char *fn, int dev, int64_t B, int64_t T, int64_t Hq,
                                                    int64_t Hkv, int64_t D, int deterministic) {
  pthread_mutex_lock(&mu);
  nvl_status st = supported_locked(fn, dev, B, T, Hq, Hkv, D, deterministic);
  pthread_mutex_unlock(&mu);
  return st;
}

extern "C" nvl_status nvl_cuda_cudnn_attn_fwd(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q,
                                              const uint16_t *k, const uint16_t *v, int64_t B, int64_t T, int64_t Hq,
                                              int64_t Hkv, int64_t D, double scale, int causal) {
  const char *fn = "attention_forward (cuDNN)";
  pthread_mutex_lock(&mu);
  nvl_status st = supported_locked(fn, ctx->dev, B, T, Hq, Hkv, D, 0);
  cudnnHandle_t h = NULL;
  Plan *p = NULL;
  if (st == NVL_OK) st = get_handle(fn, ctx->dev, &h);
  const Key key = {ctx->dev, 0, causal ? 1 : 0, 0, B, T, Hq, Hkv, D};
  if (st == NVL_OK) st = get_plan(fn, h, key, &p);
  void *ws = NULL;
  if (st == NVL_OK && p->workspace > 0) st = ctx->scratch(ctx, (size_t)p->workspace, &ws);
  if (st == NVL_OK) {
    float sc = (float)scale, ninf = neg_inf_value();
    const int64_t uids[8] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_NEG_INF};
    void *ptrs[8] = {(void *)q, (void *)k, (void *)v, out, lse, &sc, &ninf};
    st = execute(fn, h, p, uids, ptrs, causal ? 7 : 6, ws);
  }
  pthread_mutex_unlock(&mu);
  return st;
}

extern "C" nvl_status nvl_cuda_cudnn_attn_bwd(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                              const uint16_t *dout, const uint16_t *q, const uint16_t *k,
                                              const uint16_t *v, const uint16_t *out, const float *lse, int64_t B,
                                              int64_t T, int64_t Hq, int64_t Hkv, int64_t D, double scale, int causal,
                                              int deterministic) {
  const char *fn = "attention_backward (cuDNN)";
  pthread_mutex_lock(&mu);
  nvl_status st = supported_locked(fn, ctx->dev, B, T, Hq, Hkv, D, deterministic);
  cudnnHandle_t h = NULL;
  Plan *p = NULL;
  if (st == NVL_OK) st = get_handle(fn, ctx->dev, &h);
  const Key key = {ctx->dev, 1, causal ? 1 : 0, deterministic ? 1 : 0, B, T, Hq, Hkv, D};
  if (st == NVL_OK) st = get_plan(fn, h, key, &p);
  /* one scratch block: cuDNN's workspace, then softmax_sum (B, Hq, T) f32 and the dq accumulator (B, Hq, T, D) f32,
   * each at a 256-byte boundary */
  const size_t ws_bytes = p ? round_up((size_t)p->workspace) : 0, sum_bytes = round_up((size_t)(B * Hq * T) * 4);
  const size_t acc_bytes = deterministic ? 0 : round_up((size_t)(B * Hq * T * D) * 4);
  char *base = NULL;
  if (st == NVL_OK) st = ctx->scratch(ctx, ws_bytes + sum_bytes + acc_bytes, (void **)&base);
  if (st == NVL_OK) {
    float sc = (float)scale, ninf = neg_inf_value(), one = 1.0f;
    int64_t uids[16] = {UID_Q, UID_K, UID_V, UID_O, UID_DO, UID_STATS, UID_DQ, UID_DK, UID_DV, UID_SCALE, UID_ONE,
                        UID_SOFTMAX_SUM};
    void *ptrs[16] = {(void *)q, (void *)k, (void *)v, (void *)out, (void *)dout, (void *)lse, dq, dk, dv, &sc, &one,
                      base + ws_bytes};
    int n = 12;
    if (!deterministic) uids[n] = UID_DQ_ACCUM, ptrs[n++] = base + ws_bytes + sum_bytes;
    if (causal) uids[n] = UID_NEG_INF, ptrs[n++] = &ninf;
    st = execute(fn, h, p, uids, ptrs, n, p->workspace > 0 ? base : NULL);
  }
  pthread_mutex_unlock(&mu);
  return st;
}

extern "C" void nvl_cuda_cudnn_attn_stats(nvl_cudnn_attn_stats *s) {
  pthread_mutex_lock(&mu);
  *s = stats;
  pthread_mutex_unlock(&mu);
}

extern "C" size_t nvl_cuda_cudnn_version(void) {
  pthread_mutex_lock(&mu);
  (void)load();
  size_t v = A.version; /* also when load() refused it for its version */
  pthread_mutex_unlock(&mu);
  return v;
}

extern "C" size_t nvl_cuda_cudnn_compiled_version(void) { return CUDNN_VERSION; }

extern "C" int nvl_cuda_cudnn_loads(char *why, size_t n) {
  pthread_mutex_lock(&mu);
  (void)load();
  const int loaded = A.version > 0; /* opened, every symbol resolved, asked for its version */
  if (why && n) snprintf(why, n, "%s", loaded ? "" : A.why);
  pthread_mutex_unlock(&mu);
  return loaded;
}

extern "C" void nvl_cuda_cudnn_attn_clear_cache(void) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < NPLANS; i++)
    if (plans[i].used) destroy_plan(&plans[i]);
  memset(refused, 0, sizeof refused);
  stats.cached = 0;
  pthread_mutex_unlock(&mu);
}

extern "C" int nvl_cuda_cudnn_attn_break(int what) {
#ifdef NVL_CUDA_EMU
  if (what < 0 || what >= NVL_CUDNN_BREAK_COUNT) return -1;
  pthread_mutex_lock(&mu);
  const int prev = brk;
  brk = what;
  pthread_mutex_unlock(&mu);
  nvl_cuda_cudnn_attn_clear_cache();
  return prev;
#else
  (void)what;
  return -1;
#endif
}

#endif /* NVLUA_HAVE_CUDNN */
