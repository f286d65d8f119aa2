"""The live-change suite: how fast a ``ctl set`` or ``reload`` is in force.

- ``live_report``: its record, headline rows, REPORT.md section and plot
- ``writes``: the runner: a parked writer, a stepped cap and ``qosfs ctl status`` timed
"""
