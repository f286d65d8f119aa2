"""The training suite: DLIO's emulated training under a PyTorch checkpoint storm.

- ``au_report``: its record, headline rows, REPORT.md section and plot
- ``ckpt_storm``: the storm's rank processes (``python -m bench.suites.training.ckpt_storm``)
- ``dlio_entry``: DLIO's entry point without TensorFlow (run under ``mpiexec``)
- ``workload``: the runner: DLIO's workload, the scenarios, the checkpoint plan check
"""
