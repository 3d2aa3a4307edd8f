-- nvlua.data: training data — a byte-level tokenizer, the shard file format, corpora (the
-- built-in King James Bible, any text files, pre-tokenized shards) and a deterministic,
-- resumable, rank-sharded batch loader.
--
-- Shard format "NVLTOK" version 1 (little-endian), for pre-tokenized corpora:
--   bytes 0..7   magic "NVLTOK\0\0"
--   bytes 8..11  u32 version = 1
--   bytes 12..15 u32 token width in bytes: 2 (u16 ids, vocab <= 65536) or 4 (u32)
--   bytes 16..23 u64 token count n
--   bytes 24..   n tokens, each `width` bytes, little-endian unsigned
-- scripts/make_shards.lua converts text to shards with the byte tokenizer; any tokenizer can
-- write the same format (e.g. numpy: header + ids.astype('<u2').tobytes()).
local core = require "nvlua.core"
local lfs = require "lfs"
local util = require "nvlua.util"

local data = {}

local MAGIC = "NVLTOK\0\0"
local HEADER = 24

-- ---- tokenizer ------------------------------------------------------------------------------

--- The byte-level tokenizer: token id = byte value, vocabulary 256.
data.ByteTokenizer = {vocab_size = 256, name = "bytes"}
function data.ByteTokenizer.encode(s) return core.tokens_from_bytes(s, 1, #s) end
--- ids: a table of integers or a 1-D i64 tensor -> string
function data.ByteTokenizer.decode(ids)
  if type(ids) ~= "table" then ids = ids:totable() end
  local parts = {}
  for i, v in ipairs(ids) do parts[i] = string.char(math.max(0, math.min(255, v))) end
  return table.concat(parts)
end

-- ---- shards ---------------------------------------------------------------------------------

--- Write tokens (an i64 tensor, a table of integers, or a byte string for width-1 tokens)
-- as a shard, atomically (util.atomic_write); an I/O failure raises.
function data.write_shard(path, tokens, width)
  width = width or 2
  if width ~= 2 and width ~= 4 then error("write_shard: width must be 2 or 4", 2) end
  local fmt1 = width == 2 and "I2" or "I4"
  local parts
  if type(tokens) == "string" then -- bytes are tokens 0..255: pack 4096 at a time
    local n = #tokens
    parts = {MAGIC, string.pack("<I4I4I8", 1, width, n)}
    local full = "<" .. fmt1:rep(4096)
    for i = 1, n, 4096 do
      local j = math.min(n, i + 4095)
      local f = j - i + 1 == 4096 and full or ("<" .. fmt1:rep(j - i + 1))
      parts[#parts + 1] = string.pack(f, tokens:byte(i, j))
    end
  else
    local ids = type(tokens) == "table" and tokens or tokens:reshape(-1):totable()
    local limit = width == 2 and 65535 or 4294967295
    parts = {MAGIC, string.pack("<I4I4I8", 1, width, #ids)}
    local chunk = {}
    for i, v in ipairs(ids) do
      if math.type(v) ~= "integer" or v < 0 or v > limit then
        error(string.format("write_shard: token %d is %s, outside 0..%d for width %d", i, tostring(v), limit, width), 2)
      end
      chunk[#chunk + 1] = string.pack("<" .. fmt1, v)
      if #chunk == 65536 then parts[#parts + 1] = table.concat(chunk); chunk = {} end
    end
    parts[#parts + 1] = table.concat(chunk)
  end
  local ok, err = util.atomic_write(path, table.concat(parts))
  if not ok then error("write_shard: " .. path .. ": " .. err, 2) end
end

--- Open a shard: {path, width, count}; nil, msg for a missing file; raises on a malformed one.
-- The header's u64 count is checked against the file size without multiplying first (a count
-- near 2^64 / width would wrap count * width round to a small number).
function data.open_shard(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local head = f:read(HEADER) or ""
  local size = f:seek("end")
  f:close()
  if #head < HEADER or head:sub(1, 8) ~= MAGIC or not size then
    error(string.format("shard %s: not an NVLTOK shard (bad magic or shorter than %d bytes)", path, HEADER), 2)
  end
  local version, width, count = string.unpack("<I4I4I8", head, 9) -- count >= 2^63 unpacks negative
  if version ~= 1 then error(string.format("shard %s: unsupported version %d (expected 1)", path, version), 2) end
  if width ~= 2 and width ~= 4 then error(string.format("shard %s: token width %d (expected 2 or 4)", path, width), 2) end
  local data_bytes = size - HEADER
  if count < 0 or count > data_bytes // width or count * width ~= data_bytes then
    error(string.format("shard %s: header says %s tokens of %d bytes but the file has %d data bytes", path,
      string.format("%u", count), width, data_bytes), 2)
  end
  return {path = path, width = width, count = count}
end

--- Tokens [start, start+n) of a shard (0-based start) as an i64 tensor, read from the file.
function data.read_tokens(shard, start, n)
  if math.type(start) ~= "integer" or math.type(n) ~= "integer" or start < 0 or n < 0 or n > shard.count - start then
    local range = (math.type(start) == "integer" and math.type(n) == "integer")
      and string.format("[%d, %d)", start, start + n) or string.format("start %s, n %s", tostring(start), tostring(n))
    error(string.format("read_tokens: %s outside the %d tokens of %s", range, shard.count, shard.path), 2)
  end
  local f = assert(io.open(shard.path, "rb"))
  f:seek("set", HEADER + start * shard.width)
  local bytes = f:read(n * shard.width) or ""
  f:close()
  return core.tokens_from_bytes(bytes, shard.width, n)
end

-- ---- corpora --------------------------------------------------------------------------------

local function mkdir_p(path)
  local acc = path:sub(1, 1) == "/" and "" or "."
  for part in path:gmatch("[^/]+") do
    acc = acc .. "/" .. part
    if not lfs.attributes(acc) then
      local ok, err = lfs.mkdir(acc)
      if not ok and not lfs.attributes(acc) then error("mkdir " .. acc .. ": " .. tostring(err), 3) end
    end
  end
end
data.mkdir_p = mkdir_p

-- Split text into train / validation shards (the last val_fraction of the bytes, cut at a
-- line break) under dir; returns the dataset table.
local function byte_corpus(name, text, dir, val_fraction)
  mkdir_p(dir)
  local train_path, val_path = dir .. "/train.bin", dir .. "/val.bin"
  if not (lfs.attributes(train_path) and lfs.attributes(val_path)) then
    local cut = math.floor(#text * (1 - val_fraction))
    cut = text:find("\n", cut, true) or cut
    data.write_shard(train_path, text:sub(1, cut), 2)
    data.write_shard(val_path, text:sub(cut + 1), 2)
  end
  return {name = name, train = {data.open_shard(train_path)}, val = {data.open_shard(val_path)},
    vocab_size = 256, tokenizer = data.ByteTokenizer}
end

local function default_cache()
  return os.getenv("NVLUA_CACHE") or ((os.getenv("HOME") or ".") .. "/.cache/nvlua")
end
data.default_cache = default_cache

--- The built-in corpus: the King James Bible from Debian's bible-kjv package (`bible -f
-- gen1:1-rev22:21`, verse references stripped), byte tokens, the last 5% for validation.
-- Prepared once into <cache>/kjv/ (cache default: $NVLUA_CACHE or ~/.cache/nvlua).
function data.kjv(opts)
  opts = opts or {}
  local dir = (opts.cache or default_cache()) .. "/kjv"
  if lfs.attributes(dir .. "/train.bin") and lfs.attributes(dir .. "/val.bin") then
    return byte_corpus("kjv", "", dir, 0.05)
  end
  local p = io.popen("bible -f gen1:1-rev22:21 2>/dev/null")
  local raw = p and p:read("a") or ""
  if p then p:close() end
  if #raw < 1000000 then
    error("kjv: the `bible` program gave no text; install Debian's bible-kjv (scripts/setup.sh does)", 2)
  end
  local lines = {}
  for line in raw:gmatch("[^\n]+") do lines[#lines + 1] = (line:gsub("^%S+%d+:%d+ ", "")) end
  return byte_corpus("kjv", table.concat(lines, "\n") .. "\n", dir, 0.05)
end

--- The files under path (itself if a file), walked recursively in sorted order.
function data.list_files(path)
  local files = {}
  local function walk(p)
    local a = lfs.attributes(p)
    if not a then error("no such file or directory: " .. tostring(p), 3) end
    if a.mode == "directory" then
      local names = {}
      for n in lfs.dir(p) do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
      table.sort(names)
      for _, n in ipairs(names) do walk(p .. "/" .. n) end
    elseif a.mode == "file" then
      files[#files + 1] = p
    end
  end
  walk(path)
  return files
end

--- Any text file or directory of text files (walked recursively, sorted), byte tokens, the
-- last 5% for validation; cached under <cache>/text-<hash>/.
function data.text(path, opts)
  opts = opts or {}
  local attr = lfs.attributes(path)
  if not attr then error("text: no such file or directory: " .. tostring(path), 2) end
  local files = data.list_files(path)
  if #files == 0 then error("text: no files under " .. path, 2) end
  local parts = {}
  for _, f in ipairs(files) do
    local h = assert(io.open(f, "rb"))
    parts[#parts + 1] = h:read("a")
    h:close()
  end
  local text = table.concat(parts, "\n")
  if #text < 1024 then error("text: only " .. #text .. " bytes under " .. path .. "; need at least 1 KiB", 2) end
  -- the cache key hashes every byte (8 at a time: ~0.1 s for the 4 MB KJV): a key from a sample
  -- of the bytes would hand an edited corpus of the same length the old one's shards
  local h, n8 = -3750763034362895579, #text - #text % 8 -- FNV-1a's 64-bit basis and prime
  for i = 1, n8, 8 do h = (h ~ string.unpack("<i8", text, i)) * 1099511628211 end
  for i = n8 + 1, #text do h = (h ~ text:byte(i)) * 1099511628211 end
  local dir = string.format("%s/text-%016x-%d", opts.cache or default_cache(), h, #text)
  return byte_corpus(path, text, dir, opts.val_fraction or 0.05)
end

--- Pre-tokenized shards: a directory holding train*.bin and val*.bin (or a table
-- {train = {paths}, val = {paths}}); vocab_size from opts or the largest width.
function data.shards(where, opts)
  opts = opts or {}
  local train, val = {}, {}
  if type(where) == "table" then
    for _, p in ipairs(where.train or {}) do train[#train + 1] = assert(data.open_shard(p)) end
    for _, p in ipairs(where.val or {}) do val[#val + 1] = assert(data.open_shard(p)) end
  else
    if not lfs.attributes(where) then error("shards: no such directory: " .. tostring(where), 2) end
    local names = {}
    for n in lfs.dir(where) do if n:match("%.bin$") then names[#names + 1] = n end end
    table.sort(names)
    for _, n in ipairs(names) do
      local s = assert(data.open_shard(where .. "/" .. n))
      if n:match("^val") then val[#val + 1] = s else train[#train + 1] = s end
    end
  end
  if #train == 0 or #val == 0 then error("shards: need train*.bin and val*.bin shards in " .. tostring(where), 2) end
  return {name = tostring(where), train = train, val = val, vocab_size = opts.vocab_size, tokenizer = opts.tokenizer}
end

-- ---- loader ---------------------------------------------------------------------------------

local Loader = {}
Loader.__index = Loader

--- data.Loader(shards, {batch = B, seq = T, seed = s, rank = 0, world = 1, shuffle = true})
-- The shards' tokens, concatenated, are cut into windows of T+1 tokens at stride T. Each epoch
-- visits every window once in a Philox-driven permutation of (seed, epoch); global batch g
-- takes windows g*B*world + rank*B + (0..B-1) of that order, so ranks see disjoint data and a
-- restored cursor replays exactly the batches an uninterrupted run would have seen.
function data.Loader(shards, o)
  local self = setmetatable({shards = shards, B = o.batch, T = o.seq, seed = o.seed or 0, rank = o.rank or 0,
    world = o.world or 1, shuffle = o.shuffle ~= false, cursor = 0}, Loader)
  if math.type(self.B) ~= "integer" or self.B < 1 or math.type(self.T) ~= "integer" or self.T < 1 then
    error("Loader: batch and seq must be positive integers", 2)
  end
  local total = 0
  self.starts = {}
  for i, s in ipairs(shards) do self.starts[i] = total; total = total + s.count end
  self.total = total
  self.windows = (total - 1) // self.T
  if self.windows < self.B * self.world then
    error(string.format("Loader: %d tokens make only %d windows of %d+1; a batch needs %d", total, self.windows, self.T,
      self.B * self.world), 2)
  end
  self.per_epoch = self.windows // (self.B * self.world) -- batches per epoch (the remainder is dropped)
  return self
end

-- Fisher-Yates over 1..n from Philox(seed, epoch).
local function permutation(n, seed, epoch)
  local p = {}
  for i = 1, n do p[i] = i end
  local k0, k1 = seed & 0xffffffff, (seed >> 32) & 0xffffffff
  local words, w = {}, 5
  local ctr = 0
  for i = n, 2, -1 do
    if w > 4 then
      words = {core.philox(ctr & 0xffffffff, epoch & 0xffffffff, (epoch >> 32) & 0xffffffff, 0, k0, k1)}
      ctr = ctr + 1
      w = 1
    end
    local j = 1 + words[w] % i
    w = w + 1
    p[i], p[j] = p[j], p[i]
  end
  return p
end

function Loader:order(epoch)
  if self.epoch_cached ~= epoch then
    self.perm = self.shuffle and permutation(self.windows, self.seed, epoch) or nil
    self.epoch_cached = epoch
  end
  return self.perm
end

-- Tokens [g, g+n) of the concatenated stream.
function Loader:range(g, n)
  local out = core.empty({n}, "i64")
  local filled = 0
  for i, s in ipairs(self.shards) do
    local a, b = self.starts[i], self.starts[i] + s.count
    if g + filled < b and g + n > a then
      local from = math.max(g + filled, a)
      local len = math.min(g + n, b) - from
      out:narrow(1, filled + 1, len):copy_(data.read_tokens(s, from - a, len))
      filled = filled + len
      if filled == n then break end
    end
  end
  return out
end

--- The next batch: inputs, targets (i64 [B, T]; targets are inputs shifted by one).
function Loader:next()
  local g = self.cursor
  local epoch, within = g // self.per_epoch, g % self.per_epoch
  local perm = self:order(epoch)
  local buf = core.empty({self.B, self.T + 1}, "i64")
  for j = 0, self.B - 1 do
    local w = within * self.B * self.world + self.rank * self.B + j + 1
    local win = perm and perm[w] or w
    buf:select(1, j + 1):copy_(self:range((win - 1) * self.T, self.T + 1))
  end
  self.cursor = g + 1
  local x = buf:narrow(2, 1, self.T):contiguous()
  local y = buf:narrow(2, 2, self.T):contiguous()
  buf:free()
  return x, y, epoch
end

--- Loader state for checkpoints, and its restore.
function Loader:state() return {cursor = self.cursor, seed = self.seed} end
function Loader:load_state(s)
  if s.seed ~= self.seed then
    error(string.format("Loader:load_state: the checkpoint's data seed %d differs from this run's %d", s.seed, self.seed), 2)
  end
  self.cursor = s.cursor
end

return data
