/* quant.c: the Lua binding of core/quant.h — nv.core.quantize / qmatmul / rht and the
 * "nvlua.QTensor" userdata (codes + block scales + amax + layout). Options arrive as a Lua
 * table already checked for unknown keys by lua/nvlua/quant.lua; here each value is type- and
 * range-checked, and core's errors become Lua errors. */
#include <lauxlib.h>
#include <lua.h>
#include <string.h>
#include "bind.h"
#include "gam.h"
#include "qgather.h"
#include "quant.h"

#define QTENSOR_MT NVL_QTENSOR_MT

static nvl_qtensor *push_q(lua_State *L) {
  nvl_qtensor *q = lua_newuserdatauv(L, sizeof(nvl_qtensor), 0);
  *q = nvl_qtensor_null();
  luaL_setmetatable(L, QTENSOR_MT);
  nvl_lua_scope_record(L, -1);
  return q;
}

static nvl_qtensor *check_q(lua_State *L, int i) {
  nvl_qtensor *q = luaL_checkudata(L, i, QTENSOR_MT);
  if (!q->data.storage) luaL_error(L, "quantized tensor has been freed");
  return q;
}

static nvl_dtype check_format(lua_State *L, int i) {
  const char *name = luaL_checkstring(L, i);
  nvl_dtype f = nvl_dtype_from_name(name);
  if (f == NVL_DTYPE_COUNT || !nvl_dtypes[f].is_float) {
    const char *names[NVL_DTYPE_COUNT];
    int n = 0;
    for (int d = 0; d < NVL_DTYPE_COUNT; d++)
      if (nvl_dtypes[d].is_float) names[n++] = nvl_dtypes[d].name;
    const char *hint = nvl_lua_push_did_you_mean(L, name, names, n) ? lua_tostring(L, -1) : NULL;
    luaL_argerror(L, i, lua_pushfstring(L, "invalid format '%s' (valid: %s)%s%s", name, nvl_qformat_names(),
                                        hint ? "; " : "", hint ? hint : ""));
  }
  return f;
}

/* Read a 16-entry sign table at the top of the stack into s. */
static void read_signs(lua_State *L, const char *what, float *s) {
  if (luaL_len(L, -1) != 16) luaL_error(L, "%s: a sign table needs 16 entries of +1/-1, got %I", what, luaL_len(L, -1));
  for (int i = 0; i < 16; i++) {
    lua_geti(L, -1, i + 1);
    lua_Number v = lua_tonumber(L, -1);
    if (v != 1 && v != -1) luaL_error(L, "%s: sign %d must be +1 or -1, got %s", what, i + 1, luaL_tolstring(L, -1, NULL));
    s[i] = (float)v;
    lua_pop(L, 1);
  }
}

/* Options table at index 3 -> *o (signs: storage for an RHT sign table). */
static int parse_quant_opts(lua_State *L, const nvl_tensor *x, nvl_quant_opts *o, float *signs) {
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    if (lua_getfield(L, 3, "axis") != LUA_TNIL) {
      int ok;
      lua_Integer a = lua_tointegerx(L, -1, &ok);
      if (!ok) return luaL_error(L, "quantize: axis must be an integer");
      if (a < 0) a += x->ndim + 1;
      if (a < 1 || a > x->ndim)
        return luaL_error(L, "quantize: axis %I out of range for a %d-D tensor", lua_tointeger(L, -1), x->ndim);
      o->axis = (int)a - 1;
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "block") != LUA_TNIL) {
      const char *b = lua_tostring(L, -1);
      if (b && strcmp(b, "2d") == 0) o->block2d = 1;
      else if (!b || strcmp(b, "1d") != 0) return luaL_error(L, "quantize: block must be \"1d\" or \"2d\", got %s", luaL_tolstring(L, -1, NULL));
    }
    lua_pop(L, 1);
    int t = lua_getfield(L, 3, "rht");
    if (t == LUA_TTABLE) { read_signs(L, "quantize", signs); o->rht = 1; o->signs = signs; }
    else if (t == LUA_TBOOLEAN) o->rht = lua_toboolean(L, -1);
    else if (t != LUA_TNIL) return luaL_error(L, "quantize: rht must be a boolean or a table of 16 signs");
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "sr") != LUA_TNIL) {
      if (!lua_isboolean(L, -1)) return luaL_error(L, "quantize: sr must be a boolean");
      o->sr = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "rht_col") != LUA_TNIL) {
      if (!lua_isboolean(L, -1)) return luaL_error(L, "quantize_rowcol: rht_col must be a boolean");
      o->rht_col = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "view") != LUA_TNIL) {
      if (!lua_isboolean(L, -1)) return luaL_error(L, "quantize: view must be a boolean");
      o->view = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "generator") != LUA_TNIL) o->gen = ((nvl_lua_generator *)luaL_checkudata(L, -1, NVL_GENERATOR_MT))->g;
    lua_pop(L, 1);
    int has_seed = lua_getfield(L, 3, "seed") != LUA_TNIL;
    if (has_seed) {
      if (!lua_isinteger(L, -1)) return luaL_error(L, "quantize: seed must be an integer");
      o->seed = (uint64_t)lua_tointeger(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "offset") != LUA_TNIL) {
      if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 0) return luaL_error(L, "quantize: offset must be a non-negative integer");
      o->offset = (uint64_t)lua_tointeger(L, -1);
      if (!has_seed) return luaL_error(L, "quantize: offset needs a seed");
    }
    lua_pop(L, 1);
    if (o->sr && !o->gen && !has_seed) o->gen = nvl_default_generator();
    if (o->gen && has_seed) return luaL_error(L, "quantize: give either generator or seed/offset, not both");
    if (lua_getfield(L, 3, "scale_rule") != LUA_TNIL) {
      const char *r = lua_tostring(L, -1);
      if (r && strcmp(r, "floor") == 0) o->rule = NVL_MX_FLOOR;
      else if (!r || strcmp(r, "rceil") != 0) return luaL_error(L, "quantize: scale_rule must be \"rceil\" or \"floor\", got %s", luaL_tolstring(L, -1, NULL));
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 3, "amax") != LUA_TNIL) {
      nvl_qtensor *qa = luaL_testudata(L, -1, QTENSOR_MT);
      nvl_tensor *ta = luaL_testudata(L, -1, NVL_TENSOR_MT);
      if (qa) {
        o->amax_of = qa; /* the caller's option table keeps it alive through the call */
      } else if (ta) {
        o->amax_t = ta;
      } else {
        if (!lua_isnumber(L, -1))
          return luaL_error(L, "quantize: amax must be a number, a quantized tensor or a one-element f32 tensor");
        o->has_amax = 1;
        o->amax = (float)lua_tonumber(L, -1);
      }
    }
    lua_pop(L, 1);
    static const char *const slab[3] = {"sr_row_offset", "sr_k_offset", "sr_k_total"};
    int64_t *slab_dst[3] = {&o->sr_row_offset, &o->sr_k_offset, &o->sr_k_total};
    for (int i = 0; i < 3; i++) {
      if (lua_getfield(L, 3, slab[i]) != LUA_TNIL) {
        if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 0)
          return luaL_error(L, "quantize: %s must be a non-negative integer", slab[i]);
        *slab_dst[i] = (int64_t)lua_tointeger(L, -1);
      }
      lua_pop(L, 1);
    }
  }
  return 0;
}

/* core.quantize(x, format, opts) */
static int l_quantize(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "quantize");
  nvl_dtype f = check_format(L, 2);
  nvl_quant_opts o = {.axis = -1};
  float signs[16];
  parse_quant_opts(L, x, &o, signs);
  nvl_qtensor *q = push_q(L);
  CHECK(L, nvl_quantize(q, x, f, &o));
  return 1;
}

/* core.quant_amax(x [, {axis = d (1-based, default the last), rht = false}]) -> f32 (1) tensor on x's
 * device: max |x| (after the RHT along axis), as a quantization computes it; nothing read back */
static int l_quant_amax(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "quant_amax");
  int axis = -1, rht = 0;
  if (!lua_isnoneornil(L, 2)) {
    luaL_checktype(L, 2, LUA_TTABLE);
    if (lua_getfield(L, 2, "axis") != LUA_TNIL) {
      if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 1 || lua_tointeger(L, -1) > x->ndim)
        return luaL_error(L, "quant_amax: axis must be a dim of x (1..%d)", x->ndim);
      axis = (int)lua_tointeger(L, -1) - 1;
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 2, "rht") != LUA_TNIL) rht = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_quant_amax(r, x, axis, rht));
  return 1;
}

/* core.quantize_rowcol(x, format, opts) -> q_row, q_col: x (2-D) quantized along its last and
 * its first dim (opts.axis is ignored), from one read of x on cuda */
static int l_quantize_rowcol(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "quantize_rowcol");
  nvl_dtype f = check_format(L, 2);
  nvl_quant_opts o = {.axis = -1};
  float signs[16];
  parse_quant_opts(L, x, &o, signs);
  nvl_qtensor *r = push_q(L);
  nvl_qtensor *c = push_q(L);
  CHECK(L, nvl_quantize_rowcol(r, c, x, f, &o));
  return 2;
}

/* A started quantized all-gather: core.quantize_all_gather(..., {async = true}); g:wait() -> its copies. */
#define QGATHER_MT "nvlua.QGather"
typedef struct {
  nvl_qgather *g; /* NULL once waited for (or freed) */
  int copies;
} lua_qgather;

/* core.quantize_all_gather(shard, format, rows [, {axis = 2|1|"both", block = "1d"|"2d", scale_rule, amax,
 * align, check = true, async = false}]) -> the quantization of the whole weight (core/qgather.h) blocked
 * along axis (1-based: 2 = along K, the fprop copy; 1 = along the rows), or with "both" the two copies (axis
 * 2's first); with async a handle whose :wait() returns them. Options checked for unknown keys by
 * lua/nvlua/quant.lua. */
static int l_quantize_all_gather(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "quantize_all_gather");
  nvl_dtype f = check_format(L, 2);
  lua_Integer rows = luaL_checkinteger(L, 3);
  nvl_qgather_opts o = {.copies = NVL_QG_AXIS1};
  int async = 0;
  if (!lua_isnoneornil(L, 4)) {
    luaL_checktype(L, 4, LUA_TTABLE);
    if (lua_getfield(L, 4, "axis") != LUA_TNIL) {
      if (lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "both") == 0) o.copies = NVL_QG_AXIS1 | NVL_QG_AXIS0;
      else if (lua_isinteger(L, -1) && (lua_tointeger(L, -1) == 1 || lua_tointeger(L, -1) == 2))
        o.copies = lua_tointeger(L, -1) == 2 ? NVL_QG_AXIS1 : NVL_QG_AXIS0;
      else
        return luaL_error(L, "quantize_all_gather: axis must be 2 (blocked along K), 1 (along the rows) or \"both\", got %s",
                          luaL_tolstring(L, -1, NULL));
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 4, "block") != LUA_TNIL) {
      const char *b = lua_tostring(L, -1);
      if (b && strcmp(b, "2d") == 0) o.block2d = 1;
      else if (!b || strcmp(b, "1d") != 0)
        return luaL_error(L, "quantize_all_gather: block must be \"1d\" or \"2d\", got %s", luaL_tolstring(L, -1, NULL));
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 4, "scale_rule") != LUA_TNIL) {
      const char *r = lua_tostring(L, -1);
      if (r && strcmp(r, "floor") == 0) o.rule = NVL_MX_FLOOR;
      else if (!r || strcmp(r, "rceil") != 0)
        return luaL_error(L, "quantize_all_gather: scale_rule must be \"rceil\" or \"floor\", got %s", luaL_tolstring(L, -1, NULL));
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 4, "align") != LUA_TNIL) {
      if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 1)
        return luaL_error(L, "quantize_all_gather: align must be a positive integer, got %s", luaL_tolstring(L, -1, NULL));
      o.align = (int64_t)lua_tointeger(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 4, "check") != LUA_TNIL) {
      if (!lua_isboolean(L, -1)) return luaL_error(L, "quantize_all_gather: check must be true or false");
      o.nocheck = !lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 4, "async") != LUA_TNIL) {
      if (!lua_isboolean(L, -1)) return luaL_error(L, "quantize_all_gather: async must be true or false");
      async = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 4, "amax") != LUA_TNIL) { /* the options table keeps it alive through the call */
      nvl_qtensor *qa = luaL_testudata(L, -1, QTENSOR_MT);
      nvl_tensor *ta = luaL_testudata(L, -1, NVL_TENSOR_MT);
      if (qa) {
        if (!qa->data.storage) return luaL_error(L, "quantize_all_gather: the quantized tensor given as amax has been freed");
        o.amax_of = qa;
      } else if (ta) {
        o.amax_t = ta;
      } else if (lua_isnumber(L, -1)) {
        o.has_amax = 1;
        o.amax = (float)lua_tonumber(L, -1);
      } else {
        return luaL_error(L, "quantize_all_gather: amax must be a number, a quantized tensor or a one-element f32 tensor");
      }
    }
    lua_pop(L, 1);
  }
  int base = lua_gettop(L);
  lua_qgather *h = lua_newuserdatauv(L, sizeof(lua_qgather), 0); /* pushed empty first: an error leaks nothing */
  h->g = NULL;
  h->copies = o.copies;
  luaL_setmetatable(L, QGATHER_MT);
  CHECK(L, nvl_quantize_all_gather_start(&h->g, x, (int64_t)rows, f, &o));
  if (async) return 1;
  lua_getfield(L, -1, "wait");
  lua_insert(L, -2);
  lua_call(L, 1, LUA_MULTRET);
  return lua_gettop(L) - base;
}

/* g:wait() -> the copies asked for (axis 2's first): completes the gathers (on a device stream 0 waits
 * for them, the host does not) */
static int qg_wait(lua_State *L) {
  lua_qgather *h = luaL_checkudata(L, 1, QGATHER_MT);
  if (!h->g) return luaL_error(L, "quantize_all_gather: this gather was waited for already");
  int n = 0;
  nvl_qtensor *dst[2] = {NULL, NULL};
  if (h->copies & NVL_QG_AXIS1) dst[0] = push_q(L), n++;
  if (h->copies & NVL_QG_AXIS0) dst[1] = push_q(L), n++;
  nvl_qgather *g = h->g;
  h->g = NULL;
  nvl_qtensor out[2];
  CHECK(L, nvl_quantize_all_gather_wait(out, g));
  for (int c = 0; c < 2; c++) {
    if (dst[c]) *dst[c] = out[c];
    else nvl_qtensor_release(&out[c]);
  }
  return n;
}

/* g:pending() -> true until waited for */
static int qg_pending(lua_State *L) {
  lua_pushboolean(L, ((lua_qgather *)luaL_checkudata(L, 1, QGATHER_MT))->g != NULL);
  return 1;
}

/* dropped without a wait: its collectives are completed first (every rank completes them) */
static int qg_gc(lua_State *L) {
  lua_qgather *h = luaL_checkudata(L, 1, QGATHER_MT);
  nvl_qgather_free(h->g);
  h->g = NULL;
  return 0;
}

/* core.qgather_align(format, block2d, axis (1-based)) -> the row alignment a shard of that copy needs
 * (0: the copy is not gathered; core/qgather.h) */
static int l_qgather_align(lua_State *L) {
  nvl_dtype f = check_format(L, 1);
  int block2d = lua_toboolean(L, 2);
  lua_Integer axis = luaL_checkinteger(L, 3);
  luaL_argcheck(L, axis == 1 || axis == 2, 3, "axis must be 1 or 2");
  lua_pushinteger(L, (lua_Integer)nvl_qgather_align(f, block2d, (int)axis - 1));
  return 1;
}

/* q:dequantize([{on_device = false, domain = "original"}]) -> f32 tensor: on the CPU, or with on_device on
 * q's device; an RHT operand's values in x's domain, or with domain = "rotated" as stored (the RHT
 * domain the GEMMs read; the same values for a q without the RHT) */
static int q_dequantize(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  int on_device = 0, rotated = 0;
  if (!lua_isnoneornil(L, 2)) {
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, 2)) {
      lua_pop(L, 1);
      const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
      if (!k || (strcmp(k, "on_device") != 0 && strcmp(k, "domain") != 0))
        return luaL_error(L, "dequantize: unknown option '%s' (valid: on_device, domain)", luaL_tolstring(L, -1, NULL));
    }
    lua_getfield(L, 2, "on_device");
    if (!lua_isnil(L, -1) && !lua_isboolean(L, -1)) return luaL_error(L, "dequantize: on_device must be true or false");
    on_device = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (lua_getfield(L, 2, "domain") != LUA_TNIL) {
      const char *d = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
      if (d && strcmp(d, "rotated") == 0) rotated = 1;
      else if (!d || strcmp(d, "original") != 0)
        return luaL_error(L, "dequantize: domain must be \"original\" (x's values) or \"rotated\" (the RHT domain), "
                          "got %s", luaL_tolstring(L, -1, NULL));
    }
    lua_pop(L, 1);
  }
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, on_device ? nvl_dequantize_on_device(r, q, rotated) : nvl_dequantize(r, q, rotated));
  return 1;
}

static int q_codes(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_qtensor_codes(r, q));
  return 1;
}

static int q_scale_bytes(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_qtensor_scale_bytes(r, q));
  return 1;
}

/* q:data() -> the stored tensor as is: (rows, K) codes in the blocked layout (nvfp4 packed). */
static int q_data(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  nvl_tensor *r = nvl_lua_push_tensor(L);
  nvl_tensor_share(r, &q->data);
  return 1;
}

/* q:share() -> another handle on q's codes, scales and device amax (no copy; storage refcounted):
 * freeing one handle leaves the other valid */
static int q_share(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  if (!q->data.storage) return luaL_error(L, "share: quantized tensor has been freed");
  nvl_qtensor *r = push_q(L);
  nvl_qtensor c = *q;
  c.data = nvl_tensor_null();
  c.scales = nvl_tensor_null();
  c.amax_dev = nvl_tensor_null();
  nvl_tensor_share(&c.data, &q->data);
  if (q->scales.storage) nvl_tensor_share(&c.scales, &q->scales);
  if (q->amax_dev.storage) nvl_tensor_share(&c.amax_dev, &q->amax_dev);
  *r = c;
  return 1;
}

static int q_t(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  nvl_qtensor *r = push_q(L);
  CHECK(L, nvl_qtensor_t(r, q));
  return 1;
}

/* q:device() -> "cpu" | "cuda" */
static int q_device(lua_State *L) {
  lua_pushstring(L, check_q(L, 1)->data.device == NVL_CPU ? "cpu" : "cuda");
  return 1;
}

/* q:cpu() -> q itself on the host, else a host copy (codes, block scales, the same header) */
static int q_cpu(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  if (q->data.device == NVL_CPU) { lua_settop(L, 1); return 1; }
  nvl_qtensor *h = push_q(L);
  CHECK(L, nvl_qtensor_host(h, q));
  return 1;
}

/* q:swizzled_scales() -> u8 cpu tensor: the block scales in cuBLASLt's 128x4 swizzled layout,
 * padding included, as a backend with swizzled scales (cuda) writes them after the row-major
 * ones; nil for a q without them (cpu, per-tensor) */
static int q_swizzled_scales(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  nvl_tensor *t = nvl_lua_push_tensor(L); /* pushed first: filling it cannot leak */
  if (nvl_qtensor_swizzled_scales(t, q) != NVL_OK) {
    lua_pop(L, 1);
    lua_pushnil(L);
  }
  return 1;
}

static int q_format(lua_State *L) { lua_pushstring(L, nvl_dtypes[check_q(L, 1)->format].name); return 1; }
static int q_layout(lua_State *L) { lua_pushstring(L, nvl_layout_names[check_q(L, 1)->layout]); return 1; }
static int q_axis(lua_State *L) { lua_pushinteger(L, check_q(L, 1)->axis + 1); return 1; }
static int q_dim(lua_State *L) { lua_pushinteger(L, check_q(L, 1)->ndim); return 1; }
static int q_is_freed(lua_State *L) { lua_pushboolean(L, ((nvl_qtensor *)luaL_checkudata(L, 1, QTENSOR_MT))->data.storage == NULL); return 1; }

static int q_size(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    lua_Integer d = luaL_checkinteger(L, 2);
    if (d < 0) d += q->ndim + 1;
    luaL_argcheck(L, d >= 1 && d <= q->ndim, 2, "dim out of range");
    lua_pushinteger(L, q->shape[d - 1]);
    return 1;
  }
  lua_createtable(L, q->ndim, 0);
  for (int d = 0; d < q->ndim; d++) {
    lua_pushinteger(L, q->shape[d]);
    lua_rawseti(L, -2, d + 1);
  }
  return 1;
}

/* Bytes of storage: codes + block scales (+ the fp32 per-tensor scale of formats that have one). */
static int q_nbytes(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  size_t n = nvl_tensor_nbytes(&q->data) + (q->scales.storage ? (size_t)nvl_tensor_numel(&q->scales) : 0);
  if (nvl_dtypes[q->format].global_amax) n += 4;
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

static int q_free(lua_State *L) {
  nvl_qtensor_release(luaL_checkudata(L, 1, QTENSOR_MT));
  return 0;
}

/* q.amax, q.scale, q.dec_scale, q.rht, q.sr, q.seed, q.offset, q.block, else methods. q.dec_scale: the
 * tensor-level factor a GEMM applies to q's products (traits dec_scale: fp8 1 / scale, nvfp4 amax / 2688;
 * nil for formats without one), what an exported checkpoint stores as the decode scale. */
static int q_index(lua_State *L) {
  nvl_qtensor *q = luaL_checkudata(L, 1, QTENSOR_MT);
  const char *k = lua_tostring(L, 2);
  if (k && lua_type(L, 2) == LUA_TSTRING) {
    if (strcmp(k, "amax") == 0 || strcmp(k, "scale") == 0) { /* a device amax is read back on demand */
      if (q->data.storage) CHECK(L, nvl_qtensor_resolve_amax(q));
      lua_pushnumber(L, k[0] == 'a' ? q->amax : q->scale);
      return 1;
    }
    if (strcmp(k, "dec_scale") == 0) {
      const nvl_dtype_traits *f = &nvl_dtypes[q->format];
      if (!f->dec_scale) { lua_pushnil(L); return 1; }
      if (q->data.storage) CHECK(L, nvl_qtensor_resolve_amax(q));
      lua_pushnumber(L, f->dec_scale(q->amax, q->scale));
      return 1;
    }
    if (strcmp(k, "rht") == 0) { lua_pushboolean(L, q->rht); return 1; }
    if (strcmp(k, "sr") == 0) { lua_pushboolean(L, q->sr); return 1; }
    if (strcmp(k, "seed") == 0) { if (q->sr) lua_pushinteger(L, (lua_Integer)q->seed); else lua_pushnil(L); return 1; }
    if (strcmp(k, "offset") == 0) { if (q->sr) lua_pushinteger(L, (lua_Integer)q->offset); else lua_pushnil(L); return 1; }
    if (strcmp(k, "block") == 0) { lua_pushinteger(L, nvl_dtypes[q->format].block); return 1; }
    if (strcmp(k, "scale_rule") == 0) {
      if (nvl_dtypes[q->format].scale == NVL_SCALE_E8M0) lua_pushstring(L, nvl_mx_rule_names[q->rule]);
      else lua_pushnil(L);
      return 1;
    }
  }
  lua_getmetatable(L, 1);
  lua_getfield(L, -1, "__methods");
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  return 1;
}

/* core.qmatmul(qa, qb [, out_dtype [, acc]]): with acc (an f32 tensor) acc += the product, and
 * acc is returned */
static int l_qmatmul(lua_State *L) {
  nvl_qtensor *a = check_q(L, 1), *b = check_q(L, 2);
  if (!lua_isnoneornil(L, 4)) {
    nvl_tensor *acc = nvl_lua_check_tensor(L, 4, "qmatmul");
    CHECK(L, nvl_qmatmul_acc(acc, a, b));
    lua_settop(L, 4);
    return 1;
  }
  const char *o = luaL_optstring(L, 3, "f32");
  nvl_dtype dt = nvl_dtype_from_name(o);
  if (dt != NVL_F32 && dt != NVL_BF16) return luaL_argerror(L, 3, "output dtype must be \"f32\" or \"bf16\"");
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_qmatmul(r, a, b, dt));
  return 1;
}

/* core.rht(x [, axis [, signs]]) */
static int l_rht(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "rht");
  int axis = -1;
  if (!lua_isnoneornil(L, 2)) {
    lua_Integer a = luaL_checkinteger(L, 2);
    if (a < 0) a += x->ndim + 1;
    if (a < 1 || a > x->ndim)
      return luaL_error(L, "rht: axis %I out of range for a %d-D tensor", luaL_checkinteger(L, 2), x->ndim);
    axis = (int)a - 1;
  }
  float signs[16];
  const float *sp = NULL;
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    lua_pushvalue(L, 3);
    read_signs(L, "rht", signs);
    lua_pop(L, 1);
    sp = signs;
  }
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_rht(r, x, axis, sp));
  return 1;
}

/* core.rht_default_signs() -> {16 numbers} */
static int l_rht_signs(lua_State *L) {
  lua_createtable(L, 16, 0);
  for (int i = 0; i < 16; i++) {
    lua_pushinteger(L, (lua_Integer)nvl_rht16_default_signs[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* core.codec(format, "encode"|"decode", value) -> element code / value, reference codecs */
/* core.gam_quantize(x, block, group, elem) -> codes (u8 [R, K]), scales (u8 [R, K/block], E8M0 bytes
 * 127 - e_b), mant (f32 [groups], m_g): GAM scaling (NUMERICS §12.1) of the 2-D f32 x on its device
 * through the backend table (core/gam.h: the scalar reference kernels/cpu/ref/gam_ref.c under
 * nv.use_reference(true), the fast CPU or the CUDA kernel: the same bits); group "tensor" or a block
 * count (consecutive blocks, row-major); elem "e4m3" | "e5m2". A NaN or an inf sets the device's
 * non-finite flag (core.nonfinite_take). */
static int l_gam_quantize(lua_State *L) {
  static const char *const elems[] = {"e4m3", "e5m2", NULL};
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "gam_quantize");
  lua_Integer block = luaL_checkinteger(L, 2);
  lua_Integer group = 0;
  if (lua_type(L, 3) == LUA_TSTRING) {
    if (strcmp(lua_tostring(L, 3), "tensor") != 0) return luaL_argerror(L, 3, "group must be \"tensor\" or a block count");
  } else {
    group = luaL_checkinteger(L, 3);
    if (group < 1) return luaL_argerror(L, 3, "group must be \"tensor\" or a positive block count");
  }
  nvl_elem elem = luaL_checkoption(L, 4, NULL, elems) == 0 ? NVL_ELEM_E4M3 : NVL_ELEM_E5M2;
  nvl_tensor *codes = nvl_lua_push_tensor(L), *scales = nvl_lua_push_tensor(L), *mant = nvl_lua_push_tensor(L);
  CHECK(L, nvl_gam_quantize(codes, scales, mant, x, (int64_t)block, (int64_t)group, elem));
  return 3;
}

static int l_codec(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  const char *dir = luaL_checkstring(L, 2);
  const nvl_codec *c = nvl_codec_from_name(name);
  if (!c) return luaL_argerror(L, 1, lua_pushfstring(L, "unknown element format '%s' (%s)", name, nvl_codec_names()));
  if (strcmp(dir, "decode") == 0) {
    lua_Integer code = luaL_checkinteger(L, 3);
    luaL_argcheck(L, code >= 0 && code <= 255, 3, "code must be 0..255");
    lua_pushnumber(L, c->decode((uint8_t)code));
    return 1;
  }
  if (strcmp(dir, "encode") == 0 && c->encode) {
    lua_pushinteger(L, c->encode((float)luaL_checknumber(L, 3)));
    return 1;
  }
  return luaL_argerror(L, 2, "expected \"encode\" or \"decode\"");
}

/* core.qtensor_assemble(format, values, scales, factor) -> a 2-D QTensor from its parts (core/quant.h
 * nvl_qtensor_assemble): format "f32" | "bf16" with values of that dtype and scales nil, or
 * "mxfp8_e4m3" | "mxfp8_e5m2" with u8 codes [R, K] and E8M0 bytes [R, K/32]; factor (default 1) multiplies
 * every decoded value and enters the GEMMs' alpha (GAM's 1 / m_g, NUMERICS §12.1). */
static int l_qtensor_assemble(lua_State *L) {
  nvl_dtype f = check_format(L, 1);
  nvl_tensor *v = nvl_lua_check_tensor(L, 2, "qtensor_assemble");
  nvl_tensor *sc = lua_isnoneornil(L, 3) ? NULL : nvl_lua_check_tensor(L, 3, "qtensor_assemble");
  double factor = luaL_optnumber(L, 4, 1.0);
  nvl_qtensor *q = push_q(L);
  CHECK(L, nvl_qtensor_assemble(q, f, v, sc, (float)factor));
  return 1;
}

/* q:factor() -> an assembled q's decode factor (1 for every other q) */
static int q_factor(lua_State *L) {
  nvl_qtensor *q = check_q(L, 1);
  lua_pushnumber(L, q->factor != 0.0f ? q->factor : 1.0f);
  return 1;
}

static const luaL_Reg q_methods[] = {
  {"dequantize", q_dequantize}, {"codes", q_codes}, {"scale_bytes", q_scale_bytes}, {"data", q_data},
  {"t", q_t}, {"share", q_share}, {"format", q_format}, {"layout", q_layout}, {"axis", q_axis}, {"dim", q_dim},
  {"size", q_size}, {"nbytes", q_nbytes}, {"free", q_free}, {"is_freed", q_is_freed},
  {"device", q_device}, {"cpu", q_cpu}, {"swizzled_scales", q_swizzled_scales},
  {"factor", q_factor}, {NULL, NULL}};

static const luaL_Reg q_meta[] = {{"__index", q_index}, {"__gc", q_free}, {"__close", q_free}, {NULL, NULL}};

static const luaL_Reg q_funcs[] = {
  {"quantize", l_quantize}, {"quantize_rowcol", l_quantize_rowcol}, {"quantize_all_gather", l_quantize_all_gather},
  {"gam_quantize", l_gam_quantize}, {"qtensor_assemble", l_qtensor_assemble},
  {"qgather_align", l_qgather_align}, {"quant_amax", l_quant_amax}, {"qmatmul", l_qmatmul}, {"rht", l_rht}, {"rht_default_signs", l_rht_signs},
  {"codec", l_codec}, {NULL, NULL}};

static const luaL_Reg qg_methods[] = {{"wait", qg_wait}, {"pending", qg_pending}, {NULL, NULL}};

void nvl_lua_open_quant(lua_State *L) {
  luaL_newmetatable(L, QGATHER_MT);
  lua_pushcfunction(L, qg_gc);
  lua_setfield(L, -2, "__gc");
  luaL_newlib(L, qg_methods);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  luaL_newmetatable(L, QTENSOR_MT);
  luaL_setfuncs(L, q_meta, 0);
  luaL_newlib(L, q_methods);
  lua_setfield(L, -2, "__methods");
  lua_setfield(L, -2, "QTensor"); /* module.QTensor = the metatable */
  luaL_setfuncs(L, q_funcs, 0);
}
