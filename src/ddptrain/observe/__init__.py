"""Observability: rank-aware logging, metric sinks, throughput and MFU, profiler, watchdog."""
