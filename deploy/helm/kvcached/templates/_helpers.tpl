{{/*
Names and labels.
*/}}
{{- define "kvcached.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvcached.fullname" -}}
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

{{- define "kvcached.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvcached.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvcached.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvcached.labels" -}}
helm.sh/chart: {{ include "kvcached.chart" . }}
{{ include "kvcached.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: daemon
app.kubernetes.io/part-of: kvcached
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvcached.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvcached.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvcached.priorityClassName" -}}
{{- if .Values.priorityClassName -}}
{{- .Values.priorityClassName -}}
{{- else if .Values.priorityClass.create -}}
{{- default (include "kvcached.fullname" .) .Values.priorityClass.name -}}
{{- end -}}
{{- end -}}

{{/*
An int-or-string field (maxSurge, maxUnavailable): "10%" as is, a number as an integer (Go
templates print 1000000 as 1e+06).
*/}}
{{- define "kvcached.intOrPercent" -}}
{{- if kindIs "string" . -}}{{ quote . }}{{- else -}}{{ int64 . }}{{- end -}}
{{- end -}}

{{- define "kvcached.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Paths inside the daemon's container. The node paths are values (state.hostPath, ...); these are
where they appear to the daemon, and what kvcached.toml names.
*/}}
{{- define "kvcached.path.config" -}}/etc/kvcached/kvcached.toml{{- end -}}
{{- define "kvcached.path.state" -}}/var/lib/kvcached{{- end -}}
{{- define "kvcached.path.index" -}}/var/lib/kvcached/index{{- end -}}
{{- define "kvcached.path.ssd" -}}/var/lib/kvcached-ssd{{- end -}}
{{- define "kvcached.path.sockets" -}}/run/kvcached{{- end -}}
{{- define "kvcached.path.arena" -}}/var/lib/kvcached-arena{{- end -}}
{{- define "kvcached.path.certs" -}}/etc/kvcached/certs{{- end -}}
{{- define "kvcached.path.etcd" -}}/etc/kvcached/etcd{{- end -}}
{{- define "kvcached.path.tenantKey" -}}/etc/kvcached/tenants.key{{- end -}}

{{/*
Sizes. The RAM tier in MiB (ram.sizeGiB x 1024, rounded up), the daemon's own memory in MiB
(resources.daemonMemory: a quantity in Mi or Gi), and the huge page size in MiB.
*/}}
{{- define "kvcached.ramMiB" -}}
{{- mulf .Values.ram.sizeGiB 1024 | ceil | int64 -}}
{{- end -}}

{{- define "kvcached.daemonMiB" -}}
{{- $q := toString .Values.resources.daemonMemory -}}
{{- if regexMatch "^[0-9]+Gi$" $q -}}
{{- mul (trimSuffix "Gi" $q | int64) 1024 -}}
{{- else if regexMatch "^[0-9]+Mi$" $q -}}
{{- trimSuffix "Mi" $q | int64 -}}
{{- else -}}
{{- fail (printf "resources.daemonMemory must be a whole number of Mi or Gi (e.g. 1Gi, 768Mi), got %q" $q) -}}
{{- end -}}
{{- end -}}

{{/*
The slot directory beside the arena (kvcached.tiers.slot_directory), in the same directory and
memory: 44 bytes for each 4 KiB of the tier (1.07%), plus its header, in MiB rounded up.
*/}}
{{- define "kvcached.slotDirectoryMiB" -}}
{{- $ram := include "kvcached.ramMiB" . | int64 -}}
{{- add (div (add (mul $ram 11) 1023) 1024) 1 -}}
{{- end -}}

{{/*
What the arena's directory holds at most, in MiB: the tier and its slot directory; on huge
pages, rounded up to whole pages.
*/}}
{{- define "kvcached.sharedMiB" -}}
{{- $mib := add (include "kvcached.ramMiB" . | int64) (include "kvcached.slotDirectoryMiB" . | int64) -}}
{{- if eq .Values.ram.arena.backing "hugepages" -}}
{{- $page := include "kvcached.hugePageMiB" . | int64 -}}
{{- mul (div (add $mib (sub $page 1)) $page) $page -}}
{{- else -}}
{{- $mib -}}
{{- end -}}
{{- end -}}

{{- define "kvcached.hugePageMiB" -}}
{{- if eq .Values.ram.arena.hugepages.pageSize "1Gi" -}}1024{{- else -}}2{{- end -}}
{{- end -}}

{{/*
The container's memory request and limit: the RAM tier and its slot directory plus the daemon's
own memory; with huge pages the tier and the directory are in the hugepages request instead.
*/}}
{{- define "kvcached.memoryMiB" -}}
{{- if eq .Values.ram.arena.backing "hugepages" -}}
{{- include "kvcached.daemonMiB" . -}}
{{- else -}}
{{- add (include "kvcached.sharedMiB" . | int64) (include "kvcached.daemonMiB" . | int64) -}}
{{- end -}}
{{- end -}}

{{/*
A value written as TOML: strings as basic strings (JSON's escapes are TOML's), whole numbers as
integers (every number setting of the daemon takes an integer), other numbers as floats, lists as
arrays, maps as inline tables with quoted keys. A map {"$toml": TEXT} is written as TEXT (a float
that must stay one, such as a share of 1.0).
*/}}
{{- define "kvcached.tomlValue" -}}
{{- $v := . -}}
{{- $kind := kindOf $v -}}
{{- if eq $kind "string" -}}
{{- toJson $v -}}
{{- else if eq $kind "bool" -}}
{{- ternary "true" "false" $v -}}
{{- else if has $kind (list "float64" "float32" "int" "int64" "int32" "uint64") -}}
{{- toJson $v -}}
{{- else if eq $kind "slice" -}}
[{{- range $i, $x := $v -}}{{- if $i -}}, {{ end -}}{{- include "kvcached.tomlValue" $x -}}{{- end -}}]
{{- else if and (eq $kind "map") (hasKey $v "$toml") -}}
{{- get $v "$toml" -}}
{{- else if eq $kind "map" -}}
{{- if not $v -}}
{}
{{- else -}}
{ {{- range $i, $k := keys $v | sortAlpha -}}{{- if $i -}},{{- end }} {{ toJson $k }} = {{ include "kvcached.tomlValue" (get $v $k) -}}{{- end }} }
{{- end -}}
{{- else -}}
{{- fail (printf "cannot write %v (%s) as a TOML value" $v $kind) -}}
{{- end -}}
{{- end -}}

{{/*
A tenant's share: a fraction of the tier (0 < x <= 1) stays a TOML float even when whole (1.0:
the whole tier); more than 1 is bytes, an integer.
*/}}
{{- define "kvcached.share" -}}
{{- $v := float64 . -}}
{{- if le $v 1.0 -}}
{{- $s := printf "%v" $v -}}
{{- if or (contains "." $s) (contains "e" $s) -}}{{ $s }}{{- else -}}{{ $s }}.0{{- end -}}
{{- else if ne $v (floor $v) -}}
{{- fail (printf "a share over 1 is bytes and must be whole, got %v" $v) -}}
{{- else -}}
{{- toJson $v -}}
{{- end -}}
{{- end -}}

{{/*
Checks of values that relate to each other (values.schema.json checks each alone).
*/}}
{{- define "kvcached.validate" -}}
{{- if semverCompare "<1.29.0-0" .Capabilities.KubeVersion.Version -}}
{{- fail (printf "kvcached needs Kubernetes 1.29 or later (native gRPC probes, DaemonSet maxSurge), this is %s" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- $ram := mulf .Values.ram.sizeGiB 1024 -}}
{{- if eq .Values.ram.arena.backing "hugepages" -}}
{{- $page := include "kvcached.hugePageMiB" . | int64 -}}
{{- if or (ne $ram (floor $ram)) (ne (mod (int64 $ram) $page) 0) -}}
{{- fail (printf "ram.sizeGiB (%v) must be a whole number of %s huge pages (ram.arena.hugepages.pageSize)" .Values.ram.sizeGiB .Values.ram.arena.hugepages.pageSize) -}}
{{- end -}}
{{- end -}}
{{- if gt (float64 .Values.ram.maxBlockMiB) $ram -}}
{{- fail (printf "ram.maxBlockMiB (%v) does not fit in ram.sizeGiB (%v)" .Values.ram.maxBlockMiB .Values.ram.sizeGiB) -}}
{{- end -}}
{{- if and .Values.peers.enabled (not .Values.peers.etcd.endpoints) -}}
{{- fail "peers.enabled needs peers.etcd.endpoints: pods find each other through etcd (pod IPs change)" -}}
{{- end -}}
{{- if and .Values.peers.enabled (not .Values.peers.certsSecret) -}}
{{- fail "peers.enabled needs peers.certsSecret: the cluster CA and each node's certificate (kvcached certs)" -}}
{{- end -}}
{{- if and .Values.tenants.enabled .Values.tenants.keySecret (ne (int64 .Values.securityContext.runAsUser) 0) -}}
{{- fail "tenants.keySecret needs securityContext.runAsUser 0: Secret files are root-owned, and the daemon takes a tenant key only from a file no one else may read" -}}
{{- end -}}
{{- if and .Values.tenants.enabled (not .Values.tenants.members) -}}
{{- fail "tenants.enabled needs at least one tenant in tenants.members" -}}
{{- end -}}
{{- if and (not .Values.agent.enabled) (not .Values.tenants.enabled) -}}
{{- fail "agent.enabled is false and tenants are off: no engine could reach the daemon" -}}
{{- end -}}
{{- end -}}

{{/*
The daemon's configuration as data (JSON): section -> key -> value. templates/configmap.yaml
writes it as kvcached.toml. Per-pod values (the node's name, the pod's IP, the node's
certificate) are not here: the container's args pass them with --set.
*/}}
{{- define "kvcached.config" -}}
{{- $v := .Values -}}
{{- $sockets := include "kvcached.path.sockets" . -}}
{{- $kv := dict
      "ram_gib" $v.ram.sizeGiB
      "max_block_mib" $v.ram.maxBlockMiB
      "ram_policy" $v.ram.policy
      "index_dir" (include "kvcached.path.index" .)
      "ssd_gib" $v.ssd.sizeGiB
      "write_policy" $v.ssd.writePolicy -}}
{{- if gt (float64 $v.ssd.sizeGiB) 0.0 -}}
{{- $_ := set $kv "ssd_dir" (include "kvcached.path.ssd" .) -}}
{{- $_ := set $kv "ssd_ttl" $v.ssd.ttl -}}
{{- $_ := set $kv "ssd_durability" $v.ssd.durability -}}
{{- $_ := set $kv "ssd_direct_io" $v.ssd.directIO -}}
{{- end -}}
{{- if eq $v.ram.arena.backing "memfd" -}}
{{- $_ := set $kv "arena" "memfd" -}}
{{- else -}}
{{- $_ := set $kv "arena" "file" -}}
{{- $_ := set $kv "arena_dir" (include "kvcached.path.arena" .) -}}
{{- end -}}
{{- $grpc := dict
      "listen" (list (printf "unix:%s/admin/kvcached.sock" $sockets))
      "socket_mode" $v.admin.socketMode
      "health_listen" (printf "0.0.0.0:%d" (int64 $v.health.port)) -}}
{{- $agent := dict
      "socket" (ternary (printf "%s/agent/agent.sock" $sockets) "" $v.agent.enabled)
      "mode" $v.agent.mode
      "group" $v.agent.group -}}
{{- $metrics := dict "listen" (printf "0.0.0.0:%d" (int64 $v.metrics.port)) -}}
{{- $log := dict "level" $v.log.level "format" $v.log.format -}}
{{- $cfg := dict "kv" $kv "grpc" $grpc "agent" $agent "metrics" $metrics "log" $log -}}
{{- if $v.peers.enabled -}}
{{- $certs := include "kvcached.path.certs" . -}}
{{- $_ := set $cfg "quic" (dict
      "listen" (printf "0.0.0.0:%d" (int64 $v.peers.port))
      "ca" (printf "%s/ca.pem" $certs)
      "lane" $v.peers.lane
      "max_datagram_size" $v.peers.maxDatagramSize) -}}
{{- $cluster := dict "etcd" $v.peers.etcd.endpoints "prefix" $v.peers.etcd.prefix -}}
{{- if $v.peers.etcd.tlsSecret -}}
{{- $etcd := include "kvcached.path.etcd" . -}}
{{- $_ := set $cluster "etcd_ca" (printf "%s/ca.pem" $etcd) -}}
{{- $_ := set $cluster "etcd_cert" (printf "%s/cert.pem" $etcd) -}}
{{- $_ := set $cluster "etcd_key" (printf "%s/key.pem" $etcd) -}}
{{- end -}}
{{- $_ := set $cfg "cluster" $cluster -}}
{{- end -}}
{{- if $v.tenants.enabled -}}
{{- $uids := dict -}}
{{- $gids := dict -}}
{{- $agentSockets := dict -}}
{{- $ramShares := dict -}}
{{- $ssdShares := dict -}}
{{- range $name, $t := $v.tenants.members -}}
{{- $t = default (dict) $t -}}
{{- $_ := set $agentSockets $name (printf "%s/tenants/%s/agent.sock" $sockets $name) -}}
{{- with $t.uids }}{{ $_ := set $uids $name . }}{{ end -}}
{{- with $t.gids }}{{ $_ := set $gids $name . }}{{ end -}}
{{- with $t.ramShare }}{{ $_ := set $ramShares $name (dict "$toml" (include "kvcached.share" .)) }}{{ end -}}
{{- with $t.ssdShare }}{{ $_ := set $ssdShares $name (dict "$toml" (include "kvcached.share" .)) }}{{ end -}}
{{- end -}}
{{- $tenants := dict "default" $v.tenants.default "agent_sockets" $agentSockets "uids" $uids "gids" $gids
      "ram_shares" $ramShares "ssd_shares" $ssdShares -}}
{{- if $v.tenants.keySecret -}}
{{- $_ := set $tenants "key_file" (include "kvcached.path.tenantKey" .) -}}
{{- end -}}
{{- $_ := set $cfg "tenants" $tenants -}}
{{- end -}}
{{- /* Keys the container's args set per pod: extraConfig may not set them either. */ -}}
{{- $perPod := dict "quic" (list "cert" "key") "cluster" (list "name" "advertise") -}}
{{- range $section, $table := $v.extraConfig -}}
{{- if not (kindIs "map" $table) -}}
{{- fail (printf "extraConfig.%s must be a table of keys (kvcached.toml's [%s])" $section $section) -}}
{{- end -}}
{{- $into := default (dict) (get $cfg $section) -}}
{{- range $key, $value := $table -}}
{{- if or (hasKey $into $key) (has $key (default (list) (get $perPod $section))) -}}
{{- fail (printf "extraConfig.%s.%s is set by the chart from its values (see values.yaml): set the value, not extraConfig" $section $key) -}}
{{- end -}}
{{- $_ := set $into $key $value -}}
{{- end -}}
{{- $_ := set $cfg $section $into -}}
{{- end -}}
{{- toJson $cfg -}}
{{- end -}}

{{/*
kvcached.toml from kvcached.config: sections and keys sorted.
*/}}
{{- define "kvcached.toml" -}}
# kvcached.toml rendered by the kvcached Helm chart from its values; every key is described in
# config/kvcached.toml of the kvcached repository. Per-pod settings come as --set arguments.
{{- $cfg := include "kvcached.config" . | fromJson }}
{{- range $section := keys $cfg | sortAlpha }}
{{- $table := get $cfg $section }}

[{{ $section }}]
{{- range $key := keys $table | sortAlpha }}
{{ $key }} = {{ include "kvcached.tomlValue" (get $table $key) }}
{{- end }}
{{- end }}
{{- end -}}
