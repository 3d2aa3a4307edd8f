-- tests/test_cuda_fused_amax.lua: fused groups (recipe option fused_amax) on the CUDA backend, whose
-- paths differ from the CPU's: the group's amax is the device maximum of the parts' device amaxes
-- (core.quant_amax), given to the quantization as a device tensor; delayed scaling keeps the group's
-- history on the device (core.amax_history_step) and the round's chosen amax there. The checks are
-- tests/fused_amax_cases.lua's, run on "cuda":
--   * nvfp4 and fp8_cs: each part's fprop weight is bit for bit the rows of the host quantization of
--     the parts' concatenation (codes, values, amax); without the option its own weight's;
--   * fp8_delayed: one device history per group, pushed once per forward with the group's amax; the
--     parts use the amax it chose; no per-part weight history;
--   * recompute block and selective equal none (the tape holds the round's device amax per part);
--   * a training step under fused_amax makes no host synchronisation (the emulator's counters).
-- Every case needs a GPU or the emulator (scripts/test.sh --emu test_cuda_fused_amax) and skips without.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"

local C = dofile("tests/fused_amax_cases.lua")

T.case("nvfp4 fused_amax on the device: each part's weight is the rows of the concatenation's quantization", function()
  T.need_gpu()
  C.check_groups("nvfp4", "nvfp4", "cuda")
end)

T.case("fp8_cs fused_amax on the device: each part's e4m3 weight and scale are the concatenation's", function()
  T.need_gpu()
  C.check_groups("fp8_cs", "e4m3", "cuda")
end)

T.case("fp8_delayed fused_amax on the device: one device history per group, pushed once per forward", function()
  T.need_gpu()
  C.check_delayed("cuda")
end)

T.case("recompute block and selective under fused_amax on the device: the same as none", function()
  T.need_gpu()
  C.check_recompute({device = "cuda", steps = 2, micro = 2})
end)

T.case("a training step under fused_amax makes no host synchronisation (nvfp4, fp8_cs, fp8_delayed)", function()
  T.need_emu()
  for _, v in ipairs(C.VARIANTS) do
    local model = llama.Llama(C.CFG, {seed = 1, recipe = v[2]()}):to("cuda")
    local opt = optim.AdamW(model:named_parameters(), {lr = 1e-3})
    local syncs
    T.with(core.cuda_set_sync, false, function()
      for s = 1, 2 do -- the second step: the histories and rounds in their steady state
        local x, y = C.R.batch(s, 1, C.CFG.max_position_embeddings, C.CFG.vocab_size)
        local s0 = core.cuda_emu_counters().host_syncs
        local d = model:forward_backward(x, y, {defer_loss = true})
        opt:step()
        model:zero_grad()
        syncs = core.cuda_emu_counters().host_syncs - s0
        local loss = llama.loss_value(d)
        T.ok(loss > 3 and loss < 5, v[1] .. ": a loss near ln 64 = 4.16 at init, got " .. loss)
      end
    end)
    T.eq(syncs, 0, v[1] .. ": host syncs in the step")
  end
end)
