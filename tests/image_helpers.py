"""Shared by the image smoke tests (marker `images`): run commands inside the images that
scripts/build-images.sh built, with buildah (root, vfs storage, chroot isolation), as the
image's own user. Skipped with one reason where that cannot run.

buildah's chroot isolation has no read-only root filesystem; the tests instead check that
the image's user can write nothing on the root filesystem but the folders the pods mount
writable (`writable_paths`), which is what a read-only root needs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("CEPHALO_IMAGE_CACHE", Path.home() / ".cache" / "cephalo-images"))
SKIP_REASON = ("image smoke tests need root, buildah and the images of "
               "scripts/build-images.sh (run it as root, then pytest -m images)")


def image_name(target: str) -> str:
    """The image scripts/build-images.sh built last for `target`, or skip. Only when asked
    (CEPHALO_IMAGE_TESTS=1, which .ci/run sets right after building this checkout's images):
    the last image built may be another commit's, and its smoke tests take minutes."""
    if os.environ.get("CEPHALO_IMAGE_TESTS") != "1":
        pytest.skip("image smoke tests run after a build of this checkout's images: "
                    "scripts/build-images.sh, then CEPHALO_IMAGE_TESTS=1 pytest -m images "
                    "(.ci/run does both with CEPHALO_CI_IMAGES=1)")
    info = CACHE / "out" / f"{target}.json"
    if os.geteuid() != 0 or shutil.which("buildah") is None or not info.exists():
        pytest.skip(SKIP_REASON)
    image = str(json.loads(info.read_text())["image"])
    if subprocess.run([*buildah(), "inspect", "--type", "image", image],
                      capture_output=True).returncode != 0:
        pytest.skip(SKIP_REASON)
    return image


def buildah() -> list[str]:
    """buildah on the storage scripts/build-images.sh built into (overlay or vfs, as it
    found the machine; written beside each image's facts)."""
    facts = max((p for p in (CACHE / "out" / f"{t}.json" for t in ("operator", "trainer"))
                 if p.exists()), key=lambda p: p.stat().st_mtime)
    storage = json.loads(facts.read_text())["storage"]
    return ["buildah", "--storage-driver", storage["driver"], "--root", storage["root"],
            "--runroot", storage["runroot"]]


def image_info(target: str) -> dict[str, object]:
    info: dict[str, object] = json.loads((CACHE / "out" / f"{target}.json").read_text())
    return info


def image_config(image: str) -> dict[str, object]:
    out = subprocess.run([*buildah(), "inspect", "--type", "image", image], check=True,
                         capture_output=True, text=True).stdout
    config: dict[str, object] = json.loads(out)["OCIv1"]["config"]
    return config


def container(image: str) -> Iterator[str]:
    """A working container of `image` (for a module-scoped fixture); removed after."""
    name = subprocess.run([*buildah(), "from", "--quiet", "--pull-never", image], check=True,
                          capture_output=True, text=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run([*buildah(), "rm", name], capture_output=True)


def run_argv(name: str, command: Sequence[str], *, user: str = "1000:1000",
             env: dict[str, str] | None = None, volumes: Sequence[str] = (),
             workdir: str | None = None) -> list[str]:
    """`buildah run` of `command` in container `name` as `user`. --hostname localhost: under
    chroot isolation the container's hostname is not in /etc/hosts and torch's rendezvous
    waits forever in gethostbyname (Kubernetes and Docker add the entry)."""
    argv = [*buildah(), "run", "--isolation", "chroot", "--hostname", "localhost",
            "--user", user]
    for key, value in (env or {}).items():
        argv += ["--env", f"{key}={value}"]
    for volume in volumes:
        argv += ["--volume", volume]
    if workdir:
        argv += ["--workingdir", workdir]
    return [*argv, name, "--", *command]


def run(name: str, command: Sequence[str], *, timeout: float = 300,
        **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(run_argv(name, command, **kwargs), capture_output=True,  # type: ignore[arg-type]
                          text=True, timeout=timeout)


def writable_paths(name: str, user: str = "1000:1000") -> set[str]:
    """Every path on the image's root filesystem `user` may write to (top-most ones)."""
    done = run(name, ["find", "/", "-xdev", "-writable", "-prune", "-print"], user=user)
    return {line for line in done.stdout.splitlines()
            if line and not line.startswith(("/proc", "/sys", "/dev"))}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
