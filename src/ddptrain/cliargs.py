"""The argparse every `ddptrain` command uses: each complaint is a one-line UsageError, not usage + exit 2."""

from __future__ import annotations

import argparse
import difflib

from ddptrain.errors import UsageError


class ArgParser(argparse.ArgumentParser):
    """argparse, but errors raise UsageError (exit 2, one line); an unknown flag gets a "did you mean"."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            flag = message.split(":", 1)[1].split()[0]
            known = [a for action in self._actions for a in action.option_strings]
            hint = difflib.get_close_matches(flag.split("=")[0], known, n=1)
            fix = f"did you mean {hint[0]}?" if hint else f"see `{self.prog} --help`"
            raise UsageError(f"unknown flag {flag}; {fix}")
        raise UsageError(f"{message}; see `{self.prog} --help`")


# How a switch is spelled on: `--x true`, and off: `--x false` (`ddptrain train`, config.py).
TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
