"""Stands for what a trainer's main module imports (transformers, the user's package): each process that
imports it appends its pid to the file named by LOADER_MAIN_IMPORTS."""

import os

with open(os.environ["LOADER_MAIN_IMPORTS"], "a") as _record:
    _record.write(f"{os.getpid()}\n")
