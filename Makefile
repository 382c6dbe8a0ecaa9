# The README's two commands: `make demo` and `make test`. Each sets up everything it needs.
PYTHON ?= python3
NATIVE_BUILD := build/native
EXTENSION_STAMP := build/.extension-built

.PHONY: demo test deps native-test clean

demo: $(EXTENSION_STAMP)
	$(PYTHON) examples/demo.py

# Times itself, the extension's build included: the suite is meant to take minutes.
test:
	@started=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory $(EXTENSION_STAMP) || status=$$?; \
	if [ $$status -eq 0 ]; then \
	  $(PYTHON) -m pytest tests -q || status=$$?; \
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

native-test: | deps
	cmake -S . -B $(NATIVE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE=$$(command -v $(PYTHON))
	cmake --build $(NATIVE_BUILD)
	ctest --test-dir $(NATIVE_BUILD) --output-on-failure

clean:
	rm -rf build pipecomm/_C*.so *.egg-info
