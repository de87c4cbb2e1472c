"""Where a call's GPU time goes, kernel by kernel, beside SDPA's flash and cuDNN backends
(torch profiler).

    PYTHONPATH=. python scripts/common/kernel_times.py 512,1024 64,128 0,1 1    # seqlens, head dims, causal, backward

bf16 on the bench grid's shapes (bench.TOKENS, bench.HIDDEN). For each implementation:
the mean device time of every kernel per call, their sum, and the event-timed median of
the whole call (bench._median_ms_each): a sum well below the call's time means the GPU
waited on the host or on gaps between kernels.
"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cuflash import bench

CALLS = 20


def kernel_us(fn) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time / CALLS
    return dict(total)


def main() -> None:
    seqlens, dims, causals = (list(map(int, a.split(","))) for a in sys.argv[1:4])
    backward = sys.argv[4] == "1"
    for d in dims:
        for causal in map(bool, causals):
            for s in seqlens:
                b, h = bench.TOKENS // s, bench.HIDDEN // d
                impls = bench._implementations(torch, b, s, h, d, causal, backward)
                impls = {name: impls[name] for name in ("cuflash", "sdpa-flash", "sdpa-cudnn") if name in impls}
                call_ms = bench._median_ms_each(impls, torch)
                print(f"d {d} causal {causal} seqlen {s} (batch {b}, heads {h}), {'fwd+bwd' if backward else 'fwd'}")
                for name, fn in impls.items():
                    kernels = kernel_us(fn)
                    print(f"  {name}: call {call_ms[name] * 1e3:8.1f} us, kernels {sum(kernels.values()):8.1f} us")
                    for kernel, us in sorted(kernels.items(), key=lambda item: -item[1]):
                        print(f"    {us:8.1f}  {kernel[:110]}")
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
