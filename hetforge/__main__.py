from hetforge.cli import main

raise SystemExit(main())
