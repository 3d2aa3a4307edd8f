/* qentry_cpu.c: the quantization entries of the CPU table (core/backend.h): per scale kind a
 * quantize driver (x gathered into the blocked layout in cache tiles, the fast RHT, the fast
 * quantizer of quant_cpu.c), a table-driven decoder (dequant_cpu.c), and the emulated GEMM of
 * core/NUMERICS.md §7: operands decoded without their global factors (exact in fp32, and in bf16
 * within the range checked below), one GEMM — bf16 x bf16 on the CPU's bf16 units through oneDNN
 * (gemm_bf16_cpu.c) where it computes the same products, else OpenBLAS sgemm — and the product of
 * the global factors applied after in fp32. Every entry is bit-identical to its
 * twin in kernels/cpu/ref/qentry_ref.c (the GEMM: within fp32 summation-order error).
 * Not here: validation and allocation of the outputs (core/quant.c). */
#include <math.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "cpu/dequant_cpu.h"
#include "cpu/gemm_bf16_cpu.h"
#include "cpu/ops_cpu.h"
#include "cpu/qentry_cpu.h"
#include "cpu/quant_cpu.h"

#define NVL_GATHER_OMP_MIN 32768 /* elements */

/* ---- input ---------------------------------------------------------------------------------- */

/* The (K, C) slabs of x are transposed in square tiles staged in a local tile, so that both the
 * reads and the writes of x and y run along rows, each output row segment written whole: a column
 * walked straight through x strides by C (and through y by K), and with a power of two its lines
 * fall into one cache set and evict each other before they are full. */
#define NVL_TILE 64      /* f32 tiles (gather): 16 KB staged */
#define NVL_TILE_BF16 128 /* bf16 tiles (bf16_blocked_copy): 32 KB staged; 128 measured ~10% faster than 64 */

/* y (B*C, K) f32 = x (B, K, C) f32 with each (K, C) slab transposed (bf16 x: bf16_blocked_copy). */
static void gather(float *y, const float *x, int64_t B, int64_t K, int64_t C) { /* staged in a tile */
  int64_t tk = (K + NVL_TILE - 1) / NVL_TILE, tc = (C + NVL_TILE - 1) / NVL_TILE, ntiles = B * tk * tc;
#pragma omp parallel for schedule(static) if (B * K * C > NVL_GATHER_OMP_MIN)
  for (int64_t t = 0; t < ntiles; t++) {
    int64_t b = t / (tk * tc), k0 = (t / tc) % tk * NVL_TILE, c0 = t % tc * NVL_TILE;
    int64_t nk = k0 + NVL_TILE < K ? NVL_TILE : K - k0, nc = c0 + NVL_TILE < C ? NVL_TILE : C - c0;
    float tile[NVL_TILE][NVL_TILE]; /* [k][c] */
    for (int64_t k = 0; k < nk; k++) memcpy(tile[k], x + (b * K + k0 + k) * C + c0, (size_t)nc * sizeof(float));
    for (int64_t c = 0; c < nc; c++) {
      float *row = y + (b * C + c0 + c) * K + k0;
      for (int64_t k = 0; k < nk; k++) row[k] = tile[k][c];
    }
  }
}

#ifdef __SSE2__
/* y (8 rows, stride ly) = x (8 rows, stride lx) transposed, 16-bit lanes; returns the max of the
 * lanes' magnitude bits (v & 0x7fff, non-negative as int16, so a signed max orders them) */
static inline __m128i transpose8x8_u16(uint16_t *y, int64_t ly, const uint16_t *x, int64_t lx, __m128i m) {
  __m128i r[8], a[8], b[8];
  const __m128i mag = _mm_set1_epi16(0x7fff);
  for (int i = 0; i < 8; i++) {
    r[i] = _mm_loadu_si128((const __m128i *)(x + i * lx));
    m = _mm_max_epi16(m, _mm_and_si128(r[i], mag));
  }
  for (int i = 0; i < 4; i++) {
    a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) {
      b[4 * i + 2 * j] = _mm_unpacklo_epi32(a[4 * i + j], a[4 * i + j + 2]);
      b[4 * i + 2 * j + 1] = _mm_unpackhi_epi32(a[4 * i + j], a[4 * i + j + 2]);
    }
  for (int j = 0; j < 4; j++) {
    _mm_storeu_si128((__m128i *)(y + (2 * j) * ly), _mm_unpacklo_epi64(b[j], b[j + 4]));
    _mm_storeu_si128((__m128i *)(y + (2 * j + 1) * ly), _mm_unpackhi_epi64(b[j], b[j + 4]));
  }
  return m;
}
#endif

/* y (B*C, K) bf16 = x (B, K, C) bf16 with each (K, C) slab transposed (C > 1) or copied (C == 1),
 * in NVL_TILE_BF16 tiles (8 x 8 SIMD transposes inside where the CPU has them); returns the largest |x|
 * bit pattern (bits & 0x7fff), which orders bf16 magnitudes, NaNs above inf. */
static uint16_t bf16_blocked_copy(uint16_t *y, const uint16_t *x, int64_t B, int64_t K, int64_t C) {
  uint16_t m = 0;
  if (C == 1) {
    int64_t n = B * K;
#pragma omp parallel for simd reduction(max : m) if (n > NVL_GATHER_OMP_MIN)
    for (int64_t i = 0; i < n; i++) {
      uint16_t v = x[i];
      y[i] = v;
      v &= 0x7fffu;
      m = v > m ? v : m;
    }
    return m;
  }
  const int64_t TL = NVL_TILE_BF16;
  int64_t tk = (K + TL - 1) / TL, tc = (C + TL - 1) / TL, ntiles = B * tk * tc;
#pragma omp parallel for schedule(static) reduction(max : m) if (B * K * C > NVL_GATHER_OMP_MIN)
  for (int64_t t = 0; t < ntiles; t++) {
    int64_t b = t / (tk * tc), k0 = (t / tc) % tk * TL, c0 = t % tc * TL;
    int64_t nk = k0 + TL < K ? TL : K - k0, nc = c0 + TL < C ? TL : C - c0;
    const uint16_t *xs = x + (b * K + k0) * C + c0;
    uint16_t *ys = y + (b * C + c0) * K + k0;
    uint16_t tl[NVL_TILE_BF16][NVL_TILE_BF16]; /* [c][k]: the tile transposed here, then written out row by row */
    int64_t fk = 0, fc = 0;          /* the part done by 8 x 8 blocks */
#ifdef __SSE2__
    fk = nk & ~(int64_t)7, fc = nc & ~(int64_t)7;
    __m128i vm = _mm_setzero_si128();
    for (int64_t c = 0; c < fc; c += 8)
      for (int64_t k = 0; k < fk; k += 8) vm = transpose8x8_u16(&tl[c][k], NVL_TILE_BF16, xs + k * C + c, C, vm);
    uint16_t lanes[8];
    _mm_storeu_si128((__m128i *)lanes, vm);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
#endif
    for (int64_t k = 0; k < nk; k++) /* the rest: the ragged edges, or everything without SSE2 */
      for (int64_t c = (k < fk ? fc : 0); c < nc; c++) {
        uint16_t v = xs[k * C + c];
        tl[c][k] = v;
        v &= 0x7fffu;
        m = v > m ? v : m;
      }
    for (int64_t c = 0; c < nc; c++) { /* a loop, not memcpy: a call per 256-byte row cost 15% */
      uint16_t *restrict yr = ys + c * K;
      const uint16_t *restrict tr = tl[c];
      for (int64_t k = 0; k < nk; k++) yr[k] = tr[k];
    }
  }
  return m;
}

/* *xp = d's x in the blocked layout (rows, K) as f32, RHT applied: x itself when it already is
 * that, else a copy in scratch. */
static nvl_status blocked_input(nvl_kctx *ctx, const nvl_qdesc *d, const float **xp) {
  int64_t rows = d->B * d->C, K = d->K, n = rows * K;
  if (d->C == 1 && d->x_dtype == NVL_F32 && !d->rht) {
    *xp = d->x;
    return NVL_OK;
  }
  float *y; /* (rows, K) */
  NVL_TRY(ctx->scratch(ctx, (size_t)n * sizeof(float), (void **)&y));
  const uint16_t *xb = d->x_dtype == NVL_BF16 ? d->x : NULL; /* bf16 x in the blocked layout */
  if (xb && d->C > 1) { /* transposed in bf16 (SIMD) first */
    uint16_t *t;
    NVL_TRY(ctx->scratch(ctx, (size_t)n * sizeof(uint16_t), (void **)&t));
    bf16_blocked_copy(t, d->x, d->B, K, d->C);
    xb = t;
  }
  if (xb && d->rht) { /* NUMERICS §5: the transform's output has the operand's dtype (TE's bf16 wgrad path) */
    NVL_TRY(nvl_rht16_rows_bf16_cpu(y, xb, rows, K, d->signs));
  } else if (xb) {
    nvl_bf16_to_f32_cpu(y, xb, n);
  } else {
    if (d->C == 1) memcpy(y, d->x, (size_t)n * sizeof(float));
    else gather(y, d->x, d->B, K, d->C);
    if (d->rht) NVL_TRY(nvl_rht16_rows_cpu(y, y, rows, K, d->signs));
  }
  *xp = y;
  return NVL_OK;
}

static nvl_quant_ref_opts ref_opts(const nvl_qdesc *d) {
  nvl_quant_ref_opts o = {.sr = d->sr, .seed = d->seed, .offset = d->offset, .has_amax = d->has_amax, .amax = d->amax,
                          .sr_row_offset = d->sr_row_offset, .sr_k_offset = d->sr_k_offset, .sr_k_total = d->sr_k_total};
  return o;
}

/* max |x| as the tensor reduction defines it (NaN if any element is NaN). */
static float amax_of(const float *x, int64_t n) { return n ? (float)nvl_reduce_f32_cpu(NVL_RED_AMAX, x, n) : 0.0f; }

/* ---- quantize ------------------------------------------------------------------------------- */

nvl_status nvl_quantize_values_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  if (d->format == NVL_BF16 && d->x_dtype == NVL_BF16 && !d->rht) { /* bf16 codes are x's own bits */
    uint16_t m = bf16_blocked_copy(d->codes, d->x, d->B, d->K, d->C);
    *d->amax_out = m > 0x7f80u ? NAN : nvl_bf16_to_f32(m);
    return NVL_OK;
  }
  NVL_TRY(blocked_input(ctx, d, &x));
  int64_t n = d->B * d->C * d->K;
  if (d->format == NVL_BF16) nvl_f32_to_bf16_cpu(d->codes, x, n);
  else memcpy(d->codes, x, (size_t)n * sizeof(float));
  *d->amax_out = amax_of(x, n);
  return NVL_OK;
}

nvl_status nvl_quantize_tensor_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  NVL_TRY(blocked_input(ctx, d, &x));
  float scale, given = d->amax;
  return nvl_fp8_quantize_tensor_cpu(d->codes, &scale, d->amax_out, x, d->B * d->C * d->K,
                                     (nvl_elem)nvl_dtypes[d->format].elem, d->has_amax ? &given : NULL);
}

nvl_status nvl_quantize_mx_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  int64_t rows = d->B * d->C;
  NVL_TRY(blocked_input(ctx, d, &x));
  nvl_quant_ref_opts o = ref_opts(d);
  NVL_TRY(nvl_mx_quantize_cpu(d->codes, d->scales, x, rows, d->K, (nvl_elem)nvl_dtypes[d->format].elem, d->rule, &o));
  *d->amax_out = amax_of(x, rows * d->K);
  return NVL_OK;
}

nvl_status nvl_quantize_nvfp4_cpu(nvl_kctx *ctx, const nvl_qdesc *d) {
  const float *x;
  if (d->x_dtype == NVL_BF16 && !d->rht && !d->block2d) { /* bf16 x quantized without a widened copy */
    const uint16_t *xb = d->x;
    if (d->C > 1) { /* transposed in bf16 (SIMD) first */
      uint16_t *t;
      NVL_TRY(ctx->scratch(ctx, (size_t)(d->B * d->C * d->K) * sizeof(uint16_t), (void **)&t));
      bf16_blocked_copy(t, d->x, d->B, d->K, d->C);
      xb = t;
    }
    nvl_quant_ref_opts o = ref_opts(d);
    return nvl_nvfp4_quantize_bf16_cpu(d->codes, d->scales, d->amax_out, xb, d->B * d->C, d->K, &o);
  }
  NVL_TRY(blocked_input(ctx, d, &x));
  nvl_quant_ref_opts o = ref_opts(d);
  return nvl_nvfp4_quantize_cpu(d->codes, d->scales, d->amax_out, x, d->B * d->C, d->K, d->block2d, &o);
}

/* ---- dequantize ----------------------------------------------------------------------------- */

nvl_status nvl_dequantize_values_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled) {
  int64_t n = nr * q->K;
  if (q->format == NVL_BF16) nvl_bf16_to_f32_cpu(y, (const uint16_t *)q->codes + r0 * q->K, n);
  else memcpy(y, (const float *)q->codes + r0 * q->K, (size_t)n * sizeof(float));
  return NVL_OK;
}

nvl_status nvl_dequantize_tensor_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                     int unscaled) {
  nvl_elem e = (nvl_elem)nvl_dtypes[q->format].elem;
  const uint8_t *c = (const uint8_t *)q->codes + r0 * q->K;
  if (!unscaled) nvl_fp8_decode_div_cpu(y, c, nr * q->K, e, q->scale); /* value / scale, as the reference */
  else nvl_fp8_decode_cpu(y, c, nr * q->K, e, 1.0f);
  return NVL_OK;
}

nvl_status nvl_dequantize_mx_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr, int unscaled) {
  nvl_mx_decode_cpu(y, (const uint8_t *)q->codes + nvl_code_bytes(q->format, r0 * q->K), q->scales + r0 * (q->K / 32),
                    nr, q->K, (nvl_elem)nvl_dtypes[q->format].elem);
  return NVL_OK;
}

nvl_status nvl_dequantize_nvfp4_cpu(nvl_kctx *ctx, float *y, const nvl_qview *q, int64_t r0, int64_t nr,
                                    int unscaled) {
  const uint8_t *c = (const uint8_t *)q->codes + r0 * (q->K / 2), *s = q->scales + r0 * (q->K / 16);
  if (!unscaled) return nvl_nvfp4_dequantize_cpu(y, c, s, q->amax, nr, q->K);
  nvl_nvfp4_decode_unscaled_cpu(y, c, s, nr, q->K); /* value(q) * float(sd): at most 6 significant bits */
  return NVL_OK;
}

/* ---- GEMM ----------------------------------------------------------------------------------- */

/* The bf16 path (gemm_bf16_cpu.h) multiplies the same values as sgemm and sums the products in
 * fp32, but the bf16 units flush subnormal inputs, products and partial sums to zero. It runs only
 * when that cannot happen: with 2^lo the lowest bit any decoded value of an operand can hold and
 * 2^mag its smallest nonzero magnitude, mag_a, mag_b >= -126 puts every value in bf16's normal
 * range (where a value of at most 8 significant bits is exact), and lo_a + lo_b >= -126 makes every
 * product and every partial sum a multiple of 2^-126, so zero or normal. Per format: fp8 codes
 * lo = mag = -9 (e4m3) / -16 (e5m2); nvfp4 (e2m1 x ue4m3) -10; mx: the element's lowest bit (e2m1
 * -1, e4m3 -9, e5m2 -16) plus the smallest block scale's exponent (a scan of the scales); bf16:
 * from the smallest exponent field (a scan of the values). f32 operands stay on sgemm. */
typedef struct {
  int lo, mag;
} bf16_range;

#define NVL_NO_VALUES 1000 /* an operand without a finite nonzero value: no constraint */

static int range_of(const nvl_qview *q, bf16_range *r) {
  nvl_dtype f = q->format;
  int64_t n = q->rows * q->K;
  switch (f) {
  case NVL_E4M3: case NVL_E5M2: case NVL_NVFP4:
    r->lo = r->mag = f == NVL_E4M3 ? -9 : f == NVL_E5M2 ? -16 : -10;
    return 1;
  case NVL_MXFP8_E4M3: case NVL_MXFP8_E5M2: case NVL_MXFP4: {
    int s = nvl_u8_min_cpu(q->scales, n / 32), low = f == NVL_MXFP4 ? -1 : f == NVL_MXFP8_E4M3 ? -9 : -16;
    r->lo = r->mag = s == 255 ? NVL_NO_VALUES : s - 127 + low; /* 255: NaN scales only */
    return 1;
  }
  case NVL_BF16: {
    int e = nvl_bf16_exp_min_cpu(q->codes, n);
    r->lo = e == 255 ? NVL_NO_VALUES : e - 127 - 7;
    r->mag = e == 255 ? NVL_NO_VALUES : e == 0 ? -127 : e - 127;
    return 1;
  }
  default: return 0;
  }
}

/* 1: this GEMM runs on the bf16 path (oneDNN there, the CPU's bf16 units, every value in range);
 * *lo: the lowest bit any product (so any nonzero sum) can hold, 2^lo */
static int use_bf16(const nvl_qview *qa, const nvl_qview *qb, int *lo) {
  bf16_range a, b;
  if (qa->rows <= 0 || qb->rows <= 0 || qa->K <= 0 || !nvl_gemm_bf16_ready()) return 0;
  if (!range_of(qa, &a) || !range_of(qb, &b)) return 0;
  *lo = a.lo + b.lo;
  return a.mag >= -126 && b.mag >= -126 && a.lo + b.lo >= -126;
}

/* y (nr, K) bf16 = rows [r0, r0 + nr) of q decoded without global factors (exact, see above) */
static void decode_bf16(uint16_t *y, const nvl_qview *q, int64_t r0, int64_t nr) {
  int64_t K = q->K;
  nvl_elem e = (nvl_elem)nvl_dtypes[q->format].elem;
  const uint8_t *c = q->codes;
  switch (q->format) {
  case NVL_BF16: memcpy(y, (const uint16_t *)q->codes + r0 * K, (size_t)(nr * K) * sizeof(uint16_t)); break;
  case NVL_E4M3: case NVL_E5M2: nvl_fp8_decode_bf16_cpu(y, c + r0 * K, nr * K, e); break;
  case NVL_NVFP4: nvl_nvfp4_decode_unscaled_bf16_cpu(y, c + r0 * (K / 2), q->scales + r0 * (K / 16), nr, K); break;
  default: nvl_mx_decode_bf16_cpu(y, c + nvl_code_bytes(q->format, r0 * K), q->scales + r0 * (K / 32), nr, K, e);
  }
}

/* Operand storage of qgemm_into: decoded f32 (sgemm) or bf16, or a bf16 operand's own codes. */
typedef struct {
  const nvl_qview *q;
  int bf16, direct; /* direct: q's codes are the bf16 operand, no copy */
  void *buf;        /* (rows of a chunk, K) scratch, or NULL when direct */
} operand;

static nvl_status operand_init(nvl_kctx *ctx, operand *o, const nvl_qview *q, int bf16, int64_t rows) {
  *o = (operand){.q = q, .bf16 = bf16, .direct = bf16 && q->format == NVL_BF16};
  if (o->direct) return NVL_OK;
  return ctx->scratch(ctx, (size_t)(rows * q->K + 1) * (bf16 ? sizeof(uint16_t) : sizeof(float)), &o->buf);
}

/* the operand's rows [r0, r0 + nr), decoded unscaled */
static nvl_status operand_rows(nvl_kctx *ctx, operand *o, int64_t r0, int64_t nr, const void **p) {
  if (o->direct) *p = (const uint16_t *)o->q->codes + r0 * o->q->K;
  else if (o->bf16) decode_bf16(o->buf, o->q, r0, nr);
  else NVL_TRY(nvl_backend_cpu.formats[o->q->format].dequantize(ctx, o->buf, o->q, r0, nr, 1));
  if (!o->direct) *p = o->buf;
  return NVL_OK;
}

/* y (M, N, row stride ldy) = alpha · A·Bᵀ, or, with acc, y += that, or, with y16, y16 (M, N, row
 * stride ldy) = that rounded once to bf16: A decoded once, B in chunks of rows (a 128k-row LM head
 * never becomes one full-size f32 copy); with acc or y16 the chunk's product goes through a scratch
 * of at most ~16 MB (with acc the sum rounds exactly as a separate add would). The product runs on
 * the bf16 path when use_bf16 says so, else on sgemm. */
static nvl_status qgemm_into(nvl_kctx *ctx, float *y, uint16_t *y16, int64_t ldy, const nvl_qview *qa,
                             const nvl_qview *qb, int acc) {
  int64_t M = qa->rows, N = qb->rows, K = qa->K;
  int lo = 0, bf16 = use_bf16(qa, qb, &lo);
  float alpha = qa->alpha * qb->alpha;
  /* bf16 out on the bf16 path: oneDNN scales by alpha and writes the rounded result, which is
   * nvl_f32_to_bf16's where alpha * sum is zero or normal: every nonzero sum is a multiple of 2^lo,
   * so alpha 2^lo >= 2^-126 (or alpha 1: the range rule) keeps alpha * sum out of the subnormals */
  int direct16 = y16 && bf16 && (alpha == 1.0f || (isnormal(alpha) && alpha > 0.0f &&
                                                   (double)alpha * ldexp(1.0, lo) >= 0x1p-126));
  int staged = acc || (y16 && !direct16);
  int64_t chunk = (int64_t)(1 << 22) / (K > 0 ? K : 1);
  if (staged && M > 0 && (int64_t)(1 << 22) / M < chunk) chunk = (int64_t)(1 << 22) / M;
  if (chunk < 64) chunk = 64;
  if (chunk > N) chunk = N;
  if (chunk < 1) chunk = 1;
  operand a, b;
  float *sc = NULL; /* staged: (M, chunk) */
  NVL_TRY(operand_init(ctx, &a, qa, bf16, M));
  NVL_TRY(operand_init(ctx, &b, qb, bf16, chunk));
  if (staged) NVL_TRY(ctx->scratch(ctx, (size_t)(M * chunk + 1) * sizeof(float), (void **)&sc));
  const void *pa = NULL, *pb = NULL;
  NVL_TRY(operand_rows(ctx, &a, 0, M, &pa));
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    int64_t nr = N - n0 < chunk ? N - n0 : chunk;
    NVL_TRY(operand_rows(ctx, &b, n0, nr, &pb));
    if (direct16) {
      NVL_TRY(nvl_gemm_bf16_abt_bf16_cpu(y16 + n0, ldy, pa, pb, M, nr, K, alpha));
      continue;
    }
    float *dst = staged ? sc : y + n0;
    int64_t ld = staged ? nr : ldy;
    if (bf16) NVL_TRY(nvl_gemm_bf16_abt_cpu(dst, ld, pa, pb, M, nr, K));
    else nvl_matmul_f32_abt_cpu(dst, ld, pa, pb, M, nr, K);
    if (!staged && alpha == 1.0f) continue;
#pragma omp parallel for if (M * nr > 65536)
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < nr; j++) {
        float v = dst[i * ld + j];
        if (alpha != 1.0f) v = v * alpha;
        if (acc) y[i * ldy + n0 + j] = y[i * ldy + n0 + j] + v;
        else if (y16) y16[i * ldy + n0 + j] = nvl_f32_to_bf16(v);
        else dst[i * ld + j] = v;
      }
  }
  nvl_cpu_gemm_route_count(bf16 ? NVL_CPU_GEMM_BF16 : NVL_CPU_GEMM_SGEMM);
  return NVL_OK;
}

nvl_status nvl_qgemm_cpu(nvl_kctx *ctx, const nvl_gemm_desc *g) {
  int64_t N = g->b->rows;
  if (g->accumulate || g->out_dtype == NVL_F32) return qgemm_into(ctx, g->out, NULL, N, g->a, g->b, g->accumulate);
  return qgemm_into(ctx, NULL, g->out, N, g->a, g->b, 0); /* the f32 product rounded once to bf16 */
}

nvl_status nvl_rht_cpu(nvl_kctx *ctx, float *y, const float *x, int64_t rows, int64_t K, const float *signs,
                       int inverse) {
  return inverse ? nvl_rht16_rows_inverse_cpu(y, x, rows, K, signs) : nvl_rht16_rows_cpu(y, x, rows, K, signs);
}

nvl_status nvl_quantize_gam_cpu(nvl_kctx *ctx, uint8_t *codes, uint8_t *scales, float *mant, const float *x,
                                int64_t rows, int64_t K, int64_t block, int64_t group_blocks, nvl_elem elem) {
  (void)ctx;
  return nvl_gam_quantize_cpu(codes, scales, mant, x, rows, K, block, group_blocks, elem);
}
