-- tests/nonfinite_flags.lua: the non-finite flags (core.nonfinite_take; core/backend.h
-- NVL_NONFINITE_*) of a quantization and of AdamW, shared by test_quant.lua / test_optim.lua (the
-- CPU, reference and fast tables) and test_cuda_quant.lua (the CUDA table). Not a test file: loaded
-- with dofile. dev(t) moves a host tensor to the device under test.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local M = {}

-- every quantized format and layout the recipes use, each with its options; with an amax given
-- (as training gives nvfp4 and fp8 the fused or device amax) no amax pass reads x, so those rows
-- check the quantizing kernels' own test
M.FORMATS = {
  {"nvfp4"}, {"nvfp4", {block = "2d"}}, {"nvfp4", {rht = true}}, {"nvfp4", {sr = true, seed = 1, offset = 0}},
  {"nvfp4", {amax = 3}}, {"nvfp4", {amax = 3, block = "2d"}}, {"nvfp4", {amax = 3, rht = true}},
  {"e4m3"}, {"e5m2"}, {"e4m3", {amax = 3}}, {"mxfp8_e4m3"}, {"mxfp8_e5m2"}, {"mxfp4"},
}

local function bad(value, at)
  local g = nv.Generator(31)
  local x = nv.randn(32, 64, {generator = g})
  x:set(at[1], at[2], value)
  return x
end

-- a quantization of a tensor with one NaN, +inf or -inf sets flag 1 on its device and take clears
-- it; finite inputs and bf16/f32 values set nothing
function M.quantize_cases(dev, where)
  local probe = dev(nv.zeros(1))
  core.nonfinite_take(probe) -- earlier cases' flags
  for _, f in ipairs(M.FORMATS) do
    local fmt, opts = f[1], f[2] or {}
    local what = string.format("%s %s%s%s", where, fmt, opts.block and " 2d" or opts.rht and " rht" or opts.sr and " sr"
      or "", opts.amax and " (amax given)" or "")
    local good = dev(nv.randn(32, 64, {generator = nv.Generator(7)}))
    core.quantize(good, fmt, opts):free()
    T.eq(core.nonfinite_take(probe), 0, what .. ": finite input sets nothing")
    for i, v in ipairs({0 / 0, math.huge, -math.huge}) do
      for _, dt in ipairs({"f32", "bf16"}) do
        local x = dev(bad(v, {1 + 7 * i, 3 + 19 * i}):to(dt))
        core.quantize(x, fmt, opts):free()
        T.eq(core.nonfinite_take(probe), 1, string.format("%s: %s %s input sets the flag", what, tostring(v), dt))
        T.eq(core.nonfinite_take(probe), 0, what .. ": take cleared it")
      end
    end
  end
  -- the column-wise copy and the fused row + column pair read x too
  local x = dev(bad(0 / 0, {32, 64}))
  core.quantize(x, "nvfp4", {axis = 1}):free()
  T.eq(core.nonfinite_take(probe), 1, where .. ": the column-wise nvfp4 copy sets the flag")
  for _, f in ipairs({{"nvfp4"}, {"nvfp4", {amax = 3}}, {"e4m3", {amax = 3}}, {"mxfp8_e4m3"}}) do
    for _, dt in ipairs({"f32", "bf16"}) do
      local a, b = core.quantize_rowcol(x:to(dt), f[1], f[2])
      a:free(); b:free()
      T.eq(core.nonfinite_take(probe), 1, string.format("%s: quantize_rowcol %s %s%s sets the flag", where, f[1], dt,
        f[2] and " (amax given)" or ""))
    end
  end
  -- values keep NaN and inf themselves: no flag
  for _, fmt in ipairs({"bf16", "f32"}) do
    core.quantize(x, fmt):free()
    T.eq(core.nonfinite_take(probe), 0, where .. ": " .. fmt .. " values set nothing")
  end
end

-- AdamW sets flag 2 when a parameter is (or becomes) non-finite; grad_norm_multi takes the flags
-- into its state's 4th slot when asked, and leaves them otherwise
function M.optim_cases(dev, where)
  local function tensors(nan)
    local p = nv.randn(1000, {generator = nv.Generator(3)})
    if nan then p:set(517, nan) end
    return dev(p), dev(nv.randn(1000, {generator = nv.Generator(4)})), dev(nv.zeros(1000)), dev(nv.zeros(1000))
  end
  local o = {lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, step = 1}
  local probe = dev(nv.zeros(1))
  core.nonfinite_take(probe)
  local p, g, m, v = tensors()
  core.adamw_multi({p}, {g}, {m}, {v}, o)
  T.eq(core.nonfinite_take(probe), 0, where .. ": finite parameters set nothing")
  for _, bad_value in ipairs({0 / 0, math.huge}) do
    p, g, m, v = tensors(bad_value)
    core.adamw_multi({p}, {g}, {m}, {v}, o)
    T.eq(core.nonfinite_take(probe), 2, where .. ": AdamW over a " .. tostring(bad_value) .. " parameter sets flag 2")
  end
  p, g, m, v = tensors(0 / 0)
  core.adamw_multi({p}, {g}, {m}, {v}, o)
  local state = dev(nv.zeros(4, {dtype = "i64"}))
  core.grad_norm_multi(state, {g}, 1.0)
  T.eq(state:cpu():totable()[4], 0, where .. ": grad_norm_multi without take leaves the slot 0")
  core.grad_norm_multi(state, {g}, 1.0, true)
  T.eq(state:cpu():totable()[4], 2, where .. ": grad_norm_multi with take puts the flags in slot 4")
  T.eq(core.nonfinite_take(probe), 0, where .. ": and clears them")
end

return M
