/* opts.c: checking options tables passed to the bindings (see bind.h): unknown keys, wrong types
 * and missing required keys raise user errors (errors.c) naming the op, the key and the valid keys
 * (and, for a mistyped key, the valid ones closest to it). */
#include <lauxlib.h>
#include <lua.h>
#include <string.h>
#include "bind.h"

/* Raise if the table at idx has a key not in valid (NULL-terminated). */
void nvl_lua_check_keys(lua_State *L, int idx, const char *op, const char *const *valid) {
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    lua_pop(L, 1);
    int ok = 0;
    if (lua_type(L, -1) == LUA_TSTRING)
      for (const char *const *k = valid; *k; k++)
        if (strcmp(*k, lua_tostring(L, -1)) == 0) ok = 1;
    if (!ok) {
      const char *key = luaL_tolstring(L, -1, NULL);
      luaL_Buffer b;
      luaL_buffinit(L, &b);
      for (const char *const *k = valid; *k; k++) {
        if (k != valid) luaL_addstring(&b, ", ");
        luaL_addstring(&b, *k);
      }
      luaL_pushresult(&b);
      int n = 0;
      while (valid[n]) n++;
      if (lua_type(L, -3) == LUA_TSTRING && nvl_lua_push_did_you_mean(L, key, valid, n)) /* the key itself a string */
        nvl_lua_user_error(L, "%s: unknown option '%s' (valid: %s); %s", op, key, lua_tostring(L, -2), lua_tostring(L, -1));
      nvl_lua_user_error(L, "%s: unknown option '%s' (valid: %s)", op, key, lua_tostring(L, -1));
    }
  }
}

/* Number option key of the table at idx: *v unchanged when absent, unless required. */
void nvl_lua_opt_number(lua_State *L, int idx, const char *op, const char *key, double *v, int required) {
  int t = lua_getfield(L, idx, key);
  if (t == LUA_TNIL) {
    if (required) nvl_lua_user_error(L, "%s: option '%s' is required", op, key);
  } else if (t != LUA_TNUMBER) {
    nvl_lua_user_error(L, "%s: option '%s' must be a number, got %s", op, key, luaL_typename(L, -1));
  } else {
    *v = lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
}

void nvl_lua_opt_integer(lua_State *L, int idx, const char *op, const char *key, int64_t *v, int required) {
  int t = lua_getfield(L, idx, key);
  if (t == LUA_TNIL) {
    if (required) nvl_lua_user_error(L, "%s: option '%s' is required", op, key);
  } else {
    int ok;
    lua_Integer i = lua_tointegerx(L, -1, &ok);
    if (t != LUA_TNUMBER || !ok)
      nvl_lua_user_error(L, "%s: option '%s' must be an integer, got %s", op, key,
                 t == LUA_TNUMBER ? lua_pushfstring(L, "%f", lua_tonumber(L, -1)) : luaL_typename(L, -1));
    *v = (int64_t)i;
  }
  lua_pop(L, 1);
}

void nvl_lua_opt_boolean(lua_State *L, int idx, const char *op, const char *key, int *v) {
  int t = lua_getfield(L, idx, key);
  if (t == LUA_TBOOLEAN) *v = lua_toboolean(L, -1);
  else if (t != LUA_TNIL)
    nvl_lua_user_error(L, "%s: option '%s' must be a boolean, got %s", op, key, luaL_typename(L, -1));
  lua_pop(L, 1);
}
