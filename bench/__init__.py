"""qosfs benchmarks: fio job files (``bench/jobs/``) and a runner (``python -m bench``).

Every figure is a ratio against a baseline measured in the same run (bench/README.md;
bench/ANALYSIS.md reads the headline).
"""
