"""The run record: one folder per run, owned by the run, a journal that `--resume` replays, and
the result files.

Layout of a run folder:
  journal.jsonl            one JSON object per event (run start, launch, decision, result)
  launch-<n>/command.json  the exact argv and environment (secrets redacted)
  launch-<n>/server.log    everything the server printed (one fresh log per attempt: an
                           interrupted attempt's folder is moved to launch-<n>.interrupted-<k>)
  launch-<n>/server.pid    the server's pid, process group and tree mark while it runs
  launch-<n>/watchdog.log  the pids the launch's watchdog killed (pretuner died, or they had
                           left the server's group)
  launch-<n>/scan.json     what the log scanner found
  report.md, report.json   the result, or why the run failed (a PretunerError)
  tuned.env, serve.sh      the tuned configuration (finished runs only)
  .lock                    flock'ed by the pretuner process running the run (its pid inside)

- `.lock` is held (`flock`, exclusive) for the whole run, taken before the folder is checked
  empty, so two runs with one `--out` or two `--resume` of one run cannot both pass; the
  holder's pid is written into it for the message of the one refused.
- `launch-<n>/server.pid` (written by `ServerProcess`) names a server that outlived a killed
  pretuner. `--resume` stops its own orphans (it holds the lock: nobody else owns them); a new
  run refuses while a run folder beside it holds a live one whose run is not running.
- Free space of the run folder is checked before each launch, and a full disk during the run
  is one error line, not a hang.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import re
import shlex
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pretuner.errors import BadInputError, CardBusyError
from pretuner.files import write_atomic
from pretuner.procgroups import (
    ServerPid,
    kill_tree,
    live_servers,
    still_running,
    stop_group,
)
from pretuner.redact import redact_options, redact_text, restore_command_text

log = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"
LOCK_FILE = ".lock"
MIN_FREE_MIB = 64  # a server log and the result files; below this a launch is refused
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: past `ulimit -f`, full to us


class FolderInUseError(BadInputError):
    """Another pretuner process holds the run folder's lock."""


class DiskFullError(BadInputError):
    """The run folder's filesystem is full (or too full to start a launch)."""


@dataclass
class RunLock:
    """An exclusive `flock` on `<run>/.lock`, released when this process ends or on `release`."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _holder(lock_path: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(lock_path.read_text("ascii").strip())
        return f"pretuner pid {pid}"
    return "another pretuner process"


def lock_folder(folder: Path) -> RunLock:
    """Take the folder's lock without waiting; FolderInUseError names the holder."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise BadInputError(
            f"cannot lock the run folder {str(folder)!r}: {err.strerror}",
            hint="choose a writable folder",
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderInUseError(
            f"run folder {str(folder)!r} is in use by {_holder(path)}",
            hint="wait for that run to end or stop it (Ctrl-C); one folder holds one run",
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return RunLock(path, fd)


def claim_new_folder(out: Path) -> RunLock:
    """Create `out` (or take an empty one) and lock it, atomically against a second run."""
    if out.exists() and not out.is_dir():
        raise BadInputError(
            f"--out {str(out)!r} exists and is not a folder", hint="choose a new folder"
        )
    _mkdir(out, f"--out {str(out)!r}", "choose a writable folder", parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise BadInputError(f"--out {str(out)!r} is not writable", hint="choose another folder")
    if _holds_files(out):  # checked before the lock too: no stray .lock in a user's folder
        _refuse_used(out)
    lock = lock_folder(out)
    if _holds_files(out):  # a second run got here first and wrote its journal
        lock.release()
        _refuse_used(out)
    return lock


def _mkdir(folder: Path, what: str, hint: str, **how: bool) -> None:
    """`folder.mkdir(**how)`, refused as bad input (exit 2) naming `what`; a folder that exists
    (without exist_ok) still raises FileExistsError."""
    try:
        folder.mkdir(**how)
    except OSError as err:
        if isinstance(err, FileExistsError) and not how.get("exist_ok"):
            raise
        raise BadInputError(f"cannot create {what}: {err.strerror}", hint=hint) from None


def _holds_files(folder: Path) -> bool:
    return any(p.name != LOCK_FILE for p in folder.iterdir())


def _refuse_used(out: Path) -> None:
    if (out / LOCK_FILE).exists():
        lock_folder(out).release()  # FolderInUseError names a live holder
        servers = live_servers(out)
        if servers:
            raise orphan_error(servers[0], out)
    raise BadInputError(
        f"--out {str(out)!r} exists and is not empty; pretuner never overwrites a run",
        hint="choose a new folder",
    )


def orphan_error(server: ServerPid, run_folder: Path) -> CardBusyError:
    resume = shlex.join(["pretuner", "run", "--resume", str(run_folder)])
    return CardBusyError(
        f"{server.describe()} of run {str(run_folder)!r} is still running (its pretuner was "
        "killed); it holds the card and its port",
        hint=f"`{resume}` stops it and continues, or stop it: kill -TERM -- -{server.pgid}",
    )


def check_no_orphans(runs_parent: Path, own: Path | None = None) -> None:
    """Refuse to start while a run folder in `runs_parent` holds a live server whose run is
    not running (nobody holds its lock): an orphan on the card. Folders not readable, or
    whose run is live (another pretuner, possibly on another card), are left alone."""
    try:
        folders = [p for p in Path(runs_parent).iterdir() if p.is_dir() and p != own]
    except OSError:
        return
    for folder in folders:
        if not (folder / LOCK_FILE).exists():
            continue
        servers = live_servers(folder)
        if not servers:
            continue
        try:
            lock = lock_folder(folder)
        except BadInputError:
            continue  # a live run owns it
        lock.release()
        raise orphan_error(servers[0], folder)


def stop_own_orphans(run_folder: Path, grace_s: float, say: Callable[[str], None]) -> None:
    """Stop servers left running by an earlier, killed session of this run (on --resume,
    with the folder's lock held: nobody else can own them)."""
    for server in live_servers(run_folder):
        say(f"{server.describe()} was left running by the interrupted session; stopping it")
        graceful = stop_group(server.pgid, grace_s)
        kill_tree(server.tree, {server.pgid})  # what left the group (a watchdog killed too)
        if still_running(server):
            raise CardBusyError(
                f"{server.describe()} survives SIGKILL",
                hint=f"stop it by hand: kill -KILL -- -{server.pgid}",
            )
        say(f"stopped the old server group {server.pgid} ({'SIGTERM' if graceful else 'SIGKILL'})")
        Path(server.path).unlink(missing_ok=True)


def check_free_space(folder: Path, min_mib: int = MIN_FREE_MIB) -> None:
    """Refuse a launch when the run folder's filesystem has less than `min_mib` free."""
    try:
        free_mib = shutil.disk_usage(folder).free // (1 << 20)
    except OSError:
        return  # cannot tell; a write failure is still caught
    if free_mib < min_mib:
        raise DiskFullError(
            f"only {free_mib} MiB free on the filesystem of the run folder {str(folder)!r} "
            f"(a launch needs {min_mib} MiB for its server log and results)",
            hint="free disk space, then `pretuner run --resume` this run",
        )


def folder_error(err: OSError, folder: Path) -> OSError | DiskFullError:
    """A write's failure as the user meets it: a full disk (or `ulimit -f`) and a run folder
    removed under the run are one line each; anything else stays `err`."""
    where = f" ({err.filename})" if err.filename else ""
    if err.errno in _FULL:
        return DiskFullError(
            f"cannot write to the run folder {str(folder)!r}: {os.strerror(err.errno or 0)}"
            f"{where}", hint="free disk space (or raise `ulimit -f`), then `pretuner run "
            "--resume` this run")
    if not folder.is_dir():
        return DiskFullError(f"the run folder {str(folder)!r} was removed during the run{where}",
                             hint="start a new run; leave its folder in place until it ends")
    return err


@dataclass
class RunRecord:
    """A run folder, created exclusively so that no earlier run is ever overwritten."""

    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: RunLock | None = field(default=None, repr=False)  # held for the whole run

    @classmethod
    def create(cls, base: Path, model: str, card_gib: int | None) -> RunRecord:
        base = Path(base)
        _mkdir(base, f"the run folder {str(base)!r}", "choose a writable --out", parents=True,
               exist_ok=True)
        if not os.access(base, os.W_OK | os.X_OK):
            raise BadInputError(
                f"run folder {str(base)!r} is not writable", hint="choose a writable --out"
            )
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        card = f"{card_gib}g" if card_gib else "auto"
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-").lower() or "model"
        name = f"{slug}-{card}-{stamp}"
        for n in range(1000):
            candidate = base / (name if n == 0 else f"{name}-{n}")
            try:
                _mkdir(candidate, repr(str(candidate)), "choose a writable --out")
            except FileExistsError:
                continue
            return cls(path=candidate, lock=lock_folder(candidate))
        raise BadInputError(f"too many runs named {name!r} in {str(base)!r}")

    @classmethod
    def open(cls, path: Path) -> RunRecord:
        """An existing run folder, with its journal read back (for --resume)."""
        journal = Path(path) / JOURNAL
        if not journal.is_file():
            raise BadInputError(
                f"{str(path)!r} is not a pretuner run folder (no {JOURNAL})",
                hint="pass the folder `pretuner run` printed",
            )
        events = read_journal(journal)
        for started in (e for e in events if e.get("event") == "run_started"):
            options = started.get("options")
            if isinstance(options, dict):
                # The journal keeps no secret: each comes back from its variable (as serve.sh's).
                restore = functools.partial(restore_command_text, environ=os.environ,
                                            run=Path(path).name)
                if isinstance(options.get("serve_cmd"), str):
                    options["serve_cmd"] = restore(options["serve_cmd"])
                if isinstance(args := options.get("server_args"), list):
                    options["server_args"] = [restore(a) if isinstance(a, str) else a
                                              for a in args]
        return cls(path=Path(path), events=events)

    def append(self, event: str, **data: Any) -> dict[str, Any]:
        """Append one event to the journal and fsync it: it survives a crash right after."""
        if "options" in data:  # run_started: `--serve-cmd ... --api-key K` is kept redacted
            data["options"] = redact_options(data["options"])
        entry = {"event": event, "time": time.time(), **data}
        try:
            with open(self.path / JOURNAL, "a", encoding="utf-8") as fh:
                fh.write(redact_text(json.dumps(entry, sort_keys=True)) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as err:
            raise folder_error(err, self.path) from None
        self.events.append(entry)
        return entry

    def of_kind(self, event: str) -> Iterator[dict[str, Any]]:
        return (e for e in self.events if e["event"] == event)

    def launch_dir(self, n: int) -> Path:
        """A fresh folder for launch `n`, after checking the disk has room for it."""
        check_free_space(self.path)
        folder = self.path / f"launch-{n}"
        if folder.exists():
            # Moved aside, not reused: a server orphaned by a killed pretuner may still write its
            # pool dump to its old log, which the scan must not read as a rank of this attempt.
            k = 1
            while (aside := self.path / f"launch-{n}.interrupted-{k}").exists():
                k += 1
            folder.rename(aside)
        folder.mkdir()
        return folder

    def write(self, name: str, text: str, *, executable: bool = False) -> Path:
        return write_atomic(self.path / name, text, executable=executable, overwrite=True)

    def write_json(self, name: str, data: Any) -> Path:
        return self.write(name, json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_journal(journal: Path) -> list[dict[str, Any]]:
    """The journal's events; a line cut by a crash is skipped, anything else wrong is refused."""
    try:
        text = journal.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        raise BadInputError(
            f"cannot read {str(journal)!r}: {err.strerror}", hint="check the run folder"
        ) from None
    events: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            # A line cut by a crash (SIGKILL mid-write); the lines after it were appended by
            # a resume and stand.
            log.warning("%s:%d is not JSON: skipped", journal, n)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("event"), str):
            raise BadInputError(
                f"{str(journal)!r} line {n} is not a journal event (a JSON object with an "
                f"'event'): {line[:80]!r}",
                hint="the journal is damaged or not pretuner's: start a new run",
            )
        events.append(entry)
    return events
