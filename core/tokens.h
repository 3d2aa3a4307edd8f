/* tokens.h: token files checked when a dataset is opened, not when a window is drawn: one
 * sequential pass over a range of a file of little-endian integer token ids (an NVLTOK shard's
 * data, a Megatron-LM .bin or one of its splits) for the smallest and largest id, and, when those
 * fall outside a vocabulary, a second pass that finds the first offending token for the message.
 * Not here: the file formats' headers (lua/nvlua/data.lua reads and checks them) and the cache of
 * the results (data.lua keeps it beside the data). */
#ifndef NVL_TOKENS_H
#define NVL_TOKENS_H
#include <stdint.h>
#include "nvl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The minimum and maximum of count ids of width bytes (1, 2, 4: unsigned or signed; 8: signed)
 * stored little-endian from byte offset of path on. Cost: one read of count * width bytes in
 * 4 MiB blocks, each reduced by a vectorised min/max loop: 4 GB/s from the page cache on a 2-core
 * Xeon (200M u16 ids in 0.1 s), otherwise the disk's time to read the range once; memory: the one
 * 4 MiB buffer. count = 0 gives min = max = 0.
 * NVL_EIO (naming the file) when it cannot be opened or ends before the range does. */
nvl_status nvl_token_range(const char *path, int64_t offset, int width, int is_signed, int64_t count, int64_t *min,
                           int64_t *max);

/* The first of those ids outside [lo, hi]: *index (0-based, from offset) and *value, or *index = -1
 * when every id is inside. The same single read, stopping at the first one found. */
nvl_status nvl_token_find_outside(const char *path, int64_t offset, int width, int is_signed, int64_t count,
                                  int64_t lo, int64_t hi, int64_t *index, int64_t *value);

#ifdef __cplusplus
}
#endif
#endif
