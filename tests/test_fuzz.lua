-- tests/test_fuzz.lua: a seeded mutation fuzzer for the readers of untrusted files, safetensors
-- (nvlua.safetensors load / read_header), NVLTOK token shards (nvlua.data open_shard /
-- read_tokens) and Megatron-LM indexed datasets (nvlua.data open_megatron: .idx header fields,
-- entries, both files' sizes; an accepted pair is re-derived from its bytes), plus the
-- reference-verdict corpus.
--   * Valid files are built here (st.save, data.write_shard, and a hand-written header with
--     whitespace, escapes, unordered offsets, null metadata and an unknown field), then mutated:
--     bit flips, interesting bytes, truncation, extension, inserted/deleted bytes, header-length
--     and shard-header field edits (counts that make count * width wrap), and JSON edits
--     (duplicate fields and entries, swapped or unknown dtypes, huge/negative/float/malformed
--     numbers, deleted and added fields, wrong types, escapes, whitespace, deep nesting).
--   * Each mutated file is loaded under pcall with an instruction budget (a hang fails the case;
--     a crash would end the run). A rejection must be a string "safetensors: <path>: <problem>"
--     (shards: "shard <path>: <problem>"); read_header must agree with load; an accepted file's
--     tensors must have the names, dtypes, shapes and bytes that the header declares, read by
--     an independent decoder (lua-cjson, which is laxer, so it reads every header nvlua takes),
--     and an accepted shard's tokens must be the file's bytes unpacked.
--   * tests/data/safetensors_ref_corpus.txt (scripts/fuzz_safetensors_ref.py): mutated files with
--     the reference implementation's verdict and the verdict nvlua must give (the reference's, but
--     for the deliberate differences documented in lua/nvlua/safetensors.lua, tagged by the script).
-- Environment, for scripts/fuzz.sh: NVLUA_FUZZ_CASES (safetensors cases; shards get half, Megatron
-- pairs a quarter; default 4000), NVLUA_FUZZ_SEED (default 1), NVLUA_FUZZ_PROGRESS (report every N
-- cases), NVLUA_FUZZ_CASE (run only case i, to reproduce one), NVLUA_FUZZ_KEEP (a directory: failing files are copied
-- there), NVLUA_FUZZ_REF (another corpus file to check instead of the committed one).
local T = require "nvlua.test"
local nv = require "nvlua"
local st = require "nvlua.safetensors"
local data = require "nvlua.data"
local cjson = require "cjson"
local lfs = require "lfs"

local CASES = tonumber(os.getenv("NVLUA_FUZZ_CASES") or "") or 4000
local SEED = tonumber(os.getenv("NVLUA_FUZZ_SEED") or "") or 1
local PROGRESS = tonumber(os.getenv("NVLUA_FUZZ_PROGRESS") or "")
local ONLY = tonumber(os.getenv("NVLUA_FUZZ_CASE") or "")
local KEEP = os.getenv("NVLUA_FUZZ_KEEP")
local LONG = os.getenv("NVLUA_FUZZ_CASES") ~= nil -- run by scripts/fuzz.sh: print summaries

local scratch = T.tmpdir()

local function say(fmt, ...) io.stderr:write(string.format(fmt, ...) .. "\n") end

-- ---- a seeded generator (splitmix64), one stream per case so any case can be rerun alone ----------

local function generator(seed, case)
  local s = seed * 0x2545F4914F6CDD1D + case * 0x9E3779B97F4A7C15
  local g = {}
  function g.int(n) -- uniform-enough integer in [1, n]
    s = s + 0x9E3779B97F4A7C15
    local z = s
    z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ~ (z >> 27)) * 0x94D049BB133111EB
    z = z ~ (z >> 31)
    return (z >> 1) % n + 1
  end
  function g.pick(t) return t[g.int(#t)] end
  function g.chance(p) return g.int(1000) <= p * 1000 end
  return g
end

-- ---- running a case under an instruction budget -----------------------------------------------------

local BUDGET = 400 -- hook calls of 100k instructions each: 40M instructions; a normal case takes ~0.1M

local function guarded(fn, ...)
  local ticks = 0
  debug.sethook(function()
    ticks = ticks + 1
    if ticks > BUDGET then error("fuzz: the case ran past its instruction budget (a hang?)", 0) end
  end, "", 100000)
  local r = table.pack(pcall(fn, ...))
  debug.sethook()
  return table.unpack(r, 1, r.n)
end

-- failures of a run: the first few, with what reproduces them
local function failures()
  local f = {n = 0, list = {}}
  function f.add(label, what, bytes, path) -- label: "case 12" (of this seed) or "corpus line 12"
    f.n = f.n + 1
    if #f.list < 8 then f.list[#f.list + 1] = string.format("%s: %s", label, what) end
    if KEEP then
      lfs.mkdir(KEEP)
      local name = string.format("%s/%s_seed_%d%s", KEEP, label:gsub(" ", "_"), SEED, path:match("%.%w+$") or "")
      T.write_file(name, bytes)
    end
  end
  function f.check(label)
    T.ok(f.n == 0, string.format("%s: %d failing cases (seed %d; rerun case i alone with NVLUA_FUZZ_SEED=%d "
      .. "NVLUA_FUZZ_CASE=i):\n%s", label, f.n, SEED, SEED, table.concat(f.list, "\n")))
  end
  return f
end

-- ---- safetensors seeds ---------------------------------------------------------------------------

local function bytes_of(dt, n, g)
  local s = {}
  for i = 1, n * ({f32 = 4, bf16 = 2, i32 = 4, i64 = 8, u8 = 1})[dt] do s[i] = string.char(g.int(256) - 1) end
  return table.concat(s)
end

local function st_seeds()
  local g = generator(SEED, -1)
  local function saved(tensors, meta)
    local p = scratch .. "/seed.safetensors"
    assert(st.save(p, tensors, meta))
    return assert(T.read_file(p))
  end
  local function t(dt, shape)
    local n = 1
    for _, d in ipairs(shape) do n = n * d end
    return nv.core.from_bytes(bytes_of(dt, n, g), dt, shape)
  end
  local seeds = {
    saved({w = t("f32", {2, 3}), b = t("bf16", {4}), i = t("i32", {3}), l = t("i64", {2}), u = t("u8", {5})},
      {step = "7", config = '{"a": 1}'}),
    saved({scalar = t("f32", {}), empty = t("f32", {0, 4}), e2 = t("i64", {3, 0}), one = t("u8", {1})}),
    saved({["model.layers.0.self_attn.q_proj.weight"] = t("f32", {4, 4}), ['a"b\\c/d\n\1é'] = t("bf16", {2, 1, 2})}),
    saved({}, {only = "metadata"}),
  }
  local text = '{ "b" : {"dtype":"U8", "shape":[2],"data_offsets":[4,6], "extra": [1.5e0, {"k": null}, true]},\n'
    .. '"__metadata__": null, "\\u0061":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},'
    .. '"z":{"shape":[0,3],"data_offsets":[6,6],"dtype":"F32"}}  '
  seeds[#seeds + 1] = string.pack("<I8", #text) .. text .. "\1\0\0\0xy"
  return seeds
end

-- ---- safetensors mutations -------------------------------------------------------------------------

local INTERESTING = {0x00, 0xff, 0x7f, 0x80, 0x20, 0x09, 0x0a, 0x22, 0x7b, 0x7d, 0x5b, 0x5d, 0x2c, 0x3a, 0x5c, 0x2d,
  0x2e, 0x65, 0x30, 0x31, 0x39, 0xc3, 0xed, 0xf4}
local WEIRD = {"-1", "1.0", "2.5", "1e3", "-0", "00", "01", "+1", "0x10", "NaN", "Infinity", "-Infinity",
  "9007199254740993",
  "18446744073709551615", "18446744073709551616", "9223372036854775807", "9223372036854775808", "1e400", "8.", ".8",
  "1e", "--1", "4611686018427387904", "4294967296", "0", "1" .. string.rep("0", 40), "true", "null", '"8"'}
local DTYPES = {"F32", "BF16", "I32", "I64", "U8", "F16", "F64", "BOOL", "I8", "U64", "F8_E4M3", "F4", "f32", "F33", ""}
local VALUES = {"1.5", '[1,{"a":null}]', "true", "null", '"x"', "{}", "[]", "1e400", "NaN", "-0", '{"k":1,"k":2}',
  '"\\ud800"', '"\\u00e9"', "123456789012345678901234567890"}
local ESCAPES = {"\\u0041", "\\ud800", "\\udc00", "\\ud83d\\ude00", "\\x", "\t", "\\/", "\\u00", "\\U0041", "\1",
  "\127"}

-- positions where pattern matches in s: a list of {start, end}
local function spans(s, pattern)
  local out, i = {}, 1
  while true do
    local a, b = s:find(pattern, i)
    if not a then return out end
    out[#out + 1] = {a, b}
    i = b + 1
  end
end

local function splice(s, a, b, with) return s:sub(1, a - 1) .. with .. s:sub(b + 1) end

-- one JSON-level edit of header text h (returns the new text and a word for the report)
local function json_edit(g, h)
  local k = g.int(12)
  local fields = spans(h, '"[%w_]+"%s*:%s*%b[]')
  for _, sp in ipairs(spans(h, '"dtype"%s*:%s*"[^"]*"')) do fields[#fields + 1] = sp end
  local entries = spans(h, '"[^"]*"%s*:%s*%b{}')
  local numbers = spans(h, "%d+")
  if k == 1 and #fields > 0 then -- duplicate a field, maybe with another dtype
    local sp = g.pick(fields)
    local f = h:sub(sp[1], sp[2])
    if g.chance(0.6) then f = f:gsub('"dtype"%s*:%s*"[^"]*"', '"dtype":"' .. g.pick(DTYPES) .. '"') end
    return splice(h, sp[2] + 1, sp[2], "," .. f), "duplicate field"
  elseif k == 2 then -- swap a dtype
    local sp = spans(h, '"dtype"%s*:%s*"[^"]*"')
    if #sp > 0 then
      local p = g.pick(sp)
      return splice(h, p[1], p[2], '"dtype":"' .. g.pick(DTYPES) .. '"'), "dtype"
    end
  elseif k == 3 and #numbers > 0 then -- a weird or shifted number
    local sp = g.pick(numbers)
    local v = g.chance(0.7) and g.pick(WEIRD)
      or tostring(math.max(0, tonumber(h:sub(sp[1], sp[2])) + g.pick({-8, -1, 1, 8})))
    return splice(h, sp[1], sp[2], v), "number " .. v
  elseif k == 4 and #fields > 0 then -- delete a field (and a comma next to it)
    local sp = g.pick(fields)
    local a, b = sp[1], sp[2]
    if h:sub(b + 1, b + 1) == "," then b = b + 1 elseif h:sub(a - 1, a - 1) == "," then a = a - 1 end
    return splice(h, a, b, ""), "delete field"
  elseif k == 5 then -- add a field to an object, or deep nesting
    local sp = spans(h, "{")
    local p = g.pick(sp)
    local v = g.chance(0.8) and g.pick(VALUES) or (string.rep("[", 118 + g.int(12)) .. string.rep("]", 130))
    local key = g.pick({'"foo"', '"dtype"', '"shape"', '""', '"__metadata__"'})
    local sep = h:sub(p[1] + 1, p[1] + 1) == "}" and "" or ","
    return splice(h, p[1] + 1, p[1], key .. ":" .. v .. sep), "add field"
  elseif k == 6 and #entries > 0 then -- wrong types
    local sp = g.pick(g.chance(0.5) and entries or (#fields > 0 and fields or entries))
    local text = h:sub(sp[1], sp[2])
    local name = text:match('^("[^"]*"%s*:%s*)')
    local v = g.pick({"[]", "{}", "null", "1", '"x"', "[0]", "[0,8,8]", '["F32",[2],[0,8]]'})
    return splice(h, sp[1], sp[2], name .. v), "wrong type"
  elseif k == 7 and #entries > 0 then -- duplicate an entry
    local sp = g.pick(entries)
    return splice(h, sp[2] + 1, sp[2], "," .. h:sub(sp[1], sp[2])), "duplicate entry"
  elseif k == 8 then -- an escape or control character in a string
    local sp = spans(h, '"[^"]*"')
    if #sp > 0 then local p = g.pick(sp); return splice(h, p[1] + 1, p[1], g.pick(ESCAPES)), "escape" end
  elseif k == 9 then -- whitespace somewhere, at the start or at the end
    local w = g.pick({" ", "\n", "\t", "\r"})
    local at = g.pick({1, #h + 1, g.int(#h + 1)})
    return h:sub(1, at - 1) .. w .. h:sub(at), "whitespace"
  elseif k == 10 then -- __metadata__ edits
    local v = g.pick({"null", "[]", '{"a":"1","a":"2"}', '{"a":1}', '{"a":"b"}', "{}"})
    local sp = spans(h, '"__metadata__"%s*:%s*%b{}')
    if #sp > 0 then return splice(h, sp[1][1], sp[1][2], '"__metadata__":' .. v), "metadata" end
    return h:gsub("^{", '{"__metadata__":' .. v .. (h:match("^{%s*}") and "" or ","), 1), "metadata"
  elseif k == 11 then -- an empty tensor with absurd dims
    local sp = spans(h, '"shape"%s*:%s*%b[]')
    if #sp > 0 then
      local p = g.pick(sp)
      return splice(h, p[1], p[2], '"shape":' .. g.pick({"[0,9007199254740992]", "[9007199254740993,0]",
        "[4294967296,2147483648,0]", "[0,1099511627776,1099511627776]", "[1,1,1,1,1,1,1,1,0]",
        "[1,1,1,1,1,1,1,1,1,0]"})),
        "empty shape"
    end
  elseif k == 12 and #entries > 1 then -- swap two entries' offsets
    local a, b = g.pick(entries), g.pick(entries)
    local oa = h:sub(a[1], a[2]):match('"data_offsets"%s*:%s*(%b[])')
    local ob = h:sub(b[1], b[2]):match('"data_offsets"%s*:%s*(%b[])')
    if oa and ob and a[1] ~= b[1] then
      local lo, hi = a, b
      if lo[1] > hi[1] then lo, hi, oa, ob = b, a, ob, oa end
      local hs = h:sub(hi[1], hi[2]):gsub('("data_offsets"%s*:%s*)%b[]', "%1" .. oa, 1)
      local ls = h:sub(lo[1], lo[2]):gsub('("data_offsets"%s*:%s*)%b[]', "%1" .. ob, 1)
      return h:sub(1, lo[1] - 1) .. ls .. h:sub(lo[2] + 1, hi[1] - 1) .. hs .. h:sub(hi[2] + 1), "swap offsets"
    end
  end
  return h, "none"
end

-- one byte-level edit of file b
local function byte_edit(g, b)
  local n = #b >= 8 and string.unpack("<i8", b) or 0
  local hdr_end = (n > 0 and n <= #b - 8) and 8 + n or #b
  local pos = (hdr_end > 8 and g.chance(0.7)) and 8 + g.int(hdr_end - 8) or g.int(math.max(1, #b))
  local k = g.int(7)
  if k == 1 and #b > 0 then
    pos = math.min(pos, #b)
    return splice(b, pos, pos, string.char(b:byte(pos) ~ (1 << (g.int(8) - 1)))), "bit flip"
  elseif k == 2 and #b > 0 then
    pos = math.min(pos, #b)
    return splice(b, pos, pos, string.char(g.pick(INTERESTING))), "byte"
  elseif k == 3 then
    return b:sub(1, g.int(#b + 1) - 1), "truncate"
  elseif k == 4 then
    return b .. (g.chance(0.5) and string.rep("\0", g.int(16)) or string.rep(" ", g.int(9))), "extend"
  elseif k == 5 and #b >= 8 then
    local v = g.pick({n + 1, n - 1, n + 8, n - 8, 0, g.int(#b + 16), 1 << 63, -1, 100000001, n | (0x80 << 56), #b - 8})
    return string.pack("<i8", v) .. b:sub(9), "header length"
  elseif k == 6 then
    return b:sub(1, pos - 1) .. string.char(g.pick(INTERESTING)) .. b:sub(pos), "insert"
  elseif k == 7 and #b > 0 then
    return splice(b, pos, pos, ""), "delete"
  end
  return b, "none"
end

-- a mutated file from seed s: the file and the list of edits
local function mutate_st(g, s)
  local did = {}
  local n = string.unpack("<i8", s)
  local h, rest = s:sub(9, 8 + n), s:sub(9 + n)
  local nj = g.pick({0, 1, 1, 1, 2, 3})
  for _ = 1, nj do
    local what
    h, what = json_edit(g, h)
    did[#did + 1] = what
  end
  local b = string.pack("<I8", #h) .. h .. rest
  for _ = 1, (nj > 0 and g.pick({0, 0, 0, 1, 2}) or g.pick({1, 1, 2, 3})) do
    local what
    b, what = byte_edit(g, b)
    did[#did + 1] = what
  end
  return b, table.concat(did, ", ")
end

-- ---- checking one safetensors file ------------------------------------------------------------------

local NV = {F32 = "f32", BF16 = "bf16", I32 = "i32", I64 = "i64", U8 = "u8"}

-- what is wrong with an accepted file's tensors (nil if nothing), judged from its bytes: the header
-- decoded by lua-cjson, each tensor's bytes cut from the data section
local function check_accepted(b, tensors, meta)
  local n = string.unpack("<I8", b)
  local ok, hdr = pcall(cjson.decode, b:sub(9, 8 + n))
  if not ok then return "accepted, but lua-cjson cannot decode the header: " .. tostring(hdr) end
  local names = 0
  for name, e in pairs(hdr) do
    if name == "__metadata__" then
      local want = e == cjson.null and {} or e
      if not T.deep_eq(meta, want) then return "metadata differs from the header's" end
    else
      names = names + 1
      local t = tensors[name]
      if not t then return "declared tensor '" .. name .. "' not loaded" end
      if t:dtype() ~= NV[e.dtype] then return name .. ": dtype " .. t:dtype() .. ", declared " .. tostring(e.dtype) end
      local shape = {}
      for i, d in ipairs(e.shape) do shape[i] = math.tointeger(d) end
      if not T.deep_eq(t:size(), shape) then return name .. ": shape differs from the declared one" end
      local o1, o2 = math.tointeger(e.data_offsets[1]), math.tointeger(e.data_offsets[2])
      if t:bytes() ~= b:sub(9 + n + o1, 8 + n + o2) then return name .. ": bytes differ from the file's" end
    end
  end
  for _ in pairs(tensors) do names = names - 1 end
  if names ~= 0 then return "loaded tensors the header does not declare" end
  if meta == nil then return "no metadata table" end
end

-- the verdict on file bytes b ("A" or "R") and what is wrong (nil if nothing)
local function judge_st(b, path)
  T.write_file(path, b)
  local ok, tensors, meta = guarded(st.load, path)
  local hok, herr = guarded(st.read_header, path)
  local prefix = "safetensors: " .. path .. ": "
  local problem
  if not ok then
    if type(tensors) ~= "string" or tensors:sub(1, #prefix) ~= prefix or #tensors == #prefix then
      problem = "rejected without a 'safetensors: <path>: <problem>' message: " .. tostring(tensors)
    elseif hok then
      problem = "load rejects, read_header accepts: " .. tensors
    end
  elseif type(tensors) ~= "table" then
    problem = "load returned " .. tostring(tensors) .. ", " .. tostring(meta)
  else
    problem = check_accepted(b, tensors, meta)
    if not hok then problem = problem or ("load accepts, read_header rejects: " .. tostring(herr)) end
    for _, t in pairs(tensors) do t:free() end
  end
  return ok and "A" or "R", problem
end

T.case("safetensors: mutated files are rejected with a message naming the file, or load as declared", function()
  local seeds = st_seeds()
  local path = scratch .. "/case.safetensors"
  local fail = failures()
  local accepted = 0
  local first, last = ONLY or 1, ONLY or CASES
  for i = first, last do
    local g = generator(SEED, i)
    local b, did = mutate_st(g, seeds[g.int(#seeds)])
    local verdict, problem = judge_st(b, path)
    if verdict == "A" then accepted = accepted + 1 end
    if problem then fail.add("case " .. i, did .. ": " .. problem, b, path) end
    if PROGRESS and i % PROGRESS == 0 then
      say("safetensors: %d/%d cases, %d accepted, %d failing", i, last, accepted, fail.n)
    end
  end
  local total = last - first + 1
  if LONG then say("safetensors: %d cases (seed %d), %d accepted, %d rejected, %d failing", total, SEED, accepted,
    total - accepted, fail.n) end
  -- the mutations reach both outcomes (a fuzzer that only made garbage would prove little)
  if total >= 200 then
    T.ok(accepted > total // 20, "accepted " .. accepted .. " of " .. total)
    T.ok(accepted < total - total // 4, "rejected " .. total - accepted .. " of " .. total)
  end
  fail.check("safetensors")
  -- the seeds themselves load
  for _, s in ipairs(seeds) do
    local v, p = judge_st(s, path)
    T.eq(v, "A", p)
    T.eq(p, nil)
  end
end)

-- ---- shards ------------------------------------------------------------------------------------------

local function shard_seeds()
  local p = scratch .. "/seed.bin"
  local out = {}
  for _, w in ipairs({{{1, 2, 3, 65535, 0, 7, 300}, 2}, {{4294967295, 0, 5, 6, 70000}, 4}, {{}, 2}, {"abc", 2}}) do
    data.write_shard(p, w[1], w[2])
    out[#out + 1] = assert(T.read_file(p))
  end
  return out
end

-- a mutated shard; the header fields are u32 version at 9, u32 width at 13, u64 count at 17
local function mutate_shard(g, s)
  local did = {}
  for _ = 1, g.pick({1, 1, 2, 3}) do
    local k = g.int(7)
    local d = #s - 24
    if k == 1 and #s >= 24 then
      local w = string.unpack("<I4", s, 13)
      w = (w == 2 or w == 4) and w or 2
      -- counts whose product with the width wraps round to the data size (or near it)
      local v = g.pick({d // w + (1 << 62), d // w + (1 << 63), (d // w) | (1 << 62), -1, 1 << 63, 1 << 61,
        d // w + 1, d // w - 1, 0, (1 << 63) // w * 2 + d // w, g.int(1 << 40)})
      s = s:sub(1, 16) .. string.pack("<i8", v) .. s:sub(25)
      did[#did + 1] = "count"
    elseif k == 2 and #s >= 24 then
      s = s:sub(1, 12) .. string.pack("<I4", g.pick({0, 1, 2, 3, 4, 8, 0x80000000, 0xffffffff})) .. s:sub(17)
      did[#did + 1] = "width"
    elseif k == 3 and #s >= 24 then
      s = s:sub(1, 8) .. string.pack("<I4", g.pick({0, 1, 2, 0xffffffff})) .. s:sub(13)
      did[#did + 1] = "version"
    elseif k == 4 and #s > 0 then
      local p = g.int(#s)
      s = splice(s, p, p, string.char(s:byte(p) ~ (1 << (g.int(8) - 1))))
      did[#did + 1] = "bit flip"
    elseif k == 5 then
      s = s:sub(1, g.int(#s + 1) - 1)
      did[#did + 1] = "truncate"
    elseif k == 6 then
      s = s .. string.rep("\7", g.int(9))
      did[#did + 1] = "extend"
    elseif k == 7 and #s > 0 then
      local p = g.int(#s)
      s = splice(s, p, p, string.char(g.pick(INTERESTING)))
      did[#did + 1] = "byte"
    end
  end
  return s, table.concat(did, ", ")
end

local function judge_shard(b, path)
  T.write_file(path, b)
  local ok, s, msg = guarded(data.open_shard, path)
  local prefix = "shard " .. path .. ": "
  if not ok then
    if type(s) ~= "string" or not s:find(prefix, 1, true) then
      return "R", "rejected without 'shard <path>:': " .. tostring(s)
    end
    return "R"
  end
  if type(s) ~= "table" then return "R", "open_shard returned " .. tostring(s) .. ", " .. tostring(msg) end
  if (s.width ~= 2 and s.width ~= 4) or s.count < 0 or 24 + s.count * s.width ~= #b then
    return "A", string.format("accepted width %s count %s for a file of %d bytes", s.width, s.count, #b)
  end
  local rok, t = guarded(data.read_tokens, s, 0, s.count)
  if not rok then return "A", "read_tokens failed on an accepted shard: " .. tostring(t) end
  local want = {}
  for i = 1, s.count do want[i] = string.unpack(s.width == 2 and "<I2" or "<I4", b, 25 + (i - 1) * s.width) end
  if not T.deep_eq(t:totable(), want) then return "A", "tokens differ from the file's bytes" end
  t:free()
  return "A"
end

T.case("shards: mutated headers (wrapping counts included) are rejected with a named error, or read exactly", function()
  local seeds = shard_seeds()
  local path = scratch .. "/case.bin"
  local fail = failures()
  local accepted = 0
  local n = math.max(1, CASES // 2)
  local first, last = ONLY or 1, ONLY or n
  for i = first, last do
    local g = generator(SEED + 7, i)
    local b, did = mutate_shard(g, seeds[g.int(#seeds)])
    local verdict, problem = judge_shard(b, path)
    if verdict == "A" then accepted = accepted + 1 end
    if problem then fail.add("case " .. i, did .. ": " .. problem, b, path) end
    if PROGRESS and i % PROGRESS == 0 then
      say("shards: %d/%d cases, %d accepted, %d failing", i, last, accepted, fail.n)
    end
  end
  if LONG then say("shards: %d cases (seed %d), %d accepted, %d failing", last - first + 1, SEED, accepted, fail.n) end
  if last - first >= 200 then T.ok(accepted > 0, "some mutated shards are still valid") end
  fail.check("shards")
end)

-- ---- Megatron-LM indexed datasets ----------------------------------------------------------------

local MG_PACK = {[1] = "I1", [8] = "I2", [4] = "i4", [5] = "i8"}
local MG_SIZE = {[1] = 1, [8] = 2, [4] = 4, [5] = 8}

-- a .bin and .idx of documents (lists of sequences of ids) in dtype code (tests/test_megatron.lua's layout)
local function mg_pair(code, docs)
  local bin, lens, ptrs, index, ptr = {}, {}, {}, {}, 0
  index[1] = string.pack("<i8", 0)
  local n = 0
  for _, doc in ipairs(docs) do
    for _, seq in ipairs(doc) do
      for _, v in ipairs(seq) do bin[#bin + 1] = string.pack("<" .. MG_PACK[code], v) end
      n = n + 1
      lens[n], ptrs[n] = string.pack("<i4", #seq), string.pack("<i8", ptr)
      ptr = ptr + #seq * MG_SIZE[code]
    end
    index[#index + 1] = string.pack("<i8", n)
  end
  return table.concat(bin), "MMIDIDX\0\0" .. string.pack("<I8I1I8I8", 1, code, n, #index) .. table.concat(lens) ..
    table.concat(ptrs) .. table.concat(index)
end

local function mg_seeds()
  return {
    {mg_pair(8, {{{1, 2, 3}, {65535}}, {{4, 5}}, {{6}, {7, 8, 9}}, {{10, 11}}})},
    {mg_pair(4, {{{100000, 2}}, {}, {{3}, {}}, {{2147483647, 0, 1}}})},
    {mg_pair(1, {{{1}}, {{2, 3}}, {{255, 4, 5, 6}}})},
    {mg_pair(5, {{{1 << 40, 2}}, {{3}}})},
  }
end

local MG_WEIRD = {0, 1, -1, 2, 7, 1 << 31, (1 << 31) - 1, 1 << 62, (1 << 62) + 3, 1 << 63, (1 << 63) + 2, 1 << 32}

-- a mutated pair; idx fields: version u64 at 10, code u8 at 18, S u64 at 19, D u64 at 27, then entries
local function mutate_mg(g, bin, idx)
  local did = {}
  for _ = 1, g.pick({1, 1, 2, 3}) do
    local k = g.int(9)
    local S = #idx >= 34 and string.unpack("<i8", idx, 19) or 0
    local function set(at, fmt, v)
      if fmt == "<i4" then fmt, v = "<I4", v & 0xffffffff end -- any 32 bits
      if at + string.packsize(fmt) - 1 <= #idx then
        idx = idx:sub(1, at - 1) .. string.pack(fmt, v) .. idx:sub(at + string.packsize(fmt))
      end
    end
    if k == 1 then set(10, "<i8", g.pick({0, 1, 2, -1})); did[#did + 1] = "version"
    elseif k == 2 then set(18, "<I1", g.int(10) - 1); did[#did + 1] = "dtype"
    elseif k == 3 then
      set(g.pick({19, 27}), "<i8", g.pick({S - 1, S + 1, S, g.pick(MG_WEIRD)}))
      did[#did + 1] = "count"
    elseif k == 4 and S > 0 and S < 100 then -- a length, a pointer or a document index
      local which = g.int(3)
      local at = which == 1 and 35 + 4 * (g.int(S) - 1) or which == 2 and 35 + 4 * S + 8 * (g.int(S) - 1)
        or 35 + 12 * S + 8 * (g.int(math.max(1, (#idx - 34 - 12 * S) // 8)) - 1)
      set(at, which == 1 and "<i4" or "<i8", g.pick({g.pick(MG_WEIRD), g.int(12) - 4}))
      did[#did + 1] = "entry"
    elseif k == 5 and #idx > 0 then
      local p = g.int(#idx)
      idx = splice(idx, p, p, string.char(idx:byte(p) ~ (1 << (g.int(8) - 1))))
      did[#did + 1] = "idx bit flip"
    elseif k == 6 then idx = idx:sub(1, g.int(#idx + 1) - 1); did[#did + 1] = "idx truncate"
    elseif k == 7 then idx = idx .. string.rep("\0", g.pick({1, 4, 8, g.int(16)})); did[#did + 1] = "idx extend"
    elseif k == 8 then bin = bin:sub(1, g.int(#bin + 1) - 1); did[#did + 1] = "bin truncate"
    elseif k == 9 then bin = bin .. string.rep("\3", g.int(9)); did[#did + 1] = "bin extend" end
  end
  return bin, idx, table.concat(did, ", ")
end

-- An accepted pair, judged from its bytes alone: the index consistent (sizes, rising document
-- indices, lengths >= 0, contiguous pointers, the .bin exactly the tokens) and the splits the
-- right tokens (validation: the last ceil(5% of the documents)). -> what is wrong, or nil
local function mg_check(bin, idx, m)
  local code, S, D = string.unpack("<I1i8i8", idx, 18)
  local w = MG_SIZE[code]
  if not w or S < 0 or D < 2 or 34 + 12 * S + 8 * D ~= #idx then return "accepted an inconsistent header" end
  local total, starts = 0, {}
  for i = 1, S do
    local len, ptr = string.unpack("<i4", idx, 35 + 4 * (i - 1)), string.unpack("<i8", idx, 35 + 4 * S + 8 * (i - 1))
    if len < 0 or ptr ~= total * w then return "accepted sequence " .. i .. " (length or pointer)" end
    starts[i] = total
    total = total + len
  end
  starts[S + 1] = total
  if total * w ~= #bin then return "accepted a .bin of another size" end
  local prev = -1
  local docs = {}
  for i = 1, D do
    docs[i] = string.unpack("<i8", idx, 35 + 12 * S + 8 * (i - 1))
    if (i == 1 and docs[i] ~= 0) or docs[i] < prev or docs[i] > S then return "accepted bad document indices" end
    prev = docs[i]
  end
  if prev ~= S then return "accepted a last document index that is not S" end
  local n_val = math.ceil((D - 1) * 0.05 - 1e-9)
  local cut = starts[docs[D - n_val] + 1]
  if m.train.count ~= cut or m.val.count ~= total - cut then return "splits at the wrong token" end
  local want = {}
  for i = 1, total do want[i] = string.unpack(code == 4 and "<I4" or "<" .. MG_PACK[code], bin, 1 + (i - 1) * w) end
  local got = data.read_tokens(m.train, 0, m.train.count):totable()
  for _, v in ipairs(data.read_tokens(m.val, 0, m.val.count):totable()) do got[#got + 1] = v end
  if not T.deep_eq(got, want) then return "tokens differ from the .bin's bytes" end
end

T.case("megatron: mutated .idx/.bin pairs are rejected with a named error, or read exactly", function()
  local seeds = mg_seeds()
  local prefix = scratch .. "/mg"
  local fail = failures()
  local accepted = 0
  local n = math.max(1, CASES // 4)
  local first, last = ONLY or 1, ONLY or n
  for i = first, last do
    local g = generator(SEED + 11, i)
    local sd = seeds[g.int(#seeds)]
    local bin, idx, did = mutate_mg(g, sd[1], sd[2])
    T.write_file(prefix .. ".bin", bin)
    T.write_file(prefix .. ".idx", idx)
    local ok, m = guarded(data.open_megatron, prefix)
    local problem
    if not ok then
      if type(m) ~= "string" or not (m:find("megatron " .. prefix .. ".idx: ", 1, true) == 1 or
          m:find("megatron " .. prefix .. ".bin: ", 1, true) == 1) then
        problem = "rejected without 'megatron <file>:': " .. tostring(m)
      end
    else
      accepted = accepted + 1
      local cok, c = guarded(mg_check, bin, idx, m)
      if cok then problem = c else problem = "checking an accepted pair failed: " .. tostring(c) end
    end
    if problem then fail.add("case " .. i, did .. ": " .. problem, idx, prefix .. ".idx") end
  end
  if LONG then
    say("megatron: %d cases (seed %d), %d accepted, %d failing", last - first + 1, SEED, accepted, fail.n)
  end
  if last - first >= 200 then T.ok(accepted > 0 and accepted < last - first, "accepted " .. accepted) end
  fail.check("megatron")
  for _, sd in ipairs(seeds) do -- the seeds themselves are read
    T.write_file(prefix .. ".bin", sd[1])
    T.write_file(prefix .. ".idx", sd[2])
    T.eq(mg_check(sd[1], sd[2], data.open_megatron(prefix)), nil)
  end
end)

-- ---- the reference-verdict corpus -------------------------------------------------------------------

local TAGS = {lead_ws = true, trail_ws = true, dup_key = true, entry_list = true, dtype = true, shape_limit = true}

T.case("reference corpus: nvlua gives the verdict expected from the safetensors reference on every file", function()
  local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
  local file = os.getenv("NVLUA_FUZZ_REF") or (here .. "/data/safetensors_ref_corpus.txt")
  local path = scratch .. "/ref.safetensors"
  local fail = failures()
  local n, agree, expected_diff = 0, 0, 0
  local confusion = {}
  for line in io.lines(file) do
    if line:sub(1, 1) ~= "#" then
      local ref, want, tag, hex = line:match("^([AR]) ([AR]) (%S+) (%x*)$")
      T.ok(ref, "corpus line: " .. line:sub(1, 60))
      n = n + 1
      local b = hex:gsub("%x%x", function(x) return string.char(tonumber(x, 16)) end)
      local got, problem = judge_st(b, path)
      if ref ~= want then
        expected_diff = expected_diff + 1
        T.ok(TAGS[tag], "a difference from the reference has a documented tag: " .. tag)
      end
      if got == ref then agree = agree + 1 end
      local key = string.format("ref %s nvlua %s %s", ref, got, ref ~= got and tag or "")
      confusion[key] = (confusion[key] or 0) + 1
      if got ~= want then
        problem = (problem and problem .. "; " or "") .. "verdict " .. got .. ", expected " .. want
      end
      if problem then
        fail.add("corpus line " .. n, string.format("(ref %s, tag %s): %s", ref, tag, problem), b, path)
      end
    end
  end
  T.ok(n >= 50, "the corpus has cases")
  if LONG or os.getenv("NVLUA_FUZZ_REF") then
    say("reference corpus %s: %d files, nvlua agrees with the reference on %d (%.2f%%); %d differ by design",
      file, n, agree, 100 * agree / n, expected_diff)
    local keys = {}
    for k in pairs(confusion) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do say("  %-34s %d", k, confusion[k]) end
  end
  fail.check("reference corpus")
end)

T.case("cleanup", function()
  T.ok(T.rm_tree(scratch))
end)
