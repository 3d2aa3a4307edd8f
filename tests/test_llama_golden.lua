-- tests/test_llama_golden.lua: llama.Llama under the f32 recipe against PyTorch — logits, loss,
-- every parameter gradient, the losses of 5 AdamW steps and the parameters after them — for the
-- 2-layer GQA tiny Llama in tests/data/tiny_llama_ref.safetensors (scripts/make_reference.py:
-- transformers' LlamaForCausalLM on the CPU in f32, cross-checked there against a plain-torch Llama).
--
-- Tolerances (fp32: unit roundoff u = 2^-24 ≈ 6e-8). nvlua and PyTorch run the same arithmetic in a
-- different summation order (blocked GEMMs, reductions, exp/log implementations), so results agree
-- to a few ulps per op, and the error grows with the depth of the computation: the logits are ~25
-- dependent ops deep (2 blocks × {RMSNorm, q/k/v/o GEMMs, RoPE, QK^T, softmax, AV, 3 MLP GEMMs,
-- 2 residual adds}, final norm, LM head) with reductions of length K ≤ 64; a worst-case bound of
-- ~K·u relative per reduction is ~4e-6, the typical √K·u far less. Hence:
--   logits   max|Δ| ≤ 1e-5·max|logit| + 1e-6
--   loss     |Δ| ≤ 1e-6·|loss| + 1e-6  (a mean of 31 log-sum-exps: one more reduction)
--   grads    per tensor, max|Δ| ≤ 1e-5·max|g_ref|: the backward is about twice as deep as the
--            forward, and gradients of different tensors differ by ~3 orders of magnitude
--            (q_proj ~2e-4, embeddings ~0.16), so each is judged against its own scale.
--   AdamW    Adam divides by √v̂ + eps, which turns a tiny gradient's rounding difference into a
--            difference of up to ~lr in its update (for |g| near eps or a sign flip), so the final
--            parameters are compared with an absolute tolerance tied to lr, not a relative one:
--            max|Δ| ≤ 1e-3·lr. That still sees real optimizer bugs: weight decay on or off the
--            wrong group moves a weight of ~0.02 by lr·0.1·0.02·5 = 1e-4 over the 5 steps, a wrong
--            bias correction or beta moves parameters by O(lr). Losses: |Δ| ≤ 1e-5·|loss|.
-- Observed on x86-64 with OpenBLAS (what the tolerances leave as margin): logits 9e-8 (vs 5e-6),
-- loss 3e-7 (vs 5e-6), worst gradient 5e-7 relative (vs 1e-5), AdamW losses 3e-7 (vs ~3e-5),
-- final parameters 3e-7 (vs 1e-5). For scale, the bugs this test is meant to catch, made in the
-- plain-torch Llama on the same weights, move the logits by 7.7e-4 (θ = 5e5 instead of 1e4) to
-- 0.68 (wrong GQA head mapping) relative to max|logit|, and some gradient by 5.6e-2 (RMSNorm eps
-- 1e-6) to 1.9 (interleaved instead of rotate-half RoPE) relative to its max; the loss alone would
-- miss the RoPE ones (|Δloss| ~ 6e-6), which is why every gradient is checked.
local T = require "nvlua.test"
local nv = require "nvlua"
local st = require "nvlua.safetensors"
local cjson = require "cjson"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local REF = here .. "/data/tiny_llama_ref.safetensors"

local LR = 1e-2
local TOL = {
  logits_rel = 1e-5, logits_abs = 1e-6,
  loss_rel = 1e-6, loss_abs = 1e-6,
  grad_rel = 1e-5,
  adamw_loss_rel = 1e-5,
  final_abs = 1e-3 * LR,
}

local ok_llama, llama = pcall(require, "nvlua.llama")
local ok_optim, optim = pcall(require, "nvlua.optim")
local ok_recipe, recipe = pcall(require, "nvlua.recipe")

local ref, meta = st.load(REF)
assert(ref, meta) -- the golden file is committed; its absence is a failure, not a skip

local function maxabs(t) return t:abs():max() end
local function maxdiff(a, b)
  local d = a - b
  local m = d:abs():max()
  d:free()
  return m
end

-- a fresh model holding the reference weights
local function make_model()
  if not (ok_llama and ok_recipe) then T.skip("nvlua.llama / nvlua.recipe not available") end
  local model = llama.Llama(cjson.decode(meta.config), {recipe = recipe.f32()})
  local dict = {}
  for _, p in ipairs(model:named_parameters()) do dict[p.name] = ref[p.name] end
  model:load_state_dict(dict)
  return model
end

T.case("the reference file holds what the test needs", function()
  T.ok(meta.config and meta.torch_version, "metadata has the config and versions")
  local cfg = cjson.decode(meta.config)
  T.eq(cfg.num_key_value_heads, 2); T.eq(cfg.num_attention_heads, 4); T.eq(cfg.num_hidden_layers, 2)
  T.eq(ref.input_ids:size(), {2, 16}); T.eq(ref.input_ids:dtype(), "i64")
  T.eq(ref.targets:size(), {2, 16}); T.eq(ref.targets:dtype(), "i64")
  T.eq(ref.logits:size(), {32, 64}); T.eq(ref.loss:size(), {1}); T.eq(ref.adamw_losses:size(), {5})
  local ignored = 0
  for _, v in ipairs(ref.targets:reshape(32):totable()) do if v == -100 then ignored = ignored + 1 end end
  T.eq(ignored, 1, "one target is ignore_index")
end)

T.case("parameters: Hugging Face names and shapes, no_decay on norms and embeddings (PyTorch's groups)", function()
  local model = make_model()
  local n, names = 0, {}
  for _, p in ipairs(model:named_parameters()) do
    n = n + 1
    names[p.name] = true
    T.ok(ref[p.name], "reference has " .. p.name)
    T.eq(p.param:size(), ref[p.name]:size(), p.name)
    T.ok(ref["grad." .. p.name] and ref["final." .. p.name], "reference has grad/final of " .. p.name)
    local want = p.name:find("norm", 1, true) ~= nil or p.name:find("embed_tokens", 1, true) ~= nil
    T.eq(p.no_decay, want, p.name .. " no_decay")
  end
  T.eq(n, 2 + 2 * 9 + 1)
  local DATA = {input_ids = true, targets = true, logits = true, loss = true, adamw_losses = true}
  for name in pairs(ref) do
    local base = name:gsub("^grad%.", ""):gsub("^final%.", "")
    T.ok(DATA[name] or names[base], "nvlua's Llama has the reference parameter " .. base)
  end
end)

T.case("logits match PyTorch", function()
  local model = make_model()
  model:eval()
  local logits = model:forward(ref.input_ids)
  T.eq(logits:size(), {32, 64})
  local d, scale = maxdiff(logits, ref.logits), maxabs(ref.logits)
  local tol = TOL.logits_rel * scale + TOL.logits_abs
  T.ok(d <= tol, string.format("logits: max |Δ| = %.3g > %.3g (max |logit| %.3g)", d, tol, scale))
  logits:free()
end)

T.case("loss and every parameter gradient match PyTorch", function()
  local model = make_model()
  model:zero_grad()
  local loss, count = model:forward_backward(ref.input_ids, ref.targets)
  local want = ref.loss:item()
  T.eq(count, 31, "tokens counted (one is ignore_index)")
  T.near(loss, want, TOL.loss_rel * math.abs(want) + TOL.loss_abs, "loss")
  for _, p in ipairs(model:named_parameters()) do
    local g = ref["grad." .. p.name]
    local scale = maxabs(g)
    T.ok(scale > 0, p.name .. ": reference gradient is not all zero")
    local d = maxdiff(p.grad, g)
    T.ok(d <= TOL.grad_rel * scale, string.format("grad %s: max |Δ| = %.3g > %.3g (max |g| %.3g, relative %.3g)",
      p.name, d, TOL.grad_rel * scale, scale, d / scale))
  end
end)

T.case("5 AdamW steps: losses and final parameters match torch.optim.AdamW", function()
  if not ok_optim then T.skip("nvlua.optim not available") end
  local model = make_model()
  local opt = optim.AdamW(model:named_parameters(), {lr = LR, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1})
  local want = ref.adamw_losses:totable()
  for i = 1, #want do
    model:zero_grad()
    local loss = model:forward_backward(ref.input_ids, ref.targets)
    T.near(loss, want[i], TOL.adamw_loss_rel * math.abs(want[i]), "loss before step " .. i)
    opt:step()
  end
  for _, p in ipairs(model:named_parameters()) do
    local d = maxdiff(p.param, ref["final." .. p.name])
    T.ok(d <= TOL.final_abs, string.format("final %s: max |Δ| = %.3g > %.3g", p.name, d, TOL.final_abs))
  end
end)
