"""With its kernels cached, a torch caller's process never imports CuPy: forward and
backward (the backward from autograd's device thread) launch through ctypes, and agree
with torch SDPA. (A compile loads NVRTC, which comes with CuPy: the script runs itself
once first to fill the cache.)

    PYTHONPATH=. python scripts/common/check_without_cupy.py
"""
import subprocess
import sys

if "--cached" not in sys.argv:
    subprocess.run([sys.executable, __file__, "--cached", "--fill"], check=True)

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash.torch

q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
out = cuflash.torch.attention(q, k, v, causal=True)
grads = torch.autograd.grad(out, (q, k, v), dout)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
want = sdpa(qt, kt, vt, is_causal=True)
want_grads = torch.autograd.grad(want, (qt, kt, vt), dout.transpose(1, 2))
torch.testing.assert_close(out, want.transpose(1, 2), atol=2e-3, rtol=0)
for got, expected in zip(grads, want_grads):
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-2, rtol=0)
with torch.no_grad():
    torch.testing.assert_close(cuflash.torch.attention(q, k, v, causal=True), out, atol=0, rtol=0)
if "--fill" not in sys.argv:
    assert "cupy" not in sys.modules, "CuPy was imported"
    print("torch without CuPy: forward, backward and inference agree with SDPA; CuPy not imported")
