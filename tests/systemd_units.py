"""Read systemd unit files and turn their command lines into argv the way systemd does.

Just enough of systemd.unit(5)/systemd.service(5) for our own units: sections and keys
(a key given twice, like ``ExecReload=``, keeps its values in order), path escaping
(``systemd-escape --path``), the specifiers they use, ``Environment=`` and
``EnvironmentFile=``, ``$VAR``/``${VAR}`` expansion of whole words, and time spans
(``RestartSec=500ms``). Anything else raises, so a unit that grows past what this
understands fails its tests loudly.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "qosfs@.service"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(path: Path) -> Unit:
    """``{section: {key: [values in order]}}``; an empty assignment resets the list."""
    unit: Unit = defaultdict(lambda: defaultdict(list))
    section = None
    text = path.read_text().replace("\\\n", " ")
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert section is not None and sep, f"{path}: cannot parse {raw!r}"
        if value.strip():
            unit[section][key.strip()].append(value.strip())
        else:
            unit[section][key.strip()] = []
    return unit


def escape_path(path: str) -> str:
    """``systemd-escape --path``: /mnt/my-fs -> mnt-my\\x2dfs."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return "-"
    out = []
    for i, ch in enumerate("/".join(parts)):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and (ch.isalnum() or ch in ":_")) or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


def unescape(instance: str) -> str:
    """%I: "-" back to "/", then \\xNN decoded."""
    raw = instance.replace("-", "/").encode()
    return re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes([int(m.group(1), 16)]),
                  raw).decode()


def specifiers(instance: str, *, etc: Path, run: Path) -> dict[str, str]:
    """The specifiers our unit uses, with /etc and /run moved under a test directory."""
    return {"i": instance, "I": unescape(instance), "f": "/" + unescape(instance),
            "E": str(etc), "t": str(run), "%": "%"}


def expand(value: str, spec: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in spec:
            raise ValueError(f"specifier %{m.group(1)} not handled by the tests")
        return spec[m.group(1)]

    return re.sub(r"%(.)", one, value)


def read_environment_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def environment(unit: Unit, spec: dict[str, str]) -> dict[str, str]:
    """Environment= then EnvironmentFile= (which wins; a leading "-": may be missing)."""
    env: dict[str, str] = {}
    for value in unit["Service"].get("Environment", []):
        for word in shlex.split(value):
            key, _, val = expand(word, spec).partition("=")
            env[key] = val
    for value in unit["Service"].get("EnvironmentFile", []):
        optional = value.startswith("-")
        path = Path(expand(value.lstrip("-"), spec))
        if path.exists() or not optional:
            env.update(read_environment_file(path))
    return env


def command(line: str, spec: dict[str, str], env: dict[str, str]) -> list[str]:
    """One Exec*= line as argv, in systemd's order: split into words, then specifiers in
    each word (so an instance's ``\\x2d`` stays as it is), then at exec time ``${VAR}``
    (one word) and ``$VAR`` (split at whitespace, none if empty) as whole words."""
    if line[0] in "-@:+!":
        raise ValueError(f"Exec prefix {line[0]!r} not handled by the tests")
    argv: list[str] = []
    for word in (expand(w, spec) for w in shlex.split(line)):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env.get(m.group(1), ""))
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv.extend(env.get(m.group(1), "").split())
        elif "$" in word:
            raise ValueError(f"partial variable expansion in {word!r} not handled")
        else:
            argv.append(word)
    return argv


TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0}


def timespan(value: str) -> float:
    """A systemd.time(7) span in seconds: "2" (seconds), "500ms", "1min 30s"."""
    total = 0.0
    words = value.split()
    assert words, "empty time span"
    for word in words:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", word)
        if not m or (m[2] or "s") not in TIME_UNITS:
            raise ValueError(f"time span {value!r} not handled by the tests")
        total += float(m[1]) * TIME_UNITS[m[2] or "s"]
    return total
