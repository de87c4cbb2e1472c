"""TFLOP/s on the standard grid, beside torch SDPA's flash and cuDNN backends (--compare).

Grid (FlashAttention's): hidden 2048 (nheads = 2048 / d), batch * seqlen = 16k,
seqlen 512..16k, d 64, 128 and 256, causal off and on, bf16 (--dtype float16 for
fp16). Forward FLOPs = 4 b h sq sk d, halved when causal; the backward alone 2.5 x forward
(its matmul work; timed from the forward's saved outputs), forward + backward 3.5 x forward.
Each figure is the median
of at least ``timing.REPEATS`` CUDA-event timings after ``timing.WARMUP`` calls, all
implementations in the same run on the same inputs, taking turns call by call in orders
where each runs right after every other equally often (timed one after another, the first
measured ran up to 8% faster at some d 256 rows; with one order rotated, the copy that
always followed cuDNN ran up to 8% slower at 512: clock and power state). --plot draws the
table (docs/performance.png); --overhead and --variants add the host time of a small call
and the sliding-window and variable-length checks.
"""
from __future__ import annotations

import csv
import sys

from . import plot
from .timing import REPEATS, WARMUP, host_us, median_ms_each

HIDDEN = 2048
TOKENS = 16 * 1024
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
# pass -> (backward, the backward alone, FLOPs over the forward's)
PASSES = {"fwd": (False, False, 1.0), "bwd": (True, True, 2.5), "fwd+bwd": (True, False, 3.5)}
MODES = {"fwd": ("fwd",), "bwd": ("bwd",), "fwdbwd": ("fwd+bwd",), "all": tuple(PASSES)}  # (--mode)


def main(args, torch, gpu: str) -> int:
    """The grid's table (and its CSV, plot and extra checks, as ``args`` asks)."""
    baseline = load_baseline(args.baseline) if args.baseline else None
    seqlens = SEQLENS[::2] if args.quick else SEQLENS
    passes = MODES[args.mode]
    rows = []
    for pass_ in passes:
        backward, alone, work = PASSES[pass_]
        for d in (args.head_dims or HEAD_DIMS):
            for causal in (False, True):
                for s in seqlens:
                    b, h = TOKENS // s, HIDDEN // d
                    flops = 4 * b * h * s * s * d / (2 if causal else 1) * work
                    row = {"pass": pass_, "d": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                    impls = implementations(torch, b, s, h, d, causal, backward, baseline, args.dtype, args.compare,
                                            alone)
                    for name, ms in median_ms_each(impls, torch).items():
                        row[name] = flops / (ms * 1e-3) / 1e12
                    rows.append(row)
                    torch.cuda.empty_cache()

    names = [n for n in plot.IMPLEMENTATIONS if any(n in r for r in rows)]
    peers = names[1:]
    print(f"TFLOP/s, {args.dtype}, hidden {HIDDEN}, batch*seqlen {TOKENS}, {gpu}, "
          f"torch {torch.__version__}; median of {REPEATS}+ after {WARMUP} warm-up")
    print(f"{'pass':>7} {'d':>4} {'causal':>6} {'seqlen':>6} " + " ".join(f"{n:>11}" for n in names) + "  "
          + " ".join(f"{'cuflash/' + n.removeprefix('sdpa-'):>16}" for n in peers))
    for r in rows:
        vals = " ".join(f"{r[n]:11.1f}" if n in r else f"{'-':>11}" for n in names)
        ratios = " ".join(f"{r['cuflash'] / r[n]:16.3f}" if n in r else f"{'-':>16}" for n in peers)
        print(f"{r['pass']:>7} {r['d']:4d} {str(r['causal']):>6} {r['seqlen']:6d} {vals}  {ratios}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["pass", "d", "causal", "seqlen", "batch", "nheads"] + names)
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        try:
            plot.forward(rows, args.plot, f"{gpu}, {args.dtype}, hidden {HIDDEN}, batch*seqlen {TOKENS}")
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib); or save --csv and run "
                  "python -m cuflash plot CSV PNG where it is installed")
    if args.overhead:
        overhead(torch)
    if args.variants:
        variants(torch, gpu)
    return 0


def run(module, q, k, v, dout, backward, **options):
    """One forward (and backward) through ``module``'s API (cuflash, or a baseline copy)."""
    if not backward:
        return module.attention(q, k, v, **options)
    out, lse = module.attention(q, k, v, return_lse=True, **options)
    return module.attention_backward(dout, q, k, v, out, lse, **options)


def backward_alone(module, q, k, v, dout, **options):
    """A zero-argument callable running ``module``'s backward alone, from one forward's out and LSE."""
    out, lse = module.attention(q, k, v, return_lse=True, **options)
    return lambda: module.attention_backward(dout, q, k, v, out, lse, **options)


def implementations(torch, b, s, h, d, causal, backward, baseline=None, dtype="bfloat16", compare=True,
                    alone=False):
    """name -> zero-argument callable running one forward (and backward; with ``alone`` the
    backward only, from a forward run once) on fresh random inputs."""
    import cuflash
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    modules = {"cuflash": cuflash, **({} if baseline is None else {"baseline": baseline})}
    if alone:
        impls = {name: backward_alone(module, q, k, v, dout, causal=causal) for name, module in modules.items()}
    else:
        impls = {name: lambda module=module: run(module, q, k, v, dout, backward, causal=causal)
                 for name, module in modules.items()}
    if not compare:
        return impls
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    # SDPA wants (b, h, s, d): views of the same storage.
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(backward) for x in (q, k, v))
    dout_t = dout.transpose(1, 2)
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                out = sdpa(qt, kt, vt, is_causal=causal)
                if backward:
                    return torch.autograd.grad(out, (qt, kt, vt), dout_t)
                return out

        def call_backward(backend=backend):  # (the graph of one forward, kept for every call)
            with sdpa_kernel(backend):
                out = sdpa(qt, kt, vt, is_causal=causal)
            return lambda: torch.autograd.grad(out, (qt, kt, vt), dout_t, retain_graph=True)
        try:
            impls[name] = call_backward() if alone else call
            impls[name]()
        except RuntimeError:  # backend not available for this shape or build
            pass
    return impls


def load_baseline(path: str):
    """Another copy of the cuflash package (e.g. the previous release), imported under
    its folder's name so both run in one process."""
    import importlib.util
    import pathlib
    folder = pathlib.Path(path)
    spec = importlib.util.spec_from_file_location(folder.name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[folder.name] = module
    spec.loader.exec_module(module)
    return module


def overhead(torch) -> None:
    """Host time per warm call on a tiny shape, where the launch, not the GPU, is the cost
    (the forward alone, and a training step's forward + backward through autograd): calls
    are issued back to back without synchronising and timed on the host."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    import cuflash.torch
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    # A training step's attention: forward and backward through autograd.
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)

    def sdpa_step():
        out = sdpa(*(x.transpose(1, 2) for x in leaves), is_causal=True)
        torch.autograd.grad(out, leaves, dout.transpose(1, 2))

    calls = {"cuflash.attention": lambda: cuflash.attention(q, k, v, causal=True),
             "sdpa (flash)": lambda: sdpa(qt, kt, vt, is_causal=True),
             "cuflash.torch fwd+bwd": lambda: torch.autograd.grad(
                 cuflash.torch.attention(*leaves, causal=True), leaves, dout),
             "sdpa (flash) fwd+bwd": sdpa_step}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        print("host time per call, (1, 128, 1, 64) float16 causal, median of 5 x 1000 calls")
        for name, fn in calls.items():
            print(f"{name:>22}: {host_us(torch, fn):6.1f} us")


def variants(torch, gpu) -> None:
    """The variants' speed checks: a sliding window against full causal at 16k, and
    packed variable-length sequences against the padded rectangle."""
    import cuflash
    import numpy as np
    print(f"variants, bf16, d 128, {gpu}; median ms of {REPEATS} after {WARMUP} warm-up")
    h, d, s = 16, 128, 16384
    q, k, v, dout = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for backward in (False, True):
        causal, window = median_ms_each({
            "causal": lambda: run(cuflash, q, k, v, dout, backward, causal=True),
            "window": lambda: run(cuflash, q, k, v, dout, backward, causal=True, window_size=(256, 0))}, torch).values()
        print(f"{'fwd+bwd' if backward else 'fwd':>7}  seqlen {s}: causal {causal:8.3f} ms, window (256, 0) "
              f"{window:7.3f} ms, speedup {causal / window:6.1f}x")
    del q, k, v, dout

    rng = np.random.default_rng(0)  # lognormal lengths, mean about 1k, capped at 4096
    lengths = np.clip(rng.lognormal(np.log(1024), 0.8, size=32).astype(int), 1, 4096)
    total, longest = int(lengths.sum()), int(lengths.max())
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    qp, kp, vp, dp = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qr, kr, vr, dr = (torch.randn(len(lengths), longest, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for backward in (False, True):
        def packed():
            if not backward:
                return cuflash.attention_varlen(qp, kp, vp, cu, cu, longest, longest, causal=True)
            out, lse = cuflash.attention_varlen(qp, kp, vp, cu, cu, longest, longest, causal=True, return_lse=True)
            return cuflash.attention_varlen_backward(dp, qp, kp, vp, out, lse, cu, cu, longest, longest, causal=True)
        varlen, padded = median_ms_each({
            "packed": packed, "padded": lambda: run(cuflash, qr, kr, vr, dr, backward, causal=True)}, torch).values()
        print(f"{'fwd+bwd' if backward else 'fwd':>7}  {len(lengths)} sequences, {total} tokens, longest {longest}: "
              f"padded {padded:7.3f} ms, packed {varlen:7.3f} ms, speedup {padded / varlen:5.2f}x")
