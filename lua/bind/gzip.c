/* gzip.c: core.gunzip — inflate gzip (or zlib) data held in a Lua string, with zlib (Debian
 * zlib1g-dev). Evaluation reads its requests from requests.jsonl.gz files (lua/nvlua/eval.lua).
 * Not a streaming reader: the largest file read this way (HellaSwag's requests, 80k lines) inflates
 * to about 90 MB, which a Lua string holds. Not a compressor. */
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <stdio.h>
#include <string.h>
#include <zlib.h>
#include "bind.h"

#define GZ_MT "nvlua.gunzip_state"

/* zlib's inflate state in a userdata, so that a Lua error half-way (out of memory growing the output)
 * leaks nothing: its __gc ends the stream */
typedef struct {
  z_stream zs;
  int live; /* inflateInit2 succeeded, inflateEnd not yet called */
} gz_state;

static int gz_gc(lua_State *L) {
  gz_state *g = luaL_checkudata(L, 1, GZ_MT);
  if (g->live) inflateEnd(&g->zs);
  g->live = 0;
  return 0;
}

/* core.gunzip(data [, name]) -> text | nil, msg: the inflated bytes of gzip data (concatenated
 * members, then any zero padding, as gzip -d reads them); msg names `name` (a file's path) and what zlib found wrong. */
static int l_gunzip(lua_State *L) {
  size_t n;
  const char *src = luaL_checklstring(L, 1, &n);
  const char *name = luaL_optstring(L, 2, "data");
  lua_settop(L, 2);
  gz_state *g = lua_newuserdatauv(L, sizeof *g, 0); /* index 3 */
  memset(g, 0, sizeof *g);
  luaL_setmetatable(L, GZ_MT);
  /* 15 + 32: a 32 KiB window and automatic gzip / zlib header detection */
  if (inflateInit2(&g->zs, 15 + 32) != Z_OK) return luaL_error(L, "gunzip: zlib could not start: out of memory");
  g->live = 1;
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  g->zs.next_in = (Bytef *)src;
  g->zs.avail_in = (uInt)(n > UINT_MAX ? UINT_MAX : n);
  size_t left = n - g->zs.avail_in; /* input beyond the first 4 GiB, fed as avail_in drains */
  int rc = Z_OK;
  const char *why = NULL;
  for (;;) {
    char *out = luaL_prepbuffsize(&b, 1 << 16);
    g->zs.next_out = (Bytef *)out;
    g->zs.avail_out = 1 << 16;
    rc = inflate(&g->zs, Z_NO_FLUSH);
    luaL_addsize(&b, (1 << 16) - g->zs.avail_out);
    if (g->zs.avail_in == 0 && left > 0) {
      g->zs.avail_in = (uInt)(left > UINT_MAX ? UINT_MAX : left);
      left -= g->zs.avail_in;
    }
    if (rc == Z_STREAM_END) {
      if (g->zs.avail_in == 0) break;
      /* zero bytes after the last member (padding to a block size, as tape archives leave) end the
       * data, as gzip -d and Python's gzip read it; other bytes must be another member */
      size_t at = n - left - g->zs.avail_in;
      while (at < n && src[at] == 0) at++;
      if (at == n) break;
      if (inflateReset(&g->zs) != Z_OK) break; /* another gzip member follows */
      continue;
    }
    if (rc == Z_BUF_ERROR && g->zs.avail_in == 0) {
      rc = Z_DATA_ERROR; /* the input ended inside a member */
      why = "unexpected end of data: truncated file?";
    }
    if (rc != Z_OK) break;
  }
  if (rc != Z_STREAM_END) {
    char msg[256];
    snprintf(msg, sizeof msg, "gunzip: %s: not valid gzip data (%s, at byte %lu of %lu)", name,
             why ? why : g->zs.msg ? g->zs.msg : "zlib error", (unsigned long)(n - left - g->zs.avail_in), (unsigned long)n);
    inflateEnd(&g->zs);
    g->live = 0;
    luaL_pushresult(&b);
    lua_pop(L, 1);
    luaL_pushfail(L);
    lua_pushstring(L, msg);
    return 2;
  }
  inflateEnd(&g->zs);
  g->live = 0;
  luaL_pushresult(&b);
  return 1;
}

static const luaL_Reg gzip_funcs[] = {{"gunzip", l_gunzip}, {NULL, NULL}};

void nvl_lua_open_gzip(lua_State *L) {
  luaL_newmetatable(L, GZ_MT);
  lua_pushcfunction(L, gz_gc);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  luaL_setfuncs(L, gzip_funcs, 0);
}
