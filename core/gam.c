/* gam.c: the core entry of GAM scaling (gam.h): argument checks, the outputs, one call of the
 * backend table's gam_quantize. */
#include "gam.h"

#include <limits.h>

#include "dispatch.h"

#define DESC(t, buf) nvl_tensor_desc((t), (buf), sizeof(buf))

nvl_status nvl_gam_quantize(nvl_tensor *codes, nvl_tensor *scales, nvl_tensor *mant, const nvl_tensor *x,
                            int64_t block, int64_t group_blocks, nvl_elem elem) {
  const char *op = "gam_quantize";
  char s1[160];
  const nvl_backend *be;
  if (!codes || !scales || !mant || !x) return nvl_error(NVL_EINVAL, "%s: an argument is NULL", op);
  NVL_TRY(nvl_tensor_check_live(x, op));
  if (x->dtype != NVL_F32 || x->ndim != 2)
    return nvl_error(NVL_EINVAL, "%s: x must be a 2-D f32 tensor, got %s", op, DESC(x, s1));
  if (elem != NVL_ELEM_E4M3 && elem != NVL_ELEM_E5M2)
    return nvl_error(NVL_EINVAL, "%s: GAM scaling takes an fp8 element format (e4m3, e5m2), not %d", op, (int)elem);
  const int64_t rows = x->shape[0], K = x->shape[1];
  if (block < 1 || block > INT_MAX || K % block != 0)
    return nvl_error(NVL_EINVAL, "%s: block %lld must divide the last dim of x %s", op, (long long)block, DESC(x, s1));
  const int64_t nblocks = rows * (K / block);
  if (group_blocks < 0) return nvl_error(NVL_EINVAL, "%s: group of %lld blocks", op, (long long)group_blocks);
  const int64_t G = group_blocks ? group_blocks : nblocks;
  if (nblocks && nblocks % G)
    return nvl_error(NVL_EINVAL, "%s: %lld blocks of 1x%lld do not split into groups of %lld blocks", op,
                     (long long)nblocks, (long long)block, (long long)G);
  NVL_PICK(be, x, gam_quantize, op);
  nvl_tensor cx = nvl_tensor_null(), c = nvl_tensor_null(), s = nvl_tensor_null(), m = nvl_tensor_null();
  int64_t cshape[2] = {rows, K}, sshape[2] = {rows, K / block}, mshape[1] = {nblocks ? nblocks / G : 0};
  nvl_status st = nvl_tensor_contiguous(&cx, x);
  if (st == NVL_OK) st = nvl_tensor_empty(&c, NVL_U8, x->device, 2, cshape);
  if (st == NVL_OK) st = nvl_tensor_empty(&s, NVL_U8, x->device, 2, sshape);
  if (st == NVL_OK) st = nvl_tensor_empty(&m, NVL_F32, x->device, 1, mshape);
  if (st == NVL_OK && nblocks)
    st = NVL_CALL(be, x, gam_quantize, nvl_tensor_data(&c), nvl_tensor_data(&s), nvl_tensor_data(&m),
                  nvl_tensor_data(&cx), rows, K, block, G, elem);
  nvl_tensor_release(&cx);
  if (st == NVL_OK) {
    *codes = c;
    *scales = s;
    *mant = m;
  } else {
    nvl_tensor_release(&c);
    nvl_tensor_release(&s);
    nvl_tensor_release(&m);
  }
  return st;
}
