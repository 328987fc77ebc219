"""Test-only hooks and tools, kept apart from the serving code.

- ``worker_hooks``: hold the worker before loading or at each step, or slow its steps
  (``PYSERVE_TEST_HOOK_*`` switches, named in pyserve/worker/env.py);
- ``engine_hooks``: leak KV blocks on purpose so that the idle self-check has something to find
  (``PYSERVE_TEST_HOOK_LEAK_KV_BLOCKS``, named in pyserve/engine/idle_check.py);
- ``load_probe``: ``python -m pyserve.testing.load_probe MODEL`` prints the memory a load takes;
- ``kv_fill``: random contents for a paged KV cache (attention tests and benchmarks).

Production code reads the switches itself and imports from here only inside the branch where
one is set (a lazy import), never at the top of a module, so serving never loads this package.
"""
