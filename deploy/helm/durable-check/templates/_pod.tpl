{{/*
The pod template shared by the evaluators' StatefulSet or Deployment and the first tier's
StatefulSet, called with (dict "root" $ "firstTier" false|true). Both tiers run the same
image with the same security contexts, probes, receivers' Secrets and extras; the first
tier has no view and no rule files, and its own ConfigMap, selector labels, resources,
affinity and topology spread (those select pods by label: the evaluators' would not fit).
*/}}
{{- define "durable-check.podTemplate" -}}
{{- $root := .root }}
{{- $firstTier := .firstTier }}
{{- $own := ternary $root.Values.firstTier $root.Values $firstTier }}
{{- $ui := and (not $firstTier) $root.Values.ui.enabled }}
{{- $postgres := and (not $firstTier) (eq $root.Values.mode "deployment") }}
{{- with $root -}}
metadata:
  annotations:
    # A change of configuration or rules rolls the pods.
    checksum/config: {{ include (print $root.Template.BasePath (ternary "/first-tier-configmap.yaml" "/configmap.yaml" $firstTier)) $root | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- tpl (toYaml .) $root | nindent 4 }}
    {{- end }}
  labels:
    {{- if $firstTier }}
    {{- include "durable-check.firstTierSelectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: first-tier
    {{- else }}
    {{- include "durable-check.selectorLabels" . | nindent 4 }}
    {{- end }}
    {{- with .Values.podLabels }}
    {{- tpl (toYaml .) $root | nindent 4 }}
    {{- end }}
spec:
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  serviceAccountName: {{ include "durable-check.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  containers:
    - name: {{ ternary "first-tier" "durable-check" $firstTier }}
      image: {{ include "durable-check.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # The image's entrypoint is `durable-check serve`.
      args:
        - --config={{ include "durable-check.configDir" . }}/config.yaml
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      ports:
        - name: otlp
          containerPort: {{ .Values.ports.otlp.containerPort }}
          protocol: TCP
        - name: otlp-http
          containerPort: {{ index .Values.ports "otlp-http" "containerPort" }}
          protocol: TCP
        {{- if .Values.ports.metrics.enabled }}
        - name: metrics
          containerPort: {{ .Values.ports.metrics.containerPort }}
          protocol: TCP
        {{- end }}
        {{- if $ui }}
        - name: ui
          containerPort: {{ .Values.ui.containerPort }}
          protocol: TCP
        {{- end }}
      env:
        # The pod's name tells the replicas apart in the violation spans and OTLP metrics
        # they push (service.instance.id in OTEL_RESOURCE_ATTRIBUTES, below).
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- if or $postgres .Values.auth.enabled (and $ui .Values.ui.auth.existingSecret) }}
        # Secrets reach the configuration as ${env:VAR}, never through the ConfigMap.
        {{- end }}
        {{- if $postgres }}
        - name: DURABLE_CHECK_POSTGRES_DSN
          valueFrom:
            secretKeyRef:
              name: {{ .Values.postgres.existingSecret }}
              key: {{ .Values.postgres.key }}
        {{- end }}
        {{- if .Values.auth.enabled }}
        - name: DURABLE_CHECK_BEARER_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ .Values.auth.existingSecret }}
              key: {{ .Values.auth.key }}
        {{- end }}
        {{- if and $ui .Values.ui.auth.existingSecret }}
        - name: DURABLE_CHECK_UI_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ .Values.ui.auth.existingSecret }}
              key: {{ .Values.ui.auth.key }}
        {{- end }}
        {{- /* extraEnv, except OTEL_RESOURCE_ATTRIBUTES: that one is merged into the chart's, last. */}}
        {{- $resourceAttributes := list "service.instance.id=$(POD_NAME)" }}
        {{- range .Values.extraEnv }}
        {{- if ne .name "OTEL_RESOURCE_ATTRIBUTES" }}
        - {{ toYaml . | nindent 10 | trim }}
        {{- else if hasKey . "valueFrom" }}
        # extraEnv's OTEL_RESOURCE_ATTRIBUTES comes from a Secret or ConfigMap: read under
        # another name, then referenced below.
        - name: DURABLE_CHECK_EXTRA_RESOURCE_ATTRIBUTES
          valueFrom:
            {{- toYaml .valueFrom | nindent 12 }}
        {{- $resourceAttributes = append $resourceAttributes "$(DURABLE_CHECK_EXTRA_RESOURCE_ATTRIBUTES)" }}
        {{- else if get . "value" }}
        {{- $resourceAttributes = append $resourceAttributes (get . "value") }}
        {{- end }}
        {{- end }}
        # Last, so that $(VAR) in extraEnv's OTEL_RESOURCE_ATTRIBUTES may name any extraEnv
        # variable. Its entries follow the chart's, and the last of a key wins.
        - name: OTEL_RESOURCE_ATTRIBUTES
          value: {{ join "," $resourceAttributes | quote }}
      {{- with .Values.extraEnvFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.livenessProbe }}
      livenessProbe:
        {{- include "durable-check.probe" (dict "probe" . "root" $root) | nindent 8 }}
      {{- end }}
      {{- with .Values.readinessProbe }}
      readinessProbe:
        {{- if and $ui $root.Values.ui.readiness .httpGet }}
        {{- /* The view answers readiness itself on its port (its TLS is the receivers', with no client certificates). */}}
        {{- $probe := deepCopy . }}
        {{- $_ := set $probe.httpGet "port" "ui" }}
        {{- $_ := set $probe.httpGet "path" "/readyz" }}
        {{- if $root.Values.tls.enabled }}
        {{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
        {{- end }}
        {{- toYaml $probe | nindent 8 }}
        {{- else }}
        {{- include "durable-check.probe" (dict "probe" . "root" $root) | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- with .Values.startupProbe }}
      startupProbe:
        {{- include "durable-check.probe" (dict "probe" . "root" $root) | nindent 8 }}
      {{- end }}
      {{- with $own.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: {{ include "durable-check.configDir" . }}
          readOnly: true
        - name: data
          mountPath: {{ include "durable-check.dataDir" . }}
        # The root filesystem is read-only; Python and SQLite may still need a scratch directory.
        - name: tmp
          mountPath: /tmp
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    # One projected volume: the configuration, the rule files and the TLS files side by side
    # (a Secret mounted inside a ConfigMap's read-only mount could not get its mount point).
    - name: config
      projected:
        sources:
          - configMap:
              name: {{ ternary (include "durable-check.firstTierName" .) (include "durable-check.fullname" .) $firstTier }}
              items:
                - key: config.yaml
                  path: config.yaml
                {{- if not $firstTier }}
                {{- range $file := keys .Values.rules | sortAlpha }}
                - key: {{ include "durable-check.ruleKey" $file }}
                  path: rules/{{ $file }}
                {{- end }}
                {{- end }}
          {{- if .Values.tls.enabled }}
          - secret:
              name: {{ .Values.tls.existingSecret }}
              items:
                - key: tls.crt
                  path: tls/tls.crt
                - key: tls.key
                  path: tls/tls.key
                {{- if .Values.tls.clientAuth }}
                - key: ca.crt
                  path: tls/ca.crt
                {{- end }}
          {{- end }}
    {{- if $postgres }}
    # mode=deployment keeps its state in PostgreSQL; this volume only holds JSONL output.
    - name: data
      emptyDir: {}
    {{- end }}
    - name: tmp
      emptyDir: {}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $own.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $own.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
