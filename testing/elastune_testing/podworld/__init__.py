"""The pod world: pods as isolated hosts on one machine, for tests/cluster/ (docs/design.md §8).

Each pod is a process tree in its own network namespace (its own address on a bridge) and its own mount
namespace (private /tmp, only its declared volumes), started from the Pod object in the API emulator by
a kubelet that writes its status back; Deployments, Knative Services and ClusterIP Services are run by
small controllers. Needs root; `available()` says why not. Test support only: product code never
imports it.
"""

from elastune_testing.podworld.network import available
from elastune_testing.podworld.world import PodWorld

__all__ = ["PodWorld", "available"]
