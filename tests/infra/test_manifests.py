"""Compose, Kubernetes, Dockerfiles and the Grafana dashboard: they parse, they say what the
deployment needs, and every environment variable they set is a Ferry setting."""

import json
import re
from pathlib import Path

import pytest
import yaml

from ferry.api.settings import ApiSettings
from ferry.autoscaler.settings import AutoscalerSettings
from ferry.worker.protocol import GROUP, Keys
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.webhooks.settings import WebhookSettings
from tests.infra.hcl import TERRAFORM

INFRA = Path(__file__).resolve().parents[2] / "infra"
K8S = INFRA / "k8s"
SETTINGS = (WorkerSettings, ApiSettings, WebhookSettings, AutoscalerSettings)
FERRY_VARS = WorkerSettings.variable_names() | {
    "FERRY_" + name.upper() for cls in SETTINGS if cls is not WorkerSettings for name in cls.model_fields
}

# Variables that are not Ferry settings but are read by a library or the image itself.
THIRD_PARTY_VARS = {
    "AWS_ACCESS_KEY_ID": "boto3: the local MinIO's credentials in compose",
    "AWS_SECRET_ACCESS_KEY": "boto3: the local MinIO's credentials in compose",
    "AWS_DEFAULT_REGION": "boto3: region for the local MinIO client",
    "PATH": "image: the venv's bin first",
    "PYTHONUNBUFFERED": "image: logs reach the container runtime at once",
    "HF_HOME": "huggingface_hub: cache under the non-root user's home",
    "DEBIAN_FRONTEND": "image build: apt without prompts",
    "PIP_NO_CACHE_DIR": "image build: no pip cache in layers",
    "PIP_DISABLE_PIP_VERSION_CHECK": "image build: quiet pip",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OpenTelemetry: the collector traces go to (empty: tracing off)",
    "OTEL_TRACES_SAMPLER": "OpenTelemetry: which jobs are traced",
    "OTEL_TRACES_SAMPLER_ARG": "OpenTelemetry: the sampler's ratio",
    "OTEL_SERVICE_NAME": "OpenTelemetry: the process's name in a trace",
}


def _load_all(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _check_vars(names, where: str) -> None:
    for name in names:
        if name.startswith("FERRY_"):
            assert name in FERRY_VARS, f"{where}: {name} is not a field of {[c.__name__ for c in SETTINGS]}"
        else:
            assert name in THIRD_PARTY_VARS, f"{where}: {name} is neither a Ferry setting nor a known library variable"


def test_settings_share_the_ferry_prefix():
    assert all(cls.model_config["env_prefix"] == "FERRY_" for cls in SETTINGS)


# --- docker compose --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((INFRA / "docker-compose.yml").read_text())


def test_compose_services_and_ferry_env(compose):
    services = compose["services"]
    assert {"redis", "minio", "api", "worker", "webhooks", "prometheus", "grafana"} <= set(services)
    ferry = {n: s for n, s in services.items() if str(s.get("image", "")).startswith("ferry-")}
    assert {"api", "worker", "webhooks", "autoscaler"} <= set(ferry)
    for name, svc in ferry.items():
        env = svc.get("environment", {})
        assert isinstance(env, dict), f"{name}: use the mapping form for environment"
        _check_vars(env, f"compose service {name}")
    assert services["worker"]["command"] == ["worker"] and services["webhooks"]["command"] == ["webhooks"]
    assert services["api"]["command"] == ["api"]
    assert services["autoscaler"]["command"][0] == "autoscale"


def test_compose_redis_aof_minio_snapshots_and_worker_grace(compose):
    s = compose["services"]
    assert "--appendonly" in s["redis"]["command"] and "yes" in s["redis"]["command"]
    worker_env = s["worker"]["environment"]
    assert worker_env["FERRY_SNAPSHOT_URL"].startswith("s3://")
    assert worker_env["FERRY_S3_ENDPOINT_URL"] == "http://minio:9000"
    grace = int(s["worker"]["stop_grace_period"].rstrip("s"))
    assert grace > float(worker_env["FERRY_DRAIN_TIMEOUT_S"])
    assert s["worker"]["build"]["dockerfile"] == "infra/Dockerfile.worker"
    assert s["api"]["build"]["dockerfile"] == "infra/Dockerfile.api"


def test_prometheus_scrapes_every_ferry_process(compose):
    cfg = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    env = compose["services"]
    assert f"api:{env['api']['environment']['FERRY_PORT']}" in targets
    assert f"worker:{env['worker']['environment']['FERRY_METRICS_PORT']}" in targets
    assert f"webhooks:{env['webhooks']['environment']['FERRY_WEBHOOK_METRICS_PORT']}" in targets
    assert f"autoscaler:{env['autoscaler']['environment']['FERRY_AUTOSCALE_METRICS_PORT']}" in targets


def test_grafana_dashboard_is_provisioned_and_covers_the_metrics(compose):
    dash = json.loads((INFRA / "grafana" / "ferry.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in (
        "ferry_time_to_first_token_seconds_bucket",
        "ferry_inter_token_latency_seconds_bucket",
        "ferry_queue_lag",
        "ferry_num_requests_running",
        "ferry_num_requests_waiting",
        "ferry_kv_cache_usage_perc",
        "ferry_prefix_cache_hits_total",
        "ferry_prefix_cache_queries_total",
        "ferry_jobs_total",
        "ferry_webhook_deliveries_total",
    ):
        assert metric in exprs, metric
    assert re.search(r"histogram_quantile\(0\.99, .*ferry_time_to_first_token", exprs)
    assert "sum by (status)" in exprs and "sum by (outcome)" in exprs
    provisioning = yaml.safe_load((INFRA / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in provisioning["datasources"]}
    assert {p["datasource"]["uid"] for p in dash["panels"]} <= uids
    mounts = compose["services"]["grafana"]["volumes"]
    assert "./grafana/ferry.json:/var/lib/grafana/dashboards/ferry.json:ro" in mounts


def test_traces_are_an_optional_profile_and_grafana_links_exemplars_to_them(compose):
    services = compose["services"]
    assert services["otel-collector"]["profiles"] == ["tracing"] == services["jaeger"]["profiles"]
    assert "./otel/collector.yaml:/etc/otelcol/config.yaml:ro" in services["otel-collector"]["volumes"]
    collector = yaml.safe_load((INFRA / "otel" / "collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    for name in ("api", "worker", "webhooks"):  # off unless the endpoint is given
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
        assert env["OTEL_SERVICE_NAME"] == f"ferry-{name}"
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    sources = yaml.safe_load((INFRA / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in sources}
    assert by_uid["jaeger"]["url"] == "http://jaeger:16686"
    assert by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "datasourceUid": "jaeger"}]  # the exemplar label the worker sets
    dash = json.loads((INFRA / "grafana" / "ferry.json").read_text())
    linked = [t["expr"] for p in dash["panels"] for t in p["targets"] if t.get("exemplar")]
    assert any("ferry_time_to_first_token_seconds_bucket" in e for e in linked)
    assert any("ferry_e2e_request_latency_seconds_bucket" in e for e in linked)


# --- Dockerfiles -----------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile.worker", "Dockerfile.api"])
def test_dockerfiles_run_non_root_drain_on_sigterm_and_check_readyz(name):
    ins = _instructions(INFRA / name)
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [rest for w, rest in final if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert any(w == "HEALTHCHECK" and "/readyz" in rest for w, rest in final)
    env_names = set()
    for w, rest in ins:
        if w == "ENV":
            env_names |= set(re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*)=", rest))
    _check_vars(env_names, name)


def test_worker_image_is_cuda_with_the_gpu_extra_and_api_image_is_slim():
    worker = _instructions(INFRA / "Dockerfile.worker")
    assert all(rest.startswith("nvidia/cuda:") for w, rest in worker if w == "FROM" and "AS model" not in rest)
    assert any(w == "RUN" and '".[gpu]"' in rest for w, rest in worker)
    api = _instructions(INFRA / "Dockerfile.api")
    assert all("-slim" in rest for w, rest in api if w == "FROM")


# --- Kubernetes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objects = [o for res in kustomization["resources"] for o in _load_all(K8S / res)]
    config = {
        g["name"]: dict(lit.split("=", 1) for lit in g.get("literals", [])) for g in kustomization["configMapGenerator"]
    }
    return kustomization, objects, config


def _get(objects, kind, name):
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def test_every_container_env_is_a_ferry_setting(k8s):
    _, objects, config = k8s
    for d in (o for o in objects if o["kind"] == "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            for src in c.get("envFrom", []):
                names += list(config[src["configMapRef"]["name"]])
            _check_vars(names, f"Deployment/{d['metadata']['name']}")


def test_worker_gets_a_gpu_on_the_gpu_pool_and_outlives_its_drain(k8s):
    _, objects, _ = k8s
    spec = _get(objects, "Deployment", "ferry-worker")["spec"]
    assert "replicas" not in spec  # KEDA owns it
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    # Node selector and toleration match what terraform puts on the GPU nodes.
    gpu_pool = (TERRAFORM / "modules" / "gpu_pool" / "main.tf").read_text()
    label = re.search(r'gpu_label = \{ key = "([^"]+)", value = "([^"]+)" \}', gpu_pool).groups()
    taint_key = re.search(r'gpu_taint = \{ key = "([^"]+)"', gpu_pool).group(1)
    assert pod["nodeSelector"] == {label[0]: label[1]}
    assert any(t["key"] == taint_key and t["effect"] == "NoSchedule" for t in pod["tolerations"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert pod["terminationGracePeriodSeconds"] >= float(env["FERRY_DRAIN_TIMEOUT_S"]) + 30
    port = int(env["FERRY_METRICS_PORT"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}[c["readinessProbe"]["httpGet"]["port"]] == port
    assert c["args"] == ["worker"]


def test_api_has_service_pdb_and_readiness(k8s):
    _, objects, _ = k8s
    api = _get(objects, "Deployment", "ferry-api")
    (c,) = api["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["args"] == ["api"]
    svc = _get(objects, "Service", "ferry-api")
    assert svc["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]
    pdb = _get(objects, "PodDisruptionBudget", "ferry-api")
    assert pdb["spec"]["selector"] == api["spec"]["selector"] and pdb["spec"]["minAvailable"] >= 1
    assert api["spec"]["replicas"] > pdb["spec"]["minAvailable"]


def test_keda_scales_the_worker_from_zero_on_lag_and_pending(k8s):
    _, objects, config = k8s
    so = _get(objects, "ScaledObject", "ferry-worker-smollm2")["spec"]
    assert so["scaleTargetRef"]["name"] == "ferry-worker"
    assert so["minReplicaCount"] == 0 and so["maxReplicaCount"] >= 1
    assert so["cooldownPeriod"] > 0 and so["pollingInterval"] > 0
    streams = set(Keys(config["ferry-config"]["FERRY_KEY_PREFIX"]).queues(config["ferry-config"]["FERRY_MODEL_NAME"]))
    lag = {t["metadata"]["stream"] for t in so["triggers"] if "lagCount" in t["metadata"]}
    pending = {t["metadata"]["stream"] for t in so["triggers"] if "pendingEntriesCount" in t["metadata"]}
    assert lag == pending == streams
    for t in so["triggers"]:
        assert t["type"] == "redis-streams" and t["metadata"]["consumerGroup"] == GROUP
        assert t["authenticationRef"]["name"] == "ferry-redis"
        if "lagCount" in t["metadata"]:
            assert t["metadata"]["activationLagCount"] == "0"
    auth = _get(objects, "TriggerAuthentication", "ferry-redis")["spec"]["secretTargetRef"]
    assert {a["parameter"] for a in auth} == {"address", "password", "tls"}


def test_service_monitor_finds_every_metrics_port(k8s):
    _, objects, _ = k8s
    sm = _get(objects, "ServiceMonitor", "ferry")["spec"]
    selected = [
        o for o in objects
        if o["kind"] == "Service" and sm["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()
    ]  # fmt: skip
    assert {s["metadata"]["name"] for s in selected} == {"ferry-api", "ferry-worker-metrics", "ferry-webhooks-metrics"}
    port = sm["endpoints"][0]["port"]
    assert all(port in {p["name"] for p in s["spec"]["ports"]} for s in selected)


def test_pods_run_non_root_with_read_only_roots(k8s):
    _, objects, _ = k8s
    for d in (o for o in objects if o["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_k8s_wires_tracing_off_until_an_overlay_names_a_collector(k8s):
    _, objects, config = k8s
    shared = config["ferry-config"]
    assert shared["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""  # off at no cost
    assert shared["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert 0 < float(shared["OTEL_TRACES_SAMPLER_ARG"]) <= 1
    for name in ("ferry-api", "ferry-worker", "ferry-webhooks"):
        [container] = _get(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert {"configMapRef": {"name": "ferry-config"}} in container["envFrom"]
