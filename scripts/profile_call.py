"""Where the host time of one small cuflash call goes: cProfile over warm calls.

    PYTHONPATH=. python scripts/profile_call.py
"""
import cProfile
import pstats

import torch

import cuflash

q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.float16) for _ in range(3))
for _ in range(100):
    cuflash.attention(q, k, v, causal=True)
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    cuflash.attention(q, k, v, causal=True)
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(25)
