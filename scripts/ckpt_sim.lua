-- scripts/ckpt_sim.lua: what checkpointing costs a long run, fixed intervals against ckpt_every=auto
-- (the Young/Daly interval sqrt(2 C MTBF), train.auto_interval), by simulation: failures arrive as a
-- Poisson process in wall-clock time (exponential gaps of mean MTBF, seeded); a failure loses the work
-- since the last completed save and costs a restart; each save blocks training for C seconds.
-- Reported per interval: wall time over the pure compute time, split into saving, lost work and
-- restarts (means over `trials` simulated runs).
--   nvlua scripts/ckpt_sim.lua [run=<dir>] [days=30] [trials=200] [restart=600] [seed=1]
-- Without run=, the two Llama 3 8B cases of the README's scaling estimate (assumptions below); with
-- run=<dir>, a measured run: the save cost and step time its ckpt_every=auto records logged
-- (metrics.jsonl), and mtbf=<hours> (default 24).
--
-- Assumptions of the 8B cases (on paper: nothing here ran on a GPU):
--   step: the README's estimate, 9.49 s of compute per 64k-token step per GPU plus the all-reduce
--         (0.16 s on 8 GPUs, 1.40 s on 64);
--   save: fp32 weights 32.1 GB + AdamW moments 64.2 GB = 96.3 GB written at 2 GB/s per node to shared
--         storage: 48 s from one node (8 GPUs), 6 s from 8 nodes (64 GPUs, each writing its ZeRO-1 shard);
--   failures: Llama 3's report, 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per
--         50,700 GPU-hours: a job MTBF of 6,340 h on 8 GPUs and 792 h on 64;
--   restart: 10 minutes (requeue, load the checkpoint, warm up).
local train = require "nvlua.train"
local config = require "nvlua.config"
local cjson = require "cjson"

local opts = config.schema({
  run = config.str("", {doc = "a run directory whose metrics.jsonl has ckpt_every=auto records (empty: the 8B cases)"}),
  days = config.int(30, {min = 1, doc = "days of compute simulated"}),
  trials = config.int(200, {min = 1, doc = "simulated runs per interval"}),
  restart = config.int(600, {min = 0, doc = "seconds a restart after a failure costs"}),
  seed = config.int(1, {doc = "seed of the failure times"}),
  mtbf = config.num(24, {above = 0, doc = "hours between failures of the job (with run=)"}),
}):parse(arg)

-- a deterministic uniform generator in (0, 1) (an LCG)
local function rng(seed)
  local s = seed
  return function()
    s = (s * 6364136223846793005 + 1442695040888963407) & 0x7FFFFFFFFFFFFFFF
    return ((s >> 11) + 0.5) / 2 ^ 52
  end
end

-- one run of W seconds of work, saving every tau seconds of work: -> wall, saving, lost, restart
local function simulate(W, tau, C, M, R, u)
  local done, wall, saving, lost, restarts = 0, 0, 0, 0, 0
  local fail = -M * math.log(u()) -- time to the next failure
  while done < W do
    local chunk = math.min(tau, W - done)
    local need = chunk + (done + chunk < W and C or 0) -- the last chunk ends the run: no save
    if fail >= need then
      done, wall, fail = done + chunk, wall + need, fail - need
      if done < W then saving = saving + C end
    else
      wall, lost = wall + fail + R, lost + math.min(fail, chunk)
      restarts = restarts + R
      fail = -M * math.log(u())
    end
  end
  return wall, saving, lost, restarts
end

local function case(name, step_s, C, M_h)
  local W, M, R = opts.days * 86400, M_h * 3600, opts.restart
  local auto = train.auto_interval(C, step_s, M_h)
  print(string.format("\n%s: step %.2f s, save %.1f s, MTBF %.0f h, restart %d s, %d days of compute, %d trials", name,
    step_s, C, M_h, R, opts.days, opts.trials))
  print("| interval | every | wall / compute | saving | lost work | restarts |")
  print("|---|---:|---:|---:|---:|---:|")
  local list = {}
  for _, n in ipairs({10, 100, 1000}) do list[#list + 1] = {string.format("fixed %d steps", n), n} end
  list[#list + 1] = {"auto (Young/Daly)", auto}
  for _, it in ipairs(list) do
    local u = rng(opts.seed)
    local tw, ts, tl, tr = 0, 0, 0, 0
    for _ = 1, opts.trials do
      local w, s, l, r = simulate(W, it[2] * step_s, C, M, R, u)
      tw, ts, tl, tr = tw + w, ts + s, tl + l, tr + r
    end
    local n = opts.trials * W
    print(string.format("| %s | %d steps (%.1f h) | %.4f | %.2f%% | %.2f%% | %.2f%% |", it[1], it[2], it[2] * step_s / 3600,
      tw / n, 100 * ts / n, 100 * tl / n, 100 * tr / n))
  end
end

if opts.run ~= "" then -- a measured run's save cost and step time (its last ckpt_every=auto record)
  local rec
  for line in io.lines(opts.run .. "/metrics.jsonl") do
    local ok, r = pcall(cjson.decode, line)
    if ok and type(r) == "table" and r.ckpt_cost_s then rec = r end
  end
  if not rec then error("ckpt_sim: " .. opts.run .. "/metrics.jsonl has no ckpt_every=auto record (ckpt_cost_s)", 0) end
  case("measured run " .. opts.run, rec.ckpt_step_s, rec.ckpt_cost_s, opts.mtbf)
else
  case("Llama 3 8B, 8 GPUs (one node)", 9.49 + 0.16, 96.3 / 2, 50700 / 8)
  case("Llama 3 8B, 64 GPUs (8 nodes)", 9.49 + 1.40, 96.3 / 16, 50700 / 64)
end
