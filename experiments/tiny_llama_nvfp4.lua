-- experiments/tiny_llama_nvfp4.lua: the main job. A ~10M-parameter Llama 3-style model (GQA,
-- RoPE, SwiGLU, RMSNorm) trained on the King James Bible (byte tokens) with the paper's NVFP4
-- recipe — 2D 16x16 weight blocks, random Hadamard transforms on the Wgrad inputs, stochastic
-- rounding of gradients, the last quarter of the blocks in bf16 — on the CPU in a few minutes.
-- Prints the log, the final validation loss, a sample, and where the plot and checkpoint went.
--   nvlua experiments/tiny_llama_nvfp4.lua [key=value ...]     (e.g. steps=400 recipe=bf16)
local train = require "nvlua.train"

train.main({
  out = "runs/tiny_llama_nvfp4", data = "kjv", recipe = "nvfp4",
  layers = 6, hidden = 384, heads = 6, kv_heads = 2, ffn = 1024, seq = 128, rope_theta = 10000.0,
  batch = 8, steps = 400, lr = 3e-3, min_lr = 3e-4, warmup = 40, schedule = "wsd", decay = 0.25,
  eval_every = 50, eval_batches = 4, log_every = 10, sample_tokens = 200,
}, arg)
