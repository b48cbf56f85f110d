"""lm_console/engine/platform.py's CPU flags: the one /proc/cpuinfo reader (dtype default, AMX dense-rows choice)."""

from __future__ import annotations

from lm_console.engine import platform
from lm_console.kernels import cpu_quant


def test_flags_come_from_the_first_flags_line() -> None:
    text = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert platform.flags_of(text) == frozenset({"fpu", "avx512f", "amx_bf16"})
    assert platform.flags_of("processor : 0\n") == frozenset()
    assert platform.flags_of("") == frozenset()


def test_a_missing_cpuinfo_reads_as_no_flags(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(platform, "CPUINFO", tmp_path / "absent")
    platform.cpu_flags.cache_clear()
    try:
        assert platform.cpu_flags() == frozenset()
        assert not platform.cpu_has_fast_bf16() and not cpu_quant._cpu_has_amx()
    finally:
        platform.cpu_flags.cache_clear()


def test_the_engine_and_the_kernels_read_the_same_flags(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile\n")
    monkeypatch.setattr(platform, "CPUINFO", fake)
    platform.cpu_flags.cache_clear()
    try:
        assert platform.cpu_has_fast_bf16() and cpu_quant._cpu_has_amx()
    finally:
        platform.cpu_flags.cache_clear()


def test_int8_dot_needs_avx512_vnni_with_f_and_bw(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "cpuinfo"
    monkeypatch.setattr(platform, "CPUINFO", fake)
    for flags, expected in (("fpu avx2 fma f16c", False),  # an AVX2-only EPYC (Zen 2)
                            ("avx512f avx512bw avx512_vnni avx512_bf16", True),  # Zen 4/5
                            ("avx512f avx512bw avx512_vnni amx_bf16 amx_int8", True),  # Sapphire Rapids
                            ("avx512f avx512_vnni", False)):
        fake.write_text(f"processor : 0\nflags : {flags}\n")
        platform.cpu_flags.cache_clear()
        try:
            assert platform.cpu_has_int8_dot() is expected, flags
        finally:
            platform.cpu_flags.cache_clear()


# -- the CPUs this process may use (affinity and cgroup quota) --------------------------------

def _v2(tmp_path, leaf: str, parent: str | None = None):
    """A cgroup v2 tree: /proc/self/cgroup names /a/b; b's cpu.max is `leaf`, a's `parent`."""
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "cpu.max").write_text(leaf + "\n")
    if parent is not None:
        (root / "a" / "cpu.max").write_text(parent + "\n")
    listing = tmp_path / "self_cgroup"
    listing.write_text("0::/a/b\n")
    return root, listing


def test_cgroup_v2_quota_is_quota_over_period(tmp_path) -> None:
    root, listing = _v2(tmp_path, "150000 100000")
    assert platform.cgroup_cpu_quota(root, listing) == 1.5


def test_cgroup_v2_unlimited_reads_as_none(tmp_path) -> None:
    root, listing = _v2(tmp_path, "max 100000")
    assert platform.cgroup_cpu_quota(root, listing) is None


def test_cgroup_v2_a_parents_limit_binds_the_child(tmp_path) -> None:
    # The leaf is unlimited; its parent allows one core: a reader of the leaf alone would say None.
    root, listing = _v2(tmp_path, "max 100000", parent="100000 100000")
    assert platform.cgroup_cpu_quota(root, listing) == 1.0
    root, listing = _v2(tmp_path / "x", "50000 100000", parent="300000 100000")
    assert platform.cgroup_cpu_quota(root, listing) == 0.5  # the tighter of the two


def test_cgroup_v1_quota(tmp_path) -> None:
    root = tmp_path / "cgroup"
    base = root / "cpu,cpuacct" / "job"
    base.mkdir(parents=True)
    (base / "cpu.cfs_quota_us").write_text("250000\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    listing = tmp_path / "self_cgroup"
    listing.write_text("4:memory:/job\n2:cpu,cpuacct:/job\n")
    assert platform.cgroup_cpu_quota(root, listing) == 2.5
    (base / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "unlimited"
    assert platform.cgroup_cpu_quota(root, listing) is None


def test_no_cgroup_files_read_as_no_quota(tmp_path) -> None:
    assert platform.cgroup_cpu_quota(tmp_path / "none", tmp_path / "absent") is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_down() -> None:
    assert platform.usable_cpus(affinity=8, quota=None) == 8
    assert platform.usable_cpus(affinity=8, quota=2.0) == 2
    assert platform.usable_cpus(affinity=8, quota=2.9) == 2  # a third thread would be throttled
    assert platform.usable_cpus(affinity=2, quota=16.0) == 2
    assert platform.usable_cpus(affinity=8, quota=0.5) == 1  # never 0


def test_usable_cpus_follows_this_process_affinity() -> None:
    import os

    assert platform.usable_cpus() <= len(os.sched_getaffinity(0))
    assert platform.affinity_cpus() == len(os.sched_getaffinity(0))


def test_usable_cpus_under_a_narrowed_affinity() -> None:
    # As under `taskset -c 0`: 1, whatever os.cpu_count() says.
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from lm_console.engine.platform import usable_cpus; print(usable_cpus(), os.cpu_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1"


# -- OpenMP's waiting -----------------------------------------------------------------------------

def test_openmp_wait_environment_defaults_to_a_short_spin(monkeypatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LMC_OMP_SPIN"):
        monkeypatch.delenv(name, raising=False)
    assert platform.openmp_wait_environment() == {"GOMP_SPINCOUNT": "1000"}
    monkeypatch.setenv("LMC_OMP_SPIN", "0")  # no spinning at all: sleep at once
    assert platform.openmp_wait_environment() == {"GOMP_SPINCOUNT": "0"}
    monkeypatch.setenv("LMC_OMP_SPIN", "200")
    assert platform.openmp_wait_environment() == {"GOMP_SPINCOUNT": "200"}


def test_openmp_wait_environment_leaves_a_users_choice_alone(monkeypatch) -> None:
    monkeypatch.delenv("LMC_OMP_SPIN", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert platform.openmp_wait_environment() == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000")
    assert platform.openmp_wait_environment() == {}
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("LMC_OMP_SPIN", "off")
    assert platform.openmp_wait_environment() == {}


def test_a_bad_spin_count_is_refused(monkeypatch) -> None:
    import pytest

    from lm_console.engine.errors import InvalidEngineArgsError

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LMC_OMP_SPIN", "fast")
    with pytest.raises(InvalidEngineArgsError, match="LMC_OMP_SPIN"):
        platform.openmp_wait_environment()


def test_the_spin_count_reaches_openmp_only_before_torch_loads_it() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LMC_OMP_SPIN")}
    code = ("import os\nfrom lm_console.engine.platform import apply_openmp_wait_environment as a\n"
            "first = a()\nimport torch\ntorch.ones(1)\nsecond = a()\n"
            "print(first, second, os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["True", "False", "1000"]
