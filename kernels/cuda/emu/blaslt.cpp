/* blaslt.cpp: cuBLASLt on the CPU, for the emulation build: exactly the matmuls kernels/cuda/gemm.cu
 * asks for, with cuBLASLt's documented semantics, and a refusal (status + message, through
 * cublasLtGetStatusString) for anything else.
 *
 * What is modelled (cuBLASLt documentation, cublasLt.h):
 *   D = alpha * scale_a * scale_b * op(A) op(B) + beta * C, column-major, op(A) = A^T (TRANSA = T),
 *   op(B) = B (TRANSB = N): the "TN" layout, the only one nvlua uses (and the one fp8 and
 *   block-scaled GEMMs require). A is k x m (ld >= k), B k x n, C = D m x n (ld >= m), compute
 *   CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, fp32 accumulation.
 *   A/B types: f32 x f32 -> f32; bf16 x bf16 -> bf16 or f32; fp8 (e4m3/e5m2, not e5m2 x e5m2, sm_89+)
 *   -> bf16 or f32, with per-tensor A/B_SCALE_POINTERs (device floats; NULL = 1) or VEC32_UE8M0 block
 *   scales (sm_100); e2m1 x e2m1 with VEC16_UE4M3 block scales (sm_100). Block scales: one per 16 or
 *   32 elements along k of each row of op(A) (and column of op(B)), in the 128x4 tiled layout: tile
 *   (r/128, b/4) of 512 bytes, tiles row-major with ceil(blocks/4) per row of tiles, scale (r, b) at
 *   (r%32)*16 + ((r%128)/32)*4 + b%4 inside its tile; UE4M3 ignores the sign bit, UE8M0 e is 2^(e-127).
 *   e2m1 elements are packed two per byte, the lower index in the low nibble.
 *   Alignment: the heuristic's algorithm assumes the MIN_ALIGNMENT preferences (256 bytes when not
 *   set); cublasLtMatmul refuses pointers less aligned than the algorithm was chosen for. fp8 and
 *   fp4 operands need 16-byte-aligned pointers and leading dimensions of a multiple of 16 bytes.
 *   A workspace at least as large as the algorithm asks (4 MiB for fp8/fp4 here, 0 otherwise).
 * The products of decoded elements are computed in fp32 and summed in fp32, in chunks of 32 along k
 * (the order is unspecified by cuBLASLt: results match a GPU's within fp32 summation-order error).
 *
 * Not modelled (refused): other transposes, batches, epilogues, bias, C/D scales, amax outputs,
 * other types, beta != 0 with C != D, pointer modes other than host or device alpha/beta
 * (CUBLASLT_POINTER_MODE_DEVICE: both are device floats, read in stream order). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "cpu/ref/formats_ref.h"
#include "cublasLt.h"
#include "dtype.h"
#include "emu.h"

struct nvl_emu_lt_handle {
  int dev;
};
struct nvl_emu_lt_desc {
  int compute, scale_type, transa, transb, mode_a, mode_b;
  const void *scale_a, *scale_b;
  int pointer_mode; /* CUBLASLT_POINTER_MODE_HOST or _DEVICE */
};
struct nvl_emu_lt_layout {
  int type;
  uint64_t rows, cols;
  int64_t ld;
};
struct nvl_emu_lt_pref {
  size_t max_ws;
  uint32_t align[4]; /* A, B, C, D */
};

namespace nvl_emu {

static thread_local cublasStatus_t last_status = CUBLAS_STATUS_SUCCESS;
static thread_local char last_msg[900];

static const char *status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
  }
}

static cublasStatus_t lt_refuse(cublasStatus_t s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static cublasStatus_t lt_refuse(cublasStatus_t s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char m[700];
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  last_status = s;
  snprintf(last_msg, sizeof last_msg, "%s [cuBLASLt stand-in of the cuda emulator: %s]", status_name(s), m);
  return s;
}

static const char *type_name(int t) {
  switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_8F_E4M3: return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2: return "CUDA_R_8F_E5M2";
    case CUDA_R_4F_E2M1: return "CUDA_R_4F_E2M1";
    default: return "an unmodelled type";
  }
}
static int bits_of(int t) { return t == CUDA_R_32F ? 32 : t == CUDA_R_16BF ? 16 : t == CUDA_R_4F_E2M1 ? 4 : 8; }
static bool is_fp8(int t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
static bool narrow(int t) { return is_fp8(t) || t == CUDA_R_4F_E2M1; }

struct Problem {
  const nvl_emu_lt_desc *op;
  const nvl_emu_lt_layout *a, *b, *c, *d;
  int64_t m, n, k;
};

static int device_cc() { return props(current_device()).major * 10 + props(current_device()).minor; }

static cublasStatus_t check_types(const Problem &p) {
  const int ta = p.a->type, tb = p.b->type, tc = p.d->type, ma = p.op->mode_a, mb = p.op->mode_b;
  const bool scal = ma == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F && mb == ma;
  if (ma != mb) return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "A and B scale modes differ (%d, %d)", ma, mb);
  if (ta == CUDA_R_32F || ta == CUDA_R_16BF) {
    if (tb != ta || (ta == CUDA_R_32F && tc != CUDA_R_32F) || (tc != CUDA_R_32F && tc != CUDA_R_16BF))
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s x %s -> %s is not a modelled combination", type_name(ta),
                       type_name(tb), type_name(tc));
    if (!scal || p.op->scale_a || p.op->scale_b)
      return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "A/B scales are for fp8 and fp4 operands, not %s", type_name(ta));
    return CUBLAS_STATUS_SUCCESS;
  }
  if (tc != CUDA_R_32F && tc != CUDA_R_16BF)
    return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "output %s is not modelled for %s inputs", type_name(tc),
                     type_name(ta));
  if (is_fp8(ta) && is_fp8(tb)) {
    if (ta == CUDA_R_8F_E5M2 && tb == CUDA_R_8F_E5M2)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "cuBLASLt has no fp8 GEMM with two e5m2 operands");
    if (device_cc() < 89) return lt_refuse(CUBLAS_STATUS_ARCH_MISMATCH, "fp8 GEMMs need sm_89 or newer");
    if (ma == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 && device_cc() < 100)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "VEC32_UE8M0 block scales need sm_100 (this is sm_%d)",
                       device_cc());
    if (!scal && ma != CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "fp8 operands take per-tensor or VEC32_UE8M0 scales, not mode %d",
                       ma);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (ta == CUDA_R_4F_E2M1 && tb == ta) {
    if (ma != CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "e2m1 operands are modelled with VEC16_UE4M3 scales only");
    if (device_cc() < 100)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "block-scaled fp4 GEMMs need sm_100 (this is sm_%d)", device_cc());
    return CUBLAS_STATUS_SUCCESS;
  }
  return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s x %s is not a modelled combination", type_name(ta), type_name(tb));
}

/* The problem of a descriptor and its layouts, checked against what is modelled. */
static cublasStatus_t check_problem(Problem &p) {
  const nvl_emu_lt_desc *o = p.op;
  if (o->compute != CUBLAS_COMPUTE_32F || o->scale_type != CUDA_R_32F)
    return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "compute type %d / scale type %d: only CUBLAS_COMPUTE_32F with "
                     "CUDA_R_32F scaling is modelled", o->compute, o->scale_type);
  if (o->transa != CUBLAS_OP_T || o->transb != CUBLAS_OP_N)
    return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "TRANSA=%d, TRANSB=%d: only the TN layout (T, N) is modelled",
                     o->transa, o->transb);
  if (p.c != p.d && (p.c->type != p.d->type || p.c->rows != p.d->rows || p.c->cols != p.d->cols ||
                     p.c->ld != p.d->ld))
    return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "C and D layouts differ: only C = D is modelled");
  p.k = (int64_t)p.a->rows;
  p.m = (int64_t)p.a->cols;
  p.n = (int64_t)p.b->cols;
  if ((int64_t)p.b->rows != p.k || (int64_t)p.d->rows != p.m || (int64_t)p.d->cols != p.n)
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "shapes do not agree: A %llux%llu, B %llux%llu, D %llux%llu (TN)",
                     (unsigned long long)p.a->rows, (unsigned long long)p.a->cols, (unsigned long long)p.b->rows,
                     (unsigned long long)p.b->cols, (unsigned long long)p.d->rows, (unsigned long long)p.d->cols);
  if (p.m < 1 || p.n < 1 || p.k < 1 || p.a->ld < p.k || p.b->ld < p.k || p.d->ld < p.m)
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "empty dimension or leading dimension too small");
  cublasStatus_t st = check_types(p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const nvl_emu_lt_layout *ab[2] = {p.a, p.b};
  for (int i = 0; i < 2; i++)
    if (narrow(ab[i]->type) && (ab[i]->ld * bits_of(ab[i]->type) / 8) % 16)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: the leading dimension of %s (%lld elements of %s) is not a "
                       "multiple of 16 bytes", i ? "B" : "A", i ? "B" : "A", (long long)ab[i]->ld,
                       type_name(ab[i]->type));
  const int vec = o->mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 ? 16
                  : o->mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 ? 32 : 0;
  if (vec && p.k % vec)
    return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "k = %lld is not a multiple of the %d-element scale blocks",
                     (long long)p.k, vec);
  return CUBLAS_STATUS_SUCCESS;
}

/* The algorithm a heuristic hands out: what it was chosen for, and what it assumes. */
enum { ALGO_MAGIC = 0x4e564c454d55414cULL };
static uint64_t fingerprint(const Problem &p) {
  uint64_t h = 1469598103934665603ULL;
  const int64_t v[] = {p.op->transa, p.op->transb, p.op->mode_a, p.op->mode_b, p.a->type, p.b->type, p.d->type,
                       p.m, p.n, p.k, p.a->ld, p.b->ld, p.d->ld, p.op->scale_a != NULL};
  for (int64_t x : v) h = (h ^ (uint64_t)x) * 1099511628211ULL;
  return h;
}
static size_t workspace_of(const Problem &p) { return narrow(p.a->type) ? (size_t)4 << 20 : 0; }

static unsigned alignment(const void *p) {
  uintptr_t x = (uintptr_t)p;
  unsigned a = 1;
  while (a < 256 && !(x & a)) a <<= 1;
  return a;
}

}  // namespace nvl_emu

using namespace nvl_emu;

extern "C" {

size_t cublasLtGetVersion(void) { return 0; } /* 0: the stand-in, not a cuBLASLt library */
const char *cublasLtGetStatusName(cublasStatus_t s) { return status_name(s); }
const char *cublasLtGetStatusString(cublasStatus_t s) {
  if (s == last_status && last_msg[0]) return last_msg;
  return s == CUBLAS_STATUS_SUCCESS ? "success" : status_name(s);
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  NVL_EMU_LOCK;
  init();
  if (!visible_devices()) return lt_refuse(CUBLAS_STATUS_NOT_INITIALIZED, "no device");
  *h = new nvl_emu_lt_handle{current_device()};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType scale) {
  *d = new nvl_emu_lt_desc{(int)compute, (int)scale, CUBLAS_OP_N, CUBLAS_OP_N, 0, 0, NULL, NULL,
                           CUBLASLT_POINTER_MODE_HOST};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
    case CUBLASLT_MATMUL_DESC_A_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_B_SCALE_MODE: {
      if (size != 4) return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "attribute %d takes 4 bytes, got %zu", attr, size);
      int32_t v;
      memcpy(&v, buf, 4);
      if (attr == CUBLASLT_MATMUL_DESC_TRANSA) d->transa = v;
      else if (attr == CUBLASLT_MATMUL_DESC_TRANSB) d->transb = v;
      else if (attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE) d->mode_a = v;
      else d->mode_b = v;
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: {
      if (size != 4) return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "attribute %d takes 4 bytes, got %zu", attr, size);
      int32_t v;
      memcpy(&v, buf, 4);
      if (v != CUBLASLT_POINTER_MODE_HOST && v != CUBLASLT_POINTER_MODE_DEVICE)
        return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "pointer mode %d is not modelled (host 0 and device 1 are)", v);
      d->pointer_mode = v;
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      if (size != sizeof(void *))
        return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "a scale pointer takes %zu bytes, got %zu", sizeof(void *), size);
      memcpy(attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? (void *)&d->scale_a : (void *)&d->scale_b, buf, size);
      return CUBLAS_STATUS_SUCCESS;
    default: return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "matmul attribute %d is not modelled", (int)attr);
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  *l = new nvl_emu_lt_layout{(int)type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  *p = new nvl_emu_lt_pref{0, {256, 256, 256, 256}};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (size != 8) return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "MAX_WORKSPACE_BYTES takes 8 bytes, got %zu", size);
    memcpy(&p->max_ws, buf, 8);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    uint32_t v;
    if (size != 4) return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "MIN_ALIGNMENT takes 4 bytes, got %zu", size);
    memcpy(&v, buf, 4);
    if (!v || (v & (v - 1)) || v > 256)
      return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "MIN_ALIGNMENT %u is not a power of two up to 256", v);
    p->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = v;
    return CUBLAS_STATUS_SUCCESS;
  }
  return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "preference attribute %d is not modelled", (int)attr);
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t *results, int *found) {
  NVL_EMU_LOCK;
  counters().heuristics++;
  *found = 0;
  if (!h || !op || !a || !b || !c || !d || !pref || requested < 1 || !results)
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulAlgoGetHeuristic: NULL argument");
  Problem p{op, a, b, c, d, 0, 0, 0};
  cublasStatus_t st = check_problem(p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const size_t ws = workspace_of(p);
  if (ws > pref->max_ws)
    return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "the algorithm needs %zu bytes of workspace, the preference allows "
                     "%zu", ws, pref->max_ws);
  memset(results, 0, sizeof *results);
  results->algo.data[0] = ALGO_MAGIC;
  results->algo.data[1] = fingerprint(p);
  for (int i = 0; i < 4; i++) results->algo.data[2 + i] = pref->align[i];
  results->algo.data[6] = ws;
  results->workspaceSize = ws;
  results->state = CUBLAS_STATUS_SUCCESS;
  results->wavesCount = 1.0f;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"

namespace nvl_emu {

/* Value of element i of a column of type t (e2m1: two per byte, the lower index in the low nibble). */
static float element(int t, const char *col, int64_t i) {
  const uint8_t *u = (const uint8_t *)col;
  switch (t) {
    case CUDA_R_32F: {
      float f;
      memcpy(&f, col + 4 * i, 4);
      return f;
    }
    case CUDA_R_16BF: {
      uint16_t h;
      memcpy(&h, col + 2 * i, 2);
      return nvl_bf16_to_f32(h);
    }
    case CUDA_R_8F_E4M3: return nvl_e4m3_decode_ref(u[i]);
    case CUDA_R_8F_E5M2: return nvl_e5m2_decode_ref(u[i]);
    default: return nvl_e2m1_decode_ref((u[i / 2] >> (4 * (i & 1))) & 15);
  }
}

/* Offset of block scale (r, blk) in the 128x4 tiled layout for nblk blocks per row. */
static int64_t tiled_offset(int64_t r, int64_t blk, int64_t nblk) {
  const int64_t tiles_per_row = (nblk + 3) / 4;
  return ((r / 128) * tiles_per_row + blk / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + blk % 4;
}

/* rows (r0.. r0+count) of op(X) decoded, block scales applied: out (count, k) row-major. X is stored
 * k x cols column-major, so row r of op(X) = column r of X. */
static void decode_rows(std::vector<float> &out, const nvl_emu_lt_layout *l, const char *x, int mode,
                        const uint8_t *scales, int64_t k) {
  const int64_t rows = (int64_t)l->cols, col_bytes = l->ld * bits_of(l->type) / 8;
  const int vec = mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 ? 16
                  : mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 ? 32 : 0;
  out.resize((size_t)(rows * k));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < k; i++) {
      float v = element(l->type, x + r * col_bytes, i);
      if (vec) {
        const uint8_t s = scales[tiled_offset(r, i / vec, k / vec)];
        v *= vec == 16 ? nvl_ue4m3_decode_ref(s & 0x7F) : nvl_e8m0_decode_ref(s);
      }
      out[(size_t)(r * k + i)] = v;
    }
}

static float read_scale(const void *p) {
  float f = 1.0f;
  if (p) memcpy(&f, p, 4);
  return f;
}

/* D = alpha * sa * sb * op(A) op(B) + beta * C, everything already host views. */
static void compute(const Problem &p, const char *A, const char *B, const char *C, char *D, float alpha, float beta,
                    const void *sa, const void *sb) {
  std::vector<float> ra, rb;
  decode_rows(ra, p.a, A, p.op->mode_a, (const uint8_t *)sa, p.k);
  decode_rows(rb, p.b, B, p.op->mode_b, (const uint8_t *)sb, p.k);
  const bool per_tensor = p.op->mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const float scale = per_tensor ? read_scale(sa) * read_scale(sb) : 1.0f;
  /* bf16 x bf16: count what tensor cores may flush (subnormal inputs, products, partial sums) */
  const bool bf16 = p.a->type == CUDA_R_16BF && p.b->type == CUDA_R_16BF;
  auto sub = [](float v) { return v != 0.0f && fabsf(v) < 0x1p-126f; };
  int64_t subs = 0;
  if (bf16) {
    for (float v : ra) subs += sub(v);
    for (float v : rb) subs += sub(v);
  }
  for (int64_t j = 0; j < p.n; j++)
    for (int64_t i = 0; i < p.m; i++) {
      const float *x = &ra[(size_t)(i * p.k)], *y = &rb[(size_t)(j * p.k)];
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < p.k; k0 += 32) {
        float part = 0.0f;
        if (bf16) {
          for (int64_t t = k0; t < std::min(p.k, k0 + 32); t++) {
            const float pr = x[t] * y[t];
            part += pr;
            subs += sub(pr) + sub(part);
          }
        } else {
          for (int64_t t = k0; t < std::min(p.k, k0 + 32); t++) part += x[t] * y[t];
        }
        acc += part;
        subs += bf16 && sub(acc);
      }
      float v = alpha * (scale * acc);
      const int64_t at = i + j * p.d->ld;
      if (p.d->type == CUDA_R_32F) {
        if (beta != 0.0f) {
          float c;
          memcpy(&c, C + 4 * at, 4);
          v += beta * c;
        }
        memcpy(D + 4 * at, &v, 4);
      } else {
        if (beta != 0.0f) {
          uint16_t c;
          memcpy(&c, C + 2 * at, 2);
          v += beta * nvl_bf16_to_f32(c);
        }
        uint16_t o = nvl_f32_to_bf16(v);
        memcpy(D + 2 * at, &o, 2);
      }
    }
  counters().gemm_subnormals += subs;
}

/* The device allocation of operand `what` (bytes from p), or NULL with the status set. */
static Alloc *operand(const void *p, size_t bytes, const char *what) {
  Alloc *a = find_alloc(p, bytes);
  if (!a || a->dev != current_device())
    lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "%s (%p, %zu bytes) is not in one device allocation of cuda:%d (%s)", what,
              p, bytes, current_device(), describe_ptr(p).c_str());
  return a;
}

static size_t bytes_of(const nvl_emu_lt_layout *l) {
  return (size_t)((((int64_t)l->cols - 1) * l->ld + (int64_t)l->rows) * bits_of(l->type) + 7) / 8;
}

static cublasStatus_t check_alignment(const cublasLtMatmulAlgo_t *algo, const void *const ptr[4], const Problem &p) {
  static const char *const names[4] = {"A", "B", "C", "D"};
  for (int i = 0; i < 4; i++) {
    const unsigned have = alignment(ptr[i]), want = (unsigned)algo->data[2 + i];
    if (have < want)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s (%p) is %u-byte aligned, but the algorithm was chosen for "
                       "%u-byte alignment (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%s_BYTES %s)", names[i], ptr[i], have,
                       want, names[i], want == 256 ? "not set: 256" : "set higher");
    if (i < 2 && narrow(i ? p.b->type : p.a->type) && have < 16)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s (%p): %s operands must be 16-byte aligned", names[i], ptr[i],
                       type_name(i ? p.b->type : p.a->type));
  }
  return CUBLAS_STATUS_SUCCESS;
}

/* The scale tensor of operand X (rows x k/vec scales, tiled) or the per-tensor float: bytes read. */
static size_t scale_bytes(const Problem &p, int which) {
  const int mode = which ? p.op->mode_b : p.op->mode_a;
  const int64_t rows = which ? p.n : p.m;
  if (mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) return 4;
  const int vec = mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 ? 16 : 32;
  return (size_t)(((rows + 127) / 128) * 128 * ((p.k / vec + 3) / 4) * 4);
}

static int64_t dense_bytes(const nvl_emu_lt_layout *l) {
  return ((int64_t)l->rows * l->cols * bits_of(l->type) + 7) / 8;
}

/* The counters of one call (emu_api.h: nvl_emu_gemm_info). */
static GemmCount gemm_count(const Problem &p, bool reads_c, const void *const scales[2]) {
  GemmCount g{};
  g.type_a = p.a->type;
  g.type_b = p.b->type;
  g.type_d = p.d->type;
  g.scale_mode = p.op->mode_a;
  g.m = p.m;
  g.n = p.n;
  g.k = p.k;
  g.calls = 1;
  g.flops = 2 * p.m * p.n * p.k;
  g.bytes_a = dense_bytes(p.a);
  g.bytes_b = dense_bytes(p.b);
  g.bytes_c = reads_c ? dense_bytes(p.c) : 0;
  g.bytes_d = dense_bytes(p.d);
  for (int i = 0; i < 2; i++)
    if (scales[i]) g.bytes_scales += (int64_t)scale_bytes(p, i);
  return g;
}

static cublasStatus_t matmul(const Problem &p, const cublasLtMatmulAlgo_t *algo, const float *alpha,
                             const float *beta, const void *A, const void *B, const void *C, void *D, void *ws,
                             size_t ws_bytes, cudaStream_t stream) {
  auto hv = [](const void *q) -> char * { return q ? host_view(find_alloc(q, 0), q) : NULL; };
  const bool dev_ab = p.op->pointer_mode == CUBLASLT_POINTER_MODE_DEVICE;
  Alloc *ab_alloc[2] = {NULL, NULL};
  if (dev_ab) { /* alpha and beta are device floats, read in stream order (work runs as it is queued) */
    const void *abp[2] = {alpha, beta};
    for (int i = 0; i < 2; i++) {
      ab_alloc[i] = operand(abp[i], sizeof(float), i ? "beta" : "alpha");
      if (!ab_alloc[i]) return CUBLAS_STATUS_INVALID_VALUE;
    }
    alpha = reinterpret_cast<const float *>(hv(alpha));
    beta = reinterpret_cast<const float *>(hv(beta));
  }
  const void *ptr[4] = {A, B, C, D};
  cublasStatus_t st = check_alignment(algo, ptr, p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (ws_bytes < (size_t)algo->data[6])
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "a workspace of %zu bytes; the algorithm needs %zu", ws_bytes,
                     (size_t)algo->data[6]);
  const bool block = p.op->mode_a != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  if (block && (!p.op->scale_a || !p.op->scale_b))
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "block-scaled operands need A_SCALE_POINTER and B_SCALE_POINTER");
  Access acc[9];
  int n = 0;
  for (int i = 0; i < 2; i++)
    if (ab_alloc[i]) acc[n++] = Access{ab_alloc[i], ACC_READ, i ? "beta" : "alpha"};
  const char *names[] = {"A", "B", "C", "D"};
  const void *ops[] = {A, B, C, D};
  const nvl_emu_lt_layout *ls[] = {p.a, p.b, p.c, p.d};
  for (int i = 0; i < 4; i++) {
    if (i == 2 && (*beta == 0.0f || C == D)) continue;
    Alloc *x = operand(ops[i], bytes_of(ls[i]), names[i]);
    if (!x) return CUBLAS_STATUS_INVALID_VALUE;
    acc[n++] = Access{x, i == 3 ? ACC_READ | ACC_WRITE : ACC_READ, names[i]};
  }
  const void *scales[2] = {p.op->scale_a, p.op->scale_b};
  for (int i = 0; i < 2; i++) {
    if (!scales[i]) continue;
    /* seen on an H200 (cuBLASLt 13.1, 2026-11-28): an fp8 GEMM whose B scale lay 4 bytes after its A
     * scale was refused here with NOT_SUPPORTED, after the heuristic had found an algorithm for
     * 256-byte-aligned placeholders; at 16-byte offsets it ran. The exact rule is not documented:
     * 16 bytes is what was seen to work. */
    if (alignment(scales[i]) < 16)
      return lt_refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s (%p) is %u-byte aligned: scale pointers are taken at 16-byte "
                       "alignment", i ? "B_SCALE_POINTER" : "A_SCALE_POINTER", scales[i], alignment(scales[i]));
    Alloc *x = operand(scales[i], scale_bytes(p, i), i ? "B_SCALE_POINTER" : "A_SCALE_POINTER");
    if (!x) return CUBLAS_STATUS_INVALID_VALUE;
    acc[n++] = Access{x, ACC_READ, i ? "the B scales" : "the A scales"};
  }
  if (ws_bytes) {
    Alloc *x = operand(ws, ws_bytes, "the workspace");
    if (!x) return CUBLAS_STATUS_INVALID_VALUE;
    acc[n++] = Access{x, ACC_READ | ACC_WRITE, "the workspace"};
  }
  Stream *s = stream_of(stream, "cublasLtMatmul");
  if (!s) return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "stream %p is not a live stream", (void *)stream);
  counters().gemms++;
  count_gemm(gemm_count(p, *beta != 0.0f, scales));
  if (!op_enqueue(s, "cublasLtMatmul", acc, n)) return CUBLAS_STATUS_SUCCESS; /* the race is a fault, as a GPU's */
  compute(p, hv(A), hv(B), hv(C == D ? D : C), hv(D), *alpha, *beta, scales[0] ? hv(scales[0]) : NULL,
          scales[1] ? hv(scales[1]) : NULL);
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace nvl_emu

extern "C" cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                                         cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b,
                                         const void *beta, const void *C, cublasLtMatrixLayout_t c, void *D,
                                         cublasLtMatrixLayout_t d, const cublasLtMatmulAlgo_t *algo, void *workspace,
                                         size_t workspace_bytes, cudaStream_t stream) {
  NVL_EMU_LOCK;
  if (!h || !op || !alpha || !beta || !A || !a || !B || !b || !C || !c || !D || !d || !algo)
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: NULL argument");
  const bool dev_ab = op->pointer_mode == CUBLASLT_POINTER_MODE_DEVICE;
  if (!dev_ab && (in_device_range(alpha) || in_device_range(beta)))
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "alpha/beta in device memory with CUBLASLT_POINTER_MODE_HOST");
  if (dev_ab && (!in_device_range(alpha) || !in_device_range(beta)))
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "alpha/beta in host memory with CUBLASLT_POINTER_MODE_DEVICE");
  if (h->dev != current_device())
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "the handle belongs to cuda:%d, cuda:%d is current", h->dev,
                     current_device());
  Problem p{op, a, b, c, d, 0, 0, 0};
  cublasStatus_t st = check_problem(p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (algo->data[0] != ALGO_MAGIC || algo->data[1] != fingerprint(p))
    return lt_refuse(CUBLAS_STATUS_INVALID_VALUE, "the algorithm was not returned by cublasLtMatmulAlgoGetHeuristic "
                     "for this problem (descriptor or layouts changed since)");
  return matmul(p, algo, (const float *)alpha, (const float *)beta, A, B, C, D, workspace, workspace_bytes, stream);
}
