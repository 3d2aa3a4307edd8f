-- test_errors.lua: bad input raises a Lua error whose message names what was wrong. The tensor
-- layer's errors name the op, the shapes, dims and dtypes, the way Lua's own argument errors read;
-- the bad-input table (BAD) has one line per option or input that cannot work (input -> message
-- fragments), each a user error (lua/bind/errors.c) that the nvlua program prints as one line
-- without a stack traceback, which the last cases check by running the binary. Each case asserts
-- the message text. That the file runs to its last case is itself the check that none of these
-- inputs crashes the process.
-- Not here: numerical results (test_tensor, test_matmul, test_bf16, test_random).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = require "nvlua.core"

-- fn must raise, and the message must contain every one of the plain substrings.
local function raises_all(fn, ...)
  local err = T.raises(fn)
  for _, s in ipairs({...}) do
    if not err:find(s, 1, true) then error(string.format("error message %q does not contain %q", err, s), 2) end
  end
  return err
end

T.case("add: shapes that do not broadcast; the message names both", function()
  local a, b = nv.zeros(2, 3), nv.zeros(4)
  raises_all(function() return a + b end, "add", "[2,3]", "[4]", "cannot be broadcast")
  raises_all(function() return a:sub(nv.zeros(3, 3)) end, "sub", "[2,3]", "[3,3]")
  raises_all(function() return a * nv.zeros(2, 2, 2) end, "mul", "[2,2,2]")
  raises_all(function() return a:maximum(b) end, "maximum", "[2,3]", "[4]")
  raises_all(function() return a:allclose(b) end, "allclose", "[2,3]", "[4]")
end)

T.case("matmul: inner dims differ; the message names both shapes", function()
  raises_all(function() return nv.zeros(2, 3):matmul(nv.zeros(4, 5)) end, "matmul", "inner dims", "[2,3]", "[4,5]")
  raises_all(function() return nv.matmul(nv.zeros(3, 2), nv.zeros(3, 2)) end, "[3,2]")
  raises_all(function() return nv.zeros(2, 3, 4):matmul(nv.zeros(3, 4, 5)) end, "matmul", "cannot be broadcast")
end)

T.case("matmul: 1-D operands and integer dtypes", function()
  raises_all(function() return nv.zeros(3):matmul(nv.zeros(3, 2)) end, "matmul", "2-D", "[3]")
  raises_all(function() return nv.zeros(3, 2, "i32"):matmul(nv.zeros(2, 2, "i32")) end, "matmul", "f32 or bf16", "i32")
  raises_all(function() return nv.zeros(3, 2):matmul(nv.zeros(2, 2, "u8")) end, "f32 or bf16", "u8")
end)

T.case("invalid dtype names in zeros, to, tensor, arange, empty", function()
  raises_all(function() return nv.zeros(2, "f16") end, "invalid dtype 'f16'", "f32", "bf16")
  raises_all(function() return nv.zeros(2, 3, {dtype = "float"}) end, "invalid dtype 'float'")
  raises_all(function() return nv.zeros(2):to("f16") end, "invalid dtype 'f16'", "bad argument")
  raises_all(function() return nv.tensor({1, 2}, "int") end, "tensor", "invalid dtype 'int'")
  raises_all(function() return nv.arange(3, "half") end, "arange", "invalid dtype 'half'")
  raises_all(function() return nv.empty(2, {dtype = "x"}) end, "empty", "invalid dtype 'x'")
  raises_all(function() return nv.core.empty({2}, "fp8") end, "invalid dtype 'fp8'")
end)

T.case("dim out of range: sum, transpose, select, narrow, size, max", function()
  local t = nv.zeros(2, 3)
  raises_all(function() return t:sum(3) end, "sum", "dim 3 out of range for a 2-D tensor")
  raises_all(function() return t:sum(0) end, "dim 0 out of range")
  raises_all(function() return t:max(-3) end, "max", "dim -3 out of range")
  raises_all(function() return t:transpose(1, 5) end, "transpose", "dim 5 out of range")
  raises_all(function() return t:select(3, 1) end, "select", "dim 3 out of range")
  raises_all(function() return t:narrow(4, 1, 1) end, "narrow", "dim 4 out of range")
  raises_all(function() return t:size(3) end, "size", "dim 3 out of range")
  raises_all(function() return nv.tensor(1):sum(1) end, "dim 1 out of range for a 0-D tensor")
  raises_all(function() return nv.zeros(2, 3, 4):transpose() end, "transpose", "must be 2-D", "3-D")
end)

T.case("index out of range: t[i], get, set, select, narrow", function()
  local v = nv.zeros(3)
  raises_all(function() return v[10] end, "index 10 out of range for dim 1 of size 3")
  raises_all(function() return v[0] end, "index 0 out of range")
  raises_all(function() return v[-4] end, "out of range")
  raises_all(function() v[4] = 1 end, "index 4 out of range")
  local m = nv.zeros(2, 3)
  raises_all(function() return m[3] end, "select", "index 3 out of range for dim 1 of size 2", "[2,3]")
  raises_all(function() return m:get(1, 4) end, "get", "index 4 out of range for dim 2 of size 3")
  raises_all(function() return m:set(3, 1, 0) end, "set", "index 3 out of range for dim 1 of size 2")
  raises_all(function() return m:select(2, 4) end, "select", "index 4 out of range")
  raises_all(function() return m:narrow(2, 2, 3) end, "narrow", "start 2, length 3 out of range for dim 2 of size 3")
  raises_all(function() return m:narrow(1, 0, 1) end, "narrow", "out of range")
  raises_all(function() return m:narrow(1, 1, -1) end, "narrow", "out of range")
end)

T.case("wrong number of indices and non-integer indices", function()
  local m = nv.zeros(2, 3)
  raises_all(function() return m:get(1) end, "get", "1 indices for a 2-D tensor")
  raises_all(function() return m:set(1, 1, 1, 5) end, "set", "3 indices for a 2-D tensor")
  raises_all(function() return m[1.5] end, "index must be an integer", "1.5")
  raises_all(function() m[1.5] = 0 end, "index must be an integer")
  raises_all(function() return nv.tensor(7)[1] end, "cannot index a 0-D tensor")
end)

T.case("view: incompatible element count, non-contiguous tensor, two -1, negative size", function()
  local t = nv.zeros(2, 3)
  raises_all(function() return t:view(4) end, "view", "4 elements", "[2,3]", "6")
  raises_all(function() return t:view(2, 4) end, "view", "8 elements")
  raises_all(function() return t:t():view(6) end, "view", "without a copy", "reshape")
  raises_all(function() return nv.zeros(4, 6):narrow(2, 1, 3):view(12) end, "view", "without a copy")
  raises_all(function() return t:view(-1, -1) end, "view", "only one dim can be -1")
  raises_all(function() return t:view(-2, 3) end, "view", "invalid size -2")
  raises_all(function() return t:view(4, -1) end, "view", "cannot infer dim 2")
  raises_all(function() return t:view(0, -1) end, "view", "cannot infer")
  raises_all(function() return t:reshape(7) end, "reshape", "7 elements")
  raises_all(function() return t:reshape(-1, -1) end, "reshape", "only one dim can be -1")
end)

T.case("creation: negative, non-integer and too many sizes", function()
  raises_all(function() return nv.zeros(-1) end, "zeros", "non-negative integer", "-1")
  raises_all(function() return nv.ones(2, -3) end, "ones", "size #2", "-3")
  raises_all(function() return nv.zeros({2, -1}) end, "zeros", "non-negative")
  raises_all(function() return nv.zeros(1.5) end, "zeros", "must be an integer", "1.5")
  raises_all(function() return nv.rand(2, 2.5) end, "rand", "size #2", "2.5")
  raises_all(function() return nv.zeros(2, true) end, "zeros", "size #2 must be an integer, got boolean")
  raises_all(function() return nv.core.empty({2, -3}) end, "empty", "negative size -3")
  raises_all(function() return nv.zeros(1, 1, 1, 1, 1, 1, 1, 1, 1) end, "too many dims")
  raises_all(function() return nv.zeros(2 ^ 31, 2 ^ 31) end, "too large")
  raises_all(function() return nv.zeros(1 << 48) end, "out of host memory")
  raises_all(function() return nv.full(3, 1) end, "full", "sizes must be a table")
  raises_all(function() return nv.full({3}, "x") end, "full", "value must be a number")
  raises_all(function() return nv.zeros({dtype = "f32"}) end, "zeros", "missing sizes")
end)

T.case("arange: zero step, non-number arguments", function()
  raises_all(function() return nv.arange(0, 1, 0) end, "arange", "step must not be zero")
  raises_all(function() return nv.arange({}) end, "arange", "must be a number")
  raises_all(function() return nv.arange(0, {}, 1) end, "arange", "argument #2 must be a number")
end)

T.case("non-tensor arguments to methods", function()
  local t = nv.zeros(2, 2)
  raises_all(function() return t:add("x") end, "add", "expected tensors or numbers", "string")
  raises_all(function() return t + {} end, "add", "expected tensors or numbers", "table")
  raises_all(function() return t:matmul(5) end, "matmul", "nvlua.Tensor expected, got number")
  raises_all(function() return t:copy_({1, 2}) end, "copy_", "nvlua.Tensor expected")
  raises_all(function() return t:is_view_of(nil) end, "nvlua.Tensor expected")
  raises_all(function() return t:allclose(1) end, "allclose", "nvlua.Tensor expected")
  raises_all(function() return t:fill_("x") end, "fill_", "number expected")
  raises_all(function() return t:set(1, 1, "x") end, "set", "number expected")
  raises_all(function() return t:sum("x") end, "sum", "number expected")
  raises_all(function() t[1] = "s" end, "number or nvlua.Tensor expected")
end)

T.case("methods called with a non-tensor self", function()
  raises_all(function() return nv.Tensor.size(5) end, "bad argument #1 to 'size'", "nvlua.Tensor expected, got number")
  raises_all(function() return nv.Tensor.sum("x") end, "bad argument #1", "nvlua.Tensor expected, got string")
  raises_all(function() return nv.Tensor.matmul({}, nv.zeros(2, 2)) end, "nvlua.Tensor expected, got table")
  raises_all(function() return nv.Tensor.view(nil, 2) end, "nvlua.Tensor expected, got nil")
  raises_all(function() return nv.default_generator().seed(5) end, "nvlua.Generator expected, got number")
end)

T.case("nv.tensor: ragged, non-numeric and too deeply nested tables", function()
  raises_all(function() return nv.tensor({{1, 2}, {3}}) end, "tensor", "ragged nested table", "length 1 at depth 2")
  raises_all(function() return nv.tensor({{1, 2}, 3}) end, "tensor", "ragged nested table", "depth 2")
  raises_all(function() return nv.tensor({1, {2}}) end, "tensor", "expected a number", "got table")
  raises_all(function() return nv.tensor({1, "x"}) end, "tensor", "expected a number", "got string")
  raises_all(function() return nv.tensor({1, nil, 3}) end, "tensor")
  raises_all(function() return nv.tensor("abc") end, "table or number expected")
  raises_all(function() return nv.tensor({{{{{{{{{1}}}}}}}}}) end, "nested deeper than 8")
end)

T.case("use after free", function()
  local t = nv.ones(2, 3)
  t:free()
  raises_all(function() return t:sum() end, "sum", "has been freed")
  raises_all(function() return t + 1 end, "add", "freed")
  raises_all(function() return t:matmul(nv.ones(3, 2)) end, "matmul", "freed")
  raises_all(function() return nv.ones(2, 3):copy_(t) end, "copy_", "freed")
  raises_all(function() return t:view(6) end, "view", "freed")
  raises_all(function() return t[1] end, "freed")
  raises_all(function() return t:totable() end, "totable", "freed")
  raises_all(function() return t:to("bf16") end, "to", "freed")
  raises_all(function() return nv.core.rand_(t) end, "rand", "freed")
end)

T.case("permute: repeated dim, wrong count, out of range", function()
  local t = nv.zeros(2, 3, 4)
  raises_all(function() return t:permute(1, 1, 2) end, "permute", "permutation of 1..3")
  raises_all(function() return t:permute(1, 2) end, "permute", "got 2 dims for a 3-D tensor")
  raises_all(function() return t:permute(1, 2, 4) end, "permute", "permutation")
  raises_all(function() return t:permute(0, 1, 2) end, "permute", "permutation")
end)

T.case("expand: incompatible size, fewer dims", function()
  raises_all(function() return nv.zeros(4):expand(2, 3) end, "expand", "size 4 of dim 1 of [4] cannot become 3")
  raises_all(function() return nv.zeros(2, 3):expand(3) end, "expand", "cannot expand [2,3] to 1 dims")
  raises_all(function() return nv.zeros(2, 1):expand(3, 5) end, "expand", "cannot become 3")
end)

T.case("copy_: a source that does not broadcast to the destination", function()
  raises_all(function() return nv.zeros(2, 3):copy_(nv.zeros(4)) end, "copy", "[4]", "[2,3]", "does not broadcast")
  raises_all(function() return nv.zeros(2, 3):copy_(nv.zeros(2, 2, 3)) end, "copy", "does not broadcast")
  raises_all(function() nv.zeros(2, 3)[1] = nv.zeros(4) end, "does not broadcast")
end)

T.case("rand/randn with an integer dtype", function()
  raises_all(function() return nv.rand(3, "i32") end, "rand", "f32 or bf16", "i32")
  raises_all(function() return nv.randn(3, "u8") end, "randn", "f32 or bf16", "u8")
  raises_all(function() return nv.rand(3, {dtype = "i64"}) end, "rand", "i64")
end)

T.case("generators: bad seed, negative offset, wrong generator argument", function()
  raises_all(function() return nv.Generator("x") end, "Generator", "number expected")
  raises_all(function() return nv.Generator(1.5) end, "Generator", "number has no integer representation")
  raises_all(function() return nv.Generator(1):set_offset(-1) end, "set_offset", "offset must be >= 0")
  raises_all(function() return nv.core.rand_(nv.zeros(2), 5) end, "nvlua.Generator expected")
end)

T.case("reductions of an empty tensor (max, min, amax); sum of empty is 0", function()
  raises_all(function() return nv.zeros(0):max() end, "max", "the tensor is empty")
  raises_all(function() return nv.zeros(0):min() end, "min", "empty")
  raises_all(function() return nv.zeros(0, 3):amax() end, "amax", "empty")
  raises_all(function() return nv.zeros(2, 0):max(2) end, "max", "dim 2 of [2,0] is empty")
  T.eq(nv.zeros(0):sum(), 0, "sum of nothing is 0")
  T.eq(nv.zeros(0, 3):max(2):size(), {0}, "max over a non-empty dim of an empty tensor is empty, not an error")
end)

T.case("item of a tensor with more than one element", function()
  raises_all(function() return nv.zeros(2, 3):item() end, "item", "6 elements", "expected 1")
  raises_all(function() return nv.zeros(0):item() end, "item", "0 elements")
end)

-- nv.zeros(2, {device = "tpu"}) passes the device name to t:to(), which reads it as a dtype
T.case("devices: an unknown device name is reported as a device", function()
  raises_all(function() return nv.core.empty({2}, "f32", "tpu") end, "invalid device 'tpu'", "cpu, cuda")
  raises_all(function() return nv.zeros(2, {device = "tpu"}) end, "device", "tpu")
end)

T.case("cuda without a GPU: :cuda(), :to('cuda') and device='cuda' raise an error naming cuda", function()
  if nv.cuda.available() then T.skip("a GPU is present") end
  raises_all(function() return nv.zeros(2):cuda() end, "cuda")
  raises_all(function() return nv.zeros(2):to("cuda") end, "cuda")
  raises_all(function() return nv.zeros(2, {device = "cuda"}) end, "cuda")
  T.eq(nv.memory().cuda, 0, "nothing was allocated on the device")
end)

T.case("odd but legal inputs do not crash", function()
  -- each either works or raises an ordinary error; the process must continue past them all
  local odd = {
    function() return nv.zeros(0):view(0, 5) end,
    function() return nv.zeros(0, 3):t():contiguous() end,
    function() return nv.zeros(0):sum(1, true) end,
    function() return nv.zeros(3, 0):mean(2) end,
    function() return nv.zeros(0, 4):matmul(nv.zeros(4, 0)) end,
    function() return nv.tensor(2):expand(3, 4):sum() end,
    function() return nv.tensor(2):view() end,
    function() return nv.zeros(2, 3):expand(4, 2, 3):permute(3, 1, 2):reshape(-1) end,
    function() return nv.zeros(1, 1, 1, 1, 1, 1, 1, 1):view(1) end,
    function() return nv.zeros(5):narrow(1, 6, 0) end,
    function() return nv.zeros(5):narrow(1, 5, 1):select(1, 1) end,
    function() return tostring(nv.zeros(0, 0, 0)) end,
    function() return nv.zeros(3):to("u8"):to("bf16"):to("i64"):to("f32") end,
    function() local t = nv.zeros(3); t:free(); t:free(); return tostring(t) end,
  }
  for i, f in ipairs(odd) do
    local ok, err = pcall(f)
    T.ok(ok or type(err) == "string", "input " .. i .. " raised a non-string error")
  end
  T.eq(nv.zeros(5):narrow(1, 6, 0):numel(), 0, "an empty narrow at the end is legal")
  T.eq(nv.tensor(2):expand(3, 4):sum(), 24)
end)

-- ---- the bad-input table: options and inputs that cannot work --------------------------------------

local hf = require "nvlua.hf"
local nn = require "nvlua.nn"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local prune = require "nvlua.prune"
local recipe = require "nvlua.recipe"
local config = require "nvlua.config"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests"
local HF = here .. "/data/hf/llama31"
local NAN, INF = 0 / 0, math.huge

local SIZES = {vocab_size = 16, hidden_size = 16, intermediate_size = 32, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2}
local function sizes(extra)
  local c = {}
  for k, v in pairs(SIZES) do c[k] = v end
  for k, v in pairs(extra or {}) do c[k] = v end
  return c
end
local function model() return llama.Llama(sizes(), {seed = 1}) end
local function params() return nn.Linear(2, 2):named_parameters() end
-- prune.importance's table for model() with every score 1, then edited by fn(imp)
local function importance(fn)
  local imp = {ffn = {}, heads = {}, kv = {}, hidden = nv.ones(16), blocks = {}}
  for b = 0, 1 do imp.ffn[b], imp.heads[b], imp.kv[b], imp.blocks[b] = nv.ones(32), nv.ones(4), nv.ones(2), 1.0 end
  if fn then fn(imp) end
  return imp
end
local function parse(defaults, a) return config.parse(defaults, {a}) end

-- {input, fn raising the error, fragments of its message...}; internal = true: a programming error,
-- which keeps its traceback (the rest are user errors).
local BAD = {
  {"from_pretrained recipe='unknown'", function() hf.from_pretrained(HF, {recipe = "unknown"}) end,
    "from_pretrained: option recipe must be a recipe value or the name of one (f32, bf16", "got unknown"},
  {"from_pretrained recipe={}", function() hf.from_pretrained(HF, {recipe = {}}) end, "option recipe must be"},
  {"set_recipe('nvfp5')", function() model():set_recipe("nvfp5") end, "set_recipe: unknown recipe 'nvfp5' (valid: f32"},
  {"Llama recipe=42", function() llama.Llama(sizes(), {recipe = 42}) end,
    "set_recipe: the recipe must be a recipe value (nvlua.recipe) or the name of one, got 42"},
  {"mor threshold=-1", function() recipe.mor({threshold = -1}) end,
    "recipe.mor: threshold for e4m3 must be a number >= 0 (a relative error; math.huge: always within), got -1"},
  {"mor threshold=NaN", function() recipe.mor({threshold = NAN}) end,
    "threshold for e4m3 must be a number >= 0", "got " .. tostring(NAN)},
  {"mor threshold={nvfp4=-inf}", function() recipe.mor({candidates = {"nvfp4"}, threshold = {nvfp4 = -INF}}) end,
    "threshold for nvfp4 must be a number >= 0", "got -inf"},
  {"mor candidates with a hole", function() recipe.mor({candidates = {"e4m3", nil, "nvfp4"}}) end,
    "recipe.mor: candidates has a hole: candidates[2] is nil (of 3)"},
  {"mor candidates={[2]=e4m3}", function() recipe.mor({candidates = {[2] = "e4m3"}}) end,
    "candidates has a hole: candidates[1] is nil (of 2)"},
  {"prune.width imp={}", function() prune.width(model(), {}, {ffn = 16}) end,
    "prune: width: importance.hidden must be a 1-D tensor of 16 scores (the model's hidden_size), got nil"},
  {"prune.width ffn[1] of 8 scores", function() prune.width(model(), importance(function(i) i.ffn[1] = nv.ones(8) end)) end,
    "prune: width: importance.ffn[1] must be a 1-D tensor of 32 scores (the model's intermediate_size), got [8]"},
  {"prune.width heads[0] holding a NaN",
    function() prune.width(model(), importance(function(i) i.heads[0][3] = NAN end), {heads = 2}) end,
    "prune: width: importance.heads[0][3] is " .. tostring(NAN) .. ", not a finite score"},
  {"prune.width kv missing", function() prune.width(model(), importance(function(i) i.kv = nil end)) end,
    "prune: width: importance.kv must be a table {[block] = scores}, got nil"},
  {"prune.depth blocks[1]=nil", function() prune.depth(model(), importance(function(i) i.blocks[1] = nil end), {layers = 1}) end,
    "prune: depth: importance.blocks[1] must be a finite number (block 1's score), got nil"},
  {"prune.depth imp='x'", function() prune.depth(model(), "x", {layers = 1}) end, "prune: depth: imp must be the table"},
  {"config lr=0x10", function() parse({lr = 0.1}, "lr=0x10") end,
    "config: lr must be a number written in decimal (such as 3e-4 or 0.0003), got '0x10'"},
  {"config lr=0x1p4", function() parse({lr = 0.1}, "lr=0x1p4") end, "config: lr must be a number written in decimal"},
  {"config lr=' 1'", function() parse({lr = 0.1}, "lr= 1") end, "config: lr must be a number written in decimal"},
  {"config steps=0x10", function() parse({steps = 1}, "steps=0x10") end,
    "config: steps must be an integer written in decimal, got '0x10'"},
  {"config steps=2.5", function() parse({steps = 1}, "steps=2.5") end, "config: steps must be an integer, got '2.5'"},
  {"AdamW lr=-1", function() optim.AdamW(params(), {lr = -1}) end, "AdamW: option lr must be a finite number >= 0, got -1"},
  {"AdamW lr=NaN", function() optim.AdamW(params(), {lr = NAN}) end, "AdamW: option lr must be a finite number >= 0"},
  {"AdamW eps=inf", function() optim.AdamW(params(), {eps = INF}) end, "AdamW: option eps must be a finite number > 0, got inf"},
  {"AdamW eps=0 (0 / 0 for moments still 0)", function() optim.AdamW(params(), {eps = 0}) end,
    "AdamW: option eps must be a finite number > 0, got 0"},
  {"AdamW weight_decay=-0.1", function() optim.AdamW(params(), {weight_decay = -0.1}) end,
    "AdamW: option weight_decay must be a finite number >= 0, got -0.1"},
  {"AdamW betas={0.9, 1}", function() optim.AdamW(params(), {betas = {0.9, 1}}) end,
    "AdamW: option betas must be {beta1, beta2}, each a number in [0, 1), got {0.9, 1}"},
  {"AdamW group lr_scale=-1", function() optim.AdamW({{params = params(), lr_scale = -1}}) end,
    "AdamW group #1: option lr_scale must be a finite number >= 0, got -1"},
  {"ShardedAdamW lr=-1", function() optim.ShardedAdamW(model(), {lr = -1}, {}) end,
    "ShardedAdamW: option lr must be a finite number >= 0, got -1"},
  {"opt:set_lr(NaN)", function() optim.AdamW(params()):set_lr(NAN) end, "set_lr: lr must be a finite number >= 0"},
  {"opt:set_lr(inf)", function() optim.AdamW(params()):set_lr(INF) end, "set_lr: lr must be a finite number >= 0, got inf"},
  {"clip_grad_norm(NaN)", function() optim.clip_grad_norm(params(), NAN) end,
    "clip_grad_norm: max_norm must be a finite number > 0, got " .. tostring(NAN)},
  {"opt:clip_grad_norm(inf)", function() optim.AdamW(params()):clip_grad_norm(INF) end,
    "clip_grad_norm: max_norm must be a finite number > 0, got inf"},
  {"opt:clip_grad_norm(-1)", function() optim.AdamW(params()):clip_grad_norm(-1) end,
    "clip_grad_norm: max_norm must be a finite number > 0, got -1"},
  {"core.grad_norm_multi max_norm=inf",
    function() core.grad_norm_multi(nv.zeros(4, {dtype = "i64"}), {nv.zeros(3)}, INF) end,
    "grad_norm_multi: max_norm must be a finite number > 0, got inf"},
  {"core.adamw_step lr=-1", function()
    local p = nv.zeros(2)
    core.adamw_step(p, nv.zeros(2), nv.zeros(2), nv.zeros(2),
      {lr = -1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0, step = 1})
  end, "adamw_step: lr must be a finite number >= 0, got -1"},
  {"llama_config initializer_range=NaN", function() nn.llama_config(sizes({initializer_range = NAN})) end,
    "llama_config: initializer_range must be a finite number > 0, got " .. tostring(NAN)},
  {"llama_config rms_norm_eps=-1", function() nn.llama_config(sizes({rms_norm_eps = -1})) end,
    "llama_config: rms_norm_eps must be a finite number > 0, got -1"},
  {"llama_config rope_theta=inf", function() nn.llama_config(sizes({rope_theta = INF})) end,
    "llama_config: rope_theta must be a finite number > 0, got inf"},
  {"llama_config({})", function() nn.llama_config({}) end,
    "llama_config: the config must give the model's sizes vocab_size, hidden_size, intermediate_size, " ..
    "num_hidden_layers, num_attention_heads; missing: vocab_size, hidden_size, intermediate_size, num_hidden_layers, " ..
    "num_attention_heads"},
  {"nn.Llama without intermediate_size", function() nn.Llama(sizes({intermediate_size = false})) end,
    "llama_config: intermediate_size must be an integer >= 1, got false"},
  {"Linear std=NaN", function() nn.Linear(2, 2, {std = NAN}) end, "Linear: option std must be a finite number >= 0"},
  {"Embedding std=-1", function() nn.Embedding(4, 2, {std = -1}) end,
    "Embedding: option std must be a finite number >= 0, got -1"},
  {"RMSNorm eps=0", function() nn.RMSNorm(4, {eps = 0}) end, "RMSNorm: option eps must be a finite number > 0, got 0"},
  {"save_pretrained max_shard_size='0x10GB'", function() hf.parse_size("0x10GB") end,
    "save_pretrained: max_shard_size must be an integer >= 1 (bytes) or a size such as \"5GB\""},
  {"shapes that do not broadcast", function() return nv.zeros(2, 3) + nv.zeros(4) end,
    "add: shapes [2,3] f32 and [4] f32 cannot be broadcast"},
  {"coroutine.yield inside nv.scope", function()
    local co = coroutine.create(function() nv.scope(function() coroutine.yield(1) end) end)
    local ok, err = coroutine.resume(co)
    assert(not ok)
    error(err, 0)
  end, "coroutine.yield inside nv.scope (1 open in this coroutine): a scope closes when its function returns",
    internal = true},
  {"coroutine.yield inside nv.unscoped", function()
    local co = coroutine.wrap(function() nv.unscoped(function() coroutine.yield(1) end) end)
    co()
  end, "coroutine.yield inside nv.unscoped: its function cannot yield", internal = true},
}

T.case("the bad-input table: each input raises its message, a user error unless marked internal", function()
  for _, row in ipairs(BAD) do
    local ok, err = pcall(row[2])
    T.ok(not ok, row[1] .. ": expected an error")
    err = tostring(err)
    for i = 3, #row do
      if not err:find(row[i], 1, true) then
        error(string.format("%s: message %q does not contain %q", row[1], err, row[i]))
      end
    end
    T.eq(core.is_user_error(err), not row.internal, row[1] .. ": a user error? " .. err)
  end
end)

T.case("the options that were refused still take their good values", function()
  T.ok(recipe.is_recipe(hf.from_pretrained(HF, {recipe = "bf16"}).lm_head.recipe), "a recipe by name")
  T.eq(recipe.mor({threshold = 0}).mor.threshold, {0})
  T.eq(recipe.mor({threshold = INF}).mor.threshold, {INF}, "+inf: every finite error is within")
  T.eq(parse({lr = 0.1}, "lr=3e-4").lr, 3e-4)
  T.eq(parse({lr = 0.1}, "lr=.5").lr, 0.5)
  T.eq(parse({lr = 0.1}, "lr=-2").lr, -2.0)
  T.eq(parse({steps = 1}, "steps=1e3").steps, 1000)
  T.eq(parse({steps = 1}, "steps=+7").steps, 7)
  local opt = optim.AdamW(params(), {lr = 0, betas = {0, 0.999}, eps = 1e-30, weight_decay = 0})
  opt:set_lr(0)
  T.eq(opt:get_lr(), 0)
  T.eq(optim.clip_grad_norm(params(), 1e-30), 0.0)
  T.eq(nn.llama_config(sizes()).initializer_range, 0.02)
  T.eq(nn.Linear(2, 2, {std = 0}).weight_entry.param:abs():sum(), 0)
  local small = prune.depth(model(), importance(), {layers = 1})
  T.eq(small.config.num_hidden_layers, 1)
  -- a coroutine still yields outside a scope, and from a scope opened outside it
  local co = coroutine.wrap(function(a) local b = coroutine.yield(a + 1); return b * 2 end)
  T.eq(co(1), 2)
  T.eq(co(5), 10)
  T.eq(nv.scope(function()
    local c2 = coroutine.wrap(function() coroutine.yield(nv.scope_depth()) end)
    return c2()
  end), 0, "the coroutine has no scope of its own open")
  -- the scope the refused yield was in was closed as the error unwound
  local t
  local c3 = coroutine.create(function()
    pcall(nv.scope, function() t = nv.zeros(2); coroutine.yield() end)
    return nv.scope_depth()
  end)
  local ok, depth = coroutine.resume(c3)
  T.ok(ok)
  T.eq(depth, 0)
  T.raises(function() return t:sum() end, "has been freed")
end)

-- ---- scripts/prepare_data.py: its arguments and its tokenizer file ---------------------------------

local function prepare_data(args)
  if not os.execute("command -v python3 >/dev/null 2>&1") then T.skip("no python3") end
  local err = os.tmpname()
  local script = here .. "/../scripts/prepare_data.py"
  local _, how, code = os.execute(string.format("python3 %s %s >/dev/null 2>%s", T.shq(script), args, T.shq(err)))
  local text = assert(T.read_file(err))
  os.remove(err)
  return how == "exit" and code or -1, text
end

T.case("prepare_data.py: bad arguments and unreadable tokenizers are refused, naming the option and the file", function()
  local lfs = require "lfs"
  local dir = T.tmpdir()
  assert(lfs.mkdir(dir .. "/tok"))
  assert(lfs.mkdir(dir .. "/badcfg"))
  local out, doc = dir .. "/out", T.write_file(dir .. "/doc.txt", string.rep("In the beginning. ", 100))
  local bad_json = T.write_file(dir .. "/tok/tokenizer.json", "{not json")
  local array = T.write_file(dir .. "/arr.json", "[1, 2]")
  T.write_file(dir .. "/badcfg/tokenizer.json", "{}")
  T.write_file(dir .. "/badcfg/tokenizer_config.json", "{oops")
  local PY_BAD = { -- arguments -> a fragment of the one-line message
    {"--tokenizer bytes --batch 0", "prepare_data: --batch must be an integer >= 1 (documents tokenized at a time), got 0"},
    {"--tokenizer bytes --batch -3", "--batch must be an integer >= 1 (documents tokenized at a time), got -3"},
    {"--tokenizer bytes --shard-tokens 0", "--shard-tokens must be an integer >= 1, got 0"},
    {"--tokenizer bytes --val-fraction nan", "--val-fraction must be a number in (0, 1), got nan"},
    {"--tokenizer " .. dir .. "/none.json", "--tokenizer " .. dir .. "/none.json: no such file"},
    {"--tokenizer " .. dir, "--tokenizer " .. dir .. "/tokenizer.json: no such file"},
    {"--tokenizer " .. dir .. "/tok", "--tokenizer " .. bad_json .. ": not valid JSON"},
    {"--tokenizer " .. array, "--tokenizer " .. array .. ": expected a JSON object, got a list"},
    {"--tokenizer " .. dir .. "/badcfg", dir .. "/badcfg/tokenizer_config.json: not valid JSON", needs = "tokenizers"},
    {"--tiktoken " .. dir .. "/none.tiktoken", "--tiktoken " .. dir .. "/none.tiktoken: no such file"},
    {"--tiktoken cl100k_base --tiktoken-encoding cl100k_base", "--tiktoken-encoding names the encoding of a --tiktoken file"},
  }
  local has_tokenizers = os.execute("python3 -c 'import tokenizers' >/dev/null 2>&1")
  for _, row in ipairs(PY_BAD) do
    if not row.needs or has_tokenizers then
      local code, err = prepare_data(T.shq(out) .. " " .. T.shq(doc) .. " " .. row[1])
      T.eq(code, 2, row[1] .. ": exit status")
      T.ok(err:find(row[2], 1, true), string.format("%s: stderr %q should contain %q", row[1], err, row[2]))
      T.eq(err:find("Traceback", 1, true), nil, row[1] .. ": no Python traceback: " .. err)
    end
  end
  T.eq(lfs.attributes(out), nil, "nothing was written")
  T.rm_tree(dir)
end)

-- ---- messages for people: the nvlua program prints a user error as one line -------------------------

T.case("nvlua: a user error prints its one line without a traceback; NVLUA_TRACEBACK=1 brings it back", function()
  local dir = T.tmpdir()
  local script = T.write_file(dir .. "/cfg.lua",
    "local c = require('nvlua.config').parse({lr = 0.1, steps = 10}, arg)\nprint(c.lr)\n")
  local msg = "nvlua: config: lr must be a number written in decimal (such as 3e-4 or 0.0003), got '0x10'\n"
  local r = T.run_nvlua(T.shq(script) .. " lr=0x10")
  T.eq(r.code, 1)
  T.eq(r.out, "")
  T.eq(r.err, msg, "the message alone")
  r = T.run_nvlua(T.shq(script) .. " lr=0x10", {env = {NVLUA_TRACEBACK = "1"}})
  T.eq(r.code, 1)
  T.ok(r.err:sub(1, #msg) == msg and r.err:find("\nstack traceback:\n", 1, true), "the traceback is back: " .. r.err)
  T.ok(r.err:find("cfg.lua:1: in main chunk", 1, true), "it shows the script's line: " .. r.err)
  r = T.run_nvlua(T.shq(script) .. " lr=3e-4")
  T.eq(r.code, 0)
  T.eq(r.out, "0.0003\n")
  -- user errors raised by C (a core status, an options table) and by the library
  for _, case in ipairs({
    {"local nv = require 'nvlua'; local x = nv.zeros(2, 3) + nv.zeros(4)", "add: shapes [2,3] f32 and [4] f32"},
    {"local z = require('nvlua').zeros(2); require('nvlua.core').adamw_step(z, z, z, z, {lr = 1, bogus = 2})",
      "adamw_step: unknown option 'bogus'"},
    {"require('nvlua.optim').AdamW(require('nvlua.nn').Linear(2, 2), {lr = -1})",
      "AdamW: option lr must be a finite number >= 0, got -1"},
    {"require('nvlua.hf').from_pretrained('/nonexistent/model')", "from_pretrained: /nonexistent/model: no such directory"},
    {"require('nvlua.nn').llama_config({})", "llama_config: the config must give the model's sizes"},
  }) do
    r = T.run_nvlua("-e " .. T.shq(case[1]))
    T.eq(r.code, 1, case[1])
    T.ok(r.err:find(case[2], 1, true), case[1] .. ": " .. r.err)
    T.eq(select(2, r.err:gsub("\n", "")), 1, case[1] .. ": one line: " .. r.err)
  end
  T.rm_tree(dir)
end)

T.case("nvlua: an internal error (a script calling nil, an error() of its own) keeps its traceback", function()
  local dir = T.tmpdir()
  local script = T.write_file(dir .. "/bug.lua", "local function f() local g = nil; g() end\nf()\n")
  local r = T.run_nvlua(T.shq(script))
  T.eq(r.code, 1)
  T.ok(r.err:find("nvlua: " .. script .. ":1: attempt to call a nil value (local 'g')\nstack traceback:\n", 1, true), r.err)
  T.ok(r.err:find(script .. ":2: in main chunk", 1, true), r.err)
  -- a script's own error, and a user error's message raised again as a new string, are internal
  r = T.run_nvlua("-e " .. T.shq("error('mine')"))
  T.ok(r.err:find("mine\nstack traceback:", 1, true), r.err)
  r = T.run_nvlua("-e " .. T.shq("local ok, e = pcall(require('nvlua.nn').llama_config, {}); error('wrapped: ' .. e)"))
  T.ok(r.err:find("wrapped: llama_config", 1, true) and r.err:find("stack traceback:", 1, true), r.err)
  -- caught and raised again unchanged, it is still a user error
  r = T.run_nvlua("-e " .. T.shq("local ok, e = pcall(require('nvlua.nn').llama_config, {}); error(e, 0)"))
  T.eq(select(2, r.err:gsub("\n", "")), 1, "one line: " .. r.err)
  T.rm_tree(dir)
end)
