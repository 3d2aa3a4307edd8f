-- tests/test_fused_amax.lua: fused groups (nn.fuse; recipe option fused_amax, lua/nvlua/recipe.lua
-- "fused groups"): q/k/v and gate/up weights scaled by their group's amax, as one fused weight.
--   * nvfp4 and fp8_cs: each part's fprop weight, as it enters its GEMM, is bit for bit the rows of
--     the quantization of the parts' concatenation (built here, nv.quantize with its own amax): the
--     same codes, decoded values and amax; without the option each part is its own weight's
--     quantization (and the parts' own amaxes differ, so the two cases can be told apart);
--   * the default: a run with fused_amax = false (preset option, recipe.make setting, config key) is
--     the run without the option, bit for bit (losses, gradients, parameters, recipe state), and a
--     run with it differs;
--   * fp8_delayed: one history per group ("<group>|w|fprop"), pushed once per forward with the
--     group's amax (max |w| over the parts, computed here); the parts quantize with the amax it
--     chose (the previous step's group amax); no per-part weight history;
--   * activation recompute (block, selective) and a checkpoint's state round trip change nothing;
--   * which groups share a scale: recipe:weight_group, describe's and plan's group field;
--   * errors: the option where it does not apply, a non-boolean value.
-- The CUDA paths (device amax, device histories): tests/test_cuda_fused_amax.lua.
local T = require "nvlua.test"
local recipe = require "nvlua.recipe"
local train = require "nvlua.train"
local config = require "nvlua.config"

local C = dofile("tests/fused_amax_cases.lua")
local R = C.R

T.case("nvfp4 fused_amax: each q/k/v, gate/up weight is the rows of the concatenation's quantization, bit for bit", function()
  C.check_groups("nvfp4", "nvfp4")
end)

T.case("fp8_cs fused_amax: each part's e4m3 weight and per-tensor scale are the concatenation's, bit for bit", function()
  C.check_groups("fp8_cs", "e4m3")
end)

-- ---- the default is the run without the option --------------------------------------------------

local function trace_of(make) return R.trace(make, "none", {steps = 2, micro = 2, cfg = C.CFG}) end

T.case("fused_amax = false (option, recipe.make setting) is the run without it, bit for bit; true differs", function()
  for _, rname in ipairs({"nvfp4", "fp8_cs", "fp8_delayed"}) do
    local base = trace_of(function() return recipe.make(rname) end)
    local ctor = rname == "nvfp4" and recipe.nvfp4 or rname == "fp8_cs" and recipe.fp8_cs or recipe.fp8_delayed
    local d1 = R.differ(trace_of(function() return ctor({fused_amax = false}) end), base)
    T.ok(d1 == nil, rname .. "({fused_amax = false}): " .. tostring(d1) .. " differs from the default")
    local d2 = R.differ(trace_of(function() return recipe.make(rname, {fused_amax = false}) end), base)
    T.ok(d2 == nil, rname .. " make{fused_amax = false}: " .. tostring(d2) .. " differs from the default")
    local d3 = R.differ(trace_of(function() return recipe.make(rname, {fused_amax = true}) end), base)
    T.ok(d3 ~= nil, rname .. ": fused_amax = true changes the run")
  end
end)

T.case("config key fused_amax: default false, passed to the recipe; a recipe value must agree; refused where it does not apply", function()
  local c = config.parse(train.defaults, {"recipe=nvfp4"})
  T.eq(c.fused_amax, false, "default")
  T.eq(train.recipe(c).fused_amax, false, "the default recipe")
  T.eq(tostring(train.recipe(c)), tostring(recipe.nvfp4({seed = c.seed})), "the default recipe describes itself as before")
  c = config.parse(train.defaults, {"recipe=fp8_delayed", "fused_amax=true"})
  local r = train.recipe(c)
  T.ok(r.fused_amax == true and tostring(r):find("fused_amax=true", 1, true), "fused_amax=true reaches the recipe: " ..
    tostring(r))
  T.raises(function() train.recipe(config.parse(train.defaults, {"recipe=bf16", "fused_amax=true"})) end,
    "recipe bf16: fused_amax does not apply")
  T.raises(function() train.recipe(config.parse(train.defaults, {"recipe=mxfp4", "fused_amax=true"})) end,
    "recipe mxfp4: fused_amax does not apply")
  c = config.parse(train.defaults, {"fused_amax=true"})
  c.recipe = recipe.nvfp4()
  T.raises(function() train.recipe(c) end, "does not scale fused groups by one amax")
  c.recipe = recipe.nvfp4({fused_amax = true})
  T.eq(train.recipe(c), c.recipe, "a recipe value with fused_amax")
end)

-- ---- delayed scaling ------------------------------------------------------------------------------

T.case("fp8_delayed fused_amax: one history per group, pushed once per forward with the group's amax", function()
  C.check_delayed()
end)

T.case("activation recompute (block, selective) under fused_amax: the same losses, gradients, state as none", function()
  C.check_recompute({steps = 3, micro = 2})
end)

T.case("fp8_delayed fused_amax: a state round trip (through plain tables) resumes with the same scales", function()
  local SCALE = {1, 0.5, 0.25} -- the weights before step s are the initial ones times SCALE[1] ... SCALE[s]
  -- from step first to step last; restore: a state to load first
  local function run(first, last, restore)
    local r = recipe.fp8_delayed({fused_amax = true, history = 4})
    local m = C.model(r)
    if restore then r:load_state(restore) end
    local out
    for s = 1, last do
      for _, e in ipairs(m:named_parameters()) do e.param:mul_(SCALE[s]) end
      if s >= first then out = C.fprop_weights(m, r, C.ids(s)) end
    end
    return r, out
  end
  local st = run(1, 2):state()
  local copy = {seed = st.seed, offset = st.offset, histories = {}}
  for k, h in pairs(st.histories) do
    copy.histories[k] = {len = h.len, values = {table.unpack(h.values)}, pos = h.pos, count = h.count, last = h.last}
  end
  local rr, resumed = run(3, 3, copy)
  local rs, straight = run(1, 3)
  local fresh = select(2, run(3, 3))
  local n = 0
  for name, q in pairs(straight) do
    T.eq(resumed[name].amax, q.amax, name .. ": amax after the resume")
    T.ok(fresh[name].amax < q.amax, name .. ": without the state step 3 would scale by its own, smaller amax")
    n = n + 1
  end
  T.eq(n, 10, "the parts of 2 blocks' groups")
  T.eq(rr:state().histories, rs:state().histories, "the histories after step 3")
end)

-- ---- the export (nvlua.deploy) -------------------------------------------------------------------

T.case("deploy.quantize under fused_amax: every part is the training forward's weight, no group re-quantized", function()
  local deploy = require "nvlua.deploy"
  for _, v in ipairs({{"nvfp4", "nvfp4_a16"}, {"fp8_cs", "fp8"}, {"fp8_delayed", "fp8"}}) do
    for _, fused in ipairs({true, false}) do
      local r = recipe.make(v[1], {fused_amax = fused})
      local m = C.model(r)
      -- the forward's weights (delayed scaling: its history then holds this amax, the export's choice)
      local forward = C.fprop_weights(m, r, C.ids(1))
      local rows, info = deploy.quantize(m, {quantize = v[2], format = "modelopt",
        calibration = v[2] == "fp8" and {C.ids(2)} or nil})
      local what = string.format("%s fused_amax=%s", v[1], tostring(fused))
      if fused then
        T.eq(#info.fused.requantized, 0, what .. ": parts re-quantized by the export")
        local n = 0
        for _, row in ipairs(rows) do
          local f = forward[row.name]
          if f then
            n = n + 1
            T.eq(row.amax, f.amax, what .. ": " .. row.name .. " amax")
            T.ok(row.q:dequantize():eq(f.deq):sum() == f.deq:numel(), what .. ": " .. row.name .. " = the forward's")
          end
        end
        T.eq(n, 10, what .. ": the groups' parts")
      else
        T.ok(#info.fused.requantized > 0, what .. ": the export re-quantizes parts whose amax is not their group's")
      end
      deploy.free(rows)
    end
  end
end)

-- ---- which groups share a scale -----------------------------------------------------------------

T.case("weight_group, describe and plan name the group whose amax scales each weight", function()
  local m = C.model(recipe.nvfp4({fused_amax = true, bf16_first = 1, bf16_last = 0}))
  local r = m.lm_head.recipe
  local d = r:describe({model = m})
  local want = {
    ["model.layers.1.self_attn.q_proj"] = "model.layers.1.self_attn.qkv_proj",
    ["model.layers.1.self_attn.k_proj"] = "model.layers.1.self_attn.qkv_proj",
    ["model.layers.1.self_attn.v_proj"] = "model.layers.1.self_attn.qkv_proj",
    ["model.layers.1.mlp.gate_proj"] = "model.layers.1.mlp.gate_up_proj",
    ["model.layers.1.mlp.up_proj"] = "model.layers.1.mlp.gate_up_proj",
  } -- block 0 is bf16 (no scale to share); o_proj, down_proj and the head are in no group
  T.eq(#d.layers, 15, "layers")
  for i, l in ipairs(d.layers) do
    T.eq(l.group, want[l.name], l.name .. ": describe's group")
    T.eq(r:weight_group(m:linears()[i].module:context()), want[l.name], l.name .. ": weight_group")
  end
  T.eq(m.layers[1].self_attn.q_proj:context().group.name, "model.layers.0.self_attn.qkv_proj",
    "the context names the group whatever the recipe")
  local lines = {}
  r:plan(m, {out = {write = function(_, s) lines[#lines + 1] = s end}})
  T.ok(table.concat(lines):find("fused_amax: 5 weights in 2 groups", 1, true), "plan's line: " .. lines[#lines])
  local plain = recipe.nvfp4()
  plain = plain:describe({model = m:set_recipe(plain)})
  for _, l in ipairs(plain.layers) do T.eq(l.group, nil, l.name .. ": no group without fused_amax") end
end)

T.case("errors: fused_amax where it does not apply, or not a boolean", function()
  T.raises(function() recipe.mxfp4({fused_amax = true}) end, "fused_amax")
  T.raises(function() recipe.mxfp8({fused_amax = true}) end, "fused_amax")
  T.raises(function() recipe.nvfp4({fused_amax = "yes"}) end, "fused_amax")
  T.raises(function() recipe.make("mor", {fused_amax = true}) end, "recipe mor: fused_amax does not apply")
  T.raises(function() recipe.make("f32", {fused_amax = true}) end, "recipe f32: fused_amax does not apply")
end)
