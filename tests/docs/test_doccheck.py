"""Each check of tests/docs/doccheck.py fails on a broken document (and names its line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qosfs.policy.loading import parse_policy
from qosfs.policy.model import PolicyError
from tests.docs.doccheck import (
    INVALID_MARK,
    bench_problems,
    blocks,
    link_problems,
    make_problems,
    policy_problem,
    qosfs_problem,
    shell_commands,
    unlabelled_fences,
)


def _doc(tmp_path: Path, text: str) -> list[Path]:
    path = tmp_path / "broken.md"
    path.write_text(text)
    return [path]


@pytest.mark.parametrize("shown", [
    "```sh\nqosfs mount /a /b --no-such-option\n```",
    "```sh\nsudo qosfs ctl set checkpoints write_bandwith=1GiB/s  # misspelt key\n```",
    "```sh\nqosfs ctl set checkpoints write_bandwidth=fast\n```",
    "```sh\nqosfs ctl set nosuchkind:x write_bandwidth=1GiB/s\n```",
    "```sh\nQOSFS_X=1 qosfs \\\n    ctl sat\n```",
    "```console\n$ qosfs chek policy.toml\nqosfs: output, not checked\n```",
])
def test_a_wrong_qosfs_command_is_caught(tmp_path: Path, shown: str) -> None:
    found = [c for c in shell_commands(_doc(tmp_path, shown)) if c[1][0] == "qosfs"]
    assert len(found) == 1
    problem = qosfs_problem(*found[0])
    assert problem is not None and problem.startswith(f"{tmp_path}/broken.md:2: qosfs ")


def test_console_output_is_not_taken_for_commands(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "```console\n$ qosfs plan --params 7B\nqosfs plan: 7B\n# qosfs top\n```")
    assert [w for _, w in shell_commands(doc)] == [
        ["qosfs", "plan", "--params", "7B"], ["qosfs", "top"]]


@pytest.mark.parametrize("policy,marked", [
    ('[classes.a]\npaths = ["x/**"]\nwrite_bandwidth = "fast"\n', False),
    ('[clases.a]\npaths = ["x/**"]\n', False),  # a misspelt table is not skipped
    ('[classes.a]\npaths = ["x/**"]\nwrite_bandwidth = "1GiB/s"\n', True),
])
def test_a_wrong_policy_is_caught(tmp_path: Path, policy: str, marked: bool) -> None:
    mark = INVALID_MARK + "\n" if marked else ""
    [block] = blocks(_doc(tmp_path, f"text\n{mark}```toml\n{policy}```\n"))
    assert block.marked_invalid == marked
    problem = policy_problem(block)
    assert problem is not None
    if not marked:
        assert problem.startswith(f"{tmp_path}/broken.md:{5 if 'fast' in policy else 3}: ")


def test_a_fragment_gets_only_what_a_policy_around_it_would_give(tmp_path: Path) -> None:
    fragment = ('[classes.a]\npaths = ["x/**"]\ntenants = ["t"]\nscope = "cluster"\n'
                'min_read_bandwidth = "1GiB/s"\nwrite_bandwidth = "1GiB/s"\n')
    [block] = blocks(_doc(tmp_path, f"```toml\n{fragment}```\n"))
    assert policy_problem(block) is None
    with pytest.raises(PolicyError):
        parse_policy(fragment)  # what the completion is for
    [wrong] = blocks(_doc(tmp_path, f"```toml\n{fragment}priority = 'urgent'\n```\n"))
    assert policy_problem(wrong) is not None


def test_a_missing_make_target_or_bench_suite_is_caught(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "```sh\nmake -j2 demo PREFIX=/opt\nmake nosuch\n"
                         "sudo .venv/bin/python -m bench nosuchsuite\n```\n"
                         "Run `make alsonot` or `python -m bench caps --nosuchflag`.\n")
    assert make_problems(doc) == (3, [f"{tmp_path}/broken.md:3: make nosuch",
                                      f"{tmp_path}/broken.md:6: make alsonot"])
    shown, problems = bench_problems(doc)
    assert shown == 2 and len(problems) == 2 and "nosuchsuite" in problems[0]


def test_a_broken_link_or_an_unlabelled_fence_is_caught(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("")
    doc = _doc(tmp_path, "[ok](there.md#a) [gone](gone.md) ![img](img.png) `[x](code.md)`\n"
                         "[ref]: ../nowhere/file.md\n[web](https://example.org/x)\n"
                         "```\nqosfs nothing\n```\n")
    assert link_problems(doc) == [f"{tmp_path}/broken.md:1: gone.md",
                                  f"{tmp_path}/broken.md:1: img.png",
                                  f"{tmp_path}/broken.md:2: ../nowhere/file.md"]
    assert unlabelled_fences(doc) == [f"{tmp_path}/broken.md:4"]
