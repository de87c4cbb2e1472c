"""TFLOP/s on the standard grid, beside torch SDPA's flash and cuDNN backends.

Grid (FlashAttention's): bf16, hidden 2048 (nheads = 2048 / d), batch * seqlen =
16k, seqlen 512..16k, d 64 and 128, causal off and on. Forward FLOPs = 4 b h sq sk d,
halved when causal; forward + backward = 3.5 x forward (the backward does 2.5x the
forward's matmul work). Each figure is the median of ``REPEATS`` CUDA-event timings
after ``WARMUP`` calls, all implementations in the same run on the same inputs.
"""
from __future__ import annotations

import csv
import statistics

HIDDEN = 2048
TOKENS = 16 * 1024
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
WARMUP, REPEATS = 5, 30


def _gpu_name() -> str | None:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        return None


def _median_ms(fn, torch) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _implementations(torch, b, s, h, d, causal, backward):
    """name -> zero-argument callable running one forward (and backward) on fresh random inputs."""
    import cuflash
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    def run_cuflash(deterministic=False):
        if not backward:
            return cuflash.attention(q, k, v, causal=causal)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    impls = {"cuflash": run_cuflash}
    if backward:
        impls["cuflash-det"] = lambda: run_cuflash(deterministic=True)
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
              "(the NumPy CPU path is for correctness, not speed).")
        return 0
    try:
        import torch
    except ImportError:
        print("python -m cuflash bench needs PyTorch for the side-by-side SDPA comparison: pip install torch")
        return 1
    seqlens = SEQLENS[::2] if args.quick else SEQLENS
    passes = {"fwd": (False,), "fwdbwd": (True,), "all": (False, True)}[args.mode]
    rows = []
    for backward in passes:
        for d in HEAD_DIMS:
            for causal in (False, True):
                for s in seqlens:
                    b, h = TOKENS // s, HIDDEN // d
                    flops = 4 * b * h * s * s * d / (2 if causal else 1) * (3.5 if backward else 1)
                    row = {"pass": "fwd+bwd" if backward else "fwd", "d": d, "causal": causal, "seqlen": s,
                           "batch": b, "nheads": h}
                    for name, fn in _implementations(torch, b, s, h, d, causal, backward).items():
                        row[name] = flops / (_median_ms(fn, torch) * 1e-3) / 1e12
                    rows.append(row)
                    torch.cuda.empty_cache()

    names = ["cuflash", "cuflash-det", "sdpa-flash", "sdpa-cudnn"]
    print(f"TFLOP/s, bf16, hidden {HIDDEN}, batch*seqlen {TOKENS}, {gpu}, "
          f"torch {torch.__version__}; median of {REPEATS} after {WARMUP} warm-up")
    print(f"{'pass':>7} {'d':>4} {'causal':>6} {'seqlen':>6} " + " ".join(f"{n:>10}" for n in names)
          + "  cuflash/flash cuflash/cudnn")
    for r in rows:
        vals = " ".join(f"{r[n]:10.1f}" if n in r else f"{'-':>10}" for n in names)
        ratios = [f"{r['cuflash'] / r[n]:13.2f}" if n in r else f"{'-':>13}" for n in names[2:]]
        print(f"{r['pass']:>7} {r['d']:4d} {str(r['causal']):>6} {r['seqlen']:6d} {vals} {' '.join(ratios)}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["pass", "d", "causal", "seqlen", "batch", "nheads"] + names)
            writer.writeheader()
            writer.writerows(rows)
    return 0
