#!/usr/bin/env python3
"""bench_attention_torch.py: the PyTorch side of scripts/bench_attention.lua (issue 29's attention benchmark).

The same problem as the nvlua side: causal grouped-query attention, bf16 q (B, Hq, T, D), k and v (B, Hkv, T, D)
(torch's layout; nvlua's is (B, T, H, D), which cuDNN reads through strides either way), scale 1/sqrt(D), through
torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True): PyTorch's own choice of
backend, then the cuDNN and the flash backends forced with torch.nn.attention.sdpa_kernel. Forward and backward
(of the output with a fixed gradient) timed apart with CUDA events, median of three rounds of --iters // 3 calls
after a warm-up.

    python3 scripts/bench_attention_torch.py [--batch 1] [--seq 8192] [--heads 32] [--kv-heads 8] [--head-dim 128]

Prints one machine-readable line per backend for bench_attention.lua:
    RESULT torch <backend> <forward ms> <backward ms>      (or n/a n/a, then a line "NA <backend> <why>")
Not here: anything of nvlua (this script only needs torch).
"""
import argparse
import contextlib
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # no torch: say so in the table
        for name in ("default", "cudnn", "flash"):
            print(f"RESULT torch {name} n/a n/a\nNA {name} PyTorch not importable: {e}")
        return
    if not torch.cuda.is_available():
        for name in ("default", "cudnn", "flash"):
            print(f"RESULT torch {name} n/a n/a\nNA {name} torch.cuda is not available")
        return
    torch.manual_seed(1)
    B, T, Hq, Hkv, D = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    dev = "cuda"
    q = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16)
    n = max(1, a.iters // 3)

    def timed(fn):
        rounds = []
        for _ in range(3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            stop.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(stop) / n)
        return statistics.median(rounds)

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D ** -0.5, enable_gqa=True)

    for name, backends in (("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("flash", [SDPBackend.FLASH_ATTENTION])):
        try:
            ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
            with ctx:
                out = attend()  # warm-up
                out.backward(dout)
                torch.cuda.synchronize()
                with torch.no_grad():
                    fwd = timed(attend)
                out = attend()

                def backward():
                    q.grad = k.grad = v.grad = None
                    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                bwd = timed(backward)
            print(f"RESULT torch {name} {fwd:.4f} {bwd:.4f}", flush=True)
        except Exception as e:  # a backend this build or GPU does not have
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"RESULT torch {name} n/a n/a\nNA {name} {why}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
