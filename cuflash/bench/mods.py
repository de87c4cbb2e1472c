"""Programmable masks' speed (``python -m cuflash bench --mods``), beside FlexAttention.

One mask function a row, written once and given to both libraries: cuflash's
``mask_mod`` with a block mask (``cuflash.mod.create_block_mask``: empty blocks skipped,
the function evaluated only in partial ones), the same without the block mask (every
block evaluated), the call's built-in option where one exists (causal, the window,
packed sequences: the sm_90a kernels on Hopper), and torch's FlexAttention
(``torch.compile(flex_attention)`` with its own block mask). bf16, 16 heads of 128, 16k
tokens (batch 2 x 8192; the documents: one sequence of 16384 holding documents of
lognormal lengths around 1k); forward, and forward + backward. Figures are ms (median,
CUDA events, the implementations taking turns: timing.median_ms_each); the last column is
FlexAttention's time over cuflash's with the block mask. The block masks are built once
outside the timing, as a model builds them once for all its layers.
"""
from __future__ import annotations

import numpy as np

from .timing import REPEATS, WARMUP, median_ms_each

NHEADS, HEADDIM, TOKENS, WINDOW, PREFIX = 16, 128, 16384, 1024, 2048


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < PREFIX)


def same_document(b, h, q_idx, kv_idx, document):
    return document[q_idx] == document[kv_idx]


def _documents(length: int) -> np.ndarray:
    """Lengths of documents filling ``length`` tokens (lognormal around 1k, seed 0)."""
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(1024), 0.8, size=length).astype(int), 1, 4096)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), length) + 1]
    lengths[-1] -= lengths.sum() - length
    return lengths[lengths > 0]


def main(args, torch, gpu: str) -> int:
    import cupy
    from torch.nn.attention import flex_attention as flex

    import cuflash
    from cuflash import mod

    flex_attention = torch.compile(flex.flex_attention)
    passes = {"fwd": (False,), "fwdbwd": (True,), "all": (False, True)}[args.mode]
    print(f"masks, ms, bf16, {NHEADS} heads of {HEADDIM}, {TOKENS} tokens, {gpu}, torch {torch.__version__}; "
          f"median of {REPEATS}+ after {WARMUP} warm-up")
    print(f"{'pass':>7} {'mask':>10} {'visible':>7} {'cuflash':>8} {'no blocks':>9} {'built-in':>8} {'flex':>8} "
          f"{'flex/cuflash':>12}")
    for backward in passes:
        for name in ("causal", "window", "prefix", "documents"):
            batch = 1 if name == "documents" else 2
            seqlen = TOKENS // batch
            x = [torch.randn(batch, seqlen, NHEADS, HEADDIM, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            xc = [cupy.from_dlpack(t) for t in x]
            mask_mod, tensors, builtin = {"causal": (causal, (), dict(causal=True)),
                                          "window": (sliding_window, (), dict(window_size=(WINDOW - 1, 0))),
                                          "prefix": (prefix_lm, (), None),
                                          "documents": (same_document, (), None)}[name]
            if name == "documents":
                lengths = _documents(seqlen)
                ids = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
                tensors = (cupy.asarray(ids),)
                document = torch.as_tensor(ids, device="cuda")
                flex_mask = lambda b, h, q_idx, kv_idx: same_document(b, h, q_idx, kv_idx, document)  # noqa: E731
                cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            else:
                flex_mask = mask_mod
            block_mask = mod.create_block_mask(mask_mod, None, None, seqlen, seqlen, mod_tensors=tensors, like=xc[0])
            visible = float(np.mean(cupy.asnumpy(block_mask.statuses) > 0))
            flex_blocks = flex.create_block_mask(flex_mask, None, None, seqlen, seqlen, device="cuda")
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(backward) for t in x[:3])
            dout_t = x[3].transpose(1, 2)

            def ours(**options):
                q, k, v, dout = xc
                if not backward:
                    return cuflash.attention(q, k, v, **options)
                out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
                return cuflash.attention_backward(dout, q, k, v, out, lse, **options)

            def packed():  # the documents as packed sequences: varlen, one batch
                q, k, v, dout = (t[0] for t in xc)
                if not backward:
                    return cuflash.attention_varlen(q, k, v, cu, cu, int(lengths.max()), int(lengths.max()))
                out, lse = cuflash.attention_varlen(q, k, v, cu, cu, int(lengths.max()), int(lengths.max()),
                                                    return_lse=True)
                return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, int(lengths.max()),
                                                         int(lengths.max()))

            def flexed():
                out = flex_attention(qt, kt, vt, block_mask=flex_blocks)
                return torch.autograd.grad(out, (qt, kt, vt), dout_t) if backward else out

            fns = {"cuflash": lambda: ours(block_mask=block_mask),
                   "no blocks": lambda: ours(mask_mod=mask_mod, mod_tensors=tensors)}
            if builtin is not None:
                fns["built-in"] = lambda: ours(**builtin)
            elif name == "documents":
                fns["built-in"] = packed
            fns["flex"] = flexed
            ms = median_ms_each(fns, torch)
            cells = " ".join(f"{ms[c]:{w}.3f}" if c in ms else f"{'-':>{w}}"
                             for c, w in (("cuflash", 8), ("no blocks", 9), ("built-in", 8), ("flex", 8)))
            print(f"{'fwd+bwd' if backward else 'fwd':>7} {name:>10} {visible:7.2f} {cells} "
                  f"{ms['flex'] / ms['cuflash']:12.2f}", flush=True)
            torch.cuda.empty_cache()
    return 0
