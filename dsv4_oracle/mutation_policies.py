"""The policy section of ``dsv4-oracle mutate``: every named policy's non-default values.

A policy of contract section 5.2 is a legitimate choice only when it is *declared*: an
implementation that follows a non-default value without declaring it is judged under the
contract's defaults and must fail, and once it declares the value it must pass. For every
``(policy, non-default value)`` pair a *policy mutant* is an implementation that follows that
value and no other non-default one:

- the Megatron-style DSA adapter (:mod:`dsv4_oracle.examples.megatron_dsa_adapter`) configured
  with the contract's defaults but that one value;
- for ``index_grad="autograd"``, the portable torch backend with its autograd gradient form;
- ``loss_norm="rank_mean"`` differs from ``"real"`` only under context parallelism: a
  single-device implementation cannot follow it (its ops are not told the ranks), so it is a
  *lane only* entry, reported and not run.

:func:`run_policy_mutant` runs a mutant twice over the quick catalog (:func:`run_mutation` in
:mod:`dsv4_oracle.mutation` calls it): judged under the defaults (``check --policy default``),
every case that fails it counts (the *kill depth*; the first is its killer); judged under its
declaration, it must pass every case that applies (:func:`dsv4_oracle.conformance.not_applicable`
names the ones that do not). It is as expected when it is killed and its declared run passes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from dsv4_oracle.reference.contract_policies import DEFAULT_POLICIES, POLICIES

from .mutation import MutantResult, _killer, case_order

__all__ = ["PolicyMutant", "POLICY_MUTANTS", "PolicyMutantResult", "run_policy_mutant",
           "policy_adapter"]


@dataclass(frozen=True)
class PolicyMutant:
    """An implementation that follows ``value`` of ``policy`` (and the defaults otherwise).
    ``build()``: the adapter object (``None``: a lane-only entry, ``reason`` says why);
    ``first``: its likely killers, tried first."""

    policy: str
    value: str
    build: Callable | None
    description: str
    first: tuple = ()
    reason: str = ""
    expect: str = "killed"
    lane: tuple = ()
    files: tuple = ()                 # no source edit: a configured implementation

    @property
    def name(self) -> str:
        return f"policy:{self.policy}={self.value}"


def _megatron(policy: str, value: str) -> Callable:
    def build():
        from dsv4_oracle.examples.megatron_dsa_adapter import MegatronDSAAdapter
        return MegatronDSAAdapter(**{**DEFAULT_POLICIES, policy: value})
    return build


def _torch_autograd_grad():
    """The portable torch backend whose indexer-loss gradient is its autograd form (the exact
    derivative of the loss as written, floors included), declaring ``index_grad="autograd"``."""
    from dsv4_oracle.adapters import OPS, GpuImplAdapter

    class TorchAutogradGrad(GpuImplAdapter):
        ops = OPS                       # the packed layer keeps its clipped form: not this one
        policies = {"index_grad": "autograd"}

        def sparse_indexer_loss_grad(self, q_idx, k_idx, weights, compressed_ids, target,
                                     predict, *, coeff, num_real):
            return self._api.sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids,
                                                      target, predict, coeff=coeff,
                                                      num_real=num_real, mode="autograd",
                                                      **self._kw())
    obj = TorchAutogradGrad("torch", "cpu")
    obj.name = "gpu_impl:torch, autograd indexer gradient"
    return obj


_SPREAD = ("dsa-score-spread", "indexer-score-spread")
POLICY_MUTANTS: tuple[PolicyMutant, ...] = (
    PolicyMutant("loss_norm", "rows", _megatron("loss_norm", "rows"),
                 "the indexer loss divided by every row of the micro-batch (T), padding "
                 "included", ("dsa-padded", "padding-edge-layout")),
    PolicyMutant("loss_norm", "rank_mean", None,
                 "the indexer loss as the mean over the CP ranks of each rank's mean",
                 reason="differs from 'real' only under context parallelism: a single-device "
                        "implementation cannot follow it (its ops are not told the ranks)",
                 lane=("context-parallel lane",)),
    PolicyMutant("padding_rows", "attend", _megatron("padding_rows", "attend"),
                 "padding rows score and attend inside their padded document",
                 ("dsa-padded", "padding-edge-layout")),
    PolicyMutant("topk_ties", "any", _megatron("topk_ties", "any"),
                 "Top-K by torch.topk: any member of an exact tie at the K-th score",
                 ("dsa-zero-ties", "zero-score-ties")),
    PolicyMutant("index_scale", "dim_heads", _megatron("index_scale", "dim_heads"),
                 "indexer weights scaled by (D_I H_I)^-1/2 instead of D_I^-1/2",
                 ("dsa-padded", "padding-edge-layout")),
    PolicyMutant("index_grad", "autograd", _torch_autograd_grad,
                 "the indexer-loss gradient by autograd through the loss as written (the "
                 "torch backend's autograd form)", _SPREAD),
    PolicyMutant("index_grad", "exact", _megatron("index_grad", "exact"),
                 "the indexer-loss gradient p - tau, no floor", _SPREAD),
    PolicyMutant("kl_form", "log_softmax", _megatron("kl_form", "log_softmax"),
                 "KL = tau (log max(tau, 1e-10) - log_softmax(I))", _SPREAD),
    PolicyMutant("teacher", "dense", _megatron("teacher", "dense"),
                 "the teacher and the student over every visible key, each head normalised "
                 "over them", ("dsa-padded", "dsa-zero-ties")),
)

assert {(m.policy, m.value) for m in POLICY_MUTANTS} == {
    (n, v) for n, p in POLICIES.items() for v in p.values if v != p.default}, \
    "one policy mutant per non-default value"


@dataclass
class PolicyMutantResult(MutantResult):
    """A :class:`~dsv4_oracle.mutation.MutantResult` (its ``status``, ``killer``,
    ``cases_run`` are those of the run under the defaults) plus ``kills`` (the cases that
    failed under the defaults: ``len(kills)`` is the kill depth) and ``declared``: the run
    under its declaration (``passed``, ``failures`` case -> quantities, ``cases_run``,
    ``not_applicable`` case -> reason)."""

    kills: tuple = ()
    declared: dict = field(default_factory=dict)

    @property
    def kill_depth(self) -> int:
        return len(self.kills)

    @property
    def as_expected(self) -> bool:
        if self.status == "lane":
            return True
        return self.status == "killed" and bool(self.declared.get("passed"))

    def to_dict(self) -> dict:
        return {**super().to_dict(), "policy": self.mutant.policy, "value": self.mutant.value,
                "kill_depth": self.kill_depth, "kills": list(self.kills),
                "declared": self.declared}


def policy_adapter(mutant: PolicyMutant, *, declared: bool):
    """The mutant's implementation as an :class:`~dsv4_oracle.adapters.Adapter`, judged under
    its declared policies or (``declared=False``) under the contract's defaults."""
    from .adapters import Adapter

    obj = mutant.build()
    pol = getattr(obj, "policies", {})
    if pol.get(mutant.policy) != mutant.value:
        raise ValueError(f"{mutant.name}: the implementation declares {mutant.policy}="
                         f"{pol.get(mutant.policy)!r}")
    adapter = Adapter(obj, name=getattr(obj, "name", mutant.name), device="cpu",
                      spec=mutant.name)
    if not declared:
        adapter.set_policies({}, forget_declared=True)
    return adapter


def run_policy_mutant(mutant: PolicyMutant, cases, *, replays: int = 0,
                      progress=None) -> PolicyMutantResult:
    """Judge ``mutant`` over ``cases`` under the defaults (every case, in
    :func:`~dsv4_oracle.mutation.case_order`: the kill depth) and under its declaration (the
    cases that apply). ``replays``: bitwise replays per case (the policies do not change what
    the replays judge; 0 by default)."""
    from .conformance import not_applicable
    from .runner import check_case

    t0 = time.perf_counter()
    if mutant.build is None:
        return PolicyMutantResult(mutant, "lane", {"case": " ".join(mutant.lane),
                                                   "level": "lane", "quantity": "-",
                                                   "check": "-", "detail": mutant.reason},
                                  detail=mutant.reason)
    try:
        undeclared = policy_adapter(mutant, declared=False)
        declared = policy_adapter(mutant, declared=True)
    except Exception as exc:          # the implementation cannot be made: the mutant is broken
        return PolicyMutantResult(mutant, "error", detail=f"{type(exc).__name__}: {exc}",
                                  elapsed_s=time.perf_counter() - t0)
    ordered = case_order(mutant, cases)
    kills, killer = [], None
    for case in ordered:
        if progress:
            progress(mutant, case)
        outcome = check_case(undeclared, case, replays=replays)
        if not outcome.passed:
            kills.append(case.id)
            killer = killer or _killer(outcome)
    failures, skipped = {}, {}
    for case in ordered:
        why = not_applicable(case, declared.policies)
        if why:
            skipped[case.id] = why
            continue
        if progress:
            progress(mutant, case)
        outcome = check_case(declared, case, replays=replays)
        if not outcome.passed:
            failures[case.id] = sorted({c.extra.get("quantity", "?")
                                        for c in outcome.failed_checks} or {"materialize"})
    return PolicyMutantResult(
        mutant, "killed" if kills else "survived", killer, len(ordered),
        time.perf_counter() - t0, kills=tuple(kills),
        declared={"passed": not failures, "failures": failures,
                  "cases_run": len(ordered) - len(skipped), "not_applicable": skipped})


def status_text(r: PolicyMutantResult, *, markdown: bool = False) -> str:
    """The result column of the mutation table for a policy mutant (``markdown``: case ids in
    backticks)."""
    q = (lambda s: f"`{s}`") if markdown else (lambda s: s)  # noqa: E731
    if r.status == "lane":
        return f"lane only: {r.mutant.reason}"
    if r.status == "error":
        return f"ERROR: {r.detail}"
    d = r.declared
    fails = ", ".join(f"{q(c)} ({'/'.join(n)})" for c, n in d["failures"].items())
    decl = (f"declared: passes {d['cases_run']} cases" if d.get("passed") else
            f"declared: FAILS {fails}")
    if d.get("not_applicable"):
        decl += f" ({len(d['not_applicable'])} not applicable)"
    if r.status != "killed":
        return f"SURVIVED undeclared; {decl}"
    k = r.killer
    return (f"killed by {q(k['case'])} / {k['level']} / {k['quantity']}, kill depth "
            f"{r.kill_depth}; {decl}")
