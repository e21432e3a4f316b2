# The two commands of the README. Each installs what it needs first (scripts/install.sh), then runs.
PYTHON ?= python3
TAG ?=
PYTEST_ARGS ?=

.PHONY: install batch test
install:
	PYTHON=$(PYTHON) bash scripts/install.sh

# The main job: every notebook, executed headless by papermill into papermill_runs/<tag>/.
batch: install
	$(PYTHON) scripts/run_batch.py $(if $(TAG),--tag $(TAG),)

# The tests: CPU everywhere; GPU tests run where a Hopper GPU is (FOLDKV_REQUIRE_GPU=1 makes their skips failures).
test: install
	$(PYTHON) -m pytest -q -ra $(PYTEST_ARGS)
