{{/* Names, labels, and what the router's config implies for the objects around it. */}}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The pods' identity: Deployment, Service, PDB and the spread constraint select on it. */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "kvroute.labels" -}}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "true" for a loopback host (and for none: the router's default host is 127.0.0.1). */}}
{{- define "kvroute.loopback" -}}
{{- $host := . | default "127.0.0.1" | toString -}}
{{- if or (hasPrefix "127." $host) (eq $host "localhost") (eq $host "::1") -}}true{{- end -}}
{{- end -}}

{{/* The namespaces whose EndpointSlices `discovery: [{kind: kubernetes}]` watches, one a line. */}}
{{- define "kvroute.discoveryNamespaces" -}}
{{- $namespaces := list -}}
{{- range .Values.config.discovery -}}
{{- if eq (toString .kind) "kubernetes" -}}
{{- $namespaces = append $namespaces (.namespace | default $.Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- $namespaces | uniq | join "\n" -}}
{{- end -}}

{{- define "kvroute.rbacCreate" -}}
{{- if kindIs "invalid" .Values.rbac.create -}}
{{- if include "kvroute.discoveryNamespaces" . -}}true{{- end -}}
{{- else if .Values.rbac.create -}}true{{- end -}}
{{- end -}}

{{/* Every value of a key ending in .suffix anywhere in .node, one a line: `_env` keys
name a variable holding a secret, `_file` keys a file holding one. */}}
{{- define "kvroute.secretRefs" -}}
{{- $suffix := .suffix -}}
{{- if kindIs "map" .node -}}
{{- range $key, $value := .node -}}
{{- if and (hasSuffix $suffix $key) (kindIs "string" $value) -}}
{{ $value }}{{ "\n" }}
{{- else -}}
{{ include "kvroute.secretRefs" (dict "node" $value "suffix" $suffix) }}
{{- end -}}
{{- end -}}
{{- else if kindIs "slice" .node -}}
{{- range .node -}}{{ include "kvroute.secretRefs" (dict "node" . "suffix" $suffix) }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where a secretFiles entry is mounted. */}}
{{- define "kvroute.secretMount" -}}
{{- .mountPath | default (printf "/etc/kvroute-secrets/%s" .secretName) -}}
{{- end -}}

{{/* What the config has the router write, as JSON: [{key, path, dir}], `dir` being the
directory that must be writable (the file's, or capture.path itself). */}}
{{- define "kvroute.writtenPaths" -}}
{{- $config := .Values.config | default dict -}}
{{- $files := list -}}
{{- $jobs := $config.jobs | default dict -}}
{{- if and $jobs.enabled (eq (toString ($jobs.store | default "sqlite")) "sqlite") -}}
{{- $files = append $files (list "jobs.path" ($jobs.path | default "/var/lib/kvroute/jobs.db")) -}}
{{- end -}}
{{- $usage := $config.usage | default dict -}}
{{- if $usage.records -}}
{{- $files = append $files (list "usage.path" ($usage.path | default "/var/lib/kvroute/usage.db")) -}}
{{- end -}}
{{- $log := $config.access_log | default dict -}}
{{- $logging := true -}}
{{- if hasKey $log "enabled" }}{{ $logging = $log.enabled }}{{ end -}}
{{- if and $logging (ne (toString ($log.path | default "-")) "-") -}}
{{- $files = append $files (list "access_log.path" $log.path) -}}
{{- end -}}
{{- $written := list -}}
{{- range $files -}}
{{- $path := toString (index . 1) -}}
{{- $written = append $written (dict "key" (index . 0) "path" $path "dir" (dir $path)) -}}
{{- end -}}
{{- $capture := $config.capture | default dict -}}
{{- if $capture.enabled -}}
{{- $path := toString ($capture.path | default "/var/lib/kvroute/capture") -}}
{{- $written = append $written (dict "key" "capture.path" "path" $path "dir" (clean $path)) -}}
{{- end -}}
{{- toJson $written -}}
{{- end -}}

{{/* "true" if the writableVolumes entry .volume holds the directory .dir. */}}
{{- define "kvroute.holds" -}}
{{- $mount := clean (toString .volume.mountPath) -}}
{{- if or (eq .dir $mount) (hasPrefix (printf "%s/" $mount) .dir) -}}true{{- end -}}
{{- end -}}

{{/* The writableVolumes entries (their indices, as JSON) that hold a path the config
writes: only those are mounted. */}}
{{- define "kvroute.writableMounts" -}}
{{- $used := list -}}
{{- $written := include "kvroute.writtenPaths" . | fromJsonArray -}}
{{- range $i, $volume := .Values.writableVolumes -}}
{{- range $written -}}
{{- if include "kvroute.holds" (dict "volume" $volume "dir" .dir) -}}
{{- $used = append $used (toString $i) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $used | uniq | toJson -}}
{{- end -}}

{{/* Ports from the config, and whether each one is served off loopback. */}}
{{- define "kvroute.httpPort" -}}
{{- (.Values.config.listen | default dict).port | default 8000 -}}
{{- end -}}

{{- define "kvroute.grpcPort" -}}
{{- $grpc := .Values.config.grpc | default dict -}}
{{- if $grpc.enabled -}}{{ $grpc.port | default 50051 }}{{- end -}}
{{- end -}}

{{- define "kvroute.adminPort" -}}
{{- with .Values.config.admin -}}
{{- if not (include "kvroute.loopback" .host) -}}{{ .port | default 8001 }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Service port name Prometheus scrapes: /metrics is on the data port or the admin one. */}}
{{- define "kvroute.metricsPort" -}}
{{- if eq ((.Values.config.metrics | default dict).listen | default "data") "admin" -}}admin{{- else -}}http{{- end -}}
{{- end -}}

{{/* Fails the render on a config the pod cannot serve as the chart wires it. */}}
{{- define "kvroute.validate" -}}
{{- if include "kvroute.loopback" (.Values.config.listen | default dict).host -}}
{{- fail "config.listen.host is loopback: the kubelet's probes and the Service cannot reach it; set 0.0.0.0" -}}
{{- end -}}
{{- $grpc := .Values.config.grpc | default dict -}}
{{- if and $grpc.enabled $grpc.host (include "kvroute.loopback" $grpc.host) -}}
{{- fail "config.grpc.host is loopback: the Service cannot reach it; set 0.0.0.0 (or leave it unset)" -}}
{{- end -}}
{{- if and (eq (include "kvroute.metricsPort" .) "admin") (not (include "kvroute.adminPort" .)) -}}
{{- fail "config.metrics.listen is admin but config.admin.host is loopback: Prometheus cannot scrape it" -}}
{{- end -}}
{{- range $name := include "kvroute.secretRefs" (dict "node" .Values.config "suffix" "_env") | splitList "\n" | compact | uniq -}}
{{- if not (hasKey $.Values.secretEnv $name) -}}
{{- fail (printf "config names the variable %s (a *_env key): add secretEnv.%s: {secretName: ..., key: ...}" $name $name) -}}
{{- end -}}
{{- end -}}
{{- range $path := include "kvroute.secretRefs" (dict "node" .Values.config "suffix" "_file") | splitList "\n" | compact | uniq -}}
{{- $mounted := false -}}
{{- range $.Values.secretFiles -}}
{{- if hasPrefix (printf "%s/" (include "kvroute.secretMount" .)) $path -}}{{- $mounted = true -}}{{- end -}}
{{- end -}}
{{- if not $mounted -}}
{{- fail (printf "config names the file %s (a *_file key): mount its Secret with secretFiles: [{secretName: ..., mountPath: ...}] at a directory above it" $path) -}}
{{- end -}}
{{- end -}}
{{- range $written := include "kvroute.writtenPaths" . | fromJsonArray -}}
{{- if not (isAbs $written.path) -}}
{{- fail (printf "config.%s %s is a relative path: give an absolute one, under a writableVolumes mountPath" $written.key $written.path) -}}
{{- end -}}
{{- $held := false -}}
{{- range $.Values.writableVolumes -}}
{{- if include "kvroute.holds" (dict "volume" . "dir" $written.dir) -}}{{- $held = true -}}{{- end -}}
{{- end -}}
{{- $where := printf "writableVolumes: [{mountPath: %s}] (an emptyDir; claimName: an existing PersistentVolumeClaim to keep the files)" $written.dir -}}
{{- range list "/" "/tmp" "/etc/kvroute" -}}
{{- if or (eq $written.dir .) (hasPrefix (printf "%s/" .) $written.dir) -}}
{{- $where = "a directory of its own, e.g. /var/lib/kvroute, which the default writableVolumes mount (/ is read-only, /tmp the router's 64Mi scratch space, /etc/kvroute the config)" -}}
{{- end -}}
{{- end -}}
{{- if not $held -}}
{{- fail (printf "config.%s %s: the root filesystem is read-only and no writableVolumes entry holds %s; use %s" $written.key $written.path $written.dir $where) -}}
{{- end -}}
{{- end -}}
{{- end -}}
