/* sys.c: the few operating-system calls the Lua library needs and Lua lacks — fsync of a file
 * and of a directory (atomic checkpoint writes), a background writer thread that runs a list of
 * file operations in order (checkpoints that do not block training), a monotonic clock, whether
 * stdout is a terminal, the process's peak resident memory, a file's identity stamp (caches keyed
 * by it), the wall clock, the host name and process id (TensorBoard event file names), CRC-32C
 * (core/crc32c.h: their records' checksum) — and token decoding from raw bytes (u16/u32 little-endian
 * shard files) into i64 tensors, and the scans of token files (core/tokens.h). */
#define _GNU_SOURCE /* O_DIRECT; nftw */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "bind.h"
#include "crc32c.h"
#include "tokens.h"

/* core.fsync(path [, is_dir]) -> true | nil, msg: flush a file's (or directory's) data to disk */
static int l_fsync(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int dir = lua_toboolean(L, 2);
  int fd = open(path, dir ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) {
    luaL_pushfail(L);
    lua_pushfstring(L, "fsync: cannot open %s: %s", path, strerror(errno));
    return 2;
  }
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  if (rc != 0) {
    luaL_pushfail(L);
    lua_pushfstring(L, "fsync: %s: %s", path, strerror(err));
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* core.isatty(fd) -> boolean (1 = stdout) */
static int l_isatty(lua_State *L) {
  lua_Integer fd = luaL_optinteger(L, 1, 1);
  luaL_argcheck(L, fd >= 0 && fd <= INT_MAX, 1, "file descriptor out of range");
  lua_pushboolean(L, isatty((int)fd));
  return 1;
}

/* core.peak_rss() -> bytes: the process's peak resident set size */
static int l_peak_rss(lua_State *L) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  lua_pushinteger(L, (lua_Integer)ru.ru_maxrss * 1024);
  return 1;
}

/* core.unix_time() -> seconds since the Unix epoch (the real-time clock, with its fraction) */
static int l_unix_time(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  lua_pushnumber(L, (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec);
  return 1;
}

/* core.hostname() -> this machine's host name */
static int l_hostname(lua_State *L) {
  char name[HOST_NAME_MAX + 1];
  if (gethostname(name, sizeof name) != 0) return luaL_error(L, "hostname: %s", strerror(errno));
  name[HOST_NAME_MAX] = 0; /* truncated names need not be terminated */
  lua_pushstring(L, name);
  return 1;
}

/* core.getpid() -> this process's id */
static int l_getpid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

/* core.crc32c(str [, crc]) -> the CRC-32C of str (continuing crc: the value for the bytes before it) */
static int l_crc32c(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  lua_Integer crc = luaL_optinteger(L, 2, 0);
  luaL_argcheck(L, crc >= 0 && crc <= 0xFFFFFFFF, 2, "crc must be in [0, 2^32)");
  lua_pushinteger(L, (lua_Integer)nvl_crc32c((uint32_t)crc, s, len));
  return 1;
}

/* core.tokens_from_bytes(str, width, n [, offset]) -> i64 tensor (n): little-endian unsigned
 * tokens of width 1, 2 or 4 bytes, starting at byte offset (0-based) */
static int l_tokens_from_bytes(lua_State *L) {
  size_t len;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &len);
  lua_Integer w = luaL_checkinteger(L, 2), n = luaL_checkinteger(L, 3), off = luaL_optinteger(L, 4, 0);
  luaL_argcheck(L, w == 1 || w == 2 || w == 4, 2, "token width must be 1, 2 or 4 bytes");
  luaL_argcheck(L, n >= 0, 3, "count must be >= 0");
  if (off < 0 || (size_t)off > len || (len - (size_t)off) / (size_t)w < (size_t)n)
    return luaL_error(L, "tokens_from_bytes: %I tokens of %I bytes at offset %I need more than the %I bytes given",
                      n, w, off, (lua_Integer)len);
  int64_t shape[1] = {n};
  nvl_tensor *t = nvl_lua_push_tensor(L);
  if (nvl_tensor_empty(t, NVL_I64, NVL_CPU, 1, shape) != NVL_OK) return nvl_lua_raise(L);
  int64_t *p = nvl_tensor_data(t);
  const unsigned char *b = s + off;
  for (lua_Integer i = 0; i < n; i++, b += w) {
    uint32_t v = b[0];
    if (w >= 2) v |= (uint32_t)b[1] << 8;
    if (w == 4) v |= (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    p[i] = v;
  }
  return 1;
}

/* core.file_stamp(path) -> "dev:ino:size:mtime_ns:ctime_ns" | nil, msg: what changes when the file
 * is rewritten, replaced or touched (nanosecond times: a rewrite within the same second counts) */
static int l_file_stamp(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct stat sb;
  if (stat(path, &sb) != 0) {
    luaL_pushfail(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  char s[160];
  snprintf(s, sizeof s, "%llu:%llu:%lld:%lld.%09ld:%lld.%09ld", (unsigned long long)sb.st_dev,
           (unsigned long long)sb.st_ino, (long long)sb.st_size, (long long)sb.st_mtim.tv_sec, (long)sb.st_mtim.tv_nsec,
           (long long)sb.st_ctim.tv_sec, (long)sb.st_ctim.tv_nsec);
  lua_pushstring(L, s);
  return 1;
}

/* the arguments path, offset, width, signed, count of the token scans */
static void token_args(lua_State *L, const char **path, int64_t *offset, int *width, int *is_signed, int64_t *count) {
  *path = luaL_checkstring(L, 1);
  lua_Integer off = luaL_checkinteger(L, 2), w = luaL_checkinteger(L, 3), n = luaL_checkinteger(L, 5);
  luaL_argcheck(L, off >= 0, 2, "offset must be >= 0");
  *is_signed = lua_toboolean(L, 4);
  luaL_argcheck(L, w == 1 || w == 2 || w == 4 || (w == 8 && *is_signed), 3,
                "width must be 1, 2 or 4 bytes, or 8 (signed)");
  luaL_argcheck(L, n >= 0, 5, "count must be >= 0");
  *offset = off, *width = (int)w, *count = n;
}

/* core.token_range(path, offset, width, signed, count) -> min, max: the smallest and largest of
 * count little-endian ids from byte offset on (core/tokens.h: one read of the range); 0, 0 for none */
static int l_token_range(lua_State *L) {
  const char *path;
  int64_t offset, count, lo, hi;
  int width, is_signed;
  token_args(L, &path, &offset, &width, &is_signed, &count);
  CHECK(L, nvl_token_range(path, offset, width, is_signed, count, &lo, &hi));
  lua_pushinteger(L, (lua_Integer)lo);
  lua_pushinteger(L, (lua_Integer)hi);
  return 2;
}

/* core.token_find_outside(path, offset, width, signed, count, lo, hi) -> index (0-based), id of the
 * first id outside [lo, hi]; nil when there is none */
static int l_token_find_outside(lua_State *L) {
  const char *path;
  int64_t offset, count, index, value;
  int width, is_signed;
  token_args(L, &path, &offset, &width, &is_signed, &count);
  lua_Integer lo = luaL_checkinteger(L, 6), hi = luaL_checkinteger(L, 7);
  CHECK(L, nvl_token_find_outside(path, offset, width, is_signed, count, lo, hi, &index, &value));
  if (index < 0) {
    luaL_pushfail(L);
    return 1;
  }
  lua_pushinteger(L, (lua_Integer)index);
  lua_pushinteger(L, (lua_Integer)value);
  return 2;
}

/* ---- the background writer ----------------------------------------------------------------------
 * One thread at a time runs a list of operations, in order, stopping at the first that fails:
 *   {"fsync", path, is_dir}   flush a file or a directory
 *   {"write", path, contents} path.tmp written, fsync'd, renamed over path, the directory fsync'd;
 *                             contents: a string, or an array of strings and CPU or CUDA tensors
 *                             (their raw bytes, row-major) written one after the other
 *   {"rename", from, to}      {"unlink", path}   {"rmtree", path} (a file or a directory, recursively)
 *   {"rmdir", path}           {"kill", point}   SIGKILL this process (crash tests: NVLUA_FAULT)
 * core.bg_submit copies every write's contents into one host staging buffer (kept between lists, so
 * that its pages are faulted in once; core.bg_reserve makes it ahead, core.bg_release frees it).
 * By default the copies are made before it returns (by the OpenMP threads together): the caller may
 * change the tensors at once. core.bg_submit(ops, true) defers the copies of CPU tensors to the
 * writer thread, which makes them first (at normal priority) and only then runs the ops: the step
 * that saved goes on at once, its forward and backward overlapping the copy, and must call
 * core.bg_snapshot_wait() before it changes any tensor of the list (the optimizer step). Until then
 * the list's strings and tensors are held (a registry reference, a share of each tensor's storage),
 * so even a tensor freed meanwhile stays readable; they are let go on the main thread. Besides its
 * copies the thread never touches Lua or a tensor. core.bg_submit refuses while a list runs;
 * core.bg_wait() joins it and returns nil or its error message; core.bg_busy() says whether one
 * runs. Once its copies are made the writer thread runs at nice +10, below the training. */

enum { BG_FSYNC, BG_WRITE, BG_RENAME, BG_UNLINK, BG_RMTREE, BG_RMDIR, BG_KILL, BG_TOUCH /* core.bg_reserve's */ };

typedef struct {
  int kind, flag;
  char *a, *b;      /* paths (malloc'd); a write's contents: b = NULL, at off in the staging buffer */
  size_t off, blen;
} bg_op;

/* One copy into the staging buffer (a piece of a string or a tensor). */
typedef struct {
  char *dst;
  const char *src;
  size_t n;
} bg_copy;

static struct {
  pthread_t thread;
  int running;      /* a thread was started and not joined */
  atomic_int done;  /* its ops have run (or stopped at a failure) */
  bg_op *ops;
  int n;
  char *stage;      /* the staging buffer: every write's contents, one after the other */
  size_t stage_cap;
  /* a deferred list (core.bg_submit(ops, true)): the writer's copies, made before its ops */
  bg_copy *dc;
  size_t ndc;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int copied;       /* under mu: the deferred copies are made */
  int ref;          /* the ops table in the registry (LUA_NOREF: none held) */
  nvl_tensor *held; /* shares of the deferred tensors' storage */
  size_t nheld, cap_held;
  char err[512];
} bg = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .ref = LUA_NOREF};

/* The copies into the staging buffer being listed by core.bg_submit (see copy_add). */
static struct {
  bg_copy *c;
  size_t n, cap;
} copies;

/* The growing array p (n used of *cap, elem bytes each; doubled, from first) with room for one more:
 * p itself, or where realloc moved it; NULL out of memory (p unchanged, still valid). */
static void *grow(void *p, size_t n, size_t *cap, size_t elem, size_t first) {
  if (n < *cap) return p;
  size_t c = *cap ? 2 * *cap : first;
  void *q = realloc(p, c * elem);
  if (q) *cap = c;
  return q;
}

/* A share of t's storage held until the deferred copies are made; -> 0, or -1 out of memory. */
static int hold(const nvl_tensor *t) {
  nvl_tensor *h = grow(bg.held, bg.nheld, &bg.cap_held, sizeof *h, 64);
  if (!h) return -1;
  bg.held = h;
  bg.held[bg.nheld] = nvl_tensor_null();
  nvl_tensor_share(&bg.held[bg.nheld++], t);
  return 0;
}

/* Let go of what a deferred list held (main thread: the refcounts and the registry are not shared). */
static void let_go(lua_State *L) {
  for (size_t i = 0; i < bg.nheld; i++) nvl_tensor_release(&bg.held[i]);
  bg.nheld = 0;
  luaL_unref(L, LUA_REGISTRYINDEX, bg.ref);
  bg.ref = LUA_NOREF;
  free(bg.dc);
  bg.dc = NULL;
  bg.ndc = 0;
}

static int fsync_path(const char *path, int dir) {
  int fd = open(path, dir ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return -1;
  int rc = fsync(fd), e = errno;
  close(fd);
  errno = e;
  return rc;
}

/* Staged contents start at multiples of this in the staging buffer (itself aligned to it): the
 * alignment O_DIRECT asks of a buffer, a file offset and a length on the usual devices. */
#define BG_ALIGN ((size_t)4096)

/* fd's O_DIRECT cleared: its next writes go through the page cache. -> 0, or -1 with errno. */
static int make_buffered(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl == -1 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) == -1 ? -1 : 0;
}

/* len bytes at text to fd. A direct (O_DIRECT) fd writes whole aligned pieces of at most 8 MiB, and
 * is made buffered for the tail, after a short write, and for everything when the device refuses a
 * direct write (EINVAL: it wants a larger alignment). -> 0, or -1 with errno. */
static int write_all(int fd, const char *text, size_t len, int direct) {
  const size_t most = (size_t)8 << 20;
  size_t off = 0;
  while (off < len) {
    size_t n = len - off;
    if (direct && n < BG_ALIGN) {
      if (make_buffered(fd)) return -1;
      direct = 0;
    }
    if (direct) n = (n < most ? n : most) / BG_ALIGN * BG_ALIGN;
    ssize_t w = write(fd, text + off, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && direct && errno == EINVAL) {
      if (make_buffered(fd)) return -1;
      direct = 0;
      continue;
    }
    if (w < 0) return -1;
    off += (size_t)w;
    if (direct && (size_t)w % BG_ALIGN) {
      if (make_buffered(fd)) return -1;
      direct = 0;
    }
  }
  return 0;
}

/* path.tmp written (directly from the staging buffer when the file system allows O_DIRECT: no
 * copy into the page cache, which costs more CPU than the write itself), fsync'd, renamed over
 * path, the directory fsync'd. On a failure path.tmp is removed. -> 0, or -1 with errno. */
static int write_atomic(const char *path, const char *text, size_t len) {
  char tmp[PATH_MAX + 8];
  if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) { errno = ENAMETOOLONG; return -1; }
  int direct = len >= BG_ALIGN && (uintptr_t)text % BG_ALIGN == 0;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0 && direct && errno == EINVAL) { /* a file system without O_DIRECT (tmpfs) */
    direct = 0;
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  if (fd < 0) return -1;
  if (write_all(fd, text, len, direct) != 0 || fsync(fd) != 0) {
    int e = errno;
    close(fd);
    unlink(tmp);
    errno = e;
    return -1;
  }
  if (close(fd) != 0 || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    errno = e;
    return -1;
  }
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = 0;
  return fsync_path(slash ? dir : ".", 1);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb; (void)flag; (void)ftw;
  return remove(p) != 0 && errno != ENOENT ? -1 : 0;
}

static void copy_stream(char *dst, const char *src, size_t n);

static void *bg_main(void *arg) {
  (void)arg;
  /* a deferred list's copies first, at the caller's priority: the step that saved waits for them
   * before its optimizer step (core.bg_snapshot_wait) */
  for (size_t i = 0; i < bg.ndc; i++) copy_stream(bg.dc[i].dst, bg.dc[i].src, bg.dc[i].n);
  pthread_mutex_lock(&bg.mu);
  bg.copied = 1;
  pthread_cond_broadcast(&bg.cv);
  pthread_mutex_unlock(&bg.mu);
  /* Below the training threads (nice +10; who = 0: this thread alone on Linux), not SCHED_IDLE: the
   * OpenMP workers spin between parallel loops, and an idle-class writer measured starved until the
   * next save had to wait for it. Best effort: a failure changes nothing else. */
  (void)setpriority(PRIO_PROCESS, 0, 10);
  for (int i = 0; i < bg.n; i++) {
    bg_op *o = &bg.ops[i];
    int rc = 0;
    const char *what = "";
    switch (o->kind) {
      case BG_FSYNC: rc = fsync_path(o->a, o->flag); what = "fsync"; break;
      case BG_WRITE: rc = write_atomic(o->a, bg.stage ? bg.stage + o->off : "", o->blen); what = "write"; break;
      case BG_RENAME: rc = rename(o->a, o->b); what = "rename"; break;
      case BG_UNLINK: rc = unlink(o->a) != 0 && errno != ENOENT ? -1 : 0; what = "remove"; break;
      case BG_RMTREE: rc = nftw(o->a, rm_one, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT ? -1 : 0; what = "remove"; break;
      case BG_RMDIR: rc = rmdir(o->a); what = "remove the directory"; break;
      case BG_TOUCH: /* fault the staging buffer's pages in here, not in the first save's copy */
        for (size_t at = 0; at < bg.stage_cap; at += BG_ALIGN) bg.stage[at] = 0;
        break;
      case BG_KILL:
        fprintf(stderr, "NVLUA_FAULT: killing this process at %s (background writer)\n", o->a);
        fflush(stderr);
        kill(getpid(), SIGKILL);
        break;
    }
    if (rc != 0) {
      snprintf(bg.err, sizeof bg.err, "background checkpoint writer: cannot %s %s%s%s: %s", what, o->a,
               o->kind == BG_RENAME ? " to " : "", o->kind == BG_RENAME ? o->b : "", strerror(errno));
      break;
    }
  }
  atomic_store(&bg.done, 1);
  return NULL;
}

static void bg_free(void) { /* the ops; the staging buffer stays */
  for (int i = 0; i < bg.n; i++) { free(bg.ops[i].a); free(bg.ops[i].b); }
  free(bg.ops);
  bg.ops = NULL;
  bg.n = 0;
}

/* Join a thread that was started (waiting for it to end), free the ops (also those of a submit
 * that raised before its thread started) and let go of what the list held. */
static void bg_join(lua_State *L) {
  if (bg.running) {
    pthread_join(bg.thread, NULL);
    bg.running = 0;
  }
  bg_free();
  let_go(L);
  copies.n = 0;
}

/* Raise when a list still runs (what: the caller's name); else join the finished one. */
static void bg_settle(lua_State *L, const char *what) {
  if (bg.running && !atomic_load(&bg.done)) luaL_error(L, "%s: a list is still running (core.bg_wait first)", what);
  bg_join(L);
}

/* core.bg_wait() -> nil | the error message of the list that ran (joins it) */
static int l_bg_wait(lua_State *L) {
  bg_join(L);
  if (bg.err[0]) {
    lua_pushstring(L, bg.err);
    bg.err[0] = 0;
    return 1;
  }
  lua_pushnil(L);
  return 1;
}

/* core.bg_snapshot_wait() -> seconds waited: returns once a deferred list's copies are made (0 at
 * once when none is pending), and lets go of the tensors and strings it held */
static int l_bg_snapshot_wait(lua_State *L) {
  if (bg.ref == LUA_NOREF) {
    lua_pushnumber(L, 0);
    return 1;
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  if (bg.running) {
    pthread_mutex_lock(&bg.mu);
    while (!bg.copied) pthread_cond_wait(&bg.cv, &bg.mu);
    pthread_mutex_unlock(&bg.mu);
  }
  let_go(L);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  lua_pushnumber(L, (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
  return 1;
}

/* core.bg_busy() -> true while a list runs */
static int l_bg_busy(lua_State *L) {
  lua_pushboolean(L, bg.running && !atomic_load(&bg.done));
  return 1;
}

/* a malloc'd copy of the string at idx (checked already), or NULL */
static char *dupl(lua_State *L, int idx) {
  size_t n;
  const char *s = lua_tolstring(L, idx, &n);
  char *d = malloc(n + 1);
  if (!d) return NULL;
  memcpy(d, s, n);
  d[n] = 0;
  return d;
}

static const char *const bg_kinds[] = {"fsync", "write", "rename", "unlink", "rmtree", "rmdir", "kill", NULL};

/* The live tensor at idx, or NULL when the value there is not a tensor userdata. */
static nvl_tensor *as_tensor(lua_State *L, int idx) {
  nvl_tensor *t = luaL_testudata(L, idx, NVL_TENSOR_MT);
  return t && t->storage ? t : NULL;
}

/* The bytes of a write's contents at idx (a string, or an array of strings and tensors), checked
 * (op i): raises on a bad piece. */
static size_t contents_size(lua_State *L, int idx, int i) {
  if (lua_type(L, idx) == LUA_TSTRING) return luaL_len(L, idx);
  if (!lua_istable(L, idx)) luaL_error(L, "bg_submit: op %d (write) needs its contents: a string or an array of strings and tensors", i);
  size_t total = 0;
  lua_Integer n = luaL_len(L, idx);
  for (lua_Integer j = 1; j <= n; j++) {
    lua_geti(L, idx, j);
    size_t len = 0;
    nvl_tensor *t;
    if (lua_type(L, -1) == LUA_TSTRING) len = luaL_len(L, -1);
    else if ((t = as_tensor(L, -1)) != NULL) len = nvl_tensor_nbytes(t);
    else luaL_error(L, "bg_submit: op %d (write): piece %I is a %s, not a string or a live tensor", i, j, luaL_typename(L, -1));
    if (len > SIZE_MAX - total) luaL_error(L, "bg_submit: op %d (write): contents too large", i);
    total += len;
    lua_pop(L, 1);
  }
  return total;
}

/* The copies into the staging buffer, listed as the ops are (in pieces of at most 1 MiB), made
 * with streaming stores once every op is listed: by the OpenMP threads together (126 MB took 9-12
 * ms with memcpy, 6.5-7.5 ms streamed, on the 2-core CI VM), or by the writer thread for a deferred
 * list (bg.dc). */

/* Add the copy of n bytes, in pieces; -> 0, or -1 out of memory. */
static int copy_add(char *dst, const char *src, size_t n) {
  const size_t piece = (size_t)1 << 20;
  for (size_t at = 0; at < n; at += piece) {
    bg_copy *c = grow(copies.c, copies.n, &copies.cap, sizeof *c, 256);
    if (!c) return -1;
    copies.c = c;
    copies.c[copies.n++] = (bg_copy){dst + at, src + at, n - at < piece ? n - at : piece};
  }
  return 0;
}

/* memcpy with non-temporal (streaming) stores: the staging buffer is written once and read by the
 * writer's DMA, so its lines should neither evict the training's working set from the caches nor be
 * read before they are written (a plain store reads each line first). SSE2: every x86-64. */
static void copy_stream(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
  size_t head = (16 - (uintptr_t)dst % 16) % 16;
  if (n < head + 64) { memcpy(dst, src, n); return; }
  memcpy(dst, src, head);
  dst += head; src += head; n -= head;
  size_t body = n / 64 * 64;
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
    _mm_stream_si128((__m128i *)(dst + i), a);
    _mm_stream_si128((__m128i *)(dst + i + 16), b);
    _mm_stream_si128((__m128i *)(dst + i + 32), c);
    _mm_stream_si128((__m128i *)(dst + i + 48), d);
  }
  memcpy(dst + body, src + body, n - body);
  _mm_sfence(); /* the streamed lines visible before the writer thread starts */
#else
  memcpy(dst, src, n);
#endif
}

static void copy_run(void) {
  long n = (long)copies.n;
#pragma omp parallel for schedule(dynamic, 4) if (n > 8)
  for (long i = 0; i < n; i++) copy_stream(copies.c[i].dst, copies.c[i].src, copies.c[i].n);
  copies.n = 0;
}

/* List the copies of a write's contents at idx (checked by contents_size) to dst: strings and CPU
 * contiguous tensors from where they are (the ops table holds them until the copies are made; defer:
 * each such tensor's storage held too), any other tensor copied now through a contiguous host copy.
 * -> NVL_OK, the core's error, or NVL_ENOMEM. */
static nvl_status contents_copy(lua_State *L, int idx, char *dst, int defer) {
  size_t len;
  if (lua_type(L, idx) == LUA_TSTRING) {
    const char *s = lua_tolstring(L, idx, &len);
    return copy_add(dst, s, len) ? NVL_ENOMEM : NVL_OK;
  }
  lua_Integer n = luaL_len(L, idx);
  nvl_status st = NVL_OK;
  for (lua_Integer j = 1; j <= n && st == NVL_OK; j++) {
    lua_geti(L, idx, j);
    nvl_tensor *t = as_tensor(L, -1);
    if (t) len = nvl_tensor_nbytes(t);
    if (t && t->device == NVL_CPU && nvl_tensor_is_contiguous(t)) {
      if (copy_add(dst, nvl_tensor_data(t), len) || (defer && hold(t))) st = NVL_ENOMEM;
    } else if (t) {
      nvl_tensor c = nvl_tensor_null();
      st = nvl_tensor_clone_to(&c, t, t->dtype, NVL_CPU);
      if (st == NVL_OK) memcpy(dst, nvl_tensor_data(&c), len);
      nvl_tensor_release(&c);
    } else {
      const char *s = lua_tolstring(L, -1, &len);
      if (copy_add(dst, s, len)) st = NVL_ENOMEM;
    }
    dst += len;
    lua_pop(L, 1);
  }
  return st;
}

/* The staging buffer: anonymous memory in 2 MiB pages where the kernel gives them (madvise: the
 * first copy into 115 MB faults ~60 pages instead of ~28,000), page-aligned for O_DIRECT. */
#define BG_HUGE ((size_t)2 << 20)
static int stage_alloc(size_t total) {
  size_t len = (total + BG_HUGE - 1) / BG_HUGE * BG_HUGE;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return -1;
#ifdef MADV_HUGEPAGE
  (void)madvise(p, len, MADV_HUGEPAGE); /* best effort */
#endif
#ifdef MADV_DONTFORK
  (void)madvise(p, len, MADV_DONTFORK); /* a child (os.execute, io.popen) neither copies nor maps it */
#endif
  bg.stage = p;
  bg.stage_cap = len;
  return 0;
}

static void stage_free(void) {
  if (bg.stage) munmap(bg.stage, bg.stage_cap);
  bg.stage = NULL;
  bg.stage_cap = 0;
}

/* A staging buffer of at least bytes (a larger one is kept; a smaller one replaced): raises, naming
 * op, when it cannot be allocated. -> 1 when it was made now, else 0. */
static int stage_ensure(lua_State *L, const char *op, size_t bytes) {
  if (bytes <= bg.stage_cap) return 0;
  stage_free();
  if (stage_alloc(bytes) != 0) luaL_error(L, "%s: cannot allocate a staging buffer of %I bytes", op, (lua_Integer)bytes);
  return 1;
}

/* Check every op of the list at 1 (raising on a bad one) before anything is allocated; -> the
 * staging bytes its writes need. */
static size_t bg_check(lua_State *L, int n) {
  size_t total = 0;
  for (int i = 1; i <= n; i++) {
    lua_geti(L, 1, i);
    int t = lua_gettop(L);
    if (!lua_istable(L, t)) luaL_error(L, "bg_submit: op %d must be a table {kind, path, ...}", i);
    lua_geti(L, t, 1);
    int k = luaL_checkoption(L, -1, NULL, bg_kinds);
    lua_geti(L, t, 2);
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "bg_submit: op %d (%s) needs a path string", i, bg_kinds[k]);
    lua_geti(L, t, 3);
    if (k == BG_RENAME && lua_type(L, -1) != LUA_TSTRING)
      luaL_error(L, "bg_submit: op %d (%s) needs a second string", i, bg_kinds[k]);
    if (k == BG_WRITE) { /* each write's contents start aligned (O_DIRECT) */
      size_t len = contents_size(L, lua_gettop(L), i);
      if (len > SIZE_MAX - total - 2 * BG_ALIGN) luaL_error(L, "bg_submit: the writes' contents are too large");
      total += (len + BG_ALIGN - 1) / BG_ALIGN * BG_ALIGN;
    }
    lua_settop(L, t - 1);
  }
  return total;
}

/* Start the writer thread on the listed ops (and bg.dc's copies). -> 0, or -1 (nothing started). */
static int bg_start(void) {
  atomic_store(&bg.done, 0);
  bg.copied = 0;
  if (pthread_create(&bg.thread, NULL, bg_main, NULL) != 0) return -1;
  bg.running = 1;
  return 0;
}

/* core.bg_submit(ops [, defer]): start the thread on ops (see above); an error while one still runs.
 * defer: the CPU tensors' copies made by the thread (core.bg_snapshot_wait before changing them). */
static int l_bg_submit(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  int defer = lua_toboolean(L, 2);
  lua_settop(L, 1);
  bg_settle(L, "bg_submit");
  if (bg.err[0]) return luaL_error(L, "bg_submit: the previous list failed and nobody asked: %s", bg.err);
  int n = (int)luaL_len(L, 1);
  size_t total = bg_check(L, n); /* raises before any allocation */
  /* a deferred list is held from here (its tensors' storage by shares, as they are listed): should
   * anything below raise, the next submit, wait or release lets go of it and of the listed ops */
  if (defer) {
    lua_pushvalue(L, 1);
    bg.ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  stage_ensure(L, "bg_submit", total);
  bg.ops = calloc((size_t)(n > 0 ? n : 1), sizeof(bg_op));
  int oom = bg.ops == NULL;
  nvl_status copied = NVL_OK;
  size_t off = 0;
  for (int i = 1; i <= n && !oom && copied == NVL_OK; i++) {
    lua_geti(L, 1, i);
    int t = lua_gettop(L);
    lua_geti(L, t, 1);
    int k = luaL_checkoption(L, -1, NULL, bg_kinds); /* checked above: cannot raise */
    bg_op *o = &bg.ops[bg.n++];
    o->kind = k;
    lua_geti(L, t, 2);
    o->a = dupl(L, -1);
    oom = o->a == NULL;
    lua_geti(L, t, 3);
    if (k == BG_FSYNC) o->flag = lua_toboolean(L, -1);
    else if (k == BG_RENAME) oom = oom || (o->b = dupl(L, -1)) == NULL;
    else if (k == BG_WRITE) {
      o->off = off;
      o->blen = contents_size(L, t + 3, i);
      copied = contents_copy(L, t + 3, o->blen ? bg.stage + off : NULL, defer);
      off += (o->blen + BG_ALIGN - 1) / BG_ALIGN * BG_ALIGN;
    }
    lua_settop(L, t - 1);
  }
  if (oom || copied != NVL_OK) {
    bg_join(L);
    if (copied != NVL_OK && copied != NVL_ENOMEM) return nvl_lua_raise(L);
    return luaL_error(L, "bg_submit: out of memory");
  }
  if (defer) { /* the copies go to the thread; the list's strings and tensors stay held */
    bg.dc = copies.c;
    bg.ndc = copies.n;
    copies.c = NULL;
    copies.n = copies.cap = 0;
  } else {
    copy_run();
  }
  if (bg_start() != 0) {
    bg_join(L);
    return luaL_error(L, "bg_submit: cannot start the writer thread");
  }
  return 0;
}

/* core.bg_reserve(bytes): a staging buffer of at least bytes (a larger one is kept), its pages
 * faulted in by the writer thread: a run that will save in the background reserves at its start, so
 * that the first save does not pay for the allocation. An error while a list runs. */
static int l_bg_reserve(lua_State *L) {
  lua_Integer want = luaL_checkinteger(L, 1);
  luaL_argcheck(L, want >= 0, 1, "bytes must be >= 0");
  bg_settle(L, "bg_reserve");
  if (bg.err[0]) return luaL_error(L, "bg_reserve: the previous list failed and nobody asked: %s", bg.err);
  if (!stage_ensure(L, "bg_reserve", (size_t)want)) return 0;
  bg.ops = calloc(1, sizeof(bg_op));
  if (!bg.ops) return luaL_error(L, "bg_reserve: out of memory");
  bg.ops[0].kind = BG_TOUCH;
  bg.n = 1;
  if (bg_start() != 0) {
    bg_free();
    return luaL_error(L, "bg_reserve: cannot start the writer thread");
  }
  return 0;
}

/* core.bg_release(): free the staging buffer (when no list runs; the next submit allocates again) */
static int l_bg_release(lua_State *L) {
  bg_settle(L, "bg_release");
  stage_free();
  return 0;
}

/* core.write_tensor(file, t) -> true | nil, msg: t's raw bytes (row-major, little-endian) appended
 * to an open Lua file, without a Lua string in between (a CUDA tensor through a host copy) */
static int l_write_tensor(lua_State *L) {
  luaL_Stream *f = luaL_checkudata(L, 1, LUA_FILEHANDLE);
  if (f->closef == NULL) return luaL_error(L, "write_tensor: the file is closed");
  nvl_tensor *t = nvl_lua_check_tensor(L, 2, "write_tensor");
  size_t n = nvl_tensor_nbytes(t);
  nvl_tensor c = nvl_tensor_null();
  const nvl_tensor *src = t;
  if (t->device != NVL_CPU || !nvl_tensor_is_contiguous(t)) {
    CHECK(L, nvl_tensor_clone_to(&c, t, t->dtype, NVL_CPU));
    src = &c;
  }
  errno = 0;
  size_t w = n ? fwrite(nvl_tensor_data(src), 1, n, f->f) : 0;
  int e = errno;
  nvl_tensor_release(&c);
  if (w != n) {
    luaL_pushfail(L);
    lua_pushstring(L, e ? strerror(e) : "short write");
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* The writer's sentinel: when the Lua state closes (the end of a script), a list still running is
 * waited for, before the strings and tensors a deferred one holds are freed; its error is printed. */
static int l_bg_at_close(lua_State *L) {
  bg_join(L);
  if (bg.err[0]) {
    fprintf(stderr, "nvlua: %s\n", bg.err);
    bg.err[0] = 0;
  }
  return 0;
}

static const luaL_Reg sys_funcs[] = {{"fsync", l_fsync}, {"isatty", l_isatty}, {"peak_rss", l_peak_rss},
                                     {"tokens_from_bytes", l_tokens_from_bytes}, {"bg_submit", l_bg_submit},
                                     {"bg_wait", l_bg_wait}, {"bg_busy", l_bg_busy},
                                     {"bg_snapshot_wait", l_bg_snapshot_wait}, {"bg_release", l_bg_release},
                                     {"bg_reserve", l_bg_reserve}, {"write_tensor", l_write_tensor},
                                     {"file_stamp", l_file_stamp}, {"token_range", l_token_range},
                                     {"token_find_outside", l_token_find_outside},
                                     {"unix_time", l_unix_time}, {"hostname", l_hostname}, {"getpid", l_getpid},
                                     {"crc32c", l_crc32c}, {NULL, NULL}};

void nvl_lua_open_sys(lua_State *L) {
  luaL_setfuncs(L, sys_funcs, 0);
  /* the sentinel: a userdata in the registry whose __gc runs at lua_close */
  lua_newuserdatauv(L, 1, 0);
  lua_createtable(L, 0, 1);
  lua_pushcfunction(L, l_bg_at_close);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, "nvlua.bg_sentinel");
}
