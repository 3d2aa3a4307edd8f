/* layers.c: the Lua binding of core/layers.h (being written). */
#include <lauxlib.h>
#include <lua.h>
#include "bind.h"
#include "layers.h"

void nvl_lua_open_layers(lua_State *L) { (void)L; }
