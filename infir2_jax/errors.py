"""User errors: what a command line prints as one `error:` line, not as a traceback.

A UserError is a mistake in what the user gave (a config key or value, a file, the data, a
run directory) whose message says what to change; anything else is a bug and keeps its
traceback. The command-line entry points run under `cli_errors()`: a UserError exits with
status 1 and one `error: ...` line on stderr, unless --debug or INFIR2_DEBUG=1 asks for the
traceback. Each type also derives from the builtin one it replaces (ValueError,
FileNotFoundError), so code that caught those still does.
"""

import contextlib
import json
import os
import sys

DEBUG_ENV = "INFIR2_DEBUG"   # INFIR2_DEBUG=1: user errors keep their traceback too


class UserError(Exception):
  """A mistake in the user's input; its message names it and says what to change."""


class ConfigError(UserError, ValueError):
  """A config key, value, config file or variant, or a command-line flag that cannot work."""


class DataError(UserError, ValueError):
  """Input data that cannot be trained on (no documents, no validation split, bad records)."""


class NotFound(UserError, FileNotFoundError):
  """A file, directory or run that was named and does not exist."""


class DamagedFile(UserError, ValueError):
  """A file the program reads that is truncated, empty or not in its format."""


def damaged_file(path: str, problem: str, fix: str) -> DamagedFile:
  """The one-line error for a damaged file: its path, what is wrong with it, what to do."""
  return DamagedFile(f"{path} is damaged ({problem}): {fix}")


def read_json_file(path: str, fix: str):
  """The JSON value in `path`; a truncated or invalid file is a DamagedFile naming it.

  json's own error ("Expecting value: line 1 column 1") names no file, and the files read
  this way (a run's config.json, prepared.json, an HF config.json) are ones a killed copy or
  a full disk can cut short.
  """
  try:
    with open(path, "rb") as f:
      data = f.read()
    return json.loads(data.decode("utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    what = "empty" if not data.strip() else f"not valid JSON: {e}"
    raise damaged_file(path, f"{len(data)} bytes, {what}", fix) from None


def debug_requested(argv=None) -> bool:
  """--debug on the command line or INFIR2_DEBUG set to anything but "" / "0"."""
  argv = sys.argv if argv is None else argv
  return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def strip_debug_flag(argv: list[str]) -> list[str]:
  """argv without --debug (for parsers that do not define it)."""
  return [a for a in argv if a != "--debug"]


@contextlib.contextmanager
def cli_errors(debug: bool | None = None):
  """Turns a UserError into `error: MESSAGE` on stderr and exit status 1 (else re-raises)."""
  try:
    yield
  except UserError as e:
    if debug_requested() if debug is None else debug:
      raise
    sys.stderr.flush()
    raise SystemExit(f"error: {e}") from None
