{{/* ---------- names and labels ---------- */}}

{{- define "gyre.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/*
Resource name prefix; at most 40 characters so "<prefix>-inference-headless" stays a valid DNS label.
A longer one keeps its first 31 characters and adds 8 of its sha256: two releases that differ only after
character 31 still get different names.
*/}}
{{- define "gyre.fullname" -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- $full = .Release.Name -}}
{{- else -}}
{{- $full = printf "%s-%s" .Release.Name $name -}}
{{- end -}}
{{- end -}}
{{- $full = $full | trimSuffix "-" -}}
{{- if gt (len $full) 40 -}}
{{- printf "%s-%s" ($full | trunc 31 | trimSuffix "-") ($full | sha256sum | trunc 8) -}}
{{- else -}}
{{- $full -}}
{{- end -}}
{{- end -}}

{{- define "gyre.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. Call with (dict "root" $ "component" "inference"). */}}
{{- define "gyre.labels" -}}
helm.sh/chart: {{ include "gyre.chart" .root }}
{{ include "gyre.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: gyre
{{- end -}}

{{/* Selector labels: instance + component (never the version, selectors are immutable). */}}
{{- define "gyre.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gyre.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "gyre.runId" -}}
{{- .Values.experiment.run_id | default .Release.Name -}}
{{- end -}}

{{- define "gyre.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "gyre.fullname" .)) -}}
{{- end -}}

{{- define "gyre.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-data" (include "gyre.fullname" .)) -}}
{{- end -}}

{{/* In-cluster DNS name of a Service of this release: (dict "root" $ "service" "orchestrator"). */}}
{{- define "gyre.serviceHost" -}}
{{- printf "%s-%s.%s.svc.%s" (include "gyre.fullname" .root) .service .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* Label on the one Service per component that its ServiceMonitor scrapes (never a second Service: no double series). */}}
{{- define "gyre.scrapeLabel" -}}
gyre.dev/scrape: {{ .component | quote }}
{{- end -}}

{{/* ---------- images, placement, security ---------- */}}

{{- define "gyre.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion -}}
image: {{ printf "%s:%s" .image.repository $tag | quote }}
imagePullPolicy: {{ .image.pullPolicy | default "IfNotPresent" }}
{{- end -}}

{{/*
nodeSelector / tolerations / affinity of a component: its node pool's, plus its own; and its
priorityClassName / schedulerName (gang schedulers such as Volcano or Kueue's).
Call with (dict "root" $ "component" .Values.inference).
*/}}
{{- define "gyre.placement" -}}
{{- $pools := .root.Values.nodePools -}}
{{- $poolName := .component.nodePool -}}
{{- if not (hasKey $pools $poolName) -}}
{{- fail (printf "nodePool %q is not defined in nodePools (defined: %s)" $poolName (keys $pools | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $pool := get $pools $poolName -}}
{{- $selector := merge (deepCopy (.component.nodeSelector | default dict)) ($pool.nodeSelector | default dict) -}}
{{- $tolerations := concat ($pool.tolerations | default list) (.component.tolerations | default list) -}}
{{- $affinity := .component.affinity | default $pool.affinity -}}
{{- with $selector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .component.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .component.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end -}}

{{/* Pod security context (Pod Security Standards "restricted"). Call with (dict "user" 10001 "group" 10001 "fsGroup" 10001). */}}
{{- define "gyre.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .user }}
  runAsGroup: {{ .group }}
  fsGroup: {{ .fsGroup }}
  fsGroupChangePolicy: OnRootMismatch
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "gyre.containerSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "gyre.gyrePodSecurityContext" -}}
{{- $s := .Values.podSecurity -}}
{{ include "gyre.podSecurityContext" (dict "user" $s.runAsUser "group" $s.runAsGroup "fsGroup" $s.fsGroup) }}
{{- end -}}

{{/* ---------- volumes and environment shared by the Gyre containers ---------- */}}

{{/* Writable places on a read-only root filesystem: /tmp, caches and (GPU pods) a memory-backed /dev/shm. */}}
{{/* Call with (dict "root" $ "component" .Values.inference "shmSize" "2Gi"). */}}
{{- define "gyre.volumes" -}}
- name: experiment
  configMap:
    name: {{ include "gyre.fullname" .root }}-experiment
- name: data
  persistentVolumeClaim:
    claimName: {{ include "gyre.claimName" .root }}
- name: tmp
  emptyDir: {}
- name: cache
  {{- with .component.cacheSize }}
  emptyDir:
    sizeLimit: {{ . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- if .shmSize }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- end }}
{{- with .component.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gyre.volumeMounts" -}}
- name: experiment
  mountPath: /etc/gyre
  readOnly: true
- name: data
  mountPath: {{ .root.Values.persistence.mountPath }}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .shmSize }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- with .component.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Where libraries put caches: all under the /cache emptyDir (the root filesystem is read-only). */}}
{{- define "gyre.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /cache/inductor
- name: VLLM_CACHE_ROOT
  value: /cache/vllm
- name: MPLCONFIGDIR
  value: /cache/matplotlib
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* A key of the release's Secret as an env var: (dict "root" $ "name" "GYRE_AUTH__API_KEY" "key" "api-key"). */}}
{{- define "gyre.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "gyre.secretName" .root }}
      key: {{ .key }}
{{- end -}}

{{/*
GYRE_REDIS__URL (the services' `redis.url`, no credentials) and GYRE_REDIS__PASSWORD from the Secret:
the password never appears in the pod spec or a ConfigMap, and needs no URL escaping (a password
with @ / % : would break a URL it was spliced into).
*/}}
{{- define "gyre.redisEnv" -}}
{{- $ext := .Values.redis.external -}}
{{- if $ext.url }}
{{- if $ext.existingSecret }}
- name: GYRE_REDIS__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ $ext.passwordKey }}
{{- end }}
- name: GYRE_REDIS__URL
  value: {{ $ext.url | quote }}
{{- else }}
{{ include "gyre.secretEnv" (dict "root" . "name" "GYRE_REDIS__PASSWORD" "key" "redis-password") }}
- name: GYRE_REDIS__URL
  value: {{ printf "redis://%s:%d/0" (include "gyre.serviceHost" (dict "root" . "service" "redis")) (int .Values.redis.port) | quote }}
{{- end }}
{{- end -}}

{{/*
A container's resources: the component's requests/limits plus `count` GPUs of its resource name
(`<component>.gpuResourceName`, default `gpu.resourceName`). Call with (dict "root" $ "component" $v "count" 2).
*/}}
{{- define "gyre.resources" -}}
{{- $res := deepCopy (.component.resources | default dict) -}}
{{- if gt (int .count) 0 -}}
{{- $name := .component.gpuResourceName | default .root.Values.gpu.resourceName -}}
{{- $gpu := dict $name (toString .count) -}}
{{- $_ := set $res "requests" (merge (deepCopy ($res.requests | default dict)) $gpu) -}}
{{- $_ := set $res "limits" (merge (deepCopy ($res.limits | default dict)) $gpu) -}}
{{- end -}}
{{- with $res }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* ---------- the experiment file ---------- */}}

{{/* Path of the model every service loads: the generated one, or experiment.model.name. */}}
{{- define "gyre.modelPath" -}}
{{- printf "%s/model" (.Values.persistence.mountPath | trimSuffix "/") -}}
{{- end -}}

{{/*
One TOML value. Numbers go through toJson, which prints integral floats as integers (Helm reads every
number as a float; `toToml` would write `batch_size = 4.0`); JSON strings, numbers and booleans are
valid TOML. Maps become inline tables, lists arrays.
*/}}
{{- define "gyre.tomlValue" -}}
{{- if kindIs "map" . -}}
{ {{- $first := true }}{{ range $k, $v := . }}{{ if not (kindIs "invalid" $v) }}{{ if not $first }}, {{ end }}{{ $first = false }}{{ include "gyre.tomlKey" $k }} = {{ include "gyre.tomlValue" $v }}{{ end }}{{ end -}} }
{{- else if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "gyre.tomlValue" $v }}{{ end }}]
{{- else -}}
{{ toJson . }}
{{- end -}}
{{- end -}}

{{- define "gyre.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/* A TOML table body: scalars first, then [sub.tables]. Null values are left out (= the default). */}}
{{- define "gyre.tomlTable" -}}
{{- $prefix := .prefix -}}
{{- range $k, $v := .table }}
{{- if and (not (kindIs "map" $v)) (not (kindIs "invalid" $v)) }}
{{ include "gyre.tomlKey" $k }} = {{ include "gyre.tomlValue" $v }}
{{- end }}
{{- end }}
{{- range $k, $v := .table }}
{{- if and (kindIs "map" $v) $v }}

[{{ $prefix }}{{ include "gyre.tomlKey" $k }}]
{{- include "gyre.tomlTable" (dict "prefix" (printf "%s%s." $prefix (include "gyre.tomlKey" $k)) "table" $v) }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "gyre.experimentToml" -}}
{{- $exp := deepCopy .Values.experiment -}}
{{- $_ := set $exp "run_id" (include "gyre.runId" .) -}}
{{- if and .Values.modelInit.enabled (($exp.model | default dict).name) -}}
{{- fail "experiment.model.name must stay unset when modelInit.enabled (the services load the generated model)" -}}
{{- end -}}
{{- if and (not .Values.modelInit.enabled) (not (($exp.model | default dict).name)) -}}
{{- fail "set experiment.model.name (a hub id or a path on the shared volume), or enable modelInit" -}}
{{- end -}}
# Experiment {{ include "gyre.runId" . }} (release {{ .Release.Name }}). Each service reads its table:
#   gyre <service> @ /etc/gyre/experiment.toml#<service>
# Addresses, ports, the shared volume, Redis and secrets are set on the command line by the chart.
{{- include "gyre.tomlTable" (dict "prefix" "" "table" $exp) }}
{{- end -}}

{{/* torchrun processes per trainer pod. */}}
{{- define "gyre.trainerNproc" -}}
{{- $t := .Values.trainer -}}
{{- if gt (int $t.nprocPerNode) 0 -}}{{ $t.nprocPerNode }}{{- else if gt (int $t.gpusPerNode) 0 -}}{{ $t.gpusPerNode }}{{- else -}}1{{- end -}}
{{- end -}}

{{/* monitoring.coreos.com objects: "true" when enabled, or auto and the cluster serves that kind. */}}
{{- define "gyre.monitoringFor" -}}
{{- $mode := .root.Values.monitoring.enabled -}}
{{- if eq (toString $mode) "auto" -}}
{{- if .root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind) -}}true{{- end -}}
{{- else if $mode -}}true{{- end -}}
{{- end -}}

{{/*
The trainer job's identity: 8 hex of the sha256 of everything that shapes it (the experiment file and
the trainer values). It ends the torchrun rendezvous id, so pods of two configurations can never
rendezvous into one job.
*/}}
{{- define "gyre.trainerJobHash" -}}
{{- printf "%s\n%s" (include "gyre.experimentToml" .) (toJson .Values.trainer) | sha256sum | trunc 8 -}}
{{- end -}}

{{/* Multi-run (`runs`): the trainer's `runs` list as JSON (each run's folder, orchestrator and own keys). */}}
{{- define "gyre.trainerRuns" -}}
{{- $out := list }}
{{- range $run := .Values.runs }}
{{- $host := include "gyre.serviceHost" (dict "root" $ "service" (printf "orchestrator-%s" $run.name)) }}
{{- $entry := dict "name" $run.name "output_dir" (printf "%s/runs/%s" $.Values.persistence.mountPath $run.name) "orchestrator" (dict "address" (printf "%s:%d" $host (int $.Values.orchestrator.grpcPort))) }}
{{- with $run.maxSteps }}{{ $_ := set $entry "max_steps" (int .) }}{{ end }}
{{- $out = append $out (merge $entry ($run.trainer | default dict)) }}
{{- end }}
{{- toJson $out -}}
{{- end -}}

{{- define "gyre.runNames" -}}
{{- $names := list }}
{{- range $run := .Values.runs }}{{ $names = append $names $run.name }}{{ end }}
{{- toJson $names -}}
{{- end -}}

{{/* lora.max_loras for the runs' adapters (gyre.config.inference.loras_for_runs): one per run on the torch
backend, two on vLLM (a request keeps the adapter version it started with, so a run's old and new versions
overlap after each swap). */}}
{{- define "gyre.runsMaxLoras" -}}
{{- $backend := ((.Values.experiment.inference | default dict).backend) | default "torch" }}
{{- mul (len .Values.runs) (ternary 2 1 (eq $backend "vllm")) | toString -}}
{{- end -}}

{{/* "true" for one run publishing LoRA adapters (trainer.lora.publish = adapter) to the vLLM backend, which
serves them only with LoRA on (gyre.launcher.served_adapter_versions does the same for `gyre rl`). */}}
{{- define "gyre.vllmAdapterVersions" -}}
{{- $e := .Values.experiment }}
{{- $lora := ($e.trainer | default dict).lora | default dict }}
{{- $backend := ($e.inference | default dict).backend | default "torch" }}
{{- if and (not .Values.runs) (eq $backend "vllm") (eq ($lora.publish | default "merged") "adapter") }}true{{ end }}
{{- end -}}

{{/* The largest adapter rank of any run (a run's trainer.lora.rank, else experiment.trainer.lora.rank, else 16). */}}
{{- define "gyre.runsMaxRank" -}}
{{- $default := int ((((.Values.experiment.trainer | default dict).lora | default dict).rank) | default 16) }}
{{- $max := 0 }}
{{- range $run := .Values.runs }}
{{- $rank := int ((((($run.trainer | default dict).lora) | default dict).rank) | default $default) }}
{{- $max = max $max $rank }}
{{- end }}
{{- $max | toString -}}
{{- end -}}
