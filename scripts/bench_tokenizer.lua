-- scripts/bench_tokenizer.lua: nvlua's tok:encode throughput against Hugging Face `tokenizers`, single-
-- threaded, on the same text with the same tokenizer.json files (issue 33: at least the library's).
--   nvlua scripts/bench_tokenizer.lua [text=<file>] [tokenizers=a.json,b.json] [seconds=3] [python=python3]
-- text: default the KJV as data.kjv reads it (Debian bible-kjv, 4.3 MB), written to a temporary file;
-- tokenizers: default the fixtures of tests/golden/tok (GPT-2, Llama 3, Llama 2 styles) and
-- tests/data/kjv_bpe. Each encodes the text two ways: "text", the whole text in one call, and "lines",
-- each line (with its "\n") in a call of its own; each repeated for `seconds` (at least once; the best
-- time counts; reading the file and building the encoder (at the first call) are timed apart as "load").
-- scripts/bench_tokenizer.py does the same with `tokenizers` (TOKENIZERS_PARALLELISM=false: encode and
-- encode_batch of the lines on one thread) when `python` imports it; the table shows both MB/s (10^6
-- bytes of text per second), the ratio nvlua / tokenizers, and whether the ids agree (count, checksum).
-- Run it on a quiet machine: the numbers are wall-clock times.
local core = require "nvlua.core"
local config = require "nvlua.config"
local tokenizer = require "nvlua.tokenizer"
local cjson = require "cjson"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "scripts"
local root = here .. "/.."
local o = config.schema({
  text = config.str("", {doc = "a UTF-8 text file (default: the KJV)"}),
  tokenizers = config.str("", {doc = "tokenizer.json files, comma-separated (default: the test fixtures)"}),
  seconds = config.num(3, {min = 0, doc = "time per tokenizer and library"}),
  python = config.str("python3", {nonempty = true, doc = "the python that has `tokenizers`"}),
}):parse(arg)

local path, tmp = o.text, nil
if path == "" then
  local p = io.popen("bible -f gen1:1-rev22:21 2>/dev/null")
  local raw = p and p:read("a") or ""
  if p then p:close() end
  if #raw < 1000000 then error("bench_tokenizer: no text= and no `bible` (Debian bible-kjv)", 0) end
  local lines = {}
  for line in raw:gmatch("[^\n]+") do lines[#lines + 1] = (line:gsub("^%S+%d+:%d+ ", "")) end
  tmp = os.tmpname()
  local f = assert(io.open(tmp, "wb"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  path = tmp
end
local f = assert(io.open(path, "rb"))
local text = f:read("a")
f:close()
local files = {}
for p in (o.tokenizers ~= "" and o.tokenizers or table.concat({root .. "/tests/golden/tok/gpt2.json",
  root .. "/tests/golden/tok/llama3.json", root .. "/tests/golden/tok/llama2.json",
  root .. "/tests/data/kjv_bpe/tokenizer.json"}, ",")):gmatch("[^,]+") do files[#files + 1] = p end

-- the checksum of scripts/bench_tokenizer.py: sum of (i + 1) * id mod 2^61 - 1
local M = (1 << 61) - 1
local function checksum(ids)
  local s = 0
  for i, v in ipairs(ids) do s = (s + (i * v) % M) % M end
  return s
end

local lines = {}
for line in text:gmatch("[^\n]*\n?") do if line ~= "" then lines[#lines + 1] = line end end
local function encode(tok, mode)
  if mode == "text" then return tok:encode(text) end
  local ids = {}
  for _, line in ipairs(lines) do
    local l = tok:encode(line)
    table.move(l, 1, #l, #ids + 1, ids)
  end
  return ids
end

local MODES = {"text", "lines"}
local mine = {}
for _, file in ipairs(files) do
  mine[file] = {}
  local t0 = core.clock()
  local tok = tokenizer.load(file) -- the JSON read, then the encoder built by the first call
  tok:encode("")
  local load = core.clock() - t0
  for _, mode in ipairs(MODES) do
    local best, spent, ids = math.huge, 0, nil
    while ids == nil or spent < o.seconds do
      t0 = core.clock()
      ids = encode(tok, mode)
      local dt = core.clock() - t0
      best, spent = math.min(best, dt), spent + dt
    end
    mine[file][mode] = {mb_s = #text / best / 1e6, load = load, ids = #ids, sum = checksum(ids)}
  end
end

local cmd = string.format("%s %s/bench_tokenizer.py --json --seconds %s %q", o.python, here, o.seconds, path)
for _, file in ipairs(files) do cmd = cmd .. string.format(" %q", file) end
local p = io.popen("TOKENIZERS_PARALLELISM=false " .. cmd .. " 2>/dev/null")
local out = p:read("a")
p:close()
local ok, theirs = pcall(cjson.decode, out)
if not ok or type(theirs) ~= "table" then
  theirs = {}
  print(string.format("(no tokenizers numbers: `%s` failed; pip install tokenizers, or python=<a python that has it>)",
    o.python))
end
if tmp then os.remove(tmp) end

print(string.format("text: %s, %.2f MB; one thread; best of %ss each", o.text ~= "" and o.text or "the KJV",
  #text / 1e6, o.seconds))
print(string.format("%-36s %6s %8s %12s %16s %7s %s", "tokenizer", "mode", "load s", "nvlua MB/s", "tokenizers MB/s",
  "ratio", "ids"))
for _, file in ipairs(files) do
  for _, mode in ipairs(MODES) do
    local m, t = mine[file][mode], theirs[file] and theirs[file][mode]
    local same = t and (t.ids == m.ids and t.sum == m.sum and "equal" or
      string.format("DIFFER (%d vs %d)", m.ids, t.ids)) or "-"
    print(string.format("%-36s %6s %8.3f %12.2f %16s %7s %s", (file:gsub("^.*/tests/", "tests/")), mode, m.load, m.mb_s,
      t and string.format("%.2f", t.mb_s) or "-", t and string.format("%.2f", m.mb_s / t.mb_s) or "-", same))
  end
end
