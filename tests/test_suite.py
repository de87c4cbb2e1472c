"""The suite and the tree: skips say why, an interrupted run leaves nothing behind, and
the repository speaks of the library only."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def test_every_importorskip_names_its_reason():
    for path in sorted(set(TESTS.glob("test_*.py")) - {Path(__file__)}):
        for call in re.findall(r"importorskip\(([^)]*)\)", path.read_text()):
            assert "reason=" in call, f"{path.name}: importorskip({call}) says no reason"


def test_skip_reasons_are_in_the_summary():
    config = (ROOT / "pyproject.toml").read_text()
    addopts = re.search(r'^addopts = "(.*)"$', config, re.M)
    assert addopts and "-rs" in addopts[1].split()


def test_the_package_data_holds_every_kernel_source():
    """A wheel (not an editable install) carries only what package-data names: every
    folder of kernel sources must be in it."""
    import fnmatch
    config = (ROOT / "pyproject.toml").read_text()
    patterns = re.findall(r'"(cuda/[^"]+)"', re.search(r"^cuflash = \[(.*)\]$", config, re.M)[1])
    cuda = ROOT / "cuflash" / "cuda"
    for source in sorted(cuda.rglob("*.cu*")):
        name = "cuda/" + source.relative_to(cuda).as_posix()
        assert any(fnmatch.fnmatch(name, p) and name.count("/") == p.count("/") for p in patterns), name


def test_an_interrupted_run_leaves_no_temporary_folder(tmp_path):
    """Ctrl-C in the middle of a test that holds a tmp_path folder: with the project's
    pytest settings, the folders go with the run."""
    started = tmp_path / "started"
    (tmp_path / "test_slow.py").write_text(
        "import pathlib, time\n"
        "def test_slow(tmp_path):\n"
        "    (tmp_path / 'data').write_text('x')\n"
        f"    pathlib.Path({str(started)!r}).write_text('')\n"
        "    time.sleep(60)\n")
    temproot = tmp_path / "temproot"
    temproot.mkdir()
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                            str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_slow.py")],
                           env={**os.environ, "PYTEST_DEBUG_TEMPROOT": str(temproot)}, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read().decode()
            time.sleep(0.1)
        run.send_signal(signal.SIGINT)
        output = run.communicate(timeout=60)[0].decode()
    finally:
        run.kill()
    assert "KeyboardInterrupt" in output
    left = [p for p in temproot.rglob("*") if p.is_file() or p.is_symlink()]
    assert not left, left


def test_the_repository_speaks_of_the_library_only():
    """Docs, code, scripts, tests and CI say what the code does and what was measured,
    never how the work on it was organised (its work periods, numbered work items, a
    borrowed machine)."""
    words = re.compile(r"\bsessions?\b|\bitem [0-9]+|\bl" r"ent\b", re.I)  # (split: this file is scanned too)
    places = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / ".ci").rglob("*")]
    for folder in ("docs", "cuflash", "scripts", "tests"):
        places += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".md", ".py", ".cu", ".cuh", ".sh", ".csv", ".toml")]
    found = []
    for path in places:
        if path.is_file():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if words.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
