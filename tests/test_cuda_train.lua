-- test_cuda_train.lua: training on the GPU (issue 7): the tensor ops the layer library and the
-- loop use on device tensors (kernels/cuda/ops.cu) against the CPU bit for bit, Llama:to("cuda"),
-- and a 2-layer model trained 50 steps on the device against the same model on the CPU under
-- bf16 and nvfp4, then an experiment run with device=cuda (checkpoint, resume).
--
-- Tolerances. The device ops (copy, cast, fill, add_, mul_, amax) are the CPU's operations in the
-- same order: bit for bit. Training: the two devices start from the same weights and see the same
-- batches; they differ only in the order of fp32 sums (cuBLASLt vs OpenBLAS GEMMs, the fused
-- attention and cross-entropy, atomics in the weight-gradient scatters). Those differences are
-- ~1e-6 relative, but a GEMM output rounded to bf16 (the recipes' fprop/dgrad outputs) can flip
-- by one bf16 ulp (2^-8 = 0.4%) where a sum lands near a rounding boundary, and nvfp4's SR draws
-- are the same bits but decide on slightly different inputs. So: step 1's loss within 0.5%
-- (one bf16 ulp of the logits' effect; measured CPU-vs-CPU step-1 gaps are below 2e-5), and every
-- step within twice the measured noise floor of CPU runs that differ only in rounding (BOUND below:
-- 1.1% bf16, 10.5% nvfp4; an earlier guess of 3% was below nvfp4's noise). A wrong kernel is off by far
-- more: a wrong gradient stalls the loss near ln V = 4.16 where training reaches 0.9. The file has
-- not yet run on a GPU.
-- Every case needs a GPU and skips without one.
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"

local need_gpu = T.need_gpu

-- a and b (any devices) hold the same bits: compared as their f32 values on the CPU, NaN = NaN
local function same_bits(a, b, what)
  local ha, hb = a:cpu():to("f32"), b:cpu():to("f32")
  T.eq(ha:size(), hb:size(), what .. ": shape")
  local ta, tb = ha:reshape(-1):totable(), hb:reshape(-1):totable()
  local bad = 0
  for i = 1, #ta do
    local x, y = ta[i], tb[i]
    if not (x == y or (x ~= x and y ~= y)) or (x == 0 and y == 0 and 1 / x ~= 1 / y) then bad = bad + 1 end
  end
  T.ok(bad == 0, string.format("%s: %d of %d elements differ", what, bad, #ta))
end

T.case("tensor ops on cuda equal the cpu bit for bit: strided copies, f32<->bf16, fill, add_, mul_, amax", function()
  need_gpu()
  nv.manual_seed(11)
  local x = nv.randn(37, 53) * 3
  local dx = x:cuda()
  -- transposes, narrows and broadcasts made contiguous on the device
  same_bits(dx:transpose():contiguous(), x:transpose():contiguous(), "transpose")
  same_bits(dx:narrow(2, 5, 17):contiguous(), x:narrow(2, 5, 17):contiguous(), "narrow")
  same_bits(dx:narrow(1, 3, 1):expand(9, 53):contiguous(), x:narrow(1, 3, 1):expand(9, 53):contiguous(), "broadcast")
  -- a strided cuda source copied to the cpu, and a cpu source into a strided cuda destination
  same_bits(dx:transpose():cpu(), x:transpose(), "strided download")
  local d2 = nv.zeros(53, 37):cuda()
  d2:transpose():copy_(x)
  same_bits(d2, x:transpose(), "strided upload")
  -- casts, specials included
  local sp = nv.tensor({0, -0.0, 1 / 0, -1 / 0, 0 / 0, 1.00390625, 1.01171875, 3.4e38, 1e-40, -2.5e-39})
  same_bits(sp:cuda():to("bf16"), sp:to("bf16"), "f32 -> bf16 (ties, overflow, subnormals, nan)")
  same_bits(sp:to("bf16"):cuda():to("f32"), sp:to("bf16"):to("f32"), "bf16 -> f32")
  -- fill, zero_, in-place arithmetic
  local f = nv.empty(5, 7):cuda(); f:fill_(0.1)
  same_bits(f, nv.full({5, 7}, 0.1), "fill 0.1")
  local fb = nv.empty(6, "bf16"):cuda(); fb:fill_(1 / 3)
  same_bits(fb, nv.full({6}, 1 / 3, "bf16"), "fill bf16")
  local y, dy = x:clone(), dx:clone()
  y:add_(x:transpose():contiguous():transpose(), 0.3); dy:add_(dx:transpose():contiguous():transpose(), 0.3)
  same_bits(dy, y, "add_ with alpha")
  y:add_(x:narrow(1, 1, 1)); dy:add_(dx:narrow(1, 1, 1))
  same_bits(dy, y, "add_ broadcast")
  y:mul_(0.1); dy:mul_(0.1)
  same_bits(dy, y, "mul_ by a scalar not exact in f32")
  y:mul_(0.5); dy:mul_(0.5)
  same_bits(dy, y, "mul_ by a scalar exact in f32")
  T.eq(dx:amax(), x:amax(), "amax")
  T.eq(dx:to("bf16"):amax(), x:to("bf16"):amax(), "amax bf16")
  local n = x:clone(); n:set(3, 4, 0 / 0)
  local a = n:cuda():amax()
  T.ok(a ~= a, "amax propagates NaN on cuda, as on the cpu")
end)

-- ops.cu transpose_kernel: copies whose destination and source are contiguous along different dims
-- go through 32x32 tiles (ragged edges, batch dims, casts, strided destinations, broadcast sources);
-- the rest stays on copy_strided_kernel. Bit for bit with the CPU either way.
T.case("tiled transposes and permutations on cuda equal the cpu bit for bit (ragged tiles, batches, casts, strided destinations)", function()
  need_gpu()
  local g = nv.Generator(17)
  for _, shape in ipairs({ {1, 5}, {33, 70}, {64, 64}, {130, 7}, {5, 300} }) do
    local x = nv.randn(shape[1], shape[2], {generator = g}) * 3
    local dx = x:cuda()
    local what = shape[1] .. "x" .. shape[2]
    same_bits(dx:t():contiguous(), x:t():contiguous(), what .. ": transpose")
    same_bits(dx:t():to("bf16"), x:t():to("bf16"), what .. ": transposed f32 -> bf16")
    local xb, dxb = x:to("bf16"), dx:to("bf16")
    same_bits(dxb:t():contiguous(), xb:t():contiguous(), what .. ": bf16 transpose")
    same_bits(dxb:t():to("f32"), xb:t():to("f32"), what .. ": transposed bf16 -> f32")
    local xi = (x * 100):to("i64")
    same_bits(xi:cuda():t():contiguous():cpu():to("f32"), xi:t():contiguous():to("f32"), what .. ": i64 transpose")
    -- into a transposed (strided) destination from a contiguous source
    local d2 = nv.zeros(shape[2], shape[1]):cuda()
    d2:t():copy_(dx)
    same_bits(d2, x:t():contiguous(), what .. ": copy into a transposed destination")
  end
  local x3 = nv.randn(3, 37, 45, {generator = g})
  local d3 = x3:cuda()
  for _, perm in ipairs({ {1, 3, 2}, {3, 2, 1}, {2, 3, 1}, {3, 1, 2}, {2, 1, 3} }) do
    local what = "permute(" .. table.concat(perm, ",") .. ")"
    same_bits(d3:permute(table.unpack(perm)):contiguous(), x3:permute(table.unpack(perm)):contiguous(), what)
  end
  -- a broadcast source, transposed
  local row = nv.randn(1, 40, {generator = g})
  same_bits(row:cuda():expand(33, 40):t():contiguous(), row:expand(33, 40):t():contiguous(), "broadcast, transposed")
end)

T.case("Llama:to('cuda') and back keeps every value; the gradient buffer and optimizer state follow", function()
  need_gpu()
  local cfg = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32, tie_word_embeddings = true}
  local cpu = llama.Llama(cfg, {seed = 3})
  local m = llama.Llama(cfg, {seed = 3}):to("cuda")
  T.eq(m.grad_buffer:device(), "cuda", "flat gradient buffer")
  local opt = optim.AdamW(m:named_parameters(), {lr = 1e-3})
  for name, t in pairs(opt:state().m) do T.eq(t:device(), "cuda", "AdamW m of " .. name) end
  local want = {}
  for _, p in ipairs(cpu:named_parameters()) do want[p.name] = p.param end
  for _, p in ipairs(m:named_parameters()) do
    T.eq(p.param:device(), "cuda", p.name)
    same_bits(p.param, want[p.name], p.name)
  end
  m:to("cpu")
  for _, p in ipairs(m:named_parameters()) do same_bits(p.param, want[p.name], p.name .. " (back on the cpu)") end
end)

-- the 2-layer model, its batches and its training loop: tests/curve.lua (shared with scripts/curve_noise.lua)
local curve = dofile("tests/curve.lua")

-- Per-step bounds from the measured noise floor (scripts/curve_noise.lua, experiments/bench/curve_noise.md):
-- seven CPU runs that differ from the fast-kernel run only in rounding (the reference kernels' summation
-- order and double accumulators; initial weights x (1 + k 2^-23), k = +-1..3) drift up to 0.54% (bf16)
-- and 5.2% (nvfp4: SR and the 4-bit grid amplify a flipped rounding) from it within 50 steps, with the
-- recipes' defaults (bf16 activations). A device run is one more such difference, so by the triangle
-- inequality it stays within twice that: 1.1% and 10.5%.
local BOUND = {bf16 = 0.011, nvfp4 = 0.105}

local function follows(rname)
  need_gpu()
  local c, g = curve.losses("cpu", rname, 50), curve.losses("cuda", rname, 50)
  local worst, at = 0, 1
  for i = 1, 50 do
    local r = math.abs(g[i] - c[i]) / c[i]
    if r > worst then worst, at = r, i end
  end
  T.ok(math.abs(g[1] - c[1]) / c[1] <= 0.005, string.format("%s step 1: cuda %.6f vs cpu %.6f", rname, g[1], c[1]))
  T.ok(worst <= BOUND[rname], string.format("%s: worst relative gap %.4f at step %d (cuda %.5f, cpu %.5f), bound %.2f",
    rname, worst, at, g[at], c[at], BOUND[rname]))
  T.ok(g[50] < g[1] - 0.5, string.format("%s: the device run learns (%.4f -> %.4f)", rname, g[1], g[50]))
end

T.case("a 2-layer model trained 50 steps on cuda follows the cpu loss curve under bf16", function() follows("bf16") end)
T.case("a 2-layer model trained 50 steps on cuda follows the cpu loss curve under nvfp4", function() follows("nvfp4") end)

-- ---- NaN and infinity injection on cuda, every recipe (tests/nonfinite_cases.lua) --------------

local NONFINITE = dofile("tests/nonfinite_cases.lua")
for _, name in ipairs(require("nvlua.recipe").names()) do
  T.case("on cuda: a NaN weight, activation or loss and an Inf gradient are caught in their step under " .. name ..
    "; a kept NaN weight stops the run and the last healthy checkpoint survives", function()
    need_gpu()
    NONFINITE.run(name, "cuda")
  end)
end
