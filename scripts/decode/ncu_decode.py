"""One KV-cache call (GQA 32/8, d 128, bf16; batch, L and a page size from the command
line, default 1, 4096 and contiguous) for a profiler to look at:

    ncu --clock-control none -k regex:"attention_decode|merge_states" python scripts/decode/ncu_decode.py [batch] [L] [page]

With a page size the cache is a pool of pages in shuffled order (as in ``bench --decode``).
"""
import sys

import torch

import cuflash.torch

batch, length, page = (int(a) for a in (sys.argv[1:] + ["1", "4096", "0"][len(sys.argv) - 1:])[:3])
q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
table = None
if page:
    pages = -(-length // page)
    order = torch.randperm(batch * pages, device="cuda")
    table = order.reshape(batch, pages).to(torch.int32)

    def paged(x):
        padded = torch.zeros(batch, pages * page, 8, 128, device="cuda", dtype=x.dtype)
        padded[:, :length] = x
        pool = torch.empty(batch * pages, page, 8, 128, device="cuda", dtype=x.dtype)
        pool[order] = padded.reshape(batch * pages, page, 8, 128)
        return pool
    k_cache, v_cache = paged(k_cache), paged(v_cache)
for _ in range(3):
    cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
torch.cuda.synchronize()
