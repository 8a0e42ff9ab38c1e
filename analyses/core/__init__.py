"""What every room uses: hook names, tokens, metrics, the memory budget, progress bars, plots, the probe batches and the hook self-test."""
