{{- define "kvcached-engine.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvcached-engine.fullname" -}}
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

{{- define "kvcached-engine.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvcached-engine.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvcached-engine.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvcached-engine.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: engine
app.kubernetes.io/part-of: kvcached
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.kvcached.tenant }}
kvcached.io/tenant: {{ . }}
{{- end }}
{{- end -}}

{{/*
The pieces any pod needs to reach kvcached, for this chart and for other charts (a parent chart
that lists this one as a dependency may include them). Each takes the "kvcached" values map:
  volumes:      {{ include "kvcached-engine.volume" .Values.kvcached | nindent 8 }}
  volumeMounts: {{ include "kvcached-engine.volumeMount" .Values.kvcached | nindent 12 }}
  env:          {{ include "kvcached-engine.env" .Values.kvcached | nindent 12 }}
*/}}
{{- define "kvcached-engine.socketDir" -}}
{{- $root := trimSuffix "/" .socketsHostPath -}}
{{- if .tenant -}}
{{- printf "%s/tenants/%s" $root .tenant -}}
{{- else -}}
{{- printf "%s/agent" $root -}}
{{- end -}}
{{- end -}}

{{- define "kvcached-engine.socketPath" -}}
{{- printf "%s/agent.sock" (trimSuffix "/" .mountPath) -}}
{{- end -}}

{{- define "kvcached-engine.volume" -}}
# The node directory of ONE agent socket (the default one, or one tenant's): connect() needs
# write permission on the socket file, not a writable mount, so it is mounted read-only.
- name: kvcached
  hostPath:
    path: {{ include "kvcached-engine.socketDir" . }}
    type: {{ .hostPathType }}
{{- end -}}

{{- define "kvcached-engine.volumeMount" -}}
- name: kvcached
  mountPath: {{ .mountPath }}
  readOnly: true
{{- end -}}

{{- define "kvcached-engine.env" -}}
# Read by both plug-ins when their configuration names no socket.
- name: KVCACHED_AGENT_SOCKET
  value: {{ include "kvcached-engine.socketPath" . }}
{{- end -}}

{{/*
The plug-ins' settings (docs/engines.md, "Settings (both engines)").
*/}}
{{- define "kvcached-engine.pluginSettings" -}}
{{- $s := dict "socket" (include "kvcached-engine.socketPath" .) "timeout_s" .timeoutS -}}
{{- with .namespace }}{{ $_ := set $s "namespace" . }}{{ end -}}
{{- toJson $s -}}
{{- end -}}

{{/*
vLLM: --kv-transfer-config, the KvcachedConnector in both roles.
*/}}
{{- define "kvcached-engine.vllmKvTransferConfig" -}}
{{- toJson (dict
      "kv_connector" "KvcachedConnector"
      "kv_connector_module_path" "kvcached_agent.engines.vllm_connector"
      "kv_role" "kv_both"
      "kv_load_failure_policy" "recompute"
      "kv_connector_extra_config" (include "kvcached-engine.pluginSettings" . | fromJson)) -}}
{{- end -}}

{{/*
SGLang: --hicache-storage-backend-extra-config of the "dynamic" backend, zero-copy (interface_v1).
*/}}
{{- define "kvcached-engine.sglangStorageConfig" -}}
{{- $c := dict
      "backend_name" "kvcached"
      "module_path" "kvcached_agent.engines.sglang_storage"
      "class_name" "KvcachedStorage"
      "interface_v1" 1 -}}
{{- toJson (merge $c (include "kvcached-engine.pluginSettings" . | fromJson)) -}}
{{- end -}}
