"""The argparse every `ddptrain` command uses: each complaint is a one-line UsageError, not usage + exit 2."""

from __future__ import annotations

import argparse
import difflib

from ddptrain.errors import UsageError


class _Help(argparse.HelpFormatter):
    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):  # "--x [true|false], --no-x": the value is the first spelling's only
            return ", ".join((f"{action.option_strings[0]} [{action.metavar}]", *action.option_strings[1:]))
        return super()._format_action_invocation(action)


class ArgParser(argparse.ArgumentParser):
    """argparse, but errors raise UsageError (exit 2, one line); an unknown flag gets a "did you mean"."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            flag = message.split(":", 1)[1].split()[0]
            known = [a for action in self._actions for a in action.option_strings]
            hint = difflib.get_close_matches(flag.split("=")[0], known, n=1)
            fix = f"did you mean {hint[0]}?" if hint else f"see `{self.prog} --help`"
            raise UsageError(f"unknown flag {flag}; {fix}")
        raise UsageError(f"{message}; see `{self.prog} --help`")


TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class Switch(argparse.Action):
    """A boolean flag as users spell it: `--x`, `--x true` / `--x false` (and yes/no, on/off, 1/0), `--no-x`."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        negated = [f"--no-{name[2:]}" for name in option_strings if name.startswith("--")]
        super().__init__([*option_strings, *negated], dest, nargs="?", metavar="true|false", **kwargs)

    def __call__(self, parser, namespace, value, option_string=None) -> None:  # noqa: ANN001
        if option_string.startswith("--no-"):
            if value is not None:
                raise UsageError(f"{option_string} takes no value (got {value!r}); pass {option_string}, or "
                                 f"--{option_string[5:]} {value}")
            setattr(namespace, self.dest, False)
        elif value is None or value.lower() in TRUE + FALSE:
            setattr(namespace, self.dest, value is None or value.lower() in TRUE)
        else:
            raise UsageError(f"{option_string} {value}: not true or false; pass {option_string} (true), "
                             f"--no-{option_string[2:]} (false), or {option_string} false")
