"""The command line (``python -m causal_attention``): cli, demo and its distributed launcher,
check, and the benchmarks (bench/). Programs, not library: nothing here is re-exported."""
