"""Two calls of cuflash on the standard grid's shape, for a profiler to look at one kernel.

    ncu --clock-control none -k attention_backward --launch-count 1 \
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,... \
        python3 scripts/one_call.py 8192 128 0 1      # seqlen, head dim, causal, backward

bf16, hidden 2048 (nheads = 2048 / d), batch * seqlen = 16k, through cuflash.torch.
The first call compiles (NVRTC); profile the second with --launch-skip where it matters.
"""
import sys

import torch

from cuflash import torch as cuflash

seqlen, head_dim, causal, backward = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
batch, nheads = 16384 // seqlen, 2048 // head_dim
q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=backward) for _ in range(3))
for _ in range(2):
    out = cuflash.attention(q, k, v, causal=causal)
    if backward:
        out.backward(torch.ones_like(out))
torch.cuda.synchronize()
