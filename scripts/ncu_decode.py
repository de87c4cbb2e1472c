"""One KV-cache call (batch 1, L 4096, GQA 32/8, d 128, bf16) for a profiler to look at:

    ncu --clock-control none -k regex:"attention_decode|merge_states" python scripts/ncu_decode.py
"""
import torch

import cuflash.torch

q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
lengths = torch.full((1,), 4096, device="cuda", dtype=torch.int32)
for _ in range(3):
    cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
torch.cuda.synchronize()
