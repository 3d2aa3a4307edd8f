/* gemm.cu: the GEMMs of nvl_qmatmul on device operands, through cuBLASLt with fp32 accumulation
 * (the GEMM part of core/nvl_cuda.h):
 *   f32 x f32      native fp32 GEMM (CUBLAS_COMPUTE_32F, no TF32)
 *   bf16 x bf16    native bf16 GEMM
 *   fp8 x fp8      native fp8 GEMM, per-tensor decode scales through A/B_SCALE_POINTER (sm_89+;
 *                  e4m3/e5m2 in any mix but e5m2 x e5m2, which cuBLASLt lacks)
 *   nvfp4 x nvfp4  native on sm_100 (CUDA_R_4F_E2M1, VEC16_UE4M3 scales in the 128x4 swizzled
 *                  layout, s_dec_a * s_dec_b as alpha); emulated elsewhere
 *   mxfp8 x mxfp8  native on sm_100 (VEC32_UE8M0 scales, swizzled); emulated elsewhere and for
 *                  e5m2 x e5m2
 *   other mixes of bf16 / fp8 / mxfp8 / nvfp4: emulated
 * "Emulated" is NUMERICS §2's exact emulation: each operand dequantized to bf16 without its global
 * factor (exact: nvfp4 value * ue4m3 scale has at most 6 significant bits; fp8 values fit bf16;
 * mxfp8 value * 2^k fits unless the product leaves bf16's exponent range, which is detected and
 * reported as an error rather than rounded), then one bf16 GEMM with alpha = alpha_a * alpha_b.
 * Unsupported combinations are errors that say why; nothing falls back silently:
 * nvl_cuda_gemm_path reports the path a pair of formats takes on a device.
 *
 * Layout: nvlua's operands are row-major A (M, K), B (N, K) and out (M, N). cuBLASLt is
 * column-major, so out^T (N, M) = B . A^T is computed: cuBLASLt's A is our B read transposed
 * (a K x N column-major matrix, ld K, op T), its B is our A (K x M, ld K, op N), D is N x M with
 * ld N: the "TN" layout the fp8 and block-scaled kernels require.
 *
 * Not here: quantization (quant.cu), the CPU emulation (core/quant.c). */
#include <cublasLt.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common.cuh"
#include "dtype.h"

#define NVL_MAX_GPUS 16

namespace {

const char *fmt_name(int f) { return f >= 0 && f < NVL_DTYPE_COUNT ? nvl_dtypes[f].name : "?"; }

#define LT_CHECK(call)                                                                                   \
  do {                                                                                                   \
    cublasStatus_t lt_st_ = (call);                                                                      \
    if (lt_st_ != CUBLAS_STATUS_SUCCESS)                                                                 \
      return nvl_error(NVL_EDEVICE, "%s: %s failed: %s (%s)", fn, #call, cublasLtGetStatusString(lt_st_), \
                       cublasLtGetStatusName(lt_st_));                                                   \
  } while (0)

/* ---- handles, workspace, plans -------------------------------------------------------------- */

const size_t WORKSPACE = (size_t)32 << 20;

struct Lt {
  cublasLtHandle_t h;
  void *ws;
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
  if (!l->ws) {
    cudaError_t e = cudaMalloc(&l->ws, WORKSPACE);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      l->ws = NULL;
      pthread_mutex_unlock(&lt_mu);
      return nvl_error(NVL_EDEVICE, "%s: cudaMalloc(%zu bytes) for the cuBLASLt workspace on cuda:%d failed: %s (%s)",
                       fn, WORKSPACE, dev, cudaGetErrorString(e), cudaGetErrorName(e));
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
  int64_t m, n, k;
  int accumulate;
};

bool same_spec(const Spec &a, const Spec &b) {
  return a.dev == b.dev && a.ta == b.ta && a.tb == b.tb && a.tc == b.tc && a.scale_mode == b.scale_mode &&
         a.per_tensor_scales == b.per_tensor_scales && a.m == b.m && a.n == b.n && a.k == b.k &&
         a.accumulate == b.accumulate;
}

/* A cached plan: descriptors and the heuristic's algorithm for one Spec. Pointers (data, scales)
 * are set per call. */
struct Plan {
  bool used;
  Spec s;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
};
const int NPLANS = 64;
Plan plans[NPLANS];
int next_victim;

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

nvl_status build_plan(Lt *l, const Spec &s, Plan *p) {
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
    /* placeholder scale pointers so the heuristic sees a scaled GEMM; real ones per call */
    if (s.scale_mode >= 0 || s.per_tensor_scales) {
      void *scratch = NULL;
      if ((st = nvl_cuda_scratch(s.dev, &scratch)) != NVL_OK) break;
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scratch, sizeof scratch));
      LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scratch, sizeof scratch));
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

nvl_status get_plan(Lt *l, const Spec &s, Plan **out) {
  pthread_mutex_lock(&lt_mu);
  for (int i = 0; i < NPLANS; i++)
    if (plans[i].used && same_spec(plans[i].s, s)) {
      *out = &plans[i];
      pthread_mutex_unlock(&lt_mu);
      return NVL_OK;
    }
  Plan *p = &plans[next_victim];
  next_victim = (next_victim + 1) % NPLANS;
  if (p->used) destroy_plan(p);
  nvl_status st = build_plan(l, s, p);
  pthread_mutex_unlock(&lt_mu);
  if (st == NVL_OK) *out = p;
  return st;
}

/* Run one planned matmul: d (m x n col-major) = alpha * op(A) op(B) (+ d when accumulating). */
nvl_status run_matmul(const Spec &s, const void *A, const void *B, void *D, float alpha, const void *scale_a,
                      const void *scale_b) {
  const char *fn = "nvl_cuda_qgemm";
  Lt *l = NULL;
  NVL_TRY(get_lt(s.dev, &l));
  Plan *p = NULL;
  NVL_TRY(get_plan(l, s, &p));
  if (s.scale_mode >= 0 || s.per_tensor_scales) {
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof scale_a));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b));
  }
  const float beta = s.accumulate ? 1.0f : 0.0f;
  (void)cudaGetLastError();
  LT_CHECK(cublasLtMatmul(l->h, p->op, &alpha, A, p->a, B, p->b, &beta, D, p->c, D, p->c, &p->algo, l->ws, WORKSPACE, 0));
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

/* mxfp8 blocks [0, nblk): y (32 per block) = value(code) * 2^(e-127); *inexact |= 1 where the
 * product is not a bf16 value (outside bf16's exponent range). */
__global__ void __launch_bounds__(256) dequant_mxfp8_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ codes,
                                                            const uint8_t *__restrict__ scales, int64_t nblk, int e5,
                                                            uint32_t *inexact) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t bad = 0;
  for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < nblk; g += stride) {
    const float s = e8m0_decode(scales[g]);
    const uint4 *src = reinterpret_cast<const uint4 *>(codes + 32 * g);
    uint4 *dst = reinterpret_cast<uint4 *>(y + 32 * g);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const uint4 u = src[h];
      const uint32_t cw[4] = {u.x, u.y, u.z, u.w};
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; i++) {
        uint32_t c0 = (cw[i >> 1] >> (16 * (i & 1))) & 0xFFu, c1 = (cw[i >> 1] >> (16 * (i & 1) + 8)) & 0xFFu;
        float v0 = f_mul(e5 ? e5m2_decode(c0) : e4m3_decode(c0), s);
        float v1 = f_mul(e5 ? e5m2_decode(c1) : e4m3_decode(c1), s);
        uint32_t b0 = f32_to_bf16_bits(v0), b1 = f32_to_bf16_bits(v1);
        bad |= (v0 == v0 && bf16_bits_to_f32((uint16_t)b0) != v0) | (v1 == v1 && bf16_bits_to_f32((uint16_t)b1) != v1);
        w[i] = b0 | b1 << 16;
      }
      dst[2 * h] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[2 * h + 1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
  if (bad) atomicOr(inexact, 1u);
}

/* fp8 per-tensor codes (n) -> their values in bf16 (exact), the scale left to alpha. */
__global__ void __launch_bounds__(256) dequant_fp8_kernel(uint16_t *__restrict__ y, const uint8_t *__restrict__ codes,
                                                          int64_t n, int e5) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = f32_to_bf16_bits(e5 ? e5m2_decode(codes[i]) : e4m3_decode(codes[i]));
}

enum Cls { CLS_F32, CLS_BF16, CLS_FP8, CLS_MX, CLS_NVFP4, CLS_NONE };

Cls cls_of(int f) {
  switch (f) {
    case NVL_F32: return CLS_F32;
    case NVL_BF16: return CLS_BF16;
    case NVL_E4M3: case NVL_E5M2: return CLS_FP8;
    case NVL_MXFP8_E4M3: case NVL_MXFP8_E5M2: return CLS_MX;
    case NVL_NVFP4: return CLS_NVFP4;
    default: return CLS_NONE;
  }
}
bool is_e5(int f) { return f == NVL_E5M2 || f == NVL_MXFP8_E5M2; }
cudaDataType fp8_type(int f) { return is_e5(f) ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

/* y (rows, K) bf16 = the operand dequantized without its global factor; *inexact set by mxfp8. */
nvl_status dequant_bf16(uint16_t *y, const nvl_cuda_gemm_operand *o, int64_t K, uint32_t *inexact, int dev) {
  const int64_t n = o->rows * K;
  if (n == 0) return NVL_OK;
  char what[120];
  switch (cls_of(o->format)) {
    case CLS_NVFP4: {
      const int64_t nblk = n / 16;
      dequant_nvfp4_kernel<<<nvl_cuda_grid(nblk, 256, dev), 256>>>(y, static_cast<const uint8_t *>(o->data), o->scales, nblk);
      snprintf(what, sizeof what, "dequant_nvfp4_kernel (%lld blocks)", (long long)nblk);
      break;
    }
    case CLS_MX: {
      const int64_t nblk = n / 32;
      dequant_mxfp8_kernel<<<nvl_cuda_grid(nblk, 256, dev), 256>>>(y, static_cast<const uint8_t *>(o->data), o->scales, nblk,
                                                                   is_e5(o->format), inexact);
      snprintf(what, sizeof what, "dequant_mxfp8_kernel (%lld blocks)", (long long)nblk);
      break;
    }
    case CLS_FP8:
      dequant_fp8_kernel<<<nvl_cuda_grid(n, 256, dev), 256>>>(y, static_cast<const uint8_t *>(o->data), n, is_e5(o->format));
      snprintf(what, sizeof what, "dequant_fp8_kernel (%lld elements)", (long long)n);
      break;
    default:
      return nvl_error(NVL_EINVAL, "nvl_cuda_qgemm: cannot dequantize %s to bf16", fmt_name(o->format));
  }
  return nvl_cuda_check_launch(dev, "nvl_cuda_qgemm", what);
}

} /* namespace */

extern "C" nvl_gemm_path nvl_cuda_gemm_path(int fa, int fb, int dev, char *detail, size_t n) {
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
  } else if (ca == CLS_MX && cb == CLS_MX && blackwell && !(is_e5(fa) && is_e5(fb))) {
    path = NVL_GEMM_NATIVE;
    snprintf(buf, sizeof buf, "cuBLASLt block-scaled GEMM: %s x %s, VEC32_UE8M0 swizzled scales", fmt_name(fa), fmt_name(fb));
  } else {
    path = NVL_GEMM_EMULATED;
    snprintf(buf, sizeof buf, "exact emulation: %s and %s dequantized to bf16, cuBLASLt bf16 GEMM, global scales as alpha (sm_%d)",
             fmt_name(fa), fmt_name(fb), cc);
  }
  if (detail && n) snprintf(detail, n, "%s", buf);
  if (path == NVL_GEMM_UNSUPPORTED) nvl_error(NVL_EUNSUPPORTED, "qmatmul on cuda:%d: %s", dev, buf);
  return path;
}

extern "C" nvl_status nvl_cuda_qgemm(void *out, int out_bf16, int accumulate, const nvl_cuda_gemm_operand *a,
                                     const nvl_cuda_gemm_operand *b, int64_t K, int dev) {
  const char *fn = __func__;
  NVL_TRY(nvl_cuda_use_device(dev, fn));
  if (accumulate && out_bf16) return nvl_error(NVL_EINVAL, "%s: accumulation is into f32 only", fn);
  const int64_t M = a->rows, N = b->rows;
  if (M < 0 || N < 0 || K < 0) return nvl_error(NVL_EINVAL, "%s: negative dims", fn);
  if (M == 0 || N == 0) return NVL_OK;
  if (!out || !a->data || !b->data) return nvl_error(NVL_EINVAL, "%s: NULL pointer", fn);
  if (K == 0) { /* an empty sum */
    if (accumulate) return NVL_OK;
    return nvl_cuda_memset(out, 0, (size_t)(M * N) * (out_bf16 ? 2 : 4), dev);
  }
  char detail[256];
  nvl_gemm_path path = nvl_cuda_gemm_path(a->format, b->format, dev, detail, sizeof detail);
  if (path == NVL_GEMM_UNSUPPORTED) return NVL_EUNSUPPORTED;
  const cudaDataType tout = out_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  Spec s;
  memset(&s, 0, sizeof s);
  s.dev = dev;
  s.tc = tout;
  s.scale_mode = -1;
  s.m = N;
  s.n = M;
  s.k = K;
  s.accumulate = accumulate;
  const float alpha = a->alpha * b->alpha; /* as core/quant.c's qgemm_into: alpha_a * alpha_b in fp32 */
  const Cls ca = cls_of(a->format);

  if (path == NVL_GEMM_NATIVE) {
    switch (ca) {
      case CLS_F32:
      case CLS_BF16:
        s.ta = s.tb = ca == CLS_F32 ? CUDA_R_32F : CUDA_R_16BF;
        return run_matmul(s, b->data, a->data, out, alpha, NULL, NULL);
      case CLS_FP8: {
        /* decode scales on the device: [0] for cuBLASLt's A (our b), [1] for its B (our a) */
        void *scratch = NULL;
        NVL_TRY(nvl_cuda_scratch(dev, &scratch));
        float *sc = reinterpret_cast<float *>(static_cast<char *>(scratch) + 1024);
        const float host[2] = {b->alpha, a->alpha};
        NVL_CUDA_CHECK(cudaMemcpyAsync(sc, host, sizeof host, cudaMemcpyHostToDevice, 0));
        s.ta = fp8_type(b->format);
        s.tb = fp8_type(a->format);
        s.per_tensor_scales = 1;
        return run_matmul(s, b->data, a->data, out, 1.0f, sc, sc + 1);
      }
      case CLS_NVFP4:
      case CLS_MX:
        if (!a->scales_swz || !b->scales_swz)
          return nvl_error(NVL_EINVAL, "%s: the native %s GEMM needs the operands' swizzled block scales", fn,
                           fmt_name(a->format));
        if (ca == CLS_NVFP4) {
          s.ta = s.tb = CUDA_R_4F_E2M1;
          s.scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
        } else {
          s.ta = fp8_type(b->format);
          s.tb = fp8_type(a->format);
          s.scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
        }
        return run_matmul(s, b->data, a->data, out, alpha, b->scales_swz, a->scales_swz);
      default:
        return nvl_error(NVL_EINVAL, "%s: internal error: no native path for %s", fn, fmt_name(a->format));
    }
  }

  /* emulated: bf16 copies of the operands that are not bf16 already, then a bf16 GEMM */
  const nvl_cuda_gemm_operand *ops[2] = {a, b};
  uint16_t *tmp[2] = {NULL, NULL};
  const void *bf[2] = {a->data, b->data};
  uint32_t *inexact = NULL;
  nvl_status st = NVL_OK;
  bool any_mx = cls_of(a->format) == CLS_MX || cls_of(b->format) == CLS_MX;
  if (any_mx) {
    void *scratch = NULL;
    st = nvl_cuda_scratch(dev, &scratch);
    if (st == NVL_OK) {
      inexact = reinterpret_cast<uint32_t *>(static_cast<char *>(scratch) + 2048);
      st = nvl_cuda_memset(inexact, 0, 4, dev);
    }
  }
  for (int i = 0; i < 2 && st == NVL_OK; i++) {
    if (cls_of(ops[i]->format) == CLS_BF16) continue;
    if ((cls_of(ops[i]->format) == CLS_NVFP4 || cls_of(ops[i]->format) == CLS_MX) && !ops[i]->scales) {
      st = nvl_error(NVL_EINVAL, "%s: %s operand without block scales", fn, fmt_name(ops[i]->format));
      break;
    }
    void *p = NULL;
    st = nvl_cuda_malloc(&p, (size_t)(ops[i]->rows * K) * 2, dev);
    if (st != NVL_OK) break;
    tmp[i] = static_cast<uint16_t *>(p);
    bf[i] = p;
    st = dequant_bf16(tmp[i], ops[i], K, inexact, dev);
  }
  if (st == NVL_OK) {
    s.ta = s.tb = CUDA_R_16BF;
    st = run_matmul(s, bf[1], bf[0], out, alpha, NULL, NULL);
  }
  /* stream order: the frees below may be reused by later launches only */
  for (int i = 0; i < 2; i++) nvl_cuda_free(tmp[i], dev);
  if (st == NVL_OK && inexact) {
    uint32_t flag = 0;
    NVL_CUDA_CHECK(cudaMemcpy(&flag, inexact, 4, cudaMemcpyDeviceToHost));
    if (flag)
      return nvl_error(NVL_EUNSUPPORTED, "%s: emulated mxfp8 GEMM: a block scale puts an element outside bf16's "
                       "exponent range, so the bf16 emulation is not exact and its result was discarded; use the CPU "
                       "path for such data", fn);
  }
  return st;
}
