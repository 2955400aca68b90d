"""S3 faults: 5xx, throttling and connection resets between draftflow and a real S3 server (moto).

A fault-injecting proxy (`tests/reliability/faulty_s3.py`) sits on 127.0.0.1 in front of moto and fails
chosen requests; s3fs talks to the proxy. Each store operation a stage uses (atomic shard commit, manifest
write, manifest read, checksummed download, exists, listing, delete) must come through every fault with
nothing lost, and a whole pipeline run through faults must write the same manifests as a run without.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import moto_s3
from tests.reliability.faulty_s3 import Fault, FaultyProxy

pytestmark = pytest.mark.reliability
BUCKET = "draftflow-faults"
PUT, GET = r"^/draftflow-faults/runs/.+", r"^/draftflow-faults/runs/.+"

# (id, fault): each one fails the first (or nth) matching request (or `times` in a row).
FAULTS = [
    ("put-500", Fault("PUT", PUT, "500")),
    ("put-503-slowdown-x3", Fault("PUT", PUT, "503", times=3)),
    ("put-reset-mid-upload", Fault("PUT", PUT, "reset")),
    ("put-reset-2nd-upload", Fault("PUT", PUT, "reset", nth=2)),
    ("get-500", Fault("GET", GET + r"shard\.bin", "500")),
    ("get-503-slowdown", Fault("GET", GET + r"manifest\.json", "503", times=2)),
    ("get-reset", Fault("GET", GET + r"shard\.bin", "reset")),
    ("head-503", Fault("HEAD", GET, "503")),
    ("list-500", Fault("GET", r"^/draftflow-faults/?\?.*list-type=2", "500")),
    ("bulk-delete-500", Fault("POST", r"^/draftflow-faults/?\?delete", "500")),
]


@pytest.fixture(scope="module")
def moto_endpoint():
    with moto_s3() as endpoint:
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        yield endpoint


@pytest.fixture
def through(moto_endpoint, monkeypatch):
    """Point s3fs at a proxy with `faults` in front of moto; yields the proxy."""
    import s3fs

    def start(*faults: Fault) -> FaultyProxy:
        proxy = FaultyProxy(moto_endpoint, list(faults))
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.__enter__())
        s3fs.S3FileSystem.clear_instance_cache()
        started.append(proxy)
        return proxy

    started: list[FaultyProxy] = []
    yield start
    for proxy in started:
        proxy.__exit__(None, None, None)
    s3fs.S3FileSystem.clear_instance_cache()


def _stage_round_trip(root: str) -> None:
    """What a stage does on its store: commit shards, write and read the manifest, read shards back, clean up."""
    from draftflow.contracts import Manifest
    from draftflow.stages.common import remove_scratch
    from draftflow.store import Store, shard_entry

    store = Store(root)
    payload = os.urandom(300_000)  # several TCP segments: a reset lands mid-body
    entries = []
    for name in ("shard.bin", "partial/part-0.bin"):
        with store.writing(store.stage_path("s", "fp", name)) as tmp:
            open(tmp, "wb").write(payload)
            entries.append(shard_entry(name, tmp, rows=1))
    manifest = Manifest(stage="s", fingerprint="fp", code_version="c", config={}, inputs={}, shards=tuple(entries[:1]),
                        rows_in=1, rows_out=1, dropped={}, tokens=0)
    store.write_manifest("s", "fp", manifest)
    remove_scratch(store, "s", "fp", "partial")
    assert store.read_manifest("s", "fp") == manifest
    assert store.sha_matches("s", "fp", entries[0])
    assert open(store.verify_sha("s", "fp", entries[0]), "rb").read() == payload
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.stage_path("s", "fp"), refresh=True)) == [
        "manifest.json", "shard.bin"]  # the partial is gone, nothing else was left


@pytest.mark.parametrize("fault", [f for _, f in FAULTS], ids=[i for i, _ in FAULTS])
def test_store_operations_survive_the_fault(through, fault, request):
    proxy = through(fault)
    _stage_round_trip(f"s3://{BUCKET}/runs/{request.node.callspec.id}")
    assert fault.hits == fault.times, f"the fault never fired (requests: {proxy.requests})"


def _manifests(root: str) -> dict[str, str]:
    """Manifest texts by path (evaluate's without its measured step times: `procs.MEASURED_REPORTS`)."""
    import s3fs

    from tests.reliability.procs import without_measurements

    fs = s3fs.S3FileSystem()
    base = root.removeprefix("s3://")
    return {p[len(base) + 1:]: without_measurements(Path(p[len(base) + 1:]), fs.cat_file(p)).decode()
            for p in sorted(fs.glob(f"{base}/*/*/manifest.json"))}


ROOT = f"s3://{BUCKET}/runs/pipeline"  # every run in one root: the train manifest names its store URLs


@pytest.fixture(scope="module")
def clean_run(moto_endpoint, tmp_path_factory):
    """A run without faults in ROOT (through a proxy that injects none): the code it ran and its manifests.
    The tests that follow empty ROOT and run the same code there through their faults."""
    import s3fs

    from tests.reliability.procs import run_to_end, snapshot_code

    tmp = tmp_path_factory.mktemp("s3-clean")
    code = str(snapshot_code(tmp / "code"))  # every run sees the same code, whatever the tree does meanwhile
    with FaultyProxy(moto_endpoint) as endpoint:
        run_to_end({**os.environ, "CODE_SNAPSHOT": code, "AWS_ENDPOINT_URL": endpoint}, ROOT, tmp / "clean.log")
    s3fs.S3FileSystem.clear_instance_cache()  # this process reads moto directly (moto_s3's environment)
    return code, _manifests(ROOT)


def _empty_root() -> None:
    import s3fs

    from draftflow.kept import default_cache_dir

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().rm(ROOT, recursive=True)
    # Shards an earlier run downloaded would be read from the local cache, not through the faults (a cache of
    # its own would move the target too, whose local path the train manifest's serve lines name).
    shutil.rmtree(default_cache_dir() / "store", ignore_errors=True)


def test_a_run_through_faults_writes_the_manifests_of_a_run_without(clean_run, through):
    """The CLI run (a subprocess) through 5xx, SlowDown and resets mid-upload of shards, checkpoints and
    manifests: it succeeds, and its manifests (every shard's sha256, the weights, τ) equal a clean run's."""
    from tests.reliability.procs import run_to_end

    code, want = clean_run
    _empty_root()
    faults = [Fault("PUT", r"/train-00003\.", "reset"), Fault("PUT", r"/manifest\.json", "503", times=2),
              Fault("PUT", r"/train-0000[0-9]\.safetensors", "500", nth=2), Fault("GET", r"/train-00001\.", "503"),
              Fault("HEAD", r"/runs/pipeline/", "503", nth=5), Fault("PUT", r"/checkpoint/model", "reset"),
              Fault("PUT", r"/partial/", "500", nth=3), Fault("GET", r"list-type=2", "500", nth=3)]
    through(*faults)
    log = Path(code).parent / "faulty.log"
    run_to_end({**os.environ, "CODE_SNAPSHOT": code}, ROOT, log, failures_ok=True)  # tasks may retry a fault
    got = _manifests(ROOT)
    assert [f.hits for f in faults] == [f.times for f in faults]
    assert sorted(got) == sorted(want)
    for name, text in got.items():
        assert text == want[name], f"{name} differs from the run without faults"


def test_an_endpoint_lost_mid_run_is_one_line_and_the_rerun_resumes(clean_run, moto_endpoint, tmp_path):
    """The S3 endpoint goes away while extract uploads its shards (the proxy stops listening): the run ends in
    one line naming the endpoint, without a traceback; with the endpoint back (same port) the re-run resumes
    and its manifests equal a run that never lost it."""
    from tests.reliability.procs import cli_args, run_to_end

    code, want = clean_run
    _empty_root()
    lost = FaultyProxy(moto_endpoint, [Fault("PUT", r"/extract/[0-9a-f]+/(partial/)?train-00002", "die")])
    port = lost.server.server_address[1]
    env = {**os.environ, "CODE_SNAPSHOT": code, "AWS_ENDPOINT_URL": lost.__enter__()}
    done = subprocess.run([sys.executable, "-m", "flows.cli", *cli_args(ROOT)], cwd=code, env=env,
                          capture_output=True, text=True, timeout=600)
    lost.__exit__(None, None, None)
    out = done.stdout + done.stderr
    (tmp_path / "lost.log").write_text(out)
    last = done.stderr.strip().splitlines()[-1]
    assert lost.dead and done.returncode == 2 and last.startswith("draftflow: error: "), out[-3000:]
    assert "endpoint cannot be reached" in last and "AWS_ENDPOINT_URL" in last, last
    assert "Traceback" not in out, out[-3000:]

    with FaultyProxy(moto_endpoint, port=port):  # the endpoint is back, where the run expects it
        run_to_end(env, ROOT, tmp_path / "rerun.log")
    s3fs_manifests = _manifests(ROOT)
    assert s3fs_manifests == want
