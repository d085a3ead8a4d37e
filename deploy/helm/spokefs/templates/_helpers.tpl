{{- define "spokefs.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "spokefs.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "spokefs.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "spokefs.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spokefs.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "spokefs.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selector labels of one component: (dict "root" . "component" "spoke") */}}
{{- define "spokefs.selector" -}}
app.kubernetes.io/name: {{ include "spokefs.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "spokefs.image" -}}
{{ printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) | quote }}
{{- end -}}

{{- define "spokefs.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end -}}
{{- end -}}

{{- define "spokefs.tokenSecret" -}}
{{- default (printf "%s-tokens" (include "spokefs.fullname" .)) .Values.auth.secretName -}}
{{- end -}}

{{- define "spokefs.tlsSecret" -}}
{{- default (printf "%s-tls" (include "spokefs.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{- define "spokefs.caSecret" -}}
{{- default (include "spokefs.tlsSecret" .) .Values.tls.caSecretName -}}
{{- end -}}

{{- define "spokefs.hubName" -}}{{ include "spokefs.fullname" . }}-hub{{- end -}}
{{- define "spokefs.spokeName" -}}{{ include "spokefs.fullname" . }}-spoke{{- end -}}
{{- define "spokefs.headlessName" -}}{{ include "spokefs.fullname" . }}-spoke-headless{{- end -}}
{{- define "spokefs.mountName" -}}{{ include "spokefs.fullname" . }}-mount{{- end -}}
{{- define "spokefs.csiName" -}}{{ include "spokefs.fullname" . }}-csi-node{{- end -}}

{{- define "spokefs.hubUrl" -}}
{{- printf "%s://%s.%s.svc.%s:%v" (include "spokefs.scheme" .) (include "spokefs.hubName" .) .Release.Namespace .Values.clusterDomain .Values.hub.port -}}
{{- end -}}

{{- define "spokefs.upstream" -}}
{{- if .Values.spoke.upstream -}}
{{- .Values.spoke.upstream -}}
{{- else if .Values.hub.enabled -}}
{{- include "spokefs.hubUrl" . -}}
{{- else -}}
{{- fail "spoke.upstream is required when hub.enabled is false (the hub's URL, e.g. https://hub.example.org:8470)" -}}
{{- end -}}
{{- end -}}

{{- define "spokefs.spokeUrl" -}}
{{- if .Values.mount.spokeUrl -}}
{{- .Values.mount.spokeUrl -}}
{{- else -}}
{{- include "spokefs.releaseSpokeUrl" (dict "root" . "what" "mount.spokeUrl") -}}
{{- end -}}
{{- end -}}

{{/* The CSI driver's default spoke: csi.spokeUrl, else this release's spoke Service */}}
{{- define "spokefs.csiSpokeUrl" -}}
{{- if .Values.csi.spokeUrl -}}
{{- .Values.csi.spokeUrl -}}
{{- else -}}
{{- include "spokefs.releaseSpokeUrl" (dict "root" . "what" "csi.spokeUrl") -}}
{{- end -}}
{{- end -}}

{{/* This release's spoke Service URL: (dict "root" . "what" "the value that replaces it") */}}
{{- define "spokefs.releaseSpokeUrl" -}}
{{- $root := .root -}}
{{- if $root.Values.spoke.enabled -}}
{{- printf "%s://%s.%s.svc.%s:%v" (include "spokefs.scheme" $root) (include "spokefs.spokeName" $root) $root.Release.Namespace $root.Values.clusterDomain $root.Values.spoke.port -}}
{{- else -}}
{{- fail (printf "%s is required when spoke.enabled is false" .what) -}}
{{- end -}}
{{- end -}}

{{/*
Global options every spokefs command in a pod takes: the token it presents and the CA it trusts.
(dict "root" . "token" "monitor.token")
*/}}
{{- define "spokefs.clientArgs" -}}
{{- if and .root.Values.auth.enabled .token }}
- --token-file=/etc/spokefs/tokens/{{ .token }}
{{- end }}
{{- if .root.Values.tls.enabled }}
- --ca-bundle=/etc/spokefs/ca/{{ .root.Values.tls.caKey }}
{{- end }}
{{- end -}}

{{/* Server options for tokens and TLS: (dict "root" . "tokens" "hub.tokens") */}}
{{- define "spokefs.serverArgs" -}}
{{- if .root.Values.auth.enabled }}
- --auth=/etc/spokefs/tokens/{{ .tokens }}
{{- else }}
- --insecure
{{- end }}
{{- if .root.Values.tls.enabled }}
- --tls-cert=/etc/spokefs/tls/tls.crt
- --tls-key=/etc/spokefs/tls/tls.key
{{- end }}
{{- end -}}

{{/*
An HTTP probe of a server: GET /healthz (liveness, startup: the event loop answers) or /readyz
(readiness: the upstream or the cache is usable). Both need no token and carry no data, so the
kubelet asks them itself, over https with TLS (the kubelet does not check the certificate).
(dict "root" . "path" "/healthz")
*/}}
{{- define "spokefs.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: http
  scheme: {{ ternary "HTTPS" "HTTP" .root.Values.tls.enabled }}
{{- end -}}

{{/*
Whether the Prometheus operator's CRDs are served (monitoring.coreos.com/v1): the
ServiceMonitors and the PrometheusRule render only then, so an install on a cluster without
the operator succeeds. `helm template` sees no cluster: pass --api-versions monitoring.coreos.com/v1.
*/}}
{{- define "spokefs.prometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end -}}
{{- end -}}

{{/* Token and CA volumes: (dict "root" . "keys" (list "monitor.token" ...) "server" true) */}}
{{- define "spokefs.secretVolumes" -}}
{{- if .root.Values.auth.enabled }}
- name: tokens
  secret:
    secretName: {{ include "spokefs.tokenSecret" .root }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- if .root.Values.tls.enabled }}
{{- if .server }}
- name: tls
  secret:
    secretName: {{ include "spokefs.tlsSecret" .root }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
- name: ca
  secret:
    secretName: {{ include "spokefs.caSecret" .root }}
    items:
      - key: {{ .root.Values.tls.caKey }}
        path: {{ .root.Values.tls.caKey }}
{{- end }}
{{- end -}}

{{- define "spokefs.secretMounts" -}}
{{- if .root.Values.auth.enabled }}
- {name: tokens, mountPath: /etc/spokefs/tokens, readOnly: true}
{{- end }}
{{- if .root.Values.tls.enabled }}
{{- if .server }}
- {name: tls, mountPath: /etc/spokefs/tls, readOnly: true}
{{- end }}
- {name: ca, mountPath: /etc/spokefs/ca, readOnly: true}
{{- end }}
{{- end -}}

{{/*
Where the servers' certificate comes from: off, own (tls.secretName, made by the user),
certManager (cert-manager Certificates) or generate (genCA and genSignedCert, tls.yaml).
*/}}
{{- define "spokefs.tlsMode" -}}
{{- if not .Values.tls.enabled -}}off
{{- else if .Values.tls.certManager.enabled -}}certManager
{{- else if .Values.tls.secretName -}}own
{{- else -}}generate
{{- end -}}
{{- end -}}

{{/* The chart-made CA's Secret (generate), or its Certificate's (certManager, no issuerRef). */}}
{{- define "spokefs.caName" -}}{{ include "spokefs.fullname" . }}-ca{{- end -}}

{{/*
The DNS names of the chart's certificate, as a JSON list: every form of the hub and spoke
Services' names, the members' (*.HEADLESS...), localhost (the probes), tls.extraDnsNames.
*/}}
{{- define "spokefs.tlsDnsNames" -}}
{{- $ns := .Release.Namespace -}}
{{- $services := list -}}
{{- if .Values.hub.enabled }}{{ $services = append $services (include "spokefs.hubName" .) }}{{ end -}}
{{- if .Values.spoke.enabled }}{{ $services = concat $services (list (include "spokefs.spokeName" .) (include "spokefs.headlessName" .)) }}{{ end -}}
{{- $names := list -}}
{{- range $services -}}
{{- $names = concat $names (list . (printf "%s.%s" . $ns) (printf "%s.%s.svc" . $ns) (printf "%s.%s.svc.%s" . $ns $.Values.clusterDomain)) -}}
{{- end -}}
{{- if .Values.spoke.enabled -}}
{{- $names = append $names (printf "*.%s.%s.svc.%s" (include "spokefs.headlessName" .) $ns .Values.clusterDomain) -}}
{{- end -}}
{{- $names = concat $names (list "localhost") .Values.tls.extraDnsNames | uniq -}}
{{- toJson $names -}}
{{- end -}}

{{/* The addresses of the chart's certificate: loopback, for probes on an address */}}
{{- define "spokefs.tlsIPs" -}}["127.0.0.1", "::1"]{{- end -}}

{{/* A short digest of the certificate's names: the servers' pods restart when they change */}}
{{- define "spokefs.tlsNamesDigest" -}}
{{- printf "%s %s" (include "spokefs.tlsDnsNames" .) (include "spokefs.tlsIPs" .) | sha256sum | trunc 16 -}}
{{- end -}}

{{/* Pod annotations of the servers: (dict "root" .) */}}
{{- define "spokefs.serverPodAnnotations" -}}
{{- if has (include "spokefs.tlsMode" .root) (list "generate" "certManager") }}
spokefs.io/tls-names: {{ include "spokefs.tlsNamesDigest" .root | quote }}
{{- end }}
{{- end -}}

{{/* A pod's annotations: the servers' own (above) and the values' podAnnotations.
(dict "root" . "extra" .Values.hub.podAnnotations "server" true) */}}
{{- define "spokefs.podAnnotations" -}}
{{- $all := dict -}}
{{- if or (not (hasKey . "server")) .server -}}
{{- $all = include "spokefs.serverPodAnnotations" (dict "root" .root) | fromYaml | default dict -}}
{{- end -}}
{{- with .extra }}{{ $all = merge $all . }}{{ end -}}
{{- with $all }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/*
The ingress peers of a server's NetworkPolicy, as a JSON list: (dict "root" . "component" "spoke")
*/}}
{{- define "spokefs.ingressPeers" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $np := $v.networkPolicy -}}
{{- $peers := list -}}
{{- if eq .component "spoke" -}}
{{- if $v.tier.enabled -}}
{{- $peers = append $peers (dict "podSelector" (dict "matchLabels" (include "spokefs.selector" (dict "root" $root "component" "spoke") | fromYaml))) -}}
{{- end -}}
{{- if $v.mount.enabled -}}
{{- $peers = append $peers (dict "podSelector" (dict "matchLabels" (include "spokefs.selector" (dict "root" $root "component" "mount") | fromYaml))) -}}
{{- end -}}
{{- if $v.csi.enabled -}}
{{- $peers = append $peers (dict "podSelector" (dict "matchLabels" (include "spokefs.selector" (dict "root" $root "component" "csi-node") | fromYaml))) -}}
{{- end -}}
{{- else if $v.spoke.enabled -}}
{{- $peers = append $peers (dict "podSelector" (dict "matchLabels" (include "spokefs.selector" (dict "root" $root "component" "spoke") | fromYaml))) -}}
{{- end -}}
{{- if $np.prometheus.enabled -}}
{{- $prom := dict -}}
{{- if not (kindIs "invalid" $np.prometheus.namespaceSelector) }}{{ $_ := set $prom "namespaceSelector" $np.prometheus.namespaceSelector }}{{ end -}}
{{- if not (kindIs "invalid" $np.prometheus.podSelector) }}{{ $_ := set $prom "podSelector" $np.prometheus.podSelector }}{{ end -}}
{{- if not $prom -}}
{{- fail "networkPolicy.prometheus: give a namespaceSelector or a podSelector (or enabled: false)" -}}
{{- end -}}
{{- $peers = append $peers $prom -}}
{{- end -}}
{{- $peers = concat $peers (index $np .component).extraFrom -}}
{{- toJson $peers -}}
{{- end -}}

{{/*
The hub's namespace (hub.datasets) as a JSON list, each entry with its source filled in and,
for a folder on a volume of its own, that volume: [{name, source, blockSize, endpoint, volume}].
Fails on what the hub or the API server would refuse later: a name given twice, a folder on no
volume, an object store given a volume, two volumes at one path.
*/}}
{{- define "spokefs.hubDatasets" -}}
{{- $hub := .Values.hub -}}
{{- $shared := trimSuffix "/" $hub.dataset.path -}}
{{- $out := list -}}
{{- $names := dict -}}
{{- $paths := dict -}}
{{- range $hub.datasets -}}
{{- $where := printf "hub.datasets %s" .name -}}
{{- if hasKey $names .name -}}
{{- fail (printf "hub.datasets: %q is named twice (each dataset once)" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- if and .existingClaim .volume -}}
{{- fail (printf "%s: give existingClaim or volume, not both" $where) -}}
{{- end -}}
{{- $vol := dict -}}
{{- if .existingClaim -}}
{{- $vol = dict "persistentVolumeClaim" (dict "claimName" .existingClaim "readOnly" true) -}}
{{- else if .volume -}}
{{- $vol = .volume -}}
{{- end -}}
{{- $src := .source | default (ternary (printf "/datasets/%s" .name) (printf "%s/%s" $shared .name) (not (empty $vol))) -}}
{{- if contains "://" $src -}}
{{- if $vol }}{{ fail (printf "%s: an object store's dataset (%s) takes no existingClaim or volume" $where $src) }}{{ end -}}
{{- else if $vol -}}
{{- $path := trimSuffix "/" $src -}}
{{- if or (hasKey $paths $path) (eq $path $shared) -}}
{{- fail (printf "%s: another volume is already mounted at %s" $where $path) -}}
{{- end -}}
{{- $_ := set $paths $path true -}}
{{- else if not (hasPrefix (printf "%s/" $shared) $src) -}}
{{- fail (printf "%s: %s is on no volume: put it under hub.dataset.path (%s, where hub.data is mounted), or give it existingClaim or volume" $where $src $shared) -}}
{{- end -}}
{{- $out = append $out (dict "name" .name "source" $src "blockSize" .blockSize "endpoint" .endpoint "volume" $vol) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
