"""The settings that hold gptlab to an instruction set below the CPU's (`bench generate
--peer-isa`, and `bench summary`'s columns). No imports: the summary reads them without torch."""

# What holds gptlab to the instruction set of a --peer-isa build of llama.cpp: its own kernels,
# PyTorch's vectorized ops, oneDNN and MKL. Read when each library starts, so set before the run.
# avx2: AVX2-only CPUs such as AMD Zen 1-3; avx512-vnni: Intel's Ice Lake servers (AVX-512 with
# VNNI, no BF16 or AMX: this project's first Xeon; MKL's AVX512_E2 is Ice Lake's level).
AVX2_ENV = {
    "GPTLAB_KERNELS": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
ISA_ENV = {
    "native": {},
    "avx2": AVX2_ENV,
    "avx512-vnni": {
        "GPTLAB_KERNELS": "avx512",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E2",
    },
}
