-- tests/test_tokenizer.lua: tokenizers, data manifests and exports a Hugging Face user can use
-- (lua/nvlua/tokenizer.lua, data.lua's manifests, checkpoint.lua's model/ directory).
--   * the byte tokenizer's tokenizer.json: 256 tokens, id = byte, named by GPT-2's byte-level table
--     (spot values from GPT-2's own vocabulary: space "Ġ", newline "Ċ", byte 0 "Ā", 127 "ġ",
--     173 "Ń", 255 "ÿ"); a bijection; no merges, no special tokens.
--   * tests/data/kjv_bpe/: a 512-token byte-level BPE trained on the KJV by scripts/train_tokenizer.py
--     (HF tokenizers), and Genesis 1-2 tokenized by scripts/prepare_data.py (one document per verse,
--     bos and eos around each): tokenizer.load finds bos/eos in tokenizer_config.json; decoding the
--     shards (ids from HF tokenizers) gives the verses back byte for byte.
--   * the decoders of SentencePiece-style tokenizer.json files (Replace, ByteFallback, Fuse, Strip,
--     Metaspace), by hand (the same texts as HF tokenizers 0.23 gives); errors name the file and
--     the problem.
--   * manifest.json: every malformed field is a named error; data.shards takes vocab and tokenizer
--     from it.
--   * end to end: a few steps on data=shards:tests/data/kjv_bpe (vocab=0: from the manifest), the
--     checkpoint's model/ holds the tokenizer (byte-equal to the data's), tokenizer_config.json,
--     special_tokens_map.json, generation_config.json, config.json's bos/eos ids and max_positions;
--     trainer.json records them; the sample starts at the manifest's prompt ids and is their decoding;
--     a run on a text file exports the byte tokenizer (bos/eos null, no generation_config.json).
--   * data=<text file> tokenizer=<tokenizer.json>: a run on Genesis 1-2 with tests/golden/tok/llama3.json
--     trains on the tokenizer's encode of the text (train then validation shard = one encode, also when
--     encoded in 512-byte pieces), vocabulary and sample prompt (bos, "And ") from the tokenizer.
--   * scripts/make_shards.lua's byte shards carry a manifest: data=shards: needs no vocab=; a vocab= below
--     the largest id of shards without one is refused, naming the first token past it.
--   * scripts/prepare_data.py --tiktoken FILE (a local .tiktoken file, offline): scripts/check_tiktoken_offline.py,
--     skipped with its reason when python3 lacks tiktoken, tokenizers or numpy.
-- scripts/check_hf_e2e.py loads such exports with transformers (CI runs it when it can install it).
-- tests/data/kjv_bpe/ and tests/data/megatron/ are made (byte for byte again) by
--   python3 scripts/train_tokenizer.py tests/data/kjv_bpe --vocab 512
--   python3 scripts/prepare_data.py tests/data/kjv_bpe tests/data/kjv_bpe/genesis.txt \
--     --tokenizer tests/data/kjv_bpe/tokenizer.json --split line --bos --overwrite
--   python3 scripts/make_megatron_data.py tests/data/megatron/genesis_text_document tests/data/kjv_bpe/genesis.txt \
--     --tokenizer tests/data/kjv_bpe/tokenizer.json --docs-per 4 --split-sentences --append-eod \
--     --expect tests/data/megatron/genesis_text_document.json
-- (genesis.txt: `bible -f gen1:1-gen2:25` from Debian's bible-kjv, verse references stripped).
local T = require "nvlua.test"
local tokenizer = require "nvlua.tokenizer"
local data = require "nvlua.data"
local train = require "nvlua.train"
local config = require "nvlua.config"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"
local lfs = require "lfs"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local KJV = here .. "/data/kjv_bpe"
local ROOT = T.tmpdir()

local function read_json(path) return cjson.decode(assert(T.read_file(path))) end

-- ---- the byte tokenizer -------------------------------------------------------------------------

T.case("byte tokenizer.json: 256 tokens, id = byte, GPT-2's byte-level names; no merges, no specials", function()
  local t = cjson.decode(tokenizer.byte_json())
  T.eq(t.model.type, "BPE")
  T.eq(#t.model.merges, 0)
  T.eq(#t.added_tokens, 0)
  T.eq(t.pre_tokenizer.type, "ByteLevel"); T.eq(t.decoder.type, "ByteLevel")
  T.eq(t.pre_tokenizer.add_prefix_space, false)
  local ids, n = {}, 0
  for name, id in pairs(t.model.vocab) do
    n = n + 1
    T.eq(utf8.len(name), 1, "one character per token: " .. name)
    T.ok(ids[id] == nil, "id " .. id .. " once")
    ids[id] = name
  end
  T.eq(n, 256)
  for b = 0, 255 do T.ok(ids[b], "byte " .. b .. " has a token") end
  -- GPT-2's vocabulary: "Ġ" is the space, "Ċ" the newline, printable ASCII stands for itself
  local known = {[32] = "\u{120}", [10] = "\u{10A}", [0] = "\u{100}", [127] = "\u{121}", [173] = "\u{143}",
    [255] = "\u{FF}", [65] = "A", [33] = "!", [126] = "~", [161] = "\u{A1}", [9] = "\u{109}", [160] = "\u{142}"}
  for b, name in pairs(known) do T.eq(ids[b], name, "byte " .. b) end
  T.eq(tokenizer.byte_json(), tokenizer.byte_json(), "deterministic")
end)

-- ---- a tokenizer.json from HF tokenizers ---------------------------------------------------------

-- the verses of Genesis 1-2 (the source of the committed shards)
local function verses()
  local out = {}
  for line in assert(T.read_file(KJV .. "/genesis.txt")):gmatch("[^\n]+") do out[#out + 1] = line end
  return out
end

T.case("tokenizer.load: the KJV BPE (512 tokens, bos/eos in tokenizer_config.json) decodes HF's ids exactly", function()
  local tok = tokenizer.load(KJV .. "/tokenizer.json")
  T.eq({tok.vocab_size, tok.bos_token, tok.bos_id, tok.eos_token, tok.eos_id},
    {512, "<|begin_of_text|>", 0, "<|end_of_text|>", 1})
  T.eq(tokenizer.load(KJV).vocab_size, 512, "a directory holding tokenizer.json")
  local ds = data.shards(KJV)
  local ids = {}
  for _, s in ipairs({ds.train[1], ds.val[1]}) do
    for _, v in ipairs(data.read_tokens(s, 0, s.count):totable()) do ids[#ids + 1] = v end
  end
  local want = {}
  for i, v in ipairs(verses()) do want[i] = "<|begin_of_text|>" .. v .. "<|end_of_text|>" end
  T.eq(tok:decode(ids), table.concat(want), "every verse, between its bos and eos")
  T.eq(#ids, 2825 + 131, "the manifest's counts")
  T.eq(tok:decode({297, 222}), "And ", "the manifest's prompt ids")
  T.raises(function() tok:decode({512}) end, "id 512 is not in the vocabulary")
end)

local function write_tokenizer(name, t)
  local dir = ROOT .. "/" .. name
  lfs.mkdir(dir)
  T.write_file(dir .. "/tokenizer.json", cjson.encode(t))
  return dir .. "/tokenizer.json"
end

T.case("tokenizer.load: SentencePiece-style decoders (Replace, ByteFallback, Fuse, Strip, Metaspace)", function()
  local vocab = {["<unk>"] = 0, ["<s>"] = 1, ["</s>"] = 2, ["<0x0A>"] = 3, ["<0xC3>"] = 4, ["<0xA9>"] = 5,
    ["\u{2581}And"] = 6, ["\u{2581}the"] = 7, ["\u{2581}"] = 8, ["x"] = 9}
  local added = {{id = 0, content = "<unk>", special = true}, {id = 1, content = "<s>", special = true},
    {id = 2, content = "</s>", special = true}}
  local p = write_tokenizer("sp", {model = {type = "BPE", vocab = vocab, merges = {}}, added_tokens = added,
    decoder = {type = "Sequence", decoders = {{type = "Replace", pattern = {String = "\u{2581}"}, content = " "},
      {type = "ByteFallback"}, {type = "Fuse"}, {type = "Strip", content = " ", start = 1, stop = 0}}}})
  local tok = tokenizer.load(p)
  T.eq({tok.vocab_size, tok.bos_token, tok.bos_id, tok.eos_token, tok.eos_id}, {10, "<s>", 1, "</s>", 2})
  -- Llama 2's decoder: "▁And▁the" -> " And the" -> strip one leading space; bytes C3 A9 are "é"
  T.eq(tok:decode({6, 7, 8, 4, 5, 3, 9}), "And the \u{E9}\nx")
  -- added tokens go through the decoder too (tokenizers 0.23 decodes these ids to the same text)
  T.eq(tok:decode({1, 6, 7, 2}), "<s> And the</s>")
  local m = write_tokenizer("meta", {model = {type = "BPE", vocab = vocab, merges = {}},
    decoder = {type = "Metaspace", replacement = "\u{2581}", prepend_scheme = "always"}})
  T.eq(tokenizer.load(m):decode({6, 7, 9}), "And thex")
  -- Unigram's vocab is a list of [piece, score]: the id is the position
  local u = write_tokenizer("uni", {model = {type = "Unigram", vocab = {{"<unk>", 0}, {"a", -1}, {"b", -2}}},
    decoder = cjson.null})
  local ut = tokenizer.load(u)
  T.eq({ut.vocab_size, ut.bos_id, ut.eos_id}, {3, nil, nil})
  T.eq(ut:decode({1, 2, 1}), "aba")
  -- bos/eos named explicitly
  local named = tokenizer.load(u, {bos_token = "a", eos_token = "b"})
  T.eq({named.bos_id, named.eos_id}, {1, 2})
end)

T.case("tokenizer.load: errors name the file and the problem", function()
  T.raises(function() tokenizer.load(ROOT .. "/none.json") end, "tokenizer: cannot read " .. ROOT .. "/none.json")
  T.write_file(ROOT .. "/bad.json", "{not json")
  T.raises(function() tokenizer.load(ROOT .. "/bad.json") end, "tokenizer " .. ROOT .. "/bad.json: not valid JSON")
  local p = write_tokenizer("novocab", {model = {type = "BPE"}})
  T.raises(function() tokenizer.load(p) end, "tokenizer " .. p .. ": no model.vocab")
  p = write_tokenizer("badid", {model = {type = "BPE", vocab = {a = -1}}})
  T.raises(function() tokenizer.load(p) end, "the id of vocab entry a must be an integer in [0, 2147483648), got -1")
  p = write_tokenizer("regex", {model = {type = "BPE", vocab = {a = 0}},
    decoder = {type = "Replace", pattern = {Regex = "a+"}, content = "b"}})
  T.raises(function() tokenizer.load(p):decode({0}) end, "a Replace decoder with a regex pattern is not supported")
  p = write_tokenizer("wp", {model = {type = "BPE", vocab = {a = 0}}, decoder = {type = "WordPiece"}})
  T.raises(function() tokenizer.load(p):decode({0}) end, "decoder type WordPiece is not supported")
  T.raises(function() tokenizer.load(p, {eos_token = "</s>"}) end, 'eos_token "</s>" is not in its vocabulary')
end)

-- ---- manifests -------------------------------------------------------------------------------

T.case("manifest.json: data.shards takes vocab and tokenizer from it; malformed fields are named errors", function()
  local ds = data.shards(KJV)
  T.eq(ds.vocab_size, 512)
  T.eq({ds.tokenizer.bos_id, ds.tokenizer.eos_id}, {0, 1})
  T.eq(ds.tokenizer.prompt, {text = "And ", ids = {0, 297, 222}})
  local good = read_json(KJV .. "/manifest.json")
  local function with(edit, text)
    local d = ROOT .. "/man"
    T.rm_tree(d)
    assert(lfs.mkdir(d))
    for _, f in ipairs({"tokenizer.json", "train_000.bin", "val_000.bin"}) do
      T.write_file(d .. "/" .. f, assert(T.read_file(KJV .. "/" .. f)))
    end
    local m = read_json(KJV .. "/manifest.json")
    edit(m)
    T.write_file(d .. "/manifest.json", cjson.encode(m))
    T.raises(function() data.shards(d) end, text)
  end
  T.eq(good.vocab_size, 512)
  with(function(m) m.format = "other" end, "manifest " .. ROOT .. "/man/manifest.json: format other version 1")
  with(function(m) m.vocab_size = 0 end, "vocab_size must be an integer in [1, 2147483648), got 0")
  with(function(m) m.vocab_size = nil end, "vocab_size is missing")
  with(function(m) m.vocab_size = 600 end, "vocab_size 600, but " .. ROOT .. "/man/tokenizer.json has 512 tokens")
  with(function(m) m.eos_token_id = 5 end, "eos_token_id 5, but " .. ROOT .. "/man/tokenizer.json gives")
  with(function(m) m.bos_token_id = 512 end, "bos_token_id must be an integer in [0, 512), got 512")
  with(function(m) m.tokenizer = 3 end, 'tokenizer must be "bytes" or the name of a tokenizer.json')
  with(function(m) m.tokenizer = "bytes" end, "vocab_size 512 with the byte tokenizer (256)")
  with(function(m) m.tokenizer = "missing.json" end, "tokenizer: cannot read " .. ROOT .. "/man/missing.json")
  with(function(m) m.prompt.ids = {0, 999} end, "prompt.ids[2] must be an integer in [0, 512), got 999")
  with(function(m) m.prompt = "And" end, "prompt must be {text = string, ids = [integers]}")
  with(function(m) m.eos_token = "<nope>" end, 'eos_token "<nope>" is not in its vocabulary')
end)

-- ---- end to end ---------------------------------------------------------------------------------

local BASE = {"layers=1", "hidden=32", "heads=4", "kv_heads=2", "ffn=64", "seq=16", "batch=2", "steps=3",
  "eval_every=3", "eval_batches=1", "sample_tokens=12", "plot=false", "quiet=true", "seed=3", "recipe=bf16",
  "cache=" .. ROOT .. "/cache"}

local function run(name, extra)
  local args = {table.unpack(BASE)}
  args[#args + 1] = "out=" .. ROOT .. "/" .. name
  for _, a in ipairs(extra) do args[#args + 1] = a end
  local c = config.parse(train.defaults, args)
  local p = train.build(c)
  p.peak = 1e9
  return train.run(c, p), p, c
end

T.case("train on data=shards:<prepared> (vocab from the manifest): the export holds the tokenizer", function()
  local s, p = run("bpe", {"data=shards:" .. KJV, "max_positions=64"})
  T.eq(p.model.config.vocab_size, 512, "vocab=0: the manifest's")
  local m = s.checkpoint .. "/model"
  local names = {}
  for n in lfs.dir(m) do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
  table.sort(names)
  T.eq(names, {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json"})
  T.eq(T.read_file(m .. "/tokenizer.json"), T.read_file(KJV .. "/tokenizer.json"), "the data's tokenizer, as it is")
  local c = read_json(m .. "/config.json")
  T.eq({c.vocab_size, c.bos_token_id, c.eos_token_id, c.max_position_embeddings}, {512, 0, 1, 64})
  local tc = read_json(m .. "/tokenizer_config.json")
  T.eq({tc.tokenizer_class, tc.bos_token, tc.eos_token, tc.model_max_length, tc.clean_up_tokenization_spaces},
    {"PreTrainedTokenizerFast", "<|begin_of_text|>", "<|end_of_text|>", 64, false})
  T.eq(read_json(m .. "/special_tokens_map.json"), {bos_token = "<|begin_of_text|>", eos_token = "<|end_of_text|>"})
  local g = read_json(m .. "/generation_config.json")
  T.eq({g.bos_token_id, g.eos_token_id}, {0, 1})
  local tr = read_json(s.checkpoint .. "/trainer.json")
  for _, n in ipairs(names) do T.ok(tr.files["model/" .. n], "trainer.json records model/" .. n) end
  -- the sample: 12 tokens after the manifest's prompt ids, decoded by the tokenizer
  T.eq(s.sample_prompt, "And ")
  local ids = train.sample(p.model, nil, {0, 297, 222}, 12, {temperature = 0.8, top_k = 40, seed = 3})
  local list = {}
  for v in ids:gmatch("%d+") do list[#list + 1] = math.tointeger(tonumber(v)) end
  T.eq(#list, 12)
  T.eq(s.sample, p.dataset.tokenizer:decode(list))
  -- nvlua loads its export back, from the step directory or model/
  T.eq(ckpt.from_pretrained(s.checkpoint).config.max_position_embeddings, 64)
  T.eq(require("nvlua.hf").from_pretrained(m).config.vocab_size, 512)
  -- and resumes from it
  local s2 = run("bpe", {"data=shards:" .. KJV, "max_positions=64", "steps=4", "resume=auto"})
  T.eq(s2.steps, 4)
end)

T.case("data=<text file> tokenizer=<tokenizer.json>: trains on the tokenizer's encode of the text", function()
  local tj = here .. "/golden/tok/llama3.json"
  local text = T.read_file(KJV .. "/genesis.txt") -- Genesis 1-2, 7 KB
  local tok = tokenizer.load(tj)
  local s, p = run("textbpe", {"data=" .. KJV .. "/genesis.txt", "tokenizer=" .. tj, "max_positions=64"})
  local ds = p.dataset
  T.eq(p.model.config.vocab_size, tok.vocab_size, "vocab=0: the tokenizer's")
  local got = data.read_tokens(ds.train[1], 0, ds.train[1].count):totable()
  for _, v in ipairs(data.read_tokens(ds.val[1], 0, ds.val[1].count):totable()) do got[#got + 1] = v end
  T.eq(got, tok:encode(text), "train then validation ids: the tokenizer's encode of the whole text")
  T.ok(ds.val[1].count > 0 and ds.train[1].count > 10 * ds.val[1].count, "the last 5% or so for validation")
  T.eq(s.sample_prompt, "And ")
  T.eq(ds.tokenizer.prompt.ids, {tok.bos_id, table.unpack(tok:encode("And "))}, "bos, then the prompt encoded")
  T.eq(T.read_file(s.checkpoint .. "/model/tokenizer.json"), T.read_file(tj), "the export holds the tokenizer")
  -- pieces of 512 bytes (cut at line breaks) give the same ids as one encode
  local small = data.text(KJV .. "/genesis.txt", {tokenizer = tj, piece = 512, cache = ROOT .. "/cache-small"})
  local ids = data.read_tokens(small.train[1], 0, small.train[1].count):totable()
  for _, v in ipairs(data.read_tokens(small.val[1], 0, small.val[1].count):totable()) do ids[#ids + 1] = v end
  T.eq(ids, got, "encoded in 512-byte pieces")
end)

T.case("a run on byte data exports the byte tokenizer; bos/eos null; max_positions defaults to seq", function()
  local text = ROOT .. "/text.txt"
  T.write_file(text, string.rep("In the beginning God created the heaven and the earth.\n", 40))
  local s = run("bytes", {"data=" .. text})
  local m = s.checkpoint .. "/model"
  T.eq(T.read_file(m .. "/tokenizer.json"), tokenizer.byte_json())
  T.eq(lfs.attributes(m .. "/generation_config.json"), nil, "nothing to say without bos/eos")
  T.eq(lfs.attributes(m .. "/special_tokens_map.json"), nil)
  local c = read_json(m .. "/config.json")
  T.eq({c.vocab_size, c.bos_token_id, c.eos_token_id, c.max_position_embeddings}, {256, cjson.null, cjson.null, 16})
  T.eq(read_json(m .. "/tokenizer_config.json").model_max_length, 16)
  T.eq(s.sample_prompt, "And ")
  T.eq(#s.sample, 12, "12 bytes")
  T.raises(function() config.parse(train.schema, {"seq=32", "max_positions=16"}) end,
    "max_positions (16) must be 0 (= seq) or at least seq (32)")
  T.raises(function() config.parse(train.schema, {"tokenizer=" .. KJV}) end,
    "tokenizer=" .. KJV .. " goes with data=shards:..., megatron:... or a text file or directory; data=kjv is byte tokens")
  T.raises(function() config.parse(train.schema, {"tokenizer=" .. ROOT}) end,
    "is not a tokenizer.json nor a directory holding one")
end)

T.case("shards without a manifest: vocab= or tokenizer= is needed; tokenizer= gives both", function()
  local d = ROOT .. "/plain"
  assert(lfs.mkdir(d))
  for _, f in ipairs({"train_000.bin", "val_000.bin"}) do T.write_file(d .. "/" .. f, T.read_file(KJV .. "/" .. f)) end
  T.raises(function() run("plain0", {"data=shards:" .. d}) end,
    "config: data=shards:" .. d .. " needs vocab=<vocabulary size> or tokenizer=<tokenizer.json>")
  local s, p = run("plain1", {"data=shards:" .. d, "tokenizer=" .. KJV .. "/tokenizer.json", "steps=1"})
  T.eq(p.model.config.vocab_size, 512)
  T.eq(read_json(s.checkpoint .. "/model/config.json").eos_token_id, 1)
  T.eq(s.sample_prompt, "", "no manifest prompt: the sample starts at bos")
  local s2, p2 = run("plain2", {"data=shards:" .. d, "vocab=520", "steps=1"})
  T.eq(p2.model.config.vocab_size, 520)
  T.eq(lfs.attributes(s2.checkpoint .. "/model/tokenizer.json"), nil, "no tokenizer known: none exported")
  T.raises(function() run("plain3", {"data=shards:" .. KJV, "vocab=500"}) end,
    "config: vocab=500 is smaller than the data's vocabulary (512 tokens)")
  -- vocab= below the largest id of shards without a manifest: refused before the model is built,
  -- naming the first token past it (found here by reading the shard's ids in Lua)
  local shard = data.open_shard(d .. "/train_000.bin")
  local ids, first = data.read_tokens(shard, 0, shard.count):totable(), nil
  for i, v in ipairs(ids) do if v >= 300 then first = {i - 1, v}; break end end
  T.ok(first, "the KJV shard has ids >= 300")
  T.raises(function() run("plain4", {"data=shards:" .. d, "vocab=300"}) end, string.format("data %s/train_000.bin: " ..
    "token %d is %d, outside the vocabulary of 300 ids (0..299, vocab=300)", d, first[1], first[2]))
end)

T.case("scripts/make_shards.lua: byte shards with a manifest; data=shards: takes vocab 256 from it", function()
  local out = ROOT .. "/made"
  local cmd = string.format("%s %s/../scripts/make_shards.lua %s %s 2>&1", T.shq(T.nvlua()), T.shq(here),
    T.shq(KJV .. "/genesis.txt"), T.shq(out))
  local p = assert(io.popen(cmd))
  local log = p:read("a")
  T.ok(p:close(), "make_shards.lua: " .. log)
  local m = data.read_manifest(out)
  T.eq({m.tokenizer, m.vocab_size, m.bos_token_id, m.prompt.text}, {"bytes", 256, nil, "And "})
  local s, parts = run("made", {"data=shards:" .. out, "steps=1"})
  T.eq(parts.model.config.vocab_size, 256)
  T.eq(T.read_file(s.checkpoint .. "/model/tokenizer.json"), tokenizer.byte_json())
  T.eq(#s.sample, 12)
end)

T.case("scripts/prepare_data.py --tiktoken FILE: the offline route (scripts/check_tiktoken_offline.py)", function()
  if not os.execute("command -v python3 >/dev/null 2>&1") then T.skip("no python3") end
  local p = assert(io.popen(string.format("python3 %s/../scripts/check_tiktoken_offline.py 2>&1; echo \"exit $?\"",
    T.shq(here))))
  local log = p:read("a")
  p:close()
  local code = tonumber(log:match("exit (%d+)%s*$"))
  if code == 77 then T.skip(log:match("skipped: ([^\n]*)")) end
  T.eq(code, 0, "check_tiktoken_offline.py:\n" .. log)
end)

T.case("cleanup: the scratch directory is removed", function()
  T.rm_tree(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
