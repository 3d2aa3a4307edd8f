-- nvlua.plan: what a Llama configuration costs before it is built — parameter counts, training
-- FLOPs per token, the memory of one rank (GPU or CPU process) per component under a recipe, the
-- bytes each rank sends per step, and the smallest sharding / recompute setting that fits a memory
-- — for experiments' `plan=true`, train.check_memory, and to check a run's measured peak against.
--
-- plan.memory(c, r, B, T [, opts]) models what nvlua allocates on one rank of `gpus` (batch B of
-- sequence T per rank) with shard = none | optimizer | grads | full (ZeRO-0/1/2/3) and recompute =
-- none | block | selective. The peak is the largest of the step's phases — the cross-entropy and the
-- LM head's backward (every activation saved), each block's backward at its MLP (the activations of
-- the blocks below it, the working set of this one), the embedding's backward (every weight copy
-- made), and with shard=full the embedding's forward (its f32 weight gathered) — and the columns are
-- that phase's (m.phases lists them all):
--   weights     fp32 master weights: 4 bytes/param; "full": this rank's rows only (below)
--   grads       fp32 gradients: 4 bytes/param (one flat buffer); "optimizer": + the reduce-scattered
--               shard ShardedAdamW keeps (4 P/N; issue 30's 4P + 4P + 8P/N omits it); "grads" and
--               "full": this rank's rows, plus the whole (padded) gradients of the unit being
--               back-propagated and (overlap_reduce) of the one whose reduce-scatter is in flight
--   adamw       m and v: 8 bytes/param; sharded (optimizer, grads, full): this rank's rows / shard
--   activations what the forward saves for the backward, per token and block in the recipe's
--               act_dtype (bf16: 2 bytes) unless said: the block input and the residual (2C), the
--               two norms' f32 rstd, RoPE'd q and k and v (Hq·D + 2 kvC), the attention output
--               (Hq·D) and its f32 log-sum-exp (Hq), SwiGLU's gate and up (2F), and each linear's
--               input where its backward reads it: the first norm's output (C, for q/k/v), the
--               second's (C, gate/up), SwiGLU's product (F, down). Where the recipe quantizes a
--               linear's input for fprop and wgrad in one pass (recipe:_pairable: fp8, mxfp8, nvfp4;
--               never under data parallelism, whose global amax forbids it) the input's wgrad copy
--               (its format's bits) is kept instead, and o_proj keeps one of the attention output.
--               recompute=block keeps only each block's input (C) and, in the block being
--               back-propagated, all of them again; selective drops the two norm outputs and
--               SwiGLU's product (the three linear inputs above) and remakes one block's. At the
--               loss: the last block's output (C), the final norm's output and its gradient (2C),
--               and a chunk of min(tokens, 2^27 / V) tokens' logits (every token where the head is
--               not chunkable): at the cross-entropy the logits, their f32 gradient and, bf16
--               logits, their f32 widening (10 bytes a logit; f32: 8); in the head's backward their
--               gradient (in the logits' place), its wgrad copy and the chunk's input gradient. In a
--               block's backward, its working
--               set: the incoming gradient (C), SwiGLU's input gradients and down_proj's (3F, less
--               the freed product F), and the quantized copies of the widest gradient (F).
--   w copies    the quantized (or bf16) weight copies the GEMMs read. The weight cache
--               (recipe.weight_cache) keeps, for the whole optimizer step, each weight's fprop copy
--               and, from its backward on, its dgrad copy: a second allocation on the CPU and on
--               CUDA alike (measured: 2 copies for bf16, fp8_cs, mxfp8, nvfp4, mxfp4); so the loss
--               phase holds every fprop copy, the embedding's backward every copy of both kinds
--               (with grad_accum > 1 every phase does). Copies that may not be cached (delayed
--               scaling, SR) live from the forward to the layer's backward where dgrad reuses them.
--               "full": the gathered weights in the form the forward reads (quantized where the
--               recipe quantizes the weight: nvfp4 0.5625 B/param, fp8 1, mxfp8 1.03, bf16 2; f32
--               for norms and the embedding) of the unit in use and (prefetch) the prefetched
--               one; in a unit's backward also its dgrad copy; reshard_after_forward=false keeps
--               every block's gathered weights from its forward to its backward. gather="f32" (what
--               nvlua.shard gathers until the quantized all-gather is wired) gathers f32 and the
--               unit's copies are made from it.
--   transient   scratch of the phase's largest operation. CPU: the emulated GEMM's decode (B in
--               chunks of 4M floats, A whole: tokens x max(C, F) floats), or where every GEMM is a
--               plain f32 one (recipe f32) the product of the widest wgrad. CUDA: the cuBLASLt
--               workspace (32 MiB) plus the larger of an emulated GEMM's bf16 operand copies (on
--               Hopper every GEMM with nvfp4 / mx operands is emulated: 2 bytes x (M·K + N·K)) and
--               the attention backward's f32 dq accumulator and row sums (cuDNN); plus an allowance of
--               1 GiB for what lives outside nvlua's allocator (CUDA context, cuBLASLt / cuDNN
--               handles, NCCL buffers): an allowance, not a measurement.
-- Units and shards follow nvlua.shard: the embedding, each block, and the final norm with the LM
-- head; every parameter is cut along its rows into gpus ranges of chunk = ceil(ceil(rows / N) /
-- align) * align rows (align 16 for 2-D weights, 1 for norm weights), the ranks' shards padded to
-- chunk rows; the per-rank numbers are rank 0's, which holds a full chunk of every parameter.
--
-- plan.comm(c, r, B, T, opts): the bytes each rank sends per optimizer step (ring algorithms: a rank
-- sends (N-1)/N of what is gathered or reduce-scattered, twice that for an all-reduce).
-- plan.fit(c, r, B, T, {gpus, gpu_memory, ...}): the first of plan.ORDER that fits.
-- Not modelled: a distillation teacher; the forward's own phases (below the loss's: its activations
-- only grow); host memory of checkpoints (ckpt_background's staging copy); memory MPI allocates
-- inside its collectives; cuDNN's deterministic backward workspace (B·Hq·T·T·2 bytes); Blackwell's
-- native block-scaled GEMMs (no operand copies); tied embeddings under shard=grads|full (refused, as
-- nvlua.shard refuses them).
local formats = require "nvlua.formats"
local util = require "nvlua.util"
local user_error = util.user_error

local plan = {}

local GiB = 2 ^ 30

local function cfg_of(c)
  local hd = c.head_dim or c.hidden_size // c.num_attention_heads
  return c, hd
end

--- Llama 3 8B and 70B (Hugging Face config keys), for plans and the benchmark table.
plan.configs = {
  llama3_8b = {vocab_size = 128256, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = 32,
    num_attention_heads = 32, num_key_value_heads = 8, rope_theta = 500000.0, rms_norm_eps = 1e-5,
    max_position_embeddings = 8192, tie_word_embeddings = false},
  llama3_70b = {vocab_size = 128256, hidden_size = 8192, intermediate_size = 28672, num_hidden_layers = 80,
    num_attention_heads = 64, num_key_value_heads = 8, rope_theta = 500000.0, rms_norm_eps = 1e-5,
    max_position_embeddings = 8192, tie_word_embeddings = false},
}

--- The values of the shard and recompute keys, in order of cost.
plan.SHARDS = {"none", "optimizer", "grads", "full"}
plan.RECOMPUTES = {"none", "selective", "block"}

--- plan.ORDER: the configurations plan.fit tries, cheapest first. Sharding comes before recompute:
-- "optimizer" and "grads" send the bytes of plain data parallelism's all-reduce (a reduce-scatter
-- and an all-gather), "full" about as many (its weight gathers, twice a step in the compute's form,
-- replace the all-gather of f32 weights: as many bytes in bf16, fewer quantized; plan.comm) but in
-- one collective per unit on the way of every block's forward and backward, hidden only by
-- prefetching; recompute costs compute on every step whatever the interconnect ("selective" re-runs
-- the norms and SwiGLU, elementwise; "block" a second forward of every block, about a third more
-- FLOPs).
plan.ORDER = {}
for _, rc in ipairs(plan.RECOMPUTES) do
  for _, sh in ipairs(plan.SHARDS) do plan.ORDER[#plan.ORDER + 1] = {shard = sh, recompute = rc} end
end

--- plan.CUDA_OUTSIDE: bytes per GPU the plan allows for memory outside nvlua's allocator (the CUDA
-- context, cuBLASLt and cuDNN handles, NCCL's buffers): an allowance, not a measurement.
plan.CUDA_OUTSIDE = 1 * GiB
--- plan.CUBLASLT_WORKSPACE: the workspace every cuBLASLt GEMM takes (kernels/cuda/gemm.cu)
plan.CUBLASLT_WORKSPACE = 32 * 2 ^ 20

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

local LINEAR_NAMES = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
  "mlp.up_proj", "mlp.down_proj"}

--- The model's linear layers as recipe:plan wants them, without building the model.
function plan.linears(c)
  local out = {}
  for b = 0, c.num_hidden_layers - 1 do
    for _, n in ipairs(LINEAR_NAMES) do
      out[#out + 1] = {name = string.format("model.layers.%d.%s", b, n), block = b, high_precision = false}
    end
  end
  out[#out + 1] = {name = "lm_head", block = nil, high_precision = true}
  return out
end

-- ---- sizes and options ----------------------------------------------------------------------------

local UNITS = {B = 1, KB = 1e3, MB = 1e6, GB = 1e9, TB = 1e12, KIB = 2 ^ 10, MIB = 2 ^ 20, GIB = 2 ^ 30, TIB = 2 ^ 40}

--- plan.parse_bytes(v) -> bytes (an integer), or nil and what is wrong. v: a number of bytes, or
-- text: "80GB" (SI: 80e9 bytes), "80GiB" (80 x 2^30), "141GB", "79.6GiB", "85899345920"; the unit's
-- case is free, B alone means bytes. An H100 "80GB" has 79.6 GiB (81559 MiB) of memory.
function plan.parse_bytes(v)
  local n, unit
  if type(v) == "number" then
    n, unit = v, "B"
  elseif type(v) == "string" then
    local num, u = v:match("^%s*(%d+%.?%d*)%s*(%a*)%s*$")
    if not num then num, u = v:match("^%s*(%.%d+)%s*(%a*)%s*$") end
    n, unit = tonumber(num), u and (u == "" and "B" or u:upper())
  end
  if not n or not UNITS[unit] or n ~= n or n <= 0 or n == math.huge then
    return nil, "a size such as 80GB, 80GiB, 141GB or a number of bytes"
  end
  local bytes = math.floor(n * UNITS[unit] + 0.5)
  if bytes < 1 then return nil, "a size of at least one byte" end
  return math.tointeger(bytes) or bytes
end

--- plan.launcher() -> world, rank: the job's size and this process's rank as the launcher says
-- (Open MPI, MPICH / Hydra, PMI, Slurm), before any MPI call; 1, 0 without one.
function plan.launcher()
  local function env(names)
    for _, n in ipairs(names) do
      local v = math.tointeger(tonumber(os.getenv(n) or ""))
      if v then return v end
    end
  end
  local world = env({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) or 1
  local rank = env({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"}) or 0
  return math.max(world, 1), rank
end

local function one_of(list)
  return function(v)
    for _, x in ipairs(list) do if v == x then return nil end end
    return "must be one of " .. table.concat(list, ", ")
  end
end
local function is_count(v)
  if math.type(v) ~= "integer" or v < 1 then return "must be an integer >= 1" end
end
local function is_bool(v) if type(v) ~= "boolean" then return "must be true or false" end end

local OPTS = {gpus = is_count, shard = one_of(plan.SHARDS), recompute = one_of(plan.RECOMPUTES),
  reshard_after_forward = is_bool, device = one_of({"cpu", "cuda"}), grad_accum = is_count,
  gather = one_of({"quantized", "f32"}), prefetch = is_bool, overlap_reduce = is_bool}

-- opts of plan.memory / plan.comm, checked, with their defaults
local function options(opts, fname)
  opts = util.check_opts(opts, OPTS, fname)
  local o = {gpus = opts.gpus or 1, shard = opts.shard or "none", recompute = opts.recompute or "none",
    reshard_after_forward = opts.reshard_after_forward ~= false, device = opts.device or "cpu",
    grad_accum = opts.grad_accum or 1, gather = opts.gather or "quantized", prefetch = opts.prefetch ~= false,
    overlap_reduce = opts.overlap_reduce ~= false}
  return o
end

-- ---- parameters by unit, and their shards ---------------------------------------------------------

-- rows of each shard of a parameter with `rows` rows over N ranks (nvlua.shard.shard_rows's chunk)
local function chunk_rows(rows, N, align)
  local per = (rows + N - 1) // N
  return (per + align - 1) // align * align
end

-- The parameters of unit u ("embed", a block index 1..L, "head"): {name, rows, cols, align, linear}
local function unit_params(c, u)
  local _, hd = cfg_of(c)
  local C, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
  local qC, kvC = c.num_attention_heads * hd, c.num_key_value_heads * hd
  if u == "embed" then return {{name = "model.embed_tokens.weight", rows = V, cols = C, align = 16}} end
  if u == "head" then
    local l = {{name = "model.norm.weight", rows = C, cols = 1, align = 1}}
    if not c.tie_word_embeddings then l[2] = {name = "lm_head.weight", rows = V, cols = C, align = 16, linear = "lm_head"} end
    return l
  end
  local pre = string.format("model.layers.%d.", u - 1)
  local shapes = {{qC, C}, {kvC, C}, {kvC, C}, {C, qC}, {F, C}, {F, C}, {C, F}}
  local l = {}
  for i, n in ipairs(LINEAR_NAMES) do
    l[i] = {name = pre .. n .. ".weight", rows = shapes[i][1], cols = shapes[i][2], align = 16, linear = pre .. n}
  end
  l[8] = {name = pre .. "input_layernorm.weight", rows = C, cols = 1, align = 1}
  l[9] = {name = pre .. "post_attention_layernorm.weight", rows = C, cols = 1, align = 1}
  return l
end

-- {elements, shard (this rank's elements, padded), padded (N x shard)} of a unit under N ranks
local function unit_sizes(c, u, N)
  local n, s = 0, 0
  for _, p in ipairs(unit_params(c, u)) do
    n = n + p.rows * p.cols
    s = s + chunk_rows(p.rows, N, p.align) * p.cols
  end
  return {elements = n, shard = s, padded = s * N}
end

--- plan.check_world(c, gpus, shard): raises "config: gpus=N ..." when shard=grads|full would cut a
-- parameter of c into more ranges than it has rows (nvlua.shard refuses such a world too), or the
-- LM head is tied
function plan.check_world(c, gpus, shard)
  if shard ~= "grads" and shard ~= "full" then return end
  if c.tie_word_embeddings then
    user_error(string.format("config: shard=%s does not take a tied LM head (tie=true): give tie=false or " ..
      "shard=optimizer", shard), 0)
  end
  local worst
  for _, u in ipairs({"embed", 1, "head"}) do
    for _, p in ipairs(unit_params(c, u)) do
      if not worst or p.rows < worst.rows then worst = p end
    end
  end
  if gpus > worst.rows then
    user_error(string.format("config: gpus=%d is more than the %d rows of %s: shard=%s gives every rank rows of every " ..
      "parameter, so at most %d ranks (or shard=optimizer)", gpus, worst.rows, worst.name:gsub("^model%.layers%.0%.", ""),
      shard, worst.rows), 0)
  end
end

-- ---- the recipe's view of each linear -------------------------------------------------------------

local function bytes_of(spec) return formats.traits[spec.format].bits / 8 end
local function plain(g) return g.a.format == "f32" and g.b.format == "f32" and not g.a.rht end
local function cacheable(s) return not s.sr and not s.delayed end
local function same_spec(a, b)
  return a.format == b.format and a.block == b.block and a.rht == b.rht and a.sr == b.sr and a.delayed == b.delayed
    and a.scale_rule == b.scale_rule
end
local function transposable(s)
  if s.rht or s.sr then return false end
  local ft = formats.traits[s.format]
  return ft.scale == "none" or ft.scale == "fp32" or (ft.block2d and s.block == "2d")
end
-- On Hopper (sm_90) cuBLASLt runs f32, bf16 and per-tensor fp8 natively; the rest is emulated on
-- bf16 copies of both operands (kernels/cuda/gemm.cu)
local function emulated_on_hopper(g)
  local function native(s) local ft = formats.traits[s.format]; return ft.scale == "none" or ft.scale == "fp32" end
  return not (native(g.a) and native(g.b)) or (g.a.format == "e5m2" and g.b.format == "e5m2")
end

-- Per linear of block b (1-based; nil: the LM head) under recipe r: {params, rows, fprop, dgrad,
-- wgrad, copy_f, copy_d (bytes of the fprop / dgrad weight copies), cache_f, cache_d, keep_f (an
-- uncached fprop copy kept for dgrad), pair (bytes per element of the wgrad copy of x kept instead
-- of x, or nil), emul (emulated on Hopper), plain (every GEMM f32 x f32), dy_bytes (the copies of its
-- incoming gradient, bytes an element), gemm_specs (its backward's GEMMs, for their scratch)}
local function linear_info(c, r, b, l, name, gpus)
  local ctx = {name = name, block = b and b - 1, num_blocks = c.num_hidden_layers, high_precision = b == nil, step = 0}
  local gf, gd, gw = r:gemm(ctx, "fprop"), r:gemm(ctx, "dgrad"), r:gemm(ctx, "wgrad")
  local p = l.rows * l.cols
  local i = {params = p, rows = l.rows, fprop = gf, dgrad = gd, wgrad = gw}
  i.copy_f = plain(gf) and 0 or bytes_of(gf.b) * p
  i.copy_d = plain(gd) and 0 or bytes_of(gd.b) * p
  i.cache_f, i.cache_d = not plain(gf) and cacheable(gf.b), not plain(gd) and cacheable(gd.b)
  i.keep_f = not plain(gf) and not i.cache_f and transposable(gf.b) and same_spec(gf.b, gd.b)
  if gpus == 1 and not plain(gf) and not plain(gw) and not gf.a.sr and not r.mor and type(r._pairable) == "function" and
      r:_pairable(gf.a, gw.b) then
    i.pair = bytes_of(gw.b)
  end
  i.emul = emulated_on_hopper(gf) or emulated_on_hopper(gd) or emulated_on_hopper(gw)
  i.plain = plain(gf) and plain(gd) and plain(gw)
  -- the copies the backward makes of its incoming gradient (row for dgrad, column for wgrad):
  -- none for a plain GEMM; a bf16 gradient is its own row copy
  i.dy_bytes = (plain(gd) or gd.a.format == r.act_dtype) and 0 or bytes_of(gd.a)
  i.dy_bytes = i.dy_bytes + (plain(gw) and 0 or bytes_of(gw.a))
  -- on the CPU a column-wise (wgrad) quantization of a bf16 activation goes through its transpose
  -- (2 bytes an element) and, with the RHT, the transform's f32 (4 more): x's where the forward did not
  -- pair it (then it is made in the backward), dy's where dgrad's and wgrad's copies do not pair
  local function col_temp(spec) return formats.traits[spec.format].quantized and 2 + (spec.rht and 4 or 0) or 0 end
  i.x_col = (plain(gw) or i.pair) and 0 or bytes_of(gw.b) + col_temp(gw.b)
  local dy_pairs = gpus == 1 and not plain(gd) and not plain(gw) and not gd.b.sr and type(r._pairable) == "function" and
    r:_pairable(gd.a, gw.a)
  i.dy_col_temp = (plain(gw) or dy_pairs) and 0 or col_temp(gw.a)
  -- the backward's GEMMs, (M, N, K, A is bf16, B is bf16, f32 accumulate) as nvl_qgemm sees them:
  -- dgrad dX (T, in) = dY (T, out) · Wᵀ; wgrad dW (out, in) += dYᵀ (out, T) · Xᵀ (in, T) (T filled in
  -- by the caller, per token count)
  i.out_features, i.in_features = l.rows, l.cols
  i.gemm_specs = {{gd, false}, {gw, true}}
  return i
end

-- ---- memory ---------------------------------------------------------------------------------------

-- The per-block model: activations, copies and gathered forms of block b (1..L) under r.
local function block_model(c, r, b, N, ab, o)
  local _, hd = cfg_of(c)
  local C, F = c.hidden_size, c.intermediate_size
  local qC, kvC, Hq = c.num_attention_heads * hd, c.num_key_value_heads * hd, c.num_attention_heads
  local params = unit_params(c, b)
  local lin = {}
  for k = 1, 7 do lin[k] = linear_info(c, r, b, params[k], params[k].linear, o.gpus) end
  -- each linear input site: bytes per token kept (x in act_dtype where a linear keeps it, its
  -- paired wgrad copy where one pairs); the attention output is the attention's own
  local function site(ids, width, x_free)
    local keep_x, pair = false, nil
    for _, k in ipairs(ids) do
      if lin[k].pair then pair = math.max(pair or 0, lin[k].pair) else keep_x = true end
    end
    return (keep_x and not x_free and width * ab or 0) + (pair and width * pair or 0)
  end
  local s_h, s_out, s_h2, s_a = site({1, 2, 3}, C, false), site({4}, qC, true), site({5, 6}, C, false), site({7}, F, false)
  local fixed = 2 * C * ab + 2 * 4 + (2 * qC + 2 * kvC) * ab + Hq * 4 + 2 * F * ab -- norms, attention, g and u
  local m = {}
  m.full = N * (fixed + s_h + s_out + s_h2 + s_a)               -- everything, recompute = none
  m.input = N * C * ab                                           -- the block input alone
  m.selective = N * (s_h + s_h2 + s_a)                           -- what selective remakes
  if o.recompute == "none" then m.saved = m.full
  elseif o.recompute == "selective" then m.saved = m.full - m.selective
  else m.saved = m.input end
  -- the MLP's backward, the block's largest working set, in its three steps beyond what the block
  -- saved: {acts, the dgrad copies made so far (of this block), the GEMMs running}. The incoming
  -- gradient (C) throughout; down_proj's: its output dh (F) and the copies of dy; SwiGLU's: dh, dg, du
  -- (3F) with down_proj's input (site a) freed; gate_proj's: dg, du, the copies of dg and its output
  -- (C), site a freed
  local down, gate = lin[7], lin[5]
  local cpu = o.device == "cpu"
  m.mlp = {
    {acts = N * (C * ab + F * ab + C * down.dy_bytes + math.max(cpu and C * down.dy_col_temp or 0, cpu and F * down.x_col or
      F * (down.x_col > 0 and bytes_of(down.wgrad.b) or 0))), copies = down.cache_d and down.copy_d or 0, gemms = {down}},
    {acts = N * (C * ab + 3 * F * ab) - N * s_a, copies = down.cache_d and down.copy_d or 0, gemms = {}},
    {acts = N * (2 * C * ab + 2 * F * ab + F * gate.dy_bytes + (cpu and F * gate.dy_col_temp or 0)) - N * s_a,
      copies = (down.cache_d and down.copy_d or 0) + (gate.cache_d and gate.copy_d or 0), gemms = {gate}},
  }
  -- weight copies (whole weights: shard ~= full), by when they exist
  m.copy_f_cached, m.copy_d_cached, m.copy_f_kept, m.copy_transient = 0, 0, 0, 0
  m.emul, m.plain = false, true
  for _, i in ipairs(lin) do
    m.plain = m.plain and i.plain
    if i.cache_f then m.copy_f_cached = m.copy_f_cached + i.copy_f end
    if i.cache_d then m.copy_d_cached = m.copy_d_cached + i.copy_d
    else m.copy_transient = math.max(m.copy_transient, i.copy_d) end
    if i.keep_f then m.copy_f_kept = m.copy_f_kept + i.copy_f end
    m.emul = m.emul or i.emul
  end
  -- gathered (shard = full): what the all-gather brings (m.gather: the forward's form of each weight,
  -- f32 where nothing quantizes it, or f32 with gather = "f32"; the norms f32), what the unit holds in
  -- use (m.gather_f: with gather = "f32" also the fprop copies made from it) and in its backward also
  -- (m.gather_d) the dgrad copies
  m.gather, m.gather_f, m.gather_d, m.gather_bf16 = 8 * C, 8 * C, 0, 8 * C
  m.gather_quantized, m.gather_quantized_bf16 = 0, 0
  for _, i in ipairs(lin) do
    local f = o.gather == "f32" and 4 * i.params or (i.copy_f > 0 and i.copy_f or 4 * i.params)
    m.gather = m.gather + f
    m.gather_f = m.gather_f + f + (o.gather == "f32" and i.copy_f or 0)
    m.gather_d = m.gather_d + i.copy_d
    m.gather_bf16 = m.gather_bf16 + 2 * i.params
    if formats.traits[i.fprop.b.format].quantized then
      m.gather_quantized, m.gather_quantized_bf16 = m.gather_quantized + f, m.gather_quantized_bf16 + 2 * i.params
    end
  end
  m.quantized_weights = 0
  for _, i in ipairs(lin) do
    if formats.traits[i.fprop.b.format].global_amax then m.quantized_weights = m.quantized_weights + 1 end
  end
  m.lin = lin
  return m
end

-- The LM head's model under r (untied head; a tied one computes from the embedding's weight)
local function head_model(c, r, N, ab, o)
  local V, C = c.vocab_size, c.hidden_size
  local h = {}
  local i = linear_info(c, r, nil, {rows = V, cols = C}, "lm_head", 1)
  h.info = i
  h.copy_f_cached = i.cache_f and i.copy_f or 0
  h.copy_d_cached = i.cache_d and i.copy_d or 0
  h.copy_f_kept = i.keep_f and i.copy_f or 0
  local ctx = {name = "lm_head", num_blocks = c.num_hidden_layers, high_precision = true, step = 0}
  local chunk = r:head_chunkable(ctx) and math.max(1, require("nvlua.recipe").LOSS_CHUNK_ELEMS // V) or N
  -- a chunk's logits (act_dtype) with, at the cross-entropy's peak, its f32 gradient and (bf16 logits)
  -- their f32 widening; in the head's backward their gradient (act_dtype, where the logits were), its
  -- wgrad copy and the chunk's input gradient (n x C)
  local n = math.min(N, chunk)
  h.rows, h.chunks = n, (N + n - 1) // n
  h.ce = n * V * (ab + (ab == 2 and 8 or 4))
  h.bwd = n * V * (ab + (plain(i.wgrad) and 0 or bytes_of(i.wgrad.a))) + n * C * ab
  h.gather = 4 * C + (o.gather == "f32" and 4 * V * C or (i.copy_f > 0 and i.copy_f or 4 * V * C))
  h.gather_f = h.gather + (o.gather == "f32" and i.copy_f or 0)
  h.gather_d = i.copy_d
  h.gather_bf16 = 4 * C + 2 * V * C
  h.emul, h.plain = i.emul, i.plain
  return h
end

local function sum(t, a, b, f)
  local s = 0
  for k = a, b do s = s + f(t[k]) end
  return s
end

-- The scratch one linear's backward GEMMs take on a device, the larger of its dgrad's and wgrad's
-- (N tokens): CPU (kernels/cpu/qentry_cpu.c qgemm_into): A decoded whole and B in chunks of
-- min(N, 2^22 / K) rows, 2 bytes an element on the bf16 path (oneDNN, where core.gemm_bf16 says it
-- is ready; a bf16 operand is read in place) or 4 on sgemm's, and where the product is accumulated or
-- rounded by hand, an f32 staging of M x chunk (<= 16 MiB); a plain f32 GEMM (recipe f32), its f32
-- product. CUDA (kernels/cuda/gemm.cu): the cuBLASLt workspace, and where Hopper has no native GEMM
-- for the formats both operands as bf16 copies.
local function gemm_scratch(device)
  local bf16_path = device == "cpu" and select(2, require("nvlua.core").gemm_bf16())
  return function(i, N)
    local worst = 0
    for _, gs in ipairs(i.gemm_specs) do
      local g, wgrad = gs[1], gs[2]
      local M, Nn, K -- A (M, K), B (Nn, K)
      if wgrad then M, Nn, K = i.out_features, i.in_features, N else M, Nn, K = N, i.in_features, i.out_features end
      local t
      if device == "cuda" then
        t = plan.CUBLASLT_WORKSPACE + (emulated_on_hopper(g) and 2 * (M * K + Nn * K) or 0)
      elseif plain(g) then
        t = wgrad and 4 * M * Nn or 0 -- dW += the product
      else
        local eb = bf16_path and 2 or 4
        local staged = wgrad or not bf16_path
        local chunk = (1 << 22) // math.max(K, 1)
        if staged then chunk = math.min(chunk, (1 << 22) // math.max(M, 1)) end
        chunk = math.min(math.max(chunk, 64), Nn)
        local a_direct = bf16_path and g.a.format == "bf16"
        local b_direct = bf16_path and g.b.format == "bf16"
        t = (a_direct and 0 or M * K * eb) + (b_direct and 0 or chunk * K * eb) + (staged and 4 * M * chunk or 0)
      end
      worst = math.max(worst, t)
    end
    return worst
  end
end

--- Memory in bytes per component of one rank training batch B x sequence T (per rank) under
-- recipe r (a recipe object), at the step's peak: {weights, grads, optimizer, activations,
-- weight_copies, transient, total, phase}. opts: {gpus = 1, shard = "none", recompute = "none",
-- reshard_after_forward = true, device = "cpu" | "cuda", grad_accum = 1, gather = "quantized" |
-- "f32", prefetch = true, overlap_reduce = true} (the header says what each models; prefetch: a unit's
-- all-gather runs while the one before it computes, shard=full; overlap_reduce: a unit's
-- reduce-scatter runs while the next one back-propagates, shard=grads|full).
function plan.memory(c, r, B, T, opts)
  local o = options(opts, "plan.memory")
  plan.check_world(c, o.gpus, o.shard) -- shard=grads|full: a row range of every parameter per rank, no tied head
  local _, hd = cfg_of(c)
  local C, L, F, V = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
  local N, G = B * T, o.gpus
  local ab = r.act_dtype == "bf16" and 2 or 4
  local p = plan.params(c)
  -- per-block models (blocks differ only in the recipe's choices per block and linear)
  local blocks = {}
  for b = 1, L do blocks[b] = block_model(c, r, b, N, ab, o) end
  local head = head_model(c, r, N, ab, o)
  local u_embed, u_head = unit_sizes(c, "embed", G), unit_sizes(c, "head", G)
  local u_block = unit_sizes(c, 1, G)

  -- the optimizer state, weights and gradient shards (what does not change during the step)
  local W, Gs, O, unit_grad
  if o.shard == "none" then
    W, Gs, O = 4 * p.total, 4 * p.total, 8 * p.total
  elseif o.shard == "optimizer" then -- optim.ShardedAdamW: flat buffers padded to world x shard
    local shard = (p.total + G - 1) // G
    W, Gs, O = 4 * shard * G, 4 * shard * G + 4 * shard, 8 * shard
  else
    local shard = u_embed.shard + L * u_block.shard + u_head.shard
    W = o.shard == "full" and 4 * shard or 4 * (u_embed.padded + L * u_block.padded + u_head.padded)
    Gs, O = 4 * shard, 8 * shard
    unit_grad = {head = 4 * u_head.padded, block = 4 * u_block.padded, embed = 4 * u_embed.padded}
  end
  local full = o.shard == "full"

  -- the phases of the backward: {name, acts, copies, grads (in flight; then with the shards), scratch, total}
  local scratch_of = gemm_scratch(o.device)
  local function scratch(gemms, attention, tokens)
    local t = 0
    for _, i in ipairs(gemms) do t = math.max(t, scratch_of(i, tokens or N)) end
    if o.device == "cpu" then return t end
    local att = attention and N * (c.num_attention_heads + c.num_attention_heads * hd) * 4 or 0
    return plan.CUDA_OUTSIDE + math.max(t, att)
  end
  local all_f = sum(blocks, 1, L, function(m) return m.copy_f_cached end) + head.copy_f_cached
  local all_d = sum(blocks, 1, L, function(m) return m.copy_d_cached end) + head.copy_d_cached
  local accum_d = o.grad_accum > 1 and all_d or 0 -- an earlier micro-batch's dgrad copies, still cached
  local kept_f = sum(blocks, 1, L, function(m) return m.copy_f_kept end) + head.copy_f_kept
  local saved_all = sum(blocks, 1, L, function(m) return m.saved end)
  local final = N * C * ab + N * 4 -- the final norm's saved input and rstd
  local phases = {}
  -- the loss: every block's activations, the final norm's output and its gradient, the head's copies
  -- and a chunk's logits; at the cross-entropy (the head's dgrad copy made already where an earlier
  -- chunk's backward made it), and in the head's backward
  for _, part in ipairs({"ce", "bwd"}) do
    local copies
    -- what the head's backward brings: its dgrad copy, its whole gradients, the last block's prefetch
    local after_bwd = (part == "bwd" or head.chunks > 1)
    if full then
      copies = head.gather_f + (after_bwd and head.gather_d or 0)
      if not o.reshard_after_forward then copies = copies + sum(blocks, 1, L, function(m) return m.gather_f end)
      elseif o.prefetch and L > 0 and after_bwd then copies = copies + blocks[L].gather end -- block L's, prefetched
    else
      copies = all_f + kept_f + math.max(after_bwd and head.copy_d_cached or 0, accum_d)
    end
    phases[#phases + 1] = {name = part == "ce" and "the loss (cross-entropy)" or "the LM head's backward",
      acts = saved_all + final + 2 * N * C * ab + head[part], copies = copies,
      grads = unit_grad and after_bwd and unit_grad.head or 0,
      scratch = part == "ce" and (o.device == "cpu" and 0 or plan.CUDA_OUTSIDE) or scratch({head.info}, false, head.rows)}
  end
  -- block i's backward, at the largest step of its MLP's (the blocks above it done: their dgrad
  -- copies made)
  local below = saved_all
  for i = L, 1, -1 do
    local m = blocks[i]
    below = below - m.saved
    local grads = 0
    if unit_grad then
      grads = unit_grad.block + (o.overlap_reduce and (i == L and unit_grad.head or unit_grad.block) or 0)
    end
    local worst
    for _, st in ipairs(m.mlp) do
      local copies
      if full then
        copies = m.gather_f + m.gather_d
        if not o.reshard_after_forward then copies = copies + sum(blocks, 1, i - 1, function(x) return x.gather_f end)
        elseif o.prefetch and i > 1 then copies = copies + blocks[i - 1].gather end
      else
        local d_done = sum(blocks, i + 1, L, function(x) return x.copy_d_cached end) + head.copy_d_cached + st.copies
        copies = all_f + math.max(d_done, accum_d) + sum(blocks, 1, i, function(x) return x.copy_f_kept end) +
          m.copy_transient
      end
      local ph = {name = string.format("block %d's backward", i), acts = below + m.full + st.acts, copies = copies,
        grads = grads, scratch = scratch(st.gemms, true)}
      if not worst or ph.acts + ph.copies + ph.scratch > worst.acts + worst.copies + worst.scratch then worst = ph end
    end
    phases[#phases + 1] = worst
  end
  -- the embedding's backward: every dgrad copy made
  do
    local copies = full and 0 or (all_f + all_d)
    local grads = unit_grad and (unit_grad.embed + (o.overlap_reduce and L > 0 and unit_grad.block or 0)) or 0
    phases[#phases + 1] = {name = "the embedding's backward", acts = N * C * ab, copies = copies, grads = grads,
      scratch = o.device == "cpu" and 0 or plan.CUDA_OUTSIDE}
  end
  -- shard = full: the embedding's forward (its f32 weight gathered, block 1's prefetched)
  if full then
    phases[#phases + 1] = {name = "the embedding's forward", acts = N * C * ab, copies = 4 * V * C +
      (o.prefetch and L > 0 and blocks[1].gather or 0), grads = 0, scratch = o.device == "cpu" and 0 or plan.CUDA_OUTSIDE}
  end
  local best
  for _, ph in ipairs(phases) do
    ph.grads = Gs + ph.grads -- the shards (or whole buffer) and the whole gradients in flight
    ph.total = W + ph.grads + O + ph.acts + ph.copies + ph.scratch
    if not best or ph.total > best.total then best = ph end
  end
  return {weights = W, grads = best.grads, optimizer = O, activations = best.acts, weight_copies = best.copies,
    transient = best.scratch, total = best.total, phase = best.name, gpus = G, shard = o.shard, recompute = o.recompute,
    device = o.device, phases = phases}
end

-- ---- communication --------------------------------------------------------------------------------

--- Bytes one rank sends per optimizer step, by collective: {all_gather, reduce_scatter, all_reduce,
-- total, weight_gather (the weight all-gathers of shard=full), weight_gather_bf16 (the same with every
-- weight gathered in bf16, norms f32), quantized_gather / quantized_gather_bf16 (only the linears
-- the recipe quantizes: the goal's <= 0.3x), what = {collective = "what it carries"}}. Ring
-- algorithms: (N-1)/N of the bytes gathered or reduce-scattered, twice that for an all-reduce.
-- With grad_accum > 1: "grads" and "full" reduce-scatter every micro-batch, "full" gathers every
-- micro-batch; plain data parallelism and ZeRO-1 reduce once.
function plan.comm(c, r, B, T, opts)
  local o = options(opts, "plan.comm")
  local G, L = o.gpus, c.num_hidden_layers
  local f = (G - 1) / G
  local p = plan.params(c)
  local out = {all_gather = 0, reduce_scatter = 0, all_reduce = 0, weight_gather = 0, weight_gather_bf16 = 0,
    quantized_gather = 0, quantized_gather_bf16 = 0, what = {}}
  if o.shard == "none" then
    out.all_reduce = 2 * 4 * p.total * f
    out.what.all_reduce = "the f32 gradients (one flat buffer, in buckets)"
  elseif o.shard == "optimizer" then
    local shard = (p.total + G - 1) // G
    out.reduce_scatter = 4 * shard * G * f
    out.all_gather = 4 * shard * G * f
    out.what.reduce_scatter, out.what.all_gather = "the f32 gradients (avg), once per step", "the updated f32 weights"
  else
    local pad = unit_sizes(c, "embed", G).padded + L * unit_sizes(c, 1, G).padded + unit_sizes(c, "head", G).padded
    out.reduce_scatter = 4 * pad * f * o.grad_accum
    out.what.reduce_scatter = "each unit's f32 gradients as its backward completes them, every micro-batch"
    if o.shard == "grads" then
      out.all_gather = 4 * pad * f
      out.what.all_gather = "the updated f32 weights"
    else
      local ab = r.act_dtype == "bf16" and 2 or 4
      local N = B * T
      local fwd, fwd16, q, q16, bwd, bwd16, amax = 0, 0, 0, 0, 0, 0, 0
      for b = 1, L do
        local m = block_model(c, r, b, N, ab, o)
        fwd, fwd16, q, q16 = fwd + m.gather, fwd16 + m.gather_bf16, q + m.gather_quantized, q16 + m.gather_quantized_bf16
        amax = amax + m.quantized_weights
        if o.reshard_after_forward then
          bwd, bwd16 = bwd + m.gather, bwd16 + m.gather_bf16
          q, q16 = q + m.gather_quantized, q16 + m.gather_quantized_bf16
          amax = amax + m.quantized_weights
        end
      end
      local h = head_model(c, r, N, ab, o)
      local embed = 4 * c.vocab_size * c.hidden_size -- the embedding's forward reads f32 rows
      fwd, fwd16 = fwd + h.gather + embed, fwd16 + h.gather_bf16 + embed
      if formats.traits[h.info.fprop.b.format].quantized then
        q, q16 = q + h.gather - 4 * c.hidden_size, q16 + h.gather_bf16 - 4 * c.hidden_size
      end
      out.weight_gather = (fwd + bwd) * f * o.grad_accum
      out.weight_gather_bf16 = (fwd16 + bwd16) * f * o.grad_accum
      out.quantized_gather, out.quantized_gather_bf16 = q * f * o.grad_accum, q16 * f * o.grad_accum
      out.all_gather = out.weight_gather
      out.all_reduce = 2 * 4 * amax * f * o.grad_accum
      out.what.all_gather = "each unit's weights as the forward reads them" ..
        (o.reshard_after_forward and ", before its forward and again before its backward" or ", once (kept to the backward)")
      out.what.all_reduce = "one float per quantized weight per gather (its global amax)"
    end
  end
  out.total = out.all_gather + out.reduce_scatter + out.all_reduce
  return out
end

-- ---- fitting a memory -----------------------------------------------------------------------------

--- plan.fit(c, r, B, T, {gpus, gpu_memory (bytes), device, grad_accum, reshard_after_forward, gather,
-- prefetch, overlap_reduce, allowed = {shard = {...}, recompute = {...}}}) -> the first configuration of
-- plan.ORDER
-- (restricted to allowed) whose plan.memory total fits gpu_memory: {shard, recompute, total, memory};
-- nil and the last one tried when none fits. shard=grads|full are not tried on one GPU, nor where
-- the world is larger than a parameter's rows.
function plan.fit(c, r, B, T, opts)
  opts = util.check_opts(opts, {gpus = is_count, gpu_memory = true, device = true, grad_accum = true,
    reshard_after_forward = true, gather = true, prefetch = true, overlap_reduce = true, allowed = true}, "plan.fit")
  local have = opts.gpu_memory
  if type(have) ~= "number" or have <= 0 then user_error("plan.fit: gpu_memory must be a number of bytes > 0", 2) end
  local gpus = opts.gpus or 1
  local function allowed(kind, v)
    local list = opts.allowed and opts.allowed[kind]
    if not list then return true end
    for _, x in ipairs(list) do if x == v then return true end end
    return false
  end
  local last
  for _, cand in ipairs(plan.ORDER) do
    local multi = cand.shard == "grads" or cand.shard == "full"
    local ok = allowed("shard", cand.shard) and allowed("recompute", cand.recompute) and not (multi and gpus == 1) and
      not (multi and c.tie_word_embeddings) and not (multi and not pcall(plan.check_world, c, gpus, cand.shard))
    if ok then
      local m = plan.memory(c, r, B, T, {gpus = gpus, shard = cand.shard, recompute = cand.recompute, device = opts.device,
        grad_accum = opts.grad_accum, reshard_after_forward = opts.reshard_after_forward, gather = opts.gather,
        prefetch = opts.prefetch, overlap_reduce = opts.overlap_reduce})
      last = {shard = cand.shard, recompute = cand.recompute, total = m.total, memory = m}
      if m.total <= have then return last end
    end
  end
  return nil, last
end

--- plan.fewest_gpus(c, r, B, T, opts) -> the fewest GPUs (1, 2, 4, 8, ... 4096) at which plan.fit finds a
-- configuration (and that fit), or nil
function plan.fewest_gpus(c, r, B, T, opts)
  local g = 1
  while g <= 4096 do
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.gpus = g
    local fit = plan.fit(c, r, B, T, o)
    if fit then return g, fit end
    g = g * 2
  end
end

-- ---- printing -------------------------------------------------------------------------------------

local function gib(b) return b / GiB end

--- Print counts, FLOPs, the memory table (one row per recipe name) and, with several GPUs, the
-- communication table; with opts.gpu_memory (bytes) whether each recipe fits and the smallest
-- configuration that does. opts: plan.memory's and gpu_memory, memory_label (how gpu_memory was
-- given). Returns the memory rows by recipe name.
function plan.report(c, recipes, B, T, out, opts)
  out = out or io.stdout
  opts = opts or {}
  local recipe = require "nvlua.recipe"
  local mo = {gpus = opts.gpus, shard = opts.shard, recompute = opts.recompute, device = opts.device,
    reshard_after_forward = opts.reshard_after_forward, grad_accum = opts.grad_accum, gather = opts.gather,
    prefetch = opts.prefetch, overlap_reduce = opts.overlap_reduce}
  local o = options(mo, "plan.report")
  local p = plan.params(c)
  out:write(string.format("parameters: %.3fB total = embedding %.3fB + %d blocks x %.1fM (attention %.1fM, MLP %.1fM)" ..
    " + LM head %.3fB\n", p.total / 1e9, p.embed / 1e9, c.num_hidden_layers, p.block / 1e6, p.attn / 1e6, p.mlp / 1e6,
    p.lm_head / 1e9))
  local f = plan.flops_per_token(c, T)
  local att = 12 * c.num_hidden_layers * T * (c.head_dim or c.hidden_size // c.num_attention_heads) * c.num_attention_heads
  out:write(string.format("training FLOPs per token at T=%d: %.2f GFLOP (6 x %.3fB GEMM parameters + attention %.2f GFLOP)\n",
    T, f / 1e9, (f - att) / 6e9, att / 1e9))
  local where = o.device == "cuda" and "per GPU (CUDA backend" or "per rank (CPU backend"
  local sharding = o.gpus > 1 and string.format(", %d ranks, shard=%s", o.gpus, o.shard) or
    (o.shard ~= "none" and ", shard=" .. o.shard or "")
  out:write(string.format("memory (GiB) %s%s, recompute=%s; f32 master weights, grads, AdamW) for batch %d x seq %d:\n",
    where, sharding, o.recompute, B, T))
  out:write(string.format("  %-10s %9s %9s %9s %11s %9s %9s %9s\n", "recipe", "weights", "grads", "adamw", "activations",
    "w copies", "transient", "total"))
  local rows = {}
  for _, name in ipairs(recipes) do
    local r = recipe[name]()
    local m = plan.memory(c, r, B, T, mo)
    rows[name] = m
    out:write(string.format("  %-10s %9.2f %9.2f %9.2f %11.2f %9.2f %9.2f %9.2f\n", name, gib(m.weights), gib(m.grads),
      gib(m.optimizer), gib(m.activations), gib(m.weight_copies), gib(m.transient), gib(m.total)))
  end
  if o.gpus > 1 then
    out:write(string.format("communication per GPU per step (GB sent, ring algorithms over %d GPUs%s):\n", o.gpus,
      o.grad_accum > 1 and string.format(", %d micro-batches", o.grad_accum) or ""))
    out:write(string.format("  %-10s %11s %14s %11s %9s %15s\n", "recipe", "all-gather", "reduce-scatter", "all-reduce",
      "total", "gather vs bf16"))
    for _, name in ipairs(recipes) do
      local cm = plan.comm(c, recipe[name](), B, T, mo)
      rows[name].comm = cm
      local ratio = cm.quantized_gather_bf16 > 0 and string.format("%.3fx", cm.quantized_gather / cm.quantized_gather_bf16)
        or "-"
      out:write(string.format("  %-10s %11.2f %14.2f %11.2f %9.2f %15s\n", name, cm.all_gather / 1e9,
        cm.reduce_scatter / 1e9, cm.all_reduce / 1e9, cm.total / 1e9, ratio))
    end
    if o.shard == "full" then
      out:write("  (gather vs bf16: the quantized linears' weight all-gathers against the same weights in bf16)\n")
    end
  end
  if opts.gpu_memory then
    local have = opts.gpu_memory
    out:write(string.format("fits %s (%.2f GiB) per %s?\n", opts.memory_label or string.format("%.2f GiB", gib(have)),
      gib(have), o.device == "cuda" and "GPU" or "rank"))
    for _, name in ipairs(recipes) do
      local m = rows[name]
      local line = string.format("  %-10s %s (%.2f GiB)", name, m.total <= have and "fits" or "does not fit", gib(m.total))
      local fo = {gpus = o.gpus, gpu_memory = have, device = o.device, grad_accum = o.grad_accum,
        reshard_after_forward = o.reshard_after_forward, gather = o.gather, prefetch = o.prefetch,
        overlap_reduce = o.overlap_reduce, allowed = opts.allowed}
      local fit = plan.fit(c, recipe[name](), B, T, fo)
      if fit then
        line = line .. string.format("; the smallest that fits on %d: shard=%s recompute=%s (%.2f GiB)", o.gpus, fit.shard,
          fit.recompute, gib(fit.total))
      else
        local g, gf = plan.fewest_gpus(c, recipe[name](), B, T, fo)
        line = line .. (g and string.format("; nothing fits on %d; the fewest GPUs: %d with shard=%s recompute=%s (%.2f GiB)",
          o.gpus, g, gf.shard, gf.recompute, gib(gf.total)) or "; nothing fits on up to 4096 GPUs")
      end
      out:write(line .. "\n")
    end
    out:write("  (order tried: " .. plan.order_text() .. ")\n")
  end
  return rows
end

--- plan.order_text() -> plan.ORDER in words, for messages
function plan.order_text()
  local parts = {}
  for _, x in ipairs(plan.ORDER) do parts[#parts + 1] = x.shard .. "/" .. x.recompute end
  return "shard/recompute " .. table.concat(parts, ", ")
end

return plan
