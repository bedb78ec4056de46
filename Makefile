# Two commands do all the set-up on a fresh clone:
#   make demo   create the tiny checkpoint if missing, serve it, send an image request,
#               print the streamed answer and whether it matches transformers
#   make test   the lint (make lint: ruff, pyproject's [tool.ruff]) and the test suite (what CI runs)
#   make vllm-env  vLLM's CPU build in a virtual environment of its own ($(VLLM_VENV)), for
#               `epd bench --baseline vllm`; idempotent (scripts/vllm_env.py says what it did)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= models/tiny
VLLM_VENV ?= .venv-vllm

.PHONY: install demo lint test test-slow protos clean vllm-env video-ref-env

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel, not a multi-gigabyte CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# the C++ operators (epd/csrc: prefill's oneDNN matmul and fused GDN chunk rule, decode's fused
	# GDN step, decode's linear layers, norms and attention), compiled once into the user's cache
	# dir (a role would otherwise build them at its start)
	$(PY) -c "from epd import fused, kernels_prefill; kernels_prefill.available(); kernels_prefill.gdn_chunk_op(); fused.ops(); fused.decode_ops()"
	touch $@

$(MODEL)/config.json: | install
	$(VENV)/bin/epd model create --preset tiny --out $(MODEL)

demo: install $(MODEL)/config.json
	$(VENV)/bin/epd demo --model $(MODEL)

# pyflakes' checks, import order and syntax errors (pyproject's [tool.ruff]); seconds
lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/epd/v1/epd.proto

# Never in epd's venv: vLLM pins its own transformers. Needs only python3 and the package registry.
vllm-env:
	$(PYTHON) scripts/vllm_env.py $(VLLM_VENV)

# transformers' own Qwen3.5 video processor (it needs torchvision) in a venv of its own that reads
# epd's packages: the reference of tests/test_video_reference.py (slow). Idempotent.
video-ref-env: install
	$(PYTHON) scripts/video_ref_env.py .venv-videoref $(VENV)

clean:
	rm -rf $(VENV) models .pytest_cache
