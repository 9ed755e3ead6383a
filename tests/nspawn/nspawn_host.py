"""The host side of the nspawn harness: can a machine run here, which host paths a container cannot see, mounts
and cgroups under a path, and the leftovers of a dead run (cleanup_stale).  The machine itself is nspawn.py."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import time

#: Where the overlay upper/work dirs go.  Must be a tmpfs (or any non-overlay
#: file system that supports overlay upper dirs) that is NOT the root mount,
#: so it does not show up inside the lower layer.
DEFAULT_BASE_DIR = "/dev/shm"
DIR_PREFIX = "kimi-nspawn-"

#: Set to 1 to make available() report False (test the skip/fail path).
DISABLE_ENV = "KIMI_NSPAWN_DISABLE"

# Paths that nspawn (or the container's systemd) mounts over, so host content
# at those paths is NOT visible inside the container and must be bound.
_SHADOWED = ("/tmp", "/run", "/dev", "/proc", "/sys")


class NspawnError(RuntimeError):
    """Setting up, booting or tearing down the container failed."""


def needs_bind(path: str) -> bool:
    """True if host ``path`` is not visible through the overlay of ``/``.

    That is the case when it lives on another mount than ``/`` (e.g. a venv on
    a separate disk) or below a directory that the container mounts over
    (``/tmp``, ``/run``, ...).
    """
    real = os.path.realpath(path)
    for shadowed in _SHADOWED:
        if real == shadowed or real.startswith(shadowed + "/"):
            return True
    try:
        return os.stat(real).st_dev != os.stat("/").st_dev
    except FileNotFoundError:
        return False


def _mounts_under(path: str) -> list[str]:
    """Mount points at or below ``path`` in our mount namespace, deepest first."""
    prefix = path.rstrip("/")
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            # Field 5 is the mount point, with octal escapes for odd chars.
            mnt = fields[4].encode().decode("unicode_escape")
            if mnt == prefix or mnt.startswith(prefix + "/"):
                found.append(mnt)
    return sorted(set(found), key=lambda m: m.count("/"), reverse=True)


def _umount_all(path: str) -> list[str]:
    """Unmount everything at/below ``path``; return what could not be unmounted."""
    failed: list[str] = []
    for _attempt in range(3):
        mounts = _mounts_under(path)
        if not mounts:
            return []
        failed = []
        for mnt in mounts:
            r = subprocess.run(["umount", mnt], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                failed.append(mnt)
        if not failed:
            continue
        time.sleep(0.2)
    # Last resort: lazy unmount (detaches now, frees when no longer busy).
    for mnt in _mounts_under(path):
        subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
    return _mounts_under(path)


def _try_overlay(base_dir: str) -> str | None:
    """Mount and unmount a throwaway overlay of ``/``; return an error or None."""
    try:
        tmp = tempfile.mkdtemp(prefix=DIR_PREFIX + "probe-", dir=base_dir)
    except OSError as e:
        return f"cannot create a directory in {base_dir}: {e}"
    merged = os.path.join(tmp, "merged")
    try:
        for sub in ("upper", "work", "merged"):
            os.mkdir(os.path.join(tmp, sub))
        opts = f"lowerdir=/,upperdir={tmp}/upper,workdir={tmp}/work"
        r = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, merged],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            return f"overlay mount of / failed: {r.stderr.strip() or r.returncode}"
        if not os.path.exists(os.path.join(merged, "usr/lib/systemd/systemd")) and not (
            os.path.exists(os.path.join(merged, "lib/systemd/systemd"))
        ):
            return "systemd (/lib/systemd/systemd) not found in the root file system"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"overlay probe failed: {e}"
    finally:
        left = _umount_all(merged)
        if not left:
            shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def _available(base_dir: str) -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root"
    for tool in ("systemd-nspawn", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            hint = " (apt-get install systemd-container)" if tool == "systemd-nspawn" else ""
            return False, f"{tool} not found in PATH{hint}"
    if not os.path.isdir(base_dir):
        return False, f"{base_dir} does not exist"
    err = _try_overlay(base_dir)
    if err is not None:
        return False, err
    return True, "ok"


def available(base_dir: str = DEFAULT_BASE_DIR) -> tuple[bool, str]:
    """Whether NspawnMachine can run here, and if not, why (cached).

    ``KIMI_NSPAWN_DISABLE=1`` forces "unavailable" (to exercise skip/fail)."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return False, f"disabled by {DISABLE_ENV}"
    return _available(base_dir)


def cleanup_stale(base_dir: str = DEFAULT_BASE_DIR) -> list[str]:
    """Unmount and remove leftovers of harness runs whose Python process died
    without tearing down (SIGKILL, OOM).  Only touches ``base_dir/kimi-nspawn-
    <pid>-*`` dirs whose owner <pid> no longer exists and that no running
    systemd-nspawn uses.  Returns the directories removed."""
    removed: list[str] = []
    in_use = ""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            in_use += f.read().decode("utf-8", "replace") + "\n"
    for entry in sorted(os.listdir(base_dir)):
        if not entry.startswith(DIR_PREFIX):
            continue
        owner = entry[len(DIR_PREFIX) :].split("-", 1)[0]
        path = os.path.join(base_dir, entry)
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}") or path in in_use:
            continue
        if not _umount_all(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for mount, own in _cgroup_hierarchies():
        parent = os.path.join(mount, own.lstrip("/"))
        with contextlib.suppress(OSError):
            for entry in os.listdir(parent):
                owner = entry[len(DIR_PREFIX) :].split("-", 1)[0]
                stale = entry.startswith(DIR_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}")
                if stale and _rmdir_tree(os.path.join(parent, entry)):
                    removed.append(os.path.join(parent, entry))
    return removed


def _cgroup_hierarchies() -> list[tuple[str, str]]:
    """(mount point, our cgroup path) for each hierarchy nspawn places containers in: the unified
    one (cgroup2) and the legacy ``name=systemd`` one, whichever this host has."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _source, options = [*post.split(), "", ""][:3]
            mnt = pre.split()[4].encode().decode("unicode_escape")
            if fstype == "cgroup2":
                mounts.setdefault("", mnt)
            elif fstype == "cgroup" and "name=systemd" in options.split(","):
                mounts.setdefault("name=systemd", mnt)
    found: list[tuple[str, str]] = []
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers in mounts:
                found.append((mounts[controllers], path))
    return found


def _pid1_is_systemd() -> bool:
    return _comm(1) == "systemd"


def _rmdir_tree(path: str) -> bool:
    """Remove an empty cgroup and its descendants (deepest first); True when it is gone."""
    for dirpath, _dirs, _files in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not os.path.exists(path)


def _pid_ns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                kids.extend(int(x) for x in f.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""
