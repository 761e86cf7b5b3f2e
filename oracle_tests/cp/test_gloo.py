"""The CP layer (``gpu_impl/cp.py``) on real ``torch.distributed`` process groups: gloo on the
CPU, cp 2 and 4, the portable torch backend (contract sections 10 and 11).

One spawn per CP size runs every job on fresh processes (``cp_lane.rank_main``); the tests
below judge what the ranks returned:

- the gathered results against the cp=1 oracle on the inputs the ranks consumed
  (``impl_harness.judge``: exact ids / lengths / Top-K / sink-only rows, error-model ratios for
  every number); each rank's numbers are slices of that check;
- every rank's ids in its physical key layout against the oracle plan (``reference.cp_plan``),
  its owned compressed-key gradients, and the CP-reduced quantities (loss, dsink) identical on
  every rank;
- bitwise replays in deterministic mode, identical ids/out/lse in every grad mode, inputs never
  modified;
- invalid CP inputs raise a clear error on every rank (no hang, the group stays usable);
- a rank that never joins a collective turns into a test failure after a deadline.
"""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.compare import compare_exact
from dsv4_oracle.compare import compare_exact as exact

from oracle_tests.helpers.cp_lane import CASES, gather_ranks, make_inputs, rank_main, spawn
from oracle_tests.helpers.impl_harness import TORCH_CPU, assert_checks, judge

pytestmark = pytest.mark.xdist_group("cp_gloo")

LAYER_JOBS = ("csa", "csa_zigzag", "hca", "window", "csa_bf16", "csa_no_groups")
INVALID = ("rows_on_one_rank", "layout_disagrees", "declared_cp", "halo_longer_than_slice",
           "rows_not_divisible", "kv_cmp_rows")


def _jobs(cp, replays):
    jobs = [(name, "layer", dict(case=name, replays=replays if name in ("csa", "csa_bf16") else 1))
            for name in LAYER_JOBS]
    if cp == 2:
        jobs.append(("csa_nondet", "layer", dict(case="csa", deterministic=False)))
    jobs.append(("grad_modes", "grad_modes", dict(case="csa_bf16")))
    jobs += [(f"invalid_{w}", "invalid", dict(case="csa", what=w)) for w in INVALID]
    return jobs


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def lane(request):
    cp = request.param
    replays = max(2, request.config.getoption("--replays"))
    return cp, spawn(rank_main, cp, _jobs(cp, replays), deadline_s=120.0)


@pytest.mark.parametrize("name", LAYER_JOBS)
def test_gathered_results_match_cp1_oracle(lane, name):
    cp, results = lane
    case = CASES[name]
    runs = [res[name]["runs"][0] for res in results]
    got, _ = gather_ranks(case, cp, runs)
    x = make_inputs(case)
    assert_checks(judge(TORCH_CPU, case, x, got), f"{case.id} cp={cp}")


@pytest.mark.parametrize("name", LAYER_JOBS)
def test_rank_physical_layout_matches_oracle_plan(lane, name):
    """Each rank's ids in its ``[halo | local | gathered]`` layout are the oracle plan's mapping
    of the cp=1 rows; the CP-reduced loss and sink gradient are bitwise equal on every rank."""
    cp, results = lane
    case = CASES[name]
    runs = [res[name]["runs"][0] for res in results]
    got, plans = gather_ranks(case, cp, runs)
    lay = case.layout()
    ref_ids, ref_len = R.build_csa_indices(
        lay, window=case.window, ratio=case.ratio,
        compressed_ids=got.get("cmp_ids"))
    verdicts = []
    for plan, run in zip(plans, runs):
        rows = plan.rows
        tag = f" (rank {plan.rank})"
        verdicts.append(exact("physical ids" + tag, run["ids"], plan.to_physical(ref_ids[rows])))
        verdicts.append(exact("lengths" + tag, run["lengths"], ref_len[rows]))
        used = plan.key_ids >= 0
        verdicts.append(exact("key_ids on referenced slots" + tag, run["key_ids"][used],
                              plan.key_ids[used]))
        if case.ratio:
            verdicts.append(exact("owned compressed groups" + tag,
                                  torch.tensor(run["dkv_cmp"].shape[0]),
                                  torch.tensor(plan.owned_groups.numel())))
        if "cmp_ids" in got:
            verdicts.append(exact("compressed slots" + tag, run["compressed_ids"],
                                  plan.compressed_to_slots(got["cmp_ids"][rows])))
            verdicts.append(exact("loss equal on every rank" + tag, run["loss"], runs[0]["loss"],
                                  bitwise=True))
        verdicts.append(exact("dsink equal on every rank" + tag, run["dsink"], runs[0]["dsink"],
                              bitwise=True))
    assert_checks(verdicts, f"{case.id} cp={cp}")


@pytest.mark.parametrize("name", ["csa", "csa_bf16"])
def test_deterministic_replays_are_bitwise(lane, name):
    cp, results = lane
    for rank, res in enumerate(results):
        runs = res[name]["runs"]
        assert len(runs) >= 2
        for k, v in runs[0].items():
            if not isinstance(v, torch.Tensor):
                continue
            for i, other in enumerate(runs[1:], 1):
                compare_exact(f"rank {rank}: {k}, replay {i} vs 0 (cp={cp}, {name})", other[k], v,
                              bitwise=True).raise_if_failed()


@pytest.mark.parametrize("name", LAYER_JOBS)
def test_inputs_are_not_modified(lane, name):
    _, results = lane
    for rank, res in enumerate(results):
        assert res[name]["mutated"] == [], f"rank {rank} modified {res[name]['mutated']}"


def test_grad_modes_give_identical_forward(lane):
    cp, results = lane
    for rank, res in enumerate(results):
        modes = res["grad_modes"]
        for mode in ("no_grad", "inference_mode"):
            for k in ("ids", "lengths", "out", "lse", "compressed_ids", "kl", "loss"):
                assert torch.equal(modes[mode][k], modes["grad"][k]), \
                    f"rank {rank}: {k} differs under {mode} (cp={cp})"


def test_nondeterministic_mode_is_still_correct(lane):
    """``deterministic=False`` (NCCL/gloo reductions instead of fixed-order folds) must still
    agree with the oracle within the error model."""
    cp, results = lane
    if cp != 2:
        pytest.skip("run for cp=2 only (keeps the lane short)")
    case = CASES["csa"]
    runs = [res["csa_nondet"]["runs"][0] for res in results]
    got, _ = gather_ranks(case, cp, runs)
    assert_checks(judge(TORCH_CPU, case, make_inputs(case), got), f"{case.id} nondet")


@pytest.mark.parametrize("what", INVALID)
def test_invalid_cp_input_raises_on_every_rank(lane, what):
    cp, results = lane
    verdicts = [res[f"invalid_{what}"] for res in results]
    assert all(v is not None for v in verdicts), f"{what}: some rank did not raise: {verdicts}"
    for rank, (kind, msg) in enumerate(verdicts):
        assert kind in ("ValueError", "TypeError"), (rank, kind, msg)
    needle = {"rows_on_one_rank": "rows", "layout_disagrees": "disagree", "declared_cp": "cp=",
              "halo_longer_than_slice": "halo", "rows_not_divisible": "does not divide",
              "kv_cmp_rows": "kv_cmp"}[what]
    assert all(needle in msg for _, msg in verdicts), verdicts


def test_checks_detect_cp_mistakes(lane):
    """Negative controls on real lane results: a lost halo gradient (the boundary rows of
    rank 0 without rank 1's contribution) and a halo off by one row both fail the checks."""
    cp, results = lane
    case = CASES["csa_zigzag"]          # rank boundaries inside documents: halos are used
    runs = [res["csa_zigzag"]["runs"][0] for res in results]
    got, plans = gather_ranks(case, cp, runs)
    x = make_inputs(case)
    r = next(p.rank for p, run in zip(plans, runs)
             if p.rank and bool(((run["ids"] >= 0) & (run["ids"] < p.num_halo)).any()))
    plan, run = plans[r], runs[r]
    halo = (run["ids"] >= 0) & (run["ids"] < plan.num_halo)
    referenced = torch.unique(plan.key_ids[run["ids"][halo].to(torch.int64)])
    lost = dict(got)
    lost["dkv"] = got["dkv"].clone()
    lost["dkv"][referenced] = 0
    bad = [v for v in judge(TORCH_CPU, case, x, lost) if not v.passed]
    assert [v.name for v in bad] == ["dkv"], bad
    shifted = run["ids"].clone()
    shifted[halo] -= 1
    want = plan.to_physical(got["ids"][plan.rows])
    assert exact("physical ids", run["ids"], want).passed
    assert not exact("physical ids", shifted, want).passed


def _hang(rank, world):
    import time

    import torch.distributed as dist
    if rank == 0:
        dist.barrier()              # rank 1 never joins
    else:
        time.sleep(120)


def test_a_hang_becomes_a_failure():
    with pytest.raises(TimeoutError, match="did not finish"):
        spawn(_hang, 2, deadline_s=4.0, collective_timeout_s=60.0)
