/* attention.c: the Lua binding of nvl_attention_* (being written). */
#include <lauxlib.h>
#include <lua.h>
#include "bind.h"
#include "layers.h"

void nvl_lua_open_attention(lua_State *L) { (void)L; }
