"""Failpoints: crash the operator at one named, narrow moment, for fault tests and `elastune bench chaos`.

Off unless ``ELASTUNE_FAILPOINT`` names the point (a comma-separated list). A failpoint that fires logs
and ends the process at once (``os._exit``, no cleanup), as a SIGKILL or a node loss would:

- ``dispatch-after-status``: the attempt is in the job's status, no worker was told to start it yet;
- ``publish-after-create``: the LoRAAdapter exists, the job's status does not say it was published.
"""

from __future__ import annotations

import logging
import os

FAILPOINT_ENV = "ELASTUNE_FAILPOINT"
EXIT_CODE = 86
DISPATCH_AFTER_STATUS = "dispatch-after-status"
PUBLISH_AFTER_CREATE = "publish-after-create"

log = logging.getLogger("elastune.failpoint")


def failpoint(name: str) -> None:
    armed = os.environ.get(FAILPOINT_ENV)
    if armed and name in (p.strip() for p in armed.split(",")):
        log.critical("failpoint %s: exiting now (%s)", name, FAILPOINT_ENV)
        logging.shutdown()
        os._exit(EXIT_CODE)
