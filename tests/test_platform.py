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
