/* repl.c: nvlua's interactive read-eval-print loop, lua.c's doREPL with more: `nv` and `help`
 * defined first, results printed readably (nvlua.pretty: a plain table as a sorted, indented
 * constructor, not "table: 0x..."), readline editing, history (~/.nvlua_history, a statement of
 * several lines kept as one entry), completion of Lua names (a.b.c, a:m, through tables and
 * __index tables, calling nothing) and of file names inside strings, and Ctrl-C at the prompt
 * abandoning the line instead of ending the process. When stdin is not a terminal it still reads statements but
 * prints only their results (no banner, no prompts), so `printf '1+1\n' | nvlua` prints 2.
 * Not here: the command line, running scripts and Ctrl-C while Lua code runs (main.c, whose
 * nvl_main_docall runs each statement).
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

#include "bind.h"

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

#define NVL_HISTORY_FILE ".nvlua_history"
#define NVL_HISTORY_MAX 1000
#define NVL_BANNER \
  "nvlua " NVLUA_VERSION " (Lua " LUA_VERSION_MAJOR "." LUA_VERSION_MINOR \
  ") \xe2\x80\x94 type help() for the API, Ctrl-D to exit"

/* ---- Ctrl-C at the prompt ---------------------------------------------------------------- */

/* Set by SIGINT while the REPL waits for input at an interactive prompt. */
static volatile sig_atomic_t prompt_interrupted;

static void prompt_sigint(int sig) {
  (void)sig;
  prompt_interrupted = 1;
}

/* Prints and pops the error message on top of the stack when status is not LUA_OK, without a
 * program name (as lua.c's REPL). */
static void report(lua_State *L, int status) {
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    nvl_main_message(NULL, msg ? msg : "(error object is not a string)");
    lua_pop(L, 1);
  }
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

/* The results' printer, nvlua.pretty.print, in the registry (LUA_NOREF: the global print). */
static int printer_ref = LUA_NOREF;

/* Prints the values on the stack with the printer (Ctrl-C stops a long one). */
static void print_results(lua_State *L) {
  int n = lua_gettop(L);
  if (n > 0) {
    luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
    if (printer_ref != LUA_NOREF) lua_rawgeti(L, LUA_REGISTRYINDEX, printer_ref);
    else lua_getglobal(L, "print");
    lua_insert(L, 1);
    if (nvl_main_docall(L, n, 0, 0) != LUA_OK)
      nvl_main_message(NULL, lua_pushfstring(L, "error calling 'print' (%s)", lua_tostring(L, -1)));
  }
}

/* nv, help and the results' printer for the REPL; a failure is a warning, not the end of the
 * session (results are then printed with print). */
static void repl_prelude(lua_State *L) {
  static const char code[] = "nv = require \"nvlua\"; help = nv.help; return require(\"nvlua.pretty\").print";
  int status = luaL_loadbuffer(L, code, sizeof code - 1, "=(repl)");
  if (status == LUA_OK) status = nvl_main_docall(L, 0, 1, 0);
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    fflush(stdout);
    fprintf(stderr, "%s: warning: nv and help() are not available: %s\n", NVL_PROGNAME,
            msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
  } else if (lua_isfunction(L, -1)) {
    printer_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  } else {
    lua_pop(L, 1);
  }
}

void nvl_repl_run(lua_State *L) {
  int status;
  repl_interactive = isatty(STDIN_FILENO);
  if (repl_interactive) {
    nvl_main_set_idle_sigint(prompt_sigint);
#ifdef NVLUA_USE_READLINE
    readline_start(L);
#endif
    printf("%s\n", NVL_BANNER);
    fflush(stdout);
  }
  repl_prelude(L);
  while ((status = load_line(L)) != -1) {
    if (status == LUA_OK) status = nvl_main_docall(L, 0, LUA_MULTRET, 1);
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
  nvl_main_set_idle_sigint(SIG_DFL);
}
