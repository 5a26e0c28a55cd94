"""Who a request is: service-account tokens issued through TokenRequest, and the users they stand for.

After kubernetes/kubernetes:
- pkg/registry/core/serviceaccount/storage/token.go: `POST .../serviceaccounts/<name>/token` (the
  TokenRequest the kubelet makes for a pod's projected token) answers a TokenRequest whose
  status.token authenticates as that service account; the account must exist (404 otherwise);
- staging/src/k8s.io/apiserver/pkg/authentication/serviceaccount/util.go: the user is
  `system:serviceaccount:<namespace>:<name>` in the groups `system:serviceaccounts`,
  `system:serviceaccounts:<namespace>` (and `system:authenticated`, added by the authenticator chain);
- pkg/serviceaccount/claims.go (validation): a token stops authenticating once its service account is
  deleted or replaced (another uid): the request is 401 Unauthorized.

Stand-in differences: tokens are opaque random strings (not signed JWTs), expiry and audiences are
recorded but not enforced, and every namespace's `default` account counts as existing (on a cluster
the service-account controller creates it).
"""

from __future__ import annotations

import dataclasses
import datetime
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Final

ADMIN_TOKEN: Final = "emulator"
"""The token in the kubeconfig `write_kubeconfig` writes: the tests' own client, a cluster admin."""
DEFAULT_AUDIENCES: Final = ("https://kubernetes.default.svc.cluster.local",)


@dataclasses.dataclass(frozen=True, slots=True)
class User:
    name: str
    groups: tuple[str, ...]

    @property
    def is_admin(self) -> bool:
        # system:masters bypasses authorization on a real apiserver (the privileged-group authorizer).
        return "system:masters" in self.groups


ADMIN: Final = User("system:admin", ("system:masters", "system:authenticated"))


def service_account_user(namespace: str, name: str) -> User:
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Issued:
    namespace: str
    name: str
    uid: str | None  # the account's uid when it was issued (None: an implicit `default`)


@dataclasses.dataclass
class Tokens:
    """Issued tokens; `account_uid(namespace, name)` says the current uid of an account (None: absent)."""

    account_uid: Callable[[str, str], str | None]
    _issued: dict[str, _Issued] = dataclasses.field(default_factory=dict)

    def issue(self, namespace: str, name: str, request: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A TokenRequest answer for the account, or None when the account does not exist."""
        uid = self.account_uid(namespace, name)
        if uid is None and name != "default":
            return None
        token = secrets.token_urlsafe(32)
        self._issued[token] = _Issued(namespace, name, uid)
        spec = dict((request or {}).get("spec") or {})
        seconds = int(spec.get("expirationSeconds") or 3600)
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
        return {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "audiences": list(spec.get("audiences") or DEFAULT_AUDIENCES),
                "expirationSeconds": seconds,
                "boundObjectRef": spec.get("boundObjectRef"),
            },
            "status": {"token": token, "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")},
        }

    def authenticate(self, authorization: str) -> User | None:
        """The user of an `Authorization` header: ADMIN without one (the tests' client) or with the
        kubeconfig's token, a service account for a live issued token, else None (401)."""
        scheme, _, token = authorization.strip().partition(" ")
        if not authorization.strip():
            return ADMIN
        if scheme.lower() != "bearer":
            return None
        token = token.strip()
        if token == ADMIN_TOKEN:
            return ADMIN
        issued = self._issued.get(token)
        if issued is None:
            return None
        if issued.uid is not None and self.account_uid(issued.namespace, issued.name) != issued.uid:
            return None  # the account was deleted or replaced since
        return service_account_user(issued.namespace, issued.name)
