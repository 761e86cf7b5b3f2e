"""What ``dsv4-oracle check`` shows and writes: the terminal summary, ``report.json`` (a stable,
versioned schema: :data:`SCHEMA_VERSION`, checked by :func:`validate_report`), ``report.md``,
PNG plots and a JUnit XML file.

- terminal: one row per quantity (worst error/bound ratio over every case and level, failures
  first; checks that could not be judged counted apart), then every failing check with its
  pointed message, the backward convention the implementation follows (contract section 6),
  then the verdict;
- ``report.json``: every check of every case (:func:`report_dict`);
- ``ratios.png``: error/bound per case (rows) and quantity (columns), log colour scale centred
  on the bound (ratio 1); exact and determinism checks as pass/fail cells;
- ``worst_case.png``: for the case with the largest ratio, per ``(row, head)`` error/bound of
  ``out``, ``lse`` and ``dq``, with padding and sink-only rows marked in a side strip.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from typing import Callable

import torch

from .compare import STATUSES
from .conformance import BACKWARD_CONVENTIONS, QUANTITIES
from .runner import LEVELS, RunResult
from .wording import plural

__all__ = ["SCHEMA", "SCHEMA_VERSION", "quantity_rows", "report_dict", "validate_report",
           "format_summary", "format_case", "write_report", "write_junit", "fmt_ratio",
           "backward_conventions", "backward_convention_sources"]

SCHEMA = "dsv4-oracle/check-report"
# 2: every check has a status (passed / failed / not_judged); the summary counts checks not
# judged and the backward convention per level; quantities count their not-judged checks
SCHEMA_VERSION = 2
CHECK_KINDS = ("numeric", "exact", "topk", "replay", "grad_mode", "no_mutation", "error", "rejects",
               "convention")
NUMERIC = tuple(q for q in QUANTITIES if q in (
    "scores", "out", "lse", "dq", "dkv", "dsink", "loss", "kl", "target", "predict", "dq_idx",
    "dw", "dk_idx"))


def fmt_ratio(r) -> str:
    if r is None:
        return "-"
    if isinstance(r, str):
        return r
    if math.isinf(r) or math.isnan(r):
        return str(r)
    if r == 0:
        return "0"
    return f"{r:.3g}" if 1e-3 <= r < 1e4 else f"{r:.2e}"


def _ratio_key(r) -> float:
    return -1.0 if r is None else (math.inf if isinstance(r, float) and math.isnan(r) else r)


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------
def quantity_rows(result: RunResult) -> list[dict]:
    """Per quantity: checks, failures, worst ratio and where; failures first, then by worst
    ratio (largest first), exact-only quantities last in pipeline order."""
    rows: dict = {}
    for o in result.outcomes:
        for c in o.checks:
            q = c.extra.get("quantity", "run")
            lv = c.extra.get("level", "op")
            r = rows.setdefault(q, {"quantity": q, "section": QUANTITIES.get(q, ("-", ""))[0],
                                    "levels": [], "checks": 0, "failed": 0, "not_judged": 0,
                                    "worst_ratio": None, "worst_case": None, "worst_level": None,
                                    "first_failure": None})
            if lv not in r["levels"]:
                r["levels"].append(lv)
            r["checks"] += 1
            if not c.judged:
                r["not_judged"] += 1
                continue
            if not c.passed:
                r["failed"] += 1
                if r["first_failure"] is None:
                    r["first_failure"] = f"{o.case.id} [{lv}] {c.name}: {c.detail}"
            if c.ratio is not None and _ratio_key(c.ratio) > _ratio_key(r["worst_ratio"]):
                r["worst_ratio"], r["worst_case"], r["worst_level"] = c.ratio, o.case.id, lv
    order = list(QUANTITIES)
    return sorted(rows.values(), key=lambda r: (
        r["failed"] == 0, r["worst_ratio"] is None, -_ratio_key(r["worst_ratio"]),
        order.index(r["quantity"]) if r["quantity"] in order else len(order)))


def _machine() -> dict:
    cuda = torch.cuda.is_available()
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name(0) if cuda else None}


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("dsv4-oracle")
    except Exception:                  # running from a source tree that is not installed
        return "unknown"


def _worst(result: RunResult):
    best = None
    for o in result.outcomes:
        for c in o.checks:
            if c.judged and c.ratio is not None and (best is None or _ratio_key(c.ratio)
                                                     > _ratio_key(best[0])):
                best = (c.ratio, o.case.id, c.extra.get("level"), c.extra.get("quantity"))
    return best


_CONVENTION_SOURCES = {"probe": "measured", "probe on the op": "measured on the op",
                       "declared": "declared", "closest": "closest"}


def _convention_counts(result: RunResult, key: Callable) -> dict:
    out: dict = {}
    for o in result.outcomes:
        seen = {}
        for c in o.checks:
            if c.extra.get("convention") is not None and c.extra.get("convention_source"):
                seen[c.extra.get("level", "op")] = key(c.extra)
        for lv, k in seen.items():
            d = out.setdefault(lv, {})
            d[k] = d.get(k, 0) + 1
    return out


def backward_conventions(result: RunResult) -> dict:
    """Per level, how many cases' attention backward was judged under each convention of
    contract section 6 (``"given"``: ``Delta`` from the ``out`` it was handed;
    ``"recomputed"``: from its own forward)."""
    return _convention_counts(result, lambda e: e["convention"])


def backward_convention_sources(result: RunResult) -> dict:
    """Per level, how the convention was known, in how many cases: ``"measured"`` (the probe),
    ``"measured on the op"`` (the packed layer, from its op's probe), ``"declared"`` (the
    adapter's ``backward_convention``), ``"closest"`` (no probe, or a case that cannot tell
    the two apart: the convention the gradients are closer to)."""
    return _convention_counts(result, lambda e: _CONVENTION_SOURCES.get(
        e["convention_source"], e["convention_source"]))


def _conventions_line(conv: dict, sources: dict) -> str | None:
    if not conv:
        return None
    parts = []
    for lv, d in conv.items():
        how = ", ".join(f"{k} in {n}" for k, n in sorted(sources.get(lv, {}).items()))
        parts.append(f"{lv}: " + ", ".join(f"{k} in {n} case{'s' * (n != 1)}"
                                           for k, n in sorted(d.items()))
                     + (f" ({how})" if how else ""))
    return ("backward convention (contract section 6; 'given': Delta from the out it was "
            "handed, 'recomputed': from its own forward): " + "; ".join(parts))


def _json_ratio(r):
    if r is None or (isinstance(r, float) and math.isfinite(r)):
        return r
    return "nan" if math.isnan(r) else ("inf" if r > 0 else "-inf")


def report_dict(result: RunResult, *, argv=None) -> dict:
    """The report as a JSON-ready dict (schema :data:`SCHEMA` version :data:`SCHEMA_VERSION`)."""
    from dsv4_oracle import reference
    from .runner import policy_summary, precision_summary
    worst = _worst(result)
    cases = []
    for o in result.outcomes:
        checks = []
        for c in o.checks:
            d = c.to_dict()
            d["status"] = c.status
            d["quantity"] = c.extra.get("quantity", "run")
            d["level"] = c.extra.get("level", "op")
            checks.append(d)
        cases.append({
            "id": o.case.id, "passed": o.passed, "error": o.error,
            "elapsed_s": round(o.elapsed_s, 4), "categories": list(o.case.categories),
            "case": o.case.to_dict(), "precision": o.precision,
            "backends": {lv: dict(b) for lv, b in o.backends.items()},
            "checks": checks})
    n_checks = sum(len(o.checks) for o in result.outcomes)
    n_failed = sum(len(o.failed_checks) for o in result.outcomes)
    n_not_judged = sum(not c.judged for o in result.outcomes for c in o.checks)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "passed": result.passed,
        "tool": {"dsv4_oracle": _version(), "oracle": reference.ORACLE_VERSION},
        "machine": _machine(),
        "run": {"impl": result.adapter.spec, "adapter": result.adapter.name,
                "device": result.adapter.device, "ops": list(result.ops),
                "catalog": result.catalog, "case_patterns": list(result.patterns),
                "replays": result.replays, "precision": precision_summary(result),
                "policies": policy_summary(result),
                "started_utc": result.started_utc,
                "elapsed_s": round(result.elapsed_s, 3),
                "argv": list(sys.argv[1:] if argv is None else argv)},
        "summary": {"cases": len(result.outcomes),
                    "cases_failed": sum(not o.passed for o in result.outcomes),
                    "checks": n_checks, "checks_failed": n_failed,
                    "checks_not_judged": n_not_judged,
                    "backward_conventions": backward_conventions(result),
                    "backward_convention_sources": backward_convention_sources(result),
                    "worst_ratio": _json_ratio(worst[0]) if worst else None,
                    "worst": ({"case": worst[1], "level": worst[2], "quantity": worst[3]}
                              if worst else None)},
        "quantities": [{**{k: v for k, v in r.items()}, "worst_ratio": _json_ratio(r["worst_ratio"])}
                       for r in quantity_rows(result)],
        "cases": cases,
    }


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------
_NUM = (int, float)
_RATIO = (int, float, str, type(None))
# key -> allowed types, per object of the report (version 2); extra keys are allowed
_TOP = {"schema": str, "schema_version": int, "passed": bool, "tool": dict, "machine": dict,
        "run": dict, "summary": dict, "quantities": list, "cases": list}
_RUN = {"impl": str, "adapter": str, "device": str, "ops": list, "catalog": str,
        "case_patterns": list, "replays": int, "started_utc": str, "elapsed_s": _NUM,
        "argv": list}
_SUMMARY = {"cases": int, "cases_failed": int, "checks": int, "checks_failed": int,
            "checks_not_judged": int, "backward_conventions": dict,
            "worst_ratio": _RATIO, "worst": (dict, type(None))}
_QUANTITY = {"quantity": str, "section": str, "levels": list, "checks": int, "failed": int,
             "not_judged": int,
             "worst_ratio": _RATIO, "worst_case": (str, type(None)),
             "worst_level": (str, type(None)), "first_failure": (str, type(None))}
_CASE = {"id": str, "passed": bool, "error": (str, type(None)), "elapsed_s": _NUM,
         "categories": list, "case": dict, "precision": dict, "backends": dict, "checks": list}
_CHECK = {"name": str, "kind": str, "level": str, "quantity": str, "passed": bool,
          "status": str, "ratio": _RATIO, "mismatches": (int, type(None)), "detail": str}


def _fields(obj, spec: dict, where: str, problems: list) -> None:
    if not isinstance(obj, dict):
        problems.append(f"{where}: expected an object, got {type(obj).__name__}")
        return
    for k, types in spec.items():
        if k not in obj:
            problems.append(f"{where}: missing key {k!r}")
        elif isinstance(obj[k], bool) and bool not in (types if isinstance(types, tuple)
                                                       else (types,)):
            problems.append(f"{where}.{k}: bool where {types} expected")
        elif not isinstance(obj[k], types):
            problems.append(f"{where}.{k}: {type(obj[k]).__name__} is not {types}")


def _ratio_ok(r) -> bool:
    return r is None or (isinstance(r, (int, float)) and not isinstance(r, bool) and r >= 0) or \
        r in ("inf", "nan")


def validate_report(d) -> list[str]:
    """Problems of a ``report.json`` dict against schema version 2 (empty when it conforms):
    required keys and types, enumerations (check kinds, statuses, levels, quantities,
    conventions), ratios (a non-negative number, ``"inf"``, ``"nan"`` or null), and consistency
    (status against ``passed``, counts, verdicts)."""
    p: list[str] = []
    _fields(d, _TOP, "report", p)
    if p:
        return p
    if d["schema"] != SCHEMA:
        p.append(f"report.schema is {d['schema']!r}, expected {SCHEMA!r}")
    if d["schema_version"] != SCHEMA_VERSION:
        p.append(f"report.schema_version is {d['schema_version']}, expected {SCHEMA_VERSION}")
    _fields(d["run"], _RUN, "run", p)
    _fields(d["summary"], _SUMMARY, "summary", p)
    for i, q in enumerate(d["quantities"]):
        _fields(q, _QUANTITY, f"quantities[{i}]", p)
        if isinstance(q, dict) and not _ratio_ok(q.get("worst_ratio")):
            p.append(f"quantities[{i}].worst_ratio: {q.get('worst_ratio')!r} is not a ratio")
    n_checks = n_failed = n_not_judged = n_cases_failed = 0
    for i, c in enumerate(d["cases"]):
        where = f"cases[{i}]"
        _fields(c, _CASE, where, p)
        if not isinstance(c, dict) or not isinstance(c.get("checks"), list):
            continue
        failed_here = 0
        for j, ch in enumerate(c["checks"]):
            w = f"{where}.checks[{j}]"
            _fields(ch, _CHECK, w, p)
            if not isinstance(ch, dict):
                continue
            if ch.get("kind") not in CHECK_KINDS:
                p.append(f"{w}.kind: {ch.get('kind')!r} not in {CHECK_KINDS}")
            if ch.get("level") not in LEVELS:
                p.append(f"{w}.level: {ch.get('level')!r} not in {LEVELS}")
            if ch.get("quantity") not in QUANTITIES:
                p.append(f"{w}.quantity: {ch.get('quantity')!r} is not a known quantity")
            if not _ratio_ok(ch.get("ratio")):
                p.append(f"{w}.ratio: {ch.get('ratio')!r} is not a ratio")
            status = ch.get("status")
            if status not in STATUSES:
                p.append(f"{w}.status: {status!r} not in {STATUSES}")
            elif (status == "failed") is not (ch.get("passed") is False):
                p.append(f"{w}: status {status!r} contradicts passed {ch.get('passed')!r}")
            if ch.get("kind") == "numeric" and status == "passed" and \
                    not (isinstance(ch.get("ratio"), (int, float)) and ch["ratio"] <= 1):
                p.append(f"{w}: a passing numeric check must have a ratio <= 1")
            n_checks += 1
            n_not_judged += status == "not_judged"
            failed_here += ch.get("passed") is False
        n_failed += failed_here
        expect = failed_here == 0 and c.get("error") is None
        if c.get("passed") is not expect:
            p.append(f"{where}.passed is {c.get('passed')}, but its checks say {expect}")
        n_cases_failed += not expect
    s = d["summary"]
    for k, want in (("cases", len(d["cases"])), ("checks", n_checks),
                    ("checks_failed", n_failed), ("checks_not_judged", n_not_judged),
                    ("cases_failed", n_cases_failed)):
        if s.get(k) != want:
            p.append(f"summary.{k} is {s.get(k)}, the cases say {want}")
    conv = s.get("backward_conventions")
    if isinstance(conv, dict):
        for lv, counts in conv.items():
            if lv not in LEVELS or not isinstance(counts, dict) or any(
                    k not in BACKWARD_CONVENTIONS + ("none",) or not isinstance(n, int)
                    for k, n in counts.items()):
                p.append(f"summary.backward_conventions[{lv!r}]: {counts!r} is not a count per "
                         f"convention of {BACKWARD_CONVENTIONS + ('none',)}")
    if d["passed"] is not (n_cases_failed == 0 and len(d["cases"]) > 0):
        p.append(f"report.passed is {d['passed']}, the cases say {n_cases_failed == 0}")
    return p


# ---------------------------------------------------------------------------------------------
# terminal
# ---------------------------------------------------------------------------------------------
def _paint(text: str, color: str, on: bool) -> str:
    codes = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
    return f"\033[{codes[color]}m{text}\033[0m" if on else text


def _table(header, rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def what_is_wrong_lines(result: RunResult) -> list[str]:
    """Per failing quantity, the most common error pattern of its failing checks
    (:func:`dsv4_oracle.hints.pattern_lines`), in the order of the quantity table."""
    from .hints import Pattern, pattern_lines
    failed = [(c.extra.get("quantity", "run"),
               Pattern(c.extra["pattern"], c.extra["what_is_wrong"])
               if "what_is_wrong" in c.extra else None)
              for o in result.outcomes for c in o.failed_checks]
    order = [r["quantity"] for r in quantity_rows(result)]
    return sorted(pattern_lines(failed), key=lambda line: order.index(line.split(":")[0])
                  if line.split(":")[0] in order else len(order))


def format_summary(result: RunResult, *, color: bool = False, max_failures: int = 25,
                   verbose: bool = False) -> str:
    """The terminal summary: header, table of quantities, failing checks, verdict."""
    a = result.adapter
    out = []
    backends = sorted({b for o in result.outcomes for lv in o.backends.values()
                       for b in lv.values()})
    out.append(f"dsv4-oracle check: {a.spec} on {a.device}"
               + (f" (backends: {', '.join(backends)})" if backends else "")
               + (f"; {plural(len(result.outcomes), 'case')} at your shapes"
                  if result.catalog == "shape" else
                  f"; {result.catalog} catalog, {plural(len(result.outcomes), 'case')}")
               + f", replays {result.replays}")
    from .protocol import ops_line
    out.append(ops_line(result.ops))
    from .runner import policy_lines, policy_summary, precision_lines, precision_summary
    p_lines, p_flag = precision_lines(precision_summary(result))
    out += p_lines
    out += policy_lines(policy_summary(result))
    rows = []
    for r in quantity_rows(result):
        status = "FAIL" if r["failed"] else "ok"
        worst = fmt_ratio(r["worst_ratio"]) if r["worst_ratio"] is not None else "exact"
        where = f"{r['worst_case']} [{r['worst_level']}]" if r["worst_case"] else ""
        judged = r["checks"] - r["not_judged"]
        rows.append([status, r["quantity"], r["section"], "/".join(r["levels"]),
                     f"{judged - r['failed']}/{judged}", str(r["not_judged"] or ""), worst,
                     where])
    lines = _table(["", "quantity", "section", "level", "passed", "not judged", "worst ratio",
                    "worst case"], rows)
    for i, line in enumerate(lines):
        if i >= 2 and line.startswith("FAIL"):
            line = _paint(line, "red", color)
        elif i >= 2:
            line = _paint("ok", "green", color) + line[2:]
        out.append(line)
    out.append("(ratio = max |implementation - oracle| / bound of the error model, section 12; "
               "<= 1 passes; 'exact' = checked for equality; 'not judged' = checks that cannot "
               "fail: every element ill-conditioned (bound >= |oracle|), nothing to compare, or "
               "an upstream output the oracle cannot consume)")
    conv = _conventions_line(backward_conventions(result), backward_convention_sources(result))
    if conv:
        out.append(conv)
    errors = [o for o in result.outcomes if o.error]
    fails = [(o, c) for o in result.outcomes for c in o.failed_checks]
    wrong = what_is_wrong_lines(result)
    if wrong:
        out.append("")
        out.append(_paint("what is wrong, from the error pattern of the failing checks:", "bold",
                          color))
        out += [f"  {line}" for line in wrong]
    if errors or fails:
        out.append("")
        out.append(_paint(f"failing checks ({len(fails) + len(errors)}):", "bold", color))
        for o in errors:
            out.append(f"  ERROR {o.case.id}: {o.error}")
        for o, c in fails[:max_failures]:
            out.append(f"  FAIL {o.case.id} [{c.extra.get('level')}] {c.name}: {c.detail}")
        if len(fails) > max_failures:
            out.append(f"  ... and {len(fails) - max_failures} more (see --report DIR)")
    if verbose:
        out.append("")
        out.append("cases:")
        for o in result.outcomes:
            worst = max((c.ratio for c in o.checks if c.ratio is not None and c.judged),
                        default=None, key=_ratio_key)
            out.append(f"  {'ok  ' if o.passed else 'FAIL'} {o.case.id:34s} worst ratio "
                       f"{fmt_ratio(worst):>8s}  {o.elapsed_s:6.2f} s  "
                       f"{len(o.checks)} checks")
    n_checks = sum(len(o.checks) for o in result.outcomes)
    n_failed = sum(len(o.failed_checks) for o in result.outcomes)
    n_nj = sum(not c.judged for o in result.outcomes for c in o.checks)
    nj = f" ({n_nj} not judged)" if n_nj else ""
    bad_cases = sum(not o.passed for o in result.outcomes)
    worst = _worst(result)
    out.append("")
    if result.passed:
        w = (f"; worst ratio {fmt_ratio(worst[0])} ({worst[3]}, {worst[1]} [{worst[2]}])"
             if worst else "")
        out.append(_paint(f"PASS: {plural(n_checks - n_nj, 'check')} passed{nj} on "
                          f"{plural(len(result.outcomes), 'case')}{w} in "
                          f"{result.elapsed_s:.1f} s",
                          "green", color))
    else:
        out.append(_paint(f"FAIL: {n_failed} of {plural(n_checks, 'check')} failed in {bad_cases} "
                          f"of {plural(len(result.outcomes), 'case')} ({result.elapsed_s:.1f} s)"
                          f"{nj}", "red",
                          color))
    return "\n".join(out) + p_flag      # the verdict line notes widened bounds


def format_case(outcome, adapter=None, ops=None) -> str:
    """One case's checks as a table (failed first, then not judged, then passed): status,
    level, quantity, check, ratio and detail, after the ops judged (``ops``, default the
    adapter's); the message of :func:`dsv4_oracle.pytest_plugin.assert_conforms`."""
    c = outcome.case
    who = f"{adapter.spec} on {adapter.device}: " if adapter is not None else ""
    n = len(outcome.checks)
    n_failed = len(outcome.failed_checks)
    n_nj = sum(not ch.judged for ch in outcome.checks)
    head = (f"dsv4-oracle: {who}case {c.id}: {n_failed} of {n} checks failed"
            + (f", {n_nj} not judged" if n_nj else ""))
    out = [head]
    if adapter is not None:
        from .protocol import ops_line
        out.append(ops_line(adapter.ops if ops is None else ops))
        from dsv4_oracle.reference.contract_policies import policy_line
        pol = policy_line(adapter.policies)
        if pol:
            out.append(f"policies assumed (contract section 5.2): {pol}")
    if outcome.error:
        out.append(f"ERROR {c.id}: {outcome.error}")
    order = {"failed": 0, "not_judged": 1, "passed": 2}
    checks = sorted(outcome.checks, key=lambda ch: order[ch.status])   # stable: pipeline order
    label = {"failed": "FAIL", "not_judged": "not judged", "passed": "ok"}
    rows = [[label[ch.status], c.id, ch.extra.get("level", "op"), ch.extra.get("quantity", "run"),
             ch.name, fmt_ratio(ch.ratio)] for ch in checks]
    if rows:                            # the detail last, unpadded: it is often a sentence
        table = _table(["", "case", "level", "quantity", "check", "ratio"], rows)
        width = len(table[1])
        out += [f"{table[0].ljust(width)}  detail", f"{table[1]}  ------"]
        out += [f"{line.ljust(width)}  {ch.detail}" for line, ch in zip(table[2:], checks)]
    out.append("(ratio = max |implementation - oracle| / bound of the error model, contract "
               "section 12; <= 1 passes; '-' = an exact check)")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
# characters XML 1.0 cannot hold (control characters, lone surrogates, U+FFFE/U+FFFF)
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml(text: str) -> str:
    """``text`` with every character XML 1.0 cannot hold written as a ``\\xNN``/``\\uNNNN``
    escape, so that any JUnit parser reads the file whatever an adapter's message holds."""
    return _NOT_XML.sub(lambda m: (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                   else f"\\u{ord(m.group()):04x}"), str(text))


def write_junit(result: RunResult, path: str) -> None:
    """JUnit XML: one testcase per (case, level, check); failures carry the pointed message,
    checks that could not be judged are skipped with the reason. Every text is made valid
    XML (:func:`_xml`)."""
    n = sum(len(o.checks) + (1 if o.error else 0) for o in result.outcomes)
    fails = sum(len(o.failed_checks) for o in result.outcomes)
    errs = sum(1 for o in result.outcomes if o.error)
    skipped = sum(not c.judged for o in result.outcomes for c in o.checks)
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite",
                          name=_xml(f"dsv4-oracle check {result.adapter.spec}"),
                          tests=str(n), failures=str(fails), errors=str(errs),
                          skipped=str(skipped),
                          time=f"{result.elapsed_s:.3f}", timestamp=result.started_utc)
    for o in result.outcomes:
        share = o.elapsed_s / max(len(o.checks), 1)
        if o.error:
            tc = ET.SubElement(suite, "testcase", classname=f"dsv4_oracle.{o.case.id}",
                               name="setup", time="0")
            ET.SubElement(tc, "error", message=_xml(o.error)).text = _xml(o.error)
        for c in o.checks:
            tc = ET.SubElement(suite, "testcase", classname=f"dsv4_oracle.{o.case.id}",
                               name=_xml(f"[{c.extra.get('level')}] {c.name}"),
                               time=f"{share:.4f}")
            if not c.passed:
                msg = _xml(f"{c.name} ({c.kind}): {c.detail}")
                ET.SubElement(tc, "failure", message=msg, type=c.kind).text = msg
            elif not c.judged:
                ET.SubElement(tc, "skipped", message=_xml(c.detail))
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def _markdown_precision(lines: list[str]) -> list[str]:
    """The precision lines of the terminal as Markdown: one bullet each, the per-dtype lines
    nested under the first, the warning in bold."""
    out = []
    for line in lines:
        if line.startswith("  "):
            out.append(f"  - {line.strip()}")
        else:
            out.append("- " + line.replace("WARNING: ", "**looser than the default**: "))
    return out


def _markdown(d: dict, images: list[str]) -> str:
    from .runner import policy_lines, precision_lines
    s, run = d["summary"], d["run"]
    lines = [f"# dsv4-oracle check: {'PASS' if d['passed'] else 'FAIL'}", ""]
    lines += [f"- implementation: `{run['impl']}` (adapter {run['adapter']}) on "
              f"`{run['device']}`; ops: {', '.join(run['ops'])}",
              f"- catalog: {run['catalog']}"
              + (f", cases matching {', '.join(run['case_patterns'])}" if run['case_patterns']
                 else "")
              + f"; {plural(s['cases'], 'case')}, {plural(s['checks'], 'check')}, replays "
                f"{run['replays']}",
              f"- result: {s['checks'] - s['checks_failed'] - s['checks_not_judged']}/"
              f"{s['checks'] - s['checks_not_judged']} judged checks passed, "
              f"{s['checks_not_judged']} not judged; "
              f"{s['cases'] - s['cases_failed']}/{s['cases']} cases passed",
              f"- worst ratio: {fmt_ratio(s['worst_ratio'])}"
              + (f" ({s['worst']['quantity']}, case {s['worst']['case']} "
                 f"[{s['worst']['level']}])" if s["worst"] else ""),
              *(_markdown_precision(precision_lines(run["precision"])[0])
                or ["- precision assumed: none (no op ran)"]),
              "- " + ("".join(policy_lines(run["policies"])) if "policies" in run and
                      run["policies"]["non_default"] else
                      "policies assumed: the contract's defaults (section 5.2)"),
              f"- machine: {d['machine']['platform']}, {d['machine']['cpu_count']} CPUs, torch "
              f"{d['machine']['torch']}, CUDA device {d['machine']['cuda_device']}",
              f"- started {run['started_utc']}, {run['elapsed_s']:.1f} s; oracle "
              f"{d['tool']['oracle']}, dsv4-oracle {d['tool']['dsv4_oracle']}",
              "", "Ratio = max |implementation - oracle| / bound of the contract's error model "
              "(section 12); a check passes iff its ratio is <= 1. Exact checks (Top-K, ids, "
              "lengths, sink-only rows, replays, grad modes, inputs) compare for equality. A check "
              "is not judged when it cannot fail: every element ill-conditioned (its bound "
              "reaches the oracle's magnitude), nothing to compare, or an upstream output the "
              "oracle cannot consume; it is counted, never as a pass.", ""]
    conv = _conventions_line(s["backward_conventions"], s.get("backward_convention_sources", {}))
    if conv:
        lines += ["- " + conv, ""]
    lines += ["## Quantities", "",
              "| | quantity | section | level | passed | not judged | worst ratio | worst case |",
              "|---|---|---|---|---|---|---|---|"]
    for q in d["quantities"]:
        worst = fmt_ratio(q["worst_ratio"]) if q["worst_ratio"] is not None else "exact"
        where = f"{q['worst_case']} [{q['worst_level']}]" if q["worst_case"] else ""
        judged = q["checks"] - q["not_judged"]
        lines.append(f"| {'**FAIL**' if q['failed'] else 'ok'} | {q['quantity']} | "
                     f"{q['section']} | {'/'.join(q['levels'])} | "
                     f"{judged - q['failed']}/{judged} | {q['not_judged'] or ''} | {worst} | "
                     f"{where} |")
    fails = [(c, ch) for c in d["cases"] for ch in c["checks"] if not ch["passed"]]
    errors = [c for c in d["cases"] if c["error"]]
    if fails or errors:
        lines += ["", "## Failing checks", ""]
        for c in errors:
            lines.append(f"- **{c['id']}**: {c['error']}")
        for c, ch in fails[:200]:
            lines.append(f"- **{c['id']}** [{ch['level']}] `{ch['name']}` ({ch['kind']}): "
                         f"{ch['detail']}")
        if len(fails) > 200:
            lines.append(f"- ... and {len(fails) - 200} more in report.json")
    if images:
        lines += ["", "## Plots", ""]
        for img in images:
            lines.append(img if img.startswith("(") else f"![{img}]({img})")
            lines.append("")
    lines += ["", "## Cases", "", "| | case | worst ratio | checks | time (s) | backends |",
              "|---|---|---|---|---|---|"]
    for c in d["cases"]:
        ratios = [ch["ratio"] for ch in c["checks"]
                  if ch["ratio"] is not None and ch["status"] != "not_judged"]
        worst = max(ratios, key=lambda r: math.inf if isinstance(r, str) else r, default=None)
        backends = "; ".join(f"{lv}: " + ", ".join(sorted(set(b.values())))
                             for lv, b in c["backends"].items() if b)
        lines.append(f"| {'ok' if c['passed'] else '**FAIL**'} | {c['id']} | "
                     f"{fmt_ratio(worst)} | {len(c['checks'])} | {c['elapsed_s']:.2f} | "
                     f"{backends} |")
    return "\n".join(lines) + "\n"


def write_report(result: RunResult, directory: str, *, argv=None) -> list[str]:
    """Write ``report.json``, ``report.md`` and the PNG plots into ``directory`` (created);
    returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    d = report_dict(result, argv=argv)
    problems = validate_report(d)
    if problems:                        # a bug of this module: never write a bad report
        raise AssertionError("report.json does not match its schema: " + "; ".join(problems[:5]))
    from .plots import plot_ratio_grid, plot_worst_case, unavailable
    images = []
    skipped = unavailable()            # matplotlib is the optional extra ``report``
    if skipped:
        images.append(f"(PNG plots skipped: {skipped})")
    else:
        for name, fn in (("ratios.png", plot_ratio_grid), ("worst_case.png", plot_worst_case)):
            if fn(result, os.path.join(directory, name)):
                images.append(name)
    paths = [os.path.join(directory, "report.json"), os.path.join(directory, "report.md")]
    # JSON escapes every non-ASCII character; Markdown is UTF-8, with a backslash escape for
    # anything that has no UTF-8 form (a lone surrogate in an adapter's message)
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1, allow_nan=False)
        f.write("\n")
    with open(paths[1], "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(_markdown(d, images))
    return paths + [os.path.join(directory, i) for i in images if not i.startswith("(")]
