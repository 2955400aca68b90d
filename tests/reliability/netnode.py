"""The first training node of tests/reliability/test_netns.py, run inside its network namespace.

    python -m tests.reliability.netnode <root> <fingerprint> <features.json> [key=value ...]

Runs the train stage on a prepared local root (`draftflow.stages.train.run`, as the train task calls
it), with the tiny test config and the overrides given. Prints the launch's log lines, then one last
line: `trained N steps`, or `draftflow: error: <message>` and exit 1, as the CLI prints an error.
"""

from __future__ import annotations

import json
import logging
import sys

from draftflow.contracts import read_feature_source
from draftflow.errors import DraftflowError
from draftflow.stages import train
from draftflow.store import Store
from draftflow.training.launch import TrainingCrashed
from tests.conftest import tiny_config


def main(root: str, fp: str, features: str, *overrides: str) -> int:
    from draftflow.config import TargetConfig
    from draftflow.contracts import Stamp
    from draftflow.target import resolve_target

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
    cfg = tiny_config(root, *overrides)
    source = read_feature_source(json.loads(open(features).read()))
    try:
        handed = Stamp(stage="train", fingerprint=fp, inputs={"extract": "d"}, config={})
        done = train.run(Store(root), handed, cfg, resolve_target(TargetConfig()), source)
    except (DraftflowError, TrainingCrashed) as exc:
        print(f"draftflow: error: {exc}", flush=True)
        return 1
    print(f"trained {done.extra['metrics']['steps']} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
