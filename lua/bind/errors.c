/* errors.c: errors for people. A user error is one the person running nvlua fixes from its message
 * alone: a bad option or config value, a missing or malformed file, a shape, size or format that
 * does not fit. It is raised as an ordinary string error (pcall, T.raises, string methods see
 * nothing new), but through these helpers, which first remember the message in the registry; the
 * program's message handler (main.c, msghandler) prints a remembered message as its one line,
 * without a stack traceback. Every other error — a Lua runtime error, an error() of a script, a
 * failed CUDA call, a freed tensor — keeps its traceback; NVLUA_TRACEBACK=1 gives one to all.
 * What is a user error:
 *   - core's failures with status NVL_EINVAL, NVL_EUNSUPPORTED, NVL_EIO and NVL_ENOMEM (nvl_lua_raise);
 *   - the options-table checks of the bindings (opts.c);
 *   - in Lua, what is raised with core.user_error (util.user_error, util.check_opts, nvlua.config,
 *     the option checks of the library's modules, its file readers).
 * The mark is the message's text: the last user error's string is kept (one registry slot) and a
 * message equal to it is a user error. An error caught and raised again unchanged (error(err, 0))
 * stays one; a message built from it ("from_pretrained: " .. err) is a new error, marked only when
 * it is raised through the helpers too.
 * Not here: printing (main.c). */
#include <lauxlib.h>
#include <lua.h>
#include <stdarg.h>
#include "bind.h"

static const char USER_ERROR = 0; /* its address keys the registry slot */

void nvl_lua_mark_user_error(lua_State *L, int idx) {
  lua_pushvalue(L, idx);
  lua_rawsetp(L, LUA_REGISTRYINDEX, &USER_ERROR);
}

int nvl_lua_is_user_error(lua_State *L, int idx) {
  if (lua_type(L, idx) != LUA_TSTRING) return 0;
  idx = lua_absindex(L, idx);
  lua_rawgetp(L, LUA_REGISTRYINDEX, &USER_ERROR);
  int r = lua_rawequal(L, idx, -1);
  lua_pop(L, 1);
  return r;
}

int nvl_lua_user_error(lua_State *L, const char *fmt, ...) {
  va_list ap;
  luaL_where(L, 1);
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  lua_concat(L, 2);
  nvl_lua_mark_user_error(L, -1);
  return lua_error(L);
}

int nvl_lua_raise(lua_State *L) {
  switch (nvl_last_status()) {
    case NVL_EINVAL: case NVL_EUNSUPPORTED: case NVL_EIO: case NVL_ENOMEM:
      return nvl_lua_user_error(L, "%s", nvl_last_error());
    default:
      return luaL_error(L, "%s", nvl_last_error());
  }
}

/* core.user_error(msg [, level = 1]): error(msg, level) for a string msg (the position of level
 * prepended as error() does), marked as a user error. */
static int l_user_error(lua_State *L) {
  luaL_checktype(L, 1, LUA_TSTRING);
  int level = (int)luaL_optinteger(L, 2, 1);
  lua_settop(L, 1);
  if (level > 0) {
    luaL_where(L, level);
    lua_insert(L, 1);
    lua_concat(L, 2);
  }
  nvl_lua_mark_user_error(L, 1);
  return lua_error(L);
}

/* core.is_user_error(v) -> true when v is the message of the last user error */
static int l_is_user_error(lua_State *L) {
  lua_pushboolean(L, nvl_lua_is_user_error(L, 1));
  return 1;
}

static const luaL_Reg error_funcs[] = {{"user_error", l_user_error}, {"is_user_error", l_is_user_error}, {NULL, NULL}};

void nvl_lua_open_errors(lua_State *L) { luaL_setfuncs(L, error_funcs, 0); }
