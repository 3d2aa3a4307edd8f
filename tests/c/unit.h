/* unit.h: a tiny C unit-test harness for core/ and kernels/ (no Lua).
 *   NVL_TEST(name) { ... CHECK(cond); CHECK_EQ_U32(a, b); ... }
 * Tests register themselves (constructor attribute); tests/c/main.c runs them all, prints one
 * line per test and "N passed, N failed, N skipped", and exits non-zero on any failure. */
#ifndef NVL_UNIT_H
#define NVL_UNIT_H
#include <stdio.h>
#include <stdint.h>

typedef void (*nvl_unit_fn)(int *failed);
void nvl_unit_register(const char *name, nvl_unit_fn fn);

#define NVL_TEST(name)                                                             \
  static void name(int *nvl_failed_);                                              \
  __attribute__((constructor)) static void name##_register(void) { nvl_unit_register(#name, name); } \
  static void name(int *nvl_failed_)

#define CHECK(cond)                                                                \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
      (*nvl_failed_)++;                                                            \
    }                                                                              \
  } while (0)

#define CHECK_EQ_U32(a, b)                                                         \
  do {                                                                             \
    uint32_t a_ = (uint32_t)(a), b_ = (uint32_t)(b);                               \
    if (a_ != b_) {                                                                \
      fprintf(stderr, "  %s:%d: %s == %s failed: 0x%08x vs 0x%08x\n", __FILE__, __LINE__, #a, #b, a_, b_); \
      (*nvl_failed_)++;                                                            \
    }                                                                              \
  } while (0)

#endif
