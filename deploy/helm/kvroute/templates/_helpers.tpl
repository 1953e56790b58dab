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

{{- define "kvroute.router.image" -}}
{{ .Values.router.image.repository }}:{{ default .Chart.AppVersion .Values.router.image.tag }}
{{- end -}}

{{- define "kvroute.replica.image" -}}
{{- if eq .Values.replica.engine "emulated" -}}
{{ include "kvroute.router.image" . }}
{{- else -}}
{{ .Values.replica.image.repository }}:{{ default .Chart.AppVersion .Values.replica.image.tag }}
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
