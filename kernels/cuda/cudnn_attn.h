/* cudnn_attn.h: attention through cuDNN's fused scaled-dot-product attention (kernels/cuda/cudnn_attn.cu):
 * grouped-query attention, causal or not, bf16 q, k, v, out, dout, dq, dk, dv, fp32 softmax statistics (the
 * row logsumexp, lse), head dim 64 or 128, on sm_90 or newer, with cuDNN 9 loaded at run time (dlopen). Device
 * pointers, contiguous, 16-byte aligned; the caller (core/flash_attention.c) validates shapes and dtypes.
 *
 * Shapes: q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T) f32; query head h reads kv
 * head h / (Hq / Hkv). Backward: dq, dk, dv are WRITTEN (=); it needs the forward's out and lse, which is the same
 * logsumexp the other attention routes save (scale q.k, natural log), so a backward may follow any route's forward.
 *
 * Graphs and execution plans are built once per (device, direction, B, T, Hq, Hkv, D, causal, deterministic) and
 * cached; the scale is a by-value input of each execution. Workspace (cuDNN's, and the backward's fp32 row sums
 * and dq accumulator) is call scratch (nvl_kctx). Not here: validation and allocation (core/flash_attention.c),
 * the route choice (core/attention.c). */
#ifndef NVL_CUDA_CUDNN_ATTN_H
#define NVL_CUDA_CUDNN_ATTN_H
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NVL_OK if cuDNN's attention can run on device dev: nvlua was built with cuDNN, the library loads, its version is
 * one the route takes (9.6 or newer, not 9.10.0/9.10.1) and dev is sm_90 or newer. Otherwise NVL_EUNSUPPORTED with
 * the reason, naming fn. Loads the library at the first call. */
nvl_status nvl_cuda_cudnn_attn_available(const char *fn, int dev);
/* NVL_OK if the route takes this problem on dev (_available's rules too): D 64 or 128, T >= 2, on cuDNN 9.15 or
 * older T a multiple of 128 (cudnn-frontend works around a backward bug there with a padding mask, which this
 * route does not build), and a deterministic backward only on Hopper; else NVL_EUNSUPPORTED naming fn and the
 * reason. */
nvl_status nvl_cuda_cudnn_attn_supported(const char *fn, int dev, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                         int64_t D, int deterministic);
/* out (B, T, Hq, D) bf16, lse (B, Hq, T) f32 = softmax(scale q k^T [causal mask]) v and its row logsumexp.
 * Both calls return NVL_EUNSUPPORTED (and nothing ran) when cuDNN has no engine for the problem's graph; other
 * failures are NVL_EDEVICE. */
nvl_status nvl_cuda_cudnn_attn_fwd(nvl_kctx *ctx, uint16_t *out, float *lse, const uint16_t *q, const uint16_t *k,
                                   const uint16_t *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                   double scale, int causal);
/* dq, dk, dv (bf16) from dout, q, k, v, out (bf16) and lse. deterministic: the graph without cuDNN's fp32 dq
 * accumulator (dq written by one product, no atomics; cuDNN then asks for a B*Hq*T*T*2-byte dP workspace). */
nvl_status nvl_cuda_cudnn_attn_bwd(nvl_kctx *ctx, uint16_t *dq, uint16_t *dk, uint16_t *dv, const uint16_t *dout,
                                   const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *out,
                                   const float *lse, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                   double scale, int causal, int deterministic);

/* What the route has done in this process. */
typedef struct {
  int64_t graphs_built;  /* execution plans built (one per new problem key) */
  int64_t cache_hits;    /* calls that found their plan in the cache */
  int64_t evictions;     /* plans dropped to make room (least recently used) */
  int64_t executions;    /* cudnnBackendExecute calls */
  int64_t cached;        /* plans held now */
  size_t last_workspace; /* bytes of cuDNN workspace the last plan asked for */
  int64_t refusals;      /* problems cuDNN had no engine for (attention=auto fell back on them) */
  char last_refusal[480]; /* the last one's message ("" if none) */
} nvl_cudnn_attn_stats;
void nvl_cuda_cudnn_attn_stats(nvl_cudnn_attn_stats *s);
/* The loaded library's cudnnGetVersion() (0 if not loaded or not built), and the header's CUDNN_VERSION nvlua was
 * compiled against (0 without cuDNN). */
size_t nvl_cuda_cudnn_version(void);
size_t nvl_cuda_cudnn_compiled_version(void);
/* 1 if libcudnn was opened and has every function the route calls (whatever its version); else 0 and why. Loads
 * the library at the first call; needs no GPU. */
int nvl_cuda_cudnn_loads(char *why, size_t n);
/* Drop every cached plan (tests). */
void nvl_cuda_cudnn_attn_clear_cache(void);

/* Emulation builds only (tests of the emulator's cuDNN stand-in): break one rule of the cuDNN API on purpose in
 * every graph built and call made from now on (NVL_CUDNN_BREAK_NONE restores; the plan cache is dropped at each
 * change). -> the previous setting, or -1 (and nothing changes) in a build that is not the emulation. */
enum {
  NVL_CUDNN_BREAK_NONE = 0,
  NVL_CUDNN_BREAK_MASK_AXES = 1,   /* the causal mask compares GEN_INDEX axis 3 >= axis 2 (a bottom-left mask) */
  NVL_CUDNN_BREAK_P_TYPE = 2,      /* the forward's P declared FLOAT (cuDNN wants the P V operand in the io type) */
  NVL_CUDNN_BREAK_NO_SCALE = 3,    /* the variant pack leaves out the by-value scale */
  NVL_CUDNN_BREAK_WORKSPACE = 4,   /* the execution gets no workspace */
  NVL_CUDNN_BREAK_ALIGNMENT = 5,   /* Q's descriptor declares a 12-byte alignment */
  NVL_CUDNN_BREAK_STATS_DIMS = 6,  /* Stats declared [b, h, s, s] */
  NVL_CUDNN_BREAK_DESTROYED = 7,   /* Q's descriptor destroyed before the first operation uses it */
  NVL_CUDNN_BREAK_FINALIZED = 8,   /* an attribute set on Q's descriptor after it was finalized */
  NVL_CUDNN_BREAK_DUP_UID = 9,     /* O's descriptor given V's unique id */
  NVL_CUDNN_BREAK_OVERLAP = 10,    /* the forward writes O over Q */
  NVL_CUDNN_BREAK_COUNT = 11
};
int nvl_cuda_cudnn_attn_break(int what);

#ifdef __cplusplus
}
#endif
#endif
