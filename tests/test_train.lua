-- tests/test_train.lua: the training loop (lua/nvlua/train.lua) end to end on a tiny Llama (2 layers,
-- hidden 32, 4/2 heads, seq 16, batch 2) and a ~24 KB text corpus written here (byte tokenizer):
--   * bit-exact resume: 2N steps straight against N steps, a checkpoint and a new run with
--     resume=auto, under bf16, nvfp4 (stochastic rounding and RHT on) and fp8_delayed (amax
--     histories), and with grad_accum=2: every loss, grad norm, lr and validation loss in
--     metrics.jsonl and every final parameter are equal bit for bit. A control resets the SR
--     generator at the resume and must differ, so the comparison can see a state that is lost.
--   * a run that died after its last checkpoint: resume=auto drops the metrics logged past it.
--   * non-finite loss or gradient (injected by wrapping forward_backward): the step is skipped,
--     counted, logged, changes nothing; more than max_bad_steps in a row stop the run.
--   * config: key=value overrides are type-checked; unknown keys list the valid ones; config.json.
--   * recipes: train.build takes a recipe value or a name registered with recipe.register, and under
--     dist=true (a world of 2 stubbed in this process) either gets the amax reducer and the shard.
--   * Ctrl-C (nvlua.signal.raise from inside the run): the step finishes, a checkpoint is written,
--     summary.interrupted; resume=auto then ends where an uninterrupted run ends, bit for bit.
--   * eval (val loss and perplexity in metrics.jsonl), the end-of-run sample, loss.png; evaluating
--     does not change training (fp8_delayed: eval forwards would push amaxes into the histories).
--   * throughput fields: ms, tokens/s and MFU, and the FLOP count they use.
--   * MoR with every=2: choices reused across the checkpoint resume bit for bit (recipe state);
--     the log's mor_* shares.
--   * knowledge distillation (teacher= a Hugging Face directory): kl and ce logged, the loss their
--     mix; a teacher of another vocabulary is refused by name.
--   * ckpt_every=auto (the Young/Daly rule for injected costs, and a run's logged choices; as the
--     default, its 300 s floor before the first save keeps a short run to its final checkpoint); the
--     background writer's operations and the surfacing of its errors (test_crash.lua: its files and
--     its kills).
-- Every run writes under one scratch directory (os.tmpname), removed by the last case.
local T = require "nvlua.test"
local train = require "nvlua.train"
local config = require "nvlua.config"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"
local lfs = require "lfs"

local ROOT = T.tmpdir()
local CACHE = ROOT .. "/cache"

-- a deterministic corpus: lines of words picked by an LCG (about 24 KB)
local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 12345, lines = 500,
  prefix = function(i) return string.format("%d:%d ", i // 30 + 1, i % 30 + 1) end,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in", "darkness", "was",
    "upon", "face", "of", "waters", "said", "let", "there", "be", "morning", "evening", "day"}})

-- the tiny run every case starts from; extra: more "key=value" arguments (later ones win)
local BASE = {"data=" .. CORPUS, "cache=" .. CACHE, "layers=2", "hidden=32", "heads=4", "kv_heads=2", "ffn=64",
  "seq=16", "batch=2", "steps=6", "warmup=2", "lr=3e-3", "min_lr=3e-4", "schedule=wsd", "decay=0.5", "eval_every=3",
  "eval_batches=2", "log_every=1", "sample_tokens=0", "plot=false", "quiet=true", "keep=0", "seed=7"}
local function cfg(name, extra)
  local args = {}
  for _, a in ipairs(BASE) do args[#args + 1] = a end
  args[#args + 1] = "out=" .. ROOT .. "/" .. name
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  return config.parse(train.defaults, args)
end

local PEAK = 1e9 -- a fixed "peak" so the runs skip measuring sgemm (the MFU case checks the real one)

-- build the parts of c, let hook(parts) change them, run
local function run(c, hook)
  local p = train.build(c)
  p.peak = PEAK
  if hook then hook(p) end
  return train.run(c, p), p
end

local function read_metrics(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do out[#out + 1] = cjson.decode(line) end
  return out
end

-- metrics without the wall-clock fields
local TIMING = {ms = true, tokens_per_s = true, mfu = true}
local function numerics(recs)
  local out = {}
  for i, r in ipairs(recs) do
    local c = {}
    for k, v in pairs(r) do if not TIMING[k] then c[k] = v end end
    out[i] = c
  end
  return out
end

-- records equal field by field; numbers compared by their bits (string.pack), so -0 ~= 0 too
local function bits(v) return type(v) == "number" and string.pack("<d", v) or v end
local function same_records(a, b, what)
  T.eq(#a, #b, what .. ": number of records")
  for i = 1, #a do
    for _, r in ipairs({{a[i], b[i]}, {b[i], a[i]}}) do
      for k, v in pairs(r[1]) do
        if bits(v) ~= bits(r[2][k]) then
          error(string.format("%s: record %d (step %s) field %s: %s vs %s", what, i, tostring(a[i].step), k,
            string.format("%.17g", tonumber(v) or 0 / 0), string.format("%.17g", tonumber(r[2][k]) or 0 / 0)), 2)
        end
      end
    end
  end
end

local function param_bytes(model)
  local out = {}
  for _, p in ipairs(model:named_parameters()) do out[p.name] = p.param:bytes() end
  return out
end

local function same_params(a, b, what)
  local pa, pb = param_bytes(a), param_bytes(b)
  local n = 0
  for name, s in pairs(pa) do
    n = n + 1
    T.ok(pb[name] == s, what .. ": parameter " .. name .. " differs")
  end
  T.eq(n, 21, what .. ": parameters compared")
end

local function entry(model, name)
  for _, p in ipairs(model:named_parameters()) do if p.name == name then return p end end
  error("no parameter " .. name)
end

local function is_finite(x) return type(x) == "number" and x == x and x ~= math.huge and x ~= -math.huge end

-- ---- bit-exact resume --------------------------------------------------------------------------

-- 2N = 6 steps straight; then the first N = 3 steps of the same run (its schedule is the 6-step
-- one: the run is stopped at N as a kill after a checkpoint would stop it) and a new process-like
-- run (everything rebuilt from the config) with resume=auto for steps 4..6.
local function resume_case(tag, extra)
  local straight = cfg(tag .. "/straight", extra)
  local s0, p0 = run(straight)
  T.eq(s0.steps, 6)
  T.eq(s0.skipped, 0)

  local first = cfg(tag .. "/resumed", extra)
  local p1 = train.build(first)
  p1.peak = PEAK
  first.steps = 3
  local s1 = train.run(first, p1)
  T.eq(s1.steps, 3)
  T.eq(s1.checkpoint, ROOT .. "/" .. tag .. "/resumed/checkpoints/step-000003")

  local second = cfg(tag .. "/resumed", {table.unpack(extra)})
  second.resume = "auto"
  local s2, p2 = run(second)
  T.eq(s2.steps, 6)
  T.eq(#s2.losses, 3, "the resumed run trained steps 4..6")
  T.eq(s2.losses[1][1], 4)

  local m0, m2 = read_metrics(straight.out), read_metrics(second.out)
  local steps, evals = 0, 0
  for _, r in ipairs(m0) do
    if r.loss then steps = steps + 1; T.ok(is_finite(r.loss) and is_finite(r.grad_norm) and r.lr > 0) end
    if r.val_loss then evals = evals + 1 end
  end
  T.eq(steps, 6, "a record per step")
  T.eq(evals, 2, "evals at steps 3 and 6")
  -- metrics.jsonl holds the losses exactly (a JSON writer with 14 digits would not)
  local k = 0
  for _, r in ipairs(m0) do
    if r.loss then k = k + 1; T.eq(bits(r.loss), bits(s0.losses[k][2]), "metrics.jsonl loss of step " .. r.step) end
  end
  same_records(numerics(m2), numerics(m0), tag .. " metrics.jsonl")
  -- the in-memory losses agree too (metrics.jsonl must not round them)
  for i = 1, 3 do T.eq(bits(s2.losses[i][2]), bits(s0.losses[i + 3][2]), "loss of step " .. (i + 3)) end
  same_params(p2.model, p0.model, tag .. " final parameters")
  T.eq(p2.optimizer.t, p0.optimizer.t)
  local o0, o2 = p0.optimizer:state(), p2.optimizer:state()
  for name, m in pairs(o0.m) do
    T.ok(m:bytes() == o2.m[name]:bytes() and o0.v[name]:bytes() == o2.v[name]:bytes(), "AdamW moments of " .. name)
  end
  T.eq(p2.loader.cursor, p0.loader.cursor)
  T.eq(p2.recipe:state(), p0.recipe:state(), "recipe state (generator offset, amax histories)")
  return s0, p0, m0
end

T.case("resume is bit-exact under bf16: 6 steps straight = 3 + resume=auto + 3", function()
  resume_case("bf16", {"recipe=bf16"})
end)

T.case("resume is bit-exact under nvfp4 (SR + RHT + 2-D weights); losing the SR state is seen", function()
  local _, p0, m0 = resume_case("nvfp4", {"recipe=nvfp4"})
  T.eq(p0.recipe.options.sr, true)
  T.ok(p0.recipe:state().offset > 0, "the SR generator was used")
  -- control: the same resume with the SR generator's offset reset after loading must differ
  local c = cfg("nvfp4/resumed", {"recipe=nvfp4"})
  c.out = ROOT .. "/nvfp4/control"
  os.execute(string.format("mkdir -p '%s/checkpoints' && cp -r '%s/nvfp4/resumed/checkpoints/step-000003' '%s/checkpoints/'",
    c.out, ROOT, c.out))
  c.resume = "auto"
  local s = run(c, function(p)
    local base = p.schedule
    p.schedule = function(step)
      if step == 4 then p.recipe:generator():set_offset(0) end
      return base(step)
    end
  end)
  local want = {}
  for _, r in ipairs(m0) do if r.loss then want[r.step] = r.loss end end
  T.eq(s.losses[1][2], want[4], "step 4's forward has no SR: same loss")
  T.ok(s.losses[2][2] ~= want[5] and s.losses[3][2] ~= want[6], "other SR draws give other losses at steps 5, 6")
end)

T.case("resume is bit-exact under MoR with choices reused across the checkpoint (every = 2)", function()
  -- decided at steps 1, 3, 5 and reused at 2, 4, 6: step 4 reuses step 3's choices from the
  -- checkpoint. A lost state would decide again at step 4 and keep that to step 5: recipe:state()
  -- (compared by resume_case) would then hold step 4, not 5.
  require("nvlua.recipe").register("mor_every2", function(s) return require("nvlua.recipe").mor({every = 2, seed = s.seed}) end)
  local _, p0, m0 = resume_case("mor", {"recipe=mor_every2"})
  local st = p0.recipe:state().mor.sticky
  local n = 0
  for _, v in pairs(st) do n = n + 1; T.eq(v.step, 5, "decided at step 5") end
  T.eq(n, 2 * 7 * 6, "a choice per operand of every MoR linear")
  for _, r in ipairs(m0) do
    if r.loss then
      T.ok(r.mor_low > 0.9 and r.mor_low <= 1, "the log's low-precision share at step " .. r.step)
      for _, k in ipairs({"mor_low_fprop", "mor_low_dgrad", "mor_low_wgrad", "mor_low_b0", "mor_low_b1", "mor_e4m3",
                          "mor_tensors_low", "mor_tensors_e4m3"}) do
        T.ok(type(r[k]) == "number" and r[k] >= 0 and r[k] <= 1, k .. " at step " .. r.step)
      end
      -- per tensor, an operand tensor is one unit: the two shares are one number
      T.near(r.mor_tensors_low, r.mor_units_low, 1e-12, "operand tensors are the units per tensor, step " .. r.step)
    end
  end
end)

T.case("resume is bit-exact under fp8_delayed (amax histories in the checkpoint)", function()
  local _, p0 = resume_case("fp8d", {"recipe=fp8_delayed"})
  local n = 0
  for _, h in pairs(p0.recipe:state().histories) do n = n + 1; T.ok(h.count > 0) end
  T.ok(n > 0, "the recipe kept amax histories")
end)

T.case("resume is bit-exact with grad_accum=2 (nvfp4)", function()
  local _, p0 = resume_case("accum", {"recipe=nvfp4", "grad_accum=2"})
  T.eq(p0.loader.cursor, 12, "2 micro-batches per step")
end)

T.case("a run that died after its last checkpoint: resume=auto drops the metrics logged past it", function()
  local c = cfg("crash", {"recipe=bf16", "ckpt_every=2"})
  run(c)
  local before = numerics(read_metrics(c.out))
  local names = {}
  for _, d in ipairs(ckpt.list(c.out)) do names[#names + 1] = d:match("[^/]+$") end
  T.eq(names, {"step-000002", "step-000004", "step-000006"})
  ckpt.rm_rf(c.out .. "/checkpoints/step-000006")
  ckpt.rm_rf(c.out .. "/checkpoints/step-000004")
  local c2 = cfg("crash", {"recipe=bf16", "ckpt_every=2", "resume=auto"})
  local s = run(c2)
  T.eq(s.losses[1][1], 3, "resumed after step 2")
  same_records(numerics(read_metrics(c.out)), before, "metrics after the rerun of steps 3..6")
end)

-- ---- non-finite steps --------------------------------------------------------------------------

-- Wrap forward_backward: at the steps in nan_w, lm_head.weight[1][1] is NaN during the step (loss
-- and gradients NaN; the weight is put back after); at the steps in inf_g, the loss is fine and a
-- gradient element is set to +inf afterwards. snap[step] = the parameters' bytes at the step's start.
local function inject(p, nan_w, inf_g, snap)
  local m = p.model
  local w, orig = entry(m, "lm_head.weight"), m.forward_backward
  m.forward_backward = function(self, x, y, o)
    local step = self.step
    if snap then snap[step] = param_bytes(self) end
    if nan_w[step] then
      local old = w.param:get(1, 1)
      w.param:set(1, 1, 0 / 0)
      local loss, n = orig(self, x, y, o)
      w.param:set(1, 1, old)
      return loss, n
    end
    local loss, n = orig(self, x, y, o)
    if inf_g[step] then entry(self, "model.layers.0.mlp.up_proj.weight").grad:set(2, 3, math.huge) end
    return loss, n
  end
end

T.case("a NaN loss or an Inf gradient skips the step: counted, logged, parameters untouched", function()
  local c = cfg("nan", {"recipe=nvfp4", "steps=7", "max_bad_steps=2", "eval_every=0"})
  local snap = {}
  local s, p = run(c, function(p) inject(p, {[2] = true, [5] = true}, {[3] = true, [6] = true}, snap) end)
  T.eq(s.steps, 7, "two bad steps in a row (max_bad_steps=2) do not stop the run")
  T.eq(s.skipped, 4)
  T.eq(p.optimizer.t, 3, "AdamW stepped only on the good steps")
  local recs = read_metrics(c.out)
  T.eq(#recs, 7)
  for i, r in ipairs(recs) do
    T.eq(r.step, i)
    if i == 2 or i == 5 then
      T.eq(r.skipped, true, "step " .. i)
      T.ok(type(r.loss) == "string" and r.loss:find("nan"), "the NaN loss is logged as a string: " .. tostring(r.loss))
      T.ok(type(r.grad_norm) == "string" and r.grad_norm:find("nan"), "grad norm: " .. tostring(r.grad_norm))
    elseif i == 3 or i == 6 then
      T.eq(r.skipped, true, "step " .. i)
      T.ok(is_finite(r.loss), "the loss was finite")
      T.eq(r.grad_norm, "inf")
    else
      T.eq(r.skipped, nil, "step " .. i)
      T.ok(is_finite(r.loss) and is_finite(r.grad_norm))
    end
  end
  T.eq(snap[3], snap[2], "skipped step 2 changed no parameter")
  T.eq(snap[4], snap[3], "skipped step 3 changed no parameter")
  T.ok(snap[5]["lm_head.weight"] ~= snap[4]["lm_head.weight"], "good step 4 did change them")
  for _, e in ipairs(p.model:named_parameters()) do
    for _, v in ipairs(e.param:reshape(-1):totable()) do
      if not is_finite(v) then error("parameter " .. e.name .. " is not finite after the run") end
    end
  end
end)

T.case("more than max_bad_steps non-finite steps in a row stop the run with a clear message", function()
  local c = cfg("nanstop", {"recipe=bf16", "steps=8", "max_bad_steps=2", "eval_every=0"})
  local bad = {}
  for i = 2, 8 do bad[i] = true end
  T.raises(function() run(c, function(p) inject(p, bad, {}) end) end,
    "training stopped at step 4: 3 consecutive steps with a non-finite loss, gradient, weight or activation (max_bad_steps=2)")
  local recs = read_metrics(c.out)
  T.eq(#recs, 4, "metrics.jsonl holds the steps up to the stop")
  T.eq({recs[1].skipped, recs[2].skipped, recs[3].skipped, recs[4].skipped}, {nil, true, true, true})
  T.eq(ckpt.latest(c.out), nil, "no checkpoint of a diverged run")
  T.eq(require("nvlua.signal").pending(), false)
end)

-- ---- config ------------------------------------------------------------------------------------

T.case("config: key=value overrides are type-checked; unknown keys list the valid ones", function()
  local d = train.defaults
  local c = config.parse(d, {"steps=12", "lr=0.5", "min_lr=1", "tie=true", "quiet=0", "schedule=cosine", "out=a=b"})
  T.eq(c.steps, 12); T.eq(math.type(c.steps), "integer")
  T.eq(c.lr, 0.5); T.eq(math.type(c.min_lr), "float", "a number key keeps its type: min_lr=1 is 1.0")
  T.eq(c.tie, true); T.eq(c.quiet, false)
  T.eq(c.schedule, "cosine"); T.eq(c.out, "a=b")
  T.eq(d.steps, 300, "the defaults are not changed")
  T.raises(function() config.parse(d, {"steps=12.5"}) end, "config: steps must be an integer, got '12.5'")
  T.raises(function() config.parse(d, {"batch=eight"}) end, "config: batch must be an integer, got 'eight'")
  T.raises(function() config.parse(d, {"lr=fast"}) end, "config: lr must be a number, got 'fast'")
  T.raises(function() config.parse(d, {"tie=yes"}) end, "config: tie must be true or false, got 'yes'")
  T.raises(function() config.parse(d, {"steps"}) end, "config: arguments are key=value, got 'steps'")
  local err = T.raises(function() config.parse(d, {"nonsense=3"}) end, "config: unknown key 'nonsense'; valid keys: ")
  local keys = {}
  for k in pairs(d) do keys[#keys + 1] = k end
  table.sort(keys)
  T.ok(err:find(table.concat(keys, ", "), 1, true), "the message lists every valid key, sorted")
end)

T.case("config: train.main merges an experiment's defaults, saves the resolved config as config.json", function()
  local out = ROOT .. "/main"
  local big = (1 << 60) + 12345 -- a seed past 2^53 must survive the JSON
  local exp = {my_option = 4, steps = 2}
  local args = {}
  for _, a in ipairs(BASE) do args[#args + 1] = a end
  for _, a in ipairs({"out=" .. out, "steps=2", "my_option=9", "seed=" .. big, "recipe=bf16", "save=false"}) do
    args[#args + 1] = a
  end
  T.raises(function() train.main(exp, {"out=" .. out, "my_optoin=1"}) end, "unknown key 'my_optoin'")
  T.eq(lfs.attributes(out), nil, "nothing was created for a bad config")
  T.raises(function() train.main(exp, {"out=" .. out, "device=gpu"}) end, "config: device: invalid device 'gpu' (valid: cpu, cuda)")
  if not require("nvlua").cuda.available() then
    T.raises(function() train.main(exp, {"out=" .. out, "device=cuda"}) end, "config: device: device 'cuda' is not available here")
  end
  local s = train.main(exp, args)
  T.eq(s.steps, 2)
  T.eq(s.checkpoint, nil, "save=false")
  local text = assert(T.read_file(out .. "/config.json"))
  local saved = cjson.decode(text)
  T.ok(text:find('"seed": ' .. string.format("%d", big), 1, true), "the 64-bit seed is written exactly")
  local merged = {}
  for k, v in pairs(train.defaults) do merged[k] = v end
  merged.my_option = 4
  local want = config.parse(merged, args)
  T.eq(want.my_option, 9)
  local n = 0
  for k, v in pairs(want) do
    n = n + 1
    if k ~= "seed" then T.eq(saved[k], v, "config.json " .. k) end
  end
  for k in pairs(saved) do T.ok(want[k] ~= nil, "config.json has no extra key " .. k) end
  T.ok(n > 50)
  T.raises(function() run(cfg("main", {"resume=" .. out .. "/nowhere"})) end, "is not a checkpoint directory")
end)

-- ---- recipes: a value or a registered name -------------------------------------------------------

-- fn() with train.build seeing a world of 2 ranks (rank 0) in this one process: dist's functions
-- are stubbed (broadcast and all_reduce_number are identities) and put back afterwards.
local function in_world_of_two(fn)
  local dist = require "nvlua.dist"
  local fake = {init = function() return 0, 2 end, rank = function() return 0 end, world_size = function() return 2 end,
    broadcast = function(t) return t end, all_reduce_number = function(x) return x end}
  local function set(fns)
    local prev = {}
    for k, f in pairs(fns) do prev[k], dist[k] = dist[k], f end
    return prev
  end
  return T.with(set, fake, fn)
end

T.case("train.build takes a recipe value or a registered name; under dist=true either gets the data-parallel hooks", function()
  local recipe = require "nvlua.recipe"
  -- a value: the run's recipe, every linear's, with the amax reducer and the shard set
  local mine = recipe.custom(function(c) return c.high_precision and "bf16" or "e4m3" end)
  local c = cfg("recipe/value", {"dist=true"})
  c.recipe = mine
  local p = in_world_of_two(function() return train.build(c) end)
  T.eq(p.world, 2)
  T.ok(p.recipe == mine, "parts.recipe is the value")
  for _, l in ipairs(p.model:linears()) do T.ok(l.module.recipe == mine, l.name .. " runs the value") end
  T.eq(type(mine.amax_reducer), "function", "the amax reducer (max over the ranks) is set")
  T.eq(mine.amax_reducer(0.5), 0.5)
  T.eq(mine.shard, {rank = 0, world = 2}, "SR draws at this rank's rows of the global batch")
  -- a name registered by the user: built from the config's settings, hooked the same way
  recipe.register("test_train_mine", function(s) return recipe.custom(function() return "bf16" end, {seed = s.seed}) end)
  T.eq(recipe.names()[#recipe.names()], "test_train_mine")
  local pn = in_world_of_two(function() return train.build(cfg("recipe/named", {"dist=true", "recipe=test_train_mine"})) end)
  T.eq(pn.recipe.name, "custom")
  T.eq(pn.recipe.options.seed, 7, "the config's seed")
  T.eq(type(pn.recipe.amax_reducer), "function")
  T.eq(pn.recipe.shard, {rank = 0, world = 2})
  -- a preset by name, as before
  local pp = in_world_of_two(function() return train.build(cfg("recipe/preset", {"dist=true", "recipe=nvfp4"})) end)
  T.eq(type(pp.recipe.amax_reducer), "function")
  T.eq(pp.recipe.shard, {rank = 0, world = 2})
  -- one process without dist: no hooks; the value trains, and config.json holds its description
  local plain = recipe.custom(function() return "bf16" end)
  local c1 = cfg("recipe/plain", {"steps=2", "eval_every=0", "save=false"})
  c1.recipe = plain
  local s = run(c1)
  T.eq(s.steps, 2)
  T.eq(plain.amax_reducer, nil)
  T.eq(plain.shard, nil)
  T.eq(cjson.decode(assert(T.read_file(c1.out .. "/config.json"))).recipe.text, tostring(plain))
  T.raises(function() train.build(cfg("recipe/bad", {"recipe=nvfp5"})) end,
    "config: recipe must be a recipe value or one of f32, bf16, fp8_cs, fp8_delayed, mxfp8, nvfp4")
  T.raises(function() recipe.make("nvfp5") end, "recipe.make: unknown recipe 'nvfp5' (valid: f32, bf16,")
end)

-- ---- Ctrl-C ------------------------------------------------------------------------------------

T.case("Ctrl-C finishes the step, checkpoints, returns interrupted; resume=auto ends bit-exact", function()
  local signal = require "nvlua.signal"
  local extra = {"recipe=nvfp4", "eval_every=2"}
  local s0, p0 = run(cfg("sigint/straight", extra))
  local c = cfg("sigint/run", extra)
  c.save = false -- an interrupt checkpoints regardless
  local raised = 0
  local s = run(c, function(p)
    local base = p.schedule
    p.schedule = function(step)
      if step == 3 then raised = raised + 1; signal.raise() end
      return base(step)
    end
  end)
  T.eq(raised, 1)
  T.eq(s.interrupted, true)
  T.eq(s.steps, 3, "step 3 finished")
  T.eq(#s.losses, 3)
  T.eq(s.checkpoint, c.out .. "/checkpoints/step-000003")
  T.eq(ckpt.latest(c.out), s.checkpoint)
  T.eq(s.sample, nil, "no sample after an interrupt")
  T.eq(signal.pending(), false, "the run cleared the deferred interrupt")
  local c2 = cfg("sigint/run", extra)
  c2.resume = "auto"
  local s2, p2 = run(c2)
  T.eq(s2.interrupted, false)
  T.eq(s2.steps, 6)
  T.eq(s2.losses[1][1], 4)
  same_records(numerics(read_metrics(c2.out)), numerics(read_metrics(s0.run_dir)), "metrics")
  same_params(p2.model, p0.model, "after the interrupted + resumed run")
end)

-- ---- eval, sample, plot ------------------------------------------------------------------------

T.case("eval: val loss and perplexity at eval_every; the sample; loss.png", function()
  local extra = {"recipe=bf16", "steps=4", "eval_every=2", "sample_tokens=24", "temperature=0.8", "top_k=10",
    "plot=true"}
  local c = cfg("eval", extra)
  local s, p = run(c)
  local vals = {}
  for _, r in ipairs(read_metrics(c.out)) do
    if r.val_loss then
      vals[#vals + 1] = r
      T.eq(r.val_ppl, math.exp(r.val_loss), "perplexity = exp(val loss)")
      T.ok(r.val_loss > 0 and r.val_loss < 2 * math.log(256), "a plausible loss: " .. r.val_loss)
    end
  end
  T.eq(#vals, 2)
  T.eq({vals[1].step, vals[2].step}, {2, 4})
  T.ok(vals[2].val_loss < vals[1].val_loss, "it learns")
  T.eq(s.val, {{2, vals[1].val_loss}, {4, vals[2].val_loss}})
  T.eq(s.final_val_loss, vals[2].val_loss)
  T.eq(s.val_ppl, math.exp(s.final_val_loss))
  T.eq(train.evaluate(p.model, p.dataset, c), s.final_val_loss, "evaluate is deterministic")
  -- the sample, from the seed: 24 tokens asked; the context (seq=16) holds the 4 prompt bytes and 12 more,
  -- so 13 bytes come (the last needs no position) and the sample stops there
  T.eq(type(s.sample), "string")
  T.eq(#s.sample, 13)
  local again, stop = train.sample(p.model, p.dataset.tokenizer, "And ", 24, {temperature = 0.8, top_k = 10,
    seed = c.seed})
  T.eq(again, s.sample)
  T.eq(stop, "context")
  local other = train.sample(p.model, p.dataset.tokenizer, "And ", 24, {temperature = 0.8, top_k = 10, seed = c.seed + 1})
  T.ok(other ~= s.sample, "another seed, another sample")
  local s2 = run(cfg("eval2", extra))
  T.eq(s2.sample, s.sample, "a second identical run samples the same text")
  -- sample_prompt: the text the sample continues
  local c3 = cfg("eval3", {"steps=2", "sample_tokens=5", "sample_prompt=In the"})
  local s3, p3 = run(c3)
  T.eq(s3.sample_prompt, "In the")
  T.eq(s3.sample, (train.sample(p3.model, p3.dataset.tokenizer, "In the", 5, {temperature = c3.temperature,
    top_k = c3.top_k, seed = c3.seed})))
  if os.execute("command -v gnuplot >/dev/null 2>&1") then
    T.eq(s.plot, c.out .. "/loss.png")
    local f = assert(io.open(s.plot, "rb"))
    T.eq(f:read(8), "\137PNG\r\n\26\n", "a PNG file")
    f:close()
  else
    T.eq(s.plot, nil, "no gnuplot, no plot")
  end
end)

T.case("evaluation does not change training (fp8_delayed: eval forwards would push amaxes)", function()
  local with = run(cfg("evalfree/with", {"recipe=fp8_delayed", "eval_every=1", "steps=4"}))
  local without = run(cfg("evalfree/without", {"recipe=fp8_delayed", "eval_every=0", "steps=4"}))
  T.eq(#with.val, 4)
  for i = 1, 4 do T.eq(bits(with.losses[i][2]), bits(without.losses[i][2]), "loss of step " .. i) end
end)

-- ---- throughput --------------------------------------------------------------------------------

T.case("throughput: ms, tokens/s and MFU per step, consistent with the FLOP count", function()
  local mcfg = train.model_config(cfg("x"), 256)
  -- 6 · (L·(C·hd·(2Hq + 2Hkv) + 3·C·F) + C·V) + 12·L·T·hd·Hq, C 32, hd 8, F 64, L 2, V 256, T 16
  T.eq(train.flops_per_token(mcfg, 16), 6 * (2 * (32 * 8 * 12 + 3 * 32 * 64) + 32 * 256) + 12 * 2 * 16 * 8 * 4)
  T.eq(train.flops_per_token(mcfg, 16), 172032)
  local peak = require("nvlua.peak").sgemm_rate(3)
  T.ok(is_finite(peak) and peak > 1e8, "a measured sgemm rate: " .. peak)
  local c = cfg("speed", {"recipe=bf16", "steps=3", "grad_accum=2", "eval_every=0"})
  local s = run(c)
  local tok = 2 * 16 * 2
  local n = 0
  for _, r in ipairs(read_metrics(c.out)) do
    n = n + 1
    T.ok(r.ms > 0 and r.tokens_per_s > 0 and r.mfu > 0, "positive throughput fields at step " .. r.step)
    T.near(r.tokens_per_s * r.ms / 1000, tok, 1e-9 * tok, "tokens/s · s = tokens per step")
    T.near(r.mfu * PEAK, 172032 * r.tokens_per_s, 1e-9 * 172032 * r.tokens_per_s, "MFU = FLOP/s / peak")
  end
  T.eq(n, 3)
  T.ok(s.tokens_per_s > 0)
end)

T.case("knowledge distillation: teacher= (a Hugging Face directory) logs kl and ce; a vocabulary mismatch is named", function()
  local llama = require "nvlua.llama"
  local hf = require "nvlua.hf"
  local function teacher_dir(name, vocab)
    local dir = ROOT .. "/" .. name
    lfs.mkdir(dir)
    hf.save_pretrained(llama.Llama({vocab_size = vocab, hidden_size = 48, intermediate_size = 96, num_hidden_layers = 1,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16}, {seed = 1}), dir)
    return dir
  end
  local c = cfg("distill", {"teacher=" .. teacher_dir("teacher", 256), "distill_alpha=0.7", "distill_temperature=2",
    "steps=3", "eval_every=0"})
  local s = run(c)
  T.eq(s.steps, 3)
  local n = 0
  for _, r in ipairs(read_metrics(c.out)) do
    if r.loss then
      n = n + 1
      T.ok(is_finite(r.kl) and r.kl >= 0 and is_finite(r.ce) and r.ce > 0, "kl and ce at step " .. r.step)
      T.near(r.loss, 0.7 * 4 * r.kl + 0.3 * r.ce, 1e-12 * r.loss, "loss = alpha T^2 kl + (1 - alpha) ce")
    end
  end
  T.eq(n, 3)
  local bad = cfg("distill_bad", {"teacher=" .. teacher_dir("teacher100", 100)})
  T.raises(function() train.build(bad) end, "has a vocabulary of 100 tokens, the student 256")
end)

T.case("ckpt_every=auto: the Young/Daly interval, from the measured save cost, step time and mtbf", function()
  -- the rule for injected costs: a 2 s save, 0.5 s steps, one failure per hour: tau = sqrt(2 * 2 * 3600)
  -- = 120 s = 240 steps; saving costs 2 / 120 of the time, failures lose 120 / (2 * 3600) of it
  local n, info = train.auto_interval(2, 0.5, 1)
  T.eq(n, 240)
  T.eq(info.tau_s, 120)
  T.near(info.overhead, 2 / 120, 1e-15)
  T.near(info.lost, 120 / 7200, 1e-15)
  T.eq((train.auto_interval(0, 0.5, 1)), 1, "a free save: every step")
  T.eq((train.auto_interval(8, 0.25, 24)), math.floor(math.sqrt(2 * 8 * 24 * 3600) / 0.25 + 0.5))
  T.raises(function() train.auto_interval(-1, 1, 1) end, "expects finite non-negative numbers")
  -- a run (ckpt_first_s=0: no floor of training time before the first save): the first save at step
  -- 10, then each at the interval its record logged, computed by the rule
  local c = cfg("auto", {"recipe=bf16", "steps=24", "ckpt_every=auto", "ckpt_first_s=0", "mtbf=0.00001", "keep=0",
    "eval_every=0"})
  run(c)
  local saves, expect = {}, 10
  for _, r in ipairs(read_metrics(c.out)) do
    if r.ckpt_every then
      T.eq(r.step, expect, "a save where the previous one said")
      T.eq(r.ckpt_every, (train.auto_interval(r.ckpt_cost_s, r.ckpt_step_s, 0.00001)), "the logged interval is the rule's")
      saves[#saves + 1] = r.step
      expect = r.step + r.ckpt_every
    end
  end
  T.ok(#saves >= 1)
  for _, st in ipairs(saves) do
    T.ok(lfs.attributes(string.format("%s/checkpoints/step-%06d", c.out, st), "mode") == "directory", "checkpoint " .. st)
  end
  T.raises(function() train.check(cfg("bad", {"ckpt_every=often"})) end, "ckpt_every: must be a non-negative integer or auto")
  -- the default is auto with a 300 s floor: a run of seconds writes only its final checkpoint
  local d = cfg("auto_default", {"recipe=bf16", "steps=12", "keep=0", "eval_every=0", "mtbf=0.00001"})
  T.eq({d.ckpt_every, d.ckpt_first_s}, {"auto", 300})
  run(d)
  for _, r in ipairs(read_metrics(d.out)) do T.eq(r.ckpt_every, nil, "no periodic save in a short run") end
  local names = {}
  for n in lfs.dir(d.out .. "/checkpoints") do if n:match("^step") then names[#names + 1] = n end end
  T.eq(names, {"step-000012"}, "the final checkpoint alone")
end)

T.case("the background writer: its operations in order, stopping at the first failure; the error surfaces at the next step", function()
  local core = require "nvlua.core"
  local d = ROOT .. "/bgops"
  lfs.mkdir(d)
  core.bg_submit({{"write", d .. "/a.txt", "hello"}, {"rename", d .. "/a.txt", d .. "/b.txt"}, {"fsync", d .. "/b.txt", false},
    {"fsync", d, true}})
  ckpt.wait()
  T.eq(T.read_file(d .. "/b.txt"), "hello")
  T.eq(lfs.attributes(d .. "/a.txt"), nil)
  core.bg_submit({{"rename", d .. "/nope", d .. "/x"}, {"write", d .. "/never", "x"}})
  T.raises(ckpt.wait, "background checkpoint writer: cannot rename " .. d .. "/nope")
  T.eq(lfs.attributes(d .. "/never"), nil, "nothing after the failure ran")
  T.raises(function() core.bg_submit({{"copy", d}}) end, "invalid option 'copy'")
  -- a write of strings and tensors: their bytes, copied when submitted (the tensor changed at once
  -- after the submit, as the next training step would change a parameter, does not reach the file)
  local t = require("nvlua").tensor({{1.5, -2, 3}, {4, 5, 6}})
  local tt = t:transpose(1, 2) -- a view: written row-major like t:bytes() gives it
  local want = "head" .. t:bytes() .. tt:contiguous():bytes() .. "tail"
  core.bg_submit({{"write", d .. "/t.bin", {"head", t, tt, "tail"}}})
  t:fill_(0)
  ckpt.wait()
  T.eq(T.read_file(d .. "/t.bin"), want, "the staged bytes")
  T.eq(lfs.attributes(d .. "/t.bin.tmp"), nil, "the temp file renamed")
  -- a file of more than a page: written directly (O_DIRECT) in whole pages, the tail through the page
  -- cache; on tmpfs (/dev/shm) too, which may refuse O_DIRECT (then all of it buffered)
  local big = require("nvlua").randn(3001) -- any values: the file is compared with big:bytes()
  local dirs = {d}
  if lfs.attributes("/dev/shm", "mode") == "directory" then dirs[2] = "/dev/shm" end
  for _, dd in ipairs(dirs) do
    local path = dd .. "/nvlua_bg_" .. ROOT:gsub("^.*/", "") .. ".bin" -- ROOT's name is unique
    core.bg_submit({{"write", path, {"hdr", big}}, {"write", d .. "/small.txt", "x"}})
    ckpt.wait()
    T.eq(T.read_file(path), "hdr" .. big:bytes(), "a 12007-byte file in " .. dd)
    os.remove(path)
  end
  core.bg_submit({{"write", d .. "/empty.bin", {}}})
  ckpt.wait()
  T.eq(T.read_file(d .. "/empty.bin"), "", "no pieces: an empty file")
  local dead = require("nvlua").tensor({1, 2})
  dead:free()
  T.raises(function() core.bg_submit({{"write", d .. "/x", {"a", dead}}}) end,
    "op 1 (write): piece 2 is a userdata, not a string or a live tensor")
  T.raises(function() core.bg_submit({{"fsync", d, true}, {"write", d .. "/x", 7}}) end,
    "op 2 (write) needs its contents: a string or an array of strings and tensors")
  T.eq(lfs.attributes(d .. "/x"), nil, "a refused list runs nothing")
  ckpt.release()
  core.bg_submit({{"write", d .. "/again.bin", {t}}}) -- after release: allocated again
  ckpt.wait()
  T.eq(#T.read_file(d .. "/again.bin"), 24)
  -- deferred copies (bg_submit(ops, true), what train.run's background saves use): the writer thread
  -- copies the tensors and strings itself; core.bg_snapshot_wait() returns once it has, and a change
  -- made after it does not reach the file. What the list holds stays readable until then: a tensor
  -- freed and a string no longer referenced (collected) right after the submit are written as they
  -- were (4 MB each, so that the thread is most likely still copying when they are let go; under the
  -- sanitizers a read of freed memory would be reported either way)
  local nvm = require "nvlua"
  local a, b = nvm.randn(1 << 20), nvm.randn(1 << 20)
  local long = string.rep("ab", 1 << 21) .. tostring(a:numel()) -- made at run time: collectable
  local want_d = "head" .. a:bytes() .. long .. b:bytes()
  core.bg_submit({{"write", d .. "/deferred.bin", {"head", a, long, b}}}, true)
  long = nil ---@diagnostic disable-line: cast-local-type
  b:free()
  collectgarbage("collect")
  T.ok(core.bg_snapshot_wait() >= 0, "snapshot_wait returns the seconds waited")
  a:fill_(0)
  ckpt.wait()
  T.eq(T.read_file(d .. "/deferred.bin") == want_d, true, "the deferred copies: the bytes at the submit")
  T.eq(core.bg_snapshot_wait(), 0, "nothing pending: returns at once") -- no clock read when none is pending
  -- a script that ends while a list still runs: the end of the Lua state waits for it (a deferred one
  -- still holds its tensors and strings then), and a failure is printed
  local script = T.write_file(d .. "/ends.lua", string.format([[
local core = require "nvlua.core"
local nv = require "nvlua"
core.bg_submit({{"write", %q, {nv.full({1 << 22}, 2), string.rep("z", 1000)}}}, true)
]], d .. "/at_close.bin"))
  local r1 = T.run_nvlua(T.shq(script))
  T.eq(r1.code, 0, "exit status: " .. r1.err)
  T.eq(T.read_file(d .. "/at_close.bin") == require("nvlua").full({1 << 22}, 2):bytes() .. string.rep("z", 1000), true,
    "the file written in full before the process ended")
  T.write_file(script, string.format("require('nvlua.core').bg_submit({{'rename', %q, %q}})\n", d .. "/absent", d .. "/x"))
  local r2 = T.run_nvlua(T.shq(script))
  T.ok(r2.err:find("nvlua: background checkpoint writer: cannot rename " .. d .. "/absent", 1, true), r2.err)
  -- in a run: a failure of the writer (injected at step 3) stops the run at the start of step 4
  local c = cfg("bgfail", {"recipe=bf16", "ckpt_every=2", "ckpt_background=true", "eval_every=0"})
  local ok, err = pcall(run, c, function(p)
    local base = p.schedule
    p.schedule = function(step)
      if step == 3 then
        ckpt.wait()
        core.bg_submit({{"rename", d .. "/missing", d .. "/y"}})
        -- the failure has happened before step 4 starts (the writer runs at nice +10 beside the
        -- training's threads and could otherwise finish only during step 4): deterministic
        local t0 = require("nvlua").clock()
        while core.bg_busy() do assert(require("nvlua").clock() - t0 < 30, "the writer did not finish") end
      end
      return base(step)
    end
  end)
  T.ok(not ok and tostring(err):find("checkpoint: background checkpoint writer: cannot rename", 1, true),
    "the run stopped with the writer's error: " .. tostring(err))
  local recs = read_metrics(c.out)
  T.eq(recs[#recs].step, 3, "after step 3, before step 4")
end)

T.case("a parameter AdamW makes non-finite after the step read its flags: that step's checkpoint is unhealthy, " ..
  "the next step skipped, the last healthy checkpoint kept", function()
  local c = cfg("adamw_nan", {"recipe=bf16", "steps=8", "max_bad_steps=1", "eval_every=0", "ckpt_every=1", "keep=1"})
  local function hook(p)
    local opt, step = p.optimizer, p.optimizer.step
    opt.step = function(self)
      if p.model.step == 4 then -- AdamW reads a NaN at step 4, after the step's flags were taken
        local w = entry(p.model, "model.layers.1.mlp.down_proj.weight").param
        w:set(1, 1, 0 / 0)
      end
      return step(self)
    end
  end
  T.raises(function() run(c, hook) end, "training stopped at step 6: 2 consecutive steps")
  local recs = read_metrics(c.out)
  T.eq({recs[4].skipped, recs[5].skipped, recs[6].skipped}, {nil, true, true}, "step 4 ran; 5 and 6 were skipped")
  T.ok(tostring(recs[5].nonfinite):find("AdamW met a non-finite parameter", 1, true) ~= nil,
    "step 5 names AdamW's flag: " .. tostring(recs[5].nonfinite))
  T.eq(ckpt.latest_healthy(c.out), c.out .. "/checkpoints/step-000003", "step 3's checkpoint is the healthy one kept")
  T.ok(lfs.attributes(c.out .. "/checkpoints/step-000003") ~= nil, "and it exists")
end)

T.case("cleanup: the scratch directory is removed", function()
  ckpt.rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)

-- ---- NaN and infinity injection, every recipe (tests/nonfinite_cases.lua) ----------------------

local NONFINITE = dofile("tests/nonfinite_cases.lua")
for _, name in ipairs(require("nvlua.recipe").names()) do
  T.case("a NaN weight, activation or loss and an Inf gradient are caught in their step under " .. name ..
    "; a kept NaN weight stops the run and the last healthy checkpoint survives", function()
    NONFINITE.run(name, "cpu")
  end)
end

