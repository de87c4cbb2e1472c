"""KV-cache calls on every decode kernel and merge step, small enough for compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/decode/sanitize_decode.py
    compute-sanitizer --tool racecheck python scripts/decode/sanitize_decode.py

The wide tile (grids that are not split: batch 16, GQA 4/2), the split kernel with the merge
kernel (deterministic) and with its cluster merge (batch 1), each with an append, rotary,
causal, left padding and pages of 16 and 17 rows, and at an odd head dim (59: element
copies). Each call's output is checked against the float64 reference.
"""
import cupy
import numpy as np

import cuflash
from cuflash.reference_kvcache import attention_kvcache_reference


def call(batch: int, capacity: int, d: int, page_size: int, **kw) -> None:
    rng = np.random.default_rng(batch * capacity + d + page_size)
    nheads, nheads_k = 4, 2
    q = rng.standard_normal((batch, 1, nheads, d)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((batch, capacity, nheads_k, d)).astype(np.float16) for _ in "kv")
    k, v = (rng.standard_normal((batch, 1, nheads_k, d)).astype(np.float16) for _ in "kv")
    lengths = rng.integers(1, capacity - 1, batch).astype(np.int32)
    leftpad = (lengths // 3).astype(np.int32)
    angle = rng.random((capacity, 8)).astype(np.float32)
    args = dict(cache_seqlens=lengths, cache_leftpad=leftpad, rotary_cos=np.cos(angle), rotary_sin=np.sin(angle),
                causal=True)
    want = attention_kvcache_reference(q, k_cache, v_cache, k, v, **args)[0]
    gpu = {name: cupy.asarray(x) for name, x in args.items() if isinstance(x, np.ndarray)}
    g_k, g_v = cupy.asarray(k_cache), cupy.asarray(v_cache)
    if page_size:
        pages = -(-capacity // page_size)
        order = rng.permutation(batch * pages)
        table = order.reshape(batch, pages).astype(np.int32)

        def paged(x):
            padded = cupy.zeros((batch, pages * page_size) + x.shape[2:], x.dtype)
            padded[:, :capacity] = x
            pool = cupy.empty((batch * pages, page_size) + x.shape[2:], x.dtype)
            pool[cupy.asarray(order)] = padded.reshape((batch * pages, page_size) + x.shape[2:])
            return pool
        g_k, g_v, gpu["block_table"] = paged(g_k), paged(g_v), cupy.asarray(table)
        args["block_table"] = table
    out = cuflash.attention_with_kvcache(cupy.asarray(q), g_k, g_v, cupy.asarray(k), cupy.asarray(v),
                                         **{**args, **gpu, **kw})
    err = float(np.abs(cupy.asnumpy(out).astype(np.float64) - want).max())
    print(f"batch {batch} capacity {capacity} d {d} pages {page_size or '-'} {kw}: max error {err:.1e}", flush=True)
    assert err < 2e-2, err


for page_size in (0, 16, 17):
    call(16, 300, 64, page_size, num_splits=1)          # the wide tile
    call(16, 300, 128, page_size, num_splits=1)
    call(1, 700, 128, page_size)                        # split, merged in a cluster (sm_90)
    call(3, 700, 128, page_size, deterministic=True)    # split, merge kernel
call(16, 300, 59, 0, num_splits=1)                      # element copies
call(2, 300, 59, 0, num_splits=3)
