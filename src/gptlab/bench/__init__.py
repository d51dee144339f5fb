"""Benchmarks that run gptlab and a peer side by side in one process (`gptlab bench NAME`)."""
