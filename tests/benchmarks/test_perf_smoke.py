"""The benchmark history and CI's perf smoke (benchmarks/_record.py, benchmarks/perf_smoke.py).

No timed assertion here: the comparison is tested on given figures, and the one end-to-end test
asserts only that a deliberate slowdown (CPU burnt in every model step, 50 ms a step: several
times the work of a step of this workload) makes the smoke fail against a baseline it just recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _record  # noqa: E402
import perf_smoke  # noqa: E402

from lm_console.bench import fingerprint as fp  # noqa: E402


def test_a_drop_beyond_the_allowed_fraction_fails() -> None:
    baseline = {"dense_bf16": 200.0, "default": 400.0}
    assert perf_smoke.compare(baseline, {"dense_bf16": 152.0, "default": 400.0}, 0.25) == []  # 0.76x
    failures = perf_smoke.compare(baseline, {"dense_bf16": 148.0, "default": 400.0}, 0.25)  # 0.74x
    assert len(failures) == 1 and failures[0].startswith("dense_bf16: 148.0")
    assert perf_smoke.compare(baseline, {"dense_bf16": 400.0, "default": 800.0}, 0.25) == []  # faster passes
    assert len(perf_smoke.compare(baseline, {"dense_bf16": 100.0, "default": 100.0}, 0.25)) == 2


def test_a_variant_on_one_side_only_fails() -> None:
    failures = perf_smoke.compare({"dense_bf16": 200.0}, {"dense_bf16": 200.0, "default": 400.0}, 0.25)
    assert failures == ["default: in the measurement only (run make bench-baseline after changing the variants)"]


def test_the_workload_is_fixed() -> None:
    first, again = perf_smoke.requests(), perf_smoke.requests()
    assert first == again and len(first) == 16
    assert all(48 <= len(ids) <= 96 and 24 <= n <= 48 for ids, n in first)


def _print(**changes):
    base = {"cpu_model": "X", "isa": ["avx2"], "usable_cpus": 2, "memory_gib": 23.6, "torch": "2.13.0",
            "python": "3.11.7", "commit": "abc", "load_average": [1.0, 1.0, 1.0]}
    return {**base, **changes}


def test_the_fingerprint_id_ignores_the_commit_and_the_load_but_not_the_machine() -> None:
    same = fp.fingerprint_id(_print())
    assert fp.fingerprint_id(_print(commit="def", load_average=[9.0, 9.0, 9.0], memory_gib=23.5)) == same
    for change in ({"cpu_model": "Y"}, {"isa": ["avx2", "avx512f"]}, {"usable_cpus": 1}, {"torch": "2.14.0"}):
        assert fp.fingerprint_id(_print(**change)) != same, change


def test_the_fingerprint_names_what_the_figures_depend_on() -> None:
    print_ = fp.fingerprint()
    for key in ("cpu_model", "isa", "usable_cpus", "affinity_cpus", "cgroup_cpu_quota", "memory_gib", "torch",
                "commit", "load_average"):
        assert key in print_
    assert print_["usable_cpus"] <= len(os.sched_getaffinity(0))
    assert print_["torch"]  # installed in the test venv


def test_record_stamps_saves_and_appends(tmp_path, monkeypatch) -> None:
    history = tmp_path / "history.jsonl"
    monkeypatch.setenv("LMC_BENCH_HISTORY", str(history))
    saved = tmp_path / "one.json"
    first = _record.record("demo", {"tok_s": 1.5}, saved)
    _record.record("other", {"tok_s": 2.5})
    assert json.loads(saved.read_text()) == first
    assert first["benchmark"] == "demo" and first["tok_s"] == 1.5
    assert first["fingerprint_id"] == fp.fingerprint_id(first["fingerprint"])
    lines = history.read_text().splitlines()
    assert len(lines) == 2
    assert [r["tok_s"] for r in _record.runs("demo", history=history)] == [1.5]
    assert len(_record.runs(fingerprint_id=first["fingerprint_id"], history=history)) == 2
    assert _record.runs(fingerprint_id="nope", history=history) == []


def test_the_history_can_be_turned_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMC_BENCH_HISTORY", "off")
    assert _record.history_path() is None
    _record.record("demo", {"x": 1})  # writes nothing, raises nothing
    monkeypatch.delenv("LMC_BENCH_HISTORY")
    assert _record.history_path() == ROOT / "benchmarks" / "history.jsonl"


@pytest.mark.slow
def test_a_deliberate_slowdown_fails_the_smoke(tmp_path) -> None:
    env = {**os.environ, "LMC_BENCH_BASELINES": str(tmp_path / "baselines"),
           "LMC_BENCH_HISTORY": str(tmp_path / "history.jsonl")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "perf_smoke.py"), "--variants", "default", "--repeats", "1"]
    recorded = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    assert "baseline recorded" in recorded.stdout
    slowed = subprocess.run([*cmd, "--inject-cpu-ms-per-step", "50"], env=env, capture_output=True, text=True,
                            timeout=900)
    assert slowed.returncode == 1, slowed.stdout + slowed.stderr[-2000:]
    assert "PERF REGRESSION: default:" in slowed.stderr
    runs = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [r["status"] for r in runs] == ["recorded", "failed"]
