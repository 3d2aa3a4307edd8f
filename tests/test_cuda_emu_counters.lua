-- test_cuda_emu_counters.lua: the CUDA emulator's traffic counters (issue 16's measurement side):
-- per-kernel global-memory bytes read and written (unique bytes per launch, 4 KiB pages clipped to
-- each allocation: exact for kernels that stream whole allocations), per-GEMM FLOPs and operand
-- bytes, memcpy bytes by direction, the reset; and a smoke run of scripts/roofline.lua. Expected
-- values come from the kernels' definitions. Skips outside the emulation build (-DNVLUA_CUDA=EMU).
local T = require "nvlua.test"
local nv = require "nvlua"
local core = nv.core

local function need_emu()
  T.need_emu()
  if not core.cuda_emu_counters().bytes_counted then T.skip("the emulator counts bytes on x86-64 only") end
end

-- The counters spent by fn() alone (reset first).
local function spent(fn)
  core.cuda_emu_reset_counters()
  fn()
  return core.cuda_emu_counters()
end

local function only_kernel(c, name)
  local n = 0
  for _ in pairs(c.kernels) do n = n + 1 end
  T.eq(n, 1, "one kernel launched")
  local k = c.kernels[name]
  T.ok(k ~= nil, "kernel " .. name .. " counted")
  T.eq(k.launches, 1, name .. ": launches")
  return k
end

T.case("emulator counters: core.cuda_emu_reset_counters outside the emulation build raises", function()
  if core.cuda_emulated() then T.skip("the emulation build has the counters") end
  T.raises(core.cuda_emu_reset_counters, "does not emulate CUDA")
end)

T.case("emulator bytes: axpy, fill, copy and cast read and write what their definitions say", function()
  need_emu()
  core.cuda_set_sync(false)
  local n = 4096 * 3 -- f32: 48 KiB, a whole number of pages and of the allocator's 512-byte rounding
  local x, y = nv.randn(n):cuda(), nv.randn(n):cuda()
  -- y += a x: reads x and y (8n bytes), writes y (4n)
  local k = only_kernel(spent(function() y:add_(x, 0.5) end), "axpy_kernel")
  T.eq(k.bytes_read, 8 * n, "axpy bytes read")
  T.eq(k.bytes_written, 4 * n, "axpy bytes written")
  -- y = 2: writes 4n, reads nothing
  k = only_kernel(spent(function() y:fill_(2) end), "fill_kernel<unsigned int>")
  T.eq(k.bytes_read, 0, "fill bytes read")
  T.eq(k.bytes_written, 4 * n, "fill bytes written")
  -- a transpose made contiguous: through 32x32 tiles (coalesced reads and writes), reads the n f32
  -- once, writes n f32; a permutation that keeps the last dim is the plain strided copy
  local m = nv.randn(96, 128):cuda()
  local c = spent(function() m:t():contiguous():free() end)
  k = only_kernel(c, "transpose_kernel<unsigned int, unsigned int>")
  T.eq(k.bytes_read, 4 * 96 * 128, "transpose bytes read")
  T.eq(k.bytes_written, 4 * 96 * 128, "transpose bytes written")
  T.eq(c.memcpy_d2d_bytes, 0, "no device copy besides the kernel")
  local m3 = nv.randn(8, 16, 32):cuda()
  k = only_kernel(spent(function() m3:transpose(1, 2):contiguous():free() end), "copy_strided_kernel<unsigned int, unsigned int>")
  T.eq({k.bytes_read, k.bytes_written}, {4 * 8 * 16 * 32, 4 * 8 * 16 * 32}, "a batch permutation: bytes read, written")
  -- f32 -> bf16 of a transposed view (a wgrad operand's copy): read 4 bytes, write 2 per element
  k = only_kernel(spent(function() m:t():to("bf16"):free() end), "transpose_kernel<short unsigned int, float>")
  T.eq({k.bytes_read, k.bytes_written}, {4 * 96 * 128, 2 * 96 * 128}, "transposed cast: bytes read, written")
  -- a dense copy: one device-to-device memcpy of the bytes, no kernel
  c = spent(function() m:clone():free() end)
  T.eq(c.memcpy_d2d_bytes, 4 * 96 * 128, "a dense clone is one device copy")
  T.eq(next(c.kernels), nil, "a dense clone launches no kernel")
  -- f32 -> bf16 (dense): reads 4 bytes, writes 2 per element, no index arithmetic
  k = only_kernel(spent(function() m:to("bf16"):free() end), "cast_dense_kernel<short unsigned int, float>")
  T.eq(k.bytes_read, 4 * 96 * 128, "cast bytes read")
  T.eq(k.bytes_written, 2 * 96 * 128, "cast bytes written")
  -- a small tensor: its 512-byte allocation (the caching allocator's rounding) is what a page clips to
  local s = nv.randn(100):cuda()
  k = only_kernel(spent(function() s:fill_(1) end), "fill_kernel<unsigned int>")
  T.eq(k.bytes_written, 512, "a 400-byte tensor in a 512-byte allocation: bytes written")
  core.cuda_synchronize()
end)

T.case("emulator counters: copies by direction, GEMM FLOPs 2MNK and operand bytes, reset", function()
  need_emu()
  core.cuda_set_sync(false)
  local h = nv.randn(1000)
  local d
  local c = spent(function() d = h:cuda() end)
  T.eq(c.memcpy_h2d, 1, "one host->device copy")
  T.eq(c.memcpy_h2d_bytes, 4000, "host->device bytes")
  c = spent(function() d:cpu() end)
  T.eq(c.memcpy_d2h_bytes, 4000, "device->host bytes")
  local qa = core.quantize(nv.randn(64, 128):cuda(), "bf16")
  local qb = core.quantize(nv.randn(96, 128):cuda(), "bf16")
  nv.qmatmul(qa, qb):free() -- plan it first
  c = spent(function() nv.qmatmul(qa, qb):free() end)
  T.eq(c.gemms, 1, "one cuBLASLt matmul")
  T.eq(c.gemm_flops, 2 * 64 * 96 * 128, "FLOPs 2 M N K")
  T.eq(#c.gemm_shapes, 1, "one GEMM shape")
  local g = c.gemm_shapes[1]
  T.eq({g.a, g.b, g.calls, g.k, g.m * g.n, g.flops}, {"bf16", "bf16", 1, 128, 64 * 96, 2 * 64 * 96 * 128}, "the shape")
  T.eq(g.bytes_a + g.bytes_b, (64 + 96) * 128 * 2, "bf16 operands read: (M + N) K x 2 bytes")
  local out_bytes = g.d == "f32" and 4 or 2
  T.eq(g.bytes_d, 64 * 96 * out_bytes, "D written: M N x its element size (" .. g.d .. ")")
  T.eq(g.bytes_c, 0, "beta 0: C not read")
  core.cuda_emu_reset_counters()
  c = core.cuda_emu_counters()
  for _, name in ipairs({"launches", "host_syncs", "gemms", "gemm_flops", "memcpy_h2d_bytes", "memcpy_d2h_bytes"}) do
    T.eq(c[name], 0, "after reset: " .. name)
  end
  T.eq(next(c.kernels), nil, "after reset: no kernels")
  T.eq(#c.gemm_shapes, 0, "after reset: no GEMM shapes")
end)

T.case("scripts/roofline.lua: a smoke run prints the estimate with every recipe", function()
  need_emu()
  local dir = T.tmpdir()
  local out = dir .. "/est.md"
  local exe = arg[-1] or "nvlua"
  local f = assert(io.popen(string.format("%s scripts/roofline.lua sizes=1 steps=2 out=%s 2>%s/err", exe, out, dir)))
  local text = f:read("a")
  local _, _, code = f:close()
  T.eq(code, 0, "exit status; output:\n" .. text .. assert(io.open(dir .. "/err")):read("a"))
  T.ok(text:find("ESTIMATE from emulation counters, not a measurement", 1, true) ~= nil, "labelled an estimate")
  for _, r in ipairs({"bf16", "fp8_cs", "nvfp4", "mxfp8"}) do
    T.ok(text:find("| nvlua " .. r .. " (estimate) | ", 1, true) ~= nil, "summary row of " .. r)
    T.ok(text:find("\n### " .. r .. "\n", 1, true) ~= nil, "table of " .. r)
  end
  T.ok(text:find("torchtitan anchor", 1, true) and text:find("744 TFLOP/s", 1, true), "the anchors")
  local w = assert(io.open(out)):read("a")
  T.eq(w, text, "the file holds what was printed")
  T.rm_tree(dir)
end)

-- The small Llama of the issue-16 cases below (sequences up to 32 tokens).
local function tiny_cfg(layers)
  return {vocab_size = 64, hidden_size = 64, intermediate_size = 128, num_hidden_layers = layers,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32}
end

-- Issue 16: nothing in a steady-state step waits for the host. A training step as train.lua runs it
-- (sync mode off; host token ids and targets, uploaded through pinned staging; the loss left on
-- the device; the trainer's clip, the norm not read) makes no host synchronisation at all; reading
-- the loss afterwards is one. fp8 and nvfp4 amaxes stay on the device; mxfp8's emulated GEMMs on
-- sm_90 (the emulator's default device) decide their operands' scaling on the device (gemm.cu
-- decide), and its q_proj dgrad, whose dY has all-zero blocks (the first token's query gradient),
-- takes neither a sync nor the fallback. No bf16 GEMM meets a subnormal (what tensor cores may flush).
T.case("a training step makes no host synchronisation (bf16, fp8_cs, fp8 e4m3, fp8_delayed, nvfp4, mxfp8 on sm_90; 1 and 2 blocks)", function()
  need_emu()
  local llama = require "nvlua.llama"
  local optim = require "nvlua.optim"
  local recipe = require "nvlua.recipe"
  local function step_syncs(rname, layers)
    local cfg = tiny_cfg(layers)
    local rec = rname == "nvfp4" and recipe.nvfp4({bf16_first = 0, bf16_last = 0}) or
      rname == "e4m3" and recipe.fp8_cs({format = "e4m3"}) or recipe[rname]()
    local model = llama.Llama(cfg, {seed = 1, recipe = rec}):to("cuda")
    local opt = optim.AdamW(model:named_parameters(), {lr = 1e-3})
    local gen = nv.Generator(5)
    local syncs, read
    T.with(core.cuda_set_sync, false, function()
      for step = 1, 2 do
        local x = (nv.rand(1, 32, {generator = gen}) * 63):to("i64")
        local y = (nv.rand(1, 32, {generator = gen}) * 63):to("i64")
        local s0 = core.cuda_emu_counters().host_syncs
        local d = model:forward_backward(x, y, {defer_loss = true})
        opt:clip_grad_norm(1.0)
        opt:step()
        model:zero_grad()
        local s1 = core.cuda_emu_counters().host_syncs
        local loss = llama.loss_value(d)
        T.ok(loss > 3 and loss < 5, rname .. ": a loss near ln 64 = 4.16 at init, got " .. loss)
        syncs, read = s1 - s0, core.cuda_emu_counters().host_syncs - s1
      end
    end)
    return syncs, read
  end
  for _, r in ipairs({"bf16", "fp8_cs", "e4m3", "fp8_delayed", "nvfp4", "mxfp8"}) do
    for _, layers in ipairs({1, 2}) do
      local before = core.cuda_emu_counters()
      local syncs, read = step_syncs(r, layers)
      T.eq(syncs, 0, r .. ", " .. layers .. " block(s): host syncs in the step")
      T.eq(read, 1, r .. ", " .. layers .. " block(s): reading the loss afterwards")
      local after = core.cuda_emu_counters()
      T.eq(after.gemm_subnormals - before.gemm_subnormals, 0, r .. ", " .. layers .. " block(s): subnormals met by bf16 GEMMs")
      if r == "mxfp8" then
        local k, k0 = after.kernels["fallback_gemm_kernel"], before.kernels["fallback_gemm_kernel"]
        T.ok(k and k.launches > (k0 and k0.launches or 0), "mxfp8: the emulated GEMMs ran (sm_90)")
      end
    end
  end
end)

-- TE's dataflow: x's fprop and wgrad copies, and dY's dgrad and wgrad copies, each from one fused
-- pass (quant_pair_kernel) where their specs are the same quantization; the same bits as quantizing
-- each copy on its own, fewer passes over the activations.
T.case("fused row + column quantization of x and dY in the recipe: same gradients, fewer kernels and bytes", function()
  need_emu()
  local llama = require "nvlua.llama"
  local recipe = require "nvlua.recipe"
  local cfg = tiny_cfg(1)
  local makers = {fp8_cs = recipe.fp8_cs, mxfp8 = recipe.mxfp8,
    nvfp4 = function() return recipe.nvfp4({bf16_first = 0, bf16_last = 0}) end, -- wgrad's copies add the RHT
    ["nvfp4 rht=false"] = function() return recipe.nvfp4({rht = false, bf16_first = 0, bf16_last = 0}) end}
  for name, make in pairs(makers) do
    local function run(paired)
      local m = llama.Llama(cfg, {seed = 2, recipe = make()}):to("cuda")
      local g = nv.Generator(3)
      local x = (nv.rand(1, 32, {generator = g}) * 63):to("i64")
      local y = (nv.rand(1, 32, {generator = g}) * 63):to("i64")
      local p0 = recipe.Recipe._pairable
      if not paired then recipe.Recipe._pairable = function() return false end end
      core.cuda_emu_reset_counters()
      local ok, err = pcall(m.forward_backward, m, x, y)
      local c = core.cuda_emu_counters()
      recipe.Recipe._pairable = p0
      if not ok then error(err, 0) end
      local grads = {}
      for _, e in ipairs(m:named_parameters()) do grads[e.name] = e.grad:cpu() end
      local pairs_n, bytes = 0, 0
      for kname, k in pairs(c.kernels) do
        if kname:find("quant_pair_kernel", 1, true) then pairs_n = pairs_n + k.launches end
        if kname:find("quant") or kname:find("amax") then bytes = bytes + k.bytes_read + k.bytes_written end
      end
      return grads, pairs_n, c.launches, bytes
    end
    local g1, p1, l1, b1 = run(true)
    local g0, p0, l0, b0 = run(false)
    T.ok(p1 > 0 and p0 == 0, name .. ": the pair kernel runs only when paired (" .. p1 .. " launches)")
    T.ok(l1 < l0, name .. ": fewer launches (" .. l1 .. " vs " .. l0 .. ")")
    if core.cuda_emu_counters().bytes_counted then -- (counted on x86-64 only)
      T.ok(b1 < b0, name .. ": fewer quantization bytes (" .. b1 .. " vs " .. b0 .. ")")
    end
    for pname, gr in pairs(g0) do T.eq(g1[pname]:bytes(), gr:bytes(), name .. ": grad " .. pname .. " bit for bit") end
  end
end)

-- Delayed scaling with the history on the device: the same amaxes and codes as the CPU's host
-- history step by step (first step current scaling, a zero tensor keeps the previous amax, the
-- window rolls over), no host synchronisation, and state() / load_state() round trips.
T.case("fp8_delayed on cuda: the amax history on the device = the host's, bit for bit, no host sync; state round trip", function()
  need_emu()
  local recipe = require "nvlua.recipe"
  local specs = {{format = "e4m3", delayed = true}, {format = "nvfp4", delayed = true, rht = true}}
  local function run(rc, rg, steps, seed)
    local g = nv.Generator(seed)
    T.with(core.cuda_set_sync, false, function()
      for step = 1, steps do
        local x = nv.randn(32, 64, {generator = g}) * (step == 3 and 0 or step)
        local xd = x:cuda()
        for _, sp in ipairs(specs) do
          for _, axis in ipairs({1, 2}) do
            local key = sp.format .. axis
            local qc = rc:_quantize(sp, x, axis, key, true)
            local s0 = core.cuda_emu_counters().host_syncs
            local qg = rg:_quantize(sp, xd, axis, key, true)
            T.eq(core.cuda_emu_counters().host_syncs - s0, 0, key .. " step " .. step .. ": no host sync")
            T.eq(qg.amax, qc.amax, key .. " step " .. step .. ": amax")
            T.eq(qg:codes():bytes(), qc:codes():bytes(), key .. " step " .. step .. ": codes")
          end
        end
      end
    end)
  end
  local rc, rg = recipe.fp8_delayed({history = 3}), recipe.fp8_delayed({history = 3})
  run(rc, rg, 6, 1)
  local sc, sg = rc:state(), rg:state()
  T.eq(sg.histories, sc.histories, "state(): the device histories read back = the host's")
  -- resumed recipes continue alike (the device one rebuilds its history on the device)
  local rc2, rg2 = recipe.fp8_delayed({history = 3}), recipe.fp8_delayed({history = 3})
  rc2:load_state(sc)
  rg2:load_state(sg)
  run(rc2, rg2, 3, 2)
  T.raises(function() core.amax_history_step(nv.zeros(4):cuda(), 4, 0, nv.zeros(1):cuda()) end, "count 4 must be in")
end)

-- TE's fused amax: RMSNorm and SwiGLU on bf16 activations give max |out| from the pass that writes
-- out; the next linear's per-tensor quantization takes it (recipe.note_amax) instead of an amax pass.
T.case("RMSNorm and SwiGLU give their output's amax (= the quantizer's, bit for bit); the recipe uses it: same gradients, fewer passes", function()
  need_emu()
  local recipe = require "nvlua.recipe"
  local llama = require "nvlua.llama"
  local g = nv.Generator(21)
  local x = (nv.randn(48, 96, {generator = g}) * 3):to("bf16")
  local xs = x:totable() -- a NaN and extremes: ignored / counted as the quantizer does
  xs[3][5], xs[7][1] = 0 / 0, -60000
  x = nv.tensor(xs):to("bf16")
  local w = nv.randn(96, {generator = g})
  local gate, up = (nv.randn(40, 64, {generator = g}) * 4):to("bf16"), nv.randn(40, 64, {generator = g}):to("bf16")
  for _, dev in ipairs({"cuda", "cpu"}) do -- fused on cuda; a pass of its own on the cpu
    local xd, wd, gd, ud = x:to(dev), w:to(dev), gate:to(dev), up:to(dev)
    local out, _, amax = core.rmsnorm_forward(xd, wd, 1e-5, true)
    local plain = core.rmsnorm_forward(xd, wd, 1e-5)
    T.eq(out:cpu():bytes(), plain:cpu():bytes(), dev .. ": RMSNorm output unchanged")
    T.eq(amax:cpu():bytes(), core.quant_amax(out):cpu():bytes(), dev .. ": RMSNorm amax = the quantizer's")
    local h, ha = core.swiglu_forward(gd, ud, true)
    T.eq(h:cpu():bytes(), core.swiglu_forward(gd, ud):cpu():bytes(), dev .. ": SwiGLU output unchanged")
    T.eq(ha:cpu():bytes(), core.quant_amax(h):cpu():bytes(), dev .. ": SwiGLU amax = the quantizer's")
  end
  local cfg = tiny_cfg(1)
  for _, rname in ipairs({"fp8_cs", "nvfp4"}) do
    local function run(hinted)
      local m = llama.Llama(cfg, {seed = 2, recipe = rname == "nvfp4" and recipe.nvfp4({bf16_first = 0, bf16_last = 0})
        or recipe[rname]()}):to("cuda")
      local gen = nv.Generator(3)
      local ids = (nv.rand(1, 32, {generator = gen}) * 63):to("i64")
      local y = (nv.rand(1, 32, {generator = gen}) * 63):to("i64")
      local n0 = recipe.note_amax
      if not hinted then recipe.note_amax = function(_, a) a:free() end end
      core.cuda_emu_reset_counters()
      local ok, err = pcall(m.forward_backward, m, ids, y)
      local c = core.cuda_emu_counters()
      recipe.note_amax = n0
      if not ok then error(err, 0) end
      local grads = {}
      for _, e in ipairs(m:named_parameters()) do grads[e.name] = e.grad:cpu() end
      local amaxes = 0
      for kname, k in pairs(c.kernels) do if kname:find("^amax_kernel") then amaxes = amaxes + k.launches end end
      return grads, amaxes
    end
    local g1, a1 = run(true)
    local g0, a0 = run(false)
    T.ok(a1 < a0, rname .. ": fewer amax passes (" .. a1 .. " vs " .. a0 .. ")")
    for pname, gr in pairs(g0) do T.eq(g1[pname]:bytes(), gr:bytes(), rname .. ": grad " .. pname .. " bit for bit") end
  end
end)
