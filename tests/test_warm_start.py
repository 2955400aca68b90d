"""Warm starts (`train.init_from`, issue 34 point 1): what it names, what it refuses, what it starts from.

Real pieces: the code-built tiny Qwen3 target, real DFlash drafters trained by the loop and exported in the vLLM
format, a run root laid out as the train stage and the gate leave it. The whole pipeline (a gated run, then a run
warm-started from its promoted drafter) is `test_a_run_warm_starts_from_the_promoted_drafter_of_its_root`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from draftflow.config import DrafterConfig
from draftflow.drafters.dflash.config import DFlashConfig
from draftflow.drafters.dflash.export import export_vllm_dflash
from draftflow.drafters.dflash.model import DFlashDrafter
from draftflow.drafters.export import write_trained_on
from draftflow.errors import ConfigError
from draftflow.promotion import PROMOTED, promoted_export
from draftflow.store import Store
from draftflow.training import warm
from draftflow.training.loop import Start, train_drafter
from tests.conftest import MASK_ID, stage_of
from tests.test_train import samples, tcfg  # noqa: F401  (the module fixture of greedy-continued samples)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, dcfg, samples):  # noqa: F811
    """A drafter trained 60 steps, exported as the train stage exports it (with its draftflow.json)."""
    out = tmp_path_factory.mktemp("cold")
    metrics = train_drafter(samples, target, dcfg, tcfg(max_steps=60, checkpoint_every=1000), str(out))
    folder = export_vllm_dflash(out, out / "export" / "vllm", target.config)
    write_trained_on(folder, {"drafter": "dflash", "target": "a" * 16})
    return metrics, Path(folder)


def _root_promoting(tmp_path: Path, export: Path, fp: str = "0123456789abcdef") -> Path:
    """A run root whose train stage `fp` has `export` as its vLLM export, marked promoted by the gate."""
    root = tmp_path / "root"
    dest = root / "train" / fp / "export" / "vllm"
    shutil.copytree(export, dest)
    (dest.parent / PROMOTED).write_text(json.dumps({"promoted": True}))
    return root


def test_an_export_a_root_and_promoted_resolve_to_the_same_content(tmp_path, trained):
    _, export = trained
    root = _root_promoting(tmp_path, export)
    direct = warm.resolve(str(tmp_path), str(export))
    by_root = warm.resolve(str(tmp_path / "elsewhere"), str(root))
    by_word = warm.resolve(str(root), "promoted")
    assert direct.digest == by_root.digest == by_word.digest  # the fingerprint takes the content, not the name
    assert by_word.train_fingerprint == "0123456789abcdef" and direct.train_fingerprint is None
    assert direct.trained_for == by_word.trained_for == "a" * 16
    assert warm.fingerprint_input(str(root), "promoted") == {"init_from": direct.digest}
    (export / "draftflow.json").write_text(json.dumps({"drafter": "dflash", "target": "b" * 16}))
    try:  # another file content is another drafter
        assert warm.resolve(str(tmp_path), str(export)).digest != direct.digest
    finally:
        write_trained_on(export, {"drafter": "dflash", "target": "a" * 16})


def test_the_newest_promotion_is_the_promoted_drafter(tmp_path, trained):
    _, export = trained
    root = _root_promoting(tmp_path, export, "1111111111111111")
    other = root / "train" / "2222222222222222" / "export"
    shutil.copytree(root / "train" / "1111111111111111" / "export", other)
    marker = other / PROMOTED
    marker.write_text(json.dumps({"promoted": True}))
    older = marker.stat().st_mtime - 60
    os.utime(root / "train" / "1111111111111111" / "export" / PROMOTED, (older, older))
    assert promoted_export(Store(str(root)))[0] == "2222222222222222"


@pytest.mark.parametrize("case", ["nothing", "no_promotion", "deleted"])
def test_what_cannot_be_started_from_is_one_line(tmp_path, trained, case):
    _, export = trained
    if case == "nothing":
        name, root, match = str(tmp_path / "missing"), tmp_path, "no export folder .* and no run root"
    elif case == "no_promotion":
        (tmp_path / "r" / "train" / "0123456789abcdef").mkdir(parents=True)
        name, root, match = "promoted", tmp_path / "r", "has no promoted drafter"
    else:
        root = _root_promoting(tmp_path, export)
        shutil.rmtree(root / "train" / "0123456789abcdef" / "export" / "vllm")
        name, match = "promoted", "the promoted drafter .* is gone"
    with pytest.raises(ConfigError, match=match) as err:
        warm.resolve(str(root), name)
    assert "\n" not in str(err.value) and "train.init_from=" in str(err.value)


def test_another_kind_shape_or_taps_is_refused_in_one_line(trained, target, dcfg):
    _, export = trained
    init = warm.resolve(str(export), str(export))
    loaded = warm.load(init, target)
    fits = warm.check_and_state(init, loaded, DFlashDrafter(dcfg, target))
    assert set(fits) == set(loaded.trainable_state_dict())
    deeper = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=2, block_size=4, num_taps=3), MASK_ID)
    taps = DFlashConfig.from_target(target.config, DrafterConfig(num_layers=1, block_size=4, num_taps=3,
                                                                 target_layer_ids=[0, 2, 4]), MASK_ID)
    for other, match in ((deeper, "weight 'layers.1"), (taps, "target_layer_ids is")):
        with pytest.raises(ConfigError, match=match) as err:
            warm.check_and_state(init, loaded, DFlashDrafter(other, target))
        assert "\n" not in str(err.value)
    from draftflow.drafters.eagle3.config import Eagle3Config
    from draftflow.drafters.eagle3.model import Eagle3Drafter
    from draftflow.drafters.eagle3.vocab import draft_vocab

    ecfg = Eagle3Config.from_target(target.config, DrafterConfig(kind="eagle3", target_layer_ids=[1, 3, 4]), 64)
    d2t, t2d = draft_vocab({i: 1 for i in range(64)}, 320, 64)
    with pytest.raises(ConfigError, match="is a DFlashDrafter drafter, this run trains Eagle3Drafter"):
        warm.check_and_state(init, loaded, Eagle3Drafter(ecfg, target, torch.tensor(d2t), torch.tensor(t2d)))


def test_a_warm_start_begins_where_the_drafter_left_off(tmp_path, trained, target, dcfg, samples):  # noqa: F811
    cold, export = trained
    init = warm.resolve(str(tmp_path), str(export))
    warmed = train_drafter(samples, target, dcfg, tcfg(max_steps=3, checkpoint_every=1000), str(tmp_path / "w"),
                           start=Start(init=(init, warm.load(init, target))))
    scratch = train_drafter(samples, target, dcfg, tcfg(max_steps=3, checkpoint_every=1000), str(tmp_path / "s"))
    # The first step of the warm start sees the 60-step drafter's loss, not a fresh one's.
    assert warmed["first_loss"] < scratch["first_loss"] - 0.5, (warmed["first_loss"], scratch["first_loss"])
    assert warmed["first_loss"] == pytest.approx(cold["loss"], rel=0.5)


def test_the_manifest_note_says_when_the_target_is_another_revision(trained):
    _, export = trained
    init = warm.resolve(str(export), str(export))
    assert warm.manifest_note(init, "a" * 16)["target_changed"] is False
    note = warm.manifest_note(init, "c" * 16)
    assert note["target_changed"] is True and note["trained_for"] == "a" * 16 and note["digest"] == init.digest


def test_a_promoted_drafter_of_another_target_revision_is_named(tmp_path, trained):
    _, export = trained  # its draftflow.json says it was trained for target "a" * 16
    root = _root_promoting(tmp_path, export)
    assert warm.stale_promoted(str(root), "a" * 16) is None
    line = warm.stale_promoted(str(root), "b" * 16)
    assert f"trained for target {'a' * 16}, the target is now {'b' * 16}" in line and "train/0123456789abcdef" in line
    assert warm.stale_promoted(str(tmp_path / "no-root"), "b" * 16) is None


def test_a_missing_init_drafter_stops_preflight_in_one_line(tmp_path):
    from draftflow.runs.plan import preflight
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "run", f"train.init_from={tmp_path / 'gone'}")
    with pytest.raises(ConfigError, match="train.init_from=") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_run_warm_starts_from_the_promoted_drafter_of_its_root(prefect_harness, tmp_path, capsys):
    """A gated run promotes its drafter; the next run of the same root starts from it (`promoted`), records it,
    is another training than a cold one, and `draftflow status` says so."""
    from flows.cli import main
    from flows.pipeline import pipeline
    from tests.conftest import tiny_config

    root = tmp_path / "run"
    first = pipeline(tiny_config(root, "evaluate.gate.min_tau=1.0"))
    train_fp = stage_of(first, "train")["fingerprint"]
    assert (root / "train" / train_fp / "export" / PROMOTED).is_file()
    cfg = tiny_config(root, "train.init_from=promoted", "evaluate.gate.min_tau=1.0")
    second = pipeline(cfg)
    warm_fp = stage_of(second, "train")["fingerprint"]
    assert warm_fp != train_fp and [s["status"] for s in second["stages"][:4]] == ["reused"] * 4
    manifest = json.loads((root / "train" / warm_fp / "manifest.json").read_text())
    note = manifest["extra"]["init_from"]
    assert note["name"] == "promoted" and note["train_fingerprint"] == train_fp and note["target_changed"] is False
    metrics = manifest["extra"]["metrics"]
    cold = json.loads((root / "train" / train_fp / "manifest.json").read_text())["extra"]["metrics"]
    assert metrics["first_loss"] < cold["first_loss"]  # it started from the trained drafter
    # The same drafter named by its folder is the same training (the content is fingerprinted, not the name).
    by_folder = tiny_config(root, f"train.init_from={root / 'train' / train_fp / 'export' / 'vllm'}")
    assert stage_of(pipeline(by_folder), "train")["status"] == "reused"
    capsys.readouterr()
    assert main(["status", str(root)]) == 0
    assert f"warm-started from promoted (drafter {note['digest'][:12]})" in capsys.readouterr().out
    # A new revision of the target: the promoted drafter is named as trained for the old one.
    marker_export = root / "train" / warm_fp / "export" / "vllm"
    (marker_export / "draftflow.json").write_text(json.dumps({"drafter": "dflash", "target": "0" * 16}))
    assert main(["status", str(root)]) == 0
    assert "promoted drafter: the promoted drafter" in capsys.readouterr().out
