"""The build of kvroute's one C extension; everything else is in pyproject.toml.

`hashing._block_table` (hashing/_block_table.c) is the prefix index's storage: every
backend's block keys in flat arrays, 50-70 bytes a (key, backend) pair instead of ~240 in
Python dicts, out of the garbage collector's passes, in one file a host's processes
share. Plain C against the CPython API, built by any C compiler with Python's headers.
Declared here rather than in pyproject.toml, where setuptools still calls extension
modules experimental.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hashing._block_table",
            sources=["hashing/_block_table.c"],
            extra_compile_args=["-O2", "-std=c11", "-pthread"],
            extra_link_args=["-pthread"],  # the shared table's lock, on a glibc before 2.34
        )
    ]
)
