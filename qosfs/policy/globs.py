"""Path globs: compiling them (for matching) and comparing them (for proofs).

Globs are path-aware, unlike :mod:`fnmatch` whose ``*`` crosses ``/``:

- ``**`` as a whole component matches any number of components, including zero, so
  ``data/**`` matches ``data`` itself and everything below it;
- ``*`` and ``?`` match within one component; ``[a-z]``, ``[!0-9]``/``[^0-9]`` are classes;
- everything else, backslash included, is literal.

:func:`glob_covers` proves that one glob matches everything another does, component by
component: ``qosfs check`` finds shadowed classes with it
(:mod:`qosfs.policy.lint`), and classification finds the directories whose every entry a
class holds whatever its name (:mod:`qosfs.policy.classify`).

Example:
    >>> compile_glob("**/*.pt").fullmatch("a/b/x.pt") is not None
    True
"""

from __future__ import annotations

import json
import re

__all__ = ["GlobError", "compile_cgroup_glob", "compile_glob", "compile_value_glob",
           "glob_covers", "holds_every_entry", "value_glob_covers"]

_META = re.compile(r"[*?\[]")


class GlobError(ValueError):
    """A glob pattern that could never match what it looks like it should."""


def _q(text: str) -> str:
    """Quote for a one-line message (a newline in a pattern must not break the line)."""
    return json.dumps(text, ensure_ascii=False)


def _translate_component(text: str, pattern: str, *, slash_ok: bool) -> str:
    """Regex source for one glob component (or a whole value when ``slash_ok``)."""
    any_char = "." if slash_ok else "[^/]"
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        i += 1
        if ch == "*":
            out.append(any_char + "*")
        elif ch == "?":
            out.append(any_char)
        elif ch == "[":
            negate = i < n and text[i] in "!^"
            j = i + 1 if negate else i
            end = text.find("]", j + 1) if j < n and text[j] == "]" else text.find("]", j)
            if end < 0:
                raise GlobError(f'invalid glob {_q(pattern)}: unbalanced "["')
            items = _class_items(text[j:end], pattern)
            if negate:
                out.append(f"[^{items}]" if slash_ok else f"[^/{items}]")
            else:
                out.append(f"[{items}]" if slash_ok else f"(?!/)[{items}]")
            i = end + 1
        else:
            out.append(re.escape(ch))
    return "".join(out)


def _class_items(body: str, pattern: str) -> str:
    """Escape every member of a ``[...]`` body, keeping ``a-z`` ranges (no regex set quirks)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":
            lo, hi = body[i], body[i + 2]
            if lo > hi:
                backwards = _q(f"{lo}-{hi}")
                raise GlobError(f"invalid glob {_q(pattern)}: range {backwards} is backwards")
            out.append(f"{re.escape(lo)}-{re.escape(hi)}")
            i += 3
        else:
            out.append(re.escape(body[i]))
            i += 1
    return "".join(out)


def compile_glob(pattern: str) -> re.Pattern[str]:
    """Compile a path glob relative to the mount root; use ``fullmatch`` on relative paths.

    Raises:
        GlobError: empty, absolute, ``.``/``..`` or empty components, ``**`` inside a
            component, or an unbalanced ``[``.
    """
    if pattern.startswith("/"):
        raise GlobError(f'invalid glob {_q(pattern)}: must be relative to the mount root '
                        '(no leading "/")')
    return _compile_path(pattern, pattern)


def compile_cgroup_glob(pattern: str) -> re.Pattern[str]:
    """Compile an absolute cgroup glob (``"/slurm/job_*/**"``); match it against the cgroup
    path without its leading ``/``."""
    if not pattern.startswith("/"):
        raise GlobError(f'invalid glob {_q(pattern)}: cgroup paths are absolute '
                        '(start with "/")')
    return _compile_path(pattern[1:], pattern)


def _compile_path(body: str, pattern: str) -> re.Pattern[str]:
    if not body:
        raise GlobError(f'invalid glob {_q(pattern)}: empty pattern')
    source: list[str] = []
    need_sep = False  # a literal component was emitted: the next one needs a "/"
    parts = body.split("/")
    for index, part in enumerate(parts):
        if part in ("", ".", ".."):
            raise GlobError(f'invalid glob {_q(pattern)}: "{part}" component never matches '
                            '(paths are normalized)' if part else
                            f'invalid glob {_q(pattern)}: empty path component')
        if part == "**":
            if index > 0 and parts[index - 1] == "**":
                continue
            if all(p == "**" for p in parts[index:]):
                source.append("(?:/.*)?" if need_sep else ".*")
            else:
                source.append("(?:/.*)?/" if need_sep else "(?:.*/)?")
            need_sep = False
            continue
        if "**" in part:
            raise GlobError(f'invalid glob {_q(pattern)}: "**" must be a whole path component, '
                            'like "data/**" or "**/*.pt"')
        if need_sep:
            source.append("/")
        source.append(_translate_component(part, pattern, slash_ok=False))
        need_sep = True
    return re.compile("".join(source), re.DOTALL)


def compile_value_glob(pattern: str) -> re.Pattern[str]:
    """Compile a glob over a plain value (a job id): ``*`` matches anything, ``/`` included."""
    if not pattern:
        raise GlobError("invalid glob \"\": empty pattern")
    return re.compile(_translate_component(pattern, pattern, slash_ok=True), re.DOTALL)


def glob_covers(outer: str, inner: str, *, absolute: bool = False) -> bool:
    """Whether the path glob *outer* provably matches every path *inner* matches
    (cgroup globs: ``absolute``, both start with ``/``).

    Example:
        >>> glob_covers("**/*.pt", "runs/*/model.pt"), glob_covers("*.pt", "a/b.pt")
        (True, False)
    """
    a, b = _parts(outer, absolute), _parts(inner, absolute)
    memo: dict[tuple[int, int], bool] = {}

    def covers(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(a):
                memo[i, j] = j == len(b)
            elif a[i] == "**":  # any run of inner's components, "**" among them
                memo[i, j] = any(covers(i + 1, k) for k in range(j, len(b) + 1))
            else:
                memo[i, j] = (j < len(b) and b[j] != "**" and _component_covers(a[i], b[j])
                              and covers(i + 1, j + 1))
        return memo[i, j]

    return covers(0, 0)


def _parts(glob: str, absolute: bool) -> list[str]:
    parts = (glob[1:] if absolute else glob).split("/")
    return [p for i, p in enumerate(parts) if not (p == "**" and i and parts[i - 1] == "**")]


def _component_covers(p: str, q: str) -> bool:
    if p == q or p == "*":
        return True
    return not _META.search(q) and compile_glob(p).fullmatch(q) is not None


def value_glob_covers(p: str, q: str) -> bool:
    if p == q or p == "*":
        return True
    return not _META.search(q) and compile_value_glob(p).fullmatch(q) is not None


def holds_every_entry(globs: tuple[str, ...], directory: str) -> bool:
    """Whether one of *globs* provably matches every entry of *directory* (relative to the
    mount root, ``""`` the root), whatever the entry's name: ``data/**`` holds every entry
    of ``data/train``, ``**/*.pt`` does not. False, too, where it cannot be shown: a name
    of *directory* that holds a glob character (``[``, ``*``, ``?``) would be read as a
    glob, not as the literal name it is."""
    if _META.search(directory):
        return False
    entries = f"{directory}/*" if directory else "*"
    return any(glob_covers(glob, entries) for glob in globs)
