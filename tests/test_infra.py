"""The Kubernetes manifests (infra/): rendered by the real Kustomize, checked offline the way an
API server, the KubeRay 1.7 operator and our deployment policy would, and tied to the jobs they run.

The checks live in infra/check.py (operators run it too); these tests assert that the overlays
pass them and that each check rejects what it should, so a check that silently accepts
everything fails here.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
KUBERNETES_GUIDE = ROOT / "docs" / "kubernetes.md"  # the runbook of infra/


def _load_check():
    spec = importlib.util.spec_from_file_location("infra_check", INFRA / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


check = _load_check()
OVERLAYS = {p.name: p for p in check.overlays()}


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    """The overlay's objects plus the manifests embedded in its ConfigMaps (fresh copies per test)."""
    objs = check.render(OVERLAYS[overlay])
    return tuple(objs + check.embedded_objects(objs))


def objects(overlay: str) -> list[dict]:
    return copy.deepcopy(list(rendered(overlay)))


def find(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"].get("name"))]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {[check.describe(h) for h in hits]}"
    return hits[0]


# ----------------------------------------------------------------------------- rendering


def test_both_overlays_exist_and_render_with_kustomize():
    assert set(OVERLAYS) == {"dev", "prod"}
    for overlay in OVERLAYS:
        kinds = sorted(o["kind"] for o in check.render(OVERLAYS[overlay]))
        for kind in ("Namespace", "ServiceAccount", "NetworkPolicy", "RayCluster", "RayJob"):
            assert kind in kinds, f"{overlay} renders no {kind}: {kinds}"


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_one_namespace_per_overlay_and_everything_in_it(overlay):
    objs = objects(overlay)
    namespace = find(objs, "Namespace")["metadata"]["name"]
    assert namespace == {"dev": "puma-dev", "prod": "puma"}[overlay]
    stray = [check.describe(o) for o in objs if o["kind"] != "Namespace"
             and o["metadata"].get("namespace") != namespace]
    assert not stray


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_every_overlay_schedules_embedding_exactly_once(overlay):
    objs = objects(overlay)
    schedulers = [o for o in objs if o["kind"] in ("RayCronJob", "CronJob")]
    assert len(schedulers) == 1, [check.describe(o) for o in schedulers]
    if schedulers[0]["kind"] == "CronJob":  # the plain CronJob creates the embedded RayJob
        embedded = [o for o in objs if o["kind"] == "RayJob" and "generateName" in o["metadata"]]
        assert len(embedded) == 1


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_on_demand_runs_are_labelled_apart_from_the_platform(overlay):
    """`kubectl apply -k OVERLAY -l '!puma.io/run'` installs the platform without starting runs."""
    labelled = {check.describe(o): o["metadata"]["labels"]["puma.io/run"] for o in objects(overlay)
                if "puma.io/run" in o["metadata"].get("labels", {})}
    assert labelled == {"RayJob/puma-train": "train", "RayJob/puma-sweep": "sweep"}


def test_the_two_scheduling_variants_run_the_same_rayjob():
    components = INFRA / "components"
    cron = yaml.safe_load((components / "embed-raycronjob" / "raycronjob.yaml").read_text())
    template = yaml.safe_load((components / "embed-cronjob" / "files" / "rayjob-embed.yaml").read_text())
    plain = yaml.safe_load((components / "embed-cronjob" / "cronjob.yaml").read_text())
    assert cron["spec"]["jobTemplate"] == template["spec"]
    assert (cron["spec"]["schedule"], cron["spec"]["timeZone"]) == (plain["spec"]["schedule"],
                                                                    plain["spec"]["timeZone"])


def _scheduled_embedding(objs: list[dict]) -> tuple[dict, dict]:
    """(the overlay's scheduler, the spec of the RayJob each of its runs is)."""
    scheduler = next(o for o in objs if o["kind"] in ("RayCronJob", "CronJob"))
    if scheduler["kind"] == "RayCronJob":
        return scheduler, scheduler["spec"]["jobTemplate"]
    created = check.created_rayjobs(scheduler, objs)
    assert len(created) == 1, [check.describe(j) for j in created]
    return scheduler, created[0]["spec"]


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_scheduled_embedding_reconciles_its_catalogues_one_run_at_a_time(overlay):
    """Each run is `jobs/embed.py --watch PREFIX` (or --catalogue URI) into index.uri, and the index
    has one writer: the plain CronJob forbids concurrent runs and never retries its creator pod,
    and every run (RayCronJob has no concurrency policy) stops before the next one is due."""
    objs = objects(overlay)
    scheduler, run = _scheduled_embedding(objs)
    argv = shlex.split(run["entrypoint"])
    assert argv[1] == "/home/ray/app/jobs/embed.py"
    assert argv[2] in ("--watch", "--catalogue") and argv[3].startswith("s3://")
    assert any(a.startswith("index.uri=s3://") for a in argv)
    spec = scheduler["spec"]
    if scheduler["kind"] == "CronJob":
        assert spec["concurrencyPolicy"] == "Forbid"
        assert 0 < spec["startingDeadlineSeconds"] <= 6 * 3600
        assert spec["jobTemplate"]["spec"]["backoffLimit"] == 0
    assert 0 < run["activeDeadlineSeconds"] < check.cron_min_interval(spec["schedule"])
    assert check.schedule_errors(objs) == []


def _job_config(argv: list[str]):
    """The config a job's command line resolves to (--config FILE and key=value overrides)."""
    from puma.config import load_config

    config = check.repo_path(argv[argv.index("--config") + 1]) if "--config" in argv else None
    return load_config(config, [a for a in argv if "=" in a and not a.startswith("-")])


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_scheduled_embedding_follows_the_trained_model_into_the_served_index(overlay):
    """The nightly run embeds with the training run's best checkpoint (a new best rolls out a new
    version) into the index the search service serves; the service names the run, not a pinned
    embed.checkpoint, so a restart before the new version is live falls back to the live model."""
    from puma.checkpoint import best_checkpoint_uri

    objs = objects(overlay)
    embed = _job_config(shlex.split(_scheduled_embedding(objs)[1]["entrypoint"]))
    train = _job_config(shlex.split(find(objs, "RayJob", "puma-train")["spec"]["entrypoint"]))
    (_, app), = check.serve_applications(objs)
    serve = _job_config(["--config", app["args"]["config"]] +
                        [f"{k}={v}" for k, v in app["args"].items() if k != "config"])
    assert best_checkpoint_uri(embed) == best_checkpoint_uri(train) == best_checkpoint_uri(serve)
    assert embed.embed.checkpoint == serve.embed.checkpoint == ""
    assert embed.index.uri == serve.index.uri


SCHEDULE_BREAKS = {
    "concurrent CronJob runs": ("prod", "CronJob", "spec.concurrencyPolicy", "Allow",
                                "concurrencyPolicy must be Forbid"),
    "no starting deadline": ("prod", "CronJob", "spec.startingDeadlineSeconds", 0, "startingDeadlineSeconds"),
    "creator pod retried": ("prod", "CronJob", "spec.jobTemplate.spec.backoffLimit", 2,
                            "backoffLimit must be 0"),
    "CronJob due before its RayJob stops": ("prod", "CronJob", "spec.schedule", "0 */6 * * *",
                                            "not shorter than the 21600 s"),
    "RayCronJob due before its run stops": ("dev", "RayCronJob", "spec.schedule", "@hourly",
                                            "not shorter than the 3600 s"),
    "RayCronJob run without a deadline": ("dev", "RayCronJob", "spec.jobTemplate.activeDeadlineSeconds", 0,
                                          "needs activeDeadlineSeconds"),
}


@pytest.mark.parametrize("case", sorted(SCHEDULE_BREAKS))
def test_schedule_check_rejects_runs_that_can_overlap(case):
    overlay, kind, path, value, expected = SCHEDULE_BREAKS[case]
    objs = objects(overlay)
    _set(find(objs, kind), path, value)
    errors = check.schedule_errors(objs)
    assert any(expected in e for e in errors), errors


# ----------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_ray_objects_validate_against_the_kuberay_crds(overlay):
    ray_objs = [o for o in objects(overlay) if o["apiVersion"].startswith("ray.io/")]
    assert {o["kind"] for o in ray_objs} >= {"RayCluster", "RayJob"}
    assert all(o["apiVersion"] == "ray.io/v1" for o in ray_objs)
    errors = [e for o in ray_objs for e in check.schema_errors(o)]
    assert errors == []


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_builtin_kinds_validate_with_kubernetes_validate(overlay):
    builtin = [o for o in objects(overlay) if o["apiVersion"].partition("/")[0] not in check.CRD_SOURCES]
    assert len(builtin) >= 4
    assert [e for o in builtin for e in check.schema_errors(o)] == []


def _train(overlay: str = "prod") -> dict:
    return find(objects(overlay), "RayJob", "puma-train")


def _set(obj: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return obj


HEAD = "spec.rayClusterSpec.headGroupSpec"
BAD_FIELDS = {
    "RayJob has no schedule field": ("spec.schedule", "0 2 * * *", "'schedule' was unexpected"),
    "typo in a nested pod field": (f"{HEAD}.template.spec.containers.0.securityContxt", {}, "was unexpected"),
    "unknown field in embedded pod metadata": (f"{HEAD}.template.metadata", {"labelz": {}}, "unexpected"),
    "string where an integer belongs": ("spec.ttlSecondsAfterFinished", "600", "is not of type 'integer'"),
    "value outside an enum": ("spec.rayClusterSpec.authOptions", {"mode": "password"}, "is not one of"),
    "malformed quantity": (f"{HEAD}.template.spec.containers.0.resources.limits.memory", "8 GB",
                           "does not match"),
    "int32 overflow": ("spec.activeDeadlineSeconds", 2**31, "int32"),
    "CEL rule on deletionStrategy": ("spec.deletionStrategy", {"onSuccess": {"policy": "DeleteSelf"}},
                                     "deletionStrategy requires either BOTH"),
    "unknown top-level metadata field": ("metadata.labelz", {}, "labelz"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_crd_validation_rejects_what_an_api_server_rejects(case):
    path, value, expected = BAD_FIELDS[case]
    errors = check.schema_errors(_set(_train(), path, value))
    assert any(expected in e for e in errors), errors


def test_builtin_validation_rejects_unknown_fields_and_bad_types():
    cron = find(objects("prod"), "CronJob")
    assert any("schedul" in e for e in check.schema_errors(_set(copy.deepcopy(cron), "spec.schedul", "x")))
    policy = find(objects("prod"), "NetworkPolicy", "puma-ingress-within-namespace")
    assert check.schema_errors(_set(policy, "spec.policyTypes", "Ingress")) != []


BAD_FOR_OPERATOR = {
    "ttl without shutdown": ("spec.shutdownAfterJobFinishes", False, "ttlSecondsAfterFinished needs"),
    "clusterSelector without a cluster name": ("spec.clusterSelector", {"app": "x"}, "needs ray.io/cluster"),
    "deletionRules with shutdown": ("spec.deletionStrategy", {"deletionRules": [
        {"condition": {"jobStatus": "SUCCEEDED"}, "policy": "DeleteSelf"}]}, "mutually exclusive"),
    "name too long": ("metadata.name", "p" * 48, "longer than 47"),
    "replicas above maxReplicas": ("spec.rayClusterSpec.workerGroupSpecs.0.replicas", 9, "replicas <="),
    "runtimeEnvYAML not a mapping": ("spec.runtimeEnvYAML", "- a\n- b", "runtimeEnvYAML"),
    "token auth on an old Ray": ("spec.rayClusterSpec.rayVersion", "2.50.0", "needs rayVersion >= 2.52.0"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOR_OPERATOR))
def test_operator_rules_reject_what_kuberay_refuses(case):
    path, value, expected = BAD_FOR_OPERATOR[case]
    job = _train()
    job["spec"]["rayClusterSpec"]["authOptions"] = {"mode": "token"}
    assert check.kuberay_errors(job) == []
    assert any(expected in e for e in check.kuberay_errors(_set(job, path, value)))


@pytest.mark.parametrize("schedule,ok", [("0 2 * * *", True), ("*/15 0-6 * JAN-MAR MON,FRI", True),
                                         ("@daily", True), ("TZ=UTC 0 2 * * *", True),
                                         ("0 2 * *", False), ("61 2 * * *", False), ("0 2 * * 8", False),
                                         ("0 6-2 * * *", False)])
def test_cron_schedule_parsing(schedule, ok):
    assert (check.cron_errors(schedule) == []) is ok


@pytest.mark.parametrize("schedule,seconds", [
    ("0 2 * * *", 86400), ("TZ=UTC 0 2 * * *", 86400), ("*/15 * * * *", 900), ("5/20 * * * *", 1200),
    ("0 2,14 * * *", 43200), ("30 23 * * MON-FRI", 86400), ("0 2 * * 1", 7 * 86400), ("0 0 * * 7", 7 * 86400),
    ("0 2 1 * *", 28 * 86400), ("0 0 31 * *", 31 * 86400), ("0 0 1,15 * MON", 86400),  # day OR weekday
    ("@hourly", 3600), ("@every 1h30m", 5400), ("0 0 29 2 *", None), ("0 2 * *", None)])
def test_cron_min_interval_is_the_shortest_gap_between_runs(schedule, seconds):
    assert check.cron_min_interval(schedule) == seconds


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_overlays_pass_every_check(overlay):
    """Schemas, operator rules, pod policy, exposure, references, credentials: all clean."""
    assert check.check_objects(check.render(OVERLAYS[overlay])) == []


def test_check_cli_exits_zero_on_the_overlays_and_one_on_a_broken_one(tmp_path, capsys):
    assert check.main([str(p) for p in OVERLAYS.values()]) == 0
    assert "2 overlay(s) checked: 0 problem(s)" in capsys.readouterr().out
    broken = tmp_path / "broken"
    broken.mkdir()
    patch = [{"op": "replace", "path": "/spec/headGroupSpec/serviceType", "value": "LoadBalancer"}]
    (broken / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(OVERLAYS["prod"], broken)],
        "patches": [{"target": {"kind": "RayCluster", "name": "puma"}, "patch": json.dumps(patch)}]}))
    assert check.main([str(broken)]) == 1
    assert "LoadBalancer" in capsys.readouterr().out


# ----------------------------------------------------------------------------- yamllint


def test_yamllint_passes_on_every_yaml_file():
    proc = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-c", str(INFRA / "yamllint.yaml"),
                           str(INFRA), str(ROOT / "cluster")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list(INFRA.rglob("*.yaml"))) >= 15


# ----------------------------------------------------------------------------- pod policy


def templates(overlay: str) -> list:
    return [t for o in objects(overlay) for t in check.pod_templates(o)]


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_every_pod_template_is_restricted_bounded_and_pinned(overlay):
    found = templates(overlay)
    wheres = " ".join(t.where for t in found)
    for part in ("RayCluster/puma.headGroupSpec", "workerGroupSpecs[gpu]", "workerGroupSpecs[cpu]",
                 "RayJob/puma-train.submitterPodTemplate", "RayJob/puma-sweep.submitterPodTemplate",
                 "RayService/puma-search.rayClusterConfig.headGroupSpec",
                 "RayService/puma-search.rayClusterConfig.workerGroupSpecs[gpu]"):
        assert part in wheres
    if overlay == "prod":
        assert "CronJob/puma-embed-cron" in wheres
    assert len(found) >= 9
    assert [e for t in found for e in check.pod_policy_errors(t)] == []


def test_the_injected_autoscaler_container_is_checked_too():
    head = next(t for t in templates("prod") if t.where == "RayCluster/puma.headGroupSpec")
    assert [c["name"] for c in head.injected] == ["autoscaler"]
    head.injected[0]["securityContext"] = {}
    assert any("autoscaler: allowPrivilegeEscalation" in e for e in check.pod_policy_errors(head))


def _worker(overlay: str = "prod", group: str = "gpu"):
    return next(t for t in templates(overlay) if t.where == f"RayCluster/puma.workerGroupSpecs[{group}]")


VIOLATIONS = {
    "root user": (lambda p: p["securityContext"].update(runAsUser=0), "runAsUser must be a non-zero uid"),
    "non-root not enforced": (lambda p: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot must"),
    "no seccomp": (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile"),
    "privilege escalation": (lambda p: p["containers"][0]["securityContext"].update(
        allowPrivilegeEscalation=True), "allowPrivilegeEscalation must be false"),
    "capabilities kept": (lambda p: p["containers"][0]["securityContext"].pop("capabilities"), "drop ALL"),
    "added capability": (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(
        add=["NET_ADMIN"]), "capabilities.add"),
    "privileged": (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged"),
    "host network": (lambda p: p.update(hostNetwork=True), "hostNetwork"),
    "hostPath volume": (lambda p: p.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "hostPath"),
    "no limits": (lambda p: p["containers"][0]["resources"].pop("limits"), "resources.limits lacks"),
    "no memory request": (lambda p: p["containers"][0]["resources"]["requests"].pop("memory"), "lacks"),
    "limit below request": (lambda p: p["containers"][0]["resources"]["limits"].update(cpu="100m"),
                            "below its request"),
    "latest tag": (lambda p: p["containers"][0].update(image="rayproject/ray:latest"), "latest"),
    "untagged image": (lambda p: p["containers"][0].update(image="registry.example.com:5000/ray"), "no tag"),
    "literal secret env": (lambda p: p["containers"][0].update(
        env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "x" * 40}]), "literal value"),
    "access key in env": (lambda p: p["containers"][0].update(
        env=[{"name": "NOTE", "value": "AKIA" + "ABCDEFGHIJKLMNOP"}]), "looks like a credential"),
    "GPU group without GPU limit": (lambda p: p["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu"),
                                    "without a nvidia.com/gpu limit"),
    "GPU request differs from limit": (lambda p: p["containers"][0]["resources"]["requests"].update(
        {"nvidia.com/gpu": "2"}), "request must equal"),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_pod_policy_rejects_each_violation(case):
    mutate, expected = VIOLATIONS[case]
    template = _worker()
    assert check.pod_policy_errors(template) == []
    mutate(template.spec)
    assert any(expected in e for e in check.pod_policy_errors(template)), check.pod_policy_errors(template)


def test_gpu_limit_on_a_cpu_group_is_rejected():
    template = _worker(group="cpu")
    template.spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    assert any("non-GPU image" in e for e in check.pod_policy_errors(template))


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_autoscaling_cluster_has_a_gpu_worker_group_scaling_from_zero(overlay):
    cluster = find(objects(overlay), "RayCluster", "puma")["spec"]
    assert cluster["enableInTreeAutoscaling"] is True
    gpu = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu")
    assert gpu["minReplicas"] == 0 < gpu["maxReplicas"]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    assert "puma-ray-gpu" in gpu["template"]["spec"]["containers"][0]["image"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "puma-ray-cpu" in head["image"] and "nvidia.com/gpu" not in head["resources"]["limits"]


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_images_are_the_project_images_at_the_project_version(overlay):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {c["image"] for t in templates(overlay) for c in check.containers(t)}
    ray_images = {i for i in images if "puma-ray-" in i}
    expected = {f"puma-ray-cpu:{version}", f"puma-ray-gpu:{version}"}
    assert {i.rpartition("/")[2] for i in ray_images} == expected
    assert images - ray_images <= {"registry.k8s.io/kubectl:v1.33.5"}
    assert all(check.image_errors(i) == [] for i in images)


# ----------------------------------------------------------------------------- namespace, identity


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_namespace_enforces_restricted_pod_security(overlay):
    labels = find(objects(overlay), "Namespace")["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"


def test_prod_gets_s3_through_irsa_with_no_key_anywhere():
    objs = objects("prod")
    account = find(objs, "ServiceAccount", "puma-ray")
    assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+",
                        account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"])
    ray_pods = [t for t in templates("prod") if t.ray_group or "submitter" in t.where]
    assert ray_pods and all(t.spec["serviceAccountName"] == "puma-ray" for t in ray_pods)
    assert check.required_secrets(objs) == {"puma-ray-auth", "puma-serve-token"}
    assert not [o for o in objs if o["kind"] == "Secret"]


def test_dev_references_its_s3_keys_and_never_contains_them():
    objs = objects("dev")
    assert check.required_secrets(objs) == {"puma-ray-auth", "puma-s3-credentials", "puma-serve-token"}
    ray_containers = [c for t in templates("dev") if t.ray_group for c in t.spec["containers"]]
    assert ray_containers and all({"secretRef": {"name": "puma-s3-credentials"}} in c.get("envFrom", [])
                                  for c in ray_containers)
    assert check.secret_errors(objs, yaml.safe_dump_all(objs)) == []
    assert check.secret_errors([], "key: AKIA" + "ABCDEFGHIJKLMNOP") != []
    secret = {"kind": "Secret", "metadata": {"name": "s"}, "data": {"k": "dg=="}}
    assert check.secret_errors([secret], "") != []


def test_readme_tells_how_to_create_every_referenced_secret():
    readme = KUBERNETES_GUIDE.read_text()
    for overlay in OVERLAYS:
        for secret in check.required_secrets(objects(overlay)):
            assert f"create secret generic {secret}" in readme, secret


def test_only_the_cronjob_pod_and_autoscaling_heads_mount_an_api_token():
    for overlay in OVERLAYS:
        for obj in objects(overlay):
            if obj["kind"] == "ServiceAccount":
                assert obj["automountServiceAccountToken"] is False
        mounted = {t.where for t in templates(overlay) if t.spec.get("automountServiceAccountToken")}
        assert all(w.endswith("headGroupSpec") or w.startswith("CronJob/") for w in mounted), mounted


def test_the_scheduler_may_only_create_rayjobs():
    role = find(objects("prod"), "Role", "puma-embed-scheduler")
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]}]


# ----------------------------------------------------------------------------- exposure


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_head_ports_stay_inside_the_namespace(overlay):
    objs = objects(overlay)
    namespace = find(objs, "Namespace")["metadata"]["name"]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    head = {"ray.io/node-type": "head", "ray.io/cluster": "puma"}
    neighbour = check.Source(namespace, (("ray.io/node-type", "worker"),))
    operator = check.Source(check.OPERATOR_NAMESPACE, tuple(check.OPERATOR_LABELS.items()))
    for port in (8265, 10001, 6379):
        assert check.ingress_allowed(policies, namespace, head, neighbour, port)
        assert check.ingress_allowed(policies, namespace, head, operator, port) is (port == 8265)
        for source in check.OUTSIDE_SOURCES.values():
            assert not check.ingress_allowed(policies, namespace, head, source, port)
    assert check.exposure_errors(objs) == []


OPERATOR_POLICY = "puma-ray-head-from-kuberay-operator"
SEARCH_POLICY = "puma-search-from-clients"
METRICS_POLICY = "puma-ray-metrics-from-prometheus"


def _rule(objs: list[dict], policy: str) -> dict:
    return find(objs, "NetworkPolicy", policy)["spec"]["ingress"][0]


EXPOSURES = {
    "LoadBalancer service": lambda objs: objs.append(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dash", "namespace": "puma"},
         "spec": {"type": "LoadBalancer", "selector": {"ray.io/node-type": "head"},
                  "ports": [{"port": 8265}]}}),
    "Ingress": lambda objs: objs.append({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                                         "metadata": {"name": "dash", "namespace": "puma"}, "spec": {}}),
    "NodePort head service": lambda objs: find(objs, "RayCluster", "puma")["spec"]["headGroupSpec"].update(
        serviceType="NodePort"),
    "head ingress enabled": lambda objs: find(objs, "RayJob", "puma-train")["spec"]["rayClusterSpec"][
        "headGroupSpec"].update(enableIngress=True),
    "policy open to all namespaces": lambda objs: _rule(objs, "puma-ingress-within-namespace")["from"].append(
        {"namespaceSelector": {}}),
    "policy rule without sources": lambda objs: _rule(objs, OPERATOR_POLICY).pop("from"),
    "operator allowed every port": lambda objs: _rule(objs, OPERATOR_POLICY).pop("ports"),
    "no policy at all": lambda objs: [objs.remove(o) for o in list(objs) if o["kind"] == "NetworkPolicy"],
    "search port open to every namespace": lambda objs: _rule(objs, SEARCH_POLICY)["from"][0].update(
        namespaceSelector={}),
    "search policy without ports": lambda objs: _rule(objs, SEARCH_POLICY).pop("ports"),
    "search clients named apart from the policy": lambda objs: find(objs, "RayService")["metadata"][
        "annotations"].update({check.CLIENTS_ANNOTATION: "shop"}),
    "search clients not named": lambda objs: find(objs, "RayService")["metadata"].pop("annotations"),
    "serve service LoadBalancer": lambda objs: find(objs, "RayService")["spec"].update(
        serveService={"spec": {"type": "LoadBalancer"}}),
    "metrics policy opens the dashboard port": lambda objs: _rule(objs, METRICS_POLICY)["ports"][0].update(
        port=8265),
    "metrics policy without ports": lambda objs: _rule(objs, METRICS_POLICY).pop("ports"),
    "metrics port open to every namespace": lambda objs: _rule(objs, METRICS_POLICY)["from"][0].update(
        namespaceSelector={}),
    "metrics port open to every pod of the Prometheus namespace": lambda objs: _rule(
        objs, METRICS_POLICY)["from"][0].pop("podSelector"),
    "metrics policy gone while monitored": lambda objs: objs.remove(
        find(objs, "NetworkPolicy", METRICS_POLICY)),
}


@pytest.mark.parametrize("case", sorted(EXPOSURES))
def test_exposure_check_rejects_published_or_open_heads(case):
    objs = objects("prod")
    EXPOSURES[case](objs)
    assert check.exposure_errors(objs) != []


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_search_clients_reach_the_serve_port_and_nothing_else(overlay):
    """The clients' namespace reaches port 8000 of every search pod (head and workers run Serve
    proxies) and no Ray port; other namespaces and outside addresses reach none of them."""
    objs = objects(overlay)
    namespace = find(objs, "Namespace")["metadata"]["name"]
    service = find(objs, "RayService", "puma-search")
    clients_ns = service["metadata"]["annotations"][check.CLIENTS_ANNOTATION]
    assert clients_ns == {"dev": "puma-dev-clients", "prod": "puma-clients"}[overlay]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    client, other = check.Source(clients_ns, (("app", "shop"),)), check.Source("default", (("app", "shop"),))
    groups = check.group_labels(service["spec"]["rayClusterConfig"])
    assert [g for g, _ in groups] == ["head", "gpu", "cpu"]
    for group, labels in groups:
        assert check.ingress_allowed(policies, namespace, labels, client, 8000), group
        assert not check.ingress_allowed(policies, namespace, labels, other, 8000), group
        assert not check.ingress_allowed(policies, namespace, labels, check.Source(None), 8000), group
        for port in check.HEAD_PORTS:
            assert not check.ingress_allowed(policies, namespace, labels, client, port), (group, port)
    assert check.serve_port(service["spec"]) == 8000
    assert check.serve_exposure_errors(objs) == [] and check.network_policy_errors(objs) == []


BAD_SERVICES = {
    "unknown upgrade strategy": ("spec.upgradeStrategy", {"type": "BlueGreen"}, "upgradeStrategy.type"),
    "head service named": ("spec.rayClusterConfig.headGroupSpec.headService",
                           {"metadata": {"name": "x"}}, "headService.metadata.name"),
    "serve config without applications": ("spec.serveConfigV2", "http_options: {port: 8000}\n",
                                          "list of applications"),
    "serve config not YAML": ("spec.serveConfigV2", "applications: [", "list of applications"),
    "application without an import path": ("spec.serveConfigV2", "applications:\n  - name: a\n",
                                           "need import_path"),
    "name too long": ("metadata.name", "s" * 48, "longer than 47"),
    "incremental upgrade without options": ("spec.upgradeStrategy",
                                            {"type": "NewClusterWithIncrementalUpgrade"},
                                            "needs clusterUpgradeOptions"),
}


@pytest.mark.parametrize("case", sorted(BAD_SERVICES))
def test_operator_rules_reject_what_kuberay_refuses_of_a_rayservice(case):
    path, value, expected = BAD_SERVICES[case]
    service = find(objects("prod"), "RayService", "puma-search")
    assert check.kuberay_errors(service) == [] and check.schema_errors(service) == []
    errors = check.kuberay_errors(_set(service, path, value))
    assert any(expected in e for e in errors), errors


# ----------------------------------------------------------------------------- entry points

JOB_DIRS = ("jobs", "tune")



def all_entrypoints() -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for overlay in sorted(OVERLAYS):
        for where, command in check.entrypoints(objects(overlay)):
            seen.setdefault(command, f"{overlay}:{where}")
    return sorted((where, command) for command, where in seen.items())


@functools.cache
def job_help(job: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(job), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_every_job_kind_is_deployed():
    jobs = {shlex.split(cmd)[1].rpartition("/")[2] for _, cmd in all_entrypoints()}
    assert jobs == {"train.py", "sweep.py", "embed.py"}


@pytest.mark.parametrize("where,command", all_entrypoints(), ids=[w for w, _ in all_entrypoints()])
def test_entrypoint_runs_an_existing_job_whose_help_and_config_resolve(where, command):
    argv = shlex.split(command)
    assert argv[0] == "python", f"{where}: entrypoint must start with python, got {argv[0]!r}"
    job = check.repo_path(argv[1])
    assert job is not None and job.parent.name in JOB_DIRS and job.parent.parent == ROOT, argv[1]
    assert job.is_file(), f"{where}: {job.relative_to(ROOT)} does not exist (yet)"
    helped = job_help(job)
    assert helped.returncode == 0, f"{job.relative_to(ROOT)} --help failed: {helped.stderr[-2000:]}"
    options = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
    assert all(o in helped.stdout for o in options), (options, helped.stdout)
    _check_config_args(argv[2:], where)
    if "--print-config" in helped.stdout:
        local = [str(check.repo_path(a) or a) for a in argv[2:]]
        resolved = subprocess.run([sys.executable, str(job), *local, "--print-config"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=300)
        assert resolved.returncode == 0, resolved.stderr[-2000:]


def _check_config_args(args: list[str], where: str) -> None:
    """--config names a file in the repository; every key=value is a real config key."""
    from puma.config import parse_override, valid_keys

    if "--config" in args:
        config = check.repo_path(args[args.index("--config") + 1])
        assert config is not None and config.is_file(), f"{where}: config {config} not in the repository"
    keys = valid_keys()
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    unknown = [parse_override(a)[0] for a in overrides if parse_override(a)[0] not in keys]
    assert not unknown, f"{where}: unknown config keys {unknown}"


def test_the_search_service_runs_the_app_builder_with_a_config_that_resolves():
    """Every RayService application imports a callable of this repository, and its args (config file
    plus dotted keys) resolve into a valid config, in both overlays."""
    import importlib

    from puma.checkpoint import best_checkpoint_uri
    from puma.config import load_config

    apps = [(f"{overlay}:{where}", app) for overlay in sorted(OVERLAYS)
            for where, app in check.serve_applications(objects(overlay))]
    assert len(apps) == 2
    for where, app in apps:
        module, _, attr = app["import_path"].partition(":")
        assert module.split(".")[0] == "puma", where
        assert callable(getattr(importlib.import_module(module), attr)), where
        args = dict(app["args"])
        config = check.repo_path(args.pop("config"))
        assert config is not None and config.is_file(), where
        cfg = load_config(config, [f"{key}={value}" for key, value in args.items()])
        checkpoint = cfg.embed.checkpoint or best_checkpoint_uri(cfg)
        assert cfg.index.uri.startswith("s3://") and checkpoint.startswith("s3://"), where
        assert cfg.serve.token_env == "PUMA_SERVE_TOKEN"


def test_every_search_pod_gets_the_serve_token_from_its_secret():
    """Ingress replicas run on any node: every pod of the search cluster reads the token from the
    Secret (never a literal), so a request cannot find an unguarded replica."""
    for overlay in OVERLAYS:
        pods = [t for t in templates(overlay) if t.where.startswith("RayService/")]
        assert len(pods) == 3
        for template in pods:
            env = {e["name"]: e for e in template.spec["containers"][0].get("env", [])}
            assert env["PUMA_SERVE_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "puma-serve-token",
                                                                             "key": "token"}


# ----------------------------------------------------------------------------- operator install


def test_operator_values_pin_the_tested_kuberay_and_enable_the_gates_the_manifests_need():
    values = yaml.safe_load((INFRA / "helm" / "kuberay-operator-values.yaml").read_text())
    crd_version = check.CRD_DIR.name  # v1.7.0: the CRDs every test validates against
    assert values["image"]["tag"] == crd_version
    assert f"--version {crd_version.lstrip('v')}" in KUBERNETES_GUIDE.read_text()
    gates = {g["name"]: g["enabled"] for g in values["featureGates"]}
    everything = [o for overlay in OVERLAYS for o in objects(overlay)]
    if any(o["kind"] == "RayCronJob" for o in everything):
        assert gates.get("RayCronJob") is True
    if any("deletionStrategy" in (o["spec"].get("jobTemplate") or o["spec"]) for o in everything
           if o["kind"] in ("RayJob", "RayCronJob")):
        assert gates.get("RayJobDeletionPolicy") is True


# ----------------------------------------------------------------------------- monitoring

MONITORING = INFRA / "monitoring"
MONITORING_GUIDE = ROOT / "docs" / "monitoring.md"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ALERTS = {"PumaSearchLatencyP99High", "PumaSearchErrorRateHigh", "PumaSearchRefusing",
          "PumaIndexRefreshStale", "PumaEmbedRunMissing", "PumaEmbedRunFailed", "PumaEmbedRejectsSpiking"}


def _monitoring(overlay: str = "prod") -> list[dict]:
    return [o for o in objects(overlay) if o["apiVersion"].startswith(check.MONITORING_GROUP + "/")]


def _dashboard() -> dict:
    return json.loads((MONITORING / "dashboard.json").read_text())


def _rule_spec() -> dict:
    return yaml.safe_load((MONITORING / "rules.yaml").read_text())["spec"]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run scripts/setup.sh (apt-get install prometheus)")
    return promtool


def test_prod_is_monitored_and_its_monitoring_objects_validate_against_the_operator_crds():
    found = _monitoring("prod")
    assert sorted(check.describe(o) for o in found) == [
        "PodMonitor/puma-ray-workers", "PrometheusRule/puma-alerts", "ServiceMonitor/puma-pushgateway",
        "ServiceMonitor/puma-ray-heads"]
    validators = check.crd_validators(*check.CRD_SOURCES[check.MONITORING_GROUP])
    kinds = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
    assert {("monitoring.coreos.com/v1", kind) for kind in kinds} <= set(validators)
    assert [e for o in found for e in check.schema_errors(o)] == []
    assert _monitoring("dev") == []  # dev clusters may lack the CRDs (docs/kubernetes.md, "Monitoring")


BAD_MONITORING = {
    "unknown endpoint field": ("PodMonitor", "spec.podMetricsEndpoints.0.portName", "metrics",
                               "'portName' was unexpected"),
    "unknown spec field": ("ServiceMonitor", "spec.endpoint", [], "'endpoint' was unexpected"),
    "honorLabels not a boolean": ("ServiceMonitor", "spec.endpoints.0.honorLabels", "true",
                                  "is not of type 'boolean'"),
    "no endpoints": ("ServiceMonitor", "spec.endpoints", None, "None is not of type 'array'"),
    "duration not a Prometheus duration": ("PrometheusRule", "spec.groups.0.rules.0.for", "10 minutes",
                                           "does not match"),
    "labels not strings": ("PrometheusRule", "spec.groups.0.rules.0.labels", {"severity": 3},
                           "is not of type 'string'"),
    "typo in a rule field": ("PrometheusRule", "spec.groups.0.rules.0.expression", "up", "unexpected"),
}


@pytest.mark.parametrize("case", sorted(BAD_MONITORING))
def test_monitoring_crd_validation_rejects_what_an_api_server_rejects(case):
    kind, path, value, expected = BAD_MONITORING[case]
    obj = next(o for o in _monitoring() if o["kind"] == kind)
    errors = check.schema_errors(_set(obj, path, value))
    assert any(expected in e for e in errors), errors


def test_monitors_select_kuberay_pods_and_services_and_the_pushgateway():
    """Every Ray head once through its cluster's head Service, every Ray worker group, all on KubeRay's
    `metrics` port; the Pushgateway with honorLabels (the pushed `job` label is the job)."""
    objs = objects("prod")
    assert check.monitor_errors(objs) == []
    pods, services = check.pod_targets(objs), check.service_targets(objs)

    def selected(monitor: dict, pool: list) -> list[str]:
        return sorted(t.where for t in pool + check.EXTERNAL_SERVICES
                      if check._watches(monitor, t.namespace) and check.selector_matches(
                          monitor["spec"]["selector"], t.labels))

    clusters = sorted(where for o in objs for where, _ in check.ray_cluster_specs(o))
    assert len(clusters) == 4  # puma, the search service's, the train and sweep RayJobs'
    heads = selected(find(objs, "ServiceMonitor", "puma-ray-heads"), services)
    assert heads == [f"{c} head Service" for c in clusters]
    workers = selected(find(objs, "PodMonitor", "puma-ray-workers"), pods)
    assert workers == sorted(f"{where} {group} pods" for o in objs
                             for where, cluster in check.ray_cluster_specs(o)
                             for group, _ in check.group_labels(cluster) if group != "head")
    gateway = find(objs, "ServiceMonitor", "puma-pushgateway")
    assert selected(gateway, services) == [check.EXTERNAL_SERVICES[0].where]
    assert gateway["spec"]["endpoints"] == [{"port": "http", "honorLabels": True}]


MONITOR_BREAKS = {
    "selector matching no pod": ("PodMonitor", "spec.selector.matchLabels", {"ray.io/node-type": "workers"},
                                 "matches no pod"),
    "port name typo": ("PodMonitor", "spec.podMetricsEndpoints.0.port", "metric",
                       "port 'metric' is not a named port"),
    "Service port that the head Service lacks": ("ServiceMonitor/puma-ray-heads", "spec.endpoints.0.port",
                                                 "dashboard-metrics", "is not a named port"),
    "Pushgateway in a namespace nobody knows": ("ServiceMonitor/puma-pushgateway",
                                                "spec.namespaceSelector.matchNames", ["monitorng"],
                                                "watches namespace(s) ['monitorng']"),
    "heads selected through two Services": ("ServiceMonitor/puma-ray-heads", "spec.selector.matchLabels",
                                            {"ray.io/node-type": "head"}, "twice"),
}


@pytest.mark.parametrize("case", sorted(MONITOR_BREAKS))
def test_monitor_check_rejects_monitors_that_scrape_nothing_or_twice(case):
    what, path, value, expected = MONITOR_BREAKS[case]
    objs = objects("prod")
    kind, _, name = what.partition("/")
    _set(find(objs, kind, name or None), path, value)
    errors = check.monitor_errors(objs)
    assert any(expected in e for e in errors), errors


def test_prometheus_reaches_the_metrics_port_of_every_ray_pod_and_nothing_else():
    objs = objects("prod")
    namespace = find(objs, "Namespace")["metadata"]["name"]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    others = [s for s in check.OUTSIDE_SOURCES.values() if s != check.PROMETHEUS]
    groups = [(f"{where} {group}", labels) for o in objs for where, cluster in check.ray_cluster_specs(o)
              for group, labels in check.group_labels(cluster)]
    assert len(groups) == 10

    def reaches(source, labels, port):
        return check.ingress_allowed(policies, namespace, labels, source, port)

    for where, labels in groups:
        assert reaches(check.PROMETHEUS, labels, check.METRICS_PORT), where
        for port in (*check.HEAD_PORTS, check.SERVE_PORT):
            assert not reaches(check.PROMETHEUS, labels, port), (where, port)
        assert not any(reaches(source, labels, check.METRICS_PORT) for source in others), where
    assert check.metrics_exposure_errors(objs) == []


def test_the_rule_groups_pass_promtool_check_rules(tmp_path):
    """The PrometheusRule's spec is a plain rule file whose PromQL and templates Prometheus accepts."""
    rules = tmp_path / "puma-rules.yml"
    rules.write_text(yaml.safe_dump(_rule_spec(), sort_keys=False))
    proc = subprocess.run([_promtool(), "check", "rules", str(rules)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests_make_the_alerts_fire_and_stay_quiet(tmp_path):
    """rules.test.yaml (series that fire PumaSearchErrorRateHigh, PumaEmbedRejectsSpiking, PumaEmbedRunMissing
    and PumaEmbedRunFailed, and some that must not) against the plain rule file made from the spec."""
    (tmp_path / "puma-rules.yml").write_text(yaml.safe_dump(_rule_spec(), sort_keys=False))
    shutil.copy(MONITORING / "rules.test.yaml", tmp_path / "rules.test.yaml")
    unit = yaml.safe_load((MONITORING / "rules.test.yaml").read_text())
    assert unit["rule_files"] == ["puma-rules.yml"]
    fired = {t["alertname"] for test in unit["tests"] for t in test["alert_rule_test"] if t["exp_alerts"]}
    assert len(fired) >= 3 and fired <= ALERTS
    proc = subprocess.run([_promtool(), "test", "rules", "rules.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_every_alert_has_a_severity_a_summary_and_a_runbook_in_the_guide():
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", MONITORING_GUIDE.read_text(), flags=re.M | re.S)
    anchors = {slugify(title.strip(), "-") for title in re.findall(r"^#+ (.+)$", text, re.M)}
    rules = [rule for group in _rule_spec()["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], rule["alert"]
        page, _, anchor = notes["runbook_url"].partition("/#")
        assert page == "monitoring" and anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]


def _panels() -> list[dict]:
    panels = _dashboard()["panels"]
    return panels + [inner for panel in panels for inner in panel.get("panels", [])]


def test_the_dashboard_loads_and_every_panel_queries_the_datasource_variable():
    board = _dashboard()
    assert (board["uid"], board["title"]) == ("puma", "PUMA") and 36 <= board["schemaVersion"] <= 41
    variable, = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    panels = [p for p in _panels() if p["type"] != "row"]
    assert len(panels) >= 25
    assert len({p["id"] for p in _panels()}) == len(_panels())
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]
    cells = [(x, y) for box in (p["gridPos"] for p in _panels())
             for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])]
    assert len(cells) == len(set(cells)) and max(x for x, _ in cells) < 24, "panels overlap or overflow"


def test_the_grafana_configmap_is_generated_from_the_dashboard_file():
    config_map = find(objects("prod"), "ConfigMap", "puma-grafana-dashboard")  # no hash: replaced in place
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {"puma.json": (MONITORING / "dashboard.json").read_text()}


PROMQL = {
    'sum by (le, route) (rate(ray_puma_request_seconds_bucket{route="search", kind=~"a|b"}[$__range]))':
        {"ray_puma_request_seconds_bucket"},
    "histogram_quantile(0.99, sum(rate(x_bucket[5m])) by (le)) > 0.25": {"x_bucket"},
    "a / on(job) group_left(catalogue) b offset 1d > bool 2 and c unless d or e": {"a", "b", "c", "d", "e"},
    "time() - max by (catalogue) (last_success) > 26 * 3600 or absent(other)": {"last_success", "other"},
    "min_over_time((sum by (c) (x) or 0 * max without (le) (y))[1d:10m])": {"x", "y"},
    'label_replace(up{job="a}b"}, "dst", "$1", "src", "(.*)") == 1e3': {"up"},
    "SUM BY (le) (rate(m[5m])) > Inf": {"m"},
}


@pytest.mark.parametrize("expr", sorted(PROMQL))
def test_the_promql_reader_finds_exactly_the_metric_names(expr):
    from monitoring import metric_names

    assert metric_names(expr) == PROMQL[expr]


def test_the_dashboard_and_the_alerts_use_only_exported_metrics():
    """A metric name mistyped in the dashboard or the rules fails here (the contract: tests/monitoring.py)."""
    from monitoring import METRICS, metric_names_used

    used = metric_names_used()
    assert set(used) == {"dashboard", "rules"}
    for where, names in used.items():
        assert names and names <= METRICS, (where, sorted(names - METRICS))
    families = {name.split("_")[1] for name in used["dashboard"]}  # ray_puma_*, puma_embed_*, ...
    assert families == {"puma", "embed", "train", "sweep"}


def test_the_guide_describes_every_exported_metric():
    from monitoring import METRICS

    page = MONITORING_GUIDE.read_text()
    for name in METRICS:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        assert f"`{base}`" in page, name
