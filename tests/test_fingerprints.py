"""What each stage's fingerprint sees: the right config fields and the sources' content."""

from draftflow.stages.common import fingerprint
from draftflow.stages.curate import source_keys
from tests.conftest import tiny_config


def test_fields_that_do_not_change_results_do_not_move_a_stage(tmp_path):
    base = tiny_config(tmp_path)
    moved = tiny_config(tmp_path, "train.device=cpu", "train.checkpoint_every=3", "evaluate.device=cpu")
    assert fingerprint("train", base, {}) == fingerprint("train", moved, {})
    assert fingerprint("train", base, {}) != fingerprint("train", tiny_config(tmp_path, "train.lr=1e-4"), {})


def test_extract_depends_on_the_taps_not_the_drafter_depth(tmp_path):
    base = tiny_config(tmp_path)
    assert fingerprint("extract", base, {}) == fingerprint("extract", tiny_config(tmp_path, "drafter.num_layers=3"), {})
    taps = tiny_config(tmp_path, "drafter.target_layer_ids=[1,2,3]")
    assert fingerprint("extract", base, {}) != fingerprint("extract", taps, {})
    vocab = tiny_config(tmp_path, "drafter.kind=eagle3", "drafter.draft_vocab_size=100")
    eagle = tiny_config(tmp_path, "drafter.kind=eagle3")
    for stage in ("tokenize", "extract"):  # the draft vocabulary is chosen by train, from tokenize's counts
        assert fingerprint(stage, eagle, {}) == fingerprint(stage, vocab, {})
    assert fingerprint("train", eagle, {}) != fingerprint("train", vocab, {})
    thinking = tiny_config(tmp_path, "regenerate.enable_thinking=true")
    assert fingerprint("evaluate", base, {}) != fingerprint("evaluate", thinking, {})


def test_editing_a_source_in_place_changes_its_key(tmp_path):
    import os

    src = tmp_path / "s.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = tiny_config(tmp_path)
    cfg.curate.sources = [cfg.curate.sources[0].model_copy(update={"path": str(src)})]
    before = source_keys(cfg.curate)
    src.write_text('{"messages": [{"role": "user", "content": "hello"}]}\n')
    os.utime(src, ns=(1, 1))  # a different mtime even on coarse clocks
    assert source_keys(cfg.curate) != before
