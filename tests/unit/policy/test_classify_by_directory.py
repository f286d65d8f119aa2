"""Classification kept per directory (``Classifier.resolve``): where the policy provably
gives every entry of a directory one class and tenant, the first entry's answer serves the
rest. Whatever entry of the directory came first, the answer must be the one the path
itself gets (``Classifier.decide``, never memoized)."""

from __future__ import annotations

import itertools

import pytest

from qosfs.policy import classify
from qosfs.policy.classify import CallerKey, Classifier
from qosfs.policy.globs import compile_glob
from qosfs.policy.loading import default_policy, parse_policy
from qosfs.policy.model import Policy

POLICIES = {
    "default": default_policy,
    "names-and-dirs": lambda: parse_policy("""
[tenants.team-a]
uids = ["1000-1999"]
[classes.weights]
paths = ["**/*.pt", "**/.metadata"]
ops = ["write"]
[classes.alice]
paths = ["data/**"]
uids = [7]
[classes.stage]
paths = ["x/*/y/**", "**/checkpoints/**"]
[classes.team-a]
tenants = ["team-a"]
paths = ["runs/**"]
[classes.data]
paths = ["data/**", "**/*.jpg"]
ops = ["read", "meta"]
[classes.bracket]
paths = ["d[1]/**"]
"""),
    # A tenant defined by paths: nothing is kept per directory (its paths are not proved).
    "tenant-paths": lambda: parse_policy("""
[tenants.shared]
paths = ["shared/**"]
[classes.shared]
tenants = ["shared"]
[classes.data]
paths = ["data/**"]
"""),
}

DIRECTORIES = ["", "data", "data/train", "x/checkpoints", "x/checkpoints/s1", "runs/a",
               "x/a/y", "x/a/y/z", "shared", "d1", "d[1]", "d*", "home/u"]
NAMES = ["a.jpg", "b.pt", "c.pt.tmp", ".metadata", "checkpoints", "plain"]
CALLERS = [CallerKey(op, uid, 1, 0) for op in ("read", "write", "meta") for uid in (1, 7, 1500)]


def _paths(directory: str, names: list[str]) -> list[str]:
    return [f"{directory}/{n}" if directory else n for n in names]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("order", [NAMES, NAMES[::-1]], ids=["forward", "backward"])
def test_every_entry_gets_what_its_own_path_gets(name: str, order: list[str]) -> None:
    policy: Policy = POLICIES[name]()
    memoized, reference = Classifier(policy), Classifier(policy)
    for directory, caller in itertools.product(DIRECTORIES, CALLERS):
        for path in _paths(directory, order):
            decision = reference.decide(path, caller)
            got = memoized.resolve(path, caller)
            assert got == (decision.rule, decision.tenant), (path, caller)


def test_a_directory_a_class_holds_whole_is_decided_once() -> None:
    c = Classifier(default_policy())
    reader = CallerKey("read", 1000, 1000, 0)
    assert c.resolve("data/train/0001.jpg", reader)[0].name == "datasets"

    def by_path(*_: object) -> None:
        raise AssertionError("classified by path")

    c._classify = by_path  # type: ignore[method-assign, assignment]
    assert c.resolve("data/train/0002.jpg", reader)[0].name == "datasets"
    assert c.resolve("data/train/model.pt", reader)[0].name == "datasets"
    # A write under data/ could be a checkpoint (**/*.pt): that one goes by its path.
    with pytest.raises(AssertionError, match="classified by path"):
        c.resolve("data/train/0003.jpg", CallerKey("write", 1000, 1000, 0))


def test_a_directory_named_like_a_glob_goes_by_the_path() -> None:
    """``d[1]/**`` matches ``d1``'s entries, not those of a directory named ``d[1]``; read
    as a glob, the name would have looked covered."""
    c = Classifier(parse_policy('[classes.bracket]\npaths = ["d[1]/**"]\n'))
    caller = CallerKey("read", 1, 1, 0)
    assert c.resolve("d1/x", caller)[0].name == "bracket"
    assert c.resolve("d[1]/x", caller)[0].name == "default"
    assert c.resolve("d[1]/y", caller)[0].name == "default"


def test_the_directories_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(classify, "_DIRECTORIES_KEPT", 8)
    c = Classifier(default_policy())
    caller = CallerKey("read", 1, 1, 0)
    for i in range(50):
        assert c.resolve(f"data/d{i}/f", caller)[0].name == "datasets"
        assert c._entries_of is not None and len(c._entries_of) <= 8


TIMEOUTS = {
    "default": default_policy,
    "mixed": lambda: parse_policy("""
[classes.fast]
paths = ["data/**", "**/*.idx"]
entry_timeout = "60s"
[classes.slow]
paths = ["x/*/y/**"]
attr_timeout = "5s"
entry_timeout = "2s"
[classes.bracket]
paths = ["d[1]/**"]
attr_timeout = "7s"
"""),
}


@pytest.mark.parametrize("name", sorted(TIMEOUTS))
def test_cache_timeouts_by_directory_are_those_of_the_path(name: str) -> None:
    policy = TIMEOUTS[name]()
    for order in ([*NAMES, "i.idx"], ["i.idx", *NAMES]):
        timeouts = Classifier(policy).cache_timeouts
        assert timeouts is not None
        for directory in DIRECTORIES:
            for path in _paths(directory, order):
                assert timeouts(path) == _timeouts_of(policy, path), path


def _timeouts_of(policy: Policy, path: str) -> tuple[float | None, float | None]:
    """The first class in policy order that holds *path* and sets each timeout."""
    entry: float | None = None
    attr: float | None = None
    for rule in policy.classes:
        if rule.paths and not any(compile_glob(g).fullmatch(path) for g in rule.paths):
            continue
        entry = rule.entry_timeout if entry is None else entry
        attr = rule.attr_timeout if attr is None else attr
    return entry, attr
