"""The gateway's benchmarks: where a request goes (``route``), what the gateway costs (``gateway``), one
tenant flooding another (``tenancy``), on real worker and gateway processes (``..processes``)."""
