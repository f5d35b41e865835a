# Wraps the build steps; the real work is in CMake and the scripts it names.
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
# The second build of `make test`: clang, AddressSanitizer + UndefinedBehaviorSanitizer, the
# invariants that cost O(chunks) checked where they are relied on, and the libFuzzer targets
# (fuzz/).
SANITIZED ?= build-asan
FUZZ_SECONDS ?= 300

.PHONY: all deps configure build test test-build test-sanitized configure-sanitized fuzz demo \
        bench install package gpu-kit wheel python-env clean

all: build

# Debian's packages; then the Python environment of requirements.txt (torch and the Hugging Face
# libraries from PyPI), made once outside the clone and reused: deploy/python-env.sh.
deps:
	@deploy/install-deps.sh
	@deploy/python-env.sh >/dev/null

python-env: deps
	@deploy/python-env.sh

PYTHON = $$(deploy/python-env.sh)/bin/python

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DPython3_EXECUTABLE=$(PYTHON) $(CMAKE_ARGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# Every test twice: the release build's suite, then the sanitized build's suite and a short run
# of each fuzz target over its corpus. The Python tests run on requirements.txt's torch.
test: test-build test-sanitized

test-build: build
	ctest --test-dir $(BUILD) --output-on-failure -j 2

configure-sanitized: deps
	@CC=clang CXX=clang++ cmake -S . -B $(SANITIZED) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DPython3_EXECUTABLE=$(PYTHON) -DTIERD_SANITIZE=address -DTIERD_CHECK_INVARIANTS=ON -DTIERD_FUZZ=ON -DTIERD_CUDA=OFF $(CMAKE_ARGS) >/dev/null

test-sanitized: configure-sanitized
	@cmake --build $(SANITIZED) -j $(JOBS)
	ctest --test-dir $(SANITIZED) --output-on-failure -j 2

# Each fuzz target for FUZZ_SECONDS over its corpus; crashing inputs land in fuzz-crashes/.
fuzz: configure-sanitized
	@cmake --build $(SANITIZED) -j $(JOBS) --target fuzz_targets
	@for f in config config_tiers nvme_index session rpc; do \
	  fuzz/run.sh $(SANITIZED)/fuzz/$${f}_fuzz fuzz/corpus/$$f $(FUZZ_SECONDS) || exit 1; \
	done

demo: build
	@examples/run-demo.sh $(BUILD)

bench: build
	$(BUILD)/bench/tierd-bench control
	$(BUILD)/bench/tierd-bench replay
	$(BUILD)/bench/tierd-bench adam --params=1e7,1e8
	$(BUILD)/bench/tierd-bench offload-step
	$(PYTHON) bench/train_step.py --build $(BUILD)
	$(PYTHON) bench/activation_offload.py --build $(BUILD)
	$(PYTHON) bench/bf16_moments.py --build $(BUILD)
	$(PYTHON) bench/param_stream.py --build $(BUILD)
	$(PYTHON) bench/checkpoint.py --build $(BUILD)
	$(PYTHON) bench/pretrained.py --build $(BUILD)
	$(PYTHON) bench/shared_base.py --build $(BUILD)
	$(PYTHON) bench/rank_stream.py --build $(BUILD)
	$(PYTHON) bench/deepspeed_side_by_side.py --build $(BUILD)

# The GPU kit (gpu-kit/tierd-gpu-kit.tar.gz): the CUDA build's daemon, client, tests and benches
# with the Debian libraries they load, to unpack and run on a GPU machine (docs/gpu.md).
gpu-kit: build
	@tests/gpu/make_kit.sh $(BUILD) gpu-kit

# The Python wheel (dist/tierd-VERSION-py3-none-manylinux_2_NN_x86_64.whl): the package with the
# client library and the Debian libraries it loads; `pip install` it into any environment.
wheel: build
	@deploy/make-wheel.sh $(BUILD) dist $(PYTHON)

# PREFIX=/usr/local by default; DESTDIR works as usual.
install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX))

# The .deb, in $(BUILD)/.
package: build
	cd $(BUILD) && cpack

clean:
	rm -rf $(BUILD) $(SANITIZED) var fuzz-crashes dist
