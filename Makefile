# The two commands a newcomer runs (both install what they need first):
#   make demo   - `lifl demo`: federated learning through a local node, to 90 % test accuracy
#   make test   - the whole test suite, including the slow and root-only suites
.PHONY: install bpf testbed images demo test test-fast fuzz bench proto clean

PY := .venv/bin/python

install:
	@scripts/install.sh

# The eBPF key channel (bpf/keychan.bpf.o); install builds it too.
bpf:
	$(MAKE) -s -C bpf

demo: install
	.venv/bin/lifl demo

test: install testbed
	$(PY) -m pytest --all -q

# The Kubernetes test bed's binaries (scripts/k8s-testenv.sh; built once from the committed Go
# modules, then cached in ~/.cache/lifl-testenv: about 15 minutes the first time).
testbed:
	@scripts/k8s-testenv.sh build

# lifl's container images, built locally into ~/.cache/lifl-testenv/images (docs/images.md).
images: install
	@scripts/images.sh build

test-fast: install
	$(PY) -m pytest -q

# A longer fuzz run of every parser (the suite runs a bounded one).
fuzz: install
	LIFL_FUZZ_PROFILE=long $(PY) -m pytest -q -m fuzz -p no:timeout

bench: install
	$(PY) -m lifl bench dataplane

# Regenerate the gRPC stubs after editing lifl/net/lifl.proto.
proto: install
	tmp=$$(mktemp -d) && $(PY) -m grpc_tools.protoc -Ilifl/net=lifl/net --python_out=$$tmp --grpc_python_out=$$tmp lifl/net/lifl.proto \
	  && mv $$tmp/lifl/net/*.py lifl/net/ && rm -rf $$tmp

clean:
	rm -rf .venv build *.egg-info lifl/*.so .pytest_cache
	$(MAKE) -s -C bpf clean
