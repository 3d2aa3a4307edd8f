-- test_gam_fast.lua: the fast CPU kernel of GAM scaling (kernels/cpu/quant_cpu.c nvl_gam_quantize_cpu,
-- the CPU table's gam_quantize) through core.gam_quantize, against the scalar reference (the same
-- call under nv.use_reference(true)): codes, E8M0 bytes, group mantissas and the non-finite flag equal
-- bit for bit on every case of tests/gam_cases.lua (test_gam_ref.c's cases, its random generator,
-- tensors over the OpenMP thresholds); the outputs' shapes and dtypes; the argument errors.
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core
local C = dofile("tests/gam_cases.lua")

T.case("the CPU kernel equals the reference, every case, e4m3 and e5m2", function()
  C.check(C.cases(true), core.gam_quantize, function(x) return x end)
end)

T.case("outputs: u8 codes [R, K], u8 E8M0 bytes [R, K/B], f32 mantissas [groups]; the hand case's values", function()
  local x = C.tensor(C.hand, 2, 12)
  local c, s, m = core.gam_quantize(x, 4, 3, "e4m3")
  T.eq({c:dtype(), s:dtype(), m:dtype()}, {"u8", "u8", "f32"})
  T.eq(c:size(), {2, 12})
  T.eq(s:size(), {2, 3})
  T.eq(m:size(), {2})
  -- test_gam_ref.c gam_hand_cases: e_b 7, 7, 7 | 9, 127, 127 (the second group's max is 0.75, so its
  -- m_g = m(448 / 0.75) = 7/6 too, and 0.75's e_b = 9); m_g = fl(7/6)
  T.eq(s:totable(), {{120, 120, 120}, {118, 0, 0}})
  local m76 = string.unpack("f", string.pack("f", 7 / 6))
  T.eq(m:totable(), {m76, m76})
  T.eq(c:totable()[1][1], 0x7E) -- 3 (7/6) 2^7 -> 448
end)

T.case("argument errors", function()
  local x = nv.zeros(2, 32)
  T.raises(function() core.gam_quantize(x, 32, "tensor", "e2m1") end, "invalid option 'e2m1'")
  T.raises(function() core.gam_quantize(x, 24, "tensor", "e4m3") end, "block 24 must divide the last dim")
  T.raises(function() core.gam_quantize(x, 8, 3, "e4m3") end, "8 blocks of 1x8 do not split into groups of 3 blocks")
  T.raises(function() core.gam_quantize(x, 8, 0, "e4m3") end, "positive block count")
  T.raises(function() core.gam_quantize(x, 8, "all", "e4m3") end, "group must be \"tensor\"")
  T.raises(function() core.gam_quantize(x:to("bf16"), 8, 1, "e4m3") end, "x must be a 2-D f32 tensor")
  T.raises(function() core.gam_quantize(nv.zeros(64), 8, 1, "e4m3") end, "x must be a 2-D f32 tensor")
  local c, s, m = core.gam_quantize(nv.zeros(0, 32), 32, "tensor", "e4m3")
  T.eq({c:numel(), s:numel(), m:numel()}, {0, 0, 0})
end)
