-- tests/test_plan.lua: nvlua.plan's counts against a built model, and its memory prediction
-- against the measured peak of a real training step; train.build refuses, before it allocates
-- anything, a run that cannot fit the machine's memory (a machine of a given size stands in for
-- this one: the cheap bound for a million layers, the plan itself for a large batch, each message
-- with the estimate and the memory; check_memory=false builds it anyway), and reads this machine's.
local T = require "nvlua.test"
local nv = require "nvlua"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local plan = require "nvlua.plan"

local cfg = {vocab_size = 256, hidden_size = 128, intermediate_size = 384, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64}

T.case("parameter counts match the built model", function()
  T.eq(plan.params(cfg).total, llama.Llama(cfg):num_parameters())
  local tied = {}
  for k, v in pairs(cfg) do tied[k] = v end
  tied.tie_word_embeddings = true
  T.eq(plan.params(tied).total, llama.Llama(tied):num_parameters())
  -- Llama 3 8B: 8.03B parameters
  local p = plan.params({vocab_size = 128256, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = 32,
    num_attention_heads = 32, num_key_value_heads = 8})
  T.eq(p.total, 8030261248)
end)

T.case("the memory plan predicts a training step's peak within 20%", function()
  for _, name in ipairs({"bf16", "nvfp4"}) do
    collectgarbage()
    nv.reset_peak_memory()
    local base = nv.memory().cpu
    local r = nv.recipe[name]()
    local m = llama.Llama(cfg, {recipe = r, seed = 1})
    local opt = optim.AdamW(m:named_parameters(), {lr = 1e-3})
    local g = nv.Generator(3)
    local x = (nv.rand(4, 64, {generator = g}) * 255):to("i64")
    local y = (nv.rand(4, 64, {generator = g}) * 255):to("i64")
    m:forward_backward(x, y)
    opt:step()
    local measured = nv.memory().peak.cpu - base
    local predicted = plan.memory(cfg, r, 4, 64).total
    T.ok(math.abs(predicted - measured) <= 0.2 * measured,
      string.format("%s: predicted %.2f MB, measured %.2f MB", name, predicted / 2 ^ 20, measured / 2 ^ 20))
    x:free(); y:free()
  end
end)

T.case("the LM head's logits in the plan: one chunk of 2^27 / vocab tokens where the head is chunkable", function()
  local recipe = require "nvlua.recipe"
  local c = {vocab_size = 128256, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = 32,
    num_attention_heads = 32, num_key_value_heads = 8}
  local N, V = 8192, 128256
  local chunked = plan.memory(c, recipe.nvfp4(), 1, N)
  local whole = plan.memory(c, recipe.custom(function() return "nvfp4" end, {act_dtype = "bf16"}), 1, N)
  local rows = (1 << 27) // V -- 1046 tokens at a time
  -- f32 logits and gradient (8 bytes per logit) of one chunk instead of every token
  T.eq(whole.activations - chunked.activations, (N - rows) * 8 * V, "the difference is the unchunked tokens' logits")
  T.ok(whole.activations - chunked.activations > 7e9, "about 7.3 GB less at 8k tokens")
end)

-- ---- refusing what cannot fit ---------------------------------------------------------------------

local train = require "nvlua.train"
local config = require "nvlua.config"
local T_ROOT = T.tmpdir()
local CORPUS = T.write_corpus(T_ROOT .. "/corpus.txt", {seed = 5, lines = 3000, words = {"in", "the", "beginning"}})
local TINY = {"data=" .. CORPUS, "cache=" .. T_ROOT .. "/cache", "hidden=32", "heads=4", "kv_heads=2", "ffn=64",
  "seq=16", "batch=2", "quiet=true", "recipe=bf16", "eval_every=0", "out=" .. T_ROOT .. "/run"}
local function cfg(extra)
  local a = {table.unpack(TINY)}
  for _, x in ipairs(extra) do a[#a + 1] = x end
  return config.parse(train.defaults, a)
end
local GiB = 2 ^ 30

-- {name, machine bytes, keys, the message (after "config: ")}: sizes by hand for hidden 32, 4/2
-- heads (head_dim 8), ffn 64, vocab 256, untied: a block has 32*8*(2*4+2*2) + 3*32*64 + 2*32 = 9280
-- parameters, the rest 2*256*32 + 32 = 16416; a step saves 2 bytes x (6*32 + 2*16 + 3*64) = 832
-- per token and block at the least
local TOO_BIG = {
  {"a batch of 2000 x 16 tokens (the plan)", 64 * 2 ^ 20, {"layers=1", "batch=2000"}, function()
    local m = plan.memory({vocab_size = 256, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1,
      num_attention_heads = 4, num_key_value_heads = 2, tie_word_embeddings = false}, nv.recipe.bf16(), 2000, 16)
    T.ok(m.total > 64 * 2 ^ 20 and m.weights == 4 * (9280 + 16416), "the plan: more than 64 MiB")
    return string.format("this run needs about %.2f GiB by its memory plan (nvlua.plan: weights 0.00, gradients " ..
      "0.00, AdamW 0.00, activations of batch=2000 x seq=16 %.2f, weight copies 0.00, scratch %.2f GiB), more than " ..
      "the 0.06 GiB of a test machine", m.total / GiB, m.activations / GiB, m.transient / GiB)
  end},
  {"a million layers (the cheap bound: nothing planned per layer)", 64 * GiB, {"layers=1000000"},
    "this run cannot fit: it needs at least 163.1 GiB (9.280B parameters x 16 bytes for the weights, gradients " ..
    "and AdamW states: 138.3 GiB; the activations of batch=2 x seq=16 over 1000000 layers: 24.8 GiB), more than " ..
    "the 64.0 GiB of a test machine; lower layers, hidden, ffn, batch or seq (grad_accum keeps the tokens per " ..
    "step), or give check_memory=false to build it anyway"},
}

T.case("a run that cannot fit the machine is refused before anything is allocated, with the plan and the memory",
function()
  local real = train.machine_memory
  for _, c in ipairs(TOO_BIG) do
    train.machine_memory = function() return c[2], "of a test machine" end
    local want = "config: " .. (type(c[4]) == "function" and c[4]() or c[4])
    collectgarbage()
    local before = nv.memory().cpu
    local ok, err = pcall(train.build, cfg(c[3]))
    T.eq(ok, false, c[1] .. ": builds")
    T.ok(tostring(err):sub(1, #want) == want, c[1] .. ":\n  expected " .. want .. "\n  got      " .. tostring(err))
    T.eq(nv.memory().cpu, before, c[1] .. ": nothing allocated")
    -- check_memory=false: built as asked (the small one; a million layers would take minutes)
    if c[2] < GiB then
      local extra = {table.unpack(c[3])}
      extra[#extra + 1] = "check_memory=false"
      T.eq(train.build(cfg(extra)).model.config.num_hidden_layers, 1, c[1] .. ": check_memory=false")
    end
  end
  train.machine_memory = function() return 64 * 2 ^ 20, "of a test machine" end
  T.eq(train.build(cfg({"layers=2"})).model.config.num_hidden_layers, 2, "a run that fits is built")
  train.machine_memory = real
  -- this machine's: MemTotal, or a smaller cgroup limit
  local have, whose = train.machine_memory("cpu")
  local kb = assert(T.read_file("/proc/meminfo")):match("MemTotal:%s*(%d+) kB")
  T.ok(math.type(have) == "integer" and have > 0 and have <= tonumber(kb) * 1024, "bytes: " .. tostring(have))
  T.ok(whose == "of RAM on this machine" or whose:find("cgroup", 1, true), whose)
end)

T.case("train.local_ranks: the ranks on this node as Open MPI, MPICH and Slurm say it; 1 when none does", function()
  local script = T.write_file(T.tmpdir() .. "/ranks.lua", 'io.write(require("nvlua.train").local_ranks())')
  for _, c in ipairs({{{}, "1"}, {{OMPI_COMM_WORLD_LOCAL_SIZE = "4"}, "4"}, {{MPI_LOCALNRANKS = "3"}, "3"},
      {{SLURM_NTASKS_PER_NODE = "8"}, "8"}, {{SLURM_TASKS_PER_NODE = "6(x2)"}, "6"},
      {{OMPI_COMM_WORLD_LOCAL_SIZE = "2", SLURM_TASKS_PER_NODE = "8"}, "2"}}) do
    local r = T.run_nvlua(T.shq(script), {env = c[1]})
    T.eq(r.out, c[2], "local ranks with " .. require("cjson").encode(c[1]) .. "; stderr: " .. r.err)
  end
end)

T.case("cleanup: the scratch directory is removed", function()
  T.rm_tree(T_ROOT)
  T.eq(require("lfs").attributes(T_ROOT), nil)
end)
