"""TFLOP/s on the standard grid, beside torch SDPA's flash and cuDNN backends (--compare).

Grid (FlashAttention's): hidden 2048 (nheads = 2048 / d), batch * seqlen = 16k,
seqlen 512..16k, d 64, 128 and 256, causal off and on, bf16 (--dtype float16 for
fp16). Forward FLOPs = 4 b h sq sk d, halved when causal; forward + backward = 3.5 x
forward (the backward does 2.5x the forward's matmul work). Each figure is the median
of at least ``REPEATS`` CUDA-event timings after ``WARMUP`` calls, all implementations
in the same run on the same inputs, taking turns call by call in orders where each runs
right after every other equally often (timed one after another, the first measured ran
up to 8% faster at some d 256 rows; with one order rotated, the copy that always followed
cuDNN ran up to 8% slower at 512: clock and power state). --plot draws the table
(docs/performance.png).
"""
from __future__ import annotations

import csv
import statistics
import sys

HIDDEN = 2048
TOKENS = 16 * 1024
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
WARMUP, REPEATS = 5, 30


def _gpu_name() -> str | None:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        return None


def _balanced_orders(n: int) -> list[list[int]]:
    """Orders of n callables, one a round, in which every callable comes right after every
    other equally often (a Williams design: 0, 1, n-1, 2, n-2, ... shifted by the round,
    with the reversed rows too where n is odd). Rotating one order is not enough: each
    callable would always follow the same one."""
    base = [0]
    for i in range(1, n):
        base.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(x + r) % n for x in base] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def _median_ms_each(fns: dict, torch) -> dict:
    """name -> median ms of each zero-argument callable, the callables taking turns in
    orders that balance which one runs right before each (at least REPEATS rounds, a whole
    number of the design's orders), so that drifting clocks, and whatever the previous call
    leaves behind (a cuDNN call's power draw), weigh on every one alike."""
    for _ in range(WARMUP):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    items = list(fns.items())
    orders = _balanced_orders(len(items))
    rounds = -(-REPEATS // len(orders)) * len(orders)
    for i in range(rounds):
        for name, fn in (items[j] for j in orders[i % len(orders)]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _median_ms(fn, torch) -> float:
    return _median_ms_each({"fn": fn}, torch)["fn"]


def _run(module, q, k, v, dout, backward, **options):
    """One forward (and backward) through ``module``'s API (cuflash, or a baseline copy)."""
    if not backward:
        return module.attention(q, k, v, **options)
    out, lse = module.attention(q, k, v, return_lse=True, **options)
    return module.attention_backward(dout, q, k, v, out, lse, **options)


def _implementations(torch, b, s, h, d, causal, backward, baseline=None, dtype="bfloat16", compare=True):
    """name -> zero-argument callable running one forward (and backward) on fresh random inputs."""
    import cuflash
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    impls = {"cuflash": lambda: _run(cuflash, q, k, v, dout, backward, causal=causal)}
    if baseline is not None:
        impls["baseline"] = lambda: _run(baseline, q, k, v, dout, backward, causal=causal)
    if not compare:
        return impls
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    # SDPA wants (b, h, s, d): views of the same storage.
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(backward) for x in (q, k, v))
    dout_t = dout.transpose(1, 2)
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                out = sdpa(qt, kt, vt, is_causal=causal)
                if backward:
                    return torch.autograd.grad(out, (qt, kt, vt), dout_t)
                return out
        try:
            run()
            impls[name] = run
        except RuntimeError:  # backend not available for this shape or build
            pass
    return impls


def main(args) -> int:
    gpu = _gpu_name()
    if gpu is None:
        print("python -m cuflash bench: no CUDA GPU found, nothing to benchmark "
              "(the NumPy CPU path is for correctness, not speed)", file=sys.stderr)
        return 1
    try:
        import torch
    except ImportError:
        print("python -m cuflash bench needs PyTorch for the side-by-side SDPA comparison: pip install torch")
        return 1
    if getattr(args, "decode", False):
        from . import bench_decode
        return bench_decode.main(args, torch, gpu)
    baseline = _load_baseline(args.baseline) if args.baseline else None
    seqlens = SEQLENS[::2] if args.quick else SEQLENS
    passes = {"fwd": (False,), "fwdbwd": (True,), "all": (False, True)}[args.mode]
    rows = []
    for backward in passes:
        for d in (args.head_dims or HEAD_DIMS):
            for causal in (False, True):
                for s in seqlens:
                    b, h = TOKENS // s, HIDDEN // d
                    flops = 4 * b * h * s * s * d / (2 if causal else 1) * (3.5 if backward else 1)
                    row = {"pass": "fwd+bwd" if backward else "fwd", "d": d, "causal": causal, "seqlen": s,
                           "batch": b, "nheads": h}
                    impls = _implementations(torch, b, s, h, d, causal, backward, baseline, args.dtype, args.compare)
                    for name, ms in _median_ms_each(impls, torch).items():
                        row[name] = flops / (ms * 1e-3) / 1e12
                    rows.append(row)
                    torch.cuda.empty_cache()

    names = [n for n in ("cuflash", "baseline", "sdpa-flash", "sdpa-cudnn") if any(n in r for r in rows)]
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
            plot(rows, args.plot, f"{gpu}, {args.dtype}, hidden {HIDDEN}, batch*seqlen {TOKENS}")
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib); or save --csv and run "
                  "python -m cuflash plot CSV PNG where it is installed")
    if args.overhead:
        _overhead(torch)
    if args.variants:
        _variants(torch, gpu)
    return 0


def plot(rows: list[dict], path: str, title: str) -> None:
    """TFLOP/s against seqlen, one panel per (pass, causal) and head dim, one line per
    implementation. ``rows`` as ``main`` makes them (or read back from its CSV)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["pass"], r["causal"]) for r in rows}, key=lambda pc: (pc[0] != "fwd", pc[1]))
    dims = sorted({r["d"] for r in rows})
    names = [n for n in ("cuflash", "baseline", "sdpa-flash", "sdpa-cudnn") if any(r.get(n) for r in rows)]
    fig, axes = plt.subplots(len(panels), len(dims), figsize=(4 * len(dims), 3 * len(panels)), squeeze=False)
    for (pass_, causal), row_axes in zip(panels, axes):
        for d, ax in zip(dims, row_axes):
            cells = sorted((r for r in rows if (r["pass"], r["causal"], r["d"]) == (pass_, causal, d)),
                           key=lambda r: r["seqlen"])
            for name in names:
                points = [(r["seqlen"], r[name]) for r in cells if r.get(name)]
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            style_panel(ax, f"{pass_}, d {d}, {'causal' if causal else 'not causal'}", "seqlen", "TFLOP/s")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, title, path)


def style_panel(ax, title: str, xlabel: str, ylabel: str) -> None:
    """A panel of a bench plot: x on a log2 scale, y from 0, a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def save_figure(fig, title: str, path: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def read_csv(path: str) -> list[dict]:
    """The rows of a ``--csv`` file, typed back."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["causal"] = r["causal"] == "True"
        for key in ("d", "seqlen", "batch", "nheads"):
            r[key] = int(r[key])
        for key in ("cuflash", "baseline", "sdpa-flash", "sdpa-cudnn"):
            r[key] = float(r[key]) if r.get(key) else None
    return rows


def _overhead(torch) -> None:
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


def host_us(torch, fn) -> float:
    """Host time of one call of ``fn``: warmed up, then the median over 5 rounds of 1000
    calls issued back to back (their GPU work shorter than their host time), synchronising
    between rounds."""
    import time
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(1000):
            fn()
        per_call.append((time.perf_counter() - start) * 1e3)  # us per call
        torch.cuda.synchronize()
    return statistics.median(per_call)


def _load_baseline(path: str):
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


def _variants(torch, gpu) -> None:
    """The variants' speed checks: a sliding window against full causal at 16k, and
    packed variable-length sequences against the padded rectangle."""
    import cuflash
    import numpy as np
    print(f"variants, bf16, d 128, {gpu}; median ms of {REPEATS} after {WARMUP} warm-up")
    h, d, s = 16, 128, 16384
    q, k, v, dout = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for backward in (False, True):
        causal, window = _median_ms_each({
            "causal": lambda: _run(cuflash, q, k, v, dout, backward, causal=True),
            "window": lambda: _run(cuflash, q, k, v, dout, backward, causal=True, window_size=(256, 0))}, torch).values()
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
        varlen, padded = _median_ms_each({
            "packed": packed, "padded": lambda: _run(cuflash, qr, kr, vr, dr, backward, causal=True)}, torch).values()
        print(f"{'fwd+bwd' if backward else 'fwd':>7}  {len(lengths)} sequences, {total} tokens, longest {longest}: "
              f"padded {padded:7.3f} ms, packed {varlen:7.3f} ms, speedup {padded / varlen:5.2f}x")
