-- test_cuda_mor.lua: MoR (lua/nvlua/mor.lua) on the CUDA backend: the measuring (the candidates'
-- round trips through q:dequantize{on_device = true}, kernels/cuda/gemm.cu dequant_scaled_kernel),
-- the decisions, the mixed-representation operand and its GEMM on the device.
--   * the hand-computed cases of tests/mor_cases.lua: the same choices, the same mixed values and the
--     exact product, bit for bit, as on the CPU (test_mor.lua);
--   * the device's dequantize equals the CPU's bit for bit for every format;
--   * random operands: the device's errors, choices and operands equal the CPU's bit for bit (the
--     round trips are the same bits, core.block_sqerr sums each block in double in index order on
--     every backend, and the errors and the decision are computed on the host from those sums);
--   * GAM (scale = "gam"): one group (a bf16 operand with its factor), every block one fp8 format (the
--     MXFP8 operand: codes and E8M0 bytes too), groups of blocks (f32): the same bits as the CPU;
--   * a Llama step under MoR (tiered per block, and mor_paper's GAM at block 32): step 1's loss within 0.5% of the CPU's (test_cuda_train.lua's bound:
--     one bf16 ulp of a GEMM output) with the same representation counts in the first layer.
-- Run under the CPU emulation of CUDA (scripts/test.sh --emu), not on a GPU so far.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local mor = require "nvlua.mor"
local recipe = require "nvlua.recipe"
local llama = require "nvlua.llama"

local C = dofile("tests/mor_cases.lua")

local same_values, tbl = C.same_values, C.tbl

T.case("dequantize on the device equals the CPU's, every format", function()
  T.need_gpu()
  nv.manual_seed(2)
  local x = nv.randn(32, 256) * 3
  for _, f in ipairs({"f32", "bf16", "e4m3", "e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4", "mxfp4"}) do
    for _, axis in ipairs({1, 2}) do
      local want = nv.quantize(x, f, {axis = axis}):dequantize()
      local got = nv.quantize(x:cuda(), f, {axis = axis}):dequantize({on_device = true})
      T.eq(got:device(), "cuda")
      same_values(tbl(got), want:totable(), f .. " along " .. axis)
    end
  end
  local q = nv.quantize(x:cuda(), "nvfp4", {block = "2d"})
  same_values(tbl(q:dequantize({on_device = true})), nv.quantize(x, "nvfp4", {block = "2d"}):dequantize():totable(), "nvfp4 16x16")
  T.raises(function() q:dequantize({device = true}) end, "unknown option 'device'")
end)

T.case("the hand-computed cases on the device: choices, mixed values, the exact GEMM", function()
  T.need_gpu()
  local a, b = nv.tensor(C.A()):cuda(), nv.tensor(C.Bm()):cuda()
  local ra = mor.choose(a, {granularity = "block"})
  local rb = mor.choose(b, {granularity = "block"})
  local wa, wb = C.expected_choice(C.A_KINDS, 0.04), C.expected_choice(C.B_KINDS, 0.04)
  same_values(tbl(ra.choice), wa, "A's choices")
  same_values(tbl(rb.choice), wb, "B's choices")
  T.eq(ra.q:device(), "cuda")
  same_values(tbl(ra.q:dequantize({on_device = true})), C.mixed(C.A(), wa), "A's mixed values")
  local y = nv.qmatmul(ra.q, rb.q)
  T.eq(y:device(), "cuda")
  same_values(tbl(y), C.product(C.mixed(C.A(), wa), C.mixed(C.Bm(), wb)), "the mixed GEMM")
  local rt = mor.choose(a, {threshold = 0.04})
  T.eq(rt.label, "e4m3", "per tensor")
end)

T.case("random operands: the device chooses as the CPU does, per tensor and per block, tiered", function()
  T.need_gpu()
  nv.manual_seed(8)
  local x = nv.randn(128, 512) * nv.randn(128, 1):exp()
  x:narrow(1, 3, 1):narrow(2, 129, 128):mul_(2.0 ^ -14)
  local gam = {granularity = "block", candidates = {"e4m3", "e5m2"}, scale = "gam"}
  for _, o in ipairs({{granularity = "block"}, {granularity = "block", candidates = {"nvfp4", "e4m3"}},
                      {candidates = {"nvfp4", "e4m3"}}, {},
                      gam, -- GAM, one group: a bf16 operand with 1 / m_g as its factor
                      {granularity = "block", candidates = {"e4m3", "e5m2"}, scale = "gam", group = 4}, -- f32 operand
                      {granularity = "block", block = 32, candidates = {"e4m3"}, scale = "gam", threshold = math.huge}, -- MX
                      {granularity = "block", candidates = {"e5m2"}, scale = "gam", threshold = math.huge}}) do
    for _, axis in ipairs({1, 2}) do
      o.axis = axis
      local rc, rd = mor.choose(x, o), mor.choose(x:cuda(), o)
      local what = string.format("%s %s%s axis %d", o.granularity or "tensor", o.candidates and table.concat(o.candidates, ">")
        or "e4m3", o.scale and " gam group " .. tostring(o.group or "tensor") or "", axis)
      same_values(tbl(rd.choice), tbl(rc.choice), what .. ": choices")
      for i = 1, #rc.errs do
        local ec, ed = tbl(rc.errs[i]), tbl(rd.errs[i])
        same_values(ed, ec, what .. ": errors")
      end
      same_values(tbl(rd.q:dequantize({on_device = true})), rc.q:dequantize():totable(), what .. ": the operand")
      T.eq(rd.q:format(), rc.q:format(), what .. ": the operand's format")
      T.eq(rd.q:factor(), rc.q:factor(), what .. ": its factor")
      if rc.q:format():match("^mxfp8") then
        T.eq(tbl(rd.q:scale_bytes()), rc.q:scale_bytes():totable(), what .. ": E8M0 bytes")
        T.eq(tbl(rd.q:codes()), rc.q:codes():totable(), what .. ": codes")
        -- its GEMM on the device (the MXFP8 path: native on sm_100, else the exact bf16 emulation) is
        -- the exact product of the decoded values, as the CPU's, within fp32 summation:
        -- |out - cpu| <= 2 (K + 3) 2^-24 sum_k |a b| alpha
        local od, oc = nv.qmatmul(rd.q, rd.q):cpu(), nv.qmatmul(rc.q, rc.q)
        local u = rc.q:dequantize():abs()
        local bound = (u:matmul(u:t()) * (2 * (rc.q:size(2) + 3) * 2.0 ^ -24)):totable()
        local dt, ct = od:totable(), oc:totable()
        for m = 1, #ct, 17 do
          for n = 1, #ct[1], 13 do
            T.near(dt[m][n], ct[m][n], bound[m][n] + 1e-30, string.format("%s: GEMM out[%d][%d]", what, m, n))
          end
        end
        if axis == 2 then print("    MoR GAM MX operand's GEMM path on this device: " .. table.concat({core.cuda_gemm_path(
          rc.q:format(), rc.q:format())}, ", ")) end
      end
    end
  end
end)

T.case("a Llama step under MoR on the device: the loss and the first layer's choices as on the CPU", function()
  T.need_gpu()
  local cfg = {vocab_size = 64, hidden_size = 128, intermediate_size = 256, num_hidden_layers = 2, num_attention_heads = 4,
    num_key_value_heads = 2, max_position_embeddings = 64}
  nv.manual_seed(3)
  local ids, tg = (nv.rand(2, 64) * 63):to("i64"), (nv.rand(2, 64) * 63):to("i64")
  for _, make in ipairs({function() return recipe.mor({granularity = "block", block = 32, candidates = {"nvfp4", "e4m3"}}) end,
                        -- mor_paper's settings at the MX block length (k_proj's 64 outputs are no 128-multiple)
                        function() return recipe.mor({granularity = "block", block = 32, candidates = {"e4m3", "e5m2"},
                          scale = "gam"}) end}) do
    local out = {}
    local what
    for _, dev in ipairs({"cpu", "cuda"}) do
      local rec = make()
      what = rec.mor:describe()
      local m = llama.Llama(cfg, {recipe = rec, seed = 4})
      if dev == "cuda" then m:to("cuda") end
      local loss = m:forward_backward(dev == "cuda" and ids:cuda() or ids, dev == "cuda" and tg:cuda() or tg)
      out[dev] = {loss = type(loss) == "number" and loss or llama.loss_value(loss), counts = rec.mor:take_step()}
    end
    T.near(out.cuda.loss, out.cpu.loss, 5e-3 * out.cpu.loss, what .. ": step 1's loss")
    local k = "model.layers.0.self_attn.q_proj|fprop|w" -- the same weights on both: the same choices
    T.eq(out.cuda.counts[k].units, out.cpu.counts[k].units, what .. ": " .. k)
    local n = 0
    for key in pairs(out.cpu.counts) do n = n + 1; T.ok(out.cuda.counts[key], "counted on the device too: " .. key) end
    T.eq(n, 2 * 7 * 6)
  end
end)
