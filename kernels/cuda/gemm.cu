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
 * -> fp32 GEMM on the tensor cores with alpha = alpha_a * alpha_b. Where the CPU's rule for its bf16
 * units (qentry_cpu.c use_bf16: no subnormal value, product or partial sum) fails — an mx block
 * scale or a bf16 operand's exponents read from the device —, the operands go to fp32 and cuBLASLt's
 * fp32 GEMM instead (emulated_gemm), exact as well.
 * Unsupported combinations are errors that say why; nothing falls back silently:
 * nvl_cuda_gemm_path reports the path a pair of formats takes on a device.
 *
 * Layout: nvlua's operands are row-major A (M, K), B (N, K) and out (M, N). cuBLASLt is
 * column-major, so out^T (N, M) = B . A^T is computed: cuBLASLt's A is our B read transposed
 * (a K x N column-major matrix, ld K, op T), its B is our A (K x M, ld K, op N), D is N x M with
 * ld N: the "TN" layout the fp8 and block-scaled kernels require.
 *
 * Scratch (the bf16 copies of emulated operands, the fp8 scale floats, the inexact flag, the
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

/* ---- dequantization to bf16 for the emulated path ------------------------------------------- */

/* nvfp4 blocks [0, nblk): y (16 per block) = value(code) * float(sd), exact in bf16. */
__global__ void __launch_bounds__(256) dequant_nvfp4_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ packed,
                                                            const uint8_t *__restrict__ scales, int64_t nblk) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < nblk; g += stride) {
    const float sd = e4m3_decode(scales[g] & 0x7Fu);
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
 * value(code) * 2^(e-127); *inexact |= 1 where the product is not a bf16 value (outside bf16's
 * exponent range). */
__global__ void __launch_bounds__(256) dequant_mx_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ codes,
                                                         const uint8_t *__restrict__ scales, int64_t nblk, int elem,
                                                         uint32_t *inexact) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int bpb = elem == 2 ? 16 : 32; /* code bytes per block */
  uint32_t bad = 0;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < nblk; g += stride) {
    const float s = e8m0_decode(scales[g]);
    const uint8_t *src = codes + bpb * g;
    uint16_t *dst = y + 32 * g;
#pragma unroll 4
    for (int j = 0; j < 32; j++) {
      uint32_t c = elem == 2 ? (src[j >> 1] >> (4 * (j & 1))) & 15u : src[j];
      float v = f_mul(elem_decode(elem, c), s);
      uint16_t b = f32_to_bf16_bits(v);
      bad |= (v == v && bf16_bits_to_f32(b) != v);
      dst[j] = b;
    }
  }
  if (bad && inexact) atomicOr(inexact, 1u);
}

/* fp8 per-tensor codes (n) -> their values in bf16 (exact), the scale left to alpha. */
__global__ void __launch_bounds__(256) dequant_fp8_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ codes,
                                                          int64_t n, int e5) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = f32_to_bf16_bits(e5 ? e5m2_decode(codes[i]) : e4m3_decode(codes[i]));
}

/* One element of an operand, row-major (rows, K) index i, decoded without its global factor into
 * f32 (exact: NUMERICS §7), for the fp32 fallback of the emulated path. cls: 0 nvfp4, 1 mx, 2 fp8,
 * 3 bf16; elem as elem_decode. */
__global__ void __launch_bounds__(256) dequant_f32_kernel(float *__restrict__ y, const uint8_t *__restrict__ codes,
                                                          const uint8_t *__restrict__ scales, int64_t n, int cls,
                                                          int elem) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v;
    if (cls == 0) {
      v = f_mul(e2m1_decode((codes[i >> 1] >> (4 * (i & 1))) & 15u), e4m3_decode(scales[i >> 4] & 0x7Fu));
    } else if (cls == 1) {
      uint32_t c = elem == 2 ? (codes[i >> 1] >> (4 * (i & 1))) & 15u : codes[i];
      v = f_mul(elem_decode(elem, c), e8m0_decode(scales[i >> 5]));
    } else if (cls == 2) {
      v = elem_decode(elem, codes[i]);
    } else {
      v = bf16_bits_to_f32(reinterpret_cast<const uint16_t *>(codes)[i]);
    }
    y[i] = v;
  }
}

/* y[i] = element i decoded with its global factor, as the CPU's dequantize computes it (value(q) *
 * block scale, then the factor: nvfp4 (value * sd) * s_dec, fp8 value / scale, mx value * e8m0, bf16
 * widened, f32 copied); cls as dequant_f32_kernel's, 4: f32. */
__global__ void __launch_bounds__(256) dequant_scaled_kernel(float *__restrict__ y, const uint8_t *__restrict__ codes,
                                                             const uint8_t *__restrict__ scales, int64_t n, int cls,
                                                             int elem, float g) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v;
    if (cls == 0) {
      v = f_mul(f_mul(e2m1_decode((codes[i >> 1] >> (4 * (i & 1))) & 15u), e4m3_decode(scales[i >> 4] & 0x7Fu)), g);
    } else if (cls == 1) {
      uint32_t c = elem == 2 ? (codes[i >> 1] >> (4 * (i & 1))) & 15u : codes[i];
      v = f_mul(elem_decode(elem, c), e8m0_decode(scales[i >> 5]));
    } else if (cls == 2) {
      v = f_div(elem_decode(elem, codes[i]), g);
    } else if (cls == 3) {
      v = bf16_bits_to_f32(reinterpret_cast<const uint16_t *>(codes)[i]);
    } else {
      v = reinterpret_cast<const float *>(codes)[i];
    }
    y[i] = v;
  }
}

/* bits (8 words) |= the bit of the smallest byte of x (mx block scales; bf16 == 0) or of the smallest
 * exponent field of the nonzero bf16 x (bf16 == 1), as nvl_u8_min_cpu / nvl_bf16_exp_min_cpu; the
 * lowest set bit is the minimum (255 or none: no finite nonzero value). */
__global__ void range_bits_kernel(uint32_t *bits, const void *x, int64_t n, int bf16) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t m = 255;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint32_t e;
    if (bf16) {
      uint32_t h = static_cast<const uint16_t *>(x)[i];
      e = (h & 0x7fffu) ? (h >> 7) & 0xffu : 255u;
    } else {
      e = static_cast<const uint8_t *>(x)[i];
    }
    m = e < m ? e : m;
  }
  if (m < 255) atomicOr(&bits[m >> 5], 1u << (m & 31));
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

/* y (rows, K) bf16 = the operand dequantized without its global factor; *inexact set by mx. */
nvl_status dequant_bf16(uint16_t *y, const nvl_qview *o, uint32_t *inexact, int dev) {
  const int64_t n = o->rows * o->K;
  if (n == 0) return NVL_OK;
  char what[120];
  switch (cls_of(o->format)) {
    case CLS_NVFP4: {
      const int64_t nblk = n / 16;
      NVL_LAUNCH(nvl_cuda_grid(nblk, 256, dev), 256, 0, 0, dequant_nvfp4_kernel)(
          y, static_cast<const uint8_t *>(o->codes), o->scales, nblk);
      snprintf(what, sizeof what, "dequant_nvfp4_kernel (%lld blocks)", (long long)nblk);
      break;
    }
    case CLS_MX: {
      const int64_t nblk = n / 32;
      NVL_LAUNCH(nvl_cuda_grid(nblk, 256, dev), 256, 0, 0, dequant_mx_kernel)(
          y, static_cast<const uint8_t *>(o->codes), o->scales, nblk, elem_of(o->format), inexact);
      snprintf(what, sizeof what, "dequant_mx_kernel<%s> (%lld blocks)", fmt_name(o->format), (long long)nblk);
      break;
    }
    case CLS_FP8:
      NVL_LAUNCH(nvl_cuda_grid(n, 256, dev), 256, 0, 0, dequant_fp8_kernel)(
          y, static_cast<const uint8_t *>(o->codes), n, is_e5(o->format));
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

/* The exponent range of an operand's decoded values (qentry_cpu.c range_of): 2^lo the lowest bit
 * any value can hold, 2^mag the smallest nonzero magnitude; NO_VALUES: no constraint. */
const int NO_VALUES = 1000;
struct Range {
  int lo, mag;
};

/* The smallest block scale (mx) or bf16 exponent field of each operand that needs a scan, one copy
 * to the host for both; fp8 and nvfp4 ranges are fixed. */
nvl_status operand_ranges(nvl_kctx *ctx, const nvl_qview *const ops[2], Range r[2]) {
  uint32_t *bits = NULL; /* (2, 8) device */
  bool scan[2];
  for (int i = 0; i < 2; i++) {
    const int f = ops[i]->format;
    scan[i] = cls_of(f) == CLS_MX || cls_of(f) == CLS_BF16;
    const int fixed = f == NVL_E4M3 ? -9 : f == NVL_E5M2 ? -16 : -10; /* nvfp4: e2m1 0.5 x ue4m3 2^-9 */
    r[i] = Range{fixed, fixed};
  }
  if (!scan[0] && !scan[1]) return NVL_OK;
  NVL_TRY(ctx->scratch(ctx, 16 * sizeof(uint32_t), (void **)&bits));
  NVL_TRY(nvl_cuda_memset(bits, 0, 16 * sizeof(uint32_t), ctx->dev));
  for (int i = 0; i < 2; i++) {
    if (!scan[i]) continue;
    const bool bf = cls_of(ops[i]->format) == CLS_BF16;
    const int64_t n = bf ? ops[i]->rows * ops[i]->K : ops[i]->rows * ops[i]->K / 32;
    NVL_LAUNCH(nvl_cuda_grid(n, 256, ctx->dev), 256, 0, 0, range_bits_kernel)(bits + 8 * i,
        bf ? ops[i]->codes : static_cast<const void *>(ops[i]->scales), n, bf);
    NVL_TRY(nvl_cuda_check_launch(ctx->dev, "nvl_cuda_qgemm", "range_bits_kernel"));
  }
  uint32_t h[16];
  NVL_CUDA_CHECK(cudaMemcpy(h, bits, sizeof h, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 2; i++) {
    if (!scan[i]) continue;
    int m = 255;
    for (int b = 254; b >= 0; b--)
      if (h[8 * i + (b >> 5)] >> (b & 31) & 1u) m = b;
    const int f = ops[i]->format;
    if (m == 255) r[i] = Range{NO_VALUES, NO_VALUES};
    else if (cls_of(f) == CLS_BF16) r[i] = Range{m - 127 - 7, m == 0 ? -127 : m - 127};
    else {
      const int low = is_fp4(f) ? -1 : is_e5(f) ? -16 : -9;
      r[i] = Range{m - 127 + low, m - 127 + low};
    }
  }
  return NVL_OK;
}

/* The fp32 fallback: both operands decoded to f32 (exact), cuBLASLt's fp32 GEMM (subnormals kept),
 * a bf16 output rounded once from the f32 result. */
nvl_status emulated_f32_gemm(nvl_kctx *ctx, Spec &s, const nvl_gemm_desc *g, float alpha, const float *dsc) {
  const nvl_qview *ops[2] = {g->a, g->b};
  void *y[2] = {NULL, NULL};
  for (int i = 0; i < 2; i++) {
    const int64_t n = ops[i]->rows * ops[i]->K;
    const Cls c = cls_of(ops[i]->format);
    NVL_TRY(ctx->scratch(ctx, (size_t)n * sizeof(float), &y[i]));
    NVL_LAUNCH(nvl_cuda_grid(n, 256, ctx->dev), 256, 0, 0, dequant_f32_kernel)(
        static_cast<float *>(y[i]), static_cast<const uint8_t *>(ops[i]->codes), ops[i]->scales, n,
        c == CLS_NVFP4 ? 0 : c == CLS_MX ? 1 : c == CLS_FP8 ? 2 : 3, elem_of(ops[i]->format));
    NVL_TRY(nvl_cuda_check_launch(ctx->dev, "nvl_cuda_qgemm", "dequant_f32_kernel"));
  }
  s.ta = s.tb = CUDA_R_32F;
  const float *ad = dsc ? dsc + SC_ALPHA : NULL;
  if (s.tc != CUDA_R_16BF) return run_matmul(ctx, s, y[1], y[0], g->out, alpha, NULL, NULL, ad);
  const int64_t mn = s.m * s.n, one = 1; /* cuBLASLt's f32 GEMM writes f32 only: into scratch, then RNE */
  float *d = NULL;
  NVL_TRY(ctx->scratch(ctx, (size_t)mn * sizeof(float), (void **)&d));
  s.tc = CUDA_R_32F;
  NVL_TRY(run_matmul(ctx, s, y[1], y[0], d, alpha, NULL, NULL, ad));
  return nvl_cuda_copy_strided(g->out, NVL_BF16, &one, d, NVL_F32, &one, 1, &mn, ctx->dev);
}

/* The emulated GEMM (sm_90 for nvfp4 and mx pairs; mixes everywhere): each operand dequantized
 * without its global factor into bf16 scratch, one cuBLASLt bf16 x bf16 -> fp32 GEMM, alpha =
 * alpha_a * alpha_b. bf16 holds every such value exactly, but the tensor cores may flush subnormal
 * inputs, products or partial sums (cuBLASLt does not document it), so the CPU's rule (qentry_cpu.c
 * use_bf16, NUMERICS §7) decides: every value >= 2^-126 in magnitude and the lowest bits of the two
 * operands multiplying to >= 2^-126, else the fp32 fallback. An mx or bf16 operand's range comes
 * from a scan of its scales or exponents (one copy to the host); fp8 and nvfp4 are always in range. */
nvl_status emulated_gemm(nvl_kctx *ctx, Spec &s, const nvl_gemm_desc *g, float alpha, const float *dsc) {
  const char *fn = "nvl_cuda_qgemm";
  const int dev = ctx->dev;
  const nvl_qview *ops[2] = {g->a, g->b};
  const void *bf[2] = {g->a->codes, g->b->codes};
  for (int i = 0; i < 2; i++)
    if ((cls_of(ops[i]->format) == CLS_NVFP4 || cls_of(ops[i]->format) == CLS_MX) && !ops[i]->scales)
      return nvl_error(NVL_EINVAL, "%s: %s operand without block scales", fn, fmt_name(ops[i]->format));
  Range r[2];
  NVL_TRY(operand_ranges(ctx, ops, r));
  if (!(r[0].mag >= -126 && r[1].mag >= -126 && r[0].lo + r[1].lo >= -126)) {
    return emulated_f32_gemm(ctx, s, g, alpha, dsc);
  }
  for (int i = 0; i < 2; i++) {
    if (cls_of(ops[i]->format) == CLS_BF16) continue;
    void *p = NULL;
    NVL_TRY(ctx->scratch(ctx, (size_t)(ops[i]->rows * ops[i]->K) * 2, &p));
    bf[i] = p;
    NVL_TRY(dequant_bf16(static_cast<uint16_t *>(p), ops[i], NULL, dev));
  }
  s.ta = s.tb = CUDA_R_16BF;
  return run_matmul(ctx, s, bf[1], bf[0], g->out, alpha, NULL, NULL, dsc ? dsc + SC_ALPHA : NULL);
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
             "global scales as alpha; fp32 GEMM when block scales leave bf16's normal range (sm_%d)", fmt_name(fa),
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
