"""draftflow's flows are defined without the parameter schema that nothing reads.

Why: defining a flow (`Flow.__init__`) builds the JSON schema of its parameters into `Flow.parameters`
(`prefect.flows.parameter_schema`). For a flow that takes a `RunConfig` pydantic walks every section and encodes
every default (~0.15 s a flow), and the first schema imports `pydantic.v1` (~0.3 s): ~1.7 s of every process that
imports the flows (measured 2026-12-07), so of each `draftflow run`, each flow-run process a worker starts, each
re-run after a kill. In Prefect 3.9 no client code reads `Flow.parameters`: a deployment builds its run form's schema
from the flow itself (`RunnerDeployment.from_flow` and `prefect deploy` call `prefect.utilities.callables.
parameter_schema` directly), a flow run records its parameters' values, and a call's parameters are validated
against the signature.

What it does: `no_parameter_schema(fn)` marks a flow function; `install()` (run by it, so before the first marked
flow is defined) wraps the schema builder that `Flow.__init__` calls so that a marked function's flow gets an empty
`parameters`. Deployments' schemas are built as before (`tests/test_flow_schemas.py` checks both).

What it leaves: a Prefect without `prefect.flows.parameter_schema` is left as it is (`install()` returns False; the
schemas are built as before, nothing breaks).

Key trade-off: wrapping a name Prefect imports into `prefect.flows` (checked, so a Prefect that moves it turns this
off) for ~1.7 s of every process that runs a stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

MARK = "no_parameter_schema_by_draftflow"  # on each marked flow function
INSTALLED = "schemas_skipped_by_draftflow"  # on the installed wrapper
F = TypeVar("F", bound=Callable[..., Any])


def no_parameter_schema(fn: F) -> F:
    """Mark `fn` (a flow function, under `@flow`): its flow's unread `parameters` schema is left empty."""
    install()
    setattr(fn, MARK, True)
    return fn


def install() -> bool:
    """Give marked flow functions an empty parameter schema in this process; True if that is (now or before) so."""
    import prefect.flows as flows

    current = getattr(flows, "parameter_schema", None)
    if current is None:
        return False
    if getattr(current, INSTALLED, False):
        return True
    try:
        from prefect.utilities.callables import ParameterSchema
    except ImportError:
        return False

    @functools.wraps(current)
    def parameter_schema(fn: Any) -> Any:
        return ParameterSchema() if getattr(fn, MARK, False) else current(fn)

    setattr(parameter_schema, INSTALLED, True)
    flows.parameter_schema = parameter_schema
    return True
