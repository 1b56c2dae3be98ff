"""The framework glue's defaults (cuarena.FRAMEWORK_CONF, given to the library by
cuarena_set_defaults under CUARENA_CONF), end to end and without a GPU. Each case runs in a fresh
python3, because a device's allocator reads its configuration once, when it is made.

How the library's reading is seen: a device's allocator parses its configuration before it looks
for the driver, and a failed creation is not cached, so cuarena.malloc() reports an invalid
configuration (`invalid cuarena configuration: ...`) on any machine. A valid one gets past the
parse: "no CUDA driver" without a GPU, an allocation with one.

PyTorch and CuPy are not needed: the subprocess puts small stand-ins for `torch` and `cupy` in
sys.modules, which record, when the glue hands them its allocator, CUARENA_CONF and the defaults
the glue has given the library by then (a spy on cuarena_set_defaults).
"""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

import cuarena

P = cuarena.FRAMEWORK_CONF

# Stand-ins for what cuarena.torch.use() and cuarena.cupy.use() touch of torch and cupy. Each
# records CUARENA_CONF when the glue installs its allocator (the framework may allocate from then
# on). cuarena.torch._checked_shim and _record_stream_hook are replaced: the real ones compile and
# load a C++ shim.
_FAKES = r'''
import os, sys, types
seen = []

torch = types.ModuleType("torch"); torch.__version__ = "0.0-stand-in"
torch.cuda = types.ModuleType("torch.cuda"); torch.cuda.memory = types.ModuleType("torch.cuda.memory")
class _Hooks:
    def set_record_stream_fn(self, f): pass
    def set_reset_fn(self, f): pass
    def set_memory_fraction_fn(self, f): pass
class CUDAPluggableAllocator:
    def __init__(self, *a): self._hooks = _Hooks()
    def allocator(self): return self._hooks
torch.cuda.memory.CUDAPluggableAllocator = CUDAPluggableAllocator
torch.cuda.memory.change_current_allocator = lambda a: seen.append(("torch", os.environ.get("CUARENA_CONF"), given[-1:]))
sys.modules.update({"torch": torch, "torch.cuda": torch.cuda, "torch.cuda.memory": torch.cuda.memory})

cupy = types.ModuleType("cupy"); cupy.cuda = types.ModuleType("cupy.cuda")
cupy.cuda.memory = types.ModuleType("cupy.cuda.memory")
cupy.cuda.memory.UnownedMemory = cupy.cuda.memory.MemoryPointer = object
cupy.cuda.device = types.ModuleType("cupy.cuda.device"); cupy.cuda.device.get_device_id = lambda: 0
cupy.cuda.get_current_stream = lambda: None
cupy.cuda.set_allocator = lambda f: seen.append(("cupy", os.environ.get("CUARENA_CONF"), given[-1:]))
sys.modules.update({"cupy": cupy, "cupy.cuda": cupy.cuda, "cupy.cuda.memory": cupy.cuda.memory,
                    "cupy.cuda.device": cupy.cuda.device})

import cuarena, cuarena.torch, cuarena.cupy
cuarena.torch._checked_shim = lambda torch=None, stacklevel=2: ("stand-in-shim.so", 0)
cuarena.torch._record_stream_hook = lambda shim: None  # libcuarena's own hook, as for an old shim

# A spy on the library's cuarena_set_defaults: records what the glue gives it, then calls it.
given = []
_lib = cuarena.load()
_real_set_defaults = _lib.cuarena_set_defaults
def _spy(items):
    given.append(items if items is None else items.decode(errors="replace"))
    return _real_set_defaults(items)
_lib.cuarena_set_defaults = _spy

def parsed():
    """How the library reads CUARENA_CONF now: its configuration error, or VALID."""
    try:
        cuarena.malloc(256)
        return "VALID"
    except cuarena.CuarenaError as e:
        m = str(e)
        i = m.find("invalid cuarena configuration")
        return m[i:] if i >= 0 else "VALID"
'''


def run(code, conf):
    """Runs _FAKES then `code` in a fresh python3 with CUARENA_CONF = conf (None: unset), from a
    temporary directory (a relative trace= path lands there). Returns stdout; fails on an error."""
    env = os.environ.copy()
    env.pop("CUARENA_CONF", None)
    if conf is not None:
        env["CUARENA_CONF"] = conf
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-c", _FAKES + textwrap.dedent(code)], cwd=d, env=env,
                           capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"CUARENA_CONF={conf!r}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r.stdout


class FrameworkConf(unittest.TestCase):
    def test_each_glue_gives_its_defaults_before_installing_and_leaves_the_environment(self):
        for order in (["torch"], ["cupy"], ["torch", "cupy"], ["cupy", "torch"], ["torch", "torch", "cupy", "cupy"]):
            for user in (None, "max=50%"):
                calls = "\n".join(f"cuarena.{g}.use()" for g in order)
                out = run(calls + "\nprint(repr(seen)); print(repr(os.environ.get('CUARENA_CONF')))", user)
                seen, final = (eval(line) for line in out.splitlines()[-2:])
                self.assertEqual(final, user, (order, "the environment changed"))
                # Each framework got its allocator after the library had the defaults.
                self.assertTrue(seen, order)
                for name, conf, given in seen:
                    self.assertEqual((conf, given), (user, [P]), (order, user, name))

    def test_the_defaults_lie_under_the_users_conf(self):
        # Defaults valid alone, a user conf valid alone, invalid together (a chunk must be a
        # whole number of superblocks): the library must read both, the user's last.
        code = """
            r = cuarena.load().cuarena_set_defaults(b"superblock=4MiB")
            assert r == 0, r
            print(parsed())
        """
        self.assertIn("chunk", run(code, "chunk=6MiB").strip())
        self.assertEqual(run("print(parsed())", "chunk=6MiB").strip(), "VALID")
        self.assertEqual(run(code, None).strip(), "VALID")
        # The user's key wins over the same key in the defaults (taken the other way round, the
        # defaults' chunk would not be a whole number of the user's superblocks).
        self.assertEqual(run(code.replace("superblock=4MiB", "chunk=6MiB"), "superblock=4MiB,chunk=8MiB").strip(), "VALID")

    def test_the_library_reads_the_users_conf_as_before_the_glue(self):
        # For each CUARENA_CONF a user may have: the library's verdict is the same with and
        # without the glue's defaults (valid, or the same error message, which over the
        # defaults also names them).
        valid = [None, "", "   ", ",", " , max=50% ,", ",,max:50%,,", "max:80%,small_max:1MiB", "passthrough",
                 " passthrough ", "passthrough=false", "trace=t.bin", "stats=exact", "legacy_batch_bytes:64MiB",
                 "legacy_batch_bytes = 32 MiB", P, P + ",max=50%", "legacy_batch=8"]
        invalid = ["bogus=1", "max=0.8", "max=80", "small_max", "=1MiB", "small_max=", "legacy_batch_bytes=0B",
                   "legacy_batch_bytes=", "legacy_batch_bytes=16MiB;max=50%", "small_max=1MiB superblock=2MiB",
                   "superblock=4MiB,chunk=3MiB", "passthrough=maybe", "max=50%,bogus",
                   "max=50%\x1f", "\x1f", "\x1c,max=50%"]
        for user in valid + invalid:
            plain = run("print(parsed())", user).strip()
            self.assertEqual(plain == "VALID", user in valid, f"CUARENA_CONF={user!r}: {plain}")
            glued = run("cuarena.torch.use(); print(parsed())", user).strip()
            if plain == "VALID":
                self.assertEqual(glued, plain, f"CUARENA_CONF={user!r}")
            else:
                self.assertTrue(glued.startswith(plain) and f"defaults `{P}`" in glued, f"CUARENA_CONF={user!r}: {glued}")

    def test_a_conf_that_is_not_utf8_is_refused_not_ignored(self):
        env = dict(os.environb)
        env[b"CUARENA_CONF"] = b"max=50%\xff"
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([sys.executable, "-c", _FAKES + "\nprint(parsed())"], cwd=d, env=env,
                               capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("not valid UTF-8", r.stdout)

    def test_invalid_defaults_are_refused_and_change_nothing(self):
        code = """
            lib = cuarena.load()
            for bad in (b"bogus=1", b"legacy_batch_bytes=0B", b"\\xff"):
                assert lib.cuarena_set_defaults(bad) == -1, bad
                assert cuarena.last_error(), bad
            assert lib.cuarena_set_defaults(None) == -1
            print(parsed())
        """
        # Nothing was set: the user's conf alone decides (valid here).
        self.assertEqual(run(code, "chunk=6MiB").strip(), "VALID")


if __name__ == "__main__":
    unittest.main()
