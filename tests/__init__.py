"""hafiza's tests. Imported before any conftest, so OpenMP's defaults are set before torch loads, as the CLI's
entry point sets them (hafiza/threads.py); processes the tests start inherit them."""

from hafiza.threads import openmp_defaults

openmp_defaults()
