"""Tests of the installed cuarena package, run from outside the repository:

    bash tools/python-check.sh [path/to/libcuarena.so]

which installs python/ into a temporary directory (shipping the library) and runs
`python3 -m unittest discover` there. Without a GPU every call must fail with cuarena's message
as an exception; with one (CUARENA_REQUIRE_GPU=1 makes it required) the calls must work, and
the PyTorch and CuPy parts run where those are installed (each in a subprocess: an allocator is
chosen once per process).

Environment: CUARENA_EXPECT_SHIPPED=1 requires the library to be the one shipped inside the
package (found with CUARENA_LIB unset); CUARENA_TEST_REPO names the repository, which the
package must not be imported from.
"""
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import cuarena

REQUIRE_GPU = os.environ.get("CUARENA_REQUIRE_GPU") == "1"


def gpu_present():
    try:
        cuarena.stats(0)
        return True
    except cuarena.CuarenaError as e:
        if "no CUDA driver" in str(e) and not REQUIRE_GPU:
            return False
        raise


def run_python(code, env=None):
    """Runs `code` in a fresh python3 from a temporary directory; returns (exit code, output)."""
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=d, capture_output=True, text=True,
                           env=env if env is not None else os.environ.copy(), timeout=600)
        return r.returncode, r.stdout + r.stderr


class Package(unittest.TestCase):
    def test_imported_from_outside_the_repository(self):
        repo = os.environ.get("CUARENA_TEST_REPO")
        here = os.path.realpath(cuarena.__file__)
        print(f"\n  cuarena from {here}, library {cuarena.library_path()}", file=sys.stderr)
        if repo:
            self.assertFalse(here.startswith(os.path.realpath(repo) + os.sep),
                             f"cuarena was imported from the repository: {here}")

    def test_the_shipped_library_is_found_without_cuarena_lib(self):
        if os.environ.get("CUARENA_EXPECT_SHIPPED") != "1":
            self.skipTest("CUARENA_EXPECT_SHIPPED is not 1")
        self.assertNotIn("CUARENA_LIB", os.environ)
        pkg = os.path.dirname(os.path.realpath(cuarena.__file__))
        self.assertEqual(os.path.realpath(cuarena.library_path()), os.path.join(pkg, "lib", "libcuarena.so"))

    def test_versions_agree(self):
        self.assertEqual(cuarena.version(), cuarena.__version__)
        major, minor, patch = (int(x) for x in cuarena.__version__.split(".")[:3])
        self.assertEqual(cuarena.load().cuarena_version(), major * 1000000 + minor * 1000 + patch)

    def test_cuarena_lib_naming_no_file_is_an_import_error_naming_it(self):
        old = os.environ.get("CUARENA_LIB")
        os.environ["CUARENA_LIB"] = "/nonexistent/libcuarena.so"
        try:
            with self.assertRaises(ImportError) as cm:
                cuarena.library_path()
            self.assertIsInstance(cm.exception, cuarena.LibraryNotFoundError)
            self.assertIn("/nonexistent/libcuarena.so", str(cm.exception))
        finally:
            if old is None:
                del os.environ["CUARENA_LIB"]
            else:
                os.environ["CUARENA_LIB"] = old

    def test_no_library_anywhere_lists_what_was_tried(self):
        # The package's Python files alone, in a directory that is no checkout.
        with tempfile.TemporaryDirectory() as d:
            src = os.path.dirname(os.path.realpath(cuarena.__file__))
            shutil.copytree(src, os.path.join(d, "cuarena"), ignore=shutil.ignore_patterns("lib", "__pycache__"))
            env = {k: v for k, v in os.environ.items() if k != "CUARENA_LIB"}
            env["PYTHONPATH"] = d
            code, out = run_python("""
                import cuarena
                try:
                    cuarena.load()
                except ImportError as e:
                    print(type(e).__name__, e)
                else:
                    print("loaded")
            """, env)
            self.assertEqual(code, 0, out)
            self.assertIn("LibraryNotFoundError cuarena: libcuarena.so not found. Tried:", out)
            self.assertIn("CUARENA_LIB: not set", out)
            self.assertIn(os.path.join(d, "cuarena", "lib", "libcuarena.so"), out)
            self.assertIn("no repository checkout", out)

    def test_importing_the_glue_modules_imports_neither_torch_nor_cupy(self):
        code, out = run_python("""
            import sys, cuarena.torch, cuarena.cupy
            print("torch" in sys.modules, "cupy" in sys.modules, callable(cuarena.torch.use), callable(cuarena.cupy.use))
        """)
        self.assertEqual((code, out.split()), (0, ["False", "False", "True", "True"]), out)

    def test_stats_struct_has_a_leading_size_and_a_too_small_size_is_refused(self):
        self.assertEqual(ctypes.sizeof(cuarena._Stats), 8 + 8 * len(cuarena._FIELDS))
        s = cuarena._Stats()
        s.size = 16
        s.live_bytes = 77
        self.assertEqual(cuarena.load().cuarena_get_stats(0, ctypes.byref(s)), cuarena._ERR_STATS_SIZE)
        self.assertEqual((s.size, s.live_bytes), (16, 77), "nothing written")
        self.assertIn("out->size is 16", cuarena.last_error())


class Calls(unittest.TestCase):
    def test_stats_is_a_dict_or_raises_cuarenas_message(self):
        if gpu_present():
            s = cuarena.stats()
            self.assertEqual(list(s), cuarena._FIELDS)
            self.assertTrue(all(isinstance(v, int) for v in s.values()))
        else:
            with self.assertRaises(cuarena.CuarenaError) as cm:
                cuarena.stats()
            self.assertIn("no CUDA driver", str(cm.exception))
            self.assertIsInstance(cm.exception, RuntimeError)

    def test_malloc_never_returns_null_for_a_failure(self):
        self.assertEqual(cuarena.malloc(0), 0)
        cuarena.free(0, 0)  # a no-op
        if not gpu_present():
            for size in (1, 4096, 1 << 40):
                with self.assertRaises(cuarena.CuarenaError) as cm:
                    cuarena.malloc(size)
                self.assertIn("no CUDA driver", str(cm.exception))
            with self.assertRaises(cuarena.CuarenaError) as cm:
                cuarena.free(0x1000, 4096)
            self.assertIn("no CUDA driver", str(cm.exception))
            return
        before = cuarena.stats()
        p = cuarena.malloc(4096)
        self.assertNotEqual(p, 0)
        self.assertEqual(p % 256, 0)
        cuarena.free(p, 4096)
        with self.assertRaises(cuarena.CuarenaError) as cm:
            cuarena.free(p, 4096)  # double free
        self.assertIn("invalid free", str(cm.exception))
        with self.assertRaises(cuarena.OutOfMemoryError) as cm:
            cuarena.malloc(1 << 62)
        self.assertIsInstance(cm.exception, MemoryError)
        self.assertIn("out of device memory", str(cm.exception))
        after = cuarena.stats()
        self.assertEqual(after["live_bytes"], before["live_bytes"])
        self.assertGreaterEqual(after["invalid_frees"], before["invalid_frees"] + 1)

    def test_the_torch_shim_compiles_and_calls_this_library(self):
        if shutil.which(os.environ.get("CXX") or "c++") is None:
            self.skipTest("no C++ compiler")
        from cuarena import torch as glue

        with tempfile.TemporaryDirectory() as cache:
            old = os.environ.get("XDG_CACHE_HOME")
            os.environ["XDG_CACHE_HOME"] = cache
            try:
                shim, level = glue._checked_shim()  # raises if it resolved another copy of the library
                self.assertTrue(shim.startswith(cache), shim)
                self.assertEqual(level, 0, "built without PyTorch's headers")
                self.assertEqual(glue.shim_path(), shim, "cached")
                # PyTorch's record_stream hook is the shim's, which raises on a refusal, not
                # libcuarena's silent one; it skips memory cuarena did not reserve.
                hook = glue._record_stream_hook(shim)
                self.assertIsNotNone(hook)
                self.assertNotEqual(hook, cuarena._fn_addr("cuarena_record_stream"))
                ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hook)(0x7000, None)
                ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hook)(None, None)
            finally:
                if old is None:
                    del os.environ["XDG_CACHE_HOME"]
                else:
                    os.environ["XDG_CACHE_HOME"] = old


def _have(module):
    return importlib.util.find_spec(module) is not None


class Frameworks(unittest.TestCase):
    """The three-line switch, each in its own process (needs the framework and a GPU)."""

    def run_with(self, module, code, done):
        """Runs `code` in its own process where `module` and a GPU are there (else skips): it
        must exit 0, print `done`, and print nothing saying "no error" (what it prints where
        an error it expects did not come)."""
        if not _have(module):
            self.skipTest(f"{module} is not installed")
        if not gpu_present():
            self.skipTest("no GPU")
        rc, out = run_python(code)
        self.assertEqual(rc, 0, out)
        self.assertIn(done, out)
        self.assertNotIn("no error", out)

    def test_torch_three_lines(self):
        self.run_with("torch", """
            import torch, cuarena, cuarena.torch
            cuarena.torch.use()
            x = torch.arange(1 << 20, device="cuda", dtype=torch.float64)
            y = (x * 2).sum().item()
            assert y == float((1 << 20) * ((1 << 20) - 1)), y
            s = cuarena.stats()
            assert s["allocations"] >= 2 and s["live_bytes"] > 0, s
            inst = cuarena.torch.use()
            assert inst is cuarena.torch.use()
            # This PyTorch ships its headers: the shim builds with them, and out of memory is
            # PyTorch's own type (what cuDNN's workspace fallback and users' retry loops catch).
            assert inst.oom_error == "torch.OutOfMemoryError", inst
            try:
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
                print("no error for 1 PiB")
            except torch.cuda.OutOfMemoryError as e:
                assert str(e).startswith("CUDA out of memory. cuarena: out of memory"), e
            z = torch.ones(1 << 20, device="cuda")  # and it goes on
            assert int(z.sum().item()) == 1 << 20
            # PyTorch's memory statistics, answered from cuarena's by the shim's own allocator.
            assert inst.torch_stats, inst
            s = cuarena.stats()
            assert torch.cuda.memory_allocated() == s["live_bytes"] > 0, (torch.cuda.memory_allocated(), s)
            assert torch.cuda.memory_reserved() == s["reserved_bytes"], (torch.cuda.memory_reserved(), s)
            assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
            assert torch.cuda.memory_stats()["num_ooms"] == s["ooms"], s
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == 0
            assert isinstance(torch.cuda.memory_summary(), str)
            # cuDNN's benchmark under autocast asks the allocator's cacheInfo.
            torch.backends.cudnn.benchmark = True
            conv = torch.nn.Conv2d(3, 16, 3, padding=1).cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                out = conv(torch.randn(8, 3, 64, 64, device="cuda"))
            assert out.shape == (8, 16, 64, 64) and bool(torch.isfinite(out).all())
            torch.backends.cudnn.benchmark = False
            # PyTorch's fraction 0 (allowed there): nothing more is reserved, then 1 lifts it.
            torch.cuda.set_per_process_memory_fraction(0.0)
            get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # 2.11 has it
            assert get_fraction is None or get_fraction() == 0.0, get_fraction()
            try:
                torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
                print("no error at fraction 0")
            except torch.cuda.OutOfMemoryError as e:
                assert "of a 0 B cap" in str(e), e
            torch.cuda.set_per_process_memory_fraction(1.0)
            assert get_fraction is None or get_fraction() == 1.0, get_fraction()
            assert cuarena.stats()["limit_bytes"] == cuarena.stats()["device_total_bytes"] > 0
            del z
            z = torch.ones(1 << 28, dtype=torch.uint8, device="cuda")
            assert int(z.sum().item()) == 1 << 28
            del x
            print("torch OK", s["allocations"], s["arena_allocations"], s["pool_allocations"])
        """, "torch OK")

    def test_torch_cuda_graphs_capture_into_cuarenas_graph_pools(self):
        """torch.cuda.graph, a second graph sharing its pool, make_graphed_callables and a
        MemPool through the shim's own allocator: captures allocate in cuarena's graph pools
        (they were refused before), replays match eager results while eager allocations churn
        between them, a MemPool's destructor does not abort the process, and nothing is
        refused."""
        self.run_with("torch", """
            import gc, torch, cuarena, cuarena.torch
            inst = cuarena.torch.use()
            assert inst.torch_stats, inst  # the shim's own allocator: graph pools need it
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                        torch.nn.Linear(1024, 256)).cuda()
            static_in = torch.randn(64, 256, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(static_in)
            torch.cuda.current_stream().wait_stream(side)
            reserved0 = torch.cuda.memory_reserved()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = model(static_in)
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2, pool=g.pool()):
                static_out2 = model(static_in * 2)
            for i in range(5):
                x = torch.randn(64, 256, device="cuda")
                static_in.copy_(x)
                g.replay()
                g2.replay()
                junk = [torch.full((1 << k,), float(k), device="cuda") for k in range(8, 24, 3)]
                with torch.no_grad():
                    want, want2 = model(x), model(x * 2)
                assert torch.allclose(static_out, want, rtol=1e-5, atol=1e-5), (i, (static_out - want).abs().max())
                assert torch.allclose(static_out2, want2, rtol=1e-5, atol=1e-5), i
                assert all(bool((j == float(k)).all()) for j, k in zip(junk, range(8, 24, 3)))
                del junk
            # A graphed module with its backward (two captures sharing a pool).
            lin = torch.nn.Linear(128, 128).cuda()
            graphed = torch.cuda.make_graphed_callables(lin, (torch.randn(32, 128, device="cuda", requires_grad=True),))
            xin = torch.randn(32, 128, device="cuda", requires_grad=True)
            graphed(xin).sum().backward()
            w_grad = lin.weight.grad.clone()
            lin.weight.grad = None
            xin2 = xin.detach().clone().requires_grad_(True)
            lin(xin2).sum().backward()
            assert torch.allclose(w_grad, lin.weight.grad, rtol=1e-5, atol=1e-5)
            # torch.cuda.MemPool: its allocations go to a pool of its own, ordinary ones do not.
            pool = torch.cuda.MemPool()
            assert pool.use_count() == 1, pool.use_count()
            with torch.cuda.use_mem_pool(pool):
                t = torch.full((1 << 20,), 3.0, device="cuda")
            u = torch.full((1 << 20,), 4.0, device="cuda")
            assert t.data_ptr() != u.data_ptr() and float(t.sum()) == 3.0 * (1 << 20)
            assert float(u.sum()) == 4.0 * (1 << 20)
            del t, u, pool  # the pool's destructor never throws
            try:
                torch.cuda.MemPool(use_on_oom=True)
                print("no error for use_on_oom")
            except TypeError:
                pass  # a PyTorch without the argument
            except RuntimeError as e:
                assert "use_on_oom" in str(e), e
            torch.cuda.synchronize()
            del g, g2, static_out, static_out2, graphed, xin, w_grad
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            s = cuarena.stats()
            assert s["invalid_frees"] == 0, s
            print("graphs OK", reserved0, torch.cuda.memory_reserved(), s["reserved_bytes"])
        """, "graphs OK")

    def test_torch_compile_reduce_overhead_records_graph_trees_in_cuarenas_pools(self):
        """torch.compile(mode="reduce-overhead") through the shim's own allocator: CUDA graph
        trees record three compiled functions, two of them children of the first on different
        steps, so the tree restores the pool's checkpoint (getCheckpointState and
        setCheckpointPoolState) to record the second child; with PyTorch's slow-path asserts,
        the pool's live blocks must equal the live tensors after every recording and restore
        (checkPoolLiveAllocations). Results match eager ones while eager allocations churn
        between steps, and nothing is refused."""
        self.run_with("torch", """
            import gc, torch, cuarena, cuarena.torch
            inst = cuarena.torch.use()
            assert inst.torch_stats, inst
            import torch._inductor.config as ic
            ic.triton.slow_path_cudagraph_asserts = True
            def f(x): return (x * 2).sin() + 1
            def g(y): return (y @ y.T).relu().sum(dim=1)
            def h(y): return y.cos() * 3 + y.mean()
            cf, cg, ch = (torch.compile(fn, mode="reduce-overhead") for fn in (f, g, h))
            torch.manual_seed(0)
            for step in range(12):
                torch.compiler.cudagraph_mark_step_begin()
                x = torch.randn(256, 256, device="cuda")
                y = cf(x)
                out = cg(y) if step % 3 != 2 else ch(y)
                want = g(f(x)) if step % 3 != 2 else h(f(x))
                assert torch.allclose(out, want, rtol=1e-4, atol=1e-4), (step, (out - want).abs().max())
                junk = [torch.full((1 << k,), float(k), device="cuda") for k in range(8, 22, 3)]
                assert all(bool((j == float(k)).all()) for j, k in zip(junk, range(8, 22, 3)))
                del junk, out, y
            from torch._inductor import cudagraph_trees
            tm = cudagraph_trees.get_container(0).tree_manager
            restores = getattr(tm, "debug_checkpointing_counter", None)
            assert restores is None or restores > 0, restores
            torch.cuda.synchronize()
            s = cuarena.stats()
            assert s["invalid_frees"] == 0, s
            print("reduce-overhead OK", restores, s["reserved_bytes"])
        """, "reduce-overhead OK")

    def test_torch_compile_reduce_overhead_trains_like_eager(self):
        """Training through torch.compile(mode="reduce-overhead") with the shim's own
        allocator: the graph trees record the forward and the backward (a child of the
        forward), replay them for 20 steps with eager allocations between steps, and the losses
        and weights stay close to an eager copy of the model trained alongside."""
        self.run_with("torch", """
            import copy, torch, cuarena, cuarena.torch
            inst = cuarena.torch.use()
            assert inst.torch_stats, inst
            import torch._inductor.config as ic
            ic.triton.slow_path_cudagraph_asserts = True
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(),
                                        torch.nn.Linear(512, 10)).cuda()
            eager = copy.deepcopy(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
            step_fn = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
                                    mode="reduce-overhead")
            for step in range(20):
                torch.compiler.cudagraph_mark_step_begin()
                x = torch.randn(64, 128, device="cuda")
                y = torch.randint(0, 10, (64,), device="cuda")
                loss = step_fn(x, y)
                loss.backward()
                opt.step(); opt.zero_grad(set_to_none=True)
                loss_e = torch.nn.functional.cross_entropy(eager(x), y)
                loss_e.backward()
                opt_e.step(); opt_e.zero_grad(set_to_none=True)
                assert abs(float(loss) - float(loss_e)) < 1e-3, (step, float(loss), float(loss_e))
                junk = [torch.empty(1 << k, device="cuda") for k in range(10, 22, 4)]
                del junk
            for p, q in zip(model.parameters(), eager.parameters()):
                assert torch.allclose(p, q, rtol=1e-3, atol=1e-4), (p - q).abs().max()
            torch.cuda.synchronize()
            s = cuarena.stats()
            assert s["invalid_frees"] == 0, s
            print("reduce-overhead training OK", float(loss))
        """, "reduce-overhead training OK")

    def test_torch_record_stream_past_the_caps_raises_and_foreign_memory_is_skipped(self):
        self.run_with("torch", """
            import ctypes, torch, cuarena, cuarena.torch
            cuarena.torch.use()
            t = torch.ones(1024, device="cuda")
            cuda = ctypes.CDLL("libcuda.so.1")
            handles = []
            for _ in range(1025):
                h = ctypes.c_void_p()
                assert cuda.cuStreamCreate(ctypes.byref(h), 1) == 0  # non-blocking, PyTorch's context
                handles.append(h)
            streams = [torch.cuda.ExternalStream(h.value) for h in handles]
            for s in streams[:1024]:  # cuarena keeps 1,024 streams a block
                t.record_stream(s)
            try:
                t.record_stream(streams[1024])
                print("no error past the cap")
            except RuntimeError as e:
                assert "record_stream not honoured" in str(e) and "the limit" in str(e), e
            # Memory cuarena did not allocate (here the driver's, through the CUDA array
            # interface) is skipped, as PyTorch's own allocator skips it.
            raw = ctypes.c_uint64()
            assert cuda.cuMemAlloc_v2(ctypes.byref(raw), 4096) == 0
            class Foreign:
                __cuda_array_interface__ = {"shape": (1024,), "typestr": "<f4", "data": (raw.value, False),
                                            "version": 2}
            f = torch.as_tensor(Foreign(), device="cuda")
            assert f.data_ptr() == raw.value
            f.record_stream(streams[0])
            del t  # its free is fenced after the 1,024 declared streams
            torch.cuda.synchronize()
            for h in handles:
                assert cuda.cuStreamDestroy_v2(h) == 0
            assert cuarena.stats()["invalid_frees"] == 0
            print("record_stream OK")
        """, "record_stream OK")

    def test_cupy_three_lines(self):
        self.run_with("cupy", """
            import cupy, cuarena, cuarena.cupy
            cuarena.cupy.use()
            x = cupy.arange(1 << 20, dtype=cupy.float64)
            y = float((x * 2).sum())
            assert y == float((1 << 20) * ((1 << 20) - 1)), y
            s = cuarena.stats()
            assert s["allocations"] >= 2 and s["live_bytes"] > 0, s
            try:
                cupy.empty(1 << 50, dtype=cupy.uint8)
                print("no error for 1 PiB")
            except cupy.cuda.memory.OutOfMemoryError as e:
                assert "cuarena" in str(e), e
            print("cupy OK", s["allocations"], s["arena_allocations"], s["pool_allocations"])
        """, "cupy OK")


if __name__ == "__main__":
    unittest.main()
