"""Builds the optional C parts; everything else is in pyproject.toml.

    pip install -e .      # without a C compiler (or on Python < 3.11) the build of the extensions is skipped and
                          # distcheck takes its Python paths: the same results, slower

- distcheck/rank/_tracefast.c: the tracer's hot path (about 0.6 to 1.5 µs less a collective);
- distcheck/contract/_frscan.c: torch's Flight Recorder pickles read as columns without unpickling them
  (``distcheck report DUMPS``: about 6 ms for a 20,000-entry ring where loading it whole takes 0.7 s, and it
  reads what a cut-off dump holds).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("distcheck.rank._tracefast", ["distcheck/rank/_tracefast.c"], optional=True),
                   Extension("distcheck.contract._frscan", ["distcheck/contract/_frscan.c"], optional=True,
                             extra_compile_args=["-O2"])])
