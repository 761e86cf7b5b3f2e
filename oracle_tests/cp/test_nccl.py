"""The CP layer on two GPUs over NCCL, cp = 2, ``backend="auto"`` (cuDNN where its kernels
run the op, the torch backend for the rest; every result records which backend ran each op).
Marked ``multigpu`` + ``gpu`` (the pytest plugin skips it without two CUDA devices). Run it as::

    NCCL_NVLS_ENABLE=0 pytest -m multigpu oracle_tests/cp/test_nccl.py

The same judgement as the gloo lane (``cp/test_gloo.py``): gathered results against the cp=1
oracle on the consumed inputs, each rank's physical layout against the oracle plan, bitwise
replays, grad-mode parity, no mutation, invalid input raising on every rank. The main case has
the DSv4-Flash head shapes (H 64, D 512, W 128, H_I 64, D_I 128, bf16) at T = 1024.
"""
from __future__ import annotations

import os

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.compare import compare_exact
from dsv4_oracle.compare import compare_exact as exact

from oracle_tests.helpers.cp_lane import CASES, gather_ranks, make_inputs, rank_main, spawn
from oracle_tests.helpers.impl_harness import CUDNN_CUDA, assert_checks, judge

pytestmark = [pytest.mark.multigpu, pytest.mark.gpu]

CP = 2
LAYER_JOBS = ("flash_1k", "csa_bf16", "csa_zigzag", "hca", "window")
INVALID = ("rows_on_one_rank", "layout_disagrees", "declared_cp", "kv_cmp_rows")


@pytest.fixture(scope="module")
def lane(request):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # never NVLink multicast
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        pytest.fail("NCCL_NVLS_ENABLE must be 0 on the shared multi-GPU machines")
    replays = max(2, request.config.getoption("--replays"))
    gpu = dict(device="cuda", backend="auto")
    jobs = [(n, "layer", dict(case=n, replays=replays if n in ("flash_1k", "csa_bf16") else 1,
                              **gpu)) for n in LAYER_JOBS]
    jobs.append(("csa_bf16_nondet", "layer", dict(case="csa_bf16", deterministic=False, **gpu)))
    jobs.append(("grad_modes", "grad_modes", dict(case="flash_1k", **gpu)))
    jobs += [(f"invalid_{w}", "invalid", dict(case="csa_bf16", what=w, **gpu)) for w in INVALID]
    return spawn(rank_main, CP, jobs, backend="nccl", deadline_s=420.0,
                 collective_timeout_s=300.0, start_method="spawn")


@pytest.mark.parametrize("name", LAYER_JOBS + ("csa_bf16_nondet",))
def test_gathered_results_match_cp1_oracle(lane, name):
    case = CASES[name.replace("_nondet", "")]
    runs = [res[name]["runs"][0] for res in lane]
    print(f"{name}: backends per rank {[r['backends'] for r in runs]}")
    got, _ = gather_ranks(case, CP, runs)
    assert_checks(judge(CUDNN_CUDA, case, make_inputs(case), got), f"{case.id} nccl cp={CP}")


@pytest.mark.parametrize("name", LAYER_JOBS)
def test_rank_physical_layout_matches_oracle_plan(lane, name):
    case = CASES[name]
    runs = [res[name]["runs"][0] for res in lane]
    got, plans = gather_ranks(case, CP, runs)
    ref_ids, ref_len = R.build_csa_indices(
        case.layout(), window=case.window, ratio=case.ratio,
        compressed_ids=got.get("cmp_ids"))
    verdicts = []
    for plan, run in zip(plans, runs):
        tag = f" (rank {plan.rank})"
        verdicts.append(exact("physical ids" + tag, run["ids"],
                              plan.to_physical(ref_ids[plan.rows])))
        verdicts.append(exact("lengths" + tag, run["lengths"], ref_len[plan.rows]))
        verdicts.append(exact("dsink equal on every rank" + tag, run["dsink"], runs[0]["dsink"],
                              bitwise=True))
        if "cmp_ids" in got:
            verdicts.append(exact("loss equal on every rank" + tag, run["loss"], runs[0]["loss"],
                                  bitwise=True))
    assert_checks(verdicts, f"{case.id} nccl cp={CP}")


@pytest.mark.parametrize("name", ["flash_1k", "csa_bf16"])
def test_deterministic_replays_are_bitwise(lane, name):
    for rank, res in enumerate(lane):
        runs = res[name]["runs"]
        for k, v in runs[0].items():
            if isinstance(v, torch.Tensor):
                for i, other in enumerate(runs[1:], 1):
                    compare_exact(f"rank {rank}: {k}, replay {i} vs 0 ({name})", other[k], v,
                                  bitwise=True).raise_if_failed()


@pytest.mark.parametrize("name", LAYER_JOBS)
def test_inputs_are_not_modified(lane, name):
    for rank, res in enumerate(lane):
        assert res[name]["mutated"] == [], f"rank {rank} modified {res[name]['mutated']}"


def test_grad_modes_give_identical_forward(lane):
    for rank, res in enumerate(lane):
        modes = res["grad_modes"]
        for mode in ("no_grad", "inference_mode"):
            for k in ("ids", "lengths", "out", "lse", "compressed_ids", "kl", "loss"):
                compare_exact(f"rank {rank}: {k} under {mode}", modes[mode][k],
                              modes["grad"][k], bitwise=True).raise_if_failed()


@pytest.mark.parametrize("what", INVALID)
def test_invalid_cp_input_raises_on_every_rank(lane, what):
    verdicts = [res[f"invalid_{what}"] for res in lane]
    assert all(v is not None and v[0] in ("ValueError", "TypeError") for v in verdicts), verdicts
