-- tests/test_checkpoint.lua: checkpoints (lua/nvlua/checkpoint.lua).
--   * save/load round trip of everything training needs: parameters, AdamW moments and step,
--     recipe state (a 64-bit seed > 2^53 and the SR offset under nvfp4; amax histories, including
--     non-finite entries, under fp8_delayed), the loader cursor and the default generator; the
--     restored run's next step equals the original's bit for bit. The model (config.json,
--     model.safetensors) is in model/, the training state beside it, never inside.
--   * keep=K prunes the oldest; latest() ignores "step-N.partial", directories without
--     trainer.json and other names, and orders by step number; a leftover .partial is replaced.
--   * the order of writing: latest() and pruning go by it; pruning keeps the newest checkpoint
--     written outside a streak of skipped steps and the protected one; saving a step again replaces
--     it. The leftovers a crash can leave (a half-removed directory, step-N.old with or without
--     step-N, a .partial): list() sees the effective checkpoints, recover() settles them.
--   * a checkpoint of the layout before model/ (model files beside trainer.json, built here from a
--     current one) resumes bit for bit; from_pretrained (checkpoint's and nvlua.hf's) takes it, a
--     current step directory and its model/.
--   * a trainer.json that cannot be its directory's (no seq, {}, [], another step, garbage) sorts as
--     the newest, so latest() does not pass over it; ckpt.verify names it; set_aside renames it to
--     step-N.corrupt, which listing, pruning, saving step N again and recover() leave alone.
--   * a corrupt checkpoint (every file missing, empty, truncated or garbage; every trainer.json
--     field of a wrong type; a step against the directory's name; a data cursor outside
--     [step, step x max_batches_per_step]; another model shape or recipe; a diverged run) fails to
--     load with "checkpoint <dir>/<file>: <what>", changing nothing; ckpt.verify reports the same
--     damage (not the mismatches); a checkpoint without the bookkeeping fields (written before they
--     existed) loads.
--   * the Hugging Face layout: config.json has every LlamaConfig key, model.safetensors has
--     __metadata__ {"format": "pt"} and HF names/shapes (tied and untied, rope_scaling kept);
--     from_pretrained gives the same logits bit for bit.
--   * a Hugging Face directory made from the PyTorch golden model (tests/data/
--     tiny_llama_ref.safetensors): from_pretrained gives transformers' logits within the tolerance
--     of tests/test_llama_golden.lua; a config nvlua does not compute is refused.
-- (scripts/check_hf_export.py checks the other direction with transformers itself.)
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local recipe = require "nvlua.recipe"
local data = require "nvlua.data"
local ckpt = require "nvlua.checkpoint"
local st = require "nvlua.safetensors"
local cjson = require "cjson"
local lfs = require "lfs"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"

local ROOT = T.tmpdir()
local fresh = T.dir_maker(ROOT)

local function tiny(extra)
  local c = {vocab_size = 64, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4,
    num_key_value_heads = 2, max_position_embeddings = 32, rms_norm_eps = 1e-5, rope_theta = 10000.0}
  for k, v in pairs(extra or {}) do c[k] = v end
  return c
end

-- 3000 pseudo-random tokens in 0..63 (an LCG), one shard
local SHARD = ROOT .. "/tokens.bin"
do
  local ids, s = {}, 99
  for i = 1, 3000 do
    s = (s * 1103515245 + 12345) % 2147483648
    ids[i] = (s >> 16) % 64
  end
  data.write_shard(SHARD, ids, 2)
end

local function bytes_of(model)
  local out = {}
  for _, p in ipairs(model:named_parameters()) do out[p.name] = p.param:bytes() end
  return out
end

-- everything a run holds, built from a model seed and a recipe
local function setup(model_seed, rec)
  local model = llama.Llama(tiny(), {recipe = rec, seed = model_seed})
  local opt = optim.AdamW(model:named_parameters(), {lr = 1e-2, betas = {0.9, 0.95}, weight_decay = 0.1})
  local loader = data.Loader({data.open_shard(SHARD)}, {batch = 2, seq = 16, seed = 3})
  return {model = model, optimizer = opt, recipe = rec, loader = loader}
end

local function step(p, n)
  p.model.step = n
  p.model:zero_grad()
  local x, y = p.loader:next()
  local loss = p.model:forward_backward(x, y)
  x:free(); y:free()
  optim.clip_grad_norm(p.model:named_parameters(), 1.0)
  p.optimizer:step()
  return loss
end

local function read_json(path)
  local s = assert(T.read_file(path))
  return cjson.decode(s), s
end

local function ls(dir)
  local names = {}
  for n in lfs.dir(dir) do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
  table.sort(names)
  return names
end

local function sh(cmd) assert(os.execute(cmd), cmd) end

local BIG = (1 << 60) + 12345 -- a seed past 2^53: a JSON double would round it

-- ---- round trip --------------------------------------------------------------------------------

local function round_trip(rec_a, rec_b, tweak)
  local a = setup(11, rec_a)
  for i = 1, 3 do step(a, i) end
  if tweak then tweak(a) end
  local g = nv.default_generator()
  g:manual_seed(BIG + 1)
  nv.rand(10):free()
  local g_seed, g_offset = g:seed(), g:offset()
  local run = fresh("rt")
  local dir = ckpt.save(run, {model = a.model, optimizer = a.optimizer, recipe = a.recipe, loader = a.loader, step = 3,
    config = {note = "test"}})
  T.eq(dir, run .. "/checkpoints/step-000003")
  T.eq(ls(dir), {"model", "trainer.json", "trainer.safetensors"}, "the training state beside model/")
  T.eq(ls(dir .. "/model"), {"config.json", "model.safetensors"}, "model/ holds the model alone")

  local b = setup(22, rec_b)
  g:manual_seed(5)
  T.ok(bytes_of(b.model)["lm_head.weight"] ~= bytes_of(a.model)["lm_head.weight"], "b starts elsewhere")
  local tr = ckpt.load(dir, b)
  T.eq(tr.step, 3)
  T.eq(math.type(tr.step), "integer")
  T.eq(tr.config, {note = "test"})
  T.eq(bytes_of(b.model), bytes_of(a.model), "parameters")
  T.eq(b.optimizer.t, 3)
  local sa, sb = a.optimizer:state(), b.optimizer:state()
  for name, m in pairs(sa.m) do
    T.eq(sb.m[name]:bytes(), m:bytes(), "m of " .. name)
    T.eq(sb.v[name]:bytes(), sa.v[name]:bytes(), "v of " .. name)
  end
  T.eq(b.recipe:state(), a.recipe:state(), "recipe state")
  T.eq(b.loader.cursor, 3)
  T.eq({g:seed(), g:offset()}, {g_seed, g_offset}, "default generator")
  -- training goes on identically
  local la, lb = step(a, 4), step(b, 4)
  T.eq(string.pack("<d", lb), string.pack("<d", la), "the next loss, bit for bit")
  T.eq(bytes_of(b.model), bytes_of(a.model), "parameters after one more step")
  T.eq(b.recipe:state(), a.recipe:state())
  return dir, a
end

T.case("round trip under nvfp4: 64-bit seed and SR offset, AdamW, cursor, default generator", function()
  local dir, a = round_trip(recipe.nvfp4({seed = BIG}), recipe.nvfp4({seed = 5}))
  local s = a.recipe:state()
  T.eq(s.seed, BIG)
  T.ok(s.offset > 0, "SR drew from the generator")
  local tr, text = read_json(dir .. "/trainer.json")
  T.ok(text:find('"seed":"' .. string.format("%d", BIG) .. '"', 1, true), "the 64-bit seed is stored as exact text")
  T.eq(tr.recipe.recipe, "nvfp4")
  T.eq(tr.loader.cursor, "3")
end)

T.case("round trip under fp8_delayed: amax histories (non-finite entries too)", function()
  local _, a = round_trip(recipe.fp8_delayed({history = 4}), recipe.fp8_delayed({history = 4}), function(p)
    -- a step that went NaN would have pushed these; they must survive the JSON
    local key = next(p.recipe.histories)
    p.recipe.histories[key].h:push(math.huge)
    p.recipe.histories[key].h:push(0 / 0)
  end)
  local n = 0
  for _, h in pairs(a.recipe:state().histories) do
    n = n + 1
    T.ok(h.count >= 1 and h.len == 4)
  end
  T.ok(n >= 12, "a history per (layer, operand, role): " .. n)
end)

T.case("load errors: a checkpoint from another model, a missing trainer.json", function()
  local a = setup(1, recipe.f32())
  local run = fresh("err")
  local dir = ckpt.save(run, {model = a.model, optimizer = a.optimizer, step = 1})
  local other = llama.Llama(tiny({hidden_size = 48}), {seed = 1})
  T.raises(function() ckpt.load(dir, {model = other}) end, "shape mismatch")
  T.raises(function() ckpt.load(run .. "/nowhere", {model = a.model}) end, "trainer.json")
  local l = data.Loader({data.open_shard(SHARD)}, {batch = 2, seq = 16, seed = 4})
  local d2 = ckpt.save(run, {model = a.model, loader = setup(1, recipe.f32()).loader, step = 2})
  T.raises(function() ckpt.load(d2, {model = a.model, loader = l}) end, "data seed 3 differs from this run's 4")
end)

-- ---- directories -------------------------------------------------------------------------------

T.case("keep=K prunes the oldest; keep=0 keeps all", function()
  local m = llama.Llama(tiny(), {seed = 1})
  local run = fresh("keep")
  for s = 1, 5 do ckpt.save(run, {model = m, step = s, keep = 2}) end
  local names = {}
  for i, d in ipairs(ckpt.list(run)) do names[i] = d:match("[^/]+$") end
  T.eq(names, {"step-000004", "step-000005"})
  T.eq(lfs.attributes(run .. "/checkpoints/step-000003"), nil)
  local all = fresh("keepall")
  for s = 1, 4 do ckpt.save(all, {model = m, step = s, keep = 0}) end
  T.eq(#ckpt.list(all), 4)
  ckpt.save(all, {model = m, step = 5, keep = 1})
  T.eq(ckpt.list(all), {all .. "/checkpoints/step-000005"})
end)

T.case("latest() ignores .partial, directories without trainer.json, other names; orders by step", function()
  local m = llama.Llama(tiny(), {seed = 1})
  local run = fresh("latest")
  T.eq(ckpt.latest(run), nil, "no checkpoints yet")
  ckpt.save(run, {model = m, step = 5, keep = 0})
  local root = run .. "/checkpoints"
  -- a crash mid-save leaves step-N.partial (complete-looking inside); a half-copied directory
  -- has no trainer.json; other names are not checkpoints
  assert(lfs.mkdir(root .. "/step-000009.partial"))
  for _, f in ipairs({"trainer.json", "config.json", "model.safetensors"}) do
    T.write_file(root .. "/step-000009.partial/" .. f, "{}")
  end
  assert(lfs.mkdir(root .. "/step-000010"))
  T.write_file(root .. "/step-000010/model.safetensors", "x")
  assert(lfs.mkdir(root .. "/step-abc"))
  T.write_file(root .. "/notes.txt", "x")
  T.eq(ckpt.latest(run), root .. "/step-000005")
  T.eq(ckpt.list(run), {root .. "/step-000005"})
  -- by number, not by name: step-1000000 is newer than step-999999
  ckpt.save(run, {model = m, step = 999999, keep = 0})
  ckpt.save(run, {model = m, step = 1000000, keep = 0})
  T.eq(ckpt.latest(run), root .. "/step-1000000")
  ckpt.save(run, {model = m, step = 1000001, keep = 2})
  T.eq(ckpt.list(run), {root .. "/step-1000000", root .. "/step-1000001"}, "keep prunes by number too")
  -- saving step 9 replaces the leftover .partial and leaves no temp files
  ckpt.save(run, {model = m, step = 9, keep = 0})
  T.eq(lfs.attributes(root .. "/step-000009.partial"), nil)
  T.eq(ls(root .. "/step-000009"), {"model", "trainer.json"})
  T.eq(ls(root .. "/step-000009/model"), {"config.json", "model.safetensors"})
end)

T.case("the order of writing: latest() and pruning go by it; the newest healthy and the protected are kept", function()
  local m = llama.Llama(tiny(), {seed = 1})
  local run = fresh("order")
  local root = run .. "/checkpoints"
  ckpt.save(run, {model = m, step = 6, keep = 0})
  ckpt.save(run, {model = m, step = 4, keep = 0})
  T.eq(ckpt.list(run), {root .. "/step-000006", root .. "/step-000004"})
  T.eq(ckpt.latest(run), root .. "/step-000004", "written last")
  ckpt.save(run, {model = m, step = 2, keep = 2})
  T.eq(ckpt.list(run), {root .. "/step-000004", root .. "/step-000002"}, "keep=2: the 2 written last")
  -- written during a streak of skipped steps: the newest healthy one (step 2) stays
  ckpt.save(run, {model = m, step = 8, keep = 1, bad_in_row = 1, skipped = 1})
  ckpt.save(run, {model = m, step = 10, keep = 1, bad_in_row = 2, skipped = 2})
  T.eq(ckpt.list(run), {root .. "/step-000002", root .. "/step-000010"})
  ckpt.save(run, {model = m, step = 12, keep = 1, skipped = 2})
  T.eq(ckpt.list(run), {root .. "/step-000012"}, "a healthy one written: the streak's are pruned")
  -- the protected one (a run's resume point) stays
  ckpt.save(run, {model = m, step = 14, keep = 1, protect = root .. "/step-000012"})
  ckpt.save(run, {model = m, step = 16, keep = 1, protect = root .. "/step-000012"})
  T.eq(ckpt.list(run), {root .. "/step-000012", root .. "/step-000016"})
  -- saving a step again replaces it: the new content, nothing left beside it
  local m2 = llama.Llama(tiny(), {seed = 2})
  ckpt.save(run, {model = m2, step = 16, keep = 1})
  T.eq(ckpt.list(run), {root .. "/step-000016"})
  T.eq(bytes_of(ckpt.from_pretrained(root .. "/step-000016")), bytes_of(m2))
  T.ok(bytes_of(m2)["lm_head.weight"] ~= bytes_of(m)["lm_head.weight"], "m2 differs from m")
  local names = {}
  for n in lfs.dir(root) do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
  T.eq(names, {"step-000016"})
  T.raises(function() ckpt.save(run, {model = m, step = "7"}) end, "checkpoint.save: step must be an integer >= 0")
  T.raises(function() ckpt.save(run, {model = m, step = 7, keep = 1.5}) end, "checkpoint.save: keep must be an integer")
end)

T.case("a crash's leftovers: list() sees the effective checkpoints, recover() settles them", function()
  local m = llama.Llama(tiny(), {seed = 1})
  local run = fresh("leftovers")
  local root = run .. "/checkpoints"
  for s = 2, 8, 2 do ckpt.save(run, {model = m, step = s, keep = 0}) end
  local full = ls(root .. "/step-000008")
  -- step 2: a removal cut short (trainer.json goes first)
  os.remove(root .. "/step-000002/trainer.json")
  ckpt.rm_rf(root .. "/step-000002/model")
  -- step 4: a replacement cut between its renames: step-4.old and a complete step-4.partial
  sh(string.format("mv %s/step-000004 %s/step-000004.old && cp -r %s/step-000004.old %s/step-000004.partial",
    root, root, root, root))
  -- step 6: replaced, the removal of its .old cut short
  sh(string.format("cp -r %s/step-000006 %s/step-000006.old && rm %s/step-000006.old/trainer.json", root, root, root))
  -- step 8: a complete .old beside it, and step 10: only a complete .partial (never committed)
  sh(string.format("cp -r %s/step-000008 %s/step-000008.old && cp -r %s/step-000008 %s/step-000010.partial",
    root, root, root, root))
  T.eq(ckpt.list(run), {root .. "/step-000004.old", root .. "/step-000006", root .. "/step-000008"})
  T.eq(ckpt.latest(run), root .. "/step-000008")
  T.eq(#ls(root), 8, "list() changed nothing")
  ckpt.recover(run)
  T.eq(ls(root), {"step-000004", "step-000006", "step-000008"})
  T.eq(ckpt.list(run), {root .. "/step-000004", root .. "/step-000006", root .. "/step-000008"})
  for _, s in ipairs({4, 6, 8}) do T.eq(ls(string.format("%s/step-%06d", root, s)), full, "step " .. s) end
  ckpt.recover(run)
  T.eq(ls(root), {"step-000004", "step-000006", "step-000008"}, "recover() again: nothing to do")
end)

-- {name, edit of the newest checkpoint's trainer.json (its text), what ckpt.verify then says after
-- "checkpoint <dir>/trainer.json: "}: each sorted as the oldest before issue 28 (no seq: 0), so
-- latest() and resume=auto passed over it to an older checkpoint without a word
local NOT_ITS_OWN = {
  {"seq removed", function(t) return (t:gsub('"seq":%d+,?', "")) end, "field seq is missing"},
  {"an empty object", function() return "{}" end, "field step is missing"},
  {"an array", function() return "[4, 2]" end, "expected a JSON object, got a JSON array"},
  {"another checkpoint's (step 2)", function(t) return (t:gsub('"step":4', '"step":2')) end,
    "field step is 2, but the directory's name says step 4"},
  {"garbage", function() return "\0garbage" end, "not valid JSON"},
}

T.case("latest() looks first at a trainer.json that cannot be its directory's; verify names it; set_aside", function()
  local m = llama.Llama(tiny(), {seed = 1})
  for i, c in ipairs(NOT_ITS_OWN) do
    local run = fresh("own")
    local root = run .. "/checkpoints"
    ckpt.save(run, {model = m, step = 2, keep = 0})
    ckpt.save(run, {model = m, step = 4, keep = 0})
    local d4 = root .. "/step-000004"
    local text = assert(T.read_file(d4 .. "/trainer.json"))
    T.ok(text:find('"seq":2', 1, true) and text:find('"step":4', 1, true), "the fields edited below")
    T.write_file(d4 .. "/trainer.json", c[2](text))
    T.eq(ckpt.latest(run), d4, c[1] .. ": the newest, not passed over")
    local want = "checkpoint " .. d4 .. "/trainer.json: " .. c[3]
    local problem = ckpt.verify(d4)
    T.ok(problem and problem:sub(1, #want) == want, c[1] .. ":\n  expected " .. want .. "\n  got      " ..
      tostring(problem))
    T.eq(ckpt.verify(root .. "/step-000002"), nil, c[1] .. ": step 2 is intact")
    if i == 1 then -- set aside: no longer listed, kept whole; a second one of the same step gets its own name
      local before = ls(d4)
      T.eq(ckpt.set_aside(d4), d4 .. ".corrupt")
      T.eq(ckpt.list(run), {root .. "/step-000002"})
      T.eq(ls(d4 .. ".corrupt"), before, "kept as it was")
      ckpt.save(run, {model = m, step = 4, keep = 1})
      T.eq(ckpt.list(run), {d4}, "step 4 saved again, step 2 pruned")
      T.eq(ls(d4 .. ".corrupt"), before, "neither pruned nor replaced")
      T.eq(ckpt.set_aside(d4), d4 .. ".corrupt-2")
      T.eq(ls(root), {"step-000004.corrupt", "step-000004.corrupt-2"})
      ckpt.recover(run)
      T.eq(ls(root), {"step-000004.corrupt", "step-000004.corrupt-2"}, "recover() leaves them")
    end
  end
end)

-- ---- corrupt checkpoints -------------------------------------------------------------------------

local function edit_json(path, fn)
  local t = read_json(path)
  fn(t)
  T.write_file(path, require("nvlua.config").encode(t))
end

local function size(path) return lfs.attributes(path, "size") end

-- {name, edit(dir), the expected message after "checkpoint <dir>/" [, the directory's name (default
-- case-NN)]}; edit may return other load options (a model, a recipe, max_bad_steps). The good
-- checkpoint is of step 2, its data cursor 2, written with max_batches_per_step = 1.
local CORRUPT = {
  {"no trainer.json", function(d) os.remove(d .. "/trainer.json") end,
    "trainer.json: missing: not a complete checkpoint"},
  {"empty trainer.json", function(d) T.write_file(d .. "/trainer.json", "") end, "trainer.json: empty (0 bytes)"},
  {"truncated trainer.json", function(d)
    local s = assert(T.read_file(d .. "/trainer.json"))
    T.write_file(d .. "/trainer.json", s:sub(1, #s // 2))
  end, "trainer.json: not valid JSON (truncated or overwritten?)"},
  {"garbage trainer.json", function(d) T.write_file(d .. "/trainer.json", "\0\1\2garbage") end,
    "trainer.json: not valid JSON"},
  {"trainer.json an array", function(d) T.write_file(d .. "/trainer.json", "[1, 2]") end,
    "trainer.json: expected a JSON object, got a JSON array"},
  {"step text", function(d) edit_json(d .. "/trainer.json", function(t) t.step = "abc" end) end,
    'trainer.json: field step must be an integer >= 0, got "abc"'},
  {"step negative", function(d) edit_json(d .. "/trainer.json", function(t) t.step = -1 end) end,
    "trainer.json: field step must be an integer >= 0, got -1"},
  {"step fractional", function(d) edit_json(d .. "/trainer.json", function(t) t.step = 2.5 end) end,
    "trainer.json: field step must be an integer >= 0, got 2.5"},
  {"no optimizer_step", function(d) edit_json(d .. "/trainer.json", function(t) t.optimizer_step = nil end) end,
    "trainer.json: field optimizer_step is missing"},
  {"loader not an object", function(d) edit_json(d .. "/trainer.json", function(t) t.loader = 5 end) end,
    "trainer.json: field loader must be an object {cursor, seed}, got 5"},
  {"loader cursor text", function(d) edit_json(d .. "/trainer.json", function(t) t.loader.cursor = "x" end) end,
    'trainer.json: field loader.cursor must be an integer >= 0, got "x"'},
  {"recipe seed a table", function(d) edit_json(d .. "/trainer.json", function(t) t.recipe.seed = {1} end) end,
    "trainer.json: field recipe.seed must be an integer (JSON number or decimal text), got a JSON array"},
  {"recipe history", function(d)
    edit_json(d .. "/trainer.json", function(t)
      t.recipe.histories = {h = {len = 4, count = 9, pos = 0, values = {1}}}
    end)
  end, "trainer.json: field recipe.histories.h: count 9, len 4 and 1 values do not fit together"},
  {"generator offset", function(d)
    edit_json(d .. "/trainer.json", function(t) t.default_generator.offset = "-3" end)
  end, 'trainer.json: field default_generator.offset must be an integer >= 0, got "-3"'},
  {"counter text", function(d) edit_json(d .. "/trainer.json", function(t) t.bad_steps_in_row = "two" end) end,
    'trainer.json: field bad_steps_in_row must be an integer >= 0, got "two"'},
  {"no model.safetensors", function(d) os.remove(d .. "/model/model.safetensors") end,
    "model/model.safetensors: missing (a checkpoint has model/config.json, model/model.safetensors, " ..
    "trainer.safetensors and trainer.json)"},
  {"empty model.safetensors", function(d) T.write_file(d .. "/model/model.safetensors", "") end,
    "model/model.safetensors: empty (0 bytes)"},
  {"truncated model.safetensors", function(d)
    local s = assert(T.read_file(d .. "/model/model.safetensors"))
    T.write_file(d .. "/model/model.safetensors", s:sub(1, 1000))
  end, "model/model.safetensors: 1000 bytes, but trainer.json recorded"},
  {"garbage model.safetensors", function(d)
    T.write_file(d .. "/model/model.safetensors", string.rep("\255", size(d .. "/model/model.safetensors")))
  end, "model/model.safetensors: unreadable: "},
  {"garbage trainer.safetensors", function(d)
    T.write_file(d .. "/trainer.safetensors", string.rep("x", size(d .. "/trainer.safetensors")))
  end, "trainer.safetensors: unreadable: "},
  {"no trainer.safetensors", function(d) os.remove(d .. "/trainer.safetensors") end, "trainer.safetensors: missing"},
  {"garbage config.json", function(d)
    T.write_file(d .. "/model/config.json", string.rep("{", size(d .. "/model/config.json")))
  end,
    "model/config.json: not valid JSON"},
  {"replaced config.json", function(d) T.write_file(d .. "/model/config.json", "{}") end,
    "model/config.json: 2 bytes, but trainer.json recorded"},
  {"no config.json", function(d) os.remove(d .. "/model/config.json") end, "model/config.json: missing"},
  {"no model/", function(d) ckpt.rm_rf(d .. "/model") end, "model/config.json: missing"},
  {"no tokenizer.json", function(d) os.remove(d .. "/model/tokenizer.json") end,
    "model/tokenizer.json: missing (trainer.json recorded it when the checkpoint was written)"},
  {"replaced tokenizer_config.json", function(d) T.write_file(d .. "/model/tokenizer_config.json", "{}") end,
    "model/tokenizer_config.json: 2 bytes, but trainer.json recorded"},
  {"another model", function() return {model = llama.Llama(tiny({hidden_size = 48}), {seed = 1})} end,
    "model/config.json: model shape mismatch: the checkpoint is of another model: hidden_size = 32 (this model: 48)"},
  {"another recipe", function() return {recipe = recipe.bf16()} end,
    "trainer.json: written under recipe nvfp4, but this run's recipe is bf16 (resume with recipe=nvfp4)"},
  {"non-finite weights", function(d)
    local t = st.load(d .. "/model/model.safetensors")
    t["model.norm.weight"]:set(3, 0 / 0)
    assert(st.save(d .. "/model/model.safetensors", t, {}))
  end, "model/model.safetensors: the run had diverged: tensor model.norm.weight holds non-finite values"},
  {"a diverged streak", function(d)
    edit_json(d .. "/trainer.json", function(t) t.bad_steps_in_row = 6 end)
    return {max_bad_steps = 5}
  end, "trainer.json: the run had diverged: this checkpoint was written after 6 consecutive skipped steps " ..
    "(non-finite loss, gradient, weight or activation), more than max_bad_steps=5"},
  {"step against the directory's name", function() end, "trainer.json: field step is 2, but the directory's name " ..
    "says step 7: trainer.json belongs to another checkpoint or was edited", "step-000007"},
  {"step against a .old name", function() end, "trainer.json: field step is 2, but the directory's name says step 3",
    "step-000003.old"},
  {"seq removed", function(d) edit_json(d .. "/trainer.json", function(t) t.seq = nil end) end,
    "trainer.json: field seq is missing"},
  {"cursor past step x max_batches_per_step", function(d)
    edit_json(d .. "/trainer.json", function(t) t.loader.cursor = "1000000000000000" end)
  end, "trainer.json: field loader.cursor is 1000000000000000, impossible at step 2: every step draws 1 to 1 batches " ..
    "(grad_accum), so the data cursor lies in [2, 2]"},
  {"cursor below the step", function(d) edit_json(d .. "/trainer.json", function(t) t.loader.cursor = "1" end) end,
    "trainer.json: field loader.cursor is 1, impossible at step 2: every step draws 1 to 1 batches (grad_accum)"},
  {"cursor below the step, grad_accum known only from the config", function(d)
    edit_json(d .. "/trainer.json", function(t)
      t.max_batches_per_step, t.config, t.loader.cursor = nil, {grad_accum = 4}, "0"
    end)
  end, "trainer.json: field loader.cursor is 0, impossible at step 2: every step draws at least one batch, so the " ..
    "data cursor lies in [2, ...]"},
  {"max_batches_per_step 0", function(d) edit_json(d .. "/trainer.json", function(t) t.max_batches_per_step = 0 end) end,
    "trainer.json: field max_batches_per_step must be an integer >= 1, got 0"},
  {"an unexpected moment", function(d)
    local t = st.load(d .. "/trainer.safetensors")
    t["w.extra"] = nv.zeros(2)
    assert(st.save(d .. "/trainer.safetensors", t, {}))
    edit_json(d .. "/trainer.json", function(tr)
      tr.files["trainer.safetensors"] = size(d .. "/trainer.safetensors")
    end)
  end, 'trainer.safetensors: unexpected tensor "w.extra" (expected m.<name> and v.<name>)'},
}

T.case("a corrupt checkpoint fails to load naming the file and the problem, and changes nothing", function()
  local a = setup(11, recipe.nvfp4({seed = 3}))
  for i = 1, 2 do step(a, i) end
  local run = fresh("corrupt")
  local good = ckpt.save(run, {model = a.model, optimizer = a.optimizer, recipe = a.recipe, loader = a.loader,
    step = 2, tokenizer = data.ByteTokenizer, max_batches_per_step = 1})
  local b = setup(22, recipe.nvfp4({seed = 5}))
  local before, rs = bytes_of(b.model), b.recipe:state()
  for i, c in ipairs(CORRUPT) do
    local dir = string.format("%s/%s", run, c[4] or string.format("case-%02d", i))
    sh(string.format("cp -r '%s' '%s'", good, dir))
    local o = c[2](dir) or {}
    local ok, err = pcall(ckpt.load, dir, {model = o.model or b.model, optimizer = b.optimizer,
      recipe = o.recipe or b.recipe, loader = b.loader, max_bad_steps = o.max_bad_steps})
    T.eq(ok, false, c[1] .. ": loads")
    local want = "checkpoint " .. dir .. "/" .. c[3]
    T.ok(tostring(err):sub(1, #want) == want, c[1] .. ":\n  expected " .. want .. "\n  got      " .. tostring(err))
    T.ok(not tostring(err):find("attempt to", 1, true) and not tostring(err):find("bad argument", 1, true), c[1])
    -- ckpt.verify finds the same damage, without a model; what is not damage it leaves to load
    local mismatch = c[1] == "another model" or c[1] == "another recipe" or c[1]:find("diverged", 1, true) or
      c[1] == "an unexpected moment" or c[1] == "non-finite weights"
    local problem = ckpt.verify(dir, {optimizer = true})
    if mismatch then
      T.eq(problem, nil, c[1] .. ": verify")
    else
      T.ok(problem and problem:sub(1, #want) == want, c[1] .. ": verify says\n  " .. tostring(problem))
    end
  end
  T.eq(ckpt.verify(good, {optimizer = true}), nil, "the good one is intact")
  T.eq(bytes_of(b.model), before, "the model is as it was")
  T.eq(b.optimizer.t, 0, "the optimizer too")
  T.eq(b.recipe:state(), rs, "and the recipe")
  T.eq(b.loader.cursor, 0, "and the loader")
  -- the checkpoint itself loads; so does one without the bookkeeping fields (seq, files, counters)
  local tr = ckpt.load(good, b)
  T.eq({tr.step, tr.seq, tr.bad_steps_in_row, tr.skipped_steps}, {2, 1, 0, 0})
  T.eq(bytes_of(b.model), bytes_of(a.model))
  local legacy = run .. "/legacy"
  sh(string.format("cp -r '%s' '%s'", good, legacy))
  edit_json(legacy .. "/trainer.json", function(t)
    t.seq, t.files, t.bad_steps_in_row, t.skipped_steps = nil, nil, nil, nil
  end)
  local c = setup(33, recipe.nvfp4({seed = 5}))
  tr = ckpt.load(legacy, c)
  T.eq({tr.step, tr.bad_steps_in_row, tr.skipped_steps}, {2, 0, 0})
  T.eq(bytes_of(c.model), bytes_of(a.model))
  local la, lc = step(a, 3), step(c, 3)
  T.eq(string.pack("<d", lc), string.pack("<d", la), "and training goes on identically")
end)

-- ---- the layout before model/ ------------------------------------------------------------------

-- a checkpoint of the earlier layout, made from one of the current: model/'s files moved up beside
-- trainer.json, whose files lose the "model/" prefix (what save wrote before model/ existed)
local function old_layout(dir, into)
  sh(string.format("cp -r '%s' '%s'", dir, into))
  for _, n in ipairs(ls(into .. "/model")) do assert(os.rename(into .. "/model/" .. n, into .. "/" .. n)) end
  assert(lfs.rmdir(into .. "/model"))
  edit_json(into .. "/trainer.json", function(t)
    local files = {}
    for k, v in pairs(t.files) do files[(k:gsub("^model/", ""))] = v end
    t.files = files
  end)
end

T.case("a checkpoint of the layout before model/ (model files beside trainer.json) resumes and loads", function()
  local a = setup(11, recipe.nvfp4({seed = 3}))
  for i = 1, 2 do step(a, i) end
  local run = fresh("old")
  local dir = ckpt.save(run, {model = a.model, optimizer = a.optimizer, recipe = a.recipe, loader = a.loader,
    step = 2, tokenizer = data.ByteTokenizer})
  T.eq(ls(dir .. "/model"), {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
  local old = run .. "/checkpoints/step-000004"
  old_layout(dir, old)
  edit_json(old .. "/trainer.json", function(t) t.step = 4 end) -- the step its directory's name says
  T.eq(ls(old), {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "trainer.json",
    "trainer.safetensors"})
  T.eq(ckpt.model_dir(old), old)
  T.eq(ckpt.model_dir(dir), dir .. "/model")
  T.eq(ckpt.list(run), {dir, old}, "listed like any checkpoint")
  local saved = bytes_of(a.model)
  local b = setup(22, recipe.nvfp4({seed = 5}))
  local tr = ckpt.load(old, b)
  T.eq(tr.step, 4)
  T.eq(bytes_of(b.model), saved)
  local la, lb = step(a, 3), step(b, 3)
  T.eq(string.pack("<d", lb), string.pack("<d", la), "training goes on identically")
  -- from_pretrained: the old step directory, the new one, and the new one's model/, through
  -- checkpoint and through nvlua.hf
  local hf = require "nvlua.hf"
  for _, d in ipairs({old, dir, dir .. "/model"}) do
    T.eq(bytes_of(ckpt.from_pretrained(d)), saved, d)
    T.eq(bytes_of(hf.from_pretrained(d)), saved, "hf: " .. d)
    T.eq(ckpt.read_config(d).hidden_size, 32, d)
  end
  -- its files are checked as before, under their old names
  os.remove(old .. "/model.safetensors")
  T.raises(function() ckpt.load(old, b) end, "checkpoint " .. old .. "/model.safetensors: missing (a checkpoint " ..
    "has config.json, model.safetensors, trainer.safetensors and trainer.json)")
  -- a new-layout checkpoint whose model/ is gone says so (trainer.json's files tell the layout)
  ckpt.rm_rf(dir .. "/model")
  T.raises(function() ckpt.load(dir, b) end, "checkpoint " .. dir .. "/model/config.json: missing (a checkpoint " ..
    "has model/config.json, model/model.safetensors, trainer.safetensors and trainer.json)")
end)

-- ---- the Hugging Face layout -------------------------------------------------------------------

local HF_KEYS = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
  "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "hidden_act", "initializer_range",
  "attention_bias", "attention_dropout", "mlp_bias", "pretraining_tp", "use_cache", "torch_dtype", "bos_token_id",
  "eos_token_id"}

local function hf_names(L, tied)
  local out = {["model.embed_tokens.weight"] = {64, 32}, ["model.norm.weight"] = {32}}
  if not tied then out["lm_head.weight"] = {64, 32} end
  for i = 0, L - 1 do
    local p = "model.layers." .. i .. "."
    out[p .. "input_layernorm.weight"] = {32}
    out[p .. "post_attention_layernorm.weight"] = {32}
    out[p .. "self_attn.q_proj.weight"] = {32, 32}
    out[p .. "self_attn.k_proj.weight"] = {16, 32}
    out[p .. "self_attn.v_proj.weight"] = {16, 32}
    out[p .. "self_attn.o_proj.weight"] = {32, 32}
    out[p .. "mlp.gate_proj.weight"] = {64, 32}
    out[p .. "mlp.up_proj.weight"] = {64, 32}
    out[p .. "mlp.down_proj.weight"] = {32, 64}
  end
  return out
end

local IDS = nv.tensor({{1, 7, 3, 63, 0, 12, 5, 30, 9, 9, 2, 44}, {9, 10, 11, 2, 13, 44, 15, 16, 1, 0, 62, 8}}, "i64")

local function logits_of(model) return T.logit_bytes(model, IDS) end

T.case("config.json has every HF LlamaConfig key; model.safetensors has format pt, HF names and shapes", function()
  for _, tied in ipairs({false, true}) do
    local m = llama.Llama(tiny({tie_word_embeddings = tied}), {seed = 2})
    local dir = ckpt.save(fresh("hf"), {model = m, step = 1})
    local c, text = read_json(dir .. "/model/config.json")
    for _, k in ipairs(HF_KEYS) do T.ok(c[k] ~= nil, "config.json has " .. k) end
    T.eq(c.architectures, {"LlamaForCausalLM"}); T.eq(c.model_type, "llama"); T.eq(c.hidden_act, "silu")
    T.eq({c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
      c.num_key_value_heads, c.head_dim, c.max_position_embeddings}, {64, 32, 64, 2, 4, 2, 8, 32})
    T.eq(c.rms_norm_eps, 1e-5); T.eq(c.rope_theta, 10000); T.eq(c.tie_word_embeddings, tied)
    T.eq(c.rope_scaling, cjson.null); T.eq(c.attention_bias, false); T.eq(c.mlp_bias, false)
    T.eq(c.torch_dtype, "float32")
    T.ok(text:find('"rms_norm_eps":1e-05', 1, true), "numbers exact: " .. text)
    local header, meta = st.read_header(dir .. "/model/model.safetensors")
    T.eq(meta, {format = "pt"})
    local want = hf_names(2, tied)
    local n = 0
    for name, shape in pairs(want) do
      n = n + 1
      T.ok(header[name], "model.safetensors has " .. name)
      T.eq(header[name].shape, shape, name)
      T.eq(header[name].dtype, "F32", name)
    end
    for name in pairs(header) do T.ok(want[name], "no extra tensor " .. name) end
    T.eq(n, tied and 20 or 21)
    -- nvlua reads its own export back: the same logits bit for bit
    local back = ckpt.from_pretrained(dir)
    T.eq(back.config.tie_word_embeddings, tied)
    T.eq(logits_of(back), logits_of(m), "from_pretrained logits")
  end
end)

T.case("rope_scaling (llama3) survives the export with its rope_type", function()
  local rs = {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0,
    original_max_position_embeddings = 16}
  local m = llama.Llama(tiny({rope_scaling = rs}), {seed = 3})
  local dir = ckpt.save(fresh("rope"), {model = m, step = 1})
  local c = read_json(dir .. "/model/config.json")
  T.eq(c.rope_scaling, rs)
  local back = ckpt.from_pretrained(dir)
  T.eq(logits_of(back), logits_of(m))
  local plain = llama.Llama(tiny(), {seed = 3})
  T.ok(logits_of(plain) ~= logits_of(m), "the scaling changes the logits (so the comparison sees it)")
end)

T.case("a Hugging Face directory (the PyTorch golden model): from_pretrained gives its logits", function()
  local ref, meta = st.load(here .. "/data/tiny_llama_ref.safetensors")
  assert(ref, meta)
  local dir = fresh("golden_hf")
  -- config.json as transformers writes it: the model's keys plus ones that carry no arithmetic
  local c = cjson.decode(meta.config)
  c.architectures = {"LlamaForCausalLM"}; c.model_type = "llama"; c.hidden_act = "silu"
  c.torch_dtype = "float32"; c.transformers_version = meta.transformers_version; c.use_cache = true
  c.bos_token_id = 1; c.eos_token_id = 2; c.attention_bias = false; c.attention_dropout = 0.0; c.mlp_bias = false
  c.pretraining_tp = 1; c.rope_scaling = cjson.null; c.initializer_range = 0.02
  T.write_file(dir .. "/config.json", cjson.encode(c))
  local params = {}
  for name, t in pairs(ref) do
    if name:match("^model%.") or name == "lm_head.weight" then params[name] = t end
  end
  assert(st.save(dir .. "/model.safetensors", params, {format = "pt"}))
  local model = ckpt.from_pretrained(dir)
  T.eq(model.config.vocab_size, 64)
  model:eval()
  local logits = model:forward(ref.input_ids)
  local d = (logits - ref.logits):abs():max()
  local scale = ref.logits:abs():max()
  local tol = 1e-5 * scale + 1e-6 -- tests/test_llama_golden.lua's logits tolerance
  T.ok(d <= tol, string.format("logits: max |Δ| = %.3g > %.3g", d, tol))
  logits:free()
  -- a config nvlua does not compute is refused, not loaded wrong
  c.hidden_act = "gelu"
  T.write_file(dir .. "/config.json", cjson.encode(c))
  T.raises(function() ckpt.from_pretrained(dir) end, "hidden_act = gelu is not supported")
  T.raises(function() ckpt.from_pretrained(ROOT .. "/nowhere") end, "from_pretrained")
  os.remove(dir .. "/model.safetensors")
  c.hidden_act = "silu"
  T.write_file(dir .. "/config.json", cjson.encode(c))
  T.raises(function() ckpt.from_pretrained(dir) end, "no model.safetensors in " .. dir)
end)

T.case("cleanup: the scratch directory is removed", function()
  ckpt.rm_rf(ROOT)
  T.eq(lfs.attributes(ROOT), nil)
end)
