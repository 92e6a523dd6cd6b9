"""The PNGs of examples/compare_baseline.py, drawn from its report dict (see that script)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = 1 << 20


def _context_axis(ax, contexts) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.minorticks_off()


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_per_request(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, p in report["planner"].items():
        ctx = sorted(p["bytes_per_request"])
        style = "--" if name == report["baseline"] else "-"
        ax.plot(ctx, [p["bytes_per_request"][c] / MiB for c in ctx], style, marker="o", label=name)
    ax.set_yscale("log")
    _context_axis(ax, ctx)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV + state memory per request (MiB)")
    ax.set_title("Memory per request (published configs, bf16, block 16)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    _save(fig, path)


def concurrency(report: dict, path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, p in report["planner"].items():
        ctx = sorted(p["max_concurrent"])
        style = "--" if name == report["baseline"] else "-"
        ax1.plot(ctx, [max(p["max_concurrent"][c], 0.5) for c in ctx], style, marker="o", label=name)
    ax1.set_yscale("log")
    _context_axis(ax1, ctx)
    ax1.set_xlabel("context length per request (tokens)")
    ax1.set_ylabel("max concurrent requests (count)")
    ax1.set_title(f"Planner: requests that fit in {report['budget_gib']:g} GiB")
    ax1.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=8)
    real = report["real"]
    for name, r in real["runs"].items():
        ax2.plot(range(1, len(r["running"]) + 1), r["running"], "--" if "contiguous" in name else "-", label=name)
    ax2.set_xlabel("engine step (count)")
    ax2.set_ylabel("running requests (count)")
    ax2.set_title(f"Real CPU runs, tiny models, budget {real['budget_bytes'] // 1024} KiB")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    _save(fig, path)


def _bars(ax, names, values, ylabel, title, fmt):
    bars = ax.bar(range(len(names)), values, color=["C0", "C0", "C1", "C1"][:len(names)])
    for b, h in zip(bars, [0.35, 1.0, 0.35, 1.0][:len(names)]):
        b.set_alpha(h)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for i, v in enumerate(values):
        ax.annotate(fmt.format(v), (i, v), ha="center", va="bottom", fontsize=8)


def throughput(report: dict, path: Path) -> None:
    runs = report["real"]["runs"]
    names = list(runs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    _bars(ax1, names, [runs[n]["tokens_per_second"] for n in names], "prompt + generated tokens / s (wall)",
          "Measured throughput (CPU, torch reference kernels)", "{:.0f}")
    _bars(ax2, names, [runs[n]["peak_in_use_bytes"] / 1024 for n in names], "peak KV + state in use (KiB)",
          "Peak memory in use during the run", "{:.0f}")
    _save(fig, path)


def utilization(report: dict, path: Path) -> None:
    runs = report["real"]["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        steps = [i + 1 for i, u in enumerate(r["utilization"]) if u is not None]
        ax1.plot(steps, [100 * u for u in r["utilization"] if u is not None],
                 "--" if "contiguous" in name else "-", label=name)
    ax1.set_xlabel("engine step (count)")
    ax1.set_ylabel("KV utilization: tokens held / reserved (%)")
    ax1.set_ylim(0, 105)
    ax1.set_title("Reserved KV that holds tokens, per step")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    names = list(runs)
    _bars(ax2, names, [100 * runs[n]["mean_utilization"] for n in names], "mean KV utilization (%)",
          "Mean utilization over the run", "{:.0f}%")
    _save(fig, path)


def write_all(report: dict, out: Path) -> None:
    memory_per_request(report, out / "memory_per_request.png")
    concurrency(report, out / "concurrency.png")
    throughput(report, out / "throughput.png")
    utilization(report, out / "utilization.png")
