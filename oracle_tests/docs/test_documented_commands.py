"""The commands the documentation gives run, and its counts cannot go stale.

- every ``dsv4-oracle ...`` and ``python -m ...`` command of ``README.md`` and ``docs/*.md``
  (code blocks and inline code) and the advice of the fixture store's manifest: its module
  exists and its options parse; cheap ones run (``check`` with ``--list``, its adapter loaded
  when it is importable here; ``power``/``mutate`` with ``--list``; ``fixtures list``/``show``/
  ``verify CASE``; ``init-adapter`` into a temporary directory). A usage synopsis
  (``[--quick]``, ``PATTERN ...``) is checked for the options it names;
- the README's fixtures snippet runs on this machine;
- no prose of the user documentation states the size of a catalog or of the store outside a
  dated measurement (a commit or a date in the same paragraph or just above its table): those
  numbers change with every case added, and ``--list`` / ``verify`` print them.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# run records: every number in them is a measurement of its date
RUN_LOGS = ("docs/GPU_RESULTS.md", "docs/EXTERNAL_REFERENCES.md")
PLACEHOLDERS = re.compile(r"\[|\.\.\.|\bPATTERN\b|\bNAME\b|\bFILE\b|\bDIR\b|\bCASE\b|\bID\b|"
                          r"\bPATH\b|\bSPEC\b|\bC\b(?!-)")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _commands(text: str) -> list[str]:
    """``dsv4-oracle``/``python -m`` commands of one Markdown text: lines of code blocks
    (continuations joined, comments dropped, ``a && b`` split) and inline code spans."""
    found = []
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            found += [part.strip() for part in re.split(r"&&|;|\|\|", line)]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += re.findall(r"`([^`\n]+)`", prose)
    out = []
    for c in found:
        c = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", c)           # VAR=value prefixes
        if re.match(r"(dsv4-oracle|python3? -m [\w.]+)\s", c) and c not in out:
            out.append(c)
    return out


def documented_commands() -> list[tuple[str, str]]:
    cmds = [(rel, c) for rel in DOCS for c in _commands(_read(rel))]
    cmds += [("fixtures/data/manifest.json", c) for c in re.findall(r"`([^`]+)`", _note())]
    return cmds


def _note() -> str:
    return json.loads(_read("fixtures/data/manifest.json"))["note"]


def test_the_stored_manifest_gives_the_advice_regen_writes():
    from dsv4_oracle.fixtures.store import MANIFEST_NOTE
    assert _note() == MANIFEST_NOTE


def _subparser(parser, name):
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices.get(name)


def _options_exist(parser, words: list[str], where: str) -> None:
    for w in words:
        opt = w.split("=", 1)[0].strip("[]|")
        if opt.startswith("-") and len(opt) > 1:
            assert opt in parser._option_string_actions, f"{where}: unknown option {opt}"


def _run(main, argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue() + err.getvalue()


def _parses(parser, argv, where: str) -> None:
    rc, text = _run(lambda a: parser.parse_args(a) and 0, argv)
    assert rc == 0, f"{where}: does not parse: {text}"


def _importable(spec: str) -> bool:
    from dsv4_oracle.adapters import BUILTIN
    if spec in BUILTIN:
        return True
    module = spec.split(":", 1)[0]
    if module.endswith(".py"):
        return os.path.isfile(os.path.join(ROOT, module))
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _check_cli(argv: list[str], where: str, tmp_path) -> None:
    from dsv4_oracle.cli import build_parser, main
    parser = build_parser()
    if not argv or argv[0].startswith("-"):
        rc, text = _run(main, argv)
        assert rc == 0, f"{where}: {text}"
        return
    sub = _subparser(parser, argv[0])
    assert sub is not None, f"{where}: no subcommand {argv[0]!r}"
    if PLACEHOLDERS.search(" ".join(argv[1:])):        # a synopsis: the options it names
        _options_exist(sub, argv[1:], where)
        return
    _parses(parser, argv, where)
    args = parser.parse_args(argv)
    if argv[0] == "check":
        rc, text = _run(main, argv + ["--list"])
        assert rc == 0, f"{where}: {text}"
        if args.impl and _importable(args.impl) and args.impl != "gpu_impl:cudnn":
            from dsv4_oracle.adapters import load_adapter
            load_adapter(args.impl)
    elif argv[0] in ("power", "mutate"):
        rc, text = _run(main, [a for a in argv if a not in ("--lanes",)] + ["--list"])
        assert rc == 0, f"{where}: {text}"
    elif argv[0] == "init-adapter":
        rc, text = _run(main, ["init-adapter", str(tmp_path / os.path.basename(args.path))])
        assert rc == 0, f"{where}: {text}"


def _check_module(module: str, argv: list[str], where: str) -> None:
    # everything installs under dsv4_oracle: a top-level `fixtures` runs only in a checkout
    assert module.split(".")[0] in ("dsv4_oracle", "pytest"), f"{where}: not an installed module"
    assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    if module == "dsv4_oracle.fixtures":
        from dsv4_oracle.fixtures.__main__ import build_parser, main
        if PLACEHOLDERS.search(" ".join(argv)):
            sub = _subparser(build_parser(), argv[0])
            assert sub is not None, f"{where}: no subcommand {argv[0]!r}"
            _options_exist(sub, argv[1:], where)
            return
        _parses(build_parser(), argv, where)
        if argv[0] in ("list", "show") or (argv[0] == "verify" and len(argv) > 1):
            rc, text = _run(main, argv)
            assert rc == 0, f"{where}: {text}"
    elif module == "dsv4_oracle.cli":
        _check_cli(argv, where, None)
    elif module == "pytest":
        for a in argv:
            if a.startswith("oracle_tests"):
                assert os.path.exists(os.path.join(ROOT, a.split("::")[0])), \
                    f"{where}: no test path {a}"


COMMANDS = documented_commands()


@pytest.mark.parametrize("where, command", COMMANDS,
                         ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_a_documented_command_runs(where, command, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    where = f"{where}: `{command}`"
    if words[0] == "dsv4-oracle":
        _check_cli(words[1:], where, tmp_path)
    else:
        _check_module(words[2], words[3:], where)


def test_the_documentation_gives_commands():
    """The parser above finds what it is meant to find (a test that cannot fail is none)."""
    found = {c for _, c in COMMANDS}
    assert "dsv4-oracle check" in found and "python -m dsv4_oracle.fixtures verify" in found
    assert len(COMMANDS) > 40


def test_the_readme_fixtures_snippet_runs_on_this_machine(monkeypatch):
    monkeypatch.chdir(ROOT)
    section = _read("README.md").split("## Fixtures", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(snippet, "README.md (Fixtures)", "exec"), {})


COUNT = re.compile(
    r"(?<![A-Z]\s)(?<![A-Za-z_])\b\d{1,3}\s+(?:(?:runnable|small|hard|stored|catalog|"
    r"named|quick|full)\s+)*(?:cases|checks)\b|\b\d+(?:\.\d+)?\s+MB\s+for\b|"
    r"\bcatalog\s+of\s+\d+\b|\b(?:two|three|four|five|six|seven|eight|nine|ten)\s+catalog\s+"
    r"cases\b")
DATED = re.compile(r"`[0-9a-f]{7,40}`|\b20\d\d-\d\d-\d\d\b")


def stale_counts(text: str) -> list[str]:
    """Counts of cases or checks in ``text`` outside code blocks and dated measurements."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found, prev = [], ""
    for para in re.split(r"\n\s*\n", text):
        table = all(line.lstrip().startswith("|") for line in para.strip().splitlines())
        dated = DATED.search(para) or (table and DATED.search(prev))
        prev = para
        if not dated:
            found += [para[max(0, m.start() - 40):m.end()].replace("\n", " ")
                      for m in COUNT.finditer(para)]
    return found


def test_the_counting_rule_finds_counts():
    assert stale_counts("the quick catalog of 41 cases") == ["the quick catalog of 41"]
    assert stale_counts("| `cases()` | 36 small cases |")
    assert stale_counts("on four catalog cases") and stale_counts("7.2 MB for its cases")
    assert stale_counts("runs all 67 runnable\ncases")
    assert not stale_counts("at commit `97d5d7e`: 36 cases") and not stale_counts("D_I 128 cases")
    assert not stale_counts("measured 2026-12-01:\n\n| run | 36 cases |")


@pytest.mark.parametrize("rel", [r for r in DOCS if r not in RUN_LOGS] + [
    "dsv4_oracle/pytest_plugin.py", "dsv4_oracle/check.py", "dsv4_oracle/runner.py"])
def test_no_undated_count_of_cases_or_checks(rel):
    assert stale_counts(_read(rel)) == []
