"""What shell completion offers for the arguments that name files and directories.

``make install`` generates the bash and zsh completions from the argument parser with
shtab (the ``cli-docs`` extra). shtab completes an argument from the parser alone, except
for what it cannot know: that ``qosfs check FILE`` wants a file or ``qosfs mount SOURCE``
a directory. Without a hint those complete nothing, which is worse than no completion
script at all (bash would then offer file names). The hint is an attribute shtab reads,
``complete``, in the form its documentation gives, so shtab itself is never imported:
it is an install-time tool, not a dependency.

Arguments are recognised by their destination or metavar, so a new ``--something FILE``
completes files without an edit here.
"""

from __future__ import annotations

import argparse

FILES = {"bash": "_shtab_compgen_files", "zsh": "_files"}
DIRECTORIES = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/"}
DIRECTORY_ARGS = ("source", "mountpoint")
FILE_ARGS = ("file", "log_file", "policy_out")
FILE_METAVARS = ("FILE", "PATH")


def mark_paths(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Mark the arguments of ``parser`` and its subcommands' that name paths; returns it."""
    # argparse lists a parser's actions nowhere public; shtab reads the same attribute.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                mark_paths(sub)
        elif action.dest in DIRECTORY_ARGS:
            action.complete = DIRECTORIES  # type: ignore[attr-defined]
        elif action.dest in FILE_ARGS or action.metavar in FILE_METAVARS:
            action.complete = FILES  # type: ignore[attr-defined]
    return parser
