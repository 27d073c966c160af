"""argparse types for paths: files and directories checked when the flag is parsed, before any work.

A path that cannot be written (a missing or unwritable directory) or read (a
missing file, a directory where a file belongs) ends the command at parse time
with one line naming the flag and exit status 2 -- not a traceback after the
whole run. Torch-free, like every parser module (:mod:`cpattn.config.cli_args`
re-exports these names).
"""

from __future__ import annotations

import argparse
import os


def _shown(path: str) -> str:
    return repr(os.path.normpath(path))


def output_file(text: str) -> str:
    """argparse type: a file to write: not a directory, in an existing directory this user may write to.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> output_file(d + "/out.json") == d + "/out.json"
    True
    >>> output_file(d + "/missing/out.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: saw '.../missing/out.json'; rule: its directory '.../missing' does not exist; fix: create it (mkdir -p) or write elsewhere
    """
    parent = os.path.dirname(text) or "."
    if not text or text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a file path, not a directory; fix: name a file, "
                                         f"e.g. {os.path.join(text or '.', 'out.json')!r}")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: its directory {_shown(parent)} {what}; "
                                         "fix: create it (mkdir -p) or write elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a path this user may write; fix: write elsewhere")
    return text


def output_file_made(text: str) -> str:
    """argparse type: a file to write whose missing directories the command makes: not a directory, and
    :func:`output_dir` holds for its directory.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> output_file_made(d + "/new/cpu.json") == d + "/new/cpu.json"
    True
    """
    if not text or text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a file path, not a directory; fix: name a file, "
                                         f"e.g. {os.path.join(text or '.', 'out.json')!r}")
    output_dir(os.path.dirname(text) or ".")
    return text


def output_dir(text: str) -> str:
    """argparse type: a directory to write into (made if missing): not a file, below a writable directory.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> output_dir(d + "/new/run") == d + "/new/run"
    True
    """
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a directory, and this is a file; fix: remove it or "
                                         "pick another directory")
    up = os.path.abspath(text)
    while not os.path.exists(up):  # the nearest existing ancestor must be a writable directory
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: every parent is a directory, and {_shown(up)} is a "
                                         "file; fix: pick another directory")
    if not os.access(up, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a directory this user may write ({_shown(up)} is "
                                         "not writable); fix: write elsewhere")
    return text


def input_file(text: str) -> str:
    """argparse type: an existing, readable regular file.

    >>> input_file("/nonexistent/p.json")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: saw '/nonexistent/p.json'; rule: an existing file, and there is none; fix: check the path
    """
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: an existing file, and there is none; fix: check the path")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a file, and this is a directory or a device; "
                                         "fix: name the file itself")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a file this user may read; fix: check its permissions")
    return text


def input_dir(text: str) -> str:
    """argparse type: an existing directory.

    >>> input_dir(".")
    '.'
    """
    if not os.path.isdir(text):
        what = "a file" if os.path.exists(text) else "missing"
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: an existing directory, and this is {what}; "
                                         "fix: check the path")
    return text


def json_output(text: str) -> str:
    """argparse type of ``--json``: ``-`` (stdout) or an :func:`output_file`.

    >>> json_output("-")
    '-'
    """
    return text if text == "-" else output_file(text)
