# Two commands do all set-up on a fresh machine (Python 3.11): they create or reuse .venv/
# from the pinned requirements, then run.
#   make notebook   the main job: notebook 01 headless on the default backend (executed copy
#                   and figures in artifacts/). CI-sized by default: LABKIT_FAST=0 for a full run.
#   make test-quick the unit tests only (a developer's loop; not what CI runs)
#   make test       the whole test suite (unit tests + both notebooks under nbval) on XLA:CPU, plus
#                   the notebooks in the Colab TPU/GPU, Kaggle TPU and TorchTPU VM images and the unit suite on
#                   Python 3.13 (venvs in .venvs/, built by the tests with uv from images/*.txt).
#   make images     only build or reuse those venvs, and print their disk use.
#   make book       every notebook executed (fast mode), then the course as a static site in
#                   artifacts/book/ (index.html: course order, objectives, run times).
# make venv (bootstrap.sh) also installs Debian's chromium + chromium-driver when root with apt-get:
# tests/test_browser.py drives JupyterLab with them (the live dashboard on two widget stacks, the book).
SHELL := /bin/bash
# the venv's resolved path: under a path with a space .venv links to a folder outside it (scripts/bootstrap.sh)
PY = $(shell readlink -f .venv)/bin/python
LABKIT_FAST ?= 1
NOTEBOOK ?= notebooks/01_resnet50_cifar10.ipynb

.PHONY: venv images lint notebook notebooks book test test-quick bench clean

venv:
	@bash scripts/bootstrap.sh

images: venv
	$(PY) scripts/image_venv.py --all --du

notebook: venv
	LABKIT_FAST=$(LABKIT_FAST) $(PY) scripts/run_notebooks.py $(NOTEBOOK) --out artifacts

notebooks: venv
	LABKIT_FAST=$(LABKIT_FAST) $(PY) scripts/run_notebooks.py notebooks/*.ipynb --out artifacts

book: notebooks
	$(PY) scripts/build_book.py --executed artifacts --out artifacts/book

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	.venv/bin/lint-imports  # the layout's contracts (pyproject.toml [tool.importlinter])

# OMP_NUM_THREADS=1: the suite runs two or more processes at once on 2 cores (the background images beside the
# rest). Two eager CPU trainings with torch's default of one OpenMP thread per core took 3.7 s a step each, side by
# side, against 0.45 s alone: threads spin at each op's barrier while the other process holds the core. With one
# thread each, 0.8 s and 1.2 s (a ResNet-50 step at batch 32, torch 2.11). XLA:CPU's own threads are not affected.
test: venv lint
	OMP_NUM_THREADS=1 PJRT_DEVICE=CPU LABKIT_FAST=1 LABKIT_SOLUTIONS=1 MPLBACKEND=Agg LABKIT_CONSOLE=1 $(PY) -m pytest tests notebooks \
		--nbval-lax --nbval-current-env --durations=10

# A few minutes for a developer's loop: the unit tests without notebooks, child-process runs, images or the browser.
# Not the README's test command: `make test` stays the whole suite.
test-quick: venv
	OMP_NUM_THREADS=1 PJRT_DEVICE=CPU LABKIT_FAST=1 LABKIT_SOLUTIONS=1 MPLBACKEND=Agg LABKIT_CONSOLE=1 $(PY) -m pytest tests \
		-m "not heavy and not images and not slow" -q

bench: venv
	for b in bench/bench_*.py; do PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(PY) $$b || exit 1; done

clean:
	rm -rf artifacts .pytest_cache
