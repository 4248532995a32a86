# The two commands that matter (see README.md):
#   make demo   sets up redirection in a real namespace and shows captured connections
#   make test   installs what it needs, then runs lint, types and the whole test suite
PY := .venv/bin/python

.PHONY: bootstrap demo test lint wheel image image-background bench bench-quick clean

bootstrap:
	bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m demo $(DEMO_ARGS)

# The node image (redirect:<version>) as an OCI archive: build/redirect-image.tar (deploy/build-image.sh;
# rebuilt only when what goes into it changed). Load it with: ctr -n k8s.io images import build/redirect-image.tar
image: bootstrap
	bash deploy/build-image.sh

# make test starts it in the background, so that the build overlaps lint and the first tests;
# tests/test_cri.py waits for it (the recipe's lock) and builds it itself if it is still missing.
image-background: bootstrap
	@mkdir -p build
	@setsid bash deploy/build-image.sh > build/image-build.log 2>&1 < /dev/null &

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/mypy redirect/ demo/

# First the tests that need no root and no kernel (golden renderings, plan, lowerings: seconds),
# then the kernel tests; each test runs once. Exit 5 is pytest's "nothing selected" (PYTEST_ARGS
# may select only one kind).
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
test: image-background lint
	$(PYTEST) -m noroot $(PYTEST_ARGS) tests || [ $$? -eq 5 ]
	$(PYTEST) -m "not noroot" $(PYTEST_ARGS) tests || [ $$? -eq 5 ]

# make wheel: the sdist and the wheel built from it, each in an isolated environment as pip
# builds them (the cffi module and the thin CNI plugin compiled in), into $(WHEEL_DIR):
# redirect-<version>.tar.gz and redirect-<version>-cp311-cp311-linux_x86_64.whl.
WHEEL_DIR := build/dist
wheel: bootstrap
	$(PY) -m build --outdir $(WHEEL_DIR) .

# make bench [ARGS=--quick]: results in benches/results/ (JSON, summary.md, PNG plots), and the
# published figures, docs/benchmarks-results.md, rendered from that run's results file
bench: bootstrap
	REDIRECT_BENCH_COMMAND="make bench$(if $(strip $(BENCH_ARGS) $(ARGS)), ARGS='$(strip $(BENCH_ARGS) $(ARGS))')" \
		$(PY) -m benches $(BENCH_ARGS) $(ARGS)
	$(PY) -m benches.publish benches/results/latest.json docs/benchmarks-results.md

bench-quick: bootstrap
	$(MAKE) bench ARGS="--quick $(ARGS)"

clean:
	rm -rf .venv build *.egg-info redirect/_native* redirect/cni/redirect-cni-thin .pytest_cache .mypy_cache .ruff_cache
