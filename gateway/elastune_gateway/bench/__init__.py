"""The gateway's benchmark (``elastune bench route``) and the serving processes it starts (real worker
processes registered in a real Redis, the gateway, the peer routers), which the tests reuse."""
