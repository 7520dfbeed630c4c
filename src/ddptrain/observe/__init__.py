"""Observability: rank-aware log files, metric sinks (JSONL, TensorBoard, the progress bar), throughput and MFU,
the profiler, GPU utilisation, experiment trackers (`trackers`: rank 0, each on its own thread).

May import: the contracts at the top, `models` and `data.batch` (counting a batch's FLOPs). Never the loop,
parallel or checkpoints.
"""
