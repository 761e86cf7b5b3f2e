"""Faults of one rank of a CP group fail fast and loud on every rank (``gpu_impl/cp.py``,
contract section 10): gloo on the CPU, real processes, each test bounded by a deadline.

- A rank whose arguments differ from the others' (the sink values, a dtype, ``scale``,
  ``topk``, ...) or fail validation (a NaN, an infinity, a bad option) makes *every* rank raise
  the same kind of clear error, naming the argument and the ranks, before any data moves; the
  group stays usable. (Without the agreement, differing sinks give silently wrong rows,
  differing indexer dtypes abort a rank inside gloo and a NaN on one rank leaves the others
  blocked until the process group's timeout.)
- A fault no validation can see (a rank that never calls the layer, a kernel failing on one
  rank after the exchange) makes the waiting ranks raise ``TimeoutError`` after the layer's
  own ``timeout``, well before the process group's timeout (60 s here) and the test's deadline;
  without ``timeout``, after the process group's own timeout when that is the shorter.
- A rank whose process leaves the group (after failing in the forward or the backward) makes
  the others raise the layer's own ``RuntimeError`` at once, whether their collective was
  waiting or could not start.
"""
from __future__ import annotations

import pytest

from oracle_tests.helpers.cp_lane import FAULTS, fault_main, rank_main, spawn

pytestmark = pytest.mark.xdist_group("cp_faults")

# what -> (the argument the message must name, the error type every rank raises)
EXPECTED = {
    "sink_differs": ("sink", "ValueError"),
    "indexer_dtype_differs": ("q_idx", "ValueError"),
    "dtype_differs": ("q", "ValueError"),
    "nan_q": ("q", "ValueError"),
    "nan_q_idx": ("q_idx", "ValueError"),
    "inf_k_idx": ("k_idx", "ValueError"),
    "nan_sink": ("sink", "ValueError"),
    "scale_differs": ("scale", "ValueError"),
    "topk_differs": ("topk", "ValueError"),
    "coeff_differs": ("coeff", "ValueError"),
    "v_dim_differs": ("v_dim", "ValueError"),
    "window_differs": ("window", "ValueError"),
    "order_differs": ("order", "ValueError"),
    "deterministic_differs": ("deterministic", "ValueError"),
    "bad_timeout": ("timeout", "ValueError"),
    "bad_chunk": ("chunk_elements", "ValueError"),
}
assert set(EXPECTED) == set(FAULTS)


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def faults(request):
    cp = request.param
    jobs = [(f"invalid_{w}", "invalid", dict(case="csa", what=w)) for w in FAULTS]
    return cp, spawn(rank_main, cp, jobs, deadline_s=60.0, collective_timeout_s=60.0)


@pytest.mark.parametrize("what", sorted(FAULTS))
def test_a_fault_of_one_rank_raises_on_every_rank(faults, what):
    """The last rank is the odd one out; every rank raises, naming the argument and it."""
    cp, results = faults
    arg, kind = EXPECTED[what]
    last = cp - 1
    verdicts = [res[f"invalid_{what}"] for res in results]
    assert all(v is not None for v in verdicts), f"{what}: a rank did not raise: {verdicts}"
    for rank, (got_kind, msg) in enumerate(verdicts):
        assert got_kind in (kind, "TypeError"), (rank, got_kind, msg)
        assert arg in msg, f"rank {rank} does not name {arg!r}: {msg}"
        assert f"rank {last}" in msg or f"ranks {last}" in msg or f", {last}" in msg, \
            f"rank {rank} does not name rank {last}: {msg}"


def test_disagreement_names_the_argument_the_ranks_and_the_values(faults):
    cp, results = faults
    kind, msg = results[0]["invalid_sink_differs"]
    assert kind == "ValueError"
    assert msg.startswith("CP ranks disagree on sink ")
    others = ", ".join(map(str, range(cp - 1)))
    assert f"rank{'s' if cp > 2 else ''} {others}: [" in msg and f"rank {cp - 1}: [" in msg, msg


@pytest.mark.parametrize("what", ["never_joins", "fails_later"])
def test_a_rank_that_drops_out_makes_the_others_time_out(what):
    """The waiting ranks raise the layer's ``TimeoutError`` after ``timeout`` (2 s), not after
    the group's own timeout (60 s) or the test's deadline (30 s)."""
    results = spawn(fault_main, 2, what, 2.0, deadline_s=30.0, collective_timeout_s=60.0)
    kind, msg = results[0]
    assert kind == "TimeoutError", results[0]
    assert "within 2 s" in msg, msg
    where = "the validation exchange" if what == "never_joins" else "the loss reduction"
    assert where in msg and "rank 0" in msg, msg
    if what == "fails_later":
        assert results[1] == ("RuntimeError", "simulated kernel failure"), results[1]


def test_a_rank_that_exits_makes_the_others_fail_at_once():
    """A failed rank whose process leaves the group closes its connections: the waiting rank
    raises a ``RuntimeError`` naming the collective (no waiting for any timeout)."""
    results = spawn(fault_main, 2, "fails_and_exits", 30.0, deadline_s=20.0,
                    collective_timeout_s=60.0)
    kind, msg = results[0]
    assert kind == "RuntimeError" and "the loss reduction failed on rank 0" in msg, results[0]
    assert results[1] == ("RuntimeError", "simulated kernel failure"), results[1]


def test_the_layers_limit_defaults_to_a_shorter_group_timeout():
    """Without ``timeout``, the layer waits no longer than the process group's own timeout
    (3 s here) when that is shorter than its default (60 s); the failed rank stays alive for
    8 s, so a wait bounded by anything longer would end in its exit instead."""
    results = spawn(fault_main, 2, "fails_later", None, 8.0, deadline_s=40.0,
                    collective_timeout_s=3.0)
    kind, msg = results[0]
    assert kind == "TimeoutError", results[0]
    assert "within 3 s" in msg and "the loss reduction" in msg and "rank 0" in msg, msg


def test_a_rank_that_fails_in_the_backward_and_exits_gets_the_layers_message():
    """The peer's next collective cannot even start (the connection is closed): the layer's
    own RuntimeError naming the collective and the rank, not gloo's raw message."""
    results = spawn(fault_main, 2, "fails_in_backward_and_exits", 30.0, deadline_s=20.0,
                    collective_timeout_s=60.0)
    kind, msg = results[0]
    assert kind == "RuntimeError" and msg.startswith("cp_csa_layer: the "), results[0]
    assert "failed on rank 0 of the CP group (another rank failed or exited" in msg, msg
    assert results[1] == ("RuntimeError", "simulated kernel failure"), results[1]
