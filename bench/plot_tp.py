"""Plot decode tokens/s against the TP size from `bench_decode.py --results` files (JSON lines):
one panel per model, one line per (layout, batch), with the ideal linear scaling from TP 1 as
a dotted line.

    python bench/plot_tp.py results.jsonl [more.jsonl ...] --out bench/tp_scaling.png
"""

from __future__ import annotations

import argparse
import collections
import json


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({(r["config"], r.get("layers")) for r in rows}, key=str)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (config, layers) in zip(axes[0], models, strict=True):
        lines = collections.defaultdict(dict)
        for r in rows:
            if (r["config"], r.get("layers")) == (config, layers):
                lines[r["layout"], r["batch"]][r["tp"]] = r["rate"]
        for (layout, batch), rates in sorted(lines.items()):
            sizes = sorted(rates)
            (line,) = ax.plot(
                sizes, [rates[s] for s in sizes], marker="o", label=f"{layout}, batch {batch}"
            )
            if 1 in rates:  # linear scaling from TP 1
                ax.plot(sizes, [rates[1] * s for s in sizes], ":", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(
            sorted({r["tp"] for r in rows}), [str(t) for t in sorted({r["tp"] for r in rows})]
        )
        ax.set_xlabel("TP size (GPUs)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(config + (f" ({layers} layers)" if layers else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="bench/tp_scaling.png")
    parser.add_argument("--title", default="qshard decode, tokens/s by TP size (dotted: linear)")
    args = parser.parse_args()
    plot(load(args.results), args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
