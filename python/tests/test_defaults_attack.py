"""Adversarial checks of the framework glue's defaults (cuarena_set_defaults, FRAMEWORK_CONF).

The glue warns, after cuarena_set_defaults, when devices' allocators exist already ("were used
through cuarena before the framework glue was installed and keep their configuration"). When both
glues are used in one process (PyTorch and CuPy interop), the second use() finds the device the
first glue's framework made, with the glue's own defaults, and warns that it missed them. Needs a
GPU (without one no allocator is ever made); skipped otherwise. Seen failing on an H100:
"cuarena: 1 device(s) were used through cuarena before the framework glue was installed and keep
their configuration; ..." after cuarena.cupy.use(), an allocation, then cuarena.torch.use().
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuarena  # noqa: E402
from test_framework_conf import run  # noqa: E402


def _gpu():
    try:
        p = cuarena.malloc(256)
    except Exception:  # no driver, no GPU, or no library: nothing to check here
        return False
    cuarena.free(p, 256)
    return True


class DefaultsAttack(unittest.TestCase):
    @unittest.skipUnless(_gpu(), "needs a GPU: without one no device's allocator is ever made")
    def test_the_second_glue_does_not_warn_about_a_device_made_with_its_defaults(self):
        code = """
            import warnings
            cuarena.cupy.use()
            p = cuarena.malloc(1 << 20)   # device 0's allocator, made under the glue's defaults
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                cuarena.torch.use()
            print(repr([str(x.message) for x in w if "keep their configuration" in str(x.message)]))
        """
        out = run(code, None).strip().splitlines()[-1]
        self.assertEqual(eval(out), [], "a device made with the glue's defaults was reported as missing them")


if __name__ == "__main__":
    unittest.main()
