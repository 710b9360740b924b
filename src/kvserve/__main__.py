from kvserve.cli.main import main

raise SystemExit(main())
