"""Picture renderings like the paper's figures: SVG (no dependency) and PNG (matplotlib).

One row per rank, time to the right; colour per pass kind (F blue, B green, W orange, fused BW
purple), lighter shades for later microbatches, and chunk 1 (the V's up-leg) drawn with a dark
outline and hatching so the two legs of the V can be told apart.
"""
from __future__ import annotations

from ..model.actions import PassKind
from .render_text import pass_label
from ..model.schedule import Schedule

__all__ = ["render_svg", "render_png", "PASS_COLOURS"]

PASS_COLOURS = {
    PassKind.F: (0.12, 0.47, 0.71),
    PassKind.B: (0.17, 0.63, 0.17),
    PassKind.W: (1.00, 0.50, 0.05),
    PassKind.BW: (0.58, 0.40, 0.74),
}


def _shade(rgb, microbatch: int, microbatches: int):
    """Blend toward white for later microbatches (at most 55 % white)."""
    mix = 0.55 * (microbatch % 8) / 8 if microbatches > 1 else 0.0
    return tuple(c + (1.0 - c) * mix for c in rgb)


def _boxes(schedule: Schedule, start, end):
    for r in range(schedule.ranks):
        for action, s, e in zip(schedule.compute_actions(r), start[r], end[r]):
            chunk = schedule.placement.locate(action.stage)[1]
            colour = _shade(PASS_COLOURS[action.kind], action.microbatch, schedule.microbatches)
            yield r, action, s, e, chunk, colour


def render_svg(schedule: Schedule, start, end, title: str = "") -> str:
    """An SVG document of the timeline (``start``/``end`` from :func:`.simulate.simulate`)."""
    makespan = max(e[-1] for e in end if e)
    scale = min(24.0, 1600.0 / makespan)
    row, left, top = 22, 60, 28
    width = left + makespan * scale + 10
    height = top + schedule.ranks * row + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'font-family="monospace" font-size="10">',
        '<defs><pattern id="up" width="4" height="4" patternUnits="userSpaceOnUse">'
        '<path d="M0,4 L4,0" stroke="black" stroke-width="0.6" opacity="0.45"/></pattern></defs>',
        f'<text x="4" y="16" font-size="12">{title}</text>',
    ]
    for r in range(schedule.ranks):
        parts.append(f'<text x="4" y="{top + r * row + 14}">rank {r}</text>')
    for r, action, s, e, chunk, colour in _boxes(schedule, start, end):
        x, y, w = left + s * scale, top + r * row, (e - s) * scale
        fill = "#%02x%02x%02x" % tuple(round(255 * c) for c in colour)
        stroke = ' stroke="black" stroke-width="1.2"' if chunk else ' stroke="white" stroke-width="0.5"'
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 4}" fill="{fill}"{stroke}>'
                     f'<title>{action}</title></rect>')
        if chunk:
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 4}" fill="url(#up)"/>')
        if w >= 14:
            parts.append(f'<text x="{x + 2:.2f}" y="{y + 12}" fill="white">{pass_label(schedule, action)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _pyplot():
    """matplotlib's pyplot on the file-only backend (the ``[plot]`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("PNG output needs matplotlib: pip install 'megatron-vshape[plot]'") from err
    return plt


def render_png(schedule: Schedule, start, end, path: str, title: str = "") -> None:
    """Write a PNG of the timeline with matplotlib (the ``[plot]`` extra)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    makespan = max(e[-1] for e in end if e)
    passes = max(len(e) for e in end)  # width by passes per rank: any time unit reads the same
    fig, ax = plt.subplots(figsize=(min(24, 4 + passes / 4), 0.45 * schedule.ranks + 1.2))
    for r, action, s, e, chunk, colour in _boxes(schedule, start, end):
        ax.barh(r, e - s, left=s, height=0.8, color=colour, hatch="///" if chunk else None,
                edgecolor="black" if chunk else "white", linewidth=0.6)
        if (e - s) * 40 / makespan > 0.5 and schedule.microbatches <= 64:
            ax.text(s + (e - s) / 2, r, pass_label(schedule, action), ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks(range(schedule.ranks), [f"rank {r}" for r in range(schedule.ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title)
    legend = [Patch(color=PASS_COLOURS[k], label=k.value) for k in PASS_COLOURS]
    legend.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="chunk 1"))
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_frontier(points, fixed, path: str, title: str = "") -> None:
    """Bubble rate vs peak memory (relative to 1F1B), like the paper's bubble-vs-memory figure.

    ``points`` are the adaptive frontier's (memory, bubble) pairs, drawn as a staircase (a
    limit between two points gets the left one); ``fixed`` are (name, memory, bubble) markers.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if points:
        xs, ys = zip(*sorted(points))
        ax.step(xs, ys, where="post", color="black", label="auto (frontier)")
        ax.plot(xs, ys, "o", color="black", markersize=4)
    for name, memory, bubble in fixed:
        ax.plot(memory, bubble, "s", markersize=7, label=name)
    ax.set_xlabel("peak activation memory / 1F1B's")
    ax.set_ylabel("bubble rate")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
