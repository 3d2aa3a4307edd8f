-- tests/test_megatron.lua: Megatron-LM indexed datasets (<prefix>.bin + <prefix>.idx; lua/nvlua/data.lua
-- data.open_megatron, data.megatron, train's data=megatron:<prefix>).
--   * tests/data/megatron/genesis_text_document.{bin,idx}: Genesis 1-2 tokenized with the KJV BPE
--     (tests/data/kjv_bpe) into 14 documents of 2..6 sentences each, eod appended, by
--     scripts/make_megatron_data.py (its bytes equal Megatron-LM's own IndexedDatasetBuilder's,
--     checked against Megatron-LM d98e8a64dd when it was made); its .json holds the ids per
--     sequence. The reader's train split is documents 1..13, its validation split document 14,
--     token for token; decoded, the validation split is the last four verses and the eod.
--   * pairs written here (the layout from Megatron-LM's indexed_dataset.py) in every token dtype
--     (uint8, uint16, int32, int64, values up to each one's top), with empty documents and
--     sequences, and other validation fractions: read exactly.
--   * every malformed field is an error naming the file: magic, version, dtype codes (the ones
--     that are no token type and unknown ones), counts that do not fit the file (wrapping ones
--     too), a multimodal index, document indices that do not rise from 0 to S, negative lengths,
--     pointers that are not contiguous, a .bin of another size; too few documents to split.
--   * token ids outside the vocabulary (= vocab, in the validation split only, negative int32, int64
--     past 2^40, past a tokenizer's vocabulary) are refused when the pair is opened, naming the
--     .bin, the token's index in it and the id; train refuses vocab= below the largest id.
--   * training: data=megatron:<prefix> with tokenizer= runs, evaluates and exports the tokenizer.
-- tests/test_fuzz.lua mutates such pairs.
local T = require "nvlua.test"
local data = require "nvlua.data"
local tokenizer = require "nvlua.tokenizer"
local train = require "nvlua.train"
local config = require "nvlua.config"
local cjson = require "cjson"
local lfs = require "lfs"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local GENESIS = here .. "/data/megatron/genesis_text_document"
local KJV = here .. "/data/kjv_bpe"
local ROOT = T.tmpdir()

local function tokens_of(shard) return data.read_tokens(shard, 0, shard.count):totable() end

local function concat(docs, from, to)
  local out = {}
  for d = from, to do
    for _, seq in ipairs(docs[d]) do for _, v in ipairs(seq) do out[#out + 1] = v end end
  end
  return out
end

T.case("the committed pair: header, counts, the split by documents, token for token", function()
  local want = cjson.decode(assert(T.read_file(GENESIS .. ".json")))
  local docs = want.documents
  local m = data.open_megatron(GENESIS)
  T.eq({m.dtype, m.width, m.sequences, m.documents, m.tokens, m.train_documents}, {"uint16", 2, 60, 14, 2968, 13})
  T.eq(want.dtype, "uint16")
  T.eq(tokens_of(m.train), concat(docs, 1, 13), "train: documents 1..13")
  T.eq(tokens_of(m.val), concat(docs, 14, 14), "validation: document 14")
  T.eq(m.train.count + m.val.count, 2968)
  -- decoded: the last four verses of Genesis 2, then the eod
  local verses = {}
  for line in assert(T.read_file(KJV .. "/genesis.txt")):gmatch("[^\n]+") do verses[#verses + 1] = line end
  local tok = tokenizer.load(KJV)
  T.eq(tok:decode(tokens_of(m.val)), table.concat(verses, "\n", 53, 56) .. "\n<|end_of_text|>")
  -- a larger validation fraction: the last 5 of 14 documents (ceil(14 * 0.3) = 5)
  local m3 = data.open_megatron(GENESIS, {val_fraction = 0.3})
  T.eq(m3.train_documents, 9)
  T.eq(tokens_of(m3.val), concat(docs, 10, 14))
  local ds = data.megatron(GENESIS, {tokenizer = KJV})
  T.eq({ds.vocab_size, ds.tokenizer.eos_id, #ds.train, #ds.val}, {512, 1, 1, 1})
  T.eq(data.megatron(GENESIS).vocab_size, nil, "no manifest, no tokenizer: vocab= must say")
end)

-- ---- writing pairs here ------------------------------------------------------------------------

local PACK = {[1] = "I1", [8] = "I2", [4] = "i4", [5] = "i8", [2] = "i1", [3] = "i2", [6] = "d", [7] = "f"}
local SIZE = {[1] = 1, [8] = 2, [4] = 4, [5] = 8, [2] = 1, [3] = 2, [6] = 8, [7] = 4}

-- The bytes of a pair: docs is a list of documents, each a list of sequences (lists of ids).
-- -> bin, idx (the fields can be edited by the caller)
local function pair_bytes(code, docs)
  local bin, lens, ptrs, index, ptr = {}, {}, {}, {0}, 0
  for _, doc in ipairs(docs) do
    for _, seq in ipairs(doc) do
      for _, v in ipairs(seq) do bin[#bin + 1] = string.pack("<" .. PACK[code], v) end
      lens[#lens + 1] = string.pack("<i4", #seq)
      ptrs[#ptrs + 1] = string.pack("<i8", ptr)
      ptr = ptr + #seq * SIZE[code]
    end
    index[#index + 1] = #lens
  end
  local idx = {"MMIDIDX\0\0", string.pack("<I8I1I8I8", 1, code, #lens, #index), table.concat(lens), table.concat(ptrs)}
  for _, v in ipairs(index) do idx[#idx + 1] = string.pack("<i8", v) end
  return table.concat(bin), table.concat(idx)
end

local n_pairs = 0
local function write_pair(bin, idx)
  n_pairs = n_pairs + 1
  local prefix = string.format("%s/p%03d", ROOT, n_pairs)
  T.write_file(prefix .. ".bin", bin)
  T.write_file(prefix .. ".idx", idx)
  return prefix
end

-- documents with an empty document and an empty sequence among them
local function docs_for(top)
  return {{{1, 2, 3}, {top, 0}}, {}, {{7}, {}, {8, 9}}, {{top - 1, 5}}, {{4, 4, 4, 4}}}
end

T.case("pairs in every token dtype, with empty documents and sequences, read exactly", function()
  local tops = {[1] = 255, [8] = 65535, [4] = (1 << 31) - 1, [5] = (1 << 40) + 3}
  for code, top in pairs(tops) do
    local docs = docs_for(top)
    local prefix = write_pair(pair_bytes(code, docs))
    local m = data.open_megatron(prefix, {val_fraction = 0.4}) -- the last ceil(5 * 0.4) = 2 documents
    T.eq({m.width, m.sequences, m.documents, m.tokens, m.train_documents}, {SIZE[code], 7, 5, 14, 3}, "code " .. code)
    T.eq(tokens_of(m.train), concat(docs, 1, 3), "code " .. code .. " train")
    T.eq(tokens_of(m.val), concat(docs, 4, 5), "code " .. code .. " validation")
    T.eq(data.read_tokens(m.val, 1, 2):totable(), {5, 4}, "a range inside the split")
  end
  -- the empty second document ends where the first does: a split right after it starts at token 5
  local prefix = write_pair(pair_bytes(8, docs_for(9)))
  local m = data.open_megatron(prefix, {val_fraction = 0.8}) -- 4 of 5 held out: documents 2..5
  T.eq({m.train_documents, m.train.count, m.val.offset}, {1, 5, 10})
  T.eq(tokens_of(m.val), {7, 8, 9, 8, 5, 4, 4, 4, 4})
end)

-- ---- malformed pairs ---------------------------------------------------------------------------

T.case("malformed pairs: every field's error names the file and the problem", function()
  local docs = {{{1, 2}, {3}}, {{4, 5, 6}}, {{7}}}
  local bin, idx = pair_bytes(8, docs) -- S = 4 sequences, D = 4 indices, 34 + 48 + 32 = 114 bytes
  T.eq(#idx, 114)
  local function bad(what, b, i, text, file)
    local prefix = write_pair(b, i)
    local err = T.raises(function() data.open_megatron(prefix) end, text, what)
    local path = prefix .. (file or ".idx")
    T.ok(err:find("megatron " .. path .. ": ", 1, true) == 1, what .. ": names " .. path .. ": " .. err)
  end
  local function at(i, fmt, v) -- idx with the field at byte i (1-based) replaced
    return idx:sub(1, i - 1) .. string.pack(fmt, v) .. idx:sub(i + string.packsize(fmt))
  end
  local S_AT, D_AT, LEN_AT, PTR_AT, DOC_AT = 19, 27, 35, 35 + 16, 35 + 48
  bad("magic", bin, "MMIDIDY" .. idx:sub(8), "not a Megatron-LM index (bad magic")
  bad("short", bin, idx:sub(1, 30), "not a Megatron-LM index (bad magic or shorter than 34 bytes")
  bad("version", bin, at(10, "<I8", 2), "unsupported version 2 (expected 1)")
  bad("version max", bin, at(10, "<i8", -1), "unsupported version 18446744073709551615")
  for code, name in pairs({[2] = "int8", [3] = "int16", [6] = "float64", [7] = "float32"}) do
    bad("dtype " .. name, bin, at(18, "<I1", code), "dtype code " .. code .. " (" .. name .. ") is not a token type")
  end
  bad("dtype 0", bin, at(18, "<I1", 0), "unknown dtype code 0 (Megatron's are 1..8)")
  bad("dtype 9", bin, at(18, "<I1", 9), "unknown dtype code 9")
  bad("S + 1", bin, at(S_AT, "<I8", 5), "header says 5 sequences and 4 document indices, but the file has 80 bytes")
  bad("S wraps", bin, at(S_AT, "<I8", (1 << 62) + 4), "header says 4611686018427387908 sequences")
  bad("S negative", bin, at(S_AT, "<i8", -1), "header says 18446744073709551615 sequences")
  bad("D + 1", bin, at(D_AT, "<I8", 5), "header says 4 sequences and 5 document indices")
  bad("D wraps", bin, at(D_AT, "<I8", (1 << 61) + 4), "header says 4 sequences and 2305843009213693956 document")
  bad("D = 0", bin, at(D_AT, "<I8", 0), "32 bytes after the document indices (header: 4 sequences, 0 document indices)")
  bad("multimodal", bin, idx .. "\0\0\0\0", "a multimodal index (4 sequence modes after the document indices)")
  bad("trailing bytes", bin, idx .. "\0", "1 bytes after the document indices")
  bad("doc index 0", bin, at(DOC_AT, "<i8", 1), "document_indices[0] = 1: they must rise from 0 to the 4 sequences")
  bad("doc index falls", bin, at(DOC_AT + 16, "<i8", 1), "document_indices[2] = 1: they must rise")
  bad("doc index past S", bin, at(DOC_AT + 16, "<i8", 5), "document_indices[2] = 5")
  bad("last doc index", bin, at(DOC_AT + 24, "<i8", 3), "the last document index is 3, not the number of sequences 4")
  bad("negative length", bin, at(LEN_AT + 4, "<i4", -1), "sequence_lengths[1] = -1 is negative")
  bad("length + 1", bin, at(LEN_AT + 4, "<i4", 2),
    "sequence_pointers[2] = 6, but the sequences before it end at byte 8")
  bad("pointer 0", bin, at(PTR_AT, "<i8", 2), "sequence_pointers[0] = 2, but the sequences before it end at byte 0")
  bad("pointer gap", bin, at(PTR_AT + 8, "<i8", 6),
    "sequence_pointers[1] = 6, but the sequences before it end at byte 4")
  bad("long last sequence", bin, at(LEN_AT + 12, "<i4", 2), "the sequences up to 3 hold 8 tokens, more than the 7")
  bad("huge length", bin, at(LEN_AT + 12, "<i4", (1 << 31) - 1), "more than the 7 of the .bin")
  bad("bin short", bin:sub(1, -3), idx, "the sequences up to 3 hold 7 tokens, more than the 6 of the .bin")
  bad("bin long", bin .. "\0\0", idx, "16 bytes, but the index's sequences hold 7 tokens of 2 bytes", ".bin")
  bad("bin odd", bin .. "\0", idx, "15 bytes: not a whole number of 2-byte tokens", ".bin")
  local one = {pair_bytes(8, {{{1, 2, 3}}})}
  bad("one document", one[1], one[2], "1 documents: a train/validation split by documents (the last 0.05 of them)")
  T.raises(function() data.open_megatron(ROOT .. "/nowhere") end, "megatron: cannot open " .. ROOT .. "/nowhere.idx")
  local prefix = write_pair(bin, idx)
  os.remove(prefix .. ".bin")
  T.raises(function() data.open_megatron(prefix) end, "megatron: cannot open " .. prefix .. ".bin")
  T.raises(function() config.parse(train.schema, {"data=megatron:" .. prefix}) end,
    "megatron:" .. prefix .. ": no file " .. prefix .. ".bin (a Megatron-LM indexed dataset is <prefix>.bin and")
end)

-- ---- token ids against the vocabulary -----------------------------------------------------------

-- {name, dtype code, documents, options, the message after "data <prefix>.bin: "}; tokens are
-- counted from the start of the .bin
local OUT_OF_VOCAB = {
  {"uint16, id = vocab in the training split", 8, docs_for(9), {vocab_size = 9, val_fraction = 0.4},
    "token 3 is 9, outside the vocabulary of 9 ids (0..8, vocab_size 9 given); its ids run from 0 to 9"},
  {"uint16, only in the validation split (its tokens counted from the file's start)", 8,
    {{{1, 2}}, {{3}}, {{4, 10}}}, {vocab_size = 10, val_fraction = 0.5},
    "token 4 is 10, outside the vocabulary of 10 ids (0..9, vocab_size 10 given); its ids run from 3 to 10"},
  {"int32, a negative id", 4, {{{1, -1}}, {{2}}, {{3}}}, {vocab_size = 512},
    "token 1 is -1, outside the vocabulary of 512 ids (0..511, vocab_size 512 given); its ids run from -1 to 2"},
  {"int64, an id past 2^40", 5, {{{1, 2}}, {{(1 << 40) + 3, 0}}, {{3}}}, {vocab_size = 128256},
    "token 2 is 1099511627779, outside the vocabulary of 128256 ids"},
  {"past the tokenizer's vocabulary", 8, {{{1, 600}}, {{3}}, {{4}}}, {tokenizer = KJV},
    "token 1 is 600, outside the vocabulary of 512 ids (0..511, the tokenizer " .. KJV .. "/tokenizer.json)"},
}

T.case("token ids outside the vocabulary are found when the pair is opened, in either split", function()
  for _, c in ipairs(OUT_OF_VOCAB) do
    local prefix = write_pair(pair_bytes(c[2], c[3]))
    local want = "data " .. prefix .. ".bin: " .. c[5]
    local ok, err = pcall(data.megatron, prefix, c[4])
    T.eq(ok, false, c[1] .. ": opens")
    T.ok(tostring(err):sub(1, #want) == want, c[1] .. ":\n  expected " .. want .. "\n  got      " .. tostring(err))
  end
  -- uint8 ids up to 255 fit a vocabulary of 256 (the check is not the file's dtype range)
  local prefix = write_pair(pair_bytes(1, {{{200, 255}}, {{3}}, {{4}}}))
  T.eq(data.megatron(prefix, {vocab_size = 256}).megatron.train.max_id, 255)
  -- the committed pair: every id of Genesis is below the KJV tokenizer's 512; a reopen reads the cache
  local before = data.scan_stats.scanned
  local ds = data.megatron(GENESIS, {tokenizer = KJV})
  T.ok(ds.train[1].max_id < 512 and ds.val[1].max_id < 512, "Genesis fits its tokenizer")
  data.megatron(GENESIS, {tokenizer = KJV})
  T.ok(data.scan_stats.scanned - before <= 2, "at most the two splits scanned, once")
  -- training with vocab= and no tokenizer: refused before the model is built
  prefix = write_pair(pair_bytes(8, {{{1, 2, 3, 40}}, {{5, 6}}, {{7, 8}}}))
  local c = config.parse(train.defaults, {"data=megatron:" .. prefix, "vocab=32", "out=" .. ROOT .. "/oov"})
  T.raises(function() train.build(c) end, "data " .. prefix .. ".bin: token 3 is 40, outside the vocabulary of 32 ids " ..
    "(0..31, vocab=32)")
end)

-- ---- training ----------------------------------------------------------------------------------

T.case("data=megatron:<prefix> tokenizer=<tokenizer.json>: trains, evaluates, exports the tokenizer", function()
  local args = {"data=megatron:" .. GENESIS, "tokenizer=" .. KJV, "layers=1", "hidden=32", "heads=4", "kv_heads=2",
    "ffn=64", "seq=16", "batch=2", "steps=2", "eval_every=2", "eval_batches=1", "sample_tokens=4", "plot=false",
    "quiet=true", "recipe=bf16", "out=" .. ROOT .. "/run"}
  local c = config.parse(train.defaults, args)
  local p = train.build(c)
  p.peak = 1e9
  local s = train.run(c, p)
  T.eq(p.model.config.vocab_size, 512)
  T.ok(s.final_val_loss and s.final_val_loss > 0 and s.final_val_loss < 10,
    "a validation loss: " .. tostring(s.final_val_loss))
  T.eq(T.read_file(s.checkpoint .. "/model/tokenizer.json"), T.read_file(KJV .. "/tokenizer.json"))
  T.eq(cjson.decode(T.read_file(s.checkpoint .. "/model/config.json")).eos_token_id, 1)
  T.eq(s.sample_prompt, "", "no manifest prompt: from bos")
  local c2 = config.parse(train.defaults, {"data=megatron:" .. GENESIS, "out=" .. ROOT .. "/run2"})
  T.raises(function() train.build(c2) end, "config: data=megatron:" .. GENESIS .. " needs vocab=<vocabulary size> " ..
    "or tokenizer=<tokenizer.json>")
end)

T.case("cleanup: the scratch directory is removed", function()
  T.rm_tree(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
