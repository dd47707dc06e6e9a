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

{{/* Labels of every object. Call with (dict "root" $ "component" "inference"), plus "own" (labels the object adds
after these, e.g. a ServiceMonitor's `monitoring.additionalLabels`: they win over `commonLabels`). */}}
{{- define "gyre.labels" -}}
helm.sh/chart: {{ include "gyre.chart" .root }}
{{ include "gyre.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: gyre
{{- include "gyre.commonLabels" . }}
{{- end -}}

{{/* `commonLabels` but the keys in "own" (an object's or pod's own labels, written after: one key twice is a
YAML error). */}}
{{- define "gyre.commonLabels" -}}
{{- $common := dict -}}
{{- $own := .own | default dict -}}
{{- range $key, $value := .root.Values.commonLabels | default dict -}}
{{- if not (hasKey $own $key) }}{{ $_ := set $common $key $value }}{{ end -}}
{{- end -}}
{{- with $common }}
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{/*
Labels of a pod template: the selector labels and nothing that changes with the chart version (no
helm.sh/chart, no app.kubernetes.io/version): a `helm upgrade` to a new chart version then replaces pods
only when their spec changes (a new image, a changed experiment), never for a label alone. Then `commonLabels`
and the component's `podLabels` ("own"), which win.
*/}}
{{- define "gyre.podLabels" -}}
{{ include "gyre.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: gyre
{{- include "gyre.commonLabels" . }}
{{- with .own }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: instance + component (never the version, selectors are immutable). */}}
{{- define "gyre.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gyre.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/*
Redis's maxmemory: `redis.maxmemory`, else 75% of the container's memory limit in bytes (the rest for the
append-only file's rewrite and client buffers), else nothing (no limit).
*/}}
{{- define "gyre.redisMaxmemory" -}}
{{- $v := .Values.redis -}}
{{- $limit := ((($v.resources | default dict).limits | default dict).memory | default "") | toString -}}
{{- if $v.maxmemory -}}
{{- $v.maxmemory -}}
{{- else if $limit -}}
{{- $bytes := include "gyre.quantity" (dict "value" $limit "key" "redis.resources.limits.memory (or set redis.maxmemory)") -}}
{{- mulf (float64 $bytes) 0.75 | floor | int64 -}}
{{- end -}}
{{- end -}}

{{/*
A Kubernetes quantity ("1.5Gi", "500m", "8", 2e9) as a number of its base unit (bytes, cores), for
comparisons and sums. Call with (dict "value" "16Gi" "key" "the value's key, named when it is unreadable").
*/}}
{{- define "gyre.quantity" -}}
{{- $q := toString .value -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?" $q -}}
{{- $units := dict "" 1 "m" 0.001 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 -}}
{{- $unit := trimPrefix $number $q -}}
{{- if or (not $number) (not (hasKey $units $unit)) -}}
{{- fail (printf "%s: cannot read %q as a quantity (e.g. 2Gi, 500m)" .key $q) -}}
{{- end -}}
{{- mulf (float64 $number) (get $units $unit) -}}
{{- end -}}

{{- define "gyre.runId" -}}
{{- .Values.experiment.run_id | default .Release.Name -}}
{{- end -}}

{{/*
The model the release's run trains, as recorded on its experiment ConfigMap (annotation gyre.dev/model):
the generated one's recipe with modelInit, else experiment.model.name.
*/}}
{{- define "gyre.modelIdentity" -}}
{{- if .Values.modelInit.enabled -}}
gyre model init --preset {{ .Values.modelInit.preset }} --seed {{ .Values.modelInit.seed }}
{{- else -}}
{{ include "gyre.policyModel" . }}
{{- end -}}
{{- end -}}

{{/* The annotations that record the run on the objects that outlive a pod (gyre.validateImmutable). */}}
{{- define "gyre.runRecord" -}}
gyre.dev/run-id: {{ include "gyre.runId" . | quote }}
gyre.dev/model: {{ include "gyre.modelIdentity" . | quote }}
gyre.dev/claim: {{ include "gyre.claimName" . | quote }}
{{- end -}}

{{- define "gyre.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "gyre.fullname" .)) -}}
{{- end -}}

{{- define "gyre.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-data" (include "gyre.fullname" .)) -}}
{{- end -}}

{{/*
Name of one object of this release, `<fullname>-<component>`: (dict "root" $ "component" "orchestrator-alpha").
A Service name is a DNS label (at most 63 characters); `<fullname>` stays within 40, but a run's or a
server's own name can take it further: a longer name keeps its first 54 characters and adds 8 hex of its
sha256 (as gyre.fullname does), so every object of a run or server still gets a valid, distinct name.
*/}}
{{- define "gyre.componentName" -}}
{{- $full := printf "%s-%s" (include "gyre.fullname" .root) .component -}}
{{- if gt (len $full) 63 -}}
{{- printf "%s-%s" ($full | trunc 54 | trimSuffix "-") ($full | sha256sum | trunc 8) -}}
{{- else -}}
{{- $full -}}
{{- end -}}
{{- end -}}

{{/* In-cluster DNS name of a Service of this release: (dict "root" $ "service" "orchestrator"). */}}
{{- define "gyre.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "gyre.componentName" (dict "root" .root "component" .service)) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* Label on the one Service per component that its ServiceMonitor scrapes (never a second Service: no double series). */}}
{{- define "gyre.scrapeLabel" -}}
gyre.dev/scrape: {{ .component | quote }}
{{- end -}}

{{/* ---------- images, placement, security ---------- */}}

{{/* `repository@sha256:...` when `image.digest` is set (the tag is then ignored), else `repository:tag`. */}}
{{- define "gyre.image" -}}
{{- $ref := printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion) -}}
{{- with .image.digest }}{{ $ref = printf "%s@%s" $.image.repository . }}{{ end -}}
image: {{ $ref | quote }}
imagePullPolicy: {{ .image.pullPolicy | default "IfNotPresent" }}
{{- end -}}

{{/*
nodeSelector / tolerations / affinity of a component: its node pool's, plus its own; its
topologySpreadConstraints (with "spread", the workload's selector labels, as the labelSelector of a constraint
that has none); and its priorityClassName / schedulerName (gang schedulers such as Volcano or Kueue's).
Call with (dict "root" $ "component" .Values.inference "spread" (dict ...)); without "spread" (the `helm test`
pod) no spread.
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
{{- with .component.topologySpreadConstraints }}
{{- if $.spread }}
topologySpreadConstraints:
  {{- range $constraint := . }}
  {{- $constraint = deepCopy $constraint }}
  {{- if not $constraint.labelSelector }}
  {{- /* no labelSelector of its own: the pods of this workload, which is what a spread is nearly always of */}}
  {{- $_ := set $constraint "labelSelector" (dict "matchLabels" $.spread) }}
  {{- end }}
  - {{ $constraint | toYaml | nindent 4 | trim }}
  {{- end }}
{{- end }}
{{- end }}
{{- with .component.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .component.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end -}}

{{/*
The init every container of a Gyre image runs as PID 1, before its command: `tini` (in the images, from the
distribution's package). A process that is PID 1 of its PID namespace reaps every orphan re-parented to it
(an environment's tool subprocesses, compile workers, a probe's children): `gyre` as PID 1 never waits for
them, and the zombies piled up to the pids limit. The kernel also drops a signal sent to a PID 1 that has no
handler for it: the `sh -c` wait loops of the init containers ignored SIGTERM and held a deleted pod for its
whole grace period. tini forwards SIGTERM to the command (which stops as it documents; exit code as the
command's, 128 + n when a signal ended it). `-s`: it still reaps as a subreaper where it is not PID 1 (a pod
given `shareProcessNamespace`, `docker run --init`). Each container keeps its own PID namespace: the
containers of a pod cannot see (or signal) each other's processes.
*/}}
{{- define "gyre.init" -}}
tini, -s, --
{{- end -}}

{{/* Pod security context (Pod Security Standards "restricted"). Call with (dict "user" 10001 "group" 10001 "fsGroup" 10001);
"sharePids" true for a pod whose image has no init of its own (Redis: redis-server as PID 1 reaps only the
children it forked): the pod's pause container is then PID 1 and reaps the orphans. */}}
{{- define "gyre.podSecurityContext" -}}
{{- if .sharePids }}
shareProcessNamespace: true
{{- end }}
securityContext:
  runAsNonRoot: true
  {{- /* a null (absent) id is left to the platform: OpenShift's restricted SCC assigns the namespace's */}}
  {{- with .user }}
  runAsUser: {{ . }}
  {{- end }}
  {{- with .group }}
  runAsGroup: {{ . }}
  {{- end }}
  {{- with .fsGroup }}
  fsGroup: {{ . }}
  {{- end }}
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

{{/*
The command of the chart's init containers (`model-fetch`, `model-init`, `wait-for-model`): files/init.py under
tini, which logs every line as the services log theirs (`experiment.log`: with `json`, one JSON object per line,
`service` the container's name; give the container gyre.logEnv). Call with (dict "root" $ "container" "model-fetch"
"action" "fetch" "runId" "…"), runId empty for the release's run id; the action's arguments follow in `args`.
*/}}
{{- define "gyre.initCommand" -}}
command: [{{ include "gyre.init" .root }}, python3, -c]
args:
  - {{ .root.Files.Get "files/init.py" | toJson }}
  - {{ .container }}
  - {{ .runId | default (include "gyre.runId" .root) | quote }}
  - {{ .action }}
{{- end -}}

{{/*
Resources of the chart's own short-lived containers: the init containers ("modelFetch", "modelInit",
"waitForModel": `initResources.<name>`) and the `helm test` pod ("tests": `tests.resources`), merged key by key
over their defaults. The defaults live here, not in values.yaml, so that `helm upgrade --reuse-values` (the
previous chart's values, which lack these keys) still gets them. wait-for-model: Python with Gyre's logging peaks
near 60 MiB in JSON mode (it imports transformers to route its warnings). Call with (dict "root" $ "name" "modelFetch").
*/}}
{{- define "gyre.auxResources" -}}
{{- $defaults := dict
  "modelFetch" (dict "requests" (dict "cpu" "500m" "memory" "512Mi") "limits" (dict "memory" "2Gi"))
  "modelInit" (dict "requests" (dict "cpu" "500m" "memory" "1Gi") "limits" (dict "memory" "4Gi"))
  "waitForModel" (dict "requests" (dict "cpu" "10m" "memory" "64Mi") "limits" (dict "memory" "256Mi"))
  "tests" (dict "requests" (dict "cpu" "50m" "memory" "64Mi") "limits" (dict "memory" "256Mi")) -}}
{{- $own := dict -}}
{{- if eq .name "tests" -}}
{{- $own = (.root.Values.tests | default dict).resources | default dict -}}
{{- else -}}
{{- $own = get (.root.Values.initResources | default dict) .name | default dict -}}
{{- end -}}
{{- $key := ternary "tests.resources" (printf "initResources.%s" .name) (eq .name "tests") -}}
{{- /* gyre.resources: a request above its limit is refused naming the value */ -}}
{{- include "gyre.resources" (dict "root" .root "key" $key "count" 0 "component" (dict "resources" (merge (deepCopy $own) (get $defaults .name)))) -}}
{{- end -}}

{{/* ---------- volumes and environment shared by the Gyre containers ---------- */}}

{{/*
Writable places on a read-only root filesystem: /tmp, /cache (compilation caches), the model cache
(`modelCache`: inference and trainer pods loading a hub model) and (GPU pods) a memory-backed /dev/shm; plus the experiment file and
the secrets as files. Call with (dict "root" $ "component" .Values.inference "shmSize" "2Gi"
"secretKeys" (list "api-key") "modelCache" true).
*/}}
{{- define "gyre.volumes" -}}
- name: experiment
  configMap:
    name: {{ include "gyre.fullname" .root }}-experiment
{{- with include "gyre.secretsVolume" (dict "root" .root "keys" .secretKeys) | trim }}
{{ . }}
{{- end }}
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
{{- if .modelCache }}
{{- $mc := .root.Values.modelCache }}
- name: model-cache
  {{- if eq $mc.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "gyre.modelCacheClaim" .root }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ $mc.size }}
  {{- end }}
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
{{- if include "gyre.secretSources" (dict "root" .root "keys" .secretKeys) | trim }}
{{ include "gyre.secretsMount" . }}
{{- end }}
- name: data
  mountPath: {{ .root.Values.persistence.mountPath }}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .modelCache }}
- name: model-cache
  mountPath: {{ include "gyre.modelCacheDir" . }}
{{- end }}
{{- if .shmSize }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- with .component.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* ---------- the model cache (hub downloads) ---------- */}}

{{/* Where hub models are downloaded (HF_HOME): the model cache volume of inference and trainer pods. */}}
{{- define "gyre.modelCacheDir" -}}/cache/huggingface{{- end -}}

{{- define "gyre.modelCacheClaim" -}}
{{- .Values.modelCache.existingClaim | default (printf "%s-model-cache" (include "gyre.fullname" .)) -}}
{{- end -}}

{{/* "true" when a model name is a hub id (`org/name`, not a path), which the fetch init container downloads first. */}}
{{- define "gyre.isHubId" -}}
{{- if regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$" (toString .) }}true{{ end -}}
{{- end -}}

{{/* The policy's model name: experiment.model.name (empty with modelInit, whose model is gyre.modelPath). */}}
{{- define "gyre.policyModel" -}}
{{- ((.Values.experiment.model | default dict).name) | default "" -}}
{{- end -}}

{{/* "true" when the policy's services load a hub model. */}}
{{- define "gyre.hubModel" -}}
{{- if not .Values.modelInit.enabled }}{{ include "gyre.isHubId" (include "gyre.policyModel" .) }}{{ end -}}
{{- end -}}

{{/* Environment of the containers loading a hub model: the hub token's file, if any; offline once fetched. */}}
{{- define "gyre.hubEnv" -}}
{{- if .root.Values.modelCache.tokenSecret }}
- name: HF_TOKEN_PATH
  value: {{ printf "%s/hf-token" (include "gyre.secretsDir" .) | quote }}
{{- end }}
{{- if .offline }}
# model-fetch downloaded the model: load it from the cache, never ask the hub again
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end -}}

{{/*
The `model-fetch` init container of inference, server and trainer pods loading a hub model (`model`):
downloads it into the model cache once, or fails at once, with the sizes in its message (`kubectl describe
pod`), when it cannot fit, instead of a pod evicted mid-download and starting over. Call like gyre.volumes,
plus "model".
*/}}
{{- define "gyre.modelFetch" -}}
{{- $mc := .root.Values.modelCache -}}
- name: model-fetch
  {{- include "gyre.image" (dict "root" .root "image" .component.image) | nindent 2 }}
  {{- include "gyre.initCommand" (dict "root" .root "container" "model-fetch" "action" "fetch" "runId" .runId) | nindent 2 }}
    - --name
    - {{ .model | quote }}
    - --cache-dir
    - {{ include "gyre.modelCacheDir" . }}
    {{- if ne $mc.type "pvc" }}
    # the emptyDir's sizeLimit: the filesystem under it is the node's disk, which says nothing of the limit
    - --max-size
    - {{ include "gyre.bytes" $mc.size | quote }}
    {{- end }}
    - --size-setting
    - modelCache.size
  env:
    {{- include "gyre.cacheEnv" . | nindent 4 }}
    {{- include "gyre.logEnv" .root | nindent 4 }}
    {{- include "gyre.hubEnv" (dict "root" .root) | nindent 4 }}
    {{- with .component.env }}
    # The component's own, as its main container gets them: this container is the one that reaches the hub (a
    # mirror's HF_ENDPOINT, HTTPS_PROXY / NO_PROXY, a CA bundle's REQUESTS_CA_BUNDLE); the service loads offline.
    {{- toYaml . | nindent 4 }}
    {{- end }}
  terminationMessagePolicy: FallbackToLogsOnError
  {{- include "gyre.containerSecurityContext" . | nindent 2 }}
  {{- include "gyre.auxResources" (dict "root" .root "name" "modelFetch") | nindent 2 }}
  volumeMounts:
    {{- if include "gyre.secretSources" (dict "root" .root "keys" .secretKeys) | trim }}
    {{- include "gyre.secretsMount" . | nindent 4 }}
    {{- end }}
    - name: tmp
      mountPath: /tmp
    - name: model-cache
      mountPath: {{ include "gyre.modelCacheDir" . }}
    {{- with .component.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/*
The init containers of a pod serving a model with `gyre inference` (the policy's replicas, `servers`):
`model-fetch` for a hub model (`modelCache`), `wait-for-model` for the model trainer pod 0 creates
(`waitForModel`: modelInit). Empty when neither. Call like gyre.volumes, plus "model" and "waitForModel".
*/}}
{{- define "gyre.servingInitContainers" -}}
{{- if or .modelCache .waitForModel }}
initContainers:
  {{- if .modelCache }}
  {{- include "gyre.modelFetch" . | nindent 2 }}
  {{- end }}
  {{- if .waitForModel }}
  # The model is created once by trainer pod 0 (it appears atomically: written aside, then renamed);
  # starting before it exists would crash the server once.
  - name: wait-for-model
    {{- include "gyre.image" (dict "root" .root "image" .component.image) | nindent 4 }}
    {{- include "gyre.initCommand" (dict "root" .root "container" "wait-for-model" "action" "wait" "runId" .runId) | nindent 4 }}
    env:
      - name: MODEL_DIR
        value: {{ include "gyre.modelPath" .root }}
      # Python's and its libraries' home (they import transformers in JSON mode) on the writable /tmp
      - name: HOME
        value: /tmp
      {{- include "gyre.logEnv" .root | nindent 6 }}
    {{- include "gyre.containerSecurityContext" . | nindent 4 }}
    {{- include "gyre.auxResources" (dict "root" .root "name" "waitForModel") | nindent 4 }}
    volumeMounts:
      - name: data
        mountPath: {{ .root.Values.persistence.mountPath }}
        readOnly: true
      - name: tmp
        mountPath: /tmp
  {{- end }}
{{- end }}
{{- end -}}

{{/*
How long a stopping `gyre inference` lets requests in flight finish (`server.shutdown_grace_s`), from its
pod's terminationGracePeriodSeconds less its preStop wait (the kubelet counts both in the grace): all of it but
10 s (a half, under 20 s) for unloading the engine and closing the servers before the kubelet's SIGKILL. The
server's own 30 s cut long generations short in the chart's 60 s, and outlived a shorter grace period. Call with
the component's values.
*/}}
{{- define "gyre.servingShutdownGrace" -}}
{{- $grace := sub (int .terminationGracePeriodSeconds) (int (.preStopSeconds | default 0)) -}}
{{- if ge $grace 20 }}{{ sub $grace 10 }}{{ else }}{{ div $grace 2 }}{{ end -}}
{{- end -}}

{{/*
The preStop wait of a `gyre inference` container: on a pod's deletion the kubelet's SIGTERM and the endpoints'
removal race, and the server closes its port at SIGTERM, so for the seconds kube-proxy and the Service's other
clients take to drop the pod, new connections through the Service were refused (a rolling update or a scale-down
failed API calls). Sleeping first keeps it serving until they have. Call with (dict "v" $v "key" "inference").
*/}}
{{- define "gyre.servingLifecycle" -}}
{{- $wait := int (.v.preStopSeconds | default 0) -}}
{{- if ge $wait (int .v.terminationGracePeriodSeconds) -}}
{{- fail (printf "%s.preStopSeconds (%d) must be below its terminationGracePeriodSeconds (%d): the kubelet counts the wait in the grace period, and the requests in flight need the rest" .key $wait (int .v.terminationGracePeriodSeconds)) -}}
{{- end -}}
{{- if gt $wait 0 }}
lifecycle:
  preStop:
    exec:
      command: [sleep, {{ $wait | toString | quote }}]
{{- end -}}
{{- end -}}

{{/*
progressDeadlineSeconds of a Deployment of `gyre inference` replicas: the value, else the startup probe's
budget (model loading) plus 10 min for scheduling, the image pull and a hub model's download. Call with the
component's values.
*/}}
{{- define "gyre.servingProgressDeadline" -}}
{{- if .progressDeadlineSeconds -}}
{{- .progressDeadlineSeconds | int -}}
{{- else -}}
{{- add (mul (int .startupProbe.periodSeconds) (int .startupProbe.failureThreshold)) 600 -}}
{{- end -}}
{{- end -}}

{{/*
The `--timeout` (seconds) a `helm install/upgrade --wait` of the release needs: the longest a workload may take to
turn ready without Kubernetes calling it failed. Every Deployment of replicas (the policy's, each server's:
gyre.servingProgressDeadline) and the trainer (its startup probe's budget: rendezvous, model loading, the
checkpoint's restore; plus 10 min for scheduling, the image pull and a hub model's download). Helm's own 5 min
failed a release whose model still loaded, and `--atomic` then uninstalled it or rolled it back.
*/}}
{{- define "gyre.helmWaitTimeout" -}}
{{- $inference := .Values.inference -}}
{{- $longest := int (include "gyre.servingProgressDeadline" $inference) -}}
{{- range $s := .Values.servers -}}
{{- $probe := merge (deepCopy ($s.startupProbe | default dict)) $inference.startupProbe -}}
{{- $own := dict "progressDeadlineSeconds" ($s.progressDeadlineSeconds | default $inference.progressDeadlineSeconds) "startupProbe" $probe -}}
{{- $longest = max $longest (int (include "gyre.servingProgressDeadline" $own)) -}}
{{- end -}}
{{- $trainer := .Values.trainer.startupProbe -}}
{{- max $longest (add (mul (int $trainer.periodSeconds) (int $trainer.failureThreshold)) 600) -}}
{{- end -}}

{{/*
The PodDisruptionBudget of a Deployment of `gyre inference` replicas: a drain takes at most
`maxUnavailable` of them at once. Call with (dict "root" $ "component" "inference" "maxUnavailable" 1).
*/}}
{{- define "gyre.servingPdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "gyre.componentName" . }}
  labels:
    {{- include "gyre.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .maxUnavailable }}
  selector:
    matchLabels:
      {{- include "gyre.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/*
A Kubernetes quantity ("20Gi", "500M", "1073741824") as bytes; the chart adds sizes up for the
ephemeral-storage request and hands the model cache's size to `gyre model fetch`.
*/}}
{{- define "gyre.bytes" -}}
{{- $q := toString . -}}
{{- $m := regexFindAll "^([0-9]+)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$" $q -1 -}}
{{- if not $m -}}{{- fail (printf "cannot read %q as a size (use e.g. 20Gi, 500Mi)" $q) -}}{{- end -}}
{{- $num := regexFind "^[0-9]+" $q | int64 -}}
{{- $unit := trimPrefix (toString $num) $q -}}
{{- $factors := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 -}}
{{- mul $num (get $factors $unit) -}}
{{- end -}}

{{/*
The ephemeral-storage a pod's main container requests: its /cache limit plus an emptyDir model cache,
so the scheduler places the pod only on a node with that much free disk (kubelet evicts a pod whose
emptyDir outgrows its sizeLimit). Empty when nothing is limited. Call like gyre.volumes.
*/}}
{{- define "gyre.ephemeralStorage" -}}
{{- $total := 0 -}}
{{- with .component.cacheSize }}{{ $total = add $total (include "gyre.bytes" . | int64) }}{{ end -}}
{{- if and .modelCache (ne .root.Values.modelCache.type "pvc") }}{{ $total = add $total (include "gyre.bytes" .root.Values.modelCache.size | int64) }}{{ end -}}
{{- if gt (int64 $total) 0 -}}
{{- if eq (mod $total 1073741824 | int64) 0 }}{{ div $total 1073741824 }}Gi{{ else if eq (mod $total 1048576 | int64) 0 }}{{ div $total 1048576 }}Mi{{ else }}{{ $total }}{{ end -}}
{{- end -}}
{{- end -}}

{{/*
Where libraries put caches: all under the /cache emptyDir (the root filesystem is read-only). Every Python
container gets the common ones; the compiler caches only where torch compiles (the inference and trainer
services: Triton, Inductor) and vLLM's only where vLLM runs (`gyre inference`), so no pod carries settings
nothing in it reads (tests/chart/test_options_read.py). Call with (dict "root" $ "torch" true "vllm" true),
or with the root context alone for the common ones.
*/}}
{{- define "gyre.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: MPLCONFIGDIR
  value: /cache/matplotlib
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .torch }}
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /cache/inductor
{{- end }}
{{- if .vllm }}
- name: VLLM_CACHE_ROOT
  value: /cache/vllm
{{- end }}
{{- end -}}

{{/*
The experiment's shared logging settings (`experiment.log`: level, format) for a container that does not read
the experiment file (`servers`): the services that do get them from it. `log.file` is a path on the runs'
volume, which those pods do not mount.
*/}}
{{- define "gyre.logEnv" -}}
{{- $log := .Values.experiment.log | default dict -}}
{{- if $log.level }}
- name: GYRE_LOG__LEVEL
  value: {{ $log.level | quote }}
{{- end }}
{{- if $log.format }}
- name: GYRE_LOG__FORMAT
  value: {{ $log.format | quote }}
{{- end }}
{{- end -}}

{{/* ---------- secrets: files, never environment variables ---------- */}}

{{/*
Where a pod finds its secrets: one file per key (`api-key`, `control-token`, `redis-password`), from the
`secrets` volume. Environment variables would reach every child process (reward and environment code
included), crash reports and `kubectl describe`; files are read once by the services (`<key>_file`
settings, docs/kubernetes.md "Secrets").
*/}}
{{- define "gyre.secretsDir" -}}/run/secrets/gyre{{- end -}}

{{/* "true" when the services have a Redis password: the chart's Redis, or an external one with a Secret. */}}
{{- define "gyre.redisHasPassword" -}}
{{- if or (not .Values.redis.external.url) .Values.redis.external.existingSecret }}true{{ end -}}
{{- end -}}

{{/*
The `secrets` volume of a pod: keys `keys` of the release's Secret (or `secrets.existingSecret`) as files
named after the key; `redis-password` comes from `redis.external.existingSecret` with an external Redis,
`hf-token` from `modelCache.tokenSecret`. No volume at all when none of the keys has a source (a projected
volume needs sources). Call with (dict "root" $ "keys" (list "api-key" "redis-password")).
*/}}
{{- define "gyre.secretsVolume" -}}
{{- with include "gyre.secretSources" . | trim }}
- name: secrets
  projected:
    defaultMode: 0440
    sources:
      {{- . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* The projected sources of gyre.secretsVolume, one Secret each (empty when none). Same call. */}}
{{- define "gyre.secretSources" -}}
{{- $ext := .root.Values.redis.external -}}
{{- $mc := .root.Values.modelCache -}}
{{- $own := list -}}
{{- range .keys }}{{ if and (ne . "hf-token") (or (ne . "redis-password") (not $ext.url)) }}{{ $own = append $own . }}{{ end }}{{ end -}}
{{- with $own }}
- secret:
    name: {{ include "gyre.secretName" $.root }}
    items:
      {{- range . }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
{{- end }}
{{- if and (has "redis-password" .keys) $ext.url $ext.existingSecret }}
- secret:
    name: {{ $ext.existingSecret }}
    items:
      - {key: {{ $ext.passwordKey }}, path: redis-password}
{{- end }}
{{- if and (has "hf-token" .keys) $mc.tokenSecret }}
- secret:
    name: {{ $mc.tokenSecret }}
    items:
      - {key: {{ $mc.tokenKey }}, path: hf-token}
{{- end }}
{{- end -}}

{{/*
A live object of the release's namespace, as JSON: `{}` when there is none or no cluster to ask (`helm
template`, `--dry-run`). The chart's one `lookup` (tests replace it to play an upgrade).
Call with (dict "root" $ "apiVersion" "v1" "kind" "Secret" "name" "exp-gyre-secrets").
*/}}
{{- define "gyre.live" -}}
{{- lookup .apiVersion .kind .root.Release.Namespace .name | default dict | toJson -}}
{{- end -}}

{{/* The live Secret `name` (gyre.live). Call with (dict "root" $ "name" "exp-gyre-secrets"). */}}
{{- define "gyre.liveSecret" -}}
{{- include "gyre.live" (dict "root" .root "apiVersion" "v1" "kind" "Secret" "name" .name) -}}
{{- end -}}

{{/*
The data (key -> base64) of the Secret the chart creates, as JSON, computed once per render and kept for
the other templates (the Secret itself and each pod's `checksum/secrets` must see the same random values).
Each value is, in order of preference:
- derived from `secrets.seed` (sha256 of seed, namespace, release and key): the same on every render,
  with or without a cluster (`helm template`, Argo CD), so it never rotates under running pods;
- the live Secret's (`helm install`/`upgrade` read it with lookup): generated once, kept on upgrades, and a
  value changed in the cluster (`kubectl patch`, a deleted key or Secret: a rotation) is what pods get;
- random (first install, or a key missing from the live Secret).
*/}}
{{- define "gyre.generatedSecretData" -}}
{{- $memo := "gyre:generatedSecretData" -}}
{{- if not (hasKey .Values $memo) -}}
{{- $name := printf "%s-secrets" (include "gyre.fullname" .) -}}
{{- $live := (include "gyre.liveSecret" (dict "root" . "name" $name) | fromJson).data | default dict -}}
{{- $seed := .Values.secrets.seed -}}
{{- if and $seed (lt (len $seed) 32) -}}
{{- fail (printf "secrets.seed: %d characters; use a long random string (at least 32, e.g. `openssl rand -hex 32`): every key of the Secret is derived from it" (len $seed)) -}}
{{- end -}}
{{- $data := dict -}}
{{- /* with an external Redis its password comes from redis.external.existingSecret: none to generate */ -}}
{{- $keys := ternary (list "api-key" "control-token") (list "api-key" "control-token" "redis-password") (not (empty .Values.redis.external.url)) -}}
{{- range $key := $keys -}}
{{- if $seed -}}
{{- $_ := set $data $key (printf "%s\n%s\n%s\n%s" $seed $.Release.Namespace $.Release.Name $key | sha256sum | b64enc) -}}
{{- else -}}
{{- $_ := set $data $key (get $live $key | default (randAlphaNum 48 | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set .Values $memo $data -}}
{{- end -}}
{{- get .Values $memo | toJson -}}
{{- end -}}

{{/*
`checksum/secrets` of a pod: changes when a secret the pod reads changes, so a rotation (docs/kubernetes.md,
"Rotating secrets") restarts exactly the pods that use the rotated keys (the services read their secret
files once, at start). For the Secret the chart creates, the sha256 of the keys the pod mounts; for a Secret
the chart only refers to (`secrets.existingSecret`, `redis.external.existingSecret`, `modelCache.tokenSecret`),
its live uid and resourceVersion (never its data, which might be a guessable password), which change when it
is edited; without a cluster to ask, nothing. Call like gyre.secretSources (or gyre.volumes: its secretKeys).
*/}}
{{- define "gyre.secretsChecksum" -}}
{{- $root := .root -}}
{{- $ext := $root.Values.redis.external -}}
{{- $mc := $root.Values.modelCache -}}
{{- $parts := list -}}
{{- $referenced := list -}}
{{- range $key := .keys | default .secretKeys -}}
{{- if eq $key "hf-token" -}}
{{- if $mc.tokenSecret }}{{ $referenced = append $referenced $mc.tokenSecret }}{{ end -}}
{{- else if and (eq $key "redis-password") $ext.url -}}
{{- if $ext.existingSecret }}{{ $referenced = append $referenced $ext.existingSecret }}{{ end -}}
{{- else if $root.Values.secrets.existingSecret -}}
{{- $referenced = append $referenced $root.Values.secrets.existingSecret -}}
{{- else -}}
{{- $parts = append $parts (printf "%s=%s" $key (get (include "gyre.generatedSecretData" $root | fromJson) $key)) -}}
{{- end -}}
{{- end -}}
{{- range $name := $referenced | uniq | sortAlpha -}}
{{- $meta := (include "gyre.liveSecret" (dict "root" $root "name" $name) | fromJson).metadata | default dict -}}
{{- $parts = append $parts (printf "%s@%s/%s" $name ($meta.uid | default "") ($meta.resourceVersion | default "")) -}}
{{- end -}}
{{- join "\n" $parts | sha256sum -}}
{{- end -}}

{{- define "gyre.secretsMount" -}}
- name: secrets
  mountPath: {{ include "gyre.secretsDir" . }}
  readOnly: true
{{- end -}}

{{/*
A secret setting of a service as an environment variable naming its file:
(dict "name" "GYRE_AUTH__API_KEY_FILE" "key" "api-key").
*/}}
{{- define "gyre.secretFileEnv" -}}
- name: {{ .name }}
  value: {{ printf "%s/%s" (include "gyre.secretsDir" .) .key | quote }}
{{- end -}}

{{/*
GYRE_REDIS__URL (the services' `redis.url`, no credentials) and GYRE_REDIS__PASSWORD_FILE (the password's
file in the `secrets` volume): the password needs no URL escaping (a password with @ / % : would break
a URL it was spliced into).
*/}}
{{- define "gyre.redisEnv" -}}
{{- $ext := .Values.redis.external -}}
{{- if include "gyre.redisHasPassword" . }}
{{ include "gyre.secretFileEnv" (dict "name" "GYRE_REDIS__PASSWORD_FILE" "key" "redis-password") }}
{{- end }}
- name: GYRE_REDIS__URL
{{- if $ext.url }}
  value: {{ $ext.url | quote }}
{{- else }}
  value: {{ printf "redis://%s:%d/0" (include "gyre.serviceHost" (dict "root" . "service" "redis")) (int .Values.redis.port) | quote }}
{{- end }}
# The run ids' keys on the Redis are this release's: on a Redis several releases share (redis.external.url), one of
# the same run_id (a release of the same name in another namespace, a copied experiment.run_id) is refused at start
# instead of training this one's batches.
- name: GYRE_REDIS__OWNER
  value: {{ printf "%s/%s" .Release.Namespace .Release.Name | quote }}
{{- end -}}

{{/*
A container's resources: the component's requests/limits plus `count` GPUs of its resource name
(`<component>.gpuResourceName`, default `gpu.resourceName`), and an `ephemeralStorage` request unless the
component's own requests set one. Call with (dict "root" $ "component" $v "count" 2 "ephemeralStorage" "30Gi"
"key" "inference.resources"): `key` names the values a request above its limit came from.
*/}}
{{- define "gyre.resources" -}}
{{- $res := deepCopy (.component.resources | default dict) -}}
{{- with .ephemeralStorage }}
{{- $_ := set $res "requests" (merge (deepCopy ($res.requests | default dict)) (dict "ephemeral-storage" .)) -}}
{{- end -}}
{{- if gt (int .count) 0 -}}
{{- $name := .component.gpuResourceName | default .root.Values.gpu.resourceName -}}
{{- $gpu := dict $name (toString .count) -}}
{{- $_ := set $res "requests" (merge (deepCopy ($res.requests | default dict)) $gpu) -}}
{{- $_ := set $res "limits" (merge (deepCopy ($res.limits | default dict)) $gpu) -}}
{{- end -}}
{{- /* a request above its limit: the API server refuses the pod after `helm install` applied the rest */ -}}
{{- range $name, $limit := $res.limits | default dict -}}
{{- $request := get ($res.requests | default dict) $name -}}
{{- if not (kindIs "invalid" $request) -}}
{{- $r := include "gyre.quantity" (dict "value" $request "key" (printf "%s.requests.%s" $.key $name)) | float64 -}}
{{- $l := include "gyre.quantity" (dict "value" $limit "key" (printf "%s.limits.%s" $.key $name)) | float64 -}}
{{- if gt $r $l -}}
{{- fail (printf "%s: requests.%s (%v) is above limits.%s (%v), which Kubernetes refuses: raise the limit or lower the request (a values file replaces only the keys it sets: requests from one, limits from the chart's defaults)" $.key $name $request $name $limit) -}}
{{- end -}}
{{- end -}}
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

{{/*
The value of one `--key value` option the chart passes from values (a run's orchestrator keys, a server's
args): a string as it is, anything else as JSON, which the services' option parser reads (tables, lists,
null) or their config models coerce. Helm reads every number as a float, and `toString` prints a large one
with an exponent (a seed 123456789 as "1.23456789e+08", which no integer setting accepts); JSON prints
integral numbers as integers.
*/}}
{{- define "gyre.cliValue" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end -}}
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

{{/*
Resolve `url = "server:<name>"` of one orchestrator entry (in place) to that server's Service, with the
release's API key, which every server requires (its file in the orchestrator's `secrets` volume).
*/}}
{{- define "gyre.serverUrl" -}}
{{- $url := toString (.entry.url | default "") -}}
{{- if hasPrefix "server:" $url -}}
{{- $name := trimPrefix "server:" $url -}}
{{- if not (hasKey .servers $name) -}}
{{- fail (printf "%s.url = %q: no entry of `servers` is named %q" .key $url $name) -}}
{{- end -}}
{{- range $own := list "api_key_env" "api_key_file" -}}
{{- if hasKey $.entry $own -}}
{{- fail (printf "%s.%s: a `server:` url takes the release's API key (the chart sets api_key_file); remove %s" $.key $own $own) -}}
{{- end -}}
{{- end -}}
{{- $_ := set .entry "url" (get .servers $name) -}}
{{- $_ := set .entry "api_key_file" (printf "%s/api-key" (include "gyre.secretsDir" .)) -}}
{{- end -}}
{{- end -}}

{{/*
Resolve every `url = "server:<name>"` of one orchestrator table in place (its judges, reward models and
teacher): the experiment's `[orchestrator]`, or a run's own keys (`runs[i].orchestrator`). Call with
(dict "root" $ "orchestrator" $table "path" "experiment.orchestrator"); `path` names the keys in errors.
*/}}
{{- define "gyre.resolveServerUrls" -}}
{{- $servers := dict -}}
{{- range .root.Values.servers -}}
{{- $_ := set $servers .name (printf "http://%s:%v" (include "gyre.componentName" (dict "root" $.root "component" (printf "server-%s" .name))) (.httpPort | default $.root.Values.inference.httpPort)) -}}
{{- end -}}
{{- range $key := list "judges" "reward_models" -}}
{{- range $i, $entry := (get $.orchestrator $key | default list) -}}
{{- include "gyre.serverUrl" (dict "entry" $entry "servers" $servers "key" (printf "%s.%s.%d" $.path $key $i)) -}}
{{- end -}}
{{- end -}}
{{- with $.orchestrator.teacher -}}
{{- include "gyre.serverUrl" (dict "entry" . "servers" $servers "key" (printf "%s.teacher" $.path)) -}}
{{- end -}}
{{- end -}}

{{/*
The experiment as the services get it, as JSON: `experiment:` with the chart's derivations (run_id,
`server:` urls, max_concurrency, the orchestrator's progress checkpoints and resume_step from the trainer's
ckpt.*); fails on inconsistent values. gyre.experimentToml writes it as TOML.
*/}}
{{- define "gyre.experimentData" -}}
{{- $exp := deepCopy .Values.experiment -}}
{{- $_ := set $exp "run_id" (include "gyre.runId" .) -}}
{{- if and .Values.modelInit.enabled (($exp.model | default dict).name) -}}
{{- fail "experiment.model.name must stay unset when modelInit.enabled (the services load the generated model)" -}}
{{- end -}}
{{- if and (not .Values.modelInit.enabled) (not (($exp.model | default dict).name)) -}}
{{- fail "set experiment.model.name (a hub id or a path on the shared volume), or enable modelInit" -}}
{{- end -}}
{{- /* `url = "server:<name>"` of judges, reward models and the teacher: the Service of that `servers` entry */ -}}
{{- $orch := $exp.orchestrator | default dict -}}
{{- include "gyre.resolveServerUrls" (dict "root" . "orchestrator" $orch "path" "experiment.orchestrator") -}}
{{- if and (gt (float64 (((($exp.trainer | default dict).loss) | default dict).distill | default 0)) 0.0) (not $orch.teacher) -}}
{{- /* every run needs a teacher: the experiment's, or (multi-run) each run's own */ -}}
{{- $without := list -}}
{{- range .Values.runs -}}{{- if not ((.orchestrator | default dict).teacher) -}}{{- $without = append $without .name -}}{{- end -}}{{- end -}}
{{- if or (not .Values.runs) $without -}}
{{- fail (printf "experiment.trainer.loss.distill > 0 needs experiment.orchestrator.teacher%s (e.g. url = \"server:teacher\" with a `servers` entry named teacher)" (ternary (printf ", or runs[].orchestrator.teacher for runs %s" (join ", " $without)) "" (not (empty $without)))) -}}
{{- end -}}
{{- end -}}
{{- if not (gt (float64 (((($exp.trainer | default dict).loss) | default dict).distill | default 0)) 0.0) -}}
{{- /* a teacher without distill trains nothing from it, yet keeps every group of equal rewards (gyre rl refuses it) */ -}}
{{- $with := ternary (list "experiment") (list) (not (not $orch.teacher)) -}}
{{- range .Values.runs -}}{{- if ((.orchestrator | default dict).teacher) -}}{{- $with = append $with (printf "runs %s" .name) -}}{{- end -}}{{- end -}}
{{- if $with -}}
{{- fail (printf "experiment.trainer.loss.distill is 0 but a teacher is set (%s): its log-probs would train nothing, and groups of equal rewards would still be kept for it; set experiment.trainer.loss.distill > 0 (e.g. 1) or remove the teacher" (join ", " $with)) -}}
{{- end -}}
{{- end -}}
{{- /* Requests in flight: enough to fill every replica's batch, as `gyre rl` derives it (the orchestrator's own
default, 64, would leave a larger fleet's batches part-empty); with autoscaling, the largest fleet's, so the
demand KEDA reads can grow the pool. A value the user sets (here or in a run's flags) wins. */ -}}
{{- $orchInference := get $orch "inference" | default dict -}}
{{- if not (hasKey $orchInference "max_concurrency") -}}
{{- $iv := .Values.inference -}}
{{- $replicas := ternary $iv.autoscaling.maxReplicas $iv.replicas $iv.autoscaling.enabled -}}
{{- $batch := ((($exp.inference | default dict).engine | default dict).max_batch_size) | default 64 -}}
{{- $_ := set $orchInference "max_concurrency" (mul (max 1 (int $replicas)) (int $batch)) -}}
{{- $_ := set $orch "inference" $orchInference -}}
{{- end -}}
{{- /* Resume and rewind, as `gyre rl` derives them: one knob, the trainer's ckpt.* */ -}}
{{- $ckpt := (($exp.trainer | default dict).ckpt) | default dict -}}
{{- if not (hasKey $orch "ckpt_interval") -}}
{{- /* progress checkpoints are a few hundred bytes: always on, so a restart never repeats tasks */ -}}
{{- $_ := set $orch "ckpt_interval" (int ($ckpt.interval | default 1)) -}}
{{- end -}}
{{- if not (hasKey $orch "ckpt_keep_last") -}}
{{- $_ := set $orch "ckpt_keep_last" (include "gyre.progressKeepLast" (dict "root" . "orchestrator" $orch) | int) -}}
{{- end -}}
{{- if not (kindIs "invalid" $ckpt.resume_step) -}}
{{- $_ := set $orch "resume_step" (int $ckpt.resume_step) -}}
{{- end -}}
{{- $_ := set $exp "orchestrator" $orch -}}
{{- toJson $exp -}}
{{- end -}}

{{/*
The orchestrator's progress checkpoints kept (`ckpt_keep_last`): a rewind to step N needs progress checkpoint N
for every trainer checkpoint N still kept (`ckpt.keep_last`, default 2), and the orchestrator writes them as it
pushes, up to max_async_level + 1 steps ahead of the trainer (gyre.local.runs does the same for `gyre rl`).
Call with (dict "root" $ "orchestrator" <the run's [orchestrator] keys>).
*/}}
{{- define "gyre.progressKeepLast" -}}
{{- $ckpt := ((.root.Values.experiment.trainer | default dict).ckpt) | default dict -}}
{{- $keep := ternary $ckpt.keep_last 2 (not (kindIs "invalid" $ckpt.keep_last)) -}}
{{- $async := ternary .orchestrator.max_async_level 1 (hasKey .orchestrator "max_async_level") -}}
{{- add (int $keep) (int $async) 1 -}}
{{- end -}}

{{- define "gyre.experimentToml" -}}
# Experiment {{ include "gyre.runId" . }} (release {{ .Release.Name }}). Each service reads its table:
#   gyre <service> @ /etc/gyre/experiment.toml#<service>
# Addresses, ports, the shared volume, Redis and secrets are set on the command line by the chart.
{{- include "gyre.tomlTable" (dict "prefix" "" "table" (include "gyre.experimentData" . | fromJson)) }}
{{- end -}}

{{/*
The `checksum/experiment` of one service's pods: the sha256 of what that service reads from the experiment
file (the shared keys and its own table, `@ experiment.toml#<service>`). A `helm upgrade` that changes only
another service's table (the orchestrator's max_concurrency when inference replicas are added, a trainer's
learning rate) leaves these pods running. Call with (dict "root" $ "service" "trainer").
*/}}
{{- define "gyre.experimentChecksum" -}}
{{- $others := without (list "inference" "orchestrator" "trainer") .service -}}
{{- $exp := include "gyre.experimentData" .root | fromJson -}}
{{- toJson (omit $exp (index $others 0) (index $others 1)) | sha256sum -}}
{{- end -}}

{{/* torchrun processes per trainer pod. */}}
{{- define "gyre.trainerNproc" -}}
{{- $t := .Values.trainer -}}
{{- if gt (int $t.nprocPerNode) 0 -}}{{ $t.nprocPerNode }}{{- else if gt (int $t.gpusPerNode) 0 -}}{{ $t.gpusPerNode }}{{- else -}}1{{- end -}}
{{- end -}}

{{/*
Optional APIs (CRDs of other projects: KEDA, the Prometheus operator). "true" when the cluster serves `.api`
("group/version/Kind"): `.Capabilities` holds what `helm install/upgrade` discovered on the API server, but
`helm template` knows only the built-in APIs (plus its `--api-versions`), so `assumeApiVersions` may name
an API (as group/version or group/version/Kind) for a render with no cluster to ask (CI, GitOps).
A group/version in `.Capabilities` without any of its kinds comes from `--api-versions` (Argo CD's older
releases pass group/versions only) and counts for every kind: discovery lists each served kind too, so
there a group/version whose kind is missing (another version's CRDs) does not count.
*/}}
{{- define "gyre.serves" -}}
{{- $caps := .root.Capabilities.APIVersions -}}
{{- $groupVersion := .api | splitList "/" | initial | join "/" -}}
{{- $assumed := .root.Values.assumeApiVersions | default list -}}
{{- $kindsListed := false -}}
{{- range $caps }}{{ if hasPrefix (printf "%s/" $groupVersion) . }}{{ $kindsListed = true }}{{ end }}{{ end -}}
{{- $versionOnly := and ($caps.Has $groupVersion) (not $kindsListed) -}}
{{- if or ($caps.Has .api) $versionOnly (has .api $assumed) (has $groupVersion $assumed) -}}true{{- end -}}
{{- end -}}

{{/*
A value asks for an object of an optional API: fail the render when the cluster does not serve it. Without
this, `helm install/upgrade` applied part of the release and then stopped on the API server's "no matches
for kind". Call with (dict "root" $ "api" "g/v/Kind" "value" "the value that asks" "what" "the objects"
"install" "what provides the API" "off" "the value that turns them off").
*/}}
{{- define "gyre.requireApi" -}}
{{- if not (include "gyre.serves" .) -}}
{{- $groupVersion := .api | splitList "/" | initial | join "/" -}}
{{- fail (printf "%s renders %s (%s), which this cluster does not serve: install %s first, or set %s. Rendering with no cluster to ask (helm template, CI, GitOps)? Pass --api-versions %s or set assumeApiVersions: [%s] (docs/kubernetes.md, \"Optional APIs\")" .value .what .api .install .off .api $groupVersion) -}}
{{- end -}}
{{- end -}}

{{/*
monitoring.coreos.com objects: "true" when `auto` and the cluster serves that kind, or when forced with
`true` (which then requires the kind: gyre.requireApi).
*/}}
{{- define "gyre.monitoringFor" -}}
{{- $mode := .root.Values.monitoring.enabled -}}
{{- $api := printf "monitoring.coreos.com/v1/%s" .kind -}}
{{- if eq (toString $mode) "auto" -}}
{{- include "gyre.serves" (dict "root" .root "api" $api) -}}
{{- else if $mode -}}
{{- $value := ternary "monitoring.enabled=true" "monitoring.enabled=true with monitoring.rules.enabled=true" (eq .kind "ServiceMonitor") -}}
{{- $off := ternary "monitoring.enabled=auto (creates them only where served) or false" "monitoring.rules.enabled=false, or monitoring.enabled=auto (creates them only where served)" (eq .kind "ServiceMonitor") -}}
{{- include "gyre.requireApi" (dict "root" .root "api" $api "value" $value "what" (printf "%ss" .kind) "install" "the Prometheus operator's CRDs (kube-prometheus-stack, or prometheus-operator's stripped-down-crds.yaml)" "off" $off) -}}
true
{{- end -}}
{{- end -}}

{{/*
The trainer job's identity: 8 hex of the sha256 of everything that shapes it (what the trainer reads
from the experiment file, the trainer values, its `--runs`). It ends the torchrun rendezvous id, so
pods of two configurations can never rendezvous into one job. `trainer.pdb` is left out: the budget is no
part of the pod, and toggling it for a drain (docs/kubernetes.md, "Draining a trainer node") must not
replace a running trainer. Empty values (`[]`, `{}`, `""`, null) are left out too, as absent: a chart version
that adds a value whose default is empty (`topologySpreadConstraints: []`), or an upgrade with `--reuse-values`
(the previous chart's values, without that key), is the same job.
*/}}
{{- define "gyre.trainerJobHash" -}}
{{- $trainer := include "gyre.experimentChecksum" (dict "root" . "service" "trainer") -}}
{{- $values := dict -}}
{{- range $key, $value := omit .Values.trainer "pdb" -}}
{{- if or (not (empty $value)) (kindIs "bool" $value) (kindIs "float64" $value) (kindIs "int" $value) (kindIs "int64" $value) -}}
{{- $_ := set $values $key $value -}}
{{- end -}}
{{- end -}}
{{- printf "%s\n%s\n%s" $trainer (toJson $values) (include "gyre.trainerRuns" .) | sha256sum | trunc 8 -}}
{{- end -}}

{{/* Multi-run (`runs`): the trainer's `runs` list as JSON (each run's folder, orchestrator and own keys). */}}
{{- define "gyre.trainerRuns" -}}
{{- $out := list }}
{{- range $run := .Values.runs }}
{{- if contains $run.name "lora_" }}
{{- /* the trainer's RunConfig refuses it too, but only once its pod runs: refuse it at install */}}
{{- fail (printf "runs: name %q is part of \"lora_\", which peft reserves (an adapter named so could be re-initialised when loaded back): choose a longer name" $run.name) }}
{{- end }}
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
serves them only with LoRA on (gyre.local.runs.served_adapters does the same for `gyre rl`). */}}
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


{{/*
Values that must agree with each other (templates/validate.yaml): names that become object names are
unique, and each pod's ports are distinct (two containerPorts with one number make an invalid pod; two
servers on one port make a service that cannot start).
*/}}
{{- define "gyre.validate" -}}
{{- include "gyre.validateImmutable" . -}}
{{- range $key, $_ := .Values.commonLabels | default dict -}}
{{- if regexMatch "^(app\\.kubernetes\\.io|helm\\.sh|gyre\\.dev)/" $key -}}
{{- fail (printf "commonLabels: %q is a label of the chart's own (app.kubernetes.io/*, helm.sh/*, gyre.dev/*: its selectors and records use them); choose another key" $key) -}}
{{- end -}}
{{- if not (regexMatch "^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$" $key) -}}
{{- fail (printf "commonLabels: %q is not a label key ([prefix/]name: a name of up to 63 letters, digits, '-', '_', '.', a DNS prefix)" $key) -}}
{{- end -}}
{{- end -}}
{{- /* the shared volume beside the chart's own mounts: on one of them (or above it, or on /) it hides it */ -}}
{{- $mount := clean .Values.persistence.mountPath -}}
{{- range $own := list "/etc/gyre" (include "gyre.secretsDir" .) "/tmp" "/cache" "/dev/shm" -}}
{{- if or (eq $mount "/") (eq $mount $own) (hasPrefix (printf "%s/" $mount) $own) (hasPrefix (printf "%s/" $own) $mount) -}}
{{- fail (printf "persistence.mountPath %q: the pods already mount %s there (the experiment file, secrets, scratch, caches); choose another folder, e.g. /data" $.Values.persistence.mountPath $own) -}}
{{- end -}}
{{- end -}}
{{- range $list := list "runs" "servers" -}}
{{- $seen := dict -}}
{{- range $i, $entry := get $.Values $list | default list -}}
{{- if hasKey $seen $entry.name -}}
{{- fail (printf "%s[%d].name %q: %s[%v] has that name already (each gets its own objects, named after it)" $list $i $entry.name $list (get $seen $entry.name)) -}}
{{- end -}}
{{- $_ := set $seen $entry.name $i -}}
{{- end -}}
{{- end -}}
{{- $v := .Values -}}
{{- $pods := list
  (dict "key" "inference" "ports" (dict "httpPort" $v.inference.httpPort "controlPort" $v.inference.controlPort "metricsPort" $v.inference.metricsPort))
  (dict "key" "orchestrator" "ports" (dict "grpcPort" $v.orchestrator.grpcPort "metricsPort" $v.orchestrator.metricsPort))
  (dict "key" "trainer" "ports" (dict "grpcPort" $v.trainer.grpcPort "metricsPort" $v.trainer.metricsPort "healthPort" $v.trainer.healthPort "rdzvPort" $v.trainer.rdzvPort)) -}}
{{- range $i, $s := $v.servers -}}
{{- $ports := dict -}}
{{- range $name := list "httpPort" "controlPort" "metricsPort" -}}
{{- $_ := set $ports $name (ternary (get $s $name) (get $v.inference $name) (hasKey $s $name)) -}}
{{- end -}}
{{- $pods = append $pods (dict "key" (printf "servers[%d]" $i) "ports" $ports) -}}
{{- end -}}
{{- range $pod := $pods -}}
{{- $seen := dict -}}
{{- range $name := keys $pod.ports | sortAlpha -}}
{{- $port := toString (int (get $pod.ports $name)) -}}
{{- if hasKey $seen $port -}}
{{- fail (printf "%s.%s and %s.%s are both %s: the pod's ports must differ" $pod.key (get $seen $port) $pod.key $name $port) -}}
{{- end -}}
{{- $_ := set $seen $port $name -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What one pod runs on, for NOTES.txt: "2 nvidia.com/gpu each" (its own resource name, else gpu.resourceName) or "on CPU". */}}
{{- define "gyre.notesGpus" -}}
{{- if gt (int .count) 0 -}}
{{ .count }} {{ .name | default .root.Values.gpu.resourceName }} each
{{- else -}}
on CPU
{{- end -}}
{{- end -}}

{{/*
Changes `helm upgrade` cannot make, refused before anything is applied, with what to do instead: the API
server would reject the StatefulSet or claim halfway through the upgrade with a message naming no value. A
StatefulSet's volume claim templates never change (Redis's `persistence`); a claim's access modes and class
never change and its size only grows. Without a cluster to ask (`helm template`), nothing to compare.
*/}}
{{- define "gyre.validateImmutable" -}}
{{- $ns := .Release.Namespace -}}
{{- /*
A release trains one run: its id and its model stay. Checkpoints, published weights, the orchestrator's progress
and the Redis stream on the volume are that run's: a new run_id resumed the old run's checkpoints under a new
name, a new model.name resumed the old model's weights (or failed on the checkpoint's shapes), and a new
modelInit was ignored (the generated model is kept) while NOTES named the new one. The experiment ConfigMap
and the shared volume's claim record both (annotations; the claim outlives `helm uninstall`, so a new install on
the old run's volume is checked too; an older chart's objects have none: nothing to compare, and they are recorded).
*/ -}}
{{- $records := list (dict "kind" "ConfigMap" "name" (printf "%s-experiment" (include "gyre.fullname" .))) -}}
{{- if not .Values.persistence.existingClaim -}}
{{- /* the shared volume outlives `helm uninstall` (persistence.keep): it catches a new install on the old run's volume */ -}}
{{- $records = append $records (dict "kind" "PersistentVolumeClaim" "name" (include "gyre.claimName" .)) -}}
{{- end -}}
{{- $fresh := printf "a release trains one run: install a new release for another (or `helm uninstall`, `kubectl -n %s delete pvc %s` and install again: the run starts afresh)" $ns (include "gyre.claimName" .) -}}
{{- range $o := $records -}}
{{- $recorded := ((include "gyre.live" (dict "root" $ "apiVersion" "v1" "kind" $o.kind "name" $o.name) | fromJson).metadata | default dict).annotations | default dict -}}
{{- with get $recorded "gyre.dev/run-id" -}}
{{- if ne . (include "gyre.runId" $) -}}
{{- fail (printf "experiment.run_id: %q, but this release's run is %q (%s %s); %s" (include "gyre.runId" $) . $o.kind $o.name $fresh) -}}
{{- end -}}
{{- end -}}
{{- with get $recorded "gyre.dev/model" -}}
{{- if ne . (include "gyre.modelIdentity" $) -}}
{{- fail (printf "%s: these values train %q, but this release's run trains %q (%s %s), and its checkpoints and published weights are that model's; %s" (ternary "modelInit" "experiment.model.name" $.Values.modelInit.enabled) (include "gyre.modelIdentity" $) . $o.kind $o.name $fresh) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with .Values.persistence.existingClaim -}}
{{- /*
A claim is one release's: every service writes its run's weights, checkpoints, batches and progress at the claim's
root (output_dir), so two releases on one claim overwrote each other's steps and each resumed the other's run. A
claim and its releases share one namespace, so the experiment ConfigMaps there (gyre.dev/claim) name every user.
*/ -}}
{{- $claim := . -}}
{{- $own := printf "%s-experiment" (include "gyre.fullname" $) -}}
{{- range $cm := (include "gyre.live" (dict "root" $ "apiVersion" "v1" "kind" "ConfigMap" "name" "") | fromJson).items | default list -}}
{{- $record := $cm.metadata.annotations | default dict -}}
{{- if and (eq (get $record "gyre.dev/claim" | default "") $claim) (ne $cm.metadata.name $own) -}}
{{- fail (printf "persistence.existingClaim: %q is already the shared volume of release %q (ConfigMap %s, run %q): both releases would write their weights, checkpoints and batches at its root, each training on and resuming from the other's; give this release a claim of its own" $claim (get ($cm.metadata.labels | default dict) "app.kubernetes.io/instance" | default "?") $cm.metadata.name (get $record "gyre.dev/run-id" | default "?")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $r := .Values.redis -}}
{{- if not $r.external.url -}}
{{- $name := printf "%s-redis" (include "gyre.fullname" .) -}}
{{- $sts := include "gyre.live" (dict "root" . "apiVersion" "apps/v1" "kind" "StatefulSet" "name" $name) | fromJson -}}
{{- if $sts -}}
{{- $vct := $sts.spec.volumeClaimTemplates | default list -}}
{{- $howto := printf "a StatefulSet's volume claim templates cannot change: `kubectl -n %s delete statefulset %s --cascade=orphan` (the Redis pod and its volume stay), then run the upgrade again" $ns $name -}}
{{- if ne (not (empty $vct)) (not (not $r.persistence.enabled)) -}}
{{- fail (printf "redis.persistence.enabled: %v, but StatefulSet %s was created with it %v; %s" $r.persistence.enabled $name (not (empty $vct)) $howto) -}}
{{- end -}}
{{- with $vct -}}
{{- $live := index . 0 -}}
{{- $size := $live.spec.resources.requests.storage | toString -}}
{{- /* as numbers: the API server writes a claim's size in its own units (1.5Gi is 1536Mi there) */ -}}
{{- $want := include "gyre.quantity" (dict "value" $r.persistence.size "key" "redis.persistence.size") | float64 -}}
{{- if ne (include "gyre.quantity" (dict "value" $size "key" (printf "StatefulSet %s's claim size" $name)) | float64) $want -}}
{{- fail (printf "redis.persistence.size: %s, but StatefulSet %s was created with %s; grow the claim itself (`kubectl -n %s patch pvc redis-data-%s-0 -p '{\"spec\":{\"resources\":{\"requests\":{\"storage\":\"%s\"}}}}'`, if its StorageClass allows expansion), then: %s" (toString $r.persistence.size) $name $size $ns $name (toString $r.persistence.size) $howto) -}}
{{- end -}}
{{- if and $r.persistence.storageClass (ne $r.persistence.storageClass ($live.spec.storageClassName | default "")) -}}
{{- fail (printf "redis.persistence.storageClass: %q, but StatefulSet %s was created with %q; %s" $r.persistence.storageClass $name ($live.spec.storageClassName | default "") $howto) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $claims := list -}}
{{- if not .Values.persistence.existingClaim -}}
{{- $claims = append $claims (dict "key" "persistence" "name" (include "gyre.claimName" .) "v" .Values.persistence) -}}
{{- end -}}
{{- $mc := .Values.modelCache -}}
{{- if and (eq $mc.type "pvc") (not $mc.existingClaim) -}}
{{- $claims = append $claims (dict "key" "modelCache" "name" (include "gyre.modelCacheClaim" .) "v" $mc) -}}
{{- end -}}
{{- range $c := $claims -}}
{{- $pvc := include "gyre.live" (dict "root" $ "apiVersion" "v1" "kind" "PersistentVolumeClaim" "name" $c.name) | fromJson -}}
{{- if $pvc -}}
{{- $keep := printf "keep the claim's, or copy the data to a new claim and name it in %s.existingClaim" $c.key -}}
{{- if not (has $c.v.accessMode ($pvc.spec.accessModes | default list)) -}}
{{- fail (printf "%s.accessMode: %s, but PersistentVolumeClaim %s was created %s and a claim's access modes cannot change; %s" $c.key $c.v.accessMode $c.name (join ", " ($pvc.spec.accessModes | default list)) $keep) -}}
{{- end -}}
{{- if and $c.v.storageClass (ne $c.v.storageClass ($pvc.spec.storageClassName | default "")) -}}
{{- fail (printf "%s.storageClass: %q, but PersistentVolumeClaim %s was created with %q and a claim's class cannot change; %s" $c.key $c.v.storageClass $c.name ($pvc.spec.storageClassName | default "") $keep) -}}
{{- end -}}
{{- $size := $pvc.spec.resources.requests.storage | toString -}}
{{- $want := include "gyre.quantity" (dict "value" $c.v.size "key" (printf "%s.size" $c.key)) | float64 -}}
{{- if lt $want (include "gyre.quantity" (dict "value" $size "key" (printf "PersistentVolumeClaim %s's size" $c.name)) | float64) -}}
{{- fail (printf "%s.size: %s, but PersistentVolumeClaim %s already holds %s and a claim never shrinks; keep %s or more" $c.key (toString $c.v.size) $c.name $size $size) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
