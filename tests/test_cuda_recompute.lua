-- tests/test_cuda_recompute.lua: activation recompute (recompute = "none" | "block" | "selective",
-- lua/nvlua/llama.lua's header) on the CUDA backend, where the paths differ from the CPU's: delayed
-- scaling keeps its amax history on the device (the tape holds the device amax it chose), RMSNorm and
-- SwiGLU note their outputs' amax in the pass that writes them (recipe.note_amax; a replay notes them
-- again, a selective recompute not at all), x's fprop and wgrad copies come from one fused pass where
-- they pair (selective: never, the wgrad copy is made from the recomputed input in the backward), and
-- dgrad's weight copy is a re-quantization.
--   * every registered recipe and recompute_cases.lua's SR-on-x variant: a 2-block model, one step of
--     2 micro-batches (delayed scaling's history then holds the first micro-batch's amaxes when the
--     second is recomputed) on the device under each mode: losses, gradients, parameters, recipe
--     state, nv.stats, MoR's counts, the weight cache's size, the reducer's calls identical, bit for
--     bit (the comparison is between modes on the device, not with the CPU);
--   * device memory: what a training forward keeps, none - block = L*N*(A - ab*C) and none - selective =
--     L*N*ab*(2C + F) (recompute_cases.per_token), exactly;
--   * the emulator's counters: a training step under block or selective makes no host synchronisation,
--     as under none (test_cuda_emu_counters.lua's step).
-- Every case needs a GPU or the emulator (scripts/test.sh --emu test_cuda_recompute) and skips without.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local llama = require "nvlua.llama"
local recipe = require "nvlua.recipe"
local optim = require "nvlua.optim"

local R = dofile("tests/recompute_cases.lua")

T.case("every recipe on the device: losses, gradients, parameters and recipe state identical under each mode", function()
  T.need_gpu()
  -- the registered recipes, and SR on a forward operand (the replay's generator offsets on the device)
  local names = {["custom: SR on x, delayed nvfp4 weights, reducer, SR shard 0 of 2"] = true}
  for _, n in ipairs(recipe.names()) do names[n] = true end
  R.check_all({device = "cuda", steps = 1, micro = 2, variants = names})
end)

T.case("device memory: a training forward keeps L*N*(A - ab*C) less under block, L*N*ab*(2C + F) less under selective", function()
  T.need_gpu()
  local cfg = {vocab_size = 64, hidden_size = 64, intermediate_size = 256, num_hidden_layers = 3, num_attention_heads = 4,
    num_key_value_heads = 2, max_position_embeddings = 64}
  local B, L = 1, cfg.num_hidden_layers
  local N = B * cfg.max_position_embeddings
  for _, rname in ipairs({"bf16", "nvfp4"}) do
    local kept = {}
    for _, mode in ipairs(R.MODES) do kept[mode] = R.memory(rname, mode, cfg, B, "cuda") end
    if rname == "bf16" then
      local _, block_saves, selective_saves = R.per_token(cfg, 2)
      T.eq(kept.none - kept.block, L * N * block_saves, "bf16: recompute=block")
      T.eq(kept.none - kept.selective, L * N * selective_saves, "bf16: recompute=selective")
    else -- nvfp4 keeps quantized wgrad copies where bf16 keeps activations: less, whatever the mode
      T.ok(kept.block < kept.selective and kept.selective < kept.none, string.format("nvfp4: kept %d < %d < %d",
        kept.block, kept.selective, kept.none))
    end
  end
end)

T.case("a training step under block or selective makes no host synchronisation (bf16, fp8_delayed, nvfp4)", function()
  T.need_emu()
  local cfg = {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
    num_key_value_heads = 2, max_position_embeddings = 32}
  for _, rname in ipairs({"bf16", "fp8_delayed", "nvfp4"}) do
    for _, mode in ipairs(R.MODES) do
      local model = llama.Llama(cfg, {seed = 1, recipe = recipe.make(rname), recompute = mode}):to("cuda")
      local opt = optim.AdamW(model:named_parameters(), {lr = 1e-3})
      local gen = nv.Generator(5)
      local syncs
      T.with(core.cuda_set_sync, false, function()
        for _ = 1, 2 do -- the second step: histories and caches in their steady state
          local x = (nv.rand(1, 32, {generator = gen}) * 63):to("i64")
          local y = (nv.rand(1, 32, {generator = gen}) * 63):to("i64")
          local s0 = core.cuda_emu_counters().host_syncs
          local d = model:forward_backward(x, y, {defer_loss = true})
          opt:step()
          model:zero_grad()
          syncs = core.cuda_emu_counters().host_syncs - s0
          local loss = llama.loss_value(d)
          T.ok(loss > 3 and loss < 5, rname .. " " .. mode .. ": a loss near ln 64 = 4.16 at init, got " .. loss)
        end
      end)
      T.eq(syncs, 0, rname .. ", recompute=" .. mode .. ": host syncs in the step")
    end
  end
end)
