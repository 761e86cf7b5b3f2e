"""The contract's named policies (contract section 5.2), one copy each.

Where public implementations legitimately choose differently (DeepSeek's and NVIDIA's codes,
cuDNN, Megatron-Core's DSA), the choice is a named *policy* with a default. An implementation
declares the policies it follows; the oracle is then evaluated under them and the check is as
tight as under the defaults. A verdict states every non-default policy it assumed.

Each :class:`Policy` names the rule it varies, its values (the default first) and what each
value means; the oracle functions take the corresponding explicit arguments (a layout whose
padding rows are real, a loss normaliser, an indexer scale, a gradient form, a KL form, a
teacher), and :mod:`dsv4_oracle.conformance` is the one place that turns a policy into those
arguments.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["Policy", "POLICIES", "DEFAULT_POLICIES", "resolve_policies", "non_default",
           "policy_line"]


class Policy(NamedTuple):
    """One policy: ``name``, the contract ``section`` it varies, ``values`` (value -> what it
    means; the first is the default) and ``rule`` (the rule it varies, one line)."""

    name: str
    section: str
    rule: str
    values: dict

    @property
    def default(self) -> str:
        return next(iter(self.values))


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("loss_norm", "8", "the indexer loss's normaliser N", {
        "real": "sum over real rows / the real tokens of the micro-batch (cu_seqlens[-1])",
        "rows": "sum over rows with a selection / every row of the micro-batch (T, padding and "
                "capacity rows included)",
        "rank_mean": "the mean over the CP ranks of each rank's (sum over its real rows / its "
                     "real tokens); a rank without real tokens contributes 0"}),
    Policy("padding_rows", "3", "what a padding row sees", {
        "sink_only": "padding and capacity rows see no key (sink-only rows)",
        "attend": "padding rows see keys as a real row at their padded position of the document "
                  "would (the document's bounds are cu_seqlens_padded); capacity rows see none"}),
    Policy("topk_ties", "4", "which columns an exact tie at the K-th score selects", {
        "by_id": "the smaller column id wins (the stable order)",
        "any": "any member of an exact tie: the set must be a Top-K of the scores (every "
               "selected score >= every unselected candidate's) and the lengths exact"}),
    Policy("index_scale", "7", "the indexer's scale", {
        "dim": "D_I ** -0.5",
        "dim_heads": "(D_I * H_I) ** -0.5 (the weights also scaled by H_I ** -0.5)"}),
    Policy("index_grad", "8", "the gradient wrt the indexer logits", {
        "clipped": "gI = gs (p sum_c' tau~_c' m_c' - tau~_c m_c), tau~ = max(tau, e), "
                   "m_c = 1[p_c >= e] (the cuDNN kernels' form)",
        "autograd": "the exact derivative of the loss as written (its floors included)",
        "exact": "gI = gs (p sum_c' tau_c' - tau_c), that is p - tau on rows with teacher "
                 "mass: the derivative of KL(tau || softmax(I)) with no floor"}),
    Policy("kl_form", "8", "the per-row KL", {
        "clipped": "sum_c max(tau, f) (log max(tau, f) - log max(p, f)), f = 2^-126",
        "log_softmax": "sum_c tau (log max(tau, 1e-10) - log_softmax(I)_c): tau unclipped as a "
                       "factor, the student's log exact"}),
    Policy("teacher", "8", "the keys the teacher and the student range over", {
        "sparse": "the row's selected compressed keys C_t, each head normalised by LSEf "
                  "(the attention's own normaliser)",
        "dense": "every compressed key visible to the row, each head normalised by its own "
                 "log-sum-exp over them and its sink; target and predict are [T, C] by "
                 "compressed id (0 where not visible)"}),
)}

DEFAULT_POLICIES: dict[str, str] = {n: p.default for n, p in POLICIES.items()}


def resolve_policies(policies, name: str = "policies") -> dict:
    """Every policy's value: ``policies`` (``None`` or a mapping policy name -> value) over
    the defaults. An unknown name or value is a ``ValueError`` naming it and what is allowed;
    a non-mapping or a non-string value a ``TypeError``."""
    if policies is None:
        return dict(DEFAULT_POLICIES)
    if not isinstance(policies, Mapping):
        raise TypeError(f"{name} must be a mapping policy name -> value (e.g. "
                        f"{{'loss_norm': 'rows'}}), got {type(policies).__name__}")
    out = dict(DEFAULT_POLICIES)
    for k, v in policies.items():
        if k not in POLICIES:
            raise ValueError(f"{name}: unknown policy {k!r}; the policies are "
                             f"{', '.join(POLICIES)} (contract section 5.2)")
        if not isinstance(v, str):
            raise TypeError(f"{name}: the value of {k!r} must be a str, got {type(v).__name__}")
        if v not in POLICIES[k].values:
            raise ValueError(f"{name}: policy {k!r} has no value {v!r}; its values are "
                             f"{', '.join(POLICIES[k].values)}")
        out[k] = v
    return out


def non_default(policies) -> dict:
    """The entries of a resolved policy mapping that differ from the defaults."""
    return {k: v for k, v in resolve_policies(policies).items() if v != DEFAULT_POLICIES[k]}


def policy_line(policies) -> str:
    """``"loss_norm=rows, teacher=dense"`` (the non-default policies), or ``""``."""
    return ", ".join(f"{k}={v}" for k, v in non_default(policies).items())
