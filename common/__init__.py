"""What every layer shares: the model's shape, parallelism, the padded step sizes, the benchmark
client, setting checks and where the configs are."""
