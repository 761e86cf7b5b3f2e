"""The PNG plots of ``dsv4-oracle check --report DIR`` (matplotlib, drawn off-screen; the
optional extra ``report``: without matplotlib, :func:`unavailable` says why and the report is
written without plots).

- :func:`plot_ratio_grid` (``ratios.png``): error/bound per case (rows) and quantity (columns),
  the worst over the op and layer levels; cells no check judged are marked by why
  (:func:`ratio_grid` computes the cells, :func:`grid_legend` the legend);
- :func:`plot_worst_case` (``worst_case.png``): on a passing run the summary's worst check
  (the same rule, ``dsv4_oracle.report._worst``), on a failing run a typical failing check
  (:func:`typical_failure`): per ``(row, head)`` error/bound of that case, level and
  quantity, with the other maps of that case and level beside it and padding and sink-only
  rows marked (:func:`worst_view` chooses what is shown).

Both use one colour scale with a hard break at the bound (ratio 1): decades of blue for ratios
<= 1 (a pass), decades of red for ratios > 1 and ``inf`` (a failure); :func:`ratio_color`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .conformance import QUANTITIES
from .report import _worst as worst_check, fmt_ratio

__all__ = ["unavailable", "ratio_bins", "ratio_color", "PASS_COLORS", "FAIL_COLORS",
           "BIN_LABELS", "CELL_STYLES", "RatioGrid", "ratio_grid", "grid_legend",
           "plot_ratio_grid", "WorstView", "worst_view", "plot_worst_case", "MAPPED"]

# the colour bins of error/bound, right-closed decades: bins 0-4 are <= 1 (blue), 5-8 > 1 (red)
BIN_LABELS = ("<= 1e-4", "(1e-4, 1e-3]", "(1e-3, 0.01]", "(0.01, 0.1]", "(0.1, 1]",
              "(1, 10]", "(10, 100]", "> 100", "inf / nan")
PASS_COLORS = ("#eff3ff", "#c6dbef", "#9ecae1", "#6baed6", "#2171b5")
FAIL_COLORS = ("#fc9272", "#ef3b2c", "#a50f15", "#4a000a")
_N_PASS = len(PASS_COLORS)
_DARK = {3, 4, 5, 6, 7, 8}                  # bins whose cells take white text

# cell kinds of the ratio grid other than a colour bin: how each is drawn and what the legend
# says (``face``: fill colour, ``hatch``: matplotlib hatch or "", ``text``: what small grids
# write in the cell)
CELL_STYLES = {
    "exact": {"face": PASS_COLORS[0], "hatch": "", "text": "=",
              "label": "= exact check passed (compared for equality)"},
    "failed": {"face": FAIL_COLORS[-1], "hatch": "", "text": "FAIL",
               "label": "FAIL: a check failed without a ratio over 1 (an exact check)"},
    "not_judged": {"face": "#d9d9d9", "hatch": "////", "text": "",
                   "label": "hatched grey: not judged (cannot fail: ill-conditioned, "
                            "nothing to compare, or upstream output unusable)"},
    "not_run": {"face": "#969696", "hatch": "", "text": "",
                "label": "dark grey: not run (the case's setup or one of its ops raised)"},
    "absent": {"face": "#ffffff", "hatch": "", "text": "",
               "label": "blank: no check of this quantity in this case (not produced)"},
}
MAPPED = ("out", "lse", "dq")                # the quantities with a per (row, head) map


def unavailable() -> str | None:
    """Why the plots cannot be drawn (one line), or ``None`` when matplotlib is importable."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'dsv4-oracle[report]')"
    return None


def ratio_bins(r) -> np.ndarray:
    """The colour bin (0 to 8, :data:`BIN_LABELS`) of each error/bound ratio: bins 0-4 hold
    ratios <= 1 (1.0 itself in bin 4), bins 5-8 ratios > 1; ``inf`` and ``nan`` in bin 8. The
    pass/fail split compares the ratio with 1 directly (no rounding through the logarithm)."""
    r = np.asarray(r, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.ceil(np.log10(np.where(r > 0, r, 1e-300)))
    k = np.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
    low = (_N_PASS - 1) + np.clip(k, -(_N_PASS - 1), 0)          # r <= 1
    high = _N_PASS + np.clip(k - 1, 0, 2)                         # 1 < r < inf
    out = np.where(r > 1, high, low)
    out = np.where(np.isinf(r) | np.isnan(r), len(BIN_LABELS) - 1, out)
    return out.astype(np.int64)


def ratio_color(r) -> str:
    """The colour of one error/bound ratio: one of :data:`PASS_COLORS` when ``r <= 1``, one of
    :data:`FAIL_COLORS` when ``r > 1`` (``inf``, ``nan`` included)."""
    return (PASS_COLORS + FAIL_COLORS)[int(ratio_bins(r))]


def _as_float(r) -> float:
    if isinstance(r, str):
        return math.inf if r == "inf" else math.nan
    return float(r)


# ---------------------------------------------------------------------------------------------
# ratios.png
# ---------------------------------------------------------------------------------------------
@dataclass
class RatioGrid:
    """The cells of ``ratios.png``: ``cases`` (ids, rows), ``failed_cases`` (their verdicts),
    ``quantities`` (columns, pipeline order); per cell ``kind`` (``"ratio"`` or a key of
    :data:`CELL_STYLES`), ``ratio`` (worst judged ratio over the levels, nan if none),
    ``failed`` (some check of the cell failed) and ``color``."""

    cases: list
    failed_cases: list
    quantities: list
    kind: np.ndarray
    ratio: np.ndarray
    failed: np.ndarray
    color: np.ndarray = field(repr=False)


def ratio_grid(result) -> RatioGrid | None:
    """The cells of ``ratios.png`` (``None`` when nothing was checked). Per (case, quantity),
    over the op and layer levels: a failed check makes the cell red (its ratio's bin when that
    ratio is over 1, else ``"failed"``); otherwise the worst judged ratio's bin, ``"exact"``
    for passed checks without a ratio, ``"not_judged"`` when every check of the cell could
    not be judged; without any check, ``"not_run"`` when the case's setup or one of its ops
    raised, else ``"absent"``."""
    outcomes = result.outcomes
    present = {c.extra.get("quantity", "run") for o in outcomes for c in o.checks}
    cols = [q for q in QUANTITIES if q in present]
    if not outcomes or not cols:
        return None
    n, m = len(outcomes), len(cols)
    kind = np.full((n, m), "absent", dtype=object)
    ratio = np.full((n, m), np.nan)
    failed = np.zeros((n, m), dtype=bool)
    color = np.full((n, m), CELL_STYLES["absent"]["face"], dtype=object)
    for i, o in enumerate(outcomes):
        ran = o.error is None and not any(
            not c.passed and c.extra.get("quantity", "run") == "run" for c in o.checks)
        for j, q in enumerate(cols):
            checks = [c for c in o.checks if c.extra.get("quantity", "run") == q]
            judged = [c for c in checks if c.judged]
            ratios = [_as_float(c.ratio) for c in judged if c.ratio is not None]
            if ratios:
                ratio[i, j] = max(ratios, key=lambda v: math.inf if math.isnan(v) else v)
            failed[i, j] = any(not c.passed for c in checks)
            if not checks:
                kind[i, j] = "absent" if ran else "not_run"
            elif not judged:
                kind[i, j] = "not_judged"
            elif ratios and (not failed[i, j] or not ratio[i, j] <= 1):
                kind[i, j] = "ratio"
            else:
                kind[i, j] = "failed" if failed[i, j] else "exact"
            color[i, j] = (ratio_color(ratio[i, j]) if kind[i, j] == "ratio"
                           else CELL_STYLES[kind[i, j]]["face"])
    return RatioGrid([o.case.id for o in outcomes], [not o.passed for o in outcomes], cols,
                     kind, ratio, failed, color)


def grid_legend(grid: RatioGrid) -> list[tuple[str, str]]:
    """``(key, label)`` of the legend of ``ratios.png``: one entry per kind of cell other than
    a ratio that the grid holds (in :data:`CELL_STYLES` order), and ``"outline"`` when a cell
    failed. The ratios themselves are explained by the colour bar."""
    kinds = set(grid.kind.ravel())
    out = [(k, s["label"]) for k, s in CELL_STYLES.items() if k in kinds]
    if grid.failed.any():
        out.append(("outline", "black outline: a check of the cell failed"))
    return out


def _mpl():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _colorbar(fig, cax, label: str, **kw):
    """The discrete colour bar of :data:`BIN_LABELS` with a thick line at the bound."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap
    n = len(BIN_LABELS)
    sm = ScalarMappable(norm=BoundaryNorm(np.arange(-0.5, n), n),
                        cmap=ListedColormap(PASS_COLORS + FAIL_COLORS))
    cb = fig.colorbar(sm, **kw) if cax is None else fig.colorbar(sm, cax=cax)
    cb.set_ticks(np.arange(n))
    cb.set_ticklabels(BIN_LABELS)
    cb.ax.plot([-0.6, 1.6], [_N_PASS - 0.5] * 2, color="black", lw=2.5, clip_on=False,
               transform=cb.ax.get_yaxis_transform())          # the bound: ratio 1
    cb.set_label(label, fontsize=8)
    cb.ax.tick_params(labelsize=7)
    return cb


def plot_ratio_grid(result, path: str) -> bool:
    """Draw ``ratios.png`` (see :func:`ratio_grid`); ``False`` when nothing was checked."""
    g = ratio_grid(result)
    if g is None:
        return False
    plt = _mpl()
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch
    n, m = g.kind.shape
    legend = grid_legend(g)
    fig_w = max(8.0, 0.62 * m + 4.2)
    fig_h = max(3.6, 0.26 * n + 2.4 + 0.2 * len(legend))
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=110)
    rgba = np.array([[to_rgba(c) for c in row] for row in g.color])
    ax.imshow(rgba, aspect="auto", interpolation="nearest")
    small = n * m <= 2500
    for i in range(n):
        for j in range(m):
            k = g.kind[i, j]
            if CELL_STYLES.get(k, {}).get("hatch"):
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                           hatch=CELL_STYLES[k]["hatch"], edgecolor="#737373",
                                           lw=0))
            if small:
                if k == "ratio":
                    txt = fmt_ratio(float(g.ratio[i, j]))
                    dark = int(ratio_bins(g.ratio[i, j])) in _DARK
                else:
                    txt, dark = CELL_STYLES[k]["text"], k in ("failed", "not_run")
                if txt:
                    ax.text(j, i, txt, ha="center", va="center", fontsize=6,
                            color="white" if dark else "black",
                            fontweight="bold" if g.failed[i, j] else "normal")
            if g.failed[i, j]:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                           edgecolor="black", lw=1.6))
    ax.set_xticks(range(m))
    ax.set_xticklabels(g.quantities, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n))
    ax.set_yticklabels([("FAIL  " if f else "") + c for c, f in zip(g.cases, g.failed_cases)],
                       fontsize=7)
    for lbl, f in zip(ax.get_yticklabels(), g.failed_cases):
        if f:
            lbl.set_color(FAIL_COLORS[1])
    ax.set_xticks(np.arange(-0.5, m, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, n, 1), minor=True)
    ax.grid(which="minor", color="white", lw=0.6)
    ax.tick_params(which="minor", length=0)
    verdict = "PASS" if result.passed else "FAIL"
    ax.set_title(f"{verdict}: error / bound per case and quantity (worst over the op and layer "
                 f"levels)\n{result.adapter.spec} on {result.adapter.device}, "
                 f"{result.catalog} catalog", fontsize=9)
    _colorbar(fig, None, "error / bound (black line: the bound)", ax=ax,
              fraction=0.04, pad=0.02)
    handles = []
    for key, label in legend:
        if key == "outline":
            handles.append(Patch(facecolor="white", edgecolor="black", lw=1.6, label=label))
        else:
            s = CELL_STYLES[key]
            handles.append(Patch(facecolor=s["face"], edgecolor="#737373", hatch=s["hatch"],
                                 label=label))
    if handles:
        fig.legend(handles=handles, loc="lower left", ncol=1, fontsize=7, frameon=False,
                   bbox_to_anchor=(0.01, 0.0))
    fig.tight_layout(rect=(0, (0.18 * len(handles) + 0.1) / fig_h, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# worst_case.png
# ---------------------------------------------------------------------------------------------
@dataclass
class WorstView:
    """What ``worst_case.png`` shows: the summary's worst check (``case``, ``level``,
    ``quantity``, ``ratio``, ``case_passed``), the maps of that case and level (``panels``:
    the worst quantity first when it has a map, then the other mapped quantities), the row
    flags (``padding``, ``sink_only``) and ``note`` (why the worst quantity has no map, or
    ``None``)."""

    case: str
    level: str
    quantity: str
    ratio: float
    case_passed: bool
    panels: dict
    padding: np.ndarray | None
    sink_only: np.ndarray | None
    note: str | None
    typical_of: int | None = None       # a failing run: the median of this many failing checks


def typical_failure(result):
    """``(ratio, case, level, quantity, n)``: the check that represents a failing run, or
    ``None`` when no numeric check failed with a finite ratio. Of the failing quantity with a
    per-(row, head) map (:data:`MAPPED`) that fails most often (else of any failing quantity),
    the check with the median ratio among its ``n`` failing checks. A check that failed on a
    value the contract makes exactly 0 is left out: its bound is near 0, so its ratio (1e30
    and more) measures nothing."""
    fails: dict = {}
    for o in result.outcomes:
        for c in o.failed_checks:
            if c.kind == "numeric" and c.ratio is not None and np.isfinite(c.ratio) and \
                    not c.extra.get("expected_zero"):
                fails.setdefault(c.extra.get("quantity"), []).append((c.ratio, o.case.id,
                                                                      c.extra.get("level")))
    if not fails:
        return None
    order = list(QUANTITIES)
    q = max(fails, key=lambda q: (q in MAPPED, len(fails[q]),
                                  -order.index(q) if q in order else -len(order)))
    ranked = sorted(fails[q], key=lambda f: f[0])
    ratio, case_id, level = ranked[(len(ranked) - 1) // 2]
    return ratio, case_id, level, q, len(ranked)


def worst_view(result) -> WorstView | None:
    """The view of ``worst_case.png`` (``None`` when no check has a judged ratio): on a
    passing run the summary's worst check (``dsv4_oracle.report._worst``), on a failing one
    its :func:`typical_failure` (the most extreme ratio of a failing run is often an outlier:
    an element whose bound is near 0); never another case's maps."""
    typical = None if result.passed else typical_failure(result)
    w = typical[:4] if typical else worst_check(result)
    if w is None:
        return None
    ratio, case_id, level, quantity = w
    o = next(o for o in result.outcomes if o.case.id == case_id)
    maps = (o.maps or {}).get(level, {})
    order = [quantity] * (quantity in MAPPED) + [q for q in MAPPED if q != quantity]
    panels = {q: np.asarray(maps[q], dtype=np.float64) for q in order if q in maps}
    note = None
    if quantity not in panels:
        what = QUANTITIES.get(quantity, ("", quantity))[1]
        note = (f"no per-(row, head) map exists for {quantity} ({what}); maps are drawn for "
                f"{', '.join(MAPPED)} only" if quantity not in MAPPED else
                f"no per-(row, head) map of {quantity} at level {level} (its output had the "
                f"wrong shape or was not produced)")
        if panels:
            note += "; shown: the other maps of the same case and level"
    flags = {k: (np.asarray(maps[k], dtype=bool) if k in maps else None)
             for k in ("padding", "sink_only")}
    return WorstView(case_id, level, quantity, _as_float(ratio), o.passed, panels,
                     flags["padding"], flags["sink_only"], note,
                     typical[4] if typical else None)


def plot_worst_case(result, path: str) -> bool:
    """Draw ``worst_case.png`` (see :func:`worst_view`): rows x heads heat maps of error/bound
    with a strip marking padding rows and sink-only rows (no valid key); ``False`` when no
    check has a judged ratio."""
    v = worst_view(result)
    if v is None:
        return False
    plt = _mpl()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch
    what = (f"a typical failing check (the median ratio of {v.typical_of} failing "
            f"{v.quantity} checks)" if v.typical_of else "worst check of the run")
    title = (f"{what}: {v.quantity} of case {v.case} [{v.level}], ratio "
             f"{fmt_ratio(v.ratio)} ({'case passed' if v.case_passed else 'case FAILED'})")
    if not v.panels:
        fig = plt.figure(figsize=(8.0, 2.6), dpi=110)
        fig.text(0.5, 0.62, title, ha="center", va="center", fontsize=10)
        fig.text(0.5, 0.38, v.note + "\n(ratios.png shows every case and quantity)",
                 ha="center", va="center", fontsize=9, wrap=True)
        fig.savefig(path)
        plt.close(fig)
        return True
    qs = list(v.panels)
    T = v.panels[qs[0]].shape[0]
    pad = v.padding if v.padding is not None else np.zeros(T, bool)
    sink = v.sink_only if v.sink_only is not None else np.zeros(T, bool)
    flags = (pad.astype(int) * 2 + sink.astype(int)).reshape(T, 1)
    flag_colors = ["#ffffff", "#8e44ad", "#c7c7c7", "#555555"]
    flag_names = ["real row with keys", "real row, sink-only (no valid key)",
                  "padding/capacity row with keys", "padding/capacity row (sink-only)"]
    heads = max(v.panels[q].shape[1] for q in qs)
    widths = [0.35] + [min(6.0, max(2.2, 0.22 * v.panels[q].shape[1] + 1.4)) for q in qs]
    fig_h = min(12.0, max(5.2, 3.6 + T * 0.035))
    fig_w = 3.0 + sum(widths)
    fig, axes = plt.subplots(1, len(qs) + 1, figsize=(fig_w, fig_h), dpi=110,
                             gridspec_kw={"width_ratios": widths}, sharey=True)
    axes[0].imshow(flags, cmap=ListedColormap(flag_colors), vmin=-0.5, vmax=3.5, aspect="auto",
                   interpolation="nearest")
    axes[0].set_xticks([])
    axes[0].set_ylabel("packed row t", fontsize=8)
    axes[0].set_title("rows", fontsize=8)
    n_bins = len(BIN_LABELS)
    cmap = ListedColormap(PASS_COLORS + FAIL_COLORS)
    norm = BoundaryNorm(np.arange(-0.5, n_bins), n_bins)
    for ax, q in zip(axes[1:], qs):
        r = np.where(np.isnan(v.panels[q]), np.inf, v.panels[q])
        ax.imshow(ratio_bins(r), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        t, h = np.unravel_index(int(np.argmax(r)), r.shape)
        ax.plot([h], [t], marker="o", ms=9, mfc="none", mec="black", mew=1.5)
        for rows, hatch in ((pad, "//"), (sink & ~pad, "\\\\")):
            for t0, t1 in _runs(rows):
                ax.add_patch(plt.Rectangle((-0.5, t0 - 0.5), r.shape[1], t1 - t0, fill=False,
                                           hatch=hatch, edgecolor="#333333", lw=0.6,
                                           alpha=0.55))
        mark = ((" (the check shown)" if v.typical_of else " (the worst check)")
                if q == v.quantity else "")
        ax.set_title(f"{q}{mark}\nmax {fmt_ratio(float(r[t, h]))} at row {t}, head {h}",
                     fontsize=8, fontweight="bold" if mark else "normal")
        ax.set_xlabel("head" if r.shape[1] > 1 else "", fontsize=8)
        if r.shape[1] <= 16:
            ax.set_xticks(range(r.shape[1]))
        ax.tick_params(labelsize=7)
    top = 1.0 - 1.25 / fig_h
    bottom = 1.15 / fig_h
    fig.subplots_adjust(left=0.08, right=0.80, top=top, bottom=bottom, wspace=0.08)
    _colorbar(fig, fig.add_axes([0.83, bottom, 0.015, top - bottom]),
              "error / bound per (row, head), max over the feature dim;\n"
              "black line: the bound")
    sub = (f"T={T}, H={heads}; maps include ill-conditioned elements, which the check's "
           f"ratio leaves out")
    if v.note:
        sub = v.note + "\n" + sub
    fig.suptitle(title + "\n" + sub, fontsize=9)
    used = sorted(set(int(f) for f in flags.ravel()))
    handles = [Patch(facecolor=flag_colors[i], edgecolor="black", label=flag_names[i])
               for i in used]
    if pad.any():
        handles.append(Patch(facecolor="white", edgecolor="#333333", hatch="//",
                             label="hatched: padding/capacity rows"))
    if (sink & ~pad).any():
        handles.append(Patch(facecolor="white", edgecolor="#333333", hatch="\\\\",
                             label="hatched: sink-only real rows"))
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
