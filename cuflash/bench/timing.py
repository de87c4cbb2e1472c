"""The bench's clocks: CUDA events around calls taken in balanced turns, the median of many;
CUDA graph replay against plain calls; the host's time of calls issued back to back.

Every function takes ``torch`` as an argument: the bench imports it only once it has
found a GPU (and tests pass a stand-in)."""
from __future__ import annotations

import statistics
import time

WARMUP, REPEATS = 5, 30  # median_ms_each: warm-up calls, then at least this many timed rounds
ROUNDS = 5  # median_us: timed rounds
WARMUP_SECONDS = 0.1  # graph_and_plain: passes over the calls before timing


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n callables, one a round, in which every callable comes right after every
    other equally often (a Williams design: 0, 1, n-1, 2, n-2, ... shifted by the round,
    with the reversed rows too where n is odd). Rotating one order is not enough: each
    callable would always follow the same one."""
    base = [0]
    for i in range(1, n):
        base.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(x + r) % n for x in base] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def median_ms_each(fns: dict, torch) -> dict:
    """name -> median ms of each zero-argument callable, the callables taking turns in
    orders that balance which one runs right before each (at least REPEATS rounds, a whole
    number of the design's orders), so that drifting clocks, and whatever the previous call
    leaves behind (a cuDNN call's power draw), weigh on every one alike."""
    for _ in range(WARMUP):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    items = list(fns.items())
    orders = balanced_orders(len(items))
    rounds = -(-REPEATS // len(orders)) * len(orders)
    for i in range(rounds):
        for name, fn in (items[j] for j in orders[i % len(orders)]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def median_ms(fn, torch) -> float:
    return median_ms_each({"fn": fn}, torch)["fn"]


def median_us(torch, run, calls: int) -> float:
    """One call's time: the median over ROUNDS of ``run()`` (``calls`` calls) by CUDA events."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def graph_and_plain(torch, calls: list) -> tuple[float, float]:
    """(graph replay, plain) microseconds per call of the zero-argument ``calls``, run in turn,
    after WARMUP_SECONDS of passes over them (at least three): the first passes over newly allocated caches of
    several GB read up to 13% slower (H200, batch 64, 16k keys: 3,991-4,010 GB/s for the
    first measured call, 4,594-4,609 for the same call measured again, contiguous or paged)."""
    def plain():
        for call in calls:
            call()
    start, passes = time.perf_counter(), 0
    while passes < 3 or time.perf_counter() - start < WARMUP_SECONDS:
        plain()
        torch.cuda.synchronize()
        passes += 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plain()
    return median_us(torch, graph.replay, len(calls)), median_us(torch, plain, len(calls))


def host_us(torch, fn) -> float:
    """Host time of one call of ``fn``: warmed up, then the median over 5 rounds of 1000
    calls issued back to back (their GPU work shorter than their host time), synchronising
    between rounds."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(1000):
            fn()
        per_call.append((time.perf_counter() - start) * 1e3)  # us per call
        torch.cuda.synchronize()
    return statistics.median(per_call)
