"""A per-CTA timeline of the KV-cache decode kernel (GQA 32/8, d 128, bf16, caches cycled
as in ``bench --decode``), on the GPU machine:

    PYTHONPATH=. python scripts/decode/decode_timeline.py [--cells 1x4096,16x4096]

The kernel's source is patched in a copy (its cubins are cached under their own key, the
key being the source) so that thread 0 of every CTA writes clock64() at fixed points: its
start, its lengths read, Q's copy issued, the part loop entered, the first part's loads
issued, q rotated, each key tile landed (every thread's copies, past the barrier) and
done, the part's last tile issued, the new rows written into the cache, the part's
result written, the cluster's barrier passed, in the cluster merge of a row its LSEs
read, its weights, its O summed and stored (points that wait for their loads: they add
to the merge's time), every CTA of its cluster started (before its rows go to their
merging CTAs), its end (and %globaltimer at start and end, which
places the CTAs on one time axis). Printed per variant (read only; read only after one
element of every 2 MB of the caches was read, which warms their address translations and
leaves nearly all their bytes in memory; read only on one cache every call, whose last
bytes read stay in L2 but not its first past 50 MB; append, append + causal, append +
rotary + causal, pages of 16 shuffled and in order): the median and the slowest CTA's
times of each point from the kernel's first CTA start, in microseconds, so that one sees
which step a variant's extra time sits in. Not part of the package.
"""
import argparse
import statistics

import torch

import cuflash.torch
from cuflash.bench import decode as bench_decode
from scripts.common.gpu_clock import stamping

SLOTS = 48
POINTS = {"seq": 2, "q issued": 40, "loop": 41, "issued": 3, "q ready": 4, "part": 5, "cluster": 6,
          "lse read": 42, "weighed": 43, "summed": 44, "stored": 45, "started": 33, "end": 7,
          "last issued": 47, "appended": 46}
TILE0, TILES = 8, 12  # slots TILE0 + 2i (tile i landed), TILE0 + 2i + 1 (tile i done); 32: blockIdx.x;
# 39: %globaltimer at the end


def patched(text: str, address: int) -> str:
    """split_kv.cu with the trace points written in (each anchor must be found once)."""
    trace = (f"#define TRACE_AT(slot) do {{ if (threadIdx.x == 0) reinterpret_cast<unsigned long long*>({address}ULL)"
             f"[(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * {SLOTS} + (slot)] = clock64(); }}"
             " while (0)\n"
             "#define TRACE_TIME(slot) do { unsigned long long t_; asm volatile(\"mov.u64 %0, %%globaltimer;\" : "
             f"\"=l\"(t_)); if (threadIdx.x == 0) reinterpret_cast<unsigned long long*>({address}ULL)"
             f"[(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * {SLOTS} + (slot)] = t_; }}"
             " while (0)\n")
    edits = [
        ("namespace cuflash {\n", "namespace cuflash {\n" + trace),
        ("  const Rotary rotary = Rotary::of(p);\n",
         "  TRACE_TIME(0); TRACE_AT(1);\n  if (threadIdx.x == 0) reinterpret_cast<unsigned long long*>("
         f"{address}ULL)[(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * {SLOTS} + 32] = "
         "blockIdx.x + 1;\n  const Rotary rotary = Rotary::of(p);\n"
         # a use of seq.end that the compiler cannot drop: slot 2 is stamped after the lengths land
         "  if (seq.end == -7) p.o.ptr[0] = DType<T>::from_float(0.f); TRACE_AT(2);\n"),
        ("  LoadPipeline::commit();\n  const int q_rows", "  LoadPipeline::commit();\n  TRACE_AT(40);\n  const int q_rows"),
        ("  bool q_rotated = false;\n", "  bool q_rotated = false;\n  TRACE_AT(41);\n"),
        ("      const float lse = lane < ranks ? inbox_lse[first + lane] : kInf;\n",
         "      const float lse = lane < ranks ? inbox_lse[first + lane] : kInf;\n"
         "      if (lse == 12345.f) p.o.ptr[1] = DType<T>::from_float(0.f); TRACE_AT(42);\n"),
        ("      const float scale = merge.out_scale(), row_lse = merge.lse();\n",
         "      const float scale = merge.out_scale(), row_lse = merge.lse();\n      TRACE_AT(43);\n"),
        ("#pragma unroll\n        for (int e = 0; e < 4 && c + e < p.headdim; ++e) store_result(row0 + r, c + e, o[e] * scale, row_lse);\n",
         "        if (o[0] == 12345.f) p.o.ptr[2] = DType<T>::from_float(0.f); TRACE_AT(44);\n"
         "#pragma unroll\n        for (int e = 0; e < 4 && c + e < p.headdim; ++e) store_result(row0 + r, c + e, o[e] * scale, row_lse);\n"
         "        TRACE_AT(45);\n"),
        ("      if (n + kStages - 1 < n_end) issue(n + kStages - 1, (i + kStages - 1) % kStages, false);\n",
         "      if (n + kStages - 1 < n_end) issue(n + kStages - 1, (i + kStages - 1) % kStages, false);\n"
         "      if (part == split && n + kStages == n_end) TRACE_AT(47);\n"),
        ("        append(t0, stage, new_begin, new_end);\n",
         "        append(t0, stage, new_begin, new_end);\n        TRACE_AT(46);\n"),
        ("    constexpr int kItems = ", "    if (part == split) TRACE_AT(3);\n    constexpr int kItems = "),
        ("    float acc_o[1][kDTiles][4] = {};\n", "    if (part == split) TRACE_AT(4);\n"
         "    float acc_o[1][kDTiles][4] = {};\n"),
        ("LoadPipeline::wait<kStages - 1>();  // tile n (and with the first, Q) has landed\n",
         "LoadPipeline::wait<kStages - 1>();\n"
         f"      if (part == split && i < {TILES}) TRACE_AT({TILE0} + 2 * i);\n"),
        ("LoadPipeline::release();  // the next issue overwrites this stage\n",
         "LoadPipeline::release();\n"
         f"      if (part == split && i < {TILES}) TRACE_AT({TILE0} + 2 * i + 1);\n"),
        ("__syncthreads();  // the next part's loads overwrite the warps' results\n",
         "__syncthreads();\n    if (part == split) TRACE_AT(5);\n"),
        ("cluster::wait();  // every CTA started\n", "cluster::wait();\n    TRACE_AT(33);\n"),
        ("cluster::sync();  // every CTA's rows in their inboxes\n", "cluster::sync();\n    TRACE_AT(6);\n"),
        ("\n}\n\n}  // namespace cuflash", "\n  TRACE_AT(7); TRACE_TIME(39);\n}\n\n}  // namespace cuflash"),
    ]
    for anchor, replacement in edits:
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, replacement)
    return text


def timeline(trace, ctas: int, rate: float) -> list[dict]:
    """Each CTA's points in us from the first CTA's start."""
    t = trace[: ctas * SLOTS].view(ctas, SLOTS).cpu().tolist()
    first = min(row[0] for row in t)
    rows = []
    for row in t:
        start_us = (row[0] - first) / 1e3
        at = {"start": start_us, "x": row[32] - 1}
        for name, slot in POINTS.items():
            if row[slot]:
                at[name] = start_us + (row[slot] - row[1]) / rate / 1e3
        for i in range(TILES):
            for what, slot in (("landed", TILE0 + 2 * i), ("done", TILE0 + 2 * i + 1)):
                if row[slot]:
                    at[f"t{i} {what}"] = start_us + (row[slot] - row[1]) / rate / 1e3
        rows.append(at)
    return rows


def summary(label: str, runs: list[list[dict]]) -> None:
    """Each point's median and latest over the CTAs (each the median over runs), and the
    grid x (split) of the CTA whose part ends last."""
    names = [n for n in ("start", *POINTS, *(f"t{i} {w}" for i in range(TILES) for w in ("landed", "done")))
             if all(any(n in cta for cta in run) for run in runs)]
    med = {n: statistics.median(statistics.median(cta[n] for cta in run if n in cta) for run in runs) for n in names}
    late = {n: statistics.median(max(cta[n] for cta in run if n in cta) for run in runs) for n in names}
    slowest = [max(run, key=lambda c: c.get("part", 0))["x"] for run in runs]
    print(f"{label}: last CTA ends at {late['end']:.2f} us; latest part in grid x {slowest}")
    print("   " + " ".join(f"{n[:9]:>9}" for n in names))
    print("med" + " ".join(f"{med[n]:9.2f}" for n in names))
    print("max" + " ".join(f"{late[n]:9.2f}" for n in names), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", default="1x4096,16x4096")
    args = parser.parse_args()
    with stamping("decode/split_kv.cu", patched, SLOTS * (1 << 16)) as (trace, rate):
        for cell in args.cells.split(","):
            batch, length = map(int, cell.split("x"))
            caches, _, _ = bench_decode.cycled_caches(torch, batch, length, 8, 128)
            paged, table, _ = bench_decode.cycled_caches(torch, batch, length, 8, 128, 16)
            in_order = torch.arange(table.numel(), device="cuda", dtype=torch.int32).reshape(table.shape)
            ordered = [tuple(c.reshape(-1, 16, 8, 128) for c in pair) for pair in caches]  # page j of b: its rows
            q, new_k, new_v, full, before, cos, sin = bench_decode.step_inputs(torch, batch, length, 8, 128)
            call = cuflash.torch.attention_with_kvcache
            def touched(k, v):  # one element of every 2 MB of the caches read first: their address
                for x in (k, v):   # translations warm, nearly none of their bytes in L2
                    x.view(-1)[::(2 << 20) // x.element_size()].sum()
                return call(q, k, v, cache_seqlens=full)

            variants = {
                "read only": (caches, lambda k, v: call(q, k, v, cache_seqlens=full)),
                "read only, 2 MB strides touched first": (caches, touched),
                "read only, one cache every call": ([caches[0]] * len(caches),
                                                    lambda k, v: call(q, k, v, cache_seqlens=full)),
                "append": (caches, lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before)),
                "append, causal": (caches, lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before,
                                                             causal=True)),
                "append + rotary, causal": (caches, lambda k, v: call(q, k, v, new_k, new_v, cache_seqlens=before,
                                                                      rotary_cos=cos, rotary_sin=sin, causal=True)),
                "pages of 16, shuffled": (paged, lambda k, v: call(q, k, v, cache_seqlens=full, block_table=table)),
                "pages of 16, in order": (ordered, lambda k, v: call(q, k, v, cache_seqlens=full,
                                                                     block_table=in_order)),
            }
            for label, (pairs, run) in variants.items():
                runs = []
                for _ in range(3):
                    for k, v in pairs:
                        trace.zero_()
                        run(k, v)
                        torch.cuda.synchronize()
                        ctas = int((trace.view(-1, SLOTS)[:, 0] != 0).sum())
                        runs.append(timeline(trace, ctas, rate))
                summary(f"batch {batch} L {length} {label} ({len(runs[0])} CTAs)", runs[2:])
            caches.clear()
            paged.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
