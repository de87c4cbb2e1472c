"""Where a KV-cache call's time goes (GQA 32/8, d 128, bf16, caches cycled as in
``bench --decode``), on the GPU machine:

    PYTHONPATH=. python scripts/decode/decode_profile.py [--cells 1x4096,16x4096]

For each cell: the graph-replay time per call of each variant (read only, append, append +
rotary + causal, pages of 16, a contiguous call with the pages' split count, cuDNN), and the
kernels each one launches with their mean duration (torch.profiler over the replays); then
the floor for the same bytes: an empty kernel and the fastest plain streaming read of the
K+V bytes (128-bit loads, several grid sizes), replayed from a CUDA graph the same way.
Not part of the package.
"""
import argparse
import collections

import cupy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.profiler import ProfilerActivity, profile

import cuflash.torch
from cuflash import _plan
from cuflash.bench import decode as bench_decode, timing

READ = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, unsigned* out) {
  // Each thread 8 independent 16-byte loads in flight a step.
  unsigned acc = 0;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 8 * step) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = i + j * step < n ? __ldcs(p + i + j * step) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
extern "C" __global__ void empty(unsigned* out) { if (threadIdx.x == 1024) out[0] = 0; }
"""


def kernels_of(calls) -> dict:
    """Mean GPU time (us) of each kernel the zero-argument calls launch, graph-replayed."""
    graph = torch.cuda.CUDAGraph()
    for call in calls:
        call()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]].append(e.device_time)
    return {name: (len(t) / (10 * len(calls)), sum(t) / len(t)) for name, t in times.items()}


def floor(kv_bytes: int, copies: int) -> dict:
    module = cupy.RawModule(code=READ)
    read, empty = module.get_function("stream_read"), module.get_function("empty")
    buffers = [cupy.empty(kv_bytes // 16 * 4, dtype=cupy.uint32) for _ in range(copies)]
    out = cupy.zeros(1, dtype=cupy.uint32)
    result = {}
    runs = {"empty kernel": [lambda: empty((1,), (32,), (out,))] * copies}
    for ctas in (132, 264, 528, 1056, 2112):
        n = kv_bytes // 16
        runs[f"read {ctas} x 256"] = [lambda b=b, c=ctas: read((c,), (256,), (b, cupy.int64(n), out)) for b in buffers]
    stream = cupy.cuda.Stream(non_blocking=True)
    for name, calls in runs.items():
        with stream:
            for call in calls:
                call()
            stream.synchronize()
            stream.begin_capture()
            for call in calls:
                call()
            graph = stream.end_capture()
            graph.launch()
            times = []
            for _ in range(timing.ROUNDS):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                graph.launch()
                end.record()
                end.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / len(calls))
        result[name] = sorted(times)[len(times) // 2]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", default="1x4096,16x4096")
    args = parser.parse_args()
    for cell in args.cells.split(","):
        batch, length = map(int, cell.split("x"))
        caches, _, kv_bytes = bench_decode.cycled_caches(torch, batch, length, 8, 128)
        paged, table, _ = bench_decode.cycled_caches(torch, batch, length, 8, 128, 16)
        q, new_k, new_v, full, before, cos, sin = bench_decode.step_inputs(torch, batch, length, 8, 128)
        page_splits = _plan.decode_splits(batch * 8, length // 64, torch.cuda.get_device_properties(0)
                                          .multi_processor_count, small_pages=True)
        call = cuflash.torch.attention_with_kvcache
        variants = {
            "read only": [lambda k=k, v=v: call(q, k, v, cache_seqlens=full) for k, v in caches],
            "append": [lambda k=k, v=v: call(q, k, v, new_k, new_v, cache_seqlens=before) for k, v in caches],
            "append + rotary, causal": [
                lambda k=k, v=v: call(q, k, v, new_k, new_v, cache_seqlens=before, rotary_cos=cos, rotary_sin=sin,
                                      causal=True) for k, v in caches],
            "pages of 16": [lambda k=k, v=v: call(q, k, v, cache_seqlens=full, block_table=table) for k, v in paged],
            f"contiguous, {page_splits} splits": [
                lambda k=k, v=v: call(q, k, v, cache_seqlens=full, num_splits=page_splits) for k, v in caches],
        }
        views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in caches]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = [lambda k=k, v=v: sdpa(q.transpose(1, 2), k, v, enable_gqa=True) for k, v in views]
            us, _ = timing.graph_and_plain(torch, cudnn)
            print(f"batch {batch} L {length} {'cuDNN':>28}: {us:6.2f} us {kv_bytes / (us * 1e3):6.0f} GB/s")
            for name, (count, mean) in kernels_of(cudnn).items():
                print(f"{'':>40} {count:.0f} x {mean:6.2f} us  {name}")
        for label, calls in variants.items():
            us, _ = timing.graph_and_plain(torch, calls)
            print(f"batch {batch} L {length} {label:>28}: {us:6.2f} us {kv_bytes / (us * 1e3):6.0f} GB/s")
            for name, (count, mean) in kernels_of(calls).items():
                print(f"{'':>40} {count:.0f} x {mean:6.2f} us  {name}")
        for name, us in floor(kv_bytes, len(caches)).items():
            print(f"batch {batch} L {length} {name:>28}: {us:6.2f} us {kv_bytes / (us * 1e3):6.0f} GB/s", flush=True)
        caches.clear()
        paged.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
