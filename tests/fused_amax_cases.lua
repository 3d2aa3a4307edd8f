-- tests/fused_amax_cases.lua: the checks tests/test_fused_amax.lua (the CPU) and
-- tests/test_cuda_fused_amax.lua (the CUDA backend: device amaxes, device histories) run on a
-- device. Not a test file: loaded with dofile.
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local recipe = require "nvlua.recipe"

local R = dofile("tests/recompute_cases.lua")

local M = {R = R}

-- hidden 64, 4 query heads and 2 kv heads of 16: q 64 rows, k and v 32, gate and up 128 (multiples of
-- 16: nvfp4's 16x16 tiles never straddle two parts); 2 blocks, every linear but the head in nvfp4
M.CFG = R.SMALL
M.GROUPS = {
  {name = "self_attn.qkv_proj", parts = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}},
  {name = "mlp.gate_up_proj", parts = {"mlp.gate_proj", "mlp.up_proj"}},
}
local CFG, GROUPS = M.CFG, M.GROUPS

--- M.model(r [, device = "cpu"]) -> a fresh 2-block model (seed 4) under recipe r on device
function M.model(r, device)
  local m = llama.Llama(CFG, {recipe = r, seed = 4})
  if device and device ~= "cpu" then m:to(device) end
  return m
end

--- M.ids(seed) -> token ids [2, T] (host)
function M.ids(seed)
  local g = nv.Generator(seed)
  return (nv.rand(2, CFG.max_position_embeddings, {generator = g}) * (CFG.vocab_size - 1)):to("i64")
end

--- M.weights(m) -> {[parameter name] = its weight, on the host}
function M.weights(m)
  local w = {}
  for _, e in ipairs(m:named_parameters()) do w[e.name] = e.param:cpu() end
  return w
end

--- M.fprop_weights(m, r, ids) -> {[linear name] = {deq = dequantized (f32), codes =, amax =}}: the fprop
-- weight operand of every linear of a group as it enters its GEMM in one forward (eval), on the host
function M.fprop_weights(m, r, ids)
  local got = {}
  r:trace(function(e)
    if e.role == "fprop" and e.ctx.group then
      local q = e.b:cpu()
      got[e.ctx.name] = {deq = q:dequantize(), codes = q:codes(), amax = q.amax}
    end
  end)
  m:eval()
  recipe.weight_cache(function() m:forward(ids:to(m.embed_tokens.weight_entry.param:device())) end)
  m:train()
  r:trace(nil)
  return got
end

local function same(a, b, what)
  T.eq(a:size(), b:size(), what .. ": shape")
  local n = a:eq(b):sum()
  T.ok(n == a:numel(), string.format("%s: %d of %d elements differ", what, a:numel() - n, a:numel()))
end

--- M.concat(w, b, g) -> cat, offsets: the parts' weights (host) of group g in block b concatenated
-- along the rows (one fused weight, as Megatron's linear_qkv / linear_fc1 holds it), and each part's
-- row offset
function M.concat(w, b, g)
  local rows, K, offs = 0, nil, {}
  for i, p in ipairs(g.parts) do
    local t = w[string.format("model.layers.%d.%s.weight", b, p)]
    offs[i], rows, K = rows, rows + t:size(1), t:size(2)
  end
  local cat = nv.zeros(rows, K)
  for i, p in ipairs(g.parts) do
    local t = w[string.format("model.layers.%d.%s.weight", b, p)]
    cat:narrow(1, offs[i] + 1, t:size(1)):copy_(t)
  end
  return cat, offs
end

-- fmt's quantization of a weight as the recipe makes it (nvfp4: 16x16 tiles; fp8: per tensor), here
-- on the host
local function quantize_w(t, fmt)
  return nv.quantize(t, fmt, fmt == "nvfp4" and {block = "2d"} or nil)
end

--- M.check_groups(rname, fmt [, device]): under recipe rname with fused_amax each part's fprop weight
-- (in format fmt) is the rows of the host quantization of the parts' concatenation, bit for bit: codes,
-- values, amax; without it each part is its own weight's quantization; some part's own amax differs
-- from its group's (so that the two can be told apart).
function M.check_groups(rname, fmt, device)
  local ids = M.ids(1)
  for _, fused in ipairs({true, false}) do
    local r = recipe.make(rname, {fused_amax = fused})
    local m = M.model(r, device)
    local w = M.weights(m)
    local got = M.fprop_weights(m, r, ids)
    local distinct = false
    for b = 0, CFG.num_hidden_layers - 1 do
      for _, g in ipairs(GROUPS) do
        local cat, offs = M.concat(w, b, g)
        local qc = quantize_w(cat, fmt)
        local cat_deq, cat_codes = qc:dequantize(), qc:codes()
        for i, p in ipairs(g.parts) do
          local name = string.format("model.layers.%d.%s", b, p)
          local t = w[name .. ".weight"]
          local q = got[name]
          T.ok(q ~= nil, name .. ": traced")
          local own = quantize_w(t, fmt)
          distinct = distinct or own.amax ~= qc.amax
          if fused then
            local what = string.format("%s fused_amax: %s", rname, name)
            T.eq(q.amax, qc.amax, what .. ": amax = the concatenation's")
            same(q.codes, cat_codes:narrow(1, offs[i] + 1, t:size(1)), what .. ": codes = the concatenation's rows")
            same(q.deq, cat_deq:narrow(1, offs[i] + 1, t:size(1)), what .. ": values = the concatenation's rows")
          else
            local what = string.format("%s default: %s", rname, name)
            T.eq(q.amax, own.amax, what .. ": amax = its own weight's")
            same(q.codes, own:codes(), what .. ": codes = its own weight's quantization")
          end
        end
      end
    end
    T.ok(distinct, rname .. ": some part's own amax differs from its group's (else the check could not tell)")
  end
end

--- M.check_delayed([device]): fp8_delayed with fused_amax, 3 forwards, the weights scaled between
-- them: one history per group, pushed once per forward with the group's amax (max |w| over the
-- parts, from the concatenation here); each part quantized with the amax the history chose; no
-- weight history per part; the parts' x histories (one input) equal.
function M.check_delayed(device)
  local r = recipe.fp8_delayed({fused_amax = true, history = 4})
  local m = M.model(r, device)
  local gmax, used = {}, {} -- step -> block -> group -> its amax; step -> linear -> the amax it used
  for s = 1, 3 do
    if s > 1 then -- every weight times 0.5 after step 1, times 3 after step 2
      for _, e in ipairs(m:named_parameters()) do e.param:mul_(s == 2 and 0.5 or 3) end
    end
    local w = M.weights(m)
    gmax[s] = {}
    for b = 0, CFG.num_hidden_layers - 1 do
      gmax[s][b] = {}
      for _, g in ipairs(GROUPS) do gmax[s][b][g.name] = M.concat(w, b, g):abs():max() end
    end
    used[s] = {}
    for name, q in pairs(M.fprop_weights(m, r, M.ids(s))) do used[s][name] = q.amax end
  end
  local hs = r:state().histories
  for b = 0, CFG.num_hidden_layers - 1 do
    for _, g in ipairs(GROUPS) do
      local key = string.format("model.layers.%d.%s|w|fprop", b, g.name)
      local h, a = hs[key], function(s) return gmax[s][b][g.name] end
      T.ok(h ~= nil, key .. ": a history")
      T.eq(h.count, 3, key .. ": one push per forward")
      T.eq(h.values, {a(1), a(2), a(3)}, key .. ": the group's amaxes")
      for _, p in ipairs(g.parts) do
        local name = string.format("model.layers.%d.%s", b, p)
        T.ok(hs[name .. "|w|fprop"] == nil, name .. ": no history of its own")
        -- step 1: current scaling (the group's amax); then the window's max before this step's push
        T.eq(used[1][name], a(1), name .. " step 1")
        T.eq(used[2][name], a(1), name .. " step 2: the history's max (step 1's, larger)")
        T.eq(used[3][name], math.max(a(1), a(2)), name .. " step 3")
      end
    end
    local pre = string.format("model.layers.%d.self_attn.", b)
    T.eq(hs[pre .. "k_proj|x|fprop"].values, hs[pre .. "q_proj|x|fprop"].values, pre .. "k's x history = q's")
    T.eq(hs[pre .. "v_proj|x|fprop"].values, hs[pre .. "q_proj|x|fprop"].values, pre .. "v's x history = q's")
  end
end

--- M.VARIANTS: {name, make} with fused_amax on, for recompute_cases' traces
M.VARIANTS = {
  {"nvfp4 fused_amax", function() return recipe.nvfp4({fused_amax = true}) end},
  {"fp8_cs fused_amax", function() return recipe.fp8_cs({fused_amax = true}) end},
  {"fp8_delayed fused_amax", function() return recipe.fp8_delayed({fused_amax = true}) end},
}

--- M.check_recompute(o): each variant traced (recompute_cases' M.trace; o: its options) under
-- recompute block and selective equals none: losses, gradients, parameters, recipe state
function M.check_recompute(o)
  local to = {device = o.device, steps = o.steps, micro = o.micro, cfg = CFG}
  for _, v in ipairs(M.VARIANTS) do
    local base = R.trace(v[2], "none", to)
    for _, mode in ipairs({"block", "selective"}) do
      local d = R.differ(R.trace(v[2], mode, to), base)
      T.ok(d == nil, string.format("%s, recompute=%s: %s differs from recompute=none", v[1], mode, tostring(d)))
    end
  end
end

return M
