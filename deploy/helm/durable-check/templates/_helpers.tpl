{{/*
The chart name, or nameOverride.
*/}}
{{- define "durable-check.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
A fully qualified name: the release name, with the chart name unless the release name
already contains it. Truncated at 63 characters (DNS label limit).
*/}}
{{- define "durable-check.fullname" -}}
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

{{/*
The headless Service: the loadbalancing exporter's resolver target. The suffix is kept
inside the 63-character limit.
*/}}
{{- define "durable-check.headlessName" -}}
{{- printf "%s-headless" (include "durable-check.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "durable-check.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release namespace, or namespaceOverride.
*/}}
{{- define "durable-check.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "durable-check.labels" -}}
helm.sh/chart: {{ include "durable-check.chart" . }}
{{ include "durable-check.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: durable-check
{{- with .Values.additionalLabels }}
{{ tpl (toYaml .) $ }}
{{- end }}
{{- end }}

{{/*
Selector labels: pods, Services, the PodDisruptionBudget.
*/}}
{{- define "durable-check.selectorLabels" -}}
app.kubernetes.io/name: {{ include "durable-check.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the pods run as.
*/}}
{{- define "durable-check.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "durable-check.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference: by digest when one is given, else by tag (default: appVersion).
*/}}
{{- define "durable-check.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Where the container keeps its files; the same paths as the image (Dockerfile).
*/}}
{{- define "durable-check.dataDir" -}}/var/lib/durable-check{{- end }}
{{- define "durable-check.configDir" -}}/etc/durable-check{{- end }}
{{- define "durable-check.tlsDir" -}}/etc/durable-check/tls{{- end }}

{{/*
The first tier (firstTier.enabled): its objects' names, suffixes kept inside the
63-character limit, and its pods' own app.kubernetes.io/name, so that neither tier's
Services select the other's pods (the evaluators select on name and instance only, and a
StatefulSet's selector cannot change on upgrade).
*/}}
{{- define "durable-check.firstTierName" -}}
{{- printf "%s-first-tier" (include "durable-check.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}

{{- define "durable-check.firstTierHeadlessName" -}}
{{- printf "%s-first-tier-headless" (include "durable-check.fullname" . | trunc 43 | trimSuffix "-") }}
{{- end }}

{{- define "durable-check.firstTierSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-first-tier" (include "durable-check.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
ConfigMap key of a user rule file (prefixed so no rule file can collide with config.yaml).
*/}}
{{- define "durable-check.ruleKey" -}}
{{- printf "rules.%s" . }}
{{- end }}

{{/*
A probe from values, adapted to TLS: HTTPS when the receivers use TLS; a TCP check when
they require client certificates, which the kubelet cannot present.
*/}}
{{- define "durable-check.probe" -}}
{{- $probe := deepCopy .probe }}
{{- if and $probe.httpGet .root.Values.tls.enabled }}
{{- if .root.Values.tls.clientAuth }}
{{- $_ := set $probe "tcpSocket" (dict "port" $probe.httpGet.port) }}
{{- $_ := unset $probe "httpGet" }}
{{- else }}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{/*
Rendering stops here with a message naming the value when values contradict each other
in a way the schema cannot express.
*/}}
{{- define "durable-check.validate" -}}
{{- $receivers := ((.Values.config.receivers).otlp) | default dict }}
{{- range $protocol := list "grpc" "http" }}
{{- with (get $receivers $protocol) }}
{{- if hasKey . "endpoint" }}
{{- fail (printf "config.receivers.otlp.%s.endpoint: set by the chart from ports (ports.%s.containerPort); remove it from config" $protocol (ternary "otlp" "otlp-http" (eq $protocol "grpc"))) }}
{{- end }}
{{- if hasKey . "tls" }}
{{- fail (printf "config.receivers.otlp.%s.tls: set by the chart; use tls.enabled and tls.existingSecret" $protocol) }}
{{- end }}
{{- if hasKey . "auth" }}
{{- fail (printf "config.receivers.otlp.%s.auth: set by the chart; use auth.enabled and auth.existingSecret" $protocol) }}
{{- end }}
{{- end }}
{{- end }}
{{- if hasKey .Values.config "state" }}
{{- fail "config.state: set by the chart from mode (statefulset: SQLite on the volume; deployment: PostgreSQL from postgres.existingSecret)" }}
{{- end }}
{{- if and .Values.ports.metrics.enabled (hasKey (((.Values.config.exporters).prometheus) | default dict) "endpoint") }}
{{- fail "config.exporters.prometheus.endpoint: set by the chart from ports.metrics.containerPort; remove it from config" }}
{{- end }}
{{- $uiConfig := (.Values.config.ui) | default dict }}
{{- range $key := list "endpoint" "tls" "auth" }}
{{- if hasKey $uiConfig $key }}
{{- fail (printf "config.ui.%s: set by the chart; use ui.enabled, ui.containerPort, tls.enabled and ui.auth.existingSecret" $key) }}
{{- end }}
{{- end }}
{{- if and .Values.ui.ingress.enabled (not .Values.ui.enabled) }}
{{- fail "ui.ingress.enabled needs ui.enabled: the Ingress sends to the view's port" }}
{{- end }}
{{- if and .Values.ui.ingress.enabled (not .Values.ui.ingress.host) }}
{{- fail "ui.ingress.host: the Ingress needs the host name it answers for" }}
{{- end }}
{{- if and .Values.ui.ingress.enabled (not .Values.ui.auth.existingSecret) (not .Values.ui.ingress.allowWithoutToken) }}
{{- fail "ui.ingress.enabled: the view would answer anyone who reaches the Ingress; set ui.auth.existingSecret (the authenticating proxy in front adds the token), or ui.ingress.allowWithoutToken when the ingress controller authenticates every request itself" }}
{{- end }}
{{- if ((.Values.config.route).endpoint) }}
{{- fail "config.route.endpoint: would make the evaluators a first tier; run the first tier with firstTier.enabled" }}
{{- end }}
{{- if .Values.firstTier.enabled }}
{{- if not .Values.firstTier.sessionsEndpoint }}
{{- fail "firstTier.sessionsEndpoint: the Collector's receiver that routes by session (otlp/sessions in config/otel-collector-two-tier.yaml), host:port" }}
{{- end }}
{{- /* The schema keeps receivers, ui, forward, the state's backend and path and the violation exporters out of firstTier.config. */}}
{{- $route := ((.Values.firstTier.config).route) | default dict }}
{{- range $key, $value := dict "endpoint" "sessionsEndpoint" "insecure" "insecure" }}
{{- if hasKey $route $key }}
{{- fail (printf "firstTier.config.route.%s: set firstTier.%s instead" $key $value) }}
{{- end }}
{{- end }}
{{- if hasKey (((.Values.firstTier.config).evaluate) | default dict) "allowed_lateness" }}
{{- fail "firstTier.config.evaluate.allowed_lateness: the first tier takes config.evaluate.allowed_lateness, the evaluators' (the two must agree: a span the first tier holds longer reaches its evaluator late)" }}
{{- end }}
{{- if and .Values.ports.metrics.enabled (hasKey ((((.Values.firstTier.config).exporters).prometheus) | default dict) "endpoint") }}
{{- fail "firstTier.config.exporters.prometheus.endpoint: set by the chart from ports.metrics.containerPort; remove it from firstTier.config" }}
{{- end }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.ports.metrics.enabled) }}
{{- fail "serviceMonitor.enabled needs ports.metrics.enabled: the ServiceMonitor scrapes that port" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail (printf "autoscaling.minReplicas (%d) is more than autoscaling.maxReplicas (%d)" (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (hasKey .Values.podDisruptionBudget "minAvailable") (hasKey .Values.podDisruptionBudget "maxUnavailable") }}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable, not both" }}
{{- end }}
{{- /* The pod template merges extraEnv's OTEL_RESOURCE_ATTRIBUTES with service.instance.id=$(POD_NAME). */}}
{{- $resourceAttributesEntries := 0 }}
{{- range $index, $env := .Values.extraEnv }}
{{- if has $env.name (list "POD_NAME" "DURABLE_CHECK_EXTRA_RESOURCE_ATTRIBUTES") }}
{{- fail (printf "extraEnv[%d]: %s is set by the chart (it builds OTEL_RESOURCE_ATTRIBUTES' service.instance.id from the pod name); remove it" $index $env.name) }}
{{- end }}
{{- if eq $env.name "OTEL_RESOURCE_ATTRIBUTES" }}
{{- $resourceAttributesEntries = add1 $resourceAttributesEntries }}
{{- if gt $resourceAttributesEntries 1 }}
{{- fail (printf "extraEnv[%d]: OTEL_RESOURCE_ATTRIBUTES is given twice; put all the attributes in one entry" $index) }}
{{- end }}
{{- $source := get $env "valueFrom" | default dict }}
{{- range $kind := list "secretKeyRef" "configMapKeyRef" }}
{{- if (get $source $kind | default dict).optional }}
{{- fail (printf "extraEnv[%d].valueFrom.%s.optional: not for OTEL_RESOURCE_ATTRIBUTES, which the chart merges with its service.instance.id: a missing key would leave $(...) unexpanded and the whole variable invalid" $index $kind) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
