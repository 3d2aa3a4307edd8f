-- nvlua.data: training data — a byte-level tokenizer, the shard file format, corpora (the
-- built-in King James Bible, any text files, pre-tokenized shards with their manifest and
-- tokenizer, Megatron-LM indexed datasets) and a deterministic, resumable, rank-sharded batch
-- loader. Tokenizer files themselves: nvlua.tokenizer.
--
-- Shard format "NVLTOK" version 1 (little-endian), for pre-tokenized corpora:
--   bytes 0..7   magic "NVLTOK\0\0"
--   bytes 8..11  u32 version = 1
--   bytes 12..15 u32 token width in bytes: 2 (u16 ids, vocab <= 65536) or 4 (u32)
--   bytes 16..23 u64 token count n
--   bytes 24..   n tokens, each `width` bytes, little-endian unsigned
-- scripts/prepare_data.py tokenizes text or JSONL with any tokenizer.json (or a tiktoken encoding)
-- into shards plus tokenizer.json and manifest.json (below); scripts/make_shards.lua does bytes;
-- any tokenizer can write the format (e.g. numpy: header + ids.astype('<u2').tobytes()).
local core = require "nvlua.core"
local lfs = require "lfs"
local cjson = require "cjson"
local util = require "nvlua.util"
local user_error = util.user_error
local tokenizer = require "nvlua.tokenizer"

local data = {}

local MAGIC = "NVLTOK\0\0"
local HEADER = 24

-- ---- tokenizer ------------------------------------------------------------------------------

--- The byte-level tokenizer: token id = byte value, vocabulary 256, no bos / eos; the methods of
-- nvlua.tokenizer's tokenizers (colon calls).
data.ByteTokenizer = {vocab_size = 256, name = "bytes"}
--- ByteTokenizer:encode(s [, {add_special_tokens =, tensor =}]) -> the bytes of s as a table of ids, or a 1-D
-- i64 tensor with tensor = true (there are no special tokens to add)
function data.ByteTokenizer:encode(s, o)
  o = util.check_opts(o, tokenizer.ENCODE_OPTS, "ByteTokenizer:encode")
  if type(s) ~= "string" then error("ByteTokenizer:encode: text must be a string, got " .. type(s), 2) end
  local t = core.tokens_from_bytes(s, 1, #s)
  if o.tensor then return t end
  return t:totable()
end
--- ByteTokenizer:decode(ids) -> string: ids a table of integers or a 1-D i64 tensor
function data.ByteTokenizer:decode(ids)
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
  if not ok then user_error("write_shard: " .. path .. ": " .. err, 2) end
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
    user_error(string.format("shard %s: not an NVLTOK shard (bad magic or shorter than %d bytes)", path, HEADER), 2)
  end
  local version, width, count = string.unpack("<I4I4I8", head, 9) -- count >= 2^63 unpacks negative
  if version ~= 1 then user_error(string.format("shard %s: unsupported version %d (expected 1)", path, version), 2) end
  if width ~= 2 and width ~= 4 then user_error(string.format("shard %s: token width %d (expected 2 or 4)", path, width), 2) end
  local data_bytes = size - HEADER
  if count < 0 or count > data_bytes // width or count * width ~= data_bytes then
    user_error(string.format("shard %s: header says %s tokens of %d bytes but the file has %d data bytes", path,
      string.format("%u", count), width, data_bytes), 2)
  end
  return {path = path, width = width, count = count}
end

--- Tokens [start, start+n) of a shard (0-based start) as an i64 tensor, read from the file. A shard
-- is {path, width, count [, offset]}: count tokens of width bytes (1, 2, 4: unsigned; 8: signed)
-- from byte offset (default: after the NVLTOK header) on; data.megatron's splits are such shards.
function data.read_tokens(shard, start, n)
  if math.type(start) ~= "integer" or math.type(n) ~= "integer" or start < 0 or n < 0 or n > shard.count - start then
    local range = (math.type(start) == "integer" and math.type(n) == "integer")
      and string.format("[%d, %d)", start, start + n) or string.format("start %s, n %s", tostring(start), tostring(n))
    user_error(string.format("read_tokens: %s outside the %d tokens of %s", range, shard.count, shard.path), 2)
  end
  local f, err = io.open(shard.path, "rb")
  if not f then user_error("read_tokens: cannot open " .. shard.path .. ": " .. tostring(err), 2) end
  f:seek("set", (shard.offset or HEADER) + start * shard.width)
  local bytes = f:read(n * shard.width) or ""
  f:close()
  if #bytes ~= n * shard.width then
    user_error(string.format("read_tokens: %s ends before token %d (was it truncated after it was opened?)", shard.path,
      start + n), 2)
  end
  if shard.width == 8 then return core.from_bytes(bytes, "i64", {n}) end
  return core.tokens_from_bytes(bytes, shard.width, n)
end

-- ---- token ranges: every id checked against the vocabulary when a dataset is opened ----------
-- A token file whose ids do not fit the vocabulary (another tokenizer's data, a wrong vocab=, bytes
-- of something else) would fail only when a window holding such an id is drawn, possibly hours in.
-- data.shards and data.megatron therefore find the smallest and largest id of every file (of every
-- split of a Megatron .bin) when they open it: core.token_range, one sequential read of the file in
-- C (core/tokens.c: a vectorised min/max per 4 MiB block; measured 4 GB/s from the page cache on a
-- 2-core Xeon, 0.1 s for 200M u16 ids, so a file costs the disk's time to read it once), never a Lua
-- loop over the ids; a second pass, to name the first offending token, only when one is out. The result is
-- cached, so a reopen reads nothing but the cache: nvlua_token_ranges.json in the file's directory
--   {"format": "nvlua-token-ranges", "version": 1,
--    "files": {"<file name>": {"stamp": core.file_stamp, "ranges": {"<offset>+<count>x<width><u|s>":
--    ["<min>", "<max>"]}}}}   (ids as decimal text: JSON numbers are doubles)
-- or, where that directory cannot be written (a read-only dataset), <cache>/token_ranges/<hash of the
-- directory>.json. An entry counts only while the file's stamp (device, inode, size, mtime and ctime
-- in ns) is unchanged: a rewritten or replaced file is scanned again. A cache that cannot be read is
-- ignored and rewritten; one that cannot be written costs the next open a scan, nothing else.
-- (Ranks that open a dataset together scan it together the first time; their writes are atomic.)

local RANGES_FILE = "nvlua_token_ranges.json"

--- data.scan_stats: {scanned = files' ranges read by core.token_range, cached = taken from a cache}
data.scan_stats = {scanned = 0, cached = 0}

local function split_path(path)
  local dir, base = path:match("^(.*)/([^/]*)$")
  if not dir then return ".", path end
  return dir == "" and "/" or dir, base
end

local function fnv64(s)
  local h = -3750763034362895579
  for i = 1, #s do h = (h ~ s:byte(i)) * 1099511628211 end
  return string.format("%016x", h)
end

-- where a directory's ranges are cached: beside its files, then under the user cache
local function ranges_paths(dir, cache)
  local abs = dir:sub(1, 1) == "/" and dir or (lfs.currentdir() .. "/" .. dir)
  return {dir .. "/" .. RANGES_FILE, (cache or data.default_cache()) .. "/token_ranges/" .. fnv64(abs) .. ".json"}
end

local function read_ranges(paths)
  for _, p in ipairs(paths) do
    local f = io.open(p, "rb")
    if f then
      local text = f:read("a") or ""
      f:close()
      local ok, t = pcall(cjson.decode, text)
      if ok and type(t) == "table" and t.format == "nvlua-token-ranges" and t.version == 1 and
        type(t.files) == "table" then
        return t
      end
    end
  end
  return {format = "nvlua-token-ranges", version = 1, files = {}}
end

local function write_ranges(paths, t)
  local text = cjson.encode(t) .. "\n"
  if util.atomic_write(paths[1], text) then return end
  pcall(data.mkdir_p, paths[2]:match("^(.*)/[^/]*$"))
  util.atomic_write(paths[2], text) -- a failure here only costs the next open a scan
end

-- ids of width 8 are signed (data.read_tokens reads them so); Megatron's int32 too (shard.signed)
local function signed(s) return s.signed or s.width == 8 end

local function range_key(s)
  return string.format("%d+%dx%d%s", s.offset or HEADER, s.count, s.width, signed(s) and "s" or "u")
end

local function cached_id(v) return type(v) == "string" and v:match("^%-?%d+$") and math.tointeger(tonumber(v)) or nil end

--- data.token_ranges(shards [, {cache =}]): sets shard.min_id and shard.max_id of each shard
-- ({path, width, count [, offset, signed]}, as data.read_tokens takes them; count 0: nil), from
-- the cache when the file is unchanged, else by core.token_range (see above). -> shards
function data.token_ranges(shards, o)
  local by_dir, dirs = {}, {}
  for _, s in ipairs(shards) do
    local dir = split_path(s.path)
    if not by_dir[dir] then by_dir[dir] = {}; dirs[#dirs + 1] = dir end
    table.insert(by_dir[dir], s)
  end
  for _, dir in ipairs(dirs) do
    local paths = ranges_paths(dir, o and o.cache)
    local t = read_ranges(paths)
    local changed = false
    for _, s in ipairs(by_dir[dir]) do
      if s.count > 0 then
        local _, base = split_path(s.path)
        local stamp = core.file_stamp(s.path)
        local e = type(t.files[base]) == "table" and t.files[base] or nil
        if not e or e.stamp ~= stamp or type(e.ranges) ~= "table" then
          e = {stamp = stamp, ranges = {}}
          t.files[base] = e
        end
        local key = range_key(s)
        local r = type(e.ranges[key]) == "table" and e.ranges[key] or {}
        local lo, hi = cached_id(r[1]), cached_id(r[2])
        if lo and hi and stamp then
          data.scan_stats.cached = data.scan_stats.cached + 1
        else
          lo, hi = core.token_range(s.path, s.offset or HEADER, s.width, signed(s), s.count)
          data.scan_stats.scanned = data.scan_stats.scanned + 1
          e.ranges[key] = {string.format("%d", lo), string.format("%d", hi)}
          changed = true
        end
        s.min_id, s.max_id = lo, hi
      end
    end
    if changed then write_ranges(paths, t) end
  end
  return shards
end

--- data.check_vocab(shards, vocab, what): every id of the shards (data.token_ranges done) in
-- [0, vocab); else raises "<file>: token <i> is <id>, outside the vocabulary ..." naming the first
-- such token (its index in the file) and what: where the vocabulary comes from.
function data.check_vocab(shards, vocab, what)
  for _, s in ipairs(shards) do
    if s.min_id and (s.min_id < 0 or s.max_id >= vocab) then
      local offset = s.offset or HEADER
      local i, id = core.token_find_outside(s.path, offset, s.width, signed(s), s.count, 0, vocab - 1)
      if not i then -- the file changed since its range was taken
        user_error(string.format("data %s: changed while it was being checked (its ids ran from %d to %d); open it again",
          s.path, s.min_id, s.max_id), 0)
      end
      local first = s.offset and s.offset // s.width or 0 -- a split's first token in the file (a Megatron .bin)
      user_error(string.format("data %s: token %d is %d, outside the vocabulary of %d ids (0..%d, %s); its ids run " ..
        "from %d to %d: was it made with another tokenizer?", s.path, first + i, id, vocab, vocab - 1, what, s.min_id,
        s.max_id), 0)
    end
  end
end

-- ---- corpora --------------------------------------------------------------------------------

local function mkdir_p(path)
  local acc = path:sub(1, 1) == "/" and "" or "."
  for part in path:gmatch("[^/]+") do
    acc = acc .. "/" .. part
    if not lfs.attributes(acc) then
      local ok, err = lfs.mkdir(acc)
      if not ok and not lfs.attributes(acc) then user_error("mkdir " .. acc .. ": " .. tostring(err), 3) end
    end
  end
end
data.mkdir_p = mkdir_p

-- Split text into train / validation shards (the last val_fraction of the bytes, cut at a
-- line break) under dir; returns the dataset table.
local encode_text -- below: text -> tok's ids, in pieces

-- text split at the first line break after (1 - val_fraction) of it, the parts written once as
-- train.bin and val.bin under dir: byte tokens (width 2), or with tok their ids by tok (encode_text,
-- `piece` bytes at a time; width 2 for vocabularies up to 65536, else 4, and the sample prompt: bos and
-- "And " encoded) -> the corpus
local function text_corpus(name, text, dir, val_fraction, tok, piece)
  mkdir_p(dir)
  local train_path, val_path = dir .. "/train.bin", dir .. "/val.bin"
  if not (lfs.attributes(train_path) and lfs.attributes(val_path)) then
    local cut = math.floor(#text * (1 - val_fraction))
    cut = text:find("\n", cut, true) or cut
    local function ids(s) return tok and encode_text(tok, s, name, piece) or s end
    local width = tok and tok.vocab_size > 65536 and 4 or 2
    data.write_shard(train_path, ids(text:sub(1, cut)), width)
    data.write_shard(val_path, ids(text:sub(cut + 1)), width)
  end
  local c = {name = name, train = {data.open_shard(train_path)}, val = {data.open_shard(val_path)},
    vocab_size = tok and tok.vocab_size or 256, tokenizer = tok or data.ByteTokenizer}
  if tok then
    local ids = tok:encode("And ")
    if tok.bos_id then table.insert(ids, 1, tok.bos_id) end
    tok.prompt = {text = "And ", ids = ids}
    c.vocab_source = "the tokenizer " .. tok.path
  end
  return c
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
    return text_corpus("kjv", "", dir, 0.05)
  end
  local p = io.popen("bible -f gen1:1-rev22:21 2>/dev/null")
  local raw = p and p:read("a") or ""
  if p then p:close() end
  if #raw < 1000000 then
    user_error("kjv: the `bible` program gave no text; install Debian's bible-kjv (scripts/setup.sh does)", 2)
  end
  local lines = {}
  for line in raw:gmatch("[^\n]+") do lines[#lines + 1] = (line:gsub("^%S+%d+:%d+ ", "")) end
  return text_corpus("kjv", table.concat(lines, "\n") .. "\n", dir, 0.05)
end

--- The files under path (itself if a file), walked recursively in sorted order.
function data.list_files(path)
  local files = {}
  local function walk(p)
    local a = lfs.attributes(p)
    if not a then user_error("no such file or directory: " .. tostring(p), 3) end
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

-- text's ids by tok, encoded in pieces of about 1 MiB cut at a line break followed by a character that is
-- not white space (where the byte-level pre-tokenizers' regexes split anyway, so the ids are those of one
-- encode; a SentencePiece-style Prepend normalizer sees each piece as a text's start) -> an i64 tensor.
-- Memory: the text, the ids, and one piece's ids as a Lua table. Progress on stderr past 16 MiB.
local ENCODE_PIECE = 1 << 20
function encode_text(tok, text, what, piece)
  piece = piece or ENCODE_PIECE
  local parts, at, n, next_report = {}, 1, #text, 0.1
  while at <= n do
    local stop = n
    if n - at + 1 > piece then stop = text:find("\n[^%s]", at + piece) or n end
    parts[#parts + 1] = tok:encode(text:sub(at, stop), {tensor = true})
    at = stop + 1
    if n > 16 * ENCODE_PIECE and (at - 1) / n >= next_report then
      io.stderr:write(string.format("data: encoding %s with %s: %d%%\n", what, tok.name, math.floor(100 * (at - 1) / n)))
      next_report = next_report + 0.1
    end
  end
  local total = 0
  for _, t in ipairs(parts) do total = total + t:numel() end
  local out = core.empty({total}, "i64")
  local off = 0
  for _, t in ipairs(parts) do
    if t:numel() > 0 then out:narrow(1, off + 1, t:numel()):copy_(t) end
    off = off + t:numel()
  end
  return out
end

--- Any text file or directory of text files (walked recursively, sorted), the last 5% for validation;
-- byte tokens, or with opts.tokenizer (a tokenizer.json path or a directory holding one, or a loaded
-- tokenizer) that tokenizer's ids, encoded now (no preparation step; opts.piece: the bytes encoded at a
-- time, 1 MiB); cached under <cache>/text-<hash>[-tok-<tokenizer hash>]/.
function data.text(path, opts)
  opts = opts or {}
  local attr = lfs.attributes(path)
  if not attr then user_error("text: no such file or directory: " .. tostring(path), 2) end
  local files = data.list_files(path)
  if #files == 0 then user_error("text: no files under " .. path, 2) end
  local parts = {}
  for _, f in ipairs(files) do
    local h = assert(io.open(f, "rb"))
    parts[#parts + 1] = h:read("a")
    h:close()
  end
  local text = table.concat(parts, "\n")
  if #text < 1024 then user_error("text: only " .. #text .. " bytes under " .. path .. "; need at least 1 KiB", 2) end
  -- the cache key hashes every byte (8 at a time: ~0.1 s for the 4 MB KJV): a key from a sample
  -- of the bytes would hand an edited corpus of the same length the old one's shards
  local function hash(s)
    local h, n8 = -3750763034362895579, #s - #s % 8 -- FNV-1a's 64-bit basis and prime
    for i = 1, n8, 8 do h = (h ~ string.unpack("<i8", s, i)) * 1099511628211 end
    for i = n8 + 1, #s do h = (h ~ s:byte(i)) * 1099511628211 end
    return h
  end
  local dir = string.format("%s/text-%016x-%d", opts.cache or default_cache(), hash(text), #text)
  local tok = opts.tokenizer
  if tok then
    if type(tok) == "string" then tok = tokenizer.load(tok) end
    -- the tokenizer's file is part of the key: another tokenizer, other shards
    dir = string.format("%s-tok-%016x", dir, hash(tok.text or tokenizer.byte_json()))
    return text_corpus(path, text, dir, opts.val_fraction or 0.05, tok, opts.piece)
  end
  return text_corpus(path, text, dir, opts.val_fraction or 0.05)
end

-- ---- manifests and tokenizers ------------------------------------------------------------------
-- A data directory (shards, or the directory of a Megatron prefix) may hold manifest.json, written by
-- scripts/prepare_data.py (and scripts/make_shards.lua for byte shards):
--   {"format": "nvlua-data", "version": 1, "tokenizer": "bytes" | "<file in the directory>",
--    "vocab_size": N, "bos_token": s|null, "bos_token_id": i|null, "eos_token": s|null, "eos_token_id": i|null,
--    "prompt": {"text": s, "ids": [...]} (the sample prompt, tokenized), ... (counts, sources: not read)}
-- It gives the run its vocabulary (vocab=0) and tokenizer (exported with every checkpoint).

local function manifest_fail(path, fmt, ...) user_error(string.format("manifest %s: " .. fmt, path, ...), 0) end

local function opt_int(path, m, key, lo, hi)
  local v = m[key]
  if v == nil or v == cjson.null then return nil end
  local i = type(v) == "number" and math.tointeger(v)
  if not i or i < lo or (hi and i >= hi) then
    manifest_fail(path, "%s must be an integer in [%d, %s), got %s", key, lo, hi and tostring(hi) or "inf", tostring(v))
  end
  return i
end

--- data.read_manifest(dir) -> the manifest of a data directory (fields checked), or nil when it has
-- none. Raises "manifest <path>: ..." on a malformed one.
function data.read_manifest(dir)
  local path = dir .. "/manifest.json"
  local f = io.open(path, "rb")
  if not f then return nil end
  local text = f:read("a") or ""
  f:close()
  local ok, m = pcall(cjson.decode, text)
  if not ok or type(m) ~= "table" or #m > 0 then manifest_fail(path, "not a JSON object (%s)", tostring(m)) end
  if m.format ~= "nvlua-data" or m.version ~= 1 then
    manifest_fail(path, "format %s version %s (expected nvlua-data, version 1)", tostring(m.format),
      tostring(m.version))
  end
  if type(m.tokenizer) ~= "string" or m.tokenizer == "" then
    manifest_fail(path, 'tokenizer must be "bytes" or the name of a tokenizer.json in %s, got %s', dir,
      tostring(m.tokenizer))
  end
  local out = {path = path, tokenizer = m.tokenizer}
  out.vocab_size = opt_int(path, m, "vocab_size", 1, 1 << 31)
  if not out.vocab_size then manifest_fail(path, "vocab_size is missing") end
  for _, k in ipairs({"bos", "eos"}) do
    out[k .. "_token_id"] = opt_int(path, m, k .. "_token_id", 0, out.vocab_size)
    local name = m[k .. "_token"]
    if name ~= nil and name ~= cjson.null and type(name) ~= "string" then
      manifest_fail(path, "%s_token must be a string or null, got %s", k, tostring(name))
    end
    out[k .. "_token"] = type(name) == "string" and name or nil
  end
  local p = m.prompt
  if p ~= nil and p ~= cjson.null then
    if type(p) ~= "table" or type(p.text) ~= "string" or type(p.ids) ~= "table" then
      manifest_fail(path, "prompt must be {text = string, ids = [integers]}")
    end
    local ids = {}
    for i, v in ipairs(p.ids) do
      ids[i] = type(v) == "number" and math.tointeger(v)
      if not ids[i] or ids[i] < 0 or ids[i] >= out.vocab_size then
        manifest_fail(path, "prompt.ids[%d] must be an integer in [0, %d), got %s", i, out.vocab_size, tostring(v))
      end
    end
    out.prompt = {text = p.text, ids = ids}
  end
  return out
end

--- data.tokenizer_of(dir, manifest) -> the tokenizer a manifest names (data.ByteTokenizer, or the
-- tokenizer.json in dir, with the manifest's bos/eos and sample prompt), checked against it.
function data.tokenizer_of(dir, m)
  if m.tokenizer == "bytes" then
    if m.vocab_size ~= 256 then manifest_fail(m.path, "vocab_size %d with the byte tokenizer (256)", m.vocab_size) end
    return data.ByteTokenizer
  end
  local tok = tokenizer.load(dir .. "/" .. m.tokenizer, {bos_token = m.bos_token, eos_token = m.eos_token})
  if tok.vocab_size ~= m.vocab_size then
    manifest_fail(m.path, "vocab_size %d, but %s has %d tokens (ids 0..%d)", m.vocab_size, tok.path, tok.vocab_size,
      tok.vocab_size - 1)
  end
  for _, k in ipairs({"bos", "eos"}) do
    if m[k .. "_token_id"] ~= tok[k .. "_id"] then
      manifest_fail(m.path, "%s_token_id %s, but %s gives %s the id %s", k, tostring(m[k .. "_token_id"]), tok.path,
        tostring(tok[k .. "_token"]), tostring(tok[k .. "_id"]))
    end
  end
  if m.prompt then tok.prompt = m.prompt end
  return tok
end

-- The tokenizer and vocabulary of a data directory: opts.tokenizer (a path) first, else the
-- manifest's, else a tokenizer.json there. -> tokenizer or nil, vocab_size or nil, where the
-- vocabulary comes from (a phrase for messages) or nil
local function tokenizer_for(dir, opts)
  if opts.tokenizer and opts.tokenizer ~= "" then
    if type(opts.tokenizer) == "table" then
      return opts.tokenizer, opts.tokenizer.vocab_size, "the tokenizer " .. tostring(opts.tokenizer.path or
        opts.tokenizer.name)
    end
    local tok = tokenizer.load(opts.tokenizer)
    return tok, tok.vocab_size, "the tokenizer " .. tok.path
  end
  local m = data.read_manifest(dir)
  if m then return data.tokenizer_of(dir, m), m.vocab_size, "vocab_size of " .. m.path end
  if lfs.attributes(dir .. "/tokenizer.json", "mode") == "file" then
    local tok = tokenizer.load(dir .. "/tokenizer.json")
    return tok, tok.vocab_size, "the tokenizer " .. tok.path
  end
  return nil, nil, nil
end

-- A dataset's token files against its vocabulary, when it has one (data.token_ranges first):
-- opts.vocab_size, else the tokenizer's or manifest's. -> vocab_size, its source (nil, nil: none)
local function check_dataset_ids(splits, opts, vocab, source)
  local all = {}
  for _, split in ipairs(splits) do for _, s in ipairs(split) do all[#all + 1] = s end end
  data.token_ranges(all, {cache = opts.cache})
  if opts.vocab_size then vocab, source = opts.vocab_size, "vocab_size " .. opts.vocab_size .. " given" end
  if vocab then data.check_vocab(all, vocab, source) end
  return vocab, source
end

--- Pre-tokenized shards: a directory holding train*.bin and val*.bin (or a table
-- {train = {paths}, val = {paths}}). The tokenizer and the vocabulary: opts.tokenizer (a
-- tokenizer.json path or a tokenizer), else the directory's manifest.json, else its tokenizer.json,
-- else none (vocab_size then from opts). Every shard's ids are checked against the vocabulary now
-- (data.token_ranges, cached; opts.cache: where when the directory is read-only).
function data.shards(where, opts)
  opts = opts or {}
  local train, val = {}, {}
  local tok, vocab, source
  if type(where) == "table" then
    for _, p in ipairs(where.train or {}) do train[#train + 1] = assert(data.open_shard(p)) end
    for _, p in ipairs(where.val or {}) do val[#val + 1] = assert(data.open_shard(p)) end
  else
    if not lfs.attributes(where) then user_error("shards: no such directory: " .. tostring(where), 2) end
    local names = {}
    for n in lfs.dir(where) do if n:match("%.bin$") then names[#names + 1] = n end end
    table.sort(names)
    for _, n in ipairs(names) do
      local s = assert(data.open_shard(where .. "/" .. n))
      if n:match("^val") then val[#val + 1] = s else train[#train + 1] = s end
    end
    tok, vocab, source = tokenizer_for(where, opts)
  end
  if #train == 0 or #val == 0 then user_error("shards: need train*.bin and val*.bin shards in " .. tostring(where), 2) end
  vocab, source = check_dataset_ids({train, val}, opts, vocab, source)
  return {name = tostring(where), train = train, val = val, vocab_size = vocab, vocab_source = source,
    tokenizer = tok or (type(opts.tokenizer) == "table" and opts.tokenizer or nil)}
end

-- ---- Megatron-LM indexed datasets ----------------------------------------------------------------
-- The files Megatron-LM's tools/preprocess_data.py writes (megatron/core/datasets/indexed_dataset.py,
-- IndexedDatasetBuilder / _IndexWriter), <prefix>.bin and <prefix>.idx, little-endian:
--   .bin  the token ids of every sequence, back to back, in the index's dtype; no header
--   .idx  bytes 0..8    magic "MMIDIDX\0\0"
--         bytes 9..16   u64 version = 1
--         byte  17      u8 dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
--                       7 float32, 8 uint16 (preprocess_data: uint16 for vocabularies < 65500, else int32)
--         bytes 18..25  u64 S, the number of sequences
--         bytes 26..33  u64 D, the number of document indices (documents + 1)
--         then i32 sequence_lengths[S] (tokens), i64 sequence_pointers[S] (byte offsets into .bin),
--         i64 document_indices[D]: 0, then the sequence index where each document ends (the
--         last = S); document k is sequences [document_indices[k], document_indices[k+1]).
--         (A multimodal index adds i8 sequence_modes[S]: refused.)
-- Read here: token dtypes uint8, uint16, int32, int64 (int8/int16 hold no tokenizer's ids; floats are
-- not ids). Checked: every header field, the file sizes against the counts (overflow-safe), the
-- lengths >= 0, the pointers contiguous from 0 (as the writer makes them; the .bin holds exactly
-- the tokens), the document indices rising from 0 to S. Train/validation: by documents, in order,
-- the last val_fraction of them (at least one; rounded up) held out, as Megatron's --split
-- takes contiguous document ranges; documents are concatenated as they are (preprocess_data's
-- --append-eod puts the eod token between them).

local MEGATRON_MAGIC = "MMIDIDX\0\0"
local MEGATRON_DTYPES = {[1] = {"uint8", 1}, [2] = {"int8"}, [3] = {"int16"}, [4] = {"int32", 4}, [5] = {"int64", 8},
  [6] = {"float64"}, [7] = {"float32"}, [8] = {"uint16", 2}}

local function mfail(path, fmt, ...) user_error(string.format("megatron %s: " .. fmt, path, ...), 0) end

-- the header of an .idx: {dtype, width, S, D}; sizes checked
local function megatron_header(idx, f, size)
  local head = f:read(34) or ""
  if #head < 34 or head:sub(1, 9) ~= MEGATRON_MAGIC then
    mfail(idx, "not a Megatron-LM index (bad magic or shorter than 34 bytes; expected \"MMIDIDX\\0\\0\")")
  end
  local version, code, S, D = string.unpack("<i8I1i8i8", head, 10) -- u64 >= 2^63 unpack negative
  if version ~= 1 then mfail(idx, "unsupported version %s (expected 1)", string.format("%u", version)) end
  local dt = MEGATRON_DTYPES[code]
  if not dt then mfail(idx, "unknown dtype code %d (Megatron's are 1..8)", code) end
  if not dt[2] then
    mfail(idx, "dtype code %d (%s) is not a token type nvlua reads (uint8, uint16, int32, int64)", code, dt[1])
  end
  local rest = size - 34
  if S < 0 or S > rest // 12 or D < 0 or D > (rest - 12 * S) // 8 then
    mfail(idx, "header says %s sequences and %s document indices, but the file has %d bytes after the header",
      string.format("%u", S), string.format("%u", D), rest)
  end
  local extra = rest - 12 * S - 8 * D
  if extra == S and S > 0 then
    mfail(idx, "a multimodal index (%d sequence modes after the document indices): nvlua reads token datasets only", S)
  elseif extra ~= 0 then
    mfail(idx, "%d bytes after the document indices (header: %d sequences, %d document indices)", extra, S, D)
  end
  if D < 1 then mfail(idx, "no document indices (at least the leading 0)") end
  return {dtype = dt[1], width = dt[2], signed = dt[1]:sub(1, 3) == "int", S = S, D = D}
end

-- the document indices (a Lua table, 1-based), checked to rise from 0 to S
local function megatron_documents(idx, f, h)
  f:seek("set", 34 + 12 * h.S)
  local docs, prev = {}, 0
  for i = 1, h.D, 4096 do
    local k = math.min(4096, h.D - i + 1)
    local vals = {string.unpack("<" .. string.rep("i8", k), f:read(8 * k))}
    for j = 1, k do
      local v = vals[j]
      if (i + j == 2 and v ~= 0) or v < prev or v > h.S then
        mfail(idx, "document_indices[%d] = %d: they must rise from 0 to the %d sequences", i + j - 2, v, h.S)
      end
      docs[i + j - 1], prev = v, v
    end
  end
  if prev ~= h.S then mfail(idx, "the last document index is %d, not the number of sequences %d", prev, h.S) end
  return docs
end

-- Walk the sequence lengths and pointers: lengths >= 0, pointers contiguous from 0, within the .bin.
-- -> the total tokens, and the tokens before sequence `at` (0-based)
local function megatron_sequences(idx, f, h, bin_tokens, at)
  local before, total = nil, 0
  for i = 0, h.S - 1, 4096 do
    local k = math.min(4096, h.S - i)
    f:seek("set", 34 + 4 * i)
    local lens = {string.unpack("<" .. string.rep("i4", k), f:read(4 * k))}
    f:seek("set", 34 + 4 * h.S + 8 * i)
    local ptrs = {string.unpack("<" .. string.rep("i8", k), f:read(8 * k))}
    for j = 1, k do
      local s = i + j - 1
      if s == at then before = total end
      if lens[j] < 0 then mfail(idx, "sequence_lengths[%d] = %d is negative", s, lens[j]) end
      if ptrs[j] ~= total * h.width then
        mfail(idx, "sequence_pointers[%d] = %d, but the sequences before it end at byte %d (pointers must be " ..
          "contiguous from 0)", s, ptrs[j], total * h.width)
      end
      total = total + lens[j]
      if total > bin_tokens then
        mfail(idx, "the sequences up to %d hold %d tokens, more than the %d of the .bin", s, total, bin_tokens)
      end
    end
  end
  if at == h.S then before = total end
  return total, before
end

--- data.open_megatron(prefix [, {val_fraction = 0.05}]) -> {prefix, bin, idx, dtype, width,
-- sequences, documents, tokens, train_documents, train = shard, val = shard}: a Megatron-LM indexed
-- dataset, checked (see above; errors "megatron <file>: ..."), split by documents.
function data.open_megatron(prefix, o)
  local frac = (o and o.val_fraction) or 0.05
  local idx, bin = prefix .. ".idx", prefix .. ".bin"
  local f, err = io.open(idx, "rb")
  if not f then user_error("megatron: cannot open " .. idx .. ": " .. tostring(err), 0) end
  local bf, berr = io.open(bin, "rb")
  if not bf then f:close(); user_error("megatron: cannot open " .. bin .. ": " .. tostring(berr), 0) end
  local bin_size = bf:seek("end")
  bf:close()
  local ok, r = pcall(function()
    local size = f:seek("end")
    f:seek("set", 0)
    local h = megatron_header(idx, f, size)
    if bin_size % h.width ~= 0 then mfail(bin, "%d bytes: not a whole number of %d-byte tokens", bin_size, h.width) end
    local docs = megatron_documents(idx, f, h)
    local n_docs = h.D - 1
    local n_val = math.ceil(n_docs * frac - 1e-9)
    if n_val < 1 or n_val >= n_docs then
      mfail(idx, "%d documents: a train/validation split by documents (the last %g of them) needs at least one " ..
        "of each", n_docs, frac)
    end
    local total, split = megatron_sequences(idx, f, h, bin_size // h.width, docs[n_docs - n_val + 1])
    if total * h.width ~= bin_size then
      mfail(bin, "%d bytes, but the index's sequences hold %d tokens of %d bytes", bin_size, total, h.width)
    end
    return {prefix = prefix, bin = bin, idx = idx, dtype = h.dtype, width = h.width, sequences = h.S,
      documents = n_docs, tokens = total, train_documents = n_docs - n_val,
      train = {path = bin, width = h.width, count = split, offset = 0, signed = h.signed},
      val = {path = bin, width = h.width, count = total - split, offset = split * h.width, signed = h.signed}}
  end)
  f:close()
  if not ok then error(r, 0) end
  return r
end

--- data.megatron(prefix [, {vocab_size =, tokenizer =, val_fraction =, cache =}]) -> a dataset: a
-- Megatron-LM indexed dataset (<prefix>.bin, <prefix>.idx), split by documents; the tokenizer and
-- vocabulary as data.shards finds them, in the prefix's directory, and the ids checked against it
-- as data.shards checks them.
function data.megatron(prefix, opts)
  opts = opts or {}
  local m = data.open_megatron(prefix, opts)
  local tok, vocab, source = tokenizer_for(prefix:match("^(.*)/[^/]*$") or ".", opts)
  vocab, source = check_dataset_ids({{m.train}, {m.val}}, opts, vocab, source)
  return {name = "megatron:" .. prefix, train = {m.train}, val = {m.val}, vocab_size = vocab, vocab_source = source,
    tokenizer = tok, megatron = m}
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
    user_error(string.format("Loader: %d tokens make only %d windows of %d+1; a batch needs %d", total, self.windows, self.T,
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
    user_error(string.format("Loader:load_state: the checkpoint's data seed %d differs from this run's %d", s.seed, self.seed), 2)
  end
  self.cursor = s.cursor
end

return data
