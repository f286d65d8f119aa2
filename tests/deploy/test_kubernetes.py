"""The Kubernetes manifests in deploy/kubernetes, validated structurally: no cluster is
available here, so every field that makes qosfs work is checked against qosfs itself
(its argument parser, its policy loader) and against the other manifests."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from qosfs.daemon.cli import _build_parser
from qosfs.daemon.takeover import fuse_session
from qosfs.daemon.takeover.offer import handover_socket_path
from qosfs.policy.loading import parse_policy
from tests.mounting import ROOT, is_mounted
from tests.waiting import wait_for

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
    """The qosfs command line the container's entry point (qosfs-pod) runs, parsed."""
    container = _container(daemonset)
    assert container["command"] == ["qosfs-pod"]
    assert container["args"][0] == "qosfs"
    return _build_parser().parse_args(container["args"][1:])


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


def test_a_rollout_starts_the_new_pod_while_the_old_one_serves(
        daemonset: dict[str, Any]) -> None:
    """The new pod must run beside the old one on the node (its `qosfs mount` takes the
    live mount over), and no node may be left without a daemon meanwhile."""
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = _pod(daemonset)
    # Two pods of the DaemonSet on one node: nothing of the node's may be claimed by one
    # alone (a host port, the host's network namespace and its port 9567).
    assert not pod.get("hostNetwork", False)
    assert all("hostPort" not in p for p in _container(daemonset)["ports"])
    # The old daemon knows its successor by SO_PEERCRED and a pidfd: between two pods'
    # pid namespaces the peer's pid reads as 0 and the handover is refused
    # (test_a_handover_between_pid_namespaces_is_refused).
    assert pod["hostPID"] is True


def test_old_and_new_pods_share_the_handover_socket(daemonset: dict[str, Any]) -> None:
    args = _args(daemonset)
    sockets = _mount_of(daemonset, "sockets")
    handover = Path(handover_socket_path(args.socket))
    assert handover.parent == Path(sockets["mountPath"])  # beside the control socket
    # The host's directory, the same in every pod of the node (an emptyDir is the pod's).
    assert _volume(daemonset, "sockets")["hostPath"] == {"path": sockets["mountPath"],
                                                         "type": "DirectoryOrCreate"}


def test_the_image_installs_the_entry_point_and_can_hand_over(
        daemonset: dict[str, Any]) -> None:
    (entry,) = _container(daemonset)["command"]
    dockerfile = (K8S / "Dockerfile").read_text()
    copies = [line.split()[1:] for line in dockerfile.splitlines()
              if line.startswith("COPY ")]
    assert [K8S.relative_to(ROOT) / entry, Path("/usr/local/bin") / entry] in \
        [[Path(p) for p in c] for c in copies]  # on the image's PATH
    assert os.access(K8S / entry, os.X_OK)
    # pyfuse3 against the project's libfuse (PyPI's cannot hand over), checked at build.
    run = dockerfile.replace("\\\n", " ")
    venv = "/opt/qosfs"
    assert f"/src/deploy/libfuse/build.sh {venv} " in run
    assert f"{venv}/bin/python -c 'import sys; from qosfs.daemon.takeover.fuse_session import " \
        "unavailable_reason; sys.exit(unavailable_reason())'" in run
    assert f"ln -s {venv}/bin/qosfs /usr/local/bin/qosfs" in run


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


# How the kubelet binds a hostPath volume for each mountPropagation (runc's rbind plus
# the propagation it sets on the container's copy).
_PROPAGATION = {"Bidirectional": "rshared", "HostToContainer": "rslave", "None": "rprivate"}

# tmpfs mounts stand in for the shared filesystem ("nfs") and for qosfs's FUSE mounts
# ("fuseN"): what is asserted is which mount each namespace sees at the data path, and
# a dead FUSE mount is, for that, one that stayed. Each container is a private tmpfs
# with the volume bound into it, as in its own mount namespace.
_SCRIPT = r"""
set -eu
S=$1 DATA=$2 QHOST=$3 QPATH=$4 QPROP=$5 PHOST=$6 PPATH=$7 PPROP=$8
mount -t tmpfs sim "$S"; mount --make-private "$S"
mkdir -p "$S/host"; mount -t tmpfs host "$S/host"; mount --make-rshared "$S/host"
mkdir -p "$S/host$DATA"; mount -t tmpfs nfs "$S/host$DATA"; echo nfs > "$S/host$DATA/who"
container() {  # name hostPath mountPath propagation
  mkdir -p "$S/$1"; mount -t tmpfs "$1" "$S/$1"; mount --make-private "$S/$1"
  mkdir -p "$S/$1$3"; mount --rbind "$S/host$2" "$S/$1$3"; mount "--make-$4" "$S/$1$3"
}
qosfs_mounts() { mount -t tmpfs "$2" "$S/$1$DATA"; echo "$2" > "$S/$1$DATA/who"; }
look() { for c in "$@"; do echo "$STEP $c $(cat "$S/$c$DATA/who" 2>/dev/null || echo -)"; done; }
container qosfs "$QHOST" "$QPATH" "$QPROP"
container early "$PHOST" "$PPATH" "$PPROP"
STEP=mounted; qosfs_mounts qosfs fuse1
container late "$PHOST" "$PPATH" "$PPROP"
look host early late
STEP=stopped; umount "$S/qosfs$DATA"; look host early late
STEP=restarted; qosfs_mounts qosfs fuse2; look host early late
# A crash leaves fuse2 mounted; the next container cleans it (umount -l, as
# clean_stale_mount does) and mounts again.
container qosfs2 "$QHOST" "$QPATH" "$QPROP"
STEP=cleaned; umount -l "$S/qosfs2$DATA"; look host qosfs2 early late
STEP=recovered; qosfs_mounts qosfs2 fuse3; look host early late
"""


@pytest.mark.root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_restart_propagation(daemonset: dict[str, Any], tmp_path: Path) -> None:
    """Binds the manifests' volumes as the kubelet would, in a mount namespace of the
    test's own, and follows what the host and two pods (started before and after qosfs
    mounted) see at the data path across a stop, a restart and a crash."""
    source = _args(daemonset).source
    data = _mount_of(daemonset, "data")
    pod = _load("training-pod-example.yaml")
    (pod_mount,) = pod["spec"]["containers"][0]["volumeMounts"]
    (pod_volume,) = pod["spec"]["volumes"]
    root = tmp_path / "root"
    root.mkdir()
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", _SCRIPT, "sim",
         str(root), source,
         _volume(daemonset, "data")["hostPath"]["path"], data["mountPath"],
         _PROPAGATION[data["mountPropagation"]],
         pod_volume["hostPath"]["path"], pod_mount["mountPath"],
         _PROPAGATION[pod_mount["mountPropagation"]]],
        capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    seen = {(step, where): who for step, where, who in map(str.split, run.stdout.splitlines())}
    assert seen == {
        ("mounted", "host"): "fuse1", ("mounted", "early"): "fuse1",
        ("mounted", "late"): "fuse1",
        # Stopped: the real directory underneath, everywhere.
        ("stopped", "host"): "nfs", ("stopped", "early"): "nfs", ("stopped", "late"): "nfs",
        # Restarted: the new mount, in pods that started before or during the old one.
        ("restarted", "host"): "fuse2", ("restarted", "early"): "fuse2",
        ("restarted", "late"): "fuse2",
        # After a crash the new container reaches the filesystem under the dead mount.
        ("cleaned", "host"): "nfs", ("cleaned", "qosfs2"): "nfs",
        ("cleaned", "early"): "nfs", ("cleaned", "late"): "nfs",
        ("recovered", "host"): "fuse3", ("recovered", "early"): "fuse3",
        ("recovered", "late"): "fuse3",
    }


class Node:
    """A node for the manifest's pods, through real qosfs mounts: the container's entry
    point and command line and its preStop hook, run as the kubelet runs them, with the
    node's paths (the shared filesystem, /run/qosfs, the policy, the metrics port)
    replaced by the test's own. `qosfs` on PATH is this checkout's."""

    def __init__(self, root: Path, daemonset: dict[str, Any]) -> None:
        self.container = _container(daemonset)
        args = _args(daemonset)
        self.data, run, bin_dir = root / "mlfs", root / "run", root / "bin"
        for d in (self.data, run, bin_dir):
            d.mkdir()
        (self.data / "f").write_bytes(b"data")
        policy = root / "policy.toml"
        policy.write_text(_load("configmap.yaml")["data"]["policy.toml"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.socket = run / Path(args.socket).name
        self._paths = {args.source: str(self.data), args.policy: str(policy),
                       args.socket: str(self.socket), args.metrics: f"127.0.0.1:{port}"}
        qosfs = bin_dir / "qosfs"
        qosfs.write_text(f'#!/bin/sh\nexec {sys.executable} -m qosfs "$@"\n')
        qosfs.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "PYTHONPATH": str(ROOT)}
        self.root = root
        self.started: list[subprocess.Popen[bytes]] = []

    def _local(self, text: str) -> str:
        for node_path, here in self._paths.items():
            text = text.replace(node_path, here)
        return text

    def run(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=self.env)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def start_pod(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        """The container as the manifest has it (its command line with *extra* options);
        returns once its daemon serves."""
        (entry,) = self.container["command"]
        pod = self.run(name, [str(K8S / entry),
                              *map(self._local, self.container["args"]), *extra])
        wait_for(f"{name}'s daemon to serve", lambda: pod.poll() is None and self.serving(),
                 until=lambda up: up or pod.poll() is not None, timeout=30)
        assert pod.poll() is None, self.log(name)
        return pod

    def start_successor(self, name: str) -> subprocess.Popen[bytes]:
        """A new daemon that takes the mount over: what the new pod's `qosfs mount`
        does on a live mount, here by ``qosfs upgrade`` (the same handover)."""
        proc = self.run(name, ["qosfs", "upgrade", str(self.data), "--socket",
                                  str(self.socket), "--foreground"])
        wait_for(f"{name} to serve", lambda: proc.poll() is None and self.serving(),
                 until=lambda pid: pid == proc.pid or proc.poll() is not None, timeout=30)
        assert proc.poll() is None, self.log(name)
        return proc

    def serving(self) -> int | None:
        """The pid of the daemon answering on the control socket, or None."""
        done = subprocess.run(["qosfs", "ctl", "--socket", str(self.socket), "status",
                               "--json"], capture_output=True, text=True, env=self.env,
                              timeout=30, check=False)
        return int(json.loads(done.stdout)["pid"]) if done.returncode == 0 else None

    def pre_stop(self) -> None:
        hook = self.container["lifecycle"]["preStop"]["exec"]["command"]
        subprocess.run([*hook[:-1], self._local(hook[-1])], env=self.env, timeout=60,
                       check=True)

    def delete_pod(self, pod: subprocess.Popen[bytes], name: str) -> None:
        """*pod* deleted with no successor, as the kubelet does it: the preStop hook (the
        daemon answers, so it leaves the unmount to it), then SIGTERM: the daemon drains
        and unmounts, and the container exits 0."""
        self.pre_stop()
        assert is_mounted(self.data)
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(timeout=30) == 0, self.log(name)
        assert not is_mounted(self.data)

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
        if is_mounted(self.data):
            subprocess.run(["fusermount3", "-u", str(self.data)], check=False)
        if is_mounted(self.data):
            subprocess.run(["umount", "-l", str(self.data)], check=False)
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def node(tmp_tree: Path, daemonset: dict[str, Any]) -> Iterator[Node]:
    if (reason := fuse_session.unavailable_reason()) is not None:
        pytest.skip(f"handover unavailable: {reason}")
    n = Node(tmp_tree, daemonset)
    try:
        yield n
    finally:
        n.close()
    assert not is_mounted(n.data)


@pytest.mark.mount
@pytest.mark.root
def test_a_pod_that_handed_its_mount_over_stays_until_deleted(node: Node) -> None:
    """A rolling update on one node: the new pod takes the mount over while a job holds
    a file open; the old pod's container stays (a container that exited would be
    restarted, and take the mount back), and deleting it (preStop, then SIGTERM) leaves
    the mount to the new daemon."""
    old = node.start_pod("old")
    job = os.open(node.data / "f", os.O_RDONLY)
    try:
        new = node.start_successor("new")
        wait_for("the old pod to say it handed over", lambda: node.log("old"),
                 until=lambda log: "handed over to the daemon now answering" in log)
        assert old.poll() is None, node.log("old")  # the container did not exit
        node.pre_stop()
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=30) == 0, node.log("old")
        assert is_mounted(node.data) and node.serving() == new.pid
        assert os.pread(job, 4, 0) == b"data"  # the job's descriptor still reads
    finally:
        os.close(job)
    new.send_signal(signal.SIGTERM)
    assert new.wait(timeout=30) == 0, node.log("new")


@pytest.mark.mount
@pytest.mark.root
def test_a_pod_deleted_without_a_successor_unmounts(node: Node) -> None:
    node.delete_pod(node.start_pod("pod"), "pod")


@pytest.mark.mount
@pytest.mark.root
def test_a_pod_whose_daemon_died_takes_the_mount_over_and_the_job_reads_on(
        node: Node) -> None:
    """kill -9 of the daemon: the holder it started keeps the connection, the entry point
    runs the command line again, which takes the mount over; the job's descriptor reads
    on, and the container never exited (its restart would have ended the holder)."""
    pod = node.start_pod("pod")
    daemon = node.serving()
    assert daemon is not None
    job = os.open(node.data / "f", os.O_RDONLY)
    try:
        os.kill(daemon, signal.SIGKILL)
        wait_for("a new daemon to serve", node.serving,
                 until=lambda pid: pid not in (None, daemon), timeout=30)
        assert pod.poll() is None, node.log("pod")
        assert "taking it over again (1)" in node.log("pod")
        assert os.pread(job, 4, 0) == b"data"  # the same descriptor, across the crash
    finally:
        os.close(job)
    node.delete_pod(pod, "pod")


@pytest.mark.mount
@pytest.mark.root
def test_a_pod_whose_daemon_died_without_a_keeper_fails_and_its_hook_unmounts(
        node: Node) -> None:
    pod = node.start_pod("pod", "--keeper", "none")
    daemon = node.serving()
    assert daemon is not None
    os.kill(daemon, signal.SIGKILL)
    assert pod.wait(timeout=30) != 0  # the kubelet restarts the container
    assert is_mounted(node.data)  # dead: "Transport endpoint is not connected"
    node.pre_stop()
    assert not is_mounted(node.data)


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_handover_between_pid_namespaces_is_refused(node: Node) -> None:
    """Why the pods need hostPID: in two pods' pid namespaces (siblings), the old daemon
    reads its successor's pid as 0 (SO_PEERCRED), cannot take a pidfd of it, and
    refuses; it serves on."""
    unshare = ["unshare", "--pid", "--fork"]
    old = node.run("old", [*unshare, "qosfs", "mount", "--foreground", str(node.data),
                              "--socket", str(node.socket)])
    wait_for("the daemon to serve", node.serving, timeout=30)
    new = node.run("new", [*unshare, "qosfs", "upgrade", str(node.data), "--socket",
                              str(node.socket), "--foreground"])
    assert new.wait(timeout=60) != 0, node.log("new")
    assert "handover to pid 0 refused, serving on" in node.log("old")
    assert old.poll() is None and (node.data / "f").read_bytes() == b"data"
    subprocess.run(["fusermount3", "-u", str(node.data)], check=True)
    assert old.wait(timeout=30) == 0, node.log("old")


def test_manifests_match_the_kubernetes_schemas() -> None:
    """A misspelt field (``mountPropogation``) passes the checks above, which only read
    the fields they know: the API server would reject it, and so does this, offline."""
    import kubernetes_validate as validator  # the test extra: fails, not skips, if missing
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            validator.validate(_load(path.name), "1.30.0", strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")
def test_kustomize_renders_what_it_lists() -> None:
    run = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(run.stdout)}
    listed = {(d["kind"], d["metadata"]["name"])
              for d in map(_load, _load("kustomization.yaml")["resources"])}
    assert rendered == listed
