"""The bench's figures (matplotlib, imported only when one is drawn) and its CSV read back
(``python -m cuflash plot CSV PNG`` draws a table saved where matplotlib was missing)."""
from __future__ import annotations

import csv

# The forward table's implementations, in the order of its columns.
IMPLEMENTATIONS = ("cuflash", "baseline", "sdpa-flash", "sdpa-cudnn")


def forward(rows: list[dict], path: str, title: str) -> None:
    """TFLOP/s against seqlen, one panel per (pass, causal) and head dim, one line per
    implementation. ``rows`` as the forward grid makes them (or read back from its CSV)."""
    plt = _pyplot()
    panels = sorted({(r["pass"], r["causal"]) for r in rows}, key=lambda pc: (pc[0] != "fwd", pc[1]))
    dims = sorted({r["d"] for r in rows})
    names = [n for n in IMPLEMENTATIONS if any(r.get(n) for r in rows)]
    fig, axes = plt.subplots(len(panels), len(dims), figsize=(4 * len(dims), 3 * len(panels)), squeeze=False)
    for (pass_, causal), row_axes in zip(panels, axes):
        for d, ax in zip(dims, row_axes):
            cells = sorted((r for r in rows if (r["pass"], r["causal"], r["d"]) == (pass_, causal, d)),
                           key=lambda r: r["seqlen"])
            for name in names:
                points = [(r["seqlen"], r[name]) for r in cells if r.get(name)]
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            style_panel(ax, f"{pass_}, d {d}, {'causal' if causal else 'not causal'}", "seqlen", "TFLOP/s")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, title, path)


def decode(rows: list[dict], path: str, title: str) -> None:
    """GB/s against L, one panel per (heads, d, batch), one line per implementation and
    cuflash layout (graph replay). ``rows`` as the decode bench makes them."""
    plt = _pyplot()
    panels = sorted({(r["heads"], r["d"], r["batch"]) for r in rows})
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    columns = 3
    fig, axes = plt.subplots(-(-len(panels) // columns), columns, figsize=(4.2 * columns, 3 * -(-len(panels) //
                                                                                                columns)),
                             squeeze=False)
    for (heads, d, batch), ax in zip(panels, axes.flat):
        cells = [r for r in rows if (r["heads"], r["d"], r["batch"]) == (heads, d, batch)]
        lines = [(f"cuflash {layout}", layout, "cuflash") for layout in layouts] + \
            [(name, "contiguous", name) for name in ("sdpa-cudnn", "sdpa-flash")]
        for label, layout, column in lines:
            points = sorted((r["L"], r[column]) for r in cells if r["layout"] == layout and r.get(column))
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        style_panel(ax, f"GQA {heads}, d {d}, batch {batch}", "keys cached (L)", "GB/s")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, title, path)


def style_panel(ax, title: str, xlabel: str, ylabel: str) -> None:
    """A panel of a bench plot: x on a log2 scale, y from 0, a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def save_figure(fig, title: str, path: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def read_csv(path: str) -> list[dict]:
    """The rows of the forward grid's ``--csv`` file, typed back."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["causal"] = r["causal"] == "True"
        for key in ("d", "seqlen", "batch", "nheads"):
            r[key] = int(r[key])
        for key in IMPLEMENTATIONS:
            r[key] = float(r[key]) if r.get(key) else None
    return rows


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt
