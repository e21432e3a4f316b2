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
# Then the transformers adapter's CPU tests again against the device's transformers (scripts/transformers_pass.sh;
# TRANSFORMERS_PASS= skips it); both passes run, each ending on pytest's summary line, and the target fails when
# either does.
TRANSFORMERS_PASS ?= 5.17.0
test: install
	@'$(PY)' -m pytest -q -ra $(PYTEST_ARGS); main=$$?; \
	if [ -n '$(TRANSFORMERS_PASS)' ]; then bash scripts/transformers_pass.sh '$(PY)' '$(TRANSFORMERS_PASS)'; again=$$?; \
	else again=0; fi; \
	[ $$main -eq 0 ] && [ $$again -eq 0 ]
