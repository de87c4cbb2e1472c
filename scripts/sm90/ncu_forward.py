"""One forward call (16k tokens: batch 16384 / seqlen, 2048 / head dim heads, bf16) for a
profiler to look at; head dim (default 128), "causal" and the sequence length (default
8192) from argv:

    ncu --clock-control none -k regex:attention_forward --section SpeedOfLight \
        --section WarpStateStats --section ComputeWorkloadAnalysis python scripts/sm90/ncu_forward.py 128 [causal] [8192]
"""
import sys

import torch

import cuflash

head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
causal = "causal" in sys.argv[2:]
seqlen = next((int(a) for a in sys.argv[2:] if a.isdigit()), 8192)
shape = (max(1, 16384 // seqlen), seqlen, 2048 // head_dim, head_dim)
q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
for _ in range(3):
    cuflash.attention(q, k, v, causal=causal)
torch.cuda.synchronize()
