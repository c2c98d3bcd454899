from qshard.cli import main

raise SystemExit(main())
