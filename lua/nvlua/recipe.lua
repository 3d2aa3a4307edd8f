-- nvlua.recipe: precision recipes. A recipe answers, for each linear layer and each of its three
-- GEMMs, how each operand is quantized (format, block layout, RHT, SR, scale rule, delayed
-- scaling), and runs those GEMMs for nn.Linear (core/NUMERICS.md §6 is the contract):
--
--   Y[T,N]  = X[T,K] · W[N,K]ᵀ   fprop   reduces over K   operands x, w
--   dX[T,K] = dY[T,N] · W        dgrad   reduces over N   operands dy, w
--   dW[N,K] = dYᵀ · X            wgrad   reduces over T   operands dy, x
--
-- Each operand is blocked along its GEMM's reduction dim: x and w along K in fprop, dy and w
-- along N in dgrad (a 2-D weight reuses the fprop quantization transposed, q:t()), dy and x
-- along T in wgrad ({axis = 1}). fprop and dgrad outputs are rounded to bf16 unless both operands
-- are f32; wgrad outputs are f32. The recipe's act_dtype (NUMERICS §11) is the dtype of the
-- activations between layers: "bf16" (the default of every preset but f32 and custom) returns
-- fprop and dgrad outputs as bf16 tensors; "f32" returns them as f32 tensors (holding bf16 values
-- unless the GEMM is f32 x f32), the dataflow before act_dtype existed, bit for bit.
-- Under data parallelism (set_amax_reducer, set_shard) each rank quantizes its slice of the global
-- batch exactly as one process would quantize the whole: global amax, global SR block indices.
-- Memory: each entry point runs in an nv.scope (lua/bind/scope.c), which frees its quantized
-- copies and temporaries when it returns; the fprop weight copy kept for dgrad travels in saved.
-- Not here: the layers themselves (nn.Linear owns parameters and calls linear_forward /
-- linear_backward), the kernels (nv.quantize / nv.qmatmul, core/quant.c).
local core = require "nvlua.core"
local util = require "nvlua.util"
local user_error = util.user_error
local quant = require "nvlua.quant"
local stats = require "nvlua.stats"
local formats = require "nvlua.formats"
local mor = require "nvlua.mor"

local check_opts = util.check_opts

local M = {}

local Recipe = {}
Recipe.__index = Recipe
Recipe.__name = "nvlua.Recipe"

local SPEC_KEYS = {"block", "delayed", "format", "rht", "scale_rule", "sr"}
local IS_SPEC_KEY = {}
for _, k in ipairs(SPEC_KEYS) do IS_SPEC_KEY[k] = true end

local ROLES = {"fprop", "dgrad", "wgrad"}
local OPERANDS = {fprop = {"x", "w"}, dgrad = {"dy", "w"}, wgrad = {"dy", "x"}}
local REDUCES = {fprop = "K", dgrad = "N", wgrad = "T"}

local F32 = {format = "f32"}
local BF16 = {format = "bf16"}

-- ---- options ----------------------------------------------------------------------------------

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

-- Checkers of option values for util.check_opts: nil for a good value, else what is wrong with it.
local function is_bool(v) if type(v) ~= "boolean" then return "must be true or false" end end
local function is_count(v) if math.type(v) ~= "integer" or v < 0 then return "must be a non-negative integer" end end
local function is_int(v) if math.type(v) ~= "integer" then return "must be an integer" end end
local function is_pos(v) if math.type(v) ~= "integer" or v < 1 then return "must be a positive integer" end end
local function one_of(...)
  local set, names = {}, {...}
  for _, n in ipairs(names) do set[n] = true end
  return function(v) if not set[v] then return "must be one of " .. table.concat(names, ", ") end end
end
local function is_switch(v)
  if type(v) ~= "table" then return "must be a table {step = N, forward_only = true|false}" end
  for k in pairs(v) do
    if k ~= "step" and k ~= "forward_only" then return "has an unknown field '" .. tostring(k) .. "' (valid: forward_only, step)" end
  end
  if math.type(v.step) ~= "integer" or v.step < 0 then return "needs step = a non-negative integer" end
  if v.forward_only ~= nil and type(v.forward_only) ~= "boolean" then return "needs forward_only = true or false" end
end

-- ---- specs ------------------------------------------------------------------------------------

local function where(r, c)
  return string.format("recipe %s: layer '%s' %s operand %s", r.name, tostring(c.name), c.role, c.operand)
end

-- A spec as the spec function returned it (a format name or a table) -> a fresh normalized
-- table {format, block ("1d"|"2d": formats with 16x16 tiles), rht, sr, scale_rule (e8m0-scaled
-- formats), delayed}; what a format allows comes from its traits (nvlua.formats).
local function normalize(r, c, s)
  if type(s) == "string" then s = {format = s} end
  if type(s) ~= "table" then
    user_error(string.format("%s: the spec must be a format name or a table {format = ...}, got %s", where(r, c), type(s)), 0)
  end
  for k in pairs(s) do
    if not IS_SPEC_KEY[k] then
      user_error(string.format("%s: unknown spec field '%s' (valid: %s)%s", where(r, c), tostring(k),
        table.concat(SPEC_KEYS, ", "), util.suggest(k, SPEC_KEYS)), 0)
    end
  end
  local f = s.format
  local ft = formats.get(f, where(r, c))
  for _, k in ipairs({"rht", "sr", "delayed"}) do
    if s[k] ~= nil and type(s[k]) ~= "boolean" then
      user_error(string.format("%s: %s must be true or false, got %s", where(r, c), k, tostring(s[k])), 0)
    end
  end
  local n = {format = f, rht = s.rht or false, sr = s.sr or false, delayed = s.delayed or false}
  if s.block ~= nil and s.block ~= "1d" and s.block ~= "2d" then
    user_error(string.format("%s: block must be \"1d\" or \"2d\", got %s", where(r, c), tostring(s.block)), 0)
  end
  if ft.block2d then
    n.block = s.block or "1d"
    if n.block == "2d" and c.operand ~= "w" then
      user_error(string.format("%s: 2d (16x16) blocks are for weights only", where(r, c)), 0)
    end
  elseif s.block == "2d" then
    user_error(string.format("%s: 2d blocks are an nvfp4 layout, not %s", where(r, c), f), 0)
  end
  if n.sr and not ft.sr then
    user_error(string.format("%s: stochastic rounding is defined for e2m1 elements (nvfp4, mxfp4), not %s", where(r, c), f), 0)
  end
  if ft.scale == "e8m0" then
    n.scale_rule = s.scale_rule or "rceil"
    if n.scale_rule ~= "rceil" and n.scale_rule ~= "floor" then
      user_error(string.format("%s: scale_rule must be \"rceil\" or \"floor\", got %s", where(r, c), tostring(s.scale_rule)), 0)
    end
  elseif s.scale_rule ~= nil then
    user_error(string.format("%s: scale_rule is an mxfp8 option, not %s's", where(r, c), f), 0)
  end
  if n.delayed and not ft.global_amax then
    user_error(string.format("%s: delayed scaling needs a format with a global amax (e4m3, e5m2, nvfp4), not %s", where(r, c), f), 0)
  end
  return n
end

local function same_spec(a, b)
  return a.format == b.format and a.block == b.block and a.rht == b.rht and a.sr == b.sr and a.delayed == b.delayed
    and a.scale_rule == b.scale_rule
end

-- Can the fprop quantization of W serve dgrad as q:t()? Only where the transpose is exact: 2-D
-- nvfp4 tiles, per-tensor fp8, bf16 and f32; never with an RHT or SR (a different transform/draw).
local function transposable(s)
  if s.rht or s.sr then return false end
  local ft = formats.traits[s.format]
  return ft.scale == "none" or ft.scale == "fp32" or (ft.block2d and s.block == "2d")
end

--- recipe:spec(ctx, role, operand) -> the normalized spec of one operand of one GEMM.
-- ctx = {name=, block=, num_blocks=, high_precision=, step=}; role "fprop"|"dgrad"|"wgrad";
-- operand "x"|"w"|"dy". The spec function sees a copy of ctx with role and operand added.
function Recipe:spec(ctx, role, operand)
  local c = {name = ctx.name, block = ctx.block, num_blocks = ctx.num_blocks, high_precision = ctx.high_precision or false,
    step = ctx.step, role = role, operand = operand}
  return normalize(self, c, self.fn(c))
end

local function spec_label(s)
  return s.format
end

--- recipe:gemm(ctx, role) -> {role, a = spec, b = spec, out = "f32"|"bf16", label}: one GEMM's plan;
-- a is the first operand (x for fprop, dy otherwise), label the stats key.
function Recipe:gemm(ctx, role)
  local ops = OPERANDS[role]
  if not ops then error(string.format("recipe: invalid role '%s' (valid: fprop, dgrad, wgrad)", tostring(role)), 2) end
  local a, b = self:spec(ctx, role, ops[1]), self:spec(ctx, role, ops[2])
  if a.rht ~= b.rht then
    error(string.format("recipe %s: layer '%s' %s: the RHT must be on both operands (%s, %s) or on neither", self.name,
      tostring(ctx.name), role, ops[1], ops[2]), 0)
  end
  local out = "bf16"
  if role == "wgrad" or (a.format == "f32" and b.format == "f32") then out = "f32" end
  local la, lb = spec_label(a), spec_label(b)
  return {role = role, a = a, b = b, out = out, label = la == lb and la or (la .. " x " .. lb)}
end

-- ---- running the GEMMs ------------------------------------------------------------------------

-- Delayed scaling: the amax to quantize with, from the history of key (nil: the history has no
-- usable amax yet, so this step uses current scaling), and the history record.
function Recipe:_history(key)
  local h = self:_history_rec(key)
  if h.dev then host_of_dev(h) end -- the tensor is on the host now
  local a = h.h:amax() -- max over the window's finite entries; 0 when none is positive
  if a > 0 then h.last = a end
  return h.last, h
end

-- Delayed scaling on a device: the history of key lives there (f32 (len + 1): the values, then the
-- last usable amax, 0 for none), so choosing the amax and pushing this step's cost no host
-- synchronisation (core.amax_history_step: the same rule as _history and its push). The record
-- keeps either the host history (h, last) or the device one (dev); each converts to the other
-- where it is needed (state(), a tensor on the other device).
local function dev_of_host(rec, len, device)
  local vals = {}
  for i = 1, len + 1 do vals[i] = 0 end
  for i = 1, rec.h.count do vals[i] = rec.h.values[i] end
  vals[len + 1] = rec.last or 0
  return {buf = core.unscope(core.tensor(vals):to(device)), len = len, count = rec.h.count,
    pos = rec.h.count > 0 and rec.h.pos % len or 0}
end

local function host_of_dev(rec)
  local d = rec.dev
  local v = d.buf:cpu():totable()
  local h = quant.AmaxHistory(d.len)
  for i = 1, d.count do h.values[i] = v[i] end
  h.count = d.count
  h.pos = d.count > 0 and (d.pos - 1) % d.len + 1 or 0
  rec.h, rec.last = h, v[d.len + 1] > 0 and v[d.len + 1] or nil
  d.buf:free()
  rec.dev = nil
end

function Recipe:_history_rec(key)
  local rec = self.histories[key]
  if not rec then
    rec = {h = quant.AmaxHistory(self.history_len), last = nil}
    self.histories[key] = rec
  end
  return rec
end

-- The amax (a device tensor) to quantize t with under delayed scaling, this step's amax pushed:
-- cur (a fused group's, on t's device), else t's own.
function Recipe:_device_amax(key, t, s, axis, cur)
  local rec = self:_history_rec(key)
  if rec.dev and rec.dev.buf:device() ~= t:device() then host_of_dev(rec) end
  if not rec.dev then rec.dev = dev_of_host(rec, rec.h.len, t:device()) end
  local d = rec.dev
  cur = cur or core.quant_amax(t, {axis = axis, rht = s.rht}) -- what the quantization scales, on the device
  local sel = core.amax_history_step(d.buf, d.count, d.pos, cur)
  d.pos, d.count = (d.pos + 1) % d.len, math.min(d.count + 1, d.len)
  return sel
end

-- Formats scaled by one amax for the whole tensor: under data parallelism that amax is the one
-- over every rank's slice (set_amax_reducer).
-- max |x| over what quantize scales (t, or its RHT along axis), NaN ignored as quantize ignores it.
-- Its temporaries die before the quantization that needs the amax runs.
local function local_amax(t, s, axis)
  return core.scope(function()
    if s.rht and t:device() == "cuda" then -- no standalone RHT on the GPU: quantize's amax is the one after it
      return quant.quantize(t, "nvfp4", {axis = axis, rht = true}).amax
    end
    local rt = s.rht and quant.rht(t, {axis = axis}) or t
    local a = rt:amax()
    if a ~= a then -- Tensor:amax propagates NaN; quantize's own amax (here fp8's) skips it
      a = quant.quantize(rt, "e4m3").amax
    end
    return a
  end)
end

-- ---- sibling linears: one quantization of their shared input -----------------------------------
--
-- The q, k, v projections read one input, as do gate and up (and, in backward, their wgrads read
-- that input again). Inside M.share(fn), a quantization that depends only on its input and spec
-- (no SR draw, no delayed-scaling history, no amax collective) of a tensor viewing the same
-- elements as one quantized earlier in the same share, with the same spec and axis, is that earlier
-- (activations: x, dy; a weight's copy may be kept past the share for dgrad)
-- quantization: the same bits, computed once. The memo owns those copies and frees them when fn
-- returns (or raises); the input must not change inside fn.
local memo -- nil outside M.share

local function same_view(a, b)
  if a:dtype() ~= b:dtype() or not a:is_view_of(b) or a:storage_offset() ~= b:storage_offset() then return false end
  local sa, sb, ta, tb = a:size(), b:size(), a:stride(), b:stride()
  if #sa ~= #sb then return false end
  for i = 1, #sa do
    if sa[i] ~= sb[i] or ta[i] ~= tb[i] then return false end
  end
  return true
end

local function spec_key(s, axis)
  return table.concat({s.format, tostring(s.block), tostring(s.rht), tostring(s.scale_rule), axis}, "|")
end

-- The memo's copy of t's elements for spec key sk, or nil.
local function memo_find(sk, t)
  for _, e in ipairs(memo) do
    if e.key == sk and same_view(t, e.t) then return e.q end
  end
end

-- Give q (for t's elements, spec key sk) to the memo: it and a handle of its own on t's elements
-- outlive the caller's scope, until the share ends.
local function memo_add(sk, t, q)
  memo[#memo + 1] = {key = sk, t = core.unscope(t:view(t:size())), q = core.unscope(q)}
end

--- recipe.share(fn, ...) -> fn(...): run sibling linears that read one input (see above); nested
-- shares use the outermost memo.
function M.share(fn, ...)
  if memo then return fn(...) end
  memo = {}
  local r = table.pack(pcall(fn, ...))
  local m = memo
  memo = nil
  for _, e in ipairs(m) do
    e.q:free()
    e.t:free()
  end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

-- ---- amaxes from the layer that produced an activation ------------------------------------------
--
-- RMSNorm and SwiGLU on a device compute their output's amax in the pass that writes it (core's
-- *_forward with amax: TE's fused amax) and note it here; a per-tensor quantization of that output
-- (current scaling, no RHT, no data-parallel reduction) then takes it instead of an amax pass of
-- its own: the same value (max |x| of the stored elements, NaN ignored), the same bits.
-- Only the latest note is kept (its consumers — q/k/v after a norm, gate/up after the other, down
-- after SwiGLU — run before the next note), and none past a training step (weight_cache's end): a
-- note holds a handle on its tensor, which must not keep an activation alive.
local hint -- nil, or {t = a handle on the output, amax = its f32 (1) tensor}

local function drop_hint()
  if hint then
    hint.amax:free()
    hint.t:free()
    hint = nil
  end
end

--- recipe.note_amax(t, amax): amax (a one-element f32 tensor, taken over) is max |t|.
function M.note_amax(t, amax)
  drop_hint()
  hint = {t = core.unscope(t:view(t:size())), amax = core.unscope(amax)}
end

-- -> the noted amax for copy spec s of activation t, where it applies
function Recipe:_amax_hint(s, t)
  if not hint or s.rht or s.delayed or self.amax_reducer then return nil end
  local ft = formats.traits[s.format]
  if not (ft and ft.global_amax) or not same_view(t, hint.t) then return nil end
  return hint.amax
end

-- ---- weights: one quantization per optimizer step ----------------------------------------------
--
-- Inside M.weight_cache(fn) — the forward and backward passes of one optimizer step, every
-- micro-batch, during which no weight changes — a weight's quantization for a spec that depends
-- only on the weight (no SR draw, no delayed-scaling history) is made at its first use and reused by
-- every later GEMM needing the same copy: fprop of each micro-batch, and dgrad's copy (on a device,
-- its re-quantization along the other axis). The same bits as quantizing anew each time, once. The
-- cache owns the copies and frees them when fn returns (or raises). Llama:forward_backward runs in
-- one (so fprop and dgrad share), and the training loop wraps each step's micro-batches in one.
-- A weight's copies can be dropped earlier (M.weight_cache_drop: nvlua.shard, when it frees a
-- gathered weight); a backward whose fprop copy was dropped re-makes it from the weight (the same
-- call, the same bits: it depends only on the weight's values) and caches it again.
local wcache -- nil outside M.weight_cache

--- recipe.weight_cache(fn, ...) -> fn(...): see above; nested caches use the outermost.
function M.weight_cache(fn, ...)
  if wcache then return fn(...) end
  wcache = {by = setmetatable({}, {__mode = "k"}), list = {}, n = 0, amax = {}}
  local r = table.pack(pcall(fn, ...))
  local c = wcache
  wcache = nil
  for q in pairs(c.list) do q:free() end
  for _, m in pairs(c.amax) do for _, a in pairs(m) do a:free() end end -- fused groups' amaxes
  drop_hint() -- the step's activations are gone
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- recipe.weight_cache_size() -> the number of quantized weight copies the open cache holds (0
-- outside one): for tests and memory accounting.
function M.weight_cache_size() return wcache and wcache.n or 0 end

--- recipe.weight_cache_drop(w): free the open cache's copies of weight w now (nothing outside a
-- cache, or when it holds none): for a weight about to be freed (nvlua.shard's gathered weights). A
-- backward that saved one of them re-makes it (see above).
function M.weight_cache_drop(w)
  local m = wcache and wcache.by[w]
  if not m then return end
  for _, q in pairs(m) do
    wcache.list[q] = nil
    wcache.n = wcache.n - 1
    q:free()
  end
  wcache.by[w] = nil
end

local function cacheable(s) return wcache ~= nil and not s.sr and not s.delayed end

--- recipe.weight_cache_open() -> whether a weight cache is open (M.weight_cache)
function M.weight_cache_open() return wcache ~= nil end

--- recipe.weight_cache_put(w, key, q): give the open cache q as weight w's copy under key (a key of
-- Recipe:gathered_weight's): nvlua.shard's quantized all-gather, whose copies are the weight's
-- quantization without the weight (w a placeholder of its shape); the cache owns and frees q
function M.weight_cache_put(w, key, q)
  if not wcache then error("weight_cache_put: no weight cache is open", 2) end
  local m = wcache.by[w]
  if not m then m = {}; wcache.by[w] = m end
  if m[key] then error("weight_cache_put: the cache already holds a copy under " .. key, 2) end
  m[key] = core.unscope(q)
  wcache.list[q] = true
  wcache.n = wcache.n + 1
end

-- ---- activation recompute: a forward's decisions, taped and replayed ---------------------------
--
-- Activation recompute (llama.Block, recompute = "block") runs a block's forward twice: in the
-- forward pass, keeping nothing but the block's input, and again in its backward, to rebuild what
-- the backward reads. The second run must give the same bits and change nothing. Most of a forward
-- depends only on its inputs and the weights — current scaling, the weight cache's copies, the share
-- memo, the layers' arithmetic — and is simply computed again. What depends on state or on other
-- ranks is decided once: inside M.record(fn) each such quantization writes what it decided on a tape,
-- under its (layer, operand, role) key, in order; inside M.replay(tape, fn) the same quantization takes
-- its entry instead of deciding again:
--   delayed scaling   the amax the history chose (a number, or the device tensor of a device
--                     history), used as it was; nothing pushed to the history
--   data parallelism  the global amax the ranks' max all-reduce gave (recipe:set_amax_reducer); the
--                     collective is not run again
--   SR                the generator offset its draws started at; the generator is set there for the
--                     quantization and put back after, so no new bits are drawn
--   MoR               the representation chosen (a format per tensor, the choice tensor per block),
--                     neither measured nor decided nor counted again (nvlua.mor)
-- and, during a replay, stats.count and recipe:trace's hook are skipped (the step ran each GEMM once
-- as far as its counters and traces go). A replayed quantization asks for exactly the entries the
-- recorded one wrote; anything else is an error naming the key, never a silent re-decision.
-- Not here: what a recompute keeps and when it runs (llama.Block), the selective recompute of norms
-- and SwiGLU (nn.lua), which involves no quantization decision.
local tape -- nil; or {replay = false|true, entries = {[key] = {entry, ...}}, pos = {[key] = n}, owned = {tensors}}

--- recipe.record(fn, ...) -> tape, fn(...): run a forward, taping its quantization decisions (above).
function M.record(fn, ...)
  if tape then error("recipe.record: a tape is already open (activation recompute does not nest)", 2) end
  local t = {replay = false, entries = {}, pos = {}, owned = {}}
  tape = t
  local r = table.pack(pcall(fn, ...))
  tape = nil
  if not r[1] then
    M.release_tape(t)
    error(r[2], 0)
  end
  return t, table.unpack(r, 2, r.n)
end

--- recipe.replay(t, fn, ...) -> fn(...): run the forward again with the decisions of tape t (above).
function M.replay(t, fn, ...)
  if tape then error("recipe.replay: a tape is already open (activation recompute does not nest)", 2) end
  if type(t) ~= "table" or t.entries == nil then error("recipe.replay: expects a tape from recipe.record", 2) end
  t.replay, t.pos = true, {}
  tape = t
  local r = table.pack(pcall(fn, ...))
  tape = nil
  drop_hint() -- the replayed forward's consumers of a noted amax have run (see note_amax)
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- recipe.release_tape(t): free what tape t holds (device amaxes, MoR choices); t is then empty.
function M.release_tape(t)
  if type(t) ~= "table" or not t.owned then return end
  for _, x in ipairs(t.owned) do x:free() end
  t.entries, t.owned = {}, {}
end

--- recipe.replaying() -> true inside recipe.replay
function M.replaying() return tape ~= nil and tape.replay end

-- Record entry e under key (while a forward is recorded); the tensors given after e become the tape's
-- (unscoped; recipe.release_tape frees them).
local function tape_put(key, e, ...)
  if not tape or tape.replay then return end
  local l = tape.entries[key]
  if not l then l = {}; tape.entries[key] = l end
  l[#l + 1] = e
  for _, x in ipairs({...}) do tape.owned[#tape.owned + 1] = core.unscope(x) end
end

-- The next entry of key in a replay (nil outside one); an error where the recorded forward made none.
local function tape_take(key)
  if not tape or not tape.replay then return nil end
  local n = (tape.pos[key] or 0) + 1
  local e = (tape.entries[key] or {})[n]
  if not e then
    error(string.format("recompute: the recomputed forward quantized %s%s, which the first forward did not (it must " ..
      "run the same quantizations in the same order)", key, n > 1 and (" a " .. n .. "th time") or ""), 0)
  end
  tape.pos[key] = n
  return e
end

-- q = make() with generator g's offset at `offset` (an SR quantization replayed), g put back after.
local function at_offset(g, offset, make)
  local now = g:offset()
  g:set_offset(offset)
  local ok, q = pcall(make)
  g:set_offset(now)
  if not ok then error(q, 0) end
  return q
end

--- recipe internals for nvlua.mor (which recipe.lua requires): the tape of an open record / replay
Recipe._tape_put = function(_, key, e, ...) return tape_put(key, e, ...) end
Recipe._tape_take = function(_, key) return tape_take(key) end
Recipe._replaying = function() return M.replaying() end

-- The cached copy of weight w under key, else make()'s result, cached (unscoped: the cache frees it).
-- -> q, true when the cache owns q (the caller must not free it).
local function cached(w, key, make)
  local m = wcache.by[w]
  if not m then m = {}; wcache.by[w] = m end
  local q = m[key]
  if not q then
    q = core.unscope(make())
    m[key] = q
    wcache.list[q] = true
    wcache.n = wcache.n + 1
  end
  return q, true
end

-- ---- fused groups: one weight amax per group ----------------------------------------------------
--
-- Megatron trains q, k and v as one linear (linear_qkv) and gate and up as another (linear_fc1):
-- one weight, so one per-tensor amax (TransformerEngine's parameters_split concatenates the parts
-- before its one weight quantizer), and inference engines load them fused the same way (vLLM's
-- qkv_proj, gate_up_proj: one global scale). nvlua's parts are separate Linears (nn.fuse marks
-- them); under fused_amax a recipe quantizes each part's weight with the amax of the whole group —
-- the max over the parts of what quantize scales — wherever it would take the weight's own:
-- current scaling each step (nvfp4's global amax, fp8_cs), delayed scaling from one history for the
-- group, read and pushed once per round (below) with the group's amax. Each part's codes are then
-- those of the concatenated weight's rows, bit for bit, where the parts' blocks do not straddle
-- (nvfp4 16x16 tiles: rows a multiple of 16 per part). Only weights: the parts' input is one tensor,
-- quantized once for all of them (recipe.share) or, where that cannot be (delayed scaling, data
-- parallelism), by each part from the same values and so with the same amax.
-- Not under fused_amax: the quantized all-gather (Recipe:gathered_weight: each rank would scale a
-- part by the part's own global amax), MoR (which chooses each operand's format as it runs).

-- the group's amax for spec s along axis: a one-element f32 tensor on the weights' device, no host
-- sync. The parts' amaxes (core.quant_amax: NaN ignored, after the RHT where s has one) are written
-- side by side and their maximum is the amax of that row: exact, and on any backend.
local function group_amax(f, s, axis)
  local ws = f.weights()
  local row = core.empty({1, #ws}, "f32", ws[1]:device()) -- (1, parts)
  for i, w in ipairs(ws) do row:narrow(2, i, 1):copy_(core.quant_amax(w, {axis = axis, rht = s.rht}):view(1, 1)) end
  return core.quant_amax(row)
end

-- group_amax once per weight cache (no weight changes inside one; the cache frees it), else anew
local function fused_amax(f, s, axis)
  if not wcache then return group_amax(f, s, axis) end
  local m = wcache.amax[f.id]
  if not m then m = {}; wcache.amax[f.id] = m end
  local sk = spec_key(s, axis)
  if not m[sk] then m[sk] = core.unscope(group_amax(f, s, axis)) end
  return m[sk]
end

-- Delayed scaling of a fused group's weights: a round runs from a part's quantization until that
-- part is quantized again (q, k, v: one forward), as one fused weight is quantized once per forward.
-- The round's first quantization reads the group's history and pushes the group's amax (the first
-- step: the group's amax itself, current scaling); the other parts take the amax it chose.
-- device: the history on t's device (Recipe:_device_amax). -> the amax (a number, or a device
-- tensor handle of the caller's own).
function Recipe:_fused_delayed(f, s, t, axis, device)
  local r = self.rounds[f.hkey]
  if r and r.device == device and not r.seen[f.part] then
    r.seen[f.part] = true
    if device then return r.amax:view(r.amax:size()) end
    return r.amax
  end
  if r and r.device then r.amax:free() end
  local amax
  if device then
    amax = self:_device_amax(f.hkey, t, s, axis, group_amax(f, s, axis))
    r = {amax = core.unscope(amax:view(amax:size()))}
  else
    local hist, rec = self:_history(f.hkey)
    local cur = group_amax(f, s, axis):amax()
    rec.h:push(cur)
    amax = hist or cur
    r = {amax = amax}
  end
  r.seen, r.device = {[f.part] = true}, device
  self.rounds[f.hkey] = r
  return amax
end

-- Quantize t (2-D) per spec, blocked along axis (1 or 2). key names the delayed-scaling history.
-- split: t is an activation or gradient whose rows (tokens) are this rank's share of the global
-- batch under data parallelism (x, dy; not a weight): its amax is reduced over the ranks and its
-- SR draws are placed at its rows' global block indices (set_shard). fused: t is a weight scaled by
-- its fused group's amax (Recipe:_fused).
function Recipe:_quantize(s, t, axis, key, split, fused)
  -- an activation already in its spec's dtype (bf16 x, dy) along its last dim is used in place
  local o = {axis = axis, view = split or nil}
  if s.block == "2d" then o.block = "2d" end
  if s.rht then o.rht = true end
  if s.sr then o.sr = true; o.generator = self.gen end
  if s.scale_rule then o.scale_rule = s.scale_rule end
  -- delayed scaling with its history on the device (not under data parallelism: its amaxes are reduced
  -- on the host, and its SR draws placed by the shard below)
  local device_history = s.delayed and t:device() ~= "cpu" and not self.amax_reducer
  if s.sr and split and self.shard and not device_history then -- rank r's tokens are rows [r·n, (r+1)·n) of the global batch
    local n = t:size(1)
    if axis == 2 then o.sr_row_offset = self.shard.rank * n
    else o.sr_k_offset, o.sr_k_total = self.shard.rank * n, self.shard.world * n end
  end
  -- what depends on state or on the other ranks: a recompute replays the first forward's decision
  local reduced = split and self.amax_reducer and formats.traits[s.format].global_amax
  local taped = s.delayed or s.sr or reduced
  local e = taped and tape_take(key)
  if e then
    o.amax = e.amax
    if split and o.amax == nil then o.amax = self:_amax_hint(s, t) end
    if s.sr then return at_offset(self.gen, e.offset, function() return quant.quantize(t, s.format, o) end) end
    return quant.quantize(t, s.format, o)
  end
  local offset = s.sr and self.gen:offset() or nil -- where this quantization's SR draws start
  local rec, hist
  if fused and s.delayed then -- the group's history, once per round
    o.amax = self:_fused_delayed(fused, s, t, axis, device_history)
    tape_put(key, {amax = o.amax, offset = offset}, device_history and o.amax or nil)
    return quant.quantize(t, s.format, o)
  end
  if device_history then -- the history on the device
    o.amax = self:_device_amax(key, t, s, axis)
    tape_put(key, {amax = o.amax, offset = offset}, o.amax)
    return quant.quantize(t, s.format, o)
  end
  if s.delayed then hist, rec = self:_history(key); o.amax = hist end
  local global -- this step's amax over all ranks
  if reduced and (hist == nil or rec) then
    global = self.amax_reducer(local_amax(t, s, axis))
    if hist == nil then o.amax = global end
  end
  if taped then tape_put(key, {amax = o.amax, offset = offset}) end
  if split and o.amax == nil then o.amax = self:_amax_hint(s, t) end -- the producer's fused amax
  -- activations only (split): a weight's fprop copy may be kept for dgrad past the share
  local shared = memo and split and not s.sr and not s.delayed and global == nil and not self.amax_reducer
  local sk = shared and spec_key(s, axis)
  local found = shared and memo_find(sk, t)
  if found then return found end
  local function make()
    if fused then o.amax = fused_amax(fused, s, axis) end
    return quant.quantize(t, s.format, o)
  end
  if not split and cacheable(s) then return cached(t, spec_key(s, axis), make) end -- a weight: once per optimizer step
  local q = make()
  if shared then memo_add(sk, t, q) end
  if rec then -- push this step's true amax (in the RHT domain if transformed: that is what is scaled)
    local cur = global
    if cur == nil then
      if hist == nil then cur = q.amax
      elseif s.rht then cur = core.scope(function() return quant.rht(t, {axis = axis}):amax() end)
      else cur = t:amax() end
    end
    rec.h:push(cur)
  end
  return q
end

-- Both copies of an activation or gradient t (2-D, rows = tokens): per spec a blocked along its
-- last dim (fprop's x, dgrad's dy) and per spec b along the tokens (wgrad's), from one read of t
-- where the backend fuses them (core.quantize_rowcol; on the CPU, two quantizations):
-- TransformerEngine's dataflow. b is a, or a with the RHT added (the NVFP4 recipe's wgrad copies).
-- Bit for bit the two _quantize calls (SR: the row copy draws the generator's offset o, the column
-- copy o + 1, the order of the two calls). -> row, col. Only for pairable specs (below).
function Recipe:_quantize_pair(a, b, t, split)
  local sk_r, sk_c = spec_key(a, 2), spec_key(b, 1)
  local shared = memo and split and not a.sr
  if shared then
    local r, c = memo_find(sk_r, t), memo_find(sk_c, t)
    if r and c then return r, c end
  end
  local o = {amax = self:_amax_hint(a, t)} -- the row copy's (and a same-spec column copy's) amax
  if a.rht then o.rht = true elseif b.rht then o.rht_col = true end
  if a.sr then o.sr = true; o.generator = self.gen end
  if a.scale_rule then o.scale_rule = a.scale_rule end
  local r, c = core.quantize_rowcol(t, a.format, o)
  if shared then
    memo_add(sk_r, t, r)
    memo_add(sk_c, t, c)
  end
  return r, c
end

-- Can a and b (the specs of one tensor's row and column copies) come from one fused pass? The same
-- quantization along the two axes (the column copy may add the RHT), a quantized format (bf16 and
-- f32 copies are views or plain transposes), no delayed-scaling history (per role), no
-- data-parallel amax reduction or SR slab placement (per copy).
function Recipe:_pairable(a, b)
  local ft = formats.traits[a.format]
  if not (ft and ft.quantized) or a.delayed or self.amax_reducer or self.shard then return false end
  if same_spec(a, b) then return true end
  return not a.rht and b.rht and same_spec(a, {format = b.format, block = b.block, rht = false, sr = b.sr,
    delayed = b.delayed, scale_rule = b.scale_rule})
end

--- recipe:set_amax_reducer(fn | nil): data parallelism. fn(amax) -> the max of every rank's amax
-- (a collective: every rank quantizes the same operands in the same order). Activations and
-- gradients in per-tensor-scaled formats (nvfp4's global amax, fp8 current and delayed scaling)
-- are then scaled by the amax of the whole global batch, so R ranks x batch B quantize exactly
-- as 1 rank x batch R·B. Weights are the same on every rank and are not reduced.
function Recipe:set_amax_reducer(fn)
  if fn ~= nil and type(fn) ~= "function" then error("set_amax_reducer: expects a function or nil", 2) end
  if fn ~= nil and self.mor then
    error("recipe mor: data parallelism is not supported yet (each rank would choose representations from its " ..
      "own slice of the batch, not as one process would from the whole)", 2)
  end
  self.amax_reducer = fn
end

--- recipe:set_shard(rank, world): this rank's activations and gradients are the rows [rank·n,
-- (rank+1)·n) of the global batch's (n tokens per rank, the same on every rank), so stochastic
-- rounding draws the Philox bits of those rows' blocks in the global tensor (NUMERICS §3): the
-- row-wise copy of dY from row rank·n, the column-wise copy (blocked along tokens) from column
-- rank·n of world·n. world 1 (or nil) clears it.
function Recipe:set_shard(rank, world)
  if world and world > 1 then
    if math.type(rank) ~= "integer" or rank < 0 or rank >= world then error("set_shard: rank must be in 0..world-1", 2) end
    self.shard = {rank = rank, world = world}
  else
    self.shard = nil
  end
end

-- The dgrad copy Wᵀ of a weight from its fprop quantization q (a transposable spec s, blocked
-- along K): q:t() on the CPU. On a GPU W is quantized again along its other axis with q's amax: for
-- 2-D nvfp4 tiles and per-tensor fp8 that gives exactly q:t()'s values (NUMERICS §2;
-- tests/test_recipe.lua checks the identity on the CPU). The amax is given as q itself: on a device
-- it is read where it lives, no host sync. Without w (a weight all-gathered quantized, whose
-- full-precision rows this rank does not hold: nv.quant.all_gather_quantized) q:t() on the device too.
local function transposed(q, w, s, requantize)
  if not requantize and (q:device() ~= "cuda" or w == nil) then return q:t() end
  local o = {axis = 1}
  if s.block == "2d" then o.block = "2d" end
  if formats.traits[s.format].global_amax then o.amax = q end
  return quant.quantize(w, s.format, o)
end
M._transposed = transposed -- for the test of that identity (tests/test_recipe.lua)

-- The f32 x f32 GEMM without an RHT runs as a plain matmul (no copies).
local function plain(g) return g.a.format == "f32" and g.b.format == "f32" and not g.a.rht end

--- recipe:gathered_weight(ctx) -> nil, or {spec =, fkey =, dkey =}: can the linear of ctx take its
-- weight as quantized copies made elsewhere (nvlua.shard's quantized all-gather,
-- nv.quant.all_gather_quantized with copies = "both"), never reading the weight itself? Where fprop
-- and dgrad quantize the weight with one cacheable spec (a quantized format; no SR, delayed history
-- or RHT) and the weight cache is open: linear_forward then finds fprop's copy under fkey and
-- linear_backward dgrad's under dkey (the keys they ask the cache for). nil for plain or bf16
-- weights, MoR, a weight scaled by its fused group's amax (fused_amax), other specs: those read the
-- f32 weight.
function Recipe:gathered_weight(ctx)
  if not wcache or (self.mor and not ctx.high_precision) then return nil end
  local g, gd = self:gemm(ctx, "fprop"), self:gemm(ctx, "dgrad")
  if plain(g) or plain(gd) then return nil end
  local s = g.b
  local ft = formats.traits[s.format]
  if not (ft and ft.quantized) or s.sr or s.delayed or s.rht or not same_spec(s, gd.b) then return nil end
  if self:_fused(ctx, s, "fprop") then return nil end -- scaled by its group's amax (fused_amax)
  return {spec = s, fkey = spec_key(s, 2), dkey = "dgrad|" .. spec_key(s, 1)}
end

-- (the bf16 product, when out is bf16, is left to the caller's scope). act: the recipe's act_dtype;
-- a bf16 activation is the GEMM's own bf16 output, or its f32 output rounded once.
local function qgemm(qa, qb, out, act)
  local y = quant.qmatmul(qa, qb, {out = out})
  if act == "bf16" then return out == "bf16" and y or y:to("bf16") end
  return out == "bf16" and y:to("f32") or y
end

-- t as an f32 tensor: itself, or its exact widening (a bf16 activation entering a plain f32 GEMM)
local function wide(t) return t:dtype() == "f32" and t or t:to("f32") end

local function key_of(ctx, operand, role) return tostring(ctx.name) .. "|" .. operand .. "|" .. role end

-- Under fused_amax, the fused group (ctx.group: nn.fuse) whose amax scales the weight of ctx under
-- spec s, a format with a per-tensor amax, in GEMM role (its delayed-scaling history: hkey); else nil.
function Recipe:_fused(ctx, s, role)
  local g = self.fused_amax and ctx.group
  local ft = g and formats.traits[s.format]
  if not (ft and ft.global_amax) then return nil end
  return {id = g.id, part = g.part, weights = g.weights, hkey = key_of(g, "w", role)}
end

--- recipe:weight_group(ctx) -> the name of the fused group whose amax scales the weight of the
-- linear of ctx (Linear:context(); nn.fuse: "model.layers.3.self_attn.qkv_proj", "...mlp.gate_up_proj"),
-- or nil: a recipe with fused_amax, a part of a group, its fprop weight in a format with a per-tensor
-- amax (nvfp4, e4m3; not a bf16 block). Every part of a group has the same weight_scale_2 then.
-- (ctx.group.name is the group a linear is part of, whatever the recipe.)
function Recipe:weight_group(ctx)
  if self.mor or not (ctx and ctx.group) then return nil end
  return self:_fused(ctx, self:spec(ctx, "fprop", "w"), "fprop") and ctx.group.name or nil
end

local function as2d(t, what)
  local d = t:dim()
  if d == 2 then return t end
  if d < 2 then error(string.format("recipe: %s must have at least 2 dims, got %d", what, d), 3) end
  return t:reshape(-1, t:size(d))
end

local function reshape_like(y, lead, last)
  if #lead == 2 then return y end
  local shape = {}
  for i = 1, #lead - 1 do shape[i] = lead[i] end
  shape[#shape + 1] = last
  return y:reshape(shape)
end

--- recipe:fprop_weight(ctx, w) -> spec, q: how the fprop GEMM of the linear of ctx reads its weight w
-- [N, K]: its spec, and its quantization made by linear_forward's own call (the weight cache's copy
-- inside one; under delayed scaling the history's amax, this amax pushed as a forward pushes it). q is
-- nil where the GEMM reads w itself (f32); spec is nil for MoR, which chooses as it runs. For exports
-- (nvlua.deploy), which thereby hold the training forward's codes and scales.
function Recipe:fprop_weight(ctx, w)
  if self.mor and not ctx.high_precision then return nil end
  local g = self:gemm(ctx, "fprop")
  if plain(g) then return g.b, nil end
  return g.b, self:_quantize(g.b, w, 2, key_of(ctx, "w", "fprop"), nil, self:_fused(ctx, g.b, "fprop"))
end

--- recipe:linear_forward(ctx, x, w [, no_backward]) -> y, saved
-- x [T,K] f32 or bf16 (or [..., K]), w [N,K] f32 -> y [T,N] of the recipe's act_dtype (f32: bf16-
-- rounded values unless the GEMM is f32 x f32). saved holds w, x (or, where fprop's and wgrad's
-- specs of x pair, x's wgrad copy quantized in the same pass as fprop's, instead: TE's dataflow)
-- and, when dgrad will reuse it, the fprop quantization of w. no_backward (eval): no wgrad copy.
-- ctx.recompute_input (nn.Linear's recompute_input, selective recompute): x itself is saved, never a
-- wgrad copy, so that the layer may drop it and be given it back for the backward.
function Recipe:linear_forward(ctx, x, w, no_backward)
  return core.scope(function()
    local shape = x:size()
    local x2 = as2d(x, "x")
    if self.mor and not ctx.high_precision then -- MoR: each operand's representation from its numbers
      local y = self.mor:forward(self, ctx, x2, w)
      return reshape_like(y, shape, w:size(1)), {x = x2, K = x2:size(2), w = w, shape = shape, mor = true}
    end
    local g = self:gemm(ctx, "fprop")
    local y, qw, qw_cached, qx_col
    if plain(g) then
      if self.hook and not M.replaying() then core.unscoped(self.hook, {ctx = ctx, role = "fprop", gemm = g, a = x2, b = w}) end
      y = wide(x2):matmul(w:transpose()) -- x may be bf16, w is f32: matmul takes one dtype
      if self.act_dtype == "bf16" then y = y:to("bf16") end
    else
      local qx
      local gw = not no_backward and self:gemm(ctx, "wgrad")
      if gw and not plain(gw) and not g.a.sr and not ctx.recompute_input and self:_pairable(g.a, gw.b) then
        -- x's wgrad copy (along the tokens) from the same pass, kept for the backward instead of x
        qx, qx_col = self:_quantize_pair(g.a, gw.b, x2, true)
      else
        qx = self:_quantize(g.a, x2, 2, key_of(ctx, "x", "fprop"), true)
      end
      qw, qw_cached = self:_quantize(g.b, w, 2, key_of(ctx, "w", "fprop"), nil, self:_fused(ctx, g.b, "fprop"))
      if self.hook and not M.replaying() then core.unscoped(self.hook, {ctx = ctx, role = "fprop", gemm = g, a = qx, b = qw}) end
      y = qgemm(qx, qw, g.out, self.act_dtype)
      -- keep the weight's quantization only when dgrad reuses it (2-D weights: it must); else the
      -- scope frees it with qx
      if not (transposable(g.b) and same_spec(g.b, self:spec(ctx, "dgrad", "w"))) then qw = nil end
    end
    if not M.replaying() then stats.count("fprop", g.label) end
    -- returned: qw outlives the scope (a cached qw is the weight cache's, freed by it); with x's
    -- column copy saved, x itself is not (a copy the share memo owns gets a handle of our own: the
    -- memo frees its handle when the share ends)
    if qx_col and memo then qx_col = qx_col:share() end
    local saved = {x = not qx_col and x2 or nil, K = x2:size(2), qx_col = qx_col, w = w, qw = qw,
      qw_cached = qw_cached, wspec = g.b, shape = shape}
    return reshape_like(y, shape, w:size(1)), saved
  end)
end

--- recipe:linear_backward(ctx, dy, saved, dw) -> dx
-- dy [T,N] f32 or bf16 (or [..., N]); dw [N,K] f32 is accumulated (+=), or nil to skip the wgrad
-- GEMM; dx [T,K] (the recipe's act_dtype) is a new tensor. SR draws in order: dgrad's operands,
-- then wgrad's.
function Recipe:linear_backward(ctx, dy, saved, dw)
  return core.scope(function()
    local dy2 = as2d(dy, "dy")
    local x, w = saved.x, saved.w
    if saved.mor then return reshape_like(self.mor:backward(self, ctx, dy2, x, w, dw), saved.shape, saved.K) end
    local qx_col = saved.qx_col -- x's wgrad copy, made with fprop's (then x was not kept)
    saved.qx_col = nil
    if qx_col then core.adopt(qx_col) end
    -- dY's dgrad and wgrad copies from one pass where their specs allow (SR draws in the same order:
    -- dgrad's dy, then wgrad's; so not when dgrad's weight copy draws in between)
    local gd, gw = self:gemm(ctx, "dgrad"), dw ~= nil and self:gemm(ctx, "wgrad")
    local qdy_row, qdy_col
    if gw and not plain(gd) and not plain(gw) and not gd.b.sr and self:_pairable(gd.a, gw.a) then
      qdy_row, qdy_col = self:_quantize_pair(gd.a, gw.a, dy2, true)
    end
    -- dgrad: dX[T,K] = dY[T,N] · W[N,K], both blocked along N. Its scope frees its copies and the
    -- fprop weight copy saved for it before wgrad quantizes.
    local dx = core.scope(function()
      local qw = saved.qw
      saved.qw = nil
      if qw and saved.qw_cached and qw:is_freed() then
        -- its cache closed, or dropped it (M.weight_cache_drop), before this backward: fprop's
        -- quantization re-made (cacheable: a function of w's values and the spec alone)
        qw = wcache and self:_quantize(saved.wspec, w, 2, key_of(ctx, "w", "fprop"), nil,
          self:_fused(ctx, saved.wspec, "fprop")) or nil
      end
      if qw and not saved.qw_cached then core.adopt(qw) end
      local g = gd
      local d
      if plain(g) then
        if self.hook then core.unscoped(self.hook, {ctx = ctx, role = "dgrad", gemm = g, a = dy2, b = w}) end
        d = wide(dy2):matmul(w)
        if self.act_dtype == "bf16" then d = d:to("bf16") end
      else
        local qdy = qdy_row or self:_quantize(g.a, dy2, 2, key_of(ctx, "dy", "dgrad"), true)
        local function weight_t()
          if qw and same_spec(g.b, saved.wspec) then
            return transposed(qw, w, g.b) -- the fprop weight, transposed: same values
          elseif g.b.block == "2d" then -- the tiles along K, transposed; they die before the GEMM
            return core.scope(function()
              return transposed(self:_quantize(g.b, w, 2, key_of(ctx, "w", "dgrad"), nil, self:_fused(ctx, g.b, "dgrad")), w,
                g.b)
            end)
          end
          return self:_quantize(g.b, w, 1, key_of(ctx, "w", "dgrad"), nil, self:_fused(ctx, g.b, "dgrad"))
        end
        local qwt
        if cacheable(g.b) then qwt = cached(w, "dgrad|" .. spec_key(g.b, 1), weight_t) -- once per step
        else qwt = weight_t() end
        if self.hook then core.unscoped(self.hook, {ctx = ctx, role = "dgrad", gemm = g, a = qdy, b = qwt}) end
        d = qgemm(qdy, qwt, g.out, self.act_dtype)
      end
      stats.count("dgrad", g.label)
      return d
    end)
    -- wgrad: dW[N,K] += dYᵀ · X, both blocked along T
    if dw ~= nil then
      core.scope(function()
        if plain(gw) then
          if self.hook then core.unscoped(self.hook, {ctx = ctx, role = "wgrad", gemm = gw, a = dy2, b = x}) end
          dw:add_(wide(dy2):transpose():matmul(wide(x)))
        else
          local qdy = qdy_col or self:_quantize(gw.a, dy2, 1, key_of(ctx, "dy", "wgrad"), true)
          local qx = qx_col or self:_quantize(gw.b, x, 1, key_of(ctx, "x", "wgrad"), true)
          if self.hook then core.unscoped(self.hook, {ctx = ctx, role = "wgrad", gemm = gw, a = qdy, b = qx}) end
          if gw.out == "f32" then
            quant.qmatmul(qdy, qx, {accumulate = dw}) -- dw += the product, no [N, K] temporary
          else
            dw:add_(qgemm(qdy, qx, gw.out, "f32"))
          end
        end
        stats.count("wgrad", gw.label)
      end)
    end
    return reshape_like(dx, saved.shape, saved.K)
  end)
end

--- recipe.LOSS_CHUNK_ELEMS: the LM head and loss run in chunks of this many logits (tokens x vocab)
-- by default (Llama:forward_backward's loss_chunk)
M.LOSS_CHUNK_ELEMS = 1 << 27

--- recipe:head_chunkable(ctx) -> can the linear of ctx (the LM head) run over chunks of the tokens
-- with the same result? Where its activation operands are plain bf16/f32 (row-wise: each token's
-- logits, loss and input gradient are its own; the weight gradient is summed chunk by chunk in
-- fp32, an fp32 reordering). A head quantized with a per-tensor amax, SR or the RHT over the tokens
-- would quantize differently per chunk.
function Recipe:head_chunkable(ctx)
  for _, role in ipairs(ROLES) do
    local g = self:gemm(ctx, role)
    for _, o in ipairs(role == "wgrad" and {g.a, g.b} or {g.a}) do
      if (o.format ~= "bf16" and o.format ~= "f32") or o.rht or o.sr then return false end
    end
  end
  return true
end

--- recipe:release(saved): free what linear_forward kept for a backward that will not run (eval).
function Recipe:release(saved)
  if not saved then return end
  if saved.qw and not saved.qw_cached then saved.qw:free() end
  if saved.qx_col then saved.qx_col:free() end
  saved.qw, saved.qx_col = nil, nil
end

--- recipe:trace(fn | nil): call fn{ctx, role, gemm, a, b} before each GEMM, with its operands as
-- they enter it (QTensors, or the f32 tensors of a plain f32 GEMM), valid only during the call.
-- fn runs outside the arena (nv.unscoped): what it makes of them is its own.
function Recipe:trace(fn) self.hook = fn end

-- ---- plan -------------------------------------------------------------------------------------

local function describe(s)
  local parts, ft = {s.format}, formats.traits[s.format]
  if ft.block2d then parts[#parts + 1] = s.block == "2d" and "16x16" or ft.layout
  elseif ft.scale == "e8m0" then parts[#parts + 1] = ft.layout .. (s.scale_rule == "floor" and " floor" or "")
  elseif ft.scale == "fp32" then parts[#parts + 1] = s.delayed and "delayed" or "tensor" end
  if ft.block2d and s.delayed then parts[#parts + 1] = "delayed" end
  if s.rht then parts[#parts + 1] = "rht" end
  if s.sr then parts[#parts + 1] = "sr" end
  return table.concat(parts, " ")
end

-- the number of transformer blocks of model (linears lin): opts.num_blocks, the model's, or one more
-- than the highest block index of its linears
local function num_blocks(model, lin, opts)
  local L = opts.num_blocks or model.num_blocks or (type(model.config) == "table" and model.config.num_hidden_layers)
  if L then return L end
  local top = -1
  for _, l in ipairs(lin) do if l.block and l.block > top then top = l.block end end
  return top + 1
end

--- recipe:plan(model [, {step = 0, num_blocks = L, out = io.stdout, quiet = false}]) -> rows
-- model:linears() -> {{name, block, high_precision, module}, ...}. One row per linear layer:
-- {name, block, high_precision, group, fprop = {x = spec, w = spec, out, label}, dgrad = {dy, w, ...},
-- wgrad = {dy, x, ...}}; group: recipe:weight_group (the module's context gives the linear's fused
-- group); printed as a table of every layer x its 3 GEMMs, then the totals.
function Recipe:plan(model, opts)
  opts = opts or {}
  if type(model) ~= "table" and type(model) ~= "userdata" or not model.linears then
    error("plan: expects a model with a linears() method", 2)
  end
  local lin = model:linears()
  local L = num_blocks(model, lin, opts)
  local step = opts.step or 0
  local rows, totals = {}, {fprop = {}, dgrad = {}, wgrad = {}}
  for _, l in ipairs(lin) do
    local m = l.module
    local ctx = {name = l.name, block = l.block, num_blocks = L, high_precision = l.high_precision or false, step = step,
      group = type(m) == "table" and m.context and m:context().group or nil}
    local row = {name = l.name, block = l.block, high_precision = l.high_precision or false, group = self:weight_group(ctx)}
    row.mor = self.mor and not row.high_precision and self.mor:describe() or nil -- chosen as it runs
    for _, role in ipairs(ROLES) do
      local g = self:gemm(ctx, role)
      local ops = OPERANDS[role]
      row[role] = {[ops[1]] = g.a, [ops[2]] = g.b, out = g.out, label = row.mor and "mor" or g.label}
      totals[role][row[role].label] = (totals[role][row[role].label] or 0) + 1
    end
    rows[#rows + 1] = row
  end
  rows.totals = totals
  if not opts.quiet then
    local out = opts.out or io.stdout
    local wname = 5
    for _, r in ipairs(rows) do wname = math.max(wname, #tostring(r.name)) end
    out:write(string.format("recipe %s at step %d: %d linear layers, %d blocks\n", tostring(self), step, #rows, L))
    local fmt = "%-" .. wname .. "s %5s  %-9s %-26s %-26s %s\n"
    if self.mor then
      out:write(string.format("operands marked mor: each chosen as it is quantized, %s\n", self.mor:describe()))
    end
    out:write(string.format(fmt, "layer", "block", "gemm", "operand 1", "operand 2", "out"))
    for _, r in ipairs(rows) do
      for i, role in ipairs(ROLES) do
        local g, ops = r[role], OPERANDS[role]
        local b = g[ops[2]]
        local adesc, bdesc = describe(g[ops[1]]), describe(b)
        if role == "dgrad" and transposable(b) and same_spec(b, r.fprop.w) then bdesc = bdesc .. " (fprop's, t)" end
        if r.mor then adesc, bdesc = "mor", "mor" end
        out:write(string.format(fmt, i == 1 and tostring(r.name) or "", i == 1 and (r.block and tostring(r.block) or "-") or "",
          role .. "(" .. REDUCES[role] .. ")", ops[1] .. " " .. adesc, ops[2] .. " " .. bdesc, g.out))
      end
    end
    for _, role in ipairs(ROLES) do
      local parts = {}
      for _, k in ipairs(sorted_keys(totals[role])) do parts[#parts + 1] = k .. " " .. totals[role][k] end
      out:write(string.format("%s: %s\n", role, table.concat(parts, ", ")))
    end
    local groups, parts = {}, 0
    for _, r in ipairs(rows) do
      if r.group then
        parts = parts + 1
        if not groups[r.group] then groups[#groups + 1], groups[r.group] = r.group, true end
      end
    end
    if parts > 0 then
      out:write(string.format("fused_amax: %d weights in %d groups scaled by their group's amax (%s%s)\n", parts, #groups,
        groups[1], #groups > 1 and ", ..." or ""))
    end
  end
  return rows
end

-- a plan row (recipe:plan) in words: {name, block, high_precision, fprop = {x =, w =, out =}, ...}
local function row_words(r)
  local w = {name = r.name, block = r.block, high_precision = r.high_precision, group = r.group}
  for _, role in ipairs(ROLES) do
    local g, ops = r[role], OPERANDS[role]
    local a, b = describe(g[ops[1]]), describe(g[ops[2]])
    if role == "dgrad" and transposable(g[ops[2]]) and same_spec(g[ops[2]], r.fprop.w) then b = b .. " (fprop's, t)" end
    if r.mor then a, b = "mor", "mor" end
    w[role] = {[ops[1]] = a, [ops[2]] = b, out = g.out}
  end
  return w
end

--- recipe:describe([{model =, step = 0}]) -> a plain table saying what the recipe is: {name, text
-- (tostring(recipe)), settings (its options), act_dtype, defined_at (recipe.custom: where its
-- function was defined)}. With a model, also its plan at step in words: layers = one row per linear
-- {name, block, high_precision, group, fprop = {x =, w =, out =}, dgrad = {dy =, w =, out =}, wgrad =
-- {dy =, x =, out =}} (group: recipe:weight_group, the fused group whose amax scales the weight,
-- "model.layers.3.self_attn.qkv_proj"; nil where the weight has its own), each operand as
-- recipe:plan prints it ("nvfp4 16x16", "e4m3 tensor", "bf16"; "mor" where MoR chooses as it runs),
-- and totals = {fprop = {[label] = linears}, ...} (the plan's labels: "nvfp4", "e4m3 x e5m2", "mor";
-- "?" for a linear running a recipe of another kind). A
-- linear whose module runs another recipe (one set on it after the model was built) is described by
-- that recipe, its row naming it (recipe = its text).
function Recipe:describe(o)
  o = o or {}
  local settings = {}
  for k, v in pairs(self.options) do settings[k] = v end
  local d = {name = self.name, text = tostring(self), settings = settings, act_dtype = self.act_dtype,
    defined_at = self.defined_at}
  local model = o.model
  if not model then return d end
  local step = o.step or 0
  local lin = model:linears()
  local L = num_blocks(model, lin, {})
  local rows = self:plan(model, {quiet = true, step = step, num_blocks = L})
  d.layers, d.totals, d.step = {}, {fprop = {}, dgrad = {}, wgrad = {}}, step
  for i, r in ipairs(rows) do
    local own = lin[i].module and lin[i].module.recipe
    local w, labels = nil, {}
    if own ~= nil and own ~= self then -- its own recipe: its plan, or (not a recipe value) its text alone
      r = M.is_recipe(own) and own:plan({linears = function() return {lin[i]} end},
        {quiet = true, step = step, num_blocks = L})[1] or nil
    end
    if r then
      w = row_words(r)
      for _, role in ipairs(ROLES) do labels[role] = r[role].label end
    else
      w = {name = lin[i].name, block = lin[i].block, high_precision = lin[i].high_precision or false}
    end
    if own ~= nil and own ~= self then w.recipe = tostring(own) end
    d.layers[i] = w
    for _, role in ipairs(ROLES) do
      local label = labels[role] or "?"
      d.totals[role][label] = (d.totals[role][label] or 0) + 1
    end
  end
  return d
end

-- ---- state ------------------------------------------------------------------------------------

--- recipe:generator() -> the nv.Generator the SR draws come from
function Recipe:generator() return self.gen end

--- recipe:state() -> plain table {recipe, seed, offset, histories = {[key] = {len, values, pos,
-- count, last}}}: what a checkpoint needs to resume with the same SR bits and scales.
function Recipe:state()
  local hs = {}
  for key, h in pairs(self.histories) do
    if h.dev then host_of_dev(h) end -- read back (the device copy is rebuilt at its next use)
    local v = {}
    for i = 1, h.h.count do v[i] = h.h.values[i] end
    hs[key] = {len = h.h.len, values = v, pos = h.h.pos, count = h.h.count, last = h.last}
  end
  return {recipe = self.name, seed = self.gen:seed(), offset = self.gen:offset(), histories = hs,
    mor = self.mor and self.mor:state() or nil}
end

-- amaxes are fp32 values; rounding what is loaded back to fp32 undoes a text round trip's last
-- digits (a JSON writer with >= 9 significant digits), so a resumed run scales bit for bit alike.
local function f32(v)
  if type(v) ~= "number" then return v end
  return (string.unpack("<f", string.pack("<f", v)))
end

local function int_field(t, k, who)
  local v = t[k]
  local i = type(v) == "number" and math.tointeger(v)
  if not i or i < 0 then error(string.format("%s: state field %s must be a non-negative integer, got %s", who, k, tostring(v)), 3) end
  return i
end

--- recipe:load_state(s): restore what state() returned (also after a JSON round trip).
function Recipe:load_state(s)
  local who = "recipe:load_state"
  if type(s) ~= "table" then error(who .. ": expects the table recipe:state() returned", 2) end
  local seed, offset = s.seed, int_field(s, "offset", who)
  seed = type(seed) == "number" and math.tointeger(seed)
  if not seed then error(who .. ": state field seed must be an integer", 2) end
  local hs = {}
  for key, r in pairs(s.histories or {}) do
    local len = int_field(r, "len", who)
    local h = quant.AmaxHistory(len)
    local count, pos = int_field(r, "count", who), int_field(r, "pos", who)
    for i = 1, count do h.values[i] = f32(r.values[i]) end
    h.count, h.pos = count, pos
    hs[key] = {h = h, last = f32(r.last)}
  end
  if self.mor then self.mor:load_state(s.mor) end
  self.gen:manual_seed(seed)
  self.gen:set_offset(offset)
  for _, h in pairs(self.histories) do if h.dev then h.dev.buf:free() end end
  for _, r in pairs(self.rounds) do if r.device then r.amax:free() end end
  self.histories, self.rounds = hs, {}
end

Recipe.__tostring = function(r)
  local parts = {}
  for _, k in ipairs(sorted_keys(r.options)) do
    local v = r.options[k]
    if type(v) == "table" then
      local f = {}
      for _, kk in ipairs(sorted_keys(v)) do f[#f + 1] = kk .. "=" .. tostring(v[kk]) end
      v = "{" .. table.concat(f, ",") .. "}"
    end
    parts[#parts + 1] = k .. "=" .. tostring(v)
  end
  return r.name .. (#parts > 0 and ("(" .. table.concat(parts, ", ") .. ")") or "")
end

-- ---- presets ----------------------------------------------------------------------------------

-- act: the opts.act_dtype given (nil: the preset's default, act_default); shown in the recipe's
-- description only when it is not the default.
local function new(name, options, fn, seed, history, act, act_default)
  local r = setmetatable({name = name, options = options, fn = fn, gen = core.Generator(seed or 1234),
    history_len = history or 1024, histories = {}, rounds = {}, act_default = act_default or "bf16"}, Recipe)
  r:set_act_dtype(act or r.act_default)
  return r
end

local ACT_DTYPES = {bf16 = true, f32 = true}
local is_act = one_of("bf16", "f32")

--- recipe:set_act_dtype("bf16" | "f32") -> recipe: the dtype of the activations and activation
-- gradients its layers pass (NUMERICS §11). Set it before a step, not between a forward and its
-- backward.
function Recipe:set_act_dtype(dt)
  if not ACT_DTYPES[dt] then
    user_error(string.format("recipe %s: act_dtype must be 'bf16' or 'f32', got %s", self.name,
      type(dt) == "string" and "'" .. dt .. "'" or tostring(dt)), 2)
  end
  self.act_dtype = dt
  self.options.act_dtype = dt ~= self.act_default and dt or nil
  return self
end

-- Low-precision presets share two rules: modules marked high_precision (the LM head) are bf16,
-- and switch_at = {step = N, forward_only = b} moves fprop (or every GEMM) to bf16 from step N.
local function low_precision(name, sw, base)
  return function(c)
    if c.high_precision then return BF16 end
    if sw then
      if c.step == nil then error(string.format("recipe %s: switch_at needs ctx.step (layer '%s')", name, tostring(c.name)), 0) end
      if c.step >= sw.step and (c.role == "fprop" or not sw.forward_only) then return BF16 end
    end
    return base(c)
  end
end

--- recipe.f32([{act_dtype = "f32"}]): everything f32 (gradient checks, the PyTorch golden test).
function M.f32(opts)
  opts = check_opts(opts, {act_dtype = is_act}, "recipe.f32")
  return new("f32", {}, function() return F32 end, nil, nil, opts.act_dtype, "f32")
end

--- recipe.bf16([{act_dtype = "bf16"}]): every operand rounded to bf16, fp32 accumulation, bf16
-- fprop/dgrad outputs.
function M.bf16(opts)
  opts = check_opts(opts, {act_dtype = is_act}, "recipe.bf16")
  return new("bf16", {}, function() return BF16 end, nil, nil, opts.act_dtype)
end

-- fp8: format "hybrid" (e4m3 for x and w, e5m2 for dy; the default) or "e4m3" everywhere.
local function fp8(name, opts, delayed)
  local valid = {format = one_of("hybrid", "e4m3"), switch_at = is_switch, act_dtype = is_act, fused_amax = is_bool}
  if delayed then valid.history = is_pos end
  opts = check_opts(opts, valid, "recipe." .. name)
  local grad = (opts.format or "hybrid") == "hybrid" and "e5m2" or "e4m3"
  local fwd, bwd = {format = "e4m3", delayed = delayed}, {format = grad, delayed = delayed}
  local base = function(c) return c.operand == "dy" and bwd or fwd end
  local shown = {format = opts.format or "hybrid", switch_at = opts.switch_at, fused_amax = opts.fused_amax or nil}
  if delayed then shown.history = opts.history or 1024 end
  local r = new(name, shown, low_precision(name, opts.switch_at, base), nil, opts.history, opts.act_dtype)
  r.fused_amax = opts.fused_amax == true
  return r
end

--- recipe.fp8_cs({format = "hybrid"|"e4m3", switch_at, fused_amax = false}): per-tensor current
-- scaling. fused_amax: the weights of each fused group (q/k/v, gate/up: nn.fuse) are scaled by the
-- group's amax, as one fused weight would be (see "fused groups" above; recipe:weight_group).
function M.fp8_cs(opts) return fp8("fp8_cs", opts, false) end

--- recipe.fp8_delayed({history = 1024, format, switch_at, fused_amax = false}): per-tensor delayed
-- scaling. Each (layer, operand, role) has an nv.AmaxHistory; a quantization uses the max of the
-- history (a zero one keeps the previous amax) and then pushes the tensor's own amax. While a
-- history has no usable amax yet (the first step) the quantization uses current scaling.
-- fused_amax: each fused group's weights share one history (key "<group>|w|fprop"), pushed once
-- per forward with the group's amax.
function M.fp8_delayed(opts) return fp8("fp8_delayed", opts, true) end

--- recipe.mxfp8({scale_rule = "rceil"|"floor", format = "e4m3"|"hybrid", switch_at}): 1x32
-- blocks with e8m0 scales along each GEMM's reduction dim; e4m3 everywhere by default.
function M.mxfp8(opts)
  opts = check_opts(opts, {scale_rule = one_of("rceil", "floor"), format = one_of("e4m3", "hybrid"),
    switch_at = is_switch, act_dtype = is_act}, "recipe.mxfp8")
  local rule = opts.scale_rule or "rceil"
  local fwd = {format = "mxfp8_e4m3", scale_rule = rule}
  local bwd = (opts.format or "e4m3") == "hybrid" and {format = "mxfp8_e5m2", scale_rule = rule} or fwd
  local base = function(c) return c.operand == "dy" and bwd or fwd end
  local shown = {scale_rule = rule, format = opts.format or "e4m3", switch_at = opts.switch_at}
  return new("mxfp8", shown, low_precision("mxfp8", opts.switch_at, base), nil, nil, opts.act_dtype)
end

-- The 4-bit recipes (NUMERICS §6) for format fmt ("nvfp4" or "mxfp4"): fprop x and w RNE, dgrad
-- dy SR, wgrad dy and x along T with the RHT, SR on dy; the linears of the first bf16_first and
-- last bf16_last blocks in bf16. w2d (16x16 weight tiles) where the format offers them; scale_rule
-- where its scales are e8m0.
local function fp4(name, fmt, opts)
  local ft = formats.get(fmt, "recipe." .. name)
  local valid = {rht = is_bool, sr = is_bool, bf16_first = is_count, bf16_last = is_count, seed = is_int,
    switch_at = is_switch, act_dtype = is_act}
  if ft.block2d then valid.w2d = is_bool end
  if ft.scale == "e8m0" then valid.scale_rule = one_of("rceil", "floor") end
  if ft.global_amax then valid.fused_amax = is_bool end
  opts = check_opts(opts, valid, "recipe." .. name)
  local rht, sr, w2d = opts.rht ~= false, opts.sr ~= false, ft.block2d and opts.w2d ~= false
  local rule = ft.scale == "e8m0" and (opts.scale_rule or "rceil") or nil
  local function spec(t)
    t.format, t.scale_rule = fmt, rule
    return t
  end
  local W = spec({block = ft.block2d and (w2d and "2d" or "1d") or nil})
  local X = spec({})
  local DY = spec({sr = sr})
  local XT = spec({rht = rht})
  local DYT = spec({rht = rht, sr = sr})
  local base = function(c)
    if c.block ~= nil then
      local L = c.num_blocks
      local first = opts.bf16_first or (L and 2 * L // 32)
      local last = opts.bf16_last or (L and 8 * L // 32)
      if first == nil or last == nil or (last > 0 and L == nil) then
        error(string.format("recipe %s: layer '%s' needs ctx.num_blocks for its bf16_first/bf16_last rule", name,
          tostring(c.name)), 0)
      end
      if c.block < first or (last > 0 and c.block >= L - last) then return BF16 end
    end
    if c.operand == "w" then return W end
    if c.role == "wgrad" then return c.operand == "dy" and DYT or XT end
    return c.operand == "dy" and DY or X
  end
  local shown = {rht = rht, sr = sr, w2d = ft.block2d and w2d or nil, scale_rule = rule, seed = opts.seed or 1234,
    bf16_first = opts.bf16_first or "floor(2L/32)", bf16_last = opts.bf16_last or "floor(8L/32)", switch_at = opts.switch_at,
    fused_amax = opts.fused_amax or nil}
  local r = new(name, shown, low_precision(name, opts.switch_at, base), opts.seed, nil, opts.act_dtype)
  r.fused_amax = opts.fused_amax == true
  return r
end

--- recipe.nvfp4({rht = true, sr = true, w2d = true, bf16_first, bf16_last, seed = 1234, switch_at,
-- fused_amax = false}): the paper's recipe (NUMERICS §6). fprop: x 1x16 RNE, w 16x16 RNE; dgrad: dy
-- 1x16 SR, w the fprop tiles transposed; wgrad: dy and x 1x16 along T with the RHT, SR on dy.
-- fused_amax: the weights of each fused group (q/k/v, gate/up: nn.fuse) take the group's global
-- amax, one weight_scale_2 per group as engines load them (see "fused groups" above).
-- High-precision blocks: the linears of the first bf16_first and the last bf16_last transformer
-- blocks run in bf16. Defaults for a model of L blocks scale the paper's 2 and 8 of 32 with depth:
-- bf16_first = floor(2L/32), bf16_last = floor(8L/32) (L = 32: 2 and 8; L = 16: 1 and 4; L = 4:
-- 0 and 1; L < 4: none). Linears outside the blocks (block = nil) follow the rest of the recipe.
function M.nvfp4(opts) return fp4("nvfp4", "nvfp4", opts) end

--- recipe.mxfp4({rht = true, sr = true, scale_rule = "rceil"|"floor", bf16_first, bf16_last, seed, switch_at}):
-- the same recipe in MXFP4 (e2m1 elements, 1x32 blocks, e8m0 scales; OCP Microscaling), the
-- paper's comparison format: every operand 1x32 along its GEMM's reduction dim (no 2-D weight
-- blocks: dgrad re-quantizes W along its other axis), the same RHT, SR and high-precision blocks.
function M.mxfp4(opts) return fp4("mxfp4", "mxfp4", opts) end

--- recipe.custom(fn [, {seed = 1234, history = 1024, switch_at, act_dtype = "f32"}]): fn(ctx) -> spec per operand,
-- ctx = {name, block, num_blocks, high_precision, step, role, operand}; a spec is a format name
-- or {format, block, rht, sr, scale_rule, delayed}. fn has full control: it sees
-- ctx.high_precision and decides what the LM head gets. switch_at, if given, applies on top.
function M.custom(fn, opts)
  if type(fn) ~= "function" then error("recipe.custom: expects a function(ctx) -> spec, got " .. type(fn), 2) end
  opts = check_opts(opts, {seed = is_int, history = is_pos, switch_at = is_switch, act_dtype = is_act}, "recipe.custom")
  local sw = opts.switch_at
  local f = fn
  if sw then
    f = function(c)
      if c.step == nil then error(string.format("recipe custom: switch_at needs ctx.step (layer '%s')", tostring(c.name)), 0) end
      if c.step >= sw.step and (c.role == "fprop" or not sw.forward_only) then return BF16 end
      return fn(c)
    end
  end
  local r = new("custom", {seed = opts.seed or 1234, switch_at = sw}, f, opts.seed, opts.history, opts.act_dtype, "f32")
  r.defined_at = util.defined_at(fn) -- where its choices are made: recipe:describe() says it
  return r
end

--- recipe.mor({granularity = "tensor"|"block", block = 128, candidates = {"e4m3"}, threshold, every = 1,
-- decide, sr = true, w2d = true, scale = "pow2"|"gam", group = "tensor"|<blocks>, seed = 1234, act_dtype}): MoR (nvlua.mor, NUMERICS §12). Every
-- GEMM operand of every linear but the high-precision ones (the LM head: bf16) is quantized to
-- each candidate format in turn as it enters its GEMM; the relative L2 error ||Q(x) - x|| / ||x||
-- of each is measured per tensor, or per 1 x block elements along the GEMM's reduction dim
-- (granularity "block"), and decide (default: the first candidate whose error <= its threshold)
-- picks the representation; bf16 is the fallback. threshold: a number for every candidate or
-- {format = number} (defaults: mor.DEFAULT_THRESHOLD). every = N reuses a tensor's choice for N
-- steps (granularity "tensor"; the choices are recipe state). candidates = {"nvfp4", "e4m3"} is
-- the tiered variant (NVFP4, then FP8, then BF16); sr: SR on nvfp4/mxfp4 dY; w2d: 16x16 nvfp4
-- weight tiles. decide(d) gets {errs, thresholds, formats, granularity, ctx} (nvlua.mor). scale =
-- "gam" (granularity "block", candidates e4m3 / e5m2): the paper's group amax mantissa scaling, one
-- fp32 mantissa per group (group: "tensor" or a number of blocks) and one exponent per block.
function M.mor(opts)
  opts = opts or {}
  if type(opts) ~= "table" then user_error("recipe.mor: options must be a table, got " .. type(opts), 2) end
  local mo, seed, act = {}, opts.seed, opts.act_dtype
  for k, v in pairs(opts) do if k ~= "seed" and k ~= "act_dtype" then mo[k] = v end end
  if seed ~= nil and math.type(seed) ~= "integer" then user_error("recipe.mor: seed must be an integer", 2) end
  local m = mor.new(mo)
  local shown = {granularity = m.granularity, block = m.granularity == "block" and m.block or nil,
    candidates = table.concat(m.candidates, ">"), every = m.every > 1 and m.every or nil, seed = seed or 1234,
    decide = m.custom_decide and "custom" or nil, scale = m.scale ~= "pow2" and m.scale or nil,
    group = m.scale == "gam" and tostring(m.group) or nil}
  local th = {}
  for i, f in ipairs(m.candidates) do th[i] = f .. ":" .. m.threshold[i] end
  shown.threshold = table.concat(th, ",")
  local r = new("mor", shown, function() return BF16 end, seed, nil, act)
  r.mor = m
  return r
end

-- ---- registry ---------------------------------------------------------------------------------

-- Recipes by name, for configs (train.build's recipe=<name>). A constructor takes the settings an
-- experiment's config gives every recipe, any of them nil: seed, switch_at ({step, forward_only}),
-- rht, sr, w2d, bf16_first, bf16_last, act_dtype, fused_amax; it uses those that apply to it
-- (recipe.make sets a given act_dtype on what a constructor returns, and refuses fused_amax = true
-- where the recipe it returns does not scale fused groups by one amax).
local registry, registered = {}, {}

--- recipe.register(name, ctor): recipe.make(name, settings) (and recipe=<name> in a config) then
-- builds ctor(settings), which returns a recipe value (a preset or recipe.custom). Registering a
-- name again replaces its constructor.
function M.register(name, ctor)
  if type(name) ~= "string" or name == "" then
    error("recipe.register: name must be a non-empty string, got " .. tostring(name), 2)
  end
  if type(ctor) ~= "function" then
    error(string.format("recipe.register: '%s' needs a constructor function(settings) -> recipe, got %s", name, type(ctor)), 2)
  end
  if not registry[name] then registered[#registered + 1] = name end
  registry[name] = ctor
end

--- recipe.names() -> the registered names, in registration order (the presets first)
function M.names() return {table.unpack(registered)} end

--- recipe.make(name [, settings]) -> a new recipe from the constructor registered under name
function M.make(name, settings)
  local ctor = registry[name]
  if not ctor then
    user_error(string.format("recipe.make: unknown recipe '%s' (valid: %s)%s", tostring(name), table.concat(registered, ", "),
      util.suggest(name, registered)), 2)
  end
  settings = settings or {}
  local r = ctor(settings)
  if not M.is_recipe(r) then
    error(string.format("recipe.make: the constructor of '%s' returned %s, not a recipe", name, type(r)), 2)
  end
  if settings.act_dtype ~= nil then r:set_act_dtype(settings.act_dtype) end
  if settings.fused_amax and not r.fused_amax then
    user_error(string.format("recipe %s: fused_amax does not apply (it is for recipes whose weights have a per-tensor " ..
      "amax: nvfp4, fp8_cs, fp8_delayed)", name), 2)
  end
  return r
end

M.register("f32", function() return M.f32() end)
M.register("bf16", function() return M.bf16() end)
M.register("fp8_cs", function(s) return M.fp8_cs({switch_at = s.switch_at, fused_amax = s.fused_amax}) end)
M.register("fp8_delayed", function(s) return M.fp8_delayed({switch_at = s.switch_at, fused_amax = s.fused_amax}) end)
M.register("mxfp8", function(s) return M.mxfp8({switch_at = s.switch_at}) end)
M.register("nvfp4", function(s)
  return M.nvfp4({rht = s.rht, sr = s.sr, w2d = s.w2d, seed = s.seed, bf16_first = s.bf16_first, bf16_last = s.bf16_last,
    switch_at = s.switch_at, fused_amax = s.fused_amax})
end)
M.register("mxfp4", function(s) -- w2d does not apply: MX blocks are 1x32
  return M.mxfp4({rht = s.rht, sr = s.sr, seed = s.seed, bf16_first = s.bf16_first, bf16_last = s.bf16_last,
    switch_at = s.switch_at})
end)

-- MoR from a config: seed, and sr / w2d for an nvfp4 candidate; the settings of fixed tables
-- (switch_at, bf16_first, bf16_last) do not apply and are refused rather than ignored (rht, which
-- every config carries, is not used: MoR's candidates take no RHT).
local function mor_from(name, o)
  return function(s)
    for _, k in ipairs({"switch_at", "bf16_first", "bf16_last"}) do
      if s[k] ~= nil then
        user_error(string.format("recipe %s: %s does not apply (MoR chooses each operand's format as it runs)", name,
          k == "switch_at" and "switch_step" or k), 0)
      end
    end
    local t = {seed = s.seed, sr = s.sr, w2d = s.w2d}
    for k, v in pairs(o) do t[k] = v end
    return M.mor(t)
  end
end
M.register("mor", mor_from("mor", {}))
M.register("mor_block", mor_from("mor_block", {granularity = "block"}))
M.register("mor_nvfp4", mor_from("mor_nvfp4", {candidates = {"nvfp4", "e4m3"}}))
-- MoR as published (arXiv 2512.22804, issue 34): per 1x128 block, e4m3 then e5m2 then bf16, GAM scaling
-- with one group per operand (NUMERICS §12, GAM)
M.register("mor_paper", mor_from("mor_paper", {granularity = "block", candidates = {"e4m3", "e5m2"}, scale = "gam"}))

M.formats = formats.names
M.Recipe = Recipe

--- recipe.is_recipe(v) -> true for recipe values
function M.is_recipe(v) return getmetatable(v) == Recipe end

return M
