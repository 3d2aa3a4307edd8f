#!/usr/bin/env python3
"""bench_cuda_torch.py: the PyTorch side of scripts/bench_cuda.lua (issue 6's benchmark).

Times, on the same GPU and shapes as the nvlua benchmark: a device-to-device copy, torch.matmul
in bf16, and torch._scaled_mm in fp8 (e4m3 x e4m3, per-tensor scales, bf16 output) for the Llama 3
8B GEMM shapes (M = 8192 tokens). CUDA events around back-to-back calls, the median of several
repetitions, after a warm-up; random inputs (never zeros).

    python3 scripts/bench_cuda_torch.py [--m 8192] [--iters 20] [--reps 5]

Prints a table, then one machine-readable line per measurement for bench_cuda.lua:
    RESULT <name> <N> <K> <ms> <TFLOP/s or GB/s>
Not here: anything of nvlua (this script only needs torch).
"""
import argparse
import statistics
import sys

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def bench(torch, fn, iters, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / iters)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_cuda_torch: PyTorch is not installed", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("bench_cuda_torch: no GPU", file=sys.stderr)
        return 77
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results = []

    # copy bandwidth (bytes read + written), 8192 x 8192 bf16 = 128 MiB
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = bench(torch, lambda: x.clone(), args.iters, args.reps)
    results.append(("copy_bf16", 8192, 8192, ms, 2 * x.numel() * 2 / ms / 1e6))
    del x

    M = args.m
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for N, K in SHAPES:
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * M * N * K
        ms = bench(torch, lambda: torch.matmul(a, b.t()), args.iters, args.reps)
        results.append(("matmul_bf16", N, K, ms, flops / ms / 1e9))
        if fp8 is not None and hasattr(torch, "_scaled_mm"):
            a8, b8 = a.to(fp8), b.to(fp8)
            one = torch.tensor(1.0, device=dev)
            try:
                ms = bench(torch, lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16), args.iters, args.reps)
                results.append(("scaled_mm_fp8", N, K, ms, flops / ms / 1e9))
            except RuntimeError as e:  # no fp8 GEMM on this GPU / build
                print(f"bench_cuda_torch: _scaled_mm unavailable: {e}", file=sys.stderr)
            del a8, b8
        del a, b
        torch.cuda.empty_cache()

    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name(0)}, M = {M}")
    print(f"{'op':<16} {'N':>6} {'K':>6} {'ms':>9} {'TFLOP/s | GB/s':>15}")
    for name, n, k, ms, rate in results:
        print(f"{name:<16} {n:>6} {k:>6} {ms:>9.4f} {rate:>15.1f}")
    for name, n, k, ms, rate in results:
        print(f"RESULT {name} {n} {k} {ms:.6f} {rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
