"""The implementations under test and how the oracle tests run and judge them.

Data flow: a :class:`fixtures.case.Case` -> its inputs (rounded once to the case's dtype) ->
:func:`run_impl` (the implementation's whole pipeline through :mod:`gpu_impl.api`, on its
device) -> :func:`judge` (the oracle evaluated on the exact inputs the implementation consumed,
including its own intermediates: scores, ids, ``out``, ``lse``, target, predict) -> a list of
:class:`dsv4_oracle.compare.CheckResult` rows (exact and Top-K checks, and error/bound ratios
from ``reference.error_model``) -> :func:`assert_checks` (the table, and the verdict).

``run_impl`` and ``judge`` are thin wrappers of :mod:`dsv4_oracle.conformance`, the comparison
engine that ``dsv4-oracle check`` runs too (one piece of code for the suite and the command);
this module adds only what is pytest-specific (the parametrized implementations).

Implementations: the torch backend on the CPU (the CI lane), the torch and cuDNN backends on
CUDA (the GPU lane; marked ``gpu`` / ``cudnn`` so that the pytest plugin skips them without
hardware).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsv4_oracle import compare as C
from dsv4_oracle import conformance
from dsv4_oracle.adapters import Adapter, GpuImplAdapter, default_precision
from dsv4_oracle.fixtures.case import Case
from dsv4_oracle.reference import error_model as EM


@dataclass(frozen=True)
class Impl:
    """One implementation under test: a gpu_impl backend on a device."""

    backend: str
    device: str

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}"

    @property
    def request(self) -> str:
        """The ``backend`` argument passed to each op: ``"torch"``, or ``"auto"`` for cuDNN
        (cuDNN where its kernels run the op with these shapes, torch for the rest; every
        result records which backend ran, and the verdict table prints it)."""
        return "torch" if self.backend == "torch" else "auto"

    def precision(self, dtype: torch.dtype) -> EM.Precision:
        """Working precision (section 12): float32 accumulation and statistics, operands and
        outputs stored in the input dtype (bf16 for bf16 inputs)."""
        return default_precision(dtype)

    def adapter(self, *, deterministic: bool = True, chunk_rows: int | None = None) -> Adapter:
        """This implementation as a ``dsv4-oracle check`` adapter (``gpu_impl:<backend>``)."""
        return Adapter(GpuImplAdapter(self.backend, self.device, deterministic, chunk_rows),
                       name=f"gpu_impl:{self.backend}", device=self.device)


TORCH_CPU = Impl("torch", "cpu")
TORCH_CUDA = Impl("torch", "cuda")
CUDNN_CUDA = Impl("cudnn", "cuda")

IMPLEMENTATIONS = [
    pytest.param(TORCH_CPU, id=TORCH_CPU.id),
    pytest.param(TORCH_CUDA, id=TORCH_CUDA.id, marks=pytest.mark.gpu),
    pytest.param(CUDNN_CUDA, id=CUDNN_CUDA.id, marks=[pytest.mark.gpu, pytest.mark.cudnn]),
]


def cpu_lane_too_large(case: Case) -> bool:
    """Cases whose production shapes make the float64 oracle (not the implementation) cost
    seconds on a 2-core CI machine: the DSv4-Flash/Pro shapes and layouts of thousands of
    rows. The CPU lane skips them (the torch backend runs the same code at every shape); the
    GPU lanes run them."""
    work = case.heads * case.head_dim * (case.topk + case.window) * case.T
    return work > 5e7 or case.T > 1024


def skip_large_on_cpu(impl: Impl, case: Case) -> None:
    if impl.device == "cpu" and cpu_lane_too_large(case):
        pytest.skip(f"{case.id}: production-size case, run in the GPU lanes only (on the CPU "
                    "its cost is the float64 oracle's)")


def content_hash(tensors: dict) -> dict:
    """Per tensor, a hash of its dtype, shape and bytes (contract section 11: no mutation)."""
    return {k: C.content_hash(t) for k, t in tensors.items() if isinstance(t, torch.Tensor)}


# --------------------------------------------------------------------------------------------
# running and judging: the shared comparison engine (dsv4_oracle.conformance), the same code
# that ``dsv4-oracle check`` runs
# --------------------------------------------------------------------------------------------
def run_impl(impl: Impl, case: Case, x: dict, *, deterministic: bool = True,
             chunk_rows: int | None = None) -> dict:
    """The implementation's pipeline on ``x`` (tensors already on ``impl.device``): every output
    of :data:`fixtures.pipeline.OUTPUT_NAMES` it computes, on its device, plus ``backends``
    (op -> the backend that ran it). ``chunk_rows`` is passed to the ops that take it (row
    chunking of the implementation). See :func:`dsv4_oracle.conformance.run_ops`; an op that
    fails (raises, writes into an argument, returns an unusable output) raises its
    :class:`~dsv4_oracle.invoke.OpError` here, as the suite's implementations never may."""
    run = conformance.run_ops(impl.adapter(deterministic=deterministic, chunk_rows=chunk_rows),
                              case, x)
    if run.failed:
        raise next(iter(run.failed.values()))
    return {**run.got, "backends": run.backends}


def judge(impl: Impl, case: Case, x: dict, got: dict) -> list[C.CheckResult]:
    """Every check of ``got`` (from :func:`run_impl`, or an equivalent dict built by a test)
    against the oracle on the consumed inputs: :func:`dsv4_oracle.conformance.judge`."""
    return conformance.judge(case, x, got, precision=impl.precision(case.torch_dtype))


def assert_checks(checks: list, label: str = "") -> None:
    """Fail with every failing check; print the whole table (``pytest -rA -s`` shows it):
    numeric rows give error/bound ratios, exact rows mismatch counts; ``n/j`` marks a check
    that could not be judged (section 12: ill-conditioned, or nothing to compare)."""
    def row(c):
        r = "" if c.ratio is None else f"ratio={c.ratio:.3g}"
        mark = {"passed": "ok ", "failed": "BAD", "not_judged": "n/j"}[c.status]
        return f"  {mark} {c.kind:10s} {c.name:42s} {r:14s} {c.detail}"
    table = "\n".join(row(c) for c in checks)
    print(f"{label}\n{table}")
    bad = [c for c in checks if not c.passed]
    assert not bad, f"{label}: {len(bad)} check(s) failed\n{table}"


def torch_backend_outcome(case_id: str):
    """``dsv4-oracle check`` of the torch backend (``gpu_impl:torch``, CPU) on one catalog case,
    asserted to pass with a finite worst ratio; the outcome, for further assertions."""
    import math

    from dsv4_oracle.adapters import load_adapter
    from dsv4_oracle.fixtures import get
    from dsv4_oracle.runner import check_case

    outcome = check_case(load_adapter("gpu_impl:torch"), get(case_id), replays=2)
    assert outcome.error is None, outcome.error
    bad = [(c.name, c.detail) for c in outcome.failed_checks]
    assert not bad, bad
    assert math.isfinite(max(c.ratio for c in outcome.checks if c.ratio is not None))
    return outcome
