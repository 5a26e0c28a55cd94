"""Routing policies behind one interface (``policy.Router``), chosen per pool by a typed setting
(``policy.RoutingPolicyName``) through ``factory.make_router``. Pure: no torch, no I/O, no clock — the
caller passes ``now``.
"""
