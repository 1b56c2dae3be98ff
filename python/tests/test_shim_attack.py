"""Attacks on the PyTorch shim's build and cache (python/cuarena/torch.py, commit 0380a1e), with
test_torch_shim's stand-in torch (fake c10 headers and a libc10.so made here).

Tests that FAIL on 0380a1e show a defect (see each docstring); the others pin behaviour that holds.
"""
import os
import shutil
import subprocess
import tempfile
import unittest
import warnings

import cuarena
from cuarena import torch as glue

import test_torch_shim as base

CXX = base.CXX

# PyTorch's c10::Error has changed its members between releases; an upgrade that grows it.
_HEADER_V2 = base._HEADER.replace("std::string msg_;", "std::string msg_;\n    char extra_[4096];")
_LIBC10_V2 = base._LIBC10.replace("msg_(std::move(msg)) {}",
                                  "msg_(std::move(msg)) { for (auto &c : extra_) c = 'x'; }")


def _upgrade_in_place(root, torch, header, libc10_src, version):
    """What `pip install -U torch` does: new headers and libc10.so at the same paths."""
    base._write(os.path.join(root, "include", "c10", "util", "Exception.h"), header)
    base._write(os.path.join(root, "libc10.cpp"), libc10_src)
    subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", f"-I{root}/include", os.path.join(root, "libc10.cpp"),
                    "-o", os.path.join(root, "lib", "libc10.so")], check=True, capture_output=True)
    torch.__version__ = version


@unittest.skipIf(shutil.which(CXX) is None, "no C++ compiler")
class ShimAttack(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "CXX", "PATH", "CUARENA_TORCH_SHIM")}
        os.environ["XDG_CACHE_HOME"] = os.path.join(self.dir, "cache")
        os.environ.pop("CUARENA_TORCH_SHIM", None)
        self.root = os.path.join(self.dir, "torch")

    def tearDown(self):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.dir)

    def quiet_shim(self, torch=None):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            shim, c10 = glue._checked_shim(torch)
        return shim, c10, [x for x in w if issubclass(x.category, RuntimeWarning)]

    def test_an_in_place_torch_upgrade_does_not_reuse_a_shim_built_against_the_old_headers(self):
        """DEFECT: the cache key has the include path, not what is there; after an in-place
        upgrade the old shim throws an exception object sized by the old c10::Error, which the
        new libc10 constructor overruns (heap corruption: the catcher aborts)."""
        torch = base._fake_torch(self.root, base._HEADER)
        torch.__version__ = "1"
        old, c10, _ = self.quiet_shim(torch)
        self.assertTrue(c10)
        _upgrade_in_place(self.root, torch, _HEADER_V2, _LIBC10_V2, "2")
        new, c10, _ = self.quiet_shim(torch)
        r = base._run_program(self.dir, "catcher", base._CATCHER, self.root, new)
        self.assertEqual(r.returncode, 0, f"the shim used after the upgrade crashed: {r.stderr.strip()}")
        self.assertNotEqual(old, new, "the shim built against the old headers was reused")

    def test_a_failed_header_build_is_tried_again_after_torch_is_upgraded(self):
        """DEFECT: the `.failed` marker outlives the PyTorch it was recorded for (same path)."""
        torch = base._fake_torch(self.root, '#error "old PyTorch"\n')
        torch.__version__ = "1"
        _, c10, w = self.quiet_shim(torch)
        self.assertFalse(c10)
        self.assertEqual(len(w), 1)
        _upgrade_in_place(self.root, torch, base._HEADER, base._LIBC10, "2")
        _, c10, w = self.quiet_shim(torch)
        self.assertTrue(c10, [str(x.message)[:300] for x in w])

    def test_a_compiler_installed_after_a_failed_start_gives_the_c10_build(self):
        """DEFECT: a build that failed because no compiler ran (OSError) is remembered as a
        header failure; once the compiler is installed the shim is never built with the headers."""
        torch = base._fake_torch(self.root, base._HEADER)
        bindir = os.path.join(self.dir, "bin")
        os.makedirs(bindir)
        wrapper = os.path.join(bindir, "attack-cxx")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {shutil.which(CXX)} "$@"\n')
        os.chmod(wrapper, 0o755)
        os.environ["CXX"] = "attack-cxx"  # not on PATH yet: "not installed"
        with self.assertRaises(RuntimeError):
            self.quiet_shim(torch)
        cache = os.path.join(os.environ["XDG_CACHE_HOME"], "cuarena")
        self.assertEqual([f for f in os.listdir(cache) if f.endswith(".failed")], [],
                         "a build that ran no compiler was remembered")
        os.environ["PATH"] = bindir + os.pathsep + os.environ["PATH"]  # installed
        _, c10, w = self.quiet_shim(torch)
        self.assertTrue(c10, [str(x.message)[:300] for x in w])

    def test_the_fallback_warning_names_the_caller_of_the_public_shim_path(self):
        """NIT: stacklevel=4 is right through use(), one frame past a direct shim_path(torch)."""
        torch = base._fake_torch(self.root, '#error "not this PyTorch"\n')
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            glue.shim_path(torch)
        self.assertEqual([os.path.basename(x.filename) for x in w], [os.path.basename(__file__)])

    def test_a_cache_that_cannot_be_written_but_holds_the_plain_shim_still_serves(self):
        """RISK: a cache prebuilt with shim_path() (no torch) and then read-only (container,
        read-only HOME): use() now tries the header build, and mkstemp's error escapes instead
        of falling back to the cached shim with the warning. (EROFS simulated: tests run as root.)"""
        plain, _, _ = self.quiet_shim()
        torch = base._fake_torch(self.root, base._HEADER)
        real = tempfile.mkstemp

        def read_only(*a, **kw):
            raise OSError(30, "Read-only file system")

        glue.tempfile.mkstemp = read_only
        try:
            shim, c10, w = self.quiet_shim(torch)
        finally:
            glue.tempfile.mkstemp = real
        self.assertEqual(shim, plain)
        self.assertFalse(c10)
        self.assertEqual(len(w), 1)

    def test_a_torch_without_libc10_falls_back_with_a_warning_not_silently(self):
        """DEFECT on 0380a1e: headers without libc10.so (or the reverse) gave the plain shim with
        no warning."""
        torch = base._fake_torch(self.root, base._HEADER)
        os.unlink(os.path.join(self.root, "lib", "libc10.so"))
        shim, c10, w = self.quiet_shim(torch)
        self.assertFalse(c10)
        self.assertEqual(len(w), 1, [str(x.message) for x in w])
        self.assertIn("libc10.so", str(w[0].message))
        self.assertIn("not torch.OutOfMemoryError", str(w[0].message))

    def test_a_prebuilt_shim_without_the_c10_symbol_says_runtime_error(self):
        """Holds: CUARENA_TORCH_SHIM naming a shim built before cuarena_torch_shim_level existed
        (level 0: out of memory a RuntimeError)."""
        src = os.path.join(self.dir, "old_shim.cpp")
        base._write(src, r'''
#include <cstddef>
#include <stdexcept>
extern "C" void *cuarena_malloc(size_t, int, void *);
extern "C" void cuarena_free(void *, size_t, int, void *);
extern "C" void *cuarena_torch_malloc(size_t s, int d, void *st) {
    void *p = cuarena_malloc(s, d, st); if (!p && s) throw std::runtime_error("cuarena"); return p; }
extern "C" void cuarena_torch_free(void *p, size_t s, int d, void *st) { cuarena_free(p, s, d, st); }
extern "C" void *cuarena_torch_target(void) { return reinterpret_cast<void *>(&cuarena_malloc); }
''')
        lib = os.path.realpath(cuarena.library_path())
        out = os.path.join(self.dir, "old_shim.so")
        subprocess.run([CXX, "-shared", "-fPIC", src, "-o", out, lib, f"-Wl,-rpath,{os.path.dirname(lib)}"],
                       check=True, capture_output=True)
        os.environ["CUARENA_TORCH_SHIM"] = out
        shim, level, w = self.quiet_shim(base._fake_torch(self.root, base._HEADER))
        self.assertEqual((shim, level, w), (out, 0, []))


if __name__ == "__main__":
    unittest.main()
