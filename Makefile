# Two commands for a newcomer: `make test` and `make demo`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A plain `torch` pin: on a CPU machine with a local wheel cache this picks the CPU build,
# elsewhere PyPI's default (CUDA) build. Override with `make TORCH=... test`.
TORCH ?= torch==2.13.0

.PHONY: setup test test-gpu demo demo-images lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# The CPU suite runs on every core (pytest-xdist, tests dealt out one by one); a fixture that must be
# alone on the machine (the Slurm cluster) takes a lock.
test: setup
	$(PY) -m pytest -q -n auto

test-gpu: setup
	$(PY) -m pytest -q -m gpu

# The demo: 2,000 held-out task prompts through the shipped demo model (CPU or GPU), resumable,
# then one DuckDB query joining the results with the expected answers.
DEMO_SQL := SELECT i.task, count(*) AS rows, count_if(trim(r.text) = trim(i.answer))::BIGINT AS correct, \
	round(avg((trim(r.text) = trim(i.answer))::INT), 3) AS exact_match \
	FROM latest r JOIN inputs i USING (id) GROUP BY i.task ORDER BY i.task

demo: setup
	$(VENV)/bin/batchinfer run examples/demo-job.toml
	$(VENV)/bin/batchinfer query demo-output "$(DEMO_SQL)"

# The image demo: the shipped SAM 3 demo model (models/demo-sam3-shapes) segments examples/shapes on
# the CPU or GPU, resumable, then one DuckDB query sets the instances found beside the true counts.
DEMO_IMAGES_SQL := SELECT o.id, o.prompt, count(o.instance) AS found, any_value(t.instances) AS truth, \
	round(max(o.score), 3) AS best_score FROM latest o JOIN 'examples/shapes/truth.parquet' t USING (id, prompt) \
	GROUP BY ALL ORDER BY ALL

demo-images: setup
	$(VENV)/bin/batchinfer segment -i examples/shapes/images.parquet -o demo-images-output \
		--model models/demo-sam3-shapes/sam3.safetensors
	$(VENV)/bin/batchinfer query demo-images-output "$(DEMO_IMAGES_SQL)"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info demo-output demo-images-output
