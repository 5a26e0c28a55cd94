{{/* The Secrets the chart generates, computed once per render so the Secret objects and the pods'
checksum annotations agree (docs/operations/install.md, "Secrets and GitOps").

A generated value is the live Secret's when there is one (lookup: helm install/upgrade keep it), else
random. Helm renders every template of a chart with the same .Values map, so the first template that
asks stores the value there and every later one (Secret, checksum, NOTES) reads the same. Under
`helm template` lookup returns nothing (Helm's docs, "Using the lookup function"): each render is new
random, which is why the existingSecret values exist. */}}

{{- define "elastune.operatorKeysSecretName" -}}
{{- default (printf "%s-operator-keys" (include "elastune.fullname" .)) .Values.operator.proofKey.existingSecret }}
{{- end }}

{{/* Whether the gateway signs forwarded requests (gateway.requestCredential, docs/security.md). */}}
{{- define "elastune.requestCredential" -}}
{{- and .Values.gateway.enabled .Values.gateway.requestCredential.enabled | toString }}
{{- end }}

{{/* One generated value: (list $ secretName key length). */}}
{{- define "elastune.generatedSecret" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $key := index . 2 }}
{{- if not (hasKey $root.Values "__elastuneGenerated") }}
{{- $_ := set $root.Values "__elastuneGenerated" dict }}
{{- end }}
{{- $memo := get $root.Values "__elastuneGenerated" }}
{{- $id := printf "%s/%s" $name $key }}
{{- if not (hasKey $memo $id) }}
{{- $live := lookup "v1" "Secret" $root.Release.Namespace $name }}
{{- $value := "" }}
{{- if $live }}
{{- $value = index ($live.data | default dict) $key | default "" | b64dec }}
{{- end }}
{{- if not $value }}
{{- $value = randAlphaNum (index . 3) }}
{{- end }}
{{- $_ := set $memo $id $value }}
{{- end }}
{{- get $memo $id }}
{{- end }}

{{/* The Secrets the chart renders, as JSON: name -> data (plain text values). A Secret named by an
existingSecret value is the user's and is not here. */}}
{{- define "elastune.managedSecrets" -}}
{{- $out := dict }}
{{- if and (eq (include "elastune.redisAuth" .) "true") (not .Values.redis.auth.existingSecret) }}
{{- $name := include "elastune.redisSecretName" . }}
{{- $key := .Values.redis.auth.secretKey }}
{{- $password := .Values.redis.auth.password | default (include "elastune.generatedSecret" (list $ $name $key 32)) }}
{{- $_ := set $out $name (dict $key $password) }}
{{- end }}
{{- if eq (include "elastune.redisAcl" .) "true" }}
{{- range $role := list "gateway" "worker" }}
{{- if not (get $.Values.redis.bundled.acl.existingSecrets $role) }}
{{- $name := printf "%s-redis-%s" (include "elastune.fullname" $) $role }}
{{- $password := include "elastune.generatedSecret" (list $ $name "password" 32) }}
{{- $_ := set $out $name (dict "username" (printf "elastune-%s" $role) "password" $password) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not .Values.operator.proofKey.existingSecret }}
{{- $name := include "elastune.operatorKeysSecretName" . }}
{{- $keys := dict "proof-key" (include "elastune.generatedSecret" (list $ $name "proof-key" 48)) }}
{{- if eq (include "elastune.requestCredential" .) "true" }}
{{- $_ := set $keys "request-key" (include "elastune.generatedSecret" (list $ $name "request-key" 48)) }}
{{- end }}
{{- $_ := set $out $name $keys }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* `checksum/secrets` of a pod template: (list $ secretName...) -> sha256 over each Secret the pod
reads, in name order: "name:" and its data as JSON, or "name:external" for a Secret the chart does not
render (its changes are not seen here: restart the pods, or use a reloader). A changed password or key
changes the pod template, so the Deployment rolls its pods; an unchanged render leaves it alone. */}}
{{- define "elastune.secretsChecksum" -}}
{{- $root := index . 0 }}
{{- $managed := include "elastune.managedSecrets" $root | fromJson }}
{{- $lines := list }}
{{- range $name := rest . | uniq | sortAlpha }}
{{- $data := get $managed $name }}
{{- $lines = append $lines (printf "%s:%s" $name (ternary (toJson $data) "external" (not (empty $data)))) }}
{{- end }}
{{- join "\n" $lines | sha256sum }}
{{- end }}
