"""A stand-in for the device image, built from this environment.

The lent GPU has torch, triton, pytest, hypothesis, safetensors, numpy,
transformers, pytest-benchmark and psutil (the device tool's README), no vLLM
and no pytest-xdist, and kvfill is not installed there:
``gpu/device_check.sh`` puts it on the path through ``gpu/device_env.sh``.
``build(folder)`` makes a virtual environment (no pip) whose site-packages
holds exactly those distributions and what they require - every file their
RECORD lists, linked from this environment's site-packages - so vLLM,
pytest-xdist and kvfill itself are absent there as they are on the device:
imports fail and ``importlib.util.find_spec`` says None.
Returns its python; a subprocess of it (``sys.executable``) is in the image
too.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig

DEVICE_IMAGE = ("torch", "triton", "pytest", "hypothesis", "safetensors", "numpy", "transformers", "pytest-benchmark",
                "psutil")


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def distributions(names=DEVICE_IMAGE) -> dict[str, md.Distribution]:
    """``names`` and every distribution they require (markers evaluated
    without extras), by canonical name."""
    from packaging.requirements import Requirement

    out, todo = {}, [_canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a requirement this environment lacks: the image may lack it too
        out[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_canonical(req.name))
    missing = [n for n in DEVICE_IMAGE if _canonical(n) not in out]
    if missing:
        raise RuntimeError(f"this environment lacks {missing}, which the device image has")
    return out


def build(folder: str) -> str:
    """The image's python, in a new environment under ``folder``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    python = os.path.join(folder, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = os.path.realpath(sysconfig.get_paths()["purelib"])
    for dist in distributions().values():
        for top in sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}):
            src = os.path.realpath(dist.locate_file(top))
            dst = os.path.join(site, top)
            if os.path.dirname(src) == ours and os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
    return python
