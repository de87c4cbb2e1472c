"""Two calls of cuflash on the standard grid's shape, for a profiler to look at one kernel.

    ncu --clock-control none -k attention_backward --launch-count 1 \
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,... \
        python3 scripts/common/one_call.py 8192 128 0 1      # seqlen, head dim, causal, backward, [sdpa]

bf16, hidden 2048 (nheads = 2048 / d), batch * seqlen = 16k, through cuflash.torch (or,
with a fifth argument "sdpa", torch SDPA's flash backend: flash-attn's kernels).
The first call compiles (NVRTC); profile the second with --launch-skip where it matters.
"""
import sys

import torch

from cuflash import torch as cuflash

seqlen, head_dim, causal, backward = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
batch, nheads = 16384 // seqlen, 2048 // head_dim
q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=backward) for _ in range(3))
sdpa = len(sys.argv) > 5 and sys.argv[5] == "sdpa"


def attention(q, k, v, causal):
    if not sdpa:
        return cuflash.attention(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)


for _ in range(2):
    out = attention(q, k, v, causal)
    if backward:
        out.backward(torch.ones_like(out))
torch.cuda.synchronize()
