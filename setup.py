# The C kernels are built by cffi at install time; all other metadata lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["lifl/_build_kernels.py:ffibuilder"])
