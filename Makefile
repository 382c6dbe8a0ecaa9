# The README's two commands: `make demo` and `make test`. Each sets up everything it needs.
PYTHON ?= python3
NATIVE_BUILD := build/native
EXTENSION_STAMP := build/.extension-built

.PHONY: demo test deps native-build native-test clean

demo: $(EXTENSION_STAMP)
	$(PYTHON) examples/demo.py

# Times itself, the builds included: the suite is meant to take minutes. The extension and the native tests build side
# by side; pytest runs in shards side by side (scripts/run_tests.py; PYTEST_SHARDS=1 for one plain run).
test:
	@started=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory -j2 $(EXTENSION_STAMP) native-build || status=$$?; \
	if [ $$status -eq 0 ]; then \
	  $(PYTHON) scripts/run_tests.py -q || status=$$?; \
	  if [ $$status -eq 5 ]; then echo "pytest collected no tests"; fi; \
	fi; \
	if [ $$status -eq 0 ]; then $(MAKE) --no-print-directory native-test || status=$$?; fi; \
	echo "make test: $$(( $$(date +%s) - started )) s in all, exit status $$status"; \
	exit $$status

deps:
	PYTHON=$(PYTHON) scripts/bootstrap.sh

# --no-build-isolation compiles against the torch already installed instead of downloading one.
$(EXTENSION_STAMP): setup.py pyproject.toml $(shell find csrc -type f) | deps
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $@

# -O1 without debug info: the native tests check protocols, not speed, and build in 2/3 of the time (86 vs 130
# CPU seconds); the ThreadSanitizer builds keep line tables (-g1) for their reports.
native-build: | deps
	cmake -S . -B $(NATIVE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -DPython3_EXECUTABLE=$$(command -v $(PYTHON))
	cmake --build $(NATIVE_BUILD)

native-test: native-build
	ctest --test-dir $(NATIVE_BUILD) --output-on-failure

clean:
	rm -rf build pipecomm/_C*.so *.egg-info
