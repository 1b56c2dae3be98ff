"""The PEP 517 build backend of the cuarena Python package, in the standard library alone.

`pip install ./python` then needs no network, no setuptools, no wheel and no Rust toolchain (the
GPU machines have none). It builds a wheel of the `cuarena` package and ships, as
`cuarena/lib/libcuarena.so`, the first of:
  1. the file named by CUARENA_LIB (an error if that is not a file);
  2. python/cuarena/lib/libcuarena.so (copied there by hand);
  3. ../target/release/libcuarena.so (a checkout where `cargo build --release` ran).
With a library the wheel is tagged for this platform; without one it is pure Python, and the
package finds the library at run time. `pip install -e ./python` installs a path entry to this
directory instead (the library is then found in the checkout).
"""
import base64
import hashlib
import io
import os
import re
import sys
import sysconfig
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "cuarena"
LIB = "libcuarena.so"


def _project():
    """name, version, description, requires-python and license from pyproject.toml's [project]."""
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not m:
        raise RuntimeError("pyproject.toml has no [project] table")
    fields = dict(re.findall(r'^([A-Za-z-]+)\s*=\s*"([^"]*)"\s*$', m.group(1), re.M))
    for key in ("name", "version"):
        if key not in fields:
            raise RuntimeError(f"pyproject.toml's [project] has no {key}")
    return fields


def shipped_library():
    """The libcuarena.so to ship, or None (see the module's doc)."""
    env = os.environ.get("CUARENA_LIB")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(f"CUARENA_LIB={env!r} is not a file: it names the libcuarena.so to ship")
        return os.path.abspath(env)
    for cand in (os.path.join(HERE, PACKAGE, "lib", LIB), os.path.join(HERE, "..", "target", "release", LIB)):
        if os.path.isfile(cand):
            return os.path.abspath(cand)
    return None


def _package_files():
    """(path in the wheel, path on disk) for the package's sources."""
    out = []
    root = os.path.join(HERE, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "lib"))
        for name in sorted(filenames):
            if name.endswith((".py", ".cpp")):
                full = os.path.join(dirpath, name)
                out.append((os.path.relpath(full, HERE).replace(os.sep, "/"), full))
    return out


def _dist_name(p):
    return re.sub(r"[-_.]+", "_", p["name"]).lower()


def _metadata(p):
    lines = ["Metadata-Version: 2.1", f"Name: {p['name']}", f"Version: {p['version']}"]
    if "description" in p:
        lines.append(f"Summary: {p['description']}")
    if "requires-python" in p:
        lines.append(f"Requires-Python: {p['requires-python']}")
    if "license" in p:
        lines.append(f"License: {p['license']}")
    readme = os.path.join(HERE, p.get("readme", "README.md"))
    body = ""
    if os.path.isfile(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _write_wheel(wheel_directory, files, tag, purelib):
    """Writes a wheel of `files` ((arcname, bytes)) plus its .dist-info; returns its file name."""
    p = _project()
    dist = f"{_dist_name(p)}-{p['version']}"
    info = f"{dist}.dist-info"
    wheel = (f"Wheel-Version: 1.0\nGenerator: cuarena _cuarena_build\n"
             f"Root-Is-Purelib: {'true' if purelib else 'false'}\nTag: {tag}\n")
    files = list(files) + [(f"{info}/METADATA", _metadata(p).encode()), (f"{info}/WHEEL", wheel.encode()),
                           (f"{info}/top_level.txt", f"{PACKAGE}\n".encode())]
    record = [_record_line(name, data) for name, data in files] + [f"{info}/RECORD,,"]
    files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
    name = f"{dist}-{tag}.whl"
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in files:
            zi = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if arcname.endswith(".so") else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return name


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _platform_tag():
    return re.sub(r"[-.]", "_", sysconfig.get_platform())


# PEP 517 hooks ---------------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = [(arc, _read(path)) for arc, path in _package_files()]
    lib = shipped_library()
    if lib is None:
        print("cuarena: no libcuarena.so shipped (set CUARENA_LIB, or copy one to python/cuarena/lib/); "
              "the package will need CUARENA_LIB at run time", file=sys.stderr)
        return _write_wheel(wheel_directory, files, "py3-none-any", purelib=True)
    print(f"cuarena: shipping {lib} as {PACKAGE}/lib/{LIB}", file=sys.stderr)
    files.append((f"{PACKAGE}/lib/{LIB}", _read(lib)))
    return _write_wheel(wheel_directory, files, f"py3-none-{_platform_tag()}", purelib=False)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(f"_{PACKAGE}_editable.pth", (HERE + "\n").encode())], "py3-none-any",
                        purelib=True)


def build_sdist(sdist_directory, config_settings=None):
    p = _project()
    base = f"{_dist_name(p)}-{p['version']}"
    members = [(arc, _read(path)) for arc, path in _package_files()]
    for name in ("pyproject.toml", "_cuarena_build.py", "README.md"):
        if os.path.isfile(os.path.join(HERE, name)):
            members.append((name, _read(os.path.join(HERE, name))))
    members.append(("PKG-INFO", _metadata(p).encode()))
    name = f"{base}.tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as t:
        for arc, data in members:
            ti = tarfile.TarInfo(f"{base}/{arc}")
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 1577836800
            t.addfile(ti, io.BytesIO(data))
    return name
