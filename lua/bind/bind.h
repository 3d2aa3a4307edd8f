/* bind.h: what the Lua binding files (lua/bind/) share: the module entry point that main.c
 * preloads, the helpers each binding file uses to move tensors across the Lua boundary, and what
 * the program (main.c) and its REPL (repl.c) share.
 * Not here: the bindings' internals or anything of core/. */
#ifndef NVL_BIND_H
#define NVL_BIND_H
#include "lua.h"
#include "philox.h"
#include "tensor.h"

/* Return the last core error as a Lua error when expr fails. */
#define CHECK(L, expr)                             \
  do {                                             \
    if ((expr) != NVL_OK) return nvl_lua_raise(L); \
  } while (0)

/* The metatables of the tensor userdata types: "nvlua.Tensor" (tensor.c), "nvlua.QTensor" (quant.c). */
#define NVL_TENSOR_MT "nvlua.Tensor"
#define NVL_QTENSOR_MT "nvlua.QTensor"

/* The "nvlua.Generator" userdata (tensor.c): its own Philox state, or the default generator. */
#define NVL_GENERATOR_MT "nvlua.Generator"
typedef struct {
  nvl_generator *g; /* &own, or the default generator */
  nvl_generator own;
} nvl_lua_generator;

/* Opens the C core module and returns its table; preloaded as require "nvlua.core". */
int luaopen_nvlua_core(lua_State *L);

/* Push a new, empty (null) tensor userdata and return it, to be filled by a core call. */
nvl_tensor *nvl_lua_push_tensor(lua_State *L);
/* Record the tensor or quantized tensor userdata at idx in the innermost open scope, if any
 * (scope.c): every push of a new tensor userdata calls it. */
void nvl_lua_scope_record(lua_State *L, int idx);
/* Argument i as a live tensor (raises a Lua error naming op otherwise). */
nvl_tensor *nvl_lua_check_tensor(lua_State *L, int i, const char *op);
/* Raise the last core error as a Lua error: a user error (errors.c) for NVL_EINVAL, NVL_EUNSUPPORTED,
 * NVL_EIO and NVL_ENOMEM, an ordinary one otherwise. */
int nvl_lua_raise(lua_State *L);

/* ---- user errors (errors.c): printed as one line, without a traceback, by the program ---- */

/* luaL_error's twin: raise "<position>: <message>" marked as a user error. */
int nvl_lua_user_error(lua_State *L, const char *fmt, ...);
/* Mark the string at idx as the message of a user error (it is raised after, as it is). */
void nvl_lua_mark_user_error(lua_State *L, int idx);
/* Is the value at idx the message of a user error? */
int nvl_lua_is_user_error(lua_State *L, int idx);
/* Push "did you mean 'a'?" ("'a' or 'b'", "'a', 'b' or 'c'") naming those of names[0..n) closest to
 * word (case ignored: an edit distance of at most 2, 1 for words of 3 bytes or fewer; failing that,
 * names that word begins), in their order; returns 0 and pushes nothing when none is close. */
int nvl_lua_push_did_you_mean(lua_State *L, const char *word, const char *const *names, int n);
/* Add user_error, is_user_error and did_you_mean to the module table on top. */
void nvl_lua_open_errors(lua_State *L);

/* ---- options tables (opts.c): errors read "op: unknown option 'k' (valid: a, b)" ---- */

/* Raise if the table at idx has a key not in valid (NULL-terminated). */
void nvl_lua_check_keys(lua_State *L, int idx, const char *op, const char *const *valid);
/* Number / integer option key of the table at idx: *v unchanged when absent, unless required. */
void nvl_lua_opt_number(lua_State *L, int idx, const char *op, const char *key, double *v, int required);
void nvl_lua_opt_integer(lua_State *L, int idx, const char *op, const char *key, int64_t *v, int required);
/* Boolean option key: *v unchanged when absent. */
void nvl_lua_opt_boolean(lua_State *L, int idx, const char *op, const char *key, int *v);
/* Add the arena to the module table on top: scope, keep, unscope, adopt, unscoped, scope_depth
 * (scope.c). */
void nvl_lua_open_scope(lua_State *L);
/* Add the quantization functions and the "nvlua.QTensor" type to the module table on top. */
void nvl_lua_open_quant(lua_State *L);
/* Add the layer library (core/layers.h) to the module table on top (lua/bind/layers.c). */
void nvl_lua_open_layers(lua_State *L);
/* Add attention (core/layers.h) to the module table on top (lua/bind/attention.c). */
void nvl_lua_open_attention(lua_State *L);
/* Add fsync, isatty, peak_rss, file_stamp, tokens_from_bytes, the token scans (token_range,
 * token_find_outside), write_tensor, the background writer (bg_*), unix_time, hostname, getpid and
 * crc32c (lua/bind/sys.c). */
void nvl_lua_open_sys(lua_State *L);
/* Add bpe_new and the "nvlua.BPE" encoder type (core/bpe.h; lua/bind/tokenizer.c). */
void nvl_lua_open_tokenizer(lua_State *L);
/* Add the table dist: process group and collectives, core/dist.h (lua/bind/dist.c). */
void nvl_lua_open_dist(lua_State *L);
/* Add the devices' controls: cuda_memory, cuda_gemm_path, cuda_time, ... (lua/bind/cuda.c). */
void nvl_lua_open_cuda(lua_State *L);
/* Add gunzip: gzip data in a string inflated with zlib (lua/bind/gzip.c). */
void nvl_lua_open_gzip(lua_State *L);
/* Push {[device] = allocator statistics} for every GPU (an empty table without one). */
void nvl_lua_push_cuda_memory(lua_State *L);


/* ---- the program: main.c and repl.c ---- */

/* The program's name, the prefix of its error messages. */
#define NVL_PROGNAME "nvlua"

/* Runs the REPL on stdin until its end; with a terminal: banner, prompts, readline editing,
 * history, completion, Ctrl-C at the prompt abandoning the line (repl.c). */
void nvl_repl_run(lua_State *L);
/* Calls the function below narg arguments in protected mode with Ctrl-C armed (it raises
 * "interrupted!"), adding a traceback to an error message when traceback is set (main.c). */
int nvl_main_docall(lua_State *L, int narg, int nres, int traceback);
/* Prints msg and a newline on stderr, after "pname: " unless pname is NULL; stdout is flushed
 * first, to keep the two in order on one pipe (main.c). */
void nvl_main_message(const char *pname, const char *msg);
/* Sets what SIGINT does while no Lua code runs: SIG_DFL (end the process), or a REPL prompt's
 * handler (main.c). */
void nvl_main_set_idle_sigint(void (*handler)(int));

#endif
