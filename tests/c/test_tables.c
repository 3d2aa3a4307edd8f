/* test_tables.c: the traits rows and the kernel tables are complete (the check a static assert
 * cannot make on designated initializers): every dtype has its row, every quantized row is
 * consistent, and every backend table (and the CUDA one, in CUDA builds) has a quantize and a GEMM
 * row for every format nv.quantize takes, and the layer kernels. A format added to the enum but
 * not to a table fails here. */
#include <string.h>
#include "backend.h"
#include "unit.h"

NVL_TEST(traits_rows_complete) {
  for (int i = 0; i < NVL_DTYPE_COUNT; i++) {
    const nvl_dtype_traits *t = &nvl_dtypes[i];
    CHECK(t->name != NULL);
    if (!t->name) continue;
    CHECK(nvl_dtype_from_name(t->name) == (nvl_dtype)i);
    CHECK(t->bits > 0 && t->bits_per_elem >= t->bits);
    if (!t->is_quantized) continue;
    CHECK(t->is_float && t->elem >= 0 && t->elem < NVL_ELEM_COUNT);
    CHECK(t->scale > NVL_SCALE_NONE && t->scale < NVL_SCALE_KIND_COUNT && t->scale_rule != NULL);
    CHECK(t->bits == (t->elem == NVL_ELEM_E2M1 ? 4 : 8));
    CHECK(t->layout > NVL_LAYOUT_NONE && t->layout < NVL_LAYOUT_COUNT);
    if (t->scale == NVL_SCALE_TENSOR) CHECK(t->block == 0 && t->bits_per_elem == t->bits && t->enc_scale && t->dec_scale);
    else CHECK(t->block > 0 && t->bits_per_elem == t->bits + (double)t->scale_bits / t->block);
    CHECK(t->global_amax == (t->enc_scale != NULL));
    CHECK(t->sr == (t->elem == NVL_ELEM_E2M1));
  }
}

static void check_table(int *nvl_failed_, const nvl_backend *be, int host) {
  for (int i = 0; i < NVL_DTYPE_COUNT; i++) {
    if (!nvl_dtypes[i].is_float) continue;
    const nvl_format_kernels *f = &be->formats[i];
    if (!f->quantize || !f->qgemm) fprintf(stderr, "  %s table: no row for %s\n", be->name, nvl_dtypes[i].name);
    CHECK(f->quantize != NULL && f->qgemm != NULL);
    if (host) CHECK(f->dequantize != NULL); /* device q: core decodes a host copy */
  }
  CHECK(be->gam_quantize != NULL); /* GAM scaling (core/gam.h): every table has its own kernel */
  CHECK(be->layers != NULL);
  if (be->layers) CHECK(be->layers->attention_forward && be->layers->cross_entropy && be->layers->adamw_step);
}

NVL_TEST(backend_tables_complete) {
  check_table(nvl_failed_, &nvl_backend_ref, 1);
  check_table(nvl_failed_, &nvl_backend_cpu, 1);
  CHECK(nvl_backend_cpu.fallback == &nvl_backend_ref);
  /* the reference table is complete on its own: it is every other table's oracle */
  const nvl_layer_kernels *r = nvl_backend_ref.layers;
  CHECK(r->embedding_forward && r->embedding_backward && r->rmsnorm_forward && r->rmsnorm_backward &&
        r->rope_tables && r->rope_forward && r->rope_backward && r->swiglu_forward && r->swiglu_backward &&
        r->sumsq && r->attention_backward);
  CHECK(nvl_backend_ref.copy && nvl_backend_ref.fill && nvl_backend_ref.binary && nvl_backend_ref.binary_scalar &&
        nvl_backend_ref.unary && nvl_backend_ref.reduce_all && nvl_backend_ref.reduce_last && nvl_backend_ref.matmul &&
        nvl_backend_ref.axpy && nvl_backend_ref.scale && nvl_backend_ref.arange && nvl_backend_ref.random &&
        nvl_backend_ref.allclose && nvl_backend_ref.rht);
#ifdef NVLUA_HAVE_CUDA
  check_table(nvl_failed_, &nvl_backend_cuda, 0);
  CHECK(nvl_backend_cuda.device_api != NULL);
#endif
}
