"""Serve settings chosen from measured costs (`draftflow.evaluation.serve_choice`), with fixed step costs: the
choice is arithmetic on measurements, so it is tested on given numbers, never by timing this machine."""

from __future__ import annotations

import dataclasses

import pytest

from draftflow.evaluation import serve_choice as sc

# SmolLM2-135M on this 2-core CPU, measured in the rehearsal (docs/results.md "Speed on a CPU"): a plain step 64.6 ms,
# verifying 8 positions 109 ms, DFlash's drafting pass 35.7 ms; acceptance by position 26%, 4%, 0.6%, ...
CPU_ACCEPT = [0.26, 0.04, 0.006, 0.001, 0.0, 0.0, 0.0]


def cpu_costs() -> sc.Costs:
    return sc.Costs(0.0646, {k: 0.0646 + (0.109 - 0.0646) * k / 7 for k in range(1, 8)})


def test_tau_of_a_chain_cut_after_k_drafts():
    assert sc.tau_at([0.5, 0.25, 0.1], 0) == 1.0
    assert sc.tau_at([0.5, 0.25, 0.1], 2) == pytest.approx(1.75)
    assert sc.tau_at([0.5, 0.25, 0.1], 9) == pytest.approx(1.85)


def test_on_a_cpu_where_every_drafter_is_slower_the_choice_is_plain_decoding():
    dflash = sc.Proposer("dflash", CPU_ACCEPT, sc.drafting_costs(0.0357, 7, "block"))
    choice = sc.choose([dflash], cpu_costs())
    assert choice.setting == "plain" and choice.predicted == 1.0 and choice.drafts is None
    assert choice.best_speculative == "dflash:k=1"  # one draft wastes the fewest slots
    assert choice.best_predicted == pytest.approx(1.26 * 0.0646 / (0.0646 + 0.0444 / 7 + 0.0357 * 2 / 8), rel=1e-3)
    assert choice.table["dflash:k=7"]["predicted"] == pytest.approx(1.307 * 0.0646 / (0.109 + 0.0357), rel=1e-3)
    line = sc.advice({"1": dataclasses.asdict(choice), "8": dataclasses.asdict(choice)})
    assert line.startswith("on this hardware serve without speculation: best drafter setting dflash:k=1 x1.0")
    assert "at batch 8" in line


def test_where_verifying_is_nearly_free_more_drafts_pay_until_acceptance_runs_out():
    # A GPU-like cost profile: a step bound by weight reads, verifying 8 positions costs about one step.
    costs = sc.Costs(0.010, {k: 0.010 * (1 + 0.02 * k) for k in range(1, 16)})
    accept = [0.9 ** k for k in range(1, 16)]
    dflash = sc.Proposer("dflash", accept, sc.drafting_costs(0.004, 15, "block"))
    eagle = sc.Proposer("eagle3", accept, sc.drafting_costs(0.015, 15, "chain"))
    choice = sc.choose([dflash, eagle], costs)
    assert choice.proposer == "dflash" and 5 <= choice.drafts <= 15 and choice.predicted > 3
    # EAGLE-3 pays a pass per draft: its best k is smaller than DFlash's
    eagle_best = max((s for s in choice.table if s.startswith("eagle3")), key=lambda s: choice.table[s]["predicted"])
    assert int(eagle_best.rsplit("=", 1)[1]) < choice.drafts
    assert sc.advice({"1": dataclasses.asdict(choice)}).startswith("chosen from measured costs: batch 1 dflash:k=")


def test_a_lookup_that_rarely_drafts_gains_and_costs_on_its_drafting_steps_only():
    costs = sc.Costs(0.02, {1: 0.022, 2: 0.024, 3: 0.026})
    always = sc.Proposer("ngram", [0.5, 0.3, 0.2], sc.drafting_costs(0.0, 3, "free"), drafting_share=1.0)
    seldom = sc.Proposer("ngram", [0.5, 0.3, 0.2], sc.drafting_costs(0.0, 3, "free"), drafting_share=0.2)
    assert sc.predict(always, costs, 3) == pytest.approx(2.0 * 0.02 / 0.026)
    assert sc.predict(seldom, costs, 3) == pytest.approx(1.2 * 0.02 / (0.2 * 0.026 + 0.8 * 0.02))
    # the speculative path's own cost on every step (read off the measured run) weighs on every k
    slow = sc.Proposer("ngram", [0.5, 0.3, 0.2], sc.drafting_costs(0.0, 3, "free"), 0.2, overhead_s=0.004)
    assert sc.predict(slow, costs, 1) == pytest.approx(1.1 * 0.02 / (0.2 * 0.022 + 0.8 * 0.02 + 0.004))


def test_ties_go_to_fewer_drafts_and_the_margin_keeps_noise_out():
    costs = sc.Costs(1.0, {1: 1.0, 2: 1.0})
    flat = sc.Proposer("eagle3", [0.01, 0.0], {1: 0.0, 2: 0.0})
    choice = sc.choose([flat], costs)
    assert choice.best_speculative == "eagle3:k=1" and choice.setting == "plain"  # x1.01 < MARGIN
    assert sc.choose([flat], costs, margin=1.0).setting == "eagle3:k=1"
    with pytest.raises(ValueError, match="step costs must be positive"):
        sc.choose([flat], sc.Costs(0.0, {1: 1.0}))


def test_verify_costs_from_the_probe_cancel_the_requests_overhead():
    # one request: 30 ms of overhead, then 5 ms per new position on top of the plain step's forward
    probe = {n: 0.030 + 0.020 + 0.005 * (n - 1) for n in range(1, 9)}
    verify = sc.verify_from_probe(0.021, probe)
    assert set(verify) == set(range(1, 8))
    assert verify[1] == pytest.approx(0.026) and verify[7] == pytest.approx(0.021 + 0.035)


def test_a_noisy_dip_in_the_probe_does_not_make_more_drafts_cheaper():
    # SmolLM2's EAGLE-3 probe at batch 1 (2026-12-06): k = 3 (n = 4) measured below k = 1, and was chosen
    probe = {1: 0.0462, 2: 0.0537, 3: 0.0566, 4: 0.0510, 5: 0.0659, 6: 0.0643, 7: 0.0585, 8: 0.0636}
    verify = sc.verify_from_probe(0.0462, probe)
    assert all(verify[k] <= verify[k + 1] for k in range(1, 7))
    assert verify[1] == pytest.approx(0.0537) and verify[2] == verify[3] == pytest.approx((0.0566 + 0.0510) / 2)
    assert verify[4] == verify[6] == pytest.approx((0.0659 + 0.0643 + 0.0585) / 3)
    assert verify[7] == pytest.approx(0.0636)
    rising = [0.01, 0.02, 0.02, 0.03]
    assert sc.non_decreasing(rising) == rising and sc.non_decreasing([3.0, 1.0, 2.0]) == pytest.approx([2.0] * 3)


def test_drafting_costs_scale_as_each_proposer_drafts():
    assert sc.drafting_costs(0.08, 7, "block") == pytest.approx({k: 0.08 * (k + 1) / 8 for k in range(1, 8)})
    assert sc.drafting_costs(0.07, 7, "chain")[3] == pytest.approx(0.03)
    assert set(sc.drafting_costs(0.07, 3, "free").values()) == {0.0}
    assert sc.spec_step_seconds(8, 1.5, 60.0) == pytest.approx(0.2) and sc.spec_step_seconds(1, None, 5.0) is None


def test_the_choice_is_said_plainly_beside_the_serve_lines():
    plain = {"1": {"setting": "plain", "predicted": 1.0, "best_speculative": "dflash:k=1", "best_predicted": 0.83},
             "8": {"setting": "plain", "predicted": 1.0, "best_speculative": "dflash:k=1", "best_predicted": 0.41}}
    assert sc.advice(plain) == ("on this hardware serve without speculation: best drafter setting dflash:k=1 x0.83 "
                                "at batch 1, best drafter setting dflash:k=1 x0.41 at batch 8")
    mixed = {"1": {"setting": "dflash:k=3", "predicted": 1.4}, "8": {"setting": "plain", "predicted": 1.0}}
    assert sc.advice(mixed) == "chosen from measured costs: batch 1 dflash:k=3 x1.40, batch 8 plain decoding x1.00"
    assert sc.advice(None) is None


def test_serve_lines_carry_batch_ones_chosen_drafts():
    from draftflow.stages.train import _chosen_drafts

    assert _chosen_drafts({"1": {"setting": "dflash:k=3"}}, 7) == 3
    assert _chosen_drafts({"1": {"setting": "ngram:k=4"}}, 7) == 7  # not the drafter's
    assert _chosen_drafts({"1": {"setting": "plain"}}, 7) == 7 and _chosen_drafts(None, 7) == 7
