"""cluster/: the images, the AWS launcher config and the job runtime env, checked offline with
the real validators (Ray's own config validation and bootstrap code, hadolint, RuntimeEnv, Ray's
working-dir packager)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
FLAVOURS = ("cpu", "gpu")


def ray_pin() -> str:
    ray = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("ray"))
    return next(s.version for s in ray.specifier if s.operator == "==")


# ----------------------------------------------------------------------------- images


def dockerfile(flavour: str) -> str:
    return (CLUSTER / f"Dockerfile.{flavour}").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines()
            if line.strip()]


def test_hadolint_passes_on_both_dockerfiles():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run([hadolint, *(str(CLUSTER / f"Dockerfile.{f}") for f in FLAVOURS)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_base_image_is_the_pinned_ray_release(flavour):
    steps = instructions(dockerfile(flavour))
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    assert [a for op, a in steps if op == "FROM"] == ["${RAY_IMAGE}"]
    assert args["RAY_IMAGE"] == f"rayproject/ray:{ray_pin()}-py311-{flavour}"
    assert f"ray.__version__ == '{ray_pin()}'" in dockerfile(flavour)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_image_runs_as_a_numeric_non_root_user(flavour):
    users = [a for op, a in instructions(dockerfile(flavour)) if op == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0


def test_images_have_distinct_names_and_the_right_faiss():
    titles = [re.search(r'image.title="([^"]+)"', dockerfile(f)).group(1) for f in FLAVOURS]
    assert titles == ["puma-ray-cpu", "puma-ray-gpu"]
    for flavour in FLAVOURS:
        install = next(a for op, a in instructions(dockerfile(flavour)) if op == "RUN" and "pip install" in a)
        assert f'".[{flavour}]"' in install and "--constraint /home/ray/constraints.txt" in install


def _ignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: ``**`` spans directories, ``*`` and ``?`` do not."""
    parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
    table = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(table.get(part, re.escape(part)) for part in parts))


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """moby's .dockerignore semantics: the last matching pattern wins; matching a parent counts."""
    excluded = False
    candidates = [path] + [str(p) for p in Path(path).parents if str(p) != "."]
    for pattern in patterns:
        regex = _ignore_regex(pattern.lstrip("!"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not pattern.startswith("!")
    return excluded


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_copy_source_exists_and_reaches_the_build_context(flavour):
    ignore = (CLUSTER / f"Dockerfile.{flavour}.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    sources = [src for op, a in instructions(dockerfile(flavour)) if op == "COPY"
               for src in a.split()[:-1] if not src.startswith("--")]
    assert {"pyproject.toml", "puma", "jobs", "tune", "configs", "cluster/constraints.txt"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile.{flavour} copies {src}, which is not in the repository"
        assert not _dockerignore_excludes(patterns, src), f"{src} is excluded by the .dockerignore"
    for heavy in (".venv/bin/python", "artifacts/data/x.parquet", ".git/HEAD", "puma/__pycache__/a.pyc"):
        assert _dockerignore_excludes(patterns, heavy), heavy


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_jobs_smoke_tested_in_the_image_exist_and_print_help(flavour):
    loop = next(a for op, a in instructions(dockerfile(flavour)) if op == "RUN" and "--help" in a)
    jobs = re.findall(r"\b((?:jobs|tune)/\w+\.py)\b", loop)
    every_job = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "jobs").glob("*.py"))
                 if p.name != "__init__.py"]  # the package's marker (jobs are importable), not a job
    assert sorted(jobs) == sorted([*every_job, "tune/sweep.py"])  # a new job cannot be forgotten here
    missing = [j for j in jobs if not (ROOT / j).is_file()]
    assert not missing, f"the image smoke-tests entry points that do not exist: {missing}"
    for job in jobs:
        proc = subprocess.run([sys.executable, job, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), f"{job}: {proc.stderr[-1500:]}"


# ----------------------------------------------------------------------------- constraints


def constraints() -> dict[str, str]:
    text = (CLUSTER / "constraints.txt").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    pins = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert match, f"constraints.txt line is not an exact pin: {line!r}"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def test_constraints_pin_every_image_dependency_within_pyproject():
    pins = constraints()
    project = PYPROJECT["project"]
    roots = project["dependencies"] + [r for f in FLAVOURS for r in project["optional-dependencies"][f]]
    for req in map(Requirement, roots):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in cluster/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    assert pins["ray"] == ray_pin() and len(pins) > len(roots)  # transitive dependencies pinned too


def test_exact_pins_match_the_tested_environment():
    """Where pyproject pins exactly, constraints.txt, pyproject and the test environment agree."""
    from importlib import metadata

    pins = constraints()
    exact = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"] + ["faiss-cpu"])
             if any(s.operator == "==" for s in r.specifier) or r.name == "faiss-cpu"]
    assert {r.name for r in exact} >= {"torch", "ray", "timm", "faiss-cpu"}
    for req in exact:
        assert pins[canonicalize_name(req.name)] == metadata.version(req.name), req.name


# ----------------------------------------------------------------------------- AWS launcher


def launcher() -> dict:
    return yaml.safe_load((CLUSTER / "aws.yaml").read_text())


def test_launcher_config_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(launcher()))
    broken = launcher()
    broken["auth"]["ssh_proxy_comand"] = broken["auth"].pop("ssh_proxy_command")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


class AwsCalled(RuntimeError):
    """Raised by the stand-in for boto3: the launcher tried to create or look something up."""


@pytest.fixture
def no_aws(monkeypatch):
    from ray.autoscaler._private.aws import config as aws_config

    def refuse(*args, **kwargs):
        raise AwsCalled(f"AWS API called with {args}")

    monkeypatch.setattr(aws_config, "_client", refuse)
    monkeypatch.setattr(aws_config, "_resource", refuse)
    return aws_config


def test_ray_bootstrap_creates_no_open_security_group_and_no_default_role(no_aws):
    from ray.autoscaler._private.util import prepare_config

    config = prepare_config(launcher())
    before = copy.deepcopy(config["available_node_types"])
    config = no_aws._configure_iam_role(config)
    config = no_aws._configure_security_group(config)
    no_aws._check_ami(config)
    assert config["available_node_types"] == before
    ssh_default = no_aws._create_default_ssh_inbound_rules()
    assert ssh_default[0]["IpRanges"] == [{"CidrIp": "0.0.0.0/0"}]  # what we avoid
    del config["available_node_types"]["gpu.worker"]["node_config"]["SecurityGroupIds"]
    with pytest.raises(AwsCalled):
        no_aws._configure_security_group(config)


def test_launcher_shape_cpu_head_and_autoscaling_gpu_workers():
    config = launcher()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0} and "GPU" not in head["resources"]
    gpu = types["gpu.worker"]
    assert gpu["min_workers"] == 0 < gpu["max_workers"] <= config["max_workers"]
    assert gpu["resources"]["GPU"] >= 1
    assert config["idle_timeout_minutes"] > 0 and config["provider"]["cache_stopped_nodes"] is False
    docker = config["docker"]
    assert docker["head_image"].endswith(f"/puma-ray-cpu:{VERSION}")
    assert docker["image"].endswith(f"/puma-ray-gpu:{VERSION}")
    assert types["cpu.worker"]["docker"]["worker_image"].endswith(f"/puma-ray-cpu:{VERSION}")


def test_launcher_keeps_every_port_closed_to_the_internet():
    config = launcher()
    assert config["provider"]["use_internal_ips"] is True
    assert "security_group" not in config["provider"]  # its rules would be added to Ray's open default
    auth = config["auth"]
    assert auth["ssh_proxy_use_node_id"] is True and "aws ssm start-session" in auth["ssh_proxy_command"]
    assert "%h" in auth["ssh_proxy_command"] and "AWS-StartSSHSession" in auth["ssh_proxy_command"]
    for name, node in config["available_node_types"].items():
        nc = node["node_config"]
        assert re.fullmatch(r"sg-[0-9a-f]{8,17}", nc["SecurityGroupIds"][0]), name
        assert nc["MetadataOptions"]["HttpTokens"] == "required", name
        assert all(d["Ebs"]["Encrypted"] for d in nc["BlockDeviceMappings"]), name
        assert "NetworkInterfaces" not in nc, name  # AssociatePublicIpAddress would live there
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start


# ----------------------------------------------------------------------------- runtime env


def runtime_env() -> dict:
    return yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())


def test_runtime_env_parses_into_a_ray_runtime_env():
    from ray.runtime_env import RuntimeEnv

    data = runtime_env()
    assert set(data) <= RuntimeEnv.known_fields  # RuntimeEnv accepts unknown keys as plugins
    env = RuntimeEnv(**data)
    assert env.working_dir() == "." and env.env_vars() == {"PYTHONUNBUFFERED": "1"}
    with pytest.raises(TypeError):
        RuntimeEnv(**{**data, "excludes": ".venv/"})


def test_working_dir_package_is_small_and_holds_the_code_not_local_state(tmp_path):
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE, create_package

    package = tmp_path / "pkg.zip"
    create_package(str(ROOT), package, include_gitignore=False, excludes=runtime_env()["excludes"])
    names = zipfile.ZipFile(package).namelist()
    assert package.stat().st_size < GCS_STORAGE_MAX_SIZE // 8
    assert "puma/config/loader.py" in names and "jobs/train.py" in names
    assert "configs/paper_vit_s.yaml" in names
    leaked = [n for n in names if n.split("/")[0] in (".venv", "artifacts", ".git", "tests")
              or "__pycache__" in n]
    assert not leaked, leaked[:10]
