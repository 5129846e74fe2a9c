"""Run vLLM's own reload tests with graphsafe's plugin off and in every mode; fail on any difference.

The three files come from vLLM's source distribution at run time (``pip download --no-binary``; its build fails
at metadata, but pip leaves the unpacked tree in its temporary build folder, which this script points at a known
place). They run on vLLM's CPU platform (``conftest_upstream.py``: gloo, a default config; tests that need a GPU
engine or the hub are deselected there) with ``GRAPHSAFE_MODE`` set to
``off``, ``strict``, ``recapture`` and ``migrate``. A test whose result in a mode differs from ``off`` fails the
run, unless :data:`RIGHTFUL_FAIL_CLOSED` lists it with why graphsafe rightly fails closed there.

Usage: ``.venv-vllm/bin/python tests/vllm/upstream/run.py [--work build/vllm-upstream]``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

VLLM_VERSION = "0.33.0"
FILES = (
    "tests/model_executor/model_loader/test_reload.py",
    "tests/v1/worker/test_gpu_worker_weight_transfer.py",
    "tests/model_executor/model_loader/test_expert_substitution.py",
)
MODES = ("off", "strict", "recapture", "migrate")
#: ``test id -> why`` for tests whose result in a graphsafe mode may rightly differ from ``off``.
RIGHTFUL_FAIL_CLOSED: dict[str, str] = {
    # (HpcRopeNorm._kv_scratch, lazily made scratch, is declared static by the pack: no longer listed.)
}
HERE = Path(__file__).resolve().parent


def fetch(work: Path) -> Path:
    """The folder holding the three test files of vLLM's sdist (downloaded once into ``work``)."""
    tests = work / "tests"
    if all((tests / Path(name).name).exists() for name in FILES):
        return tests
    tmp = work / "pip-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-clean"]
    command += ["-d", str(work / "sdist"), f"vllm=={VLLM_VERSION}"]
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    trees = [p for p in glob.glob(str(tmp / "pip-*" / "vllm_*")) if os.path.isdir(os.path.join(p, "tests"))]
    if not trees:
        raise SystemExit(f"vllm_upstream: no unpacked vLLM {VLLM_VERSION} source tree under {tmp}; check network")
    tests.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(os.path.join(trees[0], name), tests / Path(name).name)
    shutil.rmtree(tmp, ignore_errors=True)
    return tests


def run_mode(tests: Path, mode: str) -> dict[str, str]:
    """Run the files with ``GRAPHSAFE_MODE=mode``: ``test id -> passed / failed / error / skipped``."""
    shutil.copy(HERE / "conftest_upstream.py", tests / "conftest.py")
    (tests / "pytest.ini").write_text("[pytest]\naddopts =\n")  # this folder is the rootdir: no repo config
    report = tests / f"{mode}.xml"
    # vLLM's CPU platform (the CUDA wheel has no GPU here), and no hub: nothing waits on the network
    env = {**os.environ, "GRAPHSAFE_MODE": mode, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    command += [Path(name).name for name in FILES]
    subprocess.run(command, cwd=tests, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    results: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        results[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="build/vllm-upstream", help="where the sdist's tests and reports go")
    args = parser.parse_args()
    tests = fetch(Path(args.work).resolve())
    runs = {mode: run_mode(tests, mode) for mode in MODES}
    base = runs["off"]
    if not base:
        print("vllm_upstream: no test ran with the plugin off")
        return 1
    bad = 0
    for mode in MODES:
        counts: dict[str, int] = {}
        for outcome in runs[mode].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{mode:>9}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        for name in sorted(set(base) | set(runs[mode])):
            got, want = runs[mode].get(name, "missing"), base.get(name, "missing")
            if got != want:
                why = RIGHTFUL_FAIL_CLOSED.get(name)
                print(
                    f"    {'documented' if why else 'DIFFERS'}: {name}: {want} without graphsafe, {got} here"
                    + (f" ({why})" if why else "")
                )
                bad += why is None
    verdict = "no undocumented difference from plugin-off in any mode" if not bad else f"{bad} difference(s)"
    print(f"vllm_upstream: {verdict}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
