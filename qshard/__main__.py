from qshard_cli import main

raise SystemExit(main())
