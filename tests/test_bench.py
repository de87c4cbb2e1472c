"""The bench's table round-trips through its CSV and draws; its timings take turns (no GPU
needed)."""
import collections
import csv
import itertools
import types

import pytest

from cuflash.bench import decode, plot, timing

ROWS = [
    {"pass": p, "d": d, "causal": c, "seqlen": s, "batch": 16384 // s, "nheads": 2048 // d,
     "cuflash": 100.0 + s / 100, "sdpa-flash": 110.0, "sdpa-cudnn": None}
    for p in ("fwd", "fwd+bwd") for d in (64, 128) for c in (False, True) for s in (512, 2048)
]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)


def test_csv_reads_back_typed(tmp_path):
    _write(tmp_path / "b.csv", ROWS)
    rows = plot.read_csv(str(tmp_path / "b.csv"))
    for got, want in zip(rows, ROWS):
        assert {k: got[k] for k in want if k != "baseline"} == want
        assert got["baseline"] is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (only the bench plots need it)")
    plot.forward(ROWS, str(tmp_path / "p.png"), "test")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timed_implementations_take_turns():
    """Each round times every implementation once, in turn, in orders that balance which
    one runs right before each, so a drifting clock and the call before weigh on all
    alike; each gets its own median."""
    clock, calls = [0.0], []

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event))

    def call(name, ms):
        def fn():
            calls.append(name)
            clock[0] += ms
        return fn

    medians = timing.median_ms_each({"a": call("a", 1.0), "b": call("b", 3.0), "c": call("c", 2.0)}, fake_torch)
    assert medians == {"a": 1.0, "b": 3.0, "c": 2.0}
    timed = calls[3 * timing.WARMUP:]
    assert len(timed) == 3 * -(-timing.REPEATS // 6) * 6  # whole sets of three callables' six orders
    # Within a round, each callable comes right after each other one equally often.
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    after = collections.Counter((r[i - 1], r[i]) for r in rounds for i in (1, 2))
    assert sorted(after) == sorted(itertools.permutations("abc", 2)) and len(set(after.values())) == 1, after


def test_balanced_orders_put_each_callable_after_every_other_equally_often():
    for n in range(1, 8):
        orders = timing.balanced_orders(n)
        assert all(sorted(order) == list(range(n)) for order in orders)
        after = collections.Counter((o[i - 1], o[i]) for o in orders for i in range(1, n))
        assert sorted(after) == sorted(itertools.permutations(range(n), 2)) and len(set(after.values())) <= 1


def test_decode_pages_hold_the_contiguous_cache():
    """bench --decode's paged layout: the block table reads back every row of the cache."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    cache = torch.randn(3, 50, 2, 4)
    order = torch.randperm(3 * 4)
    pages = decode.paged(torch, cache, 16, order)
    assert torch.equal(pages[order.reshape(3, 4)].reshape(3, 64, 2, 4)[:, :50], cache)


def test_decode_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (only the bench plots need it)")
    rows = [dict(layout=layout, heads=heads, d=d, batch=b, L=length, cuflash=1000.0 + length / 100,
                 **({"sdpa-cudnn": 1500.0} if layout == "contiguous" else {}))
            for layout in decode.LAYOUTS for heads in ("32/8", "32/32") for d in (64, 128)
            for b, length in decode.QUICK_GRID]
    plot.decode(rows, str(tmp_path / "d.png"), "test")
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mods_bench_documents_fill_the_sequence_and_its_masks_mean_what_they_say():
    """bench --mods: the documents cover the 16k sequence exactly, and each mask function,
    evaluated with NumPy (its block mask), shows the keys its name promises."""
    import numpy as np

    from cuflash import mod
    from cuflash.bench import mods
    lengths = mods._documents(mods.TOKENS)
    assert lengths.sum() == mods.TOKENS and (lengths > 0).all() and len(lengths) > 4
    ids = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    s, block = 2048, 128
    expected = {"causal": (mods.causal, (), lambda q, k: k <= q),
                "window": (mods.sliding_window, (), lambda q, k: (k <= q) & (q - k < mods.WINDOW)),
                "prefix": (mods.prefix_lm, (), lambda q, k: (k <= q) | (k < mods.PREFIX)),
                "documents": (mods.same_document, (ids[:s],), lambda q, k: ids[q] == ids[k])}
    q, k = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    for name, (mask_mod, tensors, visible) in expected.items():
        statuses = mod.create_block_mask(mask_mod, None, None, s, s, mod_tensors=tensors).statuses[0, 0]
        dense = visible(q, k).reshape(s // block, block, s // block, block)
        want = np.where(dense.all(axis=(1, 3)), mod.FULL, np.where(dense.any(axis=(1, 3)), mod.PARTIAL, mod.EMPTY))
        assert (statuses == want).all(), name


def test_mods_bench_grid_functions_mean_what_they_say():
    """bench --mods' grid: the relative bias adds table[h, q - k + seqlen - 1] to each score
    (the NumPy path against the oracle with the bias added by hand), and the per-sequence
    documents hide keys of another document of the same sequence only."""
    import numpy as np

    import cuflash
    from cuflash import mod
    from cuflash.bench import mods
    from cuflash.reference import attention_reference
    rng = np.random.default_rng(0)
    b, s, h, d = 2, 37, 3, 16
    q, k, v = (rng.standard_normal((b, s, h, d)) for _ in range(3))
    table = rng.standard_normal((h, 2 * s - 1))
    out = cuflash.attention(q, k, v, score_mod=mods.relative_bias, mod_tensors=(table,))
    rows, cols = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    bias = table[:, rows - cols + s - 1]  # (h, s, s)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, attention_reference(q, k, v)[0])
    ids = np.stack([np.repeat(np.arange(3), (10, 20, 7)), np.repeat(np.arange(2), (30, 7))]).astype(np.int32)
    statuses = mod.create_block_mask(mods.same_document_of, b, None, s, s, mod_tensors=(ids,)).statuses
    assert statuses.shape == (2, 1, 1, 1) and (statuses == mod.PARTIAL).all()
    hidden = cuflash.attention(q, k, v, mask_mod=mods.same_document_of, mod_tensors=(ids,))
    alone = cuflash.attention(q[:1, 10:30], k[:1, 10:30], v[:1, 10:30])  # the second document of sequence 0
    np.testing.assert_allclose(hidden[:1, 10:30], alone, rtol=1e-6, atol=1e-6)


def test_mods_bench_steps_flex_kernel_options_down_where_none_compiles():
    """bench --mods: where FlexAttention's compile finds no kernel configuration that fits,
    its calls take the next of FLEX_FALLBACK_OPTIONS; any other error is raised."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    from cuflash.bench import mods
    tried = []

    def flex(q, k, v, kernel_options=None, **options):
        tried.append(kernel_options)
        if kernel_options is None:
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource")
        return q

    x = [torch.zeros(1, 4, 2, 8) for _ in range(4)]
    call = mods._flexed(torch, flex, x, False)
    assert tried == [None, mods.FLEX_FALLBACK_OPTIONS[1]]
    call()
    assert tried[-1] == mods.FLEX_FALLBACK_OPTIONS[1]

    def broken(q, k, v, **options):
        raise ValueError("another error")

    with pytest.raises(ValueError, match="another error"):
        mods._flexed(torch, broken, x, False)


def test_the_grid_labels_each_pass_and_counts_its_flops(tmp_path, monkeypatch, capsys):
    """--mode all: the forward, the backward alone (2.5 forwards' FLOPs, timed without the
    forward) and forward + backward (3.5), each row named by its pass in the table and CSV."""
    from cuflash.bench import forward
    asked = []

    def implementations(torch, b, s, h, d, causal, backward, baseline, dtype, compare, alone):
        asked.append((backward, alone))
        return {"cuflash": None, "sdpa-cudnn": None}

    monkeypatch.setattr(forward, "implementations", implementations)
    monkeypatch.setattr(forward, "median_ms_each", lambda impls, torch: {name: 1.0 for name in impls})
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(empty_cache=lambda: None), __version__="0")
    args = types.SimpleNamespace(baseline=None, quick=True, mode="all", head_dims=[64], dtype="bfloat16",
                                 compare=True, csv=str(tmp_path / "g.csv"), plot=None, overhead=False, variants=False)
    assert forward.main(args, fake_torch, "gpu") == 0
    rows = plot.read_csv(str(tmp_path / "g.csv"))
    assert [r["pass"] for r in rows] == [p for p in ("fwd", "bwd", "fwd+bwd") for _ in range(6)]
    assert asked == [flags for flags in ((False, False), (True, True), (True, False)) for _ in range(6)]
    forward_flops = {(r["causal"], r["seqlen"]): r["cuflash"] for r in rows if r["pass"] == "fwd"}
    for r in rows:
        assert r["cuflash"] == pytest.approx(forward_flops[r["causal"], r["seqlen"]] *
                                             {"fwd": 1, "bwd": 2.5, "fwd+bwd": 3.5}[r["pass"]])
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[2:]] == [r["pass"] for r in rows]
