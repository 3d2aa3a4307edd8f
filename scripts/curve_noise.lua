-- scripts/curve_noise.lua: the noise floor of test_cuda_train.lua's loss-curve cases, measured on the CPU.
--   nvlua scripts/curve_noise.lua [--steps 50] [--out experiments/bench/curve_noise.md]
-- The same 2-layer model and batches (tests/curve.lua) trained eight times per recipe: the fast CPU
-- kernels (the baseline), the reference kernels (nv.use_reference: other summation orders, double
-- accumulators), and the fast kernels from weights nudged by k = +-1, +-2, +-3 f32 ulps. Prints each run's
-- relative gap to the baseline per step and the worst over the run; a GPU run is one more such
-- rounding difference, so by the triangle inequality a correct device stays within twice the worst
-- gap of the CPU pair (the bound test_cuda_train.lua uses), while a wrong kernel stalls near ln 64.
local nv = require "nvlua"
local config = require "nvlua.config"
local curve = dofile("tests/curve.lua")

local o = config.schema({steps = config.int(50, {min = 1}),
  out = config.str("experiments/bench/curve_noise.md", {nonempty = true})}):parse(arg)

local function gaps(a, b)
  local g, worst, at = {}, 0, 1
  for i = 1, #a do
    g[i] = math.abs(a[i] - b[i]) / b[i]
    if g[i] > worst then worst, at = g[i], i end
  end
  return g, worst, at
end

local lines = {"# Loss-curve noise floor on the CPU (scripts/curve_noise.lua)", "",
  string.format("%s, %d steps, tests/curve.lua's 2-layer model. Relative gap |run - fast| / fast.", os.date("!%Y-%m-%d"),
    o.steps), "",
  string.format("Recipes at their defaults (activations: %s); CPU GEMM route: %s.",
    nv.recipe.nvfp4().act_dtype or "?", tostring(nv.info().dnnl or "sgemm")), "", "| recipe | run | step 1 | worst | at step | final |", "|---|---|---|---|---|---|"}
for _, rname in ipairs({"bf16", "nvfp4"}) do
  io.write(string.format("%s: fast kernels ...\n", rname)); io.flush()
  local base = curve.losses("cpu", rname, o.steps)
  io.write(string.format("%s: reference kernels ...\n", rname)); io.flush()
  local prev = nv.use_reference(true)
  local ref = curve.losses("cpu", rname, o.steps)
  nv.use_reference(prev)
  local runs = {{"reference kernels", ref}}
  for _, k in ipairs({1, -1, 2, -2, 3, -3}) do
    io.write(string.format("%s: weights x (1 %+d 2^-23) ...\n", rname, k)); io.flush()
    runs[#runs + 1] = {string.format("weights x (1 %+d 2^-23)", k), curve.losses("cpu", rname, o.steps, {nudge = k})}
  end
  local worst_all = 0
  for _, r in ipairs(runs) do
    local g, worst, at = gaps(r[2], base)
    worst_all = math.max(worst_all, worst)
    lines[#lines + 1] = string.format("| %s | %s | %.2e | %.2e | %d | %.2e |", rname, r[1], g[1], worst, at, g[#g])
  end
  lines[#lines + 1] = string.format("| %s | loss fast: step 1 %.4f, step %d %.4f | | bound 2x worst = %.4f | | |", rname,
    base[1], o.steps, base[o.steps], 2 * worst_all)
end
local text = table.concat(lines, "\n") .. "\n"
io.write(text)
local f = assert(io.open(o.out, "w"))
f:write(text)
f:close()
io.write("wrote " .. o.out .. "\n")
