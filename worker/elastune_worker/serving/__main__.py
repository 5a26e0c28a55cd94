from elastune_worker.serving.server import main

raise SystemExit(main())
