/* simd_cpu.h: helpers for CPU loops that vectorise: function clones per vector width, and an exp
 * written so that a loop of it vectorises. Used by attention_cpu.c and layers_cpu.c. */
#ifndef NVL_SIMD_CPU_H
#define NVL_SIMD_CPU_H
#include <math.h>
#include <stdint.h>

/* NVL_CLONES: a function gets AVX2 / AVX-512 clones beside the baseline one (target_clones:
 * an ifunc picks one at load time); no FMA contraction (-ffp-contract=off), so every clone gives the
 * same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
#define NVL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define NVL_CLONES
#endif

/* exp(x) in fp32, written so that a loop of it vectorises (expf does not): Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2/2, Cephes' degree-7 polynomial for e^r (within ~2 ulp of expf), times 2^n.
 * x < -87 gives 0 (expf: a subnormal, below 2^-125, which no softmax sum notices), x > 88 gives
 * +inf, NaN gives NaN. */
static inline float exp_f32(float x) {
  const float lo = -87.0f, hi = 88.0f, round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  float xc = x > lo ? x : lo; /* NaN -> lo: the integer conversion below stays defined */
  xc = xc < hi ? xc : hi;
  float kf = (xc * 1.44269504088896341f + round) - round; /* n = rint(x / ln2), in [-126, 127] */
  float r = (xc - kf * 0.693359375f) - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  union {
    uint32_t u;
    float f;
  } two_n = {.u = (uint32_t)((int32_t)kf + 127) << 23}; /* 2^n, normal */
  float e = p * two_n.f;
  e = x < lo ? 0.0f : e;
  e = x > hi ? INFINITY : e;
  return x == x ? e : x;
}

/* bf16 <-> f32 as nvl_f32_to_bf16 / nvl_bf16_to_f32 (core/dtype.h), the same bits, written
 * branch-free so that a loop of them vectorises. */
static inline uint16_t bf16_of(float f) {
  union {
    float f;
    uint32_t u;
  } v = {.f = f};
  uint32_t x = v.u, rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16, quiet = (x >> 16) | 0x0040u;
  return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline float f32_of(uint16_t h) {
  union {
    uint32_t u;
    float f;
  } v = {.u = (uint32_t)h << 16};
  return v.f;
}
#endif
