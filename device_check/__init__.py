"""The device check: is the facade right and fast on this device? (It is not a benchmark.)

``python -m device_check --device cuda|cpu --out DIR [--quick] [--sections ...]`` or
``make device-check``; :mod:`device_check.check` describes the sections and the report. It
shares the model sizes, the training loops and the timing helpers of :mod:`benchmarks` through
:mod:`workbench`, and imports nothing of :mod:`benchmarks` itself.
"""
