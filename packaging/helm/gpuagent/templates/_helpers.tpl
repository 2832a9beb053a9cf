{{/* Names, labels, image references and the TOML writer shared by the templates. */}}

{{- define "gpuagent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release> when it already contains the chart name, else <release>-<chart>; 50 characters leave room for
     the component suffix ("-collector-headless"). */}}
{{- define "gpuagent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 44 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries; "component" (agent, collector, npd) is added per object. */}}
{{- define "gpuagent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gpuagent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" . "component" "agent"). */}}
{{- define "gpuagent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuagent.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* metadata.labels of one component's objects: call with (dict "ctx" . "component" "agent"). */}}
{{- define "gpuagent.componentLabels" -}}
{{ include "gpuagent.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpuagent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpuagent.npdImage" -}}
{{- $repo := default .Values.image.repository .Values.npd.image.repository -}}
{{- printf "%s:%s" $repo (default (printf "%s-npd" .Chart.AppVersion) .Values.npd.image.tag) -}}
{{- end -}}

{{/* Where a component's pods run and what they pull with: call with (dict "ctx" . "pod" .Values.agent), where
     the component's values hold priorityClassName, nodeSelector, affinity and tolerations. */}}
{{- define "gpuagent.podPlacement" -}}
{{- with .pod.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Where agents send: collector.address, else this release's collector Service. */}}
{{- define "gpuagent.collectorAddress" -}}
{{- if .Values.collector.address -}}
{{- .Values.collector.address -}}
{{- else -}}
{{- printf "%s-collector.%s.svc:%d" (include "gpuagent.fullname" .) .Release.Namespace (int .Values.collector.grpcPort) -}}
{{- end -}}
{{- end -}}

{{/* One TOML value from a YAML scalar or a list of scalars: toJson writes strings with the escapes TOML basic
     strings share, numbers and booleans as TOML writes them, and a list of scalars as a TOML array. */}}
{{- define "gpuagent.tomlValue" -}}
{{- if kindIs "map" . -}}
{{- $parts := list -}}
{{- range $k, $v := . -}}
{{- $parts = append $parts (printf "%s = %s" (toJson (toString $k)) (include "gpuagent.tomlValue" $v)) -}}
{{- end -}}
{{- printf "{ %s }" (join ", " $parts) -}}
{{- else -}}
{{- toJson . -}}
{{- end -}}
{{- end -}}

{{/* A TOML table from a map: call with (dict "name" "storage" "table" .Values.collector.config.storage).
     Keys are quoted, so any key is written as given (the collector refuses one it does not know). */}}
{{- define "gpuagent.tomlTable" -}}
[{{ .name }}]
{{- range $k, $v := .table }}
{{ toJson (toString $k) }} = {{ include "gpuagent.tomlValue" $v }}
{{- end }}
{{- end -}}

{{/* Paths inside the containers: the TOML files and the agent's probes name the same ones. */}}
{{- define "gpuagent.tokenFile" -}}/etc/gpuagent/token/token{{- end -}}
{{- define "gpuagent.caFile" -}}/etc/gpuagent/tls-ca/ca.crt{{- end -}}
