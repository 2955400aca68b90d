"""Fixtures the reliability modules share: one Prefect server and one uninterrupted run for the session."""

from __future__ import annotations

import shutil

import pytest

from tests.reliability.procs import manifests, prefect_server, run_to_end, sha256_tree, snapshot_code


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """CLI runs from a snapshot of the code, reporting to one `prefect server start` (test_signals.py has
    its own: runs with the temporary server)."""
    code = snapshot_code(tmp_path_factory.mktemp("code"))
    with prefect_server(tmp_path_factory.mktemp("prefect")) as client_env:
        yield {**client_env, "CODE_SNAPSHOT": str(code)}


@pytest.fixture(scope="session")
def uninterrupted(env, tmp_path_factory):
    """The manifests and file digests of an uninterrupted run, and an empty root (the path it ran in) for a
    test's disturbed runs. Manifests name no root path, so a disturbed run elsewhere compares too."""
    tmp = tmp_path_factory.mktemp("kill")
    root = tmp / "run"
    run_to_end(env, str(root), tmp / "uninterrupted.log")
    want = manifests(root), sha256_tree(root)
    shutil.move(root, tmp / "uninterrupted")
    return root, want


@pytest.fixture(scope="session")
def finished_run(uninterrupted):
    """The uninterrupted run's root, complete (`procs.seeded_before` copies its stages before a test's stage)."""
    root, _ = uninterrupted
    return root.parent / "uninterrupted"
