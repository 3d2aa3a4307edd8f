-- tests/nonfinite_cases.lua: NaN / infinity injection into a training run, shared by test_train.lua
-- (the CPU) and test_cuda_train.lua (device=cuda). Not a test file: loaded with dofile.
--
-- M.run(recipe, device) trains the tiny model of test_train.lua for up to 10 steps under that
-- recipe with a checkpoint after every step (keep=1, max_bad_steps=1) and injects, each at the start
-- of its step:
--   step 2  a NaN in a block's weight (model.layers.0.mlp.up_proj: quantized under every low-precision
--           recipe, where nvfp4's e2m1 codes cannot carry it), put back after the step;
--   step 4  a NaN in an activation (the input of layers[1]'s down_proj, quantized as its fprop x);
--   step 6  an infinity in a gradient (set after the backward);
--   step 8  a NaN loss (the forward_backward's loss itself);
--   step 10 the NaN weight again, now kept: steps 10 and 11 fail, and the run stops at step 11.
-- and checks: exactly steps 2, 4, 6, 8, 10, 11 are skipped (recorded), AdamW stepped on the five
-- good ones only, a quantized recipe names the flag on the weight and activation steps, the stop
-- message, and that the last healthy checkpoint (step 9's, before the kept NaN) stayed through the
-- streak's saves and pruning (keep=1) and loads without a NaN.
local T = require "nvlua.test"
local nv = require "nvlua"
local train = require "nvlua.train"
local config = require "nvlua.config"
local ckpt = require "nvlua.checkpoint"
local cjson = require "cjson"
local lfs = require "lfs"

local M = {}

local ROOT = T.tmpdir()
local CORPUS = T.write_corpus(ROOT .. "/corpus.txt", {seed = 4242, lines = 300,
  words = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "light", "in", "water"}})

-- MX blocks of 32 and mor_block's blocks of 128 along every GEMM's reduction dim (hidden, ffn,
-- tokens) need a wider model than the others' tiny one
local WIDE = {mxfp8 = 32, mxfp4 = 32, mor_block = 128, mor_paper = 128}

local function cfg(name, recipe, device)
  local w = WIDE[recipe]
  local shape = w and {"hidden=" .. w, "heads=4", "kv_heads=4", "ffn=" .. 2 * w, "seq=" .. w // 2}
    or {"hidden=32", "heads=4", "kv_heads=2", "ffn=64", "seq=16"}
  local args = {"data=" .. CORPUS, "cache=" .. ROOT .. "/cache", "out=" .. ROOT .. "/" .. name, "layers=2", "batch=2",
    "steps=12", "warmup=2", "lr=3e-3", "eval_every=0", "log_every=1", "sample_tokens=0", "plot=false", "quiet=true",
    "seed=7", "ckpt_every=1", "keep=1", "max_bad_steps=1", "recipe=" .. recipe, "device=" .. device}
  for _, a in ipairs(shape) do args[#args + 1] = a end
  return config.parse(train.defaults, args)
end

local function entry(model, name)
  for _, e in ipairs(model:named_parameters()) do if e.name == name then return e end end
  error("no parameter " .. name)
end

-- x with one element NaN, on x's device and dtype (built on the host: small tensors)
local function with_nan(x)
  local h = x:cpu():to("f32"):contiguous()
  h:reshape(-1):set(1, 0 / 0)
  return h:to(x:dtype()):to(x:device())
end

local function inject(p)
  local m = p.model
  local w = entry(m, "model.layers.0.mlp.up_proj.weight")
  local down = m.layers[2].mlp.down_proj
  local down_forward = down.forward
  local orig = m.forward_backward
  local saved
  local function nan_weight()
    local h = w.param:cpu()
    saved = saved or h:reshape(-1):get(1)
    h:reshape(-1):set(1, 0 / 0)
    w.param:copy_(h)
  end
  local function restore_weight()
    local h = w.param:cpu()
    h:reshape(-1):set(1, saved)
    w.param:copy_(h)
  end
  m.forward_backward = function(self, x, y, o)
    local step = self.step
    if step == 2 or step == 10 then nan_weight() end
    if step == 4 then down.forward = function(s, h) return down_forward(s, with_nan(h)) end end
    local loss, n = orig(self, x, y, o)
    down.forward = down_forward
    if step == 2 then restore_weight() end
    if step == 6 then
      local g = entry(self, "model.layers.1.self_attn.q_proj.weight").grad
      local h = g:cpu()
      h:reshape(-1):set(3, math.huge)
      g:copy_(h)
    end
    if step == 8 then return 0 / 0, n end
    return loss, n
  end
end

local function read_metrics(dir)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.step and not r.val_loss then out[#out + 1] = r end
  end
  return out
end

function M.run(recipe, device)
  local c = cfg("nonfinite_" .. recipe .. "_" .. device, recipe, device)
  local p = train.build(c)
  p.peak = 1e9
  inject(p)
  T.raises(function() train.run(c, p) end,
    "training stopped at step 11: 2 consecutive steps with a non-finite loss, gradient, weight or activation " ..
    "(max_bad_steps=1)")
  local recs = read_metrics(c.out)
  T.eq(#recs, 11, recipe .. ": a record for each step up to the stop")
  local bad = {[2] = true, [4] = true, [6] = true, [8] = true, [10] = true, [11] = true}
  local quantized = recipe ~= "f32" and recipe ~= "bf16"
  for i, r in ipairs(recs) do
    T.eq(r.step, i)
    T.eq(r.skipped, bad[i] or nil, string.format("%s: step %d skipped", recipe, i))
    if quantized and (i == 2 or i == 4 or i == 10) then
      T.ok(type(r.nonfinite) == "string" and r.nonfinite:find("entered a quantizer", 1, true) ~= nil,
        string.format("%s: step %d names the quantizer's flag, got %s", recipe, i, tostring(r.nonfinite)))
    end
  end
  T.eq(p.optimizer.t, 5, recipe .. ": AdamW stepped on steps 1, 3, 5, 7, 9 only")
  -- the checkpoints: step 9's (the last healthy one) stays through the streak's saves
  local names = ckpt.list(c.out)
  local last = names[#names]
  T.ok(last ~= nil, recipe .. ": a checkpoint survives")
  local healthy = c.out .. "/checkpoints/step-000009"
  T.ok(lfs.attributes(healthy) ~= nil, recipe .. ": step 9's checkpoint (the last healthy one) is kept; " ..
    "have " .. table.concat(names, ", "))
  T.eq(ckpt.latest_healthy(c.out), healthy, recipe .. ": resume's newest healthy checkpoint is step 9's")
  local model = train.build(cfg("nonfinite_load_" .. recipe .. "_" .. device, recipe, device)).model
  local tr = ckpt.load(healthy, {model = model, max_bad_steps = 1})
  T.eq(tr.step, 9, recipe .. ": the kept checkpoint loads")
  for _, e in ipairs(model:named_parameters()) do
    local h = e.param:cpu()
    T.ok(h:ne(h):sum() == 0, recipe .. ": no NaN in " .. e.name .. " of the kept checkpoint")
  end
  return recs
end

return M
