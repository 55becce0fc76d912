# SkyLB: `make demo` runs the three-region deployment on this machine; `make test` runs the test suite.
# Both create .venv and install the project into it first (Python 3.11+).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench clean llama-server system-packages lint-tools

install: $(STAMP)
	@echo "installed: $(abspath $(VENV))/bin/skylb and skylb-ctl; put them on PATH with: . $(VENV)/bin/activate"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,tracing]'
	@# bench/ (the test and benchmark harness: `skylb emulator`, `skylb local`, ...) is not in the package; this
	@# checkout's venv finds it, as `python -m` from the checkout does, through a path file naming the checkout.
	$(PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'skylb-checkout.pth').write_text('$(CURDIR)\n')"
	touch $(STAMP)

# TRACE=path replays another Mooncake trace; without the default trace the synthetic workload runs.
demo: install
	$(VENV)/bin/skylb local --config configs/local-3region.yaml $(if $(TRACE),--trace $(TRACE))

# The real llama.cpp replica that tests/test_llamacpp.py runs: built from source once per machine (about 5 minutes
# on 2 cores) and cached under ~/.cache/skylb; instant when cached. SKYLB_LLAMA_SERVER=path uses an existing binary.
llama-server: install
ifdef SKYLB_LLAMA_SERVER
	@test -x "$(SKYLB_LLAMA_SERVER)" || { echo "SKYLB_LLAMA_SERVER=$(SKYLB_LLAMA_SERVER) is not executable"; exit 1; }
else
	PYTHON=$(abspath $(PY)) deploy/llamacpp/build-llama-server.sh
endif

# import-linter, which tests/test_layout.py runs, in a venv of its own: it requires rich, and with rich installed
# structlog imports it in every Python process that logs, about 0.2 s of CPU at each start of the hundreds of
# balancers, controllers and emulators the tests run.
LINT_VENV ?= .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed-stamp
lint-tools: $(LINT_STAMP)

$(LINT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LINT_VENV)/bin/python -m pip install --quiet 'import-linter>=2.13'
	touch $(LINT_STAMP)

# The real components the tests start on loopback (BIND 9, etcd, HAProxy, Redis), from Debian's packages;
# instant when present. Without apt-get or root it says what is missing and the tests that need them skip.
system-packages:
	deploy/system/install-packages.sh

# The suite runs on TEST_WORKERS pytest-xdist workers (tests mostly wait on subprocesses and sockets, so more
# workers than cores pays); tests marked xdist_group run on one worker together (--dist loadgroup). TEST_WORKERS=0
# runs it in this process. It prints its duration and the 15 slowest tests.
# 3, not 4: with the live suites of the chaos schedule, Prometheus, Chromium and three-region deployments, a fourth
# worker on 2 cores starved timing-sensitive tests (2-5 different failures a run at 4 workers).
TEST_WORKERS ?= 3
test: install lint-tools llama-server system-packages
	@# Bytecode once for the hundreds of Python processes the tests start (none write it under PYTHONDONTWRITEBYTECODE).
	@$(PY) -m compileall -q -j0 skylb controller bench tests
	@start=$$(date +%s); $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15; rc=$$?; \
	  echo "make test: pytest took $$(( $$(date +%s) - start )) s on $(TEST_WORKERS) workers (exit $$rc)"; exit $$rc

# The simulated SkyLB evaluation in the calibrated regime (bench/sim/regime.yaml: the calibration table, paper
# Fig. 8-10, the load sweep, the Mooncake trace at 1/8 and at real prompt lengths), 3 seeds: writes
# bench/results/README.md, results.json and PNG plots (about 18 minutes on 2 cores; SEEDS=0 for one seed).
# The eight-region scenario and the cost of coordination are `skylb bench eight_regions` and `skylb bench
# coordination` (about 20 and 3 minutes).
bench: install
	$(PY) -m pip install --quiet -e '.[test,tracing,bench]'
	$(VENV)/bin/skylb bench all $(if $(SEEDS),--seeds $(SEEDS))

clean:
	rm -rf $(VENV) $(LINT_VENV) .skylb-run .pytest_cache
