/* quant_cpu.c: fast CPU quantizers (see quant_cpu.h), bit-identical to the scalar references in
 * kernels/cpu/ref/formats_ref.c, stochastic rounding included. Speed comes from:
 *  - OpenMP over independent work items (runs of blocks, tiles, chunks), after the tensor amax,
 *    itself a parallel max reduction;
 *  - branch-free element encoders (fp8 and e2m1 alike round the fp32 bits, computing every arm
 *    and selecting one), so gcc vectorises a whole block at a time;
 *  - per-block scalar work batched over 16 blocks (block maxima, scales, Philox draws);
 *  - on x86-64, an AVX2 build of each worker beside the baseline one, picked at load time.
 * Every shortcut is argued exact where it is made; tests/c/test_quant_cpu.c checks each function
 * against its reference bit for bit.
 *
 * Not here: allocation (beyond small stack tables), tensors, Lua, the contract itself (the
 * references own it; per-call scalar steps such as the global scales call them directly).
 *
 * Shape letters: R rows, K the contiguous blocked dim, n elements. x is row-major and K a
 * multiple of the block, so 1D blocks are just the consecutive 16- (32-) element pieces of x:
 * block g starts at x + 16 g, and g = row * (K/16) + k/16 is the index the SR stream uses.
 *
 * Needs IEEE fp32 in the default rounding mode with subnormals kept (no -ffast-math, no FTZ),
 * as the references do. */

/* -fno-trapping-math: the encoders compute both arms of each select (e.g. the fp8 normal and
 * subnormal roundings) and keep one. Under the default -ftrapping-math gcc sinks the float
 * arithmetic of an arm into a branch (it might raise an FP exception flag) and then cannot
 * vectorise the loop. The flag changes no computed value (it is not one of -ffast-math's
 * value-changing parts); nvlua never reads FP exception flags. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu/quant_cpu.h"
#include "backend.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "cpu/ref/gam_ref.h"
#include "philox.h"

#define NVL_QUANT_OMP_MIN 32768 /* elements; below this one thread is faster */
#define NVL_LANES 16            /* blocks whose scales / Philox draws are computed together */
#define NVL_CHUNK 16384         /* elements per work item of the element-wise loops */

/* x86-64 paths. Worker functions (NVL_WORKER) get an AVX2 clone beside the baseline one
 * (target_clones: an ifunc picks one at load time), which doubles the vector width and adds
 * blends; no FMA is enabled, so no contraction can differ from the reference. Philox has an
 * AVX2 intrinsics version. Defining NVL_QUANT_PORTABLE compiles the portable code only (the
 * unit test builds this file a second time that way, so the baseline paths run too). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(NVL_QUANT_PORTABLE)
#define NVL_QUANT_X86 1
#include <immintrin.h>
#endif
#if defined(NVL_QUANT_X86) && !defined(__AVX2__)
#define NVL_WORKER __attribute__((target_clones("avx512f", "avx2", "default"))) static
#else
#define NVL_WORKER static
#endif

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Output buffers never overlap x (except the RHT's, which may alias it). Element loops that
 * store straight into an output take restrict pointers so that gcc -O2, which will not version
 * a loop for aliasing, vectorises them too. */

/* ---- max |x| -------------------------------------------------------------------------------- */

/* The reference folds m = fmaxf(m, |x_i|) from m = 0: NaN never enters m, and the result is the
 * max of the non-NaN |x_i|, which does not depend on the order, so lanes and threads may split
 * the work freely. It is computed here in the integer domain: the bits of |x| order like |x|,
 * NaN bits (above inf's) are cleared (0x7F800000 - b is negative exactly for NaN), and an
 * integer max has no NaN case, so gcc vectorises it (as elementwise maxes, or as a reduction,
 * which it may not do for a float max without -ffast-math). */
static inline int32_t abs_bits(const float *p) {
  int32_t b;
  memcpy(&b, p, 4);
  b &= 0x7FFFFFFF;
  return b & ~((0x7F800000 - b) >> 31);
}
static inline int32_t max32(int32_t a, int32_t b) { return a > b ? a : b; }

/* The bits of |x| with NaN kept: at least RAW_NONFINITE exactly for an infinity or a NaN. Each pass
 * below that reads x also folds these into a max of its own, and sets the host's non-finite flag
 * (backend.h NVL_NONFINITE_INPUT) when it reaches RAW_NONFINITE: one more integer max per element,
 * no pass of its own. */
#define RAW_NONFINITE 0x7F800000
static inline int32_t raw_bits(const float *p) {
  int32_t b;
  memcpy(&b, p, 4);
  return b & 0x7FFFFFFF;
}
static inline void flag_raw(int32_t raw) {
  if (raw >= RAW_NONFINITE) nvl_host_nonfinite_set(NVL_NONFINITE_INPUT);
}

/* m[l] = bits of max |x| over block l of the nb consecutive blocks of len elements at x;
 * *raw = max(*raw, every element's raw_bits). */
static inline void block_maxima(int32_t *restrict m, const float *restrict x, int nb, int len, int32_t *raw) {
  int32_t w = *raw;
  for (int l = 0; l < nb; l++) {
    int32_t r = 0;
#pragma GCC unroll 1
    for (int j = 0; j < len; j++) {
      r = max32(r, abs_bits(x + len * l + j));
      w = max32(w, raw_bits(x + len * l + j));
    }
    m[l] = r;
  }
  *raw = w;
}

NVL_WORKER float absmax_span(const float *x, int64_t n) {
  int32_t acc[16] = {0}, raw[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; j++) {
      acc[j] = max32(acc[j], abs_bits(x + i + j));
      raw[j] = max32(raw[j], raw_bits(x + i + j));
    }
  int32_t m = 0, r = 0;
  for (; i < n; i++) {
    m = max32(m, abs_bits(x + i));
    r = max32(r, raw_bits(x + i));
  }
  for (int j = 0; j < 16; j++) {
    m = max32(m, acc[j]);
    r = max32(r, raw[j]);
  }
  flag_raw(r);
  return u2f((uint32_t)m);
}

/* max |x_i| over n elements, NaN ignored, 0 for n = 0; threads over chunks. */
static float absmax_cpu(const float *x, int64_t n) {
  int64_t nc = (n + NVL_CHUNK - 1) / NVL_CHUNK;
  float m = 0.0f;
#pragma omp parallel if (n > NVL_QUANT_OMP_MIN)
  {
    float lm = 0.0f;
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < nc; c++) {
      float a = absmax_span(x + c * NVL_CHUNK, min64(NVL_CHUNK, n - c * NVL_CHUNK));
      lm = a > lm ? a : lm;
    }
#pragma omp critical(nvl_quant_absmax)
    m = lm > m ? lm : m;
  }
  return m;
}

/* max |x| over n bf16 values, NaN ignored (absmax_cpu's rule): on the bits, |x| is bits & 0x7fff and
 * orders like |x|; a NaN's is above 0x7f80 and is left out */
NVL_WORKER uint16_t absmax_bf16_span(const uint16_t *x, int64_t n) {
  int32_t m = 0, r = 0; /* int32 lanes: the loop vectorises; r: NaN kept (raw_bits) */
  for (int64_t i = 0; i < n; i++) {
    int32_t v = x[i] & 0x7fff;
    r = v > r ? v : r;
    v = v > 0x7f80 ? 0 : v;
    m = v > m ? v : m;
  }
  flag_raw(r << 16);
  return (uint16_t)m;
}

static float absmax_bf16_cpu(const uint16_t *x, int64_t n) {
  int64_t nc = (n + NVL_CHUNK - 1) / NVL_CHUNK;
  uint16_t m = 0;
#pragma omp parallel for schedule(static) reduction(max : m) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t c = 0; c < nc; c++) {
    uint16_t a = absmax_bf16_span(x + c * NVL_CHUNK, min64(NVL_CHUNK, n - c * NVL_CHUNK));
    m = a > m ? a : m;
  }
  return u2f((uint32_t)m << 16);
}

/* ---- fp8 element encoders ------------------------------------------------------------------- */

/* fp32 -> fp8 code, the twin of formats_ref.c's minifloat_encode: RNE, satfinite, NaN -> 0x7F |
 * sign. M mantissa bits, bias B (emin = 1 - B), largest finite maxv with code maxcode. All arms
 * are computed and one is selected, so it vectorises; inline it with constant parameters.
 *  - a >= maxv: maxcode (inf too), as the reference.
 *  - 2^emin <= a < maxv (fp8 normal): round the fp32 bits to M mantissa bits, ties to even (add
 *    2^(22-M) - 1 plus the lowest kept bit, truncate; a carry into the exponent is the correct
 *    next binade), then rebias the exponent from 127 to B. a < maxv and maxv representable, so
 *    the result is at most maxcode (rounding is monotone).
 *  - a < 2^emin (fp8 subnormal): the quantum is 2^(emin-M); a * 2^(M-emin) < 2^M is exact, and
 *    adding 2^23 rounds it to an integer, ties to even (the fp32 ulp at 2^23 is 1); that integer
 *    is the code (2^M, for an a that rounds up to 2^emin, is that normal's code too). */
static inline uint32_t fp8_encode(float x, int M, int B, float maxv, uint32_t maxcode) {
  uint32_t u = f2u(x);
  uint32_t sign = (u >> 24) & 0x80u;
  float a = fabsf(x);
  uint32_t au = f2u(a);
  const int sh = 23 - M;
  uint32_t norm = ((au + ((1u << (sh - 1)) - 1u) + ((au >> sh) & 1u)) >> sh) - ((uint32_t)(127 - B) << M);
  float sub_scale = u2f((uint32_t)(127 + M + B - 1) << 23); /* 2^(M - emin) */
  float min_normal = u2f((uint32_t)(127 + 1 - B) << 23);    /* 2^emin */
  uint32_t sub = f2u(a * sub_scale + 8388608.0f) - 0x4B000000u;
  uint32_t mag = a < min_normal ? sub : norm;
  mag = a >= maxv ? maxcode : mag;
  mag = x != x ? 0x7Fu : mag;
  return mag | sign;
}

static inline uint32_t e4m3_encode(float x) { return fp8_encode(x, 3, 7, 448.0f, 0x7E); }
static inline uint32_t e5m2_encode(float x) { return fp8_encode(x, 2, 15, 57344.0f, 0x7B); }

/* ---- e2m1 element encoders ----------------------------------------------------------------- */

/* RNE (nvl_e2m1_encode_ref). e2m1 is a minifloat with 1 mantissa bit, bias 1, subnormal
 * quantum 0.5 and largest value 6, and the reference's thresholds (NUMERICS §1) are exactly
 * round-to-nearest-even on that grid, so this is fp8_encode's method: |v| >= 6 (and inf)
 * saturates to 7; 1 <= |v| < 6 rounds the fp32 bits to 1 mantissa bit, ties to even, and
 * rebiases (codes 2..7; 5 ties down to 4 = code 6, 5.5 up to 6 = code 7); |v| < 1 is 2|v|
 * rounded to an integer, ties to even, by adding 2^23 (codes 0..2; 0.25 -> 0, 0.75 -> 2). NaN ->
 * 6, its sign dropped; otherwise the sign bit of v is bit 3 (so -0 and small negatives give 8). */
static inline uint32_t e2m1_encode(float v) {
  float a = fabsf(v);
  uint32_t au = f2u(a);
  uint32_t norm = ((au + 0x1FFFFFu + ((au >> 22) & 1u)) >> 22) - (126u << 1);
  uint32_t sub = f2u(a * 2.0f + 8388608.0f) - 0x4B000000u;
  uint32_t m = a < 1.0f ? sub : norm;
  m = a >= 6.0f ? 7u : m;
  uint32_t c = ((f2u(v) >> 28) & 8u) | m;
  return v != v ? 6u : c;
}

/* SR (nvl_e2m1_encode_sr_ref) with random byte r. step = 0.5, 1, 2 for |v| below 2, below 4,
 * above, built in the exponent field. The reference's t = fmaf(u, step, a) equals u * step + a
 * in plain fp32: u = r/256 has 8 significant bits and step is a power of two, so the product is
 * exact and the sum is the only rounding (contracting it to an FMA changes nothing either). Its
 * q = min(floor(t / step_t) * step_t, 6) is t rounded toward zero onto the e2m1 grid (step_t is
 * the grid spacing at t), capped at 6: for t >= 1 the fp32 bits truncated to 1 mantissa bit and
 * rebiased (as in RNE, without the rounding add; t >= 8 gives 8 or more and is capped at code
 * 7), for t < 1 the code is t >= 0.5. NaN -> 6 as in RNE. */
static inline uint32_t e2m1_encode_sr(float v, uint32_t r) {
  float a = fabsf(v);
  float step = u2f(0x3F000000u + (((uint32_t)(a >= 2.0f) + (uint32_t)(a >= 4.0f)) << 23));
  float t = (float)r * (1.0f / 256.0f) * step + a;
  uint32_t norm = (f2u(t) >> 22) - (126u << 1);
  uint32_t m = t < 1.0f ? (uint32_t)(t >= 0.5f) : norm;
  m = m < 7u ? m : 7u;
  uint32_t c = ((f2u(v) >> 28) & 8u) | m;
  return v != v ? 6u : c;
}

/* Codes q (n, 0..15, n even) -> packed (n/2), the lower index in the low nibble. The codes are
 * kept in 32-bit lanes up to here: a loop mixing bytes and floats would be vectorised at the
 * byte width, i.e. with a quarter of the float lanes per register. */
static inline void pack_codes(uint8_t *restrict packed, const uint32_t *restrict q, int n) {
  for (int i = 0; i < n / 2; i++) packed[i] = (uint8_t)(q[2 * i] | (q[2 * i + 1] << 4));
}

/* ---- Philox in lanes ------------------------------------------------------------------------ */

/* out[l] = the 4 words of nvl_philox_words(seed, offset, g[l]) for NVL_LANES counters: the
 * Philox4x32-10 of core/philox.c with counter (g lo, offset lo, offset hi, g hi). One lane at a
 * time keeps its state in registers; consecutive lanes overlap in the out-of-order core. */
static void philox_lanes_scalar(uint32_t out[NVL_LANES][4], const uint64_t g[NVL_LANES], uint64_t seed,
                                uint64_t offset) {
  for (int l = 0; l < NVL_LANES; l++) {
    uint32_t c0 = (uint32_t)g[l], c1 = (uint32_t)offset, c2 = (uint32_t)(offset >> 32), c3 = (uint32_t)(g[l] >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
      uint64_t p0 = (uint64_t)0xD2511F53u * c0;
      uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
      c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
      c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
      c1 = (uint32_t)p1;
      c3 = (uint32_t)p0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    out[l][0] = c0;
    out[l][1] = c1;
    out[l][2] = c2;
    out[l][3] = c3;
  }
}

#ifdef NVL_QUANT_X86
/* The same, 8 lanes per AVX2 register: gcc does not vectorise the 32x32->64 multiplies above.
 * _mm256_mul_epu32 multiplies the even 32-bit lanes; the odd lanes are shifted down and
 * multiplied the same way, and the high and low halves are blended back into lane order. */
__attribute__((target("avx2"))) static void philox_lanes_avx2(uint32_t out[NVL_LANES][4],
                                                               const uint64_t g[NVL_LANES], uint64_t seed,
                                                               uint64_t offset) {
  uint32_t lo[NVL_LANES], hi[NVL_LANES], res[4][NVL_LANES];
  for (int l = 0; l < NVL_LANES; l++) {
    lo[l] = (uint32_t)g[l];
    hi[l] = (uint32_t)(g[l] >> 32);
  }
  const __m256i m0 = _mm256_set1_epi64x(0xD2511F53u), m1 = _mm256_set1_epi64x(0xCD9E8D57u);
  for (int l = 0; l < NVL_LANES; l += 8) {
    __m256i c0 = _mm256_loadu_si256((const __m256i *)(lo + l)), c3 = _mm256_loadu_si256((const __m256i *)(hi + l));
    __m256i c1 = _mm256_set1_epi32((int)(uint32_t)offset), c2 = _mm256_set1_epi32((int)(uint32_t)(offset >> 32));
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
      __m256i e0 = _mm256_mul_epu32(c0, m0), o0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
      __m256i e1 = _mm256_mul_epu32(c2, m1), o1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
      __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(e0, 32), o0, 0xAA);
      __m256i lo0 = _mm256_blend_epi32(e0, _mm256_slli_epi64(o0, 32), 0xAA);
      __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(e1, 32), o1, 0xAA);
      __m256i lo1 = _mm256_blend_epi32(e1, _mm256_slli_epi64(o1, 32), 0xAA);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
      c1 = lo1;
      c3 = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    _mm256_storeu_si256((__m256i *)(res[0] + l), c0);
    _mm256_storeu_si256((__m256i *)(res[1] + l), c1);
    _mm256_storeu_si256((__m256i *)(res[2] + l), c2);
    _mm256_storeu_si256((__m256i *)(res[3] + l), c3);
  }
  for (int l = 0; l < NVL_LANES; l++)
    for (int w = 0; w < 4; w++) out[l][w] = res[w][l];
}
#endif

static inline void philox_lanes(uint32_t out[NVL_LANES][4], const uint64_t g[NVL_LANES], uint64_t seed,
                                uint64_t offset) {
#ifdef NVL_QUANT_X86
  if (__builtin_cpu_supports("avx2")) {
    philox_lanes_avx2(out, g, seed, offset);
    return;
  }
#endif
  philox_lanes_scalar(out, g, seed, offset);
}

/* ---- NVFP4 ---------------------------------------------------------------------------------- */

/* Per-call constants: s_enc * (1/6) (the reference's order), and the element encode scale for
 * every stored scale byte, se = min(1 / (float(sd) * s_dec), FLT_MAX), computed exactly as the
 * reference computes it per block. Stored scales are ue4m3 codes <= 0x7F. */
typedef struct {
  float s_enc6;
  float se[128];
} nvfp4_consts;

static void nvfp4_consts_init(nvfp4_consts *c, float s_enc) {
  float s_dec = 1.0f / s_enc;
  c->s_enc6 = s_enc * (1.0f / 6.0f);
  for (int i = 0; i < 128; i++) c->se[i] = fminf(1.0f / (nvl_ue4m3_decode_ref((uint8_t)i) * s_dec), FLT_MAX);
}

/* nvl_nvfp4_block_scale_ref = ue4m3(min(bmax * s_enc6, FLT_MAX)). Here y = bmax * s_enc6 is never
 * NaN and never negative (bmax >= +0, possibly inf; s_enc6 > 0 and finite), so fminf is the plain
 * compare below, and ue4m3 (0 for y <= 0, else e4m3) is e4m3 itself (+0 encodes to 0). */
static inline uint32_t nvfp4_scale(float bmax, float s_enc6) {
  float y = bmax * s_enc6;
  return e4m3_encode(y < FLT_MAX ? y : FLT_MAX);
}

/* One 1x16 block x (16) -> codes q (16) with encode scale se; RNE, or SR with the block's
 * Philox words w (4) when w is not NULL: element j uses byte j%4 of word j/4, lowest first, i.e.
 * byte j of the words' little-endian image (read as bytes: measured faster than shifting the
 * words apart in 32-bit lanes). */
static inline void nvfp4_block(uint32_t *restrict q, const float *restrict x, float se, const uint32_t *w) {
  if (!w) {
    for (int j = 0; j < 16; j++) q[j] = e2m1_encode(x[j] * se);
  } else {
    uint8_t r[16];
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(r, w, 16);
#else
    for (int j = 0; j < 16; j++) r[j] = (uint8_t)(w[j / 4] >> (8 * (j % 4)));
#endif
    for (int j = 0; j < 16; j++) q[j] = e2m1_encode_sr(x[j] * se, r[j]);
  }
}

/* 1D: blocks [g0, g1) of x (K = 16 nb per row), each with its own max, in groups of NVL_LANES:
 * the group's maxima, scales and Philox draws, each computed across the group, then the blocks.
 * slab: o has SR slab offsets (formats_ref.h), so a block's SR index is not its own index. */
NVL_WORKER void nvfp4_1d_range(uint8_t *packed, uint8_t *scales, const float *x, const uint16_t *xb, int64_t g0,
                               int64_t g1, int64_t nb, int slab, const nvfp4_consts *c,
                               const nvl_quant_ref_opts *o) {
  float wide[16 * NVL_LANES]; /* bf16 x (xb): the lanes' blocks widened (exact) */
  for (int64_t gl = g0; gl < g1; gl += NVL_LANES) {
    int nl = (int)min64(NVL_LANES, g1 - gl);
    int32_t bmax[NVL_LANES] = {0};
    uint32_t sd[NVL_LANES], w[NVL_LANES][4];
    const float *xg = x + 16 * gl;
    if (xb) {
      for (int i = 0; i < 16 * nl; i++) wide[i] = u2f((uint32_t)xb[16 * gl + i] << 16);
      xg = wide;
    }
    int32_t raw = 0;
    if (nl == NVL_LANES) block_maxima(bmax, xg, NVL_LANES, 16, &raw); /* constant trip counts */
    else block_maxima(bmax, xg, nl, 16, &raw);
    flag_raw(raw);
    for (int l = 0; l < NVL_LANES; l++) sd[l] = nvfp4_scale(u2f((uint32_t)bmax[l]), c->s_enc6);
    if (o->sr) {
      uint64_t gs[NVL_LANES];
      for (int l = 0; l < NVL_LANES; l++)
        gs[l] = slab ? nvl_sr_group(o, 16 * nb, (gl + l) / nb, (gl + l) % nb) : (uint64_t)(gl + l);
      philox_lanes(w, gs, o->seed, o->offset);
    }
    uint32_t q[16 * NVL_LANES];
    for (int l = 0; l < nl; l++) {
      scales[gl + l] = (uint8_t)sd[l];
      nvfp4_block(q + 16 * l, xg + 16 * l, c->se[sd[l]], o->sr ? w[l] : NULL);
    }
    if (nl == NVL_LANES) pack_codes(packed + 8 * gl, q, 16 * NVL_LANES);
    else pack_codes(packed + 8 * gl, q, 16 * nl);
  }
}

/* 2D: tiles [t0, t1) of the (R/16, K/16) tile grid. Each tile's max is shared by its 16 blocks
 * g = (16 tr + i) * nb + tc, i = 0..15. */
NVL_WORKER void nvfp4_2d_range(uint8_t *packed, uint8_t *scales, const float *x, int64_t K,
                               int64_t t0, int64_t t1, const nvfp4_consts *c, const nvl_quant_ref_opts *o) {
  int64_t nb = K / 16;
  for (int64_t t = t0; t < t1; t++) {
    int64_t r0 = 16 * (t / nb), tc = t % nb;
    const float *xt = x + r0 * K + 16 * tc;
    int32_t acc[16] = {0}, raw[16] = {0}, tmax = 0, traw = 0;
    for (int i = 0; i < 16; i++)
      for (int j = 0; j < 16; j++) {
        acc[j] = max32(acc[j], abs_bits(xt + i * K + j));
        raw[j] = max32(raw[j], raw_bits(xt + i * K + j));
      }
    for (int j = 0; j < 16; j++) {
      tmax = max32(tmax, acc[j]);
      traw = max32(traw, raw[j]);
    }
    flag_raw(traw);
    uint32_t sd = nvfp4_scale(u2f((uint32_t)tmax), c->s_enc6);
    float se = c->se[sd];
    uint32_t w[NVL_LANES][4];
    if (o->sr) {
      uint64_t gs[NVL_LANES];
      for (int i = 0; i < 16; i++) gs[i] = nvl_sr_group(o, K, r0 + i, tc); /* (r0 + i) nb + tc unless a slab */
      philox_lanes(w, gs, o->seed, o->offset);
    }
    for (int i = 0; i < 16; i++) {
      int64_t g = (r0 + i) * nb + tc;
      uint32_t q[16];
      scales[g] = (uint8_t)sd;
      nvfp4_block(q, xt + i * K, se, o->sr ? w[i] : NULL);
      pack_codes(packed + 8 * g, q, 16);
    }
  }
}

static nvl_status nvfp4_quantize(uint8_t *packed, uint8_t *scales, float *amax_out, const float *x, const uint16_t *xb,
                                 int64_t rows, int64_t K, int block2d, const nvl_quant_ref_opts *opts) {
  static const nvl_quant_ref_opts defaults;
  const nvl_quant_ref_opts *o = opts ? opts : &defaults;
  if (rows < 0 || K < 0 || K % 16 || (block2d && rows % 16))
    return nvl_error(NVL_EINVAL, "nvfp4_quantize_cpu: shape [%lld,%lld] is not a whole number of %s blocks",
                     (long long)rows, (long long)K, block2d ? "16x16" : "1x16");
  NVL_TRY(nvl_sr_check_slab("nvfp4_quantize_cpu", o, K, 16));
  int slab = o->sr_row_offset != 0 || o->sr_k_offset != 0 || (o->sr_k_total != 0 && o->sr_k_total != K);
  int64_t n = rows * K;
  float amax = o->has_amax ? o->amax : xb ? absmax_bf16_cpu(xb, n) : absmax_cpu(x, n);
  nvfp4_consts c;
  nvfp4_consts_init(&c, nvl_nvfp4_enc_scale_ref(amax));
  if (block2d) {
    int64_t ntiles = (rows / 16) * (K / 16), per = 4; /* tiles per work item: 4 KiB of x */
    int64_t nitems = (ntiles + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t it = 0; it < nitems; it++) nvfp4_2d_range(packed, scales, x, K, it * per, min64(ntiles, it * per + per), &c, o);
  } else {
    int64_t nblk = n / 16, per = 4 * NVL_LANES; /* blocks per work item: 4 KiB of x */
    int64_t nitems = (nblk + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t it = 0; it < nitems; it++)
      nvfp4_1d_range(packed, scales, x, xb, it * per, min64(nblk, it * per + per), K / 16, slab, &c, o);
  }
  if (amax_out) *amax_out = amax;
  return NVL_OK;
}

nvl_status nvl_nvfp4_quantize_cpu(uint8_t *packed, uint8_t *scales, float *amax_out, const float *x, int64_t rows,
                                  int64_t K, int block2d, const nvl_quant_ref_opts *opts) {
  return nvfp4_quantize(packed, scales, amax_out, x, NULL, rows, K, block2d, opts);
}

nvl_status nvl_nvfp4_quantize_bf16_cpu(uint8_t *packed, uint8_t *scales, float *amax_out, const uint16_t *x,
                                       int64_t rows, int64_t K, const nvl_quant_ref_opts *opts) {
  return nvfp4_quantize(packed, scales, amax_out, NULL, x, rows, K, 0, opts);
}

/* Blocks [g0, g1): y = (value(code) * float(sd)) * s_dec, the reference's order; sdf (256) the
 * decoded scale bytes. */
NVL_WORKER void nvfp4_dequant_range(float *restrict y, const uint8_t *restrict packed, const uint8_t *restrict scales,
                                    const float *restrict sdf, float s_dec, int64_t g0, int64_t g1) {
  static const float v[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int64_t g = g0; g < g1; g++) {
    float sd = sdf[scales[g]];
    const uint8_t *p = packed + 8 * g;
    float *yb = y + 16 * g;
    for (int j = 0; j < 8; j++) {
      yb[2 * j] = v[p[j] & 0xF] * sd * s_dec;
      yb[2 * j + 1] = v[p[j] >> 4] * sd * s_dec;
    }
  }
}

nvl_status nvl_nvfp4_dequantize_cpu(float *y, const uint8_t *packed, const uint8_t *scales, float amax, int64_t rows,
                                    int64_t K) {
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "nvfp4_dequantize_cpu: shape [%lld,%lld] is not a whole number of 1x16 blocks",
                     (long long)rows, (long long)K);
  float sdf[256];
  for (int i = 0; i < 256; i++) sdf[i] = nvl_ue4m3_decode_ref((uint8_t)i);
  float s_dec = nvl_nvfp4_dec_scale_ref(amax);
  int64_t n = rows * K, nblk = n / 16, per = NVL_CHUNK / 16;
  int64_t nitems = (nblk + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t it = 0; it < nitems; it++)
    nvfp4_dequant_range(y, packed, scales, sdf, s_dec, it * per, min64(nblk, it * per + per));
  return NVL_OK;
}

/* ---- MX formats ----------------------------------------------------------------------------- */

static nvl_status check_elem(const char *op, nvl_elem elem) {
  if ((int)elem < 0 || elem >= NVL_ELEM_COUNT) return nvl_error(NVL_EINVAL, "%s: invalid element codec %d", op, (int)elem);
  return NVL_OK;
}

/* Per-tensor fp8 takes the two fp8 codecs only. */
static nvl_status check_fp8(const char *op, nvl_elem elem) {
  if (elem != NVL_ELEM_E4M3 && elem != NVL_ELEM_E5M2)
    return nvl_error(NVL_EINVAL, "%s: invalid fp8 element format %d", op, (int)elem);
  return NVL_OK;
}

/* nvl_e8m0_scale_rceil_ref, inlined (same steps). */
static inline uint32_t e8m0_rceil(float bmax, float elem_max) {
  float q = bmax / elem_max;
  if (q != q) return 0xFF;
  if (!(q > 0.0f)) return 0;
  if (q == INFINITY) return 254;
  uint32_t b = f2u(q), exp = b >> 23, mant = b & 0x7FFFFFu;
  if (exp == 0) return mant <= 0x400000u ? 0 : 1;
  uint32_t e = exp + (mant != 0);
  return e > 254 ? 254 : e;
}

/* nvl_e8m0_scale_floor_ref, inlined: for a normal bmax, floor(log2 bmax) + 127 is its exponent
 * field; a subnormal bmax (field 0) is below 2^-126 and clamps to code 0 as in the reference. */
static inline uint32_t e8m0_floor(float bmax, int emax_elem) {
  if (bmax != bmax) return 0xFF;
  if (!(bmax > 0.0f)) return 0;
  if (bmax == INFINITY) return 254;
  int code = (int)(f2u(bmax) >> 23) - emax_elem;
  return (uint32_t)(code < 0 ? 0 : code > 254 ? 254 : code);
}

/* 2^(127 - e) for an e8m0 code e (NaN for 0xFF), the reference's ldexpf(1, 127 - e): normal for
 * e <= 253, 2^-127 (subnormal, bits 1 << 22) for e = 254. */
static inline float e8m0_inverse(uint32_t e) {
  if (e == 0xFF) return NAN;
  return e == 254 ? u2f(1u << 22) : u2f((254 - e) << 23);
}

/* One 32-block g with max |x| bmax: its scale and codes (e2m1: packed, 16 bytes; SR with the
 * block's 8 Philox words w when w is not NULL, the two groups' words one after the other). */
static inline void mx_block(uint8_t *restrict codes, uint8_t *restrict scales, const float *restrict x, int64_t g,
                            float bmax, nvl_elem elem, nvl_mx_rule rule, const uint32_t *w) {
  const float *xb = x + 32 * g;
  static const float emax_val[NVL_ELEM_COUNT] = {448.0f, 57344.0f, 6.0f};
  static const int emax_exp[NVL_ELEM_COUNT] = {8, 15, 2};
  uint32_t e = rule == NVL_MX_RCEIL ? e8m0_rceil(bmax, emax_val[elem]) : e8m0_floor(bmax, emax_exp[elem]);
  float inv = e8m0_inverse(e);
  scales[g] = (uint8_t)e;
  if (elem == NVL_ELEM_E2M1) {
    uint32_t q[32];
    if (w) {
      uint8_t r[32];
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      memcpy(r, w, 32);
#else
      for (int j = 0; j < 32; j++) r[j] = (uint8_t)(w[j / 4] >> (8 * (j % 4)));
#endif
      for (int j = 0; j < 32; j++) q[j] = e2m1_encode_sr(xb[j] * inv, r[j]);
    } else {
      for (int j = 0; j < 32; j++) q[j] = e2m1_encode(xb[j] * inv);
    }
    pack_codes(codes + 16 * g, q, 32);
    return;
  }
  uint8_t *cb = codes + 32 * g;
  if (elem == NVL_ELEM_E5M2)
    for (int j = 0; j < 32; j++) cb[j] = (uint8_t)e5m2_encode(xb[j] * inv);
  else
    for (int j = 0; j < 32; j++) cb[j] = (uint8_t)e4m3_encode(xb[j] * inv);
}

/* 32-element blocks [g0, g1) (nb per row), in groups of NVL_LANES for the maxima (and the
 * Philox draws of SR: two counters per block). */
NVL_WORKER void mx_range(uint8_t *restrict codes, uint8_t *restrict scales, const float *restrict x, int64_t g0,
                         int64_t g1, int64_t nb, nvl_elem elem, nvl_mx_rule rule, const nvl_quant_ref_opts *o) {
  for (int64_t gl = g0; gl < g1; gl += NVL_LANES / 2) {
    int nl = (int)min64(NVL_LANES / 2, g1 - gl);
    int32_t bmax[NVL_LANES / 2];
    uint32_t w[NVL_LANES][4];
    int32_t raw = 0;
    if (nl == NVL_LANES / 2) block_maxima(bmax, x + 32 * gl, NVL_LANES / 2, 32, &raw); /* constant trip counts */
    else block_maxima(bmax, x + 32 * gl, nl, 32, &raw);
    flag_raw(raw);
    if (o->sr) {
      uint64_t gs[NVL_LANES];
      for (int l = 0; l < NVL_LANES; l++) {
        int64_t g = gl + l / 2; /* block g draws groups 2 b and 2 b + 1 of its row */
        gs[l] = nvl_sr_group(o, 32 * nb, g / nb, 2 * (g % nb) + l % 2);
      }
      philox_lanes(w, gs, o->seed, o->offset);
    }
    for (int l = 0; l < nl; l++) mx_block(codes, scales, x, gl + l, u2f((uint32_t)bmax[l]), elem, rule, o->sr ? w[2 * l] : NULL);
  }
}

nvl_status nvl_mx_quantize_cpu(uint8_t *codes, uint8_t *scales, const float *x, int64_t rows, int64_t K, nvl_elem elem,
                               nvl_mx_rule rule, const nvl_quant_ref_opts *opts) {
  static const nvl_quant_ref_opts defaults;
  const nvl_quant_ref_opts *o = opts ? opts : &defaults;
  NVL_TRY(check_elem("mx_quantize_cpu", elem));
  if ((int)rule < 0 || rule >= NVL_MX_RULE_COUNT)
    return nvl_error(NVL_EINVAL, "mx_quantize_cpu: invalid scale rule %d", (int)rule);
  if (rows < 0 || K < 0 || K % 32)
    return nvl_error(NVL_EINVAL, "mx_quantize_cpu: shape [%lld,%lld] is not a whole number of 1x32 blocks",
                     (long long)rows, (long long)K);
  if (o->sr && elem != NVL_ELEM_E2M1)
    return nvl_error(NVL_EINVAL, "mx_quantize_cpu: stochastic rounding is defined for e2m1 elements only");
  NVL_TRY(nvl_sr_check_slab("mx_quantize_cpu", o, K, 32));
  int64_t n = rows * K, nblk = n / 32, per = NVL_CHUNK / 32;
  int64_t nitems = (nblk + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t it = 0; it < nitems; it++)
    mx_range(codes, scales, x, it * per, min64(nblk, it * per + per), K / 32, elem, rule, o);
  return NVL_OK;
}

/* ---- FP8 per tensor ------------------------------------------------------------------------- */

/* codes[i] = fp8(x[i] * s) for i in [i0, i1): 32 at a time, then the tail. */
NVL_WORKER void fp8_range(uint8_t *restrict codes, const float *restrict x, float s, int64_t i0, int64_t i1,
                          nvl_elem elem) {
  int64_t i = i0;
  int32_t raw[32] = {0}, r = 0; /* the elements' raw_bits: an amax given skips absmax_span's test */
  if (elem == NVL_ELEM_E5M2) {
    for (; i + 32 <= i1; i += 32)
      for (int j = 0; j < 32; j++) {
        codes[i + j] = (uint8_t)e5m2_encode(x[i + j] * s);
        raw[j] = max32(raw[j], raw_bits(x + i + j));
      }
    for (; i < i1; i++) {
      codes[i] = (uint8_t)e5m2_encode(x[i] * s);
      r = max32(r, raw_bits(x + i));
    }
  } else {
    for (; i + 32 <= i1; i += 32)
      for (int j = 0; j < 32; j++) {
        codes[i + j] = (uint8_t)e4m3_encode(x[i + j] * s);
        raw[j] = max32(raw[j], raw_bits(x + i + j));
      }
    for (; i < i1; i++) {
      codes[i] = (uint8_t)e4m3_encode(x[i] * s);
      r = max32(r, raw_bits(x + i));
    }
  }
  for (int j = 0; j < 32; j++) r = max32(r, raw[j]);
  flag_raw(r);
}

nvl_status nvl_fp8_quantize_tensor_cpu(uint8_t *codes, float *scale, float *amax, const float *x, int64_t n,
                                       nvl_elem elem, const float *amax_in) {
  NVL_TRY(check_fp8("fp8_quantize_tensor_cpu", elem));
  if (n < 0) return nvl_error(NVL_EINVAL, "fp8_quantize_tensor_cpu: negative size %lld", (long long)n);
  float a = amax_in ? *amax_in : absmax_cpu(x, n);
  float s = nvl_fp8_tensor_scale_ref(a, elem);
  int64_t nitems = (n + NVL_CHUNK - 1) / NVL_CHUNK;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t it = 0; it < nitems; it++) fp8_range(codes, x, s, it * NVL_CHUNK, min64(n, it * NVL_CHUNK + NVL_CHUNK), elem);
  if (scale) *scale = s;
  if (amax) *amax = a;
  return NVL_OK;
}

/* ---- GAM scaling (gam_ref.h) ---------------------------------------------------------------- *
 * Two passes over x, as the reference: each group's max |x| (integer-domain, so any split of the work
 * gives the reference's fmaxf fold) and its m_g; then per block its max, e_b, the scale m_g 2^e_b and
 * the codes, the element loop vectorised as fp8_range's. The per-group and per-block scalar steps
 * (m_g, e_b) are the reference's own functions: one call per group or block, nothing per element. */

/* blocks [b0, b1) of `block` elements, groups of G blocks whose m_g are in mant */
NVL_WORKER void gam_range(uint8_t *restrict codes, uint8_t *restrict scales, const float *restrict mant,
                          const float *restrict x, int64_t b0, int64_t b1, int64_t block, int64_t G, nvl_elem elem) {
  for (int64_t b = b0; b < b1; b++) {
    const float *xb = x + b * block;
    uint8_t *cb = codes + b * block;
    int32_t m = 0;
    for (int64_t j = 0; j < block; j++) m = max32(m, abs_bits(xb + j));
    float m_g = mant[b / G];
    int e_b = nvl_gam_block_exp_ref(u2f((uint32_t)m), m_g, elem);
    float s = ldexpf(m_g, e_b); /* exact (gam_ref.h): the reference's scale */
    scales[b] = nvl_gam_e8m0_of_exp(e_b);
    if (elem == NVL_ELEM_E5M2)
      for (int64_t j = 0; j < block; j++) cb[j] = (uint8_t)e5m2_encode(xb[j] * s);
    else
      for (int64_t j = 0; j < block; j++) cb[j] = (uint8_t)e4m3_encode(xb[j] * s);
  }
}

nvl_status nvl_gam_quantize_cpu(uint8_t *codes, uint8_t *scales, float *mant, const float *x, int64_t rows, int64_t K,
                                int64_t block, int64_t group_blocks, nvl_elem elem) {
  const char *op = "gam_quantize_cpu";
  NVL_TRY(check_fp8(op, elem));
  if (block <= 0 || rows < 0 || K < 0 || K % block)
    return nvl_error(NVL_EINVAL, "%s: shape [%lld,%lld] is not a whole number of 1x%lld blocks", op, (long long)rows,
                     (long long)K, (long long)block);
  const int64_t n = rows * K, nblocks = n / block, G = group_blocks;
  if (nblocks == 0) return NVL_OK;
  if (G <= 0 || nblocks % G)
    return nvl_error(NVL_EINVAL, "%s: %lld blocks of 1x%lld do not split into groups of %lld blocks", op,
                     (long long)nblocks, (long long)block, (long long)G);
  const int64_t ng = nblocks / G, gn = G * block; /* groups, elements per group */
  if (gn > NVL_QUANT_OMP_MIN) {
    for (int64_t g = 0; g < ng; g++) mant[g] = nvl_gam_group_mantissa_ref(absmax_cpu(x + g * gn, gn), elem);
  } else {
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
    for (int64_t g = 0; g < ng; g++) mant[g] = nvl_gam_group_mantissa_ref(absmax_span(x + g * gn, gn), elem);
  }
  const int64_t per = block >= NVL_CHUNK ? 1 : NVL_CHUNK / block, nitems = (nblocks + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t it = 0; it < nitems; it++)
    gam_range(codes, scales, mant, x, it * per, min64(nblocks, it * per + per), block, G, elem);
  return NVL_OK;
}

/* ---- RHT ------------------------------------------------------------------------------------ */

/* One butterfly stage of span h on t (16), as nvl_rht16_ref: for each pair (j, j+h) with
 * j mod 2h < h, (t_j, t_j+h) <- (t_j + t_j+h, t_j - t_j+h). Written per output element (the
 * partner of j is j ^ h) so the stage is straight-line code for the vectoriser. */
static inline void rht_stage(float t[16], int h) {
  float u[16];
  for (int j = 0; j < 16; j++) u[j] = (j & h) ? t[j ^ h] - t[j] : t[j] + t[j ^ h];
  memcpy(t, u, sizeof u);
}

/* 16-chunks [c0, c1): sign, stages h = 1, 2, 4, 8, * 0.25. y may alias x: each chunk is read
 * whole before it is written. */
NVL_WORKER void rht_range(float *y, const float *x, const float *s, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c++) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = s[i] * x[16 * c + i];
    rht_stage(t, 1);
    rht_stage(t, 2);
    rht_stage(t, 4);
    rht_stage(t, 8);
    for (int i = 0; i < 16; i++) y[16 * c + i] = t[i] * 0.25f;
  }
}

/* The inverse on 16-chunks [c0, c1): stages h = 1, 2, 4, 8, * 0.25, then the signs (x R^T). */
NVL_WORKER void rht_inverse_range(float *y, const float *x, const float *s, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c++) {
    float t[16];
    memcpy(t, x + 16 * c, sizeof t);
    rht_stage(t, 1);
    rht_stage(t, 2);
    rht_stage(t, 4);
    rht_stage(t, 8);
    for (int i = 0; i < 16; i++) y[16 * c + i] = s[i] * (t[i] * 0.25f);
  }
}

/* rht_range on bf16 x, each output rounded to bf16 (RNE, NaN quieted) and kept in f32: the
 * widening, the transform and the rounding of NUMERICS §5 in one pass */
NVL_WORKER void rht_range_bf16(float *y, const uint16_t *x, const float *s, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c++) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = s[i] * u2f((uint32_t)x[16 * c + i] << 16);
    rht_stage(t, 1);
    rht_stage(t, 2);
    rht_stage(t, 4);
    rht_stage(t, 8);
    for (int i = 0; i < 16; i++) {
      uint32_t u = f2u(t[i] * 0.25f), rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      y[16 * c + i] = u2f((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : rounded);
    }
  }
}

static nvl_status rht_rows(float *y, const float *x, const uint16_t *xb, int64_t rows, int64_t K, const float *signs,
                           int inverse) {
  if (rows < 0 || K < 0 || K % 16)
    return nvl_error(NVL_EINVAL, "rht16_rows_cpu: K = %lld is not a multiple of 16 (rows %lld)", (long long)K,
                     (long long)rows);
  float s[16];
  memcpy(s, signs ? signs : nvl_rht16_default_signs, sizeof s);
  int64_t n = rows * K, nchunk = n / 16, per = NVL_CHUNK / 16;
  int64_t nitems = (nchunk + per - 1) / per;
#pragma omp parallel for schedule(static) if (n > NVL_QUANT_OMP_MIN)
  for (int64_t it = 0; it < nitems; it++) {
    int64_t c0 = it * per, c1 = min64(nchunk, it * per + per);
    if (xb) rht_range_bf16(y, xb, s, c0, c1);
    else if (inverse) rht_inverse_range(y, x, s, c0, c1);
    else rht_range(y, x, s, c0, c1);
  }
  return NVL_OK;
}

nvl_status nvl_rht16_rows_cpu(float *y, const float *x, int64_t rows, int64_t K, const float *signs) {
  return rht_rows(y, x, NULL, rows, K, signs, 0);
}

nvl_status nvl_rht16_rows_bf16_cpu(float *y, const uint16_t *x, int64_t rows, int64_t K, const float *signs) {
  return rht_rows(y, NULL, x, rows, K, signs, 0);
}

nvl_status nvl_rht16_rows_inverse_cpu(float *y, const float *x, int64_t rows, int64_t K, const float *signs) {
  return rht_rows(y, x, NULL, rows, K, signs, 1);
}
