#!/usr/bin/env python3
"""bench_blocks_torch.py: the PyTorch side of scripts/bench_blocks.lua (issue 7's benchmark).

The same model as the nvlua side: an embedding of a 256-token vocabulary, N Llama 3 8B blocks
(hidden 4096, 32 query / 8 KV heads of 128, RoPE theta 500000 in the rotate-half layout, RMSNorm
eps 1e-5, SwiGLU 14336), a final RMSNorm and an untied LM head, cross-entropy over the tokens.
fp32 master weights, bf16 autocast for the GEMMs and attention
(torch.nn.functional.scaled_dot_product_attention, causal, GQA by repeating K/V heads), AdamW
(fused) and gradient clipping at 1.0: one training step as nvlua runs it. Timed eager and under
torch.compile, micro-batch 1, median of --steps after a warm-up (compile's warm-up compiles).

    python3 scripts/bench_blocks_torch.py [--layers 1,4] [--seq 8192] [--steps 3] [--device cuda]

Prints one machine-readable line per measurement for bench_blocks.lua:
    RESULT torch <eager|compile> <layers> <step ms> <peak bytes>
Not here: anything of nvlua (this script only needs torch).
"""
import argparse
import statistics
import time


def build(torch, layers, seq, device):
    nn, F = torch.nn, torch.nn.functional
    C, H, KV, D, FF, V = 4096, 32, 8, 128, 14336, 256

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight.to(x.dtype)

    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(device)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(device)

    def rope(x):  # (B, H, T, D), rotate-half (Hugging Face) layout
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(C), RMSNorm(C)
            self.q = nn.Linear(C, H * D, bias=False)
            self.k = nn.Linear(C, KV * D, bias=False)
            self.v = nn.Linear(C, KV * D, bias=False)
            self.o = nn.Linear(H * D, C, bias=False)
            self.gate = nn.Linear(C, FF, bias=False)
            self.up = nn.Linear(C, FF, bias=False)
            self.down = nn.Linear(FF, C, bias=False)

        def forward(self, x):
            B, T, _ = x.shape
            h = self.n1(x)
            q = rope(self.q(h).view(B, T, H, D).transpose(1, 2))
            k = rope(self.k(h).view(B, T, KV, D).transpose(1, 2))
            v = self.v(h).view(B, T, KV, D).transpose(1, 2)
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(B, T, H * D))
            h = self.n2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, C)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.norm = RMSNorm(C)
            self.head = nn.Linear(C, V, bias=False)

        def forward(self, ids, targets):
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    m = Model().to(device)
    for p in m.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    return m


def bench(torch, layers, seq, steps, mode, device):
    torch.manual_seed(1)
    m = build(torch, layers, seq, device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    ids = torch.randint(0, 256, (1, seq + 1), device=device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step(model):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return loss

    model = torch.compile(m) if mode == "compile" else m
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step(model)  # warm-up (compile compiles here)
    step(model)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step(model)
        sync()
        times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss).item():
        raise SystemExit(f"bench_blocks_torch: non-finite loss ({mode}, {layers} blocks)")
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    del model, m, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times) * 1000, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="eager,compile")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_blocks_torch: no GPU visible to PyTorch")
    torch.backends.cuda.matmul.allow_tf32 = False
    for layers in [int(s) for s in a.layers.split(",")]:
        for mode in a.modes.split(","):
            ms, peak = bench(torch, layers, a.seq, a.steps, mode, a.device)
            print(f"RESULT torch {mode} {layers} {ms:.3f} {peak}", flush=True)


if __name__ == "__main__":
    main()
