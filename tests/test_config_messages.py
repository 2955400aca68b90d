"""Config mistakes are one line that says where: the file with line and column, or the --set that wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftflow.config import load_config
from draftflow.errors import ConfigError


def test_a_yaml_syntax_error_names_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\ncurate:\n  sources: [a, b\ntrain:\n  lr: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert "\n" not in msg and str(p) in msg and "line 4, column 6" in msg


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xe9 at offset 9\); save it as UTF-8"):
        load_config(p)


def test_an_unknown_key_given_with_set_is_blamed_on_set():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", overrides=["train.lrr=1e-3"])
    assert str(err.value) == "unknown config key 'train.lrr' in --set train.lrr=1e-3; remove it or fix its spelling"


def test_a_bad_value_given_with_set_is_blamed_on_set_and_a_file_key_on_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid config value at 'train.lr' in --set train.lr=-1: "):
        load_config("configs/tiny.yaml", overrides=["train.lr=-1"])
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'train.lrr' in {p}"):
        load_config(p, overrides=["train.lr=1e-3"])


def test_a_delta_config_resolves_to_the_full_file_it_replaced():
    """configs/tiny-eagle3.yaml (`base: tiny.yaml` + what differs) is the config it spelled out in full, every
    field equal, so every stage fingerprint of its runs is unchanged; switching the drafter's kind replaces
    the section (tiny.yaml's DFlash num_layers/num_taps do not leak into EAGLE-3's)."""
    root = Path(__file__).resolve().parents[1]
    delta = load_config(root / "configs" / "tiny-eagle3.yaml").model_dump()
    full = load_config(root / "tests" / "fixtures" / "configs" / "tiny-eagle3-full.yaml").model_dump()
    assert delta == full
    assert delta["drafter"]["num_layers"] == full["drafter"]["num_layers"] != \
        load_config(root / "configs" / "tiny.yaml").drafter.num_layers
