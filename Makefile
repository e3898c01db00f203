# Two entry points that do all the set-up themselves (README): `make report` and `make test`.
# PYTHON can point at any interpreter that already has (or may install) torch.
PYTHON ?= python3

.PHONY: report test test-all gpu-test

report:
	$(PYTHON) -m pip install -q -e .
	$(PYTHON) -m fastlm report

test:
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pytest -q

# the suite and the slow end-to-end runs (compiled distributed training, killed runs, ...)
test-all:
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pytest -q -m "slow or not slow"

# the GPU-marked tests, 8 processes sharing the GPU (Triton's and Inductor's compilation is CPU work)
gpu-test:
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pytest -q -m gpu -n 8 --durations=15
