"""The docs cannot drift from the code: every command, policy and link they show is
checked here against the real parser, policy loader, Makefile and tree.

Covered: README.md, docs/*.md and bench/*.md. Every fenced block names its language.

- ``sh``/``bash``/``shell`` blocks are commands (a leading ``$ `` is dropped);
  ``console`` blocks are transcripts: only ``$ `` or ``# `` lines are commands, the rest
  is output. Comments, ``sudo``, ``env``, ``VAR=value`` and line continuations are
  handled. Every ``qosfs ...`` command must parse with qosfs's own argument parser, and
  the settings of ``qosfs ctl set`` must be accepted by a policy; every ``make TARGET``
  (also inline, in backquotes) must be a Makefile target; every ``python -m bench ...``
  (also inline) must parse with the bench runner's parser.
- Every ``toml`` block is a policy (the only TOML qosfs reads), so it must load with the
  loader ``qosfs check`` uses; a misspelt table must not make a block look like
  something else and be skipped. A fragment may rely on what the rest of a policy would
  give it (a ``[backend]`` for a guarantee, a ``[cluster]`` for ``scope = "cluster"``,
  the tenants a class names): ``doccheck.complete_fragment`` adds only what is missing.
  ``[classes.default]`` is never needed: the loader adds it. A block preceded by
  ``<!-- doc-check: invalid -->`` shows a mistake and must be *rejected*.
- Every relative link (inline, image or reference-style) must point at a file.
- The references keep up with the code: every key the policy loader accepts is named in
  docs/policy.md, every ``ctl`` subcommand and every metric family the exporter yields in
  docs/control-and-metrics.md (the cluster's in docs/cluster.md), and the contents page
  lists every page of docs/.

The checks live in tests/docs/doccheck.py as functions of a list of documents, so
tests/docs/test_doccheck.py feeds each of them a broken document and sees it fail.
"""

from __future__ import annotations

import argparse
import re

import pytest

from qosfs.daemon.cli import _build_parser
from tests.docs.doccheck import (
    DOCS,
    Block,
    bench_problems,
    blocks,
    link_problems,
    make_problems,
    makefile_targets,
    policy_problem,
    qosfs_problem,
    shell_commands,
    unlabelled_fences,
)
from tests.mounting import ROOT

COMMANDS = [c for c in shell_commands(DOCS) if c[1][0] == "qosfs"]
POLICIES = [b for b in blocks(DOCS) if b.lang == "toml"]


@pytest.mark.parametrize("where,words", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_qosfs_command_shown_parses(where: str, words: list[str]) -> None:
    problem = qosfs_problem(where, words)
    assert problem is None, problem


@pytest.mark.parametrize("block", POLICIES, ids=[b.where() for b in POLICIES])
def test_every_policy_shown_loads_or_is_rejected_as_marked(block: Block) -> None:
    problem = policy_problem(block)
    assert problem is None, problem


def test_there_are_policies_and_commands_to_check() -> None:
    assert len(POLICIES) >= 6
    assert len(COMMANDS) >= 20


def test_every_make_target_shown_exists() -> None:
    assert {"demo", "test", "bench", "install"} <= makefile_targets()
    shown, problems = make_problems(DOCS)
    assert shown >= 5 and not problems, problems


def test_every_bench_command_shown_parses() -> None:
    shown, problems = bench_problems(DOCS)
    assert shown >= 3 and not problems, problems


def test_every_relative_link_points_at_a_file() -> None:
    broken = link_problems(DOCS)
    assert not broken, broken


def test_every_fenced_block_names_its_language() -> None:
    unlabelled = unlabelled_fences(DOCS)
    assert not unlabelled, unlabelled


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, len(lines)
    assert lines[2] == "```sh" and lines[3].startswith("make demo ") \
        and lines[4].startswith("make test ")


def test_the_contents_page_lists_every_document() -> None:
    contents = (ROOT / "docs" / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in contents, f"{doc.name} missing from docs/README.md"


# Keys build.py checks inline rather than through a tuple of qosfs.policy.keys.
_OTHER_POLICY_KEYS = ("backend", "control", "metrics", "cluster", "tenants", "classes",
                      "admin_group", "user_series", "user_series_idle")


def test_every_policy_key_is_in_the_policy_reference() -> None:
    from qosfs.policy import keys as vocabulary

    keys = {*vocabulary.CLASS_KEYS, *vocabulary.TENANT_KEYS, *vocabulary.CLUSTER_KEYS,
            *vocabulary.LIMIT_KEYS, *_OTHER_POLICY_KEYS}
    reference = (ROOT / "docs" / "policy.md").read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in reference and f"[{k}" not in reference)
    assert not missing, f"docs/policy.md does not name {missing}"


def test_every_ctl_command_and_metric_family_is_in_the_reference() -> None:
    reference = (ROOT / "docs" / "control-and-metrics.md").read_text()
    cluster = (ROOT / "docs" / "cluster.md").read_text()
    subcommands = [a for a in _build_parser()._actions
                   if isinstance(a, argparse._SubParsersAction)]
    ctl = subcommands[0].choices["ctl"]
    commands = [name for a in ctl._actions if isinstance(a, argparse._SubParsersAction)
                for name in a.choices]
    assert {"status", "set", "reload", "stats"} <= set(commands)
    missing = [f"ctl {c}" for c in commands if f"ctl {c}" not in reference]
    # Every family the exporter yields is named as a literal there (counters without
    # _total, which prometheus_client adds); the cluster's are documented with the cluster.
    source = (ROOT / "qosfs" / "control" / "metrics.py").read_text()
    families = set(re.findall(r'"(qosfs_[a-z_]+)"', source))
    assert len(families) >= 30
    missing += sorted(f for f in families
                      if f not in (cluster if f.startswith("qosfs_cluster_") else reference))
    assert not missing, f"not in the reference: {missing}"
