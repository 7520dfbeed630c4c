"""Checkpoints: what is written, how it is verified, and who may write.

Owns: the on-disk format and its verification (`format`: manifest, digests, atomic writes, the resume check
of changed settings), the sharded DCP layout (`shards`), reading either layout back (`read`), the parts
(`Stateful`s) saved and loaded back and the save / resume / fall-back / retention policy across ranks
(`manager`), and the run-dir lock (`runlock`).

May import: the contracts at the top (config, errors, faults) and `parallel` (the collectives that agree on
a save). Never the loop, which decides what goes into a checkpoint (`loop.checkpointed`).
"""
