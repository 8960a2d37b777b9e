"""PNG of a benchmark: sweep curves (throughput and TTFT vs rate/concurrency) or throughput bars."""
from __future__ import annotations


def plot_results(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    sweeps = [(name, kind, r[kind]) for name, r in workloads.items()
              for kind in ("sweep_rate", "sweep_concurrency") if kind in r]
    if sweeps:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, kind, sweep in sweeps:
            xs = [float(x) for x in sweep]
            label = f"{name} ({kind.split('_')[1]})"
            axes[0].plot(xs, [s["output_tok_s"] for s in sweep.values()], marker="o", label=label)
            axes[1].plot(xs, [1000 * s["ttft_s"]["p50"] for s in sweep.values()], marker="o", label=label + " p50")
            axes[1].plot(xs, [1000 * s["ttft_s"]["p99"] for s in sweep.values()], marker="x", ls="--",
                         label=label + " p99")
        axes[0].set(xlabel="request rate (req/s) or concurrency", ylabel="output tokens/s", title="throughput")
        axes[1].set(xlabel="request rate (req/s) or concurrency", ylabel="TTFT (ms)", title="time to first token")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels, values = [], []
        for name, r in workloads.items():
            for kind in ("offline", "serve", "serve_no_prefix_caching", "hf"):
                if kind in r:
                    labels.append(f"{name}\n{kind}")
                    values.append(r[kind]["output_tok_s"])
            if "ceiling" in r:
                labels.append(f"{name}\nceiling")
                values.append(r["ceiling"]["output_tok_s"])
        ax.bar(labels, values, color="tab:blue")
        ax.set(ylabel="output tokens/s", title="llmsvc benchmark")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
