/* tokens.c: the scans of token files (tokens.h). The file is read front to back in blocks into one
 * buffer; each block is reduced by a loop over its ids in their own type (the compiler vectorises
 * these: `omp simd` reductions), so the pass runs at the speed the file is read. */
#include "tokens.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tokens.c reads little-endian ids in place: a big-endian host needs a byte swap here"
#endif

#define BLOCK_BYTES ((size_t)4 << 20) /* the read buffer: 4 MiB, a multiple of every width */

static int width_ok(int width, int is_signed) {
  return width == 1 || width == 2 || width == 4 || (width == 8 && is_signed);
}

/* min/max of n ids of one type in buf (n >= 1), into *lo / *hi (which hold the running values) */
#define REDUCE(T)                                                   \
  do {                                                              \
    const T *v = (const T *)buf;                                    \
    T l = (T)*lo, h = (T)*hi;                                       \
    _Pragma("omp simd reduction(min : l) reduction(max : h)")       \
    for (size_t i = 0; i < n; i++) {                                \
      l = v[i] < l ? v[i] : l;                                      \
      h = v[i] > h ? v[i] : h;                                      \
    }                                                               \
    *lo = (int64_t)l, *hi = (int64_t)h;                             \
  } while (0)

static void reduce(const void *buf, size_t n, int width, int is_signed, int64_t *lo, int64_t *hi) {
  switch (width * 2 + is_signed) {
  case 2: REDUCE(uint8_t); break;
  case 3: REDUCE(int8_t); break;
  case 4: REDUCE(uint16_t); break;
  case 5: REDUCE(int16_t); break;
  case 8: REDUCE(uint32_t); break;
  case 9: REDUCE(int32_t); break;
  default: REDUCE(int64_t); break;
  }
}

/* id i of buf as int64 */
static int64_t id_at(const unsigned char *buf, size_t i, int width, int is_signed) {
  switch (width * 2 + is_signed) {
  case 2: return ((const uint8_t *)buf)[i];
  case 3: return ((const int8_t *)buf)[i];
  case 4: return ((const uint16_t *)buf)[i];
  case 5: return ((const int16_t *)buf)[i];
  case 8: return ((const uint32_t *)buf)[i];
  case 9: return ((const int32_t *)buf)[i];
  default: return ((const int64_t *)buf)[i];
  }
}

/* Open path at offset for count ids of width bytes, and a block buffer. */
static nvl_status open_range(const char *path, int64_t offset, int width, int is_signed, int64_t count, FILE **f,
                             void **buf, const char *op) {
  int64_t bytes;
  if (!path || !width_ok(width, is_signed) || offset < 0 || count < 0 || nvl_mul_overflow(count, width, &bytes) ||
      nvl_add_overflow(offset, bytes, &bytes))
    return nvl_error(NVL_EINVAL, "%s: bad range: offset %lld, %lld ids of width %d (%s)", op, (long long)offset,
                     (long long)count, width, is_signed ? "signed" : "unsigned");
  *f = fopen(path, "rb");
  if (!*f) return nvl_error(NVL_EIO, "%s: cannot open %s: %s", op, path, strerror(errno));
  if (fseeko(*f, (off_t)offset, SEEK_SET) != 0) {
    int e = errno;
    fclose(*f);
    return nvl_error(NVL_EIO, "%s: %s: cannot seek to byte %lld: %s", op, path, (long long)offset, strerror(e));
  }
  *buf = aligned_alloc(64, BLOCK_BYTES);
  if (!*buf) {
    fclose(*f);
    return nvl_error(NVL_ENOMEM, "%s: cannot allocate a %zu-byte read buffer", op, BLOCK_BYTES);
  }
  return NVL_OK;
}

/* Read the next block of at most `want` ids; NVL_EIO when the file ends first. */
static nvl_status read_block(FILE *f, void *buf, size_t want, int width, const char *path, int64_t done,
                             int64_t count, const char *op) {
  size_t got = fread(buf, (size_t)width, want, f);
  if (got != want)
    return nvl_error(NVL_EIO, "%s: %s ends after %lld of the %lld tokens to scan (%s)", op, path,
                     (long long)(done + (int64_t)got), (long long)count,
                     ferror(f) ? strerror(errno) : "truncated after it was opened?");
  return NVL_OK;
}

nvl_status nvl_token_range(const char *path, int64_t offset, int width, int is_signed, int64_t count, int64_t *min,
                           int64_t *max) {
  static const char op[] = "token_range";
  FILE *f;
  void *buf;
  NVL_TRY(open_range(path, offset, width, is_signed, count, &f, &buf, op));
  int64_t lo = 0, hi = 0, done = 0;
  size_t per = BLOCK_BYTES / (size_t)width;
  nvl_status st = NVL_OK;
  while (done < count) {
    size_t n = (size_t)(count - done) < per ? (size_t)(count - done) : per;
    if ((st = read_block(f, buf, n, width, path, done, count, op)) != NVL_OK) break;
    if (done == 0) lo = hi = id_at(buf, 0, width, is_signed);
    reduce(buf, n, width, is_signed, &lo, &hi);
    done += (int64_t)n;
  }
  free(buf);
  fclose(f);
  if (st == NVL_OK) *min = lo, *max = hi;
  return st;
}

nvl_status nvl_token_find_outside(const char *path, int64_t offset, int width, int is_signed, int64_t count,
                                  int64_t lo, int64_t hi, int64_t *index, int64_t *value) {
  static const char op[] = "token_find_outside";
  FILE *f;
  void *buf;
  NVL_TRY(open_range(path, offset, width, is_signed, count, &f, &buf, op));
  int64_t done = 0;
  size_t per = BLOCK_BYTES / (size_t)width;
  nvl_status st = NVL_OK;
  *index = -1, *value = 0;
  while (done < count && *index < 0) {
    size_t n = (size_t)(count - done) < per ? (size_t)(count - done) : per;
    if ((st = read_block(f, buf, n, width, path, done, count, op)) != NVL_OK) break;
    for (size_t i = 0; i < n; i++) {
      int64_t v = id_at(buf, i, width, is_signed);
      if (v < lo || v > hi) {
        *index = done + (int64_t)i, *value = v;
        break;
      }
    }
    done += (int64_t)n;
  }
  free(buf);
  fclose(f);
  return st;
}
