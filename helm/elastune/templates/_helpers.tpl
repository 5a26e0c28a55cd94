{{/* Names and labels shared by every template (app.kubernetes.io/* recommended labels). */}}

{{- define "elastune.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix: <release>-<chart>, or <release> when it already names the chart. */}}
{{- define "elastune.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "elastune.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component (operator | redis): stable across upgrades. */}}
{{- define "elastune.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastune.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of every resource: call with (dict "root" $ "component" "operator"). */}}
{{- define "elastune.labels" -}}
helm.sh/chart: {{ include "elastune.chart" .root }}
{{ include "elastune.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: elastune
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "elastune.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "elastune.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "elastune.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* The gateway runs from the operator's image unless gateway.image names another; an unset tag follows
the operator's only when the repository does too. */}}
{{- define "elastune.gatewayImage" -}}
{{- $image := .Values.gateway.image }}
{{- $repository := default .Values.operator.image.repository $image.repository }}
{{- $tag := $image.tag }}
{{- if and (not $tag) (not $image.repository) }}
{{- $tag = .Values.operator.image.tag }}
{{- end }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion $tag) }}
{{- end }}

{{- define "elastune.workerImage" -}}
{{- printf "%s:%s" .Values.worker.image.repository (default .Chart.AppVersion .Values.worker.image.tag) }}
{{- end }}

{{/* Redis: the bundled Service's URL (with the .svc suffix: workers run in other namespaces) or the
external one, which is then required. */}}
{{- define "elastune.redisUrl" -}}
{{- if .Values.redis.bundled.enabled }}
{{- printf "%s://%s-redis.%s.svc:6379/0" (ternary "rediss" "redis" (eq (include "elastune.redisTls" .) "true")) (include "elastune.fullname" .) .Release.Namespace }}
{{- else }}
{{- required "redis.url is required when redis.bundled.enabled is false" .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "elastune.redisAuth" -}}
{{- or .Values.redis.bundled.enabled .Values.redis.auth.enabled }}
{{- end }}

{{- define "elastune.redisSecretName" -}}
{{- default (printf "%s-redis" (include "elastune.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* Pod-level part of the restricted Pod Security profile; uid/gid optional (platform-assigned). */}}
{{- define "elastune.podSecurityContext" -}}
runAsNonRoot: true
{{- if not (kindIs "invalid" .runAsUser) }}
runAsUser: {{ .runAsUser }}
{{- end }}
{{- if not (kindIs "invalid" .runAsGroup) }}
runAsGroup: {{ .runAsGroup }}
fsGroup: {{ .runAsGroup }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container-level part of the restricted profile, plus a read-only root filesystem. */}}
{{- define "elastune.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Who may connect to worker pods (NetworkPolicy ingress rules): the release's gateway and operator
pods to the http port, Prometheus to the metrics port, and networkPolicy.extraIngress (workers take no traffic through a Service or Knative). The same list goes to the
chart's per-namespace policies and, cluster-wide, to the operator, which writes it into each WarmPool
namespace. */}}
{{- define "elastune.workerIngress" -}}
{{- $np := .Values.networkPolicy -}}
- from:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: {{ .Release.Namespace }}
      podSelector:
        matchExpressions:
          - key: app.kubernetes.io/instance
            operator: In
            values: [{{ .Release.Name | quote }}]
          - key: app.kubernetes.io/component
            operator: In
            values: ["gateway", "operator"]
  ports:  # /v1 and the control routes; not /metrics, which names every namespace's adapters on the pod
    - port: http
      protocol: TCP
{{- if $np.prometheus.enabled }}
- from:
    - namespaceSelector:
        {{- toYaml $np.prometheus.namespaceSelector | nindent 8 }}
      podSelector:
        {{- toYaml $np.prometheus.podSelector | nindent 8 }}
  ports:  # the worker's metrics port (the operator's container port `metrics`) and nothing else
    - port: metrics
      protocol: TCP
{{- end }}
{{- with $np.extraIngress }}
{{ toYaml . }}
{{- end }}
{{- end }}


{{/* Redis users per role (docs/design.md §6 Tenancy): the bundled Redis with redis.bundled.acl.enabled runs
ACL users operator, gateway and worker (their rules: elastune.redisAclRules below, generated from
elastune_contract/redis_acl.py), each with its own password Secret; the worker's is
the only credential the operator copies into WarmPool namespaces. */}}
{{- define "elastune.redisAcl" -}}
{{- and .Values.redis.bundled.enabled .Values.redis.bundled.acl.enabled }}
{{- end }}

{{- define "elastune.redisGatewaySecretName" -}}
{{- default (printf "%s-redis-gateway" (include "elastune.fullname" .)) .Values.redis.bundled.acl.existingSecrets.gateway }}
{{- end }}

{{- define "elastune.redisWorkerSecretName" -}}
{{- default (printf "%s-redis-worker" (include "elastune.fullname" .)) .Values.redis.bundled.acl.existingSecrets.worker }}
{{- end }}

{{/* The Secret the worker pods read their Redis password from (copied into each WarmPool namespace) and
its key: the worker user's with ACLs, else the one Redis password. */}}
{{- define "elastune.workerRedisSecret" -}}
{{- if eq (include "elastune.redisAcl" .) "true" }}{{ include "elastune.redisWorkerSecretName" . }}{{ else }}{{ include "elastune.redisSecretName" . }}{{ end }}
{{- end }}

{{- define "elastune.workerRedisSecretKey" -}}
{{- if eq (include "elastune.redisAcl" .) "true" }}password{{ else }}{{ .Values.redis.auth.secretKey }}{{ end }}
{{- end }}

{{/* One role's ACL rules, from files/redis-acl-rules.yaml (generated by tools/redis_acl_chart.py from
elastune_contract.redis_acl, their one source). Call with (list $ "operator"|"gateway"|"worker"). */}}
{{- define "elastune.redisAclRules" -}}
{{- $root := index . 0 -}}
{{- index ($root.Files.Get "files/redis-acl-rules.yaml" | fromYaml) (index . 1) -}}
{{- end }}

{{/*
"true" when the gateway authenticates API keys (the operator then publishes the key map and may
list/watch Secrets).
*/}}
{{- define "elastune.apiKeys" -}}
{{- if and .Values.gateway.enabled .Values.gateway.auth .Values.gateway.auth.enabled -}}true{{- else -}}false{{- end -}}
{{- end }}
