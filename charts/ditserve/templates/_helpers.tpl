{{/* Names, labels and the image reference shared by every template. */}}

{{- define "ditserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ditserve.fullname" -}}
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

{{- define "ditserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: pass (dict "ctx" $ "component" "operator"). */}}
{{- define "ditserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ditserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ditserve.labels" -}}
{{ include "ditserve.selectorLabels" . }}
helm.sh/chart: {{ include "ditserve.chart" .ctx }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: ditserve
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "ditserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ditserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ditserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The restricted Pod Security container context (the operator and the daemon). */}}
{{- define "ditserve.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "ditserve.cachectlServiceAccountName" -}}
{{- if .Values.cachectl.serviceAccount.create -}}
{{- default (printf "%s-cachectl" (include "ditserve.fullname" .)) .Values.cachectl.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.cachectl.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Whether the daemon reports NodeCache objects (it then needs a token and its RBAC). */}}
{{- define "ditserve.nodeStatus" -}}
{{- if and .Values.cachectl.enabled .Values.cachectl.nodeStatus.enabled -}}true{{- end -}}
{{- end -}}
