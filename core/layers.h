/* layers.h: the layer library's C contracts — forward/backward pairs for Llama's layers, the
 * fused cross-entropy, AdamW and the gradient-norm helpers (DESIGN.md "Layers").
 * Tensors on one device (the CPU, or a GPU), f32, contiguous unless said otherwise; shapes outermost
 * first. Activations (x, out, dout, dx, gate, up, dgate, dup, q, k, v, dq, dk, dv) may instead be
 * bf16, all of one call alike: the op is then its f32 form on the inputs widened exactly, each
 * activation output rounded once to bf16 (core/NUMERICS.md §11); parameters, parameter gradients,
 * rstd, lse, cos and sin stay f32.
 *   N tokens (B*T flattened), C model width, V vocabulary, B batch, T sequence, H heads,
 *   Hq query heads, Hkv key/value heads (Hq % Hkv == 0), D head dim, F FFN width.
 * Contract of every backward: parameter gradients ACCUMULATE (+=), activation gradients are
 * WRITTEN (=). Outputs of forward and activation gradients are allocated here (out must be
 * null); parameter-gradient tensors are passed in, already allocated (zeroed by the caller).
 * Each function validates shapes and dtypes and returns a status whose message names the op,
 * the shapes and the dtypes.
 * Not here: Linear (Lua, through quantize + qmatmul so a recipe picks each operand's format),
 * residual adds (ops.h), the Lua modules (lua/nvlua/nn.lua). */
#ifndef NVL_LAYERS_H
#define NVL_LAYERS_H
#include "ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- embedding -------------------------------------------------------------------------------- */
/* out (N, C) = weight[ids[n], :]; ids (N) i64 in [0, V), weight (V, C). out is f32; _as: of dtype
 * dt, f32 or bf16 (the rows rounded once). */
nvl_status nvl_embedding_forward(nvl_tensor *out, const nvl_tensor *ids, const nvl_tensor *weight);
nvl_status nvl_embedding_forward_as(nvl_tensor *out, const nvl_tensor *ids, const nvl_tensor *weight, nvl_dtype dt);
/* dweight (V, C) += scatter of dout (N, C) by ids (N). */
nvl_status nvl_embedding_backward(nvl_tensor *dweight, const nvl_tensor *dout, const nvl_tensor *ids);

/* ---- RMSNorm ---------------------------------------------------------------------------------- */
/* out (N, C) = x * rstd * weight, rstd (N) = 1 / sqrt(mean(x^2) + eps), saved for backward. */
nvl_status nvl_rmsnorm_forward(nvl_tensor *out, nvl_tensor *rstd, const nvl_tensor *x, const nvl_tensor *weight,
                               double eps);
/* dx (N, C) =, dweight (C) +=. */
nvl_status nvl_rmsnorm_backward(nvl_tensor *dx, nvl_tensor *dweight, const nvl_tensor *dout, const nvl_tensor *x,
                                const nvl_tensor *weight, const nvl_tensor *rstd);

/* ---- RoPE (Hugging Face rotate-half layout; nvl_rope_scaling: core/backend.h) ------------------- */
/* cos, sin (T, D): for position t and i < D/2, angle = t * inv_freq[i] with inv_freq[i] =
 * theta^(-2i/D) (then changed by the scaling's rope type: Llama 3.1, linear, dynamic NTK); both
 * halves repeat the D/2 angles, as in Hugging Face (emb = cat(freqs, freqs)). Computed in double,
 * stored f32. scaling may be NULL (none). Dynamic scaling refuses T > its max_position_embeddings. */
nvl_status nvl_rope_tables(nvl_tensor *cos, nvl_tensor *sin, int64_t T, int64_t D, double theta,
                           const nvl_rope_scaling *scaling);
/* out (B, T, H, D) = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). */
nvl_status nvl_rope_forward(nvl_tensor *out, const nvl_tensor *x, const nvl_tensor *cos, const nvl_tensor *sin);
/* dx = the transposed rotation of dout. */
nvl_status nvl_rope_backward(nvl_tensor *dx, const nvl_tensor *dout, const nvl_tensor *cos, const nvl_tensor *sin);

/* ---- causal grouped-query attention (fp32 math, never quantized) ------------------------------------ */
/* out (B, T, Hq, D) = softmax(q k^T * scale + causal mask) v per head, query head h reading
 * key/value head h / (Hq / Hkv); q (B, T, Hq, D), k, v (B, T, Hkv, D); lse (B, Hq, T) the
 * log-sum-exp of each softmax row, saved for backward. */
nvl_status nvl_attention_forward(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                 const nvl_tensor *v, double scale);
/* The forward over a key/value cache (KV-cache decoding; forward only, f32): T queries at positions
 * pos0 .. pos0 + T - 1, q (B, T, Hq, D); k, v (B, S, Hkv, D) the cache, S >= pos0 + T, of which query t
 * sees rows s <= pos0 + t (the causal mask aligned bottom-right; rows past pos0 + T - 1 are not read).
 * out (B, T, Hq, D), lse (B, Hq, T) as nvl_attention_forward's, which is this with S = T, pos0 = 0. */
nvl_status nvl_attention_forward_at(nvl_tensor *out, nvl_tensor *lse, const nvl_tensor *q, const nvl_tensor *k,
                                    const nvl_tensor *v, int64_t pos0, double scale);
/* dq, dk, dv = (shapes of q, k, v). */
nvl_status nvl_attention_backward(nvl_tensor *dq, nvl_tensor *dk, nvl_tensor *dv, const nvl_tensor *dout,
                                  const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v,
                                  const nvl_tensor *out, const nvl_tensor *lse, double scale);
/* The route of attention on bf16 activations (NUMERICS §11), one setting for the process:
 *   AUTO (the default): cuDNN's fused attention where it runs (CUDA tensors, sm_90+, cuDNN 9 loaded, head dim 64
 *     or 128, contiguous and 16-byte aligned, T >= 2: core/flash_attention.h), else the device's own flash kernels
 *     (CUDA: FlashAttention-2 at head dim 64 or 128; a CPU with AVX512-BF16), else the widened f32 op;
 *   FLASH: the device's own flash kernels where they apply, else the widened f32 op; never cuDNN;
 *   CUDNN: cuDNN's fused attention, or an error saying why it cannot run these activations (f32 ones and CPU
 *     tensors included): never other numerics in silence;
 *   REFERENCE: the widened f32 op everywhere (NUMERICS §11's rule).
 * f32 activations run the f32 op under every route but CUDNN. */
typedef enum {
  NVL_ATTN_AUTO = 0,
  NVL_ATTN_FLASH = 1,
  NVL_ATTN_CUDNN = 2,
  NVL_ATTN_REFERENCE = 3,
  NVL_ATTN_ROUTE_COUNT
} nvl_attn_route;
/* "auto", "flash", "cudnn", "reference" (the routes' names, by value) */
extern const char *const nvl_attn_route_names[NVL_ATTN_ROUTE_COUNT];
/* Set the route (route >= 0; < 0 only reads). -> the previous route. */
int nvl_attention_route(int route);
/* The kernels attention on these q, k, v takes under the route now: "cudnn", "flash" (CUDA FlashAttention-2),
 * "cpu_bf16" (the CPU's AVX512-BF16 kernels), "widened" (bf16 through the f32 op), "f32", or "error" (the CUDNN
 * route cannot run them). why (n bytes) gets the reason a route the setting prefers was not taken ("" if none). */
const char *nvl_attention_route_of(const nvl_tensor *q, const nvl_tensor *k, const nvl_tensor *v, char *why, size_t n);
/* The cuDNN backward's graph: deterministic (on = 1: no fp32 dq atomics, a B*Hq*T*T*2-byte workspace, Hopper
 * only; elsewhere the route falls back) or cuDNN's default (0, the default); on < 0 only reads. -> previous. */
int nvl_attention_cudnn_deterministic(int on);
/* The switch the flash route had before the routes: on = 0 sets REFERENCE, on = 1 restores the route that
 * was set before (AUTO at first); on < 0 only reads. -> whether the route was not REFERENCE. */
int nvl_attention_flash(int on);
/* 1: bf16 attention on the CPU runs the CPU table's kernels with the same flash numerics (this CPU has
 * AVX512-BF16, the CPU table is in use, the route is AUTO or FLASH); 0: the widened f32 op (or an error). */
int nvl_attention_flash_cpu(void);

/* ---- SwiGLU ----------------------------------------------------------------------------------- */
/* out (N, F) = silu(gate) * up. */
nvl_status nvl_swiglu_forward(nvl_tensor *out, const nvl_tensor *gate, const nvl_tensor *up);
/* The RMSNorm and SwiGLU forwards that also give *amax (allocated: a one-element f32 tensor on
 * out's device) = max |out| (NaN ignored), the amax a per-tensor quantization of out computes:
 * from the same pass where the backend fuses it (CUDA, bf16 activations), else a pass of its own.
 * Nothing is read back. */
nvl_status nvl_rmsnorm_forward_amax(nvl_tensor *out, nvl_tensor *rstd, nvl_tensor *amax, const nvl_tensor *x,
                                    const nvl_tensor *weight, double eps);
nvl_status nvl_swiglu_forward_amax(nvl_tensor *out, nvl_tensor *amax, const nvl_tensor *gate, const nvl_tensor *up);
/* dgate, dup (N, F) =. */
nvl_status nvl_swiglu_backward(nvl_tensor *dgate, nvl_tensor *dup, const nvl_tensor *dout, const nvl_tensor *gate,
                               const nvl_tensor *up);

/* ---- fused softmax cross-entropy -------------------------------------------------------------- */
/* loss = mean over tokens n with targets[n] != ignore_index of (lse_n - logits[n, t_n]) +
 * z_loss * lse_n^2; logits (N, V) f32 (or bf16), targets (N) i64. *count = tokens counted.
 * If dlogits is not NULL it is allocated (N, V) f32 and written with dloss_scale * d(loss)/d(logits)
 * (zero rows for ignored tokens). With no counted token, loss = 0 and dlogits = 0. */
nvl_status nvl_cross_entropy(double *loss, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *logits,
                             const nvl_tensor *targets, int64_t ignore_index, double z_loss, double dloss_scale);
/* The same for logits that are a slice of a batch with of_count > 0 counted tokens (chunks of the
 * tokens): loss = the slice's sum / of_count, gradient dloss_scale / of_count per counted token, so
 * the slices' losses add up to the batch's mean and their gradients are the batch's; *count is
 * the slice's own. of_count 0: nvl_cross_entropy. grad_dtype: dlogits' dtype, f32, or bf16 (each
 * f32 dlogit rounded once, RNE: where the backend can, written so, with no (N, V) f32 gradient). */
nvl_status nvl_cross_entropy_of(double *loss, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *logits,
                                const nvl_tensor *targets, int64_t ignore_index, double z_loss, double dloss_scale,
                                int64_t of_count, nvl_dtype grad_dtype);
/* nvl_cross_entropy_of with the loss left where the logits are: *sum_out (allocated: an i64 (1)
 * tensor on the logits' device) holds the bits of the double sum of the counted tokens' loss
 * terms, not divided; nothing is read back (on a device, no host synchronisation), *loss is NaN;
 * the mean is that sum / (of_count, else *count). */
nvl_status nvl_cross_entropy_sum(nvl_tensor *sum_out, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *logits,
                                 const nvl_tensor *targets, int64_t ignore_index, double z_loss, double dloss_scale,
                                 int64_t of_count, nvl_dtype grad_dtype);

/* ---- optimizer (nvl_adamw_opts: core/backend.h) ------------------------------------------------ */
/* In place, f32, all of one shape: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * param -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * param), m_hat = m / (1-b1^step),
 * v_hat = v / (1-b2^step) (decoupled weight decay, as torch.optim.AdamW). */
nvl_status nvl_adamw_step(nvl_tensor *param, const nvl_tensor *grad, nvl_tensor *m, nvl_tensor *v,
                          const nvl_adamw_opts *o);
/* *out = sum of squares of t (fp64 accumulation), for the global gradient norm. */
nvl_status nvl_sumsq(double *out, const nvl_tensor *t);
/* out (new f32 [rows, K / block], a's device) = per 1 x block group along the last dim of the 2-D f32
 * a and b (same shape and device; b NULL: zeros): sum of (a - b)^2, accumulated in double in index
 * order and rounded once: bit for bit the same on every backend. */
nvl_status nvl_block_sqerr(nvl_tensor *out, const nvl_tensor *a, const nvl_tensor *b, int64_t block);
/* Knowledge distillation on the student's logits s and the teacher's t (both (N, V), f32 or bf16, one
 * device) with targets (N, i64, 0-based, ignore_index skipped): *kl = the mean over the counted
 * rows of KL(softmax(t/T) || softmax(s/T)), *ce = the mean cross-entropy of s (denominator of_count
 * when > 0, else this call's count), *count = the counted rows; dlogits (new f32 (N, V), or NULL: no
 * gradient) = the gradient of dscale * (alpha * T^2 * kl + (1 - alpha) * ce). T > 0, alpha in [0, 1]. */
nvl_status nvl_distill_loss(double *kl, double *ce, int64_t *count, nvl_tensor *dlogits, const nvl_tensor *s,
                            const nvl_tensor *t, const nvl_tensor *targets, int64_t ignore_index, double T, double alpha,
                            double dscale, int64_t of_count);
/* Delayed scaling's history step on hist's device (backend.h amax_history): hist f32 (len + 1),
 * the history and, last, the last usable amax (0: none); cur a one-element f32 tensor (this
 * step's amax); 0 <= count <= len values in the window, pos in [0, len) the slot cur goes to.
 * *sel_out (allocated, f32 (1)) = the amax to quantize with. No host synchronisation. */
nvl_status nvl_amax_history_step(nvl_tensor *sel_out, nvl_tensor *hist, int64_t count, int64_t pos,
                                 const nvl_tensor *cur);

#ifdef __cplusplus
}
#endif
#endif
