#!/usr/bin/env python3
"""gen_golden_formats.py: golden vectors for nvlua's number-format quantizers.

Writes tests/golden/formats.txt from an implementation that shares no code with nvlua: it is
written from the contract (core/NUMERICS.md) with numpy float32 arithmetic, and element
rounding (e4m3, e5m2, e2m1 round-to-nearest-even) is done by ml_dtypes' casts, an independent
oracle. tests/c/test_formats_ref.c (and the Lua tests) reproduce every case bit for bit.

Not here: anything nvlua computes. Do not "fix" a mismatch by copying nvlua's behaviour into
this file; find which side disagrees with core/NUMERICS.md.

Requires: numpy, ml_dtypes (pip install numpy ml_dtypes). Deterministic: fixed seeds only.
Usage:    python3 scripts/gen_golden_formats.py [out_path]   (default tests/golden/formats.txt)

Notes on the oracle:
- ml_dtypes casts overflow to NaN (e4m3fn) or inf (e5m2) instead of saturating, so values are
  clamped to +-max first, which is what "RNE, saturate (satfinite)" means for finite inputs.
- ml_dtypes has no ue4m3; the nvfp4 block scale is an e4m3fn cast of a non-negative value.
- The e8m0 scale rules are integer arithmetic on frexp of the fp32 value (exact in float64).
- Philox4x32-10 is implemented here with Python ints; it is checked against the published
  Random123 known-answer vectors (asserted below) before anything is generated.
- Every fp32 operation of the contract is done as one numpy float32 operation, so it is rounded
  once, as in C. The SR step fmaf(u, step, a) equals the float32 sum a + (u*step) because
  u*step (an 8-bit fraction times a power of two) is exact.
"""
import math
import os
import sys

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

# ---------------------------------------------------------------------------------------------
# Philox4x32-10 (Salmon et al., SC'11)

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    c = list(ctr)
    k0, k1 = key
    for _ in range(10):
        p0 = PHILOX_M0 * c[0]
        p1 = PHILOX_M1 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK32, p1 & MASK32,
             ((p0 >> 32) ^ c[3] ^ k1) & MASK32, p0 & MASK32]
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c


# Random123 known-answer tests (kat_vectors, philox4x32 R=10).
assert philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
assert philox4x32_10([MASK32] * 4, [MASK32, MASK32]) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
assert philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == \
    [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def sr_bytes(seed, offset, g):
    """The 16 random bytes of block g (NUMERICS §3): byte j = byte (j mod 4) of word (j div 4)."""
    key = [seed & MASK32, (seed >> 32) & MASK32]
    ctr = [g, offset & MASK32, (offset >> 32) & MASK32, 0]
    w = philox4x32_10(ctr, key)
    return [(w[j // 4] >> (8 * (j % 4))) & 0xFF for j in range(16)]


# ---------------------------------------------------------------------------------------------
# Element formats through ml_dtypes

E4M3_MAX, E5M2_MAX = F32(448.0), F32(57344.0)
# element format -> (ml_dtypes type, largest finite value, emax for the OCP floor rule)
ELEM = {"e4m3": (ml_dtypes.float8_e4m3fn, E4M3_MAX, 8), "e5m2": (ml_dtypes.float8_e5m2, E5M2_MAX, 15),
        "e2m1": (ml_dtypes.float4_e2m1fn, F32(6.0), 2)}


def fp8_encode(x, elem):
    """float32 array -> uint8 codes, RNE, satfinite (inputs here are never NaN)."""
    dt, mx, _ = ELEM[elem]
    x = np.asarray(x, dtype=F32)
    assert not np.isnan(x).any()
    return np.clip(x, -mx, mx).astype(dt).view(np.uint8)


def fp8_decode(c, elem):
    dt = ELEM[elem][0]
    return np.asarray(c, dtype=np.uint8).view(dt).astype(F32)


def e2m1_encode(x):
    x = np.asarray(x, dtype=F32)
    assert not np.isnan(x).any()
    return np.clip(x, F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=F32)


def e2m1_decode(c):
    return E2M1_VALUES[np.asarray(c, dtype=np.uint8)]


def e2m1_sr(x, r):
    """NUMERICS §3, one element, float32 throughout."""
    x = F32(x)
    u = F32(r) / F32(256)
    a = F32(abs(x))
    step = F32(2 if a >= 4 else (1 if a >= 2 else 0.5))
    t = a + u * step                      # = fmaf(u, step, a): u*step is exact
    step_t = F32(2 if t >= 4 else (1 if t >= 2 else 0.5))
    q = F32(6) if np.isinf(t) else min(F32(math.floor(t / step_t)) * step_t, F32(6))
    code = int(np.where(E2M1_VALUES[:8] == q)[0][0])
    return code | (8 if np.signbit(x) else 0)


def ue4m3_encode(v):
    v = F32(v)
    assert v >= 0
    return int(fp8_encode(np.array([v]), "e4m3")[0])


def e8m0_decode(c):
    return F32(np.array([c], dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(F32)[0])


# ---------------------------------------------------------------------------------------------
# RHT (NUMERICS §5)

RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=F32)


def to_bf16(x):
    """Round fp32 values to bf16 (round to nearest even) and back to fp32."""
    return np.asarray(x, dtype=F32).astype(ml_dtypes.bfloat16).astype(F32)


def rht_rows_bf16(x):
    """The RHT of a bf16 operand as TransformerEngine's wgrad path computes it (its reference quantizer:
    the 16-chunks times diag(s) H / 4 as a bf16 matrix product, fp32 accumulation, a bf16 result):
    here the exact product (float64 sums of 16 terms, checked exact in fp32) rounded once to bf16.
    NUMERICS §5 gets the same bits from its fp32 butterfly followed by the rounding; both are computed
    and must agree, and where PyTorch is installed its CPU bf16 matmul (what TE's reference runs) too."""
    assert np.array_equal(to_bf16(x), x), "rht_rows_bf16 takes bf16 values"
    rows, K = x.shape
    H = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], dtype=np.float64)
    R = np.diag(RHT_SIGNS.astype(np.float64)) @ H / 4
    exact = x.reshape(rows, K // 16, 16).astype(np.float64) @ R
    assert np.array_equal(exact.astype(F32).astype(np.float64), exact), "a sum not exact in fp32: pick other data"
    te = to_bf16(exact.astype(F32)).reshape(rows, K)
    butterfly = to_bf16(rht_rows(x))
    assert np.array_equal(te, butterfly), "TE's order and the contract's butterfly disagree"
    try:
        import torch
    except ImportError:
        print("rht_rows_bf16: PyTorch not installed; its bf16 matmul cross-check skipped")
    else:
        xt = torch.from_numpy(x.reshape(-1, 16)).to(torch.bfloat16)
        Rt = torch.from_numpy(R.astype(F32)).to(torch.bfloat16)
        tv = (xt @ Rt).to(torch.float32).numpy().reshape(rows, K)
        assert np.array_equal(tv, te), "PyTorch's bf16 matmul disagrees on %d of %d values" % (
            int((tv != te).sum()), te.size)
    return te


def rht_rows(x):
    """Apply the 16-point RHT to every 16-chunk along the last axis, in the contract's order."""
    rows, K = x.shape
    y = (x.reshape(rows, K // 16, 16) * RHT_SIGNS).astype(F32)
    for h in (1, 2, 4, 8):
        for j in range(16):
            if j % (2 * h) < h:
                a, b = y[..., j].copy(), y[..., j + h].copy()
                y[..., j], y[..., j + h] = a + b, a - b
    y = y * F32(0.25)
    # Cross-check against the matrix definition x . diag(s) H / 4 (float64, loose tolerance).
    H = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], dtype=np.float64)
    R = np.diag(RHT_SIGNS.astype(np.float64)) @ H / 4
    ref = x.reshape(rows, K // 16, 16).astype(np.float64) @ R
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(x).max() + 1e-30)
    return y.reshape(rows, K).astype(F32)


# ---------------------------------------------------------------------------------------------
# Quantizers

def amax_of(x):
    return F32(np.abs(x).max()) if x.size else F32(0)


def nvfp4_global(amax):
    """(s_enc, s_dec) of NUMERICS §2."""
    amax = F32(amax)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(2688) / amax
    s_enc = min(s_enc, FLT_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = F32(1)
    return s_enc, F32(1) / s_enc


def nvfp4_decode_scale(amax):
    """Decode s_dec = amax / 2688 (NUMERICS §2), unless the encoder fell back / clamped."""
    amax = F32(amax)
    with np.errstate(divide="ignore", over="ignore"):
        if np.isfinite(amax) and amax > 0 and F32(2688) / amax <= FLT_MAX:
            return amax / F32(2688)
    return nvfp4_global(amax)[1]


def nvfp4_quantize(x, two_d=False, sr=None, amax_in=None):
    """x (rows, K) float32 -> codes (rows, K), scales (rows, K/16), amax."""
    rows, K = x.shape
    amax = F32(amax_in) if amax_in is not None else amax_of(x)
    s_enc, s_dec = nvfp4_global(amax)
    s_enc6 = s_enc * (F32(1) / F32(6))
    codes = np.zeros((rows, K), dtype=np.uint8)
    scales = np.zeros((rows, K // 16), dtype=np.uint8)
    for r in range(rows):
        for b in range(K // 16):
            blk = x[r, 16 * b:16 * b + 16]
            if two_d:
                r0 = (r // 16) * 16
                bmax = amax_of(x[r0:r0 + 16, 16 * b:16 * b + 16])
            else:
                bmax = amax_of(blk)
            with np.errstate(over="ignore"):
                sd = ue4m3_encode(min(bmax * s_enc6, FLT_MAX))
            with np.errstate(divide="ignore", over="ignore"):
                se = min(F32(1) / (fp8_decode([sd], "e4m3")[0] * s_dec), FLT_MAX)
            scales[r, b] = sd
            with np.errstate(over="ignore"):
                y = (blk * se).astype(F32)
            if sr is None:
                codes[r, 16 * b:16 * b + 16] = e2m1_encode(y)
            else:
                seed, offset = sr
                rb = sr_bytes(seed, offset, r * (K // 16) + b)
                codes[r, 16 * b:16 * b + 16] = [e2m1_sr(y[j], rb[j]) for j in range(16)]
    return codes, scales, amax


def nvfp4_dequantize(codes, scales, amax):
    rows, K = codes.shape
    s_dec = nvfp4_decode_scale(amax)
    sd = fp8_decode(scales, "e4m3").repeat(16, axis=1)
    return ((e2m1_decode(codes) * sd) * s_dec).astype(F32)


def e8m0_rceil(bmax, elem):
    """Smallest e in [0, 254] with 2^(e-127) >= bmax / elem_max (fp32 division); 0 for 0."""
    q = F32(bmax) / ELEM[elem][1]
    if q == 0:
        return 0
    if math.isinf(q):
        return 254
    m, ex = math.frexp(float(q))              # q = m * 2^ex, m in [0.5, 1)
    ceil_log2 = ex - 1 if m == 0.5 else ex
    return max(0, min(254, ceil_log2 + 127))


def e8m0_floor(bmax, elem):
    """OCP: 2^(floor(log2 bmax) - emax_elem) as an e8m0 code, clamped to [0, 254]; 0 for 0."""
    bmax = F32(bmax)
    if bmax == 0:
        return 0
    if math.isinf(bmax):
        return 254
    _, ex = math.frexp(float(bmax))
    return max(0, min(254, ex - 1 - ELEM[elem][2] + 127))


def mxfp8_quantize(x, elem, rule):
    rows, K = x.shape
    codes = np.zeros((rows, K), dtype=np.uint8)
    scales = np.zeros((rows, K // 32), dtype=np.uint8)
    for r in range(rows):
        for b in range(K // 32):
            blk = x[r, 32 * b:32 * b + 32]
            bmax = amax_of(blk)
            e = e8m0_rceil(bmax, elem) if rule == "rceil" else e8m0_floor(bmax, elem)
            scales[r, b] = e
            inv = F32(2.0 ** (127 - e))           # exact in float32 for e in [0, 254]
            codes[r, 32 * b:32 * b + 32] = fp8_encode((blk * inv).astype(F32), elem)
    return codes, scales


def mxfp8_dequantize(codes, scales, elem):
    s = np.array([[e8m0_decode(c) for c in row] for row in scales], dtype=F32).repeat(32, axis=1)
    return (fp8_decode(codes, elem) * s).astype(F32)


def fp8_tensor_scale(amax, elem):
    amax = F32(amax)
    if amax == 0 or not np.isfinite(amax):
        return F32(1)
    with np.errstate(over="ignore"):
        s = ELEM[elem][1] / amax
    return FLT_MAX if np.isinf(s) else s


def fp8_quantize(x, elem, amax_in=None):
    amax = F32(amax_in) if amax_in is not None else amax_of(x)
    scale = fp8_tensor_scale(amax, elem)
    return fp8_encode((x * scale).astype(F32), elem), scale, amax


def fp8_dequantize(codes, scale, elem):
    return (fp8_decode(codes, elem) / scale).astype(F32)


# ---------------------------------------------------------------------------------------------
# Output

def mxfp4_quantize(x, rule, sr=None):
    """MXFP4 (NUMERICS §4): 1x32 blocks along K, e8m0 scale with elem_max 6 (rceil) or emax 2
    (floor); e2m1 codes RNE, or SR with the 32 bytes of block g = r*(K/32) + b taken from the
    Philox counters 2g and 2g + 1 (16 bytes each, in order)."""
    rows, K = x.shape
    codes = np.zeros((rows, K), dtype=np.uint8)
    scales = np.zeros((rows, K // 32), dtype=np.uint8)
    for r in range(rows):
        for b in range(K // 32):
            blk = x[r, 32 * b:32 * b + 32]
            bmax = amax_of(blk)
            e = e8m0_rceil(bmax, "e2m1") if rule == "rceil" else e8m0_floor(bmax, "e2m1")
            scales[r, b] = e
            inv = F32(2.0 ** (127 - e))
            y = (blk * inv).astype(F32)
            if sr is None:
                codes[r, 32 * b:32 * b + 32] = e2m1_encode(y)
            else:
                g = r * (K // 32) + b
                rb = sr_bytes(sr[0], sr[1], 2 * g) + sr_bytes(sr[0], sr[1], 2 * g + 1)
                codes[r, 32 * b:32 * b + 32] = [e2m1_sr(y[j], rb[j]) for j in range(32)]
    return codes, scales


def mxfp4_dequantize(codes, scales):
    s = np.array([[e8m0_decode(c) for c in row] for row in scales], dtype=F32).repeat(32, axis=1)
    return (e2m1_decode(codes) * s).astype(F32)


def hex32(a):
    return ["%08x" % v for v in np.asarray(a, dtype=F32).reshape(-1).view(np.uint32)]


def hex8(a):
    return ["%02x" % v for v in np.asarray(a, dtype=np.uint8).reshape(-1)]


HEADER = """\
# tests/golden/formats.txt: golden vectors for nvlua's quantizers (core/NUMERICS.md).
# Generated by scripts/gen_golden_formats.py (numpy + ml_dtypes, independent of nvlua's code).
# Do not edit by hand; rerun the script.
#
# Format: line based, tokens separated by single spaces, '#' lines are comments.
#   case NAME FMT ROWS K [KEY=VALUE ...]     starts a case; x is (ROWS, K) row-major fp32
#     FMT  nvfp4_1d   1x16 blocks along K, ue4m3 scales (ROWS, K/16), tensor amax
#          nvfp4_2d   16x16 tiles; scales still stored per 1x16 block (ROWS, K/16)
#          mxfp8      1x32 blocks along K, e8m0 scales (ROWS, K/32)
#          mxfp4      1x32 blocks along K, e8m0 scales (ROWS, K/32), e2m1 elements
#          fp8        per-tensor current scaling (one fp32 scale)
#     KEYS elem=e4m3|e5m2        element format (mxfp8, fp8)
#          rule=rceil|floor      e8m0 scale rule (mxfp8, mxfp4)
#          rht=1                 nvfp4, mxfp4: the 16-point RHT (default signs, NUMERICS 5) is applied
#                                along K to x before quantization; 'xt' holds the transformed x
#          dtype=bf16            x holds bf16 values and is quantized as a bf16 tensor; with rht=1 the
#                                transformed x is rounded to bf16 before amax, scales and codes (TE's wgrad)
#          sr=1 seed=HEX offset=HEX   nvfp4, mxfp4: stochastic rounding with the Philox stream (64-bit hex)
#          amax_in=HEX           the amax is given (fp32 bits) instead of computed from x
#   x HEX...        input, fp32 bits (8 hex digits each), row-major; may continue over many lines
#   xt HEX...       (rht=1 only) x after the RHT, fp32 bits
#   codes HEX...    element codes, one byte each (2 hex digits), unpacked, row-major
#   scales HEX...   block scale bytes, row-major (absent for fp8)
#   amax HEX        the amax used, fp32 bits (nvfp4, fp8)
#   scale HEX       the fp8 per-tensor scale (x * scale is cast), fp32 bits (fp8 only)
#   y HEX...        dequantized values, fp32 bits
#   end             ends the case
# A keyword repeated on consecutive lines continues the same array.
"""


class Writer:
    def __init__(self):
        self.lines = [HEADER.rstrip("\n")]
        self.ncases = 0

    def arr(self, key, toks, per):
        for i in range(0, len(toks), per):
            self.lines.append(key + " " + " ".join(toks[i:i + per]))

    def case(self, name, fmt, x, opts=(), xt=None, codes=None, scales=None, amax=None, scale=None, y=None):
        rows, K = x.shape
        self.lines.append("case %s %s %d %d%s" % (name, fmt, rows, K, "".join(" " + o for o in opts)))
        self.arr("x", hex32(x), 16)
        if xt is not None:
            self.arr("xt", hex32(xt), 16)
        self.arr("codes", hex8(codes), 32)
        if scales is not None:
            self.arr("scales", hex8(scales), 32)
        if amax is not None:
            self.lines.append("amax " + hex32([amax])[0])
        if scale is not None:
            self.lines.append("scale " + hex32([scale])[0])
        self.arr("y", hex32(y), 16)
        self.lines.append("end")
        self.ncases += 1


def f32hex(v):
    return hex32([v])[0]


def nvfp4_case(w, name, x, two_d=False, rht=False, sr=None, amax_in=None, bf16=False):
    opts = []
    xq = x
    xt = None
    if bf16:
        opts.append("dtype=bf16")
    if rht:
        xt = rht_rows_bf16(x) if bf16 else rht_rows(x)
        xq = xt
        opts.append("rht=1")
    if sr is not None:
        opts += ["sr=1", "seed=%016x" % sr[0], "offset=%016x" % sr[1]]
    if amax_in is not None:
        opts.append("amax_in=" + f32hex(amax_in))
    codes, scales, amax = nvfp4_quantize(xq, two_d=two_d, sr=sr, amax_in=amax_in)
    y = nvfp4_dequantize(codes, scales, amax)
    w.case(name, "nvfp4_2d" if two_d else "nvfp4_1d", x, opts, xt=xt, codes=codes, scales=scales,
           amax=amax, y=y)


def nextf(v, n):
    """The float32 n ulps from v (toward +inf for n > 0)."""
    v = F32(v)
    for _ in range(abs(n)):
        v = np.nextafter(v, F32(np.inf) if n > 0 else F32(-np.inf))
    return F32(v)


def order_sensitive_blocks(rng, amax, nblocks):
    """Blocks on which NUMERICS §2's order of operations is visible: the block max makes
    bmax * (s_enc * (1/6)) round to a different ue4m3 byte than (bmax * s_enc) / 6 or
    (bmax * (1/6)) * s_enc would, and elements make e2m1(x * se) differ from what
    se = s_enc / sd (instead of 1 / (sd * s_dec)) would give. Found by a deterministic scan;
    the golden outputs are still computed by nvfp4_quantize."""
    s_enc, s_dec = nvfp4_global(amax)
    s6 = s_enc * (F32(1) / F32(6))
    vals = fp8_decode(np.arange(0, 0x7F, dtype=np.uint8), "e4m3")
    blocks = []
    for i in range(0x7D, 8, -5):                     # ue4m3 midpoints, spread over the range
        mid = (vals[i] + vals[i + 1]) / F32(2)
        b0 = F32(mid / s6)
        for d in [0] + [k for j in range(1, 41) for k in (j, -j)]:
            b = nextf(b0, d)
            if b > amax:
                continue
            sd = ue4m3_encode(b * s6)
            if sd != ue4m3_encode(F32(b * s_enc) / F32(6)) or sd != ue4m3_encode(F32(b * (F32(1) / F32(6))) * s_enc):
                break
        else:
            continue
        se = min(F32(1) / (fp8_decode([sd], "e4m3")[0] * s_dec), FLT_MAX)
        se_alt = F32(s_enc / fp8_decode([sd], "e4m3")[0])
        xs = [b]
        for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            x0 = F32(F32(t) / se)
            for d in [0] + [k for j in range(1, 9) for k in (j, -j)]:
                x = nextf(x0, d)
                if x <= b and e2m1_encode([x * se])[0] != e2m1_encode([x * se_alt])[0]:
                    xs.append(x if len(xs) % 2 else -x)
                    break
        while len(xs) < 16:
            xs.append(F32(rng.uniform(-1, 1) * b))
        blocks.append(np.array(xs[:16], dtype=F32))
        if len(blocks) == nblocks:
            break
    assert len(blocks) == nblocks
    return np.concatenate(blocks).reshape(nblocks // 4, 64)


def mxfp8_case(w, name, x, elem, rule):
    codes, scales = mxfp8_quantize(x, elem, rule)
    w.case(name, "mxfp8", x, ["elem=" + elem, "rule=" + rule], codes=codes, scales=scales,
           y=mxfp8_dequantize(codes, scales, elem))


def mxfp4_case(w, name, x, rule, rht=False, sr=None, bf16=False):
    opts = ["rule=" + rule] + (["dtype=bf16"] if bf16 else [])
    xq, xt = x, None
    if rht:
        xt = rht_rows_bf16(x) if bf16 else rht_rows(x)
        xq = xt
        opts.append("rht=1")
    if sr is not None:
        opts += ["sr=1", "seed=%016x" % sr[0], "offset=%016x" % sr[1]]
    codes, scales = mxfp4_quantize(xq, rule, sr=sr)
    w.case(name, "mxfp4", x, opts, xt=xt, codes=codes, scales=scales, y=mxfp4_dequantize(codes, scales))


def fp8_case(w, name, x, elem, amax_in=None):
    opts = ["elem=" + elem]
    if amax_in is not None:
        opts.append("amax_in=" + f32hex(amax_in))
    codes, scale, amax = fp8_quantize(x, elem, amax_in)
    w.case(name, "fp8", x, opts, codes=codes, amax=amax, scale=scale, y=fp8_dequantize(codes, scale, elem))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "formats.txt")
    rng = np.random.default_rng(20250925)

    def randn(rows, K, scale=1.0):
        return (rng.standard_normal((rows, K)) * scale).astype(F32)

    def row_scaled(rows, K):
        # Each 16-block gets its own magnitude, 2^-8 .. 2^8, so block scales vary.
        x = randn(rows, K)
        mag = np.exp2(rng.integers(-8, 9, size=(rows, K // 16))).astype(F32).repeat(16, axis=1)
        return (x * mag).astype(F32)

    w = Writer()

    # ---- NVFP4 ----
    nvfp4_case(w, "nvfp4_1d_basic", randn(4, 64, 3.0))
    nvfp4_case(w, "nvfp4_1d_block_scaled", row_scaled(2, 64))
    nvfp4_case(w, "nvfp4_2d_basic", row_scaled(32, 32), two_d=True)
    nvfp4_case(w, "nvfp4_2d_randn", randn(16, 48, 0.02), two_d=True)
    nvfp4_case(w, "nvfp4_1d_rht", row_scaled(4, 64), rht=True)
    xo = randn(4, 32)
    xo[1, 3] = F32(40.0)                                     # an outlier the RHT spreads out
    nvfp4_case(w, "nvfp4_1d_rht_outlier", xo, rht=True)
    nvfp4_case(w, "nvfp4_1d_sr", randn(4, 64, 1e-3), sr=(0x0123456789ABCDEF, 0x0000000100000005))
    nvfp4_case(w, "nvfp4_1d_sr_seed0", row_scaled(2, 64), sr=(0, 0))
    nvfp4_case(w, "nvfp4_1d_rht_sr", randn(4, 32, 0.1), rht=True, sr=(42, 7))
    xz = randn(4, 64)
    xz[0, 16:32] = 0
    xz[2, 0:16] = 0
    xz[3, 48:64] = 0
    nvfp4_case(w, "nvfp4_1d_zero_blocks", xz)
    xz2 = row_scaled(32, 32)
    xz2[16:32, 0:16] = 0                                      # one all-zero 16x16 tile
    nvfp4_case(w, "nvfp4_2d_zero_tile", xz2, two_d=True)
    nvfp4_case(w, "nvfp4_1d_all_zero", np.zeros((2, 32), dtype=F32))
    nvfp4_case(w, "nvfp4_2d_all_zero", np.zeros((16, 32), dtype=F32), two_d=True)
    mag = np.exp(rng.uniform(math.log(1e-6), math.log(1e4), size=(4, 64)))
    xw = (mag * rng.choice([-1.0, 1.0], size=(4, 64))).astype(F32)
    nvfp4_case(w, "nvfp4_1d_wide_range", xw)
    # Ties: amax_in = 2688 makes s_enc = s_dec = 1; a block whose max is 6 gets sd = 1, se = 1,
    # so its elements hit the e2m1 ties of NUMERICS §1 exactly; a block with max 12 gets sd = 2.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    t = np.array([ties + [-v for v in ties], [2 * v for v in ties] + [-2 * v for v in ties]], dtype=F32)
    nvfp4_case(w, "nvfp4_1d_ties", t, amax_in=F32(2688.0))
    nvfp4_case(w, "nvfp4_1d_op_order", order_sensitive_blocks(rng, F32(3.3), 8), amax_in=F32(3.3))
    nvfp4_case(w, "nvfp4_1d_op_order_sr", order_sensitive_blocks(rng, F32(0.07), 4), amax_in=F32(0.07),
               sr=(0xFEEDFACECAFEBEEF, 3))
    nvfp4_case(w, "nvfp4_1d_amax_given_large", randn(2, 32), amax_in=F32(100.0))
    nvfp4_case(w, "nvfp4_1d_amax_given_small", randn(2, 32, 10.0), amax_in=F32(1.0))  # saturates
    nvfp4_case(w, "nvfp4_1d_tiny", randn(2, 32, 1e-30))
    # A non-zero block far below amax: bmax * s_enc / 6 < 2^-10 rounds its ue4m3 scale to 0, so
    # se = FLT_MAX and its elements saturate to +-6 (they decode to 0 through sd = 0).
    xu = randn(2, 32)
    xu[0, 16:32] *= F32(1e-7)
    xu[1, 0:16] *= F32(1e-9)
    nvfp4_case(w, "nvfp4_1d_scale_underflow", xu)
    nvfp4_case(w, "nvfp4_1d_scale_underflow_sr", xu, sr=(5, 0xFFFFFFFF))
    nvfp4_case(w, "nvfp4_1d_tiny_amax_clamped", randn(2, 32, 1e-37))  # 2688/amax > FLT_MAX

    # ---- MXFP8 ----
    xm = row_scaled(2, 64)
    xm_wide = xw[:2].copy()
    xm_ext = randn(2, 64)
    xm_ext[0, 0:32] *= F32(1e-38)          # block max near FLT_MIN: the floor rule clamps to 0
    xm_ext[0, 32:64] *= F32(1e-44)         # fp32 subnormals: bmax/elem_max underflows
    xm_ext[1, 0:32] *= F32(1e37)           # huge block
    xm_ext[1, 32:64] = 0                   # zero block
    # Ties in e4m3 / e5m2 with scale exactly 1 (block max = elem max, both rules give 2^0).
    et4 = np.array([448, 2**-10, -2**-10, 3 * 2**-10, 17, 19, 9.5 * 2**-6, 1.0625, 1.1875, 2**-9, 13, 15,
                    -17, -19, 240, 232, 0.5 + 2**-5, 0.5 + 3 * 2**-5, 26, 30, 3.5 * 2**-9, 2**-9 + 2**-12,
                    272, 304, 352, 416, 440, -440, 1.0, 0.0, -0.0, 7.5], dtype=F32)
    et5 = np.array([57344, 2**-17, -2**-17, 3 * 2**-17, 2.5, 3.5, 1.125, 1.375, 20480, 28672, -2.5, -3.5,
                    5 * 2**-17, 2**-16, 0.0, -0.0, 9, 11, 18, 22, 36, 44, 52000, 53248, 1e-6, 1e-5, 3e-5,
                    0.1, 0.2, 0.3, 100, 1000], dtype=F32)
    for elem in ("e4m3", "e5m2"):
        for rule in ("rceil", "floor"):
            mxfp8_case(w, "mxfp8_%s_%s" % (elem, rule), xm, elem, rule)
            mxfp8_case(w, "mxfp8_%s_%s_wide_range" % (elem, rule), xm_wide, elem, rule)
            mxfp8_case(w, "mxfp8_%s_%s_extreme" % (elem, rule), xm_ext, elem, rule)
        mxfp8_case(w, "mxfp8_%s_ties" % elem, (et4 if elem == "e4m3" else et5).reshape(1, 32), elem, "rceil")
    mxfp8_case(w, "mxfp8_e4m3_rceil_all_zero", np.zeros((2, 64), dtype=F32), "e4m3", "rceil")

    # ---- FP8 per-tensor ----
    xf = row_scaled(4, 32)
    for elem in ("e4m3", "e5m2"):
        fp8_case(w, "fp8_%s_current" % elem, xf, elem)
        fp8_case(w, "fp8_%s_wide_range" % elem, xw[:2], elem)
        fp8_case(w, "fp8_%s_amax_given" % elem, xf, elem, amax_in=F32(amax_of(xf) * F32(0.25)))
        fp8_case(w, "fp8_%s_amax_given_zero" % elem, xf, elem, amax_in=F32(0.0))
    fp8_case(w, "fp8_e4m3_ties", et4.reshape(1, 32), "e4m3")         # amax 448 -> scale 1
    fp8_case(w, "fp8_e5m2_ties", et5.reshape(1, 32), "e5m2")         # amax 57344 -> scale 1
    fp8_case(w, "fp8_e4m3_all_zero", np.zeros((2, 16), dtype=F32), "e4m3")
    fp8_case(w, "fp8_e5m2_tiny_amax", randn(1, 16, 1e-36), "e5m2")  # 57344/amax overflows -> FLT_MAX

    # ---- MXFP4 (after the others, so their random inputs stay as they were) ----
    for rule in ("rceil", "floor"):
        mxfp4_case(w, "mxfp4_%s" % rule, xm, rule)
        mxfp4_case(w, "mxfp4_%s_wide_range" % rule, xm_wide, rule)
        mxfp4_case(w, "mxfp4_%s_extreme" % rule, xm_ext, rule)
    # Ties with scale exactly 1 (block max 6: rceil gives 2^0; floor gives 2^(2-2) = 1 too).
    e2t = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6,
                    0.0, -0.0, 0.1, 0.3, 0.6, 0.9, 1.1, 1.4, 1.6, 2.2, 2.8, 3.2, 4.5, 5.5, -4.5, -5.5], dtype=F32)
    mxfp4_case(w, "mxfp4_ties", e2t.reshape(1, 32), "rceil")
    mxfp4_case(w, "mxfp4_rceil_all_zero", np.zeros((2, 64), dtype=F32), "rceil")
    mxfp4_case(w, "mxfp4_sr", randn(4, 64, 1e-3), "rceil", sr=(0x0123456789ABCDEF, 0x0000000100000005))
    mxfp4_case(w, "mxfp4_floor_sr", row_scaled(2, 64), "floor", sr=(7, 0))
    mxfp4_case(w, "mxfp4_rht", row_scaled(4, 64), "rceil", rht=True)
    mxfp4_case(w, "mxfp4_rht_sr", randn(4, 32, 0.1), "rceil", rht=True, sr=(42, 7))

    # ---- bf16 operands with the RHT: TE's wgrad path (the transform's output rounded to bf16) ----
    # Cases appended last so the random stream of the cases above is unchanged.
    nvfp4_case(w, "nvfp4_1d_rht_bf16", to_bf16(row_scaled(8, 64)), rht=True, bf16=True)
    xob = to_bf16(randn(4, 32))
    xob[2, 5] = F32(-40.0)
    nvfp4_case(w, "nvfp4_1d_rht_bf16_outlier", xob, rht=True, bf16=True)
    nvfp4_case(w, "nvfp4_1d_rht_bf16_sr", to_bf16(randn(4, 64, 0.1)), rht=True, bf16=True, sr=(42, 9))
    nvfp4_case(w, "nvfp4_1d_bf16", to_bf16(randn(4, 32, 2.0)), bf16=True)           # no RHT: no rounding step
    mxfp4_case(w, "mxfp4_rht_bf16", to_bf16(row_scaled(4, 64)), "rceil", rht=True, bf16=True)

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(w.lines) + "\n")
    print("wrote %s: %d cases, %d bytes" % (os.path.normpath(out), w.ncases, os.path.getsize(out)))


if __name__ == "__main__":
    main()
