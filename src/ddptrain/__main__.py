from ddptrain.cli import entry

raise SystemExit(entry())
