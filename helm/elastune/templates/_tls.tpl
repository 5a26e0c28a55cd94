{{- /*
TLS toward Redis (redis.tls) and from the gateway to the workers (gateway.workerTLS):
docs/operations/tls.md. The operator and the gateway mount the Redis CA (and the optional client
certificate) and name the files to elastune_common.tls through ELASTUNE_REDIS_CA_FILE & co.
*/ -}}

{{- define "elastune.redisTls" -}}
{{- if .Values.redis.tls.enabled }}
{{- if not .Values.redis.tls.caSecret }}
{{- fail "redis.tls.enabled needs redis.tls.caSecret (a Secret with ca.crt)" }}
{{- end }}
{{- if and .Values.redis.bundled.enabled (not .Values.redis.tls.certSecret) }}
{{- fail "redis.tls.enabled with the bundled Redis needs redis.tls.certSecret (tls.crt, tls.key)" }}
{{- end }}
{{- if and (not .Values.redis.bundled.enabled) (not (hasPrefix "rediss://" .Values.redis.url)) }}
{{- fail "redis.tls.enabled with an external Redis needs a rediss:// redis.url" }}
{{- end }}
{{- end }}
{{- .Values.redis.tls.enabled }}
{{- end }}

{{- /* The env entries of a Redis client container (operator, gateway). */ -}}
{{- define "elastune.redisTlsEnv" -}}
{{- if eq (include "elastune.redisTls" .) "true" }}
- name: ELASTUNE_REDIS_CA_FILE
  value: /var/run/elastune/redis-ca/ca.crt
{{- if .Values.redis.tls.clientCertSecret }}
- name: ELASTUNE_REDIS_CERT_FILE
  value: /var/run/elastune/redis-client/tls.crt
- name: ELASTUNE_REDIS_KEY_FILE
  value: /var/run/elastune/redis-client/tls.key
{{- end }}
{{- end }}
{{- end }}

{{- define "elastune.redisTlsMounts" -}}
{{- if eq (include "elastune.redisTls" .) "true" }}
- name: redis-ca
  mountPath: /var/run/elastune/redis-ca
  readOnly: true
{{- if .Values.redis.tls.clientCertSecret }}
- name: redis-client
  mountPath: /var/run/elastune/redis-client
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "elastune.redisTlsVolumes" -}}
{{- if eq (include "elastune.redisTls" .) "true" }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.tls.caSecret }}
    items: [{key: ca.crt, path: ca.crt}]
{{- if .Values.redis.tls.clientCertSecret }}
- name: redis-client
  secret:
    secretName: {{ .Values.redis.tls.clientCertSecret }}
{{- end }}
{{- end }}
{{- end }}

{{- define "elastune.workerTls" -}}
{{- $w := .Values.gateway.workerTLS }}
{{- if and $w.enabled (not $w.caSecret) }}
{{- fail "gateway.workerTLS.enabled needs gateway.workerTLS.caSecret (a Secret with ca.crt)" }}
{{- end }}
{{- $w.enabled }}
{{- end }}
