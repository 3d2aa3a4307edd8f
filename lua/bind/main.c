/* main.c: the nvlua program, a Lua 5.4 stand-alone interpreter with the nvlua core built in.
 *
 * Command line and behaviour follow Lua 5.4's own `lua` (lua.c), so nvlua can stand wherever lua
 * stands: `nvlua [options] [script [args]]` with -e -l -i -v -E -W -- -, the global `arg` table,
 * LUA_INIT, scripts run under a protected call with a traceback handler, exit status 1 on error,
 * Ctrl-C raising "interrupted!" in running Lua code. What nvlua adds:
 *   - `lfs`, `cjson` and `nvlua.core` are preloaded, so they need no module path;
 *   - package.path starts with the nvlua Lua library (next to the binary, installed, or in the
 *     source tree) and, unless -E, with $NVLUA_PATH;
 *   - -v also reports the nvlua version, BLAS and CUDA;
 *   - the REPL defines `nv` and `help` first, has readline editing, history
 *     (~/.nvlua_history) and completion of Lua names, survives Ctrl-C at the prompt, and, when
 *     stdin is not a terminal, still reads statements but prints only their results (no banner,
 *     no prompts), so `printf '1+1\n' | nvlua` prints 2.
 * Not here: any tensor code (lua/bind/ bindings, core/). Nothing here calls exit(); main returns
 * the status (os.exit still ends the process with its own status).
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "lfs.h"
#include "lua-cjson.h"

#include "bind.h"
#include "dist.h"
#include "nvl_cuda.h"
#include "info.h"

#ifdef NVLUA_USE_READLINE
#include <readline/history.h>
#include <readline/readline.h>
#endif

#ifndef NVLUA_VERSION
#define NVLUA_VERSION "unknown"
#endif
#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

#define NVL_PROGNAME "nvlua"
#define NVL_HISTORY_FILE ".nvlua_history"
#define NVL_HISTORY_MAX 1000
#define NVL_BANNER \
  "nvlua " NVLUA_VERSION " (Lua " LUA_VERSION_MAJOR "." LUA_VERSION_MINOR \
  ") \xe2\x80\x94 type help() for the API, Ctrl-D to exit"

/* Prefix of error messages; NULL in the REPL, as in lua.c. */
static const char *progname = NVL_PROGNAME;

/* ---- messages --------------------------------------------------------------------------- */

static void l_message(const char *pname, const char *msg) {
  fflush(stdout); /* keep stdout and stderr in order when both go to one pipe */
  if (pname) fprintf(stderr, "%s: ", pname);
  fprintf(stderr, "%s\n", msg);
  fflush(stderr);
}

/* Prints and pops the error message on top of the stack when status is not LUA_OK. */
static int report(lua_State *L, int status) {
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    l_message(progname, msg ? msg : "(error object is not a string)");
    lua_pop(L, 1);
  }
  return status;
}

static void print_usage(const char *badoption) {
  fprintf(stderr, "%s: ", NVL_PROGNAME);
  if (badoption[1] == 'e' || badoption[1] == 'l')
    fprintf(stderr, "'%s' needs argument\n", badoption);
  else
    fprintf(stderr, "unrecognized option '%s'\n", badoption);
  fprintf(stderr,
          "usage: %s [options] [script [args]]\n"
          "Available options are:\n"
          "  -e stat   execute string 'stat'\n"
          "  -i        enter interactive mode after executing 'script'\n"
          "  -l mod    require library 'mod' into global 'mod'\n"
          "  -l g=mod  require library 'mod' into global 'g'\n"
          "  -v        show version information (Lua, nvlua, BLAS, CUDA, GPUs)\n"
          "  -E        ignore environment variables\n"
          "  -W        turn warnings on\n"
          "  --        stop handling options\n"
          "  -         stop handling options and execute stdin\n",
          NVL_PROGNAME);
  fflush(stderr);
}

static void print_version(void) {
  const char *blas = nvl_blas_info();
  int ndev;
  printf("%s\n", LUA_COPYRIGHT);
  printf("nvlua %s\n", NVLUA_VERSION);
  printf("BLAS: %s\n", blas ? blas : "unknown");
  if (nvl_cuda_compiled()) {
    int rt = nvl_cuda_runtime_version(); /* 1000 * major + 10 * minor */
    printf("CUDA: compiled in (runtime %d.%d, cuBLASLt %zu)\n", rt / 1000, (rt % 1000) / 10,
           nvl_cuda_blaslt_version());
  } else {
    printf("CUDA: not compiled in\n");
  }
  ndev = nvl_cuda_device_count();
  if (ndev <= 0) {
    const char *why = nvl_cuda_unavailable_reason();
    printf("GPUs: none (%s)\n", why && why[0] ? why : "no device");
  }
  for (int i = 0; i < ndev; i++) {
    nvl_cuda_props p;
    memset(&p, 0, sizeof p);
    if (nvl_cuda_device_props(i, &p) != NVL_OK)
      printf("GPU %d: properties unavailable (%s)\n", i, nvl_last_error());
    else
      printf("GPU %d: %s, %.1f GiB, compute capability %d.%d, %d SMs\n", i, p.name,
             (double)p.total_mem / (1024.0 * 1024.0 * 1024.0), p.major, p.minor,
             p.multiprocessors);
  }
  fflush(stdout);
}

/* ---- Ctrl-C ------------------------------------------------------------------------------ */

/* The state whose running code a Ctrl-C interrupts. */
static lua_State *globalL;
/* What SIGINT does while no Lua code runs: default (end the process), or, at an interactive
 * prompt, only set prompt_interrupted. */
static void (*idle_sigint)(int) = SIG_DFL;
static volatile sig_atomic_t prompt_interrupted;
/* Deferred mode (nvlua.signal.defer(true), used by the training loop): a first Ctrl-C only sets
 * interrupt_pending, which the loop polls between steps to checkpoint and stop cleanly; a second
 * one interrupts as usual. */
static volatile sig_atomic_t defer_interrupts, interrupt_pending;

static void set_sigint(void (*handler)(int)) {
  struct sigaction sa;
  sa.sa_handler = handler;
  sa.sa_flags = 0; /* no SA_RESTART: a blocked read returns EINTR */
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
}

/* Hook set by laction: the next Lua instruction raises the error. */
static void lstop(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  luaL_error(L, "interrupted!");
}

/* SIGINT while Lua code runs. A second Ctrl-C before the hook fires (code stuck in C) takes the
 * default action and ends the process. lua_sethook is safe to call from a signal handler. */
static void laction(int sig) {
  int mask = LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT;
  (void)sig;
  if (defer_interrupts && !interrupt_pending) {
    interrupt_pending = 1;
    return;
  }
  set_sigint(SIG_DFL);
  lua_sethook(globalL, lstop, mask, 1);
}

static void prompt_sigint(int sig) {
  (void)sig;
  prompt_interrupted = 1;
}

/* nvlua.signal.defer(on): defer Ctrl-C to polling (see defer_interrupts). */
static int l_signal_defer(lua_State *L) {
  defer_interrupts = lua_toboolean(L, 1);
  if (!defer_interrupts) interrupt_pending = 0;
  return 0;
}

/* nvlua.signal.pending() -> true once a deferred Ctrl-C came (the flag stays set). */
static int l_signal_pending(lua_State *L) {
  lua_pushboolean(L, interrupt_pending);
  return 1;
}

/* nvlua.signal.raise(): deliver SIGINT to this process (for tests of the deferred path). */
static int l_signal_raise(lua_State *L) {
  (void)L;
  raise(SIGINT);
  return 0;
}

static int luaopen_nvlua_signal(lua_State *L) {
  static const luaL_Reg f[] = {{"defer", l_signal_defer}, {"pending", l_signal_pending}, {"raise", l_signal_raise},
                               {NULL, NULL}};
  luaL_newlib(L, f);
  return 1;
}

/* ---- running code ------------------------------------------------------------------------ */

/* Message handler: adds a traceback to the error message. */
static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* Calls the function below narg arguments in protected mode, with Ctrl-C armed and, when
 * traceback is set, a traceback added to an error message. */
static int docall_ex(lua_State *L, int narg, int nres, int traceback) {
  int status;
  int base = lua_gettop(L) - narg; /* function index */
  if (traceback) {
    lua_pushcfunction(L, msghandler);
    lua_insert(L, base);
  }
  globalL = L;
  set_sigint(laction);
  status = lua_pcall(L, narg, nres, traceback ? base : 0);
  set_sigint(idle_sigint);
  if (lua_gethook(L) == lstop) lua_sethook(L, NULL, 0, 0); /* a Ctrl-C that came too late */
  if (traceback) lua_remove(L, base);
  return status;
}

static int docall(lua_State *L, int narg, int nres) { return docall_ex(L, narg, nres, 1); }

static int dochunk(lua_State *L, int status) {
  if (status == LUA_OK) status = docall(L, 0, 0);
  return report(L, status);
}

static int dofile(lua_State *L, const char *name) { return dochunk(L, luaL_loadfile(L, name)); }

static int dostring(lua_State *L, const char *s, const char *name) {
  return dochunk(L, luaL_loadbuffer(L, s, strlen(s), name));
}

/* -l spec: `mod` sets global mod (up to a '-' suffix, as lua.c), `g=mod` sets global g. */
static int dolibrary(lua_State *L, const char *spec) {
  int status;
  const char *eq = strchr(spec, '=');
  const char *modname = eq ? eq + 1 : spec;
  size_t globlen = eq ? (size_t)(eq - spec) : strlen(spec);
  if (!eq) {
    const char *mark = strchr(spec, '-');
    if (mark) globlen = (size_t)(mark - spec);
  }
  lua_getglobal(L, "require");
  lua_pushstring(L, modname);
  status = docall(L, 1, 1);
  if (status == LUA_OK) {
    lua_pushglobaltable(L);
    lua_pushlstring(L, spec, globlen);
    lua_pushvalue(L, -3);
    lua_settable(L, -3); /* _G[globname] = require(modname) */
    lua_pop(L, 2);
  }
  return report(L, status);
}

/* Pushes arg[1..#arg] for the main script; returns how many. */
static int push_args(lua_State *L) {
  int n;
  if (lua_getglobal(L, "arg") != LUA_TTABLE) luaL_error(L, "'arg' is not a table");
  n = (int)luaL_len(L, -1);
  luaL_checkstack(L, n + 3, "too many arguments to script");
  for (int i = 1; i <= n; i++) lua_rawgeti(L, -i, i);
  lua_remove(L, -n - 1);
  return n;
}

/* argv points at the script name; "-" (unless after "--") is stdin. */
static int handle_script(lua_State *L, char **argv) {
  int status;
  const char *fname = argv[0];
  if (strcmp(fname, "-") == 0 && strcmp(argv[-1], "--") != 0) fname = NULL;
  status = luaL_loadfile(L, fname);
  if (status == LUA_OK) status = docall(L, push_args(L), LUA_MULTRET);
  return report(L, status);
}

static int handle_luainit(lua_State *L) {
  const char *name = "=LUA_INIT_" LUA_VERSION_MAJOR "_" LUA_VERSION_MINOR;
  const char *init = getenv(name + 1);
  if (init == NULL) {
    name = "=LUA_INIT";
    init = getenv(name + 1);
  }
  if (init == NULL) return LUA_OK;
  if (init[0] == '@') return dofile(L, init + 1);
  return dostring(L, init, name);
}

/* ---- command line ------------------------------------------------------------------------ */

enum { OPT_ERROR = 1, OPT_I = 2, OPT_V = 4, OPT_EXEC = 8, OPT_NOENV = 16 };

/* Scans the options as lua.c does. Returns OPT_* flags; *script is the index of the script name
 * (0 when there is none) or, with OPT_ERROR, of the bad option. */
static int collect_args(char **argv, int argc, int *script) {
  int flags = 0;
  *script = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] != '-') { /* not an option: the script */
      *script = i;
      return flags;
    }
    switch (a[1]) {
      case '-': /* "--": the next argument, if any, is the script */
        if (a[2] != '\0') goto bad;
        *script = (i + 1 < argc) ? i + 1 : 0;
        return flags;
      case '\0': /* "-": the script is stdin */
        *script = i;
        return flags;
      case 'E': case 'W': case 'i': case 'v':
        if (a[2] != '\0') goto bad;
        flags |= a[1] == 'E' ? OPT_NOENV : a[1] == 'i' ? OPT_I : a[1] == 'v' ? OPT_V : 0;
        break;
      case 'e': case 'l':
        if (a[1] == 'e') flags |= OPT_EXEC;
        if (a[2] == '\0') { /* the argument is the next word, which must not be an option */
          if (i + 1 >= argc || argv[i + 1][0] == '-') goto bad;
          i++;
        }
        break;
      default:
        goto bad;
    }
    continue;
  bad:
    *script = i;
    return OPT_ERROR;
  }
  return flags;
}

/* arg[0] = script, arg[1..] = its arguments, arg[-1..] = options and the interpreter. With no
 * script, arg[0] is the interpreter and every option is positive (as lua.c does). */
static void create_arg_table(lua_State *L, char **argv, int argc, int script) {
  int narg = argc - (script + 1);
  lua_createtable(L, narg > 0 ? narg : 0, script + 1);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script);
  }
  lua_setglobal(L, "arg");
}

/* Runs -e, -l and -W in order; argv[1..n-1] are options already checked. */
static int run_args(lua_State *L, char **argv, int n) {
  for (int i = 1; i < n; i++) {
    int opt = argv[i][1];
    if (opt == 'e' || opt == 'l') {
      const char *extra = argv[i] + 2;
      int status;
      if (*extra == '\0') extra = argv[++i];
      status = opt == 'e' ? dostring(L, extra, "=(command line)") : dolibrary(L, extra);
      if (status != LUA_OK) return 0;
    } else if (opt == 'W') {
      lua_warning(L, "@on", 0);
    }
  }
  return 1;
}

/* ---- modules and paths ------------------------------------------------------------------- */

static void preload_modules(lua_State *L) {
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
  lua_pushcfunction(L, luaopen_lfs);
  lua_setfield(L, -2, "lfs");
  lua_pushcfunction(L, luaopen_cjson);
  lua_setfield(L, -2, "cjson");
  lua_pushcfunction(L, luaopen_nvlua_signal);
  lua_setfield(L, -2, "nvlua.signal");
  lua_pushcfunction(L, luaopen_nvlua_core);
  lua_setfield(L, -2, "nvlua.core");
  lua_pop(L, 1);
}

/* Pushes the first directory holding nvlua/init.lua among: <exe dir>/../lua (the source tree
 * or a build), <exe dir>/../share/nvlua/lua (an install), the configured install and source
 * directories. Returns 0 (pushing nothing) if there is none. */
static int push_lua_dir(lua_State *L) {
  char exe[PATH_MAX];
  int top = lua_gettop(L);
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len > 0) {
    char *slash;
    exe[len] = '\0';
    slash = strrchr(exe, '/');
    if (slash) {
      *slash = '\0';
      lua_pushfstring(L, "%s/../lua", exe);
      lua_pushfstring(L, "%s/../share/nvlua/lua", exe);
    }
  }
#ifdef NVLUA_INSTALL_LUA_DIR
  lua_pushstring(L, NVLUA_INSTALL_LUA_DIR);
#endif
#ifdef NVLUA_SOURCE_LUA_DIR
  lua_pushstring(L, NVLUA_SOURCE_LUA_DIR);
#endif
  for (int i = top + 1; i <= lua_gettop(L); i++) {
    const char *dir = lua_tostring(L, i);
    int found = access(lua_pushfstring(L, "%s/nvlua/init.lua", dir), R_OK) == 0;
    lua_pop(L, 1);
    if (found) {
      char real[PATH_MAX];
      if (realpath(dir, real)) lua_pushstring(L, real);
      else lua_pushvalue(L, i);
      lua_replace(L, top + 1);
      lua_settop(L, top + 1);
      return 1;
    }
  }
  lua_settop(L, top);
  return 0;
}

/* package.path = [$NVLUA_PATH;] [<lua dir>/?.lua;<lua dir>/?/init.lua;] <Lua's path>. A ";;" in
 * NVLUA_PATH stands for the rest, as in LUA_PATH. */
static void setup_path(lua_State *L, int noenv) {
  const char *env = noenv ? NULL : getenv("NVLUA_PATH");
  if (lua_getglobal(L, "package") != LUA_TTABLE) {
    lua_pop(L, 1);
    return;
  }
  lua_getfield(L, -1, "path");
  if (!lua_isstring(L, -1)) {
    lua_pop(L, 1);
    lua_pushliteral(L, "");
  }
  if (push_lua_dir(L)) {
    const char *dir = lua_tostring(L, -1);
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, lua_tostring(L, -2));
    lua_replace(L, -3);
    lua_pop(L, 1);
  }
  if (env && env[0]) {
    const char *rest = lua_tostring(L, -1);
    const char *mark = strstr(env, ";;");
    if (mark) {
      luaL_Buffer b;
      luaL_buffinit(L, &b);
      if (mark > env) {
        luaL_addlstring(&b, env, (size_t)(mark - env));
        luaL_addchar(&b, ';');
      }
      luaL_addstring(&b, rest);
      if (mark[2] != '\0') {
        luaL_addchar(&b, ';');
        luaL_addstring(&b, mark + 2);
      }
      luaL_pushresult(&b);
    } else {
      size_t n = strlen(env);
      while (n > 0 && env[n - 1] == ';') n--;
      lua_pushlstring(L, env, n);
      lua_pushliteral(L, ";");
      lua_pushvalue(L, -3);
      lua_concat(L, 3);
    }
    lua_replace(L, -2);
  }
  lua_setfield(L, -2, "path");
  lua_pop(L, 1);
}

/* ---- REPL input -------------------------------------------------------------------------- */

typedef enum { LINE_OK, LINE_EOF, LINE_INTR } line_status;

#define REPL_INTERRUPTED (-2) /* a statement abandoned with Ctrl-C at a prompt */

/* Prompts, banner and Ctrl-C at the prompt: only when stdin is a terminal. */
static int repl_interactive;

/* One line from stdin into a malloc'd *out, newline removed; prompt is printed when not NULL. */
static line_status read_plain(const char *prompt, char **out) {
  char *buf = NULL;
  size_t cap = 0;
  ssize_t n;
  if (prompt) {
    fputs(prompt, stdout);
    fflush(stdout);
  }
  prompt_interrupted = 0;
  n = getline(&buf, &cap, stdin);
  if (n < 0) {
    free(buf);
    if (prompt_interrupted) {
      clearerr(stdin);
      fputc('\n', stdout);
      return LINE_INTR;
    }
    return LINE_EOF;
  }
  if (n > 0 && buf[n - 1] == '\n') buf[n - 1] = '\0';
  *out = buf;
  return LINE_OK;
}

#ifdef NVLUA_USE_READLINE
static int use_readline;
static char history_path[PATH_MAX];
static int history_added; /* entries added this session, for append_history */

static char *rl_line;
static int rl_got_line;

static void rl_on_line(char *line) {
  rl_line = line;
  rl_got_line = 1;
  rl_callback_handler_remove();
}

/* readline through its callback interface, so that Ctrl-C at the prompt abandons the line
 * instead of ending the process: SIGINT is unblocked only inside pselect. */
static line_status read_readline(const char *prompt, char **out) {
  sigset_t block, orig;
  line_status st = LINE_OK;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigprocmask(SIG_BLOCK, &block, &orig);
  prompt_interrupted = 0;
  rl_got_line = 0;
  rl_line = NULL;
  rl_callback_handler_install(prompt, rl_on_line);
  while (!rl_got_line) {
    int fd = fileno(rl_instream ? rl_instream : stdin);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(fd, &fds);
    if (pselect(fd + 1, &fds, NULL, NULL, NULL, &orig) < 0) {
      if (errno != EINTR) {
        rl_callback_handler_remove();
        st = LINE_EOF;
        break;
      }
      if (prompt_interrupted) {
        rl_free_line_state();
#if RL_READLINE_VERSION >= 0x0700
        rl_callback_sigcleanup();
#endif
        rl_cleanup_after_signal();
        rl_callback_handler_remove();
        fputc('\n', stdout);
        fflush(stdout);
        st = LINE_INTR;
        break;
      }
#if RL_READLINE_VERSION >= 0x0801
      rl_check_signals(); /* e.g. a window resize */
#endif
      continue;
    }
    rl_callback_read_char();
  }
  sigprocmask(SIG_SETMASK, &orig, NULL);
  if (st == LINE_OK) {
    if (rl_line == NULL) return LINE_EOF;
    *out = rl_line;
  }
  return st;
}

static void history_save(void) {
  if (!history_path[0] || history_added == 0) return;
  if (access(history_path, F_OK) != 0) {
    write_history(history_path);
  } else {
    append_history(history_added < history_length ? history_added : history_length,
                   history_path);
    history_truncate_file(history_path, NVL_HISTORY_MAX);
  }
  history_added = 0;
}

/* ---- completion of Lua names (a.b.c, a:m) ---- */

static lua_State *complete_L;
static char **complete_list;
static size_t complete_n, complete_next;

static const char *const lua_keywords[] = {
    "and",   "break", "do",   "else", "elseif", "end",   "false", "for",   "function", "goto",
    "if",    "in",    "local", "nil", "not",    "or",    "repeat", "return", "then",    "true",
    "until", "while", NULL};

/* Replaces the value on top with the table its methods come from, read raw (no metamethod is
 * called): its metatable's __index when that is a table, else the metatable's __methods table
 * (nvlua's userdata types, whose __index is a function). Returns 0, leaving the value, when there
 * is none. */
static int complete_index_table(lua_State *L) {
  if (!lua_getmetatable(L, -1)) return 0;
  lua_pushliteral(L, "__index");
  lua_rawget(L, -2);
  if (!lua_istable(L, -1)) {
    lua_pop(L, 1);
    lua_pushliteral(L, "__methods");
    lua_rawget(L, -2);
    if (!lua_istable(L, -1)) {
      lua_pop(L, 2);
      return 0;
    }
  }
  lua_remove(L, -2);
  lua_remove(L, -2);
  return 1;
}

/* Replaces the value on top with its field key, as indexing would find it through tables and
 * __index tables, calling nothing; nil if not found. */
static void complete_field(lua_State *L, const char *key) {
  for (int depth = 0; depth < 16; depth++) {
    if (lua_istable(L, -1)) {
      lua_pushstring(L, key);
      if (lua_rawget(L, -2) != LUA_TNIL) {
        lua_remove(L, -2);
        return;
      }
      lua_pop(L, 1);
    }
    if (!complete_index_table(L)) break;
  }
  lua_pop(L, 1);
  lua_pushnil(L);
}

static int is_identifier(const char *s) {
  if (!(s[0] == '_' || isalpha((unsigned char)s[0]))) return 0;
  for (; *s; s++)
    if (!(*s == '_' || isalnum((unsigned char)*s))) return 0;
  return 1;
}

/* lua_CFunction(text): a table whose keys are the completions of text. */
static int complete_lua(lua_State *L) {
  const char *text = luaL_checkstring(L, 1);
  const char *dot = strrchr(text, '.'), *colon = strrchr(text, ':');
  const char *sep = dot > colon ? dot : colon;
  const char *partial = sep ? sep + 1 : text;
  size_t plen = strlen(partial);
  int methods = sep != NULL && *sep == ':';
  lua_newtable(L); /* 2: the completions */
  lua_pushglobaltable(L);
  for (const char *p = text; sep && p < sep;) { /* walk a.b.c up to the last separator */
    const char *q = p;
    while (q < sep && *q != '.' && *q != ':') q++;
    if (q < sep && *q == ':') return 1; /* ':' only before the last name */
    lua_pushlstring(L, p, (size_t)(q - p));
    lua_insert(L, -2);
    complete_field(L, lua_tostring(L, -2));
    lua_remove(L, -2);
    p = q + 1;
  }
  for (int depth = 0; depth < 16; depth++) {
    if (lua_istable(L, -1)) {
      lua_pushnil(L);
      while (lua_next(L, -2)) {
        if (lua_type(L, -2) == LUA_TSTRING) {
          const char *key = lua_tostring(L, -2);
          int isfn = lua_isfunction(L, -1);
          if (strncmp(key, partial, plen) == 0 && is_identifier(key) && (!methods || isfn)) {
            lua_pushlstring(L, text, (size_t)(partial - text));
            lua_pushstring(L, key);
            lua_pushstring(L, isfn ? "(" : "");
            lua_concat(L, 3);
            lua_pushboolean(L, 1);
            lua_rawset(L, 2);
          }
        }
        lua_pop(L, 1);
      }
    }
    if (!complete_index_table(L)) break;
  }
  if (!sep) {
    for (int i = 0; lua_keywords[i]; i++) {
      if (strncmp(lua_keywords[i], partial, plen) == 0) {
        lua_pushboolean(L, 1);
        lua_setfield(L, 2, lua_keywords[i]);
      }
    }
  }
  lua_settop(L, 2);
  return 1;
}

static void complete_clear(void) {
  for (size_t i = complete_next; i < complete_n; i++) free(complete_list[i]);
  free(complete_list);
  complete_list = NULL;
  complete_n = complete_next = 0;
}

static char *complete_generator(const char *text, int state) {
  if (state == 0) {
    lua_State *L = complete_L;
    int top = lua_gettop(L);
    complete_clear();
    lua_pushcfunction(L, complete_lua);
    lua_pushstring(L, text);
    if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_istable(L, -1)) {
      size_t cap = 0;
      lua_pushnil(L);
      while (lua_next(L, -2)) {
        lua_pop(L, 1);
        if (complete_n == cap) {
          size_t ncap = cap ? 2 * cap : 32;
          char **grown = realloc(complete_list, ncap * sizeof *grown);
          if (!grown) {
            lua_pop(L, 1);
            break;
          }
          complete_list = grown;
          cap = ncap;
        }
        complete_list[complete_n] = strdup(lua_tostring(L, -1));
        if (complete_list[complete_n]) complete_n++;
      }
    }
    lua_settop(L, top);
  }
  if (complete_next < complete_n) return complete_list[complete_next++]; /* readline frees it */
  return NULL;
}

/* Whether line[index] is inside a string literal, so that readline does not split a file name
 * at its '/' (all of a string is one word, completed as a file name). */
static int complete_in_string(char *line, int index) {
  char quote = 0;
  for (int i = 0; i < index && line[i]; i++) {
    if (quote) {
      if (line[i] == '\\') i++;
      else if (line[i] == quote) quote = 0;
    } else if (line[i] == '"' || line[i] == '\'') {
      quote = line[i];
    }
  }
  return quote != 0;
}

static char **complete_attempt(const char *text, int start, int end) {
  (void)start;
  (void)end;
  if (rl_completion_quote_character) return NULL; /* inside a string: file names */
  rl_attempted_completion_over = 1;
  rl_completion_append_character = '\0';
  return rl_completion_matches(text, complete_generator);
}

static void readline_start(lua_State *L) {
  const char *home = getenv("HOME");
  use_readline = 1;
  complete_L = L;
  rl_readline_name = "nvlua";
  rl_catch_signals = 0; /* SIGINT is ours (read_readline) */
  rl_attempted_completion_function = complete_attempt;
  rl_basic_word_break_characters = " \t\n\"'\\><=;+-*/%^~#&|{}()[],";
  rl_completer_quote_characters = "\"'";
  rl_char_is_quoted_p = complete_in_string;
  /* Timestamps ("#<seconds>" lines) delimit entries in the file, so that a statement of several
   * lines comes back as one entry. */
  history_comment_char = '#';
  history_write_timestamps = 1;
  history_multiline_entries = 1;
  if (home && home[0] &&
      (size_t)snprintf(history_path, sizeof history_path, "%s/" NVL_HISTORY_FILE, home) <
          sizeof history_path) {
    read_history(history_path); /* a missing or unreadable file is not an error */
    static int registered;
    if (!registered && atexit(history_save) == 0) registered = 1; /* os.exit() saves too */
  } else {
    history_path[0] = '\0';
  }
  stifle_history(NVL_HISTORY_MAX);
}

static void readline_stop(void) {
  history_save();
  complete_clear();
  use_readline = 0;
}
#endif /* NVLUA_USE_READLINE */

/* Adds a statement (possibly several lines) to the history. */
static void save_line(const char *line) {
#ifdef NVLUA_USE_READLINE
  if (!use_readline || line[0] == '\0') return;
  if (history_length > 0) {
    HIST_ENTRY *last = history_get(history_base + history_length - 1);
    if (last && strcmp(last->line, line) == 0) return;
  }
  add_history(line);
  history_added++;
#else
  (void)line;
#endif
}

/* Reads a line, with the first or continuation prompt (_PROMPT / _PROMPT2 when set). */
static line_status read_line(lua_State *L, int firstline, char **out) {
  const char *prompt;
  line_status st;
  *out = NULL;
  if (!repl_interactive) return read_plain(NULL, out);
  lua_getglobal(L, firstline ? "_PROMPT" : "_PROMPT2");
  prompt = lua_type(L, -1) == LUA_TSTRING || lua_type(L, -1) == LUA_TNUMBER
               ? lua_tostring(L, -1)
               : (firstline ? "> " : ">> ");
#ifdef NVLUA_USE_READLINE
  st = use_readline ? read_readline(prompt, out) : read_plain(prompt, out);
#else
  st = read_plain(prompt, out);
#endif
  lua_pop(L, 1);
  return st;
}

/* Compiles "return <line>;" so that an expression prints its values. Stack: [line] -> [line,
 * function] on success, unchanged otherwise. */
static int add_return(lua_State *L) {
  const char *line = lua_tostring(L, -1);
  const char *retline = lua_pushfstring(L, "return %s;", line);
  int status = luaL_loadbuffer(L, retline, strlen(retline), "=stdin");
  if (status == LUA_OK) {
    lua_remove(L, -2);
    save_line(line);
  } else {
    lua_pop(L, 2);
  }
  return status;
}

/* A syntax error at <eof>: the statement goes on in the next line. */
static int incomplete(lua_State *L, int status) {
  static const char mark[] = "<eof>";
  size_t len;
  const char *msg;
  if (status != LUA_ERRSYNTAX) return 0;
  msg = lua_tolstring(L, -1, &len);
  return msg && len >= sizeof mark - 1 && strcmp(msg + len - (sizeof mark - 1), mark) == 0;
}

/* Compiles the statement at index 1, reading continuation lines while it is incomplete. Stack:
 * [text] -> [text, function or message]. */
static int multi_line(lua_State *L) {
  for (;;) {
    size_t len;
    const char *text = lua_tolstring(L, 1, &len);
    int status = luaL_loadbuffer(L, text, len, "=stdin");
    char *line;
    line_status st;
    if (!incomplete(L, status)) {
      save_line(text);
      return status;
    }
    st = read_line(L, 0, &line);
    if (st == LINE_INTR) return REPL_INTERRUPTED;
    if (st == LINE_EOF) { /* report the syntax error */
      save_line(text);
      return status;
    }
    lua_pop(L, 1); /* the message */
    lua_pushliteral(L, "\n");
    lua_pushstring(L, line);
    free(line);
    lua_concat(L, 3);
  }
}

/* Reads and compiles one statement: LUA_OK with the function on the stack, an error status with
 * the message on the stack, or -1 at the end of input. */
static int load_line(lua_State *L) {
  for (;;) {
    char *line;
    int status;
    line_status st;
    lua_settop(L, 0);
    st = read_line(L, 1, &line);
    if (st == LINE_EOF) return -1;
    if (st == LINE_INTR) continue;
    if (line[0] == '=') /* "=expr" of Lua 5.1 */
      lua_pushfstring(L, "return %s", line + 1);
    else
      lua_pushstring(L, line);
    free(line);
    status = add_return(L);
    if (status != LUA_OK) status = multi_line(L);
    if (status == REPL_INTERRUPTED) continue;
    lua_remove(L, 1);
    return status;
  }
}

/* Prints the values on the stack with the global print (Ctrl-C stops a long one). */
static void print_results(lua_State *L) {
  int n = lua_gettop(L);
  if (n > 0) {
    luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
    lua_getglobal(L, "print");
    lua_insert(L, 1);
    if (docall_ex(L, n, 0, 0) != LUA_OK)
      l_message(progname, lua_pushfstring(L, "error calling 'print' (%s)", lua_tostring(L, -1)));
  }
}

/* nv and help for the REPL; a failure is a warning, not the end of the session. */
static void repl_prelude(lua_State *L) {
  static const char code[] = "nv = require \"nvlua\"; help = nv.help";
  int status = luaL_loadbuffer(L, code, sizeof code - 1, "=(repl)");
  if (status == LUA_OK) status = docall_ex(L, 0, 0, 0);
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    fflush(stdout);
    fprintf(stderr, "%s: warning: nv and help() are not available: %s\n", NVL_PROGNAME,
            msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
  }
}

static void do_repl(lua_State *L) {
  int status;
  const char *oldprogname = progname;
  progname = NULL; /* no program name on errors in the REPL */
  repl_interactive = isatty(STDIN_FILENO);
  if (repl_interactive) {
    idle_sigint = prompt_sigint;
    set_sigint(idle_sigint);
#ifdef NVLUA_USE_READLINE
    readline_start(L);
#endif
    printf("%s\n", NVL_BANNER);
    fflush(stdout);
  }
  repl_prelude(L);
  while ((status = load_line(L)) != -1) {
    if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
    if (status == LUA_OK) print_results(L);
    else report(L, status);
    fflush(stdout);
  }
  lua_settop(L, 0);
  if (repl_interactive) {
    fputc('\n', stdout);
#ifdef NVLUA_USE_READLINE
    readline_stop();
#endif
  }
  fflush(stdout);
  idle_sigint = SIG_DFL;
  set_sigint(idle_sigint);
  progname = oldprogname;
}

/* ---- main -------------------------------------------------------------------------------- */

/* Everything, in protected mode: argc and argv come as arguments 1 and 2. Returns true on
 * success. */
static int pmain(lua_State *L) {
  int argc = (int)lua_tointeger(L, 1);
  char **argv = (char **)lua_touserdata(L, 2);
  int script;
  int flags = collect_args(argv, argc, &script);
  int optlim = script > 0 ? script : argc; /* first argv that is not an option */
  luaL_checkversion(L);
  if (flags & OPT_ERROR) {
    print_usage(argv[script]);
    return 0;
  }
  if (flags & OPT_V) print_version();
  if (flags & OPT_NOENV) { /* tells package to ignore LUA_PATH and LUA_CPATH */
    lua_pushboolean(L, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
  }
  luaL_openlibs(L);
  preload_modules(L);
  setup_path(L, flags & OPT_NOENV);
  create_arg_table(L, argv, argc, script);
  lua_gc(L, LUA_GCRESTART);
  lua_gc(L, LUA_GCGEN, 0, 0);
  if (!(flags & OPT_NOENV) && handle_luainit(L) != LUA_OK) return 0;
  if (!run_args(L, argv, optlim)) return 0;
  if (script > 0 && handle_script(L, argv + script) != LUA_OK) return 0;
  if ((flags & OPT_I) || (script == 0 && !(flags & (OPT_EXEC | OPT_V)))) do_repl(L);
  lua_pushboolean(L, 1);
  return 1;
}

int main(int argc, char **argv) {
  int status, ok;
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    l_message(NVL_PROGNAME, "cannot create state: not enough memory");
    return EXIT_FAILURE;
  }
  lua_gc(L, LUA_GCSTOP); /* no collections while the state is being built */
  lua_pushcfunction(L, pmain);
  lua_pushinteger(L, argc);
  lua_pushlightuserdata(L, argv);
  status = lua_pcall(L, 2, 1, 0);
  ok = lua_toboolean(L, -1);
  report(L, status);
  lua_close(L);
  fflush(stdout);
  /* data parallelism (nvlua.dist): finalize MPI, or, when the script failed on this rank, end the
   * whole job instead of leaving the other ranks waiting in their next collective */
  nvl_dist_shutdown(ok && status == LUA_OK);
  return ok && status == LUA_OK ? EXIT_SUCCESS : EXIT_FAILURE;
}
