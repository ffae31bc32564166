"""CycloneDX 1.5 JSON SBOM of the Python packages an interpreter sees, read from the installed
environment's metadata (*.dist-info): scripts/build-images.sh runs it inside each image with
the image's own Python (stdin), so it lists exactly what the image installed, the base's site
packages included. Standard library only; deterministic (no timestamp; the serial number
is derived from the contents), so the SBOM of one image is the same on every run.

    python -I image_sbom.py IMAGE-NAME > image.cdx.json
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import uuid


def components() -> list[dict[str, object]]:
    seen: dict[str, dict[str, object]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name or name.lower() in seen:  # the first one on sys.path is the one imported
            continue
        version = dist.version
        key = name.lower().replace("_", "-")
        component: dict[str, object] = {
            "type": "library", "bom-ref": f"pkg:pypi/{key}@{version}", "name": name,
            "version": version, "purl": f"pkg:pypi/{key}@{version}"}
        license_ = dist.metadata.get("License-Expression") or dist.metadata.get("License")
        if license_ and len(license_) < 100:
            component["licenses"] = [{"expression": license_}] \
                if dist.metadata.get("License-Expression") else [{"license": {"name": license_}}]
        seen[name.lower()] = component
    return sorted(seen.values(), key=lambda c: str(c["bom-ref"]))


def main() -> None:
    image = sys.argv[1] if len(sys.argv) > 1 else "image"
    parts = components()
    digest = hashlib.sha256(json.dumps([image, parts], sort_keys=True).encode()).digest()
    bom = {
        "bomFormat": "CycloneDX", "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.UUID(bytes=digest[:16], version=5)}", "version": 1,
        "metadata": {"component": {"type": "container", "name": image},
                     "tools": [{"name": "cephalo scripts/image_sbom.py"}]},
        "components": parts,
    }
    json.dump(bom, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
