"""The benchmark's figure: latency distributions (empirical CDFs) and a throughput bar chart."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from bench.metrics import LATENCY_KEYS

TITLES = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "inter-token latency", "e2e_s": "end-to-end latency"}


def write_plot(path: str, samples: Mapping[str, Mapping[str, list[float]]],
               throughput_tok_s: Mapping[str, float], request_throughput: Mapping[str, float], title: str) -> None:
    """``samples[system][metric]`` are seconds; ``throughput_*[system]`` one figure per system."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, key in zip(axes.flat, LATENCY_KEYS):
        for system, by_key in samples.items():
            values = np.sort(np.asarray(by_key.get(key, []), dtype=np.float64)) * 1000.0
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=f"{system} (p50 {np.median(values):.1f} ms)")
        ax.set_title(TITLES[key])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    ax = axes.flat[len(LATENCY_KEYS)]
    systems = list(throughput_tok_s)
    bars = ax.bar(systems, [throughput_tok_s[s] for s in systems], color=["tab:blue", "tab:orange"][:len(systems)])
    ax.bar_label(bars, labels=[f"{throughput_tok_s[s]:.1f} tok/s\n{request_throughput[s]:.2f} req/s" for s in systems],
                 fontsize=8)
    ax.set_title("output throughput")
    ax.set_ylabel("tokens / s")
    ax.margins(y=0.2)
    axes.flat[-1].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
