/* dispatch.c: table selection, the reference switch, call scratch, and the device queries of
 * device.h (see dispatch.h). The one place that knows which tables a build has. */
#include <stdio.h>
#include "device.h"
#include "dispatch.h"
#include "dist.h"

static _Thread_local int reference;

int nvl_use_reference(int on) {
  int prev = reference;
  reference = on != 0;
  return prev;
}

/* The table of device in this build, whatever the reference switch says; NULL if none. */
static const nvl_backend *table_of(nvl_device device) {
  if (device == NVL_CPU) return &nvl_backend_cpu;
#ifdef NVLUA_HAVE_CUDA
  if (device == NVL_CUDA) {
    nvl_dist_place_gpu(); /* before the CUDA runtime starts: each rank of a node its own GPU */
    return &nvl_backend_cuda;
  }
#endif
  return NULL;
}

static nvl_status not_built(const char *op) {
  return nvl_error(NVL_EUNSUPPORTED, "%s: cuda needs the CUDA backend, and nvlua was built without it (rebuild with "
                   "nvcc and -DNVLUA_CUDA=ON)", op);
}

const nvl_backend *nvl_backend_for(nvl_device device, const char *op) {
  if (device == NVL_CPU) return reference ? &nvl_backend_ref : &nvl_backend_cpu;
  const nvl_backend *be = table_of(device);
  if (!be) {
    not_built(op);
    return NULL;
  }
  if (reference) {
    nvl_error(NVL_EUNSUPPORTED, "%s: the reference kernels run on the CPU, and this op's tensors are on %s; move them "
              "with :cpu() or turn nv.use_reference off", op, be->name);
    return NULL;
  }
  return be;
}

const nvl_device_api *nvl_device_api_for(nvl_device device, const char *op) {
  const nvl_backend *be = table_of(device);
  if (!be || !be->device_api) {
    if (!be) not_built(op);
    else nvl_error(NVL_EUNSUPPORTED, "%s: %s has no device API", op, be->name);
    return NULL;
  }
  return be->device_api;
}

nvl_status nvl_unsupported(const nvl_backend *be, const char *op) {
  return nvl_error(NVL_EUNSUPPORTED, "%s: not supported on %s%s", op, be->name,
                   be->device == NVL_CPU ? "" : " yet; copy the tensors with :cpu() first");
}

/* ---- call scratch --------------------------------------------------------------------------- */

static nvl_status call_scratch(nvl_kctx *k, size_t bytes, void **p) {
  nvl_call *c = k->owner;
  if (c->n == NVL_SCRATCH_MAX)
    return nvl_error(NVL_EINVAL, "internal error: a kernel asked for more than %d scratch buffers", NVL_SCRATCH_MAX);
  int64_t n = (int64_t)(bytes ? bytes : 1);
  nvl_tensor *t = &c->scratch[c->n];
  NVL_TRY(nvl_tensor_empty(t, NVL_U8, c->device, 1, &n));
  c->n++;
  *p = nvl_tensor_data(t);
  return NVL_OK;
}

void nvl_call_begin(nvl_call *c, nvl_device device, int dev) {
  c->k.dev = dev;
  c->k.scratch = call_scratch;
  c->k.owner = c;
  c->device = device;
  c->n = 0;
}

void nvl_call_end(nvl_call *c) {
  for (int i = 0; i < c->n; i++) nvl_tensor_release(&c->scratch[i]);
  c->n = 0;
}

/* ---- device queries (device.h) -------------------------------------------------------------- */

static const nvl_device_api *api_quiet(nvl_device device) {
  const nvl_backend *be = table_of(device);
  return be ? be->device_api : NULL;
}

int nvl_device_compiled(nvl_device device) { return api_quiet(device) != NULL; }

int nvl_device_count(nvl_device device) {
  const nvl_device_api *a = api_quiet(device);
  return a ? a->count() : 0;
}

const char *nvl_device_unavailable_reason(nvl_device device) {
  const nvl_device_api *a = api_quiet(device);
  return a ? a->unavailable_reason() : "nvlua was built without CUDA";
}

nvl_status nvl_device_props_of(nvl_device device, int dev, nvl_device_props *p) {
  const nvl_device_api *a = nvl_device_api_for(device, "device_props");
  return a ? a->props(dev, p) : NVL_EUNSUPPORTED;
}

int nvl_device_runtime_version(nvl_device device) {
  const nvl_device_api *a = api_quiet(device);
  return a ? a->runtime_version() : 0;
}

size_t nvl_device_blas_version(nvl_device device) {
  const nvl_device_api *a = api_quiet(device);
  return a ? a->blas_version() : 0;
}

nvl_status nvl_device_synchronize(nvl_device device, int dev) {
  const nvl_device_api *a = nvl_device_api_for(device, "synchronize");
  return a ? a->synchronize(dev) : NVL_EUNSUPPORTED;
}

int nvl_device_set_sync(nvl_device device, int on) {
  const nvl_device_api *a = api_quiet(device);
  return a ? a->set_sync(on) : 1;
}

nvl_status nvl_device_memory_stats(nvl_device device, int dev, nvl_device_mem_stats *s) {
  const nvl_device_api *a = nvl_device_api_for(device, "memory_stats");
  return a ? a->memory_stats(dev, s) : NVL_EUNSUPPORTED;
}

void nvl_device_empty_cache(nvl_device device, int dev) {
  const nvl_device_api *a = api_quiet(device);
  if (a) a->empty_cache(dev);
}

int nvl_device_set_poison(nvl_device device, int byte) {
  const nvl_device_api *a = api_quiet(device);
  return a ? a->set_poison(byte) : -1;
}

nvl_status nvl_device_timer_start(nvl_device device, int dev) {
  const nvl_device_api *a = nvl_device_api_for(device, "timer_start");
  return a ? a->timer_start(dev) : NVL_EUNSUPPORTED;
}

nvl_status nvl_device_timer_stop(nvl_device device, int dev, double *ms) {
  const nvl_device_api *a = nvl_device_api_for(device, "timer_stop");
  if (ms) *ms = 0;
  return a ? a->timer_stop(dev, ms) : NVL_EUNSUPPORTED;
}

nvl_gemm_path nvl_device_gemm_path(nvl_device device, nvl_dtype fa, nvl_dtype fb, int dev, char *detail, size_t n) {
  const nvl_device_api *a = nvl_device_api_for(device, "gemm_path");
  if (!a) {
    if (detail && n) snprintf(detail, n, "%s", nvl_last_error());
    return NVL_GEMM_UNSUPPORTED;
  }
  return a->gemm_path(fa, fb, dev, detail, n);
}
