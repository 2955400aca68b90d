"""The drafter registry: one spec per kind, one path for tap ids, one-line config errors, a cost model per kind."""

from __future__ import annotations

import dataclasses

import pytest

from draftflow.config import DrafterConfig, RunConfig
from draftflow.drafters.registry import DRAFTERS, drafter_spec, spec_for_architecture
from draftflow.drafters.taps import KINDS, check_drafter, feature_ids
from draftflow.errors import ConfigError
from draftflow.layers import FINAL


def test_the_registry_has_every_kind_with_every_part():
    assert list(DRAFTERS) == list(KINDS) and {"dflash", "eagle3"} <= set(KINDS)
    for kind, spec in DRAFTERS.items():
        assert spec.kind == kind and spec.title
        assert set(spec.exporters) == {"vllm", "speculators"}
        assert spec_for_architecture(spec.architecture) is spec
        assert "config.json" in spec.export_files("speculators")
    assert "modeling_dflash.py" in drafter_spec("dflash").export_files("vllm")
    assert "modeling_dflash.py" not in drafter_spec("eagle3").export_files("vllm")


def test_feature_ids_are_resolved_by_one_rule_per_kind():
    assert feature_ids(DrafterConfig(num_taps=5), 36) == [1, 9, 17, 25, 33]  # the DFlash paper's Qwen3-8B taps
    assert feature_ids(DrafterConfig(kind="eagle3"), 36) == [1, 17, 32, FINAL]  # vLLM's 2, N//2, N-3 minus one
    assert feature_ids(DrafterConfig(num_taps=2, target_layer_ids=[0, 4]), 8) == [0, 4]


@pytest.mark.parametrize("drafter, match", [
    (DrafterConfig(num_taps=5, target_layer_ids=[1, 2, 3]), "has 3 ids but drafter.num_taps is 5"),
    (DrafterConfig(kind="eagle3", target_layer_ids=[1, 2]), "exactly 3 taps"),
    (DrafterConfig(num_layers=2, layer_types=["full_attention"]), "layer_types has 1 entries"),
    (DrafterConfig(num_layers=1, layer_types=["global"]), "unknown"),
    (DrafterConfig(num_layers=1, layer_types=["sliding_attention"]), "sliding_window"),
    (DrafterConfig(kind="medusa"), "known: " + ", ".join(sorted(KINDS))),
])
def test_target_free_drafter_errors_are_one_line_config_errors(drafter, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_drafter(drafter)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("drafter, match", [
    (DrafterConfig(num_taps=3, target_layer_ids=[1, 3, 8]), "contains 8"),
    (DrafterConfig(num_taps=2, target_layer_ids=[3, 1]), "strictly increasing"),
    (DrafterConfig(num_taps=3, target_layer_ids=[1, 2, 7]), "last layer"),
    (DrafterConfig(kind="eagle3", target_layer_ids=[1, 2, 9]), "contains 9"),
])
def test_taps_against_the_target_are_one_line_config_errors(drafter, match):
    with pytest.raises(ConfigError, match=match) as err:
        feature_ids(drafter, 8)
    assert "\n" not in str(err.value)


def test_the_cost_model_differs_per_kind():
    shape = {"hidden": 4096, "layer_params": 200_000_000, "head_params": 151936 * 4096}
    flops = {kind: spec.train_flops(RunConfig(drafter=DrafterConfig(kind=kind)), 3072.0, shape)
             for kind, spec in DRAFTERS.items()}
    assert all(f > 0 for f in flops.values()) and flops["dflash"] != flops["eagle3"]
    assert len({spec.cost_note for spec in DRAFTERS.values()}) == len(DRAFTERS)


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"drafter.kind='mine' is not a drafter kind; known: " + ", ".join(KINDS)):
        drafter_spec("mine")


def test_a_kind_folder_whose_rule_or_spec_names_another_kind_fails_in_one_line(monkeypatch):
    """A kind is its folder's name (docs/extending.md, "Adding a drafter kind"): a copied folder whose RULE or SPEC
    still says the old kind is refused by name."""
    import draftflow.drafters.dflash.spec as dflash_spec
    import draftflow.drafters.dflash.taps as dflash_taps
    import draftflow.drafters.registry as registry
    import draftflow.drafters.taps as taps

    monkeypatch.setattr(dflash_taps, "RULE", dataclasses.replace(dflash_taps.RULE, kind="copied"))
    with pytest.raises(ConfigError, match=r"^draftflow/drafters/dflash/taps.py: RULE.kind is 'copied'; set it to "
                       r"'dflash'$"):
        taps._rule("dflash")
    monkeypatch.undo()
    monkeypatch.setattr(dflash_spec, "SPEC", dataclasses.replace(dflash_spec.SPEC, kind="copied"))
    with pytest.raises(ConfigError, match=r"^draftflow/drafters/dflash/spec.py: SPEC needs kind='dflash'"):
        registry._spec("dflash")
