"""``python -m cuflash bench``: cuflash's speed beside torch SDPA's flash and cuDNN backends.

One module a concern: ``forward`` (TFLOP/s on FlashAttention's grid, the host time of a
small call, the variants' checks), ``decode`` (the KV-cache call on decode shapes, GB/s),
``mods`` (programmable masks beside FlexAttention),
``timing`` (CUDA events, balanced turns, medians; graph replay), ``plot`` (figures, the
CSV read back). Nothing here runs without a CUDA GPU and PyTorch: without them ``main``
says so in one line and fails.
"""
from __future__ import annotations

import sys

from . import decode, forward, mods, timing
from .forward import HEAD_DIMS, HIDDEN, SEQLENS, TOKENS
from .timing import REPEATS, WARMUP, host_us

# The names the developer scripts time with (scripts/common/ab.py, tile_sweep.py, ...).
_balanced_orders, _median_ms_each, _median_ms = timing.balanced_orders, timing.median_ms_each, timing.median_ms
_implementations, _run, _load_baseline = forward.implementations, forward.run, forward.load_baseline


def gpu_name() -> str | None:
    """The first CUDA GPU's name, or None where CuPy sees none."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        return None


def main(args) -> int:
    gpu = gpu_name()
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
        return decode.main(args, torch, gpu)
    if getattr(args, "mods", False):
        return mods.main(args, torch, gpu)
    return forward.main(args, torch, gpu)
