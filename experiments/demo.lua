-- experiments/demo.lua: the default job until the training workflow lands (issue 5 replaces it).
-- Multiplies random matrices in f32 and in bf16 and reports how far bf16 strays from f32, per
-- size, with the memory nvlua holds. Run: build/nvlua experiments/demo.lua [seed]
local nv = require "nvlua"

local seed = tonumber(arg and arg[1]) or 1234
nv.manual_seed(seed)
print(string.format("nvlua %s demo: bf16 vs f32 matmul (seed %d)", nv.version, seed))
print(string.format("%6s %6s %6s  %12s  %12s  %10s", "M", "K", "N", "rel RMS err", "max |err|", "ms (f32)"))
for _, s in ipairs({{64, 64, 64}, {256, 512, 128}, {512, 1024, 512}, {1024, 1024, 1024}}) do
  local M, K, N = s[1], s[2], s[3]
  local a, b = nv.randn(M, K), nv.randn(K, N)
  local t0 = nv.clock()
  local c32 = a:matmul(b)
  local ms = (nv.clock() - t0) * 1000
  local c16 <close> = a:bf16():matmul(b:bf16()):float()
  local diff <close> = c16 - c32
  local rel = math.sqrt((diff * diff):sum() / (c32 * c32):sum())
  print(string.format("%6d %6d %6d  %12.3e  %12.3e  %10.2f", M, K, N, rel, diff:abs():max(), ms))
  a:free(); b:free(); c32:free()
end
collectgarbage()
print(string.format("live CPU memory after the run: %d bytes", nv.memory().cpu))
