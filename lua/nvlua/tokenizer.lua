-- nvlua.tokenizer: Hugging Face tokenizers as training data and exports see them.
--   tokenizer.load(path [, {bos_token =, eos_token =}])  a tokenizer.json (or a directory holding one)
--   tokenizer.export(tok, dir [, {model_max_length =}])  the tokenizer files of a model directory
--   tokenizer.byte_json()                                 the byte tokenizer as a tokenizer.json
--
-- The byte tokenizer (data.ByteTokenizer: id = byte value, vocabulary 256, no special tokens) is
-- exported as a byte-level BPE with no merges: the GPT-2 byte-to-unicode table (bytes 33..126,
-- 161..172, 174..255 stand for themselves, the other 68 for U+0100.. in byte order) names each
-- byte's token, and its id is the byte. A ByteLevel pre-tokenizer and decoder map text to UTF-8
-- bytes and back, so transformers' AutoTokenizer encodes any text to exactly the ids nvlua trains
-- on (scripts/check_hf_e2e.py checks it). It has no bos/eos: config.json says null, generation
-- stops at max_new_tokens. (Adding specials would make the vocabulary 257+, another model.)
--
-- A loaded tokenizer.json decodes (for train's end-of-run sample): the tokens' texts (an added
-- token's content) go through the file's decoder (ByteLevel, ByteFallback, Fuse, Replace, Strip,
-- Metaspace and Sequences of them) as the tokenizers library does, special tokens kept. It does not
-- encode (that needs the pre-tokenizer's Unicode regexes): text is tokenized by
-- scripts/prepare_data.py, which also records the ids of the sample prompt in the data's manifest.
-- bos/eos: the given names, else tokenizer_config.json beside the file, else well-known names
-- among the special added tokens (<|begin_of_text|>, <s>, <bos>, <|endoftext|>, ...).
local lfs = require "lfs"
local cjson = require "cjson"
local config = require "nvlua.config"
local util = require "nvlua.util"
local user_error = util.user_error

local tokenizer = {}

-- ---- the GPT-2 byte <-> unicode table -------------------------------------------------------

local BYTE_CHAR, CHAR_BYTE = {}, {} -- byte value -> UTF-8 text of its char, and back
do
  local n = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174)
    local cp = b
    if not printable then
      cp = 256 + n
      n = n + 1
    end
    BYTE_CHAR[b] = utf8.char(cp)
    CHAR_BYTE[utf8.char(cp)] = string.char(b)
  end
end
tokenizer.BYTE_CHAR = BYTE_CHAR

local function json_string(s) return cjson.encode(s) end

--- The byte tokenizer as a tokenizer.json text (deterministic: vocab in id order).
function tokenizer.byte_json()
  local vocab = {}
  for b = 0, 255 do vocab[#vocab + 1] = string.format("%s:%d", json_string(BYTE_CHAR[b]), b) end
  local bl = '{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true}'
  return table.concat({
    '{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,',
    '"pre_tokenizer":', bl, ',"post_processor":null,"decoder":', bl, ',',
    '"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,',
    '"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,',
    '"vocab":{', table.concat(vocab, ","), '},"merges":[]}}\n'})
end

-- ---- decoders ---------------------------------------------------------------------------------
-- Each maps a list of token strings to a list (the tokenizers library's decode_chain).

local function plain_replace(s, from, to)
  if from == "" then return s end
  local out, i = {}, 1
  while true do
    local a, b = s:find(from, i, true)
    if not a then out[#out + 1] = s:sub(i); break end
    out[#out + 1] = s:sub(i, a - 1) .. to
    i = b + 1
  end
  return table.concat(out)
end

local function map(list, fn)
  local out = {}
  for i, t in ipairs(list) do out[i] = fn(t, i) end
  return out
end

local DECODERS = {}
function DECODERS.ByteLevel(_, list)
  local out = {}
  for i, t in ipairs(list) do
    out[i] = t:gsub(utf8.charpattern, function(ch) return CHAR_BYTE[ch] or ch end)
  end
  return {table.concat(out)}
end
function DECODERS.ByteFallback(_, list)
  return map(list, function(t)
    local h = t:match("^<0x(%x%x)>$")
    return h and string.char(tonumber(h, 16)) or t
  end)
end
function DECODERS.Fuse(_, list) return {table.concat(list)} end
function DECODERS.Replace(d, list)
  local from = type(d.pattern) == "table" and d.pattern.String
  if type(from) ~= "string" or type(d.content) ~= "string" then
    user_error("tokenizer: a Replace decoder with a regex pattern is not supported (only String patterns)", 0)
  end
  return map(list, function(t) return plain_replace(t, from, d.content) end)
end
function DECODERS.Strip(d, list)
  local c, start, stop = d.content or " ", math.tointeger(d.start) or 0, math.tointeger(d.stop) or 0
  return map(list, function(t)
    for _ = 1, start do if t:sub(1, #c) == c then t = t:sub(#c + 1) end end
    for _ = 1, stop do if #t >= #c and t:sub(-#c) == c then t = t:sub(1, -#c - 1) end end
    return t
  end)
end
function DECODERS.Metaspace(d, list)
  local rep = type(d.replacement) == "string" and d.replacement or "\u{2581}"
  local strip_first = d.prepend_scheme ~= "never" and d.add_prefix_space ~= false
  return map(list, function(t, i)
    t = plain_replace(t, rep, " ")
    if i == 1 and strip_first and t:sub(1, 1) == " " then t = t:sub(2) end
    return t
  end)
end
function DECODERS.Sequence(d, list)
  for _, sub in ipairs(d.decoders or {}) do list = tokenizer.run_decoder(sub, list) end
  return list
end

--- Apply a tokenizer.json decoder (a decoded JSON object, or null: tokens joined) to a list of tokens.
function tokenizer.run_decoder(d, list)
  if d == nil or d == cjson.null then return {table.concat(list)} end
  local fn = DECODERS[d.type]
  if not fn then
    user_error(string.format("tokenizer: decoder type %s is not supported (supported: ByteLevel, ByteFallback, Fuse, " ..
      "Replace, Strip, Metaspace, Sequence)", tostring(d.type)), 0)
  end
  return fn(d, list)
end

-- ---- loading a tokenizer.json -----------------------------------------------------------------

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

-- a special token's name in tokenizer_config.json: a string or {"content": ...}
local function token_name(v)
  if type(v) == "string" then return v end
  if type(v) == "table" and type(v.content) == "string" then return v.content end
  return nil
end

local BOS_NAMES = {"<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "<|endoftext|>"}
local EOS_NAMES = {"<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|endoftext|>"}

local function check_id(path, what, v, limit)
  local i = math.type(v) == "integer" and v or (type(v) == "number" and math.tointeger(v))
  if not i or i < 0 or i >= limit then
    user_error(string.format("tokenizer %s: %s must be an integer in [0, %d), got %s", path, what, limit, tostring(v)), 0)
  end
  return i
end

-- id -> token text of the model's vocabulary and of the added tokens; -> tokens, added, size
local function vocabulary(path, t)
  local m = t.model
  if type(m) ~= "table" or type(m.vocab) ~= "table" then
    user_error("tokenizer " .. path .. ": no model.vocab (not a Hugging Face tokenizer.json?)", 0)
  end
  local tokens, added, size = {}, {}, 0
  local function put(id, text, what)
    id = check_id(path, what, id, 1 << 31)
    tokens[id] = text
    size = math.max(size, id + 1)
    return id
  end
  if #m.vocab > 0 then -- Unigram: [[piece, score], ...], the id is the position
    for i, e in ipairs(m.vocab) do put(i - 1, type(e) == "table" and tostring(e[1]) or tostring(e), "a vocab id") end
  else
    for text, id in pairs(m.vocab) do put(id, text, "the id of vocab entry " .. text) end
  end
  for _, a in ipairs(type(t.added_tokens) == "table" and t.added_tokens or {}) do
    if type(a) == "table" and type(a.content) == "string" then
      added[put(a.id, a.content, "an added token's id")] = a
    end
  end
  if size == 0 then user_error("tokenizer " .. path .. ": the vocabulary is empty", 0) end
  return tokens, added, size
end

-- the id of a token name, or nil
local function id_of(tokens, name)
  if not name then return nil end
  for id, text in pairs(tokens) do if text == name then return id end end
  return nil
end

-- bos/eos: given names, tokenizer_config.json beside path, else well-known special tokens
local function specials(path, tokens, added, o)
  local dir = path:match("^(.*)/[^/]*$") or "."
  local tc = {}
  local s = read_file(dir .. "/tokenizer_config.json")
  if s then
    local ok, v = pcall(cjson.decode, s)
    if ok and type(v) == "table" then tc = v end
  end
  local function pick(role, names)
    local name = o[role] or token_name(tc[role])
    if name then
      local id = id_of(tokens, name)
      if not id then user_error(string.format("tokenizer %s: %s %q is not in its vocabulary", path, role, name), 0) end
      return name, id
    end
    for _, n in ipairs(names) do
      local id = id_of(tokens, n)
      if id and added[id] then return n, id end
    end
    return nil, nil
  end
  local bos, bos_id = pick("bos_token", BOS_NAMES)
  local eos, eos_id = pick("eos_token", EOS_NAMES)
  return bos, bos_id, eos, eos_id
end

--- tokenizer.load(path [, {bos_token =, eos_token =}]) -> a tokenizer: {name, path, vocab_size,
-- bos_token, bos_id, eos_token, eos_id, decode(ids), text (the file's bytes)}. path: a
-- tokenizer.json or a directory holding one. Raises "tokenizer <path>: ..." on a bad file.
function tokenizer.load(path, o)
  o = o or {}
  if lfs.attributes(path, "mode") == "directory" then path = path .. "/tokenizer.json" end
  local text, err = read_file(path)
  if not text then user_error("tokenizer: cannot read " .. path .. ": " .. tostring(err), 0) end
  local ok, t = pcall(cjson.decode, text)
  if not ok or type(t) ~= "table" then user_error("tokenizer " .. path .. ": not valid JSON: " .. tostring(t), 0) end
  local tokens, added, size = vocabulary(path, t)
  local bos, bos_id, eos, eos_id = specials(path, tokens, added, o)
  local decoder = t.decoder
  local tok = {name = path, path = path, vocab_size = size, bos_token = bos, bos_id = bos_id, eos_token = eos,
    eos_id = eos_id, text = text}
  --- ids (a table of integers or an i64 tensor) -> the decoded bytes: every token's text (an added
  -- token's is its content) through the decoder, as the tokenizers library decodes (special tokens kept)
  function tok:decode(ids)
    if type(ids) ~= "table" then ids = ids:totable() end
    local list = {}
    for i, id in ipairs(ids) do
      list[i] = tokens[id]
      if list[i] == nil then
        error(string.format("tokenizer %s: id %s is not in the vocabulary", path, tostring(id)), 2)
      end
    end
    return table.concat(tokenizer.run_decoder(decoder, list))
  end
  return tok
end

-- ---- export -----------------------------------------------------------------------------------

local function write(dir, name, text, files)
  local ok, err = util.atomic_write(dir .. "/" .. name, text)
  if not ok then user_error("tokenizer.export: " .. dir .. "/" .. name .. ": " .. tostring(err), 0) end
  files[name] = #text
end

--- tokenizer.export(tok, dir [, {model_max_length =}]) -> {file name = byte size}: into the model
-- directory dir, tokenizer.json (the byte tokenizer's, or tok's file as it is), tokenizer_config.json
-- (PreTrainedTokenizerFast, the special tokens, no clean-up of spaces: decode gives the bytes back),
-- and with bos or eos special_tokens_map.json and generation_config.json.
function tokenizer.export(tok, dir, o)
  o = o or {}
  local files = {}
  local bytes = tok.name == "bytes"
  write(dir, "tokenizer.json", bytes and tokenizer.byte_json() or tok.text, files)
  local function name(v) return v or cjson.null end
  local tc = {tokenizer_class = "PreTrainedTokenizerFast", clean_up_tokenization_spaces = false,
    model_max_length = o.model_max_length, bos_token = name(tok.bos_token), eos_token = name(tok.eos_token),
    unk_token = cjson.null, pad_token = cjson.null}
  write(dir, "tokenizer_config.json", config.encode(tc) .. "\n", files)
  if tok.bos_token or tok.eos_token then
    local map = {bos_token = tok.bos_token, eos_token = tok.eos_token}
    write(dir, "special_tokens_map.json", config.encode(map) .. "\n", files)
    local gen = {bos_token_id = tok.bos_id, eos_token_id = tok.eos_id, _from_model_config = false}
    write(dir, "generation_config.json", config.encode(gen) .. "\n", files)
  end
  return files
end

return tokenizer
