/* attention.c: the Lua binding of causal grouped-query attention (core/layers.h):
 *   core.attention_forward(q, k, v, scale [, {reference = true}]) -> out, lse
 *   core.attention_backward(dout, q, k, v, out, lse, scale [, {reference = true}]) -> dq, dk, dv
 * q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T); f32 CPU tensors.
 * reference = true runs the scalar double-precision reference kernel instead of the fast one.
 * Core checks the shapes and dtypes; here only the Lua argument types. */
#include <lauxlib.h>
#include <lua.h>
#include <string.h>
#include "bind.h"
#include "cpu/attention_cpu.h"
#include "layers.h"

/* Argument i: nil/none or an options table whose only key is `reference`; returns its truth. */
static int check_opts(lua_State *L, int i, const char *fname) {
  if (lua_isnoneornil(L, i)) return 0;
  luaL_checktype(L, i, LUA_TTABLE);
  lua_pushnil(L);
  while (lua_next(L, i)) {
    lua_pop(L, 1);
    if (lua_type(L, -1) != LUA_TSTRING || strcmp(lua_tostring(L, -1), "reference") != 0) {
      const char *key = luaL_tolstring(L, -1, NULL);
      return luaL_error(L, "%s: unknown option '%s' (valid: reference)", fname, key);
    }
  }
  lua_getfield(L, i, "reference");
  int t = lua_type(L, -1), use_ref = lua_toboolean(L, -1);
  if (t != LUA_TNIL && t != LUA_TBOOLEAN) return luaL_error(L, "%s: reference must be a boolean", fname);
  lua_pop(L, 1);
  return use_ref;
}

/* core.attention_forward(q, k, v, scale [, opts]) */
static int l_attention_forward(lua_State *L) {
  const char *fname = "attention_forward";
  nvl_tensor *q = nvl_lua_check_tensor(L, 1, fname);
  nvl_tensor *k = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 3, fname);
  double scale = luaL_checknumber(L, 4);
  int use_ref = check_opts(L, 5, fname);
  nvl_tensor *out = nvl_lua_push_tensor(L);
  nvl_tensor *lse = nvl_lua_push_tensor(L);
  if (nvl_attention_forward_ex(out, lse, q, k, v, scale, use_ref) != NVL_OK) return nvl_lua_raise(L);
  return 2;
}

/* core.attention_backward(dout, q, k, v, out, lse, scale [, opts]) */
static int l_attention_backward(lua_State *L) {
  const char *fname = "attention_backward";
  nvl_tensor *dout = nvl_lua_check_tensor(L, 1, fname);
  nvl_tensor *q = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *k = nvl_lua_check_tensor(L, 3, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 4, fname);
  nvl_tensor *out = nvl_lua_check_tensor(L, 5, fname);
  nvl_tensor *lse = nvl_lua_check_tensor(L, 6, fname);
  double scale = luaL_checknumber(L, 7);
  int use_ref = check_opts(L, 8, fname);
  nvl_tensor *dq = nvl_lua_push_tensor(L);
  nvl_tensor *dk = nvl_lua_push_tensor(L);
  nvl_tensor *dv = nvl_lua_push_tensor(L);
  if (nvl_attention_backward_ex(dq, dk, dv, dout, q, k, v, out, lse, scale, use_ref) != NVL_OK) return nvl_lua_raise(L);
  return 3;
}

static const luaL_Reg attention_funcs[] = {
  {"attention_forward", l_attention_forward}, {"attention_backward", l_attention_backward}, {NULL, NULL}};

void nvl_lua_open_attention(lua_State *L) { luaL_setfuncs(L, attention_funcs, 0); }
