"""Where a small call's host time goes: each step of a warm call timed on its own.

    PYTHONPATH=. python scripts/common/host_time.py            # table of steps, CuPy and torch
    PYTHONPATH=. python scripts/common/host_time.py --profile  # and cProfile of the torch calls
    PYTHONPATH=. python scripts/common/host_time.py --kvcache  # the KV-cache call's steps instead

Calls are issued back to back without synchronising (the GPU work of a (1, 128, 1, 64)
call is shorter than its host time) and timed with perf_counter: median of 5 x 1000.
"""
import sys

import cupy
import torch

import cuflash
import cuflash.torch
from cuflash import _arrays, _kernels, api, kvcache
from cuflash.bench.timing import host_us


def report(title: str, rows: dict, backend, profiled: tuple) -> None:
    """Each row's host time per call (SDPA on ``backend``), then with --profile cProfile of
    the ``profiled`` rows."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        results = {name: host_us(torch, fn) for name, fn in rows.items()}
    print(title)
    for name, us in results.items():
        print(f"{name:>34}: {us:6.1f} us")
    if "--profile" in sys.argv:
        import cProfile
        import pstats
        for name in profiled:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2000):
                rows[name]()
            profile.disable()
            torch.cuda.synchronize()
            print(f"--- {name}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def kvcache_steps() -> None:
    """A warm KV-cache call at batch 1, 4k keys, GQA 32/8, d 128, bf16 (the bench's
    host-time cell), read only and with append + rotary, and the steps of the first."""
    from torch.nn.attention import SDPBackend
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    length, nheads, nheads_k, d = 4096, 32, 8, 128
    k_cache, v_cache = (torch.randn(1, length, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    q = torch.randn(1, 1, nheads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lengths = torch.full((1,), length - 1, device="cuda", dtype=torch.int32)
    angle = torch.rand(length, d // 2, device="cuda")
    cos, sin = angle.cos(), angle.sin()
    given = (q, k_cache, v_cache, None, None, lengths, None, None, None, None, None, None)
    scalars = (True, False, (-1, -1), 0.0, None, 0, False, False, None)
    for _ in range(2):  # (the first call of a new array type makes no warm key)
        cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    key = kvcache._key(given, scalars)
    warm = kvcache._warm[key]
    calls, device = warm.calls, warm.device
    out = calls.empty(warm.out_shape, warm.dtype, device)
    work = calls.empty((warm.work[0],), calls.dtype("float32"), device) if warm.work else out
    pointers = [0, *[calls.pointer(given[i]) for i in warm.present], calls.pointer(out), 0, calls.pointer(work),
                calls.pointer(work)]
    launch_pointers = warm.order(pointers)
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    rows = {
        "SDPA cuDNN": lambda: sdpa(qt, kt, vt, enable_gqa=True),
        "cuflash.torch, read only": lambda: cuflash.torch.attention_with_kvcache(q, k_cache, v_cache,
                                                                                 cache_seqlens=lengths),
        "cuflash.torch, append + rotary": lambda: cuflash.torch.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos, rotary_sin=sin, causal=True),
        "cuflash, read only": lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths),
        "cuflash, append + rotary": lambda: cuflash.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos, rotary_sin=sin, causal=True),
        "  key": lambda: kvcache._key(given, scalars),
        "  lookup": lambda: kvcache._warm_calls.lookup(kvcache._warm, key),
        "  empty out": lambda: calls.empty(warm.out_shape, warm.dtype, device),
        **({"  empty workspace": lambda: calls.empty((warm.work[0],), calls.dtype("float32"), device)}
           if warm.work else {}),
        "  pointers": lambda: [0, *[calls.pointer(given[i]) for i in warm.present], 1, 0, 2, 3],
        "  their order": lambda: warm.order(pointers),
        "  stream": lambda: calls.stream(device),
        "  launcher": lambda: warm.launcher(calls.stream(device), *launch_pointers),
    }
    report(f"host time per warm KV-cache call, batch 1, L {length}, GQA {nheads}/{nheads_k}, d {d}, bf16, "
           f"{len(warm.launcher.plan.steps)} kernel(s), median of 5 x 1000 calls", rows, SDPBackend.CUDNN_ATTENTION,
           ("cuflash.torch, read only", "cuflash.torch, append + rotary"))


def main() -> None:
    if "--kvcache" in sys.argv:
        return kvcache_steps()
    from torch.nn.attention import SDPBackend
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    shape = (1, 128, 1, 64)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float16) for _ in range(3))
    qc, kc, vc = (cupy.asarray(x) for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)
    scalars = (True, None, (-1, -1), 0.0, 0.0, None, 0, False)
    for _ in range(2):  # (the first call of a new array type makes no warm key)
        cuflash.attention(q, k, v, causal=True)
        cuflash.attention(qc, kc, vc, causal=True)
    key, key_c = (api._key(arrays, scalars, None) for arrays in ((q, k, v), (qc, kc, vc)))
    warm, warm_c = api._warm[key], api._warm[key_c]
    calls, calls_c = warm.calls, warm_c.calls
    out = torch.empty(shape, dtype=torch.float16, device="cuda")
    counter = torch.empty(1, dtype=torch.int32, device="cuda")  # (the sm_90a forward's tile counter, on Hopper)
    infos = {name: _arrays.inspect(x, name) for name, x in (("q", q), ("k", k), ("v", v), ("out", out),
                                                            ("counter", counter))}

    rows = {
        "torch SDPA (flash)": lambda: sdpa(qt, kt, vt, is_causal=True),
        "cuflash.attention, CuPy": lambda: cuflash.attention(qc, kc, vc, causal=True),
        "cuflash.attention, torch": lambda: cuflash.attention(q, k, v, causal=True),
        "cuflash.torch.attention": lambda: cuflash.torch.attention(q, k, v, causal=True),
        "cuflash.torch.attention, grad": lambda: cuflash.torch.attention(*leaves, causal=True),
        "  key (CuPy)": lambda: api._key((qc, kc, vc), scalars, None),
        "  signature (CuPy)": lambda: _arrays.signature(qc),
        "  empty (CuPy)": lambda: calls_c.empty(shape, warm_c.outputs[1], 0),
        "  cupy.empty": lambda: cupy.empty(shape, dtype=cupy.float16),
        "  stream (CuPy)": lambda: calls_c.stream(0),
        "  key (torch)": lambda: api._key((q, k, v), scalars, None),
        "  signature (torch)": lambda: _arrays.signature(q),
        "  lookup": lambda: api._lookup(key),
        "  empty (torch)": lambda: calls.empty(shape, warm.outputs[1], 0),
        "  torch.empty": lambda: torch.empty(shape, dtype=torch.float16, device="cuda"),
        "  stream (torch)": lambda: calls.stream(0),
        "  kernels.forward (JAX's way)": lambda: _kernels.forward(infos["q"], infos["k"], infos["v"], infos["out"], None,
                                                                  warm.options, stream=calls.stream(0),
                                                                  workspace=(infos["counter"],)),
        "  Launcher": lambda: warm.launcher(calls.stream(0), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                            0, counter.data_ptr()),
        "SDPA fwd+bwd": lambda: torch.autograd.grad(sdpa(*(x.transpose(1, 2) for x in leaves), is_causal=True),
                                                   leaves, dout.transpose(1, 2)),
        "cuflash.torch fwd+bwd": lambda: torch.autograd.grad(cuflash.torch.attention(*leaves, causal=True),
                                                            leaves, dout),
    }
    report(f"host time per warm call, {shape} float16 causal, median of 5 x 1000 calls", rows,
           SDPBackend.FLASH_ATTENTION, ("cuflash.torch.attention", "cuflash.torch fwd+bwd"))


if __name__ == "__main__":
    main()
