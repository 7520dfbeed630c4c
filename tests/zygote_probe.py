"""Run by tests/test_zygote.py as `python -m zygote_probe CODE|sleep|forkserver` (or as a script, or by `-c`):
prints what a launch sees."""

import json
import multiprocessing
import os
import random
import sys
import time


def parent_command() -> None:
    """In a process started from a forkserver: the forkserver's command line (a fresh interpreter's or not)."""
    print(open(f"/proc/{os.getppid()}/cmdline").read().replace("\0", " "), flush=True)


def main(what: str) -> int:
    if what == "sleep":
        print("sleeping", flush=True)
        if os.environ.get("PROBE"):
            open(os.environ["PROBE"], "w").close()  # said so
        time.sleep(60)
    if what == "forkserver":
        process = multiprocessing.get_context("forkserver").Process(target=parent_command)
        process.start()
        process.join()
        return process.exitcode
    print(json.dumps({"argv0": sys.argv[0], "argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path, "probe": os.environ.get("PROBE"),
                      "random": random.random(), "pid": os.getpid(), "ppid": os.getppid(),
                      "torch_preloaded": "torch" in sys.modules, "main": __name__}))
    print("to stderr\r\nline", file=sys.stderr)
    return int(what)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
