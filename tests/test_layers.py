"""Layer ids: the paper's default taps, validation, and the one table of engine index conventions."""

import ast
from pathlib import Path

import pytest

from draftflow.drafters.dflash.taps import default_dflash_layer_ids
from draftflow.drafters.eagle3.taps import default_eagle3_layer_ids, eagle3_layer_ids
from draftflow.errors import ConfigError
from draftflow.layers import (
    ENGINE_OFFSETS,
    engine_layer_id,
    engine_layer_index,
    hf_hidden_state_index,
    validate_layer_ids,
)

LIBRARY = Path(__file__).resolve().parent.parent / "draftflow"


def test_paper_default_taps():
    assert default_dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, DFlash paper
    assert default_dflash_layer_ids(8, 3) == [1, 3, 5]  # the tiny target
    assert eagle3_layer_ids(36) == [2, 18, 33]  # vLLM's default aux ids (boundaries)
    assert default_eagle3_layer_ids(36) == [1, 17, 32]  # the same layers as draftflow ids
    assert hf_hidden_state_index(1) == 2


def test_more_default_taps_than_the_target_allows_blames_num_taps():
    """`--set drafter.num_taps=99` blamed drafter.target_layer_ids, a key the user never set."""
    assert default_dflash_layer_ids(8, 5) == [1, 2, 3, 4, 5]  # the most the tiny target gives: all distinct
    with pytest.raises(ConfigError, match=r"drafter.num_taps is 6 but the target's 8 layers give at most 5") as err:
        default_dflash_layer_ids(8, 6)
    assert "target_layer_ids" not in str(err.value).split(";")[0]


def test_one_table_both_ways():
    assert ENGINE_OFFSETS == {"hf_hook": 0, "hf_hidden": 1, "vllm": 1}
    for engine in ENGINE_OFFSETS:
        assert [engine_layer_id(engine, engine_layer_index(engine, lid)) for lid in range(8)] == list(range(8))
    assert [hf_hidden_state_index(lid) for lid in range(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="no layer-index convention for engine 'sglang'"):
        engine_layer_id("sglang", 3)


def _offset_by_one(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add | ast.Sub)
        and isinstance(node.right, ast.Constant)
        and node.right.value == 1
    )


def layer_offsets_outside_the_table(root: Path = LIBRARY) -> list[str]:
    """Code that converts layer ids by hand: `[i ± 1 for i in ...layer_ids...]`, `hidden_states[x ± 1]`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "layers.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ListComp | ast.GeneratorExp) and _offset_by_one(node.elt):
                iters = " ".join(ast.unparse(g.iter) for g in node.generators)
                if "layer_ids" in iters or "aux" in iters:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
            hidden = isinstance(node, ast.Subscript) and "hidden_states" in ast.unparse(node.value)
            if hidden and _offset_by_one(node.slice):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_layer_id_conversions_go_through_the_table(tmp_path):
    assert layer_offsets_outside_the_table() == []
    (tmp_path / "pkg").mkdir()  # the scan finds both kinds of hand conversion
    (tmp_path / "pkg" / "bad.py").write_text(
        "aux = [i + 1 for i in cfg.target_layer_ids]\nx = out.hidden_states[lid + 1]\n"
    )
    assert len(layer_offsets_outside_the_table(tmp_path / "pkg")) == 2


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1, 8], "contains 8"),  # out of range
        ([1, 7], "last layer"),  # N-1: transformers only exposes it after the final norm
        ([3, 1], "strictly increasing"),
        ([], "empty"),
    ],
)
def test_bad_layer_ids_are_config_errors(ids, match):
    with pytest.raises(ConfigError, match=match):
        validate_layer_ids(ids, 8)
