"""Command line: ``python -m cuflash {demo,compile,bench}``."""
from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import sys


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
    """Compile every kernel variant for each arch (no GPU needed) and print what
    ptxas reports; fails if any variant fails to compile or spills (--allow-spills)."""
    from cuflash import _compile, _plan

    jobs = [(arch, kernel) for arch in args.arch.split(",") for kernel in _plan.all_kernels(arch)]
    # NVRTC holds the GIL: compile in processes.
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(_compile.compile_kernel, [kernel.source for _, kernel in jobs],
                                [kernel.instance for _, kernel in jobs], [arch for arch, _ in jobs]))
    spilled = 0
    print(f"{'arch':6} {'regs':>4} {'smem KiB':>8} {'spill B':>7}  variant")
    for (arch, kernel), compiled in zip(jobs, results):
        r = compiled.resources
        spill = r.spill_stores + r.spill_loads
        spilled += spill > 0
        print(f"{arch:6} {r.registers:4d} {kernel.shared_bytes / 1024:8.1f} {spill:7d}  {kernel.instance}")
    print(f"{len(jobs)} variants compiled, {spilled} spill")
    return 1 if spilled and not args.allow_spills else 0


def bench(args) -> int:
    from cuflash import bench as bench_module
    return bench_module.main(args)


def plot(args) -> int:
    from cuflash import bench as bench_module
    bench_module.plot(bench_module.read_csv(args.csv), args.png, args.csv)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="one checked attention call; says whether the GPU or the CPU path ran")
    p.set_defaults(run=demo)
    p = sub.add_parser("compile", help="compile every kernel variant with NVRTC; no GPU needed")
    p.add_argument("--arch", default="sm_80,sm_90", help="comma-separated, e.g. sm_80,sm_86,sm_89,sm_90")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--allow-spills", action="store_true")
    p.set_defaults(run=compile_all)
    p = sub.add_parser("bench", help="TFLOP/s beside torch SDPA's flash and cuDNN backends")
    p.add_argument("--quick", action="store_true", help="every other sequence length")
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "all"), default="all", help="forward, forward+backward, or both")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--head-dims", type=lambda text: tuple(map(int, text.split(","))),
                   help="comma-separated head dims (default 64,128,256)")
    p.add_argument("--compare", action="store_true", help="also time torch SDPA's flash and cuDNN backends")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    p.add_argument("--plot", help="also draw TFLOP/s against seqlen to this PNG (needs matplotlib)")
    p.add_argument("--overhead", action="store_true", help="also the host time per call on a tiny shape")
    p.add_argument("--baseline", help="folder of another cuflash package to time beside this one")
    p.add_argument("--variants", action="store_true", help="also the sliding-window and variable-length speed checks")
    p.set_defaults(run=bench)
    p = sub.add_parser("plot", help="draw a bench --csv file as a PNG (needs matplotlib)")
    p.add_argument("csv")
    p.add_argument("png")
    p.set_defaults(run=plot)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
