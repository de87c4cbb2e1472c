"""Time the KV-cache call under several copies of the kernel sources, side by side in one
process on the GPU machine (A/B of decode kernel changes):

    mkdir -p build/ab/before && git archive HEAD~1 cuflash/cuda | tar -x -C build/ab/before --strip-components=2
    CUFLASH_CACHE_DIR=build/kcache python scripts/decode/decode_ab.py build/ab/before --compile sm_90 [--d 64,128]
    PYTHONPATH=. python scripts/decode/decode_ab.py build/ab/before [--cells 1x4096,1x16384] [--d 128] [--heads-k 8] \
        [--page-size 16]

Each folder holds a copy of ``cuflash/cuda/``; the working tree's own is timed too, as
``here``. Every copy runs on the same caches (``bench --decode``'s rules: caches cycled out
of L2, graph replay), taking turns round by round, for the read-only call, the append call
and the append + rotary + causal call (the serving loop's step), cuDNN beside them.
Microseconds per call, the median of the rounds. The Python side (the planner) is the
working tree's for every copy. ``--compile ARCH`` (no GPU, no torch needed) fills the
kernel cache with every copy's bf16 decode kernels of the given head dims, so that a GPU
run carrying the cache compiles none. Not part of the package.
"""
import argparse
import pathlib
import statistics

from cuflash import _compile, _plan, experiment

ROUNDS = 3


def compile_copies(copies: dict[str, pathlib.Path], arch: str, head_dims: list[int]) -> None:
    """Every copy's bf16 KV-cache split kernels (every kind, band and flag) of these head
    dims, and its merge kernel of bf16 outputs (grids too large for a cluster), into the
    kernel cache."""
    buckets = {_plan.head_dim_bucket(d) for d in head_dims}
    kernels = [k for k in _plan.all_kernels(arch)
               if (isinstance(k, _plan.Kernel) and k.kind.startswith("decode") and k.dtype == "bfloat16"
                   and k.head_dim in buckets) or k == _plan.Merge("float32", "bfloat16")]
    for name, folder in copies.items():
        with experiment.override(sources=folder):
            for kernel in kernels:
                _compile.compile_kernel(kernel.source, kernel.instance, arch)
        print(f"{name}: {len(kernels)} variants in the cache", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="*")
    parser.add_argument("--cells", default="1x4096,1x16384")
    parser.add_argument("--d", default="128", help="head dim (--compile: a comma-separated list)")
    parser.add_argument("--compile", metavar="ARCH", help="only fill the kernel cache, for ARCH (e.g. sm_90)")
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=0)
    args = parser.parse_args()
    copies = {"here": _compile.CUDA_DIR}
    copies.update({pathlib.Path(f).name: pathlib.Path(f).resolve() for f in args.folders})
    if args.compile:
        compile_copies(copies, args.compile, [int(d) for d in args.d.split(",")])
        return
    time_copies(copies, args)


def time_copies(copies: dict[str, pathlib.Path], args) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash.torch
    from cuflash.bench import decode as bench_decode
    from cuflash.bench.timing import graph_and_plain
    d = int(args.d)
    call = cuflash.torch.attention_with_kvcache
    print(f"KV-cache call, GQA {bench_decode.NHEADS}/{args.heads_k}, d {d}, bf16, pages {args.page_size or '-'}, "
          "graph replay: us a call")
    print(f"{'cell':>12} {'call':>16} " + " ".join(f"{name:>10}" for name in (*copies, "cudnn")))
    for cell in args.cells.split(","):
        batch, length = map(int, cell.split("x"))
        caches, table, _ = bench_decode.cycled_caches(torch, batch, length, args.heads_k, d, args.page_size)
        dense = caches if table is None else bench_decode.cycled_caches(torch, batch, length, args.heads_k, d)[0]
        q, new_k, new_v, full, before, cos, sin = bench_decode.step_inputs(torch, batch, length, args.heads_k, d)
        variants = {
            "read only": lambda k, v: call(q, k, v, cache_seqlens=full, block_table=table),
            "append": lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before, block_table=table),
            "append+rotary": lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before, block_table=table,
                                               rotary_cos=cos, rotary_sin=sin, causal=True),
        }
        views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in dense]  # (SDPA: contiguous)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn, _ = graph_and_plain(torch, [
                lambda k=k, v=v: sdpa(q.transpose(1, 2), k, v, enable_gqa=args.heads_k != bench_decode.NHEADS)
                for k, v in views])
        for label, run in variants.items():
            times = {name: [] for name in copies}
            for _ in range(ROUNDS):
                for name, folder in copies.items():
                    with experiment.override(sources=folder):  # (cubins are cached under their source's key)
                        us, _ = graph_and_plain(torch, [lambda k=k, v=v: run(k, v) for k, v in caches])
                    times[name].append(us)
            print(f"{cell:>12} {label:>16} " + " ".join(f"{statistics.median(t):10.2f}" for t in times.values())
                  + f" {cudnn:10.2f}", flush=True)
        caches.clear()
        dense.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
