"""The PyTorch shim's two builds (python/cuarena/torch_shim.cpp), without PyTorch: a stand-in
`torch` module whose directory holds c10 headers and a libc10.so made here.

- Headers that compile: the shim is built with them, says so (cuarena_torch_shim_level), and a
  failed allocation throws the c10 type, checked by a C++ program that catches it. (The
  stand-in has no allocator header, so the shim's own allocator, level 2, is tested on a GPU
  with PyTorch: test_cuarena's Frameworks.)
- Headers that do not: a RuntimeWarning, the shim built without them, and the failed build
  remembered, so the next start does not compile it again.
"""
import ctypes
import os
import shutil
import subprocess
import tempfile
import types
import unittest
import warnings

import cuarena
from cuarena import torch as glue

CXX = os.environ.get("CXX") or "c++"

# A stand-in for c10/util/Exception.h: the names the shim uses, with PyTorch's shapes (a class
# hierarchy rooted at std::exception whose constructors live in libc10.so).
_HEADER = r'''
#pragma once
#include <cstdint>
#include <exception>
#include <string>
namespace c10 {
struct SourceLocation { const char *function; const char *file; uint32_t line; };
class Error : public std::exception {
  public:
    Error(SourceLocation loc, std::string msg);
    const char *what() const noexcept override;
  private:
    std::string msg_;
};
class OutOfMemoryError : public Error { using Error::Error; };
}
#define C10_THROW_ERROR(err_type, msg) \
    throw ::c10::err_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg)
'''
_LIBC10 = r'''
#include <c10/util/Exception.h>
c10::Error::Error(SourceLocation, std::string msg) : msg_(std::move(msg)) {}
const char *c10::Error::what() const noexcept { return msg_.c_str(); }
'''
# Calls the shim's malloc with an impossible size and names the type it caught.
_CATCHER = r'''
#include <c10/util/Exception.h>
#include <cstdio>
#include <cstddef>
extern "C" void *cuarena_torch_malloc(size_t, int, void *);
int main() {
    try {
        cuarena_torch_malloc(size_t(1) << 60, 0, nullptr);
        std::puts("returned");
    } catch (c10::OutOfMemoryError &e) {
        std::printf("OutOfMemoryError: %s\n", e.what());
    } catch (c10::Error &e) {
        std::printf("Error: %s\n", e.what());
    } catch (std::exception &e) {
        std::printf("other: %s\n", e.what());
    }
    return 0;
}
'''


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _fake_torch(root, header):
    """A stand-in torch module rooted at `root`, with `header` as c10/util/Exception.h and a
    libc10.so built from _LIBC10 against the working header."""
    _write(os.path.join(root, "include", "c10", "util", "Exception.h"), _HEADER)
    _write(os.path.join(root, "libc10.cpp"), _LIBC10)
    os.makedirs(os.path.join(root, "lib"))
    subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", f"-I{root}/include", os.path.join(root, "libc10.cpp"),
                    "-o", os.path.join(root, "lib", "libc10.so")], check=True, capture_output=True)
    _write(os.path.join(root, "include", "c10", "util", "Exception.h"), header)
    return types.SimpleNamespace(__file__=os.path.join(root, "__init__.py"),
                                 _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))


@unittest.skipIf(shutil.which(CXX) is None, "no C++ compiler")
class TorchShim(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.old_cache = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = os.path.join(self.dir, "cache")

    def tearDown(self):
        if self.old_cache is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = self.old_cache
        shutil.rmtree(self.dir)

    def test_with_headers_that_compile_out_of_memory_throws_the_c10_type(self):
        torch = _fake_torch(os.path.join(self.dir, "torch"), _HEADER)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            shim, level = glue._checked_shim(torch)
        self.assertEqual(level, 1, shim)
        # The stand-in has no allocator header: one warning says what that loses, and why.
        msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
        self.assertEqual(len(msgs), 1, msgs)
        self.assertIn("without PyTorch's allocator headers", msgs[0])
        self.assertIn("CUDAPluggableAllocator.h", msgs[0])
        self.assertNotIn("not torch.OutOfMemoryError", msgs[0])
        plain, plain_level = glue._checked_shim()  # without torch: the other build, its own file
        self.assertNotEqual(plain, shim)
        self.assertEqual(plain_level, 0)

        catcher = os.path.join(self.dir, "catcher")
        _write(catcher + ".cpp", _CATCHER)
        lib = os.path.realpath(cuarena.library_path())
        subprocess.run([CXX, "-std=c++17", f"-I{self.dir}/torch/include", catcher + ".cpp", "-o", catcher, shim,
                        f"-Wl,-rpath,{os.path.dirname(shim)}", f"-L{self.dir}/torch/lib", "-lc10",
                        f"-Wl,-rpath,{self.dir}/torch/lib", lib, f"-Wl,-rpath,{os.path.dirname(lib)}"],
                       check=True, capture_output=True)
        out = subprocess.run([catcher], capture_output=True, text=True, timeout=600).stdout
        # 2^60 bytes: out of memory on a GPU; without a driver, cuarena's "no CUDA driver" error.
        try:
            cuarena.stats(0)
            gpu = True
        except cuarena.CuarenaError:
            gpu = False
        if gpu:
            self.assertTrue(out.startswith("OutOfMemoryError: CUDA out of memory. cuarena: out of memory: "), out)
        else:
            self.assertTrue(out.startswith("Error: cuarena: cannot allocate"), out)
            self.assertIn("no CUDA driver", out)

    def test_headers_that_do_not_compile_fall_back_with_a_warning_and_are_not_tried_again(self):
        torch = _fake_torch(os.path.join(self.dir, "torch"), '#error "not this PyTorch"\n')
        calls = []
        real_run = glue.subprocess.run

        def counted(cmd, **kw):
            calls.append(cmd)
            return real_run(cmd, **kw)

        glue.subprocess.run = counted
        try:
            for start in range(2):
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    shim, level = glue._checked_shim(torch)
                self.assertEqual(level, 0)
                msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
                self.assertEqual(len(msgs), 1, msgs)
                self.assertIn("not torch.OutOfMemoryError", msgs[0])
                self.assertIn("not this PyTorch", msgs[0])  # the compiler's reason
                ctypes.CDLL(shim)  # loads
                if start == 0:
                    # C++20 and C++17 with the headers, then without them.
                    self.assertEqual(len(calls), 3, calls)
                    self.assertTrue(all("-DCUARENA_C10" in c for c in calls[:2]), calls)
                    self.assertNotIn("-DCUARENA_C10", calls[2])
            self.assertEqual(len(calls), 3, "the second start compiled again")
        finally:
            glue.subprocess.run = real_run


if __name__ == "__main__":
    unittest.main()
