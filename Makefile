# The two commands of the README. Each installs what it needs first (scripts/install.sh) into an isolated Python,
# then runs with that same interpreter: PYTHON=/path/to/python if given, else the active venv or conda env, else
# .venv/ in this repo (made by the install). `bash scripts/install.sh --which` prints it.
PYTHON ?=
TAG ?=
PYTEST_ARGS ?=
PY := $(shell PYTHON='$(PYTHON)' bash scripts/install.sh --which)

.PHONY: install batch test
install:
	@PYTHON='$(PYTHON)' bash scripts/install.sh

# The main job: every notebook, executed headless by papermill into papermill_runs/<tag>/.
batch: install
	'$(PY)' scripts/run_batch.py $(if $(TAG),--tag $(TAG),)

# The tests: CPU everywhere; GPU tests run where a Hopper GPU is (FOLDKV_REQUIRE_GPU=1 makes their skips failures).
test: install
	'$(PY)' -m pytest -q -ra $(PYTEST_ARGS)
