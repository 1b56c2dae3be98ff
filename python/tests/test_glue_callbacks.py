"""The glue's own logic around the library's calls, without a GPU (the library's calls are
replaced by recorders):
- a CuPy block of a per-thread stream (0x2) dropped on another thread is freed on the legacy
  stream; on its own thread, and for any other stream, on the stream it was allocated on;
- a CuPy block whose free a graph capture refuses is held with its stream and freed by
  release_held() once the capture has ended (on the legacy stream for another thread's 0x2);
  a free refused for any other reason is not held;
- the OOM callback calls the hook set last, lets a replaced hook go, never raises (even with
  warnings turned into errors), and returns 0 once nothing is set.
"""
import gc
import threading
import unittest
import warnings
import weakref

import cuarena
import cuarena.cupy as glue


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr


class CupyBlocks(unittest.TestCase):
    def setUp(self):
        self.freed = []
        self.saved = glue._Block._free
        self.capturing = False
        self.saved_error = glue.last_error
        self.error = None
        glue.last_error = lambda: self.error

        def free(ptr, size, dev, stream):
            # cuarena_free_checked: -1 while "capturing", with the library's capture message.
            if self.capturing:
                self.error = f"stream {stream:#x} is being captured into a CUDA graph: ..."
                return -1
            self.freed.append((ptr, stream))
            return 0

        glue._Block._free = free

    def tearDown(self):
        glue._Block._free = self.saved
        glue.last_error = self.saved_error
        glue._held.clear()

    def make_and_drop_elsewhere(self, ptr, stream):
        """A block made on this thread, whose only reference goes on another thread."""
        box = [glue._Block(ptr, 256, 0, _Stream(stream))]
        t = threading.Thread(target=box.clear)
        t.start()
        t.join()
        self.assertEqual(box, [])

    def test_a_per_thread_stream_block_dropped_elsewhere_is_freed_on_the_legacy_stream(self):
        self.make_and_drop_elsewhere(0x1000, 2)
        gc.collect()
        self.assertEqual(self.freed, [(0x1000, 1)])

    def test_a_block_dropped_on_its_own_thread_or_of_another_stream_keeps_its_stream(self):
        own = glue._Block(0x2000, 256, 0, _Stream(2))
        del own
        for s in (0, 1, 0xABC000):
            self.make_and_drop_elsewhere(0x3000 + s, s)
        gc.collect()
        self.assertEqual(self.freed, [(0x2000, 2), (0x3000, 0), (0x3001, 1), (0x3000 + 0xABC000, 0xABC000)])


    def test_a_free_refused_by_a_capture_is_held_and_made_after_it(self):
        self.capturing = True
        glue._Block(0x4000, 256, 0, _Stream(0xABC000))
        gc.collect()
        self.assertEqual(self.freed, [])
        self.assertEqual(len(glue._held), 1)
        self.assertEqual(glue.release_held(), 1)  # still capturing: held again
        self.capturing = False
        self.assertEqual(glue.release_held(), 0)
        self.assertEqual(self.freed, [(0x4000, 0xABC000)])
        self.assertEqual(glue.release_held(), 0)
        self.assertEqual(self.freed, [(0x4000, 0xABC000)], "a held free was made twice")

    def test_a_held_per_thread_stream_free_made_on_another_thread_uses_the_legacy_stream(self):
        self.capturing = True
        glue._Block(0x5000, 256, 0, _Stream(2))
        gc.collect()
        self.capturing = False
        t = threading.Thread(target=glue.release_held)
        t.start()
        t.join()
        self.assertEqual(self.freed, [(0x5000, 1)])

    def test_a_free_refused_for_another_reason_is_not_held(self):
        glue._Block._free = lambda ptr, size, dev, stream: -1
        self.error = "invalid free of 0x6000 (256 bytes): double free"
        glue._Block(0x6000, 256, 0, _Stream(0xABC000))
        gc.collect()
        self.assertEqual(glue._held, [])


class OomCallback(unittest.TestCase):
    def tearDown(self):
        cuarena._oom_fns.clear()

    def test_calls_the_hook_set_last_and_lets_a_replaced_one_go(self):
        class Spiller:
            def __init__(self, answer):
                self.answer, self.calls = answer, []

            def on_oom(self, requested, dev):
                self.calls.append((requested, dev))
                return self.answer

        first, second = Spiller(True), Spiller(False)
        cuarena._oom_fns[0] = first.on_oom
        self.assertEqual(cuarena._oom_call(64, 0, None), 1)
        gone = weakref.ref(first)
        cuarena._oom_fns[0] = second.on_oom  # what set_oom_hook does under its lock
        del first
        gc.collect()
        self.assertIsNone(gone(), "a replaced hook is still held")
        self.assertEqual(cuarena._oom_call(32, 0, None), 0)
        self.assertEqual(second.calls, [(32, 0)])
        self.assertEqual(cuarena._oom_call(32, 1, None), 0, "no hook on device 1")

    def test_never_raises_even_with_warnings_as_errors(self):
        cuarena._oom_fns[0] = lambda requested, dev: 1 / 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertEqual(cuarena._oom_call(64, 0, None), 0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertEqual(cuarena._oom_call(64, 0, None), 0)
        self.assertTrue(any("ZeroDivisionError" in str(x.message) for x in w), [str(x.message) for x in w])


if __name__ == "__main__":
    unittest.main()
