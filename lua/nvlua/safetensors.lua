-- nvlua.safetensors: read and write the safetensors format (Hugging Face), the checkpoint format.
--   local st = require "nvlua.safetensors"
--   st.save(path, {name = tensor, ...}, {key = "string", ...})   -- atomic: temp file + rename
--   local tensors, metadata = st.load(path)
--   local header, metadata, layout = st.read_header(path)        -- no tensor data read
--
-- The format: 8 bytes N (u64 little-endian), N bytes of JSON header, then the data section.
-- The header maps each tensor name to {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
-- (byte range [b, e) relative to the data section) plus an optional "__metadata__" object of
-- string → string. Data is row-major, little-endian, unstrided.
--
-- The reader follows the rules of the reference implementation (huggingface/safetensors,
-- safetensors/src/tensor.rs `read_metadata` / `Metadata::validate`, and its README): the header
-- is at most 100 MB of valid UTF-8 JSON; every tensor's byte size is exactly numel × element size
-- (computed with overflow checks); and the tensors, ordered by offset, cover the data section
-- exactly — no overlaps, no holes, no trailing bytes (the reference calls this
-- MetadataIncompleteBuffer; it prevents polyglot files). The header is read by a strict JSON
-- decoder of its own (below; lua-cjson would take NaN, hex and float dims, and silently merge
-- duplicate keys), which accepts what the reference's serde_json accepts, integers read exactly,
-- except where the format's README is stricter than the reference and nvlua follows the
-- README: the header must begin with '{' and be padded only with spaces (the reference also takes
-- leading and trailing tabs/newlines), no key may repeat in any object (the reference keeps the
-- last of two same-named tensors or metadata keys), and a tensor entry must be an object (serde
-- also takes [dtype, shape, offsets]). nvlua also refuses what its tensors cannot hold: the
-- format's other dtypes, more than 8 dims, and (in an empty tensor) dims above 2^53 or dims whose
-- product, a 0 counted as 1, passes 2^59.
-- scripts/fuzz_safetensors_ref.py measures the agreement with the reference on mutated files.
-- Malformed files raise "safetensors: <path>: <problem>"; a file that cannot be opened or read
-- returns nil, msg.
--
-- The writer orders tensors as the reference does (its dtype enum, in decreasing alignment, then
-- name), so every tensor is aligned to its element size and the output for a given input is
-- byte-identical to safetensors' own `save_file` (checked against safetensors 0.8.0; metadata keys
-- are sorted, where the reference leaves their order to a hash map). It writes through
-- util.atomic_write (a temp file <path>.tmp, fsync'd and renamed over the target), so a reader sees
-- the old file or the new one, never a half-written one.
--
-- With {f16 = "f32"}, load reads F16 tensors into f32 tensors (exactly: every half value is an f32
-- value) and read_header takes them (reporting dtype F16); without it F16 is refused like the
-- other dtypes nvlua has no tensor type for. The writer does not write F16.
-- With {f8 = "u8"}, load reads F8_E4M3, F8_E5M2 and F8_E8M0 tensors as u8 tensors of their raw
-- bytes (the codes of a quantized checkpoint's weights and scales, decoded by their reader,
-- deploy_read.lua) and read_header takes them (reporting their own dtype); without it they are
-- refused. The writer does not write them.
-- Not here: lazy/mmap loading of single tensors (load reads each tensor once, by offset), dtypes
-- nvlua has no tensor type for (F16 unless asked, F64, BOOL, I8, ...: rejected with the list of supported ones),
-- quantized tensors (store their codes and scales as u8/f32 tensors; st.typed writes u8 codes under an
-- F8_* dtype, which load reads back as u8 with {f8 = "u8"}).
local nv = require "nvlua"
local core = require "nvlua.core"
local util = require "nvlua.util"
local user_error = util.user_error

local st = {}

local MAX_HEADER = 100000000 -- bytes; the reference implementation's limit

-- safetensors dtype name ↔ nvlua dtype name, element size in bytes;
-- rank: the position in the reference's Dtype enum (increasing alignment), which orders the writer
-- F16 (IEEE half, which nvlua has no tensor type for) is read into f32 tensors, exactly
-- (core.from_f16_bytes), when the reader is asked to ({f16 = "f32"}); the writer never writes it.
local DTYPES = {
  F32 = {nv = "f32", size = 4, rank = 4},
  BF16 = {nv = "bf16", size = 2, rank = 2},
  F16 = {nv = "f32", size = 2, rank = 2, read_only = true},
  F8_E4M3 = {nv = "u8", size = 1, rank = 1, read_only = true, f8 = true},
  F8_E5M2 = {nv = "u8", size = 1, rank = 1, read_only = true, f8 = true},
  F8_E8M0 = {nv = "u8", size = 1, rank = 1, read_only = true, f8 = true},
  I32 = {nv = "i32", size = 4, rank = 3},
  I64 = {nv = "i64", size = 8, rank = 5},
  U8 = {nv = "u8", size = 1, rank = 1},
}
local FROM_NV = {}
for name, d in pairs(DTYPES) do if not d.read_only then FROM_NV[d.nv] = name end end
local SUPPORTED = "F32, BF16, I32, I64, U8"
-- dtypes the format defines that nvlua has no tensor type for
local SPEC_ONLY = {BOOL = true, I8 = true, U16 = true, I16 = true, F16 = true, U32 = true, F64 = true, U64 = true,
  F8_E4M3 = true, F8_E5M2 = true, F8_E8M0 = true, F8_E4M3FNUZ = true, F8_E5M2FNUZ = true, F4 = true, F6_E2M3 = true,
  F6_E3M2 = true, C64 = true}

st.dtypes = DTYPES

-- 8-bit float dtypes written from the codes in a u8 tensor (st.typed): nvlua keeps fp8 values as codes.
-- rank: their place in the reference's Dtype enum, between U8 (and I8) and BF16 (safetensors 0.8.0
-- orders F8_E8M0, F8_E4M3, F8_E5M2 after BF16 and before I8, U8).
local CODE_DTYPES = {F8_E5M2 = 1.2, F8_E4M3 = 1.3, F8_E8M0 = 1.4}
local TYPED = {}

--- st.typed(t, dtype) -> a value st.save writes as the bytes of t (a u8 tensor of 8-bit codes) under the
--- safetensors dtype F8_E4M3, F8_E5M2 or F8_E8M0 (an exported checkpoint's fp8 weights and block scales).
function st.typed(t, dtype)
  if not CODE_DTYPES[dtype] then
    error(string.format("safetensors: typed: dtype must be F8_E4M3, F8_E5M2 or F8_E8M0, got %s", tostring(dtype)), 2)
  end
  if not nv.is_tensor(t) or t:dtype() ~= "u8" then
    error(string.format("safetensors: typed: %s needs a u8 tensor of codes, got %s", dtype,
      nv.is_tensor(t) and t:dtype() .. " tensor" or type(t)), 2)
  end
  return setmetatable({t = t, dtype = dtype}, TYPED)
end

--- st.fsync_hook(path, is_dir): make path durable; save calls it with the temp file (is_dir false)
--- after closing it and before the rename, and with the directory (is_dir true) after the rename.
--- It returns true, or nil and a message (save then fails with nil, msg). core.fsync by default;
--- tests replace it to simulate a failing disk.
st.fsync_hook = core.fsync

-- ---- writing ------------------------------------------------------------------------------------

-- JSON string literal, escaped as serde_json does (so headers match the reference byte for byte)
local ESC = {['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f', ['\n'] = '\\n', ['\r'] = '\\r',
  ['\t'] = '\\t'}
local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    if c == "\127" then return c end
    return ESC[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

-- the entries of a save, in file order: {name, t = tensor, dtype = "F32".., shape, nbytes}
local function plan_save(path, tensors)
  if type(tensors) ~= "table" then
    error(string.format("safetensors: %s: save: tensors must be a table {name = tensor}, got %s", path, type(tensors)), 0)
  end
  local list = {}
  for name, t in pairs(tensors) do
    if type(name) ~= "string" or name == "" then
      error(string.format("safetensors: %s: save: tensor names must be non-empty strings, got %s", path, tostring(name)), 0)
    end
    if name == "__metadata__" then
      error(string.format("safetensors: %s: save: '__metadata__' is reserved and cannot name a tensor", path), 0)
    end
    if not utf8.len(name) then error(string.format("safetensors: %s: save: tensor name %q is not valid UTF-8", path, name), 0) end
    local sd
    if getmetatable(t) == TYPED then t, sd = t.t, t.dtype end -- st.typed: fp8 codes
    if not nv.is_tensor(t) and not util.is_tensor_source(t) then
      error(string.format("safetensors: %s: save: '%s' is not an nvlua tensor (got %s)", path, name,
        type(t) == "userdata" and "a quantized tensor or other userdata" or type(t)), 0)
    end
    local dt = t:dtype()
    sd = sd or FROM_NV[dt]
    if not sd then
      user_error(string.format("safetensors: %s: save: tensor '%s' has dtype %s, which safetensors cannot hold here (supported: f32 bf16 i32 i64 u8)", path, name, dt), 0)
    end
    local shape = t:size()
    list[#list + 1] = {name = name, t = t, dtype = sd, shape = shape, nbytes = t:numel() * (CODE_DTYPES[sd] and 1 or DTYPES[sd].size)}
  end
  local function rank(d) return CODE_DTYPES[d] or DTYPES[d].rank end
  table.sort(list, function(a, b)
    local ra, rb = rank(a.dtype), rank(b.dtype)
    if ra ~= rb then return ra > rb end
    return a.name < b.name
  end)
  return list
end

local function header_json(path, list, metadata)
  local meta = {format = "pt"}
  if metadata ~= nil then
    if type(metadata) ~= "table" then
      error(string.format("safetensors: %s: save: metadata must be a table of strings, got %s", path, type(metadata)), 0)
    end
    for k, v in pairs(metadata) do
      if type(k) ~= "string" or type(v) ~= "string" then
        error(string.format("safetensors: %s: save: metadata must map strings to strings, got %s = %s (%s); encode other values yourself (e.g. cjson.encode)",
          path, tostring(k), tostring(v), type(v)), 0)
      end
      meta[k] = v
    end
  end
  local keys = {}
  for k in pairs(meta) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = json_string(k) .. ":" .. json_string(meta[k]) end
  local out = {'{"__metadata__":{' .. table.concat(parts, ",") .. "}"}
  local offset = 0
  for _, e in ipairs(list) do
    local dims = {}
    for i, d in ipairs(e.shape) do dims[i] = string.format("%d", d) end
    out[#out + 1] = string.format('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', json_string(e.name), e.dtype,
      table.concat(dims, ","), offset, offset + e.nbytes)
    offset = offset + e.nbytes
  end
  local h = table.concat(out, ",") .. "}"
  return h .. string.rep(" ", (8 - #h % 8) % 8)
end

--- st.save(path, tensors, metadata) -> true, bytes | nil, msg
--- Writes {name = tensor (or a util.tensor_source, made as it is written)} and metadata (string → string; "format" defaults to "pt") atomically; the
--- tensors' bytes go from their memory to the file (core.write_tensor; a CUDA tensor's through a host
--- copy). An I/O failure (directory missing, disk full) returns nil, msg; a bad argument raises.
--- Either way the temp file is removed and an existing file at path is left as it was.
function st.save(path, tensors, metadata)
  if type(path) ~= "string" then error("safetensors: save: path must be a string, got " .. type(path), 2) end
  local list = plan_save(path, tensors)
  local header = header_json(path, list, metadata)
  local ok, err = util.atomic_write(path, function(put)
    put(string.pack("<I8", #header))
    put(header)
    for _, e in ipairs(list) do
      local ok2, err2
      if util.is_tensor_source(e.t) then -- made now (a sharded run's gathered parameter), its bytes put
        ok2, err2 = pcall(e.t.write, put)
      else
        ok2, err2 = pcall(put, e.t)
      end
      if not ok2 then
        if type(err2) == "table" then error(err2, 0) end -- an I/O failure: atomic_write reports it
        error(string.format("safetensors: %s: save: tensor '%s': %s", path, e.name, tostring(err2)), 0)
      end
    end
  end, {tmp = path .. ".tmp", fsync = st.fsync_hook})
  if not ok then return nil, string.format("safetensors: %s: %s", path, err) end
  return true, err
end

-- ---- reading ------------------------------------------------------------------------------------

local function bad(path, fmt, ...)
  user_error(string.format("safetensors: %s: " .. fmt, path, ...), 0)
end

local function open_for_read(path)
  if type(path) ~= "string" then error("safetensors: path must be a string, got " .. type(path), 3) end
  local f, err = io.open(path, "rb")
  if not f then
    local reason = tostring(err)
    if reason:sub(1, #path + 2) == path .. ": " then reason = reason:sub(#path + 3) end
    return nil, string.format("safetensors: %s: cannot open: %s", path, reason)
  end
  return f
end

-- read n bytes; returns the string (possibly shorter at EOF) or nil, msg on an I/O error
local function read_exact(f, n)
  if n == 0 then return "" end
  local s, err = f:read(n)
  if s == nil and err then return nil, err end
  return s or ""
end

-- ---- the header's JSON ----------------------------------------------------------------------------
-- A strict decoder for JSON (RFC 8259) as the reference reads it with serde_json: no NaN/Infinity,
-- hex, leading '+' or leading zeros; strings without raw control characters, with only the JSON
-- escapes and no lone surrogates; a number that overflows a double is an error; nesting deeper
-- than 127 levels is an error (serde_json's recursion limit); and, stricter than serde_json, a
-- duplicate key in any object is an error (the format forbids them). Decoded values: strings,
-- booleans; NULL for null; a Lua integer for an integer literal (no fraction or exponent, not -0)
-- in the int64 range; a NONINT table {text = literal, integer = true|nil} for any other number;
-- tables with the OBJECT or ARRAY metatable for objects and arrays.
-- Values nothing reads (an entry's fields other than dtype, shape and data_offsets; a list or
-- object where a tensor entry or a metadata string belongs) are checked the same way but not kept:
-- they decode to the SKIPPED_* placeholders, so a hostile 100 MB header of unread values costs
-- time, not gigabytes of tables.

local NULL = setmetatable({}, {__name = "null"})
local OBJECT, ARRAY, NONINT = {__name = "object"}, {__name = "list"}, {__name = "number"}
local SKIPPED_OBJECT, SKIPPED_ARRAY = setmetatable({}, OBJECT), setmetatable({}, ARRAY)
local SKIPPED_NUMBER = setmetatable({text = "a number"}, NONINT)
local MAX_DEPTH = 127
local ENTRY_FIELDS = {dtype = true, shape = true, data_offsets = true}

-- c: {s = header text, path = file, top = the top-level key being read}
local function json_fail(c, i, fmt, ...)
  local near = c.s:sub(math.max(1, i - 12), i + 12)
  bad(c.path, "header is not valid JSON: %s at byte %d of the header (near %q)", string.format(fmt, ...), i, near)
end

local WS = {[32] = true, [9] = true, [10] = true, [13] = true}

local function skip_ws(s, i)
  if not WS[s:byte(i)] then return i end -- the common case, without a pattern match
  local _, e = s:find("^[ \t\n\r]*", i)
  return e + 1
end

local ESCAPES = {['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t'}

-- the code point of the \uXXXX escape at i (a surrogate pair counts as one) and the index after it
local function parse_u(c, i)
  local s = c.s
  local h = s:match("^\\u(%x%x%x%x)", i)
  if not h then json_fail(c, i, "invalid \\u escape") end
  local cp = tonumber(h, 16)
  if cp >= 0xDC00 and cp <= 0xDFFF then json_fail(c, i, "lone trailing surrogate \\u%s", h) end
  if cp < 0xD800 or cp > 0xDBFF then return cp, i + 6 end
  local lo = s:match("^\\u(%x%x%x%x)", i + 6)
  local lcp = lo and tonumber(lo, 16)
  if not lcp or lcp < 0xDC00 or lcp > 0xDFFF then json_fail(c, i, "lone leading surrogate \\u%s", h) end
  return 0x10000 + ((cp - 0xD800) << 10) + (lcp - 0xDC00), i + 12
end

-- the string whose opening quote is at i ("" when skipped), and the index after its closing quote
local function parse_string(c, i, skip)
  local s, parts, j = c.s, nil, i + 1
  while true do
    local k = s:find('[\0-\31"\\]', j)
    if not k then json_fail(c, i, "unterminated string") end
    local b = s:byte(k)
    if b == 34 then -- '"'
      if skip then return "", k + 1 end
      if not parts then return s:sub(i + 1, k - 1), k + 1 end
      parts[#parts + 1] = s:sub(j, k - 1)
      return table.concat(parts), k + 1
    elseif b == 92 then -- '\'
      parts = parts or {}
      if not skip then parts[#parts + 1] = s:sub(j, k - 1) end
      local e = s:sub(k + 1, k + 1)
      local piece
      if ESCAPES[e] then
        piece, j = ESCAPES[e], k + 2
      elseif e == "u" then
        piece, j = parse_u(c, k)
        piece = utf8.char(piece)
      else
        json_fail(c, k, "invalid escape '\\%s'", e)
      end
      if not skip then parts[#parts + 1] = piece end
    else
      json_fail(c, k, "control character 0x%02x in a string (it must be escaped)", b)
    end
  end
end

-- the number at i (see the decoded values above; SKIPPED_NUMBER when skipped) and the index after it
local function parse_number(c, i, skip)
  local s = c.s
  local _, e = s:find("^-?%d+", i)
  if not e then json_fail(c, i, "invalid number") end
  local first = s:byte(i) == 45 and i + 1 or i
  if s:byte(first) == 48 and e > first then json_fail(c, i, "invalid number (leading zero)") end
  local whole = true
  if s:byte(e + 1) == 46 then -- '.'
    local _, f = s:find("^%d+", e + 2)
    if not f then json_fail(c, i, "invalid number (no digit after '.')") end
    e, whole = f, false
  end
  local x = s:byte(e + 1)
  if x == 101 or x == 69 then -- 'e', 'E'
    local _, f = s:find("^[+-]?%d+", e + 2)
    if not f then json_fail(c, i, "invalid number (bad exponent)") end
    e, whole = f, false
  end
  if skip and whole and e - i < 300 then return SKIPPED_NUMBER, e + 1 end -- far below the double range's end
  local text = s:sub(i, e)
  local v = tonumber(text)
  if v == math.huge or v == -math.huge then json_fail(c, i, "number out of range") end
  if skip then return SKIPPED_NUMBER, e + 1 end
  if whole and math.type(v) == "integer" and text ~= "-0" then return v, e + 1 end
  return setmetatable({text = text, integer = whole and text ~= "-0" or nil}, NONINT), e + 1
end

local parse_value

local function parse_array(c, i, depth, skip)
  local s, arr = c.s, skip and SKIPPED_ARRAY or setmetatable({}, ARRAY)
  i = skip_ws(s, i + 1)
  if s:byte(i) == 93 then return arr, i + 1 end -- ']'
  local n = 0
  while true do
    local v
    v, i = parse_value(c, i, depth, skip)
    if not skip then n = n + 1; arr[n] = v end
    i = skip_ws(s, i)
    local b = s:byte(i)
    if b == 93 then return arr, i + 1 end
    if b ~= 44 then json_fail(c, i, "expected ',' or ']'") end
    i = skip_ws(s, i + 1)
  end
end

-- whether the value at i under key of the object at depth is unread (see SKIPPED_* above)
local function unread(c, s, i, depth, key)
  local b = s:byte(i)
  if depth == 1 then return b == 91 end -- a list where a tensor entry belongs
  if depth ~= 2 then return false end
  if c.top == "__metadata__" then return b == 91 or b == 123 end
  return not ENTRY_FIELDS[key]
end

local function parse_object(c, i, depth, skip)
  local s, obj = c.s, skip and {} or setmetatable({}, OBJECT) -- when skipped: the set of keys seen
  i = skip_ws(s, i + 1)
  if s:byte(i) == 125 then return skip and SKIPPED_OBJECT or obj, i + 1 end -- '}'
  while true do
    if s:byte(i) ~= 34 then json_fail(c, i, "expected a string key") end
    local at, key = i, nil
    key, i = parse_string(c, i)
    if rawget(obj, key) ~= nil then
      local where = depth == 1 and "the header" or c.top == "__metadata__" and "__metadata__"
        or string.format(depth == 2 and "tensor '%s'" or "a value inside tensor '%s'", c.top)
      bad(c.path, "duplicate key '%s' in %s (at byte %d of the header; the format forbids duplicate keys)", key, where,
        at)
    end
    if depth == 1 then c.top = key end
    i = skip_ws(s, i)
    if s:byte(i) ~= 58 then json_fail(c, i, "expected ':'") end -- ':'
    i = skip_ws(s, i + 1)
    local v
    v, i = parse_value(c, i, depth, skip or unread(c, s, i, depth, key))
    obj[key] = skip and true or v
    i = skip_ws(s, i)
    local b = s:byte(i)
    if b == 125 then return skip and SKIPPED_OBJECT or obj, i + 1 end
    if b ~= 44 then json_fail(c, i, "expected ',' or '}'") end
    i = skip_ws(s, i + 1)
  end
end

local LITERALS = {t = {"true", true}, f = {"false", false}, n = {"null", NULL}}

-- the value at i (no whitespace before it) inside depth open containers, and the index after it
function parse_value(c, i, depth, skip)
  local s = c.s
  local b = s:byte(i)
  if b == 123 or b == 91 then -- '{', '['
    if depth >= MAX_DEPTH then json_fail(c, i, "nesting deeper than %d levels", MAX_DEPTH) end
    return (b == 123 and parse_object or parse_array)(c, i, depth + 1, skip)
  elseif b == 34 then
    return parse_string(c, i, skip)
  elseif b == 45 or (b and b >= 48 and b <= 57) then
    return parse_number(c, i, skip)
  end
  local lit = LITERALS[s:sub(i, i)]
  if lit and s:sub(i, i + #lit[1] - 1) == lit[1] then return lit[2], i + #lit[1] end
  json_fail(c, i, b and "expected a value" or "unexpected end of the header")
end

-- a decoded value as a message shows it
local function show(v)
  local mt = getmetatable(v)
  if mt == NONINT then return v.text .. (v.integer and " (too large)" or "") end
  if v == SKIPPED_ARRAY then return "a list" end
  if mt == ARRAY then
    local parts = {}
    for k = 1, math.min(#v, 8) do parts[k] = show(v[k]) end
    return "[" .. table.concat(parts, ", ") .. (#v > 8 and ", ...]" or "]")
  end
  if mt == OBJECT then return "an object" end
  if v == NULL then return "null" end
  if type(v) == "string" then return v .. " (a string)" end
  return tostring(v)
end

-- "a list", "an object", "null", "a string", ...: what a decoded value is
local function kind(v)
  local mt = getmetatable(v)
  local k = mt and mt.__name or type(v)
  return k == "null" and k or (k == "object" and "an " or "a ") .. k
end

-- ---- the header ---------------------------------------------------------------------------------

-- The 8-byte length and the header text of an open file, checked up to JSON decoding. -> text,
-- its length n, the file size; nil, msg when the file cannot be read.
local function read_header_text(f, path)
  local size, serr = f:seek("end")
  if not size then return nil, string.format("safetensors: %s: cannot read: %s", path, tostring(serr)) end
  f:seek("set", 0)
  local head, rerr = read_exact(f, 8)
  if not head then return nil, string.format("safetensors: %s: cannot read: %s", path, tostring(rerr)) end
  if #head < 8 then
    bad(path, "truncated: the file has %d bytes, fewer than the 8-byte header length", size)
  end
  local n = string.unpack("<i8", head)
  if n < 0 or n > MAX_HEADER then
    bad(path, "header length %s is larger than the %d-byte limit (corrupt length field?)",
      n < 0 and string.format("%u", n) or tostring(n), MAX_HEADER)
  end
  if n > size - 8 then
    bad(path, "truncated: the header length is %d bytes but only %d bytes follow the length field (header length past the end of the file)", n, size - 8)
  end
  local text = read_exact(f, n)
  if not text then return nil, string.format("safetensors: %s: cannot read the header", path) end
  if #text < n then bad(path, "truncated: the header is cut short (%d of %d bytes)", #text, n) end
  local _, at = utf8.len(text)
  if at then bad(path, "header is not valid UTF-8 (at byte %d)", at) end
  if text:sub(1, 1) ~= "{" then
    bad(path, "header is not a JSON object (it must begin with '{', got %q)", text:sub(1, 16))
  end
  local nul = text:find("\0", 1, true)
  if nul then bad(path, "header contains a NUL byte (at byte %d; padding must be spaces)", nul) end
  return text, n, size
end

-- The header text decoded: the top-level object (see "the header's JSON"), padded only with spaces.
local function decode_header(path, text)
  local c = {s = text, path = path}
  local hdr, i = parse_value(c, 1, 0)
  local _, e = text:find("^ *", i)
  if e < #text then json_fail(c, e + 1, "trailing characters after the header object (only spaces may pad it)") end
  return hdr
end

-- The header's __metadata__ strings, and the tensor names (sorted).
local function split_header(path, hdr)
  local metadata = {}
  local names = {}
  for name, info in pairs(hdr) do
    if name == "__metadata__" then
      if info ~= NULL then -- null: no metadata, as the reference reads it
        if getmetatable(info) ~= OBJECT then
          bad(path, "__metadata__ must be an object of strings, got %s", show(info))
        end
        for k, v in pairs(info) do
          if type(v) ~= "string" then
            bad(path, "__metadata__ must map strings to strings, but '%s' is %s", k, kind(v))
          end
          metadata[k] = v
        end
      end
    else
      names[#names + 1] = name
    end
  end
  table.sort(names)
  return metadata, names
end

-- The shape of tensor name's entry: a list of integers >= 0.
local function check_shape(path, name, shape)
  if getmetatable(shape) ~= ARRAY then
    bad(path, "tensor '%s': shape must be a list of non-negative integers, got %s", name,
      shape == nil and "nothing (missing shape)" or show(shape))
  end
  local sh = {}
  for i, v in ipairs(shape) do
    if math.type(v) ~= "integer" or v < 0 then
      bad(path, "tensor '%s': shape must be a list of non-negative integers, but dim %d is %s", name, i, show(v))
    end
    sh[i] = v
  end
  return sh
end

-- "2,3,4": the dims of shape sh for a message, the first 16 of a longer one
local function dims_text(sh)
  if #sh <= 16 then return table.concat(sh, ",") end
  return table.concat(sh, ",", 1, 16) .. string.format(",... (%d dims)", #sh)
end

-- What nvlua tensors can hold beyond the format's own rules (core/tensor.c nvl_shape_numel):
-- at most NVL_MAX_DIMS = 8 dims, each at most 2^53, whose product, a 0 counted as 1 (the strides
-- of an empty tensor must fit too), is at most NVL_MAX_NUMEL = (2^63 - 1) // 16. Only an empty
-- tensor (a zero dim) can pass the byte-size check and fail these.
local MAX_DIMS, MAX_DIM = 8, 1 << 53

local function check_nvlua_shape(path, name, sh)
  if #sh > MAX_DIMS then
    bad(path, "tensor '%s': shape [%s] has %d dims; nvlua tensors have at most %d", name, dims_text(sh), #sh,
      MAX_DIMS)
  end
  local p = 1
  for i, k in ipairs(sh) do
    local k1 = k > 0 and k or 1
    if k > MAX_DIM or p > math.maxinteger // 16 // k1 then
      bad(path, "tensor '%s': shape [%s] is too large for nvlua at dim %d (dims at most 2^53, their product, a 0 "
        .. "counted as 1, at most 2^59)", name, dims_text(sh), i)
    end
    p = p * k1
  end
end

-- The validated entry of tensor name: {name, dtype, nv_dtype, shape, data_offsets}; its byte
-- range lies in the data section of data_size bytes and holds exactly numel x element size.
-- Fields other than dtype, shape and data_offsets are ignored, as the reference ignores them.
local function check_entry(path, name, info, data_size, f16, f8)
  if getmetatable(info) ~= OBJECT then
    bad(path, "tensor '%s': entry is not an object {dtype, shape, data_offsets} (got %s)", name, show(info))
  end
  local sd = info.dtype
  if type(sd) ~= "string" then bad(path, "tensor '%s': missing or non-string dtype", name) end
  local d = DTYPES[sd]
  if (sd == "F16" and not f16) or (d and d.f8 and not f8) then d = nil end
  if not d then
    if SPEC_ONLY[sd] then
      bad(path, "tensor '%s': dtype %s is not supported by nvlua (supported: %s%s)", name, sd, SUPPORTED,
        sd == "F16" and "; F16 is read as f32 with {f16 = \"f32\"}" or
        DTYPES[sd] and DTYPES[sd].f8 and "; fp8 codes are read as u8 bytes with {f8 = \"u8\"}" or "")
    end
    bad(path, "tensor '%s': unknown dtype '%s' (supported: %s)", name, sd, SUPPORTED)
  end
  local sh = check_shape(path, name, info.shape)
  local off = info.data_offsets
  if off == nil then bad(path, "tensor '%s': missing data_offsets", name) end
  if getmetatable(off) ~= ARRAY or #off ~= 2 or math.type(off[1]) ~= "integer" or math.type(off[2]) ~= "integer" then
    bad(path, "tensor '%s': data_offsets must be 2 integers [begin, end], got %s", name, show(off))
  end
  local b, e = off[1], off[2]
  if b < 0 or b > e then bad(path, "tensor '%s': data_offsets [%d, %d] have begin > end or a negative begin", name, b, e) end
  if e > data_size then
    bad(path, "tensor '%s': data_offsets [%d, %d) are out of range: the data section has %d bytes (file truncated?)",
      name, b, e, data_size)
  end
  -- numel × element size, guarding the multiplication against overflow
  local nbytes, over = d.size, false
  for _, k in ipairs(sh) do
    if k == 0 then nbytes, over = 0, false; break end
    if not over and nbytes > math.maxinteger // k then over = true end
    if not over then nbytes = nbytes * k end
  end
  if over or nbytes ~= e - b then
    bad(path, "tensor '%s': %s [%s] needs %s bytes, but data_offsets [%d, %d) hold %d", name, sd,
      dims_text(sh), over and "more" or tostring(nbytes), b, e, e - b)
  end
  check_nvlua_shape(path, name, sh)
  return {name = name, dtype = sd, nv_dtype = d.nv, shape = sh, data_offsets = {b, e}}
end

-- The entries ordered by offset, checked to tile the data section [0, data_size) exactly.
local function check_coverage(path, entries, data_size)
  local order = {}
  for i, x in ipairs(entries) do order[i] = x end
  table.sort(order, function(x, y)
    if x.data_offsets[1] ~= y.data_offsets[1] then return x.data_offsets[1] < y.data_offsets[1] end
    if x.data_offsets[2] ~= y.data_offsets[2] then return x.data_offsets[2] < y.data_offsets[2] end
    return x.name < y.name
  end)
  local pos, prev = 0, nil
  for _, x in ipairs(order) do
    local b, e = x.data_offsets[1], x.data_offsets[2]
    if b < pos then
      bad(path, "tensors '%s' [%d, %d) and '%s' [%d, %d) overlap", prev.name, prev.data_offsets[1], prev.data_offsets[2],
        x.name, b, e)
    end
    if b > pos then
      bad(path, "gap in the data section: bytes [%d, %d) belong to no tensor (the spec requires full coverage)", pos, b)
    end
    if e > pos then pos, prev = e, x end
  end
  if pos < data_size then
    bad(path, "%d trailing bytes after the last tensor (data section is %d bytes, tensors cover %d; the spec requires full coverage)",
      data_size - pos, data_size, pos)
  end
  return order
end

-- Parse and validate the header of an open file; returns entries sorted by offset, metadata,
-- layout, and the header table (name -> {dtype, shape, data_offsets}).
local function parse(f, path, f16, f8)
  local text, n, size = read_header_text(f, path)
  if not text then return nil, n end
  local hdr = decode_header(path, text)
  local data_size = size - 8 - n
  local metadata, names = split_header(path, hdr)
  local entries = {}
  for _, name in ipairs(names) do entries[#entries + 1] = check_entry(path, name, hdr[name], data_size, f16, f8) end
  local order = check_coverage(path, entries, data_size)
  local header = {}
  for _, x in ipairs(entries) do
    header[x.name] = {dtype = x.dtype, shape = x.shape, data_offsets = x.data_offsets}
  end
  return order, metadata, {header_size = n, data_start = 8 + n, data_size = data_size, file_size = size}, header
end

-- the reader's options: {f16 = "f32", f8 = "u8"} or nil -> whether F16 is read (as f32), whether
-- the fp8 dtypes are (as u8 bytes)
local function read_opts(opts)
  opts = util.check_opts(opts, {f16 = function(v) return v ~= "f32" and "must be \"f32\"" or nil end,
    f8 = function(v) return v ~= "u8" and "must be \"u8\"" or nil end}, "safetensors")
  return opts.f16 == "f32", opts.f8 == "u8"
end

--- st.read_header(path [, {f16 = "f32", f8 = "u8"}]) -> header, metadata, layout | nil, msg
--- header: name → {dtype = "F32", shape = {...}, data_offsets = {begin, end}} (validated);
--- metadata: the __metadata__ strings; layout: {header_size, data_start, data_size, file_size}.
--- f16 = "f32": F16 tensors are taken (load reads them as f32); f8 = "u8": fp8 ones (as their bytes).
function st.read_header(path, opts)
  local f16, f8 = read_opts(opts)
  local f, err = open_for_read(path)
  if not f then return nil, err end
  local ok, order, metadata, layout, header = pcall(parse, f, path, f16, f8)
  f:close()
  if not ok then error(order, 0) end
  if not order then return nil, metadata end
  return header, metadata, layout
end

--- st.load(path [, {f16 = "f32", f8 = "u8"}]) -> {name = tensor}, metadata | nil, msg (a missing file);
--- malformed files raise. f16 = "f32": F16 tensors are read into f32 tensors (exactly), else refused;
--- f8 = "u8": F8_E4M3, F8_E5M2 and F8_E8M0 tensors into u8 tensors of their bytes, else refused.
function st.load(path, opts)
  local f16, f8 = read_opts(opts)
  local f, err = open_for_read(path)
  if not f then return nil, err end
  local ok, order, metadata, layout = pcall(parse, f, path, f16, f8)
  if not ok then f:close(); error(order, 0) end
  if not order then f:close(); return nil, metadata end
  local tensors = {}
  for _, x in ipairs(order) do
    local b, e = x.data_offsets[1], x.data_offsets[2]
    f:seek("set", layout.data_start + b)
    local s, rerr = read_exact(f, e - b)
    if not s or #s < e - b then
      f:close()
      for _, t in pairs(tensors) do t:free() end
      if not s then return nil, string.format("safetensors: %s: cannot read tensor '%s': %s", path, x.name, tostring(rerr)) end
      bad(path, "truncated: tensor '%s' is cut short", x.name)
    end
    if x.dtype == "F16" then
      tensors[x.name] = core.from_f16_bytes(s, x.shape)
    else
      tensors[x.name] = core.from_bytes(s, x.nv_dtype, x.shape)
    end
  end
  f:close()
  return tensors, metadata
end

return st
