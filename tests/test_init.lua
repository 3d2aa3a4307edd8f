-- tests/test_init.lua: starting a run from pretrained weights, init=hf:<dir> | ckpt:<dir> (train.lua,
-- hf.load_weights), on tiny Llamas (2 layers, hidden 32, 4/2 heads, seq 16, batch 2) and a ~12 KB
-- text corpus written here (byte tokenizer):
--   * a source model trained 3 steps, saved as a Hugging Face directory (hf.save_pretrained) and as
--     its run's checkpoint: init=hf:<dir>, ckpt:<checkpoint> and ckpt:<run dir> start from its
--     weights, byte for byte, and their first step's loss is the source model's own forward on that
--     batch (its loss under a fresh recipe of the run's config), bit for bit, under f32, bf16, nvfp4
--     and fp8_delayed (the weights are master weights; the recipe quantizes them as usual); a run
--     without init= starts elsewhere.
--   * the config: the model's keys are the checkpoint's; defaults (the schema's, an experiment's,
--     a table made in Lua at its defaults) take them silently and config.json shows them; a key the
--     user gave otherwise is an error naming both values; seq past the checkpoint's context refused.
--   * rope_scaling carried (tests/data/hf/llama31: llama3 scaling, sharded weights, vocab 64, on token
--     shards written here): the built model's logits are hf.from_pretrained's bit for bit, and the
--     same weights without the scaling give other logits (the check can see it); the rope_scaling
--     key itself, given with or without init=.
--   * resume=auto of an init run: 2 steps + resume + 2 steps = 4 straight, bit for bit (losses,
--     weights, AdamW moments), nvfp4 with SR; re-loading the init weights at the resume (the mistake
--     this guards against) is seen.
--   * distillation: init= on the student beside teacher=.
--   * data parallel (mpirun, skipped without it): 2 ranks, init=hf:llama31 (6 safetensors files)
--     under shard=none, optimizer, grads and full: the first step's loss is the source's on the
--     global batch (within fp32 reordering), and every sharded run's checkpoint after 2 steps is
--     shard=none's byte for byte.
--   * device=cuda (a GPU, or the CUDA emulator): the weights arrive on the device as they are.
--   * hf.load_weights on its own: from_pretrained's parameters; a shape, a model, a directory, an
--     option that is wrong, named.
--   * errors: a bad prefix, a missing directory, no config.json, not a checkpoint, a damaged one, a
--     config that is not a Llama's, NaN weights, another vocabulary: each names init= and the path.
local T = require "nvlua.test"
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local hf = require "nvlua.hf"
local data = require "nvlua.data"
local llama = require "nvlua.llama"
local dist = require "nvlua.dist"
local st = require "nvlua.safetensors"
local cjson = require "cjson"
local lfs = require "lfs"

local ROOT = T.tmpdir()
local HERE = (arg and arg[0] or "tests/run.lua"):match("^(.*)/[^/]*$") or "."
local LLAMA31 = HERE .. "/data/hf/llama31" -- llama3 RoPE scaling, weights in 6 files, vocab 64
if LLAMA31:sub(1, 1) ~= "/" then LLAMA31 = lfs.currentdir() .. "/" .. LLAMA31 end

local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 4242, lines = 250,
  words = {"in", "the", "beginning", "was", "word", "and", "light", "darkness", "upon", "face", "of", "waters"}})

-- token shards of vocabulary 64 (no manifest: the vocabulary is init='s), for llama31
local SHARDS = ROOT .. "/shards64"
do
  lfs.mkdir(SHARDS)
  local s = 99
  local function ids(n)
    local t = {}
    for i = 1, n do s = (s * 1103515245 + 12345) % 2147483648; t[i] = s % 64 end
    return t
  end
  data.write_shard(SHARDS .. "/train.bin", ids(3000))
  data.write_shard(SHARDS .. "/val.bin", ids(400))
end

local BASE = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "seq=16", "batch=2", "warmup=1", "eval_every=0",
  "log_every=1", "sample_tokens=0", "plot=false", "quiet=true", "keep=0"}
local SHAPE = {"layers=2", "hidden=32", "heads=4", "kv_heads=2", "ffn=64"}

-- the config of run `name`: BASE, then extra (later ones win), parsed by train.schema with the
-- experiment defaults `defaults`
local function cfg(name, extra, defaults)
  local a = {table.unpack(BASE)}
  a[#a + 1] = "out=" .. ROOT .. "/" .. name
  for _, x in ipairs(extra or {}) do a[#a + 1] = x end
  return config.parse(train.schema, a, defaults)
end

local function run(c, hook)
  local p = train.build(c)
  p.peak = 1e9 -- no GEMM-rate measurement
  if hook then hook(p) end
  return train.run(c, p), p
end

local function bits(x) return string.pack("<d", x) end

local function param_bytes(model)
  local out = {}
  for _, e in ipairs(model:named_parameters()) do out[e.name] = e.param:cpu():bytes() end
  return out
end

local function same_params(a, b, what)
  local pa, pb, n = param_bytes(a), param_bytes(b), 0
  for name, s in pairs(pa) do
    n = n + 1
    T.ok(pb[name] == s, what .. ": parameter " .. name .. " differs")
  end
  T.eq(n, 21, what .. ": parameters compared")
end

-- The source of each recipe, made once: a model trained 3 steps under it (seed 7), saved as a
-- Hugging Face directory; -> {model =, hf =, checkpoint =, run =}
local sources = {}
local function source(recipe)
  if sources[recipe] then return sources[recipe] end
  local c = cfg("src_" .. recipe, {"recipe=" .. recipe, "seed=7", "steps=3", table.unpack(SHAPE)})
  local s, p = run(c)
  local dir = ROOT .. "/hf_" .. recipe
  lfs.mkdir(dir)
  hf.save_pretrained(p.model, dir)
  sources[recipe] = {model = p.model, hf = dir, checkpoint = s.checkpoint, run = c.out}
  return sources[recipe]
end

-- The source model's loss on the first batch run c draws (its loader's order), under a fresh recipe
-- made from c: what the first step of a run starting from its weights must compute.
local function source_loss(src, c, p)
  local model = src.model
  local was = model.recipe
  model:set_recipe(train.recipe(c))
  local loss = nv.scope(function()
    local x, y = data.Loader(p.dataset.train, {batch = c.batch, seq = c.seq, seed = c.data_seed}):next()
    return model:loss(x, y)
  end)
  model:set_recipe(was)
  return loss
end

-- ---- the weights and the first loss ----------------------------------------------------------------

for _, recipe in ipairs({"f32", "bf16", "nvfp4", "fp8_delayed"}) do
  T.case("init=hf:, ckpt:<checkpoint>, ckpt:<run dir> under " .. recipe .. ": the source's weights, its loss at step 1",
    function()
    local src = source(recipe)
    local fresh = cfg(recipe .. "_fresh", {"recipe=" .. recipe, "seed=99", "steps=1", table.unpack(SHAPE)})
    local sf, pf = run(fresh)
    local want = source_loss(src, fresh, pf)
    T.ok(sf.losses[1][2] ~= want, "control: a run from the random init (seed 99) starts elsewhere")
    for i, init in ipairs({"hf:" .. src.hf, "ckpt:" .. src.checkpoint, "ckpt:" .. src.run}) do
      local c = cfg(recipe .. "_init" .. i, {"recipe=" .. recipe, "seed=99", "steps=1", "init=" .. init})
      local p = train.build(c)
      p.peak = 1e9
      same_params(p.model, src.model, init .. ": the built model's weights")
      local s = train.run(c, p)
      T.eq(bits(s.losses[1][2]), bits(want), init .. ": the first step's loss is the source's")
      T.eq(p.optimizer.t, 1, init .. ": AdamW starts at step 0 (one step taken)")
      T.eq(p.loader.cursor, 1, init .. ": the data cursor starts at 0 (one batch drawn)")
    end
  end)
end

-- ---- the config ------------------------------------------------------------------------------------

T.case("config: the model's keys are the checkpoint's; defaults take them, a key given otherwise is an error", function()
  local src = source("f32")
  local init = "init=hf:" .. src.hf
  -- an experiment's defaults are not the user's choice: taken over silently (so are the schema's)
  local c = cfg("cfg_adopt", {init}, {layers = 6, hidden = 64, heads = 8, kv_heads = 8, ffn = 128, norm_eps = 1e-6,
    rope_theta = 500000.0, tie = true})
  T.eq({c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.head_dim, c.vocab, c.tie, c.max_positions, c.rope_scaling},
    {2, 32, 4, 2, 64, 8, 256, false, 16, ""})
  T.eq({math.type(c.norm_eps), c.norm_eps, math.type(c.rope_theta), c.rope_theta}, {"float", 1e-5, "float", 10000.0})
  -- keys given as the checkpoint has them, and the "derived" zeros, are fine
  c = cfg("cfg_same", {init, "layers=2", "hidden=32", "head_dim=0", "vocab=0", "max_positions=0", "rope_theta=1e4"})
  T.eq({c.layers, c.head_dim, c.vocab, c.max_positions}, {2, 8, 256, 16})
  -- given otherwise: every contradiction named, with both values
  local msg = T.raises(function() cfg("cfg_bad", {"hidden=64", "layers=2", "heads=8", init}) end,
    "config: hidden=64 but init=hf:" .. src.hf .. " has hidden_size 32; heads=8 but init=hf:" .. src.hf ..
    " has num_attention_heads 4 (the model's keys come from init=; leave them out)")
  T.ok(not msg:find("layers=", 1, true), "layers=2 agrees: not named")
  T.raises(function() cfg("cfg_bad", {init, "tie=true"}) end,
    "config: tie=true but init=hf:" .. src.hf .. " has tie_word_embeddings false")
  T.raises(function() cfg("cfg_bad", {init, "norm_eps=1e-6"}) end,
    "config: norm_eps=1e-06 but init=hf:" .. src.hf .. " has rms_norm_eps 1e-05")
  T.raises(function() cfg("cfg_bad", {init, "vocab=300"}) end, "config: vocab=300 but init=hf:" .. src.hf ..
    " has vocab_size 256")
  T.raises(function() cfg("cfg_bad", {init, "rope_scaling={\"rope_type\":\"linear\",\"factor\":2}"}) end,
    "config: rope_scaling={\"rope_type\":\"linear\",\"factor\":2} but init=hf:" .. src.hf .. " has rope_scaling none")
  -- the checkpoint's context: seq beyond it is refused by name
  T.raises(function() cfg("cfg_bad", {init, "seq=32"}) end,
    "config: seq=32 is longer than init=hf:" .. src.hf .. "'s max_position_embeddings 16")
  -- parsed by a plain defaults table (no init= resolver there): train.check, which train.build runs,
  -- still knows which keys the arguments set
  local plain = config.parse(train.defaults, {init, "hidden=64", "data=" .. CORPUS, "seq=16"}, {layers = 6})
  T.raises(function() train.check(plain) end, "config: hidden=64 but init=hf:" .. src.hf .. " has hidden_size 32 (")
  plain = config.parse(train.defaults, {init, "data=" .. CORPUS, "seq=16"}, {layers = 6})
  T.eq({train.check(plain).layers, plain.hidden}, {2, 32})
  -- a config made in Lua (no arguments to tell): a value other than the schema's default counts as given
  local lua = {}
  for k, v in pairs(train.defaults) do lua[k] = v end
  lua.init, lua.data, lua.out, lua.seq = "hf:" .. src.hf, CORPUS, ROOT .. "/cfg_lua", 16
  lua.hidden = 64
  T.raises(function() train.check(lua) end, "config: hidden=64 but init=hf:" .. src.hf .. " has hidden_size 32")
  lua.hidden = train.defaults.hidden
  train.check(lua)
  T.eq({lua.hidden, lua.layers, lua.ffn}, {32, 2, 64}, "defaults taken over")
  -- the saved config.json shows the model trained
  local r = run(cfg("cfg_run", {init, "steps=1", "recipe=f32"}, {hidden = 64}))
  local saved = cjson.decode(assert(T.read_file(r.run_dir .. "/config.json")))
  T.eq({saved.hidden, saved.layers, saved.head_dim, saved.vocab, saved.init}, {32, 2, 8, 256, "hf:" .. src.hf})
end)

-- ---- RoPE scaling -----------------------------------------------------------------------------------

T.case("rope_scaling: llama31's llama3 scaling is carried; the logits are hf.from_pretrained's, bit for bit", function()
  local c = cfg("rope", {"data=shards:" .. SHARDS, "init=hf:" .. LLAMA31, "recipe=f32", "steps=1"})
  local want = {factor = 8, high_freq_factor = 4, low_freq_factor = 1, original_max_position_embeddings = 64,
    rope_type = "llama3"}
  T.eq(cjson.decode(c.rope_scaling), want, "the rope_scaling key holds the checkpoint's")
  T.eq({c.rope_theta, c.vocab, c.max_positions, c.head_dim}, {500000.0, 64, 128, 16})
  local mc = train.model_config(c, c.vocab)
  T.eq(mc.rope_scaling, want, "train.model_config carries it")
  T.eq({mc.initializer_range, mc.bos_token_id, mc.eos_token_id}, {0.02, 1, 2}, "and config.json's other fields")
  local p = train.build(c)
  local ref = hf.from_pretrained(LLAMA31)
  T.eq(p.model.config.rope_scaling, ref.config.rope_scaling)
  local x = data.Loader(p.dataset.train, {batch = 2, seq = 16, seed = 1}):next()
  local a, b = p.model:forward(x), ref:forward(x)
  T.ok(a:bytes() == b:bytes(), "the logits of the init'd model are from_pretrained's, bit for bit")
  -- control: the same weights without the scaling (what model_config built before) compute otherwise
  local plain = {}
  for k, v in pairs(mc) do plain[k] = v end
  plain.rope_scaling = nil
  local m = llama.Llama(plain, {seed = 1})
  hf.load_weights(m, LLAMA31)
  T.ok(m:forward(x):bytes() ~= b:bytes(), "control: without rope_scaling the logits differ")
  -- given as the checkpoint has it (another spelling of the same numbers, the default filled in): fine
  local same = cfg("rope_same", {"data=shards:" .. SHARDS, "init=hf:" .. LLAMA31, "rope_scaling={\"rope_type\":" ..
    "\"llama3\",\"factor\":8.0,\"low_freq_factor\":1,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":64}"})
  T.eq(cjson.decode(same.rope_scaling), want)
  T.raises(function() cfg("rope_bad", {"data=shards:" .. SHARDS, "init=hf:" .. LLAMA31,
    "rope_scaling={\"rope_type\":\"llama3\",\"factor\":4,\"low_freq_factor\":1,\"high_freq_factor\":4}"}) end,
    "config: rope_scaling={\"rope_type\":\"llama3\",\"factor\":4,\"low_freq_factor\":1,\"high_freq_factor\":4} but " ..
    "init=hf:" .. LLAMA31 .. " has rope_scaling {\"factor\":8,")
  -- the key without init=: a model built with it
  local lin = cfg("rope_lin", {"rope_scaling={\"rope_type\":\"linear\",\"factor\":2}", table.unpack(SHAPE)})
  T.eq(train.model_config(lin, 256).rope_scaling, {rope_type = "linear", factor = 2})
  T.eq(llama.Llama(train.model_config(lin, 256)).config.rope_scaling, {rope_type = "linear", factor = 2})
  T.raises(function() cfg("rope_x", {"rope_scaling=linear"}) end,
    "config: rope_scaling: must be \"\" (none) or a JSON object such as {\"rope_type\":\"linear\",\"factor\":2}, got 'linear'")
  T.raises(function() cfg("rope_x", {"rope_scaling={\"rope_type\":\"yarn\",\"factor\":2}"}) end,
    "config: rope_scaling: rope_scaling rope_type 'yarn' is not supported (nvlua computes default, linear, dynamic, llama3)")
  T.raises(function() cfg("rope_x", {"rope_scaling={\"rope_type\":\"linear\"}"}) end,
    "config: rope_scaling: rope_scaling.factor must be a number > 0 for rope_type 'linear', got nil")
end)

-- ---- resume ------------------------------------------------------------------------------------------

T.case("resume=auto of an init run: 2 + resume + 2 steps = 4 straight, bit for bit; init is not loaded again", function()
  local src = source("nvfp4")
  local extra = {"recipe=nvfp4", "seed=99", "steps=4", "init=hf:" .. src.hf, "ckpt_every=0"}
  local s0, p0 = run(cfg("resume_straight", extra))
  -- both parts as a job script runs them: init= and resume=auto each time (out= empty at first)
  local split = {"resume=auto", table.unpack(extra)}
  local first = cfg("resume_split", split)
  local p1 = train.build(first)
  p1.peak = 1e9
  first.steps = 2 -- (the 4-step schedule: stopped as a kill after a checkpoint would stop it)
  local s1 = train.run(first, p1)
  T.eq(s1.steps, 2)
  T.eq({bits(s1.losses[1][2]), bits(s1.losses[2][2])}, {bits(s0.losses[1][2]), bits(s0.losses[2][2])},
    "resume=auto with nothing to resume: init= loaded, steps 1 and 2 as the straight run's")
  local second = cfg("resume_split", split)
  local s2, p2 = run(second)
  T.eq({s2.steps, #s2.losses, s2.losses[1][1]}, {4, 2, 3}, "the resumed run trained steps 3 and 4")
  for i = 1, 2 do T.eq(bits(s2.losses[i][2]), bits(s0.losses[i + 2][2]), "loss of step " .. (i + 2)) end
  same_params(p2.model, p0.model, "final weights")
  local o0, o2 = p0.optimizer:state(), p2.optimizer:state()
  T.eq(o2.step, o0.step)
  for name, m in pairs(o0.m) do
    T.ok(m:bytes() == o2.m[name]:bytes() and o0.v[name]:bytes() == o2.v[name]:bytes(), "AdamW moments of " .. name)
  end
  -- control: loading the init weights over the resumed ones (at step 3) is seen in the losses
  local third = cfg("resume_control", extra)
  os.execute(string.format("mkdir -p '%s/checkpoints' && cp -r '%s/checkpoints/step-000002' '%s/checkpoints/'",
    third.out, second.out, third.out))
  third.resume = "auto"
  local s3 = run(third, function(p)
    local base = p.schedule
    p.schedule = function(step)
      if step == 3 then train.load_init(third, p.model) end
      return base(step)
    end
  end)
  T.ok(s3.losses[1][2] ~= s0.losses[3][2], "control: the init weights at step 3 give another loss")
end)

-- ---- distillation ----------------------------------------------------------------------------------

T.case("distillation: init= starts the student from its weights beside teacher=", function()
  local src = source("f32")
  -- the student starts as the teacher: the KL of the first step is zero, its cross-entropy the source's
  local c = cfg("distill", {"recipe=f32", "teacher_recipe=f32", "teacher=" .. src.hf, "init=hf:" .. src.hf, "seed=99",
    "steps=1", "distill_alpha=0.5"})
  local s, p = run(c)
  local rec = cjson.decode((T.read_file(c.out .. "/metrics.jsonl"):match("^[^\n]+")))
  -- (core.distill_loss computes its own log-softmax, not core.cross_entropy's: 1e-7 is f32's resolution
  -- of a per-token loss near 5 over the batch's 32 tokens; measured 2e-10)
  T.near(rec.ce, source_loss(src, c, p), 1e-7, "the student's cross-entropy is the source's")
  T.eq(rec.kl, 0, "KL(teacher || student) of equal models")
  T.eq(s.steps, 1)
end)

-- ---- data parallelism --------------------------------------------------------------------------------

local MPIRUN = (function()
  local h = io.popen("command -v mpirun 2>/dev/null")
  local path = h and h:read("l")
  if h then h:close() end
  return path ~= "" and path or nil
end)()

T.case("2 ranks, init=hf:llama31 (6 files): shard=none, optimizer, grads, full load it; sharded = none, byte for byte",
  function()
  if not MPIRUN then T.skip("mpirun not found") end
  if not dist.info().mpi then T.skip("nvlua built without MPI") end
  local main = T.write_file(ROOT .. "/main.lua", 'require("nvlua.train").main({}, arg)\n')
  local function launch(mode)
    local out = ROOT .. "/dp_" .. mode
    local a = {"data=shards:" .. SHARDS, "cache=" .. ROOT .. "/cache", "init=hf:" .. LLAMA31, "recipe=f32", "seq=16",
      "batch=2", "steps=2", "warmup=0", "schedule=constant", "eval_every=0", "sample_tokens=0", "plot=false",
      "quiet=true", "keep=0", "ckpt_every=0", "dist=true", "shard=" .. mode, "check_memory=false", "out=" .. out}
    local h = assert(io.popen(string.format("env OMP_NUM_THREADS=1 timeout 120 %s --allow-run-as-root --oversubscribe " ..
      "--bind-to none -np 2 %s %s %s 2>&1", MPIRUN, T.shq(T.nvlua()), T.shq(main), table.concat(a, " "))))
    local text = h:read("a")
    local _, _, code = h:close()
    T.eq(code, 0, mode .. ": mpirun exit status; output:\n" .. text)
    local losses = {}
    for line in io.lines(out .. "/metrics.jsonl") do
      local r = cjson.decode(line)
      if r.loss then losses[r.step] = r.loss end
    end
    return out, losses
  end
  local ref = hf.from_pretrained(LLAMA31)
  local want = nv.scope(function() -- the global batch: 2 ranks x 2 windows = 1 rank's 4
    local ds = data.shards(SHARDS, {cache = ROOT .. "/cache"})
    local x, y = data.Loader(ds.train, {batch = 4, seq = 16, seed = 1}):next()
    return ref:loss(x, y)
  end)
  local none, l0 = launch("none")
  -- the ranks' mean of their mean losses against one mean: the same per-token f32 losses summed in
  -- another order, and GEMMs of 32 rows instead of 64 (an f32 rounding of the logits, ~1e-7
  -- relative): 1e-5 of a loss near ln 64 = 4.2 (measured 0)
  T.near(l0[1], want, 1e-5, "step 1's loss is llama31's on the global batch")
  local model = "/checkpoints/step-000002/model/model.safetensors"
  for _, mode in ipairs({"optimizer", "grads", "full"}) do
    local dir, l = launch(mode)
    T.eq({bits(l[1]), bits(l[2])}, {bits(l0[1]), bits(l0[2])}, mode .. ": the losses are shard=none's")
    T.ok(T.read_file(dir .. model) == T.read_file(none .. model), mode .. ": the weights after 2 steps are shard=none's")
  end
end)

-- ---- device=cuda --------------------------------------------------------------------------------------

T.case("device=cuda: the init weights arrive on the device as they are", function()
  T.need_gpu()
  local src = source("f32")
  local c = cfg("cuda", {"device=cuda", "recipe=bf16", "steps=1", "seed=99", "init=hf:" .. src.hf})
  local p = train.build(c)
  T.eq(p.model.grad_buffer:device(), "cuda")
  same_params(p.model, src.model, "the weights on the device")
  p.peak = 1e9
  local s = train.run(c, p)
  -- the GPU's GEMMs sum in another order than the CPU's: the first loss agrees within bf16's
  -- rounding of the activations (8 bits of mantissa: 2^-8 relative, on a loss near 5.5)
  T.near(s.losses[1][2], source_loss(src, c, p), 5.5 * 2 ^ -8, "the first loss is the source's")
end)

-- ---- hf.load_weights ----------------------------------------------------------------------------------

T.case("hf.load_weights: a directory's weights into a model built for them; bad input named", function()
  local ref = hf.from_pretrained(LLAMA31)
  local m = llama.Llama(hf.read_config(LLAMA31), {seed = 5})
  local info = hf.load_weights(m, LLAMA31)
  T.eq(info, {missing = {}, unexpected = {}, ignored = {}})
  T.eq(param_bytes(m), param_bytes(ref), "the parameters are from_pretrained's")
  local c = hf.read_config(LLAMA31)
  c.intermediate_size = 32
  T.raises(function() hf.load_weights(llama.Llama(c), LLAMA31) end, "load_weights: " .. LLAMA31 ..
    ": model.layers.0.mlp.gate_proj.weight has shape [64,32] in model-00002-of-00006.safetensors, the model's is [32,32]")
  T.raises(function() hf.load_weights({}, LLAMA31) end, "load_weights: model must be an nvlua model (llama.Llama), got table")
  T.raises(function() hf.load_weights(m, ROOT .. "/nope") end, "load_weights: " .. ROOT .. "/nope: no such directory")
  T.raises(function() hf.load_weights(m, LLAMA31, {dtype = "f16"}) end,
    "load_weights: option dtype must be \"f32\" or \"bf16\", got f16")
end)

-- ---- errors --------------------------------------------------------------------------------------------

T.case("errors: each names init= and the path", function()
  local src = source("f32")
  local function bad(v, text) T.raises(function() cfg("err", {"init=" .. v}) end, text, v) end
  bad("/some/dir", "config: init: '/some/dir' is neither hf:<Hugging Face Llama directory> nor ckpt:<nvlua checkpoint " ..
    "or run directory>")
  bad("gguf:" .. src.hf, "config: init: 'gguf:" .. src.hf .. "' is neither hf:")
  bad("hf:", "config: init: 'hf:' is neither")
  bad("hf:" .. ROOT .. "/nope", "config: init: hf:" .. ROOT .. "/nope: no such directory")
  bad("hf:" .. CORPUS, "config: init: hf:" .. CORPUS .. ": not a directory (a file)")
  bad("hf:" .. ROOT, "config: init: hf:" .. ROOT .. ": no config.json (not a Hugging Face model directory)")
  bad("ckpt:" .. src.hf, "config: init: ckpt:" .. src.hf .. ": neither a checkpoint (no trainer.json) nor a run " ..
    "directory holding one (no complete checkpoint in " .. src.hf .. "/checkpoints)")
  -- a damaged checkpoint: its weights truncated
  local broken = ROOT .. "/broken"
  os.execute(string.format("cp -r '%s' '%s'", src.checkpoint, broken))
  local w = broken .. "/model/model.safetensors"
  T.write_file(w, assert(T.read_file(w)):sub(1, 100))
  bad("ckpt:" .. broken, "config: init: ckpt:" .. broken .. ": the checkpoint " .. broken .. " is damaged: checkpoint " ..
    broken .. "/model/model.safetensors: 100 bytes, but trainer.json recorded")
  -- not a Llama nvlua computes
  local gelu = ROOT .. "/gelu"
  lfs.mkdir(gelu)
  local conf = cjson.decode(assert(T.read_file(src.hf .. "/config.json")))
  conf.hidden_act = "gelu"
  T.write_file(gelu .. "/config.json", cjson.encode(conf))
  bad("hf:" .. gelu, "config: init=hf:" .. gelu .. ": " .. gelu .. "/config.json is not a Llama nvlua computes: " ..
    "llama_config: hidden_act = gelu is not supported (nvlua computes hidden_act = silu)")
  -- NaN weights: refused when the weights are loaded, by tensor
  local nan = ROOT .. "/nan"
  lfs.mkdir(nan)
  T.write_file(nan .. "/config.json", assert(T.read_file(src.hf .. "/config.json")))
  local ts = st.load(src.hf .. "/model.safetensors")
  ts["model.norm.weight"]:fill_(0 / 0)
  assert(st.save(nan .. "/model.safetensors", ts, {}))
  T.raises(function() train.build(cfg("err_nan", {"init=hf:" .. nan})) end, "config: init=hf:" .. nan ..
    ": load_weights: " .. nan .. ": model.safetensors: tensor model.norm.weight holds NaN values")
  -- another vocabulary than the data's
  T.raises(function() train.build(cfg("err_vocab", {"init=hf:" .. LLAMA31})) end, "config: init=hf:" .. LLAMA31 ..
    " has vocab_size 64, but data=" .. CORPUS .. " has a vocabulary of 256 tokens (byte tokens); train it on data " ..
    "tokenized with its tokenizer")
end)

T.case("cleanup: the scratch directory is removed", function()
  T.ok(T.rm_tree(ROOT))
end)
