-- tests/test_recompute.lua: activation recompute on the CPU (recompute = "none" | "block" |
-- "selective": lua/nvlua/llama.lua's header; the tape of a forward's decisions: recipe.record /
-- recipe.replay in lua/nvlua/recipe.lua).
--   * numerics (tests/recompute_cases.lua): for every registered recipe (recipe.names()) and five
--     variants that reach the paths the presets do not (f32 activations; bf16 blocks beside nvfp4
--     ones; MoR reusing choices over steps; SR on a forward operand with delayed scaling, a
--     data-parallel amax reducer and an SR shard; fp8 with the reducer), a 2-block Llama trains 2
--     optimizer steps of 2 micro-batches each (one weight cache per step, as the training loop runs
--     them) under each mode: every micro-batch's loss, the whole gradient buffer after each step, the
--     final parameters (byte for byte), the recipe's state (SR generator offset, delayed-scaling
--     histories, MoR's reused choices), nv.stats' GEMM and MoR counters, MoR's per-step counts, the
--     weight cache's size and the reducer's calls are identical. Several forwards, so that delayed
--     scaling's history holds earlier amaxes when a block is recomputed (its own forward's push
--     included: the replay must not read it). A control runs the recompute without its replay
--     and must differ.
--   * memory (bf16 and f32 activations): what a training forward keeps, exactly — per token and block
--     A = ab * (4C + 2*Dq + 2*kvC + 3F) + 4 * (Hq + 2) bytes under none (checked against the measured
--     total), A - ab*C less under block, ab * (2C + F) less under selective — and a whole step's peak:
--     lower by (L-1) * (A - max(c, delta)) under block (delta: one block's dgrad weight copies, which
--     the step's weight cache holds), by (L-1) to L blocks' ab * (2C + F) under selective.
--   * the module and train-key options, their errors, eval mode, a forward without its backward,
--     a replay that does not match its record; short runs with recompute=block and selective equal
--     recompute=none's, and say so; and so under data parallelism (2 ranks under mpirun, nvfp4 and
--     fp8_delayed: the global-batch amax all-reduces, SR at global block indices; skipped without
--     mpirun).
-- tests/test_cuda_recompute.lua runs the numerics on the CUDA backend (its emulation on the CPU).
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local recipe = require "nvlua.recipe"

local R = dofile("tests/recompute_cases.lua")
local MODES, CFG, batch, trace, differ = R.MODES, R.CFG, R.batch, R.trace, R.differ

T.case("every recipe: losses, gradients, parameters and recipe state identical under none, block and selective", function()
  R.check_all({steps = 2, micro = 2})
end)

T.case("the comparison sees a recompute that decides again (control: no replay)", function()
  -- fp8_delayed with the block's second forward run plainly: it takes its amaxes from histories that
  -- now hold its own first forward's push, and pushes again; the gradients must differ
  local make = function() return recipe.make("fp8_delayed") end
  local o = {steps = 2, micro = 2, cfg = R.SMALL}
  local base = trace(make, "none", o)
  local replay = recipe.replay
  local broken = T.with(function(f) local p = recipe.replay; recipe.replay = f; return p end,
    function(_, fn, ...) return fn(...) end, trace, make, "block", o)
  T.ok(recipe.replay == replay, "put back")
  local grads_differ = false
  for s = 1, 2 do grads_differ = grads_differ or broken[s].grads ~= base[s].grads end
  T.ok(grads_differ, "a re-deciding recompute changes the gradients")
  T.ok(not T.deep_eq(broken[2].state, base[2].state), "and the amax histories")
end)

-- ---- memory ------------------------------------------------------------------------------------------

-- Activations dominate: 4 blocks, 512 tokens, a vocabulary of 64.
local MCFG = {vocab_size = 64, hidden_size = 128, intermediate_size = 512, num_hidden_layers = 4,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256}
local B, S = 2, 256

T.case("memory: what a training forward keeps and a step's peak, as counted, under each mode", function()
  local C, F, L, N = MCFG.hidden_size, MCFG.intermediate_size, MCFG.num_hidden_layers, B * S
  local hd = C // MCFG.num_attention_heads
  local Dq, kvC = hd * MCFG.num_attention_heads, hd * MCFG.num_key_value_heads
  for _, rname in ipairs({"bf16", "f32"}) do
    local ab = rname == "bf16" and 2 or 4 -- the activation dtype's bytes
    local A, block_saves, selective_saves = R.per_token(MCFG, ab)
    local kept, peak = {}, {}
    for _, mode in ipairs(MODES) do kept[mode], peak[mode] = R.memory(rname, mode, MCFG, B) end
    -- the total kept under none: L blocks; the final norm's input (the last block's output) and rstd,
    -- and its output (the LM head's input); the step's weight copies (bf16: one of every linear, 2
    -- bytes per parameter; f32 runs plain GEMMs); the RoPE tables (f32 cos and sin, T x head_dim),
    -- made by the first forward
    local lin = L * (C * (2 * Dq + 2 * kvC) + 3 * C * F) + C * MCFG.vocab_size
    local other = N * (2 * ab * C + 4) + (rname == "bf16" and 2 * lin or 0) + 2 * 4 * S * hd
    T.eq(kept.none, L * N * A + other, rname .. ": what recompute=none keeps")
    T.eq(kept.none - kept.block, L * N * block_saves, rname .. ": recompute=block keeps L*N*(A - C) bytes less")
    T.eq(kept.none - kept.selective, L * N * selective_saves, rname .. ": recompute=selective keeps L*N*(2C + F) less")
    -- The peak of a step. Under none it comes in the top block's backward: every block's set kept, the
    -- top one's being consumed. Each block's backward also adds its dgrad weight copies to the step's
    -- weight cache, which holds them to the step's end (bf16: each linear's fprop copy transposed, 2
    -- bytes per parameter, a copy of its own on the CPU; f32 GEMMs take no copies): delta per block.
    -- Under block the recomputed block's set is whole again while the others hold their input (c) or,
    -- once back-propagated, their dgrad copies (delta): the peak is at the first or the last block
    -- back-propagated, whichever holds more, so none - block = (L-1) * (N*A - max(N*c, delta)), exactly.
    -- Under selective (A - s > delta here) it is the top block's backward, with the other blocks s
    -- lighter and part of the top block's s not rebuilt yet: none - selective in [(L-1) s, L s].
    local delta = rname == "bf16" and 2 * (lin - C * MCFG.vocab_size) // L or 0 -- bytes per block
    local block_peak = (L - 1) * (N * A - math.max(N * ab * C, delta))
    T.eq(peak.none - peak.block, block_peak, rname .. ": recompute=block lowers the peak by (L-1)*(N*A - max(N*c, delta))")
    local saved = peak.none - peak.selective
    T.ok(saved >= (L - 1) * N * selective_saves and saved <= L * N * selective_saves, string.format(
      "%s selective: the peak %.3f MB lower, not within [%.3f, %.3f] MB ((L-1) to L blocks' savings)", rname,
      saved / 2 ^ 20, (L - 1) * N * selective_saves / 2 ^ 20, L * N * selective_saves / 2 ^ 20))
  end
end)

-- ---- options, errors, lifetimes ----------------------------------------------------------------------

T.case("options: the Llama option, set_recompute, clear errors naming the key", function()
  local m = llama.Llama(CFG, {seed = 1, recompute = "block"})
  T.eq(m:recompute_mode(), "block")
  T.ok(m:extra_repr():find("recompute=block", 1, true), "the model says so")
  T.eq(m:set_recompute("selective"):recompute_mode(), "selective")
  T.eq(m.layers[1].mlp.down_proj.recompute_input, true, "selective: the linears reading a recomputed tensor")
  T.eq(m.layers[1].self_attn.o_proj.recompute_input, nil, "o_proj keeps its input (attention keeps it anyway)")
  m:set_recompute("none")
  T.eq(m.layers[1].mlp.down_proj.recompute_input, nil)
  T.ok(not m:extra_repr():find("recompute", 1, true))
  m.layers[2]:set_recompute("block")
  T.eq(m:recompute_mode(), "mixed")
  T.raises(function() llama.Llama(CFG, {recompute = "blocks"}) end,
    "Llama: option recompute must be one of none, block, selective, got blocks")
  T.raises(function() m:set_recompute("full") end, "Llama:set_recompute: recompute must be one of none, block, selective, got 'full'")
  T.raises(function() m:set_recompute() end, "got nil")
  T.raises(function() m.layers[1]:set_recompute(true) end, "Block:set_recompute: recompute must be one of")
end)

T.case("eval mode keeps nothing whatever the mode; a forward without its backward frees what it kept", function()
  local ids = batch(1, 1)
  local ref = llama.Llama(CFG, {seed = 2, recipe = "nvfp4"})
  ref:eval()
  local want = ref:forward(ids):bytes()
  for _, mode in ipairs({"block", "selective"}) do
    local m = llama.Llama(CFG, {seed = 2, recipe = "nvfp4", recompute = mode})
    m:eval()
    m:forward(ids):free() -- the RoPE tables are made by a model's first forward
    collectgarbage()
    local base = nv.memory().cpu
    local y = m:forward(ids)
    T.ok(y:bytes() == want, mode .. ": eval logits equal recompute=none's")
    y:free()
    T.eq(nv.memory().cpu - base, 0, mode .. ": an eval forward keeps nothing")
    m:train()
    -- two training forwards: the second frees what the first kept (the block inputs and tapes too)
    recipe.weight_cache(function()
      local b0 = nv.memory().cpu
      m:forward(ids):free()
      local once = nv.memory().cpu - b0
      T.ok(once > 0, mode .. ": a training forward keeps something")
      m:forward(ids):free()
      T.eq(nv.memory().cpu - b0, once, mode .. ": the second forward replaced the first's")
    end)
  end
end)

T.case("the tape: a replay must make the recorded decisions; Linear's input must be given back", function()
  local r = recipe.make("fp8_delayed")
  local w = nv.randn(32, 32, {generator = nv.Generator(1)})
  local x = nv.randn(64, 32, {generator = nv.Generator(2)})
  local ctx = {name = "l", step = 0}
  local tape = recipe.record(function() end) -- a forward that quantized nothing
  T.raises(function() recipe.replay(tape, function() r:linear_forward(ctx, x, w, true) end) end,
    "recompute: the recomputed forward quantized l|x|fprop")
  T.eq(recipe.replaying(), false, "the replay closed")
  T.raises(function() recipe.record(function() recipe.record(function() end) end) end, "recompute does not nest")
  T.raises(function() recipe.replay({}, function() end) end, "expects a tape from recipe.record")
  -- a Linear that did not keep its input
  local nn = require "nvlua.nn"
  local lin = nn.Linear(32, 16, {recipe = recipe.make("bf16")})
  lin.recompute_input = true
  lin:forward(x)
  T.ok(lin:needs_input())
  T.raises(function() lin:backward(nv.zeros(64, 16)) end, "its input was not kept (recompute_input)")
  T.raises(function() lin:restore_input(nv.zeros(64, 16)) end, "expected the forward's input [64,32], got [64,16]")
  lin:restore_input(x)
  T.ok(not lin:needs_input())
  T.raises(function() lin:restore_input(x) end, "is not waiting for its input")
  lin:backward(nv.zeros(64, 16))
end)

-- ---- the training loop --------------------------------------------------------------------------------

T.case("train: recompute=block and selective train as recompute=none does, bit for bit; the key is printed", function()
  local train = require "nvlua.train"
  local config = require "nvlua.config"
  local root = T.tmpdir()
  local corpus = T.write_corpus(root .. "/corpus.txt", {seed = 7, lines = 400, words = {"in", "the", "beginning",
    "was", "word", "and", "light"}})
  local function run(mode)
    local c = config.parse(train.defaults, {"data=" .. corpus, "cache=" .. root .. "/cache", "layers=2", "hidden=32",
      "heads=4", "kv_heads=2", "ffn=64", "seq=16", "batch=2", "grad_accum=2", "steps=4", "warmup=1", "eval_every=0",
      "sample_tokens=0", "plot=false", "save=false", "recipe=fp8_delayed", "out=" .. root .. "/" .. mode,
      "recompute=" .. mode, "quiet=" .. tostring(mode == "none")})
    local p = train.build(c)
    p.peak = 1e9 -- no sgemm measurement
    local lines = {}
    local s = T.with(function(f) local o = io.stdout; io.stdout = f; return o end,
      {write = function(_, ...) for _, x in ipairs({...}) do lines[#lines + 1] = tostring(x) end end, flush = function() end},
      function() return train.run(c, p) end)
    local printed = {write = function(_, x) lines[#lines + 1] = x end}
    config.print(c, printed)
    return s, table.concat(lines), T.read_file(c.out .. "/config.json")
  end
  local s0 = run("none")
  for _, mode in ipairs({"block", "selective"}) do
    local s, text, json = run(mode)
    T.eq(#s.losses, 4)
    for i = 1, 4 do T.eq(string.pack("<d", s.losses[i][2]), string.pack("<d", s0.losses[i][2]), mode .. ": loss of step " .. i) end
    T.ok(text:find("recompute=" .. mode, 1, true), mode .. ": the run's model line says it")
    T.ok(text:find("recompute%s*= " .. mode), mode .. ": the printed config has the key")
    T.ok(json:find('"recompute": "' .. mode .. '"', 1, true), mode .. ": config.json has it")
  end
  T.raises(function() config.parse(train.schema, {"recompute=full"}) end,
    "config: recompute must be one of none, block, selective, got 'full'")
  T.rm_tree(root)
end)

-- ---- data parallelism -----------------------------------------------------------------------------

T.case("data parallel (2 ranks under mpirun): nvfp4 and fp8_delayed train alike under every mode, bit for bit", function()
  local dist = require "nvlua.dist"
  local lfs = require "lfs"
  local cjson = require "cjson"
  local p = io.popen("command -v mpirun 2>/dev/null")
  local mpirun = p and p:read("l")
  if p then p:close() end
  if not mpirun or mpirun == "" then T.skip("mpirun not found") end
  if not dist.info().mpi then T.skip("nvlua built without MPI") end
  local exe = arg[-1] -- the nvlua running this file, made absolute
  do
    local i = -1
    while arg[i - 1] do i = i - 1 end
    exe = arg[i]
    if exe:sub(1, 1) ~= "/" and exe:find("/", 1, true) then exe = lfs.currentdir() .. "/" .. exe end
  end
  local root = T.tmpdir()
  local corpus = T.write_corpus(root .. "/corpus.txt", {seed = 3, lines = 400, words = {"let", "there", "be", "light",
    "and", "it", "was", "so"}})
  T.write_file(root .. "/main.lua", 'require("nvlua.train").main({}, arg)\n')
  -- the amaxes of the global batch (a max all-reduce per quantization: a recompute that ran it again
  -- would desynchronise the ranks), SR at global block indices, delayed scaling's histories
  for _, rname in ipairs({"nvfp4", "fp8_delayed"}) do
    local runs = {}
    for _, mode in ipairs(MODES) do
      local out = root .. "/" .. rname .. "-" .. mode
      local cmd = string.format("env OMP_NUM_THREADS=1 timeout 120 %s --allow-run-as-root --oversubscribe --bind-to none " ..
        "-np 2 %s %s/main.lua data=%s cache=%s/cache layers=2 hidden=32 heads=4 kv_heads=2 ffn=64 seq=16 batch=2 " ..
        "grad_accum=2 steps=3 warmup=1 eval_every=0 sample_tokens=0 plot=false save=false quiet=true dist=true " ..
        "recipe=%s recompute=%s out=%s 2>&1", mpirun, exe, root, corpus, root, rname, mode, out)
      local h = assert(io.popen(cmd))
      local text = h:read("a")
      local _, _, code = h:close()
      T.eq(code, 0, rname .. " " .. mode .. ": mpirun's exit status; output:\n" .. text)
      local steps = {}
      for line in io.lines(out .. "/metrics.jsonl") do
        local r = cjson.decode(line)
        if r.loss then steps[#steps + 1] = string.pack("<dd", r.loss, r.grad_norm) end
      end
      T.eq(#steps, 3, rname .. " " .. mode .. ": steps logged")
      runs[mode] = table.concat(steps)
    end
    T.ok(runs.block == runs.none, rname .. ": recompute=block's losses and gradient norms equal recompute=none's")
    T.ok(runs.selective == runs.none, rname .. ": recompute=selective's equal recompute=none's")
  end
  T.rm_tree(root)
end)
