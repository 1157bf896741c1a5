"""Air-gapped hosts: provision.yml installs the pinned vLLM from an offline wheelhouse, index off.

The wheelhouse holds a stand-in wheel named vllm 0.26.0 (real vLLM needs a GPU and ~400 MB); what
is tested is the path an air-gapped host takes: copy the folder over, pip --no-index from it alone,
the pinned version in the venv.
"""

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.support.processes import private_inventory
from vllm_lab import serving

pytestmark = [pytest.mark.integration, pytest.mark.untimed]  # a provision, no server started


def stand_in_wheel(folder: Path, version: str = "0.26.0") -> Path:
    """A minimal, valid wheel of a package called vllm (RECORD hashes included)."""
    files = {"vllm/__init__.py": f'__version__ = "{version}"\n',
             f"vllm-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
             f"vllm-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"vllm-{version}.dist-info/RECORD,,")
    path = folder / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"vllm-{version}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_provision_installs_pinned_vllm_from_the_wheelhouse(tmp_path):
    house = tmp_path / "wheelhouse"
    house.mkdir()
    stand_in_wheel(house)
    inventory = private_inventory(
        tmp_path, lab_host_vllm_install=True, lab_host_wheelhouse=str(house),
        lab_host_lab_install=False,
        # Nothing outside the wheelhouse: an unreachable index must not be needed.
        lab_host_pip_index_url="http://127.0.0.1:9/simple")
    first = serving.provision(inventory, limit="localhost")
    assert first.changed > 0
    python = tmp_path / "host/venv/bin/python"
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "0.26.0"
    assert any((tmp_path / "host").rglob("vllm-0.26.0-py3-none-any.whl"))  # copied to the host
    # (A second provision changing nothing is tested for every role in test_serving.)
