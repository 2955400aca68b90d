"""The fingerprints `plan` (and so `status` and `upstream: reuse` deployments) predicts are the ones the
stages write, across the config dimensions that change a stage's inputs: token bounds (curate counts
with the target's tokenizer), drafter kind (taps, the final hidden state), online or offline features,
and a local or S3 root. A drift here makes a finished stage look "to run", or worse, a stale one reused.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.conftest import moto_s3, tiny_config
from tests.test_eagle3_pipeline import eagle3_config

SMALL = ["train.max_steps=2", "evaluate.num_prompts=1", "evaluate.max_new_tokens=4"]
CASES = {
    "plain": [],
    "token-bounds-online": ["curate.max_prompt_tokens=200", "extract.mode=online"],
    "eagle3": ["eagle3"],
    "eagle3-token-bounds-online": ["eagle3", "curate.min_prompt_tokens=2", "extract.mode=online"],
    "s3-root": ["s3"],
}


def _config(tmp_path, case: list[str]):
    root = "s3://fp-property/run" if "s3" in case else str(tmp_path / "run")
    overrides = [o for o in case if "=" in o] + SMALL
    if "eagle3" in case:
        return eagle3_config(root, *overrides, "drafter.ttt_steps=2")
    return tiny_config(root, *overrides)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_predicts_the_fingerprints_the_stages_write(name, prefect_harness, tmp_path, tiny_target):
    from draftflow.runs.plan import plan
    from draftflow.target import TargetRef
    from flows.pipeline import pipeline

    case = CASES[name]
    with moto_s3() if "s3" in case else contextlib.nullcontext():
        if "s3" in case:
            import s3fs

            s3fs.S3FileSystem().mkdir("fp-property")
        cfg = _config(tmp_path, case)
        target = TargetRef(tiny_target.path, tiny_target.fingerprint)
        first = plan(cfg, target)[0]
        summary = pipeline(cfg)
        written = {s["stage"]: s["fingerprint"] for s in summary["stages"]}
        assert first["fingerprint"] == written["curate"]  # predicted before anything ran
        predicted = {s["stage"]: (s["fingerprint"], s["state"]) for s in plan(cfg, target)}
        assert predicted == {stage: (fp, "complete") for stage, fp in written.items()}
