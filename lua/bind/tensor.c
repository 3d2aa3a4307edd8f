/* tensor.c: the Lua binding of core/ — the module "nvlua.core" with the userdata types
 * "nvlua.Tensor" and "nvlua.Generator". The only layer that knows both Lua and core: it checks
 * argument types, converts 1-based Lua dims/indices to 0-based once, calls core, and turns a
 * non-OK nvl_status into a Lua error carrying core's message.
 * A userdata is pushed empty (a null tensor) first and filled after, so an error half-way leaks
 * nothing and __gc frees only what exists; while an nv.scope is open it is recorded there (scope.c),
 * whatever pushes it. Conveniences (printing, creation helpers) are Lua, in
 * lua/nvlua/init.lua, on the same metatable. */
#include <lauxlib.h>
#include <lua.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <time.h>
#include "bind.h"
#include "device.h"
#include "info.h"
#include "ops.h"

#define TENSOR_MT NVL_TENSOR_MT

/* ---- helpers ---- */


static nvl_tensor *push_tensor(lua_State *L) {
  nvl_tensor *t = lua_newuserdatauv(L, sizeof(nvl_tensor), 0);
  *t = nvl_tensor_null();
  luaL_setmetatable(L, TENSOR_MT);
  nvl_lua_scope_record(L, -1);
  return t;
}

nvl_tensor *nvl_lua_push_tensor(lua_State *L) { return push_tensor(L); }

/* A Lua number as a scalar operand, integers kept exact. */
static nvl_scalar to_scalar(lua_State *L, int i) {
  if (lua_isinteger(L, i)) return nvl_scalar_i(lua_tointeger(L, i));
  return nvl_scalar_f(lua_tonumber(L, i));
}

static nvl_tensor *check_tensor(lua_State *L, int i) { return luaL_checkudata(L, i, TENSOR_MT); }
static nvl_tensor *test_tensor(lua_State *L, int i) { return luaL_testudata(L, i, TENSOR_MT); }

/* A live tensor argument (freed tensors raise). */
static nvl_tensor *check_live(lua_State *L, int i, const char *op) {
  nvl_tensor *t = check_tensor(L, i);
  if (!t->storage) luaL_error(L, "%s: tensor has been freed", op);
  return t;
}

nvl_tensor *nvl_lua_check_tensor(lua_State *L, int i, const char *op) { return check_live(L, i, op); }

static nvl_dtype check_dtype(lua_State *L, int i) {
  const char *name = luaL_checkstring(L, i);
  nvl_dtype dt = nvl_dtype_from_name(name);
  if (dt == NVL_DTYPE_COUNT || nvl_dtypes[dt].is_quantized) {
    luaL_argerror(L, i, lua_pushfstring(L, "invalid dtype '%s' (valid: %s)%s", name, nvl_dtype_names(),
                                        dt == NVL_DTYPE_COUNT ? "" : "; quantized formats come from nv.quantize"));
  }
  return dt;
}

/* A 1-based dim (negative counts from the end) -> 0-based; range checked by core. */
static int check_dim(lua_State *L, int i, const nvl_tensor *t) {
  lua_Integer d0 = luaL_checkinteger(L, i), d = d0 < 0 ? d0 + t->ndim + 1 : d0;
  if (d < 1 || d > t->ndim)
    luaL_argerror(L, i, lua_pushfstring(L, "dim %I out of range for a %d-D tensor", d0, t->ndim));
  return (int)d - 1;
}

/* Shape from integers at [i, top] or a table at i. */
static int check_shape(lua_State *L, int i, int64_t *shape) {
  int n = 0;
  if (lua_istable(L, i)) {
    n = (int)luaL_len(L, i);
    if (n > NVL_MAX_DIMS) luaL_argerror(L, i, "too many dims");
    for (int k = 0; k < n; k++) {
      lua_geti(L, i, k + 1);
      int ok;
      lua_Integer v = lua_tointegerx(L, -1, &ok);
      if (!ok)
        luaL_argerror(L, i, lua_pushfstring(L, "shape entry %d must be an integer, got %s", k + 1,
                                            luaL_tolstring(L, -1, NULL)));
      shape[k] = v;
      lua_pop(L, 1);
    }
    return n;
  }
  int top = lua_gettop(L);
  for (int k = i; k <= top; k++) {
    if (n >= NVL_MAX_DIMS) luaL_argerror(L, k, "too many dims");
    shape[n++] = luaL_checkinteger(L, k);
  }
  return n;
}

static nvl_generator *opt_generator(lua_State *L, int i) {
  if (lua_isnoneornil(L, i)) return nvl_default_generator();
  nvl_lua_generator *g = luaL_checkudata(L, i, NVL_GENERATOR_MT);
  return g->g;
}

/* ---- creation ---- */

/* core.empty(shape_table, dtype, device) */
static int l_empty(lua_State *L) {
  int64_t shape[NVL_MAX_DIMS];
  luaL_checktype(L, 1, LUA_TTABLE);
  int n = check_shape(L, 1, shape);
  nvl_dtype dt = lua_isnoneornil(L, 2) ? NVL_F32 : check_dtype(L, 2);
  const char *dev = luaL_optstring(L, 3, "cpu");
  nvl_device d;
  if (strcmp(dev, "cpu") == 0) d = NVL_CPU;
  else if (strcmp(dev, "cuda") == 0) d = NVL_CUDA;
  else return luaL_argerror(L, 3, lua_pushfstring(L, "invalid device '%s' (valid: cpu, cuda)", dev));
  nvl_tensor *t = push_tensor(L);
  CHECK(L, nvl_tensor_empty(t, dt, d, n, shape));
  return 1;
}

static int l_fill_(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  luaL_checknumber(L, 2);
  CHECK(L, nvl_fill_(t, to_scalar(L, 2)));
  lua_settop(L, 1);
  return 1;
}

static int l_arange_(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  CHECK(L, nvl_arange_(t, luaL_checknumber(L, 2), luaL_checknumber(L, 3)));
  lua_settop(L, 1);
  return 1;
}

/* core.rand_(t [, generator [, first]]) / core.randn_: first (0-based, default 0): t is the draw's
 * elements first, first + 1, ... (a part of a larger tensor's draw) */
static int l_rand_(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  CHECK(L, nvl_rand_part_(t, opt_generator(L, 2), luaL_optinteger(L, 3, 0)));
  lua_settop(L, 1);
  return 1;
}

static int l_randn_(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  CHECK(L, nvl_randn_part_(t, opt_generator(L, 2), luaL_optinteger(L, 3, 0)));
  lua_settop(L, 1);
  return 1;
}

/* Fill a contiguous CPU tensor from a nested table (shape already known). */
static void fill_from_table(lua_State *L, int idx, nvl_tensor *t, int dim, char **p) {
  const nvl_dtype_traits *tr = &nvl_dtypes[t->dtype];
  if (dim == t->ndim) {
    int isnum;
    lua_Number v = lua_tonumberx(L, idx, &isnum);
    if (!isnum) luaL_error(L, "tensor: expected a number in the nested table, got %s", luaL_typename(L, idx));
    if (!tr->is_float && lua_isinteger(L, idx)) tr->store_i(*p, lua_tointeger(L, idx));
    else tr->store_f(*p, v);
    *p += tr->elem_size;
    return;
  }
  if (!lua_istable(L, idx)) luaL_error(L, "tensor: ragged nested table (expected a table at depth %d)", dim + 1);
  if ((int64_t)luaL_len(L, idx) != t->shape[dim])
    luaL_error(L, "tensor: ragged nested table: length %I at depth %d, expected %I", luaL_len(L, idx), dim + 1,
               (lua_Integer)t->shape[dim]);
  for (int64_t k = 1; k <= t->shape[dim]; k++) {
    lua_geti(L, idx, k);
    fill_from_table(L, lua_gettop(L), t, dim + 1, p);
    lua_pop(L, 1);
  }
}

/* core.tensor(nested_table_or_number, dtype) */
static int l_tensor(lua_State *L) {
  nvl_dtype dt = lua_isnoneornil(L, 2) ? NVL_F32 : check_dtype(L, 2);
  int64_t shape[NVL_MAX_DIMS];
  int n = 0;
  if (!lua_istable(L, 1) && !lua_isnumber(L, 1)) return luaL_typeerror(L, 1, "table or number");
  lua_pushvalue(L, 1);
  while (lua_istable(L, -1)) { /* walk the first elements to find the shape */
    if (n >= NVL_MAX_DIMS) return luaL_error(L, "tensor: nested deeper than %d", NVL_MAX_DIMS);
    shape[n++] = (int64_t)luaL_len(L, -1);
    if (shape[n - 1] == 0) break;
    lua_geti(L, -1, 1);
    lua_remove(L, -2);
  }
  lua_pop(L, 1);
  nvl_tensor *t = push_tensor(L);
  CHECK(L, nvl_tensor_empty(t, dt, NVL_CPU, n, shape));
  char *p = nvl_tensor_data(t);
  fill_from_table(L, 1, t, 0, &p);
  return 1;
}

/* ---- metadata ---- */

static int l_size(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    lua_pushinteger(L, t->shape[check_dim(L, 2, t)]);
    return 1;
  }
  lua_createtable(L, t->ndim, 0);
  for (int d = 0; d < t->ndim; d++) {
    lua_pushinteger(L, t->shape[d]);
    lua_rawseti(L, -2, d + 1);
  }
  return 1;
}

static int l_stride(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    lua_pushinteger(L, t->strides[check_dim(L, 2, t)]);
    return 1;
  }
  lua_createtable(L, t->ndim, 0);
  for (int d = 0; d < t->ndim; d++) {
    lua_pushinteger(L, t->strides[d]);
    lua_rawseti(L, -2, d + 1);
  }
  return 1;
}

static int l_dim(lua_State *L) { lua_pushinteger(L, check_tensor(L, 1)->ndim); return 1; }
static int l_numel(lua_State *L) { lua_pushinteger(L, nvl_tensor_numel(check_tensor(L, 1))); return 1; }
/* t:nbytes() -> numel * the element size: the bytes of t's data (what t:bytes() returns) */
static int l_nbytes(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  lua_pushinteger(L, (lua_Integer)nvl_tensor_nbytes(t));
  return 1;
}
static int l_dtype(lua_State *L) { lua_pushstring(L, nvl_dtypes[check_tensor(L, 1)->dtype].name); return 1; }
static int l_device(lua_State *L) { lua_pushstring(L, check_tensor(L, 1)->device == NVL_CPU ? "cpu" : "cuda"); return 1; }
static int l_is_contiguous(lua_State *L) { lua_pushboolean(L, nvl_tensor_is_contiguous(check_tensor(L, 1))); return 1; }
static int l_is_freed(lua_State *L) { lua_pushboolean(L, check_tensor(L, 1)->storage == NULL); return 1; }
static int l_storage_offset(lua_State *L) { lua_pushinteger(L, check_tensor(L, 1)->offset + 1); return 1; }

/* Same storage? (views share it) */
static int l_is_view_of(lua_State *L) {
  nvl_tensor *a = check_tensor(L, 1), *b = check_tensor(L, 2);
  lua_pushboolean(L, a->storage && a->storage == b->storage);
  return 1;
}

static int l_free(lua_State *L) {
  nvl_tensor_release(check_tensor(L, 1));
  return 0;
}

static int l_gc(lua_State *L) {
  nvl_tensor_release(check_tensor(L, 1));
  return 0;
}

/* ---- views ---- */

static int l_view(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "view");
  int64_t shape[NVL_MAX_DIMS];
  int n = check_shape(L, 2, shape);
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_view(r, t, n, shape));
  return 1;
}

static int l_reshape(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "reshape");
  int64_t shape[NVL_MAX_DIMS];
  int n = check_shape(L, 2, shape);
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_reshape(r, t, n, shape));
  return 1;
}

static int l_expand(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "expand");
  int64_t shape[NVL_MAX_DIMS];
  int n = check_shape(L, 2, shape);
  for (int d = 0; d < n; d++) { /* -1 keeps the size */
    int od = d - (n - t->ndim);
    if (shape[d] == -1 && od >= 0) shape[d] = t->shape[od];
  }
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_expand(r, t, n, shape));
  return 1;
}

static int l_transpose(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "transpose");
  int d0, d1;
  if (lua_isnoneornil(L, 2)) {
    if (t->ndim != 2) return luaL_error(L, "transpose: with no dims the tensor must be 2-D, got %d-D", t->ndim);
    d0 = 0; d1 = 1;
  } else {
    d0 = check_dim(L, 2, t);
    d1 = check_dim(L, 3, t);
  }
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_transpose(r, t, d0, d1));
  return 1;
}

static int l_permute(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "permute");
  int perm[NVL_MAX_DIMS];
  int64_t p64[NVL_MAX_DIMS];
  int n = check_shape(L, 2, p64);
  if (n != t->ndim) return luaL_error(L, "permute: got %d dims for a %d-D tensor", n, t->ndim);
  for (int d = 0; d < n; d++) { /* 1-based, negative from the end; core checks it is a permutation */
    int64_t p = p64[d] < 0 ? p64[d] + t->ndim : p64[d] - 1;
    perm[d] = p >= 0 && p < t->ndim ? (int)p : -1;
  }
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_permute(r, t, perm));
  return 1;
}

/* t:narrow(dim, start, length): 1-based start. */
static int l_narrow(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "narrow");
  int d = check_dim(L, 2, t);
  lua_Integer start = luaL_checkinteger(L, 3), len = luaL_checkinteger(L, 4);
  if (start < 1) /* (start - 1 could overflow) */
    return luaL_error(L, "narrow: start %I, length %I out of range for dim %d of size %I (starts are 1-based)", start,
                      len, d + 1, (lua_Integer)t->shape[d]);
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_narrow(r, t, d, start - 1, len));
  return 1;
}

/* t:select(dim, index): 1-based (negative from the end), removes dim. */
static int l_select(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "select");
  int d = check_dim(L, 2, t);
  lua_Integer i = luaL_checkinteger(L, 3);
  if (i < 0) i += t->shape[d] + 1;
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_select(r, t, d, i - 1));
  return 1;
}

static int l_contiguous(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "contiguous");
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_contiguous(r, t));
  return 1;
}

static int l_clone(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "clone");
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_clone_to(r, t, t->dtype, t->device));
  return 1;
}

static int l_copy_(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "copy_");
  nvl_tensor *s = check_live(L, 2, "copy_");
  CHECK(L, nvl_tensor_copy(t, s));
  lua_settop(L, 1);
  return 1;
}

static int l_to(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "to");
  const char *what = luaL_checkstring(L, 2);
  nvl_tensor *r;
  if (strcmp(what, "cpu") == 0 || strcmp(what, "cuda") == 0) {
    nvl_device d = what[1] == 'p' ? NVL_CPU : NVL_CUDA;
    r = push_tensor(L);
    CHECK(L, nvl_tensor_clone_to(r, t, t->dtype, d));
    return 1;
  }
  nvl_dtype dt = check_dtype(L, 2);
  r = push_tensor(L);
  CHECK(L, nvl_cast(r, t, dt));
  return 1;
}

static int l_cuda(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "cuda");
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_clone_to(r, t, t->dtype, NVL_CUDA));
  return 1;
}

static int l_cpu(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "cpu");
  if (t->device == NVL_CPU) { lua_settop(L, 1); return 1; }
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_tensor_clone_to(r, t, t->dtype, NVL_CPU));
  return 1;
}

/* ---- element access ---- */

static void push_element(lua_State *L, const nvl_tensor *t, const int64_t *idx) {
  const nvl_dtype_traits *tr = &nvl_dtypes[t->dtype];
  void *p = nvl_tensor_ptr(t, idx);
  if (tr->is_float) lua_pushnumber(L, tr->load_f(p));
  else lua_pushinteger(L, tr->load_i(p));
}

/* t:get(i, j, ...) -> number, 1-based */
static int l_get(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "get");
  int64_t idx[NVL_MAX_DIMS];
  if (lua_gettop(L) - 1 != t->ndim) return luaL_error(L, "get: %d indices for a %d-D tensor", lua_gettop(L) - 1, t->ndim);
  for (int d = 0; d < t->ndim; d++) {
    lua_Integer i = luaL_checkinteger(L, d + 2);
    idx[d] = (i < 0 ? i + t->shape[d] + 1 : i) - 1;
  }
  double v;
  CHECK(L, nvl_get(&v, t, idx));
  push_element(L, t, idx);
  return 1;
}

/* t:set(i, j, ..., value) */
static int l_set(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "set");
  int64_t idx[NVL_MAX_DIMS];
  int nargs = lua_gettop(L) - 2;
  if (nargs != t->ndim) return luaL_error(L, "set: %d indices for a %d-D tensor", nargs, t->ndim);
  for (int d = 0; d < t->ndim; d++) {
    lua_Integer i = luaL_checkinteger(L, d + 2);
    idx[d] = (i < 0 ? i + t->shape[d] + 1 : i) - 1;
  }
  double v = luaL_checknumber(L, nargs + 2);
  if (lua_isinteger(L, nargs + 2)) CHECK(L, nvl_set_i(t, idx, lua_tointeger(L, nargs + 2)));
  else CHECK(L, nvl_set(t, idx, v));
  lua_settop(L, 1);
  return 1;
}

static void totable_rec(lua_State *L, const nvl_tensor *t, int dim, int64_t *idx) {
  if (dim == t->ndim) {
    push_element(L, t, idx);
    return;
  }
  lua_createtable(L, (int)t->shape[dim], 0); /* <= INT_MAX, checked by l_totable */
  for (int64_t k = 0; k < t->shape[dim]; k++) {
    idx[dim] = k;
    totable_rec(L, t, dim + 1, idx);
    lua_rawseti(L, -2, k + 1);
  }
}

static int l_totable(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "totable");
  if (t->device != NVL_CPU) return luaL_error(L, "totable: tensor is on cuda; call :cpu() first");
  int64_t idx[NVL_MAX_DIMS] = {0};
  int64_t entries = 0, level = 1; /* the nested tables' entries, every level: at most 8 x NVL_MAX_NUMEL */
  for (int d = 0; d < t->ndim; d++) entries += level *= t->shape[d];
  if (entries > INT_MAX) { /* beyond one Lua array (2^31 entries); in practice beyond memory */
    char sh[160];
    return luaL_error(L, "totable: a %s tensor makes %I table entries, more than Lua tables hold (%d)",
                      nvl_shape_str(t, sh, sizeof sh), (lua_Integer)entries, INT_MAX);
  }
  luaL_checkstack(L, t->ndim + 4, "totable");
  totable_rec(L, t, 0, idx);
  return 1;
}

/* t[i]: a number for 1-D tensors, else the view t:select(1, i). Strings look up methods. */
static int l_index(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  if (lua_type(L, 2) == LUA_TNUMBER) {
    if (!lua_isinteger(L, 2)) return luaL_error(L, "index: tensor index must be an integer, got %f", lua_tonumber(L, 2));
    if (!t->storage) return luaL_error(L, "index: tensor has been freed");
    if (t->ndim == 0) return luaL_error(L, "index: cannot index a 0-D tensor");
    lua_Integer i = lua_tointeger(L, 2);
    if (i < 0) i += t->shape[0] + 1;
    if (t->ndim == 1) {
      int64_t idx[1] = {i - 1};
      double v;
      CHECK(L, nvl_get(&v, t, idx));
      push_element(L, t, idx);
      return 1;
    }
    nvl_tensor *r = push_tensor(L);
    CHECK(L, nvl_tensor_select(r, t, 0, i - 1));
    return 1;
  }
  lua_getmetatable(L, 1);
  lua_getfield(L, -1, "__methods");
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  return 1;
}

/* t[i] = v: sets an element of a 1-D tensor, or fills/copies into the slice t:select(1, i). */
static int l_newindex(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "newindex");
  if (!lua_isinteger(L, 2)) return luaL_error(L, "newindex: tensor index must be an integer, got %s", luaL_typename(L, 2));
  if (t->ndim == 0) return luaL_error(L, "newindex: cannot index a 0-D tensor");
  lua_Integer i = lua_tointeger(L, 2);
  if (i < 0) i += t->shape[0] + 1;
  nvl_tensor s = nvl_tensor_null();
  CHECK(L, nvl_tensor_select(&s, t, 0, i - 1));
  nvl_status st;
  if (lua_isnumber(L, 3)) {
    st = nvl_fill_(&s, to_scalar(L, 3));
  } else {
    nvl_tensor *src = test_tensor(L, 3);
    if (!src) { nvl_tensor_release(&s); return luaL_typeerror(L, 3, "number or nvlua.Tensor"); }
    st = nvl_tensor_copy(&s, src);
  }
  nvl_tensor_release(&s);
  CHECK(L, st);
  return 0;
}

static int l_len(lua_State *L) {
  nvl_tensor *t = check_tensor(L, 1);
  lua_pushinteger(L, t->ndim ? t->shape[0] : 0);
  return 1;
}

/* ---- arithmetic ---- */

static int binary(lua_State *L, nvl_binary_op op) {
  nvl_tensor *a = test_tensor(L, 1), *b = test_tensor(L, 2);
  const char *name = nvl_binary_names[op];
  if (a && b) {
    if (!a->storage || !b->storage) return luaL_error(L, "%s: tensor has been freed", name);
    nvl_tensor *r = push_tensor(L);
    CHECK(L, nvl_binary(r, op, a, b));
    return 1;
  }
  if (a && lua_isnumber(L, 2)) {
    if (!a->storage) return luaL_error(L, "%s: tensor has been freed", name);
    nvl_tensor *r = push_tensor(L);
    CHECK(L, nvl_binary_scalar(r, op, a, to_scalar(L, 2), 0));
    return 1;
  }
  if (b && lua_isnumber(L, 1)) {
    if (!b->storage) return luaL_error(L, "%s: tensor has been freed", name);
    nvl_tensor *r = push_tensor(L);
    CHECK(L, nvl_binary_scalar(r, op, b, to_scalar(L, 1), 1));
    return 1;
  }
  return luaL_error(L, "%s: expected tensors or numbers, got %s and %s", name, luaL_typename(L, 1), luaL_typename(L, 2));
}

static int l_add(lua_State *L) { return binary(L, NVL_OP_ADD); }
static int l_sub(lua_State *L) { return binary(L, NVL_OP_SUB); }
static int l_mul(lua_State *L) { return binary(L, NVL_OP_MUL); }
static int l_div(lua_State *L) { return binary(L, NVL_OP_DIV); }
static int l_pow(lua_State *L) { return binary(L, NVL_OP_POW); }
static int l_maximum(lua_State *L) { return binary(L, NVL_OP_MAXIMUM); }
static int l_minimum(lua_State *L) { return binary(L, NVL_OP_MINIMUM); }
static int l_eq(lua_State *L) { return binary(L, NVL_OP_EQ); }
static int l_ne(lua_State *L) { return binary(L, NVL_OP_NE); }
static int l_lt(lua_State *L) { return binary(L, NVL_OP_LT); }
static int l_le(lua_State *L) { return binary(L, NVL_OP_LE); }
static int l_gt(lua_State *L) { return binary(L, NVL_OP_GT); }
static int l_ge(lua_State *L) { return binary(L, NVL_OP_GE); }

static int unary(lua_State *L, nvl_unary_op op) {
  nvl_tensor *a = check_live(L, 1, nvl_unary_names[op]);
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_unary(r, op, a));
  return 1;
}
static int l_exp(lua_State *L) { return unary(L, NVL_OP_EXP); }
static int l_log(lua_State *L) { return unary(L, NVL_OP_LOG); }
static int l_sqrt(lua_State *L) { return unary(L, NVL_OP_SQRT); }
static int l_abs(lua_State *L) { return unary(L, NVL_OP_ABS); }
static int l_neg(lua_State *L) { return unary(L, NVL_OP_NEG); }

/* t:sum() -> number; t:sum(dim [, keepdim]) -> tensor (max/min also return 1-based indices). */
static int reduce(lua_State *L, nvl_reduce_op op) {
  const char *name = nvl_reduce_names[op];
  nvl_tensor *a = check_live(L, 1, name);
  if (lua_isnoneornil(L, 2)) {
    nvl_scalar v;
    CHECK(L, nvl_reduce_all(&v, op, a));
    if (v.is_int) lua_pushinteger(L, v.i);
    else lua_pushnumber(L, v.f);
    return 1;
  }
  int d = check_dim(L, 2, a);
  int keep = lua_toboolean(L, 3);
  int with_idx = op == NVL_RED_MAX || op == NVL_RED_MIN;
  nvl_tensor *r = push_tensor(L);
  nvl_tensor *ix = with_idx ? push_tensor(L) : NULL;
  CHECK(L, nvl_reduce_dim(r, ix, op, a, d, keep));
  if (ix) { /* 0-based positions -> 1-based */
    int64_t *p = nvl_tensor_data(ix);
    for (int64_t k = 0, n = nvl_tensor_numel(ix); k < n; k++) p[k] += 1;
  }
  return with_idx ? 2 : 1;
}
static int l_sum(lua_State *L) { return reduce(L, NVL_RED_SUM); }
static int l_mean(lua_State *L) { return reduce(L, NVL_RED_MEAN); }
static int l_max(lua_State *L) { return reduce(L, NVL_RED_MAX); }
static int l_min(lua_State *L) { return reduce(L, NVL_RED_MIN); }
static int l_amax(lua_State *L) { return reduce(L, NVL_RED_AMAX); }

/* t:add_(src [, alpha]) -> t */
static int l_add_(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "add_"), *src = check_live(L, 2, "add_");
  CHECK(L, nvl_add_(t, src, luaL_optnumber(L, 3, 1.0)));
  lua_settop(L, 1);
  return 1;
}

/* t:mul_(s) -> t */
static int l_mul_(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "mul_");
  CHECK(L, nvl_mul_(t, luaL_checknumber(L, 2)));
  lua_settop(L, 1);
  return 1;
}

/* t:bytes() -> the raw bytes of a CPU tensor (row-major, little-endian), as a Lua string */
static int l_bytes(lua_State *L) {
  nvl_tensor *t = check_live(L, 1, "bytes");
  if (t->device != NVL_CPU) return luaL_error(L, "bytes: tensor is on cuda; call :cpu() first");
  /* the contiguous copy lives in a userdata: if pushing the string raises (out of memory), the
   * collector frees it */
  nvl_tensor *c = nvl_lua_push_tensor(L);
  CHECK(L, nvl_tensor_contiguous(c, t));
  lua_pushlstring(L, nvl_tensor_data(c), nvl_tensor_nbytes(c));
  nvl_tensor_release(c);
  return 1;
}

/* The bytes of a from_bytes call: the string at 1, the shape at arg, the 0-based offset at arg+1;
 * elem_size bytes per element. Fills shape, returns the dim count and sets *numel and *src. */
static int bytes_arg(lua_State *L, const char *op, int arg, int elem_size, int64_t *shape, int64_t *numel,
                     const char **src) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  luaL_checktype(L, arg, LUA_TTABLE);
  int n = check_shape(L, arg, shape);
  lua_Integer off = luaL_optinteger(L, arg + 1, 0);
  CHECK(L, nvl_shape_numel(op, n, shape, numel));
  size_t need = (size_t)*numel * (size_t)elem_size; /* numel <= NVL_MAX_NUMEL: no overflow */
  if (off < 0 || (size_t)off > len || len - (size_t)off < need) /* before allocating anything */
    luaL_error(L, "%s: %I bytes needed at offset %I, the string has %I", op, (lua_Integer)need, off, (lua_Integer)len);
  *src = s + off;
  return n;
}

/* core.from_bytes(str, dtype, shape [, offset]) -> a new tensor holding a copy of the bytes
 * str[offset+1 .. offset+numel*size] (offset 0-based, default 0) */
static int l_from_bytes(lua_State *L) {
  nvl_dtype dt = check_dtype(L, 2);
  int64_t shape[NVL_MAX_DIMS], numel;
  const char *src;
  int n = bytes_arg(L, "from_bytes", 3, nvl_dtypes[dt].elem_size, shape, &numel, &src);
  nvl_tensor *t = push_tensor(L);
  CHECK(L, nvl_tensor_empty(t, dt, NVL_CPU, n, shape));
  memcpy(nvl_tensor_data(t), src, (size_t)numel * (size_t)nvl_dtypes[dt].elem_size);
  return 1;
}

/* core.from_f16_bytes(str, shape [, offset]) -> a new f32 tensor of the IEEE half values (2 bytes
 * each, little-endian) at str[offset+1 ..], converted exactly (nvl_f16_to_f32) */
static int l_from_f16_bytes(lua_State *L) {
  int64_t shape[NVL_MAX_DIMS], numel;
  const char *src;
  int n = bytes_arg(L, "from_f16_bytes", 2, 2, shape, &numel, &src);
  nvl_tensor *t = push_tensor(L);
  CHECK(L, nvl_tensor_empty(t, NVL_F32, NVL_CPU, n, shape));
  nvl_f16_to_f32_n(nvl_tensor_data(t), (const uint8_t *)src, numel);
  return 1;
}

/* A 2-D contiguous host tensor of dtype dt at argument i, for decode_scaled. */
static nvl_tensor *decode_arg(lua_State *L, int i, nvl_dtype dt, const char *what) {
  nvl_tensor *t = check_live(L, i, "decode_scaled");
  if (t->dtype != dt || t->ndim != 2 || t->device != NVL_CPU || !nvl_tensor_is_contiguous(t))
    luaL_argerror(L, i, lua_pushfstring(L, "%s must be a 2-D contiguous %s tensor on the CPU", what, nvl_dtypes[dt].name));
  return t;
}

/* core.decode_scaled(codes, elem, K [, scales [, {global =, divide =, exact =, plus_zero =}]]) -> a new
 * f32 [rows, K]: the dense values of a deployment checkpoint's weight (nvl_decode_scaled_n, whose
 * nvl_decode_opts the options are: global a number, default 1; the others booleans). codes u8
 * [rows, K] (elem "e2m1": [rows, K/2], two codes a byte); scales f32 [rows or 1, nb], K a multiple
 * of nb. */
static int l_decode_scaled(lua_State *L) {
  nvl_tensor *codes = decode_arg(L, 1, NVL_U8, "codes");
  const char *name = luaL_checkstring(L, 2);
  const nvl_codec *c = nvl_codec_from_name(name);
  if (!c) return luaL_argerror(L, 2, lua_pushfstring(L, "unknown element format '%s' (%s)", name, nvl_codec_names()));
  int packed = strcmp(name, "e2m1") == 0;
  lua_Integer K = luaL_checkinteger(L, 3);
  int64_t rows = codes->shape[0];
  if (K < 1 || codes->shape[1] != (packed ? K / 2 : K) || (packed && K % 2))
    return luaL_argerror(L, 3, lua_pushfstring(L, "K = %I does not match codes [%I, %I] of %s", K,
                                               (lua_Integer)rows, (lua_Integer)codes->shape[1], name));
  nvl_tensor *scales = lua_isnoneornil(L, 4) ? NULL : decode_arg(L, 4, NVL_F32, "scales");
  if (scales && (scales->shape[1] < 1 || K % scales->shape[1] || (scales->shape[0] != rows && scales->shape[0] != 1)))
    return luaL_argerror(L, 4, lua_pushfstring(L, "scales [%I, %I] do not block [%I, %I]", (lua_Integer)scales->shape[0],
                                               (lua_Integer)scales->shape[1], (lua_Integer)rows, K));
  nvl_decode_opts o = {1.0f, 0, 0, 0};
  if (!lua_isnoneornil(L, 5)) {
    luaL_checktype(L, 5, LUA_TTABLE);
    if (lua_getfield(L, 5, "global") != LUA_TNIL) {
      if (lua_type(L, -1) != LUA_TNUMBER) return luaL_argerror(L, 5, "global must be a number");
      o.global = (float)lua_tonumber(L, -1);
    }
    lua_getfield(L, 5, "divide");
    lua_getfield(L, 5, "exact");
    lua_getfield(L, 5, "plus_zero");
    o.divide = lua_toboolean(L, -3), o.exact = lua_toboolean(L, -2), o.plus_zero = lua_toboolean(L, -1);
    lua_pop(L, 4);
  }
  int64_t shape[2] = {rows, K};
  nvl_tensor *t = push_tensor(L);
  CHECK(L, nvl_tensor_empty(t, NVL_F32, NVL_CPU, 2, shape));
  nvl_decode_scaled_n(nvl_tensor_data(t), nvl_tensor_data(codes), c, packed, scales ? nvl_tensor_data(scales) : NULL,
                      rows, K, scales ? scales->shape[0] : 0, scales ? scales->shape[1] : 0, &o);
  return 1;
}

static int l_matmul(lua_State *L) {
  nvl_tensor *a = check_live(L, 1, "matmul"), *b = check_live(L, 2, "matmul");
  nvl_tensor *r = push_tensor(L);
  CHECK(L, nvl_matmul(r, a, b));
  return 1;
}

/* a:allclose(b [, rtol=1e-5 [, atol=1e-8 [, equal_nan]]]) */
static int l_allclose(lua_State *L) {
  nvl_tensor *a = check_live(L, 1, "allclose"), *b = check_live(L, 2, "allclose");
  int r;
  CHECK(L, nvl_allclose(&r, a, b, luaL_optnumber(L, 3, 1e-5), luaL_optnumber(L, 4, 1e-8), lua_toboolean(L, 5)));
  lua_pushboolean(L, r);
  return 1;
}

/* ---- generators ---- */

static int l_generator(lua_State *L) {
  lua_Integer seed = luaL_checkinteger(L, 1);
  nvl_lua_generator *g = lua_newuserdatauv(L, sizeof(nvl_lua_generator), 0);
  g->own.seed = (uint64_t)seed;
  g->own.offset = 0;
  g->g = &g->own;
  luaL_setmetatable(L, NVL_GENERATOR_MT);
  return 1;
}

static int l_default_generator(lua_State *L) {
  nvl_lua_generator *g = lua_newuserdatauv(L, sizeof(nvl_lua_generator), 0);
  g->g = nvl_default_generator();
  luaL_setmetatable(L, NVL_GENERATOR_MT);
  return 1;
}

static int l_manual_seed(lua_State *L) {
  nvl_generator *g = nvl_default_generator();
  g->seed = (uint64_t)luaL_checkinteger(L, 1);
  g->offset = 0;
  return 0;
}

static int g_seed(lua_State *L) { lua_pushinteger(L, (lua_Integer)((nvl_lua_generator *)luaL_checkudata(L, 1, NVL_GENERATOR_MT))->g->seed); return 1; }
static int g_offset(lua_State *L) { lua_pushinteger(L, (lua_Integer)((nvl_lua_generator *)luaL_checkudata(L, 1, NVL_GENERATOR_MT))->g->offset); return 1; }
static int g_set_offset(lua_State *L) {
  nvl_lua_generator *g = luaL_checkudata(L, 1, NVL_GENERATOR_MT);
  lua_Integer o = luaL_checkinteger(L, 2);
  luaL_argcheck(L, o >= 0, 2, "offset must be >= 0");
  g->g->offset = (uint64_t)o;
  return 0;
}
static int g_manual_seed(lua_State *L) {
  nvl_lua_generator *g = luaL_checkudata(L, 1, NVL_GENERATOR_MT);
  g->g->seed = (uint64_t)luaL_checkinteger(L, 2);
  g->g->offset = 0;
  return 0;
}
static int g_tostring(lua_State *L) {
  nvl_lua_generator *g = luaL_checkudata(L, 1, NVL_GENERATOR_MT);
  lua_pushfstring(L, "nvlua.Generator(seed=%I, offset=%I)", (lua_Integer)g->g->seed, (lua_Integer)g->g->offset);
  return 1;
}

/* philox(ctr0..3, key0..1) -> 4 words, for known-answer tests. */
static int l_philox(lua_State *L) {
  uint32_t ctr[4], key[2], out[4];
  for (int i = 0; i < 4; i++) ctr[i] = (uint32_t)luaL_checkinteger(L, i + 1);
  for (int i = 0; i < 2; i++) key[i] = (uint32_t)luaL_checkinteger(L, i + 5);
  nvl_philox4x32_10(ctr, key, out);
  for (int i = 0; i < 4; i++) lua_pushinteger(L, out[i]);
  return 4;
}

/* ---- system ---- */

static int l_memory(lua_State *L) {
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, (lua_Integer)nvl_memory_live(NVL_CPU)); lua_setfield(L, -2, "cpu");
  lua_pushinteger(L, (lua_Integer)nvl_memory_live(NVL_CUDA)); lua_setfield(L, -2, "cuda");
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, (lua_Integer)nvl_memory_peak(NVL_CPU)); lua_setfield(L, -2, "cpu");
  lua_pushinteger(L, (lua_Integer)nvl_memory_peak(NVL_CUDA)); lua_setfield(L, -2, "cuda");
  lua_setfield(L, -2, "peak");
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, (lua_Integer)nvl_memory_count(NVL_CPU)); lua_setfield(L, -2, "cpu");
  lua_pushinteger(L, (lua_Integer)nvl_memory_count(NVL_CUDA)); lua_setfield(L, -2, "cuda");
  lua_setfield(L, -2, "tensors");
  lua_pushinteger(L, (lua_Integer)nvl_memory_cached()); lua_setfield(L, -2, "cached");
  nvl_lua_push_cuda_memory(L); lua_setfield(L, -2, "devices"); /* per GPU: the caching allocator's stats */
  return 1;
}

/* Monotonic wall-clock seconds, for timing. */
static int l_clock(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  lua_pushnumber(L, (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec);
  return 1;
}

/* core.empty_cache(): give the host allocator's cached buffers back to the OS */
/* core.reset_peak_memory(): the peak restarts from what is live now (every device) */
static int l_reset_peak(lua_State *L) {
  (void)L;
  nvl_memory_reset_peak(NVL_CPU);
  nvl_memory_reset_peak(NVL_CUDA);
  return 0;
}

static int l_empty_cache(lua_State *L) {
  (void)L;
  nvl_memory_empty_cache();
  return 0;
}

static int l_cuda_available(lua_State *L) { lua_pushboolean(L, nvl_device_count(NVL_CUDA) > 0); return 1; }

static int l_cuda_devices(lua_State *L) {
  int n = nvl_device_count(NVL_CUDA);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    nvl_device_props p;
    CHECK(L, nvl_device_props_of(NVL_CUDA, i, &p));
    lua_createtable(L, 0, 5);
    lua_pushstring(L, p.name); lua_setfield(L, -2, "name");
    lua_pushinteger(L, (lua_Integer)p.total_mem); lua_setfield(L, -2, "memory");
    lua_pushfstring(L, "%d.%d", p.major, p.minor); lua_setfield(L, -2, "capability");
    lua_pushinteger(L, p.multiprocessors); lua_setfield(L, -2, "multiprocessors");
    lua_pushstring(L, p.pci_bus_id); lua_setfield(L, -2, "pci_bus_id");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_build_info(lua_State *L) {
  lua_createtable(L, 0, 6);
  lua_pushstring(L, NVLUA_VERSION); lua_setfield(L, -2, "version");
  lua_pushstring(L, nvl_blas_info()); lua_setfield(L, -2, "blas");
  lua_pushstring(L, nvl_dnnl_info()); lua_setfield(L, -2, "dnnl");
  lua_pushboolean(L, nvl_device_compiled(NVL_CUDA)); lua_setfield(L, -2, "cuda_compiled");
  lua_pushinteger(L, nvl_device_runtime_version(NVL_CUDA)); lua_setfield(L, -2, "cuda_runtime");
  lua_pushinteger(L, (lua_Integer)nvl_device_blas_version(NVL_CUDA)); lua_setfield(L, -2, "cublaslt");
  lua_pushstring(L, nvl_device_unavailable_reason(NVL_CUDA)); lua_setfield(L, -2, "cuda_unavailable_reason");
  lua_pushstring(L, nvl_fp_env_info()); lua_setfield(L, -2, "fp_env");
  return 1;
}

static int l_dtypes(lua_State *L) {
  lua_createtable(L, NVL_DTYPE_COUNT, 0);
  for (int i = 0; i < NVL_DTYPE_COUNT; i++) {
    const nvl_dtype_traits *t = &nvl_dtypes[i];
    lua_createtable(L, 0, 6);
    lua_pushstring(L, t->name); lua_setfield(L, -2, "name");
    lua_pushinteger(L, t->bits); lua_setfield(L, -2, "bits");
    lua_pushinteger(L, t->elem_size); lua_setfield(L, -2, "bytes");
    lua_pushboolean(L, t->is_float); lua_setfield(L, -2, "is_float");
    lua_pushboolean(L, t->is_quantized); lua_setfield(L, -2, "is_quantized");
    lua_pushinteger(L, t->scale_bits); lua_setfield(L, -2, "scale_bits");
    lua_pushinteger(L, t->block); lua_setfield(L, -2, "block");
    lua_pushnumber(L, t->max_finite); lua_setfield(L, -2, "max");
    lua_pushnumber(L, t->min_value); lua_setfield(L, -2, "min");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* core.formats() -> {[name] = traits} for every float format nv.quantize takes (dtype.h's traits
 * rows: the one source of bits, block lengths, scale kinds and names for the Lua library) */
static int l_formats(lua_State *L) {
  lua_newtable(L);
  for (int i = 0; i < NVL_DTYPE_COUNT; i++) {
    const nvl_dtype_traits *t = &nvl_dtypes[i];
    if (!t->is_float) continue;
    lua_createtable(L, 0, 16);
    lua_pushstring(L, t->name); lua_setfield(L, -2, "name");
    lua_pushinteger(L, i); lua_setfield(L, -2, "index"); /* the enum value: the formats' order */
    lua_pushboolean(L, t->is_quantized); lua_setfield(L, -2, "quantized");
    lua_pushinteger(L, t->bits); lua_setfield(L, -2, "elem_bits");
    lua_pushnumber(L, t->bits_per_elem); lua_setfield(L, -2, "bits");
    lua_pushnumber(L, t->max_finite); lua_setfield(L, -2, "max");
    if (t->is_quantized) {
      lua_pushstring(L, nvl_elem_names[t->elem]); lua_setfield(L, -2, "elem");
      lua_pushinteger(L, t->block); lua_setfield(L, -2, "block");
      lua_pushstring(L, nvl_layout_names[t->layout]); lua_setfield(L, -2, "layout");
      lua_pushstring(L, nvl_scale_kind_names[t->scale]); lua_setfield(L, -2, "scale");
      lua_pushinteger(L, t->scale_bits); lua_setfield(L, -2, "scale_bits");
      lua_pushstring(L, t->scale_rule); lua_setfield(L, -2, "scale_rule");
      lua_pushboolean(L, t->block2d); lua_setfield(L, -2, "block2d");
      lua_pushboolean(L, t->sr); lua_setfield(L, -2, "sr");
      lua_pushboolean(L, t->global_amax); lua_setfield(L, -2, "global_amax");
      /* largest magnitude a quantized element can carry, scales included */
      double smax = t->scale == NVL_SCALE_UE4M3 ? 448.0 : t->scale == NVL_SCALE_E8M0 ? 0x1p127 : 1.0;
      lua_pushnumber(L, t->max_finite * smax); lua_setfield(L, -2, "range");
    } else {
      lua_pushstring(L, "none"); lua_setfield(L, -2, "scale");
      lua_pushinteger(L, 0); lua_setfield(L, -2, "block");
      lua_pushstring(L, "none"); lua_setfield(L, -2, "layout");
    }
    lua_setfield(L, -2, t->name);
  }
  return 1;
}

/* core.use_reference(on) -> the previous setting: while on, every op on CPU tensors runs the
 * scalar reference kernels (kernels/cpu/ref) and ops on device tensors refuse to run */
static int l_use_reference(lua_State *L) {
  luaL_checktype(L, 1, LUA_TBOOLEAN);
  lua_pushboolean(L, nvl_use_reference(lua_toboolean(L, 1)));
  return 1;
}

/* core.gemm_bf16([on]) -> the previous setting, whether the path can run now: the CPU's emulated
 * GEMMs on its bf16 units through oneDNN (where their values allow, else sgemm); on = false keeps
 * them on sgemm (as NVLUA_DNNL=0 does from the start). */
static int l_gemm_bf16(lua_State *L) {
  int on = -1;
  if (!lua_isnoneornil(L, 1)) {
    luaL_checktype(L, 1, LUA_TBOOLEAN);
    on = lua_toboolean(L, 1);
  }
  lua_pushboolean(L, nvl_cpu_gemm_bf16_switch(on));
  lua_pushboolean(L, nvl_cpu_gemm_bf16_ready());
  return 2;
}

/* core.gemm_paths() -> {bf16 = n, sgemm = n}: how many CPU emulated GEMMs ran on each path */
static int l_gemm_paths(lua_State *L) {
  int64_t b, s;
  nvl_cpu_gemm_paths(&b, &s);
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, (lua_Integer)b); lua_setfield(L, -2, "bf16");
  lua_pushinteger(L, (lua_Integer)s); lua_setfield(L, -2, "sgemm");
  return 1;
}

static const luaL_Reg tensor_methods[] = {
  {"size", l_size}, {"stride", l_stride}, {"dim", l_dim}, {"numel", l_numel}, {"nbytes", l_nbytes}, {"dtype", l_dtype},
  {"device", l_device}, {"is_contiguous", l_is_contiguous}, {"is_freed", l_is_freed},
  {"storage_offset", l_storage_offset}, {"is_view_of", l_is_view_of}, {"free", l_free},
  {"view", l_view}, {"reshape", l_reshape}, {"expand", l_expand}, {"transpose", l_transpose},
  {"permute", l_permute}, {"narrow", l_narrow}, {"select", l_select}, {"contiguous", l_contiguous},
  {"clone", l_clone}, {"copy_", l_copy_}, {"to", l_to}, {"cuda", l_cuda}, {"cpu", l_cpu},
  {"get", l_get}, {"set", l_set}, {"totable", l_totable}, {"fill_", l_fill_},
  {"add", l_add}, {"sub", l_sub}, {"mul", l_mul}, {"div", l_div}, {"pow", l_pow},
  {"maximum", l_maximum}, {"minimum", l_minimum}, {"eq", l_eq}, {"ne", l_ne}, {"lt", l_lt},
  {"le", l_le}, {"gt", l_gt}, {"ge", l_ge},
  {"exp", l_exp}, {"log", l_log}, {"sqrt", l_sqrt}, {"abs", l_abs}, {"neg", l_neg},
  {"sum", l_sum}, {"mean", l_mean}, {"max", l_max}, {"min", l_min}, {"amax", l_amax},
  {"matmul", l_matmul}, {"allclose", l_allclose}, {"add_", l_add_}, {"mul_", l_mul_}, {"bytes", l_bytes},
  {NULL, NULL}};

static const luaL_Reg tensor_meta[] = {
  {"__index", l_index}, {"__newindex", l_newindex}, {"__len", l_len}, {"__gc", l_gc}, {"__close", l_gc},
  {"__add", l_add}, {"__sub", l_sub}, {"__mul", l_mul}, {"__div", l_div}, {"__pow", l_pow}, {"__unm", l_neg},
  {NULL, NULL}};

static const luaL_Reg generator_methods[] = {
  {"seed", g_seed}, {"offset", g_offset}, {"set_offset", g_set_offset}, {"manual_seed", g_manual_seed}, {NULL, NULL}};

static const luaL_Reg module_funcs[] = {
  {"empty", l_empty}, {"tensor", l_tensor}, {"fill_", l_fill_}, {"arange_", l_arange_}, {"rand_", l_rand_},
  {"randn_", l_randn_}, {"Generator", l_generator}, {"default_generator", l_default_generator},
  {"manual_seed", l_manual_seed}, {"philox", l_philox}, {"memory", l_memory},
  {"cuda_available", l_cuda_available}, {"cuda_devices", l_cuda_devices}, {"build_info", l_build_info},
  {"dtypes", l_dtypes}, {"formats", l_formats}, {"use_reference", l_use_reference}, {"gemm_bf16", l_gemm_bf16}, {"gemm_paths", l_gemm_paths}, {"clock", l_clock}, {"empty_cache", l_empty_cache}, {"reset_peak_memory", l_reset_peak}, {"from_bytes", l_from_bytes}, {"from_f16_bytes", l_from_f16_bytes}, {"decode_scaled", l_decode_scaled}, {"matmul", l_matmul}, {"allclose", l_allclose}, {NULL, NULL}};

int luaopen_nvlua_core(lua_State *L) {
  luaL_newmetatable(L, TENSOR_MT);
  luaL_setfuncs(L, tensor_meta, 0);
  luaL_newlib(L, tensor_methods);
  lua_setfield(L, -2, "__methods");
  lua_pop(L, 1);

  luaL_newmetatable(L, NVL_GENERATOR_MT);
  lua_pushcfunction(L, g_tostring);
  lua_setfield(L, -2, "__tostring");
  luaL_newlib(L, generator_methods);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);

  luaL_newlib(L, module_funcs);
  luaL_getmetatable(L, TENSOR_MT);
  lua_setfield(L, -2, "Tensor");
  luaL_getmetatable(L, NVL_GENERATOR_MT);
  lua_setfield(L, -2, "Generator_mt");
  nvl_lua_open_errors(L);
  nvl_lua_open_scope(L);
  nvl_lua_open_quant(L);
  nvl_lua_open_layers(L);
  nvl_lua_open_attention(L);
  nvl_lua_open_sys(L);
  nvl_lua_open_gzip(L);
  nvl_lua_open_cuda(L);
  nvl_lua_open_dist(L);
  nvl_lua_open_tokenizer(L);
  /* core.version: what build_info().version says, without build_info's CUDA probe (which starts the
   * CUDA runtime: loading nvlua must not, or dist.init's CUDA_VISIBLE_DEVICES comes too late) */
  lua_pushstring(L, NVLUA_VERSION);
  lua_setfield(L, -2, "version");
  return 1;
}
