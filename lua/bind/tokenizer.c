/* tokenizer.c: the Lua binding of core/bpe.h — core.bpe_new(spec) and the "nvlua.BPE" userdata with
 * encode and token_id. The spec is what lua/nvlua/tokenizer.lua makes of a tokenizer.json (the JSON
 * read, Sequences flattened, unsupported parts refused there); here each field is type-checked and
 * handed to core in order: vocabulary, model options, merges, normalizers, pre-tokenizer steps,
 * added tokens (normalized ones after the normalizers: their contents are normalized). */
#include <lauxlib.h>
#include <lua.h>
#include <stdlib.h>
#include <string.h>
#include "bind.h"
#include "bpe.h"

#define BPE_MT "nvlua.BPE"
#define IDS_MT "nvlua.BPE_ids"

/* a copy of an encoding's ids, in a userdata whose __gc frees it: a Lua error while the result is
 * built leaks nothing */
typedef struct {
  int32_t *p;
} ids_box;

static int ids_gc(lua_State *L) {
  ids_box *x = luaL_checkudata(L, 1, IDS_MT);
  free(x->p);
  x->p = NULL;
  return 0;
}

static nvl_bpe **check_bpe(lua_State *L, int i) {
  nvl_bpe **b = luaL_checkudata(L, i, BPE_MT);
  if (!*b) luaL_error(L, "tokenizer encoder has been freed");
  return b;
}

/* field k of the table at idx as a string (NULL when absent) */
static const char *opt_string(lua_State *L, int idx, const char *what, const char *k, size_t *len) {
  int t = lua_getfield(L, idx, k);
  const char *s = NULL;
  if (t == LUA_TSTRING) s = lua_tolstring(L, -1, len);
  else if (t != LUA_TNIL) luaL_error(L, "bpe_new: %s.%s must be a string, got %s", what, k, luaL_typename(L, -1));
  lua_pop(L, 1); /* the string stays alive: the table holds it */
  return s;
}

static lua_Integer opt_int(lua_State *L, int idx, const char *what, const char *k, lua_Integer dflt) {
  int t = lua_getfield(L, idx, k);
  lua_Integer v = dflt;
  if (t == LUA_TBOOLEAN) v = lua_toboolean(L, -1);
  else if (t != LUA_TNIL) {
    int ok;
    v = lua_tointegerx(L, -1, &ok);
    if (!ok) luaL_error(L, "bpe_new: %s.%s must be an integer, got %s", what, k, luaL_tolstring(L, -1, NULL));
  }
  lua_pop(L, 1);
  return v;
}

static const char *const NORMS[] = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Replace", "ReplaceRegex", "Prepend",
                                    "Strip", "StripAccents", NULL};
static const char *const PRES[] = {"SplitRegex", "SplitString", "SplitDigit", "SplitSpace", "SplitPunct",
                                   "PrefixSpace", "Bytes", "Metaspace", NULL};
static const char *const BEHAVIORS[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous", NULL};

static int option(lua_State *L, int idx, const char *what, const char *k, const char *const *names, const char *dflt) {
  size_t len;
  const char *s = opt_string(L, idx, what, k, &len);
  if (!s) s = dflt;
  if (!s) luaL_error(L, "bpe_new: %s.%s is missing", what, k);
  for (int i = 0; names[i]; i++)
    if (strcmp(names[i], s) == 0) return i;
  return luaL_error(L, "bpe_new: %s.%s: invalid option '%s'", what, k, s);
}

/* core.bpe_new(spec) -> an encoder: spec = {vocab = {[text] = id}, merges = {a1, b1, a2, b2, ...},
 * unk_id =, fuse_unk =, byte_fallback =, ignore_merges =, prefix =, suffix =, normalizers = {{kind =,
 * a =, c =, flag =}}, pre = {{kind =, a =, behavior =, invert =, flag =}}, added = {{content =, id =,
 * flags =}}} */
static int l_bpe_new(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  nvl_bpe **b = lua_newuserdatauv(L, sizeof *b, 0);
  *b = NULL;
  luaL_setmetatable(L, BPE_MT);
  CHECK(L, nvl_bpe_new(b));
  if (lua_getfield(L, 1, "vocab") != LUA_TTABLE) return luaL_error(L, "bpe_new: spec.vocab must be a table");
  lua_pushnil(L);
  while (lua_next(L, -2)) {
    int ok;
    lua_Integer id = lua_tointegerx(L, -1, &ok);
    if (lua_type(L, -2) != LUA_TSTRING || !ok || id < 0 || id > INT32_MAX)
      return luaL_error(L, "bpe_new: spec.vocab must map strings to integer ids in [0, 2^31)");
    size_t len;
    const char *s = lua_tolstring(L, -2, &len);
    CHECK(L, nvl_bpe_add_token(*b, s, len, (int32_t)id));
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  size_t len;
  const char *prefix = opt_string(L, 1, "spec", "prefix", &len), *suffix = opt_string(L, 1, "spec", "suffix", &len);
  CHECK(L, nvl_bpe_set_model(*b, (int32_t)opt_int(L, 1, "spec", "unk_id", -1), (int)opt_int(L, 1, "spec", "fuse_unk", 0),
                             (int)opt_int(L, 1, "spec", "byte_fallback", 0),
                             (int)opt_int(L, 1, "spec", "ignore_merges", 0), prefix, suffix));
  if (lua_getfield(L, 1, "merges") == LUA_TTABLE) {
    lua_Integer n = luaL_len(L, -1);
    for (lua_Integer i = 1; i + 1 <= n; i += 2) {
      size_t la, lc;
      lua_geti(L, -1, i);
      lua_geti(L, -2, i + 1);
      const char *a = lua_tolstring(L, -2, &la), *c = lua_tolstring(L, -1, &lc);
      if (!a || !c) return luaL_error(L, "bpe_new: spec.merges[%I] is not a pair of strings", (i + 1) / 2);
      CHECK(L, nvl_bpe_add_merge(*b, a, la, c, lc));
      lua_pop(L, 2);
    }
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 1, "normalizers") == LUA_TTABLE) {
    int t = lua_gettop(L);
    for (lua_Integer i = 1; lua_geti(L, t, i) == LUA_TTABLE; i++) {
      size_t la = 0, lc = 0;
      int kind = option(L, -1, "normalizer", "kind", NORMS, NULL);
      const char *a = opt_string(L, -1, "normalizer", "a", &la), *c = opt_string(L, -1, "normalizer", "c", &lc);
      CHECK(L, nvl_bpe_add_normalizer(*b, (nvl_bpe_norm)kind, a, la, c, lc, (int)opt_int(L, -1, "normalizer", "flag", 0)));
      lua_pop(L, 1);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 1, "pre") == LUA_TTABLE) {
    int t = lua_gettop(L);
    for (lua_Integer i = 1; lua_geti(L, t, i) == LUA_TTABLE; i++) {
      size_t la = 0;
      int kind = option(L, -1, "pre", "kind", PRES, NULL);
      int behavior = option(L, -1, "pre", "behavior", BEHAVIORS, "Isolated");
      const char *a = opt_string(L, -1, "pre", "a", &la);
      CHECK(L, nvl_bpe_add_pre(*b, (nvl_bpe_pre)kind, a, la, (nvl_bpe_behavior)behavior,
                               (int)opt_int(L, -1, "pre", "invert", 0), (int)opt_int(L, -1, "pre", "flag", 0)));
      lua_pop(L, 1);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 1, "added") == LUA_TTABLE) {
    int t = lua_gettop(L);
    for (lua_Integer i = 1; lua_geti(L, t, i) == LUA_TTABLE; i++) {
      size_t lc = 0;
      const char *c = opt_string(L, -1, "added", "content", &lc);
      if (!c) return luaL_error(L, "bpe_new: spec.added[%I].content is missing", i);
      lua_Integer id = opt_int(L, -1, "added", "id", -1);
      if (id < 0 || id > INT32_MAX) return luaL_error(L, "bpe_new: spec.added[%I].id must be in [0, 2^31)", i);
      CHECK(L, nvl_bpe_add_special(*b, c, lc, (int32_t)id, (int)opt_int(L, -1, "added", "flags", 0)));
      lua_pop(L, 1);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return 1;
}

/* enc:encode(text [, as_tensor]) -> a table of ids (0-based), or a 1-D i64 tensor.
 * The encoder's ids are copied out before anything is allocated in Lua: an allocation can run a
 * finalizer (__gc), and one that encodes with this encoder would overwrite them. */
static int l_bpe_encode(lua_State *L) {
  nvl_bpe **b = check_bpe(L, 1);
  size_t len;
  const char *s = luaL_checklstring(L, 2, &len);
  int as_tensor = lua_toboolean(L, 3);
  ids_box *box = lua_newuserdatauv(L, sizeof *box, 0);
  box->p = NULL;
  luaL_setmetatable(L, IDS_MT);
  const int32_t *out;
  size_t n;
  if (nvl_bpe_encode(*b, s, len, &out, &n) != NVL_OK) return nvl_lua_raise(L);
  box->p = malloc((n ? n : 1) * sizeof *box->p);
  if (!box->p) return luaL_error(L, "tokenizer: out of memory copying %zu ids", n);
  if (n) memcpy(box->p, out, n * sizeof *box->p);
  const int32_t *ids = box->p;
  if (as_tensor) {
    int64_t shape[1] = {(int64_t)n};
    nvl_tensor *t = nvl_lua_push_tensor(L);
    CHECK(L, nvl_tensor_empty(t, NVL_I64, NVL_CPU, 1, shape));
    int64_t *p = nvl_tensor_data(t);
    for (size_t i = 0; i < n; i++) p[i] = ids[i];
  } else {
    lua_createtable(L, (int)(n < INT32_MAX ? n : 0), 0);
    for (size_t i = 0; i < n; i++) {
      lua_pushinteger(L, ids[i]);
      lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
  }
  free(box->p); /* now, not at the next collection: a long text's copy is large */
  box->p = NULL;
  return 1;
}

/* enc:token_id(text) -> the vocabulary's id of text, or nil */
static int l_bpe_token_id(lua_State *L) {
  nvl_bpe **b = check_bpe(L, 1);
  size_t len;
  const char *s = luaL_checklstring(L, 2, &len);
  int32_t id = nvl_bpe_token_id(*b, s, len);
  if (id < 0) return 0;
  lua_pushinteger(L, id);
  return 1;
}

/* enc:work_bytes() -> the bytes of work space the encoder holds */
static int l_bpe_work_bytes(lua_State *L) {
  nvl_bpe **b = check_bpe(L, 1);
  lua_pushinteger(L, (lua_Integer)nvl_bpe_work_bytes(*b));
  return 1;
}

static int l_bpe_gc(lua_State *L) {
  nvl_bpe **b = luaL_checkudata(L, 1, BPE_MT);
  nvl_bpe_free(*b);
  *b = NULL;
  return 0;
}

static const luaL_Reg bpe_methods[] = {{"encode", l_bpe_encode}, {"token_id", l_bpe_token_id},
                                       {"work_bytes", l_bpe_work_bytes}, {NULL, NULL}};
static const luaL_Reg bpe_meta[] = {{"__gc", l_bpe_gc}, {"__close", l_bpe_gc}, {NULL, NULL}};
static const luaL_Reg module_funcs[] = {{"bpe_new", l_bpe_new}, {NULL, NULL}};

void nvl_lua_open_tokenizer(lua_State *L) {
  luaL_newmetatable(L, IDS_MT);
  lua_pushcfunction(L, ids_gc);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  luaL_newmetatable(L, BPE_MT);
  luaL_setfuncs(L, bpe_meta, 0);
  luaL_newlib(L, bpe_methods);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  luaL_setfuncs(L, module_funcs, 0);
}
