-- nvlua.plan: what a Llama configuration costs before it is built — parameter counts, training
-- FLOPs per token, and memory per component under a recipe — for experiments' `plan=true` and
-- to check a run's measured peak against.
--
-- The memory model follows what nvlua allocates on the CPU (all f32 unless said):
--   weights      4 bytes/param (the fp32 master weights are the model's weights)
--   grads        4 bytes/param (one flat buffer)
--   optimizer    8 bytes/param (AdamW m and v)
--   activations  what forward saves for backward, per token and block: the block input, the
--                two norm outputs and the residual (4C), RoPE'd q and k (C + kvC), v (kvC), the
--                attention output (C), its log-sum-exp (Hq), two rstd values, SwiGLU's gate, up
--                and product (3F); after the blocks the final norm (C); plus, while the loss is
--                computed, the logits and their gradient (2V) of min(tokens, 2^27 / V) tokens
--                (the LM head runs in chunks where recipe:head_chunkable) or of every token.
--                Not modelled: where fprop and wgrad pair (fp8, mxfp8), a linear keeps its input
--                quantized (1 byte) instead of in act_dtype: the estimate is then an upper bound
--   weight copies the quantized weights each Linear keeps from fprop for dgrad (formats whose
--                transposed quantization is exact: 2D nvfp4 0.5625 B/param, fp8 1, bf16 2)
--   transient    at the LM head's backward its weight copy is transposed (one more copy), plus
--                the GEMM's chunked decode scratch (<= 16 MB, plus one decoded activation)
local formats = require "nvlua.formats"

local plan = {}

local function cfg_of(c)
  local hd = c.head_dim or c.hidden_size // c.num_attention_heads
  return c, hd
end

--- Parameter counts: {embed, attn, mlp, norms, block, blocks, final_norm, lm_head, total}
function plan.params(c)
  local _, hd = cfg_of(c)
  local C, L = c.hidden_size, c.num_hidden_layers
  local p = {}
  p.embed = c.vocab_size * C
  p.attn = C * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
  p.mlp = 3 * C * c.intermediate_size
  p.norms = 2 * C
  p.block = p.attn + p.mlp + p.norms
  p.blocks = L * p.block
  p.final_norm = C
  p.lm_head = c.tie_word_embeddings and 0 or c.vocab_size * C
  p.total = p.embed + p.blocks + p.final_norm + p.lm_head
  return p
end

--- Training FLOPs per token (forward + backward): 6 per GEMM parameter plus attention's
-- QKᵀ and PV over the full T x T square (12·L·T·hd·Hq).
function plan.flops_per_token(c, T)
  local _, hd = cfg_of(c)
  local p = plan.params(c)
  return 6 * (p.blocks - c.num_hidden_layers * p.norms + c.vocab_size * c.hidden_size)
    + 12 * c.num_hidden_layers * T * hd * c.num_attention_heads
end

--- The model's linear layers as recipe:plan wants them, without building the model.
function plan.linears(c)
  local out = {}
  for b = 0, c.num_hidden_layers - 1 do
    for _, n in ipairs({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) do
      out[#out + 1] = {name = string.format("model.layers.%d.%s", b, n), block = b, high_precision = false}
    end
  end
  out[#out + 1] = {name = "lm_head", block = nil, high_precision = true}
  return out
end

-- bytes per parameter of the fprop weight copy kept for dgrad, by the recipe's spec: formats
-- whose transposed quantization is exact keep it (2-D tiles, per-tensor fp8, bf16); f32 runs as a
-- plain matmul and 1x16 / 1x32 blocks are re-quantized for dgrad, so they keep nothing.
local function copy_bytes(spec)
  local ft = formats.traits[spec.format]
  if ft.block2d then return spec.block == "2d" and ft.bits / 8 or 0 end
  if ft.scale == "fp32" or spec.format == "bf16" then return ft.bits / 8 end
  return 0
end

local function linear_params(c, l)
  local _, hd = cfg_of(c)
  local C, F = c.hidden_size, c.intermediate_size
  local n = l.name
  if n == "lm_head" then return c.vocab_size * C end
  if n:match("q_proj") or n:match("o_proj") then return C * hd * c.num_attention_heads end
  if n:match("k_proj") or n:match("v_proj") then return C * hd * c.num_key_value_heads end
  return C * F
end

--- Memory in bytes per component for training with batch B and sequence T under recipe r
-- (a recipe object): {weights, grads, optimizer, activations, weight_copies, transient, total}
function plan.memory(c, r, B, T)
  local _, hd = cfg_of(c)
  local p = plan.params(c)
  local C, L, F, V = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
  local kvC = hd * c.num_key_value_heads
  local N = B * T
  local m = {weights = 4 * p.total, grads = 4 * p.total, optimizer = 8 * p.total}
  -- saved per token and block: activations in the recipe's act_dtype (bf16: 2 bytes), the
  -- statistics (attention lse per head, two RMSNorm rstd) in f32; logits and their gradient f32
  local ab = r.act_dtype == "bf16" and 2 or 4
  local acts = 4 * C + (C + kvC) + kvC + C + 3 * F
  local stats = c.num_attention_heads + 2
  local head = {name = "lm_head", num_blocks = L, high_precision = true, step = 0}
  local chunk = r:head_chunkable(head) and math.max(1, require("nvlua.recipe").LOSS_CHUNK_ELEMS // V) or N
  m.activations = N * (ab * (L * acts + C + C) + 4 * L * stats) + math.min(N, chunk) * 4 * 2 * V
  -- the emulated GEMM's scratch: B decoded in chunks of at most 4M floats, A whole
  m.weight_copies, m.transient = 0, 4 * (math.min(2 ^ 22, V * C) + N * math.max(C, F))
  local biggest = 0
  for _, l in ipairs(plan.linears(c)) do
    local ctx = {name = l.name, block = l.block, num_blocks = L, high_precision = l.high_precision, step = 0}
    local g = r:gemm(ctx, "fprop")
    local b = copy_bytes(g.b) * linear_params(c, l)
    m.weight_copies = m.weight_copies + b
    if l.name == "lm_head" then biggest = b end
  end
  m.transient = m.transient + biggest
  m.total = m.weights + m.grads + m.optimizer + m.activations + m.weight_copies + m.transient
  return m
end

local function gib(b) return b / 2 ^ 30 end

--- Print counts, FLOPs and the memory table for each recipe name; returns the tables.
function plan.report(c, recipes, B, T, out)
  out = out or io.stdout
  local recipe = require "nvlua.recipe"
  local p = plan.params(c)
  out:write(string.format("parameters: %.3fB total = embedding %.3fB + %d blocks x %.1fM (attention %.1fM, MLP %.1fM)" ..
    " + LM head %.3fB\n", p.total / 1e9, p.embed / 1e9, c.num_hidden_layers, p.block / 1e6, p.attn / 1e6, p.mlp / 1e6,
    p.lm_head / 1e9))
  local f = plan.flops_per_token(c, T)
  out:write(string.format("training FLOPs per token at T=%d: %.2f GFLOP (6 x %.3fB GEMM parameters + attention %.2f GFLOP)\n",
    T, f / 1e9, (f - 12 * c.num_hidden_layers * T * (c.head_dim or c.hidden_size // c.num_attention_heads) *
      c.num_attention_heads) / 6e9, 12 * c.num_hidden_layers * T * (c.head_dim or c.hidden_size // c.num_attention_heads) *
      c.num_attention_heads / 1e9))
  out:write(string.format("memory (GiB) for batch %d x seq %d on the CPU backend (f32 master weights, grads, AdamW):\n", B, T))
  out:write(string.format("  %-10s %9s %9s %9s %11s %9s %9s %9s\n", "recipe", "weights", "grads", "adamw", "activations",
    "w copies", "transient", "total"))
  local rows = {}
  for _, name in ipairs(recipes) do
    local r = recipe[name]()
    local m = plan.memory(c, r, B, T)
    rows[name] = m
    out:write(string.format("  %-10s %9.2f %9.2f %9.2f %11.2f %9.2f %9.2f %9.2f\n", name, gib(m.weights), gib(m.grads),
      gib(m.optimizer), gib(m.activations), gib(m.weight_copies), gib(m.transient), gib(m.total)))
  end
  return rows
end

return plan
