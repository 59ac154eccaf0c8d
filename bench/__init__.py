"""grpo-fast benchmarks: one harness (``bench.harness``), one model registry (``bench.models``), CSV in
``bench/results/``, plots made from the CSV (``bench.plot``)."""
