"""The Kubernetes manifests in deploy/kubernetes, validated structurally: no cluster is
available here, so every field that makes qosfs work is checked against qosfs itself
(its argument parser, its policy loader) and against the other manifests."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import pytest

from qosfs.daemon.cli import _build_parser
from qosfs.policy.loading import parse_policy
from tests.mounting import ROOT

yaml = pytest.importorskip("yaml")

K8S = ROOT / "deploy" / "kubernetes"


def _load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S / name).read_text())
    return loaded


@pytest.fixture
def daemonset() -> dict[str, Any]:
    return _load("daemonset.yaml")


def _pod(daemonset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def _container(daemonset: dict[str, Any]) -> dict[str, Any]:
    containers = _pod(daemonset)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _args(daemonset: dict[str, Any]) -> Any:
    container = _container(daemonset)
    assert container["command"] == ["qosfs"]
    return _build_parser().parse_args(container["args"])


def _mount_of(daemonset: dict[str, Any], volume: str) -> dict[str, Any]:
    return next(m for m in _container(daemonset)["volumeMounts"] if m["name"] == volume)


def _volume(daemonset: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in _pod(daemonset)["volumes"] if v["name"] == name)


def test_every_manifest_parses_and_kustomization_lists_them() -> None:
    kustomization = _load("kustomization.yaml")
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    example = "training-pod-example.yaml"  # shows a user's pod: not deployed with qosfs
    assert sorted([*kustomization["resources"], example]) == files
    for name in files:
        document = _load(name)
        assert document["apiVersion"] and document["kind"], name
        if document["kind"] != "Namespace" and name != example:
            assert document["metadata"]["namespace"] == "qosfs-system", name


def test_daemon_runs_privileged_with_host_pids_and_fuse(daemonset: dict[str, Any]) -> None:
    pod = _pod(daemonset)
    assert pod["hostPID"] is True  # callers' /proc is read to classify them
    assert _container(daemonset)["securityContext"]["privileged"] is True
    assert _volume(daemonset, "fuse")["hostPath"] == {"path": "/dev/fuse",
                                                       "type": "CharDevice"}
    assert _mount_of(daemonset, "fuse")["mountPath"] == "/dev/fuse"
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 1
    # Longer than the daemon's drain (10 s) plus its unmount.
    assert pod["terminationGracePeriodSeconds"] >= 30


def test_the_mount_is_in_place_over_the_host_path_and_propagates(
        daemonset: dict[str, Any]) -> None:
    args = _args(daemonset)
    assert args.command == "mount" and args.foreground
    assert args.mountpoint is None  # in place: SOURCE is the mountpoint
    data = _mount_of(daemonset, "data")
    assert data["mountPropagation"] == "Bidirectional"  # else the host never sees it
    # The host's path appears at the same path in the container, and the volume is a
    # strict parent of the mountpoint: a bind of the mountpoint itself copies only the
    # mount on top, dead after a crash (test_restart_propagation shows why).
    assert _volume(daemonset, "data")["hostPath"]["path"] == data["mountPath"]
    assert Path(data["mountPath"]) in Path(args.source).parents


def test_the_policy_comes_from_the_configmap_and_loads(daemonset: dict[str, Any]) -> None:
    args = _args(daemonset)
    policy_mount = _mount_of(daemonset, "policy")
    configmap = _load("configmap.yaml")
    assert _volume(daemonset, "policy")["configMap"]["name"] == configmap["metadata"]["name"]
    key = Path(args.policy).relative_to(policy_mount["mountPath"])
    text = configmap["data"][str(key)]
    policy = parse_policy(text, "configmap.yaml")
    assert {c.name for c in policy.classes} >= {"datasets", "checkpoints", "default"}


def test_socket_and_metrics_are_reachable(daemonset: dict[str, Any]) -> None:
    args = _args(daemonset)
    sockets = _mount_of(daemonset, "sockets")
    assert Path(args.socket).parent == Path(sockets["mountPath"])
    assert _volume(daemonset, "sockets")["hostPath"]["path"] == sockets["mountPath"]
    host, port = args.metrics.rsplit(":", 1)
    assert host == "0.0.0.0"  # scraped from other hosts
    container = _container(daemonset)
    assert [p["containerPort"] for p in container["ports"]] == [int(port)]
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == port
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": int(port)}
    service = _load("service.yaml")
    assert service["spec"]["ports"][0]["targetPort"] == int(port)
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]
    # The liveness probe and preStop hook talk to the socket the daemon serves.
    liveness = container["livenessProbe"]["exec"]["command"]
    probe = _build_parser().parse_args(liveness[1:])
    assert probe.command == "ctl" and probe.socket == args.socket
    hook = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert args.socket in hook and f"fusermount3 -u {args.source}" in hook


def test_the_example_pod_lands_in_its_namespace_tenant() -> None:
    pod = _load("training-pod-example.yaml")
    policy = parse_policy(_load("configmap.yaml")["data"]["policy.toml"])
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    tenants = [t for t in policy.tenants
               if t.job_env in env and env[t.job_env] == "metadata.namespace"
               and any(fnmatch.fnmatchcase(pod["metadata"]["namespace"], g) for g in t.jobs)]
    assert [t.name for t in tenants] == ["vision"]
    (mnt,) = container["volumeMounts"]
    (volume,) = pod["spec"]["volumes"]
    assert mnt["name"] == volume["name"]
    assert mnt["mountPropagation"] == "HostToContainer"  # sees qosfs's mount over it
    assert volume["hostPath"]["path"] == mnt["mountPath"]
    source = _args(_load("daemonset.yaml")).source
    assert Path(mnt["mountPath"]) in Path(source).parents  # the parent, as the daemon's
    assert re.fullmatch(r"metadata\.labels\['project'\]", env["RUNAI_PROJECT"])
