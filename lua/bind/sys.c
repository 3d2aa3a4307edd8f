/* sys.c: the few operating-system calls the Lua library needs and Lua lacks — fsync of a file
 * and of a directory (atomic checkpoint writes), a background writer thread that runs a list of
 * file operations in order (checkpoints that do not block training), a monotonic clock, whether
 * stdout is a terminal, the process's peak resident memory — and token decoding from raw bytes
 * (u16/u32 little-endian shard files) into i64 tensors. */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include "bind.h"

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

/* ---- the background writer ----------------------------------------------------------------------
 * One thread at a time runs a list of operations, in order, stopping at the first that fails:
 *   {"fsync", path, is_dir}   flush a file or a directory
 *   {"write", path, text}     path.tmp written, fsync'd, renamed over path, the directory fsync'd
 *   {"rename", from, to}      {"unlink", path}   {"rmtree", path} (a file or a directory, recursively)
 *   {"rmdir", path}           {"kill", point}   SIGKILL this process (crash tests: NVLUA_FAULT)
 * The strings are copied when the list is submitted; the thread never touches Lua. core.bg_submit
 * refuses while a list runs; core.bg_wait() joins it and returns nil or its error message;
 * core.bg_busy() says whether one runs. */

enum { BG_FSYNC, BG_WRITE, BG_RENAME, BG_UNLINK, BG_RMTREE, BG_RMDIR, BG_KILL };

typedef struct {
  int kind, flag;
  char *a, *b;      /* paths, or the text of a write (b, blen bytes) */
  size_t blen;
} bg_op;

static struct {
  pthread_t thread;
  int running;      /* a thread was started and not joined */
  volatile int done;
  bg_op *ops;
  int n;
  char err[512];
} bg;

static int fsync_path(const char *path, int dir) {
  int fd = open(path, dir ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return -1;
  int rc = fsync(fd), e = errno;
  close(fd);
  errno = e;
  return rc;
}

static int write_atomic(const char *path, const char *text, size_t len) {
  char tmp[PATH_MAX + 8];
  if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) { errno = ENAMETOOLONG; return -1; }
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(fd, text + off, len - off);
    if (w < 0) { int e = errno; close(fd); errno = e; return -1; }
    off += (size_t)w;
  }
  if (fsync(fd) != 0) { int e = errno; close(fd); errno = e; return -1; }
  if (close(fd) != 0 || rename(tmp, path) != 0) return -1;
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

static void *bg_main(void *arg) {
  (void)arg;
  for (int i = 0; i < bg.n; i++) {
    bg_op *o = &bg.ops[i];
    int rc = 0;
    const char *what = "";
    switch (o->kind) {
      case BG_FSYNC: rc = fsync_path(o->a, o->flag); what = "fsync"; break;
      case BG_WRITE: rc = write_atomic(o->a, o->b, o->blen); what = "write"; break;
      case BG_RENAME: rc = rename(o->a, o->b); what = "rename"; break;
      case BG_UNLINK: rc = unlink(o->a) != 0 && errno != ENOENT ? -1 : 0; what = "remove"; break;
      case BG_RMTREE: rc = nftw(o->a, rm_one, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT ? -1 : 0; what = "remove"; break;
      case BG_RMDIR: rc = rmdir(o->a); what = "remove the directory"; break;
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
  bg.done = 1;
  return NULL;
}

static void bg_free(void) {
  for (int i = 0; i < bg.n; i++) { free(bg.ops[i].a); free(bg.ops[i].b); }
  free(bg.ops);
  bg.ops = NULL;
  bg.n = 0;
}

/* core.bg_wait() -> nil | the error message of the list that ran (joins it) */
static int l_bg_wait(lua_State *L) {
  if (bg.running) {
    pthread_join(bg.thread, NULL);
    bg.running = 0;
    bg_free();
  }
  if (bg.err[0]) {
    lua_pushstring(L, bg.err);
    bg.err[0] = 0;
    return 1;
  }
  lua_pushnil(L);
  return 1;
}

/* core.bg_busy() -> true while a list runs */
static int l_bg_busy(lua_State *L) {
  lua_pushboolean(L, bg.running && !bg.done);
  return 1;
}

/* a malloc'd copy of the string at idx (checked already), or NULL */
static char *dupl(lua_State *L, int idx, size_t *len) {
  size_t n;
  const char *s = lua_tolstring(L, idx, &n);
  char *d = malloc(n + 1);
  if (!d) return NULL;
  memcpy(d, s, n);
  d[n] = 0;
  if (len) *len = n;
  return d;
}

static const char *const bg_kinds[] = {"fsync", "write", "rename", "unlink", "rmtree", "rmdir", "kill", NULL};

/* Check every op of the list at 1 (raising on a bad one) before anything is allocated. */
static void bg_check(lua_State *L, int n) {
  for (int i = 1; i <= n; i++) {
    lua_geti(L, 1, i);
    int t = lua_gettop(L);
    if (!lua_istable(L, t)) luaL_error(L, "bg_submit: op %d must be a table {kind, path, ...}", i);
    lua_geti(L, t, 1);
    int k = luaL_checkoption(L, -1, NULL, bg_kinds);
    lua_geti(L, t, 2);
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "bg_submit: op %d (%s) needs a path string", i, bg_kinds[k]);
    lua_geti(L, t, 3);
    if ((k == BG_WRITE || k == BG_RENAME) && lua_type(L, -1) != LUA_TSTRING)
      luaL_error(L, "bg_submit: op %d (%s) needs a second string", i, bg_kinds[k]);
    lua_settop(L, t - 1);
  }
}

/* core.bg_submit(ops): start the thread on ops (see above); an error while one still runs */
static int l_bg_submit(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  if (bg.running && !bg.done) return luaL_error(L, "bg_submit: the previous list is still running (core.bg_wait first)");
  if (bg.running) { pthread_join(bg.thread, NULL); bg.running = 0; bg_free(); }
  if (bg.err[0]) return luaL_error(L, "bg_submit: the previous list failed and nobody asked: %s", bg.err);
  int n = (int)luaL_len(L, 1);
  bg_check(L, n); /* raises before any allocation */
  bg.ops = calloc((size_t)(n > 0 ? n : 1), sizeof(bg_op));
  int oom = bg.ops == NULL;
  for (int i = 1; i <= n && !oom; i++) {
    lua_geti(L, 1, i);
    int t = lua_gettop(L);
    lua_geti(L, t, 1);
    int k = luaL_checkoption(L, -1, NULL, bg_kinds); /* checked above: cannot raise */
    bg_op *o = &bg.ops[bg.n++];
    o->kind = k;
    lua_geti(L, t, 2);
    o->a = dupl(L, -1, NULL);
    oom = o->a == NULL;
    lua_geti(L, t, 3);
    if (k == BG_FSYNC) o->flag = lua_toboolean(L, -1);
    else if (k == BG_WRITE || k == BG_RENAME) oom = oom || (o->b = dupl(L, -1, &o->blen)) == NULL;
    lua_settop(L, t - 1);
  }
  if (oom) {
    bg_free();
    return luaL_error(L, "bg_submit: out of memory");
  }
  bg.done = 0;
  if (pthread_create(&bg.thread, NULL, bg_main, NULL) != 0) {
    bg_free();
    return luaL_error(L, "bg_submit: cannot start the writer thread");
  }
  bg.running = 1;
  return 0;
}

static const luaL_Reg sys_funcs[] = {{"fsync", l_fsync}, {"isatty", l_isatty}, {"peak_rss", l_peak_rss},
                                     {"tokens_from_bytes", l_tokens_from_bytes}, {"bg_submit", l_bg_submit},
                                     {"bg_wait", l_bg_wait}, {"bg_busy", l_bg_busy}, {NULL, NULL}};

void nvl_lua_open_sys(lua_State *L) { luaL_setfuncs(L, sys_funcs, 0); }
