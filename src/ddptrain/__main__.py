from ddptrain.cli import main

raise SystemExit(main())
