"""Where the sm_90a forward's time goes, tile by tile, on a Hopper GPU:

    PYTHONPATH=. python scripts/sm90/sm90_timeline.py [--calls 128c2048,128n8192,64c2048]

A call is HEAD_DIM, c (causal) or n (no mask), SEQLEN; 16k tokens, 2048 / d heads, bf16
(`ncu_forward.py`'s shapes). The kernel's source is patched in a copy (its cubins are cached
under their own key, the key being the source) so that one thread stamps clock64() at fixed
points of each tile: the producer when it has asked for the tile's Q, consumer 0 when Q has
landed, when its first S, second turn and last turn are issued, when its last P V has landed
and when its output is finished (in registers: written under its next tile's first S, at
d 256 at once), the last consumer when its output is finished; with the CTA's
start (%globaltimer and clock64, which place every CTA on one time axis) and %globaltimer
beside the last store (the rate the CTA's clock ran at), the multiprocessor, the CTA and
the tile's key tiles. Printed per call: the median over tiles of each phase in
microseconds (the CTA's start or its previous tile's last store to Q landed, Q landed to
the first S, the first S to the last P V landed, per key tile, the last P V to the last
store), each multiprocessor's time split into those phases and the time it held no tile,
summed over the grid, and that time split into the gaps between CTAs, before the first
and after the last. Not part of the package.
"""
import argparse
import statistics

import torch

import cuflash
from scripts.common.gpu_clock import stamping

SLOTS = 16
# The record of tile t: SLOTS 64-bit words.
CTA_TIME, CTA_CLOCK, SM, CTA, KEY_TILES = 0, 1, 2, 3, 4
STORED_TIME = 13  # %globaltimer beside "all stored": the rate of the CTA's clock
POINTS = {"q asked": 5, "q landed": 6, "S0 issued": 7, "turn 1": 8, "last turn": 9, "PV landed": 10,
          "stored": 11, "all stored": 12}


def patched(text: str, address: int) -> str:
    """sm90/fwd.cu with the stamps written in (each anchor must be found once)."""
    record = f"(reinterpret_cast<unsigned long long*>({address}ULL) + (long long)(t) * {SLOTS})"
    trace = (f"#define TRACE_AT(thread, slot) do {{ if (threadIdx.x == (thread)) {record}[slot] = clock64(); }}"
             " while (0)\n")
    edits = [
        ("namespace cuflash {\n", "namespace cuflash {\n" + trace),
        ("  if (threadIdx.x == 0) shared.init_barriers(kConsumers * 128);\n",
         "  unsigned long long trace_time;\n"
         "  unsigned trace_smid;\n"
         "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(trace_time));\n"
         "  const unsigned long long trace_clock = clock64();\n"
         "  asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(trace_smid));\n"
         "  if (threadIdx.x == 0) shared.init_barriers(kConsumers * 128);\n"),
        ("        if (leader) shared.tile() = t, shared.load_q(args, block.q_row(), block.head, block.tma_batch);\n",
         "        if (leader) shared.tile() = t, shared.load_q(args, block.q_row(), block.head, block.tma_batch);\n"
         f"        TRACE_AT(0, {POINTS['q asked']});\n"),
        ("      auto phase_of = [&](int j) { return ((used + j) / kStages) & 1; };\n",
         "      auto phase_of = [&](int j) { return ((used + j) / kStages) & 1; };\n"
         f"      TRACE_AT(128, {POINTS['q landed']});\n"
         f"      if (threadIdx.x == 128) {record}[{CTA_TIME}] = trace_time, {record}[{CTA_CLOCK}] = trace_clock,\n"
         f"          {record}[{SM}] = trace_smid, {record}[{CTA}] = blockIdx.x, {record}[{KEY_TILES}] = tiles;\n"),
        ("        issue_scores<T>(shared, stage_of(0), consumer, acc_s);\n",
         "        issue_scores<T>(shared, stage_of(0), consumer, acc_s);\n"
         f"        TRACE_AT(128, {POINTS['S0 issued']});\n"),
        ("          issue_values<T>(shared, stage_of(j - 1), p_frag, acc_o);\n",
         "          issue_values<T>(shared, stage_of(j - 1), p_frag, acc_o);\n"
         f"          if (j == 1) TRACE_AT(128, {POINTS['turn 1']});\n"
         f"          if (j == tiles - 1) TRACE_AT(128, {POINTS['last turn']});\n"),
        ("        shared.released(Shared::kValues, stage_of(tiles - 1)).arrive();\n",
         "        shared.released(Shared::kValues, stage_of(tiles - 1)).arrive();\n"
         f"        TRACE_AT(128, {POINTS['PV landed']});\n"),
        ("      pending = finish_output<T>(p, block, warp_row0, lane, softmax, acc_o);\n",
         "      pending = finish_output<T>(p, block, warp_row0, lane, softmax, acc_o);\n"
         f"      TRACE_AT(128, {POINTS['stored']});\n"
         f"      TRACE_AT(128 * kConsumers, {POINTS['all stored']});\n"
         f"      if (threadIdx.x == 128 * kConsumers) {{ unsigned long long now;\n"
         f"        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(now)); {record}[{STORED_TIME}] = now; }}\n"),
    ]
    for anchor, replacement in edits:
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, replacement)
    return text


def tiles_of(trace: torch.Tensor, count: int, rate: float) -> list[dict]:
    """Each tile's points in us on the grid's time axis (from its first CTA's start): its
    clock64 stamps at the rate its CTA's clock ran from its start to the tile's last store
    (on %globaltimer; the SM clock runs slower under load than ``rate``, the calibration's
    idle one, e.g. 1.68-1.77 against 1.98 GHz on an H100)."""
    rows = trace[: count * SLOTS].view(count, SLOTS).cpu().tolist()
    rows = [r for r in rows if r[CTA_TIME]]  # (tiles past a packed sequence's end are skipped)
    first = min(r[CTA_TIME] for r in rows)
    tiles = []
    for r in rows:
        start = (r[CTA_TIME] - first) / 1e3
        own = r[STORED_TIME] > r[CTA_TIME] and r[POINTS["all stored"]]
        clock = (r[POINTS["all stored"]] - r[CTA_CLOCK]) / (r[STORED_TIME] - r[CTA_TIME]) if own else rate
        tile = {"cta start": start, "sm": r[SM], "cta": r[CTA], "key tiles": r[KEY_TILES], "clock": clock}
        for name, slot in POINTS.items():
            if r[slot]:
                tile[name] = start + (r[slot] - r[CTA_CLOCK]) / clock / 1e3
        tiles.append(tile)
    return tiles


def summary(label: str, tiles: list[dict]) -> None:
    """Medians of each phase over the tiles, and the multiprocessors' time split."""
    by_cta = {}
    tiles = [t for t in tiles if "PV landed" in t]  # (a tile whose rows see no key has no products)
    for tile in sorted(tiles, key=lambda x: x["q landed"]):
        by_cta.setdefault((tile["sm"], tile["cta"]), []).append(tile)
    phases = {"to Q": [], "Q to S0": [], "S0 to last PV": [], "a key tile": [], "output": []}
    for run in by_cta.values():
        before = run[0]["cta start"]
        for tile in run:
            phases["to Q"].append(tile["q landed"] - before)
            phases["Q to S0"].append(tile["S0 issued"] - tile["q landed"])
            phases["S0 to last PV"].append(tile["PV landed"] - tile["S0 issued"])
            phases["a key tile"].append((tile["PV landed"] - tile["S0 issued"]) / max(1, tile["key tiles"]))
            phases["output"].append(tile["all stored"] - tile["PV landed"])
            before = tile["all stored"]
    end = max(t["all stored"] for t in tiles)
    sms = {t["sm"] for t in tiles}
    split = {"to Q": sum(phases["to Q"]), "Q to S0": sum(phases["Q to S0"]),
             "S0 to last PV": sum(phases["S0 to last PV"]), "output": sum(phases["output"])}
    held = sum(split.values())
    print(f"{label}: {len(tiles)} tiles on {len(by_cta)} CTAs, {len(sms)} multiprocessors, "
          f"{end:.1f} us; key tiles a tile median {statistics.median(t['key tiles'] for t in tiles)}")
    print("  median us: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in phases.items()))
    print("  multiprocessor time: " + ", ".join(f"{k} {v / (len(sms) * end):.1%}" for k, v in split.items())
          + f", without a tile {1 - held / (len(sms) * end):.1%}")
    # Where a multiprocessor holds no tile: between one CTA's last store and the next CTA's
    # start on it, before its first CTA, after its last store.
    gaps, before, after = [], [], []
    for sm in sms:
        runs = sorted((run for (where, _), run in by_cta.items() if where == sm), key=lambda r: r[0]["cta start"])
        gaps += [b[0]["cta start"] - a[-1]["all stored"] for a, b in zip(runs, runs[1:])]
        before.append(runs[0][0]["cta start"])
        after.append(end - runs[-1][-1]["all stored"])
    print(f"  without a tile: CTA to CTA median {statistics.median(gaps) if gaps else 0:.2f} us "
          f"({sum(gaps) / (len(sms) * end):.1%}), before the first {sum(before) / (len(sms) * end):.1%}, "
          f"after the last {sum(after) / (len(sms) * end):.1%} (mean {statistics.mean(after):.1f} us, "
          f"max {max(after):.1f}); SM clock median {statistics.median(t['clock'] for t in tiles):.3f} GHz", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", default="128c2048,128n8192,128c8192,64c2048")
    args = parser.parse_args()
    with stamping("sm90/fwd.cu", patched, SLOTS * (1 << 18)) as (trace, rate):
        print("(each CTA's stamps go at its own rate)")
        for call in args.calls.split(","):
            d, causal = int(call.split("c")[0].split("n")[0]), "c" in call
            seqlen = int(call.replace("c", "n").split("n")[1])
            q, k, v = (torch.randn(max(1, 16384 // seqlen), seqlen, 2048 // d, d, device="cuda",
                                   dtype=torch.bfloat16) for _ in "qkv")
            for i in range(4):  # the last of four calls
                trace.zero_()
                cuflash.attention(q, k, v, causal=causal)
                torch.cuda.synchronize()
            count = int(trace.view(-1, SLOTS)[:, CTA_TIME].nonzero().max()) + 1
            summary(f"d {d} {'causal' if causal else 'no mask'} {seqlen}", tiles_of(trace, count, rate))


if __name__ == "__main__":
    main()
