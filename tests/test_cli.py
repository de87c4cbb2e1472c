"""python -m cuflash from the outside: plain help with an example, misuse refused with
status 2 in one line, bench without a GPU fails, compile shows its progress and stops
cleanly on Ctrl-C, cache shows, verifies and clears the kernel cache."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _compile

from .conftest import gpu_available

ROOT = Path(__file__).resolve().parents[1]


def _cuflash(*args, cache: Path, **kwargs):
    return subprocess.run([sys.executable, "-m", "cuflash", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, CUFLASH_CACHE_DIR=str(cache)), timeout=120, **kwargs)


@pytest.mark.parametrize("command", ["", "demo", "compile", "cache", "bench", "plot"])
def test_help_is_plain_text_with_an_example(command, tmp_path):
    result = _cuflash(*command.split(), "--help", cache=tmp_path)
    assert result.returncode == 0 and not result.stderr
    assert "``" not in result.stdout
    assert re.search(rf"^examples?:\n  python -m cuflash {command}", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.parametrize("args, complaint", [
    ("compile --jobs 0", "--jobs"),
    ("compile --jobs -3", "--jobs"),
    ("compile --jobs two", "--jobs"),
    ("compile --arch sm_75", "sm_80,sm_86"),
    ("compile --arch sm_80,banana", "'banana'"),
    ("compile --only no-such-variant", "no-such-variant"),
    ("bench --head-dims 0", "--head-dims"),
    ("bench --head-dims x", "--head-dims"),
    ("bench --head-dims 64,", "--head-dims"),
    ("cache shred", "shred"),
])
def test_misuse_exits_2_in_one_line(args, complaint, tmp_path):
    result = _cuflash(*args.split(), cache=tmp_path)
    assert result.returncode == 2 and not result.stdout
    # argparse's usage, then one line that says what is wrong
    lines = [line for line in result.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1 and complaint in lines[0], result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(gpu_available(), reason="a CUDA GPU is here")
def test_bench_without_a_gpu_fails_in_one_line(tmp_path):
    result = _cuflash("bench", cache=tmp_path)
    assert result.returncode == 1 and not result.stdout
    (line,) = result.stderr.splitlines()
    assert "no CUDA GPU found" in line


def test_compile_shows_progress_and_prints_its_table(tmp_path):
    result = _cuflash("compile", "--arch", "sm_80", "--only", "attention_backward_preprocess", "--jobs", "2",
                      cache=tmp_path)
    assert result.returncode == 0, result.stderr
    header, *rows, summary = result.stdout.splitlines()
    assert header.split() == ["arch", "regs", "smem", "KiB", "spill", "B", "variant"]
    assert [row.split("  ")[-1] for row in rows] == ["cuflash::attention_backward_preprocess<cuflash::half_t>",
                                                     "cuflash::attention_backward_preprocess<cuflash::bfloat16_t>"]
    assert all(re.fullmatch(r"sm_80 +\d+ +0\.0 +0  \S.*", row) for row in rows)
    assert summary == "2 variants compiled, 0 spill"
    # Not a terminal: plain lines, the last one a summary.
    progress = result.stderr.splitlines()
    assert [line.split(",")[0] for line in progress[:2]] == ["1/2 variants", "2/2 variants"]
    assert re.fullmatch(r"2/2 variants, [\d.]+/s, 0:00 left", progress[1])
    assert re.fullmatch(r"2 variants in \d+:\d\d, [\d.]+/s", progress[2]) and len(progress) == 3


def test_ctrl_c_stops_compile_and_leaves_the_cache_sound(tmp_path, monkeypatch):
    only = "attention_forward<cuflash::half_t, 32,"  # 8 variants, compiled one at a time
    compile_ = subprocess.Popen([sys.executable, "-m", "cuflash", "compile", "--arch", "sm_80", "--only", only,
                                 "--jobs", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, env=dict(os.environ, CUFLASH_CACHE_DIR=str(tmp_path)),
                                preexec_fn=os.setpgrp)  # its own process group, as a terminal gives it
    try:
        first = compile_.stderr.readline()
        assert first.startswith("1/8 variants")
        os.killpg(compile_.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole process group
        out, err = compile_.communicate(timeout=60)
    finally:
        compile_.kill()
    assert compile_.returncode == 130
    assert not out and err.splitlines()[-1] == "python -m cuflash compile: interrupted"
    assert "Traceback" not in err
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    assert not list(tmp_path.glob("*.tmp"))
    entries = _compile.cache_entries()
    assert 1 <= len(entries) < 8 and [_compile.verify_entry(entry) for entry in entries] == [None] * len(entries)


@pytest.fixture
def two_entries(tmp_path, monkeypatch):
    """A cache with two entries of made-up kernels (no NVRTC run)."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_compile, "run_nvrtc", lambda source, instance, options: _compile.Compiled(
        b"\x7fELF not really" + instance.encode(), instance, _compile.Resources(32, 0, 0, 0)))
    _compile.compile_kernel("fwd.cu", "first", "sm_80")
    _compile.compile_kernel("fwd.cu", "second", "sm_90")
    return _compile.cache_entries()


def test_cache_says_where_it_is_and_what_it_holds(two_entries, tmp_path):
    result = _cuflash("cache", cache=tmp_path)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"kernel cache: {tmp_path}", "2 entries (sm_80: 1, sm_90: 1), 0.0 MiB"]


def test_cache_verify_removes_a_bad_entry_and_fails(two_entries, tmp_path):
    good, bad = two_entries
    bad.with_suffix(".cubin").write_bytes(b"\x7fELF tampered with")
    result = _cuflash("cache", "verify", cache=tmp_path)
    assert result.returncode == 1
    assert f"{bad.name}.cubin does not match the sha256 in its metadata" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("2 entries checked")
    assert _compile.cache_entries() == [good]
    assert _cuflash("cache", "verify", cache=tmp_path).returncode == 0


def test_cache_clear_removes_only_cuflash_files(two_entries, tmp_path):
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / f"{two_entries[0].name}.cubin.0123456789abcdef.tmp").write_bytes(b"left by a killed process")
    result = _cuflash("cache", "clear", cache=tmp_path)
    assert result.returncode == 0
    assert result.stdout == f"removed 7 files from {tmp_path}\n"  # 2 x (cubin, json, lock) and the temporary file
    assert [p.name for p in tmp_path.iterdir()] == ["notes.json"]
