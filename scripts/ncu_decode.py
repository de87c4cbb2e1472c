"""One KV-cache call (GQA 32/8, d 128, bf16; batch and L from the command line, default 1
and 4096) for a profiler to look at:

    ncu --clock-control none -k regex:"attention_decode|merge_states" python scripts/ncu_decode.py [batch] [L]
"""
import sys

import torch

import cuflash.torch

batch, length = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (1, 4096)))
q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
for _ in range(3):
    cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
torch.cuda.synchronize()
