"""The monitoring that ships in deploy/: alert rules checked and unit-tested by promtool,
and the Grafana dashboard's every query run by a real Prometheus against a live mount."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mounting import ROOT, QosfsMount, as_user
from tests.redis_server import RedisServer
from tests.waiting import wait_for

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "qosfs-dashboard.json"
MiB = 1 << 20

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool missing (Debian package prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True,
                          text=True, timeout=120)


@needs_promtool
def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    checked = _promtool("check", "rules", "qosfs-rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", "qosfs-rules.test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


ALERTS = {"QosfsDown", "QosfsReloadFailed", "QosfsLatencyTargetMissed",
          "QosfsLatencyTargetUnreachable", "QosfsThrottledHigh", "QosfsDescriptorsNearLimit",
          "QosfsPolicyDrift", "QosfsClusterFallback", "QosfsInternalError",
          "QosfsHandoverFailed", "QosfsPassthroughUncappedJoin", "QosfsPassthroughReadsUncounted"}


# Labels an alert's series cannot carry: `up` has only the target's labels (no mount: a
# failed scrape leaves nothing to join), absent() none at all, and drift compares nodes.
UNNAMED = {
    'up{job="qosfs"} == 0': {"mount"},
    'absent(up{job="qosfs"})': {"instance", "mount"},
    "count by (mount) (count by (mount, hash) (qosfs_policy_info)) > 1": {"instance"},
}


def _alert_rules() -> list[dict[str, Any]]:
    import yaml
    rules = yaml.safe_load((PROMETHEUS_DIR / "qosfs-rules.yml").read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_is_labelled_annotated_and_has_a_runbook_section() -> None:
    runbook = (ROOT / "docs" / "monitoring.md").read_text()
    rules = _alert_rules()
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        name, notes = rule["alert"], rule["annotations"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert notes["runbook_url"] == f"docs/monitoring.md#{name.lower()}", name
        assert f"### {name}\n" in runbook, name  # GitHub makes the anchor of the heading
        # Which daemon and which mount, wherever the alert's series carry them.
        said = notes["summary"] + notes["description"]
        for label in {"instance", "mount"} - UNNAMED.get(rule["expr"], set()):
            assert f"$labels.{label}" in said, (name, label)


def test_every_alert_has_unit_tests_firing_and_quiet() -> None:
    import yaml
    suite = yaml.safe_load((PROMETHEUS_DIR / "qosfs-rules.test.yml").read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in suite["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == ALERTS, ALERTS - fired
    assert quiet == ALERTS, ALERTS - quiet


@needs_promtool
def test_example_scrape_config_is_valid() -> None:
    checked = _promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target["expr"]


TEMPLATED = ("instance", "mount", "class")
LABEL_VALUES = re.compile(r"label_values\((\w+)(\{[^}]*\})?, (\w+)\)")


def _assert_regex_matched(expr: str) -> None:
    """Every template variable in ``expr`` is matched as a regex (=~"$var"): "All" and
    several values arrive as regexes (.*, a|b), which = would compare literally."""
    bare = re.sub(r'=~"\$(?:instance|mount|class)"', "", expr)
    assert not re.search(r"\$(?:instance|mount|class)\b", bare), expr


def test_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "instance", "mount", "class"}
    assert variables["datasource"]["query"] == "prometheus"
    for name in TEMPLATED:
        var = variables[name]
        assert var["datasource"]["uid"] == "${datasource}", name
        assert LABEL_VALUES.fullmatch(var["definition"]), var["definition"]
        assert var["query"]["query"] == var["definition"], name
        # "All" is the regex .*: it only works where the variable is matched with =~.
        assert var["includeAll"] and var["allValue"] == ".*", name
        _assert_regex_matched(var["definition"])
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            # Every query honours the node and mount selectors (drift compares nodes).
            assert '$mount"' in expr, (panel["title"], expr)
            _assert_regex_matched(expr)
            # Rates follow the scrape interval Grafana knows; increase() windows are
            # the panel's own choice ("rejected in 24h").
            for window in re.findall(r"\brate\([^\[]*\[([^\]]*)\]", expr):
                assert window == "$__rate_interval", (panel["title"], expr)
    # Nothing overlaps: each panel's cells are its own.
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine


# ------------------------------------------------------------ a live mount, a real Prometheus

POLICY = """
[cluster]
redis = "{redis}"
lease = "100ms"
fallback = 2

[tenants.team]
uids = [4242]
write_bandwidth = "64MiB/s"

[classes.datasets]
paths = ["data/**"]
priority = "high"
target_read_latency = "1us"   # never met: the controller caps checkpoints at once
passthrough = "off"           # its reads reach the daemon: the read panels' series

[classes.checkpoints]
paths = ["ckpt/**"]
priority = "low"
per_user = "fair"
write_bandwidth = "4MiB/s"
read_bandwidth = "1GiB/s"
burst = "1MiB"

[classes.shared]               # one cap over every mount of the cluster
paths = ["shared/**"]
scope = "cluster"
write_bandwidth = "8MiB/s"

[classes.default]
"""

# Panels whose series exist only in some states say so in their description; the mount
# here is put in all of them (a target it cannot meet, a [cluster] table), so every panel
# must return series.
CONDITIONAL = {"Automatic caps", "Cluster coordination", "Cluster cap and this node's grant"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def _substituted(expr: str) -> str:
    """``expr`` as Grafana sends it with every variable at "All"."""
    expr = expr.replace("$__rate_interval", "10s")
    for name in TEMPLATED:
        expr = expr.replace(f"${name}", ".*")
    return expr


def _rules_healthy(base: str) -> bool:
    """Every rule of qosfs-rules.yml is loaded and has been evaluated without error (an
    expression promtool accepts can still fail on real series, e.g. many-to-many)."""
    import yaml
    shipped = yaml.safe_load((PROMETHEUS_DIR / "qosfs-rules.yml").read_text())
    want = sorted(r.get("alert") or r["record"] for g in shipped["groups"] for r in g["rules"])
    loaded = [r for g in _api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in loaded) == want
    errors = [(r["name"], r["lastError"]) for r in loaded if r["health"] == "err"]
    assert not errors, errors
    return all(r["health"] == "ok" for r in loaded)


def _traffic(mnt: Path, stop: threading.Event) -> None:
    """A protected reader (O_DIRECT and passthrough = "off", so it reaches the daemon), a
    capped writer, a writer under the cluster-wide cap, and a reader of a default-class
    file, opened anew each time: passed through to the kernel, its reads counted there."""
    fd = os.open(mnt / "data" / "shard", os.O_RDONLY | os.O_DIRECT)
    buf = bytearray(1 << 16)
    view = memoryview(buf)
    try:
        with open(mnt / "ckpt" / "step.pt", "wb") as ckpt, \
                open(mnt / "shared" / "out", "wb") as shared:
            offset = 0
            while not stop.is_set():
                os.preadv(fd, [view], offset)
                offset = (offset + len(buf)) % (4 * MiB)
                ckpt.write(b"c" * (256 << 10))
                shared.write(b"s" * (256 << 10))
                (mnt / "misc" / "blob").read_bytes()
    finally:
        os.close(fd)


@pytest.mark.mount
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus missing (Debian package prometheus)")
def test_every_dashboard_query_returns_series_from_a_live_mount(
        tmp_tree: Path, redis_server: RedisServer) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    for d in (src, mnt, src / "data", src / "ckpt", src / "team", src / "shared", src / "misc"):
        d.mkdir()
    os.chmod(src / "team", 0o777)
    (src / "data" / "shard").write_bytes(os.urandom(4 * MiB))
    (src / "misc" / "blob").write_bytes(os.urandom(MiB))
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY.format(redis=redis_server.url))
    m = QosfsMount(src, mnt, "--policy", str(policy), "--metrics", "0",
                   "--socket", str(tmp_tree / "ctl.sock")).start()
    stop = threading.Event()
    writer = threading.Thread(target=_traffic, args=(mnt, stop))
    prometheus: subprocess.Popen[bytes] | None = None
    tenant: subprocess.Popen[bytes] | None = None
    try:
        metrics = wait_for("the metrics address", lambda: next(
            (word.rsplit("/", 1)[0] for word in m.log().split()
             if word.startswith("http://127.0.0.1:")), None), timeout=10, interval=0.2)
        writer.start()
        tenant = subprocess.Popen(
            ["sh", "-c", "while :; do dd if=/dev/zero of=t bs=64k count=16 2>/dev/null; done"],
            cwd=mnt / "team", preexec_fn=as_user(4242), start_new_session=True)
        port = _free_port()
        config = tmp_tree / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{PROMETHEUS_DIR / 'qosfs-rules.yml'}]\n"
            "scrape_configs:\n"
            "  - job_name: qosfs\n"
            f"    static_configs: [{{targets: ['{metrics.removeprefix('http://')}']}}]\n")
        with open(tmp_tree / "prometheus.log", "wb") as log:
            prometheus = subprocess.Popen(
                ["prometheus", f"--config.file={config}",
                 f"--storage.tsdb.path={tmp_tree / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_tree)
        base = f"http://127.0.0.1:{port}"

        def scraped() -> bool:
            try:
                found = _api(base, "/api/v1/query",
                             query='count_over_time(up{job="qosfs"}[1m])')["result"]
            except OSError:
                return False
            return bool(found) and float(found[0]["value"][1]) >= 8

        wait_for("eight scrapes", scraped, timeout=60, interval=0.2)
        targets = _api(base, "/api/v1/targets")["activeTargets"]
        assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")], targets
        # Prometheus asked for OpenMetrics and parsed it: only that format has an "info"
        # family (qosfs_build, samples qosfs_build_info) and units; the classic text
        # format would give a gauge qosfs_build_info and a unitless counter.
        families = _api(base, "/api/v1/metadata")
        assert [m["type"] for m in families.get("qosfs_build", [])] == ["info"], families
        assert [m["unit"] for m in families.get("qosfs_read_bytes", [])] == ["bytes"], families
        wait_for("every rule evaluated cleanly", lambda: _rules_healthy(base), timeout=60,
                 interval=0.2)

        # The dashboard's variables: each label_values() finds values on this mount.
        for var in _dashboard()["templating"]["list"]:
            if var["name"] not in TEMPLATED:
                continue
            found = LABEL_VALUES.fullmatch(var["definition"])
            assert found, var["definition"]
            metric, selector, label = found.groups()
            series = _api(base, "/api/v1/query", query=_substituted(metric + (selector or "")))
            assert any(r["metric"].get(label) for r in series["result"]), var["definition"]

        def empty_panels() -> list[tuple[str, str]]:
            empty = []
            for panel, expr in _targets(_dashboard()):
                if not _api(base, "/api/v1/query", query=_substituted(expr))["result"]:
                    empty.append((panel["title"], expr))
            return empty

        # The latency controller needs a few windows to cap; wait for it, not a time.
        wait_for("data in every panel", empty_panels, until=lambda empty: not empty,
                 timeout=60, interval=1)
        marked = {p["title"] for p in _dashboard()["panels"]
                  if p.get("description", "").startswith("Conditional:")}
        assert marked == CONDITIONAL, marked ^ CONDITIONAL
    finally:
        stop.set()
        if tenant is not None:  # the loop and its dd: a dd left in the mount keeps it busy
            os.killpg(tenant.pid, signal.SIGKILL)
            tenant.wait()
        if writer.is_alive():
            writer.join(30)
        if prometheus is not None:
            prometheus.send_signal(signal.SIGTERM)
            try:
                prometheus.wait(20)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait()
        assert m.stop() == 0, m.log()
