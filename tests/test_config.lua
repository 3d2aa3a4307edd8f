-- tests/test_config.lua: an experiment's configuration is checked before anything is built
-- (lua/nvlua/config.lua, train.schema): every key's type and range, the relations between keys,
-- the data against the config, the model constructor's required sizes, and the experiment
-- scripts' own keys. Every message names the key and what it accepts. The expected messages are
-- written out here by hand: they are the contract a user reads.
local T = require "nvlua.test"
local config = require "nvlua.config"
local train = require "nvlua.train"
local nn = require "nvlua.nn"
local lfs = require "lfs"

local ROOT = T.tmpdir()

-- A text corpus of n bytes (printable, deterministic).
local function corpus(name, n)
  local parts, s = {}, 7
  for i = 1, n do
    s = (s * 1103515245 + 12345) % 2147483648
    parts[i] = string.char(97 + s % 26)
  end
  return T.write_file(ROOT .. "/" .. name, table.concat(parts))
end

local TINY = {"layers=1", "hidden=32", "heads=4", "kv_heads=2", "ffn=64", "seq=16", "batch=2", "steps=2",
  "cache=" .. ROOT .. "/cache", "quiet=true", "plot=false", "save=false", "sample_tokens=0"}
local function args(extra)
  local a = {}
  for _, x in ipairs(TINY) do a[#a + 1] = x end
  for _, x in ipairs(extra) do a[#a + 1] = x end
  return a
end

T.case("every key's type and range: the message names the key, what it accepts and the value", function()
  local cases = {
    {"min_lr=-0.01", "config: min_lr must be a finite number >= 0, got -0.01"},
    {"log_every=0", "config: log_every must be an integer >= 1, got 0"},
    {"top_k=0", "config: top_k must be an integer >= 1, got 0"},
    {"eval_batches=0", "config: eval_batches must be an integer >= 1, got 0"},
    {"grad_accum=-2", "config: grad_accum must be an integer >= 1, got -2"},
    {"grad_accum=0", "config: grad_accum must be an integer >= 1, got 0"},
    {"out=", "config: out must be a non-empty string, got ''"},
    {"lr=0", "config: lr must be a finite number > 0, got 0.0"},
    {"lr=1e999", "config: lr must be a finite number > 0, got inf"},
    {"lr=nan", "config: lr must be a number, got 'nan'"},
    {"lr=0x10", "config: lr must be a number written in decimal (such as 3e-4 or 0.0003), got '0x10'"},
    {"steps=0x10", "config: steps must be an integer written in decimal, got '0x10'"},
    {"steps=1.5", "config: steps must be an integer, got '1.5'"},
    {"beta2=1", "config: beta2 must be a finite number in [0, 1), got 1.0"},
    {"decay=1.5", "config: decay must be a finite number in [0, 1], got 1.5"},
    {"layers=0", "config: layers must be an integer >= 1, got 0"},
    {"seq=-1", "config: seq must be an integer >= 1, got -1"},
    {"steps=0", "config: steps must be an integer >= 1, got 0"},
    {"keep=-1", "config: keep must be an integer >= 0, got -1"},
    {"temperature=-1", "config: temperature must be a finite number >= 0, got -1.0"},
    {"clip=0", "config: clip must be a finite number > 0, got 0.0"},
    {"bf16_last=-2", "config: bf16_last must be an integer >= -1, got -2"},
    {"schedule=cos", "config: schedule must be a schedule value or function or one of wsd, cosine, linear, constant, " ..
      "got 'cos'"},
    {"recipe=nvfp5", "config: recipe must be a recipe value or one of f32, bf16, fp8_cs, fp8_delayed, mxfp8, nvfp4, mxfp4"},
    {"device=tpu", "config: device: invalid device 'tpu' (valid: cpu, cuda)"},
    {"attention=fast", "config: attention must be one of auto, flash, cudnn, reference, got 'fast'"},
    {"data=" .. ROOT .. "/no_such_file", "config: data: '" .. ROOT .. "/no_such_file' is not a file; give kjv, shards:<dir>"},
    {"data=" .. ROOT, "config: data: '" .. ROOT .. "' is a directory; give kjv, shards:<dir> or a text file"},
    {"data=shards:" .. ROOT .. "/nowhere", "config: data: shards:" .. ROOT .. "/nowhere is not a directory"},
  }
  for _, c in ipairs(cases) do
    T.raises(function() config.parse(train.schema, args({c[1]})) end, c[2], c[1])
  end
  -- train.build checks a config however it was made (here: the plain defaults, then a bad value)
  local c = config.parse(train.defaults, args({}))
  c.log_every = 0
  T.raises(function() train.build(c) end, "config: log_every must be an integer >= 1, got 0")
end)

T.case("relations between keys are checked with the keys", function()
  local cases = {
    {{"heads=8", "kv_heads=3"}, "config: kv_heads (3) must divide heads (8)"},
    {{"hidden=30", "heads=4", "kv_heads=2"}, "config: hidden (30) is not a multiple of heads (4); give head_dim"},
    {{"head_dim=5"}, "config: the head dimension (5) must be even for RoPE"},
    {{"lr=0.001", "min_lr=0.01"}, "config: min_lr (0.01) must not exceed lr (0.001)"},
    {{"attention=cudnn"}, "config: attention=cudnn runs on a GPU; it needs device=cuda"},
  }
  for _, c in ipairs(cases) do
    T.raises(function() config.parse(train.schema, args(c[1])) end, c[2], table.concat(c[1], " "))
  end
  local ok = config.parse(train.schema, args({"hidden=30", "heads=4", "kv_heads=2", "head_dim=8"}))
  T.eq(ok.head_dim, 8, "head_dim given: hidden need not be a multiple of heads")
end)

T.case("train.main fails before it builds or writes anything", function()
  local out = ROOT .. "/main_bad"
  for _, bad in ipairs({"min_lr=-0.01", "log_every=0", "out=", "eval_batches=0", "top_k=0", "grad_accum=0"}) do
    local a = args({"out=" .. out, bad})
    T.raises(function() train.main({}, a) end, "config: ", bad)
    T.eq(lfs.attributes(out), nil, bad .. ": nothing was created")
  end
  -- an experiment's own default out of range is caught like a command-line value
  T.raises(function() train.main({log_every = 0}, args({"out=" .. out})) end, "config: log_every must be an integer >= 1")
end)

T.case("the data against the config: the vocabulary and one batch per split, before the model is built", function()
  -- 2000 bytes: 1900 train, 100 validation; batch 2 x seq 16 needs 2 windows of 17 tokens = 33
  local small = corpus("small.txt", 2000)
  local c = config.parse(train.schema, args({"data=" .. small, "seq=64"}))
  T.raises(function() train.build(c) end,
    "config: the validation split of data=" .. small .. " has 100 tokens: 1 windows of seq+1=65 tokens, but a " ..
    "batch of batch=2 x 1 rank(s) needs 2; lower seq or batch, or give more data")
  c = config.parse(train.schema, args({"data=" .. small, "seq=64", "eval_every=0"}))
  local p = train.build(c)
  T.eq(p.model.config.max_position_embeddings, 64, "no evaluation: the validation split is not needed")
  c = config.parse(train.schema, args({"data=" .. small, "seq=1000"}))
  T.raises(function() train.build(c) end, "config: the training split of data=" .. small .. " has 1900 tokens: 1 windows")
  c = config.parse(train.schema, args({"data=" .. small, "vocab=100"}))
  T.raises(function() train.build(c) end, "config: vocab=100 is smaller than the data's vocabulary (256 tokens)")
end)

T.case("nn.Llama never guesses the sizes (Hugging Face's defaults are a 6.7B model)", function()
  T.raises(function() nn.Llama({}) end, "llama_config: the config must give the model's sizes vocab_size, hidden_size, " ..
    "intermediate_size, num_hidden_layers, num_attention_heads; missing: vocab_size, hidden_size, intermediate_size, " ..
    "num_hidden_layers, num_attention_heads")
  T.raises(function() nn.Llama({vocab_size = 16, hidden_size = 16, num_hidden_layers = 1, num_attention_heads = 2}) end,
    "missing: intermediate_size")
  local m = nn.Llama({vocab_size = 16, hidden_size = 16, intermediate_size = 32, num_hidden_layers = 1,
    num_attention_heads = 2}, {seed = 1})
  T.eq(m:num_parameters(), 16 * 16 * 2 + 4 * 16 * 16 + 3 * 16 * 32 + 3 * 16, "embed + head, attention, mlp, 3 norms")
end)

T.case("schemas: declared keys, new defaults keep the range, plain defaults declare a type", function()
  local s = config.schema({n = config.int(3, {min = 1, max = 9}), x = config.num(0.5, {above = 0, below = 1}),
    name = config.str("a", {one_of = {"a", "b"}}), flag = config.bool(false), free = 2})
  local c = s:parse({"n=9", "x=0.25", "name=b", "flag=1", "free=-7"})
  T.eq({c.n, c.x, c.name, c.flag, c.free}, {9, 0.25, "b", true, -7})
  T.eq(math.type(s:parse({"x=1e-1"}).x), "float")
  T.raises(function() s:parse({"n=10"}) end, "config: n must be an integer in [1, 9], got 10")
  T.raises(function() s:parse({"x=1"}) end, "config: x must be a finite number in (0, 1), got 1.0")
  T.raises(function() s:parse({"name=c"}) end, "config: name must be one of a, b, got 'c'")
  T.raises(function() s:parse({"free=1.5"}) end, "config: free must be an integer, got '1.5'")
  T.raises(function() s:parse({"bogus=1"}) end, "config: unknown key 'bogus'; valid keys: flag, free, n, name, x")
  local e = s:extend({n = 5, extra = config.num(1.0, {min = 0})}, {function(cc)
    if cc.extra > cc.n then return "extra must not exceed n" end
  end})
  T.eq(e:defaults().n, 5, "a new default")
  T.raises(function() e:parse({"n=0"}) end, "config: n must be an integer in [1, 9], got 0", "the range is kept")
  T.raises(function() e:parse({"extra=6"}) end, "config: extra must not exceed n")
  T.raises(function() s:extend({n = 0}):parse({}) end, "config: n must be an integer in [1, 9], got 0",
    "a bad default is caught")
  T.raises(function() config.int(1, {minimum = 0}) end, "config.int: unknown option 'minimum'")
  T.eq(s:defaults().n, 3, "extend leaves the schema alone")
end)

-- A mistyped key or value names the closest valid ones (one edit, a swap of neighbours counting one,
-- or two edits for words over 3 letters; an abbreviation); the messages are written out by hand.
T.case("did you mean: a mistyped key or one_of value names the closest valid ones", function()
  local s = config.schema({steps = config.int(3, {min = 1}), seq = config.int(8), seed = config.int(1),
    recipe = config.str("nvfp4", {one_of = {"bf16", "nvfp4", "mxfp4"}}), schedule = config.str("wsd")})
  T.raises(function() s:parse({"stpes=3"}) end,
    "config: unknown key 'stpes'; did you mean 'steps'? (valid keys: recipe, schedule, seed, seq, steps)")
  T.raises(function() s:parse({[0] = "exp.lua", "stpes=3"}) end,
    "config: unknown key 'stpes'; did you mean 'steps'? (nvlua exp.lua --help lists the keys)", "with the script")
  T.raises(function() s:parse({"sched=cosine"}) end, "config: unknown key 'sched'; did you mean 'schedule'?",
    "an abbreviation")
  T.raises(function() s:parse({"se=1"}) end, "config: unknown key 'se'; did you mean 'seq'?", "short: one edit only")
  local err = T.raises(function() s:parse({"zzz=1"}) end,
    "config: unknown key 'zzz'; valid keys: recipe, schedule, seed, seq, steps")
  T.eq(err:find("did you mean", 1, true), nil, "nothing is close: no guess")
  err = T.raises(function() s:parse({[0] = "exp.lua", "zzz=1"}) end,
    "config: unknown key 'zzz'; valid keys: recipe, schedule, seed, seq, steps (nvlua exp.lua --help describes them)")
  T.raises(function() s:parse({"recipe=nvpf4"}) end,
    "config: recipe must be one of bf16, nvfp4, mxfp4, got 'nvpf4'; did you mean 'nvfp4'?")
  T.raises(function() s:parse({"recipe=NVFP4"}) end, "got 'NVFP4'; did you mean 'nvfp4'?", "case is ignored")
  err = T.raises(function() s:parse({"recipe=fp8"}) end, "config: recipe must be one of bf16, nvfp4, mxfp4, got 'fp8'")
  T.eq(err:find("did you mean", 1, true), nil, "fp8 is two edits from bf16 but only 3 letters long: no guess")
end)

T.case("schema:help lists every key with its default, what it accepts and its doc; the script's keys first", function()
  local s = config.schema({steps = config.int(3, {min = 1, doc = "training steps"}), name = config.str(""),
    lr = config.num(0.5, {above = 0, below = 1})})
  local e = s:extend({steps = 7, mine = config.bool(true, {doc = "a key of the script"})})
  local text = e:help()
  T.ok(text:find("^usage: nvlua <script> %[key=value %.%.%.%]"), "a usage line first without a script: " .. text)
  local mine, shared = text:find("Keys of this script:", 1, true), text:find("Keys it shares", 1, true)
  T.ok(mine and shared and mine < shared, "two groups, the script's first: " .. text)
  T.ok(text:find("\n  mine=true +true or false\n +a key of the script\n"), "a bool key and its doc: " .. text)
  T.ok(text:find("\n  steps=7 +an integer >= 1\n +training steps\n"), "the new default, the range kept: " .. text)
  T.ok(text:find("\n  lr=0.5 +a finite number in %(0, 1%)\n"), "a number's range: " .. text)
  T.ok(text:find("\n  name='' +a string\n"), "an empty default shown as '': " .. text)
  T.ok(text:find("steps", 1, true) > shared and text:find("mine", 1, true) < shared, "steps is shared, mine is the script's")
  T.eq(s:help():find("Keys of this script", 1, true), nil, "a schema that extends nothing has one group")
end)

-- The experiment scripts declare their own keys: a bad value stops them at once, naming the key.
T.case("the experiment scripts check their keys before doing anything", function()
  local cases = {
    {"experiments/tiny_llama_nvfp4.lua log_every=0", "config: log_every must be an integer >= 1, got 0"},
    {"experiments/compare_recipes.lua only=nvfp5", "config: only: unknown run 'nvfp5' (runs: bf16, fp8_cs, mxfp8"},
    {"experiments/fp4_tokens.lua mults=1,0.5", "config: mults: '0.5' is not a number in [1, 100] (mults: " ..
      "comma-separated token multipliers)"},
    {"experiments/fp4_tokens.lua seeds=0", "config: seeds must be an integer >= 1, got 0"},
    {"experiments/fp4_tokens.lua eval_every=0", "config: eval_every must be > 0: the comparison is of validation"},
    {"experiments/llama3_8b_nvfp4.lua plan=maybe", "config: plan must be true or false, got 'maybe'"},
    {"experiments/llama3_8b_nvfp4.lua kv_heads=5", "config: kv_heads (5) must divide heads (32)"},
    {"experiments/tiny_llama_nvfp4.lua stpes=3", "config: unknown key 'stpes'; did you mean 'steps'? (nvlua " ..
      "experiments/tiny_llama_nvfp4.lua --help lists the keys)"},
    {"experiments/tiny_llama_nvfp4.lua recipe=nvpf4", "got 'nvpf4'; did you mean 'nvfp4'?"},
    {"experiments/llama3_8b_nvfp4.lua shrad=full", "config: unknown key 'shrad'; did you mean 'shard'? (nvlua " ..
      "experiments/llama3_8b_nvfp4.lua --help lists the keys)"},
  }
  for _, c in ipairs(cases) do
    local r = T.run_nvlua(c[1] .. " out=" .. T.shq(ROOT .. "/exp"))
    T.ok(r.code ~= 0, c[1] .. ": exits non-zero")
    T.ok(r.err:find(c[2], 1, true), string.format("%s: stderr should contain %q, got %q", c[1], c[2], r.err))
    T.eq(lfs.attributes(ROOT .. "/exp"), nil, c[1] .. ": nothing written")
  end
end)

T.case("cleanup: the scratch directory is removed", function()
  T.rm_tree(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
