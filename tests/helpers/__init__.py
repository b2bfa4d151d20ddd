"""Helpers the tests share, as modules (fixtures and pytest hooks stay in conftest.py):

* ``helpers.jobs``     — compose the real ``conf/``, launch real processes (torchrun and its command line,
  ``python train.py``),
  a run crashed after step N, read TensorBoard back;
* ``helpers.counting`` — per-step collective/sync counts of a job, and the budget they must keep;
* ``helpers.compare``  — one bitwise comparison of checkpoints (and any nesting of tensors), and what a run
  leaves read back (load, last_weights, result);
* ``helpers.study``    — a small study's overrides, its workers as real processes, what trials record;
* ``helpers.extras``   — the optional extras (hf, mlflow): a module skipped where one is missing, found
  without importing it (collection stays quick).
"""
