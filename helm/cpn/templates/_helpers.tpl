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

{{/* An image reference; pass dict "repository", "tag" and "digest": a digest wins over the tag. */}}
{{- define "cpn.imageRef" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{/* The pull policy: the value when set; otherwise IfNotPresent for a digest (the content
cannot change) and Always for a tag (a moved tag is fetched again). Pass dict "policy", "digest". */}}
{{- define "cpn.pullPolicy" -}}
{{- if .policy }}{{ .policy }}{{ else if .digest }}IfNotPresent{{ else }}Always{{ end }}
{{- end }}

{{- define "cpn.image" -}}
{{- include "cpn.imageRef" (dict "repository" .Values.image.repository "tag" (default .Chart.AppVersion .Values.image.tag) "digest" .Values.image.digest) }}
{{- end }}

{{- define "cpn.imagePullPolicy" -}}
{{- include "cpn.pullPolicy" (dict "policy" .Values.image.pullPolicy "digest" .Values.image.digest) }}
{{- end }}

{{/* Ray nodes run the cpn image unless ray.image names another; image.digest pins it only
when ray.image names neither a repository nor a tag (it is the digest of the cpn image). */}}
{{- define "cpn.ray.imageDigest" -}}
{{- if .Values.ray.image.digest }}
{{- .Values.ray.image.digest }}
{{- else if not (or .Values.ray.image.repository .Values.ray.image.tag) }}
{{- .Values.image.digest }}
{{- end }}
{{- end }}

{{- define "cpn.ray.image" -}}
{{- $repository := default .Values.image.repository .Values.ray.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.ray.image.tag }}
{{- include "cpn.imageRef" (dict "repository" $repository "tag" $tag "digest" (include "cpn.ray.imageDigest" .)) }}
{{- end }}

{{- define "cpn.ray.imagePullPolicy" -}}
{{- include "cpn.pullPolicy" (dict "policy" (default .Values.image.pullPolicy .Values.ray.image.pullPolicy) "digest" (include "cpn.ray.imageDigest" .)) }}
{{- end }}

{{/*
checkov skip annotations of a cpn workload, each with its reason (checkov splits on "=", so
a reason has none). Pass dict "ctx" (the root) and "secretEnv" (true when the pod takes a
cpn secret through its environment).
*/}}
{{- define "cpn.checkovSkips" -}}
{{- $skips := list }}
{{- if not .ctx.Values.image.digest }}
{{- $skips = append $skips "CKV_K8S_43=image.digest is empty: the cpn image is built from the repository's Dockerfile by whoever installs the chart, so no digest can ship with it. Set image.digest to pin the image." }}
{{- end }}
{{- if .secretEnv }}
{{- $skips = append $skips "CKV_K8S_35=cpn reads CPN_ADMIN_TOKEN, CPN_DATABASE_URL and CPN_AGENT_TOKEN only from its environment: each is a secretKeyRef to a Secret, never an inline value. The Ray token is a mounted file." }}
{{- end }}
{{- range $i, $skip := $skips }}
checkov.io/skip{{ add1 $i }}: {{ $skip | quote }}
{{- end }}
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

{{/* Joining a Ray cluster with token authentication: the token is a file from the Secret
(RAY_AUTH_TOKEN_PATH), so it never sits in the pod's environment. Each renders nothing
without Ray token auth. */}}
{{- define "cpn.ray.authDir" -}}/var/run/secrets/cpn/ray{{- end }}

{{- define "cpn.ray.authEnv" -}}
{{- if and .Values.ray.enabled .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN_PATH
  value: {{ include "cpn.ray.authDir" . }}/auth_token
{{- end }}
{{- end }}

{{- define "cpn.ray.authMount" -}}
{{- if and .Values.ray.enabled .Values.ray.auth.enabled }}
- name: ray-auth
  mountPath: {{ include "cpn.ray.authDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "cpn.ray.authVolume" -}}
{{- if and .Values.ray.enabled .Values.ray.auth.enabled }}
- name: ray-auth
  secret:
    secretName: {{ include "cpn.ray.authSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.ray.auth.existingSecretKey }}
        path: auth_token
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

{{/* true when the ServiceMonitor is rendered (the Prometheus operator's API is present). */}}
{{- define "cpn.serviceMonitor.enabled" -}}
{{- if and .Values.controlPlane.enabled .Values.controlPlane.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}true{{ end }}
{{- end }}

{{/* NetworkPolicy pieces. */}}

{{/* The egress rule every pod needs: DNS over UDP and TCP. No selectors: any address on 53. */}}
{{- define "cpn.networkPolicy.dnsEgress" -}}
{{- if .Values.networkPolicy.dns }}
- to:
    {{- toYaml .Values.networkPolicy.dns | nindent 4 }}
  ports:
{{- else }}
- ports:
{{- end }}
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}

{{/* Peers that are cpn agents, in any namespace of this Kubernetes cluster. */}}
{{- define "cpn.networkPolicy.agentPeer" -}}
- namespaceSelector: {}
  podSelector:
    matchLabels:
      app.kubernetes.io/part-of: cpn
      app.kubernetes.io/component: agent
{{- end }}

{{/* An egress rule to TCP ports; pass dict "ports" (a list) and "to" (peers; empty: any address). */}}
{{- define "cpn.networkPolicy.egressTo" -}}
{{- if .to }}
- to:
    {{- toYaml .to | nindent 4 }}
  ports:
{{- else }}
- ports:
{{- end }}
    {{- range .ports }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- end }}

{{/* The TCP port of a URL or address: the explicit one, else "default". Pass dict "url", "default". */}}
{{- define "cpn.portOf" -}}
{{- $hostport := regexReplaceAll "[/?#].*$" (regexReplaceAll "^[a-z]+://" .url "") "" }}
{{- $port := regexFind ":[0-9]+$" $hostport | trimPrefix ":" }}
{{- default .default $port }}
{{- end }}

{{/* The port of agent.controllerURL: explicit, or 443 for https and 80 for http. */}}
{{- define "cpn.agent.controllerPort" -}}
{{- include "cpn.portOf" (dict "url" .Values.agent.controllerURL "default" (ternary "443" "80" (hasPrefix "https://" .Values.agent.controllerURL))) }}
{{- end }}

{{/* The port of controlPlane.rayAddress: explicit, or Ray's client port 10001 for ray://
and the GCS port 6379 for a plain address. */}}
{{- define "cpn.controlPlane.rayPort" -}}
{{- include "cpn.portOf" (dict "url" .Values.controlPlane.rayAddress "default" (ternary "10001" "6379" (hasPrefix "ray://" .Values.controlPlane.rayAddress))) }}
{{- end }}

{{/* The pods of this release's RayCluster: head and workers. */}}
{{- define "cpn.networkPolicy.raySelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "cpn.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [ray-head, ray-worker]
{{- end }}

{{/* Checkpoints in an object store (controlPlane.checkpoints.uri): its settings as the AWS_*
variables the S3 client reads, for every process that writes checkpoints (the control plane and
the Ray workers). Renders nothing with checkpoints on a volume. */}}
{{- define "cpn.checkpointStoreEnv" -}}
{{- $ck := .Values.controlPlane.checkpoints }}
{{- if $ck.uri }}
{{- with $ck.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $ck.region }}
- name: AWS_REGION
  value: {{ . | quote }}
{{- end }}
{{- with $ck.credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}
{{- end }}

{{/* Ray workers write checkpoints where the control plane reads them: with a claim (and no
object store) they mount it at the control plane's path. Each renders nothing otherwise. */}}
{{- define "cpn.checkpointMount" -}}
{{- $ck := .Values.controlPlane.checkpoints }}
{{- if and $ck.persistentVolumeClaim (not $ck.uri) }}
- name: checkpoints
  mountPath: {{ $ck.mountPath | quote }}
{{- end }}
{{- end }}

{{- define "cpn.checkpointVolume" -}}
{{- $ck := .Values.controlPlane.checkpoints }}
{{- if and $ck.persistentVolumeClaim (not $ck.uri) }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ $ck.persistentVolumeClaim | quote }}
{{- end }}
{{- end }}
