"""Build of strata's cyext kernels (metadata lives in pyproject.toml).

Extensions (importable as strata.kernels.<name>):
  strata_cpu    C++ CPU kernels (cyext/src/strata_cpu.cpp) behind cyext/strata_cpu.pyx. Always.
  strata_cuda   CUDA kernels (cyext/src/strata_kernels.cu, strata_moe.cu, strata_moe_stream.cu,
                strata_linear_stream.cu, strata_router.cu, strata_prefetch.cu,
                compiled by nvcc into objects in parallel and linked with -lcudart_static, so
                importing it needs no libcudart) behind
                cyext/strata_cuda.pyx. Built when nvcc is found; a failed CUDA compile only warns
                and the CPU build goes on. With STRATA_BACKEND=hip the same .cu and .pyx are
                compiled with hipcc for AMD (--offload-arch, default gfx90a) instead.

Environment switches:
  STRATA_CUDA=0|1          force the GPU extension off / on (on: a failed compile is an error)
  STRATA_BACKEND=cuda|hip  GPU toolchain (default cuda)
  STRATA_CUDA_GENCODE      nvcc target flags (default: sm_90 code + compute_80 PTX)
  STRATA_HIP_ARCH          hipcc --offload-arch (default gfx90a)
  STRATA_OPENMP=0          build the CPU kernels without OpenMP
  CUDA_HOME / ROCM_PATH    toolkit locations when not found from nvcc / hipcc
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = "cyext/src"
#: GPU translation units, compiled separately (in parallel) and linked into strata_cuda.
GPU_SOURCES = ("strata_kernels.cu", "strata_moe.cu", "strata_moe_stream.cu",
               "strata_linear_stream.cu", "strata_router.cu", "strata_prefetch.cu")
DEFAULT_GENCODE = ("-gencode=arch=compute_90,code=sm_90 "
                   "-gencode=arch=compute_80,code=compute_80")


def _warn(msg: str) -> None:
    print(f"\n*** strata setup: WARNING: {msg}\n", file=sys.stderr, flush=True)


def _info(msg: str) -> None:
    print(f"strata setup: {msg}", file=sys.stderr, flush=True)


def _env_flag(name: str) -> bool | None:
    val = os.environ.get(name)
    if val is None or val == "":
        return None
    return val.strip().lower() not in ("0", "false", "no", "off")


def _gpu_backend() -> str:
    backend = os.environ.get("STRATA_BACKEND", "cuda").strip().lower() or "cuda"
    if backend not in ("cuda", "hip"):
        raise SystemExit(f"strata setup: STRATA_BACKEND={backend!r} must be cuda or hip")
    return backend


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def _cuda_lib_dirs(nvcc: str) -> list[str]:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    dirs = []
    for home in homes:
        if not home:
            continue
        for sub in ("lib64", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib", "lib"):
            d = os.path.join(home, sub)
            if os.path.exists(os.path.join(d, "libcudart_static.a")) and d not in dirs:
                dirs.append(d)
    return dirs


def _find_hipcc() -> str | None:
    rocm = os.environ.get("ROCM_PATH")
    if rocm and os.path.exists(os.path.join(rocm, "bin", "hipcc")):
        return os.path.join(rocm, "bin", "hipcc")
    return shutil.which("hipcc")


def _hip_lib_dirs() -> list[str]:
    dirs = []
    for d in (os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "lib"), "/opt/rocm/lib",
              "/usr/lib/x86_64-linux-gnu"):
        if os.path.exists(os.path.join(d, "libamdhip64.so")) and d not in dirs:
            dirs.append(d)
    return dirs


def _openmp_flags() -> list[str]:
    if _env_flag("STRATA_OPENMP") is False:
        return []
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.cpp")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        try:
            subprocess.run([cxx, "-fopenmp", src, "-o", os.path.join(tmp, "omp")], check=True,
                           capture_output=True, timeout=60)
            return ["-fopenmp"]
        except Exception:  # noqa: BLE001 - any failure means: build without OpenMP
            _warn("OpenMP not available: the CPU kernels are built single-threaded")
            return []


class BuildExt(build_ext):
    """Compiles the GPU kernel object with nvcc/hipcc first; drops the GPU extension with a
    warning when that fails (unless STRATA_CUDA=1), so the CPU extension always builds."""

    def run(self):
        gpu = [e for e in self.extensions if getattr(e, "strata_gpu", None)]
        for ext in gpu:
            try:
                self._compile_gpu_object(ext)
            except Exception as exc:  # noqa: BLE001
                if _env_flag("STRATA_CUDA"):
                    raise
                _warn(f"the GPU extension {ext.name} is NOT built ({exc}); the CPU kernels are "
                      f"built anyway. Set STRATA_CUDA=1 to make this an error.")
                self.extensions.remove(ext)
        super().run()

    def build_extension(self, ext):
        t0 = time.time()
        super().build_extension(ext)
        _info(f"built {ext.name} in {time.time() - t0:.1f} s")

    def _compile_gpu_object(self, ext):
        """nvcc/hipcc each GPU translation unit into an object (in parallel), skipping fresh ones."""
        kind = ext.strata_gpu
        objdir = os.path.join(self.build_temp, "strata_gpu_" + kind)
        os.makedirs(objdir, exist_ok=True)
        headers = sorted(os.path.join(SRC, f) for f in os.listdir(SRC)
                         if f.endswith((".h", ".cuh")))
        if kind == "cuda":
            nvcc = _find_nvcc()
            if nvcc is None:
                raise RuntimeError("nvcc not found")
            gencode = os.environ.get("STRATA_CUDA_GENCODE", DEFAULT_GENCODE).split()
            base = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--threads", "2",
                    "-I" + SRC, *gencode]
            libdirs = _cuda_lib_dirs(nvcc)
            if not libdirs:
                raise RuntimeError("libcudart_static.a not found (set CUDA_HOME)")
            ext.library_dirs = libdirs
            ext.libraries = ["cudart_static", "rt", "pthread", "dl"]
        else:
            hipcc = _find_hipcc()
            if hipcc is None:
                raise RuntimeError("hipcc not found")
            arch = os.environ.get("STRATA_HIP_ARCH", "gfx90a")
            base = [hipcc, "-x", "hip", "-O3", "-std=c++17", "-fPIC", f"--offload-arch={arch}",
                    "-I" + SRC]
            ext.library_dirs = _hip_lib_dirs()
            ext.libraries = ["amdhip64"]
        env = dict(os.environ)
        if kind == "hip":
            env.setdefault("HIP_PLATFORM", "amd")
        objs, procs = [], []
        for name in GPU_SOURCES:
            src = os.path.join(SRC, name)
            obj = os.path.join(objdir, os.path.splitext(name)[0] + ".o")
            objs.append(obj)
            fresh = os.path.exists(obj) and not self.force and all(
                os.path.getmtime(obj) >= os.path.getmtime(d) for d in [src] + headers)
            if not fresh:
                cmd = base + ["-c", src, "-o", obj]
                _info(" ".join(cmd))
                procs.append((src, time.time(), subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        for src, t0, proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{os.path.basename(base[0])} failed on {src}:\n{out}\n{err}")
            _info(f"compiled {src} ({kind}) in {time.time() - t0:.1f} s")
        ext.extra_objects = objs
        ext.depends = [os.path.join(SRC, n) for n in GPU_SOURCES] + headers


def _extensions():
    from Cython.Build import cythonize

    omp = _openmp_flags()
    cflags = ["-O3", "-std=c++17"]
    exts = [
        Extension(
            "strata.kernels.strata_cpu",
            sources=["cyext/strata_cpu.pyx", f"{SRC}/strata_cpu.cpp"],
            include_dirs=[SRC],
            language="c++",
            extra_compile_args=cflags + omp,
            extra_link_args=omp,
            depends=[f"{SRC}/strata_cpu.h", f"{SRC}/strata_common.h", f"{SRC}/strata_cpu_moe.inc",
                     "cyext/_checks.pxi"],
        )
    ]
    want_gpu = _env_flag("STRATA_CUDA")
    backend = _gpu_backend()
    found = _find_nvcc() if backend == "cuda" else _find_hipcc()
    if want_gpu is False:
        _info("STRATA_CUDA=0: GPU extension disabled")
    elif found is None and not want_gpu:
        _info(f"no {'nvcc' if backend == 'cuda' else 'hipcc'} found: building the CPU kernels only")
    else:
        gpu = Extension(
            "strata.kernels.strata_cuda",
            sources=["cyext/strata_cuda.pyx"],
            include_dirs=[SRC],
            language="c++",
            extra_compile_args=cflags,
            depends=["cyext/_checks.pxi"],
        )
        gpu.strata_gpu = backend
        exts.append(gpu)
    out = cythonize(exts, compiler_directives={"language_level": 3}, quiet=True)
    for before, after in zip(exts, out):
        if hasattr(before, "strata_gpu"):
            after.strata_gpu = before.strata_gpu
    return out


os.chdir(HERE)
setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
