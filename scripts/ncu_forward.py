"""One forward call (batch 2, 8k, 16 heads, bf16; head dim from argv, default 128) for a
profiler to look at:

    ncu --clock-control none -k regex:attention_forward --section SpeedOfLight \
        --section WarpStateStats --section ComputeWorkloadAnalysis python scripts/ncu_forward.py 128 [causal]
"""
import sys

import torch

import cuflash

head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
causal = "causal" in sys.argv[2:]
q, k, v = (torch.randn(2, 8192, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
for _ in range(3):
    cuflash.attention(q, k, v, causal=causal)
torch.cuda.synchronize()
