/* layers.c: the Lua binding of core/layers.h (attention excepted: lua/bind/attention.c). Adds to
 * the module table nvlua.core:
 *   embedding_forward(ids, weight [, dtype]) -> out   embedding_backward(dweight, dout, ids)
 *   rmsnorm_forward(x, weight, eps [, amax]) -> out, rstd [, amax]      rmsnorm_backward(dweight, dout, x, weight, rstd) -> dx
 *   rope_tables(T, D, theta [, scaling [, M]]) -> cos, sin
 *   rope_forward(x, cos, sin) -> out                  rope_backward(dout, cos, sin) -> dx
 *   swiglu_forward(gate, up [, amax]) -> out [, amax]                   swiglu_backward(dout, gate, up) -> dgate, dup
 *   cross_entropy(logits, targets [, opts]) -> loss, count, dlogits | nil
 *   adamw_step(param, grad, m, v, opts)               sumsq(t) -> number
 *   adamw_multi(params, grads, ms, vs, opts, no_decay, state)   grad_norm_multi(state, grads, max_norm)
 * Backwards accumulate into the parameter gradient passed in (dweight +=) and return new
 * activation gradients. ids and targets are i64 tensors of 0-based token ids: data, not Lua
 * indices. Options tables are checked here: unknown keys, wrong types and missing required keys
 * raise, naming the valid keys. Shapes, dtypes and ranges are checked by core. */
#include <lauxlib.h>
#include <lua.h>
#include <string.h>
#include "bind.h"
#include "layers.h"
#include "optim.h"

/* ---- embedding -------------------------------------------------------------------------------- */

static int l_embedding_forward(lua_State *L) {
  nvl_tensor *ids = nvl_lua_check_tensor(L, 1, "embedding_forward");
  nvl_tensor *w = nvl_lua_check_tensor(L, 2, "embedding_forward");
  nvl_dtype dt = NVL_F32; /* the output's: "f32" (default) or "bf16" (bf16 activations) */
  if (!lua_isnoneornil(L, 3)) {
    const char *name = luaL_checkstring(L, 3);
    dt = nvl_dtype_from_name(name);
    if (dt != NVL_F32 && dt != NVL_BF16)
      return luaL_error(L, "embedding_forward: dtype must be 'f32' or 'bf16', got '%s'", name);
  }
  nvl_tensor *out = nvl_lua_push_tensor(L);
  CHECK(L, nvl_embedding_forward_as(out, ids, w, dt));
  return 1;
}

static int l_embedding_backward(lua_State *L) {
  nvl_tensor *dw = nvl_lua_check_tensor(L, 1, "embedding_backward");
  nvl_tensor *dout = nvl_lua_check_tensor(L, 2, "embedding_backward");
  nvl_tensor *ids = nvl_lua_check_tensor(L, 3, "embedding_backward");
  CHECK(L, nvl_embedding_backward(dw, dout, ids));
  return 0;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

static int l_rmsnorm_forward(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "rmsnorm_forward");
  nvl_tensor *w = nvl_lua_check_tensor(L, 2, "rmsnorm_forward");
  double eps = luaL_checknumber(L, 3);
  int want_amax = lua_toboolean(L, 4); /* also max |out| as a one-element f32 tensor (core/layers.h) */
  lua_settop(L, 3);
  nvl_tensor *out = nvl_lua_push_tensor(L);
  nvl_tensor *rstd = nvl_lua_push_tensor(L);
  if (!want_amax) {
    CHECK(L, nvl_rmsnorm_forward(out, rstd, x, w, eps));
    return 2;
  }
  nvl_tensor *amax = nvl_lua_push_tensor(L);
  CHECK(L, nvl_rmsnorm_forward_amax(out, rstd, amax, x, w, eps));
  return 3;
}

static int l_rmsnorm_backward(lua_State *L) {
  nvl_tensor *dw = nvl_lua_check_tensor(L, 1, "rmsnorm_backward");
  nvl_tensor *dout = nvl_lua_check_tensor(L, 2, "rmsnorm_backward");
  nvl_tensor *x = nvl_lua_check_tensor(L, 3, "rmsnorm_backward");
  nvl_tensor *w = nvl_lua_check_tensor(L, 4, "rmsnorm_backward");
  nvl_tensor *rstd = nvl_lua_check_tensor(L, 5, "rmsnorm_backward");
  nvl_tensor *dx = nvl_lua_push_tensor(L);
  CHECK(L, nvl_rmsnorm_backward(dx, dw, dout, x, w, rstd));
  return 1;
}

/* ---- RoPE ------------------------------------------------------------------------------------- */

static const char *const scaling_keys[] = {"factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings", "rope_type", NULL};
/* rope_type names by nvl_rope_kind */
static const char *const rope_kinds[] = {"default", "llama3", "linear", "dynamic", NULL};

/* The scaling table at idx: rope_type (default "llama3") and the keys that type reads, each
 * required; a key of another type is an error. M: the 5th argument (dynamic). */
static void check_scaling(lua_State *L, int idx, nvl_rope_scaling *sc) {
  const char *op = "rope_tables";
  luaL_checktype(L, idx, LUA_TTABLE);
  nvl_lua_check_keys(L, idx, op, scaling_keys);
  sc->kind = NVL_ROPE_LLAMA3;
  if (lua_getfield(L, idx, "rope_type") != LUA_TNIL) {
    int k = -1;
    if (lua_type(L, -1) == LUA_TSTRING)
      for (int i = 0; rope_kinds[i]; i++)
        if (strcmp(lua_tostring(L, -1), rope_kinds[i]) == 0) k = i;
    if (k < 0)
      luaL_error(L, "%s: scaling rope_type must be \"llama3\", \"linear\", \"dynamic\" or \"default\", got %s", op,
                 luaL_tolstring(L, -1, NULL));
    sc->kind = (nvl_rope_kind)k;
  }
  lua_pop(L, 1);
  int llama3 = sc->kind == NVL_ROPE_LLAMA3;
  static const char *const llama3_keys[] = {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  for (int i = 0; i < 3 && !llama3; i++) {
    if (lua_getfield(L, idx, llama3_keys[i]) != LUA_TNIL)
      luaL_error(L, "%s: scaling key '%s' belongs to rope_type llama3, not %s", op, llama3_keys[i],
                 rope_kinds[sc->kind]);
    lua_pop(L, 1);
  }
  if (sc->kind == NVL_ROPE_DEFAULT) return;
  nvl_lua_opt_number(L, idx, op, "factor", &sc->factor, 1);
  if (!llama3) return;
  nvl_lua_opt_number(L, idx, op, "low_freq_factor", &sc->low_freq_factor, 1);
  nvl_lua_opt_number(L, idx, op, "high_freq_factor", &sc->high_freq_factor, 1);
  nvl_lua_opt_number(L, idx, op, "original_max_position_embeddings", &sc->original_max_position_embeddings, 1);
}

/* rope_tables(T, D, theta [, scaling [, M]]): M, dynamic scaling's max_position_embeddings */
static int l_rope_tables(lua_State *L) {
  lua_Integer T = luaL_checkinteger(L, 1), D = luaL_checkinteger(L, 2);
  double theta = luaL_checknumber(L, 3);
  nvl_rope_scaling sc = {0};
  int scaled = !lua_isnoneornil(L, 4);
  if (scaled) check_scaling(L, 4, &sc);
  if (sc.kind == NVL_ROPE_DYNAMIC) sc.max_position_embeddings = luaL_checknumber(L, 5);
  nvl_tensor *c = nvl_lua_push_tensor(L);
  nvl_tensor *s = nvl_lua_push_tensor(L);
  CHECK(L, nvl_rope_tables(c, s, T, D, theta, scaled ? &sc : NULL));
  return 2;
}

static int l_rope_forward(lua_State *L) {
  nvl_tensor *x = nvl_lua_check_tensor(L, 1, "rope_forward");
  nvl_tensor *c = nvl_lua_check_tensor(L, 2, "rope_forward");
  nvl_tensor *s = nvl_lua_check_tensor(L, 3, "rope_forward");
  nvl_tensor *out = nvl_lua_push_tensor(L);
  CHECK(L, nvl_rope_forward(out, x, c, s));
  return 1;
}

static int l_rope_backward(lua_State *L) {
  nvl_tensor *dout = nvl_lua_check_tensor(L, 1, "rope_backward");
  nvl_tensor *c = nvl_lua_check_tensor(L, 2, "rope_backward");
  nvl_tensor *s = nvl_lua_check_tensor(L, 3, "rope_backward");
  nvl_tensor *dx = nvl_lua_push_tensor(L);
  CHECK(L, nvl_rope_backward(dx, dout, c, s));
  return 1;
}

/* ---- SwiGLU ----------------------------------------------------------------------------------- */

static int l_swiglu_forward(lua_State *L) {
  nvl_tensor *g = nvl_lua_check_tensor(L, 1, "swiglu_forward");
  nvl_tensor *u = nvl_lua_check_tensor(L, 2, "swiglu_forward");
  int want_amax = lua_toboolean(L, 3);
  lua_settop(L, 2);
  nvl_tensor *out = nvl_lua_push_tensor(L);
  if (!want_amax) {
    CHECK(L, nvl_swiglu_forward(out, g, u));
    return 1;
  }
  nvl_tensor *amax = nvl_lua_push_tensor(L);
  CHECK(L, nvl_swiglu_forward_amax(out, amax, g, u));
  return 2;
}

static int l_swiglu_backward(lua_State *L) {
  nvl_tensor *dout = nvl_lua_check_tensor(L, 1, "swiglu_backward");
  nvl_tensor *g = nvl_lua_check_tensor(L, 2, "swiglu_backward");
  nvl_tensor *u = nvl_lua_check_tensor(L, 3, "swiglu_backward");
  nvl_tensor *dg = nvl_lua_push_tensor(L);
  nvl_tensor *du = nvl_lua_push_tensor(L);
  CHECK(L, nvl_swiglu_backward(dg, du, dout, g, u));
  return 2;
}

/* ---- cross-entropy ---------------------------------------------------------------------------- */

static const char *const ce_keys[] = {"ignore_index", "z_loss", "grad", "scale", "of_count", "defer", "grad_dtype",
                                     NULL};

/* cross_entropy(logits, targets [, {ignore_index = -100, z_loss = 0, grad = true, scale = 1, of_count,
 * grad_dtype = "f32"}]):
 * of_count (> 0): logits are a slice of a batch with that many counted tokens (core/layers.h);
 * grad_dtype "bf16": dlogits bf16, each f32 gradient rounded once (no f32 (N, V) copy where the
 * backend writes bf16 itself: CUDA);
 * defer = true: the first result is an i64 (1) tensor on the logits' device holding the bits of the
 * double sum of the loss terms (nvl_cross_entropy_sum: nothing read back), not the mean */
static int l_cross_entropy(lua_State *L) {
  const char *op = "cross_entropy";
  nvl_tensor *logits = nvl_lua_check_tensor(L, 1, op);
  nvl_tensor *targets = nvl_lua_check_tensor(L, 2, op);
  int64_t ignore_index = -100, of_count = 0;
  double z_loss = 0.0, scale = 1.0;
  int grad = 1, defer = 0;
  nvl_dtype grad_dtype = NVL_F32;
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    nvl_lua_check_keys(L, 3, op, ce_keys);
    if (lua_getfield(L, 3, "grad_dtype") != LUA_TNIL) {
      const char *name = lua_tostring(L, -1);
      grad_dtype = name ? nvl_dtype_from_name(name) : NVL_DTYPE_COUNT;
      if (grad_dtype != NVL_F32 && grad_dtype != NVL_BF16)
        return luaL_error(L, "%s: grad_dtype must be 'f32' or 'bf16', got %s", op, name ? name : luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    nvl_lua_opt_integer(L, 3, op, "ignore_index", &ignore_index, 0);
    nvl_lua_opt_number(L, 3, op, "z_loss", &z_loss, 0);
    nvl_lua_opt_boolean(L, 3, op, "grad", &grad);
    nvl_lua_opt_boolean(L, 3, op, "defer", &defer);
    nvl_lua_opt_number(L, 3, op, "scale", &scale, 0);
    nvl_lua_opt_integer(L, 3, op, "of_count", &of_count, 0);
    if (of_count < 0 || (of_count == 0 && lua_getfield(L, 3, "of_count") != LUA_TNIL))
      return luaL_error(L, "%s: of_count must be a positive integer", op);
  }
  lua_settop(L, 3);
  nvl_tensor *d = grad ? nvl_lua_push_tensor(L) : NULL; /* index 4 */
  double loss;
  int64_t count;
  if (defer) {
    nvl_tensor *sum = nvl_lua_push_tensor(L);             /* index 5 (4 without grad) */
    CHECK(L, nvl_cross_entropy_sum(sum, &count, d, logits, targets, ignore_index, z_loss, scale, of_count, grad_dtype));
    lua_pushvalue(L, -1);
  } else {
    CHECK(L, nvl_cross_entropy_of(&loss, &count, d, logits, targets, ignore_index, z_loss, scale, of_count,
                                  grad_dtype));
    lua_pushnumber(L, loss);
  }
  lua_pushinteger(L, (lua_Integer)count);
  if (grad) lua_pushvalue(L, 4);
  else lua_pushnil(L);
  return 3;
}

static const char *const distill_keys[] = {"temperature", "alpha", "ignore_index", "grad", "scale", "of_count", NULL};

/* core.distill_loss(student_logits, teacher_logits, targets [, {temperature = 1, alpha = 0.5, ignore_index = -100,
 * grad = true, scale = 1, of_count}]) -> kl, ce, count, dlogits | nil (core/layers.h nvl_distill_loss) */
static int l_distill_loss(lua_State *L) {
  const char *op = "distill_loss";
  nvl_tensor *s = nvl_lua_check_tensor(L, 1, op), *t = nvl_lua_check_tensor(L, 2, op);
  nvl_tensor *targets = nvl_lua_check_tensor(L, 3, op);
  int64_t ignore_index = -100, of_count = 0;
  double T = 1.0, alpha = 0.5, scale = 1.0;
  int grad = 1;
  if (!lua_isnoneornil(L, 4)) {
    luaL_checktype(L, 4, LUA_TTABLE);
    nvl_lua_check_keys(L, 4, op, distill_keys);
    nvl_lua_opt_number(L, 4, op, "temperature", &T, 0);
    nvl_lua_opt_number(L, 4, op, "alpha", &alpha, 0);
    nvl_lua_opt_integer(L, 4, op, "ignore_index", &ignore_index, 0);
    nvl_lua_opt_boolean(L, 4, op, "grad", &grad);
    nvl_lua_opt_number(L, 4, op, "scale", &scale, 0);
    nvl_lua_opt_integer(L, 4, op, "of_count", &of_count, 0);
  }
  lua_settop(L, 4);
  nvl_tensor *d = grad ? nvl_lua_push_tensor(L) : NULL; /* index 5 */
  double kl, ce;
  int64_t count;
  CHECK(L, nvl_distill_loss(&kl, &ce, &count, d, s, t, targets, ignore_index, T, alpha, scale, of_count));
  lua_pushnumber(L, kl);
  lua_pushnumber(L, ce);
  lua_pushinteger(L, (lua_Integer)count);
  if (grad) lua_pushvalue(L, 5);
  else lua_pushnil(L);
  return 4;
}

/* ---- optimizer and norms ---------------------------------------------------------------------- */

static const char *const adamw_keys[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step", NULL};

/* adamw_step(param, grad, m, v, {lr=, beta1=, beta2=, eps=, weight_decay=, step=}): all required */
/* The AdamW options table at idx (adamw_step's and adamw_multi's): every key required. */
static nvl_adamw_opts adamw_opts(lua_State *L, int idx, const char *op) {
  luaL_checktype(L, idx, LUA_TTABLE);
  nvl_lua_check_keys(L, idx, op, adamw_keys);
  nvl_adamw_opts o;
  nvl_lua_opt_number(L, idx, op, "lr", &o.lr, 1);
  nvl_lua_opt_number(L, idx, op, "beta1", &o.beta1, 1);
  nvl_lua_opt_number(L, idx, op, "beta2", &o.beta2, 1);
  nvl_lua_opt_number(L, idx, op, "eps", &o.eps, 1);
  nvl_lua_opt_number(L, idx, op, "weight_decay", &o.weight_decay, 1);
  nvl_lua_opt_integer(L, idx, op, "step", &o.step, 1);
  return o;
}

static int l_adamw_step(lua_State *L) {
  const char *op = "adamw_step";
  nvl_tensor *p = nvl_lua_check_tensor(L, 1, op);
  nvl_tensor *g = nvl_lua_check_tensor(L, 2, op);
  nvl_tensor *m = nvl_lua_check_tensor(L, 3, op);
  nvl_tensor *v = nvl_lua_check_tensor(L, 4, op);
  nvl_adamw_opts o = adamw_opts(L, 5, op);
  CHECK(L, nvl_adamw_step(p, g, m, v, &o));
  return 0;
}

/* amax_history_step(hist, count, pos, cur) -> sel (core/layers.h nvl_amax_history_step; count and
 * pos 0-based) */
static int l_amax_history_step(lua_State *L) {
  nvl_tensor *hist = nvl_lua_check_tensor(L, 1, "amax_history_step");
  lua_Integer count = luaL_checkinteger(L, 2), pos = luaL_checkinteger(L, 3);
  nvl_tensor *cur = nvl_lua_check_tensor(L, 4, "amax_history_step");
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_amax_history_step(r, hist, (int64_t)count, (int64_t)pos, cur));
  return 1;
}

/* core.block_sqerr(a, b | nil, block) -> f32 [rows, K / block]: sum of (a - b)^2 per 1 x block group */
static int l_block_sqerr(lua_State *L) {
  nvl_tensor *a = nvl_lua_check_tensor(L, 1, "block_sqerr");
  nvl_tensor *b = lua_isnoneornil(L, 2) ? NULL : nvl_lua_check_tensor(L, 2, "block_sqerr");
  lua_Integer block = luaL_checkinteger(L, 3);
  nvl_tensor *r = nvl_lua_push_tensor(L);
  CHECK(L, nvl_block_sqerr(r, a, b, (int64_t)block));
  return 1;
}

static int l_sumsq(lua_State *L) {
  nvl_tensor *t = nvl_lua_check_tensor(L, 1, "sumsq");
  double s;
  CHECK(L, nvl_sumsq(&s, t));
  lua_pushnumber(L, s);
  return 1;
}

/* The array of tensors at idx (a table of n tensors), into a userdata array pushed on the stack. */
static nvl_tensor **tensor_list(lua_State *L, int idx, const char *op, const char *what, lua_Integer n) {
  luaL_checktype(L, idx, LUA_TTABLE);
  if (luaL_len(L, idx) != n)
    luaL_error(L, "%s: %s has %d tensors, params has %d", op, what, (int)luaL_len(L, idx), (int)n);
  nvl_tensor **a = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *a, 0);
  for (lua_Integer j = 1; j <= n; j++) {
    lua_geti(L, idx, j);
    a[j - 1] = luaL_testudata(L, -1, NVL_TENSOR_MT);
    if (!a[j - 1]) luaL_error(L, "%s: %s[%d] is not a tensor (a %s)", op, what, (int)j, luaL_typename(L, -1));
    lua_pop(L, 1); /* the table keeps it */
  }
  return a;
}

/* adamw_multi(params, grads, ms, vs, opts [, no_decay [, state]]): arrays of one length; opts as
 * adamw_step's; no_decay: nil or an array of booleans; state: nil or grad_norm_multi's state */
static int l_adamw_multi(lua_State *L) {
  const char *op = "adamw_multi";
  lua_settop(L, 7); /* the arrays built below go above the arguments */
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_Integer n = luaL_len(L, 1);
  nvl_tensor **p = tensor_list(L, 1, op, "params", n), **g = tensor_list(L, 2, op, "grads", n);
  nvl_tensor **m = tensor_list(L, 3, op, "ms", n), **v = tensor_list(L, 4, op, "vs", n);
  nvl_adamw_opts o = adamw_opts(L, 5, op);
  int *nd = NULL;
  if (!lua_isnoneornil(L, 6)) {
    luaL_checktype(L, 6, LUA_TTABLE);
    nd = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *nd, 0);
    for (lua_Integer j = 1; j <= n; j++) {
      lua_geti(L, 6, j);
      nd[j - 1] = lua_toboolean(L, -1);
      lua_pop(L, 1);
    }
  }
  const nvl_tensor *state = lua_isnoneornil(L, 7) ? NULL : nvl_lua_check_tensor(L, 7, op);
  CHECK(L, nvl_adamw_multi(p, g, m, v, nd, (int64_t)n, &o, state));
  return 0;
}

/* grad_norm_multi(state, grads, max_norm [, take_nonfinite = false]): state (i64, 4 elements, on the
 * grads' device) gets the sum of squares and the clip factor, and with take_nonfinite the device's
 * non-finite flags (slot 4), which are cleared; nothing is read back */
static int l_grad_norm_multi(lua_State *L) {
  const char *op = "grad_norm_multi";
  lua_settop(L, 4);
  const int take = lua_toboolean(L, 4);
  nvl_tensor *state = nvl_lua_check_tensor(L, 1, op);
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_Integer n = luaL_len(L, 2);
  nvl_tensor **g = tensor_list(L, 2, op, "grads", n);
  CHECK(L, nvl_grad_norm_multi(state, g, (int64_t)n, luaL_checknumber(L, 3), take));
  return 0;
}

/* grad_norm_combine(state, parts, max_norm): state's sum of squares = the sum of parts' (norm
 * states, all-gathered), its clip factor for max_norm (core/optim.h) */
static int l_grad_norm_combine(lua_State *L) {
  const char *op = "grad_norm_combine";
  nvl_tensor *state = nvl_lua_check_tensor(L, 1, op);
  nvl_tensor *parts = nvl_lua_check_tensor(L, 2, op);
  CHECK(L, nvl_grad_norm_combine(state, parts, luaL_checknumber(L, 3)));
  return 0;
}

/* nonfinite_take(t) -> flags: the non-finite flags of t's device (backend.h NVL_NONFINITE_*: 1 a
 * quantizer's input, 2 a parameter AdamW read or wrote), cleared; a copy to the host on a GPU */
static int l_nonfinite_take(lua_State *L) {
  uint32_t flags = 0;
  CHECK(L, nvl_nonfinite_take(nvl_lua_check_tensor(L, 1, "nonfinite_take"), &flags));
  lua_pushinteger(L, (lua_Integer)flags);
  return 1;
}

static const luaL_Reg layer_funcs[] = {
  {"embedding_forward", l_embedding_forward}, {"embedding_backward", l_embedding_backward},
  {"rmsnorm_forward", l_rmsnorm_forward}, {"rmsnorm_backward", l_rmsnorm_backward},
  {"rope_tables", l_rope_tables}, {"rope_forward", l_rope_forward}, {"rope_backward", l_rope_backward},
  {"swiglu_forward", l_swiglu_forward}, {"swiglu_backward", l_swiglu_backward},
  {"cross_entropy", l_cross_entropy}, {"adamw_step", l_adamw_step}, {"sumsq", l_sumsq}, {"block_sqerr", l_block_sqerr}, {"distill_loss", l_distill_loss}, {"amax_history_step", l_amax_history_step},
  {"adamw_multi", l_adamw_multi}, {"grad_norm_multi", l_grad_norm_multi},
  {"grad_norm_combine", l_grad_norm_combine}, {"nonfinite_take", l_nonfinite_take},
  {NULL, NULL}};

void nvl_lua_open_layers(lua_State *L) { luaL_setfuncs(L, layer_funcs, 0); }
