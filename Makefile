# hookserve: `make serve` runs the service, `make test` runs the tests.
# Both create .venv and install the package with its server and dev extras first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# torch/torchvision from the local wheel cache on the dev machines; any pip mirror elsewhere.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,batch,dev,http,oip-clients]'
	touch $(STAMP)

.PHONY: setup serve test test-slow test-ray test-kserve lint proto bench bench-quick docker-smoke clean

setup: $(STAMP)  ## create .venv and install everything

serve: $(STAMP)  ## serve resnet50, device and weights auto, on :50051
	$(VENV)/bin/hookserve serve --model resnet50 --device auto --weights auto $(ARGS)

test: $(STAMP)  ## the fast suite (what CI runs)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP)  ## soak and property-based tests
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

test-ray: $(STAMP)  ## the Ray Data adapter inside Ray (installs the ray extra first)
	$(PY) -m pip install -q -e '.[ray]'
	$(PY) -m pytest -q -m ray $(PYTEST_ARGS)

# kserve pins protobuf < 7: its clients run in a venv of their own, .venv-kserve.
test-kserve: $(STAMP)  ## KServe's own clients (gRPC and REST) against a real server
	test -x .venv-kserve/bin/python || $(PYTHON) -m venv .venv-kserve
	.venv-kserve/bin/python -m pip install -q -r tests/requirements-kserve.txt
	$(PY) -m pytest -q tests/test_oip_kserve.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check client service tests bench tools

proto: $(STAMP)  ## regenerate client/hookserve/v1 from proto/
	$(PY) tools/gen_proto.py

bench: $(STAMP)  ## full benchmark table (writes bench/results/*.json)
	$(PY) bench/run.py

bench-quick: $(STAMP)  ## a faster, smaller benchmark run
	$(PY) bench/run.py --quick

# LitServe goes in .venv (the `peers` extra); kserve pins protobuf < 7, so it gets a
# venv of its own. Writes bench/results/peers-*.json; table in docs/performance.md.
bench-peers: $(STAMP)  ## hookserve vs LitServe vs a KServe v2 gRPC server, side by side
	$(PY) -m pip install -q -e '.[peers]'
	test -x .venv-kserve/bin/python || $(PYTHON) -m venv .venv-kserve
	.venv-kserve/bin/python -m pip install -q -r bench/peers/requirements-kserve.txt
	$(PY) -m bench.peers.run $(ARGS)

docker-smoke: $(STAMP)  ## build the image, run it, extract through it, SIGTERM it
	bash scripts/docker_smoke.sh

clean:
	rm -rf $(VENV) .venv-kserve .pytest_cache .ruff_cache build *.egg-info client/*.egg-info
