"""Data: datasets, the global sample order, loaders and their worker processes.

Owns: the seeded sample order every world size shares and the loaders built on it (`pipeline`), moving a
batch to the device and counting its samples (`batch`), the built-in datasets (`images`, `text`), token
streams (`streams`), variable-length rows packed into bins of --seq_len (`packing`).

May import: the contracts at the top (config, errors) and `models.hf` (a Hugging Face dataset's
tokenizer). Nothing that knows ranks: the loop hands each rank its share (`loop.loaders`).
"""
