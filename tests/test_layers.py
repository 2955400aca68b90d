import pytest

from draftflow.errors import ConfigError
from draftflow.layers import default_dflash_layer_ids, eagle3_layer_ids, hf_hidden_state_index, validate_layer_ids


def test_paper_default_taps():
    assert default_dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, DFlash paper
    assert default_dflash_layer_ids(8, 3) == [1, 3, 5]  # the tiny target
    assert eagle3_layer_ids(36) == [2, 18, 33]
    assert hf_hidden_state_index(1) == 2


@pytest.mark.parametrize("ids, match", [
    ([1, 8], "contains 8"),            # out of range
    ([1, 7], "last layer"),             # N-1: transformers only exposes it after the final norm
    ([3, 1], "strictly increasing"),
    ([], "empty"),
])
def test_bad_layer_ids_are_config_errors(ids, match):
    with pytest.raises(ConfigError, match=match):
        validate_layer_ids(ids, 8)
