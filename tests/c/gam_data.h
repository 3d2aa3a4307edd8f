/* gam_data.h: the deterministic random tensors of the GAM C tests (test_gam_ref.c, test_gam_cpu.c),
 * each file with its own generator state (static): splitmix64 draws; per block ordinary, wide, tiny
 * (subnormal) or zero magnitudes, and per group one block whose max is the group max times a power of
 * two (m_b == m_g when not clamped). */
#ifndef NVL_TEST_GAM_DATA_H
#define NVL_TEST_GAM_DATA_H
#include <math.h>
#include <stdint.h>

static uint64_t rng_state;
static uint64_t rng(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/* +-(1 + u) 2^e, u a random 23-bit fraction, e uniform in [lo, hi] (ldexpf: subnormals rounded). */
static float rnd(int lo, int hi) {
  uint64_t r = rng();
  float v = ldexpf(1.0f + (float)(r & 0x7FFFFF) / 0x1p23f, lo + (int)((r >> 24) % (uint64_t)(hi - lo + 1)));
  return (r >> 63) ? -v : v;
}

/* x = nb blocks of B, in groups of G blocks (0: one group): per block ordinary, wide, tiny (subnormal)
 * or zero magnitudes, and per group one block whose max is the group max times a power of two. */
static void random_tensor(float *x, int64_t nb, int B, int64_t G) {
  for (int64_t b = 0; b < nb; b++) {
    int kind = (int)(rng() % 8), lo = -20 + (int)(rng() % 30);
    for (int j = 0; j < B; j++) {
      float *v = &x[b * B + j];
      if (kind == 0) *v = 0.0f;
      else if (kind == 1) *v = rnd(-149, -118);
      else if (kind == 2) *v = rnd(-60, 60);
      else *v = rnd(lo, lo + 6);
    }
  }
  int64_t gsz = G ? G : nb;
  for (int64_t g0 = 0; g0 < nb; g0 += gsz) {
    int64_t im = g0 * B;
    for (int64_t i = g0 * B; i < (g0 + gsz) * B; i++)
      if (fabsf(x[i]) > fabsf(x[im])) im = i;
    int64_t b = g0 + (int64_t)(rng() % (uint64_t)gsz);
    float v = ldexpf(fabsf(x[im]), -(int)(rng() % 5));
    for (int j = 0; j < B; j++) x[b * B + j] = fminf(fabsf(x[b * B + j]), v) * (j & 1 ? -1.0f : 1.0f);
    x[b * B] = v;
  }
}

#endif
