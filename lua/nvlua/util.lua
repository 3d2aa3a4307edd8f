-- nvlua.util: small helpers the Lua library shares (option checking, shapes, atomic file writes).
local core = require "nvlua.core"

local util = {}

--- util.user_error(msg [, level = 1]): error(msg, level), raised as a user error: a bad option, a bad
-- file, a shape or size that does not fit — what the person running nvlua fixes from the message
-- alone. It is an ordinary string error; the nvlua program prints it as its one line, without the
-- stack traceback other errors get (lua/bind/errors.c says how; NVLUA_TRACEBACK=1 shows it).
util.user_error = core.user_error
--- util.is_user_error(v) -> true when v is the message of the last user error raised
util.is_user_error = core.is_user_error
--- util.did_you_mean(word, names) -> "did you mean 'x'?" naming the names (a list of strings)
-- closest to a mistyped word (case ignored: an edit distance of at most 2, a swap of neighbours
-- counting 1, or the word an abbreviation of them), or nil when none is close (lua/bind/errors.c)
util.did_you_mean = core.did_you_mean

--- util.suggest(word, names) -> "; did you mean 'x'?" to end an error message about a mistyped
-- word (util.did_you_mean), or "" when word is not a string or no name is close
function util.suggest(word, names)
  local hint = type(word) == "string" and core.did_you_mean(word, names)
  return hint and "; " .. hint or ""
end

-- A value as an error message shows it: a list of numbers or strings as {a, b}, else tostring.
local function show(v)
  if type(v) ~= "table" or getmetatable(v) ~= nil or next(v) == nil then return tostring(v) end
  local parts = {}
  for k, x in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 or k > #v or (type(x) ~= "number" and type(x) ~= "string") then
      return tostring(v)
    end
    parts[k] = type(x) == "string" and string.format("%q", x) or tostring(x)
  end
  return "{" .. table.concat(parts, ", ") .. "}"
end

--- util.check_opts(opts, valid, fname) -> opts ({} for nil): the one option checker of the Lua
-- library. valid maps each accepted key to true (any value) or to a checker function(value) that
-- returns nil for a good value, else a phrase for "<fname>: option <k> <phrase>, got <value>"
-- (e.g. "must be true or false"). An unknown key raises "<fname>: unknown option 'k' (valid:
-- a, b, ...)", the valid keys sorted, and "; did you mean 'x'?" when k is close to one of them.
-- Errors are user errors (util.user_error) raised at the caller's caller (level 3).
function util.check_opts(opts, valid, fname)
  if opts == nil then return {} end
  if type(opts) ~= "table" then util.user_error(fname .. ": options must be a table, got " .. type(opts), 3) end
  for k, v in pairs(opts) do
    local check = valid[k]
    if not check then
      local names = {}
      for n in pairs(valid) do names[#names + 1] = n end
      table.sort(names)
      util.user_error(string.format("%s: unknown option '%s' (valid: %s)%s", fname, tostring(k), table.concat(names, ", "),
        util.suggest(k, names)), 3)
    end
    if type(check) == "function" then
      local bad = check(v)
      if bad then util.user_error(string.format("%s: option %s %s, got %s", fname, k, bad, show(v)), 3) end
    end
  end
  return opts
end

--- Two size tables equal?
function util.same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

--- "[2,3]" for a size table or a tensor
function util.shape_str(s)
  if type(s) ~= "table" then s = s:size() end
  return "[" .. table.concat(s, ",") .. "]"
end

-- An I/O failure inside atomic_write's writing (a marker table, told apart from other errors).
local IO_FAIL = {}
local function io_fail(msg) error(setmetatable({msg = msg}, IO_FAIL), 0) end

local function is_string(s) return type(s) == "string" end
-- the bytes of a piece of a file's contents: a string, or a tensor's raw bytes
local function piece_size(s) return is_string(s) and #s or s:nbytes() end

-- the contents (a string, or a function calling put(piece) for each piece: a string or a tensor)
-- into the open file f -> the bytes written
local function write_contents(f, contents)
  local n = 0
  local function put(s)
    local ok, err
    if is_string(s) then ok, err = f:write(s) else ok, err = core.write_tensor(f, s) end
    if not ok then io_fail(err) end
    n = n + piece_size(s)
  end
  if is_string(contents) then put(contents) else contents(put) end
  local ok, err = f:flush()
  if not ok then io_fail(err) end
  return n
end

-- util.with_write_sink's sink while it runs: atomic_write hands it the writes instead of doing them
local sink

--- util.with_write_sink(fn_sink, fn, ...) -> fn(...)'s results: runs fn with every util.atomic_write
-- handed to fn_sink(path, pieces) instead of written (pieces: the strings and tensors of the file, in
-- order; atomic_write then returns true and their size). A background checkpoint collects its files
-- this way, for a writer thread to write and sync (checkpoint.lua). Not reentrant.
function util.with_write_sink(fn_sink, fn, ...)
  if sink then error("with_write_sink: already collecting writes", 2) end
  sink = fn_sink
  local res = table.pack(pcall(fn, ...))
  sink = nil
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end

--- util.write_sink_active() -> true inside util.with_write_sink (a write is collected, not made: a
-- tensor put then must live until the collector has copied it)
function util.write_sink_active() return sink ~= nil end

-- The metatable of tensor sources (util.tensor_source).
local SOURCE = {}
SOURCE.__index = SOURCE
function SOURCE:size(i) if i then return self.shape[i] end return {table.unpack(self.shape)} end
function SOURCE:dtype() return self.dt end
function SOURCE:numel() local n = 1 for _, d in ipairs(self.shape) do n = n * d end return n end
function SOURCE:nbytes() return self:numel() * (self.dt == "bf16" and 2 or 4) end

--- util.tensor_source(shape, dtype, write) -> a tensor source: a tensor that is made only when it is
-- written. It answers size(), dtype(), numel(), nbytes() as the tensor would, and safetensors' save
-- calls write(put) where it would put the tensor (put it, or its bytes in pieces). A sharded run's
-- checkpoint gathers each parameter this way, one at a time (nvlua.shard). dtype: f32 or bf16.
function util.tensor_source(shape, dtype, write)
  return setmetatable({shape = {table.unpack(shape)}, dt = dtype, write = write}, SOURCE)
end

--- util.is_tensor_source(v) -> is v a util.tensor_source?
function util.is_tensor_source(v) return getmetatable(v) == SOURCE end

--- util.atomic_write(path, contents [, {tmp =, fsync =}]) -> true, bytes | nil, msg
-- Writes contents (a string, or a function(put) that calls put(piece) for each piece: a string, or an
-- nvlua tensor whose raw bytes are written, core.write_tensor) to a temp file beside path, flushes and
-- fsyncs it, renames it over path and fsyncs the directory: a crash leaves the old file or the new
-- one, never a mix. opts.tmp names the temp file (default "<path>.tmp.<pid>.<n>.<random>", so writers racing on
-- one path, in one process or several, do not share it); opts.fsync(path, is_dir) -> true | nil, msg makes a file or directory
-- durable (core.fsync by default). An I/O failure returns nil and a message saying what failed
-- ("cannot write the temp file: ...", "write failed: ...", "cannot sync the temp file: ...", "cannot
-- rename the temp file over it: ...", "written, but syncing its directory failed: ..."); an error
-- raised by a contents function is raised again. Except after the rename, the temp file is removed
-- and a file already at path is left as it was. Inside util.with_write_sink the write goes to the sink.
-- The temp file's name carries this process's id and a counter: ranks of a job writing the same cache file at
-- once (each the same bytes; the last rename wins) must not share a temp file, and math.random's sequence
-- may be the same in two processes started together (a rank's rename then found its temp file gone).
local PID = tostring(core.getpid())
local tmp_count = 0

function util.atomic_write(path, contents, opts)
  opts = util.check_opts(opts, {tmp = true, fsync = true}, "atomic_write")
  if sink then
    local pieces, n = {}, 0
    local function put(s)
      pieces[#pieces + 1] = s
      n = n + piece_size(s)
    end
    if is_string(contents) then put(contents) else contents(put) end
    sink(path, pieces)
    return true, n
  end
  local fsync = opts.fsync or core.fsync
  tmp_count = tmp_count + 1
  local tmp = opts.tmp or string.format("%s.tmp.%s.%d.%d", path, PID, tmp_count, math.random(1 << 30))
  local f, oerr = io.open(tmp, "wb")
  if not f then return nil, "cannot write the temp file: " .. tostring(oerr) end
  local ok, err = pcall(write_contents, f, contents)
  local cok, cerr = f:close()
  if ok and not cok then ok, err = false, setmetatable({msg = cerr}, IO_FAIL) end
  if not ok then
    os.remove(tmp)
    if getmetatable(err) == IO_FAIL then return nil, "write failed: " .. tostring(err.msg) end
    error(err, 0)
  end
  local size = err
  local _, ferr = fsync(tmp, false)
  if ferr ~= nil then
    os.remove(tmp)
    return nil, "cannot sync the temp file: " .. tostring(ferr)
  end
  local rok, rerr = os.rename(tmp, path)
  if not rok then
    os.remove(tmp)
    return nil, "cannot rename the temp file over it: " .. tostring(rerr)
  end
  _, ferr = fsync(path:match("^(.*)/[^/]*$") or ".", true)
  if ferr ~= nil then return nil, "written, but syncing its directory failed: " .. tostring(ferr) end
  return true, size
end

--- util.defined_at(f) -> where the Lua function f was defined: "<source>:<line>" (its file as it was
-- loaded), or "a C function"
function util.defined_at(f)
  local i = debug.getinfo(f, "S")
  if i.what == "C" then return "a C function" end
  return string.format("%s:%d", i.source:sub(1, 1) == "@" and i.source:sub(2) or i.short_src, i.linedefined)
end

--- util.sorted_keys(t) -> the keys of t in a list, sorted (names in messages and listings)
function util.sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return out
end

--- util.mean_sd(list) -> the mean and the sample standard deviation (0 for one value) of numbers
function util.mean_sd(l)
  local m = 0
  for _, v in ipairs(l) do m = m + v / #l end
  local ss = 0
  for _, v in ipairs(l) do ss = ss + (v - m) ^ 2 end
  return m, #l > 1 and math.sqrt(ss / (#l - 1)) or 0
end

return util
