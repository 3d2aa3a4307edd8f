/* attention.c: the Lua binding of causal grouped-query attention (core/layers.h):
 *   core.attention_forward(q, k, v, scale) -> out, lse
 *   core.attention_backward(dout, q, k, v, out, lse, scale) -> dq, dk, dv
 *   core.attention_forward_at(q, k, v, pos0, scale) -> out, lse: T queries at positions pos0 .. pos0+T-1 over a
 *     key/value cache k, v (B, S, Hkv, D), S >= pos0 + T (f32; layers.h nvl_attention_forward_at)
 *   core.attention_route([name]) -> the previous route: "auto" | "flash" | "cudnn" | "reference" (layers.h)
 *   core.attention_route_of(q, k, v) -> the kernels attention on these takes now ("cudnn", "flash", "cpu_bf16",
 *     "widened", "f32" or "error"), and why a preferred route was not taken ("" if none)
 *   core.attention_cudnn_deterministic([on]) -> the previous setting (the cuDNN backward's deterministic graph)
 *   core.attention_cudnn([device]) -> {available =, reason =, version =, compiled_version =, library_loads =,
 *     library_error =, graphs_built =, cache_hits =, evictions =, executions =, cached =, last_workspace =,
 *     refusals =, last_refusal =}
 *     (available: on that device, 1-based, default 1; library_loads: libcudnn opened, no GPU needed)
 *   core.attention_cudnn_clear_cache()
 *   core.attention_flash([on]) -> the previous setting (false: route "reference"; true: the route before)
 *   core.attention_flash_cpu() -> whether bf16 attention on the CPU takes the AVX512-BF16 kernels now
 * q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T); f32 tensors on
 * one device. nv.use_reference(true) runs the scalar double-precision reference kernels.
 * Core checks the shapes and dtypes; here only the Lua argument types. */
#include <lauxlib.h>
#include <lua.h>
#include "bind.h"
#include "device.h"
#include "flash_attention.h"
#include "layers.h"

/* core.attention_forward(q, k, v, scale) */
static int l_attention_forward(lua_State *L) {
  const char *fname = "attention_forward";
  nvl_tensor *q = nvl_lua_check_tensor(L, 1, fname);
  nvl_tensor *k = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 3, fname);
  double scale = luaL_checknumber(L, 4);
  lua_settop(L, 4);
  nvl_tensor *out = nvl_lua_push_tensor(L);
  nvl_tensor *lse = nvl_lua_push_tensor(L);
  CHECK(L, nvl_attention_forward(out, lse, q, k, v, scale));
  return 2;
}

/* core.attention_forward_at(q, k, v, pos0, scale) */
static int l_attention_forward_at(lua_State *L) {
  const char *fname = "attention_forward_at";
  nvl_tensor *q = nvl_lua_check_tensor(L, 1, fname);
  nvl_tensor *k = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 3, fname);
  lua_Integer pos0 = luaL_checkinteger(L, 4);
  double scale = luaL_checknumber(L, 5);
  lua_settop(L, 5);
  nvl_tensor *out = nvl_lua_push_tensor(L);
  nvl_tensor *lse = nvl_lua_push_tensor(L);
  CHECK(L, nvl_attention_forward_at(out, lse, q, k, v, (int64_t)pos0, scale));
  return 2;
}

/* core.attention_backward(dout, q, k, v, out, lse, scale) */
static int l_attention_backward(lua_State *L) {
  const char *fname = "attention_backward";
  nvl_tensor *dout = nvl_lua_check_tensor(L, 1, fname);
  nvl_tensor *q = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *k = nvl_lua_check_tensor(L, 3, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 4, fname);
  nvl_tensor *out = nvl_lua_check_tensor(L, 5, fname);
  nvl_tensor *lse = nvl_lua_check_tensor(L, 6, fname);
  double scale = luaL_checknumber(L, 7);
  lua_settop(L, 7);
  nvl_tensor *dq = nvl_lua_push_tensor(L);
  nvl_tensor *dk = nvl_lua_push_tensor(L);
  nvl_tensor *dv = nvl_lua_push_tensor(L);
  CHECK(L, nvl_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, scale));
  return 3;
}

/* core.attention_flash([on]): no argument reads the setting */
static int l_attention_flash(lua_State *L) {
  int on = lua_isnoneornil(L, 1) ? -1 : lua_toboolean(L, 1);
  lua_pushboolean(L, nvl_attention_flash(on));
  return 1;
}

/* core.attention_flash_cpu() */
static int l_attention_flash_cpu(lua_State *L) {
  lua_pushboolean(L, nvl_attention_flash_cpu());
  return 1;
}

/* core.attention_route([name]): no argument reads the setting */
static int l_attention_route(lua_State *L) {
  int r = -1;
  if (!lua_isnoneornil(L, 1)) {
    const char *const names[] = {"auto", "flash", "cudnn", "reference", NULL};
    r = luaL_checkoption(L, 1, NULL, names);
  }
  lua_pushstring(L, nvl_attn_route_names[nvl_attention_route(r)]);
  return 1;
}

/* core.attention_route_of(q, k, v) */
static int l_attention_route_of(lua_State *L) {
  const char *fname = "attention_route_of";
  nvl_tensor *q = nvl_lua_check_tensor(L, 1, fname), *k = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 3, fname);
  char why[600];
  lua_pushstring(L, nvl_attention_route_of(q, k, v, why, sizeof why));
  lua_pushstring(L, why);
  return 2;
}

/* core.attention_cudnn_deterministic([on]) */
static int l_attention_cudnn_deterministic(lua_State *L) {
  int on = lua_isnoneornil(L, 1) ? -1 : lua_toboolean(L, 1);
  lua_pushboolean(L, nvl_attention_cudnn_deterministic(on));
  return 1;
}

static void set_int(lua_State *L, const char *k, lua_Integer v) {
  lua_pushinteger(L, v);
  lua_setfield(L, -2, k);
}

/* core.attention_cudnn([device]) */
static int l_attention_cudnn(lua_State *L) {
  lua_Integer d = luaL_optinteger(L, 1, 1);
  luaL_argcheck(L, d >= 1, 1, "device must be >= 1");
  nvl_cudnn_attention_info i;
  int n = nvl_device_count(NVL_CUDA);
  nvl_status st = n == 0 ? nvl_error(NVL_EUNSUPPORTED, "no CUDA device (%s)", nvl_device_unavailable_reason(NVL_CUDA))
                  : d > n ? nvl_error(NVL_EINVAL, "no device cuda:%d (%d CUDA devices)", (int)d - 1, n)
                          : nvl_cudnn_attention_available((int)d - 1);
  nvl_cudnn_attention_stats(&i);
  lua_createtable(L, 0, 10);
  lua_pushboolean(L, st == NVL_OK);
  lua_setfield(L, -2, "available");
  lua_pushstring(L, st == NVL_OK ? "" : nvl_last_error());
  lua_setfield(L, -2, "reason");
  set_int(L, "version", (lua_Integer)i.version);
  set_int(L, "compiled_version", (lua_Integer)i.compiled_version);
  set_int(L, "graphs_built", i.graphs_built);
  set_int(L, "cache_hits", i.cache_hits);
  set_int(L, "evictions", i.evictions);
  set_int(L, "executions", i.executions);
  set_int(L, "cached", i.cached);
  set_int(L, "last_workspace", (lua_Integer)i.last_workspace);
  set_int(L, "refusals", i.refusals);
  lua_pushstring(L, i.last_refusal);
  lua_setfield(L, -2, "last_refusal");
  lua_pushboolean(L, i.loads);
  lua_setfield(L, -2, "library_loads");
  lua_pushstring(L, i.load_error);
  lua_setfield(L, -2, "library_error");
  return 1;
}

/* core.attention_cudnn_clear_cache() */
static int l_attention_cudnn_clear_cache(lua_State *L) {
  (void)L;
  nvl_cudnn_attention_clear_cache();
  return 0;
}

static const luaL_Reg attention_funcs[] = {{"attention_forward", l_attention_forward},
  {"attention_forward_at", l_attention_forward_at},
  {"attention_backward", l_attention_backward}, {"attention_flash", l_attention_flash},
  {"attention_flash_cpu", l_attention_flash_cpu}, {"attention_route", l_attention_route},
  {"attention_route_of", l_attention_route_of}, {"attention_cudnn_deterministic", l_attention_cudnn_deterministic},
  {"attention_cudnn", l_attention_cudnn}, {"attention_cudnn_clear_cache", l_attention_cudnn_clear_cache},
  {NULL, NULL}};

void nvl_lua_open_attention(lua_State *L) { luaL_setfuncs(L, attention_funcs, 0); }
