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

Then a grid over head dims (``--head-dims``, default 64 and 128) and lengths (GRID_SEQLENS,
``--quick`` every other): a relative position bias (``score_mod`` reading a table of
(heads, 2 seqlen - 1) floats; the built-in column the same call without it) and the
documents per sequence (``mask_mod`` with its block mask; the built-in column the packed
call), 16k tokens and 2048 / d heads as the forward bench, ms and FlexAttention's time over
cuflash's.
"""
from __future__ import annotations

import numpy as np

from .timing import REPEATS, WARMUP, median_ms_each

NHEADS, HEADDIM, TOKENS, WINDOW, PREFIX = 16, 128, 16384, 1024, 2048
GRID_HEAD_DIMS, GRID_SEQLENS = (64, 128), (2048, 4096, 8192, 16384)


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < PREFIX)


def same_document(b, h, q_idx, kv_idx, document):
    return document[q_idx] == document[kv_idx]


def same_document_of(b, h, q_idx, kv_idx, document):
    """Documents per sequence: ``document`` (batch, seqlen)."""
    return document[b, q_idx] == document[b, kv_idx]


def relative_bias(score, b, h, q_idx, kv_idx, table):
    """A learned bias per head and distance: ``table`` (heads, 2 seqlen - 1)."""
    return score + table[h, q_idx - kv_idx + (table.shape[1] - 1) // 2]


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

    # Each mask, score_mod and shape is a compile of its own: past dynamo's recompile limit
    # flex_attention would run unfused (the whole score matrix in memory), not as FlexAttention.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
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
            else:
                flex_mask = mask_mod
            block_mask = mod.create_block_mask(mask_mod, None, None, seqlen, seqlen, mod_tensors=tensors, like=xc[0])
            visible = float(np.mean(cupy.asnumpy(block_mask.statuses) > 0))
            flex_blocks = flex.create_block_mask(flex_mask, None, None, seqlen, seqlen, device="cuda")
            fns = {"cuflash": _ours(cuflash, xc, backward, block_mask=block_mask),
                   "no blocks": _ours(cuflash, xc, backward, mask_mod=mask_mod, mod_tensors=tensors)}
            if builtin is not None:
                fns["built-in"] = _ours(cuflash, xc, backward, **builtin)
            elif name == "documents":  # the documents as packed sequences: varlen, one batch
                fns["built-in"] = _packed(cuflash, cupy, xc, lengths, backward)
            fns["flex"] = _flexed(torch, flex_attention, x, backward, block_mask=flex_blocks)
            ms = median_ms_each(fns, torch)
            cells = " ".join(f"{ms[c]:{w}.3f}" if c in ms else f"{'-':>{w}}"
                             for c, w in (("cuflash", 8), ("no blocks", 9), ("built-in", 8), ("flex", 8)))
            print(f"{'fwd+bwd' if backward else 'fwd':>7} {name:>10} {visible:7.2f} {cells} "
                  f"{ms['flex'] / ms['cuflash']:12.2f}", flush=True)
            torch.cuda.empty_cache()
    _grid(args, torch, flex, flex_attention, passes)
    return 0


def _grid(args, torch, flex, flex_attention, passes) -> None:
    """The relative bias and the documents over head dims and lengths (the module's doc)."""
    import cupy

    import cuflash
    from cuflash import mod

    seqlens = GRID_SEQLENS[::2] if getattr(args, "quick", False) else GRID_SEQLENS
    print(f"\n{'pass':>7} {'mod':>10} {'d':>4} {'seqlen':>6} {'cuflash':>8} {'built-in':>8} {'flex':>8} "
          f"{'flex/cuflash':>12}")
    for backward in passes:
        for name in ("bias", "documents"):
            for d in getattr(args, "head_dims", None) or GRID_HEAD_DIMS:
                for seqlen in seqlens:
                    batch, nheads = TOKENS // seqlen, 2048 // d
                    x = [torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
                    xc = [cupy.from_dlpack(t) for t in x]
                    if name == "bias":
                        table = torch.randn(nheads, 2 * seqlen - 1, device="cuda")
                        options = dict(score_mod=relative_bias, mod_tensors=(cupy.from_dlpack(table),))
                        flex_options = dict(score_mod=lambda s, b, h, q, k: relative_bias(s, b, h, q, k, table))
                        builtin = _ours(cuflash, xc, backward)
                    else:
                        lengths = [_documents(seqlen) for _ in range(batch)]
                        ids = np.stack([np.repeat(np.arange(len(n)), n) for n in lengths]).astype(np.int32)
                        document = torch.as_tensor(ids, device="cuda")
                        blocks = mod.create_block_mask(same_document_of, batch, None, seqlen, seqlen,
                                                       mod_tensors=(cupy.from_dlpack(document),), like=xc[0])
                        options = dict(block_mask=blocks)
                        flex_mask = lambda b, h, q, k: same_document_of(b, h, q, k, document)  # noqa: E731
                        flex_options = dict(block_mask=flex.create_block_mask(flex_mask, batch, None, seqlen, seqlen,
                                                                               device="cuda"))
                        builtin = _packed(cuflash, cupy, xc, np.concatenate(lengths), backward)
                    ms = median_ms_each({"cuflash": _ours(cuflash, xc, backward, **options), "built-in": builtin,
                                         "flex": _flexed(torch, flex_attention, x, backward, **flex_options)}, torch)
                    print(f"{'fwd+bwd' if backward else 'fwd':>7} {name:>10} {d:4} {seqlen:6} {ms['cuflash']:8.3f} "
                          f"{ms['built-in']:8.3f} {ms['flex']:8.3f} {ms['flex'] / ms['cuflash']:12.2f}", flush=True)
                    torch.cuda.empty_cache()


# FlexAttention's kernel options, tried in turn where its compile finds no configuration that
# fits (torch 2.11 on the H100: a score_mod reading a table at d 64 asked 240 KiB of shared memory).
FLEX_FALLBACK_OPTIONS = ({}, {"num_stages": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2})


def _flexed(torch, flex_attention, x, backward: bool, **options):
    """FlexAttention's call on the same (q, k, v, dout), heads before rows as it takes them:
    with its default kernel options, or the first of FLEX_FALLBACK_OPTIONS that compiles."""
    q, k, v = (t.transpose(1, 2).detach().requires_grad_(backward) for t in x[:3])
    dout = x[3].transpose(1, 2)

    def run(kernel_options):
        out = flex_attention(q, k, v, **options, **({"kernel_options": kernel_options} if kernel_options else {}))
        return torch.autograd.grad(out, (q, k, v), dout) if backward else out

    for kernel_options in FLEX_FALLBACK_OPTIONS:
        try:
            run(kernel_options)
            break
        except Exception as e:  # (torch._inductor.exc.InductorError: no configuration fits)
            if "No valid triton configs" not in str(e) or kernel_options is FLEX_FALLBACK_OPTIONS[-1]:
                raise
            print(f"FlexAttention: {kernel_options or 'default kernel options'} did not compile; trying the next",
                  flush=True)
    return lambda: run(kernel_options)


def _ours(cuflash, xc, backward: bool, **options):
    """cuflash's call on (q, k, v, dout): the forward, or the forward and backward."""
    q, k, v, dout = xc

    def call():
        if not backward:
            return cuflash.attention(q, k, v, **options)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        return cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    return call


def _packed(cuflash, cupy, xc, lengths, backward: bool):
    """The same rows as packed sequences of ``lengths`` (varlen, one batch)."""
    q, k, v, dout = (t.reshape(-1, *t.shape[2:]) for t in xc)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = int(lengths.max())

    def call():
        if not backward:
            return cuflash.attention_varlen(q, k, v, cu, cu, longest, longest)
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, longest, longest, return_lse=True)
        return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest)
    return call
