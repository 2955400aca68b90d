"""`flows.schemas`: draftflow's flows skip the parameter schema nothing reads; deployments still get theirs.

A flow of ours has an empty `Flow.parameters` (each one is marked: a new flow without the mark fails here by name),
a flow that is not marked is built as Prefect builds it, a deployment of one of ours has its full run form, and a
marked flow's run still records and validates its parameters.
"""

from __future__ import annotations

import pydantic
import pytest
from prefect import Flow, flow
from prefect.utilities.callables import parameter_schema

import flows.pipeline
import flows.refresh
import flows.stages
from flows import schemas
from flows.schemas import no_parameter_schema


def _our_flows() -> dict[str, Flow]:
    found = {f"{m.__name__}.{n}": v for m in (flows.pipeline, flows.refresh, flows.stages)
             for n, v in vars(m).items() if isinstance(v, Flow)}
    found["flows.stages.sharded_stage_flow('tokenize')"] = flows.stages.sharded_stage_flow("tokenize")
    return found


def test_every_flow_of_ours_is_defined_without_a_parameter_schema():
    ours = _our_flows()
    assert len(ours) >= 10  # the pipeline's, the stages', the refresh's and the deployable entry points
    with_schema = [name for name, f in ours.items() if f.parameters.properties]
    assert with_schema == [], f"mark these flow functions @no_parameter_schema (flows/schemas.py): {with_schema}"


def test_a_flow_not_marked_gets_its_schema_and_install_wraps_once():
    import prefect.flows

    @flow(name="schema-kept")
    def kept(config_path: str, steps: int = 3) -> int:
        return steps

    assert set(kept.parameters.properties) == {"config_path", "steps"}
    installed = prefect.flows.parameter_schema
    assert getattr(installed, schemas.INSTALLED, False)
    assert schemas.install() is True and prefect.flows.parameter_schema is installed


def test_a_prefect_without_the_builder_is_left_alone(monkeypatch):
    import prefect.flows

    monkeypatch.delattr(prefect.flows, "parameter_schema")
    assert schemas.install() is False


def test_deployments_of_our_flows_keep_their_run_form():
    """What the UI's run form shows for a deployment: built from the flow itself, as `prefect deploy` builds it."""
    for entry in (flows.pipeline.pipeline_from_file, flows.pipeline.stage_from_file, flows.refresh.refresh_from_file):
        assert entry.parameters.properties == {}
        assert "config_path" in parameter_schema(entry).properties, entry.name
    deployment = flows.pipeline.stage_from_file.to_deployment(name="schema-check")
    assert {"config_path", "stage", "overrides", "upstream"} <= set(deployment._parameter_openapi_schema.properties)


class Settings(pydantic.BaseModel):
    steps: int


@flow(name="schema-marked")
@no_parameter_schema
def marked(settings: Settings, note: str = "x") -> int:
    return settings.steps


@pytest.mark.slow
def test_a_marked_flow_run_records_and_validates_its_parameters(prefect_harness):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    assert marked.parameters.properties == {}
    assert marked(Settings(steps=4)) == 4
    assert marked({"steps": "5"}) == 5  # validated against the signature as before: coerced to Settings
    with pytest.raises(Exception, match="steps"):
        marked({"steps": "many"})
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["schema-marked"])))
    recorded = sorted(str(r.parameters["settings"]["steps"]) for r in runs if r.state.is_completed())
    assert recorded == ["4", "5"]  # each run's parameters as it was called with them, shown in the UI
