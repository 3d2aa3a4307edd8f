-- test_tensor.lua: the CPU tensor layer seen from Lua — creation for every dtype, metadata,
-- view semantics (writes through views reach the base), copies, non-contiguous inputs to every
-- op, broadcasting, dtype promotion, elementwise ops against plain Lua math, reductions,
-- allclose, item, printing and memory accounting.
-- Not here: matmul accuracy (test_matmul), bf16 rounding ties (test_bf16), Philox and the random
-- streams (test_random), error messages of bad input (test_errors), CUDA (test_cuda).
-- Expected values come from plain Lua arithmetic on totable() results or from literals, never
-- from the op under test; the one exception is the non-contiguous case, which compares an op on
-- a strided view with the same op on its contiguous clone (a consistency contract).
local T = require "nvlua.test"
local nv = require "nvlua"

local DTYPES = {"f32", "bf16", "i32", "i64", "u8"}
local BYTES = {f32 = 4, bf16 = 2, i32 = 4, i64 = 8, u8 = 1}
local IS_FLOAT = {f32 = true, bf16 = true, i32 = false, i64 = false, u8 = false}

-- x rounded to the nearest f32 (C's double -> float conversion: round to nearest even).
local function f32(x) return (string.unpack("f", string.pack("f", x))) end

-- x rounded to the nearest bf16, ties to even; written here from the definition (a bf16 has an
-- 8-bit significand; below 2^-126 the spacing is fixed at 2^-133), independent of core/dtype.c.
local function bf16(x)
  if x ~= x or x == 0 or x == math.huge or x == -math.huge then return x end
  local a = math.abs(x)
  local e = ((string.unpack("<I8", string.pack("<d", a)) >> 52) & 0x7ff) - 1023
  if e < -126 then e = -126 end
  local q = 2.0 ^ (e - 7)
  local y = a / q                            -- exact: a power-of-two scaling
  local n = math.floor(y)
  local frac = y - n
  if frac > 0.5 or (frac == 0.5 and n % 2 == 1) then n = n + 1 end
  local r = n * q
  if r >= 2.0 ^ 128 then r = math.huge end
  return x < 0 and -r or r
end

local function flat(t, out)
  out = out or {}
  if type(t) ~= "table" then out[#out + 1] = t; return out end
  for _, v in ipairs(t) do flat(v, out) end
  return out
end

local function live() collectgarbage(); collectgarbage(); return nv.memory() end

-- ---- creation ---------------------------------------------------------------------------

T.case("zeros/ones/full/empty: shape, dtype and values for each dtype", function()
  for _, dt in ipairs(DTYPES) do
    local z = nv.zeros(2, 3, dt)
    T.eq(z:size(), {2, 3}, dt .. " zeros size")
    T.eq(z:dtype(), dt)
    T.eq(z:totable(), {{0, 0, 0}, {0, 0, 0}}, dt .. " zeros")
    T.eq(nv.ones({2, 2}, dt):totable(), {{1, 1}, {1, 1}}, dt .. " ones (sizes as a table)")
    T.eq(nv.ones(3, {dtype = dt}):dtype(), dt, dt .. " ones with an options table")
    T.eq(nv.full({3}, 7, dt):totable(), {7, 7, 7}, dt .. " full")
    local e = nv.empty(4, 5, {dtype = dt})
    T.eq(e:size(), {4, 5}); T.eq(e:dtype(), dt)
    -- integer dtypes hand back Lua integers, float dtypes Lua floats
    T.eq(math.type(nv.ones(1, dt)[1]), IS_FLOAT[dt] and "float" or "integer", dt .. " element type")
  end
  T.eq(nv.zeros(2):dtype(), "f32", "default dtype")
  -- conversions on store (dtype.h): floats round to nearest even, integers truncate toward zero
  -- and saturate
  T.eq(nv.full({1}, 1 / 3, "bf16")[1], 0.333984375, "bf16(1/3) = 0x3eab")
  T.eq(nv.full({1}, 1 / 3, "f32")[1], f32(1 / 3))
  T.eq(nv.full({2}, 2.7, "i32"):totable(), {2, 2})
  T.eq(nv.full({2}, -2.7, "i64"):totable(), {-2, -2})
  T.eq(nv.full({1}, 300, "u8")[1], 255)
  T.eq(nv.full({1}, -5, "u8")[1], 0)
  T.eq(nv.zeros(0):numel(), 0)
  T.eq(nv.zeros(3, 0):size(), {3, 0})
end)

T.case("full without a dtype: the help's own example nv.full({2, 3}, 7)", function()
  local t = nv.full({2, 3}, 7)
  T.eq(t:dtype(), "f32")
  T.eq(t:totable(), {{7, 7, 7}, {7, 7, 7}})
  T.eq(nv.full({2}, -1.5):totable(), {-1.5, -1.5})
end)

T.case("arange: integer and float steps, dtype inference", function()
  local a = nv.arange(5)
  T.eq(a:dtype(), "i64", "integer arguments give i64")
  T.eq(a:totable(), {0, 1, 2, 3, 4})
  T.eq(nv.arange(2, 8, 3):totable(), {2, 5})
  T.eq(nv.arange(5, 0, -2):totable(), {5, 3, 1})
  T.eq(nv.arange(0, 0):numel(), 0)
  T.eq(nv.arange(5, 0):numel(), 0, "empty when stop < start with a positive step")
  local q = nv.arange(0, 1, 0.25)
  T.eq(q:dtype(), "f32", "a float step gives f32")
  T.eq(q:totable(), {0, 0.25, 0.5, 0.75})
  -- element i is start + i*step computed in double, rounded once to f32
  local t = nv.arange(1, 2, 0.3)
  T.eq(t:numel(), 4, "ceil((2-1)/0.3) elements")
  local want = {}
  for i = 0, 3 do want[i + 1] = f32(1 + i * 0.3) end
  T.eq(t:totable(), want)
  local d = nv.arange(0, 1, 0.1)
  T.eq(d:numel(), 10)
  for i = 1, 10 do T.eq(d[i], f32((i - 1) * 0.1), "arange(0,1,0.1)[" .. i .. "]") end
  T.eq(nv.arange(0.5, 3):totable(), {0.5, 1.5, 2.5}, "float start")
  T.eq(nv.arange(4, "f32"):dtype(), "f32")
  T.eq(nv.arange(4, "bf16"):totable(), {0, 1, 2, 3})
  T.eq(nv.arange(1, 4, 1, "i32"):dtype(), "i32")
  T.eq(nv.arange(1, 4, 1, "u8"):totable(), {1, 2, 3})
end)

T.case("tensor from nested tables: shape, dtype inference and totable round trip", function()
  local data = {{1, 2, 3}, {4, 5, 6}}
  local t = nv.tensor(data)
  T.eq(t:dtype(), "f32", "default dtype")
  T.eq(t:size(), {2, 3})
  T.eq(t:totable(), data)
  local d3 = {{{1, 2}, {3, 4}, {5, 6}}, {{7, 8}, {9, 10}, {11, 12}}}
  T.eq(nv.tensor(d3):size(), {2, 3, 2})
  T.eq(nv.tensor(d3):totable(), d3)
  -- each dtype round-trips values it can hold exactly
  local exact = {
    f32 = {0.1 + 0.2, -1e-30, 3.5e38, 1 / 3},
    bf16 = {1.5, -2, 0.0078125, 3.3895313892515355e38},
    i32 = {-2147483648, 2147483647, 0, -1},
    i64 = {math.mininteger, math.maxinteger, (1 << 53) + 1, -((1 << 53) + 1)},
    u8 = {0, 1, 128, 255},
  }
  for dt, vals in pairs(exact) do
    local r = nv.tensor(vals, dt)
    T.eq(r:dtype(), dt)
    local want = {}
    for i, v in ipairs(vals) do want[i] = dt == "f32" and f32(v) or v end
    T.eq(r:totable(), want, dt .. " round trip")
    for i = 1, #vals do T.eq(math.type(r[i]), IS_FLOAT[dt] and "float" or "integer", dt .. " element type") end
  end
  local s = nv.tensor(5)
  T.eq(s:dim(), 0, "a number gives a 0-D tensor")
  T.eq(s:numel(), 1)
  T.eq(s:item(), 5)
  T.eq(nv.tensor({}):size(), {0})
  T.eq(nv.tensor({{}, {}}):size(), {2, 0})
end)

-- ---- metadata ---------------------------------------------------------------------------

T.case("metadata: size, dim, numel, dtype, stride, #t, t[i]", function()
  local t = nv.zeros(2, 3, 4)
  T.eq(t:size(), {2, 3, 4})
  T.eq(t:size(2), 3)
  T.eq(t:size(-1), 4, "negative dims count from the end")
  T.eq(t:dim(), 3)
  T.eq(t:numel(), 24)
  T.eq(t:dtype(), "f32")
  T.eq(t:device(), "cpu")
  T.eq(t:stride(), {12, 4, 1})
  T.eq(t:stride(1), 12)
  T.eq(#t, 2)
  T.ok(t:is_contiguous())
  T.eq(nv.tensor(1):dim(), 0)
  T.eq(#nv.tensor(1), 0)

  local v = nv.tensor({10, 20, 30})
  T.eq(v[1], 10); T.eq(v[3], 30); T.eq(v[-1], 30, "t[-1] is the last element")
  T.eq(type(v[2]), "number", "t[i] on 1-D returns a number")

  local m = nv.tensor({{1, 2, 3}, {4, 5, 6}})
  local row = m[2]
  T.ok(nv.is_tensor(row), "t[i] on 2-D returns a tensor")
  T.eq(row:size(), {3})
  T.eq(row:totable(), {4, 5, 6})
  T.ok(row:is_view_of(m), "t[i] is a view")
  T.eq(m[2][3], 6)
  T.eq(m[-1]:totable(), {4, 5, 6})
  T.eq(m:type(), "nvlua.Tensor")
end)

-- ---- views ------------------------------------------------------------------------------

T.case("views share storage: writes through each kind of view reach the base", function()
  local base = nv.arange(12, "f32")               -- 0..11
  local v = base:view(3, 4)
  T.ok(v:is_view_of(base))
  v:set(2, 3, 100)                                -- (2-1)*4 + 3 = element 7
  T.eq(base[7], 100, "view")

  local r = base:reshape(2, 6)
  T.ok(r:is_view_of(base), "reshape of a contiguous tensor is a view")
  r:set(1, 1, -1)
  T.eq(base[1], -1, "reshape")

  local tr = v:transpose(1, 2)
  T.eq(tr:size(), {4, 3}); T.eq(tr:stride(), {1, 4})
  T.ok(not tr:is_contiguous())
  tr:set(4, 1, 55)                                -- v[1][4] = element 4
  T.eq(base[4], 55, "transpose")
  T.eq(v:t():get(4, 1), 55, "t()")

  local b3 = base:view(2, 3, 2)
  local p = b3:permute(3, 1, 2)                   -- p[i][j][k] = b3[j][k][i]
  T.eq(p:size(), {2, 2, 3})
  p:set(2, 1, 3, 77)                              -- b3[1][3][2] = element (0*6 + 2*2 + 1) + 1 = 6
  T.eq(base[6], 77, "permute")

  local n = v:narrow(2, 2, 2)                     -- columns 2..3
  T.eq(n:size(), {3, 2})
  n:fill_(9)
  T.eq(v:totable(), {{-1, 9, 9, 55}, {4, 9, 9, 7}, {8, 9, 9, 11}}, "narrow")

  local s = v:select(1, 3)
  T.eq(s:size(), {4})
  s:fill_(0)
  T.eq({base[9], base[10], base[11], base[12]}, {0, 0, 0, 0}, "select")

  local one = nv.zeros(1, 3)
  local e = one:expand(4, 3)
  T.eq(e:size(), {4, 3}); T.eq(e:stride(), {0, 1})
  T.ok(e:is_view_of(one))
  one:set(1, 2, 5)
  T.eq(e:totable(), {{0, 5, 0}, {0, 5, 0}, {0, 5, 0}, {0, 5, 0}}, "expand sees writes to the base")
  e:set(3, 3, 8)                                  -- every row aliases the same storage
  T.eq(one:totable(), {{0, 5, 8}}, "writes through expand")
  T.eq(nv.zeros(3):expand(2, -1):size(), {2, 3}, "-1 keeps a size")

  -- t[i] = number fills, t[i] = tensor copies (with broadcasting), on an n-D tensor and a view
  local m = nv.zeros(3, 4)
  m[2] = 5
  m[3] = nv.tensor({1, 2, 3, 4})
  m[1] = nv.tensor({9})
  T.eq(m:totable(), {{9, 9, 9, 9}, {5, 5, 5, 5}, {1, 2, 3, 4}})
  local mv = m:view(2, 6)
  mv[2] = -1                                      -- elements 7..12 of m
  T.eq(m:totable(), {{9, 9, 9, 9}, {5, 5, -1, -1}, {-1, -1, -1, -1}}, "t[i]=v through a view")
  local x = nv.zeros(3)
  x[2] = 3.5
  x[-1] = 1
  T.eq(x:totable(), {0, 3.5, 1}, "t[i]=v on 1-D")
  local mt = nv.zeros(2, 3)
  mt:t()[3] = nv.tensor({1, 2})                   -- column 3 of mt, through a transposed view
  T.eq(mt:totable(), {{0, 0, 1}, {0, 0, 2}})
end)

T.case("is_view_of", function()
  local a = nv.zeros(4, 4)
  T.ok(a:is_view_of(a))
  T.ok(a:narrow(1, 2, 2):is_view_of(a))
  T.ok(a:narrow(1, 2, 2):t():is_view_of(a:select(2, 1)), "two views of one storage")
  T.ok(not a:clone():is_view_of(a), "clone")
  T.ok(not nv.zeros(4, 4):is_view_of(a), "another tensor")
  T.ok(not a:to("bf16"):is_view_of(a), "to() copies")
  T.ok(not a:to("f32"):is_view_of(a), "to() of the same dtype still copies")
end)

T.case("reshape copies when it must; view refuses", function()
  local base = nv.arange(6, "f32"):view(2, 3)     -- {{0,1,2},{3,4,5}}
  local tr = base:t()                             -- {{0,3},{1,4},{2,5}}
  T.raises(function() return tr:view(6) end, "view")
  local r = tr:reshape(6)
  T.ok(not r:is_view_of(base), "a transposed tensor reshapes by copying")
  T.eq(r:totable(), {0, 3, 1, 4, 2, 5})
  r[1] = 42
  T.eq(base:get(1, 1), 0, "the copy is independent")
  T.eq(tr:reshape(3, 2):totable(), {{0, 3}, {1, 4}, {2, 5}})
  -- a narrowed tensor can still be viewed where its strides allow
  local big = nv.arange(24, "f32"):view(4, 6)
  local n = big:narrow(2, 2, 3)                   -- [4,3], strides (6,1)
  local nv3 = n:view(4, 3, 1)
  T.ok(nv3:is_view_of(big))
  T.raises(function() return n:view(12) end, "view")
  T.eq(n:reshape(12):totable(), {1, 2, 3, 7, 8, 9, 13, 14, 15, 19, 20, 21})
  T.eq(nv.zeros(2, 3):view(-1):size(), {6})
  T.eq(nv.zeros(2, 3, 4):view(4, -1):size(), {4, 6})
  T.eq(nv.zeros(2, 3):view({3, 2}):size(), {3, 2}, "sizes as a table")
  local e = nv.tensor({{1, 2, 3}}):expand(2, 3)
  T.raises(function() return e:view(6) end, "view")
  T.eq(e:reshape(6):totable(), {1, 2, 3, 1, 2, 3})
end)

T.case("contiguous() shares a contiguous tensor and copies a strided one", function()
  local t = nv.tensor({{1, 2}, {3, 4}})
  local c = t:contiguous()
  T.ok(c:is_view_of(t))
  c:set(1, 1, 10)
  T.eq(t:get(1, 1), 10, "writes through contiguous() of a contiguous tensor reach it")
  local tc = t:t():contiguous()
  T.ok(not tc:is_view_of(t))
  T.ok(tc:is_contiguous())
  T.eq(tc:stride(), {2, 1})
  T.eq(tc:totable(), {{10, 3}, {2, 4}})
end)

T.case("clone is independent and contiguous", function()
  local t = nv.tensor({{1, 2, 3}, {4, 5, 6}})
  local c = t:clone()
  T.ok(not c:is_view_of(t))
  c:fill_(0)
  T.eq(t:totable(), {{1, 2, 3}, {4, 5, 6}}, "the base is untouched")
  local ct = t:t():clone()
  T.ok(ct:is_contiguous())
  T.eq(ct:totable(), {{1, 4}, {2, 5}, {3, 6}})
  for _, dt in ipairs(DTYPES) do
    local x = nv.tensor({{1, 2}, {3, 4}}, dt):t():clone()
    T.eq(x:dtype(), dt)
    T.eq(x:totable(), {{1, 3}, {2, 4}}, dt .. " clone of a transposed tensor")
  end
end)

T.case("copy_: broadcasting and dtype conversion", function()
  local d = nv.zeros(2, 3)
  T.ok(d:copy_(nv.tensor({1, 2, 3})) == d, "copy_ returns self")
  T.eq(d:totable(), {{1, 2, 3}, {1, 2, 3}}, "a row broadcast")
  d:copy_(nv.tensor({{7}, {8}}))
  T.eq(d:totable(), {{7, 7, 7}, {8, 8, 8}}, "a column broadcast")
  d:copy_(nv.tensor(4))
  T.eq(d:totable(), {{4, 4, 4}, {4, 4, 4}}, "a 0-D source")
  d:copy_(nv.tensor({{1, 2, 3}, {4, 5, 6}}, "i32"))
  T.eq(d:totable(), {{1, 2, 3}, {4, 5, 6}}, "i32 -> f32")
  local i = nv.zeros(4, "i32")
  i:copy_(nv.tensor({1.7, -1.7, 2.5, -0.5}))
  T.eq(i:totable(), {1, -1, 2, 0}, "f32 -> i32 truncates toward zero")
  local u = nv.zeros(3, "u8")
  u:copy_(nv.tensor({-3, 300, 17}))
  T.eq(u:totable(), {0, 255, 17}, "f32 -> u8 saturates")
  local b = nv.zeros(2, "bf16")
  b:copy_(nv.tensor({1 / 3, 1 + 2 ^ -8}))
  T.eq(b:totable(), {0.333984375, 1}, "f32 -> bf16 rounds to nearest even")
  local w = nv.zeros(2, "i64")
  w:copy_(nv.tensor({math.maxinteger, -5}, "i64"))
  T.eq(w:totable(), {math.maxinteger, -5}, "i64 -> i64 is exact")
  local l = nv.zeros(1, "i64")
  l:copy_(nv.tensor({2147483647}, "i32"))
  T.eq(l[1], 2147483647, "i32 -> i64")
  -- into a strided destination
  local m = nv.zeros(2, 3)
  m:t():copy_(nv.tensor({{1, 2}, {3, 4}, {5, 6}}))
  T.eq(m:totable(), {{1, 3, 5}, {2, 4, 6}}, "copy_ into a transposed view")
  m:narrow(2, 2, 1):copy_(nv.tensor({{-1}, {-2}}, "bf16"))
  T.eq(m:totable(), {{1, -1, 5}, {2, -2, 6}}, "bf16 source into a narrowed f32 view")
end)

-- ---- non-contiguous inputs --------------------------------------------------------------

-- Strided views of fixed-seed data, each with its own shape. Every op applied to a view must
-- equal the op applied to view:clone() (contiguous, same values).
local function strided_cases(dt)
  nv.manual_seed(1234)
  local out = {}
  local base = nv.randn(6, 5)
  if dt ~= "f32" then base = base:to(dt) end
  out.transposed = base:t()                                        -- [5,6] strides (1,5)
  out.narrowed = base:narrow(1, 2, 3):narrow(2, 2, 3)              -- [3,3] offset, strides (5,1)
  out.selected = base:select(2, 3)                                 -- [6] stride 5
  local b3 = nv.randn(2, 3, 4)
  if dt ~= "f32" then b3 = b3:to(dt) end
  out.permuted = b3:permute(3, 1, 2)                               -- [4,2,3]
  out.expanded = nv.randn(1, 4):to(dt):expand(3, 4)                   -- stride 0
  return out
end

T.case("non-contiguous inputs: elementwise and unary ops equal the contiguous clone's", function()
  for _, dt in ipairs({"f32", "bf16"}) do
    for name, v in pairs(strided_cases(dt)) do
      local c = v:clone()
      T.ok(c:is_contiguous())
      T.eq(v:totable(), c:totable(), dt .. " " .. name .. ": totable")
      local other = nv.randn(table.unpack(v:size()))
      local what = dt .. " " .. name .. ": "
      T.eq((v + v):totable(), (c + c):totable(), what .. "v + v")
      T.eq((v - other):totable(), (c - other):totable(), what .. "v - contiguous")
      T.eq((other * v):totable(), (other * c):totable(), what .. "contiguous * v")
      T.eq((v / (v:abs() + 1)):totable(), (c / (c:abs() + 1)):totable(), what .. "div")
      T.eq(((v:abs() + 0.5) ^ v):totable(), ((c:abs() + 0.5) ^ c):totable(), what .. "pow")
      T.eq(v:maximum(other):totable(), c:maximum(other):totable(), what .. "maximum")
      T.eq(v:minimum(other):totable(), c:minimum(other):totable(), what .. "minimum")
      T.eq((v * 0.1):totable(), (c * 0.1):totable(), what .. "scalar right")
      T.eq((3 - v):totable(), (3 - c):totable(), what .. "scalar left")
      T.eq(v:exp():totable(), c:exp():totable(), what .. "exp")
      T.eq(v:abs():log():totable(), c:abs():log():totable(), what .. "log")
      T.eq(v:abs():sqrt():totable(), c:abs():sqrt():totable(), what .. "sqrt")
      T.eq((-v):totable(), (-c):totable(), what .. "neg")
      T.eq(v:to("bf16"):totable(), c:to("bf16"):totable(), what .. "to bf16")
      T.eq(v:to("f32"):totable(), c:to("f32"):totable(), what .. "to f32")
      T.eq((v * 100):to("i32"):totable(), (c * 100):to("i32"):totable(), what .. "to i32")
      T.eq(v:clone():totable(), c:totable(), what .. "clone")
      -- copy_ from a strided source, and into a strided destination
      local dst = nv.zeros(table.unpack(v:size()))
      dst:copy_(v)
      T.eq(dst:totable(), c:totable(), what .. "copy_ from it")
    end
  end
  -- copy_ into strided destinations (not expanded: writes there alias)
  nv.manual_seed(99)
  local src = nv.randn(5, 6)
  local d = nv.zeros(6, 5)
  d:t():copy_(src)
  T.eq(d:t():totable(), src:totable(), "copy_ into a transposed destination")
  local big = nv.zeros(6, 5, "bf16")
  big:narrow(1, 2, 3):copy_(src:narrow(1, 1, 3):narrow(2, 1, 5))
  T.eq(big:narrow(1, 2, 3):totable(), src:narrow(1, 1, 3):narrow(2, 1, 5):to("bf16"):totable(), "copy_ into a narrowed bf16 destination")
end)

T.case("non-contiguous inputs: reductions equal the contiguous clone's", function()
  for _, dt in ipairs({"f32", "bf16"}) do
    for name, v in pairs(strided_cases(dt)) do
      local c = v:clone()
      local what = dt .. " " .. name .. ": "
      for _, op in ipairs({"sum", "mean", "max", "min", "amax"}) do
        T.eq(v[op](v), c[op](c), what .. op .. "()")
        for d = 1, v:dim() do
          local rv, iv = v[op](v, d)
          local rc, ic = c[op](c, d)
          T.eq(rv:totable(), rc:totable(), what .. op .. "(" .. d .. ")")
          if iv then T.eq(iv:totable(), ic:totable(), what .. op .. "(" .. d .. ") indices") end
          T.eq(v[op](v, d, true):totable(), c[op](c, d, true):totable(), what .. op .. "(" .. d .. ", keepdim)")
        end
      end
    end
  end
  -- integer dtypes too
  local i = nv.arange(24):view(4, 6):t():narrow(1, 2, 4)
  local ic = i:clone()
  T.eq(i:sum(), ic:sum()); T.eq(i:sum(2):totable(), ic:sum(2):totable()); T.eq(i:max(1):totable(), ic:max(1):totable())
end)

T.case("non-contiguous inputs: matmul equals the contiguous clone's", function()
  -- small integers: every product and partial sum is exact in f32, so any summation order and
  -- any BLAS layout gives the same bits
  local a = nv.tensor({{1, -2, 3, 0}, {4, 5, -6, 2}, {7, 8, 9, -1}})      -- [3,4]
  local b = nv.tensor({{1, 0}, {2, -1}, {0, 3}, {-2, 2}})                 -- [4,2]
  local want = {{-3, 11}, {10, -19}, {25, 17}}                             -- by hand
  T.eq(a:matmul(b):totable(), want)
  local at = a:t():clone():t()                    -- a's values, column-major
  local bt = b:t():clone():t()
  T.ok(not at:is_contiguous() and not bt:is_contiguous())
  T.eq(at:matmul(b):totable(), want, "transposed a")
  T.eq(a:matmul(bt):totable(), want, "transposed b")
  T.eq(at:matmul(bt):totable(), want, "both transposed")
  local pad = nv.zeros(5, 7)
  pad:narrow(1, 2, 3):narrow(2, 3, 4):copy_(a)
  T.eq(pad:narrow(1, 2, 3):narrow(2, 3, 4):matmul(b):totable(), want, "narrowed a")
end)

-- ---- broadcasting and promotion ---------------------------------------------------------

T.case("broadcasting: [3,1]+[1,4], [2,3]+[3], scalars either side, 0-D", function()
  local a = nv.tensor({{1}, {2}, {3}})
  local b = nv.tensor({{10, 20, 30, 40}})
  local s = a + b
  T.eq(s:size(), {3, 4})
  local want = {}
  for i = 1, 3 do want[i] = {} for j = 1, 4 do want[i][j] = i + 10 * j end end
  T.eq(s:totable(), want, "[3,1] + [1,4]")
  T.eq((b + a):totable(), want, "[1,4] + [3,1]")
  local m = nv.tensor({{1, 2, 3}, {4, 5, 6}})
  local r = nv.tensor({10, 20, 30})
  T.eq((m + r):totable(), {{11, 22, 33}, {14, 25, 36}}, "[2,3] + [3]")
  T.eq((r - m):totable(), {{9, 18, 27}, {6, 15, 24}}, "[3] - [2,3]")
  T.eq((m * nv.tensor({{2}, {3}})):totable(), {{2, 4, 6}, {12, 15, 18}}, "[2,3] * [2,1]")
  T.eq((m + 1):totable(), {{2, 3, 4}, {5, 6, 7}}, "tensor + scalar")
  T.eq((10 - m):totable(), {{9, 8, 7}, {6, 5, 4}}, "scalar - tensor")
  T.eq((m - 10):totable(), {{-9, -8, -7}, {-6, -5, -4}}, "tensor - scalar")
  T.eq((12 / m):totable(), {{12, 6, 4}, {3, f32(12 / 5), 2}}, "scalar / tensor")
  T.eq((2 ^ m):totable(), {{2, 4, 8}, {16, 32, 64}}, "scalar ^ tensor")
  T.eq((m + nv.tensor(100)):totable(), {{101, 102, 103}, {104, 105, 106}}, "tensor + 0-D tensor")
  T.eq((nv.zeros(2, 1, 3) + nv.zeros(4, 1)):size(), {2, 4, 3}, "[2,1,3] + [4,1]")
  T.raises(function() return m + nv.tensor({1, 2, 3, 4}) end, "[2,3]")
  T.raises(function() return m + nv.tensor({1, 2, 3, 4}) end, "[4]")
  T.raises(function() return m:add(nv.zeros(3, 3)) end, "cannot be broadcast")
end)

T.case("dtype promotion (u8 < i32 < i64 < bf16 < f32); integer division gives f32", function()
  local function z(dt) return nv.ones(2, dt) end
  local pairs_ = {
    {"u8", "i32", "i32"}, {"i32", "i64", "i64"}, {"i64", "bf16", "bf16"}, {"bf16", "f32", "f32"},
    {"u8", "f32", "f32"}, {"u8", "u8", "u8"}, {"i32", "bf16", "bf16"}, {"u8", "i64", "i64"},
  }
  for _, p in ipairs(pairs_) do
    T.eq((z(p[1]) + z(p[2])):dtype(), p[3], p[1] .. " + " .. p[2])
    T.eq((z(p[2]) * z(p[1])):dtype(), p[3], p[2] .. " * " .. p[1])
  end
  local a = nv.tensor({7, -7, 1}, "i32")
  local b = nv.tensor({2, 2, 3}, "i32")
  local q = a / b
  T.eq(q:dtype(), "f32", "i32 / i32")
  T.eq(q:totable(), {3.5, -3.5, f32(1 / 3)})
  T.eq((a / 2):dtype(), "f32", "i32 / integer scalar")
  T.eq((a / 2):totable(), {3.5, -3.5, 0.5})
  T.eq((nv.tensor({2, 3}, "i64") ^ 2):dtype(), "f32", "integer pow gives f32")
  T.eq((a + 2):dtype(), "i32", "an integral scalar keeps an integer dtype")
  T.eq((a + 2):totable(), {9, -5, 3})
  T.eq((a * 0.5):dtype(), "f32", "a fractional scalar gives f32")
  T.eq((a * 0.5):totable(), {3.5, -3.5, 0.5})
  T.eq((a - b):totable(), {5, -9, -2})
  T.eq((nv.tensor({2, 3}, "bf16") + 1):dtype(), "bf16")
  T.eq(a:exp():dtype(), "f32", "exp of integers")
  T.eq(nv.tensor({4, 9}, "u8"):sqrt():totable(), {2, 3})
  T.eq(a:abs():dtype(), "i32")
  T.eq(a:abs():totable(), {7, 7, 1})
  T.eq((-a):totable(), {-7, 7, -1})
  T.eq(a:sum(), 1); T.eq(math.type(a:sum()), "integer", "integer sum() is a Lua integer")
  T.eq(a:sum(1):dtype(), "i64", "integer sum(dim) accumulates in i64")
  T.eq(a:mean(1):dtype(), "f32")
  T.eq(a:max(1):dtype(), "i32")
  T.eq(a:mean(), 1 / 3)
end)

-- Lua integers are exact 64-bit values; an i64 tensor stores them through int64 (nv.tensor,
-- set), so arithmetic and reductions on i64 must not pass them through a double.
local BIG = (1 << 53) + 1                        -- the smallest positive integer a double lacks

T.case("i64 tensor-tensor arithmetic and per-dim reductions are exact beyond 2^53", function()
  local t = nv.tensor({BIG, -BIG}, "i64")
  T.eq(t:totable(), {BIG, -BIG}, "nv.tensor")
  T.eq((t + nv.tensor({1, -1}, "i64")):totable(), {BIG + 1, -BIG - 1}, "tensor + tensor")
  T.eq((t - nv.tensor({2, -2}, "i64")):totable(), {BIG - 2, -BIG + 2}, "tensor - tensor")
  T.eq((t * nv.tensor({3, 3}, "i64")):totable(), {3 * BIG, -3 * BIG}, "tensor * tensor")
  local u = nv.tensor({BIG, 2}, "i64")
  T.eq(u:sum(1):item(), BIG + 2, "sum(dim)")
  T.eq(u:max(1):item(), BIG, "max(dim)")
  T.eq(u:min(1):item(), 2, "min(dim)")
  local s = nv.zeros(1, "i64")
  s:set(1, BIG)
  T.eq(s[1], BIG, "set")
  T.eq(s:item(), BIG, "item")
end)

T.case("i64 sum()/max()/min() over all elements are exact beyond 2^53", function()
  local u = nv.tensor({BIG, 2}, "i64")
  T.eq(u:sum(), BIG + 2, "sum()")
  T.eq(u:max(), BIG, "max()")
  T.eq(nv.tensor({-BIG, 0}, "i64"):min(), -BIG, "min()")
end)

T.case("i64 with Lua integer scalars (t + n, full, fill_) is exact beyond 2^53", function()
  local z = nv.zeros(2, "i64")
  T.eq((z + BIG):totable(), {BIG, BIG}, "tensor + integer scalar")
  T.eq((nv.tensor({BIG}, "i64") - 1)[1], BIG - 1, "tensor - integer scalar")
  T.eq((BIG - nv.tensor({0}, "i64"))[1], BIG, "integer scalar - tensor")
  T.eq(nv.full({1}, BIG, "i64")[1], BIG, "full")
  T.eq(nv.zeros(1, "i64"):fill_(BIG)[1], BIG, "fill_")
end)

-- ---- elementwise against Lua ------------------------------------------------------------

-- Why exact equality holds for f32: the contiguous fast path computes + - * / in f32, which is
-- correctly rounded; the strided/broadcast path computes in double and rounds once to f32. For
-- + - * / and sqrt of f32 operands, rounding the double result to f32 gives the correctly rounded
-- f32 result (53 >= 2*24 + 2, so the double rounding is innocuous), so both paths equal
-- f32(Lua's double result). exp, log and pow are computed by the implementation as the C double
-- function of the f32 input, rounded once to f32 (kernels/cpu/ref/ops_ref.c nvl_unary_f,
-- nvl_binary_f; ops_cpu.c casts that double to float); Lua's math.exp/math.log/^ call the same
-- C functions on the same double, so f32(Lua's result) is the same bits. Scalars that are not
-- f32 values (0.1) are applied in double and rounded once, as f32(x * 0.1) does in Lua.
local BIN = {
  {"add", function(x, y) return x + y end, function(a, b) return a + b end},
  {"sub", function(x, y) return x - y end, function(a, b) return a - b end},
  {"mul", function(x, y) return x * y end, function(a, b) return a * b end},
  {"div", function(x, y) return x / y end, function(a, b) return a / b end},
  {"maximum", function(x, y) return math.max(x, y) end, function(a, b) return a:maximum(b) end},
  {"minimum", function(x, y) return math.min(x, y) end, function(a, b) return a:minimum(b) end},
}

local function check_list(got, want, what)
  T.eq(#got, #want, what .. ": length")
  for i = 1, #want do
    if not (got[i] == want[i] or (got[i] ~= got[i] and want[i] ~= want[i])) then
      error(string.format("%s: element %d: got %.9g, want %.9g", what, i, got[i], want[i]), 2)
    end
  end
end

T.case("f32 elementwise ops equal Lua math rounded once to f32 (exactly)", function()
  nv.manual_seed(7)
  local a, b = nv.randn(5, 7) * 3, nv.randn(5, 7)
  local xa, xb = flat(a:totable()), flat(b:totable())
  local bcol = nv.randn(5, 1)                     -- broadcast operand: the reference path
  local xc = flat(bcol:totable())
  for _, op in ipairs(BIN) do
    local name, lf, tf = op[1], op[2], op[3]
    local want, wantb = {}, {}
    for i = 1, #xa do
      want[i] = f32(lf(xa[i], xb[i]))
      wantb[i] = f32(lf(xa[i], xc[(i - 1) // 7 + 1]))
    end
    check_list(flat(tf(a, b):totable()), want, name .. " (contiguous, same shape)")
    check_list(flat(tf(a, bcol):totable()), wantb, name .. " (broadcast [5,7] with [5,1])")
    check_list(flat(tf(a:t(), b:t()):t():totable()), want, name .. " (transposed operands)")
  end
  local pos = a:abs() + 0.5
  local xp = flat(pos:totable())
  local want = {}
  for i = 1, #xp do want[i] = f32(xp[i] ^ xb[i]) end
  check_list(flat((pos ^ b):totable()), want, "pow")
  -- scalars, f32-exact (fast path) and not (0.1: double arithmetic, one rounding)
  local scal = {
    {"+ 0.1", function(x) return x + 0.1 end, function(t) return t + 0.1 end},
    {"* 3", function(x) return x * 3 end, function(t) return t * 3 end},
    {"* 0.1", function(x) return x * 0.1 end, function(t) return t * 0.1 end},
    {"2 - t", function(x) return 2 - x end, function(t) return 2 - t end},
    {"1 / t", function(x) return 1 / x end, function(t) return 1 / t end},
    {"t / 0.3", function(x) return x / 0.3 end, function(t) return t / 0.3 end},
    {"t ^ 2", function(x) return x ^ 2 end, function(t) return t ^ 2 end},
    {"maximum 0", function(x) return math.max(x, 0) end, function(t) return t:maximum(nv.tensor(0)) end},
  }
  for _, s in ipairs(scal) do
    local w = {}
    for i = 1, #xa do w[i] = f32(s[2](xa[i])) end
    check_list(flat(s[3](a):totable()), w, s[1])
    check_list(flat(s[3](a:t()):t():totable()), w, s[1] .. " (strided)")
  end
  -- unary
  local un = {
    {"exp", math.exp, function(t) return t:exp() end, a},
    {"log", math.log, function(t) return t:log() end, pos},
    {"sqrt", math.sqrt, function(t) return t:sqrt() end, pos},
    {"abs", math.abs, function(t) return t:abs() end, a},
    {"neg", function(x) return -x end, function(t) return t:neg() end, a},
    {"unm", function(x) return -x end, function(t) return -t end, a},
  }
  for _, u in ipairs(un) do
    local xs = flat(u[4]:totable())
    local w = {}
    for i = 1, #xs do w[i] = f32(u[2](xs[i])) end
    check_list(flat(u[3](u[4]):totable()), w, u[1])
    check_list(flat(u[3](u[4]:t()):t():totable()), w, u[1] .. " (strided)")
  end
  -- special values
  local sp = nv.tensor({1, -1, 0, 0, 4})
  local zero = nv.tensor({0, 0, 0, 0, 1})
  local q = (sp / zero):totable()
  T.eq(q[1], math.huge); T.eq(q[2], -math.huge); T.ok(q[3] ~= q[3], "0/0 is NaN"); T.eq(q[5], 4)
  local l = nv.tensor({0, -1, math.huge}):log():totable()
  T.eq(l[1], -math.huge); T.ok(l[2] ~= l[2], "log(-1) is NaN"); T.eq(l[3], math.huge)
  T.ok(nv.tensor({-1}):sqrt()[1] ~= nv.tensor({-1}):sqrt()[1], "sqrt(-1) is NaN")
  T.eq(nv.tensor({-math.huge}):exp()[1], 0)
  T.eq(nv.tensor({100}):exp()[1], math.huge, "exp overflows to inf in f32")
  local nan = 0 / 0
  local mx = nv.tensor({nan, 1, 2}):maximum(nv.tensor({1, nan, 1})):totable()
  T.ok(mx[1] ~= mx[1] and mx[2] ~= mx[2], "maximum propagates NaN from either side")
  T.eq(mx[3], 2)
  local mn = nv.tensor({nan, 1}):minimum(nv.tensor({1, nan})):totable()
  T.ok(mn[1] ~= mn[1] and mn[2] ~= mn[2], "minimum propagates NaN")
end)

T.case("bf16 elementwise ops round the double result once to bf16", function()
  -- bf16 operands are loaded exactly, combined in double and rounded once (ops_ref.c +
  -- dtype.c f64_to_bf16); the oracle bf16() above is written from the definition of RNE.
  nv.manual_seed(8)
  local a, b = nv.randn(4, 9):to("bf16"), nv.randn(4, 9):to("bf16")
  local xa, xb = flat(a:totable()), flat(b:totable())
  for _, op in ipairs(BIN) do
    local r = op[3](a, b)
    T.eq(r:dtype(), "bf16")
    local w = {}
    for i = 1, #xa do w[i] = bf16(op[2](xa[i], xb[i])) end
    check_list(flat(r:totable()), w, "bf16 " .. op[1])
  end
  local w = {}
  for i = 1, #xa do w[i] = bf16(math.exp(xa[i])) end
  check_list(flat(a:exp():totable()), w, "bf16 exp")
  for i = 1, #xa do w[i] = bf16(xa[i] * 0.1) end
  check_list(flat((a * 0.1):totable()), w, "bf16 * 0.1")
  -- mixed: bf16 + f32 computes in double and rounds to f32
  local f = nv.randn(4, 9)
  local xf = flat(f:totable())
  for i = 1, #xa do w[i] = f32(xa[i] + xf[i]) end
  check_list(flat((a + f):totable()), w, "bf16 + f32 -> f32")
end)

T.case("bf16 + and - on the fast kernels: rounded once from the exact sum (ties, gaps, subnormals, NaN)", function()
  -- The CPU kernel adds bf16 in f32 and rounds that (ops_cpu.c says why that is exact); the oracle is bf16() of the
  -- double sum, and the reference kernels must agree bit for bit. 40,000 elements: threaded blocks
  -- with a ragged tail. Exponents from -133 to 127, so sums far apart, overflows and bf16 subnormals.
  math.randomseed(21)
  local n = 40000
  local xa, xb = {}, {}
  for i = 1, n do
    xa[i] = bf16((math.random() * 2 - 1) * 2.0 ^ math.random(-133, 127))
    local near = bf16(math.random() * 2 - 1)
    -- half the b's a few binades from a (ties and carries), half anywhere
    if i % 2 == 0 then xb[i] = bf16(xa[i] * near * 2.0 ^ -(i % 12))
    else xb[i] = bf16(near * 2.0 ^ math.random(-133, 127)) end
  end
  local specials = {{1, 2 ^ -8}, {1 + 2 ^ -7, 2 ^ -8}, {1, 2 ^ -8 * (1 + 2 ^ -7)}, {1, -2 ^ -9}, {2 ^ -126, -2 ^ -133},
    {2 ^ 127 * 1.9921875, 2 ^ 127 * 1.9921875}, {1 / 0, -1 / 0}, {0 / 0, 1}, {1, 0 / 0}, {-(0 / 0), 2}, {-0.0, 0.0},
    {3, -3}, {2 ^ -133, 2 ^ -133}, {1, 2 ^ -100}, {-1, 2 ^ -100}}
  for i, p in ipairs(specials) do xa[i], xb[i] = p[1], p[2] end
  local a, b = nv.tensor(xa):to("bf16"), nv.tensor(xb):to("bf16")
  for _, op in ipairs{{"add", function(x, y) return x + y end, function(x, y) return x + y end},
                      {"sub", function(x, y) return x - y end, function(x, y) return x - y end}} do
    local got = op[3](a, b)
    T.eq(got:dtype(), "bf16")
    local w = {}
    for i = 1, n do w[i] = bf16(op[2](xa[i], xb[i])) end
    check_list(flat(got:to("f32"):totable()), w, "bf16 " .. op[1] .. " vs the oracle")
    local r = T.with(nv.use_reference, true, op[3], a, b)
    check_list(flat(got:to("f32"):totable()), flat(r:to("f32"):totable()), "bf16 " .. op[1] .. ": fast vs reference")
  end
  local c = a:clone()
  c:add_(b)
  check_list(flat(c:to("f32"):totable()), flat((a + b):to("f32"):totable()), "add_ in place = a + b")
  local d = a:clone()
  d:add_(d)
  check_list(flat(d:to("f32"):totable()), flat((a + a):to("f32"):totable()), "add_ of itself = a + a")
  local h = a:clone()
  h:narrow(1, 2, n - 1):add_(h:narrow(1, 1, n - 1)) -- overlapping views: through the f32 copy, as before
  local xh = {xa[1]}
  for i = 2, n do xh[i] = bf16(xa[i] + xa[i - 1]) end
  check_list(flat(h:to("f32"):totable()), xh, "add_ of an overlapping view")
end)

T.case("add_(src, alpha): one rule for every layout (issue 15 D1: a strided destination multiplied in double)", function()
  -- Oracle from the definition (NUMERICS §9): p = f32(f32(alpha) * src), t = f32(t + p); bf16: bf16(t + p).
  -- alpha = 0.3 is not exact in f32, so a product taken in double differs on about a third of the elements.
  nv.manual_seed(11)
  local x, y0 = nv.randn(37, 53) * 3, nv.randn(37, 53)
  local xs, ys = flat(x:totable()), flat(y0:totable())
  local a = f32(0.3)
  local want, wantb = {}, {}
  for i = 1, #xs do
    want[i] = f32(ys[i] + f32(a * xs[i]))
    wantb[i] = bf16(bf16(ys[i]) + f32(a * xs[i]))
  end
  local function strided(t) return t:transpose():contiguous():transpose() end
  local cases = {
    {"contiguous", y0:clone(), x},
    {"strided source", y0:clone(), strided(x)},
    {"strided destination", strided(y0), x},
    {"both strided", strided(y0), strided(x)},
  }
  for _, c in ipairs(cases) do
    local name, y, src = c[1], c[2], c[3]
    y:add_(src, 0.3)
    check_list(flat(y:totable()), want, "add_ " .. name)
  end
  local yb = y0:to("bf16")
  yb:add_(x, 0.3)
  check_list(flat(yb:totable()), wantb, "add_ into bf16")
  local ya = y0:clone()
  ya:add_(ya, 0.3) -- src aliasing the destination
  local wa = {}
  for i = 1, #ys do wa[i] = f32(ys[i] + f32(a * ys[i])) end
  check_list(flat(ya:totable()), wa, "add_ of itself")
end)

-- ---- reductions -------------------------------------------------------------------------

T.case("reductions: sum/mean/max/min/amax over all and per dim, keepdim, 1-based indices", function()
  local t = nv.tensor({{3, -1, 4}, {1, 5, -9}, {2, 6, 5}})
  T.eq(t:sum(), 16)
  T.eq(t:mean(), 16 / 9)
  T.eq(t:max(), 6)
  T.eq(t:min(), -9)
  T.eq(t:amax(), 9)
  T.eq(t:sum(1):totable(), {6, 10, 0})
  T.eq(t:sum(2):totable(), {6, -3, 13})
  T.eq(t:sum(-1):totable(), {6, -3, 13}, "negative dim")
  local k = t:sum(2, true)
  T.eq(k:size(), {3, 1}, "keepdim")
  T.eq(k:totable(), {{6}, {-3}, {13}})
  T.eq(t:sum(1, true):size(), {1, 3})
  T.eq(t:mean(1):totable(), {2, f32(10 / 3), 0})
  T.eq(t:amax(2):totable(), {4, 9, 6})
  local v, i = t:max(2)
  T.eq(v:totable(), {4, 5, 6}); T.eq(i:totable(), {3, 2, 2}, "max(2) indices are 1-based")
  T.eq(i:dtype(), "i64")
  v, i = t:min(1)
  T.eq(v:totable(), {1, -1, -9}); T.eq(i:totable(), {2, 1, 2})
  v, i = t:max(1, true)
  T.eq(v:size(), {1, 3}); T.eq(i:size(), {1, 3})
  T.eq(v:totable(), {{3, 6, 5}}); T.eq(i:totable(), {{1, 3, 3}})
  -- ties: the first extreme wins
  v, i = nv.tensor({{1, 7, 7}, {2, 2, 0}}):max(2)
  T.eq(i:totable(), {2, 1})
  v, i = nv.tensor({{1, 0, 0}, {2, 2, 5}}):min(2)
  T.eq(i:totable(), {2, 1})
  -- 1-D over its only dim gives 0-D results
  v, i = nv.tensor({5, 9, 2}):max(1)
  T.eq(v:dim(), 0); T.eq(v:item(), 9); T.eq(i:item(), 2)
  -- 3-D over the middle dim, against a Lua loop
  local x = nv.arange(24, "f32"):view(2, 3, 4)
  local s = x:sum(2)
  T.eq(s:size(), {2, 4})
  for a = 1, 2 do
    for c = 1, 4 do
      local acc = 0
      for b = 1, 3 do acc = acc + ((a - 1) * 12 + (b - 1) * 4 + (c - 1)) end
      T.eq(s:get(a, c), acc)
    end
  end
  local mx, ix = x:max(2)
  T.eq(mx:totable(), {{8, 9, 10, 11}, {20, 21, 22, 23}}); T.eq(ix:totable(), {{3, 3, 3, 3}, {3, 3, 3, 3}})
  -- integers
  local it = nv.tensor({4, -2, 9}, "i32")
  T.eq(it:max(), 9); T.eq(math.type(it:max()), "integer")
  T.eq(it:min(), -2); T.eq(it:amax(), 9)
  T.eq(nv.tensor({-12, 3}, "i64"):amax(), 12)
  -- empty
  T.eq(nv.zeros(0):sum(), 0)
  T.eq(nv.zeros(2, 0):sum(2):totable(), {0, 0})
  -- sum() accumulates in double: 2^24 + 1 is exact there though not in f32
  T.eq(nv.tensor({2 ^ 24, 1}):sum(), 2 ^ 24 + 1)
end)

T.case("max/min propagate NaN (value NaN, index of the first NaN)", function()
  local nan = 0 / 0
  local t = nv.tensor({1, nan, 3, nan})
  local m = t:max()
  T.ok(m ~= m, "max() is NaN")
  m = t:min()
  T.ok(m ~= m, "min() is NaN")
  m = t:amax()
  T.ok(m ~= m, "amax() is NaN")
  local v, i = t:max(1)
  T.ok(v:item() ~= v:item()); T.eq(i:item(), 2)
  v, i = nv.tensor({{1, nan}, {5, 2}, {nan, 9}}):max(2)
  local vt = v:totable()
  T.ok(vt[1] ~= vt[1]); T.eq(vt[2], 5); T.ok(vt[3] ~= vt[3])
  T.eq(i:totable(), {2, 1, 1})
  v, i = nv.tensor({{nan, 1}, {0, 2}}):min(1)
  vt = v:totable()
  T.ok(vt[1] ~= vt[1]); T.eq(vt[2], 1); T.eq(i:totable(), {1, 1})
  local s = nv.tensor({1, nan}):sum()
  T.ok(s ~= s, "sum with NaN is NaN")
end)

T.case("allclose", function()
  local a = nv.tensor({1, 2, 3})
  T.ok(a:allclose(nv.tensor({1, 2, 3})))
  T.ok(a:allclose(a + 1e-6), "within the default rtol 1e-5")
  T.ok(not a:allclose(a + 1e-3))
  T.ok(nv.allclose(a, a + 1e-3, 1e-3), "module function, larger rtol")
  T.ok(nv.tensor({0}):allclose(nv.tensor({1e-9})), "default atol 1e-8")
  T.ok(not nv.tensor({0}):allclose(nv.tensor({1e-7})))
  T.ok(nv.tensor({0}):allclose(nv.tensor({1e-7}), 0, 1e-6), "explicit atol")
  -- |a - b| <= atol + rtol * |b|: asymmetric in b
  T.ok(nv.tensor({100}):allclose(nv.tensor({101}), 0.00995, 0))
  T.ok(not nv.tensor({101}):allclose(nv.tensor({100}), 0.00995, 0))
  local nan = 0 / 0
  T.ok(not nv.tensor({nan}):allclose(nv.tensor({nan})), "NaN is not close to NaN")
  T.ok(nv.tensor({nan}):allclose(nv.tensor({nan}), 1e-5, 1e-8, true), "unless equal_nan")
  T.ok(nv.tensor({math.huge}):allclose(nv.tensor({math.huge})), "inf equals inf")
  T.ok(nv.tensor({{1, 1}, {1, 1}}):allclose(nv.tensor({1})), "shapes broadcast")
  T.ok(nv.tensor({1, 2}, "i32"):allclose(nv.tensor({1, 2}, "bf16")), "across dtypes")
end)

-- |a - b| <= atol + rtol*|b| is inf <= inf when b is infinite, so infinities need their own
-- rule (NumPy's): an infinity is close only to the same infinity.
T.case("allclose: an infinity is close only to the same infinity", function()
  T.ok(nv.tensor({math.huge}):allclose(nv.tensor({math.huge})), "inf vs inf")
  T.ok(not nv.tensor({math.huge}):allclose(nv.tensor({-math.huge})), "inf vs -inf")
  T.ok(not nv.tensor({1}):allclose(nv.tensor({math.huge})), "1 vs inf")
  T.ok(not nv.tensor({-5}):allclose(nv.tensor({-math.huge})), "-5 vs -inf")
  T.ok(not nv.tensor({math.huge}):allclose(nv.tensor({1})), "inf vs 1")
end)

T.case("item", function()
  T.eq(nv.tensor({{42}}):item(), 42)
  T.eq(nv.tensor(3.5):item(), 3.5)
  local i = nv.tensor({(1 << 53) + 1}, "i64"):item()
  T.eq(i, (1 << 53) + 1); T.eq(math.type(i), "integer")
  T.eq(nv.tensor({{1, 2}, {3, 4}}):t():narrow(1, 2, 1):narrow(2, 1, 1):item(), 2, "item of a strided view")
  T.raises(function() return nv.zeros(2):item() end, "2 elements")
end)

-- ---- printing ---------------------------------------------------------------------------

local function lines(s)
  local out = {}
  for l in (s .. "\n"):gmatch("(.-)\n") do out[#out + 1] = l end
  return out
end

T.case("printing: small tensors show every value and a header line", function()
  local s = tostring(nv.tensor({{1, 2, 3}, {4, 5, 6}}))
  local ls = lines(s)
  T.eq(#ls, 3, "two rows and the description:\n" .. s)
  T.ok(ls[1]:match("^%s*1%s+2%s+3%s*$"), "row 1: " .. ls[1])
  T.ok(ls[2]:match("^%s*4%s+5%s+6%s*$"), "row 2: " .. ls[2])
  T.eq(ls[3], "[nvlua.Tensor f32 2x3]")
  local f = tostring(nv.tensor({{0.5, -1.25}, {1e-3, 1000}}))
  for _, v in ipairs({"0.5", "-1.25", "0.001", "1000"}) do T.ok(f:find(v, 1, true), v .. " in\n" .. f) end
  T.ok(tostring(nv.zeros(2, 3, "bf16")):find("[nvlua.Tensor bf16 2x3]", 1, true))
  local i = tostring(nv.tensor({-7, 8}, "i32"))
  T.ok(i:find("-7", 1, true) and i:find("[nvlua.Tensor i32 2]", 1, true), i)
  local sc = tostring(nv.tensor(5))
  T.ok(sc:find("5", 1, true) and sc:find("[nvlua.Tensor f32 scalar]", 1, true), sc)
  local sp = tostring(nv.tensor({0 / 0, math.huge, -math.huge}))
  T.ok(sp:find("nan", 1, true) and sp:find("-inf", 1, true), sp)
  T.ok(tostring(nv.zeros(0, 3)):find("[nvlua.Tensor f32 0x3]", 1, true))
  -- a strided view prints its own values
  local t = tostring(nv.tensor({{1, 2, 3}, {4, 5, 6}}):t())
  T.ok(lines(t)[1]:match("^%s*1%s+4%s*$"), t)
end)

T.case("printing: large tensors are abbreviated; 3-D and 4-D get slice headers", function()
  local big = nv.arange(10000, "f32"):view(100, 100)
  local s = tostring(big)
  T.ok(#s < 2000, "short: " .. #s .. " chars")
  T.ok(s:find("...", 1, true), "has an ellipsis")
  T.ok(s:find("[nvlua.Tensor f32 100x100]", 1, true))
  local ls = lines(s)
  T.ok(ls[1]:match("^%s*0%s+1%s+2%s"), "first row starts with 0 1 2: " .. ls[1])
  T.ok(ls[1]:match("97%s+98%s+99%s*$"), "first row ends with 97 98 99: " .. ls[1])
  T.ok(s:find("9999", 1, true), "the last element is shown")
  T.ok(not s:find("5050", 1, true), "a middle element is not")
  T.ok(#tostring(nv.zeros(1000000)) < 2000, "a 1-D million-element tensor too")
  local d3 = tostring(nv.arange(8, "f32"):view(2, 2, 2))
  T.ok(d3:find("(1,.,.) =", 1, true) and d3:find("(2,.,.) =", 1, true), d3)
  T.ok(d3:find("[nvlua.Tensor f32 2x2x2]", 1, true))
  local l3 = lines(d3)
  T.ok(l3[2]:match("^%s*0%s+1%s*$") and l3[3]:match("^%s*2%s+3%s*$"), d3)
  local d4 = tostring(nv.zeros(2, 2, 2, 2))
  T.ok(d4:find("(1,1,.,.) =", 1, true) and d4:find("(2,2,.,.) =", 1, true), d4)
end)

-- ---- memory -----------------------------------------------------------------------------

T.case("memory: nv.memory().cpu grows by numel*elem_size and drops back after free()", function()
  for _, dt in ipairs(DTYPES) do
    local m0 = live()
    local t = nv.zeros(1000, dt)
    local m1 = nv.memory()
    T.eq(m1.cpu - m0.cpu, 1000 * BYTES[dt], dt .. " bytes")
    T.eq(m1.tensors.cpu - m0.tensors.cpu, 1, dt .. " storage count")
    T.ok(m1.peak.cpu >= m1.cpu, "peak >= live")
    t:free()
    T.ok(t:is_freed())
    local m2 = nv.memory()
    T.eq(m2.cpu, m0.cpu, dt .. " freed")
    T.eq(m2.tensors.cpu, m0.tensors.cpu)
    t:free() -- a second free is harmless
    T.eq(nv.memory().cpu, m0.cpu)
  end
end)

T.case("memory: a view's free() does not release the base's storage", function()
  local m0 = live().cpu
  local base = nv.arange(1000, "f32")
  local v = base:view(10, 100)
  local n = base:narrow(1, 5, 10)
  T.eq(nv.memory().cpu - m0, 4000, "views allocate nothing")
  v:free()
  T.eq(nv.memory().cpu - m0, 4000, "freeing a view keeps the storage")
  T.eq(base[1000], 999, "the base is still usable")
  base:free()
  T.eq(nv.memory().cpu - m0, 4000, "a live view keeps the storage after the base is freed")
  T.eq(n:totable(), {4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, "and reads its data")
  n:free()
  T.eq(nv.memory().cpu, m0, "the last reference frees it")
end)

T.case("memory: <close> releases at the end of the scope; GC releases unreachable tensors", function()
  local m0 = live().cpu
  do
    local t <close> = nv.zeros(1000)
    T.eq(nv.memory().cpu - m0, 4000)
  end
  T.eq(nv.memory().cpu, m0, "<close>")
  local ok = pcall(function()
    local t <close> = nv.zeros(500)
    error("boom")
  end)
  T.ok(not ok)
  T.eq(nv.memory().cpu, m0, "<close> on an error path")
  do local _ = nv.zeros(2000) end
  T.eq(live().cpu, m0, "garbage collection")
end)

T.case("use after free raises 'freed'", function()
  local t = nv.ones(2, 3)
  local keep = nv.ones(3)
  t:free()
  T.ok(t:is_freed())
  T.eq(tostring(t), "[nvlua.Tensor (freed)]")
  T.raises(function() return t:sum() end, "freed")
  T.raises(function() return t + 1 end, "freed")
  T.raises(function() return 1 + t end, "freed")
  T.raises(function() return t + keep end, "freed")
  T.raises(function() return keep:add(t) end, "freed")
  T.raises(function() return t[1] end, "freed")
  T.raises(function() t[1] = 0 end, "freed")
  T.raises(function() return t:totable() end, "freed")
  T.raises(function() return t:view(6) end, "freed")
  T.raises(function() return t:get(1, 1) end, "freed")
  T.raises(function() return t:exp() end, "freed")
  T.raises(function() return t:clone() end, "freed")
  T.raises(function() return t:to("bf16") end, "freed")
  T.raises(function() return t:fill_(1) end, "freed")
  T.raises(function() return keep:copy_(t) end, "freed")
  T.raises(function() return t:matmul(nv.ones(3, 3)) end, "freed")
  T.eq(keep:sum(), 3, "other tensors are unaffected")
end)

T.case("IEEE subnormals in this process: nv.info().fp_env, and f32 arithmetic keeps them", function()
  -- a library that turns on flush-to-zero / denormals-are-zero would change the formats' scales
  -- (nvfp4's clamped decode scale is 1/FLT_MAX, a subnormal); nvlua clears them (core/info.h)
  T.eq(nv.info().fp_env, "ieee", "no FTZ/DAZ found at start-up")
  local tiny = 2.0 ^ -140 -- subnormal in f32 (the smallest normal is 2^-126)
  local t = nv.tensor({ 2.0 ^ -120 }, "f32"):mul(2.0 ^ -20)
  T.eq(t:totable()[1], tiny, "2^-120 * 2^-20 = 2^-140, not flushed")
  T.eq((nv.tensor({ tiny }, "f32") + nv.tensor({ tiny }, "f32")):totable()[1], 2 * tiny, "subnormal inputs not zeroed")
end)
