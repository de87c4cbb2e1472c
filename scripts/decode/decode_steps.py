"""The KV-cache call's extra steps one at a time (graph replay, batch and L from the command
line, GQA 32/8, d 128, bf16): read only, causal, append, append + causal, append + rotary,
append + rotary + causal, so that the cost of each shows:

    PYTHONPATH=. python scripts/decode/decode_steps.py [batch] [L]
"""
import sys

import torch

import cuflash.torch
from cuflash.bench import decode as bench_decode, timing

batch, length = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (1, 4096)))
caches, _, kv_bytes = bench_decode.cycled_caches(torch, batch, length, 8, 128)
q, new_k, new_v, full, before, cos, sin = bench_decode.step_inputs(torch, batch, length, 8, 128)
steps = {
    "read only": dict(cache_seqlens=full),
    "causal": dict(cache_seqlens=full, causal=True),
    "append": dict(cache_seqlens=before, new=True),
    "append, causal": dict(cache_seqlens=before, new=True, causal=True),
    "append + rotary": dict(cache_seqlens=before, new=True, rotary_cos=cos, rotary_sin=sin),
    "append + rotary, causal": dict(cache_seqlens=before, new=True, rotary_cos=cos, rotary_sin=sin, causal=True),
}
for name, kw in steps.items():
    kw = dict(kw)
    new = (new_k, new_v) if kw.pop("new", False) else (None, None)
    us, _ = timing.graph_and_plain(torch, [
        lambda k=k, v=v: cuflash.torch.attention_with_kvcache(q, k, v, *new, **kw) for k, v in caches])
    print(f"batch {batch} L {length} {name:>24}: {us:6.2f} us  {kv_bytes / (us * 1e3):6.0f} GB/s", flush=True)
