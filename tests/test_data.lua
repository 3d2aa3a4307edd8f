-- tests/test_data.lua: training data (lua/nvlua/data.lua) and schedules (lua/nvlua/schedule.lua).
--   * the byte tokenizer round trip;
--   * NVLTOK shards: the header byte for byte, u16 and u32 widths, read_tokens ranges, write
--     errors, and one case per malformed file (bad magic, short, wrong version, bad width, size
--     not matching the header's count, counts whose count * width wraps), each naming the file;
--   * token ids against the vocabulary when shards are opened: one case per way an id can fall outside
--     (= vocab, u16 and u32 maxima, in a validation shard, the manifest's and a tokenizer's
--     vocabulary), each naming the file, the token's index and the id; the ranges cached in
--     nvlua_token_ranges.json (a reopen scans nothing, a rewritten file is scanned again, a damaged
--     cache is rewritten, an unwritable one falls back to the user cache);
--   * data.text: a directory is walked recursively in sorted order, split at a line break;
--   * the Loader, on shards whose token i is i (so a batch shows which windows it took):
--     deterministic per seed, other seeds differ, each epoch visits every window once, targets
--     are inputs shifted by one, windows across shard boundaries, world = 2 ranks take disjoint
--     windows whose union is world = 1's batch of twice the size, a restored cursor continues
--     exactly;
--   * schedules: constant, cosine, wsd, linear at warmup, mid, decay start and end (hand-computed).
local T = require "nvlua.test"
local nv = require "nvlua"
local data = require "nvlua.data"
local schedule = require "nvlua.schedule"
local lfs = require "lfs"

local ROOT = T.tmpdir()

local function range(a, b)
  local t = {}
  for i = a, b do t[#t + 1] = i end
  return t
end

-- ---- tokenizer ---------------------------------------------------------------------------------

T.case("byte tokenizer: ids are the bytes, decode(encode(s)) == s for all 256 bytes", function()
  local tok = data.ByteTokenizer
  T.eq(tok.vocab_size, 256)
  local ids = tok:encode("Hi\0\255", {tensor = true})
  T.eq(ids:dtype(), "i64")
  T.eq(ids:totable(), {72, 105, 0, 255})
  T.eq(tok:encode("Hi\0\255"), {72, 105, 0, 255}, "a table by default")
  local all = {}
  for i = 0, 255 do all[#all + 1] = string.char(i) end
  local s = table.concat(all) .. "In the beginning — é"
  T.eq(tok:decode(tok:encode(s)), s)
  T.eq(tok:decode({65, 66, 10}), "AB\n")
  T.eq(tok:encode("", {tensor = true}):numel(), 0)
  T.eq(tok:encode(""), {})
end)

-- ---- shards ------------------------------------------------------------------------------------

T.case("shards: the header byte for byte, u16 and u32 ids, read_tokens ranges", function()
  local p16, p32 = ROOT .. "/a16.bin", ROOT .. "/a32.bin"
  local ids16 = {0, 1, 255, 256, 65535, 4660, 7}
  data.write_shard(p16, ids16, 2)
  T.eq(assert(T.read_file(p16)),
    "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 2, 7) .. string.pack("<I2I2I2I2I2I2I2", table.unpack(ids16)))
  local ids32 = {0, 65536, 4294967295, 100000, 3}
  data.write_shard(p32, ids32, 4)
  T.eq(#assert(T.read_file(p32)), 24 + 5 * 4)
  T.eq(assert(T.read_file(p32)):sub(9, 24), string.pack("<I4I4I8", 1, 4, 5))
  local s16, s32 = data.open_shard(p16), data.open_shard(p32)
  T.eq({s16.width, s16.count, s16.path}, {2, 7, p16})
  T.eq({s32.width, s32.count}, {4, 5})
  T.eq(data.read_tokens(s16, 0, 7):totable(), ids16)
  T.eq(data.read_tokens(s16, 3, 2):totable(), {256, 65535})
  T.eq(data.read_tokens(s16, 6, 1):totable(), {7})
  T.eq(data.read_tokens(s16, 7, 0):numel(), 0)
  T.eq(data.read_tokens(s32, 0, 5):totable(), ids32)
  T.eq(data.read_tokens(s32, 2, 1):totable(), {4294967295})
  T.raises(function() data.read_tokens(s16, 5, 3) end, "read_tokens: [5, 8) outside the 7 tokens of " .. p16)
  T.raises(function() data.read_tokens(s16, -1, 1) end, p16)
  -- a string is written byte by byte; a tensor too
  data.write_shard(p16, "abc")
  T.eq(data.read_tokens(data.open_shard(p16), 0, 3):totable(), {97, 98, 99})
  data.write_shard(p16, nv.tensor({{5, 6}, {7, 8}}, "i64"))
  T.eq(data.read_tokens(data.open_shard(p16), 0, 4):totable(), {5, 6, 7, 8})
  -- nothing but the shard is left in the directory (atomic writes clean their temp files)
  local names = {}
  for n in lfs.dir(ROOT) do if n:match("^a%d") then names[#names + 1] = n end end
  table.sort(names)
  T.eq(names, {"a16.bin", "a32.bin"})
end)

T.case("shards: write errors (width, ids out of range); a missing file is nil, msg", function()
  local p = ROOT .. "/w.bin"
  T.raises(function() data.write_shard(p, {1, 2}, 3) end, "write_shard: width must be 2 or 4")
  T.raises(function() data.write_shard(p, {1, 65536}, 2) end, "token 2 is 65536, outside 0..65535 for width 2")
  T.raises(function() data.write_shard(p, {-1}, 4) end, "token 1 is -1, outside 0..4294967295 for width 4")
  T.raises(function() data.write_shard(p, {1.5}, 2) end, "token 1 is 1.5")
  T.eq(lfs.attributes(p), nil, "nothing written")
  local s, msg = data.open_shard(ROOT .. "/none.bin")
  T.eq(s, nil)
  T.ok(msg:find("none.bin", 1, true), msg)
end)

T.case("shards: malformed files raise a message naming the file", function()
  local good = "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 2, 3) .. string.pack("<I2I2I2", 1, 2, 3)
  local function bad(name, bytes, text)
    local p = ROOT .. "/" .. name .. ".bin"
    T.write_file(p, bytes)
    local err = T.raises(function() data.open_shard(p) end, text, name)
    T.ok(err:find("shard " .. p, 1, true), name .. ": the message names the file: " .. err)
  end
  T.write_file(ROOT .. "/good.bin", good)
  T.eq(data.open_shard(ROOT .. "/good.bin").count, 3)
  bad("magic", "NVLTOX\0\0" .. good:sub(9), "not an NVLTOK shard")
  bad("short", good:sub(1, 20), "not an NVLTOK shard")
  bad("empty", "", "not an NVLTOK shard")
  bad("version", "NVLTOK\0\0" .. string.pack("<I4I4I8", 2, 2, 3) .. good:sub(25), "unsupported version 2")
  bad("width", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 3, 2) .. good:sub(25), "token width 3 (expected 2 or 4)")
  bad("truncated", good:sub(1, -2), "header says 3 tokens of 2 bytes but the file has 5 data bytes")
  bad("long", good .. "\0\0", "header says 3 tokens of 2 bytes but the file has 8 data bytes")
  bad("count", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 2, 4) .. good:sub(25), "header says 4 tokens")
  bad("hugecount", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 4, 1 << 61) .. good:sub(25), "header says")
  -- issue 13: counts whose count * width wraps round 2^64 to the real data size passed the size check
  local data4 = string.pack("<I2I2", 1, 2) -- 4 data bytes
  bad("wrap4", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 4, (1 << 62) + 1) .. data4,
    "header says 4611686018427387905 tokens of 4 bytes but the file has 4 data bytes")
  bad("wrap2", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 2, (1 << 63) + 2) .. data4,
    "header says 9223372036854775810 tokens of 2 bytes but the file has 4 data bytes")
  bad("maxcount", "NVLTOK\0\0" .. string.pack("<I4I4i8", 1, 2, -1) .. data4, "header says 18446744073709551615 tokens")
  bad("width0", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 0, 2) .. data4, "token width 0 (expected 2 or 4)")
  bad("width8", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 8, 0) .. data4, "token width 8 (expected 2 or 4)")
  bad("widthmax", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 0xffffffff, 0) .. data4, "token width 4294967295")
  bad("version0", "NVLTOK\0\0" .. string.pack("<I4I4I8", 0, 2, 2) .. data4, "unsupported version 0 (expected 1)")
  bad("versionmax", "NVLTOK\0\0" .. string.pack("<I4I4I8", 0xffffffff, 2, 2) .. data4, "unsupported version 4294967295")
  -- the same bytes with the true count are a good shard
  T.write_file(ROOT .. "/wrapgood.bin", "NVLTOK\0\0" .. string.pack("<I4I4I8", 1, 4, 1) .. data4)
  local s1 = data.open_shard(ROOT .. "/wrapgood.bin")
  T.eq(s1.count, 1)
  T.eq(data.read_tokens(s1, 0, 1):totable(), {2 * 65536 + 1})
  -- read_tokens ranges that would wrap, or are not integers
  T.raises(function() data.read_tokens(s1, 1, math.maxinteger) end, "read_tokens: [1, ")
  T.raises(function() data.read_tokens(s1, 0, -1) end, "outside the 1 tokens")
  T.raises(function() data.read_tokens(s1, 0.5, 1) end, "read_tokens: start 0.5, n 1 outside the 1 tokens")
  -- data.shards finds train*/val* shards in a directory and rejects a malformed one
  local d = ROOT .. "/shardset"
  assert(lfs.mkdir(d))
  data.write_shard(d .. "/train_000.bin", range(0, 99), 2)
  data.write_shard(d .. "/train_001.bin", range(100, 149), 2)
  data.write_shard(d .. "/val_000.bin", range(0, 39), 2)
  local ds = data.shards(d, {vocab_size = 150})
  T.eq(#ds.train, 2); T.eq(#ds.val, 1); T.eq(ds.vocab_size, 150)
  T.eq(ds.train[2].path, d .. "/train_001.bin")
  T.write_file(d .. "/train_002.bin", "junk")
  T.raises(function() data.shards(d) end, d .. "/train_002.bin")
  T.raises(function() data.shards(ROOT .. "/nowhere") end, "shards: no such directory")
end)

-- ---- token ids against the vocabulary, when a dataset is opened -------------------------------------

-- a directory of shards: files = {name = {ids, width}}, and manifest (a table) when given
local function shard_dir(name, files, manifest)
  local d = ROOT .. "/" .. name
  assert(lfs.mkdir(d))
  for n, f in pairs(files) do data.write_shard(d .. "/" .. n, f[1], f[2] or 2) end
  if manifest then T.write_file(d .. "/" .. "manifest.json", require("cjson").encode(manifest)) end
  return d
end

local function with_id(ids, i, v) -- a copy of ids with ids[i] = v
  local out = {table.unpack(ids)}
  out[i] = v
  return out
end

local IDS = range(0, 99)
-- {name, files, data.shards options, manifest or nil, the message after "data <dir>/"}
local OUT_OF_VOCAB = {
  {"id = vocab in a second train shard", {["train_000.bin"] = {IDS}, ["train_001.bin"] = {with_id(IDS, 43, 150)},
    ["val_000.bin"] = {{1, 2}}}, {vocab_size = 150}, nil,
    "train_001.bin: token 42 is 150, outside the vocabulary of 150 ids (0..149, vocab_size 150 given); its ids run " ..
    "from 0 to 150: was it made with another tokenizer?"},
  {"the validation shard, first token", {["train_000.bin"] = {IDS}, ["val_000.bin"] = {{65535, 1}}},
    {vocab_size = 1000}, nil, "val_000.bin: token 0 is 65535, outside the vocabulary of 1000 ids (0..999"},
  {"u32 ids: the largest one", {["train_000.bin"] = {with_id(IDS, 100, 4294967295), 4}, ["val_000.bin"] = {{1}, 4}},
    {vocab_size = 70000}, nil, "train_000.bin: token 99 is 4294967295, outside the vocabulary of 70000 ids"},
  {"the manifest's vocabulary", {["train_000.bin"] = {with_id(IDS, 8, 256)}, ["val_000.bin"] = {{1}}}, {},
    {format = "nvlua-data", version = 1, tokenizer = "bytes", vocab_size = 256},
    "train_000.bin: token 7 is 256, outside the vocabulary of 256 ids (0..255, vocab_size of " .. ROOT ..
    "/oov-4/manifest.json)"},
  {"a tokenizer given", {["train_000.bin"] = {IDS}, ["val_000.bin"] = {{3, 300}}},
    {tokenizer = data.ByteTokenizer}, nil,
    "val_000.bin: token 1 is 300, outside the vocabulary of 256 ids (0..255, the tokenizer bytes)"},
}

T.case("token ids: each shard is checked against the vocabulary when opened; the error names file, token, id", function()
  for i, c in ipairs(OUT_OF_VOCAB) do
    local d = shard_dir("oov-" .. i, c[2], c[4])
    local want = "data " .. d .. "/" .. c[5]
    local ok, err = pcall(data.shards, d, c[3])
    T.eq(ok, false, c[1] .. ": opens")
    T.ok(tostring(err):sub(1, #want) == want, c[1] .. ":\n  expected " .. want .. "\n  got      " .. tostring(err))
  end
  -- the largest id in the vocabulary is fine, and the table form of data.shards is checked too
  local d = shard_dir("oov-edge", {["train_000.bin"] = {with_id(IDS, 43, 150)}, ["val_000.bin"] = {{150}}})
  T.eq(#data.shards(d, {vocab_size = 151}).train, 1)
  T.eq(data.shards(d, {vocab_size = 151}).train[1].max_id, 150)
  T.raises(function()
    data.shards({train = {d .. "/train_000.bin"}, val = {d .. "/val_000.bin"}}, {vocab_size = 100})
  end, "data " .. d .. "/train_000.bin: token 42 is 150, outside the vocabulary of 100 ids")
end)

T.case("token ids: the scan is cached beside the shards; a rewritten file is scanned again", function()
  local cjson = require "cjson"
  local d = shard_dir("scan", {["train_000.bin"] = {IDS}, ["train_001.bin"] = {range(5, 54)},
    ["val_000.bin"] = {{7, 9, 8}}})
  local st = data.scan_stats
  local function counts() return {st.scanned, st.cached} end
  local base = counts()
  local function since() return {st.scanned - base[1], st.cached - base[2]} end
  local ds = data.shards(d, {vocab_size = 100})
  T.eq(since(), {3, 0}, "first open: each file scanned once")
  T.eq({ds.train[1].min_id, ds.train[1].max_id, ds.train[2].min_id, ds.train[2].max_id, ds.val[1].min_id,
    ds.val[1].max_id}, {0, 99, 5, 54, 7, 9})
  local cache = cjson.decode(assert(T.read_file(d .. "/nvlua_token_ranges.json")))
  T.eq({cache.format, cache.version}, {"nvlua-token-ranges", 1})
  T.eq(cache.files["train_001.bin"].ranges, {["24+50x2u"] = {"5", "54"}}, "offset 24 (the header), 50 u16 ids")
  base = counts()
  ds = data.shards(d, {vocab_size = 100})
  T.eq(since(), {0, 3}, "a reopen reads the cache, not the files")
  T.eq({ds.train[2].min_id, ds.train[2].max_id}, {5, 54})
  -- the same size, rewritten at once (within the same second): its stamp differs, it is scanned again
  data.write_shard(d .. "/train_001.bin", with_id(range(5, 54), 50, 100), 2)
  base = counts()
  T.raises(function() data.shards(d, {vocab_size = 100}) end,
    "data " .. d .. "/train_001.bin: token 49 is 100, outside the vocabulary of 100 ids")
  T.eq(since(), {1, 2}, "only the rewritten file")
  data.write_shard(d .. "/train_001.bin", range(5, 54), 2)
  -- a damaged cache is ignored and written again
  T.write_file(d .. "/nvlua_token_ranges.json", "{garbage")
  base = counts()
  T.eq(data.shards(d, {vocab_size = 100}).train[2].max_id, 54)
  T.eq(since(), {3, 0})
  T.eq(cjson.decode(assert(T.read_file(d .. "/nvlua_token_ranges.json"))).files["val_000.bin"].ranges,
    {["24+3x2u"] = {"7", "9"}})
  -- a directory where the cache cannot be written (here: its name taken by a directory): the user cache
  local ro = shard_dir("scan-ro", {["train_000.bin"] = {IDS}, ["val_000.bin"] = {{1}}})
  assert(lfs.mkdir(ro .. "/nvlua_token_ranges.json"))
  base = counts()
  data.shards(ro, {vocab_size = 100, cache = ROOT .. "/usercache"})
  data.shards(ro, {vocab_size = 100, cache = ROOT .. "/usercache"})
  T.eq(since(), {2, 2}, "scanned once, then read from <cache>/token_ranges/")
  local names = {}
  for n in lfs.dir(ROOT .. "/usercache/token_ranges") do if n:match("%.json$") then names[#names + 1] = n end end
  T.eq(#names, 1)
end)

-- ---- text corpora ------------------------------------------------------------------------------

T.case("data.text: a directory is walked recursively in sorted order; 95/5 split at a line break", function()
  local d = ROOT .. "/texts"
  for _, sub in ipairs({"", "/b", "/a", "/a/x"}) do assert(lfs.mkdir(d .. sub)) end
  local function lines(tag, n)
    local t = {}
    for i = 1, n do t[i] = string.format("%s line %03d of some text", tag, i) end
    return table.concat(t, "\n") .. "\n"
  end
  local files = {["c.txt"] = lines("c", 10), ["b/z.txt"] = lines("bz", 9), ["a/x/y.txt"] = lines("axy", 11),
    ["a/k.txt"] = lines("ak", 45), ["A.txt"] = lines("A", 8)}
  for name, text in pairs(files) do T.write_file(d .. "/" .. name, text) end
  -- byte order: "A.txt" < "a" (dir: "k.txt" < "x" (dir: "y.txt")) < "b" (dir: "z.txt") < "c.txt"
  local order = {"A.txt", "a/k.txt", "a/x/y.txt", "b/z.txt", "c.txt"}
  local parts = {}
  for i, n in ipairs(order) do parts[i] = files[n] end
  local text = table.concat(parts, "\n")
  local ds = data.text(d, {cache = ROOT .. "/cache"})
  T.eq(ds.vocab_size, 256)
  T.eq(ds.tokenizer, data.ByteTokenizer)
  local tr, va = ds.train[1], ds.val[1]
  local got = data.ByteTokenizer:decode(data.read_tokens(tr, 0, tr.count)) ..
    data.ByteTokenizer:decode(data.read_tokens(va, 0, va.count))
  T.eq(got, text, "the files' text in sorted order, joined by newlines")
  local cut = text:find("\n", math.floor(#text * 0.95), true)
  T.eq(tr.count, cut, "train ends at the first line break after 95%")
  T.eq(text:sub(cut, cut), "\n")
  T.ok(va.count > 0 and va.count < 0.06 * #text)
  T.ok(tr.path:find(ROOT .. "/cache/text-", 1, true) == 1, "cached under the cache directory")
  -- an edit that keeps the length gets its own cache (the key hashes every byte)
  local edited = ROOT .. "/edited.txt"
  local long = text:rep(10) -- 20 KB
  T.write_file(edited, long)
  local e1 = data.text(edited, {cache = ROOT .. "/cache"})
  T.write_file(edited, long:sub(1, 1001) .. "#" .. long:sub(1003))
  local e2 = data.text(edited, {cache = ROOT .. "/cache"})
  T.ok(e1.train[1].path ~= e2.train[1].path, "another cache directory")
  T.eq(data.read_tokens(e2.train[1], 1001, 1):totable(), {35}, "the edited byte")
  -- a single file; errors
  local one = data.text(d .. "/a/k.txt", {cache = ROOT .. "/cache"})
  T.eq(one.train[1].count + one.val[1].count, #files["a/k.txt"])
  T.raises(function() data.text(ROOT .. "/nothing") end, "text: no such file or directory")
  T.write_file(ROOT .. "/tiny.txt", "too short")
  T.raises(function() data.text(ROOT .. "/tiny.txt", {cache = ROOT .. "/cache"}) end, "need at least 1 KiB")
end)

T.case("data.kjv: the King James Bible from bible-kjv, prepared into a cache (skipped without `bible`)", function()
  if not os.execute("command -v bible >/dev/null 2>&1") then T.skip("no `bible` program (Debian bible-kjv)") end
  local cache = ROOT .. "/kjvcache"
  local ds = data.kjv({cache = cache})
  local tr, va = ds.train[1], ds.val[1]
  local n = tr.count + va.count
  T.ok(n > 4000000 and n < 4500000, "about 4.1 MB of text: " .. n)
  T.ok(va.count / n > 0.049 and va.count / n < 0.051, "5% validation")
  local text = data.ByteTokenizer:decode(data.read_tokens(tr, 0, tr.count)) ..
    data.ByteTokenizer:decode(data.read_tokens(va, 0, va.count))
  local first = "In the beginning God created the heaven and the earth.\nAnd the earth was without form"
  T.eq(text:sub(1, #first), first)
  local last = "The grace of our Lord Jesus Christ be with you all. Amen.\n"
  T.eq(text:sub(-#last), last)
  T.eq(text:find("\n%S+%d+:%d+ "), nil, "no verse references left")
  T.eq(text:sub(tr.count, tr.count), "\n", "the split is at a line break")
  local again = data.kjv({cache = cache})
  T.eq({again.train[1].count, again.val[1].count}, {tr.count, va.count}, "the cache is reused")
end)

-- ---- the loader --------------------------------------------------------------------------------

-- a shard whose token i is i (u32), so every window tells where it starts
local function counting_shards(n, split)
  local paths, out, from = {}, {}, 0
  for i, to in ipairs(split or {n}) do
    local p = string.format("%s/count_%d_%d.bin", ROOT, n, i)
    data.write_shard(p, range(from, to - 1), 4)
    out[i] = data.open_shard(p)
    from = to
  end
  return out
end

-- the 1-based windows of a batch (window w starts at token (w-1)*T)
local function windows(x, T_)
  local out = {}
  for b, row in ipairs(x:totable()) do out[b] = row[1] // T_ + 1 end
  return out
end

local function sorted(t)
  local c = {table.unpack(t)}
  table.sort(c)
  return c
end

T.case("Loader: inputs are windows of T tokens, targets the same shifted by one; shapes and dtypes", function()
  local L = data.Loader(counting_shards(97), {batch = 3, seq = 4, seed = 1})
  T.eq({L.windows, L.per_epoch}, {24, 8})
  local x, y, epoch = L:next()
  T.eq(x:size(), {3, 4}); T.eq(y:size(), {3, 4}); T.eq(x:dtype(), "i64"); T.eq(y:dtype(), "i64")
  T.eq(epoch, 0)
  local xs, ys = x:totable(), y:totable()
  for b = 1, 3 do
    T.eq(xs[b][1] % 4, 0, "a window starts at a multiple of T")
    for t = 1, 4 do T.eq(xs[b][t], xs[b][1] + t - 1); T.eq(ys[b][t], xs[b][t] + 1, "target = next token") end
  end
  -- the last window (tokens 92..96) uses the last token as its last target
  local seen_last = false
  local U = data.Loader(counting_shards(97), {batch = 3, seq = 4, shuffle = false})
  for _ = 1, U.per_epoch do
    local ux, uy = U:next()
    for b, row in ipairs(uy:totable()) do if row[4] == 96 then seen_last = true; T.eq(ux:totable()[b][1], 92) end end
  end
  T.ok(seen_last)
  T.raises(function() data.Loader(counting_shards(97), {batch = 30, seq = 4}) end,
    "97 tokens make only 24 windows of 4+1; a batch needs 30")
  T.raises(function() data.Loader(counting_shards(97), {batch = 0, seq = 4}) end, "batch and seq must be positive")
end)

T.case("Loader: windows across shard boundaries read from both shards", function()
  local L = data.Loader(counting_shards(97, {10, 11, 50, 97}), {batch = 4, seq = 4, shuffle = false})
  local all = {}
  for _ = 1, L.per_epoch do
    local x, y = L:next()
    for b, row in ipairs(x:totable()) do
      local yr = y:totable()[b]
      for t = 1, 4 do all[#all + 1] = row[t]; T.eq(yr[t], row[t] + 1) end
    end
  end
  T.eq(all, range(0, 95), "shuffle=false: the stream in order, every token where it belongs")
end)

T.case("Loader: deterministic per seed, seeds differ, each epoch visits every window once", function()
  local shards = counting_shards(97)
  local function epochs(seed, n)
    local L = data.Loader(shards, {batch = 3, seq = 4, seed = seed})
    local out = {}
    for e = 1, n do
      local w = {}
      for _ = 1, L.per_epoch do
        local x, _, epoch = L:next()
        T.eq(epoch, e - 1)
        for _, v in ipairs(windows(x, 4)) do w[#w + 1] = v end
      end
      out[e] = w
    end
    return out
  end
  local a, b, c = epochs(1, 3), epochs(1, 3), epochs(2, 1)
  T.eq(a, b, "same seed, same order")
  T.ok(not T.deep_eq(a[1], c[1]), "another seed, another order")
  for e = 1, 3 do T.eq(sorted(a[e]), range(1, 24), "epoch " .. e .. " visits every window exactly once") end
  T.ok(not T.deep_eq(a[1], a[2]) and not T.deep_eq(a[2], a[3]), "each epoch has its own order")
  T.ok(not T.deep_eq(a[1], range(1, 24)), "shuffled")
  -- 64-bit seeds use both key words
  local h1, h2 = epochs((1 << 40) + 1, 1), epochs(1, 1)
  T.ok(not T.deep_eq(h1[1], h2[1]), "the seed's high word matters")
end)

T.case("Loader: world=2 ranks take disjoint windows whose union is world=1's batch of 2B", function()
  local shards = counting_shards(97)
  local r0 = data.Loader(shards, {batch = 3, seq = 4, seed = 5, rank = 0, world = 2})
  local r1 = data.Loader(shards, {batch = 3, seq = 4, seed = 5, rank = 1, world = 2})
  local one = data.Loader(shards, {batch = 6, seq = 4, seed = 5})
  T.eq({r0.per_epoch, r1.per_epoch, one.per_epoch}, {4, 4, 4})
  for step = 1, 12 do -- three epochs
    local w0, w1, w = windows(r0:next(), 4), windows(r1:next(), 4), windows(one:next(), 4)
    local seen = {}
    for _, v in ipairs(w0) do seen[v] = true end
    for _, v in ipairs(w1) do T.ok(not seen[v], "step " .. step .. ": ranks overlap on window " .. v) end
    local union = {table.unpack(w0)}
    for _, v in ipairs(w1) do union[#union + 1] = v end
    T.eq(union, w, "step " .. step .. ": rank 0's then rank 1's windows are world=1's batch")
  end
  -- the remainder: 25 windows over batches of 2x3 leave one window out of each epoch, on every rank alike
  local odd = counting_shards(101)
  local a = data.Loader(odd, {batch = 3, seq = 4, seed = 5, rank = 0, world = 2})
  local b = data.Loader(odd, {batch = 3, seq = 4, seed = 5, rank = 1, world = 2})
  T.eq({a.windows, a.per_epoch, b.per_epoch}, {25, 4, 4})
  local all = {}
  for _ = 1, 4 do
    for _, v in ipairs(windows(a:next(), 4)) do all[#all + 1] = v end
    for _, v in ipairs(windows(b:next(), 4)) do all[#all + 1] = v end
  end
  T.eq(#all, 24)
  local s = sorted(all)
  for i = 2, #s do T.ok(s[i] ~= s[i - 1], "no window twice in an epoch") end
end)

T.case("Loader: a restored cursor continues exactly (across an epoch boundary); the seed must match", function()
  local shards = counting_shards(97)
  local A = data.Loader(shards, {batch = 3, seq = 4, seed = 9})
  for _ = 1, 6 do A:next() end
  local st = A:state()
  T.eq(st, {cursor = 6, seed = 9})
  local B = data.Loader(shards, {batch = 3, seq = 4, seed = 9})
  B:load_state(st)
  for i = 1, 5 do -- batches 7..11: epoch 0's last two, then epoch 1
    local xa, ya, ea = A:next()
    local xb, yb, eb = B:next()
    T.eq(xb:totable(), xa:totable(), "batch " .. (6 + i))
    T.eq(yb:totable(), ya:totable())
    T.eq(eb, ea)
  end
  T.eq(B.cursor, 11)
  local C = data.Loader(shards, {batch = 3, seq = 4, seed = 10})
  T.raises(function() C:load_state(st) end, "the checkpoint's data seed 9 differs from this run's 10")
end)

-- ---- schedules ---------------------------------------------------------------------------------

local function near(a, b, what) T.near(a, b, 1e-12, what) end

T.case("schedule.constant: linear warmup, then lr", function()
  local f = schedule.constant({lr = 2.0, warmup = 4})
  near(f(1), 0.5); near(f(2), 1.0); near(f(4), 2.0); near(f(5), 2.0); near(f(1000), 2.0)
  near(schedule.constant({lr = 3.0})(1), 3.0, "no warmup")
end)

T.case("schedule.cosine: warmup, cosine from lr to min_lr at total, min_lr after", function()
  local f = schedule.cosine({lr = 1.0, min_lr = 0.1, warmup = 10, total = 110})
  near(f(5), 0.5, "warmup"); near(f(10), 1.0, "end of warmup")
  near(f(35), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), "a quarter of the way")
  near(f(60), 0.55, "mid")
  near(f(110), 0.1, "end"); near(f(200), 0.1, "past the end")
end)

T.case("schedule.wsd: warmup, stable at lr, decay over the last fraction to min_lr", function()
  local f = schedule.wsd({lr = 1.0, min_lr = 0.1, warmup = 10, total = 100, decay = 0.2})
  near(f(5), 0.5, "warmup"); near(f(10), 1.0); near(f(50), 1.0, "stable")
  near(f(80), 1.0, "decay starts after step 80 = 100 - 0.2*100")
  near(f(81), 1.0 - 0.9 / 20, "first decay step")
  near(f(90), 0.55, "mid decay"); near(f(100), 0.1, "end"); near(f(120), 0.1)
  local c = schedule.wsd({lr = 1.0, min_lr = 0.1, warmup = 10, total = 100, decay = 0.2, shape = "cosine"})
  near(c(80), 1.0); near(c(85), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))); near(c(90), 0.55); near(c(100), 0.1)
  local none = schedule.wsd({lr = 1.0, total = 10, decay = 0})
  near(none(10), 1.0, "decay = 0: no decay")
  T.raises(function() schedule.wsd({lr = 1.0, total = 10, decay = 1.5}) end, "decay must be a fraction in [0, 1]")
end)

T.case("schedule.linear: warmup, then linear to min_lr at total", function()
  local f = schedule.linear({lr = 1.0, min_lr = 0.0, warmup = 10, total = 110})
  near(f(5), 0.5); near(f(10), 1.0); near(f(35), 0.75); near(f(60), 0.5); near(f(110), 0.0); near(f(111), 0.0)
end)

T.case("schedule.make: by name; unknown names and missing numbers raise", function()
  local o = {lr = 1.0, min_lr = 0.1, warmup = 10, total = 110}
  for _, name in ipairs({"constant", "cosine", "wsd", "linear"}) do
    near(schedule.make(name, o)(60), schedule[name](o)(60), name)
  end
  T.raises(function() schedule.make("step", o) end, "schedule: unknown schedule 'step' (constant, cosine, wsd, linear)")
  T.raises(function() schedule.make("make", o) end, "unknown schedule 'make'")
  T.raises(function() schedule.cosine({lr = 1.0}) end, "schedule.cosine: 'total' must be a number")
  T.raises(function() schedule.constant({}) end, "schedule.constant: 'lr' must be a number")
end)

-- Ranks of a job tokenizing the same corpus write the same cache shards at once: each must get a temp file of
-- its own (a shared one made a rank's rename fail, "No such file or directory", under CI's sanitizers). Two
-- processes whose math.random gives the same number at every write write one path 200 times each, at once.
T.case("two processes writing one shard at once (same math.random seed) both succeed", function()
  local path, script = ROOT .. "/race.bin", ROOT .. "/race.lua"
  T.write_file(script, string.format([[
local data = require "nvlua.data"
for i = 1, 200 do math.randomseed(1); data.write_shard(%q, {1, 2, 3, i}, 2) end
print("done")
]], path))
  local cmd = string.format("%s %s & %s %s; wait", T.shq(T.nvlua()), T.shq(script), T.shq(T.nvlua()), T.shq(script))
  local p = assert(io.popen("(" .. cmd .. ") 2>&1"))
  local out = p:read("a")
  p:close()
  local _, n = out:gsub("done", "")
  T.eq(n, 2, "both writers finished; output:\n" .. out)
  local sh = data.open_shard(path)
  T.eq(sh.count, 4, "the shard holds one writer's whole tokens")
  for f in lfs.dir(ROOT) do T.ok(not f:match("^race%.bin%.tmp"), "stray temp file " .. f) end
end)

T.case("cleanup: the scratch directory is removed", function()
  T.rm_tree(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
