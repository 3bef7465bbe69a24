{{/*
Names, labels and the wiring every template shares.
*/}}

{{- define "sparrow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name; truncated at 50 characters so that "-controller" and friends still fit
in a 63-character DNS label.
*/}}
{{- define "sparrow.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sparrow.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of one component: call with (dict "ctx" $ "component" "generator").
*/}}
{{- define "sparrow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sparrow.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Every label of one component's objects: call with (dict "ctx" $ "component" "generator").
*/}}
{{- define "sparrow.labels" -}}
helm.sh/chart: {{ include "sparrow.chart" .ctx }}
{{ include "sparrow.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: sparrow
{{- end }}

{{/*
Labels of objects that belong to the release as a whole (secrets, monitors, rules, dashboards).
*/}}
{{- define "sparrow.commonLabels" -}}
helm.sh/chart: {{ include "sparrow.chart" . }}
app.kubernetes.io/name: {{ include "sparrow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sparrow
{{- end }}

{{- define "sparrow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sparrow.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image of a component: call with (dict "ctx" $ "image" .Values.generator.image).
*/}}
{{- define "sparrow.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "sparrow.generator.fullname" -}}
{{- printf "%s-generator" (include "sparrow.fullname" .) }}
{{- end }}

{{- define "sparrow.trainer.fullname" -}}
{{- printf "%s-trainer" (include "sparrow.fullname" .) }}
{{- end }}

{{- define "sparrow.controller.fullname" -}}
{{- printf "%s-controller" (include "sparrow.fullname" .) }}
{{- end }}

{{- define "sparrow.sandbox.fullname" -}}
{{- printf "%s-sandbox" (include "sparrow.fullname" .) }}
{{- end }}

{{- define "sparrow.redis.fullname" -}}
{{- printf "%s-redis" (include "sparrow.fullname" .) }}
{{- end }}

{{- define "sparrow.redis.host" -}}
{{- if .Values.redis.enabled }}
{{- include "sparrow.redis.fullname" . }}
{{- else }}
{{- required "redis.external.host is required when redis.enabled is false" .Values.redis.external.host }}
{{- end }}
{{- end }}

{{- define "sparrow.redis.port" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.port }}{{ else }}{{ .Values.redis.external.port }}{{ end }}
{{- end }}

{{- define "sparrow.redis.database" -}}
{{- if .Values.redis.enabled }}0{{ else }}{{ .Values.redis.external.database }}{{ end }}
{{- end }}

{{- define "sparrow.redis.url" -}}
{{- printf "redis://%s:%s/%s" (include "sparrow.redis.host" .) (include "sparrow.redis.port" .) (include "sparrow.redis.database" .) }}
{{- end }}

{{- define "sparrow.secretName" -}}
{{- default (printf "%s-tokens" (include "sparrow.fullname" .)) .Values.security.existingSecret }}
{{- end }}

{{- define "sparrow.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "sparrow.fullname" .)) .Values.security.tls.existingSecret }}
{{- end }}

{{/*
A component's container resources with its GPUs added as limits (GPUs are requested through limits).
Call with the component's values (.Values.generator or .Values.trainer).
*/}}
{{- define "sparrow.gpuResources" -}}
{{- $resources := deepCopy (default dict .resources) }}
{{- if gt (int .gpu.count) 0 }}
{{- $limits := default dict $resources.limits }}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
Environment of the gRPC services (trainer, generator): the service token and, with TLS, the PEM paths.
*/}}
{{- define "sparrow.securityEnv" -}}
- name: SPARROW_SECURITY__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sparrow.secretName" . }}
      key: service-token
{{- if .Values.security.tls.enabled }}
- name: SPARROW_SECURITY__TLS_CERT
  value: /etc/sparrow/tls/tls.crt
- name: SPARROW_SECURITY__TLS_KEY
  value: /etc/sparrow/tls/tls.key
- name: SPARROW_SECURITY__TLS_CA
  value: /etc/sparrow/tls/ca.crt
{{- end }}
{{- end }}

{{/*
Generator environment: where Redis and the trainer are, where to listen. docker-compose.yml sets the
same names (a test compares them).
*/}}
{{- define "sparrow.generator.env" -}}
- name: SPARROW_REDIS__URL
  value: {{ include "sparrow.redis.url" . | quote }}
- name: SPARROW_TRAINER__ADDRESS
  value: {{ printf "%s:%d" (include "sparrow.trainer.fullname" .) (int .Values.trainer.grpcPort) | quote }}
- name: SPARROW_TRAINER__WEIGHTS_DIR
  value: /var/cache/sparrow/weights
- name: SPARROW_CONTROL__HOST
  value: "0.0.0.0"
- name: SPARROW_CONTROL__PORT
  value: {{ .Values.generator.controlPort | quote }}
- name: SPARROW_METRICS__HOST
  value: "0.0.0.0"
- name: SPARROW_METRICS__PORT
  value: {{ .Values.generator.metricsPort | quote }}
{{- if .Values.generator.relay.enabled }}
- name: SPARROW_RELAY__ENABLED
  value: "true"
- name: SPARROW_RELAY__HOST
  value: "0.0.0.0"
- name: SPARROW_RELAY__PORT
  value: {{ .Values.generator.relay.port | quote }}
# Peers reach a relay at its pod's IP: a Deployment's pod name does not resolve.
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: SPARROW_RELAY__ADVERTISE
  value: {{ printf "$(POD_IP):%d" (int .Values.generator.relay.port) | quote }}
{{- end }}
{{- if not (dig "engine" "model_dir" "" .Values.generator.config) }}
- name: SPARROW_ENGINE__MODEL_DIR
  value: {{ .Values.model.dir | quote }}
{{- end }}
{{ include "sparrow.securityEnv" . }}
{{- end }}

{{- define "sparrow.trainer.env" -}}
- name: SPARROW_REDIS__URL
  value: {{ include "sparrow.redis.url" . | quote }}
- name: SPARROW_GRPC__ADDRESS
  value: {{ printf "0.0.0.0:%d" (int .Values.trainer.grpcPort) | quote }}
- name: SPARROW_METRICS__HOST
  value: "0.0.0.0"
- name: SPARROW_METRICS__PORT
  value: {{ .Values.trainer.metricsPort | quote }}
- name: SPARROW_RUN_DIR
  value: /var/lib/sparrow
- name: SPARROW_DEVICE
  value: {{ if gt (int .Values.trainer.gpu.count) 0 }}cuda{{ else }}cpu{{ end }}
{{- if not (dig "model_dir" "" .Values.trainer.config) }}
- name: SPARROW_MODEL_DIR
  value: {{ .Values.model.dir | quote }}
{{- end }}
{{ include "sparrow.securityEnv" . }}
{{- if .Values.sandbox.enabled }}
# the code reward's sandbox, called from the trainer's reward workers with the service token
- name: CODE_SANDBOX_URL
  value: {{ printf "http://%s:%d" (include "sparrow.sandbox.fullname" .) (int .Values.sandbox.port) | quote }}
- name: CODE_SANDBOX_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sparrow.secretName" . }}
      key: service-token
{{- end }}
{{- end }}

{{- /* Sandbox environment: where to listen, the pool, the jail in a container. compose sets the same names. */}}
{{- define "sparrow.sandbox.env" -}}
- name: SPARROW_API__HOST
  value: "0.0.0.0"
- name: SPARROW_API__PORT
  value: {{ .Values.sandbox.port | quote }}
- name: SPARROW_POOL__WORKERS
  value: {{ .Values.sandbox.workers | quote }}
- name: SPARROW_POOL__QUEUE_LIMIT
  value: {{ .Values.sandbox.queueLimit | quote }}
- name: SPARROW_JAIL__PROC
  value: "false"
- name: SPARROW_SECURITY__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sparrow.secretName" . }}
      key: service-token
{{- end }}

{{- define "sparrow.controller.env" -}}
- name: SPARROW_REDIS__URL
  value: {{ include "sparrow.redis.url" . | quote }}
- name: SPARROW_PROMETHEUS__URL
  value: {{ .Values.controller.prometheusUrl | quote }}
- name: SPARROW_API__HOST
  value: "0.0.0.0"
- name: SPARROW_API__PORT
  value: {{ .Values.controller.port | quote }}
- name: SPARROW_RETUNE__TAU
  value: {{ .Values.tau | quote }}
# the admin API's bearer token, in the security section every service shares
- name: SPARROW_SECURITY__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sparrow.secretName" . }}
      key: admin-token
{{- end }}

{{/*
A token that survives upgrades: the one already in the release's Secret, else the value, else random.
Call with (dict "ctx" $ "key" "service-token" "value" .Values.security.serviceToken).
*/}}
{{- define "sparrow.token" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace (include "sparrow.secretName" .ctx) }}
{{- if .value }}
{{- .value | b64enc }}
{{- else if and $existing (index $existing.data .key) }}
{{- index $existing.data .key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}

{{- /* The checkpoints volume (model.existingClaim), mounted read-only at /models. */}}
{{- define "sparrow.modelsMount" -}}
{{- if .Values.model.existingClaim }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end }}

{{- define "sparrow.modelsVolume" -}}
{{- if .Values.model.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{- /* Trainer processes in each pod: trainer.procs, or one per GPU (0); several must match the GPU count. */}}
{{- define "sparrow.trainer.procs" -}}
{{- $procs := int .Values.trainer.procs }}
{{- if eq $procs 0 }}{{ $procs = max 1 (int .Values.trainer.gpu.count) | int }}{{ end }}
{{- $gpus := int .Values.trainer.gpu.count }}
{{- if and (gt $procs 1) (gt $gpus 0) (ne $procs $gpus) }}
{{- fail (printf "trainer.procs %d does not match trainer.gpu.count %d (one rank per GPU)" $procs $gpus) }}
{{- end }}
{{- $procs }}
{{- end }}

{{- /* Several trainer nodes: the JobSet's headless subdomain (not the trainer Service's name, which selects pod 0
     only) and pod 0's stable DNS name under it: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>. */}}
{{- define "sparrow.trainer.nodesSubdomain" -}}
{{- printf "%s-nodes" (include "sparrow.trainer.fullname" .) }}
{{- end }}

{{- define "sparrow.trainer.node0" -}}
{{- printf "%s-node-0-0.%s" (include "sparrow.trainer.fullname" .) (include "sparrow.trainer.nodesSubdomain" .) }}
{{- end }}
