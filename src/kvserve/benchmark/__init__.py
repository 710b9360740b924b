"""``kvserve bench``: our engine and peers on the same workload, measured side by side."""
