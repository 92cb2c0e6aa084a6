"""rollpoint benchmarks: each item measures in one run and prints ratios where a comparison is meant."""
