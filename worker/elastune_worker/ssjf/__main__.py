from elastune_worker.ssjf.service import main

raise SystemExit(main())
