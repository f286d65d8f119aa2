"""The control protocol's parsing and validation: every malformed input, no socket."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosfs.control.protocol import (
    MAX_REQUEST_BYTES,
    Peer,
    ProtocolError,
    ReloadRequest,
    SetRequest,
    SimpleRequest,
    encode,
    error_reply,
    parse_request,
)


def req(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_read_only_commands() -> None:
    assert parse_request(b'{"cmd": "status"}') == SimpleRequest("status")
    assert parse_request(b'{"cmd":"stats"}') == SimpleRequest("stats")


def test_set_request_keeps_values_as_sent() -> None:
    got = parse_request(req({"cmd": "set", "target": "class", "name": "ckpt",
                             "changes": {"write_bandwidth": "400MiB/s", "write_iops": 2000}}))
    assert got == SetRequest("class", "ckpt", (("write_bandwidth", "400MiB/s"),
                                               ("write_iops", 2000)))


def test_set_backend_takes_no_name() -> None:
    got = parse_request(req({"cmd": "set", "target": "backend",
                             "changes": {"read_bandwidth": "4GiB/s"}}))
    assert got == SetRequest("backend", None, (("read_bandwidth", "4GiB/s"),))
    with pytest.raises(ProtocolError, match='"name" is not used with target "backend"'):
        parse_request(req({"cmd": "set", "target": "backend", "name": "x",
                           "changes": {"read_bandwidth": "4GiB/s"}}))


def test_reload_with_and_without_text() -> None:
    assert parse_request(b'{"cmd":"reload"}') == ReloadRequest()
    got = parse_request(req({"cmd": "reload", "text": "[classes.default]\n", "source": "/p"}))
    assert got == ReloadRequest("[classes.default]\n", "/p")


@pytest.mark.parametrize(("line", "message"), [
    (b"\xff\xfe", "request is not UTF-8"),
    (b"{not json", "request is not valid JSON"),
    (b"[1, 2]", "request must be a JSON object, got a list"),
    (b'"status"', "request must be a JSON object, got a string"),
    (b"{}", 'unknown command nothing'),
    (b'{"cmd": "shutdown"}', 'unknown command "shutdown"'),
    (b'{"cmd": 7}', "unknown command 7"),
    (b'{"cmd": "status", "verbose": true}', 'unknown key "verbose" for "status"'),
    (b'{"cmd": "set", "target": "class", "changes": {"a": "b"}}', '"name" is required'),
    (b'{"cmd": "set", "target": "pool", "name": "x", "changes": {"a": "b"}}',
     '"target" must be one of class, tenant, backend'),
    (b'{"cmd": "set", "target": "class", "name": "x", "changes": {}}',
     '"changes" must be a non-empty object'),
    (b'{"cmd": "set", "target": "class", "name": "x", "changes": ["a=b"]}',
     '"changes" must be a non-empty object'),
    (b'{"cmd": "set", "target": "class", "name": "x", "changes": {"a": true}}',
     'value of "a" must be a string or a number'),
    (b'{"cmd": "set", "target": "class", "name": "x", "changes": {"a": null}}',
     'value of "a" must be a string or a number'),
    (b'{"cmd": "set", "target": "class", "name": 5, "changes": {"a": "b"}}',
     '"name" must be a string, got a number'),
    (b'{"cmd": "reload", "text": ["x"]}', '"text" must be a string, got a list'),
    (b"[" * 100000 + b"]" * 100000, "longer than"),
])
def test_malformed_requests_are_refused_with_a_reason(line: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_request(line)


def test_deeply_nested_json_within_the_limit_is_refused_not_crashing() -> None:
    with pytest.raises(ProtocolError, match="request is not valid JSON"):
        parse_request(b"[" * 30000 + b"]" * 30000)


def test_oversized_request_is_refused() -> None:
    body = req({"cmd": "reload", "text": "x" * MAX_REQUEST_BYTES})
    with pytest.raises(ProtocolError, match=f"request longer than {MAX_REQUEST_BYTES} bytes"):
        parse_request(body)


def test_too_many_changes() -> None:
    changes = {f"k{i}": "1" for i in range(33)}
    with pytest.raises(ProtocolError, match="at most 32 changes"):
        parse_request(req({"cmd": "set", "target": "class", "name": "x", "changes": changes}))


def test_replies_are_one_line_and_strict_json() -> None:
    line = encode({"ok": True, "text": "a\nb"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"ok": True, "text": "a\nb"}
    assert error_reply("nope", "denied") == {"ok": False, "code": "denied", "error": "nope"}
    with pytest.raises(ValueError):
        encode({"limit": float("inf")})  # unlimited must be sent as null


def test_peer_groups() -> None:
    peer = Peer(pid=1, uid=1000, gid=100, groups=(100, 42))
    assert peer.in_group(100) and peer.in_group(42) and not peer.in_group(7)


# ------------------------------------------------------------------ hostile lines

_VALID_LINES = [
    b'{"cmd": "status"}', b'{"cmd": "stats"}', b'{"cmd": "reload"}',
    b'{"cmd": "reload", "text": "[classes.default]\\n", "source": "/p"}',
    b'{"cmd": "set", "target": "class", "name": "ckpt", "changes": {"write_bandwidth": "1MiB/s"}}',
    b'{"cmd": "set", "target": "backend", "changes": {"read_iops": 2000}}',
]
_INSERTS = [b"{", b"}", b'"', b"\\", b"\\u0000", b"\\ud800", b"\xff", b"\x00", b"[", b"]",
            b",", b":", b"null", b"true", b"1e999", b"-0", b"NaN", b"Infinity", b" " * 5,
            b'"cmd"', b'"set"', b'"changes"', b'{"a": 1}', b"\r", b"9" * 5000]


@st.composite
def hostile_line(draw: st.DrawFn) -> bytes:
    line = draw(st.sampled_from(_VALID_LINES))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(line)))
        end = min(len(line), at + draw(st.integers(0, 8)))
        line = line[:at] + draw(st.one_of(st.sampled_from(_INSERTS), st.binary(max_size=6))) \
            + line[end:]
    return line


@settings(derandomize=True, max_examples=500, deadline=None)
@given(st.one_of(hostile_line(), st.binary(max_size=200)))
def test_hostile_lines_are_requests_or_one_protocol_error(line: bytes) -> None:
    try:
        request = parse_request(line)
    except ProtocolError as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) < 200
        assert json.loads(encode(error_reply(str(exc), exc.code)))["ok"] is False
    else:
        assert request.cmd in ("status", "stats", "set", "reload")
