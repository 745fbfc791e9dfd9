"""Speed and memory measurements, run as modules from the checkout: ``python -m benchmarks.bench_pretrain ...``."""
