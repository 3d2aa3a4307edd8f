/* tensor.h: the one tensor struct, its refcounted storage, and views.
 * A tensor is (dtype, device, ndim, shape, strides, offset, storage). Shapes are outermost
 * first; strides and offset count elements, not bytes. Views share storage and bump its
 * refcount; nvl_tensor_release drops one reference. Dims are 0-based here (Lua's 1-based dims
 * are converted once, in the binding).
 * Every tensor, a view too, keeps one invariant: sizes >= 0, their product (a 0 counted as 1) at
 * most NVL_MAX_NUMEL (nvl.h), and every element inside its storage. Constructors check it
 * with nvl_shape_numel, views with nvl_tensor_check_bounds, so kernels may trust any tensor's
 * numel, strides and offset, and numel * element size never overflows.
 * Not here: arithmetic (ops.h), Lua (lua/bind/). */
#ifndef NVL_TENSOR_H
#define NVL_TENSOR_H
#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { NVL_CPU = 0, NVL_CUDA = 1, NVL_DEVICE_COUNT } nvl_device;

typedef struct {
  int refcount;
  nvl_device device;
  int device_index; /* GPU ordinal for NVL_CUDA */
  size_t bytes;
  void *data;
} nvl_storage;

typedef struct {
  nvl_dtype dtype;
  nvl_device device;
  int ndim;
  int64_t shape[NVL_MAX_DIMS];
  int64_t strides[NVL_MAX_DIMS];
  int64_t offset;
  nvl_storage *storage; /* NULL: empty or freed */
} nvl_tensor;

/* A tensor with no storage (safe to release). */
static inline nvl_tensor nvl_tensor_null(void) {
  nvl_tensor t;
  t.dtype = NVL_F32; t.device = NVL_CPU; t.ndim = 0; t.offset = 0; t.storage = NULL;
  for (int i = 0; i < NVL_MAX_DIMS; i++) { t.shape[i] = 1; t.strides[i] = 0; }
  return t;
}

/* *numel = the product of shape; an error naming op if ndim is out of 0..NVL_MAX_DIMS, a size is
 * negative, or the sizes (a 0 counted as 1) multiply past NVL_MAX_NUMEL. */
nvl_status nvl_shape_numel(const char *op, int ndim, const int64_t *shape, int64_t *numel);
/* An error naming op unless t's shape passes nvl_shape_numel and every element of the view
 * (offset + sum of index * stride) lies within its storage's bytes. */
nvl_status nvl_tensor_check_bounds(const nvl_tensor *t, const char *op);

/* New contiguous tensor, contents uninitialised. out must be null/released. A shape too large to
 * allocate is an error "empty: cannot allocate N bytes ...". */
nvl_status nvl_tensor_empty(nvl_tensor *out, nvl_dtype dt, nvl_device dev, int ndim, const int64_t *shape);
/* Drop this tensor's reference to its storage; out becomes null. Safe on a null tensor. */
void nvl_tensor_release(nvl_tensor *t);
/* out = a new reference to the same storage/view as t. */
void nvl_tensor_share(nvl_tensor *out, const nvl_tensor *t);
/* Error (NVL_ESTATE) if t has been freed; op names the caller. */
nvl_status nvl_tensor_check_live(const nvl_tensor *t, const char *op);
/* 1 if live a and b are on one device (for CUDA: one GPU). */
int nvl_tensor_same_device(const nvl_tensor *a, const nvl_tensor *b);

int64_t nvl_tensor_numel(const nvl_tensor *t);
/* numel * the element size: the bytes of t's elements (contiguous), never overflowing (see above). */
size_t nvl_tensor_nbytes(const nvl_tensor *t);
int nvl_tensor_is_contiguous(const nvl_tensor *t);
/* Address of element 0 of the view. */
void *nvl_tensor_data(const nvl_tensor *t);
/* Address of the element at a 0-based multi-index. */
void *nvl_tensor_ptr(const nvl_tensor *t, const int64_t *idx);
/* "[2,3]" into buf. */
const char *nvl_shape_str(const nvl_tensor *t, char *buf, size_t n);
/* "f32 [2,3] cpu" style description for error messages. */
const char *nvl_tensor_desc(const nvl_tensor *t, char *buf, size_t n);

/* ---- views (share storage; out must be null) ---- */
/* Reshape without copying; one entry may be -1. Fails if the strides do not allow it. */
nvl_status nvl_tensor_view(nvl_tensor *out, const nvl_tensor *t, int ndim, const int64_t *shape);
nvl_status nvl_tensor_transpose(nvl_tensor *out, const nvl_tensor *t, int d0, int d1);
nvl_status nvl_tensor_permute(nvl_tensor *out, const nvl_tensor *t, const int *perm);
nvl_status nvl_tensor_narrow(nvl_tensor *out, const nvl_tensor *t, int dim, int64_t start, int64_t len);
/* Removes dim. */
nvl_status nvl_tensor_select(nvl_tensor *out, const nvl_tensor *t, int dim, int64_t index);
/* Broadcast view to ndim/shape (stride 0 on expanded dims). */
nvl_status nvl_tensor_expand(nvl_tensor *out, const nvl_tensor *t, int ndim, const int64_t *shape);

/* ---- copies ---- */
/* dst <- src, src broadcast to dst's shape, converting dtype; across devices too. */
nvl_status nvl_tensor_copy(nvl_tensor *dst, const nvl_tensor *src);
/* out = contiguous copy of t (on dev, as dt). */
nvl_status nvl_tensor_clone_to(nvl_tensor *out, const nvl_tensor *t, nvl_dtype dt, nvl_device dev);
/* out = t itself (shared) if contiguous, else a contiguous copy. */
nvl_status nvl_tensor_contiguous(nvl_tensor *out, const nvl_tensor *t);
/* out = t reshaped: a view when possible, a copy otherwise. */
nvl_status nvl_tensor_reshape(nvl_tensor *out, const nvl_tensor *t, int ndim, const int64_t *shape);

/* Broadcast shapes of a and b (numpy rules) into shape/ndim; op names the caller. */
nvl_status nvl_broadcast_shape(const nvl_tensor *a, const nvl_tensor *b, const char *op, int *ndim, int64_t *shape);

/* Bytes currently allocated per device (live storages). */
size_t nvl_memory_live(nvl_device dev);
/* Peak bytes per device since start. */
size_t nvl_memory_peak(nvl_device dev);
/* Restart the peak from the bytes live now. */
void nvl_memory_reset_peak(nvl_device dev);
/* Live storage count per device. */
int64_t nvl_memory_count(nvl_device dev);
/* Bytes of freed host buffers kept for reuse (not counted as live), and giving them back. */
size_t nvl_memory_cached(void);
void nvl_memory_empty_cache(void);

#ifdef __cplusplus
}
#endif
#endif
