"""The PNG plots of ``dsv4-oracle check --report DIR`` (matplotlib, drawn off-screen).

- :func:`plot_ratio_grid`: error/bound per case (rows) and quantity (columns);
- :func:`plot_worst_case`: for the worst case, per ``(row, head)`` error/bound of ``out``,
  ``lse`` and ``dq``, with padding and sink-only rows marked.

Both use one colour scale: log10 of the ratio, green well below the bound, yellow at the bound
(ratio 1), red above it.
"""
from __future__ import annotations

import math

import numpy as np

from .conformance import QUANTITIES
from .report import NUMERIC, fmt_ratio

__all__ = ["plot_ratio_grid", "plot_worst_case"]

LOG_MIN, LOG_MAX = -4.0, 2.0          # colour range of log10(ratio); 0 is the bound


def _mpl():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    return plt, TwoSlopeNorm(vmin=LOG_MIN, vcenter=0.0, vmax=LOG_MAX), matplotlib.colormaps[
        "RdYlGn_r"]


def _log(r):
    r = np.asarray(r, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log10(np.where(r > 0, r, 10.0 ** (LOG_MIN - 1)))
    out = np.where(np.isnan(r), np.nan, out)
    return np.clip(out, LOG_MIN, LOG_MAX)


def _ratio(r) -> float:
    if isinstance(r, str):
        return math.inf if r == "inf" else math.nan
    return float(r)


def plot_ratio_grid(result, path: str) -> bool:
    """Error/bound per case and quantity; exact/determinism quantities as pass/fail cells."""
    outcomes = result.outcomes
    if not outcomes:
        return False
    present = {c.extra.get("quantity") for o in outcomes for c in o.checks}
    cols = [q for q in QUANTITIES if q in present]
    if not cols:
        return False
    n, m = len(outcomes), len(cols)
    ratio = np.full((n, m), np.nan)
    status = np.full((n, m), np.nan)          # 1 all passed, 0 some failed, nan not checked
    for i, o in enumerate(outcomes):
        for c in o.checks:
            j = cols.index(c.extra.get("quantity"))
            if not c.judged:              # a check that cannot fail shows as not checked
                continue
            status[i, j] = min(1.0 if np.isnan(status[i, j]) else status[i, j], float(c.passed))
            if c.ratio is not None:
                r = _ratio(c.ratio)
                ratio[i, j] = r if np.isnan(ratio[i, j]) else max(ratio[i, j], r)
    plt, norm, cmap = _mpl()
    fig_w = max(7.0, 0.62 * m + 3.2)
    fig_h = max(3.0, 0.26 * n + 2.2)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=110)
    shown = np.where(np.isnan(ratio), np.nan, _log(ratio))
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto",
                   interpolation="nearest")
    ax.set_facecolor("white")
    small = n * m <= 2500
    for i in range(n):
        for j in range(m):
            numeric = cols[j] in NUMERIC
            if np.isnan(status[i, j]):
                continue
            failed = status[i, j] == 0
            if not numeric or np.isnan(ratio[i, j]):
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1,
                                           color="#d62728" if failed else "#e8e8e8", lw=0))
                if small:
                    ax.text(j, i, "FAIL" if failed else "=", ha="center", va="center",
                            fontsize=6.5, color="white" if failed else "#555555",
                            fontweight="bold" if failed else "normal")
            else:
                if small:
                    v = ratio[i, j]
                    ax.text(j, i, fmt_ratio(float(v)), ha="center", va="center", fontsize=6,
                            color="white" if (v > 1 or v < 10 ** (LOG_MIN + 0.6)) else "black")
            if failed:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                           edgecolor="black", lw=1.6))
    ax.set_xticks(range(m))
    ax.set_xticklabels(cols, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n))
    ax.set_yticklabels([("FAIL  " if not o.passed else "") + o.case.id for o in outcomes],
                       fontsize=7)
    for lbl, o in zip(ax.get_yticklabels(), outcomes):
        if not o.passed:
            lbl.set_color("#d62728")
    ax.set_xticks(np.arange(-0.5, m, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, n, 1), minor=True)
    ax.grid(which="minor", color="white", lw=0.6)
    ax.tick_params(which="minor", length=0)
    verdict = "PASS" if result.passed else "FAIL"
    ax.set_title(f"{verdict}: error / bound per case and quantity\n{result.adapter.spec} on "
                 f"{result.adapter.device}, {result.catalog} catalog "
                 f"(worst over the op and layer levels; '=' exact check passed)", fontsize=9)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    ticks = np.arange(LOG_MIN, LOG_MAX + 1)
    cb.set_ticks(ticks)
    cb.set_ticklabels([f"1e{int(t)}" if t else "1 (bound)" for t in ticks])
    cb.set_label("error / bound (log scale)", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _worst_outcome(result):
    best = None
    for o in result.outcomes:
        maps = o.maps or {}
        for q in ("out", "lse", "dq"):
            if q in maps and maps[q].size:
                v = float(np.max(np.where(np.isnan(maps[q]), np.inf, maps[q])))
                if best is None or v > best[0]:
                    best = (v, o)
    return None if best is None else best[1]


def plot_worst_case(result, path: str) -> bool:
    """Rows x heads heat maps of error/bound (``out``, ``lse``, ``dq``) for the worst case, with
    a strip marking padding rows and sink-only rows (no valid key)."""
    o = _worst_outcome(result)
    if o is None:
        return False
    maps = o.maps
    qs = [q for q in ("out", "lse", "dq") if q in maps]
    plt, norm, cmap = _mpl()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    T = maps[qs[0]].shape[0]
    pad = np.asarray(maps.get("padding", np.zeros(T, bool)), dtype=bool)
    sink = np.asarray(maps.get("sink_only", np.zeros(T, bool)), dtype=bool)
    flags = (pad.astype(int) * 2 + sink.astype(int)).reshape(T, 1)
    flag_colors = ["#ffffff", "#8e44ad", "#c7c7c7", "#555555"]
    flag_names = ["real row with keys", "real row, sink-only (no valid key)",
                  "padding/capacity row with keys", "padding/capacity row (sink-only)"]
    heads = max(maps[q].shape[1] for q in qs)
    fig_h = min(12.0, max(4.8, 3.2 + T * 0.035))
    fig_w = 2.0 + sum(min(6.0, max(2.2, 0.22 * maps[q].shape[1] + 1.4)) for q in qs)
    widths = [0.35] + [min(6.0, max(2.2, 0.22 * maps[q].shape[1] + 1.4)) for q in qs]
    fig, axes = plt.subplots(1, len(qs) + 1, figsize=(fig_w, fig_h), dpi=110,
                             gridspec_kw={"width_ratios": widths}, sharey=True)
    axes[0].imshow(flags, cmap=ListedColormap(flag_colors), vmin=-0.5, vmax=3.5, aspect="auto",
                   interpolation="nearest")
    axes[0].set_xticks([])
    axes[0].set_ylabel("packed row t", fontsize=8)
    axes[0].set_title("rows", fontsize=8)
    worst_txt = []
    im = None
    for ax, q in zip(axes[1:], qs):
        r = np.where(np.isnan(maps[q]), np.inf, maps[q])
        im = ax.imshow(_log(r), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        t, h = np.unravel_index(int(np.argmax(r)), r.shape)
        ax.plot([h], [t], marker="o", ms=9, mfc="none", mec="black", mew=1.5)
        worst_txt.append(f"{q} {fmt_ratio(float(r[t, h]))} at row {t}, head {h}")
        # padding / sink-only rows: a hatched overlay so they read as "expected exact"
        for rows, hatch in ((pad, "//"), (sink & ~pad, "\\\\")):
            for t0, t1 in _runs(rows):
                ax.add_patch(plt.Rectangle((-0.5, t0 - 0.5), r.shape[1], t1 - t0, fill=False,
                                           hatch=hatch, edgecolor="#333333", lw=0.6,
                                           alpha=0.55))
        ax.set_title(f"{q}: max {fmt_ratio(float(r.max()))}", fontsize=9)
        ax.set_xlabel("head" if r.shape[1] > 1 else "", fontsize=8)
        if r.shape[1] <= 16:
            ax.set_xticks(range(r.shape[1]))
        ax.tick_params(labelsize=7)
    top = 1.0 - 0.95 / fig_h
    bottom = 1.05 / fig_h
    fig.subplots_adjust(left=0.08, right=0.85, top=top, bottom=bottom, wspace=0.08)
    cb = fig.colorbar(im, cax=fig.add_axes([0.875, bottom, 0.015, top - bottom]))
    ticks = np.arange(LOG_MIN, LOG_MAX + 1)
    cb.set_ticks(ticks)
    cb.set_ticklabels([f"1e{int(t)}" if t else "1 (bound)" for t in ticks])
    cb.set_label("error / bound per (row, head), max over the feature dim", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    level = maps.get("level", "op")
    fig.suptitle(f"worst case {o.case.id} [{level}] ({'PASS' if o.passed else 'FAIL'}): "
                 f"T={T}, H={heads}\n" + "; ".join(worst_txt), fontsize=9)
    used = sorted(set(int(f) for f in flags.ravel()))
    handles = [Patch(facecolor=flag_colors[i], edgecolor="black", label=flag_names[i])
               for i in used]
    handles += [Patch(facecolor="white", edgecolor="#333333", hatch="//",
                      label="hatched: padding/capacity rows"),
                Patch(facecolor="white", edgecolor="#333333", hatch="\\\\",
                      label="hatched: sink-only real rows")][:1 + int(bool((sink & ~pad).any()))]
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=7,
               frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path)
    plt.close(fig)
    return True


def _runs(mask):
    """``(start, stop)`` of the runs of True in a 1-D bool array."""
    out, start = [], None
    for i, v in enumerate(list(mask) + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out
