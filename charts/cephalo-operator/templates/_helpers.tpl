{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "cephalo.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name of every object (the release name alone when it contains the chart name). */}}
{{- define "cephalo.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cephalo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cephalo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "cephalo.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "cephalo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: cephalo
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "cephalo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cephalo.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create=false: name an existing ServiceAccount" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository[:tag][@digest]; the tag defaults to the chart's appVersion. */}}
{{- define "cephalo.imageRef" -}}
{{- $tag := default .root.Chart.AppVersion .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* kopf's flag for the log level. */}}
{{- define "cephalo.logFlag" -}}
{{- $flags := dict "warning" "--quiet" "verbose" "--verbose" "debug" "--debug" -}}
{{- get $flags .Values.logLevel -}}
{{- end -}}

{{/* Fail early, with the fix, on value combinations the schema cannot explain well. */}}
{{- define "cephalo.validate" -}}
{{- if and (eq .Values.rbac.scope "namespaced") (empty .Values.watchNamespaces) -}}
{{- fail "rbac.scope=namespaced needs watchNamespaces: list the namespaces whose CephaloJobs the operator handles (e.g. --set 'watchNamespaces={team-a}'), or use rbac.scope=cluster" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (empty .Values.watchNamespaces) -}}
{{- fail "networkPolicy.enabled needs watchNamespaces: the trainer pods' NetworkPolicies go into each namespace whose CephaloJobs the operator handles (e.g. --set 'watchNamespaces={team-a}')" -}}
{{- end -}}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) -}}
{{- fail (printf "metrics.port and health.port are both %v: the operator's /metrics and its /healthz need different ports" .Values.metrics.port) -}}
{{- end -}}
{{- with .Values.leaderElection -}}
{{- if not (gt (float64 .leaseDurationSeconds) (float64 .renewDeadlineSeconds)) -}}
{{- fail (printf "leaderElection.leaseDurationSeconds (%v) must be longer than leaderElection.renewDeadlineSeconds (%v): a leader must stop before a standby may take its lease" .leaseDurationSeconds .renewDeadlineSeconds) -}}
{{- end -}}
{{- if not (gt (float64 .renewDeadlineSeconds) (mulf 1.2 (float64 .retryPeriodSeconds))) -}}
{{- fail (printf "leaderElection.renewDeadlineSeconds (%v) must be longer than 1.2 x leaderElection.retryPeriodSeconds (%v): the leader needs time for a late renewal" .renewDeadlineSeconds .retryPeriodSeconds) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* jobPolicy.allowedTolerations as the operator reads them (CEPHALO_ALLOWED_TOLERATIONS):
key or key:effect, comma-separated. */}}
{{- define "cephalo.allowedTolerations" -}}
{{- $items := list -}}
{{- range .Values.jobPolicy.allowedTolerations -}}
{{- $items = append $items (ternary (printf "%s:%s" .key (.effect | default "")) .key (not (empty .effect))) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}
