/* ops_cpu.c: fast CPU kernels (see ops_cpu.h). Same arithmetic as the references, spread over
 * OpenMP threads and left to the compiler to vectorise. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "cpu/gemm_bf16_cpu.h"
#include "cpu/ops_cpu.h"
#include "cpu/ref/ops_ref.h"
#include "dtype.h"

#define NVL_OMP_MIN 32768 /* below this many elements threads cost more than they save */

void nvl_binary_f32_cpu(nvl_binary_op op, float *out, const float *a, const float *b, int64_t n) {
  switch (op) {
    case NVL_OP_ADD:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
      for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
      break;
    case NVL_OP_SUB:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
      for (int64_t i = 0; i < n; i++) out[i] = a[i] - b[i];
      break;
    case NVL_OP_MUL:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
      for (int64_t i = 0; i < n; i++) out[i] = a[i] * b[i];
      break;
    case NVL_OP_DIV:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
      for (int64_t i = 0; i < n; i++) out[i] = a[i] / b[i];
      break;
    default:
#pragma omp parallel for if (n > NVL_OMP_MIN)
      for (int64_t i = 0; i < n; i++) out[i] = (float)nvl_binary_f(op, a[i], b[i]);
  }
}

void nvl_binary_scalar_f32_cpu(nvl_binary_op op, float *out, const float *a, double s, int scalar_left, int64_t n) {
  float sf = (float)s;
  if ((double)sf == s && op <= NVL_OP_DIV) { /* exact in f32: float arithmetic == double-then-round */
    switch (op) {
      case NVL_OP_ADD:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = a[i] + sf;
        return;
      case NVL_OP_SUB:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = scalar_left ? sf - a[i] : a[i] - sf;
        return;
      case NVL_OP_MUL:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = a[i] * sf;
        return;
      default:
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
        for (int64_t i = 0; i < n; i++) out[i] = scalar_left ? sf / a[i] : a[i] / sf;
        return;
    }
  }
  if (op == NVL_OP_MUL) { /* the double product rounded once, as nvl_binary_f; a loop that vectorises */
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = (float)((double)a[i] * s);
    return;
  }
#pragma omp parallel for if (n > NVL_OMP_MIN)
  for (int64_t i = 0; i < n; i++)
    out[i] = (float)(scalar_left ? nvl_binary_f(op, s, a[i]) : nvl_binary_f(op, a[i], s));
}

void nvl_axpy_f32_cpu(float *y, const float *x, float alpha, int64_t n) {
  if (alpha == 1.0f) {
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) y[i] = y[i] + x[i];
    return;
  }
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
  for (int64_t i = 0; i < n; i++) {
    float p = alpha * x[i];
    y[i] = y[i] + p;
  }
}

void nvl_unary_f32_cpu(nvl_unary_op op, float *out, const float *a, int64_t n) {
#pragma omp parallel for if (n > NVL_OMP_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = (float)nvl_unary_f(op, a[i]);
}

double nvl_reduce_f32_cpu(nvl_reduce_op op, const float *a, int64_t n) {
  if (op == NVL_RED_SUM || op == NVL_RED_MEAN) {
    double s = 0;
#pragma omp parallel for reduction(+ : s) if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) s += a[i];
    return op == NVL_RED_MEAN ? s / (double)n : s;
  }
  if (op == NVL_RED_AMAX) { /* max of |x|'s bits: the order of non-negative floats; NaN bits are the largest */
    const uint32_t *u = (const uint32_t *)a;
    uint32_t mb = 0;
#pragma omp parallel for simd reduction(max : mb) if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) {
      uint32_t b = u[i] & 0x7fffffffu;
      mb = b > mb ? b : mb;
    }
    if (mb > 0x7f800000u) return NAN;
    float m;
    memcpy(&m, &mb, 4);
    return m;
  }
  int nan = 0;
  float m = a[0];
#pragma omp parallel for reduction(| : nan) if (n > NVL_OMP_MIN)
  for (int64_t i = 0; i < n; i++) nan |= isnan(a[i]) != 0;
  if (nan) return NAN;
  if (op == NVL_RED_MAX) {
#pragma omp parallel for reduction(max : m) if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, a[i]);
  } else {
#pragma omp parallel for reduction(min : m) if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) m = fminf(m, a[i]);
  }
  return m;
}

/* Copy one element of `es` bytes (1, 2, 4 or 8). */
static inline void copy_elem(char *d, const char *s, int es) {
  switch (es) {
    case 1: *d = *s; break;
    case 2: memcpy(d, s, 2); break;
    case 4: memcpy(d, s, 4); break;
    default: memcpy(d, s, 8);
  }
}

void nvl_copy_strided_cpu(nvl_tensor *dst, const nvl_tensor *src) {
  const int es = nvl_dtypes[dst->dtype].elem_size;
  char *d = nvl_tensor_data(dst);
  const char *s = nvl_tensor_data(src);
  int nd = src->ndim;
  int64_t n = nvl_tensor_numel(dst);
  if (n == 0) return;
  if (nd == 2 && es == 4) { /* tiles of 32 x 32 keep both sides in cache */
    int64_t R = src->shape[0], C = src->shape[1], s0 = src->strides[0], s1 = src->strides[1];
    uint32_t *dd = (uint32_t *)d;
    const uint32_t *ss = (const uint32_t *)s;
    int64_t tr = (R + 31) / 32, tc = (C + 31) / 32;
#pragma omp parallel for if (n > NVL_OMP_MIN)
    for (int64_t t = 0; t < tr * tc; t++) {
      int64_t i0 = (t / tc) * 32, j0 = (t % tc) * 32;
      int64_t i1 = i0 + 32 < R ? i0 + 32 : R, j1 = j0 + 32 < C ? j0 + 32 : C;
      for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) dd[i * C + j] = ss[i * s0 + j * s1];
    }
    return;
  }
  if (nd == 2) {
    int64_t R = src->shape[0], C = src->shape[1], s0 = src->strides[0], s1 = src->strides[1];
#pragma omp parallel for collapse(2) if (n > NVL_OMP_MIN)
    for (int64_t i0 = 0; i0 < R; i0 += 32)
      for (int64_t j0 = 0; j0 < C; j0 += 32)
        for (int64_t i = i0; i < R && i < i0 + 32; i++)
          for (int64_t j = j0; j < C && j < j0 + 32; j++)
            copy_elem(d + (i * C + j) * es, s + (i * s0 + j * s1) * es, es);
    return;
  }
  int64_t inner = nd ? src->shape[nd - 1] : 1, istride = nd ? src->strides[nd - 1] : 0;
  int64_t rows = n / inner;
#pragma omp parallel for if (n > NVL_OMP_MIN)
  for (int64_t r = 0; r < rows; r++) {
    int64_t off = 0, rem = r;
    for (int k = nd - 2; k >= 0; k--) {
      off += (rem % src->shape[k]) * src->strides[k];
      rem /= src->shape[k];
    }
    char *drow = d + r * inner * es;
    const char *srow = s + off * es;
    for (int64_t j = 0; j < inner; j++) copy_elem(drow + j * es, srow + j * istride * es, es);
  }
}

/* nvl_f32_to_bf16 (core/dtype.c) written branch-free so the loop vectorises: same bits. */
void nvl_f32_to_bf16_cpu(uint16_t *out, const float *a, int64_t n) {
  const uint32_t *u = (const uint32_t *)a;
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
  for (int64_t i = 0; i < n; i++) {
    uint32_t x = u[i];
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t quiet = (x >> 16) | 0x0040u;
    out[i] = (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}

void nvl_bf16_to_f32_cpu(float *out, const uint16_t *a, int64_t n) {
  uint32_t *o = (uint32_t *)out;
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
  for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)a[i] << 16;
}

/* BLAS wants each matrix with unit stride along rows (NoTrans) or columns (Trans). */
static int blas_layout(const nvl_tensor *t, CBLAS_TRANSPOSE *tr, int *ld) {
  int64_t rows = t->shape[0], cols = t->shape[1];
  int64_t mr = rows > 1 ? rows : 1, mc = cols > 1 ? cols : 1;
  if ((cols == 1 || t->strides[1] == 1) && (rows == 1 || t->strides[0] >= mc)) {
    *tr = CblasNoTrans;
    *ld = (int)(rows == 1 ? mc : t->strides[0]);
    return 1;
  }
  if ((rows == 1 || t->strides[0] == 1) && (cols == 1 || t->strides[1] >= mr)) {
    *tr = CblasTrans;
    *ld = (int)(cols == 1 ? mr : t->strides[1]);
    return 1;
  }
  return 0;
}

int nvl_matmul_f32_cpu(float *out, const nvl_tensor *a, const nvl_tensor *b) {
  CBLAS_TRANSPOSE ta, tb;
  int lda, ldb;
  int M = (int)a->shape[0], K = (int)a->shape[1], N = (int)b->shape[1];
  if (M == 0 || N == 0) return 1;
  if (K == 0) { /* an empty sum: zeros, whatever the operands' strides */
    for (int64_t i = 0; i < (int64_t)M * N; i++) out[i] = 0.0f;
    return 1;
  }
  if (!blas_layout(a, &ta, &lda) || !blas_layout(b, &tb, &ldb)) return 0;
  cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, (const float *)nvl_tensor_data(a), lda,
              (const float *)nvl_tensor_data(b), ldb, 0.0f, out, N);
  return 1;
}

void nvl_matmul_f32_abt_cpu(float *c, int64_t ldc, const float *a, const float *b, int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) c[i * ldc + j] = 0.0f;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, a, (int)K, b, (int)K, 0.0f, c,
              (int)ldc);
}

const char *nvl_blas_config(void) {
  static char buf[256];
  if (!buf[0]) snprintf(buf, sizeof buf, "%s, %d threads", openblas_get_config(), openblas_get_num_threads());
  return buf;
}

/* ---- the tensor-op entries of the CPU table: the fast kernels above where the layout allows,
 * the references otherwise ---- */

static int f32_contig(const nvl_tensor *t) { return t->dtype == NVL_F32 && nvl_tensor_is_contiguous(t); }

nvl_status nvl_copy_cpu(nvl_kctx *ctx, nvl_tensor *dst, const nvl_tensor *src) {
  int contig = nvl_tensor_is_contiguous(dst) && nvl_tensor_is_contiguous(src);
  int64_t n = nvl_tensor_numel(dst);
  if (contig && dst->dtype == src->dtype)
    memmove(nvl_tensor_data(dst), nvl_tensor_data(src), (size_t)n * nvl_dtypes[dst->dtype].elem_size);
  else if (contig && dst->dtype == NVL_BF16 && src->dtype == NVL_F32)
    nvl_f32_to_bf16_cpu(nvl_tensor_data(dst), nvl_tensor_data(src), n);
  else if (contig && dst->dtype == NVL_F32 && src->dtype == NVL_BF16)
    nvl_bf16_to_f32_cpu(nvl_tensor_data(dst), nvl_tensor_data(src), n);
  else if (dst->dtype == src->dtype && nvl_tensor_is_contiguous(dst))
    nvl_copy_strided_cpu(dst, src); /* a gather, e.g. a transpose made contiguous */
  else
    return nvl_copy_ref(ctx, dst, src);
  return NVL_OK;
}

/* out = a + b (sub: a - b), n contiguous bf16, rounded once from the exact sum as the reference
 * does (through double): the f32 sum rounded to bf16 is that. Where the exact sum of two 8-bit
 * significands needs more than f32's 24 bits, the smaller operand lies below 2^-15 of the larger,
 * nearer to the larger than any bf16 rounding tie (2^-8 of it away), so RN to f32 cannot move the sum
 * onto or across a tie; otherwise the f32 sum is exact. In blocks so that each loop vectorises. */
#define ADD_BLOCK 512
static void add_bf16_block(uint16_t *out, const uint16_t *a, const uint16_t *b, int sub, int64_t m) {
  union { float f[ADD_BLOCK]; uint32_t u[ADD_BLOCK]; } x, y;
  for (int64_t i = 0; i < m; i++) x.u[i] = (uint32_t)a[i] << 16;
  for (int64_t i = 0; i < m; i++) y.u[i] = (uint32_t)b[i] << 16;
  if (sub)
    for (int64_t i = 0; i < m; i++) x.f[i] = x.f[i] - y.f[i];
  else
    for (int64_t i = 0; i < m; i++) x.f[i] = x.f[i] + y.f[i];
  for (int64_t i = 0; i < m; i++) {
    uint32_t u = x.u[i], rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
    out[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}

static void add_bf16_cpu(uint16_t *out, const uint16_t *a, const uint16_t *b, int sub, int64_t n) {
  int64_t nb = (n + ADD_BLOCK - 1) / ADD_BLOCK;
#pragma omp parallel for schedule(static) if (n > NVL_OMP_MIN)
  for (int64_t k = 0; k < nb; k++) {
    int64_t i0 = k * ADD_BLOCK;
    add_bf16_block(out + i0, a + i0, b + i0, sub, n - i0 < ADD_BLOCK ? n - i0 : ADD_BLOCK);
  }
}

static int bf16_contig(const nvl_tensor *t) { return t->dtype == NVL_BF16 && nvl_tensor_is_contiguous(t); }

nvl_status nvl_binary_cpu(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  if ((op == NVL_OP_ADD || op == NVL_OP_SUB) && bf16_contig(out) && bf16_contig(a) && bf16_contig(b) &&
      nvl_tensor_numel(a) == nvl_tensor_numel(out) && nvl_tensor_numel(b) == nvl_tensor_numel(out)) {
    add_bf16_cpu(nvl_tensor_data(out), nvl_tensor_data(a), nvl_tensor_data(b), op == NVL_OP_SUB, nvl_tensor_numel(out));
    return NVL_OK;
  }
  if (out->dtype != NVL_F32 || op >= NVL_OP_EQ || !f32_contig(a) || !f32_contig(b))
    return nvl_binary_ref(ctx, op, out, a, b);
  nvl_binary_f32_cpu(op, nvl_tensor_data(out), nvl_tensor_data(a), nvl_tensor_data(b), nvl_tensor_numel(out));
  return NVL_OK;
}

nvl_status nvl_binary_scalar_cpu(nvl_kctx *ctx, nvl_binary_op op, nvl_tensor *out, const nvl_tensor *a, nvl_scalar s,
                                 int scalar_left) {
  if (out->dtype != NVL_F32 || op >= NVL_OP_EQ || !f32_contig(a))
    return nvl_binary_scalar_ref(ctx, op, out, a, s, scalar_left);
  nvl_binary_scalar_f32_cpu(op, nvl_tensor_data(out), nvl_tensor_data(a), s.f, scalar_left, nvl_tensor_numel(a));
  return NVL_OK;
}

nvl_status nvl_unary_cpu(nvl_kctx *ctx, nvl_unary_op op, nvl_tensor *out, const nvl_tensor *a) {
  if (out->dtype != NVL_F32 || !f32_contig(a)) return nvl_unary_ref(ctx, op, out, a);
  nvl_unary_f32_cpu(op, nvl_tensor_data(out), nvl_tensor_data(a), nvl_tensor_numel(a));
  return NVL_OK;
}

nvl_status nvl_reduce_all_cpu(nvl_kctx *ctx, nvl_reduce_op op, nvl_scalar *out, const nvl_tensor *a) {
  if (!f32_contig(a) || nvl_tensor_numel(a) == 0) return nvl_reduce_all_ref(ctx, op, out, a);
  *out = nvl_scalar_f(nvl_reduce_f32_cpu(op, nvl_tensor_data(a), nvl_tensor_numel(a)));
  return NVL_OK;
}

/* t as a contiguous f32 matrix: itself, or a gathered copy in scratch (a layout BLAS cannot take,
 * e.g. a broadcast view). */
static nvl_status blas_operand(nvl_kctx *ctx, nvl_tensor *view, nvl_storage *st, const nvl_tensor *t) {
  *view = *t;
  CBLAS_TRANSPOSE tr;
  int ld;
  if (blas_layout(t, &tr, &ld)) return NVL_OK;
  int64_t n = t->shape[0] * t->shape[1];
  memset(st, 0, sizeof *st);
  st->refcount = 1;
  st->bytes = (size_t)n * sizeof(float);
  NVL_TRY(ctx->scratch(ctx, st->bytes ? st->bytes : 1, &st->data));
  view->storage = st;
  view->offset = 0;
  view->strides[0] = t->shape[1];
  view->strides[1] = 1;
  nvl_copy_strided_cpu(view, t);
  return NVL_OK;
}

/* a's element strides, when oneDNN can take them as they are (positive: no broadcast views) */
static int dnnl_strides(const nvl_tensor *t, int64_t *rs, int64_t *cs) {
  *rs = t->strides[0], *cs = t->strides[1];
  return *rs > 0 && *cs > 0;
}

nvl_status nvl_matmul_cpu(nvl_kctx *ctx, nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b) {
  nvl_tensor ca, cb;
  nvl_storage sa, sb;
  int64_t M = a->shape[0], K = a->shape[1], N = b->shape[1], rsa, csa, rsb, csb;
  if (M > 0 && N > 0 && K > 0 && dnnl_strides(a, &rsa, &csa) && dnnl_strides(b, &rsb, &csb)) {
    /* oneDNN's f32 matmul where it runs (gemm_bf16_cpu.h), else OpenBLAS below */
    nvl_status st = nvl_gemm_f32_dnnl_cpu(nvl_tensor_data(out), nvl_tensor_data(a), rsa, csa, nvl_tensor_data(b), rsb,
                                          csb, M, N, K);
    if (st != NVL_EUNSUPPORTED) return st;
  }
  if (a->shape[0] > 0 && b->shape[1] > 0 && a->shape[1] > 0) {
    NVL_TRY(blas_operand(ctx, &ca, &sa, a));
    NVL_TRY(blas_operand(ctx, &cb, &sb, b));
  } else {
    ca = *a;
    cb = *b;
  }
  if (!nvl_matmul_f32_cpu(nvl_tensor_data(out), &ca, &cb))
    return nvl_error(NVL_EINVAL, "matmul: internal error: contiguous operands rejected by BLAS layout");
  return NVL_OK;
}

nvl_status nvl_axpy_cpu(nvl_kctx *ctx, float *y, const float *x, double alpha, int64_t n) {
  nvl_axpy_f32_cpu(y, x, (float)alpha, n);
  return NVL_OK;
}

nvl_status nvl_scale_cpu(nvl_kctx *ctx, float *p, double s, int64_t n) {
  nvl_binary_scalar_f32_cpu(NVL_OP_MUL, p, p, s, 0, n);
  return NVL_OK;
}

nvl_status nvl_fill_cpu(nvl_kctx *ctx, nvl_tensor *t, const void *value) {
  const int es = nvl_dtypes[t->dtype].elem_size;
  const unsigned char *v = value;
  char *p = nvl_tensor_data(t);
  int64_t n = nvl_tensor_numel(t), bytes = n * es;
  int same = 1;
  for (int i = 1; i < es; i++) same = same && v[i] == v[0];
  if (same) {
    int64_t chunk = (int64_t)1 << 20;
#pragma omp parallel for schedule(static) if (bytes > 4 * chunk)
    for (int64_t o = 0; o < bytes; o += chunk) memset(p + o, v[0], (size_t)(bytes - o < chunk ? bytes - o : chunk));
    return NVL_OK;
  }
  if (es == 4) {
    uint32_t w, *q = (uint32_t *)p;
    memcpy(&w, value, 4);
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) q[i] = w;
    return NVL_OK;
  }
  if (es == 2) {
    uint16_t w, *q = (uint16_t *)p;
    memcpy(&w, value, 2);
#pragma omp parallel for simd if (n > NVL_OMP_MIN)
    for (int64_t i = 0; i < n; i++) q[i] = w;
    return NVL_OK;
  }
  return nvl_fill_ref(ctx, t, value);
}
