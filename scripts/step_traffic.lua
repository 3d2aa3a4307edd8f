-- scripts/step_traffic.lua: the CUDA emulator's counters of one steady-state training step of a small
-- Llama, per recipe: host synchronisations, kernel launches, GEMMs, global-memory bytes, and the
-- kernels that move the most bytes (issue 29 part 5: the step's memory traffic and syncs). Counted
-- on the CPU emulation of CUDA (build with -DNVLUA_CUDA=EMU), not measured on a GPU.
--   build-emu/nvlua scripts/step_traffic.lua [recipes=bf16,fp8_cs,mxfp8,nvfp4] [hidden=128] [ffn=256]
--     [seq=128] [vocab=512] [layers=2] [top=12] [cc=90]
-- The step is the trainer's: forward_backward with the loss left on the device, clip_grad_norm (the
-- norm not read), AdamW, zero_grad; the counters of the last of 2 steps; reading the loss afterwards
-- is not counted. Exits 77 outside the emulation build.
local nv = require "nvlua"
local core = require "nvlua.core"
local llama = require "nvlua.llama"
local optim = require "nvlua.optim"
local recipe = require "nvlua.recipe"
local config = require "nvlua.config"

local cfg = config.schema({recipes = config.str("bf16,fp8_cs,mxfp8,nvfp4", {nonempty = true}),
  hidden = config.int(128, {min = 32}), ffn = config.int(256, {min = 32}), seq = config.int(128, {min = 16}),
  vocab = config.int(512, {min = 2}), layers = config.int(2, {min = 1}), top = config.int(12, {min = 0})}):parse(arg)

if not (core.cuda_emulated and core.cuda_emulated()) then
  io.stderr:write("step_traffic: needs the CUDA emulation build (-DNVLUA_CUDA=EMU)\n")
  os.exit(77)
end
core.cuda_set_sync(false)

local function measure(rname)
  local mcfg = {vocab_size = cfg.vocab, hidden_size = cfg.hidden, intermediate_size = cfg.ffn,
    num_hidden_layers = cfg.layers, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = cfg.seq}
  local rec = rname == "nvfp4" and recipe.nvfp4({bf16_first = 0, bf16_last = 0}) or recipe[rname]()
  local model = llama.Llama(mcfg, {seed = 1, recipe = rec}):to("cuda")
  local opt = optim.AdamW(model:named_parameters(), {lr = 1e-3})
  local gen = nv.Generator(5)
  local c, loss
  for step = 1, 2 do
    local x = (nv.rand(1, cfg.seq, {generator = gen}) * (cfg.vocab - 1)):to("i64")
    local y = (nv.rand(1, cfg.seq, {generator = gen}) * (cfg.vocab - 1)):to("i64")
    if step == 2 then core.cuda_emu_reset_counters() end
    loss = model:forward_backward(x, y, {defer_loss = true})
    opt:clip_grad_norm(1.0)
    opt:step()
    model:zero_grad()
    if step == 2 then c = core.cuda_emu_counters() end
    llama.loss_value(loss)
  end
  return c
end

print(string.format("one training step, emulated CUDA (counted, not measured): hidden %d, ffn %d, seq %d, vocab %d, %d blocks",
  cfg.hidden, cfg.ffn, cfg.seq, cfg.vocab, cfg.layers))
print("| recipe | host syncs | kernel launches | GEMMs | memsets | copies h2d/d2d | kernel bytes read | kernel bytes written | memcpy d2d bytes |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
local all = {}
for r in cfg.recipes:gmatch("[^,]+") do
  local c = measure(r)
  all[#all + 1] = {r, c}
  local rd, wr = 0, 0
  for _, k in pairs(c.kernels) do rd, wr = rd + k.bytes_read, wr + k.bytes_written end
  print(string.format("| %s | %d | %d | %d | %d | %d/%d | %d | %d | %d |", r, c.host_syncs, c.launches, c.gemms,
    c.memsets, c.memcpy_h2d, c.memcpy_d2d, rd, wr, c.memcpy_d2d_bytes))
end
for _, e in ipairs(all) do
  local r, c = e[1], e[2]
  local ks = {}
  for name, k in pairs(c.kernels) do ks[#ks + 1] = {name, k} end
  table.sort(ks, function(a, b)
    local x, y = a[2].bytes_read + a[2].bytes_written, b[2].bytes_read + b[2].bytes_written
    if x ~= y then return x > y end
    return a[1] < b[1]
  end)
  print(string.format("\n%s: kernels by bytes (read + written), top %d of %d", r, math.min(cfg.top, #ks), #ks))
  print("| kernel | launches | bytes read | bytes written |")
  print("|---|---:|---:|---:|")
  for i = 1, math.min(cfg.top, #ks) do
    local k = ks[i][2]
    print(string.format("| %s | %d | %d | %d |", ks[i][1], k.launches, k.bytes_read, k.bytes_written))
  end
end
