# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC: pip's arguments for torch (unquoted, so an index can follow: `make test
# TORCH_SPEC="torch==2.13.0 --index-url URL"`; quote a `>=` within it), e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# The demo needs only the package (CORE); the tests also need the dev extra's peers (STAMP), whose
# ~45 s of installing a fresh clone's `make demo` does not wait for.
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels-current

.PHONY: test demo lint bench install browser qemu mutants neon-check emulated-check masquerade-check

install: $(STAMP)

# The kernels compile while pip installs torch (~10 s less); pip's build of the package then finds them current.
$(CORE): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) src/gptlab/kernel_build.py & $(PY) -m pip install -q $(TORCH_SPEC); status=$$?; wait; exit $$status
	$(PY) -m pip install -q -e .
	$(PY) -m gptlab.kernels  # pip built every kernel variant (setup.py); say which one this CPU runs
	touch $@

$(STAMP): $(CORE)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: $(STAMP) $(KERNELS) browser qemu
	$(PY) -m pytest -q

# The kernels in the source tree, built again when csrc changes (a pull, an edit; nothing to do
# when they are current), so that `make test` tests the libraries an install ships rather than
# first use's build into the cache.
$(KERNELS): $(CORE) $(wildcard src/gptlab/csrc/*.c src/gptlab/csrc/*.h)
	$(PY) src/gptlab/kernel_build.py
	touch $@

# Headless Chromium (Debian's package) for the explorer's browser test; best effort: the test
# skips, saying why, only when it cannot be installed (no apt-get, not root, no network).
browser:
	@test -x /usr/bin/chromium || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
		|| echo "note: could not install Chromium; the browser test will be skipped"; }

# qemu-user (Debian's package) for tests/test_emulated_cpu.py's AVX2 CPU without AVX-512 or VNNI;
# best effort, as the browser: the test skips, saying why, only when it cannot be installed.
qemu:
	@command -v qemu-x86_64 >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null; } \
		|| echo "note: could not install qemu-user; the emulated CPU test will be skipped"; }

# The demo's deadline counts from make's start, the install included: `:=` reads the clock once,
# as make reads this file, before any prerequisite is built. Training ends sooner only where the
# install was slow enough to need it (gptlab demo --deadline).
DEMO_START := $(shell date +%s)
DEMO_SECONDS ?= 290
demo: $(CORE)
	$(PY) -m gptlab demo --deadline $$(($(DEMO_START) + $(DEMO_SECONDS)))

# The figures of the README's speed tables (Speed on each CPU) for this machine, each run written
# to bench/results/ and summed up at the end by `gptlab bench summary` (~8 min on a 2-core Zen 5;
# the first run builds llama.cpp, ~8 min more). The nanoGPT row needs a checkout of
# karpathy/nanoGPT and the demo's data: `make demo`, then
# `make bench NANOGPT_DIR=path`. Time `make demo` from a fresh clone apart.
NANOGPT_DIR ?=
bench: $(STAMP)
	$(PY) -m gptlab bench generate --peer llama.cpp --repeats 3
	$(PY) -m gptlab bench generate --peer llama.cpp --repeats 3 --modes int8,int4 --depth 895
	$(PY) -m gptlab bench generate --modes fp32 --batch 1 --repeats 3
	$(PY) -m gptlab bench serve --rounds 3
	$(PY) -m gptlab bench train --rounds 3 --steps 2
	$(PY) -m gptlab bench gemm --rounds 5
	V=$$($(PY) -c 'from gptlab import kernels; print(kernels.auto_variant())') && \
		$(PY) -m gptlab bench variants --variants $$V:nta,$$V:t0 --rounds 7 --new-tokens 128 --prompt-len 0 --gemm-rows 0
	@if [ -z "$(NANOGPT_DIR)" ]; then echo "skipped gptlab bench nanogpt: set NANOGPT_DIR to a nanoGPT checkout"; \
	elif [ ! -f runs/demo/data/train.bin ]; then echo "skipped gptlab bench nanogpt: run make demo first (its data)"; \
	else $(PY) -m gptlab bench nanogpt --nanogpt-dir "$(NANOGPT_DIR)" --data runs/demo/data --seconds 60; fi
	$(PY) -m gptlab bench summary --results bench/results

lint: $(STAMP)
	$(PY) -m ruff check src tests

# Plant realistic bugs one at a time in a copy of the tree; report which tests catch each (not part of `make test`).
mutants: $(STAMP)
	$(PY) bench/mutants.py

# The aarch64 NEON kernels (not part of `make test`): cross-compiled with Debian's
# gcc-aarch64-linux-gnu, their C check (tests/c/kernel_check.c) run under qemu-user against the
# portable variant, then planted bugs, each of which must fail it; and each library disassembled
# (no instruction past Armv8.0's NEON but neon-dotprod's dot products).
neon-check: $(STAMP)
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null; }
	$(PY) tests/c/run_check.py --arch aarch64 --mutants

# The CPU-dependent tests on emulated x86-64 CPUs (not part of `make test`; ~30 min on 2 cores of an
# AMD host, hours on an Intel one, whose qemu runs the AVX2 model's code far slower):
# qemu-user's AVX2 CPU of this host's vendor without AVX-512 or VNNI (EPYC-Milan, Zen 3, on an AMD
# host) and one without AVX (Westmere), each checked to get the variant it must (tests/emulated_cpu.py).
emulated-check: $(STAMP) qemu
	$(PY) tests/emulated_cpu.py

# The whole suite natively under the Intel Xeon's and the Zen 3's /proc/cpuinfo (the choices gptlab
# makes from the vendor and flags), bind-mounted as root (not part of `make test`; ~14 min on 2 cores).
masquerade-check: $(STAMP)
	$(PY) tests/masquerade_cpu.py
