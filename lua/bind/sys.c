/* sys.c: the few operating-system calls the Lua library needs and Lua lacks — fsync of a file
 * and of a directory (atomic checkpoint writes), a monotonic clock, whether stdout is a
 * terminal, the process's peak resident memory — and token decoding from raw bytes (u16/u32
 * little-endian shard files) into i64 tensors. */
#include <errno.h>
#include <fcntl.h>
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

static const luaL_Reg sys_funcs[] = {{"fsync", l_fsync}, {"isatty", l_isatty}, {"peak_rss", l_peak_rss},
                                     {"tokens_from_bytes", l_tokens_from_bytes}, {NULL, NULL}};

void nvl_lua_open_sys(lua_State *L) { luaL_setfuncs(L, sys_funcs, 0); }
