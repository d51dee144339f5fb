"""tests/masquerade_cpu.py's rewrite: another machine kind's /proc/cpuinfo, as gptlab reads it."""

from gptlab import cpu
from masquerade_cpu import rewrite

ZEN4 = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512vl avx512_vnni avx512_bf16 gfni vaes\n\n"
    "processor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512vl avx512_vnni avx512_bf16 gfni vaes\n"
)


def fields(text: str, processor: int) -> dict[str, str]:
    block = text.split("\n\n")[processor]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}


def test_every_processor_reads_as_the_kind(monkeypatch):
    xeon, zen3 = rewrite(ZEN4, "xeon"), rewrite(ZEN4, "zen3")
    for p in (0, 1):
        assert fields(xeon, p)["vendor_id"] == "GenuineIntel" and fields(xeon, p)["cpu family"] == "6"
        assert fields(xeon, p)["flags"] == "fpu sse2 avx2 fma f16c avx512f avx512vl avx512_vnni gfni vaes"
        assert fields(zen3, p)["model"] == "1" and fields(zen3, p)["model name"] == "AMD EPYC"
        assert fields(zen3, p)["flags"] == "fpu sse2 avx2 fma f16c vaes"
    monkeypatch.setattr(cpu, "cpuinfo", lambda field: fields(xeon, 0).get(field, ""))
    assert not cpu.may_have_native_bf16()  # what gptlab's Python then takes for this CPU
