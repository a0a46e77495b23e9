{{/*
Naming, labels and the RBAC rule sets shared by the templates.
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "pd-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects: fullnameOverride, else `<release>-<name>`, or just the
release name when it already contains the chart name. 63 characters at most (DNS label).
*/}}
{{- define "pd-operator.fullname" -}}
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

{{/* `name-version` for the helm.sh/chart label. */}}
{{- define "pd-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "pd-operator.labels" -}}
helm.sh/chart: {{ include "pd-operator.chart" . }}
{{ include "pd-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator pod; immutable once installed (Deployment selector). */}}
{{- define "pd-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "pd-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pd-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference; the tag defaults to the chart's appVersion. */}}
{{- define "pd-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The operator's RBAC rules. All of them are on namespaced resources: granted by the ClusterRole
when all namespaces are watched, else by a Role in each watched namespace. Nothing needs to be
cluster-scoped: the operator turns kopf's CRD and namespace scanning off (settings.py), and
discovery (/api, /apis) is open to every authenticated user.
Each verb is what pd_operator.kube, kopf's watches or RBAC escalation prevention need; the
integration test tests/integration/test_chart_install.py runs the operator under exactly these.
*/}}
{{- define "pd-operator.rules" -}}
# PDDeployments: kopf lists and watches them (event handlers only, so kopf writes nothing to
# them: no annotations, no finalizers); the reconcile reads each one and PUTs its status, and
# patches spec.<role>.replicas with a count set on the role's PDRole (`kubectl scale`, HPA).
- apiGroups: ["pd.serving.dev"]
  resources: ["pddeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pd.serving.dev"]
  resources: ["pddeployments/status"]
  verbs: ["update"]
# Children carry `blockOwnerDeletion: true`; with the OwnerReferencesPermissionEnforcement
# admission plugin (OpenShift, hardened clusters) that requires `update` on the owner's
# finalizers. No finalizer is ever added.
- apiGroups: ["pd.serving.dev"]
  resources: ["pddeployments/finalizers"]
  verbs: ["update"]
# PDRoles: one scale target per role, created by the operator (owned by the PDDeployment),
# its count carried both ways (patch), its status PUT.
- apiGroups: ["pd.serving.dev"]
  resources: ["pdroles"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["pd.serving.dev"]
  resources: ["pdroles/status"]
  verbs: ["update"]
# TransferAgents: read for transfer health and steered through their spec. The operator also
# creates a Role granting these verbs to the engine pods' agent, and RBAC escalation
# prevention requires the operator to hold every permission it grants (build/rbac.py).
- apiGroups: ["pd.serving.dev"]
  resources: ["transferagents"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
- apiGroups: ["pd.serving.dev"]
  resources: ["transferagents/status"]
  verbs: ["get", "update", "patch"]
# Engine pods: each engine instance's pod is created and deleted by the operator (a rollout,
# a scale, a replacement; each drains in its preStop hook first), watched (events map to
# their PDDeployment); `patch` gives a retired StatefulSet's pod (the previous release's
# children) its PDDeployment as owner; `pods/status` sets the transfer readiness gate
# condition the pod template declares.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# Children of a PDDeployment: watched, listed by label, server-side applied (a create or a
# patch), deleted when no longer desired.
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# The previous release's role StatefulSets: watched, and deleted with their pods orphaned
# on upgrade (the engine rollout then replaces those pods under load).
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "delete"]
# Each role's pod template per revision, kept for a rollback: created with a revision's
# first instances, read by name on a rollback, listed and pruned when a rollout ends (not
# watched: the operator does not cache them).
- apiGroups: ["apps"]
  resources: ["controllerrevisions"]
  verbs: ["get", "list", "create", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# The per-PDDeployment transfer key and identity authority Secrets: watched (a deleted one
# is recreated at once), read to keep their keys, server-side applied (create, patch); the
# garbage collector removes them with their PDDeployment. Each engine instance's identity
# Secret is created before its pod and deleted after it (delete), one issued by an authority
# no longer in force replaced. Engine pods need no RBAC for any of them: they reach a pod as
# volumes.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Events about PDDeployments. Both kopf and the operator (kube.create_event) POST core/v1
# Events and never update them, so neither `patch`, `list` nor events.k8s.io is granted.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
