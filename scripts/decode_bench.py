"""The KV-cache call's speed on decode shapes, beside torch SDPA's cuDNN and flash backends.

    PYTHONPATH=. python scripts/decode_bench.py [--quick]

One new token per sequence, GQA 32/8, d 128, bf16; batch 1, 16, 64 and cache lengths 4k,
16k, 64k (bounded by memory). Caches are cycled through copies of at least 400 MB together
(L2 holds 50-60 MB), so every call reads them from HBM. Two ways: calls replayed from a
CUDA graph (kernel time) and plain back-to-back calls (host time included). CUDA events,
median of 5 rounds after warm-up; GB/s of K and V bytes read.
"""
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash.torch

NHEADS, NHEADS_K, D = 32, 8, 128
CYCLE_BYTES = 400e6


def median_us(run, calls: int, rounds: int = 5) -> float:
    """Median over rounds of one call's time, a round being `run()` (calls calls)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def case(batch: int, length: int, quick: bool) -> dict:
    kv_bytes = 2 * batch * length * NHEADS_K * D * 2
    copies = max(2, min(16, int(-(-CYCLE_BYTES // kv_bytes))))
    if quick:
        copies = 2
    caches = [(torch.randn(batch, length, NHEADS_K, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(batch, length, NHEADS_K, D, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    q = torch.randn(batch, 1, NHEADS, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    # SDPA's layout: (batch, heads, seqlen, d) views of the same caches
    qt = q.transpose(1, 2)
    views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in caches]

    def cuflash_call(i):
        k, v = caches[i]
        return cuflash.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths)

    def sdpa_call(i):
        k, v = views[i]
        return sdpa(qt, k, v, enable_gqa=True)

    results = {}
    for name, call, backend in (("cuflash", cuflash_call, None), ("cuDNN", sdpa_call, SDPBackend.CUDNN_ATTENTION),
                                ("SDPA-flash", sdpa_call, SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend) if backend is not None else torch.no_grad():
                def plain():
                    for i in range(copies):
                        call(i)
                plain()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(copies):
                        call(i)
                results[name] = (median_us(graph.replay, copies), median_us(plain, copies))
        except Exception as e:  # a backend that does not take this shape
            print(f"  {name} batch {batch} L {length}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    caches.clear(), views.clear()
    torch.cuda.empty_cache()
    return {name: (kv_bytes / (g * 1e3), kv_bytes / (p * 1e3), g, p) for name, (g, p) in results.items()}


def host_times() -> None:
    """Host time per call (perf_counter over 1000 calls issued back to back; their GPU work
    is shorter), batch 1, L 4096, one new token appended with rotary."""
    import time

    import cupy
    batch, length = 1, 4096
    k_cache, v_cache = (torch.randn(batch, length, NHEADS_K, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    q = torch.randn(batch, 1, NHEADS, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 1, NHEADS_K, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lengths = torch.full((batch,), length - 1, device="cuda", dtype=torch.int32)
    angle = torch.rand(length, D // 2, device="cuda")
    cos, sin = angle.cos(), angle.sin()
    # (CuPy has no bfloat16: its arrays are float16 copies)
    c = {name: cupy.asarray(x.half() if x.dtype == torch.bfloat16 else x) for name, x in dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, lengths=lengths, cos=cos, sin=sin).items()}
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    calls = {
        "cuflash.torch, append + rotary": lambda: cuflash.torch.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lengths, rotary_cos=cos, rotary_sin=sin, causal=True),
        "cuflash.torch, read only": lambda: cuflash.torch.attention_with_kvcache(q, k_cache, v_cache,
                                                                                 cache_seqlens=lengths),
        "cuflash on CuPy, append + rotary": lambda: cuflash.attention_with_kvcache(
            c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=c["lengths"], rotary_cos=c["cos"],
            rotary_sin=c["sin"], causal=True),
        "SDPA cuDNN": lambda: sdpa(qt, kt, vt, enable_gqa=True),
    }
    print("host time per call, batch 1, L 4096 (median of 5 x 1000 calls)")
    for name, call in calls.items():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(50):
                call()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(1000):
                    call()
                times.append((time.perf_counter() - start) * 1e3)
                torch.cuda.synchronize()
        print(f"{name:>34}: {statistics.median(times):6.1f} us")
    if "--profile" in sys.argv:
        import cProfile
        import pstats
        call = calls["cuflash.torch, read only"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            call()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


def split_sweep() -> None:
    """Graph-replay time of batch 1 (L 4k, 16k, 64k) by num_splits: the splits' trade-off
    (more CTAs at once against more partial results to merge)."""
    for length, copies in ((4096, 12), (16384, 3), (65536, 2)):
        caches = [(torch.randn(1, length, NHEADS_K, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(1, length, NHEADS_K, D, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
        q = torch.randn(1, 1, NHEADS, D, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((1,), length, device="cuda", dtype=torch.int32)
        cells = []
        for splits in (0, 1, 4, 8, 16, 24, 32, 48, 64):
            def plain():
                for k, v in caches:
                    cuflash.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths, num_splits=splits)
            plain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                plain()
            cells.append(f"{splits}: {median_us(graph.replay, copies):5.1f}")
        print(f"batch 1 L {length} us by num_splits (graph replay): " + "  ".join(cells))


def main() -> None:
    quick = "--quick" in sys.argv
    grid = [(1, 4096), (1, 16384), (1, 65536), (16, 4096), (16, 16384), (64, 4096), (64, 16384)]
    if quick:
        grid = grid[:2]
    print(f"KV-cache decode, {torch.cuda.get_device_name()}, bf16, GQA {NHEADS}/{NHEADS_K}, d {D}, seqlen_q 1")
    print("GB/s of K+V read (us per call): graph replay | plain calls")
    rows = []
    for batch, length in grid:
        r = case(batch, length, quick)
        rows.append((batch, length, r))
        cells = "  ".join(f"{name} {g:6.0f} ({gu:6.1f}) | {p:6.0f} ({pu:6.1f})"
                          for name, (g, p, gu, pu) in r.items())
        print(f"batch {batch:3d} L {length:6d}: {cells}", flush=True)
    host_times()
    if "--splits" in sys.argv:
        split_sweep()
    print("ratio cuflash / cuDNN (graph | plain):")
    for batch, length, r in rows:
        if "cuflash" in r and "cuDNN" in r:
            print(f"  batch {batch:3d} L {length:6d}: {r['cuflash'][0] / r['cuDNN'][0]:5.2f} | "
                  f"{r['cuflash'][1] / r['cuDNN'][1]:5.2f}")


if __name__ == "__main__":
    main()
