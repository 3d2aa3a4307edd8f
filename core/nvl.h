/* nvl.h: status codes, the error message channel, and limits shared by all of core/ and kernels/.
 * Not here: anything that knows about Lua. Errors travel up as an nvl_status plus a message
 * (thread-local); the Lua binding turns them into Lua errors. Nothing in core calls exit/abort. */
#ifndef NVL_H
#define NVL_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  NVL_OK = 0,
  NVL_EINVAL = 1,       /* bad argument: shape, dtype, dim, index, value */
  NVL_ENOMEM = 2,       /* allocation failed */
  NVL_EUNSUPPORTED = 3, /* valid request this backend/format cannot do */
  NVL_EDEVICE = 4,      /* a CUDA / cuBLASLt call failed */
  NVL_EIO = 5,          /* file I/O */
  NVL_ESTATE = 6,       /* use of a freed tensor and similar */
  NVL_STATUS_COUNT
} nvl_status;

#define NVL_MAX_DIMS 8

/* Record a message (printf-style) for the calling thread and return st. */
nvl_status nvl_error(nvl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The last message recorded on this thread ("" if none). */
const char *nvl_last_error(void);

/* Propagate a non-OK status. */
#define NVL_TRY(expr)                  \
  do {                                 \
    nvl_status nvl_st_ = (expr);       \
    if (nvl_st_ != NVL_OK) return nvl_st_; \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
