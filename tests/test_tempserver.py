"""`flows.tempserver`: the temporary Prefect server `draftflow run` starts early when no server is set.

The real server runs here (a uvicorn child on 127.0.0.1 with this session's PREFECT_HOME); the case that
serves a flow is slow (tests/conftest.py), the refusals are fast.
"""

from __future__ import annotations

import os
from uuid import UUID

import pytest

from draftflow.errors import DraftflowError


def test_no_server_is_started_when_an_api_url_is_set():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.tempserver import serving, start

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert start() is None
        with serving(None) as url:  # nothing changes: Prefect uses the configured API
            assert url is None and os.environ.get("PREFECT_API_URL") != "http://127.0.0.1:9/api"


def test_a_server_that_does_not_answer_in_time_is_one_line_and_is_stopped():
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from flows.tempserver import TemporaryServer

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        server = TemporaryServer({**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True)})
    with pytest.raises(DraftflowError, match=r"did not answer within 0\.01 s.*STARTUP_TIMEOUT.*draftflow server"):
        server.wait_ready(0.01)
    assert server.process.poll() is not None  # stopped, not left running
    server.stop()  # a second stop is harmless


def test_a_flow_runs_on_it_and_its_run_outlives_it_in_prefect_home():
    """What `draftflow run` does: the flow reports to the early server (heartbeats off, no UI links); the
    server is stopped at the end, the environment restored, and the run is in $PREFECT_HOME's database
    (another server on the same home, e.g. `draftflow server`, shows it)."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from flows.tempserver import serving, start

    @flow(name="tempserver-probe")
    def probe() -> str:
        from prefect.runtime import flow_run

        return flow_run.id

    before = os.environ.get("PREFECT_API_URL")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # as a CLI run without a server
        server = start()
        assert server is not None
        with serving(server) as url:
            assert os.environ["PREFECT_API_URL"] == url == get_current_settings().api.url
            assert get_current_settings().flows.heartbeat_frequency is None
            run_id = probe()
        assert server.process.poll() is not None
        assert os.environ.get("PREFECT_API_URL") == before
        with serving(start()) as again:  # a later server on the same PREFECT_HOME
            assert again != url
            with get_client(sync_client=True) as client:
                run = client.read_flow_run(UUID(run_id))
    assert run.state.is_completed() and run.name
