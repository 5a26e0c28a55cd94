"""The apiserver's own rules, one module each, that the API emulator (elastune_testing.emulator) applies.

- `admission`: a custom resource as the apiextensions-apiserver admits it (prune, default, schema, CEL);
- `cel`: `x-kubernetes-validations` rules, evaluated with a maintained CEL implementation;
- `authn`: service-account tokens (TokenRequest) and the users they stand for;
- `rbac`: request attributes from method and path, and the RBAC authorizer's decision over the
  Roles, ClusterRoles and bindings stored in the emulator.

Each module names the Kubernetes source it follows (kubernetes/kubernetes, paths in the docstrings).
"""
