"""The Flower app that `lifl.bench.flower` runs: `lifl demo`'s FL job as a Flower ServerApp and
ClientApp (this directory, with its pyproject.toml, is what `flwr run` packages into a FAB)."""
