"""What the run's plots share: each member's colour, and a key to the colours beside the axes."""

from __future__ import annotations

from typing import Any

#: Up to this many members each gets a colour of its own (matplotlib's ten) and a legend entry;
#: more share a colour scale, keyed by a colour bar (a legend of 64 entries outgrew the plot,
#: and its colours repeated every ten members).
_LEGEND_MAX = 10


def member_colors(n: int) -> list[Any]:
    """Member i's colour, the same in every plot of a run."""
    if n <= _LEGEND_MAX:
        return [f"C{i}" for i in range(n)]
    from matplotlib import colormaps

    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def member_key(fig: Any, axes: Any, n: int) -> None:
    """A key to the member colours beside the axes, outside them (``fig`` made with
    ``layout="constrained"``, which makes room for it). Drawn inside the axes, 8 members'
    legend was wider than the figure and cut the last members off, and it hid the lines."""
    if n <= _LEGEND_MAX:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right upper", fontsize=7)
        return
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    scale = ScalarMappable(Normalize(0, n - 1), "viridis")
    fig.colorbar(scale, ax=axes, label="member", fraction=0.04)
