{{/* Names, labels and shared values of the kvroute chart. */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.router.fullname" -}}{{ include "kvroute.fullname" . | trunc 56 | trimSuffix "-" }}-router{{- end -}}
{{- define "kvroute.replica.fullname" -}}{{ include "kvroute.fullname" . | trunc 55 | trimSuffix "-" }}-replica{{- end -}}
{{- define "kvroute.redis.fullname" -}}{{ include "kvroute.fullname" . | trunc 57 | trimSuffix "-" }}-redis{{- end -}}
{{- define "kvroute.secret.name" -}}{{ default (include "kvroute.fullname" .) .Values.auth.existingSecret }}{{- end -}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.componentLabels" -}}
{{ include "kvroute.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The images: kvroute publishes none, so the chart names none (values.yaml says why). */}}
{{- define "kvroute.router.image" -}}
{{ required "router.image.repository is not set: kvroute publishes no image; build deploy/Dockerfile.router, push it to your registry and set router.image.repository (and tag), see deploy/README.md" .Values.router.image.repository }}:{{ default .Chart.AppVersion .Values.router.image.tag }}
{{- end -}}

{{- define "kvroute.replica.image" -}}
{{- if eq .Values.replica.engine "emulated" -}}
{{ include "kvroute.router.image" . }}
{{- else -}}
{{ required "replica.image.repository is not set: kvroute publishes no image; build deploy/Dockerfile.replica, push it to your registry and set replica.image.repository (and tag), see deploy/README.md" .Values.replica.image.repository }}:{{ default .Chart.AppVersion .Values.replica.image.tag }}
{{- end -}}
{{- end -}}

{{/* host:port of the replicas' headless service: one DNS A record per ready replica pod. */}}
{{- define "kvroute.replica.dnsName" -}}
{{ include "kvroute.replica.fullname" . }}.{{ .Release.Namespace }}.svc.cluster.local:8000
{{- end -}}

{{/* The Redis URL, when it is not read from an existing Secret; empty without Redis. */}}
{{- define "kvroute.redis.url" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "kvroute.redis.fullname" . }}:6379/0
{{- else -}}
{{- .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.redis.configured" -}}
{{- if or .Values.redis.enabled .Values.redis.externalUrl .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Whether the chart's Secret (or an existing one) holds any key. */}}
{{- define "kvroute.secret.used" -}}
{{- $a := .Values.auth -}}
{{- if or $a.existingSecret $a.apiKeys $a.adminToken $a.tenantSaltSecret $a.replicaApiKey $a.hfToken -}}true{{- end -}}
{{- end -}}

{{/* An env entry read from the kvroute Secret; optional, so an absent key leaves it unset. */}}
{{- define "kvroute.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvroute.secret.name" .ctx }}
      key: {{ .key }}
      optional: true
{{- end -}}

{{/* Whether the chart's Redis requires a password (redis.enabled and redis.auth.enabled). */}}
{{- define "kvroute.redis.auth" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled -}}true{{- end -}}
{{- end -}}

{{/* The Secret (and key) holding the chart's Redis password. */}}
{{- define "kvroute.redis.passwordSecret" -}}
{{- default (include "kvroute.redis.fullname" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* REDIS_PASSWORD from that Secret: Redis's requirepass, and the routers' and replicas' URL. */}}
{{- define "kvroute.redis.passwordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "kvroute.redis.passwordSecret" . | quote }}, key: {{ .Values.redis.auth.existingSecretKey | quote }}}
{{- end -}}

{{/* KVROUTE_REDIS_URL (a value, or a reference to an existing Secret) and the key prefix.  The
chart's Redis with a password: REDIS_PASSWORD first, then a URL Kubernetes expands it into. */}}
{{- define "kvroute.redis.urlEnv" -}}
{{- if .Values.redis.existingSecret -}}
- name: KVROUTE_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.existingSecret | quote }}, key: {{ .Values.redis.existingSecretKey | quote }}}
{{- else if include "kvroute.redis.auth" . -}}
{{ include "kvroute.redis.passwordEnv" . }}
- {name: KVROUTE_REDIS_URL, value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "kvroute.redis.fullname" .) | quote }}}
{{- else -}}
- {name: KVROUTE_REDIS_URL, value: {{ include "kvroute.redis.url" . | quote }}}
{{- end }}
- {name: KVROUTE_REDIS_KEY_PREFIX, value: {{ .Values.redis.keyPrefix | quote }}}
{{- end -}}

{{/* Where the routers find replicas, and where those publish KV events (router/fleet.py's
FleetSettings).  Bring your own vLLM (replica.enabled=false) needs at least one source. */}}
{{- define "kvroute.router.discoveryEnv" -}}
{{- $d := .Values.router.discovery -}}
{{- $ev := .Values.replica.kvEvents -}}
{{- $redis := and $d.redis (include "kvroute.redis.configured" .) -}}
{{- if .Values.replica.enabled -}}
{{- if $d.dnsName }}{{ fail "router.discovery.dnsName is for replica.enabled=false: the chart's replicas are found through their own headless Service" }}{{ end -}}
{{- if .Values.router.replicaTls.secretName }}{{ fail "router.replicaTls is for replicas that serve HTTPS (replica.enabled=false): the chart's own replicas serve plain HTTP" }}{{ end -}}
{{- if not $d.k8s.selector }}
# the chart's replicas: every ready pod behind their headless service (a selector replaces it)
- {name: KVROUTE_FLEET__DNS_NAME, value: {{ include "kvroute.replica.dnsName" . | quote }}}
{{- end }}
{{- else -}}
{{- if not (or $d.replicas $d.dnsName $d.k8s.selector $redis) -}}
{{- fail "replica.enabled=false (bring your own vLLM) needs router.discovery.dnsName (a headless Service), router.discovery.k8s.selector, router.discovery.replicas, or Redis registrations (router.discovery.redis with redis.enabled/externalUrl/existingSecret)" -}}
{{- end -}}
# bring your own vLLM: the replicas router.discovery names
{{- with $d.dnsName }}
- {name: KVROUTE_FLEET__DNS_NAME, value: {{ . | quote }}}
{{- end }}
{{- if .Values.router.replicaTls.secretName }}
# the replicas serve HTTPS (router.replicaTls): those found by DNS or the Kubernetes API too
- {name: KVROUTE_FLEET__DNS_SCHEME, value: https}
- {name: KVROUTE_FLEET__K8S_SCHEME, value: https}
{{- end }}
{{- end }}
{{- with $d.replicas }}
- {name: KVROUTE_REPLICAS, value: {{ join "," . | quote }}}
{{- end }}
{{- if $d.k8s.selector }}
- {name: KVROUTE_FLEET__K8S_SELECTOR, value: {{ $d.k8s.selector | quote }}}
- {name: KVROUTE_FLEET__K8S_NAMESPACE, value: {{ default .Release.Namespace $d.k8s.namespace | quote }}}
- {name: KVROUTE_FLEET__K8S_PORT_NAME, value: {{ $d.k8s.portName | quote }}}
{{- if $d.k8s.port }}
- {name: KVROUTE_FLEET__K8S_PORT, value: {{ $d.k8s.port | quote }}}
{{- end }}
{{- end }}
{{- if $redis }}
# registrations written by replica launchers carry their KV-event endpoints (and win)
- {name: KVROUTE_FLEET__DISCOVERY_REDIS, value: "true"}
{{- end }}
{{- if not $ev.enabled }}
# the replicas publish no KV events: route on predictions, subscribe to nothing
- {name: KVROUTE_KV_EVENTS, value: "false"}
{{- else }}
{{- /* 5557/5558 are the routers' own defaults for replicas without a registration */ -}}
{{- if ne (int $ev.port) 5557 }}
- {name: KVROUTE_FLEET__EVENTS_PORT, value: {{ $ev.port | quote }}}
{{- end }}
{{- if ne (int $ev.replayPort) 5558 }}
- {name: KVROUTE_FLEET__REPLAY_PORT, value: {{ $ev.replayPort | quote }}}
{{- end }}
{{- end }}
{{- end -}}

{{/* How routers follow KV events, in words (NOTES.txt). */}}
{{- define "kvroute.kvEventsMode" -}}
{{- $ev := .Values.replica.kvEvents -}}
{{- $redis := and .Values.router.discovery.redis (include "kvroute.redis.configured" .) -}}
{{- if not $ev.enabled -}}
none: replica.kvEvents.enabled=false, so the routers route on their own predictions only.
{{- else if and .Values.replica.enabled $redis (eq .Values.replica.engine "vllm") -}}
yes, through Redis registration: each vLLM replica's launcher registers its KV-event endpoints
(pod IP, ports {{ $ev.port }}/{{ $ev.replayPort }}) and every router subscribes to them.
{{- else -}}
yes, by convention: every router subscribes to tcp://<replica host>:{{ $ev.port }} (replay {{ $ev.replayPort }})
of each replica it finds{{ if $redis }}, unless a Redis registration names other endpoints{{ end }}.
A replica that publishes nothing there is detected and routed on predictions
(GET /admin/replicas says which; metric kvroute_kv_events_applied_total stays flat for it).
{{- end -}}
{{- end -}}

{{/* Redis's maxmemory in bytes: redis.maxmemoryPercent of redis.resources.limits.memory (a
Kubernetes quantity: plain bytes or a k, M, G, T, Ki, Mi, Gi or Ti suffix; the schema checks it). */}}
{{- define "kvroute.redis.maxmemory" -}}
{{- $limit := required "redis.resources.limits.memory is needed: it bounds Redis's maxmemory" .Values.redis.resources.limits.memory -}}
{{- $limit = ternary $limit (toString (int64 $limit)) (kindIs "string" $limit) -}}  {{- /* a number: bytes (YAML's are floats) */ -}}
{{- $number := regexFind "^[0-9]+" $limit -}}
{{- $unit := trimPrefix $number $limit -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if not (hasKey $units $unit) }}{{ fail (printf "redis.resources.limits.memory %q: use whole bytes or a k, M, G, T, Ki, Mi, Gi or Ti suffix" $limit) }}{{ end -}}
{{- div (mul (int64 $number) (get $units $unit) .Values.redis.maxmemoryPercent) 100 -}}
{{- end -}}

{{/* Pod-spec fields every pod of the chart takes from its component's values: the registries'
pull secrets, a priority class and topology spread constraints (one without labelSelector gets
the component's pod labels).  include with (dict "ctx" $ "component" "router" "values" $.Values.router). */}}
{{- define "kvroute.podExtras" -}}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  {{- $c := deepCopy . }}
  {{- if not (hasKey $c "labelSelector") }}
  {{- $_ := set $c "labelSelector" (dict "matchLabels" (include "kvroute.selectorLabels" (dict "ctx" $.ctx "component" $.component) | fromYaml)) }}
  {{- end }}
  - {{- toYaml $c | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Volume sources Pod Security "restricted" allows (values.schema.json's restrictedVolume). */}}
{{- define "kvroute.restrictedVolumeSources" -}}
configMap csi downwardAPI emptyDir ephemeral persistentVolumeClaim projected secret
{{- end -}}

{{/* A value of a Secret the chart makes: the one given, else the one the release's Secret already
holds (lookup, on upgrade), else 32 random characters drawn once per render and kept on the root
context, so that the Secret and the checksum of the pods reading it (kvroute.secretsChecksum) see
the same value: an install's checksum then equals the next upgrade's, and only a changed value
restarts pods.  include with (dict "ctx" $ "secret" NAME "key" KEY "given" VALUE). */}}
{{- define "kvroute.secretValue" -}}
{{- $value := .given -}}
{{- if not $value -}}
{{- with (lookup "v1" "Secret" .ctx.Release.Namespace .secret) -}}
{{- $value = index .data $.key | default "" | b64dec -}}
{{- end -}}
{{- end -}}
{{- if not $value -}}
{{- if not (hasKey .ctx "kvrouteDrawn") }}{{ $_ := set .ctx "kvrouteDrawn" dict }}{{ end -}}
{{- $drawn := get .ctx "kvrouteDrawn" -}}
{{- if not (hasKey $drawn .secret) }}{{ $_ := set $drawn .secret (randAlphaNum 32) }}{{ end -}}
{{- $value = get $drawn .secret -}}
{{- end -}}
{{- $value -}}
{{- end -}}

{{/* The Secrets the chart makes (templates/secret.yaml renders them; empty when not made). */}}
{{- define "kvroute.secret.auth" -}}
{{- $a := .Values.auth -}}
{{- if and (not $a.existingSecret) (include "kvroute.secret.used" .) -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ include "kvroute.secret.name" . }}
  labels:
    {{- include "kvroute.labels" . | nindent 4 }}
type: Opaque
stringData:
  {{- with $a.apiKeys }}
  api-keys: {{ join "," . | quote }}
  {{- end }}
  {{- with $a.adminToken }}
  admin-token: {{ . | quote }}
  {{- end }}
  {{- with $a.tenantSaltSecret }}
  tenant-salt-secret: {{ . | quote }}
  {{- end }}
  {{- with $a.replicaApiKey }}
  replica-api-key: {{ . | quote }}
  {{- end }}
  {{- with $a.hfToken }}
  hf-token: {{ . | quote }}
  {{- end }}
{{- end -}}
{{- end -}}

{{- define "kvroute.secret.registration" -}}
{{- if and (include "kvroute.registration.signed" .) (not .Values.registration.existingSecret) -}}
{{- $name := include "kvroute.registration.secretName" . -}}
{{- $key := .Values.registration.existingSecretKey -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvroute.labels" . | nindent 4 }}
type: Opaque
data:
  {{ $key }}: {{ include "kvroute.secretValue" (dict "ctx" . "secret" $name "key" $key "given" .Values.registration.secret) | b64enc | quote }}
{{- end -}}
{{- end -}}

{{- define "kvroute.secret.redis" -}}
{{- if and (include "kvroute.redis.auth" .) (not .Values.redis.auth.existingSecret) -}}
{{- $name := include "kvroute.redis.fullname" . -}}
{{- $key := .Values.redis.auth.existingSecretKey -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvroute.componentLabels" (dict "ctx" . "component" "redis") | nindent 4 }}
type: Opaque
data:
  {{ $key }}: {{ include "kvroute.secretValue" (dict "ctx" . "secret" $name "key" $key "given" .Values.redis.auth.password) | b64enc | quote }}
{{- end -}}
{{- end -}}

{{/* checksum/secret of a pod template: the sha256 of the Secrets named (auth, registration, redis)
as the chart renders them, so that a new value restarts the pods that read it at start.  A Secret
the chart does not make (an existingSecret) is not seen: restart those pods yourself.
include with (dict "ctx" $ "secrets" (list "auth" "registration")). */}}
{{- define "kvroute.secretsChecksum" -}}
{{- $texts := list -}}
{{- range .secrets }}{{ $texts = append $texts (include (printf "kvroute.secret.%s" .) $.ctx) }}{{ end -}}
{{- join "\n---\n" $texts | sha256sum -}}
{{- end -}}

{{/* Whether Redis registrations are signed: registration.signed, and the routers read
registrations (router.discovery.redis with a Redis).  Routers then believe only signed ones. */}}
{{- define "kvroute.registration.signed" -}}
{{- if and .Values.registration.signed .Values.router.discovery.redis (include "kvroute.redis.configured" .) -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.registration.secretName" -}}
{{- default (printf "%s-registration" (include "kvroute.fullname" .)) .Values.registration.existingSecret -}}
{{- end -}}

{{/* The registration secret as a file (never an environment value: it stays out of `env` dumps):
the env entry, the volume mount and the volume of a pod that signs or verifies registrations. */}}
{{- define "kvroute.registration.env" -}}
- {name: KVROUTE_REGISTRATION_SECRET_FILE, value: /etc/kvroute/registration/secret}
{{- end -}}

{{- define "kvroute.registration.mount" -}}
- {name: registration-secret, mountPath: /etc/kvroute/registration, readOnly: true}
{{- end -}}

{{- define "kvroute.registration.volume" -}}
- name: registration-secret
  secret:
    secretName: {{ include "kvroute.registration.secretName" . | quote }}
    items: [{key: {{ .Values.registration.existingSecretKey | quote }}, path: secret}]
{{- end -}}
