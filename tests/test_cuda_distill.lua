-- test_cuda_distill.lua: knowledge distillation on the CUDA backend (kernels/cuda/layers.cu
-- distill_kernel) against the CPU (test_distill.lua checks the CPU against double precision and
-- finite differences). Tolerances: both compute each row's softmaxes and KL in double, the device
-- with block reductions in another order, so the means agree to 1e-12 relative and each gradient
-- entry (a double rounded once to f32) to one f32 ulp. A Llama step with a teacher on the device:
-- the loss within 0.5% of the CPU's (test_cuda_train.lua's bound: one bf16 ulp of a GEMM output).
-- Run under the CPU emulation of CUDA (scripts/test.sh --emu), not on a GPU so far.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local llama = require "nvlua.llama"

T.case("distill_loss on the device = the CPU's (f32 and bf16 logits, ignored rows)", function()
  T.need_gpu()
  nv.manual_seed(1)
  local s, t = nv.randn(40, 77) * 3, nv.randn(40, 77) * 3
  local tgl = {}
  for i = 1, 40 do tgl[i] = (i * 7) % 77 end
  tgl[5] = -100
  local tg = nv.tensor(tgl):to("i64")
  for _, dt in ipairs({"f32", "bf16"}) do
    local sc, tc = s:to(dt), t:to(dt)
    local kl, ce, n, d = core.distill_loss(sc, tc, tg, {temperature = 2, alpha = 0.3})
    local kl2, ce2, n2, d2 = core.distill_loss(sc:cuda(), tc:cuda(), tg:cuda(), {temperature = 2, alpha = 0.3})
    T.near(kl2, kl, 1e-12 * kl, dt .. ": KL")
    T.near(ce2, ce, 1e-12 * ce, dt .. ": CE")
    T.eq(n2, n)
    T.eq(d2:device(), "cuda")
    local diff, bound = (d2:cpu() - d):abs(), d:abs() * 2.0 ^ -23 + 2.0 ^ -149
    T.eq(diff:le(bound):sum(), diff:numel(), dt .. ": the gradient within one f32 ulp")
  end
end)

T.case("a Llama step with a teacher on the device: the loss and its parts as on the CPU", function()
  T.need_gpu()
  local cfg = {vocab_size = 40, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4,
    num_key_value_heads = 2, max_position_embeddings = 32}
  nv.manual_seed(2)
  local ids, tg = (nv.rand(2, 16) * 39):to("i64"), (nv.rand(2, 16) * 39):to("i64")
  local out = {}
  for _, dev in ipairs({"cpu", "cuda"}) do
    local teacher = llama.Llama(cfg, {seed = 1, recipe = nv.recipe.bf16()})
    local s = llama.Llama(cfg, {seed = 3, recipe = nv.recipe.nvfp4()})
    if dev == "cuda" then teacher:to("cuda"); s:to("cuda") end
    local x, y = dev == "cuda" and ids:cuda() or ids, dev == "cuda" and tg:cuda() or tg
    out[dev] = {loss = s:forward_backward(x, y, {distill = {teacher = teacher, temperature = 2, alpha = 0.5}}),
      parts = s.distill_parts}
  end
  T.near(out.cuda.loss, out.cpu.loss, 5e-3 * out.cpu.loss, "the loss")
  T.near(out.cuda.parts.ce, out.cpu.parts.ce, 5e-3 * out.cpu.parts.ce, "its cross-entropy")
end)
