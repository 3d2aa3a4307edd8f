-- tests/run.lua: run nvlua's Lua tests.   nvlua tests/run.lua [name ...]
-- Names select files (test_tensor or tensor); none runs every tests/test_*.lua. Prints one line
-- per case and "N passed, N failed, N skipped"; exits 1 on any failure, 77 (ctest's SKIP) when
-- every case was skipped, else 0.
local lfs = require "lfs"
local T = require "nvlua.test"

local here = (arg and arg[0] or "tests/run.lua"):match("^(.*)/[^/]*$") or "."

local files = {}
if #arg > 0 then
  for _, name in ipairs(arg) do
    name = name:gsub("%.lua$", ""):gsub("^.*/", "")
    if not name:match("^test_") then name = "test_" .. name end
    local path = here .. "/" .. name .. ".lua"
    if not lfs.attributes(path) then
      io.stderr:write("run.lua: no test file " .. path .. "\n")
      os.exit(2)
    end
    files[#files + 1] = {name = name, path = path}
  end
else
  for f in lfs.dir(here) do
    if f:match("^test_.*%.lua$") then files[#files + 1] = {name = f:gsub("%.lua$", ""), path = here .. "/" .. f} end
  end
  table.sort(files, function(a, b) return a.name < b.name end)
end

local P, F, S = 0, 0, 0
for _, file in ipairs(files) do
  T.reset()
  local ok, err = pcall(dofile, file.path)
  if not ok then
    F = F + 1
    io.write(string.format("FAIL %s: (loading the file)\n     %s\n", file.name, tostring(err)))
  else
    local p, f, s = T.run((file.name:gsub("^test_", "")))
    P, F, S = P + p, F + f, S + s
  end
  collectgarbage()
end
io.write(string.format("%d passed, %d failed, %d skipped\n", P, F, S))
if F > 0 then os.exit(1) end
if P == 0 and S > 0 then os.exit(77) end
os.exit(0)
