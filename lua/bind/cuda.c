/* cuda.c: the Lua binding of the GPUs' controls (core/device.h: the CUDA table's device API) — per-device
 * allocator statistics, the GEMM path a format pair takes, sync mode, synchronisation, device
 * timing with events, allocator poisoning (tests) and cache release. Device tensors, quantization
 * and qmatmul are bound where their CPU versions are (tensor.c, quant.c); they dispatch on the
 * tensor's device in core/.
 * Every function works in a build without CUDA or on a machine without a GPU: the queries answer
 * (no devices, "unsupported"), the actions raise the backend's error. */
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <string.h>
#include "bind.h"
#include "device.h"
#include "flash_attention.h"
#ifdef NVL_CUDA_EMU
#include "emu_api.h"
#endif

static int raise_last(lua_State *L) { return luaL_error(L, "%s", nvl_last_error()); }

/* Device ordinal argument i (1-based in Lua, default 1) -> 0-based. */
static int opt_device(lua_State *L, int i) {
  lua_Integer d = luaL_optinteger(L, i, 1);
  int n = nvl_device_count(NVL_CUDA);
  if (n == 0) luaL_error(L, "cuda: no GPU: %s", nvl_device_unavailable_reason(NVL_CUDA));
  luaL_argcheck(L, d >= 1 && d <= n, i, lua_pushfstring(L, "device must be in 1..%d", n));
  return (int)d - 1;
}

void nvl_lua_push_cuda_memory(lua_State *L) {
  int n = nvl_device_count(NVL_CUDA);
  lua_createtable(L, n, 0);
  for (int d = 0; d < n; d++) {
    nvl_device_mem_stats s;
    if (nvl_device_memory_stats(NVL_CUDA, d, &s) != NVL_OK) {
      lua_pushstring(L, nvl_last_error());
    } else {
      lua_createtable(L, 0, 8);
      lua_pushinteger(L, (lua_Integer)s.allocated); lua_setfield(L, -2, "allocated");
      lua_pushinteger(L, (lua_Integer)s.peak_allocated); lua_setfield(L, -2, "peak");
      lua_pushinteger(L, (lua_Integer)s.reserved); lua_setfield(L, -2, "reserved");
      lua_pushinteger(L, (lua_Integer)s.cached); lua_setfield(L, -2, "cached");
      lua_pushinteger(L, (lua_Integer)s.blocks); lua_setfield(L, -2, "blocks");
      lua_pushinteger(L, (lua_Integer)s.device_mallocs); lua_setfield(L, -2, "device_mallocs");
      lua_pushinteger(L, (lua_Integer)s.device_free); lua_setfield(L, -2, "free");
      lua_pushinteger(L, (lua_Integer)s.device_total); lua_setfield(L, -2, "total");
    }
    lua_rawseti(L, -2, d + 1);
  }
}

/* core.cuda_memory() -> {[device] = {allocated, peak, reserved, cached, blocks, device_mallocs,
 * free, total}} (bytes; an empty table without a GPU) */
static int l_cuda_memory(lua_State *L) {
  nvl_lua_push_cuda_memory(L);
  return 1;
}

/* core.cuda_gemm_path(fmt [, fmt_b [, device]]) -> "native" | "emulated", detail; or nil, why */
static int l_gemm_path(lua_State *L) {
  const char *na = luaL_checkstring(L, 1), *nb = luaL_optstring(L, 2, na);
  nvl_dtype fa = nvl_dtype_from_name(na), fb = nvl_dtype_from_name(nb);
  if (fa == NVL_DTYPE_COUNT) return luaL_argerror(L, 1, lua_pushfstring(L, "unknown format '%s'", na));
  if (fb == NVL_DTYPE_COUNT) return luaL_argerror(L, 2, lua_pushfstring(L, "unknown format '%s'", nb));
  lua_Integer d = luaL_optinteger(L, 3, 1);
  luaL_argcheck(L, d >= 1 && d <= INT_MAX, 3, "device must be >= 1");
  int dev = (int)d - 1;
  char detail[256];
  nvl_gemm_path p = nvl_device_gemm_path(NVL_CUDA, fa, fb, dev, detail, sizeof detail);
  if (p == NVL_GEMM_UNSUPPORTED) {
    luaL_pushfail(L);
    lua_pushstring(L, nvl_last_error());
    return 2;
  }
  lua_pushstring(L, p == NVL_GEMM_NATIVE ? "native" : "emulated");
  lua_pushstring(L, detail);
  return 2;
}

/* core.cuda_set_sync(on) -> the previous setting */
static int l_set_sync(lua_State *L) {
  luaL_checktype(L, 1, LUA_TBOOLEAN);
  lua_pushboolean(L, nvl_device_set_sync(NVL_CUDA, lua_toboolean(L, 1)));
  return 1;
}

/* core.cuda_synchronize([device]) */
static int l_synchronize(lua_State *L) {
  int dev = opt_device(L, 1);
  if (nvl_device_synchronize(NVL_CUDA, dev) != NVL_OK) return raise_last(L);
  return 0;
}

/* core.cuda_time(fn, iters [, device]) -> milliseconds per call of fn, timed with device events
 * around iters back-to-back calls (fn's host time counts where the device waits for it) */
static int l_time(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_Integer iters = luaL_checkinteger(L, 2);
  luaL_argcheck(L, iters >= 1, 2, "iterations must be >= 1");
  int dev = opt_device(L, 3);
  if (nvl_device_timer_start(NVL_CUDA, dev) != NVL_OK) return raise_last(L);
  for (lua_Integer i = 0; i < iters; i++) {
    lua_pushvalue(L, 1);
    lua_call(L, 0, 0);
  }
  double ms = 0;
  if (nvl_device_timer_stop(NVL_CUDA, dev, &ms) != NVL_OK) return raise_last(L);
  lua_pushnumber(L, ms / (double)iters);
  return 1;
}

/* core.cuda_set_poison(byte | nil) -> the previous byte or nil: fill every device block the
 * allocator hands out with byte (tests prove kernels write every output element) */
static int l_set_poison(lua_State *L) {
  int b = -1;
  if (!lua_isnoneornil(L, 1)) {
    lua_Integer v = luaL_checkinteger(L, 1);
    luaL_argcheck(L, v >= 0 && v <= 255, 1, "byte must be 0..255");
    b = (int)v;
  }
  int prev = nvl_device_set_poison(NVL_CUDA, b);
  if (prev < 0) lua_pushnil(L);
  else lua_pushinteger(L, prev);
  return 1;
}

/* core.cuda_empty_cache([device]): give the caching allocator's free blocks back */
static int l_cuda_empty_cache(lua_State *L) {
  int dev = lua_isnoneornil(L, 1) ? -1 : opt_device(L, 1);
  nvl_device_empty_cache(NVL_CUDA, dev);
  return 0;
}

/* core.cuda_emulated() -> a description of the CPU emulation of CUDA this build runs its CUDA backend
 * on (-DNVLUA_CUDA=EMU), or nil in a build with real CUDA or none */
static int l_cuda_emulated(lua_State *L) {
#ifdef NVL_CUDA_EMU
  lua_pushstring(L, nvl_emu_description());
#else
  lua_pushnil(L);
#endif
  return 1;
}

#ifdef NVL_CUDA_EMU
static void set_int(lua_State *L, const char *k, int64_t v) {
  lua_pushinteger(L, (lua_Integer)v);
  lua_setfield(L, -2, k);
}

static const char *emu_type_name(int t) {
  switch (t) {
    case 0: return "f32";
    case 14: return "bf16";
    case 28: return "e4m3";
    case 29: return "e5m2";
    case 33: return "e2m1";
    default: return "?";
  }
}

/* counters.gemm_shapes: {{a, b, d, scales, m, n, k, calls, flops, bytes_a, bytes_b, bytes_c, bytes_d,
 * bytes_scales}, ...} in order of first call */
static void push_gemm_shapes(lua_State *L) {
  static const char *const modes[] = {"tensor", "vec16_ue4m3", "vec32_ue8m0"};
  nvl_emu_gemm_info g;
  lua_newtable(L);
  for (int i = 0; nvl_emu_gemm_counter(i, &g); i++) {
    lua_createtable(L, 0, 14);
    lua_pushstring(L, emu_type_name(g.type_a)); lua_setfield(L, -2, "a");
    lua_pushstring(L, emu_type_name(g.type_b)); lua_setfield(L, -2, "b");
    lua_pushstring(L, emu_type_name(g.type_d)); lua_setfield(L, -2, "d");
    lua_pushstring(L, g.scale_mode >= 0 && g.scale_mode <= 2 ? modes[g.scale_mode] : "?");
    lua_setfield(L, -2, "scales");
    set_int(L, "m", g.m); set_int(L, "n", g.n); set_int(L, "k", g.k); set_int(L, "calls", g.calls);
    set_int(L, "flops", g.flops); set_int(L, "bytes_a", g.bytes_a); set_int(L, "bytes_b", g.bytes_b);
    set_int(L, "bytes_c", g.bytes_c); set_int(L, "bytes_d", g.bytes_d); set_int(L, "bytes_scales", g.bytes_scales);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "gemm_shapes");
}
#endif

/* core.cuda_emu_counters() -> {launches = n, host_syncs = n, ..., bytes_counted = bool,
 * kernels = {[name] = {launches, blocks, threads, bytes_read, bytes_written}}, gemm_shapes = {...}}:
 * the emulator's counters since the process started or the last core.cuda_emu_reset_counters()
 * (kernels/cuda/emu/emu_api.h says what each counts); raises outside the emulation build */
static int l_cuda_emu_counters(lua_State *L) {
#ifdef NVL_CUDA_EMU
  int64_t v, l, b, t, r, w;
  const char *name;
  lua_newtable(L);
  for (int i = 0; (name = nvl_emu_counter(i, &v)) != NULL; i++) set_int(L, name, v);
  lua_pushboolean(L, nvl_emu_bytes_counted());
  lua_setfield(L, -2, "bytes_counted");
  lua_newtable(L);
  for (int i = 0; (name = nvl_emu_kernel_counter(i, &l, &b, &t)) != NULL; i++) {
    lua_createtable(L, 0, 5);
    set_int(L, "launches", l); set_int(L, "blocks", b); set_int(L, "threads", t);
    if (!nvl_emu_kernel_bytes(i, &r, &w)) r = w = 0;
    set_int(L, "bytes_read", r); set_int(L, "bytes_written", w);
    lua_setfield(L, -2, name);
  }
  lua_setfield(L, -2, "kernels");
  push_gemm_shapes(L);
  return 1;
#else
  return luaL_error(L, "cuda_emu_counters: this build does not emulate CUDA (configure with -DNVLUA_CUDA=EMU)");
#endif
}

/* core.cuda_emu_reset_counters(): every emulator counter back to 0 (raises outside the emulation build) */
static int l_cuda_emu_reset_counters(lua_State *L) {
#ifdef NVL_CUDA_EMU
  nvl_emu_reset_counters();
  return 0;
#else
  return luaL_error(L, "cuda_emu_reset_counters: this build does not emulate CUDA (configure with -DNVLUA_CUDA=EMU)");
#endif
}

/* causal argument i: a boolean, default true */
static int opt_causal(lua_State *L, int i) {
  if (lua_isnoneornil(L, i)) return 1;
  luaL_checktype(L, i, LUA_TBOOLEAN);
  return lua_toboolean(L, i);
}

/* core.cuda_flash_attention(q, k, v, scale [, causal = true]) -> out (bf16), lse (f32): the tensor-core
 * FlashAttention-2 (core/flash_attention.h; bf16 cuda tensors, head dim 64 or 128) */
static int l_flash_attention(lua_State *L) {
  const char *fname = "cuda_flash_attention";
  nvl_tensor *q = nvl_lua_check_tensor(L, 1, fname), *k = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 3, fname);
  double scale = luaL_checknumber(L, 4);
  int causal = opt_causal(L, 5);
  lua_settop(L, 5);
  nvl_tensor *out = nvl_lua_push_tensor(L), *lse = nvl_lua_push_tensor(L);
  CHECK(L, nvl_flash_attention_forward(out, lse, q, k, v, scale, causal));
  return 2;
}

/* core.cuda_flash_attention_backward(dout, q, k, v, out, lse, scale [, causal = true]) -> dq, dk, dv (bf16) */
static int l_flash_attention_backward(lua_State *L) {
  const char *fname = "cuda_flash_attention_backward";
  nvl_tensor *t[6];
  for (int i = 0; i < 6; i++) t[i] = nvl_lua_check_tensor(L, i + 1, fname);
  double scale = luaL_checknumber(L, 7);
  int causal = opt_causal(L, 8);
  lua_settop(L, 8);
  nvl_tensor *dq = nvl_lua_push_tensor(L), *dk = nvl_lua_push_tensor(L), *dv = nvl_lua_push_tensor(L);
  CHECK(L, nvl_flash_attention_backward(dq, dk, dv, t[0], t[1], t[2], t[3], t[4], t[5], scale, causal));
  return 3;
}

/* core.cuda_cudnn_attention(q, k, v, scale [, causal = true]) -> out (bf16), lse (f32): cuDNN's fused attention
 * (core/flash_attention.h; bf16 cuda tensors, head dim 64 or 128, sm_90+) */
static int l_cudnn_attention(lua_State *L) {
  const char *fname = "cuda_cudnn_attention";
  nvl_tensor *q = nvl_lua_check_tensor(L, 1, fname), *k = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *v = nvl_lua_check_tensor(L, 3, fname);
  double scale = luaL_checknumber(L, 4);
  int causal = opt_causal(L, 5);
  lua_settop(L, 5);
  nvl_tensor *out = nvl_lua_push_tensor(L), *lse = nvl_lua_push_tensor(L);
  CHECK(L, nvl_cudnn_attention_forward(out, lse, q, k, v, scale, causal));
  return 2;
}

/* core.cuda_cudnn_attention_backward(dout, q, k, v, out, lse, scale [, causal = true [, deterministic = false]])
 * -> dq, dk, dv (bf16) */
static int l_cudnn_attention_backward(lua_State *L) {
  const char *fname = "cuda_cudnn_attention_backward";
  nvl_tensor *t[6];
  for (int i = 0; i < 6; i++) t[i] = nvl_lua_check_tensor(L, i + 1, fname);
  double scale = luaL_checknumber(L, 7);
  int causal = opt_causal(L, 8);
  int det = 0;
  if (!lua_isnoneornil(L, 9)) {
    luaL_checktype(L, 9, LUA_TBOOLEAN);
    det = lua_toboolean(L, 9);
  }
  lua_settop(L, 9);
  nvl_tensor *dq = nvl_lua_push_tensor(L), *dk = nvl_lua_push_tensor(L), *dv = nvl_lua_push_tensor(L);
  CHECK(L, nvl_cudnn_attention_backward(dq, dk, dv, t[0], t[1], t[2], t[3], t[4], t[5], scale, causal, det));
  return 3;
}

/* core.cuda_cudnn_break(what) -> the previous setting (emulation builds: a cuDNN API rule broken on purpose,
 * kernels/cuda/cudnn_attn.h NVL_CUDNN_BREAK_*; 0 restores); raises elsewhere */
static int l_cudnn_break(lua_State *L) {
  lua_Integer w = luaL_checkinteger(L, 1);
  luaL_argcheck(L, w >= 0 && w < 64, 1, "must be a small non-negative integer");
  int prev = nvl_cudnn_attention_break((int)w);
  if (prev < 0) return luaL_error(L, "cuda_cudnn_break: only the CUDA emulation's cuDNN stand-in can break rules "
                                     "on purpose (or %d is not a rule it knows)", (int)w);
  lua_pushinteger(L, prev);
  return 1;
}

/* core.cuda_wmma_probe(a, b, c, flags) -> d = A B + C by one warp's wmma::mma_sync (tests of the CUDA
 * emulator's WMMA model; flags as kernels/cuda/flash_attn.h's NVL_WMMA_*) */
static int l_wmma_probe(lua_State *L) {
  const char *fname = "cuda_wmma_probe";
  nvl_tensor *a = nvl_lua_check_tensor(L, 1, fname), *b = nvl_lua_check_tensor(L, 2, fname);
  nvl_tensor *c = nvl_lua_check_tensor(L, 3, fname);
  lua_Integer flags = luaL_checkinteger(L, 4);
  luaL_argcheck(L, flags >= 0 && flags <= 255, 4, "flags must be 0..255");
  lua_settop(L, 4);
  nvl_tensor *d = nvl_lua_push_tensor(L);
  CHECK(L, nvl_wmma_probe(d, a, b, c, (int)flags));
  return 1;
}

static const luaL_Reg cuda_funcs[] = {
  {"cuda_flash_attention", l_flash_attention}, {"cuda_flash_attention_backward", l_flash_attention_backward},
  {"cuda_cudnn_attention", l_cudnn_attention}, {"cuda_cudnn_attention_backward", l_cudnn_attention_backward},
  {"cuda_cudnn_break", l_cudnn_break},
  {"cuda_wmma_probe", l_wmma_probe},
  {"cuda_emulated", l_cuda_emulated}, {"cuda_emu_counters", l_cuda_emu_counters},
  {"cuda_emu_reset_counters", l_cuda_emu_reset_counters},
  {"cuda_memory", l_cuda_memory}, {"cuda_gemm_path", l_gemm_path}, {"cuda_set_sync", l_set_sync},
  {"cuda_synchronize", l_synchronize}, {"cuda_time", l_time}, {"cuda_set_poison", l_set_poison},
  {"cuda_empty_cache", l_cuda_empty_cache}, {NULL, NULL}};

void nvl_lua_open_cuda(lua_State *L) { luaL_setfuncs(L, cuda_funcs, 0); }
