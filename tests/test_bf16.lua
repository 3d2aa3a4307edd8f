-- test_bf16.lua: bf16 conversion, exhaustively on the patterns that matter — every bf16 value
-- decodes and round-trips; f32 -> bf16 rounds to nearest even for every bf16 neighbour pair
-- (exact ties, one f32 ulp either side of a tie, the extremes of the low half); overflow to
-- inf, max finite, NaN (sign kept, never turned into inf), -0, subnormals, inf; and the
-- double -> bf16 path (nv.tensor(..., "bf16"), full, set), which must round once, not twice.
-- Not here: bf16 arithmetic (test_tensor), bf16 GEMMs (test_matmul).
--
-- The expected values come from rne_bf16 below, written from the definition of the format
-- (significand of 8 bits, exponent floor -126, so the spacing is 2^(e-7) for |x| in [2^e, 2^e+1)
-- and 2^-133 below 2^-126; ties go to the even significand; results of 2^128 or more are inf).
-- It works on values with Lua's double arithmetic, not on bit patterns, and shares nothing with
-- core/dtype.c (which adds 0x7fff + lsb to the f32 bits).
local T = require "nvlua.test"
local nv = require "nvlua"

local function f32_of_bits(b) return (string.unpack("<f", string.pack("<I4", b))) end
local function bits_of_f32(x) return (string.unpack("<I4", string.pack("<f", x))) end
local function sign_bit(x) return string.unpack("<I8", string.pack("<d", x)) >> 63 end

local TWO128 = 2.0 ^ 128

-- x (a double) rounded to the nearest bf16 value, ties to even.
local function rne_bf16(x)
  if x ~= x or x == 0 or x == math.huge or x == -math.huge then return x end
  local a = math.abs(x)
  local e = ((string.unpack("<I8", string.pack("<d", a)) >> 52) & 0x7ff) - 1023  -- a is a normal double here
  if e < -126 then e = -126 end
  local q = 2.0 ^ (e - 7)                 -- the bf16 spacing at a
  local y = a / q                         -- exact (a power-of-two scaling); 0 <= y < 256
  local n = math.floor(y)
  local frac = y - n                      -- exact
  if frac > 0.5 or (frac == 0.5 and n % 2 == 1) then n = n + 1 end
  local r = n * q
  if r >= TWO128 then r = math.huge end
  if x < 0 then return -r end             -- keeps -0 for negatives that round to zero
  return r
end

-- Compare a list of results with the oracle on the inputs; NaN must stay NaN with its sign.
local function check_all(inputs, got, what)
  T.eq(#got, #inputs, what .. ": length")
  local bad, first = 0, nil
  for i = 1, #inputs do
    local x, g = inputs[i], got[i]
    local ok
    if x ~= x then
      ok = g ~= g and sign_bit(g) == sign_bit(x)
    else
      local w = rne_bf16(x)
      ok = g == w and sign_bit(g) == sign_bit(w)   -- sign_bit tells -0 from +0
    end
    if not ok then
      bad = bad + 1
      first = first or i
    end
  end
  if bad > 0 then
    local x = inputs[first]
    error(string.format("%s: %d of %d wrong; first: input %.17g (f32 bits 0x%08x) gave %.17g, want %.17g", what, bad,
      #inputs, x, x == x and bits_of_f32(x) or 0, got[first], rne_bf16(x)), 2)
  end
end

-- The f32 values through one big tensor: f32 -> :to("bf16") -> :to("f32") -> totable().
local function via_cast(values)
  local t = nv.tensor(values)              -- f32; the values are f32 already, stored exactly
  local r = t:to("bf16"):to("f32"):totable()
  t:free()
  return r
end

T.case("the oracle itself on hand-worked values", function()
  T.eq(rne_bf16(1 + 2 ^ -8), 1, "tie between 1 and 1+2^-7 goes to 1 (even)")
  T.eq(rne_bf16(1 + 3 * 2 ^ -8), 1 + 2 ^ -6, "tie between 1+2^-7 (odd) and 1+2^-6 (even)")
  T.eq(rne_bf16(1 + 2 ^ -8 + 2 ^ -23), 1 + 2 ^ -7, "just above a tie")
  T.eq(rne_bf16(1 / 3), 0.333984375, "1/3 = 0x3eab")
  T.eq(rne_bf16(-(1 + 2 ^ -8)), -1)
  T.eq(rne_bf16(2 ^ -134), 0, "half the smallest subnormal ties to 0")
  T.eq(rne_bf16(3 * 2 ^ -134), 2 ^ -132, "tie between 2^-133 (odd) and 2^-132 (even)")
  T.eq(rne_bf16(TWO128 - 2 ^ 119), math.huge, "halfway between max and 2^128 goes up")
  T.eq(rne_bf16(TWO128 - 2 ^ 119 - 2 ^ 104), TWO128 - 2 ^ 120, "just below that halfway: max finite")
  T.eq(1 / rne_bf16(-2 ^ -140), -math.huge, "a negative that rounds to zero is -0")
end)

T.case("every bf16 value is an f32 that round-trips through to('bf16') unchanged", function()
  local vals = {}
  for h = 0, 0xffff do vals[h + 1] = f32_of_bits(h << 16) end
  local got = via_cast(vals)
  local bad = 0
  for h = 0, 0xffff do
    local x, g = vals[h + 1], got[h + 1]
    if x ~= x then
      if not (g ~= g and sign_bit(g) == (h >> 15)) then bad = bad + 1 end
    elseif bits_of_f32(g) ~= (h << 16) then
      bad = bad + 1
    end
  end
  T.eq(bad, 0, "bf16 patterns not round-tripped")
  -- the same values stored straight from doubles into a bf16 tensor
  local direct = nv.tensor(vals, "bf16"):to("f32"):totable()
  bad = 0
  for h = 0, 0xffff do
    local x, g = vals[h + 1], direct[h + 1]
    if x ~= x then
      if g == g then bad = bad + 1 end
    elseif bits_of_f32(g) ~= (h << 16) then
      bad = bad + 1
    end
  end
  T.eq(bad, 0, "bf16 patterns stored from doubles")
  -- bf16 -> f32 is exact: the bf16 tensor reads back as the decoded values
  T.eq(nv.tensor({1.5, -2 ^ -133, 3.3895313892515355e38}, "bf16"):totable(), {1.5, -2 ^ -133, 3.3895313892515355e38})
end)

-- Low halves tried under every high half: 0 (exact), 1 (just above the value), 0x7fff (one f32
-- ulp below the tie), 0x8000 (the exact tie), 0x8001 (one ulp above), 0xffff (just below the
-- next bf16), and one pseudo-random half from a fixed LCG.
T.case("f32 -> bf16 rounds to nearest even for every bf16 neighbour pair (ties, tie +- 1 ulp)", function()
  local lows = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff}
  local inputs = {}
  local seed = 12345
  for h = 0, 0xffff do
    for _, lo in ipairs(lows) do inputs[#inputs + 1] = f32_of_bits((h << 16) | lo) end
    seed = (seed * 1103515245 + 12345) & 0x7fffffff
    inputs[#inputs + 1] = f32_of_bits((h << 16) | (seed & 0xffff))
  end
  check_all(inputs, via_cast(inputs), "contiguous f32 -> bf16")
  -- the strided path (the scalar reference copy) must agree: cast a transposed view
  local n = #inputs // 7
  local t = nv.tensor(inputs):view(n, 7):t()
  local got = t:to("bf16"):t():to("f32"):view(-1):totable()
  check_all(inputs, got, "strided f32 -> bf16")
end)

T.case("specials: max finite, overflow to inf, NaN, -0, subnormals, inf", function()
  local cases = {
    {0x7f7f0000, 0x7f7f, "max finite bf16 stays"},
    {0x7f7f7fff, 0x7f7f, "below the halfway point to 2^128: max finite"},
    {0x7f7f8000, 0x7f80, "the halfway point between max and 2^128 rounds to inf"},
    {0x7f7f8001, 0x7f80, "above it: inf"},
    {0x7f7fffff, 0x7f80, "max finite f32 rounds to inf"},
    {0xff7f8000, 0xff80, "negative halfway: -inf"},
    {0xff7f7fff, 0xff7f, "negative below halfway: -max"},
    {0x7f800000, 0x7f80, "inf"},
    {0xff800000, 0xff80, "-inf"},
    {0x00000000, 0x0000, "+0"},
    {0x80000000, 0x8000, "-0 keeps its sign"},
    {0x00000001, 0x0000, "the smallest f32 subnormal rounds to +0"},
    {0x80000001, 0x8000, "and its negative to -0"},
    {0x00008000, 0x0000, "2^-134: tie between 0 and 2^-133, to 0 (even)"},
    {0x80008000, 0x8000, "-2^-134: to -0"},
    {0x00008001, 0x0001, "just above: the smallest bf16 subnormal 2^-133"},
    {0x00018000, 0x0002, "tie between subnormals 1 (odd) and 2 (even)"},
    {0x00028000, 0x0002, "tie between subnormals 2 (even) and 3"},
    {0x007f8000, 0x0080, "tie between the largest subnormal (odd) and the smallest normal"},
    {0x00800000, 0x0080, "smallest normal 2^-126"},
    {0x3f808000, 0x3f80, "1 + 2^-8: tie to 1"},
    {0x3f818000, 0x3f82, "1 + 3*2^-8: tie to 1 + 2^-6"},
    {0x3fff8000, 0x4000, "tie that carries into the exponent: 2 - 2^-8 -> 2"},
  }
  local inputs = {}
  for i, c in ipairs(cases) do inputs[i] = f32_of_bits(c[1]) end
  local got = via_cast(inputs)
  for i, c in ipairs(cases) do
    local g = got[i]
    T.eq(string.format("0x%04x", bits_of_f32(g) >> 16), string.format("0x%04x", c[2]), c[3])
  end
  T.eq(1 / got[11], -math.huge, "-0: 1/x == -inf")
  T.eq(got[3], math.huge)
  T.eq(got[1], 3.3895313892515355e38)
  -- NaN stays NaN, with its sign, whatever its payload; a payload only in the low half must not
  -- be rounded away into inf
  local nans = {0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7f80ffff, 0x7fffffff, 0xffffffff, 0x7fa00000}
  local nin = {}
  for i, b in ipairs(nans) do nin[i] = f32_of_bits(b) end
  local ngot = via_cast(nin)
  for i, b in ipairs(nans) do
    local g = ngot[i]
    T.ok(g ~= g, string.format("0x%08x stays NaN, got %s", b, tostring(g)))
    T.eq(sign_bit(g), b >> 31, string.format("0x%08x keeps its sign", b))
  end
end)

-- A double that is not an f32 value but rounds (as a double -> float conversion) onto an exact
-- bf16 tie would be rounded twice by double -> f32 -> bf16 and land on the even neighbour; the
-- correct single rounding follows the side of the tie the double lies on.
T.case("double -> bf16 (nv.tensor, full, set, fill_) rounds once, not via f32", function()
  local inputs = {}
  local function add(x) inputs[#inputs + 1] = x end
  for h = 0, 0x7f7f, 3 do                                 -- every third positive finite pair
    local m = f32_of_bits((h << 16) | 0x8000)              -- the tie between bf16 h and h+1
    for _, s in ipairs({1, -1}) do
      add(s * m)                                           -- exact tie: to even
      add(s * (m + m * 2 ^ -30))                           -- beyond the tie by far less than an f32 ulp
      add(s * (m - m * 2 ^ -30))                           -- short of it
    end
  end
  for _, x in ipairs({TWO128, -TWO128, 1e39, -1e39, TWO128 - 2 ^ 103, 3.3895313892515355e38, 1e-300, -1e-300,
    2 ^ -134 + 2 ^ -170, 2 ^ -134 - 2 ^ -170, 1 / 3, 0.1, -0.0}) do
    add(x)
  end
  local got = nv.tensor(inputs, "bf16"):totable()
  check_all(inputs, got, "nv.tensor(doubles, 'bf16')")
  -- the single-value entry points go through the same conversion
  local x = 1 + 2 ^ -8 + 2 ^ -40                          -- rounds to the 1 / 1+2^-7 tie as an f32
  T.eq(nv.full({1}, x, "bf16")[1], 1 + 2 ^ -7, "full")
  T.eq(nv.zeros(1, "bf16"):fill_(x)[1], 1 + 2 ^ -7, "fill_")
  local s = nv.zeros(1, "bf16")
  s:set(1, x)
  T.eq(s[1], 1 + 2 ^ -7, "set")
  s[1] = 1 + 2 ^ -8 - 2 ^ -40
  T.eq(s[1], 1, "t[i] = v")
  -- whereas the f32 tensor holds the tie itself, and casts it to even
  T.eq(nv.tensor({x}):to("bf16")[1], 1, "f32 tie -> even")
end)
