/* errors.c: errors for people. A user error is one the person running nvlua fixes from its message
 * alone: a bad option or config value, a missing or malformed file, a shape, size or format that
 * does not fit. It is raised as an ordinary string error (pcall, T.raises, string methods see
 * nothing new), but through these helpers, which first remember the message in the registry; the
 * program's message handler (main.c, msghandler) prints a remembered message as its one line,
 * without a stack traceback. Every other error — a Lua runtime error, an error() of a script, a
 * failed CUDA call, a freed tensor — keeps its traceback; NVLUA_TRACEBACK=1 gives one to all.
 * What is a user error:
 *   - core's failures with status NVL_EINVAL, NVL_EUNSUPPORTED, NVL_EIO and NVL_ENOMEM (nvl_lua_raise);
 *   - the options-table checks of the bindings (opts.c);
 *   - in Lua, what is raised with core.user_error (util.user_error, util.check_opts, nvlua.config,
 *     the option checks of the library's modules, its file readers).
 * The mark is the message's text: the last user error's string is kept (one registry slot) and a
 * message equal to it is a user error. An error caught and raised again unchanged (error(err, 0))
 * stays one; a message built from it ("from_pretrained: " .. err) is a new error, marked only when
 * it is raised through the helpers too.
 * A mistyped name gets the valid names closest to it ("did you mean 'steps'?", nvl_lua_push_did_you_mean).
 * Not here: printing (main.c). */
#include <ctype.h>
#include <lauxlib.h>
#include <lua.h>
#include <stdarg.h>
#include <string.h>
#include <strings.h>
#include "bind.h"

static const char USER_ERROR = 0; /* its address keys the registry slot */

void nvl_lua_mark_user_error(lua_State *L, int idx) {
  lua_pushvalue(L, idx);
  lua_rawsetp(L, LUA_REGISTRYINDEX, &USER_ERROR);
}

int nvl_lua_is_user_error(lua_State *L, int idx) {
  if (lua_type(L, idx) != LUA_TSTRING) return 0;
  idx = lua_absindex(L, idx);
  lua_rawgetp(L, LUA_REGISTRYINDEX, &USER_ERROR);
  int r = lua_rawequal(L, idx, -1);
  lua_pop(L, 1);
  return r;
}

int nvl_lua_user_error(lua_State *L, const char *fmt, ...) {
  va_list ap;
  luaL_where(L, 1);
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  lua_concat(L, 2);
  nvl_lua_mark_user_error(L, -1);
  return lua_error(L);
}

int nvl_lua_raise(lua_State *L) {
  switch (nvl_last_status()) {
    case NVL_EINVAL: case NVL_EUNSUPPORTED: case NVL_EIO: case NVL_ENOMEM:
      return nvl_lua_user_error(L, "%s", nvl_last_error());
    default:
      return luaL_error(L, "%s", nvl_last_error());
  }
}

/* core.user_error(msg [, level = 1]): error(msg, level) for a string msg (the position of level
 * prepended as error() does), marked as a user error. */
static int l_user_error(lua_State *L) {
  luaL_checktype(L, 1, LUA_TSTRING);
  int level = (int)luaL_optinteger(L, 2, 1);
  lua_settop(L, 1);
  if (level > 0) {
    luaL_where(L, level);
    lua_insert(L, 1);
    lua_concat(L, 2);
  }
  nvl_lua_mark_user_error(L, 1);
  return lua_error(L);
}

/* core.is_user_error(v) -> true when v is the message of the last user error */
static int l_is_user_error(lua_State *L) {
  lua_pushboolean(L, nvl_lua_is_user_error(L, 1));
  return 1;
}

/* ---- "did you mean": the valid names closest to a mistyped one ---------------------------- */

#define NAME_MAX_LEN 64 /* longer names are never close: the distance table stays on the stack */
#define SUGGEST_MAX 3   /* names offered at most */

/* The optimal-string-alignment distance of a and b (an insertion, a deletion, a substitution or a
 * swap of two neighbours costs 1; ASCII case ignored), or limit + 1 when it exceeds limit. */
static int name_distance(const char *a, const char *b, int limit) {
  size_t n = strlen(a), m = strlen(b);
  int d[NAME_MAX_LEN + 1][NAME_MAX_LEN + 1];
  if (n > NAME_MAX_LEN || m > NAME_MAX_LEN || (n > m ? n - m : m - n) > (size_t)limit) return limit + 1;
  for (size_t i = 0; i <= n; i++) d[i][0] = (int)i;
  for (size_t j = 0; j <= m; j++) d[0][j] = (int)j;
  for (size_t i = 1; i <= n; i++) {
    for (size_t j = 1; j <= m; j++) {
      int ai = tolower((unsigned char)a[i - 1]), bj = tolower((unsigned char)b[j - 1]);
      int v = d[i - 1][j - 1] + (ai != bj);
      if (d[i - 1][j] + 1 < v) v = d[i - 1][j] + 1;
      if (d[i][j - 1] + 1 < v) v = d[i][j - 1] + 1;
      if (i > 1 && j > 1 && ai == tolower((unsigned char)b[j - 2]) && tolower((unsigned char)a[i - 2]) == bj &&
          d[i - 2][j - 2] + 1 < v)
        v = d[i - 2][j - 2] + 1;
      d[i][j] = v;
    }
  }
  return d[n][m] > limit ? limit + 1 : d[n][m];
}

/* How close name is to word, lower is closer, -1 when it is not close: 2 x their distance when at
 * most 2 (at most 1 for a word of 3 bytes or fewer, where 2 would match most short names), and 3
 * when word (3 bytes or more) begins name: an abbreviation ("sched") ranks between one typo and two. */
static int closeness(const char *word, const char *name) {
  size_t n = strlen(word);
  int limit = n <= 3 ? 1 : 2;
  int d = name_distance(word, name, limit);
  if (n >= 3 && d > 1 && strncasecmp(name, word, n) == 0) return 3;
  return d <= limit ? 2 * d : -1;
}

int nvl_lua_push_did_you_mean(lua_State *L, const char *word, const char *const *names, int n) {
  int best = -1, shown = 0;
  luaL_Buffer b;
  for (int i = 0; i < n; i++) {
    int c = closeness(word, names[i]);
    if (c >= 0 && (best < 0 || c < best)) best = c;
  }
  if (best < 0) return 0;
  int count = 0;
  for (int i = 0; i < n; i++) count += closeness(word, names[i]) == best;
  if (count > SUGGEST_MAX) count = SUGGEST_MAX;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, "did you mean ");
  for (int i = 0; i < n && shown < count; i++) {
    if (closeness(word, names[i]) != best) continue;
    if (shown > 0) luaL_addstring(&b, shown == count - 1 ? " or " : ", ");
    luaL_addchar(&b, '\'');
    luaL_addstring(&b, names[i]);
    luaL_addchar(&b, '\'');
    shown++;
  }
  luaL_addchar(&b, '?');
  luaL_pushresult(&b);
  return 1;
}

/* core.did_you_mean(word, names) -> "did you mean 'x'?" naming the strings of the list names closest
 * to word (edit distance at most 2, or word their beginning; nvl_lua_push_did_you_mean), or nil
 * when none is close */
static int l_did_you_mean(lua_State *L) {
  const char *word = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_Integer len = luaL_len(L, 2);
  const char **names = lua_newuserdatauv(L, (size_t)(len > 0 ? len : 1) * sizeof *names, 0);
  int n = 0;
  for (lua_Integer i = 1; i <= len; i++) {
    if (lua_rawgeti(L, 2, i) == LUA_TSTRING) names[n++] = lua_tostring(L, -1); /* kept alive by the list */
    lua_pop(L, 1);
  }
  if (!nvl_lua_push_did_you_mean(L, word, names, n)) lua_pushnil(L);
  return 1;
}

static const luaL_Reg error_funcs[] = {
    {"user_error", l_user_error}, {"is_user_error", l_is_user_error}, {"did_you_mean", l_did_you_mean}, {NULL, NULL}};

void nvl_lua_open_errors(lua_State *L) { luaL_setfuncs(L, error_funcs, 0); }
