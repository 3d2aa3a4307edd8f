/* attention.c: the Lua binding of causal grouped-query attention (core/layers.h):
 *   core.attention_forward(q, k, v, scale) -> out, lse
 *   core.attention_backward(dout, q, k, v, out, lse, scale) -> dq, dk, dv
 *   core.attention_flash([on]) -> the previous setting (bf16 attention with FlashAttention's numerics:
 *     FlashAttention-2 on CUDA, the AVX512-BF16 kernels on the CPU)
 *   core.attention_flash_cpu() -> whether bf16 attention on the CPU takes that route now
 * q, out, dout, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse (B, Hq, T); f32 tensors on
 * one device. nv.use_reference(true) runs the scalar double-precision reference kernels.
 * Core checks the shapes and dtypes; here only the Lua argument types. */
#include <lauxlib.h>
#include <lua.h>
#include "bind.h"
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

static const luaL_Reg attention_funcs[] = {{"attention_forward", l_attention_forward},
  {"attention_backward", l_attention_backward}, {"attention_flash", l_attention_flash},
  {"attention_flash_cpu", l_attention_flash_cpu}, {NULL, NULL}};

void nvl_lua_open_attention(lua_State *L) { luaL_setfuncs(L, attention_funcs, 0); }
