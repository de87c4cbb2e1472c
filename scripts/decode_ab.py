"""Time the KV-cache call under several copies of the kernel sources, side by side in one
process on the GPU machine (A/B of decode kernel changes):

    mkdir -p build/ab/before && git archive HEAD~1 cuflash/cuda | tar -x -C build/ab/before --strip-components=2
    PYTHONPATH=. python scripts/decode_ab.py build/ab/before [--cells 1x4096,1x16384] [--d 128] [--heads-k 8] \
        [--page-size 16]

Each folder holds a copy of ``cuflash/cuda/``; the working tree's own is timed too, as
``here``. Every copy runs on the same caches (``bench --decode``'s rules: caches cycled out
of L2, graph replay), taking turns round by round, for the read-only call, the append call
and the append + rotary + causal call (the serving loop's step), cuDNN beside them.
Microseconds per call, the median of the rounds. The Python side (the planner) is the
working tree's for every copy. Not part of the package.
"""
import argparse
import pathlib
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash.torch
from cuflash import _compile, _kernels, bench_decode, kvcache

ROUNDS = 3


def sources_of(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.cu*"))}


def use(sources: dict[str, bytes]) -> None:
    """Launch from these sources from now on (cubins are cached under their source's key)."""
    _compile._sources = lambda: sources
    _compile.load_kernel.cache_clear()
    _kernels._function.cache_clear()  # (the loaded functions, by kernel variant)
    _kernels._resident_ctas.cache_clear()
    _kernels._launchers.clear()
    kvcache._warm.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--cells", default="1x4096,1x16384")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=0)
    args = parser.parse_args()
    copies = {"here": _compile._sources()}
    copies.update({pathlib.Path(f).name: sources_of(pathlib.Path(f)) for f in args.folders})
    call = cuflash.torch.attention_with_kvcache
    print(f"KV-cache call, GQA {bench_decode.NHEADS}/{args.heads_k}, d {args.d}, bf16, pages {args.page_size or '-'}, "
          "graph replay: us a call")
    print(f"{'cell':>12} {'call':>16} " + " ".join(f"{name:>10}" for name in (*copies, "cudnn")))
    for cell in args.cells.split(","):
        batch, length = map(int, cell.split("x"))
        caches, table, _ = bench_decode.cycled_caches(torch, batch, length, args.heads_k, args.d, args.page_size)
        dense = caches if table is None else bench_decode.cycled_caches(torch, batch, length, args.heads_k, args.d)[0]
        q, new_k, new_v, full, before, cos, sin = bench_decode.step_inputs(torch, batch, length, args.heads_k, args.d)
        variants = {
            "read only": lambda k, v: call(q, k, v, cache_seqlens=full, block_table=table),
            "append": lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before, block_table=table),
            "append+rotary": lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before, block_table=table,
                                               rotary_cos=cos, rotary_sin=sin, causal=True),
        }
        views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in dense]  # (SDPA: contiguous)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn, _ = bench_decode.graph_and_plain(torch, [
                lambda k=k, v=v: sdpa(q.transpose(1, 2), k, v, enable_gqa=args.heads_k != bench_decode.NHEADS)
                for k, v in views])
        for label, run in variants.items():
            times = {name: [] for name in copies}
            for _ in range(ROUNDS):
                for name, sources in copies.items():
                    use(sources)
                    us, _ = bench_decode.graph_and_plain(torch, [lambda k=k, v=v: run(k, v) for k, v in caches])
                    times[name].append(us)
            print(f"{cell:>12} {label:>16} " + " ".join(f"{statistics.median(t):10.2f}" for t in times.values())
                  + f" {cudnn:10.2f}", flush=True)
        use(copies["here"])
        caches.clear()
        dense.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
