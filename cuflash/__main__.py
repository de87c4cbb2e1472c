"""Command line: python -m cuflash {demo,compile,cache,bench,plot}."""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import logging
import os
import signal
import sys
import textwrap
import time

DESCRIPTION = "cuflash: exact FlashAttention as CUDA C++ kernels, compiled by NVRTC at first use."
EXAMPLES = """\
examples:
  python -m cuflash demo                       one checked attention call, GPU or CPU
  python -m cuflash compile --arch sm_90       build every kernel variant ahead of time (no GPU needed)
  python -m cuflash cache verify               check the kernel cache, removing bad entries
  python -m cuflash bench --quick --compare    TFLOP/s beside torch SDPA's flash and cuDNN backends
"""


def demo(args) -> int:
    """Run one attention on the GPU if there is one, else on the NumPy path,
    check it against the float64 reference and say which ran."""
    import numpy as np
    import cuflash
    from cuflash.reference import attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 300, 4, 64)).astype(np.float32) for _ in range(3))
    ref, _ = attention_reference(q, k, v, causal=True)
    backend = "NumPy CPU path (no GPU found)"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            backend = f"CUDA kernel on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    except Exception:
        pass
    if backend.startswith("CUDA"):
        out = cupy.asnumpy(cuflash.attention(*(cupy.asarray(x, dtype=cupy.float16) for x in (q, k, v)), causal=True))
    else:
        out = cuflash.attention(q, k, v, causal=True)
    err = float(np.abs(out.astype(np.float64) - ref).max())
    print(f"cuflash {cuflash.__version__}: causal attention (2, 300, 4, 64) on the {backend}; "
          f"max |out - float64 reference| = {err:.2e}")
    return 0 if err < 1e-2 else 1


def compile_all(args) -> int:
    """Compile every kernel variant (or --sample's, or those --only names) for each arch
    (no GPU needed) and print what ptxas reports; fails if any variant fails to compile
    or spills (--allow-spills). Progress goes to stderr, the table to stdout."""
    from cuflash import _compile, _plan

    if args.sample:
        jobs = _plan.covering_sample(tuple(args.arch))
    else:
        jobs = [(arch, kernel) for arch in args.arch for kernel in _plan.all_kernels(arch)]
    jobs = [(arch, kernel) for arch, kernel in jobs if args.only is None or args.only in kernel.instance]
    if not jobs:
        print(f"python -m cuflash compile: no variant's name contains {args.only!r}", file=sys.stderr)
        return 2
    progress = _Progress(len(jobs))
    # NVRTC holds the GIL: compile in processes.
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs, initializer=_quiet_worker)
    futures = []
    finished = False
    try:
        for arch, kernel in jobs:
            futures.append(pool.submit(_compile.compile_kernel, kernel.source, kernel.instance, arch, refresh=True))
        for future in concurrent.futures.as_completed(futures):
            future.result()  # the first failure ends the run
            progress.step()
        finished = True
    finally:
        # After Ctrl-C or a failure, drop the queued variants (here: shutdown's
        # cancel_futures misses them once the pool object is gone); those under way
        # finish, each entry written whole, while this process exits. After a whole
        # run, wait for the idle workers: a pool left running races the interpreter's
        # exit and can print an ignored exception from its manager thread.
        if not finished:
            for future in futures:
                future.cancel()
        pool.shutdown(wait=finished)
        progress.end()
    spilled = 0
    print(f"{'arch':6} {'regs':>4} {'smem KiB':>8} {'spill B':>7}  variant")
    for (arch, kernel), future in zip(jobs, futures):
        r = future.result().resources
        spill = r.spill_stores + r.spill_loads
        spilled += spill > 0
        print(f"{arch:6} {r.registers:4d} {kernel.shared_bytes / 1024:8.1f} {spill:7d}  {kernel.instance}")
    print(f"{len(jobs)} variants compiled, {spilled} spill")
    return 1 if spilled and not args.allow_spills else 0


def _quiet_worker() -> None:
    """A compile worker ignores Ctrl-C (the main process drops the queued work, and an
    idle worker would die of it with a traceback) and logs no line per variant (the
    progress line stands for them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("cuflash").setLevel(logging.WARNING)


class _Progress:
    """Variants done of the total, their rate and the time left, on stderr: one line
    redrawn in place on a terminal; in a log, a line per tenth of the work or per 10 s."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()
        self.start = self.shown_at = time.monotonic()
        self.shown_done = 0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        rate = self.done / max(now - self.start, 1e-6)
        line = f"{self.done}/{self.total} variants, {rate:.1f}/s, {_minutes((self.total - self.done) / rate)} left"
        if self.tty:
            print(f"\r{line:<60}", end="", file=sys.stderr, flush=True)
        elif now - self.shown_at >= 10 or 10 * (self.done - self.shown_done) >= self.total or self.done == self.total:
            print(line, file=sys.stderr, flush=True)
            self.shown_at, self.shown_done = now, self.done

    def end(self) -> None:
        """Close the progress line: with a summary after a whole run."""
        if self.done == self.total:
            elapsed = time.monotonic() - self.start
            summary = f"{self.total} variants in {_minutes(elapsed)}, {self.total / max(elapsed, 1e-6):.1f}/s"
            print(f"\r{summary:<60}" if self.tty else summary, file=sys.stderr)
        elif self.tty and self.done:
            print(file=sys.stderr)


def _minutes(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def cache(args) -> int:
    """Where the kernel cache is and what it holds; or check it, or empty it."""
    from cuflash import _compile

    if args.action == "verify":
        entries = _compile.cache_entries()
        bad = [problem for problem in map(_compile.verify_entry, entries) if problem]
        for problem in bad:
            print(f"removed: {problem}")
        print(f"{len(entries)} entries checked in {_compile.cache_dir()}, {len(bad)} bad and removed")
        return 1 if bad else 0
    if args.action == "clear":
        removed, status = 0, 0
        for path in _compile.cache_files():
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:  # removed meanwhile by another process
                pass
            except OSError as e:
                print(f"python -m cuflash cache clear: cannot remove {path}: {e.strerror}", file=sys.stderr)
                status = 1
        print(f"removed {removed} files from {_compile.cache_dir()}")
        return status
    files, entries = _compile.cache_files(), _compile.cache_entries()
    size = 0
    for path in files:
        try:
            size += path.stat().st_size
        except FileNotFoundError:  # removed meanwhile by another process
            pass
    archs = collections.Counter(map(_entry_arch, entries))
    per_arch = ", ".join(f"{arch}: {n}" for arch, n in sorted(archs.items()))
    print(f"kernel cache: {_compile.cache_dir()}")
    print(f"{len(entries)} entries" + (f" ({per_arch})" if entries else "") + f", {size / 2**20:.1f} MiB")
    return 0


def _entry_arch(entry) -> str:
    try:
        return json.loads(entry.with_suffix(".json").read_bytes())["arch"]
    except (OSError, ValueError, KeyError, TypeError):
        return "damaged (see cache verify)"


def bench(args) -> int:
    from cuflash import bench as bench_module
    return bench_module.main(args)


def plot(args) -> int:
    from cuflash.bench import plot as plots
    plots.forward(plots.read_csv(args.csv), args.png, args.csv)
    return 0


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of processes, 1 or more, not {text!r}")
    return int(text)


def _archs(text: str) -> list[str]:
    from cuflash import _plan
    archs = text.split(",")
    unknown = [arch for arch in archs if arch not in _plan.SHARED_MEMORY_LIMIT]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arch {', '.join(map(repr, unknown))}: "
                                         f"choose among {','.join(_plan.SHARED_MEMORY_LIMIT)}")
    return archs


def _head_dims(text: str) -> tuple[int, ...]:
    from cuflash import _plan
    parts = text.split(",")
    if not all(part.isdigit() and 1 <= int(part) <= _plan.MAX_HEAD_DIM for part in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated head dims in 1..{_plan.MAX_HEAD_DIM}, not {text!r}")
    return tuple(map(int, parts))


def _command(sub, name: str, run, summary: str, example: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=summary, description=textwrap.fill(summary, 80), epilog=f"example:\n  {example}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _command(sub, "demo", demo, "one checked attention call; says whether the GPU or the CPU path ran",
             "python -m cuflash demo")
    p = _command(sub, "compile", compile_all, "compile every kernel variant with NVRTC into the kernel cache and "
                 "print ptxas's report (registers, shared memory, spills); no GPU needed",
                 "python -m cuflash compile --arch sm_90 --only attention_forward --jobs 8")
    p.add_argument("--arch", type=_archs, default="sm_80,sm_90", help="comma-separated, e.g. sm_80,sm_86,sm_89,sm_90")
    p.add_argument("--jobs", type=_jobs, default=os.cpu_count(), help="compiles at once (default: one per CPU)")
    p.add_argument("--only", metavar="TEXT", help="only the variants whose name contains TEXT, e.g. "
                   "attention_backward_dq or bfloat16")
    p.add_argument("--sample", action="store_true", help="only a covering sample of the variants: every "
                   "template branch, in a tenth of the time")
    p.add_argument("--allow-spills", action="store_true", help="succeed even if a variant spills registers")
    p = _command(sub, "cache", cache, "show where the kernel cache is and what it holds; verify: check every "
                 "entry and remove the bad ones (exit status 1 if there were any); clear: remove every entry",
                 "python -m cuflash cache verify")
    p.add_argument("action", nargs="?", choices=("verify", "clear"))
    p = _command(sub, "bench", bench, "TFLOP/s on FlashAttention's benchmark grid, beside torch SDPA's flash "
                 "and cuDNN backends (--compare); needs a CUDA GPU and PyTorch",
                 "python -m cuflash bench --quick --mode fwd --head-dims 128 --compare")
    p.add_argument("--quick", action="store_true", help="every other sequence length")
    p.add_argument("--mode", choices=("fwd", "bwd", "fwdbwd", "all"), default="all",
                   help="forward, the backward alone, forward+backward, or all three")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--head-dims", type=_head_dims, help="comma-separated head dims (default 64,128,256)")
    p.add_argument("--compare", action="store_true", help="also time torch SDPA's flash and cuDNN backends")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    p.add_argument("--plot", help="also draw TFLOP/s against seqlen to this PNG (needs matplotlib)")
    p.add_argument("--overhead", action="store_true", help="also the host time per call on a tiny shape")
    p.add_argument("--baseline", help="folder of another cuflash package to time beside this one")
    p.add_argument("--variants", action="store_true", help="also the sliding-window and variable-length speed checks")
    p.add_argument("--decode", action="store_true", help="instead, the KV-cache call on decode shapes (GB/s, graph "
                   "replay and plain calls, contiguous and paged caches) beside SDPA's cuDNN and flash backends")
    p.add_argument("--mods", action="store_true", help="instead, programmable masks (mask_mod with and without a "
                   "block mask, the built-in option) beside FlexAttention (ms)")
    p = _command(sub, "plot", plot, "draw a bench --csv file as a PNG (needs matplotlib)",
                 "python -m cuflash plot bench.csv bench.png")
    p.add_argument("csv")
    p.add_argument("png")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"python -m cuflash {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
