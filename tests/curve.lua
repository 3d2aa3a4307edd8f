-- tests/curve.lua: the 2-layer model and data of test_cuda_train.lua's loss-curve cases, shared with
-- scripts/curve_noise.lua (which measures how far two CPU runs that differ only in rounding drift
-- apart, the noise floor those cases' bounds come from). Not a test file: loaded with dofile.
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local recipe = require "nvlua.recipe"

local M = {}

-- batch `step` of B sequences of T+1 tokens: a walk t' = (5t + 3 + noise) mod 64 (noise 0 or 1,
-- from an LCG), so the next token is predictable to about 1 bit: the loss can fall from ln 64
function M.batch(step, B, T)
  local s, rows = 1234567 + step * 7919, {}
  for b = 1, B do
    s = (s * 1103515245 + 12345) % 2147483648
    local t, row = s % 64, {}
    for i = 1, T + 1 do
      row[i] = t
      s = (s * 1103515245 + 12345) % 2147483648
      t = (5 * t + 3 + (s >> 16) % 2) % 64
    end
    rows[b] = row
  end
  local ids = nv.tensor(rows, "i64")
  local x, y = ids:narrow(2, 1, T):contiguous(), ids:narrow(2, 2, T):contiguous()
  ids:free()
  return x, y
end

-- the losses of n training steps of the 2-layer model on device dev under recipe rname.
-- opts.nudge = k: multiply every initial weight by 1 + k 2^-23 (k = +-1: at most one f32 ulp each), a
-- perturbation the size of one rounding, for measuring how rounding differences grow. opts.cfg: another
-- model config (test_cuda_cudnn.lua: head dim 64).
function M.losses(dev, rname, n, opts)
  opts = opts or {}
  local cfg = opts.cfg or {vocab_size = 64, hidden_size = 128, intermediate_size = 256, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64}
  local m = llama.Llama(cfg, {seed = 7, recipe = recipe[rname]()})
  if opts.nudge then
    for _, p in ipairs(m:named_parameters()) do p.param:mul_(1 + opts.nudge * 2 ^ -23) end
  end
  if dev == "cuda" then m:to("cuda") end
  local opt = optim.AdamW(m:named_parameters(), {lr = 3e-3, betas = {0.9, 0.95}, weight_decay = 0.1})
  local out = {}
  for step = 1, n do
    m.step = step
    m:zero_grad()
    local x, y = M.batch(step, 4, 32) -- the same batches on every device (ids on the cpu either way)
    out[step] = m:forward_backward(x, y)
    x:free(); y:free()
    optim.clip_grad_norm(m:named_parameters(), 1.0)
    opt:step()
  end
  return out
end

return M
