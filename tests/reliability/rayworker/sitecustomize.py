"""On the PYTHONPATH of the Ray worker node in tests/reliability/test_ray_netns.py, so every Python process
of that node (its Ray workers run the shard tasks) arms the kill point in `KILLABLE_POINT` under
`KILLABLE_ROOT` (tests/reliability/killable.py): the task that reaches it writes `KILLABLE_MARKER` and
blocks there until the test kills the node or cuts its link. Nothing happens without `KILLABLE_POINT`."""

import os

if os.environ.get("KILLABLE_POINT"):
    from tests.reliability.killable import arm

    arm(os.environ["KILLABLE_POINT"], os.environ["KILLABLE_ROOT"], os.environ["KILLABLE_MARKER"])
