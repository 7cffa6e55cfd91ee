"""What commands write where a user says (`--out`): checked before the work starts, written under
a temporary name of this process's own beside the target (so on its file system), and moved into
place at the end only if the target is still what was checked. Nothing there is replaced unless
the command was given --overwrite, and then only the very thing that was checked; an error or an
interrupt removes the temporary and leaves the target as it was. Imports nothing of jmoe's but
its errors, so every package and command may use it."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import pathlib
import secrets
import shutil
from typing import Iterable, Iterator, Mapping

from jmoe.errors import ConfigError, os_error

log = logging.getLogger("jmoe")

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class Output:
  """A target as it was checked: `seen` is what stood there (its identity), None when nothing
  did or only an empty directory."""

  path: pathlib.Path  # absolute, symbolic links resolved
  directory: bool
  seen: tuple | None
  flag: str

  def temporary(self, tag: str) -> pathlib.Path:
    return self.path.with_name(f".{self.path.name}.writing-{tag}")


def unique_tag() -> str:
  """A name part that no other process (on this or another host) picks."""
  return f"{os.getpid()}-{secrets.token_hex(4)}"


def check(path: PathLike, *, directory: bool, overwrite: bool | None = None,
          inputs: Mapping[str, PathLike | Iterable[PathLike]] | None = None,
          flag: str = "--out") -> Output:
  """The output `path` checked before any work (reads only, so every process may call it): a
  directory output may be new or an empty directory, a file output new; anything else needs
  `overwrite` (None: the command has no --overwrite) and the same kind. It must not be, hold or
  lie inside one of the `inputs` ({flag: paths}), and must be writable."""
  if not str(path):
    raise ConfigError(f"{flag} is empty (an unset shell variable?); give the path to write")
  target = pathlib.Path(os.path.realpath(os.path.expanduser(path)))
  if target == target.parent:
    raise ConfigError(f"{flag} {path}: give a new or empty directory, not the file system's root")
  _refuse_inputs(target, path, flag, inputs or {})
  writable(target, directory, flag)
  if not os.path.exists(target):
    return Output(target, directory, None, flag)
  if directory and not any(target.iterdir()):
    return Output(target, directory, None, flag)
  if not overwrite:
    taken = "is not empty" if directory else "exists"
    fix = (", or --overwrite to replace what is there" if overwrite is not None else
           " (nothing was overwritten)")
    free = "an empty or new directory" if directory else f"a new {flag}"
    raise ConfigError(f"{flag} {target} {taken}; give {free}{fix}")
  return Output(target, directory, _identity(target), flag)


def writable(path: PathLike, directory: bool, flag: str = "--out") -> None:
  """A ConfigError unless a `directory` (or a file) can be made or written at `path`: no file
  above it, the nearest existing directory above it writable by this process, and what is at
  `path` (if anything) of that kind."""
  path = pathlib.Path(path)
  if os.path.exists(path) and path.is_dir() != directory:
    other, kind = ("a directory", "file") if path.is_dir() else ("a file", "directory")
    raise ConfigError(f"{flag} {path} is {other}; this command writes a {kind} there: give a "
                      f"new path{' or an empty directory' if directory else ''}")
  for above in path.parents:
    if os.path.exists(above):
      if not above.is_dir():
        raise ConfigError(f"{flag} {path}: {above} is a file, so nothing can be written under "
                          f"it; choose another {flag}")
      if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write in {above} (no permission, or a "
                          f"read-only file system); choose a place you can write, or change its "
                          f"permissions")
      break
  if os.path.isfile(path) and not directory and not os.access(path, os.W_OK):
    raise ConfigError(f"{flag} {path} is not writable; choose another {flag}, or change its "
                      f"permissions")


def _refuse_inputs(target: pathlib.Path, given: PathLike, flag: str,
                   inputs: Mapping[str, PathLike | Iterable[PathLike]]) -> None:
  for name, paths in inputs.items():
    for source in ([paths] if isinstance(paths, (str, os.PathLike)) else paths):
      if not str(source):
        continue
      real = pathlib.Path(os.path.realpath(os.path.expanduser(source)))
      same = real == target or (real.exists() and target.exists() and
                                os.path.samefile(real, target))
      if same or real.is_relative_to(target):
        what = "is" if same else "holds"
        raise ConfigError(f"{flag} {given} {what} the {name} input {source}; writing there would "
                          f"replace it: choose another {flag}")
      if target.is_relative_to(real) and os.path.lexists(target):
        raise ConfigError(f"{flag} {given} is part of the {name} input {source}; choose another "
                          f"{flag}")


def _identity(path: pathlib.Path) -> tuple:
  """What tells one file or directory from another put in its place, or from itself changed."""
  stat = os.stat(path)
  return stat.st_dev, stat.st_ino, stat.st_mtime_ns, 0 if path.is_dir() else stat.st_size


@contextlib.contextmanager
def written(output: Output, tag: str | None = None) -> Iterator[pathlib.Path]:
  """The temporary (an empty directory, or an empty file) to write `output` into; published
  when the block ends without an error. On an error or an interrupt it is removed, the target
  is untouched, and an OSError becomes a message naming the path and what to do."""
  tmp = output.temporary(tag or unique_tag())
  made = _missing_parents(tmp)
  try:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if output.directory:
      tmp.mkdir()
    else:
      os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
  except OSError as e:
    _remove([], made)
    raise _failed(output, e) from None
  try:
    yield tmp
  except BaseException as e:
    _remove([tmp], made)
    failure = os_error(e)  # (a full disk under Orbax's writes too)
    if failure is not None:
      raise _failed(output, failure) from None
    raise
  publish(output, tmp)


def publish(output: Output, tmp: pathlib.Path) -> None:
  """Moves `tmp` to `output.path` if the target is still what was checked; otherwise leaves
  both where they are and says so. Interrupted, it puts back what it had moved aside."""
  path, aside = output.path, None
  if output.seen is not None:  # replace what was checked, and only that
    if not os.path.exists(path) or _identity(path) != output.seen:
      raise _changed(output, tmp)
    aside = tmp.with_name(tmp.name.replace(".writing-", ".replaced-", 1))
    try:
      os.rename(path, aside)
    except OSError as e:
      _remove([tmp])
      raise _failed(output, e) from None
  try:
    if aside is not None and _identity(aside) != output.seen:  # changed since the look
      raise FileExistsError(errno.EEXIST, "changed", str(path))
    if output.directory:
      os.rename(tmp, path)  # replaces nothing but an empty directory
    else:
      _rename_no_replace(tmp, path)
  except BaseException as e:
    if aside is not None:
      _put_back(aside, path)
    if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR,
                                              errno.EISDIR):
      raise _changed(output, tmp) from None
    _remove([tmp])
    if isinstance(e, OSError):
      raise _failed(output, e) from None
    raise
  if aside is not None:
    _remove([aside])


def _rename_no_replace(tmp: pathlib.Path, path: pathlib.Path) -> None:
  """Renames a file to `path` unless something is there (then FileExistsError), at once."""
  try:
    os.link(tmp, path)  # fails if `path` exists, whatever comes and goes around it
  except OSError as e:
    if e.errno == errno.EEXIST:
      raise
    if os.path.lexists(path):  # a file system without hard links: look, then rename
      raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
    os.rename(tmp, path)
    return
  os.unlink(tmp)


def _put_back(aside: pathlib.Path, path: pathlib.Path) -> None:
  try:
    os.rename(aside, path) if aside.is_dir() else _rename_no_replace(aside, path)
  except OSError:
    log.warning("what stood at %s was moved to %s, and %s is taken again: move it back by "
                "hand", path, aside, path)


def _changed(output: Output, tmp: pathlib.Path) -> ConfigError:
  return ConfigError(f"{output.flag} {output.path} changed while this command ran (something "
                     f"else wrote there) and is left as it is; this command's output is in "
                     f"{tmp}: move it where you want it")


def _failed(output: Output, e: OSError) -> ConfigError:
  where = f"{e.filename}: " if e.filename else ""  # (else the output's path, named below)
  if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
    fix = "choose a place you can write, or change its permissions"
  elif e.errno in (errno.ENOSPC, errno.EDQUOT):
    fix = "free some space there, or choose another place"
  else:
    fix = f"fix that, or choose another {output.flag}"
  return ConfigError(f"{where}{e.strerror or e} while writing {output.flag} {output.path}, "
                     f"which is left as it was; {fix}")


def _missing_parents(path: pathlib.Path) -> list[pathlib.Path]:
  """The directories above `path` that do not exist yet, the deepest first."""
  missing = []
  for above in path.parents:
    if os.path.lexists(above):
      break
    missing.append(above)
  return missing


def _remove(paths: list[pathlib.Path], parents: list[pathlib.Path] = ()) -> None:
  """Removes what this module made, quietly: `paths` (a temporary, or what it replaced) whole,
  then the directories made for them, deepest first, those still empty (another run may be
  writing beside)."""
  for path in paths:
    if path.is_dir() and not path.is_symlink():
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(OSError):
        path.unlink()
  for parent in parents:
    with contextlib.suppress(OSError):
      parent.rmdir()
