"""bench.core.fuse_trace: reading the kernel's FUSE request counts (no tracing needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.core import fuse_trace
from bench.core.fuse_trace import (
    FuseTrace,
    backing_counts,
    buffer_counts,
    hist_dropped,
    opcode_counts,
    parse_hist,
    parse_opcodes,
)

# the running kernel's format file (6.18), print format shortened
FORMAT = """name: fuse_request_send
ID: 1293
format:
\tfield:dev_t connection;\toffset:8;\tsize:4;\tsigned:0;
\tfield:enum fuse_opcode opcode;\toffset:24;\tsize:4;\tsigned:0;

print fmt: "connection %u req %llu opcode %u (%s) len %u ", REC->connection, REC->unique, \
REC->opcode, __print_symbolic(REC->opcode, {1, "FUSE_LOOKUP"}, {3, "FUSE_GETATTR"}, \
{14, "FUSE_OPEN"}, {15, "FUSE_READ"}, {18, "FUSE_RELEASE"}, {25, "FUSE_FLUSH"}, \
{4096, "CUSE_INIT"}), REC->len
"""

HIST = """# event histogram
#
# trigger info: hist:keys=opcode:vals=hitcount:sort=hitcount:size=256 if connection == 40 [active]
#

{ opcode:         25 } hitcount:          3
{ opcode:         14 } hitcount:        200
{ opcode:          1 } hitcount:        217
{ opcode:         99 } hitcount:          1

Totals:
    Hits: 421
    Entries: 4
    Dropped: 0
"""

IOCTL_HIST = """# event histogram
#

{ common_pid:       4242, cmd:   1074849025 } hitcount:        200
{ common_pid:       4243, cmd:   0x4004e502 } hitcount:        199
{ common_pid:       9999, cmd:   1074849025 } hitcount:         50
{ common_pid:       4242, cmd:        21505 } hitcount:          7

Totals:
    Hits: 456
    Entries: 4
    Dropped: 5
"""

TRACE = """# tracer: nop
#
# entries-in-buffer/entries-written: 5/7   #P:2
#
#           TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION
#              | |         |   |||||     |         |
          python-2101    [000] ..... 812.000001: fuse_request_send: connection 40 req 2 \
opcode 1 (FUSE_LOOKUP) len 58
          python-2101    [000] ..... 812.000002: fuse_request_send: connection 40 req 4 \
opcode 14 (FUSE_OPEN) len 48
  passthrough_hp-4242    [001] ..... 812.000003: sys_ioctl(fd: 0x00000003, cmd: 0x4010e501, \
arg: 0x7ffd1234)
  passthrough_hp-9999    [001] ..... 812.000004: sys_ioctl(fd: 0x00000003, cmd: 0x4010e501, \
arg: 0x7ffd1234)
          python-2101    [000] ..... 812.000005: fuse_request_send: connection 40 req 6 \
opcode 18 (FUSE_RELEASE) len 64
"""


def test_opcode_names_come_from_the_kernels_own_format_file() -> None:
    names = parse_opcodes(FORMAT)
    assert names[1] == "LOOKUP" and names[25] == "FLUSH" and names[4096] == "CUSE_INIT"


def test_a_histogram_is_read_as_counts_by_opcode_name() -> None:
    assert parse_hist(HIST)[0] == ({"opcode": 25}, 3)
    assert opcode_counts(HIST, parse_opcodes(FORMAT)) == {
        "FLUSH": 3, "OPEN": 200, "LOOKUP": 217, "op99": 1}
    assert hist_dropped(HIST) == 0 and hist_dropped(IOCTL_HIST) == 5


def test_backing_registrations_are_the_daemons_threads_only() -> None:
    assert parse_hist(IOCTL_HIST)[1] == ({"common_pid": 4243, "cmd": 0x4004E502}, 199)
    assert backing_counts(IOCTL_HIST, [4242, 4243]) == {
        "BACKING_OPEN": 200, "BACKING_CLOSE": 199}
    assert backing_counts(IOCTL_HIST, []) == {}


def test_the_trace_buffer_is_counted_and_says_what_it_lost() -> None:
    counts, lost = buffer_counts(TRACE, [4242])
    assert counts == {"LOOKUP": 1, "OPEN": 1, "RELEASE": 1, "BACKING_OPEN": 1}
    assert lost == 2


def test_without_tracing_it_says_why_instead_of_counting_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fuse_trace, "tracing_unavailable",
                        lambda: "not available here: no tracefs")
    with FuseTrace(tmp_path) as trace:
        assert trace.take() == {}
        assert trace.unavailable == "not available here: no tracefs"
        assert trace.inst is None
