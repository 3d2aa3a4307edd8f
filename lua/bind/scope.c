/* scope.c: the per-step arena — core.scope, keep, unscope, adopt, unscoped (nv.scope, ...;
 * lua/nvlua/init.lua's help and the README say how to use them).
 * While a scope is open, every tensor and quantized tensor userdata the binding pushes
 * (nvl_lua_push_tensor, quant.c's push_q) is recorded in the innermost open scope of the running
 * coroutine. When the scope's function returns, what it returns survives: a returned tensor, and
 * a tensor that is a value of a returned plain table (no metatable; one level deep, not nested
 * tables), moves to the enclosing scope (to none at the outermost); every other recorded tensor
 * is released as t:free() releases it. Views hold their own reference to the storage (core/
 * tensor.c refcounts it), so releasing a base never invalidates a view that survives, and
 * releasing a tensor twice is harmless. An error inside the function releases the whole scope
 * as it unwinds (a to-be-closed slot), leaving the error and its traceback untouched.
 * Not here: the tensors (tensor.c, quant.c), memory accounting (core/).
 *
 * A coroutine cannot yield from inside nv.scope or nv.unscoped: their function runs under a C call
 * (lua_call), and the scope must close when it returns. Lua's own refusal, "attempt to yield across
 * a C-call boundary", names neither, so loading this module replaces coroutine.yield with a
 * function that raises a message saying so when the running coroutine has a scope open (or runs
 * under nv.unscoped), and otherwise yields exactly as Lua's does.
 *
 * Layout: registry[&SCOPES] = {[coroutine] = stack} with weak keys (a dead coroutine's scopes go
 * with it); stack[d] = scope d, 1 outermost; scope[i] = the i-th userdata recorded (false once
 * it left), scope[userdata] = i; stack.unscoped = true for the stack nv.unscoped puts in place. */
#include <lauxlib.h>
#include <lua.h>
#include "bind.h"
#include "quant.h"

#define SCOPE_MT "nvlua.Scope"
#define UNSCOPED_MT "nvlua.Unscoped"

static const char SCOPES = 0; /* its address keys the registry */

/* The guard of an open nv.scope call: a to-be-closed slot that releases the scope on an error. */
typedef struct {
  lua_Integer depth; /* the scope it opened */
  int open;          /* 0 once closed, by the call's return or by its __close */
} scope_guard;

/* Push the running coroutine's stack of scopes and return 1; without one, push one when create,
 * else push nothing and return 0. */
static int push_stack(lua_State *L, int create) {
  if (lua_rawgetp(L, LUA_REGISTRYINDEX, &SCOPES) != LUA_TTABLE) {
    lua_pop(L, 1);
    if (!create) return 0;
    lua_newtable(L);
    lua_createtable(L, 0, 1);
    lua_pushliteral(L, "k");
    lua_setfield(L, -2, "__mode");
    lua_setmetatable(L, -2);
    lua_pushvalue(L, -1);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &SCOPES);
  }
  lua_pushthread(L);
  if (lua_rawget(L, -2) != LUA_TTABLE) {
    lua_pop(L, 1);
    if (!create) {
      lua_pop(L, 1);
      return 0;
    }
    lua_newtable(L);
    lua_pushthread(L);
    lua_pushvalue(L, -2);
    lua_rawset(L, -4);
  }
  lua_remove(L, -2);
  return 1;
}

/* The tensor or quantized tensor at idx, released; anything else is left alone. */
static void release(lua_State *L, int idx) {
  nvl_tensor *t = luaL_testudata(L, idx, NVL_TENSOR_MT);
  if (t) {
    nvl_tensor_release(t);
    return;
  }
  nvl_qtensor *q = luaL_testudata(L, idx, NVL_QTENSOR_MT);
  if (q) nvl_qtensor_release(q);
}

static int is_tensor(lua_State *L, int idx) {
  if (lua_type(L, idx) != LUA_TUSERDATA || !lua_getmetatable(L, idx)) return 0;
  luaL_getmetatable(L, NVL_TENSOR_MT);
  int r = lua_rawequal(L, -1, -2);
  lua_pop(L, 1);
  if (!r) {
    luaL_getmetatable(L, NVL_QTENSOR_MT);
    r = lua_rawequal(L, -1, -2);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return r;
}

/* Record the userdata at v in the scope at sc (once). */
static void scope_add(lua_State *L, int sc, int v) {
  lua_pushvalue(L, v);
  if (lua_rawget(L, sc) != LUA_TNIL) {
    lua_pop(L, 1);
    return;
  }
  lua_pop(L, 1);
  lua_Integer n = (lua_Integer)lua_rawlen(L, sc) + 1;
  lua_pushvalue(L, v);
  lua_rawseti(L, sc, n);
  lua_pushvalue(L, v);
  lua_pushinteger(L, n);
  lua_rawset(L, sc);
}

/* Move the userdata at v out of the scope at from, into the scope at to (0: into none), when
 * from holds it. */
static void move_one(lua_State *L, int from, int to, int v) {
  lua_pushvalue(L, v);
  if (lua_rawget(L, from) != LUA_TNUMBER) {
    lua_pop(L, 1);
    return;
  }
  lua_Integer i = lua_tointeger(L, -1);
  lua_pop(L, 1);
  lua_pushboolean(L, 0);
  lua_rawseti(L, from, i);
  lua_pushvalue(L, v);
  lua_pushnil(L);
  lua_rawset(L, from);
  if (to) scope_add(L, to, v);
}

/* move_one for the value at v: a tensor, or each tensor that is a value of a plain table. */
static void move_value(lua_State *L, int from, int to, int v) {
  if (is_tensor(L, v)) {
    move_one(L, from, to, v);
  } else if (lua_type(L, v) == LUA_TTABLE) {
    if (lua_getmetatable(L, v)) {
      lua_pop(L, 1);
      return;
    }
    lua_pushnil(L);
    while (lua_next(L, v)) {
      if (is_tensor(L, -1)) move_one(L, from, to, lua_gettop(L));
      lua_pop(L, 1);
    }
  }
}

/* Close scope d of the stack at si: the values at [first, last] move to scope d - 1 (to none
 * when d is 1), then every tensor still recorded in d is released, the latest first. */
static void scope_close(lua_State *L, int si, lua_Integer d, int first, int last) {
  lua_rawgeti(L, si, d);
  int sc = lua_gettop(L);
  if (first <= last) {
    int to = 0;
    if (d > 1) {
      lua_rawgeti(L, si, d - 1);
      to = lua_gettop(L);
    }
    for (int i = first; i <= last; i++) move_value(L, sc, to, i);
    if (to) lua_pop(L, 1);
  }
  for (lua_Integer i = (lua_Integer)lua_rawlen(L, sc); i >= 1; i--) {
    lua_rawgeti(L, sc, i);
    release(L, -1);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  lua_pushnil(L);
  lua_rawseti(L, si, d);
}

/* Close every scope of the stack at si from the innermost down to depth d, returning nothing. */
static void close_down_to(lua_State *L, int si, lua_Integer d) {
  for (lua_Integer k = (lua_Integer)lua_rawlen(L, si); k >= d; k--) scope_close(L, si, k, 1, 0);
}

void nvl_lua_scope_record(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  luaL_checkstack(L, 6, "nv.scope");
  if (!push_stack(L, 0)) return;
  lua_Integer d = (lua_Integer)lua_rawlen(L, -1);
  if (d > 0) {
    lua_rawgeti(L, -1, d);
    scope_add(L, lua_gettop(L), idx);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* The guard's __close: an error unwinds through the nv.scope call, so its scope (and any left
 * open inside it) releases everything it recorded. */
static int guard_close(lua_State *L) {
  scope_guard *g = luaL_checkudata(L, 1, SCOPE_MT);
  if (g->open) {
    g->open = 0;
    lua_getiuservalue(L, 1, 1);
    close_down_to(L, lua_gettop(L), g->depth);
  }
  return 0;
}

/* core.scope(fn, ...) -> fn(...)'s results, with a scope open while fn runs */
static int l_scope(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  int nargs = lua_gettop(L) - 1;
  push_stack(L, 1);
  lua_Integer d = (lua_Integer)lua_rawlen(L, -1) + 1;
  lua_newtable(L);
  lua_rawseti(L, -2, d);
  scope_guard *g = lua_newuserdatauv(L, sizeof *g, 1);
  g->depth = d;
  g->open = 1;
  luaL_setmetatable(L, SCOPE_MT);
  lua_insert(L, -2);
  lua_setiuservalue(L, -2, 1); /* the guard keeps its stack */
  lua_insert(L, 1);            /* guard, fn, args... */
  lua_toclose(L, 1);
  lua_call(L, nargs, LUA_MULTRET);
  int top = lua_gettop(L); /* guard, results... */
  luaL_checkstack(L, 10, "nv.scope"); /* lua_call leaves no room beyond the results */
  g->open = 0;
  lua_getiuservalue(L, 1, 1);
  int si = lua_gettop(L);
  close_down_to(L, si, d + 1); /* none is left open unless a coroutine misused them */
  scope_close(L, si, d, 2, top);
  lua_pop(L, 1);
  return top - 1;
}

/* The guard of an nv.unscoped call: puts the coroutine's stack of scopes (its user value) back. */
static int unscoped_close(lua_State *L) {
  int *open = luaL_checkudata(L, 1, UNSCOPED_MT);
  if (*open) {
    *open = 0;
    lua_rawgetp(L, LUA_REGISTRYINDEX, &SCOPES); /* made by l_unscoped */
    lua_pushthread(L);
    lua_getiuservalue(L, 1, 1);
    lua_rawset(L, -3);
  }
  return 0;
}

/* core.unscoped(fn, ...) -> fn(...)'s results: fn runs as if no scope were open (its own scopes
 * nest from none), so what it makes and stores is no open scope's to free: callbacks called from
 * inside a scope that keep what they make (recipe:trace hooks). */
static int l_unscoped(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  int nargs = lua_gettop(L) - 1;
  int *open = lua_newuserdatauv(L, sizeof *open, 1);
  *open = 1;
  luaL_setmetatable(L, UNSCOPED_MT);
  push_stack(L, 1);
  lua_setiuservalue(L, -2, 1); /* the stack to put back */
  lua_rawgetp(L, LUA_REGISTRYINDEX, &SCOPES);
  lua_pushthread(L);
  lua_newtable(L);
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "unscoped"); /* for l_yield */
  lua_rawset(L, -3);
  lua_pop(L, 1);
  lua_insert(L, 1); /* guard, fn, args... */
  lua_toclose(L, 1);
  lua_call(L, nargs, LUA_MULTRET);
  return lua_gettop(L) - 1; /* returning closes the guard */
}

/* core.keep(...) -> its arguments: the tensors among them (and in plain tables among them, one
 * level deep) leave the innermost scope for the enclosing one (none at the outermost). */
static int l_keep(lua_State *L) {
  int n = lua_gettop(L);
  if (!push_stack(L, 0)) return n;
  int si = lua_gettop(L);
  lua_Integer d = (lua_Integer)lua_rawlen(L, si);
  if (d > 0) {
    lua_rawgeti(L, si, d);
    int sc = lua_gettop(L), to = 0;
    if (d > 1) {
      lua_rawgeti(L, si, d - 1);
      to = lua_gettop(L);
    }
    for (int i = 1; i <= n; i++) move_value(L, sc, to, i);
  }
  lua_settop(L, n);
  return n;
}

/* core.unscope(...) -> its arguments: the tensors among them (and in plain tables among them, one
 * level deep) leave every open scope; their holder frees them. */
static int l_unscope(lua_State *L) {
  int n = lua_gettop(L);
  if (!push_stack(L, 0)) return n;
  int si = lua_gettop(L);
  for (lua_Integer d = (lua_Integer)lua_rawlen(L, si); d >= 1; d--) {
    lua_rawgeti(L, si, d);
    for (int i = 1; i <= n; i++) move_value(L, si + 1, 0, i);
    lua_pop(L, 1);
  }
  lua_settop(L, n);
  return n;
}

/* core.adopt(...) -> its arguments: the tensors among them (and in plain tables among them, one
 * level deep) are recorded in the innermost scope, which releases them when it ends. */
static int l_adopt(lua_State *L) {
  int n = lua_gettop(L);
  lua_Integer d = 0;
  if (push_stack(L, 0)) d = (lua_Integer)lua_rawlen(L, -1);
  if (d == 0) return luaL_error(L, "adopt: no scope is open (call it inside nv.scope)");
  lua_rawgeti(L, -1, d);
  int sc = lua_gettop(L);
  for (int i = 1; i <= n; i++) {
    if (is_tensor(L, i)) {
      scope_add(L, sc, i);
    } else if (lua_type(L, i) == LUA_TTABLE) {
      if (lua_getmetatable(L, i)) {
        lua_pop(L, 1);
        continue;
      }
      lua_pushnil(L);
      while (lua_next(L, i)) {
        if (is_tensor(L, -1)) scope_add(L, sc, lua_gettop(L));
        lua_pop(L, 1);
      }
    }
  }
  lua_settop(L, n);
  return n;
}

/* core.scope_depth() -> the number of scopes open in the running coroutine */
static int l_scope_depth(lua_State *L) {
  lua_Integer d = 0;
  if (push_stack(L, 0)) d = (lua_Integer)lua_rawlen(L, -1);
  lua_pushinteger(L, d);
  return 1;
}

/* coroutine.yield(...), as Lua's, except inside nv.scope or nv.unscoped (see the header) */
static int l_yield(lua_State *L) {
  int n = lua_gettop(L);
  if (push_stack(L, 0)) {
    lua_Integer d = (lua_Integer)lua_rawlen(L, -1);
    int unscoped = lua_getfield(L, -1, "unscoped") != LUA_TNIL;
    if (d > 0)
      return luaL_error(L, "coroutine.yield inside nv.scope (%d open in this coroutine): a scope closes when its "
                        "function returns, so its function cannot yield; yield outside nv.scope", (int)d);
    if (unscoped)
      return luaL_error(L, "coroutine.yield inside nv.unscoped: its function cannot yield; yield outside it");
    lua_settop(L, n);
  }
  return lua_yield(L, n);
}

static const luaL_Reg scope_funcs[] = {
  {"scope", l_scope}, {"keep", l_keep}, {"unscope", l_unscope}, {"adopt", l_adopt}, {"unscoped", l_unscoped},
  {"scope_depth", l_scope_depth}, {NULL, NULL}};

void nvl_lua_open_scope(lua_State *L) {
  luaL_newmetatable(L, SCOPE_MT);
  lua_pushcfunction(L, guard_close);
  lua_setfield(L, -2, "__close");
  lua_pop(L, 1);
  luaL_newmetatable(L, UNSCOPED_MT);
  lua_pushcfunction(L, unscoped_close);
  lua_setfield(L, -2, "__close");
  lua_pop(L, 1);
  luaL_setfuncs(L, scope_funcs, 0);
  if (lua_getglobal(L, "coroutine") == LUA_TTABLE) {
    lua_pushcfunction(L, l_yield);
    lua_setfield(L, -2, "yield");
  }
  lua_pop(L, 1);
}
