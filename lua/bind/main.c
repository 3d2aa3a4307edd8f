/* main.c: the nvlua program, a Lua 5.4 stand-alone interpreter with the nvlua core built in.
 *
 * Command line and behaviour follow Lua 5.4's own `lua` (lua.c), so nvlua can stand wherever lua
 * stands: `nvlua [options] [script [args]]` with -e -l -i -v -E -W -- -, the global `arg` table,
 * LUA_INIT, scripts run under a protected call with a traceback handler, exit status 1 on error,
 * Ctrl-C raising "interrupted!" in running Lua code. What nvlua adds:
 *   - `lfs`, `cjson` and `nvlua.core` are preloaded, so they need no module path;
 *   - package.path starts with the nvlua Lua library (next to the binary, installed, or in the
 *     source tree) and, unless -E, with $NVLUA_PATH;
 *   - -v also reports the nvlua version, BLAS, oneDNN, OpenMP's wait setting and CUDA;
 *   - OpenMP's idle threads spin briefly, not for milliseconds (omp_wait_default), so two jobs on the
 *     same cores share them;
 *   - the REPL (repl.c, nvl_repl_run) defines `nv` and `help` first, has readline editing,
 *     history and completion, and survives Ctrl-C at the prompt; this file runs its statements
 *     (nvl_main_docall) and keeps the Ctrl-C handling of running code;
 *   - nvlua.signal: SIGINT, SIGTERM and SIGUSR1 deferred to polling, for the training loop's clean
 *     stop (finish the step, checkpoint, exit with status 75, EX_TEMPFAIL: "interrupted, resumable");
 *   - a user error (a bad option, file or shape: lua/bind/errors.c) is printed as its one line,
 *     without the stack traceback other errors get (msghandler; NVLUA_TRACEBACK=1 restores it).
 * Not here: the REPL's line reading, history and completion (repl.c), any tensor code (lua/bind/
 * bindings, core/). Nothing here calls exit(); main returns the status (os.exit still ends the
 * process with its own status).
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "lfs.h"
#include "lua-cjson.h"

#include "bind.h"
#include "dist.h"
#include "device.h"
#include "flash_attention.h"
#ifdef NVL_CUDA_EMU
#include "emu_api.h"
#endif
#include "info.h"

#ifndef NVLUA_VERSION
#define NVLUA_VERSION "unknown"
#endif
#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

/* ---- messages --------------------------------------------------------------------------- */

void nvl_main_message(const char *pname, const char *msg) {
  fflush(stdout); /* keep stdout and stderr in order when both go to one pipe */
  if (pname) fprintf(stderr, "%s: ", pname);
  fprintf(stderr, "%s\n", msg);
  fflush(stderr);
}

/* Prints and pops the error message on top of the stack when status is not LUA_OK. */
static int report(lua_State *L, int status) {
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    nvl_main_message(NVL_PROGNAME, msg ? msg : "(error object is not a string)");
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
          "  -v        show version information (Lua, nvlua, BLAS, oneDNN, CUDA, GPUs)\n"
          "  -E        ignore environment variables\n"
          "  -W        turn warnings on\n"
          "  --        stop handling options\n"
          "  -         stop handling options and execute stdin\n",
          NVL_PROGNAME);
  fflush(stderr);
}

/* ---- OpenMP's idle threads ---------------------------------------------------------------------
 * After a parallel region libgomp's workers spin (300,000 iterations by default) before they sleep,
 * and every GEMM and kernel here is a parallel region. Alone on its cores that saves a wake-up per
 * region; beside a second job on the same cores the spinning workers hold the cores the other job's
 * threads wait for: two copies of the main job on 2 cores ran 3.4-13x slower each instead of 2x.
 * Passive waiting (no spin) costs the lone job 16%; 1,000 spins 8%; 10,000 spins nothing, but two
 * jobs then take 2.5x. nvlua's default, GOMP_SPINCOUNT=NVL_GOMP_SPINCOUNT, measured the lone job
 * 3% slower than libgomp's default and two jobs 2.2x one (scripts/bench_omp.sh,
 * experiments/bench/omp_wait_2026-11-28.md). libgomp reads its environment in a constructor, before
 * main, so nvlua sets the default by executing itself once more with it in the environment (same
 * process id, arguments and name). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept as given;
 * NVLUA_OMP_DEFAULT=0 keeps libgomp's own default. */
#define NVL_GOMP_SPINCOUNT "5000"

static void omp_wait_default(char **argv) {
  const char *off = getenv("NVLUA_OMP_DEFAULT");
  char self[PATH_MAX];
  if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || (off && strcmp(off, "0") == 0)) return;
  /* the binary's own path, not /proc/self/exe: exec names the process after the path it is given */
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  if (setenv("GOMP_SPINCOUNT", NVL_GOMP_SPINCOUNT, 1) != 0) return;
  execv(self, argv);
  unsetenv("GOMP_SPINCOUNT"); /* not executable again (the binary was replaced): libgomp's default */
}

/* What -v says about the setting libgomp started with. */
static const char *omp_wait_info(void) {
  static char buf[160];
  const char *spin = getenv("GOMP_SPINCOUNT"), *policy = getenv("OMP_WAIT_POLICY");
  const char *off = getenv("NVLUA_OMP_DEFAULT");
  if (spin && strcmp(spin, NVL_GOMP_SPINCOUNT) == 0 && !policy)
    snprintf(buf, sizeof buf, "GOMP_SPINCOUNT=%s (nvlua's default: idle threads yield the cores soon)", spin);
  else if (spin || policy)
    snprintf(buf, sizeof buf, "%s%s%s%s%s (set by the environment)", spin ? "GOMP_SPINCOUNT=" : "",
             spin ? spin : "", spin && policy ? ", " : "", policy ? "OMP_WAIT_POLICY=" : "", policy ? policy : "");
  else
    snprintf(buf, sizeof buf, "libgomp's default wait (%s)",
             off && strcmp(off, "0") == 0 ? "NVLUA_OMP_DEFAULT=0" : "could not set nvlua's");
  return buf;
}

static void print_version(void) {
  const char *blas = nvl_blas_info();
  int ndev;
  printf("%s\n", LUA_COPYRIGHT);
  printf("nvlua %s\n", NVLUA_VERSION);
  printf("BLAS: %s\n", blas ? blas : "unknown");
  printf("bf16 GEMMs: %s\n", nvl_dnnl_info());
  printf("OpenMP: %s\n", omp_wait_info());
  if (nvl_device_compiled(NVL_CUDA)) {
    int rt = nvl_device_runtime_version(NVL_CUDA); /* 1000 * major + 10 * minor */
    printf("CUDA: compiled in (runtime %d.%d, cuBLASLt %zu)\n", rt / 1000, (rt % 1000) / 10,
           nvl_device_blas_version(NVL_CUDA));
#ifdef NVL_CUDA_EMU
    printf("CUDA: %s\n", nvl_emu_description());
#endif
    nvl_cudnn_attention_info ci;
    nvl_cudnn_attention_stats(&ci); /* opens libcudnn (dlopen) if nvlua was built with its headers */
    size_t h = ci.compiled_version, l = ci.version;
    if (!h)
      printf("cuDNN: not compiled in (attention runs on nvlua's own kernels)\n");
    else if (ci.loads)
      printf("cuDNN: headers %zu.%zu.%zu, library %zu.%zu.%zu (attention=auto uses it on sm_90+)\n", h / 10000,
             h / 100 % 100, h % 100, l / 10000, l / 100 % 100, l % 100);
    else
      printf("cuDNN: headers %zu.%zu.%zu, library not loaded (%s)\n", h / 10000, h / 100 % 100, h % 100,
             ci.load_error);
  } else {
    printf("CUDA: not compiled in\n");
  }
  ndev = nvl_device_count(NVL_CUDA);
  if (ndev <= 0) {
    const char *why = nvl_device_unavailable_reason(NVL_CUDA);
    printf("GPUs: none (%s)\n", why && why[0] ? why : "no device");
  }
  for (int i = 0; i < ndev; i++) {
    nvl_device_props p;
    memset(&p, 0, sizeof p);
    if (nvl_device_props_of(NVL_CUDA, i, &p) != NVL_OK)
      printf("GPU %d: properties unavailable (%s)\n", i, nvl_last_error());
    else
      printf("GPU %d: %s, %.1f GiB, compute capability %d.%d, %d SMs\n", i, p.name,
             (double)p.total_mem / (1024.0 * 1024.0 * 1024.0), p.major, p.minor,
             p.multiprocessors);
  }
  fflush(stdout);
}

/* ---- Ctrl-C and the stop signals ----------------------------------------------------------- */

/* The state whose running code a Ctrl-C interrupts. */
static lua_State *globalL;
/* What SIGINT does while no Lua code runs: default (end the process), or, at an interactive
 * REPL prompt, the REPL's handler (nvl_main_set_idle_sigint). */
static void (*idle_sigint)(int) = SIG_DFL;
/* Deferred mode (nvlua.signal.defer(true), used by the training loop): the first SIGINT, SIGTERM
 * or SIGUSR1 only records its number in stop_signal, which the loop polls at step boundaries to
 * finish the step, checkpoint and stop. Then a second SIGINT (Ctrl-C again) interrupts the running
 * code at once (and a third, code stuck in C, ends the process); a repeated SIGTERM or SIGUSR1 is
 * ignored, because senders repeat them: `timeout` signals its child and then its process group,
 * and schedulers escalate to SIGKILL themselves. SIGTERM is what `timeout`, Slurm's time limit and
 * preemption send, and what mpirun turns its own SIGINT/SIGTERM into for the ranks; SIGUSR1 is
 * Slurm's --signal and mpirun forwards it to every rank. Outside deferred mode SIGTERM and SIGUSR1
 * keep their default action (end the process). The handler only sets sig_atomic_t flags (and, to
 * interrupt, calls lua_sethook and sigaction, which are safe there). */
static volatile sig_atomic_t defer_stops, stop_signal;
/* The status main returns when the script ends without error (nvlua.signal.set_exit_status). */
static int script_exit_status = EXIT_SUCCESS;

enum { NVL_EXIT_INTERRUPTED = 75 }; /* EX_TEMPFAIL (sysexits.h): stopped, state saved, run again */

static const int stop_signals[] = {SIGINT, SIGTERM, SIGUSR1};
static const char *const stop_signal_names[] = {"SIGINT", "SIGTERM", "SIGUSR1", NULL};

/* restart: SA_RESTART, for the deferred mode (a signal that only sets a flag must not make a
 * checkpoint's write or an MPI wait fail with EINTR); without it (Ctrl-C of running code, as
 * lua.c) a blocked read returns EINTR, so the interrupt is seen. */
static void set_handler(int sig, void (*handler)(int), int restart) {
  struct sigaction sa;
  sa.sa_handler = handler;
  sa.sa_flags = restart ? SA_RESTART : 0;
  sigemptyset(&sa.sa_mask);
  sigaction(sig, &sa, NULL);
}

static void set_sigint(void (*handler)(int)) { set_handler(SIGINT, handler, 0); }

/* Hook set by laction: the next Lua instruction raises the error. */
static void lstop(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  luaL_error(L, "interrupted!");
}

/* SIGINT while Lua code runs; SIGTERM and SIGUSR1 too in deferred mode. Deferred, the first one is
 * recorded and a repeated SIGTERM or SIGUSR1 ignored; otherwise (SIGINT outside deferred mode, a
 * second SIGINT in it) the running code is interrupted, and SIGINT's default action restored, so
 * that another Ctrl-C before the hook fires (code stuck in C) ends the process. lua_sethook is safe
 * to call from a signal handler. */
static void laction(int sig) {
  int mask = LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT;
  if (defer_stops && !stop_signal) {
    stop_signal = sig;
    return;
  }
  if (sig != SIGINT) return;
  set_sigint(SIG_DFL);
  lua_sethook(globalL, lstop, mask, 1);
}

void nvl_main_set_idle_sigint(void (*handler)(int)) {
  idle_sigint = handler;
  set_sigint(idle_sigint);
}

/* SIGTERM's and SIGUSR1's actions before defer(true) (an inherited SIG_IGN, a launcher's handler),
 * put back by defer(false). */
static struct sigaction saved_term, saved_usr1;
static int saved_actions;

/* nvlua.signal.defer(on): defer SIGINT, SIGTERM and SIGUSR1 to polling (see defer_stops), with no
 * stop pending yet; off forgets a pending one and gives SIGTERM and SIGUSR1 back the actions they
 * had before. */
static int l_signal_defer(lua_State *L) {
  if (lua_toboolean(L, 1)) {
    if (!defer_stops) {
      sigaction(SIGTERM, NULL, &saved_term);
      sigaction(SIGUSR1, NULL, &saved_usr1);
      saved_actions = 1;
    }
    stop_signal = 0; /* a stop left by an earlier run that failed is not this run's */
    defer_stops = 1;
    for (size_t i = 0; i < sizeof stop_signals / sizeof stop_signals[0]; i++) set_handler(stop_signals[i], laction, 1);
  } else {
    if (saved_actions) {
      sigaction(SIGTERM, &saved_term, NULL);
      sigaction(SIGUSR1, &saved_usr1, NULL);
      saved_actions = 0;
    } else {
      set_handler(SIGTERM, SIG_DFL, 0);
      set_handler(SIGUSR1, SIG_DFL, 0);
    }
    set_sigint(laction); /* as nvl_main_docall has it while code runs */
    defer_stops = 0;
    stop_signal = 0;
  }
  return 0;
}

/* nvlua.signal.pending() -> the name of the first deferred signal ("SIGINT", "SIGTERM",
 * "SIGUSR1") once one came (it stays until defer(false)), else false. */
static int l_signal_pending(lua_State *L) {
  int sig = stop_signal;
  for (size_t i = 0; sig && i < sizeof stop_signals / sizeof stop_signals[0]; i++) {
    if (stop_signals[i] == sig) {
      lua_pushstring(L, stop_signal_names[i]);
      return 1;
    }
  }
  lua_pushboolean(L, 0);
  return 1;
}

/* nvlua.signal.raise([name = "SIGINT"]): deliver that stop signal to this process (tests). */
static int l_signal_raise(lua_State *L) {
  int i = luaL_checkoption(L, 1, "SIGINT", stop_signal_names);
  raise(stop_signals[i]);
  return 0;
}

/* nvlua.signal.set_exit_status(n): the status nvlua exits with when its script ends without error
 * (0 unless set; the training loop sets EXIT_INTERRUPTED when a signal stopped it). os.exit still
 * ends the process with its own status. */
static int l_signal_set_exit_status(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  luaL_argcheck(L, n >= 0 && n <= 255, 1, "an exit status is 0..255");
  script_exit_status = (int)n;
  return 0;
}

static int luaopen_nvlua_signal(lua_State *L) {
  static const luaL_Reg f[] = {{"defer", l_signal_defer}, {"pending", l_signal_pending}, {"raise", l_signal_raise},
                               {"set_exit_status", l_signal_set_exit_status}, {NULL, NULL}};
  luaL_newlib(L, f);
  lua_pushinteger(L, NVL_EXIT_INTERRUPTED);
  lua_setfield(L, -2, "EXIT_INTERRUPTED");
  return 1;
}

/* ---- running code ------------------------------------------------------------------------ */

/* Whether every error gets its traceback: NVLUA_TRACEBACK set to anything but "" or "0". */
static int traceback_always(void) {
  const char *e = getenv("NVLUA_TRACEBACK");
  return e != NULL && e[0] != '\0' && strcmp(e, "0") != 0;
}

/* Message handler: adds a traceback to the error message, as lua.c's does — except to a user
 * error. How errors reach people: a user error (lua/bind/errors.c: a bad option or config value, a
 * missing or malformed file, a shape or size that does not fit; raised in C by nvl_lua_user_error,
 * by opts.c's checks and for core's NVL_EINVAL, NVL_EUNSUPPORTED, NVL_EIO and NVL_ENOMEM statuses
 * (nvl_lua_raise), in Lua by core.user_error, which util.user_error, util.check_opts and
 * nvlua.config use) is printed as its one-line message, "nvlua: config: lr must be ...". Any other
 * error — a Lua runtime error, a script's own error(), a failed CUDA call — is an internal one and
 * keeps its stack traceback. NVLUA_TRACEBACK=1 gives every error its traceback. The exit status is
 * 1 on any error. The REPL's statements (nvl_main_docall) go through the same handler. */
static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg != NULL && nvl_lua_is_user_error(L, 1) && !traceback_always()) return 1;
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* Calls the function below narg arguments in protected mode, with Ctrl-C armed and, when
 * traceback is set, a traceback added to an error message. */
int nvl_main_docall(lua_State *L, int narg, int nres, int traceback) {
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

static int docall(lua_State *L, int narg, int nres) { return nvl_main_docall(L, narg, nres, 1); }

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
  if ((flags & OPT_I) || (script == 0 && !(flags & (OPT_EXEC | OPT_V)))) nvl_repl_run(L);
  lua_pushboolean(L, 1);
  return 1;
}

int main(int argc, char **argv) {
  int status, ok;
  omp_wait_default(argv); /* returns only when no second execution is needed (or possible) */
  nvl_fp_env_ieee("at start-up"); /* IEEE subnormals, whatever a library's constructor set (info.h) */
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    nvl_main_message(NVL_PROGNAME, "cannot create state: not enough memory");
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
  return ok && status == LUA_OK ? script_exit_status : EXIT_FAILURE;
}
