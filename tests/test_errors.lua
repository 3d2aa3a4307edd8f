-- test_errors.lua: bad input to the tensor layer raises a Lua error whose message names the op
-- and what was wrong (shapes, dims, dtypes), the way Lua's own argument errors read. Each case
-- asserts the message text. That the file runs to its last case is itself the check that none
-- of these inputs crashes the process.
-- Not here: numerical results (test_tensor, test_matmul, test_bf16, test_random).
local T = require "nvlua.test"
local nv = require "nvlua"

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
