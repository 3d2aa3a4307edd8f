-- scripts/make_shards.lua: convert text (a file or a directory of files, walked in sorted order)
-- into NVLTOK shard files (format documented in lua/nvlua/data.lua) with the byte tokenizer:
-- <out>/train_000.bin, train_001.bin, ... and <out>/val_000.bin (the last val_fraction of the
-- text, cut at a line break), and <out>/manifest.json (the byte tokenizer, vocabulary 256: see
-- lua/nvlua/data.lua). Train with data=shards:<out>.
--   build/nvlua scripts/make_shards.lua <input> <out> [width=2] [val_fraction=0.05] [shard_mb=64]
-- Tokens from another tokenizer go into the same format: 24-byte header (magic "NVLTOK\0\0",
-- u32 version 1, u32 width 2|4, u64 count) then the ids, little-endian (data.write_shard).
local data = require "nvlua.data"
local config = require "nvlua.config"

local schema = config.schema({width = config.int(2, {check = function(v) if v ~= 2 and v ~= 4 then return "must be 2 or 4 (bytes per token id)" end end}),
  val_fraction = config.num(0.05, {above = 0, below = 1}), shard_mb = config.num(64.0, {above = 0})})
if config.help_requested(arg) then schema:parse(arg) end -- prints the help and exits
local input, out = arg[1], arg[2]
if not input or not out then
  io.stderr:write("usage: nvlua scripts/make_shards.lua <input file or dir> <out dir> [width=2] [val_fraction=0.05] [shard_mb=64]\n")
  os.exit(2)
end
local o = schema:parse({[0] = arg[0], table.unpack(arg, 3)})

local files = data.list_files(input)
local parts = {}
for _, f in ipairs(files) do
  local h = assert(io.open(f, "rb"))
  parts[#parts + 1] = h:read("a")
  h:close()
end
local text = table.concat(parts, "\n")
local cut = math.floor(#text * (1 - o.val_fraction))
cut = text:find("\n", cut, true) or cut
data.mkdir_p(out)
local per = math.floor(o.shard_mb * 2 ^ 20 / o.width)
local n = 0
for start = 1, cut, per do
  local path = string.format("%s/train_%03d.bin", out, n)
  data.write_shard(path, text:sub(start, math.min(cut, start + per - 1)), o.width)
  n = n + 1
end
data.write_shard(out .. "/val_000.bin", text:sub(cut + 1), o.width)
local manifest = {format = "nvlua-data", version = 1, tokenizer = "bytes", vocab_size = 256,
  prompt = {text = "And ", ids = {("And "):byte(1, -1)}}, width = o.width, tokens = {train = cut, val = #text - cut}}
assert(require("nvlua.util").atomic_write(out .. "/manifest.json", config.encode(manifest) .. "\n"))
print(string.format("make_shards: %d files, %d bytes -> %d train shard(s) (%d tokens) and 1 val shard (%d tokens) in %s",
  #files, #text, n, cut, #text - cut, out))
