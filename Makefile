# Wraps the build steps; the real work is in CMake and the scripts it names.
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all deps configure build test demo bench install package clean

all: build

deps:
	@deploy/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j 2

demo: build
	@examples/run-demo.sh $(BUILD)

bench: build
	$(BUILD)/bench/tierd-bench control
	$(BUILD)/bench/tierd-bench replay
	$(BUILD)/bench/tierd-bench adam --params=1e7,1e8
	$(BUILD)/bench/tierd-bench offload-step

# PREFIX=/usr/local by default; DESTDIR works as usual.
install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX))

# The .deb, in $(BUILD)/.
package: build
	cd $(BUILD) && cpack

clean:
	rm -rf $(BUILD) var
