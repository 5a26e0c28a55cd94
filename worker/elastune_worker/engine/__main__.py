from elastune_worker.engine.server import main

raise SystemExit(main())
