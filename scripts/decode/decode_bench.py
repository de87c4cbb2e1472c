"""The KV-cache call on decode shapes beside torch SDPA's cuDNN and flash backends, with the
figures kernel work asks for beyond ``python -m cuflash bench --decode`` (its timing rules):

    PYTHONPATH=. python scripts/decode/decode_bench.py [--quick] [--splits] [--profile]

The table: GQA 32/8, d 128, contiguous caches, bench --decode's grid; then the host time
of a warm call; --splits: batch 1 by num_splits; --profile: cProfile of a warm call.
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash.torch
from cuflash.bench import decode as bench_decode, timing

NHEADS, NHEADS_K, D = 32, 8, 128


def median_us(run, calls: int) -> float:
    return timing.median_us(torch, run, calls)


def host_times() -> None:
    """Host time per call (perf_counter over 1000 calls issued back to back; their GPU work
    is shorter), batch 1, L 4096, one new token appended with rotary."""
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
            print(f"{name:>34}: {timing.host_us(torch, call):6.1f} us")
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
    grid = bench_decode.QUICK_GRID if quick else bench_decode.GRID
    print(f"KV-cache decode, {torch.cuda.get_device_name()}, bf16, GQA {NHEADS}/{NHEADS_K}, d {D}, seqlen_q 1")
    print("GB/s of K+V read: graph replay | plain calls")
    rows = []
    for batch, length in grid:
        r = bench_decode.cell(torch, batch, length, NHEADS_K, D, "contiguous")
        rows.append((batch, length, r))
        cells = "  ".join(f"{name} {r[name]:6.0f} | {r[name + '-plain']:6.0f}" for name in
                          ("cuflash", "sdpa-cudnn", "sdpa-flash") if name in r)
        print(f"batch {batch:3d} L {length:6d}: {cells}  append {r['append']:6.0f}", flush=True)
    host_times()
    if "--splits" in sys.argv:
        split_sweep()
    print("ratio cuflash / cuDNN (graph | plain):")
    for batch, length, r in rows:
        if "sdpa-cudnn" in r:
            print(f"  batch {batch:3d} L {length:6d}: {r['cuflash'] / r['sdpa-cudnn']:5.2f} | "
                  f"{r['cuflash-plain'] / r['sdpa-cudnn-plain']:5.2f}")


if __name__ == "__main__":
    main()
