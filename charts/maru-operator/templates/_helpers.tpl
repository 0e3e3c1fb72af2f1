{{/*
Names are truncated to 63 characters because Kubernetes label values and DNS-1123 labels
(Service names among them) may not be longer; the trailing "-" a cut can leave is trimmed,
since a name must end with an alphanumeric character.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "maru-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's objects: fullnameOverride, else "<release>-<chart>", or just the
release name when it already contains the chart name (so "maru-operator" stays "maru-operator").
*/}}
{{- define "maru-operator.fullname" -}}
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

{{/* "<chart>-<version>" for the helm.sh/chart label ("+" is not allowed in label values). */}}
{{- define "maru-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the operator pod; never change them in an upgrade (selectors are immutable). */}}
{{- define "maru-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "maru-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object of the chart. */}}
{{- define "maru-operator.labels" -}}
helm.sh/chart: {{ include "maru-operator.chart" . }}
{{ include "maru-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: maru
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "maru-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "maru-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Images: one registry (images.registry) for the operator, the CSI plugin and, through the operator's
--image-* flags, every pool, vLLM and router image it writes; each can be overridden on its own.
*/}}
{{- define "maru-operator.registry" -}}
{{- .Values.images.registry | trimSuffix "/" }}
{{- end }}

{{/* The tag of the operator, pool and vllm images: images.tag, else the chart's appVersion. */}}
{{- define "maru-operator.imageTag" -}}
{{- .Values.images.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The operator image: repository:tag, or repository:tag@digest. */}}
{{- define "maru-operator.image" -}}
{{- $repository := .Values.image.repository | default (printf "%s/maru-operator" (include "maru-operator.registry" .)) }}
{{- $tag := .Values.image.tag | default (include "maru-operator.imageTag" .) }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" $repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}
{{- end }}

{{/* The CSI node plugin's image, the pool image: csiDriver.image.repository, else images.pool, else the registry's. */}}
{{- define "maru-operator.csiImage" -}}
{{- $image := .Values.csiDriver.image }}
{{- $tag := $image.tag | default (include "maru-operator.imageTag" .) }}
{{- if $image.repository }}
{{- printf "%s:%s" $image.repository $tag }}
{{- else if .Values.images.pool }}
{{- .Values.images.pool }}
{{- else }}
{{- printf "%s/maru-pool:%s" (include "maru-operator.registry" .) $tag }}
{{- end }}
{{- end }}

{{/*
An upstream CSI sidecar's image, from a dict of the chart context ("root") and the sidecar's values
("sidecar", "name"): its repository, else registry.k8s.io/sig-storage/<name> while images.registry is the
chart's default, else <images.registry>/<name>, so a private registry moves every image of the chart.
*/}}
{{- define "maru-operator.csiSidecarImage" -}}
{{- $image := .sidecar.image }}
{{- $repository := $image.repository }}
{{- if not $repository }}
{{- if eq (include "maru-operator.registry" .root) "ghcr.io/maru-pd" }}
{{- $repository = printf "registry.k8s.io/sig-storage/%s" .name }}
{{- else }}
{{- $repository = printf "%s/%s" (include "maru-operator.registry" .root) .name }}
{{- end }}
{{- end }}
{{- printf "%s:%s" $repository $image.tag }}
{{- end }}

{{/*
Namespaces that get a Role when watchNamespaces is set: the watched ones (InferenceGroups and
their children) plus the release namespace (the pool daemons run there), without duplicates.
*/}}
{{- define "maru-operator.roleNamespaces" -}}
{{- $namespaces := concat (list .Release.Namespace) .Values.watchNamespaces | uniq }}
{{- toJson $namespaces }}
{{- end }}

{{/* The metrics Service: a Service name is a DNS-1035 label, so the suffix must fit in 63 characters too. */}}
{{- define "maru-operator.metricsServiceName" -}}
{{- printf "%s-metrics" (include "maru-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
Refuse a second release serving the same operator instance: both would reconcile the same MaruPools
and InferenceGroups. Every release annotates its ClusterRole with its instance; `lookup` reads the
cluster at install time (it is empty under `helm template`, and without rbac.create).
*/}}
{{- define "maru-operator.checkInstance" -}}
{{- $fullname := include "maru-operator.fullname" . }}
{{- range (lookup "rbac.authorization.k8s.io/v1" "ClusterRole" "" "").items }}
{{- $annotations := .metadata.annotations | default dict }}
{{- if and (hasKey $annotations "maru.io/operator-instance") (ne .metadata.name $fullname) }}
{{- if eq (get $annotations "maru.io/operator-instance") $.Values.instance }}
{{- fail (printf "release %s in namespace %s already runs a maru-operator serving instance %q (ClusterRole %s): give this release another `instance` (and label its MaruPools and InferenceGroups maru.io/operator-instance=<instance>)" (get $annotations "meta.helm.sh/release-name" | default "?") (get $annotations "meta.helm.sh/release-namespace" | default "?") $.Values.instance .metadata.name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The CSI driver's name. Fixed, not a value: the operator writes it into every vLLM pod's socket volume
(maru_contracts.csi.DRIVER_NAME), and a test checks the two agree.
*/}}
{{/* The routers' ClusterRole: one per operator instance (the operator's rbac.router_role_name()). */}}
{{- define "maru-operator.routerClusterRole" -}}
{{- if .Values.instance }}maru-operator-{{ .Values.instance }}-router{{ else }}maru-operator-router{{ end }}
{{- end }}

{{- define "maru-operator.csiDriverName" -}}
csi.maru.io
{{- end }}

{{/* The CSI node plugin's DaemonSet and ServiceAccount: "<fullname>-csi-node", within 63 characters. */}}
{{- define "maru-operator.csiNodeName" -}}
{{- printf "%s-csi-node" (include "maru-operator.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* Labels that select the CSI node plugin's pods; never change them in an upgrade. */}}
{{- define "maru-operator.csiNodeSelectorLabels" -}}
app.kubernetes.io/name: {{ include "maru-operator.name" . }}-csi-node
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of the CSI driver's objects: the chart's, with their own name and component. */}}
{{- define "maru-operator.csiNodeLabels" -}}
helm.sh/chart: {{ include "maru-operator.chart" . }}
{{ include "maru-operator.csiNodeSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/component: csi-node
app.kubernetes.io/part-of: maru
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}
