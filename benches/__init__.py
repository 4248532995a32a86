"""Benchmarks: per-pod setup cost, data-path overhead and scale, next to a reference run alongside.

    make bench          # full run (N up to 1000 pods)
    make bench-quick    # under two minutes (N up to 100)
    .venv/bin/python -m benches --help

Every figure is reported as a ratio against a reference measured in the same run (Istio's
per-pod sequences for setup: ``istio-iptables``' for sidecar pods, istio-cni's node agent's for
ambient ones; a direct uncaptured connection for the data path),
because absolute times on shared machines are noise. Results: ``benches/results/``.
"""
