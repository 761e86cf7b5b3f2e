"""How messages to the user are worded: the closest valid name to a slip (a case id, an op,
an adapter attribute, a built-in implementation, a file) for one-line usage errors ("did you
mean ...?"), and counts with their plural ("1 case", "2 cases")."""
from __future__ import annotations

import difflib

__all__ = ["closest", "did_you_mean", "misspelling_of", "plural"]


def plural(n: int, word: str, words: str | None = None) -> str:
    """``"1 case"``, ``"2 cases"`` (``words``: the plural when it is not ``word + "s"``)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def closest(word: str, choices, n: int = 1, cutoff: float = 0.75) -> list[str]:
    """Up to ``n`` of ``choices`` most similar to ``word`` (``difflib``'s ratio, at least
    ``cutoff``), best first."""
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=cutoff)


def did_you_mean(word: str, choices, cutoff: float = 0.75) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""``."""
    best = closest(word, choices, cutoff=cutoff)
    return f"; did you mean {best[0]!r}?" if best else ""


def _edits(a: str, b: str) -> int:
    """The optimal-string-alignment distance: insertions, deletions, substitutions and swaps
    of neighbours."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def misspelling_of(name: str, choices, max_edits: int = 2) -> str | None:
    """The one of ``choices`` that ``name`` misspells (it differs from it by case only, or by
    at most ``max_edits`` edits), or ``None``; a name in ``choices`` misspells nothing."""
    if name in choices:
        return None
    best = min(choices, key=lambda c: _edits(name.lower(), c.lower()), default=None)
    if best is not None and _edits(name.lower(), best.lower()) <= max_edits:
        return best
    return None
