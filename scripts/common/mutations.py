"""Mutation smoke: plant one-line bugs in a copy of the package, one at a time, run a pytest
selection against each copy and print which the tests caught.

    python scripts/common/mutations.py                      # the CPU mutants (any machine)
    python scripts/common/mutations.py --family cuda        # the CUDA mutants (a GPU machine;
                                                            #   CUFLASH_REQUIRE_GPU=1 is set)
    python scripts/common/mutations.py --only rotary-q --tests "tests/test_kvcache.py -x"

Each mutant is (name, family, file under cuflash/, old text, new text, what it breaks,
pytest selection): a table of scripts/common/mutants.toml. The copy holds cuflash/ (its
CUDA sources included: the kernel cache keys every source byte, so a mutated kernel is
compiled afresh), tests/ and pyproject.toml, and pytest runs in it, so the copy is the
package the tests import. A mutant whose old text is not found exactly once is reported,
not run. A mutant is caught when pytest exits 1 (a test failed), survived when it exits 0;
anything else (a collection error, a timeout) is reported as such. Exit status 1 if any
mutant survived.
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
import tomllib
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


def load_mutants(path: Path = Path(__file__).with_name("mutants.toml")) -> list[Mutant]:
    """The mutants of ``path`` (mutants.toml: one [[mutant]] table each), their tests named
    by [selections] where they name one."""
    table = tomllib.loads(path.read_text(encoding="utf-8"))
    selections = table.get("selections", {})
    return [Mutant(**{**entry, "tests": selections.get(entry["tests"], entry["tests"])}) for entry in table["mutant"]]


MUTANTS = load_mutants()


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
