/* test_core.c: C unit tests of core/ without Lua: Philox known answers, bf16 conversion, views,
 * broadcasting, the fast CPU kernels against their references. */
#include <math.h>
#include <string.h>
#include "cpu/ops_cpu.h"
#include "cpu/ref/ops_ref.h"
#include "ops.h"
#include "unit.h"

/* Published Random123 known-answer vectors for philox4x32_10 (kat_vectors). */
NVL_TEST(philox_known_answers) {
  static const uint32_t kat[3][10] = {
    {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
    {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
    {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1},
  };
  for (int i = 0; i < 3; i++) {
    uint32_t out[4];
    nvl_philox4x32_10(kat[i], kat[i] + 4, out);
    for (int j = 0; j < 4; j++) CHECK_EQ_U32(out[j], kat[i][6 + j]);
  }
}

static float f_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

NVL_TEST(bf16_rounding_specials) {
  CHECK(nvl_f32_to_bf16(1.0f) == 0x3f80);
  CHECK(nvl_f32_to_bf16(f_from_bits(0x3f808000)) == 0x3f80); /* tie, even stays */
  CHECK(nvl_f32_to_bf16(f_from_bits(0x3f818000)) == 0x3f82); /* tie, odd rounds up to even */
  CHECK(nvl_f32_to_bf16(f_from_bits(0x3f808001)) == 0x3f81); /* just above the tie */
  CHECK(nvl_f32_to_bf16(f_from_bits(0x7f7fffff)) == 0x7f80); /* FLT_MAX rounds to inf */
  CHECK(nvl_f32_to_bf16(f_from_bits(0x7f7f7fff)) == 0x7f7f); /* below the halfway point: max bf16 */
  CHECK(nvl_f32_to_bf16(f_from_bits(0x80000000)) == 0x8000); /* -0 */
  CHECK(nvl_f32_to_bf16(f_from_bits(0xff800000)) == 0xff80); /* -inf */
  uint16_t n = nvl_f32_to_bf16(f_from_bits(0x7f800001)); /* NaN with payload only in low bits */
  CHECK((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0);
  CHECK(nvl_f32_to_bf16(f_from_bits(0x00008000)) == 0x0000); /* subnormal tie to even (0) */
  CHECK(nvl_f32_to_bf16(f_from_bits(0x00018000)) == 0x0002);
}

/* Storing a double rounds once, straight to bf16 (no double rounding through f32). */
NVL_TEST(bf16_store_from_double_rounds_once) {
  uint16_t h;
  /* 1 + 2^-8 + 2^-30: above the bf16 tie between 1 and 1+2^-7, but rounds to the tie in f32. */
  nvl_dtypes[NVL_BF16].store_f(&h, 1.0 + ldexp(1, -8) + ldexp(1, -30));
  CHECK(h == 0x3f81);
  nvl_dtypes[NVL_BF16].store_f(&h, 1.0 + ldexp(1, -8) - ldexp(1, -30));
  CHECK(h == 0x3f80);
  nvl_dtypes[NVL_BF16].store_f(&h, 1.0 + ldexp(1, -8)); /* exact tie: even */
  CHECK(h == 0x3f80);
}

NVL_TEST(view_strides_and_errors) {
  nvl_tensor t = nvl_tensor_null(), tt = nvl_tensor_null(), v = nvl_tensor_null();
  int64_t shape[3] = {2, 3, 4};
  CHECK(nvl_tensor_empty(&t, NVL_F32, NVL_CPU, 3, shape) == NVL_OK);
  int64_t s2[2] = {6, -1};
  CHECK(nvl_tensor_view(&v, &t, 2, s2) == NVL_OK);
  CHECK(v.shape[1] == 4 && v.strides[0] == 4 && v.strides[1] == 1);
  nvl_tensor_release(&v);
  CHECK(nvl_tensor_transpose(&tt, &t, 0, 2) == NVL_OK); /* [4,3,2], strides [1,4,12] */
  int64_t s3[2] = {12, 2};
  CHECK(nvl_tensor_view(&v, &tt, 2, s3) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "view") != NULL);
  int64_t s4[3] = {4, 3, 2};
  CHECK(nvl_tensor_view(&v, &tt, 3, s4) == NVL_OK);
  nvl_tensor_release(&v);
  CHECK(t.storage->refcount == 2);
  nvl_tensor_release(&tt);
  CHECK(t.storage->refcount == 1);
  size_t live = nvl_memory_live(NVL_CPU);
  nvl_tensor_release(&t);
  CHECK(nvl_memory_live(NVL_CPU) == live - 2 * 3 * 4 * sizeof(float));
}

NVL_TEST(broadcast_error_message) {
  nvl_tensor a = nvl_tensor_null(), b = nvl_tensor_null(), r = nvl_tensor_null();
  int64_t sa[2] = {2, 3}, sb[1] = {4};
  nvl_tensor_empty(&a, NVL_F32, NVL_CPU, 2, sa);
  nvl_tensor_empty(&b, NVL_BF16, NVL_CPU, 1, sb);
  CHECK(nvl_binary(&r, NVL_OP_ADD, &a, &b) == NVL_EINVAL);
  CHECK(strstr(nvl_last_error(), "add: shapes [2,3] f32 and [4] bf16 cannot be broadcast") != NULL);
  CHECK(r.storage == NULL);
  nvl_tensor_release(&a);
  nvl_tensor_release(&b);
}

/* The BLAS-backed matmul against the scalar reference, including transposed operands. */
NVL_TEST(matmul_blas_matches_reference) {
  nvl_generator g = {7, 0};
  int64_t sa[2] = {37, 19}, sb[2] = {23, 19};
  nvl_tensor a = nvl_tensor_null(), b = nvl_tensor_null(), bt = nvl_tensor_null();
  nvl_tensor r = nvl_tensor_null(), ref = nvl_tensor_null();
  nvl_tensor_empty(&a, NVL_F32, NVL_CPU, 2, sa);
  nvl_tensor_empty(&b, NVL_F32, NVL_CPU, 2, sb);
  nvl_randn_(&a, &g);
  nvl_randn_(&b, &g);
  nvl_tensor_transpose(&bt, &b, 0, 1); /* [19,23], column-major */
  CHECK(nvl_matmul(&r, &a, &bt) == NVL_OK);
  int64_t so[2] = {37, 23};
  nvl_tensor_empty(&ref, NVL_F32, NVL_CPU, 2, so);
  CHECK(nvl_matmul_ref(NULL, &ref, &a, &bt) == NVL_OK);
  /* fp32 summation of K=19 terms: |err| <= K * 2^-24 * sum|a||b| (+ the reference's own
   * rounding once); the sum of |a||b| for randn rows is < 19 * 16 with overwhelming margin. */
  const float *pr = nvl_tensor_data(&r), *pf = nvl_tensor_data(&ref);
  double worst = 0;
  for (int i = 0; i < 37 * 23; i++) worst = fmax(worst, fabs((double)pr[i] - pf[i]));
  CHECK(worst <= 19 * ldexp(1, -24) * 19 * 16);
  nvl_tensor_release(&a); nvl_tensor_release(&b); nvl_tensor_release(&bt);
  nvl_tensor_release(&r); nvl_tensor_release(&ref);
}

/* Fast f32 elementwise kernels are bit-identical to the reference. */
NVL_TEST(fast_elementwise_matches_reference) {
  nvl_generator g = {11, 0};
  int64_t s[1] = {1000};
  nvl_tensor a = nvl_tensor_null(), b = nvl_tensor_null(), r1 = nvl_tensor_null(), r2 = nvl_tensor_null();
  nvl_tensor_empty(&a, NVL_F32, NVL_CPU, 1, s);
  nvl_tensor_empty(&b, NVL_F32, NVL_CPU, 1, s);
  nvl_tensor_empty(&r1, NVL_F32, NVL_CPU, 1, s);
  nvl_tensor_empty(&r2, NVL_F32, NVL_CPU, 1, s);
  nvl_randn_(&a, &g);
  nvl_rand_(&b, &g);
  for (int op = NVL_OP_ADD; op <= NVL_OP_MINIMUM; op++) {
    nvl_binary_f32_cpu(op, nvl_tensor_data(&r1), nvl_tensor_data(&a), nvl_tensor_data(&b), 1000);
    CHECK(nvl_binary_ref(NULL, op, &r2, &a, &b) == NVL_OK);
    CHECK(memcmp(nvl_tensor_data(&r1), nvl_tensor_data(&r2), 4000) == 0);
    nvl_binary_scalar_f32_cpu(op, nvl_tensor_data(&r1), nvl_tensor_data(&a), 0.1, 1, 1000);
    CHECK(nvl_binary_scalar_ref(NULL, op, &r2, &a, nvl_scalar_f(0.1), 1) == NVL_OK);
    CHECK(memcmp(nvl_tensor_data(&r1), nvl_tensor_data(&r2), 4000) == 0);
  }
  for (int op = 0; op < NVL_UNARY_COUNT; op++) {
    nvl_unary_f32_cpu(op, nvl_tensor_data(&r1), nvl_tensor_data(&b), 1000);
    CHECK(nvl_unary_ref(NULL, op, &r2, &b) == NVL_OK);
    CHECK(memcmp(nvl_tensor_data(&r1), nvl_tensor_data(&r2), 4000) == 0);
  }
  nvl_tensor_release(&a); nvl_tensor_release(&b); nvl_tensor_release(&r1); nvl_tensor_release(&r2);
}
