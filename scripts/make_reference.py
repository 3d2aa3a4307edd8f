#!/usr/bin/env python3
"""scripts/make_reference.py: golden state for tests/test_llama_golden.lua, made by PyTorch on the CPU.

Builds a tiny Llama with grouped-query attention in float32 — Hugging Face transformers'
LlamaForCausalLM when it is installed, else the plain-torch Llama below (the same computation,
written out; when transformers is there the two are also checked against each other) — and writes
tests/data/tiny_llama_ref.safetensors:

  <param name>            every parameter under its Hugging Face name (the weights nvlua loads)
  input_ids, targets      [2, 16] i64; targets = ids shifted left by one, the last a random id,
                          one set to -100 (ignore_index)
  logits                  [32, 64] f32, (B*T, V)
  loss                    [1] f32, F.cross_entropy(logits, targets, ignore_index=-100) (mean)
  grad.<param name>       d loss / d param
  adamw_losses            [5] f32: the loss before each of 5 AdamW steps (lr 1e-2, betas (0.9, 0.95),
                          eps 1e-8, weight decay 0.1, norms and embeddings in a weight_decay=0 group)
  final.<param name>      the parameters after the 5 steps
  __metadata__            config (JSON), implementation, init, AdamW settings, torch/transformers
                          versions

Weights: torch.manual_seed(0) then Hugging Face's init (normal(0, 0.02) for linear and embedding
weights); the RMSNorm weights, which that init sets to exactly 1, are drawn as 1 + 0.1*N(0, 1) so a
forward that skips the norm weight cannot pass.

The file is written in the safetensors layout by save_file_sorted below (byte-reproducible: the
safetensors package orders metadata keys at random) and, when the safetensors package is
installed, read back with it to prove the layout.

    pip install torch transformers safetensors     # CPU is enough (the CUDA wheel works too)
    python3 scripts/make_reference.py [--out tests/data/tiny_llama_ref.safetensors] [--plain]
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
B, T = 2, 16
STEPS = 5
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# ---- a plain-torch Llama (Hugging Face's computation and parameter names) -------------------------

class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):  # (..., C)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cos_sin(T, head_dim, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(T).float(), inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c["hidden_size"] // self.nh
        C = c["hidden_size"]
        self.q_proj = nn.Linear(C, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, C, bias=False)
        self.theta = c["rope_theta"]

    def forward(self, x):  # (B, T, C)
        Bn, Tn, _ = x.shape
        q = self.q_proj(x).view(Bn, Tn, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(Bn, Tn, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(Bn, Tn, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rope_cos_sin(Tn, self.hd, self.theta)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)  # query head h uses kv head h // rep
        v = v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)  # (B, nh, T, T)
        mask = torch.triu(torch.ones(Tn, Tn, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(Bn, Tn, self.nh * self.hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, H = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class PlainLlama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = Inner(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids):  # (B, T) -> (B, T, V)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


# ---- the reference run ------------------------------------------------------------------------------

def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    c = dict(CONFIG)
    cfg = LlamaConfig(**c, attention_bias=False, mlp_bias=False, hidden_act="silu", attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    return model, (lambda ids: model(input_ids=ids).logits)


def plain_model():
    model = PlainLlama(CONFIG)
    for name, p in model.named_parameters():
        if "norm" not in name:
            nn.init.normal_(p, mean=0.0, std=0.02)
    return model, model


DTYPE_ORDER = {torch.int64: ("I64", 5), torch.float32: ("F32", 4), torch.int32: ("I32", 3),
               torch.bfloat16: ("BF16", 2), torch.uint8: ("U8", 1)}


def save_file_sorted(tensors, path, metadata):
    """The safetensors layout exactly as the safetensors package writes it (tensors by dtype in
    decreasing alignment, then name; header padded with spaces to 8 bytes), except that the
    metadata keys are sorted, where the package leaves their order to a hash map: so the file is
    byte-for-byte reproducible."""
    import struct
    keys = sorted(tensors, key=lambda k: (-DTYPE_ORDER[tensors[k].dtype][1], k))
    header, blobs, off = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for k in keys:
        t = tensors[k].contiguous()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": DTYPE_ORDER[t.dtype][0], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def no_decay(name):
    return "norm" in name or "embed_tokens" in name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "tests", "data", "tiny_llama_ref.safetensors")))
    ap.add_argument("--plain", action="store_true", help="use the plain-torch Llama even if transformers is installed")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    use_hf = not args.plain
    versions = {"torch": torch.__version__}
    if use_hf:
        try:
            import transformers
            versions["transformers"] = transformers.__version__
        except ImportError:
            use_hf = False
            print("transformers is not installed: using the plain-torch Llama", file=sys.stderr)

    torch.manual_seed(0)
    model, fwd = hf_model() if use_hf else plain_model()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    model.train()

    V = CONFIG["vocab_size"]
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.cat([ids[:, 1:], torch.randint(0, V, (B, 1), generator=g)], dim=1)
    targets[1, 5] = -100

    def loss_of(logits):  # (B, T, V) -> mean cross-entropy over the non-ignored tokens
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)

    params = dict(model.named_parameters())
    out = {name: p.detach().clone().contiguous() for name, p in params.items()}
    out["input_ids"] = ids.clone()
    out["targets"] = targets.clone()

    logits = fwd(ids)
    loss = loss_of(logits)
    loss.backward()
    out["logits"] = logits.detach().reshape(B * T, V).clone()
    out["loss"] = loss.detach().reshape(1).clone()
    for name, p in params.items():
        out["grad." + name] = p.grad.detach().clone()

    if use_hf:  # the plain-torch Llama must compute the same thing from the same weights
        plain = PlainLlama(CONFIG)
        plain.load_state_dict({k: v for k, v in out.items() if k in params})
        pl = plain(ids)
        d = (pl - logits).abs().max().item()
        print(f"plain-torch Llama vs transformers: max |logits diff| = {d:.3g}")
        assert d <= 1e-5 * logits.abs().max().item() + 1e-6, "the plain-torch Llama disagrees with transformers"

    decay = [p for n, p in params.items() if not no_decay(n)]
    nodecay = [p for n, p in params.items() if no_decay(n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": ADAMW["weight_decay"]}, {"params": nodecay, "weight_decay": 0.0}],
        lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        l = loss_of(fwd(ids))
        l.backward()
        losses.append(l.item())
        opt.step()
    assert losses[0] == loss.item(), "step 1's loss is the reference loss"
    out["adamw_losses"] = torch.tensor(losses, dtype=torch.float32)
    for name, p in params.items():
        out["final." + name] = p.detach().clone()

    cfg = dict(CONFIG)
    meta = {
        "format": "pt",
        "config": json.dumps(cfg, sort_keys=True),
        "implementation": "transformers.LlamaForCausalLM (eager attention)" if use_hf else "plain-torch Llama (scripts/make_reference.py)",
        "init": "torch.manual_seed(0); HF init normal(0, 0.02); norm weights 1 + 0.1*randn (Generator seed 1)",
        "adamw": json.dumps({"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                             "weight_decay": ADAMW["weight_decay"], "no_decay": "norms and embed_tokens",
                             "steps": STEPS}),
        "torch_version": versions["torch"],
        "transformers_version": versions.get("transformers", "not used"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file_sorted(out, args.out, meta)
    try:  # the reference reader validates the file strictly and must give back every tensor
        from safetensors.torch import load_file
        back = load_file(args.out)
        assert set(back) == set(out) and all(torch.equal(back[k], out[k]) for k in out)
        print("safetensors (the reference implementation) reads the file back exactly")
    except ImportError:
        pass
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {len(out)} tensors, {size} bytes")
    print(f"loss {loss.item():.7f}; adamw losses {[round(x, 7) for x in losses]}")
    print(f"max |logit| {logits.abs().max().item():.4g}")
    assert size < 300 * 1024


if __name__ == "__main__":
    main()
