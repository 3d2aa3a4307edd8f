-- test_cuda.lua: the CUDA backend's device layer seen from Lua — availability, host<->device
-- copies, the elementwise f32 kernel (add/sub/mul/div, bit-exact against the CPU), unaligned
-- views (the kernel's scalar path), and device memory accounting.
-- Not here: GEMMs (but matmul's dtype rule), quantization on the GPU. Every case but the first needs a GPU and skips
-- without one.
local T = require "nvlua.test"
local nv = require "nvlua"

local need_gpu = T.need_gpu

-- Bit equality of two lists of f32 values read back as Lua floats (f32 -> double is exact, so
-- equal doubles mean equal floats; -0 and +0 differ). NaNs match any NaN: the GPU returns the
-- canonical NaN where x86 keeps an operand's payload.
local function same_bits(x, y)
  if x ~= x then return y ~= y end
  return string.pack("<d", x) == string.pack("<d", y)
end

local function check_equal(got, want, what)
  T.eq(#got, #want, what .. ": length")
  local bad, first = 0, nil
  for i = 1, #want do
    if not same_bits(got[i], want[i]) then
      bad = bad + 1
      first = first or i
    end
  end
  T.ok(bad == 0, bad == 0 and what or string.format(
    "%s: %d of %d elements differ, first at [%d]: got %.9g, want %.9g",
    what, bad, #want, first or 0, got[first or 1] or 0 / 0, want[first or 1] or 0 / 0))
end

local OPS = {
  add = function(x, y) return x + y end,
  sub = function(x, y) return x - y end,
  mul = function(x, y) return x * y end,
  div = function(x, y) return x / y end,
}
local OP_NAMES = { "add", "sub", "mul", "div" }

-- Sizes around the float4 path: empty tail (4, 8), every tail length (1..3, 5, 7), a tail after
-- many float4s (4097), and sizes past one grid's worth so the grid-stride loops turn.
local SIZES = { 1, 2, 3, 4, 5, 7, 8, 4097, (1 << 21) + 5 }

-- gpu(a op b) vs cpu(a op b) on CPU tensors a, b (same shape); frees the device tensors.
local function check_op(name, a, b, what)
  local want = OPS[name](a, b):totable()
  local da, db = a:cuda(), b:cuda()
  local dc = OPS[name](da, db)
  T.eq(dc:device(), "cuda", what .. ": result device")
  check_equal(dc:cpu():totable(), want, what)
  da:free(); db:free(); dc:free()
end

T.case("cuda.available is a boolean; without a GPU :cuda() raises a cuda error", function()
  local ok = nv.cuda.available()
  T.eq(type(ok), "boolean", "nv.cuda.available() type")
  if ok then
    local devs = nv.cuda.devices()
    T.ok(#devs >= 1, "nv.cuda.devices() lists at least one device")
    for i, d in ipairs(devs) do
      T.eq(type(d.name), "string", "devices()[" .. i .. "].name")
      T.ok(type(d.memory) == "number" and d.memory > 0, "devices()[" .. i .. "].memory > 0")
      T.ok(type(d.capability) == "string" and d.capability:match("^%d+%.%d+$") ~= nil,
        "devices()[" .. i .. "].capability looks like '9.0', got " .. tostring(d.capability))
    end
  else
    T.eq(#nv.cuda.devices(), 0, "no devices listed when CUDA is unavailable")
    T.raises(function() return nv.tensor({ 1 }):cuda() end, "[Cc][Uu][Dd][Aa]")
  end
end)

T.case("cpu -> cuda -> cpu round trip is bit-identical", function()
  need_gpu()
  nv.manual_seed(1234)
  for _, n in ipairs(SIZES) do
    local t = nv.randn(n)
    local d = t:cuda()
    T.eq(d:device(), "cuda", "n=" .. n .. ": :cuda() device")
    local back = d:cpu()
    T.eq(back:device(), "cpu", "n=" .. n .. ": :cpu() device")
    check_equal(back:totable(), t:totable(), "round trip n=" .. n)
    d:free()
  end
end)

for _, name in ipairs(OP_NAMES) do
  T.case(name .. " on cuda equals the CPU bit for bit", function()
    need_gpu()
    nv.manual_seed(42)
    for _, n in ipairs(SIZES) do
      check_op(name, nv.randn(n), nv.randn(n), name .. " n=" .. n)
    end
  end)
end

T.case("add/sub/mul/div on special values: subnormals, overflow, signed zeros, inf", function()
  need_gpu()
  -- f32: 1e-38 and 1e-40 are near/below the smallest normal (1.18e-38), 1.4e-45 the smallest
  -- subnormal; 3e38 is near the max (3.4e38). A kernel that flushes subnormals or contracts
  -- into fma fails here. No 0/0 or inf-inf (NaN payloads are not compared bit for bit).
  local a = nv.tensor({ 1e-38, 1e-40, 1.4e-45, 3e38, -3e38, 1.5, -0.0, 0.0, 1, -7, 1 / 3, 1e30, 2, -1e-39 })
  local b = nv.tensor({ 0.01, 3, 1.4e-45, 3e38, 10, 1 / 3, 5, -2, 0.0, -0.0, 3, 1e10, 1e-38, 7 })
  for _, name in ipairs(OP_NAMES) do
    check_op(name, a, b, name .. " special values")
  end
end)

T.case("bf16 add/sub and add_ on cuda equal the CPU bit for bit (8-wide and scalar paths, special values)", function()
  need_gpu()
  nv.manual_seed(43)
  -- bf16 extremes: max, min normal, subnormals, signed zeros, inf, and sums that tie or overflow
  local sa = nv.tensor({ 3.3895e38, -3.3895e38, 1.1755e-38, 9.2e-41, -0.0, 0.0, 1 / 0, 1, 1 + 2 ^ -7, 256, -3, 2 ^ -133 })
  local sb = nv.tensor({ 3.3895e38, 1e38, -1.1755e-38, 9.2e-41, 0.0, -0.0, 1, 2 ^ -8, 2 ^ -8, 1.5, 3, 2 ^ -133 })
  local cases = { { sa:to("bf16"), sb:to("bf16"), "special values" } }
  for _, n in ipairs({ 1, 7, 8, 9, 23, 4097 }) do
    cases[#cases + 1] = { (nv.randn(n) * 100):to("bf16"), nv.randn(n):to("bf16"), "n=" .. n }
  end
  for _, c in ipairs(cases) do
    local a, b, what = c[1], c[2], c[3]
    for _, name in ipairs({ "add", "sub" }) do
      local want = OPS[name](a, b)
      local da, db = a:cuda(), b:cuda()
      local dc = OPS[name](da, db)
      T.eq(dc:dtype(), "bf16", what .. ": " .. name .. " stays bf16")
      T.eq(dc:cpu():bytes(), want:bytes(), what .. ": bf16 " .. name)
      da:free(); db:free(); dc:free()
    end
    local want = a:clone()
    want:add_(b)
    local da = a:cuda()
    da:add_(b:cuda())
    T.eq(da:cpu():bytes(), want:bytes(), what .. ": bf16 add_ in place")
    -- an unaligned view (offset 1 element): the scalar path
    if a:numel() > 2 then
      local n = a:numel() - 1
      local dv, dw = a:cuda():narrow(1, 2, n), b:cuda():narrow(1, 1, n)
      local r = dv + dw
      T.eq(r:cpu():bytes(), (a:narrow(1, 2, n) + b:narrow(1, 1, n)):bytes(), what .. ": unaligned views")
    end
  end
end)

T.case("mixed dtypes on cuda: bf16 op f32 -> f32 as on the CPU; matmul of two dtypes raises (one rule, core/ops.c)", function()
  need_gpu()
  nv.manual_seed(44)
  local a, b = (nv.randn(37) * 10):to("bf16"), nv.randn(37)
  for _, name in ipairs(OP_NAMES) do
    for _, pair in ipairs({ { a, b }, { b, a } }) do
      local x, y = pair[1], pair[2]
      local r = OPS[name](x:cuda(), y:cuda())
      T.eq(r:dtype(), "f32", name .. ": " .. x:dtype() .. " op " .. y:dtype() .. " -> f32")
      check_equal(r:cpu():totable(), OPS[name](x, y):totable(), name .. " mixed, the CPU's bits")
    end
  end
  local ma, mb = nv.randn(4, 8):to("bf16"):cuda(), nv.randn(8, 3):cuda()
  local e = T.raises(function() return ma:matmul(mb) end, "matmul")
  T.ok(e:find("bf16", 1, true) and e:find("f32", 1, true) and e:find("convert one", 1, true), "names both dtypes: " .. e)
  T.eq(ma:matmul(mb:to("bf16")):dtype(), "bf16", "one dtype: runs")
end)

T.case("ops on views with odd offsets (narrowed on the CPU, then copied)", function()
  need_gpu()
  nv.manual_seed(7)
  for _, n in ipairs({ 2, 4, 5, 4098 }) do
    local a, b = nv.randn(n), nv.randn(n)
    local va, vb = a:narrow(1, 2, n - 1), b:narrow(1, 2, n - 1)
    for _, name in ipairs(OP_NAMES) do
      check_op(name, va, vb, name .. " on narrow(1, 2, " .. (n - 1) .. ")")
    end
  end
end)

T.case("ops on unaligned device views (the kernel's scalar path)", function()
  need_gpu()
  nv.manual_seed(8)
  local n = 300007
  local a, b = nv.randn(n), nv.randn(n)
  local da, db = a:cuda(), b:cuda()
  local ok, va = pcall(da.narrow, da, 1, 2, n - 1)
  if not ok then
    da:free(); db:free()
    T.skip("narrow on cuda tensors is not supported: " .. tostring(va))
  end
  -- {start a, start b, length}: offsets 1/1, 1/5 and 4/1 leave a pointer off 16-byte alignment
  -- (scalar path); 4/4 is aligned again (float4 path on a shifted base).
  local cases = {
    { 2, 2, n - 1 }, { 2, 6, n - 5 }, { 5, 5, n - 4 }, { 5, 2, n - 4 },
  }
  for _, c in ipairs(cases) do
    local sa, sb, len = c[1], c[2], c[3]
    local xa, xb = da:narrow(1, sa, len), db:narrow(1, sb, len)
    local ca, cb = a:narrow(1, sa, len), b:narrow(1, sb, len)
    for _, name in ipairs(OP_NAMES) do
      local r = OPS[name](xa, xb)
      check_equal(r:cpu():totable(), OPS[name](ca, cb):totable(),
        string.format("%s at offsets %d/%d, n=%d", name, sa - 1, sb - 1, len))
      r:free()
    end
  end
  da:free(); db:free()
end)

T.case("nv.memory().cuda grows with :cuda() and drops after :free()", function()
  need_gpu()
  local before = nv.memory().cuda
  T.eq(type(before), "number", "nv.memory().cuda type")
  local d = nv.randn(1000):cuda()
  local during = nv.memory().cuda
  T.ok(during >= before + 1000 * 4,
    string.format("cuda bytes grew by at least 4000: before %d, after %d", before, during))
  d:free()
  T.eq(nv.memory().cuda, before, "cuda bytes after :free()")
end)
