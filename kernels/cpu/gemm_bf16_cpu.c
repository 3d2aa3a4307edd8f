/* gemm_bf16_cpu.c: bf16 GEMMs (f32 or bf16 results) and f32 matmuls through oneDNN's matmul (see
 * gemm_bf16_cpu.h). One CPU engine and stream, created at the first use; matmul primitives cached by
 * kind and shape (M, N, K, ldc, strides), at most NVL_DNNL_CACHE of them, least recently used evicted.
 * One mutex guards the cache and the stream, so concurrent callers run one after the other (each
 * matmul uses every core through OpenMP). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/gemm_bf16_cpu.h"

#ifdef NVLUA_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

static atomic_llong path_calls[NVL_CPU_GEMM_ROUTE_COUNT];

void nvl_cpu_gemm_route_count(nvl_cpu_gemm_route p) { atomic_fetch_add(&path_calls[p], 1); }
int64_t nvl_cpu_gemm_route_calls(nvl_cpu_gemm_route p) { return (int64_t)atomic_load(&path_calls[p]); }

static atomic_int enabled = 1; /* the in-process switch */

int nvl_gemm_bf16_switch(int on) {
  int prev = atomic_load(&enabled);
  if (on >= 0) atomic_store(&enabled, on ? 1 : 0);
  return prev;
}

#ifndef NVLUA_HAVE_DNNL

int nvl_gemm_bf16_ready(void) { return 0; }
const char *nvl_gemm_bf16_info(void) { return "oneDNN: not compiled in (bf16 GEMMs on sgemm)"; }
nvl_status nvl_gemm_bf16_abt_cpu(float *c, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M, int64_t N,
                                 int64_t K) {
  return nvl_error(NVL_EUNSUPPORTED, "bf16 GEMM: built without oneDNN");
}
nvl_status nvl_gemm_bf16_abt_bf16_cpu(uint16_t *c16, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M,
                                      int64_t N, int64_t K, float alpha) {
  return nvl_error(NVL_EUNSUPPORTED, "bf16 GEMM: built without oneDNN");
}
nvl_status nvl_gemm_f32_dnnl_cpu(float *c, const float *a, int64_t rsa, int64_t csa, const float *b, int64_t rsb,
                                 int64_t csb, int64_t M, int64_t N, int64_t K) {
  return NVL_EUNSUPPORTED;
}

#else

#define NVL_DNNL_CACHE 64

typedef struct {
  int64_t M, N, K, ldc;
  int64_t st[4]; /* f32 operands (f32 set): a's and b's row and column strides */
  int f32;       /* f32 operands and result (else bf16 operands) */
  int out16;     /* the result in bf16 (else f32), times a run-time scale */
  uint64_t used; /* LRU clock; 0: empty */
  dnnl_primitive_t prim;
  dnnl_memory_desc_t a_md, b_md, c_md;
} cache_entry;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int usable;        /* engine and stream exist, the CPU has bf16 units, NVLUA_DNNL != "0" */
static char info[256];    /* nvl_gemm_bf16_info */
static char impl[96];     /* the implementation oneDNN picked for the last new primitive */
static dnnl_engine_t engine;
static dnnl_stream_t stream;
static cache_entry cache[NVL_DNNL_CACHE];
static uint64_t clock_now;

static dnnl_status_t lookup(cache_entry **out, const cache_entry *key);

static const char *isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
  case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
  case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
  case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
  case dnnl_cpu_isa_avx512_core: return "avx512_core";
  case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
  case dnnl_cpu_isa_avx2: return "avx2";
  default: return "other";
  }
}

static void init(void) {
  const dnnl_version_t *v = dnnl_version();
  dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  int bf16_units = (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
  const char *env = getenv("NVLUA_DNNL");
  char head[64];
  snprintf(head, sizeof head, "oneDNN %d.%d.%d", v->major, v->minor, v->patch);
  if (env && strcmp(env, "0") == 0) {
    snprintf(info, sizeof info, "%s, not used (NVLUA_DNNL=0): bf16 GEMMs on sgemm", head);
    return;
  }
  if (!bf16_units) {
    snprintf(info, sizeof info, "%s, not used (the CPU has no bf16 units, ISA %s): bf16 GEMMs on sgemm", head,
             isa_name(isa));
    return;
  }
  if (dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success ||
      dnnl_stream_create(&stream, engine, dnnl_stream_default_flags) != dnnl_success) {
    snprintf(info, sizeof info, "%s, not used (no CPU engine): bf16 GEMMs on sgemm", head);
    return;
  }
  usable = 1;
  snprintf(info, sizeof info, "%s, bf16 GEMMs on %s", head, isa_name(isa));
}

int nvl_gemm_bf16_ready(void) {
  pthread_once(&once, init);
  return usable && atomic_load(&enabled);
}

const char *nvl_gemm_bf16_info(void) {
  pthread_once(&once, init);
  static char line[sizeof info + sizeof impl + 8];
  pthread_mutex_lock(&lock);
  cache_entry *e;
  if (usable && !impl[0]) { /* names the implementation oneDNN dispatches to */
    cache_entry key = {.M = 256, .N = 256, .K = 256, .ldc = 256};
    lookup(&e, &key);
  }
  if (usable && impl[0]) snprintf(line, sizeof line, "%s (%s)", info, impl);
  else snprintf(line, sizeof line, "%s", info);
  pthread_mutex_unlock(&lock);
  return line;
}

/* a new primitive for e's shape: A (M, K) row-major, B as (K, N) with strides (1, K) — b's rows
 * read as columns — and C (M, N) with row stride ldc. */
static dnnl_status_t create(cache_entry *e) {
  dnnl_dims_t ad = {e->M, e->K}, as = {e->K, 1}, bd = {e->K, e->N}, bs = {1, e->K}, cd = {e->M, e->N},
              cs = {e->ldc, 1};
  if (e->f32) as[0] = e->st[0], as[1] = e->st[1], bs[0] = e->st[2], bs[1] = e->st[3];
  dnnl_data_type_t in = e->f32 ? dnnl_f32 : dnnl_bf16;
  dnnl_status_t st;
  if ((st = dnnl_memory_desc_init_by_strides(&e->a_md, 2, ad, in, as)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_strides(&e->b_md, 2, bd, in, bs)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_strides(&e->c_md, 2, cd, e->out16 ? dnnl_bf16 : dnnl_f32, cs)) != dnnl_success)
    return st;
  dnnl_matmul_desc_t md;
  if ((st = dnnl_matmul_desc_init(&md, &e->a_md, &e->b_md, NULL, &e->c_md)) != dnnl_success) return st;
  dnnl_primitive_attr_t attr = NULL; /* bf16 out: the fp32 sum times a scale given at each run, then rounded */
  if (e->out16) {
    if ((st = dnnl_primitive_attr_create(&attr)) != dnnl_success) return st;
    if ((st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &DNNL_RUNTIME_F32_VAL)) != dnnl_success) {
      dnnl_primitive_attr_destroy(attr);
      return st;
    }
  }
  dnnl_primitive_desc_t pd;
  st = dnnl_primitive_desc_create(&pd, &md, attr, engine, NULL);
  if (attr) dnnl_primitive_attr_destroy(attr);
  if (st != dnnl_success) return st;
  const char *name = NULL;
  if (!e->f32 && dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name) == dnnl_success && name)
    snprintf(impl, sizeof impl, "%s", name);
  st = dnnl_primitive_create(&e->prim, pd);
  dnnl_primitive_desc_destroy(pd);
  return st;
}

/* the cached entry for the shape, created (evicting the least recently used) when missing */
static int same_key(const cache_entry *e, const cache_entry *k) {
  return e->M == k->M && e->N == k->N && e->K == k->K && e->ldc == k->ldc && e->out16 == k->out16 &&
         e->f32 == k->f32 && (!k->f32 || memcmp(e->st, k->st, sizeof e->st) == 0);
}

/* the cached entry for key's shape and kind, created (evicting the least recently used) when missing */
static dnnl_status_t lookup(cache_entry **out, const cache_entry *key) {
  cache_entry *lru = &cache[0];
  for (int i = 0; i < NVL_DNNL_CACHE; i++) {
    cache_entry *e = &cache[i];
    if (e->used && same_key(e, key)) {
      e->used = ++clock_now;
      *out = e;
      return dnnl_success;
    }
    if (e->used < lru->used) lru = e;
  }
  if (lru->used) dnnl_primitive_destroy(lru->prim);
  memset(lru, 0, sizeof *lru);
  *lru = *key;
  lru->used = 0;
  lru->prim = NULL;
  dnnl_status_t st = create(lru);
  if (st != dnnl_success) {
    memset(lru, 0, sizeof *lru);
    return st;
  }
  lru->used = ++clock_now;
  *out = lru;
  return dnnl_success;
}

static dnnl_status_t run(cache_entry *e, void *c, const void *a, const void *b, float scale) {
  dnnl_memory_t m[4] = {NULL, NULL, NULL, NULL};
  dnnl_status_t st;
  dnnl_memory_desc_t s_md;
  dnnl_dims_t one = {1};
  if ((st = dnnl_memory_create(&m[0], &e->a_md, engine, (void *)a)) == dnnl_success &&
      (st = dnnl_memory_create(&m[1], &e->b_md, engine, (void *)b)) == dnnl_success &&
      (st = dnnl_memory_create(&m[2], &e->c_md, engine, c)) == dnnl_success &&
      (!e->out16 || ((st = dnnl_memory_desc_init_by_tag(&s_md, 1, one, dnnl_f32, dnnl_a)) == dnnl_success &&
                     (st = dnnl_memory_create(&m[3], &s_md, engine, &scale)) == dnnl_success))) {
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, m[0]}, {DNNL_ARG_WEIGHTS, m[1]}, {DNNL_ARG_DST, m[2]},
                               {DNNL_ARG_ATTR_OUTPUT_SCALES, m[3]}};
    st = dnnl_primitive_execute(e->prim, stream, e->out16 ? 4 : 3, args);
    if (st == dnnl_success) st = dnnl_stream_wait(stream);
  }
  for (int i = 0; i < 4; i++)
    if (m[i]) dnnl_memory_destroy(m[i]);
  return st;
}

static nvl_status gemm(void *c, int out16, float scale, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M,
                       int64_t N, int64_t K) {
  pthread_once(&once, init);
  if (!usable) return nvl_error(NVL_EUNSUPPORTED, "bf16 GEMM: %s", info);
  if (M <= 0 || N <= 0 || K <= 0 || ldc < N)
    return nvl_error(NVL_EINVAL, "bf16 GEMM: bad shape M=%lld N=%lld K=%lld ldc=%lld", (long long)M, (long long)N,
                     (long long)K, (long long)ldc);
  pthread_mutex_lock(&lock);
  cache_entry *e = NULL, key = {.M = M, .N = N, .K = K, .ldc = ldc, .out16 = out16};
  dnnl_status_t st = lookup(&e, &key);
  if (st == dnnl_success) st = run(e, c, a, b, scale);
  pthread_mutex_unlock(&lock);
  if (st != dnnl_success)
    return nvl_error(NVL_EDEVICE, "bf16 GEMM: oneDNN matmul M=%lld N=%lld K=%lld failed (status %d); NVLUA_DNNL=0 "
                     "runs the sgemm path", (long long)M, (long long)N, (long long)K, (int)st);
  return NVL_OK;
}

nvl_status nvl_gemm_bf16_abt_cpu(float *c, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M, int64_t N,
                                 int64_t K) {
  return gemm(c, 0, 1.0f, ldc, a, b, M, N, K);
}

nvl_status nvl_gemm_bf16_abt_bf16_cpu(uint16_t *c16, int64_t ldc, const uint16_t *a, const uint16_t *b, int64_t M,
                                      int64_t N, int64_t K, float alpha) {
  return gemm(c16, 1, alpha, ldc, a, b, M, N, K);
}
nvl_status nvl_gemm_f32_dnnl_cpu(float *c, const float *a, int64_t rsa, int64_t csa, const float *b, int64_t rsb,
                                 int64_t csb, int64_t M, int64_t N, int64_t K) {
  if (!nvl_gemm_bf16_ready() || M <= 0 || N <= 0 || K <= 0) return NVL_EUNSUPPORTED;
  pthread_mutex_lock(&lock);
  cache_entry *e = NULL, key = {.M = M, .N = N, .K = K, .ldc = N, .f32 = 1, .st = {rsa, csa, rsb, csb}};
  dnnl_status_t st = lookup(&e, &key);
  if (st == dnnl_success) st = run(e, c, a, b, 1.0f);
  pthread_mutex_unlock(&lock);
  if (st != dnnl_success)
    return nvl_error(NVL_EDEVICE, "f32 GEMM: oneDNN matmul M=%lld N=%lld K=%lld failed (status %d); NVLUA_DNNL=0 "
                     "runs sgemm", (long long)M, (long long)N, (long long)K, (int)st);
  return NVL_OK;
}
#endif
