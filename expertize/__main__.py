from expertize.conversion.cli import main

raise SystemExit(main())
