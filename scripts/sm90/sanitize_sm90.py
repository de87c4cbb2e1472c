"""Forward calls on the sm_90a kernel small enough for compute-sanitizer, on a compute
capability 9.0 GPU:

    compute-sanitizer --tool memcheck python scripts/sm90/sanitize_sm90.py
    compute-sanitizer --tool racecheck python scripts/sm90/sanitize_sm90.py
    compute-sanitizer --tool synccheck python scripts/sm90/sanitize_sm90.py

Every head dim's tile (d 64: three consumers; 128, 192, 256: two), not causal on the persistent
grid with more tiles than multiprocessors (so CTAs take several tiles and the producer loads
the next tile's Q under the last one's output), causal (CTAs taking several tiles from the
launch's counter; pair after pair, and in the scheduler's sections, of three pairs here), a
sliding window with softcap (the extras variant), unmasked calls whose last wave is cut
along the keys (pieces merged by the last to finish), GQA, ragged lengths (sq != sk, tails
of a tile); at d 64 and 128 a score_mod with a mask_mod, and a block mask whose rows skip
empty blocks across its bit words (the mods' instances). Each call's output and LSE are
checked against the float64 reference.
"""
import cupy
import numpy as np

import cuflash
from cuflash import experiment, mod
from cuflash.reference import attention_reference


def call(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int, d: int, block_mask=None,
         **kw) -> None:
    rng = np.random.default_rng(batch * seqlen_q + seqlen_k + d)
    q = rng.standard_normal((batch, seqlen_q, nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, d)).astype(np.float16) for _ in "kv")
    want, want_lse = attention_reference(q, k, v, **kw)
    if "mod_tensors" in kw:
        kw["mod_tensors"] = tuple(map(cupy.asarray, kw["mod_tensors"]))
    if block_mask is not None:  # (it carries mask_mod and its tensors)
        kw = dict(kw, block_mask=block_mask(q), mask_mod=None, mod_tensors=())
    out, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, **kw)
    err = float(np.abs(cupy.asnumpy(out).astype(np.float64) - want).max())
    lse_err = float(np.abs(np.where(np.isinf(want_lse), 0, cupy.asnumpy(lse) - want_lse)).max())
    assert err < 2e-2 and lse_err < 1e-3, (d, kw, err, lse_err)
    print(f"d {d:3} {batch}x{seqlen_q}x{seqlen_k} heads {nheads}/{nheads_k} {sorted(kw)}: max error {err:.1e}, "
          f"lse {lse_err:.1e}")


def bias(s, b, h, q_idx, kv_idx, table):
    return s + table[h, mod.minimum(mod.maximum(q_idx - kv_idx, -8), 8) + 8]


def every_third_hidden(b, h, q_idx, kv_idx, table):
    return kv_idx % 3 != 0


def blocks_kept(b, h, q_idx, kv_idx, kept):
    """Whole blocks shown or hidden as ``kept`` says, and in the shown ones every third key."""
    return (kept[q_idx // mod.BLOCK_SIZE, kv_idx // mod.BLOCK_SIZE] != 0) & (kv_idx % 3 != 0)


def sections(seqlen_k: int, d: int, kv_heads: int):
    """Calls planned inside take the causal scheduler's sections whatever their length, of
    ``kv_heads`` kv heads' groups."""
    return experiment.override(sm90_section_rows=1, sm90_section_bytes=kv_heads * 4 * seqlen_k * d)


def main() -> None:
    major, _ = cupy.cuda.Device().compute_capability
    assert int(major) == 9, "needs a compute capability 9.0 GPU"
    for d in (64, 128, 192, 256):
        call(4, 1000, 1000, 8, 2, d)  # 24-32 tiles a head group: more tiles than multiprocessors
        call(4, 1000, 1000, 8, 2, d, causal=True)  # the CTAs take tiles from the launch's counter
        call(2, 333, 517, 4, 4, d, causal=True)
        with sections(600, d, kv_heads=1):  # 12 pairs in sections of 3
            call(2, 600, 600, 6, 2, d, causal=True)
        call(1, 300, 300, 4, 1, d, window_size=(70, 20), softcap=30.0)
        # Unmasked calls whose tail is cut along the keys (on 114 or 132 multiprocessors):
        # fewer tiles than multiprocessors, every tile in pieces; a wave and a cut tail.
        call(1, 500, 4001, 4, 2, d)
        call(1, 300, 3001, 2, 1, d, softcap=30.0)
        call(2, 1000, 2000, 11, 1, d)
        if d <= 128:  # score_mod and mask_mod; a block mask of 2 x 40 blocks (rows of 79 key tiles)
            table = np.random.default_rng(d).standard_normal((4, 17)).astype(np.float32)
            call(2, 300, 517, 4, 2, d, causal=True, score_mod=bias, mask_mod=every_third_hidden, mod_tensors=(table,))
            kept = (np.random.default_rng(d).random((2, 40)) < 0.4).astype(np.int32)
            kept[0, 5:35] = 0
            call(1, 250, 5050, 2, 1, d, mask_mod=blocks_kept, mod_tensors=(kept,),
                 block_mask=lambda q, kept=kept: mod.create_block_mask(blocks_kept, 1, 2, 250, 5050,
                                                                        mod_tensors=(cupy.asarray(kept),),
                                                                        like=cupy.asarray(q)))


if __name__ == "__main__":
    main()
