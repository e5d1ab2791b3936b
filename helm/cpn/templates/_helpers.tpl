{{/* Names, labels and the small decisions shared by several templates. */}}

{{- define "cpn.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cpn.fullname" -}}
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

{{- define "cpn.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; pass a dict with "ctx" (the root) and "component". */}}
{{- define "cpn.labels" -}}
helm.sh/chart: {{ include "cpn.chart" .ctx }}
{{ include "cpn.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: cpn
{{- end }}

{{- define "cpn.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cpn.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Resource names per component (each at most 63 characters). */}}
{{- define "cpn.controlPlane.fullname" -}}
{{- printf "%s-control-plane" (include "cpn.fullname" . | trunc 49 | trimSuffix "-") }}
{{- end }}

{{- define "cpn.agent.fullname" -}}
{{- printf "%s-agent" (include "cpn.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "cpn.ray.fullname" -}}
{{- printf "%s-ray" (include "cpn.fullname" . | trunc 40 | trimSuffix "-") }}
{{- end }}

{{- define "cpn.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "cpn.controlPlane.serviceAccountName" -}}
{{- if .Values.controlPlane.serviceAccount.create }}
{{- default (include "cpn.controlPlane.fullname" .) .Values.controlPlane.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controlPlane.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cpn.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "cpn.agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cpn.adminToken.secretName" -}}
{{- default (printf "%s-admin-token" (include "cpn.fullname" . | trunc 50 | trimSuffix "-")) .Values.controlPlane.adminToken.existingSecret }}
{{- end }}

{{- define "cpn.ray.authSecretName" -}}
{{- default (printf "%s-auth" (include "cpn.ray.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{- define "cpn.sqlite.claimName" -}}
{{- default (printf "%s-data" (include "cpn.controlPlane.fullname" .)) .Values.controlPlane.database.persistence.existingClaim }}
{{- end }}

{{/* true when the control plane stores its state in SQLite on a volume. */}}
{{- define "cpn.usesSqlite" -}}
{{- if not .Values.controlPlane.database.existingSecret }}true{{ end }}
{{- end }}

{{/*
Refuses values the schema cannot express in a way that says why. The schema refuses the same
values first; these fails remain for installs that skip schema validation.
*/}}
{{- define "cpn.validate" -}}
{{- if and .Values.controlPlane.enabled (gt (int .Values.controlPlane.replicas) 1) (include "cpn.usesSqlite" .) }}
{{- fail (printf "controlPlane.replicas=%d needs PostgreSQL: set controlPlane.database.existingSecret to a Secret holding a postgresql+psycopg:// URL. The default SQLite database lives on a ReadWriteOnce volume that only one replica can open." (int .Values.controlPlane.replicas)) }}
{{- end }}
{{- if and .Values.agent.enabled (not .Values.agent.clusterName) }}
{{- fail "agent.clusterName is required when agent.enabled=true: set it to this cluster's name as registered in the control plane." }}
{{- end }}
{{- if and .Values.agent.enabled (not (regexMatch "^https?://[^/?#\\s]+(/[^?#\\s]*)?$" (default "" .Values.agent.controllerURL))) }}
{{- fail (printf "agent.controllerURL=%q is not an http(s) URL: set it to the control plane's URL as reachable from this cluster, e.g. https://cpn.example.com." (default "" .Values.agent.controllerURL)) }}
{{- end }}
{{- if and .Values.agent.enabled (not .Values.agent.tokenSecret) }}
{{- fail "agent.tokenSecret is required when agent.enabled=true: name a Secret holding this cluster's agent key (create the key with the admin API, then kubectl create secret generic)." }}
{{- end }}
{{- if not (or .Values.controlPlane.enabled .Values.agent.enabled .Values.ray.enabled) }}
{{- fail "nothing to install: enable controlPlane, agent or ray." }}
{{- end }}
{{- end }}

{{/* The Ray custom resource name of one datacenter cluster; pass dict "ctx" and "cluster". */}}
{{- define "cpn.ray.clusterResource" -}}
{{- if .ctx.Values.ray.clusterResource }}
{{- .ctx.Values.ray.clusterResource }}
{{- else }}
{{- printf "cpn-cluster-%s" .cluster }}
{{- end }}
{{- end }}

{{/* Environment that joins a Ray cluster with token authentication. */}}
{{- define "cpn.ray.authEnv" -}}
{{- if and .Values.ray.enabled .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "cpn.ray.authSecretName" . }}
      key: {{ .Values.ray.auth.existingSecretKey }}
{{- end }}
{{- end }}

{{/* CPN_DATABASE_URL: PostgreSQL from a Secret, or SQLite on the volume mounted at /data. */}}
{{- define "cpn.databaseEnv" -}}
{{- if include "cpn.usesSqlite" . }}
- name: CPN_DATABASE_URL
  value: sqlite:////data/cpn.db
{{- else }}
- name: CPN_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.controlPlane.database.existingSecret }}
      key: {{ .Values.controlPlane.database.existingSecretKey }}
{{- end }}
{{- end }}

{{/* Writable scratch for a read-only root filesystem (Python, Ray client, matplotlib). */}}
{{- define "cpn.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
{{- end }}

{{/* The agent's probe Service, and the URL other clusters' agents use to reach it. */}}
{{- define "cpn.agent.probeServiceName" -}}
{{- printf "%s-probe" (include "cpn.agent.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cpn.agent.advertiseURL" -}}
{{- if .Values.agent.advertiseURL }}
{{- .Values.agent.advertiseURL }}
{{- else }}
{{- printf "http://%s.%s.svc:%v" (include "cpn.agent.probeServiceName" .) .Release.Namespace .Values.agent.probe.service.port }}
{{- end }}
{{- end }}
