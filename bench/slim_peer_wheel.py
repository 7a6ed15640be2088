"""Repacks the kt-kernel wheel into one that holds only what its MoE kernels need, small enough to carry to the
GPU machine (the carried tree is limited to 64 MiB; the PyPI wheel is ~101 MB, mostly sglang/deep_gemm payloads).

    python bench/slim_peer_wheel.py /work/peer/kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl

writes .whl-peer/<the same file name> at the repository root: `kt_kernel/`, `kt_kernel.libs/` (its vendored libnuma,
hwloc, gomp) and the dist-info, whose RECORD is rewritten for the files kept and whose METADATA drops the
Requires-Dist lines (torch==2.9.1 and the CLI's dependencies: bench/moe_cpu.py drives the extension's own
`kt_kernel_ext.moe` classes from NumPy, which need none of them). Install with

    python3 -m pip install --no-index --no-deps .whl-peer/*.whl
"""

import argparse
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

KEEP = ("kt_kernel/", "kt_kernel.libs/")


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(source: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    with zipfile.ZipFile(source) as wheel:
        dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info"))
        record_name = f"{dist_info}/RECORD"
        records = []
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
            for info in wheel.infolist():
                name = info.filename
                if name == record_name or name.endswith("/"):
                    continue
                if not (name.startswith(KEEP) or name.startswith(dist_info + "/")):
                    continue
                if "/__pycache__/" in name:
                    continue
                data = wheel.read(name)
                if name == f"{dist_info}/METADATA":
                    lines = data.decode().split("\n")
                    data = "\n".join(line for line in lines if not line.startswith("Requires-Dist:")).encode()
                out.writestr(info, data)  # keeps the entry's permissions (the .so files' executable bits)
                records.append(record_line(name, data))
            records.append(f"{record_name},,")
            out.writestr(record_name, "\n".join(records) + "\n")
    return target


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / ".whl-peer")
    args = parser.parse_args()
    target = slim(args.wheel, args.out)
    print(f"{target} ({target.stat().st_size / 2**20:.1f} MiB, from {args.wheel.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
