"""The contract's constants live once, in ``reference/constants.py``: every default of the
oracle, the error model and the implementations is that constant, and no module of the package
writes its own copy of the value."""
from __future__ import annotations

import inspect
import math
import pathlib
import re

import pytest

from dsv4_oracle import reference as R
from dsv4_oracle.reference import constants as K
from dsv4_oracle.reference import error_model as EM

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("reference", "gpu_impl", "dsv4_oracle", "fixtures")

# (value of the contract, the defaults that must equal it)
DEFAULTS = {
    "loss_floor": K.LOSS_FLOOR,
    "grad_floor": K.GRAD_FLOOR,
    "eps": K.QNORM_EPS,
}


def test_the_values_are_the_contracts():
    assert K.FLT_MIN == 2.0 ** -126 == K.LOSS_FLOOR            # section 8
    assert K.GRAD_FLOOR == math.exp(-100)                       # section 8
    assert K.QNORM_EPS == 1e-6                                  # section 9
    assert K.LARGE_SINK == 2.4e38                               # section 6
    assert (K.SLOT_MULTIPLE, K.CHUNK_BYTES, K.BOUND_CHUNK_BYTES) == (64, 1 << 25, 1 << 28)


def _functions():
    from dsv4_oracle.gpu_impl import api, cudnn_backend, torch_backend
    for mod in (R, EM, api, torch_backend, cudnn_backend):
        for name, fn in vars(mod).items():
            if inspect.isfunction(fn) and not name.startswith("_"):
                yield f"{mod.__name__}.{name}", fn


@pytest.mark.parametrize("param", sorted(DEFAULTS))
def test_every_default_is_the_constant(param):
    seen = []
    for where, fn in _functions():
        p = inspect.signature(fn).parameters.get(param)
        if p is not None and p.default is not p.empty:
            seen.append(where)
            assert p.default == DEFAULTS[param], (where, p.default)
    assert len(seen) >= 3, seen         # the oracle, the error model or api, the backends


# a literal of a contract constant, or a module-level definition of one of its names
LITERALS = re.compile(r"2\.0 \*\* -126|2 \*\* -126|math\.exp\(-100\)|\beps\b[^=\n]*=\s*1e-6|"
                      r"^(FLT_MIN|LOSS_FLOOR|GRAD_FLOOR|QNORM_EPS|SLOT_MULTIPLE|CHUNK_BYTES|"
                      r"LARGE_SINK)\s*=", re.M)


def test_no_module_writes_its_own_copy():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "reference" / "constants.py":
                continue
            for m in LITERALS.finditer(path.read_text()):
                line = path.read_text()[:m.start()].count("\n") + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not found, "\n".join(found)
