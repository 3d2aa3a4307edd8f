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
-- A loaded tokenizer.json encodes and decodes, as the tokenizers library does (tok:encode(text),
-- tok:decode(ids)). Encoding (BPE models: GPT-2, Llama 2 and 3, Mistral, Qwen2 ...) runs in C
-- (core/bpe.c, PCRE2 regexes, utf8proc normalization); here the JSON becomes its spec, Sequences
-- flattened, and a component it does not support is refused by name. The encoder is built at the first
-- encode, so a file that only decodes (a WordPiece or Unigram model) still loads. Decoding: the
-- tokens' texts (an added token's content) go through the file's decoder (ByteLevel, ByteFallback, Fuse,
-- Replace, Strip, Metaspace and Sequences of them), special tokens kept.
-- bos/eos: the given names, else tokenizer_config.json beside the file, else well-known names
-- among the special added tokens (<|begin_of_text|>, <s>, <bos>, <|endoftext|>, ...).
local lfs = require "lfs"
local cjson = require "cjson"
local core = require "nvlua.core"
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

-- ---- encoding ---------------------------------------------------------------------------------
-- The JSON's normalizer, pre-tokenizer and model as the spec of core.bpe_new (lua/bind/tokenizer.c).

local NORMALIZERS_OK = "NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip, StripAccents, Sequence"
local PRE_OK = "Split, ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit, Punctuation, Sequence"
-- the GPT-2 regex of the ByteLevel pre-tokenizer (tokenizers' pre_tokenizers/byte_level.rs)
local GPT2_REGEX = [['s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+]]
-- the Whitespace pre-tokenizer's \w+|[^\w\s]+, which tokenizers runs with the Rust regex crate: its \w
-- (Alphabetic, marks, Nd, Pc, Join_Control) and \s (White_Space) spelled out, as neither PCRE2's nor
-- Oniguruma's (which file regexes are read as, core/bpe.c) are the same sets
local RUST_WORD = [[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]]
local WHITESPACE_REGEX = "[" .. RUST_WORD .. "]+|[^" .. RUST_WORD .. [[\t-\r\x{85}\p{Z}]+]]
local BEHAVIORS = {Removed = true, Isolated = true, MergedWithPrevious = true, MergedWithNext = true,
  Contiguous = true}

local function is_null(v) return v == nil or v == cjson.null end

-- a Split / Replace pattern {"String": s} or {"Regex": r} -> s or r, is_regex
local function pattern_of(path, what, p)
  if type(p) == "table" and type(p.String) == "string" then return p.String, false end
  if type(p) == "table" and type(p.Regex) == "string" then return p.Regex, true end
  user_error(string.format("tokenizer %s: %s needs a pattern {\"String\": ...} or {\"Regex\": ...}", path, what), 0)
end

local function add_normalizer(path, n, out)
  if is_null(n) then return end
  local t = n.type
  if t == "Sequence" then
    for _, sub in ipairs(n.normalizers or {}) do add_normalizer(path, sub, out) end
  elseif t == "NFC" or t == "NFD" or t == "NFKC" or t == "NFKD" or t == "Lowercase" or t == "StripAccents" then
    out[#out + 1] = {kind = t}
  elseif t == "Replace" then
    local p, regex = pattern_of(path, "a Replace normalizer", n.pattern)
    out[#out + 1] = {kind = regex and "ReplaceRegex" or "Replace", a = p, c = tostring(n.content or "")}
  elseif t == "Prepend" then
    out[#out + 1] = {kind = "Prepend", a = tostring(n.prepend or "")}
  elseif t == "Strip" then
    out[#out + 1] = {kind = "Strip", flag = (n.strip_left and 1 or 0) | (n.strip_right and 2 or 0)}
  else
    user_error(string.format("tokenizer %s: normalizer type %s is not supported for encoding (supported: %s)", path,
      tostring(t), NORMALIZERS_OK), 0)
  end
end

local function add_pre(path, p, out)
  if is_null(p) then return end
  local t = p.type
  if t == "Sequence" then
    for _, sub in ipairs(p.pretokenizers or {}) do add_pre(path, sub, out) end
  elseif t == "Split" then
    local pat, regex = pattern_of(path, "a Split pre-tokenizer", p.pattern)
    local b = p.behavior or "Isolated"
    if not BEHAVIORS[b] then user_error(string.format("tokenizer %s: Split behavior %s is not known", path, tostring(b)), 0) end
    out[#out + 1] = {kind = regex and "SplitRegex" or "SplitString", a = pat, behavior = b, invert = p.invert == true}
  elseif t == "ByteLevel" then
    if p.add_prefix_space then out[#out + 1] = {kind = "PrefixSpace"} end
    if p.use_regex ~= false then out[#out + 1] = {kind = "SplitRegex", a = GPT2_REGEX, behavior = "Isolated"} end
    out[#out + 1] = {kind = "Bytes"}
  elseif t == "Metaspace" then
    local rep = type(p.replacement) == "string" and p.replacement or "\u{2581}"
    local scheme = p.prepend_scheme or (p.add_prefix_space == false and "never" or "always")
    local flag = ({never = 0, first = 1, always = 2})[scheme]
    if not flag then user_error(string.format("tokenizer %s: Metaspace prepend_scheme %s is not known", path, tostring(scheme)), 0) end
    out[#out + 1] = {kind = "Metaspace", a = rep, flag = flag}
    if p.split ~= false then out[#out + 1] = {kind = "SplitString", a = rep, behavior = "MergedWithNext"} end
  elseif t == "Digits" then
    out[#out + 1] = {kind = "SplitDigit", behavior = p.individual_digits and "Isolated" or "Contiguous"}
  elseif t == "Whitespace" then
    out[#out + 1] = {kind = "SplitRegex", a = WHITESPACE_REGEX, behavior = "Removed", invert = true}
  elseif t == "WhitespaceSplit" then
    out[#out + 1] = {kind = "SplitSpace", behavior = "Removed"}
  elseif t == "Punctuation" then
    local b = p.behavior or "Isolated"
    if not BEHAVIORS[b] then user_error(string.format("tokenizer %s: Punctuation behavior %s is not known", path, tostring(b)), 0) end
    out[#out + 1] = {kind = "SplitPunct", behavior = b}
  else
    user_error(string.format("tokenizer %s: pre-tokenizer type %s is not supported for encoding (supported: %s)", path,
      tostring(t), PRE_OK), 0)
  end
end

-- the merges, "a b" strings or [a, b] pairs, as one flat list a1, b1, a2, b2, ...
local function flat_merges(path, merges)
  local out = {}
  for i, m in ipairs(merges) do
    local a, b
    if type(m) == "string" then
      a, b = m:match("^([^ ]*) ([^ ]*)$")
    elseif type(m) == "table" and #m == 2 then
      a, b = m[1], m[2]
    end
    if type(a) ~= "string" or type(b) ~= "string" then
      user_error(string.format("tokenizer %s: merge %d is not \"a b\" nor a pair [a, b]: %s", path, i, cjson.encode(m)), 0)
    end
    out[2 * i - 1], out[2 * i] = a, b
  end
  return out
end

-- the post-processor's ids around a text's (add_special_tokens): -> a function(ids) -> ids
local function post_processor(path, p, tokens)
  if is_null(p) or p.type == "ByteLevel" then return function(ids) return ids end end
  local function around(before, after)
    return function(ids)
      local out = {}
      table.move(before, 1, #before, 1, out)
      table.move(ids, 1, #ids, #out + 1, out)
      table.move(after, 1, #after, #out + 1, out)
      return out
    end
  end
  if p.type == "TemplateProcessing" then
    local before, after, seen = {}, {}, false
    for _, item in ipairs(p.single or {}) do
      if type(item.Sequence) == "table" then
        seen = true
      elseif type(item.SpecialToken) == "table" then
        local sp = (p.special_tokens or {})[item.SpecialToken.id]
        if type(sp) ~= "table" or type(sp.ids) ~= "table" then
          user_error(string.format("tokenizer %s: TemplateProcessing names special token %s but does not define it", path,
            tostring(item.SpecialToken.id)), 0)
        end
        local dst = seen and after or before
        for _, id in ipairs(sp.ids) do dst[#dst + 1] = check_id(path, "a special token's id", id, 1 << 31) end
      end
    end
    return around(before, after)
  elseif p.type == "RobertaProcessing" or p.type == "BertProcessing" then
    local cls, sep = p.cls, p.sep
    if type(cls) ~= "table" or type(sep) ~= "table" then
      user_error(string.format("tokenizer %s: %s needs cls and sep", path, p.type), 0)
    end
    return around({check_id(path, "cls", cls[2], 1 << 31)}, {check_id(path, "sep", sep[2], 1 << 31)})
  elseif p.type == "Sequence" then
    local fns = {}
    for i, sub in ipairs(p.processors or {}) do fns[i] = post_processor(path, sub, tokens) end
    return function(ids)
      for _, fn in ipairs(fns) do ids = fn(ids) end
      return ids
    end
  end
  user_error(string.format("tokenizer %s: post-processor type %s is not supported (supported: TemplateProcessing, " ..
    "ByteLevel, RobertaProcessing, BertProcessing, Sequence)", path, tostring(p.type)), 0)
end

-- the C encoder and the post-processor of a decoded tokenizer.json
local function build_encoder(path, t, tokens)
  local m = t.model
  if m.type ~= "BPE" and not (m.type == nil and type(m.merges) == "table") then
    user_error(string.format("tokenizer %s: model type %s is not supported for encoding (supported: BPE)", path,
      tostring(m.type)), 0)
  end
  if not is_null(m.dropout) and m.dropout ~= 0 then
    user_error(string.format("tokenizer %s: BPE dropout %s is not supported (encoding is deterministic)", path,
      tostring(m.dropout)), 0)
  end
  local spec = {vocab = m.vocab, merges = flat_merges(path, type(m.merges) == "table" and m.merges or {}),
    fuse_unk = m.fuse_unk == true, byte_fallback = m.byte_fallback == true, ignore_merges = m.ignore_merges == true,
    prefix = not is_null(m.continuing_subword_prefix) and m.continuing_subword_prefix or nil,
    suffix = not is_null(m.end_of_word_suffix) and m.end_of_word_suffix or nil, normalizers = {}, pre = {}, added = {}}
  if not is_null(m.unk_token) then
    spec.unk_id = m.vocab[m.unk_token]
    if not spec.unk_id then
      user_error(string.format("tokenizer %s: unk_token %q is not in the model's vocabulary", path, m.unk_token), 0)
    end
  end
  add_normalizer(path, t.normalizer, spec.normalizers)
  add_pre(path, t.pre_tokenizer, spec.pre)
  -- in the file's order: of two with the same (normalized) text, the library matches the first listed
  for _, a in ipairs(type(t.added_tokens) == "table" and t.added_tokens or {}) do
    if type(a) == "table" and type(a.content) == "string" then
      spec.added[#spec.added + 1] = {content = a.content, id = a.id, flags = (a.lstrip and 1 or 0) |
        (a.rstrip and 2 or 0) | (a.single_word and 4 or 0) | (a.normalized and 8 or 0)}
    end
  end
  return core.bpe_new(spec), post_processor(path, t.post_processor, tokens)
end

local Tokenizer = {}
Tokenizer.__index = Tokenizer
local function boolean(v) return type(v) ~= "boolean" and "must be true or false" or nil end
local ENCODE_OPTS = {add_special_tokens = boolean, tensor = boolean}
tokenizer.ENCODE_OPTS = ENCODE_OPTS

--- tok:encode(text [, {add_special_tokens = false, tensor = false}]) -> the ids (0-based) of text as
-- the tokenizers library gives them (added tokens in the text are recognised); add_special_tokens:
-- the post-processor's too (Llama's BOS); tensor: a 1-D i64 tensor instead of a table.
function Tokenizer:encode(text, o)
  if type(text) ~= "string" then error("tokenizer:encode: text must be a string, got " .. type(text), 2) end
  o = util.check_opts(o, ENCODE_OPTS, "tokenizer:encode")
  if not self._bpe then self._bpe, self._post = build_encoder(self.path, self._json, self._tokens) end
  if not o.add_special_tokens then return self._bpe:encode(text, o.tensor) end
  local ids = self._post(self._bpe:encode(text))
  return o.tensor and core.tensor(ids, "i64") or ids
end

--- tok:decode(ids) -> text: ids (a table of integers or an i64 tensor), every token's text (an added
-- token's is its content) through the decoder, as the tokenizers library decodes (special tokens kept)
function Tokenizer:decode(ids)
  if type(ids) ~= "table" then ids = ids:totable() end
  local list = {}
  for i, id in ipairs(ids) do
    list[i] = self._tokens[id]
    if list[i] == nil then
      error(string.format("tokenizer %s: id %s is not in the vocabulary", self.path, tostring(id)), 2)
    end
  end
  return table.concat(tokenizer.run_decoder(self._json.decoder, list))
end

--- tokenizer.load(path [, {bos_token =, eos_token =}]) -> a tokenizer: {name, path, vocab_size,
-- bos_token, bos_id, eos_token, eos_id, text (the file's bytes)} with tok:encode and tok:decode.
-- path: a tokenizer.json or a directory holding one. Raises "tokenizer <path>: ..." on a bad file.
function tokenizer.load(path, o)
  o = o or {}
  if lfs.attributes(path, "mode") == "directory" then path = path .. "/tokenizer.json" end
  local text, err = read_file(path)
  if not text then user_error("tokenizer: cannot read " .. path .. ": " .. tostring(err), 0) end
  local ok, t = pcall(cjson.decode, text)
  if not ok or type(t) ~= "table" then user_error("tokenizer " .. path .. ": not valid JSON: " .. tostring(t), 0) end
  local tokens, added, size = vocabulary(path, t)
  local bos, bos_id, eos, eos_id = specials(path, tokens, added, o)
  return setmetatable({name = path, path = path, vocab_size = size, bos_token = bos, bos_id = bos_id, eos_token = eos,
    eos_id = eos_id, text = text, _json = t, _tokens = tokens}, Tokenizer)
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
