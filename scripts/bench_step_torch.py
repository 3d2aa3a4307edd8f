#!/usr/bin/env python3
"""PyTorch on the CPU, the training step of scripts/bench_step.lua: the same ~10M-parameter Llama
(transformers' LlamaForCausalLM: hidden 384, 6 layers, 6/2 heads, SwiGLU 1024, vocab 256, RoPE,
RMSNorm, untied head, SDPA attention) and the same step: forward, cross-entropy, backward, gradient
clipping at 1.0, AdamW, zero_grad. Three modes: eager fp32, torch.compile fp32, and eager with bf16
autocast (bf16 GEMMs and attention on the CPU's bf16 units, fp32 master weights).

Run by `nvlua scripts/bench_step.lua torch=true` in the same invocation (ratios measured in one run on
a shared machine); alone it prints the same lines:
    python3 scripts/bench_step_torch.py [--batch 8] [--seq 128] [--steps 5] [--modes eager,compile,autocast]
Output: one line per mode, `torch MODE MS` (median step milliseconds) or `torch MODE FAILED reason`,
after a header line `torch_info ...`. Needs torch and transformers (a tool, never nvlua's dependency).
"""
import argparse
import os
import statistics
import sys
import time


def build(torch, transformers, seq):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=seq,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                   attention_bias=False, mlp_bias=False)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.float32)
    model.train()
    return model


def run_mode(torch, transformers, mode, batch, seq, steps):
    model = build(torch, transformers, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(5)

    def loss_of(x, y):
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, 256), y.view(-1))

    fwd = torch.compile(loss_of) if mode == "compile" else loss_of
    times = []
    for i in range(steps + (3 if mode == "compile" else 1)):  # warm-up steps (compile: recompiles settle)
        x = torch.randint(0, 256, (batch, seq), generator=gen)
        y = torch.randint(0, 256, (batch, seq), generator=gen)
        t0 = time.perf_counter()
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fwd(x, y)
        else:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if not torch.isfinite(loss):
            raise RuntimeError("loss is not finite")
        times.append(dt)
    return statistics.median(times[-steps:]) * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: os.cpu_count())")
    ap.add_argument("--modes", default="eager,compile,autocast")
    a = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print("torch_info FAILED %s (pip install torch transformers)" % e)
        return 77
    torch.set_num_threads(a.threads or os.cpu_count())
    print("torch_info torch %s, transformers %s, %d threads, bf16 units: %s" % (
        torch.__version__, transformers.__version__, torch.get_num_threads(),
        getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()))
    sys.stdout.flush()
    for mode in a.modes.split(","):
        if mode not in ("eager", "compile", "autocast"):
            print("torch %s FAILED unknown mode (eager, compile, autocast)" % mode)
            continue
        try:
            ms = run_mode(torch, transformers, mode, a.batch, a.seq, a.steps)
            print("torch %s %.1f" % (mode, ms))
        except Exception as e:  # a mode that cannot run here (torch.compile without a compiler) is reported
            print("torch %s FAILED %s" % (mode, str(e).splitlines()[0][:160] if str(e) else type(e).__name__))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
