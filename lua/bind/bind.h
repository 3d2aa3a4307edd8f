/* bind.h: the entry points of the Lua bindings (the .c files in lua/bind/) that the nvlua
 * program (main.c) preloads into package.preload. Not here: the bindings' internals or anything
 * of core/. */
#ifndef NVL_BIND_H
#define NVL_BIND_H
#include "lua.h"

/* Opens the C core module and returns its table; preloaded as require "nvlua.core". */
int luaopen_nvlua_core(lua_State *L);

#endif
