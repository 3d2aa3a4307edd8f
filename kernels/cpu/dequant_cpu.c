/* dequant_cpu.c: table-driven decoders (see dequant_cpu.h). */
#include <pthread.h>
#include <string.h>

#include "cpu/dequant_cpu.h"

#define NVL_DEQ_OMP_MIN 65536

static void elem_table(float t[256], nvl_elem elem) {
  for (int c = 0; c < 256; c++) t[c] = nvl_elem_decode_ref(elem, (uint8_t)(elem == NVL_ELEM_E2M1 ? c & 15 : c));
}

void nvl_fp8_decode_cpu(float *y, const uint8_t *codes, int64_t n, nvl_elem elem, float mul) {
  float t[256];
  elem_table(t, elem);
  if (mul != 1.0f)
    for (int c = 0; c < 256; c++) t[c] = t[c] * mul;
#pragma omp parallel for if (n > NVL_DEQ_OMP_MIN)
  for (int64_t i = 0; i < n; i++) y[i] = t[codes[i]];
}

void nvl_fp8_decode_div_cpu(float *y, const uint8_t *codes, int64_t n, nvl_elem elem, float div) {
  float t[256];
  elem_table(t, elem);
  for (int c = 0; c < 256; c++) t[c] = t[c] / div; /* the reference's value / scale, once per code */
#pragma omp parallel for if (n > NVL_DEQ_OMP_MIN)
  for (int64_t i = 0; i < n; i++) y[i] = t[codes[i]];
}

void nvl_mx_decode_cpu(float *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K, nvl_elem elem) {
  float t[256], e[256];
  elem_table(t, elem);
  for (int c = 0; c < 256; c++) e[c] = nvl_e8m0_decode_ref((uint8_t)c);
  int64_t nb = rows * (K / 32);
  if (elem == NVL_ELEM_E2M1) { /* packed: two codes per byte, the lower index in the low nibble */
#pragma omp parallel for if (rows * K > NVL_DEQ_OMP_MIN)
    for (int64_t b = 0; b < nb; b++) {
      float s = e[scales[b]];
      const uint8_t *p = codes + b * 16;
      for (int j = 0; j < 16; j++) {
        y[b * 32 + 2 * j] = t[p[j] & 15] * s;
        y[b * 32 + 2 * j + 1] = t[p[j] >> 4] * s;
      }
    }
    return;
  }
#pragma omp parallel for if (rows * K > NVL_DEQ_OMP_MIN)
  for (int64_t b = 0; b < nb; b++) {
    float s = e[scales[b]];
    for (int j = 0; j < 32; j++) y[b * 32 + j] = t[codes[b * 32 + j]] * s;
  }
}

void nvl_nvfp4_decode_unscaled_cpu(float *y, const uint8_t *packed, const uint8_t *scales, int64_t rows, int64_t K) {
  float ev[16], sv[256];
  for (int i = 0; i < 16; i++) ev[i] = nvl_e2m1_decode_ref((uint8_t)i);
  for (int i = 0; i < 256; i++) sv[i] = nvl_ue4m3_decode_ref((uint8_t)i);
  int64_t nb = rows * (K / 16);
#pragma omp parallel for if (rows * K > NVL_DEQ_OMP_MIN)
  for (int64_t b = 0; b < nb; b++) {
    float s = sv[scales[b]];
    const uint8_t *p = packed + b * 8;
    float *o = y + b * 16;
    for (int j = 0; j < 8; j++) {
      o[2 * j] = ev[p[j] & 15] * s;
      o[2 * j + 1] = ev[p[j] >> 4] * s;
    }
  }
}

/* ---- straight into bf16 (the bf16 GEMM path) ------------------------------------------------- */

/* f's bf16 bits, f being exactly representable in bf16 (a NaN stays a quiet NaN) */
static inline uint16_t exact_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16) | ((u & 0x7fffffffu) > 0x7f800000u ? 0x40 : 0);
}

void nvl_fp8_decode_bf16_cpu(uint16_t *y, const uint8_t *codes, int64_t n, nvl_elem elem) {
  float t[256];
  uint16_t h[256];
  elem_table(t, elem);
  for (int c = 0; c < 256; c++) h[c] = exact_bf16(t[c]);
#pragma omp parallel for if (n > NVL_DEQ_OMP_MIN)
  for (int64_t i = 0; i < n; i++) y[i] = h[codes[i]];
}

void nvl_mx_decode_bf16_cpu(uint16_t *y, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K,
                            nvl_elem elem) {
  float t[256], e[256];
  elem_table(t, elem);
  for (int c = 0; c < 256; c++) e[c] = nvl_e8m0_decode_ref((uint8_t)c);
  int64_t nb = rows * (K / 32);
  if (elem == NVL_ELEM_E2M1) { /* packed: two codes per byte, the lower index in the low nibble */
#pragma omp parallel for if (rows * K > NVL_DEQ_OMP_MIN)
    for (int64_t b = 0; b < nb; b++) {
      float s = e[scales[b]];
      const uint8_t *p = codes + b * 16;
      for (int j = 0; j < 16; j++) {
        y[b * 32 + 2 * j] = exact_bf16(t[p[j] & 15] * s);
        y[b * 32 + 2 * j + 1] = exact_bf16(t[p[j] >> 4] * s);
      }
    }
    return;
  }
#pragma omp parallel for if (rows * K > NVL_DEQ_OMP_MIN)
  for (int64_t b = 0; b < nb; b++) {
    float s = e[scales[b]];
    for (int j = 0; j < 32; j++) y[b * 32 + j] = exact_bf16(t[codes[b * 32 + j]] * s);
  }
}

static uint16_t nvfp4_bf16[256 * 16]; /* [ue4m3 scale byte][e2m1 code]: their product in bf16 */

static void nvfp4_bf16_init(void) {
  for (int s = 0; s < 256; s++)
    for (int c = 0; c < 16; c++)
      nvfp4_bf16[s * 16 + c] = exact_bf16(nvl_e2m1_decode_ref((uint8_t)c) * nvl_ue4m3_decode_ref((uint8_t)s));
}

/* blocks [b0, b1): each block's 16 values looked up in its scale's row of the table */
static void nvfp4_bf16_blocks(uint16_t *y, const uint8_t *packed, const uint8_t *scales, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b++) {
    const uint16_t *h = nvfp4_bf16 + scales[b] * 16;
    const uint8_t *p = packed + b * 8;
    uint16_t *o = y + b * 16;
    for (int j = 0; j < 8; j++) {
      o[2 * j] = h[p[j] & 15];
      o[2 * j + 1] = h[p[j] >> 4];
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NVL_DEQ_X86 1
/* The same with AVX-512: a block's 8 code bytes split into 16 nibble indices (low nibble first),
 * widened to 16-bit lanes, and looked up in the scale's 16-entry row with one VPERMW. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void nvfp4_bf16_blocks_avx512(
    uint16_t *y, const uint8_t *packed, const uint8_t *scales, int64_t b0, int64_t b1) {
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  for (int64_t b = b0; b < b1; b++) {
    __m128i p = _mm_loadl_epi64((const __m128i *)(packed + b * 8));
    __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(p, lo4), _mm_and_si128(_mm_srli_epi16(p, 4), lo4));
    __m256i idx = _mm256_cvtepu8_epi16(nib);
    __m256i row = _mm256_loadu_si256((const __m256i *)(nvfp4_bf16 + scales[b] * 16));
    _mm256_storeu_si256((__m256i *)(y + b * 16), _mm256_permutexvar_epi16(idx, row));
  }
}
#endif

static int nvfp4_simd; /* 1: the CPU runs nvfp4_bf16_blocks_avx512 */

static void nvfp4_bf16_setup(void) {
  nvfp4_bf16_init();
#ifdef NVL_DEQ_X86
  __builtin_cpu_init();
  nvfp4_simd = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
}

void nvl_nvfp4_decode_unscaled_bf16_cpu(uint16_t *y, const uint8_t *packed, const uint8_t *scales, int64_t rows,
                                        int64_t K) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, nvfp4_bf16_setup);
  int64_t nb = rows * (K / 16), per = 1024, items = (nb + per - 1) / per; /* blocks per work item */
#pragma omp parallel for if (rows * K > NVL_DEQ_OMP_MIN)
  for (int64_t it = 0; it < items; it++) {
    int64_t b0 = it * per, b1 = b0 + per < nb ? b0 + per : nb;
#ifdef NVL_DEQ_X86
    if (nvfp4_simd) {
      nvfp4_bf16_blocks_avx512(y, packed, scales, b0, b1);
      continue;
    }
#endif
    nvfp4_bf16_blocks(y, packed, scales, b0, b1);
  }
}

int nvl_nvfp4_decode_simd_cpu(int on) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, nvfp4_bf16_setup);
  int prev = nvfp4_simd;
#ifdef NVL_DEQ_X86
  if (on >= 0) nvfp4_simd = on && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
  return prev;
}

int nvl_u8_min_cpu(const uint8_t *x, int64_t n) {
  int m = 255;
#pragma omp parallel for reduction(min : m) if (n > NVL_DEQ_OMP_MIN)
  for (int64_t i = 0; i < n; i++) m = x[i] < m ? x[i] : m;
  return m;
}

int nvl_bf16_exp_min_cpu(const uint16_t *x, int64_t n) {
  int m = 255;
#pragma omp parallel for reduction(min : m) if (n > NVL_DEQ_OMP_MIN)
  for (int64_t i = 0; i < n; i++) {
    int e = (x[i] & 0x7fff) ? (x[i] >> 7) & 0xff : 255;
    m = e < m ? e : m;
  }
  return m;
}
