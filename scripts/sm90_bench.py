"""The sm_90a forward (cuflash/_sm90.py) beside the mma.sync forward and torch SDPA's cuDNN
and flash backends, d 128, on the same arrays: TFLOP/s, CUDA events, median of 5 rounds
after a warm-up (bench's timing rules).

    PYTHONPATH=. python scripts/sm90_bench.py [--dtype float16] [--batch-tokens 16384]
"""
import argparse

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash
from cuflash import _sm90, bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--batch-tokens", type=int, default=16384, help="batch x seqlen of every cell")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    heads, d = 16, 128
    columns = ("sm90-ws", "sm90", "mma.sync", "sdpa-cudnn", "sdpa-flash")
    print(f"forward, d {d}, {heads} heads, {args.dtype}, TFLOP/s; sm90/cuDNN last")
    print(f"{'seqlen':>6} {'causal':>6} " + " ".join(f"{c:>11}" for c in columns) + f" {'ws/cudnn':>9}")
    for seqlen in (1024, 2048, 4096, 8192, 16384):
        batch = max(1, args.batch_tokens // seqlen)
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
            cq, ck, cv = (cupy.from_dlpack(x.view(torch.int16)).view(cupy.float16) for x in (q, k, v))
            if args.dtype == "bfloat16":  # (the launch reads the dtype from the array: a bfloat16 view)
                import ml_dtypes
                cq, ck, cv = (x.view(ml_dtypes.bfloat16) for x in (cq, ck, cv))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            calls = {
                "sm90-ws": lambda: _sm90.forward(cq, ck, cv, causal=causal, specialised=True),
                "sm90": lambda: _sm90.forward(cq, ck, cv, causal=causal, specialised=False),
                "mma.sync": lambda: cuflash.attention(cq, ck, cv, causal=causal),
            }
            ms = bench._median_ms_each(calls, torch)
            for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    ms[name] = bench._median_ms(lambda: sdpa(qt, kt, vt, is_causal=causal), torch)
            flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
            tflops = {name: flops / (t * 1e9) for name, t in ms.items()}
            print(f"{seqlen:6d} {str(causal):>6} " + " ".join(f"{tflops[c]:11.1f}" for c in columns)
                  + f" {tflops['sm90-ws'] / tflops['sdpa-cudnn']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
