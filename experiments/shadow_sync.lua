-- experiments/shadow_sync.lua: synchronization in the background (ShadowSync, Zheng et al. 2020) against
-- synchronous data parallelism, on CPU ranks started with mpirun: the comparison's model (4 blocks,
-- hidden 256, KJV bytes) trained `steps` steps of `batch` sequences per rank under each of
--   allreduce        the gradients averaged every step (the default),
--   shadow k=1       each rank steps on its own gradients; the parameters averaged in the background
--                    every step (applied at the next one),
--   shadow k=4       the same every 4 steps,
--   shadow k=4 +m    and the AdamW moments averaged with the parameters (shadow_moments=true),
-- on 2 and 4 ranks (equal tokens per variant). The averaging's all-reduce runs in a thread of its own
-- (MPI_THREAD_MULTIPLE, dist.all_reduce_bg), started after one step and completed at the next
-- averaging. Reported: the final validation loss, the step time, the time the step spends on
-- synchronization (sync_ms in metrics.jsonl: the gradient all-reduce's wait, or for shadow the
-- snapshot copy, the wait and applying the average) and of it the time blocked waiting on the other
-- ranks' communication (sync_wait_ms), means over steps 2..; the share is the waiting's.
-- On this machine the ranks share 2 cores (oversubscribed with 4), so the waits include the ranks'
-- scheduling; a GPU cluster's network is another matter. Writes <out>/results.md.
--   nvlua experiments/shadow_sync.lua [steps=100] [batch=4] [ranks=2,4] [out=runs/shadow_sync]
local cjson = require "cjson"
local util = require "nvlua.util"
local config = require "nvlua.config"

local o = config.schema({
  steps = config.int(100, {min = 1, doc = "training steps of every run"}),
  batch = config.int(4, {min = 1, doc = "sequences per rank per step"}),
  ranks = config.str("2,4", {doc = "the world sizes compared", check = function(v)
    if not v:match("^%d+[%d,]*$") then return "must list rank counts separated by commas, such as 2,4" end
  end}),
  out = config.str("runs/shadow_sync", {nonempty = true, doc = "the runs' directories and results.md go here"}),
}):parse(arg)

local function sh(cmd)
  local p = assert(io.popen(cmd .. " 2>&1; echo \"exit=$?\""))
  local out = p:read("a")
  p:close()
  return out, tonumber(out:match("exit=(%d+)%s*$"))
end

local mpirun = (sh("command -v mpirun")):match("^(%S+)")
if not mpirun or mpirun:match("^exit=") then error("shadow_sync: mpirun not found (Debian openmpi-bin)", 0) end
local nvlua = arg[-1]
local i = -1
while arg[i - 1] do i = i - 1 end
nvlua = arg[i]

local VARIANTS = {
  {"allreduce", {"sync=allreduce"}},
  {"shadow k=1", {"sync=shadow", "shadow_every=1"}},
  {"shadow k=4", {"sync=shadow", "shadow_every=4"}},
  {"shadow k=4 +m", {"sync=shadow", "shadow_every=4", "shadow_moments=true"}},
}

local lines = {
  string.format("%s, %d steps of %d x 128 tokens per rank, the comparison's model (3.3M parameters), bf16, CPU ranks " ..
    "(OMP_NUM_THREADS=1) on this machine's cores", os.date("!%Y-%m-%d"), o.steps, o.batch),
  "",
  "| ranks | sync | final val loss | step time | synchronization | of it waiting | waiting's share of the step |",
  "|---:|---|---:|---:|---:|---:|---:|",
}
for n in o.ranks:gmatch("%d+") do
  for _, v in ipairs(VARIANTS) do
    local dir = string.format("%s/r%s_%s", o.out, n, v[1]:gsub("[^%w]", "_"))
    local args = {"experiments/tiny_llama_nvfp4.lua", "dist=true", "recipe=bf16", "layers=4", "hidden=256", "heads=4",
      "kv_heads=2", "ffn=768", "steps=" .. o.steps, "batch=" .. o.batch, "warmup=10", "eval_every=" .. o.steps,
      "eval_batches=4", "log_every=" .. o.steps, "sample_tokens=0", "plot=false", "save=false", "quiet=true",
      "overwrite=true", "out=" .. dir, table.unpack(v[2])}
    io.write(string.format("%s ranks, %-13s ... ", n, v[1]))
    io.flush()
    local out, code = sh(string.format("env OMP_NUM_THREADS=1 %s --allow-run-as-root --oversubscribe --bind-to none " ..
      "-np %s %s %s", mpirun, n, nvlua, table.concat(args, " ")))
    if code ~= 0 then error("shadow_sync: the run failed:\n" .. out, 0) end
    local ms, sync, wait, val = {}, {}, {}, nil
    for line in io.lines(dir .. "/metrics.jsonl") do
      local r = cjson.decode(line)
      if r.loss and r.step > 1 then ms[#ms + 1], sync[#sync + 1], wait[#wait + 1] = r.ms, r.sync_ms, r.sync_wait_ms end
      if r.val_loss then val = r.val_loss end
    end
    local mms, msync, mwait = util.mean_sd(ms), util.mean_sd(sync), util.mean_sd(wait)
    print(string.format("val loss %.4f, step %.0f ms, sync %.1f ms, waiting %.1f ms", val, mms, msync, mwait))
    lines[#lines + 1] = string.format("| %s | %s | %.4f | %.0f ms | %.1f ms | %.1f ms | %.1f%% |", n, v[1], val, mms,
      msync, mwait, 100 * mwait / mms)
  end
end
print("")
for _, l in ipairs(lines) do print(l) end
local f = assert(io.open(o.out .. "/results.md", "w"))
f:write(table.concat(lines, "\n"), "\n")
f:close()
print("table: " .. o.out .. "/results.md")
