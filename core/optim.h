/* optim.h: the optimizer's multi-tensor ops — one AdamW step of many tensors and the global
 * gradient norm of many tensors, each one kernel launch on a GPU, with the clip factor left on the
 * device (lua/nvlua/optim.lua drives them). Per element the AdamW arithmetic is nvl_adamw_step's
 * (core/layers.h), bit for bit; the norm is optim.grad_norm's (fp64 sums of squares).
 * Tensors: f32, contiguous, all on one device (the first param's); no tensor of a call may
 * overlap another (optim.AdamW's parameters and moments are distinct).
 * Not here: the single-tensor ops (layers.h), collectives (dist.h). */
#ifndef NVL_OPTIM_H
#define NVL_OPTIM_H
#include "tensor.h"
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NVL_OK when o holds valid AdamW options (lr, eps, weight_decay finite and >= 0, betas in [0, 1),
 * step >= 1), else an error naming op and the option: the check of nvl_adamw_step and nvl_adamw_multi. */
nvl_status nvl_adamw_opts_check(const char *op, const nvl_adamw_opts *o);

/* One AdamW step of count tensors: params[j] updated in place from grads[j] with moments m[j],
 * v[j] (one shape each), as nvl_adamw_step would, one tensor after the other. no_decay: NULL, or
 * count flags (nonzero: that tensor's weight decay is 0). state: NULL, or a norm state that
 * nvl_grad_norm_multi wrote: each grad is then scaled by its clip factor on the fly, rounded as
 * grad:mul_(factor) rounds (the grads themselves are left as they are). */
nvl_status nvl_adamw_multi(nvl_tensor *const *params, nvl_tensor *const *grads, nvl_tensor *const *m,
                           nvl_tensor *const *v, const int *no_decay, int64_t count, const nvl_adamw_opts *o,
                           const nvl_tensor *state);

/* state (NVL_NORM_STATE i64 elements on the grads' device, contiguous; zero-filled when new) =
 * the sum of squares of every element of grads[0..count) (fp64; on the CPU exactly optim's sum of
 * core.sumsq per tensor, in order) and the clip factor for max_norm (> 0): max_norm / (norm + 1e-6)
 * when norm = sqrt(sum) > max_norm and finite, else 1. Slots: backend.h NVL_NORM_*. Nothing is
 * read back: the caller copies state to the host only when it wants the norm. */
nvl_status nvl_grad_norm_multi(nvl_tensor *state, nvl_tensor *const *grads, int64_t count, double max_norm,
                               int take_nonfinite);
/* state's sum of squares = the sum, in order (fp64), of those of parts (count norm states, contiguous
 * i64 (count * NVL_NORM_STATE) on state's device: e.g. every rank's grad_norm_multi state of its
 * shards, all-gathered), and its clip factor for max_norm, as nvl_grad_norm_multi writes them; its
 * non-finite slot is left. Nothing is read back. */
nvl_status nvl_grad_norm_combine(nvl_tensor *state, const nvl_tensor *parts, double max_norm);
/* *flags = the non-finite flags (backend.h NVL_NONFINITE_*) of like's device, which are cleared:
 * what the quantizers, their amax passes and AdamW saw since the last take (grad_norm_multi takes
 * them too). A copy to the host on a GPU. */
nvl_status nvl_nonfinite_take(const nvl_tensor *like, uint32_t *flags);

#ifdef __cplusplus
}
#endif
#endif
