"""Rack-scale planner: a calibrated performance model of DeepSeek-V4-class serving and a
search over P/D ratios, DEP sizes, batch sizes and draft depths (docs/planner.md).

Modules: ``hardware`` (GPU and link specs), ``models`` (V4 / V4.1 / V3 presets),
``counting`` (bytes and FLOPs per op of one step), ``cost`` (roofline + efficiencies +
calibration), ``comm`` (all-to-all, KV transfer, imbalance), ``simulate`` (instance step
times), ``search`` (xPyD search and Pareto frontier), ``cli`` (`rackserve plan`).
"""
