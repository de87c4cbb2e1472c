"""score_mod / mask_mod calls on the mma.sync kernels, small enough for compute-sanitizer,
on any GPU (CUFLASH_PORTABLE=1 is set here, so that a Hopper GPU runs them too):

    compute-sanitizer --tool memcheck python scripts/common/sanitize_mods.py
    compute-sanitizer --tool racecheck python scripts/common/sanitize_mods.py
    compute-sanitizer --tool synccheck python scripts/common/sanitize_mods.py

At d 64, 128 and 256, forward and backward: a relative bias (score_mod reading a table)
with a mask_mod under a causal mask, GQA and seqlen_q != seqlen_k; a block mask of
documents (empty blocks skipped, full ones unmasked, partial ones evaluated); packed
sequences with an empty one and a score_mod. Each call's output, LSE and gradients are
checked against the float64 reference.
"""
import os

os.environ["CUFLASH_PORTABLE"] = "1"  # (before cuflash reads it)

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import mod  # noqa: E402
from cuflash.reference import (attention_reference, attention_reference_backward,  # noqa: E402
                               attention_reference_varlen_backward)


def relative_bias(s, b, h, q_idx, kv_idx, table):
    return s + table[h, mod.minimum(mod.maximum(q_idx - kv_idx, -8), 8) + 8]


def sinks_and_window(b, h, q_idx, kv_idx, table):
    return (q_idx - kv_idx < 100) | (kv_idx < 4)


def same_document(b, h, q_idx, kv_idx, document):
    return document[b, q_idx] == document[b, kv_idx]


def _check(name, got, want, tolerance=3e-2):
    err = float(np.abs(np.nan_to_num(cupy.asnumpy(got).astype(np.float64), posinf=0) -
                       np.nan_to_num(want, posinf=0)).max())
    assert err < tolerance * (1.0 + float(np.abs(np.nan_to_num(want, posinf=0)).max())), (name, err)
    return err


def dense(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, host, device, **kw):
    """A forward and a backward with options kw, mod tensors ``device`` on the GPU and
    ``host`` in the reference."""
    rng = np.random.default_rng(batch * seqlen_q + seqlen_k + d)
    q = rng.standard_normal((batch, seqlen_q, nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, d)).astype(np.float16) for _ in "kv")
    dout = rng.standard_normal(q.shape).astype(np.float16)
    g = [cupy.asarray(x) for x in (dout, q, k, v)]
    out, lse = cuflash.attention(*g[1:], return_lse=True, **kw, **device)
    grads = cuflash.attention_backward(*g, out, lse, **kw, **device)
    reference = {n: x for n, x in {**kw, **host}.items() if n != "block_mask"}
    want = attention_reference_backward(dout, q, k, v, **reference)
    want_out, want_lse = attention_reference(q, k, v, **reference)
    errs = [_check("out", out, want_out), _check("lse", lse, want_lse, 1e-3)]
    errs += [_check(n, x, w) for n, x, w in zip(("dq", "dk", "dv"), grads, want)]
    print(f"d {d:3} {batch}x{seqlen_q}x{seqlen_k} heads {nheads}/{nheads_k} {sorted({**kw, **device})}: "
          f"max errors {' '.join(f'{e:.1e}' for e in errs)}")


def packed(lengths, nheads, nheads_k, d, table):
    rng = np.random.default_rng(sum(lengths) + d)
    total, cu = sum(lengths), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = rng.standard_normal((total, nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((total, nheads_k, d)).astype(np.float16) for _ in "kv")
    dout = rng.standard_normal(q.shape).astype(np.float16)
    g = [cupy.asarray(x) for x in (dout, q, k, v)]
    cu_gpu, longest = cupy.asarray(cu), max(lengths)
    kw = dict(causal=True, score_mod=relative_bias)
    out, lse = cuflash.attention_varlen(*g[1:], cu_gpu, cu_gpu, longest, longest, return_lse=True, **kw,
                                        mod_tensors=(cupy.asarray(table),))
    grads = cuflash.attention_varlen_backward(*g, out, lse, cu_gpu, cu_gpu, longest, longest, **kw,
                                              mod_tensors=(cupy.asarray(table),))
    want = attention_reference_varlen_backward(dout, q, k, v, cu, cu, **kw, mod_tensors=(table,))
    errs = [_check(n, x, w) for n, x, w in zip(("dq", "dk", "dv"), grads, want)]
    print(f"d {d:3} packed {lengths} heads {nheads}/{nheads_k}: max errors {' '.join(f'{e:.1e}' for e in errs)}")


def main() -> None:
    for d in (64, 128, 256):
        table = np.random.default_rng(d).standard_normal((4, 17)).astype(np.float32)
        dense(2, 300, 517, 4, 2, d, dict(mod_tensors=(table,)), dict(mod_tensors=(cupy.asarray(table),)),
              causal=True, score_mod=relative_bias, mask_mod=sinks_and_window)
        documents = np.repeat(np.arange(4), 100)[None].repeat(2, 0).astype(np.int32)  # (2, 400)
        documents[1] = np.repeat(np.arange(2), 200)
        blocks = mod.create_block_mask(same_document, 2, None, 400, 400, mod_tensors=(cupy.asarray(documents),),
                                       like=cupy.zeros(1, cupy.float16))
        dense(2, 400, 400, 4, 2, d, dict(mask_mod=same_document, mod_tensors=(documents,)), dict(block_mask=blocks))
        packed([100, 0, 129, 7], 4, 2, d, table)


if __name__ == "__main__":
    main()
