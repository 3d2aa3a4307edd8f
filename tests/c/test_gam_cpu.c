/* test_gam_cpu.c: the fast CPU GAM kernel (kernels/cpu/quant_cpu.c nvl_gam_quantize_cpu, and its
 * portable build from test_quant_cpu.c) against the scalar reference nvl_gam_quantize_ref, bit for bit:
 * every code, E8M0 byte and group mantissa, and the host's non-finite flag. The reference itself is
 * checked against an independent implementation in test_gam_ref.c; the inputs here are that file's
 * cases (the hand-worked tensor, the NaN / inf tensor, the exponent edges as block maxima, its random
 * tensor generator) plus tensors large enough for the OpenMP paths (a whole-tensor group over the
 * threaded amax, many small groups across threads). */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/quant_cpu.h"
#include "cpu/ref/gam_ref.h"
#include "unit.h"

/* test_quant_cpu.c's second build of quant_cpu.c (NVL_QUANT_PORTABLE) */
nvl_status portable_gam_quantize_cpu(uint8_t *, uint8_t *, float *, const float *, int64_t, int64_t, int64_t, int64_t,
                                     nvl_elem);

typedef nvl_status (*gam_fn)(uint8_t *, uint8_t *, float *, const float *, int64_t, int64_t, int64_t, int64_t, nvl_elem);

/* Fails (differing bytes, mantissas, flags) of fn against the reference on x (R, K), blocks of B,
 * groups of G blocks (0: the tensor), both fp8 elements. */
static long diff(gam_fn fn, const float *x, int64_t R, int64_t K, int B, int64_t G) {
  int64_t n = R * K, nb = n / B, g = G ? G : nb, ng = nb ? nb / g : 0;
  uint8_t *c0 = malloc((size_t)n + 1), *c1 = malloc((size_t)n + 1), *s0 = malloc((size_t)nb + 1),
          *s1 = malloc((size_t)nb + 1);
  float *m0 = malloc(sizeof(float) * (size_t)(ng + 1)), *m1 = malloc(sizeof(float) * (size_t)(ng + 1));
  long fails = 0;
  for (int e = 0; e < 2; e++) {
    nvl_elem el = e ? NVL_ELEM_E5M2 : NVL_ELEM_E4M3;
    int nonfinite = -1;
    memset(c1, 0xAA, (size_t)n);
    memset(s1, 0xAA, (size_t)nb);
    (void)nvl_host_nonfinite_take();
    if (nvl_gam_quantize_ref(c0, s0, m0, &nonfinite, x, R, K, B, G, el) != NVL_OK) fails++;
    if (fn(c1, s1, m1, x, R, K, B, g, el) != NVL_OK) fails++;
    uint32_t flags = nvl_host_nonfinite_take();
    fails += (flags == NVL_NONFINITE_INPUT) != (nonfinite == 1) || (flags & ~(uint32_t)NVL_NONFINITE_INPUT);
    fails += memcmp(c0, c1, (size_t)n) != 0;
    fails += memcmp(s0, s1, (size_t)nb) != 0;
    fails += memcmp(m0, m1, sizeof(float) * (size_t)ng) != 0;
  }
  free(c0); free(c1); free(s0); free(s1); free(m0); free(m1);
  return fails;
}

static long diff_both(const float *x, int64_t R, int64_t K, int B, int64_t G) {
  return diff(nvl_gam_quantize_cpu, x, R, K, B, G) + diff(portable_gam_quantize_cpu, x, R, K, B, G);
}

#include "gam_data.h"

NVL_TEST(gam_cpu_hand_and_nonfinite_cases) {
  const float hand[24] = {3.0f, -1.0f, 0.5f, 2.25f, 1.59f, 1.0f, -0.5f, 0.0f, 2.0f, 1.5f, -2.0f, 0.25f,
                          0.75f, 0.5f, -0.25f, 0.125f, 0.0f, -0.0f, 0.0f, 0.0f, 0x1p-140f, -0x1p-141f, 0x1p-149f, 0.0f};
  CHECK(diff_both(hand, 1, 24, 4, 0) == 0);
  CHECK(diff_both(hand, 2, 12, 4, 3) == 0);
  CHECK(diff_both(hand, 6, 4, 4, 1) == 0);
  const float nf[16] = {3.0f, NAN, -1.0f, 0.5f, -NAN, 0.0f, 0.0f, 0.0f,
                        1.0f, INFINITY, -2.0f, 0.25f, 2.0f, -INFINITY, 0.5f, 1e30f};
  CHECK(diff_both(nf, 2, 8, 4, 2) == 0);
  CHECK(diff_both(nf, 2, 8, 4, 0) == 0);
  CHECK(diff_both(nf, 1, 16, 16, 0) == 0);
}

/* test_gam_ref.c gam_exponent_edges as tensors: groups of two blocks of 4, block 0 setting the group's
 * max (so m_g), block 1's max the edge value. */
NVL_TEST(gam_cpu_exponent_edges) {
  const float edges[] = {0x1.cp-119f, 0x1.cp-120f, 0x1p-149f, 0x1.8p-130f, FLT_MAX, 0.0f, INFINITY, 0x1.8p-140f};
  const float gmax[] = {0x1.cp-119f, 1.5f * 0x1p-119f, 0x1p-149f, 1.9f * 0x1p-129f, FLT_MAX, 1.3f, INFINITY, 3.0f};
  const int ne = (int)(sizeof edges / sizeof edges[0]);
  float x[8 * 8 * 8];
  int64_t n = 0;
  for (int i = 0; i < ne; i++)
    for (int k = 0; k < ne; k++) {
      float gm = fmaxf(gmax[k], edges[i]);
      const float blk[8] = {gm, -gm * 0.5f, 0.0f, gm * 0.25f, edges[i], -edges[i] * 0.75f, 0.0f, edges[i] * 0.5f};
      memcpy(x + n, blk, sizeof blk);
      n += 8;
    }
  CHECK(diff_both(x, n / 8, 8, 4, 2) == 0);
  CHECK(diff_both(x, 1, n, 4, 0) == 0);
}

NVL_TEST(gam_cpu_random) {
  static float x[1 << 14];
  const int Bs[3] = {16, 32, 128};
  long fails = 0;
  rng_state = 2026;
  for (int t = 0; t < 96; t++) {
    int B = Bs[t % 3];
    int64_t R = 4, K = B * (1 + (int64_t)(t % 4)), nb = R * (K / B);
    int64_t G = (t / 3) % 4 == 3 ? 0 : (int64_t)1 << ((t / 3) % 4 % 3);
    if (G && nb % G) G = 0;
    random_tensor(x, nb, B, G);
    fails += diff_both(x, R, K, B, G);
  }
  CHECK(fails == 0);
}

/* Over the OpenMP thresholds (32768 elements): one group (the threaded amax), groups of 4 blocks across
 * threads, an odd block length (24) and groups larger than a chunk; a NaN in the middle of each. */
NVL_TEST(gam_cpu_large) {
  const int64_t R = 96, K = 1536;
  float *x = malloc(sizeof(float) * (size_t)(R * K));
  rng_state = 34;
  const int Bs[3] = {32, 24, 128};
  const int64_t Gs[3] = {0, 4, 96};
  long fails = 0;
  for (int t = 0; t < 3; t++) {
    int B = Bs[t];
    random_tensor(x, R * K / B, B, Gs[t]);
    fails += diff_both(x, R, K, B, Gs[t]);
    x[R * K / 2 + 5] = NAN;
    fails += diff_both(x, R, K, B, Gs[t]);
  }
  CHECK(fails == 0);
  /* a tiny group max across a whole tensor of zeros but one subnormal */
  memset(x, 0, sizeof(float) * (size_t)(R * K));
  x[R * K - 1] = -0x1p-149f;
  CHECK(diff_both(x, R, K, 32, 0) == 0);
  free(x);
}

NVL_TEST(gam_cpu_bad_arguments) {
  float x[64] = {0}, mant[4];
  uint8_t codes[64], scales[8];
  CHECK(nvl_gam_quantize_cpu(codes, scales, mant, x, 2, 32, 32, 2, NVL_ELEM_E2M1) == NVL_EINVAL);
  CHECK(nvl_gam_quantize_cpu(codes, scales, mant, x, 2, 32, 24, 1, NVL_ELEM_E4M3) == NVL_EINVAL);
  CHECK(nvl_gam_quantize_cpu(codes, scales, mant, x, 3, 16, 8, 4, NVL_ELEM_E4M3) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "6 blocks of 1x8 do not split into groups of 4 blocks") != NULL);
  CHECK(nvl_gam_quantize_cpu(codes, scales, mant, x, 0, 32, 32, 0, NVL_ELEM_E4M3) == NVL_OK); /* empty */
}
