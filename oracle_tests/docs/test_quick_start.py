"""The README's quick start, as ``.ci/run`` extracts it (the first bash block under "## Quick
start"): run literally on a machine without a GPU and without torch it installs the CPU build
of torch before the project (an unpinned torch from PyPI is a multi-GB CUDA build); with torch
installed, or a GPU, it leaves torch to pip."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def quick_start_lines() -> list[str]:
    """The block exactly as ``.ci/run`` extracts it, one command per line."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def _tool(folder, name, body):
    path = folder / name
    path.write_text(f"#!{shutil.which('sh')}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("torch_installed, gpu, cpu_torch", [
    (False, False, True), (True, False, False), (False, True, False)])
def test_the_quick_start_installs_a_cpu_torch_first_on_a_cpu_machine(tmp_path, torch_installed,
                                                                     gpu, cpu_torch):
    lines = quick_start_lines()
    project = next(i for i, line in enumerate(lines) if "pip install -e" in line)
    assert project > 0, "no line before the project's install line"
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "pip.log"
    # a machine with only these commands: python (torch importable or not), pip (logs its
    # arguments), nvidia-smi where there is a GPU
    _tool(bin_, "python", "exit 0" if torch_installed else "exit 1")
    _tool(bin_, "pip", f'echo "$*" >> {log}')
    if gpu:
        _tool(bin_, "nvidia-smi", "exit 0")
    for line in lines[:project]:
        subprocess.run([shutil.which("bash"), "-euo", "pipefail", "-c", line], check=True,
                       env={"PATH": str(bin_)}, cwd=tmp_path, timeout=30)
    calls = log.read_text().splitlines() if log.exists() else []
    if cpu_torch:
        assert calls == [f"install torch {CPU_INDEX}"]
    else:
        assert calls == []
