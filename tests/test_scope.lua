-- tests/test_scope.lua: the per-step arena (nv.scope, nv.keep, nv.unscope, nv.adopt, nv.unscoped;
-- lua/bind/scope.c): what a scope frees and what survives it, nesting, errors, views, quantized
-- tensors, and the nn modules and training step run under it.
local T = require "nvlua.test"
local nv = require "nvlua"

-- live host bytes after a full collection (what the arena must free is not left to the GC)
local function live() collectgarbage(); collectgarbage(); return nv.memory().cpu end

-- bytes live now, without collecting (a tensor the arena missed would still count)
local function bytes() return nv.memory().cpu end

T.case("scope: temporaries are freed when the function returns; its results survive", function()
  local m0 = live()
  local a, b
  local y, n = nv.scope(function(k)
    a, b = nv.zeros(k), nv.ones(k)
    local s = a + b
    T.eq(nv.scope_depth(), 1, "depth inside")
    return s * 2, 7
  end, 100)
  T.eq(nv.scope_depth(), 0, "depth after")
  T.ok(a:is_freed() and b:is_freed(), "temporaries freed")
  T.eq(n, 7, "non-tensor results pass through")
  T.eq(y:sum(), 200, "the result is intact")
  T.eq(bytes() - m0, 400, "only the result is live (no GC)")
  y:free()
  T.eq(bytes(), m0)
end)

T.case("scope: tensors directly in a returned plain table survive, nested tables do not", function()
  local m0 = live()
  local r = nv.scope(function()
    return {x = nv.zeros(10), n = 3, list = {nv.zeros(20)}, [1] = nv.ones(5)}
  end)
  T.ok(not r.x:is_freed() and not r[1]:is_freed(), "one level deep: kept")
  T.ok(r.list[1]:is_freed(), "two levels deep: freed")
  T.eq(bytes() - m0, 60)
  r.x:free(); r[1]:free()
  T.eq(bytes(), m0)
end)

T.case("scope: many results pass through, tensors among them kept", function()
  local r = table.pack(nv.scope(function()
    local out = {}
    for i = 1, 300 do out[i] = i % 3 == 0 and nv.zeros(1) or i end
    return table.unpack(out, 1, 300)
  end))
  T.eq(r.n, 300)
  for i = 1, 300 do
    if i % 3 == 0 then T.ok(not r[i]:is_freed(), "result " .. i); r[i]:free() else T.eq(r[i], i) end
  end
end)

T.case("scope: a returned table with a metatable is not looked into", function()
  local inside
  nv.scope(function()
    inside = nv.zeros(4)
    return setmetatable({t = inside}, {})
  end)
  T.ok(inside:is_freed())
end)

T.case("scope: tensors created outside (inputs, parameters) are left alone", function()
  local x = nv.ones(8)
  local y = nv.scope(function(v) return v, v:sum() end, x)
  T.ok(rawequal(x, y) and not x:is_freed(), "an input returned as is")
  nv.scope(function() local _ = x * 2 end)
  T.ok(not x:is_freed(), "an input not returned")
  x:free()
end)

T.case("keep: a kept tensor moves to the enclosing scope (and is freed there unless returned)", function()
  local m0 = live()
  local k1, k2, t
  local out = nv.scope(function()
    nv.scope(function()
      k1 = nv.keep(nv.zeros(10))
      k2 = nv.zeros(10)
      local tbl = nv.keep({t = nv.zeros(3)}) -- a plain table: its tensors, one level deep
      t = tbl.t
    end)
    T.ok(not k1:is_freed() and not t:is_freed(), "kept past the inner scope")
    T.ok(k2:is_freed(), "not kept: freed with the inner scope")
    return k1
  end)
  T.ok(rawequal(out, k1) and not k1:is_freed(), "returned from the outer scope")
  T.ok(t:is_freed(), "kept once, freed by the outer scope")
  T.eq(bytes() - m0, 40)
  k1:free()
  local top = nv.scope(function() return nv.keep(nv.zeros(2)) end) -- kept at the outermost: in no scope
  T.ok(not top:is_freed())
  top:free()
  T.eq(nv.keep(1, "a"), 1, "no scope open: its arguments back")
end)

T.case("unscope: leaves every scope; adopt: freed with the innermost", function()
  local saved
  nv.scope(function()
    nv.scope(function()
      saved = nv.unscope({x = nv.zeros(10)})
    end)
  end)
  T.ok(not saved.x:is_freed(), "unscoped: survives both scopes")
  nv.scope(function()
    nv.scope(function() nv.adopt(saved) end)
    T.ok(saved.x:is_freed(), "adopted: freed by the inner scope")
  end)
  T.raises(function() nv.adopt(nv.zeros(1)) end, "no scope is open")
end)

T.case("unscoped: a callback run inside a scope keeps what it makes", function()
  local made, inner, tmp
  nv.scope(function()
    tmp = nv.zeros(4)
    nv.unscoped(function(n)
      T.eq(nv.scope_depth(), 0, "no scope open inside")
      made = nv.zeros(n)
      nv.scope(function() inner = nv.zeros(n) end) -- its own scopes still work
      T.eq(nv.scope_depth(), 0)
    end, 8)
    T.eq(nv.scope_depth(), 1, "the scope is back")
    T.raises(function() nv.unscoped(function() error("in the callback") end) end, "in the callback")
    T.eq(nv.scope_depth(), 1, "and back after an error")
  end)
  T.ok(tmp:is_freed() and inner:is_freed(), "the scopes freed their own")
  T.ok(not made:is_freed(), "what the callback made is its own")
  made:free()
end)

T.case("nesting: each scope frees its own; depth counts them", function()
  local m0 = live()
  local outer, inner
  nv.scope(function()
    outer = nv.zeros(100)
    local r = nv.scope(function()
      inner = nv.zeros(100)
      T.eq(nv.scope_depth(), 2)
      return nv.ones(100)
    end)
    T.ok(inner:is_freed() and not outer:is_freed(), "the inner scope freed its own only")
    T.ok(not r:is_freed(), "the inner result lives in the outer scope")
    T.eq(bytes() - m0, 800)
  end)
  T.ok(outer:is_freed())
  T.eq(bytes(), m0, "everything freed at the outermost end")
end)

T.case("errors: the scope frees its tensors and the error propagates with its traceback", function()
  local m0 = live()
  local t, u
  local ok, err = xpcall(nv.scope, debug.traceback, function()
    t = nv.zeros(100)
    nv.scope(function()
      u = nv.zeros(100)
      local none = nil
      return none.field -- raises here
    end)
  end)
  T.ok(not ok)
  T.ok(t:is_freed() and u:is_freed(), "both scopes freed")
  T.eq(nv.scope_depth(), 0, "and closed")
  T.eq(bytes(), m0)
  T.ok(err:find("attempt to index a nil value", 1, true), err)
  T.ok(err:find("test_scope.lua:%d+: attempt"), "the message keeps its position: " .. err)
  -- the traceback was taken where the error happened: inside both scopes
  local _, n = err:gsub("in function '[%w%.]*scope'", "")
  T.eq(n, 2, "both nv.scope frames are in the traceback: " .. err)
  local ok2, e2 = pcall(nv.scope, function() error({code = 7}) end)
  T.ok(not ok2 and type(e2) == "table" and e2.code == 7, "a non-string error object passes unchanged")
  T.raises(function() nv.scope(42) end, "function expected")
end)

T.case("views: freeing the base leaves a returned view valid; freeing twice is harmless", function()
  local m0 = live()
  local base
  local v = nv.scope(function()
    base = nv.arange(100, "f32")
    local w = base:view(10, 10)
    w:free() -- freed by hand and again by the scope
    return base:narrow(1, 11, 5)
  end)
  T.ok(base:is_freed(), "the base handle is freed")
  T.eq(v:totable(), {10, 11, 12, 13, 14}, "the view still reads its storage")
  T.eq(bytes() - m0, 400, "the storage lives while the view does")
  v:free()
  T.eq(bytes(), m0, "the last reference frees it")
  -- a view created in a scope of a tensor from outside: only the view handle is dropped
  local x = nv.ones(10)
  nv.scope(function() local _ = x:view(2, 5) end)
  T.eq(x:sum(), 10)
  x:free()
end)

T.case("quantized tensors are recorded and freed like tensors", function()
  local m0 = live()
  local q, qt, codes
  local keep = nv.scope(function()
    local x = nv.randn(32, 64, {generator = nv.Generator(1)})
    q = nv.quantize(x, "nvfp4", {block = "2d"})
    qt = q:t()
    codes = q:codes()
    return {q = nv.quantize(x, "e4m3")}
  end)
  T.ok(q:is_freed() and qt:is_freed() and codes:is_freed(), "QTensors and their derived tensors freed")
  T.ok(not keep.q:is_freed(), "a returned QTensor survives")
  T.eq(keep.q:format(), "e4m3")
  -- its codes and block scales are live (q:nbytes() also counts its fp32 scale, which is no tensor)
  T.eq(bytes() - m0, keep.q:nbytes() - 4, "only the kept one's tensors are live")
  keep.q:free()
  T.eq(bytes(), m0)
end)

T.case("<close> and t:free() inside a scope still work", function()
  local m0 = live()
  nv.scope(function()
    local a <close> = nv.zeros(10)
    local b = nv.zeros(10)
    b:free()
    T.eq(bytes() - m0, 40)
  end)
  T.eq(bytes(), m0)
end)

T.case("scopes are per coroutine; yielding across nv.scope raises and coroutine.close frees", function()
  local co_t, main_t, in_co
  nv.scope(function()
    main_t = nv.zeros(3)
    local co = coroutine.create(function()
      T.eq(nv.scope_depth(), 0, "a coroutine starts outside every scope")
      co_t = nv.zeros(3)
      coroutine.yield()
      nv.scope(function()
        in_co = nv.zeros(3)
        coroutine.yield()
      end)
    end)
    assert(coroutine.resume(co))
    T.eq(nv.scope_depth(), 1, "the main thread's scope")
    local ok, err = coroutine.resume(co)
    T.ok(not ok and tostring(err):find("coroutine.yield inside nv.scope (1 open in this coroutine)", 1, true),
      tostring(err))
    T.ok(not in_co:is_freed(), "a dead coroutine's scope waits for coroutine.close (or the GC)")
    coroutine.close(co)
    T.ok(in_co:is_freed(), "coroutine.close closes it")
  end)
  T.ok(main_t:is_freed())
  T.ok(not co_t:is_freed(), "made by the coroutine: not the main thread's scope's")
  co_t:free()
end)

-- ---- the nn modules and the training step under the arena -----------------------------------------

local llama = require "nvlua.llama"
local nn = require "nvlua.nn"
local optim = require "nvlua.optim"

local CFG = {vocab_size = 64, hidden_size = 32, intermediate_size = 96, num_hidden_layers = 2,
  num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16}

local function batch(g)
  local x = (nv.rand(2, 16, {generator = g}) * 63):to("i64")
  local y = (nv.rand(2, 16, {generator = g}) * 63):to("i64")
  return x, y
end

-- run fn with the collector stopped: only the arena and explicit frees may release memory
local function no_gc(fn)
  collectgarbage()
  collectgarbage("stop")
  local ok, err = pcall(fn)
  collectgarbage("restart")
  if not ok then error(err, 0) end
end

T.case("a Llama training step under nv.scope frees everything it does not keep", function()
  for _, name in ipairs({"f32", "bf16", "fp8_delayed", "nvfp4"}) do
    local m = llama.Llama(CFG, {recipe = nv.recipe[name](), seed = 1})
    local opt = optim.AdamW(m:named_parameters(), {lr = 1e-3})
    local g = nv.Generator(3)
    local function step()
      return nv.scope(function()
        local loss = m:forward_backward(batch(g))
        optim.clip_grad_norm(m:named_parameters(), 1.0)
        opt:step()
        m:zero_grad()
        return loss
      end)
    end
    no_gc(function()
      local m0 = bytes()
      local l1 = step()
      -- the one piece of state made lazily on the first step: the RoPE tables (T, D) x 2
      local rope = 2 * 16 * (CFG.hidden_size // CFG.num_attention_heads) * 4
      T.eq(bytes() - m0, rope, name .. ": after the first step, only the RoPE tables are new")
      local m1 = bytes()
      for _ = 1, 3 do step() end
      T.eq(bytes(), m1, name .. ": later steps leave nothing live")
      T.eq(nv.scope_depth(), 0)
      T.ok(l1 == l1 and l1 > 0, name .. ": a loss")
    end)
  end
end)

T.case("training under the arena is bit-exact with training without it", function()
  local function run(scoped)
    local m = llama.Llama(CFG, {recipe = nv.recipe.nvfp4(), seed = 1})
    local opt = optim.AdamW(m:named_parameters(), {lr = 1e-2})
    local g = nv.Generator(5)
    local losses = {}
    for i = 1, 3 do
      local function step()
        local x, y = batch(g)
        local loss = m:forward_backward(x, y)
        opt:step()
        m:zero_grad()
        x:free(); y:free()
        return loss
      end
      losses[i] = scoped and nv.scope(step) or step()
    end
    return losses, m.lm_head.weight_entry.param:clone()
  end
  local a, wa = run(true)
  local b, wb = run(false)
  T.eq(a, b, "the same losses")
  T.ok(wa:allclose(wb, 0, 0), "the same weights")
end)

T.case("a model and its optimizer built inside a scope keep their parameters and state", function()
  local m, opt = nv.scope(function()
    local model = llama.Llama(CFG, {seed = 1})
    return model, optim.AdamW(model:named_parameters(), {lr = 1e-3})
  end)
  for _, p in ipairs(m:named_parameters()) do
    T.ok(not p.param:is_freed() and not p.grad:is_freed(), p.name .. " and its grad live")
  end
  T.ok(not m.grad_buffer:is_freed(), "the flat gradient buffer lives")
  for name, t in pairs(opt.m) do
    T.ok(not t:is_freed() and not opt.v[name]:is_freed(), name .. ": AdamW state lives")
  end
  local x, y = batch(nv.Generator(1))
  T.ok(m:forward_backward(x, y) > 0, "and it trains")
  opt:step()
end)

T.case("modules: a forward's saved activations outlive its scope and die in backward's", function()
  local a = nn.Attention(CFG, {generator = nv.Generator(2)})
  local x = nv.randn(2, 16, 32, {generator = nv.Generator(4)})
  a.rope:get(16) -- the tables first: they are the cache's
  no_gc(function()
    local m0 = bytes()
    local y = a:forward(x)
    local saved = a._saved
    T.ok(saved and not saved.q:is_freed() and not saved.lse:is_freed(), "saved for backward")
    local dx = a:backward(y)
    T.ok(saved.q:is_freed() and saved.out:is_freed() and saved.lse:is_freed(), "freed by backward's scope")
    dx:free(); y:free()
    T.eq(bytes(), m0, "nothing else is left")
    a:eval()
    y = a:forward(x)
    T.eq(a._saved, nil, "eval keeps nothing")
    y:free()
    T.eq(bytes(), m0, "eval leaves nothing")
  end)
end)

T.case("modules: an error half-way through a forward frees what the forward had made", function()
  local r = nv.recipe.custom(function(c)
    if c.name == "boom" then error("boom in the recipe", 0) end
    return "bf16"
  end)
  local mlp = nn.MLP(CFG, {recipe = r})
  mlp.down_proj.name = "boom" -- gate and up run, then down's recipe raises
  local x = nv.randn(4, 32, {generator = nv.Generator(6)})
  mlp:eval()
  no_gc(function()
    local m0 = bytes()
    T.raises(function() mlp:forward(x) end, "boom in the recipe")
    T.eq(bytes(), m0, "g, u, h and the quantized copies were freed")
  end)
end)
