-- tests/test_cuda_generate.lua: the KV cache on the GPU: core.attention_forward_at's CUDA kernel
-- (kernels/cuda/attention.cu, the training forward's kernel with a key offset) against the CPU
-- reference, and a tiny Llama's cached forward and greedy generation on cuda against its full forward.
-- Every device output is allocated poisoned (0xFF bytes, an f32 NaN), so an element the kernel leaves
-- unwritten fails the comparison.
--
-- Tolerances: the kernel computes in fp32 with an online softmax, the reference in double: rtol 1e-5,
-- atol 1e-5, as tests/test_cuda_layers.lua's attention forward. The model's cached logits against its
-- full forward on the device: 1e-5 (|logit| + max|logit|), tests/test_generate.lua's f32 bound (the
-- same two attention kernels differ only in their summation order here).
-- Every case needs a GPU (or the CUDA emulation build) and skips without one.
local T = require "nvlua.test"
local nv = require "nvlua"
local nn = require "nvlua.nn"
local data = require "nvlua.data"
local core = nv.core

local function poisoned(fn, ...) return T.with(core.cuda_set_poison, 0xFF, fn, ...) end
local function ref(fn, ...) return T.with(nv.use_reference, true, fn, ...) end

local function near(got, want, rtol, atol, what)
  got, want = got:cpu():to("f32"), want:to("f32")
  local d = (got - want):abs():max()
  T.ok(got:allclose(want, rtol, atol), string.format("%s: max |gpu - ref| = %g", what, d))
end

T.case("attention_forward_at on cuda vs the reference (GQA, a cache longer than the positions, D 8 and 64)", function()
  T.need_gpu()
  for _, c in ipairs({{B = 2, L = 37, Hq = 4, Hkv = 2, D = 8, S = 48}, {B = 1, L = 70, Hq = 2, Hkv = 1, D = 64, S = 70}}) do
    local g = nv.Generator(11)
    local q = nv.randn({c.B, c.L, c.Hq, c.D}, {generator = g})
    local kc = nv.randn({c.B, c.S, c.Hkv, c.D}, {generator = g})
    local vc = nv.randn({c.B, c.S, c.Hkv, c.D}, {generator = g})
    for _, p0 in ipairs({0, 1, 33, c.L - 1}) do
      local qt = q:narrow(2, p0 + 1, c.L - p0):contiguous()
      local out, lse = ref(core.attention_forward_at, qt, kc, vc, p0, 0.3)
      local o, l = poisoned(core.attention_forward_at, qt:cuda(), kc:cuda(), vc:cuda(), p0, 0.3)
      local what = string.format("D %d, pos0 %d", c.D, p0)
      near(o, out, 1e-5, 1e-5, "out " .. what)
      near(l, lse, 1e-5, 1e-5, "lse " .. what)
    end
  end
end)

T.case("a Llama on cuda: cached logits = the full forward's; greedy generate = greedy full forwards", function()
  T.need_gpu()
  local m = nn.Llama({vocab_size = 256, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32}, {seed = 1}):to("cuda")
  m:eval()
  local ids = data.ByteTokenizer:encode("In the beginning God")
  local x = nv.tensor({ids}, "i64"):cuda()
  local full = m:forward(x):cpu():view(1, #ids, 256)
  local cache = m:kv_cache()
  local parts = {{0, m:forward(x:narrow(2, 1, 6):contiguous(), {cache = cache})}}
  for t = 7, #ids do parts[#parts + 1] = {t - 1, m:forward(x:narrow(2, t, 1):contiguous(), {cache = cache})} end
  for _, p in ipairs(parts) do
    local want = full:narrow(2, p[1] + 1, p[2]:size(2))
    local mx = want:abs():max()
    T.ok(p[2]:device() == "cuda", "logits on the device")
    T.ok(p[2]:cpu():allclose(want, 1e-5, 1e-5 * mx), "cached logits at " .. p[1])
  end
  cache:free()
  local _, got = m:generate(data.ByteTokenizer, "And ", {max_new_tokens = 6, temperature = 0})
  local ctx = data.ByteTokenizer:encode("And ")
  for i = 1, 6 do
    local row = m:forward(nv.tensor({ctx}, "i64"):cuda()):select(1, #ctx):cpu():totable()
    local best = 1
    for j = 2, #row do if row[j] > row[best] then best = j end end
    T.eq(got[i], best - 1, "token " .. i)
    ctx[#ctx + 1] = best - 1
  end
end)

T.case("eval on cuda: every request's log-likelihood near the cpu's (f32 through the cache, nvfp4 plain forwards)",
  function()
  T.need_gpu()
  local eval = require "nvlua.eval"
  local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
  local fixture = here .. "/golden/eval"
  -- f32: the same model on both devices; the device's attention and GEMMs sum in another order, so the
  -- per-token bound of the cached-logit case above (1e-5 relative to the largest logit, about 10 here)
  -- per token of the continuation. nvfp4: the device quantizes bit for bit as the CPU (NUMERICS.md), but
  -- its GEMMs' summation order changes the bf16 roundings of the activations between layers (2^-8
  -- relative) and through them, rarely, an nvfp4 code: measured 1.2e-4 per token here, bound 1e-3
  for _, case in ipairs({{"f32", 1e-4}, {"nvfp4", 1e-3}}) do
    local recipe, tol = case[1], case[2]
    local cfg = {vocab_size = 256, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 128}
    local cpu = nn.Llama(cfg, {seed = 1, recipe = recipe})
    local gpu = nn.Llama(cfg, {seed = 1, recipe = recipe}):to("cuda")
    for _, task in ipairs({"arc_easy", "lambada"}) do
      local path = string.format("%s/%s/%s/requests.jsonl.gz", fixture, task, task == "lambada" and "bpb_0shot" or "rc_0shot")
      for _, q in ipairs(eval.load_requests(path, 2)) do
        cpu:eval(); gpu:eval()
        local a = eval.score_question(cpu, data.ByteTokenizer, q)
        local b = eval.score_question(gpu, data.ByteTokenizer, q)
        T.ok(a and b, "scored")
        for i = 1, #a do
          local n = #data.ByteTokenizer:encode(q.requests[i].continuation) + 1
          T.near(b[i].ll, a[i].ll, tol * n, string.format("%s %s doc %d request %d", recipe, task, q.doc_id, i))
        end
      end
    end
    local r = eval.evaluate(gpu, data.ByteTokenizer, "arc_easy", {data_dir = fixture, limit = 2})
    T.eq(r.arc_easy.n, 2)
  end
end)
