"""The Helm chart (packaging/helm/gpuagent) and the image it runs (packaging/container/Containerfile).

Helm is Helm's own: PyPI helm-python-sdk binds Helm's Go library (libhelm_c) with ctypes, so rendering,
values.schema.json and lint are the engine `helm install` runs, with no helm binary. Every rendered object is
validated against the Kubernetes API schemas that PyPI kubernetes-validate ships, strict (an unknown field is
an error), for the oldest release Chart.yaml's kubeVersion admits and the newest kubernetes-validate has.

ServiceMonitor and PodMonitor (monitoring.coreos.com/v1) are CRDs, which those schemas do not contain. They are
checked against MONITOR_SCHEMAS below: only the fields this chart writes, named and typed as prometheus-operator's
API defines them (pkg/apis/monitoring/v1: ServiceMonitorSpec, PodMonitorSpec, Endpoint, PodMetricsEndpoint,
SafeAuthorization), closed to other fields so a misspelt or misplaced one fails. That is a structural check of
our use, not the operator's full CRD schema.

The TOML files the chart renders are loaded by the project's own loaders (agent/config.py's load_config, the
functions `gpuagent-collector serve` reads its --config with), and the commands the containers run are parsed
by the real click commands, so a key or flag the code does not know fails here.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from tools import in_ci

try:
    import helm_python
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as exc:  # pragma: no cover - depends on the environment
    why = (f"{exc.name} is not installed (the test extra pins helm-python-sdk and kubernetes-validate: "
           "pip install -e '.[test]')")
    if in_ci():
        pytest.fail(f"CI=true, but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "packaging" / "helm" / "gpuagent"
CONTAINERFILE = ROOT / "packaging" / "container" / "Containerfile"
NAMESPACE = "gpu"
RELEASE = "gpuagent"
ADDRESS = "collector.example:7443"

# The smallest install: agents sending to a collector elsewhere (docs/KUBERNETES.md, "Install").
DEFAULTS = {"collector": {"address": ADDRESS}}
# Every optional feature: the collector with token and TLS, the agent with kmsg, fabric, labels, a monitor,
# node-problem-detector. ServiceMonitor and PodMonitor for the agents exclude each other: two variants.
ALL_ON = {
    "imagePullSecrets": [{"name": "registry-login"}],
    "collector": {
        "enabled": True,
        "nodeSelector": {"node-role.example.com/infra": "true"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "token": {"existingSecret": "gpuagent-token", "key": "token"},
        "tls": {"existingSecret": "gpuagent-collector-tls", "caSecret": "gpuagent-ca", "caKey": "ca.crt"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "persistence": {"size": "200Gi", "storageClassName": "fast-ssd"},
        "config": {
            "analyzer": {"interval": "2m", "window": "1h", "thresholds": {"virtualization_overhead.h2d": 8}},
            "pricing": {"h100-sxm": 4.1},
            "storage": {"raw_retention": "3d", "max_db_bytes": "400GB", "compaction": True},
            "fabric": {"enabled": True},
        },
    },
    "agent": {
        "serviceMonitor": {"enabled": True},
        "kmsg": {"enabled": True},
        "runtimeClassName": "nvidia",
        "priorityClassName": "gpu-monitoring",
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["0"]}]}]}}},
        "fabric": {"enabled": True, "interface": "ib0", "portLo": 42000, "portHi": 42100},
        "labels": {"pool": "h100-sxm", "provider": "aws", "region": "us-east-1", "pricePerGpuHour": 4.1,
                   "extra": {"team": "vision"}},
        "exporter": {"dcgmNames": "4.10", "jobLabels": "hpc_job"},
    },
    "npd": {"enabled": True, "priorityClassName": "node-checks"},
}
ALL_ON_PODMONITOR = {**ALL_ON, "agent": {**ALL_ON["agent"], "serviceMonitor": {"enabled": False},
                                        "podMonitor": {"enabled": True},
                                        "exporter": {"dcgmNames": "4.10", "jobLabels": "pod"}}}
# A collector without TLS (insecure) and agents without optional mounts.
PLAINTEXT = {
    "collector": {"enabled": True, "insecure": True, "token": {"existingSecret": "gpuagent-token"}},
    "agent": {"exporter": {"enabled": False}, "podResources": {"enabled": False}, "jobsSocket": {"enabled": False},
              "machineIdHostPath": "", "hostNetwork": False, "probes": {"enabled": False}},
}
DEFAULT_AGENT_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())["agent"]
VARIANTS = {"defaults": DEFAULTS, "all_on": ALL_ON, "all_on_podmonitor": ALL_ON_PODMONITOR, "plaintext": PLAINTEXT}


# ------------------------------------------------------------------------------------------------ helpers

@functools.cache
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


def render(values: dict) -> dict[str, str]:
    return _render(json.dumps(values, sort_keys=True))


@functools.cache
def _render(values_json: str) -> dict[str, str]:
    return _chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(values: dict) -> list[dict]:
    """Every Kubernetes object the chart renders with these values (NOTES.txt is text, not a manifest)."""
    out = []
    for path, text in sorted(render(values).items()):
        if path.endswith(".yaml"):
            out.extend(d for d in yaml.safe_load_all(text) if d)
    return copy.deepcopy(out)


def one(objs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and
             (component is None or o["metadata"]["labels"]["app.kubernetes.io/component"] == component)]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def kinds(objs: list[dict]) -> list[str]:
    return sorted(o["kind"] for o in objs)


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def volumes(workload: dict) -> dict[str, dict]:
    return {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}


def mounts(workload: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container(workload).get("volumeMounts", [])}


def host_paths(workload: dict) -> dict[str, str]:
    """hostPath volume name -> host path."""
    return {n: v["hostPath"]["path"] for n, v in volumes(workload).items() if "hostPath" in v}


def mounted_file(workload: dict, path: str) -> tuple[dict, dict]:
    """The (volume, mount) that puts a file at ``path`` in the container: a secret item under a mount, or a
    mount of the path itself (subPath or a hostPath file)."""
    for mount_path, m in mounts(workload).items():
        v = volumes(workload).get(m["name"], {})   # {}: a volumeClaimTemplate
        if mount_path == path:
            return v, m
        for item in (v.get("secret") or v.get("configMap") or {}).get("items", []):
            if f"{mount_path}/{item['path']}" == path:
                return v, m
    raise AssertionError(f"nothing is mounted at {path} in {workload['metadata']['name']}")


def config_text(values: dict, component: str, key: str) -> str:
    return one(objects(values), "ConfigMap", component)["data"][key]


def parse_command(group, argv: list[str]) -> dict:
    """Parse ``argv`` (executable, subcommand, options) with the real click command: unknown options fail."""
    command = group.commands[argv[1]]
    return command.make_context(argv[1], list(argv[2:])).params


def kube_versions() -> tuple[str, str]:
    """The oldest release Chart.yaml's kubeVersion admits and the newest kubernetes-validate ships."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    m = re.fullmatch(r">=(\d+)\.(\d+)\.0-0", constraint)
    assert m, f"kubeVersion {constraint!r}: the tests read only the form '>=X.Y.0-0' (no upper bound)"
    oldest = f"{m[1]}.{m[2]}"
    shipped = kubernetes_validate.utils.all_versions()
    assert any(kubernetes_validate.utils.major_minor(v) == oldest for v in shipped), \
        f"kubernetes-validate ships no schema for {oldest}, the oldest release the chart claims"
    return oldest + ".0", kubernetes_validate.utils.latest_version()


# ServiceMonitor / PodMonitor: the fields this chart uses (see the module docstring).
_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_SELECTOR = {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
             "properties": {"matchLabels": _LABELS}}
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          "(([0-9]+)s)?(([0-9]+)ms)?)$"}
_SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["name", "key"],
               "properties": {"name": _STR, "key": _STR}}
_ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"],
             "properties": {"port": _STR, "path": _STR, "interval": _DURATION, "honorLabels": {"type": "boolean"},
                            "authorization": {"type": "object", "additionalProperties": False,
                                              "properties": {"type": _STR, "credentials": _SECRET_KEY}}}}
_METADATA = {"type": "object", "required": ["name", "labels"],
             "properties": {"name": _STR, "labels": _LABELS}}


def _monitor_schema(kind: str, endpoints: str) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                           "metadata": _METADATA,
                           "spec": {"type": "object", "additionalProperties": False,
                                    "required": ["selector", endpoints],
                                    "properties": {"selector": _SELECTOR,
                                                   endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT}}}}}


MONITOR_SCHEMAS = {"ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
                   "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints")}


# ------------------------------------------------------------------------------------------- the chart

def test_chart_metadata_names_this_release_and_a_kube_version_we_validate():
    meta = _chart().metadata
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["apiVersion"] == "v2" and meta["appVersion"] == project["version"]
    assert meta["icon"].startswith("data:image/svg+xml;base64,")
    oldest, newest = kube_versions()
    assert oldest == "1.28.0" and tuple(map(int, newest.split("."))) >= (1, 28)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_reports_nothing(variant):
    """Helm's linter (values schema, templates, Chart.yaml, icon) on each variant, for both Kubernetes versions."""
    for version in kube_versions():
        report = helm_python.lint(str(CHART), VARIANTS[variant], kube_version=f"v{version}", namespace=NAMESPACE)
        assert report["messages"] == [] and report["errors"] == [], report


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_passes_the_api_schemas(variant):
    """kubernetes-validate, strict, for the oldest and newest claimed releases; the monitoring.coreos.com objects
    against MONITOR_SCHEMAS (they are CRDs the Kubernetes schemas do not have)."""
    objs = objects(VARIANTS[variant])
    assert objs
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(obj, MONITOR_SCHEMAS[obj["kind"]])
            continue
        for version in kube_versions():
            problem = _api_schema_problem(json.dumps(obj, sort_keys=True), version)
            assert problem is None, f"{obj['kind']} {obj['metadata']['name']} fails Kubernetes {version}: {problem}"


@functools.cache
def _api_schema_problem(obj_json: str, version: str) -> str | None:
    """kubernetes-validate's verdict on one object (cached: the variants share most objects)."""
    try:
        kubernetes_validate.validate(json.loads(obj_json), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return str(exc)
    return None


def test_the_monitor_schema_is_closed():
    """MONITOR_SCHEMAS is closed: a misspelt endpoint field, or a port number where the port name goes, fails."""
    sm = one(objects(ALL_ON), "ServiceMonitor", "agent")
    jsonschema.validate(sm, MONITOR_SCHEMAS["ServiceMonitor"])
    for bad in ({"honourLabels": True}, {"port": 9402}):
        broken = copy.deepcopy(sm)
        broken["spec"]["endpoints"][0].update(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, MONITOR_SCHEMAS["ServiceMonitor"])


def test_defaults_are_one_agent_daemonset_on_gpu_nodes_and_no_rbac():
    objs = objects(DEFAULTS)
    assert kinds(objs) == ["ConfigMap", "DaemonSet", "Service", "ServiceAccount"]
    ds = one(objs, "DaemonSet", "agent")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["automountServiceAccountToken"] is False and "runtimeClassName" not in pod
    c = container(ds)
    sc = c["securityContext"]
    assert "privileged" not in sc and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    # it watches every GPU and holds none
    assert not any("nvidia.com" in k for part in c["resources"].values() for k in part)
    # the host paths, each with its reason in values.yaml and docs/KUBERNETES.md; /dev/kmsg only with kmsg on
    assert host_paths(ds) == {"state": "/var/lib/gpuagent", "host-sys": "/sys",
                              "pod-resources": "/var/lib/kubelet/pod-resources", "jobs-socket": "/run/gpuagent",
                              "machine-id": "/etc/machine-id"}
    writable = {p for p, m in mounts(ds).items() if not m.get("readOnly") and m["name"] in host_paths(ds)}
    assert writable == {"/var/lib/gpuagent", "/run/gpuagent"}
    assert mounts(ds)["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    # nothing binds a role: the agent calls no Kubernetes API
    assert not [o for o in objs if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    assert one(objs, "ServiceAccount", "agent")["automountServiceAccountToken"] is False


def test_the_pod_resources_mount_is_where_the_agent_looks_for_the_kubelet_socket():
    from gpuagent.agent.config import JobsConfig

    # [jobs] kubernetes_socket (agent/schedulers/kubelet.py): the chart renders no key for it and mounts at the default
    socket = Path(JobsConfig().kubernetes_socket)
    ds = one(objects(DEFAULTS), "DaemonSet", "agent")
    assert mounts(ds)[str(socket.parent)] == {"name": "pod-resources", "mountPath": str(socket.parent), "readOnly": True}
    assert "kubernetes" not in tomllib.loads(config_text(DEFAULTS, "agent", "agent.toml"))["jobs"]
    assert "pod-resources" not in volumes(one(objects(PLAINTEXT), "DaemonSet", "agent"))


def test_the_agent_probes_ask_what_the_agent_really_serves():
    """Liveness runs `gpuagent status` (exit 1 when the status is missing, dead or stale); readiness is an HTTP
    GET of the exporter's /metrics on the port agent.toml makes it listen on, or `gpuagent status` without it."""
    from gpuagent.agent import cli as agent_cli

    for values in (DEFAULTS, PLAINTEXT):
        ds = one(objects(values), "DaemonSet", "agent")
        c = container(ds)
        listen = tomllib.loads(config_text(values, "agent", "agent.toml"))["exporter"]["listen"]
        for probe in ("startupProbe", "livenessProbe"):
            argv = c[probe]["exec"]["command"]
            assert argv[:2] == ["gpuagent", "status"]
            assert parse_command(agent_cli.main, argv)["state_dir"] in mounts(ds)
        ready = c["readinessProbe"]
        if listen:
            port = int(listen.rsplit(":", 1)[1])
            assert ready["httpGet"] == {"path": "/metrics", "port": "metrics"}
            assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
            svc = one(objects(values), "Service", "agent")
            assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == port
        else:
            assert ready["exec"]["command"][:2] == ["gpuagent", "status"] and "ports" not in c
            assert not [o for o in objects(values) if o["kind"] == "Service" and
                        o["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"]


def test_optional_features_add_exactly_their_objects_and_mounts():
    objs = objects(ALL_ON)
    assert kinds(objs) == sorted(["ConfigMap"] * 3 + ["DaemonSet"] * 2 + ["Service"] * 3 + ["ServiceAccount"] * 3
                                 + ["ServiceMonitor"] * 2 + ["StatefulSet", "ClusterRoleBinding"])
    assert not [o for o in objs if o["kind"] in ("Role", "ClusterRole", "RoleBinding")]
    ds = one(objs, "DaemonSet", "agent")
    pods = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["spec"]
            for o in objs if o["kind"] in ("DaemonSet", "StatefulSet")}
    assert pods["agent"]["runtimeClassName"] == "nvidia" and "runtimeClassName" not in pods["npd"]
    assert {c: p.get("priorityClassName") for c, p in pods.items()} == \
        {"agent": "gpu-monitoring", "npd": "node-checks", "collector": None}
    assert all(p["imagePullSecrets"] == [{"name": "registry-login"}] for p in pods.values())
    # NPD sits on the agent's nodes; the collector where its own values say
    for key in ("nodeSelector", "affinity", "tolerations"):
        assert pods["npd"][key] == pods["agent"][key] == ALL_ON["agent"].get(key, DEFAULT_AGENT_VALUES[key])
        assert pods["collector"].get(key) == ALL_ON["collector"].get(key)
    # kmsg: the device, read-only, and a privileged container (an unprivileged one cannot open it)
    assert host_paths(ds)["kmsg"] == "/dev/kmsg" and volumes(ds)["kmsg"]["hostPath"]["type"] == "CharDevice"
    assert mounts(ds)["/dev/kmsg"]["readOnly"] is True and container(ds)["securityContext"]["privileged"] is True
    assert "kmsg" not in host_paths(one(objects(DEFAULTS), "DaemonSet", "agent"))
    # the agent's token and CA come from the Secrets named in values
    assert volumes(ds)["token"]["secret"]["secretName"] == "gpuagent-token"
    assert volumes(ds)["tls-ca"]["secret"]["secretName"] == "gpuagent-ca"
    # the agent ServiceMonitor selects the agent Service and keeps the workload's labels
    sm = one(objs, "ServiceMonitor", "agent")
    svc = one([o for o in objs if o.get("spec", {}).get("clusterIP") == "None"], "Service", "agent")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    pm_objs = objects(ALL_ON_PODMONITOR)
    pm = one(pm_objs, "PodMonitor", "agent")
    pod_labels = one(pm_objs, "DaemonSet", "agent")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert not [o for o in pm_objs if o["kind"] == "ServiceMonitor" and
                o["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"]


def test_the_collector_is_a_statefulset_with_its_database_on_a_pvc_and_secrets_from_values():
    from gpuagent.collector import cli as collector_cli

    objs = objects(ALL_ON)
    sts = one(objs, "StatefulSet", "collector")
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    c = container(sts)
    params = parse_command(collector_cli.main, c["command"])
    assert mounts(sts)[str(Path(params["db_path"]).parent)]["name"] == claim["metadata"]["name"]
    for flag, secret in (("token_file", "gpuagent-token"), ("tls_cert", "gpuagent-collector-tls"),
                         ("tls_key", "gpuagent-collector-tls")):
        volume, mount = mounted_file(sts, params[flag])
        assert volume["secret"]["secretName"] == secret and mount["readOnly"] is True
    assert params["insecure"] is False and params["listen"] == "0.0.0.0:7443"
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # the Service: gRPC where agents dial, metrics where collector.toml listens
    svc = one([o for o in objs if o.get("spec", {}).get("type") == "ClusterIP"], "Service", "collector")
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    metrics_listen = tomllib.loads(config_text(ALL_ON, "collector", "collector.toml"))["metrics"]["listen"]
    assert ports == {"grpc": 7443, "metrics": int(metrics_listen.rsplit(":", 1)[1])}
    assert sts["spec"]["serviceName"] in {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    agent_toml = tomllib.loads(config_text(ALL_ON, "agent", "agent.toml"))
    assert agent_toml["collector"]["address"] == f"{svc['metadata']['name']}.{NAMESPACE}.svc:7443"
    # its ServiceMonitor scrapes /metrics with the same bearer token
    sm = one(objs, "ServiceMonitor", "collector")
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "gpuagent-token", "key": "token"}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # TLS: the kubelet's gRPC probe cannot speak it, so tcpSocket; plaintext: grpc.health.v1
    assert "tcpSocket" in c["readinessProbe"] and "grpc" not in c["readinessProbe"]
    plain = container(one(objects(PLAINTEXT), "StatefulSet", "collector"))
    assert plain["readinessProbe"]["grpc"] == {"port": 7443}
    assert parse_command(collector_cli.main, plain["command"])["insecure"] is True


def test_node_problem_detector_runs_the_documented_plugin_with_the_builtin_role_only():
    objs = objects(ALL_ON)
    npd = one(objs, "DaemonSet", "npd")
    shipped = json.loads((CHART / "files" / "gpuagent-health.json").read_text())
    assert json.loads(one(objs, "ConfigMap", "npd")["data"]["gpuagent-health.json"]) == shipped
    assert shipped == json.loads(_doc_block("docs/HEALTH.md", "## node-problem-detector", "json"))
    c = container(npd)
    config_flag = next(a for a in c["command"] if a.startswith("--config.custom-plugin-monitor="))
    config_path = config_flag.split("=", 1)[1]
    assert mounts(npd)[str(Path(config_path).parent)]["name"] == "config"
    # the plugin reads the agent's state dir, read-only, from the host path the agent writes
    agent_ds = one(objs, "DaemonSet", "agent")
    assert host_paths(npd) == {"agent-state": host_paths(agent_ds)["state"]}
    assert mounts(npd)["/var/lib/gpuagent"]["readOnly"] is True
    pod = npd["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["nodeSelector"] == agent_ds["spec"]["template"]["spec"]["nodeSelector"]
    assert {e["name"] for e in c["env"]} >= {"NODE_NAME"}
    binding = one(objs, "ClusterRoleBinding", "npd")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "system:node-problem-detector"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert one(objs, "ServiceAccount", "npd")["automountServiceAccountToken"] is True


# --------------------------------------------------------------------------------- the rendered configs

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_agent_toml_loads_with_the_agents_own_loader(variant, tmp_path):
    """load_config refuses unknown tables and keys; the files agent.toml names are the ones mounted."""
    from gpuagent.agent.config import load_config

    values = VARIANTS[variant]
    text = config_text(values, "agent", "agent.toml")
    ds = one(objects(values), "DaemonSet", "agent")
    raw = tomllib.loads(text)
    for key in ("token_file", "tls_ca"):   # load_config checks that these files exist: stand them up here
        if key in raw["collector"]:
            path = raw["collector"][key]
            volume, _ = mounted_file(ds, path)
            assert "secret" in volume
            local = tmp_path / Path(path).name
            local.write_text("SYNTHETIC\n")
            text = text.replace(json.dumps(path), json.dumps(str(local)))
    config = tmp_path / "agent.toml"
    config.write_text(text)
    cfg = load_config(str(config), env={})
    assert cfg.collector.address == (ADDRESS if variant == "defaults" else f"{RELEASE}-collector.{NAMESPACE}.svc:7443")
    assert cfg.state_dir in mounts(ds) and mounts(ds)[cfg.state_dir]["name"] == "state"
    assert mounts(ds)[cfg.hardware.sys_root]["name"] == "host-sys"
    assert cfg.hardware.kmsg == bool(values.get("agent", {}).get("kmsg", {}).get("enabled"))
    assert cfg.jobs.step_listener == ("/run/gpuagent" in mounts(ds))
    if variant.startswith("all_on"):
        assert dict(cfg.labels) == {"pool": "h100-sxm", "provider": "aws", "region": "us-east-1",
                                    "price_per_gpu_hour": "4.1", "team": "vision"}
        assert (cfg.exporter.dcgm_names, cfg.exporter.job_labels) == \
            ("4.10", values["agent"]["exporter"]["jobLabels"])
        assert (cfg.fabric.enabled, cfg.fabric.interface, cfg.fabric.port_lo, cfg.fabric.port_hi) == \
            (True, "ib0", 42000, 42100)
        assert cfg.collector.token_file and cfg.collector.tls_ca
    else:
        assert dict(cfg.labels) == {} and not cfg.fabric.enabled and not cfg.collector.tls_ca
    assert bool(cfg.collector.token_file) == ("token" in volumes(ds))


@pytest.mark.parametrize("variant", ["all_on", "plaintext"])
def test_the_collector_toml_loads_with_the_loaders_serve_uses(variant, tmp_path):
    from gpuagent.collector import cli_options as collector_cli

    config = tmp_path / "collector.toml"
    config.write_text(config_text(VARIANTS[variant], "collector", "collector.toml"))
    loaded = collector_cli.load_config(str(config))
    analyzer, storage, fabric = loaded.analyzer, loaded.maintenance, loaded.fabric
    assert loaded.auth == {}
    assert not loaded.lake.enabled and not loaded.actions.enabled
    assert analyzer.metrics_listen == "0.0.0.0:9403"
    if variant == "all_on":
        assert analyzer.interval_s == 120 and analyzer.pool_prices == {"h100-sxm": 4.1}
        assert analyzer.thresholds["virtualization_overhead.h2d"] == 8
        assert storage.raw_retention_s == 3 * 86400 and storage.max_db_bytes == 400 * 10**9
        assert fabric is not None
    else:
        assert fabric is None


def test_a_collector_key_the_code_does_not_know_is_refused_not_ignored(tmp_path):
    """collector.config tables pass keys through; the collector's loader, not the chart, knows them, and a typo
    stops `serve` with one sentence naming it."""
    import click
    from gpuagent.collector import cli_options as collector_cli

    values = {"collector": {**PLAINTEXT["collector"], "config": {"storage": {"raw_retension": "3d"}}}}
    config = tmp_path / "collector.toml"
    config.write_text(config_text(values, "collector", "collector.toml"))
    with pytest.raises(click.ClickException, match="unknown setting storage.raw_retension"):
        collector_cli.load_config(str(config))


# ------------------------------------------------------------------------------------------- bad values

BAD_VALUES = [
    ({}, "collector.address is required: set it to the HOST:PORT of the gpuagent collector"),
    ({"collector": {"address": "collector.example"}},
     'collector.address must be HOST:PORT (e.g. collector.example:7443), not "collector.example".'),
    ({"collector": {"enabled": True}}, "collector.enabled needs collector.token.existingSecret"),
    ({"collector": {"enabled": True, "token": {"existingSecret": "t"}}},
     "collector.enabled needs collector.tls.existingSecret (a kubernetes.io/tls Secret), or collector.insecure=true"),
    ({"collector": {"enabled": True, "token": {"existingSecret": "t"}, "tls": {"existingSecret": "tls"}}},
     "collector.tls.existingSecret is set but collector.tls.caSecret is not"),
    ({"collector": {"address": ADDRESS, "serviceMonitor": {"enabled": True}}},
     "collector.serviceMonitor.enabled needs collector.enabled"),
    ({"collector": {"address": ADDRESS}, "agent": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
     "would scrape every agent twice"),
    ({"collector": {"address": ADDRESS}, "agent": {"exporter": {"enabled": False}, "podMonitor": {"enabled": True}}},
     "agent.serviceMonitor and agent.podMonitor need agent.exporter.enabled"),
    ({"collector": {"address": ADDRESS}, "agent": {"fabric": {"enabled": True}}},
     "agent.fabric.enabled needs agent.fabric.interface"),
    ({"collector": {"address": ADDRESS}, "agent": {"hostNetwork": False, "fabric": {"enabled": True, "interface": "ib0"}}},
     "agent.fabric.enabled needs agent.hostNetwork=true"),
    ({"collector": {"address": ADDRESS}, "agent": {"fabric": {"enabled": True, "interface": "ib0", "portLo": 42100,
                                                              "portHi": 42000}}},
     "must both be 0 or a range lo <= hi, not 42100-42000."),
    ({"agent": {"enabled": False}, "npd": {"enabled": True}}, "npd.enabled needs agent.enabled"),
]


@pytest.mark.parametrize("values,sentence", BAD_VALUES, ids=[s.split(" ")[0] + str(i) for i, (_, s) in
                                                              enumerate(BAD_VALUES)])
def test_bad_values_stop_the_render_with_one_sentence(values, sentence):
    with pytest.raises(helm_python.HelmRenderError) as err:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(err.value).split("validate.yaml:", 1)[1].split("): ", 1)[1].strip()
    assert sentence in message and "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("values,where", [
    ({"collector": {"address": ADDRESS, "adress": "x"}}, "additional properties 'adress' not allowed"),
    ({"collector": {"address": ADDRESS}, "agent": {"exporter": {"dcgmNames": "4.7"}}}, "/agent/exporter/dcgmNames"),
    ({"collector": {"address": ADDRESS}, "agent": {"labels": {"pricePerGpuHour": "cheap"}}},
     "/agent/labels/pricePerGpuHour"),
])
def test_values_the_schema_refuses_are_named(values, where):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(where)):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


def test_the_schema_enums_are_the_agents_own():
    from gpuagent.agent.config import DCGM_NAME_GENERATIONS, JOB_LABEL_MODES

    exporter = _chart().schema["properties"]["agent"]["properties"]["exporter"]["properties"]
    assert exporter["dcgmNames"]["enum"] == list(DCGM_NAME_GENERATIONS)
    assert exporter["jobLabels"]["enum"] == list(JOB_LABEL_MODES)
    assert _chart().values["agent"]["exporter"]["dcgmNames"] == DCGM_NAME_GENERATIONS[0]


# ------------------------------------------------------------------------------------------ the image

def _doc_block(doc: str, section: str, lang: str) -> str:
    """The first ```lang block after ``section`` in a doc."""
    text = (ROOT / doc).read_text().split(section, 1)[1]
    return text.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def _containerfile_default(arg: str) -> str:
    m = re.search(rf"^ARG {arg}=(\S+)$", CONTAINERFILE.read_text(), re.MULTILINE)
    assert m, f"Containerfile has no ARG {arg}=..."
    return m[1]


def test_the_containerfile_installs_extras_and_commands_that_exist():
    """Not a build (no image builder on the test machine, docs/KUBERNETES.md): what it names must exist."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = CONTAINERFILE.read_text()
    extras = _containerfile_default("EXTRAS").split(",")
    assert set(extras) <= set(pyproject["optional-dependencies"]) and "probes" not in extras   # no torch by default
    assert 'pip install "/src[${EXTRAS}]"' in text
    for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.MULTILINE):
        assert (ROOT / src).exists(), f"Containerfile copies {src}, which the repository does not have"
    for arg in ("PYTHON_IMAGE", "NPD_IMAGE"):
        tag = _containerfile_default(arg).rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d", tag), f"{arg} must pin a release, not {tag!r}"
    ignored = (CONTAINERFILE.parent / "Containerfile.dockerignore").read_text().split()
    assert {f"!{s}" for s in re.findall(r"^COPY (?!--from)(\S+) ", text, re.MULTILINE)} <= set(ignored)
    # every executable the chart's containers and probes run comes from [project.scripts] or the Containerfile
    installed = set(pyproject["scripts"]) | set(re.findall(r"^COPY .* (/usr/local/bin/\S+)$", text, re.MULTILINE))
    for obj in objects(ALL_ON) + objects(PLAINTEXT):
        if obj["kind"] not in ("DaemonSet", "StatefulSet"):
            continue
        c = container(obj)
        argv0 = [c["command"][0]] + [c[p]["exec"]["command"][0] for p in ("startupProbe", "livenessProbe",
                                                                            "readinessProbe") if "exec" in c.get(p, {})]
        assert set(argv0) <= installed, (obj["metadata"]["name"], argv0)


def test_the_npd_plugin_in_the_image_is_the_documented_command():
    from gpuagent.agent import cli as agent_cli

    text = CONTAINERFILE.read_text()
    rule_path = json.loads((CHART / "files" / "gpuagent-health.json").read_text())["rules"][0]["path"]
    assert f"COPY packaging/container/gpuagent-health-npd {rule_path}\n" in text
    wrapper = (ROOT / "packaging" / "container" / "gpuagent-health-npd").read_text()
    assert wrapper == _doc_block("docs/HEALTH.md", "## node-problem-detector", "bash")
    exec_line = next(line for line in wrapper.splitlines() if line.startswith("exec "))
    params = parse_command(agent_cli.main, shlex.split(exec_line)[1:])
    assert params["fmt"] == "npd"
    assert params["state_dir"] in mounts(one(objects(ALL_ON), "DaemonSet", "npd"))
