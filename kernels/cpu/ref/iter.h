/* iter.h: an odometer over the elements of up to 3 tensor views of one shape (strides may be
 * 0 for broadcast dims), in row-major order. Used by the scalar reference kernels. */
#ifndef NVL_ITER_H
#define NVL_ITER_H
#include "tensor.h"

typedef struct {
  int ndim, nops;
  int64_t shape[NVL_MAX_DIMS], idx[NVL_MAX_DIMS];
  int64_t strides[3][NVL_MAX_DIMS];
  int64_t off[3];   /* current element offset of each operand */
  char *base[3];    /* storage base pointers */
  int esize[3];     /* element sizes */
} nvl_iter;

static inline void nvl_iter_init(nvl_iter *it, int nops, const nvl_tensor *const *ts) {
  it->ndim = ts[0]->ndim;
  it->nops = nops;
  for (int d = 0; d < it->ndim; d++) { it->shape[d] = ts[0]->shape[d]; it->idx[d] = 0; }
  for (int i = 0; i < nops; i++) {
    for (int d = 0; d < it->ndim; d++) it->strides[i][d] = ts[i]->strides[d];
    it->off[i] = ts[i]->offset;
    it->base[i] = (char *)ts[i]->storage->data;
    it->esize[i] = nvl_dtypes[ts[i]->dtype].elem_size;
  }
}

static inline void *nvl_iter_ptr(const nvl_iter *it, int i) { return it->base[i] + it->off[i] * it->esize[i]; }

static inline void nvl_iter_next(nvl_iter *it) {
  for (int d = it->ndim - 1; d >= 0; d--) {
    if (++it->idx[d] < it->shape[d]) {
      for (int i = 0; i < it->nops; i++) it->off[i] += it->strides[i][d];
      return;
    }
    it->idx[d] = 0;
    for (int i = 0; i < it->nops; i++) it->off[i] -= it->strides[i][d] * (it->shape[d] - 1);
  }
}
#endif
