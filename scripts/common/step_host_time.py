"""Host time of a warm training step: cuflash.torch's forward with inputs that require grad
and its backward through autograd, beside torch SDPA's (flash), and a warm
cuflash.attention_backward call alone; and SDPA's own flash kernels behind a Python autograd
node (SdpaFunction), the part of a step's host time that the node's language alone sets.

    PYTHONPATH=. python scripts/common/step_host_time.py            # table of rows
    PYTHONPATH=. python scripts/common/step_host_time.py --profile  # and the calls a cuflash step makes

It reads only the public API, so the same script times another checkout of the package
(PYTHONPATH=<that checkout>) for a before/after table. Calls are issued back to back
without synchronising (the GPU work of a (1, 128, 1, 64) call is shorter than its host
time) and timed with perf_counter: median of 5 x 1000.
"""
import collections
import sys

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash
import cuflash.torch
from cuflash.bench.timing import host_us


def calls_per_step(fn, n=200) -> collections.Counter:
    """The Python functions one call of fn enters, counted by (file, name), per call."""
    import cProfile
    import pstats
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    counts = collections.Counter()
    for (path, _, name), (_, calls, *_) in pstats.Stats(profile).stats.items():
        counts[f"{path.rsplit('/', 2)[-1]}:{name}" if "cuflash" in path else name] += calls / n
    return counts


class SdpaFunction(torch.autograd.Function):
    """torch's own flash kernels behind a Python autograd node (the same launches as SDPA's
    step, its C++ node replaced by a Python one): the host time any Python front end pays."""
    @staticmethod
    def forward(ctx, q, k, v):
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.rest = (cq, ck, mq, mk)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, *ctx.rest, 0.0, True, seed, offset)


def main() -> None:
    shape = (1, 128, 1, 64)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float16) for _ in range(3))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)
    dlse = torch.randn(shape[0], shape[2], shape[1], device="cuda")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    tensors = (dout, q, k, v, out, lse)
    arrays = tuple(cupy.asarray(x) for x in tensors)

    def sdpa_step():
        qt, kt, vt = (x.transpose(1, 2) for x in leaves)
        return torch.autograd.grad(sdpa(qt, kt, vt, is_causal=True), leaves, dout.transpose(1, 2))

    def cuflash_step():
        return torch.autograd.grad(cuflash.torch.attention(*leaves, causal=True), leaves, dout)

    def cuflash_lse_step():  # (lse's gradient too: the backward reads dlse's signature beside dout's)
        return torch.autograd.grad(cuflash.torch.attention(*leaves, causal=True, return_lse=True), leaves,
                                   (dout, dlse))

    def sdpa_python_node_step():
        qt, kt, vt = (x.transpose(1, 2) for x in leaves)
        return torch.autograd.grad(SdpaFunction.apply(qt, kt, vt), leaves, dout.transpose(1, 2))

    rows = {
        "torch SDPA (flash) fwd+bwd": sdpa_step,
        "SDPA's kernels, Python node fwd+bwd": sdpa_python_node_step,
        "cuflash.torch fwd+bwd": cuflash_step,
        "cuflash.torch fwd+bwd, dlse": cuflash_lse_step,
        "torch SDPA (flash) forward, grad": lambda: sdpa(*(x.transpose(1, 2) for x in leaves), is_causal=True),
        "cuflash.torch forward, grad": lambda: cuflash.torch.attention(*leaves, causal=True),
        "cuflash.attention_backward, torch": lambda: cuflash.attention_backward(*tensors, causal=True),
        "cuflash.attention_backward, CuPy": lambda: cuflash.attention_backward(*arrays, causal=True),
    }
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        results = {name: host_us(torch, fn) for name, fn in rows.items()}
    print(f"cuflash from {cuflash.__file__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"host time per warm call, {shape} float16 causal, median of 5 x 1000 calls")
    for name, us in results.items():
        print(f"{name:>36}: {us:6.1f} us")
    if "--profile" in sys.argv:
        for name in ("cuflash.torch fwd+bwd", "cuflash.attention_backward, torch"):
            counts = calls_per_step(rows[name])
            print(f"--- {name}: {sum(counts.values()):.0f} Python and built-in calls a call; the cuflash ones:")
            for function, n in sorted(counts.items(), key=lambda item: -item[1]):
                if ".py:" in function:
                    print(f"{n:6.1f}  {function}")


if __name__ == "__main__":
    main()
