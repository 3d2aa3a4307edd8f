/* philox.h: Philox4x32-10 (Salmon et al., SC'11, Random123), the one source of random bits in
 * nvlua. Counter-based, so the CPU and CUDA paths draw identical bits and runs resume exactly.
 * Stream layout (core/NUMERICS.md §3): key = (seed lo, seed hi); counter = (i lo, offset lo, offset hi,
 * i hi) where i indexes 4-word groups within one call and offset counts calls on a generator; the
 * last word is NUMERICS' 0 for every i < 2^32 and keeps larger tensors' groups distinct. */
#ifndef NVL_PHILOX_H
#define NVL_PHILOX_H
#include "nvl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One Philox4x32-10 evaluation: out = philox(ctr, key). */
void nvl_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* A generator: a seed and a call counter. Each op that draws random numbers uses counter
 * (i, offset) for its i-th group of 4 words and then advances offset by one. */
typedef struct {
  uint64_t seed;
  uint64_t offset;
} nvl_generator;

/* The process-wide default generator (nv.manual_seed sets it). */
nvl_generator *nvl_default_generator(void);

/* The 4 words of group i of the call at (seed, offset). */
void nvl_philox_words(uint64_t seed, uint64_t offset, uint64_t i, uint32_t out[4]);


#ifdef __cplusplus
}
#endif
#endif
