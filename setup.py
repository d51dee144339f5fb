"""Install-time build of gptlab's CPU kernels (everything else is in pyproject.toml).

`pip install .` and `pip install -e .` (so `make install`) compile csrc/kernels.c once per
variant (gptlab/kernel_build.py) into the package, next to gptlab/kernels.py, which loads the best
one the CPU can run. The libraries are ctypes libraries, not Python extension modules; one
Extension entry stands for them so that setuptools runs this step and marks a wheel as
platform-specific. A machine without a C compiler still installs: gptlab then builds at first use,
or runs PyTorch's kernels, and says why.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location("kernel_build", Path(__file__).parent / "src/gptlab/kernel_build.py")
kernel_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_build)


class BuildKernels(build_ext):
    """Build every variant's library into the build directory's package, and for editable installs
    (inplace) copy them next to src/gptlab/kernels.py."""

    def _built(self) -> list[tuple[str, Path]]:
        return [(v, Path(self.build_lib) / "gptlab" / kernel_build.library_name(v)) for v in kernel_build.buildable()]

    def _source_dir(self) -> Path:
        return Path(self.get_finalized_command("build_py").get_package_dir("gptlab"))

    def _in_source(self, path: Path) -> Path:
        return self._source_dir() / path.name

    def build_extension(self, ext):
        # Libraries already current in the source tree (`make install` builds them there while
        # pip installs torch) are copied, not compiled again.
        for line in kernel_build.build_all(Path(self.build_lib) / "gptlab", reuse=self._source_dir()):
            print(line)

    def copy_extensions_to_source(self):
        for _, path in self._built():
            if path.exists():
                self.copy_file(str(path), str(self._in_source(path)), level=self.verbose)

    def get_output_mapping(self):
        return {str(path): str(self._in_source(path)) for _, path in self._built() if path.exists()}

    def get_outputs(self):
        return [str(self._in_source(p) if self.inplace else p) for _, p in self._built() if p.exists()]


setup(
    ext_modules=[Extension("gptlab._kernels", sources=["src/gptlab/csrc/kernels.c"])],
    cmdclass={"build_ext": BuildKernels},
)
