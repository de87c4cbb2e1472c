"""Backward calls on the sm_90a backward kernel small enough for compute-sanitizer, on a
compute capability 9.0 GPU:

    compute-sanitizer --tool memcheck python scripts/sm90/sanitize_sm90_backward.py
    compute-sanitizer --tool racecheck python scripts/sm90/sanitize_sm90_backward.py
    compute-sanitizer --tool synccheck python scripts/sm90/sanitize_sm90_backward.py [dense]

(``dense``: only the calls on the 80-row tile.) Every tile (d 64: 128 x 128; d 128:
64 x 128, also serving d 72-120, and 80 x 128 for dense calls whose rows come in eights:
dQ^T in its fragments' order), causal and not,
a sliding window, GQA and MQA, ragged lengths (sq != sk, a block + 1, a single query),
the LSE's gradient, packed sequences with an empty one, deterministic calls (dQ added in
turns), softcap, ALiBi, dropout and score_mod (the extras' instances), a block mask of
mask_mod alone (the plain one); the wide kernel (d 192 and 256, 80-key blocks) causal and
not, with a window, GQA, ragged and packed. Each call's gradients are checked against the
float64 reference (dropout's run only).
"""
import cupy
import numpy as np

import cuflash
from cuflash import experiment, mod
from cuflash.reference import attention_reference_backward, attention_reference_varlen_backward


def _check(name, got, want):
    err = float(np.abs(cupy.asnumpy(got).astype(np.float64) - want).max())
    assert err < 3e-2 * (1.0 + float(np.abs(want).max())), (name, err)
    return err


def call(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dlse=False, deterministic=False, host=None, **kw):
    """One call on the GPU with options ``kw``, checked against the reference with ``host``
    in their place (NumPy arrays: ALiBi's slopes, mod tensors) where given."""
    rng = np.random.default_rng(batch * seqlen_q + seqlen_k + d)
    q = rng.standard_normal((batch, seqlen_q, nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, d)).astype(np.float16) for _ in "kv")
    dout = rng.standard_normal(q.shape).astype(np.float16)
    g = [cupy.asarray(x) for x in (dout, q, k, v)]
    out, lse = cuflash.attention(*g[1:], return_lse=True, **kw)
    lse_grad = cupy.asarray(rng.standard_normal(lse.shape).astype(np.float32)) if dlse else None
    grads = cuflash.attention_backward(*g, out, lse, dlse=lse_grad, deterministic=deterministic, **kw)
    errs = []
    if not kw.get("dropout_p"):
        options = {n: x for n, x in {**kw, **(host or {})}.items() if n != "block_mask"}  # (mask_mod's instead)
        want = attention_reference_backward(dout, q, k, v, dlse=None if lse_grad is None else cupy.asnumpy(lse_grad),
                                            **options)
        errs = [_check(n, x, w) for n, x, w in zip(("dq", "dk", "dv"), grads, want)]
    print(f"d {d:3} {batch}x{seqlen_q}x{seqlen_k} heads {nheads}/{nheads_k} {kw} dlse={dlse} "
          f"deterministic={deterministic}: "
          f"max errors {' '.join(f'{e:.1e}' for e in errs)}")


def packed(lengths, nheads, nheads_k, d, deterministic=False, **kw):
    rng = np.random.default_rng(sum(lengths) + d)
    total = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = rng.standard_normal((total, nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((total, nheads_k, d)).astype(np.float16) for _ in "kv")
    dout = rng.standard_normal(q.shape).astype(np.float16)
    g = [cupy.asarray(x) for x in (dout, q, k, v)]
    cu_gpu = cupy.asarray(cu)
    out, lse = cuflash.attention_varlen(*g[1:], cu_gpu, cu_gpu, max(lengths), max(lengths), return_lse=True, **kw)
    grads = cuflash.attention_varlen_backward(*g, out, lse, cu_gpu, cu_gpu, max(lengths), max(lengths),
                                             deterministic=deterministic, **kw)
    want = attention_reference_varlen_backward(dout, q, k, v, cu, cu, **kw)
    errs = [_check(n, x, w) for n, x, w in zip(("dq", "dk", "dv"), grads, want)]
    print(f"d {d:3} packed {lengths} heads {nheads}/{nheads_k} {kw}: max errors {' '.join(f'{e:.1e}' for e in errs)}")


def main() -> None:
    major, _ = cupy.cuda.Device().compute_capability
    assert int(major) == 9, "needs a compute capability 9.0 GPU"
    for d in (64, 96, 128):
        call(2, 300, 300, 4, 2, d)
        call(2, 300, 300, 4, 2, d, causal=True, dlse=True)
        call(1, 129, 517, 4, 1, d, causal=True)
        call(1, 1, 200, 2, 2, d)
        call(1, 257, 130, 4, 4, d, window_size=(70, 20))
        packed([100, 0, 129, 7], 4, 2, d, causal=True)
        packed([100, 0, 129, 7], 4, 2, d)
        call(2, 300, 400, 4, 2, d, deterministic=True)
        call(1, 257, 300, 4, 4, d, causal=True, deterministic=True)
        packed([100, 0, 129, 7], 4, 2, d, deterministic=True)
        extras(d)
    dense_tiles()
    for d in (192, 256):  # the wide kernel's 80-key blocks
        call(2, 161, 161, 4, 2, d)
        call(1, 81, 257, 4, 2, d, causal=True, dlse=True)
        call(1, 1, 200, 2, 2, d)
        call(1, 257, 130, 4, 4, d, window_size=(70, 20))
        packed([100, 0, 81, 7], 4, 2, d, causal=True)


def dense_tiles():
    """The 80-row tile (dense rows in eights): a step and a group past it, one group, a step's
    rows partly past the end, GQA and MQA, the LSE's gradient, causal, a window, d 72 on zero
    columns."""
    with experiment.override(sm90_backward_dense_band_rows=0):  # (short bands on 80 rows too)
        for d in (72, 128):
            call(2, 304, 300, 4, 2, d)
            call(1, 88, 517, 4, 1, d, dlse=True)
            call(3, 8, 129, 4, 4, d)
            call(2, 168, 160, 4, 2, d, causal=True)
            call(1, 304, 517, 4, 4, d, window_size=(100, 30))


def relative_bias(s, b, h, q_idx, kv_idx, bias):
    return s + bias[h, mod.minimum(mod.maximum(q_idx - kv_idx, -8), 8) + 8]


def sinks_and_window(b, h, q_idx, kv_idx):
    return ((q_idx >= kv_idx) & (q_idx - kv_idx < 100)) | (kv_idx < 4)


def extras(d):
    """Softcap, ALiBi, dropout and score_mod on the extras' instances; a block mask (a block
    column and row left out) of mask_mod alone on the plain one."""
    slopes = np.array([0.3, 0.1, 0.05, 0.02], np.float32)
    bias = np.random.default_rng(d).standard_normal((4, 17)).astype(np.float32)
    call(2, 300, 300, 4, 2, d, softcap=5.0, causal=True)
    call(1, 257, 400, 4, 4, d, alibi_slopes=cupy.asarray(slopes), host=dict(alibi_slopes=slopes))
    call(2, 300, 300, 4, 2, d, dropout_p=0.2, seed=5, causal=True)
    call(1, 300, 300, 4, 2, d, softcap=5.0, deterministic=True)
    call(1, 257, 300, 4, 2, d, score_mod=relative_bias, mod_tensors=(cupy.asarray(bias),),
         host=dict(mod_tensors=(bias,)))
    blocks = mod.create_block_mask(sinks_and_window, None, None, 400, 400, like=cupy.zeros(1, cupy.float16))
    call(1, 400, 400, 4, 2, d, block_mask=blocks, host=dict(mask_mod=sinks_and_window))


if __name__ == "__main__":
    import sys
    dense_tiles() if sys.argv[1:] == ["dense"] else main()
