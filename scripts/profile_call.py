"""Where the host time of one small cuflash call goes: cProfile over warm calls.

    PYTHONPATH=. python scripts/profile_call.py            # cuflash.attention
    PYTHONPATH=. python scripts/profile_call.py --train    # forward + backward through cuflash.torch
"""
import cProfile
import pstats
import sys

import torch

import cuflash
import cuflash.torch

q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.float16) for _ in range(3))
if "--train" in sys.argv:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)

    def call():
        torch.autograd.grad(cuflash.torch.attention(*leaves, causal=True), leaves, dout)
else:
    def call():
        cuflash.attention(q, k, v, causal=True)

for _ in range(100):
    call()
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    call()
profile.disable()
torch.cuda.synchronize()
stats = pstats.Stats(profile)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(40)
