/* cudnn.cpp: cuDNN's graph API on the CPU, for the emulation build: exactly the calls kernels/cuda/cudnn_attn.cu
 * makes, checked against the documented API, and a refusal (status + message through cudnnGetLastErrorString)
 * for anything else. What a GPU's cuDNN would run is computed here by a CPU reference of the fused attention.
 *
 * What is modelled:
 *   Handles: cudnnCreate on the current device, cudnnSetStream (a live stream of the handle's device). Execute
 *   needs the handle's device current and queues its work on the handle's stream (the emulator's stream-order
 *   checks apply to every tensor and the workspace it touches).
 *   Descriptors: create, set, finalize, get, destroy, with the documented rules: an attribute belongs to its
 *   descriptor type and has its documented attribute type and element count; a finalized descriptor takes no
 *   more attributes; a descriptor given as an attribute must be live, finalized and of the expected type; a
 *   destroyed descriptor is refused (what was built from it keeps what it needs). Tensors: data type, 4-D dims
 *   and strides (positive), unique id, byte alignment (a power of two), virtual / by-value (by-value: a
 *   non-virtual [1,1,1,1] tensor read from host memory at execution). Pointwise (ADD MUL SUB DIV EXP LOG IDENTITY
 *   CMP_GE GEN_INDEX BINARY_SELECT, their ports, broadcasting, alpha1 = alpha2 = 1), reduction (ADD, MAX; an
 *   output dim is the input's, 1, or a divisor of it: groups of consecutive indices, as GQA's gradients use),
 *   matmul (batched, the second operand's head dim may divide the first's), reshape (same element count).
 *   Operation graph: unique ids name one tensor each, every virtual tensor is produced by exactly one operation
 *   and read by one, a non-virtual one written by at most one.
 *   Heuristics (any mode) recognise exactly two patterns, the ones cudnn-frontend's composite SDPA nodes emit
 *   (scaled_dot_product_flash_attention.h: CompositeSDPANode, CompositeSDPABackwardNode): the forward and the
 *   backward of grouped-query attention, bf16 Q K V O dO dQ dK dV, fp32 intermediates and compute, by-value fp32
 *   scale, with or without the top-left causal mask (GEN_INDEX rows and columns, CMP_GE, BINARY_SELECT with a
 *   by-value fill), the fp32 Stats [b, h, s, 1] (logsumexp) written by the forward and read by the backward,
 *   K and V given transposed ([b, h, d, s] views), the backward's non-virtual softmax_sum and (unless
 *   deterministic) fp32 dQ accumulator; every op, tensor shape, stride of the head dim, data type, precision,
 *   axis and port is checked; any other graph is CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN with the first
 *   mismatch named. Head dim a multiple of 8 up to 256; s_q = s_kv = T (s_q = s_kv = 1 refused for the
 *   backward, as cuDNN does). One engine config per recognised graph; its plan asks for a workspace (forward
 *   and backward: B*Hq*T*4 bytes; deterministic backward: B*Hq*ceil64(T)^2*2, the frontend's dP workspace)
 *   that cudnnBackendExecute requires (device memory of that size, 16-byte aligned) and scribbles over.
 *   Variant packs: unique ids and pointers of every non-virtual tensor exactly once (no unknown ids), device
 *   pointers inside one allocation of the handle's device covering the tensor's extent, as aligned as the
 *   tensor declares; outputs overlapping another bound tensor are refused (in-place is not modelled).
 * The arithmetic (a model of a fused kernel, not cuDNN's exact order of operations): fp32 dot products in index
 * order, scores times scale, the mask's fill value where a key follows the query, row max, expf, fp32 row sums,
 * Stats = max + logf(sum); forward P = e / sum rounded to bf16 (the graph declares P bf16), out = sum_s P v in
 * fp32, rounded once; backward P = expf(scaled score - Stats), dP = dO v, softmax_sum = rowsum(dO * O) * one,
 * dS = (dP - softmax_sum) P scale; P and dS rounded to bf16 before their products with dO, Q and K (the
 * tensor-core operands a fused kernel uses: the graph's bf16 P^T, dS^T), dK and dV summed over the query heads of
 * a group in fp32, the fp32 accumulator then dQ rounded once. Results match a GPU's within the error bounds of
 * FlashAttention's numerics (tests/flash_bounds.lua), not bit for bit.
 *
 * Not modelled (refused): fp16, fp8, dropout, bias, padding masks, sequence lengths, ragged offsets, paged caches,
 * other masks or alignments of the diagonal, s_q != s_kv, knobs, serialisation, cuDNN's legacy API. */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cudnn_graph.h"
#include "dtype.h"
#include "emu.h"

struct nvl_emu_cudnn_handle {
  int dev;
  cudaStream_t stream;
};
struct nvl_emu_cudnn_desc {
  int unused;
};

namespace nvl_emu {
namespace {

thread_local cudnnStatus_t last_status = CUDNN_STATUS_SUCCESS;
thread_local char last_msg[1400];

cudnnStatus_t refuse(cudnnStatus_t s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
cudnnStatus_t refuse(cudnnStatus_t s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char m[1200];
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  last_status = s;
  snprintf(last_msg, sizeof last_msg, "%s [cuDNN stand-in of the cuda emulator]", m);
  return s;
}
cudnnStatus_t ok() { return CUDNN_STATUS_SUCCESS; }

const char *status_name(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_BAD_PARAM_NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
    case CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER: return "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER";
    case CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED: return "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED";
    case CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND: return "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND";
    case CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT: return "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT";
    case CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH";
    case CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH";
    case CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES: return "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES";
    case CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE: return "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE";
    case CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE: return "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN: return "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN";
    case CUDNN_STATUS_NOT_SUPPORTED_SHAPE: return "CUDNN_STATUS_NOT_SUPPORTED_SHAPE";
    case CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE: return "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE";
    case CUDNN_STATUS_NOT_SUPPORTED_LAYOUT: return "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT";
    case CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH: return "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    default: return "CUDNN_STATUS_INTERNAL_ERROR";
  }
}

/* ---- descriptors -------------------------------------------------------------------------------------- */

struct Obj;
typedef std::shared_ptr<Obj> Ref;

struct Attr {
  int type;
  int64_t count;
  std::vector<unsigned char> bytes;
  std::vector<Ref> refs; /* CUDNN_TYPE_BACKEND_DESCRIPTOR elements */
};

struct Ten {
  int64_t uid;
  int dt;
  int64_t dim[4], str[4];
  bool virt, byval;
  int64_t align;
};

/* A recognised attention graph: its dims and its non-virtual tensors. */
struct Problem {
  bool backward, causal, det;
  int64_t B, T, Hq, Hkv, D;
  Ten q, k, v, o, stats, dout, dq, dk, dv, ssum, acc; /* k (and v in the backward): the [b, h, d, s] views */
  int64_t scale_uid, fill_uid, one_uid;
};

struct Obj {
  int type;
  bool finalized = false;
  std::map<int, Attr> attrs;
  Ten ten{};                          /* tensor */
  int mode = 0, prec = 0;             /* pointwise descriptor / reduction operator, compute type */
  int64_t axis = -1;                  /* pointwise GEN_INDEX */
  Ref x, b, t, y, desc;               /* operations: pointwise x b t y; reduction x y; matmul a = x, b, c = y */
  std::vector<Ref> ops;               /* operation graph */
  std::map<int64_t, Ten> io;          /* operation graph: its non-virtual tensors by unique id */
  int dev = 0;                        /* operation graph, plan: the device */
  nvl_emu_cudnn_handle *handle = NULL;
  Ref graph;                          /* heuristics, engine config: the operation graph */
  std::shared_ptr<Problem> prob;      /* heuristics, engine config, plan */
  Ref cfg;                            /* plan */
  int64_t workspace = 0;              /* plan */
  std::vector<int64_t> uids;          /* variant pack */
  std::vector<void *> ptrs;
  void *ws = NULL;
};

std::map<const nvl_emu_cudnn_desc *, Ref> live;
std::set<const nvl_emu_cudnn_handle *> live_handles;

Ref lookup(const nvl_emu_cudnn_desc *d) {
  auto it = live.find(d);
  return it == live.end() ? Ref() : it->second;
}

const char *desc_name(int t) {
  switch (t) {
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR: return "CUDNN_BACKEND_POINTWISE_DESCRIPTOR";
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR: return "CUDNN_BACKEND_ENGINECFG_DESCRIPTOR";
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: return "CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR";
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: return "CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR";
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: return "CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR";
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: return "CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR";
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: return "CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR";
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR: return "CUDNN_BACKEND_TENSOR_DESCRIPTOR";
    case CUDNN_BACKEND_MATMUL_DESCRIPTOR: return "CUDNN_BACKEND_MATMUL_DESCRIPTOR";
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: return "CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR";
    case CUDNN_BACKEND_REDUCTION_DESCRIPTOR: return "CUDNN_BACKEND_REDUCTION_DESCRIPTOR";
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: return "CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR";
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: return "CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR";
    default: return "an unmodelled descriptor type";
  }
}
bool is_operation(int t) {
  return t == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR || t == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR ||
         t == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR || t == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR;
}
const char *dt_name(int t) {
  switch (t) {
    case CUDNN_DATA_FLOAT: return "FLOAT";
    case CUDNN_DATA_DOUBLE: return "DOUBLE";
    case CUDNN_DATA_HALF: return "HALF";
    case CUDNN_DATA_INT32: return "INT32";
    case CUDNN_DATA_BFLOAT16: return "BFLOAT16";
    case CUDNN_DATA_INT64: return "INT64";
    case CUDNN_DATA_BOOLEAN: return "BOOLEAN";
    default: return "an unmodelled data type";
  }
}
int dt_bytes(int t) {
  if (t == CUDNN_DATA_BFLOAT16 || t == CUDNN_DATA_HALF) return 2;
  if (t == CUDNN_DATA_BOOLEAN) return 1;
  return t == CUDNN_DATA_DOUBLE || t == CUDNN_DATA_INT64 ? 8 : 4;
}
const char *pw_name(int m) {
  switch (m) {
    case CUDNN_POINTWISE_ADD: return "ADD";
    case CUDNN_POINTWISE_MUL: return "MUL";
    case CUDNN_POINTWISE_DIV: return "DIV";
    case CUDNN_POINTWISE_SUB: return "SUB";
    case CUDNN_POINTWISE_EXP: return "EXP";
    case CUDNN_POINTWISE_LOG: return "LOG";
    case CUDNN_POINTWISE_IDENTITY: return "IDENTITY";
    case CUDNN_POINTWISE_CMP_GT: return "CMP_GT";
    case CUDNN_POINTWISE_CMP_GE: return "CMP_GE";
    case CUDNN_POINTWISE_CMP_LT: return "CMP_LT";
    case CUDNN_POINTWISE_GEN_INDEX: return "GEN_INDEX";
    case CUDNN_POINTWISE_BINARY_SELECT: return "BINARY_SELECT";
    default: return NULL;
  }
}
/* ports of a pointwise mode: 1 (x), 2 (x, b) or 3 (x, b, t) inputs */
int pw_inputs(int m) {
  switch (m) {
    case CUDNN_POINTWISE_EXP: case CUDNN_POINTWISE_LOG: case CUDNN_POINTWISE_IDENTITY: case CUDNN_POINTWISE_GEN_INDEX:
      return 1;
    case CUDNN_POINTWISE_BINARY_SELECT: return 3;
    default: return 2;
  }
}

/* The attributes each modelled descriptor type takes (the cuDNN 9 backend descriptor reference). */
struct Spec {
  int desc, attr, type;
  int64_t min, max;
  bool required;
  int ref; /* BACKEND_DESCRIPTOR: the descriptor type the elements must have (-1: any operation) */
  const char *name;
};
#define S_(d, a, t, lo, hi, req, ref) \
  {CUDNN_BACKEND_##d, CUDNN_ATTR_##a, CUDNN_TYPE_##t, lo, hi, req, ref, "CUDNN_ATTR_" #a}
const Spec specs[] = {
    S_(TENSOR_DESCRIPTOR, TENSOR_DATA_TYPE, DATA_TYPE, 1, 1, true, 0),
    S_(TENSOR_DESCRIPTOR, TENSOR_DIMENSIONS, INT64, 1, 8, true, 0),
    S_(TENSOR_DESCRIPTOR, TENSOR_STRIDES, INT64, 1, 8, true, 0),
    S_(TENSOR_DESCRIPTOR, TENSOR_UNIQUE_ID, INT64, 1, 1, true, 0),
    S_(TENSOR_DESCRIPTOR, TENSOR_BYTE_ALIGNMENT, INT64, 1, 1, true, 0),
    S_(TENSOR_DESCRIPTOR, TENSOR_IS_VIRTUAL, BOOLEAN, 1, 1, false, 0),
    S_(TENSOR_DESCRIPTOR, TENSOR_IS_BY_VALUE, BOOLEAN, 1, 1, false, 0),
    S_(POINTWISE_DESCRIPTOR, POINTWISE_MODE, POINTWISE_MODE, 1, 1, true, 0),
    S_(POINTWISE_DESCRIPTOR, POINTWISE_MATH_PREC, DATA_TYPE, 1, 1, true, 0),
    S_(POINTWISE_DESCRIPTOR, POINTWISE_AXIS, INT64, 1, 1, false, 0),
    S_(REDUCTION_DESCRIPTOR, REDUCTION_OPERATOR, REDUCTION_OPERATOR_TYPE, 1, 1, true, 0),
    S_(REDUCTION_DESCRIPTOR, REDUCTION_COMP_TYPE, DATA_TYPE, 1, 1, true, 0),
    S_(REDUCTION_DESCRIPTOR, REDUCTION_IS_DETERMINISTIC, BOOLEAN, 1, 1, false, 0),
    S_(MATMUL_DESCRIPTOR, MATMUL_COMP_TYPE, DATA_TYPE, 1, 1, true, 0),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_PW_DESCRIPTOR, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_POINTWISE_DESCRIPTOR),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_XDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_BDESC, BACKEND_DESCRIPTOR, 1, 1, false,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_YDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_TDESC, BACKEND_DESCRIPTOR, 1, 1, false,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_ALPHA1, FLOAT, 1, 1, false, 0),
    S_(OPERATION_POINTWISE_DESCRIPTOR, OPERATION_POINTWISE_ALPHA2, FLOAT, 1, 1, false, 0),
    S_(OPERATION_REDUCTION_DESCRIPTOR, OPERATION_REDUCTION_DESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_REDUCTION_DESCRIPTOR),
    S_(OPERATION_REDUCTION_DESCRIPTOR, OPERATION_REDUCTION_XDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_REDUCTION_DESCRIPTOR, OPERATION_REDUCTION_YDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_ADESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_BDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_CDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_MATMUL_DESCRIPTOR, OPERATION_MATMUL_DESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_MATMUL_DESCRIPTOR),
    S_(OPERATION_RESHAPE_DESCRIPTOR, OPERATION_RESHAPE_XDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATION_RESHAPE_DESCRIPTOR, OPERATION_RESHAPE_YDESC, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_TENSOR_DESCRIPTOR),
    S_(OPERATIONGRAPH_DESCRIPTOR, OPERATIONGRAPH_HANDLE, HANDLE, 1, 1, false, 0),
    S_(OPERATIONGRAPH_DESCRIPTOR, OPERATIONGRAPH_OPS, BACKEND_DESCRIPTOR, 1, 256, true, -1),
    S_(ENGINEHEUR_DESCRIPTOR, ENGINEHEUR_OPERATION_GRAPH, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR),
    S_(ENGINEHEUR_DESCRIPTOR, ENGINEHEUR_MODE, HEUR_MODE, 1, 1, true, 0),
    S_(EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_HANDLE, HANDLE, 1, 1, false, 0),
    S_(EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_ENGINE_CONFIG, BACKEND_DESCRIPTOR, 1, 1, true,
       CUDNN_BACKEND_ENGINECFG_DESCRIPTOR),
    S_(VARIANT_PACK_DESCRIPTOR, VARIANT_PACK_UNIQUE_IDS, INT64, 0, 256, true, 0),
    S_(VARIANT_PACK_DESCRIPTOR, VARIANT_PACK_DATA_POINTERS, VOID_PTR, 0, 256, true, 0),
    S_(VARIANT_PACK_DESCRIPTOR, VARIANT_PACK_WORKSPACE, VOID_PTR, 1, 1, true, 0),
};
#undef S_

const Spec *spec_of(int desc, int attr) {
  for (const Spec &s : specs)
    if (s.desc == desc && s.attr == attr) return &s;
  return NULL;
}
const char *attr_name(int desc, int attr) {
  const Spec *s = spec_of(desc, attr);
  return s ? s->name : "an attribute";
}

size_t type_size(int t) {
  switch (t) {
    case CUDNN_TYPE_HANDLE: return sizeof(cudnnHandle_t);
    case CUDNN_TYPE_BOOLEAN: return sizeof(bool);
    case CUDNN_TYPE_INT64: return 8;
    case CUDNN_TYPE_FLOAT: return 4;
    case CUDNN_TYPE_DOUBLE: return 8;
    case CUDNN_TYPE_VOID_PTR: return sizeof(void *);
    case CUDNN_TYPE_BACKEND_DESCRIPTOR: return sizeof(cudnnBackendDescriptor_t);
    default: return sizeof(int); /* the enum types */
  }
}

bool has(const Obj &o, int a) { return o.attrs.count(a) != 0; }
int64_t get_i64(const Obj &o, int a, int64_t i = 0) {
  int64_t v;
  memcpy(&v, o.attrs.at(a).bytes.data() + 8 * i, 8);
  return v;
}
int get_enum(const Obj &o, int a) {
  int v;
  memcpy(&v, o.attrs.at(a).bytes.data(), sizeof v);
  return v;
}
bool get_bool(const Obj &o, int a, bool dflt) {
  if (!has(o, a)) return dflt;
  bool v;
  memcpy(&v, o.attrs.at(a).bytes.data(), sizeof v);
  return v;
}
Ref get_ref(const Obj &o, int a) { return has(o, a) ? o.attrs.at(a).refs[0] : Ref(); }

std::string ten_str(const Ten &t) {
  char b[200];
  snprintf(b, sizeof b, "uid %lld [%lld,%lld,%lld,%lld] %s%s%s", (long long)t.uid, (long long)t.dim[0],
           (long long)t.dim[1], (long long)t.dim[2], (long long)t.dim[3], dt_name(t.dt), t.virt ? " virtual" : "",
           t.byval ? " by-value" : "");
  return b;
}
bool dims_are(const Ten &t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return t.dim[0] == a && t.dim[1] == b && t.dim[2] == c && t.dim[3] == d;
}

/* ---- finalize, per descriptor type ------------------------------------------------------------------------ */

cudnnStatus_t need(const Obj &o, std::initializer_list<int> attrs) {
  for (int a : attrs)
    if (!has(o, a))
      return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize(%s): the required %s is not set", desc_name(o.type),
                    attr_name(o.type, a));
  return ok();
}

cudnnStatus_t finalize_tensor(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_ATTR_TENSOR_STRIDES,
                             CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT});
  if (s) return s;
  Ten &t = o.ten;
  const int64_t nd = o.attrs[CUDNN_ATTR_TENSOR_DIMENSIONS].count;
  if (o.attrs[CUDNN_ATTR_TENSOR_STRIDES].count != nd)
    return refuse(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "tensor: %lld dimensions but %lld strides", (long long)nd,
                  (long long)o.attrs[CUDNN_ATTR_TENSOR_STRIDES].count);
  if (nd != 4)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, "tensor: %lld-D tensors are not modelled (4-D only)", (long long)nd);
  t.dt = get_enum(o, CUDNN_ATTR_TENSOR_DATA_TYPE);
  t.uid = get_i64(o, CUDNN_ATTR_TENSOR_UNIQUE_ID);
  t.align = get_i64(o, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT);
  t.virt = get_bool(o, CUDNN_ATTR_TENSOR_IS_VIRTUAL, false);
  t.byval = get_bool(o, CUDNN_ATTR_TENSOR_IS_BY_VALUE, false);
  for (int i = 0; i < 4; i++) {
    t.dim[i] = get_i64(o, CUDNN_ATTR_TENSOR_DIMENSIONS, i);
    t.str[i] = get_i64(o, CUDNN_ATTR_TENSOR_STRIDES, i);
    if (t.dim[i] < 1 || t.str[i] < 1)
      return refuse(t.dim[i] < 1 ? CUDNN_STATUS_BAD_PARAM : CUDNN_STATUS_NOT_SUPPORTED, "tensor uid %lld: dimension %d "
                    "is %lld with stride %lld (dims must be positive; zero or negative strides are not modelled)",
                    (long long)t.uid, i, (long long)t.dim[i], (long long)t.str[i]);
  }
  if (!strcmp(dt_name(t.dt), "an unmodelled data type"))
    return refuse(CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE, "tensor uid %lld: data type %d is not modelled",
                  (long long)t.uid, t.dt);
  if (t.align < 1 || (t.align & (t.align - 1)))
    return refuse(CUDNN_STATUS_BAD_PARAM, "tensor uid %lld: byte alignment %lld is not a power of two",
                  (long long)t.uid, (long long)t.align);
  if (t.byval && (t.virt || !dims_are(t, 1, 1, 1, 1)))
    return refuse(CUDNN_STATUS_BAD_PARAM, "tensor %s: a by-value tensor is a non-virtual [1,1,1,1] scalar",
                  ten_str(t).c_str());
  return ok();
}

cudnnStatus_t finalize_pointwise_desc(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_POINTWISE_MODE, CUDNN_ATTR_POINTWISE_MATH_PREC});
  if (s) return s;
  o.mode = get_enum(o, CUDNN_ATTR_POINTWISE_MODE);
  o.prec = get_enum(o, CUDNN_ATTR_POINTWISE_MATH_PREC);
  if (!pw_name(o.mode)) return refuse(CUDNN_STATUS_NOT_SUPPORTED, "pointwise mode %d is not modelled", o.mode);
  if (o.mode == CUDNN_POINTWISE_GEN_INDEX) {
    if (!has(o, CUDNN_ATTR_POINTWISE_AXIS))
      return refuse(CUDNN_STATUS_BAD_PARAM, "pointwise GEN_INDEX needs CUDNN_ATTR_POINTWISE_AXIS");
    o.axis = get_i64(o, CUDNN_ATTR_POINTWISE_AXIS);
    if (o.axis < 0 || o.axis > 3)
      return refuse(CUDNN_STATUS_BAD_PARAM, "GEN_INDEX axis %lld of a 4-D tensor", (long long)o.axis);
  } else if (has(o, CUDNN_ATTR_POINTWISE_AXIS)) {
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, "CUDNN_ATTR_POINTWISE_AXIS with mode %s is not modelled",
                  pw_name(o.mode));
  }
  return ok();
}

/* in broadcasts to out: same rank, each dim equal or 1 */
bool broadcasts(const Ten &in, const Ten &out) {
  for (int i = 0; i < 4; i++)
    if (in.dim[i] != out.dim[i] && in.dim[i] != 1) return false;
  return true;
}

cudnnStatus_t finalize_pointwise_op(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
                             CUDNN_ATTR_OPERATION_POINTWISE_YDESC});
  if (s) return s;
  o.desc = get_ref(o, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR);
  o.x = get_ref(o, CUDNN_ATTR_OPERATION_POINTWISE_XDESC);
  o.b = get_ref(o, CUDNN_ATTR_OPERATION_POINTWISE_BDESC);
  o.t = get_ref(o, CUDNN_ATTR_OPERATION_POINTWISE_TDESC);
  o.y = get_ref(o, CUDNN_ATTR_OPERATION_POINTWISE_YDESC);
  o.mode = o.desc->mode;
  o.prec = o.desc->prec;
  o.axis = o.desc->axis;
  const int n = pw_inputs(o.mode);
  if ((n >= 2) != (bool)o.b || (n == 3) != (bool)o.t)
    return refuse(CUDNN_STATUS_BAD_PARAM, "pointwise %s takes %s; %s given", pw_name(o.mode),
                  n == 1 ? "x only" : n == 2 ? "x and b (BDESC)" : "x, b and t (BDESC, TDESC)",
                  o.t ? (o.b ? "x, b and t" : "x and t") : o.b ? "x and b" : "x only");
  for (int a : {CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2})
    if (has(o, a)) {
      float v;
      memcpy(&v, o.attrs[a].bytes.data(), 4);
      if (v != 1.0f)
        return refuse(CUDNN_STATUS_NOT_SUPPORTED, "pointwise %s: %s = %g is not modelled (1 only)", pw_name(o.mode),
                      attr_name(o.type, a), v);
    }
  const Ten &y = o.y->ten;
  for (const Ref &r : {o.x, o.b, o.t})
    if (r && !broadcasts(r->ten, y))
      return refuse(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "pointwise %s: input %s does not broadcast to the output %s",
                    pw_name(o.mode), ten_str(r->ten).c_str(), ten_str(y).c_str());
  if (o.mode == CUDNN_POINTWISE_GEN_INDEX && !dims_are(o.x->ten, y.dim[0], y.dim[1], y.dim[2], y.dim[3]))
    return refuse(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "pointwise GEN_INDEX: the output has x's dims");
  return ok();
}

cudnnStatus_t finalize_reduction_desc(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_ATTR_REDUCTION_COMP_TYPE});
  if (s) return s;
  o.mode = get_enum(o, CUDNN_ATTR_REDUCTION_OPERATOR);
  o.prec = get_enum(o, CUDNN_ATTR_REDUCTION_COMP_TYPE);
  if (o.mode != CUDNN_REDUCE_TENSOR_ADD && o.mode != CUDNN_REDUCE_TENSOR_MAX)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, "reduction operator %d is not modelled (ADD and MAX are)", o.mode);
  return ok();
}

cudnnStatus_t finalize_reduction_op(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_ATTR_OPERATION_REDUCTION_XDESC,
                             CUDNN_ATTR_OPERATION_REDUCTION_YDESC});
  if (s) return s;
  o.desc = get_ref(o, CUDNN_ATTR_OPERATION_REDUCTION_DESC);
  o.x = get_ref(o, CUDNN_ATTR_OPERATION_REDUCTION_XDESC);
  o.y = get_ref(o, CUDNN_ATTR_OPERATION_REDUCTION_YDESC);
  o.mode = o.desc->mode;
  o.prec = o.desc->prec;
  /* each output dim: the input's, 1 (reduced), or a divisor of it (groups of consecutive indices reduced, the
   * frontend's "b (hk g) s d -> b hk s d" for GQA gradients) */
  for (int i = 0; i < 4; i++)
    if (o.x->ten.dim[i] % o.y->ten.dim[i])
      return refuse(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "reduction: output %s does not divide input %s dim by dim",
                    ten_str(o.y->ten).c_str(), ten_str(o.x->ten).c_str());
  return ok();
}

cudnnStatus_t finalize_matmul_op(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_ATTR_OPERATION_MATMUL_BDESC,
                             CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_ATTR_OPERATION_MATMUL_DESC});
  if (s) return s;
  o.x = get_ref(o, CUDNN_ATTR_OPERATION_MATMUL_ADESC);
  o.b = get_ref(o, CUDNN_ATTR_OPERATION_MATMUL_BDESC);
  o.y = get_ref(o, CUDNN_ATTR_OPERATION_MATMUL_CDESC);
  o.desc = get_ref(o, CUDNN_ATTR_OPERATION_MATMUL_DESC);
  o.prec = get_enum(*o.desc, CUDNN_ATTR_MATMUL_COMP_TYPE);
  const Ten &a = o.x->ten, &b = o.b->ten, &c = o.y->ten;
  bool good = a.dim[3] == b.dim[2] && c.dim[2] == a.dim[2] && c.dim[3] == b.dim[3];
  for (int i = 0; i < 2; i++) good = good && c.dim[i] == a.dim[i] && a.dim[i] % b.dim[i] == 0;
  if (!good)
    return refuse(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "matmul: A %s times B %s cannot give C %s (A [.., M, K], B "
                  "[.., K, N], C [.., M, N]; B's batch dims divide A's)", ten_str(a).c_str(), ten_str(b).c_str(),
                  ten_str(c).c_str());
  return ok();
}

cudnnStatus_t finalize_reshape_op(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_ATTR_OPERATION_RESHAPE_YDESC});
  if (s) return s;
  o.x = get_ref(o, CUDNN_ATTR_OPERATION_RESHAPE_XDESC);
  o.y = get_ref(o, CUDNN_ATTR_OPERATION_RESHAPE_YDESC);
  int64_t nx = 1, ny = 1;
  for (int i = 0; i < 4; i++) nx *= o.x->ten.dim[i], ny *= o.y->ten.dim[i];
  if (nx != ny)
    return refuse(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "reshape: %s and %s hold different numbers of elements",
                  ten_str(o.x->ten).c_str(), ten_str(o.y->ten).c_str());
  return ok();
}

cudnnStatus_t finalize_graph(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_OPERATIONGRAPH_OPS});
  if (s) return s;
  o.ops = o.attrs[CUDNN_ATTR_OPERATIONGRAPH_OPS].refs;
  if (has(o, CUDNN_ATTR_OPERATIONGRAPH_HANDLE)) {
    memcpy(&o.handle, o.attrs[CUDNN_ATTR_OPERATIONGRAPH_HANDLE].bytes.data(), sizeof o.handle);
    o.dev = o.handle->dev;
  } else {
    o.dev = current_device();
  }
  std::map<int64_t, const Obj *> by_uid;
  std::map<const Obj *, int> produced, read;
  std::set<const Obj *> seen_ops;
  for (const Ref &op : o.ops) {
    if (seen_ops.count(op.get()))
      return refuse(CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES, "the operation graph lists one operation twice");
    seen_ops.insert(op.get());
    for (const Ref &r : {op->x, op->b, op->t, op->y}) {
      if (!r) continue;
      auto it = by_uid.find(r->ten.uid);
      if (it != by_uid.end() && it->second != r.get())
        return refuse(CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES, "unique id %lld names two tensor descriptors in one "
                      "graph (%s and %s)", (long long)r->ten.uid, ten_str(it->second->ten).c_str(),
                      ten_str(r->ten).c_str());
      by_uid[r->ten.uid] = r.get();
      if (r == op->y) produced[r.get()]++;
      else read[r.get()]++;
    }
  }
  o.io.clear();
  for (auto &kv : by_uid) {
    const Obj *t = kv.second;
    const int p = produced.count(t) ? produced[t] : 0, r = read.count(t) ? read[t] : 0;
    if (t->ten.virt && p != 1)
      return refuse(CUDNN_STATUS_BAD_PARAM, "virtual tensor %s is produced by %d operations (one needed)",
                    ten_str(t->ten).c_str(), p);
    if (t->ten.virt && r == 0)
      return refuse(CUDNN_STATUS_BAD_PARAM, "virtual tensor %s is produced but never read", ten_str(t->ten).c_str());
    if (!t->ten.virt && p > 1)
      return refuse(CUDNN_STATUS_BAD_PARAM, "tensor %s is written by %d operations", ten_str(t->ten).c_str(), p);
    if (!t->ten.virt) o.io[kv.first] = t->ten;
  }
  return ok();
}

/* ---- the two graphs cuDNN's fused attention takes ----------------------------------------------------------- */

struct Matcher {
  const std::vector<Ref> &ops;
  std::set<const Obj *> used;
  std::string why;
  explicit Matcher(const std::vector<Ref> &o) : ops(o) {}

  bool fail(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (!why.empty()) return false;
    va_list ap;
    va_start(ap, fmt);
    char m[700];
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    why = m;
    return false;
  }
  static const char *kind(const Obj *op) {
    switch (op->type) {
      case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: return "a pointwise operation";
      case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: return "a matmul";
      case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: return "a reduction";
      default: return "a reshape";
    }
  }
  const Obj *producer(const Ref &t) {
    for (const Ref &op : ops)
      if (op->y == t) return op.get();
    return NULL;
  }
  /* the op of type `type` (pointwise: and mode) producing t; checks its precision */
  const Obj *made_by(const Ref &t, int type, int mode, int prec, const char *what) {
    if (!t) return (const Obj *)(fail("%s is missing", what), nullptr);
    const Obj *op = producer(t);
    if (!op) {
      fail("%s (%s) is not produced by any operation", what, ten_str(t->ten).c_str());
      return NULL;
    }
    if (op->type != type || (type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR && op->mode != mode) ||
        (type == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR && op->mode != mode)) {
      char found[80];
      if (op->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)
        snprintf(found, sizeof found, "pointwise %s", pw_name(op->mode));
      else
        snprintf(found, sizeof found, "%s", kind(op));
      const bool pwise = type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR;
      fail("%s (%s) must come from %s, found %s", what, ten_str(t->ten).c_str(),
           pwise ? pw_name(mode) : "the expected operation", found);
      return NULL;
    }
    if (used.count(op)) return (const Obj *)(fail("%s: one operation matched twice", what), nullptr);
    if (type != CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR && op->prec != prec)
      return (const Obj *)(fail("%s: the operation computes in %s; the fused attention takes %s", what,
                                dt_name(op->prec), dt_name(prec)), nullptr);
    used.insert(op);
    return op;
  }
  const Obj *pw(const Ref &t, int mode, const char *what, int prec = CUDNN_DATA_FLOAT) {
    return made_by(t, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, mode, prec, what);
  }
  const Obj *red(const Ref &t, int op, const char *what) {
    return made_by(t, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, op, CUDNN_DATA_FLOAT, what);
  }
  const Obj *mm(const Ref &t, const char *what) {
    return made_by(t, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, 0, CUDNN_DATA_FLOAT, what);
  }
  const Obj *rs(const Ref &t, const char *what) {
    return made_by(t, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, 0, 0, what);
  }
  /* the unique unused op of `type` (pointwise: mode) reading t as x (matmul: as A); NULL if none */
  const Obj *reader(const Ref &t, int type, int mode) {
    const Obj *found = NULL;
    for (const Ref &op : ops)
      if (op->type == type && op->x == t && !used.count(op.get()) &&
          (type != CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR || op->mode == mode)) {
        if (found) return NULL;
        found = op.get();
      }
    return found;
  }
  bool same(const Ref &a, const Ref &b, const char *what) {
    if (a != b) return fail("%s must be the same tensor (%s vs %s)", what, a ? ten_str(a->ten).c_str() : "none",
                            b ? ten_str(b->ten).c_str() : "none");
    return true;
  }
  bool tensor(const Ref &r, int dt, bool virt, int64_t a, int64_t b, int64_t c, int64_t d, const char *what) {
    if (!r) return fail("%s is missing", what);
    const Ten &t = r->ten;
    if (t.dt != dt) return fail("%s (%s) must be %s", what, ten_str(t).c_str(), dt_name(dt));
    if (t.virt != virt || t.byval)
      return fail("%s (%s) must be %s", what, ten_str(t).c_str(),
                  virt ? "virtual" : "a non-virtual tensor in device memory");
    if (!dims_are(t, a, b, c, d))
      return fail("%s (%s) must be [%lld,%lld,%lld,%lld]", what, ten_str(t).c_str(), (long long)a, (long long)b,
                  (long long)c, (long long)d);
    return true;
  }
  bool scalar(const Ref &r, const char *what) {
    if (!r) return fail("%s is missing", what);
    if (!r->ten.byval || r->ten.dt != CUDNN_DATA_FLOAT || !dims_are(r->ten, 1, 1, 1, 1))
      return fail("%s (%s) must be a by-value FLOAT [1,1,1,1] scalar", what, ten_str(r->ten).c_str());
    return true;
  }
  /* t has s's dims and strides with the last two swapped (the frontend's transposing reshape) */
  bool transposed(const Ref &t, const Ref &s, const char *what) {
    const Ten &a = t->ten, &b = s->ten;
    if (a.dim[0] != b.dim[0] || a.dim[1] != b.dim[1] || a.dim[2] != b.dim[3] || a.dim[3] != b.dim[2] ||
        a.str[0] != b.str[0] || a.str[1] != b.str[1] || a.str[2] != b.str[3] || a.str[3] != b.str[2])
      return fail("%s (%s) must be %s transposed in its last two dims (dims and strides swapped)", what,
                  ten_str(a).c_str(), ten_str(b).c_str());
    return true;
  }
  /* the causal mask on the way to `out` from `in`: returns in (through *in); causal set if present */
  bool mask(const Ref &out, Ref *in, bool *causal, int64_t *fill_uid, int64_t B, int64_t H, int64_t T) {
    const Obj *sel = producer(out);
    *causal = sel && sel->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR &&
              sel->mode == CUDNN_POINTWISE_BINARY_SELECT;
    if (!*causal) {
      *in = out;
      return true;
    }
    sel = pw(out, CUDNN_POINTWISE_BINARY_SELECT, "the masked scores");
    if (!sel || !scalar(sel->b, "the mask's fill value (BINARY_SELECT's b)")) return false;
    *fill_uid = sel->b->ten.uid;
    const Obj *cmp = pw(sel->t, CUDNN_POINTWISE_CMP_GE, "the causal mask (BINARY_SELECT's t: row >= column)",
                        CUDNN_DATA_BOOLEAN);
    if (!cmp || !tensor(sel->t, CUDNN_DATA_BOOLEAN, true, B, H, T, T, "the causal mask")) return false;
    const Obj *row = pw(cmp->x, CUDNN_POINTWISE_GEN_INDEX, "the mask's row index (CMP_GE's x)");
    const Obj *col = pw(cmp->b, CUDNN_POINTWISE_GEN_INDEX, "the mask's column index (CMP_GE's b)");
    if (!row || !col) return false;
    if (row->axis != 2 || col->axis != 3)
      return fail("the causal mask compares GEN_INDEX axis %lld >= axis %lld; the top-left causal mask is axis 2 (the "
                  "query) >= axis 3 (the key)", (long long)row->axis, (long long)col->axis);
    if (!tensor(cmp->x, CUDNN_DATA_INT32, true, B, H, T, T, "the row index") ||
        !tensor(cmp->b, CUDNN_DATA_INT32, true, B, H, T, T, "the column index"))
      return false;
    if (!same(row->x, sel->x, "the row index's input and the masked scores") ||
        !same(col->x, sel->x, "the column index's input and the masked scores"))
      return false;
    *in = sel->x;
    return true;
  }
  bool all_used() {
    if (used.size() == ops.size()) return true;
    for (const Ref &op : ops)
      if (!used.count(op.get()))
        return fail("%zu operation(s) are not part of the pattern, the first %s%s%s", ops.size() - used.size(),
                    kind(op.get()), op->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR ? " " : "",
                    op->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR ? pw_name(op->mode) : "");
    return false;
  }
  /* shape rules shared by both directions; D from q, T, heads */
  bool dims(Problem &p, const Ref &q, const Ref &kt) {
    p.B = q->ten.dim[0], p.Hq = q->ten.dim[1], p.T = q->ten.dim[2], p.D = q->ten.dim[3];
    p.Hkv = kt->ten.dim[1];
    if (p.D % 8 || p.D > 256)
      return fail("head dim %lld: cuDNN's fused attention takes multiples of 8 up to 256", (long long)p.D);
    if (p.Hq % p.Hkv) return fail("Hq = %lld is not a multiple of Hkv = %lld", (long long)p.Hq, (long long)p.Hkv);
    if (!tensor(kt, CUDNN_DATA_BFLOAT16, false, p.B, p.Hkv, p.D, p.T, "K^T (the first matmul's B)")) return false;
    if (q->ten.str[3] != 1 || kt->ten.str[2] != 1)
      return fail("the head dim must have stride 1 in Q and K (Q %lld, K^T %lld)", (long long)q->ten.str[3],
                  (long long)kt->ten.str[2]);
    return true;
  }

  bool forward(Problem &p) {
    p.backward = false;
    const Obj *m2 = NULL;
    for (const Ref &op : ops)
      if (op->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR && !op->y->ten.virt) {
        if (m2) return fail("the forward pattern has one matmul with a non-virtual output (O = P V), found two");
        m2 = op.get();
      }
    if (!m2) return fail("no matmul writes a non-virtual tensor: no O = P V");
    const Ref O = m2->y, P = m2->x, V = m2->b;
    const Obj *m2c = mm(O, "O");
    if (!m2c) return false;
    const Obj *div = pw(P, CUDNN_POINTWISE_DIV, "P (the P V matmul's A)");
    if (!div) return false;
    const Ref E = div->x, L = div->b;
    const Obj *ex = pw(E, CUDNN_POINTWISE_EXP, "P's numerator exp(S - max)");
    const Obj *sum = red(L, CUDNN_REDUCE_TENSOR_ADD, "P's denominator (the row sum of the exps)");
    if (!ex || !sum || !same(sum->x, E, "the row sum's input and the exps")) return false;
    const Obj *sub = pw(ex->x, CUDNN_POINTWISE_SUB, "exp's input S - max");
    if (!sub) return false;
    const Ref S2 = sub->x, M = sub->b;
    const Obj *mx = red(M, CUDNN_REDUCE_TENSOR_MAX, "the row max");
    if (!mx || !same(mx->x, S2, "the row max's input and the scores")) return false;
    const Obj *add = reader(M, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_POINTWISE_ADD);
    if (!add) return fail("no pointwise ADD of the row max and log(row sum): no Stats");
    const Ref stats = add->y;
    if (!pw(stats, CUDNN_POINTWISE_ADD, "Stats")) return false;
    const Obj *lg = pw(add->b, CUDNN_POINTWISE_LOG, "Stats' log(row sum)");
    if (!lg || !same(lg->x, L, "the log's input and the row sum")) return false;
    Ref S1;
    int64_t fill = 0;
    const int64_t B = O->ten.dim[0], Hq = O->ten.dim[1], T = O->ten.dim[2];
    if (!mask(S2, &S1, &p.causal, &fill, B, Hq, T)) return false;
    const Obj *mul = pw(S1, CUDNN_POINTWISE_MUL, "the scaled scores");
    if (!mul || !scalar(mul->b, "the attention scale")) return false;
    const Obj *m1 = mm(mul->x, "the scores Q K^T");
    if (!m1 || !all_used()) return false;
    const Ref Q = m1->x, KT = m1->b;
    if (!tensor(Q, CUDNN_DATA_BFLOAT16, false, B, Hq, T, Q->ten.dim[3], "Q") || !dims(p, Q, KT)) return false;
    const int64_t D = p.D, Hkv = p.Hkv;
    if (!tensor(V, CUDNN_DATA_BFLOAT16, false, B, Hkv, T, D, "V") ||
        !tensor(O, CUDNN_DATA_BFLOAT16, false, B, Hq, T, D, "O") ||
        !tensor(P, CUDNN_DATA_BFLOAT16, true, B, Hq, T, T, "P (the P V matmul's A has the inputs' type, bf16)") ||
        !tensor(stats, CUDNN_DATA_FLOAT, false, B, Hq, T, 1, "Stats"))
      return false;
    for (const Ref &r : {mul->x, S1, S2, ex->x, E})
      if (!tensor(r, CUDNN_DATA_FLOAT, true, B, Hq, T, T, "an fp32 score tensor")) return false;
    for (const Ref &r : {M, L, add->b})
      if (!tensor(r, CUDNN_DATA_FLOAT, true, B, Hq, T, 1, "a row statistic")) return false;
    if (V->ten.str[3] != 1 || O->ten.str[3] != 1) return fail("the head dim must have stride 1 in V and O");
    p.q = Q->ten, p.k = KT->ten, p.v = V->ten, p.o = O->ten, p.stats = stats->ten;
    p.scale_uid = mul->b->ten.uid, p.fill_uid = fill, p.det = false;
    return true;
  }

  bool backward(Problem &p) {
    p.backward = true;
    /* softmax_sum = rowsum(dO * O) * one */
    const Obj *ss = NULL;
    for (const Ref &op : ops)
      if (op->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR && op->mode == CUDNN_POINTWISE_MUL &&
          !op->y->ten.virt && op->y->ten.dt == CUDNN_DATA_FLOAT) {
        if (ss) return fail("two pointwise MULs write a non-virtual FLOAT tensor (one is softmax_sum)");
        ss = op.get();
      }
    if (!ss) return fail("no softmax_sum: the non-virtual FLOAT output of rowsum(dO * O) * 1");
    const Ref SSUM = ss->y;
    if (!pw(SSUM, CUDNN_POINTWISE_MUL, "softmax_sum") || !scalar(ss->b, "softmax_sum's factor (1 without dropout)"))
      return false;
    const Obj *r = red(ss->x, CUDNN_REDUCE_TENSOR_ADD, "rowsum(dO * O)");
    if (!r) return false;
    const Obj *doo = pw(r->x, CUDNN_POINTWISE_MUL, "dO * O");
    if (!doo) return false;
    const Ref dO = doo->x, O = doo->b;
    const int64_t B = dO->ten.dim[0], Hq = dO->ten.dim[1], T = dO->ten.dim[2], D = dO->ten.dim[3];
    /* dS = (dO V^T - softmax_sum) * P * scale */
    const Obj *mdp = reader(dO, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, 0);
    if (!mdp) return fail("no matmul dP = dO V^T (a single matmul with A = dO)");
    const Ref dP = mdp->y, VT = mdp->b;
    if (!mm(dP, "dP")) return false;
    const Obj *s1 = reader(dP, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_POINTWISE_SUB);
    if (!s1 || !pw(s1->y, CUDNN_POINTWISE_SUB, "dP - softmax_sum") ||
        !same(s1->b, SSUM, "dP - softmax_sum's b and softmax_sum"))
      return fail("no dP - softmax_sum");
    const Obj *m1 = reader(s1->y, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_POINTWISE_MUL);
    if (!m1 || !pw(m1->y, CUDNN_POINTWISE_MUL, "(dP - softmax_sum) * P")) return fail("no (dP - softmax_sum) * P");
    const Ref P = m1->b;
    const Obj *m2 = reader(m1->y, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_POINTWISE_MUL);
    if (!m2 || !pw(m2->y, CUDNN_POINTWISE_MUL, "dS") || !scalar(m2->b, "dS's scale"))
      return fail("no dS = ... * scale");
    const Ref dS = m2->y;
    /* P = exp(mask(Q K^T scale - Stats)) */
    const Obj *ex = pw(P, CUDNN_POINTWISE_EXP, "P (the second factor of dS)");
    if (!ex) return false;
    Ref S2;
    int64_t fill = 0;
    if (!mask(ex->x, &S2, &p.causal, &fill, B, Hq, T)) return false;
    const Obj *sub = pw(S2, CUDNN_POINTWISE_SUB, "the scaled scores minus Stats");
    if (!sub) return false;
    const Ref stats = sub->b;
    const Obj *mul = pw(sub->x, CUDNN_POINTWISE_MUL, "the scaled scores");
    if (!mul || !same(mul->b, m2->b, "the scores' scale and dS's scale")) return false;
    const Obj *mqk = mm(mul->x, "the scores Q K^T");
    if (!mqk) return false;
    const Ref Q = mqk->x, KT = mqk->b;
    /* dV = P^T dO, dK = dS^T Q (GQA: per query head, then a reduction over the group) */
    Ref outs[2];
    const Ref srcs[2] = {P, dS}, rhs[2] = {dO, Q};
    const char *names[2] = {"dV", "dK"};
    for (int i = 0; i < 2; i++) {
      const Obj *rsh = reader(srcs[i], CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, 0);
      if (!rsh || !rs(rsh->y, i ? "dS^T" : "P^T")) return fail("no reshape %s^T", i ? "dS" : "P");
      if (!transposed(rsh->y, srcs[i], i ? "dS^T" : "P^T") ||
          !tensor(rsh->y, CUDNN_DATA_BFLOAT16, true, B, Hq, T, T,
                  i ? "dS^T (bf16 for the tensor cores)" : "P^T (bf16)"))
        return false;
      const Obj *mt = reader(rsh->y, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, 0);
      if (!mt || !mm(mt->y, names[i]) || !same(mt->b, rhs[i], i ? "dK's B and Q" : "dV's B and dO")) 
        return fail("no matmul %s = %s^T %s", names[i], i ? "dS" : "P", i ? "Q" : "dO");
      outs[i] = mt->y;
      if (mt->y->ten.virt) { /* GQA */
        if (!tensor(mt->y, CUDNN_DATA_BFLOAT16, true, B, Hq, T, D, "the per-query-head gradient")) return false;
        const Obj *rd = reader(mt->y, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, 0);
        if (!rd || rd->mode != CUDNN_REDUCE_TENSOR_ADD || !red(rd->y, CUDNN_REDUCE_TENSOR_ADD, names[i]))
          return fail("the per-query-head %s must be summed over the group by a reduction ADD", names[i]);
        outs[i] = rd->y;
      }
    }
    /* dQ = dS K: through the fp32 accumulator (identity) or directly (deterministic) */
    const Obj *rk = reader(KT, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, 0);
    if (!rk || !rs(rk->y, "K (K^T reshaped back)") || !transposed(rk->y, KT, "K (K^T reshaped back)"))
      return fail("no reshape of K^T back to K for dQ = dS K");
    const Obj *mq = NULL;
    for (const Ref &op : ops)
      if (op->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR && op->x == dS && op->b == rk->y) mq = op.get();
    if (!mq || !mm(mq->y, "dQ (or its accumulator)")) return fail("no matmul dQ = dS K");
    Ref dQ = mq->y;
    p.det = true;
    if (dQ->ten.dt == CUDNN_DATA_FLOAT) {
      p.det = false;
      if (!tensor(dQ, CUDNN_DATA_FLOAT, false, B, Hq, T, D, "the dQ accumulator")) return false;
      p.acc = dQ->ten;
      const Obj *id = reader(dQ, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_POINTWISE_IDENTITY);
      if (!id || !pw(id->y, CUDNN_POINTWISE_IDENTITY, "dQ"))
        return fail("the dQ accumulator must be copied to dQ by IDENTITY");
      dQ = id->y;
    }
    if (!all_used()) return false;
    if (!tensor(Q, CUDNN_DATA_BFLOAT16, false, B, Hq, T, D, "Q") || !dims(p, Q, KT)) return false;
    const int64_t Hkv = p.Hkv;
    if (p.T < 2) return fail("s_q = s_kv = 1: cuDNN's attention backward refuses it");
    if (!tensor(VT, CUDNN_DATA_BFLOAT16, false, B, Hkv, D, T, "V^T (dP's B)") ||
        !tensor(O, CUDNN_DATA_BFLOAT16, false, B, Hq, T, D, "O") ||
        !tensor(dO, CUDNN_DATA_BFLOAT16, false, B, Hq, T, D, "dO") ||
        !tensor(dQ, CUDNN_DATA_BFLOAT16, false, B, Hq, T, D, "dQ") ||
        !tensor(outs[1], CUDNN_DATA_BFLOAT16, false, B, Hkv, T, D, "dK") ||
        !tensor(outs[0], CUDNN_DATA_BFLOAT16, false, B, Hkv, T, D, "dV") ||
        !tensor(stats, CUDNN_DATA_FLOAT, false, B, Hq, T, 1, "Stats") ||
        !tensor(SSUM, CUDNN_DATA_FLOAT, false, B, Hq, T, 1, "softmax_sum"))
      return false;
    for (const Ref &x : {P, dP, dS, S2, sub->x, mul->x, s1->y, m1->y})
      if (!tensor(x, CUDNN_DATA_FLOAT, true, B, Hq, T, T, "an fp32 score tensor")) return false;
    if (VT->ten.str[2] != 1 || O->ten.str[3] != 1 || dO->ten.str[3] != 1 || dQ->ten.str[3] != 1 ||
        outs[0]->ten.str[3] != 1 || outs[1]->ten.str[3] != 1)
      return fail("the head dim must have stride 1 in V, O, dO, dQ, dK and dV");
    p.q = Q->ten, p.k = KT->ten, p.v = VT->ten, p.o = O->ten, p.stats = stats->ten, p.dout = dO->ten;
    p.dq = dQ->ten, p.dk = outs[1]->ten, p.dv = outs[0]->ten, p.ssum = SSUM->ten;
    p.scale_uid = m2->b->ten.uid, p.fill_uid = fill, p.one_uid = ss->b->ten.uid;
    return true;
  }
};

cudnnStatus_t finalize_heuristics(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_ATTR_ENGINEHEUR_MODE});
  if (s) return s;
  o.graph = get_ref(o, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH);
  const int mode = get_enum(o, CUDNN_ATTR_ENGINEHEUR_MODE);
  if (mode < CUDNN_HEUR_MODE_INSTANT || mode > CUDNN_HEUR_MODE_A)
    return refuse(CUDNN_STATUS_BAD_PARAM, "heuristics mode %d", mode);
  const int cc = props(o.graph->dev).major * 10 + props(o.graph->dev).minor;
  if (cc < 80)
    return refuse(CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH, "fused attention needs sm_80 or newer (sm_%d)", cc);
  bool bwd = false;
  for (const Ref &op : o.graph->ops) bwd = bwd || op->type == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR;
  Matcher m(o.graph->ops);
  auto p = std::make_shared<Problem>();
  memset(p.get(), 0, sizeof *p);
  if (!(bwd ? m.backward(*p) : m.forward(*p)))
    return refuse(CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN, "no engine for this graph: it is not the SDPA %s pattern "
                  "(%zu operations): %s", bwd ? "backward" : "forward", o.graph->ops.size(), m.why.c_str());
  o.prob = p;
  return ok();
}

cudnnStatus_t finalize_plan(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG});
  if (s) return s;
  o.cfg = get_ref(o, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG);
  if (!o.cfg->prob) return refuse(CUDNN_STATUS_BAD_PARAM, "the engine config was not filled by the heuristics");
  o.graph = o.cfg->graph;
  o.prob = o.cfg->prob;
  o.dev = o.graph->dev;
  if (has(o, CUDNN_ATTR_EXECUTION_PLAN_HANDLE)) {
    nvl_emu_cudnn_handle *h;
    memcpy(&h, o.attrs[CUDNN_ATTR_EXECUTION_PLAN_HANDLE].bytes.data(), sizeof h);
    if (h->dev != o.dev)
      return refuse(CUDNN_STATUS_BAD_PARAM, "the plan's handle is cuda:%d's, the graph's cuda:%d's", h->dev, o.dev);
  }
  const Problem &p = *o.prob;
  const int64_t rows = p.B * p.Hq * p.T, t64 = (p.T + 63) / 64 * 64;
  o.workspace = p.backward && p.det ? p.B * p.Hq * t64 * t64 * 2 : rows * 4;
  counters().cudnn_plans++;
  return ok();
}

cudnnStatus_t finalize_variant_pack(Obj &o) {
  cudnnStatus_t s = need(o, {CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                             CUDNN_ATTR_VARIANT_PACK_WORKSPACE});
  if (s) return s;
  const int64_t n = o.attrs[CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS].count;
  if (o.attrs[CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS].count != n)
    return refuse(CUDNN_STATUS_BAD_PARAM, "variant pack: %lld unique ids but %lld pointers", (long long)n,
                  (long long)o.attrs[CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS].count);
  o.uids.resize((size_t)n);
  o.ptrs.resize((size_t)n);
  for (int64_t i = 0; i < n; i++) {
    o.uids[(size_t)i] = get_i64(o, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, i);
    memcpy(&o.ptrs[(size_t)i], o.attrs[CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS].bytes.data() + i * sizeof(void *),
           sizeof(void *));
    for (int64_t j = 0; j < i; j++)
      if (o.uids[(size_t)j] == o.uids[(size_t)i])
        return refuse(CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES, "variant pack: unique id %lld given twice",
                      (long long)o.uids[(size_t)i]);
  }
  memcpy(&o.ws, o.attrs[CUDNN_ATTR_VARIANT_PACK_WORKSPACE].bytes.data(), sizeof(void *));
  return ok();
}

/* ---- execution: the attention, on host views ------------------------------------------------------------- */

struct View {
  char *p;
  const Ten *t;
  /* element (i0, i1, i2, i3) */
  int64_t at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return a * t->str[0] + b * t->str[1] + c * t->str[2] + d * t->str[3];
  }
  float bf(int64_t a, int64_t b, int64_t c, int64_t d) const {
    uint16_t h;
    memcpy(&h, p + 2 * at(a, b, c, d), 2);
    return nvl_bf16_to_f32(h);
  }
  void set_bf(int64_t a, int64_t b, int64_t c, int64_t d, float v) const {
    const uint16_t h = nvl_f32_to_bf16(v);
    memcpy(p + 2 * at(a, b, c, d), &h, 2);
  }
  float f(int64_t a, int64_t b, int64_t c, int64_t d) const {
    float v;
    memcpy(&v, p + 4 * at(a, b, c, d), 4);
    return v;
  }
  void set_f(int64_t a, int64_t b, int64_t c, int64_t d, float v) const { memcpy(p + 4 * at(a, b, c, d), &v, 4); }
};

float rb(float x) { return nvl_bf16_to_f32(nvl_f32_to_bf16(x)); }

/* scores row t of (b, h): s[j] = scale q_t . k_j, the fill value where the mask drops it */
void scores(const Problem &p, const View &q, const View &k, int64_t b, int64_t h, int64_t g, int64_t t, float scale,
            float fill, float *s) {
  for (int64_t j = 0; j < p.T; j++) {
    float acc = 0.0f;
    for (int64_t d = 0; d < p.D; d++) acc += q.bf(b, h, t, d) * k.bf(b, g, d, j); /* k: the [b, h, d, s] view */
    s[j] = acc * scale;
    if (p.causal && !(t >= j)) s[j] = fill;
  }
}

void run_forward(const Problem &p, const View &q, const View &k, const View &v, const View &o, const View &st,
                 float scale, float fill) {
  std::vector<float> s((size_t)p.T), pr((size_t)p.T);
  const int64_t group = p.Hq / p.Hkv;
  for (int64_t b = 0; b < p.B; b++)
    for (int64_t h = 0; h < p.Hq; h++)
      for (int64_t t = 0; t < p.T; t++) {
        const int64_t g = h / group;
        scores(p, q, k, b, h, g, t, scale, fill, s.data());
        float m = -INFINITY, l = 0.0f;
        for (int64_t j = 0; j < p.T; j++) m = std::max(m, s[(size_t)j]);
        for (int64_t j = 0; j < p.T; j++) l += (pr[(size_t)j] = expf(s[(size_t)j] - m));
        st.set_f(b, h, t, 0, m + logf(l));
        for (int64_t j = 0; j < p.T; j++) pr[(size_t)j] = rb(pr[(size_t)j] / l);
        for (int64_t d = 0; d < p.D; d++) {
          float acc = 0.0f;
          for (int64_t j = 0; j < p.T; j++) acc += pr[(size_t)j] * v.bf(b, g, j, d);
          o.set_bf(b, h, t, d, acc);
        }
      }
}

void run_backward(const Problem &p, const View &q, const View &k, const View &vt, const View &o, const View &dout,
                  const View &st, const View &dq, const View &dk, const View &dv, const View &ssum, const View *acc,
                  float scale, float fill, float one) {
  const int64_t T = p.T, D = p.D, group = p.Hq / p.Hkv;
  std::vector<float> s((size_t)T), P((size_t)(T * T)), dS((size_t)(T * T));
  std::vector<float> gk((size_t)(T * D)), gv((size_t)(T * D));
  for (int64_t b = 0; b < p.B; b++)
    for (int64_t g = 0; g < p.Hkv; g++) {
      std::fill(gk.begin(), gk.end(), 0.0f);
      std::fill(gv.begin(), gv.end(), 0.0f);
      for (int64_t h = g * group; h < (g + 1) * group; h++) {
        for (int64_t t = 0; t < T; t++) {
          float w = 0.0f;
          for (int64_t d = 0; d < D; d++) w += dout.bf(b, h, t, d) * o.bf(b, h, t, d);
          w *= one;
          ssum.set_f(b, h, t, 0, w);
          scores(p, q, k, b, h, g, t, scale, fill, s.data());
          const float lse = st.f(b, h, t, 0);
          for (int64_t j = 0; j < T; j++) {
            const float pr = expf(s[(size_t)j] - lse);
            float dp = 0.0f;
            for (int64_t d = 0; d < D; d++) dp += dout.bf(b, h, t, d) * vt.bf(b, g, d, j);
            P[(size_t)(t * T + j)] = rb(pr);
            dS[(size_t)(t * T + j)] = rb(((dp - w) * pr) * scale);
          }
        }
        for (int64_t t = 0; t < T; t++)
          for (int64_t d = 0; d < D; d++) {
            float a = 0.0f;
            for (int64_t j = 0; j < T; j++) a += dS[(size_t)(t * T + j)] * k.bf(b, g, d, j);
            if (acc) acc->set_f(b, h, t, d, a);
            dq.set_bf(b, h, t, d, a);
          }
        for (int64_t j = 0; j < T; j++)
          for (int64_t d = 0; d < D; d++) {
            float av = 0.0f, ak = 0.0f;
            for (int64_t t = 0; t < T; t++) {
              av += P[(size_t)(t * T + j)] * dout.bf(b, h, t, d);
              ak += dS[(size_t)(t * T + j)] * q.bf(b, h, t, d);
            }
            gv[(size_t)(j * D + d)] += av;
            gk[(size_t)(j * D + d)] += ak;
          }
      }
      for (int64_t j = 0; j < T; j++)
        for (int64_t d = 0; d < D; d++) {
          dv.set_bf(b, g, j, d, gv[(size_t)(j * D + d)]);
          dk.set_bf(b, g, j, d, gk[(size_t)(j * D + d)]);
        }
    }
}

size_t extent_bytes(const Ten &t) {
  int64_t last = 0;
  for (int i = 0; i < 4; i++) last += (t.dim[i] - 1) * t.str[i];
  return (size_t)(last + 1) * (size_t)dt_bytes(t.dt);
}

cudnnStatus_t execute(nvl_emu_cudnn_handle *h, Obj &plan, Obj &vp) {
  const Problem &p = *plan.prob;
  if (plan.dev != h->dev)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the plan was built for cuda:%d, the handle is "
                  "cuda:%d's", plan.dev, h->dev);
  const std::map<int64_t, Ten> &io = plan.graph->io;
  for (int64_t uid : vp.uids)
    if (!io.count(uid))
      return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the variant pack binds unique id %lld, which is no "
                    "non-virtual tensor of the plan's graph", (long long)uid);
  std::map<int64_t, void *> ptr;
  std::map<int64_t, float> value;
  std::vector<Access> acc;
  struct Range {
    uintptr_t lo, hi;
    int64_t uid;
    bool out;
  };
  std::vector<Range> ranges;
  std::set<int64_t> outputs = {p.o.uid, p.stats.uid};
  if (p.backward) outputs = {p.dq.uid, p.dk.uid, p.dv.uid, p.ssum.uid, p.det ? p.dq.uid : p.acc.uid};
  for (const auto &kv : io) {
    const Ten &t = kv.second;
    size_t i = 0;
    while (i < vp.uids.size() && vp.uids[i] != t.uid) i++;
    if (i == vp.uids.size())
      return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: tensor %s of the graph has no pointer in the variant "
                    "pack", ten_str(t).c_str());
    void *q = vp.ptrs[i];
    if (!q)
      return refuse(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnBackendExecute: tensor %s is bound to NULL",
                    ten_str(t).c_str());
    if (t.byval) {
      if (in_device_range(q))
        return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: by-value tensor %s points into device memory (%s); "
                      "by-value inputs are read from host memory", ten_str(t).c_str(), describe_ptr(q).c_str());
      float f;
      memcpy(&f, q, 4);
      value[t.uid] = f;
      continue;
    }
    const size_t bytes = extent_bytes(t);
    Alloc *a = find_alloc(q, bytes);
    if (!a || a->dev != h->dev)
      return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: tensor %s at %p (%zu bytes) is not inside one device "
                    "allocation of cuda:%d (%s)", ten_str(t).c_str(), q, bytes, h->dev, describe_ptr(q).c_str());
    if ((uintptr_t)q % (uintptr_t)t.align)
      return refuse(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, "cudnnBackendExecute: tensor %s at %p is not %lld-byte "
                    "aligned as its descriptor declares", ten_str(t).c_str(), q, (long long)t.align);
    const bool out = outputs.count(t.uid) != 0;
    ranges.push_back(Range{(uintptr_t)q, (uintptr_t)q + bytes, t.uid, out});
    acc.push_back(Access{a, out ? ACC_WRITE : ACC_READ, "a tensor of cudnnBackendExecute"});
    ptr[t.uid] = host_view(a, q);
  }
  for (const Range &x : ranges)
    for (const Range &y : ranges)
      if (x.out && x.uid != y.uid && x.lo < y.hi && y.lo < x.hi)
        return refuse(CUDNN_STATUS_NOT_SUPPORTED, "cudnnBackendExecute: output uid %lld overlaps uid %lld (in-place "
                      "execution is not modelled)", (long long)x.uid, (long long)y.uid);
  if (plan.workspace > 0) {
    Alloc *a = find_alloc(vp.ws, (size_t)plan.workspace);
    if (!vp.ws || !a || a->dev != h->dev)
      return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the plan needs %lld bytes of workspace; %p is not "
                    "inside one device allocation of that size (%s)", (long long)plan.workspace, vp.ws,
                    describe_ptr(vp.ws).c_str());
    if ((uintptr_t)vp.ws % 16)
      return refuse(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, "cudnnBackendExecute: the workspace %p is not 16-byte "
                    "aligned", vp.ws);
    for (const Range &x : ranges)
      if (x.lo < (uintptr_t)vp.ws + (uintptr_t)plan.workspace && (uintptr_t)vp.ws < x.hi)
        return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the workspace overlaps tensor uid %lld",
                      (long long)x.uid);
    acc.push_back(Access{a, ACC_READ | ACC_WRITE, "the cuDNN workspace"});
  }
  /* one access per allocation, the modes merged */
  std::vector<Access> merged;
  for (const Access &x : acc) {
    auto it = std::find_if(merged.begin(), merged.end(), [&](const Access &m) { return m.a == x.a; });
    if (it == merged.end()) merged.push_back(x);
    else it->mode |= x.mode;
  }
  Stream *s = stream_of(h->stream, "cudnnBackendExecute");
  if (!s) return refuse(CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH, "cudnnBackendExecute: the handle's stream is not live");
  counters().cudnn_executes++;
  if (!op_enqueue(s, p.backward ? "cuDNN SDPA backward" : "cuDNN SDPA forward", merged.data(), (int)merged.size()))
    return ok(); /* the race is reported as a fault, as a GPU's would be */
  const float scale = value.at(p.scale_uid), fill = p.causal ? value.at(p.fill_uid) : 0.0f;
  auto view = [&](const Ten &t) { return View{(char *)ptr.at(t.uid), &t}; };
  if (!p.backward) {
    run_forward(p, view(p.q), view(p.k), view(p.v), view(p.o), view(p.stats), scale, fill);
  } else {
    const View a = p.det ? View{NULL, NULL} : view(p.acc);
    run_backward(p, view(p.q), view(p.k), view(p.v), view(p.o), view(p.dout), view(p.stats), view(p.dq), view(p.dk),
                 view(p.dv), view(p.ssum), p.det ? NULL : &a, scale, fill, value.at(p.one_uid));
  }
  if (plan.workspace > 0) memset(host_view(find_alloc(vp.ws, 0), vp.ws), 0xA5, (size_t)plan.workspace);
  return ok();
}

}  // namespace
}  // namespace nvl_emu

using namespace nvl_emu;

extern "C" {

size_t cudnnGetVersion(void) {
  const char *e = getenv("NVLUA_EMU_CUDNN_VERSION");
  if (e && *e) return (size_t)strtoull(e, NULL, 10);
  return CUDNN_VERSION;
}

const char *cudnnGetErrorString(cudnnStatus_t s) { return status_name(s); }

void cudnnGetLastErrorString(char *message, size_t max_size) {
  if (!message || !max_size) return;
  snprintf(message, max_size, "%s", last_status != CUDNN_STATUS_SUCCESS ? last_msg : "");
  last_status = CUDNN_STATUS_SUCCESS;
  last_msg[0] = 0;
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *handle) {
  NVL_EMU_LOCK;
  init();
  if (!handle) return refuse(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnCreate: NULL handle pointer");
  if (!visible_devices()) return refuse(CUDNN_STATUS_NOT_INITIALIZED, "cudnnCreate: no CUDA device");
  *handle = new nvl_emu_cudnn_handle{current_device(), NULL};
  live_handles.insert(*handle);
  return ok();
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  NVL_EMU_LOCK;
  if (!live_handles.erase(handle)) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnDestroy: not a live handle");
  delete handle;
  return ok();
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
  NVL_EMU_LOCK;
  if (!live_handles.count(handle)) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnSetStream: not a live handle");
  Stream *s = stream_of(stream, "cudnnSetStream");
  if (!s) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnSetStream: %p is not a live stream", (void *)stream);
  if (stream && stream_device(s) != handle->dev)
    return refuse(CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH, "cudnnSetStream: the stream is cuda:%d's, the handle "
                  "cuda:%d's", stream_device(s), handle->dev);
  handle->stream = stream;
  return ok();
}

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t *d) {
  NVL_EMU_LOCK;
  if (!d) return refuse(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnBackendCreateDescriptor: NULL descriptor pointer");
  if (!strcmp(desc_name(type), "an unmodelled descriptor type"))
    return refuse(CUDNN_STATUS_NOT_SUPPORTED, "cudnnBackendCreateDescriptor: descriptor type %d is not modelled",
                  (int)type);
  auto o = std::make_shared<Obj>();
  o->type = type;
  *d = new nvl_emu_cudnn_desc{0};
  live[*d] = o;
  return ok();
}

cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d) {
  NVL_EMU_LOCK;
  if (!live.erase(d))
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendDestroyDescriptor: %p is not a live descriptor", (void *)d);
  /* the address is not handed out again at once, so a use after destroy is seen as one */
  static std::vector<cudnnBackendDescriptor_t> quarantine;
  quarantine.push_back(d);
  if (quarantine.size() > 4096) {
    delete quarantine.front();
    quarantine.erase(quarantine.begin());
  }
  return ok();
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t count, const void *elements) {
  NVL_EMU_LOCK;
  Ref o = lookup(d);
  if (!o) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute: %p is not a live descriptor", (void *)d);
  const char *dn = desc_name(o->type);
  if (o->finalized)
    return refuse(CUDNN_STATUS_NOT_INITIALIZED, "cudnnBackendSetAttribute(%s): the descriptor is finalized", dn);
  const Spec *sp = spec_of(o->type, name);
  if (!sp)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute(%s): attribute %d is not an attribute of this "
                  "descriptor type (or not modelled)", dn, (int)name);
  if ((int)type != sp->type)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute(%s, %s): attribute type %d, documented %d", dn,
                  sp->name, (int)type, sp->type);
  if (count < sp->min || count > sp->max)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute(%s, %s): %lld elements, %lld to %lld taken", dn,
                  sp->name, (long long)count, (long long)sp->min, (long long)sp->max);
  if (count > 0 && !elements)
    return refuse(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnBackendSetAttribute(%s, %s): NULL elements", dn, sp->name);
  Attr a;
  a.type = type;
  a.count = count;
  const size_t sz = type_size(type);
  a.bytes.assign((const unsigned char *)elements, (const unsigned char *)elements + (size_t)count * sz);
  if (type == CUDNN_TYPE_BACKEND_DESCRIPTOR) {
    for (int64_t i = 0; i < count; i++) {
      cudnnBackendDescriptor_t e;
      memcpy(&e, a.bytes.data() + (size_t)i * sz, sz);
      Ref r = lookup(e);
      if (!r)
        return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute(%s, %s): element %lld (%p) is not a live "
                      "descriptor", dn, sp->name, (long long)i, (void *)e);
      if (sp->ref >= 0 ? r->type != sp->ref : !is_operation(r->type))
        return refuse(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, "cudnnBackendSetAttribute(%s, %s): element %lld is a %s, "
                      "%s expected", dn, sp->name, (long long)i, desc_name(r->type),
                      sp->ref >= 0 ? desc_name(sp->ref) : "an operation");
      if (!r->finalized)
        return refuse(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, "cudnnBackendSetAttribute(%s, %s): element %lld (a %s) is "
                      "not finalized", dn, sp->name, (long long)i, desc_name(r->type));
      a.refs.push_back(r);
    }
  }
  if (type == CUDNN_TYPE_HANDLE) {
    cudnnHandle_t h;
    memcpy(&h, a.bytes.data(), sizeof h);
    if (!live_handles.count(h))
      return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute(%s, %s): not a live handle", dn, sp->name);
  }
  o->attrs[name] = a;
  return ok();
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t d) {
  NVL_EMU_LOCK;
  Ref o = lookup(d);
  if (!o) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize: %p is not a live descriptor", (void *)d);
  if (o->finalized)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize(%s): already finalized", desc_name(o->type));
  cudnnStatus_t s;
  switch (o->type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR: s = finalize_tensor(*o); break;
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR: s = finalize_pointwise_desc(*o); break;
    case CUDNN_BACKEND_REDUCTION_DESCRIPTOR: s = finalize_reduction_desc(*o); break;
    case CUDNN_BACKEND_MATMUL_DESCRIPTOR: s = need(*o, {CUDNN_ATTR_MATMUL_COMP_TYPE}); break;
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: s = finalize_pointwise_op(*o); break;
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: s = finalize_reduction_op(*o); break;
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: s = finalize_matmul_op(*o); break;
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: s = finalize_reshape_op(*o); break;
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: s = finalize_graph(*o); break;
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: s = finalize_heuristics(*o); break;
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: s = finalize_plan(*o); break;
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: s = finalize_variant_pack(*o); break;
    default:
      s = refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize(%s): engine configs are filled by the heuristics "
                 "(CUDNN_ATTR_ENGINEHEUR_RESULTS), not finalized by hand here", desc_name(o->type));
  }
  if (s == CUDNN_STATUS_SUCCESS) o->finalized = true;
  return s;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const d, cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t requested, int64_t *count,
                                       void *elements) {
  NVL_EMU_LOCK;
  Ref o = lookup(d);
  if (!o) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendGetAttribute: %p is not a live descriptor", (void *)d);
  if (!o->finalized)
    return refuse(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, "cudnnBackendGetAttribute(%s): not finalized",
                  desc_name(o->type));
  if (!count) return refuse(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "cudnnBackendGetAttribute: NULL count");
  if (o->type == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR && name == CUDNN_ATTR_ENGINEHEUR_RESULTS) {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR)
      return refuse(CUDNN_STATUS_BAD_PARAM, "CUDNN_ATTR_ENGINEHEUR_RESULTS is read as CUDNN_TYPE_BACKEND_DESCRIPTOR");
    if (requested < 0 || (requested > 0 && !elements))
      return refuse(CUDNN_STATUS_BAD_PARAM, "CUDNN_ATTR_ENGINEHEUR_RESULTS: %lld elements requested into %p",
                    (long long)requested, elements);
    const int64_t n = std::min<int64_t>(requested, 1);
    for (int64_t i = 0; i < n; i++) {
      cudnnBackendDescriptor_t e;
      memcpy(&e, (char *)elements + i * sizeof e, sizeof e);
      Ref c = lookup(e);
      if (!c || c->type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR || c->finalized)
        return refuse(CUDNN_STATUS_BAD_PARAM, "CUDNN_ATTR_ENGINEHEUR_RESULTS: element %lld must be a live, new "
                      "CUDNN_BACKEND_ENGINECFG_DESCRIPTOR", (long long)i);
      c->graph = o->graph;
      c->prob = o->prob;
      c->finalized = true;
    }
    *count = requested == 0 ? 1 : n;
    return ok();
  }
  if (o->type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR && name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) {
    if (type != CUDNN_TYPE_INT64 || requested < 1 || !elements)
      return refuse(CUDNN_STATUS_BAD_PARAM, "CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE is one CUDNN_TYPE_INT64");
    memcpy(elements, &o->workspace, 8);
    *count = 1;
    return ok();
  }
  return refuse(CUDNN_STATUS_NOT_SUPPORTED, "cudnnBackendGetAttribute(%s, attribute %d) is not modelled",
                desc_name(o->type), (int)name);
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t vp) {
  NVL_EMU_LOCK;
  if (!live_handles.count(handle)) return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: not a live handle");
  if (handle->dev != current_device())
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the handle belongs to cuda:%d, cuda:%d is current",
                  handle->dev, current_device());
  Ref p = lookup(plan), v = lookup(vp);
  if (!p || p->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || !p->finalized)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the plan is not a live, finalized execution plan");
  if (!v || v->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR || !v->finalized)
    return refuse(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the variant pack is not a live, finalized one");
  return execute(handle, *p, *v);
}

}  // extern "C"
