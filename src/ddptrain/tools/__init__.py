"""The tools around a run: `ddptrain doctor`, `plan`, `report` and `export`.

Each is a command of its own (`main(argv)`), run before or after training, never inside it.

May import: anything below the faces (parallel, checkpoints, models, observe, the contracts).
"""
