"""Offline checks for the Kubernetes manifests in infra/: what an API server, the KubeRay operator
and our deployment policy would reject, without a cluster.

    python infra/check.py                      # every overlay under infra/overlays
    python infra/check.py infra/overlays/prod  # one overlay

Each overlay is rendered with the real Kustomize (``kubectl kustomize``); RayJobs embedded in
ConfigMaps (the CronJob's template) are checked like rendered objects. Reported:

- ray.io objects against the KubeRay 1.7 CRD schemas (../shared/kuberay-crds/v1.7.0), and
  monitoring.coreos.com objects (PodMonitor, ServiceMonitor, PrometheusRule) against the
  prometheus-operator 0.93 CRD schemas (../shared/prometheus-operator-crds), with unknown fields
  rejected as by strict field validation and the CRDs' CEL rules evaluated;
  plus the KubeRay operator's own admission rules (a port of ray-operator's ValidateRayClusterSpec,
  ValidateRayJobSpec, ValidateRayCronJobSpec and ValidateRayServiceSpec) and a RayService's
  serveConfigV2 being a Serve config whose applications name an import path;
- built-in kinds that ``kubernetes-validate`` rejects (strict) for Kubernetes ``K8S_VERSION``;
- every pod template (Ray head + injected autoscaler, worker groups, RayJob submitters, CronJob
  pods): Pod Security "restricted", requests and limits for cpu and memory, pinned images, no
  literal credentials, GPU limits exactly on GPU groups;
- exposure: LoadBalancer / NodePort Services, Ingresses, non-ClusterIP Ray head or serve services,
  and NetworkPolicies that let anything outside the namespace reach the head's 8265, 10001 or 6379
  (only the KubeRay operator may reach 8265); a RayService's Serve port must be reachable from the
  namespace its ``puma.io/clients-namespace`` annotation names and from nothing else outside; Ray's
  metrics port 8080 is reachable from Prometheus (namespace ``PROMETHEUS_NAMESPACE``) on every Ray pod
  a monitor scrapes, and from nothing else outside;
- dangling references (service accounts, ConfigMaps, Roles, RayClusters named by clusterSelector), and
  monitors that scrape nothing: each PodMonitor / ServiceMonitor selects at least one pod / Service
  (those KubeRay creates included, and the Pushgateway installed out of band), each port it scrapes is
  a named port of what it selects, and no Ray head is scraped through two Services;
- scheduled runs never overlap (one writer per index): a CronJob has concurrencyPolicy Forbid and a
  startingDeadlineSeconds, one that creates RayJobs never retries its pod, and every scheduled
  RayJob (a RayCronJob's, or one a CronJob creates) stops before the schedule's next run.

Exit status 1 if anything is reported.
"""

from __future__ import annotations

import copy
import datetime
import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

INFRA = Path(__file__).resolve().parent
ROOT = INFRA.parent
CRD_DIR = Path(os.environ.get("PUMA_KUBERAY_CRDS", ROOT.parent / "shared" / "kuberay-crds" / "v1.7.0"))
PROMETHEUS_CRD_DIR = Path(os.environ.get("PUMA_PROMETHEUS_CRDS",
                                         ROOT.parent / "shared" / "prometheus-operator-crds"))  # v0.93.0
K8S_VERSION = "1.33.0"
RAY_GROUP = "ray.io"
MONITORING_GROUP = "monitoring.coreos.com"
CRD_SOURCES = {  # API group -> (its CRDs, the variable that points elsewhere)
    RAY_GROUP: (CRD_DIR, "PUMA_KUBERAY_CRDS"),
    MONITORING_GROUP: (PROMETHEUS_CRD_DIR, "PUMA_PROMETHEUS_CRDS"),
}
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 4 MB of YAML
IMAGE_APP_DIR = "/home/ray/app"  # where the images hold the repository (cluster/Dockerfile.*)
HEAD_PORTS = (8265, 10001, 6379)
SERVE_PORT = 8000  # Serve's HTTP port unless serveConfigV2 sets http_options.port
CLIENTS_ANNOTATION = "puma.io/clients-namespace"  # on a RayService: the namespace of its clients
OPERATOR_NAMESPACE = "kuberay-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
METRICS_PORT = 8080  # KubeRay starts every Ray node with --metrics-export-port=8080, container port "metrics"
PROMETHEUS_NAMESPACE = "monitoring"  # kube-prometheus-stack's; infra/monitoring/networkpolicy.yaml names it
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # prometheus-operator labels its pods so


class CheckError(RuntimeError):
    """The manifests could not be rendered or loaded; the message says what is missing."""


# ----------------------------------------------------------------------------- rendering


def render(kustomization_dir: Path) -> list[dict]:
    """The objects ``kubectl kustomize DIR`` renders (the real Kustomize, v5 inside kubectl)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise CheckError("kubectl (with its built-in kustomize) is not on PATH; install kubectl >= 1.27")
    proc = subprocess.run([kubectl, "kustomize", str(kustomization_dir)], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise CheckError(f"kubectl kustomize {kustomization_dir} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.load_all(proc.stdout, Loader=SafeLoader) if doc]


def embedded_objects(objs: list[dict]) -> list[dict]:
    """Kubernetes objects stored as YAML in ConfigMap data (e.g. the CronJob's RayJob template)."""
    found = []
    for cm in (o for o in objs if o.get("kind") == "ConfigMap"):
        for value in (cm.get("data") or {}).values():
            doc = yaml.load(value, Loader=SafeLoader)  # a Grafana dashboard's JSON too (JSON is YAML)
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
                doc.setdefault("metadata", {}).setdefault("namespace", cm["metadata"].get("namespace"))
                found.append(doc)
    return found


def overlays() -> list[Path]:
    """Every overlay directory under infra/overlays."""
    return sorted(p.parent for p in (INFRA / "overlays").glob("*/kustomization.yaml"))


def describe(obj: dict) -> str:
    """``Kind/name`` (or ``Kind/generateName*``) for messages."""
    meta = obj.get("metadata", {})
    return f"{obj.get('kind')}/{meta.get('name') or str(meta.get('generateName', '?')) + '*'}"


# ----------------------------------------------------------------------------- CRD schemas

# CEL rules (x-kubernetes-validations) of the KubeRay 1.7 CRDs, as Python. Transition rules
# (those reading oldSelf) only apply to updates and are skipped; any other rule not listed here
# is reported, so a manifest never passes with a rule nobody evaluated.
CEL_RULES: dict[str, Callable[[object], bool]] = {
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))":
        lambda s: not (("onSuccess" in s or "onFailure" in s) and "deletionRules" in s),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))":
        lambda s: ("onSuccess" in s and "onFailure" in s) or "deletionRules" in s,
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))":
        lambda s: not ("jobStatus" in s and "jobDeploymentStatus" in s),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)":
        lambda s: "jobStatus" in s or "jobDeploymentStatus" in s,
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']":
        lambda s: s in ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"),
}


def _cel_keyword(validator, rules, instance, schema) -> Iterator[jsonschema.ValidationError]:
    for rule in rules:
        text = rule["rule"]
        if "oldSelf" in text:
            continue
        check = CEL_RULES.get(text)
        if check is None:
            yield jsonschema.ValidationError(f"CEL rule {text!r} is not evaluated offline; add it to "
                                             "CEL_RULES")
        elif not check(instance):
            yield jsonschema.ValidationError(f"{rule.get('message', text)} (CEL: {text})")


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


CrdValidatorClass = jsonschema.validators.extend(jsonschema.Draft7Validator,
                                                 {"x-kubernetes-validations": _cel_keyword})


def strict_schema(node: dict) -> dict:
    """An OpenAPI v3 CRD schema as JSON Schema that rejects unknown fields like an API server.

    Objects with ``properties`` and no ``x-kubernetes-preserve-unknown-fields`` get
    ``additionalProperties: false``; ``nullable`` becomes a null type; int-or-string quantities
    are already ``anyOf`` [integer, string]."""
    out = dict(node)
    if "properties" in node:
        out["properties"] = {k: strict_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = strict_schema(node[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [strict_schema(s) for s in node[key]]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


@functools.cache
def crd_validators(crd_dir: Path = CRD_DIR, variable: str = "PUMA_KUBERAY_CRDS"
                   ) -> dict[tuple[str, str], jsonschema.Validator]:
    """(apiVersion, kind) -> validator for every served version of every CRD in ``crd_dir``."""
    if not crd_dir.is_dir():
        raise CheckError(f"CRDs not found at {crd_dir}; set {variable} to their folder")
    validators = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=SafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict_schema(version["schema"]["openAPIV3Schema"])
            key = (f"{group}/{version['name']}", kind)
            validators[key] = CrdValidatorClass(schema, format_checker=FORMATS)
    return validators


def schema_errors(obj: dict) -> list[str]:
    """Why an API server would reject ``obj`` (CRD schemas for ray.io and monitoring.coreos.com,
    kubernetes-validate otherwise)."""
    where = describe(obj)
    group = obj.get("apiVersion", "").partition("/")[0]
    if group in CRD_SOURCES:
        validator = crd_validators(*CRD_SOURCES[group]).get((obj["apiVersion"], obj["kind"]))
        if validator is None:
            return [f"{where}: no CRD serves {obj['apiVersion']} {obj['kind']}"]
        errors = [f"{where}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(obj)]
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
        return errors + [f"{where}: metadata: {e}" for e in _builtin_errors(meta)]
    return [f"{where}: {e}" for e in _builtin_errors(obj)]


def _builtin_errors(obj: dict) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path)) or '<root>'}: {exc.message}"]
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
        return [f"kubernetes-validate has no schema: {exc}"]
    return []


# ----------------------------------------------------------------------------- KubeRay admission

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = {"RayCluster": 53, "RayJob": 47, "RayCronJob": 47, "RayService": 47}  # utils/constant.go
UPGRADE_TYPES = ("NewClusterWithIncrementalUpgrade", "NewCluster", "None")
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
RAY_START_RESOURCE_KEYS = ("num-cpus", "num-gpus", "memory", "resources")


def kuberay_errors(obj: dict) -> list[str]:
    """What the KubeRay 1.7 operator refuses to reconcile (ray-operator utils/validation.go)."""
    kind, where, spec = obj.get("kind"), describe(obj), obj.get("spec", {})
    errors = _name_errors(kind, obj.get("metadata", {}))
    if kind == "RayCluster":
        errors += cluster_spec_errors(spec)
    elif kind == "RayJob":
        errors += job_spec_errors(spec)
    elif kind == "RayCronJob":
        errors += cron_errors(spec.get("schedule", "")) + job_spec_errors(spec.get("jobTemplate") or {})
    elif kind == "RayService":
        errors += service_spec_errors(spec)
    return [f"{where}: {e}" for e in errors]


def _name_errors(kind: str, meta: dict) -> list[str]:
    name = meta.get("name") or (meta.get("generateName", "") + "x" * 5)
    limit = MAX_NAME.get(kind, 253)
    errors = [] if len(name) <= limit else [f"name {name!r} is longer than {limit} characters"]
    return errors + ([] if DNS1035.match(name) else [f"name {name!r} is not a DNS-1035 label"])


def cluster_spec_errors(spec: dict) -> list[str]:
    """ValidateRayClusterSpec, for the fields these manifests use."""
    groups = [("head", spec.get("headGroupSpec", {}))]
    groups += [(g.get("groupName", "?"), g) for g in spec.get("workerGroupSpecs", [])]
    errors = [err for name, group in groups for err in _group_errors(name, group)]
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    v2 = autoscaling and spec.get("autoscalerOptions", {}).get("version") == "v2"
    for name, group in groups:
        restart = group.get("template", {}).get("spec", {}).get("restartPolicy")
        if v2 and restart not in (None, "Never"):
            errors.append(f"{name}: restartPolicy must be Never or unset with autoscaler v2")
        if autoscaling and group.get("suspend"):
            errors.append(f"{name}: a worker group cannot be suspended with the autoscaler enabled")
    if spec.get("authOptions", {}).get("mode") == "token" and _version(spec.get("rayVersion")) < (2, 52, 0):
        errors.append("authOptions.mode 'token' needs rayVersion >= 2.52.0")
    return errors


def _group_errors(name: str, group: dict) -> list[str]:
    errors = []
    if not group.get("template", {}).get("spec", {}).get("containers"):
        errors.append(f"{name}: the pod template needs at least one container")
    params = group.get("rayStartParams", {})
    if group.get("resources") and any(params.get(k) for k in RAY_START_RESOURCE_KEYS):
        errors.append(f"{name}: resources set both in rayStartParams and resources")
    if "labels" in params:
        errors.append(f"{name}: rayStartParams['labels'] is not supported; use the labels field")
    low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
    if "groupName" in group and not low <= group.get("replicas", low) <= high:
        errors.append(f"{name}: need minReplicas <= replicas <= maxReplicas, got {low}, "
                      f"{group.get('replicas')}, {high}")
    return errors


def _version(text: str | None) -> tuple[int, ...]:
    parts = re.findall(r"\d+", text or "")
    return tuple(int(p) for p in parts[:3]) if parts else (0,)


def job_spec_errors(spec: dict) -> list[str]:
    """ValidateRayJobSpec (and its deletion-strategy rules)."""
    shutdown, selector = bool(spec.get("shutdownAfterJobFinishes")), spec.get("clusterSelector") or {}
    mode = spec.get("submissionMode", "K8sJobMode")
    checks = [
        (mode in SUBMISSION_MODES, f"submissionMode {mode!r} is not one of {list(SUBMISSION_MODES)}"),
        (not (spec.get("suspend") and not shutdown), "suspend needs shutdownAfterJobFinishes"),
        (not (spec.get("ttlSecondsAfterFinished", 0) > 0 and not shutdown),
         "ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true"),
        (bool(spec.get("rayClusterSpec") or selector),
         "one of rayClusterSpec or clusterSelector must be set"),
        (not selector or bool(selector.get("ray.io/cluster")), "clusterSelector needs ray.io/cluster"),
        (not (selector and mode == "SidecarMode"), "clusterSelector is not supported in SidecarMode"),
        (spec.get("activeDeadlineSeconds", 1) > 0, "activeDeadlineSeconds must be positive"),
        (spec.get("backoffLimit", 0) >= 0, "backoffLimit must be >= 0"),
        (not (mode == "InteractiveMode" and spec.get("backoffLimit", 0) > 0),
         "backoffLimit is incompatible with InteractiveMode"),
        (not (mode == "SidecarMode" and ("submitterPodTemplate" in spec or "submitterConfig" in spec)),
         "SidecarMode supports neither submitterPodTemplate nor submitterConfig"),
        (_runtime_env_ok(spec.get("runtimeEnvYAML")), "runtimeEnvYAML is not a YAML mapping"),
    ]
    errors = [msg for ok, msg in checks if not ok]
    restart = spec.get("submitterPodTemplate", {}).get("spec", {}).get("restartPolicy", "Never")
    if restart not in ("Never", "OnFailure"):
        errors.append(f"submitterPodTemplate.restartPolicy {restart!r}: a Job pod needs Never or OnFailure")
    if spec.get("rayClusterSpec"):
        errors += [f"rayClusterSpec: {e}" for e in cluster_spec_errors(spec["rayClusterSpec"])]
    return errors + deletion_errors(spec)


def _runtime_env_ok(text: str | None) -> bool:
    if not text:
        return True
    try:
        return isinstance(yaml.safe_load(text), dict)
    except yaml.YAMLError:
        return False


def deletion_errors(spec: dict) -> list[str]:
    """validateDeletionConfiguration / validateDeletionRules."""
    strategy = spec.get("deletionStrategy")
    if not strategy:
        return []
    rules = strategy.get("deletionRules") or []
    errors = ["deletionRules and shutdownAfterJobFinishes are mutually exclusive"] \
        if rules and spec.get("shutdownAfterJobFinishes") else []
    autoscaling = bool((spec.get("rayClusterSpec") or {}).get("enableInTreeAutoscaling"))
    ttls: dict[str, dict[str, int]] = {}
    for i, rule in enumerate(rules):
        policy, cond = rule.get("policy"), rule.get("condition", {})
        if spec.get("clusterSelector") and policy in ("DeleteCluster", "DeleteWorkers"):
            errors.append(f"deletionRules[{i}]: {policy} is not supported with clusterSelector")
        if autoscaling and policy == "DeleteWorkers":
            errors.append(f"deletionRules[{i}]: DeleteWorkers is not supported with autoscaling")
        by_policy = ttls.setdefault(cond.get("jobStatus", ""), {})
        if policy in by_policy:
            errors.append(f"deletionRules[{i}]: duplicate rule for {policy} and {cond.get('jobStatus')}")
        by_policy[policy] = cond.get("ttlSeconds", 0)
    for status, by_policy in ttls.items():
        order = [by_policy[p] for p in ("DeleteWorkers", "DeleteCluster", "DeleteSelf") if p in by_policy]
        if order != sorted(order):
            errors.append(f"deletionRules for {status or 'jobDeploymentStatus'}: TTLs must grow "
                          "Workers <= Cluster <= Self")
    return errors


def service_spec_errors(spec: dict) -> list[str]:
    """ValidateRayServiceSpec, plus serveConfigV2 being a Serve config (what the operator submits)."""
    cluster = spec.get("rayClusterConfig") or {}
    errors = [f"rayClusterConfig: {e}" for e in cluster_spec_errors(cluster)]
    if cluster.get("headGroupSpec", {}).get("headService", {}).get("metadata", {}).get("name"):
        errors.append("rayClusterConfig.headGroupSpec.headService.metadata.name must not be set")
    upgrade = (spec.get("upgradeStrategy") or {}).get("type")
    if upgrade is not None and upgrade not in UPGRADE_TYPES:
        errors.append(f"upgradeStrategy.type {upgrade!r} is not one of {list(UPGRADE_TYPES)}")
    if spec.get("rayClusterDeletionDelaySeconds", 0) < 0:
        errors.append("rayClusterDeletionDelaySeconds must be >= 0")
    if upgrade == "NewClusterWithIncrementalUpgrade":
        options = (spec.get("upgradeStrategy") or {}).get("clusterUpgradeOptions") or {}
        if not cluster.get("enableInTreeAutoscaling"):
            errors.append("NewClusterWithIncrementalUpgrade needs the Ray autoscaler")
        if not options.get("gatewayClassName") or options.get("intervalSeconds", 0) <= 0 \
                or not 0 <= options.get("stepSizePercent", -1) <= 100:
            errors.append("NewClusterWithIncrementalUpgrade needs clusterUpgradeOptions with "
                          "gatewayClassName, intervalSeconds > 0 and stepSizePercent in [0, 100]")
    return errors + serve_config_errors(spec.get("serveConfigV2"))


def serve_config(text: str | None) -> dict:
    """serveConfigV2 as a mapping ({} when absent or not YAML)."""
    try:
        config = yaml.safe_load(text or "")
    except yaml.YAMLError:
        return {}
    return config if isinstance(config, dict) else {}


def serve_config_errors(text: str | None) -> list[str]:
    """serveConfigV2 must be a YAML mapping with applications, each naming ``import_path: module:attr``."""
    if text is None:
        return []
    apps = serve_config(text).get("applications")
    if not isinstance(apps, list) or not apps:
        return ["serveConfigV2 is not a Serve config with a list of applications"]
    bad = [a.get("name", "?") if isinstance(a, dict) else repr(a) for a in apps
           if not isinstance(a, dict) or not re.fullmatch(r"[\w.]+:[\w.]+", str(a.get("import_path", "")))]
    return [f"serveConfigV2: application(s) {bad} need import_path 'module:attribute'"] if bad else []


def serve_port(spec: dict) -> int:
    """The Serve HTTP port of a RayService (serveConfigV2 http_options.port, default 8000)."""
    return int((serve_config(spec.get("serveConfigV2")).get("http_options") or {}).get("port", SERVE_PORT))


MONTHS = "JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split()
CRON_FIELDS = ((0, 59, {}), (0, 23, {}), (1, 31, {}), (1, 12, {m: i + 1 for i, m in enumerate(MONTHS)}),
               (0, 7, {d: i for i, d in enumerate("SUN MON TUE WED THU FRI SAT".split())}))
CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def cron_errors(schedule: str) -> list[str]:
    """robfig/cron ParseStandard: five fields (or a descriptor), each within its range."""
    text = re.sub(r"^(CRON_TZ|TZ)=\S+\s+", "", schedule.strip())
    if text in CRON_DESCRIPTORS or text.startswith("@every "):
        return []
    fields = text.split()
    if len(fields) != 5:
        return [f"schedule {schedule!r}: expected 5 fields, got {len(fields)}"]
    bad = [f for f, (lo, hi, names) in zip(fields, CRON_FIELDS, strict=True)
           if not _cron_field_ok(f, lo, hi, names)]
    return [f"schedule {schedule!r}: invalid field(s) {bad}"] if bad else []


def _cron_field_ok(field_text: str, lo: int, hi: int, names: dict[str, int]) -> bool:
    for part in field_text.split(","):
        match = re.fullmatch(r"(\*|\?|[0-9A-Za-z]+(?:-[0-9A-Za-z]+)?)(?:/(\d+))?", part)
        if not match or (match.group(2) is not None and int(match.group(2)) < 1):
            return False
        if match.group(1) in ("*", "?"):
            continue
        bounds = [names.get(x.upper(), int(x) if x.isdigit() else -1) for x in match.group(1).split("-")]
        if any(not lo <= b <= hi for b in bounds) or bounds != sorted(bounds):
            return False
    return True


CRON_INTERVALS = {"@hourly": 3600, "@daily": 86400, "@midnight": 86400, "@weekly": 7 * 86400,
                  "@monthly": 28 * 86400, "@yearly": 365 * 86400, "@annually": 365 * 86400}
CRON_DAYS_CHECKED = 731  # two years from 2024-01-01 (a leap year): every calendar gap occurs


def cron_min_interval(schedule: str) -> int | None:
    """The shortest time in seconds between two runs of ``schedule`` (robfig/cron semantics: day of
    month OR day of week when both are restricted); None if it does not parse or runs at most once
    in the two years checked."""
    text = re.sub(r"^(CRON_TZ|TZ)=\S+\s+", "", schedule.strip())
    if text in CRON_INTERVALS:
        return CRON_INTERVALS[text]
    if text.startswith("@every "):
        parts = re.fullmatch(r"((\d+)h)?((\d+)m)?((\d+)s)?", text[len("@every "):].strip())
        seconds = parts and sum(int(parts.group(g) or 0) * k for g, k in ((2, 3600), (4, 60), (6, 1)))
        return seconds or None
    if cron_errors(text):
        return None
    fields = text.split()
    minutes, hours, doms, months, dows = (_cron_values(f, lo, hi, names)
                                          for f, (lo, hi, names) in zip(fields, CRON_FIELDS, strict=True))
    dows = {d % 7 for d in dows}  # 7 is Sunday too
    either = fields[2] not in ("*", "?") and fields[4] not in ("*", "?")  # else both must match

    def runs_on(day: datetime.date) -> bool:
        dom, dow = day.day in doms, (day.weekday() + 1) % 7 in dows  # cron: Sunday is 0
        return day.month in months and ((dom or dow) if either else (dom and dow))

    start = datetime.date(2024, 1, 1)
    days = [d for d in (start + datetime.timedelta(n) for n in range(CRON_DAYS_CHECKED)) if runs_on(d)]
    times = sorted(h * 60 + m for h in hours for m in minutes)  # minutes of the day
    gaps = [b - a for a, b in itertools.pairwise(times)]
    gaps += [(b - a).days * 1440 + times[0] - times[-1] for a, b in itertools.pairwise(days)]
    return 60 * min(gaps) if gaps else None


def _cron_values(field_text: str, lo: int, hi: int, names: dict[str, int]) -> set[int]:
    """The values a valid cron field selects (``a/s`` is ``a-hi/s``, as in robfig/cron)."""
    values = set()
    for part in field_text.split(","):
        body, _, step = part.partition("/")
        if body in ("*", "?"):
            first, last = lo, hi
        else:
            ends = [names.get(x.upper(), int(x) if x.isdigit() else -1) for x in body.split("-")]
            first, last = ends[0], ends[-1] if len(ends) > 1 or not step else hi
        values.update(range(first, last + 1, int(step or 1)))
    return values


# ----------------------------------------------------------------------------- pod templates


@dataclass
class PodTemplate:
    """One pod template found in a manifest, with what is known about its role."""

    where: str
    spec: dict
    namespace: str | None
    ray_group: str | None = None  # "head" or a worker group name; None for non-Ray pods
    injected: list[dict] = field(default_factory=list)  # containers the operator adds (autoscaler)


def pod_templates(obj: dict) -> Iterator[PodTemplate]:
    """Every pod template inside ``obj`` (Ray clusters, RayJob submitters, CronJobs, workloads)."""
    kind, where, ns = obj.get("kind"), describe(obj), obj.get("metadata", {}).get("namespace")
    spec = obj.get("spec", {})
    if kind == "RayCluster":
        yield from _ray_cluster_pods(spec, where, ns)
    elif kind in ("RayJob", "RayCronJob"):
        job = spec.get("jobTemplate", {}) if kind == "RayCronJob" else spec
        yield from _ray_job_pods(job, where, ns)
    elif kind == "RayService":
        yield from _ray_cluster_pods(spec.get("rayClusterConfig", {}), f"{where}.rayClusterConfig", ns)
    elif kind == "CronJob":
        yield PodTemplate(where, spec["jobTemplate"]["spec"]["template"]["spec"], ns)
    elif kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
        yield PodTemplate(where, spec["template"]["spec"], ns)
    elif kind == "Pod":
        yield PodTemplate(where, spec, ns)


def _ray_job_pods(job: dict, where: str, ns: str | None) -> Iterator[PodTemplate]:
    if job.get("rayClusterSpec"):
        yield from _ray_cluster_pods(job["rayClusterSpec"], f"{where}.rayClusterSpec", ns)
    if job.get("submitterPodTemplate"):
        yield PodTemplate(f"{where}.submitterPodTemplate", job["submitterPodTemplate"].get("spec", {}), ns)


def _ray_cluster_pods(spec: dict, where: str, ns: str | None) -> Iterator[PodTemplate]:
    head = spec.get("headGroupSpec", {}).get("template", {}).get("spec", {})
    injected = []
    if spec.get("enableInTreeAutoscaling"):
        options = spec.get("autoscalerOptions", {})
        injected.append({"name": "autoscaler", "image": options.get("image", _first_image(head)),
                         "resources": options.get("resources", {}),
                         "securityContext": options.get("securityContext", {})})
    yield PodTemplate(f"{where}.headGroupSpec", head, ns, "head", injected)
    for group in spec.get("workerGroupSpecs", []):
        name = group.get("groupName", "?")
        yield PodTemplate(f"{where}.workerGroupSpecs[{name}]", group.get("template", {}).get("spec", {}),
                          ns, name)


def _first_image(pod: dict) -> str:
    containers = pod.get("containers") or [{}]
    return containers[0].get("image", "")


def containers(template: PodTemplate) -> list[dict]:
    """Init containers, containers and operator-injected containers of a pod template."""
    pod = template.spec
    return list(pod.get("initContainers", [])) + list(pod.get("containers", [])) + template.injected


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
CREDENTIAL_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|KEY_ID|API_KEY|PRIVATE_KEY|CREDENTIAL",
                             re.IGNORECASE)
CREDENTIAL_VALUE = re.compile(r"(AKIA|ASIA)[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----"
                              r"|aws_secret_access_key\s*[:=]\s*[A-Za-z0-9/+=]{20,}")
GPU_RESOURCE = "nvidia.com/gpu"


def pod_policy_errors(template: PodTemplate) -> list[str]:
    """Pod Security 'restricted' plus our rules, for one pod template and all its containers."""
    pod, errors = template.spec, []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            errors.append(f"{flag} is not allowed")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            errors.append(f"volume {volume.get('name')}: type {sorted(kinds)} is not allowed")
    for container in containers(template):
        errors += [f"container {container.get('name')}: {e}"
                   for e in container_errors(container, pod.get("securityContext", {}))]
    errors += gpu_errors(template)
    return [f"{template.where}: {e}" for e in errors]


def container_errors(container: dict, pod_sc: dict) -> list[str]:
    """Security context, resources, image pin and env rules for one container."""
    sc = container.get("securityContext", {})
    effective = {**pod_sc, **sc}
    checks = [
        (sc.get("privileged") is not True, "privileged is not allowed"),
        (sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation must be false"),
        ("ALL" in sc.get("capabilities", {}).get("drop", []), "capabilities must drop ALL"),
        (not sc.get("capabilities", {}).get("add"), "capabilities.add is not allowed"),
        (effective.get("runAsNonRoot") is True, "runAsNonRoot must be true"),
        (isinstance(effective.get("runAsUser"), int) and effective["runAsUser"] > 0,
         "runAsUser must be a non-zero uid"),
        (effective.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"),
         "seccompProfile must be RuntimeDefault or Localhost"),
        (not any(p.get("hostPort") for p in container.get("ports", [])), "hostPort is not allowed"),
    ]
    errors = [msg for ok, msg in checks if not ok] + resource_errors(container.get("resources", {}))
    return errors + image_errors(container.get("image", "")) + env_errors(container)


def resource_errors(resources: dict) -> list[str]:
    """cpu and memory requests and limits present; every limit >= its request."""
    errors = []
    for section in ("requests", "limits"):
        missing = [r for r in ("cpu", "memory") if r not in resources.get(section, {})]
        if missing:
            errors.append(f"resources.{section} lacks {missing}")
    for name, request in resources.get("requests", {}).items():
        limit = resources.get("limits", {}).get(name)
        if limit is not None and parse_quantity(limit) < parse_quantity(request):
            errors.append(f"resources: limit {name}={limit} is below its request {request}")
    return errors


QUANTITY_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def parse_quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity (``500m``, ``8Gi``, ``2``) as a number."""
    match = re.fullmatch(r"([0-9.]+(?:[eE][-+]?\d+)?)([a-zA-Z]*)", str(value))
    if not match or match.group(2) not in QUANTITY_SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}; e.g. 500m, 2, 8Gi")
    return float(match.group(1)) * QUANTITY_SUFFIX[match.group(2)]


def image_errors(image: str) -> list[str]:
    """An image must name an explicit tag other than latest, or a digest."""
    if "@sha256:" in image:
        return []
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return [f"image {image!r} has no tag; pin a version (or a digest)"]
    return [f"image {image!r}: tag 'latest' is not pinned"] if tag == "latest" else []


def env_errors(container: dict) -> list[str]:
    """Credentials only by reference: no literal value for a credential-like name or value."""
    errors = []
    for env in container.get("env", []):
        literal = str(env.get("value", ""))
        if literal and CREDENTIAL_NAME.search(env.get("name", "")):
            errors.append(f"env {env['name']} has a literal value; use valueFrom.secretKeyRef")
        if CREDENTIAL_VALUE.search(literal):
            errors.append(f"env {env.get('name')} holds what looks like a credential")
    return errors


def gpu_errors(template: PodTemplate) -> list[str]:
    """Ray groups running the GPU image limit nvidia.com/gpu (>= 1, request = limit); others none."""
    if template.ray_group is None:
        return []
    errors = []
    for container in template.spec.get("containers", []):
        gpu_image = "gpu" in container.get("image", "").rpartition("/")[2]
        limit = container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE)
        request = container.get("resources", {}).get("requests", {}).get(GPU_RESOURCE, limit)
        if gpu_image and (limit is None or parse_quantity(limit) < 1):
            errors.append(f"container {container.get('name')}: GPU image without a {GPU_RESOURCE} limit")
        if limit is not None and request != limit:
            errors.append(f"container {container.get('name')}: {GPU_RESOURCE} request must equal its limit")
        if limit is not None and not gpu_image:
            errors.append(f"container {container.get('name')}: {GPU_RESOURCE} limit on a non-GPU image")
    return errors


# ----------------------------------------------------------------------------- exposure


def exposure_errors(objs: list[dict]) -> list[str]:
    """Anything that publishes a Ray port beyond the cluster, or lets other namespaces reach it."""
    errors = []
    for obj in objs:
        kind, where = obj.get("kind"), describe(obj)
        if kind == "Service" and obj.get("spec", {}).get("type") in ("LoadBalancer", "NodePort"):
            errors.append(f"{where}: type {obj['spec']['type']} publishes ports outside the cluster")
        if kind in ("Ingress", "Gateway", "HTTPRoute", "GRPCRoute", "Route"):
            errors.append(f"{where}: {kind} objects are not allowed (the dashboard is never published)")
        for cluster_where, cluster in ray_cluster_specs(obj):
            errors += [f"{cluster_where}: {e}" for e in _head_service_errors(cluster)]
        if kind == "RayService" and (obj["spec"].get("serveService") or {}).get("spec", {}).get(
                "type", "ClusterIP") != "ClusterIP":
            errors.append(f"{where}: serveService.spec.type must be ClusterIP (clients are in the cluster)")
    return errors + network_policy_errors(objs) + serve_exposure_errors(objs) + metrics_exposure_errors(objs)


def ray_cluster_specs(obj: dict) -> Iterator[tuple[str, dict]]:
    """Every RayClusterSpec inside ``obj`` (RayCluster, RayJob, RayCronJob, RayService)."""
    kind, spec, where = obj.get("kind"), obj.get("spec", {}), describe(obj)
    if kind == "RayCluster":
        yield where, spec
    if kind == "RayService" and spec.get("rayClusterConfig"):
        yield f"{where}.rayClusterConfig", spec["rayClusterConfig"]
    job = spec.get("jobTemplate", {}) if kind == "RayCronJob" else spec if kind == "RayJob" else {}
    if job.get("rayClusterSpec"):
        yield f"{where}.rayClusterSpec", job["rayClusterSpec"]


def _head_service_errors(cluster: dict) -> list[str]:
    head = cluster.get("headGroupSpec", {})
    errors = []
    if head.get("serviceType", "ClusterIP") != "ClusterIP":
        errors.append(f"head serviceType {head['serviceType']!r}: only ClusterIP keeps it in the cluster")
    if head.get("enableIngress"):
        errors.append("enableIngress publishes the dashboard")
    if head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") != "ClusterIP":
        errors.append("headService.spec.type must be ClusterIP")
    return errors


@dataclass(frozen=True)
class Source:
    """A client: a pod (namespace + labels) or, with ``namespace=None``, an address outside."""

    namespace: str | None
    pod_labels: tuple[tuple[str, str], ...] = ()
    namespace_labels: tuple[tuple[str, str], ...] = ()


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label selector semantics (matchLabels + matchExpressions; {} matches all)."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    ops = {"In": lambda k, vs: labels.get(k) in vs, "NotIn": lambda k, vs: labels.get(k) not in vs,
           "Exists": lambda k, vs: k in labels, "DoesNotExist": lambda k, vs: k not in labels}
    expressions = selector.get("matchExpressions", [])
    return all(ops[e["operator"]](e["key"], e.get("values", [])) for e in expressions)


def ingress_allowed(policies: list[dict], namespace: str, pod_labels: dict, source: Source,
                    port: int) -> bool:
    """Whether NetworkPolicies admit ``source`` to ``port`` of a pod (Kubernetes semantics)."""
    selecting = [p for p in policies if p["metadata"].get("namespace") == namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selector_matches(p["spec"].get("podSelector", {}), pod_labels)]
    if not selecting:
        return True
    return any(_rule_admits(rule, namespace, source, port)
               for policy in selecting for rule in policy["spec"].get("ingress", []))


def _rule_admits(rule: dict, namespace: str, source: Source, port: int) -> bool:
    ports = rule.get("ports")
    if ports and not any(_port_matches(p, port) for p in ports):
        return False
    peers = rule.get("from")
    return not peers or any(_peer_admits(peer, namespace, source) for peer in peers)


def _port_matches(spec: dict, port: int) -> bool:
    value = spec.get("port")
    if value is None or isinstance(value, str):
        return True  # all ports, or a named port that may name any of the head's ports
    return value <= port <= spec.get("endPort", value)


def _peer_admits(peer: dict, namespace: str, source: Source) -> bool:
    if "ipBlock" in peer:
        return source.namespace is None  # an address; precise CIDR matching is not needed here
    if source.namespace is None:
        return False
    ns_labels = {"kubernetes.io/metadata.name": source.namespace, **dict(source.namespace_labels)}
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], ns_labels):
            return False
    elif source.namespace != namespace:
        return False
    return selector_matches(peer.get("podSelector", {}), dict(source.pod_labels))


PROMETHEUS = Source(PROMETHEUS_NAMESPACE, tuple(PROMETHEUS_LABELS.items()))
OUTSIDE_SOURCES = {
    "a pod in another namespace": Source("default", (("app", "client"),)),
    "an address outside the cluster": Source(None),
    "a pod in the operator namespace that is not the operator": Source(OPERATOR_NAMESPACE, (("app", "x"),)),
    "Prometheus": PROMETHEUS,  # may reach METRICS_PORT and nothing else (metrics_exposure_errors)
    "a pod in the Prometheus namespace that is not Prometheus": Source(PROMETHEUS_NAMESPACE, (("app", "x"),)),
    "a pod labelled like Prometheus in another namespace": Source("default", PROMETHEUS.pod_labels),
}


def network_policy_errors(objs: list[dict]) -> list[str]:
    """Ray head ports reachable from outside the namespace (only the operator may reach 8265), for the
    generic head and for each cluster's own head labels; a RayService's clients count as outside."""
    policies = [o for o in objs if o.get("kind") == "NetworkPolicy"]
    operator = Source(OPERATOR_NAMESPACE, tuple(OPERATOR_LABELS.items()))
    errors: list[str] = []
    for ns in sorted({o["metadata"].get("namespace") for o in objs if list(ray_cluster_specs(o))}):
        clients = {f"a pod of the search clients' namespace {c}": Source(c, (("app", "client"),))
                   for c in clients_namespaces(objs, ns)}
        sources = dict(OUTSIDE_SOURCES) | clients
        heads = [{"ray.io/node-type": "head", "ray.io/cluster": "any"}]
        heads += [labels for o in objs if o["metadata"].get("namespace") == ns
                  for _, cluster in ray_cluster_specs(o)
                  for group, labels in group_labels(cluster) if group == "head"]
        for head in heads:
            for port in HEAD_PORTS:
                errors += [f"namespace {ns}: {what} can reach the Ray head's port {port}"
                           for what, source in sources.items()
                           if ingress_allowed(policies, ns, head, source, port)]
                if port != 8265 and ingress_allowed(policies, ns, head, operator, port):
                    errors.append(f"namespace {ns}: the operator can reach the Ray head's port {port}")
    return list(dict.fromkeys(errors))


def clients_namespaces(objs: list[dict], ns: str | None) -> list[str]:
    """The clients' namespaces that the RayServices of namespace ``ns`` name."""
    return sorted({o["metadata"].get("annotations", {}).get(CLIENTS_ANNOTATION) for o in objs
                   if o.get("kind") == "RayService" and o["metadata"].get("namespace") == ns} - {None})


# KubeRay's labels on every Ray pod besides node type, group and cluster; a template's labels override them
KUBERAY_POD_LABELS = {"ray.io/is-ray-node": "yes", "app.kubernetes.io/name": "kuberay",
                      "app.kubernetes.io/created-by": "kuberay-operator"}


def group_labels(cluster: dict) -> list[tuple[str, dict]]:
    """(group, labels of its pods) for the head and each worker group: template labels plus KubeRay's
    (ray-operator's labelPod; node type, group and cluster are KubeRay's whatever the template says)."""
    return [(group, labels) for group, labels, _ in ray_pods(cluster)]


def ray_pods(cluster: dict) -> list[tuple[str, dict, dict]]:
    """(group, pod labels, pod spec) for the head and each worker group of a RayClusterSpec."""
    head = cluster.get("headGroupSpec", {}).get("template", {})
    out = [("head", {**KUBERAY_POD_LABELS, **head.get("metadata", {}).get("labels", {}),
                     "ray.io/node-type": "head", "ray.io/cluster": "any", "ray.io/group": "headgroup"},
            head.get("spec", {}))]
    for group in cluster.get("workerGroupSpecs", []):
        template, name = group.get("template", {}), group.get("groupName", "?")
        labels = {**KUBERAY_POD_LABELS, **template.get("metadata", {}).get("labels", {}),
                  "ray.io/node-type": "worker", "ray.io/cluster": "any", "ray.io/group": name}
        out.append((name, labels, template.get("spec", {})))
    return out


def metrics_exposure_errors(objs: list[dict]) -> list[str]:
    """Ray's metrics port (8080) on every Ray pod: reachable from Prometheus where a monitor scrapes the
    pod's namespace (or the scrape fails), and from nothing else outside the namespace."""
    policies = [o for o in objs if o.get("kind") == "NetworkPolicy"]
    monitors = [o for o in objs if o.get("kind") in MONITOR_KINDS]
    errors = []
    for obj in (o for o in objs if list(ray_cluster_specs(o))):
        ns = obj["metadata"].get("namespace")
        scraped = any(_watches(m, ns) for m in monitors)
        others = {what: s for what, s in OUTSIDE_SOURCES.items() if s != PROMETHEUS}
        others |= {f"a pod of the search clients' namespace {c}": Source(c, (("app", "client"),))
                   for c in clients_namespaces(objs, ns)}
        for where, cluster in ray_cluster_specs(obj):
            for group, labels in group_labels(cluster):
                if scraped and not ingress_allowed(policies, ns, labels, PROMETHEUS, METRICS_PORT):
                    errors.append(f"{where}: Prometheus cannot reach port {METRICS_PORT} of the {group} "
                                  "pods, which the monitors scrape")
                errors += [f"{where}: {what} can reach port {METRICS_PORT} of the {group} pods"
                           for what, source in others.items()
                           if ingress_allowed(policies, ns, labels, source, METRICS_PORT)]
    return errors


def serve_exposure_errors(objs: list[dict]) -> list[str]:
    """Each RayService's Serve port: reachable from its clients' namespace (the annotation), from nothing
    else outside its namespace, on every pod that runs a Serve proxy (head and workers)."""
    policies = [o for o in objs if o.get("kind") == "NetworkPolicy"]
    errors = []
    for service in (o for o in objs if o.get("kind") == "RayService"):
        where, ns = describe(service), service["metadata"].get("namespace")
        clients = service["metadata"].get("annotations", {}).get(CLIENTS_ANNOTATION)
        if not clients:
            errors.append(f"{where}: no {CLIENTS_ANNOTATION} annotation names the namespace of its clients")
            continue
        port, client = serve_port(service["spec"]), Source(clients, (("app", "client"),))
        for group, labels in group_labels(service["spec"].get("rayClusterConfig", {})):
            if not ingress_allowed(policies, ns, labels, client, port):
                errors.append(f"{where}: pods of namespace {clients} cannot reach port {port} of the "
                              f"{group} pods")
            errors += [f"{where}: {what} can reach port {port} of the {group} pods"
                       for what, source in OUTSIDE_SOURCES.items()
                       if source.namespace != clients and ingress_allowed(policies, ns, labels, source, port)]
    return errors


# ----------------------------------------------------------------------------- references


def reference_errors(objs: list[dict]) -> list[str]:
    """Names that point at nothing in the rendered set (per namespace)."""
    have = {(o["kind"], o["metadata"].get("namespace"), o["metadata"].get("name")) for o in objs}
    errors = []
    for obj in objs:
        ns = obj.get("metadata", {}).get("namespace")
        for kind, name in _references(obj):
            if (kind, ns, name) not in have:
                errors.append(f"{describe(obj)}: refers to {kind}/{name}, which is not in namespace {ns}")
    return errors


def _references(obj: dict) -> Iterator[tuple[str, str]]:
    for template in pod_templates(obj):
        if template.spec.get("serviceAccountName"):
            yield "ServiceAccount", template.spec["serviceAccountName"]
        for volume in template.spec.get("volumes", []):
            if "configMap" in volume:
                yield "ConfigMap", volume["configMap"]["name"]
    if obj.get("kind") == "RoleBinding":
        yield obj["roleRef"]["kind"], obj["roleRef"]["name"]
        accounts = [s["name"] for s in obj.get("subjects", []) if s["kind"] == "ServiceAccount"]
        yield from (("ServiceAccount", name) for name in accounts)
    if obj.get("kind") in ("RayJob", "RayCronJob"):
        job = obj["spec"].get("jobTemplate", {}) if obj["kind"] == "RayCronJob" else obj["spec"]
        if job.get("clusterSelector"):
            yield "RayCluster", job["clusterSelector"].get("ray.io/cluster", "")


def required_secrets(objs: list[dict]) -> set[str]:
    """Secrets the manifests reference but (by design) never contain: created out of band."""
    names = set()
    for obj in objs:
        for _, cluster in ray_cluster_specs(obj):
            names.update(filter(None, [cluster.get("authOptions", {}).get("secretName")]))
        for template in pod_templates(obj):
            for container in containers(template):
                names.update(e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e)
                names.update(e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                             if "secretKeyRef" in e.get("valueFrom", {}))
    return names


def secret_errors(objs: list[dict], text: str) -> list[str]:
    """No Secret with data in the manifests and nothing that looks like a key in the rendered text."""
    errors = [f"{describe(o)}: Secrets with data must not live in manifests" for o in objs
              if o.get("kind") == "Secret" and (o.get("data") or o.get("stringData"))]
    return errors + [f"credential-like text: {m.group(0)[:12]}..." for m in CREDENTIAL_VALUE.finditer(text)]


# ----------------------------------------------------------------------------- monitors

MONITOR_KINDS = ("PodMonitor", "ServiceMonitor")
HEAD_SERVICE_LABELS = {"ray.io/cluster": "any", "ray.io/node-type": "head", "ray.io/identifier": "any-head",
                       "app.kubernetes.io/name": "kuberay",
                       "app.kubernetes.io/created-by": "kuberay-operator"}  # KubeRay's HeadServiceLabels
KUBERAY_DEFAULT_PORTS = {"client": 10001, "gcs-server": 6379, "dashboard": 8265, "metrics": METRICS_PORT,
                         "serve": SERVE_PORT}  # a head Service's ports when the head container names none


@dataclass
class Target:
    """What a monitor may select: a pod template or a Service, with its labels and named ports."""

    where: str
    namespace: str | None
    labels: dict
    ports: dict[str, int]
    head_of: str | None = None  # a Service in front of a Ray head: that cluster


# Installed out of band (docs/kubernetes.md, "Monitoring"), as its chart creates it: the Pushgateway the
# jobs push to (prometheus-community/prometheus-pushgateway, release prometheus-pushgateway).
EXTERNAL_SERVICES = [
    Target("Service/prometheus-pushgateway (chart prometheus-pushgateway)", PROMETHEUS_NAMESPACE,
           {"app.kubernetes.io/name": "prometheus-pushgateway",
            "app.kubernetes.io/instance": "prometheus-pushgateway"},
           {"http": 9091}),
]


def pod_targets(objs: list[dict]) -> list[Target]:
    """Every pod template with its labels and named container ports; Ray pods as KubeRay makes them (its
    labels, and the port ``metrics`` it adds to the Ray container, the first, when absent)."""
    targets = []
    for obj in objs:
        ns, kind = obj.get("metadata", {}).get("namespace"), obj.get("kind")
        for where, cluster in ray_cluster_specs(obj):
            for group, labels, pod in ray_pods(cluster):
                ports = {"metrics": METRICS_PORT, **_named_ports((pod.get("containers") or [{}])[:1])}
                targets.append(Target(f"{where} {group} pods", ns, labels, ports))
        template = (obj.get("spec", {}).get("jobTemplate", {}).get("spec", {}) if kind == "CronJob"
                    else obj.get("spec", {}))
        if kind in ("CronJob", "Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
            pod = template.get("template", {})
            targets.append(Target(f"{describe(obj)} pods", ns, pod.get("metadata", {}).get("labels", {}),
                                  _named_ports(pod.get("spec", {}).get("containers", []))))
    return targets


def _named_ports(containers: list[dict]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", []) if p.get("name")}


def service_targets(objs: list[dict]) -> list[Target]:
    """The Services in ``objs`` and those KubeRay creates: a head Service per cluster (ports: the head
    container's, unnamed ones as ``<port>-port``, or KubeRay's defaults; plus ``metrics``) and, for a
    RayService, its own head Service (same pod, without app.kubernetes.io/name) and Serve Service."""
    targets = [Target(describe(o), o["metadata"].get("namespace"), o["metadata"].get("labels", {}),
                      {p.get("name", ""): p["port"] for p in o.get("spec", {}).get("ports", [])})
               for o in objs if o.get("kind") == "Service"]
    for obj in objs:
        ns, name = obj.get("metadata", {}).get("namespace"), obj.get("metadata", {}).get("name")
        for where, cluster in ray_cluster_specs(obj):
            head = (cluster.get("headGroupSpec", {}).get("template", {}).get("spec", {}).get("containers")
                    or [{}])[0]
            ports = {p.get("name") or f"{p['containerPort']}-port": p["containerPort"]
                     for p in head.get("ports", [])} or dict(KUBERAY_DEFAULT_PORTS)
            ports.setdefault("metrics", METRICS_PORT)
            targets.append(Target(f"{where} head Service", ns, dict(HEAD_SERVICE_LABELS), ports, where))
            if obj.get("kind") == "RayService":
                labels = {"ray.io/originated-from-cr-name": name, "ray.io/originated-from-crd": "RayService",
                          "ray.io/node-type": "head", "ray.io/identifier": f"{name}-head"}
                targets.append(Target(f"Service/{name}-head-svc", ns, labels, ports, where))
                serve = {"ray.io/originated-from-cr-name": name, "ray.io/originated-from-crd": "RayService",
                         "ray.io/serve": f"{name}-serve"}
                targets.append(Target(f"Service/{name}-serve-svc", ns, serve,
                                      {"serve": ports.get("serve", SERVE_PORT)}))
    return targets


def _watches(monitor: dict, namespace: str | None) -> bool:
    """Whether a monitor selects targets in ``namespace`` (its own unless namespaceSelector says)."""
    chosen = monitor.get("spec", {}).get("namespaceSelector") or {}
    if chosen.get("any"):
        return True
    return namespace in (chosen.get("matchNames") or [monitor["metadata"].get("namespace")])


def monitor_errors(objs: list[dict]) -> list[str]:
    """PodMonitors and ServiceMonitors that scrape nothing, or twice (prometheus-operator's selection)."""
    pods, services = pod_targets(objs), service_targets(objs) + EXTERNAL_SERVICES
    known = {o.get("metadata", {}).get("namespace") for o in objs} | {t.namespace for t in EXTERNAL_SERVICES}
    errors = []
    for monitor in (o for o in objs if o.get("kind") in MONITOR_KINDS
                    and o.get("apiVersion", "").startswith(MONITORING_GROUP + "/")):
        where, spec = describe(monitor), monitor.get("spec", {})
        names = (spec.get("namespaceSelector") or {}).get("matchNames") or []
        if set(names) - known:
            errors.append(f"{where}: watches namespace(s) {sorted(set(names) - known)}, where nothing is "
                          "known to check against (neither this overlay nor check.EXTERNAL_SERVICES)")
        pool = pods if monitor["kind"] == "PodMonitor" else services
        selected = [t for t in pool if _watches(monitor, t.namespace)
                    and selector_matches(spec.get("selector") or {}, t.labels)]
        if not selected:
            errors.append(f"{where}: selector {spec.get('selector')} matches no "
                          f"{'pod' if monitor['kind'] == 'PodMonitor' else 'Service'} it watches")
        endpoints = spec.get("podMetricsEndpoints") or spec.get("endpoints") or []
        for port in (e["port"] for e in endpoints if e.get("port")):
            lacking = [t.where for t in selected if port not in t.ports]
            if lacking:
                errors.append(f"{where}: port {port!r} is not a named port of {lacking}")
        heads: dict[str, list[str]] = {}
        for target in (t for t in selected if t.head_of):
            heads.setdefault(target.head_of, []).append(target.where)
        errors += [f"{where}: scrapes the head of {cluster} twice, through {found}"
                   for cluster, found in heads.items() if len(found) > 1]
    return errors


# ----------------------------------------------------------------------------- scheduled runs


def schedule_errors(objs: list[dict]) -> list[str]:
    """One writer per index: scheduled runs never overlap. A CronJob skips a slot while its last Job
    runs (concurrencyPolicy Forbid) and has a startingDeadlineSeconds; when its pod creates RayJobs
    (and ends), Forbid does not cover them, so the pod is never retried (backoffLimit 0: a retry after
    a create whose answer was lost starts a second run) and each RayJob it creates, like a
    RayCronJob's (no concurrency policy at all), stops (activeDeadlineSeconds) before the next slot."""
    errors = []
    for obj in objs:
        kind, where, spec = obj.get("kind"), describe(obj), obj.get("spec", {})
        if kind == "CronJob":
            errors += _cronjob_errors(where, spec)
            runs = [(describe(j), j.get("spec", {})) for j in created_rayjobs(obj, objs)]
            if runs and spec.get("jobTemplate", {}).get("spec", {}).get("backoffLimit") != 0:
                errors.append(f"{where}: its pod creates RayJobs, so jobTemplate.spec.backoffLimit must be 0 "
                              f"(a retried pod can start a second run)")
        elif kind == "RayCronJob":
            runs = [(where, spec.get("jobTemplate") or {})]
        else:
            continue
        schedule = spec.get("schedule", "")
        errors += [e for run_where, run in runs for e in _overlap_errors(run_where, run, schedule)]
    return errors


def created_rayjobs(cronjob: dict, objs: list[dict]) -> list[dict]:
    """The RayJobs a CronJob's pod creates: those stored in the ConfigMaps it mounts."""
    ns = cronjob["metadata"].get("namespace")
    mounted = {v["configMap"]["name"] for t in pod_templates(cronjob) for v in t.spec.get("volumes", [])
               if "configMap" in v}
    maps = [o for o in objs if o.get("kind") == "ConfigMap" and o["metadata"].get("name") in mounted
            and o["metadata"].get("namespace") == ns]
    return [o for o in embedded_objects(maps) if o.get("kind") == "RayJob"]


def _cronjob_errors(where: str, spec: dict) -> list[str]:
    errors = []
    if spec.get("concurrencyPolicy") != "Forbid":
        errors.append(f"{where}: concurrencyPolicy must be Forbid (one run at a time), "
                      f"got {spec.get('concurrencyPolicy', 'Allow (the default)')!r}")
    if not spec.get("startingDeadlineSeconds"):
        errors.append(f"{where}: no startingDeadlineSeconds (after 100 missed slots a CronJob stops "
                      f"scheduling; a late run should be skipped, not started whenever)")
    return errors


def _overlap_errors(where: str, run: dict, schedule: str) -> list[str]:
    deadline, interval = run.get("activeDeadlineSeconds"), cron_min_interval(schedule)
    if not deadline:
        return [f"{where}: a scheduled RayJob needs activeDeadlineSeconds (a hung run overlaps the next)"]
    if interval is not None and deadline >= interval:
        return [f"{where}: activeDeadlineSeconds {deadline} is not shorter than the {interval} s between "
                f"runs of {schedule!r}: two runs could write one index at once"]
    return []


# ----------------------------------------------------------------------------- entry points


def entrypoints(objs: list[dict]) -> list[tuple[str, str]]:
    """(where, command) for every RayJob entrypoint, RayCronJob templates included."""
    found = []
    for obj in objs:
        spec = obj.get("spec", {})
        job = spec.get("jobTemplate", {}) if obj.get("kind") == "RayCronJob" else spec
        if obj.get("kind") in ("RayJob", "RayCronJob") and job.get("entrypoint"):
            found.append((describe(obj), job["entrypoint"]))
    return found


def serve_applications(objs: list[dict]) -> list[tuple[str, dict]]:
    """(where, application) for every Serve application of every RayService's serveConfigV2."""
    return [(f"{describe(o)}:{app.get('name', '?')}", app) for o in objs if o.get("kind") == "RayService"
            for app in serve_config(o["spec"].get("serveConfigV2")).get("applications") or []
            if isinstance(app, dict)]


def repo_path(image_path: str) -> Path | None:
    """The repository file behind a path inside the images (``/home/ray/app/X`` -> ``ROOT/X``)."""
    prefix = IMAGE_APP_DIR + "/"
    return ROOT / image_path[len(prefix):] if image_path.startswith(prefix) else None


# ----------------------------------------------------------------------------- driver


def check_objects(objs: list[dict], text: str = "") -> list[str]:
    """Every check above over one rendered set of objects (embedded manifests included)."""
    everything = objs + embedded_objects(objs)
    errors = []
    for obj in everything:
        errors += schema_errors(obj) + kuberay_errors(obj)
        for template in pod_templates(obj):
            errors += pod_policy_errors(template)
    errors += exposure_errors(everything) + reference_errors(everything) + monitor_errors(everything)
    errors += schedule_errors(everything)
    return errors + secret_errors(everything, text or yaml.safe_dump_all(everything))


def check_overlay(path: Path) -> list[str]:
    """Render ``path`` and check it; messages are prefixed with the overlay's name."""
    objs = render(path)
    return [f"{path.name}: {e}" for e in check_objects(copy.deepcopy(objs))]


def main(argv: list[str] | None = None) -> int:
    """Check the given overlays (default: all); print every problem; 1 if there were any."""
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)] or overlays()
    errors = [e for path in paths for e in check_overlay(path)]
    for error in errors:
        print(error)
    print(f"{len(paths)} overlay(s) checked: {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
