"""Container and cluster files: they parse, name files that exist, and ask for GPUs where they should.

Docker is not available in CI, so the images are not built here; these checks catch the
mistakes that break a build or a work pool before anyone runs one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "infra" / "k8s" / "gpu-job-template.json"


def _copy_sources(dockerfile: Path) -> list[str]:
    """Sources of every COPY (without --from) in a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "COPY" and not any(p.startswith("--from") for p in parts):
            out += [p for p in parts[1:-1] if not p.startswith("--")]
    return out


def _extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfiles_copy_paths_that_exist_and_install_known_extras(name):
    dockerfile = ROOT / "infra" / name
    sources = _copy_sources(dockerfile)
    assert {"pyproject.toml", "draftflow", "flows", "tasks", "configs"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), f"{name} copies {src}, which is not in the repository"
    for extras in re.findall(r'"\.\[([a-z0-9,]+)\]"', dockerfile.read_text()):
        assert set(extras.split(",")) <= _extras(), f"{name} installs an unknown extra: {extras}"


def test_gpu_image_takes_torch_from_vllm_not_the_cpu_pin():
    text = (ROOT / "infra" / "Dockerfile.gpu").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    assert '".[vllm,s3,ray]"' in text and "constraints-cpu.txt" not in text.split("COPY", 1)[1]


def test_compose_file_parses_and_names_existing_dockerfiles_and_volumes():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"prefect-server", "s3", "cpu-worker"} <= set(services)
    built = {}
    for name, svc in services.items():
        if "build" in svc:
            context = ROOT / svc["build"]["context"]
            dockerfile = context / svc["build"]["dockerfile"]
            assert dockerfile.is_file(), f"service {name}: {dockerfile} does not exist"
            built[name] = dockerfile.name
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"service {name} depends on unknown service {dep}"
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"service {name} mounts missing {source}"
            else:
                assert source in compose.get("volumes", {}), f"service {name}: volume {source} is not declared"
    assert built["cpu-worker"] == "Dockerfile.cpu" and built.get("gpu-worker") == "Dockerfile.gpu"
    assert services["cpu-worker"]["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"


def test_compose_file_holds_no_credentials():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"SECRET|PASSWORD|ACCESS_KEY|ROOT_USER", key):
                assert str(value).startswith("${"), f"service {name}: {key} must come from the environment"


def test_gpu_job_template_is_a_valid_kubernetes_base_job_template():
    from prefect.server.schemas.actions import WorkPoolCreate

    template = json.loads(TEMPLATE.read_text())
    assert set(template) == {"job_configuration", "variables"}
    # Prefect's server-side check: every {{ placeholder }} of job_configuration is a declared variable.
    WorkPoolCreate(name="gpu", type="kubernetes", base_job_template=template)
    job = template["job_configuration"]["job_manifest"]
    assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "{{ image }}"
    for side in ("limits", "requests"):
        assert container["resources"][side]["nvidia.com/gpu"] == "{{ gpu_count }}"
    gpu = template["variables"]["properties"]["gpu_count"]
    assert gpu["type"] == "integer" and gpu["default"] == 1 and gpu["minimum"] == 0


def test_gpu_job_template_renders_the_gpu_count_and_image_a_deployment_sets():
    from prefect.utilities.templating import apply_values

    template = json.loads(TEMPLATE.read_text())
    values = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    values |= {"gpu_count": 4, "image": "registry.example/draftflow:gpu"}
    rendered = apply_values(template["job_configuration"], values)
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4  # an int, as Kubernetes wants
    assert container["image"] == "registry.example/draftflow:gpu"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert "{{" not in json.dumps(rendered)



@pytest.mark.parametrize("name", ["constraints-cpu.txt", "constraints-vllm.txt"])
def test_the_gguf_extra_is_pinned_in_both_legs_constraints(name):
    """`make install` and `make test-vllm` install `.[gguf]`: its packages get the tested versions, not the newest."""
    from importlib.metadata import PackageNotFoundError, version

    import tomllib

    pins = dict(line.split("==") for line in (ROOT / name).read_text().splitlines() if "==" in line)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gguf"]
    for package in (re.match(r"[A-Za-z0-9_.-]+", req).group(0) for req in extra):
        assert package in pins, f"{name} does not pin {package} (the gguf extra)"
        try:
            installed = version(package)
        except PackageNotFoundError:
            continue
        assert pins[package] == installed, f"{name} pins {package}=={pins[package]}; this venv has {installed}"
