/* main.c: runs every NVL_TEST registered by the files in tests/c/. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "info.h"
#include "unit.h"

#define NVL_UNIT_MAX 512
static struct { const char *name; nvl_unit_fn fn; } tests[NVL_UNIT_MAX];
static int ntests;

void nvl_unit_register(const char *name, nvl_unit_fn fn) {
  if (ntests < NVL_UNIT_MAX) { tests[ntests].name = name; tests[ntests].fn = fn; ntests++; }
}

static int by_name(const void *a, const void *b) {
  const char *x = *(const char *const *)a, *y = *(const char *const *)b;
  return strcmp(x, y);
}

int main(int argc, char **argv) {
  int passed = 0, failed = 0;
  nvl_fp_env_ieee("at start-up"); /* IEEE subnormals, whatever a library's constructor set (info.h) */
  qsort(tests, ntests, sizeof tests[0], by_name);
  for (int i = 0; i < ntests; i++) {
    if (argc > 1 && !strstr(tests[i].name, argv[1])) continue;
    int f = 0;
    tests[i].fn(&f);
    /* a test (or a library it calls) that leaves flush-to-zero or denormals-are-zero on would change
     * every later test's subnormal arithmetic: a failure of its own, and the state is cleared */
    const int env = nvl_fp_env_ieee(NULL);
    if (env) {
      printf("  %s left %s%s%s set\n", tests[i].name, env & NVL_FP_FTZ ? "FTZ" : "", env == (NVL_FP_FTZ | NVL_FP_DAZ) ? "+" : "",
             env & NVL_FP_DAZ ? "DAZ" : "");
      f = 1;
    }
    printf("%s %s\n", f ? "FAIL" : "ok  ", tests[i].name);
    fflush(stdout);
    if (f) failed++; else passed++;
  }
  printf("c_unit: %d passed, %d failed, 0 skipped\n", passed, failed);
  return failed ? 1 : 0;
}
