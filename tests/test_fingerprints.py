"""What each stage's fingerprint sees: the right config fields and the sources' content."""

from draftflow.stages.curate import source_keys
from draftflow.stages.registry import stamp
from tests.conftest import tiny_config


def test_fields_that_do_not_change_results_do_not_move_a_stage(tmp_path):
    base = tiny_config(tmp_path)
    moved = tiny_config(tmp_path, "train.device=cpu", "train.checkpoint_every=3", "evaluate.device=cpu")
    assert stamp(base, "train", {}).fingerprint == stamp(moved, "train", {}).fingerprint
    slower = tiny_config(tmp_path, "train.lr=1e-4")
    assert stamp(base, "train", {}).fingerprint != stamp(slower, "train", {}).fingerprint


def test_extract_depends_on_the_taps_not_the_drafter_depth(tmp_path):
    base = tiny_config(tmp_path)
    deeper = tiny_config(tmp_path, "drafter.num_layers=3")
    assert stamp(base, "extract", {}).fingerprint == stamp(deeper, "extract", {}).fingerprint
    taps = tiny_config(tmp_path, "drafter.target_layer_ids=[1,2,3]")
    assert stamp(base, "extract", {}).fingerprint != stamp(taps, "extract", {}).fingerprint
    vocab = tiny_config(tmp_path, "drafter.kind=eagle3", "drafter.draft_vocab_size=100")
    eagle = tiny_config(tmp_path, "drafter.kind=eagle3")
    for stage in ("tokenize", "extract"):  # the draft vocabulary is chosen by train, from tokenize's counts
        assert stamp(eagle, stage, {}).fingerprint == stamp(vocab, stage, {}).fingerprint
    assert stamp(eagle, "train", {}).fingerprint != stamp(vocab, "train", {}).fingerprint
    thinking = tiny_config(tmp_path, "regenerate.enable_thinking=true")
    assert stamp(base, "evaluate", {}).fingerprint != stamp(thinking, "evaluate", {}).fingerprint


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
