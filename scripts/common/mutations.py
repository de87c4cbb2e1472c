"""Mutation smoke: plant one-line bugs in a copy of the package, one at a time, run a pytest
selection against each copy and print which the tests caught.

    python scripts/common/mutations.py                      # the CPU mutants (any machine)
    python scripts/common/mutations.py --family cuda        # the CUDA mutants (a GPU machine;
                                                            #   CUFLASH_REQUIRE_GPU=1 is set)
    python scripts/common/mutations.py --only rotary-q --tests "tests/test_kvcache.py -x"

Each mutant is (name, family, file under cuflash/, old text, new text, what it breaks,
pytest selection). The copy holds cuflash/ (its CUDA sources included: the kernel cache
keys every source byte, so a mutated kernel is compiled afresh), tests/ and
pyproject.toml, and pytest runs in it, so the copy is the package the tests import. A
mutant whose old text is not found exactly once is reported, not run. A mutant is
caught when pytest exits 1 (a test failed), survived when it exits 0; anything else
(a collection error, a timeout) is reported as such. Exit status 1 if any mutant survived.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    family: str  # "cpu" (the NumPy path) or "cuda" (a kernel source)
    file: str    # under cuflash/
    old: str
    new: str
    what: str
    tests: str   # the pytest selection that must catch it


CPU_TESTS = "tests/test_cpu.py tests/test_cpu_variants.py tests/test_kvcache.py tests/test_reference_kvcache.py -x -q"
KV_GPU = "tests/test_gpu_kvcache.py -x -q -k 'every_key_tile or small_calls or long_calls or merge_steps or split_count'"
FWD_GPU = "tests/test_gpu_forward.py tests/test_sm90.py -x -q -k 'every_key_tile or matches or long_sequences or tail'"

MUTANTS = [
    Mutant("rotary-q", "cpu", "cpu.py",
           "cache.rotary_interleaved).astype(q.dtype)", "cache.rotary_interleaved)",
           "the rotated q kept in float32, not rounded to q's dtype", "tests/test_kvcache.py -x -q"),
    Mutant("rotary-position", "cpu", "cpu.py",
           "positions = np.arange(n, n + seqlen_q) if local else np.full(seqlen_q, n)",
           "positions = np.arange(n, n + seqlen_q) if local else np.full(seqlen_q, max(n - 1, 0))",
           "q rotated one position early", CPU_TESTS),
    Mutant("kv-leftpad", "cpu", "cpu.py",
           "keys = _rows(b, np.arange(int(leftpad[b]), n + cache.seqlen_new)",
           "keys = _rows(b, np.arange(int(leftpad[b]) // 2, n + cache.seqlen_new)",
           "keys before the left padding read", CPU_TESTS),
    Mutant("kv-last-key", "cpu", "cpu.py",
           "keys = _rows(b, np.arange(int(leftpad[b]), n + cache.seqlen_new)",
           "keys = _rows(b, np.arange(int(leftpad[b]), max(int(leftpad[b]), n + cache.seqlen_new - 1))",
           "the last key of each sequence lost", CPU_TESTS),
    Mutant("kv-window-limit", "cpu", "cpu.py",
           "batch_index=np.array([b]), window_limit=cache.capacity)", "batch_index=np.array([b]), window_limit=None)",
           "a window side compared with the sequence's length, not the cache's", CPU_TESTS),
    Mutant("kv-page-row", "cpu", "cpu.py",
           "return table[b].astype(np.int64)[positions // page_size], positions % page_size",
           "return table[b].astype(np.int64)[positions // page_size], (positions + 1) % page_size",
           "a paged row read from the next slot", CPU_TESTS),
    Mutant("merge-states-weight", "cpu", "kvcache.py",
           "weights = xp.where(empty, 0, xp.exp(finite - xp.where(seen, top, 0)))",
           "weights = xp.where(empty, 0, xp.exp(0.5 * (finite - xp.where(seen, top, 0))))",
           "merge_states weighs its parts by exp(lse / 2)", "tests/test_kvcache.py tests/test_torch_kvcache.py -x -q"),
    # The kernels' mutants: a tile, page, split, merge or rotary bug the GPU tests must see.
    Mutant("mask-offset", "cuda", "cuda/mask.cuh", "return Mask{seqlen_k, seqlen_k - seqlen_q, left < 0 || left",
           "return Mask{seqlen_k, seqlen_k - seqlen_q + 1, left < 0 || left",
           "the mask's diagonal one key late (every family's mask)", FWD_GPU),
    Mutant("split-skips-a-tile", "cuda", "cuda/decode/split_kv.cu",
           "const int n_begin = part_tile(part), n_end = part_tile(part + 1);",
           "const int n_begin = part_tile(part) + (part > 0 && part_tile(part) < part_tile(part + 1)), "
           "n_end = part_tile(part + 1);",
           "every split after the first skips its first key tile", KV_GPU),
    Mutant("merge-weight", "cuda", "cuda/partial.cuh", "fast_exp2((lse - top) * kLog2e)",
           "fast_exp2((lse - top) * kLog2e * 0.5f)", "a part's merge weight exp((lse - top) / 2)",
           KV_GPU),
    Mutant("page-index", "cuda", "cuda/decode/cache.cuh", "pages[page_of(t)] : -1;", "pages[page_of(t) ^ 1] : -1;",
           "a row read ahead from the neighbouring page-table entry", KV_GPU),
    Mutant("rotary-q-position", "cuda", "cuda/decode/split_kv.cu",
           "return seq.length + (kLocal ? (row0 + r) / group : 0);",
           "return seq.length + (kLocal ? (row0 + r) / group : 0) + 1;", "q rotated one position late", KV_GPU),
]


def plant(mutant: Mutant, into: Path) -> str | None:
    """Copy the package, tests and pyproject into ``into`` with the mutant's edit; None if
    planted, else why not."""
    shutil.copytree(ROOT / "cuflash", into / "cuflash", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", into / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    path = into / "cuflash" / mutant.file
    if not path.is_file():
        return f"no file cuflash/{mutant.file}"
    text = path.read_text(encoding="utf-8")
    if text.count(mutant.old) != 1:
        return f"old text found {text.count(mutant.old)} times in cuflash/{mutant.file}"
    path.write_text(text.replace(mutant.old, mutant.new, 1), encoding="utf-8")
    return None


def run(mutant: Mutant, tests: str, timeout: float) -> tuple[str, float, str]:
    """(verdict, seconds, the first failing test or the reason)."""
    with tempfile.TemporaryDirectory(prefix="cuflash-mutant-") as folder:
        copy = Path(folder)
        why = plant(mutant, copy)
        if why is not None:
            return "not planted", 0.0, why
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        if mutant.family == "cuda":
            env.setdefault("CUFLASH_REQUIRE_GPU", "1")  # a GPU that does not answer must not pass as caught-nothing
        where = subprocess.run([sys.executable, "-c", "import cuflash; print(cuflash.__file__)"], cwd=copy, env=env,
                               capture_output=True, text=True)
        if not where.stdout.startswith(str(copy)):
            return "not planted", 0.0, f"the copy is not what imports: {where.stdout.strip() or where.stderr[-200:]}"
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rf", *_split(tests)], cwd=copy, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timed out", time.perf_counter() - start, f"over {timeout:.0f} s"
        seconds = time.perf_counter() - start
        failed = next((line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")), "")
        verdict = {0: "SURVIVED", 1: "caught"}.get(done.returncode, f"pytest exit {done.returncode}")
        if done.returncode not in (0, 1):
            failed = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
            failed = failed[0]
        return verdict, seconds, failed


def _split(command: str) -> list[str]:
    import shlex
    return shlex.split(command)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["cpu", "cuda", "all"], default="cpu")
    parser.add_argument("--only", help="comma-separated mutant names")
    parser.add_argument("--tests", help="a pytest selection for every mutant, in place of each one's own")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a mutant's run may take")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (each in its own copy)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.family in ("all", m.family)]
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTANTS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name:20} {m.family:5} cuflash/{m.file:22} {m.what}")
        return 0
    print("| mutant | file | bug | verdict | time | first failing test |")
    print("|---|---|---|---|---|---|")
    survived = False
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = [pool.submit(run, m, args.tests or m.tests, args.timeout) for m in chosen]
        for m, done in zip(chosen, runs):
            verdict, seconds, detail = done.result()
            survived |= verdict == "SURVIVED"
            print(f"| {m.name} | cuflash/{m.file} | {m.what} | {verdict} | {seconds:.0f} s | {detail} |", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
