-- test_layering.lua: the source tree keeps its layers apart (DESIGN.md "Layers"; issue 14's rules):
--   * core/ and kernels/ include no Lua header (only lua/bind/ sees Lua);
--   * a kernel file includes, of core/, only the shared format / tensor-layout headers: nvl.h,
--     dtype.h, tensor.h, philox.h and backend.h (the kernel table's type);
--   * a public core header includes no kernel header;
--   * lua/bind/ includes no kernel header (it reaches kernels only through core);
--   * no hand-written stub mirrors a backend (kernels/cuda/stub.c is gone).
local T = require "nvlua.test"
local lfs = require "lfs"

-- the repository root: this file's directory's parent
local ROOT = (debug.getinfo(1, "S").source:match("^@(.*)/tests/[^/]*$")) or "."

local function files(dir, pattern, out)
  if not out then dir = ROOT .. "/" .. dir end
  out = out or {}
  for name in lfs.dir(dir) do
    if name ~= "." and name ~= ".." then
      local p = dir .. "/" .. name
      local mode = lfs.attributes(p, "mode")
      if mode == "directory" then files(p, pattern, out)
      elseif name:match(pattern) then out[#out + 1] = p end
    end
  end
  table.sort(out)
  return out
end

-- The quoted includes of a file.
local function includes(path)
  local f = assert(io.open(path))
  local s = f:read("a")
  f:close()
  local out = {}
  for h in s:gmatch('#%s*include%s+"([^"]+)"') do out[#out + 1] = h end
  for h in s:gmatch('#%s*include%s+<([^>]+)>') do out[#out + 1] = "<" .. h .. ">" end
  return out
end

local SOURCE = "%.[ch]$"
local function is_source(p) return p:match("%.[ch]$") or p:match("%.cu$") or p:match("%.cuh$") end

local core_headers = {}
for _, p in ipairs(files("core", "%.h$")) do core_headers[p:match("[^/]+$")] = true end
local SHARED = {["nvl.h"] = true, ["dtype.h"] = true, ["tensor.h"] = true, ["philox.h"] = true, ["backend.h"] = true}

T.case("core/ and kernels/ include no Lua header", function()
  local n = 0
  for _, dir in ipairs({"core", "kernels"}) do
    for _, p in ipairs(files(dir, ".")) do
      if is_source(p) then
        n = n + 1
        for _, h in ipairs(includes(p)) do
          T.ok(not h:match("lua") and not h:match("lauxlib") and not h:match("lfs"), p .. " includes " .. h)
        end
      end
    end
  end
  T.ok(n > 40, "found the sources (" .. n .. ")")
end)

T.case("kernels include only the shared core headers (nvl.h, dtype.h, tensor.h, philox.h, backend.h)", function()
  local n = 0
  for _, p in ipairs(files("kernels", ".")) do
    if is_source(p) then
      for _, h in ipairs(includes(p)) do
        local base = h:match("[^/]+$")
        if core_headers[h] then
          n = n + 1
          T.ok(SHARED[h], p .. " includes core/" .. h .. ", which is not a shared format/tensor-layout header")
        else
          -- the CUDA emulator (kernels/cuda/emu) includes its own headers by their bare names
          local emu_own = p:match("kernels/cuda/emu/") and lfs.attributes("kernels/cuda/emu/" .. h) ~= nil
          T.ok(h:sub(1, 1) == "<" or h:match("^cpu/") or h:match("^cuda/") or base == "common.cuh" or emu_own,
            p .. " includes " .. h .. ", which is neither a kernel header nor a shared core header")
        end
      end
    end
  end
  T.ok(n > 5, "kernels do include the shared headers")
end)

T.case("public core headers and lua/bind include no kernel header", function()
  for _, p in ipairs(files("core", "%.h$")) do
    for _, h in ipairs(includes(p)) do T.ok(not h:match("^cpu/") and not h:match("^cuda/"), p .. " includes " .. h) end
  end
  for _, p in ipairs(files("lua/bind", SOURCE)) do
    for _, h in ipairs(includes(p)) do T.ok(not h:match("^cpu/") and not h:match("^cuda/"), p .. " includes " .. h) end
  end
end)

T.case("no hand-written stub mirrors a backend", function()
  T.ok(not lfs.attributes(ROOT .. "/kernels/cuda/stub.c"), "kernels/cuda/stub.c exists")
  for _, p in ipairs(files("kernels", ".")) do T.ok(not p:match("stub"), p) end
end)

