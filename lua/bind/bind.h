/* bind.h: what the Lua binding files (lua/bind/) share: the module entry point that main.c
 * preloads, the helpers each binding file uses to move tensors across the Lua boundary, and what
 * the program (main.c) and its REPL (repl.c) share.
 * Not here: the bindings' internals or anything of core/. */
#ifndef NVL_BIND_H
#define NVL_BIND_H
#include "lua.h"
#include "tensor.h"

/* Opens the C core module and returns its table; preloaded as require "nvlua.core". */
int luaopen_nvlua_core(lua_State *L);

/* Push a new, empty (null) tensor userdata and return it, to be filled by a core call. */
nvl_tensor *nvl_lua_push_tensor(lua_State *L);
/* Argument i as a live tensor (raises a Lua error naming op otherwise). */
nvl_tensor *nvl_lua_check_tensor(lua_State *L, int i, const char *op);
/* Raise the last core error as a Lua error. */
int nvl_lua_raise(lua_State *L);
/* Add the quantization functions and the "nvlua.QTensor" type to the module table on top. */
void nvl_lua_open_quant(lua_State *L);
/* Add the layer library (core/layers.h) to the module table on top (lua/bind/layers.c). */
void nvl_lua_open_layers(lua_State *L);
/* Add attention (core/layers.h) to the module table on top (lua/bind/attention.c). */
void nvl_lua_open_attention(lua_State *L);
/* Add fsync, isatty, peak_rss, tokens_from_bytes (lua/bind/sys.c). */
void nvl_lua_open_sys(lua_State *L);
/* Add the table dist: process group and collectives, core/dist.h (lua/bind/dist.c). */
void nvl_lua_open_dist(lua_State *L);
/* Add the CUDA backend's controls: cuda_memory, cuda_gemm_path, cuda_time, ... (lua/bind/cuda.c). */
void nvl_lua_open_cuda(lua_State *L);
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
