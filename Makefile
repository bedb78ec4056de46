# Two commands do all the set-up on a fresh clone:
#   make demo   create the tiny checkpoint if missing, serve it, send an image request,
#               print the streamed answer and whether it matches transformers
#   make test   the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= models/tiny

.PHONY: install demo test test-slow protos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel, not a multi-gigabyte CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

$(MODEL)/config.json: | install
	$(VENV)/bin/epd model create --preset tiny --out $(MODEL)

demo: install $(MODEL)/config.json
	$(VENV)/bin/epd demo --model $(MODEL)

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/epd/v1/epd.proto

clean:
	rm -rf $(VENV) models .pytest_cache
