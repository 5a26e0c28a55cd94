from elastune_ssjf.service import main

raise SystemExit(main())
