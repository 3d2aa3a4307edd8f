/* dist.c: the Lua binding of core/dist.h — the table nvlua.core.dist, which lua/nvlua/dist.lua
 * (require "nvlua.dist") presents. Ranks are 0-based, as MPI numbers them; ops are "sum", "avg",
 * "max", "min". Collectives return their output tensor; core's errors become Lua errors. */
#include <lauxlib.h>
#include <lua.h>
#include "bind.h"
#include "dist.h"

static nvl_dist_op check_op(lua_State *L, int i) {
  return (nvl_dist_op)luaL_checkoption(L, i, "sum", nvl_dist_op_names);
}

/* init([multiple]) -> rank, world; multiple: ask MPI for MPI_THREAD_MULTIPLE (all_reduce_bg's thread) */
static int l_init(lua_State *L) {
  CHECK(L, nvl_dist_init_threads(lua_toboolean(L, 1)));
  lua_pushinteger(L, nvl_dist_rank());
  lua_pushinteger(L, nvl_dist_world_size());
  return 2;
}

static int l_initialized(lua_State *L) { lua_pushboolean(L, nvl_dist_initialized()); return 1; }
static int l_rank(lua_State *L) { lua_pushinteger(L, nvl_dist_rank()); return 1; }
static int l_world_size(lua_State *L) { lua_pushinteger(L, nvl_dist_world_size()); return 1; }
static int l_local_rank(lua_State *L) { lua_pushinteger(L, nvl_dist_local_rank()); return 1; }
static int l_local_size(lua_State *L) { lua_pushinteger(L, nvl_dist_local_size()); return 1; }
static int l_backend(lua_State *L) { lua_pushstring(L, nvl_dist_backend()); return 1; }
static int l_gpu_placement(lua_State *L) { lua_pushstring(L, nvl_dist_gpu_placement()); return 1; }

/* info() -> {mpi = bool, mpi_version = string, nccl = bool, nccl_loads = bool, nccl_why = string} */
static int l_info(lua_State *L) {
  const char *v, *why;
  lua_createtable(L, 0, 5);
  lua_pushboolean(L, nvl_dist_mpi_compiled(&v)); lua_setfield(L, -2, "mpi");
  lua_pushstring(L, v); lua_setfield(L, -2, "mpi_version");
  lua_pushboolean(L, nvl_dist_nccl_compiled()); lua_setfield(L, -2, "nccl");
  lua_pushboolean(L, nvl_nccl_available(&why)); lua_setfield(L, -2, "nccl_loads");
  lua_pushstring(L, why); lua_setfield(L, -2, "nccl_why");
  return 1;
}

static int l_barrier(lua_State *L) {
  CHECK(L, nvl_dist_barrier());
  return 0;
}

/* all_reduce(t [, op]) -> t */
static int l_all_reduce(lua_State *L) {
  nvl_tensor *t = nvl_lua_check_tensor(L, 1, "all_reduce");
  CHECK(L, nvl_dist_all_reduce(t, check_op(L, 2)));
  lua_settop(L, 1);
  return 1;
}

/* all_reduce_start(t [, op = "sum"]) -> t: started, not waited for (core/dist.h) */
static int l_all_reduce_start(lua_State *L) {
  nvl_tensor *t = nvl_lua_check_tensor(L, 1, "all_reduce_start");
  CHECK(L, nvl_dist_all_reduce_start(t, check_op(L, 2)));
  lua_settop(L, 1);
  return 1;
}

/* all_reduce_bg(t [, op = "sum" [, {src = tensor, delta = false}]]) -> t: started in the background
 * (core/dist.h) */
static int l_all_reduce_bg(lua_State *L) {
  nvl_tensor *t = nvl_lua_check_tensor(L, 1, "all_reduce_bg");
  nvl_dist_op op = check_op(L, 2);
  const nvl_tensor *src = NULL;
  int delta = 0;
  if (!lua_isnoneornil(L, 3)) {
    static const char *const keys[] = {"src", "delta", NULL};
    luaL_checktype(L, 3, LUA_TTABLE);
    nvl_lua_check_keys(L, 3, "all_reduce_bg", keys);
    nvl_lua_opt_boolean(L, 3, "all_reduce_bg", "delta", &delta);
    lua_getfield(L, 3, "src");
    if (!lua_isnil(L, -1)) src = nvl_lua_check_tensor(L, lua_gettop(L), "all_reduce_bg (src)");
  }
  CHECK(L, nvl_dist_all_reduce_bg(t, src, op, delta));
  lua_settop(L, 1);
  return 1;
}

static int l_bg_wait(lua_State *L) {
  CHECK(L, nvl_dist_bg_wait());
  return 0;
}

static int l_bg_pending(lua_State *L) { lua_pushboolean(L, nvl_dist_bg_pending()); return 1; }
static int l_bg_busy(lua_State *L) { lua_pushboolean(L, nvl_dist_bg_busy()); return 1; }
static int l_bg_threaded(lua_State *L) { lua_pushboolean(L, nvl_dist_bg_threaded()); return 1; }

/* wait_all(): complete the started all-reduces */
static int l_wait_all(lua_State *L) {
  CHECK(L, nvl_dist_wait_all());
  return 0;
}

static int l_pending(lua_State *L) {
  lua_pushinteger(L, nvl_dist_pending());
  return 1;
}

/* all_reduce_number(x [, op]) -> number, reduced in double precision */
static int l_all_reduce_number(lua_State *L) {
  double x = luaL_checknumber(L, 1);
  CHECK(L, nvl_dist_all_reduce_f64(&x, 1, check_op(L, 2)));
  lua_pushnumber(L, x);
  return 1;
}

/* all_reduce_numbers({x1, x2, ...} [, op]) -> a new table: each number reduced in double
 * precision, all in one collective (e.g. a loss and a flag) */
static int l_all_reduce_numbers(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  nvl_dist_op op = check_op(L, 2);
  lua_Integer n = luaL_len(L, 1);
  luaL_argcheck(L, n <= 4096, 1, "at most 4096 numbers");
  double *x = lua_newuserdatauv(L, (size_t)(n > 0 ? n : 1) * sizeof(double), 0); /* freed by the GC */
  for (lua_Integer i = 0; i < n; i++) {
    if (lua_rawgeti(L, 1, i + 1) != LUA_TNUMBER)
      luaL_error(L, "bad argument #1 to 'all_reduce_numbers' (element %d is a %s, not a number)", (int)(i + 1),
                 luaL_typename(L, -1));
    x[i] = lua_tonumber(L, -1);
    lua_pop(L, 1);
  }
  CHECK(L, nvl_dist_all_reduce_f64(x, (int)n, op));
  lua_createtable(L, (int)n, 0);
  for (lua_Integer i = 0; i < n; i++) {
    lua_pushnumber(L, x[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* broadcast(t [, root = 0]) -> t */
static int l_broadcast(lua_State *L) {
  nvl_tensor *t = nvl_lua_check_tensor(L, 1, "broadcast");
  lua_Integer root = luaL_optinteger(L, 2, 0);
  luaL_argcheck(L, root >= 0 && root < nvl_dist_world_size(), 2,
                lua_pushfstring(L, "root %d is not a rank (0..%d)", (int)root, nvl_dist_world_size() - 1));
  CHECK(L, nvl_dist_broadcast(t, (int)root));
  lua_settop(L, 1);
  return 1;
}

/* reduce_scatter(out, t [, op]) -> out */
static int l_reduce_scatter(lua_State *L) {
  nvl_tensor *out = nvl_lua_check_tensor(L, 1, "reduce_scatter");
  nvl_tensor *t = nvl_lua_check_tensor(L, 2, "reduce_scatter");
  CHECK(L, nvl_dist_reduce_scatter(out, t, check_op(L, 3)));
  lua_settop(L, 1);
  return 1;
}

/* all_gather(out, t) -> out */
static int l_all_gather(lua_State *L) {
  nvl_tensor *out = nvl_lua_check_tensor(L, 1, "all_gather");
  nvl_tensor *t = nvl_lua_check_tensor(L, 2, "all_gather");
  CHECK(L, nvl_dist_all_gather(out, t));
  lua_settop(L, 1);
  return 1;
}

/* shard_rows(rows, world, align) -> a table: [r + 1] = {row0 = first row (0-based), rows = count} for
 * each rank r, and chunk (core/dist.h nvl_dist_shard_rows) */
static int l_shard_rows(lua_State *L) {
  lua_Integer rows = luaL_checkinteger(L, 1), world = luaL_checkinteger(L, 2), align = luaL_optinteger(L, 3, 1);
  luaL_argcheck(L, rows >= 0, 1, "rows must be >= 0");
  luaL_argcheck(L, world >= 1 && world <= (1 << 20), 2, "world must be a rank count >= 1");
  luaL_argcheck(L, align >= 1, 3, "align must be >= 1");
  int64_t row0, n, chunk = 0;
  lua_createtable(L, (int)world, 1);
  for (int r = 0; r < (int)world; r++) {
    nvl_dist_shard_rows((int64_t)rows, (int)world, (int64_t)align, r, &row0, &n, &chunk);
    lua_createtable(L, 0, 2);
    lua_pushinteger(L, (lua_Integer)row0);
    lua_setfield(L, -2, "row0");
    lua_pushinteger(L, (lua_Integer)n);
    lua_setfield(L, -2, "rows");
    lua_rawseti(L, -2, r + 1);
  }
  lua_pushinteger(L, (lua_Integer)chunk);
  lua_setfield(L, -2, "chunk");
  return 1;
}

/* bytes() -> {all_gather = n, reduce_scatter = n, all_reduce = n, broadcast = n}: bytes this rank sent
 * (core/dist.h nvl_dist_bytes); reset_bytes() starts them again from 0 */
static int l_bytes(lua_State *L) {
  lua_createtable(L, 0, NVL_DIST_BYTES_COUNT);
  for (int k = 0; k < NVL_DIST_BYTES_COUNT; k++) {
    lua_pushinteger(L, (lua_Integer)nvl_dist_bytes((nvl_dist_bytes_kind)k));
    lua_setfield(L, -2, nvl_dist_bytes_names[k]);
  }
  return 1;
}

static int l_reset_bytes(lua_State *L) {
  (void)L;
  nvl_dist_bytes_reset();
  return 0;
}

/* all_gather_start(out, t) -> ticket: started, not waited for (core/dist.h); all_gather_wait(ticket) */
static int l_all_gather_start(lua_State *L) {
  nvl_tensor *out = nvl_lua_check_tensor(L, 1, "all_gather_start");
  nvl_tensor *t = nvl_lua_check_tensor(L, 2, "all_gather_start");
  int ticket = -1;
  CHECK(L, nvl_dist_all_gather_start(out, t, &ticket));
  lua_pushinteger(L, ticket);
  return 1;
}

static int l_all_gather_wait(lua_State *L) {
  CHECK(L, nvl_dist_all_gather_wait((int)luaL_checkinteger(L, 1)));
  return 0;
}

static int l_set_timeout(lua_State *L) {
  nvl_dist_set_timeout(luaL_checknumber(L, 1));
  return 0;
}

static int l_timeout(lua_State *L) { lua_pushnumber(L, nvl_dist_timeout()); return 1; }

static int l_finalize(lua_State *L) {
  (void)L;
  nvl_dist_finalize();
  return 0;
}

/* abort(status): end every rank (returns only in a world of one) */
static int l_abort(lua_State *L) {
  lua_Integer status = luaL_optinteger(L, 1, 1);
  nvl_dist_abort(status >= 1 && status <= 255 ? (int)status : 1); /* an exit status; any other value: 1 */
  return 0;
}

static const luaL_Reg dist_funcs[] = {
  {"init", l_init}, {"initialized", l_initialized}, {"rank", l_rank}, {"world_size", l_world_size},
  {"local_rank", l_local_rank}, {"local_size", l_local_size}, {"backend", l_backend}, {"info", l_info},
  {"gpu_placement", l_gpu_placement},
  {"barrier", l_barrier}, {"all_reduce", l_all_reduce}, {"all_reduce_start", l_all_reduce_start}, {"wait_all", l_wait_all}, {"pending", l_pending},
  {"all_reduce_bg", l_all_reduce_bg}, {"bg_wait", l_bg_wait}, {"bg_pending", l_bg_pending},
  {"bg_busy", l_bg_busy}, {"bg_threaded", l_bg_threaded}, {"all_reduce_number", l_all_reduce_number},
  {"all_reduce_numbers", l_all_reduce_numbers},
  {"broadcast", l_broadcast}, {"reduce_scatter", l_reduce_scatter}, {"all_gather", l_all_gather},
  {"all_gather_start", l_all_gather_start}, {"all_gather_wait", l_all_gather_wait},
  {"shard_rows", l_shard_rows}, {"bytes", l_bytes}, {"reset_bytes", l_reset_bytes},
  {"set_timeout", l_set_timeout}, {"timeout", l_timeout}, {"finalize", l_finalize}, {"abort", l_abort},
  {NULL, NULL}};

void nvl_lua_open_dist(lua_State *L) {
  luaL_newlib(L, dist_funcs);
  lua_setfield(L, -2, "dist");
}
