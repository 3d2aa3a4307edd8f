/* gemm.cu: the GEMMs of nvl_qmatmul on device operands, through cuBLASLt with fp32 accumulation
 * (the qgemm entry of the CUDA table, and its gemm_path query). Operands are classified by their
 * format's traits row (scale kind, element codec), never by format name:
 *   f32 x f32      native fp32 GEMM (CUBLAS_COMPUTE_32F, no TF32)
 *   bf16 x bf16    native bf16 GEMM
 *   fp8 x fp8      native fp8 GEMM, per-tensor decode scales through A/B_SCALE_POINTER (sm_89+;
 *                  e4m3/e5m2 in any mix but e5m2 x e5m2, which cuBLASLt lacks)
 *   nvfp4 x nvfp4  native on sm_100 (CUDA_R_4F_E2M1, VEC16_UE4M3 scales in the 128x4 swizzled
 *                  layout, s_dec_a * s_dec_b as alpha); emulated elsewhere
 *   mxfp8 x mxfp8  native on sm_100 (VEC32_UE8M0 scales, swizzled); emulated elsewhere and for
 *                  e5m2 x e5m2
 *   other mixes of bf16 / fp8 / mx formats / nvfp4 (mx with e2m1 elements included): emulated
 * "Emulated" is core/NUMERICS.md §7's exact emulation: each operand dequantized to bf16 without its global
 * factor (exact: nvfp4 value * ue4m3 scale has at most 6 significant bits; fp8 values fit bf16;
 * mxfp8 value * 2^k fits bf16's normal range unless the block scale is tiny), then one bf16 x bf16
 * -> fp32 GEMM on the tensor cores with alpha = alpha_a * alpha_b. No subnormal value, product or
 * partial sum may reach the tensor cores (the rule of the CPU's bf16 units, qentry_cpu.c use_bf16):
 * where an mx block scale or a bf16 operand's exponents could make one, the operands are scaled by
 * powers of two chosen on the device and alpha by the inverse (emulated_gemm, decide); where no such
 * scaling exists, a CUDA-core kernel computes the exact fp32 sum instead. No host synchronisation.
 * Unsupported combinations are errors that say why; nothing falls back silently:
 * nvl_cuda_gemm_path reports the path a pair of formats takes on a device.
 *
 * Layout: nvlua's operands are row-major A (M, K), B (N, K) and out (M, N). cuBLASLt is
 * column-major, so out^T (N, M) = B . A^T is computed: cuBLASLt's A is our B read transposed
 * (a K x N column-major matrix, ld K, op T), its B is our A (K x M, ld K, op N), D is N x M with
 * ld N: the "TN" layout the fp8 and block-scaled kernels require.
 *
 * Scratch (the bf16 copies of emulated operands, the fp8 scale floats, the range words, the
 * cuBLASLt workspace) is call scratch from the caller (nvl_kctx).
 *
 * Not here: quantization (quant.cu), the CPU emulation (kernels/cpu/qentry_cpu.c). */
#include <cublasLt.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common.cuh"
#include "dtype.h"

#define NVL_MAX_GPUS 16

namespace {

const char *fmt_name(int f) { return f >= 0 && f < NVL_DTYPE_COUNT ? nvl_dtypes[f].name : "?"; }

/* ---- handles, workspace, plans -------------------------------------------------------------- */

const size_t WORKSPACE = (size_t)32 << 20;

struct Lt {
  cublasLtHandle_t h;
};
Lt lts[NVL_MAX_GPUS];
pthread_mutex_t lt_mu = PTHREAD_MUTEX_INITIALIZER;

nvl_status get_lt(int dev, Lt **out) {
  const char *fn = "nvl_cuda_qgemm";
  pthread_mutex_lock(&lt_mu);
  Lt *l = &lts[dev];
  if (!l->h) {
    cublasStatus_t st = cublasLtCreate(&l->h);
    if (st != CUBLAS_STATUS_SUCCESS) {
      l->h = NULL;
      pthread_mutex_unlock(&lt_mu);
      return nvl_error(NVL_EDEVICE, "%s: cublasLtCreate on cuda:%d failed: %s (%s)", fn, dev,
                       cublasLtGetStatusString(st), cublasLtGetStatusName(st));
    }
  }
  pthread_mutex_unlock(&lt_mu);
  *out = l;
  return NVL_OK;
}

/* What one cuBLASLt matmul is, in cuBLASLt's terms (m = our N, n = our M). */
struct Spec {
  int dev;
  cudaDataType ta, tb, tc; /* cuBLASLt's A (our B), B (our A), C = D */
  int scale_mode;          /* -1: none; else the cublasLtMatmulMatrixScale_t of both A and B */
  int per_tensor_scales;   /* fp8: A/B_SCALE_POINTER are single device floats */
  int alpha_dev;           /* CUBLASLT_POINTER_MODE_DEVICE: alpha and beta are device floats */
  int64_t m, n, k;
  int accumulate;
  uint32_t align[3];       /* the alignment in bytes (up to 256) of A, B and C = D: the algorithm
                            * is chosen for them (MIN_ALIGNMENT preferences), so they are in the key */
};

bool same_spec(const Spec &a, const Spec &b) {
  return a.dev == b.dev && a.ta == b.ta && a.tb == b.tb && a.tc == b.tc && a.scale_mode == b.scale_mode &&
         a.per_tensor_scales == b.per_tensor_scales && a.alpha_dev == b.alpha_dev && a.m == b.m && a.n == b.n && a.k == b.k &&
         a.accumulate == b.accumulate && a.align[0] == b.align[0] && a.align[1] == b.align[1] &&
         a.align[2] == b.align[2];
}

/* The largest power of two up to 256 that divides p's address. */
uint32_t align_of(const void *p) {
  uint32_t a = 256;
  while (a > 1 && ((uintptr_t)p & (a - 1))) a >>= 1;
  return a;
}

/* A cached plan: descriptors and the heuristic's algorithm for one Spec. Pointers (data, scales)
 * are set per call. */
struct Plan {
  bool used;
  uint64_t last_use; /* plan_clock at its last use: the least recently used plan is evicted */
  Spec s;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
};
const int NPLANS = 64;
Plan plans[NPLANS]; /* guarded by lt_mu, as are the descriptors inside */
uint64_t plan_clock;

void destroy_plan(Plan *p) {
  if (p->op) cublasLtMatmulDescDestroy(p->op);
  if (p->a) cublasLtMatrixLayoutDestroy(p->a);
  if (p->b) cublasLtMatrixLayoutDestroy(p->b);
  if (p->c) cublasLtMatrixLayoutDestroy(p->c);
  memset(p, 0, sizeof *p);
}

const char *type_name(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F: return "f32";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    case CUDA_R_4F_E2M1: return "e2m1";
    default: return "?";
  }
}

nvl_status build_plan(Lt *l, const Spec &s, Plan *p, void *placeholder) {
  const char *fn = "nvl_cuda_qgemm";
  memset(p, 0, sizeof *p);
  p->s = s;
  nvl_status st = NVL_OK;
  do {
    cublasStatus_t r;
#define LT_TRY(call)                                                                                       \
  if ((r = (call)) != CUBLAS_STATUS_SUCCESS) {                                                             \
    st = nvl_error(NVL_EDEVICE, "%s: %s failed: %s (%s)", fn, #call, cublasLtGetStatusString(r),           \
                   cublasLtGetStatusName(r));                                                              \
    break;                                                                                                 \
  }
    LT_TRY(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (s.scale_mode >= 0) {
      int32_t mode = s.scale_mode;
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
    }
    if (s.alpha_dev) {
      int32_t pm = CUBLASLT_POINTER_MODE_DEVICE;
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm));
    }
    /* placeholder scale pointers (any device memory) so the heuristic sees a scaled GEMM; the
     * real ones are set per call */
    if (s.scale_mode >= 0 || s.per_tensor_scales) {
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder,
                                            sizeof placeholder));
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder,
                                            sizeof placeholder));
    }
    LT_TRY(cublasLtMatrixLayoutCreate(&p->a, s.ta, (uint64_t)s.k, (uint64_t)s.m, s.k));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->b, s.tb, (uint64_t)s.k, (uint64_t)s.n, s.k));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->c, s.tc, (uint64_t)s.m, (uint64_t)s.n, s.m));
    cublasLtMatmulPreference_t pref = NULL;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = WORKSPACE;
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    r = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    /* without these the heuristic assumes 256-byte-aligned pointers; wgrad's C/D can be a view of the
     * flat gradient buffer at any 16-byte multiple (issue 15 D3) */
    static const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && r == CUBLAS_STATUS_SUCCESS; i++)
      r = cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &s.align[i < 3 ? i : 2], sizeof(uint32_t));
    if (r == CUBLAS_STATUS_SUCCESS)
      r = cublasLtMatmulAlgoGetHeuristic(l->h, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (r != CUBLAS_STATUS_SUCCESS && r != CUBLAS_STATUS_NOT_SUPPORTED) {
      st = nvl_error(NVL_EDEVICE, "%s: cublasLtMatmulAlgoGetHeuristic failed: %s (%s)", fn,
                     cublasLtGetStatusString(r), cublasLtGetStatusName(r));
      break;
    }
    if (r == CUBLAS_STATUS_NOT_SUPPORTED || found == 0) {
      st = nvl_error(NVL_EUNSUPPORTED, "%s: cuBLASLt has no algorithm for %s x %s -> %s%s (m=%lld, n=%lld, k=%lld, "
                     "TN%s) on sm_%d; check the alignment rules of this type combination (e.g. K a multiple of 16 "
                     "bytes' worth of elements)", fn, type_name(s.tb), type_name(s.ta), type_name(s.tc),
                     s.scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 ? " with VEC16_UE4M3 scales"
                     : s.scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 ? " with VEC32_UE8M0 scales" : "",
                     (long long)s.n, (long long)s.m, (long long)s.k, s.accumulate ? ", beta = 1" : "", nvl_cuda_cc(s.dev));
      break;
    }
    p->algo = res.algo;
#undef LT_TRY
  } while (0);
  if (st != NVL_OK) {
    destroy_plan(p);
    return st;
  }
  p->used = true;
  return NVL_OK;
}

/* The plan of s: a cached one, or one built in place of an empty slot or of the least recently
 * used plan. Called with lt_mu held (the plan is valid while it stays held). */
nvl_status get_plan(Lt *l, const Spec &s, Plan **out, void *placeholder) {
  Plan *victim = &plans[0];
  for (int i = 0; i < NPLANS; i++) {
    Plan *p = &plans[i];
    if (p->used && same_spec(p->s, s)) {
      p->last_use = ++plan_clock;
      *out = p;
      return NVL_OK;
    }
    if (victim->used && (!p->used || p->last_use < victim->last_use)) victim = p;
  }
  if (victim->used) destroy_plan(victim);
  NVL_TRY(build_plan(l, s, victim, placeholder));
  victim->last_use = ++plan_clock;
  *out = victim;
  return NVL_OK;
}

/* The device floats a GEMM reads through pointers (A/B_SCALE_POINTER; alpha and beta in
 * CUBLASLT_POINTER_MODE_DEVICE), each 16 bytes from the next: cuBLASLt's fp8 GEMM on an H200
 * (cuBLASLt 13.1, 2026-11-28) answered CUBLAS_STATUS_NOT_SUPPORTED at cublasLtMatmul when the B scale
 * lay 4 bytes after the A scale, though the heuristic (given 256-byte-aligned placeholders) had found
 * an algorithm. The emulator (kernels/cuda/emu) enforces the 16-byte rule. */
enum { SC_A = 0, SC_B = 4, SC_ALPHA = 8, SC_BETA = 12, SC_FLOATS = 16 };

/* Run one planned matmul: d (m x n col-major) = alpha * op(A) op(B) (+ d when accumulating); the
 * cuBLASLt workspace is call scratch. alpha_dev: NULL, or the device floats alpha (alpha_dev[0]) and
 * beta (alpha_dev[SC_BETA - SC_ALPHA]) (computed on
 * the device from amaxes that live there), which replace the host alpha and beta. */
nvl_status run_matmul(nvl_kctx *ctx, const Spec &spec, const void *A, const void *B, void *D, float alpha,
                      const void *scale_a, const void *scale_b, const float *alpha_dev = NULL) {
  const char *fn = "nvl_cuda_qgemm";
  Spec s = spec;
  s.alpha_dev = alpha_dev != NULL;
  s.align[0] = align_of(A);
  s.align[1] = align_of(B);
  s.align[2] = align_of(D);
  Lt *l = NULL;
  NVL_TRY(get_lt(s.dev, &l));
  void *ws = NULL;
  NVL_TRY(ctx->scratch(ctx, WORKSPACE, &ws));
  /* the plan's descriptor gets this call's scale pointers: plan lookup, the pointers and the
   * (asynchronous) matmul under one lock, so no other thread changes or evicts it meanwhile */
  pthread_mutex_lock(&lt_mu);
  Plan *p = NULL;
  nvl_status st = get_plan(l, s, &p, ws);
  cublasStatus_t r = CUBLAS_STATUS_SUCCESS;
  const char *call = "cublasLtMatmulDescSetAttribute";
  if (st == NVL_OK && (s.scale_mode >= 0 || s.per_tensor_scales)) {
    r = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a);
    if (r == CUBLAS_STATUS_SUCCESS)
      r = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b);
  }
  const float beta = s.accumulate ? 1.0f : 0.0f;
  (void)cudaGetLastError();
  if (st == NVL_OK && r == CUBLAS_STATUS_SUCCESS) {
    call = "cublasLtMatmul";
    const void *pa = alpha_dev ? (const void *)alpha_dev : (const void *)&alpha;
    const void *pb = alpha_dev ? (const void *)(alpha_dev + (SC_BETA - SC_ALPHA)) : (const void *)&beta;
    r = cublasLtMatmul(l->h, p->op, pa, A, p->a, B, p->b, pb, D, p->c, D, p->c, &p->algo, ws, WORKSPACE, 0);
  }
  pthread_mutex_unlock(&lt_mu);
  NVL_TRY(st);
  if (r != CUBLAS_STATUS_SUCCESS)
    return nvl_error(NVL_EDEVICE, "%s: %s failed: %s (%s)", fn, call, cublasLtGetStatusString(r),
                     cublasLtGetStatusName(r));
  char what[160];
  snprintf(what, sizeof what, "cublasLtMatmul (%s x %s -> %s, M=%lld, N=%lld, K=%lld)", type_name(s.tb), type_name(s.ta),
           type_name(s.tc), (long long)s.n, (long long)s.m, (long long)s.k);
  return nvl_cuda_check_launch(s.dev, fn, what);
}

/* ---- the emulated path's range, decided on the device ---------------------------------------- *
 * NUMERICS §7: the bf16 tensor cores may flush subnormal inputs, products and partial sums, so the
 * emulated GEMM multiplies operands scaled by powers of two 2^s_a, 2^s_b (s >= 0) chosen so that no
 * subnormal can occur, and the GEMM's alpha is alpha_a * alpha_b * 2^-(s_a + s_b) (a device float,
 * CUBLASLT_POINTER_MODE_DEVICE). The choice is made on the device from the operands' exponent range
 * (one scan of the mx block scales or bf16 values, no copy to the host), by every kernel that needs
 * it (decide(): a pure function of four words). Where no such pair of shifts exists, the operands
 * are zeroed, the cuBLASLt GEMM adds nothing, and fallback_gemm_kernel computes the exact fp32
 * products and sums instead. */

/* What the host knows of one operand's decoded values v (without global factors). */
enum { RANGE_FIXED = 0, RANGE_MX = 1, RANGE_BF16 = 2 };
struct OpRange {
  int mode;      /* RANGE_FIXED: lo and top below; RANGE_MX: from its block scales' exponents e (v = elem *
                  * 2^(e-127), elem a multiple of 2^lo, |elem| < 2^top); RANGE_BF16: from its values' exponents */
  int lo, top;   /* RANGE_FIXED: every nonzero |v| is a multiple of 2^lo and >= 2^lo, and < 2^top */
  int shiftable; /* dequantized by a kernel here (a bf16 operand is used as it is: never shifted) */
};
struct RangeInfo {
  OpRange op[2];
  int log2k;          /* ceil(log2 K): sum |a b| over K terms < 2^(top_a + top_b + log2k) */
  float alpha_host;   /* the GEMM's alpha_a * alpha_b, */
  const float *alpha_dev; /* or, when not NULL, the device float holding it (gemm_scales_kernel's) */
};
struct Decision {
  int s[2];    /* the shifts: operand i is multiplied by 2^s[i] */
  int fail;    /* no shifts keep every value, product and sum exact: fallback_gemm_kernel computes */
  float alpha; /* the GEMM's alpha, alpha_a * alpha_b * 2^-(s[0] + s[1]) (exact) */
};

/* 2^e for -126 <= e <= 127 */
__device__ __forceinline__ float pow2(int e) { return u2f((uint32_t)(127 + e) << 23); }

/* range words (4, zeroed): w[2i] = max over operand i's counted exponents e of 255 - e, w[2i + 1] = max
 * of e + 1 (0: no finite nonzero value). Counted: an mx block's scale byte, but for a NaN scale (255)
 * and for a block of zero codes (every zero block has e = 0, the smallest scale: it would take a
 * shift that its values, all zero, do not need); a bf16 value's exponent field, but for zeros,
 * infinities and NaN. */
__device__ __forceinline__ int range_min(const uint32_t *w, int i) { return 255 - (int)w[2 * i]; }
__device__ __forceinline__ int range_max(const uint32_t *w, int i) { return (int)w[2 * i + 1] - 1; }

__device__ Decision decide(const uint32_t *w, const RangeInfo &ri) {
  const float alpha = ri.alpha_dev ? *ri.alpha_dev : ri.alpha_host;
  Decision d = {{0, 0}, 0, alpha};
  int lo[2], mag[2], top[2], smax[2], need[2];
  for (int i = 0; i < 2; i++) {
    const OpRange &o = ri.op[i];
    if (o.mode == RANGE_FIXED) {
      lo[i] = mag[i] = o.lo;
      top[i] = o.top;
    } else {
      if (w[2 * i] == 0) return d; /* no finite nonzero value: every product is 0 (or NaN either way) */
      const int m = range_min(w, i), M = range_max(w, i);
      if (o.mode == RANGE_MX) {
        lo[i] = mag[i] = m - 127 + o.lo;
        top[i] = M - 127 + o.top;
      } else { /* bf16: the lowest mantissa bit; a subnormal (field 0) is below 2^-126 */
        lo[i] = m - 127 - 7;
        mag[i] = m == 0 ? -127 : m - 127;
        top[i] = M - 127 + 1;
      }
    }
    /* shifted values stay finite in bf16: every |v| 2^s < 2^128 (v has at most 8 significant bits, so
     * it is at most bf16's largest finite value); a value already out of range takes no shift */
    smax[i] = !o.shiftable || top[i] >= 128 ? 0 : top[i] <= 1 ? 127 : 128 - top[i];
    need[i] = mag[i] < -126 ? -126 - mag[i] : 0; /* every nonzero |v| 2^s >= 2^-126 */
    if (need[i] > smax[i]) {
      d.fail = 1;
      return d;
    }
  }
  /* every product, so every partial sum, a multiple of 2^-126 (zero or normal) */
  int extra = -126 - (lo[0] + lo[1]) - need[0] - need[1];
  d.s[0] = need[0];
  d.s[1] = need[1];
  for (int i = 0; i < 2 && extra > 0; i++) {
    const int add = extra < smax[i] - d.s[i] ? extra : smax[i] - d.s[i];
    d.s[i] += add;
    extra -= add;
  }
  /* a shift must not make a finite sum overflow (sum |a b| 2^k < 2^127 keeps every partial sum
   * finite), and alpha 2^-k must be exact and normal (cuBLASLt's epilogue is not documented to keep
   * a subnormal alpha), so alpha 2^-k (2^k sum) is alpha sum rounded once, as the CPU's */
  const int k = d.s[0] + d.s[1];
  const bool plain = alpha == 0.0f || !(fabsf(alpha) < u2f(0x7F800000u)); /* 0, inf, NaN: scaled alike */
  if (extra > 0 || (k > 0 && (top[0] + top[1] + ri.log2k + k > 127 ||
                              (!plain && (k > 252 || fabsf(alpha) < pow2(k - 126)))))) {
    d.s[0] = d.s[1] = 0;
    d.fail = 1;
    return d;
  }
  if (k > 0) { /* two steps of at most 2^-126 each: the first result is at least the final one, normal */
    const int k1 = k < 126 ? k : 126;
    d.alpha = f_mul(f_mul(alpha, pow2(-k1)), pow2(-(k - k1)));
  }
  return d;
}

/* Operand `which` of a GEMM: its multiplier 2^s (1 without a range), or 0 where the GEMM falls back. */
__device__ __forceinline__ float operand_mult(const uint32_t *w, const RangeInfo &ri, int which) {
  if (!w) return 1.0f;
  const Decision d = decide(w, ri);
  return d.fail ? 0.0f : pow2(d.s[which]);
}

/* v times mult; mult 0 (the fallback) gives +0 whatever v is (an infinity or a NaN included) */
__device__ __forceinline__ float scaled(float v, float mult) { return mult == 0.0f ? 0.0f : f_mul(v, mult); }

/* nvfp4 blocks [0, nblk): y (16 per block) = value(code) * float(sd) * mult, exact in bf16 (mult 2^s
 * from operand_mult, or 0). */
__global__ void __launch_bounds__(256) dequant_nvfp4_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ packed,
                                                            const uint8_t *__restrict__ scales, int64_t nblk,
                                                            const uint32_t *range, RangeInfo ri, int which) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const float mult = operand_mult(range, ri, which);
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < nblk; g += stride) {
    const float sd = scaled(e4m3_decode(scales[g] & 0x7Fu), mult); /* ue4m3 x 2^s: exact (see decide) */
    const uint2 p = *reinterpret_cast<const uint2 *>(packed + 8 * g);
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
      uint32_t byte = ((i < 4 ? p.x : p.y) >> (8 * (i & 3))) & 0xFFu;
      uint32_t lo = f32_to_bf16_bits(f_mul(e2m1_decode(byte & 15u), sd));
      uint32_t hi = f32_to_bf16_bits(f_mul(e2m1_decode(byte >> 4), sd));
      w[i] = lo | hi << 16;
    }
    uint4 *dst = reinterpret_cast<uint4 *>(y + 16 * g);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

/* One element code of codec elem (0 e4m3, 1 e5m2, 2 e2m1) -> its value. */
__device__ __forceinline__ float elem_decode(int elem, uint32_t c) {
  return elem == 2 ? e2m1_decode(c & 15u) : elem == 1 ? e5m2_decode(c) : e4m3_decode(c);
}

/* mx blocks [0, nblk) of any element codec (e2m1 codes packed two per byte): y (32 per block) =
 * value(code) * 2^(e-127) * mult. The first product is exact in fp32 (or infinite, as the CPU's
 * decode), the second exact by decide's choice. */
__global__ void __launch_bounds__(256) dequant_mx_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ codes,
                                                         const uint8_t *__restrict__ scales, int64_t nblk, int elem,
                                                         const uint32_t *range, RangeInfo ri, int which) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int bpb = elem == 2 ? 16 : 32; /* code bytes per block */
  const float mult = operand_mult(range, ri, which);
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < nblk; g += stride) {
    const float s = e8m0_decode(scales[g]);
    const uint8_t *src = codes + bpb * g;
    uint16_t *dst = y + 32 * g;
#pragma unroll 4
    for (int j = 0; j < 32; j++) {
      uint32_t c = elem == 2 ? (src[j >> 1] >> (4 * (j & 1))) & 15u : src[j];
      dst[j] = f32_to_bf16_bits(scaled(f_mul(elem_decode(elem, c), s), mult));
    }
  }
}

/* fp8 per-tensor codes (n) -> their values times mult in bf16 (exact), the scale left to alpha. */
__global__ void __launch_bounds__(256) dequant_fp8_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ codes,
                                                          int64_t n, int e5, const uint32_t *range, RangeInfo ri,
                                                          int which) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const float mult = operand_mult(range, ri, which);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = f32_to_bf16_bits(scaled(e5 ? e5m2_decode(codes[i]) : e4m3_decode(codes[i]), mult));
}

/* Element i of an operand, row-major (rows, K), decoded without its global factor into f32 (exact:
 * NUMERICS §7). cls: 0 nvfp4, 1 mx, 2 fp8, 3 bf16; elem as elem_decode. */
__device__ __forceinline__ float decode_unscaled(const uint8_t *codes, const uint8_t *scales, int64_t i, int cls,
                                                 int elem) {
  if (cls == 0) return f_mul(e2m1_decode((codes[i >> 1] >> (4 * (i & 1))) & 15u), e4m3_decode(scales[i >> 4] & 0x7Fu));
  if (cls == 1) {
    uint32_t c = elem == 2 ? (codes[i >> 1] >> (4 * (i & 1))) & 15u : codes[i];
    return f_mul(elem_decode(elem, c), e8m0_decode(scales[i >> 5]));
  }
  if (cls == 2) return elem_decode(elem, codes[i]);
  return bf16_bits_to_f32(reinterpret_cast<const uint16_t *>(codes)[i]);
}

/* y[i] = element i decoded with its global factor, as the CPU's dequantize computes it (value(q) *
 * block scale, then the factor: nvfp4 (value * sd) * s_dec, fp8 value / scale, mx value * e8m0, bf16
 * widened, f32 copied); cls as decode_unscaled's, 4: f32. */
__global__ void __launch_bounds__(256) dequant_scaled_kernel(float *__restrict__ y, const uint8_t *__restrict__ codes,
                                                             const uint8_t *__restrict__ scales, int64_t n, int cls,
                                                             int elem, float g) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v;
    if (cls == 4) v = reinterpret_cast<const float *>(codes)[i];
    else {
      v = decode_unscaled(codes, scales, i, cls, elem);
      if (cls == 0) v = f_mul(v, g);
      else if (cls == 2) v = f_div(v, g);
    }
    y[i] = v;
  }
}

/* One operand's range scan (the words of decide): an mx operand's n block scales (codes: its codes,
 * read only for blocks whose scale byte is 0), or a bf16 operand's n values; mode 0: nothing. */
struct ScanOp {
  const uint8_t *scales, *codes;
  const uint16_t *values;
  int64_t n;
  int mode; /* 0, RANGE_MX or RANGE_BF16 */
  int fp4;  /* mx: e2m1 codes, two per byte */
};

__device__ __forceinline__ uint32_t scan_exp(const ScanOp &o, int64_t i) {
  if (o.mode == RANGE_BF16) {
    const uint32_t h = o.values[i], e = (h >> 7) & 0xFFu;
    return (h & 0x7FFFu) && e != 255 ? e : 255u;
  }
  const uint32_t e = o.scales[i];
  if (e == 0) { /* a block of zero codes (+-0) has no range; read byte by byte (views of rows need
                 * not be 16-byte aligned), only for such blocks */
    uint32_t any = 0;
    const uint8_t *c = o.codes + (o.fp4 ? 16 : 32) * i;
    for (int q = 0; q < (o.fp4 ? 16 : 32); q++) any |= c[q] & (o.fp4 ? 0x77u : 0x7Fu);
    if (!any) return 255u;
  }
  return e; /* 255: a NaN scale */
}

/* w (4, zeroed) = the range words of the two operands, from one pass over both (decide). */
__global__ void __launch_bounds__(256) range_scan_kernel(uint32_t *w, ScanOp a, ScanOp b) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t r[4] = {0, 0, 0, 0};
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.n + b.n; i += stride) {
    const int which = i >= a.n;
    const uint32_t e = which ? scan_exp(b, i - a.n) : scan_exp(a, i);
    if (e < 255) {
      r[2 * which] = max(r[2 * which], 255u - e);
      r[2 * which + 1] = max(r[2 * which + 1], e + 1);
    }
  }
  for (int q = 0; q < 4; q++) {
    const uint32_t m = __reduce_max_sync(0xFFFFFFFFu, r[q]);
    if ((threadIdx.x & 31) == 0 && m) atomicMax(&w[q], m);
  }
}

/* One operand of fallback_gemm_kernel: its codes (bf16 values for cls 3), block scales, decode_unscaled's cls and elem. */
struct FbOp {
  const uint8_t *codes, *scales;
  int cls, elem;
};

/* The emulated GEMM's alpha and beta for cuBLASLt (sc[SC_ALPHA], sc[SC_BETA], read in
 * CUBLASLT_POINTER_MODE_DEVICE) and, where decide() fails, its result: out (M, N) row-major, f32 (+=
 * with accumulate) or bf16, = alpha * sum over k of a[m, k] b[n, k], exact fp32 products summed in
 * fp32 in k's order, as the CPU's sgemm path (qentry_cpu.c qgemm_into: the sum times alpha unless
 * alpha is 1, then added or rounded once). The cuBLASLt GEMM after it then has zeroed operands,
 * alpha -0 and beta 1: out + (-0) is out. When decide() does not fail, one thread writes the two
 * floats and every other returns at once. */
__global__ void __launch_bounds__(256) fallback_gemm_kernel(float *sc, void *out, FbOp a, FbOp b, int64_t M, int64_t N,
                                                            int64_t K, int accumulate, int out_bf16,
                                                            const uint32_t *range, RangeInfo ri) {
  const Decision d = decide(range, ri);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    sc[SC_ALPHA] = d.fail ? -0.0f : d.alpha;
    sc[SC_BETA] = d.fail || accumulate ? 1.0f : 0.0f;
  }
  if (!d.fail) return;
  const float alpha = ri.alpha_dev ? *ri.alpha_dev : ri.alpha_host;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < M * N; i += stride) {
    const int64_t m = i / N, n = i - m * N;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++)
      acc = f_add(acc, f_mul(decode_unscaled(a.codes, a.scales, m * K + k, a.cls, a.elem),
                             decode_unscaled(b.codes, b.scales, n * K + k, b.cls, b.elem)));
    const float v = alpha == 1.0f ? acc : f_mul(acc, alpha);
    if (out_bf16) static_cast<uint16_t *>(out)[i] = f32_to_bf16_bits(v);
    else if (accumulate) static_cast<float *>(out)[i] = f_add(static_cast<float *>(out)[i], v);
    else static_cast<float *>(out)[i] = v;
  }
}

/* sc[SC_A], sc[SC_B] = the per-tensor decode scales of an fp8 GEMM's operands (cuBLASLt reads them
 * on the device). */
__global__ void set_scales_kernel(float *sc, float s0, float s1) {
  sc[SC_A] = s0;
  sc[SC_B] = s1;
}

/* The per-tensor decode factor of an operand whose amax is on the device (kind 1: fp8 with element
 * maximum emax, 1 / its scale; kind 2: nvfp4), or host (kind 0), as core's traits dec_scale. */
__device__ float dec_factor(int kind, float emax, const uint32_t *amax, float host) {
  if (kind == 1) return f_div(1.0f, fp8_tensor_scale(u2f(*amax), emax));
  if (kind == 2) return nvfp4_dec_scale(u2f(*amax));
  return host;
}

/* sc[SC_A, SC_B, SC_ALPHA, SC_BETA] = {b's decode factor, a's, alpha = a's * b's (the CPU's
 * alpha_a * alpha_b), beta}: what an fp8 GEMM reads through A/B_SCALE_POINTER, or alpha and beta in
 * CUBLASLT_POINTER_MODE_DEVICE. */
__global__ void gemm_scales_kernel(float *sc, int ka, float ea, const uint32_t *amax_a, float host_a, int kb, float eb,
                                   const uint32_t *amax_b, float host_b, float beta) {
  const float da = dec_factor(ka, ea, amax_a, host_a), db = dec_factor(kb, eb, amax_b, host_b);
  sc[SC_A] = db;
  sc[SC_B] = da;
  sc[SC_ALPHA] = f_mul(da, db);
  sc[SC_BETA] = beta;
}

/* The GEMM class of a format, from its traits row. */
enum Cls { CLS_F32, CLS_BF16, CLS_FP8, CLS_MX, CLS_NVFP4, CLS_NONE };

Cls cls_of(int f) {
  if (f < 0 || f >= NVL_DTYPE_COUNT) return CLS_NONE;
  const nvl_dtype_traits *t = &nvl_dtypes[f];
  if (f == NVL_F32) return CLS_F32;
  if (f == NVL_BF16) return CLS_BF16;
  switch (t->is_quantized ? t->scale : NVL_SCALE_KIND_COUNT) {
    case NVL_SCALE_TENSOR: return CLS_FP8;
    case NVL_SCALE_E8M0: return CLS_MX;
    case NVL_SCALE_UE4M3: return CLS_NVFP4;
    default: return CLS_NONE;
  }
}
int elem_of(int f) { return f >= 0 && f < NVL_DTYPE_COUNT ? nvl_dtypes[f].elem : -1; }
bool is_e5(int f) { return elem_of(f) == NVL_ELEM_E5M2; }
bool is_fp4(int f) { return elem_of(f) == NVL_ELEM_E2M1; }
cudaDataType fp8_type(int f) { return is_e5(f) ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

/* y (rows, K) bf16 = operand `which` of a GEMM dequantized without its global factor, times the
 * 2^s decide() picks from range (NULL: no range, times 1), or zeros where it fails. */
nvl_status dequant_bf16(uint16_t *y, const nvl_qview *o, const uint32_t *range, const RangeInfo &ri, int which,
                        int dev) {
  const int64_t n = o->rows * o->K;
  if (n == 0) return NVL_OK;
  char what[120];
  switch (cls_of(o->format)) {
    case CLS_NVFP4: {
      const int64_t nblk = n / 16;
      NVL_LAUNCH(nvl_cuda_grid(nblk, 256, dev), 256, 0, 0, dequant_nvfp4_kernel)(
          y, static_cast<const uint8_t *>(o->codes), o->scales, nblk, range, ri, which);
      snprintf(what, sizeof what, "dequant_nvfp4_kernel (%lld blocks)", (long long)nblk);
      break;
    }
    case CLS_MX: {
      const int64_t nblk = n / 32;
      NVL_LAUNCH(nvl_cuda_grid(nblk, 256, dev), 256, 0, 0, dequant_mx_kernel)(
          y, static_cast<const uint8_t *>(o->codes), o->scales, nblk, elem_of(o->format), range, ri, which);
      snprintf(what, sizeof what, "dequant_mx_kernel<%s> (%lld blocks)", fmt_name(o->format), (long long)nblk);
      break;
    }
    case CLS_FP8:
      NVL_LAUNCH(nvl_cuda_grid(n, 256, dev), 256, 0, 0, dequant_fp8_kernel)(
          y, static_cast<const uint8_t *>(o->codes), n, is_e5(o->format), range, ri, which);
      snprintf(what, sizeof what, "dequant_fp8_kernel (%lld elements)", (long long)n);
      break;
    default:
      return nvl_error(NVL_EINVAL, "nvl_cuda_qgemm: cannot dequantize %s to bf16", fmt_name(o->format));
  }
  return nvl_cuda_check_launch(dev, "nvl_cuda_qgemm", what);
}

/* The native GEMM of path NATIVE (operands of one class). */
nvl_status native_gemm(nvl_kctx *ctx, Spec &s, const nvl_gemm_desc *g, float alpha, const float *dsc) {
  const char *fn = "nvl_cuda_qgemm";
  const nvl_qview *a = g->a, *b = g->b;
  switch (cls_of(a->format)) {
    case CLS_F32:
      if (s.tc == CUDA_R_16BF) { /* cuBLASLt's f32 x f32 GEMM writes f32 only: into scratch, then RNE */
        const int64_t mn = s.m * s.n;
        float *y = NULL;
        NVL_TRY(ctx->scratch(ctx, (size_t)mn * sizeof(float), (void **)&y));
        s.tc = CUDA_R_32F;
        s.ta = s.tb = CUDA_R_32F;
        NVL_TRY(run_matmul(ctx, s, b->codes, a->codes, y, alpha, NULL, NULL));
        const int64_t one = 1;
        return nvl_cuda_copy_strided(g->out, NVL_BF16, &one, y, NVL_F32, &one, 1, &mn, ctx->dev);
      }
      s.ta = s.tb = CUDA_R_32F;
      return run_matmul(ctx, s, b->codes, a->codes, g->out, alpha, NULL, NULL);
    case CLS_BF16:
      s.ta = s.tb = CUDA_R_16BF;
      return run_matmul(ctx, s, b->codes, a->codes, g->out, alpha, NULL, NULL);
    case CLS_FP8: {
      /* decode scales on the device: [SC_A] for cuBLASLt's A (our b), [SC_B] for its B (our a);
       * from gemm_scales_kernel when an amax is on the device */
      float *sc = const_cast<float *>(dsc);
      if (!sc) {
        NVL_TRY(ctx->scratch(ctx, SC_FLOATS * sizeof(float), (void **)&sc));
        /* written by a kernel that takes them as arguments: a copy from a pageable host array would
         * synchronise the host with the device at every GEMM (issue 15 D7) */
        NVL_LAUNCH(1, 1, 0, 0, set_scales_kernel)(sc, b->alpha, a->alpha);
        NVL_TRY(nvl_cuda_check_launch(ctx->dev, fn, "set_scales_kernel"));
      }
      s.ta = fp8_type(b->format);
      s.tb = fp8_type(a->format);
      s.per_tensor_scales = 1;
      return run_matmul(ctx, s, b->codes, a->codes, g->out, 1.0f, sc + SC_A, sc + SC_B);
    }
    case CLS_NVFP4:
    case CLS_MX:
      if (!a->scales_swz || !b->scales_swz)
        return nvl_error(NVL_EINVAL, "%s: the native %s GEMM needs the operands' swizzled block scales", fn,
                         fmt_name(a->format));
      if (cls_of(a->format) == CLS_NVFP4) {
        s.ta = s.tb = CUDA_R_4F_E2M1;
        s.scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
      } else {
        s.ta = fp8_type(b->format);
        s.tb = fp8_type(a->format);
        s.scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
      }
      return run_matmul(ctx, s, b->codes, a->codes, g->out, alpha, b->scales_swz, a->scales_swz, dsc ? dsc + SC_ALPHA : NULL);
    default:
      return nvl_error(NVL_EINVAL, "%s: internal error: no native path for %s", fn, fmt_name(a->format));
  }
}

/* The host's part of an operand's range (decide): fixed for fp8 and nvfp4 values (e4m3 codes 2^-9 ..
 * 448 < 2^9, e5m2 2^-16 .. 57344 < 2^16, nvfp4 e2m1 x ue4m3 multiples of 2^-10 below 6 x 448 < 2^12),
 * scanned on the device for the mx formats (element lowest bit and bound: e4m3 2^-9, 2^9; e5m2
 * 2^-16, 2^16; e2m1 2^-1, 2^3) and bf16. */
OpRange op_range(const nvl_qview *o) {
  const int f = o->format;
  switch (cls_of(f)) {
    case CLS_MX: return is_fp4(f) ? OpRange{RANGE_MX, -1, 3, 1} : is_e5(f) ? OpRange{RANGE_MX, -16, 16, 1}
                                                                        : OpRange{RANGE_MX, -9, 9, 1};
    case CLS_BF16: return OpRange{RANGE_BF16, 0, 0, 0};
    case CLS_NVFP4: return OpRange{RANGE_FIXED, -10, 12, 1};
    default: return is_e5(f) ? OpRange{RANGE_FIXED, -16, 16, 1} : OpRange{RANGE_FIXED, -9, 9, 1};
  }
}

/* The emulated GEMM (sm_90 for nvfp4 and mx pairs; mixes everywhere): each operand dequantized
 * without its global factor into bf16 scratch, one cuBLASLt bf16 x bf16 -> fp32 GEMM, alpha =
 * alpha_a * alpha_b. bf16 holds every such value exactly, but the tensor cores may flush subnormal
 * inputs, products or partial sums (cuBLASLt does not document it), so no subnormal may reach them
 * (NUMERICS §7). fp8 and nvfp4 values never make one (lo_a + lo_b >= -20). An mx or bf16 operand's
 * exponent range is scanned on the device (range_scan_kernel, one pass over the mx block scales or the
 * bf16 values), and the kernels after it pick the power-of-two shifts from it (decide): no copy to
 * the host, no synchronisation; fallback_gemm_kernel writes the GEMM's device alpha and beta, and
 * where no shift exists, the exact result itself. */
nvl_status emulated_gemm(nvl_kctx *ctx, Spec &s, const nvl_gemm_desc *g, float alpha, const float *dsc) {
  const char *fn = "nvl_cuda_qgemm";
  const int dev = ctx->dev;
  const nvl_qview *ops[2] = {g->a, g->b};
  const void *bf[2] = {g->a->codes, g->b->codes};
  for (int i = 0; i < 2; i++)
    if ((cls_of(ops[i]->format) == CLS_NVFP4 || cls_of(ops[i]->format) == CLS_MX) && !ops[i]->scales)
      return nvl_error(NVL_EINVAL, "%s: %s operand without block scales", fn, fmt_name(ops[i]->format));
  RangeInfo ri;
  memset(&ri, 0, sizeof ri);
  for (int i = 0; i < 2; i++) ri.op[i] = op_range(ops[i]);
  while (((int64_t)1 << ri.log2k) < g->a->K) ri.log2k++;
  ri.alpha_host = alpha;
  ri.alpha_dev = dsc ? dsc + SC_ALPHA : NULL;
  uint32_t *range = NULL; /* (4) device: decide's words */
  if (ri.op[0].mode != RANGE_FIXED || ri.op[1].mode != RANGE_FIXED) {
    ScanOp so[2];
    memset(so, 0, sizeof so);
    for (int i = 0; i < 2; i++) {
      const nvl_qview *o = ops[i];
      so[i].mode = ri.op[i].mode == RANGE_FIXED ? 0 : ri.op[i].mode;
      if (so[i].mode == RANGE_MX) {
        so[i].scales = o->scales;
        so[i].codes = static_cast<const uint8_t *>(o->codes);
        so[i].n = o->rows * o->K / 32;
        so[i].fp4 = is_fp4(o->format);
      } else if (so[i].mode == RANGE_BF16) {
        so[i].values = static_cast<const uint16_t *>(o->codes);
        so[i].n = o->rows * o->K;
      }
    }
    NVL_TRY(ctx->scratch(ctx, 4 * sizeof(uint32_t), (void **)&range));
    NVL_TRY(nvl_cuda_memset(range, 0, 4 * sizeof(uint32_t), dev));
    NVL_LAUNCH(nvl_cuda_grid(so[0].n + so[1].n, 256, dev), 256, 0, 0, range_scan_kernel)(range, so[0], so[1]);
    NVL_TRY(nvl_cuda_check_launch(dev, fn, "range_scan_kernel"));
  }
  for (int i = 0; i < 2; i++) {
    if (cls_of(ops[i]->format) == CLS_BF16) continue;
    void *p = NULL;
    NVL_TRY(ctx->scratch(ctx, (size_t)(ops[i]->rows * ops[i]->K) * 2, &p));
    bf[i] = p;
    NVL_TRY(dequant_bf16(static_cast<uint16_t *>(p), ops[i], range, ri, i, dev));
  }
  s.ta = s.tb = CUDA_R_16BF;
  if (!range) return run_matmul(ctx, s, bf[1], bf[0], g->out, alpha, NULL, NULL, ri.alpha_dev);
  float *sc = NULL; /* the GEMM's alpha and beta, written by fallback_gemm_kernel */
  NVL_TRY(ctx->scratch(ctx, SC_FLOATS * sizeof(float), (void **)&sc));
  FbOp fo[2];
  for (int i = 0; i < 2; i++) {
    const Cls c = cls_of(ops[i]->format);
    fo[i] = FbOp{static_cast<const uint8_t *>(ops[i]->codes), ops[i]->scales,
                 c == CLS_NVFP4 ? 0 : c == CLS_MX ? 1 : c == CLS_FP8 ? 2 : 3, elem_of(ops[i]->format)};
  }
  const int64_t M = g->a->rows, N = g->b->rows;
  int blocks = nvl_cuda_grid(M * N, 256, dev);
  if (blocks > 64) blocks = 64; /* one thread works unless decide fails, which real operands never make it do */
  NVL_LAUNCH(blocks, 256, 0, 0, fallback_gemm_kernel)(sc, g->out, fo[0], fo[1], M, N, g->a->K, g->accumulate,
                                                      g->out_dtype == NVL_BF16, range, ri);
  NVL_TRY(nvl_cuda_check_launch(dev, fn, "fallback_gemm_kernel"));
  return run_matmul(ctx, s, bf[1], bf[0], g->out, alpha, NULL, NULL, sc + SC_ALPHA);
}

} /* namespace */

extern "C" nvl_gemm_path nvl_cuda_gemm_path(nvl_dtype fa, nvl_dtype fb, int dev, char *detail, size_t n) {
  char buf[256];
  nvl_gemm_path path = NVL_GEMM_UNSUPPORTED;
  Cls ca = cls_of(fa), cb = cls_of(fb);
  int cc = nvl_cuda_device_count() > dev && dev >= 0 ? nvl_cuda_cc(dev) : 0;
  const bool blackwell = cc >= 100 && cc < 110; /* sm_100 / sm_103: block-scaled tcgen05 GEMMs */
  if (ca == CLS_NONE || cb == CLS_NONE) {
    snprintf(buf, sizeof buf, "%s x %s is not a GEMM format pair", fmt_name(fa), fmt_name(fb));
  } else if (cc == 0) {
    snprintf(buf, sizeof buf, "cuda:%d is not available", dev);
  } else if (cc < 90) {
    snprintf(buf, sizeof buf, "nvlua's CUDA kernels are built for sm_90 and newer; cuda:%d is sm_%d", dev, cc);
  } else if (ca == CLS_F32 || cb == CLS_F32) {
    if (ca == cb) {
      path = NVL_GEMM_NATIVE;
      snprintf(buf, sizeof buf, "cuBLASLt fp32 GEMM (CUBLAS_COMPUTE_32F)");
    } else {
      snprintf(buf, sizeof buf, "%s x %s: f32 pairs only with f32 (an f32 operand has no exact bf16 emulation)",
               fmt_name(fa), fmt_name(fb));
    }
  } else if (ca == CLS_BF16 && cb == CLS_BF16) {
    path = NVL_GEMM_NATIVE;
    snprintf(buf, sizeof buf, "cuBLASLt bf16 GEMM, fp32 accumulation");
  } else if (ca == CLS_FP8 && cb == CLS_FP8) {
    if (is_e5(fa) && is_e5(fb)) {
      snprintf(buf, sizeof buf, "e5m2 x e5m2: cuBLASLt has no fp8 GEMM for two e5m2 operands (use e4m3 for one)");
    } else {
      path = NVL_GEMM_NATIVE;
      snprintf(buf, sizeof buf, "cuBLASLt fp8 GEMM (%s x %s), per-tensor scales through A/B_SCALE_POINTER", fmt_name(fa),
               fmt_name(fb));
    }
  } else if (ca == CLS_NVFP4 && cb == CLS_NVFP4 && blackwell) {
    path = NVL_GEMM_NATIVE;
    snprintf(buf, sizeof buf, "cuBLASLt block-scaled GEMM: CUDA_R_4F_E2M1, VEC16_UE4M3 swizzled scales, alpha = s_dec_a s_dec_b");
  } else if (ca == CLS_MX && cb == CLS_MX && blackwell && !is_fp4(fa) && !is_fp4(fb) && !(is_e5(fa) && is_e5(fb))) {
    path = NVL_GEMM_NATIVE;
    snprintf(buf, sizeof buf, "cuBLASLt block-scaled GEMM: %s x %s, VEC32_UE8M0 swizzled scales", fmt_name(fa), fmt_name(fb));
  } else {
    path = NVL_GEMM_EMULATED;
    snprintf(buf, sizeof buf, "exact emulation: %s and %s dequantized to bf16, cuBLASLt bf16 GEMM on the tensor cores, "
             "global scales as alpha; operands scaled by powers of two chosen on the device where block scales leave "
             "bf16's normal range (sm_%d)", fmt_name(fa),
             fmt_name(fb), cc);
  }
  if (detail && n) snprintf(detail, n, "%s", buf);
  if (path == NVL_GEMM_UNSUPPORTED) nvl_error(NVL_EUNSUPPORTED, "qmatmul on cuda:%d: %s", dev, buf);
  return path;
}

/* The dequantize entry of the CUDA table: y (nr, K) on the device = rows [r0, r0 + nr) of q decoded
 * (core/quant.c nvl_dequantize), bit for bit the CPU's values; unscaled: without the global factor.
 * The global factor is q's host amax/scale (core resolves a pending device amax first). */
extern "C" nvl_status nvl_cuda_dequantize(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                          int unscaled) {
  const int64_t n = nr * q->K;
  if (n == 0) return NVL_OK;
  const Cls c = cls_of(q->format);
  const int block = nvl_dtypes[q->format].block;
  const uint8_t *codes = static_cast<const uint8_t *>(q->codes) + nvl_code_bytes(q->format, r0 * q->K);
  const uint8_t *scales = q->scales && block > 0 ? q->scales + r0 * (q->K / block) : NULL;
  int cls;
  float g = 1.0f;
  switch (c) {
    case CLS_NVFP4: cls = 0; g = unscaled ? 1.0f : q->alpha; break; /* nvl_nvfp4_dec_scale_ref(amax) */
    case CLS_MX: cls = 1; break;
    case CLS_FP8: cls = 2; g = unscaled ? 1.0f : q->scale; break;
    case CLS_F32: cls = 4; break;
    default: cls = 3; break; /* bf16 */
  }
  NVL_LAUNCH(nvl_cuda_grid(n, 256, ctx->dev), 256, 0, 0, dequant_scaled_kernel)(y, codes, scales, n, cls,
                                                                                elem_of(q->format), g);
  return nvl_cuda_check_launch(ctx->dev, "nvl_cuda_dequantize", "dequant_scaled_kernel");
}

extern "C" nvl_status nvl_cuda_qgemm(nvl_kctx *ctx, const nvl_gemm_desc *g) {
  const char *fn = __func__;
  const int dev = ctx->dev;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  const int accumulate = g->accumulate, out_bf16 = g->out_dtype == NVL_BF16;
  if (accumulate && out_bf16) return nvl_error(NVL_EINVAL, "%s: accumulation is into f32 only", fn);
  const int64_t M = g->a->rows, N = g->b->rows, K = g->a->K;
  if (M == 0 || N == 0) return NVL_OK;
  if (!g->out || !g->a->codes || !g->b->codes) return nvl_error(NVL_EINVAL, "%s: NULL pointer", fn);
  if (K == 0) { /* an empty sum */
    if (accumulate) return NVL_OK;
    return nvl_cuda_memset(g->out, 0, (size_t)(M * N) * (out_bf16 ? 2 : 4), dev);
  }
  char detail[256];
  nvl_gemm_path path = nvl_cuda_gemm_path(g->a->format, g->b->format, dev, detail, sizeof detail);
  if (path == NVL_GEMM_UNSUPPORTED) return NVL_EUNSUPPORTED;
  Spec s;
  memset(&s, 0, sizeof s);
  s.dev = dev;
  s.tc = out_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  s.scale_mode = -1;
  s.m = N;
  s.n = M;
  s.k = K;
  s.accumulate = accumulate;
  const float alpha = g->a->alpha * g->b->alpha; /* as the CPU's qgemm: alpha_a * alpha_b in fp32 */
  /* an operand whose amax lives on the device (quant.h amax_pending): its decode factor, alpha and
   * beta are computed there, one tiny kernel, and nothing waits for the host */
  float *dsc = NULL;
  if (g->a->amax_dev || g->b->amax_dev) {
    const nvl_qview *o[2] = {g->a, g->b};
    int kind[2];
    float emax[2];
    for (int i = 0; i < 2; i++) {
      const Cls c = cls_of(o[i]->format);
      if (o[i]->amax_dev && c != CLS_FP8 && c != CLS_NVFP4)
        return nvl_error(NVL_EINVAL, "%s: a device amax on a %s operand (no per-tensor scale)", fn, fmt_name(o[i]->format));
      kind[i] = !o[i]->amax_dev ? 0 : c == CLS_FP8 ? 1 : 2;
      emax[i] = is_e5(o[i]->format) ? 57344.0f : 448.0f;
    }
    NVL_TRY(ctx->scratch(ctx, SC_FLOATS * sizeof(float), (void **)&dsc));
    NVL_LAUNCH(1, 1, 0, 0, gemm_scales_kernel)(dsc, kind[0], emax[0], reinterpret_cast<const uint32_t *>(g->a->amax_dev),
        g->a->alpha, kind[1], emax[1], reinterpret_cast<const uint32_t *>(g->b->amax_dev), g->b->alpha,
        accumulate ? 1.0f : 0.0f);
    NVL_TRY(nvl_cuda_check_launch(dev, fn, "gemm_scales_kernel"));
  }
  return path == NVL_GEMM_NATIVE ? native_gemm(ctx, s, g, alpha, dsc) : emulated_gemm(ctx, s, g, alpha, dsc);
}
