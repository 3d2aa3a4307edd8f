/* dispatch.h: how core/ picks a kernel table and runs one entry (core-private; DESIGN.md
 * "Dispatch"). The table comes from the tensors' device, or is the scalar reference while
 * nv.use_reference(true) is on; an entry a table leaves empty is a clean "<op>: not supported on
 * <backend>" error. Scratch that an entry asks for (nvl_kctx.scratch) is allocated here, on the
 * op's device, and released when the call returns.
 * Not here: the kernels (kernels/), the tables' type (backend.h). */
#ifndef NVL_DISPATCH_H
#define NVL_DISPATCH_H
#include "backend.h"

#define NVL_SCRATCH_MAX 8

typedef struct {
  nvl_kctx k;
  nvl_device device;
  int n;
  nvl_tensor scratch[NVL_SCRATCH_MAX];
} nvl_call;

/* The compute table for tensors on device (or the reference, see above), or NULL with an error
 * naming op (no table: a build without CUDA; the reference asked for on a GPU). */
const nvl_backend *nvl_backend_for(nvl_device device, const char *op);
/* The table of t's device (t live). */
static inline const nvl_backend *nvl_backend_of(const nvl_tensor *t, const char *op) {
  return nvl_backend_for(t->device, op);
}
/* The device API of device (never NULL for the host's own memory: returns NULL and sets an error
 * when device has no table). */
const nvl_device_api *nvl_device_api_for(nvl_device device, const char *op);
/* "op: not supported on <backend>" as an NVL_EUNSUPPORTED error. */
nvl_status nvl_unsupported(const nvl_backend *be, const char *op);

/* Start / finish a call of one entry on device (GPU ordinal dev). */
void nvl_call_begin(nvl_call *c, nvl_device device, int dev);
void nvl_call_end(nvl_call *c);

/* be = the table for device with a non-empty `entry` (its own, or its fallback's), or return
 * the error, which names the device's table. */
#define NVL_PICK_DEV(be, device, entry, op)                               \
  do {                                                                    \
    const nvl_backend *nvl_be_ = nvl_backend_for((device), (op));        \
    if (!nvl_be_) return NVL_EUNSUPPORTED;                                \
    (be) = nvl_be_;                                                       \
    if (!(be)->entry && (be)->fallback) (be) = (be)->fallback;            \
    if (!(be)->entry) return nvl_unsupported(nvl_be_, (op));              \
  } while (0)
/* The same for the device of tensor t. */
#define NVL_PICK(be, t, entry, op) NVL_PICK_DEV(be, (t)->device, entry, op)

/* Run be->entry(&ctx, ...) for tensors like t (its device and GPU), scratch released after. */
#define NVL_CALL(be, t, entry, ...)                                                        \
  ({                                                                                       \
    nvl_call c_;                                                                           \
    nvl_call_begin(&c_, (t)->device, (t)->storage ? (t)->storage->device_index : 0);       \
    nvl_status s_ = (be)->entry(&c_.k, __VA_ARGS__);                                       \
    nvl_call_end(&c_);                                                                     \
    s_;                                                                                    \
  })
#endif
